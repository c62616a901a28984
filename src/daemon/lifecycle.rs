//! A replica's life from start to exit: the daemon, the optional HTTP listener, the watchdog, and the drain
//! timeout — one entry point, [`run`], that the command line calls with the process's signals and a test calls
//! with tokens of its own.

use std::{sync::Arc, time::Duration};

use chrono::Utc;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{stop, Daemon, TickError};
use crate::{
    config::Settings,
    http::{self, Probes},
    jobs::RunReport,
    schedule::{due, SystemWall},
    sdnotify::{Notifier, Watchdog},
    signals::Signals,
    status::StatusSource,
};

/// How a replica is told to stop or to tick now, and whom it tells how it is doing.
#[derive(Debug, Clone)]
pub struct Control {
    /// Stop claiming, finish the batch in flight, hand the key back, exit within `schedule.drain_timeout`.
    pub shutdown: CancellationToken,
    /// Exit now, batch or not.
    pub hard_stop: CancellationToken,
    /// Tick now.
    pub run_now: Arc<Notify>,
    /// The service manager's notification socket (systemd's `NOTIFY_SOCKET`).
    pub notifier: Option<Arc<Notifier>>,
    /// The service manager's watchdog, petted on progress.
    pub watchdog: Option<Arc<Watchdog>>,
}

impl Control {
    /// Tokens of the caller's own, no service manager: what a test drives a replica with.
    pub fn new() -> Self {
        Control {
            shutdown: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
            run_now: Arc::new(Notify::new()),
            notifier: None,
            watchdog: None,
        }
    }

    /// The process's signals (see [`Signals`]) and the service manager, if any.
    pub fn from_signals(
        signals: Signals,
        notifier: Option<Arc<Notifier>>,
        watchdog: Option<Arc<Watchdog>>,
    ) -> Self {
        Control {
            shutdown: signals.shutdown,
            hard_stop: signals.hard_stop,
            run_now: signals.run_now,
            notifier,
            watchdog,
        }
    }
}

impl Default for Control {
    fn default() -> Self {
        Control::new()
    }
}

/// How a replica stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// Shut down cleanly: the batch in flight finished and its key was handed back, or the replica held no key.
    Drained,
    /// Told to exit at once (a second SIGTERM).
    HardStop,
    /// The drain took longer than `schedule.drain_timeout`: exited with a batch in flight, whose key is taken
    /// over when its lease expires.
    DrainTimeout,
    /// Told to stop while running keys, and the database was gone: the key could not be handed back; its lease
    /// frees it for a peer.
    DatabaseGone,
}

impl Stopped {
    /// The process's exit code: 0 after a clean drain, 1 otherwise.
    pub fn exit_code(self) -> u8 {
        match self {
            Stopped::Drained => 0,
            Stopped::HardStop | Stopped::DrainTimeout | Stopped::DatabaseGone => 1,
        }
    }
}

/// Why a replica could not start. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("http.listen: cannot listen on {addr}: {error}")]
    Listen {
        addr: std::net::SocketAddr,
        error: std::io::Error,
    },
}

/// Runs a replica until it is told to stop: ticks on the schedule, serves `http.listen` if set, and gives a
/// shutdown `schedule.drain_timeout` to hand its key back. Returns once the HTTP listener has stopped too, so
/// its port is free again.
pub async fn run(settings: Settings, control: Control) -> Result<Stopped, StartError> {
    let drain_timeout = settings.schedule.drain_timeout;
    let connect_timeout = settings.database.host_timeout();
    let http_listen = settings.http_listen;
    let health_window = due::health_window(&settings, Utc::now());
    let status_settings = settings.clone();
    let daemon = replica(settings, &control);
    let listener = match http_listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|error| StartError::Listen { addr, error })?;
            tracing::info!(%addr, "serving /healthz, /readyz, /metrics, /status and /status.json");
            let probes = Probes {
                metrics: daemon.metrics(),
                heartbeat: daemon.heartbeat(),
                pool: daemon.pool(),
                window: health_window,
                started_ms: crate::metrics::unix_now_ms(),
                status: StatusSource::new(
                    &status_settings,
                    daemon.owner(),
                    daemon.metrics(),
                    daemon.heartbeat(),
                ),
            };
            Some(tokio::spawn(http::serve(
                listener,
                probes,
                control.shutdown.clone(),
            )))
        }
        None => None,
    };
    let stopped = until_stopped(daemon, &control, drain_timeout, connect_timeout).await;
    // The listener stops on shutdown (which a hard stop implies).
    control.shutdown.cancel();
    if let Some(listener) = listener {
        if let Err(e) = listener.await {
            tracing::warn!(error = %e, "the http listener ended abnormally");
        }
    }
    Ok(stopped)
}

