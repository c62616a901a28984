//! Daily overdue accrual: one ledger row per loan and day however often it runs, a compensation queue for
//! rejected charges, and reconciliation with the month-end settlement.

use std::{process::Stdio, time::Duration};

use chrono::{DateTime, NaiveDate, Utc};
use fine_settler::store::ledger_writes::LedgerWrites;
use fine_settler::{
    backoff::Backoff,
    fine::FinePolicy,
    jobs::{
        accrual::{compensate, Accrual},
        settlement::Settlement,
        JobName, Outcome, RunKey,
    },
    shard::ShardSpec,
    store::Db,
};
use sqlx::PgPool;

use crate::helpers::{
    assert_success, d, database_url, db, fine_settler, insert, loan, output, report, runner, runner_on,
    sigkill, slow_down, spawn, wait_until,
};

/// The accrual job, with the database's rules replaced by `policy` (one `default` version).
async fn accrual(pool: &PgPool, policy: FinePolicy) -> Accrual {
    crate::helpers::set_policy(pool, policy).await;
    Accrual {
        backoff: Backoff::new(Duration::from_millis(100), Duration::from_millis(250)),
        row_timeout: Duration::from_millis(500),
        isolation_budget: Duration::from_secs(5),
        lock_timeout: Duration::from_secs(2),
        scope: Default::default(),
        writes: LedgerWrites::new(crate::helpers::engine(pool)),
    }
}

fn day_key(day: NaiveDate, shard: i64, shards: i64) -> RunKey {
    RunKey {
        job: JobName::OverdueAccrual,
        business_date: day,
        shard: ShardSpec::new(shard, shards).expect("shard"),
    }
}

/// A day safely in the past for the `accrue` command, which refuses today and later.
fn past_day() -> NaiveDate {
    fine_settler::calendar::local_date(chrono::Utc::now(), chrono_tz::Asia::Shanghai)
        - chrono::Duration::days(5)
}

async fn ledger(pool: &PgPool) -> Vec<(i64, NaiveDate, i64)> {
    sqlx::query_as("select loan_id, accrual_date, amount_cents from fine_ledger order by 1, 2")
        .fetch_all(pool)
        .await
        .expect("ledger")
}

/// Oracle in plain SQL: the loans overdue on `day` under grace 0.
/// Moves the compensation queue's clock: each row's `(updated_at, next_attempt_at)` becomes `to(now, updated_at,
/// next_attempt_at)`. Computed here and written as values: Citus refuses a timestamp's arithmetic on a column
/// (a stable operator) in an update of a distributed table.
async fn move_queue_clock<F>(pool: &PgPool, to: F)
where
    F: Fn(DateTime<Utc>, DateTime<Utc>, DateTime<Utc>) -> (DateTime<Utc>, DateTime<Utc>),
{
    type Row = (i64, NaiveDate, DateTime<Utc>, DateTime<Utc>, DateTime<Utc>);
    let rows: Vec<Row> =
        sqlx::query_as("select loan_id, accrual_date, updated_at, next_attempt_at, now() from fine_pending")
            .fetch_all(pool)
            .await
            .expect("the queue");
    for (loan, day, updated, next, now) in rows {
        let (updated, next) = to(now, updated, next);
        sqlx::query(
            "update fine_pending set updated_at = $3, next_attempt_at = $4 where loan_id = $1 and accrual_date = $2",
        )
        .bind(loan)
        .bind(day)
        .bind(updated)
        .bind(next)
        .execute(pool)
        .await
        .expect("move the queue's clock");
    }
}

async fn overdue_on(pool: &PgPool, day: NaiveDate) -> Vec<i64> {
    sqlx::query_scalar(
        "select id from loans where due_on < $1 and (returned_on is null or returned_on >= $1) order by id",
    )
    .bind(day)
    .fetch_all(pool)
    .await
    .expect("oracle")
}

/// 300 loans around `day`: due from 20 days before to 10 days after, returned at varied times or not at all.
async fn mixed_loans(pool: &PgPool, day: NaiveDate) {
    let loans: Vec<_> = (1..=300i64)
        .map(|id| {
            let due = day + chrono::Duration::days(id % 31 - 20);
            let returned = match id % 4 {
                0 => None,
                1 => Some(day - chrono::Duration::days(id % 7)),
                2 => Some(day),
                _ => Some(day + chrono::Duration::days(id % 5)),
            };
            loan(id, &due.to_string(), returned.map(|r| r.to_string()).as_deref())
        })
        .collect();
    insert(pool, &loans).await;
}

