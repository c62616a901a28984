//! `backfill`: run every business date of a job in a range × every shard through the same runner as the daemon
//! and `settle` / `accrue`, oldest first, K keys at a time in one process — the way to catch up on dates that
//! fell out of the catch-up window (every replica down for a quarter). `--dry-run` reads what each key would
//! do and how many rows it would touch, and writes nothing.
//!
//! Which keys run (`--reprocess`): `missing` runs every key in [`ClaimMode::Free`], so absent, FAILED and expired
//! keys are claimed or taken over, a SUCCESS key with late rows is re-opened by the runner, and a SUCCESS key
//! with nothing left is skipped; `failed` only the keys that are FAILED; `all` every key in
//! [`ClaimMode::Force`], as `settle --force` does (rows already settled or charged are never changed). A key a
//! live owner holds is skipped in every mode: a claim never displaces a live owner.

use std::sync::atomic::{AtomicBool, Ordering};

use chrono::{Datelike, Months, NaiveDate, Utc};
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use super::{
    accrual::{compensate_within, Accrual, PassLimits},
    runner::{process_owner, BatchJob, JobError, Runner},
    settlement::Settlement,
    JobName, Outcome, RunKey, RunReport,
};
use crate::{
    calendar,
    config::{Settings, TimeSource},
    progress::Bar,
    shard::ShardSpec,
    store::{
        self,
        job_runs::{self, ClaimMode, RangeKey, RunStatus},
        ledger, loans, lock_table,
        pauses::Pause,
        Db, StoreError,
    },
};

/// The most business dates one backfill takes (a year of days; the range is split beyond that).
pub const MAX_DATES: usize = 366;
/// The most keys one backfill runs at a time.
pub const MAX_CONCURRENCY: usize = 32;

/// Which keys of the range a backfill runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reprocess {
    /// Keys absent or not SUCCESS, and SUCCESS keys with late rows (the default).
    Missing,
    /// Only FAILED keys.
    Failed,
    /// Every key; SUCCESS ones are re-run as `--force` does.
    All,
}

impl Reprocess {
    pub fn parse(s: &str) -> Option<Self> {
        [Reprocess::Missing, Reprocess::Failed, Reprocess::All]
            .into_iter()
            .find(|r| r.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Reprocess::Missing => "missing",
            Reprocess::Failed => "failed",
            Reprocess::All => "all",
        }
    }

    /// How a key whose row has `status` (`None`: no row) is claimed, or `None` if this backfill leaves it.
    fn mode(self, status: Option<RunStatus>) -> Option<ClaimMode> {
        match self {
            Reprocess::Missing => Some(ClaimMode::Free),
            Reprocess::Failed => (status == Some(RunStatus::Failed)).then_some(ClaimMode::Free),
            Reprocess::All => Some(ClaimMode::Force),
        }
    }
}

/// Why a backfill did not run.
#[derive(Debug, thiserror::Error)]
pub enum BackfillError {
    /// Bad arguments (the flag and what is wrong with it); nothing was written.
    #[error("{flag}: {problem}")]
    Usage { flag: &'static str, problem: String },
    /// The database failed before any key ran.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A dry run could not read what a key would do.
    #[error(transparent)]
    Job(#[from] JobError),
    /// A pause covers some of the keys (`fine-settler pause`); nothing ran.
    #[error("{0}; resume it with `fine-settler resume`, or pass --ignore-pause to run anyway")]
    Paused(Pause),
}

impl From<sqlx::Error> for BackfillError {
    fn from(e: sqlx::Error) -> Self {
        BackfillError::Store(StoreError::Sql(e))
    }
}

fn usage(flag: &'static str, problem: String) -> BackfillError {
    BackfillError::Usage { flag, problem }
}

/// A backfill as asked for on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub job: JobName,
    pub from: NaiveDate,
    pub to: NaiveDate,
    /// The shard count whose every shard runs.
    pub shards: i64,
    pub reprocess: Reprocess,
    /// How many keys run at a time.
    pub concurrency: i64,
    /// Run even where a pause covers the keys (and through a pause set meanwhile).
    pub ignore_pause: bool,
}

/// A checked backfill: its business dates (oldest first), shard count and concurrency.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backfill {
    pub request: Request,
    pub dates: Vec<NaiveDate>,
    pub shards: i32,
    pub concurrency: usize,
}

