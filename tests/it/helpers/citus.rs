//! The Citus cluster of `scripts/citus.sh` in tests: a database of its own on it ([`CitusDb`]), and the core
//! suites run on it as well as on PostgreSQL ([`crate::each_engine`]).
//!
//! A test database on the cluster is named `citus_…`: the helpers that hand a test's database to the product
//! ([`crate::helpers::db`], [`crate::helpers::database_url`], [`crate::helpers::fine_settler`]) see from the name
//! that it is a Citus one, and give the product `database.engine = "citus"` and the coordinator's address.

use std::{future::Future, sync::atomic::AtomicU32, time::Duration};

use fine_settler::{
    config::{DatabaseSettings, DatabaseUrl, Engine, Pooler},
    store::{connect::connect_lazy, Db},
};
use futures_util::FutureExt;
use sqlx::{postgres::PgPoolOptions, PgPool};

/// The prefix of every test database on the Citus cluster.
const PREFIX: &str = "citus_";

/// The coordinator's URL (`scripts/test.sh --citus` sets it).
fn coordinator() -> String {
    std::env::var("FINE_SETTLER_CITUS_URL")
        .expect("FINE_SETTLER_CITUS_URL (run the Citus tests with scripts/test.sh --citus)")
}

/// `scripts/citus.sh what` (`crash-worker`, `crash-coordinator`) on the cluster of the test database at `url`
/// (its port taken from the URL, never another cluster's); panics unless it succeeds.
pub fn citus_sh(url: &str, what: &str) {
    let port = url
        .rsplit_once(':')
        .and_then(|(_, rest)| rest.split('/').next())
        .expect("a port in the URL");
    let status =
        std::process::Command::new(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/citus.sh"))
            .arg(what)
            .env("FINE_SETTLER_CITUS_PORT", port)
            .status()
            .expect("scripts/citus.sh");
    assert!(status.success(), "scripts/citus.sh {what}");
}

/// Whether `database` is a test database on the Citus cluster.
pub fn is_citus(database: &str) -> bool {
    database.starts_with(PREFIX)
}

/// Whether `pool` is on a test database of the Citus cluster.
pub fn is_test_db(pool: &PgPool) -> bool {
    pool.connect_options().get_database().is_some_and(is_citus)
}

/// The URLs of the Citus test database of `pool` on each worker (`scripts/citus.sh` puts them on the two
/// ports after the coordinator's).
pub fn worker_urls(pool: &PgPool) -> Vec<String> {
    let name = pool
        .connect_options()
        .get_database()
        .expect("a database")
        .to_string();
    let coordinator = coordinator();
    let (base, _) = coordinator.rsplit_once('/').expect("a database path");
    let (host, port) = base.rsplit_once(':').expect("a port");
    let port: u16 = port.parse().expect("a port");
    [port + 1, port + 2]
        .iter()
        .map(|w| format!("{host}:{w}/{name}?sslmode=disable"))
        .collect()
}

/// The URL of the test database `name` on the coordinator.
pub fn url_of(name: &str) -> String {
    let coordinator = coordinator();
    let (base, _) = coordinator.rsplit_once('/').expect("a database path");
    format!("{base}/{name}?sslmode=disable")
}

/// The product's pool on the Citus test database `name`, as a replica opens it (`database.engine = "citus"`:
/// the jobs' session settings for Citus), connecting when first used.
pub fn jobs_db(name: &str) -> Db {
    jobs_db_of(name, 4)
}

/// [`jobs_db`] with a pool of `max_connections`.
pub fn jobs_db_of(name: &str, max_connections: u32) -> Db {
    let settings = DatabaseSettings {
        url: DatabaseUrl::parse(&url_of(name)).expect("a valid URL"),
        max_connections,
        connect_timeout: Duration::from_secs(10),
        pooler: Pooler::None,
        engine: Engine::Citus,
    };
    connect_lazy(&settings, "fine-settler-test", Duration::from_secs(60))
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A database of its own on the Citus cluster, with the extension on every node and the workers added.
pub struct CitusDb {
    pub admin: PgPool,
    pub name: String,
    pub url: String,
    pub pool: PgPool,
    /// The workers' URLs for this database.
    pub workers: Vec<String>,
}

impl CitusDb {
    /// A new database on the cluster; `tag` says whose (its name is `citus_<tag>_<n>_<pid>`, within
    /// PostgreSQL's 63 bytes).
    pub async fn new(tag: &str) -> CitusDb {
        let coordinator = std::env::var("FINE_SETTLER_CITUS_URL")
            .expect("FINE_SETTLER_CITUS_URL (run the Citus tests with scripts/test.sh --citus)");
        let (base, _) = coordinator.rsplit_once('/').expect("a database path");
        let port: u16 = base
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .expect("a port");
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag: String = tag.chars().take(32).collect();
        let name = format!("{PREFIX}{tag}_{n}_{}", std::process::id());
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&format!("{base}/postgres?sslmode=disable"))
            .await
            .expect("connect to the coordinator");
        sqlx::query(&format!("drop database if exists {name} with (force)"))
            .execute(&admin)
            .await
            .expect("a statement on the cluster");
        sqlx::query(&format!("create database {name}"))
            .execute(&admin)
            .await
            .expect("a statement on the cluster");
        // A test's own triggers on the distributed tables (slow writes, rejected charges, audits) are created
        // and dropped in its sessions; Citus checks this setting when a trigger is created or dropped.
        sqlx::query(&format!(
            "alter database {name} set citus.enable_unsafe_triggers = on"
        ))
        .execute(&admin)
        .await
        .expect("a statement on the cluster");
        let url = format!("{base}/{name}?sslmode=disable");
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .expect("a statement on the cluster");
        let workers = [port + 1, port + 2];
        sqlx::raw_sql("create extension citus")
            .execute(&pool)
            .await
            .expect("a statement on the cluster");
        sqlx::query(
            "select master_run_on_worker(array['127.0.0.1', '127.0.0.1'], array[$1, $2],
                    array['create extension if not exists citus', 'create extension if not exists citus'], true)",
        )
        .bind(i32::from(workers[0]))
        .bind(i32::from(workers[1]))
        .execute(&pool)
        .await
        .expect("a statement on the cluster");
        sqlx::query("select citus_set_coordinator_host('127.0.0.1', $1)")
            .bind(i32::from(port))
            .execute(&pool)
            .await
            .expect("a statement on the cluster");
        for w in workers {
            sqlx::query("select citus_add_node('127.0.0.1', $1)")
                .bind(i32::from(w))
                .execute(&pool)
                .await
                .expect("a statement on the cluster");
        }
        let host = base.rsplit_once(':').expect("a port").0;
        CitusDb {
            admin,
            workers: workers
                .iter()
                .map(|w| format!("{host}:{w}/{name}?sslmode=disable"))
                .collect(),
            name,
            url,
            pool,
        }
    }

    /// Drops the database (on every node).
    pub async fn drop(self) {
        self.pool.close().await;
        sqlx::query(&format!("drop database if exists {} with (force)", self.name))
            .execute(&self.admin)
            .await
            .expect("a statement on the cluster");
    }

    /// fine-settler's schema as `migrate` builds it on Citus, and the `fixtures` (files of tests/it/fixtures,
    /// without `.sql`) applied, as `#[sqlx::test]` gives a database on PostgreSQL (`default_policy` is the policy
    /// `migrate` seeds: checked, not written again).
    pub async fn migrate(&self, fixtures: &[&str]) {
        let mut cmd = crate::helpers::fine_settler(&self.url);
        cmd.arg("migrate");
        crate::helpers::assert_success(&crate::helpers::output(cmd));
        for fixture in fixtures {
            if *fixture == "default_policy" {
                // What `migrate` seeds from the built-in `[fine]` (the fixture writes it where the schema comes
                // from sqlx's migrator, which seeds nothing).
                let seeded: (i64, i32, i64, bool) = sqlx::query_as(
                    "select daily_rate_cents, grace_days, cap_cents, charge_closed_days from fine_policies",
                )
                .fetch_one(&self.pool)
                .await
                .expect("the one policy migrate seeds");
                assert_eq!(seeded, (100, 0, 0, false), "the seeded policy is the fixture's");
                continue;
            }
            let path = format!("{}/tests/it/fixtures/{fixture}.sql", env!("CARGO_MANIFEST_DIR"));
            let sql = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            sqlx::raw_sql(&sql)
                .execute(&self.pool)
                .await
                .unwrap_or_else(|e| panic!("fixture {fixture}: {e}"));
        }
    }
}

