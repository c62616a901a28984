//! What the primary knows of its standbys (`pg_stat_replication`), for the throttle's lag limit.

use chrono::{DateTime, Utc};

use crate::store::Db;

/// One look at the primary: its WAL position and clock, and every standby's last report.
#[derive(Debug, Clone, PartialEq)]
pub struct Replication {
    /// `clock_timestamp()` of the primary when it was asked.
    pub at: DateTime<Utc>,
    /// Its WAL insert position, in bytes from `0/0` (`None` on a server in recovery).
    pub lsn: Option<i64>,
    /// Which server and timeline that position is on (address, port, timeline): a failover changes it, even
    /// behind a pooler or a virtual address.
    pub server: Option<String>,
    pub standbys: Vec<StandbyReport>,
}

/// One standby's last report, as the primary saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct StandbyReport {
    /// Its `application_name`, as `throttle.standbys` names it.
    pub application_name: String,
    /// `application_name` (the standby's `cluster_name` by default), address and walsender pid, for the log.
    pub name: String,
    /// The same standby after it reconnects: its `application_name` when it has its own (a standby's
    /// `cluster_name`, as `throttle.standbys` names it), else with its address (`walreceiver`, the default, is
    /// shared by every standby without a `cluster_name`).
    pub identity: String,
    /// Whether it reports a replay position of its own (a standby, a subscription), as opposed to a client
    /// that only receives WAL (`pg_basebackup`, `pg_receivewal`).
    pub replays: bool,
    /// The replay position of its last report, in bytes from `0/0` (`None`: no report yet, or hidden from this
    /// role); for a logical consumer that reports no apply position (`pg_recvlogical`), what it has flushed.
    pub replay_lsn: Option<i64>,
    /// When the standby sent that report (its own clock).
    pub reply_time: Option<DateTime<Utc>>,
    /// `replay_lag`, for the log only (see [`crate::jobs::throttle`] on why it is not the rule).
    pub replay_lag_seconds: Option<f64>,
}

/// Whether this role may read the standbys' positions: `pg_stat_replication` shows them only to superusers and
/// members of `pg_read_all_stats` (which `pg_monitor` includes).
pub async fn can_read_positions(pool: &Db) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(r#"select pg_has_role('pg_read_all_stats', 'usage') as "readable!""#)
        .fetch_one(pool)
        .await
}

/// The primary's position and the standbys streaming from it whose `application_name` is in `names` — when
/// `names` is empty, every physical standby: a logical walsender's `replay_lsn` is what its subscriber confirmed,
/// which a healthy subscriber may do only every half minute, so logical ones count only when named. No standbys
/// on a standby itself (a cascade is not followed).
pub async fn look(pool: &Db, names: &[String]) -> Result<Replication, sqlx::Error> {
    let rows = sqlx::query!(
        r#"select p.at as "at!", p.lsn, p.server,
                  s.pid as "pid?",
                  s.application_name as "application_name?",
                  coalesce(nullif(s.application_name, ''), 'standby') || coalesce(' at ' || host(s.client_addr), '')
                      || ' (pid ' || s.pid || ')' as name,
                  case when s.application_name not in ('', 'walreceiver') then s.application_name
                       else coalesce(nullif(s.application_name, ''), 'standby')
                            || coalesce(' at ' || host(s.client_addr), '') end as identity,
                  s.replay_lsn is not null as replays,
                  pg_wal_lsn_diff(coalesce(s.replay_lsn, s.flush_lsn), '0/0')::bigint as replay_lsn,
                  s.reply_time,
                  extract(epoch from s.replay_lag)::float8 as replay_lag_seconds
           from (select clock_timestamp() as at,
                        case when pg_is_in_recovery() then null
                             else pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint end as lsn,
                        case when pg_is_in_recovery() then null
                             else coalesce(host(inet_server_addr()), 'local') || ':'
                                  || coalesce(inet_server_port()::text, '') || ' timeline '
                                  || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) end as server) p
           left join (select w.pid, w.application_name, w.client_addr, w.replay_lsn, w.flush_lsn, w.reply_time,
                             w.replay_lag,
                             slot.slot_type
                      from pg_stat_replication w
                      left join pg_replication_slots slot on slot.active_pid = w.pid) s
                  on (cardinality($1::text[]) = 0 and s.slot_type is distinct from 'logical')
                     or s.application_name = any($1::text[])
           order by s.pid"#,
        names
    )
    .fetch_all(pool)
    .await?;
    let at = rows.first().map(|r| r.at).unwrap_or_else(Utc::now);
    let lsn = rows.first().and_then(|r| r.lsn);
    let server = rows.first().and_then(|r| r.server.clone());
    let standbys = rows
        .into_iter()
        .filter(|r| r.pid.is_some())
        .map(|r| StandbyReport {
            application_name: r.application_name.unwrap_or_default(),
            name: r.name.unwrap_or_else(|| "standby".into()),
            identity: r.identity.unwrap_or_else(|| "standby".into()),
            replays: r.replays.unwrap_or(false),
            replay_lsn: r.replay_lsn,
            reply_time: r.reply_time,
            replay_lag_seconds: r.replay_lag_seconds,
        })
        .collect();
    Ok(Replication {
        at,
        lsn,
        server,
        standbys,
    })
}
