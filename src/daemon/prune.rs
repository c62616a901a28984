//! The pruning of the attempt history (`claim.history_retention`), a little at a time.

use super::Daemon;
use crate::store::{self, StoreError};

/// Rows deleted per pruning statement, and statements per pruning pass at most.
const PRUNE_BATCH: i64 = 1000;
const PRUNE_BATCHES: u32 = 50;

impl Daemon {
    /// Deletes `job_run_attempts` rows older than `claim.history_retention`, in small batches so that no
    /// statement holds locks for long. Failures are logged and retried at the next pass.
    pub(super) async fn prune_history(&self) {
        let retention = self.settings.claim.history_retention;
        let mut pruned = 0u64;
        for _ in 0..PRUNE_BATCHES {
            match store::job_runs::prune_history(&self.pool, retention, PRUNE_BATCH).await {
                Ok(n) => {
                    pruned += n;
                    if n < PRUNE_BATCH as u64 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %StoreError::from(e), "pruning the attempt history failed; retrying later");
                    break;
                }
            }
        }
        if pruned > 0 {
            tracing::info!(pruned, retention = %humantime::format_duration(retention), "pruned old attempt history");
        }
    }
}
