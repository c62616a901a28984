//! A server whose TLS certificate rustls cannot read — a self-signed X.509 version 1 certificate, as Citus
//! generates for every node it sets up — is connected to as `psql` would: under `sslmode=prefer` (the default)
//! without TLS, said once; under `require` and stricter never, with one line saying why.

use std::{os::unix::fs::MetadataExt, path::Path, process::Command};

use sqlx::{postgres::PgPoolOptions, Connection, Executor, PgConnection};

use crate::helpers::{fine_settler, migrate, output, report, settled, Cluster, Running, StderrLog};
use crate::throttle::october;

/// The warning of a host connected to without TLS under `sslmode=prefer`.
const WARNING: &str = "sslmode=prefer: the TLS handshake with the server failed";

/// Runs `program` with `args` in `dir`, failing the test unless it succeeds; its stdout.
fn run(dir: &Path, program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A fresh server with a `libraryd` database and TLS on, its certificate a self-signed X.509 version 1 one.
async fn a_server_with_a_version_1_certificate() -> Cluster {
    let server = Cluster::primary_with_libraryd().await;
    turn_tls_on_with_a_version_1_certificate(&server).await;
    server
}

/// Gives `server` a self-signed X.509 version 1 certificate (made with `openssl x509 -req -signkey`, which writes
/// version 1 when given no extensions), turns TLS on and restarts it.
async fn turn_tls_on_with_a_version_1_certificate(server: &Cluster) {
    let data = server.dir().join("data");
    run(
        &data,
        "openssl",
        &[
            "req",
            "-new",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
        ]
        .into_iter()
        .chain(["-subj", "/CN=127.0.0.1", "-out", "server.csr"])
        .collect::<Vec<_>>(),
    );
    run(
        &data,
        "openssl",
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-signkey",
            "server.key",
            "-days",
            "3650",
            "-out",
            "server.crt",
        ],
    );
    let text = run(
        &data,
        "openssl",
        &["x509", "-in", "server.crt", "-noout", "-text"],
    );
    assert!(text.contains("Version: 1 (0x0)"), "{text}");
    // The server's own files: its user's, the key readable by it alone.
    let owner = std::fs::metadata(&data).expect("data folder");
    for file in ["server.key", "server.crt"] {
        let path = data.join(file);
        std::os::unix::fs::chown(&path, Some(owner.uid()), Some(owner.gid())).expect("chown");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
    }
    server
        .connect()
        .await
        .execute("alter system set ssl = on")
        .await
        .expect("ssl on");
    server.stop_fast().await;
    server.start().await;
}

/// The server's URL for `libraryd`, with `query` appended.
fn url(server: &Cluster, query: &str) -> String {
    format!("{}{query}", server.url("libraryd"))
}

/// A pool on `server`'s `libraryd` without TLS (sqlx's own `prefer` refuses the certificate).
async fn without_tls(server: &Cluster) -> sqlx::PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .connect(&url(server, "?sslmode=disable"))
        .await
        .expect("connect without TLS")
}

/// A replica of `server`'s `libraryd` (the default `sslmode`) with its status page, once `/readyz` says ready:
/// the process, its log, the page's port.
async fn replica_with_a_status_page(server: &Cluster) -> (Running, StderrLog, u16) {
    let port = crate::helpers::free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut replica = crate::helpers::daemon(
        &server.url("libraryd"),
        0,
        1,
        &[("FINE_SETTLER__HTTP__LISTEN", &listen)],
    );
    let log = StderrLog::collect(&mut replica);
    crate::helpers::wait_until("ready", std::time::Duration::from_secs(30), || async {
        crate::daemon::http_get(port, "/readyz").await.0 == 200
    })
    .await;
    (replica, log, port)
}

/// `settle` of October through `url`.
fn settle(url: &str) -> std::process::Output {
    let mut cmd = fine_settler(url);
    cmd.args(["settle", "--business-date", "2026-10-31"]);
    output(cmd)
}

#[tokio::test]
async fn a_certificate_rustls_cannot_read_is_connected_to_without_tls_under_prefer_as_psql_does() {
    let server = a_server_with_a_version_1_certificate().await;
    let default = server.url("libraryd");
    // What the product works around: sqlx's own `prefer` fails the connection.
    let refused = PgConnection::connect(&default)
        .await
        .expect_err("rustls refuses the certificate");
    assert!(
        refused.to_string().contains("UnsupportedCertVersion"),
        "{refused}"
    );
    migrate(&default);
    // The server does speak TLS: libpq would use it.
    let pool = without_tls(&server).await;
    let ssl: String = sqlx::query_scalar("show ssl")
        .fetch_one(&pool)
        .await
        .expect("ssl");
    assert_eq!(ssl, "on");
    october(&pool, 100).await;

    let out = settle(&default);
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{log}");
    assert_eq!(report(&out)["updated"], 100, "{log}");
    assert_eq!(log.matches(WARNING).count(), 1, "said once: {log}");
    assert!(log.contains("UnsupportedCertVersion"), "{log}");
    assert_eq!(settled(&pool, "2026-10-31").await.0, 100);
    pool.close().await;
}

