//! `fine_ledger` and `fine_pending`: the accrual scan, its charges, and the compensation queue.

use chrono::{DateTime, NaiveDate, Utc};
use sqlx::PgConnection;

use crate::store::Db;

use crate::{fine::FinePolicy, shard::ShardSpec};

/// A loan overdue on the accrual day and not yet charged (nor queued) for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overdue {
    pub id: i64,
}

/// The next batch of the shard's loans overdue on `day` — `due_on + grace_days < day` and not returned before
/// `day` — that have no ledger row and no pending charge for `day`, and (with a cap) have not reached it.
///
/// Written so that the generic plan the job connections use stays a walk of the primary key with one key probe
/// of the ledger and of the queue per loan: without the `offset 0` fences the planner turns the two `not
/// exists` into anti-joins that scan and hash the whole ledger for every batch (seconds per batch once the
/// ledger holds millions of rows, more than the batch timeout when a re-opened or forced day finds every loan
/// already charged); and the cap's sum over the loan's ledger is taken only for the loans still to charge.
pub async fn overdue_batch(
    pool: &Db,
    day: NaiveDate,
    shard: ShardSpec,
    grace_days: i64,
    cap_cents: i64,
    from_id: i64,
    limit: i64,
) -> Result<Vec<Overdue>, sqlx::Error> {
    sqlx::query_as!(
        Overdue,
        r#"select c.id as "id!"
           from (select l.id from loans l
                 where l.id >= $1 and l.id % $2 = $3
                   and l.due_on < $5::date - $4::int
                   and (l.returned_on is null or l.returned_on >= $5)
                   and not exists (select 1 from fine_ledger f
                                   where f.loan_id = l.id and f.accrual_date = $5 offset 0)
                   and not exists (select 1 from fine_pending p
                                   where p.loan_id = l.id and p.accrual_date = $5 offset 0)
                 order by l.id
                 offset 0) c
           where $6::bigint = 0 or coalesce((select sum(f.amount_cents) from fine_ledger f
                                             where f.loan_id = c.id), 0) < $6
           order by c.id
           limit $7"#,
        from_id,
        i64::from(shard.shards()),
        i64::from(shard.shard()),
        i32::try_from(grace_days).unwrap_or(i32::MAX),
        day,
        cap_cents,
        limit,
    )
    .fetch_all(pool)
    .await
}

/// How many loans of the shard with `id >= from_id` a run of `day` starting there would charge: those
/// [`overdue_batch`] finds, counted (`backfill --dry-run`). The predicate is [`overdue_batch`]'s, without its
/// limit.
pub async fn count_overdue(
    pool: &Db,
    day: NaiveDate,
    shard: ShardSpec,
    grace_days: i64,
    cap_cents: i64,
    from_id: i64,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar!(
        r#"select count(*) as "count!"
           from (select l.id from loans l
                 where l.id >= $6 and l.id % $1 = $2
                   and l.due_on < $4::date - $3::int
                   and (l.returned_on is null or l.returned_on >= $4)
                   and not exists (select 1 from fine_ledger f
                                   where f.loan_id = l.id and f.accrual_date = $4 offset 0)
                   and not exists (select 1 from fine_pending p
                                   where p.loan_id = l.id and p.accrual_date = $4 offset 0)
                 offset 0) c
           where $5::bigint = 0 or coalesce((select sum(f.amount_cents) from fine_ledger f
                                             where f.loan_id = c.id), 0) < $5"#,
        i64::from(shard.shards()),
        i64::from(shard.shard()),
        i32::try_from(grace_days).unwrap_or(i32::MAX),
        day,
        cap_cents,
        from_id,
    )
    .fetch_one(pool)
    .await
}

/// The advisory-lock namespace of per-loan ledger locks (`pg_advisory_xact_lock(space, hashint8(loan_id))`):
/// ASCII "fsLd". A collision of two loans' hashes only makes their charges wait for each other.
const LOAN_LOCK_SPACE: i32 = 0x6673_4c64;

/// Locks each loan of `ids` for the rest of the transaction, in one fixed order (that of the lock keys), so that
/// two transactions locking overlapping sets cannot deadlock. Every charge takes this lock before it reads what
/// the loan has accrued: charges for different days never meet on the ledger's key, and without it two runs (a
/// second replica of the shard, a manual `accrue`, `pending retry`, the overlap of two shard counts) would each
/// read the same total and together charge past the cap. Waits at most the transaction's `lock_timeout`.
pub async fn lock_loans(tx: &mut PgConnection, ids: &[i64]) -> Result<(), sqlx::Error> {
    sqlx::query_scalar!(
        r#"select count(*) as "locked!" from (
               select pg_advisory_xact_lock($1::int, k.key)
               from (select distinct hashint8(b.id) as key from unnest($2::bigint[]) as b (id) order by 1) k
           ) locks"#,
        LOAN_LOCK_SPACE,
        ids,
    )
    .fetch_one(&mut *tx)
    .await?;
    Ok(())
}

