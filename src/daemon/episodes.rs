//! What a tick notices and logs once per episode rather than once per tick: the host−database clock skew, the
//! pauses covering this shard, and keys that left their catch-up window without succeeding.

use chrono::{DateTime, Utc};

use super::Daemon;
use crate::{
    jobs::JobName,
    schedule::due,
    store::{job_runs::KeyState, pauses::Pause},
};

impl Daemon {
    /// Logs the host−database clock skew: debug every tick, a warning when it first exceeds `time.max_skew`,
    /// and an info line when it is back within bounds.
    pub(super) fn observe_skew(&mut self, host: DateTime<Utc>, db: DateTime<Utc>) {
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

    /// Logs (at error) and counts each key that left its catch-up window without succeeding, once per process:
    /// without this such a key would drop out of `fine_settler_due_unsettled` and its alert would clear.
    pub(super) fn report_abandoned(&mut self, now: DateTime<Utc>, states: &[KeyState]) {
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
    pub(super) fn observe_pauses(&mut self, pauses: &[Pause]) {
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
}

/// A database time as logged: RFC 3339, milliseconds, UTC.
fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}
