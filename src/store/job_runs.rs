//! `job_runs` and `job_run_attempts`: the claim, the epoch fence and the finish of a run key.
//!
//! Every statement is short and runs on its own (never inside the long settlement work), and every write to a
//! claimed row is conditioned on `epoch = my_epoch`: a replica that lost its claim cannot change the row. Each
//! transition also appends its attempt-history row in the same statement, so history and state never disagree.
//! All times are the database's `now()`.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use sqlx::{
    encode::IsNull,
    postgres::{PgArgumentBuffer, PgTypeInfo, PgValueRef},
    PgConnection, Postgres,
};

use super::Db;
use crate::jobs::RunKey;

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

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Claims `key` for `owner`: insert, else take over (or, by `mode`, re-open or force a SUCCESS row), else skip
/// (README, "How a settlement run works").
pub async fn claim(
    pool: &Db,
    key: &RunKey,
    owner: &str,
    lease: Duration,
    mode: ClaimMode,
) -> Result<Claim, sqlx::Error> {
    let inserted = sqlx::query_scalar!(
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
    .await?;
    if let Some(epoch) = inserted {
        return Ok(Claim::Won {
            epoch,
            cursor: None,
            kind: ClaimKind::Inserted,
        });
    }

    // The row exists (a conflicting insert in flight is waited for, so it is committed by now). Take it over if
    // it failed or its lease expired; re-open and force also take a SUCCESS row and walk it from the beginning
    // (a re-open finds only the rows still to do and keeps the key's counters; a forced run resets them). A
    // live RUNNING owner is never displaced, not even by force. `prior` reads the row as it was before the
    // update, to say who holds it when we skip and which kind of claim this was.
    let take_success = mode != ClaimMode::Free;
    let force = mode == ClaimMode::Force;
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
               returning job_name, business_date, shards, shard, epoch, owner, cursor
           ), history as (
               insert into job_run_attempts (job_name, business_date, shards, shard, epoch, owner, event)
               select job_name, business_date, shards, shard, epoch, owner,
                      case when $8 then 'forced'
                           when (select status from prior) = 'SUCCESS' then 'reopened'
                           else 'takeover' end
               from taken
           )
           select prior.status as "status!: RunStatus", prior.owner as "owner!", prior.epoch as "epoch!",
                  prior.lease_until as "lease_until!",
                  taken.epoch as "new_epoch?", taken.cursor as "cursor?"
           from prior left join taken on true"#,
        key.job.as_str(),
        key.business_date,
        key.shard.shards(),
        key.shard.shard(),
        owner,
        millis(lease) as f64,
        take_success,
        force,
    )
    .fetch_optional(pool)
    .await?;

    match row {
        Some(r) => match r.new_epoch {
            Some(epoch) => Ok(Claim::Won {
                epoch,
                // A SUCCESS row taken again (re-opened or forced) starts over: its cursor was reset.
                cursor: r.cursor,
                kind: match (force, r.status) {
                    (true, _) => ClaimKind::Forced,
                    (false, RunStatus::Success) => ClaimKind::Reopened,
                    (false, _) => ClaimKind::TakenOver,
                },
            }),
            None => Ok(Claim::Skipped(Holder {
                status: r.status,
                owner: r.owner,
                epoch: r.epoch,
                lease_until: r.lease_until,
            })),
        },
        // Only reachable if the row was deleted between the two statements (rows are kept forever; an operator
        // deleting one by hand is the only way). Report it as an error rather than guess.
        None => Err(sqlx::Error::RowNotFound),
    }
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
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "RUNNING",
            RunStatus::Success => "SUCCESS",
            RunStatus::Failed => "FAILED",
        }
    }

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

