//! What the failover and replica-lag tests rely on, shown on real servers started by [`Cluster`]: a standby
//! replays the primary's writes and refuses its own, and catches up after a restart; a standby whose replay is
//! paused shows on the primary as a WAL distance (and a `replay_lag`) that grows until replay resumes; and a
//! standby promoted after its primary crashed takes writes and keeps what was replicated. No fine-settler code
//! runs here.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use crate::helpers::Cluster;

/// The primary's view of `standby` in `pg_stat_replication`: how many bytes of WAL the primary has written that
/// the standby has not replayed, and `replay_lag` in seconds (null when none was measured recently).
async fn replication(primary: &mut PgConnection, standby: &Cluster) -> (i64, Option<f64>) {
    sqlx::query_as(
        "select pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint,
                extract(epoch from replay_lag)::float8
         from pg_stat_replication where application_name = $1",
    )
    .bind(standby.name())
    .fetch_one(primary)
    .await
    .expect("the standby's row in pg_stat_replication")
}

async fn count(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar("select count(*) from shelf")
        .fetch_one(conn)
        .await
        .expect("count shelf")
}

async fn in_recovery(conn: &mut PgConnection) -> bool {
    sqlx::query_scalar("select pg_is_in_recovery()")
        .fetch_one(conn)
        .await
        .expect("pg_is_in_recovery()")
}

/// A primary with a table `shelf (id, title)` and a streaming standby that has replayed it.
async fn primary_and_standby() -> (Cluster, Cluster, PgConnection) {
    let primary = Cluster::primary().await;
    let standby = primary.standby().await;
    let mut conn = primary.connect().await;
    sqlx::query("create table shelf (id bigint primary key, title text not null)")
        .execute(&mut conn)
        .await
        .expect("create table");
    standby.wait_replayed(&primary).await;
    (primary, standby, conn)
}

#[tokio::test]
async fn a_standby_replays_the_primarys_writes_and_refuses_its_own() {
    let started = Instant::now();
    let (primary, standby, mut p) = primary_and_standby().await;
    sqlx::query("insert into shelf values (1, 'Middlemarch')")
        .execute(&mut p)
        .await
        .expect("insert on the primary");
    standby.wait_replayed(&primary).await;

    let mut s = standby.connect().await;
    let title: String = sqlx::query_scalar("select title from shelf where id = 1")
        .fetch_one(&mut s)
        .await
        .expect("the row on the standby");
    assert_eq!(title, "Middlemarch");
    let refused = sqlx::query("insert into shelf values (2, 'Ulysses')")
        .execute(&mut s)
        .await
        .expect_err("a standby refuses writes");
    assert_eq!(
        refused.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("25006"),
        "read_only_sql_transaction: {refused}"
    );
    assert!(in_recovery(&mut s).await, "the standby is in recovery");
    assert!(!in_recovery(&mut p).await, "the primary is not");
    s.close().await.expect("close");

    // Stopped, nothing listens on the standby's port; started again, it comes back on that port and catches up
    // with what it missed.
    standby.stop_fast().await;
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", standby.port())).is_err(),
        "the stopped standby still listens"
    );
    sqlx::query("insert into shelf values (2, 'Ulysses')")
        .execute(&mut p)
        .await
        .expect("insert while the standby is down");
    standby.start().await;
    standby.wait_replayed(&primary).await;
    assert_eq!(count(&mut standby.connect().await).await, 2);

    // Dropped, a server is gone: nothing listens on its port (a server whose folder was removed under it still
    // would, failing only the connections), and its folder is removed.
    let (port, dir) = (standby.port(), standby.dir().to_owned());
    drop(standby);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the dropped standby still listens on {port}"
    );
    assert!(!dir.exists(), "{} is still there", dir.display());
    eprintln!(
        "replication: standby replays and refuses writes in {:?}",
        started.elapsed()
    );
}

