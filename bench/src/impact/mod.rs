//! The impact section: what settlement costs a libraryd-like load running beside it. A `pgbench` load (a point
//! read of one random loan and a row-locking update of another, by id, at a fixed rate) runs on a fresh copy of
//! the template through each phase — the load alone, `settle` with its defaults, the single set-based `update`
//! of each month, `settle` throttled to a quarter of the rate the defaults reached — and its per-transaction
//! latency log gives the load's p50 / p99 / max in each. Beside it, the WAL each way of settling writes per row,
//! measured without the load (whose own WAL would count) on fresh copies after a checkpoint.
//!
//! Every phase settles the same four months one after another (`MONTHS`), as libraryd's month-end would if
//! settlement had fallen behind: enough rows that the settle phases last several seconds, so that a p99 of the
//! load rests on some thousands of its transactions rather than a few hundred.
//!
//! Two more kinds of phase put those figures in proportion. `settle` under `throttle.max_commit_latency` (a
//! budget of 1.5 × the idle phase's p99) shows what the latency-keyed pace keeps and the rate it finds. And each
//! `settle` phase has a *control* ([`control`]): a plain writer producing the WAL bytes per second that phase
//! wrote, for as long as it ran, beside the same load — what writing that volume costs the load on this server
//! whoever writes it. Where the load's sessions were while each phase ran (on CPU, waiting on WAL, on a lock) is
//! sampled from `pg_stat_activity`.

mod control;
mod report;

use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use sqlx::PgPool;

use crate::{binary, per_sec, Bench, Error, SettleJob, Via};

/// The business dates settled in every phase, one after another: the four month ends whose months hold most of
/// the generated returns (loans cluster around October; late returns reach into November).
const MONTHS: [&str; 4] = ["2026-08-31", "2026-09-30", "2026-10-31", "2026-11-30"];

/// The load, one transaction of libraryd's: show a member one loan, and record something on another (a no-op
/// `update` of `member_id`, a column libraryd owns). The update takes the same row lock settlement's update
/// needs, writes a new row version as libraryd's updates do, and changes nothing settlement reads or computes.
const LOAD_SCRIPT: &str = "\\set id random(1, :loans)
\\set other random(1, :loans)
begin;
select id, member_id, book_id, borrowed_on, due_on, returned_on, fine_cents, fine_settled_at from loans where id = :id;
update loans set member_id = member_id where id = :other;
commit;
";

/// How often the lock-wait sampler looks at `pg_stat_activity`.
const SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// The throttle setting of the throttled phase, as an environment override of the `settle` process.
const THROTTLE_KEY: &str = "FINE_SETTLER__THROTTLE__MAX_ROWS_PER_SECOND";

/// The setting of the latency-keyed phase.
const BUDGET_KEY: &str = "FINE_SETTLER__THROTTLE__MAX_COMMIT_LATENCY";

/// The latency-keyed phase's budget, in idle p99s.
const BUDGET_OF_IDLE_P99: f64 = 1.5;

/// The latency-keyed phase starts no month after this long: at a low rate the four months could take hours.
const GOVERNED_DEADLINE: Duration = Duration::from_secs(150);

/// The longest control phase: long enough for a p99 of some thousands of the load's transactions.
const CONTROL_MAX: Duration = Duration::from_secs(40);

/// How the impact section runs.
#[derive(Debug, Clone)]
pub(crate) struct ImpactArgs {
    /// The `pgbench` binary.
    pub pgbench: PathBuf,
    /// Load transactions per second (`pgbench -R`).
    pub rate: u32,
    /// Load sessions (`pgbench -c`).
    pub clients: u32,
    /// How long the idle phase lasts.
    pub idle: Duration,
    /// The load runs this long before a phase starts.
    pub warmup: Duration,
    /// ... and this long after it ends, so that the transactions scheduled in the phase finish.
    pub cooldown: Duration,
}

/// What runs beside the load.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Nothing: the load alone.
    Idle,
    /// `fine-settler settle` of each month, defaults.
    Settle,
    /// The single set-based `update` of each month.
    Statement,
    /// `settle` of each month with `throttle.max_rows_per_second` at this.
    Throttled(u64),
    /// `settle` of each month with `throttle.max_commit_latency` at this (no month started after
    /// [`GOVERNED_DEADLINE`]).
    Governed(Duration),
    /// The plain writer at this many bytes of WAL per second, for this long: the control of a `settle` phase.
    Control {
        of: Of,
        bytes_per_sec: f64,
        secs: Duration,
        /// The WAL one of its rows costs.
        row_bytes: f64,
    },
}