/// The business dates of `job` in `[from, to]`, oldest first: every day for accrual; for settlement the month
/// ends that lie in the range — a month counts when its last day does, so `--to 2026-12-15` stops at November.
/// At most [`MAX_DATES`].
pub fn business_dates(job: JobName, from: NaiveDate, to: NaiveDate) -> Result<Vec<NaiveDate>, BackfillError> {
    for (flag, date) in [("--from", from), ("--to", to)] {
        if !(1..=9999).contains(&date.year()) {
            return Err(usage(flag, format!("{date} is out of range (years 1 to 9999)")));
        }
    }
    if from > to {
        return Err(usage("--from", format!("{from} is after --to ({to})")));
    }
    let too_many = |n: i64| {
        usage(
            "--from/--to",
            format!(
                "{from} to {to} holds {n} business dates of {job}; a backfill takes at most {MAX_DATES}, \
                 split the range"
            ),
        )
    };
    let dates: Vec<NaiveDate> = match job {
        JobName::OverdueAccrual => {
            let n = (to - from).num_days() + 1;
            if n > MAX_DATES as i64 {
                return Err(too_many(n));
            }
            from.iter_days().take(n as usize).collect()
        }
        JobName::FineSettlement => {
            // Every month from `from`'s to the one before `to`'s has its end in the range, and `to`'s if `to`
            // is its last day.
            let months =
                i64::from(to.year() - from.year()) * 12 + i64::from(to.month()) - i64::from(from.month());
            let n = months + i64::from(to == calendar::month_end(to));
            if n > MAX_DATES as i64 {
                return Err(too_many(n));
            }
            let mut dates = Vec::new();
            let mut month = calendar::month_start(from);
            while month <= to {
                let end = calendar::month_end(month);
                if (from..=to).contains(&end) {
                    dates.push(end);
                }
                match month.checked_add_months(Months::new(1)) {
                    Some(next) => month = next,
                    None => break,
                }
            }
            dates
        }
    };
    if dates.is_empty() {
        return Err(usage(
            "--from/--to",
            format!(
                "no month end between {from} and {to}: a month is backfilled when its last day is in the range"
            ),
        ));
    }
    Ok(dates)
}

/// Checks a request against the configuration, without the database: its dates, its shard count and its
/// concurrency — each run needs one connection at a time, so K runs need K of `database.max_connections` (on
/// Citus a settlement batch writes its parts beside it on more, when they are free: `jobs/runner/beside.rs`).
pub fn prepare(settings: &Settings, request: Request) -> Result<Backfill, BackfillError> {
    let shards = ShardSpec::new(0, request.shards)
        .map_err(|e| usage("--shards", e.to_string()))?
        .shards();
    let concurrency = usize::try_from(request.concurrency)
        .ok()
        .filter(|k| (1..=MAX_CONCURRENCY).contains(k))
        .ok_or_else(|| {
            usage(
                "--concurrency",
                format!(
                    "must be between 1 and {MAX_CONCURRENCY}, got {}",
                    request.concurrency
                ),
            )
        })?;
    let connections = settings.database.max_connections as usize;
    if concurrency > connections {
        return Err(usage(
            "--concurrency",
            format!(
                "{concurrency} runs at a time need {concurrency} connections, but database.max_connections is \
                 {connections}; raise it (FINE_SETTLER__DATABASE__MAX_CONNECTIONS={concurrency}) or lower \
                 --concurrency"
            ),
        ));
    }
    let dates = business_dates(request.job, request.from, request.to)?;
    Ok(Backfill {
        request,
        dates,
        shards,
        concurrency,
    })
}

