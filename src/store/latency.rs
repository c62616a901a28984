//! The throttle's probe of the commit latency libraryd meets (`throttle.max_commit_latency`).

use std::time::Duration;

use sqlx::{Connection, Executor, PgConnection};
use tokio::time::Instant;

use crate::store::Db;

/// The probe's write, touching no table. A transaction must write WAL before its commit to wait for the flush
/// (and for a synchronous standby) as a writing transaction of libraryd's does — one that only took an id commits
/// without waiting. A transactional logical message is the smallest such write (one WAL record; logical decoding
/// consumers see it under this prefix).
pub const PROBE_WRITE: &str = "select pg_logical_emit_message(true, 'fine-settler-probe', '')";

/// How long one probe transaction takes on a connection already checked out of the pool (a wait for a free
/// connection is not counted); `None` if it took longer than `timeout`. A probe still running then is not waited
/// for: its connection leaves the pool and is closed, so that a hung server cannot hold the pool's connections.
pub async fn commit_latency(pool: &Db, timeout: Duration) -> Result<Option<Duration>, sqlx::Error> {
    let mut conn = pool.pool().acquire().await?;
    match tokio::time::timeout(timeout, probe(&mut conn)).await {
        Ok(latency) => latency.map(Some),
        Err(_) => {
            drop(conn.detach());
            Ok(None)
        }
    }
}

/// One probe transaction on `conn`, shaped as a short transaction of libraryd's — four round trips: `begin`, a
/// read, the write, `commit` — timed from the first to the commit's answer. Its time is what such a transaction
/// meets at that moment: each round trip's wake-up on a busy server, the WAL insert and flush queue.
pub async fn probe(conn: &mut PgConnection) -> Result<Duration, sqlx::Error> {
    let started = Instant::now();
    let mut tx = conn.begin().await?;
    tx.execute("select 1").await?;
    tx.execute(PROBE_WRITE).await?;
    tx.commit().await?;
    Ok(started.elapsed())
}
