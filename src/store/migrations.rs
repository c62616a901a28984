//! The schema: the embedded migrations ([`MIGRATOR`]) and [`migrate`], which applies them; the indexes a
//! migration builds `CONCURRENTLY`, the leftovers of an interrupted build, and where a running build stands
//! ([`index_build`], reported to an [`IndexBuildObserver`] while the migrations run).

use std::time::Duration;

use sqlx::{postgres::PgPoolOptions, Connection, PgConnection, PgPool};

use super::{route::Route, session::Gucs, StoreError};
use crate::config::DatabaseSettings;

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

/// Told, a few times a second while the migrations run, which index build their backend is running (`None`
/// while it runs none). The command line draws it as progress bars; the store knows nothing of them.
pub type IndexBuildObserver = Box<dyn FnMut(Option<&IndexBuild>) + Send>;

/// How often a running migration's index build is looked at.
const INDEX_BUILD_POLL: Duration = Duration::from_millis(200);

/// Applies the migrations; applying them twice is a no-op. Uses one connection without a statement timeout,
/// because building an index concurrently on millions of loans takes longer than any batch. With an `observer`,
/// a second connection watches the index builds and tells it where they stand.
pub async fn migrate(db: &DatabaseSettings, observer: Option<IndexBuildObserver>) -> Result<(), StoreError> {
    // The first qualifying host of the URL (with one host, that host), without a statement timeout.
    let route = Route::new(db, "fine-settler migrate", &Gucs::none());
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
    let watcher = match observer {
        Some(observer) => {
            // The pool's one connection runs the migrations: its backend is the one to watch.
            let pid = sqlx::query_scalar!(r#"select pg_backend_pid() as "pid!""#)
                .fetch_one(&pool)
                .await?;
            let conn = PgConnection::connect_with(
                &options.clone().application_name("fine-settler migrate progress"),
            )
            .await?;
            Some(tokio::spawn(watch_index_builds(conn, pid, observer)))
        }
        None => None,
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
