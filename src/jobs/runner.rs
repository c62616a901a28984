//! The one mechanism every job runs on: claim a key, walk its rows in fenced keyset batches, finish.
//!
//! A job supplies how to find the next batch after a cursor and how to write it (conditionally:
//! a row already done is never changed again). The runner supplies everything that makes a run safe to repeat:
//! the claim, one transaction per batch whose last statement is the epoch fence, the cursor checkpoint, the
//! lease renewal by progress, the finish, and the history. A batch whose fence matches no row rolls back, so a
//! replica that lost its claim commits nothing more.

use std::{future::Future, hash::BuildHasher, sync::Arc, time::Duration};

use sqlx::PgConnection;

use crate::store::Db;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{
    throttle::{BatchSizer, Lagging, Reason, Throttle},
    Outcome, RunKey, RunReport,
};
use crate::{
    backoff::Backoff,
    calendar::CalendarError,
    config::{ClaimSettings, Lease},
    health::Heartbeat,
    metrics::{ClaimResult, Metrics},
    progress::RowsHook,
    redact::secrets_in as redact_secrets_in,
    store::{
        self,
        job_runs::{self, Claim, ClaimKind, ClaimMode, Claimant, Ending, Fence, Progress, RunStatus},
        pauses::Pause,
    },
};

/// A job the runner can drive. Its work items are identified by unique, ascending `i64` ids (the keyset
/// cursor).
pub trait BatchJob: Send + Sync {
    /// One batch of work, as `fetch` found it.
    type Batch: Send + Sync;

    /// The next batch: up to `limit` items of `key`'s work with `id >= from_id` that still need work, in
    /// ascending id order; `None` when nothing is left.
    fn fetch(
        &self,
        pool: &Db,
        key: &RunKey,
        from_id: i64,
        limit: i64,
    ) -> impl Future<Output = Result<Option<Self::Batch>, JobError>> + Send;

    /// The lowest id that may still need work (`None`: nothing left at all), asked once at the start of a run
    /// so that a run with nothing to do ends at once. By default every id may.
    fn first_id(
        &self,
        _pool: &Db,
        _key: &RunKey,
    ) -> impl Future<Output = Result<Option<i64>, JobError>> + Send {
        async { Ok(Some(i64::MIN)) }
    }

    /// Whether `key`, which is SUCCESS, still has items to do — items that became due after its run passed them
    /// (a back-dated return, a row left behind because libraryd held it locked). A plain run of such a key
    /// re-opens it. By default nothing arrives late.
    fn late(&self, _pool: &Db, _key: &RunKey) -> impl Future<Output = Result<bool, JobError>> + Send {
        async { Ok(false) }
    }

    /// The batch's last id (the next cursor) and how many items it holds.
    fn extent(batch: &Self::Batch) -> (i64, i64);

    /// Writes the batch inside the batch transaction, skipping items already done; returns how many were
    /// written.
    fn write(
        &self,
        tx: &mut PgConnection,
        key: &RunKey,
        batch: &Self::Batch,
    ) -> impl Future<Output = Result<u64, JobError>> + Send;
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The business date does not fit the job.
    #[error(transparent)]
    Calendar(#[from] CalendarError),
    /// A statement failed (connection lost, statement timeout, constraint).
    #[error("database error: {}", redact_secrets_in(&.0.to_string()))]
    Sql(#[from] sqlx::Error),
    /// A row's data cannot be processed; the run stops so that an operator can look at it.
    #[error("loan {id}: {problem}")]
    Data { id: i64, problem: String },
    /// A batch transaction did not complete in time (claim.batch_timeout).
    #[error("a batch did not complete within {}", humantime::format_duration(*.0))]
    BatchTimeout(Duration),
}

impl JobError {
    /// Whether the statement failed because the server cannot write (see [`crate::store::read_only`]).
    pub fn read_only(&self) -> bool {
        matches!(self, JobError::Sql(e) if crate::store::read_only(e))
    }

    /// Whether the connection failed rather than the statement (see [`transient`]).
    pub fn connection_lost(&self) -> bool {
        matches!(self, JobError::Sql(e) if transient(e) && !crate::store::read_only(e))
    }
}

/// Waits before each retry of a statement that ends a run, when the connection (not the statement) failed:
/// [`END_RETRIES`] retries, 125 ms doubled up to 2 s (3.9 s in all).
const END_BACKOFF: Backoff = Backoff::new(Duration::from_millis(125), Duration::from_secs(2));
const END_RETRIES: u32 = 5;

/// Whether `e` is about the connection rather than the statement — the server restarting or shutting down, a
/// broken socket, no connection to be had — so the same statement may succeed on a new connection.
pub fn transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) | sqlx::Error::PoolTimedOut => {
            true
        }
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("08") || c.starts_with("57P")),
        _ => false,
    }
}

