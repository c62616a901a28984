//! What a database failure means. [`StoreError`] is the store's own error; [`ReadOnlyServer`] says why a server
//! cannot write; [`classify`] is the one place that reads SQLSTATE codes: every decision the product takes on a
//! failed statement (retry on a new connection, leave a locked row for later, queue a refused charge, report a
//! read-only server or missing migrations) starts from its [`DbFailure`].

use sqlx::{Executor, PgConnection};

use crate::redact::secrets_in as redact_secrets_in;

/// Why a database operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A statement or connection failed; the message has the URL's password redacted.
    #[error("database error: {}", crate::store::tls::database_error(.0))]
    Sql(#[from] sqlx::Error),
    /// Applying migrations failed.
    #[error("migration failed: {}", redact_secrets_in(&.0.to_string()))]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The schema cannot be built on this Citus coordinator, or `database.engine` does not say what the server is.
    #[error("{0}")]
    Citus(#[from] crate::store::migrations::CitusError),
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
    /// travels the paths every database error travels; [`classify`] recognises it).
    pub fn check(in_recovery: bool, read_only: bool) -> Result<(), sqlx::Error> {
        match ReadOnlyServer::of(in_recovery, read_only) {
            Some(r) => Err(r.into()),
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

impl From<ReadOnlyServer> for sqlx::Error {
    /// An I/O error wrapping the finding: no statement was refused, the connection leads nowhere useful.
    fn from(r: ReadOnlyServer) -> Self {
        sqlx::Error::Io(std::io::Error::other(r))
    }
}

/// What a failed database operation means, as far as fine-settler decides anything on it. One value per error:
/// the questions the product asks ([`DbFailure::transient`], [`DbFailure::read_only`],
/// [`DbFailure::lock_wait`], [`DbFailure::refused`]) are answered from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbFailure {
    /// A row (or other) lock was not granted within `lock_timeout` (`lock_not_available`, 55P03).
    LockWait,
    /// The lock wait closed a cycle with another transaction and PostgreSQL cancelled this side
    /// (`deadlock_detected`, 40P01).
    Deadlock,
    /// The statement was refused because its transaction is read-only (`read_only_sql_transaction`, 25006): the
    /// server was demoted, or made read-only by default, under an open connection.
    ReadOnlyTransaction,
    /// [`ReadOnlyServer::check`] found the server unable to write before any statement was sent: a finding about
    /// the connection, which another host (after a failover) may not share.
    ReadOnlyServer,
    /// The connection rather than the statement failed — I/O, TLS, the protocol, no connection within the
    /// acquire timeout, class 08 (connection exception) or 57P (the server shutting down, crashed or not yet
    /// accepting connections) — so the same statement may succeed on a new connection.
    ConnectionLost,
    /// The statement was cancelled (`query_canceled`, 57014): in fine-settler, almost always its
    /// `statement_timeout` (the batch timeout), otherwise an operator's cancel request.
    Canceled,
    /// A table the statement names does not exist (`undefined_table`, 42P01): the schema is not migrated.
    UndefinedTable,
    /// The server itself is in trouble: insufficient resources (class 53: a full disk, out of memory), a system
    /// error (58) or an internal error (XX). About the server, not the statement.
    ServerTrouble,
    /// Any other error the server raised for the statement: a constraint, a trigger's exception, bad data.
    Rejected,
    /// Not a database failure at all: sqlx's own (no row where one was expected, a value it cannot decode, the
    /// pool closed, its configuration).
    Other,
}

impl DbFailure {
    /// Whether the same statement may succeed on a new connection: [`DbFailure::ConnectionLost`], and a server
    /// found read-only by a check (a reconnect may reach the promoted host). The ending statements of a run are
    /// retried on these.
    pub fn transient(self) -> bool {
        matches!(self, DbFailure::ConnectionLost | DbFailure::ReadOnlyServer)
    }

    /// Whether the server cannot write: found so by a check, or a statement refused for it.
    pub fn read_only(self) -> bool {
        matches!(self, DbFailure::ReadOnlyTransaction | DbFailure::ReadOnlyServer)
    }

    /// Whether the statement failed waiting for a lock (a timeout or a deadlock): the jobs leave the row for
    /// later.
    pub fn lock_wait(self) -> bool {
        matches!(self, DbFailure::LockWait | DbFailure::Deadlock)
    }

    /// Whether the server answered and refused this statement, as opposed to the connection failing, the server
    /// being in trouble, or sqlx failing on its own: every SQLSTATE but classes 08, 57P, 53, 58 and XX. Accrual
    /// isolates a charge refused so and queues it (server trouble is not queued: it would burn the charges'
    /// attempts during an incident).
    pub fn refused(self) -> bool {
        matches!(
            self,
            DbFailure::LockWait
                | DbFailure::Deadlock
                | DbFailure::ReadOnlyTransaction
                | DbFailure::Canceled
                | DbFailure::UndefinedTable
                | DbFailure::Rejected
        )
    }

    /// What a SQLSTATE means. The single codes are matched before the classes that would otherwise hold them.
    fn of_sqlstate(code: &str) -> Self {
        match code {
            "55P03" => DbFailure::LockWait,
            "40P01" => DbFailure::Deadlock,
            "25006" => DbFailure::ReadOnlyTransaction,
            "57014" => DbFailure::Canceled,
            "42P01" => DbFailure::UndefinedTable,
            c if c.starts_with("08") || c.starts_with("57P") => DbFailure::ConnectionLost,
            c if c.starts_with("53") || c.starts_with("58") || c.starts_with("XX") => {
                DbFailure::ServerTrouble
            }
            _ => DbFailure::Rejected,
        }
    }
}

/// What `e` means (see [`DbFailure`]).
pub fn classify(e: &sqlx::Error) -> DbFailure {
    match e {
        sqlx::Error::Io(io) if io.get_ref().is_some_and(|inner| inner.is::<ReadOnlyServer>()) => {
            DbFailure::ReadOnlyServer
        }
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) | sqlx::Error::PoolTimedOut => {
            DbFailure::ConnectionLost
        }
        // PostgreSQL always sends a code; an error without one is still the server's answer to the statement.
        sqlx::Error::Database(db) => db
            .code()
            .map_or(DbFailure::Rejected, |c| DbFailure::of_sqlstate(&c)),
        _ => DbFailure::Other,
    }
}

/// Whether `e` says the server cannot write: found read-only by [`ReadOnlyServer::check`], or a statement that
/// failed with `read_only_sql_transaction` (25006).
pub fn read_only(e: &sqlx::Error) -> bool {
    classify(e).read_only()
}

/// Whether the statement failed waiting for a row lock: not granted within `lock_timeout` (55P03), or the wait
/// closed a cycle with another transaction and PostgreSQL cancelled this side (deadlock, 40P01).
pub fn lock_not_available(e: &sqlx::Error) -> bool {
    classify(e).lock_wait()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sqlx::{Connection, PgPool};

    use super::*;

    /// Each code, its meaning, and the four decisions taken on it: (transient, read-only, lock wait, refused).
    /// These are the decisions the product took before the classifier, each at its own site.
    const TABLE: &[(&str, DbFailure, [bool; 4])] = &[
        ("55P03", DbFailure::LockWait, [false, false, true, true]),
        ("40P01", DbFailure::Deadlock, [false, false, true, true]),
        (
            "25006",
            DbFailure::ReadOnlyTransaction,
            [false, true, false, true],
        ),
        ("57014", DbFailure::Canceled, [false, false, false, true]),
        ("42P01", DbFailure::UndefinedTable, [false, false, false, true]),
        ("08006", DbFailure::ConnectionLost, [true, false, false, false]),
        ("08000", DbFailure::ConnectionLost, [true, false, false, false]),
        ("57P01", DbFailure::ConnectionLost, [true, false, false, false]),
        ("57P03", DbFailure::ConnectionLost, [true, false, false, false]),
        ("53100", DbFailure::ServerTrouble, [false, false, false, false]),
        ("53200", DbFailure::ServerTrouble, [false, false, false, false]),
        ("58030", DbFailure::ServerTrouble, [false, false, false, false]),
        ("XX000", DbFailure::ServerTrouble, [false, false, false, false]),
        ("XX001", DbFailure::ServerTrouble, [false, false, false, false]),
        // Not 57P: an operator's intervention other than a shutdown is about the statement.
        ("57000", DbFailure::Rejected, [false, false, false, true]),
        ("23505", DbFailure::Rejected, [false, false, false, true]),
        ("23514", DbFailure::Rejected, [false, false, false, true]),
        ("P0001", DbFailure::Rejected, [false, false, false, true]),
        ("22012", DbFailure::Rejected, [false, false, false, true]),
        ("40001", DbFailure::Rejected, [false, false, false, true]),
    ];

    fn decisions(f: DbFailure) -> [bool; 4] {
        [f.transient(), f.read_only(), f.lock_wait(), f.refused()]
    }

    #[test]
    fn every_code_means_one_thing_and_the_decisions_follow() {
        for (code, meaning, expected) in TABLE {
            let f = DbFailure::of_sqlstate(code);
            assert_eq!(f, *meaning, "{code}");
            assert_eq!(decisions(f), *expected, "{code}: {f:?}");
        }
    }

    #[test]
    fn errors_outside_the_server_are_classified_by_their_kind() {
        let io = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(classify(&io), DbFailure::ConnectionLost);
        assert_eq!(classify(&sqlx::Error::PoolTimedOut), DbFailure::ConnectionLost);
        assert_eq!(
            classify(&sqlx::Error::Protocol("eof".into())),
            DbFailure::ConnectionLost
        );
        assert_eq!(
            classify(&sqlx::Error::Tls("handshake".into())),
            DbFailure::ConnectionLost
        );
        assert_eq!(classify(&sqlx::Error::RowNotFound), DbFailure::Other);
        assert_eq!(classify(&sqlx::Error::PoolClosed), DbFailure::Other);
        assert_eq!(decisions(DbFailure::Other), [false; 4]);
    }

    #[test]
    fn a_server_found_read_only_is_read_only_and_worth_a_new_connection_but_no_refusal() {
        for (in_recovery, read_only) in [(true, false), (true, true), (false, true)] {
            let e = ReadOnlyServer::check(in_recovery, read_only).expect_err("read-only");
            assert_eq!(classify(&e), DbFailure::ReadOnlyServer);
            assert_eq!(decisions(classify(&e)), [true, true, false, false]);
            assert!(super::read_only(&e));
        }
        assert!(ReadOnlyServer::check(false, false).is_ok());
    }

    /// The error the last of `statements` fails with on `conn`, each sent on its own (the ones before it set the
    /// scene and must succeed).
    async fn failure(conn: &mut PgConnection, statements: &[&str]) -> sqlx::Error {
        let (last, setup) = statements.split_last().expect("a statement");
        for sql in setup {
            sqlx::raw_sql(sql).execute(&mut *conn).await.expect(sql);
        }
        sqlx::raw_sql(last).execute(&mut *conn).await.expect_err(last)
    }

    #[sqlx::test(migrations = false)]
    async fn the_servers_own_errors_are_classified(pool: PgPool) {
        let mut conn = pool.acquire().await.expect("connection");
        let cases: [(&[&str], DbFailure); 6] = [
            (&["select * from no_such_table"], DbFailure::UndefinedTable),
            (&["select 1 / 0"], DbFailure::Rejected),
            (
                &["do $$ begin raise exception 'refused by a trigger'; end $$"],
                DbFailure::Rejected,
            ),
            (
                &["do $$ begin raise exception 'no space' using errcode = 'disk_full'; end $$"],
                DbFailure::ServerTrouble,
            ),
            (
                &["set statement_timeout = '10ms'", "select pg_sleep(10)"],
                DbFailure::Canceled,
            ),
            (
                &["begin read only", "create table t (id int)"],
                DbFailure::ReadOnlyTransaction,
            ),
        ];
        for (statements, meaning) in cases {
            let e = failure(&mut conn, statements).await;
            assert_eq!(classify(&e), meaning, "{statements:?}: {e}");
            sqlx::raw_sql("rollback; reset all")
                .execute(&mut *conn)
                .await
                .expect("reset");
        }
    }

    #[sqlx::test(migrations = false)]
    async fn a_lock_not_granted_within_the_lock_timeout_is_a_lock_wait(pool: PgPool) {
        let mut holder = pool.begin().await.expect("begin");
        sqlx::query("select pg_advisory_xact_lock(1)")
            .execute(&mut *holder)
            .await
            .expect("lock");
        let mut waiter = pool.begin().await.expect("begin");
        crate::store::set_local_lock_timeout(&mut waiter, Duration::from_millis(1))
            .await
            .expect("lock_timeout");
        let e = failure(&mut waiter, &["select pg_advisory_xact_lock(1)"]).await;
        assert_eq!(classify(&e), DbFailure::LockWait, "{e}");
        assert!(lock_not_available(&e));
    }

    #[sqlx::test(migrations = false)]
    async fn a_lock_wait_that_closes_a_cycle_is_a_deadlock(pool: PgPool) {
        let mut a = pool.begin().await.expect("begin");
        let mut b = pool.begin().await.expect("begin");
        for (tx, key) in [(&mut a, 1), (&mut b, 2)] {
            sqlx::query("select pg_advisory_xact_lock($1)")
                .bind(key)
                .execute(&mut **tx)
                .await
                .expect("lock");
        }
        let pid_a: i32 = sqlx::query_scalar("select pg_backend_pid()")
            .fetch_one(&mut *a)
            .await
            .expect("pid");
        // A waits for B's lock; once it waits, B asks for A's and one of them is cancelled. Each side rolls back
        // as soon as its statement ends (a failed transaction keeps its locks until then), letting the other on.
        let a_waits = tokio::spawn(async move {
            let r = sqlx::query("select pg_advisory_xact_lock(2)")
                .execute(&mut *a)
                .await;
            a.rollback().await.expect("rollback");
            r
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let waiting: bool =
                sqlx::query_scalar("select exists (select 1 from pg_locks where pid = $1 and not granted)")
                    .bind(pid_a)
                    .fetch_one(&pool)
                    .await
                    .expect("pg_locks");
            if waiting {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "A never waited for B's lock"
            );
            tokio::task::yield_now().await;
        }
        let b_result = sqlx::query("select pg_advisory_xact_lock(1)")
            .execute(&mut *b)
            .await;
        b.rollback().await.expect("rollback");
        let a_result = a_waits.await.expect("join");
        let e = match (a_result, b_result) {
            (Err(e), Ok(_)) | (Ok(_), Err(e)) => e,
            (a, b) => panic!("exactly one side is cancelled: {:?} / {:?}", a.err(), b.err()),
        };
        assert_eq!(classify(&e), DbFailure::Deadlock, "{e}");
        assert!(lock_not_available(&e));
    }

    #[sqlx::test(migrations = false)]
    async fn a_terminated_backend_is_a_lost_connection(pool: PgPool) {
        let options = (*pool.connect_options()).clone();
        let mut conn = PgConnection::connect_with(&options).await.expect("connect");
        let e = failure(&mut conn, &["select pg_terminate_backend(pg_backend_pid())"]).await;
        assert_eq!(classify(&e), DbFailure::ConnectionLost, "{e}");
        assert!(classify(&e).transient());
    }
}
