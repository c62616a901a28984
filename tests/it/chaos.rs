//! The chaos suite: real `fine-settler run` processes — 3 shards x 3 replicas, then 4 shards x 3 replicas — on a
//! private PostgreSQL loaded with several months of loans, while a seeded schedule injects SIGKILLs (each replica
//! restarted after a random pause), a zombie (SIGSTOP past its lease, SIGCONT after a peer took over), PostgreSQL
//! restarts, connection cuts through a TCP proxy, and forced reruns plus manual `settle`/`accrue` of the same
//! keys. Afterwards an oracle written in plain SQL checks that nothing was lost or charged twice.
//!
//! `scripts/test.sh --test it chaos` runs the short mode (CI). The long mode:
//! `FINE_SETTLER_CHAOS=long FINE_SETTLER_CHAOS_SEED=7 scripts/test.sh --test it chaos -- --nocapture`.

use std::{
    collections::BTreeMap,
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use chrono::NaiveDate;
use fine_settler::demo::{self, SplitMix64};
use sqlx::{postgres::PgPoolOptions, PgPool};
use tokio::net::{TcpListener, TcpStream};

use crate::{
    helpers::{fine_settler, insert, install_update_audit, slow_down},
    server::PrivateServer,
};

/// How hard to shake.
#[derive(Debug, Clone)]
struct Mode {
    name: &'static str,
    loans_per_month: u64,
    accrual_days: u32,
    /// Seconds each loan update and ledger insert sleeps (so that work is in flight while faults land).
    seconds_per_row: f64,
    kills: usize,
    zombies: usize,
    restarts: usize,
    cuts: usize,
    manual: usize,
    /// Faults land between these offsets from the start.
    window: (Duration, Duration),
    /// The shard count changes 3 -> 4 at this offset.
    reshard_at: Duration,
    /// How long the replicas get to finish after the last fault.
    settle_limit: Duration,
}

impl Mode {
    fn from_env() -> Mode {
        match std::env::var("FINE_SETTLER_CHAOS").as_deref() {
            Ok("long") => Mode {
                name: "long",
                loans_per_month: 12_000,
                accrual_days: 20,
                seconds_per_row: 0.015,
                kills: 24,
                zombies: 3,
                restarts: 4,
                cuts: 10,
                manual: 24,
                window: (Duration::from_secs(8), Duration::from_secs(300)),
                reshard_at: Duration::from_secs(20),
                settle_limit: Duration::from_secs(900),
            },
            _ => Mode {
                name: "short",
                loans_per_month: 2_500,
                accrual_days: 10,
                seconds_per_row: 0.015,
                kills: 6,
                zombies: 1,
                restarts: 2,
                cuts: 3,
                manual: 6,
                window: (Duration::from_secs(6), Duration::from_secs(45)),
                reshard_at: Duration::from_secs(8),
                settle_limit: Duration::from_secs(240),
            },
        }
    }
}

const ZONE: &str = "Asia/Shanghai";
const RATE: i64 = 100;
const LEASE: &str = "6s";
const BATCH_TIMEOUT: &str = "3s";
/// Loans whose ledger inserts a trigger rejects: their charges must end in fine_pending (DEAD), nowhere else.
const POISONED: usize = 4;

/// A TCP proxy in front of PostgreSQL whose connections the test can cut at any moment.
struct Proxy {
    port: u16,
    cut: tokio::sync::watch::Sender<u64>,
    active: Arc<AtomicU64>,
}

impl Proxy {
    async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let active = Arc::new(AtomicU64::new(0));
        let (tx, count) = (cut.clone(), active.clone());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let mut cut = tx.subscribe();
                let count = count.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                        return;
                    };
                    count.fetch_add(1, Ordering::SeqCst);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.changed() => {}
                    }
                    count.fetch_sub(1, Ordering::SeqCst);
                    // Both sockets drop here: the replica and the server each see their connection end,
                    // whatever was in flight.
                });
            }
        });
        Proxy { port, cut, active }
    }

    /// Cuts every connection open now; returns how many.
    fn cut_all(&self) -> u64 {
        let n = self.active.load(Ordering::SeqCst);
        self.cut.send_modify(|g| *g += 1);
        n
    }
}