/// Runs a test's body on a database of its own on the Citus cluster ([`CitusDb::migrate`]d), then drops the
/// database, whether the body passed or not (a failed test's database would be left on every node).
pub async fn on_citus<F, Fut>(tag: &str, fixtures: &[&str], body: F)
where
    F: FnOnce(PgPool) -> Fut,
    Fut: Future<Output = ()>,
{
    let db = CitusDb::new(tag).await;
    let outcome = std::panic::AssertUnwindSafe(async {
        db.migrate(fixtures).await;
        body(db.pool.clone()).await;
    })
    .catch_unwind()
    .await;
    db.drop().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// Tests that run on each engine: each `#[sqlx::test]` given stays as it is, on PostgreSQL, and gets a twin,
/// `<its name>::citus::on_citus`, that runs the same body on a database of its own on the Citus cluster
/// ([`on_citus`]; ignored unless asked for, as `scripts/test.sh --citus` does). The body reaches the product
/// through the helpers ([`crate::helpers::db`], [`crate::helpers::database_url`], the binary's commands), which
/// give it the Citus engine there.
#[macro_export]
macro_rules! each_engine {
    ($(
        $(#[doc = $doc:expr])*
        #[sqlx::test $( (fixtures($($fixture:literal),*)) )?]
        $(#[$meta:meta])*
        async fn $name:ident($pool:ident: PgPool) $body:block
    )*) => {$(
        $(#[doc = $doc])*
        #[sqlx::test $( (fixtures($($fixture),*)) )?]
        $(#[$meta])*
        async fn $name($pool: PgPool) $body

        mod $name {
            pub mod citus {
                #[allow(unused_imports)]
                use super::super::*;

                #[tokio::test]
                #[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
                async fn on_citus() {
                    $crate::helpers::citus::on_citus(
                        stringify!($name),
                        &[$($($fixture),*)?],
                        |$pool: PgPool| async move $body,
                    )
                    .await;
                }
            }
        }
    )*};
}

/// The port of the coordinator of `scripts/citus.sh`'s cluster (its workers listen on the next two).
pub fn coordinator_port() -> u16 {
    let coordinator = coordinator();
    let (base, _) = coordinator.rsplit_once('/').expect("a database path");
    base.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .expect("a port")
}

/// The folder of the cluster's PostgreSQL programs (`scripts/pg-fetch.sh 18`, which `scripts/citus.sh` runs its
/// nodes with): a standby of a node must run the same major version, with Citus installed.
pub fn pg_bin() -> std::path::PathBuf {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg-fetch.sh");
    let out = std::process::Command::new(&script)
        .arg("18")
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !stdout.trim().is_empty(),
        "{} 18: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    std::path::PathBuf::from(stdout.trim())
}
