//! When the daemon ticks: slots on UTC wall time (fixed-rate grid, fixed-delay, cron in a zone), the pure slot
//! guard ([`guard`]), and a waiter driven by tokio timers.
//!
//! Slot identity always comes from the wall clock (never the monotonic clock), read through [`WallClock`] so
//! tests can drive it with tokio's paused time. Waiting uses bounded naps that re-read the wall clock: a
//! suspended host or a clock step is noticed within one nap, and nothing ever bursts to catch up.
//!
//! A step of the wall clock is told apart from time passing by [`ClockWatch`]: between two readings the wall
//! clock should move as far as the monotonic clock did. When it moves more than [`CLOCK_STEP_TOLERANCE`] further
//! (forward: a step ahead or a suspend) or less (a step back: NTP, a VM restored from a snapshot), the wait ends
//! with [`Wake::ClockStep`] and the scheduler re-bases on the new time at once, rather than wait for a due time
//! computed on the old one.

pub mod drift;
pub mod due;
pub mod guard;
pub mod scheduler;

use std::{
    fmt,
    sync::{
        atomic::{AtomicI64, Ordering},
        Arc,
    },
    time::Duration,
};

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::ScheduleMode;

/// The wall clock the scheduler reads.
pub trait WallClock: Send + Sync + fmt::Debug {
    fn now(&self) -> DateTime<Utc>;
}

/// The host's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemWall;

impl WallClock for SystemWall {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A wall clock that advances with tokio's clock, from a fixed origin: under `tokio::time::pause()` it moves
/// only when the test advances time. [`TokioWall::step`] steps it as an operator or NTP steps a host's clock
/// (clones share the steps).
#[derive(Debug, Clone)]
pub struct TokioWall {
    origin: DateTime<Utc>,
    start: tokio::time::Instant,
    stepped_ms: Arc<AtomicI64>,
}

impl TokioWall {
    pub fn new(origin: DateTime<Utc>) -> Self {
        TokioWall {
            origin,
            start: tokio::time::Instant::now(),
            stepped_ms: Arc::default(),
        }
    }

    /// Steps the clock by `by` (negative: back), without any time passing.
    pub fn step(&self, by: chrono::Duration) {
        self.stepped_ms
            .fetch_add(by.num_milliseconds(), Ordering::Relaxed);
    }
}

impl WallClock for TokioWall {
    fn now(&self) -> DateTime<Utc> {
        let elapsed = chrono::Duration::from_std(self.start.elapsed()).unwrap_or(chrono::Duration::MAX);
        let stepped = chrono::Duration::milliseconds(self.stepped_ms.load(Ordering::Relaxed));
        self.origin
            .checked_add_signed(elapsed)
            .and_then(|t| t.checked_add_signed(stepped))
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    }
}

/// How far the wall clock may move apart from the monotonic clock between two readings before it counts as a
/// step. Both are read back to back, so only a step (or a suspend) moves them apart by this much; NTP's slewing
/// (at most 0.5 ms a second) and a busy host's late wake-ups do not.
pub const CLOCK_STEP_TOLERANCE: Duration = Duration::from_millis(500);

/// Tells a step of the wall clock from time passing: remembers the last reading of both clocks.
#[derive(Debug, Clone)]
pub struct ClockWatch {
    wall: DateTime<Utc>,
    mono: tokio::time::Instant,
}

impl ClockWatch {
    /// Starts watching from `wall`, the wall clock's reading now.
    pub fn new(wall: DateTime<Utc>) -> Self {
        ClockWatch {
            wall,
            mono: tokio::time::Instant::now(),
        }
    }

