//! The chaos suite: real `fine-settler run` processes — 3 shards x 3 replicas, then 4 shards x 3 replicas — on a
//! private PostgreSQL loaded with several months of loans, while a seeded schedule injects SIGKILLs (each replica
//! restarted after a random pause), a zombie (SIGSTOP past its lease, SIGCONT after a peer took over), PostgreSQL
//! restarts, connection cuts through a TCP proxy, and forced reruns plus manual `settle`/`accrue` of the same
//! keys. Everything runs under a fine cap that most late loans reach. Meanwhile libraryd's live writes land in
//! keys that already succeeded — new loans returned inside a settled month, open loans whose return is recorded
//! late and back-dated into one, loans entered late that are overdue inside the accrual window — and the
//! replicas must re-open those keys; and libraryd changes loans whose days were charged already — returns
//! back-dated to a charged day, due dates moved later and earlier, returns removed — and the replicas must
//! correct those days by themselves. Snapshots of the ledger taken while they run must find it append-only and
//! under the cap. Afterwards an oracle written in plain SQL checks that nothing was lost, charged twice or
//! charged past the cap, and that the net ledger of every (loan, day) is what a clean sequential run leaves.
//!
//! `scripts/test.sh --test it chaos` runs the short mode (CI). The long mode:
//! `FINE_SETTLER_CHAOS=long FINE_SETTLER_CHAOS_SEED=7 scripts/test.sh --test it chaos -- --nocapture`.

mod edits;
mod faults;
mod history;
mod late;
mod oracle;
pub(crate) mod proxy;
mod replica;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use chrono::NaiveDate;
use fine_settler::demo;
use sqlx::{postgres::PgPoolOptions, PgPool};

