//! The claim protocol: insert, take over, skip; and its history.

use std::time::Duration;

use fine_settler::store::job_runs::{claim, finish, Claim, ClaimKind, ClaimMode, Claimant, Ending};
use sqlx::{postgres::PgPoolOptions, PgPool};

use crate::helpers::{db, key};

const LEASE: Duration = Duration::from_secs(60);

async fn won(pool: &PgPool, owner: &str, force: bool) -> Option<(i64, ClaimKind)> {
    let mode = if force { ClaimMode::Force } else { ClaimMode::Free };
    match claim(&db(pool), &key("2026-10-31", 0, 1), owner, LEASE, mode)
        .await
        .expect("claim")
    {
        Claim::Won { epoch, kind, .. } => Some((epoch, kind)),
        Claim::Skipped(_) => None,
    }
}

async fn status(pool: &PgPool) -> (String, String, i64) {
    sqlx::query_as("select status, owner, epoch from job_runs")
        .fetch_one(pool)
        .await
        .expect("job_runs row")
}

async fn expire_lease(pool: &PgPool) {
    sqlx::query("update job_runs set lease_until = now() - interval '1 second'")
        .execute(pool)
        .await
        .expect("expire");
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn first_insert_wins_and_the_second_skips(pool: PgPool) {
    assert_eq!(won(&pool, "a", false).await, Some((1, ClaimKind::Inserted)));
    assert_eq!(won(&pool, "b", false).await, None);
    assert_eq!(status(&pool).await, ("RUNNING".into(), "a".into(), 1));
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_live_running_key_is_skipped_even_by_force(pool: PgPool) {
    won(&pool, "a", false).await;
    match claim(&db(&pool), &key("2026-10-31", 0, 1), "b", LEASE, ClaimMode::Force)
        .await
        .expect("claim")
    {
        Claim::Skipped(holder) => {
            assert_eq!(
                (holder.status.as_str(), holder.owner.as_str(), holder.epoch),
                ("RUNNING", "a", 1)
            );
        }
        other => panic!("a live owner was displaced: {other:?}"),
    }
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn an_expired_running_key_is_taken_over_with_the_next_epoch(pool: PgPool) {
    won(&pool, "a", false).await;
    expire_lease(&pool).await;
    assert_eq!(won(&pool, "b", false).await, Some((2, ClaimKind::TakenOver)));
    assert_eq!(status(&pool).await, ("RUNNING".into(), "b".into(), 2));
    // The old owner can no longer finish the key.
    let k = key("2026-10-31", 0, 1);
    assert!(!finish(
        &db(&pool),
        &k,
        Claimant { epoch: 1, owner: "a" },
        None,
        Ending::Success,
        0,
        0
    )
    .await
    .expect("finish"));
    assert!(finish(
        &db(&pool),
        &k,
        Claimant { epoch: 2, owner: "b" },
        None,
        Ending::Success,
        0,
        0
    )
    .await
    .expect("finish"));
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_failed_key_is_taken_over_at_once(pool: PgPool) {
    won(&pool, "a", false).await;
    let k = key("2026-10-31", 0, 1);
    assert!(finish(
        &db(&pool),
        &k,
        Claimant { epoch: 1, owner: "a" },
        None,
        Ending::Failed("boom"),
        3,
        2
    )
    .await
    .expect("fail"));
    assert_eq!(won(&pool, "b", false).await, Some((2, ClaimKind::TakenOver)));
    let last_error: Option<String> = sqlx::query_scalar("select last_error from job_runs")
        .fetch_one(&pool)
        .await
        .expect("row");
    assert_eq!(last_error, None, "a takeover clears the previous error");
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn success_is_skipped_unless_forced_and_force_resets_the_cursor(pool: PgPool) {
    won(&pool, "a", false).await;
    sqlx::query("update job_runs set cursor = 500, scanned = 10, updated = 7")
        .execute(&pool)
        .await
        .expect("progress");
    let k = key("2026-10-31", 0, 1);
    assert!(finish(
        &db(&pool),
        &k,
        Claimant { epoch: 1, owner: "a" },
        Some(500),
        Ending::Success,
        10,
        7
    )
    .await
    .expect("finish"));
    assert_eq!(won(&pool, "b", false).await, None);
    match claim(&db(&pool), &k, "c", LEASE, ClaimMode::Force)
        .await
        .expect("claim")
    {
        Claim::Won { epoch, cursor, kind } => assert_eq!((epoch, cursor, kind), (2, None, ClaimKind::Forced)),
        other => panic!("force did not take a SUCCESS key: {other:?}"),
    }
    let counters: (i64, i64) = sqlx::query_as("select scanned, updated from job_runs")
        .fetch_one(&pool)
        .await
        .expect("row");
    assert_eq!(counters, (0, 0));
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn a_takeover_resumes_from_the_stored_cursor(pool: PgPool) {
    won(&pool, "a", false).await;
    sqlx::query("update job_runs set cursor = 4242")
        .execute(&pool)
        .await
        .expect("progress");
    expire_lease(&pool).await;
    match claim(&db(&pool), &key("2026-10-31", 0, 1), "b", LEASE, ClaimMode::Free)
        .await
        .expect("claim")
    {
        Claim::Won { cursor, .. } => assert_eq!(cursor, Some(4242)),
        other => panic!("{other:?}"),
    }
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn keys_differ_by_shard_count(pool: PgPool) {
    for (shard, shards) in [(0, 3), (0, 4), (1, 4)] {
        match claim(
            &db(&pool),
            &key("2026-10-31", shard, shards),
            "a",
            LEASE,
            ClaimMode::Free,
        )
        .await
        .expect("claim")
        {
            Claim::Won { epoch: 1, .. } => {}
            other => panic!("{shard}/{shards}: {other:?}"),
        }
    }
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn sixteen_concurrent_claimers_get_exactly_one_winner(pool: PgPool) {
    let wide = PgPoolOptions::new()
        .max_connections(17)
        .connect_with((*pool.connect_options()).clone())
        .await
        .expect("pool");
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let (pool, barrier) = (wide.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let _conn_warm = pool.acquire().await.expect("connection");
            drop(_conn_warm);
            barrier.wait().await;
            claim(
                &db(&pool),
                &key("2026-10-31", 0, 1),
                &format!("claimer-{i}"),
                LEASE,
                ClaimMode::Free,
            )
            .await
            .expect("claim")
        }));
    }
    let mut winners = 0;
    for t in tasks {
        if matches!(t.await.expect("task"), Claim::Won { .. }) {
            winners += 1;
        }
    }
    assert_eq!(winners, 1);
    let attempts: i64 = sqlx::query_scalar("select count(*) from job_run_attempts")
        .fetch_one(&wide)
        .await
        .expect("n");
    assert_eq!(attempts, 1, "only the winner appears in the history");
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn every_transition_appends_history(pool: PgPool) {
    let k = key("2026-10-31", 0, 1);
    won(&pool, "a", false).await;
    expire_lease(&pool).await;
    won(&pool, "b", false).await;
    finish(
        &db(&pool),
        &k,
        Claimant { epoch: 2, owner: "b" },
        None,
        Ending::Failed("disk full"),
        5,
        5,
    )
    .await
    .expect("fail");
    won(&pool, "c", false).await;
    finish(
        &db(&pool),
        &k,
        Claimant { epoch: 3, owner: "c" },
        None,
        Ending::Success,
        1,
        1,
    )
    .await
    .expect("finish");
    let events: Vec<(i64, String, String, Option<String>)> =
        sqlx::query_as("select epoch, owner, event, error from job_run_attempts order by id")
            .fetch_all(&pool)
            .await
            .expect("history");
    let events: Vec<(i64, &str, &str, Option<&str>)> = events
        .iter()
        .map(|(e, o, ev, err)| (*e, o.as_str(), ev.as_str(), err.as_deref()))
        .collect();
    assert_eq!(
        events,
        vec![
            (1, "a", "claimed", None),
            (2, "b", "takeover", None),
            (2, "b", "failed", Some("disk full")),
            (3, "c", "takeover", None),
            (3, "c", "success", None),
        ]
    );
}
}

crate::each_engine! {
#[sqlx::test(fixtures("default_policy"))]
async fn old_attempt_history_is_pruned_in_batches_and_job_runs_are_kept(pool: PgPool) {
    won(&pool, "a", false).await;
    sqlx::query(
        "insert into job_run_attempts (job_name, business_date, shards, shard, epoch, owner, event, at)
         select 'fine-settlement', '2026-10-31', 1, 0, 1, 'old', 'claimed', now() - interval '100 days'
         from generate_series(1, 2500)",
    )
    .execute(&pool)
    .await
    .expect("old history");
    let ninety_days = Duration::from_secs(90 * 86_400);
    let batches: Vec<u64> = {
        let mut v = Vec::new();
        loop {
            let n = fine_settler::store::job_runs::prune_history(&db(&pool), ninety_days, 1000)
                .await
                .expect("prune");
            v.push(n);
            if n < 1000 {
                break v;
            }
        }
    };
    assert_eq!(batches, vec![1000, 1000, 500]);
    let left: Vec<String> = sqlx::query_scalar("select owner from job_run_attempts")
        .fetch_all(&pool)
        .await
        .expect("history");
    assert_eq!(left, vec!["a".to_string()], "recent history stays");
    assert_eq!(status(&pool).await.0, "RUNNING", "job_runs rows are never pruned");
}
}

crate::each_engine! {
/// The finish is retried after a connection error; when the first attempt had committed (its reply lost with
/// the connection), the retry finds the key already SUCCESS under its own epoch: that is finished, not a lost
/// lease, and the history gets no second row.
#[sqlx::test(fixtures("default_policy"))]
async fn a_retried_finish_that_already_committed_counts_as_finished(pool: PgPool) {
    won(&pool, "a", false).await;
    let k = key("2026-10-31", 0, 1);
    assert!(finish(
        &db(&pool),
        &k,
        Claimant { epoch: 1, owner: "a" },
        None,
        Ending::Success,
        5,
        5
    )
    .await
    .expect("finish"));
    assert!(
        finish(
            &db(&pool),
            &k,
            Claimant { epoch: 1, owner: "a" },
            None,
            Ending::Success,
            5,
            5
        )
        .await
        .expect("retried finish"),
        "the retry sees its own SUCCESS"
    );
    let events: Vec<String> = sqlx::query_scalar("select event from job_run_attempts order by id")
        .fetch_all(&pool)
        .await
        .expect("history");
    assert_eq!(events, ["claimed", "success"]);
    // Another epoch's finish is still refused.
    assert!(!finish(
        &db(&pool),
        &k,
        Claimant { epoch: 2, owner: "b" },
        None,
        Ending::Success,
        0,
        0
    )
    .await
    .expect("finish"));
    // And a retried FAILED finish after a peer took the key over is a lost lease.
    expire_lease(&pool).await;
    sqlx::query("update job_runs set status = 'FAILED'")
        .execute(&pool)
        .await
        .expect("fail");
    assert_eq!(won(&pool, "b", false).await, Some((2, ClaimKind::TakenOver)));
    assert!(!finish(
        &db(&pool),
        &k,
        Claimant { epoch: 1, owner: "a" },
        None,
        Ending::Failed("x"),
        0,
        0
    )
    .await
    .expect("finish"));
}
}

crate::each_engine! {
/// The fence renews the lease from the moment it runs: a batch that took most of the batch timeout leaves its
/// owner a whole lease, not the lease minus the batch.
#[sqlx::test(fixtures("default_policy"))]
async fn the_fence_renews_the_lease_from_the_moment_it_runs(pool: PgPool) {
    won(&pool, "a", false).await;
    let k = key("2026-10-31", 0, 1);
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("select pg_sleep(1.5)")
        .execute(&mut *tx)
        .await
        .expect("a slow batch");
    let progress = fine_settler::store::job_runs::Progress {
        after: None,
        cursor: 10,
        scanned: 10,
        updated: 10,
    };
    let lease = Duration::from_secs(2);
    assert_eq!(
        fine_settler::store::job_runs::advance(
            &mut tx,
            &k,
            fine_settler::store::job_runs::Claimant { epoch: 1, owner: "a" },
            progress,
            lease
        )
        .await
        .expect("fence"),
        fine_settler::store::job_runs::Fence::Passed { paused: None }
    );
    tx.commit().await.expect("commit");
    let left: f64 = sqlx::query_scalar(
        "select extract(epoch from lease_until - clock_timestamp())::float8 from job_runs",
    )
    .fetch_one(&pool)
    .await
    .expect("lease");
    assert!(
        left > 1.8,
        "the renewed lease has {left:.3} s left, not 2 s - 1.5 s"
    );
}
}

crate::each_engine! {
/// The tick's action for a key (`KeyState::action`, from the row the tick status read) and the claim agree on
/// every state a row can be in: a free claim wins exactly the keys a tick would claim or take over, and a
/// re-open exactly the late SUCCESS ones.
#[sqlx::test(fixtures("default_policy"))]
async fn the_tick_s_action_and_the_claim_agree_on_every_state(pool: PgPool) {
    use fine_settler::{
        shard::ShardSpec,
        store::job_runs::{tick_status, Action, DueKeys, LateProbe},
    };
    let k = key("2026-10-31", 0, 1);
    let no_probe = LateProbe {
        settlement_since: None,
        due: DueKeys::NONE,
    };
    // Late: an unsettled loan returned in the month, so that the probe finds rows left in a SUCCESS key.
    crate::helpers::insert(
        &pool,
        &[crate::helpers::loan(1, "2026-10-01", Some("2026-10-10"))],
    )
    .await;
    let late_probe = LateProbe {
        settlement_since: Some(crate::helpers::d("2026-01-01")),
        due: DueKeys::NONE,
    };
    let states: [(&str, &str, LateProbe, Action); 6] = [
        ("none", "", no_probe, Action::Claim),
        ("live", "", no_probe, Action::Skip),
        (
            "expired",
            "update job_runs set lease_until = now() - interval '1 second'",
            no_probe,
            Action::Takeover,
        ),
        (
            "failed",
            "update job_runs set status = 'FAILED', lease_until = now()",
            no_probe,
            Action::Takeover,
        ),
        (
            "success",
            "update job_runs set status = 'SUCCESS', lease_until = now()",
            no_probe,
            Action::Skip,
        ),
        (
            "late",
            "update job_runs set status = 'SUCCESS', lease_until = now()",
            late_probe,
            Action::Reopen,
        ),
    ];
    for (name, setup, probe, expected) in states {
        sqlx::query("delete from job_runs")
            .execute(&pool)
            .await
            .expect("reset");
        if name != "none" {
            claim(&db(&pool), &k, "holder", LEASE, ClaimMode::Free)
                .await
                .expect("seed claim");
        }
        if !setup.is_empty() {
            sqlx::query(setup).execute(&pool).await.expect("setup");
        }
        let mut conn = pool.acquire().await.expect("connection");
        let seen = tick_status(
            &mut conn,
            ShardSpec::SINGLE,
            crate::helpers::d("2026-01-01"),
            probe,
        )
        .await
        .expect("tick status");
        drop(conn);
        let action = Action::of(seen.keys.first(), false);
        assert_eq!(action, expected, "{name}");
        let mode = if action == Action::Reopen {
            ClaimMode::Reopen
        } else {
            ClaimMode::Free
        };
        let won = matches!(
            claim(&db(&pool), &k, "tick", LEASE, mode).await.expect("claim"),
            Claim::Won { .. }
        );
        assert_eq!(
            won,
            matches!(action, Action::Claim | Action::Takeover | Action::Reopen),
            "{name}: the claim and the action {action:?} disagree"
        );
    }
}
}

crate::each_engine! {
/// After a failover the promoted standby may lack the run's last batches and their cursor: the run's next fence
/// and its SUCCESS must not pass there, or the run would go on after (or end at) a cursor whose rows the server
/// never settled. A FAILED ending is recorded whatever the cursor (the takeover resumes from the server's).
#[sqlx::test(fixtures("default_policy"))]
async fn the_fence_and_a_success_pass_only_at_the_cursor_the_run_last_committed(pool: PgPool) {
    use fine_settler::store::job_runs::{advance, Fence, Progress};
    won(&pool, "a", false).await;
    let k = key("2026-10-31", 0, 1);
    let fence = |after: Option<i64>, cursor: i64| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.expect("begin");
            let progress = Progress {
                after,
                cursor,
                scanned: 1,
                updated: 1,
            };
            let f = advance(&mut tx, &k, Claimant { epoch: 1, owner: "a" }, progress, LEASE)
                .await
                .expect("fence");
            tx.commit().await.expect("commit");
            f
        }
    };
    assert_eq!(fence(None, 10).await, Fence::Passed { paused: None });
    assert_eq!(fence(Some(10), 20).await, Fence::Passed { paused: None });
    // The server lost the batch that went to 20 (a failover): the run, which committed it, presents 20.
    sqlx::query("update job_runs set cursor = 10")
        .execute(&pool)
        .await
        .expect("lose the last batch");
    assert_eq!(fence(Some(20), 30).await, Fence::Lost);
    assert!(!finish(
        &db(&pool),
        &k,
        Claimant { epoch: 1, owner: "a" },
        Some(20),
        Ending::Success,
        0,
        0
    )
    .await
    .expect("finish"));
    assert_eq!(
        status(&pool).await.0,
        "RUNNING",
        "not SUCCESS at a cursor the server does not have"
    );
    assert!(finish(
        &db(&pool),
        &k,
        Claimant { epoch: 1, owner: "a" },
        Some(20),
        Ending::Failed("boom"),
        0,
        0
    )
    .await
    .expect("finish"));
    assert_eq!(status(&pool).await.0, "FAILED");
}
}

crate::each_engine! {
/// A standby promoted before it replayed a run's claim can give the same epoch, at the same cursor, to another
/// replica. The run still holding its old claim must not pass that replica's fence, renew its lease or finish its
/// key: the fence, the renewal and the finish name the owner too. Here the other replica's claim is written over
/// the row while the run's first batch is in flight (its loans updated, its fence not yet run).
#[sqlx::test(fixtures("default_policy"))]
async fn a_run_is_fenced_out_of_its_epoch_held_by_another_owner(pool: PgPool) {
    use fine_settler::jobs::{settlement::Settlement, Outcome};
    let loans: Vec<_> = (1..=400)
        .map(|id| crate::helpers::loan(id, "2026-10-01", Some("2026-10-06")))
        .collect();
    crate::helpers::insert(&pool, &loans).await;
    // 5 ms a row: the first batch of 100 takes about half a second before its fence.
    crate::helpers::slow_down(&pool, "update on loans", 0.005).await;
    let k = key("2026-10-31", 0, 1);
    let run = crate::helpers::runner(&pool, "a", 100);
    let task = tokio::spawn(async move { run.run(&Settlement::new(), k, false).await });
    crate::helpers::wait_until("the claim", Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, i64>("select count(*) from job_runs")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
            == 1
    })
    .await;
    // What the promoted standby holds: the same key, epoch 1, no cursor — claimed by "b".
    sqlx::query("update job_runs set owner = 'b', lease_until = now() + interval '1 hour'")
        .execute(&pool)
        .await
        .expect("b's claim");
    let report = task.await.expect("run");
    assert_eq!(report.outcome, Outcome::LeaseLost, "{report:?}");
    assert_eq!(status(&pool).await, ("RUNNING".into(), "b".into(), 1));
    let settled: i64 = sqlx::query_scalar("select count(*) from loans where fine_settled_at is not null")
        .fetch_one(&pool)
        .await
        .expect("settled");
    assert_eq!(settled, 0, "the fenced batch rolled back");
    let cursor: Option<i64> = sqlx::query_scalar("select cursor from job_runs")
        .fetch_one(&pool)
        .await
        .expect("cursor");
    assert_eq!(cursor, None);
    // Nor can it finish or renew b's key.
    assert!(!finish(
        &db(&pool),
        &k,
        Claimant { epoch: 1, owner: "a" },
        None,
        Ending::Failed("x"),
        0,
        0
    )
    .await
    .expect("finish"));
    assert_eq!(
        fine_settler::store::job_runs::renew(&db(&pool), &k, Claimant { epoch: 1, owner: "a" }, None, LEASE)
            .await
            .expect("renew"),
        fine_settler::store::job_runs::Fence::Lost
    );
    assert_eq!(status(&pool).await, ("RUNNING".into(), "b".into(), 1));
}
}
