//! [`Db`], the pool every statement goes through, and the way its connections reach PostgreSQL behind
//! `database.pooler`: directly, or one transaction at a time ([`Unit`]) behind a transaction-mode pooler.

use std::sync::Arc;

use futures_util::{future::BoxFuture, stream::BoxStream, TryStreamExt};
use sqlx::{
    postgres::{PgConnectOptions, PgPoolOptions, PgQueryResult, PgRow, PgTypeInfo},
    Connection, Executor, PgConnection, PgPool, Postgres, Transaction,
};

use super::{
    route::{host_of, Route},
    session::Gucs,
};
use crate::config::{DatabaseSettings, Engine, Pooler};

/// How long [`Db::try_begin`] waits for a connection the pool opens.
const SPARE_WITHIN: std::time::Duration = std::time::Duration::from_millis(500);

/// A pool and the way its connections reach PostgreSQL (`database.pooler`): every statement fine-settler runs
/// against the database goes through one.
///
/// Directly or behind a session-mode pooler it is the pool, nothing more. Behind a transaction-mode pooler a
/// server connection belongs to this client only until its transaction ends, and PgBouncer's defaults forward
/// neither startup options nor prepared statements across transactions. So there every statement runs inside a
/// transaction ([`Db::begin`], or one of its own when run on the `Db` itself, as an [`Executor`]) whose first
/// round trip sets the connection's settings `LOCAL` and clears prepared statements left by earlier clients,
/// and sqlx caches no statement (each is prepared anew in the transaction that runs it).
#[derive(Clone)]
pub struct Db {
    pool: PgPool,
    pooler: Pooler,
    /// Behind a transaction-mode pooler, the statement every transaction begins with.
    begin: Option<Arc<str>>,
    route: Arc<Route>,
    /// What the server is (`database.engine`): on Citus a batch's write is routed to one shard at a time
    /// ([`crate::store::citus`]).
    engine: Engine,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("pooler", &self.pooler)
            .field("size", &self.pool.size())
            .finish_non_exhaustive()
    }
}

impl From<PgPool> for Db {
    /// A pool of direct connections.
    fn from(pool: PgPool) -> Self {
        let route = Route::direct((*pool.connect_options()).clone());
        Db {
            pool,
            pooler: Pooler::None,
            begin: None,
            route: route.into(),
            engine: Engine::Postgresql,
        }
    }
}

/// A connection checked out of a [`Db`] for one statement: a plain pooled connection, or (behind a
/// transaction-mode pooler) a transaction, committed by [`Unit::done`].
pub enum Unit {
    Plain(sqlx::pool::PoolConnection<Postgres>),
    Tx(Transaction<'static, Postgres>),
}

impl std::fmt::Debug for Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unit::Plain(_) => "Unit::Plain",
            Unit::Tx(_) => "Unit::Tx",
        })
    }
}

impl std::ops::Deref for Unit {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        match self {
            Unit::Plain(c) => c,
            Unit::Tx(t) => t,
        }
    }
}

impl std::ops::DerefMut for Unit {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Unit::Plain(c) => c,
            Unit::Tx(t) => t,
        }
    }
}

impl Unit {
    /// Ends the unit: commits its transaction, if it has one.
    pub async fn done(self) -> Result<(), sqlx::Error> {
        match self {
            Unit::Plain(_) => Ok(()),
            Unit::Tx(t) => t.commit().await,
        }
    }
}

