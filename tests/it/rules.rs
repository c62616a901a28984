//! The fine rules in the database price every path: settlement, the accrual's charges and corrections, the
//! re-check and `verify` all take a loan's policy from `fine_policies` (the version of its class in force on its
//! due date) and leave the library's closed days uncharged — checked against the Rust rules (`crate::policy`).

use std::{collections::BTreeMap, time::Duration};

use chrono::NaiveDate;
use fine_settler::{
    backoff::Backoff,
    jobs::{accrual::Accrual, settlement::Settlement, JobName, Outcome, RunKey},
    policy::{governing, ClosedDays},
    shard::ShardSpec,
    store::{corrections, ledger::Scope, policies},
};
use fine_settler::{config::Engine, store::ledger_writes::LedgerWrites};
use sqlx::PgPool;

use crate::helpers::{d, database_url, db, fine_settler, key, output, report, runner};

fn accrual() -> Accrual {
    Accrual {
        backoff: Backoff::new(Duration::from_millis(100), Duration::from_millis(250)),
        row_timeout: Duration::from_millis(500),
        isolation_budget: Duration::from_secs(5),
        lock_timeout: Duration::from_secs(2),
        scope: Scope::Full,
        writes: LedgerWrites::new(Engine::Postgresql),
    }
}

fn day_key(day: NaiveDate) -> RunKey {
    RunKey {
        job: JobName::OverdueAccrual,
        business_date: day,
        shard: ShardSpec::SINGLE,
    }
}

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(sql).execute(pool).await.expect(sql);
}

/// Two classes with two versions each (the later one from 2026-10-15), a class libraryd misspelt, and four
/// closed days (one of the versions charges them).
async fn rules(pool: &PgPool) {
    crate::helpers::add_versions(
        pool,
        "insert into fine_policies (fine_class, effective_from, daily_rate_cents, grace_days, cap_cents,
                                    charge_closed_days)
         values ('default', '2026-10-15', 50, 1, 0, false),
                ('laptop', '4714-11-24 BC', 300, 0, 1000, false),
                ('laptop', '2026-10-15', 200, 2, 600, true)",
    )
    .await;
    exec(
        pool,
        "insert into library_closed_days (day, reason)
         values ('2026-10-05', 'staff day'), ('2026-10-11', 'sunday'), ('2026-10-12', 'holiday'),
                ('2026-10-20', 'snow');",
    )
    .await;
}

/// Loans of every class, due from 2026-09-26 on (so that every owed day is in the accrual window), some
/// returned in October, some still out.
async fn loans(pool: &PgPool) {
    exec(
        pool,
        "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on, fine_class)
         select id, 1, 1, due - 21, due,
                case when id % 4 <> 3 then least(due + (id % 11) + id % 3, date '2026-10-31') end,
                (array[null, 'laptop', 'typo', 'default'])[1 + id % 4]
         from (select id, date '2026-09-26' + (id * 3 % 31) as due from generate_series(1, 48) id) l",
    )
    .await;
}

/// The Rust rules' fine and daily amounts for each loan, from the versions and closed days the database holds.
struct Oracle {
    versions: Vec<fine_settler::policy::PolicyVersion>,
    closed: ClosedDays,
}

impl Oracle {
    async fn load(pool: &PgPool) -> Self {
        let versions = policies::list(&db(pool)).await.expect("versions");
        let days: Vec<NaiveDate> = sqlx::query_scalar("select day from library_closed_days order by day")
            .fetch_all(pool)
            .await
            .expect("closed days");
        Oracle {
            versions,
            closed: ClosedDays::new(days),
        }
    }

    fn policy(&self, class: Option<&str>, due: NaiveDate) -> fine_settler::policy::Policy {
        governing(&self.versions, class, due).expect("a version").policy
    }
}

type LoanRow = (
    i64,
    Option<String>,
    NaiveDate,
    Option<NaiveDate>,
    i64,
    Option<chrono::DateTime<chrono::Utc>>,
);

async fn loan_rows(pool: &PgPool) -> Vec<LoanRow> {
    sqlx::query_as(
        "select id, fine_class, due_on, returned_on, fine_cents, fine_settled_at from loans order by id",
    )
    .fetch_all(pool)
    .await
    .expect("loans")
}

