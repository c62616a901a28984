//! The replica as a process: catch-up across months with three shards, graceful and hard shutdown, surviving a
//! PostgreSQL restart, and what an idle tick costs.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use fine_settler::{calendar, demo};
use sqlx::{postgres::PgPoolOptions, PgPool};

use crate::{
    helpers::{
        assert_success, d, daemon, database_url, due_now, exit_of, fine_settler, free_port, insert,
        install_update_audit, loan, max_updates_per_loan, migrate, oracle, output, seed_run, settled, signal,
        slow_down, stop, wait_until, PgBouncer, PoolMode, Running, StderrLog, Via,
    },
    server::PrivateServer,
};

/// Demo loans around each month, with disjoint ids.
async fn load_months(pool: &PgPool, months: &[NaiveDate], per_month: u64) {
    for (i, month) in months.iter().enumerate() {
        let spec = demo::DemoSpec {
            loans: per_month,
            seed: 11 + i as u64,
            month: *month,
            first_id: 1 + i as i64 * 100_000,
        };
        insert(pool, &demo::loans(spec).collect::<Vec<_>>()).await;
    }
}

async fn success_keys(pool: &PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from job_runs where status = 'SUCCESS'")
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

async fn assert_every_month_settled_once(pool: &PgPool, months: &[NaiveDate]) {
    for m in months {
        let m = m.to_string();
        assert_eq!(settled(pool, &m).await, oracle(pool, &m).await, "month {m}");
    }
    assert_eq!(max_updates_per_loan(pool).await, 1, "no loan was updated twice");
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn three_replicas_settle_every_missed_month_and_stop_cleanly(pool: PgPool) {
    three_replicas_catch_up(&pool, &Via::direct(&pool)).await;
}
}

/// Three replicas reaching the database `via` settle the three missed months (every shard's key, every loan
/// once) and stop cleanly on SIGTERM.
pub(crate) async fn three_replicas_catch_up(pool: &PgPool, via: &Via) {
    let pool = pool.clone();
    install_update_audit(&pool).await;
    let months = due_now(&pool, 3).await;
    load_months(&pool, &months, 1500).await;
    let replicas: Vec<Running> = (0..3).map(|s| via.daemon(s, 3, &[])).collect();
    wait_until("all 3 x 3 keys SUCCESS", Duration::from_secs(60), || async {
        success_keys(&pool).await == 9
    })
    .await;
    for r in &replicas {
        signal(r, "TERM");
    }
    for r in replicas {
        let (code, stderr) = exit_of(r, Duration::from_secs(10)).await;
        assert_eq!(code, Some(0), "{stderr}");
    }
    let keys: Vec<(NaiveDate, i32, i32)> =
        sqlx::query_as("select business_date, shards, shard from job_runs order by 1, 3")
            .fetch_all(&pool)
            .await
            .expect("keys");
    let expected: Vec<(NaiveDate, i32, i32)> = months
        .iter()
        .flat_map(|m| (0..3).map(move |s| (*m, 3, s)))
        .collect();
    assert_eq!(keys, expected);
    assert_every_month_settled_once(&pool, &months).await;
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn sigterm_mid_run_hands_the_key_back_and_a_restarted_replica_finishes_it(pool: PgPool) {
    install_update_audit(&pool).await;
    let months = due_now(&pool, 1).await;
    let loans: Vec<_> = (1..=400)
        .map(|id| {
            let returned = months[0] - chrono::Duration::days(1);
            let due = returned - chrono::Duration::days(3);
            loan(id, &due.to_string(), Some(&returned.to_string()))
        })
        .collect();
    insert(&pool, &loans).await;
    slow_down(&pool, "update on loans", 0.004).await;
    let url = database_url(&pool);
    let extra = [
        ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
        ("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "10"),
    ];
    let replica = daemon(&url, 0, 1, &extra);
    wait_until("a few committed batches", Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, i64>("select coalesce(max(scanned), 0) from job_runs")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
            >= 30
    })
    .await;
    let (code, stderr) = stop(replica).await;
    assert_eq!(code, Some(0), "{stderr}");
    let (status, error, released): (String, Option<String>, bool) =
        sqlx::query_as("select status, last_error, lease_until <= now() from job_runs")
            .fetch_one(&pool)
            .await
            .expect("row");
    assert_eq!(status, "FAILED");
    assert!(error.unwrap_or_default().contains("shutdown"));
    assert!(released, "the lease ends at once so a peer need not wait");
    let scanned_before: i64 = sqlx::query_scalar("select scanned from job_runs")
        .fetch_one(&pool)
        .await
        .expect("row");
    assert!(scanned_before < 400, "stopped mid-run");

    sqlx::query("drop trigger slow_down on loans")
        .execute(&pool)
        .await
        .expect("drop trigger");
    let mut once = fine_settler(&url);
    once.env("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1")
        .args(["run", "--once"]);
    let out = output(once);
    assert_success(&out);
    let report = crate::helpers::report(&out);
    assert_eq!(
        (report["outcome"].as_str(), report["epoch"].as_i64()),
        (Some("settled"), Some(2))
    );
    assert_eq!(
        report["scanned"].as_i64(),
        Some(400 - scanned_before),
        "resumed from the cursor"
    );
    assert_every_month_settled_once(&pool, &months).await;
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_second_signal_exits_at_once(pool: PgPool) {
    let months = due_now(&pool, 1).await;
    let returned = (months[0] - chrono::Duration::days(1)).to_string();
    insert(
        &pool,
        &(1..=50)
            .map(|id| loan(id, "2020-01-01", Some(&returned)))
            .collect::<Vec<_>>(),
    )
    .await;
    // One batch takes about 4 s: long enough to signal twice while it is in flight.
    slow_down(&pool, "update on loans", 0.4).await;
    let url = database_url(&pool);
    let extra = [
        ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
        ("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "10"),
        ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "20s"),
        ("FINE_SETTLER__CLAIM__LEASE", "30s"),
    ];
    let mut replica = daemon(&url, 0, 1, &extra);
    let stderr = StderrLog::collect(&mut replica);
    wait_until("the first batch in flight", Duration::from_secs(30), || async {
        crate::helpers::sleeping(&pool, "fine-settler run%").await > 0
    })
    .await;
    let started = tokio::time::Instant::now();
    signal(&replica, "TERM");
    // A second signal sent before the first is handled could be merged with it.
    wait_until("the first signal handled", Duration::from_secs(2), || async {
        stderr.contains("shutdown requested")
    })
    .await;
    signal(&replica, "TERM");
    let (code, _) = exit_of(replica, Duration::from_secs(10)).await;
    let stderr = stderr.finish();
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "did not wait for the batch: {:?}",
        started.elapsed()
    );
    assert!(stderr.contains("second shutdown signal"), "{stderr}");
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn an_invalid_shard_exits_2_with_one_line(pool: PgPool) {
    let url = database_url(&pool);
    for extra in [
        &[
            ("FINE_SETTLER__INSTANCE__SHARD", "3"),
            ("FINE_SETTLER__INSTANCE__SHARDS", "3"),
        ][..],
        &[
            ("FINE_SETTLER__INSTANCE__SHARD_FROM", "pod-index"),
            ("POD_INDEX", "7"),
        ][..],
        &[
            ("FINE_SETTLER__INSTANCE__SHARD_FROM", "pod-name"),
            ("POD_NAME", "fine-settler"),
        ][..],
    ] {
        let mut cmd = fine_settler(&url);
        cmd.env_remove("POD_INDEX").env_remove("POD_NAME");
        for (k, v) in extra {
            cmd.env(k, v);
        }
        cmd.arg("run");
        let out = output(cmd);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{extra:?}: {stderr}");
        assert!(stderr.contains("instance.shard"), "{stderr}");
    }
    let runs: i64 = sqlx::query_scalar("select count(*) from job_runs")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(runs, 0);
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn the_shard_comes_from_the_statefulset_pod(pool: PgPool) {
    let months = due_now(&pool, 1).await;
    let url = database_url(&pool);
    let mut cmd = fine_settler(&url);
    cmd.env("FINE_SETTLER__INSTANCE__SHARDS", "3")
        .env("FINE_SETTLER__INSTANCE__SHARD_FROM", "pod-name")
        .env("POD_NAME", "fine-settler-2")
        .env("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1")
        .args(["run", "--once"]);
    let out = output(cmd);
    assert_success(&out);
    let key: (NaiveDate, i32, i32, String) =
        sqlx::query_as("select business_date, shards, shard, status from job_runs")
            .fetch_one(&pool)
            .await
            .expect("key");
    assert_eq!(key, (months[0], 3, 2, "SUCCESS".to_string()));
}
}

#[tokio::test]
async fn replicas_recover_from_a_postgres_restart_without_restarting_themselves() {
    replicas_recover_from_a_restart(None).await;
}

/// Three replicas (reaching a private server directly, or through a PgBouncer in `front` of it) settle three
/// months while the server restarts under them: every key SUCCESS, every loan settled once, each outage logged
/// once when it starts and once when it ends, and no replica restarted.
pub(crate) async fn replicas_recover_from_a_restart(front: Option<PoolMode>) {
    let server = PrivateServer::start(&[]);
    let url = server.migrated_database("libraryd").await;
    let bouncer = match front {
        Some(mode) => Some(PgBouncer::start_in_front_of(&server.url("postgres"), mode).await),
        None => None,
    };
    let via = match (&bouncer, front) {
        (Some(b), Some(PoolMode::Transaction)) => Via {
            url: b.url_for(&url),
            pooler: "transaction",
        },
        (Some(b), Some(PoolMode::Session)) => Via {
            url: b.url_for(&url),
            pooler: "session",
        },
        _ => Via {
            url: url.clone(),
            pooler: "none",
        },
    };
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .connect(&url)
        .await
        .expect("connect");
    install_update_audit(&pool).await;
    let months = due_now(&pool, 3).await;
    load_months(&pool, &months, 1500).await;
    // About 15 s of work in all: the restart lands while batches are in flight.
    slow_down(&pool, "update on loans", 0.005).await;
    pool.close().await;

    let replicas: Vec<Running> = (0..3).map(|s| via.daemon(s, 3, &[])).collect();
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .connect(&url)
        .await
        .expect("connect");
    wait_until("work in progress", Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, i64>("select coalesce(sum(scanned), 0)::bigint from job_runs")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
            > 300
    })
    .await;
    let before_restart = success_keys(&pool).await;
    pool.close().await;
    server.restart();
    // A replica notices the outage when a tick's first statement fails on its dead connection.

    let pool = PgPoolOptions::new()
        .max_connections(3)
        .connect(&url)
        .await
        .expect("reconnect");
    wait_until(
        "all 3 x 3 keys SUCCESS after the restart",
        Duration::from_secs(90),
        || async { success_keys(&pool).await == 9 },
    )
    .await;
    for r in &replicas {
        signal(r, "TERM");
    }
    let mut outages = 0;
    for r in replicas {
        let (code, stderr) = exit_of(r, Duration::from_secs(10)).await;
        assert_eq!(code, Some(0), "{stderr}");
        let down = stderr.matches("database unreachable").count();
        let up = stderr.matches("database reachable again").count();
        assert_eq!(
            down, up,
            "each outage logged once when it starts and once when it ends: {stderr}"
        );
        outages += down;
    }
    assert!(
        before_restart < 9,
        "the restart happened mid-run ({before_restart} keys were done)"
    );
    assert!(
        (1..=3 * 2).contains(&outages),
        "outages seen and logged once each, not per retry: {outages}"
    );
    assert_every_month_settled_once(&pool, &months).await;
}

/// The statements run since the last reset, but for a replica's start-up check that `fine_policies` has its first
/// version (once per process, not per tick).
async fn statements_since_reset(pool: &sqlx::PgPool) -> Vec<(String, i64)> {
    sqlx::query_as(
        "select query, calls from pg_stat_statements
         where query not like '%pg_stat_statements%' and query not like '%insert into fine_policies%'
           and dbid = (select oid from pg_database where datname = current_database())",
    )
    .fetch_all(pool)
    .await
    .expect("statements")
}

#[tokio::test]
async fn an_idle_tick_is_one_statement() {
    let server = PrivateServer::start(&["shared_preload_libraries=pg_stat_statements"]);
    let url = server.url("postgres");
    migrate(&url);
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("connect");
    sqlx::query("create extension pg_stat_statements")
        .execute(&pool)
        .await
        .expect("extension");
    let once = || {
        let mut cmd = fine_settler(&url);
        cmd.env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
            .args(["run", "--once"]);
        let out = output(cmd);
        assert_success(&out);
    };
    once(); // runs the (empty) catch-up windows: 3 month ends and 7 days, every key becomes SUCCESS
    assert_eq!(success_keys(&pool).await, 3 + 7);
    sqlx::query("select pg_stat_statements_reset()")
        .execute(&pool)
        .await
        .expect("reset");
    once(); // idle
    let statements = statements_since_reset(&pool).await;
    let calls: i64 = statements.iter().map(|(_, c)| c).sum();
    let recheck: i64 = statements
        .iter()
        .filter(|(q, _)| q.contains("fine_loan_changes"))
        .map(|(_, c)| c)
        .sum();
    assert_eq!(
        (calls, recheck),
        (2, 1),
        "an idle tick of both jobs runs one statement, and the accrual re-check (due at the first tick after a \
         start, then every accrual.recheck_every) one of its own: {statements:?}"
    );
    let mut settlement_only = fine_settler(&url);
    settlement_only.args(["run", "--once"]);
    sqlx::query("select pg_stat_statements_reset()")
        .execute(&pool)
        .await
        .expect("reset");
    assert_success(&output(settlement_only));
    let statements = statements_since_reset(&pool).await;
    let calls: i64 = statements.iter().map(|(_, c)| c).sum();
    assert_eq!(calls, 1, "an idle tick is one statement: {statements:?}");
}

crate::each_engine! {
/// One tick of a replica with accrual on retries the shard's due pending charge first, then runs the accrual
/// for each of the last seven days: the pending charge reaches the ledger before the tick claims its first key.
#[sqlx::test(fixtures("default_policy"))]
async fn a_tick_compensates_first_then_accrues_the_last_seven_days(pool: PgPool) {
    let now: DateTime<Utc> = sqlx::query_scalar("select now()")
        .fetch_one(&pool)
        .await
        .expect("now");
    let today = calendar::local_date(now, chrono_tz::Asia::Shanghai);
    let long_ago = (today - chrono::Duration::days(40)).to_string();
    insert(
        &pool,
        &(1..=20).map(|id| loan(id, &long_ago, None)).collect::<Vec<_>>(),
    )
    .await;
    // A charge that failed 20 days ago and is due for a retry.
    let old_day = today - chrono::Duration::days(20);
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (1, $1, 100, 1, 'lock timeout', now() - interval '1 second')",
    )
    .bind(old_day)
    .execute(&pool)
    .await
    .expect("pending");

    let url = database_url(&pool);
    let mut cmd = fine_settler(&url);
    cmd.env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
        .env("FINE_SETTLER__SETTLEMENT__ENABLED", "false")
        .args(["run", "--once"]);
    let out = output(cmd);
    assert_success(&out);
    let reports = String::from_utf8_lossy(&out.stdout).lines().count();
    assert_eq!(reports, 7, "one run per due day");

    let days = fine_settler::schedule::due::accrual_due(today, 7);
    let per_day: Vec<(NaiveDate, i64)> =
        sqlx::query_as("select accrual_date, count(*) from fine_ledger group by 1 order by 1")
            .fetch_all(&pool)
            .await
            .expect("ledger");
    let mut expected: Vec<(NaiveDate, i64)> = vec![(old_day, 1)];
    expected.extend(days.iter().map(|d| (*d, 20)));
    assert_eq!(per_day, expected);
    let pending: i64 = sqlx::query_scalar("select count(*) from fine_pending")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(pending, 0);
    let keys: i64 = sqlx::query_scalar(
        "select count(*) from job_runs where job_name = 'overdue-accrual' and status = 'SUCCESS'",
    )
    .fetch_one(&pool)
    .await
    .expect("keys");
    assert_eq!(keys, 7);

    // The order: the compensated charge was written before the first of the tick's claims.
    let (compensated_at, first_claim): (DateTime<Utc>, DateTime<Utc>) = sqlx::query_as(
        "select (select charged_at from fine_ledger where loan_id = 1 and accrual_date = $1),
                (select min(at) from job_run_attempts where job_name = 'overdue-accrual' and event = 'claimed')",
    )
    .bind(old_day)
    .fetch_one(&pool)
    .await
    .expect("order");
    assert!(
        compensated_at < first_claim,
        "the compensation pass did not run before the tick's runs: charged at {compensated_at}, \
         first claim at {first_claim}"
    );
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn plan_shows_what_a_tick_would_claim_and_writes_nothing(pool: PgPool) {
    let url = database_url(&pool);
    let plan = |at: &str| {
        let mut cmd = fine_settler(&url);
        cmd.env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
            .env("FINE_SETTLER__ACCRUAL__CATCH_UP_DAYS", "2")
            .args(["plan", "--at", at]);
        let out = output(cmd);
        assert_success(&out);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON line"))
            // The first line is the rules in force.
            .filter(|v| v.get("rules").is_none())
            .map(|v| {
                format!(
                    "{} {} {} {}",
                    v["job"].as_str().unwrap_or(""),
                    v["business_date"].as_str().unwrap_or(""),
                    v["status"].as_str().unwrap_or(""),
                    v["action"].as_str().unwrap_or("")
                )
            })
            .collect::<Vec<_>>()
    };
    // 00:30 on January 1st in Shanghai: December is due, and the last two days of it for accrual.
    let before = plan("2027-01-01T00:30:00+08:00");
    assert_eq!(
        before,
        vec![
            "fine-settlement 2026-10-31 none claim",
            "fine-settlement 2026-11-30 none claim",
            "fine-settlement 2026-12-31 none claim",
            "overdue-accrual 2026-12-30 none claim",
            "overdue-accrual 2026-12-31 none claim",
        ]
    );
    let runs: i64 = sqlx::query_scalar("select count(*) from job_runs")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(runs, 0, "plan writes nothing");

    let mut settle = fine_settler(&url);
    settle.args(["settle", "--business-date", "2026-11-30"]);
    assert_success(&output(settle));
    seed_run(
        &pool,
        "fine-settlement",
        d("2026-12-31"),
        "RUNNING",
        "crashed",
        1,
        "-1 minute",
    )
    .await;
    seed_run(
        &pool,
        "overdue-accrual",
        d("2026-12-30"),
        "FAILED",
        "someone",
        3,
        "0 s",
    )
    .await;
    let after = plan("2027-01-01T00:30:00+08:00");
    assert_eq!(
        after,
        vec![
            "fine-settlement 2026-10-31 none claim",
            "fine-settlement 2026-11-30 SUCCESS skip",
            "fine-settlement 2026-12-31 RUNNING takeover",
            "overdue-accrual 2026-12-30 FAILED takeover",
            "overdue-accrual 2026-12-31 none claim",
        ]
    );
    // A time long before today sees that time's keys too.
    seed_run(
        &pool,
        "fine-settlement",
        d("2019-12-31"),
        "SUCCESS",
        "someone",
        1,
        "0 s",
    )
    .await;
    assert_eq!(
        plan("2020-01-01T00:30:00+08:00")[2],
        "fine-settlement 2019-12-31 SUCCESS skip"
    );
}
}

/// GET `path` from a local listener; (status, body). Retries while the listener is not up yet.
pub(crate) async fn http_get(port: u16, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        if let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = write!(stream, "GET {path} HTTP/1.1\r\nhost: localhost\r\n\r\n");
            let mut response = String::new();
            let _ = stream.read_to_string(&mut response);
            let status = response
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let body = response
                .split_once("\r\n\r\n")
                .map(|(_, b)| b.to_string())
                .unwrap_or_default();
            return (status, body);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "nothing listens on {port}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn probes_and_metrics_are_served_by_a_running_replica(pool: PgPool) {
    let months = due_now(&pool, 1).await;
    load_months(&pool, &months, 500).await;
    let url = database_url(&pool);
    let port = free_port();
    let replica = daemon(
        &url,
        0,
        1,
        &[
            ("FINE_SETTLER__HTTP__LISTEN", &format!("127.0.0.1:{port}")),
            ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
        ],
    );
    wait_until("the month settled", Duration::from_secs(30), || async {
        success_keys(&pool).await == 1
    })
    .await;
    assert_eq!(http_get(port, "/healthz").await.0, 200);
    assert_eq!(http_get(port, "/readyz").await, (200, "ready\n".to_string()));
    assert_eq!(http_get(port, "/nope").await.0, 404);
    let (status, metrics) = http_get(port, "/metrics").await;
    assert_eq!(status, 200);
    for line in [
        "fine_settler_claims_total{job=\"fine-settlement\",shard=\"0/1\",result=\"won\"} 1",
        "fine_settler_runs_total{job=\"fine-settlement\",shard=\"0/1\",result=\"settled\"} 1",
        "fine_settler_pending{shard=\"0/1\"} 0",
        "fine_settler_due_unsettled{job=\"fine-settlement\",shard=\"0/1\"} 0",
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }
    let updated: f64 = metrics
        .lines()
        .find(|l| l.starts_with("fine_settler_rows_updated_total{job=\"fine-settlement\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0);
    let expected: i64 = sqlx::query_scalar("select count(*) from loans where fine_settled_at is not null")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(updated as i64, expected);
    assert!(
        metrics
            .lines()
            .all(|l| !l.contains("business_date") && !l.contains("loan")),
        "no unbounded labels"
    );
    assert_eq!(stop(replica).await.0, Some(0));
}
}

#[sqlx::test(migrations = false)]
async fn readiness_fails_until_the_database_is_migrated(pool: PgPool) {
    let url = database_url(&pool);
    let port = free_port();
    let replica = daemon(
        &url,
        0,
        1,
        &[("FINE_SETTLER__HTTP__LISTEN", &format!("127.0.0.1:{port}"))],
    );
    let (status, body) = http_get(port, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    migrate(&url);
    wait_until("ready after migrate", Duration::from_secs(10), || async {
        http_get(port, "/readyz").await.0 == 200
    })
    .await;
    assert_eq!(
        http_get(port, "/healthz").await.0,
        200,
        "an outage is not a stall: the replica keeps retrying"
    );
    assert_eq!(stop(replica).await.0, Some(0));
}

/// A replica waiting at start (here for `migrate`) is ready when its work loop is, not when the database is: the
/// first `/readyz` that finds the database ready ends the loop's backoff (grown to 16 s here), says it is not
/// ready yet, and the loop's first tick makes it ready. It used to answer 200 at once while the loop slept out
/// the rest of its backoff, up to 30 s, without ticking.
#[sqlx::test(migrations = false)]
async fn readiness_at_start_waits_for_the_work_loop_not_only_for_the_database(pool: PgPool) {
    let url = database_url(&pool);
    let port = free_port();
    let mut replica = daemon(
        &url,
        0,
        1,
        &[("FINE_SETTLER__HTTP__LISTEN", &format!("127.0.0.1:{port}"))],
    );
    let log = StderrLog::collect(&mut replica);
    // Attempts at 0, 0.25, 0.75, 1.75, 3.75, 7.75 and 15.75 s; the next one would be at 31.75 s.
    tokio::time::sleep(Duration::from_secs(17)).await;
    migrate(&url);
    let migrated = std::time::Instant::now();
    wait_until("ready after migrate", Duration::from_secs(30), || async {
        tokio::time::sleep(Duration::from_millis(250)).await;
        http_get(port, "/readyz").await.0 == 200
    })
    .await;
    let took = migrated.elapsed();
    assert!(
        log.contains("database ready"),
        "/readyz said ready {took:?} after migrate, before the work loop was"
    );
    assert!(took < Duration::from_secs(5), "ready only {took:?} after migrate");
    assert_eq!(stop(replica).await.0, Some(0));
    drop(log);
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_replica_whose_log_reader_went_away_still_stops_on_sigterm(pool: PgPool) {
    let url = database_url(&pool);
    let mut replica = daemon(&url, 0, 1, &[("FINE_SETTLER__LOG__LEVEL", "debug")]);
    // The log shipper reading stderr dies: every further log line fails to write.
    drop(replica.stderr.take());
    wait_until("a few ticks", Duration::from_secs(10), || async {
        success_keys(&pool).await >= 3
    })
    .await;
    let (code, _) = stop(replica).await;
    assert_eq!(code, Some(0));
}
}

crate::each_engine! {
/// A key held by an owner that died is taken over within the same pass once its lease runs out, not only at the
/// next tick: the older month is held (lease ending in 2 s) when the pass reaches it, the newer month takes 4 s,
/// then the pass comes back to the older one and takes it over.
#[sqlx::test(fixtures("default_policy"))]
async fn a_pass_comes_back_to_a_key_whose_lease_ran_out_meanwhile(pool: PgPool) {
    install_update_audit(&pool).await;
    let months = due_now(&pool, 2).await;
    let (older, newer) = (months[0], months[1]);
    let mut loans = Vec::new();
    for (i, month) in [older, newer].iter().enumerate() {
        for j in 0..10 {
            let returned = month.to_string();
            loans.push(loan(1 + (i * 10 + j) as i64, &returned, Some(&returned)));
        }
    }
    insert(&pool, &loans).await;
    // A claim of a dead owner, its lease running out in 2 s.
    seed_run(
        &pool,
        "fine-settlement",
        older,
        "RUNNING",
        "gone-host:1:00000000",
        1,
        "2 s",
    )
    .await;
    // Only the newer month's updates are slow: ten of them, 0.4 s each, in one batch.
    let function = format!(
        "create function slow_newer() returns trigger language plpgsql as $$
         begin if new.returned_on > date '{older}' then perform pg_sleep(0.4); end if; return new; end $$"
    );
    crate::helpers::ddl(
        &pool,
        &[
            &function,
            "create trigger slow_newer before update on loans for each row execute function slow_newer()",
        ],
    )
    .await;

    let mut cmd = fine_settler(&database_url(&pool));
    cmd.env("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "2")
        .env("FINE_SETTLER__CLAIM__LEASE", "30s")
        .env("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "10s")
        .args(["run", "--once"]);
    let out = output(cmd);
    assert_success(&out);
    let reports: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("report"))
        .collect();
    let seen: Vec<(String, String, Option<i64>)> = reports
        .iter()
        .map(|r| {
            (
                r["business_date"].as_str().unwrap_or("").to_string(),
                r["outcome"].as_str().unwrap_or("").to_string(),
                r["epoch"].as_i64(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            (older.to_string(), "skipped".to_string(), Some(1)),
            (newer.to_string(), "settled".to_string(), Some(1)),
            (older.to_string(), "settled".to_string(), Some(2)),
        ]
    );
    assert_every_month_settled_once(&pool, &[older, newer]).await;
}
}
