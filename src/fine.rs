//! The fine policy: how many cents a loan returned late owes. Pure and overflow-safe.
//!
//! `fine = min(cap, max(0, days_late - grace_days) * daily_rate)`, where `days_late = returned_on - due_on`.
//! Every step is checked arithmetic. Validated settings keep the daily rate at most [`MAX_DAILY_RATE_CENTS`], so
//! no date difference PostgreSQL can represent (its `date - date` is a 32-bit integer) overflows an `i64`; the
//! checks remain as the last line of defence and report an error rather than wrap.

use std::fmt;

/// The largest accepted daily rate: 100,000,000 cents (one million currency units) a day. With at most
/// `i32::MAX` days late the product stays below `2.2e17`, far inside `i64`.
pub const MAX_DAILY_RATE_CENTS: i64 = 100_000_000;

/// The largest accepted grace period, in days (about 100 years).
pub const MAX_GRACE_DAYS: i64 = 36_525;

/// An amount of money in cents, never negative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cents(i64);

impl Cents {
    pub const ZERO: Cents = Cents(0);

    /// A non-negative amount; `None` for a negative one.
    pub fn new(cents: i64) -> Option<Self> {
        (cents >= 0).then_some(Cents(cents))
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for Cents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Why a fine could not be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FineError {
    /// The product of chargeable days and the daily rate does not fit in an `i64`, and no cap bounds it.
    #[error("fine overflows 64-bit cents: {days} chargeable days at {rate} cents a day")]
    Overflow { days: i64, rate: i64 },
}

/// The validated fine policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinePolicy {
    daily_rate: Cents,
    grace_days: i64,
    cap: Option<Cents>,
}

/// Why a fine policy was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The daily rate is negative or above [`MAX_DAILY_RATE_CENTS`].
    #[error("must be between 0 and {MAX_DAILY_RATE_CENTS}, got {0}")]
    Rate(i64),
    /// The grace period is negative or above [`MAX_GRACE_DAYS`].
    #[error("must be between 0 and {MAX_GRACE_DAYS}, got {0}")]
    Grace(i64),
    /// The cap is negative (0 means "no cap").
    #[error("must be 0 (no cap) or positive, got {0}")]
    Cap(i64),
}

impl FinePolicy {
    /// The documented defaults: 100 cents a day, no grace, no cap.
    pub const DEFAULT: FinePolicy = FinePolicy {
        daily_rate: Cents(100),
        grace_days: 0,
        cap: None,
    };

    /// Builds a policy; `cap_cents = 0` means no cap, as in the configuration file.
    pub fn new(daily_rate_cents: i64, grace_days: i64, cap_cents: i64) -> Result<Self, PolicyError> {
        if !(0..=MAX_DAILY_RATE_CENTS).contains(&daily_rate_cents) {
            return Err(PolicyError::Rate(daily_rate_cents));
        }
        if !(0..=MAX_GRACE_DAYS).contains(&grace_days) {
            return Err(PolicyError::Grace(grace_days));
        }
        let cap = match cap_cents {
            0 => None,
            c if c > 0 => Some(Cents(c)),
            c => return Err(PolicyError::Cap(c)),
        };
        Ok(FinePolicy {
            daily_rate: Cents(daily_rate_cents),
            grace_days,
            cap,
        })
    }

    pub fn daily_rate(&self) -> Cents {
        self.daily_rate
    }

    pub fn grace_days(&self) -> i64 {
        self.grace_days
    }

    pub fn cap(&self) -> Option<Cents> {
        self.cap
    }

    /// The fine for a loan returned `days_late` days after its due date (negative when returned early).
    pub fn fine(&self, days_late: i64) -> Result<Cents, FineError> {
        // saturating_sub: days_late is bounded by i32 in practice, but the policy must hold for any input.
        let chargeable = days_late.saturating_sub(self.grace_days).max(0);
        let rate = self.daily_rate.get();
        match (chargeable.checked_mul(rate), self.cap) {
            (Some(fine), None) => Ok(Cents(fine)),
            (Some(fine), Some(cap)) => Ok(Cents(fine.min(cap.get()))),
            // The exact product exceeds i64::MAX, so it certainly exceeds any cap.
            (None, Some(cap)) => Ok(cap),
            (None, None) => Err(FineError::Overflow {
                days: chargeable,
                rate,
            }),
        }
    }
}

impl FinePolicy {
    /// The canonical accrual amount of `day` for a loan due on `due_on` and returned on `returned_on` (if it
    /// was): what the ledger's net for that (loan, day) must be. A function of the loan and the policy alone, so
    /// that the order in which days are charged never changes what each day holds.
    ///
    /// `day` is owed when `due_on + grace_days < day` and the loan was not returned before it; the k-th owed day
    /// (k = 0 for the first) is charged `clamp(cap - rate * k, 0, rate)` — the earliest days in full, the day
    /// that reaches the cap the remainder, nothing after. Summed over a returned loan's owed days this is
    /// [`FinePolicy::fine`]. The SQL function `fine_settler_day_amount` (migrations/20261202000012) is the same
    /// rule; a property test against the database holds them equal.
    pub fn day_amount(
        &self,
        due_on: chrono::NaiveDate,
        returned_on: Option<chrono::NaiveDate>,
        day: chrono::NaiveDate,
    ) -> Cents {
        let after_due = (day - due_on).num_days();
        if after_due <= self.grace_days || returned_on.is_some_and(|r| day > r) {
            return Cents::ZERO;
        }
        let rate = self.daily_rate.get();
        let Some(cap) = self.cap else {
            return Cents(rate);
        };
        // Owed days before this one; the product stays far inside i64 (rate <= 10^8, days < 2^31), and
        // saturates rather than wraps should it not.
        let before = after_due - self.grace_days - 1;
        let charged_before = rate.saturating_mul(before);
        Cents(cap.get().saturating_sub(charged_before).clamp(0, rate))
    }
}

