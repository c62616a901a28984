//! Keeping runs kind to libraryd's traffic (`[throttle]`): a rows-per-second pace — fixed, or adapted to keep
//! libraryd's commit latency under a budget ([`latency`]) — a wait while a standby lags, and batches shrunk to a
//! target duration. The runner asks before every batch ([`Throttle::admit`],
//! [`Throttle::lagging`]) and sizes every batch with a [`BatchSizer`]; how a run waits without breaking the
//! lease rules is the runner's part.
//!
//! **When a standby lags.** `replay_lag` cannot be the rule. PostgreSQL measures it only when a standby reports
//! a replay position that moved, and a quiet standby reports only every `wal_receiver_status_interval` (10 s by
//! default): a standby whose replay is stuck may keep showing its last, small value while megabytes wait, and one
//! that caught up long ago keeps its last, large value (or shows the time its report took, not its replay) until
//! it has reported itself fully replayed twice. The rule uses what a report does say for certain: at its
//! `reply_time`, the standby had replayed up to its `replay_lsn`. Before every batch the throttle notes the
//! primary's WAL position and clock (a [`WalHistory`]); a standby lags by at least the time from the first
//! noted position beyond its replay position to its report's `reply_time` — WAL that existed then was still not
//! replayed at the report. It lags when that exceeds the limit. A stale report can only under-state the lag,
//! never invent one; a stuck standby's lag grows with each of its reports (every WAL arrival, or every status
//! interval); once it catches up, its next report releases the batches. The lag is the standby's clock against
//! the primary's: keep them synchronised (NTP); a skew adds to or takes from it.
//!
//! **Before the evidence is in.** The rule dates unreplayed WAL only from positions this process noted. A
//! standby that had not replayed even the oldest of them (a process that just started, a run's first batch, a
//! standby paused before the run) may lag by far more than the rule can show yet: its lag is *unknown*, and
//! batches wait as they do for a lagging standby, until its reports settle it — it replays past a noted
//! position (its lag is dated, and judged by the rule), or it reports later than the limit after the oldest
//! noted position without having replayed it (it lags). A quiet standby reports every `wal_receiver_status_interval`
//! (10 s by default), so the first batch of a run may wait that long for the report that clears it; one that
//! sends no report settling its lag within [`unknown_wait`] of the oldest kept position (a longer interval, or
//! none) is warned about once and judged by the rule alone while it stays so. Writes outside the batches — a
//! compensation pass — ask the same verdict ([`Throttle::settled_verdict`]).
//!
//! **On Citus** (`database.engine = "citus"`) a batch's writes land on the workers, each a primary with its own
//! WAL and standbys, which the coordinator's `pg_stat_replication` does not show. So every look is also taken on
//! each worker, through the coordinator ([`crate::store::citus::replication`]), and each node's standbys are
//! judged by the rule against that node's own noted positions (a [`WalHistory`] per node); the verdict is the
//! worst of them — a standby of any node that lags holds the batches, and the log names it with its worker.
//! `throttle.standbys` names standbys of any node.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use chrono::{DateTime, Utc};
use tokio::{sync::OnceCell, time::Instant};
use tokio_util::sync::CancellationToken;

use crate::{
    config::{Engine, ThrottleSettings},
    store::{
        citus,
        replication::{self, Replication},
        Db,
    },
};

pub mod latency;

pub use latency::{Governor, LatencyPace, Probed};

/// The most work a paced batch holds, in time at the rate: a batch works at full speed, so what libraryd's
/// transactions meet while it runs — its row locks, the WAL its commit must flush before theirs — grows with
/// its size; the pace keeps the average, the slice keeps each burst short.
pub const PACE_SLICE: Duration = Duration::from_millis(50);

/// Why a batch waits; the `reason` label of `fine_settler_throttled_seconds_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// `throttle.max_rows_per_second`.
    Rate,
    /// `throttle.max_replica_lag`.
    ReplicaLag,
    /// The pace `throttle.max_commit_latency` adapts.
    CommitLatency,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Rate => "rate",
            Reason::ReplicaLag => "replica_lag",
            Reason::CommitLatency => "commit_latency",
        }
    }
}

/// A standby found lagging more than the limit.
#[derive(Debug, Clone, PartialEq)]
pub struct Lagging {
    pub standby: String,
    /// How long WAL had waited for it, as of its last report.
    pub behind: Duration,
    /// WAL bytes the primary has that it had not replayed at its last report.
    pub unreplayed_bytes: i64,
    /// Its `replay_lag`, for the log.
    pub replay_lag: Option<Duration>,
}

impl fmt::Display for Lagging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: WAL written {} before its last report was not replayed by it, {} bytes not replayed",
            self.standby,
            humantime::format_duration(whole_millis(self.behind)),
            self.unreplayed_bytes
        )
    }
}

/// A standby whose lag is not known yet: it had not replayed the oldest position this process noted when it last
/// reported (see the module's rule).
#[derive(Debug, Clone, PartialEq)]
pub struct Unknown {
    pub standby: String,
    /// WAL bytes the primary has that it had not replayed at its last report.
    pub unreplayed_bytes: i64,
    /// How long batches may wait for its reports to settle its lag ([`unknown_wait`]).
    pub at_most: Duration,
}

impl fmt::Display for Unknown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: had not replayed WAL older than the oldest position this process keeps ({} bytes not \
             replayed); waiting for a report that shows its lag, at most {} from that position",
            self.standby,
            self.unreplayed_bytes,
            humantime::format_duration(whole_millis(self.at_most))
        )
    }
}

/// What one look says of the standbys.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// No standby is known or suspected to lag more than the limit: a batch may start.
    Clear,
    /// A standby lags more than the limit.
    Lagging(Lagging),
    /// A standby's lag is not known yet (and none is known to lag).
    Unknown(Unknown),
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Clear => write!(f, "no standby lags more than throttle.max_replica_lag"),
            Verdict::Lagging(l) => write!(f, "a standby lags more than throttle.max_replica_lag ({l})"),
            Verdict::Unknown(u) => write!(f, "a standby's lag is not known yet ({u})"),
        }
    }
}

impl Verdict {
    /// Whether a batch must wait.
    pub fn holds(&self) -> bool {
        !matches!(self, Verdict::Clear)
    }
}