/// What a dry run says a key would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DryAction {
    /// No row: the run inserts it.
    Claim,
    /// FAILED, or RUNNING with an expired lease: the run takes it over.
    Takeover,
    /// SUCCESS with rows still to do: the run re-opens it.
    Reopen,
    /// SUCCESS, re-run from the beginning (`--reprocess all`).
    Force,
    /// Not run: SUCCESS with nothing left, held by a live owner, or not selected by `--reprocess`.
    Skip,
}

/// One line of a dry run.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DryKey {
    pub job: &'static str,
    pub business_date: NaiveDate,
    pub shards: i32,
    pub shard: i32,
    /// The key's status, `None` when it has no row.
    pub status: Option<RunStatus>,
    pub action: DryAction,
    /// The rows the run would touch: loans to settle, or loans to charge (0 for a key that would not run).
    pub rows: i64,
    /// The ledger corrections the run would append (accrual only; 0 otherwise).
    pub corrections: i64,
}

/// The last line of a dry run.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DrySummary {
    pub summary: bool,
    pub dry_run: bool,
    pub job: &'static str,
    pub from: NaiveDate,
    pub to: NaiveDate,
    pub shards: i32,
    pub reprocess: Reprocess,
    pub keys: usize,
    /// Keys that would run (not `skip`).
    pub to_run: usize,
    pub rows: i64,
    pub corrections: i64,
    /// The pauses that cover keys of the backfill (a real run refuses to start unless `--ignore-pause`), as
    /// `runs --json` prints them.
    pub paused: Vec<serde_json::Value>,
}

/// The last line of a backfill.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Summary {
    pub summary: bool,
    pub dry_run: bool,
    pub job: &'static str,
    pub from: NaiveDate,
    pub to: NaiveDate,
    pub shards: i32,
    pub reprocess: Reprocess,
    pub concurrency: usize,
    pub keys: usize,
    /// Keys `--reprocess failed` left alone (not FAILED).
    pub not_selected: usize,
    pub settled: usize,
    pub skipped: usize,
    pub failed: usize,
    pub lease_lost: usize,
    /// Keys not started because of a shutdown request.
    pub not_started: usize,
    pub updated: i64,
    /// Pending charges written by the compensation passes (accrual).
    pub compensated: u64,
    /// Compensation passes that failed (the days were accrued anyway).
    pub compensation_errors: usize,
    /// A shutdown request stopped the backfill.
    pub interrupted: bool,
    /// A pause set while the backfill ran stopped it (the keys not started are `not_started`).
    pub paused: bool,
    pub elapsed_ms: u64,
}

impl Summary {
    /// 0 when every key settled or was skipped, 1 otherwise (a failure, a lost lease, an interruption).
    pub fn exit_code(&self) -> u8 {
        let incomplete = self.failed + self.lease_lost + self.not_started > 0 || self.interrupted;
        u8::from(incomplete)
    }
}

/// The job of a backfill (or of a one-shot run's progress bar), for the calls that are not generic.
pub(super) enum Job {
    Settlement(Settlement),
    Accrual(Accrual),
}

impl Job {
    pub(super) fn of(settings: &Settings, name: JobName) -> Self {
        match name {
            JobName::FineSettlement => Job::Settlement(Settlement::new()),
            JobName::OverdueAccrual => Job::Accrual(Accrual::from_settings(settings)),
        }
    }

    async fn run(&self, runner: &Runner, key: RunKey, mode: ClaimMode) -> RunReport {
        match self {
            Job::Settlement(j) => runner.run_as(j, key, mode).await,
            Job::Accrual(j) => runner.run_as(j, key, mode).await,
        }
    }

    /// The runner's re-open question for a SUCCESS key, asked the way the runner asks it.
    async fn late(&self, pool: &Db, key: &RunKey) -> Result<bool, JobError> {
        match self {
            Job::Settlement(j) => j.late(pool, key).await,
            Job::Accrual(j) => j.late(pool, key).await,
        }
    }

