//! The accrual's re-check on a Citus coordinator: what [`crate::store::corrections::recheck`] finds and does in
//! one statement, in several, in one transaction.
//!
//! On PostgreSQL the re-check is one statement whose CTEs read the queued changes, join each changed loan to
//! the window's days, and clear or mark the changes found owed. Citus refuses that join of a CTE's rows to the
//! distributed tables ("complex joins are only supported when all distributed tables are co-located and joined
//! on their distribution columns", Citus 14.0.1). Here the changes are read first; the days still to do are
//! found by one statement over the changed loans (named by id, so that Citus prunes it to their shards, each
//! loan joined to its own rows on its worker); then the changes are cleared, marked and unmarked by sequence
//! number. A change libraryd queues meanwhile has a new sequence number, which this pass neither reads nor
//! clears: it waits for the next re-check, as it would on PostgreSQL.

use std::collections::BTreeSet;

use chrono::NaiveDate;

use crate::{
    shard::ShardSpec,
    store::{corrections::Recheck, Db},
};

/// A queued change: its sequence number and its loan.
type Change = (i64, i64);

/// See [`crate::store::corrections::recheck`]: the same arguments and the same findings.
#[allow(clippy::too_many_arguments)]
pub async fn recheck(
    pool: &Db,
    shard: ShardSpec,
    first: NaiveDate,
    last: NaiveDate,
    limit: i64,
    clear: bool,
    settle: std::time::Duration,
) -> Result<Recheck, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let seen: Vec<Change> = sqlx::query_as(
        "select c.seq, c.loan_id from fine_loan_changes c
         where fine_settler_shard_of(c.loan_id, $1) = $2
         order by c.seq
         limit $3",
    )
    .bind(shard.shards())
    .bind(shard.shard())
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    let changed: Vec<i64> = seen
        .iter()
        .map(|(_, id)| *id)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let work = days_to_do(&mut tx, &changed, first, last).await?;
    let orphaned = orphaned(&mut tx, &changed).await?;
    let dirty: BTreeSet<i64> = work.iter().map(|(id, _)| *id).collect();
    let days: Vec<NaiveDate> = work
        .iter()
        .map(|(_, day)| *day)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let (clean, owed): (Vec<Change>, Vec<Change>) = seen.iter().partition(|(_, id)| !dirty.contains(id));
    let (cleared, marked) = if clear {
        // A change is marked found owed as of now, after the loans were read: in one statement the two coincide;
        // the transaction's start (`now()`) would be before the reads, and shorten the wait for a second look.
        let looked: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("select clock_timestamp()")
            .fetch_one(&mut *tx)
            .await?;
        mark(&mut tx, &clean, &owed, looked, settle).await?
    } else {
        (0, 0)
    };
    tx.commit().await?;
    Ok(Recheck {
        days,
        changed: changed.len() as i64,
        dirty: dirty.len() as i64,
        orphaned,
        cleared,
        marked,
        more: seen.len() as i64 >= limit,
    })
}

/// The (loan, day) pairs of the window `first..=last` on which a loan of `changed` is still to charge (owed,
/// neither charged nor queued) or to correct (charged, and its net is not what is owed).
async fn days_to_do(
    tx: &mut sqlx::PgConnection,
    changed: &[i64],
    first: NaiveDate,
    last: NaiveDate,
) -> Result<Vec<(i64, NaiveDate)>, sqlx::Error> {
    sqlx::query_as(
        "select l.id, d.day
         from loans l
         cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
         cross join (select g::date as day from generate_series($2::date, $3::date, interval '1 day') g) d
         cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, d.day, p.daily_rate_cents,
                                                           p.grace_days, p.cap_cents, p.charge_closed_days) a
         left join fine_ledger f on f.loan_id = l.id and f.accrual_date = d.day
         left join lateral (select sum(c.amount_cents) as total from fine_ledger_corrections c
                            where c.loan_id = l.id and c.accrual_date = d.day) n on true
         left join lateral (select true as queued from fine_pending q
                            where q.loan_id = l.id and q.accrual_date = d.day) q on true
         where l.id = any($1::bigint[]) and $2::date <= $3::date
           and ((f.loan_id is null and a.amount_cents > 0 and q.queued is null)
             or (f.loan_id is not null and a.amount_cents <> f.amount_cents + coalesce(n.total, 0)
                 and isfinite(l.due_on) and coalesce(isfinite(l.returned_on), true)))",
    )
    .bind(changed)
    .bind(first)
    .bind(last)
    .fetch_all(&mut *tx)
    .await
}

/// The loans of `changed` libraryd deleted that have ledger rows, ascending.
async fn orphaned(tx: &mut sqlx::PgConnection, changed: &[i64]) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "select f.loan_id from fine_ledger f
         left join loans l on l.id = f.loan_id
         where f.loan_id = any($1::bigint[]) and l.id is null
         group by f.loan_id
         order by f.loan_id",
    )
    .bind(changed)
    .fetch_all(&mut *tx)
    .await
}

/// The changes' bookkeeping: of the `clean` changes (seq, loan), those found owed a `settle` ago or more are
/// removed and those never found owed are marked (as found at `looked`); of the `owed` ones, those marked are unmarked. Returns (removed,
/// marked + unmarked).
async fn mark(
    tx: &mut sqlx::PgConnection,
    clean: &[Change],
    owed: &[Change],
    looked: chrono::DateTime<chrono::Utc>,
    settle: std::time::Duration,
) -> Result<(i64, i64), sqlx::Error> {
    let settle_ms = i64::try_from(settle.as_millis()).unwrap_or(i64::MAX) as f64;
    let split = |rows: &[Change]| -> (Vec<i64>, Vec<i64>) { rows.iter().copied().unzip() };
    let (clean_seqs, clean_loans) = split(clean);
    let (owed_seqs, owed_loans) = split(owed);
    let cleared = sqlx::query(
        "delete from fine_loan_changes
         where loan_id = any($1::bigint[]) and seq = any($2::bigint[])
           and cleared_at < now() - $3 * interval '1 millisecond'",
    )
    .bind(&clean_loans)
    .bind(&clean_seqs)
    .bind(settle_ms)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let marked = sqlx::query(
        "update fine_loan_changes set cleared_at = $3
         where loan_id = any($1::bigint[]) and seq = any($2::bigint[]) and cleared_at is null",
    )
    .bind(&clean_loans)
    .bind(&clean_seqs)
    .bind(looked)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let unmarked = sqlx::query(
        "update fine_loan_changes set cleared_at = null
         where loan_id = any($1::bigint[]) and seq = any($2::bigint[]) and cleared_at is not null",
    )
    .bind(&owed_loans)
    .bind(&owed_seqs)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    Ok((count(cleared), count(marked) + count(unmarked)))
}
