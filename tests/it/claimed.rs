//! A claimed run as one handle (`ClaimedRun`): it advances through the fence from its own cursor, renews by the
//! same fence without rows, ends once, and after a lost fence commits nothing and can only record the loss.

use std::time::Duration;

use fine_settler::store::job_runs::{ClaimKind, ClaimMode, Claimed, ClaimedRun, Covered, Ending, Fence};
use sqlx::PgPool;

use crate::helpers::{db, insert, key, loan};

const LEASE: Duration = Duration::from_secs(60);

async fn won(pool: &PgPool, owner: &str, mode: ClaimMode) -> ClaimedRun {
    match ClaimedRun::claim(&db(pool), key("2026-10-31", 0, 1), owner, LEASE, mode)
        .await
        .expect("claim")
    {
        Claimed::Won(run) => run,
        Claimed::Skipped(holder) => panic!("{owner} was skipped: {holder:?}"),
    }
}

/// (cursor, scanned, updated) of the only `job_runs` row.
async fn row(pool: &PgPool) -> (Option<i64>, i64, i64) {
    sqlx::query_as("select cursor, scanned, updated from job_runs")
        .fetch_one(pool)
        .await
        .expect("job_runs row")
}

async fn events(pool: &PgPool) -> Vec<(String, String, Option<i64>)> {
    sqlx::query_as("select owner, event, scanned from job_run_attempts order by id")
        .fetch_all(pool)
        .await
        .expect("history")
}

async fn covered(run: &mut ClaimedRun, pool: &PgPool, last_id: i64, rows: i64) -> Fence {
    let tx = db(pool).begin().await.expect("begin");
    let covered = Covered {
        last_id,
        scanned: rows,
        updated: rows,
        corrected: 0,
    };
    run.advance(tx, covered).await.expect("advance")
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_run_advances_from_its_own_cursor_renews_without_rows_and_ends_once(pool: PgPool) {
    let mut run = won(&pool, "a", ClaimMode::Free).await;
    assert_eq!(
        (run.epoch(), run.kind(), run.next_id()),
        (1, ClaimKind::Inserted, Some(i64::MIN))
    );
    assert_eq!(
        covered(&mut run, &pool, 10, 4).await,
        Fence::Passed { paused: None }
    );
    assert_eq!(
        covered(&mut run, &pool, 20, 3).await,
        Fence::Passed { paused: None }
    );
    assert_eq!(
        (run.cursor(), run.next_id(), run.scanned()),
        (Some(20), Some(21), 7)
    );
    assert_eq!(row(&pool).await, (Some(20), 7, 7));

    sqlx::query("update job_runs set lease_until = now() + interval '1 second'")
        .execute(&pool)
        .await
        .expect("shorten the lease");
    assert_eq!(run.renew().await.expect("renew"), Fence::Passed { paused: None });
    assert_eq!(
        row(&pool).await,
        (Some(20), 7, 7),
        "a renewal moves neither cursor nor counters"
    );
    let left: f64 =
        sqlx::query_scalar("select extract(epoch from lease_until - now())::float8 from job_runs")
            .fetch_one(&pool)
            .await
            .expect("lease");
    assert!(left > 50.0, "the renewal gave the lease {left:.1} s");

    let end = run.finish(Ending::Success);
    assert!(end.send().await.expect("finish"));
    assert!(
        end.send().await.expect("finish again"),
        "a resent end is still finished"
    );
    assert_eq!(
        events(&pool).await,
        [
            ("a".to_string(), "claimed".to_string(), None),
            ("a".to_string(), "success".to_string(), Some(7)),
        ]
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn a_fenced_out_run_commits_nothing_and_records_its_lost_lease(pool: PgPool) {
    insert(&pool, &[loan(1, "2026-10-01", Some("2026-10-10"))]).await;
    let mut run = won(&pool, "a", ClaimMode::Free).await;
    assert_eq!(
        covered(&mut run, &pool, 5, 2).await,
        Fence::Passed { paused: None }
    );
    sqlx::query("update job_runs set lease_until = now() - interval '1 second'")
        .execute(&pool)
        .await
        .expect("expire");
    let peer = won(&pool, "b", ClaimMode::Free).await;
    assert_eq!(
        (peer.epoch(), peer.kind(), peer.cursor()),
        (2, ClaimKind::TakenOver, Some(5))
    );

    // A batch whose business write is followed by a fence that finds the peer: rolled back, handle unmoved.
    let mut tx = db(&pool).begin().await.expect("begin");
    sqlx::query("update loans set fine_cents = 999 where id = 1")
        .execute(&mut *tx)
        .await
        .expect("business write");
    let lost = run
        .advance(
            tx,
            Covered {
                last_id: 9,
                scanned: 1,
                updated: 1,
                corrected: 0,
            },
        )
        .await
        .expect("advance");
    assert_eq!(lost, Fence::Lost);
    assert_eq!((run.cursor(), run.scanned()), (Some(5), 2));
    let fine: i64 = sqlx::query_scalar("select fine_cents from loans where id = 1")
        .fetch_one(&pool)
        .await
        .expect("loan");
    assert_eq!(fine, 0, "the fenced batch's write rolled back");
    assert_eq!(run.renew().await.expect("renew"), Fence::Lost);

    let end = run.hand_back("stopping");
    assert!(
        !end.send().await.expect("hand back"),
        "b's key is not a's to hand back"
    );
    end.lost().record().await.expect("record");
    let status: (String, String, i64) = sqlx::query_as("select status, owner, epoch from job_runs")
        .fetch_one(&pool)
        .await
        .expect("row");
    assert_eq!(status, ("RUNNING".into(), "b".into(), 2));
    assert_eq!(
        events(&pool).await.last(),
        Some(&("a".to_string(), "lease_lost".to_string(), Some(2)))
    );
}

#[sqlx::test(fixtures("default_policy"))]
async fn the_claim_kind_is_the_one_the_history_records(pool: PgPool) {
    let run = won(&pool, "a", ClaimMode::Free).await;
    assert!(run.finish(Ending::Success).send().await.expect("finish"));
    let reopened = won(&pool, "b", ClaimMode::Reopen).await;
    assert_eq!((reopened.epoch(), reopened.kind()), (2, ClaimKind::Reopened));
    assert!(reopened.finish(Ending::Success).send().await.expect("finish"));
    let forced = won(&pool, "c", ClaimMode::Force).await;
    assert_eq!(
        (forced.epoch(), forced.kind(), forced.cursor()),
        (3, ClaimKind::Forced, None)
    );
    let recorded: Vec<String> = events(&pool).await.into_iter().map(|(_, e, _)| e).collect();
    assert_eq!(
        recorded,
        [
            ClaimKind::Inserted.event(),
            "success",
            ClaimKind::Reopened.event(),
            "success",
            ClaimKind::Forced.event()
        ]
    );
}