    /// The rows a run of `key` would touch, walking from `from_id` (`None`: nothing after its cursor), and the
    /// ledger corrections it would append.
    pub(super) async fn rows(
        &self,
        pool: &Db,
        key: &RunKey,
        from_id: Option<i64>,
    ) -> Result<(i64, i64), JobError> {
        let Some(from_id) = from_id else { return Ok((0, 0)) };
        match self {
            Job::Settlement(_) => {
                let month = calendar::settlement_month(key.business_date)?;
                Ok((loans::count_unsettled(pool, month, key.shard, from_id).await?, 0))
            }
            Job::Accrual(_) => Ok(ledger::count_work(pool, key.business_date, key.shard, from_id).await?),
        }
    }
}

/// The pool of a backfill, once the range is known to be over by the configured clock (the database's by
/// default, as for the daemon): a business date is run once it is over — a month end from the next day on, like
/// an accrual day.
pub async fn connect(settings: &Settings, backfill: &Backfill) -> Result<Db, BackfillError> {
    let pool = store::connect(
        &settings.database,
        &format!("fine-settler backfill {}", backfill.request.job),
        settings.claim.lease.batch_timeout(),
    )
    .await?;
    let now = match settings.time_source {
        TimeSource::System => Ok(Utc::now()),
        TimeSource::Database => store::database_now(&pool).await,
    };
    let now = match now {
        Ok(now) => now,
        Err(e) => {
            pool.close().await;
            return Err(e.into());
        }
    };
    let today = calendar::local_date(now, settings.zone);
    let last = backfill.dates.last().copied().unwrap_or(NaiveDate::MIN);
    if last >= today {
        pool.close().await;
        return Err(usage(
            "--to",
            format!(
                "{last} is not over yet (today is {today} in {}); a business date is run once it is over",
                settings.zone.name()
            ),
        ));
    }
    Ok(pool)
}

/// The keys of the backfill, oldest date first, shards in order, each with its row's state (if any).
async fn keys(pool: &Db, backfill: &Backfill) -> Result<Vec<(RunKey, Option<RangeKey>)>, BackfillError> {
    let (job, shards) = (backfill.request.job, backfill.shards);
    let (first, last) = match (backfill.dates.first(), backfill.dates.last()) {
        (Some(f), Some(l)) => (*f, *l),
        _ => return Ok(Vec::new()),
    };
    let mut rows: std::collections::HashMap<(NaiveDate, i32), RangeKey> =
        job_runs::range(pool, job.as_str(), (first, last), shards)
            .await?
            .into_iter()
            .map(|r| ((r.business_date, r.shard), r))
            .collect();
    let mut keys = Vec::with_capacity(backfill.dates.len() * shards as usize);
    for &business_date in &backfill.dates {
        for shard in 0..shards {
            let spec = ShardSpec::new(i64::from(shard), i64::from(shards))
                .map_err(|e| usage("--shards", e.to_string()))?;
            let state = rows.remove(&(business_date, shard));
            keys.push((
                RunKey {
                    job,
                    business_date,
                    shard: spec,
                },
                state,
            ));
        }
    }
    Ok(keys)
}

/// The pauses in force that stop some shard of the backfill's shard count.
async fn pauses(pool: &Db, backfill: &Backfill) -> Result<Vec<Pause>, sqlx::Error> {
    let shards: Vec<ShardSpec> = (0..backfill.shards)
        .filter_map(|s| ShardSpec::new(i64::from(s), i64::from(backfill.shards)).ok())
        .collect();
    Ok(
        crate::store::pauses::list(pool, Some(backfill.request.job.as_str()))
            .await?
            .into_iter()
            .filter(|p| shards.iter().any(|s| p.scope.covers(*s)))
            .collect(),
    )
}

