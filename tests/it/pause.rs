//! Pause and resume: a paused job's keys are not claimed by any replica, a run in progress hands its key back
//! after the batch whose fence saw the pause, `resume` lets the next tick go on from the cursor, a shard's pause
//! stops only that shard, and `settle`/`accrue` by hand refuse a paused key unless `--ignore-pause`.

use std::{process::Output, time::Duration};

use chrono::NaiveDate;
use fine_settler::{
    jobs::{settlement::Settlement, JobName, Outcome},
    shard::ShardSpec,
    store::{
        job_runs::{advance, claim, Claim, ClaimMode, Claimant, Fence, Progress},
        pauses::{self, PauseScope},
    },
};
use sqlx::PgPool;

use crate::{
    daemon::http_get,
    helpers::{
        assert_success, daemon, database_url, db, due_now, fine_settler, free_port, insert,
        install_update_audit, key, loan, max_updates_per_loan, oracle, output, report, runner, settled,
        slow_down, stop, wait_until, StderrLog,
    },
};

/// Loans 1..=n returned the day before `month_end`, three days late.
async fn returned_in(pool: &PgPool, month_end: NaiveDate, n: i64) {
    let returned = month_end - chrono::Duration::days(1);
    let due = returned - chrono::Duration::days(3);
    let loans: Vec<_> = (1..=n)
        .map(|id| loan(id, &due.to_string(), Some(&returned.to_string())))
        .collect();
    insert(pool, &loans).await;
}

/// Runs the binary with `args` against `url`.
fn cli(url: &str, args: &[&str]) -> Output {
    let mut cmd = fine_settler(url);
    cmd.args(args);
    output(cmd)
}

