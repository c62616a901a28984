//! The audit behind `verify`: recomputes a settled month in plain SQL, independently of the settlement code.

use crate::store::Db;
use chrono::NaiveDate;

use crate::fine::FinePolicy;

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
    /// Settled loans whose every overdue day is in the ledger (or whose ledger reached the cap): the ones the
    /// ledger can be reconciled with.
    pub ledger_checked: i64,
    /// Of those, loans whose ledger total differs from `fine_cents`.
    pub ledger_mismatches: i64,
    /// Loans returned in the month with ledger rows for days on which they were not overdue (a return
    /// back-dated after the day was charged, a due date moved later): charged for days nothing was owed.
    pub over_accrued: i64,
}

/// Audits the loans returned in `[first, last]` against `policy`. The expected fine is computed by the database
/// (`least` ignores a null cap), a second implementation of the policy that the Rust code does not share.
pub async fn month(
    pool: &Db,
    (first, last): (NaiveDate, NaiveDate),
    policy: &FinePolicy,
) -> Result<MonthAudit, sqlx::Error> {
    let row = sqlx::query!(
        r#"with l as (
               select fine_cents, fine_settled_at,
                      least(nullif($3::bigint, 0),
                            greatest(0, returned_on - due_on - $4::bigint) * $5::bigint) as expected
               from loans
               where returned_on between $1 and $2
           )
           select count(*) as "returned!",
                  count(fine_settled_at) as "settled!",
                  count(*) filter (where fine_settled_at is not null and fine_cents <> expected) as "wrong_fine!",
                  coalesce(sum(fine_cents) filter (where fine_settled_at is not null), 0)::bigint as "total_cents!",
                  coalesce(sum(expected), 0)::bigint as "expected_cents!"
           from l"#,
        first,
        last,
        policy.cap().map_or(0, |c| c.get()),
        policy.grace_days(),
        policy.daily_rate().get(),
    )
    .fetch_one(pool)
    .await?;

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

    // Reconciliation: a returned loan's overdue days are due_on + grace < D <= returned_on. A ledger row outside
    // those days is over-accrued (reported on its own); when the ledger has a row for each of them (or has
    // reached the cap), its total must equal the settled fine.
    let ledger = sqlx::query!(
        r#"with r as (
               select l.id, l.fine_cents, l.fine_settled_at,
                      greatest(0, l.returned_on - l.due_on - $4::int) as days,
                      coalesce(sum(f.amount_cents), 0)::bigint as total,
                      count(f.loan_id) filter (where f.accrual_date - $4::int > l.due_on
                                                 and f.accrual_date <= l.returned_on) as rows,
                      count(f.loan_id) filter (where f.accrual_date - $4::int <= l.due_on
                                                  or f.accrual_date > l.returned_on) as outside
               from loans l
               left join fine_ledger f on f.loan_id = l.id
               where l.returned_on between $1 and $2
               group by l.id, l.fine_cents, l.fine_settled_at, l.returned_on, l.due_on
           ), full_ledger as (
               select * from r
               where fine_settled_at is not null and outside = 0
                 and ((rows > 0 and rows = days) or ($3::bigint > 0 and rows > 0 and total >= $3))
           )
           select (select count(*) from full_ledger) as "checked!",
                  (select count(*) from full_ledger where total <> fine_cents) as "mismatches!",
                  (select count(*) from r where outside > 0) as "over_accrued!""#,
        first,
        last,
        policy.cap().map_or(0, |c| c.get()),
        i32::try_from(policy.grace_days()).unwrap_or(i32::MAX),
    )
    .fetch_one(pool)
    .await?;

    Ok(MonthAudit {
        returned: row.returned,
        settled: row.settled,
        unsettled: row.returned - row.settled,
        wrong_fine: row.wrong_fine,
        total_cents: row.total_cents,
        expected_cents: row.expected_cents,
        complete_shard_counts: complete,
        ledger_checked: ledger.checked,
        ledger_mismatches: ledger.mismatches,
        over_accrued: ledger.over_accrued,
    })
}

impl MonthAudit {
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
        if self.returned > 0 && self.complete_shard_counts.is_empty() {
            v.push("no shard count has a SUCCESS settlement run for every shard".to_string());
        }
        v
    }
}