use self::{
    faults::Faults,
    history::History,
    oracle::{assert_zombies_recorded_lost_leases, Figures, Oracle, Verdict},
    proxy::Proxy,
    replica::{deployment, Fleet},
};
use crate::{
    helpers::{insert, install_update_audit, slow_down},
    server::PrivateServer,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos() {
    let mode = Mode::from_env();
    let seed: u64 = std::env::var("FINE_SETTLER_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261130);
    let started = Instant::now();
    eprintln!("chaos: mode {} seed {seed}", mode.name);

    // Set up: a private server with the loans and the triggers, the proxy, 3 shards x 3 replicas.
    let server = PrivateServer::start(&["max_connections=150"]);
    let url = server.migrated_database("chaos").await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&url)
        .await
        .expect("connect");
    // The database's default policy is the deployment's (`migrate` seeded it from the default keys).
    crate::helpers::set_policy(
        &pool,
        fine_settler::fine::FinePolicy::new(RATE, 0, CAP).expect("the deployment's policy"),
    )
    .await;
    let world = World::load(&pool, &mode, seed).await;
    let history = History::install(&pool).await;
    let oracle = Oracle::new(&world.months, world.days[0], world.current);
    let proxy = Proxy::start(server.port()).await;
    let mut fleet = Fleet::new(&url, &proxy, mode.accrual_days);
    fleet.start(3);
    let scene = Scene {
        server: &server,
        pool: &pool,
        url: &url,
        proxy: &proxy,
        mode: &mode,
        world: &world,
        oracle: &oracle,
        history: &history,
        seed,
        started,
    };

    // Run: every fault of the schedule, then the wait for the replicas to catch up; then stop them all.
    let mut faults = Faults::new(&scene, seed);
    faults.run(&mut fleet).await;
    let zombies = faults.zombies(&mut fleet).await;
    let late_left = faults.wait_for_the_end(&mut fleet).await;
    let work_done = started.elapsed();
    fleet.stop();
    let manual_outcomes = faults.manual_outcomes();
    operator_finishes_keys_handed_back_at_the_stop(&pool, &url).await;

    // Check: the zombies' lost leases, and the oracle before and after the operator retries the DEAD charges.
    assert_zombies_recorded_lost_leases(&pool, &zombies).await;
    let mut verdict = Verdict::check(&pool, &oracle, &history, &world.poisoned, late_left).await;
    operator_retries_dead_charges(&pool, &url).await;
    verdict.check_after_the_retry(&pool, &oracle, &history).await;

    let figures = Figures::read(&pool).await;
    report(
        &scene,
        &faults,
        &manual_outcomes,
        fleet.starts(),
        work_done,
        &verdict,
        &figures,
    );
    let broken = verdict.broken();
    if !broken.is_empty() {
        oracle::diagnose(&pool, &oracle).await;
        eprintln!("chaos: replica errors, most frequent first:");
        for (n, what) in fleet.errors().iter().take(8) {
            eprintln!("    {n:>5} x {what}");
        }
    }
    assert!(broken.is_empty(), "invariants violated: {broken:?}");
    assert!(
        figures.reopened.iter().map(|(_, n)| n).sum::<i64>() >= 1,
        "no key was re-opened for the late rows"
    );
    assert!(
        figures.corrections.iter().map(|(_, n)| n).sum::<i64>() >= 1,
        "no correction was written for the loans libraryd changed"
    );
    faults.injected.assert_all_landed(&mode);
    faults.edits.assert_all_landed();
}

/// How hard to shake.
#[derive(Debug, Clone)]
struct Mode {
    name: &'static str,
    loans_per_month: u64,
    accrual_days: u32,
    /// Seconds each loan update and ledger insert sleeps (so that work is in flight while faults land).
    seconds_per_row: f64,
    kills: usize,
    zombies: usize,
    restarts: usize,
    cuts: usize,
    manual: usize,
    /// Rounds of late rows (see [`late::LateRows`]) while the replicas run, besides the last one once every key is
    /// SUCCESS.
    late_rounds: usize,
    /// Rounds of changes to loans already charged (see [`edits::Edits`]) while the replicas run, besides the last
    /// one once every key is SUCCESS.
    edit_rounds: usize,
    /// Faults land between these offsets from the start.
    window: (Duration, Duration),
    /// The shard count changes 3 -> 4 at this offset.
    reshard_at: Duration,
    /// How long the replicas get to finish after the last fault.
    settle_limit: Duration,
}

impl Mode {
    fn from_env() -> Mode {
        match std::env::var("FINE_SETTLER_CHAOS").as_deref() {
            Ok("long") => Mode {
                name: "long",
                loans_per_month: 12_000,
                accrual_days: 20,
                seconds_per_row: 0.015,
                kills: 24,
                zombies: 3,
                restarts: 4,
                cuts: 10,
                manual: 24,
                late_rounds: 8,
                edit_rounds: 10,
                window: (Duration::from_secs(8), Duration::from_secs(300)),
                reshard_at: Duration::from_secs(20),
                settle_limit: Duration::from_secs(900),
            },
            _ => Mode {
                name: "short",
                loans_per_month: 2_500,
                accrual_days: 10,
                seconds_per_row: 0.025,
                kills: 6,
                zombies: 1,
                restarts: 2,
                cuts: 3,
                manual: 6,
                late_rounds: 3,
                edit_rounds: 4,
                window: (Duration::from_secs(6), Duration::from_secs(45)),
                reshard_at: Duration::from_secs(8),
                settle_limit: Duration::from_secs(240),
            },
        }
    }
}

const ZONE: &str = "Asia/Shanghai";
const RATE: i64 = 100;
/// The fine cap: three and a half days' rate. Most late returns reach it, and so do most loans overdue inside the
/// accrual window (charged four days: three at the full rate, the fourth the half day left under the cap).
const CAP: i64 = 3 * RATE + RATE / 2;
/// Loans whose ledger inserts a trigger rejects: their charges must end in fine_pending (DEAD), nowhere else.
const POISONED: usize = 4;
/// The shard count the replicas end with; its keys are the ones that must all end SUCCESS.
const FINAL_SHARDS: i32 = 4;
/// How long the replicas get, after the last round of late rows, to settle and charge every late row (a re-open
/// takes a tick or two; the replicas may be busy with others).
const LATE_LIMIT: Duration = Duration::from_secs(60);

/// What the run's parts share.
struct Scene<'a> {
    server: &'a PrivateServer,
    pool: &'a PgPool,
    url: &'a str,
    proxy: &'a Proxy,
    mode: &'a Mode,
    world: &'a World,
    oracle: &'a Oracle,
    history: &'a History,
    seed: u64,
    started: Instant,
}

