//! The status page of running replicas: `/status.json` as keys go from RUNNING (with their progress) to SUCCESS
//! across shards, 503 when the database cannot be read, `/status` rendered by a real headless Chromium, and page
//! loads by the hundred: the probes still answer, the page opens one database session, and with no qualifying
//! host one search for a host runs at a time.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use chrono::NaiveDate;
use serde_json::Value;
use sqlx::PgPool;

use crate::{
    daemon::http_get,
    helpers::{
        d, daemon, database_url, db, due_now, fine_settler, free_port, insert, loan, seed_run, slow_down,
        spawn, stop, wait_until, StderrLog,
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

#[sqlx::test(fixtures("default_policy"))]
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

#[sqlx::test(fixtures("default_policy"))]
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

/// GET `path` on a new connection: the status code (0 when the connection failed) and how long the answer took.
async fn timed_get(port: u16, path: &str) -> (u16, Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let started = Instant::now();
    let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return (0, started.elapsed());
    };
    let request = format!("GET {path} HTTP/1.1\r\nhost: localhost\r\n\r\n");
    let mut response = Vec::new();
    if stream.write_all(request.as_bytes()).await.is_err() || stream.read_to_end(&mut response).await.is_err()
    {
        return (0, started.elapsed());
    }
    let code = String::from_utf8_lossy(&response)
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, started.elapsed())
}

/// `n` connections to `port` that never send a byte.
async fn idle_connections(port: u16, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut idle = Vec::with_capacity(n);
    for _ in 0..n {
        idle.push(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connect"),
        );
    }
    idle
}

/// `n` page loads at once; the status codes they got.
fn page_loads(port: u16, n: usize) -> tokio::task::JoinHandle<Vec<u16>> {
    tokio::spawn(async move {
        let loads: Vec<_> = (0..n)
            .map(|_| tokio::spawn(async move { timed_get(port, "/status.json").await.0 }))
            .collect();
        let mut codes = Vec::with_capacity(n);
        for load in loads {
            codes.push(load.await.expect("load"));
        }
        codes
    })
}

/// The probes, one after the other, until `done`: each one's status code and the longest answer.
async fn probe_until(
    port: u16,
    done: &tokio::task::JoinHandle<Vec<u16>>,
) -> (Vec<(&'static str, u16)>, Duration) {
    let (mut answers, mut longest) = (Vec::new(), Duration::ZERO);
    while !done.is_finished() || answers.len() < 9 {
        for path in ["/healthz", "/readyz", "/metrics"] {
            let (code, took) = timed_get(port, path).await;
            answers.push((path, code));
            longest = longest.max(took);
        }
    }
    (answers, longest)
}

/// `fine-settler run` (300 ms period) under `ulimit -n limit`, with the environment [`fine_settler`] gives it and
/// `extra`; stderr piped.
fn with_file_limit(url: &str, limit: u32, extra: &[(&str, &str)]) -> crate::helpers::Running {
    let binary = fine_settler(url);
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", &format!("ulimit -n {limit} && exec \"$0\" run")])
        .arg(binary.get_program());
    for (k, v) in binary.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cmd.env("FINE_SETTLER__SCHEDULE__PERIOD", "300ms")
        .envs(extra.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    spawn(&mut cmd)
}

/// Samples of (the status page's database sessions, the replica's open file descriptors).
type Samples = Arc<Mutex<Vec<(i64, usize)>>>;

