//! The command line's contract: bad input gets one clear line naming the problem, exit 2, and nothing written.

use sqlx::PgPool;

use crate::helpers::{assert_success, d, database_url, fine_settler, migrate, output, report, seed_run};

async fn nothing_written(pool: &PgPool) {
    let runs: i64 = sqlx::query_scalar("select count(*) from job_runs")
        .fetch_one(pool)
        .await
        .expect("count");
    let settled: i64 = sqlx::query_scalar("select count(*) from loans where fine_settled_at is not null")
        .fetch_one(pool)
        .await
        .expect("count");
    assert_eq!((runs, settled), (0, 0));
}

async fn scan_index_is_valid(pool: &PgPool) -> bool {
    sqlx::query_scalar(
        "select i.indisvalid from pg_index i join pg_class c on c.oid = i.indexrelid
         where c.relname = 'loans_unsettled_returned_idx'",
    )
    .fetch_one(pool)
    .await
    .expect("the scan index exists")
}

fn stderr_lines(out: &std::process::Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect()
}

#[sqlx::test(fixtures("default_policy"))]
async fn each_invalid_setting_is_one_line_naming_its_key_and_exit_2(pool: PgPool) {
    sqlx::query("insert into loans values (1, 1, 1, '2026-09-01', '2026-10-01', '2026-10-09', 0, null)")
        .execute(&pool)
        .await
        .expect("loan");
    let url = database_url(&pool);
    let cases = [
        ("FINE_SETTLER__INSTANCE__SHARD", "3", "instance.shard"),
        ("FINE_SETTLER__INSTANCE__SHARD", "-1", "instance.shard"),
        ("FINE_SETTLER__INSTANCE__SHARDS", "0", "instance.shards"),
        ("FINE_SETTLER__TIME__ZONE", "Europe/Atlantis", "time.zone"),
        ("FINE_SETTLER__CLAIM__LEASE", "forever", "claim.lease"),
        ("FINE_SETTLER__CLAIM__LOCK_TIMEOUT", "1h", "claim.lock_timeout"),
        ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "-3s", "claim.batch_timeout"),
        (
            "FINE_SETTLER__FINE__DAILY_RATE_CENTS",
            "-100",
            "fine.daily_rate_cents",
        ),
        ("FINE_SETTLER__FINE__GRACE_DAYS", "-2", "fine.grace_days"),
        ("FINE_SETTLER__FINE__CAP_CENTS", "-1", "fine.cap_cents"),
        (
            "FINE_SETTLER__SETTLEMENT__BATCH_SIZE",
            "0",
            "settlement.batch_size",
        ),
        ("FINE_SETTLER__INSTANCE__NAME", "x", "name"),
    ];
    for (var, value, key) in cases {
        let mut cmd = fine_settler(&url);
        cmd.env(var, value)
            .args(["settle", "--business-date", "2026-10-31"]);
        let out = output(cmd);
        let lines = stderr_lines(&out);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {lines:?}");
        assert_eq!(lines.len(), 1, "{var}={value}: {lines:?}");
        assert!(lines[0].contains(key), "{var}={value}: {lines:?}");
        assert!(
            out.stdout.is_empty(),
            "{var}={value}: no report for a run that never started"
        );
    }
    nothing_written(&pool).await;
}