/// The value of the first series of `/metrics` whose line starts with `series`.
fn metric(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// (status, epoch, scanned, updated, last_error, lease ended) of the only `job_runs` row.
async fn the_key(pool: &PgPool) -> (String, i64, i64, i64, Option<String>, bool) {
    sqlx::query_as("select status, epoch, scanned, updated, last_error, lease_until <= now() from job_runs")
        .fetch_one(pool)
        .await
        .expect("the job_runs row")
}

/// Committed updates of loan rows, counted by the audit trigger (rolled-back ones are not).
async fn committed_updates(pool: &PgPool) -> i64 {
    sqlx::query_scalar("select coalesce(sum(n), 0)::bigint from loan_updates")
        .fetch_one(pool)
        .await
        .expect("audit")
}

/// A replica mid-run, paused: the run commits the batch in flight and hands the key back (FAILED, "paused: …",
/// lease ended); while paused, tick after tick claims nothing and commits nothing, the replica says so once and
/// exports the gauge; resumed, the next tick takes the key over and finishes it from the cursor, no loan
/// updated twice.
#[sqlx::test(fixtures("default_policy"))]
async fn a_pause_stops_a_running_replica_within_one_batch_and_resume_finishes_from_the_cursor(pool: PgPool) {
    install_update_audit(&pool).await;
    let months = due_now(&pool, 1).await;
    returned_in(&pool, months[0], 400).await;
    slow_down(&pool, "update on loans", 0.004).await;
    let url = database_url(&pool);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let extra = [
        ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
        ("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "10"),
        ("FINE_SETTLER__HTTP__LISTEN", listen.as_str()),
    ];
    let mut replica = daemon(&url, 0, 1, &extra);
    let log = StderrLog::collect(&mut replica);
    wait_until("a few committed batches", Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, i64>("select coalesce(max(scanned), 0) from job_runs")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
            >= 30
    })
    .await;

    let out = cli(
        &url,
        &[
            "pause",
            "--job",
            "fine-settlement",
            "--reason",
            "month-end freeze",
            "--by",
            "ops@test",
        ],
    );
    assert_success(&out);
    let paused = report(&out);
    assert_eq!(
        (
            paused["paused"].as_bool(),
            paused["by"].as_str(),
            paused["shards"].is_null()
        ),
        (Some(true), Some("ops@test"), true),
        "{paused}"
    );
    let scanned_at_pause: i64 = sqlx::query_scalar("select scanned from job_runs")
        .fetch_one(&pool)
        .await
        .expect("row");

    wait_until("the key handed back", Duration::from_secs(10), || async {
        the_key(&pool).await.0 == "FAILED"
    })
    .await;
    let (status, epoch, scanned, updated, error, lease_ended) = the_key(&pool).await;
    assert_eq!(
        (status.as_str(), epoch, error.as_deref(), lease_ended),
        ("FAILED", 1, Some("paused: month-end freeze (by ops@test)"), true)
    );
    // The batch in flight when the pause committed, and no more (a batch is 10 rows; the next fence sees it).
    assert!(
        scanned > scanned_at_pause - 1 && scanned <= scanned_at_pause + 20 && scanned < 400,
        "stopped within a batch of the pause: {scanned_at_pause} then {scanned}"
    );
    // No batch committed after the hand-back: every committed update is counted in the key's row.
    assert_eq!(committed_updates(&pool).await, updated);

    // Several ticks while paused (period 300 ms): nothing claimed, nothing written.
    let ticks = |body: &str| metric(body, "fine_settler_ticks_total{").unwrap_or(-1.0);
    // The gauge is set from the tick's status read: the first tick after the hand-back shows the pause (the key
    // turns FAILED mid-tick, before that read).
    wait_until("the paused gauge set", Duration::from_secs(5), || async {
        let body = http_get(port, "/metrics").await.1;
        metric(&body, "fine_settler_paused{job=\"fine-settlement\"") == Some(1.0)
    })
    .await;
    let (_, body) = http_get(port, "/metrics").await;
    let ticks_then = ticks(&body);
    assert_eq!(
        metric(&body, "fine_settler_paused{job=\"overdue-accrual\""),
        Some(0.0)
    );
    wait_until("five more ticks", Duration::from_secs(15), || async {
        ticks(&http_get(port, "/metrics").await.1) >= ticks_then + 5.0
    })
    .await;
    assert_eq!(
        the_key(&pool).await,
        (status, epoch, scanned, updated, error, lease_ended)
    );
    assert_eq!(committed_updates(&pool).await, updated);
    let events: Vec<String> = sqlx::query_scalar("select event from job_run_attempts order by id")
        .fetch_all(&pool)
        .await
        .expect("h");
    assert_eq!(events, ["claimed", "failed"], "no claim while paused");
    let plan = cli(&url, &["plan"]);
    let plan = report(&plan);
    assert_eq!(
        (
            plan["action"].as_str(),
            plan["paused"]["by"].as_str(),
            plan["paused"]["reason"].as_str()
        ),
        (Some("paused"), Some("ops@test"), Some("month-end freeze")),
        "{plan}"
    );

    let out = cli(&url, &["resume", "--job", "fine-settlement", "--by", "ops@test"]);
    assert_success(&out);
    let resumed = report(&out);
    assert_eq!(
        (resumed["resumed"].as_bool(), resumed["reason"].as_str()),
        (Some(true), Some("month-end freeze")),
        "{resumed}"
    );
    sqlx::query("drop trigger slow_down on loans")
        .execute(&pool)
        .await
        .expect("drop trigger");
    wait_until("the key SUCCESS", Duration::from_secs(30), || async {
        the_key(&pool).await.0 == "SUCCESS"
    })
    .await;
    let (_, epoch, scanned_total, _, _, _) = the_key(&pool).await;
    assert_eq!(
        (epoch, scanned_total),
        (2, 400),
        "taken over once, every row scanned once"
    );
    let m = months[0].to_string();
    assert_eq!(settled(&pool, &m).await, oracle(&pool, &m).await);
    assert_eq!(
        max_updates_per_loan(&pool).await,
        1,
        "resumed after the cursor: no loan updated twice"
    );
    wait_until("the gauge back to 0", Duration::from_secs(10), || async {
        let (_, body) = http_get(port, "/metrics").await;
        metric(&body, "fine_settler_paused{job=\"fine-settlement\"") == Some(0.0)
    })
    .await;

    let (code, _) = stop(replica).await;
    assert_eq!(code, Some(0));
    let stderr = log.finish();
    let lines = |text: &str| stderr.lines().filter(|l| l.contains(text)).count();
    assert_eq!(lines("job paused by ops@test: month-end freeze"), 1, "{stderr}");
    assert_eq!(lines("job resumed"), 1, "{stderr}");
    assert_eq!(lines("handing the key back"), 1, "{stderr}");
}

/// A run learns of a pause at its first fence: a key claimed just before the pause commits one batch and is
/// handed back; with `ignoring_pauses` (`--ignore-pause`) the run goes on to the end.
#[sqlx::test(fixtures("default_policy"))]
async fn a_run_claimed_before_the_pause_commits_one_batch_and_hands_the_key_back(pool: PgPool) {
    returned_in(&pool, "2026-10-31".parse().expect("date"), 50).await;
    pauses::pause(
        &db(&pool),
        JobName::FineSettlement,
        PauseScope::Job,
        "ops",
        "audit",
    )
    .await
    .expect("pause");
    let k = key("2026-10-31", 0, 1);
    let run = runner(&pool, "r", 10).run(&Settlement::new(), k, false).await;
    assert_eq!(
        (run.outcome, run.scanned, run.detail.as_deref()),
        (Outcome::Failed, 10, Some("paused: audit (by ops)"))
    );
    let (status, _, scanned, _, error, lease_ended) = the_key(&pool).await;
    assert_eq!(
        (status.as_str(), scanned, error.as_deref(), lease_ended),
        ("FAILED", 10, Some("paused: audit (by ops)"), true)
    );
    let run = runner(&pool, "r2", 10)
        .ignoring_pauses()
        .run(&Settlement::new(), k, false)
        .await;
    assert_eq!(
        (run.outcome, run.scanned, run.epoch),
        (Outcome::Settled, 40, Some(2))
    );
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
}

/// The fence's answer: a pause covering the key (the job's, or this shard's) lets the batch commit and says
/// who paused it; another shard's pause is not this key's; a lost epoch is lost, paused or not.
#[sqlx::test(fixtures("default_policy"))]
async fn the_fence_reports_a_pause_and_never_mistakes_it_for_a_lost_lease(pool: PgPool) {
    let k = key("2026-10-31", 1, 4);
    assert!(matches!(
        claim(&db(&pool), &k, "a", Duration::from_secs(60), ClaimMode::Free)
            .await
            .expect("claim"),
        Claim::Won { epoch: 1, .. }
    ));
    let progress = Progress {
        after: None,
        cursor: 5,
        scanned: 5,
        updated: 5,
    };
    let fence = |epoch| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.expect("begin");
            let f = advance(
                &mut tx,
                &k,
                Claimant { epoch, owner: "a" },
                progress,
                Duration::from_secs(60),
            )
            .await
            .expect("fence");
            tx.rollback().await.expect("rollback");
            f
        }
    };
    assert_eq!(fence(1).await, Fence::Passed { paused: None });
    let other = ShardSpec::new(2, 4).expect("shard");
    pauses::pause(
        &db(&pool),
        JobName::FineSettlement,
        PauseScope::Shard(other),
        "x",
        "other shard",
    )
    .await
    .expect("pause");
    pauses::pause(
        &db(&pool),
        JobName::OverdueAccrual,
        PauseScope::Job,
        "x",
        "other job",
    )
    .await
    .expect("pause");
    assert_eq!(fence(1).await, Fence::Passed { paused: None });
    pauses::pause(
        &db(&pool),
        JobName::FineSettlement,
        PauseScope::Shard(k.shard),
        "s",
        "this shard",
    )
    .await
    .expect("pause");
    assert_eq!(
        fence(1).await,
        Fence::Passed {
            paused: Some(("s".into(), "this shard".into()))
        }
    );
    pauses::pause(
        &db(&pool),
        JobName::FineSettlement,
        PauseScope::Job,
        "j",
        "whole job",
    )
    .await
    .expect("pause");
    assert_eq!(
        fence(1).await,
        Fence::Passed {
            paused: Some(("j".into(), "whole job".into()))
        }
    );
    assert_eq!(fence(2).await, Fence::Lost);
}