/// Every 20 ms until aborted: the status page's database sessions (in `pg_stat_activity`) and the open file
/// descriptors of process `pid`.
fn sample_sessions_and_files(pool: &PgPool, pid: u32) -> (tokio::task::JoinHandle<()>, Samples) {
    let samples = Arc::new(Mutex::new(Vec::new()));
    let (pool, sink, fds) = (pool.clone(), samples.clone(), format!("/proc/{pid}/fd"));
    let sampler = tokio::spawn(async move {
        loop {
            let sessions: i64 = sqlx::query_scalar(
                // This test's database only: replicas of other tests running at the same time have the name too.
                "select count(*) from pg_stat_activity
                 where application_name = 'fine-settler run 0/1 status' and datname = current_database()",
            )
            .fetch_one(&pool)
            .await
            .expect("sessions");
            let open = std::fs::read_dir(&fds).map_or(0, |d| d.count());
            sink.lock().expect("lock").push((sessions, open));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    (sampler, samples)
}

/// A bounded flood on loopback — 100 connections that never send a byte and 300 page loads at once — against a
/// replica whose file descriptors are limited to 256: the probes keep answering within 3 s (the Kubernetes
/// probes' timeout), every page load gets the page or a quick "busy", the page never holds more than its one
/// database session, the replica's open file descriptors stay under what its systemd unit's `LimitNOFILE` is
/// sized for, and nothing fails to be accepted for want of a file descriptor.
#[sqlx::test(fixtures("default_policy"))]
async fn a_flooded_page_leaves_the_probes_answering_and_opens_one_database_session(pool: PgPool) {
    let url = database_url(&pool);
    let port = free_port();
    let mut replica = with_file_limit(&url, 256, &[("FINE_SETTLER__HTTP__LISTEN", &listen(port))]);
    let log = StderrLog::collect(&mut replica);
    wait_until("the page answers", Duration::from_secs(20), || async {
        http_get(port, "/status.json").await.0 == 200
    })
    .await;

    let (sampler, samples) = sample_sessions_and_files(&pool, replica.id());
    let idle = idle_connections(port, 100).await;
    let loads = page_loads(port, 300);
    let (answers, longest) = probe_until(port, &loads).await;
    let codes = loads.await.expect("loads");
    sampler.abort();
    drop(idle);

    let failed: Vec<_> = answers.iter().filter(|(_, code)| *code != 200).collect();
    assert!(failed.is_empty(), "probes that failed: {failed:?}");
    assert!(longest < Duration::from_secs(3), "a probe took {longest:?}");
    let count = |code: u16| codes.iter().filter(|c| **c == code).count();
    assert_eq!(count(200) + count(503), 300, "page loads: {codes:?}");
    assert!(count(200) > 0, "no page load got the page");
    let samples = samples.lock().expect("lock").clone();
    let most = samples.iter().map(|s| s.0).max().unwrap_or(0);
    assert!(most <= 1, "the page held {most} database sessions at once");
    let most_fds = samples.iter().map(|s| s.1).max().unwrap_or(0);
    // The listener's places and one newcomer, the listener, four jobs' connections and four others (the tick's,
    // the page's, a host search of each pool), and at most 16 of the process's own.
    let bound = fine_settler::http::MAX_CONNECTIONS + 2 + 8 + 16;
    assert!(
        most_fds <= bound,
        "{most_fds} file descriptors open (bound {bound})"
    );
    println!(
        "flood: {} probes, longest {longest:?}; page loads: {} 200, {} 503; status sessions at most {most}; \
         open file descriptors at most {most_fds}",
        answers.len(),
        count(200),
        count(503)
    );
    assert_eq!(stop(replica).await.0, Some(0));
    let log = log.finish();
    assert!(
        !log.contains("http accept failed") && !log.contains("Too many open files"),
        "{log}"
    );
}

/// A PostgreSQL host that never answers: it reads each connection's startup message (declining TLS), keeps the
/// connection open without a word until the client gives up, and counts the connections by application name —
/// those open now, the most open at once, and all.
#[derive(Debug, Default)]
struct SilentHost {
    /// Per application name: (open now, most open at once, all).
    seen: Mutex<HashMap<String, (u32, u32, u32)>>,
}

impl SilentHost {
    async fn start() -> (Arc<SilentHost>, u16) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let host = Arc::new(SilentHost::default());
        let counts = host.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(counts.clone().hold(stream));
            }
        });
        (host, port)
    }

    async fn hold(self: Arc<Self>, mut stream: tokio::net::TcpStream) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let Some(application) = startup_application_name(&mut stream).await else {
            return;
        };
        self.count(&application, |(open, most, all)| {
            (open + 1, most.max(open + 1), all + 1)
        });
        let mut rest = [0u8; 256];
        while matches!(stream.read(&mut rest).await, Ok(1..)) {}
        let _ = stream.shutdown().await;
        self.count(&application, |(open, most, all)| (open - 1, most, all));
    }

    fn count(&self, application: &str, f: impl FnOnce((u32, u32, u32)) -> (u32, u32, u32)) {
        let mut seen = self.seen.lock().expect("lock");
        let entry = seen.entry(application.to_string()).or_default();
        *entry = f(*entry);
    }

    /// (most open at once, all) of `application`'s connections.
    fn of(&self, application: &str) -> (u32, u32) {
        let seen = self.seen.lock().expect("lock");
        seen.get(application)
            .map_or((0, 0), |(_, most, all)| (*most, *all))
    }
}

