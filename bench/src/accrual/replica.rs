//! A real replica at work on a database of the accrual section, and what the server ran for it: `run --once`
//! (one tick and its runs' reports), a replica ticking for a while, and `pg_stat_statements` of the database
//! (every statement, and the re-check's own).

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::ChildStderr,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use chrono::NaiveDate;

use super::{process, Jit};
use crate::{Bench, Error};

/// The start of the re-check's statement (`corrections::recheck` in src/store/corrections.rs), as
/// `pg_stat_statements` records it.
const RECHECK_SQL_START: &str = "with seen as (";

/// Marks the benchmark's own questions to a database while a replica works there, so that they are not counted
/// among the replica's statements.
pub(crate) const OWN: &str = "/* fine-settler-bench */";

/// The log line of a tick that found nothing to do (src/daemon/tick.rs).
const IDLE_TICK: &str = "tick: nothing due";

/// The re-check's log line when it found days to re-open (src/daemon/recheck.rs).
const RECHECK_FOUND: &str = "accrual re-check: days to re-open";

/// One run of a `run --once` tick, as its report line says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RunLine {
    pub job: String,
    pub business_date: NaiveDate,
    pub outcome: String,
    pub updated: i64,
    pub corrections: i64,
    pub elapsed_ms: u64,
    pub reopened: bool,
}

impl RunLine {
    fn parse(line: &str) -> Result<Self, Error> {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let text = |k: &str| {
            v[k].as_str()
                .map(str::to_string)
                .ok_or(format!("no {k} in {line}"))
        };
        Ok(RunLine {
            job: text("job")?,
            business_date: text("business_date")?.parse()?,
            outcome: text("outcome")?,
            updated: v["updated"].as_i64().unwrap_or(0),
            corrections: v["corrections"].as_i64().unwrap_or(0),
            elapsed_ms: v["elapsed_ms"].as_u64().unwrap_or(0),
            reopened: v["reopened"].as_bool().unwrap_or(false),
        })
    }
}

/// What one re-check found, from its log line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Found {
    pub changed: i64,
    pub dirty: i64,
    pub days: usize,
}

/// The re-checks in a replica's JSON log that found days to re-open.
pub(crate) fn found_in(log: &str) -> Vec<Found> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"].as_str() == Some(RECHECK_FOUND))
        .map(|v| Found {
            changed: v["changed"].as_i64().unwrap_or(0),
            dirty: v["dirty"].as_i64().unwrap_or(0),
            days: v["days"].as_str().map_or(0, |d| d.matches('-').count() / 2),
        })
        .collect()
}

/// One `run --once`: its runs, its wall time (process start to exit) and its log.
#[derive(Debug, Clone)]
pub(crate) struct Once {
    pub runs: Vec<RunLine>,
    pub wall_ms: u64,
    pub log: String,
}

/// Statements the server ran in a database since the last reset (`pg_stat_statements`, the benchmark's own
/// questions about it left out), and of them the re-check's.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Statements {
    pub calls: i64,
    pub exec_ms: f64,
    pub recheck: Timed,
}

impl Statements {
    /// What ran after `earlier`, a reading of the same statistics (the largest call is the later reading's).
    pub fn since(&self, earlier: &Statements) -> Statements {
        Statements {
            calls: self.calls - earlier.calls,
            exec_ms: self.exec_ms - earlier.exec_ms,
            recheck: Timed {
                calls: self.recheck.calls - earlier.recheck.calls,
                exec_ms: self.recheck.exec_ms - earlier.recheck.exec_ms,
                plans: self.recheck.plans - earlier.recheck.plans,
                plan_ms: self.recheck.plan_ms - earlier.recheck.plan_ms,
                max_exec_ms: self.recheck.max_exec_ms,
            },
        }
    }
}