/// Runs `statement` (one idempotent, fenced statement that ends a run), retrying it for a few seconds while the
/// failure is [`transient`]. Without this, a run cut off by a server restart would leave its key RUNNING until
/// the lease expires (delaying the takeover), and a replica thawed after a takeover could not record that it
/// lost its lease.
///
/// With several hosts in `database.url`, each retry first looks for a qualifying host again (a failover): a retry
/// finding none is not sent (it would only wait for the dead server), and one that finds the promoted standby
/// records the end of the run there, as far as the standby had replayed it.
async fn retrying<T, F, Fut>(what: &str, pool: &Db, mut statement: F) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let mut waits = END_BACKOFF.delays(END_RETRIES);
    let mut result = statement().await;
    loop {
        match result {
            Err(e) if transient(&e) => match waits.next() {
                Some(wait) => {
                    tracing::debug!(error = %JobError::from(e), what, wait_ms = wait.as_millis() as u64, "retrying");
                    tokio::time::sleep(wait).await;
                    result = match pool.follows_hosts() {
                        true => match pool.reconnect().await {
                            Ok(()) => statement().await,
                            Err(e) => Err(e),
                        },
                        false => statement().await,
                    };
                }
                None => return Err(e),
            },
            result => return result,
        }
    }
}

/// This host's name: the kernel's, else `$HOSTNAME` (systemd's ProcSubset=pid hides /proc/sys), else
/// `unknown-host`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".to_string())
}

/// A process-unique owner name: host, pid and a random part, so two processes on one host (or a restarted
/// process reusing a pid) never share an identity.
pub fn process_owner() -> String {
    let host = host_name();
    // RandomState is seeded from the OS's randomness per process: enough for a uniqueness suffix, no extra crate.
    let random = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
    format!("{host}:{}:{:08x}", std::process::id(), random as u32)
}

/// What the runner needs besides the job: where, as whom, and with which limits.
#[derive(Debug, Clone)]
pub struct Runner {
    pub pool: Db,
    pub owner: String,
    /// The lease every committed batch renews, the longest a batch transaction may take and how long a batch
    /// statement waits for a row lock.
    pub lease: Lease,
    pub batch_size: u32,
    /// Cancelled on shutdown: the run stops between batches and hands its key back.
    pub cancel: CancellationToken,
    /// Where the replica's metrics go (the daemon's), if anywhere.
    pub metrics: Option<Arc<Metrics>>,
    /// Told of the run's progress (every committed batch and lease renewal) and of its throttled waits (the
    /// daemon's heartbeat), if anything is.
    pub heartbeat: Option<Arc<Heartbeat>>,
    /// Told the rows of every committed batch (an operator's progress bar), if anything is.
    pub progress: Option<RowsHook>,
    /// Go on through a pause of the job (`--ignore-pause`); by default a run hands its key back after the
    /// batch whose fence saw the pause.
    pub ignore_pause: bool,
    /// The process's throttle (`[throttle]`), shared by its runs.
    pub throttle: Arc<Throttle>,
}

/// How often a run waiting for a lagging standby looks again.
const LAG_POLL: Duration = Duration::from_millis(250);

/// The shortest interval between lease renewals of a waiting run (a lease barely longer than the batch timeout
/// would otherwise renew in a busy loop).
const MIN_RENEW_EVERY: Duration = Duration::from_millis(100);

