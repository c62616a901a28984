//! A server that cannot write — a hot standby, or a primary whose transactions are read-only — is never used for
//! work: a replica claims nothing on it, says so once, answers `/readyz` 503, and resumes by itself when a
//! writable server is back; a one-shot command exits 1 with one line. Here the read-only server is the test's
//! own database with `default_transaction_read_only` (the failover test has a real standby).

use std::time::Duration;

use chrono::Datelike;
use fine_settler::store;
use sqlx::{postgres::PgPoolOptions, Executor, PgPool};

use crate::{
    daemon::http_get,
    helpers::{
        daemon, database_url, due_now, exit_of, fine_settler, free_port, insert, loan, output, signal,
        wait_until, Running, StderrLog,
    },
    server::PrivateServer,
};

/// Runs each statement in turn on one connection, in a writable session whatever the server's default.
async fn exec(pool: &PgPool, sql: &str) {
    let mut conn = pool.acquire().await.expect("connection");
    conn.execute("set default_transaction_read_only = off")
        .await
        .expect("writable session");
    for statement in sql.split(';') {
        conn.execute(statement).await.expect(statement);
    }
}

fn database_of(pool: &PgPool) -> String {
    pool.connect_options()
        .get_database()
        .expect("a test database")
        .to_string()
}

/// New connections to the test's database get read-only transactions (the test pool's own, opened before,
/// keep writing).
async fn make_read_only(pool: &PgPool, on: bool) {
    let db = database_of(pool);
    let sql = if on {
        format!("alter database \"{db}\" set default_transaction_read_only = on")
    } else {
        format!("alter database \"{db}\" reset default_transaction_read_only")
    };
    exec(pool, &sql).await;
}

async fn job_runs(pool: &PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from job_runs")
        .fetch_one(pool)
        .await
        .expect("count")
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_replica_started_on_a_read_only_server_is_not_ready_claims_nothing_and_starts_once_it_can_write(
    pool: PgPool,
) {
    let month = due_now(&pool, 1).await[0];
    let day = |n: u32| month.with_day(n).expect("day").to_string();
    insert(&pool, &[loan(1, &day(2), Some(&day(9)))]).await;
    // The test pool's connections (opened before) keep writing; the replica's are read-only.
    make_read_only(&pool, true).await;
    let url = database_url(&pool);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut replica = daemon(&url, 0, 1, &[("FINE_SETTLER__HTTP__LISTEN", &listen)]);
    let log = StderrLog::collect(&mut replica);

    wait_until("the not-ready line", Duration::from_secs(15), || async {
        log.contains("connected to a read-only server")
    })
    .await;
    let (status, body) = http_get(port, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("connected to a read-only server"), "{body}");
    // Retries at 250 ms, 500 ms, 1 s, 2 s: nothing is claimed meanwhile.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(job_runs(&pool).await, 0, "a read-only server was used for work");

    make_read_only(&pool, false).await;
    wait_until(
        "the key SUCCESS once the server writes",
        Duration::from_secs(30),
        || async { all_settled(&pool).await },
    )
    .await;
    ready_then_stop(
        port,
        replica,
        log,
        "connected to a read-only server",
        "database ready",
    )
    .await;
}

/// `/readyz` answers 200; the replica stops on SIGTERM; its log has the episode once each way (`started`,
/// `ended`) and no other error line.
async fn ready_then_stop(port: u16, replica: Running, log: StderrLog, started: &str, ended: &str) {
    let (status, body) = http_get(port, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    signal(&replica, "TERM");
    let (code, _) = exit_of(replica, Duration::from_secs(10)).await;
    assert_eq!(code, Some(0));
    let stderr = log.finish();
    let lines = |text: &str| stderr.lines().filter(|l| l.contains(text)).count();
    assert_eq!(lines(started), 1, "{stderr}");
    assert_eq!(lines(ended), 1, "{stderr}");
    assert_eq!(
        lines(r#""level":"error""#),
        1,
        "one error line for the whole episode: {stderr}"
    );
}

/// Whether every loan is settled and no key is left but SUCCESS.
async fn all_settled(pool: &PgPool) -> bool {
    sqlx::query_scalar(
        "select not exists (select 1 from loans where fine_settled_at is null)
            and not exists (select 1 from job_runs where status <> 'SUCCESS')
            and exists (select 1 from job_runs)",
    )
    .fetch_one(pool)
    .await
    .unwrap_or(false)
}

/// A pool whose sessions keep writing whatever the server's default.
async fn writing_pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("set default_transaction_read_only = off")
                    .await
                    .map(|_| ())
            })
        })
        .connect(url)
        .await
        .expect("connect")
}