/// `--dry-run`: one line per key (through `emit`, oldest first) with its status, what a run would do and how
/// many rows it would touch; then the summary. Reads only.
pub async fn dry_run(
    settings: &Settings,
    backfill: &Backfill,
    pool: &Db,
    mut emit: impl FnMut(&DryKey),
) -> Result<DrySummary, BackfillError> {
    let request = backfill.request;
    let job = Job::of(settings, request.job);
    let keys = keys(pool, backfill).await?;
    let (mut to_run, mut total, mut corrections) = (0usize, 0i64, 0i64);
    for (key, state) in &keys {
        let status = state.as_ref().map(|s| s.status);
        let action = match (request.reprocess.mode(status), state) {
            (None, _) => DryAction::Skip,
            (Some(_), None) => DryAction::Claim,
            (Some(mode), Some(s)) => match s.status {
                // A free claim skips a SUCCESS key; the runner re-opens it if the job finds late rows.
                RunStatus::Success if mode == ClaimMode::Free => {
                    if job.late(pool, key).await? {
                        DryAction::Reopen
                    } else {
                        DryAction::Skip
                    }
                }
                // What the claim would take (a live owner is never displaced): a forced claim walks the whole key.
                _ if !s.taken_by(mode) => DryAction::Skip,
                _ if mode == ClaimMode::Force => DryAction::Force,
                _ => DryAction::Takeover,
            },
        };
        // A takeover resumes after the key's cursor, as the runner does; the other claims walk the whole key.
        let from_id = match (action, state) {
            (DryAction::Takeover, Some(RangeKey { cursor: Some(c), .. })) => c.checked_add(1),
            _ => Some(i64::MIN),
        };
        let (rows, corrected) = match action {
            DryAction::Skip => (0, 0),
            _ => job.rows(pool, key, from_id).await?,
        };
        if action != DryAction::Skip {
            to_run += 1;
            total += rows;
            corrections += corrected;
        }
        emit(&DryKey {
            job: request.job.as_str(),
            business_date: key.business_date,
            shards: key.shard.shards(),
            shard: key.shard.shard(),
            status,
            action,
            rows,
            corrections: corrected,
        });
    }
    Ok(DrySummary {
        summary: true,
        dry_run: true,
        job: request.job.as_str(),
        from: request.from,
        to: request.to,
        shards: backfill.shards,
        reprocess: request.reprocess,
        keys: keys.len(),
        to_run,
        rows: total,
        corrections,
        paused: pauses(pool, backfill).await?.iter().map(Pause::json).collect(),
    })
}

/// The real run: for accrual, each shard's compensation pass first (as `accrue` does); then every selected key
/// through the runner, `concurrency` at a time, started oldest first, each report passed to `emit` as the runs
/// complete (in key order). On `cancel` the runs in flight finish their current batch and hand their keys back
/// (FAILED, lease ended), no further key starts, and the summary says so.
pub async fn run(
    settings: &Settings,
    backfill: &Backfill,
    pool: Db,
    cancel: CancellationToken,
    bars: bool,
    emit: impl FnMut(&RunReport),
) -> Result<Summary, BackfillError> {
    let started = tokio::time::Instant::now();
    let request = backfill.request;
    if !request.ignore_pause {
        // Refused before anything is written (the compensation pass included), as `settle`/`accrue` are.
        if let Some(pause) = pauses(&pool, backfill).await?.into_iter().next() {
            return Err(BackfillError::Paused(pause));
        }
    }
    let job = Job::of(settings, request.job);
    let keys = keys(&pool, backfill).await?;
    let selected: Vec<(RunKey, ClaimMode)> = keys
        .iter()
        .filter_map(|(key, state)| {
            request
                .reprocess
                .mode(state.as_ref().map(|s| s.status))
                .map(|mode| (*key, mode))
        })
        .collect();
    let mut summary = Summary::new(backfill, keys.len(), selected.len());
    if let Job::Accrual(accrual) = &job {
        compensate_shards(settings, accrual, &pool, &selected, &cancel, &mut summary).await;
    }
    let bar = if bars {
        Some(bar(&job, &pool, request.job, &selected).await)
    } else {
        None
    };
    let mut runner = runner(settings, request, &pool, &cancel, bar.as_ref());
    if let Job::Accrual(_) = &job {
        let at_once = u32::try_from(backfill.concurrency).unwrap_or(u32::MAX);
        runner.batch_size = lock_table::fit_accrual_batch(&pool, runner.batch_size, at_once).await;
    }
    summary.paused = run_keys(&runner, &job, selected, backfill.concurrency, &mut summary, emit).await;
    summary.interrupted = cancel.is_cancelled();
    summary.elapsed_ms = started.elapsed().as_millis() as u64;
    pool.close().await;
    Ok(summary)
}