/// What a tick does with a due key, by what it saw of the key's row and whether a pause covers the key.
/// [`KeyState::action`] is the only place that decides it, and it decides as [`claim`] does: `claim` (in
/// [`ClaimMode::Free`]) wins exactly the keys whose action is `Claim` or `Takeover`, and [`ClaimMode::Reopen`]
/// the `Reopen` ones. A paused key is never tried (`claim` does not look at pauses: the tick does not call it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// No row yet: insert it under epoch 1.
    Claim,
    /// FAILED, or RUNNING with an expired lease: take it over under a new epoch.
    Takeover,
    /// SUCCESS, but rows of its business date are still to do: re-open it.
    Reopen,
    /// SUCCESS with nothing left, or a live owner holds it.
    Skip,
    /// An operator paused the job (or this shard of it): not claimed until it is resumed. A SUCCESS key with
    /// nothing left stays `Skip`.
    Paused,
}

impl Action {
    /// The action for a key whose row is `state` (`None`: no row), `paused` or not.
    pub fn of(state: Option<&KeyState>, paused: bool) -> Self {
        match state {
            Some(s) => s.action(paused),
            None if paused => Action::Paused,
            None => Action::Claim,
        }
    }

    /// Whether a tick runs the key: anything but a SUCCESS key with nothing left, or a paused key. (A key a
    /// live owner holds is tried too: its claim is skipped, and the tick learns when the lease ends.)
    pub fn runs(state: Option<&KeyState>, paused: bool) -> bool {
        !state.is_some_and(KeyState::done) && !paused
    }
}

/// Progress of one committed batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// The key's cursor as this run last committed it (or claimed it): the fence passes only if the key still has
    /// it. After a failover a promoted standby may lack the old primary's last batches (and their cursor); a run
    /// that goes on from its own cursor there would skip their rows.
    pub after: Option<i64>,
    /// The last id the batch covered; the next batch starts after it.
    pub cursor: i64,
    pub scanned: i64,
    pub updated: i64,
}

/// What the fence found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fence {
    /// Another epoch owns the key: the caller must roll back.
    Lost,
    /// The batch may commit. `paused`: a pause covering the key (who, why) was committed before the fence ran,
    /// so the run must hand the key back after committing this batch.
    Passed { paused: Option<(String, String)> },
}

/// The fence, run inside the batch's transaction after its business writes: advances cursor and counters and
/// renews the lease, only while `epoch` and `owner` still hold the key ([`Fence::Lost`] otherwise: the claim was
/// lost and the caller must roll back). The owner as well as the epoch: a standby promoted before it replayed a
/// run's claim can give the same epoch to another replica, and the run must not pass that one's fence. It also says whether a pause now covers the key: the same statement reads
/// `job_pauses` (a primary-key lookup in a table of a few rows), so a run learns of a pause at the end of the
/// batch in flight without a statement of its own. A pause never makes the fence fail: it only asks the run
/// to stop after this batch.
///
/// The row lock taken here serialises with a takeover: a takeover waits for an in-flight batch and then sees the
/// renewed lease; a batch that runs after a takeover sees the new epoch and matches nothing.
///
/// The lease is renewed from `clock_timestamp()`, the moment the fence runs, not from `now()`, which is the
/// start of the batch transaction: a batch that took almost `batch_timeout` would otherwise leave its owner
/// only `lease - batch_timeout` until the next batch must commit.
pub async fn advance(
    tx: &mut PgConnection,
    key: &RunKey,
    holder: Claimant<'_>,
    progress: Progress,
    lease: Duration,
) -> Result<Fence, sqlx::Error> {
    let fenced = sqlx::query!(
        r#"with fenced as (
               update job_runs set
                   cursor = $6, scanned = scanned + $7, updated = updated + $8,
                   heartbeat_at = clock_timestamp(),
                   lease_until = clock_timestamp() + $9 * interval '1 millisecond'
               where job_name = $1 and business_date = $2 and shards = $3 and shard = $4
                 and status = 'RUNNING' and epoch = $5 and cursor is not distinct from $10 and owner = $11
               returning 1
           ), pause as (
               -- The whole job's pause before this shard's own.
               select paused_by, reason from job_pauses
               where job_name = $1 and ((shards = 0 and shard = 0) or (shards = $3 and shard = $4))
               order by shards
               limit 1
           )
           select pause.paused_by as "paused_by?", pause.reason as "reason?"
           from fenced left join pause on true"#,
        key.job.as_str(),
        key.business_date,
        key.shard.shards(),
        key.shard.shard(),
        holder.epoch,
        progress.cursor,
        progress.scanned,
        progress.updated,
        millis(lease) as f64,
        progress.after,
        holder.owner,
    )
    .fetch_optional(&mut *tx)
    .await?;
    Ok(match fenced {
        None => Fence::Lost,
        Some(row) => Fence::Passed {
            paused: row.paused_by.zip(row.reason),
        },
    })
}

