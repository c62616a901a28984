//! The accrual on Citus: `accrue` charges every overdue loan on its worker under a cap, corrects a back-dated
//! return when its day re-runs, relieves a loan whose due date moved earlier; and the daemon ticks, accrues its
//! window and re-opens the days its re-check finds from what libraryd changed; `runs` and the status page show
//! the keys.

use std::time::Duration;

use super::{migrate, CitusDb};
use crate::daemon::http_get;
use crate::helpers::{
    assert_success, daemon, exit_of, fine_settler, free_port, output, report, signal, wait_until,
};

/// `fine-settler accrue --date day` on Citus, in batches of 50.
fn accrue(url: &str, day: &str) -> serde_json::Value {
    let mut cmd = fine_settler(url);
    cmd.env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "50")
        .args(["accrue", "--date", day]);
    let out = output(cmd);
    assert_success(&out);
    report(&out)
}

/// Each (day, net) of `loan`: its charge plus its corrections.
async fn nets(db: &CitusDb, loan: i64) -> Vec<(String, i64)> {
    sqlx::query_as(
        "select f.accrual_date::text,
                (f.amount_cents + coalesce((select sum(c.amount_cents) from fine_ledger_corrections c
                                            where c.loan_id = f.loan_id and c.accrual_date = f.accrual_date), 0))::bigint
         from fine_ledger f where f.loan_id = $1 order by 1",
    )
    .bind(loan)
    .fetch_all(&db.pool)
    .await
    .expect("the loan's ledger")
}

#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn accrue_charges_under_the_cap_corrects_a_back_dated_return_and_relieves_a_moved_due_date() {
    let db = CitusDb::new("accrue").await;
    // Due 2026-10-10, one in two returned 2026-10-20; 100 cents a day up to 300 (the seeded default policy).
    db.libraryd_loans(200).await;
    let mut cmd = fine_settler(&db.url);
    cmd.env("FINE_SETTLER__FINE__CAP_CENTS", "300").arg("migrate");
    assert_success(&output(cmd));
    for day in ["2026-10-11", "2026-10-12", "2026-10-13", "2026-10-14"] {
        let run = accrue(&db.url, day);
        assert_eq!(run["outcome"], "settled", "{run}");
    }
    let totals = || async {
        sqlx::query_as::<_, (i64, Option<i64>)>("select count(*), sum(amount_cents)::bigint from fine_ledger")
            .fetch_one(&db.pool)
            .await
            .expect("the ledger")
    };
    assert_eq!(
        totals().await,
        (600, Some(60_000)),
        "three days of 100 cents for each of 200 loans, the fourth over the cap"
    );

    // libraryd back-dates the returns to 2026-10-12: the 13th is no longer owed by those 100 loans.
    sqlx::raw_sql("update loans set returned_on = '2026-10-12' where returned_on is not null")
        .execute(&db.pool)
        .await
        .expect("back-date the returns");
    let again = accrue(&db.url, "2026-10-13");
    assert_eq!(
        (&again["outcome"], &again["reopened"], &again["corrections"]),
        (
            &serde_json::json!("settled"),
            &serde_json::json!(true),
            &serde_json::json!(100)
        ),
        "{again}"
    );
    let returned: (i64, Option<i64>) = sqlx::query_as(
        "select count(*), sum(amount_cents)::bigint from fine_ledger_corrections
         where reason = 'returned' and accrual_date = '2026-10-13'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the corrections");
    assert_eq!(returned, (100, Some(-10_000)));
    // `runs` shows each key's corrections.
    let mut cmd = fine_settler(&db.url);
    cmd.args([
        "runs",
        "--job",
        "overdue-accrual",
        "--business-date",
        "2026-10-13",
        "--json",
    ]);
    let out = output(cmd);
    assert_success(&out);
    let row: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).expect("one JSON line for the key");
    assert_eq!(
        (&row["status"], &row["corrected"]),
        (&serde_json::json!("SUCCESS"), &serde_json::json!(100)),
        "{row}"
    );

    // Loan 1 (open) is due two days earlier: the 9th and 10th are owed, the 12th and 13th are not. Its ledger
    // holds the cap already, so the 9th's charge relieves those days first.
    sqlx::raw_sql("update loans set due_on = '2026-10-08' where id = 1")
        .execute(&db.pool)
        .await
        .expect("move the due date");
    for day in ["2026-10-09", "2026-10-10"] {
        let run = accrue(&db.url, day);
        assert_eq!(run["outcome"], "settled", "{run}");
    }
    assert_eq!(
        nets(&db, 1).await,
        [
            ("2026-10-09".to_string(), 100),
            ("2026-10-10".to_string(), 100),
            ("2026-10-11".to_string(), 100),
            ("2026-10-12".to_string(), 0),
            ("2026-10-13".to_string(), 0),
        ],
        "the loan's days as one run in order leaves them, at the cap"
    );
    // A second pass over the days finds nothing to do.
    let mut cmd = fine_settler(&db.url);
    cmd.args([
        "backfill",
        "--job",
        "overdue-accrual",
        "--from",
        "2026-10-09",
        "--to",
        "2026-10-14",
        "--dry-run",
    ]);
    let out = output(cmd);
    assert_success(&out);
    let summary = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("the summary line"))
        .expect("a summary");
    assert_eq!(
        (&summary["rows"], &summary["corrections"]),
        (&serde_json::json!(0), &serde_json::json!(0)),
        "{summary}"
    );
    db.drop().await;
}

