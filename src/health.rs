//! The replica's liveness: when it last made progress (a tick, a committed batch, an outage retry), when a tick
//! last read its status, and the systemd watchdog it feeds. The daemon, the runner and the scheduler report to
//! one [`Heartbeat`]; `/healthz`, the status page and the watchdog read it.
//!
//! Two kinds of report, kept apart on purpose: *progress* ([`Heartbeat::progress_now`]) is what `/healthz`
//! judges, and it pets the watchdog too; *alive* ([`Heartbeat::alive`]) — a wake of an idle loop, a throttled
//! batch waiting — only pets the watchdog: a loop that wakes but never gets anything done is still stalled for
//! `/healthz`, while restarting a process that is merely waiting (for its slot, a lagging standby) would not help.

use std::{
    sync::{Arc, OnceLock},
    time::Duration,
};

use crate::{
    metrics::{unix_now_ms, UnixTime},
    sdnotify::Watchdog,
};

/// Liveness of one replica; cheap to report to from any task.
#[derive(Debug, Default)]
pub struct Heartbeat {
    /// The last progress; shared with the metric that exports it, if any.
    progress: UnixTime,
    /// When the last tick read its status (for the status page).
    tick: UnixTime,
    /// The systemd watchdog, petted on every report.
    watchdog: OnceLock<Arc<Watchdog>>,
}

/// What `/healthz` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// The last progress is `age` old, within the window.
    Live { age: Duration },
    /// No progress for `age`, longer than `window`.
    Stalled { age: Duration, window: Duration },
}

impl Heartbeat {
    /// A heartbeat whose last progress is kept in `progress` (e.g. [`crate::metrics::Metrics::last_progress`], so
    /// that the metric shows it).
    pub fn exporting(progress: UnixTime) -> Self {
        Heartbeat {
            progress,
            ..Heartbeat::default()
        }
    }

    /// Routes every report to the systemd watchdog from now on.
    pub fn attach_watchdog(&self, dog: Arc<Watchdog>) {
        let _ = self.watchdog.set(dog);
    }

    /// Notes that the replica made progress at `unix_ms` (a tick, a batch, a retry), and that it is alive.
    pub fn progress(&self, unix_ms: i64) {
        self.progress.advance_to(unix_ms);
        self.alive();
    }

    /// Notes progress now (by the host clock: this is observability, not business time).
    pub fn progress_now(&self) {
        self.progress(unix_now_ms());
    }

    /// Notes that the replica's loop is alive (a wake of the scheduler loop, a throttled wait, or progress):
    /// pets the systemd watchdog, if one is attached. Not progress for `/healthz`.
    pub fn alive(&self) {
        if let Some(dog) = self.watchdog.get() {
            dog.pet();
        }
    }

    /// Unix time in ms of the last progress (0: none yet).
    pub fn last_progress_ms(&self) -> i64 {
        self.progress.unix_ms()
    }

    /// Notes that a tick read its status now (host clock).
    pub fn ticked_now(&self) {
        self.tick.advance_to(unix_now_ms());
    }

    /// Unix time in ms of the last tick that read its status (0: none yet).
    pub fn last_tick_ms(&self) -> i64 {
        self.tick.unix_ms()
    }

    /// `/healthz` at `now_ms`: live while the last progress — or the start, `started_ms`, before the first — is
    /// at most `window` old.
    pub fn health(&self, now_ms: i64, started_ms: i64, window: Duration) -> Health {
        let last = self.last_progress_ms().max(started_ms);
        let age = Duration::from_millis(u64::try_from(now_ms.saturating_sub(last)).unwrap_or(0));
        if age <= window {
            Health::Live { age }
        } else {
            Health::Stalled { age, window }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_counts_the_start_as_progress_and_stalls_after_the_window() {
        let beat = Heartbeat::default();
        let window = Duration::from_secs(60);
        assert_eq!(
            beat.health(1_030_000, 1_000_000, window),
            Health::Live {
                age: Duration::from_secs(30)
            }
        );
        assert_eq!(
            beat.health(1_061_000, 1_000_000, window),
            Health::Stalled {
                age: Duration::from_secs(61),
                window
            }
        );
        beat.progress(1_050_000);
        assert!(matches!(
            beat.health(1_061_000, 1_000_000, window),
            Health::Live { .. }
        ));
        assert_eq!(beat.last_tick_ms(), 0);
        beat.ticked_now();
        assert!(beat.last_tick_ms() > 1_700_000_000_000);
    }

    #[test]
    fn progress_is_exported_through_the_shared_clock() {
        let metrics = crate::metrics::Metrics::new("0/1".into());
        let beat = Heartbeat::exporting(metrics.last_progress());
        beat.progress(1_700_000_000_500);
        assert!(metrics
            .render()
            .contains("fine_settler_last_progress_timestamp_seconds{shard=\"0/1\"} 1700000000.5"));
    }
}
