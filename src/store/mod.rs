//! The database layer: every SQL statement fine-settler sends lives below this module, checked at compile time
//! against the migrations (`.sqlx` holds the offline data, so building needs no database).

pub mod audit;
pub mod job_runs;
pub mod ledger;
pub mod loans;
pub mod pauses;
pub mod replication;
pub mod status;

use std::time::Duration;

use futures_util::{future::BoxFuture, stream::BoxStream, TryStreamExt};
use sqlx::{
    postgres::{PgConnectOptions, PgPoolOptions, PgQueryResult, PgRow, PgTypeInfo},
    Connection, Executor, PgConnection, PgPool, Postgres, Transaction,
};

use crate::{
    config::{DatabaseSettings, Pooler, TargetSessionAttrs},
    redact::secrets_in as redact_secrets_in,
};

/// The migrations in `migrations/`, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Indexes built `CONCURRENTLY` by a migration, with that migration's description; an interrupted build leaves
/// them INVALID.
const CONCURRENT_INDEXES: &[(&str, &str)] = &[
    ("loans_unsettled_returned_idx", "loans unsettled index"),
    ("loans_unsettled_by_return_idx", "loans unsettled by return index"),
    ("loans_open_by_due_idx", "loans open by due index"),
    ("loans_returned_late_idx", "loans returned late index"),
];

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

/// `host`'s options as a connection of `application_name` behind `pooler` opens them: the application name shows
/// the replica in `pg_stat_activity`. Behind a pooler, sqlx's `extra_float_digits` startup parameter is not sent
/// (PgBouncer refuses every startup parameter it does not know; fine-settler reads no floats); behind one in
/// transaction mode no statement is kept prepared beyond its transaction (see [`Db`]).
fn for_pooler(pooler: Pooler, host: &PgConnectOptions, application_name: &str) -> PgConnectOptions {
    let options = host.clone().application_name(application_name);
    match pooler {
        Pooler::None => options,
        Pooler::Session => options.extra_float_digits(None),
        Pooler::Transaction => options.extra_float_digits(None).statement_cache_capacity(0),
    }
}

/// The session settings a pool's connections run under, each a PostgreSQL parameter and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Gucs(Vec<(&'static str, String)>);

impl Gucs {
    /// The job connections' settings: the batch timeout as both `statement_timeout` and
    /// `idle_in_transaction_session_timeout`; no parallel query; and generic plans.
    ///
    /// A batch reads a few thousand rows through an index. With parallel workers allowed, the planner started
    /// workers (and a parallel scan plus sort) for every batch query, several times slower than the index walk.
    /// With custom plans (PostgreSQL's default for a statement's first five executions), the literal month made
    /// the planner read the month's whole range from the index ordered by return date, or the whole table, and
    /// sort it for each batch, 80–150 ms each; the generic plan walks the id-ordered index, as a keyset batch
    /// should (measured with auto_explain; see bench/RESULTS.md).
    fn jobs(batch_timeout: Duration) -> Self {
        let timeout = batch_timeout.as_millis().max(1).to_string();
        Gucs(vec![
            ("statement_timeout", timeout.clone()),
            ("idle_in_transaction_session_timeout", timeout),
            ("max_parallel_workers_per_gather", "0".into()),
            ("plan_cache_mode", "force_generic_plan".into()),
        ])
    }

    /// The status page's: every statement under `statement_timeout = timeout`, no parallel query.
    fn status(timeout: Duration) -> Self {
        Gucs(vec![
            ("statement_timeout", timeout.as_millis().max(1).to_string()),
            ("max_parallel_workers_per_gather", "0".into()),
        ])
    }

    /// The settings as startup `options` (a direct connection).
    fn apply(&self, options: PgConnectOptions) -> PgConnectOptions {
        options.options(self.0.iter().map(|(k, v)| (*k, v.as_str())))
    }

