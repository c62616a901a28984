//! Shared test fixtures: loans, an update audit trigger, the independent SQL oracle, waiting for a condition, the
//! real binary (in [`process`]), a real PgBouncer in front of the test server (in [`pgbouncer`]), a primary
//! with streaming standbys as real PostgreSQL servers (in [`cluster`]), and which PostgreSQL programs every
//! server a test starts runs (in [`postgres`]).

pub mod citus;
mod cluster;
mod pgbouncer;
mod postgres;
mod process;

use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use fine_settler::{
    calendar,
    config::{ClaimSettings, Lease},
    jobs::{runner::Runner, JobName, RunKey},
    shard::ShardSpec,
    store::{
        loans::{insert_new, NewLoan},
        Db,
    },
};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

pub use citus::CitusDb;
pub use cluster::Cluster;
pub use pgbouncer::{PgBouncer, PoolMode};
pub use postgres::{pg_bin, program};
pub use process::{
    assert_success, daemon, exit_of, fine_settler, migrate, output, report, send_signal, sigkill, signal,
    spawn, stop, Running, StderrLog,
};

/// The settlement business dates a daemon in Asia/Shanghai is due for right now, oldest first (computed from
/// the database clock, as the daemon does).
pub async fn due_now(pool: &PgPool, months: u32) -> Vec<NaiveDate> {
    let now: DateTime<Utc> = sqlx::query_scalar("select now()")
        .fetch_one(pool)
        .await
        .expect("now");
    fine_settler::schedule::due::settlement_due(calendar::local_date(now, chrono_tz::Asia::Shanghai), months)
}

/// A loopback port nothing listens on (at the time of asking).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

pub fn d(s: &str) -> NaiveDate {
    s.parse().expect("test date")
}

pub fn key(date: &str, shard: i64, shards: i64) -> RunKey {
    RunKey {
        job: JobName::FineSettlement,
        business_date: d(date),
        shard: ShardSpec::new(shard, shards).expect("test shard"),
    }
}

/// A loan borrowed 30 days before it was due.
pub fn loan(id: i64, due: &str, returned: Option<&str>) -> NewLoan {
    let due_on = d(due);
    NewLoan {
        id,
        member_id: 1,
        book_id: 1,
        borrowed_on: due_on - chrono::Duration::days(30),
        due_on,
        returned_on: returned.map(d),
    }
}

pub async fn insert(pool: &PgPool, loans: &[NewLoan]) {
    insert_new(&db(pool), loans).await.expect("insert loans");
}

/// A `job_runs` row for shard 0 of 1 as some other replica left it: `lease` is the lease left, as a PostgreSQL
/// interval from now (`"1 hour"`, `"-1 minute"`, `"0 s"`).
pub async fn seed_run(
    pool: &PgPool,
    job: &str,
    date: NaiveDate,
    status: &str,
    owner: &str,
    epoch: i64,
    lease: &str,
) {
    sqlx::query(
        "insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch, lease_until)
         values ($1, $2, 1, 0, $3, $4, $5, now() + $6::interval)",
    )
    .bind(job)
    .bind(date)
    .bind(status)
    .bind(owner)
    .bind(epoch)
    .bind(lease)
    .execute(pool)
    .await
    .expect("seed job_runs row");
}

/// Counts every committed update of each loan row (rolled-back updates roll their count back too).
pub async fn install_update_audit(pool: &PgPool) {
    let table = "create table loan_updates (loan_id bigint primary key, n int not null)";
    let distribute = "select create_distributed_table('loan_updates', 'loan_id', colocate_with => 'loans')";
    let function = r#"create function count_loan_update() returns trigger language plpgsql as $$
           begin
               insert into loan_updates values (new.id, 1)
               on conflict (loan_id) do update set n = loan_updates.n + 1;
               return new;
           end $$"#;
    let trigger = "create trigger count_loan_update after update on loans
               for each row execute function count_loan_update()";
    if citus::is_test_db(pool) {
        ddl(pool, &[table, distribute, function, trigger]).await;
    } else {
        ddl(pool, &[table, function, trigger]).await;
    }
}

/// Makes every row of `event` (e.g. "update on loans") sleep `seconds_per_row`, so that a process under test is
/// reliably mid-run when the test acts on it.
pub async fn slow_down(pool: &PgPool, event: &str, seconds_per_row: f64) {
    let function = format!(
        "create or replace function slow_down() returns trigger language plpgsql as $$
         begin perform pg_sleep({seconds_per_row}); return new; end $$"
    );
    let trigger =
        format!("create trigger slow_down before {event} for each row execute function slow_down()");
    ddl(pool, &[&function, &trigger]).await;
}

