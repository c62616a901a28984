//! The run's first step: claim the key, and decide whether a SUCCESS key is re-opened. Its end is the run's
//! handle, or the report of a run that does not start (skipped, or the claim failed).

use std::time::Duration;

use tokio::time::Instant;

use super::{held::Holding, retry::retrying, transient, BatchJob, JobError, Runner};
use crate::{
    jobs::{Outcome, RunKey, RunReport},
    metrics::ClaimResult,
    store::job_runs::{self, ClaimMode, Claimed, ClaimedRun, Holder, RunStatus},
};

/// The `last_error` of a key handed back because its claim's answer was lost.
const UNANSWERED_CLAIM: &str = "the claim's answer was lost with its connection; handed back for a peer";

/// How the claim step ended.
pub(super) enum Start {
    /// This process holds the run (counted in the runner's held keys while the `Holding` lives).
    Run(ClaimedRun, Holding),
    /// The run does not start; its report.
    Ended(RunReport),
}

impl Runner {
    /// Claims `key` in `mode` (see [`Runner::run_as`]), re-opening a SUCCESS key with rows still to do, and
    /// records the won claim's epoch in the run's `span`.
    pub(super) async fn claim<J: BatchJob>(
        &self,
        job: &J,
        key: RunKey,
        mode: ClaimMode,
        span: &tracing::Span,
    ) -> Start {
        // The key counts as held from the moment the claim has a connection to be sent on (its answer may be
        // lost after it committed); a claim still waiting for a connection to a dead server holds nothing.
        if let Err(e) = self.pool.pool().acquire().await {
            return Start::Ended(failed(key, e));
        }
        let holding = self.held.hold();
        let claimed = match self.claim_within(key, mode).await {
            // The re-open decision: a SUCCESS key a free claim skipped is claimed again as a re-open if the job
            // finds rows still to do in it (`Reopen` and `Force` take SUCCESS keys anyway).
            Ok(Claimed::Skipped(holder))
                if holder.status == RunStatus::Success && mode == ClaimMode::Free =>
            {
                match job.late(&self.pool, &key).await {
                    Ok(true) => self.claim_as(key, ClaimMode::Reopen).await,
                    Ok(false) => Ok(Claimed::Skipped(holder)),
                    Err(e) => {
                        tracing::error!(error = %e, "cannot tell whether the key has rows left; not re-opened");
                        return Start::Ended(RunReport::new(key, Outcome::Failed).with_detail(e.to_string()));
                    }
                }
            }
            // A key RUNNING under this process's own name, which runs a key once at a time: a claim of its own
            // whose answer was lost. Handed back (as `release` would) and claimed again.
            Ok(Claimed::Skipped(holder))
                if holder.status == RunStatus::Running && holder.owner == self.owner =>
            {
                self.reclaim_own(key, mode).await
            }
            claimed => claimed,
        };
        match claimed {
            Ok(Claimed::Won(run)) => {
                self.held.recovered(&key);
                self.won(&run, span);
                Start::Run(run, holding)
            }
            Ok(Claimed::Skipped(holder)) => Start::Ended(self.skipped(key, holder)),
            Err(e) => {
                if transient(&e) {
                    self.hand_back_unanswered(key).await;
                }
                Start::Ended(failed(key, e))
            }
        }
    }

    /// The claim's connection failed with the statement sent: it may have committed, leaving the key RUNNING
    /// under this process's owner with nobody running it. Hands it back (retried for a few seconds), so that the
    /// next tick takes it over at once; if it is not recorded yet or cannot be handed back, the key is counted as
    /// stranded (what a stop then says) until the next claim of it finds it this process's own (and hands it
    /// back), or its lease ends.
    async fn hand_back_unanswered(&self, key: RunKey) {
        // The statement ends on the server within its statement timeout (the batch timeout) of being sent.
        self.held
            .unresolved_until(Instant::now() + self.lease.batch_timeout());
        let handed_back = retrying("hand back a claim whose answer was lost", &self.pool, || {
            job_runs::hand_back_unanswered_claim(&self.pool, &key, &self.owner, UNANSWERED_CLAIM)
        })
        .await;
        match handed_back {
            Ok(true) => {
                tracing::warn!("the claim's answer was lost, but it had been recorded: handed the key back");
                self.held.recovered(&key);
            }
            // Not recorded yet: it may still commit (the server finishing the statement), so the key is counted
            // until this replica claims it again (and finds it its own) or its lease ends.
            Ok(false) => self.held.strand(key, self.lease.duration()),
            Err(e) => {
                tracing::error!(error = %JobError::from(e),
                    "the claim's answer was lost and the key cannot be handed back; its lease frees it for a peer");
                self.held.strand(key, self.lease.duration());
            }
        }
    }

    /// Hands back `key`, found RUNNING under this process's own name, and claims it again in `mode`.
    async fn reclaim_own(&self, key: RunKey, mode: ClaimMode) -> Result<Claimed, sqlx::Error> {
        job_runs::hand_back_unanswered_claim(&self.pool, &key, &self.owner, UNANSWERED_CLAIM).await?;
        tracing::warn!(
            "the key was RUNNING under this replica's own name (a claim whose answer was lost): handed back and \
             claimed again"
        );
        self.claim_as(key, mode).await
    }

    /// [`Runner::claim_as`] with a client-side limit: a connection that black-holes its answer (a lost route;
    /// the server's `statement_timeout` cannot end a wait for bytes that never arrive) fails the claim as a lost
    /// connection after the batch timeout and a second, instead of holding the replica for ever.
    async fn claim_within(&self, key: RunKey, mode: ClaimMode) -> Result<Claimed, sqlx::Error> {
        let limit = self.lease.batch_timeout() + Duration::from_secs(1);
        match tokio::time::timeout(limit, self.claim_as(key, mode)).await {
            Ok(claimed) => claimed,
            Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the claim got no answer within {}",
                    humantime::format_duration(limit)
                ),
            ))),
        }
    }

    async fn claim_as(&self, key: RunKey, mode: ClaimMode) -> Result<Claimed, sqlx::Error> {
        ClaimedRun::claim(&self.pool, key, &self.owner, self.lease.duration(), mode).await
    }

    /// A won claim: counted, its epoch recorded in the run's span (before the line that says so).
    fn won(&self, run: &ClaimedRun, span: &tracing::Span) {
        self.count_claim(*run.key(), ClaimResult::from(run.kind()));
        span.record("epoch", run.epoch());
        tracing::info!(claim = ?run.kind(), cursor = run.cursor(), "claimed");
    }

    /// The report of a skipped claim: who holds the key, and until when if it is running.
    fn skipped(&self, key: RunKey, holder: Holder) -> RunReport {
        self.count_claim(key, ClaimResult::Skipped);
        let report = RunReport::new(key, Outcome::Skipped).with_epoch(holder.epoch);
        match holder.status {
            RunStatus::Running => report
                .with_detail(format!(
                    "held by {} until {}",
                    holder.owner,
                    holder.lease_until.to_rfc3339()
                ))
                .with_held_until(holder.lease_until),
            status => report.with_detail(format!("already {status}")),
        }
    }

    fn count_claim(&self, key: RunKey, result: ClaimResult) {
        if let Some(m) = &self.metrics {
            m.count_claim(key.job, result);
        }
    }
}

/// The report of a claim that failed (logged here).
fn failed(key: RunKey, e: sqlx::Error) -> RunReport {
    let e = JobError::from(e);
    tracing::error!(error = %e, "claim failed");
    RunReport::new(key, Outcome::Failed).failed_by(&e)
}
