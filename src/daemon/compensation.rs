//! The tick's compensation pass: the shard's due pending charges retried within a time budget, a failing pass
//! logged once per episode and never stopping the tick, and no pass while a standby lags past
//! `throttle.max_replica_lag` (a standby whose lag is not known yet is waited for, bounded): the charges stay
//! due for a later tick.

use super::Daemon;
use crate::{
    jobs::{
        accrual::{self, Accrual},
        throttle::Verdict,
    },
    shard::ShardSpec,
    store::StoreError,
};

impl Daemon {
    /// Retries the shard's due pending charges, for at most `claim.batch_timeout` (the rest at the next tick) and
    /// never past a shutdown request. A pass that fails — a deferred constraint at commit, a missing
    /// grant on `fine_pending`, the connection — never stops the tick: settlement and accrual go on, the error
    /// is logged once per episode (and when it ends) and counted, and the next tick tries again.
    pub(super) async fn compensate(&mut self, shard: ShardSpec) {
        if self.held_by_a_standby().await {
            return;
        }
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

    /// Whether the lag limit holds this tick's compensation pass: a standby lags past `throttle.max_replica_lag`
    /// (the pass is left for a later tick), or its lag is not known yet (the tick waits for its reports to settle
    /// it, bounded as before a batch). Logged once per episode, with the verdict that held it.
    async fn held_by_a_standby(&mut self) -> bool {
        let verdict = self
            .throttle
            .settled_verdict(&self.pool, &self.shutdown, false, |_| {})
            .await;
        let held = verdict.holds();
        if held && !std::mem::replace(&mut self.compensation_held, true) {
            match &verdict {
                Verdict::Lagging(lagging) => tracing::warn!(standby = %lagging.standby,
                    "compensation pass left for a later tick: a standby lags more than throttle.max_replica_lag \
                     ({lagging})"),
                Verdict::Unknown(unknown) => tracing::info!(standby = %unknown.standby,
                    "compensation pass left for a later tick: a standby's lag is not known yet ({unknown})"),
                Verdict::Clear => {}
            }
        } else if !held && std::mem::take(&mut self.compensation_held) {
            tracing::info!("compensation pass resumes: no standby lags more than throttle.max_replica_lag");
        }
        held
    }
}
