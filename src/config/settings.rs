//! The validated configuration, in the types the code uses: holding a [`Settings`] means every value is in range
//! and every invariant between values holds.

use std::{net::SocketAddr, time::Duration};

use chrono_tz::Tz;
use tracing_subscriber::EnvFilter;

// The URL's types live in their own module; named here too, where they were first defined.
pub use super::database_url::{DatabaseUrl, DatabaseUrlError, TargetSessionAttrs};
use crate::{fine::FinePolicy, shard::ShardSpec};

/// How the daemon's scheduler produces ticks.
#[derive(Debug, Clone)]
pub enum ScheduleMode {
    /// Ticks on a UTC grid of this period, anchored at the Unix epoch.
    FixedRate(Duration),
    /// Waits this long after each tick ends.
    FixedDelay(Duration),
    /// Ticks when the expression matches, in the configured zone.
    Cron(Box<croner::Cron>),
}

#[derive(Debug, Clone)]
pub struct ScheduleSettings {
    pub mode: ScheduleMode,
    pub max_catch_up: u32,
    /// After a shutdown signal, how long the daemon may take to finish its batch and hand its key back.
    pub drain_timeout: Duration,
}

/// Where a tick reads the time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeSource {
    Database,
    System,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Json,
    Pretty,
}

#[derive(Debug, Clone)]
pub struct DatabaseSettings {
    pub url: DatabaseUrl,
    pub max_connections: u32,
    pub connect_timeout: Duration,
    /// What sits between the replica and PostgreSQL (`database.pooler`).
    pub pooler: Pooler,
    /// What the server is (`database.engine`).
    pub engine: Engine,
}

impl DatabaseSettings {
    /// How long a connection to one host is waited for: the URL's `connect_timeout` (libpq's per-host limit),
    /// else `database.connect_timeout`.
    pub fn host_timeout(&self) -> Duration {
        self.url.host_timeout().unwrap_or(self.connect_timeout)
    }
}

/// What sits between fine-settler and PostgreSQL (`database.pooler`), which decides how a connection gets its
/// session settings and whether it may keep prepared statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooler {
    /// A direct connection (or a pooler that hands each client one server connection for its whole session
    /// *and* accepts startup options): settings travel in the startup packet, statements stay prepared.
    None,
    /// A pooler in session mode (PgBouncer `pool_mode = session`): no startup options (PgBouncer rejects
    /// them); the settings are `SET` once per connection, statements stay prepared.
    Session,
    /// A pooler in transaction mode (PgBouncer `pool_mode = transaction`): a server connection is ours only
    /// inside a transaction, so every statement runs in one that first sets its settings `LOCAL`, and no
    /// prepared statement outlives the transaction.
    Transaction,
}

impl Pooler {
    pub fn as_str(self) -> &'static str {
        match self {
            Pooler::None => "none",
            Pooler::Session => "session",
            Pooler::Transaction => "transaction",
        }
    }
}

/// The database engine (`database.engine`): what `migrate` builds and how statements are planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Engine {
    /// One PostgreSQL server (with its standbys).
    #[default]
    Postgresql,
    /// A Citus coordinator: `loans` and fine-settler's per-loan tables are distributed by loan id, colocated;
    /// the policies and the calendar are reference tables; the claims stay on the coordinator (docs/citus.md).
    Citus,
}

impl Engine {
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Postgresql => "postgresql",
            Engine::Citus => "citus",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct ClaimSettings {
    /// The lease and the timeouts that must fit inside it.
    pub lease: Lease,
    /// How long `job_run_attempts` rows are kept.
    pub history_retention: Duration,
}

/// How long a claim stays valid without progress, and the two timeouts that keep a live replica from losing it:
/// `lock_timeout < batch_timeout < duration`, by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    duration: Duration,
    batch_timeout: Duration,
    lock_timeout: Duration,
}

/// Why three durations do not make a [`Lease`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// A batch renews the lease when it commits; a lease no longer than the longest batch would let a peer take
    /// over a replica that is still working.
    #[error("{} must be longer than claim.batch_timeout ({})", fmt_duration(*lease), fmt_duration(*batch_timeout))]
    NotLongerThanBatch {
        lease: Duration,
        batch_timeout: Duration,
    },
    /// A lock wait must end well inside the batch, so that the batch can leave the row and commit the rest.
    #[error("{} must be shorter than claim.batch_timeout ({})", fmt_duration(*lock_timeout), fmt_duration(*batch_timeout))]
    LockNotShorterThanBatch {
        lock_timeout: Duration,
        batch_timeout: Duration,
    },
}

fn fmt_duration(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(d)
}

impl Lease {
    /// A lease of `duration`; an unset timeout is derived ([`derived_batch_timeout`], [`derived_lock_timeout`]).
    /// The error lists every invariant the values break.
    pub fn new(
        duration: Duration,
        batch_timeout: Option<Duration>,
        lock_timeout: Option<Duration>,
    ) -> Result<Self, Vec<LeaseError>> {
        let batch_timeout = batch_timeout.unwrap_or_else(|| derived_batch_timeout(duration));
        let lock_timeout = lock_timeout.unwrap_or_else(|| derived_lock_timeout(batch_timeout));
        let broken: Vec<LeaseError> = [
            Lease::check_batch(duration, batch_timeout),
            Lease::check_lock(batch_timeout, lock_timeout),
        ]
        .into_iter()
        .filter_map(Result::err)
        .collect();
        if !broken.is_empty() {
            return Err(broken);
        }
        Ok(Lease {
            duration,
            batch_timeout,
            lock_timeout,
        })
    }

