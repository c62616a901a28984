//! The accrual ledger converges to what is owed: a day's amount is a function of the loan (never of the order in
//! which days are charged), corrections bring charged days to what is owed after libraryd changes a loan — once
//! each, append-only, inside the run's fence — and the re-check finds them from the loans that changed.

use std::{collections::BTreeMap, time::Duration};

use chrono::NaiveDate;
use fine_settler::store::ledger_writes::LedgerWrites;
use fine_settler::{
    backoff::Backoff,
    fine::FinePolicy,
    jobs::{
        accrual::{compensate, Accrual},
        JobName, Outcome, RunKey,
    },
    shard::ShardSpec,
    store::{
        corrections,
        ledger::{self, Scope},
    },
};
use sqlx::PgPool;

use crate::helpers::{d, db, insert, loan, runner};

/// The accrual job, with the database's rules replaced by `policy` (one `default` version).
async fn accrual(pool: &PgPool, policy: FinePolicy) -> Accrual {
    crate::helpers::set_policy(pool, policy).await;
    Accrual {
        backoff: Backoff::new(Duration::from_millis(100), Duration::from_millis(250)),
        row_timeout: Duration::from_millis(500),
        isolation_budget: Duration::from_secs(5),
        lock_timeout: Duration::from_secs(2),
        scope: Scope::Full,
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

fn days(from: &str, to: &str) -> Vec<NaiveDate> {
    d(from).iter_days().take_while(|x| *x <= d(to)).collect()
}

/// The net ledger, one entry per (loan, day) whose net is not zero, as finance reads it.
async fn net(pool: &PgPool) -> BTreeMap<(i64, NaiveDate), i64> {
    let rows: Vec<(i64, NaiveDate, i64)> =
        sqlx::query_as("select loan_id, accrual_date, net_cents from fine_ledger_net order by 1, 2")
            .fetch_all(pool)
            .await
            .expect("net ledger");
    rows.into_iter().map(|(l, day, n)| ((l, day), n)).collect()
}

/// The first charges, as `fine_ledger` holds them.
async fn charges(pool: &PgPool) -> Vec<(i64, NaiveDate, i64)> {
    sqlx::query_as("select loan_id, accrual_date, amount_cents from fine_ledger order by 1, 2")
        .fetch_all(pool)
        .await
        .expect("ledger")
}

/// The oracle: what each loan owes for each of `days`, computed in Rust from the loans as they are now.
async fn owed(pool: &PgPool, policy: &FinePolicy, days: &[NaiveDate]) -> BTreeMap<(i64, NaiveDate), i64> {
    let loans: Vec<(i64, NaiveDate, Option<NaiveDate>)> =
        sqlx::query_as("select id, due_on, returned_on from loans order by id")
            .fetch_all(pool)
            .await
            .expect("loans");
    let mut owed = BTreeMap::new();
    for (id, due, returned) in loans {
        for day in days {
            let amount = policy.day_amount(due, returned, *day).get();
            if amount > 0 {
                owed.insert((id, *day), amount);
            }
        }
    }
    owed
}

async fn reset(pool: &PgPool) {
    sqlx::query("truncate fine_ledger, fine_ledger_corrections, fine_pending, job_runs, job_run_attempts")
        .execute(pool)
        .await
        .expect("reset");
}

/// Loans of every shape the cap meets: out since before the window, due inside it, returned inside it.
async fn library(pool: &PgPool) {
    let mut loans = Vec::new();
    for id in 1..=60i64 {
        let due = d("2026-10-25") + chrono::Duration::days(id % 20);
        let returned = (id % 3 == 0).then(|| due + chrono::Duration::days(2 + id % 9));
        let mut l = loan(id, "2026-01-01", None);
        l.due_on = due;
        l.borrowed_on = due - chrono::Duration::days(21);
        l.returned_on = returned;
        loans.push(l);
    }
    insert(pool, &loans).await;
}

async fn run_days(pool: &PgPool, job: &Accrual, days: &[NaiveDate]) {
    for day in days {
        let r = runner(pool, "seq", 7).run(job, day_key(*day, 0, 1), false).await;
        assert!(matches!(r.outcome, Outcome::Settled | Outcome::Skipped), "{r:?}");
    }
}

/// Ascending, descending, all days at once, and two shard counts at once: every order of runs leaves, row for
/// row, the ledger one sequential run leaves — each day at its canonical amount — with a cap that most loans
/// reach inside the window.
#[sqlx::test(fixtures("default_policy"))]
async fn every_order_of_runs_leaves_the_ledger_of_one_sequential_run(pool: PgPool) {
    library(&pool).await;
    let policy = FinePolicy::new(100, 1, 550).expect("policy");
    let job = accrual(&pool, policy).await;
    let window = days("2026-11-01", "2026-11-25");
    let expected = owed(&pool, &policy, &window).await;
    assert!(expected.len() > 250, "the library has work: {}", expected.len());

    run_days(&pool, &job, &window).await;
    let sequential = charges(&pool).await;
    assert_eq!(net(&pool).await, expected, "ascending");

    reset(&pool).await;
    let mut backwards = window.clone();
    backwards.reverse();
    run_days(&pool, &job, &backwards).await;
    assert_eq!(charges(&pool).await, sequential, "descending");

    reset(&pool).await;
    let all_at_once = window.iter().enumerate().map(|(i, day)| {
        let (pool, job) = (pool.clone(), job);
        // Half the days under one shard, half under two shards (whose keys overlap the first count's loans).
        let key = if i % 2 == 0 {
            vec![day_key(*day, 0, 1)]
        } else {
            vec![day_key(*day, 0, 2), day_key(*day, 1, 2)]
        };
        async move {
            for k in key {
                let r = runner(&pool, &format!("c{i}"), 5).run(&job, k, false).await;
                assert_eq!(r.outcome, Outcome::Settled, "{r:?}");
            }
        }
    });
    futures_util::future::join_all(all_at_once).await;
    assert_eq!(charges(&pool).await, sequential, "all at once");
    let corrections: i64 = sqlx::query_scalar("select count(*) from fine_ledger_corrections")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(corrections, 0, "nothing changed, nothing corrected");
}

crate::each_engine! {
/// Changes libraryd makes after days were charged: a return back-dated before them, a due date moved later, a
/// due date moved earlier (more days owed, and the cap reached sooner), a return removed. Re-running the days
/// appends corrections — never updating a charge — after which the net ledger is what is owed; running them
/// again writes nothing more.
#[sqlx::test(fixtures("default_policy"))]
async fn corrections_bring_changed_loans_to_what_is_owed_once(pool: PgPool) {
    insert(
        &pool,
        &[
            loan(1, "2026-11-01", None),               // returned back-dated to 11-04
            loan(2, "2026-11-01", None),               // due date moved later, to 11-06
            loan(3, "2026-11-05", None), // due date moved earlier, to 10-31: the cap comes sooner
            loan(4, "2026-11-01", Some("2026-11-03")), // return removed: out again
        ],
    )
    .await;
    let policy = FinePolicy::new(100, 0, 450).expect("policy");
    let job = accrual(&pool, policy).await;
    let window = days("2026-11-01", "2026-11-10");
    run_days(&pool, &job, &window).await;
    let before = charges(&pool).await;

    for change in [
        "update loans set returned_on = '2026-11-04' where id = 1",
        "update loans set due_on = '2026-11-06' where id = 2",
        "update loans set due_on = '2026-10-31' where id = 3",
        "update loans set returned_on = null where id = 4",
    ] {
        sqlx::query(change)
            .execute(&pool)
            .await
            .expect("libraryd's change");
    }
    // One pass, oldest day first, as `backfill --reprocess all` of days before the catch-up window runs: loan 3's
    // new days come before the days that now owe less, whose charges hold the whole cap; the run of each new day
    // brings those down first (a positive amount never takes the net past the cap), so nothing is left short.
    run_days(&pool, &job, &window).await;
    let expected = owed(&pool, &policy, &window).await;
    assert_eq!(net(&pool).await, expected);
    let after = charges(&pool).await;
    assert!(
        before.iter().all(|c| after.contains(c)),
        "no charge was changed or removed"
    );

    let reasons: Vec<(i64, String, i64)> = sqlx::query_as(
        "select loan_id, reason, count(*) from fine_ledger_corrections group by 1, 2 order by 1, 2",
    )
    .fetch_all(&pool)
    .await
    .expect("reasons");
    assert_eq!(
        reasons,
        vec![
            (1, "returned".to_string(), 2),
            (2, "due-date-moved".to_string(), 5),
            (3, "cap".to_string(), 5),
        ],
        "loan 1 was charged up to the cap (11-02..11-06) and owes up to 11-04; loan 2 owes from 11-07; loan 3's \
         charged days 11-06..11-10 are past the cap once it is due 10-31; loan 4's days from 11-04 were never \
         charged (it had been returned) and are charged now"
    );

    // Again: nothing more to correct, and nothing is corrected twice.
    run_days(&pool, &job, &window).await;
    let total: i64 = sqlx::query_scalar("select count(*) from fine_ledger_corrections")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(total, 12);

    // The return of loan 1 removed again: its corrected days are owed again.
    sqlx::query("update loans set returned_on = null where id = 1")
        .execute(&pool)
        .await
        .expect("change");
    run_days(&pool, &job, &window).await;
    assert_eq!(net(&pool).await, owed(&pool, &policy, &window).await);
    let reinstated: i64 =
        sqlx::query_scalar("select count(*) from fine_ledger_corrections where reason = 'reinstated'")
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(
        reinstated, 2,
        "11-05 and 11-06 (50 cents: it reaches the cap of 450) again"
    );
}
}

crate::each_engine! {
/// Two runs correcting the same day at the same time (the day under one shard count and under two, whose keys
/// are different) write each correction once: the second finds its number taken.
#[sqlx::test(fixtures("default_policy"))]
async fn concurrent_runs_correct_each_day_once(pool: PgPool) {
    let loans: Vec<_> = (1..=200).map(|id| loan(id, "2026-11-01", None)).collect();
    insert(&pool, &loans).await;
    let job = accrual(&pool, FinePolicy::new(100, 0, 0).expect("policy")).await;
    let window = days("2026-11-02", "2026-11-06");
    run_days(&pool, &job, &window).await;
    sqlx::query("update loans set returned_on = '2026-11-02'")
        .execute(&pool)
        .await
        .expect("back-dated returns");
    for _ in 0..3 {
        sqlx::query("truncate fine_ledger_corrections")
            .execute(&pool)
            .await
            .expect("reset");
        let runs = window.iter().flat_map(|day| {
            [day_key(*day, 0, 1), day_key(*day, 0, 2), day_key(*day, 1, 2)]
                .into_iter()
                .map(|k| {
                    let (pool, job) = (pool.clone(), job);
                    async move { runner(&pool, "x", 50).run(&job, k, true).await }
                })
        });
        for r in futures_util::future::join_all(runs).await {
            assert_eq!(r.outcome, Outcome::Settled, "{r:?}");
        }
        let dup: i64 = sqlx::query_scalar(
            "select count(*) from (select loan_id, accrual_date from fine_ledger_corrections
                                   group by 1, 2 having count(*) > 1) x",
        )
        .fetch_one(&pool)
        .await
        .expect("duplicates");
        assert_eq!(dup, 0, "a day corrected twice");
        let left = net(&pool).await;
        assert_eq!(left.len(), 200, "only 11-02 is owed");
        assert!(left.keys().all(|(_, day)| *day == d("2026-11-02")));
    }
}
}

crate::each_engine! {
/// The re-check reads only the loans libraryd changed: it finds the days a changed loan needs, a run of those
/// days in the changed scope corrects them, and the next re-check clears the queue. A loan libraryd deleted is
/// reported, never corrected.
#[sqlx::test(fixtures("default_policy"))]
async fn the_recheck_finds_the_changed_loans_and_clears_them_once_corrected(pool: PgPool) {
    let loans: Vec<_> = (1..=1_000).map(|id| loan(id, "2026-11-01", None)).collect();
    insert(&pool, &loans).await;
    let policy = FinePolicy::new(100, 0, 0).expect("policy");
    let job = accrual(&pool, policy).await;
    let window = days("2026-11-02", "2026-11-08");
    let (first, last) = (window[0], window[window.len() - 1]);
    run_days(&pool, &job, &window).await;
    let shard = ShardSpec::SINGLE;
    let pool_db = db(&pool);
    // Loans inserted already overdue were queued by the insert trigger; nothing to do for them.
    let recheck = || corrections::recheck(&pool_db, shard, first, last, 100_000, true, Duration::ZERO);
    let initial = recheck().await.expect("recheck");
    assert_eq!(
        (initial.days.len(), initial.dirty, initial.marked),
        (0, 0, 1_000),
        "{initial:?}"
    );
    let second = recheck().await.expect("recheck");
    assert_eq!(second.cleared, 1_000, "found owed twice: cleared {second:?}");
    let idle = recheck().await.expect("recheck");
    assert_eq!(idle.changed, 0, "{idle:?}");

    sqlx::query("update loans set returned_on = '2026-11-05' where id % 100 = 7")
        .execute(&pool)
        .await
        .expect("back-dated returns");
    sqlx::query("delete from loans where id = 500")
        .execute(&pool)
        .await
        .expect("deleted");
    let found = recheck().await.expect("recheck");
    assert_eq!(found.changed, 11, "{found:?}");
    assert_eq!(found.dirty, 10, "{found:?}");
    assert_eq!(found.days, days("2026-11-06", "2026-11-08"));
    assert_eq!(found.orphaned, vec![500]);

    let changed = accrual(&pool, policy).await.within(Scope::Changed);
    for day in &found.days {
        let r = runner(&pool, "r", 100)
            .run(&changed, day_key(*day, 0, 1), false)
            .await;
        assert_eq!(r.outcome, Outcome::Settled, "{r:?}");
        assert!(r.reopened, "{r:?}");
        assert_eq!((r.scanned, r.corrections), (10, 10), "{r:?}");
    }
    let done = recheck().await.expect("recheck");
    assert_eq!(
        (done.changed, done.dirty, done.cleared),
        (11, 0, 1),
        "the deleted loan's change goes: {done:?}"
    );
    let done = recheck().await.expect("recheck");
    assert_eq!((done.changed, done.dirty, done.cleared), (10, 0, 10), "{done:?}");
    let mut left = net(&pool).await;
    left.retain(|(loan, _), _| *loan != 500);
    assert_eq!(left, owed(&pool, &policy, &window).await);
    let kept: i64 = sqlx::query_scalar("select count(*) from fine_ledger_net where loan_id = 500")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(kept, 7, "the deleted loan's ledger stays as charged");
}
}

crate::each_engine! {
/// `backfill --dry-run`'s count is what the run then writes, cap included: every day of a range counted up front
/// (as the dry run does, before anything runs), then the days run newest first — charges, and, after libraryd
/// back-dates returns, corrections.
#[sqlx::test(fixtures("default_policy"))]
async fn the_dry_run_counts_what_the_run_writes(pool: PgPool) {
    library(&pool).await;
    let policy = FinePolicy::new(100, 1, 550).expect("policy");
    let job = accrual(&pool, policy).await;
    let window = days("2026-11-01", "2026-11-25");
    let counted = count_days(&pool, &window).await;
    let written = run_counting(&pool, &job, &window).await;
    assert_eq!(written, counted);
    assert!(counted.iter().map(|c| c.1 .0).sum::<i64>() > 250, "{counted:?}");

    sqlx::query("update loans set returned_on = due_on + 3 where returned_on is null and id % 2 = 0")
        .execute(&pool)
        .await
        .expect("back-dated returns");
    let counted = count_days(&pool, &window).await;
    let written = run_counting(&pool, &job, &window).await;
    assert_eq!(written, counted);
    let corrections: i64 = counted.iter().map(|c| c.1 .1).sum();
    assert!(
        corrections > 50,
        "the back-dated returns were corrected: {corrections}"
    );
}
}

/// The dry run's (charges, corrections) of each day, counted before any of them runs.
async fn count_days(pool: &PgPool, days: &[NaiveDate]) -> Vec<(NaiveDate, (i64, i64))> {
    let mut counted = Vec::new();
    for day in days {
        let work = ledger::count_work(&db(pool), *day, ShardSpec::SINGLE, i64::MIN)
            .await
            .expect("count");
        counted.push((*day, work));
    }
    counted
}

/// Runs `days` newest first (a forced run, as `--reprocess all`); what each wrote, in the order of `days`.
async fn run_counting(pool: &PgPool, job: &Accrual, days: &[NaiveDate]) -> Vec<(NaiveDate, (i64, i64))> {
    let mut written = Vec::new();
    for day in days.iter().rev() {
        let r = runner(pool, "a", 7).run(job, day_key(*day, 0, 1), true).await;
        assert_eq!(r.outcome, Outcome::Settled, "{r:?}");
        written.push((*day, (r.updated, r.corrections)));
    }
    written.reverse();
    written
}

/// An upgrade from a ledger charged in the old order (each charge `least(rate, cap − what the ledger held)`, so
/// the days charged first took the money): the upgrade queues every loan with a charge, and the re-checks and
/// the runs of the days they re-open bring the net ledger to the canonical amounts by appending corrections
/// (reason `canonical`) and the days the old order skipped — never by rewriting a row.
#[sqlx::test(migrations = false)]
async fn an_old_order_ledger_is_brought_to_canonical_amounts_by_corrections(pool: PgPool) {
    use fine_settler::store::migrations::MIGRATOR;
    let before_upgrade = sqlx::migrate::Migrator {
        migrations: MIGRATOR
            .migrations
            .iter()
            .filter(|m| m.version < 20261202000012)
            .cloned()
            .collect(),
        ..sqlx::migrate::Migrator::DEFAULT
    };
    before_upgrade.run(&pool).await.expect("the previous schema");
    library(&pool).await;
    let policy = FinePolicy::new(100, 1, 550).expect("policy");
    let window = days("2026-11-01", "2026-11-25");
    // The old charge, newest day first (as concurrent runs or a backfill with concurrency could leave it).
    for day in window.iter().rev() {
        sqlx::query(
            "insert into fine_ledger (loan_id, accrual_date, amount_cents)
             select c.id, $1, c.amount
             from (select l.id, least(100, 550 - coalesce((select sum(f.amount_cents) from fine_ledger f
                                                             where f.loan_id = l.id), 0)) as amount
                   from loans l
                   where l.due_on < $1::date - 1 and (l.returned_on is null or l.returned_on >= $1)) c
             where c.amount > 0
             on conflict do nothing",
        )
        .bind(day)
        .execute(&pool)
        .await
        .expect("old charge");
    }
    let old = charges(&pool).await;
    let expected = owed(&pool, &policy, &window).await;
    assert_ne!(net_of(&old), expected, "the old order left another ledger");

    let mut upgrade = crate::helpers::fine_settler(&crate::helpers::database_url(&pool));
    upgrade.arg("migrate");
    crate::helpers::assert_success(&crate::helpers::output(upgrade));

    let shard = ShardSpec::SINGLE;
    let changed = accrual(&pool, policy).await.within(Scope::Changed);
    let mut rounds = 0;
    loop {
        let found = corrections::recheck(
            &db(&pool),
            shard,
            window[0],
            window[24],
            100_000,
            true,
            Duration::ZERO,
        )
        .await
        .expect("recheck");
        if found.days.is_empty() {
            break;
        }
        rounds += 1;
        assert!(rounds <= 3, "converges within a few re-checks: {found:?}");
        for day in &found.days {
            let r = runner(&pool, "up", 50)
                .run(&changed, day_key(*day, 0, 1), false)
                .await;
            assert_eq!(r.outcome, Outcome::Settled, "{r:?}");
        }
    }
    assert_eq!(net(&pool).await, expected);
    let after = charges(&pool).await;
    assert!(
        old.iter().all(|c| after.contains(c)),
        "no charge was changed or removed"
    );
    let reasons: Vec<String> =
        sqlx::query_scalar("select distinct reason from fine_ledger_corrections order by 1")
            .fetch_all(&pool)
            .await
            .expect("reasons");
    // `canonical` for the old charges; `cap` for a day the old order skipped, charged in the first round only up
    // to what the cap left while the old days were still being corrected, and completed in the next.
    assert_eq!(reasons, ["canonical", "cap"]);
}

fn net_of(rows: &[(i64, NaiveDate, i64)]) -> BTreeMap<(i64, NaiveDate), i64> {
    rows.iter().map(|(l, day, a)| ((*l, *day), *a)).collect()
}

crate::each_engine! {
/// A charge priced from a loan's row before libraryd changed it, committed after a re-check found the changed loan
/// as owed: the change stays queued until a second re-check (at least a batch's time later) finds it owed too, so
/// the stale charge is seen and corrected instead of forgotten.
#[sqlx::test(fixtures("default_policy"))]
async fn a_charge_in_flight_when_the_loan_changes_is_not_forgotten(pool: PgPool) {
    insert(&pool, &[loan(1, "2026-12-01", None)]).await;
    let policy = FinePolicy::new(100, 0, 0).expect("policy");
    let window = days("2026-12-02", "2026-12-05");
    run_days(&pool, &accrual(&pool, policy).await, &window[..3]).await;
    let shard = ShardSpec::SINGLE;
    let pool_db = db(&pool);
    let recheck = || corrections::recheck(&pool_db, shard, window[0], window[3], 100, true, Duration::ZERO);
    // The loan was queued by its insert (already overdue); start from an empty queue.
    sqlx::query("delete from fine_loan_changes")
        .execute(&pool)
        .await
        .expect("empty queue");

    // A batch of 12-05 prices loan 1 from its row as it is: still out.
    let mut batch = pool.begin().await.expect("begin");
    let charged = LedgerWrites::new(crate::helpers::engine(&pool))
        .charge(&mut batch, d("2026-12-05"), &[1], ledger::Clamp::Hold)
        .await
        .expect("charge");
    assert_eq!(charged.written, 1);
    // libraryd records the return, back-dated to 12-04, before the batch commits.
    sqlx::query("update loans set returned_on = '2026-12-04' where id = 1")
        .execute(&pool)
        .await
        .expect("return");
    let first = recheck().await.expect("recheck");
    assert_eq!((first.dirty, first.cleared), (0, 0), "{first:?}");
    batch.commit().await.expect("commit");
    let second = recheck().await.expect("recheck");
    assert_eq!(second.days, [d("2026-12-05")], "{second:?}");
    assert_eq!(second.dirty, 1, "{second:?}");
}
}

crate::each_engine! {
/// A due date moved earlier on a loan that reached its cap days ago, found only after the re-check let the loan go
/// (its days in the window were already as owed): one pass over the older days, oldest first, as `backfill
/// --reprocess all` runs them, still leaves every day as owed — the run of a new day that does not fit under the
/// cap corrects the loan's later days first, whether or not the loan is still queued — and the dry run counted
/// that pass's work beforehand.
#[sqlx::test(fixtures("default_policy"))]
async fn one_pass_after_a_due_date_moved_earlier_leaves_every_day_as_owed(pool: PgPool) {
    insert(&pool, &[loan(1, "2026-01-01", None)]).await;
    let policy = FinePolicy::new(100, 0, 1000).expect("policy");
    let job = accrual(&pool, policy).await;
    let charged = days("2026-01-02", "2026-01-12");
    run_days(&pool, &job, &charged).await;
    sqlx::query("update loans set due_on = '2025-12-29' where id = 1")
        .execute(&pool)
        .await
        .expect("libraryd moves the due date");
    sqlx::query("delete from fine_loan_changes")
        .execute(&pool)
        .await
        .expect("the re-check let it go");

    let pass = days("2025-12-30", "2026-01-12");
    let counted: i64 = count_days(&pool, &pass)
        .await
        .iter()
        .map(|(_, (charges, corrections))| charges + corrections)
        .sum();
    let mut written = 0;
    for day in &pass {
        let r = runner(&pool, "backfill", 7)
            .run(&job, day_key(*day, 0, 1), true)
            .await;
        assert_eq!(r.outcome, Outcome::Settled, "{r:?}");
        written += r.updated as i64 + r.corrections as i64;
    }
    assert_eq!(net(&pool).await, owed(&pool, &policy, &pass).await);
    assert_eq!(written, counted, "the dry run counted the pass's writes");
    let total: i64 = sqlx::query_scalar("select sum(net_cents)::bigint from fine_ledger_net")
        .fetch_one(&pool)
        .await
        .expect("total");
    assert_eq!(total, 1000);
}
}

crate::each_engine! {
/// A loan whose class libraryd changes between runs to one with another policy (the rate doubled, the cap
/// lowered) never gets a negative correction on a day it now owes more, never goes over the new cap, and one
/// pass leaves every day as the new policy prices it.
#[sqlx::test(fixtures("default_policy"))]
async fn a_changed_class_never_corrects_an_owed_day_downwards(pool: PgPool) {
    insert(&pool, &[loan(1, "2026-01-01", None)]).await;
    let before = FinePolicy::new(100, 0, 1000).expect("policy");
    let job = accrual(&pool, before).await;
    crate::helpers::add_versions(
        &pool,
        "insert into fine_policies (fine_class, effective_from, daily_rate_cents, grace_days, cap_cents) \
         values ('laptop', '4714-11-24 BC', 200, 0, 800)",
    )
    .await;
    let after = FinePolicy::new(200, 0, 800).expect("policy");
    let window = days("2026-01-02", "2026-01-12");
    run_days(&pool, &job, &window).await;
    sqlx::query("update loans set fine_class = 'laptop' where id = 1")
        .execute(&pool)
        .await
        .expect("libraryd reclassifies the loan");
    let queued: i64 = sqlx::query_scalar("select count(*) from fine_loan_changes where loan_id = 1")
        .fetch_one(&pool)
        .await
        .expect("queue");
    assert!(queued > 0, "a change of class is queued for the re-check");

    for day in &window {
        let r = runner(&pool, "again", 7)
            .run(&job, day_key(*day, 0, 1), true)
            .await;
        assert_eq!(r.outcome, Outcome::Settled, "{r:?}");
    }
    let wrong: i64 = sqlx::query_scalar(
        "select count(*) from fine_ledger_corrections c join fine_ledger_net n using (loan_id, accrual_date) \
         where c.amount_cents < 0 and n.net_cents > 0 and c.accrual_date < '2026-01-06'",
    )
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(wrong, 0, "the days now owing 200 were never corrected downwards");
    assert_eq!(net(&pool).await, owed(&pool, &after, &window).await);
}
}

crate::each_engine! {
/// A pending charge whose day no longer fits under the cap because later days hold more than they owe (the due
/// date moved earlier while it waited) is not written off as "not owed": the retry leaves it to the re-check,
/// queueing the loan, and the run of its day relieves the later days and charges it.
#[sqlx::test(fixtures("default_policy"))]
async fn a_pending_charge_held_back_by_the_cap_is_left_to_the_recheck(pool: PgPool) {
    insert(&pool, &[loan(1, "2026-01-01", None)]).await;
    let policy = FinePolicy::new(100, 0, 1000).expect("policy");
    let job = accrual(&pool, policy).await;
    run_days(&pool, &job, &days("2026-01-03", "2026-01-11")).await;
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at) \
         values (1, '2026-01-02', 100, 1, 'rejected by a trigger', now())",
    )
    .execute(&pool)
    .await
    .expect("a charge that failed");
    sqlx::query("update loans set due_on = '2025-12-31' where id = 1")
        .execute(&pool)
        .await
        .expect("libraryd moves the due date");
    sqlx::query("delete from fine_loan_changes")
        .execute(&pool)
        .await
        .expect("the re-check let it go");
    run_days(&pool, &job, &days("2026-01-01", "2026-01-01")).await;

    let done = fine_settler::jobs::accrual::compensate(&db(&pool), &job, Some(ShardSpec::SINGLE), true, 10)
        .await
        .expect("compensation pass");
    assert_eq!(
        (done.charged, done.not_owed, done.held_back),
        (0, 0, 1),
        "{done:?}"
    );
    let queued: i64 = sqlx::query_scalar("select count(*) from fine_loan_changes where loan_id = 1")
        .fetch_one(&pool)
        .await
        .expect("queue");
    assert!(queued > 0, "the loan is queued for the re-check");

    let r = runner(&pool, "recheck", 7)
        .run(&job, day_key(d("2026-01-02"), 0, 1), true)
        .await;
    assert_eq!(r.outcome, Outcome::Settled, "{r:?}");
    let window = days("2026-01-01", "2026-01-11");
    assert_eq!(net(&pool).await, owed(&pool, &policy, &window).await);
}
}

