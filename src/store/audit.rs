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
    /// Settled loans returned late whose every owed day was accrued (its accrual key SUCCESS for the loan's
    /// shard): the ones the ledger can be reconciled with.
    pub ledger_checked: i64,
    /// Of those, loans whose net ledger total (`fine_ledger_net`) differs from `fine_cents`.
    pub ledger_mismatches: i64,
    /// Loans returned in the month with a day whose net exceeds what is owed for it (a return back-dated after
    /// the day was charged, a due date moved later, not yet corrected).
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

    // Reconciliation with the ledger as finance reads it (fine_ledger_net: first charges plus corrections). A
    // day whose net exceeds its canonical amount (a day not owed at all, or owed less) is over-accrued. A settled
    // loan whose every owed day was accrued (an accrual key of the day SUCCESS for the loan's shard, under some
    // shard count) must have a net total equal to its fine.
    let ledger = sqlx::query!(
        r#"with r as (
               select l.id, l.fine_cents, l.fine_settled_at, l.due_on, l.returned_on,
                      coalesce((select sum(n.net_cents) from fine_ledger_net n where n.loan_id = l.id), 0)::bigint
                          as net,
                      (select count(*) from fine_ledger_net n
                       where n.loan_id = l.id
                         and n.net_cents > fine_settler_day_amount(l.due_on, l.returned_on, n.accrual_date,
                                                                   $5, $4, $3)) as over
               from loans l
               where l.returned_on between $1 and $2 and isfinite(l.due_on)
           ), covered as (
               select r.* from r
               where r.fine_settled_at is not null and r.returned_on - r.due_on > $4::int
                 and not exists (
                     -- The owed days, newest first, as offsets back from the return (no date arithmetic that
                     -- could leave the date range on extreme loans).
                     select 1 from generate_series(0, r.returned_on - r.due_on - $4::int - 1) k
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
        policy.cap().map_or(0, |c| c.get()),
        i32::try_from(policy.grace_days()).unwrap_or(i32::MAX),
        policy.daily_rate().get(),
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
