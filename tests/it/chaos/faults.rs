//! The fault schedule, drawn from the seed, and its injection: SIGKILLs (each replica restarted after a random
//! pause), zombies (SIGSTOP past the lease, SIGCONT once a peer took over), PostgreSQL restarts, connection cuts
//! through the proxy, forced reruns and manual `settle`/`accrue`, rounds of late rows, rounds of changes to loans
//! already charged, and the shard-count change; then the wait for the replicas to finish, with a last round of
//! both once every key is SUCCESS. The ledger is snapshotted with every progress report and around every round.

use std::{
    collections::BTreeMap,
    process::{Child, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use chrono::NaiveDate;
use fine_settler::demo::SplitMix64;
use sqlx::PgPool;
use tokio::task::JoinHandle;

use super::{
    edits::Edits,
    late::LateRows,
    replica::{deployment, log_tail, Candidate, Fleet},
    Mode, Scene, LATE_LIMIT,
};
use crate::helpers::send_signal;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Kill,
    Zombie,
    Restart,
    Cut,
    Manual,
    Late,
    Edit,
}

/// When each fault lands, as an offset from the start, in order.
fn schedule(mode: &Mode, rng: &mut SplitMix64) -> Vec<(Duration, Fault)> {
    let (from, to) = mode.window;
    let span = (to - from).as_millis() as u64;
    let mut schedule: Vec<(Duration, Fault)> = Vec::new();
    for (fault, n) in [
        (Fault::Kill, mode.kills),
        (Fault::Zombie, mode.zombies),
        (Fault::Restart, mode.restarts),
        (Fault::Cut, mode.cuts),
        (Fault::Manual, mode.manual),
        (Fault::Late, mode.late_rounds),
        (Fault::Edit, mode.edit_rounds),
    ] {
        for _ in 0..n {
            // Zombies land in the first quarter, restarts and cuts in the first third, while work is certainly in
            // flight (the short mode's first pass is over after about 22 s: a zombie up to 28 s found no claim to
            // freeze, and three cuts spread over the whole window none mid-run, each once in seven runs); zombies
            // after the shard-count change, so that their peers keep running.
            let at = if matches!(fault, Fault::Zombie | Fault::Restart | Fault::Cut) {
                let (start, part) = if fault == Fault::Zombie {
                    (mode.reshard_at + Duration::from_secs(1), 4)
                } else {
                    (from, 3)
                };
                start + Duration::from_millis(rng.below(span / part))
            } else {
                from + Duration::from_millis(rng.below(span))
            };
            schedule.push((at, fault));
        }
    }
    schedule.sort();
    schedule
}

/// A replica that was frozen past its lease, taken over and thawed: its owner and key.
pub struct Zombie {
    pub owner: String,
    pub date: NaiveDate,
    pub job: String,
}

/// How many faults of each kind landed.
#[derive(Default)]
pub struct Injected(BTreeMap<&'static str, u64>);

impl std::fmt::Debug for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl Injected {
    fn add(&mut self, what: &'static str, n: u64) {
        *self.0.entry(what).or_default() += n;
    }

    fn count(&self, what: &str) -> u64 {
        self.0.get(what).copied().unwrap_or(0)
    }

    /// Every fault of the mode landed, and where it had to: restarts and a cut while work was in flight, each
    /// zombie on a replica that held a claim.
    pub fn assert_all_landed(&self, mode: &Mode) {
        assert!(self.count("SIGKILL") >= mode.kills as u64);
        assert!(self.count("PostgreSQL restart") >= mode.restarts as u64);
        assert!(
            self.count("PostgreSQL restart with batches in flight") >= 2,
            "restarts must hit work in flight: {self:?}"
        );
        assert!(
            self.count("connection cut while its replica held a claim") >= 1,
            "a cut must hit a replica mid-run: {self:?}"
        );
        assert_eq!(
            self.count("zombie (SIGSTOP past the lease, SIGCONT)"),
            mode.zombies as u64,
            "a zombie found no replica holding a claim"
        );
    }
}

/// The chaos run: the seeded schedule and what it has done so far.
pub struct Faults<'a> {
    scene: &'a Scene<'a>,
    rng: SplitMix64,
    schedule: Vec<(Duration, Fault)>,
    next: usize,
    resharded: bool,
    reported: Instant,
    pub injected: Injected,
    pub late: LateRows,
    pub edits: Edits,
    manual: Vec<(String, Child)>,
    zombie_tasks: Vec<JoinHandle<Option<Zombie>>>,
    /// The pid of the replica a zombie act has frozen, which no SIGKILL may pick.
    frozen: Arc<Mutex<Option<u32>>>,
}

impl<'a> Faults<'a> {
    /// The schedule, from the seed.
    pub fn new(scene: &'a Scene<'a>, seed: u64) -> Faults<'a> {
        let mut rng = SplitMix64::new(seed);
        let schedule = schedule(scene.mode, &mut rng);
        Faults {
            scene,
            rng,
            schedule,
            next: 0,
            resharded: false,
            reported: Instant::now(),
            injected: Injected::default(),
            late: LateRows::default(),
            edits: Edits::default(),
            manual: Vec::new(),
            zombie_tasks: Vec::new(),
            frozen: Arc::default(),
        }
    }

    /// Injects every fault of the schedule, and changes the shard count 3 -> 4 on time.
    pub async fn run(&mut self, fleet: &mut Fleet) {
        let mode = self.scene.mode;
        while self.next < self.schedule.len() || !self.resharded {
            let now = self.scene.started.elapsed();
            self.progress().await;
            fleet.restart_due();
            if !self.resharded && now >= mode.reshard_at {
                fleet.reshard(4);
                self.resharded = true;
                self.injected.add("shard count change 3 -> 4", 1);
                continue;
            }
            let Some(&(at, fault)) = self.schedule.get(self.next) else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            if now < at {
                tokio::time::sleep((at - now).min(Duration::from_millis(100))).await;
                continue;
            }
            self.next += 1;
            self.inject(fault, now, fleet).await;
        }
    }

    async fn inject(&mut self, fault: Fault, now: Duration, fleet: &mut Fleet) {
        let Scene {
            server,
            pool,
            proxy,
            mode,
            world,
            ..
        } = self.scene;
        match fault {
            Fault::Kill => {
                // Holding the lock: a zombie act cannot pick this replica while it is being killed.
                let guard = self.frozen.lock().expect("lock");
                let killed = fleet.kill_one(&mut self.rng, *guard);
                drop(guard);
                if killed {
                    self.injected.add("SIGKILL", 1);
                }
            }
            Fault::Zombie => {
                self.zombie_tasks.push(tokio::spawn(zombie(
                    (*pool).clone(),
                    fleet.candidates(),
                    self.frozen.clone(),
                    mode.settle_limit / 3,
                )));
            }
            Fault::Restart => {
                // While a batch is in flight: wait (restarting replicas meanwhile) for a live claim.
                let running = live_claims(pool, fleet, None).await;
                server.restart();
                eprintln!("chaos: PostgreSQL restarted with {running} keys RUNNING");
                self.injected.add("PostgreSQL restart", 1);
                if running > 0 {
                    self.injected.add("PostgreSQL restart with batches in flight", 1);
                }
            }
            Fault::Cut => {
                // Mid-transaction: wait for the proxied replica to hold a live claim.
                let pid = fleet.proxied_pid();
                let running = live_claims(pool, fleet, pid).await;
                let n = proxy.cut_all();
                self.injected.add("connection cut (proxy)", 1);
                self.injected.add("connections cut", n);
                if running > 0 {
                    self.injected
                        .add("connection cut while its replica held a claim", 1);
                }
            }
            Fault::Manual => self.start_manual_run(),
            Fault::Edit => {
                if self.edit_round().await == 0 && now < mode.window.1 {
                    // Nothing charged yet: try again a little later.
                    self.schedule.push((now + Duration::from_secs(1), Fault::Edit));
                    self.schedule[self.next..].sort();
                }
            }
            Fault::Late => {
                let shards = if self.resharded { 4 } else { 3 };
                if self.late.inject(pool, &mut self.rng, shards, world).await {
                    eprintln!(
                        "chaos: {:>6.1}s  late rows: {:?}",
                        self.scene.started.elapsed().as_secs_f64(),
                        self.late
                    );
                    self.injected.add("late rows (rounds)", 1);
                } else if now < mode.window.1 {
                    // No month of this count is settled yet: try again a little later.
                    self.schedule.push((now + Duration::from_secs(1), Fault::Late));
                    self.schedule[self.next..].sort();
                }
            }
        }
    }

    /// One round of changes to loans already charged, between two snapshots of the ledger; how many landed.
    async fn edit_round(&mut self) -> u64 {
        let Scene {
            pool, world, history, ..
        } = self.scene;
        history.snapshot(pool).await;
        let landed = self.edits.inject(pool, &mut self.rng, world).await;
        history.snapshot(pool).await;
        if landed > 0 {
            eprintln!(
                "chaos: {:>6.1}s  charged loans changed: {:?}",
                self.scene.started.elapsed().as_secs_f64(),
                self.edits.by_kind()
            );
            self.injected.add("changes to charged loans (rounds)", 1);
        }
        landed
    }

    /// A manual `settle` or `accrue` (forced or not) of a random key of the current shard count, left running.
    fn start_manual_run(&mut self) {
        let Scene { url, world, .. } = self.scene;
        let rng = &mut self.rng;
        let shards = if self.resharded { 4 } else { 3 };
        let shard = rng.below(shards) as i32;
        let force = rng.below(2) == 0;
        let mut cmd = deployment(url);
        let what = if rng.below(2) == 0 {
            let m = world.months[rng.below(world.months.len() as u64) as usize];
            cmd.args(["settle", "--business-date", &m.to_string()]);
            format!("settle {m}")
        } else {
            let d = world.days[rng.below(world.days.len() as u64) as usize];
            cmd.args(["accrue", "--date", &d.to_string()]);
            format!("accrue {d}")
        };
        cmd.args(["--shard", &shard.to_string(), "--shards", &shards.to_string()]);
        if force {
            cmd.arg("--force");
        }
        let what = format!(
            "{what} shard {shard}/{shards}{}",
            if force { " --force" } else { "" }
        );
        cmd.stdout(Stdio::piped()).stderr(Stdio::null());
        self.manual.push((what, cmd.spawn().expect("spawn manual run")));
        self.injected.add(
            if force {
                "forced rerun"
            } else {
                "manual settle/accrue"
            },
            1,
        );
    }

    /// Waits for the zombies to finish their act (replicas keep being restarted meanwhile); the zombies.
    pub async fn zombies(&mut self, fleet: &mut Fleet) -> Vec<Zombie> {
        while !self.zombie_tasks.iter().all(JoinHandle::is_finished) {
            fleet.restart_due();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut zombies = Vec::new();
        for task in self.zombie_tasks.drain(..) {
            if let Some(z) = task.await.expect("the zombie act panicked") {
                zombies.push(z);
                self.injected.add("zombie (SIGSTOP past the lease, SIGCONT)", 1);
            }
        }
        zombies
    }

    /// Lets the replicas finish (restarting any still paused). Once every key is SUCCESS, a last round of late
    /// rows and of changes to charged loans lands in keys that are all done; the replicas must re-open them,
    /// settle and charge every late row and correct every changed loan's days (a correction clamped under the cap
    /// waits for a later re-check: the wait polls until the ledger of every late or changed loan is the
    /// sequential run's). Returns how many late or changed loans are still outstanding: 0, or what was left
    /// LATE_LIMIT after the last round.
    /// Panics if the keys are not all SUCCESS within the mode's settle limit.
    pub async fn wait_for_the_end(&mut self, fleet: &mut Fleet) -> i64 {
        let Scene {
            pool,
            mode,
            world,
            oracle,
            ..
        } = self.scene;
        let deadline = Instant::now() + mode.settle_limit;
        let mut last_round: Option<Instant> = None;
        loop {
            fleet.restart_due();
            self.progress().await;
            // A manual run still going may yet force a key (a slow start) or fail it: the end is when none is left
            // and the replicas have finished what any of them left.
            let done = self.manual_runs_ended()
                && finished(pool, &world.months, &world.days).await.unwrap_or(false)
                && fleet.all_running();
            if done && last_round.is_none() {
                assert!(self.late.inject(pool, &mut self.rng, 4, world).await);
                eprintln!(
                    "chaos: {:>6.1}s  last late rows: {:?}",
                    self.scene.started.elapsed().as_secs_f64(),
                    self.late
                );
                assert!(self.edit_round().await > 0, "no charged loan to change");
                last_round = Some(Instant::now());
                continue;
            }
            let late_left = oracle.late_left(pool).await;
            if done && late_left == 0 {
                return late_left;
            }
            if last_round.is_some_and(|t| t.elapsed() > LATE_LIMIT) {
                eprintln!(
                    "chaos: late or changed loans left {LATE_LIMIT:?} after the last round: {:#?}",
                    oracle.late_report(pool).await
                );
                return late_left;
            }
            if Instant::now() > deadline {
                let states: Vec<(String, NaiveDate, i32, String, Option<String>)> = sqlx::query_as(
                    "select job_name, business_date, shard, status, last_error from job_runs
                     where shards = 4 and status <> 'SUCCESS' order by 1, 2, 3",
                )
                .fetch_all(*pool)
                .await
                .unwrap_or_default();
                panic!(
                    "not finished after {:?}: {states:?}\n{}",
                    mode.settle_limit,
                    fleet.first_log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits for the manual runs, each of which must exit 0 or 1 with a report; their outcomes, counted.
    /// Whether every manual run has exited.
    fn manual_runs_ended(&mut self) -> bool {
        self.manual
            .iter_mut()
            .all(|(_, child)| matches!(child.try_wait(), Ok(Some(_))))
    }

    pub fn manual_outcomes(&mut self) -> BTreeMap<String, u64> {
        let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
        for (what, child) in self.manual.drain(..) {
            let out = child.wait_with_output().expect("manual run");
            let code = out.status.code();
            assert!(matches!(code, Some(0) | Some(1)), "{what}: exit {code:?}");
            let stdout = String::from_utf8_lossy(&out.stdout);
            let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or("{}"))
                .unwrap_or_else(|e| panic!("{what}: report {stdout:?}: {e}"));
            let outcome = report["outcome"].as_str().unwrap_or("none").to_string();
            assert!(
                ["settled", "skipped", "failed", "lease_lost"].contains(&outcome.as_str()),
                "{what}: {report}"
            );
            *outcomes.entry(outcome).or_default() += 1;
        }
        outcomes
    }

    /// One line of progress every 10 s: keys by status (final count), live claims, pending charges; and a
    /// snapshot of the ledger.
    async fn progress(&mut self) {
        if self.reported.elapsed() < Duration::from_secs(10) {
            return;
        }
        self.reported = Instant::now();
        self.scene.history.snapshot(self.scene.pool).await;
        let row: Result<(i64, i64, i64, i64), _> = sqlx::query_as(
            "select (select count(*) from job_runs where shards = 4 and status = 'SUCCESS'),
                    (select count(*) from job_runs where status = 'RUNNING' and lease_until > now()),
                    (select count(*) from fine_pending where status = 'PENDING'),
                    (select count(*) from fine_ledger)",
        )
        .fetch_one(self.scene.pool)
        .await;
        if let Ok((success, running, pending, ledger)) = row {
            eprintln!(
                "chaos: {:>6.1}s  keys SUCCESS (4 shards) {success}, live claims {running}, pending {pending}, ledger rows {ledger}",
                self.scene.started.elapsed().as_secs_f64()
            );
        }
    }
}

/// Whether every due key of the 4-shard count is SUCCESS and every pending charge has reached its end (DEAD).
async fn finished(pool: &PgPool, months: &[NaiveDate], days: &[NaiveDate]) -> Result<bool, sqlx::Error> {
    let keys: i64 = sqlx::query_scalar(
        "select count(*) from job_runs where shards = 4 and status = 'SUCCESS'
           and ((job_name = 'fine-settlement' and business_date = any($1))
             or (job_name = 'overdue-accrual' and business_date = any($2)))",
    )
    .bind(months)
    .bind(days)
    .fetch_one(pool)
    .await?;
    let pending: i64 = sqlx::query_scalar("select count(*) from fine_pending where status = 'PENDING'")
        .fetch_one(pool)
        .await?;
    Ok(keys == 4 * (months.len() + days.len()) as i64 && pending == 0)
}

/// The number of live claims (of the replica `pid`, or of anyone), waiting up to 20 s for one to appear while
/// restarting killed replicas.
async fn live_claims(pool: &PgPool, fleet: &mut Fleet, pid: Option<u32>) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        fleet.restart_due();
        let owner = pid.map(|p| format!("%:{p}:%")).unwrap_or_else(|| "%".into());
        let n: i64 = sqlx::query_scalar(
            "select count(*) from job_runs where status = 'RUNNING' and lease_until > now() and owner like $1",
        )
        .bind(owner)
        .fetch_one(pool)
        .await
        .unwrap_or(0);
        if n > 0 || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Freezes a replica that holds a claim (one of `candidates`, with a live peer of its shard) until a peer has
/// taken its key over, then thaws it and waits for it to record the lost lease. Runs beside the fault loop, which
/// leaves the frozen pid (in `frozen`) alone. None if no replica held a claim with a live peer within 20 s.
async fn zombie(
    pool: PgPool,
    candidates: Vec<Candidate>,
    frozen: Arc<Mutex<Option<u32>>>,
    limit: Duration,
) -> Option<Zombie> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let running: Vec<(String, NaiveDate, i32, i32, String, i64)> = sqlx::query_as(
            "select job_name, business_date, shards, shard, owner, epoch from job_runs
             where status = 'RUNNING' and lease_until > now()",
        )
        .fetch_all(&pool)
        .await
        .unwrap_or_default();
        for (job, date, shards, shard, owner, epoch) in running {
            let pid: u32 = owner.split(':').nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
            let Some(Candidate { log, .. }) = candidates.iter().find(|c| c.pid == pid) else {
                continue;
            };
            if !candidates
                .iter()
                .any(|c| c.shard == shard && c.shards == shards && c.pid != pid)
            {
                continue;
            }
            {
                // Under the lock the fault loop kills under: the pid is alive now and nobody kills it while frozen.
                let mut frozen = frozen.lock().expect("lock");
                let alive = std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("fine-settler"));
                if !alive {
                    continue;
                }
                *frozen = Some(pid);
                send_signal(pid, "STOP");
            }
            // Frozen while it still holds the key? The list above may be a tick old, and a statement sent just
            // before the freeze (its finish) still lands: look again once it has. A key it had finished meanwhile
            // is re-opened by a peer's re-check later (a higher epoch), with no lost lease for the zombie to report.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let holds: bool = sqlx::query_scalar(
                "select exists (select 1 from job_runs where job_name = $1 and business_date = $2 and shards = $3
                     and shard = $4 and status = 'RUNNING' and owner = $5 and epoch = $6)",
            )
            .bind(&job)
            .bind(date)
            .bind(shards)
            .bind(shard)
            .bind(&owner)
            .bind(epoch)
            .fetch_one(&pool)
            .await
            .unwrap_or(false);
            if !holds {
                send_signal(pid, "CONT");
                *frozen.lock().expect("lock") = None;
                continue;
            }
            // A peer of the same shard takes the key over once the lease has expired and the peer's tick comes
            // back to the key (a tick works through every due key of the shard in turn, so that can take a while
            // when the peers are busy with other keys).
            let taken = Instant::now() + limit;
            let mut overtaken = false;
            while Instant::now() < taken {
                let now_epoch: Option<i64> = sqlx::query_scalar(
                    "select epoch from job_runs where job_name = $1 and business_date = $2 and shards = $3
                     and shard = $4",
                )
                .bind(&job)
                .bind(date)
                .bind(shards)
                .bind(shard)
                .fetch_optional(&pool)
                .await
                .ok()
                .flatten();
                if now_epoch.is_some_and(|e| e > epoch) {
                    overtaken = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            send_signal(pid, "CONT");
            *frozen.lock().expect("lock") = None;
            assert!(
                overtaken,
                "no peer took over {job} {date} {shard}/{shards} from the frozen {owner}: {}",
                log_tail(log)
            );
            // Thawed, its next batch (or its finish) meets the new epoch: it must commit nothing and say so.
            let reported = Instant::now() + Duration::from_secs(30);
            loop {
                let lost: i64 = sqlx::query_scalar(
                    "select count(*) from job_run_attempts where owner = $1 and event = 'lease_lost'",
                )
                .bind(&owner)
                .fetch_one(&pool)
                .await
                .unwrap_or(0);
                if lost > 0 {
                    break;
                }
                assert!(
                    Instant::now() < reported,
                    "the thawed {owner} never reported its lost lease: {}",
                    log_tail(log)
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            eprintln!(
                "chaos: zombie {owner} ({job} {date} shard {shard}/{shards}, epoch {epoch}) taken over, thawed, \
                 reported lease lost"
            );
            return Some(Zombie { owner, date, job });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}
