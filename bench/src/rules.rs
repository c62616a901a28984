//! The fine rules' section: the month's settlement and an accrual day under the library's rules as data — two
//! item classes with two policy versions each (and two of `default`), about 60 closed days a year, one version
//! charging closed days — each against one set-based statement computing the same amounts with the same SQL
//! functions; the cost of a loan's chargeable days for a week-late loan and a book lost five years ago; and the
//! statements of an idle tick.

use std::time::Instant;

use sqlx::PgPool;

use crate::{binary, per_sec, Bench, Error, MONTH_END};

/// The accrual day measured: loans of the generated month still out or returned on or after it.
const DAY: &str = "2026-10-20";

/// The rules applied to a copy of the settlement template: classes on the loans (a third each of none, `laptop`
/// and `dvd`; written with triggers off, as a libraryd that recorded them at checkout), versions from 2026-10-10
/// (inside the month: loans due on both sides of it), Sundays and eight holidays a year from 2019 to 2027.
const RULES_SQL: &str = "
set session_replication_role = replica;
update loans set fine_class = case id % 3 when 0 then null when 1 then 'laptop' else 'dvd' end;
insert into fine_policies (fine_class, effective_from, daily_rate_cents, grace_days, cap_cents, charge_closed_days,
                           reason)
values ('default', '2026-10-10', 50, 1, 0, false, 'bench'),
       ('laptop', '4714-11-24 BC', 300, 0, 6000, false, 'bench'),
       ('laptop', '2026-10-10', 200, 2, 4000, true, 'bench'),
       ('dvd', '4714-11-24 BC', 100, 1, 1500, false, 'bench'),
       ('dvd', '2026-10-10', 150, 0, 0, false, 'bench');
reset session_replication_role;
insert into library_closed_days (day, reason)
select d::date, 'sunday' from generate_series('2019-01-06'::date, '2027-12-26', interval '7 days') d
union
select make_date(y, h.m, h.d), 'holiday'
from generate_series(2019, 2027) y, (values (1, 1), (2, 14), (5, 1), (10, 1), (10, 2), (10, 3), (12, 25), (12, 26)) h (m, d)
on conflict do nothing;
";

/// The accrual day's charges at once, priced as `accrue` prices them.
const DAY_SQL: &str = "insert into fine_ledger (loan_id, accrual_date, amount_cents)
     select l.id, $1, a.amount_cents
     from loans l
     cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
     cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents, p.grace_days,
                                                       p.cap_cents, p.charge_closed_days) a
     where l.due_on < $1::date and (l.returned_on is null or l.returned_on >= $1) and a.amount_cents > 0";

/// A week of the ledger before the accrual day: each loan's canonical amount for each of the seven days before
/// [`DAY`], priced as `accrue` prices them (so the ledger is what seven sequential runs leave, and no cap is
/// passed).
const WEEK_SQL: &str = "insert into fine_ledger (loan_id, accrual_date, amount_cents)
     select l.id, d.day, a.amount_cents
     from generate_series($1::date - 7, $1::date - 1, interval '1 day') g
     cross join lateral (select g::date as day) d
     cross join loans l
     cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
     cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, d.day, p.daily_rate_cents,
                                                       p.grace_days, p.cap_cents, p.charge_closed_days) a
     where l.due_on < d.day and (l.returned_on is null or l.returned_on >= d.day) and a.amount_cents > 0";

/// One way of one leg: rows written, milliseconds, and a checksum of what was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    rows: i64,
    ms: u64,
    checksum: i64,
}

/// What the section measured.
#[derive(Debug, Clone, Default)]
pub(crate) struct RulesLeg {
    loans: u64,
    closed_per_year: f64,
    settle: Vec<(Run, Run)>,
    accrue: Vec<(Run, Run)>,
    /// The day's statement cut into batches of the section's batch size (each its own transaction), and that size.
    batched: Vec<Run>,
    batch: u32,
    /// The accrual day on a ledger holding the week before it: (`accrue`, the guarded statement, the one
    /// `insert`) each round.
    capped: Vec<(Run, Run, Run)>,
    /// Charges in the week's ledger.
    week_rows: i64,
    /// (µs a loan for a week late, µs a loan for five years late), each over `span_loans`.
    span_us: (f64, f64),
    span_loans: i64,
    idle_statements: f64,
}

fn median(mut runs: Vec<Run>) -> Run {
    runs.sort_by_key(|r| r.ms);
    runs[(runs.len().max(1) - 1) / 2]
}

