//! One accrual day over the mixed population: `fine-settler accrue --date D` against the one set-based
//! `insert … select` that writes the same charges, each on a fresh copy of the template, for the current ledger
//! and (with `--before-binary`) the ledger before canonical amounts, in rounds, side by side in one run.

use std::{path::Path, process::Stdio, time::Instant};

use chrono::NaiveDate;

use super::{
    data::{self, Population, CAP, GRACE, RATE},
    replica::Costly,
    template_name, Jit, Schema,
};
use crate::{Bench, Error};

/// How a day is accrued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Way {
    /// `fine-settler accrue --date D`: claimed, in fenced batches, resumable.
    Accrue,
    /// The same with JIT compilation off for its sessions: how much of its time is compiling its statements.
    AccrueJitOff,
    /// One `insert into fine_ledger select …` of every charge of the day: no batches, no claim, no fence.
    Statement,
    /// The same statement with the cap's guard `accrue` keeps (current ledger only): each charge written only if
    /// it fits under what the loan's ledger and corrections leave under its cap (their sums, read per loan), and
    /// `on conflict do nothing` — what any one statement that keeps a loan under its cap whatever else was
    /// charged must read; still no batches.
    GuardedStatement,
    /// The statement without the guard cut into batches (current ledger only): the next `accrual.batch_size`
    /// loans owing a charge by id, each batch its own statement and transaction — what cutting the day into
    /// commits costs by itself; no guard, no claim, no fence.
    BatchedStatement,
}

/// One accrual of the day as measured: the charges it wrote, their sum, its time (the run's `elapsed_ms`, claim
/// to finish, or the statement's), the statements the server ran for it (and the costliest of them) and the
/// process's peak RSS.
#[derive(Debug, Clone)]
pub(crate) struct DayRun {
    pub rows: i64,
    pub cents: i64,
    pub ms: u64,
    pub statements: i64,
    pub costliest: Vec<Costly>,
    pub peak_rss_kib: u64,
}

/// Every run of the accrual day, by ledger and way, in the order they ran.
#[derive(Debug, Default)]
pub(crate) struct DayLeg {
    pub loans: u64,
    pub generated: Vec<(Schema, data::Generated)>,
    pub runs: Vec<(Schema, Way, Vec<DayRun>)>,
}

impl DayLeg {
    /// The median run of `way` on `schema` by time (of an even number, the faster of the middle two).
    pub fn median(&self, schema: Schema, way: Way) -> Option<DayRun> {
        let (_, _, runs) = self.runs.iter().find(|(s, w, _)| *s == schema && *w == way)?;
        let mut runs = runs.clone();
        runs.sort_by_key(|r| r.ms);
        runs.get((runs.len().max(1) - 1) / 2).cloned()
    }

    /// `way`'s rate against the statement's on `schema`, by their medians.
    pub fn ratio(&self, schema: Schema, way: Way) -> Option<f64> {
        let accrue = self.median(schema, way)?;
        let statement = self.median(schema, Way::Statement)?;
        Some(statement.ms.max(1) as f64 / accrue.ms.max(1) as f64)
    }

    fn push(&mut self, schema: Schema, way: Way, run: DayRun) {
        match self.runs.iter_mut().find(|(s, w, _)| *s == schema && *w == way) {
            Some((_, _, runs)) => runs.push(run),
            None => self.runs.push((schema, way, vec![run])),
        }
    }
}

/// Runs [`BATCHED_SQL`] on `pool` batch after batch (each its own transaction) until one writes nothing; returns
/// the charges written and the statements run.
pub(crate) async fn batched_statement(
    pool: &sqlx::PgPool,
    day: NaiveDate,
    batch: u32,
) -> Result<(u64, i64), Error> {
    let (mut written, mut statements, mut after) = (0u64, 0i64, 0i64);
    loop {
        let (rows, last): (i64, i64) = sqlx::query_as(BATCHED_SQL)
            .bind(day)
            .bind(after)
            .bind(i64::from(batch))
            .fetch_one(pool)
            .await?;
        statements += 1;
        if rows == 0 {
            return Ok((written, statements));
        }
        written += u64::try_from(rows)?;
        after = last;
    }
}