#[tokio::test]
async fn require_and_stricter_are_never_downgraded_and_say_why_in_one_line() {
    let server = a_server_with_a_version_1_certificate().await;
    migrate(&url(&server, "?sslmode=disable"));
    let pool = without_tls(&server).await;
    october(&pool, 10).await;
    for mode in ["require", "verify-ca", "verify-full"] {
        let out = settle(&url(&server, &format!("?sslmode={mode}")));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{mode}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{mode}: one line: {stderr}");
        assert!(
            stderr.contains("the server's TLS certificate is X.509 version 1"),
            "{mode}: {stderr}"
        );
        assert!(!stderr.contains(WARNING), "{mode}: never downgraded: {stderr}");
    }
    let runs: i64 = sqlx::query_scalar("select count(*) from job_runs")
        .fetch_one(&pool)
        .await
        .expect("job_runs");
    assert_eq!(runs, 0, "nothing written");
    assert_eq!(settled(&pool, "2026-10-31").await.0, 0);
    pool.close().await;
}

/// The daemon's pool opens no connection before its first tick: the tick that meets the failed handshake looks
/// for its server again, learns to connect without TLS, and the tick after works — `run --once` settles its month.
#[tokio::test]
async fn the_daemon_learns_it_too_and_settles_its_month() {
    let server = a_server_with_a_version_1_certificate().await;
    let plain = url(&server, "?sslmode=disable");
    migrate(&plain);
    let pool = without_tls(&server).await;
    let month = crate::helpers::due_now(&pool, 1).await[0];
    let day = |back: i64| (month - chrono::Duration::days(back)).to_string();
    crate::helpers::insert(&pool, &[crate::helpers::loan(1, &day(20), Some(&day(10)))]).await;
    let mut once = fine_settler(&server.url("libraryd"));
    once.env("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1")
        .args(["run", "--once"]);
    let out = output(once);
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{log}");
    assert_eq!(log.matches(WARNING).count(), 1, "said once: {log}");
    let fine: Option<i64> = sqlx::query_scalar("select fine_cents from loans where id = 1")
        .fetch_one(&pool)
        .await
        .expect("fine");
    assert_eq!(fine, Some(1000), "ten days at 100 cents");
    pool.close().await;
}

/// A running replica on such a server: ready, its status page answers (its pool is its own and learns for
/// itself), and the warning is said once in the whole process.
#[tokio::test]
async fn a_running_replica_is_ready_and_its_status_page_answers() {
    let server = a_server_with_a_version_1_certificate().await;
    migrate(&url(&server, "?sslmode=disable"));
    let (replica, log, port) = replica_with_a_status_page(&server).await;
    for page in ["/status.json", "/status"] {
        let (code, body) = crate::daemon::http_get(port, page).await;
        assert_eq!(code, 200, "{page}: {body}");
    }
    crate::helpers::stop(replica).await;
    let log = log.finish();
    assert_eq!(log.matches(WARNING).count(), 1, "said once: {log}");
    assert!(!log.contains("not ready"), "ready at the first try: {log}");
}

/// A replica that started against a server without TLS follows it when the server is restarted with TLS on and
/// such a certificate (a failover behind the same address, a changed configuration): after the connection error
/// it asks again, and connects without TLS. (It used to keep trying TLS until restarted.)
#[tokio::test]
async fn a_replica_follows_its_server_when_tls_is_turned_on_with_such_a_certificate() {
    let server = Cluster::primary_with_libraryd().await;
    migrate(&server.url("libraryd"));
    let (replica, log, port) = replica_with_a_status_page(&server).await;
    turn_tls_on_with_a_version_1_certificate(&server).await;
    crate::helpers::wait_until(
        "the warning of a connection without TLS",
        std::time::Duration::from_secs(60),
        || async { log.contains(WARNING) },
    )
    .await;
    crate::helpers::wait_until("ready again", std::time::Duration::from_secs(30), || async {
        crate::daemon::http_get(port, "/readyz").await.0 == 200
    })
    .await;
    let (code, body) = crate::daemon::http_get(port, "/status.json").await;
    assert_eq!(code, 200, "{body}");
    crate::helpers::stop(replica).await;
    log.finish();
}
