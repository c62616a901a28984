//! A replica's lifecycle: in-process, through `daemon::run`, a clean drain that also stops the HTTP listener, and
//! the drain timeout cutting a batch short; as a process, what its probes say while its ticks fail on a server
//! that answers, and once they succeed again.

use std::time::{Duration, Instant};

use fine_settler::{
    config::{self, Settings},
    daemon::{self, Control, Stopped},
};
use sqlx::PgPool;
use tokio::{io::AsyncWriteExt, net::TcpStream};

use crate::{
    daemon::http_get,
    helpers::{
        daemon as replica_process, database_url, free_port, insert, loan, signal, slow_down, stop,
        wait_until, StderrLog,
    },
};

fn settings(pool: &PgPool, extra: &[(&str, &str)]) -> Settings {
    let mut env: std::collections::HashMap<String, String> = [
        ("DATABASE_URL", database_url(pool)),
        ("FINE_SETTLER__SCHEDULE__PERIOD", "300ms".into()),
        ("FINE_SETTLER__CLAIM__LEASE", "10s".into()),
        ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "5s".into()),
        ("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "5".into()),
        ("FINE_SETTLER__LOG__FORMAT", "json".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    config::load(None, &env)
        .and_then(|raw| raw.validate(&env))
        .expect("valid settings")
}

/// How the replica stopped, once it has (within 10 s).
async fn stopped(replica: tokio::task::JoinHandle<Result<Stopped, daemon::StartError>>) -> Stopped {
    tokio::time::timeout(Duration::from_secs(10), replica)
        .await
        .expect("stopped within 10 s")
        .expect("no panic")
        .expect("started")
}

async fn healthz_answers(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .is_ok()
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_replica_told_to_stop_drains_and_frees_its_port(pool: PgPool) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let settings = settings(&pool, &[("FINE_SETTLER__HTTP__LISTEN", &listen)]);
    let control = Control::new();
    let replica = tokio::spawn(daemon::run(settings, control.clone()));
    wait_until("the replica serves /healthz", Duration::from_secs(20), || {
        healthz_answers(port)
    })
    .await;
    wait_until("the replica has ticked", Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, i64>("select count(*) from job_runs where status = 'SUCCESS'")
            .fetch_one(&pool)
            .await
            .expect("count")
            > 0
    })
    .await;
    control.shutdown.cancel();
    let stopped = stopped(replica).await;
    assert_eq!(stopped, Stopped::Drained);
    assert_eq!(stopped.exit_code(), 0);
    // The listener was awaited: its port is free as soon as `run` has returned.
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("the port is free again");
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_drain_longer_than_the_drain_timeout_exits_with_the_batch_in_flight(pool: PgPool) {
    // Loans returned late in the month a tick settles now; each row's update takes a second, so a batch of 5
    // takes 5 s.
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("select now()")
        .fetch_one(&pool)
        .await
        .expect("now");
    let today = fine_settler::calendar::local_date(now, chrono_tz::Asia::Shanghai);
    let month_end = fine_settler::calendar::previous_month_end(today);
    let (due, back) = (
        (month_end - chrono::Duration::days(20)).to_string(),
        (month_end - chrono::Duration::days(5)).to_string(),
    );
    let loans: Vec<_> = (1..=20).map(|id| loan(id, &due, Some(&back))).collect();
    insert(&pool, &loans).await;
    slow_down(&pool, "update on loans", 1.0).await;
    let settings = settings(
        &pool,
        &[
            ("FINE_SETTLER__SCHEDULE__DRAIN_TIMEOUT", "300ms"),
            ("FINE_SETTLER__ACCRUAL__ENABLED", "false"),
            ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
        ],
    );
    let control = Control::new();
    let replica = tokio::spawn(daemon::run(settings, control.clone()));
    wait_until("a batch is in flight", Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, bool>(
            "select exists (select 1 from pg_stat_activity
                            where query like '%update loans%' and state = 'active'
                              and datname = current_database() and pid <> pg_backend_pid())",
        )
        .fetch_one(&pool)
        .await
        .expect("activity")
    })
    .await;
    let asked = Instant::now();
    control.shutdown.cancel();
    let stopped = stopped(replica).await;
    let took = asked.elapsed();
    assert_eq!(stopped, Stopped::DrainTimeout);
    assert_eq!(stopped.exit_code(), 1);
    // It did not wait for the batch (5 s): it left after the drain timeout.
    assert!(took < Duration::from_secs(3), "took {took:?}");
}

