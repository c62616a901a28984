//! The audit behind `verify`: recomputes a settled month in plain SQL, independently of the settlement code (the
//! policy version and the fine written out again, the closed days counted one by one, rather than the SQL
//! functions settlement calls), and reports the loans neither job touches because a date of theirs is not finite.
//!
//! Two of its statements, the month's fines and the reconciliation with the ledger, have forms of their own for
//! a Citus coordinator ([`crate::store::citus::audit`]), chosen by [`Audit`]; both forms give the same answers.

use crate::{
    config::Engine,
    store::{citus, Db},
};
use chrono::NaiveDate;

/// What `verify` found for one business month.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MonthAudit {
    /// Loans returned in the month.
    pub returned: i64,
    /// Of those, settled (`fine_settled_at` set).
    pub settled: i64,
    /// Returned in the month but not settled.
    pub unsettled: i64,
    /// Settled with a fine other than the policy's.
    pub wrong_fine: i64,
    /// Sum of `fine_cents` over the settled loans.
    pub total_cents: i64,
    /// Sum of the policy's fine over all loans returned in the month.
    pub expected_cents: i64,
    /// Shard counts for which every shard's settlement run is SUCCESS.
    pub complete_shard_counts: Vec<i32>,
    /// Settled loans returned late whose every owed day was accrued (its accrual key SUCCESS for the loan's
    /// shard): the ones the ledger can be reconciled with.
    pub ledger_checked: i64,
    /// Of those, loans whose net ledger total (`fine_ledger_net`) differs from `fine_cents`.
    pub ledger_mismatches: i64,
    /// Loans returned in the month with a day whose net exceeds what is owed for it (a return back-dated after
    /// the day was charged, a due date moved later, not yet corrected).
    pub over_accrued: i64,
    /// Loans with a due or return date that is not finite (`infinity`, `-infinity`), which neither job settles
    /// or accrues: every such loan not settled, whatever its month, and the settled ones returned in this month.
    /// They are not counted in `returned` (no fine can be computed for them).
    pub not_finite: i64,
    /// The first of them by id, at most [`NOT_FINITE_SHOWN`].
    pub not_finite_ids: Vec<i64>,
    /// Loans returned in the month (finite due date) that no policy governs — not even the `default` class's
    /// (a `fine_policies` emptied by hand): neither job can price them.
    pub without_policy: i64,
    /// Loans returned in the month whose `fine_class` has no policy version for their due date: priced by the
    /// `default` class's, as the rules say — counted so that a class libraryd misspells shows.
    pub loans_without_class_policy: i64,
    /// Those classes, in order, at most [`UNKNOWN_CLASSES_SHOWN`].
    pub classes_without_policy: Vec<String>,
}

/// How many class names [`MonthAudit::unknown_classes`] lists at most.
pub const UNKNOWN_CLASSES_SHOWN: usize = 20;

/// How many loan ids [`MonthAudit::not_finite_ids`] lists at most.
pub const NOT_FINITE_SHOWN: usize = 20;

/// Audits the loans returned in `[first, last]` against the fine rules in the database: each loan's expected fine
/// is its policy version's over its chargeable days, computed by the database from the loan as it is now with
/// SQL of its own (not the functions settlement calls), apart from what settlement wrote. The statements are
/// those of the pool's engine (`database.engine`).
pub async fn month(pool: &Db, month: (NaiveDate, NaiveDate)) -> Result<MonthAudit, sqlx::Error> {
    Audit::new(pool.engine()).month(pool, month).await
}

/// The audit's statements for one engine (`database.engine`): PostgreSQL's below, or, on a Citus coordinator,
/// the forms of [`citus::audit`] for the two that Citus does not plan as they are written here. Both compute the
/// same answers (plain SQL both, so the tests run either engine's on PostgreSQL and compare them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Audit {
    engine: Engine,
}

impl Audit {
    pub fn new(engine: Engine) -> Self {
        Audit { engine }
    }

