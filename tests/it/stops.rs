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
    stop_during_a_compensation_pass(Gone::Dead).await;
}

/// The same with the server frozen (a paused VM: connections are accepted by the kernel, nothing answers): the
/// stop's question goes unanswered for 3 s at most, not the 10 s connect timeout it used to wait.
#[tokio::test]
async fn a_sigterm_during_a_compensation_pass_with_the_server_frozen_exits_0_within_seconds() {
    stop_during_a_compensation_pass(Gone::Frozen).await;
}

/// How the server goes away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gone {
    Dead,
    Frozen,
}

async fn stop_during_a_compensation_pass(gone: Gone) {
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
    match gone {
        Gone::Dead => primary.stop_immediate().await,
        Gone::Frozen => primary.freeze(),
    }
    let stopped_at = Instant::now();
    signal(&replica, "TERM");
    let (code, _) = exit_of(replica, Duration::from_secs(20)).await;
    let took = stopped_at.elapsed();
    if gone == Gone::Frozen {
        primary.thaw();
    }
    let stderr = log.finish();
    eprintln!("stopped {took:?} after SIGTERM during a compensation pass with the server {gone:?}");
    assert!(took < Duration::from_secs(5), "stopped after {took:?}: {stderr}");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("held no key"), "{stderr}");
    assert!(!stderr.contains("could not hand the key back"), "{stderr}");
    assert!(!stderr.contains("batch in flight"), "{stderr}");
}

/// A claim whose answer is lost with its connection (it committed; the reply never came) leaves the key RUNNING
/// under the replica's own owner with nobody running it: the replica hands it back (FAILED, lease ended) if it
/// has committed by then, and its next tick takes it over as its own either way and settles the month. It used
/// to leave the key to its lease (here a minute) — and a stop meanwhile exited 0 saying it held no key.
#[sqlx::test(fixtures("default_policy"))]
async fn a_claim_whose_answer_was_lost_is_handed_back_at_once(pool: PgPool) {
    let ClaimInFlight { proxy, replica, log } = claim_in_flight(&pool).await;
    proxy.cut_all();
    let (_, took) = every_month_settled_within(&pool, Duration::from_secs(20)).await;
    signal(&replica, "TERM");
    let (code, _) = exit_of(replica, Duration::from_secs(10)).await;
    let stderr = log.finish();
    let history: Vec<String> = sqlx::query_scalar(
        "select business_date || ' ' || event || ' ' || epoch || ' ' || owner || ' ' || coalesce(error, '')
         from job_run_attempts order by id",
    )
    .fetch_all(&pool)
    .await
    .expect("history");
    let stderr = format!("{stderr}\nhistory: {history:#?}");
    eprintln!("the month settled {took:?} after the claim's answer was lost");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        took < Duration::from_secs(10),
        "settled only {took:?} after the cut: {stderr}"
    );
    // The first claim, of the oldest month due, is the one cut: handed back (if it had committed by then) or
    // taken over by the replica's next tick, as its own.
    let recovered: i64 = sqlx::query_scalar(
        "select count(*) from job_run_attempts a
         where a.business_date = (select min(business_date) from job_runs)
           and ((a.event = 'failed' and a.error like 'the claim''s answer was lost%')
                or (a.event = 'takeover' and a.epoch = 2))",
    )
    .fetch_one(&pool)
    .await
    .expect("history");
    assert!(recovered >= 1, "{stderr}");
}

/// A replica (settlement only, a one-minute lease) reaching the server through a proxy the test can cut, whose
/// first claim is sleeping in its trigger (see [`slow_first_claim`]); one loan due in the latest month.
struct ClaimInFlight {
    proxy: crate::chaos::proxy::Proxy,
    replica: crate::helpers::Running,
    log: StderrLog,
}

