//! fine-settler's schema on a real Citus cluster (`database.engine = "citus"`): `migrate` distributes `loans`
//! by id (or keeps libraryd's distribution by id, and refuses any other), colocates the per-loan tables with it,
//! makes the rules' tables reference tables, and leaves the claims on the coordinator; the triggers work on the
//! shards; and an engine that does not match the server is a configuration error that writes nothing.
//!
//! The Citus tests need the cluster of `scripts/citus.sh` (a coordinator and two workers on the ports after
//! it): `scripts/test.sh --citus` starts it and runs them with `FINE_SETTLER_CITUS_URL` set to the coordinator's
//! URL. Each makes a database of its own on the cluster and drops it at the end.

mod accrual;
mod chaos;
mod settle;
mod throttle;
mod verify;

use std::process::Output;

use sqlx::{postgres::PgPoolOptions, PgPool};

pub(crate) use crate::helpers::CitusDb;
use crate::helpers::{assert_success, fine_settler, output, report};

/// `fine-settler migrate` with `database.engine = engine` against `url`.
fn migrate(url: &str, engine: &str) -> Output {
    let mut cmd = fine_settler(url);
    cmd.env("FINE_SETTLER__DATABASE__ENGINE", engine).arg("migrate");
    output(cmd)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `engine = "citus"` against a server without Citus: exit 2, the key named, nothing written.
#[sqlx::test(migrations = false)]
async fn the_citus_engine_on_a_server_without_citus_is_refused_before_writing(pool: PgPool) {
    let out = migrate(&crate::helpers::database_url(&pool), "citus");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("database.engine"), "{}", stderr(&out));
    let written: bool = sqlx::query_scalar("select to_regclass('_sqlx_migrations') is not null")
        .fetch_one(&pool)
        .await
        .expect("a statement on the cluster");
    assert!(!written, "the migrations table was created");
}

impl CitusDb {
    /// libraryd's `loans` (its own columns only), with `n` loans, one in two returned.
    async fn libraryd_loans(&self, n: i64) {
        sqlx::raw_sql(
            "create table loans (id bigint primary key, member_id bigint not null, book_id bigint not null,
                                 borrowed_on date not null, due_on date not null, returned_on date)",
        )
        .execute(&self.pool)
        .await
        .expect("a statement on the cluster");
        sqlx::query(
            "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
             select g, g % 100, g, date '2026-10-01', date '2026-10-10',
                    case when g % 2 = 0 then date '2026-10-20' end
             from generate_series(1, $1) g",
        )
        .bind(n)
        .execute(&self.pool)
        .await
        .expect("a statement on the cluster");
    }

    /// Each table of fine-settler's schema as `citus_tables` shows it: (name, type, distribution column,
    /// colocation group, shard count); a table missing from it is a plain table of the coordinator.
    async fn placements(&self) -> Vec<(String, String, String, i32, i32)> {
        sqlx::query_as(
            "select table_name::text, citus_table_type, distribution_column, colocation_id, shard_count::int
             from citus_tables order by 1",
        )
        .fetch_all(&self.pool)
        .await
        .expect("a statement on the cluster")
    }
}

async fn on_worker(url: &str, sql: &str) -> Vec<(String,)> {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .expect("connect to a worker");
    let rows = sqlx::query_as(sql)
        .fetch_all(&pool)
        .await
        .expect("a statement on the cluster");
    pool.close().await;
    rows
}

fn expected(shards: i32) -> Vec<(String, String, String, i32, i32)> {
    let loans = |t: &str, col: &str| {
        (
            t.to_string(),
            "distributed".to_string(),
            col.to_string(),
            1,
            shards,
        )
    };
    let reference = |t: &str| (t.to_string(), "reference".to_string(), "<none>".to_string(), 2, 1);
    vec![
        loans("fine_ledger", "loan_id"),
        loans("fine_ledger_corrections", "loan_id"),
        loans("fine_loan_changes", "loan_id"),
        loans("fine_pending", "loan_id"),
        reference("fine_policies"),
        reference("library_closed_days"),
        loans("loans", "id"),
    ]
}

/// Only the placement's kinds (the colocation groups' numbers are Citus's to pick): loans and the per-loan
/// tables share one group, the reference tables another.
fn normalised(mut rows: Vec<(String, String, String, i32, i32)>) -> Vec<(String, String, String, i32, i32)> {
    let loans_group = rows.iter().find(|r| r.0 == "loans").map(|r| r.3);
    for r in &mut rows {
        r.3 = if Some(r.3) == loans_group { 1 } else { 2 };
    }
    rows
}

