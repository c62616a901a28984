//! One tick, in the steps a reader would name: look (one status statement: the time, the shard's keys, its
//! pending charges and pauses), compensate (retry the due pending charges), re-check (on its own schedule: the
//! accrual days a changed loan still needs), notice (abandoned keys, pauses), plan (the due keys not yet SUCCESS,
//! and the SUCCESS ones to re-open), run the pass over them, and record how many stay due.

use std::collections::HashSet;

use chrono::{DateTime, Utc};

use super::{Daemon, TickError};
use crate::{
    config::TimeSource,
    jobs::{accrual::Accrual, settlement::Settlement, JobName, Outcome, RunKey, RunReport},
    schedule::due::{self, Due, Pass},
    shard::ShardSpec,
    store::{
        job_runs::{Action, ClaimMode, TickStatus},
        ledger::Scope,
    },
};

/// What a tick saw: the status statement's answer, and the time the tick goes by (the database's or the host's,
/// as `time.source` says).
#[derive(Debug)]
struct Seen {
    status: TickStatus,
    now: DateTime<Utc>,
}

impl Daemon {
    /// One tick: read the time, the shard's keys and its due pending charges (one statement); retry the due
    /// pending charges; then run every due key not yet SUCCESS, oldest first per job.
    pub async fn tick(&mut self) -> Result<Vec<RunReport>, TickError> {
        let Seen { mut status, now } = self.look().await?;
        self.compensate_if_due(&status).await;
        self.recheck_if_due(now).await;
        self.rechecks.mark(&mut status.keys);
        self.report_abandoned(now, &status.keys);
        self.observe_pauses(&status.pauses);
        let todo: Vec<Due> = due::plan(&self.settings, now, &status.keys, &status.pauses)
            .into_iter()
            .filter(|d| d.runs)
            .collect();
        if todo.is_empty() {
            self.record_unsettled(&todo, &[]);
            tracing::debug!(%now, "tick: nothing due");
            return Ok(Vec::new());
        }
        let reports = self.run_pass(&todo, status.now).await?;
        self.record_unsettled(&todo, &reports);
        for r in reports
            .iter()
            .filter(|r| r.job == JobName::OverdueAccrual.as_str())
        {
            if r.outcome == Outcome::Settled {
                self.rechecks.settled(r.business_date);
            }
        }
        Ok(reports)
    }

    /// Reads the tick status (the time is read once, here), logs the clock skew, and sets the queue's gauges.
    async fn look(&mut self) -> Result<Seen, TickError> {
        let before = self.wall.now();
        let status = self.read_status_on_tick_clock(before).await?;
        self.heartbeat.ticked_now();
        let after = self.wall.now();
        self.db_offset.measured(before + (after - before) / 2, status.now);
        self.observe_skew(before + (after - before) / 2, status.now);
        let now = match self.settings.time_source {
            TimeSource::Database => status.now,
            TimeSource::System => after,
        };
        self.metrics.set_pending(status.pending, status.dead);
        self.metrics.set_keys_unclaimed(status.unclaimed);
        Ok(Seen { status, now })
    }

    /// Retries the shard's due pending charges, if accrual is enabled, some are due, and accrual is not paused:
    /// a paused accrual charges nothing, its queue included (as `accrue` refuses before its pass).
    async fn compensate_if_due(&mut self, status: &TickStatus) {
        let accrual_paused = status
            .pauses
            .iter()
            .any(|p| p.job_name == JobName::OverdueAccrual.as_str());
        if self.settings.accrual.enabled && status.due_pending > 0 && !accrual_paused {
            self.compensate(self.settings.instance).await;
        }
    }

