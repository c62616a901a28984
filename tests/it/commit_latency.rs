//! `throttle.max_commit_latency` on real servers: the pace follows the commit latency the server imposes. Slow
//! commits are made real with a synchronous standby that applies each commit record 300 ms late
//! (`synchronous_commit = remote_apply`, `recovery_min_apply_delay`): every commit on the primary, libraryd's
//! and the probe's alike, then takes at least that long; removing the delay makes commits fast again. The delay
//! and the budget are far apart on both sides, so that a loaded machine's own commit latency does not decide
//! the outcome.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use fine_settler::{
    config::ThrottleSettings,
    jobs::{settlement::Settlement, throttle::Throttle, Outcome},
    metrics::Metrics,
};
use sqlx::{postgres::PgPoolOptions, Connection, Executor, PgConnection, PgPool};

use crate::helpers::{
    database_url, fine_settler, migrate, oracle, output, report, runner, settled, wait_until, Cluster,
};
use crate::throttle::october;

/// How long the throttle's probe transaction takes on a new connection to `url`.
async fn a_commit(url: &str) -> Duration {
    let mut conn = PgConnection::connect(url).await.expect("connect");
    fine_settler::store::latency::probe(&mut conn)
        .await
        .expect("probe")
}

/// The value of the gauge `name` in `metrics` (`None` before it is set).
fn gauge(metrics: &Metrics, name: &str) -> Option<f64> {
    metrics
        .render()
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// While every commit takes 300 ms or more against a 100 ms budget, the pace falls to its floor and the run
/// settles no faster than the floor's rate; once commits are fast again, the pace climbs back and the run
/// finishes, settling exactly what one clean run would.
#[tokio::test]
async fn the_pace_falls_while_commits_are_slow_and_climbs_back_when_they_are_fast() {
    let primary = Cluster::primary_with_libraryd().await;
    let url = primary.url("libraryd");
    migrate(&url);
    let delay = Duration::from_millis(300);
    let standby = primary
        .standby_with(&format!("recovery_min_apply_delay = '{}ms'", delay.as_millis()))
        .await;
    let mut p = primary.connect().await;
    for sql in [
        "alter system set synchronous_standby_names = '*'",
        "alter system set synchronous_commit = 'remote_apply'",
        "select pg_reload_conf()",
    ] {
        p.execute(sql).await.expect("a synchronous standby");
    }
    wait_until(
        "commits wait for the delayed standby",
        Duration::from_secs(20),
        || async { a_commit(&url).await >= delay },
    )
    .await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("connect to the primary");
    october(&pool, 20_000).await;

    let k = crate::helpers::key("2026-10-31", 0, 1);
    let metrics = Arc::new(Metrics::new("0/1".into()));
    let budget = Duration::from_millis(100);
    let run = runner(&pool, "governed", 1_000)
        .with_metrics(metrics.clone())
        .with_throttle(Throttle::new(ThrottleSettings {
            max_commit_latency: Some(budget),
            ..ThrottleSettings::default()
        }));
    let task = tokio::spawn(async move { run.run(&Settlement::new(), k, false).await });
    let rate = || gauge(&metrics, "fine_settler_throttle_rate_rows_per_second");
    // From 2,000 rows/s, halved at most every half second: the floor in about three seconds.
    wait_until("the pace at its floor", Duration::from_secs(60), || async {
        rate() == Some(50.0)
    })
    .await;
    let latency =
        gauge(&metrics, "fine_settler_throttle_commit_latency_seconds").expect("the probe is shown");
    assert_eq!(
        gauge(&metrics, "fine_settler_throttle_commit_latency_budget_seconds"),
        Some(0.1)
    );
    assert!(
        latency >= delay.as_secs_f64(),
        "the probe measured {latency} s, less than the standby's delay"
    );
    // At the floor, the run settles no faster than 50 rows/s (batches of 2 rows, a 50 ms slice of the rate),
    // however fast or slow the machine.
    let (before, since) = (settled(&pool, "2026-10-31").await.0, Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (after, took) = (settled(&pool, "2026-10-31").await.0, since.elapsed());
    assert_eq!(
        rate(),
        Some(50.0),
        "every probe over the budget: the pace stays at its floor"
    );
    let allowed = (50.0 * took.as_secs_f64()).ceil() as i64 + 2;
    assert!(
        after - before <= allowed,
        "{} loans settled in {took:?} at the floor, more than {allowed}",
        after - before
    );

    let mut s = standby.connect().await;
    for sql in [
        "alter system set recovery_min_apply_delay = 0",
        "select pg_reload_conf()",
    ] {
        s.execute(sql).await.expect("no more delay");
    }
    wait_until("commits are fast again", Duration::from_secs(20), || async {
        a_commit(&url).await < budget / 2
    })
    .await;
    let report = tokio::time::timeout(Duration::from_secs(300), task)
        .await
        .expect("the run finished once commits were fast")
        .expect("task");
    assert_eq!((report.outcome, report.updated), (Outcome::Settled, 20_000));
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    let rate = rate().expect("the pace");
    // From the floor, 10 rows/s a probe (ten a second) until 0.5 % of the rate is more: about 1,900 rows/s by
    // the time the last of the loans is settled on an idle machine; a loaded one probes less often.
    assert!(
        rate > 500.0,
        "the pace climbed back from its floor: {rate} rows/s"
    );
    let waited = crate::throttle::throttled_seconds(&metrics, "commit_latency");
    assert!(waited > 0.0, "batches waited for the adapted pace");
    pool.close().await;
}

/// The `settle` command under a budget every commit keeps: the run settles everything, its pacing is one episode
/// in the log, said with the budget.
#[sqlx::test(fixtures("default_policy"))]
async fn the_settle_command_paces_to_a_commit_latency_budget(pool: PgPool) {
    october(&pool, 2_000).await;
    let mut cmd = fine_settler(&database_url(&pool));
    cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "500")
        .env("FINE_SETTLER__THROTTLE__MAX_COMMIT_LATENCY", "10s")
        .args(["settle", "--business-date", "2026-10-31"]);
    let out = output(cmd);
    let json = report(&out);
    assert_eq!(json["outcome"], "settled", "{json}");
    assert_eq!(json["updated"], 2_000);
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        log.matches("throttled: batches paced to keep commits within throttle.max_commit_latency")
            .count(),
        1,
        "{log}"
    );
    assert_eq!(log.matches("throttle released").count(), 1, "{log}");
    assert!(!log.contains("a commit took longer"), "{log}");
}

