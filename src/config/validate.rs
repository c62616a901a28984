//! From [`RawSettings`] to [`Settings`]: one function per section, each recording the problems it finds with the
//! key they belong to, so that every problem is reported at once.

use std::{collections::HashMap, net::SocketAddr, str::FromStr, time::Duration};

use chrono_tz::Tz;

use super::{
    derived_batch_timeout, derived_lock_timeout,
    raw::{
        RawAccrual, RawClaim, RawDatabase, RawFine, RawHttp, RawInstance, RawLog, RawSchedule, RawSettlement,
        RawThrottle, RawTime,
    },
    settings::{MIN_DERIVING_LEASE, MIN_LOCK_TIMEOUT},
    AccrualSettings, ClaimSettings, ConfigError, DatabaseSettings, DatabaseUrl, Engine, Lease, LeaseError,
    LogFilter, LogFormat, Pooler, Problem, RawSettings, ScheduleMode, ScheduleSettings, Settings,
    SettlementSettings, ThrottleSettings, TimeSource,
};
use crate::{
    fine::{FinePolicy, PolicyError},
    shard::{ShardError, ShardSpec},
};

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

    /// A duration where `"0s"` means off (`None`).
    fn duration_or_off(&mut self, key: &'static str, text: &str) -> Option<Option<Duration>> {
        match humantime::parse_duration(text) {
            Ok(d) if d.is_zero() => Some(None),
            Ok(d) => Some(Some(d)),
            Err(e) => {
                self.fail(
                    key,
                    format!("{text:?} is not a duration ({e}); use e.g. \"5s\", or \"0s\" for off"),
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
    /// `instance.shard_from` names a pod index or pod name variable, and for `PGOPTIONS` behind a pooler.
    pub fn validate(&self, env: &HashMap<String, String>) -> Result<Settings, ConfigError> {
        let mut c = Checker { problems: Vec::new() };
        let database = database(&mut c, &self.database, env);
        let instance = instance(&mut c, &self.instance, env);
        let schedule = schedule(&mut c, &self.schedule);
        let time = time(&mut c, &self.time);
        let claim = claim(&mut c, &self.claim);
        let settlement = settlement(&mut c, &self.settlement);
        let accrual = accrual(&mut c, &self.accrual);
        let fine = fine(&mut c, &self.fine);
        let log = log(&mut c, &self.log);
        let http_listen = http(&mut c, &self.http);
        let throttle = throttle(&mut c, &self.throttle, claim.as_ref());
        if !c.problems.is_empty() {
            return Err(ConfigError::Invalid(c.problems));
        }
        // Every Option below is Some: a None was recorded as a problem above.
        let built = (|| {
            let (zone, time_source, max_skew) = time?;
            let (log_format, log_level) = log?;
            Some(Settings {
                database: database?,
                instance: instance?,
                schedule: schedule?,
                zone,
                time_source,
                max_skew,
                claim: claim?,
                settlement: settlement?,
                accrual: accrual?,
                fine: fine?,
                log_format,
                log_level,
                http_listen: http_listen?,
                throttle: throttle?,
            })
        })();
        built.ok_or_else(|| {
            ConfigError::Invalid(vec![Problem {
                key: "(internal)",
                message: "validation lost a value".into(),
            }])
        })
    }
}

fn database(c: &mut Checker, raw: &RawDatabase, env: &HashMap<String, String>) -> Option<DatabaseSettings> {
    let url = c.check("database.url", DatabaseUrl::parse(&raw.url));
    let max_connections = c.int_in("database.max_connections", raw.max_connections, 1..=100);
    let connect_timeout = c.duration("database.connect_timeout", &raw.connect_timeout);
    let pooler = match raw.pooler.trim() {
        "none" => Some(Pooler::None),
        "session" => Some(Pooler::Session),
        "transaction" => Some(Pooler::Transaction),
        other => {
            c.fail(
                "database.pooler",
                format!("{other:?} is not one of none, session, transaction"),
            );
            None
        }
    };
    let engine = match raw.engine.trim() {
        "postgresql" => Some(Engine::Postgresql),
        "citus" => Some(Engine::Citus),
        other => {
            c.fail(
                "database.engine",
                format!("{other:?} is not one of postgresql, citus"),
            );
            None
        }
    };
    if let (Some(url), Some(pooler)) = (&url, pooler) {
        c.check("database.pooler", url.check_pooler(pooler, env));
    }
    Some(DatabaseSettings {
        url: url?,
        max_connections: max_connections?,
        connect_timeout: connect_timeout?,
        pooler: pooler?,
        engine: engine?,
    })
}

fn instance(c: &mut Checker, raw: &RawInstance, env: &HashMap<String, String>) -> Option<ShardSpec> {
    let shard = match raw.shard_from.as_str() {
        "config" => Some(raw.shard),
        "pod-index" => {
            let var = &raw.pod_index_env;
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
            let var = &raw.pod_name_env;
            match env.get(var) {
                Some(name) => match pod_ordinal(name) {
                    Some(ordinal) => Some(ordinal),
                    None => {
                        c.fail(
                            "instance.shard_from",
                            format!(
                                "pod-name: {var}={name:?} does not end in -ORDINAL (e.g. fine-settler-2)"
                            ),
                        );
                        None
                    }
                },
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
    match ShardSpec::new(shard?, raw.shards) {
        Ok(spec) => Some(spec),
        Err(e @ ShardError::Shards(_)) => {
            c.fail("instance.shards", e.to_string());
            None
        }
        Err(e @ ShardError::Shard { .. }) => {
            c.fail("instance.shard", e.to_string());
            None
        }
    }
}

fn schedule(c: &mut Checker, raw: &RawSchedule) -> Option<ScheduleSettings> {
    let period = c.duration("schedule.period", &raw.period);
    let mode = match raw.mode.as_str() {
        "fixed-rate" => period.map(ScheduleMode::FixedRate),
        "fixed-delay" => period.map(ScheduleMode::FixedDelay),
        "cron" => c
            .check("schedule.cron", croner::Cron::from_str(&raw.cron))
            .map(|cron| ScheduleMode::Cron(Box::new(cron))),
        other => {
            c.fail(
                "schedule.mode",
                format!("{other:?} is not one of fixed-rate, fixed-delay, cron"),
            );
            None
        }
    };
    let max_catch_up = c.int_in("schedule.max_catch_up", raw.max_catch_up, 0..=1_000_000);
    let drain_timeout = c.duration("schedule.drain_timeout", &raw.drain_timeout);
    Some(ScheduleSettings {
        mode: mode?,
        max_catch_up: max_catch_up?,
        drain_timeout: drain_timeout?,
    })
}

fn time(c: &mut Checker, raw: &RawTime) -> Option<(Tz, TimeSource, Duration)> {
    let zone = match raw.zone.parse::<Tz>() {
        Ok(zone) => Some(zone),
        Err(_) => {
            c.fail(
                "time.zone",
                format!("{:?} is not an IANA time zone (e.g. \"Asia/Shanghai\")", raw.zone),
            );
            None
        }
    };
    let source = match raw.source.as_str() {
        "database" => Some(TimeSource::Database),
        "system" => Some(TimeSource::System),
        other => {
            c.fail("time.source", format!("{other:?} is not one of database, system"));
            None
        }
    };
    let max_skew = c.duration("time.max_skew", &raw.max_skew);
    Some((zone?, source?, max_skew?))
}

fn claim(c: &mut Checker, raw: &RawClaim) -> Option<ClaimSettings> {
    let lease = c.duration("claim.lease", &raw.lease);
    // An explicit value that does not parse is unknown (its problem is recorded); an unset one is derived from
    // the value it depends on, when that is known.
    let explicit_batch = raw
        .batch_timeout
        .as_deref()
        .map(|t| c.duration("claim.batch_timeout", t));
    let explicit_lock = raw
        .lock_timeout
        .as_deref()
        .map(|t| c.duration("claim.lock_timeout", t));
    let history_retention = c.duration("claim.history_retention", &raw.history_retention);
    if history_retention.is_some_and(|r| r < Duration::from_secs(3600)) {
        c.fail("claim.history_retention", "must be at least 1h");
    }
    let batch_timeout = explicit_batch.unwrap_or_else(|| lease.map(derived_batch_timeout));
    let lock_timeout = explicit_lock.unwrap_or_else(|| batch_timeout.map(derived_lock_timeout));
    // Each invariant is checked whenever its two values are known, so that every contradiction is reported even
    // when a third value is bad. Only explicit values can contradict each other: the derived ones always fit.
    let mut broken = Vec::new();
    if let (Some(lease), Some(batch)) = (lease, batch_timeout) {
        broken.extend(Lease::check_batch(lease, batch).err());
    }
    if let (Some(batch), Some(lock)) = (batch_timeout, lock_timeout) {
        broken.extend(Lease::check_lock(batch, lock).err());
    }
    let derived = Derived {
        batch_timeout: explicit_batch.is_none(),
        lock_timeout: explicit_lock.is_none(),
        lease,
    };
    lease_problems(c, &broken, derived);
    let lease = Lease::new(lease?, Some(batch_timeout?), Some(lock_timeout?)).ok()?;
    Some(ClaimSettings {
        lease,
        history_retention: history_retention?,
    })
}

/// Which of the claim's timeouts were derived rather than set, and the lease they derive from.
#[derive(Debug, Clone, Copy)]
struct Derived {
    batch_timeout: bool,
    lock_timeout: bool,
    lease: Option<Duration>,
}

/// Each broken invariant, reported against the key the operator set: a derived timeout that does not fit is the
/// fault of the value it was derived from (a lease too short to leave a batch room for a lock wait).
fn lease_problems(c: &mut Checker, broken: &[LeaseError], derived: Derived) {
    for e in broken {
        match (e, derived) {
            (LeaseError::NotLongerThanBatch { .. }, _) => c.fail("claim.lease", e.to_string()),
            (
                LeaseError::LockNotShorterThanBatch { batch_timeout, .. },
                Derived {
                    lock_timeout: true,
                    batch_timeout: true,
                    lease: Some(lease),
                },
            ) => c.fail(
                "claim.lease",
                format!(
                    "{} is too short: the batch timeout derived from it ({}) leaves no room for a lock wait \
                     (at least {}); use a lease of at least {}",
                    humantime::format_duration(lease),
                    humantime::format_duration(*batch_timeout),
                    humantime::format_duration(MIN_LOCK_TIMEOUT),
                    humantime::format_duration(MIN_DERIVING_LEASE)
                ),
            ),
            (
                LeaseError::LockNotShorterThanBatch { batch_timeout, .. },
                Derived { lock_timeout: true, .. },
            ) => c.fail(
                "claim.batch_timeout",
                format!(
                    "{} leaves no room for the lock wait derived from it (at least {}); set it above that, or \
                     set claim.lock_timeout below it",
                    humantime::format_duration(*batch_timeout),
                    humantime::format_duration(MIN_LOCK_TIMEOUT)
                ),
            ),
            (LeaseError::LockNotShorterThanBatch { .. }, _) => c.fail("claim.lock_timeout", e.to_string()),
        }
    }
}

fn settlement(c: &mut Checker, raw: &RawSettlement) -> Option<SettlementSettings> {
    let batch_size = c.int_in("settlement.batch_size", raw.batch_size, 1..=MAX_BATCH_SIZE);
    let catch_up_months = c.int_in("settlement.catch_up_months", raw.catch_up_months, 1..=120);
    Some(SettlementSettings {
        enabled: raw.enabled,
        batch_size: batch_size?,
        catch_up_months: catch_up_months?,
    })
}

fn accrual(c: &mut Checker, raw: &RawAccrual) -> Option<AccrualSettings> {
    let batch_size = c.int_in("accrual.batch_size", raw.batch_size, 1..=MAX_BATCH_SIZE);
    let catch_up_days = c.int_in("accrual.catch_up_days", raw.catch_up_days, 1..=3660);
    let max_attempts = c.int_in("accrual.max_attempts", raw.max_attempts, 1..=1000);
    let retry_backoff = c.duration("accrual.retry_backoff", &raw.retry_backoff);
    let retry_backoff_max = c.duration("accrual.retry_backoff_max", &raw.retry_backoff_max);
    let recheck_every = c.duration("accrual.recheck_every", &raw.recheck_every);
    if let (Some(base), Some(max)) = (retry_backoff, retry_backoff_max) {
        if max < base {
            c.fail(
                "accrual.retry_backoff_max",
                "must not be shorter than accrual.retry_backoff",
            );
        }
    }
    Some(AccrualSettings {
        enabled: raw.enabled,
        batch_size: batch_size?,
        catch_up_days: catch_up_days?,
        max_attempts: max_attempts?,
        retry_backoff: retry_backoff?,
        retry_backoff_max: retry_backoff_max?,
        recheck_every: recheck_every?,
    })
}

fn fine(c: &mut Checker, raw: &RawFine) -> Option<FinePolicy> {
    match FinePolicy::new(raw.daily_rate_cents, raw.grace_days, raw.cap_cents) {
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
    }
}

fn log(c: &mut Checker, raw: &RawLog) -> Option<(LogFormat, LogFilter)> {
    let format = match raw.format.as_str() {
        "json" => Some(LogFormat::Json),
        "pretty" => Some(LogFormat::Pretty),
        other => {
            c.fail("log.format", format!("{other:?} is not one of json, pretty"));
            None
        }
    };
    let filter = c.check("log.level", LogFilter::parse(&raw.level));
    Some((format?, filter?))
}

fn http(c: &mut Checker, raw: &RawHttp) -> Option<Option<SocketAddr>> {
    match raw.listen.trim() {
        "" => Some(None),
        addr => c
            .check(
                "http.listen",
                addr.parse::<SocketAddr>().map_err(|e| format!("{addr:?}: {e}")),
            )
            .map(Some),
    }
}

/// The largest `throttle.max_rows_per_second`: beyond it the limit would not bind on any server.
pub const MAX_ROWS_PER_SECOND: i64 = 10_000_000;

fn throttle(c: &mut Checker, raw: &RawThrottle, claim: Option<&ClaimSettings>) -> Option<ThrottleSettings> {
    let rate = c.int_in(
        "throttle.max_rows_per_second",
        raw.max_rows_per_second,
        0..=MAX_ROWS_PER_SECOND,
    );
    let lag = c.duration_or_off("throttle.max_replica_lag", &raw.max_replica_lag);
    let budget = c.duration_or_off("throttle.max_commit_latency", &raw.max_commit_latency);
    let batch_duration = c.duration_or_off("throttle.batch_duration", &raw.batch_duration);
    if let (Some(Some(target)), Some(claim)) = (batch_duration, claim) {
        let timeout = claim.lease.batch_timeout();
        if target >= timeout {
            c.fail(
                "throttle.batch_duration",
                format!(
                    "{} must be shorter than claim.batch_timeout ({})",
                    humantime::format_duration(target),
                    humantime::format_duration(timeout)
                ),
            );
        }
    }
    // An empty name (a trailing comma in the environment) is no standby.
    let standbys: Vec<String> = raw
        .standbys
        .iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    Some(ThrottleSettings {
        max_rows_per_second: Some(rate?).filter(|r| *r > 0),
        max_commit_latency: budget?,
        max_replica_lag: lag?,
        standbys,
        batch_duration: batch_duration?,
    })
}

/// The ordinal of a StatefulSet pod name: `fine-settler-2` → 2.
pub fn pod_ordinal(name: &str) -> Option<i64> {
    let (_, ordinal) = name.trim().rsplit_once('-')?;
    if ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    ordinal.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::load;
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
        assert_eq!(settings.claim.lease.duration(), Duration::from_secs(120));
        assert_eq!(settings.settlement.batch_size, 10000);
        assert_eq!(settings.zone, chrono_tz::Asia::Shanghai);
        assert_eq!(settings.fine, FinePolicy::default());
        assert!(settings.http_listen.is_none());
    }

    #[test]
    fn the_engine_is_postgresql_unless_citus_is_named() {
        assert_eq!(settings(&[]).database.engine, Engine::Postgresql);
        let citus = settings(&[("FINE_SETTLER__DATABASE__ENGINE", "citus")]);
        assert_eq!(citus.database.engine, Engine::Citus);
        assert_eq!(
            problems(&[("FINE_SETTLER__DATABASE__ENGINE", "mysql")]),
            vec!["invalid configuration: database.engine: \"mysql\" is not one of postgresql, citus"]
        );
    }

    #[test]
    fn the_claim_timeouts_follow_the_lease_unless_set() {
        let s = settings(&[]);
        assert_eq!(
            (s.claim.lease.batch_timeout(), s.claim.lease.lock_timeout()),
            (Duration::from_secs(30), Duration::from_secs(5))
        );
        // Only the lease set: both timeouts follow it, and nothing contradicts.
        let s = settings(&[("FINE_SETTLER__CLAIM__LEASE", "10s")]);
        assert_eq!(
            (s.claim.lease.batch_timeout(), s.claim.lease.lock_timeout()),
            (Duration::from_millis(2500), Duration::from_millis(416))
        );
        let s = settings(&[("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "12s")]);
        assert_eq!(s.claim.lease.lock_timeout(), Duration::from_secs(2));
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
        assert_eq!(s.database.url.redacted(), "postgres://b@h2/db");
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
            (
                "FINE_SETTLER__THROTTLE__MAX_ROWS_PER_SECOND",
                "-1",
                "throttle.max_rows_per_second",
            ),
            (
                "FINE_SETTLER__THROTTLE__MAX_ROWS_PER_SECOND",
                "10000001",
                "throttle.max_rows_per_second",
            ),
            (
                "FINE_SETTLER__THROTTLE__MAX_COMMIT_LATENCY",
                "snappy",
                "throttle.max_commit_latency",
            ),
            (
                "FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG",
                "a while",
                "throttle.max_replica_lag",
            ),
            (
                "FINE_SETTLER__THROTTLE__BATCH_DURATION",
                "fast",
                "throttle.batch_duration",
            ),
            (
                "FINE_SETTLER__THROTTLE__BATCH_DURATION",
                "30s",
                "throttle.batch_duration",
            ),
        ];
        for (var, value, key) in cases {
            let lines = problems(&[(var, value)]);
            assert_eq!(lines.len(), 1, "{var}={value}: {lines:?}");
            assert!(lines[0].contains(key), "{var}={value}: {lines:?}");
        }
    }

    #[test]
    fn the_throttle_is_off_by_default_and_zero_means_off() {
        assert_eq!(settings(&[]).throttle, ThrottleSettings::default());
        let zeros = settings(&[
            ("FINE_SETTLER__THROTTLE__MAX_ROWS_PER_SECOND", "0"),
            ("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "0s"),
            ("FINE_SETTLER__THROTTLE__MAX_COMMIT_LATENCY", "0s"),
            ("FINE_SETTLER__THROTTLE__BATCH_DURATION", "0ms"),
        ]);
        assert_eq!(zeros.throttle, ThrottleSettings::default());
        let on = settings(&[
            ("FINE_SETTLER__THROTTLE__MAX_ROWS_PER_SECOND", "2500"),
            ("FINE_SETTLER__THROTTLE__MAX_REPLICA_LAG", "5s"),
            ("FINE_SETTLER__THROTTLE__MAX_COMMIT_LATENCY", "4ms"),
            ("FINE_SETTLER__THROTTLE__BATCH_DURATION", "200ms"),
        ]);
        assert_eq!(
            on.throttle,
            ThrottleSettings {
                max_rows_per_second: Some(2500),
                max_commit_latency: Some(Duration::from_millis(4)),
                max_replica_lag: Some(Duration::from_secs(5)),
                standbys: Vec::new(),
                batch_duration: Some(Duration::from_millis(200)),
            }
        );
        // The standbys the limit watches, as a TOML list or a comma-separated variable.
        let named = settings(&[("FINE_SETTLER__THROTTLE__STANDBYS", "standby1, dr-east,")]);
        assert_eq!(named.throttle.standbys, ["standby1", "dr-east"]);
        // A target no shorter than the batch timeout could never shrink a batch before it times out.
        assert_eq!(
            problems(&[("FINE_SETTLER__THROTTLE__BATCH_DURATION", "30s")]),
            vec![
                "invalid configuration: throttle.batch_duration: 30s must be shorter than claim.batch_timeout (30s)"
            ]
        );
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
        // A bad claim timeout does not hide a contradiction between the two others.
        let lines = problems(&[
            ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "2m"),
            ("FINE_SETTLER__CLAIM__LOCK_TIMEOUT", "soon"),
        ]);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[1].contains("claim.lease: 2m must be longer than claim.batch_timeout (2m)"),
            "{lines:?}"
        );
        let lines = problems(&[
            ("FINE_SETTLER__CLAIM__LEASE", "soon"),
            ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "5ms"),
        ]);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[1].contains(
                "claim.batch_timeout: 5ms leaves no room for the lock wait derived from it (at least 10ms)"
            ),
            "{lines:?}"
        );
    }

    #[test]
    fn a_lease_too_short_for_its_derived_timeouts_is_named_as_the_lease() {
        let lines = problems(&[("FINE_SETTLER__CLAIM__LEASE", "1ms")]);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains("claim.lease: 1ms is too short") && lines[0].contains("at least 44ms"),
            "{lines:?}"
        );
        let shortest = humantime::format_duration(MIN_DERIVING_LEASE).to_string();
        assert!(problems(&[("FINE_SETTLER__CLAIM__LEASE", shortest.as_str())]).is_empty());
        let shorter = humantime::format_duration(MIN_DERIVING_LEASE - Duration::from_millis(1)).to_string();
        let lines = problems(&[("FINE_SETTLER__CLAIM__LEASE", shorter.as_str())]);
        assert!(
            lines.iter().any(|l| l.contains("claim.lease: 43ms is too short")),
            "{lines:?}"
        );
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
        let vars = env(&[("DATABASE_URL", "postgres://u:hunter2@h/db")]);
        let raw = load(None, &vars).expect("loads");
        let settings = raw.validate(&vars).expect("valid");
        let shown = raw.to_redacted_toml(&settings);
        assert!(
            !shown.contains("hunter2") && shown.contains("u:***@h/db"),
            "{shown}"
        );
        // The settings themselves never print it either.
        let debug = format!("{settings:?}");
        assert!(
            !debug.contains("hunter2") && debug.contains("u:***@h/db"),
            "{debug}"
        );
    }
}
