//! Month-end fine settlement: for each loan returned in the business month, set `fine_cents` from its fine
//! policy in the database (the version of its class in force on its due date, over its chargeable days) and
//! stamp `fine_settled_at`. The business date is the month's last day. A loan whose due date is not
//! a finite date is left out (see [`crate::store::loans`]) and reported by `verify`.

use chrono::NaiveDate;
use sqlx::{Connection, PgConnection};

use crate::store::Db;

use super::{
    runner::{BatchJob, JobError, Written},
    shard_walk::ShardWalk,
    RunKey,
};
use crate::{
    calendar,
    config::Engine,
    shard::ShardSpec,
    store::{
        self,
        citus::{self, Locked},
        loans::{self, SettleBatch},
    },
};

/// The settlement job. Its fines come from the database's fine rules (`fine_policies`, `library_closed_days`).
/// One value serves one run at a time best: on Citus it keeps the run's walk between batches ([`ShardWalk`]).
#[derive(Debug, Default)]
pub struct Settlement {
    walk: ShardWalk,
}

impl Settlement {
    pub fn new() -> Self {
        Settlement {
            walk: ShardWalk::new(),
        }
    }
}

impl BatchJob for Settlement {
    type Batch = SettleBatch;

    async fn fetch(
        &self,
        pool: &Db,
        key: &RunKey,
        from_id: i64,
        limit: i64,
    ) -> Result<Option<SettleBatch>, JobError> {
        let month = calendar::settlement_month(key.business_date)?;
        Ok(match pool.engine() {
            Engine::Postgresql => loans::next_batch(pool, month, key.shard, from_id, limit).await?,
            Engine::Citus => {
                let list = |most| loans::next_listed(pool, month, key.shard, from_id, most);
                let walked = self.walk.next(pool, key, from_id, limit, list).await?;
                walked.map(|w| SettleBatch {
                    from_id,
                    last_id: w.cursor,
                    count: w.parts.iter().map(|p| p.len() as i64).sum(),
                    parts: w.parts,
                })
            }
        })
    }

    async fn first_id(&self, pool: &Db, key: &RunKey) -> Result<Option<i64>, JobError> {
        self.walk.start(key);
        let month = calendar::settlement_month(key.business_date)?;
        let any = loans::month_has_unsettled(pool, month, key.shard).await?;
        Ok(any.then_some(i64::MIN))
    }

    fn extent(batch: &SettleBatch) -> (i64, i64) {
        (batch.last_id, batch.count)
    }

    fn committed(&self, key: &RunKey, batch: &SettleBatch) {
        self.walk.committed(key, &batch.parts);
    }

    /// On Citus, a batch of parts on several nodes: its first part in the batch's transaction, each other
    /// beside it, so that the nodes settle at the same time.
    fn split(&self, batch: &SettleBatch) -> Option<(SettleBatch, Vec<SettleBatch>)> {
        let [own, beside @ ..] = batch.parts.as_slice() else {
            return None;
        };
        if beside.is_empty() {
            return None;
        }
        let part = |ids: &Vec<i64>| SettleBatch {
            from_id: batch.from_id,
            last_id: batch.last_id,
            count: ids.len() as i64,
            parts: vec![ids.clone()],
        };
        Some((part(own), beside.iter().map(part).collect()))
    }

    async fn late(&self, pool: &Db, key: &RunKey) -> Result<bool, JobError> {
        let month = calendar::settlement_month(key.business_date)?;
        Ok(loans::month_has_unsettled(pool, month, key.shard).await?)
    }

    /// Under the calendar's lock, the range update (on Citus, the listed loans' update, one Citus shard at a
    /// time: [`write_held`]).
    async fn write(
        &self,
        tx: &mut PgConnection,
        key: &RunKey,
        _epoch: i64,
        batch: &SettleBatch,
    ) -> Result<Written, JobError> {
        // No calendar change while this batch prices its loans (src/store/ledger.rs, CALENDAR_LOCK): one that
        // waited for it then sees this month's key and is refused.
        store::ledger::hold_calendar(tx).await?;
        write_held(tx, key, batch).await
    }

    /// A part beside the batch takes the calendar's lock only if it is granted at once: a calendar change
    /// queued for it waits for the batch's transaction, which holds it and waits for this part.
    async fn write_beside(
        &self,
        tx: &mut PgConnection,
        key: &RunKey,
        _epoch: i64,
        part: &SettleBatch,
    ) -> Result<Option<Written>, JobError> {
        if !store::ledger::try_hold_calendar(tx).await? {
            return Ok(None);
        }
        write_held(tx, key, part).await.map(Some)
    }
}

/// [`Settlement::write`] under the calendar's lock: the range update under a savepoint; if it meets a row lock
/// it cannot get within `claim.lock_timeout`, the batch settles every row it can lock instead and leaves the
/// locked ones for the re-open.
async fn write_held(tx: &mut PgConnection, key: &RunKey, batch: &SettleBatch) -> Result<Written, JobError> {
    let month = calendar::settlement_month(key.business_date)?;
    let mut range = tx.begin().await?;
    match settle(&mut range, month, key.shard, batch, Locked::Wait).await {
        Ok(updated) => {
            range.commit().await?;
            Ok(Written::rows(updated))
        }
        Err(e) if store::lock_not_available(&e) => {
            range.rollback().await?;
            let updated = settle(tx, month, key.shard, batch, Locked::Skip).await?;
            tracing::warn!(
                from_id = batch.from_id,
                to_id = batch.last_id,
                updated,
                left = batch
                    .count
                    .saturating_sub(i64::try_from(updated).unwrap_or(i64::MAX)),
                "rows locked by another transaction were left for later; the key re-opens for them"
            );
            Ok(Written::rows(updated))
        }
        Err(e) => Err(e.into()),
    }
}

/// Settles `batch`: its range on PostgreSQL; on Citus its listed loans, one Citus shard at a time.
async fn settle(
    tx: &mut PgConnection,
    month: (NaiveDate, NaiveDate),
    shard: ShardSpec,
    batch: &SettleBatch,
    locked: Locked,
) -> Result<u64, sqlx::Error> {
    if batch.parts.is_empty() {
        return match locked {
            Locked::Wait => loans::settle_range(tx, month, shard, batch).await,
            Locked::Skip => loans::settle_unlocked(tx, month, shard, batch).await,
        };
    }
    let mut updated = 0;
    for part in &batch.parts {
        for ids in citus::by_shard(&mut *tx, part).await? {
            updated += citus::settle_listed(tx, month, shard, &ids, locked).await?;
        }
    }
    Ok(updated)
}
