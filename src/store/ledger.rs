//! `fine_ledger` and `fine_pending`: the accrual scan, its charges, and the compensation queue.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use sqlx::PgConnection;

use crate::store::Db;

use crate::shard::ShardSpec;

/// A loan with work on the accrual day: a charge to write, or a correction (on Citus, a loan that may have
/// work: [`crate::store::citus::ledger::candidates`]).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Overdue {
    pub id: i64,
}

/// Which loans a run of an accrual day looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scope {
    /// Every loan of the shard: a day's first run, a takeover, and every operator command.
    #[default]
    Full,
    /// Only the loans libraryd changed (`fine_loan_changes`): a day the daemon's re-check re-opened, where only
    /// those can have work.
    Changed,
}

/// The next batch of the shard's loans with work on `day` (ascending id, from `from_id`): those owed a charge —
/// the day's canonical amount is not zero and the day is neither charged nor queued — and those charged on the
/// day whose net is not the canonical amount (a correction).
///
/// The charges are found by a walk of the primary key with one key probe of the ledger and of the queue per
/// overdue loan (the `offset 0` fences keep the planner from turning the `not exists` into anti-joins that hash
/// the whole ledger for every batch); the corrections by a walk of the day's charges. The cap's sums are read
/// once, by the charge, not for every loan scanned (a batch relieves a changed loan's over-charged days before
/// its charge, so what is left under the cap covers the canonical amount). The day's walk is written as a row comparison on
/// `(accrual_date, loan_id)` so that the generic plan the jobs keep uses `fine_ledger_day_idx` from the cursor;
/// with `loan_id >= $1` it walked the primary key over every day's charges (229 ms of a 378 ms batch at
/// 1,000,000 loans with a week of ledger, bench/README.md). On Citus the batch is the loans that may have work,
/// unpriced ([`crate::store::citus::ledger::candidates`]); the batch's write prices them.
pub async fn overdue_batch(
    pool: &Db,
    day: NaiveDate,
    shard: ShardSpec,
    scope: Scope,
    from_id: i64,
    limit: i64,
) -> Result<Vec<Overdue>, sqlx::Error> {
    match (scope, pool.engine()) {
        (Scope::Full, crate::config::Engine::Postgresql) => {
            full_batch(pool, day, shard, from_id, limit).await
        }
        (Scope::Full, crate::config::Engine::Citus) => {
            crate::store::citus::ledger::candidates(pool, day, shard, from_id, limit).await
        }
        (Scope::Changed, _) => changed_batch(pool, day, shard, from_id, limit).await,
    }
}

async fn full_batch(
    pool: &Db,
    day: NaiveDate,
    shard: ShardSpec,
    from_id: i64,
    limit: i64,
) -> Result<Vec<Overdue>, sqlx::Error> {
    sqlx::query_as!(
        Overdue,
        r#"select u.id as "id!" from (
               (select l.id from loans l
                cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
                cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $4, p.daily_rate_cents,
                                                                  p.grace_days, p.cap_cents,
                                                                  p.charge_closed_days) a
                where l.id >= $1 and fine_settler_shard_of(l.id, $2) = $3
                  and l.due_on < $4::date
                  and (l.returned_on is null or l.returned_on >= $4)
                  and a.amount_cents > 0
                  and not exists (select 1 from fine_ledger f
                                  where f.loan_id = l.id and f.accrual_date = $4 offset 0)
                  and not exists (select 1 from fine_pending q
                                  where q.loan_id = l.id and q.accrual_date = $4 offset 0)
                order by l.id
                limit $5)
               union all
               (select f.loan_id
                from fine_ledger f
                -- The loan by its key for each charge (a join, planned on a ledger whose statistics
                -- predate the day's charges, scanned the whole loans table for each).
                cross join lateral (select l.id, l.due_on, l.returned_on, l.fine_class from loans l
                                    where l.id = f.loan_id offset 0) l
                cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
                cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $4, p.daily_rate_cents,
                                                                  p.grace_days, p.cap_cents,
                                                                  p.charge_closed_days) a
                cross join lateral (select f.amount_cents + coalesce(sum(c.amount_cents), 0) as net
                                    from fine_ledger_corrections c
                                    where c.loan_id = f.loan_id and c.accrual_date = $4) n
                where f.accrual_date = $4 and (f.accrual_date, f.loan_id) >= ($4, $1)
                  and fine_settler_shard_of(f.loan_id, $2) = $3
                  and a.amount_cents <> n.net and isfinite(l.due_on) and coalesce(isfinite(l.returned_on), true)
                order by f.accrual_date, f.loan_id
                limit $5)
           ) u
           order by u.id
           limit $5"#,
        from_id,
        shard.shards(),
        shard.shard(),
        day,
        limit,
    )
    .fetch_all(pool)
    .await
}