    /// See [`month`].
    pub async fn month(self, pool: &Db, month: (NaiveDate, NaiveDate)) -> Result<MonthAudit, sqlx::Error> {
        let (fines, ledger) = match self.engine {
            Engine::Postgresql => (fines(pool, month).await?, ledger(pool, month).await?),
            Engine::Citus => (
                citus::audit::fines(pool, month).await?,
                citus::audit::ledger(pool, month).await?,
            ),
        };
        audit(pool, month.1, fines, ledger).await
    }
}

/// The audit of the month ending `last` from its fines and its reconciliation with the ledger: the shard counts
/// that settled it completely and the loans of any month no job touches are read here (the same statements on
/// either engine: the first reads only the coordinator's `job_runs`).
async fn audit(
    pool: &Db,
    last: NaiveDate,
    fines: Fines,
    ledger: Reconciled,
) -> Result<MonthAudit, sqlx::Error> {
    let complete = sqlx::query_scalar!(
        r#"select shards as "shards!" from job_runs
           where job_name = 'fine-settlement' and business_date = $1
           group by shards
           having count(*) filter (where status = 'SUCCESS') = shards
           order by shards"#,
        last,
    )
    .fetch_all(pool)
    .await?;
    let (unsettled_not_finite, mut not_finite_ids) = unsettled_not_finite(pool).await?;
    // Disjoint sets (settled, not settled): their counts add up, and the first ids of both are the first ids.
    not_finite_ids.extend(&fines.settled_not_finite);
    not_finite_ids.sort_unstable();
    not_finite_ids.truncate(NOT_FINITE_SHOWN);
    Ok(MonthAudit {
        returned: fines.returned,
        settled: fines.settled,
        unsettled: fines.returned - fines.settled,
        wrong_fine: fines.wrong_fine,
        total_cents: fines.total_cents,
        expected_cents: fines.expected_cents,
        complete_shard_counts: complete,
        ledger_checked: ledger.checked,
        ledger_mismatches: ledger.mismatches,
        over_accrued: ledger.over_accrued,
        not_finite: unsettled_not_finite + fines.settled_not_finite.len() as i64,
        not_finite_ids,
        without_policy: fines.without_policy,
        loans_without_class_policy: fines.unknown_class,
        classes_without_policy: fines.unknown_classes,
    })
}

/// The month's fines against the policy's, as [`MonthAudit`] reports them.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct Fines {
    pub(crate) returned: i64,
    pub(crate) settled: i64,
    pub(crate) wrong_fine: i64,
    pub(crate) total_cents: i64,
    pub(crate) expected_cents: i64,
    /// The month's settled loans whose due date is not finite (settled before the rule, or their due date
    /// changed since): their fine cannot be checked.
    pub(crate) settled_not_finite: Vec<i64>,
    pub(crate) without_policy: i64,
    pub(crate) unknown_class: i64,
    pub(crate) unknown_classes: Vec<String>,
}

