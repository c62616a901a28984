//! `loans`: the settlement scan and the conditional settlement write. The daemon writes only `fine_cents` and
//! `fine_settled_at`, and only on rows whose `fine_settled_at` is still null.

use chrono::NaiveDate;
use sqlx::{PgConnection, PgPool};

use crate::shard::ShardSpec;

/// A loan waiting to be settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsettled {
    pub id: i64,
    /// `returned_on - due_on`; `None` when `due_on` is not a finite date (libraryd should never store one).
    pub days_late: Option<i64>,
}

/// The next batch of the shard's unsettled loans returned in `[first, last]`, in id order from `from_id` on.
///
/// `fine_settled_at is null` is the marker, never `fine_cents = 0`: an on-time return is settled with a fine of
/// zero and must not be picked up again. The predicate matches the partial index `loans_unsettled_returned_idx`,
/// which the scan walks in id order.
pub async fn unsettled_batch(
    pool: &PgPool,
    (first, last): (NaiveDate, NaiveDate),
    shard: ShardSpec,
    from_id: i64,
    limit: i64,
) -> Result<Vec<Unsettled>, sqlx::Error> {
    sqlx::query_as!(
        Unsettled,
        r#"select id,
                  case when isfinite(due_on) then (returned_on - due_on)::bigint end as "days_late?"
           from loans
           where fine_settled_at is null and returned_on is not null
             and returned_on between $1 and $2
             and id >= $3 and id % $4 = $5
           order by id
           limit $6"#,
        first,
        last,
        from_id,
        i64::from(shard.shards()),
        i64::from(shard.shard()),
        limit,
    )
    .fetch_all(pool)
    .await
}

/// Stamps each loan with its fine, unless it was settled meanwhile. Returns how many rows were written.
pub async fn settle(tx: &mut PgConnection, ids: &[i64], fines: &[i64]) -> Result<u64, sqlx::Error> {
    let done = sqlx::query!(
        r#"update loans as l set fine_cents = b.fine_cents, fine_settled_at = now()
           from unnest($1::bigint[], $2::bigint[]) as b (id, fine_cents)
           where l.id = b.id and l.fine_settled_at is null"#,
        ids,
        fines,
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
pub async fn insert_new(pool: &PgPool, loans: &[NewLoan]) -> Result<u64, sqlx::Error> {
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
