//! Configuration: raw layered settings (built-in defaults, the replica's TOML file, environment) and their
//! validation into typed [`Settings`], once, at start.
//!
//! Layers, lowest first: `config/default.toml` (compiled in), `--config FILE`, `FINE_SETTLER__SECTION__KEY`
//! variables, and `DATABASE_URL` for `database.url`. Unknown keys are errors, so a typo never silently falls
//! back to a default. Validation reports every problem at once, one line per problem naming its key; nothing
//! touches the database before it has passed.

use std::{collections::HashMap, net::SocketAddr, path::Path, str::FromStr, time::Duration};

use chrono_tz::Tz;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgConnectOptions;

use crate::{
    fine::{FinePolicy, PolicyError},
    shard::{ShardError, ShardSpec},
};

/// The built-in base layer: every key with its documented default.
pub const DEFAULTS_TOML: &str = include_str!("../config/default.toml");

/// Prefix of the environment variables that override keys: `FINE_SETTLER__SECTION__KEY`.
pub const ENV_PREFIX: &str = "FINE_SETTLER";

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
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDatabase {
    pub url: String,
    pub max_connections: i64,
    pub connect_timeout: String,
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
    /// Unset: derived from the lease ([`derived_batch_timeout`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_timeout: Option<String>,
    /// Unset: derived from the batch timeout ([`derived_lock_timeout`]).
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

/// One invalid value: the key it belongs to and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub key: &'static str,
    pub message: String,
}

/// Why the configuration could not be used. Either way the process exits with code 2 before any database
/// access.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A source could not be read or parsed: a missing file, TOML syntax, a value of the wrong type, an
    /// unknown key. The message names the key or file.
    #[error("invalid configuration: {0}")]
    Load(String),
    /// Values that parsed but are out of range or inconsistent; each names its key.
    #[error("{}", render_problems(.0))]
    Invalid(Vec<Problem>),
}

impl ConfigError {
    /// One line per problem, each naming its key.
    pub fn lines(&self) -> Vec<String> {
        match self {
            ConfigError::Load(_) => vec![self.to_string()],
            ConfigError::Invalid(problems) => problems.iter().map(render_problem).collect(),
        }
    }
}

fn render_problem(p: &Problem) -> String {
    format!("invalid configuration: {}: {}", p.key, p.message)
}

fn render_problems(problems: &[Problem]) -> String {
    problems.iter().map(render_problem).collect::<Vec<_>>().join("\n")
}

/// Reads the layers. `env` is the process environment (passed in so tests can give their own).
pub fn load(file: Option<&Path>, env: &HashMap<String, String>) -> Result<RawSettings, ConfigError> {
    use config::{Config, Environment, File, FileFormat};

    let mut builder = Config::builder().add_source(File::from_str(DEFAULTS_TOML, FileFormat::Toml));
    if let Some(path) = file {
        if !path.is_file() {
            return Err(ConfigError::Load(format!(
                "config file {} does not exist",
                path.display()
            )));
        }
        builder = builder.add_source(File::from(path).format(FileFormat::Toml).required(true));
    }
    let prefixed: config::Map<String, String> = env
        .iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    builder = builder.add_source(
        Environment::with_prefix(ENV_PREFIX)
            .prefix_separator("__")
            .separator("__")
            .source(Some(prefixed)),
    );
    if let Some(url) = env.get("DATABASE_URL").filter(|u| !u.is_empty()) {
        builder = builder
            .set_override("database.url", url.as_str())
            .map_err(|e| ConfigError::Load(e.to_string()))?;
    }
    builder
        .build()
        .and_then(|c| c.try_deserialize::<RawSettings>())
        .map_err(|e| ConfigError::Load(redact_secrets_in(&e.to_string())))
}

/// How the daemon's scheduler produces ticks.
#[derive(Debug, Clone)]
pub enum ScheduleMode {
    /// Ticks on a UTC grid of this period, anchored at the Unix epoch.
    FixedRate(Duration),
    /// Waits this long after each tick ends.
    FixedDelay(Duration),
    /// Ticks when the expression matches, in the configured zone.
    Cron(Box<croner::Cron>),
}

#[derive(Debug, Clone)]
pub struct ScheduleSettings {
    pub mode: ScheduleMode,
    pub max_catch_up: u32,
    /// After a shutdown signal, how long the daemon may take to finish its batch and hand its key back.
    pub drain_timeout: Duration,
}

