//! The long-running replica: on every admitted tick, settle every due business date of every enabled job for
//! this shard, oldest first. The only place that runs the scheduler loop.
//!
//! A tick reads the time once (the database clock by default, so replicas with skewed clocks agree, and logs the
//! host−database skew), computes the due business dates in each job's catch-up window, and runs each one that
//! is not SUCCESS for this shard. An idle tick — everything SUCCESS — is one statement (see
//! [`store::Session`]). When PostgreSQL is unreachable the tick is retried with capped exponential backoff; the
//! outage is logged once when it starts and once when it ends, and the daemon never exits because of it.
//!
//! This file holds the replica itself (its state and its loop); the rest, by responsibility: [`lifecycle`] from
//! start to exit, `tick` one tick in its named steps, `outage` waiting for the database (at start and through
//! outages), `compensation` the tick's pass over the pending charges, `episodes` what a tick notices and logs
//! once per episode (clock skew, pauses, abandoned keys), `prune` the history's pruning, `plan` the `plan`
//! command's view of a tick, `tick_clock` the one clock every date of a tick comes from, `stop` what a stop
//! waits for and says.

mod compensation;
mod episodes;
pub mod lifecycle;
mod outage;
mod plan;
mod prune;
pub mod recheck;
mod stop;
mod tick;
mod tick_clock;

use std::{
    collections::HashSet,
    sync::{atomic::AtomicBool, Arc},
    time::Duration,
};

use crate::store::Db;
use chrono::NaiveDate;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::{
    backoff::Backoff,
    config::Settings,
    health::{Heartbeat, TickFailure},
    jobs::{
        runner::{process_owner, HeldKeys, Runner},
        throttle::Throttle,
    },
    metrics::Metrics,
    schedule::{scheduler::Scheduler, Schedule, WallClock},
    sdnotify::Notifier,
    store::{self, pauses::Pause, Session},
};

pub use lifecycle::{run, run_once, Control, StartError, Stopped};
pub use plan::plan;

/// The wait before each retry of a tick (or of the readiness check) while the database is unreachable: 250 ms,
/// doubled per failure, at most 30 s.
pub const TICK_BACKOFF: Backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(30));

