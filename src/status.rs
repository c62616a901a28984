//! The status page (`/status`, HTML) and its data (`/status.json`): where every shard of every job stands, the
//! compensation queue, and this replica's own schedule, last tick and clock skew.
//!
//! A read of the database is three short statements ([`crate::store::status`]) through a pool of one connection
//! of its own under a statement timeout, so page loads can neither take a connection from the jobs nor hold one
//! for long. Page loads share one read at a time ([`flight`]): a load that arrives while a read runs waits for
//! its answer, at most [`MAX_WAITING`] loads wait at once and the next is answered at once that the page is busy,
//! and after a failed read one search for the next qualifying host of `database.url` runs at a time — so a flood
//! of page loads opens no more database sessions than one load, and leaves the listener's other places to the
//! probes. Everything else comes from the replica's [`Heartbeat`] (its last tick and progress) and [`Metrics`]
//! (its clock skew).
//!
//! Per job, the grid is every business date of this replica's catch-up window, plus every older key that is
//! not SUCCESS (abandoned by the window), × every shard count and shard found in `job_runs` and every shard of
//! this replica's own shard count ([`fleet`]). A cell without a row is shown as absent; a due key of another
//! shard that nobody runs is marked unclaimed. The pauses in force for a job (`pause`) are listed
//! above its grid.
//!
//! The HTML is built with `maud`, which escapes every value it interpolates: an owner or an error message is
//! text, never markup. The page has no script; it reloads itself every [`RELOAD_SECONDS`].

mod fleet;
mod flight;