impl Verdict {
    /// The worse of two nodes' verdicts: a lag over an unknown lag over clear; of two lags, the longer (of two
    /// unknowns, the first).
    pub fn worst(self, other: Verdict) -> Verdict {
        match (self, other) {
            (Verdict::Lagging(a), Verdict::Lagging(b)) => {
                Verdict::Lagging(if b.behind > a.behind { b } else { a })
            }
            (Verdict::Lagging(a), _) | (_, Verdict::Lagging(a)) => Verdict::Lagging(a),
            (Verdict::Unknown(a), _) | (_, Verdict::Unknown(a)) => Verdict::Unknown(a),
            (Verdict::Clear, Verdict::Clear) => Verdict::Clear,
        }
    }
}

/// A primary whose standbys the lag limit watches, each with WAL positions of its own.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Node {
    /// The server this process is connected to (PostgreSQL's primary, a Citus coordinator).
    Connected,
    /// A Citus worker, by `host:port` in the coordinator's `pg_dist_node`.
    Worker(String),
}

/// What the throttle keeps of the primaries it watches.
#[derive(Debug, Default)]
struct Watched {
    /// Each primary's noted positions.
    histories: HashMap<Node, WalHistory>,
    /// Workers whose look failed, warned about once until a look succeeds again.
    unreadable: HashSet<String>,
}

/// How often a wait for the standbys looks again.
pub const LAG_POLL: Duration = Duration::from_millis(250);

/// PostgreSQL's default `wal_receiver_status_interval`: how often a quiet standby reports.
pub const DEFAULT_STATUS_INTERVAL: Duration = Duration::from_secs(10);

/// How long batches wait for a standby of unknown lag: the limit and two default status intervals — by then a
/// standby reporting at the default has either replayed past a noted position or reported later than the limit
/// after it. One that has not is judged by the rule alone from then on (a warning says so once).
pub fn unknown_wait(limit: Duration) -> Duration {
    limit + DEFAULT_STATUS_INTERVAL * 2
}

fn whole_millis(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis().min(u128::from(u64::MAX)) as u64)
}

/// One noted WAL position of the primary, by its clock: WAL up to `lsn` existed at `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalSample {
    pub at: DateTime<Utc>,
    pub lsn: i64,
}

/// The primary's WAL positions as this process noted them, oldest first, each position at the first time it was
/// seen, for a while: a standby's lag is judged against them.
#[derive(Debug, Default, Clone)]
pub struct WalHistory {
    samples: VecDeque<WalSample>,
    /// The server the samples are from (address, port and timeline): another one's positions say nothing of
    /// this one's standbys.
    server: String,
    /// Standbys (by name) whose lag is still unknown after [`unknown_wait`] from the oldest noted position:
    /// warned about once, judged by the rule alone while they stay so.
    gave_up: HashSet<String>,
    /// Standbys (by identity) that lagged more than the limit at their last report, with what they had replayed
    /// then: one that leaves the view (its connection dropped) is taken to lag still, until it is back.
    lagged: HashMap<String, Departed>,
}

/// What is known of a standby that lagged at its last report, should it leave the view.
#[derive(Debug, Clone)]
struct Departed {
    /// Its name, as the log had it.
    name: String,
    /// The position it had replayed by then.
    replayed: i64,
    /// When WAL it had not replayed was first noted (it has waited since; kept here, as the noted positions are
    /// forgotten past their horizon).
    since: DateTime<Utc>,
    /// Whether its leaving was warned about.
    warned: bool,
}

impl Watched {
    /// Judges each Citus worker's look against its own positions and returns the worst of `verdict` and theirs.
    /// A worker whose look fails (it is down, the statement failed there) is left out of this verdict — a batch
    /// that writes on a worker that is down fails anyway — and warned about once; the positions of a worker no
    /// longer in the cluster's metadata are forgotten.
    fn judge_workers(
        &mut self,
        workers: Vec<citus::replication::WorkerLook>,
        limit: Duration,
        verdict: Verdict,
    ) -> Verdict {
        let listed: HashSet<Node> = workers.iter().map(|w| Node::Worker(w.node.clone())).collect();
        self.histories
            .retain(|node, _| *node == Node::Connected || listed.contains(node));
        let mut verdict = verdict;
        for worker in workers {
            match worker.look {
                Ok(look) => {
                    if self.unreadable.remove(&worker.node) {
                        tracing::info!(worker = %worker.node, "the worker's standbys can be read again");
                    }
                    let history = self.histories.entry(Node::Worker(worker.node)).or_default();
                    verdict = verdict.worst(judge(history, &look, limit));
                }
                Err(error) => {
                    if self.unreadable.insert(worker.node.clone()) {
                        tracing::warn!(worker = %worker.node, error = %error,
                            "cannot read the standbys of this Citus worker; batches go on without the replica lag \
                             limit for its standbys until it answers again");
                    }
                }
            }
        }
        verdict
    }
}

impl WalHistory {
    /// At most this many samples (looked at four times a second while held): the oldest, the best evidence, is
    /// always kept, and those after it go first.
    const MAX: usize = 4096;

    /// How long positions are kept, for a limit of `limit`: twice the limit, at least a minute. A standby stuck
    /// for longer is still judged behind by the oldest kept position, so still more than the limit.
    pub fn horizon(limit: Duration) -> Duration {
        (limit * 2).max(Duration::from_secs(60))
    }

    /// Notes that WAL up to `sample.lsn` existed at `sample.at` on `server`, and forgets positions older than
    /// `horizon` (but the newest). Another server (a failover, a pooler now pointing elsewhere), or a position
    /// lower than one already noted, forgets everything noted before; a sample older than the newest one (two
    /// runs of the process looking at once) is left out.
    pub fn note(&mut self, server: &str, sample: WalSample, horizon: Duration) {
        if self.server != server
            || self
                .samples
                .back()
                .is_some_and(|last| sample.lsn < last.lsn && sample.at >= last.at)
        {
            self.samples.clear();
            self.gave_up.clear();
            self.lagged.clear();
            self.server = server.to_string();
        }
        if self
            .samples
            .back()
            .is_some_and(|last| sample.lsn <= last.lsn || sample.at < last.at)
        {
            return;
        }
        self.samples.push_back(sample);
        if self.samples.len() > Self::MAX {
            self.samples.remove(1);
        }
        let horizon = chrono::Duration::from_std(horizon).unwrap_or(chrono::Duration::MAX);
        while self.samples.len() > 1 && self.samples.front().is_some_and(|s| sample.at - s.at > horizon) {
            self.samples.pop_front();
        }
    }

