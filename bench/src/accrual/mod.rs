//! The accrual section: what the accrual ledger costs, measured on data generated around the accrual day (`data`).
//! - One accrual day: `fine-settler accrue --date D` against one set-based statement writing the same charges,
//!   for the current ledger and, with `--before-binary`, the ledger before canonical amounts, side by side
//!   (`day`).
//! - The re-check: a replica correcting back-dated returns by itself; the cost of a re-check with nothing
//!   queued and with changed loans queued, at several sizes of open overdue loans; the statements of an idle
//!   tick with accrual enabled (`recheck`).
//!
//! `report` turns the figures into the report's "Accrual" section, which `merge` can put into an existing
//! report in place of the one there (`--accrual-only --merge-into`).

mod data;
pub(crate) mod day;
mod recheck;
mod replica;
mod report;

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use chrono::NaiveDate;

pub(crate) use report::{measured_accrual, measured_all, merge, merge_section};

use crate::{Bench, Error};

/// The accrual window in days (`accrual.catch_up_days`, at its default): the days a re-check covers.
const WINDOW_DAYS: i64 = 7;

/// The zone business dates are computed in (`time.zone`, at its default): the accrual day is yesterday there.
const ZONE: &str = "Asia/Shanghai";

/// How the accrual section runs.
#[derive(Debug, Clone)]
pub(crate) struct AccrualArgs {
    /// Loans of the accrual-day template (and of the back-dated returns).
    pub loans: u64,
    /// Rounds of the accrual day (each way on a fresh copy in every round); the report takes the medians.
    pub rounds: u32,
    /// Batch size of `accrue` and of the replicas.
    pub batch: u32,
    /// Returns back-dated before charged days, for a replica to correct.
    pub returns: u64,
    /// Sizes (open overdue loans) at which the re-check's cost is measured.
    pub open_sizes: Vec<u64>,
    /// Changed loans queued for the re-check that must find them all.
    pub changed: u64,
    /// How long each ticking replica runs.
    pub tick_secs: u64,
    /// The `fine-settler` binary of the ledger before canonical amounts, measured beside the current one.
    pub before: Option<PathBuf>,
}

/// Which ledger a database has: the current one, or the one before canonical amounts (migrated by
/// `--before-binary`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Schema {
    Current,
    Before,
}

impl Schema {
    fn label(self) -> &'static str {
        match self {
            Schema::Current => "current ledger",
            Schema::Before => "ledger before canonical amounts",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Schema::Current => "current",
            Schema::Before => "before",
        }
    }
}

/// Everything the accrual section measured.
#[derive(Debug)]
pub(crate) struct Accrual {
    args: AccrualArgs,
    day: NaiveDate,
    /// The commit the `--before-binary` was built from, when it can be told.
    before_commit: Option<String>,
    /// The machine's 1-minute load average when the section started and when it ended.
    load: (String, String),
    /// The server's `jit_above_cost`.
    jit_above_cost: String,
    day_leg: day::DayLeg,
    backdated: recheck::Backdated,
    sizes: Vec<recheck::OpenSize>,
}

impl Bench {
    /// The accrual section, every measurement in turn; the databases it makes are dropped as soon as they are
    /// measured.
    pub(crate) async fn accrual(&self, args: &AccrualArgs) -> Result<Accrual, Error> {
        let load_before = load_average();
        let current = crate::binary()?;
        let before = match &args.before {
            Some(path) if !path.is_file() => {
                return Err(format!("--before-binary {}: no such file", path.display()).into())
            }
            Some(path) => Some(path.as_path()),
            None => None,
        };
        sqlx::raw_sql("create extension if not exists pg_stat_statements")
            .execute(&self.admin)
            .await?;
        let day = self.accrual_day().await?;
        let jit_above_cost: String = sqlx::query_scalar("select current_setting('jit_above_cost')")
            .fetch_one(&self.admin)
            .await?;
        eprintln!("== accrual: day {day}, {} loans", args.loans);
        let day_leg = self
            .day_leg(&current, before, args.loans, day, args.batch, args.rounds)
            .await?;
        let backdated = self
            .backdated(&current, args.loans, day, args.batch, args.returns)
            .await?;
        self.drop_db(&template_name(Schema::Current, args.loans)).await?;
        let mut sizes = Vec::new();
        for n in &args.open_sizes {
            sizes.push(self.open_size(&current, *n, day, args).await?);
        }
        Ok(Accrual {
            args: args.clone(),
            day,
            before_commit: before.and_then(commit_of),
            load: (load_before, load_average()),
            jit_above_cost,
            day_leg,
            backdated,
            sizes,
        })
    }

    /// The accrual day: yesterday in the replicas' zone, by the database clock (the latest day a replica
    /// accrues).
    async fn accrual_day(&self) -> Result<NaiveDate, Error> {
        Ok(sqlx::query_scalar("select (now() at time zone $1)::date - 1")
            .bind(ZONE)
            .fetch_one(&self.admin)
            .await?)
    }

    /// Fails if the accrual day is no longer `day` (the replicas' midnight passed during the section: their
    /// window moved, and the measurements after it would not be what they claim).
    async fn still_day(&self, day: NaiveDate) -> Result<(), Error> {
        let now = self.accrual_day().await?;
        if now != day {
            return Err(
                format!("the accrual day moved from {day} to {now} during the run; run it again").into(),
            );
        }
        Ok(())
    }
}

/// Whether a process's sessions use PostgreSQL's JIT compilation as the server says (on by default, for any
/// statement whose estimated cost is over `jit_above_cost`), or not at all (`PGOPTIONS=-c jit=off`, which the
/// product's connections honour as libpq's do): measured both ways where compiling costs more than running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Jit {
    Server,
    Off,
}

/// The template of the accrual day for `schema` and `loans`.
fn template_name(schema: Schema, loans: u64) -> String {
    format!("fsb_accrual_{}_{loans}", schema.short())
}

/// A `fine-settler` process of this section on database `url`: the section's policy, accrual enabled in batches
/// of `batch`, settlement enabled or not, JIT as `jit` says, logs at `log` (JSON on stderr).
fn process(binary: &Path, url: &str, batch: u32, settlement: bool, jit: Jit, log: &str) -> Command {
    let mut cmd = Command::new(binary);
    if jit == Jit::Off {
        cmd.env("PGOPTIONS", "-c jit=off");
    }
    cmd.env("DATABASE_URL", url)
        .env("FINE_SETTLER__LOG__LEVEL", log)
        .env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
        .env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", batch.to_string())
        .env("FINE_SETTLER__SETTLEMENT__ENABLED", settlement.to_string())
        .envs(data::policy_env())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// The machine's 1-minute load average (`/proc/loadavg`).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}

/// The commit of the checkout a binary was built in (`<checkout>/target/release/fine-settler`), if it is one.
fn commit_of(binary: &Path) -> Option<String> {
    let checkout = binary.parent()?.parent()?.parent()?;
    let out = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(checkout)
        .output()
        .ok()?;
    let commit = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !commit.is_empty()).then_some(commit)
}
