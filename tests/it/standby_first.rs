//! A multi-host URL without `target_session_attrs` whose first host is a standby (the routine layout after a
//! failover, once the old primary is rebuilt as a standby): the standby does not hold the replica, which moves on
//! to the writable host and settles every loan, as with `read-write`.

use std::time::Duration;

use chrono::Datelike;
use sqlx::{postgres::PgPoolOptions, PgPool};

use crate::helpers::{daemon, due_now, insert, loan, migrate, oracle, settled, stop, wait_until, Cluster};

#[tokio::test]
async fn a_standby_listed_first_does_not_hold_a_replica_without_target_session_attrs() {
    let primary = Cluster::primary_with_libraryd().await;
    migrate(&primary.url("libraryd"));
    let pool: PgPool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&primary.url("libraryd"))
        .await
        .expect("connect to the primary");
    let month = due_now(&pool, 1).await[0];
    let first = month.with_day(1).expect("first day").to_string();
    let loans: Vec<_> = (1..=300)
        .map(|n| loan(n, &first, Some(&month.to_string())))
        .collect();
    insert(&pool, &loans).await;
    let standby = primary.standby().await;
    standby.wait_replayed(&primary).await;
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/libraryd?connect_timeout=2",
        standby.port(),
        primary.port()
    );
    let replica = daemon(&url, 0, 1, &[("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1")]);
    let month_end = month.to_string();
    wait_until(
        "every loan settled on the primary",
        Duration::from_secs(30),
        || async { settled(&pool, &month_end).await == oracle(&pool, &month_end).await },
    )
    .await;
    let (code, stderr) = stop(replica).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("switching to the next qualifying host"),
        "{stderr}"
    );
}
