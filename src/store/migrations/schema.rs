//! How far a database is from the schema this binary's migrations make: every embedded migration recorded as
//! applied (and not failed), and every index fine-settler owns ([`owned_indexes`]) present on its table and
//! valid. Readiness (`/readyz`, the replica's start) and `migrate` (before it repairs, and once it is done) ask
//! it here, and say which migration or index falls short.

use std::fmt;

use sqlx::PgExecutor;

use super::{owned_indexes, OwnedIndex, MIGRATOR};
use crate::store::{classify, DbFailure};

/// A migration as sqlx's `_sqlx_migrations` records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    pub version: i64,
    /// `false`: the migration failed half-way (sqlx refuses to migrate further until it is dealt with).
    pub success: bool,
}

/// The migrations the database records; `None` when it was never migrated (no `_sqlx_migrations`).
pub async fn recorded<'e>(db: impl PgExecutor<'e>) -> Result<Option<Vec<Recorded>>, sqlx::Error> {
    // `_sqlx_migrations` is sqlx's own table, not part of the checked schema: an unchecked query.
    let rows = sqlx::query_as::<_, (i64, bool)>("select version, success from _sqlx_migrations")
        .fetch_all(db)
        .await;
    match rows {
        Ok(rows) => Ok(Some(
            rows.into_iter()
                .map(|(version, success)| Recorded { version, success })
                .collect(),
        )),
        Err(e) if classify(&e) == DbFailure::UndefinedTable => Ok(None),
        Err(e) => Err(e),
    }
}

/// Where an owned index stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexState {
    Valid,
    /// INVALID, and no build of it is in progress: left by a build that was interrupted or failed.
    Invalid,
    /// INVALID because another session is building it right now (`create index concurrently` marks the index
    /// valid only at its end).
    Building,
    /// No index of that name on its table.
    Missing,
}

/// An owned index and where it stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexStatus {
    pub index: &'static OwnedIndex,
    pub state: IndexState,
    /// The index as a name to use in SQL (schema-qualified where `search_path` does not find it), if it exists.
    pub regclass: Option<String>,
}

/// Where each owned index stands.
///
/// A build in progress is one that `pg_stat_progress_create_index` shows, in this database, from a backend
/// other than this one. Locks on the index would not tell it: every writer of the table holds one on each of
/// its indexes, built or not. A build run by a role whose progress this role may not read shows without its
/// index; it is then taken for a build of every invalid index, so that nothing a live session is building is
/// ever dropped.
pub async fn index_states<'e>(db: impl PgExecutor<'e>) -> Result<Vec<IndexStatus>, sqlx::Error> {
    let owned = owned_indexes();
    let names: Vec<String> = owned.iter().map(|i| i.name.clone()).collect();
    let tables: Vec<String> = owned.iter().map(|i| i.table.clone()).collect();
    let rows = sqlx::query!(
        r#"select o.name as "name!", x.indexrelid::regclass::text as regclass,
                  coalesce(x.indisvalid, false) as "valid!",
                  exists (select 1 from pg_stat_progress_create_index p
                          where p.datid = (select oid from pg_database where datname = current_database())
                            and p.pid <> pg_backend_pid()
                            and (p.index_relid = x.indexrelid or p.index_relid is null)) as "building!"
           from unnest($1::text[], $2::text[]) as o(name, tbl)
           left join lateral (
               select i.indexrelid, i.indisvalid from pg_index i join pg_class c on c.oid = i.indexrelid
               where c.relname = o.name and i.indrelid = to_regclass(o.tbl)
           ) x on true"#,
        &names,
        &tables
    )
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|row| {
            let index = owned.iter().find(|i| i.name == row.name)?;
            let state = match (&row.regclass, row.valid, row.building) {
                (None, _, _) => IndexState::Missing,
                (Some(_), true, _) => IndexState::Valid,
                (Some(_), false, true) => IndexState::Building,
                (Some(_), false, false) => IndexState::Invalid,
            };
            Some(IndexStatus {
                index,
                state,
                regclass: row.regclass,
            })
        })
        .collect())
}

/// One way the database falls short of the schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gap {
    /// Nothing was ever migrated.
    NeverMigrated,
    /// An embedded migration is not recorded as applied.
    MigrationMissing { version: i64, description: String },
    /// A migration is recorded as failed.
    MigrationFailed { version: i64, description: String },
    /// An owned index is missing, INVALID, or still being built.
    Index { name: String, state: IndexState },
}

/// Every way the database falls short of the schema; empty when it has it all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gaps(pub Vec<Gap>);

