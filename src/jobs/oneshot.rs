//! The one-shot commands' runs (`settle`, `accrue`, `pending retry`): connect, run one key (or one
//! compensation pass) under a fresh owner that hands its key back cleanly when its shutdown token is
//! cancelled, close. Each always produces a report; an error that keeps a run from starting is the report's
//! `detail`. A run of a business date that is not over yet is refused before anything is written, and so is a
//! run of a paused job (or shard), unless the operator says to ignore the pause.
//!
//! Shutdown is an input: the command line cancels the token on SIGINT/SIGTERM (it installs the handlers;
//! nothing here touches signals), and a test can cancel it itself.

use crate::store::Db;
use chrono::Utc;
use tokio_util::sync::CancellationToken;

use super::{
    accrual::{compensate, compensate_within, Accrual, Compensation, PassLimits},
    backfill::Job,
    runner::{process_owner, Runner},
    settlement::Settlement,
    throttle::Throttle,
    JobName, Outcome, RunKey, RunReport,
};
use crate::{
    calendar,
    config::{Settings, TimeSource},
    progress::Bar,
    store::{self, pauses::Pause, StoreError},
};

/// A bar over the rows a run of `key` would touch (counted once, with the job's own predicates), when `bars`.
async fn bar_for(settings: &Settings, runner: &Runner, key: RunKey, bars: bool) -> Option<Bar> {
    if !bars {
        return None;
    }
    let (rows, corrections) = Job::of(settings, key.job)
        .rows(&runner.pool, &key, Some(i64::MIN))
        .await
        .unwrap_or((0, 0));
    let total = rows.saturating_add(corrections);
    let what = format!("{} {} {}", key.job, key.business_date, key.shard);
    Some(Bar::new(&what, u64::try_from(total).unwrap_or(0), "rows"))
}

/// A report for a run that could not start (no database).
fn not_started(key: RunKey, started: tokio::time::Instant, error: String) -> RunReport {
    RunReport {
        elapsed_ms: started.elapsed().as_millis() as u64,
        ..RunReport::new(key, Outcome::Failed).with_detail(error)
    }
}

/// How a one-shot run of one key goes: the operator's flags, whether it shows progress bars, and what stops it.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Re-run a key that already succeeded, from the beginning (`--force`).
    pub force: bool,
    /// Run even though a pause covers the key, and go on through a pause set while it runs (`--ignore-pause`).
    pub ignore_pause: bool,
    /// Show a progress bar over the rows (stderr is a terminal).
    pub bars: bool,
    /// Cancelled to stop: the run finishes its current batch and hands its key back (FAILED, lease ended).
    pub shutdown: CancellationToken,
}

/// A runner for a one-shot command, handing its key back cleanly once `shutdown` is cancelled.
async fn one_shot_runner(
    settings: &Settings,
    key: RunKey,
    batch_size: u32,
    shutdown: CancellationToken,
) -> Result<Runner, String> {
    let app = format!("fine-settler {} {}", key.job, key.shard);
    let pool = store::connect(&settings.database, &app, settings.claim.lease.batch_timeout())
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "cannot connect to the database");
            e.to_string()
        })?;
    if let Err(e) = store::policies::seed_default_by(&pool, &settings.fine, key.job.as_str()).await {
        pool.close().await;
        return Err(e.to_string());
    }
    Ok(
        Runner::new(pool, process_owner(), &settings.claim, batch_size, shutdown)
            .with_throttle(Throttle::new(settings.throttle.clone())),
    )
}

/// Why a one-shot run was refused before it started; nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// `settle` of a month, or `accrue` of a day, that is not over yet.
    #[error(transparent)]
    NotOver(#[from] NotOver),
    /// A pause covers the key (or, for `pending retry`, some shard of the accrual).
    #[error("{0}; resume it with `fine-settler resume`, or pass --ignore-pause to run anyway")]
    Paused(Pause),
}

/// Why a connected one-shot run does not start.
enum NotAdmitted {
    /// Refused: the business date is not over, or a pause covers the key.
    Refused(Refused),
    /// The clock or the pauses could not be read (the report's detail).
    Error(String),
}

/// `runner`, if `key`'s business date is over and no pause covers `key` — or, with `ignore_pause`, a runner that
/// also goes on through a pause set while it runs. A refused runner's pool is closed.
async fn admitted(
    settings: &Settings,
    runner: Runner,
    key: RunKey,
    ignore_pause: bool,
) -> Result<Runner, NotAdmitted> {
    let refused = match over(settings, &runner.pool, key).await {
        Err(refused) => refused,
        Ok(()) if ignore_pause => return Ok(runner.ignoring_pauses()),
        Ok(()) => match store::pauses::covering(&runner.pool, key.job, key.shard).await {
            Ok(None) => return Ok(runner),
            Ok(Some(pause)) => NotAdmitted::Refused(Refused::Paused(pause)),
            Err(e) => {
                let e = StoreError::from(e);
                tracing::error!(error = %e, "cannot tell whether the job is paused");
                NotAdmitted::Error(e.to_string())
            }
        },
    };
    runner.pool.close().await;
    Err(refused)
}