use std::{
    collections::BTreeSet,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use crate::store::Db;
use chrono::{DateTime, NaiveDate, TimeZone, Utc};
use maud::{html, Markup, DOCTYPE};

use crate::{
    calendar,
    config::Settings,
    health::Heartbeat,
    jobs::JobName,
    metrics::Metrics,
    schedule::{due, Schedule},
    store::{
        job_runs::RunStatus,
        pauses::Pause,
        status::{self as rows, DeadCharge, KeyRow},
    },
};

/// How long a page load may wait for the database, in all: the connection, then each statement.
pub const DATABASE_TIMEOUT: Duration = Duration::from_secs(2);
/// The page reloads itself this often.
pub const RELOAD_SECONDS: u32 = 5;
/// DEAD charges listed (the oldest).
const DEAD_SHOWN: i64 = 5;
/// Page loads that may wait for the read in flight at once (each holds one of the listener's places); the next
/// is answered 503 "status busy" at once.
pub const MAX_WAITING: usize = 8;

/// Where the status data comes from: the replica's settings and identity, its heartbeat and metrics, and the
/// page's own pool, with the read in flight and the search for a host in flight.
#[derive(Debug, Clone)]
pub struct StatusSource {
    settings: Arc<Settings>,
    owner: String,
    metrics: Arc<Metrics>,
    heartbeat: Arc<Heartbeat>,
    pool: Db,
    reads: Arc<flight::Flight<Result<Status, StatusError>>>,
    /// A search for the next qualifying host runs.
    searching: Arc<AtomicBool>,
}

impl StatusSource {
    /// The status of the replica with `settings`, claiming as `owner`. Opens no connection until a page loads.
    pub fn new(settings: &Settings, owner: &str, metrics: Arc<Metrics>, heartbeat: Arc<Heartbeat>) -> Self {
        let pool = crate::store::connect_status(
            &settings.database,
            &format!("fine-settler run {} status", settings.instance),
            DATABASE_TIMEOUT,
        );
        StatusSource {
            settings: Arc::new(settings.clone()),
            owner: owner.to_string(),
            metrics,
            heartbeat,
            pool,
            reads: Arc::new(flight::Flight::new(MAX_WAITING)),
            searching: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The status, as the read in flight (or a new one) finds it: [`StatusError`] if the database does not answer
    /// within a few seconds, or [`StatusError::Busy`] at once when [`MAX_WAITING`] page loads wait already.
    pub async fn read(&self) -> Result<Status, StatusError> {
        let source = self.clone();
        self.reads
            .join(move || async move { source.read_now().await })
            .await
            .unwrap_or_else(|missed| Err(missed.into()))
    }

    /// Reads the status from the database now.
    async fn read_now(&self) -> Result<Status, StatusError> {
        let settings = &self.settings;
        // The window by the database's clock when the last tick measured the host's skew from it (the tick
        // plans by it), so that a host clock ahead or behind shows the tick's keys.
        let skew = self
            .metrics
            .clock_skew()
            .and_then(|s| chrono::Duration::try_milliseconds((s * 1000.0) as i64))
            .unwrap_or_default();
        let since = due::window_start(settings, Utc::now() - skew);
        // The pool bounds the wait for its connection and the server each statement; this bounds the whole, in
        // case the server cannot even be reached.
        let read = async {
            // Its pool is its own: it learns for itself whether the server's TLS works (cheap once learnt).
            self.pool.learn_tls().await;
            let keys = rows::keys(&self.pool, since).await?;
            let dead = rows::oldest_dead(&self.pool, DEAD_SHOWN).await?;
            let pauses = crate::store::pauses::list(&self.pool, None).await?;
            let today = calendar::local_date(keys.now, settings.zone);
            let rules = crate::store::policies::rules_in_force(&self.pool, today).await?;
            Ok::<_, sqlx::Error>((keys, dead, pauses, rules))
        };
        let read = tokio::time::timeout(DATABASE_TIMEOUT * 2, read).await;
        if !matches!(read, Ok(Ok(_))) {
            self.search_for_a_host();
        }
        let (keys, dead, pauses, rules) = read
            .map_err(|_| StatusError::Timeout)?
            .map_err(|e| StatusError::Database(crate::redact::secrets_in(&e.to_string())))?;
        let replica = ReplicaStatus {
            shard: settings.instance.shard(),
            shards: settings.instance.shards(),
            owner: self.owner.clone(),
            schedule: Schedule::new(settings.schedule.mode.clone(), settings.zone).describe(),
            zone: settings.zone.name().to_string(),
            last_tick: unix_ms(self.heartbeat.last_tick_ms()),
            last_progress: unix_ms(self.heartbeat.last_progress_ms()),
            clock_skew_s: self.metrics.clock_skew(),
        };
        Ok(Status {
            rules,
            ..assemble(settings, keys, dead, &pauses, replica)
        })
    }

    /// After a failed read, when `database.url` lists several hosts: looks for the next qualifying one (a
    /// failover) in the background, so that a later read finds it — unless a search runs already. Each search
    /// opens a connection to a host, and a flood of failed loads must not open one each.
    fn search_for_a_host(&self) {
        if !self.pool.follows_hosts() || self.searching.swap(true, Ordering::SeqCst) {
            return;
        }
        let (pool, searching) = (self.pool.clone(), self.searching.clone());
        tokio::spawn(async move {
            if let Err(e) = pool.reconnect().await {
                tracing::debug!(error = %crate::store::StoreError::from(e), "status page: no qualifying host yet");
            }
            searching.store(false, Ordering::SeqCst);
        });
    }
}

/// Why the status could not be read (the routes answer 503 with this).
#[derive(Debug, Clone, thiserror::Error)]
pub enum StatusError {
    /// The database did not answer in time.
    #[error("status unavailable: the database did not answer within {} s", DATABASE_TIMEOUT.as_secs() * 2)]
    Timeout,
    /// A statement or the connection failed (the message has the password redacted).
    #[error("status unavailable: {0}")]
    Database(String),
    /// [`MAX_WAITING`] page loads were waiting for the database already.
    #[error("status busy: {0}; try again shortly")]
    Busy(String),
}

impl From<flight::Missed> for StatusError {
    fn from(missed: flight::Missed) -> Self {
        match missed {
            flight::Missed::Busy(_) => StatusError::Busy(missed.to_string()),
            flight::Missed::Lost => StatusError::Database(missed.to_string()),
        }
    }
}

fn unix_ms(ms: i64) -> Option<DateTime<Utc>> {
    (ms > 0).then(|| Utc.timestamp_millis_opt(ms).single()).flatten()
}

/// Everything the page shows (`/status.json`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Status {
    /// The database clock when the status was read.
    pub now: DateTime<Utc>,
    pub replica: ReplicaStatus,
    pub jobs: Vec<JobStatus>,
    pub queue: QueueStatus,
    /// The fine rules on the database's today: the version of each class in force and those to come, and the
    /// closed days of the coming month.
    pub rules: crate::store::policies::RulesInForce,
}

/// This replica: who it is, how it ticks, and how it is doing (from its metrics).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReplicaStatus {
    pub shard: i32,
    pub shards: i32,
    pub owner: String,
    /// As the start-up log line describes it.
    pub schedule: String,
    pub zone: String,
    /// When its last tick read its status (host clock); `null` before the first.
    pub last_tick: Option<DateTime<Utc>>,
    /// Its last progress (a tick, a batch, an outage retry), what `/healthz` checks.
    pub last_progress: Option<DateTime<Utc>>,
    /// Host clock minus database clock at the last tick, in seconds; `null` before the first.
    pub clock_skew_s: Option<f64>,
}

/// One job's grid.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct JobStatus {
    pub job: JobName,
    /// Whether this replica runs the job.
    pub enabled: bool,
    /// The business dates of this replica's catch-up window at `now`, oldest first (empty when disabled).
    pub window: Vec<NaiveDate>,
    /// The pauses in force for the job: `job`, `shards` and `shard` (null for the whole job), `by`, `reason`,
    /// `since` — as `runs --json` prints them.
    pub paused: Vec<serde_json::Value>,
    /// The grid's columns: every shard count and shard found in `job_runs` for the job, and every shard of this
    /// replica's own shard count (when it runs the job).
    pub shards: Vec<ShardColumn>,
    /// The shards of this replica's shard count with a due key nobody runs (a cell with `unclaimed: true`).
    pub unclaimed_shards: Vec<i32>,
    /// The grid's cells, newest business date first, then by shard count and shard. A cell of the window with no
    /// row has `status: null`.
    pub keys: Vec<KeyStatus>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct ShardColumn {
    pub shards: i32,
    pub shard: i32,
}

/// One cell: a key's row, or its absence.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KeyStatus {
    pub business_date: NaiveDate,
    pub shards: i32,
    pub shard: i32,
    /// `null`: no row yet.
    pub status: Option<RunStatus>,
    pub epoch: Option<i64>,
    pub owner: Option<String>,
    /// Seconds of lease left, by the database clock.
    pub lease_left_s: Option<f64>,
    /// Seconds since the lease ended, by the database clock (what tells a host down; not in the JSON).
    #[serde(skip)]
    pub lease_ended_s: Option<f64>,
    /// RUNNING keys only.
    pub progress: Option<Progress>,
    pub last_error: Option<String>,
    /// The business date is in this replica's catch-up window.
    pub in_window: bool,
    /// Not SUCCESS, and older than the window: nothing runs it by itself any more.
    pub abandoned: bool,
    /// A due key of another shard of this replica's shard count that nobody runs: no row, or not SUCCESS with a
    /// lease that ended more than the lease ago; not paused; of a date this replica's own shard has a row of (see
    /// [`fleet`]).
    pub unclaimed: bool,
}

