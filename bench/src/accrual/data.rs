//! The accrual section's data: loans generated set-based in SQL around the accrual day, and the ledger a replica
//! that had accrued every earlier day would hold, in a database migrated by the binary under test (the current
//! one, or the one before). Everything is a function of the loan's id (`hashint8`), so the two schemas get the
//! same loans and the same ledger.
//!
//! The ledger's amounts are written out here (`day_amount_sql`), because the schema before canonical amounts has
//! no `fine_settler_day_amount`; on the current schema every generated amount is checked against that function,
//! so the generator and the product agree on what a day owes.

use std::{path::Path, process::Command, time::Instant};

use chrono::NaiveDate;

use super::{Schema, WINDOW_DAYS};
use crate::{Bench, Error};

/// The fine policy of every accrual measurement: 100 cents a day, no grace, a cap of 1,550 cents — fifteen days
/// in full, a sixteenth charged the 50 cents left, nothing after — so that the data has loans past the cap and a
/// day that is charged a remainder. Passed to every process as `FINE_SETTLER__FINE__…`.
pub(crate) const RATE: i64 = 100;
pub(crate) const GRACE: i32 = 0;
pub(crate) const CAP: i64 = 1550;
/// The owed day (counted from 1) that reaches the cap; from the next one on a loan owes nothing.
const CAP_DAY: i64 = (CAP + RATE - 1) / RATE;

/// The policy as environment overrides of a `fine-settler` process.
pub(crate) fn policy_env() -> [(&'static str, String); 3] {
    [
        ("FINE_SETTLER__FINE__DAILY_RATE_CENTS", RATE.to_string()),
        ("FINE_SETTLER__FINE__GRACE_DAYS", GRACE.to_string()),
        ("FINE_SETTLER__FINE__CAP_CENTS", CAP.to_string()),
    ]
}

/// Which loans a database holds, and which of their ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Population {
    /// A library around the accrual day: 60 % out and overdue by 1 to 24 days (a third of them past the day
    /// that reaches the cap), 15 % overdue and returned on the day or the day after, 10 % not yet due, 15 %
    /// returned before the day (on time, or late); with every loan's whole ledger before the day, as a replica
    /// that accrued each day in turn leaves it. Half the loans owe a charge on the day.
    Mixed,
    /// Only open loans, overdue by 1 to 16 days or (a fifth) by 17 to 40, past the cap; with the ledger of the
    /// accrual window (the week that ends on the day), and each day of the window recorded as accrued.
    OpenOverdue,
}

/// What a database was generated with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Generated {
    pub loans: i64,
    pub ledger_rows: i64,
    pub seconds: f64,
}

/// The canonical amount of `day` for a loan due `due` and returned `ret` under a policy of `rate`, `grace` and
/// `cap` (each an SQL expression), written out: `fine_settler_day_amount` (migrations/20261202000012) for a
/// policy with a cap.
pub(crate) fn day_amount_sql(due: &str, ret: &str, day: &str, [rate, grace, cap]: [&str; 3]) -> String {
    format!(
        "case when ({day} - {due})::bigint <= {grace} or {day} > coalesce({ret}, {day}) then 0::bigint
              else greatest(0::bigint, least({rate}, {cap} - {rate} * (({day} - {due})::bigint - {grace} - 1)))
         end"
    )
}

/// The section's policy as SQL literals, for [`day_amount_sql`].
fn policy_sql() -> [String; 3] {
    [
        format!("{RATE}::bigint"),
        format!("{GRACE}::int"),
        format!("{CAP}::bigint"),
    ]
}

/// The statement that inserts loans `1..=$1` around day `$2`.
fn loans_sql(population: Population) -> String {
    // Three independent draws per loan, each in 0 .. 2^32.
    let draws = "select id, (hashint8(id)::bigint + 2147483648) % 100 as cat,
                        hashint8(id + 1000000007)::bigint + 2147483648 as h2,
                        hashint8(id + 2000000014)::bigint + 2147483648 as h3
                 from generate_series(1, $1::bigint) id";
    let dates = match population {
        Population::Mixed => "select case when cat < 75 then $2::date - (1 + h2 % 24)::int
                         when cat < 85 then $2::date + (h2 % 14)::int
                         else $2::date - (2 + h2 % 24)::int end as due_on) d0
             cross join lateral (
             select d0.due_on,
                    case when cat < 60 then null
                         when cat < 75 then $2::date + (h3 % 2)::int
                         when cat < 85 then null
                         when cat < 93 then d0.due_on - (h3 % 5)::int
                         else d0.due_on + 1 + (h3 % ($2::date - d0.due_on - 1))::int end as returned_on"
            .to_string(),
        Population::OpenOverdue => format!(
            "select case when cat < 20 then $2::date - ({} + h2 % 24)::int
                         else $2::date - (1 + h2 % {CAP_DAY})::int end as due_on) d0
             cross join lateral (select d0.due_on, null::date as returned_on",
            CAP_DAY + 1
        ),
    };
    format!(
        "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         select g.id, 1 + g.h2 % 5000, 1 + g.h3 % 20000, d.due_on - 14, d.due_on, d.returned_on
         from ({draws}) g
         cross join lateral ({dates}) d"
    )
}

