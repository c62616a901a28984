//! The chaos short mode on Citus: real `fine-settler run` replicas — 2 shards x 2 replicas, both jobs, a short
//! schedule period — on a Citus database of their own holding two due months of loans and an accrual window of
//! five days, under a fine cap that many loans reach, while a seeded schedule SIGKILLs replicas (each restarted
//! after a random pause), crashes the first worker and then the coordinator (`scripts/citus.sh crash-worker`,
//! `crash-coordinator`: stopped at once and started again), and libraryd records returns late: back-dated into
//! a month already settled (the key must re-open) and back-dated to a day already charged (the later days must
//! be corrected). Each crash waits for a key held by a live claim; the first pass outlasts the schedule. Once the
//! fleet has caught up it is stopped (SIGTERM, exit 0), and an oracle in plain SQL checks the result against the
//! rules alone: every loan of a due month settled with the policy's fine and written once (a trigger counts the
//! writes of each loan's settlement), no other loan touched, the net ledger of every (loan, day) of the window
//! what one clean sequential run by the loans' final rows leaves (charged once a day, under the cap, corrected
//! where libraryd changed the loan), the corrections numbered without a gap, nothing queued, every key of the
//! windows SUCCESS and none other, a settlement key re-opened, each loan returned on a charged day corrected, and
//! `fine-settler verify` clean for both months. About 100 s on the 2-core machine.
//!
//! The oracle is the one of the PostgreSQL chaos suite (tests/it/chaos/oracle.rs) in the forms Citus plans: its
//! statements join `loans` to the coordinator's `job_runs`, which Citus refuses ("direct joins between
//! distributed and local tables are not supported"), so the keys are read on their own and every one must be
//! SUCCESS, the window's days are a `values` list beside the loans, and the expected and actual ledgers are
//! compared row by row here. A seed other than the default: `FINE_SETTLER_CHAOS_SEED=7`.

