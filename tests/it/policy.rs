//! The fine rules as data: the SQL functions (migrations/20261203000053) and `fine_settler::policy` agree over
//! random loans, policies and calendars; `policy add` / `policy list` and their refusals; `migrate` seeds the
//! first `default` policy from the `[fine]` keys, and `run` refuses a replica whose keys differ from it.

use std::process::Output;

use chrono::{Duration, NaiveDate};
use fine_settler::{
    fine::FinePolicy,
    policy::{governing, ClosedDays, FineClass, Policy, PolicyVersion},
    store::policies::earliest_date,
};
use proptest::{
    prelude::*,
    strategy::{Strategy, ValueTree},
    test_runner::TestRunner,
};
use sqlx::PgPool;

use crate::helpers::{assert_success, d, database_url, fine_settler, output, report};

/// One generated case: a loan (due, returned), a day, and the policy that prices it.
#[derive(Debug, Clone)]
struct Case {
    due: NaiveDate,
    returned: Option<NaiveDate>,
    day: NaiveDate,
    rate: i64,
    grace: i64,
    cap: i64,
    charge_closed: bool,
}

/// Dates around a month end, a leap day (2028, 2000) or a century that is not leap (2100).
const BASES: [&str; 4] = ["2026-10-20", "2028-02-20", "2000-02-20", "2100-02-20"];

/// A case around `base`: cap boundaries (a multiple of the rate, one either side) as often as free caps, returns
/// before, on and long after the due date, and now and then a loan due years before the calendar starts.
fn case(base: NaiveDate) -> impl Strategy<Value = Case> {
    let cap = prop_oneof![
        Just(None),
        (0i64..20, -1i64..=1).prop_map(|(k, delta)| Some((k, delta))),
        (1i64..20_000).prop_map(|c| Some((-1, c))),
    ];
    (
        prop_oneof![9 => -10i64..60, 1 => -2_000i64..-1_000],
        proptest::option::weighted(0.7, -5i64..70),
        -5i64..90,
        (0i64..500, 0i64..10, cap, any::<bool>()),
    )
        .prop_map(move |(due, returned, day, (rate, grace, cap, charge_closed))| {
            let due = base + Duration::days(due);
            let cap = match cap {
                None => 0,
                Some((-1, c)) => c,
                Some((k, delta)) => (rate * k + delta).max(0),
            };
            Case {
                due,
                returned: returned.map(|r| due + Duration::days(r)),
                day: base + Duration::days(day),
                rate,
                grace,
                cap,
                charge_closed,
            }
        })
}

/// A calendar around `base`: up to 30 closed days in its first three months.
fn calendar(base: NaiveDate) -> impl Strategy<Value = Vec<NaiveDate>> {
    proptest::collection::vec(-10i64..90, 0..30)
        .prop_map(move |ks| ks.into_iter().map(|k| base + Duration::days(k)).collect())
}

/// The calendar's closed days become exactly `days`.
async fn set_calendar(pool: &PgPool, days: &[NaiveDate]) {
    sqlx::query("delete from library_closed_days")
        .execute(pool)
        .await
        .expect("clear calendar");
    sqlx::query(
        "insert into library_closed_days (day, reason) select distinct d, 'test' from unnest($1::date[]) d",
    )
    .bind(days)
    .execute(pool)
    .await
    .expect("close days");
}

/// `(day amount, settled fine)` of every case, by the SQL functions, in one statement.
async fn by_sql(pool: &PgPool, cases: &[Case]) -> Vec<(i64, i64)> {
    let col = |f: fn(&Case) -> i64| cases.iter().map(f).collect::<Vec<i64>>();
    sqlx::query_as(
        "select a.amount_cents, f.fine_cents
         from unnest($1::date[], $2::date[], $3::date[], $4::bigint[], $5::bigint[], $6::bigint[], $7::bool[])
              with ordinality t(due, ret, day, rate, grace, cap, cc, i)
         cross join lateral fine_settler_policy_day_amount(due, ret, day, rate, grace::int, cap, cc) a
         cross join lateral fine_settler_policy_fine(due, ret, rate, grace::int, cap, cc) f
         order by i",
    )
    .bind(cases.iter().map(|c| c.due).collect::<Vec<_>>())
    .bind(cases.iter().map(|c| c.returned).collect::<Vec<_>>())
    .bind(cases.iter().map(|c| c.day).collect::<Vec<_>>())
    .bind(col(|c| c.rate))
    .bind(col(|c| c.grace))
    .bind(col(|c| c.cap))
    .bind(cases.iter().map(|c| c.charge_closed).collect::<Vec<_>>())
    .fetch_all(pool)
    .await
    .expect("the SQL rule")
}