/// Which `settle` phase a control stands beside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Of {
    Settle,
    Throttled,
    Governed,
}

impl Of {
    fn label(self) -> &'static str {
        match self {
            Of::Settle => "defaults",
            Of::Throttled => "throttled to a quarter",
            Of::Governed => "max_commit_latency",
        }
    }
}

impl Phase {
    /// The control of the `settle` phase `p` (`of`): the WAL per second its settlement wrote (its rows at
    /// `wal`'s bytes per row, over its duration), for as long as it ran (5 s to [`CONTROL_MAX`]).
    fn control_of(of: Of, p: &PhaseResult, wal: Wal, row_bytes: f64) -> Phase {
        Phase::Control {
            of,
            bytes_per_sec: wal.per_row() * p.settled as f64 / p.wall.as_secs_f64().max(0.001),
            secs: p.wall.clamp(Duration::from_secs(5), CONTROL_MAX),
            row_bytes,
        }
    }

    fn label(self, batch: u32) -> String {
        match self {
            Phase::Idle => "idle: the load alone".into(),
            Phase::Settle => format!("`settle`, defaults (batches of {batch})"),
            Phase::Statement => "single statement: one set-based `update` per month".into(),
            Phase::Throttled(cap) => format!("`settle`, throttled to {cap} rows/s"),
            Phase::Governed(budget) => format!(
                "`settle`, `throttle.max_commit_latency` = {:.1} ms",
                budget.as_secs_f64() * 1000.0
            ),
            Phase::Control {
                of, bytes_per_sec, ..
            } => format!(
                "control of {}: a plain writer at {:.1} MB/s of WAL",
                of.label(),
                bytes_per_sec / 1e6
            ),
        }
    }
}

/// One transaction of the load, from pgbench's per-transaction log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LoadTx {
    client: u32,
    /// When pgbench scheduled it (`-R`), µs since the Unix epoch.
    scheduled_us: i64,
    /// From its scheduled start to its end, µs (what pgbench logs as `time`; it includes the schedule lag).
    latency_us: i64,
}

/// The transactions of pgbench's per-transaction log `text` (`client_id transaction_no time script_no
/// time_epoch time_us [schedule_lag]`, `time` in µs and the time stamp that of the transaction's end). The
/// scheduled start is the end less `time`, which with `-R` is counted from the scheduled start.
fn parse_log(text: &str) -> Result<Vec<LoadTx>, Error> {
    let mut txs = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> Result<i64, Error> {
            fields
                .get(i)
                .and_then(|f| f.parse::<i64>().ok())
                .ok_or_else(|| format!("pgbench log line {line:?}: field {} is not a number", i + 1).into())
        };
        if fields.len() < 6 {
            return Err(format!(
                "pgbench log line {line:?} has {} fields, not 6 or more",
                fields.len()
            )
            .into());
        }
        let latency_us = num(2)?;
        let ended_us = num(4)? * 1_000_000 + num(5)?;
        txs.push(LoadTx {
            client: u32::try_from(num(0)?)?,
            scheduled_us: ended_us - latency_us,
            latency_us,
        });
    }
    Ok(txs)
}

/// The load's latency over one phase.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Latency {
    transactions: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

/// Nearest-rank percentiles of `latencies_us`; `None` when empty.
fn latency(mut latencies_us: Vec<i64>) -> Option<Latency> {
    if latencies_us.is_empty() {
        return None;
    }
    latencies_us.sort_unstable();
    let n = latencies_us.len();
    let rank = |p: f64| latencies_us[((p * n as f64).ceil() as usize).clamp(1, n) - 1] as f64 / 1000.0;
    Some(Latency {
        transactions: n,
        p50_ms: rank(0.50),
        p99_ms: rank(0.99),
        max_ms: latencies_us[n - 1] as f64 / 1000.0,
    })
}

