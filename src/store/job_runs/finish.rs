//! The statements that end a claim: the run's own finish (SUCCESS, or FAILED with the lease ended), the history
//! row of a run that found its lease lost, and an operator's release of a RUNNING claim.

use super::{Claimant, RunStatus};
use crate::{jobs::RunKey, store::Db};

/// How a run ended, as written to `job_runs` and `job_run_attempts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending<'a> {
    Success,
    /// FAILED with this `last_error`; the lease ends now, so a peer may take over at its next tick.
    Failed(&'a str),
}

/// Finishes the run held under `epoch` by `owner`. `scanned`/`updated` are this attempt's own counts, for the
/// history. Returns `false` if they no longer hold the key (the claim was lost) — or, for a SUCCESS, if the key's
/// cursor is not `cursor`, the run's last committed one (see [`super::Progress::after`]).
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

/// Hands back whatever claim of `key` the process `owner` holds — a claim whose answer was lost with its
/// connection may have committed: FAILED with the lease ended and `last_error = error`, recorded in the history,
/// so that a peer (or this replica's next tick) takes it over at once instead of after the lease. Owners are
/// unique per process, so no other process's claim can match. Returns whether a claim was handed back; safe to
/// retry.
pub async fn hand_back_unanswered_claim(
    pool: &Db,
    key: &RunKey,
    owner: &str,
    error: &str,
) -> Result<bool, sqlx::Error> {
    let handed_back = sqlx::query_scalar!(
        r#"with done as (
               update job_runs set status = 'FAILED', last_error = $6, finished_at = now(), heartbeat_at = now(),
                                   lease_until = now()
               where job_name = $1 and business_date = $2 and shards = $3 and shard = $4
                 and status = 'RUNNING' and owner = $5
               returning job_name, business_date, shards, shard, epoch, owner
           ), history as (
               insert into job_run_attempts (job_name, business_date, shards, shard, epoch, owner, event,
                                             scanned, updated, error)
               select job_name, business_date, shards, shard, epoch, owner, 'failed', 0, 0, $6 from done
           )
           select count(*) as "handed_back!" from done"#,
        key.job.as_str(),
        key.business_date,
        key.shard.shards(),
        key.shard.shard(),
        owner,
        error,
    )
    .fetch_one(pool)
    .await?;
    Ok(handed_back > 0)
}

/// Hands back every key the process `owner` left RUNNING (what [`hand_back_unanswered_claim`] does for one key),
/// when it stops running keys: at a clean stop nothing of its own is running, so any such row is a claim whose
/// answer was lost. Returns how many were handed back.
pub async fn hand_back_all_of(pool: &Db, owner: &str, error: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar!(
        r#"with done as (
               update job_runs set status = 'FAILED', last_error = $2, finished_at = now(), heartbeat_at = now(),
                                   lease_until = now()
               where status = 'RUNNING' and owner = $1
               returning job_name, business_date, shards, shard, epoch, owner
           ), history as (
               insert into job_run_attempts (job_name, business_date, shards, shard, epoch, owner, event,
                                             scanned, updated, error)
               select job_name, business_date, shards, shard, epoch, owner, 'failed', 0, 0, $2 from done
           )
           select count(*) as "handed_back!" from done"#,
        owner,
        error,
    )
    .fetch_one(pool)
    .await
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