impl RulesLeg {
    fn medians(pairs: &[(Run, Run)]) -> (Run, Run) {
        (
            median(pairs.iter().map(|p| p.0).collect()),
            median(pairs.iter().map(|p| p.1).collect()),
        )
    }

    /// The section, in Markdown.
    pub(crate) fn report(&self) -> String {
        let (settle, limit) = Self::medians(&self.settle);
        let (accrue, statement) = Self::medians(&self.accrue);
        let ratio = |ours: Run, theirs: Run| theirs.ms.max(1) as f64 / ours.ms.max(1) as f64;
        let verdict = |r: f64| if r >= 0.85 { "met" } else { "not met" };
        let (week, years) = self.span_us;
        let mut r = String::from("## Fine rules: policy versions, item classes, closed days\n\n");
        r.push_str(&format!(
            "{} loans of the settlement template with the rules as data: a third each of no class, `laptop` and `dvd`; \
             two versions of each class and of `default` (the second from 2026-10-10, inside the month, so that loans \
             fall on both sides), one of them charging closed days; {:.0} closed days a year (Sundays and eight \
             holidays, 2019–2027). Each way on a fresh copy, {} rounds, the median reported. The statements compute \
             what fine-settler computes, with the same SQL functions (`fine_settler_policy_of`, \
             `fine_settler_policy_fine`, `fine_settler_policy_day_amount`); every round both ways wrote the same \
             rows with the same checksum.\n\n",
            self.loans,
            self.closed_per_year,
            self.settle.len()
        ));
        r.push_str("| measurement | fine-settler | one statement | ratio | target |\n| --- | ---: | ---: | ---: | --- |\n");
        r.push_str(&format!(
            "| settlement of {MONTH_END}: `settle` (1 shard) vs one `update` | {} loans, {} ms ({:.0} rows/s) | {} ms ({:.0} rows/s) | {:.2} | ≥ 0.85 — {} |\n",
            settle.rows,
            settle.ms,
            per_sec(settle.rows, settle.ms),
            limit.ms,
            per_sec(limit.rows, limit.ms),
            ratio(settle, limit),
            verdict(ratio(settle, limit))
        ));
        r.push_str(&format!(
            "| accrual day {DAY} (empty ledger): `accrue` vs one `insert` | {} charges, {} ms ({:.0} rows/s) | {} ms ({:.0} rows/s) | {:.2} | ≥ 0.85 — {} |\n",
            accrue.rows,
            accrue.ms,
            per_sec(accrue.rows, accrue.ms),
            statement.ms,
            per_sec(statement.rows, statement.ms),
            ratio(accrue, statement),
            verdict(ratio(accrue, statement))
        ));
        if !self.batched.is_empty() {
            let batched = median(self.batched.clone());
            r.push_str(&format!(
                "\nWhat batches alone cost: the same `insert` cut into batches of {} loans owing a charge by id, each its own \
                 transaction (no claim, no fence, no lock, no cap's guard), {} ms ({:.0} rows/s): {:.2} × the one \
                 `insert`; `accrue`'s rate is {:.2} × these batches'.\n",
                self.batch,
                batched.ms,
                per_sec(batched.rows, batched.ms),
                ratio(batched, statement),
                ratio(accrue, batched)
            ));
        }
        if !self.capped.is_empty() {
            let accrued = median(self.capped.iter().map(|c| c.0).collect());
            let guarded = median(self.capped.iter().map(|c| c.1).collect());
            let plain = median(self.capped.iter().map(|c| c.2).collect());
            r.push_str(&format!(
                "\nWhat the cap's guard costs, on a ledger that holds the week before the day ({} charges: each loan's \
                 canonical amounts of the seven days before, priced as `accrue` prices them, then `vacuum analyze`), each \
                 way on a fresh copy of it, the same charges with the same checksum:\n\n\
                 | the day's charges on a week of ledger | ms | rows/s | × the one `insert` |\n| --- | ---: | ---: | ---: |\n",
                self.week_rows
            ));
            for (way, run) in [
                ("one `insert` (no guard)".to_string(), plain),
                (
                    "one `insert` with the cap's guard and each day charged once (`on conflict do nothing`); no \
                     batches, claim, fence, lock or correction"
                        .to_string(),
                    guarded,
                ),
                (format!("`fine-settler accrue --date {DAY}`"), accrued),
            ] {
                let rate = per_sec(run.rows, run.ms);
                r.push_str(&format!("| {way} | {} | {rate:.0} | {:.2} |\n", run.ms, ratio(run, plain)));
            }
            r.push_str(&format!(
                "\nThe second row is the fastest anything can charge the day that keeps a loan under its cap and never \
                 charges a day twice: the guard reads what each capped loan's ledger and corrections hold. `accrue`'s rate \
                 is {:.2} × that statement's.\n",
                ratio(accrued, guarded)
            ));
        }
        r.push_str(&format!(
            "\n| a loan's chargeable days ({} loans each, closed days counted, cap so the count is needed) | µs a loan |\n| --- | ---: |\n\
             | a week late | {week:.2} |\n| five years late (a lost book) | {years:.2} |\n| ratio (five years / a week) | {:.2} |\n",
            self.span_loans,
            years / week.max(f64::MIN_POSITIVE)
        ));
        r.push_str(&format!(
            "\nStatements per idle tick on the settled copy, start-up included, as the settlement section measures them (a \
             replica ticking every 200 ms for 3 s, settlement enabled, `pg_stat_statements` calls over the ticks it \
             logged): {:.2}. The tick's one statement reads no rule (it prices nothing); the accrual section measures \
             the steady idle tick alone.\n",
            self.idle_statements
        ));
        r
    }
}