async fn changed_batch(
    pool: &Db,
    day: NaiveDate,
    shard: ShardSpec,
    from_id: i64,
    limit: i64,
) -> Result<Vec<Overdue>, sqlx::Error> {
    sqlx::query_as!(
        Overdue,
        r#"select l.id as "id!"
           from (select distinct c.loan_id from fine_loan_changes c
                 where c.loan_id >= $1 and fine_settler_shard_of(c.loan_id, $2) = $3) ch
           join loans l on l.id = ch.loan_id
           cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
           cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $4, p.daily_rate_cents,
                                                             p.grace_days, p.cap_cents, p.charge_closed_days) a
           left join fine_ledger f on f.loan_id = l.id and f.accrual_date = $4
           cross join lateral (select coalesce(f.amount_cents, 0) + coalesce(sum(c.amount_cents), 0) as net
                               from fine_ledger_corrections c
                               where c.loan_id = l.id and c.accrual_date = $4) n
           where (f.loan_id is null and a.amount_cents > 0
                  and not exists (select 1 from fine_pending q where q.loan_id = l.id and q.accrual_date = $4))
              or (f.loan_id is not null and a.amount_cents <> n.net
                  and isfinite(l.due_on) and coalesce(isfinite(l.returned_on), true))
           order by l.id
           limit $5"#,
        from_id,
        shard.shards(),
        shard.shard(),
        day,
        limit,
    )
    .fetch_all(pool)
    .await
}

/// What a run of `day` starting at `from_id` would write (`backfill --dry-run`): the charges and the
/// corrections [`overdue_batch`] finds (in [`Scope::Full`]), counted. Since a day's amount depends on the loan
/// alone, this is what the run then writes, cap included, when nothing else writes meanwhile — except that, with
/// a cap, the corrections a run writes on the other days of a changed loan whose day would not fit under the cap
/// ([`relieve`](crate::store::corrections::relieve): a due date moved earlier) are counted here under the day they
/// correct: over a range of days that holds them, the counts add up to what the runs write.
pub async fn count_work(
    pool: &Db,
    day: NaiveDate,
    shard: ShardSpec,
    from_id: i64,
) -> Result<(i64, i64), sqlx::Error> {
    let row = sqlx::query!(
        r#"select
             (select count(*)
              from (select l.id from loans l
                    cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
                    cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $4,
                                                                      p.daily_rate_cents, p.grace_days, p.cap_cents,
                                                                      p.charge_closed_days) a
                    where l.id >= $1 and fine_settler_shard_of(l.id, $2) = $3
                      and l.due_on < $4::date
                      and (l.returned_on is null or l.returned_on >= $4)
                      and a.amount_cents > 0
                      and not exists (select 1 from fine_ledger f
                                      where f.loan_id = l.id and f.accrual_date = $4 offset 0)
                      and not exists (select 1 from fine_pending q
                                      where q.loan_id = l.id and q.accrual_date = $4 offset 0)
                    offset 0) c) as "charges!",
             (select count(*)
              from fine_ledger f
              -- The loan by its key for each charge (a join, planned on a ledger whose statistics
              -- predate the day's charges, scanned the whole loans table for each).
              cross join lateral (select l.id, l.due_on, l.returned_on, l.fine_class from loans l
                                  where l.id = f.loan_id offset 0) l
              cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
              cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $4, p.daily_rate_cents,
                                                                p.grace_days, p.cap_cents,
                                                                p.charge_closed_days) a
              cross join lateral (select f.amount_cents + coalesce(sum(c.amount_cents), 0) as net
                                  from fine_ledger_corrections c
                                  where c.loan_id = f.loan_id and c.accrual_date = $4) n
              where f.accrual_date = $4 and (f.accrual_date, f.loan_id) >= ($4, $1)
                and fine_settler_shard_of(f.loan_id, $2) = $3
                and a.amount_cents <> n.net and isfinite(l.due_on) and coalesce(isfinite(l.returned_on), true))
             as "corrections!""#,
        from_id,
        shard.shards(),
        shard.shard(),
        day,
    )
    .fetch_one(pool)
    .await?;
    Ok((row.charges, row.corrections))
}