/// Calls of one statement and the database time they took.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Timed {
    pub calls: i64,
    pub exec_ms: f64,
    /// Times planned, and the time it took (recorded where `pg_stat_statements.track_planning` is on): a
    /// prepared statement is planned when a connection first runs it, and again while PostgreSQL tries custom
    /// plans before it settles on the generic one.
    pub plans: i64,
    pub plan_ms: f64,
    pub max_exec_ms: f64,
}

impl Timed {
    /// Execution time per call.
    pub fn exec_per_call_ms(&self) -> f64 {
        self.exec_ms / self.calls.max(1) as f64
    }

    /// Database time per call, planning included.
    pub fn per_call_ms(&self) -> f64 {
        (self.exec_ms + self.plan_ms) / self.calls.max(1) as f64
    }

    /// Planning time per plan.
    pub fn per_plan_ms(&self) -> f64 {
        self.plan_ms / self.plans.max(1) as f64
    }
}

/// One statement of the most costly in a database: its calls, their execution time, the start of its text.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Costly {
    pub calls: i64,
    pub exec_ms: f64,
    pub text: String,
}

/// A replica left to work until a condition held.
#[derive(Debug, Clone)]
pub(crate) struct Worked {
    /// From its start until the condition was seen to hold (polled every 100 ms).
    pub wall_ms: u64,
    pub log: String,
}

/// A replica that ticked for a while: the statements of its steady idle ticks (between the first idle tick and
/// the last), those since it started (start-up included), and its RSS at the end.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticking {
    /// Idle ticks in the steady part.
    pub ticks: usize,
    pub steady: Statements,
    pub total: Statements,
    pub rss_kib: u64,
}

impl Ticking {
    /// Statements per steady idle tick.
    pub fn per_tick(&self) -> f64 {
        self.steady.calls as f64 / self.ticks.max(1) as f64
    }

    /// Database time per steady idle tick (execution).
    pub fn ms_per_tick(&self) -> f64 {
        self.steady.exec_ms / self.ticks.max(1) as f64
    }
}

impl Bench {
    pub(crate) async fn reset_statements(&self) -> Result<(), Error> {
        sqlx::query("select pg_stat_statements_reset()")
            .execute(&self.admin)
            .await?;
        Ok(())
    }

    /// `pg_stat_statements` of database `db` since the last reset.
    pub(crate) async fn statements_of(&self, db: &str) -> Result<Statements, Error> {
        let row: (i64, f64, i64, f64, i64, f64, f64) = sqlx::query_as(
            "select coalesce(sum(calls), 0)::bigint, coalesce(sum(total_exec_time), 0)::float8,
                    coalesce(sum(calls) filter (where query like $2 || '%'), 0)::bigint,
                    coalesce(sum(total_exec_time) filter (where query like $2 || '%'), 0)::float8,
                    coalesce(sum(plans) filter (where query like $2 || '%'), 0)::bigint,
                    coalesce(sum(total_plan_time) filter (where query like $2 || '%'), 0)::float8,
                    coalesce(max(max_exec_time) filter (where query like $2 || '%'), 0)::float8
             from pg_stat_statements
             where dbid = (select oid from pg_database where datname = $1)
               and query not like '%pg_stat_statements%' and query not like $3 || '%'",
        )
        .bind(db)
        .bind(RECHECK_SQL_START)
        .bind(OWN)
        .fetch_one(&self.admin)
        .await?;
        Ok(Statements {
            calls: row.0,
            exec_ms: row.1,
            recheck: Timed {
                calls: row.2,
                exec_ms: row.3,
                plans: row.4,
                plan_ms: row.5,
                max_exec_ms: row.6,
            },
        })
    }