/// Renews the lease of a run that waits between batches (the throttle) through the same fence as a batch: only
/// while the key is RUNNING under `epoch` and `owner` at the run's last committed `cursor`. Also tells, as the batch fence
/// does, whether a pause covers the key, so that a long wait still honours an operator's pause.
pub async fn renew(
    pool: &Db,
    key: &RunKey,
    holder: Claimant<'_>,
    cursor: Option<i64>,
    lease: Duration,
) -> Result<Fence, sqlx::Error> {
    let renewed = sqlx::query!(
        r#"with fenced as (
               update job_runs set
                   heartbeat_at = clock_timestamp(),
                   lease_until = clock_timestamp() + $6 * interval '1 millisecond'
               where job_name = $1 and business_date = $2 and shards = $3 and shard = $4
                 and status = 'RUNNING' and epoch = $5 and cursor is not distinct from $7 and owner = $8
               returning 1
           ), pause as (
               select paused_by, reason from job_pauses
               where job_name = $1 and ((shards = 0 and shard = 0) or (shards = $3 and shard = $4))
               order by shards
               limit 1
           )
           select pause.paused_by as "paused_by?", pause.reason as "reason?"
           from fenced left join pause on true"#,
        key.job.as_str(),
        key.business_date,
        key.shard.shards(),
        key.shard.shard(),
        holder.epoch,
        millis(lease) as f64,
        cursor,
        holder.owner,
    )
    .fetch_optional(pool)
    .await?;
    Ok(match renewed {
        None => Fence::Lost,
        Some(row) => Fence::Passed {
            paused: row.paused_by.zip(row.reason),
        },
    })
}

/// Who holds a claim: the epoch it won and the process that won it. The fence, the renewal and the finish match
/// both: a standby promoted before it replayed a claim can give the same epoch to another process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claimant<'a> {
    pub epoch: i64,
    pub owner: &'a str,
}

/// How a run ended, as written to `job_runs` and `job_run_attempts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending<'a> {
    Success,
    /// FAILED with this `last_error`; the lease ends now, so a peer may take over at its next tick.
    Failed(&'a str),
}

/// Finishes the run held under `epoch` by `owner`. `scanned`/`updated` are this attempt's own counts, for the
/// history. Returns `false` if they no longer hold the key (the claim was lost) — or, for a SUCCESS, if the key's
/// cursor is not `cursor`, the run's last committed one (see [`Progress::after`]).
///
/// The statement is safe to retry after a connection error: if an earlier attempt committed (the reply was
/// lost with the connection), the row is already in the target state under this epoch, which counts as
/// finished — it is not a lost lease — and no second history row is written.
pub async fn finish(
    pool: &Db,
    key: &RunKey,
    holder: Claimant<'_>,
    cursor: Option<i64>,
    ending: Ending<'_>,
    scanned: i64,
    updated: i64,
) -> Result<bool, sqlx::Error> {
    let (status, event, error) = match ending {
        Ending::Success => (RunStatus::Success, "success", None),
        Ending::Failed(e) => (RunStatus::Failed, "failed", Some(e)),
    };
    let finished = sqlx::query_scalar!(
        r#"with done as (
               update job_runs set status = $6, last_error = $8, finished_at = now(), heartbeat_at = now(),
                                   lease_until = now()
               where job_name = $1 and business_date = $2 and shards = $3 and shard = $4
                 and status = 'RUNNING' and epoch = $5 and owner = $12
                 -- SUCCESS only where the key's cursor is the run's last: a promoted standby lacking the run's
                 -- last batches keeps the key RUNNING, and its takeover settles their rows again.
                 and ($6 <> 'SUCCESS' or cursor is not distinct from $11)
               returning job_name, business_date, shards, shard, epoch, owner
           ), history as (
               insert into job_run_attempts (job_name, business_date, shards, shard, epoch, owner, event,
                                             scanned, updated, error)
               select job_name, business_date, shards, shard, epoch, owner, $7, $9, $10, $8 from done
           )
           select count(*) as "finished!" from done"#,
        key.job.as_str(),
        key.business_date,
        key.shard.shards(),
        key.shard.shard(),
        holder.epoch,
        status.as_str(),
        event,
        error,
        scanned,
        updated,
        cursor,
        holder.owner,
    )
    .fetch_one(pool)
    .await?;
    if finished == 1 {
        return Ok(true);
    }
    // Nothing matched: either another epoch owns the key, or an earlier attempt of this finish committed (and,
    // if it was still committing when this one started, the update waited for it). A new statement sees the row
    // as committed now.
    let now = sqlx::query_scalar!(
        r#"select exists (select 1 from job_runs
                          where job_name = $1 and business_date = $2 and shards = $3 and shard = $4
                            and status = $6 and epoch = $5 and owner = $7) as "already!""#,
        key.job.as_str(),
        key.business_date,
        key.shard.shards(),
        key.shard.shard(),
        holder.epoch,
        status.as_str(),
        holder.owner,
    )
    .fetch_one(pool)
    .await?;
    Ok(now)
}