/// Whether `key`'s business date is over by the configured clock (the database's by default, as for the
/// daemon): a day is accrued, and a month settled, once it is over — a month end from the next day on. A run
/// before that would record a SUCCESS key for a date still open, which the daemon would then skip.
async fn over(settings: &Settings, pool: &Db, key: RunKey) -> Result<(), NotAdmitted> {
    let now = match settings.time_source {
        TimeSource::System => Ok(Utc::now()),
        TimeSource::Database => store::database_now(pool).await,
    };
    let today = match now {
        Ok(now) => calendar::local_date(now, settings.zone),
        Err(e) => {
            let e = StoreError::from(e);
            tracing::error!(error = %e, "cannot read the database clock");
            return Err(NotAdmitted::Error(e.to_string()));
        }
    };
    if key.business_date >= today {
        return Err(NotAdmitted::Refused(Refused::NotOver(NotOver {
            job: key.job,
            date: key.business_date,
            today,
            zone: settings.zone.name(),
        })));
    }
    Ok(())
}

/// Settles one key (`settle`); refused for a month that is not over yet and, unless `options.ignore_pause`,
/// while a pause covers it (with it, the run also goes on through a pause set while it runs).
pub async fn settle(settings: &Settings, key: RunKey, options: Options) -> Result<RunReport, Refused> {
    let started = tokio::time::Instant::now();
    let batch_size = settings.settlement.batch_size;
    let runner = match one_shot_runner(settings, key, batch_size, options.shutdown).await {
        Ok(runner) => runner,
        Err(e) => return Ok(not_started(key, started, e)),
    };
    let runner = match admitted(settings, runner, key, options.ignore_pause).await {
        Ok(runner) => runner,
        Err(NotAdmitted::Refused(refused)) => return Err(refused),
        Err(NotAdmitted::Error(e)) => return Ok(not_started(key, started, e)),
    };
    let settlement = Settlement::new();
    let bar = bar_for(settings, &runner, key, options.bars).await;
    let runner = match &bar {
        Some(bar) => runner.with_progress(bar.rows_hook()),
        None => runner,
    };
    let report = runner.run(&settlement, key, options.force).await;
    drop(bar);
    runner.pool.close().await;
    Ok(report)
}

/// The report of `accrue`: the run's, plus what the compensation pass did and the shard's queue.
#[derive(Debug, serde::Serialize)]
pub struct AccrualReport {
    #[serde(flatten)]
    pub run: RunReport,
    /// Pending charges of this shard written by the compensation pass before the run.
    pub compensated: u64,
    /// Why the compensation pass failed, if it did (the run went ahead).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compensation_error: Option<String>,
    /// This shard's PENDING charges after the run.
    pub pending: Option<i64>,
    /// This shard's DEAD charges after the run.
    pub dead: Option<i64>,
}

/// The business date asked for is not over yet; nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{date} is not before today ({today} in {zone}); {}", once_over(*.job))]
pub struct NotOver {
    pub job: JobName,
    pub date: chrono::NaiveDate,
    pub today: chrono::NaiveDate,
    pub zone: &'static str,
}

/// When `job` runs a business date.
fn once_over(job: JobName) -> &'static str {
    match job {
        JobName::FineSettlement => "a month is settled once it is over",
        JobName::OverdueAccrual => "a day is accrued once it is over",
    }
}

impl NotOver {
    /// The command line's flag that named the date (`settle --business-date`, `accrue --date`).
    pub fn flag(&self) -> &'static str {
        match self.job {
            JobName::FineSettlement => "--business-date",
            JobName::OverdueAccrual => "--date",
        }
    }
}

