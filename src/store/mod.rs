//! The database layer: every SQL statement fine-settler sends lives below this module, checked at compile time
//! against the migrations (`.sqlx` holds the offline data, so building needs no database).

pub mod audit;
pub mod job_runs;
pub mod ledger;
pub mod loans;
pub mod pauses;
pub mod status;

use std::time::Duration;

use sqlx::{
    postgres::{PgConnectOptions, PgPoolOptions},
    Connection, PgConnection, PgPool,
};

use crate::{config::DatabaseSettings, redact::secrets_in as redact_secrets_in};

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
}

/// Connection settings shared by every pool: the application name shows the replica in `pg_stat_activity`.
fn connect_options(db: &DatabaseSettings, application_name: &str) -> PgConnectOptions {
    db.url
        .connect_options()
        .clone()
        .application_name(application_name)
}

/// The options every job connection uses: the application name; the batch timeout as both
/// `statement_timeout` and `idle_in_transaction_session_timeout`; no parallel query; and generic plans.
///
/// A batch reads a few thousand rows through an index. With parallel workers allowed, the planner started
/// workers (and a parallel scan plus sort) for every batch query, several times slower than the index walk.
/// With custom plans (PostgreSQL's default for a statement's first five executions), the literal month made the
/// planner read the month's whole range from the index ordered by return date, or the whole table, and sort it
/// for each batch, 80–150 ms each; the generic plan walks the id-ordered index, as a keyset batch should
/// (measured with auto_explain; see bench/RESULTS.md).
fn job_options(db: &DatabaseSettings, application_name: &str, batch_timeout: Duration) -> PgConnectOptions {
    let timeout = batch_timeout.as_millis().to_string();
    connect_options(db, application_name).options([
        ("statement_timeout", timeout.as_str()),
        ("idle_in_transaction_session_timeout", timeout.as_str()),
        ("max_parallel_workers_per_gather", "0"),
        ("plan_cache_mode", "force_generic_plan"),
    ])
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
pub async fn database_now(pool: &PgPool) -> Result<chrono::DateTime<chrono::Utc>, sqlx::Error> {
    sqlx::query_scalar!(r#"select now() as "now!""#)
        .fetch_one(pool)
        .await
}

/// Whether the statement failed waiting for a row lock: not granted within `lock_timeout` (55P03), or the wait
/// closed a cycle with another transaction and PostgreSQL cancelled this side (deadlock, 40P01).
pub fn lock_not_available(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("55P03" | "40P01")))
}

/// A pool for the jobs. Every statement runs under `statement_timeout = batch_timeout`, so a batch that hangs
/// on a lock fails before the lease it renews runs out; and `idle_in_transaction_session_timeout =
/// batch_timeout`, so the server aborts the open transaction of a replica that froze mid-batch (SIGSTOP, a VM
/// pause) and its row locks do not block the peer that takes over.
pub async fn connect(
    db: &DatabaseSettings,
    application_name: &str,
    batch_timeout: Duration,
) -> Result<PgPool, StoreError> {
    let pool = pool_options(db)
        .connect_with(job_options(db, application_name, batch_timeout))
        .await?;
    Ok(pool)
}

fn pool_options(db: &DatabaseSettings) -> PgPoolOptions {
    PgPoolOptions::new()
        .max_connections(db.max_connections)
        .acquire_timeout(db.connect_timeout)
}

/// Like [`connect`], but opens no connection until one is needed: the daemon starts (and keeps running) while
/// the database is down.
pub fn connect_lazy(db: &DatabaseSettings, application_name: &str, batch_timeout: Duration) -> PgPool {
    pool_options(db).connect_lazy_with(job_options(db, application_name, batch_timeout))
}