/// `ids` in the order [`lock_loans`] locks them (that of their lock keys), so that a batch isolated row by row
/// takes its loans' locks in the same order as every other charge and cannot deadlock with one.
pub async fn in_lock_order(tx: &mut PgConnection, ids: &[i64]) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"select b.id as "id!" from unnest($1::bigint[]) as b (id) order by hashint8(b.id), b.id"#,
        ids
    )
    .fetch_all(&mut *tx)
    .await
}

/// Charges each loan of `ids` for `day`: `amount` (the daily rate, or a pending charge's amount), or what is
/// left under `cap_cents` if that is less, computed here from the ledger as this statement sees it — so call
/// [`lock_loans`] first in the same transaction when there is a cap. A loan is charged only if it is still
/// overdue on `day` by the loans row as it is now (a return back-dated before `day` means nothing is owed);
/// a day already charged is skipped. Returns the rows written.
pub async fn charge(
    tx: &mut PgConnection,
    day: NaiveDate,
    ids: &[i64],
    amount: i64,
    policy: &FinePolicy,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query!(
        r#"insert into fine_ledger (loan_id, accrual_date, amount_cents)
           select c.id, $1, c.amount
           from (select l.id,
                        case when $4::bigint = 0 then $3::bigint
                             else least($3::bigint,
                                        $4::bigint - coalesce((select sum(f.amount_cents) from fine_ledger f
                                                               where f.loan_id = l.id), 0))
                        end as amount
                 from loans l
                 where l.id = any($2::bigint[])
                   and l.due_on < $1::date - $5::int and (l.returned_on is null or l.returned_on >= $1)) c
           where c.amount > 0
           on conflict on constraint fine_ledger_pkey do nothing"#,
        day,
        ids,
        amount,
        policy.cap().map_or(0, |c| c.get()),
        i32::try_from(policy.grace_days()).unwrap_or(i32::MAX),
    )
    .execute(&mut *tx)
    .await?;
    Ok(done.rows_affected())
}

/// Checks every deferred constraint and fires every deferred trigger now, so that one that rejects a charge
/// fails here, inside the charge's savepoint, where the charge can be isolated and queued — instead of at
/// commit, where it would fail the whole batch (and the run, every time it is retried).
pub async fn check_deferred_now(tx: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query!("set constraints all immediate")
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Sets this transaction's statement timeout (used while charges are isolated row by row).
pub async fn set_local_statement_timeout(tx: &mut PgConnection, millis: u64) -> Result<(), sqlx::Error> {
    sqlx::query_scalar!(
        "select set_config('statement_timeout', $1, true)",
        millis.to_string()
    )
    .fetch_one(&mut *tx)
    .await?;
    Ok(())
}

/// Whether `day` has a loan of `shard` still to charge: overdue on the day, neither charged nor
/// queued for it, and under the cap — the accrual's re-open question for one key, as the tick status asks it
/// for every key ([`crate::store::job_runs::tick_status`]); both call the SQL function
/// `fine_settler_uncharged_days` (migrations/20261201000008), where the question is written once.
pub async fn day_has_uncharged(
    pool: &Db,
    day: NaiveDate,
    shard: ShardSpec,
    policy: &FinePolicy,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(
        r#"select exists (select 1 from fine_settler_uncharged_days($1, $1, $2, $3, $4, $5)) as "late!""#,
        day,
        shard.shards(),
        shard.shard(),
        i32::try_from(policy.grace_days()).unwrap_or(i32::MAX),
        policy.cap().map_or(0, |c| c.get()),
    )
    .fetch_one(pool)
    .await
}

/// Queues a failed charge. A row already queued for that day is left as it is.
pub async fn enqueue(
    tx: &mut PgConnection,
    loan_id: i64,
    day: NaiveDate,
    amount: i64,
    error: &str,
    retry_in_ms: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        r#"insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
           values ($1, $2, $3, 1, $4, now() + $5 * interval '1 millisecond')
           on conflict on constraint fine_pending_pkey do nothing"#,
        loan_id,
        day,
        amount,
        error,
        retry_in_ms as f64,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A queued charge.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Pending {
    pub loan_id: i64,
    pub accrual_date: NaiveDate,
    pub amount_cents: i64,
    pub attempts: i32,
    pub next_attempt_at: DateTime<Utc>,
    pub last_error: Option<String>,
    pub status: String,
}

/// Pending charges of `shard` due for a retry (or all PENDING ones with `due_only = false`), oldest first.
pub async fn due_pending(
    pool: &Db,
    shard: Option<ShardSpec>,
    due_only: bool,
    limit: i64,
) -> Result<Vec<Pending>, sqlx::Error> {
    let (shards, index) = shard.map_or((1, 0), |s| (s.shards(), s.shard()));
    sqlx::query_as!(
        Pending,
        r#"select loan_id, accrual_date, amount_cents, attempts, next_attempt_at, last_error, status
           from fine_pending
           where status = 'PENDING' and (not $1 or next_attempt_at <= now()) and fine_settler_shard_of(loan_id, $2) = $3
           order by next_attempt_at, loan_id, accrual_date
           limit $4"#,
        due_only,
        shards,
        index,
        limit,
    )
    .fetch_all(pool)
    .await
}

/// Locks one pending charge for a retry, unless another replica holds it or it changed since `seen` was read:
/// it must still be PENDING with the attempts seen, and — for a due-only pass — still due. The re-check under the
/// lock is what keeps the backoff: a replica working from a list read before a peer's failed retry would
/// otherwise retry the charge again at once, and with three replicas a charge would burn three attempts per
/// round. Returns its attempts so far.
pub async fn lock_pending(
    tx: &mut PgConnection,
    seen: &Pending,
    due_only: bool,
) -> Result<Option<i32>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"select attempts from fine_pending
           where loan_id = $1 and accrual_date = $2 and status = 'PENDING' and attempts = $3
             and (not $4 or next_attempt_at <= now())
           for update skip locked"#,
        seen.loan_id,
        seen.accrual_date,
        seen.attempts,
        due_only,
    )
    .fetch_optional(&mut *tx)
    .await
}

