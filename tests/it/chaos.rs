//! The chaos suite: real `fine-settler run` processes — 3 shards x 3 replicas, then 4 shards x 3 replicas — on a
//! private PostgreSQL loaded with several months of loans, while a seeded schedule injects SIGKILLs (each replica
//! restarted after a random pause), a zombie (SIGSTOP past its lease, SIGCONT after a peer took over), PostgreSQL
//! restarts, connection cuts through a TCP proxy, and forced reruns plus manual `settle`/`accrue` of the same
//! keys. Everything runs under a fine cap that most late loans reach. Meanwhile libraryd's live writes land in
//! keys that already succeeded — new loans returned inside a settled month, open loans whose return is recorded
//! late and back-dated into one, loans entered late that are overdue inside the accrual window — and the
//! replicas must re-open those keys. Afterwards an oracle written in plain SQL checks that nothing was lost,
//! charged twice or charged past the cap.
//!
//! `scripts/test.sh --test it chaos` runs the short mode (CI). The long mode:
//! `FINE_SETTLER_CHAOS=long FINE_SETTLER_CHAOS_SEED=7 scripts/test.sh --test it chaos -- --nocapture`.

use std::{
    collections::BTreeMap,
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use chrono::{Datelike, NaiveDate};
use fine_settler::demo::{self, SplitMix64};
use sqlx::{postgres::PgPoolOptions, PgConnection, PgPool};
use tokio::net::{TcpListener, TcpStream};

use crate::{
    helpers::{fine_settler, insert, install_update_audit, slow_down},
    server::PrivateServer,
};

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
    /// Rounds of late rows (see [`LateRows`]) while the replicas run, besides the last one once every key is
    /// SUCCESS.
    late_rounds: usize,
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
                window: (Duration::from_secs(8), Duration::from_secs(300)),
                reshard_at: Duration::from_secs(20),
                settle_limit: Duration::from_secs(900),
            },
            _ => Mode {
                name: "short",
                loans_per_month: 2_500,
                accrual_days: 10,
                seconds_per_row: 0.015,
                kills: 6,
                zombies: 1,
                restarts: 2,
                cuts: 3,
                manual: 6,
                late_rounds: 3,
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
const LEASE: &str = "6s";
const BATCH_TIMEOUT: &str = "3s";
/// Loans whose ledger inserts a trigger rejects: their charges must end in fine_pending (DEAD), nowhere else.
const POISONED: usize = 4;
/// How long the replicas get, after the last round of late rows, to settle and charge every late row (a re-open
/// takes a tick or two; the replicas may be busy with others).
const LATE_LIMIT: Duration = Duration::from_secs(60);

/// A TCP proxy in front of PostgreSQL whose connections the test can cut at any moment.
struct Proxy {
    port: u16,
    cut: tokio::sync::watch::Sender<u64>,
    active: Arc<AtomicU64>,
}

impl Proxy {
    async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let active = Arc::new(AtomicU64::new(0));
        let (tx, count) = (cut.clone(), active.clone());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let mut cut = tx.subscribe();
                let count = count.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                        return;
                    };
                    count.fetch_add(1, Ordering::SeqCst);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.changed() => {}
                    }
                    count.fetch_sub(1, Ordering::SeqCst);
                    // Both sockets drop here: the replica and the server each see their connection end,
                    // whatever was in flight.
                });
            }
        });
        Proxy { port, cut, active }
    }

    /// Cuts every connection open now; returns how many.
    fn cut_all(&self) -> u64 {
        let n = self.active.load(Ordering::SeqCst);
        self.cut.send_modify(|g| *g += 1);
        n
    }
}

/// One replica process slot: its shard, its URL (direct or through the proxy) and its log file.
struct Replica {
    shard: i32,
    shards: i32,
    url: String,
    log: PathBuf,
    child: Option<Child>,
    restart_at: Option<Instant>,
    starts: u32,
}

impl Replica {
    fn spawn(&mut self, mode: &Mode) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut cmd = deployment(&self.url);
        cmd.env("FINE_SETTLER__INSTANCE__SHARD", self.shard.to_string())
            .env("FINE_SETTLER__INSTANCE__SHARDS", self.shards.to_string())
            .env("FINE_SETTLER__SCHEDULE__PERIOD", "300ms")
            .env("FINE_SETTLER__SCHEDULE__DRAIN_TIMEOUT", "15s")
            .env("FINE_SETTLER__DATABASE__MAX_CONNECTIONS", "2")
            .env("FINE_SETTLER__DATABASE__CONNECT_TIMEOUT", "2s")
            .env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
            .env(
                "FINE_SETTLER__ACCRUAL__CATCH_UP_DAYS",
                mode.accrual_days.to_string(),
            )
            .arg("run")
            .stdout(Stdio::null())
            .stderr(log);
        self.child = Some(cmd.spawn().expect("spawn replica"));
        self.starts += 1;
        self.restart_at = None;
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

/// A replica still running when its slot goes away — the test failed half-way — is killed, so that no replica
/// outlives the test.
impl Drop for Replica {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The real binary with the deployment's shared settings, as every replica, manual run and the operator's retry
/// have them: the fine policy (with its cap), the claim timings, the batch sizes, the zone and the compensation
/// queue's backoff.
fn deployment(url: &str) -> Command {
    let mut cmd = fine_settler(url);
    cmd.env("FINE_SETTLER__FINE__DAILY_RATE_CENTS", RATE.to_string())
        .env("FINE_SETTLER__FINE__CAP_CENTS", CAP.to_string())
        .env("FINE_SETTLER__CLAIM__LEASE", LEASE)
        .env("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", BATCH_TIMEOUT)
        .env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "50")
        .env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "50")
        .env("FINE_SETTLER__ACCRUAL__MAX_ATTEMPTS", "3")
        .env("FINE_SETTLER__ACCRUAL__RETRY_BACKOFF", "200ms")
        .env("FINE_SETTLER__ACCRUAL__RETRY_BACKOFF_MAX", "1s")
        // Late overdue loans are found by the accrual's recheck; at the default 15 minutes the run would wait
        // that long for them.
        .env("FINE_SETTLER__ACCRUAL__RECHECK_EVERY", "2s")
        .env("FINE_SETTLER__TIME__ZONE", ZONE);
    cmd
}

