//! What a stop waits for, and what it says about the replica's key. A shutdown ends every wait for the database
//! at once (the host search, a connection wait, the backoff: see `outage` and `tick_clock`), so a replica that
//! was not running keys stops within moments, holding none. One that was running keys finishes its batch and
//! hands the key back — unless the database is gone: then nothing it waits for can succeed (the batch cannot
//! commit, the hand-back cannot be recorded), so the stop does not wait out the drain timeout for it; it says
//! that the key could not be handed back and that its lease frees it for a peer.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use sqlx::{Connection, PgConnection};

use super::Daemon;
use crate::store::{self, job_runs, Db, DbFailure};

/// How often a stop in progress asks whether the database is still there.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// The longest a stop's question may go unanswered before the database counts as gone (less when the host's
/// connect timeout is shorter): a frozen server (a paused VM, SIGSTOP) never refuses the connection, and a stop
/// that waited out `database.connect_timeout` for it — or the drain timeout, when that is shorter — was neither
/// prompt nor, at the drain timeout, truthful about what it held. A server that cannot answer `select 1` to a
/// fresh connection in this time cannot commit a batch or a hand-back in it either.
pub const PROBE_WITHIN: Duration = Duration::from_secs(3);

/// Why a stop does not wait for the drain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseGone(pub String);

/// Once the replica is told to stop, while it is past a tick's status statement (`in_pass`): returns as soon as
/// a fresh connection to the pool's host cannot run `select 1` for want of a server (refused, reset, or no answer
/// within `connect_timeout` or [`PROBE_WITHIN`], whichever is shorter) — a query, not only a connection: a pooler in front (PgBouncer) accepts connections
/// with its server gone. Never returns while the server answers, or once the pass is over (the replica then stops
/// by itself).
pub async fn database_gone(pool: &Db, in_pass: &Arc<AtomicBool>, connect_timeout: Duration) -> DatabaseGone {
    let within = connect_timeout.min(PROBE_WITHIN);
    loop {
        if in_pass.load(Ordering::SeqCst) {
            match tokio::time::timeout(within, answers(pool)).await {
                Err(_) => {
                    return DatabaseGone(format!(
                        "{} did not answer within {}",
                        pool.host(),
                        humantime::format_duration(within)
                    ))
                }
                Ok(Err(e)) if store::classify(&e) == DbFailure::ConnectionLost => {
                    return DatabaseGone(store::StoreError::from(e).to_string())
                }
                Ok(_) => {}
            }
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
}

/// Whether a fresh connection to the pool's host runs `select 1` (a connection of its own: the pool's may all be
/// busy with the batch in flight).
async fn answers(pool: &Db) -> Result<(), sqlx::Error> {
    let mut conn = PgConnection::connect_with(&pool.current_options()).await?;
    let answered = sqlx::query("select 1").execute(&mut conn).await.map(|_| ());
    let _ = conn.close().await;
    answered
}

/// The longest a clean stop spends handing back keys left `RUNNING` under its name.
const LEFTOVERS_WITHIN: Duration = Duration::from_secs(2);

/// The `last_error` of a key handed back at a clean stop.
const LEFT_OVER: &str = "left RUNNING by a claim whose answer was lost; handed back when the replica stopped";

impl Daemon {
    /// At a clean stop the replica runs nothing: a key still `RUNNING` under its owner is a claim whose answer was
    /// lost with its connection (it committed after the replica had given up on it). Hands such keys back, so that
    /// a peer takes them over at once rather than after their lease — once every claim given up on has ended on
    /// the server (within the batch timeout of being sent) — within [`LEFTOVERS_WITHIN`], and a failure only
    /// logged (their lease frees them, and the stop says it could not hand a key back).
    pub(super) async fn hand_back_leftovers(&self) {
        // A claim given up on may still commit: its statement ends within the batch timeout of being sent.
        if let Some(by) = self.held.claims_end_by() {
            tokio::time::sleep_until(by).await;
        }
        let handed_back = tokio::time::timeout(
            LEFTOVERS_WITHIN,
            job_runs::hand_back_all_of(&self.pool, &self.owner, LEFT_OVER),
        )
        .await;
        if matches!(handed_back, Ok(Ok(_))) {
            self.held.all_recovered();
        }
        match handed_back {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => tracing::warn!(
                keys = n,
                "handed back keys left RUNNING by claims whose answer was lost"
            ),
            Ok(Err(e)) => {
                tracing::debug!(error = %store::StoreError::from(e), "could not look for keys left RUNNING")
            }
            Err(_) => tracing::debug!("could not look for keys left RUNNING within 2 s"),
        }
    }
}