/// Appends a `lease_lost` history row: this replica found its epoch superseded. History only; the key's row
/// belongs to the new owner and is not touched.
pub async fn record_lease_lost(
    pool: &Db,
    key: &RunKey,
    epoch: i64,
    owner: &str,
    scanned: i64,
    updated: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        r#"insert into job_run_attempts (job_name, business_date, shards, shard, epoch, owner, event,
                                         scanned, updated, error)
           values ($1, $2, $3, $4, $5, $6, 'lease_lost', $7, $8, 'another replica took over the key')"#,
        key.job.as_str(),
        key.business_date,
        key.shard.shards(),
        key.shard.shard(),
        epoch,
        owner,
        scanned,
        updated,
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// One `job_runs` row, for `runs`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct JobRun {
    pub job_name: String,
    pub business_date: NaiveDate,
    pub shards: i32,
    pub shard: i32,
    pub status: RunStatus,
    pub owner: String,
    pub epoch: i64,
    pub started_at: DateTime<Utc>,
    pub heartbeat_at: DateTime<Utc>,
    pub lease_until: DateTime<Utc>,
    /// Seconds of lease left (0 when expired or finished), by the database clock.
    pub lease_left_s: f64,
    pub finished_at: Option<DateTime<Utc>>,
    pub cursor: Option<i64>,
    pub scanned: i64,
    pub updated: i64,
    pub last_error: Option<String>,
}

/// The `job_runs` rows, optionally for one job and/or business date, newest business date first.
pub async fn list(
    pool: &Db,
    job: Option<&str>,
    business_date: Option<NaiveDate>,
) -> Result<Vec<JobRun>, sqlx::Error> {
    sqlx::query_as!(
        JobRun,
        r#"select job_name, business_date, shards, shard, status as "status: RunStatus", owner, epoch,
                  started_at, heartbeat_at,
                  lease_until,
                  greatest(0, extract(epoch from lease_until - now()))::float8 as "lease_left_s!",
                  finished_at, cursor, scanned, updated, last_error
           from job_runs
           where ($1::text is null or job_name = $1) and ($2::date is null or business_date = $2)
           order by business_date desc, job_name, shards, shard"#,
        job,
        business_date,
    )
    .fetch_all(pool)
    .await
}

/// The state of one key of a backfill's range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeKey {
    pub business_date: NaiveDate,
    pub shard: i32,
    pub status: RunStatus,
    /// The lease has run out (by the database clock).
    pub expired: bool,
    /// The last id a committed batch covered: a takeover resumes after it.
    pub cursor: Option<i64>,
}

