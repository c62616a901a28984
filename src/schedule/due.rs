//! What is due: which business dates a tick at a given time owes each job, what it does with each key it finds
//! in `job_runs`, which keys have left their window unfinished, and in which order a tick's pass visits its
//! keys. Pure functions of the settings, the time and the rows a tick read.
//!
//! - Settlement is due for the last `settlement.catch_up_months` month ends before today's month, accrual for
//!   yesterday and the `accrual.catch_up_days - 1` days before it (today in `time.zone`).
//! - Each key's action comes from [`KeyState::action`], next to the claim it mirrors.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};

use crate::{
    calendar,
    config::{ScheduleMode, Settings},
    jobs::JobName,
    store::{
        job_runs::{Action, DueKeys, KeyState, LateProbe},
        pauses::Pause,
    },
};

/// The settlement business dates due on local date `today`, oldest first: the last `n` month ends before
/// today's month (the catch-up window). Each must settle on its own; they are never merged.
pub fn settlement_due(today: NaiveDate, n: u32) -> Vec<NaiveDate> {
    let mut dates = Vec::with_capacity(n as usize);
    let mut end = calendar::previous_month_end(today);
    for _ in 0..n {
        dates.push(end);
        match calendar::month_start(end).pred_opt() {
            Some(previous) => end = previous,
            None => break,
        }
    }
    dates.reverse();
    dates
}

/// The accrual days due on local date `today`: yesterday and the `n - 1` days before it, oldest first.
pub fn accrual_due(today: NaiveDate, n: u32) -> Vec<NaiveDate> {
    (1..=i64::from(n))
        .rev()
        .filter_map(|back| today.checked_sub_signed(chrono::Duration::days(back)))
        .collect()
}

/// One due business date of one job, and what the tick saw of it (a line of `plan`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Due {
    pub job: JobName,
    pub business_date: NaiveDate,
    pub shard: i32,
    pub shards: i32,
    /// `none` when no row exists yet, else the row's status.
    pub status: &'static str,
    pub action: Action,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The pause that stops the key (action `paused`); absent when none does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused: Option<PausedBy>,
    /// The tick runs the key: it is not SUCCESS with nothing left, nor paused (see [`Action::runs`]).
    #[serde(skip)]
    pub runs: bool,
}

/// Who paused a due key, why and since when (a `plan` line's `paused`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PausedBy {
    pub by: String,
    pub reason: String,
    pub since: DateTime<Utc>,
}

/// The due business dates at `now`, oldest first per job (settlement, then accrual), with what a tick would do
/// with each; `pauses` are those covering this shard (as the tick status read them).
pub fn plan(settings: &Settings, now: DateTime<Utc>, states: &[KeyState], pauses: &[Pause]) -> Vec<Due> {
    let today = calendar::local_date(now, settings.zone);
    let mut due = Vec::new();
    if settings.settlement.enabled {
        for date in settlement_due(today, settings.settlement.catch_up_months) {
            due.push(classify(settings, JobName::FineSettlement, date, states, pauses));
        }
    }
    if settings.accrual.enabled {
        for date in accrual_due(today, settings.accrual.catch_up_days) {
            due.push(classify(settings, JobName::OverdueAccrual, date, states, pauses));
        }
    }
    due
}

fn classify(
    settings: &Settings,
    job: JobName,
    date: NaiveDate,
    states: &[KeyState],
    pauses: &[Pause],
) -> Due {
    let state = states
        .iter()
        .find(|s| s.job_name == job.as_str() && s.business_date == date);
    let pause = pauses
        .iter()
        .find(|p| p.job_name == job.as_str() && p.scope.covers(settings.instance));
    let action = Action::of(state, pause.is_some());
    Due {
        job,
        business_date: date,
        shard: settings.instance.shard(),
        shards: settings.instance.shards(),
        status: state.map_or("none", |s| s.status.as_str()),
        action,
        owner: state.map(|s| s.owner.clone()),
        paused: pause.filter(|_| action == Action::Paused).map(|p| PausedBy {
            by: p.by.clone(),
            reason: p.reason.clone(),
            since: p.since,
        }),
        runs: Action::runs(state, pause.is_some()),
    }
}