/// The calendar's lock (`pg_advisory_xact_lock(1718829932, 0)`: ASCII "fsCl" and 0), which every change of
/// `library_closed_days` takes exclusively (its numbering trigger, migrations/20261203000052) and every batch
/// that prices loans takes shared, first, for its transaction: a calendar change waits for the batches in flight
/// to commit, and a batch that starts meanwhile waits for the change — so a batch never prices a loan with a
/// calendar about to change under it, and the change's own checks and queueing (src/store/calendar.rs) see
/// every batch's work.
pub const CALENDAR_LOCK: (i32, i32) = (0x6673_436c, 0);

/// Takes the calendar's lock shared for the rest of the transaction ([`CALENDAR_LOCK`]); settlement's batches
/// (the accrual's take it in [`lock_loans`]).
pub async fn hold_calendar(tx: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query_scalar!(
        r#"select 1 as "held!" from pg_advisory_xact_lock_shared($1, $2)"#,
        CALENDAR_LOCK.0,
        CALENDAR_LOCK.1,
    )
    .fetch_one(&mut *tx)
    .await?;
    Ok(())
}

/// [`hold_calendar`] if the lock is granted at once: `false` when a calendar change holds it or waits for it.
pub async fn try_hold_calendar(tx: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(
        r#"select pg_try_advisory_xact_lock_shared($1, $2) as "held!""#,
        CALENDAR_LOCK.0,
        CALENDAR_LOCK.1,
    )
    .fetch_one(&mut *tx)
    .await
}

/// The advisory-lock namespace of per-loan ledger locks (`pg_advisory_xact_lock(space, hashint8(loan_id))`):
/// ASCII "fsLd". A collision of two loans' hashes only makes their charges wait for each other. The trigger that
/// keeps a charged loan's id (`fine_settler_loan_keeps_its_id`, migrations/20261205000062) takes it too, by its
/// number, before it looks for the loan's charges.
const LOAN_LOCK_SPACE: i32 = 0x6673_4c64;

/// Locks each loan of `ids` for the rest of the transaction, in one fixed order (that of the lock keys), so that
/// two transactions locking overlapping sets cannot deadlock — when some policy has a cap (the locks guard the
/// cap's sums; with no cap anywhere there is nothing to guard, and the statement takes none). Every charge takes
/// this lock before it reads what the loan has accrued: charges for different days never meet on the ledger's
/// key, and without it two runs (a second replica of the shard, a manual `accrue`, `pending retry`, the overlap
/// of two shard counts) would each read the same total and together charge past the cap. Waits at most the
/// transaction's `lock_timeout`. (A version with a cap added meanwhile takes effect from today on — the table's
/// insert trigger refuses an earlier date — so it governs only loans not yet due, none of which any run charges
/// yet.) The same statement takes the calendar's lock shared ([`CALENDAR_LOCK`]), as every batch that prices
/// loans does: it is the first statement of each batch and of each compensation retry.
///
/// It also has the rest of the transaction's statements planned at each execution (`plan_cache_mode =
/// force_custom_plan`, local to the transaction), with the tables' sizes of the moment. The job connections
/// otherwise keep one generic plan per statement, built at its first execution: on a new deployment the ledger
/// is empty then, and the cap's sums of a loan's charges, planned for an empty table, read the day's index
/// whole (`loan_id` is its second column) instead of the key — each batch of a day slower than the one before,
/// 0.7 s to 10 s a batch of 10,000 on the first day of 170,000 charges, until autovacuum analysed the ledger.
/// Planning costs a few milliseconds a batch.
pub async fn lock_loans(tx: &mut PgConnection, ids: &[i64]) -> Result<(), sqlx::Error> {
    sqlx::query_scalar!(
        r#"select (select count(*) from pg_advisory_xact_lock_shared($3, $4)
                   where set_config('plan_cache_mode', 'force_custom_plan', true) is not null)
                  + (select count(*) from (
                         select pg_advisory_xact_lock($1::int, k.key)
                         from (select distinct hashint8(b.id) as key from unnest($2::bigint[]) as b (id)
                               order by 1) k
                         where exists (select 1 from fine_policies c where c.cap_cents > 0)
                     ) locks) as "locked!""#,
        LOAN_LOCK_SPACE,
        ids,
        CALENDAR_LOCK.0,
        CALENDAR_LOCK.1,
    )
    .fetch_one(&mut *tx)
    .await?;
    Ok(())
}

