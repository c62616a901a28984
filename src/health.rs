//! The replica's liveness: when it last made progress (a tick, a committed batch, an outage retry), when a tick
//! last read its status, whether its ticks are failing, and the systemd watchdog it feeds. The daemon, the runner
//! and the scheduler report to one [`Heartbeat`]; `/healthz`, `/readyz`, the status page and the watchdog read it.
//!
//! Two kinds of report, kept apart on purpose: *progress* ([`Heartbeat::progress_now`]) is what `/healthz`
//! judges, and it pets the watchdog too; *alive* ([`Heartbeat::alive`]) — a wake of an idle loop, a throttled
//! batch waiting — only pets the watchdog: a loop that wakes but never gets anything done is still stalled for
//! `/healthz`, while restarting a process that is merely waiting (for its slot, a lagging standby) would not help.
//!
//! Progress alone does not make a replica healthy: a tick that fails and is retried is progress for the loop,
//! yet nothing gets settled. So every tick attempt also reports how it ended ([`Heartbeat::tick_succeeded`],
//! [`Heartbeat::tick_failed`]). A failure because the database is unreachable or read-only is an outage
//! ([`TickFailure::Outage`]): the replica waits it out with backoff, restarting it would not help, and `/healthz`
//! stays green (`/readyz` says the database is unavailable). Any other failure — the database answered and the
//! tick failed anyway: a statement timeout, a missing table — starts a *failing* spell, which only a
//! successful tick (or an outage, which is excused) ends: `/readyz` fails at once, and `/healthz` once the spell
//! is older than the liveness window ([`Health::Failing`]).

use std::{
    sync::{
        atomic::{AtomicI64, Ordering},
        Arc, Mutex, OnceLock,
    },
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
    /// The failing spell in progress, if the last tick attempt failed for a reason other than an outage.
    failing: Mutex<Option<Spell>>,
    /// The systemd watchdog, petted on every report.
    watchdog: OnceLock<Arc<Watchdog>>,
    /// Since when (unix ms) tick attempts fail because the database is unreachable or read-only, if they do.
    outage: Mutex<Option<i64>>,
    /// Told when the database answers again while the loop waits out an outage: it retries at once.
    retry: tokio::sync::Notify,
    /// When (unix ms) a probe last ended the loop's wait during a failing spell.
    probe_woke: AtomicI64,
}

/// During a failing spell, a readiness probe ends the loop's backoff at most this often: a retry per probe, not
/// one per request.
pub const PROBE_RETRY_EVERY: Duration = Duration::from_secs(1);

/// Why a tick attempt failed, as far as liveness is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickFailure {
    /// The database is unreachable, or the server cannot write: an outage the replica waits out by itself.
    Outage,
    /// The database answered and the tick failed anyway (a statement timeout, a missing table): the reason, as
    /// logged.
    Error(String),
}

/// A failing spell: since when tick attempts fail for a reason other than an outage.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Spell {
    since_ms: i64,
    attempts: u32,
    reason: String,
}

/// Ticks that keep failing for a reason other than an outage, as `/readyz` and `/healthz` report them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failing {
    /// Since the first failed attempt of the spell.
    pub age: Duration,
    /// Failed attempts in the spell.
    pub attempts: u32,
    /// The last attempt's error.
    pub reason: String,
}

impl std::fmt::Display for Failing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ticks failing for {} ms ({} attempts); last error: {}",
            self.age.as_millis(),
            self.attempts,
            self.reason
        )
    }
}