/// The transactions of `txs` scheduled in `[from_us, to_us)`, and whether every client had gone on past
/// `to_us` (then all it was scheduled to run in the window had ended before the load was stopped: each session
/// runs its transactions in the order of their schedule).
fn in_window(txs: &[LoadTx], from_us: i64, to_us: i64) -> (Vec<i64>, bool) {
    let latencies = txs
        .iter()
        .filter(|t| (from_us..to_us).contains(&t.scheduled_us))
        .map(|t| t.latency_us)
        .collect();
    let mut clients: Vec<u32> = txs.iter().map(|t| t.client).collect();
    clients.sort_unstable();
    clients.dedup();
    let caught_up = !clients.is_empty()
        && clients.iter().all(|c| {
            txs.iter()
                .filter(|t| t.client == *c)
                .any(|t| t.scheduled_us >= to_us)
        });
    (latencies, caught_up)
}

/// One phase as measured.
#[derive(Debug, Clone)]
struct PhaseResult {
    phase: Phase,
    wall: Duration,
    load: Latency,
    /// The load's rate over the phase (transactions scheduled in it per second).
    load_rate: f64,
    /// Whether the load had run every transaction scheduled in the phase when it was stopped.
    caught_up: bool,
    waits: LockWaits,
    /// The commit latency probe of `throttle.max_commit_latency`, taken by the benchmark every
    /// [`PROBE_EVERY`] through the phase on a connection of its own: how its p99 follows the load's.
    probe: Option<Latency>,
    /// The share of the machine's CPU that was busy during the phase (everything on it, not only the benchmark).
    cpu: Option<f64>,
    /// Rows settled, and settlement's own time for them (`elapsed_ms` of the runs; the statements' time).
    settled: i64,
    settle_ms: u64,
    /// Months settled (the latency-keyed phase may stop early).
    months: usize,
    /// A control's rows written.
    control_rows: i64,
}

impl PhaseResult {
    fn rows_per_sec(&self) -> f64 {
        per_sec(self.settled, self.settle_ms)
    }
}

/// The WAL one way of settling writes (all months, no load, fresh copy after a checkpoint).
#[derive(Debug, Clone, Copy)]
struct Wal {
    rows: i64,
    bytes: i64,
}

impl Wal {
    fn per_row(self) -> f64 {
        self.bytes as f64 / self.rows.max(1) as f64
    }
}

/// Everything the impact section measured.
#[derive(Debug, Clone)]
pub(crate) struct Impact {
    args: ImpactArgs,
    loans: u64,
    batch: u32,
    idle: PhaseResult,
    settle: PhaseResult,
    statement: PhaseResult,
    /// The throttled phase, or why it could not run (the `settle` binary does not know the setting).
    throttled: Result<PhaseResult, String>,
    /// The latency-keyed phase (its budget below), or why it could not run.
    governed: Result<PhaseResult, String>,
    budget: Duration,
    /// The control of each `settle` phase that ran, in the order defaults, throttled, latency-keyed.
    controls: Vec<PhaseResult>,
    /// The WAL one row of the control's writer costs.
    row_bytes: f64,
    wal_settle: Wal,
    wal_statement: Wal,
}

/// A running load: pgbench and the folder of its script, output and logs.
#[derive(Debug)]
struct Load {
    child: Child,
    dir: PathBuf,
}

impl Load {
    fn start(args: &ImpactArgs, url: &str, loans: u64, dir: &Path) -> Result<Self, Error> {
        std::fs::create_dir_all(dir)?;
        let script = dir.join("load.sql");
        std::fs::write(&script, LOAD_SCRIPT)?;
        let child = Command::new(&args.pgbench)
            .args(["--no-vacuum", "--protocol", "prepared", "--file"])
            .arg(&script)
            .arg("--define")
            .arg(format!("loans={loans}"))
            .arg("--rate")
            .arg(args.rate.to_string())
            .arg("--client")
            .arg(args.clients.to_string())
            // The load is stopped when the phase is over (see `stop`); this only bounds a forgotten one.
            .args(["--time", "3600", "--log", "--log-prefix"])
            .arg(dir.join("tx"))
            .arg(url)
            .stdout(std::fs::File::create(dir.join("stdout"))?)
            .stderr(std::fs::File::create(dir.join("stderr"))?)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", args.pgbench.display()))?;
        Ok(Load {
            child,
            dir: dir.to_path_buf(),
        })
    }