/// How far a RUNNING key has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Progress {
    /// Rows the key's committed batches read / wrote.
    pub scanned: i64,
    pub updated: i64,
    /// Rows after the cursor still to do, counted with the batches' own predicate.
    pub to_do: i64,
}

/// The compensation queue, every shard's.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct QueueStatus {
    pub pending: i64,
    /// PENDING charges due for a retry now.
    pub pending_due: i64,
    pub dead: i64,
    /// The oldest DEAD charges (by accrual day), at most five.
    pub oldest_dead: Vec<DeadCharge>,
}

/// Builds the page's data from what the database said (pure: the tests call it with rows of their own).
pub fn assemble(
    settings: &Settings,
    rows: rows::StatusRows,
    dead: Vec<DeadCharge>,
    pauses: &[Pause],
    replica: ReplicaStatus,
) -> Status {
    let today = calendar::local_date(rows.now, settings.zone);
    let busy = fleet::busy_shards(settings.instance, &rows.keys);
    let jobs = [
        (
            JobName::FineSettlement,
            settings.settlement.enabled,
            due::settlement_due(today, settings.settlement.catch_up_months),
        ),
        (
            JobName::OverdueAccrual,
            settings.accrual.enabled,
            due::accrual_due(today, settings.accrual.catch_up_days),
        ),
    ]
    .into_iter()
    .map(|(job, enabled, window)| {
        let window = if enabled { window } else { Vec::new() };
        let mut status = job_status(job, enabled, window, &rows.keys, settings);
        status.paused = pauses
            .iter()
            .filter(|p| p.job_name == job.as_str())
            .map(Pause::json)
            .collect();
        fleet::mark(
            &mut status,
            settings.instance,
            due::unclaimed_grace(settings, rows.now),
            pauses,
            &busy,
        );
        status
    })
    .collect();
    Status {
        now: rows.now,
        replica,
        jobs,
        queue: QueueStatus {
            pending: rows.pending,
            pending_due: rows.pending_due,
            dead: rows.dead,
            oldest_dead: dead,
        },
        rules: Default::default(),
    }
}

