//! Walking a claimed run's rows: from the first id with work, one fenced batch after another — each after the
//! throttle's wait, each under `claim.batch_timeout` — until nothing is left, the lease is lost, the job is
//! paused or the process shuts down.

use std::time::Duration;

use tokio::time::Instant;

use super::{beside::BesideTally, wait::Episodes, BatchJob, JobError, Runner};
use crate::{
    jobs::{throttle::BatchSizer, RunKey},
    store::{
        self,
        corrections::Corrected,
        job_runs::{ClaimedRun, Covered, Fence},
        pauses::Pause,
    },
};

/// Why a walk stopped (other than on an error).
#[derive(Debug)]
pub(super) enum Stop {
    /// Nothing left to do.
    Done,
    /// A shutdown request: stopped between batches.
    Shutdown,
    /// The fence (or a renewal) found another owner.
    LeaseLost,
    /// A pause covers the key: handed back after the batch that saw it, with this `last_error`.
    Paused(String),
}

/// What a walk keeps between batches besides the run's handle.
pub(super) struct Walk {
    /// Sizes the batches to `throttle.batch_duration`.
    sizer: BatchSizer,
    /// When the lease was last renewed (by the claim, a batch or a renewal while throttled).
    pub(super) renewed: Instant,
    pub(super) episodes: Episodes,
}

enum BatchResult {
    /// Nothing left to do.
    Empty,
    /// Committed a batch; `paused`: the fence saw a pause of the key (who, why); `took`: how long its
    /// transaction was open.
    Committed {
        covered: Covered,
        corrected: Corrected,
        paused: Option<(String, String)>,
        took: Duration,
    },
    /// The fence matched nothing: another replica owns the key now. Rolled back.
    Fenced,
}

impl Runner {
    /// Walks `run`'s rows batch by batch and says why it stopped.
    pub(super) async fn walk<J: BatchJob>(&self, job: &J, run: &mut ClaimedRun) -> Result<Stop, JobError> {
        let mut walk = Walk {
            sizer: BatchSizer::new(self.batch_size, self.throttle.settings().batch_duration),
            renewed: Instant::now(),
            episodes: Episodes::default(),
        };
        let stop = self.batches(job, run, &mut walk).await;
        walk.episodes.end();
        stop
    }

    async fn batches<J: BatchJob>(
        &self,
        job: &J,
        run: &mut ClaimedRun,
        walk: &mut Walk,
    ) -> Result<Stop, JobError> {
        if self.cancel.is_cancelled() {
            return Ok(Stop::Shutdown);
        }
        // Skip straight to the first id with work; nothing at all means the run is done.
        let first = job.first_id(&self.pool, run.key()).await?;
        let mut next = run.next_id().zip(first).map(|(n, f)| n.max(f));
        loop {
            let Some(from_id) = next else {
                return Ok(Stop::Done);
            };
            let limit = self.throttle.cap_batch(walk.sizer.next());
            if let Some(stop) = self.throttled(run, limit, walk).await? {
                return Ok(stop);
            }
            let limit = self.throttle.cap_batch(walk.sizer.next());
            match self.timed_batch(job, run, from_id, limit).await? {
                BatchResult::Empty => return Ok(Stop::Done),
                BatchResult::Fenced => return Ok(Stop::LeaseLost),
                BatchResult::Committed {
                    covered,
                    corrected,
                    paused,
                    took,
                } => {
                    walk.renewed = Instant::now();
                    self.committed(run.key(), walk, covered, &corrected, took);
                    if let Some((by, reason)) = paused {
                        tracing::warn!(cursor = covered.last_id, paused_by = %by, reason = %reason,
                            "job paused: handing the key back after this batch");
                        return Ok(Stop::Paused(Pause::run_error(&by, &reason)));
                    }
                }
            }
            next = run.next_id();
            if self.cancel.is_cancelled() {
                return Ok(Stop::Shutdown);
            }
        }
    }