/// Takes, without waiting, the lock of each loan of `ids` that no other transaction holds (when some policy has a
/// cap, as [`lock_loans`]); returns the loans whose lock another transaction holds, in ascending order. For a
/// batch whose [`lock_loans`] waited past the lock timeout: take the calendar's lock first (`lock_loans` with no
/// loans). A lock taken without waiting cannot deadlock, whatever the order.
pub async fn try_lock_loans(tx: &mut PgConnection, ids: &[i64]) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"select coalesce(array_agg(k.id order by k.id) filter (where not k.locked), '{}') as "held!"
           from (select b.id, pg_try_advisory_xact_lock($1::int, hashint8(b.id)) as locked
                 from unnest($2::bigint[]) as b (id)
                 where exists (select 1 from fine_policies c where c.cap_cents > 0)
                 offset 0) k"#,
        LOAN_LOCK_SPACE,
        ids,
    )
    .fetch_one(&mut *tx)
    .await
}

/// The loans of `ids` charged on `day` (a first charge in `fine_ledger`), in ascending order.
pub async fn charged_on(tx: &mut PgConnection, day: NaiveDate, ids: &[i64]) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar!(
        r#"select f.loan_id as "loan_id!" from fine_ledger f
           where f.loan_id = any($2::bigint[]) and f.accrual_date = $1
           order by f.loan_id"#,
        day,
        ids,
    )
    .fetch_all(&mut *tx)
    .await
}

/// How a charge or a correction treats a positive amount that does not fit under the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clamp {
    /// Writes nothing for it and reports the loan as held back: its other days hold more than they owe (a
    /// changed loan, or a policy changed since they were charged), and relieving them first lets the day be
    /// written in full ([`relieve`](crate::store::corrections::relieve)).
    Hold,
    /// Writes what is left under the cap, if anything: the guard that keeps a loan's net under the cap in every
    /// committed state whatever else happened.
    Cut,
}

impl Clamp {
    fn holds(self) -> bool {
        self == Clamp::Hold
    }
}

/// What a charge wrote, and the loans whose amount it held back ([`Clamp::Hold`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Charged {
    pub written: u64,
    pub held: Vec<i64>,
}