/// One replica process slot: its shard, its URL (direct or through the proxy) and its log file.
struct Replica {
    shard: i32,
    shards: i32,
    url: String,
    log: PathBuf,
    child: Option<Child>,
    restart_at: Option<Instant>,
    starts: u32,
}

impl Replica {
    fn spawn(&mut self, mode: &Mode) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut cmd = fine_settler(&self.url);
        cmd.env("FINE_SETTLER__INSTANCE__SHARD", self.shard.to_string())
            .env("FINE_SETTLER__INSTANCE__SHARDS", self.shards.to_string())
            .env("FINE_SETTLER__SCHEDULE__PERIOD", "300ms")
            .env("FINE_SETTLER__SCHEDULE__DRAIN_TIMEOUT", "15s")
            .env("FINE_SETTLER__CLAIM__LEASE", LEASE)
            .env("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", BATCH_TIMEOUT)
            .env("FINE_SETTLER__DATABASE__MAX_CONNECTIONS", "2")
            .env("FINE_SETTLER__DATABASE__CONNECT_TIMEOUT", "2s")
            .env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "50")
            .env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
            .env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "50")
            .env(
                "FINE_SETTLER__ACCRUAL__CATCH_UP_DAYS",
                mode.accrual_days.to_string(),
            )
            .env("FINE_SETTLER__ACCRUAL__MAX_ATTEMPTS", "3")
            .env("FINE_SETTLER__ACCRUAL__RETRY_BACKOFF", "200ms")
            .env("FINE_SETTLER__ACCRUAL__RETRY_BACKOFF_MAX", "1s")
            .env("FINE_SETTLER__TIME__ZONE", ZONE)
            .arg("run")
            .stdout(Stdio::null())
            .stderr(log);
        self.child = Some(cmd.spawn().expect("spawn replica"));
        self.starts += 1;
        self.restart_at = None;
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

/// One line of progress: keys by status (final count), live claims, pending charges.
async fn progress(pool: &PgPool, started: Instant) {
    let row: Result<(i64, i64, i64, i64), _> = sqlx::query_as(
        "select (select count(*) from job_runs where shards = 4 and status = 'SUCCESS'),
                (select count(*) from job_runs where status = 'RUNNING' and lease_until > now()),
                (select count(*) from fine_pending where status = 'PENDING'),
                (select count(*) from fine_ledger)",
    )
    .fetch_one(pool)
    .await;
    if let Ok((success, running, pending, ledger)) = row {
        eprintln!(
            "chaos: {:>6.1}s  keys SUCCESS (4 shards) {success}, live claims {running}, pending {pending}, ledger rows {ledger}",
            started.elapsed().as_secs_f64()
        );
    }
}

/// Restarts the killed replicas whose pause is over.
fn restart_due(replicas: &mut [Replica], mode: &Mode) {
    for r in replicas.iter_mut() {
        if r.restart_at.is_some_and(|t| Instant::now() >= t) {
            r.spawn(mode);
        }
    }
}

fn kill(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status();
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Kill,
    Zombie,
    Restart,
    Cut,
    Manual,
}

/// The due business dates, computed in SQL from the database clock (independently of the daemon's calendar).
async fn due_dates(pool: &PgPool, days: u32) -> (Vec<NaiveDate>, Vec<NaiveDate>) {
    let months: Vec<NaiveDate> = sqlx::query_scalar(
        "select (date_trunc('month', (now() at time zone $1)::date) - make_interval(months => k - 1)
                 - interval '1 day')::date
         from generate_series(1, 3) k order by 1",
    )
    .bind(ZONE)
    .fetch_all(pool)
    .await
    .expect("due months");
    let accrual: Vec<NaiveDate> = sqlx::query_scalar(
        "select (now() at time zone $1)::date - k from generate_series(1, $2) k order by 1",
    )
    .bind(ZONE)
    .bind(days as i32)
    .fetch_all(pool)
    .await
    .expect("due days");
    (months, accrual)
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar::<_, Option<i64>>(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .unwrap_or(0)
}

