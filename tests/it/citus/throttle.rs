//! The throttle's replica-lag limit on Citus: a batch's writes land on the workers, so a streaming standby of a
//! worker — which the coordinator's `pg_stat_replication` does not show — holds the batches while its replay is
//! paused, and the log names it with its worker; once replay resumes the run settles the month.
//!
//! The standby is a base backup of the first worker of `scripts/citus.sh`'s cluster, listening on the port three
//! after the coordinator's (the cluster's nodes use the first three), and is stopped and removed at the end.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, PgPool};

use crate::{
    helpers::{
        citus::{coordinator_port, on_citus, pg_bin, worker_urls},
        database_url, exit_of, fine_settler, oracle, settled, spawn, Cluster, StderrLog,
    },
    throttle::october,
};

/// What a standby of a worker runs with besides the worker's own postgresql.conf: loopback TCP only, and a
/// report of its positions every second (default 10 s).
const STANDBY: &str = "
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
hot_standby = on
wal_receiver_status_interval = '1s'
";

async fn loans_settled(pool: &PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from loans where fine_settled_at is not null")
        .fetch_one(pool)
        .await
        .expect("settled loans")
}

#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn a_paused_standby_of_a_worker_holds_every_batch_until_replay_resumes() {
    on_citus("lag", &["default_policy"], |pool: PgPool| async move {
        october(&pool, 3_000).await;
        let worker = coordinator_port() + 1;
        let standby = Cluster::standby_of(worker, coordinator_port() + 3, pg_bin(), STANDBY).await;
        standby.pause_replay().await;
        // WAL on the worker that its standby does not replay (libraryd's traffic).
        let mut on_worker = PgConnection::connect(&worker_urls(&pool)[0])
            .await
            .expect("connect to the first worker");
        sqlx::query("create table libraryd_traffic as select g from generate_series(1, 1000) g")
            .execute(&mut on_worker)
            .await
            .expect("WAL the standby does not replay");

        let mut cmd = fine_settler(&database_url(&pool));
        cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "200")
            .env("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "1s")
            .env("FINE_SETTLER__THROTTLE__STANDBYS", standby.name())
            .env("FINE_SETTLER__CLAIM__LEASE", "6s")
            .args(["settle", "--business-date", "2026-10-31"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = spawn(&mut cmd);
        let log = StderrLog::collect(&mut child);
        // Held from its first batch: the standby's lag is unknown, then known to pass the limit.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !log.contains("throttled: a standby lags") {
            let written = loans_settled(&pool).await;
            assert!(
                written == 0 && Instant::now() < deadline,
                "no hold for the worker's standby ({written} loans settled meanwhile): {}",
                log.snapshot()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        // Held for longer than the lease: no loan settled on any worker, the key RUNNING with a live lease.
        for _ in 0..16 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let (status, live): (String, bool) = sqlx::query_as(
                "select status, lease_until > now() from job_runs where job_name = 'fine-settlement'",
            )
            .fetch_one(&pool)
            .await
            .expect("the key");
            assert_eq!((status.as_str(), live), ("RUNNING", true));
            assert_eq!(
                loans_settled(&pool).await,
                0,
                "a batch committed while the standby lagged"
            );
        }

        let resumed_at = Instant::now();
        standby.resume_replay().await;
        let (code, _) = exit_of(child, Duration::from_secs(60)).await;
        let stderr = log.finish();
        assert_eq!(code, Some(0), "{stderr}");
        eprintln!(
            "citus::throttle: settled {:?} after replay resumed",
            resumed_at.elapsed()
        );
        assert_eq!(
            settled(&pool, "2026-10-31").await,
            oracle(&pool, "2026-10-31").await
        );
        assert_eq!(loans_settled(&pool).await, 3_000);
        // The log names the standby and its worker.
        let held = stderr
            .lines()
            .find(|l| l.contains("throttled: a standby lags"))
            .expect("the hold's line");
        assert!(
            held.contains(standby.name()) && held.contains(&format!("of worker 127.0.0.1:{worker}")),
            "{held}"
        );
        assert!(stderr.contains("throttle released"), "{stderr}");
        assert!(
            !stderr.contains("do not stream from this server"),
            "the named standby was found on its worker: {stderr}"
        );
        on_worker.close().await.expect("close");
        drop(standby);
    })
    .await;
}
