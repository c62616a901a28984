//! The schema: the embedded migrations ([`MIGRATOR`]) and [`migrate`], which applies them, safe from any
//! number of hosts at once; the indexes fine-settler owns, read from the migrations ([`owned`]); how far a
//! database is from the schema ([`schema`], which readiness asks too); and where a running index build stands
//! ([`index_build`], reported to an [`IndexBuildObserver`] while the migrations run).
//!
//! `migrate` does everything on one connection, under one lock ([`lock`]): it waits for any index build
//! another session is running, clears what an interrupted build left ([`repair`]), runs sqlx's migrator, and
//! checks the result. Two `migrate`s never look at the schema at the same time, so neither takes the other's
//! build in progress (INVALID until it ends) for a leftover.

mod citus;
mod lock;
pub mod owned;
mod repair;
pub mod schema;
pub mod statements;

use std::time::Duration;

use sqlx::{postgres::PgPoolOptions, Connection, PgConnection};

pub use citus::CitusError;
pub use owned::{owned_indexes, retired_indexes, OwnedIndex, RetiredIndex};
pub use schema::Gaps;

use super::{route::Route, session::Gucs, StoreError};
use crate::config::{DatabaseSettings, Engine};

/// The migrations in `migrations/`, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Told, a few times a second while the migrations run, which index build their backend is running (`None`
/// while it runs none). The command line draws it as progress bars; the store knows nothing of them.
pub type IndexBuildObserver = Box<dyn FnMut(Option<&IndexBuild>) + Send>;

/// How often a running migration's index build is looked at.
const INDEX_BUILD_POLL: Duration = Duration::from_millis(200);

/// What [`migrate`] did, and what it found still missing at its end.
#[derive(Debug)]
pub struct Migrated {
    /// Owned indexes that were INVALID or gone, rebuilt by running their migration again.
    pub rebuilt: Vec<&'static OwnedIndex>,
    /// Indexes a migration retired, found built again (by an older release's `migrate`) and dropped again.
    pub dropped: Vec<&'static RetiredIndex>,
    /// How the schema still falls short once the migrations have run (empty: complete).
    pub gaps: Gaps,
}

/// Applies the migrations; applying them twice is a no-op, and any number of `migrate`s may run at once (they
/// take turns). Uses one connection without a statement timeout, because building an index concurrently on
/// millions of loans takes longer than any batch. With an `observer`, a second connection watches the index
/// builds and tells it where they stand.
pub async fn migrate(
    db: &DatabaseSettings,
    observer: Option<IndexBuildObserver>,
) -> Result<Migrated, StoreError> {
    // The first qualifying host of the URL (with one host, that host), without a statement timeout.
    let route = Route::new(db, "fine-settler migrate", &Gucs::none());
    let chosen = match route.len() {
        1 => {
            route.learn_tls(0).await;
            0
        }
        _ => route.choose().await?,
    };
    let options = route.options(chosen);
    // A pool of one: it keeps trying to connect until the connect timeout (a server still starting at boot).
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(db.connect_timeout)
        .connect_with(options.clone())
        .await?;
    let mut conn = pool.acquire().await?;
    lock::acquire(&mut conn).await?;
    let watcher = match observer {
        Some(observer) => {
            // This connection runs the migrations: its backend is the one to watch.
            let pid = sqlx::query_scalar!(r#"select pg_backend_pid() as "pid!""#)
                .fetch_one(&mut *conn)
                .await?;
            let progress = PgConnection::connect_with(
                &options.clone().application_name("fine-settler migrate progress"),
            )
            .await?;
            Some(tokio::spawn(watch_index_builds(progress, pid, observer)))
        }
        None => None,
    };
    let result = migrate_locked(&mut conn, db.engine).await;
    if let Some(watcher) = watcher {
        watcher.abort();
        let _ = watcher.await;
    }
    let migrated = result?;
    lock::release(&mut conn).await?;
    drop(conn);
    pool.close().await;
    Ok(migrated)
}

/// What `migrate` does once it holds the lock.
async fn migrate_locked(conn: &mut PgConnection, engine: Engine) -> Result<Migrated, StoreError> {
    // Before anything is written: `database.engine` must say what the server is.
    match (engine, citus::has_extension(conn).await?) {
        (Engine::Postgresql, true) => return Err(CitusError::Undeclared.into()),
        (Engine::Citus, false) => return Err(CitusError::NoExtension.into()),
        _ => {}
    }
    let rebuilt = repair::prepare_rebuilds(conn).await?;
    match engine {
        Engine::Postgresql => MIGRATOR.run(&mut *conn).await?,
        Engine::Citus => citus::migrate(conn).await?,
    }
    let dropped = repair::drop_retired(conn).await?;
    let recorded = schema::recorded(&mut *conn).await?;
    let indexes = schema::index_states(&mut *conn).await?;
    Ok(Migrated {
        rebuilt,
        dropped,
        gaps: Gaps::of(recorded.as_deref(), &indexes),
    })
}

/// Tells `observer` where the index builds of backend `pid` stand, polling on `conn` until aborted (or until the
/// connection fails: the progress shown is not worth failing the migration for).
async fn watch_index_builds(mut conn: PgConnection, pid: i32, mut observer: IndexBuildObserver) {
    let mut tick = tokio::time::interval(INDEX_BUILD_POLL);
    loop {
        tick.tick().await;
        let Ok(build) = index_build(&mut conn, pid).await else {
            return;
        };
        observer(build.as_ref());
    }
}

/// Where an index build of backend `pid` stands (`pg_stat_progress_create_index`), if one is running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexBuild {
    /// The index being built (empty until the build has created it).
    pub index: String,
    /// The build's phase, as PostgreSQL names it (e.g. "waiting for writers before build").
    pub phase: String,
    /// Table blocks scanned so far, of `blocks_total` (0 outside the scan).
    pub blocks_done: i64,
    pub blocks_total: i64,
    /// Tuples sorted, loaded or validated so far, of `tuples_total`.
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