    /// How long WAL had been waiting for a standby that, at `reply_time`, had replayed up to `replay_lsn`: from
    /// the first noted position beyond it, if that was noted by then.
    pub fn behind(&self, replay_lsn: i64, reply_time: DateTime<Utc>) -> Duration {
        self.samples
            .iter()
            .find(|s| s.lsn > replay_lsn)
            .filter(|s| s.at <= reply_time)
            .and_then(|s| (reply_time - s.at).to_std().ok())
            .unwrap_or_default()
    }

    /// Whether what a standby that had replayed up to `replay_lsn` had not replayed is dated by the noted
    /// positions: it had replayed a noted position (or every one), so all it had not was written after that one.
    pub fn dated(&self, replay_lsn: i64) -> bool {
        self.samples.front().is_none_or(|oldest| oldest.lsn <= replay_lsn)
    }

    /// When the first noted position beyond `replay_lsn` was noted, if any.
    fn first_beyond(&self, replay_lsn: i64) -> Option<DateTime<Utc>> {
        self.samples.iter().find(|s| s.lsn > replay_lsn).map(|s| s.at)
    }

    /// When the oldest kept position was noted.
    fn oldest_at(&self) -> Option<DateTime<Utc>> {
        self.samples.front().map(|s| s.at)
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// Judges one look at the primary against `limit`, after noting its position in `history`: the first standby
/// that lags more than the limit, else the first whose lag is not known yet, else clear. A standby stays unknown
/// until a report settles it, or until [`unknown_wait`] has passed since the oldest noted position without one —
/// a report later than the limit after that position would have proved a lag — and is then judged by the rule.
pub fn judge(history: &mut WalHistory, look: &Replication, limit: Duration) -> Verdict {
    let (Some(lsn), Some(server)) = (look.lsn, look.server.as_deref()) else {
        return Verdict::Clear;
    };
    history.note(server, WalSample { at: look.at, lsn }, WalHistory::horizon(limit));
    let at_most = unknown_wait(limit);
    let waited = history
        .oldest_at()
        .and_then(|oldest| (look.at - oldest).to_std().ok())
        .unwrap_or_default();
    let mut lagging = None;
    let mut unknown = None;
    let mut undated = HashSet::new();
    let mut lag_now = HashMap::new();
    for s in &look.standbys {
        let (Some(replay), Some(reply_time)) = (s.replay_lsn, s.reply_time) else {
            continue;
        };
        let unreplayed_bytes = lsn.saturating_sub(replay).max(0);
        let behind = history.behind(replay, reply_time);
        if behind > limit {
            if s.replays {
                lag_now.insert(s.identity.as_str(), replay);
            }
            lagging.get_or_insert_with(|| Lagging {
                standby: s.name.clone(),
                behind,
                unreplayed_bytes,
                replay_lag: s
                    .replay_lag_seconds
                    .filter(|l| l.is_finite() && *l >= 0.0)
                    .map(Duration::from_secs_f64),
            });
        } else if !history.dated(replay) {
            undated.insert(s.name.clone());
            if history.gave_up.contains(&s.name) {
                continue;
            }
            if waited <= at_most {
                unknown.get_or_insert_with(|| Unknown {
                    standby: s.name.clone(),
                    unreplayed_bytes,
                    at_most,
                });
            } else {
                tracing::warn!(standby = %s.name, unreplayed_bytes, waited_ms = waited.as_millis() as u64,
                    "no report from this standby settled its lag within {} (is its wal_receiver_status_interval \
                     longer than 10 s, or 0?); batches go on, judging it by its reports alone while it stays so",
                    humantime::format_duration(whole_millis(at_most)));
                history.gave_up.insert(s.name.clone());
            }
        }
    }
    history.gave_up.retain(|name| undated.contains(name));
    if let Some(departed) = departed_lagging(history, look, lsn, limit, &lag_now) {
        lagging.get_or_insert(departed);
    }
    match (lagging, unknown) {
        (Some(lagging), _) => Verdict::Lagging(lagging),
        (None, Some(unknown)) => Verdict::Unknown(unknown),
        (None, None) => Verdict::Clear,
    }
}

/// Keeps `history`'s record of the standbys that lag at this look (`lag_now`: identity and replay position of
/// each that replays), and judges those that lagged at an earlier
/// look and have left the view (a network blip, a primary restart, `wal_sender_timeout`: a standby whose replay
/// is paused or behind does not reconnect until its replay needs more WAL). Nothing says it replayed anything
/// since, so it is judged by its last report, as of now: it lags until it reconnects and its reports say
/// otherwise (a healthy standby reconnects as soon as its replay needs WAL it does not have), a failover, or the
/// process ends. Warned about once when it leaves. Returns the most behind of them.
fn departed_lagging(
    history: &mut WalHistory,
    look: &Replication,
    lsn: i64,
    limit: Duration,
    lag_now: &HashMap<&str, i64>,
) -> Option<Lagging> {
    // A standby counts as back once it has reported: a new walsender shows no position until its first reply.
    let back: HashSet<&str> = look
        .standbys
        .iter()
        .filter(|s| s.replay_lsn.is_some() && s.reply_time.is_some())
        .map(|s| s.identity.as_str())
        .collect();
    let mut kept = HashMap::new();
    let mut worst: Option<Lagging> = None;
    for (identity, mut d) in std::mem::take(&mut history.lagged) {
        if back.contains(identity.as_str()) {
            if d.warned {
                tracing::info!(standby = %identity, "the standby that left while it lagged is back; judged by its reports again");
            }
            kept.insert(identity, Departed { warned: false, ..d });
            continue;
        }
        let behind = (look.at - d.since).to_std().unwrap_or_default();
        let unreplayed_bytes = lsn.saturating_sub(d.replayed).max(0);
        if !d.warned {
            tracing::warn!(standby = %d.name, unreplayed_bytes,
                "a standby that lagged more than throttle.max_replica_lag left pg_stat_replication (its connection \
                 dropped): batches wait until it reconnects and replays; restart this process to stop waiting for \
                 a standby gone for good, or leave it out of throttle.standbys");
            d.warned = true;
        }
        if behind > limit && worst.as_ref().is_none_or(|w| behind > w.behind) {
            worst = Some(Lagging {
                standby: format!("{} (disconnected while it lagged)", d.name),
                behind,
                unreplayed_bytes,
                replay_lag: None,
            });
        }
        kept.insert(identity, d);
    }
    for s in look
        .standbys
        .iter()
        .filter(|s| back.contains(s.identity.as_str()))
    {
        let lags = lag_now.get(s.identity.as_str());
        let Some((&replayed, since)) = lags.and_then(|r| Some((r, history.first_beyond(*r)?))) else {
            kept.remove(&s.identity);
            continue;
        };
        let since = kept
            .get(&s.identity)
            .map_or(since, |d: &Departed| d.since.min(since));
        kept.insert(
            s.identity.clone(),
            Departed {
                name: s.name.clone(),
                replayed,
                since,
                warned: false,
            },
        );
    }
    history.lagged = kept;
    worst
}

/// The throttle of one process, shared by all its runs (the daemon's, a backfill's concurrent keys): the pace and
/// the noted WAL positions carry from one run to the next, so the rate is per process — each replica has its own.
#[derive(Debug)]
pub struct Throttle {
    settings: ThrottleSettings,
    /// The earliest time the next batch may start under `max_rows_per_second`.
    next_batch_at: Mutex<Option<Instant>>,
    /// Whether this role may read the standbys' positions (asked once; `false` warned about once).
    readable: OnceCell<bool>,
    /// Held across a look, so that the looks of concurrent runs are noted in the order they were taken.
    watched: tokio::sync::Mutex<Watched>,
    /// The pace under `throttle.max_commit_latency`, when set.
    latency: Option<Arc<LatencyPace>>,
}

impl Throttle {
    pub fn new(settings: ThrottleSettings) -> Arc<Self> {
        Arc::new(Throttle {
            next_batch_at: Mutex::new(None),
            readable: OnceCell::new(),
            watched: tokio::sync::Mutex::new(Watched::default()),
            latency: settings
                .max_commit_latency
                .map(|budget| LatencyPace::new(budget, settings.max_rows_per_second)),
            settings,
        })
    }

    /// A throttle that never waits.
    pub fn off() -> Arc<Self> {
        Throttle::new(ThrottleSettings::default())
    }

    pub fn settings(&self) -> &ThrottleSettings {
        &self.settings
    }

    /// The pace, in rows per second: the governor's rate under `throttle.max_commit_latency`, else
    /// `throttle.max_rows_per_second` (`None`: no pace).
    pub fn rate(&self) -> Option<f64> {
        match &self.latency {
            Some(pace) => pace.rate(),
            None => self.settings.max_rows_per_second.map(f64::from),
        }
    }

    /// Why a batch waits for the pace: the adapted rate or the fixed one.
    pub fn pace_reason(&self) -> Reason {
        match self.latency {
            Some(_) => Reason::CommitLatency,
            None => Reason::Rate,
        }
    }

    /// The largest batch the pace allows: [`PACE_SLICE`]'s rows, so that a paced run works in short bursts
    /// spread evenly over each second rather than one long one (`limit` when there is no pace).
    pub fn cap_batch(&self, limit: u32) -> u32 {
        match self.rate() {
            Some(rate) => {
                let slice = (rate * PACE_SLICE.as_secs_f64()).max(1.0);
                limit.min(slice as u32)
            }
            None => limit,
        }
    }

    fn cost(rate: f64, rows: i64) -> Duration {
        Duration::from_secs_f64(rows.max(0) as f64 / rate)
    }

    /// Admits a batch of up to `rows` rows under the pace: `None` if it may start now — its rows are then
    /// reserved, so that concurrent runs of the process do not all start at once — or how long to wait first.
    pub fn admit(&self, rows: u32) -> Option<Duration> {
        let rate = self.rate()?;
        let mut next = self.next_batch_at.lock().ok()?;
        let now = Instant::now();
        match *next {
            Some(at) if at > now => Some(at - now),
            _ => {
                *next = Some(now + Self::cost(rate, i64::from(rows)));
                None
            }
        }
    }

    /// Settles an admitted batch of `reserved` rows that worked `done` (0 if it did not commit) in `took`: the
    /// pace is given back what the batch did not use. The next batch may then start `done / rate` seconds after
    /// this one was admitted, so a run's average stays under the rate. The governor learns how fast batches go.
    pub fn settle(&self, reserved: u32, done: i64, took: Duration) {
        if let Some(pace) = &self.latency {
            pace.worked(done, took);
        }
        let Some(rate) = self.rate() else {
            return;
        };
        let unused = Self::cost(rate, i64::from(reserved) - done.clamp(0, i64::from(reserved)));
        if let Ok(mut next) = self.next_batch_at.lock() {
            if let Some(at) = next.as_mut() {
                *at = at.checked_sub(unused).unwrap_or(*at);
            }
        }
    }

    /// Under `throttle.max_commit_latency`: starts a probe in the background when one is due and none is running,
    /// and returns what the last finished probe did to the rate, once (see [`LatencyPace::probe`]).
    pub fn probe(&self, pool: &Db) -> Option<Probed> {
        self.latency.as_ref()?.probe(pool)
    }

    /// Asks once whether this role may read the standbys' positions; if it may not, says so once (a warning)
    /// and the lag limit is off from then on. Nothing to ask when the limit is off.
    pub async fn prepare(&self, pool: &Db) -> Result<bool, sqlx::Error> {
        let Some(limit) = self.settings.max_replica_lag else {
            return Ok(false);
        };
        self.readable
            .get_or_try_init(|| async {
                let readable = replication::can_read_positions(pool).await?;
                if readable && !self.settings.standbys.is_empty() {
                    let mut streaming = replication::look(pool, &self.settings.standbys).await?.standbys;
                    if pool.engine() == Engine::Citus {
                        for worker in citus::replication::look_workers(pool, &self.settings.standbys).await? {
                            streaming.extend(worker.look.map(|l| l.standbys).unwrap_or_default());
                        }
                    }
                    let missing: Vec<&str> = self
                        .settings
                        .standbys
                        .iter()
                        .filter(|n| !streaming.iter().any(|s| &s.application_name == *n))
                        .map(String::as_str)
                        .collect();
                    if !missing.is_empty() {
                        tracing::warn!(missing = ?missing,
                            "throttle.standbys names standbys that do not stream from this server now; the lag \
                             limit watches them once they do");
                    }
                }
                if !readable {
                    tracing::warn!(
                        max_replica_lag = %humantime::format_duration(limit),
                        "throttle.max_replica_lag is set but this role may not read standbys' positions in \
                         pg_stat_replication (grant it pg_read_all_stats, part of pg_monitor); running without \
                         the replica lag limit"
                    );
                }
                Ok(readable)
            })
            .await
            .copied()
    }

    /// Whether a standby lags more than `throttle.max_replica_lag`, or may (see the module's rules); clear when
    /// the limit is off or cannot be read.
    pub async fn lagging(&self, pool: &Db) -> Result<Verdict, sqlx::Error> {
        let Some(limit) = self.settings.max_replica_lag else {
            return Ok(Verdict::Clear);
        };
        if !self.prepare(pool).await? {
            return Ok(Verdict::Clear);
        }
        let look = replication::look(pool, &self.settings.standbys).await?;
        // On Citus the workers' standbys too; a failure to ask them leaves the coordinator's verdict standing.
        let workers = match pool.engine() {
            Engine::Citus => match citus::replication::look_workers(pool, &self.settings.standbys).await {
                Ok(workers) => Some(workers),
                Err(e) => {
                    tracing::debug!(error = %e, "cannot ask the Citus workers for their standbys; judging the coordinator's alone");
                    None
                }
            },
            Engine::Postgresql => None,
        };
        let mut watched = self.watched.lock().await;
        let verdict = judge(
            watched.histories.entry(Node::Connected).or_default(),
            &look,
            limit,
        );
        Ok(match workers {
            Some(workers) => watched.judge_workers(workers, limit, verdict),
            None => verdict,
        })
    }

    /// The verdict for writes outside the batches (a compensation pass), once settled: looks again every
    /// [`LAG_POLL`] while a standby's lag is unknown — and, with `while_lagging`, while one lags — and returns
    /// the verdict that ended the wait: `Clear` when the pass may go on. `first_wait` is told the first verdict
    /// that made it wait; a shutdown ends the wait with the last verdict. A look that fails is `Clear`: the
    /// check is advisory, as before a batch.
    pub async fn settled_verdict(
        &self,
        pool: &Db,
        cancel: &CancellationToken,
        while_lagging: bool,
        first_wait: impl FnOnce(&Verdict),
    ) -> Verdict {
        let mut first_wait = Some(first_wait);
        loop {
            let verdict = match self.lagging(pool).await {
                Ok(verdict) => verdict,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot read pg_stat_replication; writing without the lag limit");
                    return Verdict::Clear;
                }
            };
            let waits = match &verdict {
                Verdict::Clear => false,
                Verdict::Unknown(_) => true,
                Verdict::Lagging(_) => while_lagging,
            };
            if !waits {
                return verdict;
            }
            if let Some(told) = first_wait.take() {
                told(&verdict);
            }
            tokio::select! {
                _ = cancel.cancelled() => return verdict,
                _ = tokio::time::sleep(LAG_POLL) => {}
            }
        }
    }

    /// Waits before a one-shot command's compensation pass while a standby lags more than the limit or its lag
    /// is not known yet, as a batch would (said once, at its start and its end), or until `cancel` fires.
    pub async fn before_compensation(&self, pool: &Db, cancel: &CancellationToken) {
        let waited = Instant::now();
        let mut said = false;
        self.settled_verdict(pool, cancel, true, |verdict| {
            tracing::info!(
                reason = Reason::ReplicaLag.as_str(),
                "compensation pass waits: {verdict}"
            );
            said = true;
        })
        .await;
        if said {
            tracing::info!(
                reason = Reason::ReplicaLag.as_str(),
                waited_ms = waited.elapsed().as_millis() as u64,
                "compensation pass resumes"
            );
        }
    }

    /// Notes the primary's WAL position before a run writes anything (its claim), when the lag limit is on: a
    /// standby that had replayed it when it last reported is dated by it, so a quiet, caught-up standby does not
    /// hold the run's first batch until its next status report. Advisory: a failure is only logged.
    pub async fn note_position(&self, pool: &Db) {
        if let Err(e) = self.lagging(pool).await {
            tracing::debug!(error = %e, "could not note the WAL position before the run");
        }
    }
}

/// Sizes the batches of one run to `throttle.batch_duration`: `batch_size` is the most; a batch whose
/// transaction took longer than the target makes the next one smaller in proportion, and batches well inside it
/// let the size grow back, at most doubling per batch.
#[derive(Debug, Clone, Copy)]
pub struct BatchSizer {
    max: u32,
    current: u32,
    target: Option<Duration>,
}

impl BatchSizer {
    pub fn new(max: u32, target: Option<Duration>) -> Self {
        let max = max.max(1);
        BatchSizer {
            max,
            current: max,
            target,
        }
    }