    /// Takes a new reading, `wall`: the step since the last one (positive: ahead) if the wall clock moved more than
    /// [`CLOCK_STEP_TOLERANCE`] apart from the monotonic clock.
    pub fn observe(&mut self, wall: DateTime<Utc>) -> Option<chrono::Duration> {
        let mono = tokio::time::Instant::now();
        let passed = chrono::Duration::from_std(mono - self.mono).unwrap_or(chrono::Duration::MAX);
        let step = (wall - self.wall) - passed;
        (self.wall, self.mono) = (wall, mono);
        let tolerance = chrono::Duration::from_std(CLOCK_STEP_TOLERANCE).unwrap_or(chrono::Duration::MAX);
        (step.abs() > tolerance).then_some(step)
    }
}

/// The longest single sleep: after each nap the wall clock is read again.
pub const MAX_NAP: Duration = Duration::from_secs(1);

/// A schedule: how wall time maps to slots and when the next trigger is due.
#[derive(Debug, Clone)]
pub struct Schedule {
    mode: ScheduleMode,
    zone: Tz,
}

fn millis(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

fn from_millis(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap_or(if ms < 0 {
        DateTime::<Utc>::MIN_UTC
    } else {
        DateTime::<Utc>::MAX_UTC
    })
}

fn period_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

impl Schedule {
    pub fn new(mode: ScheduleMode, zone: Tz) -> Self {
        Schedule { mode, zone }
    }

    pub fn mode(&self) -> &ScheduleMode {
        &self.mode
    }

    /// The slot `t` falls in. Fixed-rate and fixed-delay: `floor(t / period)` on the epoch-anchored grid. Cron:
    /// the latest occurrence at or before `t`, as Unix seconds (`i64::MIN` if there is none).
    pub fn slot_of(&self, t: DateTime<Utc>) -> i64 {
        match &self.mode {
            ScheduleMode::FixedRate(p) | ScheduleMode::FixedDelay(p) => millis(t).div_euclid(period_ms(*p)),
            ScheduleMode::Cron(cron) => cron
                .find_previous_occurrence(&t.with_timezone(&self.zone), true)
                .map(|o| o.timestamp())
                .unwrap_or(i64::MIN),
        }
    }

    /// How many slots lie strictly between `last` and `slot`, counting at most `cap + 1`. Fixed-delay never
    /// misses slots: it waits after each run by design.
    pub fn missed(&self, last: i64, slot: i64, cap: u32) -> u64 {
        match &self.mode {
            ScheduleMode::FixedRate(_) => guard::grid_missed(last, slot),
            ScheduleMode::FixedDelay(_) => 0,
            ScheduleMode::Cron(cron) => {
                let Some(start) = DateTime::from_timestamp(last, 0) else {
                    return 0;
                };
                cron.iter_after(start.with_timezone(&self.zone))
                    .take_while(|o| o.timestamp() < slot)
                    .take(cap as usize + 1)
                    .count() as u64
            }
        }
    }

    /// When the next trigger is due, given the last processed slot, when the last run ended, and now. Never later
    /// than the next slot after `now`, so that a clock stepped back does not silence the schedule.
    pub fn next_due(
        &self,
        last_slot: Option<i64>,
        last_end: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> DateTime<Utc> {
        match &self.mode {
            ScheduleMode::FixedRate(p) => {
                let p = period_ms(*p);
                let after_now = (millis(now).div_euclid(p) + 1).saturating_mul(p);
                let after_last = last_slot.map_or(after_now, |s| s.saturating_add(1).saturating_mul(p));
                from_millis(after_last.min(after_now))
            }
            ScheduleMode::FixedDelay(d) => {
                let delay = chrono::Duration::from_std(*d).unwrap_or(chrono::Duration::MAX);
                last_end
                    .min(now)
                    .checked_add_signed(delay)
                    .unwrap_or(DateTime::<Utc>::MAX_UTC)
            }
            ScheduleMode::Cron(cron) => {
                let next_after = |t: DateTime<Utc>| {
                    cron.find_next_occurrence(&t.with_timezone(&self.zone), false)
                        .map(|o| o.with_timezone(&Utc))
                        .unwrap_or(DateTime::<Utc>::MAX_UTC)
                };
                let after_now = next_after(now);
                match last_slot.and_then(|s| DateTime::from_timestamp(s, 0)) {
                    Some(last) => next_after(last).min(after_now),
                    None => after_now,
                }
            }
        }
    }

    /// The time between two triggers after `at`: the period, or the gap between the cron's next two occurrences
    /// (zero when it has fewer).
    pub fn interval_after(&self, at: DateTime<Utc>) -> Duration {
        match &self.mode {
            ScheduleMode::FixedRate(p) | ScheduleMode::FixedDelay(p) => *p,
            ScheduleMode::Cron(cron) => {
                let mut next = cron.iter_after(at.with_timezone(&self.zone));
                match (next.next(), next.next()) {
                    (Some(a), Some(b)) => (b - a).to_std().unwrap_or_default(),
                    _ => Duration::ZERO,
                }
            }
        }
    }

    /// Human description for logs.
    pub fn describe(&self) -> String {
        match &self.mode {
            ScheduleMode::FixedRate(p) => format!("fixed-rate every {}", humantime::format_duration(*p)),
            ScheduleMode::FixedDelay(p) => {
                format!("fixed-delay {} after each run", humantime::format_duration(*p))
            }
            ScheduleMode::Cron(c) => format!("cron {:?} in {}", c.pattern.to_string(), self.zone.name()),
        }
    }
}

/// Why a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The due time was reached.
    Due,
    /// A manual "run now" (SIGHUP).
    RunNow,
    /// Shutdown.
    Cancelled,
    /// The wall clock stepped by this much (positive: ahead): the due time was computed on the old time.
    ClockStep(chrono::Duration),
}

/// Waits until the wall clock reaches `due`, in naps of at most [`MAX_NAP`] that re-read it; returns early on a
/// run-now notification, cancellation, or a step of the wall clock that `watch` sees. `beat` is called at every
/// wake (the loop is alive).
pub async fn wait_until(
    wall: &Arc<dyn WallClock>,
    watch: &mut ClockWatch,
    due: DateTime<Utc>,
    run_now: &Notify,
    cancel: &CancellationToken,
    beat: impl Fn(),
) -> Wake {
    loop {
        beat();
        let now = wall.now();
        if let Some(step) = watch.observe(now) {
            return Wake::ClockStep(step);
        }
        if now >= due {
            return Wake::Due;
        }
        let left = (due - now).to_std().unwrap_or(Duration::ZERO);
        let nap = left.min(MAX_NAP);
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return Wake::Cancelled,
            _ = run_now.notified() => return Wake::RunNow,
            _ = tokio::time::sleep(nap) => {}
        }
    }
}

/// A UTC instant from local wall time in `zone` (the earlier one if ambiguous); for tests and `plan`.
pub fn local_instant(zone: Tz, date: chrono::NaiveDate, h: u32, m: u32, s: u32) -> Option<DateTime<Utc>> {
    zone.with_ymd_and_hms(
        chrono::Datelike::year(&date),
        chrono::Datelike::month(&date),
        chrono::Datelike::day(&date),
        h,
        m,
        s,
    )
    .earliest()
    .map(|t| t.with_timezone(&Utc))
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s)
            .expect("rfc3339")
            .with_timezone(&Utc)
    }

    fn cron(pattern: &str, zone: Tz) -> Schedule {
        Schedule::new(
            ScheduleMode::Cron(Box::new(croner::Cron::from_str(pattern).expect("cron"))),
            zone,
        )
    }

    fn rate(ms: u64) -> Schedule {
        Schedule::new(ScheduleMode::FixedRate(Duration::from_millis(ms)), chrono_tz::UTC)
    }

    #[test]
    fn fixed_rate_slots_sit_on_an_epoch_grid() {
        let s = rate(60_000);
        let t = utc("2026-11-30T10:00:30Z");
        assert_eq!(s.slot_of(t), t.timestamp() / 60);
        assert_eq!(s.next_due(None, t, t), utc("2026-11-30T10:01:00Z"));
        // After a long run the next trigger is due at once (the slot after the last processed one).
        let last = s.slot_of(t);
        assert_eq!(
            s.next_due(Some(last), t, utc("2026-11-30T10:03:10Z")),
            utc("2026-11-30T10:01:00Z")
        );
        assert_eq!(s.missed(last, s.slot_of(utc("2026-11-30T10:03:10Z")), 3), 2);
    }

    #[test]
    fn a_clock_stepped_back_waits_at_most_one_period() {
        let s = rate(60_000);
        let last = s.slot_of(utc("2026-11-30T12:00:00Z"));
        let now = utc("2026-11-30T10:00:30Z");
        assert_eq!(s.next_due(Some(last), now, now), utc("2026-11-30T10:01:00Z"));
    }

    #[test]
    fn fixed_delay_waits_after_the_run_ends() {
        let s = Schedule::new(
            ScheduleMode::FixedDelay(Duration::from_millis(200)),
            chrono_tz::UTC,
        );
        let end = utc("2026-11-30T10:00:00.080Z");
        assert_eq!(s.next_due(Some(0), end, end), utc("2026-11-30T10:00:00.280Z"));
        assert_eq!(s.missed(1, 9, 3), 0);
    }

    #[test]
    fn cron_runs_once_right_after_a_spring_forward_gap() {
        // Europe/Berlin, 2026-03-29: 02:00 CET jumps to 03:00 CEST; 02:30 does not exist that day.
        let s = cron("0 30 2 * * *", chrono_tz::Europe::Berlin);
        let before = utc("2026-03-28T12:00:00Z");
        let due = s.next_due(None, before, before);
        assert_eq!(
            due,
            utc("2026-03-29T01:00:00Z"),
            "03:00 CEST, the first instant after the gap"
        );
        let after = s.next_due(Some(s.slot_of(due)), due, due);
        assert_eq!(after, utc("2026-03-30T00:30:00Z"), "then 02:30 CEST the next day");
    }

    #[test]
    fn cron_runs_once_in_a_fall_back_overlap() {
        // Europe/Berlin, 2026-10-25: 03:00 CEST goes back to 02:00 CET; 02:30 happens twice.
        let s = cron("0 30 2 * * *", chrono_tz::Europe::Berlin);
        let before = utc("2026-10-24T12:00:00Z");
        let first = s.next_due(None, before, before);
        assert_eq!(first, utc("2026-10-25T00:30:00Z"), "02:30 CEST");
        let second = s.next_due(Some(s.slot_of(first)), first, first);
        assert_eq!(
            second,
            utc("2026-10-26T01:30:00Z"),
            "not 02:30 CET the same night, but the next day"
        );
    }

    #[test]
    fn cron_counts_missed_occurrences() {
        let s = cron("0 */10 * * * *", chrono_tz::Asia::Shanghai);
        let last = s.slot_of(utc("2026-11-30T10:00:00Z"));
        let now = s.slot_of(utc("2026-11-30T10:45:00Z"));
        assert_eq!(
            s.missed(last, now, 10),
            3,
            "10:10, 10:20, 10:30 fell between 10:00 and 10:40"
        );
        assert_eq!(s.missed(last, now, 1), 2, "counting stops past the cap");
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_uses_bounded_naps_and_honours_run_now() {
        let wall: Arc<dyn WallClock> = Arc::new(TokioWall::new(utc("2026-11-30T10:00:00Z")));
        let mut watch = ClockWatch::new(wall.now());
        let (notify, cancel) = (Notify::new(), CancellationToken::new());
        let (soon, later) = (utc("2026-11-30T10:00:05Z"), utc("2026-11-30T11:00:00Z"));
        assert_eq!(
            wait_until(&wall, &mut watch, soon, &notify, &cancel, || {}).await,
            Wake::Due
        );
        assert_eq!(wall.now(), soon);
        notify.notify_one();
        assert_eq!(
            wait_until(&wall, &mut watch, later, &notify, &cancel, || {}).await,
            Wake::RunNow
        );
        cancel.cancel();
        assert_eq!(
            wait_until(&wall, &mut watch, later, &notify, &cancel, || {}).await,
            Wake::Cancelled
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_when_the_wall_clock_steps_either_way() {
        let stepping = TokioWall::new(utc("2026-11-30T10:00:00Z"));
        let wall: Arc<dyn WallClock> = Arc::new(stepping.clone());
        let mut watch = ClockWatch::new(wall.now());
        let (notify, cancel) = (Notify::new(), CancellationToken::new());
        let step_later = |by: chrono::Duration| {
            let stepping = stepping.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(2_500)).await;
                stepping.step(by);
            })
        };
        for by in [
            chrono::Duration::hours(-1),
            chrono::Duration::seconds(3),
            chrono::Duration::hours(2),
        ] {
            step_later(by);
            let started = tokio::time::Instant::now();
            let due = wall.now() + chrono::Duration::days(1);
            let woke = wait_until(&wall, &mut watch, due, &notify, &cancel, || {}).await;
            assert_eq!(woke, Wake::ClockStep(by));
            assert!(started.elapsed() <= Duration::from_millis(2_500) + MAX_NAP);
        }
        // A step smaller than the tolerance is time passing (NTP slewing, a late wake-up).
        stepping.step(chrono::Duration::milliseconds(-400));
        assert_eq!(watch.observe(wall.now()), None);
    }
}
