//! The pace keyed to libraryd's commit latency (`throttle.max_commit_latency`): a [`Governor`] finds the fastest
//! rows-per-second rate that keeps a commit under the budget, from a probe of fine-settler's own.
//!
//! **The signal.** Every [`PROBE_EVERY`] while a run works, before a batch, the throttle times one tiny
//! transaction of its own on another connection of the pool ([`crate::store::latency::PROBE`], one round trip):
//! it writes one small WAL record, so its commit waits for the WAL flush (and a synchronous standby), as each of
//! libraryd's writing transactions does, and it touches no table. What it measures is what a short
//! libraryd transaction meets at that moment: the server's CPU, the WAL insert and flush queue the batches fill,
//! the network. (The connection is checked out first: a wait for a free connection of fine-settler's pool is not
//! libraryd's latency.) A probe that fails is ignored; one that takes longer than [`probe_timeout`] counts as a
//! probe over the budget.
//!
//! **The rate.** Additive increase, multiplicative decrease: each probe within the budget raises the rate by
//! [`INCREASE_STEP`] rows/s, or by [`INCREASE_SHARE`] of the rate when that is more; each probe over it halves the
//! rate. The rate starts at [`START_RATE`], never falls below [`FLOOR_RATE`] (a run always progresses), never
//! rises above `throttle.max_rows_per_second` when that is set, nor above twice what the last batch achieved at
//! full speed — so a rate raised while the runs were fast comes down in one halving when it matters. A probe over
//! the budget in every few therefore holds the rate where libraryd's tail commits stay near the budget.

use std::time::Duration;

use tokio::time::Instant;

/// How often a working run probes the commit latency (at most; only before a batch).
pub const PROBE_EVERY: Duration = Duration::from_millis(100);
/// The rate a process starts at, in rows per second.
pub const START_RATE: f64 = 2_000.0;
/// The lowest rate, in rows per second: a run always progresses.
pub const FLOOR_RATE: f64 = 50.0;
/// The least a probe within the budget raises the rate, in rows per second.
pub const INCREASE_STEP: f64 = 250.0;
/// The share of the rate a probe within the budget raises it by, when that is more than [`INCREASE_STEP`].
pub const INCREASE_SHARE: f64 = 0.05;
/// The factor a probe over the budget multiplies the rate by.
pub const DECREASE: f64 = 0.5;

/// How long a probe may take before it counts as over the budget: ten budgets, at least a second and at most a
/// minute.
pub fn probe_timeout(budget: Duration) -> Duration {
    budget
        .saturating_mul(10)
        .clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// What a probe did to the rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Probed {
    /// The commit latency measured (the timeout, for a probe that took longer).
    pub latency: Duration,
    /// Whether it was over the budget.
    pub over: bool,
    /// The rate before and after it, in rows per second.
    pub from: f64,
    pub to: f64,
}

/// The rate under `throttle.max_commit_latency`, adapted after every probe.
#[derive(Debug, Clone)]
pub struct Governor {
    budget: Duration,
    /// `throttle.max_rows_per_second`, when set.
    ceiling: Option<f64>,
    rate: f64,
    /// Twice the rate the last batch achieved while it ran (rows over its transaction's time).
    achievable: Option<f64>,
    last_probe: Option<Instant>,
}

impl Governor {
    pub fn new(budget: Duration, ceiling: Option<u32>) -> Self {
        let ceiling = ceiling.map(f64::from);
        Governor {
            budget,
            ceiling,
            rate: ceiling.map_or(START_RATE, |c| c.min(START_RATE)),
            achievable: None,
            last_probe: None,
        }
    }

    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// The current rate, in rows per second.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Whether a probe is due at `now`: none yet, or the last started [`PROBE_EVERY`] ago. A due probe is then
    /// taken as started, so that concurrent runs of the process do not probe at once.
    pub fn probe_due(&mut self, now: Instant) -> bool {
        let due = self
            .last_probe
            .is_none_or(|last| now.saturating_duration_since(last) >= PROBE_EVERY);
        if due {
            self.last_probe = Some(now);
        }
        due
    }

    /// Adapts the rate to a probe's commit latency.
    pub fn observe(&mut self, latency: Duration) -> Probed {
        let from = self.rate;
        let over = latency > self.budget;
        let to = if over {
            from * DECREASE
        } else {
            from + INCREASE_STEP.max(from * INCREASE_SHARE)
        };
        self.rate = self.bounded(to);
        Probed {
            latency,
            over,
            from,
            to: self.rate,
        }
    }

    /// Notes a committed batch: `rows` worked in `took` (its transaction, at full speed).
    pub fn worked(&mut self, rows: i64, took: Duration) {
        if rows <= 0 || took.is_zero() {
            return;
        }
        self.achievable = Some(2.0 * rows as f64 / took.as_secs_f64());
        self.rate = self.bounded(self.rate);
    }

    fn bounded(&self, rate: f64) -> f64 {
        let mut rate = rate;
        if let Some(c) = self.ceiling {
            rate = rate.min(c);
        }
        if let Some(a) = self.achievable {
            rate = rate.min(a);
        }
        rate.max(self.floor())
    }

