//! What the status page reads (`/status`, `/status.json`): every shard's `job_runs` rows that a page shows, with
//! the to-do count of each RUNNING key, and the compensation queue. Two statements per page load, run through a
//! pool of their own (see [`connect_status`](super::connect_status)) under a short `statement_timeout`.

use crate::store::Db;
use chrono::{DateTime, NaiveDate, Utc};

use super::job_runs::RunStatus;

/// A `job_runs` row as the status page shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyRow {
    pub job_name: String,
    pub business_date: NaiveDate,
    pub shards: i32,
    pub shard: i32,
    pub status: RunStatus,
    pub owner: String,
    pub epoch: i64,
    /// Seconds of lease left by the database clock (0 when it has run out or the key is finished).
    pub lease_left_s: f64,
    /// Seconds since the lease ended by the database clock (0 while it lasts).
    pub lease_ended_s: f64,
    pub scanned: i64,
    pub updated: i64,
    /// RUNNING keys only: the rows the run has still to do after its cursor, by the predicate its batches select
    /// with.
    pub to_do: Option<i64>,
    pub last_error: Option<String>,
}

/// The keys and the queue, as one statement sees them.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusRows {
    /// The database clock.
    pub now: DateTime<Utc>,
    pub keys: Vec<KeyRow>,
    /// Every shard's `PENDING` charges, those of them due for a retry now, and the `DEAD` ones.
    pub pending: i64,
    pub pending_due: i64,
    pub dead: i64,
}

/// Every shard's keys with a business date from `since` on, and every key that is not SUCCESS whatever its date
/// (so that keys abandoned by their catch-up window show), with the database clock and the queue's counts.
///
/// The to-do count runs only for RUNNING keys (a `case` evaluates its function only for the rows that take its
/// branch: `fine_settler_settlement_to_do` and `fine_settler_accrual_to_do`, migrations/20261203000061, functions
/// so that on Citus the statement names no distributed table beside the coordinator's `job_runs`) and uses each
/// job's batch predicate after the key's cursor (the queue's counts, every shard's, are
/// `fine_settler_pending_counts` of the one shard of one): for settlement through a partial index
/// of unsettled loans (what is left of the month, 7 ms for a month of 34,000 loans); for the accrual the
/// primary key after the cursor, checking the ledger and the queue for each overdue loan (42 ms for 100,000
/// loans) — the page's `statement_timeout` bounds it.
pub async fn keys(pool: &Db, since: NaiveDate) -> Result<StatusRows, sqlx::Error> {
    let rows = sqlx::query!(
        r#"select t.now as "now!", q.pending as "pending!", q.pending_due as "pending_due!", q.dead as "dead!",
                  r.job_name as "job_name?", r.business_date as "business_date?", r.shards as "shards?",
                  r.shard as "shard?", r.status as "status?: RunStatus", r.owner as "owner?", r.epoch as "epoch?",
                  greatest(0, extract(epoch from r.lease_until - t.now))::float8 as "lease_left_s?",
                  greatest(0, extract(epoch from t.now - r.lease_until))::float8 as "lease_ended_s?",
                  r.scanned as "scanned?", r.updated as "updated?", r.last_error,
                  case when r.status = 'RUNNING' and r.job_name = 'fine-settlement' then
                           fine_settler_settlement_to_do(r.business_date, coalesce(r.cursor, -9223372036854775808),
                                                         r.shards, r.shard)
                       when r.status = 'RUNNING' and r.job_name = 'overdue-accrual' then
                           fine_settler_accrual_to_do(r.business_date, coalesce(r.cursor, -9223372036854775808),
                                                      r.shards, r.shard)
                  end as to_do
           from (select now() as now) t
           cross join (select c.pending, c.due_pending as pending_due, c.dead
                       from fine_settler_pending_counts(1, 0) c) q
           left join job_runs r on r.business_date >= $1 or r.status <> 'SUCCESS'
           order by r.job_name, r.business_date desc, r.shards, r.shard"#,
        since,
    )
    .fetch_all(pool)
    .await?;
    let (now, pending, pending_due, dead) = rows
        .first()
        .map(|r| (r.now, r.pending, r.pending_due, r.dead))
        .ok_or(sqlx::Error::RowNotFound)?;
    let keys = rows
        .into_iter()
        .filter_map(|r| {
            Some(KeyRow {
                job_name: r.job_name?,
                business_date: r.business_date?,
                shards: r.shards?,
                shard: r.shard?,
                status: r.status?,
                owner: r.owner?,
                epoch: r.epoch?,
                lease_left_s: r.lease_left_s?,
                lease_ended_s: r.lease_ended_s?,
                scanned: r.scanned?,
                updated: r.updated?,
                to_do: r.to_do,
                last_error: r.last_error,
            })
        })
        .collect();
    Ok(StatusRows {
        now,
        keys,
        pending,
        pending_due,
        dead,
    })
}

/// A DEAD charge, waiting for an operator (`pending retry --dead`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeadCharge {
    pub loan_id: i64,
    pub accrual_date: NaiveDate,
    pub amount_cents: i64,
    pub attempts: i32,
    pub last_error: Option<String>,
    /// When it was last tried.
    pub updated_at: DateTime<Utc>,
}

/// The `limit` oldest DEAD charges (by accrual day), every shard's.
pub async fn oldest_dead(pool: &Db, limit: i64) -> Result<Vec<DeadCharge>, sqlx::Error> {
    sqlx::query_as!(
        DeadCharge,
        r#"select loan_id, accrual_date, amount_cents, attempts, last_error, updated_at
           from fine_pending
           where status = 'DEAD'
           order by accrual_date, loan_id
           limit $1"#,
        limit,
    )
    .fetch_all(pool)
    .await
}