/// A pause of shard 1 of 2 stops only that shard: shard 0 settles, shard 1 claims nothing (its plan says
/// paused), shard 1 of another shard count is not paused; resuming the whole job does not lift the shard's own
/// pause, resuming the shard does.
#[sqlx::test(fixtures("default_policy"))]
async fn a_shard_s_pause_stops_only_that_shard(pool: PgPool) {
    let months = due_now(&pool, 1).await;
    returned_in(&pool, months[0], 40).await;
    let url = database_url(&pool);
    let once = |shard: &str, shards: &str| {
        let mut cmd = fine_settler(&url);
        cmd.env("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1")
            .env("FINE_SETTLER__INSTANCE__SHARD", shard)
            .env("FINE_SETTLER__INSTANCE__SHARDS", shards);
        cmd
    };
    let out = cli(
        &url,
        &[
            "pause",
            "--job",
            "fine-settlement",
            "--shards",
            "2",
            "--shard",
            "1",
            "--by",
            "ops",
        ],
    );
    assert_success(&out);
    assert_eq!(
        (report(&out)["shards"].as_i64(), report(&out)["shard"].as_i64()),
        (Some(2), Some(1))
    );

    let mut plan = once("1", "2");
    plan.arg("plan");
    let plan = output(plan);
    assert_eq!(report(&plan)["action"].as_str(), Some("paused"));
    for (shard, shards) in [("0", "2"), ("1", "2"), ("1", "3")] {
        let mut run = once(shard, shards);
        run.args(["run", "--once"]);
        assert_success(&output(run));
    }
    let keys: Vec<(i32, i32, String)> =
        sqlx::query_as("select shards, shard, status from job_runs order by shards, shard")
            .fetch_all(&pool)
            .await
            .expect("keys");
    assert_eq!(
        keys,
        [(2, 0, "SUCCESS".to_string()), (3, 1, "SUCCESS".to_string())]
    );

    let out = cli(&url, &["resume", "--job", "fine-settlement", "--by", "ops"]);
    assert_success(&out);
    let r = report(&out);
    assert_eq!(r["resumed"].as_bool(), Some(false), "{r}");
    assert_eq!(r["still_paused"].as_array().map(Vec::len), Some(1), "{r}");
    let out = cli(
        &url,
        &[
            "resume",
            "--job",
            "fine-settlement",
            "--shards",
            "2",
            "--shard",
            "1",
            "--by",
            "ops",
        ],
    );
    assert_eq!(report(&out)["resumed"].as_bool(), Some(true));
    let mut run = once("1", "2");
    run.args(["run", "--once"]);
    let run = output(run);
    assert_success(&run);
    assert_eq!(report(&run)["outcome"].as_str(), Some("settled"));
}