/// The `job_runs` rows of `job` under `shards` for business dates in `[first, last]` (`backfill`).
pub async fn range(
    pool: &Db,
    job: &str,
    (first, last): (NaiveDate, NaiveDate),
    shards: i32,
) -> Result<Vec<RangeKey>, sqlx::Error> {
    sqlx::query_as!(
        RangeKey,
        r#"select business_date, shard, status as "status: RunStatus", lease_until < now() as "expired!",
                  cursor
           from job_runs
           where job_name = $1 and shards = $2 and business_date between $3 and $4
           order by business_date, shard"#,
        job,
        shards,
        first,
        last,
    )
    .fetch_all(pool)
    .await
}

/// A `job_runs` row of this shard, as a tick sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyState {
    pub job_name: String,
    pub business_date: NaiveDate,
    pub status: RunStatus,
    pub owner: String,
    /// The lease has run out (by the database clock).
    pub expired: bool,
    /// A SUCCESS key whose business date has rows still to do (see [`LateProbe`]): it is re-opened.
    pub late: bool,
}

impl KeyState {
    /// What a tick does with the key: the rule of [`claim`]'s `where` clause (FAILED, or RUNNING with an
    /// expired lease, is taken over; a live owner is never displaced), plus re-opening late SUCCESS keys; while
    /// `paused`, nothing but a finished key's skip.
    pub fn action(&self, paused: bool) -> Action {
        match self.status {
            _ if self.done() => Action::Skip,
            _ if paused => Action::Paused,
            RunStatus::Success if self.late => Action::Reopen,
            RunStatus::Success => Action::Skip,
            RunStatus::Failed => Action::Takeover,
            RunStatus::Running if self.expired => Action::Takeover,
            RunStatus::Running => Action::Skip,
        }
    }

    /// SUCCESS with nothing left to do.
    pub fn done(&self) -> bool {
        self.status == RunStatus::Success && !self.late
    }
}

/// Which SUCCESS keys the tick status also checks for rows still to do, and the policy that says what is still
/// to do. A date of `None` turns the job's probe off (the job is disabled).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LateProbe {
    /// Settlement keys from this business date on: any unsettled loan of the shard returned in the month.
    pub settlement_since: Option<NaiveDate>,
    /// Accrual keys from this day on: any loan of the shard overdue on the day and neither charged nor queued
    /// for it, and under the cap.
    pub accrual_since: Option<NaiveDate>,
    pub grace_days: i32,
    /// 0 = no cap.
    pub cap_cents: i64,
}

/// What a tick sees before it claims anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TickStatus {
    /// The database clock.
    pub now: DateTime<Utc>,
    /// This shard's `job_runs` rows in the window.
    pub keys: Vec<KeyState>,
    /// This shard's pending charges due for a retry.
    pub due_pending: i64,
    /// This shard's PENDING and DEAD charges.
    pub pending: i64,
    pub dead: i64,
    /// The pauses covering this shard, at most one per job (the whole job's before the shard's own).
    pub pauses: Vec<crate::store::pauses::Pause>,
}

