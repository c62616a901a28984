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
    store::loans::{self, Unsettled},
};

/// The settlement job under one fine policy.
#[derive(Debug, Clone, Copy)]
pub struct Settlement {
    pub policy: FinePolicy,
}

impl BatchJob for Settlement {
    type Row = Unsettled;

    fn name(&self) -> JobName {
        JobName::FineSettlement
    }

    fn row_id(row: &Unsettled) -> i64 {
        row.id
    }

    async fn fetch(
        &self,
        pool: &PgPool,
        key: &RunKey,
        from_id: i64,
        limit: i64,
    ) -> Result<Vec<Unsettled>, JobError> {
        let month = calendar::settlement_month(key.business_date)?;
        Ok(loans::unsettled_batch(pool, month, key.shard, from_id, limit).await?)
    }

    async fn write(&self, tx: &mut PgConnection, _key: &RunKey, rows: &[Unsettled]) -> Result<u64, JobError> {
        let mut fines = Vec::with_capacity(rows.len());
        for row in rows {
            let days = row.days_late.ok_or(JobError::Data {
                id: row.id,
                problem: "due_on is not a finite date".into(),
            })?;
            let fine = self.policy.fine(days).map_err(|e| JobError::Data {
                id: row.id,
                problem: e.to_string(),
            })?;
            fines.push(fine.get());
        }
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        Ok(loans::settle(tx, &ids, &fines).await?)
    }
}