/// One line of progress: keys by status (final count), live claims, pending charges.
async fn progress(pool: &PgPool, started: Instant) {
    let row: Result<(i64, i64, i64, i64), _> = sqlx::query_as(
        "select (select count(*) from job_runs where shards = 4 and status = 'SUCCESS'),
                (select count(*) from job_runs where status = 'RUNNING' and lease_until > now()),
                (select count(*) from fine_pending where status = 'PENDING'),
                (select count(*) from fine_ledger)",
    )
    .fetch_one(pool)
    .await;
    if let Ok((success, running, pending, ledger)) = row {
        eprintln!(
            "chaos: {:>6.1}s  keys SUCCESS (4 shards) {success}, live claims {running}, pending {pending}, ledger rows {ledger}",
            started.elapsed().as_secs_f64()
        );
    }
}

/// Restarts the killed replicas whose pause is over.
fn restart_due(replicas: &mut [Replica], mode: &Mode) {
    for r in replicas.iter_mut() {
        if r.restart_at.is_some_and(|t| Instant::now() >= t) {
            r.spawn(mode);
        }
    }
}

fn kill(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status();
}

/// The replicas' error events (JSON log lines at level error), counted by message and error, most frequent first:
/// what to look at when an invariant breaks.
fn replica_errors(dir: &Path) -> Vec<(usize, String)> {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        for line in text.lines() {
            let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if event["level"] == "error" {
                let what = format!("{}: {}", event["message"], event["error"]);
                *counts.entry(what.chars().take(300).collect()).or_default() += 1;
            }
        }
    }
    let mut by_count: Vec<(usize, String)> = counts.into_iter().map(|(what, n)| (n, what)).collect();
    by_count.sort_by(|a, b| b.cmp(a));
    by_count
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Kill,
    Zombie,
    Restart,
    Cut,
    Manual,
    Late,
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

/// Rows libraryd writes while the replicas run, into months and days whose keys already succeeded: a return
/// recorded after its month was settled and back-dated into it, a loan entered late. The daemon must re-open those
/// keys. Every loan injected is listed in the table `late_loans`, for the wait at the end and the oracle.
#[derive(Debug, Default)]
struct LateRows {
    /// New loans returned inside a settled due month.
    returned: u64,
    /// Open loans updated to returned, the return back-dated into a settled due month.
    back_dated: u64,
    /// New unreturned loans, overdue inside the accrual window.
    overdue: u64,
    /// Ids handed out so far.
    issued: i64,
}

/// New late loans take their ids from the gap below the month blocks (below every settlement cursor) or from
/// above them.
const LATE_IDS_BELOW: i64 = 500_000;
const LATE_IDS_ABOVE: i64 = 9_000_000;

impl LateRows {
    /// A fresh id from `base`'s range that belongs to shard `shard` of `shards`.
    fn id(&mut self, base: i64, shard: i32, shards: i32) -> i64 {
        self.issued += 1;
        let id = base + 12 * self.issued;
        id + (i64::from(shard) - id).rem_euclid(i64::from(shards))
    }

    fn total(&self) -> u64 {
        self.returned + self.back_dated + self.overdue
    }
}

/// The (business date, shard) of every SUCCESS key of `job` under the shard count `shards`.
async fn success_keys(pool: &PgPool, job: &str, shards: i32) -> Vec<(NaiveDate, i32)> {
    sqlx::query_as(
        "select business_date, shard from job_runs
         where job_name = $1 and shards = $2 and status = 'SUCCESS' order by 1, 2",
    )
    .bind(job)
    .bind(shards)
    .fetch_all(pool)
    .await
    .unwrap_or_default()
}

fn pick<T: Copy>(rng: &mut SplitMix64, from: &[T]) -> T {
    from[rng.below(from.len() as u64) as usize]
}

fn days(n: u64) -> chrono::Duration {
    chrono::Duration::days(n as i64)
}

/// A return day in the month ending `month_end`, and a due date: returned on time, late under the cap or late
/// past it — or, given the accrual window's first day, returned inside the window, one to six days late.
fn late_return(
    rng: &mut SplitMix64,
    month_end: NaiveDate,
    window_start: Option<NaiveDate>,
) -> (NaiveDate, NaiveDate) {
    let month_start = month_end.with_day(1).expect("first of the month");
    match window_start {
        Some(first) => {
            let from = month_start.max(first);
            let returned = from + days(rng.below((month_end - from).num_days() as u64 + 1));
            (returned, returned - days(1 + rng.below(6)))
        }
        None => {
            let returned = month_start + days(rng.below(u64::from(month_end.day())));
            (returned, returned + days(3) - days(rng.below(12)))
        }
    }
}