    /// The lease must be longer than the longest batch.
    pub fn check_batch(lease: Duration, batch_timeout: Duration) -> Result<(), LeaseError> {
        if lease <= batch_timeout {
            return Err(LeaseError::NotLongerThanBatch { lease, batch_timeout });
        }
        Ok(())
    }

    /// A lock wait must be shorter than the batch it happens in.
    pub fn check_lock(batch_timeout: Duration, lock_timeout: Duration) -> Result<(), LeaseError> {
        if lock_timeout >= batch_timeout {
            return Err(LeaseError::LockNotShorterThanBatch {
                lock_timeout,
                batch_timeout,
            });
        }
        Ok(())
    }

    /// How long a claim stays valid without progress; every committed batch renews it.
    pub fn duration(self) -> Duration {
        self.duration
    }

    /// The statement timeout of every batch (and the longest a batch transaction may take); shorter than the
    /// lease, so a live replica's lease never lapses mid-batch.
    pub fn batch_timeout(self) -> Duration {
        self.batch_timeout
    }

    /// How long a batch statement waits for a row lock (libraryd's, or another run's) before it leaves the row
    /// for later; shorter than the batch timeout, so a lock wait never fails a batch.
    pub fn lock_timeout(self) -> Duration {
        self.lock_timeout
    }
}

/// `claim.batch_timeout` when it is not set: a quarter of the lease, at most 30 s — so that a lease of any length
/// works on its own, and a healthy replica renews its lease several times before it could run out.
pub fn derived_batch_timeout(lease: Duration) -> Duration {
    whole_millis(lease / 4).min(Duration::from_secs(30))
}

fn whole_millis(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `claim.lock_timeout` when it is not set: a sixth of the batch timeout, at most 5 s (and at least 10 ms) —
/// long enough to ride out libraryd's short transactions, short enough that a batch that meets a row libraryd
/// keeps locked still has the time to leave that row and commit the rest.
pub fn derived_lock_timeout(batch_timeout: Duration) -> Duration {
    whole_millis(batch_timeout / 6).clamp(MIN_LOCK_TIMEOUT, Duration::from_secs(5))
}

/// The shortest lock wait ever derived.
pub const MIN_LOCK_TIMEOUT: Duration = Duration::from_millis(10);

/// The shortest `claim.lease` whose derived batch timeout leaves room for the shortest derived lock wait.
pub const MIN_DERIVING_LEASE: Duration = Duration::from_millis(4 * (MIN_LOCK_TIMEOUT.as_millis() as u64 + 1));

/// `log.level`: a filter `tracing-subscriber` accepts (e.g. `info`, `fine_settler=debug,sqlx=warn`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogFilter(String);

impl LogFilter {
    pub fn parse(filter: &str) -> Result<Self, String> {
        EnvFilter::try_new(filter)
            .map(|_| LogFilter(filter.to_string()))
            .map_err(|e| format!("{filter:?} is not a valid filter: {e}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[derive(Debug, Clone, Copy)]
pub struct SettlementSettings {
    pub enabled: bool,
    pub batch_size: u32,
    pub catch_up_months: u32,
}

#[derive(Debug, Clone, Copy)]
pub struct AccrualSettings {
    pub enabled: bool,
    pub batch_size: u32,
    pub catch_up_days: u32,
    pub max_attempts: u32,
    /// Delay before the first retry of a failed charge; doubled per attempt up to `retry_backoff_max`.
    pub retry_backoff: Duration,
    pub retry_backoff_max: Duration,
    /// How often a tick also asks whether loans became overdue on accrual days that already succeeded (a loan
    /// recorded late, a due date shortened). The question walks the overdue loans still out, so unlike
    /// settlement's it is not asked at every tick.
    pub recheck_every: Duration,
}

/// The validated configuration. Holding one means every value is in range.
#[derive(Debug, Clone)]
pub struct Settings {
    pub database: DatabaseSettings,
    pub instance: ShardSpec,
    pub schedule: ScheduleSettings,
    pub zone: Tz,
    pub time_source: TimeSource,
    /// Warn when the host clock and the database clock differ by more than this.
    pub max_skew: Duration,
    pub claim: ClaimSettings,
    pub settlement: SettlementSettings,
    pub accrual: AccrualSettings,
    pub fine: FinePolicy,
    pub log_format: LogFormat,
    pub log_level: LogFilter,
    pub http_listen: Option<SocketAddr>,
    pub throttle: ThrottleSettings,
}

/// How gently runs treat libraryd's traffic (`[throttle]`); every limit is off by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ThrottleSettings {
    /// The most rows a run works per second, on average (`None`: unlimited).
    pub max_rows_per_second: Option<u32>,
    /// The pace adapts to keep a probe's commit latency within this budget (`None`: off).
    pub max_commit_latency: Option<Duration>,
    /// Batches wait while a standby lags more than this (`None`: off).
    pub max_replica_lag: Option<Duration>,
    /// The `application_name`s of the standbys the lag limit watches (empty: every standby).
    pub standbys: Vec<String>,
    /// A batch transaction that takes longer makes the next batch smaller (`None`: off).
    pub batch_duration: Option<Duration>,
}