use std::{
    collections::BTreeMap,
    fs::File,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use chrono::{Datelike, NaiveDate};
use fine_settler::demo::SplitMix64;
use futures_util::FutureExt;
use sqlx::PgPool;

use super::CitusDb;
use crate::helpers::{assert_success, ddl, exit_of, fine_settler, output, spawn, Running};

const RATE: i64 = 100;
/// Three and a half days' rate: a loan returned four or more days late is fined the cap, and an open loan is
/// charged three full days and half a fourth.
const CAP: i64 = 350;
const SHARDS: i32 = 2;
const REPLICAS_PER_SHARD: i32 = 2;
/// The settlement's catch-up window: the two months before the current one.
const MONTHS: u32 = 2;
/// The accrual's catch-up window: the five days before today.
const DAYS: i64 = 5;
const LOANS_PER_MONTH: u64 = 1500;
const WINDOW_LOANS: u64 = 2000;
const KILLS: usize = 6;
/// Rounds of each kind of libraryd edit.
const EDITS: usize = 2;
/// Faults land between these offsets from the start.
/// (The first pass takes longer than the window: every fault lands while the replicas work.)
const WINDOW: (Duration, Duration) = (Duration::from_secs(4), Duration::from_secs(35));
/// How long the fleet gets, after the last fault, to catch up.
const CATCH_UP: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the Citus cluster: scripts/test.sh --citus"]
async fn chaos_short_mode_on_citus() {
    let seed: u64 = std::env::var("FINE_SETTLER_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261205);
    let started = Instant::now();
    let db = CitusDb::new("chaos_short").await;
    let outcome = std::panic::AssertUnwindSafe(run(&db, seed, started))
        .catch_unwind()
        .await;
    db.drop().await;
    eprintln!("citus chaos: {:.1} s in all", started.elapsed().as_secs_f64());
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn run(db: &CitusDb, seed: u64, started: Instant) {
    let world = World::load(db, seed).await;
    let mut fleet = Fleet::start(&db.url);
    let mut faults = Faults::new(seed);
    faults.run(db, &world, &mut fleet, started).await;
    let caught_up = wait_for_the_end(&db.pool, &world).await;
    let work_done = started.elapsed();
    fleet.stop().await;

    let today: NaiveDate = sqlx::query_scalar("select (now() at time zone 'UTC')::date")
        .fetch_one(&db.pool)
        .await
        .expect("today");
    assert_eq!(
        today, world.today,
        "the UTC date changed during the run: the replicas' windows moved (run it again)"
    );
    let verdict = verdict(db, &world, &faults).await;
    eprintln!(
        "citus chaos: seed {seed}; {} loans; months {:?}; days {}..{}; caught up: {caught_up}; \
         work done in {:.1} s; injected {:?}; replica starts {}",
        world.loans,
        world.months,
        world.days[0],
        world.days[world.days.len() - 1],
        work_done.as_secs_f64(),
        faults.injected,
        fleet.starts
    );
    for (what, n) in Figures::read(&db.pool).await.0 {
        eprintln!("citus chaos:   {what}: {n}");
    }
    let broken: Vec<_> = verdict.iter().filter(|(_, n)| **n != 0).collect();
    if !broken.is_empty() {
        for (n, what) in fleet.errors().iter().take(8) {
            eprintln!("citus chaos: replica error {n:>5} x {what}");
        }
    }
    assert!(broken.is_empty(), "invariants violated: {broken:?}");
    for (what, n) in [
        ("SIGKILL", KILLS),
        ("worker crash with work in flight", 1),
        ("coordinator crash with work in flight", 1),
        ("return back-dated into a settled month", EDITS),
        ("return back-dated to a charged day", EDITS),
    ] {
        assert_eq!(
            faults.injected.get(what).copied().unwrap_or(0),
            n,
            "{what}: {:?}",
            faults.injected
        );
    }
    let holding = faults
        .injected
        .get("SIGKILL of a replica holding a claim")
        .copied()
        .unwrap_or(0);
    assert!(
        holding >= 2,
        "at least two SIGKILLs must hit a replica holding a claim: {:?}",
        faults.injected
    );
}

/// The database the replicas start on: the loans, the schema, the policy and the settlement counter.
struct World {
    /// The database's UTC date when the test began (the windows are the days and months before it).
    today: NaiveDate,
    /// The due months' last days, oldest first.
    months: Vec<NaiveDate>,
    /// The accrual window's days, oldest first.
    days: Vec<NaiveDate>,
    loans: usize,
}

impl World {
    /// Loans due in each of the two due months (three in four returned, from three days early to six late) and
    /// in the days before the accrual window's end (a little over half still out, the rest returned up to five
    /// days late), on libraryd's table; then `migrate` (which distributes it) with the deployment's policy, and a
    /// trigger that counts the daemon's writes of each loan's settlement.
    async fn load(db: &CitusDb, seed: u64) -> World {
        let today: NaiveDate = sqlx::query_scalar("select (now() at time zone 'UTC')::date")
            .fetch_one(&db.pool)
            .await
            .expect("today");
        let this_month = today.with_day(1).expect("a first day");
        let mut months = Vec::new();
        let mut end = this_month;
        for _ in 0..MONTHS {
            end = end.pred_opt().expect("a day");
            months.insert(0, end);
            end = end.with_day(1).expect("a first day");
        }
        let days: Vec<NaiveDate> = (1..=DAYS)
            .rev()
            .map(|k| today - chrono::Duration::days(k))
            .collect();
        let yesterday = days[days.len() - 1];
        let mut rng = SplitMix64::new(seed);
        let mut loans: Vec<(i64, NaiveDate, Option<NaiveDate>)> = Vec::new();
        for month in &months {
            let first = month.with_day(1).expect("a first day");
            for _ in 0..LOANS_PER_MONTH {
                let due = first + chrono::Duration::days(rng.below(u64::from(month.day())) as i64);
                let returned = (rng.below(4) != 0)
                    .then(|| (due + chrono::Duration::days(rng.below(10) as i64 - 3)).min(yesterday));
                loans.push((loans.len() as i64 + 1, due, returned));
            }
        }
        for _ in 0..WINDOW_LOANS {
            let due = yesterday - chrono::Duration::days(1 + rng.below(8) as i64);
            let returned = (rng.below(9) < 4)
                .then(|| (due + chrono::Duration::days(rng.below(6) as i64)).min(yesterday));
            loans.push((loans.len() as i64 + 1, due, returned));
        }
        sqlx::raw_sql(
            "create table loans (id bigint primary key, member_id bigint not null, book_id bigint not null,
                                 borrowed_on date not null, due_on date not null, returned_on date,
                                 settlement_writes int not null default 0)",
        )
        .execute(&db.pool)
        .await
        .expect("libraryd's loans");
        sqlx::query(
            "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
             select id, id % 97, id, due - 14, due, returned
             from unnest($1::bigint[], $2::date[], $3::date[]) as l(id, due, returned)",
        )
        .bind(loans.iter().map(|l| l.0).collect::<Vec<_>>())
        .bind(loans.iter().map(|l| l.1).collect::<Vec<_>>())
        .bind(loans.iter().map(|l| l.2).collect::<Vec<_>>())
        .execute(&db.pool)
        .await
        .expect("the loans");
        let mut cmd = deployment(&db.url);
        cmd.arg("migrate");
        assert_success(&output(cmd));
        // Counts each committed write of a loan's settlement (fine-settler's: libraryd never writes these
        // columns). Created after `migrate`, which distributes only a table without triggers of libraryd's.
        ddl(
            &db.pool,
            &[
                "create function count_settlement_write() returns trigger language plpgsql as $$
                 begin
                     if new.fine_settled_at is distinct from old.fine_settled_at
                        or new.fine_cents is distinct from old.fine_cents then
                         new.settlement_writes := old.settlement_writes + 1;
                     end if;
                     return new;
                 end $$",
                "create trigger count_settlement_write before update on loans
                 for each row execute function count_settlement_write()",
            ],
        )
        .await;
        eprintln!(
            "citus chaos: {} loans; due months {months:?}; accrual days {}..{yesterday}",
            loans.len(),
            days[0]
        );
        World {
            today,
            months,
            days,
            loans: loans.len(),
        }
    }

    /// Whether `column` (a date) falls in a due month.
    fn in_due_month(&self, column: &str) -> String {
        format!(
            "(date_trunc('month', {column}) + interval '1 month' - interval '1 day')::date in ({})",
            self.months
                .iter()
                .map(|m| format!("date '{m}'"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    }

    /// The keys every replica's window covers, as (job, business date, shard).
    fn keys(&self) -> Vec<(String, NaiveDate, i32)> {
        let mut keys = Vec::new();
        for shard in 0..SHARDS {
            for m in &self.months {
                keys.push(("fine-settlement".to_string(), *m, shard));
            }
            for d in &self.days {
                keys.push(("overdue-accrual".to_string(), *d, shard));
            }
        }
        keys.sort();
        keys
    }
}

/// The real binary with the deployment's settings, as every replica and command of the test has them.
fn deployment(url: &str) -> Command {
    let mut cmd = fine_settler(url);
    for (k, v) in [
        ("FINE_SETTLER__FINE__DAILY_RATE_CENTS", RATE.to_string()),
        ("FINE_SETTLER__FINE__CAP_CENTS", CAP.to_string()),
        ("FINE_SETTLER__TIME__ZONE", "UTC".to_string()),
        ("FINE_SETTLER__CLAIM__LEASE", "6s".to_string()),
        ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "5s".to_string()),
        ("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "50".to_string()),
        ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", MONTHS.to_string()),
        ("FINE_SETTLER__ACCRUAL__ENABLED", "true".to_string()),
        ("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "50".to_string()),
        ("FINE_SETTLER__ACCRUAL__CATCH_UP_DAYS", DAYS.to_string()),
        ("FINE_SETTLER__ACCRUAL__RETRY_BACKOFF", "500ms".to_string()),
        ("FINE_SETTLER__ACCRUAL__RETRY_BACKOFF_MAX", "2s".to_string()),
        ("FINE_SETTLER__ACCRUAL__RECHECK_EVERY", "1s".to_string()),
    ] {
        cmd.env(k, v);
    }
    cmd
}

/// One replica process slot.
struct Replica {
    shard: i32,
    log: PathBuf,
    child: Option<Running>,
    restart_at: Option<Instant>,
}

/// Two replicas for each of the two shards, their logs in a folder of their own.
struct Fleet {
    url: String,
    logs: tempfile::TempDir,
    replicas: Vec<Replica>,
    starts: u32,
}

impl Fleet {
    fn start(url: &str) -> Fleet {
        let logs = tempfile::tempdir().expect("a log folder");
        let replicas = (0..SHARDS)
            .flat_map(|s| (0..REPLICAS_PER_SHARD).map(move |i| (s, i)))
            .map(|(shard, i)| Replica {
                shard,
                log: logs.path().join(format!("shard{shard}-{i}.log")),
                child: None,
                restart_at: None,
            })
            .collect();
        let mut fleet = Fleet {
            url: url.to_string(),
            logs,
            replicas,
            starts: 0,
        };
        for i in 0..fleet.replicas.len() {
            fleet.spawn(i);
        }
        fleet
    }

    fn spawn(&mut self, i: usize) {
        let r = &mut self.replicas[i];
        let log = File::options()
            .create(true)
            .append(true)
            .open(&r.log)
            .expect("a log file");
        let mut cmd = deployment(&self.url);
        cmd.env("FINE_SETTLER__INSTANCE__SHARD", r.shard.to_string())
            .env("FINE_SETTLER__INSTANCE__SHARDS", SHARDS.to_string())
            .env("FINE_SETTLER__SCHEDULE__PERIOD", "500ms")
            .env("FINE_SETTLER__SCHEDULE__DRAIN_TIMEOUT", "15s")
            .env("FINE_SETTLER__DATABASE__MAX_CONNECTIONS", "2")
            .env("FINE_SETTLER__DATABASE__CONNECT_TIMEOUT", "2s")
            .arg("run")
            .stdout(Stdio::null())
            .stderr(log);
        r.child = Some(spawn(&mut cmd));
        r.restart_at = None;
        self.starts += 1;
    }

    /// A random running replica: its slot and pid.
    fn pick(&self, rng: &mut SplitMix64) -> Option<(usize, u32)> {
        let live: Vec<(usize, u32)> = (0..self.replicas.len())
            .filter_map(|i| self.replicas[i].child.as_ref().map(|c| (i, c.id())))
            .collect();
        (!live.is_empty()).then(|| live[rng.below(live.len() as u64) as usize])
    }

    /// SIGKILLs replica `i`, to be started again after 0.3–3 s.
    fn kill(&mut self, i: usize, rng: &mut SplitMix64) {
        let r = &mut self.replicas[i];
        crate::helpers::sigkill(r.child.take().expect("running"));
        r.restart_at = Some(Instant::now() + Duration::from_millis(300 + rng.below(2700)));
    }

    /// Starts again the killed replicas whose pause is over; whether every replica runs.
    fn restart_due(&mut self) -> bool {
        for i in 0..self.replicas.len() {
            if self.replicas[i].restart_at.is_some_and(|t| Instant::now() >= t) {
                self.spawn(i);
            }
        }
        self.replicas.iter().all(|r| r.child.is_some())
    }

    /// SIGTERM to every replica, each of which must exit 0.
    async fn stop(&mut self) {
        for r in &self.replicas {
            crate::helpers::signal(r.child.as_ref().expect("running"), "TERM");
        }
        for r in &mut self.replicas {
            let (code, _) = exit_of(r.child.take().expect("running"), Duration::from_secs(30)).await;
            assert_eq!(code, Some(0), "the final SIGTERM: {}", log_tail(&r.log));
        }
    }

    /// The replicas' error events (JSON log lines at level error), counted by message, most frequent first.
    fn errors(&self) -> Vec<(usize, String)> {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for entry in std::fs::read_dir(self.logs.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            for line in std::fs::read_to_string(entry.path()).unwrap_or_default().lines() {
                let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else {
                    continue;
                };
                if event["level"] == "error" {
                    let what = format!("{}: {}", event["message"], event["error"]);
                    *counts.entry(what.chars().take(300).collect()).or_default() += 1;
                }
            }
        }
        let mut by_count: Vec<(usize, String)> = counts.into_iter().map(|(w, n)| (n, w)).collect();
        by_count.sort_by(|a, b| b.cmp(a));
        by_count
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Kill,
    CrashWorker,
    CrashCoordinator,
    /// An open loan of the oldest due month returned, back-dated into that month once it is settled.
    ReturnIntoSettledMonth,
    /// An open loan charged on two days or more returned, back-dated to its first charged day.
    ReturnOnChargedDay,
}

/// The seeded schedule and what landed.
struct Faults {
    rng: SplitMix64,
    schedule: Vec<(Duration, Fault)>,
    injected: BTreeMap<&'static str, usize>,
    /// The loans libraryd changed.
    edited: Vec<i64>,
    /// The loans returned on a charged day (their later days must be corrected).
    returned_on_charged_day: Vec<i64>,
}

impl Faults {
    /// SIGKILLs over the whole window, the worker crash in its first third, the coordinator crash in its second
    /// (while work is in flight; apart, so that each is recovered from on its own), the edits anywhere in it.
    fn new(seed: u64) -> Faults {
        let mut rng = SplitMix64::new(seed ^ 0x00c1_7a5c);
        let (from, to) = WINDOW;
        let span = (to - from).as_millis() as u64;
        let mut schedule = Vec::new();
        let at = |rng: &mut SplitMix64, part: (u64, u64)| {
            from + Duration::from_millis(span * part.0 / 3 + rng.below(span * (part.1 - part.0) / 3))
        };
        for _ in 0..KILLS {
            schedule.push((at(&mut rng, (0, 3)), Fault::Kill));
        }
        schedule.push((at(&mut rng, (0, 1)), Fault::CrashWorker));
        schedule.push((at(&mut rng, (1, 2)), Fault::CrashCoordinator));
        for _ in 0..EDITS {
            schedule.push((at(&mut rng, (0, 3)), Fault::ReturnIntoSettledMonth));
            schedule.push((at(&mut rng, (0, 3)), Fault::ReturnOnChargedDay));
        }
        schedule.sort();
        eprintln!("citus chaos: schedule {schedule:?}");
        Faults {
            rng,
            schedule,
            injected: BTreeMap::new(),
            edited: Vec::new(),
            returned_on_charged_day: Vec::new(),
        }
    }

    /// Injects the schedule, restarting killed replicas as their pauses end; an edit that finds no loan yet (the
    /// month not settled, nothing charged twice) and a crash that finds no work in flight are tried again a
    /// second later. Returns once every fault landed
    /// and every replica runs.
    async fn run(&mut self, db: &CitusDb, world: &World, fleet: &mut Fleet, started: Instant) {
        let mut pending = std::mem::take(&mut self.schedule);
        loop {
            let all_running = fleet.restart_due();
            if pending.is_empty() && all_running {
                return;
            }
            assert!(
                started.elapsed() < WINDOW.1 + Duration::from_secs(60),
                "faults still to land: {pending:?}"
            );
            if let Some(&(at, fault)) = pending.first() {
                if started.elapsed() >= at {
                    pending.remove(0);
                    if !self.inject(db, world, fleet, fault).await {
                        pending.push((started.elapsed() + Duration::from_secs(1), fault));
                        pending.sort();
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether `fault` landed.
    async fn inject(&mut self, db: &CitusDb, world: &World, fleet: &mut Fleet, fault: Fault) -> bool {
        let landed = match fault {
            Fault::Kill => match fleet.pick(&mut self.rng) {
                Some((i, pid)) => {
                    let holding = in_flight(&db.pool, Some(pid)).await;
                    fleet.kill(i, &mut self.rng);
                    if holding {
                        self.count("SIGKILL of a replica holding a claim");
                    }
                    Some("SIGKILL")
                }
                None => None,
            },
            // A crash waits for work in flight (tried again a second later).
            Fault::CrashWorker => (in_flight(&db.pool, None).await && crash(&db.url, "crash-worker"))
                .then_some("worker crash with work in flight"),
            Fault::CrashCoordinator => (in_flight(&db.pool, None).await
                && crash(&db.url, "crash-coordinator"))
            .then_some("coordinator crash with work in flight"),
            Fault::ReturnIntoSettledMonth => self
                .return_into_settled_month(&db.pool, world)
                .await
                .then_some("return back-dated into a settled month"),
            Fault::ReturnOnChargedDay => self
                .return_on_charged_day(&db.pool)
                .await
                .then_some("return back-dated to a charged day"),
        };
        if let Some(what) = landed {
            self.count(what);
        }
        landed.is_some()
    }

    fn count(&mut self, what: &'static str) {
        *self.injected.entry(what).or_default() += 1;
        eprintln!("citus chaos: {what}");
    }

    /// libraryd records the return of an open loan of the oldest due month, back-dated to its due date plus 0–6
    /// days (inside the month), once both shards have settled that month: the key must re-open.
    async fn return_into_settled_month(&mut self, pool: &PgPool, world: &World) -> bool {
        let month = world.months[0];
        let settled: i64 = sqlx::query_scalar(
            "select count(*) from job_runs
             where job_name = 'fine-settlement' and business_date = $1 and shards = $2 and status = 'SUCCESS'",
        )
        .bind(month)
        .bind(SHARDS)
        .fetch_one(pool)
        .await
        .unwrap_or(0);
        if settled < i64::from(SHARDS) {
            return false;
        }
        let salt = self.rng.next_u64().to_string();
        let late = self.rng.below(7) as i32;
        let found: Option<i64> = sqlx::query_scalar(
            "select id from loans
             where returned_on is null and due_on between date_trunc('month', $1::date) and $1 and id <> all($3)
             order by md5(id::text || $2) limit 1",
        )
        .bind(month)
        .bind(&salt)
        .bind(&self.edited)
        .fetch_optional(pool)
        .await
        .ok()
        .flatten();
        let Some(id) = found else {
            return false;
        };
        let changed = sqlx::query(
            "update loans set returned_on = least(due_on + $3, $2) where id = $1 and returned_on is null",
        )
        .bind(id)
        .bind(month)
        .bind(late)
        .execute(pool)
        .await
        .is_ok_and(|r| r.rows_affected() == 1);
        if changed {
            self.edited.push(id);
        }
        changed
    }

    /// libraryd records the return of an open loan charged on two days or more, back-dated to the first of them:
    /// the later days must be corrected.
    async fn return_on_charged_day(&mut self, pool: &PgPool) -> bool {
        let salt = self.rng.next_u64().to_string();
        let found: Option<(i64, NaiveDate)> = sqlx::query_as(
            "select f.loan_id, min(f.accrual_date) from fine_ledger f join loans l on l.id = f.loan_id
             where l.returned_on is null and f.loan_id <> all($2)
             group by f.loan_id having count(*) >= 2
             order by md5(f.loan_id::text || $1) limit 1",
        )
        .bind(&salt)
        .bind(&self.edited)
        .fetch_optional(pool)
        .await
        .ok()
        .flatten();
        let Some((id, day)) = found else {
            return false;
        };
        let changed = sqlx::query("update loans set returned_on = $2 where id = $1 and returned_on is null")
            .bind(id)
            .bind(day)
            .execute(pool)
            .await
            .is_ok_and(|r| r.rows_affected() == 1);
        if changed {
            self.edited.push(id);
            self.returned_on_charged_day.push(id);
        }
        changed
    }
}

/// Whether a key is held by a live claim — of the replica `pid` if given (an owner is `host:pid:random`).
async fn in_flight(pool: &PgPool, pid: Option<u32>) -> bool {
    let owner = pid.map_or("%".to_string(), |p| format!("%:{p}:%"));
    sqlx::query_scalar::<_, i64>(
        "select count(*) from job_runs where status = 'RUNNING' and lease_until > now() and owner like $1",
    )
    .bind(owner)
    .fetch_one(pool)
    .await
    .is_ok_and(|n| n > 0)
}

/// `scripts/citus.sh what` on the test's cluster; true, so that a fault that happened reads as one.
fn crash(url: &str, what: &str) -> bool {
    crate::helpers::citus::citus_sh(url, what);
    true
}

/// Waits (at most [`CATCH_UP`]) until every key is SUCCESS, nothing is queued and the oracle finds the ledger
/// and the settlements as they must end; whether that happened (if not, the verdict says what is wrong).
async fn wait_for_the_end(pool: &PgPool, world: &World) -> bool {
    let deadline = Instant::now() + CATCH_UP;
    while Instant::now() < deadline {
        if let Ok(v) = invariants(pool, world).await {
            if v.values().all(|n| *n == 0) {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    false
}

/// Every invariant with its number of violations (0 where it holds).
async fn invariants(pool: &PgPool, world: &World) -> Result<BTreeMap<String, i64>, sqlx::Error> {
    let mut v = BTreeMap::new();
    let count = |sql: String| async move { sqlx::query_scalar::<_, i64>(&sql).fetch_one(pool).await };

    // The keys (the coordinator's table, read on its own).
    let keys: Vec<(String, NaiveDate, i32, String)> = sqlx::query_as(
        "select job_name, business_date, shard, status from job_runs where shards = $1 order by 1, 2, 3",
    )
    .bind(SHARDS)
    .fetch_all(pool)
    .await?;
    let want = world.keys();
    let have: Vec<(String, NaiveDate, i32)> = keys.iter().map(|k| (k.0.clone(), k.1, k.2)).collect();
    v.insert(
        "key of the windows missing, or one outside them".to_string(),
        (want != have) as i64,
    );
    v.insert(
        "key not SUCCESS".to_string(),
        keys.iter().filter(|k| k.3 != "SUCCESS").count() as i64,
    );
    v.insert(
        "key of another shard count".to_string(),
        count(format!("select count(*) from job_runs where shards <> {SHARDS}")).await?,
    );
    v.insert(
        "charge queued (fine_pending)".to_string(),
        count("select count(*) from fine_pending".to_string()).await?,
    );

    // Settlement, from the loans alone.
    let due_month = world.in_due_month("returned_on");
    v.insert(
        "loan of a due month unsettled or with the wrong fine".to_string(),
        count(format!(
            "select count(*) from loans where {due_month}
               and (fine_settled_at is null or fine_cents <> least({CAP}, greatest(0, returned_on - due_on) * {RATE}))"
        ))
        .await?,
    );
    v.insert(
        "loan outside the due months settled or fined".to_string(),
        count(format!(
            "select count(*) from loans where (returned_on is null or not {due_month})
               and (fine_settled_at is not null or fine_cents <> 0)"
        ))
        .await?,
    );
    v.insert(
        "settlement written other than once (settled loans) or at all (the others)".to_string(),
        count(
            "select count(*) from loans where settlement_writes <> (fine_settled_at is not null)::int"
                .to_string(),
        )
        .await?,
    );

    // The ledger: the net of every (loan, day) against one clean sequential run by the loans' final rows.
    let expected = expected_ledger(pool, world).await?;
    let net: BTreeMap<(i64, NaiveDate), i64> = sqlx::query_as::<_, (i64, NaiveDate, i64)>(
        "select loan_id, accrual_date, net_cents::bigint from fine_ledger_net",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|(l, d, n)| ((l, d), n))
    .collect();
    let differ = expected
        .keys()
        .chain(net.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter(|k| expected.get(k) != net.get(k))
        .count();
    v.insert(
        "(loan, day) whose net differs from a clean sequential run's".to_string(),
        differ as i64,
    );
    let mut per_loan: BTreeMap<i64, i64> = BTreeMap::new();
    for ((loan, _), n) in &net {
        *per_loan.entry(*loan).or_default() += n;
    }
    v.insert(
        "loan whose net is above the cap".to_string(),
        per_loan.values().filter(|n| **n > CAP).count() as i64,
    );
    v.insert(
        "ledger day outside the window".to_string(),
        count(format!(
            "select count(*) from fine_ledger where accrual_date not between date '{}' and date '{}'",
            world.days[0],
            world.days[world.days.len() - 1]
        ))
        .await?,
    );
    v.insert(
        "day whose corrections are not numbered 1, 2, … without a gap".to_string(),
        count(
            "select count(*) from (select loan_id, accrual_date from fine_ledger_corrections group by 1, 2
                                   having min(seq) <> 1 or max(seq) <> count(*)) x"
                .to_string(),
        )
        .await?,
    );
    v.insert(
        "correction of a day never charged".to_string(),
        count(
            "select count(*) from fine_ledger_corrections c
             left join fine_ledger f on f.loan_id = c.loan_id and f.accrual_date = c.accrual_date
             where f.loan_id is null"
                .to_string(),
        )
        .await?,
    );
    Ok(v)
}

/// `(loan, day) -> net` as one clean sequential run leaves it (tests/it/chaos/oracle.rs, `Oracle::expected`,
/// with every key of the window SUCCESS — checked on its own — and the days as a `values` list instead of the
/// join to `job_runs`): a day is owed when it is after the due date and not after the return; the loan's earlier
/// days were charged `rate × (day - due_on - 1)`, each the full rate until the cap, the day that reaches it what
/// is left, nothing after.
async fn expected_ledger(
    pool: &PgPool,
    world: &World,
) -> Result<BTreeMap<(i64, NaiveDate), i64>, sqlx::Error> {
    let days = world
        .days
        .iter()
        .map(|d| format!("(date '{d}')"))
        .collect::<Vec<_>>()
        .join(", ");
    let rows: Vec<(i64, NaiveDate, i64)> = sqlx::query_as(&format!(
        "select loan_id, accrual_date, least({RATE}, {CAP} - before)::bigint as net_cents
         from (select l.id as loan_id, k.day as accrual_date, {RATE} * (k.day - l.due_on - 1)::bigint as before
               from loans l join (values {days}) k(day)
                 on l.due_on < k.day and (l.returned_on is null or k.day <= l.returned_on)) x
         where before < {CAP}"
    ))
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|(l, d, n)| ((l, d), n)).collect())
}

/// The verdict once the fleet has stopped: the invariants, the libraryd edits picked up (a settlement key
/// re-opened, the changed loans' later days corrected), and `verify` clean for both months.
async fn verdict(db: &CitusDb, world: &World, faults: &Faults) -> BTreeMap<String, i64> {
    let mut v = invariants(&db.pool, world)
        .await
        .expect("the oracle's statements");
    let reopened: i64 = sqlx::query_scalar(
        "select count(*) from job_run_attempts where job_name = 'fine-settlement' and event = 'reopened'",
    )
    .fetch_one(&db.pool)
    .await
    .expect("job_run_attempts");
    v.insert(
        "no settlement key re-opened for the returns back-dated into a settled month".to_string(),
        (reopened == 0) as i64,
    );
    let corrected: i64 = sqlx::query_scalar(
        "select count(distinct loan_id) from fine_ledger_corrections where reason = 'returned' and loan_id = any($1)",
    )
    .bind(&faults.returned_on_charged_day)
    .fetch_one(&db.pool)
    .await
    .expect("fine_ledger_corrections");
    v.insert(
        "loan returned on a charged day without a correction".to_string(),
        faults.returned_on_charged_day.len() as i64 - corrected,
    );
    for month in &world.months {
        let mut cmd = deployment(&db.url);
        cmd.args(["verify", "--business-date", &month.to_string(), "--json"]);
        let out = output(cmd);
        let failed = out.status.code() != Some(0);
        if failed {
            eprintln!(
                "citus chaos: verify {month}: exit {:?}\n{}\n{}",
                out.status.code(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        v.insert(format!("verify --business-date {month} not clean"), failed as i64);
    }
    v
}

/// What the run did, for its report.
struct Figures(Vec<(&'static str, i64)>);

impl Figures {
    async fn read(pool: &PgPool) -> Figures {
        let mut figures = Vec::new();
        let at_cap =
            format!("select count(*) from loans where fine_settled_at is not null and fine_cents = {CAP}");
        for (what, sql) in [
            (
                "loans settled",
                "select count(*) from loans where fine_settled_at is not null",
            ),
            ("loans settled at the cap", &at_cap),
            ("first charges (fine_ledger)", "select count(*) from fine_ledger"),
            (
                "(loan, day) of the net ledger",
                "select count(*) from fine_ledger_net",
            ),
            ("corrections", "select count(*) from fine_ledger_corrections"),
            ("keys", "select count(*) from job_runs"),
            (
                "takeovers",
                "select count(*) from job_run_attempts where event = 'takeover'",
            ),
            (
                "lost leases",
                "select count(*) from job_run_attempts where event = 'lease_lost'",
            ),
            (
                "re-opened keys",
                "select count(*) from job_run_attempts where event = 'reopened'",
            ),
        ] {
            figures.push((what, sqlx::query_scalar(sql).fetch_one(pool).await.unwrap_or(-1)));
        }
        Figures(figures)
    }
}
