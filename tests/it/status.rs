//! The status page of running replicas: `/status.json` as keys go from RUNNING (with their progress) to SUCCESS
//! across shards, 503 when the database cannot be read, and `/status` rendered by a real headless Chromium.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use chrono::NaiveDate;
use serde_json::Value;
use sqlx::PgPool;

use crate::{
    daemon::http_get,
    helpers::{
        d, daemon, database_url, db, due_now, free_port, insert, loan, seed_run, slow_down, stop, wait_until,
    },
};

/// `n` loans returned (3 days late) on the day before `month_end`, ids 1..=n.
async fn load_month(pool: &PgPool, month_end: NaiveDate, n: i64) {
    let returned = month_end - chrono::Duration::days(1);
    let due = returned - chrono::Duration::days(3);
    let loans: Vec<_> = (1..=n)
        .map(|id| loan(id, &due.to_string(), Some(&returned.to_string())))
        .collect();
    insert(pool, &loans).await;
}

async fn status_json(port: u16) -> Value {
    let (code, body) = http_get(port, "/status.json").await;
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("/status.json is not JSON ({e}): {body}"))
}

/// The settlement cell of `date` for shard `shard` of `shards`.
fn cell(status: &Value, date: NaiveDate, shards: i64, shard: i64) -> Option<Value> {
    status["jobs"]
        .as_array()?
        .iter()
        .find(|j| j["job"] == "fine-settlement")?["keys"]
        .as_array()?
        .iter()
        .find(|k| k["business_date"] == date.to_string() && k["shards"] == shards && k["shard"] == shard)
        .cloned()
}

async fn owner_of(pool: &PgPool, date: NaiveDate, shards: i32, shard: i32) -> String {
    sqlx::query_scalar(
        "select owner from job_runs where job_name = 'fine-settlement' and business_date = $1
           and shards = $2 and shard = $3",
    )
    .bind(date)
    .bind(shards)
    .bind(shard)
    .fetch_one(pool)
    .await
    .expect("owner")
}