crate::each_engine! {
/// Under a cap a batch locks its loans (their sums guard the cap). A loan whose lock another transaction holds past
/// `claim.lock_timeout` is left out: the rest of the batch is charged and corrected and the run succeeds; the
/// left-out charge is queued for compensation and the left-out correction for the re-check, each done once the
/// lock is let go — instead of the whole run failing, at every tick, for as long as the lock is held.
#[sqlx::test(fixtures("default_policy"))]
async fn a_loan_locked_past_the_lock_timeout_is_left_out_and_queued_not_a_failed_run(pool: PgPool) {
    let day = d("2026-10-10");
    insert(
        &pool,
        &[
            loan(1, "2026-10-01", None),
            loan(2, "2026-10-01", None),
            loan(3, "2026-10-01", Some("2026-10-05")),
            loan(4, "2026-10-01", None),
        ],
    )
    .await;
    let policy = FinePolicy::new(100, 0, 10_000).expect("policy");
    let job = accrual(&pool, policy).await;
    // Loan 3 was charged on the day before its return was recorded: it needs a correction.
    sqlx::query("insert into fine_ledger (loan_id, accrual_date, amount_cents) values (3, $1, 100)")
        .bind(day)
        .execute(&pool)
        .await
        .expect("old charge");
    sqlx::query("delete from fine_loan_changes")
        .execute(&pool)
        .await
        .expect("nothing queued");

    // Another transaction holds loans 2 and 3 (a concurrent key of a backfill, a compensation retry).
    let mut peer = pool.begin().await.expect("begin");
    ledger::lock_loans(&mut peer, &[2, 3])
        .await
        .expect("lock the loans");
    let run = runner(&pool, "a", 10).run(&job, day_key(day, 0, 1), false).await;
    assert_eq!(run.outcome, Outcome::Settled, "{run:?}");
    assert_eq!((run.updated, run.corrections), (2, 0), "{run:?}");
    assert_eq!(
        charges(&pool).await,
        vec![(1, day, 100), (3, day, 100), (4, day, 100)],
        "the loans not held are charged; the held ones are left as they were"
    );
    let pending: Vec<(i64, String)> = sqlx::query_as("select loan_id, status from fine_pending")
        .fetch_all(&pool)
        .await
        .expect("pending");
    assert_eq!(
        pending,
        vec![(2, "PENDING".to_string())],
        "the held charge is queued"
    );
    let queued: Vec<i64> = sqlx::query_scalar("select loan_id from fine_loan_changes")
        .fetch_all(&pool)
        .await
        .expect("queued");
    assert_eq!(queued, vec![3], "the held correction is queued for the re-check");

    peer.rollback().await.expect("let go");
    let found = corrections::recheck(&db(&pool), ShardSpec::SINGLE, day, day, 100, true, Duration::ZERO)
        .await
        .expect("recheck");
    assert_eq!((found.days.clone(), found.dirty), (vec![day], 1), "{found:?}");
    let again = runner(&pool, "b", 10)
        .run(&job.within(Scope::Changed), day_key(day, 0, 1), false)
        .await;
    assert_eq!(again.outcome, Outcome::Settled, "{again:?}");
    assert!(again.reopened, "{again:?}");
    assert_eq!((again.updated, again.corrections), (0, 1), "{again:?}");
    let pass = compensate(&db(&pool), &job, None, false, 5).await.expect("pass");
    assert_eq!(pass.charged, 1, "{pass:?}");
    let mut expected = BTreeMap::new();
    for id in [1, 2, 4] {
        expected.insert((id, day), 100);
    }
    assert_eq!(
        net(&pool).await,
        expected,
        "every day as owed once the lock is let go"
    );
}
}

