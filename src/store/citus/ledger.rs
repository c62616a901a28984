//! The accrual's writes on a Citus coordinator: the statements of [`crate::store::ledger`] and
//! [`crate::store::corrections`] a batch and a compensation retry run, in forms Citus plans.
//!
//! Each computes what its PostgreSQL statement computes, from the same rule functions and under the same loan
//! locks (taken on the coordinator, where every fine-settler statement is sent; see
//! [`crate::store::ledger::lock_loans`]). What differs is only how the rows are reached, measured against Citus
//! 14.0.1 (`scripts/citus.sh`): Citus refuses a correlated subquery in a statement whose `FROM` holds a CTE, a
//! subquery or a set-returning function ("correlated subqueries are not supported when the FROM clause contains
//! …"), and an `offset` in a lateral subquery that reads a function's column. So the cap's sums are lateral joins
//! of the loan's rows instead of scalar subqueries, a batch's loans are read by `id = any(…)` instead of from
//! `unnest(…)`, and the `offset 0` fences that steer PostgreSQL's planner are left out (every job statement on
//! Citus is planned afresh, docs/citus.md). A loan's rows all live on its loan's worker (colocated by
//! `loan_id`), so each loan's sums are read in one place; Citus runs the statement on every worker the batch's
//! loans reach, in the batch's one transaction.
//!
//! Like the settlement's statements in [`super`], these are meant for Citus (plain SQL, they also run on
//! PostgreSQL) and are tested by the Citus suite (`tests/it/citus/`), not checked against the migrations at build
//! time.

use chrono::NaiveDate;
use sqlx::PgConnection;

use crate::{
    jobs::RunKey,
    shard::ShardSpec,
    store::{
        corrections::Corrected,
        ledger::{Charged, Clamp, Overdue},
        Db,
    },
};

/// [`crate::store::ledger::overdue_batch`]'s batch of a day's run over every loan of the shard, on Citus: the next
/// loans (ascending id, from `from_id`) that may have work on `day`, unpriced — those overdue on the day (due
/// before it, not returned before it) neither charged nor queued for it, and those charged on it. The write
/// prices them: a loan owed nothing that day (in its grace period, a closed day, past its cap) is charged
/// nothing, and a charged day already at its amount gets no correction. Priced here as on PostgreSQL, the scan
/// would price the batch's size of loans on every Citus shard (each shard's ordered, limited scan is run in full
/// before the coordinator merges them): 540 ms a batch of 1,000 against 55 ms unpriced, measured at 20,000 loans
/// on 32 shards of the test cluster.
pub async fn candidates(
    pool: &Db,
    day: NaiveDate,
    shard: ShardSpec,
    from_id: i64,
    limit: i64,
) -> Result<Vec<Overdue>, sqlx::Error> {
    sqlx::query_as(
        "select u.id from (
             (select l.id from loans l
              where l.id >= $1 and fine_settler_shard_of(l.id, $2) = $3
                and l.due_on < $4::date and (l.returned_on is null or l.returned_on >= $4)
                and not exists (select 1 from fine_ledger f where f.loan_id = l.id and f.accrual_date = $4)
                and not exists (select 1 from fine_pending q where q.loan_id = l.id and q.accrual_date = $4)
              order by l.id
              limit $5)
             union all
             (select f.loan_id from fine_ledger f
              where f.accrual_date = $4 and f.loan_id >= $1 and fine_settler_shard_of(f.loan_id, $2) = $3
              order by f.loan_id
              limit $5)
         ) u
         order by u.id
         limit $5",
    )
    .bind(from_id)
    .bind(shard.shards())
    .bind(shard.shard())
    .bind(day)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// [`crate::store::ledger::charge`] on Citus: each loan of `ids` charged for `day` its canonical amount under