/// One round of late rows aimed at keys of the `shards` count that are SUCCESS, in one libraryd transaction:
/// four loans returned inside settled months, two loans overdue since before a day whose accrual succeeded, and
/// up to two back-dated returns of open loans into `last_month` (the last due month's end). `window` is the
/// accrual window. Writes nothing and returns false while no settlement key of that count has succeeded yet.
async fn inject_late(
    pool: &PgPool,
    rng: &mut SplitMix64,
    late: &mut LateRows,
    shards: i32,
    window: (NaiveDate, NaiveDate),
    last_month: NaiveDate,
    poisoned: &[i64],
) -> bool {
    let settled = success_keys(pool, "fine-settlement", shards).await;
    if settled.is_empty() {
        return false;
    }
    let charged = success_keys(pool, "overdue-accrual", shards).await;
    let in_window: Vec<_> = settled.iter().copied().filter(|(m, _)| *m >= window.0).collect();
    let mut tx = pool.begin().await.expect("begin late rows");
    for i in 0..4 {
        // The first one, when a settled month reaches into the accrual window, is returned inside the window and
        // overdue there: besides its fine it owes those days' charges.
        let inside = i == 0 && !in_window.is_empty();
        let (month_end, shard) = pick(rng, if inside { &in_window } else { &settled });
        let base = if i % 2 == 0 {
            LATE_IDS_BELOW
        } else {
            LATE_IDS_ABOVE
        };
        let id = late.id(base, shard, shards);
        let (returned, due) = late_return(rng, month_end, inside.then_some(window.0));
        new_late_loan(&mut tx, id, due - days(21), due, Some(returned), "returned").await;
        late.returned += 1;
    }
    for _ in 0..2 {
        let (day, shard) = if charged.is_empty() {
            (window.0, rng.below(shards as u64) as i32)
        } else {
            pick(rng, &charged)
        };
        let due = day - days(1 + rng.below(5));
        let id = late.id(LATE_IDS_ABOVE, shard, shards);
        new_late_loan(&mut tx, id, due - days(14), due, None, "overdue").await;
        late.overdue += 1;
    }
    late.back_dated += back_date_returns(&mut tx, rng, window.1, last_month, poisoned).await;
    tx.commit().await.expect("commit late rows");
    true
}

/// Inserts a loan as libraryd would, remembering it in `late_loans` (and in `loans_before`, so that the oracle
/// also checks that an unreturned one was left alone).
async fn new_late_loan(
    tx: &mut PgConnection,
    id: i64,
    borrowed: NaiveDate,
    due: NaiveDate,
    returned: Option<NaiveDate>,
    kind: &str,
) {
    sqlx::query(
        "with l as (insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
                    values ($1, 1, 1, $2, $3, $4) returning id, fine_cents),
              b as (insert into loans_before select id, fine_cents from l)
         insert into late_loans select id, $5 from l",
    )
    .bind(id)
    .bind(borrowed)
    .bind(due)
    .bind(returned)
    .bind(kind)
    .execute(&mut *tx)
    .await
    .expect("insert a late loan");
}

