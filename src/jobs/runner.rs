//! The one mechanism every job runs on: claim a key, walk its rows in fenced keyset batches, end the run.
//!
//! A job supplies how to find the next batch after a cursor and how to write it (conditionally:
//! a row already done is never changed again). The runner supplies everything that makes a run safe to repeat:
//! the claim, one transaction per batch whose last statement is the epoch fence, the cursor checkpoint, the
//! lease renewal by progress, the finish, and the history. A batch whose fence matches no row rolls back, so a
//! replica that lost its claim commits nothing more.
//!
//! A claimed run is one handle ([`ClaimedRun`](crate::store::job_runs::ClaimedRun): key, epoch, owner,
//! cursor); [`Runner::run_as`] takes it through named steps, each in a file of its own under `runner/`: `claim`
//! (with the re-open decision), `walk` (the batches), `wait` (the throttle's waits, which renew the lease), `end`
//! (finish, hand back or lease lost) and `retry` (the statements that end a run, retried through a lost
//! connection). The steps are submodules of this one so that their logs keep its target
//! (`RUST_LOG=fine_settler::jobs::runner=debug` shows them all).

mod beside;
mod claim;
mod end;
mod held;
mod retry;
mod wait;
mod walk;

use std::{future::Future, hash::BuildHasher, sync::Arc, time::Duration};

use sqlx::PgConnection;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use self::claim::Start;
pub use self::{held::HeldKeys, retry::transient};
use super::{throttle::Throttle, Outcome, RunKey, RunReport};
use crate::{
    calendar::CalendarError,
    config::{ClaimSettings, Lease},
    health::Heartbeat,
    metrics::Metrics,
    progress::RowsHook,
    store::{corrections::Corrected, job_runs::ClaimMode, Db},
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

    /// Told once `batch` of the run of `key` committed (its fence passed). By default nothing is kept between
    /// batches; a walk that hands out batches it listed earlier lets them go here ([`super::shard_walk`]).
    fn committed(&self, _key: &RunKey, _batch: &Self::Batch) {}

    /// The batch cut into the part its own transaction writes and parts the runner may write beside it at the
    /// same time, each with [`BatchJob::write`] on a transaction of its own that passes the fence's check and
    /// commits before the batch's fence (`runner/beside.rs`). `None` (the default): the batch is
    /// written whole in its transaction.
    fn split(&self, _batch: &Self::Batch) -> Option<(Self::Batch, Vec<Self::Batch>)> {
        None
    }

    /// Writes the batch inside the batch transaction of the run of `key` under `epoch`, skipping items already
    /// done; says what it wrote.
    fn write(
        &self,
        tx: &mut PgConnection,
        key: &RunKey,
        epoch: i64,
        batch: &Self::Batch,
    ) -> impl Future<Output = Result<Written, JobError>> + Send;

    /// [`BatchJob::write`] of a part written beside its batch ([`BatchJob::split`]), on a transaction of its
    /// own: `None` when the part cannot be written there without waiting for a lock the batch's transaction may
    /// be queued behind (it is then written in the batch's transaction). By default `write`: a job that splits
    /// and takes such a lock (the settlement, the calendar's) must say how its part does without the wait.
    fn write_beside(
        &self,
        tx: &mut PgConnection,
        key: &RunKey,
        epoch: i64,
        part: &Self::Batch,
    ) -> impl Future<Output = Result<Option<Written>, JobError>> + Send {
        async move { self.write(tx, key, epoch, part).await.map(Some) }
    }
}

/// What a batch wrote: business rows (loans settled, charges), and ledger corrections by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Written {
    pub updated: u64,
    pub corrected: Corrected,
}

impl Written {
    /// Adds what `other` wrote.
    pub fn add(&mut self, other: &Written) {
        self.updated = self.updated.saturating_add(other.updated);
        self.corrected.add(&other.corrected);
    }

    /// `updated` rows and no corrections.
    pub fn rows(updated: u64) -> Self {
        Written {
            updated,
            corrected: Corrected::default(),
        }
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The business date does not fit the job.
    #[error(transparent)]
    Calendar(#[from] CalendarError),
    /// A statement failed (connection lost, statement timeout, constraint).
    #[error("database error: {}", crate::store::tls::database_error(.0))]
    Sql(#[from] sqlx::Error),
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
    /// The keys this runner's runs hold now (shared with the daemon's stop).
    pub held: Arc<HeldKeys>,
    /// Write the parts of a batch a job cuts ([`BatchJob::split`]) beside it, on connections of their own
    /// (the default); else in the batch's transaction (a backfill of several runs at once, whose runs need the
    /// pool's connections).
    pub parts_beside: bool,
}

/// The shortest interval between lease renewals of a waiting run (a lease barely longer than the batch timeout
/// would otherwise renew in a busy loop).
const MIN_RENEW_EVERY: Duration = Duration::from_millis(100);

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
            held: Arc::default(),
            parts_beside: true,
        }
    }

    /// The same runner, writing every part of a batch in the batch's transaction ([`Runner::parts_beside`]).
    pub fn with_parts_in_batch(mut self) -> Self {
        self.parts_beside = false;
        self
    }

    /// The same runner, counting the keys its runs hold in `held`.
    pub fn with_held_keys(mut self, held: Arc<HeldKeys>) -> Self {
        self.held = held;
        self
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
        self.record(key, &span, &report);
        report
    }

    /// The run's steps: note the primary's WAL position for the lag limit, claim the key (or report why not),
    /// walk its batches, end the run.
    async fn claim_and_run<J: BatchJob>(
        &self,
        job: &J,
        key: RunKey,
        mode: ClaimMode,
        span: &tracing::Span,
    ) -> RunReport {
        self.throttle.note_position(&self.pool).await;
        let (mut run, _holding) = match self.claim(job, key, mode, span).await {
            Start::Run(run, holding) => (run, holding),
            Start::Ended(report) => return report,
        };
        let stop = self.walk(job, &mut run).await;
        self.end(run, stop).await
    }

    /// What a finished run leaves besides its report: the metrics of its outcome and its last log lines.
    fn record(&self, key: RunKey, span: &tracing::Span, report: &RunReport) {
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