/// The statement that inserts the ledger of every loan for its owed days in `$1 ..= $2`, at their canonical
/// amounts (days that owe nothing have no row), in the order of the primary key.
fn ledger_sql() -> String {
    format!(
        "insert into fine_ledger (loan_id, accrual_date, amount_cents)
         select l.id, d.day, a.amount
         from loans l
         cross join lateral (
             select g::date as day
             from generate_series(greatest(l.due_on + 1 + {GRACE}, $1::date),
                                  least($2::date, coalesce(l.returned_on, $2::date)), interval '1 day') g) d
         cross join lateral (select {} as amount) a
         where a.amount > 0",
        day_amount_sql(
            "l.due_on",
            "l.returned_on",
            "d.day",
            policy_sql().each_ref().map(String::as_str)
        )
    )
}

/// The days `population`'s ledger covers, for accrual day `day`.
fn ledger_days(population: Population, day: NaiveDate) -> (NaiveDate, NaiveDate) {
    match population {
        // Whole histories: nothing is owed earlier than 25 days before the day.
        Population::Mixed => (day - chrono::Duration::days(400), day - chrono::Duration::days(1)),
        Population::OpenOverdue => (day - chrono::Duration::days(WINDOW_DAYS - 1), day),
    }
}

impl Bench {
    /// Database `name`: migrated by `binary`, then `n` loans of `population` around accrual `day` and their
    /// ledger, vacuumed and analysed. The loans are inserted with the triggers on `loans` off, as a library
    /// whose queued changes the re-check has already read: nothing is queued in `fine_loan_changes`.
    pub(crate) async fn accrual_db(
        &self,
        name: &str,
        binary: &Path,
        schema: Schema,
        population: Population,
        n: u64,
        day: NaiveDate,
    ) -> Result<Generated, Error> {
        let started = Instant::now();
        self.drop_db(name).await?;
        self.exec(&format!("create database {name}")).await?;
        migrate(binary, &format!("{}/{name}", self.server))?;
        let pool = self.pool(name, 1).await?;
        let (first, last) = ledger_days(population, day);
        let mut tx = pool.begin().await?;
        sqlx::raw_sql("alter table loans disable trigger user")
            .execute(&mut *tx)
            .await?;
        let loans = sqlx::query(&loans_sql(population))
            .bind(i64::try_from(n)?)
            .bind(day)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        let ledger_rows = sqlx::query(&ledger_sql())
            .bind(first)
            .bind(last)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        sqlx::raw_sql("alter table loans enable trigger user")
            .execute(&mut *tx)
            .await?;
        if population == Population::OpenOverdue {
            record_window_accrued(&mut tx, day).await?;
        }
        tx.commit().await?;
        // One statement each: several in one simple query would run in one transaction, where vacuum cannot.
        for table in ["loans", "fine_ledger"] {
            sqlx::raw_sql(&format!("vacuum analyze {table}"))
                .execute(&pool)
                .await?;
        }
        if schema == Schema::Current {
            check_canonical(&pool).await?;
        }
        pool.close().await;
        Ok(Generated {
            loans: i64::try_from(loans)?,
            ledger_rows: i64::try_from(ledger_rows)?,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// `binary migrate` on `url`.
fn migrate(binary: &Path, url: &str) -> Result<(), Error> {
    let status = Command::new(binary)
        .arg("migrate")
        .env("DATABASE_URL", url)
        .env("FINE_SETTLER__LOG__LEVEL", "warn")
        // The policy's keys seed the database's first policy, which the replicas' keys must then equal.
        .envs(policy_env())
        .stdout(std::process::Stdio::null())
        .status()?;
    if !status.success() {
        return Err(format!("{} migrate failed", binary.display()).into());
    }
    Ok(())
}

/// Records the accrual window's days as accrued (SUCCESS, shard 0 of 1), as the replica that wrote the
/// generated ledger would have left them: a replica started on the database then has nothing due.
async fn record_window_accrued(tx: &mut sqlx::PgConnection, day: NaiveDate) -> Result<(), Error> {
    sqlx::query(
        "insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch, lease_until,
                               finished_at)
         select 'overdue-accrual', g::date, 1, 0, 'SUCCESS', 'fine-settler-bench', 1, now(), now()
         from generate_series($1::date, $2::date, interval '1 day') g",
    )
    .bind(day - chrono::Duration::days(WINDOW_DAYS - 1))
    .bind(day)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Fails unless every generated ledger amount is `fine_settler_day_amount`'s and nothing is queued.
async fn check_canonical(pool: &sqlx::PgPool) -> Result<(), Error> {
    let (off, queued): (i64, i64) = sqlx::query_as(
        "select (select count(*) from fine_ledger f join loans l on l.id = f.loan_id
                 where f.amount_cents <> fine_settler_day_amount(l.due_on, l.returned_on, f.accrual_date,
                                                                 $1, $2, $3)),
                (select count(*) from fine_loan_changes)",
    )
    .bind(RATE)
    .bind(GRACE)
    .bind(CAP)
    .fetch_one(pool)
    .await?;
    if off != 0 || queued != 0 {
        return Err(format!(
            "generated ledger: {off} amounts differ from fine_settler_day_amount, {queued} changes queued"
        )
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The written-out amount takes the policy's values where the function takes its parameters.
    #[test]
    fn the_written_out_amount_names_the_policy() {
        let sql = day_amount_sql(
            "l.due_on",
            "l.returned_on",
            "d.day",
            policy_sql().each_ref().map(String::as_str),
        );
        assert!(sql.contains(
            "least(100::bigint, 1550::bigint - 100::bigint * ((d.day - l.due_on)::bigint - 0::int - 1))"
        ));
        assert!(sql.contains("d.day > coalesce(l.returned_on, d.day)"));
        assert_eq!(CAP_DAY, 16);
    }
}