/// The throttle waits of one run, so that each episode is logged once: its start with the reason, its end with
/// how long it lasted. Waits for the pace follow every batch, so the pace's episode is the whole run.
#[derive(Default)]
struct Episodes {
    rate: Option<(Instant, Duration)>,
    lag: Option<Instant>,
    /// The lag check failed in this run (said once).
    lag_unreadable: bool,
}

impl Episodes {
    /// A wait for the pace begins (the episode's first is logged).
    fn rate_wait(&mut self, rate: u32) {
        if self.rate.is_none() {
            tracing::info!(
                reason = Reason::Rate.as_str(),
                max_rows_per_second = rate,
                "throttled: batches paced to throttle.max_rows_per_second"
            );
            self.rate = Some((Instant::now(), Duration::ZERO));
        }
    }

    /// Time actually slept for the pace.
    fn rate_waited(&mut self, slept: Duration) {
        if let Some((_, total)) = &mut self.rate {
            *total += slept;
        }
    }

    fn lag_start(&mut self, lagging: &Lagging, limit: Duration) {
        if self.lag.is_none() {
            tracing::warn!(reason = Reason::ReplicaLag.as_str(), standby = %lagging.standby,
                unreplayed_bytes = lagging.unreplayed_bytes,
                replay_lag_ms = lagging.replay_lag.map(|l| l.as_millis() as u64),
                behind_ms = lagging.behind.as_millis() as u64,
                max_replica_lag = %humantime::format_duration(limit),
                "throttled: a standby lags more than throttle.max_replica_lag; batches wait ({lagging})");
            self.lag = Some(Instant::now());
        }
    }

    fn lag_unreadable(&mut self, error: &JobError) {
        if !self.lag_unreadable {
            tracing::warn!(error = %error, "cannot read pg_stat_replication; this batch goes on without the replica lag limit");
            self.lag_unreadable = true;
        }
    }

    fn lag_end(&mut self, why: &str) {
        if let Some(started) = self.lag.take() {
            tracing::info!(
                reason = Reason::ReplicaLag.as_str(),
                waited_ms = started.elapsed().as_millis() as u64,
                "throttle released: {why}"
            );
        }
    }

    fn end(&mut self) {
        self.lag_end("the run ended");
        if let Some((started, waited)) = self.rate.take() {
            tracing::info!(
                reason = Reason::Rate.as_str(),
                waited_ms = waited.as_millis() as u64,
                over_ms = started.elapsed().as_millis() as u64,
                "throttle released: the run ended"
            );
        }
    }
}

enum BatchResult {
    /// Nothing left to do.
    Empty,
    /// Committed a batch ending at this id; `paused`: the fence saw a pause of the key (who, why); `took`: how
    /// long its transaction was open.
    Committed {
        last_id: i64,
        scanned: i64,
        updated: i64,
        paused: Option<(String, String)>,
        took: Duration,
    },
    /// The fence matched nothing: another replica owns the key now. Rolled back.
    Fenced,
}

enum Stop {
    Done,
    Shutdown,
    LeaseLost,
    /// A pause covers the key: handed back after the batch that saw it, with this `last_error`.
    Paused(String),
}

/// The message a run records when it hands its key back on shutdown.
pub const SHUTDOWN_ERROR: &str = "shutdown requested: stopped between batches and released for a peer";

impl Runner {
    /// A runner with the claim settings of the configuration, and no metrics.
    pub fn new(
        pool: Db,
        owner: String,
        claim: &ClaimSettings,
        batch_size: u32,
        cancel: CancellationToken,
    ) -> Self {
        Runner {
            pool,
            owner,
            lease: claim.lease,
            batch_size,
            cancel,
            metrics: None,
            heartbeat: None,
            progress: None,
            ignore_pause: false,
            throttle: Throttle::off(),
        }
    }

    /// The same runner, waiting for `throttle` before its batches.
    pub fn with_throttle(mut self, throttle: Arc<Throttle>) -> Self {
        self.throttle = throttle;
        self
    }