async fn block_charges(pool: &PgPool, ids: &[i64]) {
    let table = if crate::helpers::citus::is_test_db(pool) {
        // A reference table: the trigger reads it on every worker.
        "create table if not exists blocked (id bigint primary key);
         select create_reference_table('blocked')
         where not exists (select 1 from citus_tables where table_name = 'blocked'::regclass)"
    } else {
        "create table if not exists blocked (id bigint primary key)"
    };
    crate::helpers::ddl(
        pool,
        &[
            table,
            "create or replace function reject_blocked() returns trigger language plpgsql as $$
             begin
                 if exists (select 1 from blocked where id = new.loan_id) then
                     raise exception 'charge rejected for loan %', new.loan_id;
                 end if;
                 return new;
             end $$",
            "drop trigger if exists reject_blocked on fine_ledger",
            "create trigger reject_blocked before insert on fine_ledger for each row execute function reject_blocked()",
        ],
    )
    .await;
    for id in ids {
        sqlx::query("insert into blocked values ($1) on conflict do nothing")
            .bind(id)
            .execute(pool)
            .await
            .expect("block");
    }
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_run_a_concurrent_duplicate_and_a_forced_rerun_leave_one_ledger(pool: PgPool) {
    let day = past_day();
    mixed_loans(&pool, day).await;
    let expected = overdue_on(&pool, day).await;
    assert!(expected.len() > 100);
    let url = database_url(&pool);
    let accrue = |extra: &'static [&'static str]| {
        let mut cmd = fine_settler(&url);
        cmd.env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "20")
            .args(["accrue", "--date", &day.to_string()])
            .args(extra);
        cmd
    };
    let (a, b) = (accrue(&[]), accrue(&[]));
    let (a, b) = tokio::join!(
        tokio::task::spawn_blocking(move || output(a)),
        tokio::task::spawn_blocking(move || output(b))
    );
    let reports = [report(&a.expect("join")), report(&b.expect("join"))];
    let outcomes: Vec<&str> = reports.iter().filter_map(|r| r["outcome"].as_str()).collect();
    assert!(
        outcomes.contains(&"settled") && outcomes.contains(&"skipped"),
        "{reports:?}"
    );
    let first = ledger(&pool).await;
    assert_eq!(first.iter().map(|r| r.0).collect::<Vec<_>>(), expected);
    assert!(first.iter().all(|r| r.1 == day && r.2 == 100));

    let forced = output(accrue(&["--force"]));
    let forced = report(&forced);
    // A run's `scanned` counts the loans its batches looked at: on PostgreSQL those found to have work, on Citus
    // every loan that may have some, unpriced — the day's charged loans among them (docs/citus.md).
    let looked_at = if crate::helpers::citus::is_test_db(&pool) { expected.len() as i64 } else { 0 };
    assert_eq!(
        (forced["outcome"].as_str(), forced["scanned"].as_i64(), forced["updated"].as_i64()),
        (Some("settled"), Some(looked_at), Some(0))
    );
    assert_eq!(
        (forced["pending"].as_i64(), forced["dead"].as_i64()),
        (Some(0), Some(0))
    );
    assert_eq!(ledger(&pool).await, first, "the forced rerun changed nothing");
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn rejected_charges_wait_in_pending_and_are_compensated_exactly_once(pool: PgPool) {
    rejected_charges_compensated_once(&pool, db(&pool)).await;
}
}

/// Charges rejected by a trigger during a run (through `jobs`) wait in `fine_pending` and a compensation pass
/// charges each exactly once, when it is due.
pub(crate) async fn rejected_charges_compensated_once(pool: &PgPool, jobs: Db) {
    let pool = pool.clone();
    let day = d("2026-10-10");
    mixed_loans(&pool, day).await;
    let expected = overdue_on(&pool, day).await;
    let blocked = [expected[3], expected[10], expected[11]];
    block_charges(&pool, &blocked).await;

    // The first retry a minute after the failure: far longer than any machine takes from the run to the "not due
    // yet" pass below (with a second's backoff, a loaded machine sometimes got there after the charges came due).
    // The minute then passes by moving the queue's clock, not by waiting it out.
    let job = Accrual {
        backoff: Backoff::new(Duration::from_secs(60), Duration::from_secs(240)),
        ..accrual(&pool, FinePolicy::DEFAULT).await
    };
    let run = runner_on(jobs.clone(), "a", 25)
        .run(&job, day_key(day, 0, 1), false)
        .await;
    assert_eq!(
        run.outcome,
        Outcome::Settled,
        "a run with pending charges still succeeds: {run:?}"
    );
    assert_eq!(run.updated, expected.len() as i64 - 3);
    let pending: Vec<(i64, String, i32, String)> =
        sqlx::query_as("select loan_id, status, attempts, last_error from fine_pending order by loan_id")
            .fetch_all(&pool)
            .await
            .expect("pending");
    assert_eq!(pending.iter().map(|p| p.0).collect::<Vec<_>>(), blocked.to_vec());
    assert!(
        pending
            .iter()
            .all(|p| p.1 == "PENDING" && p.2 == 1 && p.3.contains("charge rejected")),
        "{pending:?}"
    );
    // A rerun does not charge them behind the queue's back (on Citus it looks at the day's charged loans again:
    // its batches are unpriced).
    let forced = runner_on(jobs.clone(), "b", 25)
        .run(&job, day_key(day, 0, 1), true)
        .await;
    let looked_at = if crate::helpers::citus::is_test_db(&pool) {
        run.updated
    } else {
        0
    };
    assert_eq!((forced.scanned, forced.updated), (looked_at, 0));

    sqlx::query("delete from blocked")
        .execute(&pool)
        .await
        .expect("lift");
    // Not due yet: nothing happens.
    assert_eq!(
        compensate(&jobs, &job, Some(ShardSpec::SINGLE), true, 10)
            .await
            .expect("pass")
            .charged,
        0
    );
    // Due one backoff after they were queued.
    let delays: Vec<f64> = sqlx::query_scalar(
        "select extract(epoch from next_attempt_at - updated_at)::float8 * 1000 from fine_pending",
    )
    .fetch_all(&pool)
    .await
    .expect("delays");
    assert!(delays.iter().all(|ms| (ms - 60_000.0).abs() < 1.0), "{delays:?}");
    // A minute later (the queue's times moved back by one).
    let minute = chrono::Duration::seconds(60);
    move_queue_clock(&pool, |_, updated, next| (updated - minute, next - minute)).await;
    let done = compensate(&jobs, &job, Some(ShardSpec::SINGLE), true, 10)
        .await
        .expect("pass");
    assert_eq!(done.charged, 3);
    let again = compensate(&jobs, &job, Some(ShardSpec::SINGLE), true, 10)
        .await
        .expect("pass");
    assert_eq!(again.charged, 0);
    let rows = ledger(&pool).await;
    assert_eq!(
        rows.iter().map(|r| r.0).collect::<Vec<_>>(),
        expected,
        "every overdue loan charged exactly once"
    );
    let left: i64 = sqlx::query_scalar("select count(*) from fine_pending")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(left, 0);
}

