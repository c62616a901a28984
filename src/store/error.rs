//! What went wrong in the store: [`StoreError`], [`ReadOnlyServer`] (why a server cannot write), and what a
//! failed statement says ([`read_only`], [`lock_not_available`]).

use sqlx::{Executor, PgConnection};

use crate::redact::secrets_in as redact_secrets_in;

/// Why a database operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A statement or connection failed; the message has the URL's password redacted.
    #[error("database error: {}", redact_secrets_in(&.0.to_string()))]
    Sql(#[from] sqlx::Error),
    /// Applying migrations failed.
    #[error("migration failed: {}", redact_secrets_in(&.0.to_string()))]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The server cannot write; nothing was done.
    #[error("{server} at {host}; nothing was done")]
    ReadOnly { server: ReadOnlyServer, host: String },
}

/// The server fine-settler is connected to cannot write: a hot standby (in recovery), or a primary whose
/// transactions are read-only by default (`default_transaction_read_only`, as set on a demoted primary kept
/// behind a stable address). Nothing is claimed through such a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReadOnlyServer {
    #[error("connected to a read-only server (in recovery: a standby)")]
    InRecovery,
    #[error(
        "connected to a read-only server (its transactions are read-only: default_transaction_read_only)"
    )]
    ReadOnlyTransactions,
}

impl ReadOnlyServer {
    /// `Err` for a server in recovery, or one whose transactions are read-only (as a `sqlx::Error`, so that it
    /// travels the paths every database error travels; [`read_only`] recognises it).
    pub fn check(in_recovery: bool, read_only: bool) -> Result<(), sqlx::Error> {
        match ReadOnlyServer::of(in_recovery, read_only) {
            Some(r) => Err(sqlx::Error::Io(std::io::Error::other(r))),
            None => Ok(()),
        }
    }

    /// What `pg_is_in_recovery()` and `transaction_read_only` say, if the server cannot write.
    pub fn of(in_recovery: bool, read_only: bool) -> Option<Self> {
        match (in_recovery, read_only) {
            (true, _) => Some(ReadOnlyServer::InRecovery),
            (false, true) => Some(ReadOnlyServer::ReadOnlyTransactions),
            (false, false) => None,
        }
    }

    /// Asks the server behind `conn` whether it can write (a simple query: safe behind any pooler).
    pub async fn ask(conn: &mut PgConnection) -> Result<Option<Self>, sqlx::Error> {
        use sqlx::Row;
        let row = conn
            .fetch_one("select pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'")
            .await?;
        Ok(ReadOnlyServer::of(row.try_get(0)?, row.try_get(1)?))
    }
}

/// Whether `e` says the server cannot write: found read-only by [`ReadOnlyServer::check`], or a statement that
/// failed with `read_only_sql_transaction` (25006).
pub fn read_only(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().as_deref() == Some("25006"),
        sqlx::Error::Io(io) => io
            .get_ref()
            .is_some_and(|inner| inner.downcast_ref::<ReadOnlyServer>().is_some()),
        _ => false,
    }
}

/// Whether the statement failed waiting for a row lock: not granted within `lock_timeout` (55P03), or the wait
/// closed a cycle with another transaction and PostgreSQL cancelled this side (deadlock, 40P01).
pub fn lock_not_available(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("55P03" | "40P01")))
}
