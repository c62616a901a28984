//! `[throttle]` on real servers: the rows-per-second cap (in-process and through the `settle` command), batches
//! shrunk to `throttle.batch_duration` under a slowed trigger, and the replica lag limit against a real streaming
//! standby whose replay is paused — no batch commits while it lags or its lag is not known yet (also a run's only
//! batch, against lag from before the run), nor does the daemon's compensation pass; the run renews its lease
//! while it waits and finishes soon after replay resumes.

use std::{
    process::Stdio,
    sync::Arc,
    time::{Duration, Instant},
};

use fine_settler::{
    config::{ClaimSettings, Lease, ThrottleSettings},
    jobs::{settlement::Settlement, throttle::Throttle, Outcome},
    metrics::Metrics,
};
use sqlx::{postgres::PgPoolOptions, Executor, PgPool};

use crate::helpers::{
    database_url, db, fine_settler, insert, loan, migrate, oracle, output, report, runner, settled,
    slow_down, spawn, wait_until, Cluster, StderrLog,
};

/// `n` loans returned in October 2026 (ids from 1), each 5 days late.
pub(crate) async fn october(pool: &PgPool, n: i64) {
    let loans: Vec<_> = (1..=n)
        .map(|id| loan(id, "2026-10-01", Some("2026-10-06")))
        .collect();
    insert(pool, &loans).await;
}

/// A fresh primary with a migrated `libraryd` holding `n` October loans: the server, the database's URL, a pool.
async fn primary_with_october(n: i64) -> (Cluster, String, PgPool) {
    let primary = Cluster::primary_with_libraryd().await;
    let url = primary.url("libraryd");
    migrate(&url);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("connect to the primary");
    october(&pool, n).await;
    (primary, url, pool)
}