#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn migrate_distributes_a_local_loans_table_and_places_every_table_beside_it() {
    let db = CitusDb::new("local").await;
    db.libraryd_loans(1000).await;
    let out = migrate(&db.url, "citus");
    assert_success(&out);
    let shards: i32 = sqlx::query_scalar("select current_setting('citus.shard_count')::int")
        .fetch_one(&db.pool)
        .await
        .expect("a statement on the cluster");
    assert_eq!(normalised(db.placements().await), expected(shards));
    // The rows moved to the shards, none lost; the coordinator's own copy emptied.
    let (all, local): (i64, i64) =
        sqlx::query_as("select (select count(*) from loans), pg_relation_size('loans')")
            .fetch_one(&db.pool)
            .await
            .expect("a statement on the cluster");
    assert_eq!((all, local), (1000, 0));
    // Again: nothing to do, nothing changed.
    assert_success(&migrate(&db.url, "citus"));
    assert_eq!(normalised(db.placements().await), expected(shards));
    // The claims stay on the coordinator.
    let job_runs: Option<String> = sqlx::query_scalar(
        "select table_name::text from citus_tables where table_name = 'job_runs'::regclass",
    )
    .fetch_optional(&db.pool)
    .await
    .expect("a statement on the cluster");
    assert_eq!(job_runs, None);
    // The engine must say what the server is.
    let out = migrate(&db.url, "postgresql");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("database.engine = \"citus\""),
        "{}",
        stderr(&out)
    );
    db.drop().await;
}

#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn libraryds_own_distribution_by_id_is_kept_and_any_other_refused() {
    let db = CitusDb::new("byid").await;
    db.libraryd_loans(100).await;
    sqlx::raw_sql("select create_distributed_table('loans', 'id', shard_count => 4)")
        .execute(&db.pool)
        .await
        .expect("a statement on the cluster");
    assert_success(&migrate(&db.url, "citus"));
    assert_eq!(normalised(db.placements().await), expected(4));
    db.drop().await;

    let db = CitusDb::new("bymember").await;
    db.libraryd_loans(100).await;
    // (A table distributed by member_id has its key include it.)
    sqlx::raw_sql(
        "alter table loans drop constraint loans_pkey, add primary key (member_id, id);
         select create_distributed_table('loans', 'member_id')",
    )
    .execute(&db.pool)
    .await
    .expect("a statement on the cluster");
    let out = migrate(&db.url, "citus");
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("loans is hash-distributed by member_id on this Citus cluster; fine-settler needs it hash-distributed by id"),
        "{}",
        stderr(&out)
    );
    db.drop().await;
}

#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn the_triggers_work_on_the_shards_and_on_every_copy_of_a_reference_table() {
    let db = CitusDb::new("triggers").await;
    db.libraryd_loans(10).await;
    assert_success(&migrate(&db.url, "citus"));
    // The change capture: a loan's change is queued on its own worker (the queue's shard of the same loan).
    sqlx::raw_sql(
        "delete from fine_loan_changes; update loans set returned_on = date '2026-10-15' where id = 7",
    )
    .execute(&db.pool)
    .await
    .expect("a statement on the cluster");
    let queued: Vec<i64> = sqlx::query_scalar("select loan_id from fine_loan_changes")
        .fetch_all(&db.pool)
        .await
        .expect("a statement on the cluster");
    assert_eq!(queued, vec![7]);
    // The calendar's numbering runs on every copy, each numbering itself.
    let mut cmd = fine_settler(&db.url);
    cmd.args([
        "calendar",
        "close",
        "--from",
        "2027-01-04",
        "--to",
        "2027-01-05",
        "--reason",
        "inventory",
    ]);
    let out = output(cmd);
    assert_success(&out);
    let mut cmd = fine_settler(&db.url);
    cmd.args([
        "calendar",
        "close",
        "--from",
        "2027-01-02",
        "--to",
        "2027-01-02",
        "--reason",
        "holiday",
    ]);
    assert_success(&output(cmd));
    for worker in &db.workers {
        let rows = on_worker(
            worker,
            "select string_agg(day::text || '=' || ordinal, ',' order by day) from library_closed_days",
        )
        .await;
        assert_eq!(
            rows,
            vec![("2027-01-02=1,2027-01-04=2,2027-01-05=3".to_string(),)],
            "{worker}"
        );
    }
    // A policy version is history, and a new one takes effect from today on — on every copy.
    let refused = sqlx::raw_sql("update fine_policies set daily_rate_cents = 1")
        .execute(&db.pool)
        .await
        .expect_err("a policy row was updated");
    assert!(
        refused.to_string().contains("never updated or deleted"),
        "{refused}"
    );
    let refused = sqlx::raw_sql(
        "insert into fine_policies (fine_class, effective_from, daily_rate_cents) values ('dvd', current_date - 1, 5)",
    )
    .execute(&db.pool)
    .await
    .expect_err("a policy in the past was added");
    assert!(refused.to_string().contains("from today on"), "{refused}");
    sqlx::raw_sql(
        "insert into fine_policies (fine_class, effective_from, daily_rate_cents) values ('dvd', current_date + 1, 5)",
    )
    .execute(&db.pool)
    .await
    .expect("a policy from tomorrow is added");
    for worker in &db.workers {
        let rows = on_worker(
            worker,
            "select string_agg(fine_class, ',' order by fine_class) from fine_policies",
        )
        .await;
        assert_eq!(rows, vec![("default,dvd".to_string(),)], "{worker}");
    }
    db.drop().await;
}