crate::each_engine! {
/// A retry that only waits too long for the loan's lock (a peer's batch holds it) is no attempt: however many
/// such retries a busy server sees, the charge stays PENDING with its attempts — each wait twice the last, up to
/// the backoff's maximum — and is charged once the lock is let go. (Each used to count: on a loaded machine,
/// sound charges went DEAD for an operator.)
#[sqlx::test(fixtures("default_policy"))]
async fn a_retry_that_waits_too_long_for_the_loans_lock_spends_no_attempt(pool: PgPool) {
    let day = d("2026-10-10");
    insert(&pool, &[loan(1, "2026-10-01", None)]).await;
    block_charges(&pool, &[1]).await;
    // Under a cap, a charge takes its loan's lock (days of one loan charged at once must not pass the cap).
    let job = Accrual {
        lock_timeout: Duration::from_millis(100),
        backoff: Backoff::new(Duration::from_secs(10), Duration::from_secs(40)),
        ..accrual(&pool, FinePolicy::new(100, 0, 10_000).expect("policy")).await
    };
    runner(&pool, "a", 10).run(&job, day_key(day, 0, 1), false).await;
    sqlx::query("delete from blocked")
        .execute(&pool)
        .await
        .expect("lift");
    let row = || async {
        sqlx::query_as::<_, (String, i32, String, f64)>(
            "select status, attempts, last_error,
                    extract(epoch from next_attempt_at - updated_at)::float8 from fine_pending",
        )
        .fetch_one(&pool)
        .await
        .expect("pending row")
    };
    let (_, attempts, _, wait) = row().await;
    assert_eq!(
        (attempts, wait.round()),
        (1, 10.0),
        "the run's own charge was the first attempt"
    );
    // The time of the next attempt comes (the row's clock moved back by what was left of its wait).
    let due = || async {
        move_queue_clock(&pool, |now, updated, next| (updated - (next - now), now)).await;
    };

    // A peer's batch holds the loan's lock through four retries, with two attempts allowed in all.
    let mut peer = pool.begin().await.expect("begin");
    fine_settler::store::ledger::lock_loans(&mut peer, &[1])
        .await
        .expect("lock the loan");
    let mut waits = Vec::new();
    for _ in 0..4 {
        due().await;
        let pass = compensate(&db(&pool), &job, None, true, 2).await.expect("pass");
        assert_eq!((pass.charged, pass.dead, pass.retried), (0, 0, 1), "{pass:?}");
        let (status, attempts, error, wait) = row().await;
        assert_eq!((status.as_str(), attempts), ("PENDING", 1), "{error}");
        assert!(error.contains("lock timeout"), "{error}");
        waits.push(wait.round());
    }
    assert_eq!(
        waits,
        vec![20.0, 40.0, 40.0, 40.0],
        "each wait twice the last, up to the maximum"
    );
    peer.rollback().await.expect("let go");
    due().await;
    let pass = compensate(&db(&pool), &job, None, true, 2).await.expect("pass");
    assert_eq!(pass.charged, 1, "{pass:?}");
    let left: i64 = sqlx::query_scalar("select count(*) from fine_pending")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(left, 0);
    assert_eq!(ledger(&pool).await.len(), 1, "charged once");
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_charge_that_keeps_failing_goes_dead_with_growing_capped_backoff(pool: PgPool) {
    let day = d("2026-10-10");
    insert(&pool, &[loan(1, "2026-10-01", None), loan(2, "2026-10-01", None)]).await;
    block_charges(&pool, &[1]).await;
    let job = accrual(&pool, FinePolicy::DEFAULT).await;
    runner(&pool, "a", 10).run(&job, day_key(day, 0, 1), false).await;

    let delay_ms = || async {
        sqlx::query_scalar::<_, f64>(
            "select extract(epoch from next_attempt_at - updated_at)::float8 * 1000 from fine_pending",
        )
        .fetch_one(&pool)
        .await
        .expect("delay")
    };
    let mut delays = vec![delay_ms().await];
    let mut statuses = Vec::new();
    for _ in 0..3 {
        sqlx::query("update fine_pending set next_attempt_at = now()")
            .execute(&pool)
            .await
            .expect("make due");
        compensate(&db(&pool), &job, None, true, 4).await.expect("pass");
        let (status, attempts): (String, i32) = sqlx::query_as("select status, attempts from fine_pending")
            .fetch_one(&pool)
            .await
            .expect("row");
        statuses.push((status, attempts));
        delays.push(delay_ms().await);
    }
    let rounded: Vec<i64> = delays[..3]
        .iter()
        .map(|d| (d / 10.0).round() as i64 * 10)
        .collect();
    assert_eq!(
        rounded,
        vec![100, 200, 250],
        "backoff doubles and is capped: {delays:?}"
    );
    assert_eq!(
        statuses,
        vec![("PENDING".into(), 2), ("PENDING".into(), 3), ("DEAD".into(), 4)],
        "DEAD after max_attempts"
    );
    // DEAD rows are left alone by the daemon's passes...
    assert_eq!(
        compensate(&db(&pool), &job, None, true, 4)
            .await
            .expect("pass")
            .charged,
        0
    );
    // ...until an operator fixes the cause and resurrects them.
    sqlx::query("delete from blocked")
        .execute(&pool)
        .await
        .expect("lift");
    let url = database_url(&pool);
    let mut retry = fine_settler(&url);
    retry.args(["pending", "retry", "--dead"]);
    let out = output(retry);
    assert_success(&out);
    let summary = report(&out);
    assert_eq!(
        (summary["resurrected"].as_i64(), summary["charged"].as_i64()),
        (Some(1), Some(1))
    );
    assert_eq!(ledger(&pool).await, vec![(1, day, 100), (2, day, 100)]);
}
}

crate::each_engine! {
/// `accrual.max_attempts = N` is N attempts in all, the batch's own failed charge being the first: with 1 a queued
/// charge is DEAD at the first pass without being tried again; with 2 it is tried once more.
#[sqlx::test(fixtures("default_policy"))]
async fn max_attempts_counts_every_attempt_the_batchs_charge_included(pool: PgPool) {
    let day = d("2026-10-10");
    insert(&pool, &[loan(1, "2026-10-01", None)]).await;
    block_charges(&pool, &[1]).await;
    let job = accrual(&pool, FinePolicy::DEFAULT).await;
    runner(&pool, "a", 10).run(&job, day_key(day, 0, 1), false).await;
    let row = || async {
        sqlx::query_as::<_, (String, i32)>("select status, attempts from fine_pending")
            .fetch_one(&pool)
            .await
            .expect("row")
    };
    assert_eq!(
        row().await,
        ("PENDING".into(), 1),
        "the batch's charge was attempt 1"
    );
    for (max_attempts, attempts) in [(1, 1), (2, 2)] {
        sqlx::query("update fine_pending set status = 'PENDING', attempts = 1, next_attempt_at = now()")
            .execute(&pool)
            .await
            .expect("queued again");
        let pass = compensate(&db(&pool), &job, None, true, max_attempts)
            .await
            .expect("pass");
        assert_eq!(
            (row().await, pass.dead, pass.charged),
            (("DEAD".into(), attempts), 1, 0),
            "max_attempts = {max_attempts}"
        );
    }
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_killed_accrual_is_taken_over_and_charges_every_loan_once(pool: PgPool) {
    let day = past_day();
    let loans: Vec<_> = (1..=300)
        .map(|id| loan(id, &(day - chrono::Duration::days(3)).to_string(), None))
        .collect();
    insert(&pool, &loans).await;
    slow_down(&pool, "insert on fine_ledger", 0.005).await;
    let url = database_url(&pool);
    let accrue = || {
        let mut cmd = fine_settler(&url);
        cmd.env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "10")
            .env("FINE_SETTLER__CLAIM__LEASE", "3s")
            .env("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "1s")
            .args(["accrue", "--date", &day.to_string()]);
        cmd
    };
    let victim = spawn(accrue().stdout(Stdio::null()).stderr(Stdio::null()));
    wait_until("a few batches", Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, i64>("select count(*) from fine_ledger")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
            >= 50
    })
    .await;
    sigkill(victim);
    sqlx::query("drop trigger slow_down on fine_ledger")
        .execute(&pool)
        .await
        .expect("drop");
    wait_until("the lease to expire", Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, bool>("select lease_until < now() from job_runs")
            .fetch_one(&pool)
            .await
            .unwrap_or(false)
    })
    .await;
    let out = output(accrue());
    let r = report(&out);
    assert_eq!(
        (r["outcome"].as_str(), r["epoch"].as_i64()),
        (Some("settled"), Some(2)),
        "{r}"
    );
    let rows = ledger(&pool).await;
    assert_eq!(rows.len(), 300);
    assert_eq!(
        rows.iter().map(|r| r.0).collect::<Vec<_>>(),
        (1..=300).collect::<Vec<_>>()
    );
}
}

