//! The pace keyed to libraryd's commit latency (`throttle.max_commit_latency`): a [`Governor`] finds the fastest
//! rows-per-second rate that keeps a commit under the budget, from a probe of fine-settler's own.
//!
//! **The signal.** Every [`PROBE_EVERY`] while a run works, before a batch, the throttle times one tiny
//! transaction of its own on another connection of the pool ([`crate::store::latency::probe`]), shaped as a
//! short transaction of libraryd's: `begin`, a read, a write of one small WAL record (so that its commit waits
//! for the WAL flush and a synchronous standby, as each of libraryd's writing transactions does), `commit` —
//! four round trips, touching no table. What it measures is what a short libraryd transaction meets at that
//! moment: the server's CPU, the WAL insert and flush queue the batches fill, the network. (The connection is
//! checked out first: a wait for a free connection of fine-settler's pool is not libraryd's latency.) One probe
//! runs at a time, in the background: a batch never waits for it. A probe that fails is ignored; one that takes
//! longer than [`probe_timeout`] counts as a probe over the budget, and its connection is closed rather than
//! waited for.
//!
//! **The rate.** Each probe within the budget raises the rate by [`INCREASE_SHARE`] of it (at least
//! [`INCREASE_STEP`] rows/s); a probe over it halves the rate — at most once per [`DECREASE_HOLD`], so that the
//! probes of one busy moment, taken before the halving could tell, do not halve it again and again. The rate
//! starts at [`START_RATE`], never falls below [`FLOOR_RATE`] (a run always progresses), never rises above
//! `throttle.max_rows_per_second` when that is set, nor above twice what the last batch achieved at full speed —
//! so a rate raised while the runs were fast comes down in one halving when it matters.
//!
//! **Why these steps.** The budget is meant as a tail: libraryd's commits should stay within it but for the
//! odd one. Where the rate settles, its rises and its falls balance: a share `p` of the probes over the budget
//! halves it, the rest raise it by [`INCREASE_SHARE`], so `p × ½ ≈ (1 − p) × INCREASE_SHARE` — with a rise of
//! 0.5 % a probe, about one probe in a hundred is over the budget: the rate that keeps the probes' p99 near the
//! budget, whatever the server. The price is a slow climb: about 5 % a second (ten probes), doubling in 14 s.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::time::Instant;

use crate::store::{self, Db};

/// How often a working run probes the commit latency (at most; only before a batch).
pub const PROBE_EVERY: Duration = Duration::from_millis(100);
/// The rate a process starts at, in rows per second.
pub const START_RATE: f64 = 2_000.0;
/// The lowest rate, in rows per second: a run always progresses.
pub const FLOOR_RATE: f64 = 50.0;
/// The least a probe within the budget raises the rate, in rows per second.
pub const INCREASE_STEP: f64 = 10.0;
/// The share of the rate a probe within the budget raises it by, when that is more than [`INCREASE_STEP`].
pub const INCREASE_SHARE: f64 = 0.005;
/// The factor a probe over the budget multiplies the rate by.
pub const DECREASE: f64 = 0.5;
/// After a halving, probes over the budget leave the rate alone this long (those within it raise it).
pub const DECREASE_HOLD: Duration = Duration::from_millis(500);

