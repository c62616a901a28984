//! Keeping runs kind to libraryd's traffic (`[throttle]`): a rows-per-second pace, a wait while a standby
//! lags, and batches shrunk to a target duration. The runner asks before every batch ([`Throttle::pace_wait`],
//! [`Throttle::lagging`]) and sizes every batch with a [`BatchSizer`]; how a run waits without breaking the
//! lease rules is the runner's part.
//!
//! **When a standby lags.** `replay_lag` alone cannot tell: it is measured only when the standby's replay
//! position moves, so a standby whose replay is stuck may keep showing its last, small value. A standby lags
//! when WAL is waiting for it (its replay position is behind the primary's current one) and either its
//! `replay_lag` exceeds the limit, or its own reports show it stuck: the same replay position, behind WAL it had
//! already received, in reports whose `reply_time`s span more than the limit. Reports are compared by the
//! standby's own `reply_time`, not by when this process looked, because a quiet standby reports its replay
//! position only every `wal_receiver_status_interval` (10 s by default): one old report showing replay a little
//! behind what it had just received is not a stuck standby. The price: once the primary is quiet (every batch
//! waiting), a standby that caught up is seen to have done so at its next report, up to
//! `wal_receiver_status_interval` later.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex},
    time::Duration,
};

use chrono::{DateTime, Utc};
use tokio::{sync::OnceCell, time::Instant};

use crate::{
    config::ThrottleSettings,
    store::{
        replication::{self, StandbyReport},
        Db,
    },
};

/// Why a batch waits; the `reason` label of `fine_settler_throttled_seconds_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// `throttle.max_rows_per_second`.
    Rate,
    /// `throttle.max_replica_lag`.
    ReplicaLag,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Rate => "rate",
            Reason::ReplicaLag => "replica_lag",
        }
    }
}

/// A standby found lagging more than the limit.
#[derive(Debug, Clone, PartialEq)]
pub struct Lagging {
    pub standby: String,
    pub unreplayed_bytes: i64,
    pub replay_lag: Option<Duration>,
    /// How long, by its own reports, its replay position has not moved.
    pub unmoved_for: Duration,
}

impl fmt::Display for Lagging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} bytes of WAL not replayed, replay position unmoved for {}",
            self.standby,
            self.unreplayed_bytes,
            humantime::format_duration(whole_millis(self.unmoved_for))
        )?;
        if let Some(lag) = self.replay_lag {
            write!(
                f,
                ", replay_lag {}",
                humantime::format_duration(whole_millis(lag))
            )?;
        }
        Ok(())
    }
}

fn whole_millis(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis().min(u128::from(u64::MAX)) as u64)
}

/// What the throttle remembers of one standby: its last replay position and, if it was behind what it had
/// received, the time of the first report that showed it stuck there.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    replay_lsn: String,
    stuck_since: Option<DateTime<Utc>>,
}

/// Judges one standby's report against the limit, given what was seen of it before; returns what to remember
/// and whether it lags. A report without positions (none sent yet, or hidden from this role) never lags.
pub fn judge(
    before: Option<&Seen>,
    report: &StandbyReport,
    limit: Duration,
) -> (Option<Seen>, Option<Lagging>) {
    let (Some(lsn), Some(unreplayed), Some(reply_time)) =
        (&report.replay_lsn, report.unreplayed_bytes, report.reply_time)
    else {
        return (before.cloned(), None);
    };
    // Replay had caught up with what the standby had received when it reported: not stuck, however long it
    // has been at this position.
    let behind = report.received_unreplayed_bytes.is_some_and(|b| b > 0);
    let stuck_since = match before {
        _ if !behind => None,
        Some(b) if &b.replay_lsn == lsn && b.stuck_since.is_some() => b.stuck_since,
        _ => Some(reply_time),
    };
    let seen = Seen {
        replay_lsn: lsn.clone(),
        stuck_since,
    };
    if unreplayed <= 0 {
        return (Some(seen), None);
    }
    let unmoved_for = stuck_since
        .and_then(|since| (reply_time - since).to_std().ok())
        .unwrap_or_default();
    let replay_lag = report
        .replay_lag_seconds
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64);
    let lags = unmoved_for > limit || replay_lag.is_some_and(|l| l > limit);
    let lagging = lags.then(|| Lagging {
        standby: format!("{} (pid {})", report.name, report.pid),
        unreplayed_bytes: unreplayed,
        replay_lag,
        unmoved_for,
    });
    (Some(seen), lagging)
}

