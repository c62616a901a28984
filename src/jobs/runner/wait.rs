//! The throttle's waits before a batch: while a standby lags past the limit, then for the pace. A wait keeps the
//! lease rules — the waiting run renews its lease through the batch fence — and each episode of waiting is
//! logged once, at its start and at its end.

use std::time::Duration;

use tokio::time::Instant;

use super::{
    retry::retrying,
    walk::{Stop, Walk},
    JobError, Runner,
};
use crate::{
    config::ThrottleSettings,
    jobs::{
        throttle::{Lagging, Probed, Reason, Unknown, Verdict, LAG_POLL},
        RunKey,
    },
    store::{
        job_runs::{ClaimedRun, Fence},
        pauses::Pause,
    },
};

/// How often a probe over `throttle.max_commit_latency` is said in the log, at most (each is at debug).
const SAY_OVER_EVERY: Duration = Duration::from_secs(10);

impl Runner {
    /// Waits before a batch for as long as the throttle asks — while a standby lags past the limit, then for
    /// the pace, which admits the batch's `limit` rows — and returns how the run must stop instead, if it must.
    ///
    /// A wait keeps the lease rules: the run renews its lease through the batch fence (the key RUNNING under its
    /// epoch and owner at its last committed cursor) every [`Runner::renew_every`], so a live, waiting run never
    /// lets its lease run out, and a run that lost its key learns so while it waits. The renewal also sees a
    /// pause of the job (the run hands its key back, as after a batch), and a shutdown ends the wait at once.
    pub(super) async fn throttled(
        &self,
        run: &ClaimedRun,
        limit: u32,
        walk: &mut Walk,
    ) -> Result<Option<Stop>, JobError> {
        loop {
            let lagging = self.lagging(&mut walk.episodes).await;
            if !lagging {
                self.probe_commit_latency(&mut walk.episodes);
            }
            let renew_at = walk.renewed + self.renew_every();
            let wait = if lagging {
                Some((Reason::ReplicaLag, LAG_POLL))
            } else if Instant::now() >= renew_at {
                // A batch about to start renews first if a renewal is due: it may take the whole batch timeout.
                None
            } else {
                match self.throttle.admit(limit) {
                    None => return Ok(None),
                    Some(wait) => {
                        let reason = self.throttle.pace_reason();
                        walk.episodes.rate_wait(reason, self.throttle.settings());
                        Some((reason, wait))
                    }
                }
            };
            if let Some((reason, wait)) = wait {
                let slice = wait.min(renew_at.saturating_duration_since(Instant::now()));
                if let Some(stop) = self.sleep(run.key(), reason, slice, &mut walk.episodes).await {
                    return Ok(Some(stop));
                }
            }
            if Instant::now() >= renew_at {
                if let Some(stop) = self.renew(run).await? {
                    return Ok(Some(stop));
                }
                walk.renewed = Instant::now();
            }
        }
    }

    /// Whether a batch must wait for a standby: one lags more than `throttle.max_replica_lag` now, or its lag is
    /// not known yet (see [`crate::jobs::throttle`]). The check is advisory: if it cannot be read (the statement
    /// fails), the batch goes on, and a broken connection fails that batch as it would have anyway.
    async fn lagging(&self, episodes: &mut Episodes) -> bool {
        match self.throttle.lagging(&self.pool).await {
            Ok(Verdict::Lagging(lagging)) => {
                let limit = self.throttle.settings().max_replica_lag.unwrap_or_default();
                episodes.lag_start(&lagging, limit);
                true
            }
            Ok(Verdict::Unknown(unknown)) => {
                episodes.unknown_start(&unknown);
                true
            }
            Ok(Verdict::Clear) => {
                episodes.lag_end("no standby lags more than throttle.max_replica_lag");
                false
            }
            Err(e) => {
                episodes.lag_unreadable(&JobError::from(e));
                false
            }
        }
    }

    /// Under `throttle.max_commit_latency`: a probe started in the background when one is due, and what the last
    /// finished one did to the rate (see [`crate::jobs::throttle::latency`]) told to the metrics and the log.
    fn probe_commit_latency(&self, episodes: &mut Episodes) {
        let Some(probed) = self.throttle.probe(&self.pool) else {
            return;
        };
        let budget = self.throttle.settings().max_commit_latency.unwrap_or_default();
        if let Some(m) = &self.metrics {
            m.set_commit_latency(probed.latency, budget, probed.to);
        }
        episodes.probed(&probed, budget);
    }

    /// Sleeps one `slice` of a wait for `reason`, counting the time actually slept; a shutdown ends the sleep at
    /// once and the run with it.
    async fn sleep(
        &self,
        key: &RunKey,
        reason: Reason,
        slice: Duration,
        episodes: &mut Episodes,
    ) -> Option<Stop> {
        let slept = Instant::now();
        tokio::select! {
            _ = self.cancel.cancelled() => return Some(Stop::Shutdown),
            _ = tokio::time::sleep(slice) => {}
        }
        let slept = slept.elapsed();
        if matches!(reason, Reason::Rate | Reason::CommitLatency) {
            episodes.rate_waited(slept);
        }
        if let Some(m) = &self.metrics {
            m.add_throttled(key.job, reason, slept.as_secs_f64());
        }
        if let Some(h) = &self.heartbeat {
            h.alive();
        }
        None
    }

