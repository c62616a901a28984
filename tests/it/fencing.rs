//! Fencing: a replica whose key was taken over commits nothing more.

use std::{
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use fine_settler::{
    jobs::{
        runner::{BatchJob, JobError, Written},
        settlement::Settlement,
        Outcome, RunKey,
    },
    store::{
        job_runs::{self, Claim, ClaimKind},
        loans::SettleBatch,
        Db,
    },
};
use sqlx::{postgres::PgPoolOptions, Connection, PgConnection, PgPool};
use tokio::sync::Notify;

use crate::helpers::{
    db, insert, install_update_audit, key, loan, max_updates_per_loan, oracle, runner, settled, wait_until,
};

/// Settlement, except that on reaching batch number `at` (0-based) the run says so and waits to be resumed
/// before it writes: the batch's rows are fetched and its transaction is open, but nothing of it is written yet.
struct PausesBeforeBatch {
    inner: Settlement,
    at: usize,
    batches: AtomicUsize,
    /// Notified once the run has reached batch `at`.
    reached: Notify,
    /// Notified to let batch `at` write.
    resume: Notify,
    /// How many loans batch `at` wrote inside its transaction, whether or not that transaction committed.
    written: AtomicU64,
}

impl PausesBeforeBatch {
    fn new(at: usize) -> Arc<Self> {
        Arc::new(PausesBeforeBatch {
            inner: Settlement::new(),
            at,
            batches: AtomicUsize::new(0),
            reached: Notify::new(),
            resume: Notify::new(),
            written: AtomicU64::new(0),
        })
    }

    /// Waits (at most 30 s) until the run has reached batch `at`.
    async fn wait_until_reached(&self, who: &str) {
        tokio::time::timeout(Duration::from_secs(30), self.reached.notified())
            .await
            .unwrap_or_else(|_| panic!("{who} did not reach batch {}", self.at));
    }
}

impl BatchJob for PausesBeforeBatch {
    type Batch = SettleBatch;

    fn extent(batch: &SettleBatch) -> (i64, i64) {
        Settlement::extent(batch)
    }

    fn committed(&self, key: &RunKey, batch: &SettleBatch) {
        self.inner.committed(key, batch);
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

    async fn write(
        &self,
        tx: &mut PgConnection,
        key: &RunKey,
        epoch: i64,
        batch: &SettleBatch,
    ) -> Result<Written, JobError> {
        if self.batches.fetch_add(1, Ordering::SeqCst) != self.at {
            return self.inner.write(tx, key, epoch, batch).await;
        }
        self.reached.notify_one();
        self.resume.notified().await;
        let written = self.inner.write(tx, key, epoch, batch).await?;
        self.written.store(written.updated, Ordering::SeqCst);
        Ok(written)
    }
}

/// A pool on the test's database whose sessions carry `name` as their application name, so that
/// [`install_writer_audit`] can tell who wrote a loan.
async fn pool_named(pool: &PgPool, name: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(3)
        .connect_with((*pool.connect_options()).clone().application_name(name))
        .await
        .expect("named pool")
}

/// Records, for every committed update of a loan, the application name of the session that made it.
async fn install_writer_audit(pool: &PgPool) {
    sqlx::raw_sql(
        r#"create table loan_writers (loan_id bigint not null, writer text not null);
           create function record_loan_writer() returns trigger language plpgsql as $$
           begin
               insert into loan_writers values (new.id, current_setting('application_name'));
               return new;
           end $$;
           create trigger record_loan_writer after update on loans
               for each row execute function record_loan_writer();"#,
    )
    .execute(pool)
    .await
    .expect("install writer audit");
}

/// Per writer: (application name, loans written, lowest id, highest id).
async fn writers(pool: &PgPool) -> Vec<(String, i64, i64, i64)> {
    sqlx::query_as(
        "select writer, count(*), min(loan_id), max(loan_id) from loan_writers group by writer order by writer",
    )
    .fetch_all(pool)
    .await
    .expect("writers")
}

/// A zombie replica stalls in the middle of a batch past its lease; a peer takes the key over and is itself in
/// the middle of its first batch, over the same rows, when the zombie wakes up and writes. The rows are still
/// unsettled, so the zombie's conditional write does change them: only the fence keeps them from committing. The
/// zombie ends `lease_lost` having committed nothing more, and the peer settles every loan from the zombie's
/// cursor on, each exactly once.
#[sqlx::test(fixtures("default_policy"))]
async fn a_replica_taken_over_mid_run_commits_nothing_more_and_the_peer_finishes(pool: PgPool) {
    install_update_audit(&pool).await;
    install_writer_audit(&pool).await;
    let loans: Vec<_> = (1..=100)
        .map(|id| loan(id, "2026-10-05", Some("2026-10-20")))
        .collect();
    insert(&pool, &loans).await;
    let (zombie_pool, peer_pool) = (pool_named(&pool, "zombie").await, pool_named(&pool, "peer").await);
    let k = key("2026-10-31", 0, 1);

    // The zombie commits batches 0..=2 (loans 1..=30) and pauses before writing batch 3 (loans 31..=40).
    let zombie_job = PausesBeforeBatch::new(3);
    let zombie = tokio::spawn({
        let (job, replica) = (zombie_job.clone(), runner(&zombie_pool, "zombie", 10));
        async move { replica.run(&*job, k, false).await }
    });
    zombie_job.wait_until_reached("the zombie").await;

    // Its stall outlives the lease: a peer takes the key over, resumes from the cursor and pauses before writing
    // its first batch (loans 31..=37).
    sqlx::query("update job_runs set lease_until = now() - interval '1 second'")
        .execute(&pool)
        .await
        .expect("expire the lease");
    let peer_job = PausesBeforeBatch::new(0);
    let peer = tokio::spawn({
        let (job, replica) = (peer_job.clone(), runner(&peer_pool, "peer", 7));
        async move { replica.run(&*job, k, false).await }
    });
    peer_job.wait_until_reached("the peer").await;

    // The zombie wakes up and writes loans 31..=40, which nobody has settled yet; its fence matches nothing.
    zombie_job.resume.notify_one();
    let zombie = zombie.await.expect("zombie task");
    assert_eq!(
        zombie_job.written.load(Ordering::SeqCst),
        10,
        "the zombie's last batch found unsettled loans to write"
    );
    assert_eq!(zombie.outcome, Outcome::LeaseLost, "{zombie:?}");
    assert_eq!(zombie.epoch, Some(1));
    assert_eq!(
        (zombie.scanned, zombie.updated),
        (30, 30),
        "only the three batches before the stall count"
    );
    assert_eq!(
        settled(&pool, "2026-10-31").await.0,
        30,
        "the zombie's last batch was rolled back"
    );

    peer_job.resume.notify_one();
    let peer = peer.await.expect("peer task");
    assert_eq!(
        (peer.outcome, peer.epoch, peer.scanned, peer.updated),
        (Outcome::Settled, Some(2), 70, 70)
    );
    assert_eq!(
        writers(&pool).await,
        vec![("peer".into(), 70, 31, 100), ("zombie".into(), 30, 1, 30)],
        "nothing the zombie wrote after the takeover committed"
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
    zombie_pool.close().await;
    peer_pool.close().await;
}

/// The advisory lock key of [`Gate`].
const GATE_KEY: i64 = 0x6761_7465;

/// Holds every update of a loan row at a gate until the test opens it: a trigger takes a shared advisory lock
/// that the gate's own session holds exclusively. A batch transaction stopped at the gate has fetched its loans
/// and started writing them, and has not reached its fence. On Citus the trigger fires on the workers, where
/// advisory locks are the workers' own: the gate is held there, by a session on each worker.
struct Gate {
    holders: Vec<PgConnection>,
    /// The servers the trigger runs on (this test database's URL on each).
    nodes: Vec<String>,
}

impl Gate {
    async fn close(pool: &PgPool) -> Gate {
        crate::helpers::ddl(
            pool,
            &[
                &format!(
                    "create function wait_at_gate() returns trigger language plpgsql as $$
                     begin perform pg_advisory_xact_lock_shared({GATE_KEY}); return new; end $$"
                ),
                "create trigger wait_at_gate before update on loans for each row execute function wait_at_gate()",
            ],
        )
        .await;
        let nodes = if crate::helpers::citus::is_test_db(pool) {
            crate::helpers::citus::worker_urls(pool)
        } else {
            vec![crate::helpers::database_url(pool)]
        };
        let mut holders = Vec::new();
        for node in &nodes {
            let mut holder = PgConnection::connect(node).await.expect("gate connection");
            sqlx::query("select pg_advisory_lock($1)")
                .bind(GATE_KEY)
                .execute(&mut holder)
                .await
                .expect("close the gate");
            holders.push(holder);
        }
        Gate { holders, nodes }
    }

    /// Waits (at most 30 s) until some transaction waits at the gate.
    async fn wait_for_a_writer(&self) {
        // pg_locks shows the whole server: only this test's database counts.
        let waiting = "select count(*) from pg_locks
                       where locktype = 'advisory' and objid::bigint = $1 and not granted
                         and database = (select oid from pg_database where datname = current_database())";
        wait_until("a loan update at the gate", Duration::from_secs(30), || async {
            for node in &self.nodes {
                let Ok(mut conn) = PgConnection::connect(node).await else {
                    continue;
                };
                let n = sqlx::query_scalar::<_, i64>(waiting)
                    .bind(GATE_KEY)
                    .fetch_one(&mut conn)
                    .await;
                if n.is_ok_and(|n| n > 0) {
                    return true;
                }
            }
            false
        })
        .await;
    }

    async fn open(mut self) {
        for holder in &mut self.holders {
            sqlx::query("select pg_advisory_unlock($1)")
                .bind(GATE_KEY)
                .execute(&mut *holder)
                .await
                .expect("open the gate");
        }
    }
}

crate::each_engine! {
/// The fence inside a real batch of `Runner::run`: while the batch transaction is writing its loans, an
/// operator releases the claim and a peer takes the key over. The runner's own fence, the batch's last
/// statement, then matches nothing: the batch's loan writes roll back, nothing is settled, and the run reports
/// `lease_lost` without touching the peer's row.
#[sqlx::test(fixtures("default_policy"))]
async fn a_batch_whose_claim_is_taken_over_while_it_writes_rolls_back(pool: PgPool) {
    install_update_audit(&pool).await;
    let loans: Vec<_> = (1..=20)
        .map(|id| loan(id, "2026-10-05", Some("2026-10-06")))
        .collect();
    insert(&pool, &loans).await;
    let k = key("2026-10-31", 0, 1);
    let gate = Gate::close(&pool).await;

    let run = tokio::spawn({
        let replica = runner(&pool, "a", 1000);
        let settlement = Settlement::new();
        async move { replica.run(&settlement, k, false).await }
    });
    gate.wait_for_a_writer().await;
    let released = job_runs::release(&db(&pool), &k, "operator", "looked stuck")
        .await
        .expect("release")
        .expect("the key exists");
    assert!(released.released, "{released:?}");
    let claim = job_runs::claim(
        &db(&pool),
        &k,
        "peer",
        Duration::from_secs(60),
        job_runs::ClaimMode::Free,
    )
    .await
    .expect("takeover");
    assert!(
        matches!(
            claim,
            Claim::Won {
                epoch: 2,
                kind: ClaimKind::TakenOver,
                ..
            }
        ),
        "{claim:?}"
    );
    gate.open().await;

    let report = run.await.expect("run task");
    assert_eq!(
        (report.outcome, report.epoch, report.scanned, report.updated),
        (Outcome::LeaseLost, Some(1), 0, 0),
        "{report:?}"
    );
    assert_eq!(settled(&pool, "2026-10-31").await, (0, 0));
    assert_eq!(
        max_updates_per_loan(&pool).await,
        0,
        "the batch's loan writes were rolled back"
    );
    let row: (String, String, i64, Option<i64>) =
        sqlx::query_as("select status, owner, epoch, cursor from job_runs")
            .fetch_one(&pool)
            .await
            .expect("row");
    assert_eq!(row, ("RUNNING".into(), "peer".into(), 2, None));
    let events: Vec<(i64, String)> = sqlx::query_as("select epoch, event from job_run_attempts order by id")
        .fetch_all(&pool)
        .await
        .expect("history");
    let events: Vec<(i64, &str)> = events.iter().map(|(e, ev)| (*e, ev.as_str())).collect();
    assert_eq!(
        events,
        vec![
            (1, "claimed"),
            (1, "released"),
            (2, "takeover"),
            (1, "lease_lost")
        ]
    );
}
}

#[sqlx::test(fixtures("default_policy"))]
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
        parts: Vec::new(),
    };
    let month = (crate::helpers::d("2026-10-01"), crate::helpers::d("2026-10-31"));
    let mut tx = pool.begin().await.expect("tx");
    let shard = fine_settler::shard::ShardSpec::SINGLE;
    let written = fine_settler::store::loans::settle_range(&mut tx, month, shard, &batch)
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