    /// One statement setting them for the session (behind a session-mode pooler, run after connecting).
    fn set_session(&self) -> String {
        self.0
            .iter()
            .map(|(k, v)| format!("set {k} = '{v}'"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The statement that begins a transaction behind a transaction-mode pooler: `begin`; drop whatever
    /// prepared statements an earlier client left on the server connection the pooler assigned (sqlx names
    /// its statements per client connection, so another client's could collide with ours); then the settings,
    /// local to the transaction. One round trip.
    fn begin_local(&self) -> String {
        let sets = self
            .0
            .iter()
            .map(|(k, v)| format!("set_config('{k}', '{v}', true)"))
            .collect::<Vec<_>>()
            .join(", ");
        format!("begin; deallocate all; select {sets}")
    }
}

/// The options of each of `database.url`'s hosts, in order, for a connection with settings `gucs`, and what must
/// run on it after it connects.
fn hosts_with(
    db: &DatabaseSettings,
    application_name: &str,
    gucs: &Gucs,
) -> (Vec<PgConnectOptions>, Option<String>) {
    let hosts = db
        .url
        .hosts()
        .iter()
        .map(|host| {
            let options = for_pooler(db.pooler, host, application_name);
            match db.pooler {
                Pooler::None if !gucs.0.is_empty() => gucs.apply(options),
                _ => options,
            }
        })
        .collect();
    let after = (db.pooler == Pooler::Session).then(|| gucs.set_session());
    (hosts, after)
}

/// The servers a [`Db`] may use — `database.url`'s hosts, in order, each with the options this pool opens
/// connections with — and since when its connections count as fresh.
///
/// sqlx connects a pool to one host. A `Db` starts on the first; [`Db::reconnect`] (after a connection error or
/// a read-only server) tries the hosts in order again, the first that qualifies for `target_session_attrs`
/// becomes the pool's, and every connection opened before is dropped at its next checkout instead of being
/// used (a connection left on a demoted primary passes sqlx's ping and fails every write).
#[derive(Debug)]
struct Route {
    hosts: Vec<PgConnectOptions>,
    target: TargetSessionAttrs,
    /// Per host (`connect_timeout` in the URL), else `database.connect_timeout`.
    host_timeout: Duration,
    /// Run on a new connection before it is used (behind a session-mode pooler: the settings).
    after_connect: Option<String>,
    fresh_since: std::sync::Mutex<std::time::Instant>,
    /// Counts [`Route::stale`] calls: a connection opened outside the pool (the tick's session) compares it.
    generation: std::sync::atomic::AtomicU64,
    /// How many times the pool moved to another host.
    switches: std::sync::atomic::AtomicU64,
}

impl Route {
    fn new(db: &DatabaseSettings, application_name: &str, gucs: &Gucs) -> Self {
        let (hosts, after_connect) = hosts_with(db, application_name, gucs);
        Route {
            hosts,
            target: db.url.target(),
            host_timeout: db.url.host_timeout().unwrap_or(db.connect_timeout),
            after_connect,
            fresh_since: std::sync::Mutex::new(std::time::Instant::now()),
            generation: std::sync::atomic::AtomicU64::new(0),
            switches: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Every connection opened until now is stale: it is dropped at its next checkout instead of being used.
    fn stale(&self) {
        *self.fresh_since.lock().unwrap_or_else(|e| e.into_inner()) = std::time::Instant::now();
        self.generation.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether a connection `age` old was opened after the last [`Db::reconnect`].
    fn fresh(&self, age: Duration) -> bool {
        let since = *self.fresh_since.lock().unwrap_or_else(|e| e.into_inner());
        std::time::Instant::now()
            .checked_sub(age)
            .is_none_or(|opened| opened >= since)
    }

    /// The first host, in order, that answers within the host timeout and qualifies for the target: its index,
    /// or the last host's error.
    async fn choose(&self) -> Result<usize, sqlx::Error> {
        let mut last = None;
        for (i, host) in self.hosts.iter().enumerate() {
            match tokio::time::timeout(self.host_timeout, self.probe(host)).await {
                Ok(Ok(())) => return Ok(i),
                Ok(Err(e)) => {
                    tracing::debug!(host = %host_of(host), error = %redact_secrets_in(&e.to_string()),
                        "host does not qualify");
                    last = Some(e);
                }
                Err(_) => {
                    tracing::debug!(host = %host_of(host), "host did not answer within its connect timeout");
                    last = Some(sqlx::Error::PoolTimedOut);
                }
            }
        }
        Err(last.unwrap_or(sqlx::Error::PoolTimedOut))
    }

    /// Connects to `host` and asks whether it qualifies for the target.
    async fn probe(&self, host: &PgConnectOptions) -> Result<(), sqlx::Error> {
        let mut conn = PgConnection::connect_with(host).await?;
        let fit = match self.target {
            TargetSessionAttrs::Any => Ok(None),
            TargetSessionAttrs::ReadWrite => ReadOnlyServer::ask(&mut conn).await,
            // libpq's `primary`: not in recovery (read-only transactions by default do not disqualify it).
            TargetSessionAttrs::Primary => ReadOnlyServer::ask(&mut conn)
                .await
                .map(|r| r.filter(|r| *r == ReadOnlyServer::InRecovery)),
        };
        let _ = conn.close().await;
        match fit? {
            None => Ok(()),
            Some(r) => Err(sqlx::Error::Io(std::io::Error::other(r))),
        }
    }
}

/// `host:port` of a connection's options, for logs.
fn host_of(options: &PgConnectOptions) -> String {
    format!("{}:{}", options.get_host(), options.get_port())
}

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
    begin: Option<std::sync::Arc<str>>,
    route: std::sync::Arc<Route>,
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
        let route = Route {
            hosts: vec![(*pool.connect_options()).clone()],
            target: TargetSessionAttrs::Any,
            host_timeout: Duration::from_secs(10),
            after_connect: None,
            fresh_since: std::sync::Mutex::new(std::time::Instant::now()),
            generation: std::sync::atomic::AtomicU64::new(0),
            switches: std::sync::atomic::AtomicU64::new(0),
        };
        Db {
            pool,
            pooler: Pooler::None,
            begin: None,
            route: route.into(),
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
    fn lazy(db: &DatabaseSettings, application_name: &str, gucs: &Gucs, options: PgPoolOptions) -> Self {
        let route = std::sync::Arc::new(Route::new(db, application_name, gucs));
        let fresh = route.clone();
        let mut options = options;
        if route.hosts.len() > 1 {
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
            let sql: std::sync::Arc<str> = sql.as_str().into();
            options = options.after_connect(move |conn, _| {
                let sql = sql.clone();
                Box::pin(async move {
                    conn.execute(&*sql).await?;
                    Ok(())
                })
            });
        }
        Db {
            pool: options.connect_lazy_with(route.hosts[0].clone()),
            pooler: db.pooler,
            begin: (db.pooler == Pooler::Transaction).then(|| gucs.begin_local().into()),
            route,
        }
    }

    /// Looks for a server again, after a connection error or a read-only server: the hosts are tried in order
    /// and the first that qualifies becomes the pool's (with one host, that host); connections opened before
    /// are dropped rather than reused. `Err` if no host qualifies (the pool keeps its host, and the next call
    /// tries again).
    pub async fn reconnect(&self) -> Result<(), sqlx::Error> {
        self.route.stale();
        if self.route.hosts.len() == 1 {
            return Ok(());
        }
        let chosen = self.route.choose().await?;
        let host = self.route.hosts[chosen].clone();
        if host_of(&host) != host_of(&self.pool.connect_options()) {
            tracing::info!(host = %host_of(&host), "switching to the next qualifying host");
            self.route
                .switches
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.pool.set_connect_options(host);
        // Connections opened while the hosts were tried went to the old host.
        self.route.stale();
        Ok(())
    }

    /// How many times [`Db::reconnect`] moved the pool to another host.
    pub fn switches(&self) -> u64 {
        self.route.switches.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The host the pool opens its connections to now, as `host:port`.
    pub fn host(&self) -> String {
        host_of(&self.pool.connect_options())
    }

    /// Whether `database.url` lists several hosts, so that [`Db::reconnect`] may move to another.
    pub fn follows_hosts(&self) -> bool {
        self.route.hosts.len() > 1
    }

    /// The options the pool opens its connections with now (its current host).
    pub fn current_options(&self) -> PgConnectOptions {
        (*self.pool.connect_options()).clone()
    }

    /// What must run on a new connection before it is used (for connections opened outside the pool).
    fn after_connect(&self) -> Option<&str> {
        self.route.after_connect.as_deref()
    }

    /// The pool underneath.
    pub fn pool(&self) -> &PgPool {
        &self.pool
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

    /// A connection for one statement (see [`Unit`]).
    pub async fn unit(&self) -> Result<Unit, sqlx::Error> {
        match &self.begin {
            None => Ok(Unit::Plain(self.pool.acquire().await?)),
            Some(_) => Ok(Unit::Tx(self.begin().await?)),
        }
    }

    /// Closes every connection (waiting for checked-out ones to come back).
    pub async fn close(&self) {
        self.pool.close().await
    }
}

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

/// Sets this transaction's `lock_timeout` (`claim.lock_timeout`): a statement that waits longer for a row lock
/// fails with `lock_not_available` (55P03), which the jobs handle by leaving the row for later. Set per
/// transaction rather than per connection, so that the claim statements — which wait for an in-flight batch
/// on purpose — are not cut short.
pub async fn set_local_lock_timeout(tx: &mut PgConnection, timeout: Duration) -> Result<(), sqlx::Error> {
    sqlx::query_scalar!(
        "select set_config('lock_timeout', $1, true)",
        timeout.as_millis().max(1).to_string()
    )
    .fetch_one(&mut *tx)
    .await?;
    Ok(())
}

/// The database clock.
pub async fn database_now(pool: &Db) -> Result<chrono::DateTime<chrono::Utc>, sqlx::Error> {
    sqlx::query_scalar!(r#"select now() as "now!""#)
        .fetch_one(pool)
        .await
}

/// Whether the statement failed waiting for a row lock: not granted within `lock_timeout` (55P03), or the wait
/// closed a cycle with another transaction and PostgreSQL cancelled this side (deadlock, 40P01).
pub fn lock_not_available(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("55P03" | "40P01")))
}

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
    let pool = Db::lazy(db, application_name, &Gucs::jobs(batch_timeout), pool_options(db));
    pool.reconnect().await?;
    let mut conn = pool.pool.acquire().await?;
    if let Some(server) = ReadOnlyServer::ask(&mut conn).await? {
        return Err(StoreError::ReadOnly {
            server,
            host: host_of(&pool.current_options()),
        });
    }
    drop(conn);
    Ok(pool)
}

fn pool_options(db: &DatabaseSettings) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(db.max_connections)
        .acquire_timeout(db.connect_timeout)
}

/// Like [`connect`], but opens no connection until one is needed (and looks neither for a qualifying host nor
/// at whether the server can write: the daemon does, at every tick): the daemon starts (and keeps running)
/// while the database is down.
pub fn connect_lazy(db: &DatabaseSettings, application_name: &str, batch_timeout: Duration) -> Db {
    Db::lazy(db, application_name, &Gucs::jobs(batch_timeout), pool_options(db))
}

/// The status page's own pool: one connection at most, opened when a page is first loaded and closed after a
/// minute without one, every statement under `statement_timeout = timeout`, and a wait for the connection of at
/// most `timeout` too. It is separate from the jobs' pool so that page loads never take a connection a batch or
/// a claim is waiting for: however many arrive, they queue for this one connection (and give up after
/// `timeout`), and the replica holds at most one connection more than `database.max_connections` and the
/// tick's.
pub fn connect_status(db: &DatabaseSettings, application_name: &str, timeout: Duration) -> Db {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(timeout)
        .idle_timeout(Duration::from_secs(60));
    Db::lazy(db, application_name, &Gucs::status(timeout), pool)
}

/// One dedicated connection, re-opened after any error. The daemon reads its tick status through it, so an idle
/// tick is a single round trip (a pooled connection adds a health-check ping at every checkout and release).
pub struct Session {
    /// The jobs' pool: the session connects to its current host, with its options.
    db: Db,
    application_name: String,
    connect_timeout: Duration,
    /// The longest the status statement may take, client side (the server's `statement_timeout` cannot end a
    /// wait on a host that vanished without closing the connection).
    statement_limit: Duration,
    /// The connection, and the pool's [`Route`] generation it was opened in.
    conn: Option<(PgConnection, u64)>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("db", &self.db)
            .field("connected", &self.conn.is_some())
            .finish_non_exhaustive()
    }
}

impl Session {
    /// A session beside `db`'s pool, on the same host and with the same settings; its statement may take
    /// `statement_limit` at most.
    pub fn new(
        db: &Db,
        application_name: &str,
        connect_timeout: Duration,
        statement_limit: Duration,
    ) -> Self {
        Session {
            db: db.clone(),
            application_name: application_name.into(),
            connect_timeout,
            statement_limit,
            conn: None,
        }
    }

    /// The database clock, this shard's recent `job_runs` rows and due pending charges (see
    /// [`job_runs::tick_status`]). `Err` (see [`read_only`]) if the server cannot write.
    pub async fn tick_status(
        &mut self,
        shard: crate::shard::ShardSpec,
        since: chrono::NaiveDate,
        late: job_runs::LateProbe,
    ) -> Result<job_runs::TickStatus, sqlx::Error> {
        let generation = self.db.route.generation();
        if self
            .conn
            .as_ref()
            .is_some_and(|(_, opened)| *opened != generation)
        {
            // The pool looked for a server again since: so does the session.
            self.conn = None;
        }
        if self.conn.is_none() {
            let options = self.db.current_options().application_name(&self.application_name);
            let connect = PgConnection::connect_with(&options);
            let mut conn = tokio::time::timeout(self.connect_timeout, connect)
                .await
                .map_err(|_| sqlx::Error::PoolTimedOut)??;
            if let Some(sql) = self.db.after_connect() {
                conn.execute(sql).await?;
            }
            self.conn = Some((conn, generation));
        }
        let Some((conn, _)) = self.conn.as_mut() else {
            return Err(sqlx::Error::PoolClosed);
        };
        let begin = self.db.begin.clone();
        let read = async {
            match begin {
                None => job_runs::tick_status(conn, shard, since, late).await,
                Some(begin) => {
                    let mut tx = conn.begin_with(begin.to_string()).await?;
                    let status = job_runs::tick_status(&mut tx, shard, since, late).await?;
                    tx.commit().await?;
                    Ok(status)
                }
            }
        };
        let result = tokio::time::timeout(self.statement_limit, read)
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut));
        if result.is_err() {
            // Whatever went wrong, the next tick starts from a fresh connection.
            self.conn = None;
        }
        result
    }
}

/// Whether the replica can work: the database answers within 2 s and every migration this binary knows is
/// applied. `Err` carries the reason, for `/readyz` and the startup log.
pub async fn readiness(pool: &Db) -> Result<(), String> {
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    // `_sqlx_migrations` is sqlx's own table, not part of the checked schema: an unchecked query.
    let applied = tokio::time::timeout(
        Duration::from_secs(2),
        sqlx::query_as::<_, (Option<i64>, bool, bool)>(
            "select max(version), pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'
             from _sqlx_migrations where success",
        )
        .fetch_one(pool),
    )
    .await;
    match applied {
        Err(_) => Err("database did not answer within 2 s".into()),
        Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("42P01") => Err(format!(
            "migrations missing: none applied, binary needs {latest}; run `fine-settler migrate`"
        )),
        Ok(Err(e)) => Err(format!(
            "database unavailable: {}",
            redact_secrets_in(&e.to_string())
        )),
        Ok(Ok((v, in_recovery, read_only))) => match ReadOnlyServer::of(in_recovery, read_only) {
            Some(r) => Err(r.to_string()),
            None if v.unwrap_or(0) < latest => Err(format!(
                "migrations missing: database at {}, binary needs {latest}; run `fine-settler migrate`",
                v.unwrap_or(0)
            )),
            None => Ok(()),
        },
    }
}

/// Applies the migrations; applying them twice is a no-op. Uses one connection without a statement timeout,
/// because building an index concurrently on millions of loans takes longer than any batch. With `bars`, a
/// second connection watches the index builds and draws their progress.
pub async fn migrate(db: &DatabaseSettings, bars: bool) -> Result<(), StoreError> {
    // The first qualifying host of the URL (with one host, that host), without a statement timeout.
    let route = Route::new(db, "fine-settler migrate", &Gucs(Vec::new()));
    let chosen = match route.hosts.len() {
        1 => 0,
        _ => route.choose().await?,
    };
    let options = route.hosts[chosen].clone();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(db.connect_timeout)
        .connect_with(options.clone())
        .await?;
    drop_invalid_indexes(&pool).await?;
    let watcher = if bars {
        // The pool's one connection runs the migrations: its backend is the one to watch.
        let pid = sqlx::query_scalar!(r#"select pg_backend_pid() as "pid!""#)
            .fetch_one(&pool)
            .await?;
        let watcher =
            PgConnection::connect_with(&options.clone().application_name("fine-settler migrate progress"))
                .await?;
        Some(tokio::spawn(crate::progress::watch_index_builds(watcher, pid)))
    } else {
        None
    };
    let result = MIGRATOR.run(&pool).await;
    if let Some(watcher) = watcher {
        watcher.abort();
        let _ = watcher.await;
    }
    result?;
    pool.close().await;
    Ok(())
}

/// Where an index build of backend `pid` stands (`pg_stat_progress_create_index`), if one is running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexBuild {
    pub index: String,
    pub phase: String,
    pub blocks_done: i64,
    pub blocks_total: i64,
    pub tuples_done: i64,
    pub tuples_total: i64,
}

/// The index build backend `pid` is running, if any.
pub async fn index_build(conn: &mut PgConnection, pid: i32) -> Result<Option<IndexBuild>, sqlx::Error> {
    sqlx::query_as!(
        IndexBuild,
        r#"select coalesce(c.relname::text, '') as "index!", p.phase as "phase!",
                  p.blocks_done as "blocks_done!", p.blocks_total as "blocks_total!",
                  p.tuples_done as "tuples_done!", p.tuples_total as "tuples_total!"
           from pg_stat_progress_create_index p left join pg_class c on c.oid = p.index_relid
           where p.pid = $1"#,
        pid
    )
    .fetch_optional(conn)
    .await
}

/// A `create index concurrently` that was interrupted leaves an INVALID index, which `if not exists` would then
/// accept as done. Drop such leftovers (concurrently, so libraryd keeps writing) so the migration rebuilds them.
async fn drop_invalid_indexes(pool: &PgPool) -> Result<(), StoreError> {
    for (name, migration) in CONCURRENT_INDEXES {
        let invalid = sqlx::query_scalar!(
            r#"select exists (
                   select 1 from pg_index i join pg_class c on c.oid = i.indexrelid
                   where c.relname = $1 and c.relnamespace = current_schema()::regnamespace
                     and not i.indisvalid
               ) as "invalid!""#,
            name
        )
        .fetch_one(pool)
        .await?;
        if invalid {
            tracing::warn!(
                index = name,
                "dropping an invalid index left by an interrupted build; it is rebuilt next"
            );
            sqlx::query(&format!("drop index concurrently if exists {name}"))
                .execute(pool)
                .await?;
            // The migration that builds it is already recorded as applied; forget it so it runs again.
            // (`_sqlx_migrations` belongs to sqlx, not to our schema, hence an unchecked query.)
            sqlx::query("delete from _sqlx_migrations where description = $1")
                .bind(migration)
                .execute(pool)
                .await?;
        }
    }
    Ok(())
}