/// `settle` and `accrue` by hand on a paused job exit 1 with one line naming the pause and write nothing (not
/// even the compensation pass); with `--ignore-pause` they run.
#[sqlx::test(fixtures("default_policy"))]
async fn settle_and_accrue_refuse_a_paused_job_unless_told_to_ignore_the_pause(pool: PgPool) {
    returned_in(&pool, "2026-10-31".parse().expect("date"), 20).await;
    let url = database_url(&pool);
    for job in ["fine-settlement", "overdue-accrual"] {
        let out = cli(
            &url,
            &[
                "pause",
                "--job",
                job,
                "--reason",
                "quarter close",
                "--by",
                "ops@test",
            ],
        );
        assert_success(&out);
    }
    // A pending charge already due: accrue's compensation pass would write it.
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (1, '2026-10-28', 100, 1, 'lock timeout', now() - interval '1 second')",
    )
    .execute(&pool)
    .await
    .expect("pending");
    let before = |pool: PgPool| async move {
        sqlx::query_as::<_, (i64, i64, i64, i64)>(
            "select (select count(*) from job_runs), (select count(*) from job_run_attempts),
                    (select count(*) from loans where fine_settled_at is not null),
                    (select count(*) from fine_ledger) + (select sum(attempts) from fine_pending)",
        )
        .fetch_one(&pool)
        .await
        .expect("counts")
    };
    let untouched = before(pool.clone()).await;
    for args in [
        ["settle", "--business-date", "2026-10-31"],
        ["accrue", "--date", "2026-10-30"],
    ] {
        let out = cli(&url, &args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: no report");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line: {stderr}");
        for part in [
            "is paused by ops@test since 20",
            ": quarter close",
            "--ignore-pause",
        ] {
            assert!(
                lines[0].contains(part),
                "{args:?}: {part:?} missing from {:?}",
                lines[0]
            );
        }
        assert_eq!(before(pool.clone()).await, untouched, "{args:?} wrote nothing");
    }
    let out = cli(
        &url,
        &["settle", "--business-date", "2026-10-31", "--ignore-pause"],
    );
    assert_success(&out);
    assert_eq!(report(&out)["outcome"].as_str(), Some("settled"));
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    let out = cli(&url, &["accrue", "--date", "2026-10-30", "--ignore-pause"]);
    assert_success(&out);
    let r = report(&out);
    assert_eq!(
        (r["outcome"].as_str(), r["compensated"].as_u64()),
        (Some("settled"), Some(1)),
        "{r}"
    );
}

