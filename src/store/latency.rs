//! The throttle's probe of the commit latency libraryd meets (`throttle.max_commit_latency`).

use std::time::Duration;

use sqlx::Executor;
use tokio::time::Instant;

use crate::store::Db;

/// One tiny writing transaction in one round trip, touching no table. It must write WAL before its commit: a
/// transaction that only took an id commits without waiting for the flush (nor for a synchronous standby), so it
/// would not meet what libraryd's writing transactions meet. A transactional logical message is the smallest
/// such write (one WAL record; logical decoding consumers see it under this prefix).
pub const PROBE: &str = "begin; select pg_logical_emit_message(true, 'fine-settler-probe', ''); commit";

/// How long one probe transaction takes, from sending it to its commit's answer, on a connection already
/// checked out of the pool (a wait for a free connection is not counted).
pub async fn commit_latency(pool: &Db) -> Result<Duration, sqlx::Error> {
    let mut conn = pool.pool().acquire().await?;
    let started = Instant::now();
    // A statement without arguments goes as one simple query: the three statements in one round trip.
    conn.execute(PROBE).await?;
    Ok(started.elapsed())
}
