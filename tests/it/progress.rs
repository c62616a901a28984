//! Progress bars: drawn on stderr when it is a terminal (run under a pseudo-terminal with util-linux `script`),
//! never otherwise — then stderr is JSON log lines only and stdout the report lines only.

use std::process::{Command, Stdio};

use serde_json::Value;
use sqlx::PgPool;

use crate::helpers::{database_url, fine_settler, insert, loan, output, slow_down};

const MONTH_END: &str = "2026-10-31";

/// `n` loans overdue in October, each with a fine to settle at its end.
async fn overdue_loans(pool: &PgPool, n: i64) {
    let loans: Vec<_> = (1..=n)
        .map(|id| loan(id, "2026-10-01", Some("2026-10-20")))
        .collect();
    insert(pool, &loans).await;
}

/// The text with ANSI escape sequences (CSI `ESC [ ... letter`) removed, and carriage returns as line ends.
fn plain(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                if chars.peek() == Some(&'[') {
                    chars.next();
                    for c in chars.by_ref() {
                        if c.is_ascii_alphabetic() {
                            break;
                        }
                    }
                }
            }
            '\r' => out.push('\n'),
            c => out.push(c),
        }
    }
    out
}

/// Runs `fine-settler ARGS` with `env` and stderr a pseudo-terminal (util-linux `script`), stdout a file:
/// (`script`'s output, which is everything drawn on the terminal; the file's contents).
fn under_terminal(url: &str, args: &str, env: &[(&str, &str)]) -> (std::process::Output, String) {
    if Command::new("script").arg("--version").output().is_err() {
        panic!("util-linux `script` is needed to run a command under a pseudo-terminal");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let stdout_file = dir.path().join("stdout");
    // The same environment as every other run of the binary.
    let base = fine_settler(url);
    let mut cmd = Command::new("script");
    for (k, v) in base.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let bin = env!("CARGO_BIN_EXE_fine-settler");
    cmd.args([
        "-qfec",
        &format!("'{bin}' {args} > '{}'", stdout_file.display()),
        "/dev/null",
    ])
    .stdin(Stdio::null());
    let out = output(cmd);
    let stdout = std::fs::read_to_string(&stdout_file).expect("stdout file");
    (out, stdout)
}

#[sqlx::test(fixtures("default_policy"))]
async fn settle_on_a_terminal_draws_rows_done_of_rows_to_do_and_keeps_stdout_the_report(pool: PgPool) {
    overdue_loans(&pool, 3000).await;
    // 3000 rows at 1 ms each in batches of 100: the run takes some seconds, so the bar is drawn mid-run.
    slow_down(&pool, "update on loans", 0.001).await;
    let (out, stdout) = under_terminal(
        &database_url(&pool),
        &format!("settle --business-date {MONTH_END}"),
        &[("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "100")],
    );
    let terminal = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "terminal output: {terminal}");

    let drawn = plain(&terminal);
    let positions: Vec<u64> = drawn
        .lines()
        .filter_map(|l| {
            let (done, rest) = l.split_once("/3000 rows")?;
            assert!(rest.contains("/s"), "the bar shows a rate: {l:?}");
            done.rsplit(' ').next()?.parse().ok()
        })
        .collect();
    assert!(
        positions.iter().any(|&p| p > 0 && p < 3000),
        "a bar mid-run, rows done of 3000 to do: {positions:?} in {drawn}"
    );
    assert_eq!(positions.last(), Some(&3000), "the bar ends full: {drawn}");
    // Log lines still reach the terminal, each whole on its own line: not written into the bar's line.
    let logs: Vec<&str> = drawn.lines().filter(|l| l.contains("\"level\"")).collect();
    assert!(!logs.is_empty(), "log lines still reach the terminal: {drawn}");
    for line in logs {
        let v: Result<Value, _> = serde_json::from_str(line.trim_end());
        assert!(v.is_ok(), "a log line garbled by the bar: {line:?}");
    }

    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "stdout is the report line only: {stdout:?}");
    let report: Value = serde_json::from_str(lines[0]).expect("the report is JSON");
    assert_eq!(report["outcome"], "settled", "{report}");
    assert_eq!(report["updated"], 3000, "{report}");
}

#[sqlx::test(fixtures("default_policy"))]
async fn migrate_on_a_terminal_draws_the_concurrent_index_build(pool: PgPool) {
    overdue_loans(&pool, 2000).await;
    // The index is to be built again: gone, and its migration forgotten.
    sqlx::raw_sql(
        "drop index loans_unsettled_returned_idx;
         delete from _sqlx_migrations where description = 'loans unsettled index';",
    )
    .execute(&pool)
    .await
    .expect("forget the index");
    // A writer in an open transaction: the concurrent build waits for it, in its first phase, until it ends.
    let mut writer = pool.begin().await.expect("begin");
    sqlx::query("insert into loans values (999999, 1, 1, '2026-09-01', '2026-10-01', '2026-10-20', 0, null)")
        .execute(&mut *writer)
        .await
        .expect("insert");
    let url = database_url(&pool);
    let run = tokio::task::spawn_blocking(move || under_terminal(&url, "migrate", &[]));
    crate::helpers::wait_until(
        "the build waits for the writer",
        std::time::Duration::from_secs(20),
        || {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>("select count(*) from pg_stat_progress_create_index")
                    .fetch_one(&pool)
                    .await
                    .expect("progress")
                    > 0
            }
        },
    )
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    writer.rollback().await.expect("rollback");
    let (out, stdout) = run.await.expect("join");
    let terminal = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(0), "terminal output: {terminal}");
    let drawn = plain(&terminal);
    assert!(
        drawn.contains("index loans_unsettled_returned_idx (waiting for writers before build)"),
        "a bar names the index and its phase: {drawn}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "stdout is the report line only: {stdout:?}");
    let report: Value = serde_json::from_str(lines[0]).expect("the report is JSON");
    assert_eq!(report["migrate"], "ok", "{report}");
}

