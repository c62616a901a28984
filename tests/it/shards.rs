//! Shard membership covers every id, negative ones included: the SQL function every query uses agrees with
//! `ShardSpec::owns`, a month with negative ids is settled by exactly one shard per loan, and a negative loan's
//! pending charge is retried and counted by its shard.

use std::time::Duration;

use fine_settler::{
    backoff::Backoff,
    jobs::{
        accrual::{compensate, Accrual},
        settlement::Settlement,
        Outcome,
    },
    shard::{shard_of, ShardSpec, MAX_SHARDS},
    store,
};
use fine_settler::{config::Engine, store::ledger_writes::LedgerWrites};
use proptest::{
    strategy::{Strategy, ValueTree},
    test_runner::TestRunner,
};
use sqlx::PgPool;

use crate::helpers::{
    db, insert, install_update_audit, key, loan, max_updates_per_loan, oracle, runner, settled,
};

/// `fine_settler_shard_of(id, shards)` in SQL and `shard_of` in Rust agree on generated ids and shard counts
/// (any i64, 1..=MAX_SHARDS) and on the edges, all sent in one statement.
#[sqlx::test(fixtures("default_policy"))]
async fn the_sql_shard_function_agrees_with_shard_spec(pool: PgPool) {
    let mut gen = TestRunner::deterministic();
    let pairs = (proptest::num::i64::ANY, 1..=MAX_SHARDS);
    let mut cases: Vec<(i64, i32)> = (0..5000)
        .map(|_| pairs.new_tree(&mut gen).expect("generate").current())
        .collect();
    for id in [
        i64::MIN,
        i64::MIN + 1,
        -1025,
        -1024,
        -3,
        -2,
        -1,
        0,
        1,
        1023,
        i64::MAX,
    ] {
        for shards in [1, 2, 3, 7, MAX_SHARDS - 1, MAX_SHARDS] {
            cases.push((id, shards));
        }
    }
    let (ids, counts): (Vec<i64>, Vec<i32>) = cases.iter().copied().unzip();
    let from_sql: Vec<i32> = sqlx::query_scalar(
        "select fine_settler_shard_of(id, n) from unnest($1::bigint[], $2::int[]) with ordinality t(id, n, i)
         order by i",
    )
    .bind(&ids)
    .bind(&counts)
    .fetch_all(&pool)
    .await
    .expect("shard_of in SQL");
    for ((id, shards), sql) in cases.iter().zip(&from_sql) {
        assert_eq!(*sql, shard_of(*id, *shards), "id {id}, {shards} shards");
        let owners = (0..*shards)
            .filter(|s| {
                ShardSpec::new(i64::from(*s), i64::from(*shards))
                    .expect("shard")
                    .owns(*id)
            })
            .count();
        assert_eq!(owners, 1, "id {id}, {shards} shards");
    }
    assert_eq!(from_sql.len(), cases.len());
}

/// Loans -7..=7 returned in the month, settled by three shards: every loan is settled exactly once, each by the
/// shard `ShardSpec::owns` names, and the totals are the oracle's.
#[sqlx::test(fixtures("default_policy"))]
async fn negative_ids_are_settled_by_exactly_one_shard(pool: PgPool) {
    install_update_audit(&pool).await;
    let loans: Vec<_> = (-7..=7)
        .map(|id| loan(id, "2026-10-01", Some("2026-10-05")))
        .collect();
    insert(&pool, &loans).await;
    for shard in 0..3 {
        let spec = ShardSpec::new(shard, 3).expect("shard");
        let owned = (-7..=7).filter(|id| spec.owns(*id)).count() as i64;
        let run = runner(&pool, "a", 2)
            .run(&Settlement::new(), key("2026-10-31", shard, 3), false)
            .await;
        assert_eq!(
            (run.outcome, run.updated),
            (Outcome::Settled, owned),
            "shard {shard}"
        );
    }
    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    assert_eq!(settled(&pool, "2026-10-31").await, (15, 15 * 400));
    assert_eq!(max_updates_per_loan(&pool).await, 1);
}

/// A pending charge of loan -3 belongs to shard 1 of 2 (the remainder taken non-negative): that shard's pass
/// retries it and its counts show it; shard 0's do neither.
#[sqlx::test(fixtures("default_policy"))]
async fn a_negative_loans_pending_charge_is_retried_and_counted_by_its_shard(pool: PgPool) {
    insert(&pool, &[loan(-3, "2026-10-01", None)]).await;
    sqlx::query(
        "insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (-3, '2026-10-10', 100, 1, 'lock timeout', now())",
    )
    .execute(&pool)
    .await
    .expect("pending");
    let job = Accrual {
        backoff: Backoff::new(Duration::from_millis(100), Duration::from_millis(250)),
        row_timeout: Duration::from_millis(500),
        isolation_budget: Duration::from_secs(5),
        lock_timeout: Duration::from_secs(2),
        scope: Default::default(),
        writes: LedgerWrites::new(Engine::Postgresql),
    };
    let (zero, one) = (
        ShardSpec::new(0, 2).expect("shard"),
        ShardSpec::new(1, 2).expect("shard"),
    );
    let pool_db = db(&pool);
    assert_eq!(
        store::ledger::counts(&pool_db, Some(zero)).await.expect("counts"),
        (0, 0)
    );
    assert_eq!(
        store::ledger::counts(&pool_db, Some(one)).await.expect("counts"),
        (1, 0)
    );
    let other = compensate(&pool_db, &job, Some(zero), true, 10)
        .await
        .expect("pass");
    assert_eq!(other.charged, 0, "not shard 0's");
    let own = compensate(&pool_db, &job, Some(one), true, 10)
        .await
        .expect("pass");
    assert_eq!(own.charged, 1, "shard 1's");
    let ledger: Vec<(i64, i64)> = sqlx::query_as("select loan_id, amount_cents from fine_ledger")
        .fetch_all(&pool)
        .await
        .expect("ledger");
    assert_eq!(ledger, vec![(-3, 100)]);
}