/// The seconds `metrics` counted batches waiting for `reason` (0 before any wait).
pub(crate) fn throttled_seconds(metrics: &Metrics, reason: &str) -> f64 {
    metrics
        .render()
        .lines()
        .find(|l| {
            l.starts_with("fine_settler_throttled_seconds_total{")
                && l.contains(&format!("reason=\"{reason}\""))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or(0.0)
}

fn throttle(settings: ThrottleSettings) -> Arc<Throttle> {
    Throttle::new(settings)
}

/// Slows each loan's settlement down (half a millisecond a row: about 3 s of work unthrottled for 6,000 loans,
/// batches of 200 take 0.1 s each), starts a standby of `primary`, lets it catch up, pauses its replay and writes
/// WAL it does not replay.
async fn slow_loans_and_a_paused_standby(primary: &Cluster, pool: &PgPool) -> Cluster {
    slow_down(pool, "update on loans", 0.0005).await;
    let standby = primary.standby().await;
    standby.wait_replayed(primary).await;
    standby.pause_replay().await;
    sqlx::query("create table libraryd_traffic as select g from generate_series(1, 1000) g")
        .execute(pool)
        .await
        .expect("WAL the standby does not replay");
    standby
}

/// `settle` of October on `url` in batches of 200 under a lag limit of 1 s and a short lease (6 s, so that a wait
/// outlasts it), its output piped.
fn settle_under_a_lag_limit(url: &str) -> std::process::Command {
    let mut cmd = fine_settler(url);
    cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "200")
        .env("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "1s")
        .env("FINE_SETTLER__CLAIM__LEASE", "6s")
        .args(["settle", "--business-date", "2026-10-31"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_run_under_a_rows_per_second_cap_takes_at_least_rows_over_cap(pool: PgPool) {
    october(&pool, 2_000).await;
    let k = crate::helpers::key("2026-10-31", 0, 1);
    let metrics = Arc::new(Metrics::new("0/1".into()));
    let cap = 1_000;
    let run = runner(&pool, "capped", 100)
        .with_metrics(metrics.clone())
        .with_throttle(throttle(ThrottleSettings {
            max_rows_per_second: Some(cap),
            ..ThrottleSettings::default()
        }));
    let started = Instant::now();
    let report = run.run(&Settlement::new(), k, false).await;
    let took = started.elapsed();
    assert_eq!((report.outcome, report.updated), (Outcome::Settled, 2_000));
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    let floor = Duration::from_secs_f64(0.9 * 2_000.0 / f64::from(cap));
    assert!(
        took >= floor,
        "2000 rows under {cap}/s took {took:?}, less than {floor:?}"
    );
    let waited = throttled_seconds(&metrics, "rate");
    assert!(
        waited > 1.0,
        "the run waited {waited} s for the rate, by the metric"
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn the_settle_command_honours_the_cap_from_its_configuration(pool: PgPool) {
    october(&pool, 1_000).await;
    let mut cmd = fine_settler(&database_url(&pool));
    cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "50")
        .env("FINE_SETTLER__THROTTLE__MAX_ROWS_PER_SECOND", "500")
        .args(["settle", "--business-date", "2026-10-31"]);
    let started = Instant::now();
    let out = output(cmd);
    let took = started.elapsed();
    let json = report(&out);
    assert_eq!(json["outcome"], "settled", "{json}");
    assert_eq!(json["updated"], 1_000);
    assert!(
        took >= Duration::from_millis(1_800),
        "1000 rows under 500/s took {took:?}"
    );
    let log = String::from_utf8_lossy(&out.stderr);
    // One episode, logged once when it starts and once when it ends.
    assert_eq!(log.matches("throttled: batches paced").count(), 1, "{log}");
    assert_eq!(log.matches("throttle released").count(), 1, "{log}");
}

#[sqlx::test(fixtures("default_policy"))]
async fn batches_shrink_to_the_target_duration_under_a_slow_trigger(pool: PgPool) {
    october(&pool, 1_200).await;
    // Which transaction wrote each loan: the batches' sizes, in commit order.
    sqlx::raw_sql(
        r#"create table batch_rows (loan_id bigint primary key, tx bigint not null, at timestamptz not null);
           create function note_batch() returns trigger language plpgsql as $$
           begin
               insert into batch_rows values (new.id, txid_current(), clock_timestamp());
               return new;
           end $$;
           create trigger note_batch after update on loans for each row execute function note_batch();"#,
    )
    .execute(&pool)
    .await
    .expect("batch trigger");
    // 2 ms a row: a batch of 200 holds its transaction for about 400 ms.
    slow_down(&pool, "update on loans", 0.002).await;
    let k = crate::helpers::key("2026-10-31", 0, 1);
    let report = runner(&pool, "sized", 200)
        .with_throttle(throttle(ThrottleSettings {
            batch_duration: Some(Duration::from_millis(100)),
            ..ThrottleSettings::default()
        }))
        .run(&Settlement::new(), k, false)
        .await;
    assert_eq!((report.outcome, report.updated), (Outcome::Settled, 1_200));
    let sizes: Vec<i64> = sqlx::query_scalar("select count(*) from batch_rows group by tx order by min(at)")
        .fetch_all(&pool)
        .await
        .expect("batch sizes");
    assert_eq!(sizes.iter().sum::<i64>(), 1_200);
    assert_eq!(sizes[0], 200, "the first batch has batch_size rows: {sizes:?}");
    // After the first, a batch of about 100 ms holds about 50 rows; never the full 200 again.
    assert!(
        sizes[1..].iter().all(|s| *s <= 100),
        "later batches stay near the target: {sizes:?}"
    );
    assert!(sizes.len() >= 8, "{sizes:?}");
}

/// Settles 6,000 loans on `primary` with the `settle` command under a lag limit of 1 s while `standby`'s replay is
/// paused; a short lease (6 s) so that the wait outlasts it. Replay is paused before the run starts and libraryd
/// writes after that, so the standby has not replayed what there was when the run first looked: its lag is
/// unknown at the first batch, then known to pass the limit — no batch commits until replay resumes.
#[tokio::test]
async fn a_paused_standby_holds_every_batch_until_replay_resumes() {
    let (primary, url, pool) = primary_with_october(6_000).await;
    sqlx::raw_sql(
        r#"create table batch_rows (loan_id bigint primary key, at timestamptz not null);
           create function note_batch() returns trigger language plpgsql as $$
           begin insert into batch_rows values (new.id, clock_timestamp()); return new; end $$;
           create trigger note_batch after update on loans for each row execute function note_batch();"#,
    )
    .execute(&pool)
    .await
    .expect("batch trigger");
    let standby = slow_loans_and_a_paused_standby(&primary, &pool).await;

    let mut cmd = settle_under_a_lag_limit(&url);
    // Named, as an operator would list the standbys to watch.
    cmd.env("FINE_SETTLER__THROTTLE__STANDBYS", standby.name()).env(
        "FINE_SETTLER__LOG__LEVEL",
        "info,fine_settler::jobs::runner=debug",
    );
    let mut child = spawn(&mut cmd);
    let log = StderrLog::collect(&mut child);
    wait_until(
        "the run waits for the standby",
        Duration::from_secs(30),
        || async { log.contains("throttled: a standby lags") },
    )
    .await;

    // Held for longer than the lease: nothing commits, and the key stays RUNNING with a live lease.
    let mut expired = 0;
    for _ in 0..16 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (status, live): (String, bool) = sqlx::query_as(
            "select status, lease_until > now() from job_runs where job_name = 'fine-settlement'",
        )
        .fetch_one(&pool)
        .await
        .expect("key");
        assert_eq!(status, "RUNNING");
        expired += i32::from(!live);
    }
    assert_eq!(expired, 0, "the waiting run let its lease expire");
    let written: i64 = sqlx::query_scalar("select count(*) from batch_rows")
        .fetch_one(&pool)
        .await
        .expect("batch rows");
    assert_eq!(written, 0, "a batch committed while the standby lagged");

    let resumed_at = Instant::now();
    standby.resume_replay().await;
    let (code, _) = crate::helpers::exit_of(child, Duration::from_secs(60)).await;
    let stderr = log.finish();
    let after_resume = resumed_at.elapsed();
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    // The work is about 3 s; the standby reports its replay every second.
    assert!(
        after_resume < Duration::from_secs(12),
        "the run took {after_resume:?} after replay resumed"
    );
    // Unknown at the first batch, unless the report proving the lag came before that batch looked.
    assert!(
        stderr
            .matches("throttled: a standby's lag is not known yet")
            .count()
            <= 1,
        "{stderr}"
    );
    assert_eq!(stderr.matches("throttled: a standby lags").count(), 1, "{stderr}");
    assert!(stderr.contains("lease renewed while throttled"), "{stderr}");
    assert!(stderr.contains("throttle released"), "{stderr}");
    let left: i64 =
        sqlx::query_scalar("select count(*) from job_runs where status = 'RUNNING' and lease_until < now()")
            .fetch_one(&pool)
            .await
            .expect("expired keys");
    assert_eq!(left, 0);
    pool.close().await;
}

/// A standby whose connection drops while it lags — replay paused, the primary's walsender ended — leaves
/// `pg_stat_replication` and does not come back while its replay is paused. A run that saw it lag goes on
/// holding its batches (warned once) until it is back and has replayed, rather than writing at once.
#[tokio::test]
async fn a_standby_whose_connection_drops_while_it_lags_still_holds_batches_until_it_is_back() {
    let (primary, url, pool) = primary_with_october(6_000).await;
    let standby = slow_loans_and_a_paused_standby(&primary, &pool).await;

    let mut cmd = settle_under_a_lag_limit(&url);
    let mut child = spawn(&mut cmd);
    let log = StderrLog::collect(&mut child);
    wait_until(
        "the run waits for the standby",
        Duration::from_secs(30),
        || async { log.contains("throttled: a standby lags") },
    )
    .await;

    sqlx::query("select pg_terminate_backend(pid) from pg_stat_replication")
        .execute(&pool)
        .await
        .expect("end the walsender");
    wait_until(
        "the standby leaves pg_stat_replication",
        Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, i64>("select count(*) from pg_stat_replication")
                .fetch_one(&pool)
                .await
                .expect("standbys")
                == 0
        },
    )
    .await;
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let connected: i64 = sqlx::query_scalar("select count(*) from pg_stat_replication")
            .fetch_one(&pool)
            .await
            .expect("standbys");
        assert_eq!(
            connected, 0,
            "the paused standby reconnected: the test proves nothing"
        );
        assert_eq!(
            settled(&pool, "2026-10-31").await,
            (0, 0),
            "a batch committed after the lagging standby's connection dropped"
        );
    }
    assert!(
        log.contains("left pg_stat_replication (its connection dropped)"),
        "no warning of the standby that left"
    );

    standby.resume_replay().await;
    let (code, _) = crate::helpers::exit_of(child, Duration::from_secs(60)).await;
    let stderr = log.finish();
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    assert_eq!(
        stderr.matches("left pg_stat_replication").count(),
        1,
        "warned once: {stderr}"
    );
    pool.close().await;
}

/// Lag that existed before the run: replay paused and 200,000 rows of WAL left unreplayed for 3 s, then a run that
/// fits in one batch, the standby reporting at PostgreSQL's default 10 s. The first batch waits (the standby's lag
/// is not known: it had not replayed the run's first noted position) until a report later than the limit proves
/// the lag, and the run writes nothing until replay resumes.
#[tokio::test]
async fn wal_left_unreplayed_before_a_run_holds_its_only_batch_at_the_default_status_interval() {
    let (primary, url, pool) = primary_with_october(300).await;
    let standby = primary.standby_with("wal_receiver_status_interval = '10s'").await;
    let mut s = standby.connect().await;
    let interval: String = sqlx::query_scalar("show wal_receiver_status_interval")
        .fetch_one(&mut s)
        .await
        .expect("interval");
    assert_eq!(interval, "10s");
    standby.wait_replayed(&primary).await;
    standby.pause_replay().await;
    sqlx::query("create table libraryd_traffic as select g, repeat('x', 100) as pad from generate_series(1, 200000) g")
        .execute(&pool)
        .await
        .expect("WAL the standby does not replay");
    tokio::time::sleep(Duration::from_secs(3)).await;

    let mut cmd = fine_settler(&url);
    cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "1000")
        .env("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "1s")
        .args(["settle", "--business-date", "2026-10-31"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = spawn(&mut cmd);
    let log = StderrLog::collect(&mut child);
    // The standby's next report comes within its 10 s interval, later than the limit after the first look.
    wait_until(
        "the run is held for the lagging standby",
        Duration::from_secs(40),
        || async { log.contains("throttled: a standby lags") },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        (0, 0),
        "the run's only batch committed while the standby lagged"
    );
    standby.resume_replay().await;
    let (code, _) = crate::helpers::exit_of(child, Duration::from_secs(60)).await;
    let stderr = log.finish();
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    assert_eq!(
        stderr
            .matches("throttled: a standby's lag is not known yet")
            .count(),
        1,
        "{stderr}"
    );
    assert_eq!(stderr.matches("throttled: a standby lags").count(), 1, "{stderr}");
    assert!(stderr.contains("throttle released"), "{stderr}");
    pool.close().await;
}

/// The other half of the first-batch rule, at PostgreSQL's default 10 s status interval: a healthy standby whose
/// last report predates libraryd's last write may hold a run's first batch until its next report, which shows it
/// replayed everything — then the run goes on, never judged lagging.
#[tokio::test]
async fn a_healthy_quiet_standby_is_cleared_by_its_next_report_at_the_default_status_interval() {
    let (primary, url, pool) = primary_with_october(300).await;
    let standby = primary.standby_with("wal_receiver_status_interval = '10s'").await;
    standby.wait_replayed(&primary).await;
    sqlx::query("create table libraryd_traffic as select g from generate_series(1, 1000) g")
        .execute(&pool)
        .await
        .expect("libraryd writes");
    let mut cmd = fine_settler(&url);
    cmd.env("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "1s").args([
        "settle",
        "--business-date",
        "2026-10-31",
    ]);
    let started = Instant::now();
    let out = output(cmd);
    let took = started.elapsed();
    crate::helpers::assert_success(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    assert!(!stderr.contains("throttled: a standby lags"), "{stderr}");
    // At most one status interval of waiting, and the work (well under a second).
    assert!(took < Duration::from_secs(20), "took {took:?}: {stderr}");
    eprintln!("throttle: a healthy standby at the default interval: settle took {took:?}");
    pool.close().await;
}

/// `accrue` retries the shard's due pending charges before its day: while a standby lags, that pass waits as a
/// batch would, and charges once replay resumes.
#[tokio::test]
async fn accrue_s_compensation_pass_waits_for_a_lagging_standby() {
    let (primary, url, pool) = primary_with_october(0).await;
    insert(
        &pool,
        &(1..=5).map(|id| loan(id, "2026-09-01", None)).collect::<Vec<_>>(),
    )
    .await;
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (1, '2026-10-01', 100, 1, 'lock timeout', now() - interval '1 second')",
    )
    .execute(&pool)
    .await
    .expect("pending");
    let standby = primary.standby().await;
    standby.wait_replayed(&primary).await;
    standby.pause_replay().await;
    sqlx::query("create table libraryd_traffic as select g from generate_series(1, 1000) g")
        .execute(&pool)
        .await
        .expect("WAL the standby does not replay");
    let mut cmd = fine_settler(&url);
    cmd.env("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "1s")
        .args(["accrue", "--date", "2026-10-20"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = spawn(&mut cmd);
    let log = StderrLog::collect(&mut child);
    wait_until(
        "the compensation pass waits for the standby",
        Duration::from_secs(30),
        || async { log.contains("compensation pass waits: ") },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let charged: i64 = sqlx::query_scalar("select count(*) from fine_ledger")
        .fetch_one(&pool)
        .await
        .expect("ledger");
    assert_eq!(charged, 0, "charged while the standby lagged");
    standby.resume_replay().await;
    let (code, _) = crate::helpers::exit_of(child, Duration::from_secs(60)).await;
    let stderr = log.finish();
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("compensation pass resumes"), "{stderr}");
    let pending: i64 = sqlx::query_scalar("select count(*) from fine_pending where status = 'PENDING'")
        .fetch_one(&pool)
        .await
        .expect("pending");
    assert_eq!(pending, 0, "{stderr}");
    let day: i64 = sqlx::query_scalar(
        "select count(*) from fine_ledger where loan_id = 1 and accrual_date = '2026-10-01'",
    )
    .fetch_one(&pool)
    .await
    .expect("charged");
    assert_eq!(day, 1, "{stderr}");
    pool.close().await;
}

/// Between runs, the daemon's compensation pass writes charges too: while a standby's lag is unknown or past the
/// limit, the tick leaves its due pending charges for a later tick (and its runs wait, as every run does); once
/// the standby has caught up, the next tick charges them.
#[tokio::test]
async fn the_compensation_pass_waits_for_a_lagging_standby() {
    let (primary, url, pool) = primary_with_october(0).await;
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("select now()")
        .fetch_one(&pool)
        .await
        .expect("now");
    let today = fine_settler::calendar::local_date(now, chrono_tz::Asia::Shanghai);
    let long_ago = (today - chrono::Duration::days(40)).to_string();
    insert(
        &pool,
        &(1..=20).map(|id| loan(id, &long_ago, None)).collect::<Vec<_>>(),
    )
    .await;
    let old_day = today - chrono::Duration::days(20);
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (1, $1, 100, 1, 'lock timeout', now() - interval '1 second')",
    )
    .bind(old_day)
    .execute(&pool)
    .await
    .expect("pending");
    let standby = primary.standby().await;
    standby.wait_replayed(&primary).await;
    standby.pause_replay().await;
    sqlx::query("create table libraryd_traffic as select g from generate_series(1, 50000) g")
        .execute(&pool)
        .await
        .expect("WAL the standby does not replay");
    let tick = || {
        let mut cmd = fine_settler(&url);
        cmd.env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
            .env("FINE_SETTLER__SETTLEMENT__ENABLED", "false")
            .env("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "1s")
            .args(["run", "--once"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    };
    let pending = || async {
        sqlx::query_scalar::<_, i64>("select count(*) from fine_pending where status = 'PENDING'")
            .fetch_one(&pool)
            .await
            .expect("pending")
    };
    let mut child = spawn(&mut tick());
    let log = StderrLog::collect(&mut child);
    wait_until(
        "the tick's runs wait for the standby",
        Duration::from_secs(40),
        || async { log.contains("throttled: a standby lags") },
    )
    .await;
    let charged: i64 = sqlx::query_scalar("select count(*) from fine_ledger")
        .fetch_one(&pool)
        .await
        .expect("ledger");
    assert_eq!(charged, 0, "charged while the standby lagged");
    standby.resume_replay().await;
    let (code, _) = crate::helpers::exit_of(child, Duration::from_secs(60)).await;
    let stderr = log.finish();
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("compensation pass left for a later tick: a standby lags"),
        "{stderr}"
    );
    assert_eq!(pending().await, 1, "the held pass charged the pending day");
    // Caught up: the next tick retries the pending charge.
    standby.wait_replayed(&primary).await;
    let out = output(tick());
    crate::helpers::assert_success(&out);
    assert_eq!(pending().await, 0, "{}", String::from_utf8_lossy(&out.stderr));
    let day: i64 =
        sqlx::query_scalar("select count(*) from fine_ledger where loan_id = 1 and accrual_date = $1")
            .bind(old_day)
            .fetch_one(&pool)
            .await
            .expect("charged");
    assert_eq!(day, 1);
    pool.close().await;
}

/// `throttle.standbys` leaves out a standby it does not name (one with `recovery_min_apply_delay`, say): its
/// paused replay holds nothing, and a name that does not stream is warned about once.
#[tokio::test]
async fn a_standby_left_out_of_throttle_standbys_holds_nothing() {
    let (primary, url, pool) = primary_with_october(6_000).await;
    slow_down(&pool, "update on loans", 0.0005).await;
    let standby = primary.standby().await;
    standby.wait_replayed(&primary).await;
    standby.pause_replay().await;
    let mut cmd = fine_settler(&url);
    cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "200")
        .env("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "1s")
        .env("FINE_SETTLER__THROTTLE__STANDBYS", "dr-west")
        .args(["settle", "--business-date", "2026-10-31"]);
    let started = Instant::now();
    let out = output(cmd);
    let took = started.elapsed();
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(report(&out)["updated"], 6_000, "{log}");
    assert!(!log.contains("throttled"), "{log}");
    assert_eq!(
        log.matches("names standbys that do not stream").count(),
        1,
        "{log}"
    );
    assert!(log.contains("dr-west"), "{log}");
    assert!(
        took > Duration::from_secs(2),
        "the run outlasted the limit: {took:?}"
    );
    standby.resume_replay().await;
    pool.close().await;
}

/// With the standby reporting at PostgreSQL's default pace (`wal_receiver_status_interval = 10s`) and a limit
/// shorter than that (2 s): one lag episode while replay is paused, released at the standby's first report after
/// the resume, and no more after it — a healthy standby's old reports, and the `replay_lag` it measured while
/// paused, never hold a batch again.
#[tokio::test]
async fn a_standby_reporting_every_ten_seconds_holds_batches_once_and_not_after_it_caught_up() {
    let (primary, url, pool) = primary_with_october(8_000).await;
    slow_down(&pool, "update on loans", 0.0005).await;
    let standby = primary.standby_with("wal_receiver_status_interval = '10s'").await;
    standby.wait_replayed(&primary).await;
    standby.pause_replay().await;

    let mut cmd = fine_settler(&url);
    cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "200")
        .env("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "2s")
        .args(["settle", "--business-date", "2026-10-31"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = spawn(&mut cmd);
    let log = StderrLog::collect(&mut child);
    wait_until(
        "the run waits for the standby",
        Duration::from_secs(30),
        || async { log.contains("throttled: a standby lags") },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let resumed_at = Instant::now();
    standby.resume_replay().await;
    let (code, _) = crate::helpers::exit_of(child, Duration::from_secs(90)).await;
    let after_resume = resumed_at.elapsed();
    let stderr = log.finish();
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    assert_eq!(
        stderr.matches("throttled: a standby lags").count(),
        1,
        "held again after the standby caught up:\n{stderr}"
    );
    // Released at the standby's next report (at most 10 s), then the rest of the work (at most about 4 s).
    assert!(
        after_resume < Duration::from_secs(20),
        "the run took {after_resume:?} after replay resumed"
    );
    eprintln!("throttle: 10 s status interval, 2 s limit: finished {after_resume:?} after the resume");
    pool.close().await;
}

/// A role without `pg_read_all_stats` cannot see standbys' positions: a command with a lag limit says so once and
/// runs unthrottled. `deploy/sql/least-privilege.sql -v monitor=on` grants what the limit needs.
#[sqlx::test(fixtures("default_policy"))]
async fn a_lag_limit_the_role_cannot_read_warns_once_and_the_script_can_grant_it(pool: PgPool) {
    october(&pool, 300).await;
    let november: Vec<_> = (1_001..=1_300)
        .map(|id| loan(id, "2026-11-01", Some("2026-11-06")))
        .collect();
    insert(&pool, &november).await;
    let owner_url = database_url(&pool);
    let (base, db) = owner_url.rsplit_once('/').expect("url");
    // Roles are cluster-wide: named after the test's database.
    let tail: String = db.to_lowercase().chars().rev().take(24).collect();
    let role = format!("fm_{tail}");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/sql/least-privilege.sql");
    let grant = |extra: &[&str]| {
        let out = std::process::Command::new("psql")
            .arg(&owner_url)
            .args(["-qX", "-v", "ON_ERROR_STOP=1", "-v", &format!("role={role}")])
            .args(["-v", "password=s3cret"])
            .args(extra)
            .args(["-f", script])
            .output()
            .expect("psql");
        crate::helpers::assert_success(&out);
    };
    grant(&[]);
    let (scheme, host) = base.split_once("://").expect("scheme");
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    let role_url = format!("{scheme}://{role}:s3cret@{host}/{db}");
    let settle = |date: &str| {
        let mut cmd = fine_settler(&role_url);
        cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "50")
            .env("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "1s")
            .args(["settle", "--business-date", date]);
        let out = output(cmd);
        (report(&out), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (json, log) = settle("2026-10-31");
    assert_eq!(
        (json["outcome"].clone(), json["updated"].clone()),
        ("settled".into(), 300.into()),
        "{log}"
    );
    assert_eq!(
        log.matches("may not read standbys' positions").count(),
        1,
        "{log}"
    );

    grant(&["-v", "monitor=on"]);
    let readable: bool = sqlx::query_scalar("select pg_has_role($1, 'pg_read_all_stats', 'usage')")
        .bind(&role)
        .fetch_one(&pool)
        .await
        .expect("role");
    assert!(readable, "monitor=on grants pg_read_all_stats");
    let (json, log) = settle("2026-11-30");
    assert_eq!(json["updated"], 300, "{log}");
    assert!(!log.contains("may not read"), "{log}");
    sqlx::raw_sql(&format!("drop owned by {role}; drop role {role};"))
        .execute(&pool)
        .await
        .expect("drop role");
}

/// A run waiting for a lagging standby still hears an operator's pause: its lease renewal, like a batch's
/// fence, sees it, and the run hands its key back without waiting for the standby.
#[tokio::test]
async fn an_operator_pause_reaches_a_run_waiting_for_a_lagging_standby() {
    let (primary, _, pool) = primary_with_october(3_000).await;
    slow_down(&pool, "update on loans", 0.0005).await;
    let standby = primary.standby().await;
    standby.wait_replayed(&primary).await;
    standby.pause_replay().await;

    let k = crate::helpers::key("2026-10-31", 0, 1);
    // A 3 s lease, renewed every second while the run waits.
    let claim = ClaimSettings {
        lease: Lease::new(Duration::from_secs(3), None, None).expect("lease"),
        history_retention: Duration::from_secs(86_400),
    };
    let metrics = Arc::new(Metrics::new("0/1".into()));
    let run = fine_settler::jobs::runner::Runner::new(
        db(&pool),
        "waiting".into(),
        &claim,
        100,
        tokio_util::sync::CancellationToken::new(),
    )
    .with_metrics(metrics.clone())
    .with_throttle(throttle(ThrottleSettings {
        max_replica_lag: Some(Duration::from_secs(1)),
        ..ThrottleSettings::default()
    }));
    let task = tokio::spawn(async move { run.run(&Settlement::new(), k, false).await });
    // Past a renewal: the wait has outlasted a third of the lease.
    wait_until(
        "the run waits for the standby",
        Duration::from_secs(30),
        || async { throttled_seconds(&metrics, "replica_lag") > 1.5 },
    )
    .await;
    sqlx::query(
        "insert into job_pauses (job_name, shards, shard, paused_by, reason)
         values ('fine-settlement', 0, 0, 'ops', 'month-end freeze')",
    )
    .execute(&pool)
    .await
    .expect("pause");
    let report = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the waiting run handed its key back within a renewal or two")
        .expect("task");
    assert!(report.paused, "{report:?}");
    assert_eq!(report.outcome, Outcome::Failed);
    assert!(report.updated < 3_000, "{report:?}");
    let (status, error, lease_ended): (String, Option<String>, bool) =
        sqlx::query_as("select status, last_error, lease_until <= now() from job_runs")
            .fetch_one(&pool)
            .await
            .expect("key");
    assert_eq!(status, "FAILED");
    assert_eq!(error.as_deref(), Some("paused: month-end freeze (by ops)"));
    assert!(lease_ended);
    standby.resume_replay().await;
    pool.close().await;
}

/// The daemon's runs are throttled too: one tick (`run --once`) settling the last month end under a cap.
#[sqlx::test(fixtures("default_policy"))]
async fn the_daemon_paces_its_runs(pool: PgPool) {
    let month_end = crate::helpers::due_now(&pool, 1).await[0];
    let first = chrono::Datelike::with_day(&month_end, 1)
        .expect("first day")
        .to_string();
    let loans: Vec<_> = (1..=600)
        .map(|id| loan(id, &first, Some(&month_end.to_string())))
        .collect();
    insert(&pool, &loans).await;
    let mut tick = fine_settler(&database_url(&pool));
    tick.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "50")
        .env("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1")
        .env("FINE_SETTLER__THROTTLE__MAX_ROWS_PER_SECOND", "300")
        .args(["run", "--once"]);
    let started = Instant::now();
    let out = output(tick);
    let took = started.elapsed();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert_eq!(settled(&pool, &month_end.to_string()).await.0, 600, "{log}");
    assert!(
        took >= Duration::from_millis(1_800),
        "600 rows under 300/s took {took:?}"
    );
    assert_eq!(log.matches("throttled: batches paced").count(), 1, "{log}");
}

/// Accrual batches are paced like settlement's: `accrue` of a day with 600 overdue loans under 300 rows/s.
#[sqlx::test(fixtures("default_policy"))]
async fn the_accrue_command_is_paced_too(pool: PgPool) {
    let today = fine_settler::calendar::local_date(chrono::Utc::now(), chrono_tz::Asia::Shanghai);
    let day = today - chrono::Duration::days(5);
    let due = (day - chrono::Duration::days(3)).to_string();
    let loans: Vec<_> = (1..=600).map(|id| loan(id, &due, None)).collect();
    insert(&pool, &loans).await;
    let mut cmd = fine_settler(&database_url(&pool));
    cmd.env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "50")
        .env("FINE_SETTLER__THROTTLE__MAX_ROWS_PER_SECOND", "300")
        .args(["accrue", "--date", &day.to_string()]);
    let started = Instant::now();
    let out = output(cmd);
    let took = started.elapsed();
    let json = report(&out);
    assert_eq!(json["updated"], 600, "{json}");
    let charged: i64 = sqlx::query_scalar("select count(*) from fine_ledger where accrual_date = $1")
        .bind(day)
        .fetch_one(&pool)
        .await
        .expect("ledger");
    assert_eq!(charged, 600);
    assert!(
        took >= Duration::from_millis(1_800),
        "600 charges under 300/s took {took:?}"
    );
}

/// A logical walsender counts only when `throttle.standbys` names it: a CDC consumer that confirms rarely (here
/// `pg_recvlogical`, reporting every second but flushing, so confirming, only every 5 s) holds no batch by
/// default, and holds them once named.
#[tokio::test]
async fn a_logical_consumer_holds_batches_only_when_named() {
    let primary = Cluster::primary_with_libraryd().await;
    primary
        .connect()
        .await
        .execute("alter system set wal_level = 'logical'")
        .await
        .expect("wal_level");
    primary.stop_fast().await;
    primary.start().await;
    let url = primary.url("libraryd");
    migrate(&url);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .expect("connect to the primary");
    october(&pool, 6_000).await;
    slow_down(&pool, "update on loans", 0.0005).await;
    for sql in [
        "create publication cdc for all tables",
        "select pg_create_logical_replication_slot('cdc', 'pgoutput')",
    ] {
        sqlx::query(sql)
            .execute(&pool)
            .await
            .expect("publication and slot");
    }
    // Status every second, but fsync (and so confirm) only every 5 s: its confirmed position stands still for
    // seconds at a time while it reports.
    let out_dir = tempfile::tempdir().expect("temp dir");
    let out_file = out_dir.path().join("changes");
    let consumer = spawn(
        std::process::Command::new(crate::helpers::program("pg_recvlogical"))
            .args(["-d", &url, "-S", "cdc", "--start", "-s", "1", "-F", "5", "-f"])
            .arg(&out_file)
            .args(["-o", "proto_version=1", "-o", "publication_names=cdc"])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    wait_until("the consumer streams", Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, i64>("select count(*) from pg_stat_replication where reply_time is not null")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
            == 1
    })
    .await;
    let settle = |standbys: Option<&str>, month_end: &str| {
        let mut cmd = fine_settler(&url);
        cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "200")
            .env("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "1s")
            .args(["settle", "--business-date", month_end])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(names) = standbys {
            cmd.env("FINE_SETTLER__THROTTLE__STANDBYS", names);
        }
        cmd
    };
    // Not named: the consumer holds nothing; October (about 3 s of work) settles straight through.
    let child = spawn(&mut settle(None, "2026-10-31"));
    let (code, stderr) = crate::helpers::exit_of(child, Duration::from_secs(60)).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("throttled"), "{stderr}");
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    // Named: its confirmed position stands still for seconds while it reports, so it holds November's batches.
    let november: Vec<_> = (10_001..=16_000)
        .map(|id| loan(id, "2026-11-01", Some("2026-11-06")))
        .collect();
    insert(&pool, &november).await;
    let mut child = spawn(&mut settle(Some("pg_recvlogical"), "2026-11-30"));
    let log = StderrLog::collect(&mut child);
    wait_until(
        "the named consumer holds the run",
        Duration::from_secs(30),
        || async { log.contains("throttled: a standby lags") },
    )
    .await;
    let (code, _) = crate::helpers::stop(child).await;
    assert_eq!(code, Some(1), "SIGTERM hands the key back: {}", log.finish());
    drop(consumer);
    pool.close().await;
}
