//! The re-check, measured with a real replica: returns back-dated before charged days, which a replica corrects
//! by itself (`run --once`: its tick re-checks, and the days it re-opens run over the changed loans only); and,
//! at each size of open overdue loans, what a re-check costs with nothing queued and with changed loans queued
//! (database time from `pg_stat_statements`), and the statements of an idle tick with accrual enabled.

use std::path::Path;

use chrono::{Duration, NaiveDate};

use super::{
    data::{Population, CAP, GRACE, RATE},
    replica::{found_in, Found, RunLine, Statements, Ticking, Timed},
    template_name, AccrualArgs, Jit, Schema, WINDOW_DAYS,
};
use crate::{Bench, Error};

/// How long a replica may take to correct the back-dated returns before the benchmark gives up.
const CORRECTING_DEADLINE: std::time::Duration = std::time::Duration::from_secs(600);

/// `accrual.recheck_every` of the replica that re-checks at every tick: far shorter than its 200 ms period, since
/// a re-check is due once that long has passed since the last one ended.
const RECHECK_EVERY_TICK: &str = "10ms";

/// A replica correcting back-dated returns by itself.
#[derive(Debug, Clone)]
pub(crate) struct Backdated {
    /// The days accrued before the returns were back-dated (the setup's runs).
    pub setup: Vec<RunLine>,
    /// Loans whose return was recorded, dated the day before the window, and the changes that queued.
    pub returns: i64,
    pub queued: i64,
    /// Charges of those loans after their return: the corrections owed.
    pub owed: i64,
    /// From the replica's start until the ledger held every correction owed.
    pub wall_ms: u64,
    /// The re-checks that found days to re-open.
    pub rechecks: Vec<Found>,
    pub statements: Statements,
    /// Corrections in the ledger afterwards, and days after a return that still have a net.
    pub written: i64,
    pub net_after_returns: i64,
}

/// The re-check at one size of open overdue loans.
#[derive(Debug, Clone)]
pub(crate) struct OpenSize {
    pub loans: i64,
    pub at_cap: i64,
    pub ledger_rows: i64,
    pub generated_secs: f64,
    /// A replica ticking with `accrual.recheck_every` at its default (the first tick re-checks).
    pub idle: Ticking,
    /// A replica re-checking at every tick, with nothing queued; and the same with JIT off.
    pub every_tick: Ticking,
    pub every_tick_jit_off: Ticking,
    /// One re-check with changed loans queued.
    pub changed: Changed,
}

/// One `run --once` whose re-check had changed loans queued: how many, what it found, what it cost.
#[derive(Debug, Clone)]
pub(crate) struct Changed {
    pub queued: i64,
    pub found: Found,
    pub recheck: Timed,
    /// The tick's wall time (start to exit), the re-opened days' runs included.
    pub wall_ms: u64,
}

/// The day before the window that ends on `day`: a return dated there makes every charge of the window owed
/// no longer (a return back-dated before charged days), and leaves the days before the window as they are.
fn before_window(day: NaiveDate) -> NaiveDate {
    day - Duration::days(WINDOW_DAYS)
}

impl Bench {
    /// A replica correcting `returns` back-dated returns by itself, on a copy of the current template: the
    /// window is accrued first (`run --once`), then that many open loans charged on `day` (spread over the ids)
    /// are recorded as returned the day before the window, and a replica ticking every 200 ms is timed until the
    /// ledger holds every correction owed.
    pub(crate) async fn backdated(
        &self,
        current: &Path,
        loans: u64,
        day: NaiveDate,
        batch: u32,
        returns: u64,
    ) -> Result<Backdated, Error> {
        eprintln!("   accrual: re-check of {returns} back-dated returns (accruing the window first)");
        let db = self
            .copy(&template_name(Schema::Current, loans), "fsb_accrual_backdated")
            .await?;
        self.still_day(day).await?;
        let setup = self.run_once(current, &db, batch, false, Jit::Server)?;
        check_setup(&setup.runs, day)?;
        let pool = self.pool(&db, 1).await?;
        let ids = back_date(&pool, day, returns).await?;
        let (queued, owed): (i64, i64) = sqlx::query_as(
            "select (select count(*) from fine_loan_changes),
                    (select count(*) from fine_ledger f join loans l on l.id = f.loan_id
                     where l.id = any($1) and f.accrual_date > l.returned_on)",
        )
        .bind(&ids)
        .fetch_one(&pool)
        .await?;
        self.exec("checkpoint").await?;
        self.still_day(day).await?;
        self.reset_statements().await?;
        let done = format!("select count(*) >= {owed} from fine_ledger_corrections");
        let worked = self
            .until(current, &db, batch, &done, CORRECTING_DEADLINE)
            .await?;
        let statements = self.statements_of(&db).await?;
        let (written, net_after_returns): (i64, i64) = sqlx::query_as(
            "select (select count(*) from fine_ledger_corrections),
                    (select count(*) from fine_ledger_net n join loans l on l.id = n.loan_id
                     where l.id = any($1) and n.accrual_date > l.returned_on)",
        )
        .bind(&ids)
        .fetch_one(&pool)
        .await?;
        pool.close().await;
        self.drop_db(&db).await?;
        Ok(Backdated {
            setup: setup.runs,
            returns: i64::try_from(ids.len())?,
            queued,
            owed,
            wall_ms: worked.wall_ms,
            rechecks: found_in(&worked.log),
            statements,
            written,
            net_after_returns,
        })
    }