/// The earliest business date a tick at `at` can be due for: every job's catch-up window back from `at`, plus a
/// margin (33 days) that covers the zone offset and any plausible difference between this host's clock and the
/// database's.
pub fn window_start(settings: &Settings, at: DateTime<Utc>) -> NaiveDate {
    let months = i64::from(settings.settlement.catch_up_months);
    let days = i64::from(settings.accrual.catch_up_days);
    let back = months.saturating_mul(31).max(days).saturating_add(33);
    at.date_naive()
        .checked_sub_signed(chrono::Duration::days(back))
        .unwrap_or(NaiveDate::MIN)
}

/// What the tick status asks about SUCCESS keys at `at` (the tick's clock: see `daemon::tick_clock`): whether rows arrived after their run, for the
/// settlement keys of the catch-up window (with two days of margin for the zone and the clocks' skew). The
/// accrual's keys are re-opened by its own re-check.
pub fn late_probe(settings: &Settings, at: DateTime<Utc>) -> LateProbe {
    let early = calendar::local_date(at, settings.zone)
        .checked_sub_signed(chrono::Duration::days(2))
        .unwrap_or(NaiveDate::MIN);
    LateProbe {
        settlement_since: settings
            .settlement
            .enabled
            .then(|| settlement_due(early, settings.settlement.catch_up_months))
            .and_then(|dates| dates.first().copied()),
        due: due_keys(settings, at),
    }
}

/// The keys due at `at`, as ranges, for the status statement's count of keys nobody runs.
fn due_keys(settings: &Settings, at: DateTime<Utc>) -> DueKeys {
    let today = calendar::local_date(at, settings.zone);
    let range = |dates: Vec<NaiveDate>| Some((*dates.first()?, *dates.last()?));
    DueKeys {
        settlement: settings
            .settlement
            .enabled
            .then(|| settlement_due(today, settings.settlement.catch_up_months))
            .and_then(range),
        accrual: settings
            .accrual
            .enabled
            .then(|| accrual_due(today, settings.accrual.catch_up_days))
            .and_then(range),
        grace: unclaimed_grace(settings, at),
    }
}

/// How long a due key of another shard may go without a live owner before it counts as one nobody runs: the
/// lease, or two intervals of the schedule when they are longer (a peer takes a failed key over at its next
/// tick, a schedule interval away, not a lease away), plus `claim.batch_timeout` (a batch in flight). With a
/// cron schedule the interval is the gap between its next two occurrences after `at`.
pub fn unclaimed_grace(settings: &Settings, at: DateTime<Utc>) -> std::time::Duration {
    let schedule = crate::schedule::Schedule::new(settings.schedule.mode.clone(), settings.zone);
    let interval = schedule.interval_after(at);
    settings.claim.lease.duration().max(interval.saturating_mul(2)) + settings.claim.lease.batch_timeout()
}

/// Keys of this shard that are not SUCCESS although their business date has left its job's catch-up window at
/// `now`: nothing runs them by itself any more (`verify` reports the month; `settle`/`accrue` by hand fixes it).
pub fn abandoned<'a>(settings: &Settings, now: DateTime<Utc>, states: &'a [KeyState]) -> Vec<&'a KeyState> {
    let today = calendar::local_date(now, settings.zone);
    let oldest_settlement = settlement_due(today, settings.settlement.catch_up_months)
        .first()
        .copied()
        .filter(|_| settings.settlement.enabled);
    let oldest_accrual = accrual_due(today, settings.accrual.catch_up_days)
        .first()
        .copied()
        .filter(|_| settings.accrual.enabled);
    states
        .iter()
        .filter(|s| s.status != crate::store::job_runs::RunStatus::Success)
        .filter(|s| {
            let oldest = if s.job_name == JobName::FineSettlement.as_str() {
                oldest_settlement
            } else {
                oldest_accrual
            };
            oldest.is_some_and(|oldest| s.business_date < oldest)
        })
        .collect()
}

