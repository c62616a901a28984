//! The PgBouncer harness is real: a per-test database is reached through it by name, each pool mode does what
//! PgBouncer's documentation says, and PgBouncer's default settings reject what sqlx sends at login unless told
//! otherwise — the behaviour the product has to live with behind a pooler (and a `PGOPTIONS` in the environment,
//! which the product refuses behind one).

use std::str::FromStr;

use sqlx::{
    postgres::{PgConnectOptions, PgConnection},
    Connection, PgPool, Row,
};

use crate::helpers::{assert_success, database_url, fine_settler, output, PgBouncer, PoolMode};

/// A sqlx login that PgBouncer's defaults admit: without the `extra_float_digits` sqlx sends by default (and
/// without `options`, which sqlx sends only when asked).
fn admitted(url: &str) -> PgConnectOptions {
    PgConnectOptions::from_str(url)
        .expect("bouncer URL")
        .extra_float_digits(None)
}

async fn connect(bouncer: &PgBouncer, options: &PgConnectOptions) -> PgConnection {
    PgConnection::connect_with(options)
        .await
        .unwrap_or_else(|e| panic!("connect through pgbouncer: {e}\n{}", bouncer.log()))
}

/// `select pg_backend_pid()` as a simple query (no prepared statement: safe in transaction mode).
async fn backend_pid(conn: &mut PgConnection) -> i32 {
    sqlx::raw_sql("select pg_backend_pid()")
        .fetch_one(conn)
        .await
        .expect("pg_backend_pid")
        .get(0)
}

/// `set statement_timeout = …` as a simple query, outside a transaction.
async fn set_statement_timeout(conn: &mut PgConnection, value: &str) {
    sqlx::raw_sql(&format!("set statement_timeout = '{value}'"))
        .execute(conn)
        .await
        .expect("set statement_timeout");
}

async fn statement_timeout(conn: &mut PgConnection) -> String {
    sqlx::raw_sql("show statement_timeout")
        .fetch_one(conn)
        .await
        .expect("show statement_timeout")
        .get(0)
}

#[sqlx::test(fixtures("default_policy"))]
async fn transaction_mode_reaches_the_per_test_database_by_name(pool: PgPool) {
    let bouncer = PgBouncer::start(PoolMode::Transaction).await;
    let url = bouncer.url_for(&database_url(&pool));
    assert!(
        url.starts_with(&format!("postgres://postgres@127.0.0.1:{}/", bouncer.port())),
        "{url}"
    );
    let mut conn = connect(&bouncer, &admitted(&url)).await;

    let row = sqlx::raw_sql("select current_database()::text, pg_backend_pid()")
        .fetch_one(&mut conn)
        .await
        .expect("simple query through pgbouncer");
    let (database, pid): (String, i32) = (row.get(0), row.get(1));
    let expected = pool
        .connect_options()
        .get_database()
        .expect("test db")
        .to_string();
    assert_eq!(database, expected);
    // The server itself sees that backend, connected to the test's database, and it is not this pool's.
    let server_side: Option<String> =
        sqlx::query_scalar("select datname::text from pg_stat_activity where pid = $1")
            .bind(pid)
            .fetch_optional(&pool)
            .await
            .expect("pg_stat_activity");
    assert_eq!(server_side, Some(expected));
}

#[sqlx::test(fixtures("default_policy"))]
async fn default_settings_reject_the_extra_float_digits_sqlx_sends(pool: PgPool) {
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let bouncer = PgBouncer::start(mode).await;
        let url = bouncer.url_for(&database_url(&pool));
        let err = PgConnection::connect(&url)
            .await
            .err()
            .unwrap_or_else(|| panic!("{mode:?}: a default sqlx login was admitted"));
        assert!(
            err.to_string()
                .contains("unsupported startup parameter: extra_float_digits"),
            "{mode:?}: {err}"
        );
        // The same login without it is admitted.
        connect(&bouncer, &admitted(&url)).await;
    }
}