    /// One batch under `claim.batch_timeout`.
    async fn timed_batch<J: BatchJob>(
        &self,
        job: &J,
        run: &mut ClaimedRun,
        from_id: i64,
        limit: u32,
    ) -> Result<BatchResult, JobError> {
        let timeout = self.lease.batch_timeout();
        let started = Instant::now();
        let tally = BesideTally::default();
        let batch = tokio::time::timeout(timeout, self.batch(job, run, from_id, limit, &tally)).await;
        // Parts committed beside the batch counted themselves in the key's row; the handle counts them here,
        // whatever became of the batch.
        let beside = tally.committed();
        run.count_beside(
            beside.scanned,
            count(beside.written.updated),
            count(beside.written.corrected.total()),
        );
        // The pace admitted `limit` rows (in `throttled`); it gets back what the batch did not work.
        let done = match &batch {
            Ok(Ok(BatchResult::Committed { covered, .. })) => covered.scanned,
            _ => 0,
        };
        self.throttle.settle(limit, done, started.elapsed());
        batch.unwrap_or(Err(JobError::BatchTimeout(timeout)))
    }

    /// One batch: read the next rows, then one transaction that writes them and, last, passes the fence.
    async fn batch<J: BatchJob>(
        &self,
        job: &J,
        run: &mut ClaimedRun,
        from_id: i64,
        limit: u32,
        tally: &BesideTally,
    ) -> Result<BatchResult, JobError> {
        let key = *run.key();
        let Some(batch) = job.fetch(&self.pool, &key, from_id, i64::from(limit)).await? else {
            return Ok(BatchResult::Empty);
        };
        let (last_id, scanned) = J::extent(&batch);
        let began = Instant::now();
        let mut tx = self.pool.begin().await?;
        store::set_local_lock_timeout(&mut tx, self.lease.lock_timeout()).await?;
        let written = self.write_batch(job, &mut tx, run, &batch, tally).await?;
        let beside = tally.committed();
        let Some(mut written) = written else {
            tx.rollback().await?;
            return Ok(BatchResult::Fenced);
        };
        let own = Covered {
            last_id,
            scanned: scanned - beside.scanned,
            updated: count(written.updated),
            corrected: count(written.corrected.total()),
        };
        Ok(match run.advance(tx, own).await? {
            Fence::Lost => BatchResult::Fenced,
            Fence::Passed { paused } => {
                job.committed(&key, &batch);
                written.add(&beside.written);
                BatchResult::Committed {
                    covered: Covered {
                        last_id,
                        scanned,
                        updated: count(written.updated),
                        corrected: count(written.corrected.total()),
                    },
                    corrected: written.corrected,
                    paused: paused.filter(|_| !self.ignore_pause),
                    took: began.elapsed(),
                }
            }
        })
    }

    /// What follows a committed batch: the next batch's size adapts to this one's duration, and the progress
    /// hook, the metrics and the log hear of its rows.
    fn committed(
        &self,
        key: &RunKey,
        walk: &mut Walk,
        covered: Covered,
        corrected: &Corrected,
        took: Duration,
    ) {
        let (s, u) = (covered.scanned, covered.updated);
        let size = walk.sizer.next();
        walk.sizer.observe(s, took);
        if walk.sizer.next() != size {
            tracing::debug!(
                took_ms = took.as_millis() as u64,
                from = size,
                to = walk.sizer.next(),
                "batch resized to throttle.batch_duration"
            );
        }
        if let Some(p) = &self.progress {
            p.call(s, u);
        }
        if let Some(m) = &self.metrics {
            m.count_rows(key.job, s, u);
            m.count_corrections(key.job, corrected);
        }
        if let Some(h) = &self.heartbeat {
            h.progress_now();
        }
        tracing::debug!(
            cursor = covered.last_id,
            batch_scanned = s,
            batch_updated = u,
            batch_corrected = covered.corrected,
            "batch committed"
        );
    }
}

/// A count of rows as the key's counters keep it.
fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