/// `pending retry` retries every shard's charges, so a pause of the accrual — of the whole job or of one shard —
/// refuses it: exit 1, one line naming the pause and `--ignore-pause`, nothing written (not even `--dead`'s fresh
/// attempts). With `--ignore-pause` it charges the queue. A pause of the settlement does not stop it.
#[sqlx::test(fixtures("default_policy"))]
async fn pending_retry_refuses_a_paused_accrual_unless_told_to_ignore_the_pause(pool: PgPool) {
    insert(&pool, &[loan(1, "2026-10-01", None), loan(2, "2026-10-01", None)]).await;
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at, status)
         values (1, '2026-10-28', 100, 1, 'lock timeout', now() + interval '1 hour', 'PENDING'),
                (2, '2026-10-28', 100, 10, 'lock timeout', now(), 'DEAD')",
    )
    .execute(&pool)
    .await
    .expect("pending");
    let url = database_url(&pool);
    let queue = || async {
        sqlx::query_as::<_, (i64, String, i32)>(
            "select loan_id, status, attempts from fine_pending order by loan_id",
        )
        .fetch_all(&pool)
        .await
        .expect("queue")
    };
    let untouched = queue().await;
    assert_success(&cli(
        &url,
        &["pause", "--job", "fine-settlement", "--by", "ops@test"],
    ));
    let pause = |scope: &[&str]| {
        let mut args = vec![
            "pause",
            "--job",
            "overdue-accrual",
            "--reason",
            "ledger audit",
            "--by",
            "ops@test",
        ];
        args.extend_from_slice(scope);
        assert_success(&cli(&url, &args));
    };
    let resume = |scope: &[&str]| {
        let mut args = vec!["resume", "--job", "overdue-accrual", "--by", "ops@test"];
        args.extend_from_slice(scope);
        assert_success(&cli(&url, &args));
    };
    let shard: &[&str] = &["--shards", "2", "--shard", "1"];
    for scope in [&[][..], shard] {
        pause(scope);
        for retry in [&["pending", "retry"][..], &["pending", "retry", "--dead"][..]] {
            let out = cli(&url, retry);
            let stderr = String::from_utf8_lossy(&out.stderr);
            let lines: Vec<&str> = stderr.lines().collect();
            assert_eq!(out.status.code(), Some(1), "{scope:?} {retry:?}: {stderr}");
            assert!(out.stdout.is_empty(), "{scope:?} {retry:?}: no report");
            assert_eq!(lines.len(), 1, "{scope:?} {retry:?}: {stderr}");
            for part in [
                "overdue-accrual",
                "is paused by ops@test",
                ": ledger audit",
                "--ignore-pause",
            ] {
                assert!(lines[0].contains(part), "{part:?} missing from {:?}", lines[0]);
            }
            assert_eq!(queue().await, untouched, "{scope:?} {retry:?} wrote nothing");
        }
        resume(scope);
    }

    pause(shard);
    let out = cli(&url, &["pending", "retry", "--ignore-pause"]);
    assert_success(&out);
    let r = report(&out);
    assert_eq!(
        (r["charged"].as_u64(), r["pending"].as_i64()),
        (Some(1), Some(0)),
        "{r}"
    );
    resume(shard);
    // Only the settlement is paused now.
    let out = cli(&url, &["pending", "retry", "--dead"]);
    assert_success(&out);
    let r = report(&out);
    assert_eq!(
        (r["resurrected"].as_u64(), r["charged"].as_u64()),
        (Some(1), Some(1)),
        "{r}"
    );
    let charged: Vec<i64> = sqlx::query_scalar("select loan_id from fine_ledger order by loan_id")
        .fetch_all(&pool)
        .await
        .expect("ledger");
    assert_eq!(charged, vec![1, 2]);
}