/// Setting only the lease is enough: the batch and lock timeouts follow it, and check-config shows them.
#[test]
fn a_short_lease_alone_is_accepted_and_check_config_shows_the_derived_timeouts() {
    let mut cmd = fine_settler("postgres://nobody@127.0.0.1:1/nothing");
    cmd.env("FINE_SETTLER__CLAIM__LEASE", "10s").arg("check-config");
    let out = output(cmd);
    assert_success(&out);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("lease = \"10s\"")
            && shown.contains("batch_timeout = \"2s 500ms\"")
            && shown.contains("lock_timeout = \"416ms\""),
        "{shown}"
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_bad_config_file_is_rejected_before_any_database_access(pool: PgPool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("shard.toml");
    std::fs::write(
        &file,
        "[instance]\nshard = 4\nshards = 4\n[claim]\nlease = \"1s\"\nbatch_timeout = \"30s\"\n",
    )
    .expect("write");
    // An unreachable URL: if validation did not come first, this would be a connection failure (exit 1).
    let mut cmd = fine_settler("postgres://nobody:hunter2@127.0.0.1:1/nothing");
    cmd.arg("--config")
        .arg(&file)
        .args(["settle", "--business-date", "2026-10-31"]);
    let out = output(cmd);
    let lines = stderr_lines(&out);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(lines.len(), 2, "both problems, one line each: {lines:?}");
    assert!(
        lines.iter().any(|l| l.contains("instance.shard")) && lines.iter().any(|l| l.contains("claim.lease"))
    );
    nothing_written(&pool).await;
}

#[sqlx::test(fixtures("default_policy"))]
async fn bad_arguments_exit_2_and_write_nothing(pool: PgPool) {
    let url = database_url(&pool);
    for args in [
        &["settle", "--business-date", "2026-10-30"][..],
        &["settle", "--business-date", "2026-02-30"][..],
        &["settle", "--business-date", "10000-01-31"][..],
        &[
            "settle",
            "--business-date",
            "2026-10-31",
            "--shard",
            "3",
            "--shards",
            "3",
        ][..],
        &[
            "settle",
            "--business-date",
            "2026-10-31",
            "--shard",
            "-1",
            "--shards",
            "3",
        ][..],
        &["settle"][..],
        &["verify", "--business-date", "2026-11-01"][..],
    ] {
        let mut cmd = fine_settler(&url);
        cmd.args(args);
        let out = output(cmd);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    nothing_written(&pool).await;
}

#[sqlx::test(fixtures("default_policy"))]
async fn an_unreachable_database_is_a_runtime_failure_with_a_report(_pool: PgPool) {
    let mut cmd = fine_settler("postgres://nobody:hunter2@127.0.0.1:1/nothing");
    cmd.env("FINE_SETTLER__DATABASE__CONNECT_TIMEOUT", "2s").args([
        "settle",
        "--business-date",
        "2026-10-31",
    ]);
    let out = output(cmd);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(report(&out)["outcome"], "failed");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("hunter2"), "the password leaked: {all}");
}

#[sqlx::test(fixtures("default_policy"))]
async fn check_config_prints_the_effective_values_with_the_password_redacted(_pool: PgPool) {
    let mut cmd = fine_settler("postgres://settler:hunter2@db.example:5432/libraryd?sslmode=require");
    cmd.env("FINE_SETTLER__INSTANCE__SHARDS", "3")
        .env("FINE_SETTLER__INSTANCE__SHARD", "2")
        .arg("check-config");
    let out = output(cmd);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("hunter2"), "{text}");
    assert!(
        text.contains("settler:***@db.example:5432/libraryd?sslmode=require"),
        "{text}"
    );
    let parsed: toml::Value = toml::from_str(&text).expect("valid TOML");
    assert_eq!(parsed["instance"]["shard"].as_integer(), Some(2));
}

#[sqlx::test(fixtures("default_policy"))]
async fn migrate_twice_is_a_no_op(pool: PgPool) {
    let url = database_url(&pool);
    for _ in 0..2 {
        migrate(&url);
    }
    assert!(scan_index_is_valid(&pool).await);
}

#[sqlx::test(migrations = false)]
async fn migrate_upgrades_an_existing_libraryd_database(pool: PgPool) {
    // libraryd's table as it was before fine-settler: no fine_settled_at, with data in it.
    sqlx::raw_sql(
        "create table loans (id bigint primary key, member_id bigint not null, book_id bigint not null,
                             borrowed_on date not null, due_on date not null, returned_on date,
                             fine_cents bigint not null default 0);
         insert into loans select g, 1, 1, date '2026-09-01', date '2026-09-15', date '2026-10-01'
         from generate_series(1, 1000) g;",
    )
    .execute(&pool)
    .await
    .expect("libraryd schema");
    let url = database_url(&pool);
    migrate(&url);
    let unsettled: i64 = sqlx::query_scalar("select count(*) from loans where fine_settled_at is null")
        .fetch_one(&pool)
        .await
        .expect("new column");
    assert_eq!(unsettled, 1000, "existing rows kept, new column null");

    let mut cmd = fine_settler(&url);
    cmd.args(["settle", "--business-date", "2026-10-31"]);
    let out = output(cmd);
    assert_eq!(report(&out)["updated"], 1000);
}

#[sqlx::test(migrations = false)]
async fn migrate_rebuilds_an_index_left_invalid_by_an_interrupted_build(pool: PgPool) {
    let url = database_url(&pool);
    migrate(&url);
    // Simulate a `create index concurrently` that died half-way.
    sqlx::query(
        "update pg_index set indisvalid = false
         where indexrelid = 'loans_unsettled_returned_idx'::regclass",
    )
    .execute(&pool)
    .await
    .expect("mark invalid");
    migrate(&url);
    assert!(scan_index_is_valid(&pool).await);
}