/// The fine rules read the reference tables' shards, where the rows are: a statement routed to one worker and a
/// statement on every shard both price a loan by the policy and the closed days.
#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn the_fine_rules_read_the_policies_and_closed_days_on_the_workers() {
    let db = CitusDb::new("rules").await;
    // Due 2026-10-10, one in two returned 2026-10-20: ten days at the default 100 cents a day.
    db.libraryd_loans(1000).await;
    assert_success(&migrate(&db.url, "citus"));
    sqlx::raw_sql("insert into library_closed_days (day, reason) values ('2026-10-15', 'inventory')")
        .execute(&db.pool)
        .await
        .expect("close a day");
    // One loan: the statement is routed whole to its worker, where the rule functions are inlined.
    let one: i64 = sqlx::query_scalar(
        "select fine_settler_loan_fine(fine_class, due_on, returned_on) from loans where id = 8",
    )
    .fetch_one(&db.pool)
    .await
    .expect("a routed fine");
    assert_eq!(one, 900, "nine chargeable days");
    // Every shard.
    let all: i64 = sqlx::query_scalar(
        "select sum(fine_settler_loan_fine(fine_class, due_on, returned_on))::bigint from loans
         where returned_on is not null",
    )
    .fetch_one(&db.pool)
    .await
    .expect("fines on every shard");
    assert_eq!(all, 500 * 900);
    // A new policy version reaches the workers' copies as well (from tomorrow: for loans due then).
    sqlx::raw_sql(
        "insert into fine_policies (fine_class, effective_from, daily_rate_cents) values ('default', current_date + 1, 7)",
    )
    .execute(&db.pool)
    .await
    .expect("a new version");
    let later: i64 = sqlx::query_scalar(
        "select fine_settler_loan_fine(null, current_date + 1, current_date + 4) from loans where id = 8",
    )
    .fetch_one(&db.pool)
    .await
    .expect("a routed fine under the new version");
    assert_eq!(later, 3 * 7);
    db.drop().await;
}

/// A `loans` with triggers of libraryd's own is left to the operator: fine-settler does not drop and re-create
/// triggers it did not write (their comments, and whether they may run on the shards, are not its to decide).
#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn a_loans_table_with_triggers_of_its_own_is_left_for_the_operator_to_distribute() {
    let db = CitusDb::new("foreign").await;
    db.libraryd_loans(10).await;
    sqlx::raw_sql(
        "create function libraryd_audit() returns trigger language plpgsql as $$ begin return null; end $$;
         create trigger libraryd_audit after update on loans for each row execute function libraryd_audit();
         alter table loans disable trigger libraryd_audit",
    )
    .execute(&db.pool)
    .await
    .expect("libraryd's trigger");
    let out = migrate(&db.url, "citus");
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("loans has triggers fine-settler did not create (libraryd_audit)"),
        "{}",
        stderr(&out)
    );
    // Nothing of the table was changed: still the coordinator's, its trigger still there and still disabled.
    let (distributed, enabled): (bool, String) = sqlx::query_as(
        "select exists (select 1 from citus_tables where table_name = 'loans'::regclass),
                (select tgenabled::text from pg_trigger where tgname = 'libraryd_audit')",
    )
    .fetch_one(&db.pool)
    .await
    .expect("the table");
    assert_eq!((distributed, enabled.as_str()), (false, "D"));
    db.drop().await;
}