impl Bench {
    /// The section: `loans` loans, `rounds` rounds, `settle` batches of `batch`.
    pub(crate) async fn rules(&self, loans: u64, rounds: u32, batch: u32) -> Result<RulesLeg, Error> {
        let base = self.template(loans).await?;
        let template = format!("fsb_rules_{loans}");
        self.copy(&base, &template).await?;
        let pool = self.pool(&template, 1).await?;
        sqlx::raw_sql(RULES_SQL).execute(&pool).await?;
        sqlx::raw_sql("vacuum full loans").execute(&pool).await?;
        sqlx::raw_sql("analyze").execute(&pool).await?;
        let closed: i64 = sqlx::query_scalar("select count(*) from library_closed_days")
            .fetch_one(&pool)
            .await?;
        pool.close().await;
        self.until_unused(&template).await?;
        let mut leg = RulesLeg {
            loans,
            batch,
            closed_per_year: closed as f64 / 9.0,
            ..RulesLeg::default()
        };
        for round in 1..=rounds {
            eprintln!("   rules, round {round}/{rounds}: settle, update, accrue, insert");
            let db = self.copy(&template, "fsb_rules_run").await?;
            let s = self.settle(&db, 1, batch, false).await?;
            let settled = Run {
                rows: s.updated,
                ms: s.elapsed_ms,
                checksum: self.fines_checksum(&db).await?,
            };
            self.drop_db(&db).await?;
            let db = self.copy(&template, "fsb_rules_run").await?;
            let (rows, secs) = self.limit(&db, 1).await?;
            let limit = Run {
                rows: i64::try_from(rows)?,
                ms: (secs * 1000.0) as u64,
                checksum: self.fines_checksum(&db).await?,
            };
            if round == 1 {
                leg.idle_statements = self.idle(&db).await?.0;
            }
            self.drop_db(&db).await?;
            if (settled.rows, settled.checksum) != (limit.rows, limit.checksum) {
                return Err(format!("settle {settled:?} and the update {limit:?} disagree").into());
            }
            leg.settle.push((settled, limit));

            let db = self.copy(&template, "fsb_rules_run").await?;
            let accrued = self.accrue(&db, batch).await?;
            self.drop_db(&db).await?;
            let db = self.copy(&template, "fsb_rules_run").await?;
            let statement = self.day_statement(&db).await?;
            self.drop_db(&db).await?;
            if (accrued.rows, accrued.checksum) != (statement.rows, statement.checksum) {
                return Err(format!("accrue {accrued:?} and the insert {statement:?} disagree").into());
            }
            let db = self.copy(&template, "fsb_rules_run").await?;
            let batched = self.day_batched(&db, batch).await?;
            self.drop_db(&db).await?;
            if (batched.rows, batched.checksum) != (statement.rows, statement.checksum) {
                return Err(
                    format!("the batched insert {batched:?} and the insert {statement:?} disagree").into(),
                );
            }
            leg.batched.push(batched);
            leg.accrue.push((accrued, statement));
        }
        leg.week_rows = self.capped(&template, batch, rounds, &mut leg.capped).await?;
        let db = self.copy(&template, "fsb_rules_run").await?;
        let pool = self.pool(&db, 1).await?;
        let (span_loans, week, years) = span_cost(&pool).await?;
        pool.close().await;
        self.drop_db(&db).await?;
        leg.span_loans = span_loans;
        leg.span_us = (week, years);
        self.drop_db(&template).await?;
        Ok(leg)
    }