/// Where a tick reads the time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeSource {
    Database,
    System,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Json,
    Pretty,
}

#[derive(Debug, Clone)]
pub struct DatabaseSettings {
    /// The URL, with its password; print it only through [`redact_url`].
    pub url: String,
    pub max_connections: u32,
    pub connect_timeout: Duration,
}

#[derive(Debug, Clone, Copy)]
pub struct ClaimSettings {
    /// How long a claim stays valid without progress.
    pub lease: Duration,
    /// The statement timeout of every batch; always shorter than `lease`.
    pub batch_timeout: Duration,
    /// How long a batch statement waits for a row lock (libraryd's, or another run's) before it leaves the row
    /// for later; always shorter than `batch_timeout`, so a lock wait never fails a batch.
    pub lock_timeout: Duration,
    /// How long `job_run_attempts` rows are kept.
    pub history_retention: Duration,
}

#[derive(Debug, Clone, Copy)]
pub struct SettlementSettings {
    pub enabled: bool,
    pub batch_size: u32,
    pub catch_up_months: u32,
}

#[derive(Debug, Clone, Copy)]
pub struct AccrualSettings {
    pub enabled: bool,
    pub batch_size: u32,
    pub catch_up_days: u32,
    pub max_attempts: u32,
    /// Delay before the first retry of a failed charge; doubled per attempt up to `retry_backoff_max`.
    pub retry_backoff: Duration,
    pub retry_backoff_max: Duration,
    /// How often a tick also asks whether loans became overdue on accrual days that already succeeded (a loan
    /// recorded late, a due date shortened). The question walks the overdue loans still out, so unlike
    /// settlement's it is not asked at every tick.
    pub recheck_every: Duration,
}

/// The validated configuration. Holding one means every value is in range.
#[derive(Debug, Clone)]
pub struct Settings {
    pub database: DatabaseSettings,
    pub instance: ShardSpec,
    pub schedule: ScheduleSettings,
    pub zone: Tz,
    pub time_source: TimeSource,
    /// Warn when the host clock and the database clock differ by more than this.
    pub max_skew: Duration,
    pub claim: ClaimSettings,
    pub settlement: SettlementSettings,
    pub accrual: AccrualSettings,
    pub fine: FinePolicy,
    pub log_format: LogFormat,
    pub log_level: String,
    pub http_listen: Option<SocketAddr>,
}

/// The largest batch accepted: a batch is one transaction holding its rows' locks until commit.
pub const MAX_BATCH_SIZE: i64 = 100_000;

/// Collects problems while validating, so that all of them are reported together.
struct Checker {
    problems: Vec<Problem>,
}

impl Checker {
    fn fail(&mut self, key: &'static str, message: impl Into<String>) {
        self.problems.push(Problem {
            key,
            message: message.into(),
        });
    }

    fn check<T, E: std::fmt::Display>(&mut self, key: &'static str, r: Result<T, E>) -> Option<T> {
        r.map_err(|e| self.fail(key, e.to_string())).ok()
    }

    fn duration(&mut self, key: &'static str, text: &str) -> Option<Duration> {
        match humantime::parse_duration(text) {
            Ok(d) if d.is_zero() => {
                self.fail(key, format!("{text:?} must be longer than zero"));
                None
            }
            Ok(d) => Some(d),
            Err(e) => {
                self.fail(
                    key,
                    format!("{text:?} is not a duration ({e}); use e.g. \"500ms\", \"90s\", \"5m\""),
                );
                None
            }
        }
    }

    fn int_in(&mut self, key: &'static str, value: i64, range: std::ops::RangeInclusive<i64>) -> Option<u32> {
        if range.contains(&value) {
            u32::try_from(value).ok()
        } else {
            self.fail(
                key,
                format!(
                    "must be between {} and {}, got {value}",
                    range.start(),
                    range.end()
                ),
            );
            None
        }
    }
}

