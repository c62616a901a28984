//! `backfill` as an operator runs it, through the real binary: the catch-up after every replica was down for
//! months, its dry run (exactly the rows the run then touches, and nothing written), `--reprocess`, concurrency,
//! accrual with a pending charge, a live owner, and bad input.

use chrono::{Datelike, NaiveDate};
use fine_settler::store::loans::NewLoan;
use serde_json::Value;
use sqlx::PgPool;

use crate::helpers::{
    due_now, exit_of, fine_settler, install_update_audit, max_updates_per_loan, oracle, output, seed_run,
    settled, signal, slow_down, spawn, wait_until, Running, StderrLog,
};

/// `fine-settler backfill ARGS` with `env`; (exit code, stdout's JSON lines, stderr).
fn backfill(url: &str, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, Vec<Value>, String) {
    let mut cmd = fine_settler(url);
    cmd.arg("backfill").args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = output(cmd);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?} is not JSON: {e}")))
        .collect();
    (
        out.status.code(),
        lines,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Everything the backfill may write, as one fingerprint: loans, job_runs, the history, ledger, queue.
async fn fingerprint(pool: &PgPool) -> String {
    sqlx::query_scalar(
        r#"select md5(coalesce((select string_agg(format('%s', l), ',' order by id) from loans l), '')
                   || coalesce((select string_agg(format('%s', r), ',' order by business_date, shard)
                                from job_runs r), '')
                   || (select count(*) from job_run_attempts)::text
                   || coalesce((select string_agg(format('%s', f), ',' order by loan_id, accrual_date)
                                from fine_ledger f), '')
                   || coalesce((select string_agg(format('%s', p), ',' order by loan_id, accrual_date)
                                from fine_pending p), ''))"#,
    )
    .fetch_one(pool)
    .await
    .expect("fingerprint")
}

fn loan(id: i64, due_on: NaiveDate, returned_on: Option<NaiveDate>) -> NewLoan {
    NewLoan {
        id,
        member_id: 1,
        book_id: 1,
        borrowed_on: due_on - chrono::Duration::days(30),
        due_on,
        returned_on,
    }
}

fn s(d: NaiveDate) -> String {
    d.to_string()
}

/// `per_month` loans returned in each month of `months` (month ends), ids `1000 * i + j`, each returned 0-4 days
/// late.
async fn loans_in(pool: &PgPool, months: &[NaiveDate], per_month: i64) {
    let mut loans = Vec::new();
    for (i, end) in months.iter().enumerate() {
        let start = end.with_day(1).expect("first");
        for j in 1..=per_month {
            let due = start + chrono::Duration::days(2);
            let returned = due + chrono::Duration::days(j % 5);
            loans.push(loan(1000 * (i as i64 + 1) + j, due, Some(returned)));
        }
    }
    crate::helpers::insert(pool, &loans).await;
}

fn keys(lines: &[Value]) -> &[Value] {
    let (last, keys) = lines.split_last().expect("a summary line");
    assert_eq!(last["summary"], true, "{last}");
    keys
}