fn listen(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

#[sqlx::test]
async fn status_json_follows_every_shard_s_keys_from_running_to_success(pool: PgPool) {
    let month = due_now(&pool, 1).await[0];
    load_month(&pool, month, 200).await;
    // A key far outside the window that never succeeded, under another shard count: shown, as abandoned.
    seed_run(
        &pool,
        "fine-settlement",
        d("2020-01-31"),
        "FAILED",
        "old-replica",
        3,
        "0 s",
    )
    .await;
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at, status)
         values (7, '2026-11-20', 100, 10, 'charge rejected: <b>', now(), 'DEAD'),
                (8, '2026-11-21', 100, 1, null, now() + interval '1 hour', 'PENDING')",
    )
    .execute(&pool)
    .await
    .expect("queue rows");
    slow_down(&pool, "update on loans", 0.02).await;
    let url = database_url(&pool);
    let ports = [free_port(), free_port()];
    let replicas: Vec<_> = (0..2)
        .map(|s| {
            daemon(
                &url,
                s,
                2,
                &[
                    ("FINE_SETTLER__HTTP__LISTEN", &listen(ports[s as usize])),
                    ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
                    ("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "10"),
                ],
            )
        })
        .collect();

    // Shard 0, mid-run, as replica 1 sees it: epoch, owner, lease and progress.
    let deadline = Instant::now() + Duration::from_secs(30);
    let running = loop {
        let status = status_json(ports[1]).await;
        let shard0 = cell(&status, month, 2, 0).unwrap_or(Value::Null);
        if shard0["status"] == "RUNNING" && shard0["progress"]["scanned"].as_i64().unwrap_or(0) > 0 {
            break shard0;
        }
        assert!(
            Instant::now() < deadline,
            "shard 0 never RUNNING with progress: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(running["epoch"], 1);
    assert_eq!(running["owner"], owner_of(&pool, month, 2, 0).await);
    let lease = running["lease_left_s"].as_f64().expect("lease");
    assert!(
        lease > 0.0 && lease <= 3.0,
        "a 3 s lease, renewed by each batch: {lease}"
    );
    let progress = &running["progress"];
    assert_eq!(
        progress["scanned"].as_i64().expect("scanned") + progress["to_do"].as_i64().expect("to do"),
        100,
        "rows done + rows still to do = the shard's month: {running}"
    );
    assert_eq!(running["in_window"], true);
    assert_eq!(running["last_error"], Value::Null);

    sqlx::query("drop trigger slow_down on loans")
        .execute(&pool)
        .await
        .expect("drop trigger");
    wait_until(
        "both shards SUCCESS on the page",
        Duration::from_secs(30),
        || async {
            let status = status_json(ports[0]).await;
            (0..2).all(|s| cell(&status, month, 2, s).is_some_and(|c| c["status"] == "SUCCESS"))
        },
    )
    .await;
    let status = status_json(ports[0]).await;
    for s in 0..2 {
        let done = cell(&status, month, 2, s).expect("cell");
        assert_eq!(done["progress"], Value::Null, "no progress for a finished key");
        assert_eq!(done["lease_left_s"], 0.0);
        assert_eq!(done["owner"], owner_of(&pool, month, 2, s as i32).await);
    }
    let old = cell(&status, d("2020-01-31"), 1, 0).expect("the abandoned key is shown");
    assert_eq!(
        (&old["status"], &old["abandoned"], &old["epoch"], &old["owner"]),
        (
            &Value::from("FAILED"),
            &Value::from(true),
            &Value::from(3),
            &Value::from("old-replica")
        )
    );
    let settlement = &status["jobs"][0];
    assert_eq!(settlement["window"], serde_json::json!([month.to_string()]));
    assert_eq!(
        settlement["shards"],
        serde_json::json!([{"shards": 1, "shard": 0}, {"shards": 2, "shard": 0}, {"shards": 2, "shard": 1}])
    );
    let replica = &status["replica"];
    assert_eq!(
        (replica["shard"].as_i64(), replica["shards"].as_i64()),
        (Some(0), Some(2))
    );
    assert_eq!(replica["owner"], owner_of(&pool, month, 2, 0).await);
    assert_eq!(replica["schedule"], "fixed-rate every 300ms");
    assert!(
        replica["last_tick"].is_string() && replica["last_progress"].is_string(),
        "{replica}"
    );
    assert!(
        replica["clock_skew_s"].as_f64().is_some_and(|s| s.abs() < 2.0),
        "{replica}"
    );
    let queue = &status["queue"];
    assert_eq!(
        (queue["pending"].as_i64(), queue["dead"].as_i64()),
        (Some(1), Some(1))
    );
    assert_eq!(queue["pending_due"], 0);
    assert_eq!(queue["oldest_dead"][0]["loan_id"], 7);
    assert_eq!(queue["oldest_dead"][0]["last_error"], "charge rejected: <b>");
    for r in replicas {
        assert_eq!(stop(r).await.0, Some(0));
    }
}

#[sqlx::test]
async fn the_status_routes_answer_503_within_seconds_when_the_database_cannot_be_read(pool: PgPool) {
    let url = database_url(&pool);
    let port = free_port();
    let replica = daemon(&url, 0, 1, &[("FINE_SETTLER__HTTP__LISTEN", &listen(port))]);
    wait_until("the page answers", Duration::from_secs(15), || async {
        http_get(port, "/status.json").await.0 == 200
    })
    .await;
    // An operator's lock that the page's statement must wait for.
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("lock table job_runs in access exclusive mode")
        .execute(&mut *tx)
        .await
        .expect("lock");
    for path in ["/status.json", "/status"] {
        let started = Instant::now();
        let (code, body) = http_get(port, path).await;
        let took = started.elapsed();
        assert_eq!(code, 503, "{path}: {body}");
        assert!(body.starts_with("status unavailable: "), "{path}: {body}");
        assert!(took < Duration::from_secs(5), "{path} took {took:?}");
    }
    tx.rollback().await.expect("unlock");
    assert_eq!(http_get(port, "/status").await.0, 200);
    assert_eq!(stop(replica).await.0, Some(0));
}

/// Loads `url` in headless Chromium; returns the DOM after load and the page's console messages. Fails, naming
/// the script that installs it, when Chromium is missing.
fn chromium_dom(url: &str, screenshot: Option<&Path>) -> (String, Vec<String>) {
    let profile = tempfile::tempdir().expect("profile dir");
    let mut cmd = Command::new("chromium");
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--enable-logging=stderr",
        "--v=0",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()));
    match screenshot {
        Some(path) => cmd
            .arg(format!("--screenshot={}", path.display()))
            .arg("--window-size=1280,900"),
        None => cmd.arg("--dump-dom"),
    };
    let out = cmd.arg(url).output().unwrap_or_else(|e| {
        panic!("cannot run chromium ({e}): scripts/test.sh installs it (Debian's chromium package)")
    });
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let console = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.contains(":CONSOLE") || l.contains("Uncaught"))
        .map(str::to_string)
        .collect();
    (String::from_utf8_lossy(&out.stdout).into_owned(), console)
}

