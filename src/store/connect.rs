//! The pools the product opens: the jobs' (checked to be writable, or lazy for the daemon) and the status page's
//! own, each with its settings and size.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;

use super::{route::host_of, session::Gucs, Db, ReadOnlyServer, StoreError};
use crate::config::DatabaseSettings;

/// A pool for the jobs, on the first of `database.url`'s hosts that qualifies, and checked to be writable.
/// Every statement runs under `statement_timeout = batch_timeout`, so a batch that hangs on a lock fails
/// before the lease it renews runs out; and `idle_in_transaction_session_timeout = batch_timeout`, so the
/// server aborts the open transaction of a replica that froze mid-batch (SIGSTOP, a VM pause) and its row
/// locks do not block the peer that takes over.
pub async fn connect(
    db: &DatabaseSettings,
    application_name: &str,
    batch_timeout: Duration,
) -> Result<Db, StoreError> {
    let pool = Db::lazy(
        db,
        application_name,
        &Gucs::jobs(batch_timeout, db.engine),
        pool_options(db),
    );
    pool.reconnect().await?;
    let mut conn = pool.pool().acquire().await?;
    if let Some(server) = ReadOnlyServer::ask(&mut conn).await? {
        return Err(StoreError::ReadOnly {
            server,
            host: host_of(&pool.current_options()),
        });
    }
    drop(conn);
    Ok(pool)
}

/// The jobs' pool: `database.max_connections` connections, each waited for `database.connect_timeout` at most.
fn pool_options(db: &DatabaseSettings) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(db.max_connections)
        .acquire_timeout(db.connect_timeout)
}

/// Like [`connect`], but opens no connection until one is needed (and looks neither for a qualifying host nor
/// at whether the server can write: the daemon does, at every tick): the daemon starts (and keeps running)
/// while the database is down.
pub fn connect_lazy(db: &DatabaseSettings, application_name: &str, batch_timeout: Duration) -> Db {
    Db::lazy(
        db,
        application_name,
        &Gucs::jobs(batch_timeout, db.engine),
        pool_options(db),
    )
}

/// The status page's own pool: one connection at most, opened when a page is first loaded and closed after a
/// minute without one, every statement under `statement_timeout = timeout`, and a wait for the connection of at
/// most `timeout` too. It is separate from the jobs' pool so that page loads never take a connection a batch or
/// a claim is waiting for, and the replica holds at most one connection more than `database.max_connections`
/// and the tick's. (However many page loads arrive, the page runs one read at a time through it, and one search
/// for a host after a failed read: see [`crate::status`].)
pub fn connect_status(db: &DatabaseSettings, application_name: &str, timeout: Duration) -> Db {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(timeout)
        .idle_timeout(Duration::from_secs(60));
    Db::lazy(db, application_name, &Gucs::status(timeout), pool)
}
