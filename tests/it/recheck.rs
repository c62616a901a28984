//! The daemon's accrual re-check, as a real replica runs it: it re-opens the days a changed loan needs and their
//! runs correct them, and a re-check that cannot complete is its own episode — settlement and the tick go on.

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};

use crate::{
    daemon::http_get,
    helpers::{daemon, database_url, free_port, insert, loan, stop, wait_until},
};

/// Yesterday and the days before it, in the daemon's zone, as the database sees them.
async fn days_ago(pool: &PgPool, n: i32) -> chrono::NaiveDate {
    sqlx::query_scalar("select ((now() at time zone 'Asia/Shanghai')::date - $1)::date")
        .bind(n)
        .fetch_one(pool)
        .await
        .expect("date")
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

crate::each_engine! {
/// A return recorded late and back-dated before days the replica already charged: the re-check finds the loan
/// among libraryd's changes, re-opens those days, and their runs append `returned` corrections; the net ledger is
/// then what is owed, and the metric counts them.
#[sqlx::test(fixtures("default_policy"))]
async fn a_replica_corrects_a_back_dated_return_by_itself(pool: PgPool) {
    let due = days_ago(&pool, 10).await;
    let loans: Vec<_> = (1..=40)
        .map(|id| {
            let mut l = loan(id, "2026-01-01", None);
            l.due_on = due;
            l
        })
        .collect();
    insert(&pool, &loans).await;
    let port = free_port();
    let url = database_url(&pool);
    let listen = format!("127.0.0.1:{port}");
    let replica = daemon(
        &url,
        0,
        1,
        &[
            ("FINE_SETTLER__ACCRUAL__ENABLED", "true"),
            ("FINE_SETTLER__SETTLEMENT__ENABLED", "false"),
            ("FINE_SETTLER__ACCRUAL__RECHECK_EVERY", "500ms"),
            ("FINE_SETTLER__HTTP__LISTEN", &listen),
        ],
    );
    wait_until("the window accrued", Duration::from_secs(30), || async {
        count(&pool, "select count(*) from fine_ledger").await == 40 * 7
    })
    .await;
    let back_to = days_ago(&pool, 4).await;
    sqlx::query("update loans set returned_on = $1 where id <= 10")
        .bind(back_to)
        .execute(&pool)
        .await
        .expect("back-dated returns");
    // Days after the return: 3 of the window's 7 (back_to + 1 ..= yesterday).
    wait_until(
        "the back-dated days corrected",
        Duration::from_secs(30),
        || async {
            count(
                &pool,
                "select count(*) from fine_ledger_corrections where reason = 'returned'",
            )
            .await
                == 10 * 3
        },
    )
    .await;
    let over: i64 = count(
        &pool,
        "select count(*) from fine_ledger_net n join loans l on l.id = n.loan_id
         where n.accrual_date > l.returned_on",
    )
    .await;
    assert_eq!(over, 0);
    let (_, metrics) = http_get(port, "/metrics").await;
    assert!(
        metrics.contains(
            "fine_settler_ledger_corrections_total{job=\"overdue-accrual\",shard=\"0/1\",reason=\"returned\"} 30"
        ),
        "{metrics}"
    );
    wait_until("the change queue cleared", Duration::from_secs(10), || async {
        count(&pool, "select count(*) from fine_loan_changes").await == 0
    })
    .await;
    let (code, stderr) = stop(replica).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("accrual re-check: days to re-open"), "{stderr}");
}
}

crate::each_engine! {
/// The re-check cannot complete (its tables are locked by another session) while last month waits to be
/// settled: the replica settles it anyway, counts and logs the failed re-check once as its own episode (not as a
/// database outage), and stays live. Before the re-check had its own step, the accrual's re-open question was part
/// of the tick's status statement, and a slow one stopped every tick.
#[sqlx::test(fixtures("default_policy"))]
async fn a_re_check_that_cannot_complete_never_stops_the_tick(pool: PgPool) {
    let month_end = crate::helpers::due_now(&pool, 1).await[0];
    let returned: Vec<_> = (1..=50)
        .map(|id| {
            let mut l = loan(id, "2026-01-01", None);
            l.due_on = month_end - chrono::Duration::days(20);
            l.returned_on = Some(month_end - chrono::Duration::days(5));
            l
        })
        .collect();
    insert(&pool, &returned).await;
    let url = database_url(&pool);
    let mut locker = PgConnection::connect(&url).await.expect("connect");
    sqlx::query("begin").execute(&mut locker).await.expect("begin");
    sqlx::query("lock table fine_ledger, fine_loan_changes in access exclusive mode")
        .execute(&mut locker)
        .await
        .expect("lock");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let replica = daemon(
        &url,
        0,
        1,
        &[
            ("FINE_SETTLER__ACCRUAL__ENABLED", "true"),
            ("FINE_SETTLER__ACCRUAL__RECHECK_EVERY", "1s"),
            ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
            ("FINE_SETTLER__HTTP__LISTEN", &listen),
        ],
    );
    wait_until("last month settled", Duration::from_secs(30), || async {
        count(
            &pool,
            "select count(*) from job_runs where job_name = 'fine-settlement' and status = 'SUCCESS'",
        )
        .await
            == 1
    })
    .await;
    let settled = count(
        &pool,
        "select count(*) from loans where fine_settled_at is not null",
    )
    .await;
    assert_eq!(settled, 50);
    wait_until("a failed re-check counted", Duration::from_secs(10), || async {
        http_get(port, "/metrics")
            .await
            .1
            .lines()
            .any(|l| l.starts_with("fine_settler_recheck_errors_total{") && !l.ends_with(" 0"))
    })
    .await;
    assert_eq!(http_get(port, "/healthz").await.0, 200);
    sqlx::query("rollback")
        .execute(&mut locker)
        .await
        .expect("unlock");
    let (code, stderr) = stop(replica).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        stderr.matches("accrual re-check failed;").count(),
        1,
        "logged once per episode: {stderr}"
    );
    assert!(!stderr.contains("database unreachable"), "{stderr}");
}
}
