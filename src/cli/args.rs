//! The command line's arguments: the clap types of every subcommand and their value parsers.

use std::path::PathBuf;

use chrono::{DateTime, NaiveDate};
use clap::{Parser, Subcommand};

use crate::jobs::{backfill::Reprocess, JobName};

/// Settles library fines in PostgreSQL: idempotent, sharded, resumable.
#[derive(Debug, Parser)]
#[command(name = "fine-settler", version)]
pub struct Cli {
    /// The replica's TOML file; overrides the built-in defaults (see config/default.toml).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the database migrations (idempotent).
    Migrate,
    /// Settle one business month (its last day) for one shard, and print a one-line JSON report.
    Settle {
        /// The business date: the last day of the month to settle, e.g. 2026-10-31.
        #[arg(long, value_name = "D")]
        business_date: NaiveDate,
        #[command(flatten)]
        shard: ShardArgs,
        /// Re-run a key that already succeeded, from the beginning (rows already settled are not touched).
        #[arg(long)]
        force: bool,
        /// Run even though the job (or this shard) is paused.
        #[arg(long)]
        ignore_pause: bool,
    },
    /// Run the replica: tick on the schedule, settling every due business date of this shard.
    Run {
        /// Do one tick, print its runs' reports, and exit (0 if every run settled or skipped).
        #[arg(long)]
        once: bool,
    },
    /// Print what a tick at that time would claim (one JSON line per due key); writes nothing.
    Plan {
        /// The time of the tick (default: now, by the configured clock).
        #[arg(long, value_name = "RFC3339")]
        at: Option<DateTime<chrono::FixedOffset>>,
    },
    /// Measure the scheduler: run it with simulated work and print each tick's start, lag and gap.
    Drift {
        #[arg(long, value_enum)]
        mode: DriftMode,
        /// The period (fixed-rate) or delay (fixed-delay).
        #[arg(long, value_parser = parse_duration, default_value = "200ms")]
        period: std::time::Duration,
        /// Simulated work per tick.
        #[arg(long, value_parser = parse_duration, default_value = "80ms")]
        work: std::time::Duration,
        #[arg(long, default_value_t = 6)]
        ticks: usize,
        /// Print at most this many table rows (the summary covers all ticks).
        #[arg(long, default_value_t = 20)]
        rows: usize,
    },
    /// Accrue one day's overdue fines for one shard (after retrying its due pending charges), and print a
    /// one-line JSON report with the shard's pending and dead counts.
    Accrue {
        /// The accrual day, before today in time.zone.
        #[arg(long, value_name = "D")]
        date: NaiveDate,
        #[command(flatten)]
        shard: ShardArgs,
        /// Re-run a day that already succeeded (days already charged are not charged again).
        #[arg(long)]
        force: bool,
        /// Run even though the job (or this shard) is paused.
        #[arg(long)]
        ignore_pause: bool,
    },
    /// Run every business date of a job in a range (month ends for settlement, days for accrual) for every
    /// shard, oldest first, through the same runner as the daemon: the catch-up after a long outage. Prints
    /// each run's report line, then a summary; exits 1 if any run failed.
    Backfill {
        #[arg(long, value_name = "J", value_parser = parse_job)]
        job: JobName,
        /// The first day of the range.
        #[arg(long, value_name = "D1")]
        from: NaiveDate,
        /// The last day of the range (settlement: a month is included when its last day is in the range).
        #[arg(long, value_name = "D2")]
        to: NaiveDate,
        /// The shard count whose every shard runs (default: instance.shards).
        #[arg(long, value_name = "N", allow_negative_numbers = true)]
        shards: Option<i64>,
        /// missing: keys absent or not SUCCESS, and SUCCESS keys with late rows; failed: only FAILED keys;
        /// all: every key, SUCCESS ones re-run as --force does.
        #[arg(long, value_name = "WHICH", value_parser = parse_reprocess, default_value = "missing")]
        reprocess: Reprocess,
        /// How many keys run at a time (at most database.max_connections).
        #[arg(long, value_name = "K", default_value_t = 1, allow_negative_numbers = true)]
        concurrency: i64,
        /// Print what each key would do and how many rows it would touch, then a summary; write nothing.
        #[arg(long)]
        dry_run: bool,
        /// Run even where a pause covers the keys (and through a pause set while the backfill runs).
        #[arg(long)]
        ignore_pause: bool,
    },
    /// The compensation queue of failed charges.
    Pending {
        #[command(subcommand)]
        action: PendingAction,
    },
    /// Show job_runs rows as a table (or the attempt history).
    Runs {
        /// Only this job (fine-settlement or overdue-accrual).
        #[arg(long, value_name = "J", value_parser = parse_job)]
        job: Option<JobName>,
        /// Only this business date.
        #[arg(long, value_name = "D")]
        business_date: Option<NaiveDate>,
        /// Show job_run_attempts instead: every claim, takeover, finish, failure, lost lease and release.
        #[arg(long)]
        history: bool,
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// End a stuck claim now: the key becomes FAILED with its lease ended, so the next run takes it over under a
    /// new epoch (fencing out the old owner); recorded in the history with who and why.
    Release {
        #[arg(long, value_name = "J", value_parser = parse_job)]
        job: JobName,
        #[arg(long, value_name = "D")]
        business_date: NaiveDate,
        #[arg(long, value_name = "N", allow_negative_numbers = true)]
        shards: i64,
        #[arg(long, value_name = "S", allow_negative_numbers = true)]
        shard: i64,
        /// Why, for the history.
        #[arg(long, default_value = "released by an operator")]
        reason: String,
        /// Who, for the history (default: $USER@host).
        #[arg(long)]
        by: Option<String>,
    },
    /// Audit a settled month; exit 3 on any violation.
    Verify {
        /// The business date (month end) to audit.
        #[arg(long, value_name = "D")]
        business_date: NaiveDate,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Validate the configuration and print the effective values (password redacted).
    CheckConfig,
    /// Insert deterministic demo loans (existing ids are left alone, so running it twice is a no-op).
    DemoData {
        /// How many loans.
        #[arg(long, default_value_t = 5000)]
        loans: u64,
        /// The generator's seed.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// The month the loans cluster around, as YYYY-MM.
        #[arg(long, value_name = "YYYY-MM", value_parser = parse_month)]
        month: NaiveDate,
        /// The first loan id.
        #[arg(long, default_value_t = 1)]
        first_id: i64,
    },
    /// Pause a job on every replica (or one shard of it): from their next tick no replica claims its keys, and a
    /// run in progress hands its key back after its current batch. Stored in the database; idempotent.
    Pause {
        #[arg(long, value_name = "J", value_parser = parse_job)]
        job: JobName,
        #[command(flatten)]
        scope: PauseScopeArgs,
        /// Why, for the replicas' logs, `runs` and the history.
        #[arg(long, default_value = "paused by an operator")]
        reason: String,
        /// Who, for the history (default: $USER@host).
        #[arg(long)]
        by: Option<String>,
    },
    /// Lift a pause set with `pause` (the same scope: the whole job, or the one shard); the next tick goes on
    /// from where the runs stopped.
    Resume {
        #[arg(long, value_name = "J", value_parser = parse_job)]
        job: JobName,
        #[command(flatten)]
        scope: PauseScopeArgs,
        /// Who, for the history (default: $USER@host).
        #[arg(long)]
        by: Option<String>,
    },
}

/// `--shards N --shard S` of `pause` and `resume`: both or neither (neither: the whole job, every shard).
#[derive(Debug, clap::Args)]
pub struct PauseScopeArgs {
    /// Only this shard count (with --shard).
    #[arg(long, value_name = "N", allow_negative_numbers = true, requires = "shard")]
    pub shards: Option<i64>,
    /// Only this shard (with --shards).
    #[arg(long, value_name = "S", allow_negative_numbers = true, requires = "shards")]
    pub shard: Option<i64>,
}

/// `--shard S --shards N` of the one-shot commands; each defaults to the instance's.
#[derive(Debug, clap::Args)]
pub struct ShardArgs {
    /// The shard (default: instance.shard).
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub shard: Option<i64>,
    /// The shard count (default: instance.shards).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub shards: Option<i64>,
}

#[derive(Debug, Subcommand)]
pub enum PendingAction {
    /// List queued charges: loan, date, amount, attempts, next attempt, last error, status.
    List {
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Retry every PENDING charge now, whatever its next attempt time.
    Retry {
        /// Also give DEAD charges a fresh set of attempts first.
        #[arg(long)]
        dead: bool,
    },
}

/// The scheduler modes `drift` can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DriftMode {
    FixedRate,
    FixedDelay,
}

fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    match humantime::parse_duration(s) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err("must be longer than zero".into()),
        Err(e) => Err(format!("{s:?} is not a duration ({e})")),
    }
}

fn parse_job(s: &str) -> Result<JobName, String> {
    [JobName::FineSettlement, JobName::OverdueAccrual]
        .into_iter()
        .find(|j| j.as_str() == s)
        .ok_or_else(|| format!("{s:?} is not fine-settlement or overdue-accrual"))
}

fn parse_reprocess(s: &str) -> Result<Reprocess, String> {
    Reprocess::parse(s).ok_or_else(|| format!("{s:?} is not missing, failed or all"))
}

fn parse_month(s: &str) -> Result<NaiveDate, String> {
    NaiveDate::parse_from_str(&format!("{s}-01"), "%Y-%m-%d")
        .map_err(|_| format!("{s:?} is not a month like 2026-10"))
}
