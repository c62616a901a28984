//! `loans`: the settlement scan and the conditional settlement write. The daemon writes only `fine_cents` and
//! `fine_settled_at`, and only on rows whose `fine_settled_at` is still null.
//!
//! A loan whose `due_on` is not a finite date (`infinity`, `-infinity`: PostgreSQL stores them, no calendar has
//! them) is not the settlement's: every statement here leaves it out (`isfinite(due_on)`), as the accrual leaves
//! out a loan with a non-finite `due_on` or `returned_on`, and `verify` reports it (`store::audit`). Failing the
//! run instead would hold back the whole shard's month for one row; leaving it out settles the rest and keeps
//! the key from re-opening for a row it will never settle. (A non-finite `returned_on` is in no month, so the
//! month's `between` already leaves it out.)

use chrono::NaiveDate;
use sqlx::PgConnection;

use crate::store::Db;

use crate::shard::ShardSpec;

/// The next batch of a shard's unsettled loans returned in the business month.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettleBatch {
    /// The batch covers ids `from_id..=last_id`, and leaves the cursor at `last_id` (on Citus, the cursor
    /// that [`crate::jobs::shard_walk::ShardWalk`] gives the batch, which may be below its loans).
    pub from_id: i64,
    pub last_id: i64,
    /// Loans in the batch.
    pub count: i64,
    /// On Citus, the batch's loans, listed in parts of one Citus shard each, no two on one node: its write
    /// reaches them one Citus shard at a time ([`crate::store::citus`]), and the runner writes its parts at
    /// once ([`crate::jobs::BatchJob::split`]). Empty on PostgreSQL, whose write is the range.
    pub parts: Vec<Vec<i64>>,
}

/// Finds the next batch: the first `limit` unsettled loans of the shard returned in `[first, last]` with
/// `id >= from_id`, in id order — only their id range and count, which the write then updates as a range.
///
/// `fine_settled_at is null` is the marker, never `fine_cents = 0`: an on-time return is settled with a fine of
/// zero and must not be picked up again. The predicate matches the partial index `loans_unsettled_returned_idx`
/// (`(id, returned_on) include (due_on)`): the batch is a walk of it in id order from `from_id`, which stops at
/// the `limit`-th match, so a month's batches read the index once between them.
///
/// The walk is written as a subquery kept apart (`offset 0`) that only orders the unsettled loans by id, the
/// month, finiteness and shard tests applied outside it. Written as one query, the planner estimates the shard
/// test at its default selectivity for a function (0.5 %), believes that fewer rows than `limit` match, and
/// reads all of the month's unsettled loans through `loans_unsettled_by_return_idx` (or the table) to sort
/// them — at every batch, so a month's cost grew with the square of its size: measured on 1,000,000 loans
/// (288,169 returned in the month), 100–250 ms a batch against 8–20 ms for the walk.
pub async fn next_batch(
    pool: &Db,
    (first, last): (NaiveDate, NaiveDate),
    shard: ShardSpec,
    from_id: i64,
    limit: i64,
) -> Result<Option<SettleBatch>, sqlx::Error> {
    let row = sqlx::query!(
        r#"select max(id) as last_id, count(*) as "count!"
           from (select u.id
                 from (select id, returned_on, due_on
                       from loans
                       where fine_settled_at is null and returned_on is not null and id >= $3
                       order by id
                       offset 0) u
                 where u.returned_on between $1 and $2 and isfinite(u.due_on)
                   and fine_settler_shard_of(u.id, $4) = $5
                 limit $6) batch"#,
        first,
        last,
        from_id,
        shard.shards(),
        shard.shard(),
        limit,
    )
    .fetch_one(pool)
    .await?;
    Ok(row.last_id.map(|last_id| SettleBatch {
        from_id,
        last_id,
        count: row.count,
        parts: Vec::new(),
    }))
}

/// [`next_batch`] on Citus: the same loans, listed (for [`SettleBatch::parts`]), for a write that reaches them
/// one Citus shard at a time. Citus runs the ordered, limited scan on every shard and merges the shards' first
/// `limit` ids (the subquery kept apart that [`next_batch`] needs on PostgreSQL would, on Citus, bring every
/// unsettled loan to the coordinator).
pub async fn next_listed(
    pool: &Db,
    (first, last): (NaiveDate, NaiveDate),
    shard: ShardSpec,
    from_id: i64,
    limit: i64,
) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"select id from loans
           where fine_settled_at is null and returned_on is not null and id >= $3
             and returned_on between $1 and $2 and isfinite(due_on)
             and fine_settler_shard_of(id, $4) = $5
           order by id
           limit $6"#,
        first,
        last,
        from_id,
        shard.shards(),
        shard.shard(),
        limit,
    )
    .fetch_all(pool)
    .await
}

/// Whether the shard has any unsettled loan returned in `[first, last]`, through the index ordered by return
/// date (`loans_unsettled_by_return_idx`): the ordered scan stops at the first entry of the month, and a settled
/// month has none, so either answer takes a fraction of a millisecond — whereas the batch scan, walking ids,
/// would read every other month's unsettled loans before concluding that this month has none. (The due date is
/// not in that index: the first entries' rows are read for it, one row in all but a month of non-finite dates.)
pub async fn month_has_unsettled(
    pool: &Db,
    (first, last): (NaiveDate, NaiveDate),
    shard: ShardSpec,
) -> Result<bool, sqlx::Error> {
    let any = sqlx::query_scalar!(
        r#"select id from loans
           where fine_settled_at is null and returned_on is not null
             and returned_on between $1 and $2 and fine_settler_shard_of(id, $3) = $4 and isfinite(due_on)
           order by returned_on, id
           limit 1"#,
        first,
        last,
        shard.shards(),
        shard.shard(),
    )
    .fetch_optional(pool)
    .await?;
    Ok(any.is_some())
}