/// Accrues one day for one shard (`accrue`), after retrying the shard's due pending charges. Refuses a day that
/// is not over yet by the configured clock (the database's by default, as for the daemon), and, unless
/// `options.ignore_pause`, a paused key (before the compensation pass: nothing is written).
pub async fn accrue(settings: &Settings, key: RunKey, options: Options) -> Result<AccrualReport, Refused> {
    let started = tokio::time::Instant::now();
    let not_started = |e: String| AccrualReport {
        run: not_started(key, started, e),
        compensated: 0,
        compensation_error: None,
        pending: None,
        dead: None,
    };
    let batch_size = settings.accrual.batch_size;
    let runner = match one_shot_runner(settings, key, batch_size, options.shutdown).await {
        Ok(runner) => runner,
        Err(e) => return Ok(not_started(e)),
    };
    let mut runner = match admitted(settings, runner, key, options.ignore_pause).await {
        Ok(runner) => runner,
        Err(NotAdmitted::Refused(refused)) => return Err(refused),
        Err(NotAdmitted::Error(e)) => return Ok(not_started(e)),
    };
    runner.batch_size = store::lock_table::fit_accrual_batch(&runner.pool, batch_size, 1).await;
    let job = Accrual::from_settings(settings);
    let max_attempts = settings.accrual.max_attempts;
    // The pass writes charges: not while a standby lags (as a batch would wait).
    runner
        .throttle
        .before_compensation(&runner.pool, &runner.cancel)
        .await;
    // A failing compensation pass (a missing grant, a broken trigger) does not keep the day from being accrued.
    let compensation = compensate(&runner.pool, &job, Some(key.shard), true, max_attempts)
        .await
        .map_err(|e| {
            let e = StoreError::from(e);
            tracing::error!(error = %e, "compensation pass failed; accruing the day anyway");
            e.to_string()
        });
    let bar = bar_for(settings, &runner, key, options.bars).await;
    let runner = match &bar {
        Some(bar) => runner.with_progress(bar.rows_hook()),
        None => runner,
    };
    let run = runner.run(&job, key, options.force).await;
    drop(bar);
    let counts = store::ledger::counts(&runner.pool, Some(key.shard)).await.ok();
    runner.pool.close().await;
    Ok(AccrualReport {
        run,
        compensated: compensation.as_ref().map_or(0, |c| c.charged),
        compensation_error: compensation.err(),
        pending: counts.map(|c| c.0),
        dead: counts.map(|c| c.1),
    })
}

/// What `pending retry` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RetryReport {
    /// DEAD charges given a fresh set of attempts first (`--dead`).
    pub resurrected: u64,
    pub charged: u64,
    pub not_owed: u64,
    /// Held back by the cap while other days of the loan hold more than they owe: left to the re-check.
    pub held_back: u64,
    pub retried: u64,
    /// Charges that used their last attempt in this pass.
    pub dead_now: u64,
    /// The queue afterwards, every shard.
    pub pending: i64,
    pub dead: i64,
    /// A shutdown was asked for before the pass was through: it stopped between two charges (each charge is its
    /// own transaction, so none is left half done). Printed only when true.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub interrupted: bool,
}

impl RetryReport {
    /// The process's exit code: 1 if the pass was interrupted (the rest waits for the next pass), else 0.
    pub fn exit_code(&self) -> u8 {
        u8::from(self.interrupted)
    }
}

/// Why `pending retry` may not run: a pause of the accrual, of the whole job or of any one shard (the whole
/// job's first) — the pass retries every shard's charges, so it would write for a paused shard, which the daemon's
/// own pass never does. `None` when the accrual is not paused anywhere.
pub async fn retry_refused(pool: &Db) -> Result<Option<Refused>, StoreError> {
    let pauses = store::pauses::list(pool, Some(JobName::OverdueAccrual.as_str())).await?;
    Ok(pauses.into_iter().next().map(Refused::Paused))
}

/// Retries every PENDING charge of every shard now, whatever its next attempt time (`pending retry`); with
/// `dead`, DEAD charges get a fresh set of attempts first. With `bars`, a bar over the pending charges. Once
/// `shutdown` is cancelled the pass stops before its next charge.
pub async fn retry_pending(
    settings: &Settings,
    pool: &Db,
    dead: bool,
    bars: bool,
    shutdown: CancellationToken,
) -> Result<RetryReport, StoreError> {
    store::policies::seed_default_by(pool, &settings.fine, "pending retry").await?;
    let resurrected = if dead {
        store::ledger::resurrect(pool).await?
    } else {
        0
    };
    let job = Accrual::from_settings(settings);
    let bar = if bars {
        let (pending, _) = store::ledger::counts(pool, None).await?;
        Some(Bar::new(
            "pending retry",
            u64::try_from(pending).unwrap_or(0),
            "charges",
        ))
    } else {
        None
    };
    Throttle::new(settings.throttle.clone())
        .before_compensation(pool, &shutdown)
        .await;
    let limits = PassLimits {
        cancel: Some(shutdown.clone()),
        progress: bar.as_ref().map(Bar::rows_hook),
        ..PassLimits::default()
    };
    let Compensation {
        charged,
        not_owed,
        held_back,
        retried,
        dead: dead_now,
        stopped_early: interrupted,
    } = compensate_within(pool, &job, None, false, settings.accrual.max_attempts, &limits).await?;
    drop(bar);
    let (pending, dead) = store::ledger::counts(pool, None).await?;
    Ok(RetryReport {
        resurrected,
        charged,
        not_owed,
        held_back,
        retried,
        dead_now,
        pending,
        dead,
        interrupted,
    })
}