fn job_status(
    job: JobName,
    enabled: bool,
    window: Vec<NaiveDate>,
    keys: &[KeyRow],
    settings: &Settings,
) -> JobStatus {
    let mine: Vec<&KeyRow> = keys.iter().filter(|k| k.job_name == job.as_str()).collect();
    let oldest = window.first().copied();
    let in_window = |date: NaiveDate| oldest.is_some_and(|o| date >= o);
    let mut columns: BTreeSet<ShardColumn> = mine
        .iter()
        .map(|k| ShardColumn {
            shards: k.shards,
            shard: k.shard,
        })
        .collect();
    if enabled {
        columns.extend(fleet::every_shard(settings.instance));
    }
    // The window's dates, and the older keys that did not succeed.
    let mut dates: BTreeSet<NaiveDate> = window.iter().copied().collect();
    dates.extend(
        mine.iter()
            .filter(|k| in_window(k.business_date) || k.status != RunStatus::Success)
            .map(|k| k.business_date),
    );
    let mut cells = Vec::new();
    for date in dates.iter().rev() {
        for column in &columns {
            let row = mine
                .iter()
                .find(|k| k.business_date == *date && k.shards == column.shards && k.shard == column.shard);
            match row {
                Some(k) => cells.push(KeyStatus {
                    business_date: *date,
                    shards: k.shards,
                    shard: k.shard,
                    status: Some(k.status),
                    epoch: Some(k.epoch),
                    owner: Some(k.owner.clone()),
                    lease_left_s: Some(k.lease_left_s),
                    lease_ended_s: Some(k.lease_ended_s),
                    progress: (k.status == RunStatus::Running).then_some(Progress {
                        scanned: k.scanned,
                        updated: k.updated,
                        to_do: k.to_do.unwrap_or(0),
                    }),
                    last_error: k.last_error.clone(),
                    in_window: in_window(*date),
                    abandoned: !in_window(*date) && k.status != RunStatus::Success,
                    unclaimed: false,
                }),
                // An older date shows only its rows; a column with no row there stays empty.
                None if in_window(*date) => cells.push(KeyStatus {
                    business_date: *date,
                    shards: column.shards,
                    shard: column.shard,
                    status: None,
                    epoch: None,
                    owner: None,
                    lease_left_s: None,
                    lease_ended_s: None,
                    progress: None,
                    last_error: None,
                    in_window: true,
                    abandoned: false,
                    unclaimed: false,
                }),
                None => {}
            }
        }
    }
    JobStatus {
        job,
        enabled,
        window,
        paused: Vec::new(),
        shards: columns.into_iter().collect(),
        unclaimed_shards: Vec::new(),
        keys: cells,
    }
}