/// Removes a pending charge (it was charged, or there is nothing left to charge).
pub async fn resolve(tx: &mut PgConnection, loan_id: i64, day: NaiveDate) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "delete from fine_pending where loan_id = $1 and accrual_date = $2",
        loan_id,
        day
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Records another failed attempt: the error, the next attempt time, and DEAD once `dead` says so.
pub async fn retry_failed(
    tx: &mut PgConnection,
    loan_id: i64,
    day: NaiveDate,
    error: &str,
    retry_in_ms: i64,
    dead: bool,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        r#"update fine_pending set attempts = attempts + 1, last_error = $3,
                  next_attempt_at = now() + $4 * interval '1 millisecond',
                  status = case when $5 then 'DEAD' else 'PENDING' end, updated_at = now()
           where loan_id = $1 and accrual_date = $2"#,
        loan_id,
        day,
        error,
        retry_in_ms as f64,
        dead,
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Makes a pending charge DEAD without another attempt (it has had them all).
pub async fn give_up(tx: &mut PgConnection, loan_id: i64, day: NaiveDate) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "update fine_pending set status = 'DEAD', updated_at = now() where loan_id = $1 and accrual_date = $2",
        loan_id,
        day
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Gives DEAD charges (optionally of one loan) a fresh set of attempts, due now. Returns how many.
pub async fn resurrect(pool: &Db) -> Result<u64, sqlx::Error> {
    let done = sqlx::query!(
        r#"update fine_pending set status = 'PENDING', attempts = 0, next_attempt_at = now(), updated_at = now()
           where status = 'DEAD'"#
    )
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// (PENDING, DEAD) counts, for one shard or all.
pub async fn counts(pool: &Db, shard: Option<ShardSpec>) -> Result<(i64, i64), sqlx::Error> {
    let (shards, index) = shard.map_or((1, 0), |s| (s.shards(), s.shard()));
    let row = sqlx::query!(
        r#"select count(*) filter (where status = 'PENDING') as "pending!",
                  count(*) filter (where status = 'DEAD') as "dead!"
           from fine_pending where fine_settler_shard_of(loan_id, $1) = $2"#,
        shards,
        index,
    )
    .fetch_one(pool)
    .await?;
    Ok((row.pending, row.dead))
}

/// Every queued charge, DEAD first, for `pending list`.
pub async fn list(pool: &Db) -> Result<Vec<Pending>, sqlx::Error> {
    sqlx::query_as!(
        Pending,
        r#"select loan_id, accrual_date, amount_cents, attempts, next_attempt_at, last_error, status
           from fine_pending
           order by status, next_attempt_at, loan_id, accrual_date"#
    )
    .fetch_all(pool)
    .await
}
