//! `migrate` on a Citus coordinator (`database.engine = "citus"`): the same migrations, sent one statement at
//! a time, then every table placed where its statements work and its batches stay on one worker (docs/citus.md).
//!
//! **One statement at a time.** Citus forwards some DDL (`create trigger` on a distributed table among it) to
//! the workers as the text it received, and refuses a text of several commands. The migrations are cut into
//! their statements ([`super::statements`]) and run as sqlx's migrator runs them — each in one transaction with
//! its row in `_sqlx_migrations` (the same table, version and checksum, so either engine's `migrate` takes over
//! from the other), a `-- no-transaction` migration statement by statement without one.
//!
//! **The placement**, done by every `migrate`, each step only when it is not done yet:
//! - `loans` hash-distributed by `id` — or left as libraryd distributed it, when that is by `id`; any other
//!   distribution is refused (the per-loan tables could not be colocated with it);
//! - `fine_ledger`, `fine_ledger_corrections`, `fine_pending` and `fine_loan_changes` distributed by `loan_id`,
//!   colocated with `loans`: a loan's rows live on its loan's worker, so a batch's join of a loan to its ledger
//!   and its change capture (a trigger on `loans`) never leave that worker;
//! - `fine_policies` and `library_closed_days` reference tables (a copy on every node): the fine rules read
//!   them inside the statements that run on the workers;
//! - the claims (`job_runs`, `job_run_attempts`), the pauses and `fine_settler_marks` stay plain tables of the
//!   coordinator: small, read and written by key, under the row locks and advisory locks the claim protocol
//!   rests on — which are the coordinator's, where every fine-settler statement is sent.
//!
//! Citus runs triggers on distributed and reference tables only with `citus.enable_unsafe_triggers` (set for
//! this connection): a trigger fires on each shard, so it must touch nothing but its own shard and the
//! colocated ones — fine-settler's do (`fine_settler_note_loan_change` writes the change queue's shard of the
//! same loan; the policy and calendar triggers read their own copy, migrations/20261203000058). A table is
//! distributed with its triggers dropped and put back after (the copy of its rows must not fire them).

use std::collections::HashMap;

use sqlx::{migrate::Migrate, migrate::MigrateError, Connection, Executor, PgConnection};

use super::{statements, MIGRATOR};
use crate::store::StoreError;

/// The tables distributed by `loan_id` beside `loans`.
const COLOCATED: [&str; 4] = [
    "fine_ledger",
    "fine_ledger_corrections",
    "fine_pending",
    "fine_loan_changes",
];
/// The reference tables.
const REFERENCE: [&str; 2] = ["fine_policies", "library_closed_days"];

/// Why the schema cannot be built on this Citus coordinator.
#[derive(Debug, thiserror::Error)]
pub enum CitusError {
    #[error(
        "database.engine is \"citus\", but the database has no citus extension: create it (and add the workers) \
         on the coordinator first, or set database.engine = \"postgresql\""
    )]
    NoExtension,
    #[error(
        "the database has the citus extension: set database.engine = \"citus\" to build fine-settler's tables \
         for it (docs/citus.md)"
    )]
    Undeclared,
    #[error(
        "{table} is {how} on this Citus cluster; fine-settler needs it hash-distributed by {column}{colocated} \
         (docs/citus.md)"
    )]
    Placed {
        table: &'static str,
        how: String,
        column: &'static str,
        colocated: &'static str,
    },
}

impl CitusError {
    /// `database.engine` does not say what the server is (nothing was written).
    pub fn is_engine_mismatch(&self) -> bool {
        matches!(self, CitusError::NoExtension | CitusError::Undeclared)
    }
}