/// The statement that writes the day's charges at once: on the current ledger with each loan's policy from the
/// database (`fine_settler_policy_of`, `fine_settler_policy_day_amount`: what `accrue` computes, so that the
/// ratio compares like with like); on the one before (which has neither) with the flat rule written out, which
/// costs what its `accrue` computed. The policy's values are bound on both (the current statement reads them
/// from the database: a filter that is always true names them).
fn statement_sql(schema: Schema) -> String {
    match schema {
        Schema::Current => "insert into fine_ledger (loan_id, accrual_date, amount_cents)
             select l.id, $1, a.amount_cents
             from loans l
             cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
             cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents,
                                                               p.grace_days, p.cap_cents,
                                                               p.charge_closed_days) a
             where l.due_on < $1::date and (l.returned_on is null or l.returned_on >= $1)
               and a.amount_cents > 0 and ($2::bigint, $3::int, $4::bigint) is not null"
            .to_string(),
        Schema::Before => {
            let amount = data::day_amount_sql(
                "l.due_on",
                "l.returned_on",
                "$1::date",
                ["$2::bigint", "$3::int", "$4::bigint"],
            );
            format!(
                "insert into fine_ledger (loan_id, accrual_date, amount_cents)
                 select l.id, $1, a.amount
                 from loans l
                 cross join lateral (select {amount} as amount) a
                 where l.due_on < $1::date - $3::int and (l.returned_on is null or l.returned_on >= $1)
                   and a.amount > 0"
            )
        }
    }
}

/// [`Way::GuardedStatement`] (and the fine rules section's guarded way): the current statement, each charge of a
/// capped loan written only if it fits under the cap with what the loan's ledger and corrections hold (summed per
/// loan, as `accrue`'s charge sums them; a loan without a cap is not summed, as there), and `on conflict do
/// nothing`: one statement, no batches, claim, fence, lock or correction — the fastest anything can charge the
/// day that keeps a loan under its cap and never charges a day twice. On a canonical ledger every charge fits: it
/// writes what the others do.
pub(crate) const GUARDED_SQL: &str = "insert into fine_ledger (loan_id, accrual_date, amount_cents)
     select c.id, $1, c.amount_cents
     from (select l.id, a.amount_cents, p.cap_cents,
                  case when p.cap_cents = 0 then 0
                       else (select coalesce(sum(x.amount_cents), 0)::bigint from fine_ledger x where x.loan_id = l.id)
                            + (select coalesce(sum(y.amount_cents), 0)::bigint from fine_ledger_corrections y
                               where y.loan_id = l.id) end as held
           from loans l
           cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
           cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents,
                                                             p.grace_days, p.cap_cents, p.charge_closed_days) a
           where l.due_on < $1::date and (l.returned_on is null or l.returned_on >= $1) and a.amount_cents > 0
           offset 0) c
     where c.cap_cents = 0 or c.held + c.amount_cents <= c.cap_cents
     on conflict on constraint fine_ledger_pkey do nothing";

/// [`Way::BatchedStatement`]: the current statement over the next `$3` loans owing a charge after id `$2`
/// (walking the primary key); returns the charges written and the last loan's id.
pub(crate) const BATCHED_SQL: &str = "with c as (
         select l.id, a.amount_cents
         from loans l
         cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
         cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents,
                                                           p.grace_days, p.cap_cents, p.charge_closed_days) a
         where l.id > $2 and l.due_on < $1::date and (l.returned_on is null or l.returned_on >= $1)
           and a.amount_cents > 0
         order by l.id
         limit $3
     ), w as (
         insert into fine_ledger (loan_id, accrual_date, amount_cents)
         select c.id, $1, c.amount_cents from c
         returning loan_id
     )
     select count(*), coalesce(max(loan_id), 0)::bigint from w";

