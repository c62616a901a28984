//! The long-running replica: on every admitted tick, settle every due business date of every enabled job for
//! this shard, oldest first. The only place that runs the scheduler loop.
//!
//! A tick reads the time once (the database clock by default, so replicas with skewed clocks agree, and logs the
//! host−database skew), computes the due business dates in each job's catch-up window, and runs each one that
//! is not SUCCESS for this shard. An idle tick — everything SUCCESS — is one statement (see
//! [`store::Session`]). When PostgreSQL is unreachable the tick is retried with capped exponential backoff; the
//! outage is logged once when it starts and once when it ends, and the daemon never exits because of it.

pub mod lifecycle;

use std::{collections::HashSet, sync::Arc, time::Duration};

use crate::store::Db;
use chrono::{DateTime, NaiveDate, Utc};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::{
    backoff::Backoff,
    config::{Settings, TimeSource},
    health::Heartbeat,
    jobs::{
        accrual::{self, Accrual},
        runner::{process_owner, Runner},
        settlement::Settlement,
        throttle::Throttle,
        JobName, Outcome, RunKey, RunReport,
    },
    metrics::Metrics,
    schedule::{
        due::{self, Due, Pass},
        scheduler::{Scheduler, Tick},
        Schedule, WallClock,
    },
    sdnotify::Notifier,
    shard::ShardSpec,
    store::{
        self,
        job_runs::{Action, ClaimMode, KeyState, TickStatus},
        pauses::Pause,
        Session, StoreError,
    },
};

pub use lifecycle::{run, run_once, Control, StartError, Stopped};

/// The wait before each retry of a tick (or of the readiness check) while the database is unreachable: 250 ms,
/// doubled per failure, at most 30 s.
pub const TICK_BACKOFF: Backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(30));

/// The first history pruning runs this long after start (so that restarts do not add load), then every
/// [`PRUNE_EVERY`].
pub const FIRST_PRUNE_AFTER: Duration = Duration::from_secs(600);
pub const PRUNE_EVERY: Duration = Duration::from_secs(3600);
/// Rows deleted per pruning statement, and statements per pruning pass at most.
const PRUNE_BATCH: i64 = 1000;
const PRUNE_BATCHES: u32 = 50;