/// its policy, when it fits under the cap (held back or cut by `clamp` otherwise); a day already charged is
/// skipped, and a loan whose day was charged when the statement began is never reported held.
pub async fn charge(
    tx: &mut PgConnection,
    day: NaiveDate,
    ids: &[i64],
    clamp: Clamp,
) -> Result<Charged, sqlx::Error> {
    let (written, held): (i64, Vec<i64>) = sqlx::query_as(
        "with c as (
             select l.id, a.amount_cents as target, d.charged,
                    case when p.cap_cents = 0 then a.amount_cents
                         else least(a.amount_cents, p.cap_cents - coalesce(s.total, 0) - coalesce(t.total, 0))
                    end as amount
             from loans l
             cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
             cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents,
                                                               p.grace_days, p.cap_cents, p.charge_closed_days) a
             left join lateral (select sum(x.amount_cents) as total from fine_ledger x
                                where x.loan_id = l.id) s on true
             left join lateral (select sum(y.amount_cents) as total from fine_ledger_corrections y
                                where y.loan_id = l.id) t on true
             left join lateral (select true as charged from fine_ledger f
                                where f.loan_id = l.id and f.accrual_date = $1) d on true
             where l.id = any($2::bigint[]) and a.amount_cents > 0
         ), written as (
             insert into fine_ledger (loan_id, accrual_date, amount_cents)
             select c.id, $1, c.amount from c
             where c.amount > 0 and (not $3 or c.amount = c.target)
             on conflict on constraint fine_ledger_pkey do nothing
             returning loan_id
         )
         select (select count(*) from written),
                coalesce((select array_agg(c.id order by c.id) from c
                          where $3 and c.amount < c.target and c.charged is null), '{}')",
    )
    .bind(day)
    .bind(ids)
    .bind(clamp == Clamp::Hold)
    .fetch_one(&mut *tx)
    .await?;
    Ok(Charged {
        written: u64::try_from(written).unwrap_or(0),
        held,
    })
}

/// [`crate::store::corrections::correct`] on Citus: for each loan of `ids` charged on the run's day, the
/// correction that brings the day's net to its canonical amount, within the cap. Returns the corrections written,
/// by reason, and the loans held back ([`Clamp::Hold`]).
pub async fn correct(
    tx: &mut PgConnection,
    key: &RunKey,
    epoch: i64,
    ids: &[i64],
    clamp: Clamp,
) -> Result<(Corrected, Vec<i64>), sqlx::Error> {
    let (reasons, held): (Vec<String>, Vec<i64>) = sqlx::query_as(
        "with w as materialized (
             select f.loan_id, n.seq, l.due_on, l.returned_on, p.grace_days, p.charge_closed_days,
                    a.amount_cents as target, n.net, f.charged_at,
                    case when a.amount_cents <= n.net or p.cap_cents = 0 then a.amount_cents - n.net
                         else least(a.amount_cents - n.net,
                                    p.cap_cents - coalesce(s.total, 0) - coalesce(t.total, 0))
                    end as delta
             from fine_ledger f
             join loans l on l.id = f.loan_id
             cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
             cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents,
                                                               p.grace_days, p.cap_cents, p.charge_closed_days) a
             cross join lateral (select f.amount_cents + coalesce(sum(c.amount_cents), 0) as net,
                                        coalesce(max(c.seq), 0) + 1 as seq
                                 from fine_ledger_corrections c
                                 where c.loan_id = f.loan_id and c.accrual_date = f.accrual_date) n
             left join lateral (select sum(x.amount_cents) as total from fine_ledger x
                                where x.loan_id = f.loan_id) s on true
             left join lateral (select sum(y.amount_cents) as total from fine_ledger_corrections y
                                where y.loan_id = f.loan_id) t on true
             where f.loan_id = any($2::bigint[]) and f.accrual_date = $1
               and isfinite(l.due_on) and coalesce(isfinite(l.returned_on), true)
         ), written as (
             insert into fine_ledger_corrections (loan_id, accrual_date, seq, amount_cents, reason,
                                                  job_name, business_date, shards, shard, epoch)
             select w.loan_id, $1, w.seq, w.delta,
                    fine_settler_correction_reason(w.due_on, w.returned_on, $1, w.grace_days,
                                                   w.charge_closed_days, w.target, w.net, w.seq, w.charged_at),
                    $3, $1, $4, $5, $6
             from w
             where w.target < w.net
                or (w.target > w.net and w.delta > 0 and (not $7 or w.delta = w.target - w.net))
             on conflict on constraint fine_ledger_corrections_pkey do nothing
             returning reason
         )
         select coalesce((select array_agg(x.reason) from written x), '{}'),
                coalesce((select array_agg(w.loan_id order by w.loan_id) from w
                          where $7 and w.target > w.net and w.delta < w.target - w.net), '{}')",
    )
    .bind(key.business_date)
    .bind(ids)
    .bind(key.job.as_str())
    .bind(key.shard.shards())
    .bind(key.shard.shard())
    .bind(epoch)
    .bind(clamp == Clamp::Hold)
    .fetch_one(&mut *tx)
    .await?;
    Ok((Corrected::named(&reasons), held))
}

