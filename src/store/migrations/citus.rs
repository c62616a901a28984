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
    #[error(
        "the reference table {table} has no copy on the coordinator, whose statements read it: add the \
         coordinator to the cluster's metadata (select citus_set_coordinator_host('<its host>', <its port>))"
    )]
    NoCoordinatorCopy { table: String },
    #[error(
        "this Citus node is not the coordinator: point database.url at the coordinator, where the statements of \
         every replica go"
    )]
    NotCoordinator,
    #[error(
        "{table} has triggers fine-settler did not create ({triggers}): distribute it yourself, with its \
         triggers as they must be on Citus (docs/citus.md), then run migrate again"
    )]
    ForeignTriggers { table: &'static str, triggers: String },
}

impl CitusError {
    /// `database.engine` does not say what the server is (nothing was written).
    pub fn is_engine_mismatch(&self) -> bool {
        matches!(
            self,
            CitusError::NoExtension | CitusError::Undeclared | CitusError::NotCoordinator
        )
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
    let coordinator: bool = sqlx::query_scalar("select citus_is_coordinator()")
        .fetch_one(&mut *conn)
        .await?;
    if !coordinator {
        return Err(CitusError::NotCoordinator.into());
    }
    conn.execute("set citus.enable_unsafe_triggers = on").await?;
    apply_migrations(conn).await?;
    place(conn).await?;
    bind_rules(conn).await?;
    keep_rules_whole(conn).await?;
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
    if migration.no_tx && builds_only_valid_indexes(conn, migration.version).await? {
        // Citus turns an index that exists INVALID when `create index concurrently if not exists` runs again
        // (citusdata/citus#8338): a migration run again after a crash between its build and its record, or
        // one whose index was built by hand, is recorded without running.
        record.bind(0_i64).execute(&mut *conn).await?;
        return Ok(());
    }
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

/// Whether migration `version` builds indexes fine-settler owns and every one of them exists and is valid.
async fn builds_only_valid_indexes(conn: &mut PgConnection, version: i64) -> Result<bool, sqlx::Error> {
    let states = super::schema::index_states(&mut *conn).await?;
    let mine: Vec<_> = states.iter().filter(|s| s.index.migration == version).collect();
    Ok(!mine.is_empty() && mine.iter().all(|s| s.state == super::schema::IndexState::Valid))
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
    let how = match &now {
        // The right column, in another colocation group than loans.
        Placement::Hash { column: c, group } if c == column => {
            format!("hash-distributed by {c} but not colocated with loans (colocation group {group})")
        }
        other => describe(other),
    };
    CitusError::Placed {
        table,
        how,
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

/// What a table needs before Citus distributes it: the change queue's primary key made to include `loan_id`,
/// as Citus requires of a distributed table's unique keys (`seq` alone stays unique: it comes from one identity
/// sequence).
fn before_distributing(table: &str) -> Option<&'static str> {
    (table == "fine_loan_changes").then_some(
        "alter table fine_loan_changes drop constraint fine_loan_changes_pkey, \
         add constraint fine_loan_changes_pkey primary key (loan_id, seq)",
    )
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Hash {
        column: &'static str,
        with: Option<&'static str>,
    },
    Reference,
}

impl Kind {
    /// Has Citus distribute `table` this way.
    async fn create(self, tx: &mut PgConnection, table: &str) -> Result<(), sqlx::Error> {
        match self {
            Kind::Hash { column, with } => {
                sqlx::query("select create_distributed_table($1, $2, colocate_with => $3)")
                    .bind(table)
                    .bind(column)
                    .bind(with.unwrap_or("default"))
                    .execute(tx)
                    .await?;
            }
            Kind::Reference => {
                sqlx::query("select create_reference_table($1)")
                    .bind(table)
                    .execute(tx)
                    .await?;
            }
        }
        Ok(())
    }
}

/// A trigger of a table being distributed: taken off for the copy of the table's rows, put back after as it
/// was.
struct Trigger {
    name: String,
    definition: String,
    /// `pg_trigger.tgenabled`: `O` (fires), `D` (disabled), `A` (always), `R` (replica sessions only).
    enabled: String,
}

impl Trigger {
    /// The triggers of `table`, which must all be fine-settler's own: another's (libraryd's, on `loans`) would
    /// be put back without its comment, and run on the shards without Citus's check that it may.
    async fn of(tx: &mut PgConnection, table: &'static str) -> Result<Vec<Trigger>, StoreError> {
        let triggers: Vec<Trigger> = sqlx::query_as!(
            Trigger,
            r#"select tgname::text as "name!", pg_get_triggerdef(oid) as "definition!",
                      tgenabled::text as "enabled!"
               from pg_trigger where tgrelid = to_regclass($1) and not tgisinternal order by tgname"#,
            table
        )
        .fetch_all(&mut *tx)
        .await?;
        let others: Vec<&str> = triggers
            .iter()
            .map(|t| t.name.as_str())
            .filter(|name| !name.starts_with("fine_settler_"))
            .collect();
        if !others.is_empty() {
            let triggers = others.join(", ");
            return Err(CitusError::ForeignTriggers { table, triggers }.into());
        }
        Ok(triggers)
    }

    async fn take_off(&self, tx: &mut PgConnection, table: &str) -> Result<(), sqlx::Error> {
        let statement = format!("drop trigger {} on {table}", quote(&self.name));
        tx.execute(sqlx::raw_sql(&statement)).await?;
        Ok(())
    }

    /// Created again, and disabled (or firing always, or in replica sessions only) if it was.
    async fn put_back(&self, tx: &mut PgConnection, table: &str) -> Result<(), sqlx::Error> {
        tx.execute(sqlx::raw_sql(&self.definition)).await?;
        let state = match self.enabled.as_str() {
            "D" => "disable trigger",
            "A" => "enable always trigger",
            "R" => "enable replica trigger",
            _ => return Ok(()),
        };
        let statement = format!("alter table {table} {state} {}", quote(&self.name));
        tx.execute(sqlx::raw_sql(&statement)).await?;
        Ok(())
    }
}

/// Distributes `table` in one transaction, its triggers taken off for the copy of its rows and put back after,
/// and the coordinator's own copy of the rows (now on the shards) emptied.
async fn distribute(conn: &mut PgConnection, table: &'static str, kind: Kind) -> Result<(), StoreError> {
    let mut tx = conn.begin().await?;
    let triggers = Trigger::of(&mut tx, table).await?;
    if let Some(statement) = before_distributing(table) {
        tx.execute(statement).await?;
    }
    for t in &triggers {
        t.take_off(&mut tx, table).await?;
    }
    kind.create(&mut tx, table).await?;
    // (Before the triggers are back: `fine_policies` has one that refuses a truncate.)
    sqlx::query("select truncate_local_data_after_distributing_table($1)")
        .bind(table)
        .execute(&mut *tx)
        .await?;
    for t in &triggers {
        t.put_back(&mut tx, table).await?;
    }
    tx.commit().await?;
    tracing::info!(table, kind = ?kind, triggers = triggers.len(), "distributed a table on Citus");
    Ok(())
}

/// The fine rules' functions made to read the reference tables' shards: on Citus a reference table's rows are
/// in its one shard (`fine_policies_<shard id>`, the same name on every node, the coordinator included), and
/// the table's own name on a worker is an empty stand-in. A statement routed to a worker runs there as plain
/// PostgreSQL, which inlines the rule functions: named by the table, they would find no policy and no closed
/// day. Every function of fine-settler's schema whose body names `fine_policies` or `library_closed_days`
/// (qualified, as the migrations write them) is defined again with the shard's name instead; Citus sends the
/// new definition to every node. Done at every `migrate` (a later migration may define a rule function again).
async fn bind_rules(conn: &mut PgConnection) -> Result<(), StoreError> {
    let schema: String = sqlx::query_scalar("select quote_ident(current_schema())")
        .fetch_one(&mut *conn)
        .await?;
    let shards: Vec<(String, i64, bool)> = sqlx::query_as(
        "select c.relname::text, s.shardid,
                exists (select 1 from pg_dist_placement p where p.shardid = s.shardid and p.groupid = 0)
         from pg_dist_shard s join pg_class c on c.oid = s.logicalrelid
         where c.relnamespace = current_schema()::regnamespace
           and c.relname in ('fine_policies', 'library_closed_days')",
    )
    .fetch_all(&mut *conn)
    .await?;
    if let Some((table, _, _)) = shards.iter().find(|(_, _, on_coordinator)| !on_coordinator) {
        return Err(CitusError::NoCoordinatorCopy { table: table.clone() }.into());
    }
    let functions: Vec<(String, String)> = sqlx::query_as(
        "select p.oid::regprocedure::text, pg_get_functiondef(p.oid) from pg_proc p
         where p.pronamespace = current_schema()::regnamespace and p.prokind = 'f'
           and p.proname like 'fine\\_settler\\_%'
           and (p.prosrc like '%.fine_policies%' or p.prosrc like '%.library_closed_days%')",
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut bound = 0;
    for (function, definition) in functions {
        let mut new = definition.clone();
        for (table, shard, _) in &shards {
            new = bind(
                &new,
                &format!("{schema}.{table}"),
                &format!("{schema}.{table}_{shard}"),
            );
        }
        if new != definition {
            conn.execute(sqlx::raw_sql(&new)).await?;
            tracing::debug!(function, "a rule function reads the reference tables' shards");
            bound += 1;
        }
    }
    if bound > 0 {
        tracing::info!(
            functions = bound,
            "bound the fine rules to the reference tables' shards"
        );
    }
    Ok(())
}

/// The fine rules' table functions (those a statement joins as `fine_settler_policy_of(…) p`; and every other
/// table function of fine-settler's, such as the queue's counts the tick reads) made opaque to the coordinator's
/// planner: each gets a `search_path` setting of its own, which keeps PostgreSQL from inlining
/// its body into the statement. Inlined, a rule function's body joins a reference table's shard into a
/// statement over distributed tables, and Citus 14.0.1 refuses to plan it when the statement has parameters
/// ("parameterized queries for SQL functions referencing distributed tables are not supported", measured on
/// every accrual statement). Called as functions, the rules run where the statement runs — on each worker, over
/// that worker's copy of the reference tables (their bodies name the shards, [`bind_rules`]) — and the
/// statement plans. Their bodies name fine-settler's objects with its schema, which the setting keeps on the path.
/// Only on Citus: on PostgreSQL the inlined rules are what lets the planner cache a policy per class and due date.
async fn keep_rules_whole(conn: &mut PgConnection) -> Result<(), StoreError> {
    let functions: Vec<String> = sqlx::query_scalar(
        "select p.oid::regprocedure::text from pg_proc p
         where p.pronamespace = current_schema()::regnamespace and p.prokind = 'f' and p.proretset
           and p.prolang = (select oid from pg_language where lanname = 'sql')
           and p.proname like 'fine\\_settler\\_%'
           and not coalesce(exists (select 1 from unnest(p.proconfig) c where c like 'search\\_path=%'), false)",
    )
    .fetch_all(&mut *conn)
    .await?;
    let schema: String = sqlx::query_scalar("select quote_ident(current_schema())")
        .fetch_one(&mut *conn)
        .await?;
    for function in &functions {
        let alter = format!("alter function {function} set search_path = pg_catalog, {schema}");
        conn.execute(sqlx::raw_sql(&alter)).await?;
    }
    if !functions.is_empty() {
        tracing::info!(
            functions = functions.len(),
            "kept the fine rules' table functions from inlining"
        );
    }
    Ok(())
}

/// `text` with every `name` that is a whole name (not followed by a letter, digit, `_` or `$`) replaced by
/// `with`.
fn bind(text: &str, name: &str, with: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(name) {
        let after = &rest[at + name.len()..];
        out.push_str(&rest[..at]);
        if after.starts_with(|c: char| c.is_alphanumeric() || c == '_' || c == '$') {
            out.push_str(name);
        } else {
            out.push_str(with);
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

/// `name` as a quoted SQL identifier.
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::bind;

    #[test]
    fn a_table_name_is_bound_where_it_is_a_whole_name() {
        let body = "select 1 from public.fine_policies f, public.fine_policies_9 g, public.fine_policies\n \
                    where x = public.fine_policiesx or public.fine_policies$";
        assert_eq!(
            bind(body, "public.fine_policies", "public.fine_policies_102"),
            "select 1 from public.fine_policies_102 f, public.fine_policies_9 g, public.fine_policies_102\n \
             where x = public.fine_policiesx or public.fine_policies$"
        );
        // Bound twice: the same.
        let once = bind(body, "public.fine_policies", "public.fine_policies_102");
        assert_eq!(
            bind(&once, "public.fine_policies", "public.fine_policies_102"),
            once
        );
    }
}
