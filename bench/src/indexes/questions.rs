//! The questions fine-settler asks between its runs, timed on one copy of the indexes section: what the daemon asks
//! at every tick when there is nothing to do (the tick's status statement, which probes each settled month of the
//! catch-up window for late rows) and at its re-check (the loans libraryd changed, against the accrual window's
//! days), and what `verify` asks of a settled month. Each is the real binary's statement: `fine-settler plan --at`
//! asks both of the tick's questions and writes nothing, and `verify` is the operator's command; the server's time
//! of each statement comes from `pg_stat_statements`, reset before every run.

use std::{fmt::Write as _, process::Command, time::Instant};

use sqlx::PgPool;

use crate::{binary, Bench, Error, MONTH_END};

/// The time `plan` is asked about: noon of 5 November 2026 in the default zone (Asia/Shanghai). The settlement
/// keys of its catch-up window (3 months by default) are the month ends of August, September and October 2026,
/// all settled on the copy first, so the tick is idle for settlement and its status statement probes each of the
/// three for late rows; the accrual window is 29 October to 4 November (keys never run: read from `job_runs`
/// alone), which the re-check asks about.
pub(super) const PLAN_AT: &str = "2026-11-05T12:00:00+08:00";

/// The month ends settled on each copy besides the template's own, so that every settlement key of `PLAN_AT`'s
/// window is done.
pub(super) const EARLIER_MONTH_ENDS: [&str; 2] = ["2026-08-31", "2026-09-30"];

/// Text only the tick's status statement has (`store::job_runs::tick`).
const STATUS_MARK: &str = r#"as "late?""#;
/// Text only the re-check has (`store::corrections::recheck`).
const RECHECK_MARK: &str = "with seen as";
/// Text only `verify`'s check of loans with dates that are not finite has (`store::audit`), the one of its
/// statements that can read fine-settler's partial indexes (the month's own reads are ranges of `returned_on`,
/// which none of them holds whole).
const NOT_FINITE_MARK: &str = r#"as "ids!""#;

/// A question asked several times on one copy: the first time (after the copy's runs, its plan made anew by a
/// new process, as every later one) and the median of the others, in ms.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Runs {
    pub first: f64,
    pub median: f64,
}

impl Runs {
    fn of(ms: &[f64]) -> Runs {
        let Some((&first, rest)) = ms.split_first() else {
            return Runs::default();
        };
        let mut rest = rest.to_vec();
        rest.sort_by(f64::total_cmp);
        let median = match rest.len() {
            0 => first,
            n if n % 2 == 1 => rest[n / 2],
            n => (rest[n / 2 - 1] + rest[n / 2]) / 2.0,
        };
        Runs { first, median }
    }
}

/// One copy's questions: the server's time of each statement, and `verify`'s whole time as its operator waits
/// for it.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Questions {
    /// The idle tick's status statement right after the copy's runs: the settled months' dead index entries
    /// still there and the planner's statistics from before the settlements (until autovacuum comes by).
    pub status_unvacuumed: Runs,
    /// The idle tick's status statement after `vacuum analyze loans`.
    pub status: Runs,
    /// The accrual re-check (as `plan` asks it: up to 10,000 queued changes, nothing cleared).
    pub recheck: Runs,
    /// `fine-settler verify --business-date MONTH_END --json`, wall clock.
    pub verify: Runs,
    /// `verify`'s check of loans with dates that are not finite.
    pub not_finite: Runs,
}

impl Bench {
    /// Settles the earlier months of `PLAN_AT`'s window on `db`, then asks `plan --at PLAN_AT` `plan_runs` times;
    /// then, after `vacuum analyze loans`, `plan` as many times again and `verify` `verify_runs` times.
    pub(super) async fn questions(
        &self,
        db: &str,
        plan_runs: usize,
        verify_runs: usize,
    ) -> Result<Questions, Error> {
        for month_end in EARLIER_MONTH_ENDS {
            self.command(db, &["settle", "--business-date", month_end], "settled")
                .await?;
        }
        let pool = self.pool(db, 1).await?;
        sqlx::raw_sql("create extension if not exists pg_stat_statements")
            .execute(&pool)
            .await?;
        let (unvacuumed, _) = self.plans(db, &pool, plan_runs).await?;
        sqlx::raw_sql("vacuum analyze loans").execute(&pool).await?;
        let (status, recheck) = self.plans(db, &pool, plan_runs).await?;
        let (mut verify, mut not_finite) = (Vec::new(), Vec::new());
        for _ in 0..verify_runs {
            reset(&pool).await?;
            // Exit 3 is a month with violations: still a full audit, timed as such.
            let args = ["verify", "--business-date", MONTH_END, "--json"];
            let (_, ms) = self.timed(db, &args, &[0, 3])?;
            verify.push(ms);
            not_finite.push(statement_ms(&pool, NOT_FINITE_MARK).await?);
        }
        pool.close().await;
        Ok(Questions {
            status_unvacuumed: unvacuumed,
            status,
            recheck,
            verify: Runs::of(&verify),
            not_finite: Runs::of(&not_finite),
        })
    }