/// Whether the database has the citus extension.
pub(super) async fn has_extension(conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar!(r#"select exists (select 1 from pg_extension where extname = 'citus') as "citus!""#)
        .fetch_one(conn)
        .await
}

/// Runs the migrations not yet applied and places the tables, on a database with the citus extension.
pub(super) async fn migrate(conn: &mut PgConnection) -> Result<(), StoreError> {
    conn.execute("set citus.enable_unsafe_triggers = on").await?;
    apply_migrations(conn).await?;
    place(conn).await?;
    conn.execute("reset citus.enable_unsafe_triggers").await?;
    Ok(())
}

/// sqlx's migrator, statement by statement: the same checks (a failed migration left behind, a migration
/// changed or gone since it was applied) and the same bookkeeping.
async fn apply_migrations(conn: &mut PgConnection) -> Result<(), MigrateError> {
    conn.ensure_migrations_table().await?;
    if let Some(version) = conn.dirty_version().await? {
        return Err(MigrateError::Dirty(version));
    }
    let applied: HashMap<i64, Vec<u8>> = conn
        .list_applied_migrations()
        .await?
        .into_iter()
        .map(|m| (m.version, m.checksum.into_owned()))
        .collect();
    let ours: Vec<_> = MIGRATOR
        .iter()
        .filter(|m| m.migration_type.is_up_migration())
        .collect();
    if let Some(gone) = applied.keys().find(|v| !ours.iter().any(|m| m.version == **v)) {
        return Err(MigrateError::VersionMissing(*gone));
    }
    for migration in ours {
        match applied.get(&migration.version) {
            Some(checksum) if checksum[..] != migration.checksum[..] => {
                return Err(MigrateError::VersionMismatch(migration.version));
            }
            Some(_) => {}
            None => apply(conn, migration).await?,
        }
    }
    Ok(())
}

async fn apply(conn: &mut PgConnection, migration: &sqlx::migrate::Migration) -> Result<(), MigrateError> {
    let failed = |e| MigrateError::ExecuteMigration(e, migration.version);
    let started = std::time::Instant::now();
    let record = sqlx::query(
        "insert into _sqlx_migrations (version, description, success, checksum, execution_time)
         values ($1, $2, true, $3, $4)",
    )
    .bind(migration.version)
    .bind(&*migration.description)
    .bind(&*migration.checksum);
    if migration.no_tx {
        for statement in statements::split(&migration.sql) {
            conn.execute(sqlx::raw_sql(&statement)).await.map_err(failed)?;
        }
        let took = i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX);
        record.bind(took).execute(&mut *conn).await?;
    } else {
        let mut tx = conn.begin().await?;
        for statement in statements::split(&migration.sql) {
            tx.execute(sqlx::raw_sql(&statement)).await.map_err(failed)?;
        }
        let took = i64::try_from(started.elapsed().as_nanos()).unwrap_or(i64::MAX);
        record.bind(took).execute(&mut *tx).await?;
        tx.commit().await?;
    }
    Ok(())
}

/// How Citus holds a table now.
#[derive(Debug, PartialEq, Eq)]
enum Placement {
    /// A plain table of the coordinator.
    Local,
    /// Hash-distributed by `column`, in colocation group `group`.
    Hash {
        column: String,
        group: i32,
    },
    Reference,
    /// Anything else (a Citus local table, a single-shard table), as Citus names it.
    Other(String),
}

/// Where `table` is, from `citus_tables` (Citus's catalog; not in the offline query data, which is built on
/// plain PostgreSQL, so the statement is checked at run time).
async fn placement(conn: &mut PgConnection, table: &str) -> Result<Placement, sqlx::Error> {
    let row: Option<(String, String, i32)> = sqlx::query_as(
        "select citus_table_type, distribution_column, colocation_id from citus_tables
         where table_name = to_regclass($1)",
    )
    .bind(table)
    .fetch_optional(conn)
    .await?;
    Ok(match row {
        None => Placement::Local,
        Some((kind, column, group)) => match kind.as_str() {
            "distributed" if column != "<none>" => Placement::Hash { column, group },
            "reference" => Placement::Reference,
            "local" => Placement::Other("a Citus local table".into()),
            other => Placement::Other(format!("a {other} table without a distribution column")),
        },
    })
}