/// Charges each loan of `ids` for `day` its canonical amount under its policy (`fine_settler_policy_day_amount`,
/// by the loans row as it is now: nothing if the day is not owed) when it fits under the policy's cap; one that
/// does not is held back or cut (`clamp`). While a loan's ledger is canonical every amount fits (canonical
/// amounts add up to at most the cap). The cap's remainder is read here, so call [`lock_loans`] first in the
/// same transaction. A day already charged is skipped. (The `offset 0` fence computes each amount once:
/// inlined, the cap's two sums were taken twice per loan, for the filter and for the row.)
pub async fn charge(
    tx: &mut PgConnection,
    day: NaiveDate,
    ids: &[i64],
    clamp: Clamp,
) -> Result<Charged, sqlx::Error> {
    let row = sqlx::query!(
        r#"with c as (
               select l.id, a.amount_cents as target,
                      case when p.cap_cents = 0 then a.amount_cents
                           else least(a.amount_cents,
                                      p.cap_cents
                                      - coalesce((select sum(x.amount_cents) from fine_ledger x
                                                  where x.loan_id = l.id), 0)
                                      - coalesce((select sum(y.amount_cents) from fine_ledger_corrections y
                                                  where y.loan_id = l.id), 0))
                      end as amount
               from loans l
               cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
               cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents,
                                                                 p.grace_days, p.cap_cents,
                                                                 p.charge_closed_days) a
               where l.id = any($2::bigint[]) and a.amount_cents > 0
               offset 0
           ), written as (
               insert into fine_ledger (loan_id, accrual_date, amount_cents)
               select c.id, $1, c.amount from c
               where c.amount > 0 and (not $3 or c.amount = c.target)
               on conflict on constraint fine_ledger_pkey do nothing
               returning loan_id
           )
           select (select count(*) from written) as "written!",
                  coalesce((select array_agg(c.id order by c.id) from c
                            where $3 and c.amount < c.target
                              and not exists (select 1 from fine_ledger f
                                              where f.loan_id = c.id and f.accrual_date = $1)), '{}')
                      as "held!""#,
        day,
        ids,
        clamp.holds(),
    )
    .fetch_one(&mut *tx)
    .await?;
    Ok(Charged {
        written: u64::try_from(row.written).unwrap_or(0),
        held: row.held,
    })
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

/// Sets this transaction's statement timeout to `value` (as PostgreSQL writes one: `500ms`, `30s`), and returns
/// the one it replaces, to be set back the same way: charges isolated row by row run under a short one, and the
/// batch's statements after them under the batch's own.
pub async fn set_local_statement_timeout(tx: &mut PgConnection, value: &str) -> Result<String, sqlx::Error> {
    sqlx::query_scalar!(
        r#"select s.before as "before!"
           from (select current_setting('statement_timeout') as before offset 0) s
           where set_config('statement_timeout', $1, true) is not null"#,
        value
    )
    .fetch_one(&mut *tx)
    .await
}

/// Whether `day` has a loan of `shard` with work — a charge or a correction (the predicate of
/// [`overdue_batch`] in [`Scope::Full`]): the accrual's re-open question for one key, as `accrue` and `backfill`
/// ask it. It looks at every overdue loan of the day (the open ones and those returned late on or after it: a scan
/// of `loans`, since no index of fine-settler's serves an operator's question alone) and at the day's charges.
/// The daemon re-opens the days its re-check finds from the loans libraryd changed; it asks this only when a
/// free claim of a key finds it done (a peer finished it between the tick's look and the claim): rare, and a
/// scan then (a third of a second at 1,000,000 loans).
pub async fn day_has_work(pool: &Db, day: NaiveDate, shard: ShardSpec) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(
        r#"select exists (
                  select 1
                  from (select l.id, l.due_on, l.returned_on, l.fine_class from loans l
                        where l.returned_on is null and l.due_on < $1::date
                        union all
                        select l.id, l.due_on, l.returned_on, l.fine_class from loans l
                        where l.returned_on > l.due_on and l.returned_on >= $1 and l.due_on < $1::date) l
                  cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
                  cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents,
                                                                    p.grace_days, p.cap_cents,
                                                                    p.charge_closed_days) a
                  where fine_settler_shard_of(l.id, $2) = $3
                    and a.amount_cents > 0
                    and not exists (select 1 from fine_ledger f where f.loan_id = l.id and f.accrual_date = $1)
                    and not exists (select 1 from fine_pending q where q.loan_id = l.id and q.accrual_date = $1))
               or exists (
                  select 1
                  from fine_ledger f
                  -- The loan by its key for each charge (a join, planned on a ledger whose statistics
                  -- predate the day's charges, scanned the whole loans table for each).
                  cross join lateral (select l.id, l.due_on, l.returned_on, l.fine_class from loans l
                                      where l.id = f.loan_id offset 0) l
                  cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
                  cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents,
                                                                    p.grace_days, p.cap_cents,
                                                                    p.charge_closed_days) a
                  cross join lateral (select f.amount_cents + coalesce(sum(c.amount_cents), 0) as net
                                      from fine_ledger_corrections c
                                      where c.loan_id = f.loan_id and c.accrual_date = $1) n
                  where f.accrual_date = $1 and fine_settler_shard_of(f.loan_id, $2) = $3
                    and a.amount_cents <> n.net and isfinite(l.due_on)
                    and coalesce(isfinite(l.returned_on), true))
               as "late!""#,
        day,
        shard.shards(),
        shard.shard(),
    )
    .fetch_one(pool)
    .await
}

