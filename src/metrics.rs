//! Prometheus metrics of one replica: typed families (`prometheus-client`) registered once in [`Metrics`], and
//! rendered in the text exposition format (0.0.4) by `/metrics`. Labels are only `job`, `shard`, `result` and
//! `reason` — never dates or ids, so the number of series stays fixed — and every label value but the shard
//! comes from a closed set (an enum), so neither a metric nor a label value can be misspelt at a call site.
//!
//! Decisions:
//! - The names in this file are the exported ones (`fine_settler_claims_total`). prometheus-client appends
//!   `_total` to a counter's name itself, so [`Builder::add`] registers a counter without it; and it appends a
//!   full stop to every help text, so the help texts here are registered without theirs.
//! - The run duration was a summary (`_sum` and `_count` only); prometheus-client has no summary, so it is a
//!   histogram with fixed buckets ([`RUN_DURATION_BUCKETS`]): `_sum` and `_count` are still there, and
//!   `histogram_quantile` works on its `_bucket` series.
//! - `shard` is a label of every series (as `"S/N"`), written after `job` and before `result` / `reason`, as it
//!   always was; the label sets below keep that order.
//! - A replica's series that an alert watches with `increase()` exist with 0 from its start
//!   ([`Metrics::with_watched_series_at_zero`]), so that their first increase is seen. Other families appear with
//!   their first series (an empty family exports nothing, not even its `# HELP`).
//! - Liveness (the last progress, the systemd watchdog) is not kept here but in [`crate::health::Heartbeat`]; its
//!   last progress is exported as `fine_settler_last_progress_timestamp_seconds` through a shared [`UnixTime`].

use std::{
    collections::BTreeSet,
    fmt,
    sync::{
        atomic::{AtomicI64, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use prometheus_client::{
    encoding::{
        prometheus_text, EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder, MetricEncoder,
    },
    metrics::{
        counter::Counter, family::Family, gauge::Gauge, histogram::Histogram, MetricType, TypedMetric,
    },
    registry::{Metric, Registry},
};

use crate::{
    jobs::{throttle::Reason, JobName, Outcome},
    schedule::{scheduler::SlotStats, CLOCK_STEP_TOLERANCE},
    store::{
        corrections::Reason as CorrectionReason,
        job_runs::{ClaimKind, Unclaimed},
    },
};

/// Upper bounds (seconds) of the run duration histogram's buckets: from a run that found little to do to a month
/// of a large shard, which takes tens of minutes.
pub const RUN_DURATION_BUCKETS: [f64; 12] = [
    0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];

/// How a claim attempt ended: the `result` label of `fine_settler_claims_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClaimResult {
    /// A new key (inserted with epoch 1).
    Won,
    /// A FAILED or expired key taken over, or an operator's forced re-run.
    Takeover,
    /// A SUCCESS key re-opened for rows that arrived after its run.
    Reopened,
    /// Someone finished the key, or a live owner holds it.
    Skipped,
}

impl From<ClaimKind> for ClaimResult {
    fn from(kind: ClaimKind) -> Self {
        match kind {
            ClaimKind::Inserted => ClaimResult::Won,
            ClaimKind::Reopened => ClaimResult::Reopened,
            ClaimKind::TakenOver | ClaimKind::Forced => ClaimResult::Takeover,
        }
    }
}

impl ClaimResult {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimResult::Won => "won",
            ClaimResult::Takeover => "takeover",
            ClaimResult::Reopened => "reopened",
            ClaimResult::Skipped => "skipped",
        }
    }
}

/// The label values of the closed sets are the names the product already uses (reports, logs, config).
macro_rules! label_value_from_as_str {
    ($($t:ty),*) => {$(
        impl EncodeLabelValue for $t {
            fn encode(&self, encoder: &mut LabelValueEncoder) -> fmt::Result {
                fmt::Write::write_str(encoder, self.as_str())
            }
        }
    )*};
}