/// Whether every due key of the 4-shard count is SUCCESS and every pending charge has reached its end (DEAD).
async fn finished(pool: &PgPool, months: &[NaiveDate], days: &[NaiveDate]) -> Result<bool, sqlx::Error> {
    let keys: i64 = sqlx::query_scalar(
        "select count(*) from job_runs where shards = 4 and status = 'SUCCESS'
           and ((job_name = 'fine-settlement' and business_date = any($1))
             or (job_name = 'overdue-accrual' and business_date = any($2)))",
    )
    .bind(months)
    .bind(days)
    .fetch_one(pool)
    .await?;
    let pending: i64 = sqlx::query_scalar("select count(*) from fine_pending where status = 'PENDING'")
        .fetch_one(pool)
        .await?;
    Ok(keys == 4 * (months.len() + days.len()) as i64 && pending == 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos() {
    let mode = Mode::from_env();
    let seed: u64 = std::env::var("FINE_SETTLER_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261130);
    let mut rng = SplitMix64::new(seed);
    let started = Instant::now();
    eprintln!("chaos: mode {} seed {seed}", mode.name);

    let server = PrivateServer::start(&["max_connections=150"]);
    let url = server.migrated_database("chaos").await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&url)
        .await
        .expect("connect");

    // Loans around the three due months and the current one, disjoint ids.
    let (months, days) = due_dates(&pool, mode.accrual_days).await;
    let current = *days.last().expect("days");
    for (i, month) in months.iter().chain([&current]).enumerate() {
        let spec = demo::DemoSpec {
            loans: mode.loans_per_month,
            seed: seed.wrapping_add(i as u64),
            month: *month,
            first_id: 1 + i as i64 * 1_000_000,
        };
        insert(&pool, &demo::loans(spec).collect::<Vec<_>>()).await;
    }
    sqlx::raw_sql("create table loans_before as select id, fine_cents from loans")
        .execute(&pool)
        .await
        .expect("snapshot");
    install_update_audit(&pool).await;
    // Poison a few loans that are overdue every accrual day (unreturned, due before the window).
    let poisoned: Vec<i64> = sqlx::query_scalar(
        "select id from loans where returned_on is null and due_on < $1 order by id limit $2",
    )
    .bind(days[0] - chrono::Duration::days(1))
    .bind(POISONED as i64)
    .fetch_all(&pool)
    .await
    .expect("poisoned");
    assert_eq!(poisoned.len(), POISONED);
    sqlx::raw_sql(&format!(
        "create function poison() returns trigger language plpgsql as $$
         begin raise exception 'loan % is poisoned by the chaos test', new.loan_id; end $$;
         create trigger poison before insert on fine_ledger for each row
           when (new.loan_id in ({})) execute function poison();",
        poisoned.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
    ))
    .execute(&pool)
    .await
    .expect("poison");
    slow_down(&pool, "update on loans", mode.seconds_per_row).await;
    sqlx::raw_sql(
        "create trigger slow_down before insert on fine_ledger for each row execute function slow_down();",
    )
    .execute(&pool)
    .await
    .expect("slow ledger");
    let loans = scalar(&pool, "select count(*) from loans").await;
    eprintln!(
        "chaos: {loans} loans; due months {months:?}; {} accrual days {}..{}; poisoned {poisoned:?}",
        days.len(),
        days[0],
        current
    );

    let proxy = Proxy::start(server.port()).await;
    let logs = tempfile::tempdir().expect("log dir");
    let make = |shard: i32, shards: i32, i: usize, proxied: bool| Replica {
        shard,
        shards,
        url: if proxied {
            url.replace(&format!(":{}/", server.port()), &format!(":{}/", proxy.port))
        } else {
            url.clone()
        },
        log: logs.path().join(format!("shards{shards}-shard{shard}-{i}.log")),
        child: None,
        restart_at: None,
        starts: 0,
    };
    // Phase A: 3 shards x 3 replicas; replica 0 of shard 0 goes through the proxy.
    let mut replicas: Vec<Replica> = (0..3)
        .flat_map(|s| (0..3).map(move |i| (s, i)))
        .map(|(s, i)| make(s, 3, i, s == 0 && i == 0))
        .collect();
    for r in &mut replicas {
        r.spawn(&mode);
    }

    // The fault schedule, from the seed.
    let (from, to) = mode.window;
    let span = (to - from).as_millis() as u64;
    let mut schedule: Vec<(Duration, Fault)> = Vec::new();
    for (fault, n) in [
        (Fault::Kill, mode.kills),
        (Fault::Zombie, mode.zombies),
        (Fault::Restart, mode.restarts),
        (Fault::Cut, mode.cuts),
        (Fault::Manual, mode.manual),
    ] {
        for _ in 0..n {
            // Zombies and restarts land in the first half, while work is certainly in flight; zombies after the
            // shard-count change, so that their peers keep running.
            let at = if matches!(fault, Fault::Zombie | Fault::Restart) {
                let start = if fault == Fault::Zombie {
                    mode.reshard_at + Duration::from_secs(1)
                } else {
                    from
                };
                start + Duration::from_millis(rng.below(span / 2))
            } else {
                from + Duration::from_millis(rng.below(span))
            };
            schedule.push((at, fault));
        }
    }
    schedule.sort();
    let mut injected: BTreeMap<&str, u64> = BTreeMap::new();
    let mut manual: Vec<(String, Child)> = Vec::new();
    let mut zombie_tasks = Vec::new();
    let frozen: Arc<std::sync::Mutex<Option<u32>>> = Arc::default();
    let mut resharded = false;
    let mut next = 0;

    let mut reported = Instant::now();
    while next < schedule.len() || !resharded {
        let now = started.elapsed();
        if reported.elapsed() >= Duration::from_secs(10) {
            reported = Instant::now();
            progress(&pool, started).await;
        }
        restart_due(&mut replicas, &mode);
        if !resharded && now >= mode.reshard_at {
            // 3 -> 4 shards: stop every replica of the old count (SIGTERM: they hand their keys back and exit
            // 0), then start 4 x 3 of the new one.
            for r in replicas.iter_mut() {
                if let Some(pid) = r.pid() {
                    kill(pid, "TERM");
                }
            }
            for r in replicas.iter_mut() {
                if let Some(mut child) = r.child.take() {
                    let status = child.wait().expect("wait");
                    assert_eq!(status.code(), Some(0), "old-count replica: {}", log_tail(&r.log));
                }
            }
            replicas = (0..4)
                .flat_map(|s| (0..3).map(move |i| (s, i)))
                .map(|(s, i)| make(s, 4, i, s == 0 && i == 0))
                .collect();
            for r in &mut replicas {
                r.spawn(&mode);
            }
            resharded = true;
            *injected.entry("shard count change 3 -> 4").or_default() += 1;
            continue;
        }
        let Some(&(at, fault)) = schedule.get(next) else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        if now < at {
            tokio::time::sleep((at - now).min(Duration::from_millis(100))).await;
            continue;
        }
        next += 1;
        match fault {
            Fault::Kill => {
                // Holding the lock: a zombie act cannot pick this replica while it is being killed.
                let guard = frozen.lock().expect("lock");
                let frozen_pid = *guard;
                let live: Vec<usize> = (0..replicas.len())
                    .filter(|&i| replicas[i].child.is_some() && replicas[i].pid() != frozen_pid)
                    .collect();
                if live.is_empty() {
                    continue;
                }
                let r = &mut replicas[live[rng.below(live.len() as u64) as usize]];
                let mut child = r.child.take().expect("live");
                let _ = child.kill();
                let _ = child.wait();
                r.restart_at = Some(Instant::now() + Duration::from_millis(200 + rng.below(1800)));
                drop(guard);
                *injected.entry("SIGKILL").or_default() += 1;
            }
            Fault::Zombie => {
                let candidates: Vec<Candidate> = replicas
                    .iter()
                    .filter_map(|r| r.pid().map(|pid| (pid, r.shard, r.shards, r.log.clone())))
                    .collect();
                zombie_tasks.push(tokio::spawn(zombie(
                    pool.clone(),
                    candidates,
                    frozen.clone(),
                    mode.settle_limit / 3,
                )));
            }
            Fault::Restart => {
                // While a batch is in flight: wait (restarting replicas meanwhile) for a live claim.
                let running = live_claims(&pool, &mut replicas, &mode, None).await;
                server.restart();
                eprintln!("chaos: PostgreSQL restarted with {running} keys RUNNING");
                *injected.entry("PostgreSQL restart").or_default() += 1;
                if running > 0 {
                    *injected
                        .entry("PostgreSQL restart with batches in flight")
                        .or_default() += 1;
                }
            }
            Fault::Cut => {
                // Mid-transaction: wait for the proxied replica to hold a live claim.
                let proxied = replicas
                    .iter()
                    .position(|r| r.url.contains(&format!(":{}/", proxy.port)));
                let pid = proxied.and_then(|i| replicas[i].pid());
                let running = live_claims(&pool, &mut replicas, &mode, pid).await;
                let n = proxy.cut_all();
                *injected.entry("connection cut (proxy)").or_default() += 1;
                *injected.entry("connections cut").or_default() += n;
                if running > 0 {
                    *injected
                        .entry("connection cut while its replica held a claim")
                        .or_default() += 1;
                }
            }
            Fault::Manual => {
                let shards = if resharded { 4 } else { 3 };
                let shard = rng.below(shards) as i32;
                let force = rng.below(2) == 0;
                let mut cmd = fine_settler(&url);
                let what = if rng.below(2) == 0 {
                    let m = months[rng.below(months.len() as u64) as usize];
                    cmd.args(["settle", "--business-date", &m.to_string()]);
                    format!("settle {m}")
                } else {
                    let d = days[rng.below(days.len() as u64) as usize];
                    // The deployment's accrual settings, as the replicas have them.
                    cmd.env("FINE_SETTLER__ACCRUAL__MAX_ATTEMPTS", "3")
                        .env("FINE_SETTLER__ACCRUAL__RETRY_BACKOFF", "200ms")
                        .env("FINE_SETTLER__ACCRUAL__RETRY_BACKOFF_MAX", "1s")
                        .args(["accrue", "--date", &d.to_string()]);
                    format!("accrue {d}")
                };
                cmd.env("FINE_SETTLER__CLAIM__LEASE", LEASE)
                    .env("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", BATCH_TIMEOUT)
                    .env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "50")
                    .env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "50")
                    .env("FINE_SETTLER__TIME__ZONE", ZONE)
                    .args(["--shard", &shard.to_string(), "--shards", &shards.to_string()]);
                if force {
                    cmd.arg("--force");
                }
                let what = format!(
                    "{what} shard {shard}/{shards}{}",
                    if force { " --force" } else { "" }
                );
                cmd.stdout(Stdio::piped()).stderr(Stdio::null());
                manual.push((what, cmd.spawn().expect("spawn manual run")));
                *injected
                    .entry(if force {
                        "forced rerun"
                    } else {
                        "manual settle/accrue"
                    })
                    .or_default() += 1;
            }
        }
    }

    // The zombies finish their act (replicas keep being restarted meanwhile).
    while !zombie_tasks
        .iter()
        .all(|t: &tokio::task::JoinHandle<_>| t.is_finished())
    {
        restart_due(&mut replicas, &mode);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut zombies: Vec<(String, NaiveDate, String)> = Vec::new();
    for task in zombie_tasks {
        if let Some(z) = task.await.expect("the zombie act panicked") {
            zombies.push(z);
            *injected
                .entry("zombie (SIGSTOP past the lease, SIGCONT)")
                .or_default() += 1;
        }
    }

    // Let the replicas finish (restarting any still paused), then stop them all.
    let deadline = Instant::now() + mode.settle_limit;
    loop {
        restart_due(&mut replicas, &mode);
        if reported.elapsed() >= Duration::from_secs(10) {
            reported = Instant::now();
            progress(&pool, started).await;
        }
        if finished(&pool, &months, &days).await.unwrap_or(false)
            && replicas.iter().all(|r| r.child.is_some())
        {
            break;
        }
        if Instant::now() > deadline {
            let states: Vec<(String, NaiveDate, i32, String, Option<String>)> = sqlx::query_as(
                "select job_name, business_date, shard, status, last_error from job_runs
                 where shards = 4 and status <> 'SUCCESS' order by 1, 2, 3",
            )
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
            panic!(
                "not finished after {:?}: {states:?}\n{}",
                mode.settle_limit,
                log_tail(&replicas[0].log)
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let work_done = started.elapsed();
    for r in &replicas {
        kill(r.pid().expect("live"), "TERM");
    }
    for r in replicas.iter_mut() {
        let status = r.child.take().expect("live").wait().expect("wait");
        assert_eq!(status.code(), Some(0), "final SIGTERM: {}", log_tail(&r.log));
    }
    let mut manual_outcomes: BTreeMap<String, u64> = BTreeMap::new();
    for (what, child) in manual {
        let out = child.wait_with_output().expect("manual run");
        let code = out.status.code();
        assert!(matches!(code, Some(0) | Some(1)), "{what}: exit {code:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or("{}"))
            .unwrap_or_else(|e| panic!("{what}: report {stdout:?}: {e}"));
        let outcome = report["outcome"].as_str().unwrap_or("none").to_string();
        assert!(
            ["settled", "skipped", "failed", "lease_lost"].contains(&outcome.as_str()),
            "{what}: {report}"
        );
        *manual_outcomes.entry(outcome).or_default() += 1;
    }

    // The zombies: each found its key taken over, committed nothing after that, and recorded the lost lease.
    for (owner, date, job) in &zombies {
        let lost = scalar(
            &pool,
            &format!(
                "select count(*) from job_run_attempts where owner = '{owner}' and event = 'lease_lost'
                   and job_name = '{job}' and business_date = '{date}'"
            ),
        )
        .await;
        assert!(
            lost >= 1,
            "zombie {owner} ({job} {date}) did not report a lost lease"
        );
    }

    // ---- The oracle: plain SQL, independent of the daemon's code. ----
    let mut violations: BTreeMap<&str, i64> = BTreeMap::new();
    let mut check = |name: &'static str, n: i64| {
        violations.insert(name, n);
    };
    let months_sql = months
        .iter()
        .map(|m| format!("'{m}'"))
        .collect::<Vec<_>>()
        .join(",");
    // Every loan returned in a settled month is settled with the policy's fine.
    check(
        "loan of a settled month unsettled or with the wrong fine",
        scalar(
            &pool,
            &format!(
                "select count(*) from loans
                 where (date_trunc('month', returned_on) + interval '1 month' - interval '1 day')::date
                       in ({months_sql})
                   and (fine_settled_at is null
                        or fine_cents <> greatest(0, returned_on - due_on) * {RATE})"
            ),
        )
        .await,
    );
    // Loans outside the settled months are untouched.
    check(
        "loan outside the settled months touched",
        scalar(
            &pool,
            &format!(
                "select count(*) from loans l join loans_before b using (id)
                 where (l.returned_on is null
                        or (date_trunc('month', l.returned_on) + interval '1 month' - interval '1 day')::date
                           not in ({months_sql}))
                   and (l.fine_settled_at is not null or l.fine_cents <> b.fine_cents)"
            ),
        )
        .await,
    );
    check(
        "loan updated more than once",
        scalar(&pool, "select count(*) from loan_updates where n > 1").await,
    );
    // Every key of the final count is SUCCESS.
    check(
        "key of the final count not SUCCESS",
        scalar(
            &pool,
            "select count(*) from job_runs where shards = 4 and status <> 'SUCCESS'",
        )
        .await,
    );
    // fine_pending holds only the poisoned loans, all DEAD.
    let poisoned_sql = poisoned.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    check(
        "pending charge of a loan the test did not poison, or not DEAD",
        scalar(
            &pool,
            &format!(
                "select count(*) from fine_pending where loan_id not in ({poisoned_sql}) or status <> 'DEAD'"
            ),
        )
        .await,
    );
    let dead = scalar(&pool, "select count(*) from fine_pending").await;
    let ledger_oracle = format!(
        "select l.id as loan_id, d::date as accrual_date, {RATE}::bigint as amount_cents
         from loans l, generate_series(date '{}', date '{}', interval '1 day') d
         where l.due_on < d::date and (l.returned_on is null or d::date <= l.returned_on)",
        days[0], current
    );
    // The ledger: exactly the oracle's charges minus the poisoned loans' (which wait, DEAD, in fine_pending).
    check(
        "ledger row the oracle does not have",
        scalar(
            &pool,
            &format!(
                "select count(*) from (select loan_id, accrual_date, amount_cents from fine_ledger
                                       except all ({ledger_oracle})) x"
            ),
        )
        .await,
    );
    check(
        "oracle charge missing from the ledger (not poisoned)",
        scalar(
            &pool,
            &format!(
                "select count(*) from (({ledger_oracle}) except all
                                       select loan_id, accrual_date, amount_cents from fine_ledger) x
                 where loan_id not in ({poisoned_sql})"
            ),
        )
        .await,
    );
    check(
        "poisoned charge neither in the ledger nor pending",
        scalar(
            &pool,
            &format!(
                "select count(*) from ({ledger_oracle}) o where o.loan_id in ({poisoned_sql})
                 and not exists (select 1 from fine_pending p where p.loan_id = o.loan_id
                                 and p.accrual_date = o.accrual_date)"
            ),
        )
        .await,
    );

    // The operator fixes the poisoned loans and retries the DEAD charges: the ledger becomes the oracle.
    sqlx::raw_sql("drop trigger poison on fine_ledger")
        .execute(&pool)
        .await
        .expect("unpoison");
    let mut retry = fine_settler(&url);
    retry.args(["pending", "retry", "--dead"]);
    let out = retry.output().expect("pending retry");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    check(
        "pending after the operator's retry",
        scalar(&pool, "select count(*) from fine_pending").await,
    );
    check(
        "ledger differs from the oracle after the retry",
        scalar(
            &pool,
            &format!(
                "select count(*) from ((select loan_id, accrual_date, amount_cents from fine_ledger
                                        except all ({ledger_oracle}))
                                       union all (({ledger_oracle}) except all
                                        select loan_id, accrual_date, amount_cents from fine_ledger)) x"
            ),
        )
        .await,
    );

    let settled = scalar(
        &pool,
        "select count(*) from loans where fine_settled_at is not null",
    )
    .await;
    let ledger = scalar(&pool, "select count(*) from fine_ledger").await;
    let keys = scalar(&pool, "select count(*) from job_runs").await;
    let takeovers = scalar(
        &pool,
        "select count(*) from job_run_attempts where event = 'takeover'",
    )
    .await;
    let lost = scalar(
        &pool,
        "select count(*) from job_run_attempts where event = 'lease_lost'",
    )
    .await;
    let starts: u32 = replicas.iter().map(|r| r.starts).sum();
    eprintln!(
        "chaos: {} mode, seed {seed}: work done after {work_done:.1?}, total {:.1?}",
        mode.name,
        started.elapsed()
    );
    eprintln!("chaos: faults injected: {injected:?}");
    eprintln!("chaos: manual runs by outcome: {manual_outcomes:?}; replica starts (final count): {starts}");
    eprintln!(
        "chaos: checked {loans} loans ({settled} settled), {ledger} ledger rows, {dead} DEAD charges of {POISONED} \
         poisoned loans, {keys} job_runs keys; {takeovers} takeovers, {lost} lost leases"
    );
    eprintln!("chaos: invariants: {violations:?}");
    let broken: Vec<_> = violations.iter().filter(|(_, n)| **n != 0).collect();
    assert!(broken.is_empty(), "invariants violated: {broken:?}");
    assert!(injected.get("SIGKILL").copied().unwrap_or(0) >= mode.kills as u64);
    assert!(injected.get("PostgreSQL restart").copied().unwrap_or(0) >= mode.restarts as u64);
    assert!(
        injected
            .get("PostgreSQL restart with batches in flight")
            .copied()
            .unwrap_or(0)
            >= 2,
        "restarts must hit work in flight: {injected:?}"
    );
    assert!(
        injected
            .get("connection cut while its replica held a claim")
            .copied()
            .unwrap_or(0)
            >= 1,
        "a cut must hit a replica mid-run: {injected:?}"
    );
    assert_eq!(
        injected
            .get("zombie (SIGSTOP past the lease, SIGCONT)")
            .copied()
            .unwrap_or(0),
        mode.zombies as u64,
        "a zombie found no replica holding a claim"
    );
}

