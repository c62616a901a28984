//! Business dates: months, month ends and the local date in the configured zone. Pure functions.
//!
//! The month-end settlement's business date is the last day of the month it settles; it becomes due once the
//! local date (in `time.zone`) has reached the following month. Dates are limited to years 1..=9999: the range
//! every component (chrono, PostgreSQL, ISO 8601 text) handles without special cases.

use chrono::{DateTime, Datelike, Months, NaiveDate, TimeZone, Utc};
use chrono_tz::Tz;

/// Why a date was rejected as a business date.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CalendarError {
    /// The date lies outside years 1..=9999.
    #[error("{0} is out of range (years 1 to 9999)")]
    OutOfRange(NaiveDate),
    /// A month-end job was given a date that is not the last day of its month.
    #[error("{date} is not the last day of its month (that is {month_end})")]
    NotMonthEnd { date: NaiveDate, month_end: NaiveDate },
}

fn in_range(date: NaiveDate) -> Result<NaiveDate, CalendarError> {
    if (1..=9999).contains(&date.year()) {
        Ok(date)
    } else {
        Err(CalendarError::OutOfRange(date))
    }
}

/// The first day of `date`'s month.
pub fn month_start(date: NaiveDate) -> NaiveDate {
    date.with_day(1).unwrap_or(date)
}

/// The last day of `date`'s month. Saturates at chrono's last representable month.
pub fn month_end(date: NaiveDate) -> NaiveDate {
    month_start(date)
        .checked_add_months(Months::new(1))
        .and_then(|next| next.pred_opt())
        .unwrap_or(NaiveDate::MAX)
}

/// The business month a settlement date stands for: its first day and the date itself, both inclusive.
/// `date` must be a month end within years 1..=9999.
pub fn settlement_month(date: NaiveDate) -> Result<(NaiveDate, NaiveDate), CalendarError> {
    let date = in_range(date)?;
    let end = month_end(date);
    if date != end {
        return Err(CalendarError::NotMonthEnd { date, month_end: end });
    }
    Ok((month_start(date), date))
}

/// The local calendar date of an instant in `zone`.
pub fn local_date(instant: DateTime<Utc>, zone: Tz) -> NaiveDate {
    zone.from_utc_datetime(&instant.naive_utc()).date_naive()
}

/// The latest month end that is due on local date `today`: the last day of the previous month.
pub fn previous_month_end(today: NaiveDate) -> NaiveDate {
    month_start(today).pred_opt().unwrap_or(NaiveDate::MIN)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn d(s: &str) -> NaiveDate {
        s.parse().expect("test date")
    }

    #[test]
    fn month_ends_including_leap_februaries() {
        assert_eq!(month_end(d("2026-01-15")), d("2026-01-31"));
        assert_eq!(month_end(d("2026-02-01")), d("2026-02-28"));
        assert_eq!(month_end(d("2028-02-10")), d("2028-02-29"));
        assert_eq!(month_end(d("2100-02-10")), d("2100-02-28"));
        assert_eq!(month_end(d("2000-02-10")), d("2000-02-29"));
        assert_eq!(month_end(d("2026-12-31")), d("2026-12-31"));
    }

    #[test]
    fn settlement_month_accepts_only_month_ends() {
        assert_eq!(
            settlement_month(d("2028-02-29")),
            Ok((d("2028-02-01"), d("2028-02-29")))
        );
        assert_eq!(
            settlement_month(d("2026-02-27")),
            Err(CalendarError::NotMonthEnd {
                date: d("2026-02-27"),
                month_end: d("2026-02-28")
            })
        );
        assert_eq!(
            settlement_month(d("+10000-01-31")),
            Err(CalendarError::OutOfRange(d("+10000-01-31")))
        );
    }

    #[test]
    fn january_ticks_settle_the_previous_december() {
        assert_eq!(previous_month_end(d("2027-01-01")), d("2026-12-31"));
        assert_eq!(previous_month_end(d("2026-03-31")), d("2026-02-28"));
    }

    #[test]
    fn local_date_follows_the_zone_not_utc() {
        let instant = d("2026-12-31").and_hms_opt(17, 0, 0).expect("time").and_utc();
        assert_eq!(local_date(instant, chrono_tz::Asia::Shanghai), d("2027-01-01"));
        assert_eq!(local_date(instant, chrono_tz::UTC), d("2026-12-31"));
        assert_eq!(
            previous_month_end(local_date(instant, chrono_tz::Asia::Shanghai)),
            d("2026-12-31")
        );
    }

    proptest! {
        #[test]
        fn previous_month_end_is_a_month_end_before_today(days in 0i64..3_000_000) {
            let today = d("0002-01-01") + chrono::Duration::days(days);
            let end = previous_month_end(today);
            prop_assert!(end < today);
            prop_assert_eq!(month_end(end), end);
            prop_assert_eq!(end.succ_opt().map(month_start), Some(month_start(today)));
        }
    }
}