/// `pause` twice changes nothing the second time (same who, why, since; one history row); `resume` says what it
/// lifted, and a second `resume` that nothing was paused (exit 0); `--by` defaults to $USER@host; `runs` shows
/// the pause above its table and as a `record: pause` JSON line; bad scopes are refused with exit 2 and nothing
/// written.
#[sqlx::test(fixtures("default_policy"))]
async fn pause_and_resume_report_what_they_did_and_keep_a_history(pool: PgPool) {
    let url = database_url(&pool);
    let as_alice = |args: &[&str]| {
        let mut cmd = fine_settler(&url);
        cmd.env("USER", "alice").args(args);
        output(cmd)
    };
    let first = as_alice(&[
        "pause",
        "--job",
        "overdue-accrual",
        "--reason",
        "ledger migration",
    ]);
    assert_success(&first);
    let first = report(&first);
    assert_eq!(
        (first["paused"].as_bool(), first["already_paused"].as_bool()),
        (Some(true), Some(false))
    );
    assert!(
        first["by"].as_str().is_some_and(|b| b.starts_with("alice@")),
        "{first}"
    );
    let again = as_alice(&[
        "pause",
        "--job",
        "overdue-accrual",
        "--reason",
        "something else",
        "--by",
        "bob",
    ]);
    assert_success(&again);
    let again = report(&again);
    assert_eq!(
        (again["paused"].as_bool(), again["already_paused"].as_bool()),
        (Some(false), Some(true))
    );
    for field in ["by", "reason", "since"] {
        assert_eq!(again[field], first[field], "{field}: the first pause stays");
    }

    let runs = as_alice(&["runs"]);
    assert_success(&runs);
    let text = String::from_utf8_lossy(&runs.stdout);
    let top = text.lines().next().unwrap_or_default();
    assert!(
        top.starts_with("paused: overdue-accrual (every shard) is paused by alice@")
            && top.ends_with(": ledger migration"),
        "{text}"
    );
    let runs = as_alice(&["runs", "--json", "--job", "overdue-accrual"]);
    let line: serde_json::Value = serde_json::from_slice(&runs.stdout).expect("one JSON line");
    assert_eq!(
        (line["record"].as_str(), line["job"].as_str()),
        (Some("pause"), Some("overdue-accrual"))
    );
    let runs = as_alice(&["runs", "--json", "--job", "fine-settlement"]);
    assert!(runs.stdout.is_empty(), "another job's pause is not shown");

    let resumed = as_alice(&["resume", "--job", "overdue-accrual", "--by", "carol"]);
    assert_success(&resumed);
    let resumed = report(&resumed);
    assert_eq!(
        (
            resumed["resumed"].as_bool(),
            resumed["paused_by"].as_str(),
            resumed["by"].as_str()
        ),
        (Some(true), first["by"].as_str(), Some("carol"))
    );
    let twice = as_alice(&["resume", "--job", "overdue-accrual"]);
    assert_success(&twice);
    assert_eq!(report(&twice)["resumed"].as_bool(), Some(false));

    let history = pauses::history(&db(&pool), None).await.expect("history");
    let seen: Vec<(&str, &str, Option<&str>)> = history
        .iter()
        .map(|e| (e.event.as_str(), e.by.as_str(), e.reason.as_deref()))
        .collect();
    assert_eq!(
        seen,
        [
            (
                "paused",
                first["by"].as_str().unwrap_or_default(),
                Some("ledger migration")
            ),
            ("resumed", "carol", Some("ledger migration")),
        ]
    );
    assert!(history
        .iter()
        .all(|e| e.paused_at == history[0].paused_at && e.paused_at.is_some()));

    for bad in [
        &["pause", "--job", "nope"][..],
        &["pause", "--job", "fine-settlement", "--shards", "2"],
        &[
            "pause",
            "--job",
            "fine-settlement",
            "--shards",
            "2",
            "--shard",
            "2",
        ],
        &["resume", "--job", "fine-settlement", "--shard", "0"],
    ] {
        let out = as_alice(bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(!out.stderr.is_empty(), "{bad:?} says why");
    }
    assert_eq!(
        pauses::history(&db(&pool), None).await.expect("history").len(),
        2,
        "nothing written"
    );
    assert!(pauses::list(&db(&pool), None).await.expect("pauses").is_empty());
}

/// A pause that comes while a replica's pass works through several keys: the key in flight is handed back, and
/// the pass starts no further key of the job (they wait for `resume`).
#[sqlx::test(fixtures("default_policy"))]
async fn a_pause_mid_pass_starts_no_further_key_of_the_job(pool: PgPool) {
    let months = due_now(&pool, 3).await;
    for (i, m) in months.iter().enumerate() {
        let returned = *m - chrono::Duration::days(1);
        let due = returned - chrono::Duration::days(3);
        let loans: Vec<_> = (1..=8)
            .map(|j| {
                loan(
                    100 * (i as i64 + 1) + j,
                    &due.to_string(),
                    Some(&returned.to_string()),
                )
            })
            .collect();
        insert(&pool, &loans).await;
    }
    crate::helpers::slow_down(&pool, "update on loans", 0.2).await;
    let url = database_url(&pool);
    let mut cmd = fine_settler(&url);
    cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "2")
        .env("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "3")
        .env("FINE_SETTLER__CLAIM__LEASE", "30s")
        .args(["run", "--once"]);
    let child = std::thread::spawn(move || output(cmd));
    crate::helpers::wait_until("a committed batch", Duration::from_secs(20), || async {
        sqlx::query_scalar::<_, i64>("select count(*) from job_runs where cursor is not null")
            .fetch_one(&pool)
            .await
            .expect("count")
            > 0
    })
    .await;
    let out = cli(
        &url,
        &[
            "pause",
            "--job",
            "fine-settlement",
            "--reason",
            "freeze",
            "--by",
            "ops",
        ],
    );
    assert!(out.status.success());
    let out = child.join().expect("join");
    let rows: Vec<(NaiveDate, String, Option<String>)> =
        sqlx::query_as("select business_date, status, last_error from job_runs order by business_date")
            .fetch_all(&pool)
            .await
            .expect("rows");
    assert_eq!(
        rows.len(),
        1,
        "no key after the paused one was claimed: {rows:?} {out:?}"
    );
    assert!(
        rows[0]
            .2
            .as_deref()
            .is_some_and(|e| e.starts_with("paused: freeze")),
        "{rows:?}"
    );
    // At most the batch in flight and the next one commit after the pause.
    let after: i64 = sqlx::query_scalar(
        "select count(*) from loans where fine_settled_at > (select paused_at from job_pauses)",
    )
    .fetch_one(&pool)
    .await
    .expect("settled after the pause");
    assert!(after <= 4, "{after} loans settled after the pause");
}

/// A paused accrual charges nothing from the daemon either: its compensation pass waits for `resume`, as `accrue`
/// refuses before its own.
#[sqlx::test(fixtures("default_policy"))]
async fn a_paused_accrual_s_queue_is_not_compensated_by_the_daemon(pool: PgPool) {
    let url = database_url(&pool);
    insert(&pool, &[loan(7, "2026-01-01", None)]).await;
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, next_attempt_at)
         values (7, '2026-02-01', 100, now() - interval '1 hour')",
    )
    .execute(&pool)
    .await
    .expect("pending");
    let out = cli(
        &url,
        &[
            "pause",
            "--job",
            "overdue-accrual",
            "--reason",
            "freeze",
            "--by",
            "ops",
        ],
    );
    assert!(out.status.success());
    let tick = || {
        let mut cmd = fine_settler(&url);
        cmd.env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
            .env("FINE_SETTLER__SETTLEMENT__ENABLED", "false")
            .args(["run", "--once"]);
        output(cmd)
    };
    let out = tick();
    assert!(out.status.success(), "{out:?}");
    let counts = || async {
        let ledger: i64 = sqlx::query_scalar("select count(*) from fine_ledger")
            .fetch_one(&pool)
            .await
            .expect("ledger");
        let pending: i64 = sqlx::query_scalar("select count(*) from fine_pending")
            .fetch_one(&pool)
            .await
            .expect("pending");
        (ledger, pending)
    };
    assert_eq!(counts().await, (0, 1));
    let out = cli(&url, &["resume", "--job", "overdue-accrual", "--by", "ops"]);
    assert!(out.status.success());
    assert!(tick().status.success());
    assert_eq!(counts().await.1, 0, "compensated after resume");
}
