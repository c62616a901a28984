//! The library's closed days: `calendar close` / `open` / `list`, their refusals (a bad range, a month already
//! settled), the ordinals that make counting closed days two index probes, and the loans a change to a past day
//! queues for the accrual's re-check.

use std::process::Output;

use chrono::{Duration, NaiveDate};
use sqlx::PgPool;

use crate::helpers::{assert_success, d, database_url, fine_settler, insert, loan, output, report};

/// Runs `fine-settler calendar ARGS` against the test's database.
fn calendar(pool: &PgPool, args: &[&str]) -> Output {
    let mut cmd = fine_settler(&database_url(pool));
    cmd.arg("calendar").args(args);
    output(cmd)
}

/// The one line on stderr of a refused command, which must have exited 2.
fn refusal(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(lines.len(), 1, "{stderr}");
    lines[0].to_string()
}

/// (day, ordinal) of every closed day.
async fn closed(pool: &PgPool) -> Vec<(NaiveDate, i64)> {
    sqlx::query_as("select day, ordinal from library_closed_days order by day")
        .fetch_all(pool)
        .await
        .expect("closed days")
}

async fn queued(pool: &PgPool) -> Vec<i64> {
    sqlx::query_scalar("select distinct loan_id from fine_loan_changes order by 1")
        .fetch_all(pool)
        .await
        .expect("queue")
}

/// Today in the default zone, by the database clock.
async fn today(pool: &PgPool) -> NaiveDate {
    sqlx::query_scalar("select (now() at time zone 'Asia/Shanghai')::date")
        .fetch_one(pool)
        .await
        .expect("today")
}

/// Bad ranges are one line naming the value, exit 2, nothing written; a close and an open change exactly the
/// days not already so, number the closed days in order after every change, and `list` shows them.
#[sqlx::test(fixtures("default_policy"))]
async fn close_open_and_list_keep_the_days_numbered_and_refuse_bad_ranges(pool: PgPool) {
    let to_before = refusal(&calendar(
        &pool,
        &[
            "close",
            "--from",
            "2030-01-10",
            "--to",
            "2030-01-09",
            "--reason",
            "x",
        ],
    ));
    assert!(to_before.contains("--to 2030-01-09"), "{to_before}");
    let too_long = refusal(&calendar(
        &pool,
        &[
            "close",
            "--from",
            "2030-01-01",
            "--to",
            "2040-01-02",
            "--reason",
            "x",
        ],
    ));
    assert!(too_long.contains("ten years"), "{too_long}");
    let open_long = refusal(&calendar(
        &pool,
        &["open", "--from", "2030-01-01", "--to", "2041-01-01"],
    ));
    assert!(open_long.contains("--to 2041-01-01"), "{open_long}");
    // PostgreSQL's first and last days: no library calendar reaches them, and the settled-month check cannot
    // compute their month — refused as values, not failed as statements.
    for (flag, day) in [
        ("--from", "-4713-11-24"),
        ("--from", "-5000-01-01"),
        ("--to", "+10000-01-01"),
    ] {
        let given = format!("{flag}={day}");
        let mut args = vec!["close", "--from=9999-06-01", "--reason", "x"];
        if flag == "--from" {
            args[1] = &given;
        } else {
            args.push(&given);
        }
        let far = refusal(&calendar(&pool, &args));
        assert!(far.contains(&format!("{flag} {day}")), "{far}");
    }
    // --reason is required to close: clap's refusal.
    assert_eq!(
        calendar(&pool, &["close", "--from", "2030-01-01"]).status.code(),
        Some(2)
    );
    assert!(closed(&pool).await.is_empty(), "a refusal writes nothing");

    let week = calendar(
        &pool,
        &[
            "close",
            "--from",
            "2030-12-24",
            "--to",
            "2030-12-26",
            "--reason",
            "holidays",
            "--by",
            "ops",
        ],
    );
    assert_success(&week);
    assert_eq!(report(&week)["days"].as_array().map(Vec::len), Some(3));
    let earlier = calendar(&pool, &["close", "--from", "2030-12-01", "--reason", "snow"]);
    assert_success(&earlier);
    let again = calendar(&pool, &["close", "--from", "2030-12-25", "--reason", "other"]);
    assert_success(&again);
    assert_eq!(
        report(&again)["days"],
        serde_json::json!([]),
        "a closed day stays as it was"
    );
    assert_eq!(
        closed(&pool).await,
        [
            (d("2030-12-01"), 1),
            (d("2030-12-24"), 2),
            (d("2030-12-25"), 3),
            (d("2030-12-26"), 4)
        ]
    );
    let opened = calendar(&pool, &["open", "--from", "2030-12-24"]);
    assert_success(&opened);
    assert_eq!(report(&opened)["days"], serde_json::json!(["2030-12-24"]));
    assert_eq!(
        closed(&pool).await,
        [(d("2030-12-01"), 1), (d("2030-12-25"), 2), (d("2030-12-26"), 3)]
    );
    let through: Vec<i64> = sqlx::query_scalar(
        "select fine_settler_closed_through(d) from unnest('{2030-11-30,2030-12-01,2030-12-24,2030-12-31}'::date[]) d",
    )
    .fetch_all(&pool)
    .await
    .expect("closed through");
    assert_eq!(through, [0, 1, 1, 3]);

    let list = calendar(
        &pool,
        &["list", "--from", "2030-12-02", "--to", "2030-12-31", "--json"],
    );
    assert_success(&list);
    let stdout = String::from_utf8_lossy(&list.stdout).to_string();
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert_eq!(rows[0]["day"], "2030-12-25");
    assert_eq!(rows[0]["reason"], "holidays");
    assert_eq!(rows[0]["created_by"], "ops");
    assert_success(&calendar(&pool, &["list"]));
}