async fn net(pool: &PgPool) -> BTreeMap<(i64, NaiveDate), i64> {
    let rows: Vec<(i64, NaiveDate, i64)> =
        sqlx::query_as("select loan_id, accrual_date, net_cents from fine_ledger_net where net_cents <> 0")
            .fetch_all(pool)
            .await
            .expect("net");
    rows.into_iter().map(|(l, day, n)| ((l, day), n)).collect()
}

fn days(from: &str, to: &str) -> Vec<NaiveDate> {
    d(from).iter_days().take_while(|x| *x <= d(to)).collect()
}

/// Every amount comes from the loan's version and the closed days: the October settlement sets each loan's
/// fine as the Rust rules do, every day of the ledger holds the Rust rules' amount (nothing on a closed day
/// unless the version charges closed days), each settled loan's ledger adds up to its fine, and `verify` agrees
/// (and names the class no version exists for).
#[sqlx::test(fixtures("default_policy"))]
async fn every_amount_follows_the_loans_version_and_the_closed_days(pool: PgPool) {
    rules(&pool).await;
    loans(&pool).await;
    let window = days("2026-09-26", "2026-10-31");
    for day in &window {
        let r = runner(&pool, "accrual", 7)
            .run(&accrual(), day_key(*day), false)
            .await;
        assert!(matches!(r.outcome, Outcome::Settled | Outcome::Skipped), "{r:?}");
    }
    let s = runner(&pool, "settle", 7)
        .run(&Settlement::new(), key("2026-10-31", 0, 1), false)
        .await;
    assert_eq!(s.outcome, Outcome::Settled, "{s:?}");

    let oracle = Oracle::load(&pool).await;
    let mut expected_net = BTreeMap::new();
    let (mut settled, mut closed_charged) = (0, 0);
    for (id, class, due, returned, fine, settled_at) in loan_rows(&pool).await {
        let policy = oracle.policy(class.as_deref(), due);
        for day in &window {
            let amount = policy.day_amount(&oracle.closed, due, returned, *day).get();
            if amount > 0 {
                expected_net.insert((id, *day), amount);
                if oracle.closed.is_closed(*day) {
                    closed_charged += 1;
                }
            }
        }
        if let Some(returned) = returned.filter(|r| *r >= d("2026-10-01")) {
            assert!(settled_at.is_some(), "loan {id} returned {returned} is settled");
            assert_eq!(
                fine,
                policy.fine(&oracle.closed, due, returned).get(),
                "loan {id} ({class:?}, due {due}, returned {returned})"
            );
            settled += 1;
        }
    }
    assert_eq!(net(&pool).await, expected_net);
    assert!(settled > 20, "{settled} loans settled");
    assert!(
        closed_charged > 0,
        "the version that charges closed days charged some"
    );
    let mismatched: i64 = sqlx::query_scalar(
        "select count(*) from loans l
         where l.returned_on between '2026-10-01' and '2026-10-31'
           and l.fine_cents <> coalesce((select sum(n.net_cents) from fine_ledger_net n where n.loan_id = l.id), 0)",
    )
    .fetch_one(&pool)
    .await
    .expect("reconcile");
    assert_eq!(mismatched, 0, "each settled loan's ledger adds up to its fine");

    let mut verify = fine_settler(&database_url(&pool));
    verify.args(["verify", "--business-date", "2026-10-31", "--json"]);
    let out = output(verify);
    let audit = report(&out);
    assert_eq!(out.status.code(), Some(0), "{audit}");
    assert_eq!(audit["audit"]["wrong_fine"], 0);
    assert_eq!(audit["audit"]["over_accrued"], 0);
    assert_eq!(
        audit["audit"]["classes_without_policy"],
        serde_json::json!(["typo"])
    );
    assert!(
        audit["notes"][0].as_str().is_some_and(|n| n.contains("typo")),
        "{audit}"
    );
}

