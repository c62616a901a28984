//! libraryd's changes to loans already charged, while the replicas run: a return recorded late and back-dated to a
//! day already charged, a due date moved later, a due date moved earlier, a return removed. Each changes what the
//! loan owes on days of the accrual window that were charged already; the daemon's re-check must find the loan
//! and the runs of those days must append the corrections, by themselves. Every change is logged in the table
//! `loan_edits`, with the loan's settlement as the change found it (read under the row's lock), for the wait at
//! the end and the oracle: a settled loan stays settled as it was, whatever libraryd changes afterwards.

use std::collections::BTreeMap;

use chrono::NaiveDate;
use fine_settler::demo::SplitMix64;
use sqlx::{PgConnection, PgPool};

use super::{World, CAP, RATE};

/// How many days after its due date an open loan owes something: the rate each until the cap is reached.
const OWED_WHILE_OPEN: i64 = (CAP + RATE - 1) / RATE;

/// A kind of change to a loan's dates after some of its days were charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Edit {
    /// An open loan's return recorded late, back-dated to a day already charged that has a charged day after it:
    /// the days after the return are no longer owed (corrections `returned`).
    BackDatedReturn,
    /// A due date moved one to three days later, on a loan charged on the first day after its old due date: that
    /// day is no longer owed (`due-date-moved`), the day that reaches the cap moves later (`cap`, new charges).
    DueLater,
    /// A due date moved one to three days earlier: every day owes what the day one to three places later owed
    /// (`cap`: less, or nothing once the cap is reached sooner).
    DueEarlier,
    /// A return removed (set back to null) from a charged loan with days after the return that an open loan owes
    /// inside the window — one whose days were corrected away by a back-dated return first, when there is one
    /// (`reinstated`), else new charges.
    ReturnRemoved,
}

impl Edit {
    pub const ALL: [Edit; 4] = [
        Edit::BackDatedReturn,
        Edit::DueLater,
        Edit::DueEarlier,
        Edit::ReturnRemoved,
    ];

    /// The name in `loan_edits.kind` and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Edit::BackDatedReturn => "back-dated return",
            Edit::DueLater => "due date later",
            Edit::DueEarlier => "due date earlier",
            Edit::ReturnRemoved => "return removed",
        }
    }

    /// The query for a random candidate: `(id, due_on, returned_on, day)`, `day` being the charged day a return
    /// is back-dated to (the due date for the other kinds). Binds: $1 and $2 the window's first and last days,
    /// $3 the poisoned loans (never changed: their days must stay DEAD), $4 a salt for the random order.
    fn candidate(self) -> String {
        match self {
            Edit::BackDatedReturn => {
                "select l.id, l.due_on, l.returned_on, n.accrual_date
                 from fine_ledger_net n join loans l on l.id = n.loan_id
                 where l.returned_on is null and n.accrual_date between $1 and $2 and l.id <> all($3)
                   and exists (select 1 from fine_ledger_net m
                               where m.loan_id = n.loan_id and m.accrual_date > n.accrual_date)
                 order by md5(l.id::text || n.accrual_date::text || $4) limit 1"
                    .to_string()
            }
            Edit::DueLater => {
                "select l.id, l.due_on, l.returned_on, l.due_on
                 from fine_ledger_net n join loans l on l.id = n.loan_id
                 where n.accrual_date = l.due_on + 1 and n.accrual_date between $1 and $2 and l.id <> all($3)
                 order by md5(l.id::text || $4) limit 1"
                    .to_string()
            }
            Edit::DueEarlier => {
                "select l.id, l.due_on, l.returned_on, l.due_on
                 from fine_ledger_net n join loans l on l.id = n.loan_id
                 where n.accrual_date between $1 and $2 and l.id <> all($3)
                 order by md5(l.id::text || n.accrual_date::text || $4) limit 1"
                    .to_string()
            }
            // Charged, and with days it owes again: after its return, inside the window, and among the first
            // OWED_WHILE_OPEN days after its due date (an open loan owes nothing after those).
            Edit::ReturnRemoved => format!(
                "select l.id, l.due_on, l.returned_on, l.due_on
                 from loans l
                 where l.returned_on is not null and l.id <> all($3)
                   and exists (select 1 from fine_ledger f where f.loan_id = l.id)
                   and greatest(l.returned_on + 1, $1, l.due_on + 1) <= least($2, l.due_on + {OWED_WHILE_OPEN})
                 order by exists (select 1 from fine_ledger_corrections c
                                  where c.loan_id = l.id and c.reason = 'returned') desc,
                          md5(l.id::text || $4)
                 limit 1"
            ),
        }
    }

    /// The loan's new `(due_on, returned_on)`.
    fn apply(
        self,
        rng: &mut SplitMix64,
        due: NaiveDate,
        returned: Option<NaiveDate>,
        day: NaiveDate,
    ) -> (NaiveDate, Option<NaiveDate>) {
        let shift = chrono::Duration::days(1 + rng.below(3) as i64);
        match self {
            Edit::BackDatedReturn => (due, Some(day)),
            Edit::DueLater => (due + shift, returned),
            Edit::DueEarlier => (due - shift, returned),
            Edit::ReturnRemoved => (due, None),
        }
    }
}

