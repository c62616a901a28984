//! Settlement end to end: idempotence, the seed's zero-fine trap, resharding, month edges, crash and resume.

use std::{process::Stdio, time::Duration};

use chrono::NaiveDate;
use fine_settler::{
    calendar,
    demo::{self, DemoSpec},
    fine::FinePolicy,
    jobs::{settlement::Settlement, Outcome},
};
use sqlx::PgPool;

use crate::helpers::{
    d, database_url, db, fine_settler, insert, install_update_audit, key, loan, max_updates_per_loan, oracle,
    output, report, runner, settled, settled_outside, sigkill, slow_down, spawn, wait_until, Via,
};

async fn demo_loans(pool: &PgPool, n: u64) {
    let loans: Vec<_> = demo::loans(DemoSpec {
        loans: n,
        seed: 7,
        month: d("2026-10-01"),
        first_id: 1,
    })
    .collect();
    insert(pool, &loans).await;
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_run_settles_the_month_and_reruns_change_nothing(pool: PgPool) {
    install_update_audit(&pool).await;
    demo_loans(&pool, 2000).await;
    let k = key("2026-10-31", 0, 1);
    let (expected_n, expected_total) = oracle(&pool, "2026-10-31").await;
    assert!(expected_n > 100 && expected_total > 0);

    let first = runner(&pool, "a", 64).run(&Settlement::new(), k, false).await;
    assert_eq!(
        (first.outcome, first.epoch, first.scanned, first.updated),
        (Outcome::Settled, Some(1), expected_n, expected_n)
    );
    assert_eq!(settled(&pool, "2026-10-31").await, (expected_n, expected_total));
    assert_eq!(
        settled_outside(&pool, "2026-10-31").await,
        0,
        "loans outside the month are untouched"
    );

    let again = runner(&pool, "b", 64).run(&Settlement::new(), k, false).await;
    assert_eq!(again.outcome, Outcome::Skipped);

    let forced = runner(&pool, "c", 64).run(&Settlement::new(), k, true).await;
    assert_eq!(
        (forced.outcome, forced.epoch, forced.scanned, forced.updated),
        (Outcome::Settled, Some(2), 0, 0)
    );
    assert_eq!(settled(&pool, "2026-10-31").await, (expected_n, expected_total));
    assert_eq!(max_updates_per_loan(&pool).await, 1);
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn three_shards_twice_each_concurrently_then_rerun_then_forced(pool: PgPool) {
    three_shards_twice_each(&pool, &Via::direct(&pool)).await;
}
}

/// 3 shards × 2 concurrent `settle` processes reaching the database `via`, then a rerun and a forced rerun: the
/// oracle's totals, one update per loan (the audit trigger), three SUCCESS keys, and `verify` clean.
pub(crate) async fn three_shards_twice_each(pool: &PgPool, via: &Via) {
    let pool = pool.clone();
    install_update_audit(&pool).await;
    demo_loans(&pool, 3000).await;
    let oracle_totals = oracle(&pool, "2026-10-31").await;

    let settle_all = |extra: &'static [&'static str]| {
        let via = via.clone();
        async move {
            let mut tasks = Vec::new();
            for shard in 0..3 {
                for _ in 0..2 {
                    let mut cmd = via.command();
                    cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "50")
                        .args([
                            "settle",
                            "--business-date",
                            "2026-10-31",
                            "--shards",
                            "3",
                            "--shard",
                        ])
                        .arg(shard.to_string())
                        .args(extra);
                    tasks.push(tokio::task::spawn_blocking(move || output(cmd)));
                }
            }
            let mut reports = Vec::new();
            for t in tasks {
                let out = t.await.expect("join");
                assert_eq!(
                    out.status.code(),
                    Some(0),
                    "stderr: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                reports.push(report(&out));
            }
            reports
        }
    };
    let count = |reports: &[serde_json::Value], outcome: &str| {
        reports.iter().filter(|r| r["outcome"] == outcome).count()
    };
    let sum = |reports: &[serde_json::Value], field: &str| {
        reports
            .iter()
            .map(|r| r[field].as_i64().unwrap_or(0))
            .sum::<i64>()
    };

    let first = settle_all(&[]).await;
    // Each shard has one winner; its twin either skipped or, if it came after the winner finished, also skipped.
    assert_eq!(count(&first, "settled"), 3, "{first:?}");
    assert_eq!(count(&first, "skipped"), 3, "{first:?}");
    assert_eq!(sum(&first, "updated"), oracle_totals.0);

    let rerun = settle_all(&[]).await;
    assert_eq!(count(&rerun, "skipped"), 6, "{rerun:?}");

    let forced = settle_all(&["--force"]).await;
    // A forced twin that comes after its shard's forced run finished forces again: that is what --force means.
    assert!(count(&forced, "settled") >= 3, "{forced:?}");
    assert_eq!(
        count(&forced, "settled") + count(&forced, "skipped"),
        6,
        "{forced:?}"
    );
    assert_eq!(
        sum(&forced, "scanned"),
        0,
        "a forced rerun finds nothing left to settle"
    );

    assert_eq!(settled(&pool, "2026-10-31").await, oracle_totals);
    assert_eq!(max_updates_per_loan(&pool).await, 1, "no loan was updated twice");
    let statuses: Vec<(i32, String)> = sqlx::query_as("select shard, status from job_runs order by shard")
        .fetch_all(&pool)
        .await
        .expect("runs");
    assert_eq!(
        statuses,
        vec![
            (0, "SUCCESS".into()),
            (1, "SUCCESS".into()),
            (2, "SUCCESS".into())
        ]
    );

    let verify = output({
        let mut c = via.command();
        c.args(["verify", "--business-date", "2026-10-31"]);
        c
    });
    assert_eq!(
        verify.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&verify.stdout)
    );
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn the_seeds_zero_fine_trap_reworks_nothing(pool: PgPool) {
    install_update_audit(&pool).await;
    // 40 on-time returns (fine 0) and 10 late ones.
    let mut loans: Vec<_> = (1..=40)
        .map(|id| loan(id, "2026-10-20", Some("2026-10-10")))
        .collect();
    loans.extend((41..=50).map(|id| loan(id, "2026-10-01", Some("2026-10-04"))));
    insert(&pool, &loans).await;
    let k = key("2026-10-31", 0, 1);
    let first = runner(&pool, "a", 16).run(&Settlement::new(), k, false).await;
    assert_eq!(first.updated, 50);

    // The seed's marker would still select every on-time loan as "unsettled"...
    let by_zero_marker: i64 =
        sqlx::query_scalar("select count(*) from loans where returned_on is not null and fine_cents = 0")
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(by_zero_marker, 40);
    // ...while ours reworks none of them.
    let forced = runner(&pool, "b", 16).run(&Settlement::new(), k, true).await;
    assert_eq!((forced.scanned, forced.updated), (0, 0));
    assert_eq!(max_updates_per_loan(&pool).await, 1);
    assert_eq!(settled(&pool, "2026-10-31").await, (50, 10 * 300));
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn resharding_from_three_to_four_settles_every_row(pool: PgPool) {
    install_update_audit(&pool).await;
    demo_loans(&pool, 1500).await;
    // Only shards 0 and 1 of 3 ran (a replica was missing); then the deployment moved to 4 shards.
    for shard in [0, 1] {
        let r = runner(&pool, "old", 40)
            .run(&Settlement::new(), key("2026-10-31", shard, 3), false)
            .await;
        assert_eq!(r.outcome, Outcome::Settled);
    }
    let partial = settled(&pool, "2026-10-31").await.0;
    let expected = oracle(&pool, "2026-10-31").await;
    assert!(partial > 0 && partial < expected.0);
    let mut second = 0;
    for shard in 0..4 {
        let r = runner(&pool, "new", 40)
            .run(&Settlement::new(), key("2026-10-31", shard, 4), false)
            .await;
        assert_eq!(
            r.outcome,
            Outcome::Settled,
            "shard {shard} of 4 runs fresh, not skipped"
        );
        second += r.updated;
    }
    assert_eq!(partial + second, expected.0, "the overlap was not written twice");
    assert_eq!(settled(&pool, "2026-10-31").await, expected);
    assert_eq!(max_updates_per_loan(&pool).await, 1);
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn the_business_month_is_first_to_last_day_inclusive(pool: PgPool) {
    insert(
        &pool,
        &[
            loan(1, "2028-01-20", Some("2028-01-31")), // previous month: excluded
            loan(2, "2028-01-30", Some("2028-02-01")), // first day: 2 days late
            loan(3, "2028-02-19", Some("2028-02-29")), // leap day: 10 days late
            loan(4, "2028-02-28", Some("2028-03-01")), // next month's first day: excluded
            loan(5, "2028-02-10", None),               // not returned: excluded
        ],
    )
    .await;
    let r = runner(&pool, "a", 10)
        .run(&Settlement::new(), key("2028-02-29", 0, 1), false)
        .await;
    assert_eq!((r.outcome, r.scanned), (Outcome::Settled, 2));
    let fines: Vec<(i64, i64, bool)> =
        sqlx::query_as("select id, fine_cents, fine_settled_at is not null from loans order by id")
            .fetch_all(&pool)
            .await
            .expect("loans");
    assert_eq!(
        fines,
        vec![
            (1, 0, false),
            (2, 200, true),
            (3, 1000, true),
            (4, 0, false),
            (5, 0, false)
        ]
    );
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_january_tick_settles_december(pool: PgPool) {
    insert(
        &pool,
        &[
            loan(1, "2026-12-30", Some("2026-12-31")),
            loan(2, "2026-12-30", Some("2027-01-01")),
        ],
    )
    .await;
    // 2026-12-31T16:30Z is 00:30 on January 1st in Shanghai.
    let tick = d("2026-12-31").and_hms_opt(16, 30, 0).expect("time").and_utc();
    let business_date = calendar::previous_month_end(calendar::local_date(tick, chrono_tz::Asia::Shanghai));
    assert_eq!(business_date, d("2026-12-31"));
    let r = runner(&pool, "a", 10)
        .run(&Settlement::new(), key("2026-12-31", 0, 1), false)
        .await;
    assert_eq!((r.outcome, r.scanned, r.updated), (Outcome::Settled, 1, 1));
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn ids_at_the_top_of_the_range_terminate(pool: PgPool) {
    insert(
        &pool,
        &[
            loan(i64::MAX - 1, "2026-10-01", Some("2026-10-02")),
            loan(i64::MAX, "2026-10-01", Some("2026-10-03")),
        ],
    )
    .await;
    let r = runner(&pool, "a", 1)
        .run(&Settlement::new(), key("2026-10-31", 0, 1), false)
        .await;
    assert_eq!((r.outcome, r.scanned), (Outcome::Settled, 2));
    let cursor: Option<i64> = sqlx::query_scalar("select cursor from job_runs")
        .fetch_one(&pool)
        .await
        .expect("row");
    assert_eq!(cursor, Some(i64::MAX));
}
}

crate::each_engine! {
/// A loan whose due date is not finite (`-infinity`, `infinity`: PostgreSQL stores them, no calendar has them)
/// is left out: the run settles the rest of the month and succeeds, the key does not re-open for it, and
/// `verify` names it (exit 3) — as it names one with a non-finite return date, which is in no month. Once the
/// date is fixed, `settle` re-opens the key and settles it.
#[sqlx::test(fixtures("default_policy"))]
async fn a_loan_with_a_date_that_is_not_finite_is_left_out_and_named_by_verify(pool: PgPool) {
    insert(
        &pool,
        &[
            loan(1, "2026-10-01", Some("2026-10-02")),
            loan(3, "2026-10-01", Some("2026-10-03")),
        ],
    )
    .await;
    sqlx::raw_sql(
        "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on) values
           (2, 1, 1, '2026-09-01', '-infinity', '2026-10-05'),
           (4, 1, 1, '2026-09-01', 'infinity', '2026-10-06'),
           (5, 1, 1, '2026-09-01', '2026-09-20', 'infinity'),
           (6, 1, 1, '2026-09-01', '-infinity', null)",
    )
    .execute(&pool)
    .await
    .expect("loans with dates that are not finite");
    let k = key("2026-10-31", 0, 1);
    let run = runner(&pool, "a", 1).run(&Settlement::new(), k, false).await;
    assert_eq!(
        (run.outcome, run.scanned, run.updated),
        (Outcome::Settled, 2, 2),
        "{run:?}"
    );
    assert_eq!(settled(&pool, "2026-10-31").await, (2, 100 + 200));
    let again = runner(&pool, "b", 1).run(&Settlement::new(), k, false).await;
    assert_eq!(
        again.outcome,
        Outcome::Skipped,
        "no re-open for a loan it cannot settle"
    );

    let url = database_url(&pool);
    let verify = || {
        let mut cmd = fine_settler(&url);
        cmd.args(["verify", "--business-date", "2026-10-31", "--json"]);
        output(cmd)
    };
    let out = verify();
    let audit = report(&out);
    assert_eq!(out.status.code(), Some(3), "{audit}");
    assert_eq!(
        (
            audit["audit"]["not_finite"].as_i64(),
            audit["audit"]["not_finite_ids"].clone(),
            audit["audit"]["returned"].as_i64(),
            audit["audit"]["unsettled"].as_i64(),
        ),
        (Some(4), serde_json::json!([2, 4, 5, 6]), Some(2), Some(0)),
        "{audit}"
    );
    let violations = audit["violations"].to_string();
    assert!(
        violations.contains("not finite") && violations.contains("loans 2, 4, 5, 6"),
        "{violations}"
    );

    sqlx::query("update loans set due_on = '2026-09-30' where id = 2")
        .execute(&pool)
        .await
        .expect("fix");
    let mut settle = fine_settler(&url);
    settle.args(["settle", "--business-date", "2026-10-31"]);
    let out = output(settle);
    let r = report(&out);
    assert_eq!(
        (
            r["outcome"].as_str(),
            r["reopened"].as_bool(),
            r["updated"].as_i64()
        ),
        (Some("settled"), Some(true), Some(1)),
        "{r}"
    );
    assert_eq!(settled(&pool, "2026-10-31").await, (3, 100 + 500 + 200));
    sqlx::raw_sql(
        "update loans set due_on = '2026-10-01' where id in (4, 6);
         update loans set returned_on = null where id = 5",
    )
    .execute(&pool)
    .await
    .expect("fix the rest");
    let out = verify();
    assert_eq!(out.status.code(), Some(3), "loan 4 is unsettled now");
    assert_eq!(report(&out)["audit"]["not_finite"].as_i64(), Some(0));
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_killed_run_is_taken_over_after_its_lease_and_resumes_from_the_cursor(pool: PgPool) {
    install_update_audit(&pool).await;
    let loans: Vec<_> = (1..=300)
        .map(|id| loan(id, "2026-10-05", Some("2026-10-15")))
        .collect();
    insert(&pool, &loans).await;
    // Slow every row down so that the process is reliably mid-run when it is killed.
    slow_down(&pool, "update on loans", 0.005).await;

    let url = database_url(&pool);
    let settle = |url: &str| {
        let mut cmd = fine_settler(url);
        cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "10")
            .env("FINE_SETTLER__CLAIM__LEASE", "3s")
            .env("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "1s")
            .args(["settle", "--business-date", "2026-10-31"]);
        cmd
    };
    let victim = spawn(settle(&url).stdout(Stdio::null()).stderr(Stdio::null()));
    let scanned_so_far = || async {
        sqlx::query_scalar::<_, i64>("select coalesce(max(scanned), 0) from job_runs")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
    };
    wait_until("five committed batches", Duration::from_secs(30), || async {
        scanned_so_far().await >= 50
    })
    .await;
    sigkill(victim);
    // Its last transaction dies with its connection; wait until the server has let go of it.
    wait_until("the killed session to end", Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from pg_stat_activity
             where datname = current_database() and application_name like 'fine-settler settle%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap_or(1)
            == 0
    })
    .await;
    let committed = scanned_so_far().await;
    assert!(
        (50..300).contains(&committed),
        "killed mid-run, after {committed} rows"
    );
    sqlx::query("drop trigger slow_down on loans")
        .execute(&pool)
        .await
        .expect("drop slow trigger");

    // While the dead owner's lease is still live, nobody takes over.
    let early = output(settle(&url));
    assert_eq!(report(&early)["outcome"], "skipped");
    wait_until("the lease to expire", Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, bool>("select lease_until < now() from job_runs")
            .fetch_one(&pool)
            .await
            .unwrap_or(false)
    })
    .await;

    let resumed = output(settle(&url));
    assert_eq!(resumed.status.code(), Some(0));
    let r = report(&resumed);
    assert_eq!(
        (r["outcome"].as_str(), r["epoch"].as_i64()),
        (Some("settled"), Some(2))
    );
    let rescanned = committed + r["scanned"].as_i64().unwrap_or(0) - 300;
    assert!(
        (0..=10).contains(&rescanned),
        "rows scanned again: {rescanned} (at most one batch)"
    );
    assert_eq!(settled(&pool, "2026-10-31").await, (300, 300 * 1000));
    assert_eq!(max_updates_per_loan(&pool).await, 1);
    let events: Vec<(i64, String)> = sqlx::query_as("select epoch, event from job_run_attempts order by id")
        .fetch_all(&pool)
        .await
        .expect("history");
    let events: Vec<(i64, &str)> = events.iter().map(|(e, ev)| (*e, ev.as_str())).collect();
    assert_eq!(events, vec![(1, "claimed"), (2, "takeover"), (2, "success")]);
}
}

crate::each_engine! {
/// A policy's fines as settlement writes them, on real loan rows: 60 policies (small, large and maximal daily
/// rates, grace, with and without a cap), each settling a month of its own through the runner — 200 loans
/// returned from 1,000 days early to 2,999 days late, and 6 extreme ones. The audit behind `verify` must find no
/// wrong fine, and every loan's `fine_cents` must be `FinePolicy::fine` of its days late. The extremes are the
/// furthest a loan row reaches: due on PostgreSQL's first date (4714-11-24 BC) or its last (5874897-12-31),
/// 2^30 days early, and a day either side of the due date; the first and last months are in years 1 and 9999,
/// the calendar's bounds, so the first date is about 5.4 million days before a return and the last about
/// 2.1 billion days after one.
#[sqlx::test(fixtures("default_policy"))]
async fn settlement_and_the_audit_charge_the_policys_fine_on_random_and_extreme_loans(pool: PgPool) {
    let mut rng = demo::SplitMix64::new(99);
    let mut checked = 0;
    for round in 0..60u32 {
        let rate = match round % 3 {
            0 => rng.below(1000) as i64,
            1 => fine_settler::fine::MAX_DAILY_RATE_CENTS - rng.below(1000) as i64,
            _ => rng.below(100_000) as i64,
        };
        let grace = rng.below(60) as i64;
        let cap = if round % 2 == 0 {
            0
        } else {
            rng.below(1_000_000) as i64
        };
        let policy = FinePolicy::new(rate, grace, cap).expect("policy");
        let first = match round {
            0 => d("0001-01-01"),
            59 => d("9999-12-01"),
            r => d("2021-01-01") + chrono::Months::new(r - 1),
        };
        let last = calendar::month_end(first);
        let days_in_month = (last - first).num_days() as u64 + 1;
        let returned_in_month =
            |rng: &mut demo::SplitMix64| first + chrono::Duration::days(rng.below(days_in_month) as i64);

        // (returned_on, days late or else the due date)
        let mut loans: Vec<(NaiveDate, Option<i32>, Option<&str>)> = (0..200)
            .map(|_| {
                (
                    returned_in_month(&mut rng),
                    Some(rng.below(4000) as i32 - 1000),
                    None,
                )
            })
            .collect();
        loans.extend([
            (last, None, Some("4714-11-24 BC")),
            (first, None, Some("5874897-12-31")),
            (returned_in_month(&mut rng), Some(i32::MIN / 2), None),
            (returned_in_month(&mut rng), Some(-1), None),
            (returned_in_month(&mut rng), Some(0), None),
            (returned_in_month(&mut rng), Some(1), None),
        ]);
        let ids: Vec<i64> = (1..=loans.len() as i64)
            .map(|i| i64::from(round) * 1000 + i)
            .collect();
        let returned: Vec<NaiveDate> = loans.iter().map(|l| l.0).collect();
        let days: Vec<Option<i32>> = loans.iter().map(|l| l.1).collect();
        let due: Vec<Option<&str>> = loans.iter().map(|l| l.2).collect();
        sqlx::query(
            "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
             select id, 1, 1, due_on, due_on, returned
             from (select t.id, t.returned, coalesce(t.due::date, t.returned - t.days) as due_on
                   from unnest($1::bigint[], $2::date[], $3::int[], $4::text[]) as t (id, returned, days, due)) l",
        )
        .bind(&ids)
        .bind(&returned)
        .bind(&days)
        .bind(&due)
        .execute(&pool)
        .await
        .expect("insert loans");

        crate::helpers::set_policy(&pool, policy).await;
        let run = runner(&pool, "settler", 64)
            .run(&Settlement::new(), key(&last.to_string(), 0, 1), false)
            .await;
        assert_eq!(
            (run.outcome, run.scanned, run.updated),
            (Outcome::Settled, 206, 206),
            "{policy:?}: {run:?}"
        );
        let audit = fine_settler::store::audit::month(&db(&pool), (first, last))
            .await
            .expect("audit");
        assert_eq!(
            (audit.returned, audit.unsettled, audit.wrong_fine),
            (206, 0, 0),
            "{policy:?}, month {first}: {audit:?}"
        );
        assert_eq!(
            audit.total_cents, audit.expected_cents,
            "{policy:?}, month {first}"
        );

        let fines: Vec<(i64, i32, i64)> = sqlx::query_as(
            "select id, returned_on - due_on, fine_cents from loans
             where returned_on between $1 and $2 order by id",
        )
        .bind(first)
        .bind(last)
        .fetch_all(&pool)
        .await
        .expect("fines");
        assert_eq!(fines.len(), 206);
        for (id, days_late, fine) in fines {
            assert_eq!(
                policy.fine(i64::from(days_late)).map(|c| c.get()),
                Ok(fine),
                "loan {id}: {policy:?}, {days_late} days late"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 60 * 206);
}
}