    /// Renews the lease of the waiting run; how it must stop instead, if the renewal found the key lost or
    /// paused. Retried like the finish: a connection cut during a long wait need not fail the run.
    async fn renew(&self, run: &ClaimedRun) -> Result<Option<Stop>, JobError> {
        match retrying("renew the lease", &self.pool, || run.renew()).await? {
            Fence::Lost => return Ok(Some(Stop::LeaseLost)),
            Fence::Passed {
                paused: Some((by, reason)),
            } if !self.ignore_pause => {
                tracing::warn!(cursor = run.cursor(), paused_by = %by, reason = %reason,
                    "job paused while throttled: handing the key back");
                return Ok(Some(Stop::Paused(Pause::run_error(&by, &reason))));
            }
            Fence::Passed { .. } => {}
        }
        tracing::debug!(cursor = run.cursor(), "lease renewed while throttled");
        if let Some(h) = &self.heartbeat {
            h.progress_now();
        }
        Ok(None)
    }
}

/// The throttle waits of one run, so that each episode is logged once: its start with the reason, its end with
/// how long it lasted. Waits for the pace follow every batch, so the pace's episode is the whole run.
#[derive(Debug, Default)]
pub(super) struct Episodes {
    /// The pace's episode: why it paces, since when, and how long it waited in all.
    rate: Option<(Reason, Instant, Duration)>,
    /// When a probe over `throttle.max_commit_latency` was last said (at most every [`SAY_OVER_EVERY`]).
    over_said: Option<Instant>,
    /// A wait for the standbys is in progress, since then.
    lag: Option<Instant>,
    /// In this wait, a standby was said to lag; a standby's lag was said to be unknown.
    lag_said: bool,
    unknown_said: bool,
    /// The lag check failed in this run (said once).
    lag_unreadable: bool,
}

impl Episodes {
    /// A wait for the pace begins (the episode's first is logged).
    fn rate_wait(&mut self, reason: Reason, settings: &ThrottleSettings) {
        if self.rate.is_some() {
            return;
        }
        match settings.max_commit_latency {
            Some(budget) => tracing::info!(
                reason = reason.as_str(),
                max_commit_latency = %humantime::format_duration(budget),
                "throttled: batches paced to keep commits within throttle.max_commit_latency"
            ),
            None => tracing::info!(
                reason = reason.as_str(),
                max_rows_per_second = settings.max_rows_per_second.unwrap_or(0),
                "throttled: batches paced to throttle.max_rows_per_second"
            ),
        }
        self.rate = Some((reason, Instant::now(), Duration::ZERO));
    }

    /// Time actually slept for the pace.
    fn rate_waited(&mut self, slept: Duration) {
        if let Some((_, _, total)) = &mut self.rate {
            *total += slept;
        }
    }

    /// A probe of the commit latency: over the budget, said at most every [`SAY_OVER_EVERY`]; every one at debug.
    fn probed(&mut self, probed: &Probed, budget: Duration) {
        let latency_us = probed.latency.as_micros() as u64;
        let slowed = probed.over && probed.to < probed.from;
        if slowed && self.over_said.is_none_or(|at| at.elapsed() >= SAY_OVER_EVERY) {
            self.over_said = Some(Instant::now());
            tracing::info!(
                reason = Reason::CommitLatency.as_str(),
                latency_us,
                max_commit_latency = %humantime::format_duration(budget),
                rows_per_second = probed.to.round() as u64,
                "throttled: a commit took longer than throttle.max_commit_latency; the pace slows to {:.0} rows/s",
                probed.to
            );
        } else {
            tracing::debug!(
                latency_us,
                over = probed.over,
                from = probed.from.round() as u64,
                rows_per_second = probed.to.round() as u64,
                "commit latency probed"
            );
        }
    }

    fn lag_start(&mut self, lagging: &Lagging, limit: Duration) {
        self.lag.get_or_insert_with(Instant::now);
        if !self.lag_said {
            self.lag_said = true;
            tracing::warn!(reason = Reason::ReplicaLag.as_str(), standby = %lagging.standby,
                unreplayed_bytes = lagging.unreplayed_bytes,
                replay_lag_ms = lagging.replay_lag.map(|l| l.as_millis() as u64),
                behind_ms = lagging.behind.as_millis() as u64,
                max_replica_lag = %humantime::format_duration(limit),
                "throttled: a standby lags more than throttle.max_replica_lag; batches wait ({lagging})");
        }
    }

    fn unknown_start(&mut self, unknown: &Unknown) {
        self.lag.get_or_insert_with(Instant::now);
        if !self.unknown_said && !self.lag_said {
            self.unknown_said = true;
            tracing::info!(reason = Reason::ReplicaLag.as_str(), standby = %unknown.standby,
                unreplayed_bytes = unknown.unreplayed_bytes,
                "throttled: a standby's lag is not known yet; batches wait ({unknown})");
        }
    }

    fn lag_unreadable(&mut self, error: &JobError) {
        if !self.lag_unreadable {
            tracing::warn!(error = %error, "cannot read pg_stat_replication; this batch goes on without the replica lag limit");
            self.lag_unreadable = true;
        }
    }

    fn lag_end(&mut self, why: &str) {
        self.lag_said = false;
        self.unknown_said = false;
        if let Some(started) = self.lag.take() {
            tracing::info!(
                reason = Reason::ReplicaLag.as_str(),
                waited_ms = started.elapsed().as_millis() as u64,
                "throttle released: {why}"
            );
        }
    }

    /// The run ended: any episode in progress ends with it.
    pub(super) fn end(&mut self) {
        self.lag_end("the run ended");
        if let Some((reason, started, waited)) = self.rate.take() {
            tracing::info!(
                reason = reason.as_str(),
                waited_ms = waited.as_millis() as u64,
                over_ms = started.elapsed().as_millis() as u64,
                "throttle released: the run ended"
            );
        }
    }
}