crate::each_engine! {
/// A loan left out of its batch (another transaction held it past `claim.lock_timeout`) whose day libraryd made
/// not owed while the batch waited (its return back-dated before the day) is not queued: there is nothing to
/// charge, and the queue holds only positive amounts — queued with nothing, it failed the whole run.
#[sqlx::test(fixtures("default_policy"))]
async fn a_left_out_loan_owing_nothing_by_then_is_not_queued_and_the_run_succeeds(pool: PgPool) {
    let day = d("2026-10-10");
    insert(&pool, &[loan(1, "2026-10-01", None), loan(2, "2026-10-01", None)]).await;
    let job = accrual(&pool, FinePolicy::new(100, 0, 10_000).expect("policy")).await;
    let mut peer = pool.begin().await.expect("begin");
    ledger::lock_loans(&mut peer, &[2]).await.expect("lock the loan");
    let run = tokio::spawn({
        let (pool, job) = (pool.clone(), job);
        async move { runner(&pool, "a", 10).run(&job, day_key(day, 0, 1), false).await }
    });
    // The batch waits for loan 2's lock; meanwhile libraryd records its return as before the day.
    crate::helpers::wait_until(
        "the batch waiting for loan 2",
        Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, bool>(
                "select exists (select 1 from pg_locks where locktype = 'advisory' and classid = 1718832228
                                                     and not granted)",
            )
            .fetch_one(&pool)
            .await
            .unwrap_or(false)
        },
    )
    .await;
    sqlx::query("update loans set returned_on = '2026-10-05' where id = 2")
        .execute(&pool)
        .await
        .expect("back-date the return");
    let run = run.await.expect("the run");
    assert_eq!(run.outcome, Outcome::Settled, "{run:?}");
    assert_eq!(run.updated, 1, "{run:?}");
    let pending: i64 = sqlx::query_scalar("select count(*) from fine_pending")
        .fetch_one(&pool)
        .await
        .expect("pending");
    assert_eq!(pending, 0, "nothing to charge is not queued");
    peer.rollback().await.expect("let go");
}
}