/// A probe that never returns (its write made to hang on this database) neither holds the run nor takes the
/// pool's connections: each counts as over the budget once its timeout passes, its connection is closed, and the
/// run settles every loan at the pace's floor or better.
#[sqlx::test(fixtures("default_policy"))]
async fn a_hung_probe_neither_holds_the_run_nor_takes_the_pool(pool: PgPool) {
    october(&pool, 300).await;
    let db: String = sqlx::query_scalar("select current_database()")
        .fetch_one(&pool)
        .await
        .expect("database");
    for sql in [
        "create function public.pg_logical_emit_message(bool, text, text) returns pg_lsn language plpgsql as $$
         begin perform pg_sleep(3600); return null; end $$"
            .to_string(),
        format!("alter database \"{db}\" set search_path = public, pg_catalog"),
    ] {
        pool.execute(sql.as_str()).await.expect("a probe that hangs");
    }
    let mut cmd = fine_settler(&database_url(&pool));
    cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "100")
        .env("FINE_SETTLER__DATABASE__MAX_CONNECTIONS", "2")
        .env("FINE_SETTLER__THROTTLE__MAX_COMMIT_LATENCY", "5ms")
        .args(["settle", "--business-date", "2026-10-31"]);
    let out = output(cmd);
    let log = String::from_utf8_lossy(&out.stderr);
    let json = report(&out);
    assert_eq!(json["outcome"], "settled", "{json} {log}");
    assert_eq!(json["updated"], 300, "{log}");
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    let hung: i64 = sqlx::query_scalar(
        "select count(*) from pg_stat_activity where datname = current_database() and query like '%pg_logical_emit_message%' and pid <> pg_backend_pid()",
    )
    .fetch_one(&pool)
    .await
    .expect("sessions");
    assert!(hung <= 1, "{hung} probes still running on the server");
}