    /// Fails when pgbench has already exited (a bad script, no connection): nothing would be measured.
    fn check_running(&mut self) -> Result<(), Error> {
        if let Some(status) = self.child.try_wait()? {
            let stderr = std::fs::read_to_string(self.dir.join("stderr")).unwrap_or_default();
            return Err(format!("pgbench exited early ({status}): {}", stderr.trim()).into());
        }
        Ok(())
    }

    /// Ends the load and returns its transactions. pgbench has no way to end a run before its `--time`, so its
    /// sessions are terminated: each client then stops ("aborted"), and pgbench closes its logs and exits 2.
    /// What it wrote to stderr before that is a failure of the load itself (a client that aborted on its own);
    /// what it writes after is the termination's doing.
    async fn stop(mut self, admin: &PgPool, db: &str) -> Result<Vec<LoadTx>, Error> {
        self.check_running()?;
        let before = std::fs::read_to_string(self.dir.join("stderr"))?;
        if let Some(line) = before.lines().find(|l| !l.trim().is_empty()) {
            return Err(format!("the pgbench load failed: {line}").into());
        }
        sqlx::query(
            "select pg_terminate_backend(pid) from pg_stat_activity
             where datname = $1 and application_name = 'pgbench'",
        )
        .bind(db)
        .execute(admin)
        .await?;
        let mut child = self.child;
        tokio::task::spawn_blocking(move || child.wait()).await??;
        let mut txs = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let is_log = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("tx."));
            if is_log {
                txs.extend(parse_log(&std::fs::read_to_string(&path)?)?);
            }
        }
        std::fs::remove_dir_all(&self.dir)?;
        Ok(txs)
    }
}

/// What the sampler saw of the load's sessions: its lock waits, and where its active sessions were.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct LockWaits {
    /// The longest lock wait, ms.
    longest_ms: f64,
    /// How many statements of the load were seen waiting on a lock (each counted once).
    statements: usize,
    /// Active sessions of the load seen, over all samples: all of them, and of those, on CPU (no wait event),
    /// waiting for WAL (`IO:WALSync`, `IO:WALWrite`, `LWLock:WALWrite`, `LWLock:WALInsert`), on a lock
    /// (`Lock:*`), or waiting on anything else.
    active: usize,
    cpu: usize,
    wal: usize,
    lock: usize,
    other: usize,
}

impl LockWaits {
    /// A share of the active samples, in %.
    fn share(&self, n: usize) -> f64 {
        100.0 * n as f64 / self.active.max(1) as f64
    }
}

/// One active session of the load: pid, its statement's start (µs), ms since then, wait event type and name.
type Sample = (i32, i64, f64, Option<String>, Option<String>);

/// The load's sessions, sampled from `pg_stat_activity` every [`SAMPLE_EVERY`] until `stop` is set. A lock
/// wait: a waiting session's statement started at `query_start`, and the wait can have lasted at most since then
/// (a point read or update spends microseconds before it waits); a statement is told by its session and
/// `query_start`. Every active session of the load is also counted by where it is (see [`LockWaits`]).
async fn lock_waits(pool: PgPool, db: String, stop: Arc<AtomicBool>) -> Result<LockWaits, Error> {
    let mut w = LockWaits::default();
    let mut seen = std::collections::HashSet::new();
    while !stop.load(Ordering::Relaxed) {
        let active: Vec<Sample> = sqlx::query_as(
            "select pid, (extract(epoch from query_start) * 1000000)::int8,
                    (extract(epoch from clock_timestamp() - query_start) * 1000)::float8,
                    wait_event_type, wait_event
             from pg_stat_activity
             where datname = $1 and application_name = 'pgbench' and state = 'active'",
        )
        .bind(&db)
        .fetch_all(&pool)
        .await?;
        for (pid, started, waited, kind, event) in active {
            w.active += 1;
            match (kind.as_deref(), event.as_deref()) {
                (None, _) => w.cpu += 1,
                (Some("Lock"), _) => {
                    w.lock += 1;
                    seen.insert((pid, started));
                    w.longest_ms = w.longest_ms.max(waited);
                }
                (Some("IO"), Some("WALSync" | "WALWrite"))
                | (Some("LWLock"), Some("WALWrite" | "WALInsert")) => w.wal += 1,
                _ => w.other += 1,
            }
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    pool.close().await;
    w.statements = seen.len();
    Ok(w)
}

/// How often the benchmark probes the commit latency (as a run under `throttle.max_commit_latency` does).
const PROBE_EVERY: Duration = Duration::from_millis(100);

/// The write of the product's commit latency probe (`probe` of `src/store/latency.rs`: `begin`, `select 1`,
/// this, `commit`, four round trips).
const PROBE_WRITE: &str = "select pg_logical_emit_message(true, 'fine-settler-probe', '')";

/// The product's probe, timed every [`PROBE_EVERY`] until `stop` is set: each probe's latency in µs.
async fn probes(pool: PgPool, stop: Arc<AtomicBool>) -> Result<Vec<i64>, Error> {
    let mut conn = pool.acquire().await?;
    let mut latencies = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        sqlx::Executor::execute(&mut *tx, "select 1").await?;
        sqlx::Executor::execute(&mut *tx, PROBE_WRITE).await?;
        tx.commit().await?;
        latencies.push(i64::try_from(started.elapsed().as_micros())?);
        tokio::time::sleep(PROBE_EVERY).await;
    }
    drop(conn);
    pool.close().await;
    Ok(latencies)
}

/// The machine's CPU time so far, from the first line of `/proc/stat`: (busy, total) in clock ticks, busy
/// being all but idle and iowait. `None` where there is no `/proc/stat`.
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|t| t.parse().ok())
        .collect::<Option<_>>()?;
    let total: u64 = ticks.iter().sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some((total - idle, total))
}