/// Why a tick could not look at its work.
#[derive(Debug, thiserror::Error)]
pub enum TickError {
    /// The tick's status query (or its compensation pass) failed: the database is unreachable, restarting, or
    /// not migrated.
    #[error("cannot read the tick status: {}", crate::redact::secrets_in(&.0.to_string()))]
    Database(#[from] sqlx::Error),
    /// The server cannot write (a standby, or read-only transactions): the tick claims nothing.
    #[error("{0}")]
    ReadOnly(String),
    /// A run of the tick lost its connection.
    #[error("a run lost its database connection: {0}")]
    Connection(String),
}

impl TickError {
    /// The error, with a read-only server told apart from an unreachable one.
    fn classify(e: sqlx::Error) -> Self {
        if store::read_only(&e) {
            TickError::ReadOnly(match &e {
                sqlx::Error::Io(io) => io.to_string(),
                other => format!(
                    "connected to a read-only server ({})",
                    crate::redact::secrets_in(&other.to_string())
                ),
            })
        } else {
            TickError::Database(e)
        }
    }
}

/// What a tick at `at` would do (default: now, by the configured clock), one line per due key, as `plan`
/// prints it. Reads the tick status; writes nothing.
pub async fn plan(settings: &Settings, at: Option<DateTime<Utc>>) -> Result<Vec<Due>, TickError> {
    let pool = store::connect_lazy(
        &settings.database,
        "fine-settler plan",
        settings.claim.lease.batch_timeout(),
    );
    pool.reconnect().await?;
    let mut session = Session::new(
        &pool,
        "fine-settler plan",
        settings.database.connect_timeout,
        settings.claim.lease.batch_timeout() + settings.database.connect_timeout,
    );
    let around = at.unwrap_or_else(Utc::now);
    let status = session
        .tick_status(
            settings.instance,
            due::window_start(settings, around),
            due::late_probe(settings, around, true),
        )
        .await?;
    let now = match (at, settings.time_source) {
        (Some(at), _) => at,
        (None, TimeSource::Database) => status.now,
        (None, TimeSource::System) => Utc::now(),
    };
    Ok(due::plan(settings, now, &status.keys, &status.pauses))
}

/// A replica.
#[derive(Debug)]
pub struct Daemon {
    settings: Settings,
    pool: Db,
    session: Session,
    owner: String,
    wall: Arc<dyn WallClock>,
    shutdown: CancellationToken,
    run_now: Arc<Notify>,
    skew_warned: bool,
    metrics: Arc<Metrics>,
    /// The replica's liveness: `/healthz`, the status page and the systemd watchdog read it.
    heartbeat: Arc<Heartbeat>,
    /// The service manager (systemd), told READY=1 and STATUS=… when `NOTIFY_SOCKET` is set.
    notifier: Option<Arc<Notifier>>,
    /// The compensation pass is failing (logged once per episode, like an outage).
    compensation_failing: bool,
    /// Keys already reported as abandoned by this process (each is logged and counted once).
    abandoned: HashSet<(String, NaiveDate)>,
    /// When the tick status last asked about late accrual rows (`accrual.recheck_every`).
    accrual_rechecked: Option<tokio::time::Instant>,
    /// The pauses covering this shard at the last tick (each logged when it starts and when it ends).
    paused: Vec<Pause>,
    /// `[throttle]`, shared by every run of the replica.
    throttle: Arc<Throttle>,
}

impl Daemon {
    /// Sets up the replica without touching the database (connections open lazily).
    pub fn new(
        settings: Settings,
        wall: Arc<dyn WallClock>,
        shutdown: CancellationToken,
        run_now: Arc<Notify>,
    ) -> Self {
        let owner = process_owner();
        let app = format!("fine-settler run {}", settings.instance);
        let pool = store::connect_lazy(&settings.database, &app, settings.claim.lease.batch_timeout());
        let session = Session::new(
            &pool,
            &format!("{app} tick"),
            settings.database.connect_timeout,
            settings.claim.lease.batch_timeout() + settings.database.connect_timeout,
        );
        let metrics = Arc::new(Metrics::new(settings.instance.to_string()).with_watched_series_at_zero());
        let heartbeat = Arc::new(Heartbeat::exporting(metrics.last_progress()));
        let throttle = Throttle::new(settings.throttle.clone());
        Daemon {
            settings,
            pool,
            session,
            owner,
            wall,
            shutdown,
            run_now,
            skew_warned: false,
            metrics,
            heartbeat,
            notifier: None,
            compensation_failing: false,
            abandoned: HashSet::new(),
            accrual_rechecked: None,
            paused: Vec::new(),
            throttle,
        }
    }

    /// Tells the service manager about readiness and status through `notifier`.
    pub fn with_notifier(mut self, notifier: Option<Arc<Notifier>>) -> Self {
        self.notifier = notifier;
        self
    }

    fn status(&self, state: &str) {
        if let Some(n) = &self.notifier {
            n.send(state);
        }
    }