/// The loans returned in the month with a finite due date; those without one are counted apart (no fine can be
/// computed for them: `returned_on - due_on` would fail the statement), the settled ones listed here, in the same
/// pass over the month, and the others by [`unsettled_not_finite`].
async fn fines(pool: &Db, (first, last): (NaiveDate, NaiveDate)) -> Result<Fines, sqlx::Error> {
    let row = sqlx::query!(
        r#"with l as (
               select l.id, l.fine_cents, l.fine_settled_at, isfinite(l.due_on) as finite,
                      case when isfinite(l.due_on) then f.fine_cents end as expected,
                      l.fine_class is not null and p.fine_class is distinct from l.fine_class as unknown_class,
                      l.fine_class
               from loans l
               -- The version and the fine written out again, apart from the functions settlement calls: the
               -- version of the loan's class in force on its due date, else the default class's; the closed days
               -- counted one by one (an audit can afford a cost that grows with the span).
               left join lateral (
                   select v.fine_class, v.daily_rate_cents, v.grace_days, v.cap_cents, v.charge_closed_days
                   from fine_policies v
                   where v.effective_from <= l.due_on and (v.fine_class = l.fine_class or v.fine_class = 'default')
                   order by (v.fine_class = l.fine_class) desc nulls last, v.effective_from desc
                   limit 1) p on true
               left join lateral (
                   select case
                       when not (isfinite(l.due_on) and isfinite(l.returned_on)) then null
                       when l.returned_on - l.due_on <= p.grace_days then 0::bigint
                       else least(nullif(p.cap_cents, 0),
                                  p.daily_rate_cents
                                  * ((l.returned_on - l.due_on - p.grace_days)::bigint
                                     - case when p.charge_closed_days then 0
                                            else (select count(*) from library_closed_days c
                                                  where c.day > l.due_on + p.grace_days and c.day <= l.returned_on)
                                       end))
                   end as fine_cents) f on true
               where l.returned_on between $1 and $2
           )
           select count(*) filter (where finite) as "returned!",
                  count(fine_settled_at) filter (where finite) as "settled!",
                  count(*) filter (where fine_settled_at is not null and fine_cents is distinct from expected)
                      as "wrong_fine!",
                  coalesce(sum(fine_cents) filter (where fine_settled_at is not null and finite), 0)::bigint
                      as "total_cents!",
                  coalesce(sum(expected), 0)::bigint as "expected_cents!",
                  coalesce(array_agg(id order by id) filter (where fine_settled_at is not null and not finite),
                           '{}') as "settled_not_finite!",
                  count(*) filter (where finite and expected is null) as "without_policy!",
                  count(*) filter (where unknown_class) as "unknown_class!",
                  coalesce((array_agg(distinct fine_class) filter (where unknown_class))[1:$3], '{}')
                      as "unknown_classes!"
           from l"#,
        first,
        last,
        UNKNOWN_CLASSES_SHOWN as i32,
    )
    .fetch_one(pool)
    .await?;
    Ok(Fines {
        returned: row.returned,
        settled: row.settled,
        wrong_fine: row.wrong_fine,
        total_cents: row.total_cents,
        expected_cents: row.expected_cents,
        settled_not_finite: row.settled_not_finite,
        without_policy: row.without_policy,
        unknown_class: row.unknown_class,
        unknown_classes: row.unknown_classes,
    })
}

/// The month's loans reconciled with the ledger, as [`MonthAudit`] reports them.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct Reconciled {
    pub(crate) checked: i64,
    pub(crate) mismatches: i64,
    pub(crate) over_accrued: i64,
}

/// Reconciliation with the ledger as finance reads it (`fine_ledger_net`: first charges plus corrections). A day
/// whose net exceeds its canonical amount (a day not owed at all, or owed less) is over-accrued. A settled loan
/// whose every owed day was accrued (an accrual key of the day SUCCESS for the loan's shard, under some shard
/// count) must have a net total equal to its fine. Loans with a non-finite due date are left out (see
/// [`fines`]).
async fn ledger(pool: &Db, (first, last): (NaiveDate, NaiveDate)) -> Result<Reconciled, sqlx::Error> {
    let row = sqlx::query!(
        r#"with r as (
               select l.id, l.fine_cents, l.fine_settled_at, l.due_on, l.returned_on, p.grace_days,
                      coalesce((select sum(n.net_cents) from fine_ledger_net n where n.loan_id = l.id), 0)::bigint
                          as net,
                      (select count(*) from fine_ledger_net n
                       cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, n.accrual_date,
                                                                         p.daily_rate_cents, p.grace_days,
                                                                         p.cap_cents, p.charge_closed_days) a
                       where n.loan_id = l.id and n.net_cents > a.amount_cents) as over
               from loans l
               cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
               where l.returned_on between $1 and $2 and isfinite(l.due_on)
           ), covered as (
               select r.* from r
               where r.fine_settled_at is not null and r.returned_on - r.due_on > r.grace_days
                 and not exists (
                     -- The owed days, newest first, as offsets back from the return (no date arithmetic that
                     -- could leave the date range on extreme loans).
                     select 1 from generate_series(0, r.returned_on - r.due_on - r.grace_days - 1) k
                     where not exists (select 1 from job_runs j
                                       where j.job_name = 'overdue-accrual' and j.business_date = r.returned_on - k
                                         and j.status = 'SUCCESS'
                                         and j.shard = fine_settler_shard_of(r.id, j.shards)))
           )
           select (select count(*) from covered) as "checked!",
                  (select count(*) from covered where net <> fine_cents) as "mismatches!",
                  (select count(*) from r where over > 0) as "over_accrued!""#,
        first,
        last,
    )
    .fetch_one(pool)
    .await?;
    Ok(Reconciled {
        checked: row.checked,
        mismatches: row.mismatches,
        over_accrued: row.over_accrued,
    })
}

