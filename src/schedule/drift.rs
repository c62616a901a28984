//! `fine-settler drift`: runs the real scheduler against the system clock with simulated work and reports how
//! far each tick started from its ideal time — fixed-rate stays on its grid, fixed-delay drifts by the work time
//! every tick, and fixed-rate work slower than its period is merged rather than burst.

use std::{fmt::Write as _, sync::Arc, time::Duration};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{
    scheduler::{Scheduler, SlotStats},
    Schedule, SystemWall, WallClock,
};
use crate::config::ScheduleMode;

/// One tick as measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Start, in ms after the first tick's ideal start.
    pub start_ms: f64,
    /// The ideal start: tick index × period.
    pub ideal_ms: f64,
    pub merged: u64,
}

/// The measurements of a drift run.
#[derive(Debug, Clone)]
pub struct DriftReport {
    pub mode: &'static str,
    pub period: Duration,
    pub work: Duration,
    pub samples: Vec<Sample>,
    pub stats: SlotStats,
}

/// Runs `ticks` ticks of the real scheduler with `work` of simulated work each. Fixed-rate starts on the next
/// grid slot; fixed-delay starts at once.
pub async fn measure(fixed_rate: bool, period: Duration, work: Duration, ticks: usize) -> DriftReport {
    let mode = if fixed_rate {
        ScheduleMode::FixedRate(period)
    } else {
        ScheduleMode::FixedDelay(period)
    };
    let wall: Arc<dyn WallClock> = Arc::new(SystemWall);
    let mut scheduler = Scheduler::new(Schedule::new(mode, chrono_tz::UTC), 3, wall, !fixed_rate);
    let (notify, cancel) = (Notify::new(), CancellationToken::new());
    let mut samples = Vec::with_capacity(ticks);
    let mut origin = None;
    let period_ms = period.as_secs_f64() * 1e3;
    while samples.len() < ticks {
        let Some(tick) = scheduler.next(&notify, &cancel).await else {
            break;
        };
        // The ideal start of the first tick: its slot's start for fixed-rate, the first tick itself otherwise.
        let origin_ms = *origin.get_or_insert_with(|| {
            if fixed_rate {
                tick.slot as f64 * period_ms
            } else {
                tick.at.timestamp_micros() as f64 / 1e3
            }
        });
        let start_ms = tick.at.timestamp_micros() as f64 / 1e3 - origin_ms;
        samples.push(Sample {
            start_ms,
            ideal_ms: samples.len() as f64 * period_ms,
            merged: tick.merged,
        });
        tokio::time::sleep(work).await;
        scheduler.finished();
    }
    DriftReport {
        mode: if fixed_rate { "fixed-rate" } else { "fixed-delay" },
        period,
        work,
        samples,
        stats: scheduler.stats(),
    }
}

fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[rank.min(v.len() - 1)]
}

impl DriftReport {
    /// Lag of each tick behind its ideal start, in ms.
    pub fn lags(&self) -> Vec<f64> {
        self.samples.iter().map(|s| s.start_ms - s.ideal_ms).collect()
    }

    /// |gap to the previous tick − period|, in ms.
    pub fn interval_errors(&self) -> Vec<f64> {
        let period_ms = self.period.as_secs_f64() * 1e3;
        self.samples
            .windows(2)
            .map(|w| ((w[1].start_ms - w[0].start_ms) - period_ms).abs())
            .collect()
    }

    /// The table and the summary line.
    pub fn render(&self, rows: usize) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "== {} period={} work={} ==",
            self.mode,
            humantime::format_duration(self.period),
            humantime::format_duration(self.work)
        );
        let _ = writeln!(
            out,
            "{:>6} {:>10} {:>10} {:>10} {:>10} {:>7}",
            "tick", "start", "ideal", "lag", "gap", "merged"
        );
        let shown = self.samples.len().min(rows);
        for (i, s) in self.samples.iter().enumerate().take(shown) {
            let gap = if i == 0 {
                "-".to_string()
            } else {
                format!("{:.1}ms", s.start_ms - self.samples[i - 1].start_ms)
            };
            let _ = writeln!(
                out,
                "{:>6} {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>10} {:>7}",
                i + 1,
                s.start_ms,
                s.ideal_ms,
                s.start_ms - s.ideal_ms,
                gap,
                s.merged
            );
        }
        if self.samples.len() > shown {
            let _ = writeln!(out, "   ... {} more ticks", self.samples.len() - shown);
        }
        let (lags, errors) = (self.lags(), self.interval_errors());
        let _ = writeln!(
            out,
            "summary: ticks={} lag p50={:.1}ms p99={:.1}ms max={:.1}ms; interval error p50={:.1}ms max={:.1}ms; \
             merged slots={} rebases={} dropped={}",
            self.samples.len(),
            percentile(&lags, 50.0),
            percentile(&lags, 99.0),
            lags.iter().copied().fold(0.0, f64::max),
            percentile(&errors, 50.0),
            errors.iter().copied().fold(0.0, f64::max),
            self.stats.merged,
            self.stats.rebased,
            self.stats.dropped,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 100.0), 5.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn lags_and_interval_errors() {
        let r = DriftReport {
            mode: "fixed-delay",
            period: Duration::from_millis(200),
            work: Duration::from_millis(80),
            samples: vec![
                Sample {
                    start_ms: 0.0,
                    ideal_ms: 0.0,
                    merged: 0,
                },
                Sample {
                    start_ms: 282.0,
                    ideal_ms: 200.0,
                    merged: 0,
                },
                Sample {
                    start_ms: 565.0,
                    ideal_ms: 400.0,
                    merged: 0,
                },
            ],
            stats: SlotStats::default(),
        };
        assert_eq!(r.lags(), vec![0.0, 82.0, 165.0]);
        assert_eq!(r.interval_errors(), vec![82.0, 83.0]);
        assert!(r.render(10).contains("lag p50=82.0ms"));
    }
}