/// The `<td>` of a cell in the DOM, by its id.
fn td<'a>(dom: &'a str, id: &str) -> &'a str {
    let start = dom
        .find(&format!("<td id=\"{id}\""))
        .unwrap_or_else(|| panic!("no cell {id} in:\n{dom}"));
    let end = dom[start..].find("</td>").map_or(dom.len(), |e| start + e);
    &dom[start..end]
}

#[sqlx::test]
async fn chromium_renders_the_status_page_as_keys_change(pool: PgPool) {
    let month = due_now(&pool, 1).await[0];
    load_month(&pool, month, 300).await;
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at, status)
         values (42, $1, 100, 10, 'charge rejected by trigger \"<ledger_guard>\"', now(), 'DEAD')",
    )
    .bind(month - chrono::Duration::days(3))
    .execute(&pool)
    .await
    .expect("a DEAD charge");
    slow_down(&pool, "update on loans", 0.05).await;
    let url = database_url(&pool);
    let port = free_port();
    let replica = daemon(
        &url,
        0,
        1,
        &[
            ("FINE_SETTLER__HTTP__LISTEN", &listen(port)),
            ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
            ("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "5"),
        ],
    );
    wait_until(
        "the key RUNNING with progress",
        Duration::from_secs(30),
        || async {
            let status = status_json(port).await;
            cell(&status, month, 1, 0).is_some_and(|c| c["progress"]["scanned"].as_i64().unwrap_or(0) > 0)
        },
    )
    .await;
    let page = format!("http://127.0.0.1:{port}/status");
    let id = format!("fine-settlement-{month}-1-0");
    // The screenshot, for people to look at, shows the key running.
    let shot = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join("status.png");
    let (dom, console) = tokio::task::spawn_blocking({
        let (page, shot) = (page.clone(), shot.clone());
        move || {
            let dom = chromium_dom(&page, None);
            let _ = chromium_dom(&page, Some(&shot));
            dom
        }
    })
    .await
    .expect("chromium");
    assert!(console.is_empty(), "console messages: {console:?}");
    let running = td(&dom, &id);
    assert!(running.contains("class=\"key RUNNING\""), "{running}");
    assert!(
        running.contains("<progress value=\"") && running.contains("max=\"300\""),
        "{running}"
    );
    assert!(
        running.contains("epoch 1") && running.contains(" s left"),
        "{running}"
    );
    assert!(dom.contains("fixed-rate every 300ms"), "the replica's schedule");
    assert!(dom.contains("<span id=\"dead\">1</span> DEAD"), "the queue");
    assert!(
        dom.contains("charge rejected by trigger \"&lt;ledger_guard&gt;\""),
        "the DEAD charge's error, as text"
    );
    let png = std::fs::read(&shot).expect("the screenshot was written");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "a real screenshot"
    );

    sqlx::query("drop trigger slow_down on loans")
        .execute(&pool)
        .await
        .expect("drop trigger");
    wait_until("the key SUCCESS", Duration::from_secs(30), || async {
        cell(&status_json(port).await, month, 1, 0).is_some_and(|c| c["status"] == "SUCCESS")
    })
    .await;
    let (dom, console) = tokio::task::spawn_blocking(move || chromium_dom(&page, None))
        .await
        .expect("chromium");
    assert!(console.is_empty(), "console messages: {console:?}");
    let done = td(&dom, &id);
    assert!(
        done.contains("class=\"key SUCCESS\"") && !done.contains("<progress"),
        "{done}"
    );
    assert_eq!(stop(replica).await.0, Some(0));
}

