//! What each Citus worker knows of its own standbys, for the throttle's lag limit on a coordinator.
//!
//! A batch's writes land on the workers, each a primary with WAL positions of its own, and the coordinator's
//! `pg_stat_replication` shows only the coordinator's standbys. So on Citus the throttle also asks every worker,
//! through the coordinator (`run_command_on_workers`, one connection to each worker in the same database), what
//! [`crate::store::replication::look`] asks the server it is connected to, and judges each node's standbys
//! against that node's own positions.
//!
//! The statement runs only on Citus (`run_command_on_workers` exists nowhere else), so it is not checked against
//! the migrations at build time; the Citus suite (`tests/it/citus/throttle.rs`) runs it.

use chrono::{DateTime, Utc};
use serde::Deserialize;

use crate::store::{
    replication::{Replication, StandbyReport},
    Db,
};

/// One worker's answer: its look, or why it could not be had (the worker is down, the statement failed there).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerLook {
    /// The worker as the coordinator's metadata names it (`host:port` of `pg_dist_node`).
    pub node: String,
    pub look: Result<Replication, String>,
}

/// [`crate::store::replication::look`]'s statement as one JSON value (`run_command_on_workers` returns a
/// command's first value as text), with the same rules: the standbys named in `%1$L` (a `text[]` literal), or
/// every physical one when it is empty; times in microseconds since the epoch.
const WORKER_LOOK: &str = r#"
    select json_build_object(
             'at_us', (extract(epoch from p.at) * 1000000)::bigint,
             'lsn', p.lsn,
             'server', p.server,
             'standbys', coalesce((
               select json_agg(json_build_object(
                        'application_name', s.application_name,
                        'name', coalesce(nullif(s.application_name, ''), 'standby')
                                || coalesce(' at ' || host(s.client_addr), '') || ' (pid ' || s.pid || ')',
                        'identity', case when s.application_name not in ('', 'walreceiver') then s.application_name
                                         else coalesce(nullif(s.application_name, ''), 'standby')
                                              || coalesce(' at ' || host(s.client_addr), '') end,
                        'replays', s.replay_lsn is not null,
                        'replay_lsn', pg_wal_lsn_diff(coalesce(s.replay_lsn, s.flush_lsn), '0/0')::bigint,
                        'reply_time_us', (extract(epoch from s.reply_time) * 1000000)::bigint,
                        'replay_lag_seconds', extract(epoch from s.replay_lag)::float8)
                      order by s.pid)
               from (select w.pid, w.application_name, w.client_addr, w.replay_lsn, w.flush_lsn, w.reply_time,
                            w.replay_lag, slot.slot_type
                     from pg_stat_replication w
                     left join pg_replication_slots slot on slot.active_pid = w.pid) s
               where (cardinality(%1$L::text[]) = 0 and s.slot_type is distinct from 'logical')
                     or s.application_name = any(%1$L::text[])), '[]'::json))::text
    from (select clock_timestamp() as at,
                 case when pg_is_in_recovery() then null
                      else pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint end as lsn,
                 case when pg_is_in_recovery() then null
                      else coalesce(host(inet_server_addr()), 'local') || ':'
                           || coalesce(inet_server_port()::text, '') || ' timeline '
                           || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) end as server) p"#;

/// How long a look waits for a worker's connection.
const WORKER_CONNECT: std::time::Duration = std::time::Duration::from_secs(3);

#[derive(Deserialize)]
struct RawLook {
    at_us: i64,
    lsn: Option<i64>,
    server: Option<String>,
    standbys: Vec<RawStandby>,
}

#[derive(Deserialize)]
struct RawStandby {
    application_name: Option<String>,
    name: Option<String>,
    identity: Option<String>,
    replays: Option<bool>,
    replay_lsn: Option<i64>,
    reply_time_us: Option<i64>,
    replay_lag_seconds: Option<f64>,
}