/// The Rust rule for one case: `(day amount, settled fine)`, the fine 0 for a loan still out.
fn by_rust(c: &Case, closed: &ClosedDays) -> (i64, i64) {
    let p = Policy {
        fine: FinePolicy::new(c.rate, c.grace, c.cap).expect("valid policy"),
        charge_closed_days: c.charge_closed,
    };
    let amount = p.day_amount(closed, c.due, c.returned, c.day).get();
    let fine = c.returned.map_or(0, |r| p.fine(closed, c.due, r).get());
    (amount, fine)
}

/// Over 60 random calendars (around a month end, leap days and a century that is not leap) and 250 random
/// loans each, the SQL functions and `Policy` agree on every day amount and every settled fine — closed due
/// dates, closed return dates, grace spanning closed days, cap boundaries, days before and after the calendar's
/// first and last closed day, and loans overdue for years (their closed days counted by ordinals). A few cases
/// are written out, so that every one of those is there whatever the generator draws.
#[sqlx::test]
async fn the_sql_rule_and_the_rust_rule_agree(pool: PgPool) {
    let mut gen = TestRunner::deterministic();
    for round in 0..60 {
        let base = d(BASES[round % BASES.len()]);
        let mut days = calendar(base).new_tree(&mut gen).expect("calendar").current();
        let mut cases: Vec<Case> = (0..250)
            .map(|_| case(base).new_tree(&mut gen).expect("case").current())
            .collect();
        // Closed on the due date, on the return date and inside the grace period of one loan, priced on each
        // of its days; and a loan due before the calendar's first closed day, returned after its last.
        days.extend([base, base + Duration::days(2), base + Duration::days(9)]);
        for k in -1..12 {
            cases.push(Case {
                due: base,
                returned: Some(base + Duration::days(9)),
                day: base + Duration::days(k),
                rate: 100,
                grace: 3,
                cap: 500,
                charge_closed: false,
            });
        }
        cases.push(Case {
            due: base - Duration::days(400),
            returned: Some(base + Duration::days(200)),
            day: base + Duration::days(100),
            rate: 7,
            grace: 1,
            cap: 0,
            charge_closed: false,
        });
        set_calendar(&pool, &days).await;
        let closed = ClosedDays::new(days.iter().copied());
        let sql = by_sql(&pool, &cases).await;
        assert_eq!(sql.len(), cases.len());
        for (c, s) in cases.iter().zip(&sql) {
            assert_eq!(*s, by_rust(c, &closed), "{c:?}, closed {:?}", closed.days());
        }
    }
}

/// `fine_settler_policy_of` and `policy::governing` pick the same version for random versions of two classes
/// and `default`, random classes (none, an unknown one) and due dates — including dates before any version —
/// and `fine_settler_loan_fine` prices a loan by the policy it picks.
#[sqlx::test]
async fn the_sql_and_rust_pick_the_same_policy(pool: PgPool) {
    let mut gen = TestRunner::deterministic();
    let base = d("2026-06-01");
    let classes = ["default", "laptop", "dvd"];
    let versions_strategy = proptest::collection::vec((0usize..3, -300i64..300, 0i64..1000), 1..12);
    let versions: Vec<PolicyVersion> = versions_strategy
        .new_tree(&mut gen)
        .expect("versions")
        .current()
        .into_iter()
        .map(|(class, from, rate)| PolicyVersion {
            class: FineClass::new(classes[class]).expect("class"),
            effective_from: base + Duration::days(from),
            policy: Policy {
                fine: FinePolicy::new(rate, 0, 0).expect("policy"),
                charge_closed_days: false,
            },
            created_at: chrono::DateTime::UNIX_EPOCH,
            created_by: "test".into(),
            reason: String::new(),
        })
        .collect();
    // Versions of any date, in any order: as a superuser with triggers off (the insert trigger takes versions
    // from today on only, the default class's from the earliest date first).
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("set local session_replication_role = replica")
        .execute(&mut *tx)
        .await
        .expect("triggers off");
    for v in &versions {
        sqlx::query(
            "insert into fine_policies (fine_class, effective_from, daily_rate_cents) values ($1, $2, $3)
             on conflict do nothing",
        )
        .bind(v.class.as_str())
        .bind(v.effective_from)
        .bind(v.policy.fine.daily_rate().get())
        .execute(&mut *tx)
        .await
        .expect("insert version");
    }
    tx.commit().await.expect("commit");
    // The first version of a (class, date) pair is the one the table keeps.
    let mut kept: Vec<PolicyVersion> = Vec::new();
    for v in versions {
        if !kept
            .iter()
            .any(|k| k.class == v.class && k.effective_from == v.effective_from)
        {
            kept.push(v);
        }
    }
    let loans: Vec<(Option<&str>, NaiveDate)> = (0..400)
        .map(|i| {
            let class = [None, Some("laptop"), Some("dvd"), Some("typo"), Some("default")][i % 5];
            (class, base + Duration::days((i as i64 * 37) % 700 - 350))
        })
        .collect();
    for (class, due) in loans {
        let sql: Option<(String, NaiveDate)> =
            sqlx::query_as("select fine_class, effective_from from fine_settler_policy_of($1, $2)")
                .bind(class)
                .bind(due)
                .fetch_optional(&pool)
                .await
                .expect("policy_of");
        let rust = governing(&kept, class, due).map(|v| (v.class.as_str().to_string(), v.effective_from));
        assert_eq!(sql, rust, "class {class:?}, due {due}");
        // The scalar convenience looks the same policy up: a loan returned ten days late.
        let returned = due + Duration::days(10);
        let fine: Option<i64> = sqlx::query_scalar("select fine_settler_loan_fine($1, $2, $3)")
            .bind(class)
            .bind(due)
            .bind(returned)
            .fetch_one(&pool)
            .await
            .expect("loan_fine");
        let rust =
            governing(&kept, class, due).map(|v| v.policy.fine(&ClosedDays::default(), due, returned).get());
        assert_eq!(fine, rust, "class {class:?}, due {due}");
    }
}

