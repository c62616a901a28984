//! The `[fine]` keys since the rules moved into the database: `migrate` seeds the first `default` policy from
//! them, and afterwards the database's `fine_policies` is the one source every replica uses. A replica whose
//! file or environment still sets a `[fine]` key to a value other than the database's `default` policy in force
//! today is refused at start ([`FineKeys::check`]), so that two replicas can never price loans differently.
//! Only keys set explicitly count: the compiled-in defaults are no one's choice, and a replica with no `[fine]`
//! keys always runs.

use std::{collections::HashMap, path::Path};

use chrono::NaiveDate;

use super::{ConfigError, ENV_PREFIX};
use crate::{fine::FinePolicy, policy::PolicyVersion};

/// One `[fine]` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FineKey {
    DailyRateCents,
    GraceDays,
    CapCents,
}

impl FineKey {
    const ALL: [FineKey; 3] = [FineKey::DailyRateCents, FineKey::GraceDays, FineKey::CapCents];

    /// The key's name in its section.
    pub fn name(self) -> &'static str {
        match self {
            FineKey::DailyRateCents => "daily_rate_cents",
            FineKey::GraceDays => "grace_days",
            FineKey::CapCents => "cap_cents",
        }
    }

    /// The key's value in `policy` (the cap as in the file: 0 for none).
    fn value(self, policy: &FinePolicy) -> i64 {
        match self {
            FineKey::DailyRateCents => policy.daily_rate().get(),
            FineKey::GraceDays => policy.grace_days(),
            FineKey::CapCents => policy.cap().map_or(0, |c| c.get()),
        }
    }
}

/// The `[fine]` keys a replica's file or environment sets, with their validated values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FineKeys {
    /// The keys set explicitly, in the order of [`FineKey::ALL`].
    set: Vec<FineKey>,
    /// The effective values (those of the keys not set are the compiled-in defaults, never compared).
    values: FinePolicy,
}

/// A `[fine]` key that disagrees with the database.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid configuration: {keys} differs from the database's default fine policy in force today ({policy}, \
     effective from {from}): the fine rules live in fine_policies now; remove the [fine] keys from this \
     replica's file and environment (see `fine-settler policy list`)"
)]
pub struct FineKeysDiffer {
    /// `fine.KEY = value` for each key that differs.
    pub keys: String,
    /// The database's values, as `fine.KEY = value` pairs.
    pub policy: String,
    pub from: NaiveDate,
}

impl FineKeys {
    /// The keys `file` (its `[fine]` table) and `env` (`FINE_SETTLER__FINE__KEY`, any case) set; `values` are the
    /// validated settings.
    pub fn read(
        file: Option<&Path>,
        env: &HashMap<String, String>,
        values: FinePolicy,
    ) -> Result<Self, ConfigError> {
        let in_file: Vec<String> = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ConfigError::Load(format!("config file {}: {e}", path.display())))?;
                let doc: toml::Table = text
                    .parse()
                    .map_err(|e| ConfigError::Load(format!("config file {}: {e}", path.display())))?;
                match doc.get("fine") {
                    Some(toml::Value::Table(t)) => t.keys().cloned().collect(),
                    _ => Vec::new(),
                }
            }
            None => Vec::new(),
        };
        let prefix = format!("{ENV_PREFIX}__FINE__").to_lowercase();
        let in_env: Vec<String> = env
            .keys()
            .filter_map(|k| k.to_lowercase().strip_prefix(&prefix).map(str::to_string))
            .collect();
        let set = FineKey::ALL
            .into_iter()
            .filter(|k| in_file.iter().chain(&in_env).any(|n| n == k.name()))
            .collect();
        Ok(FineKeys { set, values })
    }

    /// Whether no `[fine]` key is set.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Refuses keys whose values differ from `in_force`, the database's `default` policy in force today. With no
    /// such policy (a database `migrate` has not seeded yet) there is nothing to disagree with.
    pub fn check(&self, in_force: Option<&PolicyVersion>) -> Result<(), FineKeysDiffer> {
        let Some(db) = in_force else {
            return Ok(());
        };
        let theirs = &db.policy.fine;
        let differ: Vec<String> = self
            .set
            .iter()
            .filter(|k| k.value(&self.values) != k.value(theirs))
            .map(|k| format!("fine.{} = {}", k.name(), k.value(&self.values)))
            .collect();
        if differ.is_empty() {
            return Ok(());
        }
        let policy = FineKey::ALL
            .iter()
            .map(|k| format!("{} = {}", k.name(), k.value(theirs)))
            .collect::<Vec<_>>()
            .join(", ");
        Err(FineKeysDiffer {
            keys: differ.join(", "),
            policy,
            from: db.effective_from,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        policy::{FineClass, Policy},
        testing::env,
    };

    fn version(rate: i64, grace: i64, cap: i64) -> PolicyVersion {
        PolicyVersion {
            class: FineClass::default_class(),
            effective_from: NaiveDate::from_ymd_opt(2026, 1, 1).expect("a date"),
            policy: Policy {
                fine: FinePolicy::new(rate, grace, cap).expect("policy"),
                charge_closed_days: false,
            },
            created_at: chrono::DateTime::UNIX_EPOCH,
            created_by: "test".into(),
            reason: String::new(),
        }
    }

    #[test]
    fn compiled_in_defaults_never_disagree() {
        let keys = FineKeys::read(None, &env(&[]), FinePolicy::DEFAULT).expect("read");
        assert!(keys.is_empty());
        assert_eq!(keys.check(Some(&version(250, 3, 900))), Ok(()));
    }

    #[test]
    fn a_key_set_in_the_environment_must_equal_the_database() {
        let values = FinePolicy::new(150, 0, 0).expect("policy");
        let keys = FineKeys::read(
            None,
            &env(&[("FINE_SETTLER__FINE__DAILY_RATE_CENTS", "150")]),
            values,
        )
        .expect("read");
        assert_eq!(keys.check(Some(&version(150, 3, 900))), Ok(()));
        assert_eq!(keys.check(None), Ok(()));
        let e = keys.check(Some(&version(100, 0, 0))).expect_err("differs");
        assert_eq!(e.keys, "fine.daily_rate_cents = 150");
        assert!(e.to_string().contains("effective from 2026-01-01"), "{e}");
    }

    #[test]
    fn a_key_set_in_the_file_counts() {
        let dir = std::env::temp_dir().join(format!("fine-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("replica.toml");
        std::fs::write(&file, "[fine]\ncap_cents = 500\n").expect("write");
        let values = FinePolicy::new(100, 0, 500).expect("policy");
        let keys = FineKeys::read(Some(&file), &env(&[]), values).expect("read");
        let e = keys.check(Some(&version(100, 0, 0))).expect_err("differs");
        assert_eq!(e.keys, "fine.cap_cents = 500");
        // The rate is not set, so its compiled-in value is not compared.
        assert_eq!(keys.check(Some(&version(300, 0, 500))), Ok(()));
        std::fs::remove_dir_all(&dir).ok();
    }
}