impl Db {
    /// A pool of `options`' size on `db`'s first host that opens no connection until one is needed.
    pub(super) fn lazy(
        db: &DatabaseSettings,
        application_name: &str,
        gucs: &Gucs,
        options: PgPoolOptions,
    ) -> Self {
        let route = Arc::new(Route::new(db, application_name, gucs));
        let fresh = route.clone();
        let mut options = options;
        if route.len() > 1 {
            // sqlx retries a refused connection until the acquire timeout ("the server is starting"); with other
            // hosts to try, a dead one is given up after the per-host timeout instead.
            let timeout = options.get_acquire_timeout().min(route.host_timeout);
            options = options.acquire_timeout(timeout);
        }
        // A stale connection is dropped before anything is sent on it (sqlx's own check would first ping it,
        // which on a vanished host waits for the network to give up); a fresh one is pinged as sqlx would.
        let mut options = options
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                let fresh = fresh.fresh(meta.age);
                Box::pin(async move { Ok(fresh && conn.ping().await.is_ok()) })
            });
        if let Some(sql) = &route.after_connect {
            let sql: Arc<str> = sql.as_str().into();
            options = options.after_connect(move |conn, _| {
                let sql = sql.clone();
                Box::pin(async move {
                    conn.execute(&*sql).await?;
                    Ok(())
                })
            });
        }
        Db {
            pool: options.connect_lazy_with(route.options(0)),
            pooler: db.pooler,
            begin: (db.pooler == Pooler::Transaction).then(|| gucs.begin_local().into()),
            route,
            engine: db.engine,
        }
    }

    /// Looks for a server again, after a connection error or a read-only server: the hosts are tried in order
    /// and the first that qualifies becomes the pool's (with one host, that host); connections opened before
    /// are dropped rather than reused. `Err` if no host qualifies (the pool keeps its host, and the next call
    /// tries again).
    pub async fn reconnect(&self) -> Result<(), sqlx::Error> {
        self.route.stale();
        self.route.relearn_tls();
        if self.route.len() == 1 {
            self.learn_tls().await;
            return Ok(());
        }
        let chosen = self.route.choose().await?;
        let host = self.route.options(chosen);
        if host_of(&host) != host_of(&self.pool.connect_options()) {
            tracing::info!(host = %host_of(&host), "switching to the next qualifying host");
            self.route.switched();
        }
        self.pool.set_connect_options(host);
        self.route.set_current(chosen);
        // Connections opened while the hosts were tried went to the old host.
        self.route.stale();
        Ok(())
    }

    /// Under `sslmode=prefer`, until a connection to the pool's host has succeeded: connects to it once to learn
    /// whether its TLS handshake works; if it does not (a certificate rustls cannot use, see [`super::tls`]), the
    /// pool connects to that host without TLS from then on. Cheap once learnt; a failure to connect is left to the
    /// connections that follow. A lazy pool's first user calls it, so that its first connection already works.
    pub async fn learn_tls(&self) {
        let i = self.route.current();
        if self.route.learn_tls(i).await {
            self.pool.set_connect_options(self.route.options(i));
            self.route.stale();
        }
    }

    /// How many times [`Db::reconnect`] moved the pool to another host.
    pub fn switches(&self) -> u64 {
        self.route.switches()
    }

    /// The host the pool opens its connections to now, as `host:port`.
    pub fn host(&self) -> String {
        host_of(&self.pool.connect_options())
    }

    /// Whether `database.url` lists several hosts, so that [`Db::reconnect`] may move to another.
    pub fn follows_hosts(&self) -> bool {
        self.route.len() > 1
    }

    /// The options the pool opens its connections with now (its current host).
    pub fn current_options(&self) -> PgConnectOptions {
        (*self.pool.connect_options()).clone()
    }

    /// What must run on a new connection before it is used (for connections opened outside the pool).
    pub(super) fn after_connect(&self) -> Option<&str> {
        self.route.after_connect.as_deref()
    }

    /// Behind a transaction-mode pooler, the statement every transaction begins with (for connections opened
    /// outside the pool).
    pub(super) fn begin_statement(&self) -> Option<Arc<str>> {
        self.begin.clone()
    }

    /// The pool's route generation: a connection opened outside the pool in an older one is stale (see
    /// [`Db::reconnect`]).
    pub(super) fn generation(&self) -> u64 {
        self.route.generation()
    }

    /// The pool underneath.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// What the server is (`database.engine`).
    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// What sits between this pool and PostgreSQL.
    pub fn pooler(&self) -> Pooler {
        self.pooler
    }

    /// Begins a transaction (with the connection's settings made local to it, behind a transaction-mode
    /// pooler).
    pub async fn begin(&self) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        match &self.begin {
            None => self.pool.begin().await,
            Some(begin) => self.pool.begin_with(begin.to_string()).await,
        }
    }

    /// [`Db::begin`] when a connection is idle or the pool may open one (`None` when every connection is in
    /// use, or a new one is not open within [`SPARE_WITHIN`]): for work that is done another way rather than
    /// wait for a connection.
    pub async fn try_begin(&self) -> Result<Option<Transaction<'static, Postgres>>, sqlx::Error> {
        if self.pool.num_idle() == 0 && self.pool.size() >= self.pool.options().get_max_connections() {
            return Ok(None);
        }
        match tokio::time::timeout(SPARE_WITHIN, self.begin()).await {
            Ok(tx) => tx.map(Some),
            Err(_) => Ok(None),
        }
    }

    /// A connection for one statement (see [`Unit`]).
    pub async fn unit(&self) -> Result<Unit, sqlx::Error> {
        match &self.begin {
            None => Ok(Unit::Plain(self.pool.acquire().await?)),
            Some(_) => Ok(Unit::Tx(self.begin().await?)),
        }
    }

    /// Closes every connection, waiting for checked-out ones to come back — for at most [`CLOSE_WITHIN`]: a
    /// connection stuck reading from a server that stopped answering (a frozen host, a partition) never comes
    /// back, and a command that had already finished its work waited for it for ever. Whatever is still open then
    /// is left to the process's exit.
    pub async fn close(&self) {
        if tokio::time::timeout(CLOSE_WITHIN, self.pool.close())
            .await
            .is_err()
        {
            tracing::warn!(
                host = %self.host(),
                "a connection did not close within {} (the server does not answer); leaving it",
                humantime::format_duration(CLOSE_WITHIN)
            );
        }
    }
}

/// How long [`Db::close`] waits for the connections to close.
pub const CLOSE_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

impl<'d> sqlx::Executor<'d> for &'_ Db {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<sqlx::Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        E: 'q + sqlx::Execute<'q, Postgres>,
    {
        if self.begin.is_none() {
            return self.pool.fetch_many(query);
        }
        let db = self.clone();
        Box::pin(
            futures_util::stream::once(async move {
                let mut unit = db.unit().await?;
                let all: Vec<_> = unit.fetch_many(query).try_collect().await?;
                unit.done().await?;
                Ok::<_, sqlx::Error>(futures_util::stream::iter(all.into_iter().map(Ok)))
            })
            .try_flatten(),
        )
    }

    fn fetch_optional<'e, 'q: 'e, E>(self, query: E) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        E: 'q + sqlx::Execute<'q, Postgres>,
    {
        if self.begin.is_none() {
            return self.pool.fetch_optional(query);
        }
        let db = self.clone();
        Box::pin(async move {
            let mut unit = db.unit().await?;
            let row = unit.fetch_optional(query).await?;
            unit.done().await?;
            Ok(row)
        })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<sqlx::postgres::PgStatement<'q>, sqlx::Error>> {
        self.pool.prepare_with(sql, parameters)
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<sqlx::Describe<Postgres>, sqlx::Error>> {
        self.pool.describe(sql)
    }
}
