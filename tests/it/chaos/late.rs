//! libraryd's live writes while the replicas run, into months and days whose keys already succeeded: new loans
//! returned inside a settled month, open loans whose return is recorded late and back-dated into one, loans
//! entered late that are overdue inside the accrual window. Every loan written is listed in the table
//! `late_loans`, for the wait at the end and the oracle.

use chrono::{Datelike, NaiveDate};
use fine_settler::demo::SplitMix64;
use sqlx::{PgConnection, PgPool};

use super::World;

/// The late rows written so far, by kind. The daemon must re-open the keys they fall into.
#[derive(Debug, Default)]
pub struct LateRows {
    /// New loans returned inside a settled due month.
    pub returned: u64,
    /// Open loans never overdue in the window updated to returned, the return back-dated into a settled due month.
    pub back_dated: u64,
    /// New unreturned loans, overdue inside the accrual window.
    pub overdue: u64,
    /// Ids handed out so far.
    issued: i64,
}

/// New late loans take their ids from the gap below the month blocks (below every settlement cursor) or from
/// above them.
const LATE_IDS_BELOW: i64 = 500_000;
const LATE_IDS_ABOVE: i64 = 9_000_000;

impl LateRows {
    /// A fresh id from `base`'s range that belongs to shard `shard` of `shards`.
    fn id(&mut self, base: i64, shard: i32, shards: i32) -> i64 {
        self.issued += 1;
        let id = base + 12 * self.issued;
        id + (i64::from(shard) - id).rem_euclid(i64::from(shards))
    }

    pub fn total(&self) -> u64 {
        self.returned + self.back_dated + self.overdue
    }

    /// One round of late rows aimed at keys of the `shards` count that are SUCCESS, in one libraryd transaction:
    /// four loans returned inside settled months, two loans overdue since before a day whose accrual succeeded,
    /// and a back-dated return of an open loan into the last due month. Writes nothing and returns false
    /// while no settlement key of that count has succeeded yet.
    pub async fn inject(&mut self, pool: &PgPool, rng: &mut SplitMix64, shards: i32, world: &World) -> bool {
        let window_start = world.days[0];
        let settled = success_keys(pool, "fine-settlement", shards).await;
        if settled.is_empty() {
            return false;
        }
        let charged = success_keys(pool, "overdue-accrual", shards).await;
        let in_window: Vec<_> = settled
            .iter()
            .copied()
            .filter(|(m, _)| *m >= window_start)
            .collect();
        let mut tx = pool.begin().await.expect("begin late rows");
        for i in 0..4 {
            // The first one, when a settled month reaches into the accrual window, is returned inside the window and
            // overdue there: besides its fine it owes those days' charges.
            let inside = i == 0 && !in_window.is_empty();
            let (month_end, shard) = pick(rng, if inside { &in_window } else { &settled });
            let base = if i % 2 == 0 {
                LATE_IDS_BELOW
            } else {
                LATE_IDS_ABOVE
            };
            let id = self.id(base, shard, shards);
            let (returned, due) = late_return(rng, month_end, inside.then_some(window_start));
            new_late_loan(&mut tx, id, due - days(21), due, Some(returned), "returned").await;
            self.returned += 1;
        }
        for _ in 0..2 {
            let (day, shard) = if charged.is_empty() {
                (window_start, rng.below(shards as u64) as i32)
            } else {
                pick(rng, &charged)
            };
            let due = day - days(1 + rng.below(5));
            let id = self.id(LATE_IDS_ABOVE, shard, shards);
            new_late_loan(&mut tx, id, due - days(14), due, None, "overdue").await;
            self.overdue += 1;
        }
        self.back_dated +=
            back_date_returns(&mut tx, rng, world.current, world.last_month, &world.poisoned).await;
        tx.commit().await.expect("commit late rows");
        true
    }
}

