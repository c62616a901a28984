//! The indexes fine-settler owns, read from the embedded migrations' own SQL rather than kept in a list: every
//! index a migration creates by name (`create [unique] index [concurrently] [if not exists] NAME on TABLE`)
//! and no later migration drops (`drop index [concurrently] [if exists] NAME, …`). A migration added tomorrow
//! is covered without anyone remembering to add its index here.
//!
//! An index is rebuilt by running the migration that creates it again, so a migration that wants an index under
//! another name creates the new one and drops the old one (`alter index … rename` is not followed).

use std::{collections::BTreeMap, sync::LazyLock};

use sqlx::migrate::Migration;

use super::MIGRATOR;

/// An index an embedded migration creates and no later one drops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedIndex {
    /// The index's name, as PostgreSQL stores it (unquoted names folded to lower case).
    pub name: String,
    /// The table it indexes, as the migration names it (resolved through `search_path`, like the migration).
    pub table: String,
    /// The version of the (latest) migration that creates it: running that migration again rebuilds it.
    pub migration: i64,
}

/// The indexes the embedded migrations own, by name.
pub fn owned_indexes() -> &'static [OwnedIndex] {
    static OWNED: LazyLock<Vec<OwnedIndex>> = LazyLock::new(|| owned_by(MIGRATOR.iter()));
    &OWNED
}

/// An index an embedded migration created and a later one dropped (and none created again since).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetiredIndex {
    /// The index's name, as PostgreSQL stores it.
    pub name: String,
    /// The version of the migration that drops it.
    pub dropped_by: i64,
}

/// The indexes the embedded migrations retired, by name.
///
/// A binary from before the drop still owns such an index: its readiness reports it missing, and its `migrate`
/// forgets the migration that built it and builds it again — after which the drop, already recorded, never runs
/// again. So `migrate` drops a retired index it finds ([`super::repair::drop_retired`]).
pub fn retired_indexes() -> &'static [RetiredIndex] {
    static RETIRED: LazyLock<Vec<RetiredIndex>> = LazyLock::new(|| retired_by(MIGRATOR.iter()));
    &RETIRED
}

/// The indexes `migrations` (in version order) leave behind, by name.
fn owned_by<'m>(migrations: impl Iterator<Item = &'m Migration>) -> Vec<OwnedIndex> {
    owned_and_retired(migrations).0
}

/// The indexes `migrations` (in version order) created and then dropped, by name.
fn retired_by<'m>(migrations: impl Iterator<Item = &'m Migration>) -> Vec<RetiredIndex> {
    owned_and_retired(migrations).1
}

/// What `migrations` (in version order) leave behind: the indexes they own, and those they retired.
fn owned_and_retired<'m>(
    migrations: impl Iterator<Item = &'m Migration>,
) -> (Vec<OwnedIndex>, Vec<RetiredIndex>) {
    let mut owned = BTreeMap::new();
    let mut retired = BTreeMap::new();
    for migration in migrations.filter(|m| m.migration_type.is_up_migration()) {
        for change in index_changes(&migration.sql) {
            match change {
                IndexChange::Created { name, table } => {
                    retired.remove(&name);
                    let migration = migration.version;
                    owned.insert(
                        name.clone(),
                        OwnedIndex {
                            name,
                            table,
                            migration,
                        },
                    );
                }
                IndexChange::Dropped { name } => {
                    if owned.remove(&name).is_some() {
                        let dropped_by = migration.version;
                        retired.insert(name.clone(), RetiredIndex { name, dropped_by });
                    }
                }
                IndexChange::Unnamed => {}
            }
        }
    }
    (owned.into_values().collect(), retired.into_values().collect())
}

/// What one statement of a migration does to an index.
#[derive(Debug, PartialEq, Eq)]
enum IndexChange {
    Created {
        name: String,
        table: String,
    },
    Dropped {
        name: String,
    },
    /// `create index on …` without a name: PostgreSQL picks one, so nothing can own it (a test keeps the
    /// migrations free of them).
    Unnamed,
}

/// A token of SQL: a word (keyword or identifier, unquoted ones folded to lower case, a qualified name kept
/// whole) or one punctuation character.
#[derive(Debug, PartialEq, Eq)]
enum Token {
    Word(String),
    Punct(char),
}

impl Token {
    fn is(&self, word: &str) -> bool {
        matches!(self, Token::Word(w) if w == word)
    }
}