#[sqlx::test(fixtures("default_policy"))]
async fn accrue_refuses_a_day_that_is_not_over_and_pending_list_shows_the_queue(pool: PgPool) {
    let url = database_url(&pool);
    let today = fine_settler::calendar::local_date(chrono::Utc::now(), chrono_tz::Asia::Shanghai);
    for date in [today, today + chrono::Duration::days(3)] {
        let mut cmd = fine_settler(&url);
        cmd.args(["accrue", "--date", &date.to_string()]);
        let out = output(cmd);
        let lines = stderr_lines(&out);
        assert_eq!(out.status.code(), Some(2), "{lines:?}");
        assert!(lines.len() == 1 && lines[0].contains("--date"), "{lines:?}");
    }
    nothing_written(&pool).await;

    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at, status)
         values (42, '2026-10-10', 100, 10, 'charge rejected for loan 42', now(), 'DEAD')",
    )
    .execute(&pool)
    .await
    .expect("pending row");
    let mut cmd = fine_settler(&url);
    cmd.args(["pending", "list"]);
    let out = output(cmd);
    assert_eq!(out.status.code(), Some(0));
    let table = String::from_utf8_lossy(&out.stdout);
    let row = table
        .lines()
        .find(|l| l.contains("42"))
        .unwrap_or_else(|| panic!("{table}"));
    for field in ["2026-10-10", "100", "10", "DEAD", "charge rejected for loan 42"] {
        assert!(row.contains(field), "{field} missing from {row:?}");
    }
}

/// `settle` refuses a month that is not over yet, as `accrue` refuses such a day: this month (a loan returned in it
/// already) and the calendar's last month end, exit 2, one line naming `--business-date`, nothing written — no
/// SUCCESS key that would make the daemon skip the month once it is over.
#[sqlx::test(fixtures("default_policy"))]
async fn settle_refuses_a_month_that_is_not_over(pool: PgPool) {
    use chrono::Datelike;

    let url = database_url(&pool);
    let today = fine_settler::calendar::local_date(chrono::Utc::now(), chrono_tz::Asia::Shanghai);
    let this_month_end = fine_settler::calendar::previous_month_end(
        (today.with_day(1).expect("first") + chrono::Duration::days(32))
            .with_day(1)
            .expect("first of next month"),
    );
    sqlx::query("insert into loans values (1, 1, 1, $1, $1, $1, 0, null)")
        .bind(today.with_day(1).expect("first"))
        .execute(&pool)
        .await
        .expect("a loan returned this month");
    for date in [this_month_end, d("9999-12-31")] {
        let mut cmd = fine_settler(&url);
        cmd.args(["settle", "--business-date", &date.to_string()]);
        let out = output(cmd);
        let lines = stderr_lines(&out);
        assert_eq!(out.status.code(), Some(2), "{date}: {lines:?}");
        assert!(
            lines.len() == 1
                && lines[0].contains("--business-date")
                && lines[0].contains(&format!("{date} is not before today"))
                && lines[0].contains("a month is settled once it is over"),
            "{lines:?}"
        );
        assert!(out.stdout.is_empty(), "{date}: no report");
    }
    nothing_written(&pool).await;
}

