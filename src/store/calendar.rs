//! `library_closed_days`: `calendar close`, `calendar open` and `calendar list`.
//!
//! A change to a day can change fines: a closed day is not charged, and the days after it within a loan's cap
//! move. So a change is refused when it touches a month whose settlement has started for some shard (a
//! `fine-settlement` key for that month or a later one exists: a settled fine never changes silently), and a
//! change to a day already over queues the loans overdue on it in `fine_loan_changes`
//! (migrations/20261202000014), where the accrual's re-check finds them and corrects their ledger.
//!
//! A change and its checks are one transaction: nothing is written when it is refused.

use chrono::{DateTime, NaiveDate, Utc};

use crate::store::Db;

/// One closed day.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ClosedDay {
    pub day: NaiveDate,
    pub reason: String,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
}

/// What a change did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changed {
    /// The days whose state changed (closed by `close`, opened by `open`); days already so are left alone.
    pub days: Vec<NaiveDate>,
    /// Loans queued for the accrual's re-check because a changed day is already over.
    pub loans_queued: u64,
}

/// Why a change was not made.
#[derive(Debug, thiserror::Error)]
pub enum CalendarError {
    /// A changed day lies in (or before) a month whose settlement has started for some shard.
    #[error(
        "{day} is in a month already settled: fine-settlement of {month} has a key for shard {shard} of \
         {shards} ({status}), and a settled fine never changes"
    )]
    Settled {
        day: NaiveDate,
        /// The month's business date (its last day).
        month: NaiveDate,
        shards: i32,
        shard: i32,
        status: String,
    },
    /// The database failed.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// PostgreSQL's earliest date, 4714-11-24 BC.
const PG_EARLIEST: NaiveDate = match NaiveDate::from_ymd_opt(-4713, 11, 24) {
    Some(d) => d,
    None => NaiveDate::MIN,
};

/// The closed days in `[from, to]` (each end optional), in order.
pub async fn list(
    pool: &Db,
    from: Option<NaiveDate>,
    to: Option<NaiveDate>,
) -> Result<Vec<ClosedDay>, sqlx::Error> {
    sqlx::query_as!(
        ClosedDay,
        r#"select day, reason, created_at, created_by from library_closed_days
           where day >= $1 and day <= $2
           order by day"#,
        from.unwrap_or(PG_EARLIEST),
        // A day past the last date chrono has (inserted by hand: PostgreSQL's dates go further) is not listed.
        to.unwrap_or(NaiveDate::MAX),
    )
    .fetch_all(pool)
    .await
}

/// Closes every day of `[from, to]` not closed yet, recording why and by whom.
pub async fn close(
    pool: &Db,
    (from, to): (NaiveDate, NaiveDate),
    reason: &str,
    by: &str,
    today: NaiveDate,
) -> Result<Changed, CalendarError> {
    let mut tx = pool.begin().await?;
    take_calendar(&mut tx).await?;
    let days = sqlx::query_scalar!(
        r#"insert into library_closed_days (day, reason, created_by)
           select d::date, $3, $4 from generate_series($1::date, $2::date, interval '1 day') d
           on conflict on constraint library_closed_days_pkey do nothing
           returning day"#,
        from,
        to,
        reason,
        by,
    )
    .fetch_all(&mut *tx)
    .await?;
    let loans_queued = after_change(&mut tx, &days, today).await?;
    tx.commit().await?;
    Ok(Changed { days, loans_queued })
}

/// Opens every closed day of `[from, to]`.
pub async fn open(
    pool: &Db,
    (from, to): (NaiveDate, NaiveDate),
    today: NaiveDate,
) -> Result<Changed, CalendarError> {
    let mut tx = pool.begin().await?;
    take_calendar(&mut tx).await?;
    let days = sqlx::query_scalar!(
        r#"delete from library_closed_days where day between $1 and $2 returning day"#,
        from,
        to,
    )
    .fetch_all(&mut *tx)
    .await?;
    let loans_queued = after_change(&mut tx, &days, today).await?;
    tx.commit().await?;
    Ok(Changed { days, loans_queued })
}

/// Takes the calendar's lock ([`CALENDAR_LOCK`](crate::store::ledger::CALENDAR_LOCK)) before the change touches a
/// row: its numbering trigger takes it too, after the statement — a `close` and an `open` at once each held a row
/// the other's renumbering needed while waiting for that lock (a deadlock, one of them failing).
async fn take_calendar(tx: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    let (space, key) = crate::store::ledger::CALENDAR_LOCK;
    sqlx::query_scalar!(
        r#"select 1 as "taken!" from pg_advisory_xact_lock($1, $2)"#,
        space,
        key
    )
    .fetch_one(&mut *tx)
    .await?;
    Ok(())
}

/// The checks and consequences of changing `days`, inside the change's transaction: refuses a change in a
/// settled month, and queues the loans overdue on a changed day already over for the re-check.
async fn after_change(
    tx: &mut sqlx::PgConnection,
    days: &[NaiveDate],
    today: NaiveDate,
) -> Result<u64, CalendarError> {
    let Some(&first) = days.iter().min() else {
        return Ok(0);
    };
    // A loan whose fine depends on a day was returned on or after it, so it is settled in that day's month or a
    // later one: any settlement key of those months (whatever its status: a failed run may have settled
    // batches) means a fine that could change is already written.
    let settled = sqlx::query!(
        r#"select business_date, shards, shard, status from job_runs
           where job_name = 'fine-settlement'
             and business_date >= (date_trunc('month', $1::date) + interval '1 month - 1 day')::date
           order by business_date, shards, shard
           limit 1"#,
        first,
    )
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(k) = settled {
        return Err(CalendarError::Settled {
            day: first,
            month: k.business_date,
            shards: k.shards,
            shard: k.shard,
            status: k.status,
        });
    }
    let past: Vec<NaiveDate> = days.iter().copied().filter(|d| *d < today).collect();
    if past.is_empty() {
        return Ok(0);
    }
    // The loans out and overdue on a changed past day (grace aside: a loan queued needlessly is found as owed
    // and leaves the queue): loans still out, and loans returned late on or after the first such day. A scan of
    // `loans` (a second or so a million loans): a past day is changed rarely, and an index for it would cost
    // every checkout and late return of libraryd's (docs/performance.md, "fine-settler's indexes").
    let queued = sqlx::query!(
        r#"insert into fine_loan_changes (loan_id)
           select l.id from loans l
           where l.returned_on is null and l.due_on < (select max(d) from unnest($1::date[]) d)
             and exists (select 1 from unnest($1::date[]) d where l.due_on < d)
           union
           select l.id from loans l
           where l.returned_on >= (select min(d) from unnest($1::date[]) d) and l.returned_on > l.due_on
             and exists (select 1 from unnest($1::date[]) d where l.due_on < d and d <= l.returned_on)"#,
        &past,
    )
    .execute(&mut *tx)
    .await?;
    Ok(queued.rows_affected())
}