    /// The size of the next batch.
    pub fn next(&self) -> u32 {
        self.current
    }

    /// Notes that a batch of `rows` held its transaction open for `took`.
    pub fn observe(&mut self, rows: i64, took: Duration) {
        let Some(target) = self.target else {
            return;
        };
        if rows <= 0 {
            return;
        }
        let took = took.max(Duration::from_micros(1));
        // The rows that would have fit the target at this batch's speed.
        let fits = (rows as f64 * target.as_secs_f64() / took.as_secs_f64()).floor();
        let fits = fits.clamp(1.0, f64::from(self.max)) as u32;
        self.current = if took > target {
            fits
        } else {
            // Within the target: never smaller; grow towards what fits, at most doubling.
            fits.min(self.current.saturating_mul(2)).max(self.current)
        }
        .clamp(1, self.max);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::store::replication::StandbyReport;

    fn t(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_800_000_000_000 + ms).expect("time")
    }

    /// The primary at `at_ms` with WAL up to `lsn`, and standbys' last reports: (replay position, sent at).
    fn look(at_ms: i64, lsn: i64, standbys: &[(i64, i64)]) -> Replication {
        Replication {
            at: t(at_ms),
            lsn: Some(lsn),
            server: Some("10.0.0.5:5432 timeline 00000001".into()),
            standbys: standbys
                .iter()
                .enumerate()
                .map(|(i, (replay, sent_ms))| StandbyReport {
                    application_name: format!("standby{i}"),
                    name: format!("standby{i} at 127.0.0.1 (pid {})", 100 + i),
                    identity: format!("standby{i} at 127.0.0.1"),
                    replays: true,
                    replay_lsn: Some(*replay),
                    reply_time: Some(t(*sent_ms)),
                    replay_lag_seconds: Some(0.078),
                })
                .collect(),
        }
    }