#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn the_daemon_accrues_its_window_and_reopens_the_days_its_recheck_finds() {
    let db = CitusDb::new("daemon").await;
    db.libraryd_loans(200).await;
    assert_success(&migrate(&db.url, "citus"));
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let replica = daemon(
        &db.url,
        0,
        1,
        &[
            ("FINE_SETTLER__HTTP__LISTEN", &listen),
            ("FINE_SETTLER__TIME__ZONE", "UTC"),
            // Citus's batches take longer than the helper's one-second timeout allows.
            ("FINE_SETTLER__CLAIM__LEASE", "60s"),
            ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "20s"),
            ("FINE_SETTLER__ACCRUAL__ENABLED", "true"),
            ("FINE_SETTLER__ACCRUAL__CATCH_UP_DAYS", "3"),
            ("FINE_SETTLER__ACCRUAL__RECHECK_EVERY", "1s"),
        ],
    );
    let accrued = || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from job_runs where job_name = 'overdue-accrual' and status = 'SUCCESS'",
        )
        .fetch_one(&db.pool)
        .await
        .expect("the accrual's keys")
    };
    wait_until(
        "the window's three days accrued",
        Duration::from_secs(90),
        || async { accrued().await == 3 },
    )
    .await;
    let charged: (i64, Option<i64>) =
        sqlx::query_as("select count(*), sum(amount_cents)::bigint from fine_ledger")
            .fetch_one(&db.pool)
            .await
            .expect("the ledger");
    assert_eq!(
        charged,
        (300, Some(30_000)),
        "the 100 open loans, three days each"
    );

    // libraryd records loan 1's return as two days ago: yesterday is no longer owed.
    sqlx::raw_sql("update loans set returned_on = (now() at time zone 'UTC')::date - 2 where id = 1")
        .execute(&db.pool)
        .await
        .expect("back-date a return");
    let corrections = || async {
        sqlx::query_as::<_, (i64, Option<i64>)>(
            "select count(*), sum(amount_cents)::bigint from fine_ledger_corrections
             where loan_id = 1 and reason = 'returned'",
        )
        .fetch_one(&db.pool)
        .await
        .expect("the corrections")
    };
    wait_until(
        "the re-check re-opened yesterday",
        Duration::from_secs(60),
        || async { corrections().await.0 > 0 },
    )
    .await;
    assert_eq!(corrections().await, (1, Some(-100)));
    let (code, page) = http_get(port, "/status.json").await;
    assert_eq!(code, 200, "{page}");
    let status: serde_json::Value = serde_json::from_str(&page).expect("the status page's JSON");
    assert!(
        status.to_string().contains("overdue-accrual"),
        "the page lists the accrual's keys: {status}"
    );
    signal(&replica, "TERM");
    let (code, err) = exit_of(replica, Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "{err}");
    db.drop().await;
}

