//! The library's fine rules as data: a versioned policy per item class ([`PolicyVersion`], the rows of
//! `fine_policies`), the closed days ([`ClosedDays`]), and the rule that prices a loan under them ([`Policy`]).
//!
//! This is the Rust side of the one definition; the SQL side is migrations/20261203000053 (functions
//! `fine_settler_policy_of`, `fine_settler_policy_day_amount`, `fine_settler_policy_fine`, …). A property test
//! against the database (tests/it/policy.rs) holds them equal over random loans, policies and calendars.
//!
//! A day `D` is **chargeable** for a loan when `due_on + grace < D` (grace counts calendar days), the loan was
//! not returned before `D`, and `D` is not closed — unless the policy charges closed days. The settled fine is
//! `min(cap, rate × chargeable days in (due_on + grace, returned_on])`; the k-th chargeable day (k = 0 for the
//! first) owes `clamp(cap − rate·k, 0, rate)`, any other day 0, so a returned loan's days add up to its fine.

mod class;
mod closed_days;

use chrono::{DateTime, NaiveDate, Utc};

pub use class::{ClassError, FineClass, DEFAULT_CLASS, MAX_CLASS_CHARS};
pub use closed_days::ClosedDays;

use crate::fine::{Cents, FinePolicy};

/// One policy: rate, grace, cap ([`FinePolicy`], validated) and whether closed days are charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub fine: FinePolicy,
    pub charge_closed_days: bool,
}

impl Policy {
    /// The chargeable days in `(after, through]` for a loan whose grace period ends on `after` and which was out
    /// on every day of the span: its length less its closed days, unless closed days are charged.
    pub fn chargeable_days(&self, closed: &ClosedDays, after: NaiveDate, through: NaiveDate) -> i64 {
        if through <= after {
            return 0;
        }
        let days = (through - after).num_days();
        if self.charge_closed_days {
            days
        } else {
            days - closed.in_span(after, through)
        }
    }

    /// The last day of the grace period of a loan due on `due_on`: `due_on + grace`, when there is a later day
    /// (`None` past chrono's last date, where no day can be chargeable).
    fn grace_ends(&self, due_on: NaiveDate) -> Option<NaiveDate> {
        let grace = u64::try_from(self.fine.grace_days()).unwrap_or(0);
        due_on.checked_add_days(chrono::Days::new(grace))
    }

    /// The canonical amount of `day` for a loan due on `due_on` and returned on `returned_on` (if it was): what
    /// the ledger's net for that (loan, day) must be. SQL: `fine_settler_policy_day_amount`.
    pub fn day_amount(
        &self,
        closed: &ClosedDays,
        due_on: NaiveDate,
        returned_on: Option<NaiveDate>,
        day: NaiveDate,
    ) -> Cents {
        let grace = self.fine.grace_days();
        if (day - due_on).num_days() <= grace || returned_on.is_some_and(|r| day > r) {
            return Cents::ZERO;
        }
        if !self.charge_closed_days && closed.is_closed(day) {
            return Cents::ZERO;
        }
        let rate = self.fine.daily_rate().get();
        let Some(cap) = self.fine.cap() else {
            return self.fine.daily_rate();
        };
        let (Some(after), Some(before)) = (self.grace_ends(due_on), day.pred_opt()) else {
            return Cents::ZERO;
        };
        // Chargeable days before this one; rate <= 10^8 and days < 2^31 keep the product inside i64, and it
        // saturates rather than wraps should it not.
        let charged_before = rate.saturating_mul(self.chargeable_days(closed, after, before));
        Cents::new(cap.get().saturating_sub(charged_before).clamp(0, rate)).unwrap_or(Cents::ZERO)
    }

    /// The fine settlement sets for a loan due on `due_on` and returned on `returned_on`:
    /// `min(cap, rate × chargeable days in (due_on + grace, returned_on])`. SQL: `fine_settler_policy_fine`.
    pub fn fine(&self, closed: &ClosedDays, due_on: NaiveDate, returned_on: NaiveDate) -> Cents {
        if (returned_on - due_on).num_days() <= self.fine.grace_days() {
            return Cents::ZERO;
        }
        let Some(after) = self.grace_ends(due_on) else {
            return Cents::ZERO;
        };
        let days = self.chargeable_days(closed, after, returned_on);
        let total = self.fine.daily_rate().get().saturating_mul(days);
        let capped = match self.fine.cap() {
            Some(cap) => total.min(cap.get()),
            None => total,
        };
        Cents::new(capped).unwrap_or(Cents::ZERO)
    }
}

/// One row of `fine_policies`: the policy of a class for loans due from `effective_from` on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyVersion {
    pub class: FineClass,
    pub effective_from: NaiveDate,
    pub policy: Policy,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
    pub reason: String,
}

impl PolicyVersion {
    /// The JSON fields `policy list --json` prints, named as the table's columns.
    pub fn json(&self) -> serde_json::Value {
        let f = &self.policy.fine;
        serde_json::json!({
            "fine_class": self.class.as_str(),
            "effective_from": self.effective_from,
            "daily_rate_cents": f.daily_rate().get(),
            "grace_days": f.grace_days(),
            "cap_cents": f.cap().map_or(0, Cents::get),
            "charge_closed_days": self.policy.charge_closed_days,
            "created_at": self.created_at,
            "created_by": self.created_by,
            "reason": self.reason,
        })
    }
}

/// The policy that governs a loan of class `class` (none: `default`) due on `due_on`, among `versions`: the
/// version of its class with the latest `effective_from <= due_on`, else the `default` class's. `None` when not
/// even `default` has one for that date. SQL: `fine_settler_policy_of`.
pub fn governing<'v>(
    versions: &'v [PolicyVersion],
    class: Option<&str>,
    due_on: NaiveDate,
) -> Option<&'v PolicyVersion> {
    let latest = |name: &str| {
        versions
            .iter()
            .filter(|v| v.class.as_str() == name && v.effective_from <= due_on)
            .max_by_key(|v| v.effective_from)
    };
    class.and_then(latest).or_else(|| latest(DEFAULT_CLASS))
}

#[cfg(test)]
mod tests;