crate::each_engine! {
/// Which loans a day charges, at the edges: due the day before (charged) or on the day (not yet), returned on
/// the day (charged) or the day before (not); grace days are free; and with a cap, the charge that reaches it is
/// partial and nothing is charged after it.
#[sqlx::test(fixtures("default_policy"))]
async fn accrual_edges_grace_and_cap(pool: PgPool) {
    let day = d("2026-10-10");
    insert(
        &pool,
        &[
            loan(1, "2026-10-09", None),               // due the day before: overdue
            loan(2, "2026-10-10", None),               // due on the day: not overdue yet
            loan(3, "2026-10-01", Some("2026-10-10")), // returned on the day: charged
            loan(4, "2026-10-01", Some("2026-10-09")), // returned the day before: not charged
            loan(5, "2026-10-07", None),               // due 3 days before: with grace 2, overdue
            loan(6, "2026-10-08", None),               // due 2 days before: with grace 2, still in grace
        ],
    )
    .await;
    let plain = accrual(&pool, FinePolicy::DEFAULT).await;
    runner(&pool, "a", 10)
        .run(&plain, day_key(day, 0, 1), false)
        .await;
    let charged: Vec<i64> = ledger(&pool).await.iter().map(|r| r.0).collect();
    assert_eq!(charged, vec![1, 3, 5, 6]);

    sqlx::query("delete from fine_ledger")
        .execute(&pool)
        .await
        .expect("reset");
    sqlx::query("delete from job_runs")
        .execute(&pool)
        .await
        .expect("reset");
    let graced = accrual(&pool, FinePolicy::new(100, 2, 0).expect("policy")).await;
    runner(&pool, "a", 10)
        .run(&graced, day_key(day, 0, 1), false)
        .await;
    let charged: Vec<i64> = ledger(&pool).await.iter().map(|r| r.0).collect();
    assert_eq!(
        charged,
        vec![3, 5],
        "loan 1 (due the day before) is still within its 2 days of grace"
    );

    // Grace and a cap of 250 cents over five days: each loan's first charge comes the day after its grace ends,
    // the charge that reaches the cap is partial, and nothing is charged after it.
    sqlx::query("delete from fine_ledger")
        .execute(&pool)
        .await
        .expect("reset");
    sqlx::query("delete from job_runs")
        .execute(&pool)
        .await
        .expect("reset");
    let capped = accrual(&pool, FinePolicy::new(100, 2, 250).expect("policy")).await;
    for day in 10..=14 {
        let r = runner(&pool, "a", 10)
            .run(&capped, day_key(d(&format!("2026-10-{day}")), 0, 1), false)
            .await;
        assert_eq!(r.outcome, Outcome::Settled, "{r:?}");
    }
    assert_eq!(
        ledger(&pool).await,
        vec![
            (1, d("2026-10-12"), 100),
            (1, d("2026-10-13"), 100),
            (1, d("2026-10-14"), 50),
            (2, d("2026-10-13"), 100),
            (2, d("2026-10-14"), 100),
            (5, d("2026-10-10"), 100),
            (5, d("2026-10-11"), 100),
            (5, d("2026-10-12"), 50),
            (6, d("2026-10-11"), 100),
            (6, d("2026-10-12"), 100),
            (6, d("2026-10-13"), 50),
        ],
        "loan 2 stays under the cap; loans 1, 5 and 6 stop at it; loan 4 was returned before the day; loan 3's \
         10-10 is its 7th owed day (from 10-04), past the cap, so nothing is owed for it whatever was charged"
    );
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn the_cap_is_reached_mid_month_and_nothing_more_is_charged(pool: PgPool) {
    insert(&pool, &[loan(1, "2026-10-01", None)]).await;
    let capped = accrual(&pool, FinePolicy::new(100, 0, 250).expect("policy")).await;
    let mut per_day = Vec::new();
    for day in 2..=6 {
        let r = runner(&pool, "a", 10)
            .run(&capped, day_key(d(&format!("2026-10-0{day}")), 0, 1), false)
            .await;
        per_day.push((r.scanned, r.updated));
    }
    // Past the cap the loan owes nothing: PostgreSQL's batches find no work; Citus's look at the loan (it may
    // have some: the batches are unpriced) and charge it nothing.
    let past_cap = if crate::helpers::citus::is_test_db(&pool) { (1, 0) } else { (0, 0) };
    assert_eq!(per_day, vec![(1, 1), (1, 1), (1, 1), past_cap, past_cap]);
    assert_eq!(
        ledger(&pool).await,
        vec![
            (1, d("2026-10-02"), 100),
            (1, d("2026-10-03"), 100),
            (1, d("2026-10-04"), 50)
        ]
    );
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_month_of_accrual_reconciles_with_its_settlement(pool: PgPool) {
    let loans: Vec<_> = fine_settler::demo::loans(fine_settler::demo::DemoSpec {
        loans: 400,
        seed: 5,
        month: d("2026-09-01"),
        first_id: 1,
    })
    .collect();
    insert(&pool, &loans).await;
    let first_overdue = loans.iter().map(|l| l.due_on).min().expect("loans") + chrono::Duration::days(1);
    let job = accrual(&pool, FinePolicy::DEFAULT).await;
    let mut day = first_overdue;
    while day <= d("2026-09-30") {
        let r = runner(&pool, "a", 50).run(&job, day_key(day, 0, 1), false).await;
        assert_eq!(r.outcome, Outcome::Settled);
        day += chrono::Duration::days(1);
    }
    // libraryd records ten returns late, back-dated three days before days already charged: running the days
    // again re-opens those with corrections to write, and the net ledger agrees with the fines settled after.
    let backdated = sqlx::query(
        "update loans set returned_on = returned_on - 3
         where id in (select id from loans where returned_on - due_on > 5 and returned_on between '2026-09-10' and '2026-09-30'
                      order by id limit 10)",
    )
    .execute(&pool)
    .await
    .expect("back-dated returns")
    .rows_affected();
    assert_eq!(backdated, 10);
    let mut day = first_overdue;
    let mut corrected = 0;
    while day <= d("2026-09-30") {
        let r = runner(&pool, "a", 50).run(&job, day_key(day, 0, 1), false).await;
        assert!(matches!(r.outcome, Outcome::Settled | Outcome::Skipped), "{r:?}");
        corrected += r.corrections;
        day += chrono::Duration::days(1);
    }
    assert_eq!(corrected, 30, "three days of each back-dated return");
    let s = runner(&pool, "a", 50)
        .run(&Settlement::new(), crate::helpers::key("2026-09-30", 0, 1), false)
        .await;
    assert_eq!(s.outcome, Outcome::Settled);

    let url = database_url(&pool);
    let verify = || {
        let mut cmd = fine_settler(&url);
        cmd.args(["verify", "--business-date", "2026-09-30", "--json"]);
        output(cmd)
    };
    let ok = verify();
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );
    let audit = report(&ok);
    let late: i64 = sqlx::query_scalar(
        "select count(*) from loans where returned_on between '2026-09-01' and '2026-09-30' and returned_on > due_on",
    )
    .fetch_one(&pool)
    .await
    .expect("late loans");
    assert!(late > 20);
    assert_eq!(
        audit["audit"]["ledger_checked"].as_i64(),
        Some(late),
        "every late loan reconciled: {audit}"
    );
    assert_eq!(audit["audit"]["ledger_mismatches"].as_i64(), Some(0));
    assert_eq!(audit["audit"]["over_accrued"].as_i64(), Some(0));

    // Tamper with one ledger row of a late loan returned in September.
    sqlx::query(
        "update fine_ledger set amount_cents = amount_cents + 1
         where (loan_id, accrual_date) = (
             select f.loan_id, f.accrual_date from fine_ledger f join loans l on l.id = f.loan_id
             where l.returned_on between '2026-09-01' and '2026-09-30' order by 1, 2 limit 1)",
    )
    .execute(&pool)
    .await
    .expect("tamper");
    let bad = verify();
    assert_eq!(bad.status.code(), Some(3));
    assert_eq!(report(&bad)["audit"]["ledger_mismatches"].as_i64(), Some(1));
}
}

/// Loan 1, overdue on a past day, with that day's charge queued in `fine_pending` to be retried `after` (an SQL
/// interval) from now; the day.
async fn queue_one_charge(pool: &PgPool, after: &str) -> NaiveDate {
    let day = past_day();
    insert(
        pool,
        &[loan(1, &(day - chrono::Duration::days(3)).to_string(), None)],
    )
    .await;
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, next_attempt_at) \
         values (1, $1, 100, now() + $2::interval)",
    )
    .bind(day)
    .bind(after)
    .execute(pool)
    .await
    .expect("queue a charge");
    day
}