    /// The same runner, going on through pauses (an operator's `--ignore-pause`).
    pub fn ignoring_pauses(mut self) -> Self {
        self.ignore_pause = true;
        self
    }

    /// The same runner, reporting to `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The same runner, reporting its progress to `heartbeat`.
    pub fn with_heartbeat(mut self, heartbeat: Arc<Heartbeat>) -> Self {
        self.heartbeat = Some(heartbeat);
        self
    }

    /// The same runner, telling `progress` the rows of every committed batch.
    pub fn with_progress(mut self, progress: RowsHook) -> Self {
        self.progress = Some(progress);
        self
    }

    /// Runs `key` to completion (or until it is lost, fails or is cancelled). Never panics on a database
    /// error: every path ends in a report, and every error is logged here, once.
    pub async fn run<J: BatchJob>(&self, job: &J, key: RunKey, force: bool) -> RunReport {
        let mode = if force { ClaimMode::Force } else { ClaimMode::Free };
        self.run_as(job, key, mode).await
    }

    /// Runs `key` claimed in `mode`: `Free` re-opens a SUCCESS key only if the job finds late rows in it,
    /// `Reopen` re-opens it without asking (the caller has seen late rows), `Force` restarts it.
    pub async fn run_as<J: BatchJob>(&self, job: &J, key: RunKey, mode: ClaimMode) -> RunReport {
        let span = tracing::info_span!(
            "run",
            job = %key.job,
            business_date = %key.business_date,
            shards = key.shard.shards(),
            shard = key.shard.shard(),
            epoch = tracing::field::Empty,
            owner = %self.owner,
        );
        let started = Instant::now();
        let report = self
            .claim_and_run(job, key, mode, &span)
            .instrument(span.clone())
            .await;
        let report = RunReport {
            elapsed_ms: started.elapsed().as_millis() as u64,
            ..report
        };
        if let Some(m) = &self.metrics {
            let job = key.job;
            m.count_run(job, report.outcome);
            if report.outcome != Outcome::Skipped && report.epoch.is_some() {
                m.observe_run_duration(job, report.elapsed_ms as f64 / 1000.0);
            }
            if report.outcome == Outcome::Settled {
                let now = crate::metrics::unix_now_ms() as f64 / 1000.0;
                m.set_last_success(job, now);
            }
            if report.reopened {
                m.count_late_rows(job, report.updated);
            }
        }
        if report.reopened && report.updated > 0 {
            span.in_scope(|| match key.job {
                super::JobName::FineSettlement => {
                    tracing::info!(late_rows = report.updated, "late returns settled")
                }
                super::JobName::OverdueAccrual => {
                    tracing::info!(late_rows = report.updated, "late overdue days charged")
                }
            });
        }
        span.in_scope(|| match report.outcome {
            Outcome::Skipped => tracing::debug!(
                outcome = "skipped",
                holder_epoch = report.epoch,
                detail = report.detail.as_deref(),
                "run skipped"
            ),
            outcome => tracing::info!(
                outcome = outcome.as_str(),
                scanned = report.scanned,
                updated = report.updated,
                elapsed_ms = report.elapsed_ms,
                detail = report.detail.as_deref(),
                "run finished"
            ),
        });
        report
    }