/// Queues the failed charges of `ids` for `day`, each with the day's amount under the loan's policy as it is now
/// (for the operator: a retry charges what is owed when it runs), all with `error`. A row already queued for that
/// day is left as it is. A loan owed nothing that day by its row as it is now (libraryd changed or deleted it
/// since the batch was read; on Citus, a batch's loans are not priced before the write) is not queued: there is
/// nothing to charge, and the queue holds only positive amounts (`fine_pending_amount_positive`).
pub async fn enqueue(
    tx: &mut PgConnection,
    ids: &[i64],
    day: NaiveDate,
    error: &str,
    retry_in_ms: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        r#"insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
           select o.id, $2, o.amount_cents, 1, $3, now() + $4 * interval '1 millisecond'
           from (select b.id,
                        (select a.amount_cents from loans l
                         cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
                         cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $2,
                                                                           p.daily_rate_cents, p.grace_days,
                                                                           p.cap_cents, p.charge_closed_days) a
                         where l.id = b.id) as amount_cents
                 from unnest($1::bigint[]) as b (id)
                 offset 0) o
           where o.amount_cents > 0
           on conflict on constraint fine_pending_pkey do nothing"#,
        ids,
        day,
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

/// What a failed retry of a pending charge does to its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The charge was rejected: the attempt counts, the next waits `retry_in`, and the row is DEAD if this was
    /// the last.
    Spent { retry_in: Duration, dead: bool },
    /// It only waited too long for a lock: no attempt is counted, and the next waits twice the last wait
    /// (at least `first`, at most `max`), so a charge held up for long is retried less and less often.
    Busy { first: Duration, max: Duration },
}

/// Records a failed retry of the pending charge `(loan_id, day)`: the error, the next attempt time, the attempt
/// counted if it was spent, and DEAD once it is the last. Times are taken when this statement starts (after the
/// retry's lock wait, not at its transaction's start). Returns the wait before the next attempt.
pub async fn retry_failed(
    tx: &mut PgConnection,
    (loan_id, day): (i64, NaiveDate),
    error: &str,
    attempt: Attempt,
) -> Result<Duration, sqlx::Error> {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let (spent, dead, retry_in, first, max) = match attempt {
        Attempt::Spent { retry_in, dead } => (true, dead, ms(retry_in), 0.0, 0.0),
        Attempt::Busy { first, max } => (false, false, 0.0, ms(first), ms(max)),
    };
    let waits_ms = sqlx::query_scalar!(
        r#"update fine_pending set attempts = attempts + case when $5 then 1 else 0 end, last_error = $3,
                  next_attempt_at = statement_timestamp() + case
                      when $5 then $4 * interval '1 millisecond'
                      else least($8 * interval '1 millisecond',
                                 greatest($7 * interval '1 millisecond', 2 * (next_attempt_at - updated_at)))
                  end,
                  status = case when $6 then 'DEAD' else 'PENDING' end, updated_at = statement_timestamp()
           where loan_id = $1 and accrual_date = $2
           returning extract(epoch from next_attempt_at - updated_at)::float8 * 1000 as "waits_ms!""#,
        loan_id,
        day,
        error,
        retry_in,
        spent,
        dead,
        first,
        max,
    )
    .fetch_optional(&mut *tx)
    .await?;
    Ok(Duration::from_secs_f64(waits_ms.unwrap_or(0.0).max(0.0) / 1000.0))
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
