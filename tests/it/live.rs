//! libraryd keeps writing while fine-settler works: returns back-dated into a settled month, loans recorded late,
//! rows it keeps locked, triggers and deferred constraints that reject charges, and two runs charging the same
//! capped loan at once. Each test here failed before the behaviour it names was built.

use std::{process::Stdio, time::Duration};

use chrono::{DateTime, NaiveDate, Utc};
use fine_settler::{
    backoff::Backoff,
    calendar,
    fine::FinePolicy,
    jobs::{
        accrual::{compensate, Accrual},
        runner::Runner,
        settlement::Settlement,
        JobName, Outcome, RunKey,
    },
    shard::ShardSpec,
};
use fine_settler::{config::Engine, store::ledger_writes::LedgerWrites};
use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::helpers::{
    assert_success, claim_settings, d, daemon, database_url, db, due_now, fine_settler, insert, key, loan,
    oracle, output, report, runner, seed_run, settled, stop, LOCK_TIMEOUT,
};

/// The database's local date in Asia/Shanghai (the daemon's default zone), by the database clock.
async fn db_today(pool: &PgPool) -> NaiveDate {
    let now: DateTime<Utc> = sqlx::query_scalar("select now()")
        .fetch_one(pool)
        .await
        .expect("now");
    calendar::local_date(now, chrono_tz::Asia::Shanghai)
}

fn days(n: i64) -> chrono::Duration {
    chrono::Duration::days(n)
}

/// `run --once` of one replica (settlement only unless `extra` says otherwise); its reports and stderr.
fn run_once(url: &str, extra: &[(&str, &str)]) -> (Vec<serde_json::Value>, String) {
    let mut cmd = fine_settler(url);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.args(["run", "--once"]);
    let out = output(cmd);
    assert_success(&out);
    let reports = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("report line is JSON"))
        .collect();
    (reports, String::from_utf8_lossy(&out.stderr).into_owned())
}

async fn history_events(pool: &PgPool, job: &str, date: NaiveDate) -> Vec<String> {
    sqlx::query_scalar(
        "select event from job_run_attempts where job_name = $1 and business_date = $2 order by id",
    )
    .bind(job)
    .bind(date)
    .fetch_all(pool)
    .await
    .expect("history")
}

