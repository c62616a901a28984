//! The one clock of a tick. With `time.source = "database"` every date a tick computes comes from the database's
//! time — the plan, the re-check's window, and also the bounds the status statement asks about (the oldest key
//! it reads, the settlement keys it probes for late rows), which must be known *before* the statement that reads
//! the database's time. They are computed from an estimate: the host's time minus the host−database offset the
//! last tick measured. When the estimate was wrong about those bounds (the first tick of a process on a skewed
//! host, a step of either clock) the statement is asked again with the database's own time, so a host clock
//! running ahead or behind never hides a late return; an idle tick with a settled offset stays one statement.

use std::sync::atomic::Ordering;

use chrono::{DateTime, Utc};

use super::{Daemon, TickError};
use crate::{
    config::TimeSource,
    schedule::due,
    store::job_runs::{LateProbe, TickStatus},
};

/// The host clock minus the database's, as the last tick measured it.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct DbOffset(Option<chrono::Duration>);

impl DbOffset {
    /// The database's time when the host's is `host` (the host's own before any measurement).
    fn estimate(self, host: DateTime<Utc>) -> DateTime<Utc> {
        self.0
            .and_then(|offset| host.checked_sub_signed(offset))
            .unwrap_or(host)
    }

    /// Notes that the database's time was `db` when the host's was `host`.
    pub(super) fn measured(&mut self, host: DateTime<Utc>, db: DateTime<Utc>) {
        self.0 = Some(host - db);
    }
}

/// What the status statement asks about, for a tick at `at`.
fn bounds(settings: &crate::config::Settings, at: DateTime<Utc>) -> (chrono::NaiveDate, LateProbe) {
    (due::window_start(settings, at), due::late_probe(settings, at))
}

impl Daemon {
    /// The tick's status statement, asked about the bounds of the tick's own clock: the database's time (through
    /// the estimate, checked against the time the statement read) or, with `time.source = "system"`, the host's
    /// time `host`.
    ///
    /// A shutdown ends the wait at once ([`TickError::ShuttingDown`]): nothing is claimed before this statement
    /// answers, so there is nothing to drain. Once it answered, the tick may claim keys: it is in its pass.
    pub(super) async fn read_status_on_tick_clock(
        &mut self,
        host: DateTime<Utc>,
    ) -> Result<TickStatus, TickError> {
        let shutdown = self.shutdown.clone();
        let status = tokio::select! {
            biased;
            () = shutdown.cancelled() => Err(TickError::ShuttingDown),
            status = self.read_status_by_tick_clock(host) => status,
        };
        if status.is_ok() {
            self.in_pass.store(true, Ordering::SeqCst);
        }
        status
    }

    async fn read_status_by_tick_clock(&mut self, host: DateTime<Utc>) -> Result<TickStatus, TickError> {
        if self.settings.time_source == TimeSource::System {
            return self.read_status(host).await;
        }
        let estimate = self.db_offset.estimate(host);
        let status = self.read_status(estimate).await?;
        if bounds(&self.settings, estimate) == bounds(&self.settings, status.now) {
            return Ok(status);
        }
        tracing::debug!(
            estimate = %estimate,
            database_now = %status.now,
            "the tick's estimate of the database's date was off: reading the status again by the database's time"
        );
        self.read_status(status.now).await
    }
}
