//! The host clock stepped under a running replica (libfaketime, whose offset file the test rewrites while the
//! process runs; scripts/test.sh installs it): back and ahead, by seconds and by hours, in every schedule mode,
//! the replica re-bases once per step, says so, counts it, and goes on ticking.

use std::{path::PathBuf, process::Stdio, time::Duration};

use sqlx::PgPool;

use crate::{
    daemon::http_get,
    helpers::{database_url, fine_settler, free_port, spawn, stop, wait_until, Running},
};

/// libfaketime's preload library, from Debian's libfaketime package.
fn libfaketime() -> PathBuf {
    let candidates = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|arch| arch.path().join("faketime/libfaketime.so.1"))
        .chain([PathBuf::from("/usr/lib/faketime/libfaketime.so.1")]);
    candidates
        .into_iter()
        .find(|p| p.exists())
        .expect("libfaketime (Debian's libfaketime package) is needed; scripts/test.sh installs it")
}

/// A replica whose host clock is the real one shifted by the offset in `offset_file` (seconds, read at every
/// reading of the clock), with `/metrics` on `port`; the monotonic clock is left alone, as a real step leaves it.
fn replica_on_a_shifted_clock(
    url: &str,
    offset_file: &std::path::Path,
    port: u16,
    mode: &[(&str, &str)],
) -> Running {
    let mut cmd = fine_settler(url);
    cmd.env("LD_PRELOAD", libfaketime())
        .env("FAKETIME_TIMESTAMP_FILE", offset_file)
        .env("FAKETIME_NO_CACHE", "1")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .env("FINE_SETTLER__HTTP__LISTEN", format!("127.0.0.1:{port}"))
        .env("FINE_SETTLER__CLAIM__LEASE", "3s");
    for (k, v) in mode {
        cmd.env(k, v);
    }
    cmd.arg("run").stdout(Stdio::null()).stderr(Stdio::piped());
    spawn(&mut cmd)
}

fn metric(body: &str, series: &str) -> f64 {
    body.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0)
}

async fn ticks(port: u16) -> f64 {
    metric(&http_get(port, "/metrics").await.1, "fine_settler_ticks_total{")
}

/// Steps of -30 s, -1 h, +1 h and +20 s (a period is 1 s): after each, two more ticks within 5 s — without
/// re-basing, the first two would silence the replica for 30 s and an hour.
async fn steps_are_survived(pool: PgPool, mode: &[(&str, &str)]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let offset = dir.path().join("offset");
    std::fs::write(&offset, "+0").expect("offset file");
    let port = free_port();
    let replica = replica_on_a_shifted_clock(&database_url(&pool), &offset, port, mode);
    wait_until("the first ticks", Duration::from_secs(20), || async {
        ticks(port).await >= 2.0
    })
    .await;
    let steps = [
        ("-30", "30 s back"),
        ("-3630", "an hour back"),
        ("-30", "an hour ahead"),
        ("-10", "20 s ahead"),
    ];
    for (n, (total, what)) in steps.into_iter().enumerate() {
        let before = ticks(port).await;
        std::fs::write(&offset, total).expect("step the clock");
        wait_until(
            &format!("two ticks after a step {what} ({mode:?})"),
            Duration::from_secs(5),
            || async { ticks(port).await >= before + 2.0 },
        )
        .await;
        let body = http_get(port, "/metrics").await.1;
        assert_eq!(
            metric(&body, "fine_settler_clock_steps_total{"),
            n as f64 + 1.0,
            "each step counted once ({what}, {mode:?})"
        );
        // The progress the probes report moved with the clock: never ahead of it.
        let (status, health) = http_get(port, "/healthz").await;
        assert_eq!(status, 200, "{health}");
        let age: u64 = health
            .trim()
            .strip_prefix("ok: last progress ")
            .and_then(|r| r.strip_suffix(" ms ago"))
            .and_then(|ms| ms.parse().ok())
            .unwrap_or_else(|| panic!("{health}"));
        assert!(age < 5_000, "{what}: {health}");
        let last = metric(&body, "fine_settler_last_progress_timestamp_seconds{");
        let host_now = chrono::Utc::now().timestamp() as f64 + total.parse::<f64>().expect("offset");
        assert!(
            (host_now - last).abs() < 5.0,
            "{what}: last progress {last} against the replica's clock {host_now}"
        );
    }
    let (code, stderr) = stop(replica).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        stderr.matches("the host clock stepped").count(),
        4,
        "each step logged once: {stderr}"
    );
}

#[sqlx::test]
async fn fixed_rate_survives_clock_steps(pool: PgPool) {
    steps_are_survived(pool, &[("FINE_SETTLER__SCHEDULE__PERIOD", "1s")]).await;
}

#[sqlx::test]
async fn fixed_delay_survives_clock_steps(pool: PgPool) {
    let mode = [
        ("FINE_SETTLER__SCHEDULE__MODE", "fixed-delay"),
        ("FINE_SETTLER__SCHEDULE__PERIOD", "1s"),
    ];
    steps_are_survived(pool, &mode).await;
}

#[sqlx::test]
async fn cron_survives_clock_steps(pool: PgPool) {
    let mode = [
        ("FINE_SETTLER__SCHEDULE__MODE", "cron"),
        ("FINE_SETTLER__SCHEDULE__CRON", "* * * * * *"),
    ];
    steps_are_survived(pool, &mode).await;
}