    /// The `n` statements that took the most execution time in database `db` since the last reset.
    pub(crate) async fn costliest(&self, db: &str, n: i64) -> Result<Vec<Costly>, Error> {
        let rows: Vec<(i64, f64, String)> = sqlx::query_as(
            "select calls, total_exec_time, left(regexp_replace(query, '\\s+', ' ', 'g'), 60)
             from pg_stat_statements
             where dbid = (select oid from pg_database where datname = $1)
               and query not like '%pg_stat_statements%'
             order by total_exec_time desc
             limit $2",
        )
        .bind(db)
        .bind(n)
        .fetch_all(&self.admin)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(calls, exec_ms, text)| Costly { calls, exec_ms, text })
            .collect())
    }

    /// `binary run --once` on `db`: one tick, with settlement enabled or not, JIT as `jit` says.
    pub(crate) fn run_once(
        &self,
        binary: &Path,
        db: &str,
        batch: u32,
        settlement: bool,
        jit: Jit,
    ) -> Result<Once, Error> {
        let url = format!("{}/{db}", self.server);
        let started = Instant::now();
        let out = process(binary, &url, batch, settlement, jit, "info")
            .args(["run", "--once"])
            .output()?;
        let wall_ms = u64::try_from(started.elapsed().as_millis())?;
        let log = String::from_utf8_lossy(&out.stderr).to_string();
        if !out.status.success() {
            return Err(format!("run --once failed ({}): {log}", out.status).into());
        }
        let runs = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(RunLine::parse)
            .collect::<Result<_, _>>()?;
        Ok(Once { runs, wall_ms, log })
    }

    /// A replica of `binary` ticking every 200 ms on `db` (accrual enabled, settlement disabled), stopped once
    /// `done` — a query of one boolean, asked every 100 ms — answers true, or failing after `deadline`.
    pub(crate) async fn until(
        &self,
        binary: &Path,
        db: &str,
        batch: u32,
        done: &str,
        deadline: Duration,
    ) -> Result<Worked, Error> {
        let pool = self.pool(db, 1).await?;
        let asked = format!("{OWN} {done}");
        let url = format!("{}/{db}", self.server);
        let started = Instant::now();
        let replica = process(binary, &url, batch, false, Jit::Server, "info")
            .arg("run")
            .env("FINE_SETTLER__SCHEDULE__PERIOD", "200ms")
            .stdout(std::process::Stdio::null())
            .spawn()?;
        let mut held = false;
        while !held && started.elapsed() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            held = sqlx::query_scalar(&asked).fetch_one(&pool).await?;
        }
        let wall_ms = u64::try_from(started.elapsed().as_millis())?;
        pool.close().await;
        std::process::Command::new("kill")
            .args(["-TERM", &replica.id().to_string()])
            .status()?;
        let out = replica.wait_with_output()?;
        let log = String::from_utf8_lossy(&out.stderr).to_string();
        if !held {
            return Err(format!("the replica had not done its work after {deadline:?}: {log}").into());
        }
        Ok(Worked { wall_ms, log })
    }

    /// A replica of `binary` ticking every 200 ms on `db` for about `secs` seconds, settlement and accrual
    /// enabled, re-checking every `recheck_every` (its default when `None`), JIT as `jit` says. The statistics are reset before it
    /// starts and read twice: right after its first idle tick is logged and right after the last one (a tick logs
    /// "nothing due" after its last statement, and the next comes 200 ms later), so that the steady figures hold
    /// whole idle ticks only, without the start-up and the first tick.
    pub(crate) async fn ticking(
        &self,
        binary: &Path,
        db: &str,
        batch: u32,
        recheck_every: Option<&str>,
        jit: Jit,
        secs: u64,
    ) -> Result<Ticking, Error> {
        self.reset_statements().await?;
        let url = format!("{}/{db}", self.server);
        let mut cmd = process(binary, &url, batch, true, jit, "fine_settler=debug");
        cmd.arg("run")
            .env("FINE_SETTLER__SCHEDULE__PERIOD", "200ms")
            .stdout(std::process::Stdio::null());
        if let Some(every) = recheck_every {
            cmd.env("FINE_SETTLER__ACCRUAL__RECHECK_EVERY", every);
        }
        let mut replica = cmd.spawn()?;
        let ticks = Arc::new(AtomicUsize::new(0));
        let log = read_log(replica.stderr.take().ok_or("no stderr")?, ticks.clone());
        let first = self.reading(db, &ticks, 0).await;
        tokio::time::sleep(Duration::from_secs(secs)).await;
        let last = self.reading(db, &ticks, ticks.load(Ordering::SeqCst)).await;
        let (rss_kib, _) = crate::rss_of(replica.id());
        std::process::Command::new("kill")
            .args(["-TERM", &replica.id().to_string()])
            .status()?;
        replica.wait()?;
        let log = log.join().map_err(|_| "log reader panicked")?;
        let (Some((first, at_first)), Some((last, total))) = (first?, last?) else {
            return Err(format!("the replica logged no idle tick within {TICK_WAIT:?}: {log}").into());
        };
        Ok(Ticking {
            ticks: last - first,
            steady: total.since(&at_first),
            total,
            rss_kib,
        })
    }
}

