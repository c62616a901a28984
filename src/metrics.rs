//! Prometheus metrics of one replica, rendered in the text exposition format by `/metrics`. Labels are only
//! `job`, `shard`, `result` and `reason` — never dates or ids, so the number of series stays fixed.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{
        atomic::{AtomicI64, Ordering},
        Arc, Mutex, OnceLock,
    },
};

use crate::sdnotify::Watchdog;

/// Every metric the binary exports: name, type, help. Alert rules and dashboards are checked against this list.
pub const DEFINITIONS: &[(&str, &str, &str)] = &[
    (
        "fine_settler_claims_total",
        "counter",
        "Claim attempts by result: won (new key), takeover (also forced), reopened, skipped.",
    ),
    (
        "fine_settler_lease_lost_total",
        "counter",
        "Runs that found their key taken over by another replica.",
    ),
    (
        "fine_settler_runs_total",
        "counter",
        "Runs by result: settled, skipped, failed, lease_lost.",
    ),
    (
        "fine_settler_run_duration_seconds",
        "summary",
        "Time from claim to finish of runs that claimed their key.",
    ),
    (
        "fine_settler_rows_scanned_total",
        "counter",
        "Rows read by committed batches.",
    ),
    (
        "fine_settler_rows_updated_total",
        "counter",
        "Rows written by committed batches.",
    ),
    ("fine_settler_ticks_total", "counter", "Scheduler ticks run."),
    (
        "fine_settler_tick_errors_total",
        "counter",
        "Tick attempts that could not read their status (database unreachable).",
    ),
    (
        "fine_settler_slots_dropped_total",
        "counter",
        "Triggers dropped because their slot was already processed.",
    ),
    (
        "fine_settler_slots_merged_total",
        "counter",
        "Missed slots covered by a later tick.",
    ),
    (
        "fine_settler_slot_rebases_total",
        "counter",
        "Ticks that fell more than max_catch_up slots behind and re-based.",
    ),
    (
        "fine_settler_due_unsettled",
        "gauge",
        "Due business dates not SUCCESS for this shard after the last tick.",
    ),
    (
        "fine_settler_pending",
        "gauge",
        "Charges waiting in the compensation queue for this shard.",
    ),
    (
        "fine_settler_pending_dead",
        "gauge",
        "DEAD charges of this shard, waiting for an operator.",
    ),
    (
        "fine_settler_clock_skew_seconds",
        "gauge",
        "This host's clock minus the database's, at the last tick.",
    ),
    (
        "fine_settler_last_success_timestamp_seconds",
        "gauge",
        "Unix time of the last run that settled its key.",
    ),
    (
        "fine_settler_late_rows_total",
        "counter",
        "Rows settled or charged by re-opened keys: returns back-dated into a settled month, rows left locked.",
    ),
    (
        "fine_settler_keys_abandoned_total",
        "counter",
        "Keys that left their catch-up window without succeeding (each counted once per process).",
    ),
    (
        "fine_settler_paused",
        "gauge",
        "1 while a pause (fine-settler pause) covers this replica's shard of the job, else 0.",
    ),
    (
        "fine_settler_throttled_seconds_total",
        "counter",
        "Time batches waited for the throttle, by reason: rate (max_rows_per_second), replica_lag.",
    ),
    (
        "fine_settler_compensation_errors_total",
        "counter",
        "Compensation passes that failed with an error other than a rejected charge.",
    ),
    (
        "fine_settler_last_progress_timestamp_seconds",
        "gauge",
        "Unix time of the replica's last progress (tick, batch or retry).",
    ),
];

/// The replica's metrics; cheap to update from any task.
#[derive(Debug)]
pub struct Metrics {
    shard: String,
    series: Mutex<BTreeMap<(&'static str, String), f64>>,
    last_progress_ms: AtomicI64,
    /// When the last tick read its status (unix ms; 0: none yet), for the status page.
    last_tick_ms: AtomicI64,
    /// The systemd watchdog, fed by [`Metrics::progress`] and [`Metrics::alive`].
    watchdog: OnceLock<Arc<Watchdog>>,
}

impl Metrics {
    /// Metrics of the replica owning `shard` (rendered as `shard="S/N"`).
    pub fn new(shard: String) -> Self {
        Metrics {
            shard,
            series: Mutex::new(BTreeMap::new()),
            last_progress_ms: AtomicI64::new(0),
            last_tick_ms: AtomicI64::new(0),
            watchdog: OnceLock::new(),
        }
    }

    fn labels(&self, job: Option<&str>, result: Option<&str>) -> String {
        self.labels_with(job, result.map(|r| ("result", r)))
    }

    fn labels_with(&self, job: Option<&str>, extra: Option<(&str, &str)>) -> String {
        let mut l = String::new();
        if let Some(job) = job {
            let _ = write!(l, "job=\"{job}\",");
        }
        let _ = write!(l, "shard=\"{}\"", self.shard);
        if let Some((name, value)) = extra {
            let _ = write!(l, ",{name}=\"{value}\"");
        }
        l
    }

    fn apply(&self, name: &'static str, labels: String, f: impl FnOnce(&mut f64)) {
        if let Ok(mut series) = self.series.lock() {
            f(series.entry((name, labels)).or_insert(0.0));
        }
    }

    /// Adds `by` to a counter.
    pub fn add(&self, name: &'static str, job: Option<&str>, result: Option<&str>, by: f64) {
        self.apply(name, self.labels(job, result), |v| *v += by);
    }

    /// Adds `by` to a counter labelled by `reason`.
    pub fn add_reason(&self, name: &'static str, job: Option<&str>, reason: &str, by: f64) {
        self.apply(name, self.labels_with(job, Some(("reason", reason))), |v| {
            *v += by
        });
    }