crate::each_engine! {
/// `pending retry` stops before its next charge once its shutdown token is cancelled (the command line cancels it
/// on SIGINT/SIGTERM), says so and exits 1; run to its end, it charges the queue and says nothing of it.
#[sqlx::test(fixtures("default_policy"))]
async fn a_cancelled_pending_retry_stops_before_its_next_charge(pool: PgPool) {
    use fine_settler::jobs::oneshot::retry_pending;
    use tokio_util::sync::CancellationToken;

    // Not due for hours: only a retry-now pass takes it.
    let day = queue_one_charge(&pool, "1 hour").await;
    let engine = match crate::helpers::engine(&pool) {
        fine_settler::config::Engine::Citus => "citus",
        fine_settler::config::Engine::Postgresql => "postgresql",
    };
    let env: std::collections::HashMap<String, String> = [
        ("DATABASE_URL".to_string(), database_url(&pool)),
        ("FINE_SETTLER__DATABASE__ENGINE".to_string(), engine.to_string()),
    ]
    .into();
    let settings = fine_settler::config::load(None, &env)
        .and_then(|raw| raw.validate(&env))
        .expect("valid settings");
    let cancelled = CancellationToken::new();
    cancelled.cancel();
    let stopped = retry_pending(&settings, &db(&pool), false, false, cancelled)
        .await
        .expect("pass");
    assert!(stopped.interrupted, "{stopped:?}");
    assert_eq!((stopped.charged, stopped.pending, stopped.exit_code()), (0, 1, 1));
    assert_eq!(serde_json::to_value(stopped).expect("json")["interrupted"], true);
    assert!(ledger(&pool).await.is_empty(), "nothing charged");
    let done = retry_pending(&settings, &db(&pool), false, false, CancellationToken::new())
        .await
        .expect("pass");
    assert_eq!(
        (done.interrupted, done.charged, done.pending, done.exit_code()),
        (false, 1, 0, 0)
    );
    assert!(serde_json::to_value(done)
        .expect("json")
        .get("interrupted")
        .is_none());
    assert_eq!(ledger(&pool).await, vec![(1, day, 100)]);
    // A signal that finds nothing left to try interrupted nothing: the pass is complete, exit 0.
    let cancelled = CancellationToken::new();
    cancelled.cancel();
    let empty = retry_pending(&settings, &db(&pool), false, false, cancelled)
        .await
        .expect("pass");
    assert_eq!(
        (empty.interrupted, empty.pending, empty.exit_code()),
        (false, 0, 0)
    );
}
}