impl Bench {
    /// The accrual day, `rounds` times: on fresh copies of each template, `accrue` and then the statement, the
    /// current ledger first. Fails unless every run wrote the same charges. The templates are made here; the
    /// current one is kept for the re-check, the one before is dropped.
    pub(crate) async fn day_leg(
        &self,
        current: &Path,
        before: Option<&Path>,
        loans: u64,
        day: NaiveDate,
        batch: u32,
        rounds: u32,
    ) -> Result<DayLeg, Error> {
        let mut ledgers = vec![(Schema::Current, current)];
        ledgers.extend(before.map(|b| (Schema::Before, b)));
        let mut leg = DayLeg {
            loans,
            ..DayLeg::default()
        };
        for (schema, binary) in &ledgers {
            eprintln!(
                "   accrual: generating {loans} loans and their ledger ({})",
                schema.label()
            );
            let name = template_name(*schema, loans);
            let generated = self
                .accrual_db(&name, binary, *schema, Population::Mixed, loans, day)
                .await?;
            leg.generated.push((*schema, generated));
        }
        for round in 1..=rounds {
            for (schema, binary) in &ledgers {
                eprintln!("   accrual day, round {round}/{rounds}: {}", schema.label());
                let template = template_name(*schema, loans);
                for (way, jit) in [(Way::Accrue, Jit::Server), (Way::AccrueJitOff, Jit::Off)] {
                    let run = self.accrue_day(binary, &template, day, batch, jit).await?;
                    leg.push(*schema, way, run);
                }
                let run = self.statement_day(*schema, &template, day).await?;
                leg.push(*schema, Way::Statement, run);
                if *schema == Schema::Current {
                    let run = self.guarded_day(&template, day).await?;
                    leg.push(*schema, Way::GuardedStatement, run);
                    let run = self.batched_day(&template, day, batch).await?;
                    leg.push(*schema, Way::BatchedStatement, run);
                }
            }
        }
        if before.is_some() {
            self.drop_db(&template_name(Schema::Before, loans)).await?;
        }
        let first = leg.runs[0].2[0].clone();
        for (schema, way, runs) in &leg.runs {
            if let Some(r) = runs
                .iter()
                .find(|r| (r.rows, r.cents) != (first.rows, first.cents))
            {
                return Err(format!(
                    "{way:?} on the {} wrote {} charges of {} cents, the first run {} of {}",
                    schema.label(),
                    r.rows,
                    r.cents,
                    first.rows,
                    first.cents
                )
                .into());
            }
        }
        Ok(leg)
    }

    /// `binary accrue --date day` on a fresh copy of `template`, JIT as `jit` says.
    async fn accrue_day(
        &self,
        binary: &Path,
        template: &str,
        day: NaiveDate,
        batch: u32,
        jit: Jit,
    ) -> Result<DayRun, Error> {
        let db = self.copy(template, "fsb_accrual_day").await?;
        self.reset_statements().await?;
        let url = format!("{}/{db}", self.server);
        let child = super::process(binary, &url, batch, false, jit, "warn")
            .args(["accrue", "--date", &day.to_string()])
            .stderr(Stdio::inherit())
            .spawn()?;
        let pid = child.id();
        let watcher = std::thread::spawn(move || crate::peak_rss(&[pid]));
        let out = child.wait_with_output()?;
        let peak_rss_kib = watcher.join().map_err(|_| "rss watcher panicked")?;
        let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let report: serde_json::Value = serde_json::from_str(&line)?;
        if report["outcome"].as_str() != Some("settled") {
            return Err(format!("{} accrue failed: {line}", binary.display()).into());
        }
        let statements = self.statements_of(&db).await?.calls;
        let costliest = self.costliest(&db, 3).await?;
        let (rows, cents) = self.day_charges(&db, day).await?;
        self.drop_db(&db).await?;
        if report["updated"].as_i64() != Some(rows) {
            return Err(format!(
                "accrue reported {} charges, the ledger holds {rows}",
                report["updated"]
            )
            .into());
        }
        Ok(DayRun {
            rows,
            cents,
            ms: report["elapsed_ms"].as_u64().unwrap_or(0),
            statements,
            costliest,
            peak_rss_kib,
        })
    }