/// The (business date, shard) of every SUCCESS key of `job` under the shard count `shards`.
async fn success_keys(pool: &PgPool, job: &str, shards: i32) -> Vec<(NaiveDate, i32)> {
    sqlx::query_as(
        "select business_date, shard from job_runs
         where job_name = $1 and shards = $2 and status = 'SUCCESS' order by 1, 2",
    )
    .bind(job)
    .bind(shards)
    .fetch_all(pool)
    .await
    .unwrap_or_default()
}

fn pick<T: Copy>(rng: &mut SplitMix64, from: &[T]) -> T {
    from[rng.below(from.len() as u64) as usize]
}

fn days(n: u64) -> chrono::Duration {
    chrono::Duration::days(n as i64)
}

/// A return day in the month ending `month_end`, and a due date: returned on time, late under the cap or late
/// past it — or, given the accrual window's first day, returned inside the window, one to six days late.
fn late_return(
    rng: &mut SplitMix64,
    month_end: NaiveDate,
    window_start: Option<NaiveDate>,
) -> (NaiveDate, NaiveDate) {
    let month_start = month_end.with_day(1).expect("first of the month");
    match window_start {
        Some(first) => {
            let from = month_start.max(first);
            let returned = from + days(rng.below((month_end - from).num_days() as u64 + 1));
            (returned, returned - days(1 + rng.below(6)))
        }
        None => {
            let returned = month_start + days(rng.below(u64::from(month_end.day())));
            (returned, returned + days(3) - days(rng.below(12)))
        }
    }
}

/// Inserts a loan as libraryd would, remembering it in `late_loans` (and in `loans_before`, so that the oracle
/// also checks that an unreturned one was left alone).
async fn new_late_loan(
    tx: &mut PgConnection,
    id: i64,
    borrowed: NaiveDate,
    due: NaiveDate,
    returned: Option<NaiveDate>,
    kind: &str,
) {
    sqlx::query(
        "with l as (insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
                    values ($1, 1, 1, $2, $3, $4) returning id, fine_cents),
              b as (insert into loans_before select id, fine_cents from l)
         insert into late_loans select id, $5 from l",
    )
    .bind(id)
    .bind(borrowed)
    .bind(due)
    .bind(returned)
    .bind(kind)
    .execute(&mut *tx)
    .await
    .expect("insert a late loan");
}

/// Records the return of an open loan never overdue inside the window, back-dated into `last_month`, the last
/// settled month (`yesterday` ends the accrual window), between its borrowing and its due date (fine 0): the
/// settlement key must re-open for it. (Returns back-dated to a day already charged are among the changes of
/// [`super::edits`].) A loan libraryd changed after it was settled is left alone. Returns how many: 0 or 1.
async fn back_date_returns(
    tx: &mut PgConnection,
    rng: &mut SplitMix64,
    yesterday: NaiveDate,
    last_month: NaiveDate,
    poisoned: &[i64],
) -> u64 {
    let salt = rng.next_u64().to_string();
    let never_overdue: Option<(i64, NaiveDate, NaiveDate)> = sqlx::query_as(
        "select id, borrowed_on, least(due_on, $2) from loans
         where returned_on is null and fine_settled_at is null and due_on >= $1 and borrowed_on <= $2
           and id <> all($3) and id not in (select id from late_loans)
         order by md5(id::text || $4) limit 1",
    )
    .bind(yesterday)
    .bind(last_month)
    .bind(poisoned)
    .bind(&salt)
    .fetch_optional(&mut *tx)
    .await
    .expect("an open loan never overdue in the window");
    let Some((id, from, to)) = never_overdue else {
        return 0;
    };
    let returned = from + days(rng.below((to - from).num_days() as u64 + 1));
    sqlx::query(
        "with u as (update loans set returned_on = $2 where id = $1 and returned_on is null returning id)
         insert into late_loans select id, 'back-dated' from u",
    )
    .bind(id)
    .bind(returned)
    .execute(&mut *tx)
    .await
    .expect("back-date a return");
    // The audit counts fine-settler's updates of a loan; this one is libraryd's.
    sqlx::query("update loan_updates set n = n - 1 where loan_id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await
        .expect("audit");
    1
}
