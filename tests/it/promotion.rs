//! A failover measured: the primary killed while a key is RUNNING, the standby promoted only 12 s later (long
//! enough for an outage backoff to have grown past the promise), and the replica resumes on the promoted
//! standby within `connect_timeout + lease` plus one period of the promotion; meanwhile `/readyz` says ready
//! only once a tick has succeeded again.

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
    standby.promote().await;
    let promoted = Instant::now();
    let mut conn = PgConnection::connect(&standby.url("libraryd"))
        .await
        .expect("promoted");
    let promoted_at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("select now()")
        .fetch_one(&mut conn)
        .await
        .expect("now");
    // Resumed: a batch committed (or the key finished) on the promoted server after the promotion.
    let mut ready_before_resumed = None;
    loop {
        let resumed: i64 = sqlx::query_scalar(
            "select count(*) from job_runs where greatest(heartbeat_at, finished_at) > $1",
        )
        .bind(promoted_at)
        .fetch_one(&mut conn)
        .await
        .expect("job_runs");
        if resumed > 0 {
            break;
        }
        if ready_before_resumed.is_none() && http_get(port, "/readyz").await.0 == 200 {
            ready_before_resumed = Some(promoted.elapsed());
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
    assert_eq!(
        ready_before_resumed, None,
        "/readyz said ready before a tick succeeded"
    );
    let (code, stderr) = stop(replica).await;
    assert_eq!(code, Some(0), "{stderr}");
}
