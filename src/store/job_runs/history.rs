//! What `runs` and `backfill` read of `job_runs` and `job_run_attempts`, and the pruning of old history.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};

use super::{millis, ClaimMode, RunStatus};
use crate::store::Db;

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
    /// Ledger corrections the key's runs appended, every epoch's.
    pub corrected: i64,
    pub last_error: Option<String>,
}

/// The `job_runs` rows, optionally for one job and/or business date, newest business date first, each with the
/// corrections its runs wrote (`fine_settler_key_corrections`, migrations/20261203000061: on Citus the statement
/// names no distributed table beside the coordinator's `job_runs`).
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
                  finished_at, cursor, scanned, updated,
                  fine_settler_key_corrections(r.job_name, r.business_date, r.shards, r.shard) as "corrected!",
                  last_error
           from job_runs r
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

impl RangeKey {
    /// Whether a claim in `mode` would take the key as it was read ([`RunStatus::taken_by`]).
    pub fn taken_by(&self, mode: ClaimMode) -> bool {
        self.status.taken_by(self.expired, mode)
    }
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
