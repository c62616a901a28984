//! `migrate` from many hosts at once: several processes against the same libraryd database (fresh, and already
//! migrated) all succeed and leave every migration recorded and every index in place and valid; an index another
//! session is building is waited for, never dropped; readiness names every migration and index that falls short,
//! and `migrate` mends them.

use std::{
    collections::hash_map::DefaultHasher,
    hash::{Hash, Hasher},
    process::{Child, Output, Stdio},
    time::Duration,
};

use fine_settler::store::readiness;
use sqlx::{postgres::PgPoolOptions, Connection, PgConnection, PgPool};

use crate::helpers::{
    assert_success, database_url, db, exit_of, fine_settler, insert, loan, output, report, spawn, wait_until,
    StderrLog,
};

/// How many `migrate` processes run at once (the migrate unit of every host at boot).
const MIGRATORS: usize = 4;
/// Rounds against a fresh copy of the libraryd database; one more runs against the last, already migrated.
const FRESH_ROUNDS: usize = 3;
/// Loans in libraryd's table: enough that each concurrent index build takes a while.
const LOANS: i64 = 200_000;

/// The databases of one test on the server of its pool: created from scratch or as copies of a template, dropped
/// at the end.
struct Server {
    /// The server's URL up to the database name.
    base: String,
    /// A prefix unique to the test, short and lowercase (from its own database's name, which is neither).
    prefix: String,
    admin: PgPool,
    created: Vec<String>,
}

impl Server {
    fn of(pool: &PgPool) -> Server {
        let url = database_url(pool);
        let (base, name) = url.rsplit_once('/').expect("a database in the URL");
        let mut hasher = DefaultHasher::new();
        name.hash(&mut hasher);
        Server {
            base: base.to_string(),
            prefix: format!("migrate_{:016x}", hasher.finish()),
            admin: pool.clone(),
            created: Vec::new(),
        }
    }

    /// A new database `suffix` (copied from `template`, if given); its URL.
    async fn create(&mut self, suffix: &str, template: Option<&str>) -> String {
        let name = format!("{}_{suffix}", self.prefix);
        sqlx::raw_sql(&format!("drop database if exists {name} with (force)"))
            .execute(&self.admin)
            .await
            .expect("drop a leftover");
        let from = template.map(|t| format!(" template {}_{t}", self.prefix));
        sqlx::raw_sql(&format!("create database {name}{}", from.unwrap_or_default()))
            .execute(&self.admin)
            .await
            .expect("create database");
        self.created.push(name.clone());
        format!("{}/{name}", self.base)
    }

    async fn drop_all(self) {
        for name in self.created.iter().rev() {
            sqlx::raw_sql(&format!("drop database if exists {name} with (force)"))
                .execute(&self.admin)
                .await
                .expect("drop database");
        }
    }
}

/// libraryd's table as it was before fine-settler (no fine columns) with `n` loans: returned on time, returned
/// late, still out.
async fn libraryd_loans(url: &str, n: i64) {
    let mut conn = PgConnection::connect(url).await.expect("connect");
    sqlx::raw_sql(&format!(
        "create table loans (id bigint primary key, member_id bigint not null, book_id bigint not null,
                             borrowed_on date not null, due_on date not null, returned_on date);
         insert into loans
         select g, g % 997, g % 7919, date '2026-08-01' + (g % 60), date '2026-09-01' + (g % 60),
                case g % 3 when 0 then null when 1 then date '2026-08-20' + (g % 60)
                           else date '2026-09-10' + (g % 60) end
         from generate_series(1, {n}) g;
         analyze loans;"
    ))
    .execute(&mut conn)
    .await
    .expect("libraryd's loans");
    conn.close().await.expect("close");
}

/// The schema as the checks compare it: every index of the schema with whether it is valid, and every recorded
/// migration with whether it succeeded.
#[derive(Debug, PartialEq, Eq)]
struct Schema {
    indexes: Vec<(String, bool)>,
    migrations: Vec<(i64, bool)>,
}

async fn schema(url: &str) -> Schema {
    let mut conn = PgConnection::connect(url).await.expect("connect");
    let indexes = sqlx::query_as(
        "select c.relname::text, i.indisvalid from pg_index i join pg_class c on c.oid = i.indexrelid
         where c.relnamespace = current_schema()::regnamespace order by 1",
    )
    .fetch_all(&mut conn)
    .await
    .expect("indexes");
    let migrations = sqlx::query_as("select version, success from _sqlx_migrations order by version")
        .fetch_all(&mut conn)
        .await
        .expect("migrations");
    conn.close().await.expect("close");
    Schema { indexes, migrations }
}