/// Records the return of up to two open loans, back-dated into `last_month`, the last settled month (`yesterday`
/// ends the accrual window). The ledger is append-only: a charge already written for a day after the back-dated
/// return stays (nothing is refunded, by design), so only returns that leave no such charge are back-dated: a
/// loan never overdue inside the window, returned between its borrowing and its due date (fine 0), and a loan
/// whose ledger has reached the cap on days up to its new return date (fine: the cap), for which no further
/// charge can be written. Returns how many.
async fn back_date_returns(
    tx: &mut PgConnection,
    rng: &mut SplitMix64,
    yesterday: NaiveDate,
    last_month: NaiveDate,
    poisoned: &[i64],
) -> u64 {
    let salt = rng.next_u64().to_string();
    let never_overdue: Option<(i64, NaiveDate, NaiveDate)> = sqlx::query_as(
        "select id, borrowed_on, least(due_on, $2) from loans
         where returned_on is null and due_on >= $1 and borrowed_on <= $2 and id <> all($3)
           and id not in (select id from late_loans)
         order by md5(id::text || $4) limit 1",
    )
    .bind(yesterday)
    .bind(last_month)
    .bind(poisoned)
    .bind(&salt)
    .fetch_optional(&mut *tx)
    .await
    .expect("an open loan never overdue in the window");
    let at_the_cap: Option<(i64, NaiveDate, NaiveDate)> = sqlx::query_as(
        "select l.id, max(f.accrual_date), $2 from loans l join fine_ledger f on f.loan_id = l.id
         where l.returned_on is null and l.id <> all($3) and l.id not in (select id from late_loans)
         group by l.id having sum(f.amount_cents) >= $1 and max(f.accrual_date) <= $2
         order by md5(l.id::text || $4) limit 1",
    )
    .bind(CAP)
    .bind(last_month)
    .bind(poisoned)
    .bind(&salt)
    .fetch_optional(&mut *tx)
    .await
    .expect("an open loan at the cap");
    let mut n = 0;
    for (id, from, to) in [never_overdue, at_the_cap].into_iter().flatten() {
        let returned = from + days(rng.below((to - from).num_days() as u64 + 1));
        sqlx::query(
            "with u as (update loans set returned_on = $2 where id = $1 and returned_on is null returning id)
             insert into late_loans select id, 'back-dated' from u",
        )
        .bind(id)
        .bind(returned)
        .execute(&mut *tx)
        .await
        .expect("back-date a return");
        // The audit counts fine-settler's updates of a loan; this one is libraryd's.
        sqlx::query("update loan_updates set n = n - 1 where loan_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await
            .expect("audit");
        n += 1;
    }
    n
}

/// The oracle's SQL, from the loans alone and the rule as the README states it (not the daemon's code): the due
/// months settle, each overdue day of the accrual window `first..=last` is charged, the cap bounds both.
struct Oracle {
    /// The due months' last days, as an SQL list.
    months: String,
    first: NaiveDate,
    last: NaiveDate,
}

impl Oracle {
    /// Whether the date `column` falls in a due month.
    fn in_due_month(&self, column: &str) -> String {
        format!(
            "(date_trunc('month', {column}) + interval '1 month' - interval '1 day')::date in ({})",
            self.months
        )
    }

    /// `(loan_id, accrual_date)`: every day of the window on which the loan is overdue, before any cap.
    fn overdue_days(&self) -> String {
        format!(
            "select l.id as loan_id, d::date as accrual_date
             from loans l, generate_series(date '{}', date '{}', interval '1 day') d
             where l.due_on < d::date and (l.returned_on is null or d::date <= l.returned_on)",
            self.first, self.last
        )
    }

    /// `(loan_id, days, total)`: per loan, its overdue days and what they owe under the cap.
    fn totals(&self) -> String {
        format!(
            "select loan_id, count(*) as days, least({CAP}, {RATE} * count(*))::bigint as total
             from ({}) o group by loan_id",
            self.overdue_days()
        )
    }

    /// `(loan_id, accrual_date, amount_cents)`: the ledger when each loan's days are charged in date order — the
    /// full rate each overdue day until the cap, the day that reaches it what is left under it, nothing after.
    /// `before` is what the loan's earlier days were charged.
    fn in_order_ledger(&self) -> String {
        format!(
            "select loan_id, accrual_date, least({RATE}, {CAP} - before)::bigint as amount_cents
             from (select loan_id, accrual_date,
                          coalesce(sum({RATE}) over (partition by loan_id order by accrual_date
                                                     rows between unbounded preceding and 1 preceding), 0)
                              as before
                   from ({}) o) x
             where before < {CAP}",
            self.overdue_days()
        )
    }

    /// Late loans the daemon has not caught up with — returned in a due month but unsettled, or charged other
    /// than their total: `(kind, id, due_on, returned_on, settled, charged, owed)`.
    fn late_outstanding(&self) -> String {
        format!(
            "select k.kind, l.id, l.due_on, l.returned_on, l.fine_settled_at is not null as settled,
                    coalesce(f.total, 0) as charged, coalesce(o.total, 0) as owed
             from late_loans k join loans l using (id)
             left join (select loan_id, sum(amount_cents) as total from fine_ledger
                        where loan_id in (select id from late_loans) group by 1) f on f.loan_id = k.id
             left join ({}) o on o.loan_id = k.id
             where (l.fine_settled_at is null and {})
                or coalesce(f.total, 0) <> coalesce(o.total, 0)",
            self.totals(),
            self.in_due_month("l.returned_on")
        )
    }
}

/// The ledger invariants, for every loan except `skip` where a loan's total is compared.
///
/// Whichever order the days are charged in, the cap must hold: no loan's ledger ever sums past it (checked on
/// its own, it is the point). Beyond that the per-day split depends on the order in which each loan's days were
/// charged, which the rule does not fix: every day is its own key, and a later day can be charged first — a
/// manual `accrue` of a later day, a peer running the next day while the key of the day before waits for a
/// takeover, a compensated charge of an earlier day (a DEAD day retried after later days were charged gets only
/// what is left under the cap). The split then differs from the in-order oracle while the total does not. So
/// the ledger is compared per loan total, day by day for the loans the cap never truncates, and for the others
/// through what holds in any order: charges only on overdue days, none above the rate, at most one partial
/// charge (the one that reached the cap).
async fn ledger_checks(pool: &PgPool, oracle: &Oracle, skip: &[i64]) -> Vec<(&'static str, i64)> {
    let skip = format!(
        "'{{{}}}'::bigint[]",
        skip.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
    );
    let (overdue, totals) = (oracle.overdue_days(), oracle.totals());
    vec![
        (
            "loan charged more than the cap in total",
            scalar(
                pool,
                &format!(
                    "select count(*) from (select loan_id from fine_ledger group by 1
                                           having sum(amount_cents) > {CAP}) x"
                ),
            )
            .await,
        ),
        (
            "ledger row for a day its loan was not overdue (or outside the window)",
            scalar(
                pool,
                &format!(
                    "select count(*) from fine_ledger f where not exists (
                         select 1 from ({overdue}) o where o.loan_id = f.loan_id and o.accrual_date = f.accrual_date)"
                ),
            )
            .await,
        ),
        (
            "ledger row above the daily rate, or a second partial row of a loan",
            scalar(
                pool,
                &format!(
                    "select count(*) from (select loan_id from fine_ledger group by 1
                                           having max(amount_cents) > {RATE}
                                              or count(*) filter (where amount_cents < {RATE}) > 1) x"
                ),
            )
            .await,
        ),
        (
            "loan whose ledger total differs from the oracle's",
            scalar(
                pool,
                &format!(
                    "select count(*) from (select loan_id, sum(amount_cents) as total from fine_ledger group by 1) f
                     full join ({totals}) o using (loan_id)
                     where coalesce(f.total, 0) <> coalesce(o.total, 0) and loan_id <> all({skip})"
                ),
            )
            .await,
        ),
        (
            "overdue day of a loan under the cap not charged the full rate",
            scalar(
                pool,
                &format!(
                    "with uncapped as (select loan_id from ({totals}) o
                                       where days * {RATE} <= {CAP} and loan_id <> all({skip})),
                          want as (select loan_id, accrual_date, {RATE}::bigint as amount_cents from ({overdue}) o
                                   where loan_id in (select loan_id from uncapped)),
                          have as (select loan_id, accrual_date, amount_cents from fine_ledger
                                   where loan_id in (select loan_id from uncapped))
                     select count(*) from ((select * from want except all select * from have)
                                           union all (select * from have except all select * from want)) x"
                ),
            )
            .await,
        ),
    ]
}