/// The share of the machine's CPU time (all cores) that was busy between two [`cpu_ticks`].
fn cpu_busy(from: Option<(u64, u64)>, to: Option<(u64, u64)>) -> Option<f64> {
    let ((b0, t0), (b1, t1)) = (from?, to?);
    (t1 > t0).then(|| (b1 - b0) as f64 / (t1 - t0) as f64)
}

fn unix_us() -> Result<i64, Error> {
    Ok(i64::try_from(
        SystemTime::now().duration_since(UNIX_EPOCH)?.as_micros(),
    )?)
}

impl Bench {
    /// Whether the `settle` binary accepts the setting `key` at `value` (it validates its configuration before
    /// it connects); otherwise its own message.
    fn setting_available(&self, key: &str, value: &str) -> Result<(), String> {
        let out = Command::new(binary().map_err(|e| e.to_string())?)
            .arg("check-config")
            .env(key, value)
            .env("DATABASE_URL", format!("{}/postgres", self.server))
            .env("FINE_SETTLER__LOG__LEVEL", "warn")
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
        }
    }

    /// Settles every month of [`MONTHS`] on `db` one after another, as `phase` says: (rows, settlement ms,
    /// months). The latency-keyed phase starts no month after [`GOVERNED_DEADLINE`].
    async fn settle_months(&self, db: &str, phase: Phase, batch: u32) -> Result<(i64, u64, usize), Error> {
        let mut rows = 0;
        let mut ms = 0;
        let mut months = 0;
        let started = Instant::now();
        for month in MONTHS {
            if matches!(phase, Phase::Governed(_)) && started.elapsed() >= GOVERNED_DEADLINE {
                break;
            }
            months += 1;
            match phase {
                Phase::Idle | Phase::Control { .. } => {}
                Phase::Statement => {
                    let (n, secs) = self.limit_of(db, month, 1).await?;
                    rows += i64::try_from(n)?;
                    ms += (secs * 1000.0).round() as u64;
                }
                Phase::Settle | Phase::Throttled(_) | Phase::Governed(_) => {
                    let env = match phase {
                        Phase::Throttled(cap) => vec![(THROTTLE_KEY, cap.to_string())],
                        Phase::Governed(budget) => vec![(BUDGET_KEY, format!("{}us", budget.as_micros()))],
                        _ => Vec::new(),
                    };
                    let job = SettleJob {
                        business_date: month,
                        shards: 1,
                        batch,
                        force: false,
                        env: &env,
                    };
                    let s = self.settle_job(&Via::direct(&self.server), db, &job).await?;
                    rows += s.updated;
                    ms += s.elapsed_ms;
                }
            }
        }
        Ok((rows, ms, months))
    }

    /// One phase on a fresh copy of `template`: the load starts, warms up, `phase` runs, the load cools down
    /// and stops; the phase's figures are those of the load's transactions scheduled while `phase` ran.
    async fn impact_phase(
        &self,
        template: &str,
        args: &ImpactArgs,
        loans: u64,
        batch: u32,
        phase: Phase,
    ) -> Result<PhaseResult, Error> {
        let db = self.copy(template, "fsb_impact").await?;
        let writer = match phase {
            Phase::Control { .. } => {
                let pool = self.pool(&db, 1).await?;
                control::prepare(&pool).await?;
                Some(pool)
            }
            _ => None,
        };
        let dir = std::env::temp_dir().join(format!("fsb-load-{}-{}", std::process::id(), unix_us()?));
        let mut load = Load::start(args, &format!("{}/{db}", self.server), loans, &dir)?;
        tokio::time::sleep(args.warmup).await;
        load.check_running()?;

        let stop = Arc::new(AtomicBool::new(false));
        let sampler = tokio::spawn(lock_waits(
            self.pool("postgres", 1).await?,
            db.clone(),
            stop.clone(),
        ));
        let prober = tokio::spawn(probes(self.pool(&db, 1).await?, stop.clone()));
        let from_us = unix_us()?;
        let cpu_from = cpu_ticks();
        let started = Instant::now();
        let mut control_rows = 0;
        let (settled, settle_ms, months) = match phase {
            Phase::Idle => {
                tokio::time::sleep(args.idle).await;
                (0, 0, 0)
            }
            Phase::Control {
                bytes_per_sec,
                secs,
                row_bytes,
                ..
            } => {
                let pool = writer.ok_or("the control's writer has no connection")?;
                control_rows = control::write(pool, bytes_per_sec, row_bytes, secs).await?;
                (0, 0, 0)
            }
            _ => self.settle_months(&db, phase, batch).await?,
        };
        let wall = started.elapsed();
        let to_us = unix_us()?;
        let cpu = cpu_busy(cpu_from, cpu_ticks());
        tokio::time::sleep(args.cooldown).await;
        stop.store(true, Ordering::Relaxed);
        let waits = sampler.await??;
        let probe = latency(prober.await??);
        let txs = load.stop(&self.admin, &db).await?;
        self.drop_db(&db).await?;

        let (latencies, caught_up) = in_window(&txs, from_us, to_us);
        let load = latency(latencies).ok_or("the load ran no transaction during the phase")?;
        Ok(PhaseResult {
            phase,
            wall,
            load_rate: load.transactions as f64 / wall.as_secs_f64(),
            load,
            caught_up,
            waits,
            probe,
            cpu,
            settled,
            settle_ms,
            months,
            control_rows,
        })
    }

    /// The WAL written by settling every month of a fresh copy of `template` as `phase` says, with nothing else
    /// running (the copy is made after a checkpoint, so every way starts with the same full-page writes ahead).
    async fn wal_of(&self, template: &str, phase: Phase, batch: u32) -> Result<Wal, Error> {
        let db = self.copy(template, "fsb_wal").await?;
        let before: String = sqlx::query_scalar("select pg_current_wal_lsn()::text")
            .fetch_one(&self.admin)
            .await?;
        let (rows, _, _) = self.settle_months(&db, phase, batch).await?;
        let bytes: i64 =
            sqlx::query_scalar("select pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint")
                .bind(&before)
                .fetch_one(&self.admin)
                .await?;
        self.drop_db(&db).await?;
        Ok(Wal { rows, bytes })
    }

    /// The WAL one row of the control's writer costs, on a fresh copy of `template` with nothing else running.
    async fn writer_row_bytes(&self, template: &str) -> Result<f64, Error> {
        let db = self.copy(template, "fsb_wal").await?;
        let pool = self.pool(&db, 1).await?;
        let bytes = control::bytes_per_row(&pool).await?;
        pool.close().await;
        self.drop_db(&db).await?;
        Ok(bytes)
    }

    /// The impact section on `template` (`loans` loans).
    pub(crate) async fn impact(
        &self,
        template: &str,
        loans: u64,
        batch: u32,
        args: &ImpactArgs,
    ) -> Result<Impact, Error> {
        eprintln!("   impact: WAL per row, settle and the single statement, without load");
        let wal_settle = self.wal_of(template, Phase::Settle, batch).await?;
        let wal_statement = self.wal_of(template, Phase::Statement, batch).await?;
        let run = |phase: Phase| {
            eprintln!("   impact: {} beside {} load tx/s", phase.label(batch), args.rate);
            self.impact_phase(template, args, loans, batch, phase)
        };
        let idle = run(Phase::Idle).await?;
        let settle = run(Phase::Settle).await?;
        let statement = run(Phase::Statement).await?;
        let throttled = match self.setting_available(THROTTLE_KEY, "1000") {
            Ok(()) => {
                let cap = ((settle.rows_per_sec() / 4.0).floor() as u64).max(1);
                Ok(run(Phase::Throttled(cap)).await?)
            }
            Err(why) => {
                eprintln!("   impact: throttled phase not available: {why}");
                Err(why)
            }
        };
        let budget = Duration::from_micros((idle.load.p99_ms * 1000.0 * BUDGET_OF_IDLE_P99).round() as u64);
        let governed = match self.setting_available(BUDGET_KEY, "5ms") {
            Ok(()) => Ok(run(Phase::Governed(budget)).await?),
            Err(why) => {
                eprintln!("   impact: latency-keyed phase not available: {why}");
                Err(why)
            }
        };
        for p in [&settle, &statement].into_iter().chain(throttled.as_ref().ok()) {
            if p.settled != wal_settle.rows {
                return Err(format!(
                    "{} settled {} rows, the WAL measurement {}",
                    p.phase.label(batch),
                    p.settled,
                    wal_settle.rows
                )
                .into());
            }
        }
        eprintln!("   impact: WAL per row of the control's writer, without load");
        let row_bytes = self.writer_row_bytes(template).await?;
        let mut controls = Vec::new();
        for (of, p) in [
            (Of::Settle, Ok(&settle)),
            (Of::Throttled, throttled.as_ref()),
            (Of::Governed, governed.as_ref()),
        ] {
            if let Ok(p) = p {
                controls.push(run(Phase::control_of(of, p, wal_settle, row_bytes)).await?);
            }
        }
        Ok(Impact {
            args: args.clone(),
            loans,
            batch,
            idle,
            settle,
            statement,
            throttled,
            governed,
            budget,
            controls,
            row_bytes,
            wal_settle,
            wal_statement,
        })
    }
}

