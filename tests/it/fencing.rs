//! Fencing: a replica whose key was taken over commits nothing more.

use std::sync::atomic::{AtomicUsize, Ordering};

use fine_settler::{
    fine::FinePolicy,
    jobs::{
        runner::{BatchJob, JobError},
        settlement::Settlement,
        JobName, Outcome, RunKey,
    },
    store::loans::SettleBatch,
};
use sqlx::{PgConnection, PgPool};

use crate::helpers::{
    d, insert, install_update_audit, key, loan, max_updates_per_loan, oracle, runner, seed_run, settled,
};

/// Settlement, except that just before writing batch number `after` (0-based) the replica stalls long enough
/// for its lease to expire and for a peer to take the key over and finish it.
struct StallsBeforeBatch {
    inner: Settlement,
    after: usize,
    batches: AtomicUsize,
    peer_pool: PgPool,
    peer_report: tokio::sync::Mutex<Option<fine_settler::jobs::RunReport>>,
}

impl BatchJob for StallsBeforeBatch {
    type Batch = SettleBatch;

    fn name(&self) -> JobName {
        self.inner.name()
    }

    fn extent(batch: &SettleBatch) -> (i64, i64) {
        Settlement::extent(batch)
    }

    async fn fetch(
        &self,
        pool: &PgPool,
        key: &RunKey,
        from_id: i64,
        limit: i64,
    ) -> Result<Option<SettleBatch>, JobError> {
        self.inner.fetch(pool, key, from_id, limit).await
    }

    async fn write(&self, tx: &mut PgConnection, key: &RunKey, batch: &SettleBatch) -> Result<u64, JobError> {
        if self.batches.fetch_add(1, Ordering::SeqCst) == self.after {
            // The stall outlives the lease...
            sqlx::query("update job_runs set lease_until = now() - interval '1 second'")
                .execute(&self.peer_pool)
                .await?;
            // ...and a peer takes over, resumes from the cursor and finishes, all before we write.
            let peer = runner(&self.peer_pool, "peer", 7);
            let report = peer.run(&self.inner, *key, false).await;
            *self.peer_report.lock().await = Some(report);
        }
        self.inner.write(tx, key, batch).await
    }
}

#[sqlx::test]
async fn a_replica_taken_over_mid_run_commits_nothing_more_and_the_peer_finishes(pool: PgPool) {
    install_update_audit(&pool).await;
    let loans: Vec<_> = (1..=100)
        .map(|id| loan(id, "2026-10-05", Some("2026-10-20")))
        .collect();
    insert(&pool, &loans).await;

    let job = StallsBeforeBatch {
        inner: Settlement {
            policy: FinePolicy::default(),
        },
        after: 3,
        batches: AtomicUsize::new(0),
        peer_pool: pool.clone(),
        peer_report: tokio::sync::Mutex::new(None),
    };
    let zombie = runner(&pool, "zombie", 10)
        .run(&job, key("2026-10-31", 0, 1), false)
        .await;

    assert_eq!(zombie.outcome, Outcome::LeaseLost);
    assert_eq!(zombie.epoch, Some(1));
    assert_eq!(
        (zombie.scanned, zombie.updated),
        (30, 30),
        "only the three batches before the stall count"
    );
    let peer = job.peer_report.lock().await.clone().expect("the peer ran");
    assert_eq!(
        (peer.outcome, peer.epoch, peer.scanned),
        (Outcome::Settled, Some(2), 70)
    );

    assert_eq!(
        settled(&pool, "2026-10-31").await,
        oracle(&pool, "2026-10-31").await
    );
    assert_eq!(max_updates_per_loan(&pool).await, 1, "no loan was written twice");
    let row: (String, String, i64) = sqlx::query_as("select status, owner, epoch from job_runs")
        .fetch_one(&pool)
        .await
        .expect("row");
    assert_eq!(row, ("SUCCESS".into(), "peer".into(), 2));
    let lost: i64 = sqlx::query_scalar(
        "select count(*) from job_run_attempts where event = 'lease_lost' and epoch = 1 and owner = 'zombie'",
    )
    .fetch_one(&pool)
    .await
    .expect("history");
    assert_eq!(lost, 1);
}

#[sqlx::test]
async fn a_fenced_batch_rolls_back_its_business_writes(pool: PgPool) {
    install_update_audit(&pool).await;
    let loans: Vec<_> = (1..=20)
        .map(|id| loan(id, "2026-10-05", Some("2026-10-06")))
        .collect();
    insert(&pool, &loans).await;
    let k = key("2026-10-31", 0, 1);
    let runner = runner(&pool, "a", 1000);
    // Claim, then lose the key before the first batch: bump the epoch underneath the runner.
    seed_run(
        &pool,
        "fine-settlement",
        d("2026-10-31"),
        "RUNNING",
        "other",
        5,
        "1 hour",
    )
    .await;
    let mut tx = pool.begin().await.expect("tx");
    let settlement = Settlement {
        policy: FinePolicy::default(),
    };
    let batch = settlement
        .fetch(&pool, &k, i64::MIN, 1000)
        .await
        .expect("fetch")
        .expect("a batch");
    let written = settlement.write(&mut tx, &k, &batch).await.expect("write");
    assert_eq!(written, 20);
    let progress = fine_settler::store::job_runs::Progress {
        cursor: 20,
        scanned: 20,
        updated: 20,
    };
    let fenced = fine_settler::store::job_runs::advance(&mut tx, &k, 4, progress, runner.lease)
        .await
        .expect("advance");
    assert!(!fenced, "epoch 4 does not own a key at epoch 5");
    tx.rollback().await.expect("rollback");
    assert_eq!(settled(&pool, "2026-10-31").await.0, 0);
    assert_eq!(max_updates_per_loan(&pool).await, 0);
}

#[sqlx::test]
async fn the_conditional_write_never_changes_a_settled_loan(pool: PgPool) {
    install_update_audit(&pool).await;
    insert(
        &pool,
        &[
            loan(1, "2026-10-01", Some("2026-10-04")),
            loan(2, "2026-10-01", Some("2026-10-02")),
        ],
    )
    .await;
    // Loan 1 was settled (with a fine that today's policy would not give) by an earlier run.
    sqlx::query("update loans set fine_cents = 777, fine_settled_at = now() where id = 1")
        .execute(&pool)
        .await
        .expect("settle 1");
    // A writer whose batch still covers loan 1 (a stale batch, another shard count).
    let batch = SettleBatch {
        from_id: 1,
        last_id: 2,
        count: 2,
        bad_due: None,
    };
    let month = (crate::helpers::d("2026-10-01"), crate::helpers::d("2026-10-31"));
    let mut tx = pool.begin().await.expect("tx");
    let shard = fine_settler::shard::ShardSpec::SINGLE;
    let written =
        fine_settler::store::loans::settle_range(&mut tx, month, shard, &batch, &FinePolicy::DEFAULT)
            .await
            .expect("settle");
    tx.commit().await.expect("commit");
    assert_eq!(written, 1, "only the unsettled loan is written");
    let fines: Vec<(i64, i64)> = sqlx::query_as("select id, fine_cents from loans order by id")
        .fetch_all(&pool)
        .await
        .expect("loans");
    assert_eq!(fines, vec![(1, 777), (2, 100)]);
    assert_eq!(max_updates_per_loan(&pool).await, 1);
}
