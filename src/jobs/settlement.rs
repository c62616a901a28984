//! Month-end fine settlement: for each loan returned in the business month, set `fine_cents` from the fine
//! policy and stamp `fine_settled_at`. The business date is the month's last day.

use sqlx::{PgConnection, PgPool};

use super::{
    runner::{BatchJob, JobError},
    JobName, RunKey,
};
use crate::{
    calendar,
    fine::FinePolicy,
    store::loans::{self, SettleBatch},
};

/// The settlement job under one fine policy.
#[derive(Debug, Clone, Copy)]
pub struct Settlement {
    pub policy: FinePolicy,
}

impl BatchJob for Settlement {
    type Batch = SettleBatch;

    fn name(&self) -> JobName {
        JobName::FineSettlement
    }

    async fn fetch(
        &self,
        pool: &PgPool,
        key: &RunKey,
        from_id: i64,
        limit: i64,
    ) -> Result<Option<SettleBatch>, JobError> {
        let month = calendar::settlement_month(key.business_date)?;
        let batch = loans::next_batch(pool, month, key.shard, from_id, limit).await?;
        if let Some(id) = batch.and_then(|b| b.bad_due) {
            return Err(JobError::Data {
                id,
                problem: "due_on is not a finite date".into(),
            });
        }
        Ok(batch)
    }

    async fn first_id(&self, pool: &PgPool, key: &RunKey) -> Result<Option<i64>, JobError> {
        let month = calendar::settlement_month(key.business_date)?;
        let any = loans::month_has_unsettled(pool, month, key.shard).await?;
        Ok(any.then_some(i64::MIN))
    }

    fn extent(batch: &SettleBatch) -> (i64, i64) {
        (batch.last_id, batch.count)
    }

    async fn write(&self, tx: &mut PgConnection, key: &RunKey, batch: &SettleBatch) -> Result<u64, JobError> {
        let month = calendar::settlement_month(key.business_date)?;
        Ok(loans::settle_range(tx, month, key.shard, batch, &self.policy).await?)
    }
}