/// What `/healthz` answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// The last progress is `age` old, within the window, and ticks are not failing for longer than it.
    Live { age: Duration },
    /// No progress for `age`, longer than `window`.
    Stalled { age: Duration, window: Duration },
    /// Ticks have failed, for a reason other than an outage, for longer than `window`.
    Failing { failing: Failing, window: Duration },
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

    /// Notes that a tick read its status now (host clock): the database answered the tick's status statement
    /// (which fails on a read-only server, and is the statement whose failure makes a failing spell), so an
    /// outage or a failing spell is over — the tick goes on to its pass, however long that takes (a catch-up).
    pub fn ticked_now(&self) {
        self.tick.advance_to(unix_now_ms());
        *lock(&self.outage) = None;
        *self.spell() = None;
    }

    /// Unix time in ms of the last tick that read its status (0: none yet).
    pub fn last_tick_ms(&self) -> i64 {
        self.tick.unix_ms()
    }

    /// Notes that a tick attempt succeeded: a failing spell or an outage, if any, is over.
    pub fn tick_succeeded(&self) {
        *self.spell() = None;
        *lock(&self.outage) = None;
    }

    /// Since when (unix ms) the replica's tick attempts have failed for an outage, if the last one did: it is not
    /// ready, whatever a probe of the database finds, until a tick reads its status (or succeeds).
    pub fn outage_since(&self) -> Option<i64> {
        *lock(&self.outage)
    }

    /// Notes that the database answers again (a readiness check found it so) while the loop waits out an outage:
    /// the loop's wait ends, so that it retries at once rather than after its backoff.
    pub fn database_answers(&self) {
        if self.outage_since().is_some() {
            self.retry.notify_one();
        }
    }

    /// Notes that a readiness probe found ticks failing on a server that answers: the loop's wait ends (at most
    /// once per [`PROBE_RETRY_EVERY`]), so that a cause that went away (a lock released, a grant restored) is
    /// seen at the next probe rather than after a backoff of up to 30 s.
    pub fn probed_while_failing(&self, now_ms: i64) {
        let every = i64::try_from(PROBE_RETRY_EVERY.as_millis()).unwrap_or(i64::MAX);
        let last = self.probe_woke.load(Ordering::Relaxed);
        // A clock stepped back counts as a second gone by; of probes racing, one wakes the loop.
        let due = now_ms.saturating_sub(last) >= every || now_ms < last;
        if due
            && self
                .probe_woke
                .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.retry.notify_one();
        }
    }

    /// Resolves once [`Heartbeat::database_answers`] was told during an outage, or
    /// [`Heartbeat::probed_while_failing`] during a failing spell.
    pub async fn database_answered(&self) {
        self.retry.notified().await;
    }

    /// Notes that a tick attempt failed at `unix_ms`. An outage ends a failing spell (the replica is waiting for
    /// the database, as it should); any other failure starts one, or lengthens the one in progress.
    pub fn tick_failed(&self, unix_ms: i64, failure: TickFailure) {
        {
            let mut outage = lock(&self.outage);
            *outage = match failure {
                TickFailure::Outage => Some(outage.unwrap_or(unix_ms)),
                TickFailure::Error(_) => None,
            };
        }
        let mut spell = self.spell();
        *spell = match failure {
            TickFailure::Outage => None,
            TickFailure::Error(reason) => Some(match spell.take() {
                Some(s) => Spell {
                    attempts: s.attempts.saturating_add(1),
                    reason,
                    ..s
                },
                None => Spell {
                    since_ms: unix_ms,
                    attempts: 1,
                    reason,
                },
            }),
        };
    }

    /// The failing spell in progress at `now_ms`, if the last tick attempt failed for a reason other than an
    /// outage (what `/readyz` reports).
    pub fn failing(&self, now_ms: i64) -> Option<Failing> {
        self.spell().as_ref().map(|s| Failing {
            age: millis_between(s.since_ms, now_ms),
            attempts: s.attempts,
            reason: s.reason.clone(),
        })
    }

    /// `/healthz` at `now_ms`: live while the last progress — or the start, `started_ms`, before the first — is
    /// at most `window` old, and ticks have not been failing (other than by an outage) for longer than `window`.
    pub fn health(&self, now_ms: i64, started_ms: i64, window: Duration) -> Health {
        // The start counts only before the first progress: after the host clock stepped back, the start may lie
        // ahead of the progress that follows the step.
        let last = match self.last_progress_ms() {
            0 => started_ms,
            progress => progress,
        };
        let age = millis_between(last, now_ms);
        if age > window {
            return Health::Stalled { age, window };
        }
        match self.failing(now_ms) {
            Some(failing) if failing.age > window => Health::Failing { failing, window },
            _ => Health::Live { age },
        }
    }

    fn spell(&self) -> std::sync::MutexGuard<'_, Option<Spell>> {
        // A reporter that panicked left a whole value behind: the spell is still what it says.
        self.failing.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `m`'s value, even if a reporter panicked while holding it (it left a whole value behind).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The time from `from_ms` to `to_ms` (zero if `to_ms` is earlier: two clocks read out of order).