    async fn claim_and_run<J: BatchJob>(
        &self,
        job: &J,
        key: RunKey,
        mode: ClaimMode,
        span: &tracing::Span,
    ) -> RunReport {
        let report = |outcome, epoch, scanned, updated, detail| RunReport {
            job: key.job.as_str(),
            business_date: key.business_date,
            shard: key.shard.shard(),
            shards: key.shard.shards(),
            outcome,
            epoch,
            scanned,
            updated,
            elapsed_ms: 0,
            detail,
            held_until: None,
            reopened: false,
            paused: false,
            read_only: false,
            connection_lost: false,
        };

        let mut claimed = job_runs::claim(&self.pool, &key, &self.owner, self.lease.duration(), mode).await;
        // A SUCCESS key with rows still to do is re-opened (--force and Reopen take SUCCESS anyway).
        if let Ok(Claim::Skipped(holder)) = &claimed {
            if holder.status == RunStatus::Success && mode == ClaimMode::Free {
                match job.late(&self.pool, &key).await {
                    Ok(true) => {
                        claimed = job_runs::claim(
                            &self.pool,
                            &key,
                            &self.owner,
                            self.lease.duration(),
                            ClaimMode::Reopen,
                        )
                        .await
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::error!(error = %e, "cannot tell whether the key has rows left; not re-opened");
                        return report(Outcome::Failed, None, 0, 0, Some(e.to_string()));
                    }
                }
            }
        }
        let (epoch, cursor, reopened) = match claimed {
            Ok(Claim::Won { epoch, cursor, kind }) => {
                self.count_claim(key, ClaimResult::from(kind));
                span.record("epoch", epoch);
                tracing::info!(claim = ?kind, cursor, "claimed");
                (epoch, cursor, kind == ClaimKind::Reopened)
            }
            Ok(Claim::Skipped(holder)) => {
                self.count_claim(key, ClaimResult::Skipped);
                let detail = if holder.status == RunStatus::Running {
                    format!(
                        "held by {} until {}",
                        holder.owner,
                        holder.lease_until.to_rfc3339()
                    )
                } else {
                    format!("already {}", holder.status)
                };
                return RunReport {
                    held_until: (holder.status == RunStatus::Running).then_some(holder.lease_until),
                    ..report(Outcome::Skipped, Some(holder.epoch), 0, 0, Some(detail))
                };
            }
            Err(e) => {
                let e = JobError::from(e);
                tracing::error!(error = %e, "claim failed");
                return RunReport {
                    read_only: e.read_only(),
                    connection_lost: e.connection_lost(),
                    ..report(Outcome::Failed, None, 0, 0, Some(e.to_string()))
                };
            }
        };

        let report = |outcome, epoch, scanned, updated, detail| RunReport {
            reopened,
            ..report(outcome, epoch, scanned, updated, detail)
        };
        let failed = |epoch, scanned, updated, detail, read_only, connection_lost| RunReport {
            read_only,
            connection_lost,
            ..report(Outcome::Failed, epoch, scanned, updated, detail)
        };
        let (mut scanned, mut updated) = (0i64, 0i64);
        // The key's cursor as this run last committed it: each fence (and the SUCCESS) expects it on the server.
        let mut committed = cursor;
        // The cursor is the last id a committed batch covered; i64::MAX means there is nothing after it.
        let mut next = match cursor {
            None => Some(i64::MIN),
            Some(c) => c.checked_add(1),
        };
        let mut asked_first_id = false;
        let mut sizer = BatchSizer::new(self.batch_size, self.throttle.settings().batch_duration);
        // When the lease was last renewed (by the claim, a batch or a renewal while throttled).
        let mut renewed = Instant::now();
        let mut episodes = Episodes::default();
        let stop = loop {
            if self.cancel.is_cancelled() {
                break Ok(Stop::Shutdown);
            }
            if !asked_first_id {
                asked_first_id = true;
                // Skip straight to the first id with work; nothing at all means the run is done.
                match job.first_id(&self.pool, &key).await {
                    Ok(first) => next = next.zip(first).map(|(n, f)| n.max(f)),
                    Err(e) => break Err(e),
                }
            }
            let Some(from_id) = next else { break Ok(Stop::Done) };
            match self
                .throttled(
                    &key,
                    epoch,
                    committed,
                    self.throttle.cap_batch(sizer.next()),
                    &mut renewed,
                    &mut episodes,
                )
                .await
            {
                Ok(None) => {}
                Ok(Some(stop)) => break Ok(stop),
                Err(e) => break Err(e),
            }
            let limit = self.throttle.cap_batch(sizer.next());
            let batch = tokio::time::timeout(
                self.lease.batch_timeout(),
                self.batch(job, &key, epoch, committed, from_id, limit),
            )
            .await;
            // The pace admitted `limit` rows (in `throttled`); it gets back what the batch did not work.
            let done = match &batch {
                Ok(Ok(BatchResult::Committed { scanned, .. })) => *scanned,
                _ => 0,
            };
            self.throttle.settle(limit, done);
            match batch {
                Err(_) => break Err(JobError::BatchTimeout(self.lease.batch_timeout())),
                Ok(Err(e)) => break Err(e),
                Ok(Ok(BatchResult::Empty)) => break Ok(Stop::Done),
                Ok(Ok(BatchResult::Fenced)) => break Ok(Stop::LeaseLost),
                Ok(Ok(BatchResult::Committed {
                    last_id,
                    scanned: s,
                    updated: u,
                    paused,
                    took,
                })) => {
                    renewed = Instant::now();
                    let size = sizer.next();
                    sizer.observe(s, took);
                    if sizer.next() != size {
                        tracing::debug!(
                            took_ms = took.as_millis() as u64,
                            from = size,
                            to = sizer.next(),
                            "batch resized to throttle.batch_duration"
                        );
                    }
                    scanned += s;
                    updated += u;
                    committed = Some(last_id);
                    next = last_id.checked_add(1);
                    if let Some(p) = &self.progress {
                        p.call(s, u);
                    }
                    if let Some(m) = &self.metrics {
                        m.count_rows(key.job, s, u);
                    }
                    if let Some(h) = &self.heartbeat {
                        h.progress_now();
                    }
                    tracing::debug!(
                        cursor = last_id,
                        batch_scanned = s,
                        batch_updated = u,
                        "batch committed"
                    );
                    if let Some((by, reason)) = paused {
                        tracing::warn!(cursor = last_id, paused_by = %by, reason = %reason,
                            "job paused: handing the key back after this batch");
                        break Ok(Stop::Paused(Pause::run_error(&by, &reason)));
                    }
                }
            }
        };

        episodes.end();
        let ending = match &stop {
            Ok(Stop::Done) => Some(Ending::Success),
            Ok(Stop::Shutdown) => Some(Ending::Failed(SHUTDOWN_ERROR)),
            // As a graceful stop: FAILED with the lease ended, so that the first tick after a resume takes the
            // key over and goes on after its cursor.
            Ok(Stop::Paused(error)) => Some(Ending::Failed(error)),
            Ok(Stop::LeaseLost) => None,
            Err(e) => {
                tracing::error!(error = %e, scanned, updated, "run failed");
                None
            }
        };
        let error_text = stop.as_ref().err().map(ToString::to_string);
        let read_only = stop.as_ref().err().is_some_and(JobError::read_only);
        let lost = stop.as_ref().err().is_some_and(JobError::connection_lost);
        let ending = ending.or(error_text.as_deref().map(Ending::Failed));

        let finished = match ending {
            Some(ending) => {
                retrying("finish", &self.pool, || {
                    job_runs::finish(
                        &self.pool,
                        &key,
                        self.claimant(epoch),
                        committed,
                        ending,
                        scanned,
                        updated,
                    )
                })
                .await
            }
            None => Ok(false),
        };
        let lease_lost = match (&stop, &finished) {
            (Ok(Stop::LeaseLost), _) => true,
            // Finishing found another epoch: the key was taken over after our last batch.
            (_, Ok(false)) => true,
            _ => false,
        };
        if lease_lost {
            tracing::warn!(
                scanned,
                updated,
                "lease lost: another replica took the key over (or the server lacks this run's last batches)"
            );
            let recorded = retrying("record the lost lease", &self.pool, || {
                job_runs::record_lease_lost(&self.pool, &key, epoch, &self.owner, scanned, updated)
            })
            .await;
            if let Err(e) = recorded {
                tracing::warn!(error = %JobError::from(e), "could not record the lost lease in the history");
            }
            return report(Outcome::LeaseLost, Some(epoch), scanned, updated, None);
        }
        if let Err(e) = finished {
            // The key stays RUNNING; its lease expires and a peer takes over and resumes from the cursor.
            let e = JobError::from(e);
            tracing::error!(error = %e, "could not record the end of the run; the lease will expire");
            let read_only = read_only || e.read_only();
            let lost = lost || e.connection_lost();
            return failed(
                Some(epoch),
                scanned,
                updated,
                Some(error_text.unwrap_or(e.to_string())),
                read_only,
                lost,
            );
        }
        match stop {
            Ok(Stop::Done) => report(Outcome::Settled, Some(epoch), scanned, updated, None),
            Ok(Stop::Shutdown) => report(
                Outcome::Failed,
                Some(epoch),
                scanned,
                updated,
                Some(SHUTDOWN_ERROR.into()),
            ),
            Ok(Stop::Paused(error)) => RunReport {
                paused: true,
                ..report(Outcome::Failed, Some(epoch), scanned, updated, Some(error))
            },
            _ => failed(Some(epoch), scanned, updated, error_text, read_only, lost),
        }
    }