impl RawSettings {
    /// Validates every value; on failure returns all problems found. `env` is read for the shard when
    /// `instance.shard_from` names a pod index or pod name variable.
    pub fn validate(&self, env: &HashMap<String, String>) -> Result<Settings, ConfigError> {
        let mut c = Checker { problems: Vec::new() };

        let url = self.database.url.trim().to_string();
        if url.is_empty() {
            c.fail(
                "database.url",
                "is empty; set it in the config file or in DATABASE_URL",
            );
        } else if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            c.fail(
                "database.url",
                format!(
                    "{} must start with postgres:// or postgresql://",
                    redact_url(&url)
                ),
            );
        } else if let Err(e) = PgConnectOptions::from_str(&url) {
            c.fail(
                "database.url",
                format!(
                    "{} is not a valid URL: {}",
                    redact_url(&url),
                    redact_secrets_in(&e.to_string())
                ),
            );
        }
        let max_connections = c.int_in("database.max_connections", self.database.max_connections, 1..=100);
        let connect_timeout = c.duration("database.connect_timeout", &self.database.connect_timeout);

        let shard = match self.instance.shard_from.as_str() {
            "config" => Some(self.instance.shard),
            "pod-index" => {
                let var = &self.instance.pod_index_env;
                match env.get(var).map(|v| v.trim().parse::<i64>()) {
                    Some(Ok(index)) => Some(index),
                    Some(Err(_)) => {
                        c.fail(
                            "instance.shard_from",
                            format!("pod-index: {var}={:?} is not a number", env[var]),
                        );
                        None
                    }
                    None => {
                        c.fail(
                            "instance.shard_from",
                            format!("pod-index: environment variable {var} is not set"),
                        );
                        None
                    }
                }
            }
            "pod-name" => {
                let var = &self.instance.pod_name_env;
                match env.get(var) {
                    Some(name) => {
                        match pod_ordinal(name) {
                            Some(ordinal) => Some(ordinal),
                            None => {
                                c.fail(
                                "instance.shard_from",
                                format!("pod-name: {var}={name:?} does not end in -ORDINAL (e.g. fine-settler-2)"),
                            );
                                None
                            }
                        }
                    }
                    None => {
                        c.fail(
                            "instance.shard_from",
                            format!("pod-name: environment variable {var} is not set"),
                        );
                        None
                    }
                }
            }
            other => {
                c.fail(
                    "instance.shard_from",
                    format!("{other:?} is not one of config, pod-index, pod-name"),
                );
                None
            }
        };
        let instance = match shard.map(|shard| ShardSpec::new(shard, self.instance.shards)) {
            None => None,
            Some(Ok(spec)) => Some(spec),
            Some(Err(e @ ShardError::Shards(_))) => {
                c.fail("instance.shards", e.to_string());
                None
            }
            Some(Err(e @ ShardError::Shard { .. })) => {
                c.fail("instance.shard", e.to_string());
                None
            }
        };

        let period = c.duration("schedule.period", &self.schedule.period);
        let mode = match self.schedule.mode.as_str() {
            "fixed-rate" => period.map(ScheduleMode::FixedRate),
            "fixed-delay" => period.map(ScheduleMode::FixedDelay),
            "cron" => c
                .check("schedule.cron", croner::Cron::from_str(&self.schedule.cron))
                .map(|cron| ScheduleMode::Cron(Box::new(cron))),
            other => {
                c.fail(
                    "schedule.mode",
                    format!("{other:?} is not one of fixed-rate, fixed-delay, cron"),
                );
                None
            }
        };
        let max_catch_up = c.int_in("schedule.max_catch_up", self.schedule.max_catch_up, 0..=1_000_000);
        let drain_timeout = c.duration("schedule.drain_timeout", &self.schedule.drain_timeout);

        let zone = match self.time.zone.parse::<Tz>() {
            Ok(zone) => Some(zone),
            Err(_) => {
                c.fail(
                    "time.zone",
                    format!(
                        "{:?} is not an IANA time zone (e.g. \"Asia/Shanghai\")",
                        self.time.zone
                    ),
                );
                None
            }
        };
        let time_source = match self.time.source.as_str() {
            "database" => Some(TimeSource::Database),
            "system" => Some(TimeSource::System),
            other => {
                c.fail("time.source", format!("{other:?} is not one of database, system"));
                None
            }
        };

        let max_skew = c.duration("time.max_skew", &self.time.max_skew);