#[sqlx::test(fixtures("default_policy"))]
async fn session_mode_keeps_a_clients_prepared_statements_and_settings_to_itself(pool: PgPool) {
    let bouncer = PgBouncer::start(PoolMode::Session).await;
    let options = admitted(&bouncer.url_for(&database_url(&pool)));
    let mut first = connect(&bouncer, &options).await;
    let mut second = connect(&bouncer, &options).await;

    // Each sets a session setting outside a transaction; in transaction mode both would land on the one server
    // connection, and the first would read the second's value.
    set_statement_timeout(&mut first, "1234ms").await;
    set_statement_timeout(&mut second, "4321ms").await;
    assert_eq!(statement_timeout(&mut first).await, "1234ms");
    assert_eq!(statement_timeout(&mut second).await, "4321ms");
    // sqlx prepares named statements and reuses them; a session keeps them on its server connection.
    for n in 1..=3_i64 {
        let next: i64 = sqlx::query_scalar("select $1::int8 + 1")
            .bind(n)
            .fetch_one(&mut first)
            .await
            .unwrap_or_else(|e| panic!("prepared statement, run {n}: {e}\n{}", bouncer.log()));
        assert_eq!(next, n + 1);
    }
}

#[sqlx::test(fixtures("default_policy"))]
async fn transaction_mode_shares_a_server_connection_and_session_mode_does_not(pool: PgPool) {
    // Two client connections open at once, each running one statement after the other. In transaction mode the
    // second finds the first client's server connection idle in the pool (no other was ever opened) and runs on
    // it, settings and all: a SET outside a transaction leaks to whichever client comes next. In session mode the
    // first client keeps its own, so the second gets another, with the server's defaults.
    for (mode, shared) in [(PoolMode::Transaction, true), (PoolMode::Session, false)] {
        let bouncer = PgBouncer::start(mode).await;
        let options = admitted(&bouncer.url_for(&database_url(&pool)));
        let mut first = connect(&bouncer, &options).await;
        let mut second = connect(&bouncer, &options).await;
        let a = backend_pid(&mut first).await;
        set_statement_timeout(&mut first, "1234ms").await;
        let b = backend_pid(&mut second).await;
        assert_eq!(a == b, shared, "{mode:?}: backends {a} and {b}");
        let seen = statement_timeout(&mut second).await;
        assert_eq!(
            seen == "1234ms",
            shared,
            "{mode:?}: the second client sees {seen}"
        );
    }
}

/// With `PGOPTIONS` in the environment (a shell that sets `-c statement_timeout=…`), sqlx would send it as the
/// startup parameter `options`, which PgBouncer refuses at every login. Behind a pooler in either mode a command
/// refuses at once instead: exit 2, one line naming `PGOPTIONS`, no connection, nothing written. Directly, the
/// variable is sqlx's to send, as libpq's users expect.
#[sqlx::test(fixtures("default_policy"))]
async fn pgoptions_behind_a_pooler_is_refused_in_one_line_naming_it(pool: PgPool) {
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let bouncer = PgBouncer::start(mode).await;
        let mut cmd = fine_settler(&bouncer.url_for(&database_url(&pool)));
        cmd.env("PGOPTIONS", "-c statement_timeout=5min")
            .env(
                "FINE_SETTLER__DATABASE__POOLER",
                match mode {
                    PoolMode::Transaction => "transaction",
                    PoolMode::Session => "session",
                },
            )
            .args(["settle", "--business-date", "2026-10-31"]);
        let out = output(cmd);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(out.status.code(), Some(2), "{mode:?}: {stderr}");
        assert_eq!(lines.len(), 1, "{mode:?}: {stderr}");
        assert!(
            lines[0].contains("database.pooler") && lines[0].contains("PGOPTIONS"),
            "{mode:?}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{mode:?}: no report");
        let log = bouncer.log();
        assert!(!log.contains("unsupported startup parameter"), "{mode:?}: {log}");
    }
    let runs: i64 = sqlx::query_scalar("select count(*) from job_runs")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(runs, 0, "nothing written");

    let mut direct = fine_settler(&database_url(&pool));
    direct
        .env("PGOPTIONS", "-c statement_timeout=5min")
        .args(["settle", "--business-date", "2026-10-31"]);
    let out = output(direct);
    assert_success(&out);
}