/// How long the replica may go without progress before `/healthz` fails: two periods of its schedule (for cron,
/// two intervals between its next occurrences after `now`) or a third of the lease, whichever is longer, plus the
/// batch timeout, and at least a minute.
///
/// A third of the lease: a run waiting on the throttle (its pace, a lagging standby) makes progress only when it
/// renews its lease, and the runner renews a waiting run at most a third of the lease apart, each renewal a
/// statement of up to the batch timeout. Without it a healthy wait under a long lease (4 minutes: renewals 80 s
/// apart) would fail `/healthz` for part of every interval — and a liveness probe would kill a replica that was
/// merely waiting, leaving its key RUNNING for the whole lease.
pub fn health_window(settings: &Settings, now: DateTime<Utc>) -> Duration {
    let period = match &settings.schedule.mode {
        ScheduleMode::FixedRate(p) | ScheduleMode::FixedDelay(p) => *p,
        ScheduleMode::Cron(cron) => {
            let mut next = cron.iter_after(now.with_timezone(&settings.zone));
            match (next.next(), next.next()) {
                (Some(a), Some(b)) => (b - a).to_std().unwrap_or(Duration::from_secs(86_400)),
                _ => Duration::from_secs(86_400),
            }
        }
    };
    let renewals = settings.claim.lease.duration() / 3;
    ((period * 2).max(renewals) + settings.claim.lease.batch_timeout()).max(Duration::from_secs(60))
}

/// The order one tick's pass visits its due keys in: each once, oldest first per job — except that a key a live
/// owner held when the pass reached it is visited again, before the next key, once that owner's lease has run
/// out (a pass can be long: a backlog of keys, each with many batches; an owner whose lease lapses meanwhile may
/// be gone). A lease that was not renewed since the last visit is not visited again, so a pass never spins on
/// an estimate of the database clock that runs a little ahead.
#[derive(Debug)]
pub struct Pass<'a, T> {
    queue: std::slice::Iter<'a, T>,
    held: Vec<(&'a T, DateTime<Utc>)>,
}

/// A key to run now; `held_until` is the lease end it was held until, when this is a revisit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Visit<'a, T> {
    pub key: &'a T,
    pub held_until: Option<DateTime<Utc>>,
}

impl<'a, T> Pass<'a, T> {
    pub fn new(keys: &'a [T]) -> Self {
        Pass {
            queue: keys.iter(),
            held: Vec::new(),
        }
    }