/// The status page's own pool: one connection at most, opened when a page is first loaded and closed after a
/// minute without one, every statement under `statement_timeout = timeout`, and a wait for the connection of at
/// most `timeout` too. It is separate from the jobs' pool so that page loads never take a connection a batch or
/// a claim is waiting for: however many arrive, they queue for this one connection (and give up after
/// `timeout`), and the replica holds at most one connection more than `database.max_connections` and the
/// tick's.
pub fn connect_status(db: &DatabaseSettings, application_name: &str, timeout: Duration) -> PgPool {
    let millis = timeout.as_millis().to_string();
    PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(timeout)
        .idle_timeout(Duration::from_secs(60))
        .connect_lazy_with(connect_options(db, application_name).options([
            ("statement_timeout", millis.as_str()),
            ("max_parallel_workers_per_gather", "0"),
        ]))
}

/// One dedicated connection, re-opened after any error. The daemon reads its tick status through it, so an idle
/// tick is a single round trip (a pooled connection adds a health-check ping at every checkout and release).
pub struct Session {
    /// Holds the password: never printed (see the `Debug` below).
    options: PgConnectOptions,
    connect_timeout: Duration,
    conn: Option<PgConnection>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("host", &self.options.get_host())
            .field("database", &self.options.get_database())
            .field("connected", &self.conn.is_some())
            .finish_non_exhaustive()
    }
}

impl Session {
    pub fn new(db: &DatabaseSettings, application_name: &str, batch_timeout: Duration) -> Self {
        Session {
            options: job_options(db, application_name, batch_timeout),
            connect_timeout: db.connect_timeout,
            conn: None,
        }
    }

    /// The database clock, this shard's recent `job_runs` rows and due pending charges (see
    /// [`job_runs::tick_status`]).
    pub async fn tick_status(
        &mut self,
        shard: crate::shard::ShardSpec,
        since: chrono::NaiveDate,
        late: job_runs::LateProbe,
    ) -> Result<job_runs::TickStatus, sqlx::Error> {
        if self.conn.is_none() {
            let connect = PgConnection::connect_with(&self.options);
            let conn = tokio::time::timeout(self.connect_timeout, connect)
                .await
                .map_err(|_| sqlx::Error::PoolTimedOut)??;
            self.conn = Some(conn);
        }
        let Some(conn) = self.conn.as_mut() else {
            return Err(sqlx::Error::PoolClosed);
        };
        let result = job_runs::tick_status(conn, shard, since, late).await;
        if result.is_err() {
            // Whatever went wrong, the next tick starts from a fresh connection.
            self.conn = None;
        }
        result
    }
}

/// Whether the replica can work: the database answers within 2 s and every migration this binary knows is
/// applied. `Err` carries the reason, for `/readyz` and the startup log.
pub async fn readiness(pool: &PgPool) -> Result<(), String> {
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    // `_sqlx_migrations` is sqlx's own table, not part of the checked schema: an unchecked query.
    let applied = tokio::time::timeout(
        Duration::from_secs(2),
        sqlx::query_scalar::<_, Option<i64>>("select max(version) from _sqlx_migrations where success")
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
        Ok(Ok(v)) if v.unwrap_or(0) < latest => Err(format!(
            "migrations missing: database at {}, binary needs {latest}; run `fine-settler migrate`",
            v.unwrap_or(0)
        )),
        Ok(Ok(_)) => Ok(()),
    }
}

/// Applies the migrations; applying them twice is a no-op. Uses one connection without a statement timeout,
/// because building an index concurrently on millions of loans takes longer than any batch. With `bars`, a
/// second connection watches the index builds and draws their progress.
pub async fn migrate(db: &DatabaseSettings, bars: bool) -> Result<(), StoreError> {
    let options = connect_options(db, "fine-settler migrate");
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(db.connect_timeout)
        .connect_with(options)
        .await?;
    drop_invalid_indexes(&pool).await?;
    let watcher = if bars {
        // The pool's one connection runs the migrations: its backend is the one to watch.
        let pid = sqlx::query_scalar!(r#"select pg_backend_pid() as "pid!""#)
            .fetch_one(&pool)
            .await?;
        let watcher =
            PgConnection::connect_with(&connect_options(db, "fine-settler migrate progress")).await?;
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