/// The throttle of one process, shared by all its runs: the pace and what was seen of the standbys carry from
/// one run to the next.
#[derive(Debug)]
pub struct Throttle {
    settings: ThrottleSettings,
    /// The earliest time the next batch may start under `max_rows_per_second`.
    next_batch_at: Mutex<Option<Instant>>,
    /// Whether this role may read the standbys' positions (asked once; `false` warned about once).
    readable: OnceCell<bool>,
    standbys: Mutex<HashMap<i32, Seen>>,
}

impl Throttle {
    pub fn new(settings: ThrottleSettings) -> Arc<Self> {
        Arc::new(Throttle {
            settings,
            next_batch_at: Mutex::new(None),
            readable: OnceCell::new(),
            standbys: Mutex::new(HashMap::new()),
        })
    }

    /// A throttle that never waits.
    pub fn off() -> Arc<Self> {
        Throttle::new(ThrottleSettings::default())
    }

    pub fn settings(&self) -> ThrottleSettings {
        self.settings
    }

    /// The largest batch the pace allows: one second's rows, so that a run never works a long burst and then
    /// waits as long (`limit` when there is no pace).
    pub fn cap_batch(&self, limit: u32) -> u32 {
        match self.settings.max_rows_per_second {
            Some(rate) => limit.min(rate).max(1),
            None => limit,
        }
    }

    /// How long the next batch must wait for the pace (`None`: it may start now).
    pub fn pace_wait(&self) -> Option<Duration> {
        self.settings.max_rows_per_second?;
        let at = (*self.next_batch_at.lock().ok()?)?;
        let now = Instant::now();
        (at > now).then(|| at - now)
    }

