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

use crate::{binary, per_sec, verdict, Bench, Error, SettleJob, Via};

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
}

impl Phase {
    fn label(self, batch: u32) -> String {
        match self {
            Phase::Idle => "idle: the load alone".into(),
            Phase::Settle => format!("`settle`, defaults (batches of {batch})"),
            Phase::Statement => "single statement: one set-based `update` per month".into(),
            Phase::Throttled(cap) => format!("`settle`, throttled to {cap} rows/s"),
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
    /// The share of the machine's CPU that was busy during the phase (everything on it, not only the benchmark).
    cpu: Option<f64>,
    /// Rows settled, and settlement's own time for them (`elapsed_ms` of the runs; the statements' time).
    settled: i64,
    settle_ms: u64,
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

/// What the lock-wait sampler saw of the load's lock waits.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct LockWaits {
    /// The longest, ms.
    longest_ms: f64,
    /// How many statements of the load were seen waiting (each counted once).
    statements: usize,
}

/// The load's lock waits, sampled from `pg_stat_activity` every [`SAMPLE_EVERY`] until `stop` is set: a
/// waiting session's statement started at `query_start`, and the wait can have lasted at most since then (a
/// point read or update spends microseconds before it waits); a statement is told by its session and
/// `query_start`.
async fn lock_waits(pool: PgPool, db: String, stop: Arc<AtomicBool>) -> Result<LockWaits, Error> {
    let mut longest: f64 = 0.0;
    let mut seen = std::collections::HashSet::new();
    while !stop.load(Ordering::Relaxed) {
        let waiting: Vec<(i32, i64, f64)> = sqlx::query_as(
            "select pid, (extract(epoch from query_start) * 1000000)::int8,
                    (extract(epoch from clock_timestamp() - query_start) * 1000)::float8
             from pg_stat_activity
             where datname = $1 and application_name = 'pgbench' and wait_event_type = 'Lock'",
        )
        .bind(&db)
        .fetch_all(&pool)
        .await?;
        for (pid, started, waited) in waiting {
            seen.insert((pid, started));
            longest = longest.max(waited);
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    pool.close().await;
    Ok(LockWaits {
        longest_ms: longest,
        statements: seen.len(),
    })
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
    /// Whether the `settle` binary accepts `throttle.max_rows_per_second` (it validates its configuration
    /// before it connects); otherwise its own message.
    fn throttle_available(&self) -> Result<(), String> {
        let out = Command::new(binary().map_err(|e| e.to_string())?)
            .arg("check-config")
            .env(THROTTLE_KEY, "1000")
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

    /// Settles every month of [`MONTHS`] on `db` one after another, as `phase` says: (rows, settlement ms).
    async fn settle_months(&self, db: &str, phase: Phase, batch: u32) -> Result<(i64, u64), Error> {
        let mut rows = 0;
        let mut ms = 0;
        for month in MONTHS {
            match phase {
                Phase::Idle => {}
                Phase::Statement => {
                    let (n, secs) = self.limit_of(db, month, 1).await?;
                    rows += i64::try_from(n)?;
                    ms += (secs * 1000.0).round() as u64;
                }
                Phase::Settle | Phase::Throttled(_) => {
                    let env = match phase {
                        Phase::Throttled(cap) => vec![(THROTTLE_KEY, cap.to_string())],
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
        Ok((rows, ms))
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
        let from_us = unix_us()?;
        let cpu_from = cpu_ticks();
        let started = Instant::now();
        let (settled, settle_ms) = match phase {
            Phase::Idle => {
                tokio::time::sleep(args.idle).await;
                (0, 0)
            }
            _ => self.settle_months(&db, phase, batch).await?,
        };
        let wall = started.elapsed();
        let to_us = unix_us()?;
        let cpu = cpu_busy(cpu_from, cpu_ticks());
        tokio::time::sleep(args.cooldown).await;
        stop.store(true, Ordering::Relaxed);
        let waits = sampler.await??;
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
            cpu,
            settled,
            settle_ms,
        })
    }

    /// The WAL written by settling every month of a fresh copy of `template` as `phase` says, with nothing else
    /// running (the copy is made after a checkpoint, so every way starts with the same full-page writes ahead).
    async fn wal_of(&self, template: &str, phase: Phase, batch: u32) -> Result<Wal, Error> {
        let db = self.copy(template, "fsb_wal").await?;
        let before: String = sqlx::query_scalar("select pg_current_wal_lsn()::text")
            .fetch_one(&self.admin)
            .await?;
        let (rows, _) = self.settle_months(&db, phase, batch).await?;
        let bytes: i64 =
            sqlx::query_scalar("select pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint")
                .bind(&before)
                .fetch_one(&self.admin)
                .await?;
        self.drop_db(&db).await?;
        Ok(Wal { rows, bytes })
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
        let throttled = match self.throttle_available() {
            Ok(()) => {
                let cap = ((settle.rows_per_sec() / 4.0).floor() as u64).max(1);
                Ok(run(Phase::Throttled(cap)).await?)
            }
            Err(why) => {
                eprintln!("   impact: throttled phase not available: {why}");
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
        Ok(Impact {
            args: args.clone(),
            loans,
            batch,
            idle,
            settle,
            statement,
            throttled,
            wal_settle,
            wal_statement,
        })
    }
}

impl Impact {
    fn p99_ratio(&self, p: &PhaseResult) -> f64 {
        p.load.p99_ms / self.idle.load.p99_ms.max(0.001)
    }

    fn wal_ratio(&self) -> f64 {
        self.wal_settle.per_row() / self.wal_statement.per_row().max(f64::MIN_POSITIVE)
    }

    /// The section of the report.
    pub(crate) fn report(&self) -> String {
        use std::fmt::Write as _;
        let a = &self.args;
        let mut r = String::new();
        let _ = writeln!(r, "## Impact on a live load\n");
        let _ = writeln!(
            r,
            "A libraryd-like load beside each phase: `pgbench` at {} transactions/s (`-R`, {} sessions, prepared statements), each transaction a point read of one random loan and `update loans set member_id = member_id` of another (by id: the row lock settlement's update needs, a new row version, nothing settlement reads). Each phase runs on a fresh copy of the {}-loan template, the load started {:.0} s before it and stopped {:.0} s after it; a phase's figures are the load's transactions scheduled while it ran. Every phase that settles settles the months ending {} one after another ({} rows). Latency is pgbench's, from each transaction's scheduled start (schedule lag included). Lock waits are sampled from `pg_stat_activity` every {} ms (a load session waiting on a lock, since its statement started): shorter waits can be missed. Machine CPU busy is `/proc/stat` over the phase, all cores, everything running on the machine.\n",
            a.rate,
            a.clients,
            self.loans,
            a.warmup.as_secs_f64(),
            a.cooldown.as_secs_f64(),
            MONTHS.join(", "),
            self.wal_settle.rows,
            SAMPLE_EVERY.as_millis()
        );
        let _ = writeln!(
            r,
            "| phase | duration | load tx | load tx/s | p50 | p99 | max | longest lock wait | load statements seen waiting | machine CPU busy | settled rows | rows/s |"
        );
        let _ = writeln!(
            r,
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        );
        let row = |r: &mut String, p: &PhaseResult| {
            let rate = if p.phase == Phase::Idle {
                String::new()
            } else {
                format!("{:.0}", p.rows_per_sec())
            };
            let settled = if p.phase == Phase::Idle {
                String::new()
            } else {
                p.settled.to_string()
            };
            let _ = writeln!(
                r,
                "| {}{} | {:.1} s | {} | {:.0} | {:.1} ms | {:.1} ms | {:.1} ms | {:.0} ms | {} ({:.2} % of the load's) | {} | {settled} | {rate} |",
                p.phase.label(self.batch),
                if p.caught_up { "" } else { " (load behind schedule when stopped)" },
                p.wall.as_secs_f64(),
                p.load.transactions,
                p.load_rate,
                p.load.p50_ms,
                p.load.p99_ms,
                p.load.max_ms,
                p.waits.longest_ms,
                p.waits.statements,
                100.0 * p.waits.statements as f64 / p.load.transactions.max(1) as f64,
                p.cpu.map_or_else(|| "?".to_string(), |c| format!("{:.0} %", c * 100.0)),
            );
        };
        row(&mut r, &self.idle);
        row(&mut r, &self.settle);
        row(&mut r, &self.statement);
        match &self.throttled {
            Ok(p) => row(&mut r, p),
            Err(why) => {
                let _ = writeln!(
                    r,
                    "| `settle`, throttled | not available: {} | | | | | | | | | | |",
                    why.replace('|', "\\|")
                );
            }
        }
        let _ = writeln!(r);
        let _ = writeln!(
            r,
            "Rows/s is settlement's own: the runs' `elapsed_ms` (claim to finish), the statements' time. Beside the load, `settle` with its defaults reaches {:.2} of the single statement's rate.\n",
            self.settle.rows_per_sec() / self.statement.rows_per_sec().max(f64::MIN_POSITIVE)
        );
        if let Ok(p) = &self.throttled {
            let Phase::Throttled(cap) = p.phase else {
                unreachable!("the throttled phase is Phase::Throttled")
            };
            let _ = writeln!(
                r,
                "Throttled to {cap} rows/s (a quarter of the {:.0} rows/s the defaults reached above), `settle` averaged {:.0} rows/s ({:.2} of the cap).\n",
                self.settle.rows_per_sec(),
                p.rows_per_sec(),
                p.rows_per_sec() / cap as f64
            );
        }
        let _ = writeln!(
            r,
            "WAL per settled row, without the load, each on a fresh copy after a `checkpoint` (`pg_current_wal_lsn()` before and after, `pg_wal_lsn_diff`):\n"
        );
        let _ = writeln!(r, "| way | rows | WAL | bytes per row |");
        let _ = writeln!(r, "| --- | ---: | ---: | ---: |");
        for (label, w) in [
            (
                format!("`settle`, defaults (batches of {})", self.batch),
                self.wal_settle,
            ),
            ("single statement per month".to_string(), self.wal_statement),
        ] {
            let _ = writeln!(
                r,
                "| {label} | {} | {:.1} MiB | {:.1} |",
                w.rows,
                w.bytes as f64 / 1_048_576.0,
                w.per_row()
            );
        }
        let _ = writeln!(r);
        let _ = writeln!(
            r,
            "Ratios: defaults p99 / idle p99 = {:.2} (target ≤ 2); defaults max = {:.1} ms (target ≤ 250 ms); throttled p99 / idle p99 = {} (target ≤ 1.2); single statement p99 / idle p99 = {:.2}; settle WAL per row / statement WAL per row = {:.2} (target ≤ 1.1). `bench/README.md` says what limits a missed one.\n",
            self.p99_ratio(&self.settle),
            self.settle.load.max_ms,
            match &self.throttled {
                Ok(p) => format!("{:.2}", self.p99_ratio(p)),
                Err(_) => "not available".into(),
            },
            self.p99_ratio(&self.statement),
            self.wal_ratio()
        );
        r
    }

    /// Rows of the report's targets table.
    pub(crate) fn targets(&self) -> String {
        use std::fmt::Write as _;
        let mut r = String::new();
        let ratio = self.p99_ratio(&self.settle);
        let _ = writeln!(
            r,
            "| load p99 during `settle` (defaults) ≤ 2 × idle p99 | {ratio:.2} ({:.1} ms vs {:.1} ms) | {} |",
            self.settle.load.p99_ms,
            self.idle.load.p99_ms,
            verdict(ratio <= 2.0)
        );
        let _ = writeln!(
            r,
            "| load max during `settle` (defaults) ≤ 250 ms | {:.1} ms | {} |",
            self.settle.load.max_ms,
            verdict(self.settle.load.max_ms <= 250.0)
        );
        match &self.throttled {
            Ok(p) => {
                let ratio = self.p99_ratio(p);
                let _ = writeln!(
                    r,
                    "| load p99 during `settle` throttled to a quarter ≤ 1.2 × idle p99 | {ratio:.2} ({:.1} ms) | {} |",
                    p.load.p99_ms,
                    verdict(ratio <= 1.2)
                );
            }
            Err(_) => {
                let _ = writeln!(
                    r,
                    "| load p99 during `settle` throttled to a quarter ≤ 1.2 × idle p99 | not available | not measured |"
                );
            }
        }
        let ratio = self.wal_ratio();
        let _ = writeln!(
            r,
            "| settle WAL per row ≤ 1.1 × the single statement's | {ratio:.2} ({:.0} vs {:.0} bytes) | {} |",
            self.wal_settle.per_row(),
            self.wal_statement.per_row(),
            verdict(ratio <= 1.1)
        );
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