/// `fine-settler ARGS` with small batches against the Citus test database `url` (`database.engine = "citus"`,
/// as [`fine_settler`] gives it there): its report.
fn run_citus(url: &str, args: &[&str]) -> serde_json::Value {
    let mut cmd = fine_settler(url);
    cmd.env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "100").args(args);
    let out = output(cmd);
    assert_success(&out);
    report(&out)
}

/// `settle` on Citus: each batch's loans lie in many shards, and its write reaches them one shard at a time,
/// pricing each loan on its worker by the rules' copies there (a closed day included); a rerun changes nothing.
#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn settle_prices_every_returned_loan_on_its_shard_and_a_rerun_changes_nothing() {
    let db = CitusDb::new("settle").await;
    // Due 2026-10-10, one in two returned 2026-10-20: ten days at the default 100 cents a day, one closed.
    db.libraryd_loans(2000).await;
    assert_success(&migrate(&db.url, "citus"));
    sqlx::raw_sql("insert into library_closed_days (day, reason) values ('2026-10-15', 'inventory')")
        .execute(&db.pool)
        .await
        .expect("close a day");
    let first = run_citus(&db.url, &["settle", "--business-date", "2026-10-31"]);
    assert_eq!(first["outcome"], "settled", "{first}");
    assert_eq!(first["updated"], 1000, "{first}");
    let settled = || async {
        sqlx::query_as::<_, (i64, Option<i64>, i64)>(
            "select count(*) filter (where fine_settled_at is not null),
                    sum(fine_cents)::bigint,
                    count(*) filter (where returned_on is null and fine_settled_at is not null)
             from loans",
        )
        .fetch_one(&db.pool)
        .await
        .expect("the loans")
    };
    assert_eq!(
        settled().await,
        (1000, Some(1000 * 900), 0),
        "nine chargeable days each, open loans untouched"
    );
    let again = run_citus(&db.url, &["settle", "--business-date", "2026-10-31"]);
    assert_eq!(again["outcome"], "skipped", "{again}");
    assert_eq!(settled().await, (1000, Some(1000 * 900), 0));
    db.drop().await;
}

/// A loan libraryd holds locked on its worker: the batch waits `claim.lock_timeout` there (the coordinator's
/// `set local` reaches the worker), settles the rest of its loans around it, and the rerun after the lock is let
/// go settles it — rather than the batch waiting until the batch timeout fails the run.
#[tokio::test]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn a_loan_libraryd_holds_locked_is_settled_around_then_by_the_reopen() {
    let db = CitusDb::new("locked").await;
    db.libraryd_loans(200).await;
    assert_success(&migrate(&db.url, "citus"));
    let mut libraryd = db.pool.begin().await.expect("libraryd's transaction");
    sqlx::query("update loans set member_id = member_id where id = 4")
        .execute(&mut *libraryd)
        .await
        .expect("libraryd locks loan 4");
    let run = |url: String| {
        tokio::task::spawn_blocking(move || {
            let mut cmd = fine_settler(&url);
            cmd.env("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "10s")
                .env("FINE_SETTLER__CLAIM__LOCK_TIMEOUT", "500ms")
                .args(["settle", "--business-date", "2026-10-31"]);
            let out = output(cmd);
            assert_success(&out);
            report(&out)
        })
    };
    let first = run(db.url.clone()).await.expect("the run");
    assert_eq!(
        (&first["outcome"], &first["updated"]),
        (&serde_json::json!("settled"), &serde_json::json!(99)),
        "{first}"
    );
    libraryd.commit().await.expect("libraryd commits");
    let again = run(db.url.clone()).await.expect("the rerun");
    assert_eq!(
        (&again["outcome"], &again["updated"], &again["reopened"]),
        (
            &serde_json::json!("settled"),
            &serde_json::json!(1),
            &serde_json::json!(true)
        ),
        "{again}"
    );
    db.drop().await;
}
