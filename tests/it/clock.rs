//! The host clock stepped under a running replica (libfaketime, whose offset file the test rewrites while the
//! process runs; scripts/test.sh installs it): back and ahead, by seconds and by hours, in every schedule mode,
//! the replica re-bases once per step, says so, counts it, and goes on ticking. And a host clock running ahead
//! or behind the database's never hides a late return: every date a tick computes comes from the database's
//! time.

use std::{path::PathBuf, process::Stdio, time::Duration};

use sqlx::PgPool;

use crate::{
    daemon::http_get,
    helpers::{
        assert_success, database_url, due_now, fine_settler, free_port, insert, loan, oracle, settled, spawn,
        stop, wait_until, Running,
    },
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

#[sqlx::test(fixtures("default_policy"))]
async fn fixed_rate_survives_clock_steps(pool: PgPool) {
    steps_are_survived(pool, &[("FINE_SETTLER__SCHEDULE__PERIOD", "1s")]).await;
}

#[sqlx::test(fixtures("default_policy"))]
async fn fixed_delay_survives_clock_steps(pool: PgPool) {
    let mode = [
        ("FINE_SETTLER__SCHEDULE__MODE", "fixed-delay"),
        ("FINE_SETTLER__SCHEDULE__PERIOD", "1s"),
    ];
    steps_are_survived(pool, &mode).await;
}

#[sqlx::test(fixtures("default_policy"))]
async fn cron_survives_clock_steps(pool: PgPool) {
    let mode = [
        ("FINE_SETTLER__SCHEDULE__MODE", "cron"),
        ("FINE_SETTLER__SCHEDULE__CRON", "* * * * * *"),
    ];
    steps_are_survived(pool, &mode).await;
}

/// `run --once` with the host clock shifted by `shift` (libfaketime's `-f` syntax, e.g. `"+40d"`): its reports.
fn run_once_shifted(url: &str, shift: &str) -> Vec<serde_json::Value> {
    let mut cmd = fine_settler(url);
    cmd.env("LD_PRELOAD", libfaketime())
        .env("FAKETIME", shift)
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .args(["run", "--once"]);
    let out = cmd.output().expect("run --once");
    assert_success(&out);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a report is JSON"))
        .collect()
}

/// `plan` with the host clock shifted by `shift`: its key lines as (job, business date, action).
fn plan_shifted(url: &str, shift: &str) -> Vec<(String, String, String)> {
    let mut cmd = fine_settler(url);
    cmd.env("LD_PRELOAD", libfaketime())
        .env("FAKETIME", shift)
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .arg("plan");
    let out = cmd.output().expect("plan");
    assert_success(&out);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON"))
        .filter(|v| v.get("rules").is_none())
        .map(|v| {
            let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
            (s("job"), s("business_date"), s("action"))
        })
        .collect()
}

/// A return back-dated into the oldest settled month of the catch-up window is settled at the first tick, with
/// the host clock 40 days ahead of the database's and 40 days behind it; a return back-dated into a month that
/// left the window (by the database's date) re-opens nothing, however far behind the host clock is.
#[sqlx::test(fixtures("default_policy"))]
async fn a_host_clock_ahead_or_behind_never_hides_a_late_return(pool: PgPool) {
    let url = database_url(&pool);
    let months = due_now(&pool, 3).await;
    let (oldest, before_window) = (months[0], months[0] - chrono::Duration::days(40));
    let day =
        |month_end: chrono::NaiveDate, back: i64| (month_end - chrono::Duration::days(back)).to_string();
    for (i, m) in months.iter().enumerate() {
        insert(&pool, &[loan(10 + i as i64, &day(*m, 20), Some(&day(*m, 10)))]).await;
    }
    assert_eq!(run_once_shifted(&url, "+0").len(), 3, "the window settled");
    for (n, shift) in ["+40d", "-40d"].into_iter().enumerate() {
        let id = 100 + n as i64;
        insert(&pool, &[loan(id, &day(oldest, 20), Some(&day(oldest, 5)))]).await;
        insert(
            &pool,
            &[loan(
                id + 50,
                &day(before_window, 20),
                Some(&day(before_window, 5)),
            )],
        )
        .await;
        // `plan` asks its question with the database's time too: it shows the re-open the tick then does.
        let planned = plan_shifted(&url, shift);
        assert!(
            planned.contains(&(
                "fine-settlement".to_string(),
                oldest.to_string(),
                "reopen".to_string()
            )),
            "plan, host clock {shift}: {planned:?}"
        );
        let reports = run_once_shifted(&url, shift);
        let dates: Vec<&str> = reports
            .iter()
            .filter_map(|r| r["business_date"].as_str())
            .collect();
        assert_eq!(dates, [oldest.to_string()], "host clock {shift}: {reports:?}");
        assert_eq!(reports[0]["reopened"], true, "{reports:?}");
        assert_eq!(
            settled(&pool, &oldest.to_string()).await,
            oracle(&pool, &oldest.to_string()).await,
            "host clock {shift}"
        );
    }
}
