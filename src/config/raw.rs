//! The configuration as its sources spell it: every key present (the defaults layer has them all), nothing
//! checked yet beyond its TOML type.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Settings;

/// The raw, merged configuration as the sources spell it; every key is present thanks to the defaults layer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSettings {
    pub database: RawDatabase,
    pub instance: RawInstance,
    pub schedule: RawSchedule,
    pub time: RawTime,
    pub claim: RawClaim,
    pub settlement: RawSettlement,
    pub accrual: RawAccrual,
    pub fine: RawFine,
    pub log: RawLog,
    pub http: RawHttp,
    pub throttle: RawThrottle,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDatabase {
    pub url: String,
    pub max_connections: i64,
    pub connect_timeout: String,
    pub pooler: String,
    pub engine: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawInstance {
    pub shard: i64,
    pub shards: i64,
    pub shard_from: String,
    pub pod_index_env: String,
    pub pod_name_env: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSchedule {
    pub mode: String,
    pub period: String,
    pub cron: String,
    pub max_catch_up: i64,
    pub drain_timeout: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTime {
    pub zone: String,
    pub source: String,
    pub max_skew: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClaim {
    pub lease: String,
    /// Unset: derived from the lease ([`super::derived_batch_timeout`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_timeout: Option<String>,
    /// Unset: derived from the batch timeout ([`super::derived_lock_timeout`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_timeout: Option<String>,
    pub history_retention: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSettlement {
    pub enabled: bool,
    pub batch_size: i64,
    pub catch_up_months: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAccrual {
    pub enabled: bool,
    pub batch_size: i64,
    pub catch_up_days: i64,
    pub max_attempts: i64,
    pub retry_backoff: String,
    pub retry_backoff_max: String,
    pub recheck_every: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFine {
    pub daily_rate_cents: i64,
    pub grace_days: i64,
    pub cap_cents: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLog {
    pub format: String,
    pub level: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHttp {
    pub listen: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawThrottle {
    pub max_rows_per_second: i64,
    pub max_commit_latency: String,
    pub max_replica_lag: String,
    pub standbys: Vec<String>,
    pub batch_duration: String,
}

impl RawSettings {
    /// The effective configuration as TOML, with the database password redacted and the derived claim timeouts
    /// written out (`settings` is this configuration, validated).
    pub fn to_redacted_toml(&self, settings: &Settings) -> String {
        let mut shown = self.clone();
        shown.database.url = crate::redact::url(&shown.database.url);
        let text = |d: Duration| humantime::format_duration(d).to_string();
        shown.claim.batch_timeout = Some(text(settings.claim.lease.batch_timeout()));
        shown.claim.lock_timeout = Some(text(settings.claim.lease.lock_timeout()));
        // The shard the replica will run: with `shard_from` a pod's index or name, not the file's `shard`.
        shown.instance.shard = i64::from(settings.instance.shard());
        shown.instance.shards = i64::from(settings.instance.shards());
        toml::to_string_pretty(&shown).unwrap_or_else(|e| format!("# cannot render configuration: {e}\n"))
    }
}