/// How many unsettled loans of the shard were returned in `[first, last]` with `id >= from_id`: the rows a run
/// of the key starting at `from_id` would settle, by the predicate of [`next_batch`] (`backfill --dry-run`).
pub async fn count_unsettled(
    pool: &Db,
    (first, last): (NaiveDate, NaiveDate),
    shard: ShardSpec,
    from_id: i64,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar!(
        r#"select count(*) as "count!" from loans
           where fine_settled_at is null and returned_on is not null
             and returned_on between $1 and $2 and id >= $5 and fine_settler_shard_of(id, $3) = $4
             and isfinite(due_on)"#,
        first,
        last,
        shard.shards(),
        shard.shard(),
        from_id,
    )
    .fetch_one(pool)
    .await
}

/// Settles a batch as one range update: every unsettled loan of the shard returned in `[first, last]` with an id
/// in the batch's range gets its fine and `fine_settled_at`; a loan settled meanwhile is not touched. The fine
/// is its policy's (`fine_settler_policy_of`: the version of its class in force on its due date) over its
/// chargeable days (`fine_settler_policy_fine`, migrations/20261203000053), evaluated by PostgreSQL: a range
/// update reads each row once instead of joining a list of ids back to the table, the difference between
/// reaching the speed of a single set-based update or not. The SQL rule is held equal to `crate::policy` by a
/// property test; bigint arithmetic in PostgreSQL fails loudly on overflow, and a loan no policy governs fails
/// the update (`fine_cents` is not null) rather than being settled with no fine.
pub async fn settle_range(
    tx: &mut PgConnection,
    (first, last): (NaiveDate, NaiveDate),
    shard: ShardSpec,
    batch: &SettleBatch,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query!(
        r#"update loans
           set fine_cents = (select f.fine_cents
                             from fine_settler_policy_of(loans.fine_class, loans.due_on) p
                             cross join lateral fine_settler_policy_fine(loans.due_on, loans.returned_on,
                                                                         p.daily_rate_cents, p.grace_days,
                                                                         p.cap_cents, p.charge_closed_days) f),
               fine_settled_at = now()
           where id between $3 and $4 and fine_settler_shard_of(id, $5) = $6
             and fine_settled_at is null and returned_on is not null
             and returned_on between $1 and $2
             and isfinite(due_on)"#,
        first,
        last,
        batch.from_id,
        batch.last_id,
        shard.shards(),
        shard.shard(),
    )
    .execute(&mut *tx)
    .await?;
    Ok(done.rows_affected())
}

/// Settles the batch's range like [`settle_range`], leaving out every row another transaction holds locked
/// (libraryd in the middle of recording a return, say): the rows it can lock it settles, the others stay
/// unsettled — the key's re-open settles them once they are free. Used when the range update met a lock it
/// could not get within `lock_timeout`. The fine expression is [`settle_range`]'s.
pub async fn settle_unlocked(
    tx: &mut PgConnection,
    (first, last): (NaiveDate, NaiveDate),
    shard: ShardSpec,
    batch: &SettleBatch,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query!(
        r#"with free as (
               select id from loans
               where id between $3 and $4 and fine_settler_shard_of(id, $5) = $6
                 and fine_settled_at is null and returned_on is not null
                 and returned_on between $1 and $2
                 and isfinite(due_on)
               for no key update skip locked
           )
           update loans
           set fine_cents = (select f.fine_cents
                             from fine_settler_policy_of(loans.fine_class, loans.due_on) p
                             cross join lateral fine_settler_policy_fine(loans.due_on, loans.returned_on,
                                                                         p.daily_rate_cents, p.grace_days,
                                                                         p.cap_cents, p.charge_closed_days) f),
               fine_settled_at = now()
           from free
           where loans.id = free.id and loans.fine_settled_at is null"#,
        first,
        last,
        batch.from_id,
        batch.last_id,
        shard.shards(),
        shard.shard(),
    )
    .execute(&mut *tx)
    .await?;
    Ok(done.rows_affected())
}

/// One generated loan (see `demo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLoan {
    pub id: i64,
    pub member_id: i64,
    pub book_id: i64,
    pub borrowed_on: NaiveDate,
    pub due_on: NaiveDate,
    pub returned_on: Option<NaiveDate>,
}

/// Inserts loans that do not exist yet (by id); returns how many were new.
pub async fn insert_new(pool: &Db, loans: &[NewLoan]) -> Result<u64, sqlx::Error> {
    let ids: Vec<i64> = loans.iter().map(|l| l.id).collect();
    let members: Vec<i64> = loans.iter().map(|l| l.member_id).collect();
    let books: Vec<i64> = loans.iter().map(|l| l.book_id).collect();
    let borrowed: Vec<NaiveDate> = loans.iter().map(|l| l.borrowed_on).collect();
    let due: Vec<NaiveDate> = loans.iter().map(|l| l.due_on).collect();
    let returned: Vec<Option<NaiveDate>> = loans.iter().map(|l| l.returned_on).collect();
    let done = sqlx::query!(
        r#"insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
           select * from unnest($1::bigint[], $2::bigint[], $3::bigint[], $4::date[], $5::date[], $6::date[])
           on conflict on constraint loans_pkey do nothing"#,
        &ids,
        &members,
        &books,
        &borrowed as &[NaiveDate],
        &due as &[NaiveDate],
        &returned as &[Option<NaiveDate>],
    )
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}