/// Loans not settled with a due or return date that is not finite (`infinity`, `-infinity`), which neither job
/// touches, whatever their month (such a date is in no month): returned or still out; how many, and the first
/// [`NOT_FINITE_SHOWN`] ids.
///
/// The returned branch is the predicate of `loans_unsettled_returned_idx` (which includes the due date), so it
/// reads no settled loan; the open branch scans `loans` (no index of fine-settler's serves the open loans: one
/// that did cost every checkout of libraryd's an entry). `d in ('-infinity', 'infinity')` is `not isfinite(d)`,
/// in a form an index can search.
async fn unsettled_not_finite(pool: &Db) -> Result<(i64, Vec<i64>), sqlx::Error> {
    let row = sqlx::query!(
        r#"select count(*) as "count!", coalesce((array_agg(id order by id))[1:$1], '{}') as "ids!"
           from (select id from loans
                 where fine_settled_at is null and returned_on is not null
                   and (due_on in ('-infinity', 'infinity') or returned_on in ('-infinity', 'infinity'))
                 union all
                 select id from loans
                 where returned_on is null and due_on in ('-infinity', 'infinity')) bad"#,
        NOT_FINITE_SHOWN as i32,
    )
    .fetch_one(pool)
    .await?;
    Ok((row.count, row.ids))
}

impl MonthAudit {
    /// Human-readable findings that are not violations: a class with no policy is priced by `default`, as the
    /// rules say, but is most likely a misspelling in libraryd.
    pub fn notes(&self) -> Vec<String> {
        let mut n = Vec::new();
        if self.loans_without_class_policy > 0 {
            let more = if self.classes_without_policy.len() >= UNKNOWN_CLASSES_SHOWN {
                ", …"
            } else {
                ""
            };
            n.push(format!(
                "{} loans returned in the month have a fine_class with no policy for their due date, so the \
                 `default` policy priced them: {}{more}",
                self.loans_without_class_policy,
                self.classes_without_policy.join(", ")
            ));
        }
        n
    }

    /// Human-readable violations; empty when the month is correct.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.unsettled > 0 {
            v.push(format!(
                "{} loans returned in the month are not settled",
                self.unsettled
            ));
        }
        if self.wrong_fine > 0 {
            v.push(format!(
                "{} settled loans carry a fine other than the policy's",
                self.wrong_fine
            ));
        }
        if self.ledger_mismatches > 0 {
            v.push(format!(
                "{} fully accrued loans have a ledger total other than their settled fine",
                self.ledger_mismatches
            ));
        }
        if self.over_accrued > 0 {
            v.push(format!(
                "{} loans are over-accrued: the ledger charges them for days on which they were not overdue",
                self.over_accrued
            ));
        }
        if self.not_finite > 0 {
            let ids: Vec<String> = self.not_finite_ids.iter().map(i64::to_string).collect();
            let more = if self.not_finite > self.not_finite_ids.len() as i64 {
                ", …"
            } else {
                ""
            };
            v.push(format!(
                "{} loans have a due or return date that is not finite, so neither job settles or accrues them \
                 (fix the dates in libraryd): loans {}{more}",
                self.not_finite,
                ids.join(", ")
            ));
        }
        if self.without_policy > 0 {
            v.push(format!(
                "{} loans returned in the month have no fine policy at all (fine_policies has no `default` \
                 version for their due date: the table was edited with its triggers off); add the `default` \
                 class's version from 4714-11-24 BC as a superuser (docs/operations.md)",
                self.without_policy
            ));
        }
        if self.returned > 0 && self.complete_shard_counts.is_empty() {
            v.push("no shard count has a SUCCESS settlement run for every shard".to_string());
        }
        v
    }
}