impl Gaps {
    /// What `recorded` and `indexes` say is missing, invalid or failed.
    pub fn of(recorded: Option<&[Recorded]>, indexes: &[IndexStatus]) -> Gaps {
        let Some(recorded) = recorded else {
            return Gaps(vec![Gap::NeverMigrated]);
        };
        let mut gaps = Vec::new();
        for m in MIGRATOR.iter().filter(|m| m.migration_type.is_up_migration()) {
            let (version, description) = (m.version, m.description.to_string());
            match recorded.iter().find(|r| r.version == m.version) {
                None => gaps.push(Gap::MigrationMissing { version, description }),
                Some(r) if !r.success => gaps.push(Gap::MigrationFailed { version, description }),
                Some(_) => {}
            }
        }
        gaps.extend(
            indexes
                .iter()
                .filter(|s| s.state != IndexState::Valid)
                .map(|s| Gap::Index {
                    name: s.index.name.clone(),
                    state: s.state,
                }),
        );
        Gaps(gaps)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for Gaps {
    /// `migrations missing: V (description), …; indexes not valid: NAME missing, …; run `fine-settler migrate``
    /// — one clause per kind of gap, each naming every migration or index it is about.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.contains(&Gap::NeverMigrated) {
            let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
            return write!(
                f,
                "migrations missing: none applied, binary needs {latest}; run `fine-settler migrate`"
            );
        }
        let clause = |kind: &str, named: fn(&Gap) -> Option<String>| {
            let names: Vec<String> = self.0.iter().filter_map(named).collect();
            (!names.is_empty()).then(|| format!("{kind}: {}", names.join(", ")))
        };
        let clauses: Vec<String> = [
            clause("migrations missing", |g| match g {
                Gap::MigrationMissing { version, description } => Some(format!("{version} ({description})")),
                _ => None,
            }),
            clause("migrations failed", |g| match g {
                Gap::MigrationFailed { version, description } => Some(format!("{version} ({description})")),
                _ => None,
            }),
            clause("indexes not valid", |g| match g {
                Gap::Index { name, state } => Some(format!("{name} {}", state.describe())),
                _ => None,
            }),
        ]
        .into_iter()
        .flatten()
        .collect();
        write!(f, "{}; run `fine-settler migrate`", clauses.join("; "))
    }
}

impl IndexState {
    /// How the operator reads it after the index's name.
    fn describe(self) -> &'static str {
        match self {
            IndexState::Valid => "valid",
            IndexState::Invalid => "invalid (left by an interrupted build)",
            IndexState::Building => "being built",
            IndexState::Missing => "missing",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_recorded() -> Vec<Recorded> {
        MIGRATOR
            .iter()
            .map(|m| Recorded {
                version: m.version,
                success: true,
            })
            .collect()
    }

    fn all_valid() -> Vec<IndexStatus> {
        owned_indexes()
            .iter()
            .map(|index| IndexStatus {
                index,
                state: IndexState::Valid,
                regclass: Some(index.name.clone()),
            })
            .collect()
    }

    #[test]
    fn every_migration_recorded_and_every_index_valid_is_no_gap() {
        assert!(Gaps::of(Some(&all_recorded()), &all_valid()).is_empty());
    }

    #[test]
    fn a_database_never_migrated_says_so_and_what_the_binary_needs() {
        let gaps = Gaps::of(None, &[]);
        assert_eq!(gaps.0, vec![Gap::NeverMigrated]);
        assert!(
            gaps.to_string()
                .starts_with("migrations missing: none applied, binary needs 2"),
            "{gaps}"
        );
    }

    #[test]
    fn each_gap_is_named_once_in_its_clause() {
        let mut recorded = all_recorded();
        let middle = recorded.remove(2);
        recorded[0].success = false;
        let mut indexes = all_valid();
        indexes[0].state = IndexState::Missing;
        indexes[1].state = IndexState::Building;
        let gaps = Gaps::of(Some(&recorded), &indexes);
        let text = gaps.to_string();
        let first = MIGRATOR.iter().next().expect("a migration");
        let third = MIGRATOR.iter().nth(2).expect("three migrations");
        assert_eq!(middle.version, third.version);
        assert_eq!(
            text,
            format!(
                "migrations missing: {} ({}); migrations failed: {} ({}); indexes not valid: {} missing, {} being \
                 built; run `fine-settler migrate`",
                third.version,
                third.description,
                first.version,
                first.description,
                indexes[0].index.name,
                indexes[1].index.name
            )
        );
    }
}
