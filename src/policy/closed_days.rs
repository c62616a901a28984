//! [`ClosedDays`]: the library's closed days (`library_closed_days`) as a calendar the fine rules count with.

use std::collections::BTreeSet;

use chrono::NaiveDate;

/// The days the library is closed, in order. Counting the closed days of a span is a search, never a walk over
/// the span, as the SQL side's ordinals make it two index probes (migrations/20261203000052).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClosedDays {
    /// Sorted, without repeats.
    days: Vec<NaiveDate>,
}

impl ClosedDays {
    /// A calendar closed on `days` (in any order; repeats count once).
    pub fn new(days: impl IntoIterator<Item = NaiveDate>) -> Self {
        let days: BTreeSet<NaiveDate> = days.into_iter().collect();
        ClosedDays {
            days: days.into_iter().collect(),
        }
    }

    /// Whether the library is closed on `day`.
    pub fn is_closed(&self, day: NaiveDate) -> bool {
        self.days.binary_search(&day).is_ok()
    }

    /// How many closed days there are up to and including `day` (SQL: `fine_settler_closed_through`).
    pub fn through(&self, day: NaiveDate) -> i64 {
        // At most a few thousand days: the count always fits.
        i64::try_from(self.days.partition_point(|d| *d <= day)).unwrap_or(i64::MAX)
    }

    /// How many closed days lie in `(after, through]` (0 for an empty span).
    pub fn in_span(&self, after: NaiveDate, through: NaiveDate) -> i64 {
        if through <= after {
            return 0;
        }
        self.through(through) - self.through(after)
    }

    /// The closed days, in order.
    pub fn days(&self) -> &[NaiveDate] {
        &self.days
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> NaiveDate {
        s.parse().expect("a date")
    }

    #[test]
    fn counts_closed_days_in_half_open_spans() {
        let c = ClosedDays::new([d("2026-11-15"), d("2026-11-01"), d("2026-11-08"), d("2026-11-08")]);
        assert_eq!(c.days().len(), 3);
        assert!(c.is_closed(d("2026-11-08")));
        assert!(!c.is_closed(d("2026-11-09")));
        assert_eq!(c.through(d("2026-10-31")), 0);
        assert_eq!(c.through(d("2026-11-08")), 2);
        assert_eq!(c.in_span(d("2026-11-01"), d("2026-11-15")), 2);
        assert_eq!(c.in_span(d("2026-10-31"), d("2026-11-01")), 1);
        assert_eq!(c.in_span(d("2026-11-15"), d("2026-11-01")), 0);
    }
}