/// Every line of stderr is a JSON object (no bar, no escape sequence, no carriage return), and every line of
/// stdout is one JSON report.
fn assert_plain_json(what: &str, out: &std::process::Output) -> Vec<Value> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains('\u{1b}') && !stderr.contains('\r'),
        "{what}: no escape sequences or carriage returns on stderr: {stderr:?}"
    );
    for line in stderr.lines() {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("{what}: stderr line {line:?} is not a JSON log line: {e}"));
        assert!(v.is_object() && v.get("level").is_some(), "{what}: {line:?}");
    }
    assert!(!stderr.contains("rows ("), "{what}: no bar on stderr: {stderr:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains('\u{1b}') && !stdout.contains('\r'),
        "{what}: {stdout:?}"
    );
    let reports: Vec<Value> = stdout
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("{what}: stdout line {l:?} is not JSON: {e}"))
        })
        .collect();
    assert!(!reports.is_empty(), "{what}: a report on stdout");
    reports
}

#[sqlx::test(fixtures("default_policy"))]
async fn without_a_terminal_stderr_is_json_logs_and_stdout_the_reports(pool: PgPool) {
    overdue_loans(&pool, 300).await;
    let url = database_url(&pool);
    let run = |args: &[&str]| {
        let mut cmd = fine_settler(&url);
        cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "50")
            .env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "50")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        output(cmd)
    };

    let out = run(&["migrate"]);
    let reports = assert_plain_json("migrate", &out);
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0]["migrate"], "ok");

    let out = run(&["settle", "--business-date", MONTH_END]);
    let reports = assert_plain_json("settle", &out);
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0]["updated"], 300, "{:?}", reports[0]);

    let out = run(&["accrue", "--date", "2026-10-15"]);
    let reports = assert_plain_json("accrue", &out);
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0]["outcome"], "settled", "{:?}", reports[0]);
    assert_eq!(reports[0]["updated"], 300, "{:?}", reports[0]);

    let out = run(&["pending", "retry"]);
    let reports = assert_plain_json("pending retry", &out);
    assert_eq!(reports.len(), 1);
    assert!(reports[0].get("charged").is_some(), "{:?}", reports[0]);

    let out = run(&[
        "backfill",
        "--job",
        "overdue-accrual",
        "--from",
        "2026-10-16",
        "--to",
        "2026-10-18",
    ]);
    let reports = assert_plain_json("backfill", &out);
    assert_eq!(reports.len(), 4, "three runs and a summary: {reports:?}");
    assert_eq!(reports[3]["summary"], true, "{reports:?}");
    assert_eq!(reports[3]["updated"], 900, "{reports:?}");
}
