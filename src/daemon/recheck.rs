//! The accrual re-check: a step of the tick on its own schedule (`accrual.recheck_every`), apart from the tick's
//! status statement. It asks which days of the accrual window a loan libraryd changed still needs — a charge or a
//! correction ([`corrections::recheck`]) — and the tick re-opens those days' keys, each run looking only at the
//! changed loans ([`Scope::Changed`]). Its cost grows with the changes queued, not with the library's history.
//!
//! A re-check that fails or runs out of time (`claim.batch_timeout`) is its own episode: logged once (and when it
//! ends), counted (`fine_settler_recheck_errors_total`), retried at its next turn (looking at half as many changes
//! if it ran out of time) — never a database outage, and never in the way of settlement or of the accrual's due
//! keys.

use std::collections::BTreeSet;

use chrono::{DateTime, NaiveDate, Utc};

use super::Daemon;
use crate::{
    calendar,
    jobs::JobName,
    schedule::due,
    store::{
        corrections::{self, Recheck},
        job_runs::{KeyState, RunStatus},
        StoreError,
    },
};

/// The most queued changes one re-check looks at; more wait for the next one, which then comes at the next tick.
pub const CHANGES_PER_RECHECK: i64 = 10_000;

/// The fewest: a re-check that runs out of time looks at half as many changes the next time, down to this.
pub const MIN_CHANGES_PER_RECHECK: i64 = 100;

/// The re-check's state between ticks.
#[derive(Debug)]
pub(super) struct Rechecks {
    /// How many queued changes the next re-check looks at: halved after a re-check that ran out of time, doubled
    /// after one that completed with more waiting (a bulk import queues many), within
    /// [`MIN_CHANGES_PER_RECHECK`]..=[`CHANGES_PER_RECHECK`].
    limit: i64,
    /// When the last re-check succeeded.
    last: Option<tokio::time::Instant>,
    /// The last re-check left changes unread: the next tick re-checks again.
    more: bool,
    /// Accrual days the last re-check found work on, not yet settled by a run since.
    pub(super) reopen: BTreeSet<NaiveDate>,
    /// The re-check is failing (logged once per episode).
    failing: bool,
}

impl Default for Rechecks {
    fn default() -> Self {
        Rechecks {
            limit: 1_000,
            last: None,
            more: false,
            reopen: BTreeSet::new(),
            failing: false,
        }
    }
}

impl Rechecks {
    /// Whether a tick now should re-check: never yet, the interval passed, or the last one left changes unread.
    fn due(&self, every: std::time::Duration) -> bool {
        self.more || self.last.is_none_or(|at| at.elapsed() >= every)
    }

    /// Marks the accrual keys of `keys` whose day has work as late (SUCCESS keys are then re-opened).
    pub(super) fn mark(&self, keys: &mut [KeyState]) {
        mark_late(keys, &self.reopen);
    }

    /// A run of `day` settled: its re-opened work is done until a re-check finds more.
    pub(super) fn settled(&mut self, day: NaiveDate) {
        self.reopen.remove(&day);
    }
}

/// Marks the SUCCESS accrual keys of `keys` whose business date is one of `days` as late.
pub fn mark_late(keys: &mut [KeyState], days: &BTreeSet<NaiveDate>) {
    for k in keys.iter_mut() {
        if k.job_name == JobName::OverdueAccrual.as_str() && k.status == RunStatus::Success {
            k.late = days.contains(&k.business_date);
        }
    }
}

/// The accrual window a re-check at `now` covers: the catch-up window's days (`None` with accrual disabled).
pub fn window(settings: &crate::config::Settings, now: DateTime<Utc>) -> Option<(NaiveDate, NaiveDate)> {
    if !settings.accrual.enabled {
        return None;
    }
    let days = due::accrual_due(
        calendar::local_date(now, settings.zone),
        settings.accrual.catch_up_days,
    );
    Some((*days.first()?, *days.last()?))
}

impl Daemon {
    /// Re-checks the changed loans if it is time to, within `claim.batch_timeout`; on success the days found
    /// replace the days to re-open.
    pub(super) async fn recheck_if_due(&mut self, now: DateTime<Utc>) {
        let Some((first, last)) = window(&self.settings, now) else {
            return;
        };
        if !self.rechecks.due(self.settings.accrual.recheck_every) {
            return;
        }
        let timeout = self.settings.claim.lease.batch_timeout();
        let asked = corrections::recheck(
            &self.pool,
            self.settings.instance,
            first,
            last,
            self.rechecks.limit,
            true,
            timeout,
        );
        match tokio::time::timeout(timeout, asked).await {
            Ok(Ok(found)) => {
                if found.more {
                    self.rechecks.limit = (self.rechecks.limit * 2).min(CHANGES_PER_RECHECK);
                }
                self.rechecked(found)
            }
            Ok(Err(e)) => self.recheck_failed(StoreError::from(e).to_string()),
            Err(_) => {
                let limit = self.rechecks.limit;
                self.rechecks.limit = (limit / 2).max(MIN_CHANGES_PER_RECHECK);
                self.recheck_failed(format!(
                    "did not complete within {} (claim.batch_timeout) looking at {limit} changed loans; the next \
                     looks at {}",
                    humantime::format_duration(timeout),
                    self.rechecks.limit
                ))
            }
        }
    }

    fn rechecked(&mut self, found: Recheck) {
        if std::mem::take(&mut self.rechecks.failing) {
            tracing::info!("accrual re-check works again");
        }
        for loan_id in &found.orphaned {
            tracing::warn!(
                loan_id,
                "loan deleted by libraryd has ledger rows; nothing is corrected for it (its ledger stays as charged)"
            );
        }
        self.metrics.observe_recheck(found.dirty, found.orphaned.len());
        let level_info = !found.days.is_empty();
        if level_info {
            tracing::info!(changed = found.changed, dirty = found.dirty, cleared = found.cleared,
                days = ?found.days, more = found.more, "accrual re-check: days to re-open");
        } else {
            tracing::debug!(
                changed = found.changed,
                cleared = found.cleared,
                more = found.more,
                "accrual re-check"
            );
        }
        self.rechecks.reopen = found.days.into_iter().collect();
        self.rechecks.more = found.more;
        self.rechecks.last = Some(tokio::time::Instant::now());
    }

    /// A failed re-check waits for its next turn (`accrual.recheck_every`), so that one that cannot complete does
    /// not spend `claim.batch_timeout` of every tick.
    fn recheck_failed(&mut self, error: String) {
        self.rechecks.last = Some(tokio::time::Instant::now());
        self.rechecks.more = false;
        self.metrics.count_recheck_error();
        if !std::mem::replace(&mut self.rechecks.failing, true) {
            tracing::error!(error = %error,
                "accrual re-check failed; settlement and the accrual's due keys go on, retrying at the next tick");
        } else {
            tracing::debug!(error = %error, "accrual re-check failed again");
        }
    }
}