    /// The accrual day on copies of `template` whose ledger holds the week before it ([`WEEK_SQL`]), `rounds` times:
    /// `accrue`, the one statement with the cap's guard
    /// ([`crate::accrual::day::GUARDED_SQL`]) and the one `insert` ([`DAY_SQL`]), each
    /// on a fresh copy, pushed to `out`. Fails unless every way wrote the same charges. Returns the week's charges.
    async fn capped(
        &self,
        template: &str,
        batch: u32,
        rounds: u32,
        out: &mut Vec<(Run, Run, Run)>,
    ) -> Result<i64, Error> {
        let week_template = self.copy(template, "fsb_rules_week").await?;
        let pool = self.pool(&week_template, 1).await?;
        let week = sqlx::query(WEEK_SQL)
            .bind(DAY.parse::<chrono::NaiveDate>()?)
            .execute(&pool)
            .await?
            .rows_affected();
        sqlx::raw_sql("vacuum analyze fine_ledger").execute(&pool).await?;
        pool.close().await;
        self.until_unused(&week_template).await?;
        for round in 1..=rounds {
            eprintln!(
                "   rules, round {round}/{rounds}: the day on a week of ledger: accrue, guarded, insert"
            );
            let db = self.copy(&week_template, "fsb_rules_run").await?;
            let accrued = self.accrue(&db, batch).await?;
            self.drop_db(&db).await?;
            let db = self.copy(&week_template, "fsb_rules_run").await?;
            let guarded = self
                .day_statement_of(&db, crate::accrual::day::GUARDED_SQL)
                .await?;
            self.drop_db(&db).await?;
            let db = self.copy(&week_template, "fsb_rules_run").await?;
            let plain = self.day_statement_of(&db, DAY_SQL).await?;
            self.drop_db(&db).await?;
            for (way, run) in [("accrue", accrued), ("the guarded statement", guarded)] {
                if (run.rows, run.checksum) != (plain.rows, plain.checksum) {
                    return Err(format!(
                        "on a week of ledger, {way} {run:?} and the insert {plain:?} disagree"
                    )
                    .into());
                }
            }
            out.push((accrued, guarded, plain));
        }
        self.drop_db(&week_template).await?;
        Ok(i64::try_from(week)?)
    }

