//! `verify`'s audit on a Citus coordinator: the two statements of [`crate::store::audit`] that Citus does not
//! plan as PostgreSQL's are written, in forms it plans that compute the same answers.
//!
//! Measured against Citus 14.0.1 (`scripts/citus.sh`):
//! - **The month's fines.** PostgreSQL's statement counts a loan's closed days in a scalar subquery inside a
//!   lateral subquery without `FROM` (the fine's `case`), which Citus refuses: "correlated subqueries are not
//!   supported when the FROM clause contains a subquery without FROM". Here the closed days are counted in a
//!   lateral join of their own, read by the fine's `case`; the policy version is still written out (the lateral
//!   `order by … limit 1` over the reference table `fine_policies` plans on Citus), apart from the rule functions
//!   settlement calls. Citus runs the statement on every worker, each over its shards of `loans` and its copy of
//!   the rules, and merges the counts and sums on the coordinator.
//! - **The reconciliation with the ledger.** PostgreSQL's statement reads each loan's net and its over-charged
//!   days in scalar subqueries that call the rule functions, which Citus refuses ("Only immutable functions can
//!   be used as a table expressions in a multi-shard query"), and checks the accrual's keys in `job_runs`, a table
//!   of the coordinator's, beside them. Here the loans' nets and over-charged days are one grouped join (a loan's
//!   ledger rows live on its worker, colocated by `loan_id`), which Citus computes on the workers into a result
//!   on the coordinator (the `materialized` CTE); the rest of the statement — the keys' check, the counts — is
//!   PostgreSQL's, run on the coordinator over that result and `job_runs`. The coordinator holds one row per
//!   loan returned in the month while it runs. The view `fine_ledger_net` is written out, each loan's days
//!   summed from its own rows: joined as the view, its `union all` was not pushed down, and Citus copied the
//!   whole ledger, every month of it, to the coordinator and on to every worker (the statement took 2.4 s so at
//!   20,000 loans and 56,000 ledger rows, 1.1 s written out).
//!
//! The other statements of the audit (the shard counts that settled the month, the loans of no month) run on
//! Citus as they are. Like the rest of [`super`], these are plain SQL that also runs on PostgreSQL, not checked
//! against the migrations at build time: `tests/it/engines.rs` runs them against PostgreSQL's on one database and
//! compares every answer, and the Citus suite (`tests/it/citus/verify.rs`) runs `verify` on the cluster.

use chrono::NaiveDate;

use crate::store::{
    audit::{Fines, Reconciled, UNKNOWN_CLASSES_SHOWN},
    Db,
};