/// Runs `fine-settler policy ARGS` against the test's database.
fn policy(pool: &PgPool, args: &[&str]) -> Output {
    let mut cmd = fine_settler(&database_url(pool));
    cmd.arg("policy").args(args);
    output(cmd)
}

/// The one line on stderr of a refused command, which must have exited 2.
fn refusal(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(lines.len(), 1, "{stderr}");
    lines[0].to_string()
}

async fn versions(pool: &PgPool) -> i64 {
    sqlx::query_scalar("select count(*) from fine_policies")
        .fetch_one(pool)
        .await
        .expect("count")
}

/// Tomorrow in the default zone (Asia/Shanghai), by the database clock.
async fn tomorrow(pool: &PgPool) -> NaiveDate {
    sqlx::query_scalar("select (now() at time zone 'Asia/Shanghai')::date + 1")
        .fetch_one(pool)
        .await
        .expect("tomorrow")
}

/// `policy add`: bad values, today and a different version for a taken (class, date) are one line naming the
/// value, exit 2, nothing written; the same version twice is a no-op; `policy list` shows what was added.
#[sqlx::test]
async fn policy_add_refuses_bad_input_and_is_idempotent(pool: PgPool) {
    let from = tomorrow(&pool).await.to_string();
    let today = (tomorrow(&pool).await - Duration::days(1)).to_string();
    let long = "x".repeat(65);
    let bad: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--class", "laptop", "--from", &from, "--daily-rate-cents", "-5"],
            "--daily-rate-cents -5",
        ),
        (
            vec![
                "--class",
                "laptop",
                "--from",
                &from,
                "--daily-rate-cents",
                "5",
                "--grace-days",
                "40000",
            ],
            "--grace-days 40000",
        ),
        (
            vec![
                "--class",
                "laptop",
                "--from",
                &from,
                "--daily-rate-cents",
                "5",
                "--cap-cents",
                "-1",
            ],
            "--cap-cents -1",
        ),
        (
            vec!["--class", "", "--from", &from, "--daily-rate-cents", "5"],
            "--class \"\"",
        ),
        (
            vec!["--class", &long, "--from", &from, "--daily-rate-cents", "5"],
            "at most 64 characters",
        ),
        // libraryd's `loans.fine_class` is matched exactly: a name no one types is a typo waiting.
        (
            vec!["--class", "   ", "--from", &from, "--daily-rate-cents", "5"],
            "--class \"   \"",
        ),
        (
            vec!["--class", " dvd", "--from", &from, "--daily-rate-cents", "5"],
            "--class \" dvd\"",
        ),
        (
            vec!["--class", "a\nb", "--from", &from, "--daily-rate-cents", "5"],
            "--class \"a\\nb\"",
        ),
        (
            vec!["--class", "laptop", "--from", &today, "--daily-rate-cents", "5"],
            "must be after today",
        ),
        (
            vec![
                "--class",
                "laptop",
                "--from",
                "2001-01-01",
                "--daily-rate-cents",
                "5",
            ],
            "--from 2001-01-01",
        ),
    ];
    for (args, names) in &bad {
        let line = refusal(&policy(
            &pool,
            &["add"].iter().chain(args).copied().collect::<Vec<_>>(),
        ));
        assert!(line.contains(names), "{args:?}: {line}");
    }
    // An unknown flag: clap's own refusal, exit 2.
    let out = policy(
        &pool,
        &[
            "add",
            "--class",
            "laptop",
            "--from",
            &from,
            "--daily-rate-cents",
            "5",
            "--fast",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(versions(&pool).await, 0, "a refusal writes nothing");

    let add = [
        "add",
        "--class",
        "laptop",
        "--from",
        &from,
        "--daily-rate-cents",
        "500",
        "--cap-cents",
        "5000",
        "--charge-closed-days",
        "--reason",
        "laptops cost more",
        "--by",
        "ops",
    ];
    let first = policy(&pool, &add);
    assert_success(&first);
    assert_eq!(report(&first)["policy"], "added");
    let again = policy(&pool, &add);
    assert_success(&again);
    assert_eq!(report(&again)["policy"], "unchanged");
    let other = refusal(&policy(
        &pool,
        &[
            "add",
            "--class",
            "laptop",
            "--from",
            &from,
            "--daily-rate-cents",
            "400",
        ],
    ));
    assert!(other.contains("already has a different policy"), "{other}");
    // The laptop version, and the `default` one the first `policy add` seeded into the empty table from the
    // [fine] keys (loans of no class, or of a class without a version, need one).
    assert_eq!(versions(&pool).await, 2);

    let list = policy(&pool, &["list", "--json"]);
    assert_success(&list);
    let row = report(&list);
    assert_eq!(row["fine_class"], "laptop");
    assert_eq!(row["effective_from"], from.as_str());
    assert_eq!(row["daily_rate_cents"], 500);
    assert_eq!(row["cap_cents"], 5000);
    assert_eq!(row["charge_closed_days"], true);
    assert_eq!(row["created_by"], "ops");
    assert_eq!(row["reason"], "laptops cost more");
    let table = policy(&pool, &["list"]);
    assert_success(&table);
    assert!(String::from_utf8_lossy(&table.stdout).contains("laptop"));
}

/// `migrate` turns the deployment's `[fine]` keys into the first `default` policy, effective from the earliest
/// date, once; afterwards `run` refuses a replica whose `[fine]` key differs from it (one line, exit 2) and runs
/// one whose keys agree or that sets none.
#[sqlx::test]
async fn migrate_seeds_the_default_policy_and_run_refuses_disagreeing_keys(pool: PgPool) {
    let url = database_url(&pool);
    let migrate = |rate: &str| {
        let mut cmd = fine_settler(&url);
        cmd.env("FINE_SETTLER__FINE__DAILY_RATE_CENTS", rate)
            .env("FINE_SETTLER__FINE__CAP_CENTS", "900")
            .arg("migrate");
        output(cmd)
    };
    let first = migrate("250");
    assert_success(&first);
    assert_eq!(report(&first)["policy_seeded"], true);
    let second = migrate("300");
    assert_success(&second);
    assert_eq!(report(&second)["policy_seeded"], false);
    let seeded: (String, NaiveDate, i64, i32, i64, bool) = sqlx::query_as(
        "select fine_class, effective_from, daily_rate_cents, grace_days, cap_cents, charge_closed_days
         from fine_policies",
    )
    .fetch_one(&pool)
    .await
    .expect("the one seeded policy");
    assert_eq!(seeded, ("default".into(), earliest_date(), 250, 0, 900, false));

    let run = |env: &[(&str, &str)]| {
        let mut cmd = fine_settler(&url);
        cmd.envs(env.iter().copied()).args(["run", "--once"]);
        output(cmd)
    };
    let refused = refusal(&run(&[("FINE_SETTLER__FINE__DAILY_RATE_CENTS", "300")]));
    assert!(refused.contains("fine.daily_rate_cents = 300"), "{refused}");
    assert!(refused.contains("daily_rate_cents = 250"), "{refused}");
    assert_eq!(
        sqlx::query_scalar::<_, i64>("select count(*) from job_runs")
            .fetch_one(&pool)
            .await
            .expect("count"),
        0,
        "a refused replica claims nothing"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("replica.toml");
    std::fs::write(&file, "[fine]\ngrace_days = 2\n").expect("write");
    let mut from_file = fine_settler(&url);
    from_file.arg("--config").arg(&file).args(["run", "--once"]);
    let line = refusal(&output(from_file));
    assert!(line.contains("fine.grace_days = 2"), "{line}");

    assert_success(&run(&[
        ("FINE_SETTLER__FINE__DAILY_RATE_CENTS", "250"),
        ("FINE_SETTLER__FINE__CAP_CENTS", "900"),
    ]));
    assert_success(&run(&[]));
}