/// Ticks that fail on a server that answers — here the tick's status statement waits for an operator's lock on
/// `job_runs` until its statement timeout (1 s) cancels it, attempt after attempt — make `/readyz` fail at once
/// and `/healthz` once they have failed for longer than the liveness window (two 300 ms periods plus the 1 s
/// batch timeout, at least a minute), each saying why; a tick that succeeds again makes both green.
#[sqlx::test(fixtures("default_policy"))]
async fn ticks_failing_on_a_server_that_answers_fail_readyz_then_healthz_until_one_succeeds(pool: PgPool) {
    let url = database_url(&pool);
    let port = free_port();
    let mut replica = replica_process(
        &url,
        0,
        1,
        &[("FINE_SETTLER__HTTP__LISTEN", &format!("127.0.0.1:{port}"))],
    );
    let log = StderrLog::collect(&mut replica);
    // No spell was in progress when a probe, sent at `ready_at`, found the replica ready: the spell that follows
    // starts after it. (It may start before the lock below is granted: the replica's statements queue behind the
    // lock request, and time out there, while it waits for the replica's own transaction to end.)
    let started = Instant::now();
    let ready_at = loop {
        let asked_at = Instant::now();
        if http_get(port, "/readyz").await.0 == 200 {
            break asked_at;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(http_get(port, "/healthz").await.0, 200);

    let mut lock = pool.begin().await.expect("begin");
    sqlx::query("lock table job_runs in access exclusive mode")
        .execute(&mut *lock)
        .await
        .expect("lock");
    wait_until("/readyz fails", Duration::from_secs(20), || async {
        http_get(port, "/readyz").await.0 == 503
    })
    .await;
    let (code, body) = http_get(port, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.starts_with("ticks failing for "), "{body}");
    assert!(body.contains("statement timeout"), "{body}");
    let (code, body) = http_get(port, "/healthz").await;
    assert_eq!(code, 200, "within the window, still live: {body}");

    wait_until("/healthz fails", Duration::from_secs(120), || async {
        http_get(port, "/healthz").await.0 == 503
    })
    .await;
    let took = ready_at.elapsed();
    let (code, body) = http_get(port, "/healthz").await;
    assert_eq!(code, 503, "{body}");
    assert!(
        body.starts_with("failing: ticks failing for ") && body.contains(", longer than 60000 ms ("),
        "{body}"
    );
    assert!(body.contains("statement timeout"), "{body}");
    assert!(took >= Duration::from_secs(60), "failed after {took:?}");

    // The lock goes; a tick now (SIGHUP) succeeds, and both probes are green again.
    lock.rollback().await.expect("unlock");
    signal(&replica, "HUP");
    wait_until("green again", Duration::from_secs(40), || async {
        http_get(port, "/healthz").await.0 == 200 && http_get(port, "/readyz").await.0 == 200
    })
    .await;
    assert_eq!(stop(replica).await.0, Some(0));
    let log = log.finish();
    assert!(log.contains("statement timeout"), "{log}");
}

/// The replica's tick errors so far, from its `/metrics`.
async fn tick_errors(port: u16) -> u64 {
    let (_, body) = http_get(port, "/metrics").await;
    body.lines()
        .filter(|l| l.starts_with("fine_settler_tick_errors_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Ticks failing on a server that answers back off up to 30 s between attempts; once the cause is gone, a
/// readiness probe ends the wait (at most once a second), so `/readyz` is green again within about a probe
/// period — it used to stay 503 for the rest of the backoff, up to 30 s, with nothing wrong any more.
#[sqlx::test(fixtures("default_policy"))]
async fn once_a_failing_tick_s_cause_is_gone_the_next_probe_brings_the_replica_back(pool: PgPool) {
    let url = database_url(&pool);
    let port = free_port();
    let mut replica = replica_process(
        &url,
        0,
        1,
        &[("FINE_SETTLER__HTTP__LISTEN", &format!("127.0.0.1:{port}"))],
    );
    let log = StderrLog::collect(&mut replica);
    wait_until("ready", Duration::from_secs(20), || async {
        http_get(port, "/readyz").await.0 == 200
    })
    .await;
    let mut lock = pool.begin().await.expect("begin");
    sqlx::query("lock table job_runs in access exclusive mode")
        .execute(&mut *lock)
        .await
        .expect("lock");
    // Seven failed attempts (each a 1 s statement timeout, then 250 ms, 500 ms, … 8 s of backoff): the wait
    // after the seventh is 16 s.
    wait_until("seven failed ticks", Duration::from_secs(60), || async {
        tick_errors(port).await >= 7
    })
    .await;
    lock.rollback().await.expect("unlock");
    let released = Instant::now();
    wait_until("/readyz green again", Duration::from_secs(40), || async {
        tokio::time::sleep(Duration::from_millis(250)).await;
        http_get(port, "/readyz").await.0 == 200
    })
    .await;
    let took = released.elapsed();
    eprintln!("/readyz green {took:?} after the cause of the failing ticks went");
    assert!(
        took < Duration::from_secs(5),
        "green only {took:?} after the cause went"
    );
    assert_eq!(stop(replica).await.0, Some(0));
    drop(log);
}