/// A `count(*)` (or any bigint) the test polls; 0 while the database is busy restarting.
async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(sql).execute(pool).await.expect(sql);
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_return_back_dated_into_a_settled_month_is_settled_by_the_next_tick_and_by_settle(pool: PgPool) {
    let url = database_url(&pool);
    let months = due_now(&pool, 3).await;
    let latest = *months.last().expect("a due month");
    let mid = (latest - days(10)).to_string();
    insert(
        &pool,
        &(100..150)
            .map(|id| loan(id, &(latest - days(20)).to_string(), Some(&mid)))
            .collect::<Vec<_>>(),
    )
    .await;
    // A book still out, which libraryd will record as returned (back-dated) after the month is settled.
    insert(&pool, &[loan(200, &(latest - days(25)).to_string(), None)]).await;
    let (first, _) = run_once(&url, &[]);
    assert_eq!(first.len(), 3, "three due months, each settled: {first:?}");

    // The book drop is processed the next morning: a new loan with an id below the cursor, and the open loan's
    // return, both back-dated into the settled month.
    insert(&pool, &[loan(7, &(latest - days(30)).to_string(), Some(&mid))]).await;
    sqlx::query("update loans set returned_on = $1 where id = 200")
        .bind(d(&mid))
        .execute(&pool)
        .await
        .expect("return");
    assert!(settled(&pool, &latest.to_string()).await.0 < oracle(&pool, &latest.to_string()).await.0);

    let (second, stderr) = run_once(&url, &[]);
    assert_eq!(
        second.len(),
        1,
        "only the month with late returns runs: {second:?}"
    );
    let r = &second[0];
    assert_eq!(r["business_date"], latest.to_string());
    assert_eq!(r["outcome"], "settled");
    assert_eq!(r["reopened"], true);
    assert_eq!(r["updated"], 2);
    assert_eq!(r["epoch"], 2);
    assert!(stderr.contains("late returns settled"), "{stderr}");
    assert_eq!(
        settled(&pool, &latest.to_string()).await,
        oracle(&pool, &latest.to_string()).await
    );
    assert_eq!(
        history_events(&pool, "fine-settlement", latest).await,
        ["claimed", "success", "reopened", "success"]
    );

    // By hand: `settle` without --force re-opens the key too, and says so.
    insert(&pool, &[loan(8, &(latest - days(30)).to_string(), Some(&mid))]).await;
    let mut settle = fine_settler(&url);
    settle.args(["settle", "--business-date", &latest.to_string()]);
    let out = output(settle);
    assert_success(&out);
    let r = report(&out);
    assert_eq!(
        (&r["outcome"], &r["reopened"], &r["updated"], &r["epoch"]),
        (
            &serde_json::json!("settled"),
            &serde_json::json!(true),
            &serde_json::json!(1),
            &serde_json::json!(3)
        )
    );
    assert_eq!(
        settled(&pool, &latest.to_string()).await,
        oracle(&pool, &latest.to_string()).await
    );

    // Nothing late any more: the next tick is idle, and a plain settle skips.
    let (third, _) = run_once(&url, &[]);
    assert!(third.is_empty(), "{third:?}");
    let mut settle = fine_settler(&url);
    settle.args(["settle", "--business-date", &latest.to_string()]);
    let r = report(&output(settle));
    assert_eq!(
        (&r["outcome"], &r["reopened"]),
        (&serde_json::json!("skipped"), &serde_json::json!(false))
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn outside_the_catch_up_window_nothing_reopens_by_itself_verify_reports_it_and_settle_fixes_it(
    pool: PgPool,
) {
    let url = database_url(&pool);
    let oldest_due = due_now(&pool, 3).await[0];
    // The month end before the window: settled long ago.
    let old = calendar::month_start(oldest_due).pred_opt().expect("date");
    seed_run(&pool, "fine-settlement", old, "SUCCESS", "long-gone", 1, "-1 day").await;
    let returned = (old - days(3)).to_string();
    insert(&pool, &[loan(5, &(old - days(9)).to_string(), Some(&returned))]).await;

    let (reports, _) = run_once(&url, &[]);
    assert!(
        reports.iter().all(|r| r["business_date"] != old.to_string()),
        "a key outside the window is not re-opened by itself: {reports:?}"
    );
    let verify = |expect: i32| {
        let mut cmd = fine_settler(&url);
        cmd.args(["verify", "--business-date", &old.to_string()]);
        let out = output(cmd);
        assert_eq!(
            out.status.code(),
            Some(expect),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(verify(3).contains("1 loans returned in the month are not settled"));
    let mut settle = fine_settler(&url);
    settle.args(["settle", "--business-date", &old.to_string()]);
    let r = report(&output(settle));
    assert_eq!(
        (&r["reopened"], &r["updated"]),
        (&serde_json::json!(true), &serde_json::json!(1))
    );
    verify(0);
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_loan_recorded_late_as_overdue_is_charged_when_the_tick_reopens_its_days(pool: PgPool) {
    let url = database_url(&pool);
    let today = db_today(&pool).await;
    let accrual_only = [
        ("FINE_SETTLER__ACCRUAL__ENABLED", "true"),
        ("FINE_SETTLER__SETTLEMENT__ENABLED", "false"),
    ];
    insert(&pool, &[loan(1, &(today - days(30)).to_string(), None)]).await;
    let (first, _) = run_once(&url, &accrual_only);
    assert_eq!(first.len(), 7);
    insert(&pool, &[loan(3, &(today + days(20)).to_string(), None)]).await;
    let (idle, _) = run_once(&url, &accrual_only);
    assert!(
        idle.is_empty(),
        "a loan not overdue yet re-opens nothing: {idle:?}"
    );
    // Recorded late: borrowed long ago, overdue all week; and a loan whose due date libraryd shortened.
    insert(&pool, &[loan(2, &(today - days(20)).to_string(), None)]).await;
    sqlx::query("update loans set due_on = $1 where id = 3")
        .bind(today - days(4))
        .execute(&pool)
        .await
        .expect("shorten");

    let (second, stderr) = run_once(&url, &accrual_only);
    assert_eq!(second.len(), 7, "every day of the window re-opened: {second:?}");
    assert!(second
        .iter()
        .all(|r| r["reopened"] == true && r["outcome"] == "settled"));
    assert!(stderr.contains("late overdue days charged"), "{stderr}");
    let per_loan: Vec<(i64, i64)> =
        sqlx::query_as("select loan_id, count(*) from fine_ledger group by 1 order by 1")
            .fetch_all(&pool)
            .await
            .expect("ledger");
    // Loan 3 is overdue on the days after its new due date: today-3 .. yesterday.
    assert_eq!(per_loan, [(1, 7), (2, 7), (3, 3)]);
    let (idle, _) = run_once(&url, &accrual_only);
    assert!(idle.is_empty(), "{idle:?}");
}

/// The accrual job, with the database's rules replaced by `policy` (one `default` version).
async fn accrual(pool: &PgPool, policy: FinePolicy, backoff: Duration) -> Accrual {
    crate::helpers::set_policy(pool, policy).await;
    Accrual {
        backoff: Backoff::new(backoff, backoff * 4),
        row_timeout: Duration::from_millis(500),
        isolation_budget: Duration::from_secs(5),
        lock_timeout: LOCK_TIMEOUT,
        scope: Default::default(),
        writes: LedgerWrites::new(Engine::Postgresql),
    }
}

fn day_key(day: NaiveDate) -> RunKey {
    RunKey {
        job: JobName::OverdueAccrual,
        business_date: day,
        shard: ShardSpec::SINGLE,
    }
}

async fn ledger_total(pool: &PgPool, loan_id: i64) -> i64 {
    sqlx::query_scalar("select coalesce(sum(net_cents), 0)::bigint from fine_ledger_net where loan_id = $1")
        .bind(loan_id)
        .fetch_one(pool)
        .await
        .expect("total")
}

#[sqlx::test(fixtures("default_policy"))]
async fn two_runs_of_different_days_never_charge_a_capped_loan_past_its_cap(pool: PgPool) {
    let day = d("2026-10-20");
    insert(&pool, &[loan(1, "2026-10-18", None)]).await;
    // Owed: 10-19 100, 10-20 100, 10-21 50 (cap 250). The ledger holds 200 on two later days, as a ledger charged
    // in another order (or before a due date moved) may, and each ledger insert takes half a second, so the two
    // runs overlap: whichever locks the loan first finds its day does not fit under the cap, corrects the later
    // days (owed nothing) and charges its day; the other then finds room for its own.
    exec(
        &pool,
        "insert into fine_ledger (loan_id, accrual_date, amount_cents)
         values (1, '2026-10-25', 100), (1, '2026-10-26', 100);
         create function slow_ledger() returns trigger language plpgsql as $$
         begin perform pg_sleep(0.5); return new; end $$;
         create trigger slow_ledger before insert on fine_ledger for each row execute function slow_ledger();",
    )
    .await;
    let job = accrual(
        &pool,
        FinePolicy::new(100, 0, 250).expect("policy"),
        Duration::from_secs(60),
    )
    .await;
    // Two replicas of the shard (or a manual accrue) running two days at once.
    let (ra, rb) = (runner(&pool, "a", 10), runner(&pool, "b", 10));
    let (a, b) = tokio::join!(
        ra.run(&job, day_key(day), false),
        rb.run(&job, day_key(day + days(1)), false),
    );
    assert_eq!((a.outcome, b.outcome), (Outcome::Settled, Outcome::Settled));
    assert_eq!(
        ledger_total(&pool, 1).await,
        150,
        "10-20 and 10-21 as owed, the later days corrected to nothing: the cap holds"
    );
    assert_eq!(
        (a.updated + b.updated, a.corrections + b.corrections),
        (2, 2),
        "both days charged in full, the two later days corrected once"
    );
}

/// A libraryd session holding row locks, released by `commit()`.
struct Libraryd(PgConnection);

impl Libraryd {
    async fn locks(pool: &PgPool, sql: &str) -> Libraryd {
        let mut conn = PgConnection::connect(&database_url(pool)).await.expect("connect");
        sqlx::raw_sql(&format!("begin; {sql}"))
            .execute(&mut conn)
            .await
            .expect("lock");
        Libraryd(conn)
    }

    async fn commit(mut self) {
        sqlx::raw_sql("commit")
            .execute(&mut self.0)
            .await
            .expect("commit");
    }
}

fn runner_with_lock_timeout(pool: &PgPool, owner: &str, batch_size: u32) -> Runner {
    let claim = claim_settings(Duration::from_millis(300));
    Runner::new(
        db(pool),
        owner.into(),
        &claim,
        batch_size,
        CancellationToken::new(),
    )
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_row_libraryd_keeps_locked_is_left_for_later_and_settled_once_released(pool: PgPool) {
    insert(
        &pool,
        &(1..=30)
            .map(|id| loan(id, "2026-10-05", Some("2026-10-20")))
            .collect::<Vec<_>>(),
    )
    .await;
    let libraryd = Libraryd::locks(&pool, "select * from loans where id = 12 for update").await;
    let job = Settlement::new();
    let k = key("2026-10-31", 0, 1);
    let first = runner_with_lock_timeout(&pool, "a", 10).run(&job, k, false).await;
    assert_eq!(
        (first.outcome, first.updated),
        (Outcome::Settled, 29),
        "{first:?}"
    );
    let unsettled: Vec<i64> = sqlx::query_scalar("select id from loans where fine_settled_at is null")
        .fetch_all(&pool)
        .await
        .expect("unsettled");
    assert_eq!(unsettled, [12]);

    // Still locked: the re-open leaves it again, and the key stays SUCCESS.
    let again = runner_with_lock_timeout(&pool, "b", 10).run(&job, k, false).await;
    assert_eq!(
        (again.outcome, again.reopened, again.updated),
        (Outcome::Settled, true, 0)
    );
    libraryd.commit().await;
    let metrics = std::sync::Arc::new(fine_settler::metrics::Metrics::new("0/1".into()));
    let last = runner_with_lock_timeout(&pool, "c", 10)
        .with_metrics(metrics.clone())
        .run(&job, k, false)
        .await;
    assert_eq!(
        (last.outcome, last.reopened, last.updated),
        (Outcome::Settled, true, 1)
    );
    let text = metrics.render();
    let series = |s: &str| text.lines().any(|l| l == s);
    assert!(
        series(r#"fine_settler_late_rows_total{job="fine-settlement",shard="0/1"} 1"#)
            && series(r#"fine_settler_claims_total{job="fine-settlement",shard="0/1",result="reopened"} 1"#),
        "{text}"
    );
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_charge_blocked_by_a_libraryd_lock_goes_to_pending_and_is_charged_once_released(pool: PgPool) {
    // libraryd keeps a balance per member, updated by a trigger on the ledger; a libraryd transaction holds
    // member 7's balance row.
    exec(
        &pool,
        "create table member_balances (member_id bigint primary key, cents bigint not null default 0);
         insert into member_balances values (1, 0), (7, 0);
         create function add_to_balance() returns trigger language plpgsql as $$
         begin
             update member_balances set cents = cents + new.amount_cents
             where member_id = (select member_id from loans where id = new.loan_id);
             return new;
         end $$;
         create trigger add_to_balance after insert on fine_ledger for each row execute function add_to_balance();",
    )
    .await;
    insert(
        &pool,
        &(1..=20)
            .map(|id| loan(id, "2026-10-01", None))
            .collect::<Vec<_>>(),
    )
    .await;
    exec(&pool, "update loans set member_id = 7 where id = 13").await;
    let libraryd = Libraryd::locks(
        &pool,
        "select * from member_balances where member_id = 7 for update",
    )
    .await;

    let job = accrual(&pool, FinePolicy::default(), Duration::from_millis(100)).await;
    let day = d("2026-10-20");
    let run = runner_with_lock_timeout(&pool, "a", 50)
        .run(&job, day_key(day), false)
        .await;
    assert_eq!((run.outcome, run.updated), (Outcome::Settled, 19), "{run:?}");
    let pending: Vec<(i64, String)> = sqlx::query_as("select loan_id, last_error from fine_pending")
        .fetch_all(&pool)
        .await
        .expect("pending");
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].0, 13);
    assert!(pending[0].1.contains("lock"), "{pending:?}");

    libraryd.commit().await;
    let done = compensate(&db(&pool), &job, Some(ShardSpec::SINGLE), false, 10)
        .await
        .expect("compensation");
    assert_eq!(done.charged, 1);
    let charged: i64 = sqlx::query_scalar("select count(*) from fine_ledger where accrual_date = $1")
        .bind(day)
        .fetch_one(&pool)
        .await
        .expect("ledger");
    assert_eq!(charged, 20);
}

#[sqlx::test(fixtures("default_policy"))]
async fn concurrent_compensation_passes_spend_one_attempt_per_backoff_period(pool: PgPool) {
    insert(&pool, &[loan(1, "2026-10-01", None), loan(2, "2026-10-01", None)]).await;
    // Both charges keep failing; loan 1's rejection takes 1 s, loan 2's 0.3 s.
    exec(
        &pool,
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (1, '2026-10-20', 100, 1, 'x', now() - interval '1 s'),
                (2, '2026-10-20', 100, 1, 'x', now() - interval '1 s');
         create function reject_slowly() returns trigger language plpgsql as $$
         begin
             perform pg_sleep(case when new.loan_id = 1 then 1.0 else 0.3 end);
             raise exception 'charge rejected for loan %', new.loan_id;
         end $$;
         create trigger reject_slowly before insert on fine_ledger for each row execute function reject_slowly();",
    )
    .await;
    // Two replicas of the shard read the same due list; each then reaches the charge the other just retried.
    let job = accrual(&pool, FinePolicy::default(), Duration::from_secs(60)).await;
    let shared = db(&pool);
    let pass = || compensate(&shared, &job, Some(ShardSpec::SINGLE), true, 10);
    let (a, b) = tokio::join!(pass(), pass());
    let (a, b) = (a.expect("pass a"), b.expect("pass b"));
    assert_eq!(a.retried + b.retried, 2, "{a:?} {b:?}");
    let attempts: Vec<i32> = sqlx::query_scalar("select attempts from fine_pending order by loan_id")
        .fetch_all(&pool)
        .await
        .expect("attempts");
    assert_eq!(attempts, [2, 2], "each charge retried once, not once per replica");
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_failing_compensation_pass_does_not_stop_settlement(pool: PgPool) {
    let url = database_url(&pool);
    let latest = *due_now(&pool, 1).await.last().expect("month");
    let returned = (latest - days(3)).to_string();
    insert(
        &pool,
        &(1..=10)
            .map(|id| loan(id, &(latest - days(8)).to_string(), Some(&returned)))
            .collect::<Vec<_>>(),
    )
    .await;
    // A due pending charge whose queue row cannot be changed: the pass fails with an error that is not a
    // rejected charge (as with a missing grant on fine_pending).
    exec(
        &pool,
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (1, current_date - 40, 100, 1, 'x', now() - interval '1 s');
         create function frozen_queue() returns trigger language plpgsql as $$
         begin raise exception 'permission denied for table fine_pending'; end $$;
         create trigger frozen_queue before update or delete on fine_pending
             for each row execute function frozen_queue();",
    )
    .await;
    let (reports, stderr) = run_once(
        &url,
        &[
            ("FINE_SETTLER__ACCRUAL__ENABLED", "true"),
            ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
        ],
    );
    assert!(
        reports
            .iter()
            .any(|r| r["job"] == "fine-settlement" && r["outcome"] == "settled" && r["updated"] == 10),
        "{reports:?}"
    );
    assert_eq!(
        stderr.matches("compensation pass failed").count(),
        1,
        "logged once: {stderr}"
    );
    assert_eq!(
        settled(&pool, &latest.to_string()).await,
        oracle(&pool, &latest.to_string()).await
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_deferred_constraint_that_rejects_a_charge_at_commit_queues_that_charge(pool: PgPool) {
    insert(
        &pool,
        &(1..=20)
            .map(|id| loan(id, "2026-10-01", None))
            .collect::<Vec<_>>(),
    )
    .await;
    exec(
        &pool,
        "create function reject_13() returns trigger language plpgsql as $$
         begin
             if new.loan_id = 13 then raise exception 'loan 13 is disputed'; end if;
             return null;
         end $$;
         create constraint trigger reject_13 after insert on fine_ledger deferrable initially deferred
             for each row execute function reject_13();",
    )
    .await;
    let job = accrual(&pool, FinePolicy::default(), Duration::from_millis(100)).await;
    let run = runner(&pool, "a", 50)
        .run(&job, day_key(d("2026-10-20")), false)
        .await;
    assert_eq!((run.outcome, run.updated), (Outcome::Settled, 19), "{run:?}");
    let pending: Vec<(i64, String)> = sqlx::query_as("select loan_id, last_error from fine_pending")
        .fetch_all(&pool)
        .await
        .expect("pending");
    assert_eq!(pending.len(), 1);
    assert!(
        pending[0].0 == 13 && pending[0].1.contains("disputed"),
        "{pending:?}"
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_pending_charge_for_a_day_no_longer_overdue_is_resolved_and_verify_reports_over_accrual(
    pool: PgPool,
) {
    insert(&pool, &[loan(1, "2026-10-01", None), loan(2, "2026-10-01", None)]).await;
    exec(
        &pool,
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (1, '2026-10-20', 100, 1, 'x', now() - interval '1 s');
         insert into fine_ledger (loan_id, accrual_date, amount_cents)
         select 2, d::date, 100 from generate_series('2026-10-02'::date, '2026-10-20', '1 day') d;
         update loans set returned_on = '2026-10-15' where id in (1, 2);",
    )
    .await;
    // Loan 1 was returned on the 15th, recorded late: nothing is owed for the 20th.
    let job = accrual(&pool, FinePolicy::default(), Duration::from_millis(100)).await;
    let done = compensate(&db(&pool), &job, Some(ShardSpec::SINGLE), true, 10)
        .await
        .expect("compensation");
    assert_eq!((done.charged, done.not_owed), (0, 1));
    assert_eq!(ledger_total(&pool, 1).await, 0);
    let pending: i64 = sqlx::query_scalar("select count(*) from fine_pending")
        .fetch_one(&pool)
        .await
        .expect("pending");
    assert_eq!(pending, 0);

    // Loan 2 was charged up to the 20th before its return on the 15th was recorded: over-accrued.
    let settle = runner(&pool, "s", 10)
        .run(&Settlement::new(), key("2026-10-31", 0, 1), false)
        .await;
    assert_eq!(settle.outcome, Outcome::Settled);
    let mut verify = fine_settler(&database_url(&pool));
    verify.args(["verify", "--business-date", "2026-10-31", "--json"]);
    let out = output(verify);
    assert_eq!(out.status.code(), Some(3));
    let audit: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(audit["audit"]["over_accrued"], 1, "{audit}");
    assert!(
        audit["violations"].to_string().contains("over-accrued"),
        "{audit}"
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_key_that_leaves_its_window_unfinished_is_reported_once(pool: PgPool) {
    let url = database_url(&pool);
    let oldest_due = due_now(&pool, 3).await[0];
    let left = calendar::month_start(oldest_due).pred_opt().expect("date");
    seed_run(&pool, "fine-settlement", left, "FAILED", "bad-data", 4, "-1 hour").await;
    let (reports, stderr) = run_once(&url, &[]);
    assert!(reports.iter().all(|r| r["business_date"] != left.to_string()));
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("left its catch-up window without succeeding"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains(&left.to_string()) && lines[0].contains("\"level\":\"error\""),
        "{}",
        lines[0]
    );
}

/// `accrue --date` asks the database what day it is, as the daemon does: a host clock three days behind does not
/// make yesterday "not over yet" (the test runs the binary under libfaketime; scripts/test.sh installs it).
#[sqlx::test(fixtures("default_policy"))]
async fn accrue_checks_its_date_against_the_database_clock(pool: PgPool) {
    let url = database_url(&pool);
    let yesterday = db_today(&pool).await - days(1);
    insert(&pool, &[loan(1, &(yesterday - days(10)).to_string(), None)]).await;
    let faketime = which("faketime")
        .expect("faketime (Debian's faketime package) is needed; scripts/test.sh installs it");
    let run = |date: NaiveDate| {
        let mut cmd = std::process::Command::new(&faketime);
        cmd.args(["-f", "-3d", env!("CARGO_BIN_EXE_fine-settler")])
            .args(["accrue", "--date", &date.to_string()])
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .env("DATABASE_URL", &url)
            .stdin(Stdio::null());
        cmd.output().expect("run under faketime")
    };
    let out = run(yesterday);
    assert_success(&out);
    assert_eq!(report(&out)["updated"], 1);
    // And today, by the database clock, is refused though the host thinks it is three days away.
    let out = run(yesterday + days(1));
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("--date"));
}

fn which(program: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|p| p.is_file())
    })
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_loan_due_at_the_end_of_the_calendar_does_not_stop_the_accrual(pool: PgPool) {
    insert(&pool, &[loan(1, "2026-10-01", None), loan(3, "2026-10-01", None)]).await;
    // PostgreSQL's last date: with a grace period, `due_on + grace` is past the calendar.
    exec(
        &pool,
        "insert into loans (id, member_id, book_id, borrowed_on, due_on) values (2, 1, 1, '2026-01-01', '5874897-12-31')",
    )
    .await;
    let job = accrual(
        &pool,
        FinePolicy::new(100, 1, 0).expect("policy"),
        Duration::from_secs(1),
    )
    .await;
    let run = runner(&pool, "a", 10)
        .run(&job, day_key(d("2026-10-20")), false)
        .await;
    assert_eq!((run.outcome, run.updated), (Outcome::Settled, 2), "{run:?}");
}

// No fixture: the command seeds the empty fine_policies from its [fine] keys.
#[sqlx::test]
async fn with_a_daily_rate_of_zero_accrual_days_do_not_reopen_at_every_tick(pool: PgPool) {
    let url = database_url(&pool);
    let today = db_today(&pool).await;
    insert(&pool, &[loan(1, &(today - days(30)).to_string(), None)]).await;
    let free = [
        ("FINE_SETTLER__ACCRUAL__ENABLED", "true"),
        ("FINE_SETTLER__SETTLEMENT__ENABLED", "false"),
        ("FINE_SETTLER__FINE__DAILY_RATE_CENTS", "0"),
    ];
    let (first, _) = run_once(&url, &free);
    assert_eq!(first.len(), 7);
    let (second, _) = run_once(&url, &free);
    assert!(
        second.is_empty(),
        "nothing is owed, so nothing is late: {second:?}"
    );
}

/// The first attempt of a finish still committing when its retry starts: the retry waits for it, matches
/// nothing, and must still see that the key is SUCCESS under its own epoch.
#[sqlx::test(fixtures("default_policy"))]
async fn a_retried_finish_racing_its_own_first_attempt_counts_as_finished(pool: PgPool) {
    use fine_settler::store::job_runs::{claim, finish, ClaimMode, Claimant, Ending};
    let k = key("2026-10-31", 0, 1);
    claim(&db(&pool), &k, "a", Duration::from_secs(60), ClaimMode::Free)
        .await
        .expect("claim");
    let mut first = pool.begin().await.expect("begin");
    sqlx::query("update job_runs set status = 'SUCCESS', lease_until = now() where epoch = 1")
        .execute(&mut *first)
        .await
        .expect("first attempt");
    let retry = tokio::spawn({
        let pool = pool.clone();
        async move {
            finish(
                &db(&pool),
                &k,
                Claimant { epoch: 1, owner: "a" },
                None,
                Ending::Success,
                0,
                0,
            )
            .await
        }
    });
    crate::helpers::wait_until(
        "the retry waits for the first attempt",
        Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, i64>(
                "select count(*) from pg_stat_activity
             where datname = current_database() and wait_event_type = 'Lock' and query like '%with done as%'",
            )
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
                == 1
        },
    )
    .await;
    first.commit().await.expect("commit the first attempt");
    assert!(
        retry.await.expect("task").expect("finish"),
        "finished, not a lost lease"
    );
}

/// A replica asked to stop during a long compensation backlog stops between charges and exits 0 within its drain
/// timeout; the rest of the queue waits for the next replica.
#[sqlx::test(fixtures("default_policy"))]
async fn sigterm_during_a_long_compensation_pass_stops_it_cleanly(pool: PgPool) {
    let url = database_url(&pool);
    insert(
        &pool,
        &(1..=200)
            .map(|id| loan(id, "2026-06-01", None))
            .collect::<Vec<_>>(),
    )
    .await;
    exec(
        &pool,
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         select id, '2026-06-20', 100, 1, 'x', now() - interval '1 s' from generate_series(1, 200) id;
         create function slow_ledger() returns trigger language plpgsql as $$
         begin perform pg_sleep(0.1); return new; end $$;
         create trigger slow_ledger before insert on fine_ledger for each row execute function slow_ledger();",
    )
    .await;
    let replica = daemon(
        &url,
        0,
        1,
        &[
            ("FINE_SETTLER__ACCRUAL__ENABLED", "true"),
            ("FINE_SETTLER__SETTLEMENT__ENABLED", "false"),
            ("FINE_SETTLER__SCHEDULE__DRAIN_TIMEOUT", "3s"),
        ],
    );
    let remaining = || count(&pool, "select count(*) from fine_pending");
    crate::helpers::wait_until(
        "the compensation pass under way",
        Duration::from_secs(20),
        || async { remaining().await < 195 },
    )
    .await;
    let (code, stderr) = stop(replica).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(remaining().await > 0, "stopped before the end of the backlog");
}

/// Two runs of different days charging the same capped loans, one of them isolating a rejected batch row by row:
/// the isolated charges take their loans' locks in the same order as every batch, so the two cannot deadlock.
#[sqlx::test(fixtures("default_policy"))]
async fn isolating_a_rejected_batch_cannot_deadlock_with_another_run(pool: PgPool) {
    use std::str::FromStr;
    insert(
        &pool,
        &(2..=4).map(|id| loan(id, "2026-10-01", None)).collect::<Vec<_>>(),
    )
    .await;
    // Loan 4's charge for the 20th is rejected; every other charge takes 0.4 s.
    exec(
        &pool,
        "create function slow_or_rejected() returns trigger language plpgsql as $$
         begin
             if new.loan_id = 4 and new.accrual_date = '2026-10-20' then raise exception 'loan 4 disputed'; end if;
             perform pg_sleep(0.4);
             return new;
         end $$;
         create trigger slow_or_rejected before insert on fine_ledger
             for each row execute function slow_or_rejected();",
    )
    .await;
    let job = accrual(
        &pool,
        FinePolicy::new(100, 0, 1_000_000).expect("policy"),
        Duration::from_secs(60),
    )
    .await;
    let a = tokio::spawn({
        let (pool, job) = (pool.clone(), job);
        async move {
            runner(&pool, "a", 10)
                .run(&job, day_key(d("2026-10-20")), false)
                .await
        }
    });
    // Run a holds its batch's three loan locks for the whole batch (its corrections, its charges, and the
    // isolation of the rejected charge), taken at once in the one lock order.
    crate::helpers::wait_until("run a isolating its batch", Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from pg_locks l join pg_database d on d.oid = l.database
             where l.locktype = 'advisory' and l.classid = 1718832228 and l.granted
               and d.datname = current_database()",
        )
        .fetch_one(&pool)
        .await
        .unwrap_or(0)
            == 3
    })
    .await;
    // Run b detects deadlocks late, so that a deadlock, if any, is detected by run a and shows in its queue.
    let patient = sqlx::postgres::PgPoolOptions::new()
        .connect_with(
            sqlx::postgres::PgConnectOptions::from_str(&database_url(&pool))
                .expect("url")
                .options([("deadlock_timeout", "10s")]),
        )
        .await
        .expect("connect");
    let b = runner(&patient, "b", 10)
        .run(&job, day_key(d("2026-10-21")), false)
        .await;
    let a = a.await.expect("run a");
    assert_eq!((a.outcome, a.updated), (Outcome::Settled, 2), "{a:?}");
    assert_eq!((b.outcome, b.updated), (Outcome::Settled, 3), "{b:?}");
    let pending: Vec<(i64, String)> = sqlx::query_as("select loan_id, last_error from fine_pending")
        .fetch_all(&pool)
        .await
        .expect("pending");
    assert_eq!(pending.len(), 1, "only the rejected charge waits: {pending:?}");
    assert_eq!(pending[0].0, 4);
}

/// A loan recorded late and returned inside both a settled month and the accrual window: the running replica's
/// next tick settles it (settlement's question runs at every tick), and its overdue days are charged by the next
/// accrual recheck although the loan is settled by then.
#[sqlx::test(fixtures("default_policy"))]
async fn a_late_return_settled_by_a_running_replica_is_also_accrued(pool: PgPool) {
    let url = database_url(&pool);
    let today = db_today(&pool).await;
    let month_end = calendar::month_start(today).pred_opt().expect("date");
    let replica = daemon(
        &url,
        0,
        1,
        &[
            ("FINE_SETTLER__ACCRUAL__ENABLED", "true"),
            ("FINE_SETTLER__ACCRUAL__CATCH_UP_DAYS", "40"),
            ("FINE_SETTLER__ACCRUAL__RECHECK_EVERY", "1s"),
        ],
    );
    let success = || count(&pool, "select count(*) from job_runs where status = 'SUCCESS'");
    crate::helpers::wait_until(
        "3 months and 40 days SUCCESS",
        Duration::from_secs(30),
        || async { success().await == 43 },
    )
    .await;
    // Returned on the last day of last month, five days late, recorded now.
    insert(
        &pool,
        &[loan(
            77,
            &(month_end - days(5)).to_string(),
            Some(&month_end.to_string()),
        )],
    )
    .await;
    crate::helpers::wait_until(
        "the late loan settled and accrued",
        Duration::from_secs(15),
        || async {
            let (settled, charged): (bool, i64) = sqlx::query_as(
                "select (select fine_settled_at is not null from loans where id = 77),
                    (select count(*) from fine_ledger where loan_id = 77)",
            )
            .fetch_one(&pool)
            .await
            .expect("state");
            settled && charged == 5
        },
    )
    .await;
    let (code, stderr) = stop(replica).await;
    assert_eq!(code, Some(0), "{stderr}");
}

/// The accrual's re-check looks at each day of a changed loan: a day both charged and queued (a charge rejected
/// by a trigger after another run had written that day) does not hide a day really missing from the same loan.
#[sqlx::test(fixtures("default_policy"))]
async fn a_day_both_charged_and_queued_does_not_hide_a_missing_day(pool: PgPool) {
    insert(&pool, &[loan(2, "2026-01-01", None)]).await;
    exec(
        &pool,
        "insert into fine_ledger (loan_id, accrual_date, amount_cents)
         select 2, d::date, 100 from generate_series('2026-01-02'::date, '2026-01-10', '1 day') d
         where d::date <> '2026-01-07';
         insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at, status)
         values (2, '2026-01-06', 100, 10, 'rejected', now(), 'DEAD');",
    )
    .await;
    // The loan was queued by libraryd's insert (it was already overdue).
    let found = fine_settler::store::corrections::recheck(
        &fine_settler::store::Db::from(pool.clone()),
        fine_settler::shard::ShardSpec::SINGLE,
        d("2026-01-02"),
        d("2026-01-10"),
        100,
        false,
        Duration::ZERO,
    )
    .await
    .expect("recheck");
    assert_eq!(found.days, [d("2026-01-07")]);
}