impl Summary {
    /// The summary of `backfill` before anything ran: `keys` in its range, `selected` of them to run.
    fn new(backfill: &Backfill, keys: usize, selected: usize) -> Self {
        let request = backfill.request;
        Summary {
            summary: true,
            dry_run: false,
            job: request.job.as_str(),
            from: request.from,
            to: request.to,
            shards: backfill.shards,
            reprocess: request.reprocess,
            concurrency: backfill.concurrency,
            keys,
            not_selected: keys - selected,
            settled: 0,
            skipped: 0,
            failed: 0,
            lease_lost: 0,
            not_started: 0,
            updated: 0,
            compensated: 0,
            compensation_errors: 0,
            interrupted: false,
            paused: false,
            elapsed_ms: 0,
        }
    }

    /// Counts a key's run.
    fn count(&mut self, report: &RunReport) {
        match report.outcome {
            Outcome::Settled => self.settled += 1,
            Outcome::Skipped => self.skipped += 1,
            Outcome::Failed => self.failed += 1,
            Outcome::LeaseLost => self.lease_lost += 1,
        }
        self.updated += report.updated;
    }
}

/// The compensation pass of each shard of the selected keys, before its days, as `accrue` does: a charge that
/// failed on an earlier day is retried before the days after it are charged (the cap counts it). A failing pass
/// does not keep the days back.
async fn compensate_shards(
    settings: &Settings,
    accrual: &Accrual,
    pool: &Db,
    selected: &[(RunKey, ClaimMode)],
    cancel: &CancellationToken,
    summary: &mut Summary,
) {
    let mut shards: Vec<ShardSpec> = selected.iter().map(|(k, _)| k.shard).collect();
    shards.sort_by_key(|s| s.shard());
    shards.dedup();
    let limits = PassLimits {
        cancel: Some(cancel.clone()),
        ..PassLimits::default()
    };
    for shard in shards {
        match compensate_within(
            pool,
            accrual,
            Some(shard),
            true,
            settings.accrual.max_attempts,
            &limits,
        )
        .await
        {
            Ok(c) => summary.compensated += c.charged,
            Err(e) => {
                let e = StoreError::from(e);
                tracing::error!(error = %e, shard = shard.shard(),
                    "compensation pass failed; accruing the days anyway");
                summary.compensation_errors += 1;
            }
        }
    }
}

/// One bar over every selected key's rows, counted once before the runs start.
async fn bar(job: &Job, pool: &Db, name: JobName, selected: &[(RunKey, ClaimMode)]) -> Bar {
    let mut total = 0;
    for (key, _) in selected {
        let (rows, corrections) = job.rows(pool, key, Some(i64::MIN)).await.unwrap_or((0, 0));
        total += rows + corrections;
    }
    let what = format!("backfill {name} ({} keys)", selected.len());
    Bar::new(&what, u64::try_from(total).unwrap_or(0), "rows")
}

/// The runner of a backfill's keys: a fresh owner, the job's batch size, the process's throttle, going on through
/// pauses if asked to, and telling `bar` its rows.
fn runner(
    settings: &Settings,
    request: Request,
    pool: &Db,
    cancel: &CancellationToken,
    bar: Option<&Bar>,
) -> Runner {
    let batch_size = match request.job {
        JobName::FineSettlement => settings.settlement.batch_size,
        JobName::OverdueAccrual => settings.accrual.batch_size,
    };
    let runner = Runner::new(
        pool.clone(),
        process_owner(),
        &settings.claim,
        batch_size,
        cancel.clone(),
    )
    .with_throttle(super::throttle::Throttle::new(settings.throttle.clone()));
    let runner = if request.ignore_pause {
        runner.ignoring_pauses()
    } else {
        runner
    };
    // Several runs at once share the pool: each needs its connection, which a part beside another's batch
    // would take.
    let runner = if request.concurrency > 1 {
        runner.with_parts_in_batch()
    } else {
        runner
    };
    match bar {
        Some(bar) => runner.with_progress(bar.rows_hook()),
        None => runner,
    }
}

