//! The claim protocol's statements: insert, else take over (or, by mode, re-open or force a SUCCESS row), else
//! skip. Each is one short statement that also appends its history row. Which row a claim may take — the
//! takeover rule — is written here, in the take-over statement's `where` clause; the tick's forecast of it
//! ([`RunStatus::taken_by`]) sits beside it and a test checks that they agree on every state.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{millis, RunStatus};
use crate::{jobs::RunKey, store::Db};

/// How a claim was won.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimKind {
    /// No row existed: this replica inserted it with epoch 1.
    Inserted,
    /// The row was FAILED, or RUNNING with an expired lease: this replica bumped the epoch.
    TakenOver,
    /// An operator's `--force` re-run: the row (possibly SUCCESS) was taken over and its cursor reset.
    Forced,
    /// A SUCCESS key whose business date still has rows to do (a return recorded after the month was settled
    /// and back-dated into it, a row libraryd kept locked): taken again under `epoch + 1`, from the start of
    /// the key (only rows still to do are found), counters kept.
    Reopened,
}

impl ClaimKind {
    /// The claim's `job_run_attempts` event, as the claim statements write it.
    pub fn event(self) -> &'static str {
        match self {
            ClaimKind::Inserted => "claimed",
            ClaimKind::TakenOver => "takeover",
            ClaimKind::Forced => "forced",
            ClaimKind::Reopened => "reopened",
        }
    }

    /// The kind whose history event is `event`: the take-over statement decides the kind once, as the event it
    /// writes, and returns it.
    fn of_event(event: &str) -> Result<Self, sqlx::Error> {
        [
            ClaimKind::Inserted,
            ClaimKind::TakenOver,
            ClaimKind::Forced,
            ClaimKind::Reopened,
        ]
        .into_iter()
        .find(|k| k.event() == event)
        .ok_or_else(|| sqlx::Error::Decode(format!("{event:?} is not a claim's history event").into()))
    }
}

/// Which rows a claim may take besides an absent, FAILED or expired one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimMode {
    /// Only what is free: no row, FAILED, or RUNNING with an expired lease.
    Free,
    /// Also a SUCCESS row, which is re-opened (the caller has seen that it has rows left to do).
    Reopen,
    /// Also a SUCCESS row, restarted from the beginning with its counters reset (an operator's `--force`).
    Force,
}

/// The current holder of a key this replica did not get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub status: RunStatus,
    pub owner: String,
    pub epoch: i64,
    pub lease_until: DateTime<Utc>,
}

/// The result of trying to claim a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This replica owns the run under `epoch`, resuming after `cursor` (the last id a committed batch covered).
    Won {
        epoch: i64,
        cursor: Option<i64>,
        kind: ClaimKind,
    },
    /// Someone finished it, or a live owner holds it.
    Skipped(Holder),
}

impl RunStatus {
    /// Whether a claim in `mode` would take a row of this status whose lease has (`expired`) or has not run out:
    /// FAILED, or RUNNING with an expired lease, always; SUCCESS only when re-opened or forced; a live RUNNING
    /// owner never. This is the take-over statement's `where` clause ([`claim`]) as the tick and a dry run
    /// forecast it from a row they read; it is the only copy of that rule outside the statement, and
    /// `the_tick_s_action_and_the_claim_agree_on_every_state` checks the two against each other.
    pub fn taken_by(self, expired: bool, mode: ClaimMode) -> bool {
        match self {
            RunStatus::Failed => true,
            RunStatus::Running => expired,
            RunStatus::Success => mode != ClaimMode::Free,
        }
    }
}

/// Claims `key` for `owner`: insert, else take over (or, by `mode`, re-open or force a SUCCESS row), else skip
/// (docs/how-it-works.md, "How a settlement run works"). A run claims through [`super::ClaimedRun::claim`],
/// which wraps a won claim into the handle the rest of the run goes through.
pub async fn claim(
    pool: &Db,
    key: &RunKey,
    owner: &str,
    lease: Duration,
    mode: ClaimMode,
) -> Result<Claim, sqlx::Error> {
    match insert(pool, key, owner, lease).await? {
        Some(epoch) => Ok(Claim::Won {
            epoch,
            cursor: None,
            kind: ClaimKind::Inserted,
        }),
        None => take_over(pool, key, owner, lease, mode).await,
    }
}