        let lease = c.duration("claim.lease", &self.claim.lease);
        let explicit_batch = self
            .claim
            .batch_timeout
            .as_deref()
            .map(|t| c.duration("claim.batch_timeout", t));
        let explicit_lock = self
            .claim
            .lock_timeout
            .as_deref()
            .map(|t| c.duration("claim.lock_timeout", t));
        let history_retention = c.duration("claim.history_retention", &self.claim.history_retention);
        if history_retention.is_some_and(|r| r < Duration::from_secs(3600)) {
            c.fail("claim.history_retention", "must be at least 1h");
        }
        let batch_timeout = match explicit_batch {
            Some(explicit) => explicit,
            None => lease.map(derived_batch_timeout),
        };
        let lock_timeout = match explicit_lock {
            Some(explicit) => explicit,
            None => batch_timeout.map(derived_lock_timeout),
        };
        if let (Some(lease), Some(batch_timeout)) = (lease, batch_timeout) {
            // A batch renews the lease when it commits; a lease shorter than the longest batch would let a peer
            // take over a replica that is still working. Only explicit values can contradict each other.
            if lease <= batch_timeout {
                c.fail(
                    "claim.lease",
                    format!(
                        "{} must be longer than claim.batch_timeout ({})",
                        humantime::format_duration(lease),
                        humantime::format_duration(batch_timeout)
                    ),
                );
            }
        }
        if let (Some(batch_timeout), Some(lock_timeout)) = (batch_timeout, lock_timeout) {
            // A lock wait must end well inside the batch, so that the batch can leave the row and commit the rest.
            if lock_timeout >= batch_timeout {
                c.fail(
                    "claim.lock_timeout",
                    format!(
                        "{} must be shorter than claim.batch_timeout ({})",
                        humantime::format_duration(lock_timeout),
                        humantime::format_duration(batch_timeout)
                    ),
                );
            }
        }

        let settlement_batch = c.int_in(
            "settlement.batch_size",
            self.settlement.batch_size,
            1..=MAX_BATCH_SIZE,
        );
        let catch_up_months = c.int_in(
            "settlement.catch_up_months",
            self.settlement.catch_up_months,
            1..=120,
        );
        let accrual_batch = c.int_in("accrual.batch_size", self.accrual.batch_size, 1..=MAX_BATCH_SIZE);
        let catch_up_days = c.int_in("accrual.catch_up_days", self.accrual.catch_up_days, 1..=3660);
        let max_attempts = c.int_in("accrual.max_attempts", self.accrual.max_attempts, 1..=1000);
        let retry_backoff = c.duration("accrual.retry_backoff", &self.accrual.retry_backoff);
        let retry_backoff_max = c.duration("accrual.retry_backoff_max", &self.accrual.retry_backoff_max);
        let recheck_every = c.duration("accrual.recheck_every", &self.accrual.recheck_every);
        if let (Some(base), Some(max)) = (retry_backoff, retry_backoff_max) {
            if max < base {
                c.fail(
                    "accrual.retry_backoff_max",
                    "must not be shorter than accrual.retry_backoff",
                );
            }
        }

        let fine = match FinePolicy::new(
            self.fine.daily_rate_cents,
            self.fine.grace_days,
            self.fine.cap_cents,
        ) {
            Ok(policy) => Some(policy),
            Err(e) => {
                let key = match e {
                    PolicyError::Rate(_) => "fine.daily_rate_cents",
                    PolicyError::Grace(_) => "fine.grace_days",
                    PolicyError::Cap(_) => "fine.cap_cents",
                };
                c.fail(key, e.to_string());
                None
            }
        };