    /// Charges `rows` worked by a committed batch to the pace: the next batch may start `rows / rate` seconds
    /// after this one could (never earlier than now), so the average over a run stays under the rate.
    pub fn charge(&self, rows: i64) {
        let Some(rate) = self.settings.max_rows_per_second else {
            return;
        };
        let cost = Duration::from_secs_f64(rows.max(0) as f64 / f64::from(rate));
        if let Ok(mut next) = self.next_batch_at.lock() {
            let now = Instant::now();
            let from = next.filter(|at| *at > now).unwrap_or(now);
            *next = Some(from + cost);
        }
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
                if !readable {
                    tracing::warn!(
                        max_replica_lag = %humantime::format_duration(limit),
                        "throttle.max_replica_lag is set but this role may not read standbys' positions in \
                         pg_stat_replication (grant it pg_read_all_stats, part of pg_monitor); running without the replica lag \
                         limit"
                    );
                }
                Ok(readable)
            })
            .await
            .copied()
    }

    /// The first standby that lags more than `throttle.max_replica_lag` (see the module's rule); `None` when none
    /// does, or the limit is off or cannot be read.
    pub async fn lagging(&self, pool: &Db) -> Result<Option<Lagging>, sqlx::Error> {
        let Some(limit) = self.settings.max_replica_lag else {
            return Ok(None);
        };
        if !self.prepare(pool).await? {
            return Ok(None);
        }
        let reports = replication::standbys(pool).await?;
        let Ok(mut seen) = self.standbys.lock() else {
            return Ok(None);
        };
        let mut remembered = HashMap::with_capacity(reports.len());
        let mut first = None;
        for report in &reports {
            let (now_seen, lagging) = judge(seen.get(&report.pid), report, limit);
            if let Some(s) = now_seen {
                remembered.insert(report.pid, s);
            }
            first = first.or(lagging);
        }
        // Standbys gone from the view are forgotten.
        *seen = remembered;
        Ok(first)
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

    /// A report of replay at `lsn`, `unreplayed` bytes behind the primary now and `behind` bytes behind what the
    /// standby had received, sent at `at_ms`.
    fn report(lsn: &str, unreplayed: i64, behind: i64, lag_ms: Option<u64>, at_ms: i64) -> StandbyReport {
        StandbyReport {
            pid: 7,
            name: "standby1 at 127.0.0.1".into(),
            replay_lsn: Some(lsn.into()),
            unreplayed_bytes: Some(unreplayed),
            received_unreplayed_bytes: Some(behind),
            replay_lag_seconds: lag_ms.map(|ms| ms as f64 / 1000.0),
            reply_time: Some(DateTime::from_timestamp_millis(1_800_000_000_000 + at_ms).expect("time")),
        }
    }

    /// Feeds the reports in order; returns whether each lagged.
    fn lags(reports: &[StandbyReport], limit: Duration) -> Vec<bool> {
        let mut seen = None;
        reports
            .iter()
            .map(|r| {
                let (s, lagging) = judge(seen.as_ref(), r, limit);
                seen = s;
                lagging.is_some()
            })
            .collect()
    }

    #[test]
    fn a_stuck_replay_lags_once_its_own_reports_span_the_limit() {
        let limit = Duration::from_secs(1);
        // Replay stuck at 0/100 while WAL piles up; replay_lag keeps its last small value.
        let stuck = [
            // Caught up for a long time at 0/100: no evidence yet.
            report("0/100", 0, 0, Some(78), -60_000),
            report("0/100", 10, 10, Some(78), 0),
            report("0/100", 5_000, 4_000, Some(78), 600),
            report("0/100", 9_000, 9_000, Some(78), 1_000),
            report("0/100", 12_900_000, 12_000_000, Some(78), 1_001),
        ];
        assert_eq!(lags(&stuck, limit), [false, false, false, false, true]);
        let lagging = judge(None, &stuck[1], limit).0;
        let (_, l) = judge(lagging.as_ref(), &stuck[4], limit);
        let text = l.expect("lags").to_string();
        assert!(
            text.contains("standby1 at 127.0.0.1 (pid 7): 12900000 bytes")
                && text.contains("unmoved for 1s 1ms"),
            "{text}"
        );
    }

    #[test]
    fn a_moving_or_caught_up_standby_does_not_lag() {
        let limit = Duration::from_secs(1);
        // Replay moves at every report.
        let moving = [
            report("0/100", 10, 10, Some(5), 0),
            report("0/200", 10, 10, Some(5), 900),
            report("0/300", 10, 10, Some(5), 1_800),
            report("0/400", 10, 10, Some(5), 2_700),
        ];
        assert_eq!(lags(&moving, limit), [false; 4]);
        // Caught up: nothing is waiting, whatever replay_lag last said and however long the position stays.
        let caught_up = [
            report("0/100", 0, 0, Some(5_000), 0),
            report("0/100", 0, 0, Some(5_000), 20_000),
        ];
        assert_eq!(lags(&caught_up, limit), [false, false]);
        // One old report, looked at again and again, is no evidence of a stuck standby.
        let quiet = [report("0/100", 40, 40, None, 0), report("0/100", 40, 40, None, 0)];
        assert_eq!(lags(&quiet, limit), [false, false]);
        // A quiet, healthy standby: its last report (10 s ago) showed it caught up at 0/100; new WAL arrives and
        // its next report shows replay a little behind what it just received. Not stuck.
        let woken = [
            report("0/100", 0, 0, None, 0),
            report("0/100", 300, 300, None, 10_000),
            report("0/100", 300, 300, None, 10_000),
        ];
        assert_eq!(lags(&woken, limit), [false, false, false]);
    }

    #[test]
    fn replay_lag_over_the_limit_lags_while_wal_waits() {
        let limit = Duration::from_secs(1);
        let slow = [
            report("0/100", 10, 10, Some(1_500), 0),
            report("0/200", 0, 0, Some(1_500), 100),
        ];
        assert_eq!(lags(&slow, limit), [true, false]);
    }

    #[test]
    fn a_report_without_positions_never_lags() {
        let hidden = StandbyReport {
            replay_lsn: None,
            unreplayed_bytes: None,
            received_unreplayed_bytes: None,
            ..report("0/100", 1, 1, Some(9_000), 0)
        };
        assert_eq!(judge(None, &hidden, Duration::from_secs(1)), (None, None));
    }

    #[test]
    fn the_pace_spaces_batches_by_their_rows() {
        let throttle = Throttle::new(ThrottleSettings {
            max_rows_per_second: Some(1000),
            ..ThrottleSettings::default()
        });
        assert_eq!(throttle.cap_batch(10_000), 1000);
        assert_eq!(throttle.cap_batch(500), 500);
        assert_eq!(throttle.pace_wait(), None);
        throttle.charge(500);
        let wait = throttle.pace_wait().expect("waits");
        assert!(
            wait > Duration::from_millis(400) && wait <= Duration::from_millis(500),
            "{wait:?}"
        );
        throttle.charge(500);
        let wait = throttle.pace_wait().expect("waits");
        assert!(
            wait > Duration::from_millis(900) && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
        let off = Throttle::off();
        off.charge(1_000_000);
        assert_eq!((off.pace_wait(), off.cap_batch(10_000)), (None, 10_000));
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
