//! The scheduler loop: waits for the next due slot, passes every trigger through the slot guard, and hands out
//! admitted ticks one at a time. The caller runs the tick and reports back with [`Scheduler::finished`].

use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::health::Heartbeat;

use super::{
    guard::{Decision, SlotGuard},
    wait_until, ClockWatch, Schedule, Wake, WallClock,
};

/// What started a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    Startup,
    Timer,
    RunNow,
}

/// An admitted tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tick {
    pub slot: i64,
    /// Missed slots this tick covers.
    pub merged: u64,
    /// The scheduler fell behind by more than `max_catch_up` slots, or the wall clock stepped, and re-based.
    pub rebased: bool,
    pub trigger: Trigger,
    /// Wall time at which the tick was admitted.
    pub at: DateTime<Utc>,
}

/// Counters since start, for logs and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotStats {
    pub ticks: u64,
    pub dropped: u64,
    pub merged: u64,
    pub rebased: u64,
    /// Steps of the wall clock seen (each re-based the schedule once).
    pub clock_steps: u64,
}

#[derive(Debug)]
pub struct Scheduler {
    schedule: Schedule,
    guard: SlotGuard,
    max_catch_up: u32,
    wall: Arc<dyn WallClock>,
    /// Tick once at start instead of waiting for the first slot.
    startup_tick: bool,
    started: bool,
    last_end: DateTime<Utc>,
    stats: SlotStats,
    /// Tells a step of the wall clock from time passing, across waits and ticks alike.
    watch: ClockWatch,
    /// The wall clock stepped since the last admitted tick: the next one is a re-base.
    stepped: bool,
    /// Told at every wake of the loop (at most [`super::MAX_NAP`] apart while idle): the watchdog's feed.
    heartbeat: Option<Arc<Heartbeat>>,
}

impl Scheduler {
    pub fn new(schedule: Schedule, max_catch_up: u32, wall: Arc<dyn WallClock>, startup_tick: bool) -> Self {
        let now = wall.now();
        Scheduler {
            schedule,
            guard: SlotGuard::new(max_catch_up),
            max_catch_up,
            wall,
            startup_tick,
            started: false,
            last_end: now,
            stats: SlotStats::default(),
            watch: ClockWatch::new(now),
            stepped: false,
            heartbeat: None,
        }
    }

    /// Reports every wake of the loop to `heartbeat` (see [`Heartbeat::alive`]).
    pub fn with_heartbeat(mut self, heartbeat: Arc<Heartbeat>) -> Self {
        self.heartbeat = Some(heartbeat);
        self
    }

    pub fn stats(&self) -> SlotStats {
        self.stats
    }

    /// Waits for the next admitted tick; `None` once `cancel` fires.
    pub async fn next(&mut self, run_now: &Notify, cancel: &CancellationToken) -> Option<Tick> {
        loop {
            let trigger = if !self.started && self.startup_tick {
                self.started = true;
                Trigger::Startup
            } else {
                self.started = true;
                let now = self.wall.now();
                // A step while the last tick ran.
                if let Some(step) = self.watch.observe(now) {
                    self.rebase_after(step, now);
                }
                let due = self.schedule.next_due(self.guard.last(), self.last_end, now);
                let heartbeat = self.heartbeat.clone();
                let beat = move || {
                    if let Some(h) = &heartbeat {
                        h.alive();
                    }
                };
                match wait_until(&self.wall, &mut self.watch, due, run_now, cancel, beat).await {
                    Wake::Cancelled => return None,
                    Wake::RunNow => Trigger::RunNow,
                    Wake::Due => Trigger::Timer,
                    Wake::ClockStep(step) => {
                        self.rebase_after(step, self.wall.now());
                        continue;
                    }
                }
            };
            if cancel.is_cancelled() {
                return None;
            }
            let at = self.wall.now();
            let slot = self.schedule.slot_of(at);
            let (schedule, cap) = (&self.schedule, self.max_catch_up);
            match self
                .guard
                .admit(slot, |last, slot| schedule.missed(last, slot, cap))
            {
                Decision::Drop => {
                    self.stats.dropped += 1;
                    tracing::debug!(slot, trigger = ?trigger, dropped_total = self.stats.dropped, "trigger dropped: slot already processed");
                }
                Decision::Run {
                    slot,
                    merged,
                    rebased,
                } => {
                    self.stats.ticks += 1;
                    self.stats.merged += merged;
                    if std::mem::take(&mut self.stepped) {
                        // Logged when the step was seen.
                        self.stats.rebased += 1;
                        return Some(Tick {
                            slot,
                            merged,
                            rebased: true,
                            trigger,
                            at,
                        });
                    }
                    if rebased {
                        self.stats.rebased += 1;
                        tracing::warn!(
                            slot,
                            missed_slots = merged,
                            max_catch_up = cap,
                            "fell behind (suspend, overload or clock jump): running once and re-basing"
                        );
                    } else if merged > 0 {
                        tracing::info!(
                            slot,
                            merged_slots = merged,
                            merged_total = self.stats.merged,
                            "missed slots merged into this tick"
                        );
                    }
                    return Some(Tick {
                        slot,
                        merged,
                        rebased,
                        trigger,
                        at,
                    });
                }
            }
        }
    }