/// Everything a tick needs to know before it claims anything, in one statement: the database clock, this
/// shard's `job_runs` rows for business dates from `since` on — each SUCCESS key in `late`'s window with
/// whether rows of it are still to do — how many of its pending charges are due, and the pauses that cover the
/// shard (`job_pauses`, a table of a few rows, aggregated into arrays on the one first row). An idle tick costs
/// exactly this one round trip.
///
/// The settlement probe is the predicate [`crate::store::loans::month_has_unsettled`] asks for one key (and the
/// one the batches select); it reads the partial index of unsettled loans by return date: a settled month has no
/// entry in it, so the probe costs one index descent per key. The accrual probe is the SQL function
/// `fine_settler_uncharged_days` (a migration), asked once for the whole window (and by
/// [`crate::store::ledger::day_has_uncharged`] for one day): it walks the overdue loans still out and counts each
/// one's ledger rows in the window, which is why the daemon asks it only every `accrual.recheck_every`.
pub async fn tick_status(
    conn: &mut PgConnection,
    shard: crate::shard::ShardSpec,
    since: NaiveDate,
    late: LateProbe,
) -> Result<TickStatus, sqlx::Error> {
    let rows = sqlx::query!(
        r#"with late_days as (
               -- Up to the latest accrual day that succeeded: the days after it have not been accrued at all.
               select fine_settler_uncharged_days(
                          $5::date,
                          (select max(business_date) from job_runs
                           where job_name = 'overdue-accrual' and shards = $1::int and shard = $2::int
                             and status = 'SUCCESS' and business_date >= $5::date),
                          $1::int, $2::int, $6::int, $7::bigint) as d
           )
           select t.now as "now!", t.due_pending as "due_pending!", t.pending as "pending!", t.dead as "dead!",
                  t.in_recovery as "in_recovery!", t.read_only as "read_only!",
                  pz.jobs as "paused_jobs!", pz.shards as "paused_shards!", pz.bys as "paused_by!",
                  pz.reasons as "paused_reasons!", pz.since as "paused_since!",
                  r.job_name as "job_name?", r.business_date as "business_date?",
                  r.status as "status?: RunStatus", r.owner as "owner?", (r.lease_until < t.now) as "expired?",
                  (r.status = 'SUCCESS' and (
                       (r.job_name = 'fine-settlement' and r.business_date >= $4::date and exists (
                            select 1 from loans l
                            where l.fine_settled_at is null and l.returned_on is not null
                              and l.returned_on between date_trunc('month', r.business_date)::date
                                                    and r.business_date
                              and l.id % $1::int = $2::int))
                    or (r.job_name = 'overdue-accrual' and r.business_date in (select d from late_days)))
                  ) as "late?"
           from (select now() as now, pg_is_in_recovery() as in_recovery,
                        current_setting('transaction_read_only') = 'on' as read_only,
                        (select count(*) from fine_pending p
                         where p.status = 'PENDING' and p.next_attempt_at <= now()
                           and p.loan_id % $1::int = $2::int) as due_pending,
                        (select count(*) filter (where p.status = 'PENDING') from fine_pending p
                         where p.loan_id % $1::int = $2::int) as pending,
                        (select count(*) filter (where p.status = 'DEAD') from fine_pending p
                         where p.loan_id % $1::int = $2::int) as dead) t
           cross join (select coalesce(array_agg(p.job_name order by p.job_name, p.shards), '{}') as jobs,
                              coalesce(array_agg(p.shards order by p.job_name, p.shards), '{}') as shards,
                              coalesce(array_agg(p.paused_by order by p.job_name, p.shards), '{}') as bys,
                              coalesce(array_agg(p.reason order by p.job_name, p.shards), '{}') as reasons,
                              coalesce(array_agg(p.paused_at order by p.job_name, p.shards), '{}') as since
                       from job_pauses p
                       where (p.shards = 0 and p.shard = 0) or (p.shards = $1::int and p.shard = $2::int)) pz
           left join job_runs r
             on r.shards = $1::int and r.shard = $2::int
            and r.business_date >= $3"#,
        shard.shards(),
        shard.shard(),
        since,
        // A disabled probe asks from a date no key has, so that its subqueries are never evaluated.
        late.settlement_since.unwrap_or(NaiveDate::MAX),
        late.accrual_since.unwrap_or(NaiveDate::MAX),
        late.grace_days,
        late.cap_cents,
    )
    .fetch_all(&mut *conn)
    .await?;
    let (now, due_pending, pending, dead) = rows
        .first()
        .map(|r| (r.now, r.due_pending, r.pending, r.dead))
        .ok_or(sqlx::Error::RowNotFound)?;
    if let Some(r) = rows.first() {
        super::ReadOnlyServer::check(r.in_recovery, r.read_only)?;
    }
    let mut pauses: Vec<crate::store::pauses::Pause> = Vec::new();
    if let Some(r) = rows.first() {
        let each = r.paused_jobs.iter().zip(&r.paused_shards).zip(&r.paused_by);
        for (((job, shards), by), (reason, since)) in each.zip(r.paused_reasons.iter().zip(&r.paused_since)) {
            // Ordered by job, the whole job's pause (shards = 0) first: keep the first of each job.
            if pauses.iter().any(|p| &p.job_name == job) {
                continue;
            }
            let scope = match *shards {
                0 => crate::store::pauses::PauseScope::Job,
                _ => crate::store::pauses::PauseScope::Shard(shard),
            };
            pauses.push(crate::store::pauses::Pause {
                job_name: job.clone(),
                scope,
                by: by.clone(),
                reason: reason.clone(),
                since: *since,
            });
        }
    }
    let keys = rows
        .into_iter()
        .filter_map(|r| {
            Some(KeyState {
                job_name: r.job_name?,
                business_date: r.business_date?,
                status: r.status?,
                owner: r.owner?,
                expired: r.expired?,
                late: r.late.unwrap_or(false),
            })
        })
        .collect();
    Ok(TickStatus {
        now,
        keys,
        due_pending,
        pending,
        dead,
        pauses,
    })
}