impl Default for FinePolicy {
    fn default() -> Self {
        FinePolicy::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn policy(rate: i64, grace: i64, cap: i64) -> FinePolicy {
        FinePolicy::new(rate, grace, cap).expect("valid policy")
    }

    proptest! {
        /// The days of a returned loan, each at its canonical amount, add up to the fine settlement sets —
        /// whatever the policy — so the ledger and the month-end settlement agree.
        #[test]
        fn day_amounts_add_up_to_the_fine(
            rate in 0i64..5_000, grace in 0i64..10, cap in prop_oneof![Just(0i64), 1i64..20_000],
            late in -5i64..60,
        ) {
            let p = policy(rate, grace, cap);
            let due = chrono::NaiveDate::from_ymd_opt(2026, 10, 20).expect("a date");
            let returned = due + chrono::Duration::days(late);
            let total: i64 = (-3..late + 5)
                .map(|k| p.day_amount(due, Some(returned), due + chrono::Duration::days(k)).get())
                .sum();
            prop_assert_eq!(total, p.fine(late).expect("a fine").get());
        }
    }

    #[test]
    fn defaults_charge_a_hundred_cents_a_day() {
        let p = FinePolicy::default();
        assert_eq!(p.fine(0), Ok(Cents::ZERO));
        assert_eq!(p.fine(-5), Ok(Cents::ZERO));
        assert_eq!(p.fine(1), Ok(Cents(100)));
        assert_eq!(p.fine(30), Ok(Cents(3000)));
    }

    #[test]
    fn grace_days_are_free_and_cap_bounds_the_fine() {
        let p = policy(100, 3, 1000);
        assert_eq!(p.fine(3), Ok(Cents::ZERO));
        assert_eq!(p.fine(4), Ok(Cents(100)));
        assert_eq!(p.fine(13), Ok(Cents(1000)));
        assert_eq!(p.fine(500), Ok(Cents(1000)));
    }

    #[test]
    fn rejects_out_of_range_settings() {
        assert_eq!(FinePolicy::new(-1, 0, 0), Err(PolicyError::Rate(-1)));
        assert_eq!(
            FinePolicy::new(MAX_DAILY_RATE_CENTS + 1, 0, 0),
            Err(PolicyError::Rate(100_000_001))
        );
        assert_eq!(FinePolicy::new(100, -1, 0), Err(PolicyError::Grace(-1)));
        assert_eq!(FinePolicy::new(100, 0, -1), Err(PolicyError::Cap(-1)));
    }

    #[test]
    fn extreme_inputs_never_wrap() {
        let uncapped = FinePolicy {
            daily_rate: Cents(i64::MAX),
            grace_days: 0,
            cap: None,
        };
        assert!(matches!(uncapped.fine(2), Err(FineError::Overflow { .. })));
        let capped = FinePolicy {
            daily_rate: Cents(i64::MAX),
            grace_days: 0,
            cap: Some(Cents(7)),
        };
        assert_eq!(capped.fine(2), Ok(Cents(7)));
        assert_eq!(policy(1, MAX_GRACE_DAYS, 0).fine(i64::MIN), Ok(Cents::ZERO));
    }

    #[test]
    fn validated_rates_cannot_overflow_on_any_postgres_date_difference() {
        let p = policy(MAX_DAILY_RATE_CENTS, 0, 0);
        assert!(p.fine(i64::from(i32::MAX)).is_ok());
    }

    proptest! {
        #[test]
        fn fine_matches_the_formula(
            rate in 0..=MAX_DAILY_RATE_CENTS,
            grace in 0..=MAX_GRACE_DAYS,
            cap in 0i64..=i64::MAX,
            days in i64::from(i32::MIN)..=i64::from(i32::MAX),
        ) {
            let p = policy(rate, grace, cap);
            let exact = i128::from((days - grace).max(0)) * i128::from(rate);
            let expected = if cap == 0 { exact } else { exact.min(i128::from(cap)) };
            prop_assert_eq!(p.fine(days).map(|c| i128::from(c.get())), Ok(expected));
        }

        #[test]
        fn fine_is_monotone_in_days_late(rate in 0..=1000i64, grace in 0..=30i64, cap in 0..=100_000i64,
                                         days in -1000..=100_000i64) {
            let p = policy(rate, grace, cap);
            prop_assert!(p.fine(days)? <= p.fine(days + 1)?);
        }
    }
}
