//! The tick's compensation pass: the shard's due pending charges retried within a time budget, a failing pass
//! logged once per episode and never stopping the tick.

use super::Daemon;
use crate::{
    jobs::accrual::{self, Accrual},
    shard::ShardSpec,
    store::StoreError,
};

impl Daemon {
    /// Retries the shard's due pending charges, for at most `claim.batch_timeout` (the rest at the next tick) and
    /// never past a shutdown request. A pass that fails — a deferred constraint at commit, a missing
    /// grant on `fine_pending`, the connection — never stops the tick: settlement and accrual go on, the error
    /// is logged once per episode (and when it ends) and counted, and the next tick tries again.
    pub(super) async fn compensate(&mut self, shard: ShardSpec) {
        let accrual = Accrual::from_settings(&self.settings);
        let max_attempts = self.settings.accrual.max_attempts;
        let limits = accrual::PassLimits {
            cancel: Some(self.shutdown.clone()),
            budget: Some(self.settings.claim.lease.batch_timeout()),
            heartbeat: Some(self.heartbeat.clone()),
            progress: None,
        };
        match accrual::compensate_within(&self.pool, &accrual, Some(shard), true, max_attempts, &limits).await
        {
            Ok(done) => {
                if std::mem::take(&mut self.compensation_failing) {
                    tracing::info!("compensation pass works again");
                }
                tracing::info!(
                    charged = done.charged,
                    not_owed = done.not_owed,
                    held_back = done.held_back,
                    retried = done.retried,
                    dead = done.dead,
                    "compensation pass"
                );
            }
            Err(e) => {
                self.metrics.count_compensation_error();
                let e = StoreError::from(e);
                if !std::mem::replace(&mut self.compensation_failing, true) {
                    tracing::error!(error = %e, "compensation pass failed; settlement and accrual go on, retrying at the next tick");
                } else {
                    tracing::debug!(error = %e, "compensation pass failed again");
                }
            }
        }
    }
}