/// The changes that landed so far, by kind.
#[derive(Debug, Default)]
pub struct Edits(BTreeMap<Edit, u64>);

impl Edits {
    /// One round: one change of each kind, in one libraryd transaction, each on a random loan that has one (none
    /// while nothing is charged yet). Returns how many landed.
    pub async fn inject(&mut self, pool: &PgPool, rng: &mut SplitMix64, world: &World) -> u64 {
        let salt = rng.next_u64().to_string();
        let (first, last) = (world.days[0], world.current);
        let mut tx = pool.begin().await.expect("begin loan edits");
        let mut landed = 0;
        for edit in Edit::ALL {
            let found: Option<(i64, NaiveDate, Option<NaiveDate>, NaiveDate)> =
                sqlx::query_as(&edit.candidate())
                    .bind(first)
                    .bind(last)
                    .bind(&world.poisoned)
                    .bind(&salt)
                    .fetch_optional(&mut *tx)
                    .await
                    .unwrap_or_else(|e| panic!("a loan to change ({}): {e}", edit.name()));
            let Some((id, due, returned, day)) = found else {
                continue;
            };
            let (new_due, new_returned) = edit.apply(rng, due, returned, day);
            if change(&mut tx, edit, id, (due, returned), (new_due, new_returned)).await {
                *self.0.entry(edit).or_default() += 1;
                landed += 1;
            }
        }
        tx.commit().await.expect("commit loan edits");
        landed
    }

    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// How many of each kind landed, by name.
    pub fn by_kind(&self) -> BTreeMap<&'static str, u64> {
        self.0.iter().map(|(e, n)| (e.name(), *n)).collect()
    }

    /// Every kind of change landed at least once.
    pub fn assert_all_landed(&self) {
        for edit in Edit::ALL {
            assert!(
                self.0.get(&edit).copied().unwrap_or(0) >= 1,
                "no {} landed: {:?}",
                edit.name(),
                self.by_kind()
            );
        }
    }
}

/// Sets loan `id`'s dates from `before` to `after` as libraryd would, logging the change in `loan_edits` with the
/// settlement the update found; false if the loan's dates were no longer `before`.
async fn change(
    tx: &mut PgConnection,
    edit: Edit,
    id: i64,
    before: (NaiveDate, Option<NaiveDate>),
    after: (NaiveDate, Option<NaiveDate>),
) -> bool {
    // The update waits for a settlement that holds the row and then reads the row it committed: the settlement
    // logged is the one the change came after.
    let logged: Option<i64> = sqlx::query_scalar(
        "with u as (update loans set due_on = $4, returned_on = $5
                    where id = $1 and due_on = $2 and returned_on is not distinct from $3
                    returning id, fine_settled_at, fine_cents)
         insert into loan_edits (loan_id, kind, due_before, returned_before, due_after, returned_after,
                                 settled_at, fine_cents)
         select id, $6, $2, $3, $4, $5, fine_settled_at, fine_cents from u
         returning loan_id",
    )
    .bind(id)
    .bind(before.0)
    .bind(before.1)
    .bind(after.0)
    .bind(after.1)
    .bind(edit.name())
    .fetch_optional(&mut *tx)
    .await
    .unwrap_or_else(|e| panic!("{} of loan {id}: {e}", edit.name()));
    if logged.is_none() {
        return false;
    }
    // The audit counts fine-settler's updates of a loan; this one is libraryd's.
    sqlx::query("update loan_updates set n = n - 1 where loan_id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await
        .expect("audit");
    true
}

/// The table `loan_edits`: every change, as [`change`] logged it.
pub async fn install(pool: &PgPool) {
    sqlx::raw_sql(
        "create table loan_edits (
             seq bigint generated always as identity primary key,
             loan_id bigint not null,
             kind text not null,
             due_before date not null,
             returned_before date,
             due_after date not null,
             returned_after date,
             settled_at timestamptz,
             fine_cents bigint not null,
             at timestamptz not null default now()
         );
         create index on loan_edits (loan_id);",
    )
    .execute(pool)
    .await
    .expect("loan_edits");
}
