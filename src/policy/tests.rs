//! The rule's own properties; its agreement with SQL is tested against the database (tests/it/policy.rs).

use chrono::{Duration, NaiveDate};
use proptest::prelude::*;

use super::*;

fn d(s: &str) -> NaiveDate {
    s.parse().expect("a date")
}

fn policy(rate: i64, grace: i64, cap: i64, charge_closed_days: bool) -> Policy {
    Policy {
        fine: FinePolicy::new(rate, grace, cap).expect("valid policy"),
        charge_closed_days,
    }
}

proptest! {
    /// Without closed days the rule is the ledger's canonical amount and settlement's fine as before.
    #[test]
    fn without_closed_days_it_is_the_flat_rule(
        rate in 0i64..5_000, grace in 0i64..10, cap in prop_oneof![Just(0i64), 1i64..20_000],
        late in -5i64..60, at in -3i64..70, charge in any::<bool>(),
    ) {
        let p = policy(rate, grace, cap, charge);
        let none = ClosedDays::default();
        let due = d("2026-10-20");
        let returned = due + Duration::days(late);
        let day = due + Duration::days(at);
        prop_assert_eq!(p.day_amount(&none, due, Some(returned), day), p.fine.day_amount(due, Some(returned), day));
        prop_assert_eq!(p.day_amount(&none, due, None, day), p.fine.day_amount(due, None, day));
        prop_assert_eq!(p.fine(&none, due, returned), p.fine.fine(late).expect("a fine"));
    }

    /// With closed days, a returned loan's days at their canonical amounts add up to its settled fine.
    #[test]
    fn day_amounts_add_up_to_the_fine_with_closed_days(
        rate in 0i64..5_000, grace in 0i64..10, cap in prop_oneof![Just(0i64), 1i64..20_000],
        late in -5i64..60, closed in proptest::collection::vec(-5i64..70, 0..20), charge in any::<bool>(),
    ) {
        let p = policy(rate, grace, cap, charge);
        let due = d("2026-10-20");
        let cal = ClosedDays::new(closed.iter().map(|k| due + Duration::days(*k)));
        let returned = due + Duration::days(late);
        let total: i64 = (-3..late + 5)
            .map(|k| p.day_amount(&cal, due, Some(returned), due + Duration::days(k)).get())
            .sum();
        prop_assert_eq!(total, p.fine(&cal, due, returned).get());
    }
}

#[test]
fn closed_days_are_free_and_do_not_use_up_the_grace() {
    // Due Sunday 11-01, grace 1, closed on 11-02 and 11-08: 11-02 is grace anyway, 11-08 is not charged.
    let cal = ClosedDays::new([d("2026-11-02"), d("2026-11-08")]);
    let p = policy(100, 1, 0, false);
    assert_eq!(
        p.fine(&cal, d("2026-11-01"), d("2026-11-10")),
        Cents::new(700).expect("cents")
    );
    assert_eq!(
        p.day_amount(&cal, d("2026-11-01"), None, d("2026-11-08")),
        Cents::ZERO
    );
    let charged = Policy {
        charge_closed_days: true,
        ..p
    };
    assert_eq!(
        charged.fine(&cal, d("2026-11-01"), d("2026-11-10")),
        Cents::new(800).expect("cents")
    );
}

#[test]
fn the_day_reaching_the_cap_gets_the_remainder_counting_open_days_only() {
    let cal = ClosedDays::new([d("2026-11-03")]);
    let p = policy(100, 0, 250, false);
    let amounts: Vec<i64> = (1..=5)
        .map(|k| {
            p.day_amount(&cal, d("2026-11-01"), None, d("2026-11-01") + Duration::days(k))
                .get()
        })
        .collect();
    assert_eq!(amounts, [100, 0, 100, 50, 0]);
}

#[test]
fn a_class_without_a_version_for_the_date_falls_back_to_default() {
    let version = |class: &str, from: &str, rate: i64| PolicyVersion {
        class: FineClass::new(class).expect("class"),
        effective_from: d(from),
        policy: policy(rate, 0, 0, false),
        created_at: DateTime::<Utc>::UNIX_EPOCH,
        created_by: "test".into(),
        reason: String::new(),
    };
    let versions = [
        version("default", "2000-01-01", 100),
        version("default", "2026-06-01", 150),
        version("laptop", "2026-01-01", 500),
    ];
    let rate = |class: Option<&str>, due: &str| {
        governing(&versions, class, d(due)).map(|v| v.policy.fine.daily_rate().get())
    };
    assert_eq!(rate(None, "2026-05-31"), Some(100));
    assert_eq!(rate(None, "2026-06-01"), Some(150));
    assert_eq!(rate(Some("laptop"), "2025-12-31"), Some(100));
    assert_eq!(rate(Some("laptop"), "2026-07-01"), Some(500));
    assert_eq!(rate(Some("dvd"), "2026-07-01"), Some(150));
    assert_eq!(rate(None, "1999-12-31"), None);
}