    /// Runs the due keys `todo`, oldest first per job, until each was visited once or a shutdown is asked for. A
    /// key another replica holds is visited again once its holder's lease has ended (by `db_now`, the status
    /// statement's database time, advanced by the time the pass has taken). A run that finds its job paused (at
    /// its fence) ends that job's part of the pass. A read-only server or a lost connection ends the pass with an
    /// error, for the outage loop.
    async fn run_pass(&self, todo: &[Due], db_now: DateTime<Utc>) -> Result<Vec<RunReport>, TickError> {
        let shard = self.settings.instance;
        let mut reports = Vec::with_capacity(todo.len());
        let pass_started = tokio::time::Instant::now();
        let mut pass = Pass::new(todo);
        // Jobs a run of this pass found paused (at its fence): the pass starts no further key of them.
        let mut paused_now: HashSet<JobName> = HashSet::new();
        while !self.shutdown.is_cancelled() {
            let now = db_now + chrono::Duration::from_std(pass_started.elapsed()).unwrap_or_default();
            let Some(visit) = pass.next_at(now) else {
                break;
            };
            if paused_now.contains(&visit.key.job) {
                continue;
            }
            let switches = self.pool.switches();
            let report = self.run_due(visit.key, shard).await;
            self.still_connected(&report, switches)?;
            if report.paused {
                paused_now.insert(visit.key.job);
            }
            if let Some(until) = report.held_until {
                pass.held(visit, until);
            }
            reports.push(report);
        }
        Ok(reports)
    }

    /// Whether the pass may go on after `report`, a run that started when the pool had moved `switches` times.
    fn still_connected(&self, report: &RunReport, switches: u64) -> Result<(), TickError> {
        if report.read_only {
            // The server stopped writing since the tick read its status: claim nothing more on it.
            let detail = report.detail.clone().unwrap_or_default();
            return Err(TickError::ReadOnly(format!(
                "connected to a read-only server ({detail})"
            )));
        }
        let moved = self.pool.switches() != switches;
        if report.connection_lost || moved {
            // The server went away mid-run (a restart, a failover — the run may have ended on the next qualifying
            // host): the rest of the pass would only wait for it key by key, or run on a host the tick has not
            // read; the outage loop looks for the server with backoff and starts the pass again, and the episode
            // is logged as one.
            let detail = report.detail.clone().unwrap_or_default();
            return Err(TickError::Connection(match moved {
                true => format!("the database moved to {} ({detail})", self.pool.host()),
                false => detail,
            }));
        }
        Ok(())
    }

    /// Sets `fine_settler_due_unsettled` for each job: its keys due this tick that no run of it settled (failed,
    /// lost, held by another replica, or not reached before shutdown) stay due.
    fn record_unsettled(&self, todo: &[Due], reports: &[RunReport]) {
        for job in [JobName::FineSettlement, JobName::OverdueAccrual] {
            let settled = reports
                .iter()
                .filter(|r| r.job == job.as_str() && r.outcome == Outcome::Settled)
                .count();
            let due = todo.iter().filter(|d| d.job == job).count();
            self.metrics.set_due_unsettled(job, due.saturating_sub(settled));
        }
    }

    /// The tick's status statement, asking about the bounds of a tick at `before`.
    pub(super) async fn read_status(&mut self, before: DateTime<Utc>) -> Result<TickStatus, TickError> {
        let since = due::window_start(&self.settings, before);
        let late = due::late_probe(&self.settings, before);
        self.session
            .tick_status(self.settings.instance, since, late)
            .await
            .map_err(TickError::classify)
    }

    /// Runs one due key of this shard.
    async fn run_due(&self, due: &Due, shard: ShardSpec) -> RunReport {
        // A key the status statement found late is re-opened as such, without asking the question again.
        let mode = if due.action == Action::Reopen {
            ClaimMode::Reopen
        } else {
            ClaimMode::Free
        };
        if due.job == JobName::OverdueAccrual {
            let key = RunKey {
                job: JobName::OverdueAccrual,
                business_date: due.business_date,
                shard,
            };
            // A day the re-check re-opened has work only on the loans libraryd changed.
            let scope = match mode {
                ClaimMode::Reopen => Scope::Changed,
                _ => Scope::Full,
            };
            let accrual = Accrual::from_settings(&self.settings).within(scope);
            self.runner(self.accrual_batch_size().await)
                .run_as(&accrual, key, mode)
                .await
        } else {
            let key = RunKey {
                job: JobName::FineSettlement,
                business_date: due.business_date,
                shard,
            };
            self.runner(self.settings.settlement.batch_size)
                .run_as(&Settlement::new(), key, mode)
                .await
        }
    }
}