#[sqlx::test]
async fn running_keys_count_what_their_batches_still_have_to_do_after_the_cursor(pool: PgPool) {
    use fine_settler::store::status::{keys, AccrualPolicy};
    // Settlement, 2026-10-31, shard 0 of 2, cursor 10: unsettled even ids above 10 returned in October count;
    // loan 4 (below the cursor, left locked by a batch) does not, nor do odd ids, settled loans, other months.
    let mut loans: Vec<_> = (1..=30)
        .map(|id| loan(id, "2026-10-20", Some("2026-10-25")))
        .collect();
    loans.push(loan(40, "2026-09-20", Some("2026-09-25")));
    insert(&pool, &loans).await;
    sqlx::query("update loans set fine_settled_at = now() where id in (12, 14)")
        .execute(&pool)
        .await
        .expect("settle two");
    // Accrual day 2026-10-15, shard 0 of 1, cursor 100: loans 101..=110 due 2026-10-10 and still out; 103 is
    // charged, 104 queued, 105 returned before the day, 106 at the cap; with a grace of 2 days 107 (due
    // 2026-10-13) is not overdue yet.
    let mut accrual: Vec<_> = (101..=110).map(|id| loan(id, "2026-10-10", None)).collect();
    accrual.push(loan(99, "2026-10-10", None));
    insert(&pool, &accrual).await;
    sqlx::raw_sql(
        "update loans set returned_on = '2026-10-14' where id = 105;
         update loans set due_on = '2026-10-13' where id = 107;
         insert into fine_ledger (loan_id, accrual_date, amount_cents) values (103, '2026-10-15', 100),
                                                                            (106, '2026-10-01', 500);
         insert into fine_pending (loan_id, accrual_date, amount_cents, next_attempt_at)
             values (104, '2026-10-15', 100, now());
         insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch, lease_until, cursor,
                               scanned, updated)
         values ('fine-settlement', '2026-10-31', 2, 0, 'RUNNING', 'a', 1, now() + interval '1 minute', 10, 5, 5),
                ('overdue-accrual', '2026-10-15', 1, 0, 'RUNNING', 'b', 2, now() + interval '1 minute', 100, 1, 1),
                ('fine-settlement', '2026-09-30', 2, 0, 'SUCCESS', 'a', 1, now(), null, 1, 1);",
    )
    .execute(&pool)
    .await
    .expect("rows");
    let rows = keys(
        &db(&pool),
        d("2026-01-01"),
        AccrualPolicy {
            grace_days: 2,
            cap_cents: 500,
        },
    )
    .await
    .expect("status rows");
    let to_do: Vec<(&str, String, Option<i64>)> = rows
        .keys
        .iter()
        .map(|k| (k.job_name.as_str(), k.business_date.to_string(), k.to_do))
        .collect();
    assert_eq!(
        to_do,
        [
            // 16, 18, ..., 30: 8 loans.
            ("fine-settlement", "2026-10-31".to_string(), Some(8)),
            ("fine-settlement", "2026-09-30".to_string(), None),
            // 101, 102, 108, 109, 110.
            ("overdue-accrual", "2026-10-15".to_string(), Some(5)),
        ]
    );
    assert_eq!((rows.pending, rows.pending_due, rows.dead), (1, 1, 0));
}