    /// Sleeps `wait` in naps of at most a second, telling the watchdog the loop is alive (an outage is handled
    /// here; restarting the process would not help). Returns early on shutdown or run-now.
    async fn nap(&self, wait: Duration) {
        let until = tokio::time::Instant::now() + wait;
        loop {
            self.heartbeat.alive();
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return;
            }
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = self.run_now.notified() => return,
                _ = tokio::time::sleep(left.min(Duration::from_secs(1))) => {}
            }
        }
    }

    /// Waits until the pool connects and every migration is applied (retrying with backoff, logged once), so
    /// that READY=1 means the replica can work. `false` if shut down first.
    pub async fn await_ready(&self) -> bool {
        let mut failures = 0u32;
        loop {
            let ready = store::readiness(&self.pool).await;
            // Waiting for the database is not a stall: each attempt counts as progress for /healthz.
            self.heartbeat.progress_now();
            match ready {
                Ok(()) => {
                    if failures > 0 {
                        tracing::info!(attempts = failures, "database ready");
                    }
                    return true;
                }
                Err(reason) => {
                    failures += 1;
                    // A connection that found the server read-only (or broken) is not asked again: the next
                    // attempt opens new ones, on the next qualifying host if the URL lists several.
                    if let Err(e) = self.pool.reconnect().await {
                        tracing::debug!(error = %StoreError::from(e), "no qualifying host yet");
                    }
                    if failures == 1 {
                        tracing::error!(reason = %reason, "not ready: waiting for the database and migrations");
                        self.status(&format!("STATUS=not ready: {reason}"));
                    }
                    self.nap(TICK_BACKOFF.delay(failures)).await;
                    if self.shutdown.is_cancelled() {
                        return false;
                    }
                }
            }
        }
    }

    /// The replica's metrics (for the HTTP listener).
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// The replica's liveness (for the HTTP listener and the watchdog).
    pub fn heartbeat(&self) -> Arc<Heartbeat> {
        self.heartbeat.clone()
    }

    /// The owner name this replica claims keys under (for the status page).
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// The pool the jobs use (for the readiness probe).
    pub fn pool(&self) -> Db {
        self.pool.clone()
    }

    fn runner(&self, batch_size: u32) -> Runner {
        Runner::new(
            self.pool.clone(),
            self.owner.clone(),
            &self.settings.claim,
            batch_size,
            self.shutdown.clone(),
        )
        .with_metrics(self.metrics.clone())
        .with_heartbeat(self.heartbeat.clone())
        .with_throttle(self.throttle.clone())
    }

    /// Runs until shutdown: ticks on the schedule (and once at start), each tick retried through outages.
    pub async fn run(mut self) {
        let schedule = Schedule::new(self.settings.schedule.mode.clone(), self.settings.zone);
        tracing::info!(
            owner = %self.owner,
            shard = self.settings.instance.shard(),
            shards = self.settings.instance.shards(),
            schedule = %schedule.describe(),
            "replica started"
        );
        if !self.await_ready().await {
            self.pool.close().await;
            tracing::info!("replica stopped before it was ready");
            return;
        }
        // A lag limit this role cannot read is said once, now (and asked again at the first batch if this fails).
        if let Err(e) = self.throttle.prepare(&self.pool).await {
            tracing::debug!(error = %e, "could not ask whether standbys' positions are readable");
        }
        self.status(&format!(
            "READY=1\nSTATUS=shard {}: ticking {}",
            self.settings.instance,
            schedule.describe()
        ));
        let mut scheduler = Scheduler::new(
            schedule,
            self.settings.schedule.max_catch_up,
            self.wall.clone(),
            true,
        )
        .with_heartbeat(self.heartbeat.clone());
        let run_now = self.run_now.clone();
        let shutdown = self.shutdown.clone();
        let mut next_prune = tokio::time::Instant::now() + FIRST_PRUNE_AFTER;
        while let Some(tick) = scheduler.next(&run_now, &shutdown).await {
            let stats = scheduler.stats();
            self.metrics
                .set_slot_totals(stats.dropped, stats.merged, stats.rebased);
            self.tick_through_outages(tick).await;
            if tokio::time::Instant::now() >= next_prune && !shutdown.is_cancelled() {
                self.prune_history().await;
                next_prune = tokio::time::Instant::now() + PRUNE_EVERY;
            }
            scheduler.finished();
        }
        self.pool.close().await;
        tracing::info!(stats = ?scheduler.stats(), "replica stopped");
    }

    /// One tick, retried with capped exponential backoff while the database is unreachable. Returns the runs'
    /// reports (empty if shut down before the database came back).
    pub async fn tick_through_outages(&mut self, tick: Tick) -> Vec<RunReport> {
        let mut failures = 0u32;
        // When the episode started, and whether it is a read-only server (rather than no server).
        let mut outage_started: Option<(tokio::time::Instant, bool)> = None;
        loop {
            let result = self.tick().await;
            self.heartbeat.progress_now();
            match result {
                Ok(reports) => {
                    self.metrics.count_tick();
                    if let Some((started, read_only)) = outage_started {
                        let down_ms = started.elapsed().as_millis() as u64;
                        if read_only {
                            self.status("STATUS=writable server found again");
                            tracing::info!(
                                down_ms,
                                attempts = failures,
                                "writable server found again; resuming"
                            );
                        } else {
                            self.status("STATUS=database reachable again");
                            tracing::info!(
                                down_ms,
                                attempts = failures,
                                "database reachable again; resuming"
                            );
                        }
                    }
                    return reports;
                }
                Err(e) => {
                    self.metrics.count_tick_error();
                    failures += 1;
                    if outage_started.is_none() {
                        let read_only = matches!(e, TickError::ReadOnly(_));
                        outage_started = Some((tokio::time::Instant::now(), read_only));
                        if read_only {
                            tracing::error!(error = %e, slot = tick.slot,
                                "read-only server: claiming nothing; looking for a writable one with backoff");
                            self.status("STATUS=connected to a read-only server; retrying with backoff");
                        } else {
                            tracing::error!(error = %e, slot = tick.slot, "database unreachable; retrying with backoff");
                            self.status("STATUS=database unreachable; retrying with backoff");
                        }
                    }
                    // Drop every connection and look for a server again (the next qualifying host, if the URL
                    // lists several).
                    if let Err(e) = self.pool.reconnect().await {
                        tracing::debug!(error = %StoreError::from(e), "no qualifying host yet");
                    }
                    let wait = TICK_BACKOFF.delay(failures);
                    tracing::debug!(error = %e, attempt = failures, backoff_ms = wait.as_millis() as u64, "tick failed");
                    self.nap(wait).await;
                    if self.shutdown.is_cancelled() {
                        return Vec::new();
                    }
                }
            }
        }
    }

    /// One tick: read the time, the shard's keys and its due pending charges (one statement); retry the due
    /// pending charges; then run every due key not yet SUCCESS, oldest first per job.
    pub async fn tick(&mut self) -> Result<Vec<RunReport>, TickError> {
        let shard = self.settings.instance;
        let before = self.wall.now();
        let recheck_accrual = self
            .accrual_rechecked
            .is_none_or(|at| at.elapsed() >= self.settings.accrual.recheck_every);
        let status = self.read_status(before, recheck_accrual).await?;
        self.heartbeat.ticked_now();
        if recheck_accrual {
            self.accrual_rechecked = Some(tokio::time::Instant::now());
        }
        let after = self.wall.now();
        self.observe_skew(before + (after - before) / 2, status.now);
        let now = match self.settings.time_source {
            TimeSource::Database => status.now,
            TimeSource::System => after,
        };
        self.metrics.set_pending(status.pending, status.dead);
        // A paused accrual charges nothing, its queue included (as `accrue` refuses before its pass).
        let accrual_paused = status
            .pauses
            .iter()
            .any(|p| p.job_name == JobName::OverdueAccrual.as_str());
        if self.settings.accrual.enabled && status.due_pending > 0 && !accrual_paused {
            self.compensate(shard).await;
        }
        self.report_abandoned(now, &status.keys);
        self.observe_pauses(&status.pauses);
        let todo: Vec<Due> = due::plan(&self.settings, now, &status.keys, &status.pauses)
            .into_iter()
            .filter(|d| d.runs)
            .collect();
        if todo.is_empty() {
            for job in [JobName::FineSettlement, JobName::OverdueAccrual] {
                self.metrics.set_due_unsettled(job, 0);
            }
            tracing::debug!(%now, "tick: nothing due");
            return Ok(Vec::new());
        }
        let mut reports = Vec::with_capacity(todo.len());
        // The pass's estimate of the database clock, for the revisits of held keys.
        let pass_started = tokio::time::Instant::now();
        let mut pass = Pass::new(&todo);
        // Jobs a run of this pass found paused (at its fence): the pass starts no further key of them.
        let mut paused_now: HashSet<JobName> = HashSet::new();
        while !self.shutdown.is_cancelled() {
            let db_now = status.now + chrono::Duration::from_std(pass_started.elapsed()).unwrap_or_default();
            let Some(visit) = pass.next_at(db_now) else {
                break;
            };
            if paused_now.contains(&visit.key.job) {
                continue;
            }
            let switches = self.pool.switches();
            let report = self.run_due(visit.key, shard).await;
            if report.read_only {
                // The server stopped writing since the tick read its status: claim nothing more on it.
                let detail = report.detail.clone().unwrap_or_default();
                return Err(TickError::ReadOnly(format!(
                    "connected to a read-only server ({detail})"
                )));
            }
            if report.connection_lost || self.pool.switches() != switches {
                // The server went away mid-run (a restart, a failover — the run may have ended on the next
                // qualifying host): the rest of the pass would only wait for it key by key, or run on a host
                // the tick has not read; the outage loop looks for the server with backoff and starts the pass
                // again, and the episode is logged as one.
                let detail = report.detail.clone().unwrap_or_default();
                return Err(TickError::Connection(match self.pool.switches() != switches {
                    true => format!("the database moved to {} ({detail})", self.pool.host()),
                    false => detail,
                }));
            }
            if report.paused {
                paused_now.insert(visit.key.job);
            }
            if let Some(until) = report.held_until {
                pass.held(visit, until);
            }
            reports.push(report);
        }
        for job in [JobName::FineSettlement, JobName::OverdueAccrual] {
            // Keys this tick did not see through to the end (failed, lost, held by another replica, or not reached
            // before shutdown) stay due.
            let settled = reports
                .iter()
                .filter(|r| r.job == job.as_str() && r.outcome == Outcome::Settled)
                .count();
            let due = todo.iter().filter(|d| d.job == job).count();
            self.metrics.set_due_unsettled(job, due.saturating_sub(settled));
        }
        Ok(reports)
    }

    /// The tick's status statement at host time `before`, asking about late accrual rows too if `accrual`.
    async fn read_status(&mut self, before: DateTime<Utc>, accrual: bool) -> Result<TickStatus, TickError> {
        let since = due::window_start(&self.settings, before);
        let late = due::late_probe(&self.settings, before, accrual);
        self.session
            .tick_status(self.settings.instance, since, late)
            .await
            .map_err(TickError::classify)
    }

    /// Retries the shard's due pending charges, for at most `claim.batch_timeout` (the rest at the next tick) and
    /// never past a shutdown request. A pass that fails — a deferred constraint at commit, a missing
    /// grant on `fine_pending`, the connection — never stops the tick: settlement and accrual go on, the error
    /// is logged once per episode (and when it ends) and counted, and the next tick tries again.
    async fn compensate(&mut self, shard: ShardSpec) {
        let accrual = Accrual::from_settings(&self.settings);
        let max_attempts = self.settings.accrual.max_attempts;
        let limits = accrual::PassLimits {
            cancel: Some(self.shutdown.clone()),
            budget: Some(self.settings.claim.lease.batch_timeout()),
            heartbeat: Some(self.heartbeat.clone()),
            progress: None,
        };
        match accrual::compensate_within(&self.pool, &accrual, Some(shard), true, max_attempts, &limits).await
        {
            Ok(done) => {
                if std::mem::take(&mut self.compensation_failing) {
                    tracing::info!("compensation pass works again");
                }
                tracing::info!(
                    charged = done.charged,
                    not_owed = done.not_owed,
                    retried = done.retried,
                    dead = done.dead,
                    "compensation pass"
                );
            }
            Err(e) => {
                self.metrics.count_compensation_error();
                let e = StoreError::from(e);
                if !std::mem::replace(&mut self.compensation_failing, true) {
                    tracing::error!(error = %e, "compensation pass failed; settlement and accrual go on, retrying at the next tick");
                } else {
                    tracing::debug!(error = %e, "compensation pass failed again");
                }
            }
        }
    }

    /// Logs (at error) and counts each key that left its catch-up window without succeeding, once per process:
    /// without this such a key would drop out of `fine_settler_due_unsettled` and its alert would clear.
    fn report_abandoned(&mut self, now: DateTime<Utc>, states: &[KeyState]) {
        for s in due::abandoned(&self.settings, now, states) {
            if self.abandoned.insert((s.job_name.clone(), s.business_date)) {
                let mut jobs = [JobName::FineSettlement, JobName::OverdueAccrual].into_iter();
                if let Some(job) = jobs.find(|j| j.as_str() == s.job_name) {
                    self.metrics.count_key_abandoned(job);
                }
                tracing::error!(
                    job = %s.job_name,
                    business_date = %s.business_date,
                    status = %s.status,
                    owner = %s.owner,
                    "key left its catch-up window without succeeding; nothing runs it by itself any more: \
                     run settle/accrue for it by hand"
                );
            }
        }
    }

    /// Sets `fine_settler_paused` for each job and logs each pause covering this shard once, at warn, when a
    /// tick first sees it, and once, at info, when it is gone (the job was resumed).
    fn observe_pauses(&mut self, pauses: &[Pause]) {
        for job in [JobName::FineSettlement, JobName::OverdueAccrual] {
            let now = pauses.iter().find(|p| p.job_name == job.as_str());
            let before = self.paused.iter().find(|p| p.job_name == job.as_str());
            self.metrics.set_paused(job, now.is_some());
            // A pause replaced by another (the job's after the shard's, or a new one after a resume between two
            // ticks) is a new episode.
            let same = |a: &Pause, b: &Pause| a.scope == b.scope && a.since == b.since;
            match (before, now) {
                (Some(b), Some(n)) if same(b, n) => {}
                (_, Some(n)) => tracing::warn!(
                    job = %n.job_name, scope = %n.scope, by = %n.by, reason = %n.reason, since = %rfc3339(n.since),
                    "job paused by {}: {}", n.by, n.reason
                ),
                (Some(b), None) => tracing::info!(
                    job = %b.job_name, scope = %b.scope, paused_by = %b.by, since = %rfc3339(b.since),
                    "job resumed; its keys are claimed again"
                ),
                (None, None) => {}
            }
        }
        self.paused = pauses.to_vec();
    }

    /// Runs one due key of this shard.
    async fn run_due(&self, due: &Due, shard: ShardSpec) -> RunReport {
        // A key the status statement found late is re-opened as such, without asking the question again.
        let mode = if due.action == Action::Reopen {
            ClaimMode::Reopen
        } else {
            ClaimMode::Free
        };
        if due.job == JobName::OverdueAccrual {
            let key = RunKey {
                job: JobName::OverdueAccrual,
                business_date: due.business_date,
                shard,
            };
            let accrual = Accrual::from_settings(&self.settings);
            self.runner(self.settings.accrual.batch_size)
                .run_as(&accrual, key, mode)
                .await
        } else {
            let key = RunKey {
                job: JobName::FineSettlement,
                business_date: due.business_date,
                shard,
            };
            let settlement = Settlement {
                policy: self.settings.fine,
            };
            self.runner(self.settings.settlement.batch_size)
                .run_as(&settlement, key, mode)
                .await
        }
    }

    /// Deletes `job_run_attempts` rows older than `claim.history_retention`, in small batches so that no
    /// statement holds locks for long. Failures are logged and retried at the next pass.
    async fn prune_history(&self) {
        let retention = self.settings.claim.history_retention;
        let mut pruned = 0u64;
        for _ in 0..PRUNE_BATCHES {
            match store::job_runs::prune_history(&self.pool, retention, PRUNE_BATCH).await {
                Ok(n) => {
                    pruned += n;
                    if n < PRUNE_BATCH as u64 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %StoreError::from(e), "pruning the attempt history failed; retrying later");
                    break;
                }
            }
        }
        if pruned > 0 {
            tracing::info!(pruned, retention = %humantime::format_duration(retention), "pruned old attempt history");
        }
    }

    /// Logs the host−database clock skew: debug every tick, a warning when it first exceeds `time.max_skew`,
    /// and an info line when it is back within bounds.
    fn observe_skew(&mut self, host: DateTime<Utc>, db: DateTime<Utc>) {
        let skew_ms = (host - db).num_milliseconds();
        self.metrics.set_clock_skew(skew_ms as f64 / 1000.0);
        let limit = self.settings.max_skew.as_millis() as i64;
        tracing::debug!(clock_skew_ms = skew_ms, "host clock minus database clock");
        if skew_ms.abs() > limit && !self.skew_warned {
            self.skew_warned = true;
            tracing::warn!(
                clock_skew_ms = skew_ms,
                max_skew_ms = limit,
                "host clock differs from the database clock"
            );
        } else if skew_ms.abs() <= limit && self.skew_warned {
            self.skew_warned = false;
            tracing::info!(clock_skew_ms = skew_ms, "clock skew back within bounds");
        }
    }
}

/// A database time as logged: RFC 3339, milliseconds, UTC.
fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_replica_s_debug_never_shows_the_password() {
        let env = crate::testing::env(&[("DATABASE_URL", "postgres://u:hunter2@h/db?password=hunter3")]);
        let settings = crate::config::load(None, &env)
            .and_then(|raw| raw.validate(&env))
            .expect("valid");
        let daemon = Daemon::new(
            settings,
            Arc::new(crate::schedule::SystemWall),
            CancellationToken::new(),
            Arc::new(Notify::new()),
        );
        let shown = format!("{daemon:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("hunter3") && shown.contains("u:***@h/db"),
            "{shown}"
        );
    }

    #[test]
    fn the_tick_backoff_doubles_and_is_capped() {
        assert_eq!(TICK_BACKOFF.delay(1), Duration::from_millis(250));
        assert_eq!(TICK_BACKOFF.delay(2), Duration::from_millis(500));
        assert_eq!(TICK_BACKOFF.delay(5), Duration::from_secs(4));
        assert_eq!(TICK_BACKOFF.delay(8), Duration::from_secs(30));
        assert_eq!(TICK_BACKOFF.delay(u32::MAX), Duration::from_secs(30));
    }
}
