//! The epoch fence: the one statement through which a claimed run advances (the last statement of each batch
//! transaction) and renews its lease while it waits (a renewal is an advance that covered no rows). Written once,
//! so that a batch and a renewal can never disagree on who holds a key.

use std::time::Duration;

use sqlx::{Executor, PgConnection, Postgres};

use super::{millis, Claimant};
use crate::{jobs::RunKey, store::Db};

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
/// run's claim can give the same epoch to another replica, and the run must not pass that one's fence. It also
/// says whether a pause now covers the key: the same statement reads `job_pauses` (a primary-key lookup in a
/// table of a few rows), so a run learns of a pause at the end of the batch in flight without a statement of its
/// own. A pause never makes the fence fail: it only asks the run to stop after this batch.
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
    let step = Step {
        after: progress.after,
        to: Some(progress.cursor),
        scanned: progress.scanned,
        updated: progress.updated,
    };
    fence(&mut *tx, key, holder, step, lease).await
}

/// Renews the lease of a run that waits between batches (the throttle): the batch fence with no rows — the
/// cursor stays the run's last committed `cursor`, the counters add nothing — on a statement of its own. So it
/// passes only while the key is RUNNING under `epoch` and `owner` at that cursor, and tells, as after a batch,
/// whether a pause covers the key, so that a long wait still honours an operator's pause.
pub async fn renew(
    pool: &Db,
    key: &RunKey,
    holder: Claimant<'_>,
    cursor: Option<i64>,
    lease: Duration,
) -> Result<Fence, sqlx::Error> {
    let step = Step {
        after: cursor,
        to: cursor,
        scanned: 0,
        updated: 0,
    };
    fence(pool, key, holder, step, lease).await
}

/// The fence of a transaction that writes part of a batch beside the batch's own (`jobs/runner/beside.rs`):
/// the one fence statement with the cursor left where it is — it adds the part's rows to the key's counters and renews the
/// lease, only while `holder` holds the key at the cursor `after`, as the batch's fence will ask (`false`
/// otherwise: the part must roll back). Its row lock holds until the part commits: a takeover, and the
/// batch's own fence, wait for it as for a batch in flight, then see the lease it renewed.
pub async fn beside(
    tx: &mut PgConnection,
    key: &RunKey,
    holder: Claimant<'_>,
    after: Option<i64>,
    (scanned, updated): (i64, i64),
    lease: Duration,
) -> Result<bool, sqlx::Error> {
    let step = Step {
        after,
        to: after,
        scanned,
        updated,
    };
    let fenced = fence(&mut *tx, key, holder, step, lease).await?;
    Ok(matches!(fenced, Fence::Passed { .. }))
}

/// What the fence moves: from the cursor the run last committed to the one it commits now, and the rows of the
/// batch (a renewal: the same cursor, no rows).
#[derive(Debug, Clone, Copy)]
struct Step {
    after: Option<i64>,
    to: Option<i64>,
    scanned: i64,
    updated: i64,
}

/// The fence statement itself (see [`advance`]), on a batch's transaction or on a connection of its own.
async fn fence<'c, E>(
    conn: E,
    key: &RunKey,
    holder: Claimant<'_>,
    step: Step,
    lease: Duration,
) -> Result<Fence, sqlx::Error>
where
    E: Executor<'c, Database = Postgres>,
{
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
        step.to,
        step.scanned,
        step.updated,
        millis(lease) as f64,
        step.after,
        holder.owner,
    )
    .fetch_optional(conn)
    .await?;
    Ok(match fenced {
        None => Fence::Lost,
        Some(row) => Fence::Passed {
            paused: row.paused_by.zip(row.reason),
        },
    })
}