async fn claim_in_flight(pool: &PgPool) -> ClaimInFlight {
    let proxy = crate::chaos::proxy::Proxy::start(pool.connect_options().get_port()).await;
    let url = proxy.route(&crate::helpers::database_url(pool));
    let month = due_now(pool, 1).await[0];
    let first = month.with_day(1).expect("first day").to_string();
    insert(pool, &[loan(1, &first, Some(&month.to_string()))]).await;
    slow_first_claim(pool).await;
    let mut replica = daemon(
        &url,
        0,
        1,
        &[
            ("FINE_SETTLER__ACCRUAL__ENABLED", "false"),
            ("FINE_SETTLER__CLAIM__LEASE", "60s"),
        ],
    );
    let log = StderrLog::collect(&mut replica);
    wait_until("the claim sleeping", Duration::from_secs(20), || async {
        // (This test's database only: the tests that share this helper run at once on the same server.)
        sqlx::query_scalar::<_, i64>(
            "select count(*) from pg_stat_activity where datname = current_database() and wait_event = 'PgSleep'",
        )
        .fetch_one(pool)
            .await
            .unwrap_or(0)
            > 0
    })
    .await;
    ClaimInFlight { proxy, replica, log }
}

/// Polls until the three due months' keys are SUCCESS or `limit` has passed: whether they were, and when.
async fn every_month_settled_within(pool: &PgPool, limit: Duration) -> (bool, Duration) {
    let started = Instant::now();
    loop {
        let settled = sqlx::query_scalar::<_, bool>(
            "select count(*) = 3 and bool_and(status = 'SUCCESS') from job_runs",
        )
        .fetch_one(pool)
        .await
        .unwrap_or(false);
        if settled || started.elapsed() >= limit {
            return (settled, started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The first claim sleeps 0.8 s before it commits (within the tests' 1 s statement timeout): long enough to cut
/// its connection meanwhile.
async fn slow_first_claim(pool: &PgPool) {
    sqlx::raw_sql(
        "create table claim_slept (done boolean);
         create function slow_first_claim() returns trigger language plpgsql as $$
         begin
             if new.job_name = 'fine-settlement' and not exists (select 1 from claim_slept) then
                 insert into claim_slept values (true);
                 perform pg_sleep(0.8);
             end if;
             return new;
         end $$;
         create trigger slow_first_claim before insert on job_runs for each row execute function slow_first_claim();",
    )
    .execute(pool)
    .await
    .expect("slow claim");
}

/// A replica told to stop just after its claim's connection was cut, before the claim has committed on the server:
/// the stop waits for the claim's statement to end (its statement timeout), then hands the key back. It used to
/// look at once, find nothing, exit 0 — and the claim committed a moment later, leaving the key RUNNING for its
/// whole lease under a process that was gone.
#[sqlx::test(fixtures("default_policy"))]
async fn a_stop_right_after_a_claim_s_answer_was_lost_leaves_no_key_running(pool: PgPool) {
    let ClaimInFlight { proxy, replica, log } = claim_in_flight(&pool).await;
    proxy.cut_all();
    tokio::time::sleep(Duration::from_millis(50)).await;
    signal(&replica, "TERM");
    let (code, _) = exit_of(replica, Duration::from_secs(10)).await;
    let stderr = log.finish();
    // Whatever the claim did has ended by now (its statement timeout is 1 s).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let running: i64 =
        sqlx::query_scalar("select count(*) from job_runs where status = 'RUNNING' and lease_until > now()")
            .fetch_one(&pool)
            .await
            .expect("job_runs");
    assert_eq!(running, 0, "a key left RUNNING by a stopped replica: {stderr}");
    assert_eq!(code, Some(0), "{stderr}");
}

/// A claim whose connection black-holes its answer (a lost route: the socket stays open, nothing arrives) fails
/// after the batch timeout and a second, and is handed back: the month settles within seconds. It used to wait
/// for the answer for ever, the replica wedged with its key RUNNING.
#[sqlx::test(fixtures("default_policy"))]
async fn a_claim_whose_answer_never_arrives_gives_up_and_is_handed_back(pool: PgPool) {
    let ClaimInFlight { proxy, replica, log } = claim_in_flight(&pool).await;
    proxy.freeze_all();
    let (settled, took) = every_month_settled_within(&pool, Duration::from_secs(20)).await;
    proxy.cut_all();
    signal(&replica, "TERM");
    let (code, _) = exit_of(replica, Duration::from_secs(10)).await;
    let stderr = log.finish();
    eprintln!("settled {took:?} after the claim's connection was black-holed");
    assert!(settled, "not settled {took:?} after the black hole: {stderr}");
    assert_eq!(code, Some(0), "{stderr}");
}
