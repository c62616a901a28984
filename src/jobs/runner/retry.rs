//! Retrying the statements that end a run (and a waiting run's renewal) through a lost connection: a few
//! seconds of backoff, and with several hosts in `database.url` a look for the promoted one before each retry.

use std::{future::Future, time::Duration};

use super::JobError;
use crate::{backoff::Backoff, store::Db};

/// Waits before each retry of a statement that ends a run, when the connection (not the statement) failed:
/// [`END_RETRIES`] retries, 125 ms doubled up to 2 s (3.9 s in all).
const END_BACKOFF: Backoff = Backoff::new(Duration::from_millis(125), Duration::from_secs(2));
const END_RETRIES: u32 = 5;

/// Whether `e` is about the connection rather than the statement — the server restarting or shutting down, a
/// broken socket, no connection to be had — so the same statement may succeed on a new connection.
pub fn transient(e: &sqlx::Error) -> bool {
    crate::store::classify(e).transient()
}

/// Runs `statement` (one idempotent, fenced statement that ends a run), retrying it for a few seconds while the
/// failure is [`transient`]. Without this, a run cut off by a server restart would leave its key RUNNING until
/// the lease expires (delaying the takeover), and a replica thawed after a takeover could not record that it
/// lost its lease.
///
/// With several hosts in `database.url`, each retry first looks for a qualifying host again (a failover): a retry
/// finding none is not sent (it would only wait for the dead server), and one that finds the promoted standby
/// records the end of the run there, as far as the standby had replayed it.
pub(super) async fn retrying<T, F, Fut>(what: &str, pool: &Db, mut statement: F) -> Result<T, sqlx::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, sqlx::Error>>,
{
    let mut waits = END_BACKOFF.delays(END_RETRIES);
    let mut result = statement().await;
    loop {
        match result {
            Err(e) if transient(&e) => match waits.next() {
                Some(wait) => {
                    tracing::debug!(error = %JobError::from(e), what, wait_ms = wait.as_millis() as u64, "retrying");
                    tokio::time::sleep(wait).await;
                    result = match pool.follows_hosts() {
                        true => match pool.reconnect().await {
                            Ok(()) => statement().await,
                            Err(e) => Err(e),
                        },
                        false => statement().await,
                    };
                }
                None => return Err(e),
            },
            result => return result,
        }
    }
}