/// The snow day recorded the next morning: closing a day already charged queues the loans out on it, the
/// re-check re-opens the day, and its run corrects each charge away with reason `closed-day` (and, under a cap,
/// brings the day that reaches it forward); opening it again charges it again. A change inside a month already
/// settled is refused.
#[sqlx::test(fixtures("default_policy"))]
async fn closing_a_day_already_charged_corrects_it_and_opening_it_charges_it_again(pool: PgPool) {
    crate::helpers::set_policy(
        &pool,
        fine_settler::fine::FinePolicy::new(100, 0, 450).expect("policy"),
    )
    .await;
    exec(
        &pool,
        "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         values (1, 1, 1, '2026-10-01', '2026-11-01', null), (2, 1, 1, '2026-10-01', '2026-11-02', null),
                (3, 1, 1, '2026-10-01', '2026-11-05', null);
         delete from fine_loan_changes;",
    )
    .await;
    let window = days("2026-11-02", "2026-11-08");
    for day in &window {
        runner(&pool, "accrual", 7)
            .run(&accrual(), day_key(*day), false)
            .await;
    }
    let calendar = |args: &[&str]| {
        let mut cmd = fine_settler(&database_url(&pool));
        cmd.arg("calendar").args(args);
        output(cmd)
    };
    let closed = calendar(&["close", "--from", "2026-11-04", "--reason", "snow"]);
    assert_eq!(
        closed.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&closed.stderr)
    );
    // Older than the replicas' catch-up window today: said, with the backfill that corrects it.
    assert_eq!(
        report(&closed)["days_outside_window"],
        serde_json::json!(["2026-11-04"])
    );
    assert!(
        String::from_utf8_lossy(&closed.stderr).contains("--from 2026-11-04 --to 2026-11-04 --reprocess all"),
        "{}",
        String::from_utf8_lossy(&closed.stderr)
    );

    let found = corrections::recheck(
        &db(&pool),
        ShardSpec::SINGLE,
        window[0],
        window[6],
        100,
        false,
        Duration::ZERO,
    )
    .await
    .expect("recheck");
    assert!(found.days.contains(&d("2026-11-04")), "{found:?}");
    for day in &found.days {
        let r = runner(&pool, "recheck", 7)
            .run(&accrual().within(Scope::Changed), day_key(*day), true)
            .await;
        assert_eq!(r.outcome, Outcome::Settled, "{r:?}");
    }
    let reasons: Vec<(i64, NaiveDate, i64, String)> = sqlx::query_as(
        "select loan_id, accrual_date, amount_cents, reason from fine_ledger_corrections order by 1, 2, seq",
    )
    .fetch_all(&pool)
    .await
    .expect("corrections");
    assert!(
        reasons.contains(&(1, d("2026-11-04"), -100, "closed-day".into())),
        "{reasons:?}"
    );
    let oracle = Oracle::load(&pool).await;
    let owed = |oracle: &Oracle, loans: &[LoanRow]| {
        let mut owed = BTreeMap::new();
        for (id, class, due, returned, ..) in loans {
            let policy = oracle.policy(class.as_deref(), *due);
            for day in &window {
                let a = policy.day_amount(&oracle.closed, *due, *returned, *day).get();
                if a > 0 {
                    owed.insert((*id, *day), a);
                }
            }
        }
        owed
    };
    let rows = loan_rows(&pool).await;
    assert_eq!(net(&pool).await, owed(&oracle, &rows), "closed");
    assert!(!net(&pool).await.contains_key(&(1, d("2026-11-04"))));

    let opened = calendar(&["open", "--from", "2026-11-04"]);
    assert_eq!(
        opened.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&opened.stderr)
    );
    let found = corrections::recheck(
        &db(&pool),
        ShardSpec::SINGLE,
        window[0],
        window[6],
        100,
        false,
        Duration::ZERO,
    )
    .await
    .expect("recheck");
    for day in &found.days {
        runner(&pool, "recheck", 7)
            .run(&accrual().within(Scope::Changed), day_key(*day), true)
            .await;
    }
    let oracle = Oracle::load(&pool).await;
    assert_eq!(net(&pool).await, owed(&oracle, &rows), "opened again");
    assert_eq!(net(&pool).await.get(&(1, d("2026-11-04"))), Some(&100));

    // A settlement key of November exists: a November day can no longer change.
    runner(&pool, "settle", 7)
        .run(&Settlement::new(), key("2026-11-30", 0, 1), false)
        .await;
    let refused = calendar(&["close", "--from", "2026-11-06", "--reason", "late"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("2026-11-30"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// A database whose `fine_policies` is empty (migrated before the rules moved into it) gets the deployment's
/// `[fine]` keys as its first `default` version from the first command that prices loans, so no loan is ever
/// left without a policy; and a version, once there, is never rewritten or removed.
#[sqlx::test]
async fn an_empty_policy_table_is_seeded_and_a_version_is_never_rewritten(pool: PgPool) {
    let refused = sqlx::query(
        "insert into fine_policies (fine_class, effective_from, daily_rate_cents) values ('laptop', '2020-01-01', 9)",
    )
    .execute(&pool)
    .await;
    assert!(
        refused.is_err_and(|e| e
            .to_string()
            .contains("the first fine policy must be the default class")),
        "the first version must give every loan a policy"
    );
    exec(
        &pool,
        "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         values (1, 1, 1, '2026-09-01', '2026-10-01', '2026-10-11')",
    )
    .await;
    let mut settle = fine_settler(&database_url(&pool));
    settle.env("FINE_SETTLER__FINE__DAILY_RATE_CENTS", "70").args([
        "settle",
        "--business-date",
        "2026-10-31",
    ]);
    let out = output(settle);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fine: i64 = sqlx::query_scalar("select fine_cents from loans where id = 1")
        .fetch_one(&pool)
        .await
        .expect("fine");
    assert_eq!(fine, 700, "ten days at the seeded 70 cents");
    let versions: Vec<(String, i64)> =
        sqlx::query_as("select fine_class, daily_rate_cents from fine_policies")
            .fetch_all(&pool)
            .await
            .expect("versions");
    assert_eq!(versions, [("default".to_string(), 70)]);
    let back_dated = sqlx::query(
        "insert into fine_policies (fine_class, effective_from, daily_rate_cents, cap_cents)
         values ('laptop', current_date - 1, 300, 900)",
    )
    .execute(&pool)
    .await;
    assert!(
        back_dated.is_err_and(|e| e.to_string().contains("must take effect from today on")),
        "a version never re-prices a loan already due"
    );
    sqlx::query(
        "insert into fine_policies (fine_class, effective_from, daily_rate_cents) values ('laptop', current_date + 1, 300)",
    )
    .execute(&pool)
    .await
    .expect("a version from tomorrow");
    for statement in [
        "update fine_policies set daily_rate_cents = 1",
        "delete from fine_policies",
        "truncate fine_policies",
    ] {
        let refused = sqlx::query(statement).execute(&pool).await;
        assert!(
            refused.is_err_and(|e| e.to_string().contains("never updated or deleted")),
            "{statement}"
        );
    }
}

/// `plan` and the status page show the rules where people look: the version of each class in force today and
/// those to come, and the closed days of the coming month.
#[sqlx::test(fixtures("default_policy"))]
async fn plan_and_the_status_page_show_the_rules_in_force(pool: PgPool) {
    let today: NaiveDate = sqlx::query_scalar("select (now() at time zone 'Asia/Shanghai')::date")
        .fetch_one(&pool)
        .await
        .expect("today");
    crate::helpers::add_versions(
        &pool,
        &format!(
            "insert into fine_policies (fine_class, effective_from, daily_rate_cents, grace_days, cap_cents)
             values ('laptop', '2020-01-01', 300, 0, 0), ('laptop', '2021-01-01', 400, 0, 0),
                    ('laptop', '{}', 500, 1, 5000)",
            today + chrono::Duration::days(10)
        ),
    )
    .await;
    sqlx::query("insert into library_closed_days (day, reason) values ($1::date + 3, 'holiday'), ($1::date + 90, 'later')")
        .bind(today)
        .execute(&pool)
        .await
        .expect("closed days");
    let expected = serde_json::json!([
        ["default", "-4713-11-24"],
        ["laptop", "2021-01-01"],
        ["laptop", (today + chrono::Duration::days(10)).to_string()],
    ]);
    let shown = |rules: &serde_json::Value| {
        let policies: Vec<serde_json::Value> = rules["policies"]
            .as_array()
            .expect("policies")
            .iter()
            .map(|p| serde_json::json!([p["fine_class"], p["effective_from"]]))
            .collect();
        (serde_json::Value::from(policies), rules["closed_days"].clone())
    };
    let closed = serde_json::json!([(today + chrono::Duration::days(3)).to_string()]);

    let mut plan = fine_settler(&database_url(&pool));
    plan.arg("plan");
    let out = output(plan);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // On stderr: stdout is the keys alone.
    let first: serde_json::Value = serde_json::from_str(
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .find(|l| l.starts_with("{\"rules\""))
            .expect("the rules line"),
    )
    .expect("JSON");
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .all(|l| !l.contains("\"rules\"")),
        "stdout is the keys alone"
    );
    assert_eq!(
        shown(&first["rules"]),
        (expected.clone(), closed.clone()),
        "{first}"
    );

    let port = crate::helpers::free_port();
    let listen = format!("127.0.0.1:{port}");
    let replica = crate::helpers::daemon(
        &database_url(&pool),
        0,
        1,
        &[("FINE_SETTLER__HTTP__LISTEN", &listen)],
    );
    crate::helpers::wait_until("the status page", Duration::from_secs(20), || async {
        crate::daemon::http_get(port, "/status.json").await.0 == 200
    })
    .await;
    let (_, body) = crate::daemon::http_get(port, "/status.json").await;
    let status: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(shown(&status["rules"]), (expected, closed), "{status}");
    let (_, page) = crate::daemon::http_get(port, "/status").await;
    assert!(page.contains("Fine rules") && page.contains("laptop"), "{page}");
    crate::helpers::stop(replica).await;
}

/// A calendar change and a settlement batch never interleave: a batch that starts while a change is being made
/// waits for it and prices with it (the snow day closed while the month-end settlement claims its key is not
/// charged), and a change made while a batch prices waits for the batch and then sees the month's key (and is
/// refused: a settled fine never changes silently).
#[sqlx::test(fixtures("default_policy"))]
async fn a_calendar_change_and_a_settlement_batch_never_interleave(pool: PgPool) {
    exec(
        &pool,
        "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         values (1, 1, 1, '2026-10-01', '2026-11-01', '2026-11-10')",
    )
    .await;
    // The change is being made: the day is inserted (its trigger holds the calendar's lock), not yet committed.
    let mut change = pool.begin().await.expect("begin");
    sqlx::query("insert into library_closed_days (day, reason) values ('2026-11-05', 'snow')")
        .execute(&mut *change)
        .await
        .expect("close a day");
    let settling = tokio::spawn({
        let pool = pool.clone();
        async move {
            runner(&pool, "settle", 7)
                .run(&Settlement::new(), key("2026-11-30", 0, 1), false)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    change.commit().await.expect("commit the change");
    let run = settling.await.expect("settlement");
    assert_eq!(run.outcome, Outcome::Settled, "{run:?}");
    let fine: i64 = sqlx::query_scalar("select fine_cents from loans where id = 1")
        .fetch_one(&pool)
        .await
        .expect("fine");
    assert_eq!(fine, 800, "nine days late, one of them closed");

    // A batch in flight (it holds the calendar's lock shared, as settlement's batches do) and the month's key
    // claimed in it: a change waits for the batch, then sees the key and is refused, writing nothing.
    exec(&pool, "delete from job_runs").await;
    let mut batch = pool.begin().await.expect("begin");
    fine_settler::store::ledger::hold_calendar(&mut batch)
        .await
        .expect("the calendar's lock");
    sqlx::query(
        "insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch, lease_until)
         values ('fine-settlement', '2026-11-30', 1, 0, 'RUNNING', 'other', 1, now() + interval '1 minute')",
    )
    .execute(&mut *batch)
    .await
    .expect("a claim");
    let closing = tokio::task::spawn_blocking({
        let url = database_url(&pool);
        move || {
            let mut cmd = fine_settler(&url);
            cmd.args(["calendar", "close", "--from", "2026-11-06", "--reason", "late"]);
            output(cmd)
        }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    batch.commit().await.expect("the batch commits");
    let out = closing.await.expect("calendar close");
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("2026-11-30"));
    let closed: i64 = sqlx::query_scalar("select count(*) from library_closed_days where day = '2026-11-06'")
        .fetch_one(&pool)
        .await
        .expect("closed days");
    assert_eq!(closed, 0, "nothing written");
}

/// A job connection keeps the generic plan of each statement for its life, built at the statement's first
/// execution with the table sizes of that moment. On a new deployment the ledger is empty then: a batch's probe
/// "is this loan charged today" must still be planned on the ledger's index — as a sequential scan it read every
/// charge of the day for every loan once the run had written some (a batch of 1,000,000 loans took 20 s, and the
/// run failed at its batch timeout).
#[sqlx::test(fixtures("default_policy"))]
async fn a_job_connection_plans_the_ledger_probe_on_its_index_even_on_an_empty_ledger(pool: PgPool) {
    // Analysed while empty (a DBA's `vacuumdb --analyze`, or a database copied from a template): the planner
    // then knows it is empty.
    exec(&pool, "vacuum analyze fine_ledger").await;
    let url = database_url(&pool);
    let env: std::collections::HashMap<String, String> =
        [("DATABASE_URL".to_string(), url.clone())].into_iter().collect();
    let settings = fine_settler::config::load(None, &env)
        .and_then(|raw| raw.validate(&env))
        .expect("settings");
    let jobs = fine_settler::store::connect(&settings.database, "test", Duration::from_secs(5))
        .await
        .expect("a job pool");
    let mut conn = jobs.pool().acquire().await.expect("a job connection");
    sqlx::raw_sql(
        "prepare probe (bigint, date) as
             select l.id from loans l
             where l.id >= $1 and not exists (select 1 from fine_ledger f
                                              where f.loan_id = l.id and f.accrual_date = $2 offset 0)
             order by l.id limit 100",
    )
    .execute(&mut *conn)
    .await
    .expect("prepare");
    let plan: Vec<String> = sqlx::query_scalar("explain execute probe (0, '2026-10-20')")
        .fetch_all(&mut *conn)
        .await
        .expect("explain");
    let plan = plan.join("\n");
    assert!(
        plan.contains("fine_ledger_day_idx") || plan.contains("fine_ledger_pkey"),
        "{plan}"
    );
    assert!(!plan.contains("Seq Scan on fine_ledger"), "{plan}");
}

/// `run --once` on an empty `fine_policies` seeds it from its `[fine]` keys before its tick, as `run` does (its
/// month's settlement failed on a fine no policy could give).
#[sqlx::test]
async fn run_once_seeds_an_empty_policy_table(pool: PgPool) {
    let month = crate::helpers::due_now(&pool, 1).await[0];
    let day = |back: i64| (month - chrono::Duration::days(back)).to_string();
    crate::helpers::insert(&pool, &[crate::helpers::loan(1, &day(20), Some(&day(10)))]).await;
    let mut once = fine_settler(&database_url(&pool));
    // No [fine] key: the compiled-in values (100 cents a day) seed it.
    once.env("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1")
        .args(["run", "--once"]);
    let out = output(once);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fine: i64 = sqlx::query_scalar("select fine_cents from loans where id = 1")
        .fetch_one(&pool)
        .await
        .expect("fine");
    assert_eq!(fine, 1000, "ten days at the seeded 100 cents");
}

/// Closing and opening days at the same moment never deadlock (each held a row the other's renumbering needed),
/// and a day past the last date the program's calendar has, inserted by hand, does not break `calendar list`.
#[sqlx::test(fixtures("default_policy"))]
async fn calendar_changes_at_once_never_deadlock(pool: PgPool) {
    use fine_settler::store::calendar;
    let d0 = d("2027-03-01");
    calendar::close(&db(&pool), (d0, d0 + chrono::Duration::days(40)), "test", "t", d0)
        .await
        .expect("close");
    let mut tasks = Vec::new();
    for i in 0..20i64 {
        let db = db(&pool);
        let (open, close) = (
            d0 + chrono::Duration::days(i),
            d0 + chrono::Duration::days(60 + i),
        );
        tasks.push(tokio::spawn(async move {
            let opened = calendar::open(&db, (open, open), d0).await.map(|_| ());
            let closed = calendar::close(&db, (close, close), "x", "t", d0)
                .await
                .map(|_| ());
            opened.and(closed)
        }));
        let db = crate::helpers::db(&pool);
        let day = d0 + chrono::Duration::days(20 + i);
        tasks.push(tokio::spawn(async move {
            calendar::open(&db, (day, day), d0).await.map(|_| ())
        }));
    }
    for t in tasks {
        t.await.expect("task").expect("no deadlock");
    }
    exec(
        &pool,
        "insert into library_closed_days (day, reason) values ('5874897-12-31', 'far')",
    )
    .await;
    let mut list = fine_settler(&database_url(&pool));
    list.args(["calendar", "list", "--json"]);
    let out = output(list);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
