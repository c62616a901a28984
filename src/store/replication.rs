//! What the primary knows of its standbys (`pg_stat_replication`), for the throttle's lag limit.

use chrono::{DateTime, Utc};

use crate::store::Db;

/// One standby's last report, as the primary saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct StandbyReport {
    /// The walsender's pid: a standby that reconnects is a new one.
    pub pid: i32,
    /// `application_name` (the standby's `cluster_name` by default) and address, for the log.
    pub name: String,
    /// The last replay position it reported (`None`: none yet).
    pub replay_lsn: Option<String>,
    /// WAL bytes the primary has written that it has not replayed, by that report.
    pub unreplayed_bytes: Option<i64>,
    /// WAL bytes it had received (flushed) but not replayed when it sent that report.
    pub received_unreplayed_bytes: Option<i64>,
    /// `replay_lag`: how old the WAL it last replayed was when it replayed it.
    pub replay_lag_seconds: Option<f64>,
    /// When the standby sent that report (its own clock).
    pub reply_time: Option<DateTime<Utc>>,
}

/// Whether this role may read the standbys' positions: `pg_stat_replication` shows them only to superusers and
/// members of `pg_read_all_stats` (which `pg_monitor` includes).
pub async fn can_read_positions(pool: &Db) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(r#"select pg_has_role('pg_read_all_stats', 'usage') as "readable!""#)
        .fetch_one(pool)
        .await
}

/// Every standby streaming from this server, with its last report. Empty on a standby itself.
pub async fn standbys(pool: &Db) -> Result<Vec<StandbyReport>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"select pid as "pid!",
                  coalesce(nullif(application_name, ''), 'standby') || coalesce(' at ' || host(client_addr), '')
                      as "name!",
                  replay_lsn::text as replay_lsn,
                  case when pg_is_in_recovery() then null
                       else pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint end as unreplayed_bytes,
                  pg_wal_lsn_diff(flush_lsn, replay_lsn)::bigint as received_unreplayed_bytes,
                  extract(epoch from replay_lag)::float8 as replay_lag_seconds,
                  reply_time
           from pg_stat_replication
           order by pid"#
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| StandbyReport {
            pid: r.pid,
            name: r.name,
            replay_lsn: r.replay_lsn,
            unreplayed_bytes: r.unreplayed_bytes,
            received_unreplayed_bytes: r.received_unreplayed_bytes,
            replay_lag_seconds: r.replay_lag_seconds,
            reply_time: r.reply_time,
        })
        .collect())
}