    fn count_claim(&self, key: RunKey, result: ClaimResult) {
        if let Some(m) = &self.metrics {
            m.count_claim(key.job, result);
        }
    }

    /// Waits before a batch for as long as the throttle asks — while a standby lags past the limit, then for
    /// the pace, which admits the batch's `limit` rows — and returns how the run must stop instead, if it must.
    ///
    /// A wait keeps the lease rules: the run renews its lease through the batch fence (the key RUNNING under its
    /// epoch and owner at its last committed cursor) every [`Runner::renew_every`], so a live, waiting run never
    /// lets its lease run out, and a run that lost its key learns so while it waits. The renewal also sees a
    /// pause of the job (the run hands its key back, as after a batch), and a shutdown ends the wait at once.
    /// The lag check is advisory: if it cannot be read (the statement fails), the batch goes on, and a broken
    /// connection fails that batch as it would have anyway.
    async fn throttled(
        &self,
        key: &RunKey,
        epoch: i64,
        committed: Option<i64>,
        limit: u32,
        renewed: &mut Instant,
        episodes: &mut Episodes,
    ) -> Result<Option<Stop>, JobError> {
        let settings = self.throttle.settings();
        loop {
            let lagging = match self.throttle.lagging(&self.pool).await {
                Ok(Some(lagging)) => {
                    episodes.lag_start(&lagging, settings.max_replica_lag.unwrap_or_default());
                    Some(lagging)
                }
                Ok(None) => {
                    episodes.lag_end("no standby lags more than throttle.max_replica_lag");
                    None
                }
                Err(e) => {
                    episodes.lag_unreadable(&JobError::from(e));
                    None
                }
            };
            let renew_at = *renewed + self.renew_every();
            let wait = match lagging {
                Some(_) => Some((Reason::ReplicaLag, LAG_POLL)),
                // A batch about to start renews first if a renewal is due: it may take the whole batch timeout.
                None if Instant::now() >= renew_at => None,
                None => match self.throttle.admit(limit) {
                    None => return Ok(None),
                    Some(wait) => {
                        episodes.rate_wait(settings.max_rows_per_second.unwrap_or(0));
                        Some((Reason::Rate, wait))
                    }
                },
            };
            if let Some((reason, wait)) = wait {
                let slice = wait.min(renew_at.saturating_duration_since(Instant::now()));
                let slept = Instant::now();
                tokio::select! {
                    _ = self.cancel.cancelled() => return Ok(Some(Stop::Shutdown)),
                    _ = tokio::time::sleep(slice) => {}
                }
                let slept = slept.elapsed();
                if reason == Reason::Rate {
                    episodes.rate_waited(slept);
                }
                if let Some(m) = &self.metrics {
                    m.add_throttled(key.job, reason, slept.as_secs_f64());
                }
                if let Some(h) = &self.heartbeat {
                    h.alive();
                }
            }
            if Instant::now() >= renew_at {
                // Retried like the finish: a connection cut during a long wait need not fail the run.
                let renewal = retrying("renew the lease", &self.pool, || {
                    job_runs::renew(
                        &self.pool,
                        key,
                        self.claimant(epoch),
                        committed,
                        self.lease.duration(),
                    )
                })
                .await?;
                match renewal {
                    Fence::Lost => return Ok(Some(Stop::LeaseLost)),
                    Fence::Passed {
                        paused: Some((by, reason)),
                    } if !self.ignore_pause => {
                        tracing::warn!(cursor = committed, paused_by = %by, reason = %reason,
                            "job paused while throttled: handing the key back");
                        return Ok(Some(Stop::Paused(Pause::run_error(&by, &reason))));
                    }
                    Fence::Passed { .. } => {}
                }
                *renewed = Instant::now();
                tracing::debug!(cursor = committed, "lease renewed while throttled");
                if let Some(h) = &self.heartbeat {
                    h.progress_now();
                }
            }
        }
    }