/// The largest number of committed updates any loan received.
pub async fn max_updates_per_loan(pool: &PgPool) -> i32 {
    sqlx::query_scalar::<_, Option<i32>>("select max(n) from loan_updates")
        .fetch_one(pool)
        .await
        .expect("read audit")
        .unwrap_or(0)
}

/// The oracle, in plain SQL and independent of the daemon: (loans returned in the month, their total fine under
/// the default policy of 100 cents a day, no grace, no cap).
pub async fn oracle(pool: &PgPool, month_end: &str) -> (i64, i64) {
    sqlx::query_as::<_, (i64, i64)>(
        r#"select count(*), coalesce(sum(greatest(0, returned_on - due_on) * 100), 0)::bigint
           from loans
           where returned_on >= date_trunc('month', $1::date) and returned_on <= $1::date"#,
    )
    .bind(d(month_end))
    .fetch_one(pool)
    .await
    .expect("oracle")
}

/// What the database holds for a month: (settled loans returned in it, their total fine).
pub async fn settled(pool: &PgPool, month_end: &str) -> (i64, i64) {
    sqlx::query_as::<_, (i64, i64)>(
        r#"select count(*), coalesce(sum(fine_cents), 0)::bigint
           from loans
           where fine_settled_at is not null
             and returned_on >= date_trunc('month', $1::date) and returned_on <= $1::date"#,
    )
    .bind(d(month_end))
    .fetch_one(pool)
    .await
    .expect("settled")
}

/// Loans outside the month that were touched anyway (must be 0).
pub async fn settled_outside(pool: &PgPool, month_end: &str) -> i64 {
    sqlx::query_scalar(
        r#"select count(*) from loans
           where fine_settled_at is not null
             and (returned_on is null or returned_on < date_trunc('month', $1::date) or returned_on > $1::date)"#,
    )
    .bind(d(month_end))
    .fetch_one(pool)
    .await
    .expect("outside")
}

/// The claim settings of in-process test runners: a minute's lease, 10 s batches, lock waits of `lock_timeout`.
pub fn claim_settings(lock_timeout: Duration) -> ClaimSettings {
    ClaimSettings {
        lease: Lease::new(
            Duration::from_secs(60),
            Some(Duration::from_secs(10)),
            Some(lock_timeout),
        )
        .expect("a valid lease"),
        history_retention: Duration::from_secs(86_400),
    }
}

/// The lock wait of in-process test runners.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// The lock wait of in-process test runners on `db`: longer on Citus, whose batches hold their loans' locks
/// longer (each statement reaches the workers; three servers share the test machine), so that the suites' many
/// runs at once of overlapping loans wait for each other as they do on PostgreSQL.
fn lock_timeout_on(db: &Db) -> Duration {
    match db.engine() {
        fine_settler::config::Engine::Citus => Duration::from_secs(6),
        fine_settler::config::Engine::Postgresql => LOCK_TIMEOUT,
    }
}

/// The engine of the test's database: Citus for a test database on the Citus cluster.
pub fn engine(pool: &PgPool) -> fine_settler::config::Engine {
    if citus::is_test_db(pool) {
        fine_settler::config::Engine::Citus
    } else {
        fine_settler::config::Engine::Postgresql
    }
}

/// The pool as the product's [`Db`] (direct connections); on a Citus test database, the product's own pool
/// on it with the Citus engine ([`citus::jobs_db`]).
pub fn db(pool: &PgPool) -> Db {
    match pool.connect_options().get_database() {
        Some(name) if citus::is_test_db(pool) => citus::jobs_db(name),
        _ => Db::from(pool.clone()),
    }
}

/// A runner on `db` (see [`runner`]).
pub fn runner_on(db: Db, owner: &str, batch_size: u32) -> Runner {
    let lock_timeout = lock_timeout_on(&db);
    Runner::new(
        db,
        owner.into(),
        &claim_settings(lock_timeout),
        batch_size,
        CancellationToken::new(),
    )
}

pub fn runner(pool: &PgPool, owner: &str, batch_size: u32) -> Runner {
    runner_on(db(pool), owner, batch_size)
}