    /// Waits until no session uses `db`, so that it can be copied: a closed pool's backend that has not ended
    /// after a second is ended.
    async fn until_unused(&self, db: &str) -> Result<(), Error> {
        for attempt in 0..100 {
            if attempt == 20 {
                sqlx::query("select pg_terminate_backend(pid) from pg_stat_activity where datname = $1")
                    .bind(db)
                    .execute(&self.admin)
                    .await?;
            }
            let sessions: i64 =
                sqlx::query_scalar("select count(*) from pg_stat_activity where datname = $1")
                    .bind(db)
                    .fetch_one(&self.admin)
                    .await?;
            if sessions == 0 {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let who: Vec<(Option<String>, Option<String>, Option<String>)> = sqlx::query_as(
            "select backend_type, application_name, left(query, 80) from pg_stat_activity where datname = $1",
        )
        .bind(db)
        .fetch_all(&self.admin)
        .await?;
        Err(format!("{db} is still in use: {who:?}").into())
    }

    /// A checksum of the month's settled fines.
    async fn fines_checksum(&self, db: &str) -> Result<i64, Error> {
        let pool = self.pool(db, 1).await?;
        let sum: i64 = sqlx::query_scalar(
            "select coalesce(sum(fine_cents * (id % 997 + 1)), 0)::bigint from loans where fine_settled_at is not null",
        )
        .fetch_one(&pool)
        .await?;
        pool.close().await;
        Ok(sum)
    }

    /// A checksum of the day's charges, and how many.
    async fn charges(&self, db: &str) -> Result<(i64, i64), Error> {
        let pool = self.pool(db, 1).await?;
        let row: (i64, i64) = sqlx::query_as(
            "select count(*), coalesce(sum(amount_cents * (loan_id % 997 + 1)), 0)::bigint
             from fine_ledger where accrual_date = $1::date",
        )
        .bind(DAY)
        .fetch_one(&pool)
        .await?;
        pool.close().await;
        Ok(row)
    }

    /// `fine-settler accrue --date DAY` on `db`.
    async fn accrue(&self, db: &str, batch: u32) -> Result<Run, Error> {
        let out = std::process::Command::new(binary()?)
            .args(["accrue", "--date", DAY])
            .env("DATABASE_URL", format!("{}/{db}", self.server))
            .env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", batch.to_string())
            .env("FINE_SETTLER__LOG__LEVEL", "warn")
            .output()?;
        let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let report: serde_json::Value = serde_json::from_str(&line)?;
        if report["outcome"].as_str() != Some("settled") {
            return Err(format!("accrue failed: {line}").into());
        }
        let (rows, checksum) = self.charges(db).await?;
        Ok(Run {
            rows,
            ms: report["elapsed_ms"].as_u64().unwrap_or(0),
            checksum,
        })
    }

    /// The day's charges as one statement on `db`.
    async fn day_statement(&self, db: &str) -> Result<Run, Error> {
        self.day_statement_of(db, DAY_SQL).await
    }

    /// The day's charges as the one statement `sql` (its `$1` the day) on `db`.
    async fn day_statement_of(&self, db: &str, sql: &str) -> Result<Run, Error> {
        let pool = self.pool(db, 1).await?;
        sqlx::raw_sql("select 1").execute(&pool).await?;
        let started = Instant::now();
        sqlx::query(sql)
            .bind(DAY.parse::<chrono::NaiveDate>()?)
            .execute(&pool)
            .await?;
        let ms = u64::try_from(started.elapsed().as_millis())?;
        pool.close().await;
        let (rows, checksum) = self.charges(db).await?;
        Ok(Run { rows, ms, checksum })
    }

    /// The day's charges by the same statement in batches of `batch` on `db`
    /// ([`crate::accrual::day::batched_statement`]).
    async fn day_batched(&self, db: &str, batch: u32) -> Result<Run, Error> {
        let pool = self.pool(db, 1).await?;
        sqlx::raw_sql("select 1").execute(&pool).await?;
        let started = Instant::now();
        crate::accrual::day::batched_statement(&pool, DAY.parse::<chrono::NaiveDate>()?, batch).await?;
        let ms = u64::try_from(started.elapsed().as_millis())?;
        pool.close().await;
        let (rows, checksum) = self.charges(db).await?;
        Ok(Run { rows, ms, checksum })
    }
}

/// The cost of a loan's chargeable days, for loans due a week before a day and loans due five years before it:
/// (loans each, µs a loan a week late, µs a loan five years late). The amount of the day is computed under a
/// cap the loans never reach, so the chargeable days before the day are counted for every loan (closed days
/// included); the best of three timings each.
async fn span_cost(pool: &PgPool) -> Result<(i64, f64, f64), Error> {
    const N: i64 = 200_000;
    let time = |days: i64| async move {
        let mut best = f64::MAX;
        for _ in 0..3 {
            let started = Instant::now();
            let _: i64 = sqlx::query_scalar(
                "select sum(a.amount_cents)::bigint
                 from generate_series(1, $1::bigint) g
                 cross join lateral fine_settler_policy_day_amount(date '2026-10-20' - $2::int - (g % 3)::int,
                                                                   null, date '2026-10-20', 100, 0,
                                                                   1000000000000, false) a",
            )
            .bind(N)
            .bind(i32::try_from(days)?)
            .fetch_one(pool)
            .await?;
            best = best.min(started.elapsed().as_secs_f64() * 1e6 / N as f64);
        }
        Ok::<f64, Error>(best)
    };
    let week = time(7).await?;
    let years = time(5 * 365).await?;
    Ok((N, week, years))
}

/// The section's heading, as [`RulesLeg::report`] writes it.
const HEADING: &str = "## Fine rules: policy versions, item classes, closed days";
/// The report header line that says when the section was measured.
const MEASURED: &str = "- fine rules measured:";

/// The header line for a section measured at `date`, commit `commit`.
pub(crate) fn measured(date: &str, commit: &str) -> String {
    format!("{MEASURED} {date} at commit {commit}")
}

/// `existing` with its fine rules section replaced by `section` and its header line by `measured`
/// ([`crate::accrual::merge_section`]).
pub(crate) fn merge(existing: &str, section: &str, measured: &str) -> String {
    crate::accrual::merge_section(existing, (HEADING, section), (MEASURED, measured))
}
