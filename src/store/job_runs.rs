//! `job_runs` and `job_run_attempts`: the claim, the epoch fence and the finish of a run key.
//!
//! Every statement is short and runs on its own (never inside the long settlement work), and every write to a
//! claimed row is conditioned on `epoch = my_epoch`: a replica that lost its claim cannot change the row. Each
//! transition also appends its attempt-history row in the same statement, so history and state never disagree.
//! All times are the database's `now()`.
//!
//! By responsibility:
//! - [`claim`](mod@claim): the claim protocol's statements (insert, take over, re-open, force, skip);
//! - [`fence`](mod@fence): the one fenced statement a batch advances through and a waiting run renews by;
//! - [`finish`](mod@finish): the statements that end a claim (finish, lost lease, an operator's release);
//! - [`claimed`]: [`ClaimedRun`], a claimed run as one handle whose methods are those statements;
//! - [`tick`]: the tick's one status statement and what it decides for each key;
//! - [`history`]: what `runs` and `backfill` read.

pub mod claim;
pub mod claimed;
pub mod fence;
pub mod finish;
pub mod history;
pub mod tick;

use std::time::Duration;

use sqlx::{
    encode::IsNull,
    postgres::{PgArgumentBuffer, PgTypeInfo, PgValueRef},
    Postgres,
};

pub use self::{
    claim::{claim, Claim, ClaimKind, ClaimMode, Holder},
    claimed::{Claimed, ClaimedRun, Covered, LostRun, RunEnd},
    fence::{advance, renew, Fence, Progress},
    finish::{
        finish, hand_back_all_of, hand_back_unanswered_claim, record_lease_lost, release, Ending, Released,
    },
    history::{history, list, prune_history, range, Attempt, JobRun, RangeKey},
    tick::{tick_status, Action, DueKeys, KeyState, LateProbe, TickStatus, Unclaimed},
};

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Who holds a claim: the epoch it won and the process that won it. The fence, the renewal and the finish match
/// both: a standby promoted before it replayed a claim can give the same epoch to another process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claimant<'a> {
    pub epoch: i64,
    pub owner: &'a str,
}

/// The status column of `job_runs` (the table's check constraint admits only these). Decoded from and encoded
/// to its text; serialized as the column spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum RunStatus {
    /// Claimed; the owner's lease says until when.
    Running,
    Success,
    /// Ended on an error, a shutdown or a release; any run may take it over.
    Failed,
}

impl RunStatus {
    /// The column's text.
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "RUNNING",
            RunStatus::Success => "SUCCESS",
            RunStatus::Failed => "FAILED",
        }
    }

    /// The status the column's text `s` names, if any.
    pub fn parse(s: &str) -> Option<Self> {
        [RunStatus::Running, RunStatus::Success, RunStatus::Failed]
            .into_iter()
            .find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for RunStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

impl sqlx::Type<Postgres> for RunStatus {
    fn type_info() -> PgTypeInfo {
        <str as sqlx::Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <str as sqlx::Type<Postgres>>::compatible(ty)
    }
}

impl sqlx::Decode<'_, Postgres> for RunStatus {
    fn decode(value: PgValueRef<'_>) -> Result<Self, sqlx::error::BoxDynError> {
        let text = <&str as sqlx::Decode<Postgres>>::decode(value)?;
        RunStatus::parse(text).ok_or_else(|| format!("{text:?} is not a job_runs status").into())
    }
}

impl sqlx::Encode<'_, Postgres> for RunStatus {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, sqlx::error::BoxDynError> {
        <&str as sqlx::Encode<Postgres>>::encode_by_ref(&self.as_str(), buf)
    }
}