crate::each_engine! {
/// A second SIGINT ends `pending retry` at once (exit 1), even while a charge waits on the server: the first asks
/// it to stop between two charges, and an operator who presses Ctrl-C again is not kept waiting.
#[sqlx::test(fixtures("default_policy"))]
async fn a_second_sigint_ends_pending_retry_at_once(pool: PgPool) {
    queue_one_charge(&pool, "0s").await;
    slow_down(&pool, "insert on fine_ledger", 60.0).await;
    let mut cmd = fine_settler(&database_url(&pool));
    cmd.args(["pending", "retry"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = spawn(&mut cmd);
    let log = crate::helpers::StderrLog::collect(&mut child);
    wait_until("the charge waiting in the slow trigger", Duration::from_secs(20), || async {
        crate::helpers::sleeping(&pool, "%").await > 0
    })
    .await;
    crate::helpers::signal(&child, "INT");
    wait_until("the first signal taken", Duration::from_secs(5), || async {
        log.contains("shutdown requested")
    })
    .await;
    crate::helpers::signal(&child, "INT");
    let (code, _) = crate::helpers::exit_of(child, Duration::from_secs(5)).await;
    let err = log.finish();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("second shutdown signal"), "{err}");
    assert!(ledger(&pool).await.is_empty(), "nothing charged");
}
}

/// A cap (so that a batch locks each loan), and `times` as many open loans due on `due_on` (an SQL expression) as
/// the server's lock table holds, at most a batch's maximum (100,000) — on the test clusters (64 × 400 slots)
/// more than the table holds with whatever room the server has to spare. Returns how many.
async fn more_loans_than_the_lock_table(pool: &PgPool, due_on: &str, times: i64) -> i64 {
    crate::helpers::add_versions(pool, "update fine_policies set cap_cents = 1000").await;
    let slots: i64 = sqlx::query_scalar(
        "select current_setting('max_locks_per_transaction')::bigint
                * (current_setting('max_connections')::bigint + current_setting('max_prepared_transactions')::bigint)",
    )
    .fetch_one(pool)
    .await
    .expect("lock table");
    let loans = (times * slots).min(100_000);
    sqlx::query(&format!(
        "insert into loans (id, member_id, book_id, borrowed_on, due_on)
         select g, 1, 1, {due_on} - 20, {due_on} from generate_series(1, $1::bigint) g"
    ))
    .bind(loans)
    .execute(pool)
    .await
    .expect("loans");
    loans
}

crate::each_engine! {
/// A batch size whose loan locks (one per loan with a cap) do not fit in the server's lock table is cut to a
/// quarter of the table: the day is accrued whole, in more batches, and the log says why. Before, every attempt
/// of the run failed with "out of shared memory" — and filled the table libraryd shares meanwhile.
#[sqlx::test(fixtures("default_policy"))]
async fn a_batch_too_big_for_the_servers_lock_table_is_cut_to_fit(pool: PgPool) {
    let loans = more_loans_than_the_lock_table(&pool, "date '2026-10-01'", 2).await;
    let mut cmd = fine_settler(&database_url(&pool));
    cmd.env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "100000")
        .args(["accrue", "--date", "2026-10-10"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .expect("join");
    let run = report(&out);
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        (run["outcome"].as_str(), run["updated"].as_i64()),
        (Some("settled"), Some(loans)),
        "{run}\n{log}"
    );
    assert!(
        log.contains("accrual.batch_size is more loan locks than a quarter of the server's lock table"),
        "{log}"
    );
    let charged: i64 =
        sqlx::query_scalar("select count(*) from fine_ledger where accrual_date = '2026-10-10'")
            .fetch_one(&pool)
            .await
            .expect("ledger");
    assert_eq!(charged, loans);

    // A backfill's batches run `--concurrency` at a time: each gets its share.
    let mut cmd = fine_settler(&database_url(&pool));
    cmd.env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "100000")
        .env("FINE_SETTLER__DATABASE__MAX_CONNECTIONS", "2")
        .args([
            "backfill",
            "--job",
            "overdue-accrual",
            "--from",
            "2026-10-11",
            "--to",
            "2026-10-12",
        ])
        .args(["--concurrency", "2"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .expect("join");
    let summary = report(&out);
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        (summary["settled"].as_i64(), summary["updated"].as_i64()),
        (Some(2), Some(loans)),
        "{summary}\n{log}"
    );
    assert!(log.contains(r#""batches_at_once":2"#), "{log}");
}
}

crate::each_engine! {
/// The same cut in a replica: its accrual runs use batches that fit its share of the server's lock table (the
/// fleet's replicas, one per shard, accrue at once: here shard 0 of 2; read once, at its first accrual run), and
/// yesterday is accrued whole for its shard.
#[sqlx::test(fixtures("default_policy"))]
async fn a_replicas_batches_too_big_for_the_servers_lock_table_are_cut_to_fit(pool: PgPool) {
    // Due three days ago: yesterday is owed (and its day before), whatever the replica's zone.
    let loans = more_loans_than_the_lock_table(&pool, "current_date - 3", 4).await;
    let mut cmd = fine_settler(&database_url(&pool));
    cmd.env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
        .env("FINE_SETTLER__SETTLEMENT__ENABLED", "false")
        .env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "100000")
        .env("FINE_SETTLER__INSTANCE__SHARD", "0")
        .env("FINE_SETTLER__INSTANCE__SHARDS", "2")
        .args(["run", "--once"]);
    let out = tokio::task::spawn_blocking(move || output(cmd))
        .await
        .expect("join");
    let log = String::from_utf8_lossy(&out.stderr);
    assert_success(&out);
    let (charged, of_shard): (i64, i64) = sqlx::query_as(
        "select (select count(*) from fine_ledger
                 where accrual_date = (select max(accrual_date) from fine_ledger)),
                (select count(*) from loans where fine_settler_shard_of(id, 2) = 0)",
    )
    .fetch_one(&pool)
    .await
    .expect("ledger");
    assert!(
        of_shard > 0 && of_shard < loans,
        "shard 0 holds part of the {loans} loans"
    );
    assert_eq!(charged, of_shard, "{log}");
    assert!(log.contains(r#""batches_at_once":2"#), "{log}");
    let failed: i64 = sqlx::query_scalar("select count(*) from job_runs where status <> 'SUCCESS'")
        .fetch_one(&pool)
        .await
        .expect("runs");
    assert_eq!(failed, 0, "{log}");
    assert_eq!(
        log.matches("accrual.batch_size is more loan locks than a quarter of the server's lock table")
            .count(),
        1,
        "warned once: {log}"
    );
}
}

/// Isolating a rejected batch runs each charge under a short statement timeout; the batch's later statements
/// (relieving held loans, its fence) run under the one it had before: a short timeout left on them failed a batch
/// whose relief took longer, at every retry of its run.
#[sqlx::test(fixtures("default_policy"))]
async fn an_isolated_batch_gives_its_statements_back_their_timeout(pool: PgPool) {
    use fine_settler::{
        jobs::runner::BatchJob,
        store::ledger::{Overdue, Scope},
    };
    let day = d("2026-10-10");
    mixed_loans(&pool, day).await;
    let overdue = overdue_on(&pool, day).await;
    block_charges(&pool, &overdue[..1]).await;
    let job = accrual(&pool, FinePolicy::DEFAULT).await.within(Scope::Full);
    let rows: Vec<Overdue> = overdue.iter().map(|&id| Overdue { id }).collect();
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("set local statement_timeout = '37s'")
        .execute(&mut *tx)
        .await
        .expect("set");
    let written = job
        .write(&mut tx, &day_key(day, 0, 1), 1, &rows)
        .await
        .expect("the batch writes the charges it can");
    assert_eq!(written.updated, overdue.len() as u64 - 1, "{written:?}");
    let timeout: String = sqlx::query_scalar("select current_setting('statement_timeout')")
        .fetch_one(&mut *tx)
        .await
        .expect("timeout");
    assert_eq!(timeout, "37s");
    tx.rollback().await.expect("rollback");
}
