//! The settlement's walk on Citus: each batch's parts lie in one Citus shard each, on different workers, so
//! each part's write is one statement on one worker and the workers write at once; and a run that stops inside
//! a window leaves a cursor below which every loan is settled.

use std::sync::Mutex;

use fine_settler::{
    jobs::{
        runner::{BatchJob, JobError, Written},
        settlement::Settlement,
        Outcome, RunKey,
    },
    store::{loans::SettleBatch, Db},
};
use sqlx::{PgConnection, PgPool};

use crate::helpers::{
    citus::{jobs_db_of, on_citus},
    key, runner, runner_on,
};

/// The settlement, recording the loans of each write (a batch's part), how many parts each batch was cut
/// into and the loans of each committed batch, and failing every write in a batch's own transaction from write
/// number `fail_at` (1-based) on.
struct Recorded {
    inner: Settlement,
    batches: Mutex<Vec<Vec<i64>>>,
    splits: Mutex<Vec<usize>>,
    committed: Mutex<i64>,
    fail_at: Option<usize>,
}

impl Recorded {
    fn new(fail_at: Option<usize>) -> Self {
        Recorded {
            inner: Settlement::new(),
            batches: Mutex::new(Vec::new()),
            splits: Mutex::new(Vec::new()),
            committed: Mutex::new(0),
            fail_at,
        }
    }

    fn batches(&self) -> Vec<Vec<i64>> {
        self.batches.lock().expect("the batches").clone()
    }
}

impl BatchJob for Recorded {
    type Batch = SettleBatch;

    fn extent(batch: &SettleBatch) -> (i64, i64) {
        Settlement::extent(batch)
    }

    fn committed(&self, key: &RunKey, batch: &SettleBatch) {
        *self.committed.lock().expect("the count") += batch.count;
        self.inner.committed(key, batch);
    }

    async fn write_beside(
        &self,
        tx: &mut PgConnection,
        key: &RunKey,
        epoch: i64,
        part: &SettleBatch,
    ) -> Result<Option<Written>, JobError> {
        self.record(part);
        self.inner.write_beside(tx, key, epoch, part).await
    }

    fn split(&self, batch: &SettleBatch) -> Option<(SettleBatch, Vec<SettleBatch>)> {
        self.splits.lock().expect("the splits").push(batch.parts.len());
        self.inner.split(batch)
    }

    async fn fetch(
        &self,
        pool: &Db,
        key: &RunKey,
        from_id: i64,
        limit: i64,
    ) -> Result<Option<SettleBatch>, JobError> {
        self.inner.fetch(pool, key, from_id, limit).await
    }

    async fn first_id(&self, pool: &Db, key: &RunKey) -> Result<Option<i64>, JobError> {
        self.inner.first_id(pool, key).await
    }

    async fn write(
        &self,
        tx: &mut PgConnection,
        key: &RunKey,
        epoch: i64,
        batch: &SettleBatch,
    ) -> Result<Written, JobError> {
        let n = self.record(batch);
        if self.fail_at.is_some_and(|at| n >= at) {
            return Err(JobError::Sql(sqlx::Error::Protocol(
                "the test stops the run here".into(),
            )));
        }
        self.inner.write(tx, key, epoch, batch).await
    }
}

impl Recorded {
    /// Records the loans of a write; returns how many writes there were.
    fn record(&self, batch: &SettleBatch) -> usize {
        let mut batches = self.batches.lock().expect("the batches");
        batches.extend(batch.parts.iter().cloned());
        batches.len()
    }
}

/// With one connection in its pool a replica writes every part of a batch in the batch's own transaction: the
/// month is settled and counted as with parts beside.
#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn with_one_connection_every_part_is_written_in_its_batch() {
    on_citus("one_conn", &[], |pool| async move {
        sqlx::raw_sql(
            "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
             select g, g, g, '2026-09-20', '2026-10-10', '2026-10-20' from generate_series(1, 600) g",
        )
        .execute(&pool)
        .await
        .expect("the loans");
        let name = pool
            .connect_options()
            .get_database()
            .expect("a database")
            .to_string();
        let one = runner_on(jobs_db_of(&name, 1), "one", 10);
        let job = Recorded::new(None);
        let report = one.run(&job, key("2026-10-31", 0, 1), false).await;
        assert_eq!(
            (report.outcome, report.scanned, report.updated),
            (Outcome::Settled, 600, 600),
            "{report:?}"
        );
        assert_eq!(settled(&pool).await, (600, Some(600 * 1000)));
        let counted: (i64, i64) = sqlx::query_as("select scanned, updated from job_runs")
            .fetch_one(&pool)
            .await
            .expect("the key");
        assert_eq!(counted, (600, 600));
        assert!(
            job.splits.lock().expect("the splits").contains(&2),
            "batches were cut into parts"
        );
        let mut written: Vec<i64> = job.batches().concat();
        written.sort_unstable();
        assert_eq!(written, (1..=600).collect::<Vec<i64>>(), "each loan written once");
    })
    .await;
}