        let log_format = match self.log.format.as_str() {
            "json" => Some(LogFormat::Json),
            "pretty" => Some(LogFormat::Pretty),
            other => {
                c.fail("log.format", format!("{other:?} is not one of json, pretty"));
                None
            }
        };
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.level) {
            c.fail(
                "log.level",
                format!("{:?} is not a valid filter: {e}", self.log.level),
            );
        }

        let http_listen = match self.http.listen.trim() {
            "" => Some(None),
            addr => c
                .check(
                    "http.listen",
                    addr.parse::<SocketAddr>().map_err(|e| format!("{addr:?}: {e}")),
                )
                .map(Some),
        };

        if !c.problems.is_empty() {
            return Err(ConfigError::Invalid(c.problems));
        }
        // Every Option below is Some: a None was recorded as a problem above.
        let built = (|| {
            Some(Settings {
                database: DatabaseSettings {
                    url,
                    max_connections: max_connections?,
                    connect_timeout: connect_timeout?,
                },
                instance: instance?,
                schedule: ScheduleSettings {
                    mode: mode?,
                    max_catch_up: max_catch_up?,
                    drain_timeout: drain_timeout?,
                },
                zone: zone?,
                time_source: time_source?,
                max_skew: max_skew?,
                claim: ClaimSettings {
                    lease: lease?,
                    batch_timeout: batch_timeout?,
                    lock_timeout: lock_timeout?,
                    history_retention: history_retention?,
                },
                settlement: SettlementSettings {
                    enabled: self.settlement.enabled,
                    batch_size: settlement_batch?,
                    catch_up_months: catch_up_months?,
                },
                accrual: AccrualSettings {
                    enabled: self.accrual.enabled,
                    batch_size: accrual_batch?,
                    catch_up_days: catch_up_days?,
                    max_attempts: max_attempts?,
                    retry_backoff: retry_backoff?,
                    retry_backoff_max: retry_backoff_max?,
                    recheck_every: recheck_every?,
                },
                fine: fine?,
                log_format: log_format?,
                log_level: self.log.level.clone(),
                http_listen: http_listen?,
            })
        })();
        built.ok_or_else(|| {
            ConfigError::Invalid(vec![Problem {
                key: "(internal)",
                message: "validation lost a value".into(),
            }])
        })
    }

    /// The effective configuration as TOML, with the database password redacted and the derived claim timeouts
    /// written out (`settings` is this configuration, validated).
    pub fn to_redacted_toml(&self, settings: &Settings) -> String {
        let mut shown = self.clone();
        shown.database.url = redact_url(&shown.database.url);
        let text = |d: Duration| humantime::format_duration(d).to_string();
        shown.claim.batch_timeout = Some(text(settings.claim.batch_timeout));
        shown.claim.lock_timeout = Some(text(settings.claim.lock_timeout));
        toml::to_string_pretty(&shown).unwrap_or_else(|e| format!("# cannot render configuration: {e}\n"))
    }
}

/// `claim.batch_timeout` when it is not set: a quarter of the lease, at most 30 s — so that a lease of any length
/// works on its own, and a healthy replica renews its lease several times before it could run out.
pub fn derived_batch_timeout(lease: Duration) -> Duration {
    whole_millis(lease / 4).min(Duration::from_secs(30))
}

fn whole_millis(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `claim.lock_timeout` when it is not set: a sixth of the batch timeout, at most 5 s (and at least 10 ms) —
/// long enough to ride out libraryd's short transactions, short enough that a batch that meets a row libraryd
/// keeps locked still has the time to leave that row and commit the rest.
pub fn derived_lock_timeout(batch_timeout: Duration) -> Duration {
    whole_millis(batch_timeout / 6).clamp(Duration::from_millis(10), Duration::from_secs(5))
}

/// The ordinal of a StatefulSet pod name: `fine-settler-2` → 2.
pub fn pod_ordinal(name: &str) -> Option<i64> {
    let (_, ordinal) = name.trim().rsplit_once('-')?;
    if ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    ordinal.parse().ok()
}

/// The URL with any password replaced by `***` (in the user-info part and in a `password=` parameter).
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return redact_password_params(url);
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let redacted_authority = match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            match userinfo.find(':') {
                Some(colon) => format!("{}:***{}", &userinfo[..colon], &authority[at..]),
                None => authority.to_string(),
            }
        }
        None => authority.to_string(),
    };
    format!(
        "{}{}{}",
        &url[..scheme_end],
        redacted_authority,
        redact_password_params(&rest[authority_end..])
    )
}

fn redact_password_params(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("password=") {
        let value_start = i + "password=".len();
        out.push_str(&rest[..value_start]);
        out.push_str("***");
        let tail = &rest[value_start..];
        let value_end = tail.find(['&', ' ', '#']).unwrap_or(tail.len());
        rest = &tail[value_end..];
    }
    out.push_str(rest);
    out
}

