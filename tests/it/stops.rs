//! Stops are prompt whatever the database does: a SIGTERM ends a search of hung hosts at once (the replica holds
//! no key: it says so and exits 0), and a replica whose server died mid-run says it could not hand its key back
//! (its lease frees it) and exits within a few seconds, without claiming a batch in flight.

use std::{
    net::TcpListener,
    time::{Duration, Instant},
};

use chrono::Datelike;
use sqlx::{postgres::PgPoolOptions, PgPool};

use crate::helpers::{
    daemon, due_now, exit_of, fine_settler, insert, loan, migrate, signal, slow_down, spawn, wait_until,
    Cluster, PgBouncer, PoolMode, StderrLog,
};

/// `n` servers that accept a connection and never answer (the kernel completes the handshake for the listen
/// backlog): each costs a connection attempt its whole connect timeout.
fn hung_hosts(n: usize) -> Vec<TcpListener> {
    (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect()
}

#[tokio::test]
async fn a_sigterm_during_a_search_of_hung_hosts_exits_0_at_once_holding_no_key() {
    let hung = hung_hosts(4);
    let hosts: Vec<String> = hung
        .iter()
        .map(|l| format!("127.0.0.1:{}", l.local_addr().expect("addr").port()))
        .collect();
    let url = format!(
        "postgres://fine_settler@{}/libraryd?connect_timeout=10",
        hosts.join(",")
    );
    let mut cmd = fine_settler(&url);
    cmd.arg("run")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut replica = spawn(&mut cmd);
    let log = StderrLog::collect(&mut replica);
    wait_until("the replica started", Duration::from_secs(10), || async {
        log.contains("replica started")
    })
    .await;
    // Well into the first host's connect timeout.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stopped_at = Instant::now();
    signal(&replica, "TERM");
    let (code, _) = exit_of(replica, Duration::from_secs(5)).await;
    let took = stopped_at.elapsed();
    let stderr = log.finish();
    eprintln!("stopped {took:?} after SIGTERM during a search of 4 hung hosts");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(took < Duration::from_secs(3), "stopped after {took:?}: {stderr}");
    assert!(stderr.contains("held no key"), "{stderr}");
    assert!(!stderr.contains("batch in flight"), "{stderr}");
}

#[tokio::test]
async fn a_sigterm_after_the_server_died_mid_run_says_the_key_could_not_be_handed_back() {
    server_dies_mid_run(None).await;
}

/// The same behind a transaction-mode PgBouncer, which goes on accepting connections with its server gone: the
/// stop asks a question of the server, not only for a connection (it used to wait out the drain timeout).
#[tokio::test]
async fn behind_pgbouncer_a_sigterm_after_the_server_died_mid_run_says_the_key_could_not_be_handed_back() {
    server_dies_mid_run(Some(PoolMode::Transaction)).await;
}

/// A replica reaching the server directly or through a PgBouncer in `front` of it; the server dies mid-run, then
/// the replica is told to stop.
async fn server_dies_mid_run(front: Option<PoolMode>) {
    let primary = Cluster::primary_with_libraryd().await;
    let url = primary.url("libraryd");
    migrate(&url);
    let bouncer = match front {
        Some(mode) => Some(PgBouncer::start_in_front_of(&primary.url("postgres"), mode).await),
        None => None,
    };
    let replica_url = bouncer.as_ref().map_or(url.clone(), |b| b.url_for(&url));
    let pool: PgPool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("connect");
    let month = due_now(&pool, 1).await[0];
    let first = month.with_day(1).expect("first day").to_string();
    let loans: Vec<_> = (1..=400)
        .map(|n| loan(n, &first, Some(&month.to_string())))
        .collect();
    insert(&pool, &loans).await;
    // Batches of 25 at 20 ms a row: half a second each, so the run is mid-way when the server dies.
    slow_down(&pool, "update on loans", 0.02).await;
    let pooler = match front {
        Some(PoolMode::Transaction) => "transaction",
        Some(PoolMode::Session) => "session",
        None => "none",
    };
    let mut replica = daemon(
        &replica_url,
        0,
        1,
        &[
            ("FINE_SETTLER__DATABASE__CONNECT_TIMEOUT", "10s"),
            ("FINE_SETTLER__DATABASE__POOLER", pooler),
        ],
    );
    let log = StderrLog::collect(&mut replica);
    wait_until("a key claimed", Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, i64>("select count(*) from job_runs where status = 'RUNNING' and scanned > 0")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
            > 0
    })
    .await;
    pool.close().await;
    primary.stop_immediate().await;
    let stopped_at = Instant::now();
    signal(&replica, "TERM");
    let (code, _) = exit_of(replica, Duration::from_secs(20)).await;
    let took = stopped_at.elapsed();
    let stderr = log.finish();
    eprintln!("stopped {took:?} after SIGTERM with the server gone mid-run");
    assert!(took < Duration::from_secs(5), "stopped after {took:?}: {stderr}");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("could not hand the key back; its lease frees it for a peer"),
        "{stderr}"
    );
    assert!(!stderr.contains("batch in flight"), "{stderr}");
}