#[sqlx::test(fixtures("default_policy"))]
async fn release_ends_a_stuck_claim_and_the_next_run_fences_the_old_owner(pool: PgPool) {
    sqlx::query("insert into loans values (1, 1, 1, '2026-09-01', '2026-10-01', '2026-10-04', 0, null)")
        .execute(&pool)
        .await
        .expect("loan");
    // A replica claimed the key and hung with an hour of lease left.
    seed_run(
        &pool,
        "fine-settlement",
        d("2026-10-31"),
        "RUNNING",
        "host-a:42:beef",
        4,
        "1 hour",
    )
    .await;
    let url = database_url(&pool);
    let release = || {
        let mut cmd = fine_settler(&url);
        cmd.args([
            "release",
            "--job",
            "fine-settlement",
            "--business-date",
            "2026-10-31",
            "--shards",
            "1",
            "--shard",
            "0",
            "--reason",
            "host-a is wedged",
            "--by",
            "oncall",
        ]);
        output(cmd)
    };
    let out = release();
    assert_success(&out);
    let r = report(&out);
    assert_eq!(
        (
            r["released"].as_bool(),
            r["previous_owner"].as_str(),
            r["epoch"].as_i64()
        ),
        (Some(true), Some("host-a:42:beef"), Some(4))
    );
    // Releasing again finds nothing running: harmless.
    assert_eq!(report(&release())["released"].as_bool(), Some(false));

    let mut settle = fine_settler(&url);
    settle.args(["settle", "--business-date", "2026-10-31"]);
    let settled = report(&output(settle));
    assert_eq!(
        (settled["outcome"].as_str(), settled["epoch"].as_i64()),
        (Some("settled"), Some(5))
    );

    let mut history = fine_settler(&url);
    history.args(["runs", "--history", "--json"]);
    let out = output(history);
    assert_success(&out);
    let events: Vec<(String, String, Option<String>)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON"))
        .map(|v| {
            (
                v["event"].as_str().unwrap_or("").to_string(),
                v["owner"].as_str().unwrap_or("").to_string(),
                v["error"].as_str().map(str::to_string),
            )
        })
        .collect();
    assert_eq!(
        events[0],
        (
            "released".into(),
            "oncall".into(),
            Some("host-a is wedged".into())
        )
    );
    assert_eq!(
        events.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
        vec!["released", "takeover", "success"]
    );

    let mut missing = fine_settler(&url);
    missing.args([
        "release",
        "--job",
        "overdue-accrual",
        "--business-date",
        "2026-10-30",
        "--shards",
        "1",
        "--shard",
        "0",
    ]);
    let out = output(missing);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(report(&out)["found"].as_bool(), Some(false));
    let mut bad = fine_settler(&url);
    bad.args([
        "release",
        "--job",
        "nope",
        "--business-date",
        "2026-10-30",
        "--shards",
        "1",
        "--shard",
        "0",
    ]);
    assert_eq!(output(bad).status.code(), Some(2));
}

#[sqlx::test(fixtures("default_policy"))]
async fn replicas_run_under_the_least_privilege_role(pool: PgPool) {
    let owner_url = database_url(&pool);
    let db = owner_url
        .rsplit_once('/')
        .map(|(_, db)| db.to_string())
        .expect("db");
    // Roles are cluster-wide: name this one after the test's database, short and lower case.
    let tail: String = db
        .to_lowercase()
        .chars()
        .rev()
        .take(24)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let role = format!("fs_{tail}");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/sql/least-privilege.sql");
    for _ in 0..2 {
        let out = std::process::Command::new("psql")
            .args([
                &owner_url,
                "-qX",
                "-v",
                &format!("role={role}"),
                "-v",
                "password=s3cret",
                "-f",
                script,
            ])
            .output()
            .expect("psql");
        assert_success(&out);
    }
    let (base, _) = owner_url.rsplit_once('/').expect("url");
    let (scheme, host) = base.split_once("://").expect("scheme");
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    let role_url = format!("{scheme}://{role}:s3cret@{host}/{db}");

    let today = fine_settler::calendar::local_date(chrono::Utc::now(), chrono_tz::Asia::Shanghai);
    let due = (today - chrono::Duration::days(40)).to_string();
    let returned = (today - chrono::Duration::days(2)).to_string();
    sqlx::query("insert into loans values (1, 1, 1, $1::date - 30, $1::date, null, 0, null), (2, 1, 1, $1::date - 30, $1::date, $2::date, 0, null)")
        .bind(&due)
        .bind(&returned)
        .execute(&pool)
        .await
        .expect("loans");

    // The daemon's whole tick (settlement and accrual, with a compensation pass), a forced settle, an accrual,
    // a release and the history, all as the restricted role.
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (1, $1::date, 100, 1, 'lock timeout', now() - interval '1 second')",
    )
    .bind(&due)
    .execute(&pool)
    .await
    .expect("pending");
    let mut tick = fine_settler(&role_url);
    tick.env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
        .args(["run", "--once"]);
    assert_success(&output(tick));
    for args in [
        &[
            "accrue",
            "--date",
            &(today - chrono::Duration::days(1)).to_string(),
            "--force",
        ][..],
        &["runs", "--history"][..],
        &["pending", "list"][..],
        &["pause", "--job", "overdue-accrual", "--by", "ops"][..],
        &["resume", "--job", "overdue-accrual", "--by", "ops"][..],
    ] {
        let mut cmd = fine_settler(&role_url);
        cmd.args(args);
        assert_success(&output(cmd));
    }
    let ledger: i64 = sqlx::query_scalar("select count(*) from fine_ledger")
        .fetch_one(&pool)
        .await
        .expect("ledger");
    assert!(
        ledger >= 8,
        "seven days for two loans plus the compensated charge: {ledger}"
    );

    // And nothing else: libraryd's other columns and rows are out of reach.
    let restricted = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&role_url)
        .await
        .expect("connect");
    for sql in [
        "update loans set member_id = 2 where id = 1",
        "delete from loans where id = 1",
        "delete from job_runs",
    ] {
        let err = sqlx::query(sql).execute(&restricted).await.expect_err(sql);
        assert!(err.to_string().contains("permission denied"), "{sql}: {err}");
    }
    restricted.close().await;
    sqlx::raw_sql(&format!(r#"drop owned by "{role}"; drop role "{role}";"#))
        .execute(&pool)
        .await
        .expect("cleanup");
}

/// Every `fine_settler_*` name in a file, as written (a histogram's series with their suffixes).
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("fine_settler_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        names.insert(name.to_string());
        rest = &tail[end..];
    }
    names
}