    /// The day's charges written by one statement on a fresh copy of `template` (the connection warmed first,
    /// so connecting is not timed).
    async fn statement_day(&self, schema: Schema, template: &str, day: NaiveDate) -> Result<DayRun, Error> {
        let sql = statement_sql(schema);
        let query = sqlx::query(&sql).bind(day).bind(RATE).bind(GRACE).bind(CAP);
        self.one_statement(template, "fsb_accrual_statement", day, query)
            .await
    }

    /// The day's charges written by the guarded statement ([`Way::GuardedStatement`]) on a fresh copy of
    /// `template`.
    async fn guarded_day(&self, template: &str, day: NaiveDate) -> Result<DayRun, Error> {
        let query = sqlx::query(GUARDED_SQL).bind(day);
        self.one_statement(template, "fsb_accrual_guarded", day, query)
            .await
    }

    /// `query` on a fresh copy of `template` named after `name`, timed (the connection warmed first, so
    /// connecting is not timed).
    async fn one_statement(
        &self,
        template: &str,
        name: &str,
        day: NaiveDate,
        query: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<DayRun, Error> {
        let db = self.copy(template, name).await?;
        let pool = self.pool(&db, 1).await?;
        sqlx::raw_sql("select 1").execute(&pool).await?;
        let started = Instant::now();
        let written = query.execute(&pool).await?.rows_affected();
        let ms = u64::try_from(started.elapsed().as_millis())?;
        pool.close().await;
        self.statement_run(&db, day, written, 1, ms).await
    }

    /// The day's charges written by the statement in batches of `batch` ([`Way::BatchedStatement`]) on a fresh
    /// copy of `template`: one connection, each batch its own transaction, until a batch writes nothing.
    async fn batched_day(&self, template: &str, day: NaiveDate, batch: u32) -> Result<DayRun, Error> {
        let db = self.copy(template, "fsb_accrual_batched").await?;
        let pool = self.pool(&db, 1).await?;
        sqlx::raw_sql("select 1").execute(&pool).await?;
        let started = Instant::now();
        let (written, statements) = batched_statement(&pool, day, batch).await?;
        let ms = u64::try_from(started.elapsed().as_millis())?;
        pool.close().await;
        self.statement_run(&db, day, written, statements, ms).await
    }

    /// A statement way's run on `db`, checked against what the ledger holds; `db` is dropped.
    async fn statement_run(
        &self,
        db: &str,
        day: NaiveDate,
        written: u64,
        statements: i64,
        ms: u64,
    ) -> Result<DayRun, Error> {
        let (rows, cents) = self.day_charges(db, day).await?;
        self.drop_db(db).await?;
        if i64::try_from(written)? != rows {
            return Err(format!("the statement wrote {written} charges, the ledger holds {rows}").into());
        }
        Ok(DayRun {
            rows,
            cents,
            ms,
            statements,
            costliest: Vec::new(),
            peak_rss_kib: 0,
        })
    }

    /// The charges of `day` in `db`'s ledger and their sum.
    async fn day_charges(&self, db: &str, day: NaiveDate) -> Result<(i64, i64), Error> {
        let pool = self.pool(db, 1).await?;
        let charges = sqlx::query_as(
            "select count(*), coalesce(sum(amount_cents), 0)::bigint from fine_ledger where accrual_date = $1",
        )
        .bind(day)
        .fetch_one(&pool)
        .await?;
        pool.close().await;
        Ok(charges)
    }
}