/// Runs the selected keys, `concurrency` at a time, each report counted in `summary` and passed to `emit`;
/// whether a run found the job paused.
///
/// `buffered` polls at most `concurrency` runs at once, started in key order (oldest date first), and yields
/// their reports in that order. A run not yet started when the shutdown comes does not claim its key. Once a run
/// finds the job paused (at its fence: the pause came while the backfill ran), no further key starts either, as
/// after a shutdown request.
async fn run_keys(
    runner: &Runner,
    job: &Job,
    selected: Vec<(RunKey, ClaimMode)>,
    concurrency: usize,
    summary: &mut Summary,
    mut emit: impl FnMut(&RunReport),
) -> bool {
    let paused = AtomicBool::new(false);
    let paused_ref = &paused;
    let mut reports = futures_util::stream::iter(selected)
        .map(|(key, mode)| async move {
            if runner.cancel.is_cancelled() || paused_ref.load(Ordering::SeqCst) {
                return None;
            }
            let report = job.run(runner, key, mode).await;
            if report.paused {
                paused_ref.store(true, Ordering::SeqCst);
            }
            Some(report)
        })
        .buffered(concurrency);
    while let Some(report) = reports.next().await {
        match report {
            None => summary.not_started += 1,
            Some(report) => {
                summary.count(&report);
                emit(&report);
            }
        }
    }
    drop(reports);
    paused.load(Ordering::SeqCst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> NaiveDate {
        s.parse().expect("test date")
    }

    fn dates(job: JobName, from: &str, to: &str) -> Result<Vec<String>, String> {
        business_dates(job, d(from), d(to))
            .map(|v| v.iter().map(ToString::to_string).collect())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn settlement_takes_the_month_ends_inside_the_range() {
        assert_eq!(
            dates(JobName::FineSettlement, "2026-07-15", "2026-10-31").expect("dates"),
            ["2026-07-31", "2026-08-31", "2026-09-30", "2026-10-31"]
        );
        // A --to that is not a month end leaves its month out.
        assert_eq!(
            dates(JobName::FineSettlement, "2026-01-01", "2026-03-30").expect("dates"),
            ["2026-01-31", "2026-02-28"]
        );
        assert_eq!(
            dates(JobName::FineSettlement, "2024-02-29", "2024-02-29").expect("dates"),
            ["2024-02-29"]
        );
    }

    #[test]
    fn accrual_takes_every_day() {
        assert_eq!(
            dates(JobName::OverdueAccrual, "2026-02-27", "2026-03-01").expect("dates"),
            ["2026-02-27", "2026-02-28", "2026-03-01"]
        );
    }

    #[test]
    fn bad_ranges_name_the_flag() {
        let e = dates(JobName::OverdueAccrual, "2026-03-02", "2026-03-01").expect_err("rejected");
        assert!(e.starts_with("--from: 2026-03-02 is after --to"), "{e}");
        let e = dates(JobName::FineSettlement, "2026-03-02", "2026-03-30").expect_err("rejected");
        assert!(e.starts_with("--from/--to: no month end"), "{e}");
        let e = dates(JobName::OverdueAccrual, "2025-01-01", "2026-01-02").expect_err("rejected");
        assert!(
            e.contains("holds 367 business dates of overdue-accrual; a backfill takes at most 366"),
            "{e}"
        );
        assert!(dates(JobName::OverdueAccrual, "2025-01-01", "2025-12-31").is_ok());
        let e = dates(JobName::FineSettlement, "0001-01-01", "9999-12-31").expect_err("rejected");
        assert!(e.contains("at most 366"), "{e}");
    }
}