    /// Judges the looks in order (one server); returns how far behind each found a lagging standby, in ms.
    fn lags(looks: &[Replication], limit_ms: u64) -> Vec<Option<u64>> {
        let mut history = WalHistory::default();
        looks
            .iter()
            .map(
                |l| match judge(&mut history, l, Duration::from_millis(limit_ms)) {
                    Verdict::Lagging(lagging) => Some(lagging.behind.as_millis() as u64),
                    _ => None,
                },
            )
            .collect()
    }

    #[test]
    fn a_stuck_replay_lags_once_wal_it_has_not_replayed_is_older_than_the_limit_at_its_report() {
        // Replay stuck at 1000 while batches write; the standby reports at every WAL arrival.
        let stuck = [
            look(0, 1_000, &[(1_000, -5_000)]),
            look(300, 60_000, &[(1_000, 250)]),
            look(600, 120_000, &[(1_000, 550)]),
            look(1_200, 180_000, &[(1_000, 1_150)]),
            look(1_500, 240_000, &[(1_000, 1_450)]),
        ];
        // The first position beyond 1000 was noted at 300 ms: lag 1150 - 300 = 850 ms, then 1150 ms.
        assert_eq!(lags(&stuck, 1_000), [None, None, None, None, Some(1_150)]);
        let mut history = WalHistory::default();
        for l in &stuck[..4] {
            judge(&mut history, l, Duration::from_secs(1));
        }
        let Verdict::Lagging(lagging) = judge(&mut history, &stuck[4], Duration::from_secs(1)) else {
            panic!("lags")
        };
        assert_eq!(
            lagging.to_string(),
            "standby0 at 127.0.0.1 (pid 100): WAL written 1s 150ms before its last report was not replayed by it, \
             239000 bytes not replayed"
        );
        assert_eq!(lagging.replay_lag, Some(Duration::from_millis(78)));
    }