    /// Re-bases the schedule on the wall clock's new time `now` after it stepped by `step`. Back: the slots counted
    /// on the old time are forgotten (they lie in the future now), so the next slot of the new time runs within
    /// one period, and fixed-delay waits its delay from the step. Ahead (or a suspend): the slots the step crossed
    /// are due, so the tick runs at once, merging them (or re-basing past `max_catch_up`) — a forward step must
    /// not skip the slot it jumped over (a daily cron stepped past 02:30 would otherwise run a day late).
    fn rebase_after(&mut self, step: chrono::Duration, now: DateTime<Utc>) {
        self.stats.clock_steps += 1;
        if step < chrono::Duration::zero() {
            self.guard.forget();
            self.last_end = now;
        }
        self.stepped = true;
        tracing::warn!(
            step_ms = step.num_milliseconds(),
            direction = if step < chrono::Duration::zero() { "back" } else { "ahead" },
            now = %now,
            clock_steps_total = self.stats.clock_steps,
            "the host clock stepped (or the host was suspended): re-basing the schedule on the new time"
        );
    }

    /// Records the end of the tick just run (fixed-delay waits from here).
    pub fn finished(&mut self) {
        self.last_end = self.wall.now();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{config::ScheduleMode, schedule::TokioWall};

    fn origin() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-11-30T10:00:00Z")
            .expect("origin")
            .with_timezone(&Utc)
    }

    fn scheduler(mode: ScheduleMode, startup: bool, max_catch_up: u32) -> Scheduler {
        let wall: Arc<dyn WallClock> = Arc::new(TokioWall::new(origin()));
        Scheduler::new(Schedule::new(mode, chrono_tz::UTC), max_catch_up, wall, startup)
    }

    /// Runs `n` ticks with `work` each; returns (ms since origin at admission, merged, rebased).
    async fn run(s: &mut Scheduler, n: usize, work: Duration) -> Vec<(i64, u64, bool)> {
        let (notify, cancel) = (Notify::new(), CancellationToken::new());
        let mut out = Vec::new();
        for _ in 0..n {
            let tick = s.next(&notify, &cancel).await.expect("tick");
            out.push(((tick.at - origin()).num_milliseconds(), tick.merged, tick.rebased));
            tokio::time::sleep(work).await;
            s.finished();
        }
        out
    }

    #[tokio::test(start_paused = true)]
    async fn fixed_rate_stays_on_the_grid() {
        let mut s = scheduler(ScheduleMode::FixedRate(Duration::from_millis(200)), false, 3);
        let ticks = run(&mut s, 6, Duration::from_millis(80)).await;
        let starts: Vec<i64> = ticks.iter().map(|t| t.0).collect();
        assert_eq!(starts, vec![200, 400, 600, 800, 1000, 1200]);
        assert!(ticks.iter().all(|t| t.1 == 0 && !t.2));
    }