/// Loans whose ledger differs from the in-order oracle (their days were charged out of date order; see
/// [`ledger_checks`]): a figure, not a violation.
async fn charged_out_of_order(pool: &PgPool, oracle: &Oracle) -> i64 {
    let in_order = oracle.in_order_ledger();
    scalar(
        pool,
        &format!(
            "select count(distinct loan_id) from (
                 (select loan_id, accrual_date, amount_cents from fine_ledger except all ({in_order}))
                 union all (({in_order}) except all select loan_id, accrual_date, amount_cents from fine_ledger)) x"
        ),
    )
    .await
}

/// The late loans still outstanding, one line each, with the days charged: for the failure report.
async fn late_report(pool: &PgPool, oracle: &Oracle) -> Vec<String> {
    sqlx::query_scalar(&format!(
        "select format('%s loan %s due %s returned %s: settled %s, charged %s of %s (%s)', kind, id, due_on,
                       coalesce(returned_on::text, 'no'), settled, charged, owed,
                       (select string_agg(f.accrual_date || ': ' || f.amount_cents, ', ' order by f.accrual_date)
                        from fine_ledger f where f.loan_id = x.id))
         from ({}) x order by id",
        oracle.late_outstanding()
    ))
    .fetch_all(pool)
    .await
    .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos() {
    let mode = Mode::from_env();
    let seed: u64 = std::env::var("FINE_SETTLER_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20261130);
    let mut rng = SplitMix64::new(seed);
    let started = Instant::now();
    eprintln!("chaos: mode {} seed {seed}", mode.name);

    let server = PrivateServer::start(&["max_connections=150"]);
    let url = server.migrated_database("chaos").await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&url)
        .await
        .expect("connect");

    // Loans around the three due months and the current one, disjoint ids.
    let (months, days) = due_dates(&pool, mode.accrual_days).await;
    let current = *days.last().expect("days");
    let last_month = *months.last().expect("months");
    for (i, month) in months.iter().chain([&current]).enumerate() {
        let spec = demo::DemoSpec {
            loans: mode.loans_per_month,
            seed: seed.wrapping_add(i as u64),
            month: *month,
            first_id: 1 + i as i64 * 1_000_000,
        };
        insert(&pool, &demo::loans(spec).collect::<Vec<_>>()).await;
    }
    sqlx::raw_sql(
        "create table loans_before as select id, fine_cents from loans;
         create table late_loans (id bigint primary key, kind text not null);",
    )
    .execute(&pool)
    .await
    .expect("snapshot");
    install_update_audit(&pool).await;
    // Poison a few loans that are overdue every accrual day (unreturned, due before the window).
    let poisoned: Vec<i64> = sqlx::query_scalar(
        "select id from loans where returned_on is null and due_on < $1 order by id limit $2",
    )
    .bind(days[0] - chrono::Duration::days(1))
    .bind(POISONED as i64)
    .fetch_all(&pool)
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
    .execute(&pool)
    .await
    .expect("poison");
    slow_down(&pool, "update on loans", mode.seconds_per_row).await;
    sqlx::raw_sql(
        "create trigger slow_down before insert on fine_ledger for each row execute function slow_down();",
    )
    .execute(&pool)
    .await
    .expect("slow ledger");
    let loans = scalar(&pool, "select count(*) from loans").await;
    let oracle = Oracle {
        months: months
            .iter()
            .map(|m| format!("'{m}'"))
            .collect::<Vec<_>>()
            .join(","),
        first: days[0],
        last: current,
    };
    eprintln!(
        "chaos: {loans} loans; due months {months:?}; {} accrual days {}..{}; poisoned {poisoned:?}",
        days.len(),
        days[0],
        current
    );

    let proxy = Proxy::start(server.port()).await;
    let logs = tempfile::tempdir().expect("log dir");
    let make = |shard: i32, shards: i32, i: usize, proxied: bool| Replica {
        shard,
        shards,
        url: if proxied {
            url.replace(&format!(":{}/", server.port()), &format!(":{}/", proxy.port))
        } else {
            url.clone()
        },
        log: logs.path().join(format!("shards{shards}-shard{shard}-{i}.log")),
        child: None,
        restart_at: None,
        starts: 0,
    };
    // Phase A: 3 shards x 3 replicas; replica 0 of shard 0 goes through the proxy.
    let mut replicas: Vec<Replica> = (0..3)
        .flat_map(|s| (0..3).map(move |i| (s, i)))
        .map(|(s, i)| make(s, 3, i, s == 0 && i == 0))
        .collect();
    for r in &mut replicas {
        r.spawn(&mode);
    }

    // The fault schedule, from the seed.
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
    ] {
        for _ in 0..n {
            // Zombies and restarts land in the first half, while work is certainly in flight; zombies after the
            // shard-count change, so that their peers keep running.
            let at = if matches!(fault, Fault::Zombie | Fault::Restart) {
                let start = if fault == Fault::Zombie {
                    mode.reshard_at + Duration::from_secs(1)
                } else {
                    from
                };
                start + Duration::from_millis(rng.below(span / 2))
            } else {
                from + Duration::from_millis(rng.below(span))
            };
            schedule.push((at, fault));
        }
    }
    schedule.sort();
    let mut injected: BTreeMap<&str, u64> = BTreeMap::new();
    let mut manual: Vec<(String, Child)> = Vec::new();
    let mut zombie_tasks = Vec::new();
    let frozen: Arc<std::sync::Mutex<Option<u32>>> = Arc::default();
    let mut resharded = false;
    let mut next = 0;
    let mut late = LateRows::default();

    let mut reported = Instant::now();
    while next < schedule.len() || !resharded {
        let now = started.elapsed();
        if reported.elapsed() >= Duration::from_secs(10) {
            reported = Instant::now();
            progress(&pool, started).await;
        }
        restart_due(&mut replicas, &mode);
        if !resharded && now >= mode.reshard_at {
            // 3 -> 4 shards: stop every replica of the old count (SIGTERM: they hand their keys back and exit
            // 0), then start 4 x 3 of the new one.
            for r in replicas.iter_mut() {
                if let Some(pid) = r.pid() {
                    kill(pid, "TERM");
                }
            }
            for r in replicas.iter_mut() {
                if let Some(mut child) = r.child.take() {
                    let status = child.wait().expect("wait");
                    assert_eq!(status.code(), Some(0), "old-count replica: {}", log_tail(&r.log));
                }
            }
            replicas = (0..4)
                .flat_map(|s| (0..3).map(move |i| (s, i)))
                .map(|(s, i)| make(s, 4, i, s == 0 && i == 0))
                .collect();
            for r in &mut replicas {
                r.spawn(&mode);
            }
            resharded = true;
            *injected.entry("shard count change 3 -> 4").or_default() += 1;
            continue;
        }
        let Some(&(at, fault)) = schedule.get(next) else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        if now < at {
            tokio::time::sleep((at - now).min(Duration::from_millis(100))).await;
            continue;
        }
        next += 1;
        match fault {
            Fault::Kill => {
                // Holding the lock: a zombie act cannot pick this replica while it is being killed.
                let guard = frozen.lock().expect("lock");
                let frozen_pid = *guard;
                let live: Vec<usize> = (0..replicas.len())
                    .filter(|&i| replicas[i].child.is_some() && replicas[i].pid() != frozen_pid)
                    .collect();
                if live.is_empty() {
                    continue;
                }
                let r = &mut replicas[live[rng.below(live.len() as u64) as usize]];
                let mut child = r.child.take().expect("live");
                let _ = child.kill();
                let _ = child.wait();
                r.restart_at = Some(Instant::now() + Duration::from_millis(200 + rng.below(1800)));
                drop(guard);
                *injected.entry("SIGKILL").or_default() += 1;
            }
            Fault::Zombie => {
                let candidates: Vec<Candidate> = replicas
                    .iter()
                    .filter_map(|r| r.pid().map(|pid| (pid, r.shard, r.shards, r.log.clone())))
                    .collect();
                zombie_tasks.push(tokio::spawn(zombie(
                    pool.clone(),
                    candidates,
                    frozen.clone(),
                    mode.settle_limit / 3,
                )));
            }
            Fault::Restart => {
                // While a batch is in flight: wait (restarting replicas meanwhile) for a live claim.
                let running = live_claims(&pool, &mut replicas, &mode, None).await;
                server.restart();
                eprintln!("chaos: PostgreSQL restarted with {running} keys RUNNING");
                *injected.entry("PostgreSQL restart").or_default() += 1;
                if running > 0 {
                    *injected
                        .entry("PostgreSQL restart with batches in flight")
                        .or_default() += 1;
                }
            }
            Fault::Cut => {
                // Mid-transaction: wait for the proxied replica to hold a live claim.
                let proxied = replicas
                    .iter()
                    .position(|r| r.url.contains(&format!(":{}/", proxy.port)));
                let pid = proxied.and_then(|i| replicas[i].pid());
                let running = live_claims(&pool, &mut replicas, &mode, pid).await;
                let n = proxy.cut_all();
                *injected.entry("connection cut (proxy)").or_default() += 1;
                *injected.entry("connections cut").or_default() += n;
                if running > 0 {
                    *injected
                        .entry("connection cut while its replica held a claim")
                        .or_default() += 1;
                }
            }
            Fault::Manual => {
                let shards = if resharded { 4 } else { 3 };
                let shard = rng.below(shards) as i32;
                let force = rng.below(2) == 0;
                let mut cmd = deployment(&url);
                let what = if rng.below(2) == 0 {
                    let m = months[rng.below(months.len() as u64) as usize];
                    cmd.args(["settle", "--business-date", &m.to_string()]);
                    format!("settle {m}")
                } else {
                    let d = days[rng.below(days.len() as u64) as usize];
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
                manual.push((what, cmd.spawn().expect("spawn manual run")));
                *injected
                    .entry(if force {
                        "forced rerun"
                    } else {
                        "manual settle/accrue"
                    })
                    .or_default() += 1;
            }
            Fault::Late => {
                let shards = if resharded { 4 } else { 3 };
                if inject_late(
                    &pool,
                    &mut rng,
                    &mut late,
                    shards,
                    (days[0], current),
                    last_month,
                    &poisoned,
                )
                .await
                {
                    eprintln!(
                        "chaos: {:>6.1}s  late rows: {late:?}",
                        started.elapsed().as_secs_f64()
                    );
                    *injected.entry("late rows (rounds)").or_default() += 1;
                } else if now < mode.window.1 {
                    // No month of this count is settled yet: try again a little later.
                    schedule.push((now + Duration::from_secs(1), Fault::Late));
                    schedule[next..].sort();
                }
            }
        }
    }

    // The zombies finish their act (replicas keep being restarted meanwhile).
    while !zombie_tasks
        .iter()
        .all(|t: &tokio::task::JoinHandle<_>| t.is_finished())
    {
        restart_due(&mut replicas, &mode);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut zombies: Vec<(String, NaiveDate, String)> = Vec::new();
    for task in zombie_tasks {
        if let Some(z) = task.await.expect("the zombie act panicked") {
            zombies.push(z);
            *injected
                .entry("zombie (SIGSTOP past the lease, SIGCONT)")
                .or_default() += 1;
        }
    }

    // Let the replicas finish (restarting any still paused). Once every key is SUCCESS, a last round of late rows
    // lands in keys that are all done; the replicas must re-open them and settle and charge every late row (the
    // oracle reports any left after LATE_LIMIT). Then stop them all.
    let deadline = Instant::now() + mode.settle_limit;
    let mut last_round: Option<Instant> = None;
    let mut late_left: i64;
    loop {
        restart_due(&mut replicas, &mode);
        if reported.elapsed() >= Duration::from_secs(10) {
            reported = Instant::now();
            progress(&pool, started).await;
        }
        let done = finished(&pool, &months, &days).await.unwrap_or(false)
            && replicas.iter().all(|r| r.child.is_some());
        if done && last_round.is_none() {
            assert!(
                inject_late(
                    &pool,
                    &mut rng,
                    &mut late,
                    4,
                    (days[0], current),
                    last_month,
                    &poisoned
                )
                .await
            );
            eprintln!(
                "chaos: {:>6.1}s  last late rows: {late:?}",
                started.elapsed().as_secs_f64()
            );
            last_round = Some(Instant::now());
            continue;
        }
        late_left = sqlx::query_scalar(&format!("select count(*) from ({}) x", oracle.late_outstanding()))
            .fetch_one(&pool)
            .await
            .unwrap_or(i64::MAX);
        if done && late_left == 0 {
            break;
        }
        if last_round.is_some_and(|t| t.elapsed() > LATE_LIMIT) {
            eprintln!(
                "chaos: late rows left {LATE_LIMIT:?} after the last round: {:#?}",
                late_report(&pool, &oracle).await
            );
            break;
        }
        if Instant::now() > deadline {
            let states: Vec<(String, NaiveDate, i32, String, Option<String>)> = sqlx::query_as(
                "select job_name, business_date, shard, status, last_error from job_runs
                 where shards = 4 and status <> 'SUCCESS' order by 1, 2, 3",
            )
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
            panic!(
                "not finished after {:?}: {states:?}\n{}",
                mode.settle_limit,
                log_tail(&replicas[0].log)
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let work_done = started.elapsed();
    for r in &replicas {
        kill(r.pid().expect("live"), "TERM");
    }
    for r in replicas.iter_mut() {
        let status = r.child.take().expect("live").wait().expect("wait");
        assert_eq!(status.code(), Some(0), "final SIGTERM: {}", log_tail(&r.log));
    }
    let mut manual_outcomes: BTreeMap<String, u64> = BTreeMap::new();
    for (what, child) in manual {
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
        *manual_outcomes.entry(outcome).or_default() += 1;
    }

    // The zombies: each found its key taken over, committed nothing after that, and recorded the lost lease.
    for (owner, date, job) in &zombies {
        let lost = scalar(
            &pool,
            &format!(
                "select count(*) from job_run_attempts where owner = '{owner}' and event = 'lease_lost'
                   and job_name = '{job}' and business_date = '{date}'"
            ),
        )
        .await;
        assert!(
            lost >= 1,
            "zombie {owner} ({job} {date}) did not report a lost lease"
        );
    }

    // ---- The oracle: plain SQL, independent of the daemon's code. ----
    let mut violations: BTreeMap<String, i64> = BTreeMap::new();
    let mut check = |name: &str, n: i64| {
        violations.insert(name.to_string(), n);
    };
    // Every loan returned in a settled month — the late ones too — is settled with the policy's fine.
    check(
        "loan of a settled month unsettled or with the wrong fine",
        scalar(
            &pool,
            &format!(
                "select count(*) from loans
                 where {} and (fine_settled_at is null
                               or fine_cents <> least({CAP}, greatest(0, returned_on - due_on) * {RATE}))",
                oracle.in_due_month("returned_on")
            ),
        )
        .await,
    );
    // Loans outside the settled months are untouched.
    check(
        "loan outside the settled months touched",
        scalar(
            &pool,
            &format!(
                "select count(*) from loans l join loans_before b using (id)
                 where (l.returned_on is null or not {})
                   and (l.fine_settled_at is not null or l.fine_cents <> b.fine_cents)",
                oracle.in_due_month("l.returned_on")
            ),
        )
        .await,
    );
    check(
        "loan updated more than once",
        scalar(&pool, "select count(*) from loan_updates where n > 1").await,
    );
    // Every key of the final count is SUCCESS.
    check(
        "key of the final count not SUCCESS",
        scalar(
            &pool,
            "select count(*) from job_runs where shards = 4 and status <> 'SUCCESS'",
        )
        .await,
    );
    check(
        "late loan not settled or charged within LATE_LIMIT of the last round",
        late_left,
    );
    // fine_pending holds only the poisoned loans, all DEAD.
    let poisoned_sql = poisoned.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    check(
        "pending charge of a loan the test did not poison, or not DEAD",
        scalar(
            &pool,
            &format!(
                "select count(*) from fine_pending where loan_id not in ({poisoned_sql}) or status <> 'DEAD'"
            ),
        )
        .await,
    );
    let dead = scalar(&pool, "select count(*) from fine_pending").await;
    // The poisoned loans' ledger stays empty, so the cap never stops their charges: every overdue day of the
    // window waits, DEAD, in fine_pending.
    check(
        "overdue day of a poisoned loan not DEAD in fine_pending",
        scalar(
            &pool,
            &format!(
                "select count(*) from ({}) o where o.loan_id in ({poisoned_sql})
                 and not exists (select 1 from fine_pending p where p.loan_id = o.loan_id
                                 and p.accrual_date = o.accrual_date and p.status = 'DEAD')",
                oracle.overdue_days()
            ),
        )
        .await,
    );
    // The ledger, the poisoned loans' totals aside.
    for (name, n) in ledger_checks(&pool, &oracle, &poisoned).await {
        check(name, n);
    }

    // The operator fixes the poisoned loans and retries the DEAD charges (with the deployment's policy): the
    // ledger becomes the oracle's, compared as `ledger_checks` says — a DEAD day compensated after a later day
    // was charged could split a loan's total differently from the in-order oracle.
    sqlx::raw_sql("drop trigger poison on fine_ledger")
        .execute(&pool)
        .await
        .expect("unpoison");
    let mut retry = deployment(&url);
    retry.args(["pending", "retry", "--dead"]);
    let out = retry.output().expect("pending retry");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    check(
        "pending after the operator's retry",
        scalar(&pool, "select count(*) from fine_pending").await,
    );
    for (name, n) in ledger_checks(&pool, &oracle, &[]).await {
        check(&format!("after the retry: {name}"), n);
    }

    let settled = scalar(
        &pool,
        "select count(*) from loans where fine_settled_at is not null",
    )
    .await;
    let settled_at_cap = scalar(
        &pool,
        &format!("select count(*) from loans where fine_settled_at is not null and fine_cents = {CAP}"),
    )
    .await;
    let ledger = scalar(&pool, "select count(*) from fine_ledger").await;
    let ledger_loans = scalar(&pool, "select count(distinct loan_id) from fine_ledger").await;
    let charged_to_cap = scalar(
        &pool,
        &format!(
            "select count(*) from (select loan_id from fine_ledger group by 1 having sum(amount_cents) = {CAP}) x"
        ),
    )
    .await;
    let out_of_order = charged_out_of_order(&pool, &oracle).await;
    let checked = scalar(&pool, "select count(*) from loans").await;
    let keys = scalar(&pool, "select count(*) from job_runs").await;
    let takeovers = scalar(
        &pool,
        "select count(*) from job_run_attempts where event = 'takeover'",
    )
    .await;
    let lost = scalar(
        &pool,
        "select count(*) from job_run_attempts where event = 'lease_lost'",
    )
    .await;
    let reopened: Vec<(String, i64)> = sqlx::query_as(
        "select job_name, count(*) from job_run_attempts where event = 'reopened' group by 1 order by 1",
    )
    .fetch_all(&pool)
    .await
    .expect("re-opens");
    let starts: u32 = replicas.iter().map(|r| r.starts).sum();
    eprintln!(
        "chaos: {} mode, seed {seed}: work done after {work_done:.1?}, total {:.1?}",
        mode.name,
        started.elapsed()
    );
    eprintln!("chaos: faults injected: {injected:?}");
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
        "chaos: checked {checked} loans ({settled} settled, {settled_at_cap} at the cap of {CAP}), {ledger} ledger \
         rows of {ledger_loans} loans ({charged_to_cap} charged up to the cap, {out_of_order} of them with days \
         charged out of date order), {dead} DEAD charges of {POISONED} poisoned loans, {keys} job_runs keys; \
         {takeovers} takeovers, {lost} lost leases"
    );
    eprintln!("chaos: invariants: {violations:?}");
    let broken: Vec<_> = violations.iter().filter(|(_, n)| **n != 0).collect();
    if !broken.is_empty() {
        eprintln!("chaos: replica errors, most frequent first:");
        for (n, what) in replica_errors(logs.path()).iter().take(8) {
            eprintln!("    {n:>5} x {what}");
        }
    }
    assert!(broken.is_empty(), "invariants violated: {broken:?}");
    assert!(
        reopened.iter().map(|(_, n)| n).sum::<i64>() >= 1,
        "no key was re-opened for the late rows"
    );
    assert!(injected.get("SIGKILL").copied().unwrap_or(0) >= mode.kills as u64);
    assert!(injected.get("PostgreSQL restart").copied().unwrap_or(0) >= mode.restarts as u64);
    assert!(
        injected
            .get("PostgreSQL restart with batches in flight")
            .copied()
            .unwrap_or(0)
            >= 2,
        "restarts must hit work in flight: {injected:?}"
    );
    assert!(
        injected
            .get("connection cut while its replica held a claim")
            .copied()
            .unwrap_or(0)
            >= 1,
        "a cut must hit a replica mid-run: {injected:?}"
    );
    assert_eq!(
        injected
            .get("zombie (SIGSTOP past the lease, SIGCONT)")
            .copied()
            .unwrap_or(0),
        mode.zombies as u64,
        "a zombie found no replica holding a claim"
    );
}

/// The number of live claims (of the replica `pid`, or of anyone), waiting up to 20 s for one to appear while
/// restarting killed replicas.
async fn live_claims(pool: &PgPool, replicas: &mut [Replica], mode: &Mode, pid: Option<u32>) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        restart_due(replicas, mode);
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

/// A live replica as a zombie candidate: pid, shard, shard count, log.
type Candidate = (u32, i32, i32, PathBuf);

/// Freezes a replica that holds a claim (one of `candidates`, with a live peer of its shard) until a peer has
/// taken its key over, then thaws it and waits for it to record the lost lease. Runs beside the fault loop, which
/// leaves the frozen pid (in `frozen`) alone. Returns the zombie's owner and key.
async fn zombie(
    pool: PgPool,
    candidates: Vec<Candidate>,
    frozen: Arc<std::sync::Mutex<Option<u32>>>,
    limit: Duration,
) -> Option<(String, NaiveDate, String)> {
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
            let Some((_, _, _, log)) = candidates.iter().find(|c| c.0 == pid) else {
                continue;
            };
            if !candidates
                .iter()
                .any(|c| c.1 == shard && c.2 == shards && c.0 != pid)
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
                kill(pid, "STOP");
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
            kill(pid, "CONT");
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
            return Some((owner, date, job));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}