/// Two replicas (one per shard) accrue a window of days in small batches; one is killed (SIGKILL) mid-way and
/// started again, and a worker crashes and recovers meanwhile: the ledger ends as one clean run leaves it — every
/// open loan charged once a day, nothing corrected, nothing left queued — and a dry run finds nothing to do.
#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn a_killed_replica_and_a_crashed_worker_leave_the_ledger_as_one_clean_run() {
    let db = CitusDb::new("chaos").await;
    db.libraryd_loans(2000).await;
    assert_success(&migrate(&db.url, "citus"));
    let env = [
        ("FINE_SETTLER__TIME__ZONE", "UTC"),
        ("FINE_SETTLER__CLAIM__LEASE", "6s"),
        ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "5s"),
        ("FINE_SETTLER__ACCRUAL__ENABLED", "true"),
        ("FINE_SETTLER__ACCRUAL__CATCH_UP_DAYS", "3"),
        ("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "50"),
        ("FINE_SETTLER__ACCRUAL__RETRY_BACKOFF", "1s"),
        ("FINE_SETTLER__ACCRUAL__RECHECK_EVERY", "1s"),
        // Nobody reads the replicas' stderr until they exit: a pipe that fills up would stop them.
        ("FINE_SETTLER__LOG__LEVEL", "warn"),
    ];
    let zero = daemon(&db.url, 0, 2, &env);
    let one = daemon(&db.url, 1, 2, &env);
    let charged = || async {
        sqlx::query_scalar::<_, i64>("select count(*) from fine_ledger")
            .fetch_one(&db.pool)
            .await
            .unwrap_or(0)
    };
    wait_until("the first charges", Duration::from_secs(60), || async {
        charged().await > 0
    })
    .await;
    crate::helpers::sigkill(zero);
    crate::helpers::citus::citus_sh(&db.url, "crash-worker");
    let zero = daemon(&db.url, 0, 2, &env);
    let done = || async {
        sqlx::query_as::<_, (i64, i64)>(
            "select (select count(*) from job_runs where job_name = 'overdue-accrual' and status = 'SUCCESS'),
                    (select count(*) from fine_pending)",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap_or((0, -1))
    };
    wait_until(
        "three days of both shards accrued, nothing queued",
        Duration::from_secs(180),
        || async { done().await == (6, 0) },
    )
    .await;
    let (count, sum, days): (i64, Option<i64>, i64) = sqlx::query_as(
        "select count(*), sum(amount_cents)::bigint, count(distinct accrual_date) from fine_ledger",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the ledger");
    let corrections: i64 = sqlx::query_scalar("select count(*) from fine_ledger_corrections")
        .fetch_one(&db.pool)
        .await
        .expect("the corrections");
    let ledger = (count, sum, days, corrections);
    assert_eq!(
        ledger,
        (3000, Some(300_000), 3, 0),
        "the 1,000 open loans charged 100 cents on each of the three days, once"
    );
    for replica in [zero, one] {
        signal(&replica, "TERM");
        let (code, err) = exit_of(replica, Duration::from_secs(30)).await;
        assert_eq!(code, Some(0), "{err}");
    }
    db.drop().await;
}

/// A batch's loan that another transaction holds locked is left out and queued for compensation — unless it owes
/// nothing that day: on Citus a batch's loans are not priced before the write, and a loan in its grace period
/// queued with nothing to charge broke the queue's rule (positive amounts only) and failed the run.
#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn a_locked_loan_owing_nothing_that_day_is_left_out_without_being_queued() {
    let db = CitusDb::new("grace").await;
    // Due 2026-10-10 with ten days' grace: on the 15th every open loan is overdue and owes nothing.
    db.libraryd_loans(20).await;
    let mut cmd = fine_settler(&db.url);
    cmd.env("FINE_SETTLER__FINE__CAP_CENTS", "1000")
        .env("FINE_SETTLER__FINE__GRACE_DAYS", "10")
        .arg("migrate");
    assert_success(&output(cmd));
    // Another session holds loan 1's ledger lock (src/store/ledger.rs, LOAN_LOCK_SPACE "fsLd").
    let mut holder = db.pool.acquire().await.expect("a connection");
    sqlx::query("select pg_advisory_lock(1718832228, hashint8(1::bigint))")
        .execute(&mut *holder)
        .await
        .expect("hold the loan's lock");
    let mut cmd = fine_settler(&db.url);
    cmd.env("FINE_SETTLER__CLAIM__LOCK_TIMEOUT", "300ms")
        .args(["accrue", "--date", "2026-10-15"]);
    let out = output(cmd);
    assert_success(&out);
    let run = report(&out);
    assert_eq!(
        (&run["outcome"], &run["updated"], &run["pending"]),
        (
            &serde_json::json!("settled"),
            &serde_json::json!(0),
            &serde_json::json!(0)
        ),
        "{run}"
    );
    drop(holder);
    db.drop().await;
}
