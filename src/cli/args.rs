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

/// The subcommands; each one's flags are a struct of their own, which its function in `cli::commands` takes.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the database migrations (idempotent).
    Migrate,
    /// Settle one business month (its last day) for one shard, and print a one-line JSON report.
    Settle(SettleArgs),
    /// Run the replica: tick on the schedule, settling every due business date of this shard.
    Run(RunArgs),
    /// Print what a tick at that time would claim (one JSON line per due key); writes nothing.
    Plan(PlanArgs),
    /// Measure the scheduler: run it with simulated work and print each tick's start, lag and gap.
    Drift(DriftArgs),
    /// Accrue one day's overdue fines for one shard (after retrying its due pending charges), and print a
    /// one-line JSON report with the shard's pending and dead counts.
    Accrue(AccrueArgs),
    /// Run every business date of a job in a range (month ends for settlement, days for accrual) for every
    /// shard, oldest first, through the same runner as the daemon: the catch-up after a long outage. Prints
    /// each run's report line, then a summary; exits 1 if any run failed.
    Backfill(BackfillArgs),
    /// The compensation queue of failed charges.
    Pending {
        #[command(subcommand)]
        action: PendingAction,
    },
    /// Show job_runs rows as a table (or the attempt history).
    Runs(RunsArgs),
    /// End a stuck claim now: the key becomes FAILED with its lease ended, so the next run takes it over under a
    /// new epoch (fencing out the old owner); recorded in the history with who and why.
    Release(ReleaseArgs),
    /// Audit a settled month; exit 3 on any violation.
    Verify(VerifyArgs),
    /// Validate the configuration and print the effective values (password redacted).
    CheckConfig,
    /// Insert deterministic demo loans (existing ids are left alone, so running it twice is a no-op).
    DemoData(DemoDataArgs),
    /// Pause a job on every replica (or one shard of it): from their next tick no replica claims its keys, and a
    /// run in progress hands its key back after its current batch. Stored in the database; idempotent.
    Pause(PauseArgs),
    /// Lift a pause set with `pause` (the same scope: the whole job, or the one shard); the next tick goes on
    /// from where the runs stopped.
    Resume(ResumeArgs),
    /// The fine rules in the database (fine_policies): one version per item class and first due date.
    Policy {
        #[command(subcommand)]
        action: PolicyAction,
    },
    /// The days the library is closed (library_closed_days), which are not charged.
    Calendar {
        #[command(subcommand)]
        action: CalendarAction,
    },
}

impl Command {
    /// Whether the command writes logs (so needs the subscriber): every one but the pure printers, which never
    /// did (`check-config` prints the configuration; `drift` measures the scheduler without a database).
    pub fn logs(&self) -> bool {
        !matches!(self, Command::CheckConfig | Command::Drift(_))
    }
}

/// `settle`'s flags.
#[derive(Debug, clap::Args)]
pub struct SettleArgs {
    /// The business date: the last day of the month to settle, e.g. 2026-10-31.
    #[arg(long, value_name = "D")]
    pub business_date: NaiveDate,
    #[command(flatten)]
    pub shard: ShardArgs,
    /// Re-run a key that already succeeded, from the beginning (rows already settled are not touched).
    #[arg(long)]
    pub force: bool,
    /// Run even though the job (or this shard) is paused.
    #[arg(long)]
    pub ignore_pause: bool,
}

/// `run`'s flags.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Do one tick, print its runs' reports, and exit (0 if every run settled or skipped).
    #[arg(long)]
    pub once: bool,
}

/// `plan`'s flags.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// The time of the tick (default: now, by the configured clock).
    #[arg(long, value_name = "RFC3339")]
    pub at: Option<DateTime<chrono::FixedOffset>>,
}

/// `drift`'s flags.
#[derive(Debug, clap::Args)]
pub struct DriftArgs {
    #[arg(long, value_enum)]
    pub mode: DriftMode,
    /// The period (fixed-rate) or delay (fixed-delay).
    #[arg(long, value_parser = parse_duration, default_value = "200ms")]
    pub period: std::time::Duration,
    /// Simulated work per tick.
    #[arg(long, value_parser = parse_duration, default_value = "80ms")]
    pub work: std::time::Duration,
    #[arg(long, default_value_t = 6)]
    pub ticks: usize,
    /// Print at most this many table rows (the summary covers all ticks).
    #[arg(long, default_value_t = 20)]
    pub rows: usize,
}