/// What `release` found and did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Released {
    /// The key's status before the release.
    pub status: RunStatus,
    pub epoch: i64,
    /// The owner whose lease was ended (or the last owner, if nothing was released).
    pub previous_owner: String,
    /// Whether a RUNNING claim was ended.
    pub released: bool,
}

/// Ends a RUNNING claim now (an operator's `release`): the key becomes FAILED with `lease_until = now()`, so the
/// next run takes it over under a new epoch and the old owner, if it is still alive, is fenced out. The release
/// is recorded in the history with who did it and why. `None` if the key does not exist.
pub async fn release(
    pool: &Db,
    key: &RunKey,
    by: &str,
    reason: &str,
) -> Result<Option<Released>, sqlx::Error> {
    let row = sqlx::query!(
        r#"with prior as (
               select status, owner, epoch from job_runs
               where job_name = $1 and business_date = $2 and shards = $3 and shard = $4
           ), ended as (
               update job_runs set status = 'FAILED', lease_until = now(), finished_at = now(),
                                   last_error = 'released by ' || $5 || ': ' || $6
               where job_name = $1 and business_date = $2 and shards = $3 and shard = $4 and status = 'RUNNING'
               returning job_name, business_date, shards, shard, epoch
           ), history as (
               insert into job_run_attempts (job_name, business_date, shards, shard, epoch, owner, event, error)
               select job_name, business_date, shards, shard, epoch, $5, 'released', $6 from ended
           )
           select prior.status as "status!: RunStatus", prior.owner as "owner!", prior.epoch as "epoch!",
                  exists (select 1 from ended) as "released!"
           from prior"#,
        key.job.as_str(),
        key.business_date,
        key.shard.shards(),
        key.shard.shard(),
        by,
        reason,
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| Released {
        status: r.status,
        epoch: r.epoch,
        previous_owner: r.owner,
        released: r.released,
    }))
}

/// One `job_run_attempts` row, for `runs --history`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Attempt {
    pub id: i64,
    pub job_name: String,
    pub business_date: NaiveDate,
    pub shards: i32,
    pub shard: i32,
    pub epoch: i64,
    pub owner: String,
    pub event: String,
    pub scanned: Option<i64>,
    pub updated: Option<i64>,
    pub error: Option<String>,
    pub at: DateTime<Utc>,
}

/// The attempt history, optionally for one job and/or business date, oldest first.
pub async fn history(
    pool: &Db,
    job: Option<&str>,
    business_date: Option<NaiveDate>,
) -> Result<Vec<Attempt>, sqlx::Error> {
    sqlx::query_as!(
        Attempt,
        r#"select id, job_name, business_date, shards, shard, epoch, owner, event, scanned, updated, error, at
           from job_run_attempts
           where ($1::text is null or job_name = $1) and ($2::date is null or business_date = $2)
           order by id"#,
        job,
        business_date,
    )
    .fetch_all(pool)
    .await
}

/// Deletes up to `limit` `job_run_attempts` rows older than `older_than`, oldest first; returns how many.
/// `job_runs` rows are never pruned: deduplication depends on them.
pub async fn prune_history(pool: &Db, older_than: Duration, limit: i64) -> Result<u64, sqlx::Error> {
    let done = sqlx::query!(
        r#"delete from job_run_attempts
           where id in (select id from job_run_attempts
                        where at < now() - $1 * interval '1 millisecond'
                        order by id
                        limit $2)"#,
        millis(older_than) as f64,
        limit,
    )
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}
