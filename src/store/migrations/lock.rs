//! The one lock of `migrate`: a session-level advisory lock, held on the connection that does everything
//! `migrate` does — waiting for index builds, clearing what an interrupted build left, sqlx's migrator, the
//! final check — from before it first looks at the schema until it is done. A session lock, because the
//! migrations that build indexes `CONCURRENTLY` cannot run inside a transaction.
//!
//! sqlx's migrator takes a session advisory lock of its own (keyed on the database's name) on the same
//! connection. Every `migrate` takes this one first, so no other `migrate` can hold sqlx's when it is asked for:
//! it never waits. (Only an older binary, which knew nothing of this lock, could hold it.)

use std::time::Duration;

use sqlx::PgConnection;

/// The lock's key: "fine-mig" in ASCII. Advisory locks are per database: `migrate`s of two databases on one
/// server do not wait for each other.
const KEY: i64 = i64::from_be_bytes(*b"fine-mig");

/// How often a `migrate` waiting for another asks for the lock again.
const POLL: Duration = Duration::from_millis(250);

/// Takes the lock on `conn`, waiting for as long as another `migrate` holds it.
///
/// It asks with `pg_try_advisory_lock` again and again rather than waiting inside `pg_advisory_lock`: a backend
/// waiting in a statement holds a snapshot, and `create index concurrently` waits, before it marks the index
/// valid, for every transaction holding an older snapshot to end. The holder's build would wait for the
/// waiter, the waiter for the holder's lock, and PostgreSQL would end one of them with "deadlock detected".
/// Between two tries a waiter holds no snapshot, and a try lasts one round trip.
pub(super) async fn acquire(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    let mut waited = false;
    while !sqlx::query_scalar!(r#"select pg_try_advisory_lock($1) as "locked!""#, KEY)
        .fetch_one(&mut *conn)
        .await?
    {
        if !waited {
            tracing::info!("another migrate is running; waiting for it to finish");
            waited = true;
        }
        tokio::time::sleep(POLL).await;
    }
    if waited {
        tracing::info!("the other migrate has finished; checking the schema");
    }
    Ok(())
}

/// Lets the next `migrate` go ahead at once, rather than when the server notices the connection closed.
pub(super) async fn release(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query_scalar!(r#"select pg_advisory_unlock($1) as "unlocked!""#, KEY)
        .fetch_one(conn)
        .await?;
    Ok(())
}