    /// The next key to run at (an estimate of) database time `now`: a held key whose lease ended before `now`,
    /// else the next key in order; `None` when the pass is over.
    pub fn next_at(&mut self, now: DateTime<Utc>) -> Option<Visit<'a, T>> {
        if let Some(i) = self.held.iter().position(|(_, until)| *until < now) {
            let (key, until) = self.held.remove(i);
            return Some(Visit {
                key,
                held_until: Some(until),
            });
        }
        self.queue.next().map(|key| Visit {
            key,
            held_until: None,
        })
    }

    /// `visit` found the key held by a live owner until `until`: visit it again once that lease has ended,
    /// unless it is the same lease as at the last visit.
    pub fn held(&mut self, visit: Visit<'a, T>, until: DateTime<Utc>) {
        if visit.held_until.is_none_or(|before| until > before) {
            self.held.push((visit.key, until));
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn d(s: &str) -> NaiveDate {
        s.parse().expect("test date")
    }

    #[test]
    fn the_settlement_window_is_the_last_n_month_ends_oldest_first() {
        assert_eq!(
            settlement_due(d("2027-01-01"), 3),
            vec![d("2026-10-31"), d("2026-11-30"), d("2026-12-31")]
        );
        assert_eq!(
            settlement_due(d("2028-03-15"), 2),
            vec![d("2028-01-31"), d("2028-02-29")]
        );
        // A tick at 00:30 on January 1st in Shanghai is due for December 31st.
        let tick = d("2026-12-31").and_hms_opt(16, 30, 0).expect("time").and_utc();
        let today = calendar::local_date(tick, chrono_tz::Asia::Shanghai);
        assert_eq!(settlement_due(today, 1), vec![d("2026-12-31")]);
        // The same instant in UTC is still December: the latest due month end is November's.
        assert_eq!(
            settlement_due(calendar::local_date(tick, chrono_tz::UTC), 1),
            vec![d("2026-11-30")]
        );
    }

    #[test]
    fn accrual_days_are_yesterday_and_before() {
        assert_eq!(
            accrual_due(d("2027-01-01"), 3),
            vec![d("2026-12-29"), d("2026-12-30"), d("2026-12-31")]
        );
    }

    fn state(job: JobName, date: &str, status: crate::store::job_runs::RunStatus) -> KeyState {
        KeyState {
            job_name: job.as_str().into(),
            business_date: d(date),
            status,
            owner: "a".into(),
            expired: false,
            late: false,
        }
    }

    fn settings() -> Settings {
        let env = crate::testing::env(&[]);
        crate::config::load(None, &env)
            .and_then(|raw| raw.validate(&env))
            .expect("defaults")
    }

    /// A peer takes a failed key over at its next tick: with a schedule interval longer than the lease the grace
    /// is two intervals, so a key waiting for that tick never counts as one nobody runs.
    #[test]
    fn the_unclaimed_grace_covers_two_schedule_intervals() {
        let with = |vars: &[(&str, &str)]| {
            let env = crate::testing::env(vars);
            let s = crate::config::load(None, &env)
                .and_then(|raw| raw.validate(&env))
                .expect("valid");
            let batch = s.claim.lease.batch_timeout();
            (
                unclaimed_grace(&s, "2026-12-01T00:00:00Z".parse().expect("time")),
                batch,
            )
        };
        let (grace, batch) = with(&[
            ("FINE_SETTLER__SCHEDULE__PERIOD", "10m"),
            ("FINE_SETTLER__CLAIM__LEASE", "2m"),
        ]);
        assert_eq!(grace, Duration::from_secs(20 * 60) + batch);
        let (grace, batch) = with(&[
            ("FINE_SETTLER__SCHEDULE__PERIOD", "1s"),
            ("FINE_SETTLER__CLAIM__LEASE", "2m"),
        ]);
        assert_eq!(grace, Duration::from_secs(120) + batch);
        let (grace, batch) = with(&[
            ("FINE_SETTLER__SCHEDULE__MODE", "cron"),
            ("FINE_SETTLER__SCHEDULE__CRON", "0 30 2 * * *"),
            ("FINE_SETTLER__CLAIM__LEASE", "2m"),
        ]);
        assert_eq!(grace, Duration::from_secs(2 * 86_400) + batch);
    }

    #[test]
    fn a_tick_plans_each_job_s_window_and_classifies_its_rows() {
        use crate::store::job_runs::RunStatus::*;
        let mut s = settings();
        s.accrual.enabled = true;
        s.accrual.catch_up_days = 2;
        s.settlement.catch_up_months = 2;
        // 2026-12-01 10:00 in Shanghai.
        let now = "2026-12-01T02:00:00Z".parse().expect("time");
        let mut expired = state(JobName::OverdueAccrual, "2026-11-30", Running);
        expired.expired = true;
        let mut late = state(JobName::FineSettlement, "2026-10-31", Success);
        late.late = true;
        let rows = [
            late,
            state(JobName::FineSettlement, "2026-11-30", Success),
            expired,
        ];
        let plan = plan(&s, now, &rows, &[]);
        let seen: Vec<_> = plan
            .iter()
            .map(|p| (p.job, p.business_date, p.status, p.action, p.runs))
            .collect();
        assert_eq!(
            seen,
            vec![
                (
                    JobName::FineSettlement,
                    d("2026-10-31"),
                    "SUCCESS",
                    Action::Reopen,
                    true
                ),
                (
                    JobName::FineSettlement,
                    d("2026-11-30"),
                    "SUCCESS",
                    Action::Skip,
                    false
                ),
                (
                    JobName::OverdueAccrual,
                    d("2026-11-29"),
                    "none",
                    Action::Claim,
                    true
                ),
                (
                    JobName::OverdueAccrual,
                    d("2026-11-30"),
                    "RUNNING",
                    Action::Takeover,
                    true
                ),
            ]
        );
        // The plan's JSON line, as `plan` prints it.
        let line = serde_json::to_string(&plan[3]).expect("json");
        assert_eq!(
            line,
            r#"{"job":"overdue-accrual","business_date":"2026-11-30","shard":0,"shards":1,"status":"RUNNING","action":"takeover","owner":"a"}"#
        );
        // A FAILED key that left the window is abandoned; a SUCCESS one is not.
        let rows = [
            state(JobName::FineSettlement, "2026-09-30", Failed),
            state(JobName::FineSettlement, "2026-08-31", Success),
            state(JobName::OverdueAccrual, "2026-11-28", Running),
        ];
        let gone: Vec<_> = abandoned(&s, now, &rows)
            .into_iter()
            .map(|k| (k.job_name.as_str(), k.business_date))
            .collect();
        assert_eq!(
            gone,
            vec![
                ("fine-settlement", d("2026-09-30")),
                ("overdue-accrual", d("2026-11-28"))
            ]
        );
    }

    #[test]
    fn a_paused_job_s_keys_are_not_run_except_that_finished_ones_stay_skipped() {
        use crate::store::{job_runs::RunStatus::*, pauses::PauseScope};
        let mut s = settings();
        s.accrual.enabled = true;
        s.accrual.catch_up_days = 1;
        s.settlement.catch_up_months = 3;
        s.instance = crate::shard::ShardSpec::new(1, 4).expect("shard");
        let now = "2026-12-01T02:00:00Z".parse().expect("time");
        let mut expired = state(JobName::FineSettlement, "2026-10-31", Running);
        expired.expired = true;
        let mut late = state(JobName::FineSettlement, "2026-09-30", Success);
        late.late = true;
        let rows = [
            late,
            expired,
            state(JobName::OverdueAccrual, "2026-11-30", Failed),
        ];
        let pause = |scope| Pause {
            job_name: JobName::FineSettlement.as_str().into(),
            scope,
            by: "ops@h".into(),
            reason: "month-end freeze".into(),
            since: now,
        };
        let seen = |pauses: &[Pause]| -> Vec<(JobName, Action, bool, bool)> {
            plan(&s, now, &rows, pauses)
                .iter()
                .map(|p| (p.job, p.action, p.runs, p.paused.is_some()))
                .collect()
        };
        let paused_settlement = vec![
            (JobName::FineSettlement, Action::Paused, false, true),
            (JobName::FineSettlement, Action::Paused, false, true),
            (JobName::FineSettlement, Action::Paused, false, true),
            (JobName::OverdueAccrual, Action::Takeover, true, false),
        ];
        // The whole job, or this very shard: every key of the job that would run (re-open, take over, claim)
        // is paused; the other job goes on.
        assert_eq!(seen(&[pause(PauseScope::Job)]), paused_settlement);
        assert_eq!(seen(&[pause(PauseScope::Shard(s.instance))]), paused_settlement);
        // Another shard's pause, or the same shard number under another shard count, changes nothing here.
        let unpaused = vec![
            (JobName::FineSettlement, Action::Reopen, true, false),
            (JobName::FineSettlement, Action::Takeover, true, false),
            (JobName::FineSettlement, Action::Claim, true, false),
            (JobName::OverdueAccrual, Action::Takeover, true, false),
        ];
        for other in [(2, 4), (1, 3)] {
            let other = crate::shard::ShardSpec::new(other.0, other.1).expect("shard");
            assert_eq!(seen(&[pause(PauseScope::Shard(other))]), unpaused);
        }
        assert_eq!(seen(&[]), unpaused);
        // A finished key is skipped, paused or not.
        let done = [state(JobName::FineSettlement, "2026-11-30", Success)];
        let line = plan(&s, now, &done, &[pause(PauseScope::Job)]);
        assert_eq!(
            (line[2].action, line[2].runs, line[2].paused.is_some()),
            (Action::Skip, false, false)
        );
        let line = serde_json::to_string(&line[1]).expect("json");
        assert_eq!(
            line,
            r#"{"job":"fine-settlement","business_date":"2026-10-31","shard":1,"shards":4,"status":"none","action":"paused","paused":{"by":"ops@h","reason":"month-end freeze","since":"2026-12-01T02:00:00Z"}}"#
        );
    }

    #[test]
    fn the_health_window_is_two_periods_or_a_third_of_the_lease_plus_a_batch_and_at_least_a_minute() {
        let mut s = settings();
        let now: DateTime<Utc> = "2026-12-01T02:00:00Z".parse().expect("time");
        s.schedule.mode = ScheduleMode::FixedRate(Duration::from_secs(600));
        assert_eq!(health_window(&s, now), Duration::from_secs(1230));
        s.schedule.mode = ScheduleMode::FixedRate(Duration::from_secs(1));
        // A third of the default lease (2 min) plus its batch timeout (30 s).
        assert_eq!(health_window(&s, now), Duration::from_secs(70));
        s.claim.lease = crate::config::Lease::new(Duration::from_secs(30), None, None).expect("lease");
        assert_eq!(health_window(&s, now), Duration::from_secs(60));
        let hourly: croner::Cron = "0 * * * *".parse().expect("cron");
        s.schedule.mode = ScheduleMode::Cron(Box::new(hourly));
        assert_eq!(health_window(&s, now), Duration::from_millis(7_207_500));
    }

    /// A run waiting on a lagging standby under a lease of 4 minutes (period 1 s) renews its lease every 80 s,
    /// each renewal taking up to the batch timeout: `/healthz`, asked every second of the wait, is always live.
    #[test]
    fn a_healthy_wait_under_a_long_lease_never_fails_health() {
        let mut s = settings();
        let now: DateTime<Utc> = "2026-12-01T02:00:00Z".parse().expect("time");
        s.schedule.mode = ScheduleMode::FixedRate(Duration::from_secs(1));
        s.claim.lease = crate::config::Lease::new(Duration::from_secs(240), None, None).expect("lease");
        let window = health_window(&s, now);
        let (renew_every, renewal_takes) = (80_000i64, s.claim.lease.batch_timeout().as_millis() as i64);
        let beat = crate::health::Heartbeat::default();
        let start = 1_700_000_000_000i64;
        beat.progress(start);
        let mut next_renewal = start + renew_every + renewal_takes;
        for at in (start..start + 10 * renew_every).step_by(1_000) {
            if at >= next_renewal {
                beat.progress(at);
                next_renewal = at + renew_every + renewal_takes;
            }
            assert!(
                matches!(beat.health(at, start, window), crate::health::Health::Live { .. }),
                "{:?} at +{} ms (window {window:?})",
                beat.health(at, start, window),
                at - start
            );
        }
    }

    fn at(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(s, 0).expect("time")
    }

    #[test]
    fn a_held_key_is_revisited_once_its_lease_ends_and_never_for_the_same_lease() {
        let keys = ["a", "b", "c"];
        let mut pass = Pass::new(&keys);
        let a = pass.next_at(at(0)).expect("a");
        assert_eq!((*a.key, a.held_until), ("a", None));
        pass.held(a, at(10));
        // Before a's lease ends the pass goes on in order.
        assert_eq!(pass.next_at(at(5)).map(|v| *v.key), Some("b"));
        // Once it has ended, a comes before c.
        let again = pass.next_at(at(11)).expect("a again");
        assert_eq!((*again.key, again.held_until), ("a", Some(at(10))));
        // Held again under the same lease (its owner did not renew it): not retried.
        pass.held(again, at(10));
        assert_eq!(pass.next_at(at(20)).map(|v| *v.key), Some("c"));
        assert_eq!(pass.next_at(at(30)), None);
    }

    proptest! {
        #[test]
        fn catch_up_windows_are_consecutive_month_ends(days in 0i64..2_000_000, n in 1u32..40) {
            let today = d("1000-01-01") + chrono::Duration::days(days);
            let due = settlement_due(today, n);
            prop_assert_eq!(due.len(), n as usize);
            prop_assert_eq!(due.last().copied(), Some(calendar::previous_month_end(today)));
            for w in due.windows(2) {
                prop_assert_eq!(calendar::month_end(w[0]), w[0]);
                prop_assert_eq!(calendar::previous_month_end(w[1]), w[0]);
            }
        }

        #[test]
        fn accrual_windows_are_the_n_days_before_today(days in 0i64..2_000_000, n in 1u32..4000) {
            let today = d("1000-01-01") + chrono::Duration::days(days);
            let due = accrual_due(today, n);
            prop_assert_eq!(due.len(), n as usize);
            prop_assert_eq!(due.last().copied(), today.pred_opt());
            for w in due.windows(2) {
                prop_assert_eq!(w[0].succ_opt(), Some(w[1]));
            }
        }

        /// Whatever the leases do, a pass visits every key, in order, and ends.
        #[test]
        fn a_pass_visits_every_key_and_ends(
            n in 0usize..8, leases in proptest::collection::vec(0i64..50, 0..40)
        ) {
            let keys: Vec<usize> = (0..n).collect();
            let mut pass = Pass::new(&keys);
            let mut leases = leases.into_iter();
            let (mut now, mut firsts, mut visits) = (0i64, Vec::new(), 0);
            while let Some(visit) = pass.next_at(at(now)) {
                visits += 1;
                prop_assert!(visits <= n + 40, "the pass did not end");
                if visit.held_until.is_none() {
                    firsts.push(*visit.key);
                }
                // A visit takes a second; the key may turn out held by a lease ending a little later.
                now += 1;
                if let Some(lease) = leases.next().filter(|l| *l > 25) {
                    pass.held(visit, at(now + lease - 25));
                }
            }
            prop_assert_eq!(firsts, keys);
        }
    }
}
