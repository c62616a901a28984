//! The control of the impact section: a writer that is not fine-settler — plain `insert`s into a table of its
//! own, at a fixed WAL rate — beside the same load, so that a phase's cost can be set against what writing its
//! WAL volume alone costs the load on this server (the floor no way of settling can go under).

use std::time::Duration;

use sqlx::PgPool;
use tokio::time::{Instant, MissedTickBehavior};

use crate::Error;

/// The writer commits once per tick: about as often as a paced `settle` commits a batch.
pub(super) const TICK: Duration = Duration::from_millis(50);

/// Bytes of padding per row (a row's WAL is this plus its header and the record's).
const PAD: i32 = 300;

/// Creates the writer's table in the database `pool` reaches.
pub(super) async fn prepare(pool: &PgPool) -> Result<(), Error> {
    sqlx::raw_sql("create table if not exists walgen (id bigserial primary key, pad text not null)")
        .execute(pool)
        .await?;
    Ok(())
}

/// The WAL one row of the writer's costs, measured with nothing else running: 20,000 rows in 20 transactions.
pub(super) async fn bytes_per_row(pool: &PgPool) -> Result<f64, Error> {
    prepare(pool).await?;
    let before: String = sqlx::query_scalar("select pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await?;
    for _ in 0..20 {
        insert(pool, 1_000).await?;
    }
    let bytes: i64 = sqlx::query_scalar("select pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint")
        .bind(&before)
        .fetch_one(pool)
        .await?;
    Ok(bytes as f64 / 20_000.0)
}

async fn insert(pool: &PgPool, rows: i64) -> Result<(), Error> {
    sqlx::query("insert into walgen (pad) select repeat('x', $1) from generate_series(1, $2)")
        .bind(PAD)
        .bind(rows)
        .execute(pool)
        .await?;
    Ok(())
}

/// Writes `bytes_per_sec` of WAL (at `bytes_per_row`) for `secs`, one transaction per [`TICK`]; the rows
/// written. A tick that falls behind is skipped, not made up in a burst.
pub(super) async fn write(
    pool: PgPool,
    bytes_per_sec: f64,
    bytes_per_row: f64,
    secs: Duration,
) -> Result<i64, Error> {
    let per_tick = bytes_per_sec * TICK.as_secs_f64() / bytes_per_row.max(1.0);
    let mut owed = 0.0;
    let mut written = 0;
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let end = Instant::now() + secs;
    while Instant::now() < end {
        ticks.tick().await;
        owed += per_tick;
        let rows = owed.floor() as i64;
        if rows > 0 {
            insert(&pool, rows).await?;
            owed -= rows as f64;
            written += rows;
        }
    }
    pool.close().await;
    Ok(written)
}