/// The first history pruning runs this long after start (so that restarts do not add load), then every
/// [`PRUNE_EVERY`].
pub const FIRST_PRUNE_AFTER: Duration = Duration::from_secs(600);
pub const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// Why a tick could not look at its work.
#[derive(Debug, thiserror::Error)]
pub enum TickError {
    /// The tick's status query (or its compensation pass) failed: the database is unreachable, restarting, or
    /// not migrated.
    #[error("cannot read the tick status: {}", crate::store::tls::database_error(.0))]
    Database(#[from] sqlx::Error),
    /// The server cannot write (a standby, or read-only transactions): the tick claims nothing.
    #[error("{0}")]
    ReadOnly(String),
    /// A run of the tick lost its connection.
    #[error("a run lost its database connection: {0}")]
    Connection(String),
    /// A shutdown was asked for while the tick waited for the database, before it claimed anything.
    #[error("shutdown requested before the tick could read its status")]
    ShuttingDown,
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

    /// What the failure means for liveness: a database that cannot be reached (or a connection lost) or cannot
    /// write is an outage the replica waits out; anything else failed on a server that answered.
    pub fn liveness(&self) -> TickFailure {
        match self {
            TickError::ReadOnly(_) | TickError::Connection(_) | TickError::ShuttingDown => {
                TickFailure::Outage
            }
            TickError::Database(e) if store::classify(e).transient() => TickFailure::Outage,
            TickError::Database(_) => TickFailure::Error(self.to_string()),
        }
    }
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
    /// The host−database offset the last tick measured: the status statement's bounds come from it.
    db_offset: tick_clock::DbOffset,
    metrics: Arc<Metrics>,
    /// The replica's liveness: `/healthz`, the status page and the systemd watchdog read it.
    heartbeat: Arc<Heartbeat>,
    /// The service manager (systemd), told READY=1 and STATUS=… when `NOTIFY_SOCKET` is set.
    notifier: Option<Arc<Notifier>>,
    /// The compensation pass is failing (logged once per episode, like an outage).
    compensation_failing: bool,
    /// The compensation pass waits for a lagging standby (logged once per episode).
    compensation_held: bool,
    /// Keys already reported as abandoned by this process (each is logged and counted once).
    abandoned: HashSet<(String, NaiveDate)>,
    /// The accrual re-check's schedule, episode and findings.
    rechecks: recheck::Rechecks,
    /// The pauses covering this shard at the last tick (each logged when it starts and when it ends).
    paused: Vec<Pause>,
    /// `[throttle]`, shared by every run of the replica.
    throttle: Arc<Throttle>,
    /// Whether a tick is past its status statement (running keys, compensating, re-checking): only then does a
    /// stop watch whether the database is gone (see [`lifecycle`]).
    in_pass: Arc<AtomicBool>,
    /// The keys the replica's runs hold now: what a stop says about them.
    held: Arc<HeldKeys>,
    /// `accrual.batch_size` cut to the server's lock table ([`store::lock_table`]), once read.
    accrual_batch: tokio::sync::OnceCell<u32>,
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
            settings.database.host_timeout(),
            settings.claim.lease.batch_timeout() + settings.database.host_timeout(),
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
            db_offset: tick_clock::DbOffset::default(),
            metrics,
            heartbeat,
            notifier: None,
            compensation_failing: false,
            compensation_held: false,
            abandoned: HashSet::new(),
            rechecks: recheck::Rechecks::default(),
            paused: Vec::new(),
            throttle,
            in_pass: Arc::default(),
            held: Arc::default(),
            accrual_batch: tokio::sync::OnceCell::new(),
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

    /// Set while a tick is past its status statement (for the stop).
    pub fn in_pass(&self) -> Arc<AtomicBool> {
        self.in_pass.clone()
    }

    /// The keys the replica holds now (for the stop).
    pub fn held(&self) -> Arc<HeldKeys> {
        self.held.clone()
    }

    /// The pool the jobs use (for the readiness probe).
    pub fn pool(&self) -> Db {
        self.pool.clone()
    }

    /// The accrual's batch size: `accrual.batch_size`, cut to this replica's share of a quarter of the server's
    /// lock table if it holds less ([`store::lock_table`]): the fleet's replicas, one per shard, tick on the same
    /// grid and accrue at the same time. Read at the first accrual run (and again after one that could not read
    /// it); a replica started before the server's settings changed keeps the cut it read until it restarts.
    async fn accrual_batch_size(&self) -> u32 {
        let configured = self.settings.accrual.batch_size;
        let replicas = u32::try_from(self.settings.instance.shards()).unwrap_or(u32::MAX);
        let read = self
            .accrual_batch
            .get_or_try_init(|| store::lock_table::fitted(&self.pool, configured, replicas))
            .await;
        match read {
            Ok(size) => *size,
            Err(e) => {
                tracing::debug!(error = %e, "could not read the server's lock table settings; this run keeps accrual.batch_size");
                configured
            }
        }
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
        .with_held_keys(self.held.clone())
    }

    /// Gives an empty fine_policies (a database migrated before the rules moved into it, or by other means) this
    /// deployment's first `default` policy, as `migrate` gives it; a failure is logged, and retried by the next
    /// start.
    pub(crate) async fn seed_rules(&self) {
        self.pool.learn_tls().await;
        if let Err(e) = store::policies::seed_default_by(&self.pool, &self.settings.fine, "run").await {
            tracing::warn!(error = %e, "could not check that fine_policies has a policy");
        }
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
            tracing::info!("replica stopped before it was ready; it held no key");
            return;
        }
        self.seed_rules().await;
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
            self.metrics.set_slot_totals(stats);
            self.tick_through_outages(tick).await;
            if tokio::time::Instant::now() >= next_prune && !shutdown.is_cancelled() {
                self.prune_history().await;
                next_prune = tokio::time::Instant::now() + PRUNE_EVERY;
            }
            scheduler.finished();
        }
        self.hand_back_leftovers().await;
        self.pool.close().await;
        tracing::info!(stats = ?scheduler.stats(), "replica stopped");
    }
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

    /// The tick's own connection waits for a host as long as the pool does: the URL's `connect_timeout` when it
    /// has one (it used to wait `database.connect_timeout`, 10 s by default, for a host the URL gives 2 s).
    #[tokio::test]
    async fn the_tick_s_session_waits_for_a_host_as_the_url_says() {
        let env = crate::testing::env(&[
            ("DATABASE_URL", "postgres://u@h1,h2/db?connect_timeout=2"),
            ("FINE_SETTLER__DATABASE__CONNECT_TIMEOUT", "10s"),
        ]);
        let settings = crate::config::load(None, &env)
            .and_then(|raw| raw.validate(&env))
            .expect("valid");
        let daemon = Daemon::new(
            settings,
            Arc::new(crate::schedule::SystemWall),
            CancellationToken::new(),
            Arc::new(Notify::new()),
        );
        assert_eq!(daemon.session.connect_timeout(), Duration::from_secs(2));
    }

    #[test]
    fn an_unreachable_or_read_only_database_is_an_outage_and_any_other_tick_error_is_not() {
        let refused = || sqlx::Error::Io(std::io::ErrorKind::ConnectionRefused.into());
        for e in [
            TickError::Database(refused()),
            TickError::Database(sqlx::Error::PoolTimedOut),
            TickError::classify(crate::store::ReadOnlyServer::InRecovery.into()),
            TickError::Connection("connection reset".into()),
        ] {
            assert_eq!(e.liveness(), TickFailure::Outage, "{e}");
        }
        let missing = TickError::Database(sqlx::Error::RowNotFound);
        assert_eq!(missing.liveness(), TickFailure::Error(missing.to_string()));
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