/// `MIGRATORS` `migrate` processes started together against `url`, each one's output once it exits.
async fn migrate_at_once(url: &str) -> Vec<Output> {
    let children: Vec<Child> = (0..MIGRATORS)
        .map(|_| {
            let mut cmd = fine_settler(url);
            cmd.arg("migrate").stdout(Stdio::piped()).stderr(Stdio::piped());
            cmd.spawn().expect("start migrate")
        })
        .collect();
    tokio::task::spawn_blocking(move || {
        children
            .into_iter()
            .map(|c| c.wait_with_output().expect("wait for migrate"))
            .collect()
    })
    .await
    .expect("join")
}

fn assert_all_succeeded(what: &str, outputs: &[Output]) {
    for (i, out) in outputs.iter().enumerate() {
        assert_eq!(
            out.status.code(),
            Some(0),
            "{what}: migrate #{i} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[sqlx::test(migrations = false)]
async fn concurrent_migrates_all_succeed_and_leave_the_schema_complete(pool: PgPool) {
    let mut server = Server::of(&pool);
    // What one `migrate` alone leaves: the schema every round must end with.
    let reference = server.create("reference", None).await;
    let mut conn = PgConnection::connect(&reference).await.expect("connect");
    fine_settler::store::MIGRATOR
        .run(&mut conn)
        .await
        .expect("migrate the reference");
    conn.close().await.expect("close");
    let complete = schema(&reference).await;
    assert!(complete.indexes.iter().all(|(_, valid)| *valid), "{complete:?}");
    assert!(complete.migrations.iter().all(|(_, ok)| *ok), "{complete:?}");

    let libraryd = server.create("libraryd", None).await;
    libraryd_loans(&libraryd, LOANS).await;
    let mut last = String::new();
    for round in 0..FRESH_ROUNDS {
        let url = server.create(&format!("round{round}"), Some("libraryd")).await;
        let outputs = migrate_at_once(&url).await;
        assert_all_succeeded(&format!("round {round}"), &outputs);
        assert_eq!(schema(&url).await, complete, "round {round}");
        last = url;
    }
    let outputs = migrate_at_once(&last).await;
    assert_all_succeeded("already migrated", &outputs);
    assert_eq!(schema(&last).await, complete, "already migrated");
    server.drop_all().await;
}

/// Readiness names a migration forgotten in the middle (not only the latest counts) and an index that is gone;
/// `migrate` applies the one and rebuilds the other.
#[sqlx::test]
async fn readiness_names_a_forgotten_migration_and_a_dropped_index_and_migrate_mends_both(pool: PgPool) {
    assert_eq!(readiness(&db(&pool)).await, Ok(()));
    sqlx::raw_sql(
        "delete from _sqlx_migrations where version = 20261101000005;
         drop index loans_unsettled_returned_idx;",
    )
    .execute(&pool)
    .await
    .expect("forget a migration, drop an index");
    let reason = readiness(&db(&pool)).await.expect_err("not ready");
    assert_eq!(
        reason,
        "migrations missing: 20261101000005 (loans unsettled by return index); \
         indexes not valid: loans_unsettled_returned_idx missing; run `fine-settler migrate`"
    );

    let mut cmd = fine_settler(&database_url(&pool));
    cmd.arg("migrate");
    let out = output(cmd);
    assert_success(&out);
    assert_eq!(
        report(&out)["rebuilt"],
        serde_json::json!(["loans_unsettled_returned_idx"]),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(readiness(&db(&pool)).await, Ok(()));
}

/// An index another session is building is INVALID until the build ends: `migrate` waits for that build instead
/// of taking the index for the leftover of an interrupted one, and the index that build made stays.
#[sqlx::test]
async fn migrate_waits_for_an_index_build_in_progress_and_never_drops_it(pool: PgPool) {
    let loans: Vec<_> = (1..=1000)
        .map(|id| loan(id, "2026-10-01", Some("2026-10-20")))
        .collect();
    insert(&pool, &loans).await;
    sqlx::raw_sql("drop index loans_unsettled_returned_idx")
        .execute(&pool)
        .await
        .expect("drop the index");
    // A writer in an open transaction: the build below creates its INVALID index, then waits for the writer.
    let mut writer = pool.begin().await.expect("begin");
    sqlx::query("insert into loans values (999999, 1, 1, '2026-09-01', '2026-10-01', '2026-10-20', 0, null)")
        .execute(&mut *writer)
        .await
        .expect("insert");
    let url = database_url(&pool);
    // The other session (a pool of its one connection: sqlx's executor on a bare connection cannot move into a
    // task).
    let builder = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("connect");
    let build = tokio::spawn(async move {
        sqlx::raw_sql(
            "create index concurrently if not exists loans_unsettled_returned_idx
                 on loans (id, returned_on) include (due_on)
                 where fine_settled_at is null and returned_on is not null",
        )
        .execute(&builder)
        .await
    });
    let being_built = || async {
        sqlx::query_scalar::<_, i64>(
            "select p.index_relid::bigint from pg_stat_progress_create_index p
             where p.index_relid = to_regclass('loans_unsettled_returned_idx')",
        )
        .fetch_optional(&pool)
        .await
        .expect("progress")
    };
    wait_until("the build's index", Duration::from_secs(20), || async {
        being_built().await.is_some()
    })
    .await;
    let built = being_built().await.expect("the index being built");
    let reason = readiness(&db(&pool))
        .await
        .expect_err("not ready during the build");
    assert!(
        reason.contains("loans_unsettled_returned_idx being built"),
        "{reason}"
    );

    let mut cmd = fine_settler(&url);
    cmd.arg("migrate").stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut migrate = spawn(&mut cmd);
    let log = StderrLog::collect(&mut migrate);
    wait_until("migrate at the index", Duration::from_secs(20), || async {
        log.contains("another session is building an index") || migrate_waits_on_a_lock(&pool).await
    })
    .await;
    writer.rollback().await.expect("rollback");
    build.await.expect("join").expect("the build succeeds");
    let (code, _) = exit_of(migrate, Duration::from_secs(30)).await;
    let log = log.finish();
    assert_eq!(code, Some(0), "{log}");
    let (now, valid): (i64, bool) = sqlx::query_as(
        "select i.indexrelid::bigint, i.indisvalid from pg_index i
         where i.indexrelid = to_regclass('loans_unsettled_returned_idx')",
    )
    .fetch_one(&pool)
    .await
    .expect("the index is there");
    assert_eq!(now, built, "the index the other session built was dropped: {log}");
    assert!(valid);
    assert_eq!(readiness(&db(&pool)).await, Ok(()));
}

/// Whether a statement of `migrate` waits for a lock (a `drop index` waiting for the build's lock on the table).
async fn migrate_waits_on_a_lock(pool: &PgPool) -> bool {
    sqlx::query_scalar(
        "select exists (select 1 from pg_stat_activity
                        where application_name = 'fine-settler migrate' and wait_event_type = 'Lock')",
    )
    .fetch_one(pool)
    .await
    .expect("pg_stat_activity")
}

/// Every migration, cut into its statements (as `migrate` sends them to a Citus coordinator) and run one
/// statement at a time, in its order, builds the schema on a fresh database: no statement is cut inside a
/// string, a body or a comment (a wrong cut is a syntax error here).
#[sqlx::test(migrations = false)]
async fn every_migration_runs_statement_by_statement(pool: PgPool) {
    use fine_settler::store::{migrations::statements::split, MIGRATOR};
    let mut conn = pool.acquire().await.expect("a connection");
    let mut statements = 0;
    for migration in MIGRATOR.iter() {
        for statement in split(&migration.sql) {
            sqlx::raw_sql(&statement)
                .execute(&mut *conn)
                .await
                .unwrap_or_else(|e| panic!("migration {}: {e}\n{statement}", migration.version));
            statements += 1;
        }
    }
    assert!(statements > MIGRATOR.iter().count(), "{statements} statements");
    let functions: i64 =
        sqlx::query_scalar("select count(*) from pg_proc where proname = 'fine_settler_policy_day_amount'")
            .fetch_one(&mut *conn)
            .await
            .expect("count");
    assert_eq!(functions, 1);
}

/// An index a migration retired, built again by an older release's `migrate` (which owns it still: it finds it
/// missing, forgets the migration that built it and runs that again), is dropped again by the next `migrate` —
/// the drop, already recorded, would never run again — and reported.
#[sqlx::test]
async fn an_index_a_migration_retired_and_an_older_release_built_again_is_dropped_again(pool: PgPool) {
    let exists = |name: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, bool>("select to_regclass($1) is not null")
                .bind(name)
                .fetch_one(&pool)
                .await
                .expect("the catalogue")
        }
    };
    assert!(!exists("loans_open_by_due_idx").await, "dropped by its migration");
    // What an older release's `migrate` does: it forgets the migrations that built its two missing indexes.
    sqlx::raw_sql("delete from _sqlx_migrations where version in (20261201000006, 20261201000009)")
        .execute(&pool)
        .await
        .expect("forget the migrations");
    let mut cmd = fine_settler(&database_url(&pool));
    cmd.arg("migrate");
    let out = output(cmd);
    assert_success(&out);
    assert_eq!(
        report(&out)["dropped"],
        serde_json::json!(["loans_open_by_due_idx", "loans_returned_late_idx"]),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!exists("loans_open_by_due_idx").await);
    assert!(!exists("loans_returned_late_idx").await);
    assert_eq!(readiness(&db(&pool)).await, Ok(()));
    // Nothing left to drop.
    let mut cmd = fine_settler(&database_url(&pool));
    cmd.arg("migrate");
    let out = output(cmd);
    assert_success(&out);
    assert_eq!(report(&out)["dropped"], serde_json::json!([]));
}