/// The impact section's heading in the report.
const HEADING: &str = "## Impact on a live load";

/// The report's header line saying when the impact section alone was measured.
const MEASURED: &str = "- impact measured:";

pub(crate) fn measured(date: &str, commit: &str) -> String {
    format!("{MEASURED} {date} at commit {commit} (`scripts/bench.sh --impact`)")
}

/// The targets table's rows the impact section owns: every row about the load, and the WAL ratio.
fn is_impact_target(line: &str) -> bool {
    line.starts_with("| load ") || line.starts_with("| settle WAL per row")
}

/// `existing` with its impact section replaced by `section`, its impact rows of the targets table by `targets`
/// (in place of the first of them, else at the table's end), and its header line by `measured`.
pub(crate) fn merge(existing: &str, section: &str, targets: &str, measured: &str) -> String {
    let merged = crate::accrual::merge_section(existing, (HEADING, section), (MEASURED, measured));
    let mut lines: Vec<&str> = merged.lines().collect();
    let Some(table) = lines.iter().position(|l| *l == "## Targets") else {
        return merged;
    };
    let end = lines[table + 1..]
        .iter()
        .position(|l| l.starts_with("## "))
        .map_or(lines.len(), |i| table + 1 + i);
    let at = lines[table..end]
        .iter()
        .position(|l| is_impact_target(l))
        .map(|i| table + i)
        .or_else(|| {
            lines[table..end]
                .iter()
                .rposition(|l| l.starts_with('|'))
                .map(|i| table + i + 1)
        });
    let Some(at) = at else {
        return merged;
    };
    let kept: Vec<&str> = lines[at..end]
        .iter()
        .copied()
        .filter(|l| !is_impact_target(l))
        .collect();
    let rows = targets.lines().filter(|l| !l.is_empty());
    let new: Vec<&str> = rows.chain(kept).collect();
    lines.splice(at..end, new);
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_replaces_the_section_and_its_target_rows_only() {
        let existing = "# Settlement benchmark\n\n- commit: abc\n\n## Impact on a live load\n\nold figures\n\n## Batch size\n\nkept\n\n## Targets\n\n| target | measured | verdict |\n| --- | --- | --- |\n| throughput | 1 | met |\n| load p99 old | 9 | missed |\n| settle WAL per row old | 1 | met |\n| accrual | 2 | met |\n";
        let merged = merge(
            existing,
            "## Impact on a live load\n\nnew figures\n",
            "| load p99 new | 1 | met |\n| settle WAL per row new | 1 | met |\n",
            &measured("2026-12-03T07:00:00Z", "def"),
        );
        assert!(
            merged.contains("new figures") && !merged.contains("old figures"),
            "{merged}"
        );
        assert!(merged.contains("## Batch size\n\nkept"), "{merged}");
        assert!(
            merged.contains("- impact measured: 2026-12-03T07:00:00Z at commit def"),
            "{merged}"
        );
        assert!(
            merged.contains("| throughput | 1 | met |\n| load p99 new | 1 | met |\n| settle WAL per row new | 1 | met |\n| accrual | 2 | met |"),
            "{merged}"
        );
        assert!(!merged.contains("old |"), "{merged}");
    }

    #[test]
    fn a_log_line_gives_the_scheduled_start_and_the_latency() {
        // With -R: client, transaction, time (µs, from the scheduled start), script, end (s, µs), schedule lag.
        let txs = parse_log("0 1 7817 0 1796139307 801571 97\n2 14 1250000 0 1796139309 000000 1086\n\n")
            .expect("parses");
        assert_eq!(
            txs,
            vec![
                LoadTx {
                    client: 0,
                    scheduled_us: 1_796_139_307_801_571 - 7817,
                    latency_us: 7817
                },
                LoadTx {
                    client: 2,
                    scheduled_us: 1_796_139_309_000_000 - 1_250_000,
                    latency_us: 1_250_000
                },
            ]
        );
    }

    #[test]
    fn a_bad_log_line_is_named() {
        let err = parse_log("0 1 skipped 0 1796139307 801571 97").expect_err("skipped is no latency");
        assert!(err.to_string().contains("skipped"), "{err}");
        let err = parse_log("0 1 12").expect_err("too short");
        assert!(err.to_string().contains("3 fields"), "{err}");
    }

    #[test]
    fn cpu_busy_is_the_busy_share_of_the_ticks_between_two_readings() {
        assert_eq!(cpu_busy(Some((100, 1000)), Some((400, 2000))), Some(0.3));
        assert_eq!(cpu_busy(Some((100, 1000)), Some((100, 1000))), None);
        assert_eq!(cpu_busy(None, Some((100, 1000))), None);
        let (busy, total) = cpu_ticks().expect("/proc/stat on Linux");
        assert!(busy <= total && total > 0);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        // 1..=1000 ms: p50 is the 500th value, p99 the 990th.
        let l = latency((1..=1000).rev().map(|ms| ms * 1000).collect()).expect("some");
        assert_eq!(l.transactions, 1000);
        assert_eq!(l.p50_ms, 500.0);
        assert_eq!(l.p99_ms, 990.0);
        assert_eq!(l.max_ms, 1000.0);
        // Of 10 values, p99 is the 10th (rank ⌈9.9⌉), not the 9th.
        let ten = latency((1..=10).map(|ms| ms * 1000).collect()).expect("some");
        assert_eq!((ten.p50_ms, ten.p99_ms), (5.0, 10.0));
        let one = latency(vec![2500]).expect("one");
        assert_eq!((one.p50_ms, one.p99_ms, one.max_ms), (2.5, 2.5, 2.5));
        assert_eq!(latency(Vec::new()), None);
    }

    #[test]
    fn a_phase_counts_what_was_scheduled_in_it_and_knows_whether_the_load_caught_up() {
        let tx = |client, scheduled_us, latency_us| LoadTx {
            client,
            scheduled_us,
            latency_us,
        };
        // Client 1's transaction scheduled at 150 waited (a lock) until long after the phase ended at 200: it
        // still belongs to the phase.
        let txs = [
            tx(0, 50, 1),
            tx(0, 120, 2),
            tx(1, 150, 5000),
            tx(0, 210, 3),
            tx(1, 260, 4),
        ];
        let (latencies, caught_up) = in_window(&txs, 100, 200);
        assert_eq!(latencies, vec![2, 5000]);
        assert!(caught_up);
        // Had client 1 not run anything scheduled after the phase, its share of the phase may be missing.
        let (_, caught_up) = in_window(&txs[..4], 100, 200);
        assert!(!caught_up);
    }
}
