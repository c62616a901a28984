//! The jobs: what a run key is, what a run reports, and the jobs themselves on top of one generic
//! claim → fenced batches → finish runner ([`runner`]).

pub mod accrual;
pub mod backfill;
pub mod oneshot;
pub mod runner;
pub mod settlement;
pub mod shard_walk;
pub mod throttle;

use std::fmt;

use chrono::NaiveDate;
use serde::Serialize;

use crate::shard::ShardSpec;

/// The jobs fine-settler runs; their names are part of the `job_runs` contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobName {
    /// Month-end settlement of returned loans' fines.
    FineSettlement,
    /// Daily accrual of overdue fines into the ledger.
    OverdueAccrual,
}

impl JobName {
    pub fn as_str(self) -> &'static str {
        match self {
            JobName::FineSettlement => "fine-settlement",
            JobName::OverdueAccrual => "overdue-accrual",
        }
    }
}

impl Serialize for JobName {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl fmt::Display for JobName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The unit of claiming: one job, one business date, one shard of one shard count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RunKey {
    pub job: JobName,
    pub business_date: NaiveDate,
    pub shard: ShardSpec,
}

/// How a run ended, as printed in the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// This replica claimed the key and finished it.
    Settled,
    /// Someone finished the key, or a live owner holds it.
    Skipped,
    /// The run stopped on an error (or a shutdown request); the key is FAILED and a later run resumes it.
    Failed,
    /// Another replica took the key over; this replica's uncommitted batch was rolled back.
    LeaseLost,
}

impl Outcome {
    /// The name used in reports and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Settled => "settled",
            Outcome::Skipped => "skipped",
            Outcome::Failed => "failed",
            Outcome::LeaseLost => "lease_lost",
        }
    }

    /// Exit code of a one-shot command: 0 when the key is done or someone else has it, 1 otherwise.
    pub fn exit_code(self) -> u8 {
        match self {
            Outcome::Settled | Outcome::Skipped => 0,
            Outcome::Failed | Outcome::LeaseLost => 1,
        }
    }
}

/// The one-line JSON report of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    pub job: &'static str,
    pub business_date: NaiveDate,
    pub shard: i32,
    pub shards: i32,
    pub outcome: Outcome,
    /// The epoch this replica ran under; for a skip, the holder's epoch; null if the claim itself failed.
    pub epoch: Option<i64>,
    /// Rows this attempt read.
    pub scanned: i64,
    /// Rows this attempt wrote (loans settled, charges).
    pub updated: i64,
    /// Ledger corrections this attempt appended (accrual only; 0 otherwise).
    pub corrections: i64,
    pub elapsed_ms: u64,
    /// Why the run failed, or who holds a skipped key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The key had succeeded and was re-opened for rows that arrived after its run (`updated` counts them).
    pub reopened: bool,
    /// For a key skipped because a live owner holds it: when that owner's lease ends (database time). Not part
    /// of the JSON report.
    #[serde(skip)]
    pub held_until: Option<chrono::DateTime<chrono::Utc>>,
    /// The run handed its key back because the job (or the shard) was paused meanwhile: whoever runs more keys
    /// of the job stops starting them. Not part of the JSON report (its `detail` says "paused: …").
    #[serde(skip)]
    pub paused: bool,
    /// The run failed because the server cannot write (SQLSTATE 25006): the daemon claims nothing more on it.
    /// Not part of the JSON report (its `detail` has the error).
    #[serde(skip)]
    pub read_only: bool,
    /// The run failed because the connection did (the server went away): the daemon stops its pass and treats
    /// it as an outage. Not part of the JSON report.
    #[serde(skip)]
    pub connection_lost: bool,
}

impl RunReport {
    /// The report of a run of `key` that ended `outcome`: no epoch, no rows, no detail, no flags — the setters
    /// below add what the run knows. `elapsed_ms` is set by whoever timed the run.
    pub fn new(key: RunKey, outcome: Outcome) -> Self {
        RunReport {
            job: key.job.as_str(),
            business_date: key.business_date,
            shard: key.shard.shard(),
            shards: key.shard.shards(),
            outcome,
            epoch: None,
            scanned: 0,
            updated: 0,
            corrections: 0,
            elapsed_ms: 0,
            detail: None,
            reopened: false,
            held_until: None,
            paused: false,
            read_only: false,
            connection_lost: false,
        }
    }

    /// The epoch the run held (for a skip: the holder's).
    pub fn with_epoch(self, epoch: i64) -> Self {
        RunReport {
            epoch: Some(epoch),
            ..self
        }
    }

    /// The rows the run read and wrote.
    pub fn with_counts(self, scanned: i64, updated: i64) -> Self {
        RunReport {
            scanned,
            updated,
            ..self
        }
    }

    /// The ledger corrections the run appended.
    pub fn with_corrections(self, corrections: i64) -> Self {
        RunReport { corrections, ..self }
    }

    /// Why the run failed, or who holds a skipped key.
    pub fn with_detail(self, detail: impl Into<String>) -> Self {
        RunReport {
            detail: Some(detail.into()),
            ..self
        }
    }

    /// Whether the run re-opened a SUCCESS key.
    pub fn with_reopened(self, reopened: bool) -> Self {
        RunReport { reopened, ..self }
    }

    /// For a skip: until when the live owner's lease runs.
    pub fn with_held_until(self, until: chrono::DateTime<chrono::Utc>) -> Self {
        RunReport {
            held_until: Some(until),
            ..self
        }
    }

    /// The run handed its key back because of a pause.
    pub fn with_paused(self) -> Self {
        RunReport { paused: true, ..self }
    }

    /// Notes a failure: its text becomes the detail (the last one noted wins) and what it says of the server
    /// (read-only, the connection lost) is added to the flags.
    pub fn failed_by(self, error: &runner::JobError) -> Self {
        RunReport {
            detail: Some(error.to_string()),
            read_only: self.read_only || error.read_only(),
            connection_lost: self.connection_lost || error.connection_lost(),
            ..self
        }
    }
}
