//! Deterministic demo loans: a fixed seed always gives the same loans, with on-time, late and unreturned ones
//! around a chosen month. Used by the demo, the tests and the benchmark.

use chrono::{Duration, NaiveDate};

use crate::{calendar, store::loans::NewLoan};

/// SplitMix64: a tiny, well-distributed generator; the demo needs reproducibility, not cryptography.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// What to generate.
#[derive(Debug, Clone, Copy)]
pub struct DemoSpec {
    pub loans: u64,
    pub seed: u64,
    /// Any day of the month the loans cluster around.
    pub month: NaiveDate,
    /// The id of the first loan; ids are consecutive.
    pub first_id: i64,
}

/// The loans of `spec`, in id order. Borrowed from 45 days before the month to its end; due 14, 21 or 30 days
/// later; 15 % unreturned, 45 % returned on time, 40 % returned 1 to 60 days late.
pub fn loans(spec: DemoSpec) -> impl Iterator<Item = NewLoan> {
    let start = calendar::month_start(spec.month) - Duration::days(45);
    let span = (calendar::month_end(spec.month) - start).num_days() + 1;
    let mut rng = SplitMix64::new(spec.seed);
    (0..spec.loans).map(move |i| {
        let borrowed_on = start + Duration::days(rng.below(span as u64) as i64);
        let due_on = borrowed_on + Duration::days([14, 21, 30][rng.below(3) as usize]);
        let returned_on = match rng.below(100) {
            0..=14 => None,
            15..=59 => {
                let early = (due_on - borrowed_on).num_days() as u64;
                Some(due_on - Duration::days(rng.below(early + 1) as i64))
            }
            _ => Some(due_on + Duration::days(1 + rng.below(60) as i64)),
        };
        NewLoan {
            id: spec.first_id + i as i64,
            member_id: 1 + rng.below(5_000) as i64,
            book_id: 1 + rng.below(20_000) as i64,
            borrowed_on,
            due_on,
            returned_on,
        }
    })
}

/// Inserts the loans of `spec` (`demo-data`), 10,000 per statement; loans whose id exists are left alone.
/// Returns how many were inserted.
pub async fn insert(pool: &crate::store::Db, spec: DemoSpec) -> Result<u64, sqlx::Error> {
    let mut inserted = 0;
    let mut chunk = Vec::with_capacity(10_000);
    for loan in loans(spec) {
        chunk.push(loan);
        if chunk.len() == 10_000 {
            inserted += crate::store::loans::insert_new(pool, &chunk).await?;
            chunk.clear();
        }
    }
    inserted += crate::store::loans::insert_new(pool, &chunk).await?;
    Ok(inserted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_loans_with_every_kind() {
        let spec = DemoSpec {
            loans: 2000,
            seed: 42,
            month: "2026-10-01".parse().expect("date"),
            first_id: 1,
        };
        let a: Vec<_> = loans(spec).collect();
        let b: Vec<_> = loans(spec).collect();
        assert_eq!(a, b);
        assert!(a.iter().any(|l| l.returned_on.is_none()));
        assert!(a.iter().any(|l| l.returned_on.is_some_and(|r| r <= l.due_on)));
        assert!(a.iter().any(|l| l.returned_on.is_some_and(|r| r > l.due_on)));
        assert!(a
            .iter()
            .all(|l| l.due_on > l.borrowed_on && l.returned_on.is_none_or(|r| r >= l.borrowed_on)));
        let other: Vec<_> = loans(DemoSpec { seed: 43, ..spec }).collect();
        assert_ne!(a, other);
    }
}