/// Turns the whole server's transactions read-only (`on`) or writable again, at a reload.
async fn server_read_only(pool: &PgPool, on: bool) {
    let sql = match on {
        true => "alter system set default_transaction_read_only = on; select pg_reload_conf()",
        false => "alter system reset default_transaction_read_only; select pg_reload_conf()",
    };
    exec(pool, sql).await;
}

/// A primary demoted behind its address: every session's transactions turn read-only at a reload
/// (`default_transaction_read_only` in postgresql.auto.conf), connections stay up. The running replica notices
/// at its next tick, claims nothing, answers 503, logs the episode once, and resumes when the server writes
/// again. (A private server: the setting is server-wide.)
#[tokio::test]
async fn a_running_replica_whose_server_turns_read_only_claims_nothing_until_it_writes_again() {
    let server = PrivateServer::start(&[]);
    let url = server.migrated_database("libraryd").await;
    let pool = writing_pool(&url).await;
    let month = due_now(&pool, 1).await[0];
    let day = |n: u32| month.with_day(n).expect("day").to_string();
    insert(&pool, &[loan(1, &day(2), Some(&day(9)))]).await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut replica = daemon(&url, 0, 1, &[("FINE_SETTLER__HTTP__LISTEN", &listen)]);
    let log = StderrLog::collect(&mut replica);
    wait_until("the month settled", Duration::from_secs(30), || async {
        all_settled(&pool).await
    })
    .await;

    server_read_only(&pool, true).await;
    // A return back-dated into the settled month: the next tick would re-open the key.
    insert(&pool, &[loan(2, &day(3), Some(&day(10)))]).await;
    wait_until("the episode's line", Duration::from_secs(15), || async {
        log.contains("read-only server: claiming nothing")
    })
    .await;
    let (status, body) = http_get(port, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("connected to a read-only server"), "{body}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let unsettled = |pool: PgPool| async move {
        sqlx::query_scalar::<_, i64>("select count(*) from loans where fine_settled_at is null")
            .fetch_one(&pool)
            .await
            .expect("count")
    };
    assert_eq!(
        unsettled(pool.clone()).await,
        1,
        "nothing was written while the server was read-only"
    );

    server_read_only(&pool, false).await;
    wait_until("the late return settled", Duration::from_secs(40), || async {
        unsettled(pool.clone()).await == 0
    })
    .await;
    ready_then_stop(
        port,
        replica,
        log,
        "read-only server: claiming nothing",
        "writable server found again",
    )
    .await;
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_one_shot_command_on_a_read_only_server_exits_1_with_one_line_and_writes_nothing(pool: PgPool) {
    let month = due_now(&pool, 1).await[0];
    insert(&pool, &[loan(1, &month.to_string(), Some(&month.to_string()))]).await;
    make_read_only(&pool, true).await;
    let url = database_url(&pool);
    for args in [
        vec!["settle", "--business-date", &month.to_string()],
        vec!["accrue", "--date", "2026-01-05"],
        vec!["pause", "--job", "fine-settlement"],
    ] {
        let mut cmd = fine_settler(&url);
        cmd.args(&args);
        let out = output(cmd);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr} {stdout}");
        // One line (a run's error log line, or the command's error), naming the reason.
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.contains("connected to a read-only server"),
            "{args:?}: {stderr}"
        );
        // A run still prints its report (failed, nothing claimed); nothing else is printed.
        assert!(
            stdout.is_empty()
                || (stdout.contains(r#""outcome":"failed""#) && stdout.contains(r#""epoch":null"#)),
            "{args:?}: {stdout}"
        );
    }
    assert_eq!(job_runs(&pool).await, 0);
    let pauses: i64 = sqlx::query_scalar("select count(*) from job_pauses")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(pauses, 0);
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_write_refused_by_a_read_only_transaction_is_told_apart_from_other_errors(pool: PgPool) {
    let mut tx = pool.begin().await.expect("begin");
    exec_tx(&mut tx, "set transaction read only").await;
    let refused = sqlx::query(
        "insert into job_pauses (job_name, shards, shard, paused_by, reason) values ('x', 0, 0, 'me', 'r')",
    )
    .execute(&mut *tx)
    .await
    .expect_err("a read-only transaction refuses the insert");
    assert!(store::read_only(&refused), "{refused}");
    drop(tx);
    let other = sqlx::query("select 1/0")
        .execute(&pool)
        .await
        .expect_err("division by zero");
    assert!(!store::read_only(&other), "{other}");
    let in_recovery = store::ReadOnlyServer::check(true, false).expect_err("in recovery");
    assert!(store::read_only(&in_recovery));
    assert!(
        in_recovery
            .to_string()
            .contains("connected to a read-only server"),
        "{in_recovery}"
    );
    assert!(store::ReadOnlyServer::check(false, false).is_ok());
}

async fn exec_tx(tx: &mut sqlx::PgConnection, sql: &str) {
    sqlx::raw_sql(sql).execute(&mut *tx).await.expect(sql);
}

/// Once the server writes again after an outage, the replica is ready as soon as a tick's status statement
/// answers — not only when that tick's whole pass ends: a catch-up pass of many late rows after an outage used
/// to keep `/readyz` at 503 ("no tick has succeeded since the outage began") for as long as the pass ran, while
/// the replica was working.
#[tokio::test]
async fn after_an_outage_the_replica_is_ready_while_its_catch_up_pass_runs() {
    let server = PrivateServer::start(&[]);
    let url = server.migrated_database("libraryd").await;
    let pool = writing_pool(&url).await;
    let month = due_now(&pool, 1).await[0];
    let day = |n: u32| month.with_day(n).expect("day").to_string();
    insert(&pool, &[loan(1, &day(2), Some(&day(9)))]).await;
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut replica = daemon(
        &url,
        0,
        1,
        &[
            ("FINE_SETTLER__HTTP__LISTEN", &listen),
            ("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "10"),
        ],
    );
    let log = StderrLog::collect(&mut replica);
    wait_until("the month settled", Duration::from_secs(30), || async {
        all_settled(&pool).await
    })
    .await;

    server_read_only(&pool, true).await;
    wait_until("the outage's line", Duration::from_secs(15), || async {
        log.contains("read-only server: claiming nothing")
    })
    .await;
    // 300 returns back-dated into the settled month, 30 ms a row: a catch-up pass of about 9 s.
    let late: Vec<_> = (2..=301).map(|n| loan(n, &day(3), Some(&day(10)))).collect();
    insert(&pool, &late).await;
    crate::helpers::slow_down(&pool, "update on loans", 0.03).await;
    server_read_only(&pool, false).await;
    wait_until("the catch-up pass under way", Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from loans where fine_settled_at is not null and id > 1",
        )
        .fetch_one(&pool)
        .await
        .unwrap_or(0)
            > 0
    })
    .await;
    let (status, body) = http_get(port, "/readyz").await;
    let left: i64 = sqlx::query_scalar("select count(*) from loans where fine_settled_at is null")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert!(left > 0, "the pass ended before /readyz was asked");
    assert_eq!(status, 200, "{body}");
    wait_until("the late returns settled", Duration::from_secs(60), || async {
        all_settled(&pool).await
    })
    .await;
    ready_then_stop(
        port,
        replica,
        log,
        "read-only server: claiming nothing",
        "writable server found again",
    )
    .await;
}