/// The `application_name` of a connection's startup message, after declining an SSLRequest.
async fn startup_application_name(stream: &mut tokio::net::TcpStream) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let len = usize::try_from(stream.read_u32().await.ok()?).ok()?;
        let mut message = vec![0u8; len.checked_sub(4)?];
        stream.read_exact(&mut message).await.ok()?;
        if message.get(..4)? == 80877103u32.to_be_bytes() {
            stream.write_all(b"N").await.ok()?;
            continue;
        }
        let fields: Vec<&[u8]> = message.get(4..)?.split(|b| *b == 0).collect();
        let at = fields.iter().position(|f| *f == b"application_name")?;
        return Some(String::from_utf8_lossy(fields.get(at + 1)?).into_owned());
    }
}

/// No qualifying host (a failover window: the first host down, the second not answering): 200 page loads at
/// once and then 200 more get a quick 503, the replica waiting for its database is live but not ready, and the
/// page's searches for a host reach the hosts one at a time — not one search per failed load.
#[tokio::test]
async fn with_no_qualifying_host_page_loads_search_for_one_one_at_a_time() {
    let (silent, silent_port) = SilentHost::start().await;
    let url = format!(
        "postgres://fine_settler@127.0.0.1:{},127.0.0.1:{silent_port}/libraryd?target_session_attrs=read-write&connect_timeout=1",
        free_port()
    );
    let port = free_port();
    let mut replica = daemon(&url, 0, 1, &[("FINE_SETTLER__HTTP__LISTEN", &listen(port))]);
    let log = StderrLog::collect(&mut replica);
    wait_until("the listener answers", Duration::from_secs(20), || async {
        http_get(port, "/healthz").await.0 == 200
    })
    .await;
    let started = Instant::now();
    for _ in 0..2 {
        let loads = page_loads(port, 200);
        let (answers, longest) = probe_until(port, &loads).await;
        let codes = loads.await.expect("loads");
        assert!(codes.iter().all(|c| *c == 503), "page loads: {codes:?}");
        for (path, code) in answers {
            let expected = if path == "/readyz" { 503 } else { 200 };
            assert_eq!(code, expected, "{path} while the replica waits for its database");
        }
        // `/readyz` asks the database, 2 s at most.
        assert!(longest < Duration::from_secs(5), "a probe took {longest:?}");
    }
    let took = started.elapsed();
    let (most, all) = silent.of("fine-settler run 0/1 status");
    println!("no qualifying host: 400 page loads in {took:?}; the page's connections to the silent host: {all}, at most {most} at once");
    assert!(all >= 1, "the page looked for a host");
    assert!(most <= 1, "{most} searches for a host at once");
    // One read at a time, each failing after the first host's timeout (1 s): at most one search per second.
    assert!(u64::from(all) <= took.as_secs() + 1, "{all} searches in {took:?}");
    assert_eq!(stop(replica).await.0, Some(0));
    drop(log);
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

#[sqlx::test(fixtures("default_policy"))]
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

#[sqlx::test(fixtures("default_policy"))]
async fn running_keys_count_what_their_batches_still_have_to_do_after_the_cursor(pool: PgPool) {
    use fine_settler::store::status::keys;
    crate::helpers::set_policy(
        &pool,
        fine_settler::fine::FinePolicy::new(100, 2, 500).expect("policy"),
    )
    .await;
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
    // charged, 104 queued, 105 returned before the day; with a grace of 2 days 107 (due 2026-10-13) is not
    // overdue yet. 106 holds a charge of 500 on another day, but the day's amount is a function of the loan
    // (its 3rd chargeable day: 100 under the cap of 500), so it has a charge to write (and the batch relieves
    // the other day first).
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
    let rows = keys(&db(&pool), d("2026-01-01")).await.expect("status rows");
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
            // 101, 102, 106, 108, 109, 110.
            ("overdue-accrual", "2026-10-15".to_string(), Some(6)),
        ]
    );
    assert_eq!((rows.pending, rows.pending_due, rows.dead), (1, 1, 0));
}
