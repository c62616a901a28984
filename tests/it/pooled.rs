//! The core guarantees, through a real PgBouncer with its default settings (`database.pooler` set to its pool
//! mode): the idempotence test (3 shards × 2 concurrent processes, rerun, forced rerun, oracle, audit trigger)
//! in transaction and session mode; three replicas catching up; an accrual whose rejected charges wait in
//! pending and are compensated once; a replica frozen mid-batch (SIGSTOP) whose transaction the server aborts;
//! and a PostgreSQL restart under running replicas.

use std::time::Duration;

use chrono::Datelike;
use fine_settler::{
    config::{DatabaseSettings, DatabaseUrl, Engine, Pooler},
    store::{self, Db},
};
use sqlx::PgPool;

use crate::{
    accrual::rejected_charges_compensated_once,
    daemon::{replicas_recover_from_a_restart, three_replicas_catch_up},
    helpers::{
        database_url, due_now, exit_of, insert, install_update_audit, loan, max_updates_per_loan, oracle,
        settled, signal, slow_down, wait_until, PgBouncer, PoolMode, StderrLog, Via,
    },
    settlement::three_shards_twice_each,
};

fn pooler(mode: PoolMode) -> &'static str {
    match mode {
        PoolMode::Transaction => "transaction",
        PoolMode::Session => "session",
    }
}

/// The test's database through `bouncer`.
fn via(pool: &PgPool, bouncer: &PgBouncer, mode: PoolMode) -> Via {
    Via {
        url: bouncer.url_for(&database_url(pool)),
        pooler: pooler(mode),
    }
}

/// The jobs' pool of the product itself, through `bouncer`.
async fn jobs_through(pool: &PgPool, bouncer: &PgBouncer, mode: PoolMode) -> Db {
    let settings = DatabaseSettings {
        url: DatabaseUrl::parse(&bouncer.url_for(&database_url(pool))).expect("url"),
        max_connections: 4,
        connect_timeout: Duration::from_secs(10),
        pooler: match mode {
            PoolMode::Transaction => Pooler::Transaction,
            PoolMode::Session => Pooler::Session,
        },
        engine: Engine::Postgresql,
    };
    store::connect(&settings, "fine-settler test", Duration::from_secs(5))
        .await
        .expect("connect through pgbouncer")
}

#[sqlx::test(fixtures("default_policy"))]
async fn idempotence_through_pgbouncer_in_transaction_mode(pool: PgPool) {
    let bouncer = PgBouncer::start(PoolMode::Transaction).await;
    three_shards_twice_each(&pool, &via(&pool, &bouncer, PoolMode::Transaction)).await;
}

#[sqlx::test(fixtures("default_policy"))]
async fn idempotence_through_pgbouncer_in_session_mode(pool: PgPool) {
    let bouncer = PgBouncer::start(PoolMode::Session).await;
    three_shards_twice_each(&pool, &via(&pool, &bouncer, PoolMode::Session)).await;
}

#[sqlx::test(fixtures("default_policy"))]
async fn three_replicas_catch_up_through_pgbouncer_in_transaction_mode(pool: PgPool) {
    let bouncer = PgBouncer::start(PoolMode::Transaction).await;
    three_replicas_catch_up(&pool, &via(&pool, &bouncer, PoolMode::Transaction)).await;
}

#[sqlx::test(fixtures("default_policy"))]
async fn rejected_charges_are_compensated_once_through_pgbouncer_in_transaction_mode(pool: PgPool) {
    let bouncer = PgBouncer::start(PoolMode::Transaction).await;
    let jobs = jobs_through(&pool, &bouncer, PoolMode::Transaction).await;
    rejected_charges_compensated_once(&pool, jobs).await;
}

/// The owner, cursor and status of the key of `month`.
async fn holder(pool: &PgPool, month: chrono::NaiveDate) -> Option<(String, Option<i64>, String)> {
    sqlx::query_as("select owner, cursor, status from job_runs where business_date = $1")
        .bind(month)
        .fetch_optional(pool)
        .await
        .expect("job_runs")
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_replica_frozen_mid_batch_behind_pgbouncer_commits_nothing_when_thawed(pool: PgPool) {
    let bouncer = PgBouncer::start(PoolMode::Transaction).await;
    let via = via(&pool, &bouncer, PoolMode::Transaction);
    install_update_audit(&pool).await;
    let month = due_now(&pool, 1).await[0];
    let first = month.with_day(1).expect("first day");
    let loans: Vec<_> = (1..=200)
        .map(|id| loan(id, &first.to_string(), Some(&month.to_string())))
        .collect();
    insert(&pool, &loans).await;
    let expected = oracle(&pool, &month.to_string()).await;
    // Batches of 25 at 20 ms a row: half a second of statement per batch, then the fence and the commit.
    slow_down(&pool, "update on loans", 0.02).await;

    // Settlement only, a 3 s lease and a 1 s batch timeout (so also 1 s of idle-in-transaction at most).
    let zombie_env = [("FINE_SETTLER__ACCRUAL__ENABLED", "false")];
    let mut zombie = via.daemon(0, 1, &zombie_env);
    let zombie_log = StderrLog::collect(&mut zombie);
    wait_until("the first batch committed", Duration::from_secs(30), || async {
        matches!(holder(&pool, month).await, Some((_, Some(_), s)) if s == "RUNNING")
    })
    .await;
    // Freeze it while a batch's transaction is open: its statement runs on, then the transaction sits idle,
    // and the server aborts it after the idle-in-transaction timeout, set local to the transaction (behind a
    // transaction-mode pooler there is no session to set it on).
    let zombie_owner = holder(&pool, month).await.expect("held").0;
    wait_until("a batch transaction open", Duration::from_secs(10), || async {
        open_transactions(&pool).await == 1
    })
    .await;
    signal(&zombie, "STOP");
    wait_until(
        "the frozen replica's transaction aborted by the server",
        Duration::from_secs(10),
        || async { open_transactions(&pool).await == 0 },
    )
    .await;
    let peer = via.daemon(0, 1, &zombie_env);
    wait_until("the peer settled the month", Duration::from_secs(60), || async {
        matches!(holder(&pool, month).await, Some((o, _, s)) if s == "SUCCESS" && o != zombie_owner)
    })
    .await;
    signal(&zombie, "CONT");
    // The thawed replica finds its transaction gone: what it had in flight commits nothing.
    wait_until(
        "the thawed replica noticed it lost its key",
        Duration::from_secs(15),
        || async { zombie_log.contains("lease lost") || zombie_log.contains("run failed") },
    )
    .await;
    assert_eq!(settled(&pool, &month.to_string()).await, expected);
    assert_eq!(max_updates_per_loan(&pool).await, 1, "no loan was updated twice");

    signal(&peer, "TERM");
    signal(&zombie, "TERM");
    let (code, stderr) = exit_of(peer, Duration::from_secs(10)).await;
    assert_eq!(code, Some(0), "{stderr}");
    let (code, _) = exit_of(zombie, Duration::from_secs(10)).await;
    assert_eq!(code, Some(0));
    zombie_log.finish();
}

/// Transactions open on the test's database, other than the asking one's.
async fn open_transactions(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_stat_activity
         where datname = current_database() and xact_start is not null and pid <> pg_backend_pid()",
    )
    .fetch_one(pool)
    .await
    .expect("pg_stat_activity")
}

#[tokio::test]
async fn replicas_behind_pgbouncer_recover_from_a_postgres_restart() {
    replicas_recover_from_a_restart(Some(PoolMode::Transaction)).await;
}
