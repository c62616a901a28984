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
//! timeout, a lost fence): its rows are done and counted — in the key's row by its fence, in the run's handle
//! from the batch's [`BesideTally`], which outlives the batch — and the cursor has not passed them: the next
//! batch or run finds them done (the writes' own conditions). A part that fails before its commit (a lock it
//! may not wait for, a lost connection, a sibling's fence holding the key's row past `claim.lock_timeout`) rolls
//! back and is written in the batch's transaction instead.

use std::sync::Mutex;

use sqlx::PgConnection;

use super::{BatchJob, JobError, Runner, Written};
use crate::store::{self, job_runs::ClaimedRun};

/// How a part beside the batch ended.
enum Beside {
    /// Committed (told to the tally).
    Committed,
    /// Rolled back: another run holds the key.
    Lost,
    /// Not started, or rolled back before it wrote anything lasting: the batch's transaction writes it.
    NotHere,
}

/// What the parts beside a batch committed: their rows written, and read (their share of the batch's
/// `scanned`).
#[derive(Debug, Default, Clone)]
pub(super) struct BesideCommitted {
    pub written: Written,
    pub scanned: i64,
}

/// What a batch's parts beside it committed, told as each commits: kept by the caller of the batch, so that
/// the count survives a batch cut short (its timeout drops the batch's future).
#[derive(Debug, Default)]
pub(super) struct BesideTally(Mutex<BesideCommitted>);

impl BesideTally {
    fn add(&self, written: &Written, scanned: i64) {
        let mut tally = self.0.lock().unwrap_or_else(|e| e.into_inner());
        tally.written.add(written);
        tally.scanned += scanned;
    }

    /// What the parts committed so far.
    pub(super) fn committed(&self) -> BesideCommitted {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Runner {
    /// Writes `batch` in `tx`, or — when the job cuts it ([`BatchJob::split`]) and this runner writes parts
    /// beside ([`Runner::parts_beside`]) — its first part in `tx` and each other part beside it, all at the
    /// same time, each part beside telling `tally` once it committed. Says what `tx` wrote: `None` when a part
    /// beside found the key held by another run, and `tx` must roll back (its fence would find the same).
    pub(super) async fn write_batch<J: BatchJob>(
        &self,
        job: &J,
        tx: &mut PgConnection,
        run: &ClaimedRun,
        batch: &J::Batch,
        tally: &BesideTally,
    ) -> Result<Option<Written>, JobError> {
        let key = *run.key();
        let split = if self.parts_beside { job.split(batch) } else { None };
        let Some((own, parts)) = split else {
            return job.write(tx, &key, run.epoch(), batch).await.map(Some);
        };
        let beside =
            futures_util::future::join_all(parts.iter().map(|part| self.beside(job, run, part, tally)));
        let (mine, theirs) = tokio::join!(job.write(tx, &key, run.epoch(), &own), beside);
        let mut failed = None;
        let mut lost = false;
        let mut here = Vec::new();
        for (part, ended) in parts.iter().zip(theirs) {
            match ended {
                Ok(Beside::Committed) => {}
                Ok(Beside::Lost) => lost = true,
                Ok(Beside::NotHere) => here.push(part),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        let mut written = match (mine, failed) {
            (Err(e), _) | (Ok(_), Some(e)) => return Err(e),
            (Ok(_), None) if lost => return Ok(None),
            (Ok(own), None) => own,
        };
        for part in here {
            tracing::debug!("a part of the batch is written in the batch's transaction");
            written.add(&job.write(tx, &key, run.epoch(), part).await?);
        }
        Ok(Some(written))
    }

    /// One part beside the batch: written, fenced and committed on a transaction of its own, then told to
    /// `tally`. Whatever fails before the commit rolls the part back for the batch's transaction to write.
    async fn beside<J: BatchJob>(
        &self,
        job: &J,
        run: &ClaimedRun,
        part: &J::Batch,
        tally: &BesideTally,
    ) -> Result<Beside, JobError> {
        let mut tx = match self.pool.try_begin().await {
            Ok(Some(tx)) => tx,
            Ok(None) => return Ok(Beside::NotHere),
            Err(e) => {
                tracing::debug!(error = %e, "no transaction beside the batch; its part is written in the batch's");
                return Ok(Beside::NotHere);
            }
        };
        let (_, scanned) = J::extent(part);
        let fenced = async {
            store::set_local_lock_timeout(&mut tx, self.lease.lock_timeout()).await?;
            let Some(written) = job.write_beside(&mut tx, run.key(), run.epoch(), part).await? else {
                return Ok(None);
            };
            let updated = i64::try_from(written.updated).unwrap_or(i64::MAX);
            let passed = run.pass_beside(&mut tx, scanned, updated).await?;
            Ok::<_, JobError>(Some((written, passed)))
        };
        let (written, passed) = match fenced.await {
            Ok(Some(fenced)) => fenced,
            failed => {
                if let Err(e) = failed {
                    tracing::debug!(error = %e, "a part beside the batch failed before its commit; the batch writes it");
                }
                // Its locks let go before the batch's transaction writes the part (a dead connection's with it).
                let _ = tx.rollback().await;
                return Ok(Beside::NotHere);
            }
        };
        if !passed {
            tx.rollback().await?;
            return Ok(Beside::Lost);
        }
        tx.commit().await?;
        tally.add(&written, scanned);
        Ok(Beside::Committed)
    }
}