/// How long a probe may take before it counts as over the budget: ten budgets, at least a second and at most
/// ten.
pub fn probe_timeout(budget: Duration) -> Duration {
    budget
        .saturating_mul(10)
        .clamp(Duration::from_secs(1), Duration::from_secs(10))
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
    /// When the rate was last halved.
    last_decrease: Option<Instant>,
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
            last_decrease: None,
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
    /// taken as started.
    pub fn probe_due(&mut self, now: Instant) -> bool {
        let due = self
            .last_probe
            .is_none_or(|last| now.saturating_duration_since(last) >= PROBE_EVERY);
        if due {
            self.last_probe = Some(now);
        }
        due
    }

    /// Adapts the rate to a probe's commit latency, measured at `now`.
    pub fn observe(&mut self, latency: Duration, now: Instant) -> Probed {
        let from = self.rate;
        let over = latency > self.budget;
        let held = self
            .last_decrease
            .is_some_and(|at| now.saturating_duration_since(at) < DECREASE_HOLD);
        let to = match (over, held) {
            (true, true) => from,
            (true, false) => {
                self.last_decrease = Some(now);
                from * DECREASE
            }
            (false, _) => from + INCREASE_STEP.max(from * INCREASE_SHARE),
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

/// The pace under `throttle.max_commit_latency` of one process: its [`Governor`], and the probe that runs in
/// the background, one at a time.
#[derive(Debug)]
pub struct LatencyPace {
    governor: Mutex<Governor>,
    /// A probe is running.
    probing: AtomicBool,
    /// What the last finished probe did to the rate, until a run reports it.
    probed: Mutex<Option<Probed>>,
    /// A probe failed (warned about once).
    failed: AtomicBool,
}

impl LatencyPace {
    pub fn new(budget: Duration, ceiling: Option<u32>) -> Arc<Self> {
        Arc::new(LatencyPace {
            governor: Mutex::new(Governor::new(budget, ceiling)),
            probing: AtomicBool::new(false),
            probed: Mutex::new(None),
            failed: AtomicBool::new(false),
        })
    }

    /// The current rate, in rows per second.
    pub fn rate(&self) -> Option<f64> {
        self.governor.lock().ok().map(|g| g.rate())
    }

    /// Notes a committed batch (see [`Governor::worked`]).
    pub fn worked(&self, rows: i64, took: Duration) {
        if let Ok(mut g) = self.governor.lock() {
            g.worked(rows, took);
        }
    }

    /// Starts a probe in the background when one is due and none is running — a batch never waits for a probe,
    /// so a slow one cannot hold the run below the pace — and returns what the last finished probe did to the
    /// rate, once.
    pub fn probe(self: &Arc<Self>, pool: &Db) -> Option<Probed> {
        let finished = self.probed.lock().ok()?.take();
        let due =
            !self.probing.load(Ordering::Acquire) && self.governor.lock().ok()?.probe_due(Instant::now());
        if due {
            self.probing.store(true, Ordering::Release);
            let pace = self.clone();
            let pool = pool.clone();
            tokio::spawn(async move {
                let probed = pace.probe_now(&pool).await;
                if let (Some(probed), Ok(mut last)) = (probed, pace.probed.lock()) {
                    *last = Some(probed);
                }
                pace.probing.store(false, Ordering::Release);
            });
        }
        finished
    }

    /// Times one probe and adapts the rate to it. A probe that fails is warned about once and ignored (the rate
    /// stays); one that outlasts [`probe_timeout`] counts as over the budget.
    async fn probe_now(&self, pool: &Db) -> Option<Probed> {
        let budget = self.governor.lock().ok()?.budget();
        let timeout = probe_timeout(budget);
        let latency = match store::latency::commit_latency(pool, timeout).await {
            Ok(latency) => latency.unwrap_or(timeout),
            Err(e) => {
                let rate = self.rate().unwrap_or_default().round() as u64;
                if self.failed.swap(true, Ordering::Relaxed) {
                    tracing::debug!(error = %e, rows_per_second = rate, "the commit latency probe failed; the pace stays");
                } else {
                    tracing::warn!(error = %e, rows_per_second = rate,
                        "the commit latency probe of throttle.max_commit_latency failed; the pace stays where it is \
                         until a probe succeeds (said once per process)");
                }
                return None;
            }
        };
        self.governor
            .lock()
            .ok()
            .map(|mut g| g.observe(latency, Instant::now()))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const BUDGET: Duration = Duration::from_millis(5);

    /// Probes `latency` `n` times, each [`DECREASE_HOLD`] after the last (so that none is held).
    fn probe_n(g: &mut Governor, latency: Duration, n: usize, t: &mut Instant) {
        for _ in 0..n {
            *t += DECREASE_HOLD;
            g.observe(latency, *t);
        }
    }

    #[test]
    fn a_probe_over_the_budget_halves_the_rate_and_one_within_raises_it() {
        let t = Instant::now();
        let mut g = Governor::new(BUDGET, None);
        assert_eq!(g.rate(), START_RATE);
        let p = g.observe(Duration::from_millis(6), t);
        assert!(p.over);
        assert_eq!((p.from, p.to), (START_RATE, START_RATE / 2.0));
        let p = g.observe(Duration::from_millis(5), t);
        assert!(!p.over, "the budget itself is within it");
        assert_eq!(p.to, START_RATE / 2.0 + INCREASE_STEP);
        // Above INCREASE_STEP / INCREASE_SHARE, the increase is a share of the rate.
        let mut g = Governor::new(BUDGET, Some(1_000_000));
        let mut t = Instant::now();
        probe_n(&mut g, Duration::ZERO, 1_000, &mut t);
        let before = g.rate();
        assert!(before > 10_000.0, "{before}");
        let p = g.observe(Duration::ZERO, t);
        assert!((p.to - before * (1.0 + INCREASE_SHARE)).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn probes_over_the_budget_within_the_hold_halve_the_rate_once() {
        let t = Instant::now();
        let mut g = Governor::new(BUDGET, None);
        g.observe(Duration::from_secs(1), t);
        let p = g.observe(Duration::from_secs(1), t + DECREASE_HOLD / 2);
        assert!(p.over);
        assert_eq!(p.to, START_RATE / 2.0, "held: one busy moment halves once");
        let p = g.observe(Duration::from_secs(1), t + DECREASE_HOLD);
        assert_eq!(p.to, START_RATE / 4.0, "after the hold, halved again");
    }

    #[test]
    fn about_one_probe_in_a_hundred_over_the_budget_holds_the_rate() {
        let mut g = Governor::new(BUDGET, None);
        let mut t = Instant::now();
        probe_n(&mut g, Duration::ZERO, 2_000, &mut t);
        // From wherever it got to: one probe over in every 100 (the 100th), for a long while.
        let mut rates = Vec::new();
        for i in 1..=20_000 {
            t += DECREASE_HOLD;
            let latency = if i % 100 == 0 {
                Duration::from_secs(1)
            } else {
                Duration::ZERO
            };
            rates.push(g.observe(latency, t).to);
        }
        let late = &rates[10_000..];
        let (lo, hi) = late
            .iter()
            .fold((f64::MAX, 0.0_f64), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
        assert!(
            hi / lo < 2.1,
            "the rate swings between {lo} and {hi}, a halving's width"
        );
        // One in a hundred is about the balance: one in fifty drives it down, one in two hundred up.
        for (every, falls) in [(50, true), (200, false)] {
            let mut g2 = g.clone();
            let start = g2.rate();
            for i in 1..=2_000 {
                t += DECREASE_HOLD;
                let latency = if i % every == 0 {
                    Duration::from_secs(1)
                } else {
                    Duration::ZERO
                };
                g2.observe(latency, t);
            }
            assert_eq!(
                g2.rate() < start / 2.0,
                falls,
                "one in {every}: {start} → {}",
                g2.rate()
            );
        }
    }

    #[test]
    fn the_rate_never_leaves_its_floor_and_ceilings() {
        let mut t = Instant::now();
        let mut g = Governor::new(BUDGET, Some(3_000));
        probe_n(&mut g, Duration::ZERO, 1_000, &mut t);
        assert_eq!(g.rate(), 3_000.0, "max_rows_per_second is the ceiling");
        probe_n(&mut g, Duration::from_secs(1), 100, &mut t);
        assert_eq!(g.rate(), FLOOR_RATE);
        // A ceiling below the start rate starts there; one below the floor is the floor.
        assert_eq!(Governor::new(BUDGET, Some(100)).rate(), 100.0);
        let mut g = Governor::new(BUDGET, Some(10));
        probe_n(&mut g, Duration::from_secs(1), 1, &mut t);
        g.worked(1, Duration::from_secs(1));
        assert_eq!(g.rate(), 10.0);
    }

    #[test]
    fn a_rate_raised_while_batches_were_fast_is_held_to_twice_what_the_last_achieved() {
        let mut t = Instant::now();
        let mut g = Governor::new(BUDGET, None);
        probe_n(&mut g, Duration::ZERO, 2_000, &mut t);
        assert!(g.rate() > 100_000.0, "{}", g.rate());
        // 1,000 rows in 100 ms: 10,000 rows/s at full speed.
        g.worked(1_000, Duration::from_millis(100));
        assert_eq!(g.rate(), 20_000.0);
        probe_n(&mut g, Duration::from_secs(1), 1, &mut t);
        assert_eq!(g.rate(), 10_000.0, "one halving brings it to what batches do");
        // Nothing worked teaches nothing.
        g.worked(0, Duration::from_millis(100));
        g.worked(10, Duration::ZERO);
        probe_n(&mut g, Duration::ZERO, 1_000, &mut t);
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
        assert_eq!(probe_timeout(Duration::MAX), Duration::from_secs(10));
    }

    proptest! {
        /// Whatever the probes say, the rate stays within its floor and ceilings, and moves the right way.
        #[test]
        fn the_rate_moves_against_the_latency_within_its_bounds(
            ceiling in proptest::option::of(1u32..5_000_000),
            probes in proptest::collection::vec(
                (0u64..20, 0u64..1_000, proptest::option::of((1i64..100_000, 1u64..1_000))),
                1..200,
            ),
        ) {
            let mut g = Governor::new(BUDGET, ceiling);
            let mut t = Instant::now();
            for (ms, gap_ms, batch) in probes {
                t += Duration::from_millis(gap_ms);
                if let Some((rows, took)) = batch {
                    g.worked(rows, Duration::from_millis(took));
                }
                let before = g.rate();
                let p = g.observe(Duration::from_millis(ms), t);
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