    /// The re-check at `n` open overdue loans: generated with a week of ledger, a first tick, a replica ticking
    /// with the default `recheck_every` and one re-checking at every tick (with JIT and without), then
    /// `args.changed` loans changed and one `run --once`. The database is dropped afterwards.
    pub(crate) async fn open_size(
        &self,
        current: &Path,
        n: u64,
        day: NaiveDate,
        args: &AccrualArgs,
    ) -> Result<OpenSize, Error> {
        eprintln!("   accrual: re-check at {n} open overdue loans (generating a week of ledger)");
        let db = format!("fsb_accrual_open_{n}");
        let generated = self
            .accrual_db(&db, current, Schema::Current, Population::OpenOverdue, n, day)
            .await?;
        self.exec(&format!(
            "alter database {db} set pg_stat_statements.track_planning = on"
        ))
        .await?;
        let pool = self.pool(&db, 1).await?;
        let at_cap: i64 = sqlx::query_scalar(
            "select count(*) from loans where fine_settler_day_amount(due_on, returned_on, $1, $2, $3, $4) = 0",
        )
        .bind(day)
        .bind(RATE)
        .bind(GRACE)
        .bind(CAP)
        .fetch_one(&pool)
        .await?;
        pool.close().await;
        self.still_day(day).await?;
        // The first tick settles the (empty) months of the catch-up window; after it every tick is idle.
        self.run_once(current, &db, args.batch, true, Jit::Server)?;
        let secs = args.tick_secs;
        let idle = self
            .ticking(current, &db, args.batch, None, Jit::Server, secs)
            .await?;
        let every = Some(RECHECK_EVERY_TICK);
        let every_tick = self
            .ticking(current, &db, args.batch, every, Jit::Server, secs)
            .await?;
        let every_tick_jit_off = self
            .ticking(current, &db, args.batch, every, Jit::Off, secs)
            .await?;
        let changed = self.changed(current, &db, day, args).await?;
        self.drop_db(&db).await?;
        Ok(OpenSize {
            loans: generated.loans,
            at_cap,
            ledger_rows: generated.ledger_rows,
            generated_secs: generated.seconds,
            idle,
            every_tick,
            every_tick_jit_off,
            changed,
        })
    }

    /// `args.changed` open loans charged on `day` back-dated before the window in `db`, and one `run --once`
    /// whose re-check must find every one of them with work.
    async fn changed(
        &self,
        current: &Path,
        db: &str,
        day: NaiveDate,
        args: &AccrualArgs,
    ) -> Result<Changed, Error> {
        let pool = self.pool(db, 1).await?;
        let ids = back_date(&pool, day, args.changed).await?;
        let queued: i64 = sqlx::query_scalar("select count(*) from fine_loan_changes")
            .fetch_one(&pool)
            .await?;
        pool.close().await;
        self.still_day(day).await?;
        self.reset_statements().await?;
        let once = self.run_once(current, db, args.batch, true, Jit::Server)?;
        let recheck = self.statements_of(db).await?.recheck;
        let found = found_in(&once.log);
        let changed = i64::try_from(ids.len())?;
        match found.as_slice() {
            [one] if one.changed == changed && one.dirty == changed => Ok(Changed {
                queued,
                found: *one,
                recheck,
                wall_ms: once.wall_ms,
            }),
            _ => Err(format!("the re-check of {changed} changed loans in {db} found {found:?}").into()),
        }
    }
}

/// Records `count` open loans charged on `day` — spread over the ids — as returned the day before the window;
/// their ids. Fails if there are fewer such loans.
async fn back_date(pool: &sqlx::PgPool, day: NaiveDate, count: u64) -> Result<Vec<i64>, Error> {
    let ids: Vec<i64> = sqlx::query_scalar(
        "with chosen as (
             select l.id from loans l
             where l.returned_on is null
               and exists (select 1 from fine_ledger f where f.loan_id = l.id and f.accrual_date = $1)
             order by hashint8(l.id), l.id
             limit $2)
         update loans set returned_on = $3 from chosen where loans.id = chosen.id
         returning loans.id",
    )
    .bind(day)
    .bind(i64::try_from(count)?)
    .bind(before_window(day))
    .fetch_all(pool)
    .await?;
    if ids.len() as u64 != count {
        return Err(format!(
            "only {} open loans charged on {day} to back-date, {count} asked",
            ids.len()
        )
        .into());
    }
    Ok(ids)
}

/// Fails unless the setup's tick accrued every day of the window, the days before `day` finding nothing to do
/// (the generated ledger is what the replica would have written) and `day` charging.
fn check_setup(runs: &[RunLine], day: NaiveDate) -> Result<(), Error> {
    let accrual: Vec<&RunLine> = runs.iter().filter(|r| r.job == "overdue-accrual").collect();
    let quiet = accrual
        .iter()
        .filter(|r| r.business_date < day)
        .all(|r| r.updated == 0 && r.corrections == 0);
    let charged = accrual.iter().any(|r| r.business_date == day && r.updated > 0);
    if accrual.len() as i64 != WINDOW_DAYS
        || !quiet
        || !charged
        || accrual.iter().any(|r| r.outcome != "settled")
    {
        return Err(format!("accruing the window before the returns: unexpected runs {accrual:?}").into());
    }
    Ok(())
}