/// The database the replicas start on: loans around the three due months and the current one, a snapshot of
/// them, the update audit, a few poisoned loans, and every loan update and ledger insert slowed down.
struct World {
    /// The due months' last days, oldest first.
    months: Vec<NaiveDate>,
    /// The accrual window's days, oldest first.
    days: Vec<NaiveDate>,
    /// The window's last day (yesterday).
    current: NaiveDate,
    /// The last due month's end.
    last_month: NaiveDate,
    /// Loans whose ledger inserts a trigger rejects.
    poisoned: Vec<i64>,
}

impl World {
    async fn load(pool: &PgPool, mode: &Mode, seed: u64) -> World {
        // Loans around the three due months and the current one, disjoint ids.
        let (months, days) = due_dates(pool, mode.accrual_days).await;
        let current = *days.last().expect("days");
        let last_month = *months.last().expect("months");
        for (i, month) in months.iter().chain([&current]).enumerate() {
            let spec = demo::DemoSpec {
                loans: mode.loans_per_month,
                seed: seed.wrapping_add(i as u64),
                month: *month,
                first_id: 1 + i as i64 * 1_000_000,
            };
            insert(pool, &demo::loans(spec).collect::<Vec<_>>()).await;
        }
        // These loans stand for libraryd's history, there before fine-settler was installed. The triggers that
        // queue the loans libraryd changes for the accrual's re-check (fine_loan_changes) saw them inserted
        // overdue, as if every one had been recorded late: that queue starts empty, as after an upgrade, and
        // holds only what libraryd writes from here on.
        sqlx::raw_sql("delete from fine_loan_changes")
            .execute(pool)
            .await
            .expect("the loans' history is not a change");
        sqlx::raw_sql(
            "create table loans_before as select id, fine_cents from loans;
             create table late_loans (id bigint primary key, kind text not null);",
        )
        .execute(pool)
        .await
        .expect("snapshot");
        install_update_audit(pool).await;
        edits::install(pool).await;
        // Poison a few open loans that owe on every day up to the cap inside the window: due the day before it
        // starts or later, at least as many days before its end as it takes to reach the cap.
        let poisoned: Vec<i64> = sqlx::query_scalar(
            "select id from loans where returned_on is null and due_on between $1 and $2 order by id limit $3",
        )
        .bind(days[0] - chrono::Duration::days(1))
        .bind(current - chrono::Duration::days((CAP + RATE - 1) / RATE))
        .bind(POISONED as i64)
        .fetch_all(pool)
        .await
        .expect("poisoned");
        assert_eq!(poisoned.len(), POISONED);
        sqlx::raw_sql(&format!(
            "create function poison() returns trigger language plpgsql as $$
             begin raise exception 'loan % is poisoned by the chaos test', new.loan_id; end $$;
             create trigger poison before insert on fine_ledger for each row
               when (new.loan_id in ({})) execute function poison();",
            poisoned.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
        ))
        .execute(pool)
        .await
        .expect("poison");
        slow_down(pool, "update on loans", mode.seconds_per_row).await;
        sqlx::raw_sql(
            "create trigger slow_down before insert on fine_ledger for each row execute function slow_down();",
        )
        .execute(pool)
        .await
        .expect("slow ledger");
        let loans = scalar(pool, "select count(*) from loans").await;
        eprintln!(
            "chaos: {loans} loans; due months {months:?}; {} accrual days {}..{}; poisoned {poisoned:?}",
            days.len(),
            days[0],
            current
        );
        World {
            months,
            days,
            current,
            last_month,
            poisoned,
        }
    }
}

/// The due business dates, computed in SQL from the database clock (independently of the daemon's calendar).
async fn due_dates(pool: &PgPool, days: u32) -> (Vec<NaiveDate>, Vec<NaiveDate>) {
    let months: Vec<NaiveDate> = sqlx::query_scalar(
        "select (date_trunc('month', (now() at time zone $1)::date) - make_interval(months => k - 1)
                 - interval '1 day')::date
         from generate_series(1, 3) k order by 1",
    )
    .bind(ZONE)
    .fetch_all(pool)
    .await
    .expect("due months");
    let accrual: Vec<NaiveDate> = sqlx::query_scalar(
        "select (now() at time zone $1)::date - k from generate_series(1, $2) k order by 1",
    )
    .bind(ZONE)
    .bind(days as i32)
    .fetch_all(pool)
    .await
    .expect("due days");
    (months, accrual)
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar::<_, Option<i64>>(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .unwrap_or(0)
}

