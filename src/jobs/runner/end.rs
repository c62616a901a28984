//! The run's last step: end the claimed run by how its walk stopped — finish it (SUCCESS, or FAILED on an
//! error), hand it back (a shutdown or a pause: FAILED with the lease ended, for a peer to take over), or record
//! that its lease was lost — and say so in its report.

use super::{retry::retrying, walk::Stop, JobError, Runner, SHUTDOWN_ERROR};
use crate::{
    jobs::{Outcome, RunKey, RunReport},
    store::job_runs::{ClaimKind, ClaimedRun, Ending, LostRun},
};

/// What a claimed run had done when it ended: the run's fields of its report.
#[derive(Debug, Clone, Copy)]
struct Tally {
    key: RunKey,
    epoch: i64,
    scanned: i64,
    updated: i64,
    corrected: i64,
    reopened: bool,
}

impl Tally {
    fn of(run: &ClaimedRun) -> Self {
        Tally {
            key: *run.key(),
            epoch: run.epoch(),
            scanned: run.scanned(),
            updated: run.updated(),
            corrected: run.corrected(),
            reopened: run.kind() == ClaimKind::Reopened,
        }
    }

    /// The run's report, ended `outcome`.
    fn report(&self, outcome: Outcome) -> RunReport {
        RunReport::new(self.key, outcome)
            .with_epoch(self.epoch)
            .with_counts(self.scanned, self.updated)
            .with_corrections(self.corrected)
            .with_reopened(self.reopened)
    }
}

impl Runner {
    /// Ends `run`, whose walk stopped with `stop`; the end is retried through a lost connection. If the end
    /// finds another epoch holding the key, the lease was lost after the run's last batch.
    pub(super) async fn end(&self, run: ClaimedRun, stop: Result<Stop, JobError>) -> RunReport {
        let tally = Tally::of(&run);
        let end = match &stop {
            Ok(Stop::LeaseLost) => return self.lease_lost(run.lose(), tally).await,
            Ok(Stop::Done) => run.finish(Ending::Success),
            Ok(Stop::Shutdown) => run.hand_back(SHUTDOWN_ERROR),
            // As a graceful stop: FAILED with the lease ended, so that the first tick after a resume takes the
            // key over and goes on after its cursor.
            Ok(Stop::Paused(error)) => run.hand_back(error),
            Err(e) => {
                tracing::error!(error = %e, scanned = tally.scanned, updated = tally.updated, "run failed");
                run.finish(Ending::Failed(&e.to_string()))
            }
        };
        match retrying("finish", &self.pool, || end.send()).await {
            Ok(true) => ended(tally, stop),
            // Finishing found another epoch: the key was taken over after our last batch.
            Ok(false) => self.lease_lost(end.lost(), tally).await,
            Err(e) => {
                // The key stays RUNNING; its lease expires and a peer takes over and resumes from the cursor.
                // Until then the replica still holds it (what a stop says).
                let e = JobError::from(e);
                tracing::error!(error = %e, "could not record the end of the run; the lease will expire");
                self.held.strand(tally.key, self.lease.duration());
                let report = tally.report(Outcome::Failed).failed_by(&e);
                match &stop {
                    // The run's own error is the one to report; the finish's adds what it says of the server.
                    Err(first) => report.failed_by(first),
                    Ok(_) => report,
                }
            }
        }
    }

    /// The run lost its lease: another replica took the key over (or the server lacks the run's last batches).
    /// Only the history hears of it; the key's row belongs to the new owner.
    async fn lease_lost(&self, lost: LostRun, tally: Tally) -> RunReport {
        tracing::warn!(
            scanned = tally.scanned,
            updated = tally.updated,
            "lease lost: another replica took the key over (or the server lacks this run's last batches)"
        );
        if let Err(e) = retrying("record the lost lease", &self.pool, || lost.record()).await {
            tracing::warn!(error = %JobError::from(e), "could not record the lost lease in the history");
        }
        tally.report(Outcome::LeaseLost)
    }
}

/// The report of a run whose end was recorded.
fn ended(tally: Tally, stop: Result<Stop, JobError>) -> RunReport {
    match stop {
        Ok(Stop::Done) => tally.report(Outcome::Settled),
        Ok(Stop::Shutdown) => tally.report(Outcome::Failed).with_detail(SHUTDOWN_ERROR),
        Ok(Stop::Paused(error)) => tally.report(Outcome::Failed).with_detail(error).with_paused(),
        Ok(Stop::LeaseLost) => tally.report(Outcome::LeaseLost),
        Err(e) => tally.report(Outcome::Failed).failed_by(&e),
    }
}