/// `accrue`'s flags.
#[derive(Debug, clap::Args)]
pub struct AccrueArgs {
    /// The accrual day, before today in time.zone.
    #[arg(long, value_name = "D")]
    pub date: NaiveDate,
    #[command(flatten)]
    pub shard: ShardArgs,
    /// Re-run a day that already succeeded (days already charged are not charged again).
    #[arg(long)]
    pub force: bool,
    /// Run even though the job (or this shard) is paused.
    #[arg(long)]
    pub ignore_pause: bool,
}

/// `backfill`'s flags.
#[derive(Debug, clap::Args)]
pub struct BackfillArgs {
    #[arg(long, value_name = "J", value_parser = parse_job)]
    pub job: JobName,
    /// The first day of the range.
    #[arg(long, value_name = "D1")]
    pub from: NaiveDate,
    /// The last day of the range (settlement: a month is included when its last day is in the range).
    #[arg(long, value_name = "D2")]
    pub to: NaiveDate,
    /// The shard count whose every shard runs (default: instance.shards).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub shards: Option<i64>,
    /// missing: keys absent or not SUCCESS, and SUCCESS keys with late rows; failed: only FAILED keys;
    /// all: every key, SUCCESS ones re-run as --force does.
    #[arg(long, value_name = "WHICH", value_parser = parse_reprocess, default_value = "missing")]
    pub reprocess: Reprocess,
    /// How many keys run at a time (at most database.max_connections).
    #[arg(long, value_name = "K", default_value_t = 1, allow_negative_numbers = true)]
    pub concurrency: i64,
    /// Print what each key would do and how many rows it would touch, then a summary; write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Run even where a pause covers the keys (and through a pause set while the backfill runs).
    #[arg(long)]
    pub ignore_pause: bool,
}

/// `runs`' flags.
#[derive(Debug, clap::Args)]
pub struct RunsArgs {
    /// Only this job (fine-settlement or overdue-accrual).
    #[arg(long, value_name = "J", value_parser = parse_job)]
    pub job: Option<JobName>,
    /// Only this business date.
    #[arg(long, value_name = "D")]
    pub business_date: Option<NaiveDate>,
    /// Show job_run_attempts instead: every claim, takeover, finish, failure, lost lease and release.
    #[arg(long)]
    pub history: bool,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `release`'s flags.
#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    #[arg(long, value_name = "J", value_parser = parse_job)]
    pub job: JobName,
    #[arg(long, value_name = "D")]
    pub business_date: NaiveDate,
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub shards: i64,
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub shard: i64,
    /// Why, for the history.
    #[arg(long, default_value = "released by an operator")]
    pub reason: String,
    /// Who, for the history (default: $USER@host).
    #[arg(long)]
    pub by: Option<String>,
}

/// `verify`'s flags.
#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// The business date (month end) to audit.
    #[arg(long, value_name = "D")]
    pub business_date: NaiveDate,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `demo-data`'s flags.
#[derive(Debug, clap::Args)]
pub struct DemoDataArgs {
    /// How many loans.
    #[arg(long, default_value_t = 5000)]
    pub loans: u64,
    /// The generator's seed.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// The month the loans cluster around, as YYYY-MM.
    #[arg(long, value_name = "YYYY-MM", value_parser = parse_month)]
    pub month: NaiveDate,
    /// The first loan id.
    #[arg(long, default_value_t = 1)]
    pub first_id: i64,
}

/// `pause`'s flags.
#[derive(Debug, clap::Args)]
pub struct PauseArgs {
    #[arg(long, value_name = "J", value_parser = parse_job)]
    pub job: JobName,
    #[command(flatten)]
    pub scope: PauseScopeArgs,
    /// Why, for the replicas' logs, `runs` and the history.
    #[arg(long, default_value = "paused by an operator")]
    pub reason: String,
    /// Who, for the history (default: $USER@host).
    #[arg(long)]
    pub by: Option<String>,
}