/// [`crate::store::audit`]'s month's fines on Citus: the same columns, the closed days counted in a join.
///
/// The join's lower bound is the end of the grace period only where the fine's `case` reaches its count (finite
/// dates, returned after the grace period, closed days not charged); elsewhere it is null and counts nothing,
/// so no date is computed that PostgreSQL's statement would not compute (`due_on + grace` can leave the date
/// range on a loan due near its end), and the count stays a walk of the primary key between two days.
pub(crate) async fn fines(pool: &Db, (first, last): (NaiveDate, NaiveDate)) -> Result<Fines, sqlx::Error> {
    sqlx::query_as(
        "with l as (
             select l.id, l.fine_cents, l.fine_settled_at, isfinite(l.due_on) as finite,
                    case when isfinite(l.due_on) then f.fine_cents end as expected,
                    l.fine_class is not null and p.fine_class is distinct from l.fine_class as unknown_class,
                    l.fine_class
             from loans l
             left join lateral (
                 select v.fine_class, v.daily_rate_cents, v.grace_days, v.cap_cents, v.charge_closed_days
                 from fine_policies v
                 where v.effective_from <= l.due_on and (v.fine_class = l.fine_class or v.fine_class = 'default')
                 order by (v.fine_class = l.fine_class) desc nulls last, v.effective_from desc
                 limit 1) p on true
             left join lateral (
                 select count(*) as days from library_closed_days c
                 where c.day > case when not (isfinite(l.due_on) and isfinite(l.returned_on)) then null
                                    when l.returned_on - l.due_on > p.grace_days and not p.charge_closed_days
                                        then l.due_on + p.grace_days
                               end
                   and c.day <= l.returned_on) closed on true
             left join lateral (
                 select case
                     when not (isfinite(l.due_on) and isfinite(l.returned_on)) then null
                     when l.returned_on - l.due_on <= p.grace_days then 0::bigint
                     else least(nullif(p.cap_cents, 0),
                                p.daily_rate_cents
                                * ((l.returned_on - l.due_on - p.grace_days)::bigint - closed.days))
                 end as fine_cents) f on true
             where l.returned_on between $1 and $2
         )
         select count(*) filter (where finite) as returned,
                count(fine_settled_at) filter (where finite) as settled,
                count(*) filter (where fine_settled_at is not null and fine_cents is distinct from expected)
                    as wrong_fine,
                coalesce(sum(fine_cents) filter (where fine_settled_at is not null and finite), 0)::bigint
                    as total_cents,
                coalesce(sum(expected), 0)::bigint as expected_cents,
                coalesce(array_agg(id order by id) filter (where fine_settled_at is not null and not finite),
                         '{}') as settled_not_finite,
                count(*) filter (where finite and expected is null) as without_policy,
                count(*) filter (where unknown_class) as unknown_class,
                coalesce((array_agg(distinct fine_class) filter (where unknown_class))[1:$3], '{}')
                    as unknown_classes
         from l",
    )
    .bind(first)
    .bind(last)
    .bind(UNKNOWN_CLASSES_SHOWN as i32)
    .fetch_one(pool)
    .await
}

/// [`crate::store::audit`]'s reconciliation with the ledger on Citus: the same answers, each loan's net and
/// over-charged days grouped from one join of its days (as `fine_ledger_net` has them: each day's first charge
/// and corrections, the days whose net is not zero).
///
/// A loan without ledger rows is joined to no day (its net is 0, none of its days over-charged); the rule
/// function is then asked about its return day instead of a null one, which it would price without its guards
/// (and `due_on + grace` can leave the date range on a loan due near its end).
pub(crate) async fn ledger(
    pool: &Db,
    (first, last): (NaiveDate, NaiveDate),
) -> Result<Reconciled, sqlx::Error> {
    sqlx::query_as(
        "with r as materialized (
             select l.id, l.fine_cents, l.fine_settled_at, l.due_on, l.returned_on, p.grace_days,
                    coalesce(sum(n.net_cents), 0)::bigint as net,
                    count(*) filter (where n.net_cents > a.amount_cents) as over
             from loans l
             cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
             -- fine_ledger_net's rows of the loan, the view written out.
             left join lateral (
                 select e.accrual_date, sum(e.amount_cents)::bigint as net_cents
                 from (select f.accrual_date, f.amount_cents from fine_ledger f where f.loan_id = l.id
                       union all
                       select c.accrual_date, c.amount_cents from fine_ledger_corrections c
                       where c.loan_id = l.id) e
                 group by e.accrual_date
                 having sum(e.amount_cents) <> 0) n on true
             cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on,
                                                               coalesce(n.accrual_date, l.returned_on),
                                                               p.daily_rate_cents, p.grace_days, p.cap_cents,
                                                               p.charge_closed_days) a
             where l.returned_on between $1 and $2 and isfinite(l.due_on)
             group by l.id, p.grace_days
         ), covered as (
             select r.* from r
             where r.fine_settled_at is not null and r.returned_on - r.due_on > r.grace_days
               and not exists (
                   select 1 from generate_series(0, r.returned_on - r.due_on - r.grace_days - 1) k
                   where not exists (select 1 from job_runs j
                                     where j.job_name = 'overdue-accrual' and j.business_date = r.returned_on - k
                                       and j.status = 'SUCCESS'
                                       and j.shard = fine_settler_shard_of(r.id, j.shards)))
         )
         select (select count(*) from covered) as checked,
                (select count(*) from covered where net <> fine_cents) as mismatches,
                (select count(*) from r where over > 0) as over_accrued",
    )
    .bind(first)
    .bind(last)
    .fetch_one(pool)
    .await
}