const STYLE: &str = "
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .3em; } h2 { font-size: 1.15em; margin: 1.4em 0 .4em; }
table { border-collapse: collapse; } th, td { border: 1px solid #ccc; padding: .3em .5em; vertical-align: top; }
th { background: #f3f3f3; text-align: left; } td.key { min-width: 11em; }
.SUCCESS { background: #dcf5dc; } .RUNNING { background: #dbe9ff; } .FAILED { background: #ffdcdc; }
.absent { background: #f7f7f7; color: #888; } .abandoned { outline: 3px solid #c00; outline-offset: -3px; }
.unclaimed { outline: 3px dashed #c00; outline-offset: -3px; }
.paused { background: #fff3cd; border: 1px solid #e0c060; padding: .3em .6em; }
.status { font-weight: 600; } .small { font-size: .85em; color: #555; } .error { color: #a00; }
progress { width: 10em; } dl { display: grid; grid-template-columns: max-content auto; gap: .1em 1em; }
dt { color: #555; } dd { margin: 0; }
";

/// The page (`/status`).
pub fn render(status: &Status) -> String {
    let r = &status.replica;
    let page = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta http-equiv="refresh" content=(RELOAD_SECONDS);
                meta name="viewport" content="width=device-width, initial-scale=1";
                link rel="icon" href="data:,";
                title { "fine-settler status — shard " (r.shard) "/" (r.shards) }
                style { (maud::PreEscaped(STYLE)) }
            }
            body {
                h1 { "fine-settler" }
                p.small {
                    "As of " time id="now" datetime=(status.now.to_rfc3339()) { (short_time(status.now)) }
                    " (database clock); reloads every " (RELOAD_SECONDS) " s. "
                    a href="/status.json" { "JSON" }
                }
                section id="replica" {
                    h2 { "This replica" }
                    dl {
                        dt { "shard" } dd { (r.shard) " of " (r.shards) }
                        dt { "owner" } dd { code { (r.owner) } }
                        dt { "schedule" } dd { (r.schedule) " (zone " (r.zone) ")" }
                        dt { "last tick" } dd { (optional_time(r.last_tick)) }
                        dt { "last progress" } dd { (optional_time(r.last_progress)) }
                        dt { "clock skew" } dd {
                            @match r.clock_skew_s {
                                Some(s) => { (format!("{s:+.3} s")) " (host − database)" }
                                None => { "not measured yet" }
                            }
                        }
                    }
                }
                @for job in &status.jobs { (job_grid(job)) }
                (queue(&status.queue))
                (rules(&status.rules))
            }
        }
    };
    page.into_string()
}

fn job_grid(job: &JobStatus) -> Markup {
    let dates: Vec<NaiveDate> = {
        let mut seen = Vec::new();
        for k in &job.keys {
            if seen.last() != Some(&k.business_date) {
                seen.push(k.business_date);
            }
        }
        seen
    };
    html! {
        section.job id=(job.job.as_str()) {
            h2 { (job.job.as_str()) @if !job.enabled { " (not run by this replica)" } }
            @for p in &job.paused {
                p.paused {
                    "Paused"
                    @match (p["shards"].as_i64(), p["shard"].as_i64()) {
                        (Some(n), Some(s)) => { " (shard " (s) "/" (n) ")" }
                        _ => { " (every shard)" }
                    }
                    " by " (p["by"].as_str().unwrap_or("")) " since " (p["since"].as_str().unwrap_or(""))
                    ": " (p["reason"].as_str().unwrap_or(""))
                }
            }
            @if job.keys.is_empty() {
                p.small { "No keys to show." }
            } @else {
                table {
                    thead { tr {
                        th { "business date" }
                        @for c in &job.shards { th { "shard " (c.shard) "/" (c.shards) } }
                    } }
                    tbody {
                        @for date in &dates {
                            tr {
                                th { (date) }
                                @for c in &job.shards {
                                    @match job.keys.iter().find(|k| k.business_date == *date
                                        && k.shards == c.shards && k.shard == c.shard) {
                                        Some(k) => (cell(job.job, k)),
                                        None => td.absent {},
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn cell(job: JobName, k: &KeyStatus) -> Markup {
    let id = format!("{}-{}-{}-{}", job.as_str(), k.business_date, k.shards, k.shard);
    let class = match k.status {
        Some(s) if k.abandoned => format!("key {} abandoned", s.as_str()),
        Some(s) if k.unclaimed => format!("key {} unclaimed", s.as_str()),
        Some(s) => format!("key {}", s.as_str()),
        None if k.unclaimed => "key absent unclaimed".to_string(),
        None => "key absent".to_string(),
    };
    html! {
        td id=(id) class=(class) {
            @match k.status {
                None => {
                    span.status { "absent" }
                    @if k.unclaimed { " " span.error { "unclaimed" } }
                }
                Some(status) => {
                    span.status { (status.as_str()) }
                    @if k.abandoned { " " span.error { "abandoned" } }
                    @if k.unclaimed { " " span.error { "unclaimed" } }
                    div.small { "epoch " (k.epoch.unwrap_or(0)) }
                    @if let Some(owner) = &k.owner { div.small { code { (owner) } } }
                    @if let Some(left) = k.lease_left_s {
                        @if left > 0.0 { div.small { "lease " (format!("{left:.0}")) " s left" } }
                    }
                    @if let Some(p) = k.progress {
                        div {
                            progress value=(p.scanned) max=(p.scanned + p.to_do) {}
                            " " span.small { (p.scanned) " / " (p.scanned + p.to_do) }
                        }
                    }
                    @if let Some(e) = &k.last_error { div.small.error { (e) } }
                }
            }
        }
    }
}

/// The fine rules in force and the closed days of the coming month.
fn rules(r: &crate::store::policies::RulesInForce) -> Markup {
    let field = |v: &serde_json::Value, k: &str| v[k].to_string().trim_matches('"').to_string();
    html! {
        section id="rules" {
            h2 { "Fine rules" }
            table {
                tr { th { "class" } th { "from" } th { "rate (cents/day)" } th { "grace (days)" } th { "cap (cents)" }
                     th { "closed days" } }
                @for p in &r.policies {
                    tr {
                        td { code { (field(p, "fine_class")) } } td { (field(p, "effective_from")) }
                        td { (field(p, "daily_rate_cents")) } td { (field(p, "grace_days")) }
                        td { @if p["cap_cents"] == 0 { "none" } @else { (field(p, "cap_cents")) } }
                        td { @if p["charge_closed_days"] == true { "charged" } @else { "free" } }
                    }
                }
            }
            p.small {
                "Closed in the coming month: "
                @if r.closed_days.is_empty() { "none" }
                @else { (r.closed_days.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")) }
            }
        }
    }
}

fn queue(q: &QueueStatus) -> Markup {
    html! {
        section id="queue" {
            h2 { "Compensation queue" }
            p {
                span id="pending" { (q.pending) } " pending (" (q.pending_due) " due for a retry), "
                span id="dead" { (q.dead) } " DEAD"
            }
            @if !q.oldest_dead.is_empty() {
                table {
                    thead { tr { th { "loan" } th { "accrual day" } th { "amount (cents)" } th { "attempts" }
                                 th { "last tried" } th { "last error" } } }
                    tbody {
                        @for d in &q.oldest_dead {
                            tr {
                                td { (d.loan_id) } td { (d.accrual_date) } td { (d.amount_cents) }
                                td { (d.attempts) } td { (short_time(d.updated_at)) }
                                td.error { (d.last_error.as_deref().unwrap_or("")) }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn short_time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn optional_time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "not yet".to_string(), short_time)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        let env = crate::testing::env(&[("DATABASE_URL", "postgres://u@h/db")]);
        crate::config::load(None, &env)
            .and_then(|raw| raw.validate(&env))
            .expect("valid")
    }

    fn row(date: &str, status: RunStatus, owner: &str, error: Option<&str>) -> KeyRow {
        KeyRow {
            job_name: "fine-settlement".into(),
            business_date: date.parse().expect("date"),
            shards: 1,
            shard: 0,
            status,
            owner: owner.into(),
            epoch: 2,
            lease_left_s: 41.4,
            lease_ended_s: 0.0,
            scanned: 30,
            updated: 28,
            to_do: Some(70),
            last_error: error.map(str::to_string),
        }
    }

    fn replica(owner: &str) -> ReplicaStatus {
        ReplicaStatus {
            shard: 0,
            shards: 1,
            owner: owner.into(),
            schedule: "fixed-rate every 1m".into(),
            zone: "Asia/Shanghai".into(),
            last_tick: None,
            last_progress: None,
            clock_skew_s: Some(0.012),
        }
    }

    fn status(keys: Vec<KeyRow>) -> Status {
        status_paused(keys, Vec::new())
    }

    fn status_paused(keys: Vec<KeyRow>, pauses: Vec<Pause>) -> Status {
        let now = "2026-12-01T04:00:00Z".parse().expect("time");
        assemble(
            &settings(),
            rows::StatusRows {
                now,
                keys,
                pending: 3,
                pending_due: 1,
                dead: 1,
            },
            vec![DeadCharge {
                loan_id: 7,
                accrual_date: "2026-11-20".parse().expect("date"),
                amount_cents: 100,
                attempts: 10,
                last_error: Some("rejected: <b>no</b>".into()),
                updated_at: now,
            }],
            &pauses,
            replica("host:1:ab"),
        )
    }

    #[test]
    fn the_grid_is_the_window_and_abandoned_keys_by_shard() {
        let s = status(vec![
            row("2026-11-30", RunStatus::Running, "a", None),
            row("2026-10-31", RunStatus::Success, "a", None),
            // Older than the three month ends of the window, and not SUCCESS: shown as abandoned.
            row("2026-06-30", RunStatus::Failed, "b", Some("boom")),
            // Older and SUCCESS: not shown.
            row("2026-05-31", RunStatus::Success, "b", None),
        ]);
        let settlement = &s.jobs[0];
        assert_eq!(
            settlement.window,
            ["2026-09-30", "2026-10-31", "2026-11-30"].map(|d| d.parse::<NaiveDate>().expect("date"))
        );
        let cells: Vec<(String, Option<RunStatus>, bool)> = settlement
            .keys
            .iter()
            .map(|k| (k.business_date.to_string(), k.status, k.abandoned))
            .collect();
        assert_eq!(
            cells,
            [
                ("2026-11-30".into(), Some(RunStatus::Running), false),
                ("2026-10-31".into(), Some(RunStatus::Success), false),
                ("2026-09-30".into(), None, false),
                ("2026-06-30".into(), Some(RunStatus::Failed), true),
            ]
        );
        assert_eq!(
            settlement.keys[0].progress,
            Some(Progress {
                scanned: 30,
                updated: 28,
                to_do: 70
            })
        );
        assert_eq!(
            settlement.keys[1].progress, None,
            "only RUNNING keys show progress"
        );
        // The accrual is off by default: no window, no cells.
        assert!(!s.jobs[1].enabled && s.jobs[1].keys.is_empty());
    }

    /// Shard 0 of 3: shard 1 has a live key and keys whose lease ended long ago (a host down), shard 2 no row at
    /// all (nobody runs it).
    #[test]
    fn every_shard_of_the_count_is_a_column_and_keys_nobody_runs_are_unclaimed() {
        let env = crate::testing::env(&[
            ("DATABASE_URL", "postgres://u@h/db"),
            ("FINE_SETTLER__INSTANCE__SHARD", "0"),
            ("FINE_SETTLER__INSTANCE__SHARDS", "3"),
        ]);
        let settings = crate::config::load(None, &env)
            .and_then(|raw| raw.validate(&env))
            .expect("valid");
        // `lease`: seconds left (positive) or since it ended (negative), as the statement reads them.
        let of = |date: &str, shard: i32, status: RunStatus, lease: f64| KeyRow {
            shards: 3,
            shard,
            lease_left_s: lease.max(0.0),
            lease_ended_s: (-lease).max(0.0),
            ..row(date, status, "a", None)
        };
        let keys = vec![
            of("2026-11-30", 0, RunStatus::Success, 0.0),
            of("2026-11-30", 1, RunStatus::Running, -3600.0),
            of("2026-10-31", 0, RunStatus::Success, 0.0),
            of("2026-10-31", 1, RunStatus::Running, -3600.0),
            // This shard has no row of the month: it has not claimed it yet, so neither is anyone else's missing.
            of("2026-09-30", 1, RunStatus::Running, -3600.0),
        ];
        let now = "2026-12-01T04:00:00Z".parse().expect("time");
        let rows = rows::StatusRows {
            now,
            keys,
            pending: 0,
            pending_due: 0,
            dead: 0,
        };
        let s = assemble(&settings, rows, Vec::new(), &[], replica("a"));
        let settlement = &s.jobs[0];
        assert_eq!(
            settlement
                .shards
                .iter()
                .map(|c| (c.shards, c.shard))
                .collect::<Vec<_>>(),
            [(3, 0), (3, 1), (3, 2)]
        );
        let unclaimed: Vec<(String, i32)> = settlement
            .keys
            .iter()
            .filter(|k| k.unclaimed)
            .map(|k| (k.business_date.to_string(), k.shard))
            .collect();
        assert_eq!(
            unclaimed,
            [
                ("2026-11-30".into(), 1),
                ("2026-11-30".into(), 2),
                ("2026-10-31".into(), 1),
                ("2026-10-31".into(), 2),
            ],
            "shard 0 is this replica's own: never unclaimed"
        );
        assert_eq!(settlement.unclaimed_shards, [1, 2]);
        let page = render(&s);
        assert!(
            page.contains(r#"<td id="fine-settlement-2026-11-30-3-2" class="key absent unclaimed">"#),
            "{page}"
        );
    }

    /// The page counts as the metric does: a shard whose replica runs a key right now (a long catch-up run of an
    /// older month) is not one nobody runs, though it has not claimed the newer keys yet.
    #[test]
    fn a_shard_running_another_key_has_no_unclaimed_key() {
        let env = crate::testing::env(&[
            ("DATABASE_URL", "postgres://u@h/db"),
            ("FINE_SETTLER__INSTANCE__SHARD", "0"),
            ("FINE_SETTLER__INSTANCE__SHARDS", "2"),
        ]);
        let settings = crate::config::load(None, &env)
            .and_then(|raw| raw.validate(&env))
            .expect("valid");
        let of = |date: &str, shard: i32, status: RunStatus, lease_left_s: f64| KeyRow {
            shards: 2,
            shard,
            lease_left_s,
            lease_ended_s: 0.0,
            ..row(date, status, "a", None)
        };
        let keys = vec![
            of("2026-11-30", 0, RunStatus::Success, 0.0),
            of("2026-10-31", 0, RunStatus::Success, 0.0),
            of("2026-09-30", 0, RunStatus::Success, 0.0),
            of("2026-09-30", 1, RunStatus::Running, 30.0),
        ];
        let rows = rows::StatusRows {
            now: "2026-12-01T04:00:00Z".parse().expect("time"),
            keys,
            pending: 0,
            pending_due: 0,
            dead: 0,
        };
        let s = assemble(&settings, rows, Vec::new(), &[], replica("a"));
        assert!(
            s.jobs[0].keys.iter().all(|k| !k.unclaimed),
            "{:?}",
            s.jobs[0].unclaimed_shards
        );
    }

    #[test]
    fn every_value_is_escaped_as_text() {
        let evil = r#"<script>alert("x")</script>' onmouseover='y"#;
        let mut s = status(vec![row("2026-11-30", RunStatus::Failed, evil, Some(evil))]);
        s.replica = replica(evil);
        let page = render(&s);
        assert!(!page.contains("<script"), "{page}");
        assert!(!page.contains("<b>no</b>"), "{page}");
        assert!(
            page.contains("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;' onmouseover='y"),
            "{page}"
        );
        assert!(page.contains("rejected: &lt;b&gt;no&lt;/b&gt;"), "{page}");
    }

    #[test]
    fn the_page_shows_each_cell_s_state_and_reloads_itself() {
        let s = status(vec![row("2026-11-30", RunStatus::Running, "host:9:cd", None)]);
        let page = render(&s);
        assert!(page.starts_with("<!DOCTYPE html>"), "{page}");
        assert!(
            page.contains(r#"<meta http-equiv="refresh" content="5">"#),
            "{page}"
        );
        assert!(
            page.contains(r#"<td id="fine-settlement-2026-11-30-1-0" class="key RUNNING">"#),
            "{page}"
        );
        assert!(page.contains(r#"<progress value="30" max="100">"#), "{page}");
        assert!(page.contains("lease 41 s left"), "{page}");
        assert!(page.contains(r#"<td id="fine-settlement-2026-10-31-1-0" class="key absent">"#));
        assert!(page.contains("+0.012 s"), "{page}");
        assert!(page.contains(r#"<span id="dead">1</span> DEAD"#), "{page}");
        assert!(!page.contains("<script"), "no script: {page}");
    }

    #[test]
    fn a_pause_is_shown_above_its_job_s_grid_as_text() {
        use crate::{shard::ShardSpec, store::pauses::PauseScope};
        let since = "2026-11-30T15:00:00Z".parse().expect("time");
        let pauses = vec![
            Pause {
                job_name: "fine-settlement".into(),
                scope: PauseScope::Job,
                by: "ops@host".into(),
                reason: "month-end <freeze>".into(),
                since,
            },
            Pause {
                job_name: "overdue-accrual".into(),
                scope: PauseScope::Shard(ShardSpec::new(1, 3).expect("shard")),
                by: "ops@host".into(),
                reason: "disk".into(),
                since,
            },
        ];
        let s = status_paused(vec![row("2026-11-30", RunStatus::Failed, "a", None)], pauses);
        let settlement = &s.jobs[0];
        assert_eq!(settlement.paused.len(), 1);
        assert_eq!(settlement.paused[0]["by"], "ops@host");
        assert_eq!(settlement.paused[0]["shards"], serde_json::Value::Null);
        assert_eq!(s.jobs[1].paused[0]["shard"], 1);
        let page = render(&s);
        assert!(
            page.contains(
                "Paused (every shard) by ops@host since 2026-11-30T15:00:00Z: month-end &lt;freeze&gt;"
            ),
            "{page}"
        );
        assert!(page.contains("Paused (shard 1/3) by ops@host"), "{page}");
    }
}
