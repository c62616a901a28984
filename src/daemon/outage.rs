//! Waiting for the database: before the replica is ready (connected, every migration applied) and through an
//! outage during a tick. Both retry with [`TICK_BACKOFF`], nap in steps of a second so that the watchdog sees the
//! loop alive, and log an episode once when it starts and once when it ends.

use std::{sync::atomic::Ordering, time::Duration};

use super::{Daemon, TickError, TICK_BACKOFF};
use crate::{
    health::TickFailure,
    jobs::RunReport,
    metrics::unix_now_ms,
    schedule::scheduler::Tick,
    store::{self, StoreError},
};

/// With several hosts in `database.url`, the longest wait between two searches of the hosts during an outage.
pub const HOST_SEARCH_EVERY: Duration = Duration::from_secs(1);

/// An outage in progress: when it started, and whether the server is read-only (rather than unreachable).
#[derive(Debug, Clone, Copy)]
struct Outage {
    started: tokio::time::Instant,
    read_only: bool,
}

impl Daemon {
    /// Sleeps `wait` in naps of at most a second, telling the watchdog the loop is alive (an outage is handled
    /// here; restarting the process would not help). Returns early on shutdown, run-now, or a readiness check
    /// that found the database answering again.
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
                _ = self.heartbeat.database_answered() => return,
                _ = tokio::time::sleep(left.min(Duration::from_secs(1))) => {}
            }
        }
    }

    /// Looks for a server again (the next qualifying host, if the URL lists several), unless a shutdown comes
    /// first: a search of hung hosts takes a connect timeout per host, which a stop does not wait for. Returns
    /// how long to wait before the next attempt, after `failures` failed ones: none when the search moved the
    /// pool to another host (a promoted standby: use it at once); with several hosts at most
    /// [`HOST_SEARCH_EVERY`], so that a promotion is found within about a connect timeout, whatever the backoff
    /// has grown to; otherwise the backoff.
    async fn reconnect(&self, failures: u32) -> Duration {
        let switches = self.pool.switches();
        tokio::select! {
            biased;
            () = self.shutdown.cancelled() => {}
            found = self.pool.reconnect() => if let Err(e) = found {
                tracing::debug!(error = %StoreError::from(e), "no qualifying host yet");
            }
        }
        let backoff = TICK_BACKOFF.delay(failures);
        match (self.pool.switches() != switches, self.pool.follows_hosts()) {
            (true, _) => Duration::ZERO,
            (false, true) => backoff.min(HOST_SEARCH_EVERY),
            (false, false) => backoff,
        }
    }

    /// Waits until the pool connects and every migration is applied (retrying with backoff, logged once), so
    /// that READY=1 means the replica can work. `false` if shut down first — at once, whatever the database is
    /// doing: the replica holds no key yet.
    pub async fn await_ready(&self) -> bool {
        let mut failures = 0u32;
        loop {
            let ready = tokio::select! {
                biased;
                () = self.shutdown.cancelled() => return false,
                ready = store::readiness(&self.pool) => ready,
            };
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
                    // Not ready until a tick reads its status: a `/readyz` that finds the database ready meanwhile
                    // says so, and ends this wait (see `Heartbeat::database_answers`).
                    self.heartbeat
                        .tick_failed(unix_now_ms(), crate::health::TickFailure::Outage);
                    // A connection that found the server read-only (or broken) is not asked again: the next
                    // attempt opens new ones, on the next qualifying host if the URL lists several.
                    let wait = self.reconnect(failures).await;
                    if failures == 1 {
                        tracing::error!(reason = %reason, "not ready: waiting for the database and migrations");
                        self.status(&format!("STATUS=not ready: {reason}"));
                    }
                    self.nap(wait).await;
                    if self.shutdown.is_cancelled() {
                        return false;
                    }
                }
            }
        }
    }

    /// One tick, retried with capped exponential backoff while the database is unreachable. Returns the runs'
    /// reports (empty if shut down before the database came back).
    pub async fn tick_through_outages(&mut self, tick: Tick) -> Vec<RunReport> {
        let mut failures = 0u32;
        let mut outage: Option<Outage> = None;
        loop {
            let result = self.tick().await;
            self.in_pass.store(false, Ordering::SeqCst);
            if matches!(result, Err(TickError::ShuttingDown)) {
                return Vec::new();
            }
            self.heartbeat.progress_now();
            match result {
                Ok(reports) => {
                    self.heartbeat.tick_succeeded();
                    self.metrics.count_tick();
                    if let Some(outage) = outage {
                        self.outage_ended(outage, failures);
                    }
                    return reports;
                }
                Err(e) => {
                    self.heartbeat.tick_failed(unix_now_ms(), e.liveness());
                    self.metrics.count_tick_error();
                    failures += 1;
                    if outage.is_none() {
                        outage = Some(self.outage_began(&e, &tick));
                    }
                    // An outage: drop every connection and look for a server again (the next qualifying host,
                    // if the URL lists several). A failure on a server that answers is no reason to leave it:
                    // back off (a readiness probe ends the wait, see `Heartbeat::probed_while_failing`).
                    let wait = match e.liveness() {
                        TickFailure::Outage => self.reconnect(failures).await,
                        TickFailure::Error(_) => TICK_BACKOFF.delay(failures),
                    };
                    tracing::debug!(error = %e, attempt = failures, backoff_ms = wait.as_millis() as u64, "tick failed");
                    self.nap(wait).await;
                    if self.shutdown.is_cancelled() {
                        return Vec::new();
                    }
                }
            }
        }
    }

    /// Logs (and tells the service manager) that a tick failed with `e`: the start of an outage.
    fn outage_began(&self, e: &TickError, tick: &Tick) -> Outage {
        let started = tokio::time::Instant::now();
        let read_only = matches!(e, TickError::ReadOnly(_));
        if read_only {
            tracing::error!(error = %e, slot = tick.slot,
                "read-only server: claiming nothing; looking for a writable one with backoff");
            self.status("STATUS=connected to a read-only server; retrying with backoff");
        } else if e.liveness() == crate::health::TickFailure::Outage {
            tracing::error!(error = %e, slot = tick.slot, "database unreachable; retrying with backoff");
            self.status("STATUS=database unreachable; retrying with backoff");
        } else {
            // The server answered: a statement timeout, a missing table or grant. Not an outage to wait out:
            // /readyz fails at once and /healthz once it lasts (see health.rs).
            tracing::error!(error = %e, slot = tick.slot, "tick failed on a server that answers; retrying with backoff");
            self.status("STATUS=tick failing; retrying with backoff");
        }
        Outage { started, read_only }
    }

    /// Logs (and tells the service manager) that a tick worked again after `failures` failed attempts.
    fn outage_ended(&self, outage: Outage, failures: u32) {
        let down_ms = outage.started.elapsed().as_millis() as u64;
        if outage.read_only {
            self.status("STATUS=writable server found again");
            tracing::info!(
                down_ms,
                attempts = failures,
                "writable server found again; resuming"
            );
        } else {
            self.status("STATUS=database reachable again");
            tracing::info!(down_ms, attempts = failures, "database reachable again; resuming");
        }
    }
}