    #[test]
    fn a_standby_that_leaves_the_view_while_it_lags_still_lags_until_it_is_back() {
        let mut history = WalHistory::default();
        let limit = Duration::from_secs(1);
        let mut verdicts = Vec::new();
        for l in [
            look(0, 1_000, &[(1_000, 0), (1_000, 0)]),
            look(300, 60_000, &[(1_000, 250), (60_000, 250)]),
            look(1_500, 240_000, &[(1_000, 1_450), (240_000, 1_450)]),
        ] {
            verdicts.push(judge(&mut history, &l, limit));
        }
        assert!(matches!(verdicts[2], Verdict::Lagging(_)), "{verdicts:?}");
        // Its connection drops: the healthy one alone is left in the view, for as long as it stays away.
        let mut gone = look(5_000, 300_000, &[(300_000, 4_990), (300_000, 4_990)]);
        gone.standbys.remove(0);
        let Verdict::Lagging(lagging) = judge(&mut history, &gone, limit) else {
            panic!("a standby that left while it lagged holds");
        };
        assert_eq!(
            (lagging.standby.as_str(), lagging.behind),
            (
                "standby0 at 127.0.0.1 (pid 100) (disconnected while it lagged)",
                Duration::from_millis(4_700)
            )
        );
        assert!(judge(&mut history, &gone, limit).holds());
        // Long after, every position it had not replayed forgotten past the horizon: still held.
        let mut later = look(200_000, 900_000, &[(900_000, 199_990), (900_000, 199_990)]);
        later.standbys.remove(0);
        let Verdict::Lagging(lagging) = judge(&mut history, &later, limit) else {
            panic!("the hold outlives the noted positions");
        };
        assert_eq!(lagging.behind, Duration::from_millis(199_700));
        // Reconnected, not reported yet: still held.
        let mut reconnected = look(200_500, 900_000, &[(900_000, 200_490), (900_000, 200_490)]);
        reconnected.standbys[0].replay_lsn = None;
        reconnected.standbys[0].reply_time = None;
        assert!(judge(&mut history, &reconnected, limit).holds());
        // Back, and caught up: released.
        let back = look(201_000, 900_000, &[(900_000, 200_990), (900_000, 200_990)]);
        assert_eq!(judge(&mut history, &back, limit), Verdict::Clear);
        // A standby that leaves while it keeps up holds nothing.
        let mut healthy_leaves = look(201_500, 910_000, &[(910_000, 201_490), (910_000, 201_490)]);
        healthy_leaves.standbys.remove(0);
        assert_eq!(judge(&mut history, &healthy_leaves, limit), Verdict::Clear);
        // A failover forgets it.
        let mut history = WalHistory::default();
        for l in [
            look(0, 1_000, &[(1_000, 0)]),
            look(300, 60_000, &[(1_000, 250)]),
            look(1_500, 240_000, &[(1_000, 1_450)]),
        ] {
            judge(&mut history, &l, limit);
        }
        let mut elsewhere = look(2_000, 250_000, &[]);
        elsewhere.server = Some("10.0.0.6:5432 timeline 00000002".into());
        assert_eq!(judge(&mut history, &elsewhere, limit), Verdict::Clear);
    }

    #[test]
    fn old_or_caught_up_reports_never_invent_a_lag() {
        // A quiet, healthy standby: its last report, 10 s old, shows it caught up at 1000. New WAL is noted
        // after that report: nothing says the standby has not replayed it.
        let quiet = [
            look(0, 1_000, &[(1_000, -10_000)]),
            look(100, 2_000, &[(1_000, -10_000)]),
            look(5_000, 2_000, &[(1_000, -10_000)]),
        ];
        assert_eq!(lags(&quiet, 1_000), [None, None, None]);
        // A report that shows replay moving with the WAL: never far behind.
        let moving = [
            look(0, 1_000, &[(1_000, 0)]),
            look(500, 2_000, &[(1_500, 480)]),
            look(1_000, 3_000, &[(2_600, 990)]),
            look(1_500, 4_000, &[(3_900, 1_490)]),
        ];
        assert_eq!(lags(&moving, 1_000), [None; 4]);
        // Caught up after a lag: its next report releases, whatever replay_lag says.
        let caught_up = [
            look(0, 1_000, &[(1_000, 0)]),
            look(100, 5_000, &[(1_000, 90)]),
            look(3_000, 5_000, &[(1_000, 2_900)]),
            look(4_000, 5_000, &[(5_000, 3_900)]),
        ];
        assert_eq!(lags(&caught_up, 1_000), [None, None, Some(2_800), None]);
    }