/// A loan's charges are kept under its id: under a new id its overdue days would be owed again, and charged a
/// second time beside the old id's charges, which no run corrects (the old id is a loan libraryd deleted). The
/// database refuses the renumbering of a charged loan, naming it; a loan with nothing charged keeps its freedom.
#[sqlx::test(fixtures("default_policy"))]
async fn a_charged_loan_cannot_change_its_id(pool: PgPool) {
    let job = accrual(&pool, FinePolicy::new(100, 0, 0).expect("policy")).await;
    let mut charged = loan(1, "2026-11-01", None);
    charged.borrowed_on = charged.due_on - chrono::Duration::days(21);
    let mut spare = loan(2, "2026-12-20", None);
    spare.borrowed_on = spare.due_on - chrono::Duration::days(21);
    insert(&pool, &[charged, spare]).await;
    run_days(&pool, &job, &days("2026-11-02", "2026-11-03")).await;
    assert_eq!(charges(&pool).await.len(), 2);

    let err = sqlx::query("update loans set id = 1001 where id = 1")
        .execute(&pool)
        .await
        .expect_err("a charged loan keeps its id");
    let db = err.as_database_error().expect("refused by the database");
    assert_eq!(db.code().as_deref(), Some("23001"), "{db}");
    assert!(db.message().contains("loan 1 "), "{db}");
    let ids: Vec<i64> = sqlx::query_scalar("select id from loans order by id")
        .fetch_all(&pool)
        .await
        .expect("ids");
    assert_eq!(ids, [1, 2], "nothing changed");

    sqlx::query("update loans set id = 1002 where id = 2")
        .execute(&pool)
        .await
        .expect("a loan with nothing charged may change its id");
    run_days(&pool, &job, &days("2026-11-02", "2026-11-03")).await;
    assert_eq!(charges(&pool).await.len(), 2, "no day charged twice");

    let refused = |e: sqlx::Error| {
        let db = e.as_database_error().expect("refused by the database");
        assert_eq!(db.code().as_deref(), Some("23001"), "{db}");
    };
    // A loan overdue by its own row, with nothing charged yet: a batch may be charging it this very moment (its
    // charge not yet committed, or not visible to libraryd's repeatable read snapshot).
    let mut overdue = loan(5, "2026-11-01", None);
    overdue.borrowed_on = overdue.due_on - chrono::Duration::days(21);
    let mut late = loan(6, "2026-11-01", Some("2026-11-03"));
    late.borrowed_on = late.due_on - chrono::Duration::days(21);
    insert(&pool, &[overdue, late]).await;
    for id in [5, 6] {
        refused(
            sqlx::query(&format!("update loans set id = {} where id = {id}", id + 1000))
                .execute(&pool)
                .await
                .expect_err("an overdue loan keeps its id"),
        );
    }
    // Loans with charges whose due date moved later meanwhile. A charge queued for compensation is a charge too.
    let mut queued = loan(3, "2099-11-01", None);
    queued.borrowed_on = queued.due_on - chrono::Duration::days(21);
    insert(&pool, &[queued]).await;
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, last_error, next_attempt_at)
         values (3, '2026-11-02', 100, 'test', now())",
    )
    .execute(&pool)
    .await
    .expect("queue a charge");
    refused(
        sqlx::query("update loans set id = 1003 where id = 3")
            .execute(&pool)
            .await
            .expect_err("a queued charge keeps the id"),
    );
    // The id judged is the one written, whatever libraryd's own BEFORE triggers do to it.
    crate::helpers::ddl(
        &pool,
        &[
            "create function libraryd_renumbers() returns trigger language plpgsql as $$
             begin new.id := new.id + 5000; return new; end $$",
            "create trigger loans_renumber before update on loans for each row
             when (new.member_id = 99) execute function libraryd_renumbers()",
        ],
    )
    .await;
    refused(
        sqlx::query("update loans set member_id = 99 where id = 1")
            .execute(&pool)
            .await
            .expect_err("renumbered by a BEFORE trigger"),
    );
    sqlx::query("drop trigger loans_renumber on loans")
        .execute(&pool)
        .await
        .expect("drop");
    // A charge in flight when libraryd renumbers the loan: the renumbering waits for it, then sees it.
    let mut flight = loan(4, "2099-11-01", None);
    flight.borrowed_on = flight.due_on - chrono::Duration::days(21);
    insert(&pool, &[flight]).await;
    let mut charging = pool.begin().await.expect("begin");
    sqlx::raw_sql(
        "select pg_advisory_xact_lock(1718832228, hashint8(4::bigint));
         insert into fine_ledger (loan_id, accrual_date, amount_cents) values (4, '2026-11-02', 100)",
    )
    .execute(&mut *charging)
    .await
    .expect("a charge in flight");
    let renumber = tokio::spawn({
        let pool = pool.clone();
        async move {
            sqlx::query("update loans set id = 1004 where id = 4")
                .execute(&pool)
                .await
        }
    });
    // The renumbering waits for the charge's lock (not a sleep: the wait is seen in pg_locks).
    crate::helpers::wait_until(
        "the renumbering waiting for loan 4's ledger lock",
        Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, bool>(
                "select exists (select 1 from pg_locks where locktype = 'advisory' and classid = 1718832228
                                                     and not granted)",
            )
            .fetch_one(&pool)
            .await
            .unwrap_or(false)
        },
    )
    .await;
    assert!(!renumber.is_finished(), "the renumbering waits for the charge");
    charging.commit().await.expect("commit the charge");
    refused(renumber.await.expect("join").expect_err("seen once committed"));
    let ids: Vec<i64> = sqlx::query_scalar("select id from loans order by id")
        .fetch_all(&pool)
        .await
        .expect("ids");
    assert_eq!(
        ids,
        [1, 3, 4, 5, 6, 1002],
        "only the loan never overdue was renumbered"
    );
}