/// What a replica-lag throttle would read on the primary. The distance grows with every write the paused standby
/// does not replay. `replay_lag` does not stand still: PostgreSQL 15's walsender reports a stuck replay position
/// as a lag that grows with the time since the first WAL the standby has not replayed (it interpolates from its
/// samples), refreshed on each of the standby's reports — whenever WAL arrives, and every
/// `wal_receiver_status_interval` (1 s in these clusters, 10 s by default), keeping its last value in between.
/// Once replay has caught up, the distance is 0 while `replay_lag` still shows its last measurement, until the
/// standby has reported itself fully replayed twice; then it is NULL.
#[tokio::test]
async fn paused_replay_shows_on_the_primary_as_a_growing_wal_distance_and_replay_lag() {
    let started = Instant::now();
    let (primary, standby, mut p) = primary_and_standby().await;
    sqlx::query("insert into shelf select i, 'copy ' || i from generate_series(1, 100) i")
        .execute(&mut p)
        .await
        .expect("insert");
    standby.wait_replayed(&primary).await;
    let before = replication(&mut p, &standby).await;
    eprintln!("replication: before the pause (distance, replay_lag) = {before:?}");
    assert_eq!(before.0, 0, "caught up before the pause");

    let paused = Instant::now();
    standby.pause_replay().await;
    let mut samples = Vec::new();
    for round in 1..=10_i64 {
        sqlx::query("insert into shelf select i, 'copy ' || i from generate_series($1, $1 + 99) i")
            .bind(round * 100 + 1)
            .execute(&mut p)
            .await
            .expect("insert while replay is paused");
        tokio::time::sleep(Duration::from_millis(200)).await;
        samples.push(replication(&mut p, &standby).await);
    }
    let paused_for = paused.elapsed().as_secs_f64();
    eprintln!("replication: {paused_for:.2} s paused, samples (distance, replay_lag) = {samples:?}");
    let distances: Vec<i64> = samples.iter().map(|s| s.0).collect();
    assert!(distances[0] > 0, "{distances:?}");
    assert!(
        distances.windows(2).all(|w| w[0] < w[1]),
        "the distance grows with every write and never shrinks while paused: {distances:?}"
    );
    let lags: Vec<f64> = samples.iter().filter_map(|s| s.1).collect();
    assert!(
        lags.windows(2).all(|w| w[0] <= w[1]),
        "replay_lag never shrinks while paused: {lags:?}"
    );
    let last = samples
        .last()
        .and_then(|s| s.1)
        .expect("a replay_lag while paused");
    assert!(
        (0.5..=paused_for + 0.1).contains(&last),
        "replay_lag grows with the pause: {last} s after {paused_for:.2} s paused"
    );
    assert_eq!(
        count(&mut standby.connect().await).await,
        100,
        "nothing replayed while paused"
    );

    standby.resume_replay().await;
    let resumed = Instant::now();
    let caught_up = poll_replication(&mut p, &standby, "a distance of 0", |s| s.0 == 0).await;
    eprintln!(
        "replication: distance 0 {:?} after resume, replay_lag then {:?}",
        resumed.elapsed(),
        caught_up.1
    );
    assert_eq!(count(&mut standby.connect().await).await, 1100);
    poll_replication(&mut p, &standby, "replay_lag NULL", |s| s.1.is_none()).await;
    eprintln!(
        "replication: replay_lag NULL {:?} after resume",
        resumed.elapsed()
    );
    eprintln!("replication: paused replay in {:?}", started.elapsed());
}

/// Polls the primary's view of `standby` every 50 ms until `done` holds (at most 30 s); returns that view.
async fn poll_replication(
    primary: &mut PgConnection,
    standby: &Cluster,
    what: &str,
    done: impl Fn(&(i64, Option<f64>)) -> bool,
) -> (i64, Option<f64>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let sample = replication(primary, standby).await;
        if done(&sample) {
            return sample;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: (distance, replay_lag) = {sample:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_standby_promoted_after_its_primary_crashed_takes_writes_and_keeps_what_was_replicated() {
    let started = Instant::now();
    let (primary, standby, mut p) = primary_and_standby().await;
    sqlx::query("insert into shelf values (1, 'committed before the crash')")
        .execute(&mut p)
        .await
        .expect("insert on the primary");
    standby.wait_replayed(&primary).await;

    primary.stop_immediate().await;
    // Down: its postmaster left its folder (a connection to its port could reach another test's new server).
    assert!(
        !primary.dir().join("postmaster.pid").exists(),
        "the primary is down"
    );
    assert!(
        primary.log().contains("received immediate shutdown request"),
        "{}",
        primary.log()
    );
    standby.promote().await;

    let mut s = standby.connect().await;
    assert!(!in_recovery(&mut s).await, "promoted");
    sqlx::query("insert into shelf values (2, 'written after the promotion')")
        .execute(&mut s)
        .await
        .expect("the promoted standby takes writes");
    let titles: Vec<String> = sqlx::query_scalar("select title from shelf order by id")
        .fetch_all(&mut s)
        .await
        .expect("read");
    assert_eq!(
        titles,
        ["committed before the crash", "written after the promotion"]
    );
    assert!(
        standby.log().contains("selected new timeline ID"),
        "{}",
        standby.log()
    );
    eprintln!("replication: failover in {:?}", started.elapsed());
}