/// A one-shot `settle` whose server freezes mid-run (a frozen host, a partition: the sockets stay open, nothing
/// answers) ends by itself: its batch times out, the end of the run is retried briefly, its connections are left
/// to the exit, and it prints its report and exits 1 — it used to wait for a connection that never came back, for
/// ever, after logging that the run had finished.
#[tokio::test]
async fn a_settle_whose_server_freezes_mid_run_ends_by_itself() {
    let primary = Cluster::primary_with_libraryd().await;
    let url = primary.url("libraryd");
    migrate(&url);
    let pool: PgPool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("connect");
    let month = due_now(&pool, 1).await[0];
    let first = month.with_day(1).expect("first day").to_string();
    let loans: Vec<_> = (1..=400)
        .map(|n| loan(n, &first, Some(&month.to_string())))
        .collect();
    insert(&pool, &loans).await;
    slow_down(&pool, "update on loans", 0.02).await;
    let mut settle = crate::helpers::fine_settler(&url);
    settle
        .env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "25")
        .env("FINE_SETTLER__CLAIM__LEASE", "6s")
        .env("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "2s")
        .env("FINE_SETTLER__CLAIM__LOCK_TIMEOUT", "1s")
        .env("FINE_SETTLER__DATABASE__CONNECT_TIMEOUT", "2s")
        .args(["settle", "--business-date", &month.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = settle.spawn().expect("settle");
    wait_until("a batch settled", Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, i64>("select count(*) from loans where fine_settled_at is not null")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
            > 0
    })
    .await;
    pool.close().await;
    primary.freeze();
    let frozen_at = Instant::now();
    let mut ended = None;
    while frozen_at.elapsed() < Duration::from_secs(60) {
        if let Some(status) = child.try_wait().expect("try_wait") {
            ended = Some(status);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = frozen_at.elapsed();
    if ended.is_none() {
        let _ = child.kill();
    }
    primary.thaw();
    let out = child.wait_with_output().expect("settle's output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("settle ended {took:?} after its server froze");
    assert!(
        ended.is_some(),
        "still running {took:?} after the freeze: {stderr}"
    );
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let report = crate::helpers::report(&out);
    assert_eq!(report["outcome"], "failed", "{report}");
}

/// A replica told to stop while its compensation pass runs and its server has just died holds no key (the pass
/// charges pending rows, it claims nothing): it says so and exits 0 — it used to say it could not hand its key
/// back, and exit 1, whenever the database was gone after the tick's status statement.
#[tokio::test]
async fn a_sigterm_during_a_compensation_pass_with_the_server_gone_exits_0_holding_no_key() {
    let primary = Cluster::primary_with_libraryd().await;
    let url = primary.url("libraryd");
    migrate(&url);
    let pool: PgPool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("connect");
    let loans: Vec<_> = (1..=200).map(|n| loan(n, "2026-06-01", None)).collect();
    insert(&pool, &loans).await;
    sqlx::raw_sql(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         select id, '2026-06-20', 100, 1, 'x', now() - interval '1 s' from generate_series(1, 200) id;",
    )
    .execute(&pool)
    .await
    .expect("pending charges");
    slow_down(&pool, "insert on fine_ledger", 0.1).await;
    let mut replica = daemon(
        &url,
        0,
        1,
        &[
            ("FINE_SETTLER__ACCRUAL__ENABLED", "true"),
            ("FINE_SETTLER__SETTLEMENT__ENABLED", "false"),
            ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "20s"),
            ("FINE_SETTLER__CLAIM__LEASE", "60s"),
            ("FINE_SETTLER__DATABASE__CONNECT_TIMEOUT", "10s"),
        ],
    );
    let log = StderrLog::collect(&mut replica);
    wait_until(
        "the compensation pass under way",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, i64>("select count(*) from fine_pending")
                .fetch_one(&pool)
                .await
                .unwrap_or(200)
                < 195
        },
    )
    .await;
    let held: i64 = sqlx::query_scalar("select count(*) from job_runs where status = 'RUNNING'")
        .fetch_one(&pool)
        .await
        .expect("running keys");
    assert_eq!(held, 0, "the replica holds a key during its compensation pass");
    pool.close().await;
    primary.stop_immediate().await;
    let stopped_at = Instant::now();
    signal(&replica, "TERM");
    let (code, _) = exit_of(replica, Duration::from_secs(20)).await;
    let took = stopped_at.elapsed();
    let stderr = log.finish();
    eprintln!("stopped {took:?} after SIGTERM during a compensation pass with the server gone");
    assert!(took < Duration::from_secs(5), "stopped after {took:?}: {stderr}");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("held no key"), "{stderr}");
    assert!(!stderr.contains("could not hand the key back"), "{stderr}");
    assert!(!stderr.contains("batch in flight"), "{stderr}");
}