/// Each active worker's look at its standbys whose `application_name` is in `names` (every physical one when
/// empty), asked through the coordinator. A standby's name and identity say which worker it streams from
/// ("… of worker host:port"): the log names it so, and two workers' standbys with the same name stay apart.
///
/// A worker that does not answer its connection within [`WORKER_CONNECT`] is a failed look of its own (Citus
/// waits `citus.node_connection_timeout`, 30 s by default, for each): the batches are not held up for it.
pub async fn look_workers(pool: &Db, names: &[String]) -> Result<Vec<WorkerLook>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("select set_config('citus.node_connection_timeout', $1, true)")
        .bind(WORKER_CONNECT.as_millis().to_string())
        .execute(&mut *tx)
        .await?;
    let rows: Vec<(String, bool, Option<String>)> = sqlx::query_as(
        "select nodename || ':' || nodeport, success, result
         from run_command_on_workers(format($1, $2::text[]))
         order by nodename, nodeport",
    )
    .bind(WORKER_LOOK)
    .bind(names)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(rows
        .into_iter()
        .map(|(node, success, result)| {
            let result = result.unwrap_or_default();
            let look = if success {
                parse(&node, &result)
            } else {
                Err(result)
            };
            WorkerLook { node, look }
        })
        .collect())
}

fn micros(us: i64) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp_micros(us)
}

fn parse(node: &str, json: &str) -> Result<Replication, String> {
    let raw: RawLook = serde_json::from_str(json).map_err(|e| format!("unreadable answer ({e}): {json}"))?;
    let of = |s: String| format!("{s} of worker {node}");
    Ok(Replication {
        at: micros(raw.at_us).ok_or_else(|| format!("a time out of range: {}", raw.at_us))?,
        lsn: raw.lsn,
        server: raw.server,
        standbys: raw
            .standbys
            .into_iter()
            .map(|s| StandbyReport {
                application_name: s.application_name.unwrap_or_default(),
                name: of(s.name.unwrap_or_else(|| "standby".into())),
                identity: of(s.identity.unwrap_or_else(|| "standby".into())),
                replays: s.replays.unwrap_or(false),
                replay_lsn: s.replay_lsn,
                reply_time: s.reply_time_us.and_then(micros),
                replay_lag_seconds: s.replay_lag_seconds,
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_answer_names_its_standbys_by_the_worker() {
        let json = r#"{"at_us": 1764900000123456, "lsn": 50331648, "server": "127.0.0.1:54361 timeline 00000001",
            "standbys": [{"application_name": "walreceiver", "name": "walreceiver at 127.0.0.1 (pid 7)",
            "identity": "walreceiver at 127.0.0.1", "replays": true, "replay_lsn": 50331000,
            "reply_time_us": 1764900000000000, "replay_lag_seconds": null}]}"#;
        let look = parse("127.0.0.1:54361", json).expect("parsed");
        assert_eq!(look.at.timestamp_micros(), 1_764_900_000_123_456);
        assert_eq!(look.lsn, Some(50_331_648));
        let standby = &look.standbys[0];
        assert_eq!(standby.application_name, "walreceiver");
        assert_eq!(
            standby.name,
            "walreceiver at 127.0.0.1 (pid 7) of worker 127.0.0.1:54361"
        );
        assert_eq!(
            standby.identity,
            "walreceiver at 127.0.0.1 of worker 127.0.0.1:54361"
        );
        assert_eq!(standby.replay_lsn, Some(50_331_000));
        assert_eq!(
            standby.reply_time.map(|t| t.timestamp_micros()),
            Some(1_764_900_000_000_000)
        );
        assert!(parse("w", "not json").is_err());
        let empty = parse(
            "w",
            r#"{"at_us": 0, "lsn": null, "server": null, "standbys": []}"#,
        )
        .expect("parsed");
        assert!(empty.standbys.is_empty() && empty.lsn.is_none());
    }
}