/// Redacts every URL-looking token of a message (errors from drivers may quote the URL they were given).
pub fn redact_secrets_in(message: &str) -> String {
    message
        .split(' ')
        .map(|word| {
            if word.contains("://") {
                redact_url(word)
            } else {
                redact_password_params(word)
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::env;

    fn problems(pairs: &[(&str, &str)]) -> Vec<String> {
        let env = env(pairs);
        match load(None, &env).and_then(|raw| raw.validate(&env)) {
            Ok(_) => Vec::new(),
            Err(e) => e.lines(),
        }
    }

    #[test]
    fn the_defaults_are_valid() {
        let settings = settings(&[]);

        assert_eq!(settings.instance, ShardSpec::SINGLE);
        assert_eq!(settings.claim.lease, Duration::from_secs(120));
        assert_eq!(settings.settlement.batch_size, 10000);
        assert_eq!(settings.zone, chrono_tz::Asia::Shanghai);
        assert_eq!(settings.fine, FinePolicy::default());
        assert!(settings.http_listen.is_none());
    }

    #[test]
    fn the_claim_timeouts_follow_the_lease_unless_set() {
        let s = settings(&[]);
        assert_eq!(
            (s.claim.batch_timeout, s.claim.lock_timeout),
            (Duration::from_secs(30), Duration::from_secs(5))
        );
        // Only the lease set: both timeouts follow it, and nothing contradicts.
        let s = settings(&[("FINE_SETTLER__CLAIM__LEASE", "10s")]);
        assert_eq!(
            (s.claim.batch_timeout, s.claim.lock_timeout),
            (Duration::from_millis(2500), Duration::from_millis(416))
        );
        let s = settings(&[("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "12s")]);
        assert_eq!(s.claim.lock_timeout, Duration::from_secs(2));
        // Explicit values that contradict each other are refused, naming the key.
        assert_eq!(
            problems(&[
                ("FINE_SETTLER__CLAIM__LEASE", "10s"),
                ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "30s")
            ]),
            vec!["invalid configuration: claim.lease: 10s must be longer than claim.batch_timeout (30s)"]
        );
        assert_eq!(
            problems(&[
                ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "3s"),
                ("FINE_SETTLER__CLAIM__LOCK_TIMEOUT", "3s")
            ]),
            vec![
                "invalid configuration: claim.lock_timeout: 3s must be shorter than claim.batch_timeout (3s)"
            ]
        );
        // check-config shows the derived values.
        let vars = env(&[("FINE_SETTLER__CLAIM__LEASE", "1m")]);
        let raw = load(None, &vars).expect("loads");
        let shown = raw.to_redacted_toml(&raw.validate(&vars).expect("valid"));
        assert!(
            shown.contains("batch_timeout = \"15s\"") && shown.contains("lock_timeout = \"2s 500ms\""),
            "{shown}"
        );
    }

    fn settings(pairs: &[(&str, &str)]) -> Settings {
        let env = env(pairs);
        load(None, &env).and_then(|r| r.validate(&env)).expect("valid")
    }

    #[test]
    fn environment_overrides_and_database_url_wins() {
        let s = settings(&[
            ("FINE_SETTLER__INSTANCE__SHARD", "2"),
            ("FINE_SETTLER__INSTANCE__SHARDS", "3"),
            ("FINE_SETTLER__SCHEDULE__PERIOD", "500ms"),
            ("FINE_SETTLER__DATABASE__URL", "postgres://a@h1/db"),
            ("DATABASE_URL", "postgres://b@h2/db"),
        ]);
        assert_eq!((s.instance.shard(), s.instance.shards()), (2, 3));
        assert!(matches!(s.schedule.mode, ScheduleMode::FixedRate(p) if p == Duration::from_millis(500)));
        assert_eq!(s.database.url, "postgres://b@h2/db");
    }

    #[test]
    fn each_invalid_value_names_its_key() {
        let cases: &[(&str, &str, &str)] = &[
            ("FINE_SETTLER__INSTANCE__SHARD", "3", "instance.shard"),
            ("FINE_SETTLER__INSTANCE__SHARD", "-1", "instance.shard"),
            ("FINE_SETTLER__INSTANCE__SHARDS", "0", "instance.shards"),
            ("FINE_SETTLER__TIME__ZONE", "Mars/Olympus", "time.zone"),
            ("FINE_SETTLER__CLAIM__LEASE", "soon", "claim.lease"),
            ("FINE_SETTLER__CLAIM__LEASE", "0.5x", "claim.lease"),
            ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "0s", "claim.batch_timeout"),
            (
                "FINE_SETTLER__FINE__DAILY_RATE_CENTS",
                "-5",
                "fine.daily_rate_cents",
            ),
            ("FINE_SETTLER__FINE__GRACE_DAYS", "-1", "fine.grace_days"),
            ("FINE_SETTLER__FINE__CAP_CENTS", "-1", "fine.cap_cents"),
            (
                "FINE_SETTLER__SETTLEMENT__BATCH_SIZE",
                "0",
                "settlement.batch_size",
            ),
            ("FINE_SETTLER__SCHEDULE__MODE", "hourly", "schedule.mode"),
            ("DATABASE_URL", "mysql://x@y/z", "database.url"),
            ("FINE_SETTLER__LOG__FORMAT", "xml", "log.format"),
            ("FINE_SETTLER__HTTP__LISTEN", "nowhere", "http.listen"),
        ];
        for (var, value, key) in cases {
            let lines = problems(&[(var, value)]);
            assert_eq!(lines.len(), 1, "{var}={value}: {lines:?}");
            assert!(lines[0].contains(key), "{var}={value}: {lines:?}");
        }
    }

    #[test]
    fn the_shard_can_come_from_a_statefulset_pod() {
        let s = settings(&[
            ("FINE_SETTLER__INSTANCE__SHARDS", "3"),
            ("FINE_SETTLER__INSTANCE__SHARD_FROM", "pod-index"),
            ("POD_INDEX", "2"),
        ]);
        assert_eq!(s.instance.shard(), 2);
        let s = settings(&[
            ("FINE_SETTLER__INSTANCE__SHARDS", "3"),
            ("FINE_SETTLER__INSTANCE__SHARD_FROM", "pod-name"),
            ("POD_NAME", "fine-settler-1"),
        ]);
        assert_eq!(s.instance.shard(), 1);
        let lines = problems(&[
            ("FINE_SETTLER__INSTANCE__SHARDS", "3"),
            ("FINE_SETTLER__INSTANCE__SHARD_FROM", "pod-name"),
            ("POD_NAME", "fine-settler-3"),
        ]);
        assert!(
            lines.len() == 1 && lines[0].contains("instance.shard"),
            "{lines:?}"
        );
        let lines = problems(&[("FINE_SETTLER__INSTANCE__SHARD_FROM", "pod-index")]);
        assert!(
            lines.len() == 1 && lines[0].contains("POD_INDEX is not set"),
            "{lines:?}"
        );
        assert_eq!(pod_ordinal("web-12"), Some(12));
        assert_eq!(pod_ordinal("web"), None);
        assert_eq!(pod_ordinal("web-"), None);
        assert_eq!(pod_ordinal("web-+1"), None);
    }

    #[test]
    fn all_problems_are_reported_together() {
        let lines = problems(&[
            ("FINE_SETTLER__INSTANCE__SHARD", "9"),
            ("FINE_SETTLER__TIME__ZONE", "Nowhere"),
        ]);
        assert_eq!(lines.len(), 2, "{lines:?}");
    }

    #[test]
    fn unknown_keys_and_wrong_types_are_load_errors() {
        let lines = problems(&[("FINE_SETTLER__INSTANCE__SHRAD", "1")]);
        assert_eq!(lines.len(), 1);
        assert!(lines[0].contains("shrad"), "{lines:?}");
        let lines = problems(&[("FINE_SETTLER__INSTANCE__SHARD", "two")]);
        assert!(lines[0].contains("instance.shard"), "{lines:?}");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(
            redact_url("postgres://u@h/db?password=secret&sslmode=require"),
            "postgres://u@h/db?password=***&sslmode=require"
        );
        assert_eq!(redact_url("postgres://h/db"), "postgres://h/db");
        assert_eq!(redact_url("postgres://u:p@ss@h/db"), "postgres://u:***@h/db");
        let vars = env(&[("DATABASE_URL", "postgres://u:hunter2@h/db")]);
        let raw = load(None, &vars).expect("loads");
        let settings = raw.validate(&vars).expect("valid");
        let shown = raw.to_redacted_toml(&settings);
        assert!(
            !shown.contains("hunter2") && shown.contains("u:***@h/db"),
            "{shown}"
        );
    }
}