    /// [`FLOOR_RATE`], or `throttle.max_rows_per_second` when that is lower: the cap is never exceeded.
    fn floor(&self) -> f64 {
        self.ceiling.map_or(FLOOR_RATE, |c| c.min(FLOOR_RATE))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const BUDGET: Duration = Duration::from_millis(5);

    #[test]
    fn a_probe_over_the_budget_halves_the_rate_and_one_within_raises_it() {
        let mut g = Governor::new(BUDGET, None);
        assert_eq!(g.rate(), START_RATE);
        let p = g.observe(Duration::from_millis(6));
        assert!(p.over);
        assert_eq!((p.from, p.to), (START_RATE, START_RATE / 2.0));
        let p = g.observe(Duration::from_millis(5));
        assert!(!p.over, "the budget itself is within it");
        assert_eq!(p.to, START_RATE / 2.0 + INCREASE_STEP);
        // Above INCREASE_STEP / INCREASE_SHARE, the increase is a share of the rate.
        let mut g = Governor::new(BUDGET, Some(1_000_000));
        for _ in 0..200 {
            g.observe(Duration::ZERO);
        }
        let before = g.rate();
        assert!(before > 100_000.0, "{before}");
        let p = g.observe(Duration::ZERO);
        assert!((p.to - before * (1.0 + INCREASE_SHARE)).abs() < 1e-6 || p.to == 1_000_000.0);
    }

    #[test]
    fn the_rate_never_leaves_its_floor_and_ceilings() {
        let mut g = Governor::new(BUDGET, Some(3_000));
        for _ in 0..100 {
            g.observe(Duration::ZERO);
        }
        assert_eq!(g.rate(), 3_000.0, "max_rows_per_second is the ceiling");
        for _ in 0..100 {
            g.observe(Duration::from_secs(1));
        }
        assert_eq!(g.rate(), FLOOR_RATE);
        // A ceiling below the start rate starts there; one below the floor is the floor.
        assert_eq!(Governor::new(BUDGET, Some(100)).rate(), 100.0);
        let mut g = Governor::new(BUDGET, Some(10));
        g.observe(Duration::from_secs(1));
        g.worked(1, Duration::from_secs(1));
        assert_eq!(g.rate(), 10.0);
    }

    #[test]
    fn a_rate_raised_while_batches_were_fast_is_held_to_twice_what_the_last_achieved() {
        let mut g = Governor::new(BUDGET, None);
        for _ in 0..300 {
            g.observe(Duration::ZERO);
        }
        assert!(g.rate() > 1_000_000.0);
        // 1,000 rows in 100 ms: 10,000 rows/s at full speed.
        g.worked(1_000, Duration::from_millis(100));
        assert_eq!(g.rate(), 20_000.0);
        g.observe(Duration::from_secs(1));
        assert_eq!(g.rate(), 10_000.0, "one halving brings it to what batches do");
        // Nothing worked teaches nothing.
        g.worked(0, Duration::from_millis(100));
        g.worked(10, Duration::ZERO);
        for _ in 0..100 {
            g.observe(Duration::ZERO);
        }
        assert_eq!(g.rate(), 20_000.0);
    }

    #[test]
    fn a_probe_is_due_every_probe_interval_once() {
        let mut g = Governor::new(BUDGET, None);
        let t0 = Instant::now();
        assert!(g.probe_due(t0));
        assert!(!g.probe_due(t0), "taken as started");
        assert!(!g.probe_due(t0 + PROBE_EVERY / 2));
        assert!(g.probe_due(t0 + PROBE_EVERY));
    }

    #[test]
    fn a_probe_times_out_after_ten_budgets_and_at_least_a_second() {
        assert_eq!(probe_timeout(Duration::from_millis(5)), Duration::from_secs(1));
        assert_eq!(probe_timeout(Duration::from_millis(500)), Duration::from_secs(5));
        assert_eq!(probe_timeout(Duration::MAX), Duration::from_secs(60));
    }

    proptest! {
        /// Whatever the probes say, the rate stays within its floor and ceilings, and moves the right way.
        #[test]
        fn the_rate_moves_against_the_latency_within_its_bounds(
            ceiling in proptest::option::of(1u32..5_000_000),
            probes in proptest::collection::vec((0u64..20, proptest::option::of((1i64..100_000, 1u64..1_000))), 1..200),
        ) {
            let mut g = Governor::new(BUDGET, ceiling);
            for (ms, batch) in probes {
                if let Some((rows, took)) = batch {
                    g.worked(rows, Duration::from_millis(took));
                }
                let before = g.rate();
                let p = g.observe(Duration::from_millis(ms));
                prop_assert!(p.to >= FLOOR_RATE.min(f64::from(ceiling.unwrap_or(u32::MAX))));
                if let Some(c) = ceiling {
                    prop_assert!(p.to <= f64::from(c), "the cap is never exceeded");
                }
                if p.over {
                    prop_assert!(p.to <= before);
                } else {
                    prop_assert!(p.to >= before);
                }
            }
        }
    }
}