#[sqlx::test(fixtures("default_policy"))]
async fn after_a_three_month_outage_a_dry_run_then_backfill_settles_the_months_the_window_lost(pool: PgPool) {
    let url = crate::helpers::database_url(&pool);
    // m[0] settled before the outage, m[1..4] fell out of the window, m[4] the one-month window catches up.
    let m = due_now(&pool, 5).await;
    loans_in(&pool, &m, 7).await;
    install_update_audit(&pool).await;
    let mut settle = fine_settler(&url);
    settle.args(["settle", "--business-date", &s(m[0])]);
    crate::helpers::assert_success(&output(settle));
    let mut tick = fine_settler(&url);
    tick.env("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1")
        .args(["run", "--once"]);
    crate::helpers::assert_success(&output(tick));
    for month in &m[1..4] {
        assert_eq!(
            settled(&pool, &s(*month)).await.0,
            0,
            "{month} is not settled yet"
        );
    }

    let range = [
        "--job",
        "fine-settlement",
        "--from",
        &s(m[0].with_day(1).expect("first")),
        "--to",
        &s(m[4]),
    ];
    let before = fingerprint(&pool).await;
    let (code, dry, err) = backfill(&url, &[&range[..], &["--dry-run"]].concat(), &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(fingerprint(&pool).await, before, "a dry run writes nothing");
    let dry_keys = keys(&dry);
    assert_eq!(dry_keys.len(), 5);
    for (line, month) in dry_keys.iter().zip(&m) {
        assert_eq!(line["business_date"], s(*month), "oldest first: {line}");
        assert_eq!(
            (line["shards"].clone(), line["shard"].clone()),
            (1.into(), 0.into())
        );
        assert_eq!(line["job"], "fine-settlement");
    }
    for i in [0, 4] {
        assert_eq!(dry_keys[i]["status"], "SUCCESS");
        assert_eq!(
            (dry_keys[i]["action"].clone(), dry_keys[i]["rows"].clone()),
            ("skip".into(), 0.into())
        );
    }
    for line in &dry_keys[1..4] {
        assert_eq!(line["status"], Value::Null);
        assert_eq!(
            (line["action"].clone(), line["rows"].clone()),
            ("claim".into(), 7.into())
        );
    }
    assert_eq!(dry.last().expect("summary")["rows"], 21);

    let (code, run, err) = backfill(&url, &range, &[]);
    assert_eq!(code, Some(0), "{err}");
    let runs = keys(&run);
    assert_eq!(runs.len(), 5);
    for (report, planned) in runs.iter().zip(dry_keys) {
        assert_eq!(report["business_date"], planned["business_date"]);
        assert_eq!(
            report["updated"], planned["rows"],
            "the dry run's rows are what the run touched"
        );
        let expected = if planned["action"] == "skip" {
            "skipped"
        } else {
            "settled"
        };
        assert_eq!(report["outcome"], expected, "{report}");
    }
    assert_eq!(run.last().expect("summary")["settled"], 3);
    for month in &m {
        assert_eq!(
            settled(&pool, &s(*month)).await,
            oracle(&pool, &s(*month)).await,
            "{month}"
        );
    }
    assert_eq!(max_updates_per_loan(&pool).await, 1);

    // Again: all skips, nothing changes.
    let loans_before = fingerprint(&pool).await;
    let (code, again, err) = backfill(&url, &range, &[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        keys(&again)
            .iter()
            .all(|r| r["outcome"] == "skipped" && r["updated"] == 0),
        "{again:?}"
    );
    assert_eq!(fingerprint(&pool).await, loans_before);

    // --reprocess all re-runs every SUCCESS key and changes no loan.
    let (code, all, err) = backfill(&url, &[&range[..], &["--reprocess", "all"]].concat(), &[]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        keys(&all)
            .iter()
            .all(|r| r["outcome"] == "settled" && r["updated"] == 0),
        "{all:?}"
    );
    assert_eq!(max_updates_per_loan(&pool).await, 1);
    for month in &m {
        assert_eq!(
            settled(&pool, &s(*month)).await,
            oracle(&pool, &s(*month)).await,
            "{month}"
        );
    }
}

#[sqlx::test(fixtures("default_policy"))]
async fn reprocess_failed_runs_only_the_failed_keys(pool: PgPool) {
    let url = crate::helpers::database_url(&pool);
    let m = due_now(&pool, 3).await;
    loans_in(&pool, &m, 4).await;
    let range = ["--job", "fine-settlement", "--from", &s(m[0]), "--to", &s(m[2])];
    let (code, _, err) = backfill(&url, &range, &[]);
    assert_eq!(code, Some(0), "{err}");
    // m[1] failed after a batch that ended at loan 2002, with 2003 and 2004 left (and 2001 below the cursor,
    // left for a re-open); m[2] succeeded but two of its loans came back unsettled (late rows, which `missing`
    // would re-open): `failed` runs m[1] only, from its cursor.
    sqlx::query(
        "update job_runs set status = 'FAILED', lease_until = now(), cursor = 2002 where business_date = $1",
    )
    .bind(m[1])
    .execute(&pool)
    .await
    .expect("fail m1");
    sqlx::query("update loans set fine_settled_at = null where id in (2001, 2003, 2004, 3001, 3002)")
        .execute(&pool)
        .await
        .expect("unsettle");

    let failed = [&range[..], &["--reprocess", "failed"]].concat();
    let (code, dry, err) = backfill(&url, &[&failed[..], &["--dry-run"]].concat(), &[]);
    assert_eq!(code, Some(0), "{err}");
    let actions: Vec<_> = keys(&dry)
        .iter()
        .map(|l| (l["action"].clone(), l["rows"].clone()))
        .collect();
    assert_eq!(
        actions,
        [
            ("skip".into(), 0.into()),
            ("takeover".into(), 2.into()),
            ("skip".into(), 0.into())
        ]
    );
    let (code, run, err) = backfill(&url, &failed, &[]);
    assert_eq!(code, Some(0), "{err}");
    let runs = keys(&run);
    assert_eq!(runs.len(), 1, "{run:?}");
    assert_eq!(
        (runs[0]["business_date"].clone(), runs[0]["updated"].clone()),
        (s(m[1]).into(), 2.into())
    );
    assert_eq!(run.last().expect("summary")["not_selected"], 2);
    let left: i64 = sqlx::query_scalar("select count(*) from loans where fine_settled_at is null")
        .fetch_one(&pool)
        .await
        .expect("left");
    assert_eq!(
        left, 3,
        "m[2]'s late rows and m[1]'s below its cursor are left to `missing`"
    );
    // `missing` then re-opens m[1] and m[2] by itself, as its dry run says.
    let (code, dry, err) = backfill(&url, &[&range[..], &["--dry-run"]].concat(), &[]);
    assert_eq!(code, Some(0), "{err}");
    let (code, run, err) = backfill(&url, &range, &[]);
    assert_eq!(code, Some(0), "{err}");
    for (planned, report) in keys(&dry).iter().zip(keys(&run)) {
        assert_eq!(report["updated"], planned["rows"], "{planned} / {report}");
        assert_eq!(
            report["reopened"],
            planned["action"] == "reopen",
            "{planned} / {report}"
        );
    }
    let rows: Vec<_> = keys(&dry).iter().map(|l| l["rows"].clone()).collect();
    assert_eq!(rows, [0, 1, 2].map(Value::from));
}

#[sqlx::test(fixtures("default_policy"))]
async fn three_shards_run_three_at_a_time_and_never_more(pool: PgPool) {
    let url = crate::helpers::database_url(&pool);
    let m = due_now(&pool, 3).await;
    loans_in(&pool, &m, 6).await;
    // 0.1 s per settled loan: each key takes 0.2 s, long enough for the runs to overlap.
    slow_down(&pool, "update on loans", 0.1).await;
    let args = [
        "--job",
        "fine-settlement",
        "--from",
        &s(m[0]),
        "--to",
        &s(m[2]),
        "--shards",
        "3",
    ];
    let (code, run, err) = backfill(&url, &[&args[..], &["--concurrency", "3"]].concat(), &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(keys(&run).len(), 9);
    assert!(keys(&run).iter().all(|r| r["outcome"] == "settled"), "{run:?}");
    for month in &m {
        assert_eq!(
            settled(&pool, &s(*month)).await,
            oracle(&pool, &s(*month)).await,
            "{month}"
        );
    }
    // How many runs were in progress when each one started.
    let most: i64 = sqlx::query_scalar(
        "select max((select count(*) from job_runs s
                     where s.started_at <= r.started_at and s.finished_at > r.started_at))
         from job_runs r",
    )
    .fetch_one(&pool)
    .await
    .expect("overlap");
    assert!(
        (2..=3).contains(&most),
        "{most} runs at once with --concurrency 3"
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn accrual_backfill_compensates_first_and_charges_exactly_the_dry_runs_rows(pool: PgPool) {
    let url = crate::helpers::database_url(&pool);
    let today: NaiveDate = sqlx::query_scalar("select (now() at time zone 'Asia/Shanghai')::date")
        .fetch_one(&pool)
        .await
        .expect("today");
    let days: Vec<NaiveDate> = (1..=3).rev().map(|n| today - chrono::Duration::days(n)).collect();
    let due = days[0] - chrono::Duration::days(10);
    // Loans 1-5 out and overdue on every day; 6 returned on the second day (overdue on the first two); 7 not due.
    let mut loans: Vec<_> = (1..=5).map(|id| loan(id, due, None)).collect();
    loans.push(loan(6, due, Some(days[1])));
    loans.push(loan(7, today + chrono::Duration::days(5), None));
    crate::helpers::insert(&pool, &loans).await;
    // A charge of an earlier day that failed and is due for its retry.
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (1, $1, 100, 1, 'earlier failure', now() - interval '1 second')",
    )
    .bind(due + chrono::Duration::days(1))
    .execute(&pool)
    .await
    .expect("pending");

    let range = [
        "--job",
        "overdue-accrual",
        "--from",
        &s(days[0]),
        "--to",
        &s(days[2]),
    ];
    let before = fingerprint(&pool).await;
    let (code, dry, err) = backfill(&url, &[&range[..], &["--dry-run"]].concat(), &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(fingerprint(&pool).await, before);
    let rows: Vec<_> = keys(&dry).iter().map(|l| l["rows"].clone()).collect();
    assert_eq!(rows, [6, 6, 5].map(Value::from));

    let (code, run, err) = backfill(&url, &range, &[]);
    assert_eq!(code, Some(0), "{err}");
    let updated: Vec<_> = keys(&run).iter().map(|r| r["updated"].clone()).collect();
    assert_eq!(updated, rows, "the run charged what the dry run counted");
    assert_eq!(run.last().expect("summary")["compensated"], 1);
    let (ledger, pending): (i64, i64) =
        sqlx::query_as("select (select count(*) from fine_ledger), (select count(*) from fine_pending)")
            .fetch_one(&pool)
            .await
            .expect("counts");
    assert_eq!((ledger, pending), (6 + 6 + 5 + 1, 0));

    // The days are done: a dry run finds nothing left.
    let (_, dry, _) = backfill(&url, &[&range[..], &["--dry-run"]].concat(), &[]);
    assert!(
        keys(&dry)
            .iter()
            .all(|l| l["status"] == "SUCCESS" && l["rows"] == 0),
        "{dry:?}"
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_key_held_by_a_live_owner_is_skipped_not_displaced(pool: PgPool) {
    let url = crate::helpers::database_url(&pool);
    let m = due_now(&pool, 2).await;
    loans_in(&pool, &m, 3).await;
    seed_run(
        &pool,
        "fine-settlement",
        m[0],
        "RUNNING",
        "elsewhere:1:live",
        4,
        "1 hour",
    )
    .await;
    let range = ["--job", "fine-settlement", "--from", &s(m[0]), "--to", &s(m[1])];
    let (_, dry, _) = backfill(&url, &[&range[..], &["--dry-run"]].concat(), &[]);
    assert_eq!(keys(&dry)[0]["action"], "skip");
    assert_eq!(keys(&dry)[0]["status"], "RUNNING");
    for reprocess in ["missing", "all"] {
        let (code, run, err) = backfill(&url, &[&range[..], &["--reprocess", reprocess]].concat(), &[]);
        assert_eq!(code, Some(0), "{err}");
        assert_eq!(keys(&run)[0]["outcome"], "skipped", "{run:?}");
        assert!(keys(&run)[0]["detail"]
            .as_str()
            .unwrap_or("")
            .contains("elsewhere:1:live"));
    }
    let (owner, epoch): (String, i64) =
        sqlx::query_as("select owner, epoch from job_runs where business_date = $1")
            .bind(m[0])
            .fetch_one(&pool)
            .await
            .expect("row");
    assert_eq!((owner.as_str(), epoch), ("elsewhere:1:live", 4));
    assert_eq!(settled(&pool, &s(m[0])).await.0, 0);
    assert_eq!(settled(&pool, &s(m[1])).await, oracle(&pool, &s(m[1])).await);
}

#[sqlx::test(fixtures("default_policy"))]
async fn each_bad_input_is_one_line_naming_the_flag_exit_2_and_nothing_written(pool: PgPool) {
    let url = crate::helpers::database_url(&pool);
    let m = due_now(&pool, 2).await;
    loans_in(&pool, &m, 3).await;
    let today: NaiveDate = sqlx::query_scalar("select (now() at time zone 'Asia/Shanghai')::date")
        .fetch_one(&pool)
        .await
        .expect("today");
    let this_month_end = fine_settler::calendar::month_end(today);
    let before = fingerprint(&pool).await;
    let settle = |from: String, to: String| {
        vec![
            "--job".into(),
            "fine-settlement".into(),
            "--from".into(),
            from,
            "--to".into(),
            to,
        ]
    };
    let accrue = |from: String, to: String| {
        vec![
            "--job".into(),
            "overdue-accrual".into(),
            "--from".into(),
            from,
            "--to".into(),
            to,
        ]
    };
    let ok = settle(s(m[0]), s(m[1]));
    let with = |extra: &[&str]| [ok.clone(), extra.iter().map(|e| e.to_string()).collect()].concat();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (settle(s(m[1]), s(m[0])), "--from: "),
        (
            settle("2026-03-02".into(), "2026-03-30".into()),
            "--from/--to: no month end",
        ),
        (accrue("2020-01-01".into(), "2024-01-01".into()), "--from/--to: "),
        (accrue(s(today - chrono::Duration::days(2)), s(today)), "--to: "),
        (settle(s(m[0]), s(this_month_end)), "--to: "),
        (with(&["--concurrency", "0"]), "--concurrency: "),
        (with(&["--concurrency", "-3"]), "--concurrency: "),
        (with(&["--concurrency", "1000"]), "--concurrency: "),
        (with(&["--concurrency", "5"]), "database.max_connections is 4"),
        (with(&["--shards", "0"]), "--shards: "),
        (with(&["--reprocess", "some"]), "--reprocess"),
    ];
    for (args, expected) in cases {
        for dry in [false, true] {
            let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
            if dry {
                args.push("--dry-run");
            }
            let (code, stdout, err) = backfill(&url, &args, &[]);
            assert_eq!(code, Some(2), "{args:?}: {err}");
            assert!(
                err.contains(expected),
                "{args:?}: {err:?} does not say {expected:?}"
            );
            assert!(stdout.is_empty(), "{args:?}: {stdout:?}");
            assert_eq!(fingerprint(&pool).await, before, "{args:?} wrote something");
        }
    }
}

/// A backfill of three months of 6 loans each, slowed to 0.2 s per settled loan in batches of 2, started as a
/// process and returned once its first batch has committed (the first key is mid-run for a good second).
async fn backfill_mid_run(pool: &PgPool, url: &str) -> (Vec<NaiveDate>, Running, StderrLog) {
    let m = due_now(pool, 3).await;
    loans_in(pool, &m, 6).await;
    slow_down(pool, "update on loans", 0.2).await;
    let mut cmd = fine_settler(url);
    cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "2")
        .args([
            "backfill",
            "--job",
            "fine-settlement",
            "--from",
            &s(m[0]),
            "--to",
            &s(m[2]),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = spawn(&mut cmd);
    let log = StderrLog::collect(&mut child);
    wait_until(
        "a committed batch",
        std::time::Duration::from_secs(20),
        || async {
            sqlx::query_scalar::<_, i64>("select count(*) from job_runs where cursor is not null")
                .fetch_one(pool)
                .await
                .expect("count")
                > 0
        },
    )
    .await;
    (m, child, log)
}

#[sqlx::test(fixtures("default_policy"))]
async fn sigterm_mid_backfill_finishes_the_batch_hands_the_key_back_and_starts_no_other(pool: PgPool) {
    let url = crate::helpers::database_url(&pool);
    let (m, mut child, log) = backfill_mid_run(&pool, &url).await;
    signal(&child, "TERM");
    let mut stdout = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().expect("stdout"), &mut stdout).expect("stdout");
    let (code, _) = exit_of(child, std::time::Duration::from_secs(20)).await;
    let err = log.finish();
    assert_eq!(code, Some(1), "{err}");
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect();
    let runs = keys(&lines);
    assert_eq!(runs.len(), 1, "only the run in flight reports: {lines:?}");
    assert_eq!(runs[0]["outcome"], "failed");
    assert!(runs[0]["detail"]
        .as_str()
        .unwrap_or("")
        .contains("shutdown requested"));
    let summary = lines.last().expect("summary");
    assert_eq!(
        (summary["interrupted"].clone(), summary["not_started"].clone()),
        (true.into(), 2.into())
    );
    let rows: Vec<(NaiveDate, String, bool)> = sqlx::query_as(
        "select business_date, status, lease_until <= now() from job_runs order by business_date",
    )
    .fetch_all(&pool)
    .await
    .expect("rows");
    assert_eq!(
        rows,
        [(m[0], "FAILED".to_string(), true)],
        "handed back; no other key claimed"
    );
    // The batches it committed are settled; the next backfill resumes and finishes.
    let done = settled(&pool, &s(m[0])).await.0;
    assert_eq!(runs[0]["updated"], done);
    assert!(done > 0 && done < 6, "{done}");
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_paused_job_is_not_backfilled_unless_told_to_ignore_the_pause(pool: PgPool) {
    let url = crate::helpers::database_url(&pool);
    let m = due_now(&pool, 2).await;
    loans_in(&pool, &m, 3).await;
    let mut pause = fine_settler(&url);
    pause.args([
        "pause",
        "--job",
        "fine-settlement",
        "--shards",
        "2",
        "--shard",
        "1",
        "--reason",
        "month-end freeze",
        "--by",
        "ops@test",
    ]);
    crate::helpers::assert_success(&output(pause));
    let before = fingerprint(&pool).await;
    let range = [
        "--job",
        "fine-settlement",
        "--from",
        &s(m[0]),
        "--to",
        &s(m[1]),
        "--shards",
        "2",
    ];

    // The dry run says so, and still writes nothing.
    let (code, dry, err) = backfill(&url, &[&range[..], &["--dry-run"]].concat(), &[]);
    assert_eq!(code, Some(0), "{err}");
    let summary = dry.last().expect("summary");
    assert_eq!(summary["paused"][0]["by"], "ops@test", "{summary}");
    assert_eq!(summary["paused"][0]["shard"], 1, "{summary}");
    // The real run refuses with one line and writes nothing, the compensation pass included.
    let (code, lines, err) = backfill(&url, &range, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(lines.is_empty(), "{lines:?}");
    let said: Vec<&str> = err.lines().filter(|l| l.starts_with("fine-settler:")).collect();
    assert_eq!(said.len(), 1, "{err}");
    assert!(
        said[0].contains("paused by ops@test")
            && said[0].contains("month-end freeze")
            && said[0].contains("--ignore-pause"),
        "{err}"
    );
    assert_eq!(fingerprint(&pool).await, before);
    // A pause of another shard count does not stop it.
    let other = [&range[..6], &["--shards", "3", "--dry-run"]].concat();
    let (code, dry, err) = backfill(&url, &other, &[]);
    assert_eq!(code, Some(0), "{err}");
    let summary = dry.last().expect("summary");
    assert_eq!(summary["paused"], serde_json::json!([]), "{summary}");
    // With --ignore-pause it runs every key, the paused shard's too.
    let (code, lines, err) = backfill(&url, &[&range[..], &["--ignore-pause"]].concat(), &[]);
    assert_eq!(code, Some(0), "{err}");
    let summary = lines.last().expect("summary");
    assert_eq!(summary["settled"], 4, "{summary}");
}

/// A pause set while a backfill runs stops it: the key in flight is handed back after the batch whose fence saw
/// the pause, and no further key starts (they are `not_started`).
#[sqlx::test(fixtures("default_policy"))]
async fn a_pause_set_mid_backfill_starts_no_further_key(pool: PgPool) {
    let url = crate::helpers::database_url(&pool);
    let (_, mut child, log) = backfill_mid_run(&pool, &url).await;
    let mut pause = fine_settler(&url);
    pause.args([
        "pause",
        "--job",
        "fine-settlement",
        "--reason",
        "freeze",
        "--by",
        "ops",
    ]);
    crate::helpers::assert_success(&output(pause));
    let mut stdout = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().expect("stdout"), &mut stdout).expect("stdout");
    let (code, _) = exit_of(child, std::time::Duration::from_secs(30)).await;
    let _ = log.finish();
    assert_eq!(code, Some(1), "{stdout}");
    let summary: Value = serde_json::from_str(stdout.lines().last().expect("summary")).expect("json");
    assert_eq!(summary["paused"], true, "{summary}");
    assert_eq!(summary["not_started"], 2, "{summary}");
    let rows: Vec<(NaiveDate, String, Option<String>)> =
        sqlx::query_as("select business_date, status, last_error from job_runs order by business_date")
            .fetch_all(&pool)
            .await
            .expect("rows");
    assert_eq!(rows.len(), 1, "only the key in flight was claimed: {rows:?}");
    assert_eq!(rows[0].1, "FAILED", "{rows:?}");
    assert!(
        rows[0]
            .2
            .as_deref()
            .is_some_and(|e| e.starts_with("paused: freeze")),
        "{rows:?}"
    );
}

/// `--reprocess all` forces every key not held by a live owner — a FAILED one too, whose cursor the forced claim
/// resets — so its dry run counts the whole key, and the run touches exactly that.
#[sqlx::test(fixtures("default_policy"))]
async fn reprocess_all_counts_a_failed_key_from_its_start(pool: PgPool) {
    let url = crate::helpers::database_url(&pool);
    let m = due_now(&pool, 1).await;
    loans_in(&pool, &m, 4).await;
    let range = ["--job", "fine-settlement", "--from", &s(m[0]), "--to", &s(m[0])];
    let (code, _, err) = backfill(&url, &range, &[]);
    assert_eq!(code, Some(0), "{err}");
    // FAILED after a batch that ended at loan 1002, with 1001 (below the cursor) and 1003 unsettled again.
    sqlx::query("update job_runs set status = 'FAILED', lease_until = now(), cursor = 1002")
        .execute(&pool)
        .await
        .expect("fail");
    sqlx::query("update loans set fine_settled_at = null where id in (1001, 1003)")
        .execute(&pool)
        .await
        .expect("unsettle");
    let all = [&range[..], &["--reprocess", "all"]].concat();
    let (code, dry, err) = backfill(&url, &[&all[..], &["--dry-run"]].concat(), &[]);
    assert_eq!(code, Some(0), "{err}");
    let planned = &keys(&dry)[0];
    assert_eq!(
        (planned["action"].clone(), planned["rows"].clone()),
        ("force".into(), 2.into()),
        "{planned}"
    );
    let (code, run, err) = backfill(&url, &all, &[]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(keys(&run)[0]["updated"], 2, "{run:?}");
}