#[test]
fn alert_rules_and_the_dashboard_use_only_exported_metrics() {
    // Derived from the registry: every series a family of the binary can export.
    let exported = fine_settler::metrics::Metrics::new("0/1".into()).series_names();
    let root = env!("CARGO_MANIFEST_DIR");
    let rules =
        std::fs::read_to_string(format!("{root}/deploy/prometheus/fine-settler.rules.yml")).expect("rules");
    let dashboard =
        std::fs::read_to_string(format!("{root}/deploy/grafana/fine-settler.json")).expect("dashboard");
    let parsed: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    assert!(parsed["panels"].as_array().is_some_and(|p| !p.is_empty()));
    for (file, text) in [("rules", &rules), ("dashboard", &dashboard)] {
        let used = metric_names(text);
        assert!(used.len() >= 6, "{file} uses {used:?}");
        let unknown: Vec<_> = used.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{file} uses metrics the binary does not export: {unknown:?}"
        );
    }
    assert!(rules.matches("- alert:").count() >= 6);
    // The rules cover what an operator must hear about.
    for needed in [
        "fine_settler_due_unsettled",
        "fine_settler_pending_dead",
        "fine_settler_clock_skew_seconds",
        "fine_settler_last_progress_timestamp_seconds",
        "fine_settler_lease_lost_total",
    ] {
        assert!(metric_names(&rules).contains(needed), "no alert on {needed}");
    }
}

/// A replica role given its privileges before the pause tables existed keeps working after the upgrade: the
/// migration that follows them grants the pause tables to every role that may update `job_runs`.
#[sqlx::test(fixtures("default_policy"))]
async fn an_older_least_privilege_role_gets_the_pause_tables_from_the_migration(pool: PgPool) {
    let owner_url = database_url(&pool);
    let db = owner_url
        .rsplit_once('/')
        .map(|(_, db)| db.to_string())
        .expect("db");
    let tail: String = db.to_lowercase().chars().rev().take(24).collect::<String>();
    let role = format!("fo_{tail}");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/sql/least-privilege.sql");
    let psql = |args: &[&str]| {
        let out = std::process::Command::new("psql")
            .arg(&owner_url)
            .args(["-qX", "-v", "ON_ERROR_STOP=1"])
            .args(args)
            .output()
            .expect("psql");
        assert_success(&out);
    };
    psql(&[
        "-v",
        &format!("role={role}"),
        "-v",
        "password=s3cret",
        "-f",
        script,
    ]);
    // As the role was before the pause tables: no rights on them.
    psql(&[
        "-c",
        &format!("revoke all on job_pauses, job_pause_events from {role}"),
    ]);
    let (base, _) = owner_url.rsplit_once('/').expect("url");
    let (scheme, host) = base.split_once("://").expect("scheme");
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    let role_url = format!("{scheme}://{role}:s3cret@{host}/{db}");
    let tick = || {
        let mut tick = fine_settler(&role_url);
        tick.args(["run", "--once"]);
        output(tick)
    };
    let before = tick();
    assert_eq!(before.status.code(), Some(1), "{before:?}");
    assert!(
        String::from_utf8_lossy(&before.stderr).contains("job_pauses"),
        "{before:?}"
    );
    psql(&[
        "-f",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/migrations/20261201000011_job_pauses_grants.sql"
        ),
    ]);
    assert_success(&tick());
}