/// The node (placement group) of the Citus shard of `ids`' first loan.
async fn node_of(pool: &PgPool, ids: &[i64]) -> i32 {
    sqlx::query_scalar(
        "select p.groupid from pg_dist_placement p
         where p.shardid = get_shard_id_for_distribution_column('loans', $1::bigint)",
    )
    .bind(ids[0])
    .fetch_one(pool)
    .await
    .expect("the node of a part")
}

/// How many Citus shards `ids` fall in.
async fn shards_of(pool: &PgPool, ids: &[i64]) -> i64 {
    sqlx::query_scalar(
        "select count(distinct get_shard_id_for_distribution_column('loans', id)) from unnest($1::bigint[]) id",
    )
    .bind(ids)
    .fetch_one(pool)
    .await
    .expect("the shards of a batch")
}

/// Loans returned in the month that are not settled at or below the key's cursor, and the cursor.
async fn unsettled_below_cursor(pool: &PgPool) -> (Option<i64>, i64) {
    let cursor: Option<i64> =
        sqlx::query_scalar("select cursor from job_runs where job_name = 'fine-settlement'")
            .fetch_one(pool)
            .await
            .expect("the key");
    let below = sqlx::query_scalar(
        "select count(*) from loans
         where returned_on between '2026-10-01' and '2026-10-31' and fine_settled_at is null and id <= $1",
    )
    .bind(cursor.unwrap_or(-1))
    .fetch_one(pool)
    .await
    .expect("the loans");
    (cursor, below)
}

async fn settled(pool: &PgPool) -> (i64, Option<i64>) {
    sqlx::query_as("select count(*), sum(fine_cents)::bigint from loans where fine_settled_at is not null")
        .fetch_one(pool)
        .await
        .expect("the loans")
}

/// 600 loans returned in October, ten days late, over the 32 Citus shards of `loans` on two workers, in batches
/// of 10: a window is 320 loans (10 for each Citus shard), so the walk has two. A batch is cut into a part on
/// each worker, each part's loans in one Citus shard. A run stopped from its fifth part on leaves a cursor below
/// which every loan is settled; the run that takes the key over settles the rest, each loan once.
#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn each_part_lies_in_one_citus_shard_of_its_worker_and_a_run_stopped_inside_a_window_leaves_a_true_cursor(
) {
    on_citus("walk", &[], |pool| async move {
        sqlx::raw_sql(
            "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
             select g, g, g, '2026-09-20', '2026-10-10', '2026-10-20' from generate_series(1, 600) g;
             insert into loans (id, member_id, book_id, borrowed_on, due_on)
             select g, g, g, '2026-09-20', '2026-10-10' from generate_series(601, 700) g",
        )
        .execute(&pool)
        .await
        .expect("the loans");
        let k = key("2026-10-31", 0, 1);

        let stopped = Recorded::new(Some(5));
        let first = runner(&pool, "a", 10).run(&stopped, k, false).await;
        assert_eq!(first.outcome, Outcome::Failed, "{first:?}");
        let (cursor, below) = unsettled_below_cursor(&pool).await;
        assert_eq!(
            below, 0,
            "every loan at or below the cursor {cursor:?} is settled"
        );
        // The batches that committed, and a part beside the failed one that may have: each counted in the key.
        let committed = *stopped.committed.lock().expect("the count");
        let after_first = settled(&pool).await.0;
        assert!(
            committed > 0 && after_first >= committed,
            "{committed} {after_first}"
        );
        let counted: i64 = sqlx::query_scalar("select scanned from job_runs")
            .fetch_one(&pool)
            .await
            .expect("the key");
        assert_eq!(counted, after_first, "every loan settled is counted once");
        assert_eq!(
            first.scanned, counted,
            "the run's report counts what the key counts"
        );
        assert!(
            stopped.splits.lock().expect("the splits").iter().all(|&n| n == 2),
            "every batch has a part on each of the two workers"
        );

        let rest = Recorded::new(None);
        let second = runner(&pool, "b", 10).run(&rest, k, false).await;
        assert_eq!(second.outcome, Outcome::Settled, "{second:?}");
        assert_eq!(second.updated, 600 - after_first, "{second:?}");
        assert_eq!(settled(&pool).await, (600, Some(600 * 1000)));

        let batches: Vec<Vec<i64>> = stopped.batches().into_iter().chain(rest.batches()).collect();
        for batch in &batches {
            assert!(!batch.is_empty() && batch.len() <= 10, "{batch:?}");
            assert_eq!(shards_of(&pool, batch).await, 1, "one Citus shard: {batch:?}");
        }
        let mut again: Vec<i64> = rest.batches().concat();
        again.sort_unstable();
        assert!(
            again.windows(2).all(|w| w[0] < w[1]),
            "no loan in two batches of a run"
        );
        let mut nodes = Vec::new();
        for batch in &batches {
            nodes.push(node_of(&pool, batch).await);
        }
        nodes.sort_unstable();
        nodes.dedup();
        assert_eq!(nodes.len(), 2, "parts on both workers");
    })
    .await;
}