/// The URL of the test's own database on the server named by DATABASE_URL (or on the Citus cluster's
/// coordinator, for a Citus test database).
pub fn database_url(pool: &PgPool) -> String {
    let db = pool
        .connect_options()
        .get_database()
        .expect("test pool has a database")
        .to_string();
    if citus::is_citus(&db) {
        return citus::url_of(&db);
    }
    let server = std::env::var("DATABASE_URL").expect("DATABASE_URL");
    let (base, _) = server.rsplit_once('/').expect("DATABASE_URL has a database path");
    format!("{base}/{db}")
}

/// How a test's processes reach its database: directly, or through a pooler (`database.pooler`).
#[derive(Debug, Clone)]
pub struct Via {
    pub url: String,
    pub pooler: &'static str,
}

impl Via {
    /// Straight to the test's database.
    pub fn direct(pool: &PgPool) -> Via {
        Via {
            url: database_url(pool),
            pooler: "none",
        }
    }

    /// The binary, pointed at the database this way.
    pub fn command(&self) -> std::process::Command {
        let mut cmd = fine_settler(&self.url);
        cmd.env("FINE_SETTLER__DATABASE__POOLER", self.pooler);
        cmd
    }

    /// A replica (see [`daemon`]) reaching the database this way.
    pub fn daemon(&self, shard: i32, shards: i32, extra: &[(&str, &str)]) -> Running {
        let mut env = vec![("FINE_SETTLER__DATABASE__POOLER", self.pooler)];
        env.extend_from_slice(extra);
        daemon(&self.url, shard, shards, &env)
    }
}

/// Polls `check` every 50 ms until it returns true, failing after `limit`.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Replaces the database's fine rules with one `default` policy, effective from the earliest date: a test's
/// "deployment" whose rules are `policy`. fine-settler never rewrites a policy version (a trigger refuses it), so
/// the test does it as a superuser with triggers off, before any loan is priced under the old rules.
pub async fn set_policy(pool: &PgPool, policy: fine_settler::fine::FinePolicy) {
    add_versions(
        pool,
        &format!(
            "delete from fine_policies;
             insert into fine_policies (fine_class, effective_from, daily_rate_cents, grace_days, cap_cents, reason)
             values ('default', '4714-11-24 BC', {}, {}, {}, 'test')",
            policy.daily_rate().get(),
            policy.grace_days(),
            policy.cap().map_or(0, |c| c.get())
        ),
    )
    .await;
}

/// Runs `statements` (a test's own tables, functions and triggers) one at a time, each its own transaction: on a
/// Citus test database a `create trigger` on a distributed table is sent to the workers as the text received,
/// and Citus refuses a text of several commands. (Triggers on distributed tables fire on each shard, so a test's
/// must touch nothing but its own shard and the colocated ones.)
pub async fn ddl(pool: &PgPool, statements: &[&str]) {
    for statement in statements {
        sqlx::raw_sql(statement)
            .execute(pool)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
}

/// How many of the test database's sessions are asleep in `pg_sleep` (a slow trigger) for a session whose
/// application name is like `application`: on a Citus test database, a worker's session asleep for a
/// coordinator session of that name (the same distributed transaction: `citus_stat_activity`'s global pid).
pub async fn sleeping(pool: &PgPool, application: &str) -> i64 {
    let sql = if citus::is_test_db(pool) {
        "select count(*) from citus_stat_activity w
         where w.datname = current_database() and w.wait_event = 'PgSleep'
           and exists (select 1 from citus_stat_activity c
                       where c.global_pid = w.global_pid and c.application_name like $1)"
    } else {
        "select count(*) from pg_stat_activity
         where datname = current_database() and wait_event = 'PgSleep' and application_name like $1"
    };
    sqlx::query_scalar(sql)
        .bind(application)
        .fetch_one(pool)
        .await
        .expect("the server's sessions")
}

/// Runs `sql` (inserts of policy versions a test needs, back-dated ones included) with triggers off: the table's
/// insert trigger accepts only versions that take effect from today on, which a test of loans due in the past
/// cannot use.
pub async fn add_versions(pool: &PgPool, sql: &str) {
    let mut tx = pool.begin().await.expect("begin");
    if citus::is_test_db(pool) {
        // The copies of a reference table are written on every node: the setting goes with the transaction.
        sqlx::query("set local citus.propagate_set_commands = 'local'")
            .execute(&mut *tx)
            .await
            .expect("propagate the settings");
    }
    sqlx::query("set local session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .expect("triggers off");
    sqlx::raw_sql(sql).execute(&mut *tx).await.expect(sql);
    tx.commit().await.expect("commit");
}