fn millis_between(from_ms: i64, to_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(to_ms.saturating_sub(from_ms)).unwrap_or(0))
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
    fn ticks_failing_on_a_server_that_answers_fail_readiness_at_once_and_liveness_after_the_window() {
        let beat = Heartbeat::default();
        let window = Duration::from_secs(60);
        let timeout = || TickFailure::Error("canceling statement due to statement timeout".into());
        // Healthy: ticks succeed.
        beat.tick_succeeded();
        beat.progress(1_000_000);
        assert_eq!(beat.failing(1_000_000), None);
        // Failing, retried with backoff: each retry is progress for the loop, so it never stalls ...
        for at in [1_001_000, 1_030_000, 1_060_000] {
            beat.tick_failed(at, timeout());
            beat.progress(at);
        }
        let failing = beat.failing(1_061_000).expect("failing");
        assert_eq!((failing.age, failing.attempts), (Duration::from_secs(60), 3));
        assert!(
            failing.to_string()
                == "ticks failing for 60000 ms (3 attempts); last error: canceling statement due to statement timeout",
            "{failing}"
        );
        // ... and it is live until the spell is older than the window ...
        assert_eq!(
            beat.health(1_061_000, 0, window),
            Health::Live {
                age: Duration::from_secs(1)
            }
        );
        // ... then it fails, saying why.
        beat.progress(1_061_500);
        assert_eq!(
            beat.health(1_061_500, 0, window),
            Health::Failing {
                failing: Failing {
                    age: Duration::from_millis(60_500),
                    attempts: 3,
                    reason: "canceling statement due to statement timeout".into()
                },
                window
            }
        );
        // One successful tick ends the spell.
        beat.tick_succeeded();
        assert_eq!(beat.failing(1_062_000), None);
        assert!(matches!(beat.health(1_062_000, 0, window), Health::Live { .. }));
    }

    #[test]
    fn an_outage_is_waited_out_live_and_ends_a_failing_spell() {
        let beat = Heartbeat::default();
        let window = Duration::from_secs(60);
        // The database unreachable for ten minutes: every retry is progress, none is a failure.
        for at in (0..=600).map(|s| 1_000_000 + s * 1_000) {
            beat.tick_failed(at, TickFailure::Outage);
            beat.progress(at);
        }
        assert_eq!(beat.failing(1_600_000), None);
        assert!(matches!(
            beat.health(1_600_000, 1_000_000, window),
            Health::Live { .. }
        ));
        // A failure, then an outage: the spell is over; a failure after it starts a new one.
        beat.tick_failed(1_600_000, TickFailure::Error("boom".into()));
        beat.tick_failed(1_700_000, TickFailure::Outage);
        assert_eq!(beat.failing(1_700_000), None);
        beat.tick_failed(1_701_000, TickFailure::Error("boom".into()));
        beat.progress(1_760_000);
        assert_eq!(
            beat.failing(1_760_000).map(|f| (f.age, f.attempts)),
            Some((Duration::from_secs(59), 1))
        );
        assert!(matches!(beat.health(1_760_000, 0, window), Health::Live { .. }));
    }

    #[test]
    fn after_the_clock_stepped_back_an_hour_a_stall_is_seen_within_the_window() {
        let beat = Heartbeat::default();
        let window = Duration::from_secs(60);
        let (started, stepped) = (1_700_003_600_000, 1_700_000_000_000);
        beat.progress(started + 1_000);
        // The clock steps back an hour; the replica makes progress once more, then stalls.
        beat.progress(stepped);
        assert_eq!(beat.last_progress_ms(), stepped);
        assert_eq!(
            beat.health(stepped + 30_000, started, window),
            Health::Live {
                age: Duration::from_secs(30)
            }
        );
        assert_eq!(
            beat.health(stepped + 61_000, started, window),
            Health::Stalled {
                age: Duration::from_secs(61),
                window
            }
        );
    }

    /// The work loop's outage is what `/readyz` agrees with: from the first failed attempt until a tick reads its
    /// status or succeeds;
    /// a readiness check that finds the database answering meanwhile ends the loop's wait.
    #[tokio::test]
    async fn an_outage_lasts_until_a_tick_succeeds_and_a_database_that_answers_wakes_the_loop() {
        let beat = Heartbeat::default();
        let woken = || tokio::time::timeout(Duration::from_millis(50), beat.database_answered());
        beat.database_answers();
        assert!(woken().await.is_err(), "no outage: nothing to wake");
        beat.tick_failed(1_000, TickFailure::Outage);
        beat.tick_failed(2_000, TickFailure::Outage);
        assert_eq!(beat.outage_since(), Some(1_000));
        beat.database_answers();
        assert!(woken().await.is_ok(), "the loop's wait ends");
        beat.tick_succeeded();
        assert_eq!(beat.outage_since(), None);
        beat.tick_failed(2_500, TickFailure::Outage);
        beat.ticked_now();
        assert_eq!(
            beat.outage_since(),
            None,
            "a tick that read its status ends the outage"
        );
        beat.tick_failed(3_000, TickFailure::Outage);
        beat.tick_failed(4_000, TickFailure::Error("boom".into()));
        assert_eq!(beat.outage_since(), None, "a server that answers is no outage");
    }

    /// During a failing spell a probe ends the loop's wait, once per second at most.
    #[tokio::test]
    async fn a_probe_during_a_failing_spell_wakes_the_loop_at_most_once_a_second() {
        let beat = Heartbeat::default();
        let woken = || tokio::time::timeout(Duration::from_millis(50), beat.database_answered());
        beat.probed_while_failing(10_000);
        assert!(woken().await.is_ok(), "the first probe wakes the loop");
        beat.probed_while_failing(10_500);
        assert!(
            woken().await.is_err(),
            "a second probe within the second does not"
        );
        beat.probed_while_failing(11_000);
        assert!(woken().await.is_ok(), "a probe a second later does");
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
