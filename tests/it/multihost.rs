//! libpq's multi-host `database.url` against a real server: every command accepts it and works through its first
//! host (the one `connect_options()` names), `check-config` shows it redacted, a bad list is one line naming
//! the bad part, exit 2, nothing written, and ticks failing on a server that answers do not leave it.

use sqlx::PgPool;

use crate::helpers::{assert_success, database_url, fine_settler, free_port, insert, loan, output, report};

/// The test database's URL with a second host (nothing listens there) and the libpq parameters of the form.
fn multi_host(pool: &PgPool) -> String {
    let url = database_url(pool);
    let (before, db) = url.rsplit_once('/').expect("a database path");
    format!(
        "{before},127.0.0.1:{}/{db}?target_session_attrs=read-write&connect_timeout=3",
        free_port()
    )
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_multi_host_url_settles_through_its_first_host(pool: PgPool) {
    insert(&pool, &[loan(1, "2026-10-01", Some("2026-10-09"))]).await;
    let url = multi_host(&pool);

    let mut cmd = fine_settler(&url);
    cmd.args(["settle", "--business-date", "2026-10-31"]);
    let out = output(cmd);
    assert_success(&out);
    let report = report(&out);
    assert_eq!(
        (report["outcome"].as_str(), report["updated"].as_i64()),
        (Some("settled"), Some(1)),
        "{report}"
    );
    let fine: i64 = sqlx::query_scalar("select fine_cents from loans where id = 1")
        .fetch_one(&pool)
        .await
        .expect("the loan");
    assert_eq!(fine, 800);
}

#[sqlx::test(fixtures("default_policy"))]
async fn check_config_shows_a_multi_host_url_redacted(_pool: PgPool) {
    let url = "postgres://settler:hunter2@db1.example:5432,[2001:db8::2]:5433/libraryd?target_session_attrs=primary";
    let mut cmd = fine_settler(url);
    cmd.arg("check-config");
    let out = output(cmd);
    assert_success(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("hunter2"), "{text}");
    assert!(
        text.contains(
            "settler:***@db1.example:5432,[2001:db8::2]:5433/libraryd?target_session_attrs=primary"
        ),
        "{text}"
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_bad_host_list_is_one_line_exit_2_and_nothing_written(pool: PgPool) {
    insert(&pool, &[loan(1, "2026-10-01", Some("2026-10-09"))]).await;
    let good = database_url(&pool).replace("postgres@", "postgres:hunter2@");
    let (before, db) = good.rsplit_once('/').expect("a database path");
    let cases = [
        (format!("{before},,127.0.0.1:1/{db}"), "host 2 of 3 is empty"),
        (
            format!("{before},127.0.0.1:99999/{db}"),
            "port \"99999\" of host \"127.0.0.1\"",
        ),
        (
            format!("{before}/{db}?host=127.0.0.1,127.0.0.2&port=5432,5433,5434"),
            "3 ports for 2 hosts",
        ),
        (
            format!("{before},127.0.0.2/{db}?target_session_attrs=standby"),
            "target_session_attrs=standby is not supported",
        ),
        (
            format!("{before}/{db}?connect_timeout=3s"),
            "connect_timeout=\"3s\" is not a whole number of seconds",
        ),
    ];
    for (url, part) in cases {
        let mut cmd = fine_settler(&url);
        cmd.args(["settle", "--business-date", "2026-10-31"]);
        let out = output(cmd);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(out.status.code(), Some(2), "{url}: {stderr}");
        assert_eq!(lines.len(), 1, "{url}: {stderr}");
        assert!(
            lines[0].contains("database.url") && lines[0].contains(part),
            "{url}: {stderr}"
        );
        assert!(!stderr.contains("hunter2"), "{stderr}");
        assert!(out.stdout.is_empty(), "{url}");
    }
    let (runs, settled): (i64, i64) = sqlx::query_as(
        "select (select count(*) from job_runs), (select count(*) from loans where fine_settled_at is not null)",
    )
    .fetch_one(&pool)
    .await
    .expect("counts");
    assert_eq!((runs, settled), (0, 0));
}

/// The backend pids of the replica's connections.
async fn replica_backends(pool: &PgPool) -> std::collections::BTreeSet<i32> {
    // Of this test's database only: other tests' replicas run on the same server at the same time.
    sqlx::query_scalar(
        "select pid from pg_stat_activity
         where datname = current_database() and application_name like 'fine-settler run%'",
    )
    .fetch_all(pool)
    .await
    .expect("pg_stat_activity")
    .into_iter()
    .collect()
}

/// Ticks failing on a server that answers (here: a statement timeout on a locked `job_runs`) keep the replica on
/// that server and back off as with one host: the connections stay, no host is searched. They used to be handled
/// as an outage, dropping every connection and searching the hosts again about every second.
#[sqlx::test(fixtures("default_policy"))]
async fn ticks_failing_on_a_server_that_answers_keep_its_connections_and_back_off(pool: PgPool) {
    let url = multi_host(&pool);
    let port = free_port();
    let mut replica = crate::helpers::daemon(
        &url,
        0,
        1,
        &[("FINE_SETTLER__HTTP__LISTEN", &format!("127.0.0.1:{port}"))],
    );
    let log = crate::helpers::StderrLog::collect(&mut replica);
    crate::helpers::wait_until("ready", std::time::Duration::from_secs(20), || async {
        crate::daemon::http_get(port, "/readyz").await.0 == 200
    })
    .await;
    let mut lock = pool.begin().await.expect("begin");
    sqlx::query("lock table job_runs in access exclusive mode")
        .execute(&mut *lock)
        .await
        .expect("lock");
    crate::helpers::wait_until("a failed tick", std::time::Duration::from_secs(20), || async {
        log.contains("tick failed on a server that answers")
    })
    .await;
    let before = replica_backends(&pool).await;
    // Four attempts more: 1 s statement timeouts with 500 ms, 1 s, 2 s and 4 s of backoff between.
    tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    let after = replica_backends(&pool).await;
    lock.rollback().await.expect("unlock");
    assert!(!before.is_empty(), "no connection of the replica's seen");
    assert_eq!(
        before, after,
        "the replica dropped its connections to a server that answers"
    );
    assert_eq!(crate::helpers::stop(replica).await.0, Some(0));
    drop(log);
}