/// The first step: inserts the key's row under epoch 1; its epoch if this replica did, `None` if the row exists.
async fn insert(pool: &Db, key: &RunKey, owner: &str, lease: Duration) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"with won as (
               insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch,
                                     started_at, heartbeat_at, lease_until)
               values ($1, $2, $3, $4, 'RUNNING', $5, 1, now(), now(), now() + $6 * interval '1 millisecond')
               on conflict on constraint job_runs_pkey do nothing
               returning job_name, business_date, shards, shard, epoch, owner
           ), history as (
               insert into job_run_attempts (job_name, business_date, shards, shard, epoch, owner, event)
               select job_name, business_date, shards, shard, epoch, owner, 'claimed' from won
           )
           select epoch as "epoch!" from won"#,
        key.job.as_str(),
        key.business_date,
        key.shard.shards(),
        key.shard.shard(),
        owner,
        millis(lease) as f64,
    )
    .fetch_optional(pool)
    .await
}

/// The second step, once the row exists (a conflicting insert in flight is waited for, so it is committed by
/// now): take it over if it failed or its lease expired; re-open and force also take a SUCCESS row and walk it
/// from the beginning (a re-open finds only the rows still to do and keeps the key's counters; a forced run
/// resets them). A live RUNNING owner is never displaced, not even by force. `prior` reads the row as it was
/// before the update, to say who holds it when we skip and which kind of claim this was; the kind is decided
/// once, as the history event, and returned.
async fn take_over(
    pool: &Db,
    key: &RunKey,
    owner: &str,
    lease: Duration,
    mode: ClaimMode,
) -> Result<Claim, sqlx::Error> {
    let row = sqlx::query!(
        r#"with prior as (
               select status, owner, epoch, lease_until from job_runs
               where job_name = $1 and business_date = $2 and shards = $3 and shard = $4
           ), taken as (
               update job_runs set
                   status = 'RUNNING', owner = $5, epoch = epoch + 1,
                   started_at = now(), heartbeat_at = now(), lease_until = now() + $6 * interval '1 millisecond',
                   finished_at = null, last_error = null,
                   cursor = case when $8 or status = 'SUCCESS' then null else cursor end,
                   scanned = case when $8 then 0 else scanned end,
                   updated = case when $8 then 0 else updated end
               where job_name = $1 and business_date = $2 and shards = $3 and shard = $4
                 and (status = 'FAILED'
                      or (status = 'RUNNING' and lease_until < now())
                      or ($7 and status = 'SUCCESS'))
               returning job_name, business_date, shards, shard, epoch, owner, cursor,
                         case when $8 then 'forced'
                              when (select status from prior) = 'SUCCESS' then 'reopened'
                              else 'takeover' end as event
           ), history as (
               insert into job_run_attempts (job_name, business_date, shards, shard, epoch, owner, event)
               select job_name, business_date, shards, shard, epoch, owner, event from taken
           )
           select prior.status as "status!: RunStatus", prior.owner as "owner!", prior.epoch as "epoch!",
                  prior.lease_until as "lease_until!",
                  taken.epoch as "new_epoch?", taken.cursor as "cursor?", taken.event as "event?"
           from prior left join taken on true"#,
        key.job.as_str(),
        key.business_date,
        key.shard.shards(),
        key.shard.shard(),
        owner,
        millis(lease) as f64,
        mode != ClaimMode::Free,
        mode == ClaimMode::Force,
    )
    .fetch_optional(pool)
    .await?;
    // No row: only reachable if it was deleted between the two statements (rows are kept forever; an operator
    // deleting one by hand is the only way). Reported as an error rather than guessed at.
    let r = row.ok_or(sqlx::Error::RowNotFound)?;
    match r.new_epoch {
        Some(epoch) => Ok(Claim::Won {
            epoch,
            // A SUCCESS row taken again (re-opened or forced) starts over: its cursor was reset.
            cursor: r.cursor,
            kind: ClaimKind::of_event(r.event.as_deref().unwrap_or_default())?,
        }),
        None => Ok(Claim::Skipped(Holder {
            status: r.status,
            owner: r.owner,
            epoch: r.epoch,
            lease_until: r.lease_until,
        })),
    }
}