impl Bench {
    /// The statements of `db` right after an idle tick later than the `after`-th, with the number of that tick
    /// (`None` if none comes within [`TICK_WAIT`]). A reading that the next tick overtook — its log line came
    /// before the reading ended, so its statement may be counted without the tick — is taken again after it.
    async fn reading(
        &self,
        db: &str,
        ticks: &AtomicUsize,
        after: usize,
    ) -> Result<Option<(usize, Statements)>, Error> {
        let mut after = after;
        for _ in 0..10 {
            let Some(tick) = next_tick(ticks, after).await else {
                return Ok(None);
            };
            let statements = self.statements_of(db).await?;
            if ticks.load(Ordering::SeqCst) == tick {
                return Ok(Some((tick, statements)));
            }
            after = ticks.load(Ordering::SeqCst);
        }
        Err("every reading of the statements was overtaken by the replica's next tick".into())
    }
}

/// How long the benchmark waits for a replica's next idle tick.
const TICK_WAIT: Duration = Duration::from_secs(10);

/// Reads a replica's log to its end on a thread of its own, counting its idle ticks in `ticks`; the log.
fn read_log(stderr: ChildStderr, ticks: Arc<AtomicUsize>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut log = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains(IDLE_TICK) {
                ticks.fetch_add(1, Ordering::SeqCst);
            }
            log.push_str(&line);
            log.push('\n');
        }
        log
    })
}

/// The number of idle ticks once it is above `after` (`None` if that does not happen within [`TICK_WAIT`]).
async fn next_tick(ticks: &AtomicUsize, after: usize) -> Option<usize> {
    let started = Instant::now();
    while started.elapsed() < TICK_WAIT {
        let now = ticks.load(Ordering::SeqCst);
        if now > after {
            return Some(now);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_line_of_run_once_is_read() {
        let line = r#"{"job":"overdue-accrual","business_date":"2026-12-01","shard":0,"shards":1,"outcome":"settled","epoch":2,"scanned":10,"updated":0,"corrections":7,"elapsed_ms":12,"reopened":true}"#;
        let run = RunLine::parse(line).expect("a report line");
        assert_eq!(
            run.business_date,
            "2026-12-01".parse::<NaiveDate>().expect("date")
        );
        assert_eq!(
            (run.outcome.as_str(), run.corrections, run.reopened),
            ("settled", 7, true)
        );
        assert!(RunLine::parse(r#"{"job":"overdue-accrual"}"#).is_err());
    }

    #[test]
    fn the_rechecks_that_found_days_are_read_from_the_log() {
        let log = concat!(
            r#"{"level":"debug","message":"accrual re-check","changed":0}"#,
            "\n",
            r#"{"level":"info","message":"accrual re-check: days to re-open","changed":1000,"dirty":998,"days":"[2026-11-25, 2026-11-26]"}"#,
            "\nnot json\n"
        );
        assert_eq!(
            found_in(log),
            vec![Found {
                changed: 1000,
                dirty: 998,
                days: 2
            }]
        );
    }
}
