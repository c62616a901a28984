//! A batch's write on a Citus coordinator (`database.engine = "citus"`, docs/citus.md): the settlement's, one
//! Citus shard at a time, here; the accrual's in [`ledger`], its re-check in [`recheck`]; and `verify`'s audit
//! in [`audit`].
//!
//! Citus runs a statement whose rows all lie in one shard — its distributed tables filtered by loan ids of that
//! shard (`id = any(…)`, which Citus prunes to the shard) — on the shard's worker as it is: plain PostgreSQL
//! there, with the fine rules bound to the reference tables' copies (`migrate`). The same write spread over
//! several shards is refused: an `update` calling a rule function with the row's columns ("STABLE functions used
//! in UPDATE queries cannot be called with column references"), a statement calling a SQL function that reads a
//! distributed table with parameters ("parameterized queries for SQL functions referencing distributed tables
//! are not supported") — both measured on Citus 14.0.1. So on Citus a batch lists its loans, and its write runs
//! once per shard they fall in, each time with that shard's ids only; all in the batch's one transaction, which
//! the coordinator commits on every worker it wrote to at once (two-phase commit), fence included.
//!
//! The statements here run only on Citus (`get_shard_id_for_distribution_column` exists nowhere else), so they
//! are not checked against the migrations at build time like the rest of the store; the Citus suite
//! (`tests/it/citus.rs`) runs each of them.

pub mod audit;
pub mod ledger;
pub mod recheck;
pub mod replication;

use chrono::NaiveDate;
use sqlx::PgConnection;

use crate::shard::ShardSpec;

/// `ids` (in ascending order) grouped by the Citus shard of `loans` they fall in: each group ascending, the
/// groups in the order of their first id. The coordinator answers from its metadata; no worker is asked.
pub async fn by_shard(db: impl sqlx::PgExecutor<'_>, ids: &[i64]) -> Result<Vec<Vec<i64>>, sqlx::Error> {
    let groups = by_shard_on_nodes(db, ids).await?;
    Ok(groups.into_iter().map(|g| g.ids).collect())
}

/// The loans of one Citus shard of `loans` and the node that holds it (its placement's `groupid`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardGroup {
    pub node: i32,
    pub ids: Vec<i64>,
}

/// [`by_shard`]'s groups, each with the node that holds its Citus shard: batches of different nodes can be
/// written at the same time, each by its own worker.
pub async fn by_shard_on_nodes(
    db: impl sqlx::PgExecutor<'_>,
    ids: &[i64],
) -> Result<Vec<ShardGroup>, sqlx::Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let groups: Vec<(i32, Vec<i64>)> = sqlx::query_as(
        "select coalesce((select min(p.groupid) from pg_dist_placement p where p.shardid = s.shard), 0)::int,
                s.ids
         from (select get_shard_id_for_distribution_column('loans', id) as shard,
                      array_agg(id order by id) as ids, min(id) as first
               from unnest($1::bigint[]) id
               group by 1) s
         order by s.first",
    )
    .bind(ids)
    .fetch_all(db)
    .await?;
    Ok(groups
        .into_iter()
        .map(|(node, ids)| ShardGroup { node, ids })
        .collect())
}

/// How many Citus shards `loans` is split into, from the coordinator's metadata.
pub async fn loan_shards(db: impl sqlx::PgExecutor<'_>) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("select count(*) from pg_dist_shard where logicalrelid = 'loans'::regclass")
        .fetch_one(db)
        .await
}

/// A listed settlement update's fine for the row of `loans` it is at: [`crate::store::loans::settle_range`]'s.
/// (Not the scalar `fine_settler_loan_fine`, the same expression as a function: Citus refuses a STABLE function
/// called with the row's columns in an `update` even when it is routed to one shard.)
macro_rules! listed_fine {
    () => {
        "(select f.fine_cents
          from fine_settler_policy_of(loans.fine_class, loans.due_on) p
          cross join lateral fine_settler_policy_fine(loans.due_on, loans.returned_on,
                                                      p.daily_rate_cents, p.grace_days,
                                                      p.cap_cents, p.charge_closed_days) f)"
    };
}

/// Which of the listed loans (`$3`) are still the settlement's: [`crate::store::loans::settle_range`]'s
/// conditions with the range replaced by the list.
macro_rules! still_listed {
    () => {
        "id = any($3) and fine_settler_shard_of(id, $4) = $5
         and fine_settled_at is null and returned_on is not null
         and returned_on between $1 and $2
         and isfinite(due_on)"
    };
}

/// The settlement's write of a batch's loans of one Citus shard.
const SETTLE_LISTED: &str = concat!(
    "update loans set fine_cents = ",
    listed_fine!(),
    ", fine_settled_at = now() where ",
    still_listed!()
);

/// [`SETTLE_LISTED`] leaving out the rows another transaction holds locked, as
/// [`crate::store::loans::settle_unlocked`] does: the rows it can lock first, then their update. The update
/// joins them back to `loans` by hash (`enable_nestloop` off for the statement's transaction, on the worker
/// too): in a nested loop each of the batch's rows would look its id up with the whole list again (`id = any`,
/// which Citus needs in the update's own conditions to send it to one shard) — measured, 960 ms for a batch of
/// 9,000 loans against 290 ms by hash.
const SETTLE_LISTED_UNLOCKED: &str = concat!(
    "with free as (select id from loans where ",
    still_listed!(),
    " for no key update skip locked)
     update loans set fine_cents = ",
    listed_fine!(),
    ", fine_settled_at = now()
     from free
     where loans.id = free.id and loans.id = any($3) and loans.fine_settled_at is null"
);

/// Whether a settlement write waits for row locks (and fails after `lock_timeout`) or leaves locked rows out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Locked {
    Wait,
    Skip,
}

/// Settles the loans of `ids` (one Citus shard's) that are still the settlement's: returned in `[first, last]`,
/// unsettled, of `shard`. Returns how many it settled.
pub async fn settle_listed(
    tx: &mut PgConnection,
    (first, last): (NaiveDate, NaiveDate),
    shard: ShardSpec,
    ids: &[i64],
    locked: Locked,
) -> Result<u64, sqlx::Error> {
    let statement = match locked {
        Locked::Wait => SETTLE_LISTED,
        Locked::Skip => {
            sqlx::query("set local enable_nestloop = off")
                .execute(&mut *tx)
                .await?;
            SETTLE_LISTED_UNLOCKED
        }
    };
    let done = sqlx::query(statement)
        .bind(first)
        .bind(last)
        .bind(ids)
        .bind(shard.shards())
        .bind(shard.shard())
        .execute(&mut *tx)
        .await?;
    Ok(done.rows_affected())
}
