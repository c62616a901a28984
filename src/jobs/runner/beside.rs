//! A batch written in parts at the same time: its first part in the batch's transaction, each other part
//! *beside* it, in a transaction of its own on a connection of its own (on Citus, one worker's Citus shard a
//! part: docs/citus.md, "Batches of one Citus shard").
//!
//! A part beside the batch ends with a fence of its own ([`ClaimedRun::pass_beside`]): the batch's fence without
//! the cursor — it adds the part's rows to the key's counters and renews the lease, only while the run holds the
//! key at its cursor — and commits before the batch's fence runs. Its row lock on the key holds until the part
//! commits, so a takeover (and the batch's own fence) waits for it as for a batch in flight. The batch's fence
//! moves the cursor, once every part beside it ended. A part whose fence found the key another run's rolls back,
//! and the batch with it. A part that cannot start — no connection free at once, or a lock the batch's
//! transaction may be queued behind ([`BatchJob::write_beside`]; the calendar's) — is written in the batch's
//! transaction after the batch's own part, as if the batch had not been cut.
//!
//! A part that committed stays committed whatever becomes of its batch (a failed write of another part, a
//! timeout, a lost fence): its rows are done and counted, and the cursor has not passed them — the next batch
//! or run finds them done (the writes' own conditions).

use sqlx::PgConnection;

use super::{BatchJob, JobError, Runner, Written};
use crate::store::{self, job_runs::ClaimedRun};

/// How a part beside the batch ended.
enum Beside {
    /// Committed, having written this of its `scanned` rows.
    Committed { written: Written, scanned: i64 },
    /// Rolled back: another run holds the key.
    Lost,
    /// Not started, or rolled back before it wrote anything lasting: the batch's transaction writes it.
    NotHere,
}

/// What the parts beside a batch committed: their rows written, and read (their share of the batch's
/// `scanned`).
#[derive(Debug, Default)]
pub(super) struct BesideCommitted {
    pub written: Written,
    pub scanned: i64,
}

impl Runner {
    /// Writes `batch` in `tx`, or — when the job cuts it ([`BatchJob::split`]) — its first part in `tx` and
    /// each other part beside it, all at the same time. Says what `tx` wrote — `None` when a part beside found
    /// the key held by another run, and `tx` must roll back (its fence would find the same) — and, whatever
    /// became of the batch, what the parts beside committed.
    pub(super) async fn write_batch<J: BatchJob>(
        &self,
        job: &J,
        tx: &mut PgConnection,
        run: &ClaimedRun,
        batch: &J::Batch,
    ) -> (Result<Option<Written>, JobError>, BesideCommitted) {
        let key = *run.key();
        let Some((own, parts)) = job.split(batch) else {
            let own = job.write(tx, &key, run.epoch(), batch).await;
            return (own.map(Some), BesideCommitted::default());
        };
        let beside = futures_util::future::join_all(parts.iter().map(|part| self.beside(job, run, part)));
        let (mine, theirs) = tokio::join!(job.write(tx, &key, run.epoch(), &own), beside);
        let mut beside = BesideCommitted::default();
        let mut failed = None;
        let mut lost = false;
        let mut here = Vec::new();
        for (part, ended) in parts.iter().zip(theirs) {
            match ended {
                Ok(Beside::Committed { written, scanned }) => {
                    beside.written.add(&written);
                    beside.scanned += scanned;
                }
                Ok(Beside::Lost) => lost = true,
                Ok(Beside::NotHere) => here.push(part),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        let mut written = match (mine, failed) {
            (Err(e), _) | (Ok(_), Some(e)) => return (Err(e), beside),
            (Ok(_), None) if lost => return (Ok(None), beside),
            (Ok(own), None) => own,
        };
        for part in here {
            tracing::debug!("a part of the batch is written in the batch's transaction");
            match job.write(tx, &key, run.epoch(), part).await {
                Ok(w) => written.add(&w),
                Err(e) => return (Err(e), beside),
            }
        }
        (Ok(Some(written)), beside)
    }

    /// One part beside the batch: written, fenced and committed on a transaction of its own.
    async fn beside<J: BatchJob>(
        &self,
        job: &J,
        run: &ClaimedRun,
        part: &J::Batch,
    ) -> Result<Beside, JobError> {
        let mut tx = match self.pool.try_begin().await {
            Ok(Some(tx)) => tx,
            Ok(None) => return Ok(Beside::NotHere),
            Err(e) => {
                tracing::debug!(error = %e, "no transaction beside the batch; its part is written in the batch's");
                return Ok(Beside::NotHere);
            }
        };
        store::set_local_lock_timeout(&mut tx, self.lease.lock_timeout()).await?;
        let written = match job.write_beside(&mut tx, run.key(), run.epoch(), part).await {
            Ok(Some(written)) => written,
            Ok(None) => {
                tx.rollback().await?;
                return Ok(Beside::NotHere);
            }
            Err(e) => return Err(e),
        };
        let (_, scanned) = J::extent(part);
        let updated = i64::try_from(written.updated).unwrap_or(i64::MAX);
        if !run.pass_beside(&mut tx, scanned, updated).await? {
            tx.rollback().await?;
            return Ok(Beside::Lost);
        }
        tx.commit().await?;
        Ok(Beside::Committed { written, scanned })
    }
}
