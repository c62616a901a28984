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

use crate::store::{self, Db, DbFailure};

/// How often a stop in progress asks whether the database is still there.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Why a stop does not wait for the drain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseGone(pub String);

/// Once the replica is told to stop, while it is past a tick's status statement (`in_pass`): returns as soon as
/// a fresh connection to the pool's host cannot run `select 1` for want of a server (refused, reset, or no answer
/// within `connect_timeout`) — a query, not only a connection: a pooler in front (PgBouncer) accepts connections
/// with its server gone. Never returns while the server answers, or once the pass is over (the replica then stops
/// by itself).
pub async fn database_gone(pool: &Db, in_pass: &Arc<AtomicBool>, connect_timeout: Duration) -> DatabaseGone {
    loop {
        if in_pass.load(Ordering::SeqCst) {
            match tokio::time::timeout(connect_timeout, answers(pool)).await {
                Err(_) => {
                    return DatabaseGone(format!(
                        "{} did not answer within {}",
                        pool.host(),
                        humantime::format_duration(connect_timeout)
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