/// The index statements in `sql`, in order.
fn index_changes(sql: &str) -> Vec<IndexChange> {
    let tokens = tokens(sql);
    let mut changes = Vec::new();
    let mut at = 0;
    while at < tokens.len() {
        let rest = &tokens[at..];
        if rest[0].is("create") {
            if let Some(change) = create_index(&rest[1..]) {
                changes.push(change);
            }
        } else if rest[0].is("drop") && rest.get(1).is_some_and(|t| t.is("index")) {
            changes.extend(drop_index(&rest[2..]));
        }
        at += 1;
    }
    changes
}

/// `[unique] index [concurrently] [if not exists] NAME on [only] TABLE`, after `create`.
fn create_index(tokens: &[Token]) -> Option<IndexChange> {
    let mut words = tokens.iter().peekable();
    words.next_if(|t| t.is("unique"));
    words.next_if(|t| t.is("index"))?;
    words.next_if(|t| t.is("concurrently"));
    if words.next_if(|t| t.is("if")).is_some() {
        words.next_if(|t| t.is("not"))?;
        words.next_if(|t| t.is("exists"))?;
    }
    let name = match words.next()? {
        Token::Word(w) if w == "on" => return Some(IndexChange::Unnamed),
        Token::Word(w) => unqualified(w),
        Token::Punct(_) => return None,
    };
    words.next_if(|t| t.is("on"))?;
    words.next_if(|t| t.is("only"));
    match words.next()? {
        Token::Word(table) => Some(IndexChange::Created {
            name,
            table: table.clone(),
        }),
        Token::Punct(_) => None,
    }
}

/// `[concurrently] [if exists] NAME [, NAME]…`, after `drop index`.
fn drop_index(tokens: &[Token]) -> Vec<IndexChange> {
    let mut words = tokens.iter().peekable();
    words.next_if(|t| t.is("concurrently"));
    if words.next_if(|t| t.is("if")).is_some() && words.next_if(|t| t.is("exists")).is_none() {
        return Vec::new();
    }
    let mut dropped = Vec::new();
    while let Some(Token::Word(name)) = words.next() {
        dropped.push(IndexChange::Dropped {
            name: unqualified(name),
        });
        if words.next_if(|t| **t == Token::Punct(',')).is_none() {
            break;
        }
    }
    dropped
}

/// An index's own name: an index lives in its table's schema, so a qualified name's schema says nothing more.
fn unqualified(name: &str) -> String {
    name.rsplit('.').next().unwrap_or(name).to_string()
}

/// `sql` as tokens, without comments, string literals and dollar-quoted bodies (a function's body or a `do`
/// block is not a statement of the migration itself).
fn tokens(sql: &str) -> Vec<Token> {
    let mut tokens = Vec::new();
    let mut rest = sql;
    while let Some(c) = rest.chars().next() {
        let skipped = if rest.starts_with("--") {
            rest.find('\n').unwrap_or(rest.len())
        } else if rest.starts_with("/*") {
            rest.find("*/").map_or(rest.len(), |end| end + 2)
        } else if c == '\'' {
            rest[1..].find('\'').map_or(rest.len(), |end| end + 2)
        } else if let Some(tag) = dollar_tag(rest) {
            rest[tag.len()..]
                .find(tag)
                .map_or(rest.len(), |end| 2 * tag.len() + end)
        } else if c.is_whitespace() {
            c.len_utf8()
        } else {
            let (token, len) = token(rest);
            tokens.push(token);
            len
        };
        rest = &rest[skipped..];
    }
    tokens
}

/// The opening `$tag$` (or `$$`) of a dollar-quoted string at the start of `sql`.
fn dollar_tag(sql: &str) -> Option<&str> {
    let inner = sql.strip_prefix('$')?;
    let end = inner.find('$')?;
    inner[..end]
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
        .then(|| &sql[..end + 2])
}