/// Runs `daemon` until it stops: by itself after a shutdown (drained, or holding no key), at a hard stop, when
/// the database is found gone during a shutdown while the replica ran keys, or at the drain timeout.
async fn until_stopped(
    daemon: Daemon,
    control: &Control,
    drain_timeout: Duration,
    connect_timeout: Duration,
) -> Stopped {
    let (in_pass, held, pool) = (daemon.in_pass(), daemon.held(), daemon.pool());
    // What the replica holds is read as the drain times out or the database is found gone: once a branch of the
    // `select!` below is taken, the replica's future (and with it every run's hold on its key) is dropped.
    let drain_expired = async {
        control.shutdown.cancelled().await;
        tokio::time::sleep(drain_timeout).await;
        (held.running(), held.count())
    };
    let gone = async {
        control.shutdown.cancelled().await;
        let gone = stop::database_gone(&pool, &in_pass, connect_timeout).await;
        (gone, held.count())
    };
    tokio::select! {
        () = daemon.run() => {
            // Drained; a key the replica could not hand back (its claim's answer lost, the database gone since)
            // is said, as when the database is found gone.
            if held.count() > 0 {
                tracing::error!("could not hand the key back; its lease frees it for a peer");
                Stopped::DatabaseGone
            } else {
                Stopped::Drained
            }
        }
        () = control.hard_stop.cancelled() => Stopped::HardStop,
        (stop::DatabaseGone(reason), held_keys) = gone => {
            if held_keys > 0 {
                tracing::error!(
                    reason = %reason,
                    "the database is unreachable: could not hand the key back; its lease frees it for a peer"
                );
                Stopped::DatabaseGone
            } else {
                tracing::warn!(reason = %reason, "the database is unreachable; the replica held no key");
                Stopped::Drained
            }
        }
        (running, held_keys) = drain_expired => {
            if running > 0 {
                tracing::error!(
                    drain_timeout_ms = duration_ms(drain_timeout),
                    "drain timeout: exiting with a batch in flight; its key is taken over when the lease expires"
                );
                Stopped::DrainTimeout
            } else if held_keys > 0 {
                tracing::error!(
                    drain_timeout_ms = duration_ms(drain_timeout),
                    "drain timeout: could not hand the key back; its lease frees it for a peer"
                );
                Stopped::DrainTimeout
            } else {
                tracing::warn!(drain_timeout_ms = duration_ms(drain_timeout), "drain timeout; the replica held no key");
                Stopped::Drained
            }
        }
    }
}

/// One tick, then return its runs' reports (`run --once`).
pub async fn run_once(settings: Settings, control: Control) -> Result<Vec<RunReport>, TickError> {
    let mut daemon = replica(settings, &control);
    daemon.seed_rules().await;
    daemon.tick().await
}

fn replica(settings: Settings, control: &Control) -> Daemon {
    let daemon = Daemon::new(
        settings,
        Arc::new(SystemWall),
        control.shutdown.clone(),
        control.run_now.clone(),
    )
    .with_notifier(control.notifier.clone());
    if let Some(dog) = &control.watchdog {
        daemon.heartbeat().attach_watchdog(dog.clone());
    }
    daemon
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