/// Places every table (see the module's documentation), each step only when it is not done yet.
async fn place(conn: &mut PgConnection) -> Result<(), StoreError> {
    let loans_group = match placement(conn, "loans").await? {
        Placement::Local => {
            distribute(
                conn,
                "loans",
                Kind::Hash {
                    column: "id",
                    with: None,
                },
            )
            .await?;
            colocation_group(conn, "loans").await?
        }
        Placement::Hash { column, group } if column == "id" => group,
        other => return Err(misplaced("loans", "id", "", other).into()),
    };
    for table in COLOCATED {
        match placement(conn, table).await? {
            Placement::Local => {
                if table == "fine_loan_changes" {
                    key_by_loan(conn).await?;
                }
                let kind = Kind::Hash {
                    column: "loan_id",
                    with: Some("loans"),
                };
                distribute(conn, table, kind).await?;
            }
            Placement::Hash { column, group } if column == "loan_id" && group == loans_group => {}
            other => return Err(misplaced(table, "loan_id", ", colocated with loans", other).into()),
        }
    }
    for table in REFERENCE {
        match placement(conn, table).await? {
            Placement::Local => distribute(conn, table, Kind::Reference).await?,
            Placement::Reference => {}
            other => {
                return Err(CitusError::Placed {
                    table,
                    how: describe(&other),
                    column: "nothing (a reference table)",
                    colocated: "",
                }
                .into())
            }
        }
    }
    Ok(())
}

fn misplaced(
    table: &'static str,
    column: &'static str,
    colocated: &'static str,
    now: Placement,
) -> CitusError {
    CitusError::Placed {
        table,
        how: describe(&now),
        column,
        colocated,
    }
}

fn describe(placement: &Placement) -> String {
    match placement {
        Placement::Local => "a plain table of the coordinator".into(),
        Placement::Hash { column, .. } => format!("hash-distributed by {column}"),
        Placement::Reference => "a reference table".into(),
        Placement::Other(how) => how.clone(),
    }
}

async fn colocation_group(conn: &mut PgConnection, table: &str) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar("select colocation_id from citus_tables where table_name = to_regclass($1)")
        .bind(table)
        .fetch_one(conn)
        .await
}

/// The change queue's primary key made to include `loan_id`, as Citus requires of a distributed table's unique
/// keys (`seq` alone stays unique: it comes from one identity sequence).
async fn key_by_loan(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    conn.execute(
        "alter table fine_loan_changes drop constraint fine_loan_changes_pkey, \
         add constraint fine_loan_changes_pkey primary key (loan_id, seq)",
    )
    .await?;
    Ok(())
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Hash {
        column: &'static str,
        with: Option<&'static str>,
    },
    Reference,
}

/// Distributes `table` in one transaction, its triggers dropped for the copy of its rows and put back after,
/// and the coordinator's own copy of the rows (now on the shards) emptied.
async fn distribute(conn: &mut PgConnection, table: &'static str, kind: Kind) -> Result<(), sqlx::Error> {
    let mut tx = conn.begin().await?;
    let triggers = sqlx::query!(
        r#"select tgname::text as "name!", pg_get_triggerdef(oid) as "definition!"
           from pg_trigger where tgrelid = to_regclass($1) and not tgisinternal order by tgname"#,
        table
    )
    .fetch_all(&mut *tx)
    .await?;
    for t in &triggers {
        tx.execute(sqlx::raw_sql(&format!(
            "drop trigger {} on {table}",
            quote(&t.name)
        )))
        .await?;
    }
    match kind {
        Kind::Hash { column, with } => {
            sqlx::query("select create_distributed_table($1, $2, colocate_with => $3)")
                .bind(table)
                .bind(column)
                .bind(with.unwrap_or("default"))
                .execute(&mut *tx)
                .await?;
        }
        Kind::Reference => {
            sqlx::query("select create_reference_table($1)")
                .bind(table)
                .execute(&mut *tx)
                .await?;
        }
    }
    // (Before the triggers are back: `fine_policies` has one that refuses a truncate.)
    sqlx::query("select truncate_local_data_after_distributing_table($1)")
        .bind(table)
        .execute(&mut *tx)
        .await?;
    for t in &triggers {
        tx.execute(sqlx::raw_sql(&t.definition)).await?;
    }
    tx.commit().await?;
    tracing::info!(table, kind = ?kind, triggers = triggers.len(), "distributed a table on Citus");
    Ok(())
}

/// `name` as a quoted SQL identifier.
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