/// The operator fixes the poisoned loans and retries the DEAD charges (with the deployment's policy).
/// The final SIGTERM may land while a replica has just re-opened a key (its re-check runs every 2 s, and finds
/// work on a changed loan for a while): that run hands its key back (FAILED, "shutdown requested"), as it
/// should, for a peer that is not coming. An operator runs each such key once by hand, as the runbook says; the
/// invariants then hold for every key.
async fn operator_finishes_keys_handed_back_at_the_stop(pool: &PgPool, url: &str) {
    let handed_back: Vec<(String, NaiveDate, i32)> = sqlx::query_as(&format!(
        "select job_name, business_date, shard from job_runs
         where shards = {FINAL_SHARDS} and status = 'FAILED' and last_error like 'shutdown requested%'
         order by 1, 2, 3"
    ))
    .fetch_all(pool)
    .await
    .expect("job_runs");
    for (job, date, shard) in handed_back {
        let mut run = deployment(url);
        match job.as_str() {
            "fine-settlement" => run.args(["settle", "--business-date", &date.to_string()]),
            _ => run.args(["accrue", "--date", &date.to_string()]),
        };
        run.args([
            "--shard",
            &shard.to_string(),
            "--shards",
            &FINAL_SHARDS.to_string(),
        ]);
        let out = run.output().expect("the operator's run");
        eprintln!(
            "chaos: {job} {date} shard {shard} was handed back at the final stop; run by hand: exit {:?}",
            out.status.code()
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

async fn operator_retries_dead_charges(pool: &PgPool, url: &str) {
    sqlx::raw_sql("drop trigger poison on fine_ledger")
        .execute(pool)
        .await
        .expect("unpoison");
    let mut retry = deployment(url);
    retry.args(["pending", "retry", "--dead"]);
    let out = retry.output().expect("pending retry");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What the run did, in figures.
fn report(
    scene: &Scene<'_>,
    faults: &Faults<'_>,
    manual_outcomes: &BTreeMap<String, u64>,
    starts: u32,
    work_done: Duration,
    verdict: &Verdict,
    figures: &Figures,
) {
    let Figures {
        settled,
        settled_at_cap,
        ledger,
        net,
        ledger_loans,
        charged_to_cap,
        corrections,
        seen,
        checked,
        keys,
        takeovers,
        lost,
        reopened,
    } = figures;
    let (late, dead) = (&faults.late, verdict.dead);
    let (snapshots, skipped) = scene.history.counts();
    eprintln!(
        "chaos: {} mode, seed {}: work done after {work_done:.1?}, total {:.1?}",
        scene.mode.name,
        scene.seed,
        scene.started.elapsed()
    );
    eprintln!("chaos: faults injected: {:?}", faults.injected);
    eprintln!("chaos: manual runs by outcome: {manual_outcomes:?}; replica starts (final count): {starts}");
    eprintln!(
        "chaos: late rows injected: {} ({} returned in a settled month, {} back-dated returns, {} overdue in the \
         window); keys re-opened: {reopened:?}",
        late.total(),
        late.returned,
        late.back_dated,
        late.overdue
    );
    eprintln!(
        "chaos: charged loans changed: {} {:?}; corrections by reason: {corrections:?}",
        faults.edits.total(),
        faults.edits.by_kind()
    );
    eprintln!(
        "chaos: checked {checked} loans ({settled} settled, {settled_at_cap} at the cap of {CAP}), {ledger} first \
         charges, {net} (loan, day) nets of {ledger_loans} loans compared with a sequential run ({charged_to_cap} \
         loans at the cap), {dead} DEAD charges of {POISONED} poisoned loans, {keys} job_runs keys; {takeovers} \
         takeovers, {lost} lost leases; {snapshots} ledger snapshots ({skipped} skipped by a fault) followed \
         {seen} rows"
    );
    eprintln!("chaos: invariants: {:?}", verdict.violations);
}