    /// `plan --at PLAN_AT` `runs` times on `db`: the status statement's and the re-check's times.
    async fn plans(&self, db: &str, pool: &PgPool, runs: usize) -> Result<(Runs, Runs), Error> {
        let (mut status, mut recheck) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            reset(pool).await?;
            let (out, _) = self.timed(db, &["plan", "--at", PLAN_AT], &[0])?;
            idle(&out)?;
            status.push(statement_ms(pool, STATUS_MARK).await?);
            recheck.push(statement_ms(pool, RECHECK_MARK).await?);
        }
        Ok((Runs::of(&status), Runs::of(&recheck)))
    }

    /// `fine-settler ARGS` on `db`, with the accrual enabled (so that `plan` asks the re-check): its stdout and
    /// wall time in ms, once it exited with one of `codes`.
    fn timed(&self, db: &str, args: &[&str], codes: &[i32]) -> Result<(String, f64), Error> {
        let started = Instant::now();
        let out = Command::new(binary()?)
            .args(args)
            .env("DATABASE_URL", format!("{}/{db}", self.server))
            .env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
            .env("FINE_SETTLER__LOG__LEVEL", "error")
            .output()?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        if !out.status.code().is_some_and(|c| codes.contains(&c)) {
            return Err(format!(
                "fine-settler {}: {}: {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )
            .into());
        }
        Ok((String::from_utf8_lossy(&out.stdout).into_owned(), ms))
    }
}

/// Forgets this database's statement statistics.
async fn reset(pool: &PgPool) -> Result<(), Error> {
    sqlx::query(
        "select pg_stat_statements_reset(0::oid,
                (select oid from pg_database where datname = current_database()), 0::bigint)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The server's time, in ms, of the statements of this database whose text holds `mark`, since the last reset;
/// an error if none ran.
async fn statement_ms(pool: &PgPool, mark: &str) -> Result<f64, Error> {
    let (calls, ms): (i64, f64) = sqlx::query_as(
        "select coalesce(sum(calls), 0)::bigint, coalesce(sum(total_exec_time), 0)::float8
         from pg_stat_statements
         where dbid = (select oid from pg_database where datname = current_database())
           and strpos(query, $1) > 0",
    )
    .bind(mark)
    .fetch_one(pool)
    .await?;
    if calls == 0 {
        return Err(format!("no statement with {mark:?} ran").into());
    }
    Ok(ms)
}

/// Checks that `plan`'s lines (`out`) show an idle tick for settlement: every month end of the window done.
fn idle(out: &str) -> Result<(), Error> {
    let mut months = 0;
    for line in out.lines() {
        let due: serde_json::Value = serde_json::from_str(line)?;
        if due["job"].as_str() == Some("fine-settlement") {
            months += 1;
            if due["action"].as_str() != Some("skip") {
                return Err(format!("plan --at {PLAN_AT}: a settlement key is not done: {line}").into());
            }
        }
    }
    if months != EARLIER_MONTH_ENDS.len() + 1 {
        return Err(format!("plan --at {PLAN_AT}: {months} settlement keys, expected 3").into());
    }
    Ok(())
}

/// The table of the questions of `rows` (each a label and its questions).
pub(super) fn table<'a>(r: &mut String, rows: impl Iterator<Item = (String, &'a Questions)>) {
    let _ = writeln!(
        r,
        "| indexes kept | idle tick: status statement, right after the runs | the same, vacuumed | re-check | \
         `verify` | of which the not-finite check |"
    );
    let _ = writeln!(r, "| --- | ---: | ---: | ---: | ---: | ---: |");
    let cell = |t: Runs| format!("{} ({})", ms(t.median), ms(t.first));
    for (label, q) in rows {
        let _ = writeln!(
            r,
            "| {label} | {} | {} | {} | {} | {} |",
            cell(q.status_unvacuumed),
            cell(q.status),
            cell(q.recheck),
            cell(q.verify),
            cell(q.not_finite)
        );
    }
}

/// `ms` milliseconds, to a tenth under 10 ms and whole above.
pub(super) fn ms(ms: f64) -> String {
    if ms < 10.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{ms:.0} ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_run_is_apart_from_the_median_of_the_others() {
        let r = Runs::of(&[90.0, 3.0, 1.0, 2.0]);
        assert_eq!((r.first, r.median), (90.0, 2.0));
        let r = Runs::of(&[90.0, 4.0, 1.0, 2.0, 3.0]);
        assert_eq!(r.median, 2.5);
        let r = Runs::of(&[7.0]);
        assert_eq!((r.first, r.median), (7.0, 7.0));
    }
}
