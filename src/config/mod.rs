//! Configuration: raw layered settings (built-in defaults, the replica's TOML file, environment) and their
//! validation into typed [`Settings`], once, at start.
//!
//! Layers, lowest first: `config/default.toml` (compiled in), `--config FILE`, `FINE_SETTLER__SECTION__KEY`
//! variables, and `DATABASE_URL` for `database.url`. Unknown keys are errors, so a typo never silently falls
//! back to a default. Validation reports every problem at once, one line per problem naming its key; nothing
//! touches the database before it has passed.
//!
//! - [`raw`]: the keys as the sources spell them ([`RawSettings`]), and `check-config`'s rendering.
//! - [`settings`]: the types the code uses ([`Settings`], [`Lease`], [`LogFilter`], …).
//! - [`database_url`]: `database.url` parsed once ([`DatabaseUrl`]): libpq's multi-host form, its
//!   `target_session_attrs` and `connect_timeout`, and the URL as it may be shown.
//! - [`validate`]: from the one to the other, a function per section.
//! - [`fine_keys`]: the `[fine]` keys a replica sets explicitly, checked against the database's policy at start.

pub mod database_url;
pub mod fine_keys;
pub mod raw;
pub mod settings;
pub mod validate;

use std::{collections::HashMap, path::Path};

pub use database_url::{DatabaseUrl, DatabaseUrlError, PoolerOptionsError, TargetSessionAttrs};
pub use fine_keys::{FineKey, FineKeys, FineKeysDiffer};
pub use raw::RawSettings;
pub use settings::{
    derived_batch_timeout, derived_lock_timeout, AccrualSettings, ClaimSettings, DatabaseSettings, Engine,
    Lease, LeaseError, LogFilter, LogFormat, Pooler, ScheduleMode, ScheduleSettings, Settings,
    SettlementSettings, ThrottleSettings, TimeSource,
};
pub use validate::{pod_ordinal, MAX_BATCH_SIZE};

use crate::redact;

/// The built-in base layer: every key with its documented default.
pub const DEFAULTS_TOML: &str = include_str!("../../config/default.toml");

/// Prefix of the environment variables that override keys: `FINE_SETTLER__SECTION__KEY`.
pub const ENV_PREFIX: &str = "FINE_SETTLER";

/// `throttle.standbys` from the environment: names separated by commas.
const STANDBYS_VAR: &str = "FINE_SETTLER__THROTTLE__STANDBYS";

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
        .filter(|(k, _)| k.starts_with(ENV_PREFIX) && k.as_str() != STANDBYS_VAR)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    builder = builder.add_source(
        Environment::with_prefix(ENV_PREFIX)
            .prefix_separator("__")
            .separator("__")
            .source(Some(prefixed)),
    );
    // The one list-valued key: comma-separated in the environment.
    if let Some(names) = env.get(STANDBYS_VAR) {
        let names: Vec<String> = names.split(',').map(str::to_string).collect();
        builder = builder
            .set_override("throttle.standbys", names)
            .map_err(|e| ConfigError::Load(e.to_string()))?;
    }
    if let Some(url) = env.get("DATABASE_URL").filter(|u| !u.is_empty()) {
        builder = builder
            .set_override("database.url", url.as_str())
            .map_err(|e| ConfigError::Load(e.to_string()))?;
    }
    builder
        .build()
        .and_then(|c| c.try_deserialize::<RawSettings>())
        .map_err(|e| ConfigError::Load(redact::secrets_in(&e.to_string())))
}