    #[tokio::test(start_paused = true)]
    async fn fixed_delay_drifts_by_the_work_time() {
        let mut s = scheduler(ScheduleMode::FixedDelay(Duration::from_millis(200)), true, 3);
        let starts: Vec<i64> = run(&mut s, 4, Duration::from_millis(80))
            .await
            .iter()
            .map(|t| t.0)
            .collect();
        assert_eq!(starts, vec![0, 280, 560, 840]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_fixed_rate_task_slower_than_its_period_is_merged_not_burst() {
        let mut s = scheduler(ScheduleMode::FixedRate(Duration::from_millis(100)), true, 3);
        let ticks = run(&mut s, 4, Duration::from_millis(300)).await;
        assert_eq!(
            ticks,
            vec![(0, 0, false), (300, 2, false), (600, 2, false), (900, 2, false)]
        );
        assert_eq!(
            s.stats(),
            SlotStats {
                ticks: 4,
                dropped: 0,
                merged: 6,
                rebased: 0,
                clock_steps: 0
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_stall_runs_once_and_rebases() {
        let mut s = scheduler(ScheduleMode::FixedRate(Duration::from_millis(100)), true, 3);
        run(&mut s, 1, Duration::from_millis(10)).await;
        // The process is suspended for a second inside a tick.
        let ticks = run(&mut s, 2, Duration::from_millis(1_000)).await;
        assert_eq!(ticks[0], (100, 0, false));
        assert_eq!(ticks[1], (1100, 9, true));
    }

    /// Steps of the wall clock back and ahead, by seconds and by hours, in every mode: each is seen once,
    /// re-based once, and the next tick comes within one period of the new time.
    #[tokio::test(start_paused = true)]
    async fn a_clock_step_re_bases_once_and_ticking_goes_on_within_a_period() {
        let modes = [
            ScheduleMode::FixedRate(Duration::from_secs(1)),
            ScheduleMode::FixedDelay(Duration::from_secs(1)),
            ScheduleMode::Cron(Box::new(
                std::str::FromStr::from_str("* * * * * *").expect("every second"),
            )),
        ];
        let steps = [-5, -3_600, 3_600, 20, -600].map(chrono::Duration::seconds);
        for mode in modes {
            let wall = TokioWall::new(origin());
            let shared: Arc<dyn WallClock> = Arc::new(wall.clone());
            let mut s = Scheduler::new(Schedule::new(mode.clone(), chrono_tz::UTC), 3, shared, true);
            let (notify, cancel) = (Notify::new(), CancellationToken::new());
            s.next(&notify, &cancel).await.expect("startup tick");
            s.finished();
            for (n, by) in steps.into_iter().enumerate() {
                tokio::time::sleep(Duration::from_millis(300)).await;
                wall.step(by);
                let stepped_at = tokio::time::Instant::now();
                let tick = s.next(&notify, &cancel).await.expect("tick");
                s.finished();
                let waited = stepped_at.elapsed();
                assert!(
                    tick.rebased && waited <= Duration::from_secs(1),
                    "{mode:?}, step {by}: {tick:?} after {waited:?}"
                );
                let next = s.next(&notify, &cancel).await.expect("tick");
                s.finished();
                assert!(!next.rebased, "{mode:?}, step {by}: re-based once: {next:?}");
                assert_eq!(s.stats().clock_steps, n as u64 + 1, "{mode:?}");
            }
        }
    }

    /// A forward step (an NTP correction of a slow clock, a VM resumed) across a slot runs that slot at once: an
    /// hourly schedule stepped from 10:50 to 11:10, or a daily cron stepped past its time, does not wait for the
    /// next slot of the new time.
    #[tokio::test(start_paused = true)]
    async fn a_forward_step_across_a_slot_runs_it_at_once() {
        let modes = [
            ScheduleMode::FixedRate(Duration::from_secs(3_600)),
            ScheduleMode::Cron(Box::new(
                std::str::FromStr::from_str("0 0 * * * *").expect("hourly"),
            )),
        ];
        for mode in modes {
            let wall = TokioWall::new(origin());
            let shared: Arc<dyn WallClock> = Arc::new(wall.clone());
            let mut s = Scheduler::new(Schedule::new(mode.clone(), chrono_tz::UTC), 3, shared, true);
            let (notify, cancel) = (Notify::new(), CancellationToken::new());
            s.next(&notify, &cancel).await.expect("startup tick");
            s.finished();
            tokio::time::sleep(Duration::from_secs(50 * 60)).await;
            wall.step(chrono::Duration::minutes(20));
            let stepped_at = tokio::time::Instant::now();
            let tick = s.next(&notify, &cancel).await.expect("tick");
            assert!(
                stepped_at.elapsed() <= Duration::from_secs(1),
                "{mode:?}: the 11:00 slot ran {:?} after the step",
                stepped_at.elapsed()
            );
            assert_eq!(tick.slot, s.schedule.slot_of(wall.now()), "{mode:?}");
            assert_eq!(s.stats().clock_steps, 1, "{mode:?}");
        }
    }

    /// A step during a tick (not during a wait) is seen when the next wait starts.
    #[tokio::test(start_paused = true)]
    async fn a_clock_stepped_back_during_a_tick_does_not_silence_the_schedule() {
        let wall = TokioWall::new(origin());
        let shared: Arc<dyn WallClock> = Arc::new(wall.clone());
        let mode = ScheduleMode::FixedRate(Duration::from_secs(1));
        let mut s = Scheduler::new(Schedule::new(mode, chrono_tz::UTC), 3, shared, true);
        let (notify, cancel) = (Notify::new(), CancellationToken::new());
        s.next(&notify, &cancel).await.expect("startup tick");
        wall.step(chrono::Duration::hours(-1));
        s.finished();
        let started = tokio::time::Instant::now();
        let tick = s.next(&notify, &cancel).await.expect("tick");
        assert!(tick.rebased && started.elapsed() <= Duration::from_secs(1));
        assert_eq!(s.stats().clock_steps, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn run_now_in_a_processed_slot_is_dropped() {
        let mut s = scheduler(ScheduleMode::FixedRate(Duration::from_millis(1_000)), true, 3);
        let (notify, cancel) = (Notify::new(), CancellationToken::new());
        let first = s.next(&notify, &cancel).await.expect("startup tick");
        assert_eq!(first.trigger, Trigger::Startup);
        s.finished();
        // A "run now" in the same slot as the startup tick is dropped; then the timer fires.
        notify.notify_one();
        let next = s.next(&notify, &cancel).await.expect("tick");
        assert_eq!(
            (next.trigger, (next.at - origin()).num_milliseconds()),
            (Trigger::Timer, 1_000)
        );
        assert_eq!(s.stats().dropped, 1);
        cancel.cancel();
        assert_eq!(s.next(&notify, &cancel).await, None);
    }
}
