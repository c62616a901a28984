//! A failover measured: the primary killed while a key is RUNNING, the standby promoted only 12 s later (long
//! enough for an outage backoff to have grown past the promise), and the replica resumes on the promoted
//! standby within `connect_timeout + lease` plus one period of the promotion; `/readyz` says not ready through the
//! outage and ready once work has resumed.

use std::time::{Duration, Instant};

use chrono::Datelike;
use sqlx::{postgres::PgPoolOptions, Connection, PgConnection, PgPool};

use crate::{
    daemon::http_get,
    helpers::{daemon, due_now, free_port, insert, loan, migrate, slow_down, stop, wait_until, Cluster},
};

/// The replica's timings: `connect_timeout` in the URL, the lease and period of `helpers::daemon`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const LEASE: Duration = Duration::from_secs(3);
const PERIOD: Duration = Duration::from_millis(300);

#[tokio::test]
async fn after_a_late_promotion_work_resumes_within_connect_timeout_plus_lease_plus_a_period() {
    let primary = Cluster::primary_with_libraryd().await;
    migrate(&primary.url("libraryd"));
    let pool: PgPool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&primary.url("libraryd"))
        .await
        .expect("connect to the primary");
    let month = due_now(&pool, 1).await[0];
    let first = month.with_day(1).expect("first day").to_string();
    let loans: Vec<_> = (1..=2_000)
        .map(|n| loan(n, &first, Some(&month.to_string())))
        .collect();
    insert(&pool, &loans).await;
    slow_down(&pool, "update on loans", 0.005).await;
    let standby = primary.standby().await;
    standby.wait_replayed(&primary).await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/libraryd?target_session_attrs=read-write&connect_timeout={}",
        primary.port(),
        standby.port(),
        CONNECT_TIMEOUT.as_secs()
    );
    let port = free_port();
    let replica = daemon(
        &url,
        0,
        1,
        &[
            ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
            ("FINE_SETTLER__HTTP__LISTEN", &format!("127.0.0.1:{port}")),
        ],
    );
    wait_until(
        "a key RUNNING with batches committed",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, i64>(
                "select count(*) from job_runs where status = 'RUNNING' and scanned > 0",
            )
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
                > 0
        },
    )
    .await;
    pool.close().await;
    primary.stop_immediate().await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    let (status, body) = http_get(port, "/readyz").await;
    assert_eq!(status, 503, "during the outage: {body}");
    // What the standby holds of the replica's work before it is promoted: read-only until then, so any later
    // stamp is the replica's, on the promoted server (one host clock for both servers).
    let last_stamp = |url: String| async move {
        let mut conn = PgConnection::connect(&url).await.expect("connect");
        sqlx::query_scalar::<_, Option<chrono::DateTime<chrono::Utc>>>(
            "select max(greatest(heartbeat_at, finished_at)) from job_runs",
        )
        .fetch_one(&mut conn)
        .await
        .expect("job_runs")
    };
    let before = last_stamp(standby.url("libraryd"))
        .await
        .expect("the key's heartbeat reached the standby");
    standby.promote().await;
    let promoted = Instant::now();
    // Resumed: a batch committed, the key was taken over or it finished, on the promoted server.
    loop {
        if last_stamp(standby.url("libraryd")).await > Some(before) {
            break;
        }
        assert!(promoted.elapsed() < Duration::from_secs(60), "never resumed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = promoted.elapsed();
    eprintln!("resumed {took:?} after the promotion");
    // Two seconds of slack for a loaded test machine.
    let promise = CONNECT_TIMEOUT + LEASE + PERIOD + Duration::from_secs(2);
    assert!(
        took <= promise,
        "resumed {took:?} after the promotion (promise {promise:?})"
    );
    // Ready once a tick has read its status on the promoted server, which comes before its first commit (the
    // tick's status read, then its pass): by now, or within a period.
    wait_until("/readyz says ready", Duration::from_secs(5), || async {
        http_get(port, "/readyz").await.0 == 200
    })
    .await;
    let (code, stderr) = stop(replica).await;
    assert_eq!(code, Some(0), "{stderr}");
}
