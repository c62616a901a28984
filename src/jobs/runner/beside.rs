//! A batch written in parts at the same time: its first part in the batch's transaction, each other part
//! *beside* it, in a transaction of its own on a connection of its own (on Citus, one worker's Citus shard a
//! part: docs/citus.md, "Batches of one Citus shard").
//!
//! A part beside the batch passes the fence's check ([`ClaimedRun::holds`]) as its last statement and commits
//! before the batch's fence runs; the check keeps the key's row locked until the part ends, so a takeover (and
//! the batch's own fence) waits for it as for a batch in flight. A part commits only under the run's lease and
//! at its cursor, then, as a batch does. The batch's fence moves the cursor, once every part beside it
//! committed. A part that found the key another run's rolls back and the batch with it. A part beside that
//! cannot start — no connection free at once, or a lock (the calendar's) not granted within
//! `claim.lock_timeout` — is written in the batch's transaction after the batch's own part, as if the batch
//! had not been cut.

use sqlx::PgConnection;

use super::{BatchJob, JobError, Runner, Written};
use crate::store::{self, job_runs::ClaimedRun};

/// How a part beside the batch ended.
enum Beside {
    /// Committed, having written this.
    Committed(Written),
    /// Rolled back: another run holds the key.
    Lost,
    /// Not started, or rolled back before it wrote anything lasting: the batch's transaction writes it.
    NotHere,
}

impl Runner {
    /// Writes `batch` in `tx`, or — when the job cuts it ([`BatchJob::split`]) — its first part in `tx` and
    /// each other part beside it, all at the same time; says what they wrote. `None`: a part beside found the
    /// key held by another run, and `tx` must roll back (its fence would find the same).
    pub(super) async fn write_batch<J: BatchJob>(
        &self,
        job: &J,
        tx: &mut PgConnection,
        run: &ClaimedRun,
        batch: &J::Batch,
    ) -> Result<Option<Written>, JobError> {
        let key = *run.key();
        let Some((own, parts)) = job.split(batch) else {
            return Ok(Some(job.write(tx, &key, run.epoch(), batch).await?));
        };
        let beside = futures_util::future::join_all(parts.iter().map(|part| self.beside(job, run, part)));
        let (mine, theirs) = tokio::join!(job.write(tx, &key, run.epoch(), &own), beside);
        let mut written = mine?;
        let mut lost = false;
        for (part, ended) in parts.iter().zip(theirs) {
            match ended? {
                Beside::Committed(w) => written.add(&w),
                Beside::Lost => lost = true,
                Beside::NotHere if !lost => {
                    tracing::debug!("a part of the batch is written in the batch's transaction");
                    written.add(&job.write(tx, &key, run.epoch(), part).await?);
                }
                Beside::NotHere => {}
            }
        }
        Ok((!lost).then_some(written))
    }

    /// One part beside the batch: written, checked against the fence and committed on a transaction of its own.
    async fn beside<J: BatchJob>(
        &self,
        job: &J,
        run: &ClaimedRun,
        part: &J::Batch,
    ) -> Result<Beside, JobError> {
        let Some(mut tx) = self.pool.try_begin().await? else {
            return Ok(Beside::NotHere);
        };
        store::set_local_lock_timeout(&mut tx, self.lease.lock_timeout()).await?;
        let written = match job.write(&mut tx, run.key(), run.epoch(), part).await {
            Ok(written) => written,
            Err(JobError::Sql(e)) if store::lock_not_available(&e) => {
                tx.rollback().await?;
                return Ok(Beside::NotHere);
            }
            Err(e) => return Err(e),
        };
        if !run.holds(&mut tx).await? {
            tx.rollback().await?;
            return Ok(Beside::Lost);
        }
        tx.commit().await?;
        Ok(Beside::Committed(written))
    }
}