    #[test]
    fn the_most_behind_standby_is_reported_and_one_that_never_reported_is_not_judged() {
        let mut two = look(2_000, 9_000, &[(9_000, 1_990), (1_000, 1_990)]);
        two.standbys.push(StandbyReport {
            application_name: "new".into(),
            name: "new".into(),
            identity: "new".into(),
            replays: false,
            replay_lsn: None,
            reply_time: None,
            replay_lag_seconds: None,
        });
        let looks = [look(0, 1_000, &[]), look(100, 2_000, &[]), two];
        assert_eq!(lags(&looks, 1_000), [None, None, Some(1_890)]);
    }

    #[test]
    fn another_server_or_a_position_going_back_forgets_the_noted_positions() {
        let limit = Duration::from_secs(1);
        let on = |server: &str, l: Replication| Replication {
            server: Some(server.into()),
            ..l
        };
        // A failover behind a pooler: the same address, another timeline, and the promoted standby already
        // past the old primary's positions. Its own standby, replaying normally, is not behind those.
        let mut history = WalHistory::default();
        judge(
            &mut history,
            &on("db timeline 1", look(0, 1_000, &[(900, 0)])),
            limit,
        );
        judge(
            &mut history,
            &on("db timeline 1", look(100, 2_000, &[(900, 90)])),
            limit,
        );
        let promoted = on("db timeline 2", look(5_000, 3_000, &[(2_500, 4_990)]));
        assert!(matches!(
            judge(&mut history, &promoted, limit),
            Verdict::Unknown(_)
        ));
        assert_eq!(history.len(), 1);
        let replayed = on("db timeline 2", look(5_100, 3_000, &[(3_000, 5_050)]));
        assert_eq!(judge(&mut history, &replayed, limit), Verdict::Clear);
        // A position lower than the last one noted, later: another server that the identity did not tell.
        let mut same = WalHistory::default();
        judge(&mut same, &look(0, 1_000, &[(900, 0)]), limit);
        judge(&mut same, &look(100, 2_000, &[(900, 90)]), limit);
        assert!(matches!(
            judge(&mut same, &look(5_000, 1_500, &[(1_200, 4_990)]), limit),
            Verdict::Unknown(_)
        ));
        assert_eq!(same.len(), 1);
    }

    #[test]
    fn two_runs_looking_at_once_keep_the_evidence_of_a_stuck_standby() {
        let limit = Duration::from_secs(5);
        let mut history = WalHistory::default();
        // Stuck at 1000 for 10 s while WAL grows.
        judge(&mut history, &look(0, 2_000, &[(1_000, -100)]), limit);
        for i in 1..=10 {
            judge(
                &mut history,
                &look(i * 1_000, 2_000 + i * 1_000, &[(1_000, i * 1_000 - 10)]),
                limit,
            );
        }
        // Run B's look (taken later) is noted before run A's: A's older sample is left out, not a failover.
        let b = look(11_000, 14_000, &[(1_000, 10_990)]);
        let a = look(10_900, 13_500, &[(1_000, 10_890)]);
        assert!(judge(&mut history, &b, limit).holds());
        assert!(
            judge(&mut history, &a, limit).holds(),
            "the stuck standby is still held"
        );
        assert!(history.len() > 5);
    }

    #[test]
    fn the_history_keeps_the_oldest_evidence_and_forgets_past_its_horizon() {
        let mut history = WalHistory::default();
        let horizon = WalHistory::horizon(Duration::from_secs(1));
        assert_eq!(horizon, Duration::from_secs(60));
        for i in 0..10_000 {
            history.note(
                "db",
                WalSample {
                    at: t(i),
                    lsn: 1_000 + i,
                },
                horizon,
            );
        }
        assert_eq!(history.len(), WalHistory::MAX);
        // The oldest position is kept: a standby stuck before it is still seen 10 s behind.
        assert_eq!(history.behind(999, t(10_000)), Duration::from_millis(10_000));
        // Past the horizon, positions are forgotten; a standby stuck for longer is still judged behind by the
        // oldest kept one: more than the limit.
        history.note(
            "db",
            WalSample {
                at: t(200_000),
                lsn: 50_000,
            },
            horizon,
        );
        assert_eq!(history.len(), 1);
        history.note(
            "db",
            WalSample {
                at: t(230_000),
                lsn: 60_000,
            },
            horizon,
        );
        assert_eq!(history.behind(999, t(250_000)), Duration::from_secs(50));
        // The same position noted again keeps its first time.
        let mut h = WalHistory::default();
        h.note("db", WalSample { at: t(0), lsn: 5 }, horizon);
        h.note("db", WalSample { at: t(900), lsn: 5 }, horizon);
        assert_eq!(h.behind(4, t(1_000)), Duration::from_millis(1_000));
        assert!(!h.is_empty());
    }