/// The number of live claims (of the replica `pid`, or of anyone), waiting up to 20 s for one to appear while
/// restarting killed replicas.
async fn live_claims(pool: &PgPool, replicas: &mut [Replica], mode: &Mode, pid: Option<u32>) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        restart_due(replicas, mode);
        let owner = pid.map(|p| format!("%:{p}:%")).unwrap_or_else(|| "%".into());
        let n: i64 = sqlx::query_scalar(
            "select count(*) from job_runs where status = 'RUNNING' and lease_until > now() and owner like $1",
        )
        .bind(owner)
        .fetch_one(pool)
        .await
        .unwrap_or(0);
        if n > 0 || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A live replica as a zombie candidate: pid, shard, shard count, log.
type Candidate = (u32, i32, i32, PathBuf);

/// Freezes a replica that holds a claim (one of `candidates`, with a live peer of its shard) until a peer has
/// taken its key over, then thaws it and waits for it to record the lost lease. Runs beside the fault loop, which
/// leaves the frozen pid (in `frozen`) alone. Returns the zombie's owner and key.
async fn zombie(
    pool: PgPool,
    candidates: Vec<Candidate>,
    frozen: Arc<std::sync::Mutex<Option<u32>>>,
    limit: Duration,
) -> Option<(String, NaiveDate, String)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let running: Vec<(String, NaiveDate, i32, i32, String, i64)> = sqlx::query_as(
            "select job_name, business_date, shards, shard, owner, epoch from job_runs
             where status = 'RUNNING' and lease_until > now()",
        )
        .fetch_all(&pool)
        .await
        .unwrap_or_default();
        for (job, date, shards, shard, owner, epoch) in running {
            let pid: u32 = owner.split(':').nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
            let Some((_, _, _, log)) = candidates.iter().find(|c| c.0 == pid) else {
                continue;
            };
            if !candidates
                .iter()
                .any(|c| c.1 == shard && c.2 == shards && c.0 != pid)
            {
                continue;
            }
            {
                // Under the lock the fault loop kills under: the pid is alive now and nobody kills it while frozen.
                let mut frozen = frozen.lock().expect("lock");
                let alive = std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("fine-settler"));
                if !alive {
                    continue;
                }
                *frozen = Some(pid);
                kill(pid, "STOP");
            }
            // A peer of the same shard takes the key over once the lease has expired and the peer's tick comes
            // back to the key (a tick works through every due key of the shard in turn, so that can take a while
            // when the peers are busy with other keys).
            let taken = Instant::now() + limit;
            let mut overtaken = false;
            while Instant::now() < taken {
                let now_epoch: Option<i64> = sqlx::query_scalar(
                    "select epoch from job_runs where job_name = $1 and business_date = $2 and shards = $3
                     and shard = $4",
                )
                .bind(&job)
                .bind(date)
                .bind(shards)
                .bind(shard)
                .fetch_optional(&pool)
                .await
                .ok()
                .flatten();
                if now_epoch.is_some_and(|e| e > epoch) {
                    overtaken = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            kill(pid, "CONT");
            *frozen.lock().expect("lock") = None;
            assert!(
                overtaken,
                "no peer took over {job} {date} {shard}/{shards} from the frozen {owner}: {}",
                log_tail(log)
            );
            // Thawed, its next batch (or its finish) meets the new epoch: it must commit nothing and say so.
            let reported = Instant::now() + Duration::from_secs(30);
            loop {
                let lost: i64 = sqlx::query_scalar(
                    "select count(*) from job_run_attempts where owner = $1 and event = 'lease_lost'",
                )
                .bind(&owner)
                .fetch_one(&pool)
                .await
                .unwrap_or(0);
                if lost > 0 {
                    break;
                }
                assert!(
                    Instant::now() < reported,
                    "the thawed {owner} never reported its lost lease: {}",
                    log_tail(log)
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            eprintln!(
                "chaos: zombie {owner} ({job} {date} shard {shard}/{shards}, epoch {epoch}) taken over, thawed, \
                 reported lease lost"
            );
            return Some((owner, date, job));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}