/// The word or punctuation character at the start of `sql`, and its length. A word runs on through quoted and
/// unquoted parts and dots (`public."Loans"` is one word).
fn token(sql: &str) -> (Token, usize) {
    let mut word = String::new();
    let mut end = 0;
    while let Some(c) = sql[end..].chars().next() {
        if c == '"' {
            let quoted = &sql[end + 1..];
            let close = quoted.find('"').unwrap_or(quoted.len());
            word.push_str(&quoted[..close]);
            end = (end + close + 2).min(sql.len());
        } else if c.is_alphanumeric() || c == '_' || c == '.' || (c == '$' && end > 0) {
            word.extend(c.to_lowercase());
            end += c.len_utf8();
        } else {
            break;
        }
    }
    match sql.chars().next() {
        Some(c) if end == 0 => (Token::Punct(c), c.len_utf8()),
        _ => (Token::Word(word), end),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn created(name: &str, table: &str) -> IndexChange {
        IndexChange::Created {
            name: name.into(),
            table: table.into(),
        }
    }

    #[test]
    fn every_form_of_create_index_is_read_with_its_table() {
        let sql = "-- create index commented_idx on loans (id)
            create index if not exists a_idx on loans (id);
            create unique index b_idx on only public.job_runs (x) where y = 'create index quoted_idx on t';
            create index concurrently if not exists C_Idx
                on loans (due_on, id) include (returned_on) where returned_on is null;
            CREATE UNIQUE INDEX CONCURRENTLY \"Quoted Idx\" ON \"Loans\" (id);
            /* create index block_idx on loans (id) */
            create index on loans (book_id);";
        assert_eq!(
            index_changes(sql),
            vec![
                created("a_idx", "loans"),
                created("b_idx", "public.job_runs"),
                created("c_idx", "loans"),
                created("Quoted Idx", "Loans"),
                IndexChange::Unnamed,
            ]
        );
    }

    #[test]
    fn a_function_body_or_do_block_is_not_read() {
        let sql = "create function f() returns void language sql as $$ create index in_body_idx on t (x) $$;
            do $body$ begin execute 'create index in_do_idx on t (x)'; end $body$;
            create index after_idx on t (x);";
        assert_eq!(index_changes(sql), vec![created("after_idx", "t")]);
    }

    #[test]
    fn unterminated_quotes_and_comments_end_the_text() {
        for sql in [
            "create index \"open",
            "create index 'open",
            "/* open",
            "$$ open",
            "$tag$ open $",
        ] {
            assert!(index_changes(sql).is_empty(), "{sql}");
        }
        assert_eq!(index_changes("create index \"a\" on t"), vec![created("a", "t")]);
    }

    #[test]
    fn drop_index_in_every_form() {
        let sql = "drop index a_idx; drop index concurrently if exists public.b_idx, c_idx cascade;
            drop table d; drop index if exists;";
        let dropped = |n: &str| IndexChange::Dropped { name: n.into() };
        assert_eq!(
            index_changes(sql),
            vec![dropped("a_idx"), dropped("b_idx"), dropped("c_idx")]
        );
    }

    #[test]
    fn an_index_dropped_later_is_not_owned_and_one_created_again_belongs_to_its_last_migration() {
        let migration = |version: i64, sql: &'static str| {
            Migration::new(
                version,
                "m".into(),
                sqlx::migrate::MigrationType::Simple,
                sql.into(),
                false,
            )
        };
        let migrations = [
            migration(
                1,
                "create index if not exists kept_idx on loans (id); create index gone_idx on loans (x);",
            ),
            migration(2, "drop index concurrently if exists gone_idx;"),
            migration(3, "create index if not exists kept_idx on loans (id, due_on);"),
            migration(
                4,
                "create index back_idx on loans (y); drop index back_idx; drop index never_ours_idx;",
            ),
            migration(5, "create index back_idx on loans (y, z);"),
        ];
        assert_eq!(
            owned_by(migrations.iter()),
            vec![
                OwnedIndex {
                    name: "back_idx".into(),
                    table: "loans".into(),
                    migration: 5
                },
                OwnedIndex {
                    name: "kept_idx".into(),
                    table: "loans".into(),
                    migration: 3
                }
            ]
        );
        // Retired: dropped after it was created, and not created again since; an index never created is not.
        assert_eq!(
            retired_by(migrations.iter()),
            vec![RetiredIndex {
                name: "gone_idx".into(),
                dropped_by: 2
            }]
        );
    }

    #[test]
    fn the_embedded_migrations_name_every_index_they_create() {
        for m in MIGRATOR.iter() {
            assert!(
                !index_changes(&m.sql).contains(&IndexChange::Unnamed),
                "migration {} creates an index without a name: nothing can tell whether it exists",
                m.version
            );
        }
        let owned = owned_indexes();
        let named = |name: &str| owned.iter().find(|i| i.name == name);
        // Two of them, as examples: one built concurrently on libraryd's table, one in a transaction.
        assert_eq!(
            named("loans_unsettled_returned_idx").map(|i| (i.table.as_str(), i.migration)),
            Some(("loans", 20261101000003))
        );
        assert_eq!(
            named("job_run_attempts_key_idx").map(|i| (i.table.as_str(), i.migration)),
            Some(("job_run_attempts", 20261101000002))
        );
        let retired: Vec<(&str, i64)> = retired_indexes()
            .iter()
            .map(|i| (i.name.as_str(), i.dropped_by))
            .collect();
        assert_eq!(
            retired,
            vec![
                ("loans_open_by_due_idx", 20261203000059),
                ("loans_returned_late_idx", 20261203000060)
            ]
        );
    }
}