/// A change to a day inside a month whose settlement has a key (any shard) is refused, naming the month: exit 2,
/// nothing written. A day of a later month is not.
#[sqlx::test(fixtures("default_policy"))]
async fn a_change_inside_a_settled_month_is_refused(pool: PgPool) {
    sqlx::query(
        "insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch, lease_until)
         values ('fine-settlement', '2026-10-31', 2, 1, 'SUCCESS', 'test', 1, now())",
    )
    .execute(&pool)
    .await
    .expect("a settled key");
    let line = refusal(&calendar(
        &pool,
        &[
            "close",
            "--from",
            "2026-10-05",
            "--to",
            "2026-11-02",
            "--reason",
            "snow",
        ],
    ));
    assert!(
        line.contains("2026-10-31") && line.contains("shard 1 of 2"),
        "{line}"
    );
    assert!(closed(&pool).await.is_empty(), "nothing written");
    sqlx::query("insert into library_closed_days (day, reason) values ('2026-10-05', 'by hand')")
        .execute(&pool)
        .await
        .expect("close by hand");
    let line = refusal(&calendar(
        &pool,
        &["open", "--from", "2026-10-01", "--to", "2026-10-31"],
    ));
    assert!(line.contains("2026-10-31"), "{line}");
    assert_eq!(closed(&pool).await.len(), 1, "nothing opened");
    assert_success(&calendar(
        &pool,
        &["close", "--from", "2026-11-02", "--reason", "snow"],
    ));
}

/// Closing or opening a day already over queues every loan out and overdue on it for the accrual's re-check
/// (and none other); a day still to come queues nothing.
#[sqlx::test(fixtures("default_policy"))]
async fn a_change_to_a_past_day_queues_the_loans_overdue_on_it(pool: PgPool) {
    let past = today(&pool).await - Duration::days(3);
    let day = |k: i64| (past + Duration::days(k)).to_string();
    insert(
        &pool,
        &[
            loan(1, &day(-5), None),           // out, overdue on the day
            loan(2, &day(-5), Some(&day(0))),  // returned on the day: still owed it
            loan(3, &day(-5), Some(&day(-1))), // returned before it
            loan(4, &day(0), None),            // due on the day: not overdue yet
            loan(5, &day(-9), Some(&day(2))),  // returned after it
        ],
    )
    .await;
    sqlx::query("delete from fine_loan_changes")
        .execute(&pool)
        .await
        .expect("empty queue");
    let future = (today(&pool).await + Duration::days(5)).to_string();
    assert_success(&calendar(
        &pool,
        &["close", "--from", &future, "--reason", "planned"],
    ));
    assert!(
        queued(&pool).await.is_empty(),
        "a day to come changes no charge yet"
    );

    let closed_day = calendar(&pool, &["close", "--from", &day(0), "--reason", "snow"]);
    assert_success(&closed_day);
    assert_eq!(report(&closed_day)["loans_queued"], 3);
    assert_eq!(queued(&pool).await, [1, 2, 5]);
    sqlx::query("delete from fine_loan_changes")
        .execute(&pool)
        .await
        .expect("empty queue");
    assert_success(&calendar(&pool, &["open", "--from", &day(0)]));
    assert_eq!(queued(&pool).await, [1, 2, 5]);
}