/// [`crate::store::corrections::relieve`] on Citus: for each loan of `ids` whose run's day does not fit under its
/// cap, the corrections that bring its other over-charged days down to their canonical amounts. (The reason is
/// named on the coordinator, from the rows the workers found: it reads `fine_settler_marks`, a table of the
/// coordinator's; so does [`correct`]'s.)
pub async fn relieve(
    tx: &mut PgConnection,
    key: &RunKey,
    epoch: i64,
    ids: &[i64],
) -> Result<Corrected, sqlx::Error> {
    let reasons: Vec<String> = sqlx::query_scalar(
        "with w as materialized (
             select f.loan_id, f.accrual_date, n.seq, l.due_on, l.returned_on, p.grace_days, p.charge_closed_days,
                    a.amount_cents as target, n.net, f.charged_at
             from loans l
             cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
             cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents,
                                                               p.grace_days, p.cap_cents,
                                                               p.charge_closed_days) owed
             left join lateral (select sum(x.amount_cents) as total from fine_ledger x
                                where x.loan_id = l.id) s on true
             left join lateral (select sum(y.amount_cents) as total from fine_ledger_corrections y
                                where y.loan_id = l.id) t on true
             left join lateral (select sum(x.amount_cents) as total from fine_ledger x
                                where x.loan_id = l.id and x.accrual_date = $1) sd on true
             left join lateral (select sum(y.amount_cents) as total from fine_ledger_corrections y
                                where y.loan_id = l.id and y.accrual_date = $1) td on true
             join fine_ledger f on f.loan_id = l.id and f.accrual_date <> $1
             cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, f.accrual_date,
                                                               p.daily_rate_cents, p.grace_days, p.cap_cents,
                                                               p.charge_closed_days) a
             cross join lateral (select f.amount_cents + coalesce(sum(c.amount_cents), 0) as net,
                                        coalesce(max(c.seq), 0) + 1 as seq
                                 from fine_ledger_corrections c
                                 where c.loan_id = f.loan_id and c.accrual_date = f.accrual_date) n
             where l.id = any($2::bigint[]) and owed.amount_cents > 0 and p.cap_cents > 0
               and isfinite(l.due_on) and coalesce(isfinite(l.returned_on), true)
               -- what the loan holds, plus what the day still owes, is over the cap
               and coalesce(s.total, 0) + coalesce(t.total, 0)
                   + greatest(owed.amount_cents - coalesce(sd.total, 0) - coalesce(td.total, 0), 0)
                   > p.cap_cents
               and a.amount_cents < n.net
         )
         insert into fine_ledger_corrections (loan_id, accrual_date, seq, amount_cents, reason,
                                              job_name, business_date, shards, shard, epoch)
         select w.loan_id, w.accrual_date, w.seq, w.target - w.net,
                fine_settler_correction_reason(w.due_on, w.returned_on, w.accrual_date, w.grace_days,
                                               w.charge_closed_days, w.target, w.net, w.seq, w.charged_at),
                $3, $1, $4, $5, $6
         from w
         on conflict on constraint fine_ledger_corrections_pkey do nothing
         returning reason",
    )
    .bind(key.business_date)
    .bind(ids)
    .bind(key.job.as_str())
    .bind(key.shard.shards())
    .bind(key.shard.shard())
    .bind(epoch)
    .fetch_all(&mut *tx)
    .await?;
    Ok(Corrected::named(&reasons))
}

/// [`crate::store::ledger::enqueue`] on Citus: the failed charges of `ids` for `day` queued, each with the day's
/// amount under the loan's policy as it is now; a loan owed nothing that day (or deleted) is not queued.
pub async fn enqueue(
    tx: &mut PgConnection,
    ids: &[i64],
    day: NaiveDate,
    error: &str,
    retry_in_ms: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         select l.id, $2, a.amount_cents, 1, $3, now() + $4 * interval '1 millisecond'
         from loans l
         cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
         cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $2, p.daily_rate_cents,
                                                           p.grace_days, p.cap_cents, p.charge_closed_days) a
         where l.id = any($1::bigint[]) and a.amount_cents > 0
         on conflict on constraint fine_pending_pkey do nothing",
    )
    .bind(ids)
    .bind(day)
    .bind(error)
    .bind(retry_in_ms as f64)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// [`crate::store::corrections::note_changes`] on Citus: each loan of `ids` queued for the re-check, unless a
/// change of it is queued and not yet found owed. A loan libraryd deleted is not queued here (its deletion
/// queued it already: the change capture's delete trigger).
pub async fn note_changes(tx: &mut PgConnection, ids: &[i64]) -> Result<(), sqlx::Error> {
    sqlx::query(
        "insert into fine_loan_changes (loan_id)
         select l.id from loans l
         left join lateral (select true as queued from fine_loan_changes c
                            where c.loan_id = l.id and c.cleared_at is null limit 1) q on true
         where l.id = any($1::bigint[]) and q.queued is null",
    )
    .bind(ids)
    .execute(&mut *tx)
    .await?;
    Ok(())
}