/// `resume`'s flags.
#[derive(Debug, clap::Args)]
pub struct ResumeArgs {
    #[arg(long, value_name = "J", value_parser = parse_job)]
    pub job: JobName,
    #[command(flatten)]
    pub scope: PauseScopeArgs,
    /// Who, for the history (default: $USER@host).
    #[arg(long)]
    pub by: Option<String>,
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
        /// Retry even though the accrual (or one of its shards) is paused.
        #[arg(long)]
        ignore_pause: bool,
    },
}

/// `policy`'s subcommands.
#[derive(Debug, Subcommand)]
pub enum PolicyAction {
    /// List every version: class, first due date, rate, grace, cap, closed-day rule, who, when, why.
    List {
        /// Print one JSON object a line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Add a version for loans of a class falling due from a date after today (in time.zone, by the database
    /// clock). The same version twice is a no-op; a different one for the same class and date is refused.
    Add(PolicyAddArgs),
}

/// `policy add`'s flags.
#[derive(Debug, clap::Args)]
pub struct PolicyAddArgs {
    /// The item class (`default` for loans with no class or no policy of their own), 1 to 64 characters.
    #[arg(long, value_name = "C")]
    pub class: String,
    /// The first due date the version governs; after today.
    #[arg(long, value_name = "D")]
    pub from: NaiveDate,
    /// Cents charged per chargeable day.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub daily_rate_cents: i64,
    /// Calendar days after the due date that are never charged.
    #[arg(long, value_name = "G", default_value_t = 0, allow_negative_numbers = true)]
    pub grace_days: i64,
    /// The most a loan is charged in all; 0 for no cap.
    #[arg(long, value_name = "X", default_value_t = 0, allow_negative_numbers = true)]
    pub cap_cents: i64,
    /// Charge the days the library is closed too.
    #[arg(long)]
    pub charge_closed_days: bool,
    /// Why, for the record.
    #[arg(long, value_name = "R", default_value = "")]
    pub reason: String,
    /// Who, for the record (default: $USER@host).
    #[arg(long, value_name = "B")]
    pub by: Option<String>,
}

/// `calendar`'s subcommands.
#[derive(Debug, Subcommand)]
pub enum CalendarAction {
    /// Close the days from D1 to D2 (default: D1 alone); days already closed are left as they are.
    Close(CalendarCloseArgs),
    /// Open the closed days from D1 to D2 (default: D1 alone).
    Open(CalendarRangeArgs),
    /// List the closed days (of a range, with --from and --to).
    List(CalendarListArgs),
}

/// `--from D1 [--to D2]` of `calendar close` and `calendar open`.
#[derive(Debug, clap::Args)]
pub struct CalendarRangeArgs {
    /// The first day.
    #[arg(long, value_name = "D1")]
    pub from: NaiveDate,
    /// The last day (default: the first), at most ten years after it.
    #[arg(long, value_name = "D2")]
    pub to: Option<NaiveDate>,
}

/// `calendar close`'s flags.
#[derive(Debug, clap::Args)]
pub struct CalendarCloseArgs {
    #[command(flatten)]
    pub range: CalendarRangeArgs,
    /// Why the library is closed (a holiday, the snow day).
    #[arg(long, value_name = "R")]
    pub reason: String,
    /// Who, for the record (default: $USER@host).
    #[arg(long, value_name = "B")]
    pub by: Option<String>,
}

/// `calendar list`'s flags.
#[derive(Debug, clap::Args)]
pub struct CalendarListArgs {
    /// The first day listed (with --to).
    #[arg(long, value_name = "D1", requires = "to")]
    pub from: Option<NaiveDate>,
    /// The last day listed (with --from).
    #[arg(long, value_name = "D2", requires = "from")]
    pub to: Option<NaiveDate>,
    /// Print one JSON object a line instead of a table.
    #[arg(long)]
    pub json: bool,
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