    #[test]
    fn a_standby_behind_wal_older_than_the_first_look_holds_until_its_reports_settle_its_lag() {
        let limit = Duration::from_secs(1);
        let verdicts = |looks: &[Replication]| -> Vec<&'static str> {
            let mut history = WalHistory::default();
            looks
                .iter()
                .map(|l| match judge(&mut history, l, limit) {
                    Verdict::Clear => "clear",
                    Verdict::Lagging(_) => "lagging",
                    Verdict::Unknown(_) => "unknown",
                })
                .collect()
        };
        // Replay paused before the process started, WAL waiting since long before its first look (at 0): each
        // report earlier than the limit after that look proves nothing; the first later one proves a lag.
        let paused = [
            look(0, 50_000, &[(1_000, -200)]),
            look(250, 50_000, &[(1_000, 200)]),
            look(900, 50_000, &[(1_000, 850)]),
            look(1_300, 50_000, &[(1_000, 1_250)]),
            look(9_000, 50_000, &[(50_000, 8_950)]),
        ];
        assert_eq!(
            verdicts(&paused),
            ["unknown", "unknown", "unknown", "lagging", "clear"]
        );
        // A quiet standby that reports every 10 s: it replayed the last WAL but has not said so yet. It is
        // cleared by its next report, which shows it past the first look's position.
        let quiet = [
            look(0, 5_000, &[(4_000, -3_000)]),
            look(4_000, 5_000, &[(4_000, -3_000)]),
            look(7_000, 5_000, &[(5_000, 6_990)]),
        ];
        assert_eq!(verdicts(&quiet), ["unknown", "unknown", "clear"]);
        // Caught up at the first look, or replaying a little behind a busy primary: no wait, or a short one.
        assert_eq!(verdicts(&[look(0, 5_000, &[(5_000, -9_000)])]), ["clear"]);
        let busy = [look(0, 5_000, &[(4_900, -10)]), look(250, 6_000, &[(5_500, 240)])];
        assert_eq!(verdicts(&busy), ["unknown", "clear"]);
    }

    #[test]
    fn a_standby_that_never_reports_is_waited_for_at_most_the_unknown_wait_then_judged_by_the_rule() {
        let limit = Duration::from_secs(1);
        let at_most = unknown_wait(limit).as_millis() as i64;
        assert_eq!(at_most, 21_000);
        let mut history = WalHistory::default();
        // Its last report is from before the first look, and none comes after it.
        let silent = |at: i64| look(at, 5_000 + at, &[(4_000, -1_000)]);
        for at in [0, 10_000, at_most] {
            assert!(
                matches!(judge(&mut history, &silent(at), limit), Verdict::Unknown(_)),
                "{at}"
            );
        }
        assert_eq!(judge(&mut history, &silent(at_most + 1), limit), Verdict::Clear);
        assert_eq!(judge(&mut history, &silent(at_most + 500), limit), Verdict::Clear);
        // It reports at last, stuck: the rule holds it.
        assert!(matches!(
            judge(&mut history, &look(30_000, 40_000, &[(4_000, 29_990)]), limit),
            Verdict::Lagging(_)
        ));
    }

    #[test]
    fn looks_further_apart_than_the_horizon_never_give_up_on_a_stuck_standby() {
        // A daemon between runs looks once a tick, 61 s apart: each look forgets the last (past the one-minute
        // horizon). The wait is counted from the oldest kept position, so a standby stuck at 4000 and reporting
        // every 10 s is unknown at each look, never cleared; within the tick, its next report proves the lag.
        let limit = Duration::from_secs(1);
        let mut history = WalHistory::default();
        for tick in 0..4 {
            let at = tick * 61_000;
            let verdict = judge(
                &mut history,
                &look(at, 10_000 + at, &[(4_000, at - 5_000)]),
                limit,
            );
            assert!(matches!(verdict, Verdict::Unknown(_)), "tick {tick}: {verdict:?}");
            assert_eq!(history.len(), 1);
        }
        let next_report = judge(&mut history, &look(188_500, 200_000, &[(4_000, 188_000)]), limit);
        assert!(matches!(next_report, Verdict::Lagging(_)), "{next_report:?}");
    }

    #[test]
    fn the_pace_spaces_batches_by_their_rows_and_reserves_for_concurrent_runs() {
        let throttle = Throttle::new(ThrottleSettings {
            max_rows_per_second: Some(1000),
            ..ThrottleSettings::default()
        });
        // Batches of a twentieth of a second's rows.
        assert_eq!(throttle.cap_batch(10_000), 50);
        assert_eq!(throttle.cap_batch(20), 20);
        let slow = Throttle::new(ThrottleSettings {
            max_rows_per_second: Some(3),
            ..ThrottleSettings::default()
        });
        assert_eq!(slow.cap_batch(10_000), 1);
        assert_eq!(throttle.admit(500), None);
        // A second run asking at once waits for the first's reservation.
        let wait = throttle.admit(500).expect("reserved");
        assert!(
            wait > Duration::from_millis(400) && wait <= Duration::from_millis(500),
            "{wait:?}"
        );
        // The batch worked only 100 of its 500 rows: the pace gets 400 rows' time back.
        throttle.settle(500, 100, Duration::from_millis(10));
        let wait = throttle.admit(500).expect("still waits");
        assert!(wait <= Duration::from_millis(100), "{wait:?}");
        let off = Throttle::off();
        assert_eq!(off.admit(1_000_000), None);
        assert_eq!(off.admit(1_000_000), None);
        assert_eq!(off.cap_batch(10_000), 10_000);
    }

    #[test]
    fn batches_shrink_to_the_target_and_grow_back_slowly() {
        let mut sizer = BatchSizer::new(10_000, Some(Duration::from_millis(100)));
        assert_eq!(sizer.next(), 10_000);
        sizer.observe(10_000, Duration::from_millis(400));
        assert_eq!(sizer.next(), 2_500);
        sizer.observe(2_500, Duration::from_millis(10));
        assert_eq!(sizer.next(), 5_000);
        sizer.observe(5_000, Duration::from_millis(10));
        assert_eq!(sizer.next(), 10_000);
        // A short tail batch inside the target does not shrink the size.
        sizer.observe(3, Duration::from_millis(1));
        assert_eq!(sizer.next(), 10_000);
        // Without a target nothing changes.
        let mut fixed = BatchSizer::new(10_000, None);
        fixed.observe(10_000, Duration::from_secs(10));
        assert_eq!(fixed.next(), 10_000);
    }

    proptest! {
        #[test]
        fn the_size_stays_between_one_and_the_maximum(
            max in 1u32..100_000,
            target_ms in 1u64..10_000,
            batches in prop::collection::vec((0i64..200_000, 0u64..100_000), 1..30),
        ) {
            let mut sizer = BatchSizer::new(max, Some(Duration::from_millis(target_ms)));
            for (rows, took_ms) in batches {
                let before = sizer.next();
                sizer.observe(rows, Duration::from_millis(took_ms));
                let after = sizer.next();
                prop_assert!((1..=max).contains(&after));
                if Duration::from_millis(took_ms) > Duration::from_millis(target_ms) && rows > 0 {
                    prop_assert!(after <= before.max(rows.min(i64::from(max)) as u32));
                }
            }
        }
    }
}
