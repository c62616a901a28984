//! The one place that handles process signals. SIGTERM/SIGINT: the first asks for a graceful shutdown
//! (`shutdown`), the second for an immediate exit (`hard_stop`). SIGHUP: "run now" (`run_now`).

use std::sync::Arc;

use tokio::{
    signal::unix::{signal, SignalKind},
    sync::Notify,
};
use tokio_util::sync::CancellationToken;

use crate::sdnotify::Notifier;

/// What the signals mean to the rest of the program.
#[derive(Debug, Clone)]
pub struct Signals {
    /// Cancelled by the first SIGTERM or SIGINT: stop claiming, finish the batch, hand the key back.
    pub shutdown: CancellationToken,
    /// Cancelled by a second SIGTERM or SIGINT: exit now.
    pub hard_stop: CancellationToken,
    /// Notified by SIGHUP: tick now (dropped if the current slot was already processed).
    pub run_now: Arc<Notify>,
}

impl Signals {
    /// Installs the handlers (on the current tokio runtime).
    pub fn install() -> std::io::Result<Self> {
        Self::install_notifying(None)
    }

    /// Installs the handlers; the first shutdown signal also tells the service manager `STOPPING=1` (before
    /// anything starts draining).
    pub fn install_notifying(notifier: Option<Arc<Notifier>>) -> std::io::Result<Self> {
        let signals = Signals {
            shutdown: CancellationToken::new(),
            hard_stop: CancellationToken::new(),
            run_now: Arc::new(Notify::new()),
        };
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut hup = signal(SignalKind::hangup())?;
        let s = signals.clone();
        tokio::spawn(async move {
            loop {
                let name = tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = int.recv() => "SIGINT",
                    _ = hup.recv() => {
                        tracing::info!(signal = "SIGHUP", "run-now requested");
                        s.run_now.notify_one();
                        continue;
                    }
                };
                if s.shutdown.is_cancelled() {
                    tracing::warn!(signal = name, "second shutdown signal: exiting without draining");
                    s.hard_stop.cancel();
                } else {
                    tracing::info!(
                        signal = name,
                        "shutdown requested: finishing the current batch, then releasing"
                    );
                    if let Some(n) = &notifier {
                        n.send("STOPPING=1\nSTATUS=draining: finishing the current batch, then releasing");
                    }
                    s.shutdown.cancel();
                }
            }
        });
        Ok(signals)
    }
}