/// The cap's guard and the calendar's lock take a lock in one statement and read what it protects in the next:
/// that holds only under read committed, where each statement sees what committed before it. A database (or
/// role) whose default is repeatable read or serializable must not change it: every job transaction runs under
/// read committed, whatever the server's default, with each `database.pooler`.
#[sqlx::test]
async fn job_transactions_are_read_committed_whatever_the_database_default(pool: PgPool) {
    use fine_settler::config::{DatabaseSettings, DatabaseUrl, Engine, Pooler};
    let name = pool
        .connect_options()
        .get_database()
        .expect("a test database")
        .to_string();
    sqlx::query(&format!(
        "alter database \"{name}\" set default_transaction_isolation = 'repeatable read'"
    ))
    .execute(&pool)
    .await
    .expect("alter database");
    for pooler in [Pooler::None, Pooler::Session, Pooler::Transaction] {
        let settings = DatabaseSettings {
            url: DatabaseUrl::parse(&crate::helpers::database_url(&pool)).expect("a valid URL"),
            max_connections: 1,
            connect_timeout: Duration::from_secs(10),
            pooler,
            engine: Engine::Postgresql,
        };
        let jobs = fine_settler::store::connect_lazy(&settings, "fine-settler-test", Duration::from_secs(60));
        let mut tx = jobs.begin().await.expect("begin");
        let isolation: String = sqlx::query_scalar("show transaction_isolation")
            .fetch_one(&mut *tx)
            .await
            .expect("isolation");
        assert_eq!(isolation, "read committed", "pooler {}", pooler.as_str());
        tx.rollback().await.expect("rollback");
        jobs.pool().close().await;
    }
}