label_value_from_as_str!(JobName, Outcome, Reason, ClaimResult, CorrectionReason);

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ShardLabels {
    shard: Arc<str>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct JobLabels {
    job: JobName,
    shard: Arc<str>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RunLabels {
    job: JobName,
    shard: Arc<str>,
    result: Outcome,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ClaimLabels {
    job: JobName,
    shard: Arc<str>,
    result: ClaimResult,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ThrottleLabels {
    job: JobName,
    shard: Arc<str>,
    reason: Reason,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CorrectionLabels {
    job: JobName,
    shard: Arc<str>,
    reason: CorrectionReason,
}

/// A Unix time in milliseconds that only moves forward, exported as a gauge of seconds. Clones share the value,
/// so the one who keeps the time (the heartbeat) and the registry that exports it hold the same clock.
#[derive(Debug, Clone, Default)]
pub struct UnixTime(Arc<AtomicI64>);

impl UnixTime {
    /// Moves the time to `unix_ms`, unless it is already a little later (two tasks may report out of order). A
    /// time more than [`CLOCK_STEP_TOLERANCE`] earlier is taken: the host clock stepped back, and keeping a time
    /// ahead of the clock would show a negative age and hide a stall until the clock caught up.
    pub fn advance_to(&self, unix_ms: i64) {
        let tolerance = i64::try_from(CLOCK_STEP_TOLERANCE.as_millis()).unwrap_or(i64::MAX);
        let _ = self.0.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
            (unix_ms > held || held.saturating_sub(unix_ms) > tolerance).then_some(unix_ms)
        });
    }

    /// The time in Unix milliseconds (0: never set).
    pub fn unix_ms(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl TypedMetric for UnixTime {
    const TYPE: MetricType = MetricType::Gauge;
}

impl EncodeMetric for UnixTime {
    fn encode(&self, mut encoder: MetricEncoder) -> fmt::Result {
        encoder.encode_gauge(&(self.unix_ms() as f64 / 1000.0))
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

type Counters<L> = Family<L, Counter>;
type Gauges<L> = Family<L, Gauge>;
type FloatGauges<L> = Family<L, Gauge<f64, AtomicU64>>;
type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn run_duration_histogram() -> Histogram {
    Histogram::new(RUN_DURATION_BUCKETS)
}

/// Registers families, keeping each one's exported name and type.
#[derive(Debug, Default)]
struct Builder {
    registry: Registry,
    families: Vec<(&'static str, MetricType)>,
}

impl Builder {
    /// Registers `metric` as `name` (the exported name: a counter's ends in `_total`) with `help`.
    fn add<M: Metric + Clone>(&mut self, name: &'static str, help: &str, metric: M) -> M {
        let kind = metric.metric_type();
        let registered = match kind {
            MetricType::Counter => name.strip_suffix("_total").unwrap_or(name),
            _ => name,
        };
        self.registry
            .register(registered, help.strip_suffix('.').unwrap_or(help), metric.clone());
        self.families.push((name, kind));
        metric
    }
}

/// The families of a run: claims, outcomes, durations and rows.
#[derive(Debug)]
struct RunFamilies {
    claims: Counters<ClaimLabels>,
    lease_lost: Counters<JobLabels>,
    runs: Counters<RunLabels>,
    run_duration: Histograms<JobLabels>,
    rows_scanned: Counters<JobLabels>,
    rows_updated: Counters<JobLabels>,
    last_success: FloatGauges<JobLabels>,
    late_rows: Counters<JobLabels>,
    corrections: Counters<CorrectionLabels>,
}

/// The families of the throttle: time waited, and the pace `throttle.max_commit_latency` adapts.
#[derive(Debug)]
struct PaceFamilies {
    throttled: Family<ThrottleLabels, Counter<f64, AtomicU64>>,
    commit_latency: FloatGauges<ShardLabels>,
    commit_latency_budget: FloatGauges<ShardLabels>,
    pace_rate: FloatGauges<ShardLabels>,
}

impl RunFamilies {
    fn register(b: &mut Builder) -> Self {
        RunFamilies {
            claims: b.add(
                "fine_settler_claims_total",
                "Claim attempts by result: won (new key), takeover (also forced), reopened, skipped.",
                Family::default(),
            ),
            lease_lost: b.add(
                "fine_settler_lease_lost_total",
                "Runs that found their key taken over by another replica.",
                Family::default(),
            ),
            runs: b.add(
                "fine_settler_runs_total",
                "Runs by result: settled, skipped, failed, lease_lost.",
                Family::default(),
            ),
            run_duration: b.add(
                "fine_settler_run_duration_seconds",
                "Time from claim to finish of runs that claimed their key.",
                Family::new_with_constructor(run_duration_histogram as fn() -> Histogram),
            ),
            rows_scanned: b.add(
                "fine_settler_rows_scanned_total",
                "Rows read by committed batches.",
                Family::default(),
            ),
            rows_updated: b.add(
                "fine_settler_rows_updated_total",
                "Rows written by committed batches.",
                Family::default(),
            ),
            last_success: b.add(
                "fine_settler_last_success_timestamp_seconds",
                "Unix time of the last run that settled its key.",
                Family::default(),
            ),
            late_rows: b.add(
                "fine_settler_late_rows_total",
                "Rows settled or charged by re-opened keys: returns back-dated into a settled month, rows left \
                 locked.",
                Family::default(),
            ),
            corrections: b.add(
                "fine_settler_ledger_corrections_total",
                "Ledger corrections appended by committed batches, by reason: returned, due-date-moved, cap, \
                 reinstated, canonical.",
                Family::default(),
            ),
        }
    }
}

impl PaceFamilies {
    fn register(b: &mut Builder) -> Self {
        PaceFamilies {
            throttled: b.add(
                "fine_settler_throttled_seconds_total",
                "Time batches waited for the throttle, by reason: rate (max_rows_per_second), replica_lag, \
                 commit_latency (the pace max_commit_latency adapts).",
                Family::default(),
            ),
            commit_latency: b.add(
                "fine_settler_throttle_commit_latency_seconds",
                "The last commit latency probe of the throttle (max_commit_latency).",
                Family::default(),
            ),
            commit_latency_budget: b.add(
                "fine_settler_throttle_commit_latency_budget_seconds",
                "throttle.max_commit_latency, once a run has probed against it.",
                Family::default(),
            ),
            pace_rate: b.add(
                "fine_settler_throttle_rate_rows_per_second",
                "The pace max_commit_latency adapted to, after the last probe.",
                Family::default(),
            ),
        }
    }
}

/// The families of the replica's loop: ticks, slots, what is due, the queue, pauses and the clock.
#[derive(Debug)]
struct TickFamilies {
    ticks: Counters<ShardLabels>,
    tick_errors: Counters<ShardLabels>,
    slots_dropped: Counters<ShardLabels>,
    slots_merged: Counters<ShardLabels>,
    slot_rebases: Counters<ShardLabels>,
    clock_steps: Counters<ShardLabels>,
    due_unsettled: Gauges<JobLabels>,
    keys_unclaimed: Gauges<JobLabels>,
    pending: Gauges<ShardLabels>,
    pending_dead: Gauges<ShardLabels>,
    clock_skew: FloatGauges<ShardLabels>,
    keys_abandoned: Counters<JobLabels>,
    paused: Gauges<JobLabels>,
    compensation_errors: Counters<ShardLabels>,
    recheck_errors: Counters<ShardLabels>,
    recheck_queued: Gauges<ShardLabels>,
    ledger_orphans: Counters<ShardLabels>,
    last_progress: Family<ShardLabels, UnixTime>,
}

impl TickFamilies {
    fn register(b: &mut Builder) -> Self {
        TickFamilies {
            ticks: b.add(
                "fine_settler_ticks_total",
                "Scheduler ticks run.",
                Family::default(),
            ),
            tick_errors: b.add(
                "fine_settler_tick_errors_total",
                "Tick attempts that failed (database unreachable or read-only, a statement timeout, a missing table).",
                Family::default(),
            ),
            slots_dropped: b.add(
                "fine_settler_slots_dropped_total",
                "Triggers dropped because their slot was already processed.",
                Family::default(),
            ),
            slots_merged: b.add(
                "fine_settler_slots_merged_total",
                "Missed slots covered by a later tick.",
                Family::default(),
            ),
            slot_rebases: b.add(
                "fine_settler_slot_rebases_total",
                "Ticks that re-based: more than max_catch_up slots behind, or after a step of the host clock.",
                Family::default(),
            ),
            clock_steps: b.add(
                "fine_settler_clock_steps_total",
                "Steps of the host clock (back or ahead, or a suspend) the scheduler saw and re-based on.",
                Family::default(),
            ),
            due_unsettled: b.add(
                "fine_settler_due_unsettled",
                "Due business dates not SUCCESS for this shard after the last tick.",
                Family::default(),
            ),
            keys_unclaimed: b.add(
                "fine_settler_keys_unclaimed",
                "Due keys of the other shards of this shard count that nobody runs (no row, or no live owner for longer than the lease), at the last tick.",
                Family::default(),
            ),
            pending: b.add(
                "fine_settler_pending",
                "Charges waiting in the compensation queue for this shard.",
                Family::default(),
            ),
            pending_dead: b.add(
                "fine_settler_pending_dead",
                "DEAD charges of this shard, waiting for an operator.",
                Family::default(),
            ),
            clock_skew: b.add(
                "fine_settler_clock_skew_seconds",
                "This host's clock minus the database's, at the last tick.",
                Family::default(),
            ),
            keys_abandoned: b.add(
                "fine_settler_keys_abandoned_total",
                "Keys that left their catch-up window without succeeding (each counted once per process).",
                Family::default(),
            ),
            paused: b.add(
                "fine_settler_paused",
                "1 while a pause (fine-settler pause) covers this replica's shard of the job, else 0.",
                Family::default(),
            ),
            compensation_errors: b.add(
                "fine_settler_compensation_errors_total",
                "Compensation passes that failed with an error other than a rejected charge.",
                Family::default(),
            ),
            recheck_errors: b.add(
                "fine_settler_recheck_errors_total",
                "Accrual re-checks that failed or ran out of time (settlement and accrual of due keys go on).",
                Family::default(),
            ),
            recheck_queued: b.add(
                "fine_settler_recheck_changed_loans",
                "Changed loans of the shard whose ledger the last accrual re-check found still to charge or correct.",
                Family::default(),
            ),
            ledger_orphans: b.add(
                "fine_settler_ledger_orphans_total",
                "Loans with ledger rows that libraryd deleted: nothing is corrected for them.",
                Family::default(),
            ),
            last_progress: b.add(
                "fine_settler_last_progress_timestamp_seconds",
                "Unix time of the replica's last progress (tick, batch or retry).",
                Family::default(),
            ),
        }
    }
}

const JOBS: [JobName; 2] = [JobName::FineSettlement, JobName::OverdueAccrual];

/// The replica's metrics; cheap to update from any task.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Every family's exported name and type, in registration order.
    families: Vec<(&'static str, MetricType)>,
    shard: Arc<str>,
    run: RunFamilies,
    pace: PaceFamilies,
    tick: TickFamilies,
}

impl Metrics {
    /// Metrics of the replica owning `shard` (rendered as `shard="S/N"`); only the last progress has a series.
    pub fn new(shard: String) -> Self {
        let mut b = Builder::default();
        let run = RunFamilies::register(&mut b);
        let pace = PaceFamilies::register(&mut b);
        let tick = TickFamilies::register(&mut b);
        let metrics = Metrics {
            registry: b.registry,
            families: b.families,
            shard: shard.into(),
            run,
            pace,
            tick,
        };
        // 0 until the first progress, as it always was.
        metrics.last_progress();
        metrics
    }

    /// The same metrics with the series alerts watch at 0 (a replica's, from its start): the counters alerts
    /// watch with `increase()`, so that their first increase is seen, and the pause gauge.
    pub fn with_watched_series_at_zero(self) -> Self {
        // Creating a series is asking for it; the handle returned is not needed.
        for job in JOBS {
            let labels = self.job(job);
            self.tick.keys_abandoned.get_or_create_owned(&labels);
            self.run.late_rows.get_or_create_owned(&labels);
            self.tick.paused.get_or_create_owned(&labels);
            for reason in [Reason::Rate, Reason::ReplicaLag, Reason::CommitLatency] {
                self.pace
                    .throttled
                    .get_or_create_owned(&self.throttle(job, reason));
            }
        }
        self.tick
            .compensation_errors
            .get_or_create_owned(&self.only_shard());
        self.tick.recheck_errors.get_or_create_owned(&self.only_shard());
        for reason in CorrectionReason::ALL {
            self.run
                .corrections
                .get_or_create_owned(&self.correction(JobName::OverdueAccrual, reason));
        }
        self
    }

    fn correction(&self, job: JobName, reason: CorrectionReason) -> CorrectionLabels {
        CorrectionLabels {
            job,
            shard: self.shard.clone(),
            reason,
        }
    }

    fn only_shard(&self) -> ShardLabels {
        ShardLabels {
            shard: self.shard.clone(),
        }
    }

    fn job(&self, job: JobName) -> JobLabels {
        JobLabels {
            job,
            shard: self.shard.clone(),
        }
    }

    fn throttle(&self, job: JobName, reason: Reason) -> ThrottleLabels {
        ThrottleLabels {
            job,
            shard: self.shard.clone(),
            reason,
        }
    }

    /// Counts a claim attempt of `job`.
    pub fn count_claim(&self, job: JobName, result: ClaimResult) {
        let labels = ClaimLabels {
            job,
            shard: self.shard.clone(),
            result,
        };
        self.run.claims.get_or_create(&labels).inc();
    }

    /// Counts a run of `job` that ended with `outcome` (and a lost lease, if it was).
    pub fn count_run(&self, job: JobName, outcome: Outcome) {
        let labels = RunLabels {
            job,
            shard: self.shard.clone(),
            result: outcome,
        };
        self.run.runs.get_or_create(&labels).inc();
        if outcome == Outcome::LeaseLost {
            self.run.lease_lost.get_or_create(&self.job(job)).inc();
        }
    }

    /// Records the claim-to-finish time of a run of `job` that claimed its key.
    pub fn observe_run_duration(&self, job: JobName, seconds: f64) {
        self.run
            .run_duration
            .get_or_create(&self.job(job))
            .observe(seconds);
    }

    /// Notes that a run of `job` settled its key at `unix_seconds`.
    pub fn set_last_success(&self, job: JobName, unix_seconds: f64) {
        self.run
            .last_success
            .get_or_create(&self.job(job))
            .set(unix_seconds);
    }

    /// Counts the rows a committed batch of `job` read and wrote.
    pub fn count_rows(&self, job: JobName, scanned: i64, updated: i64) {
        let labels = self.job(job);
        self.run
            .rows_scanned
            .get_or_create(&labels)
            .inc_by(count(scanned));
        self.run
            .rows_updated
            .get_or_create(&labels)
            .inc_by(count(updated));
    }

    /// Counts the rows a re-opened key of `job` settled or charged.
    pub fn count_late_rows(&self, job: JobName, rows: i64) {
        self.run
            .late_rows
            .get_or_create(&self.job(job))
            .inc_by(count(rows));
    }

    /// Adds the time a batch of `job` waited for the throttle, for `reason`.
    pub fn add_throttled(&self, job: JobName, reason: Reason, seconds: f64) {
        self.pace
            .throttled
            .get_or_create(&self.throttle(job, reason))
            .inc_by(seconds);
    }

    /// Sets the last commit latency probe, its budget and the pace it led to (rows per second).
    pub fn set_commit_latency(&self, latency: Duration, budget: Duration, rate: f64) {
        let labels = self.only_shard();
        self.pace
            .commit_latency
            .get_or_create(&labels)
            .set(latency.as_secs_f64());
        self.pace
            .commit_latency_budget
            .get_or_create(&labels)
            .set(budget.as_secs_f64());
        self.pace.pace_rate.get_or_create(&labels).set(rate);
    }

    /// Counts a tick that read its status.
    pub fn count_tick(&self) {
        self.tick.ticks.get_or_create(&self.only_shard()).inc();
    }

    /// Counts a tick attempt that could not read its status.
    pub fn count_tick_error(&self) {
        self.tick.tick_errors.get_or_create(&self.only_shard()).inc();
    }

    /// Brings the slot counters up to the scheduler's totals since start (dropped triggers, merged slots,
    /// re-bases, steps of the host clock): the scheduler keeps totals, a counter only goes up.
    pub fn set_slot_totals(&self, stats: SlotStats) {
        let labels = self.only_shard();
        for (family, total) in [
            (&self.tick.slots_dropped, stats.dropped),
            (&self.tick.slots_merged, stats.merged),
            (&self.tick.slot_rebases, stats.rebased),
            (&self.tick.clock_steps, stats.clock_steps),
        ] {
            let counter = family.get_or_create(&labels);
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }

    /// Sets how many due business dates of `job` are not SUCCESS after the tick.
    pub fn set_due_unsettled(&self, job: JobName, dates: usize) {
        let dates = i64::try_from(dates).unwrap_or(i64::MAX);
        self.tick.due_unsettled.get_or_create(&self.job(job)).set(dates);
    }

    /// Sets the due keys of the other shards nobody runs, per job, as the last tick's status read them.
    pub fn set_keys_unclaimed(&self, unclaimed: Unclaimed) {
        for job in [JobName::FineSettlement, JobName::OverdueAccrual] {
            self.tick
                .keys_unclaimed
                .get_or_create(&self.job(job))
                .set(unclaimed.of(job));
        }
    }

    /// Sets the shard's PENDING and DEAD charges.
    pub fn set_pending(&self, pending: i64, dead: i64) {
        let labels = self.only_shard();
        self.tick.pending.get_or_create(&labels).set(pending);
        self.tick.pending_dead.get_or_create(&labels).set(dead);
    }

    /// Sets this host's clock minus the database's.
    pub fn set_clock_skew(&self, seconds: f64) {
        self.tick
            .clock_skew
            .get_or_create(&self.only_shard())
            .set(seconds);
    }

    /// This host's clock minus the database's at the last tick, if a tick measured it.
    pub fn clock_skew(&self) -> Option<f64> {
        self.tick.clock_skew.get(&self.only_shard()).map(|g| g.get())
    }

    /// Counts a key of `job` that left its catch-up window without succeeding.
    pub fn count_key_abandoned(&self, job: JobName) {
        self.tick.keys_abandoned.get_or_create(&self.job(job)).inc();
    }

    /// Sets whether a pause covers this shard of `job`.
    pub fn set_paused(&self, job: JobName, paused: bool) {
        self.tick
            .paused
            .get_or_create(&self.job(job))
            .set(i64::from(paused));
    }

    /// Counts a compensation pass that failed.
    pub fn count_compensation_error(&self) {
        self.tick
            .compensation_errors
            .get_or_create(&self.only_shard())
            .inc();
    }

    /// Counts the corrections a committed batch of `job` appended, by reason.
    pub fn count_corrections(&self, job: JobName, corrected: &crate::store::corrections::Corrected) {
        for (reason, n) in &corrected.0 {
            self.run
                .corrections
                .get_or_create(&self.correction(job, *reason))
                .inc_by(*n);
        }
    }

    /// Counts an accrual re-check that failed or ran out of time.
    pub fn count_recheck_error(&self) {
        self.tick.recheck_errors.get_or_create(&self.only_shard()).inc();
    }

    /// What the last accrual re-check found: changed loans still to charge or correct, and loans libraryd
    /// deleted that have ledger rows (counted once each re-check that sees them).
    pub fn observe_recheck(&self, dirty: i64, orphaned: usize) {
        self.tick
            .recheck_queued
            .get_or_create(&self.only_shard())
            .set(dirty);
        self.tick
            .ledger_orphans
            .get_or_create(&self.only_shard())
            .inc_by(orphaned as u64);
    }

    /// The clock exported as `fine_settler_last_progress_timestamp_seconds` (see [`crate::health::Heartbeat`]).
    pub fn last_progress(&self) -> UnixTime {
        self.tick.last_progress.get_or_create_owned(&self.only_shard())
    }

    /// The Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String does not fail, and every label value is plain text: an error here is a bug, logged
        // rather than turned into a failed scrape.
        if let Err(e) = prometheus_text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "cannot encode the metrics");
        }
        out
    }

    /// The name of every series a family of this binary can export, whether or not it has one yet: a counter's
    /// `…_total`, a gauge's name, a histogram's `…_bucket`, `…_sum` and `…_count`. Alert rules and dashboards
    /// are checked against this.
    pub fn series_names(&self) -> BTreeSet<String> {
        self.families
            .iter()
            .flat_map(|&(name, kind)| match kind {
                MetricType::Histogram => ["_bucket", "_sum", "_count"]
                    .iter()
                    .map(|suffix| format!("{name}{suffix}"))
                    .collect::<Vec<_>>(),
                _ => vec![name.to_string()],
            })
            .collect()
    }
}

/// A row count as a counter increment (counts are never negative).
fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
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

    /// The names of the series in `text` (the exposition format).
    fn names_in(text: &str) -> BTreeSet<String> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next())
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn renders_counters_gauges_and_histograms_with_fixed_labels() {
        let m = Metrics::new("1/3".into());
        m.count_claim(JobName::FineSettlement, ClaimResult::Won);
        m.count_claim(JobName::FineSettlement, ClaimResult::Won);
        m.set_pending(4, 0);
        m.observe_run_duration(JobName::OverdueAccrual, 0.5);
        m.last_progress().advance_to(1_700_000_000_000);
        let text = m.render();
        for line in [
            "fine_settler_claims_total{job=\"fine-settlement\",shard=\"1/3\",result=\"won\"} 2",
            "fine_settler_pending{shard=\"1/3\"} 4",
            "fine_settler_run_duration_seconds_sum{job=\"overdue-accrual\",shard=\"1/3\"} 0.5",
            "fine_settler_run_duration_seconds_count{job=\"overdue-accrual\",shard=\"1/3\"} 1",
            "fine_settler_run_duration_seconds_bucket{job=\"overdue-accrual\",shard=\"1/3\",le=\"0.5\"} 1",
            "fine_settler_run_duration_seconds_bucket{job=\"overdue-accrual\",shard=\"1/3\",le=\"0.1\"} 0",
            "fine_settler_last_progress_timestamp_seconds{shard=\"1/3\"} 1700000000.0",
            "# HELP fine_settler_claims_total Claim attempts by result: won (new key), takeover (also forced), \
             reopened, skipped.",
            "# TYPE fine_settler_claims_total counter",
            "# TYPE fine_settler_run_duration_seconds histogram",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from:\n{text}");
        }
    }

    #[test]
    fn series_alerts_watch_exist_at_zero_from_the_start() {
        let bare = Metrics::new("0/2".into()).render();
        assert!(!bare.contains("fine_settler_paused"), "{bare}");
        let text = Metrics::new("0/2".into()).with_watched_series_at_zero().render();
        for line in [
            "fine_settler_keys_abandoned_total{job=\"fine-settlement\",shard=\"0/2\"} 0",
            "fine_settler_late_rows_total{job=\"overdue-accrual\",shard=\"0/2\"} 0",
            "fine_settler_compensation_errors_total{shard=\"0/2\"} 0",
            "fine_settler_recheck_errors_total{shard=\"0/2\"} 0",
            "fine_settler_ledger_corrections_total{job=\"overdue-accrual\",shard=\"0/2\",reason=\"returned\"} 0",
            "fine_settler_throttled_seconds_total{job=\"overdue-accrual\",shard=\"0/2\",reason=\"replica_lag\"} 0.0",
            "fine_settler_paused{job=\"fine-settlement\",shard=\"0/2\"} 0",
            "fine_settler_last_progress_timestamp_seconds{shard=\"0/2\"} 0.0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from:\n{text}");
        }
        assert!(!text.contains("fine_settler_claims_total"), "{text}");
    }

    #[test]
    fn every_family_exports_the_series_names_it_declares() {
        let m = Metrics::new("0/1".into());
        let job = JobName::FineSettlement;
        m.count_claim(job, ClaimResult::from(ClaimKind::Forced));
        m.count_run(job, Outcome::LeaseLost);
        m.observe_run_duration(job, 1.0);
        m.set_last_success(job, 1.0);
        m.count_rows(job, 2, 1);
        m.count_late_rows(job, 1);
        m.add_throttled(job, Reason::Rate, 0.25);
        m.set_commit_latency(Duration::from_millis(3), Duration::from_millis(5), 1250.0);
        m.count_tick();
        m.count_tick_error();
        m.set_slot_totals(SlotStats {
            ticks: 4,
            dropped: 1,
            merged: 2,
            rebased: 3,
            clock_steps: 1,
        });
        m.set_due_unsettled(job, 1);
        m.set_keys_unclaimed(Unclaimed {
            settlement: 2,
            accrual: 0,
        });
        m.set_pending(1, 1);
        m.set_clock_skew(0.5);
        m.count_key_abandoned(job);
        m.set_paused(job, true);
        m.count_compensation_error();
        m.count_recheck_error();
        m.observe_recheck(2, 1);
        m.count_corrections(
            job,
            &crate::store::corrections::Corrected([(CorrectionReason::Returned, 2)].into_iter().collect()),
        );
        let text = m.render();
        assert_eq!(names_in(&text), m.series_names(), "{text}");
        assert_eq!(m.families.len(), 31);
        assert!(
            text.contains("fine_settler_throttle_rate_rows_per_second{shard=\"0/1\"} 1250"),
            "{text}"
        );
        assert!(text.contains("result=\"takeover\""), "{text}");
        assert!(text.contains("fine_settler_lease_lost_total{job=\"fine-settlement\",shard=\"0/1\"} 1"));
        assert!(text.contains("fine_settler_paused{job=\"fine-settlement\",shard=\"0/1\"} 1"));
        assert!(text.contains("fine_settler_keys_unclaimed{job=\"fine-settlement\",shard=\"0/1\"} 2"));
        assert!(text.contains("fine_settler_keys_unclaimed{job=\"overdue-accrual\",shard=\"0/1\"} 0"));
    }

    #[test]
    fn slot_counters_follow_the_scheduler_totals() {
        let m = Metrics::new("0/1".into());
        let totals = |dropped, merged, rebased, clock_steps| SlotStats {
            ticks: 0,
            dropped,
            merged,
            rebased,
            clock_steps,
        };
        m.set_slot_totals(totals(2, 5, 0, 0));
        m.set_slot_totals(totals(3, 5, 1, 1));
        let text = m.render();
        for line in [
            "fine_settler_slots_dropped_total{shard=\"0/1\"} 3",
            "fine_settler_slots_merged_total{shard=\"0/1\"} 5",
            "fine_settler_slot_rebases_total{shard=\"0/1\"} 1",
            "fine_settler_clock_steps_total{shard=\"0/1\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from:\n{text}");
        }
    }

    #[test]
    fn the_status_page_reads_the_clock_skew() {
        let m = Metrics::new("0/2".into());
        assert_eq!(m.clock_skew(), None);
        m.set_clock_skew(-0.25);
        assert_eq!(m.clock_skew(), Some(-0.25));
    }

    #[test]
    fn unix_time_only_moves_forward_and_is_shared_by_its_clones() {
        let t = UnixTime::default();
        let shared = t.clone();
        t.advance_to(2_000);
        shared.advance_to(1_800);
        assert_eq!(t.unix_ms(), 2_000);
    }

    #[test]
    fn unix_time_follows_a_clock_stepped_back() {
        let t = UnixTime::default();
        t.advance_to(1_700_003_600_000);
        t.advance_to(1_700_000_000_000);
        assert_eq!(
            t.unix_ms(),
            1_700_000_000_000,
            "an hour back is a step, not a late report"
        );
    }
}