    /// Sets a gauge.
    pub fn set(&self, name: &'static str, job: Option<&str>, value: f64) {
        self.apply(name, self.labels(job, None), |v| *v = value);
    }

    /// Records one observation of a summary (its `_sum` and `_count`).
    pub fn observe(&self, name: &'static str, job: Option<&str>, value: f64) {
        let labels = self.labels(job, None);
        self.apply(name, format!("sum|{labels}"), |v| *v += value);
        self.apply(name, format!("count|{labels}"), |v| *v += 1.0);
    }

    /// Notes that the replica made progress at `unix_ms` (a tick, a batch, a retry).
    pub fn progress(&self, unix_ms: i64) {
        self.last_progress_ms.fetch_max(unix_ms, Ordering::Relaxed);
        self.alive();
    }

    /// Notes that the replica's loop is alive (a wake of the scheduler loop, or progress): pets the systemd
    /// watchdog, if one is attached. Not progress for `/healthz`.
    pub fn alive(&self) {
        if let Some(dog) = self.watchdog.get() {
            dog.pet();
        }
    }

    /// Routes liveness to the systemd watchdog from now on.
    pub fn attach_watchdog(&self, dog: Arc<Watchdog>) {
        let _ = self.watchdog.set(dog);
    }

    /// Notes progress now (by the host clock: this is observability, not business time).
    pub fn progress_now(&self) {
        self.progress(unix_now_ms());
    }

    /// Unix time in ms of the last progress (0: none yet).
    pub fn last_progress_ms(&self) -> i64 {
        self.last_progress_ms.load(Ordering::Relaxed)
    }

    /// Notes that a tick read its status now (host clock).
    pub fn ticked_now(&self) {
        self.last_tick_ms.fetch_max(unix_now_ms(), Ordering::Relaxed);
    }

    /// Unix time in ms of the last tick that read its status (0: none yet).
    pub fn last_tick_ms(&self) -> i64 {
        self.last_tick_ms.load(Ordering::Relaxed)
    }

    /// The current value of a gauge (or counter) without `result` label, if it was ever set.
    pub fn value(&self, name: &str, job: Option<&str>) -> Option<f64> {
        let labels = self.labels(job, None);
        let series = self.series.lock().ok()?;
        series
            .iter()
            .find(|((n, l), _)| *n == name && *l == labels)
            .map(|(_, v)| *v)
    }

    /// The Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let series = self.series.lock().map(|s| s.clone()).unwrap_or_default();
        for (name, kind, help) in DEFINITIONS {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            if *name == "fine_settler_last_progress_timestamp_seconds" {
                let ms = self.last_progress_ms();
                let _ = writeln!(
                    out,
                    "{name}{{{}}} {}",
                    self.labels(None, None),
                    ms as f64 / 1000.0
                );
                continue;
            }
            for ((n, labels), value) in series.iter().filter(|((n, _), _)| n == name) {
                match labels.split_once('|') {
                    Some((part, labels)) => {
                        let _ = writeln!(out, "{n}_{part}{{{labels}}} {value}");
                    }
                    None => {
                        let _ = writeln!(out, "{n}{{{labels}}} {value}");
                    }
                }
            }
        }
        out
    }
}

/// The host clock as Unix milliseconds.
pub fn unix_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_gauges_and_summaries_with_fixed_labels() {
        let m = Metrics::new("1/3".into());
        m.add(
            "fine_settler_claims_total",
            Some("fine-settlement"),
            Some("won"),
            1.0,
        );
        m.add(
            "fine_settler_claims_total",
            Some("fine-settlement"),
            Some("won"),
            1.0,
        );
        m.set("fine_settler_pending", None, 4.0);
        m.observe("fine_settler_run_duration_seconds", Some("overdue-accrual"), 0.5);
        m.progress(1_700_000_000_000);
        let text = m.render();
        assert!(
            text.contains(
                "fine_settler_claims_total{job=\"fine-settlement\",shard=\"1/3\",result=\"won\"} 2"
            ),
            "{text}"
        );
        assert!(text.contains("fine_settler_pending{shard=\"1/3\"} 4"), "{text}");
        assert!(
            text.contains("fine_settler_run_duration_seconds_sum{job=\"overdue-accrual\",shard=\"1/3\"} 0.5"),
            "{text}"
        );
        assert!(
            text.contains("fine_settler_run_duration_seconds_count{job=\"overdue-accrual\",shard=\"1/3\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("fine_settler_last_progress_timestamp_seconds{shard=\"1/3\"} 1700000000"),
            "{text}"
        );
        assert_eq!(text.matches("# TYPE").count(), DEFINITIONS.len());
    }

    #[test]
    fn the_status_page_reads_gauges_and_the_last_tick() {
        let m = Metrics::new("0/2".into());
        assert_eq!(m.value("fine_settler_clock_skew_seconds", None), None);
        assert_eq!(m.last_tick_ms(), 0);
        m.set("fine_settler_clock_skew_seconds", None, -0.25);
        m.set("fine_settler_due_unsettled", Some("fine-settlement"), 2.0);
        assert_eq!(m.value("fine_settler_clock_skew_seconds", None), Some(-0.25));
        assert_eq!(
            m.value("fine_settler_due_unsettled", Some("fine-settlement")),
            Some(2.0)
        );
        assert_eq!(
            m.value("fine_settler_due_unsettled", Some("overdue-accrual")),
            None
        );
        m.ticked_now();
        assert!(m.last_tick_ms() > 1_700_000_000_000);
    }
}