    fn claimant(&self, epoch: i64) -> Claimant<'_> {
        Claimant {
            epoch,
            owner: &self.owner,
        }
    }

    /// How often a waiting run renews its lease: a third of the lease, or less when a long batch timeout needs
    /// it — a batch may start just before a renewal was due and take the whole batch timeout, and the lease must
    /// outlast both: `min(lease / 3, (lease - batch_timeout) / 2)`.
    fn renew_every(&self) -> Duration {
        let lease = self.lease.duration();
        (lease / 3)
            .min(lease.saturating_sub(self.lease.batch_timeout()) / 2)
            .max(MIN_RENEW_EVERY)
    }

    /// One batch: read the next rows, then one transaction that writes them and, last, passes the fence.
    async fn batch<J: BatchJob>(
        &self,
        job: &J,
        key: &RunKey,
        epoch: i64,
        after: Option<i64>,
        from_id: i64,
        limit: u32,
    ) -> Result<BatchResult, JobError> {
        let batch = job.fetch(&self.pool, key, from_id, i64::from(limit)).await?;
        let Some(batch) = batch else {
            return Ok(BatchResult::Empty);
        };
        let (last_id, scanned) = J::extent(&batch);
        let began = Instant::now();
        let mut tx = self.pool.begin().await?;
        store::set_local_lock_timeout(&mut tx, self.lease.lock_timeout()).await?;
        let updated = i64::try_from(job.write(&mut tx, key, &batch).await?).unwrap_or(i64::MAX);
        let progress = Progress {
            after,
            cursor: last_id,
            scanned,
            updated,
        };
        let paused = match job_runs::advance(
            &mut tx,
            key,
            self.claimant(epoch),
            progress,
            self.lease.duration(),
        )
        .await?
        {
            Fence::Lost => {
                tx.rollback().await?;
                return Ok(BatchResult::Fenced);
            }
            Fence::Passed { paused } => paused.filter(|_| !self.ignore_pause),
        };
        tx.commit().await?;
        Ok(BatchResult::Committed {
            last_id,
            scanned,
            updated,
            paused,
            took: began.elapsed(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Lease;

    fn runner(lease: Duration, batch_timeout: Option<Duration>) -> Runner {
        let claim = ClaimSettings {
            lease: Lease::new(lease, batch_timeout, None).expect("lease"),
            history_retention: Duration::from_secs(3600),
        };
        let pool = Db::from(sqlx::postgres::PgPoolOptions::new().connect_lazy_with(Default::default()));
        Runner::new(pool, "a".into(), &claim, 100, CancellationToken::new())
    }

    #[tokio::test]
    async fn a_waiting_run_renews_often_enough_for_a_whole_batch_after_it() {
        // The derived batch timeout (30 s of a 2 m lease): a third of the lease.
        assert_eq!(
            runner(Duration::from_secs(120), None).renew_every(),
            Duration::from_secs(40)
        );
        // A batch timeout of 100 s: a batch started just before a renewal was due must still end inside the
        // lease, 10 + 100 < 120.
        let long = runner(Duration::from_secs(120), Some(Duration::from_secs(100)));
        assert_eq!(long.renew_every(), Duration::from_secs(10));
        assert!(long.renew_every() + long.lease.batch_timeout() < long.lease.duration());
    }
}
