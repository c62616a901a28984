//! The tick's view of its shard: one status statement (the database clock, this shard's keys in the window and
//! which of them have late rows, the pending charges, the pauses, and the due keys of the other shards that
//! nobody runs) and what the tick does with each key ([`Action`]).

use chrono::{DateTime, NaiveDate, Utc};
use sqlx::PgConnection;

use super::{ClaimMode, RunStatus};
use crate::{
    jobs::JobName,
    shard::ShardSpec,
    store::pauses::{Pause, PauseScope},
};

/// What a tick does with a due key, by what it saw of the key's row and whether a pause covers the key.
/// [`KeyState::action`] is the only place that decides it, and it decides as [`super::claim`] does: `claim` (in
/// [`ClaimMode::Free`]) wins exactly the keys whose action is `Claim` or `Takeover`, and [`ClaimMode::Reopen`]
/// the `Reopen` ones. A paused key is never tried (`claim` does not look at pauses: the tick does not call it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// No row yet: insert it under epoch 1.
    Claim,
    /// FAILED, or RUNNING with an expired lease: take it over under a new epoch.
    Takeover,
    /// SUCCESS, but rows of its business date are still to do: re-open it.
    Reopen,
    /// SUCCESS with nothing left, or a live owner holds it.
    Skip,
    /// An operator paused the job (or this shard of it): not claimed until it is resumed. A SUCCESS key with
    /// nothing left stays `Skip`.
    Paused,
}

impl Action {
    /// The action for a key whose row is `state` (`None`: no row), `paused` or not.
    pub fn of(state: Option<&KeyState>, paused: bool) -> Self {
        match state {
            Some(s) => s.action(paused),
            None if paused => Action::Paused,
            None => Action::Claim,
        }
    }

    /// Whether a tick runs the key: anything but a SUCCESS key with nothing left, or a paused key. (A key a
    /// live owner holds is tried too: its claim is skipped, and the tick learns when the lease ends.)
    pub fn runs(state: Option<&KeyState>, paused: bool) -> bool {
        !state.is_some_and(KeyState::done) && !paused
    }
}

/// A `job_runs` row of this shard, as a tick sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyState {
    pub job_name: String,
    pub business_date: NaiveDate,
    pub status: RunStatus,
    pub owner: String,
    /// The lease has run out (by the database clock).
    pub expired: bool,
    /// A SUCCESS key whose business date has rows still to do (see [`LateProbe`]): it is re-opened.
    pub late: bool,
}

impl KeyState {
    /// What a tick does with the key: what [`super::claim`] would do with it ([`RunStatus::taken_by`]: FAILED,
    /// or RUNNING with an expired lease, is taken over; a live owner is never displaced), plus re-opening late
    /// SUCCESS keys; while `paused`, nothing but a finished key's skip.
    pub fn action(&self, paused: bool) -> Action {
        if self.done() {
            Action::Skip
        } else if paused {
            Action::Paused
        } else if self.status == RunStatus::Success {
            // Not done: it has rows left, and a re-open takes it.
            Action::Reopen
        } else if self.status.taken_by(self.expired, ClaimMode::Free) {
            Action::Takeover
        } else {
            Action::Skip
        }
    }

    /// SUCCESS with nothing left to do.
    pub fn done(&self) -> bool {
        self.status == RunStatus::Success && !self.late
    }
}

/// Which SUCCESS settlement keys the tick status also checks for rows still to do. (The accrual's are found by
/// its own re-check, on its own schedule: see `daemon::recheck`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LateProbe {
    /// Settlement keys from this business date on: any unsettled loan of the shard returned in the month. `None`
    /// turns the probe off (settlement is disabled).
    pub settlement_since: Option<NaiveDate>,
    /// The keys due at the tick's time, which the statement also asks every other shard of the shard count about
    /// (see [`Unclaimed`]).
    pub due: DueKeys,
}

/// The business dates due at the tick's time, per job, as ranges the statement expands (`None`: the job is
/// disabled here), and how long a key may go without a live owner before it counts as unclaimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DueKeys {
    /// The first and last settlement month ends due (every month end between them is).
    pub settlement: Option<(NaiveDate, NaiveDate)>,
    /// The first and last accrual days due (every day between them is).
    pub accrual: Option<(NaiveDate, NaiveDate)>,
    /// A RUNNING or FAILED row counts as unclaimed once its lease ended more than this long ago. The lease: a
    /// shard that is run takes such a key over at its first tick after the lease ends.
    pub grace: std::time::Duration,
}

impl DueKeys {
    /// Asks about no key (a statement that needs only this shard's own rows).
    pub const NONE: DueKeys = DueKeys {
        settlement: None,
        accrual: None,
        grace: std::time::Duration::ZERO,
    };
}

/// How many due keys of the other shards of this shard count nobody runs, per job: no `job_runs` row at all (a
/// shard no replica was ever started for), or a row that is not SUCCESS whose lease ended more than the grace
/// ago (a host down). Keys a pause covers are not counted (a pause is an operator's choice, shown by its own
/// gauge). This replica's own shard is never counted: the tick about to run is its owner.
///
/// A key counts only once this replica's own shard claimed it more than the grace ago (or claimed it again
/// since): replicas tick at the same moments (the fixed-rate grid, the cron times), so at the tick a key comes
/// due its peers' rows are being written while this statement reads. A replica whose own shard has no row of a
/// key (paused, or its first tick) counts nothing for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Unclaimed {
    pub settlement: i64,
    pub accrual: i64,
}

impl Unclaimed {
    /// The count for `job`.
    pub fn of(self, job: JobName) -> i64 {
        match job {
            JobName::FineSettlement => self.settlement,
            JobName::OverdueAccrual => self.accrual,
        }
    }
}

/// What a tick sees before it claims anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TickStatus {
    /// The database clock.
    pub now: DateTime<Utc>,
    /// This shard's `job_runs` rows in the window.
    pub keys: Vec<KeyState>,
    /// This shard's pending charges due for a retry.
    pub due_pending: i64,
    /// This shard's PENDING and DEAD charges.
    pub pending: i64,
    pub dead: i64,
    /// The pauses covering this shard, at most one per job (the whole job's before the shard's own).
    pub pauses: Vec<Pause>,
    /// The due keys of the other shards nobody runs.
    pub unclaimed: Unclaimed,
}

/// Everything a tick needs to know before it claims anything, in one statement: the database clock, this
/// shard's `job_runs` rows for business dates from `since` on — each SUCCESS settlement key in `late`'s window
/// with whether rows of it are still to do — how many of its pending charges are due, and the pauses that cover
/// the shard (`job_pauses`, a table of a few rows, aggregated into arrays on the one first row), and how many due
/// keys of the other shards nobody runs ([`Unclaimed`]: the due keys × the other shards, each a primary-key probe
/// of `job_runs`). An idle tick costs exactly this one round trip.
///
/// The settlement probe is the predicate [`crate::store::loans::month_has_unsettled`] asks for one key (and the
/// one the batches select), as the function `fine_settler_month_late` (migrations/20261203000061: so that on
/// Citus the statement names no distributed table beside the coordinator's `job_runs`; the queue's counts are
/// `fine_settler_pending_counts`, for the same reason); it reads the partial
/// index of unsettled loans by return date: a settled month has no entry in it, so the probe costs one index
/// descent per key. Accrual keys are never late here: the accrual's
/// re-check (its own statement, on its own schedule) marks them.
pub async fn tick_status(
    conn: &mut PgConnection,
    shard: ShardSpec,
    since: NaiveDate,
    late: LateProbe,
) -> Result<TickStatus, sqlx::Error> {
    let rows = status_rows(conn, shard, since, late).await?;
    let first = rows.first().ok_or(sqlx::Error::RowNotFound)?;
    crate::store::ReadOnlyServer::check(first.in_recovery, first.read_only)?;
    let (now, due_pending, pending, dead) = (first.now, first.due_pending, first.pending, first.dead);
    let pauses = first.pauses(shard);
    let unclaimed = Unclaimed {
        settlement: first.unclaimed_settlement,
        accrual: first.unclaimed_accrual,
    };
    Ok(TickStatus {
        now,
        keys: rows.into_iter().filter_map(StatusRow::key_state).collect(),
        due_pending,
        pending,
        dead,
        pauses,
        unclaimed,
    })
}

/// One row of the tick's status statement: the shard's figures and pauses (the same on every row) and one key's
/// row (`None` columns when the shard has no key in the window: the one row then carries only the figures).
#[derive(Debug)]
struct StatusRow {
    now: DateTime<Utc>,
    due_pending: i64,
    pending: i64,
    dead: i64,
    in_recovery: bool,
    read_only: bool,
    paused_jobs: Vec<String>,
    paused_shards: Vec<i32>,
    paused_by: Vec<String>,
    paused_reasons: Vec<String>,
    paused_since: Vec<DateTime<Utc>>,
    unclaimed_settlement: i64,
    unclaimed_accrual: i64,
    job_name: Option<String>,
    business_date: Option<NaiveDate>,
    status: Option<RunStatus>,
    owner: Option<String>,
    expired: Option<bool>,
    late: Option<bool>,
}

impl StatusRow {
    /// The pauses covering `shard`, at most one per job: ordered by job, the whole job's pause (shards = 0)
    /// first, the first of each job is kept.
    fn pauses(&self, shard: ShardSpec) -> Vec<Pause> {
        let mut pauses: Vec<Pause> = Vec::new();
        let each = self
            .paused_jobs
            .iter()
            .zip(&self.paused_shards)
            .zip(&self.paused_by);
        for (((job, shards), by), (reason, since)) in
            each.zip(self.paused_reasons.iter().zip(&self.paused_since))
        {
            if pauses.iter().any(|p| &p.job_name == job) {
                continue;
            }
            pauses.push(Pause {
                job_name: job.clone(),
                scope: match *shards {
                    0 => PauseScope::Job,
                    _ => PauseScope::Shard(shard),
                },
                by: by.clone(),
                reason: reason.clone(),
                since: *since,
            });
        }
        pauses
    }

    /// The row's key, if it has one.
    fn key_state(self) -> Option<KeyState> {
        Some(KeyState {
            job_name: self.job_name?,
            business_date: self.business_date?,
            status: self.status?,
            owner: self.owner?,
            expired: self.expired?,
            late: self.late.unwrap_or(false),
        })
    }
}

/// The status statement (see [`tick_status`]).
async fn status_rows(
    conn: &mut PgConnection,
    shard: ShardSpec,
    since: NaiveDate,
    late: LateProbe,
) -> Result<Vec<StatusRow>, sqlx::Error> {
    sqlx::query_as!(
        StatusRow,
        r#"select t.now as "now!", q.due_pending as "due_pending!", q.pending as "pending!", q.dead as "dead!",
                  t.in_recovery as "in_recovery!", t.read_only as "read_only!",
                  pz.jobs as "paused_jobs!", pz.shards as "paused_shards!", pz.bys as "paused_by!",
                  pz.reasons as "paused_reasons!", pz.since as "paused_since!",
                  uc.settlement as "unclaimed_settlement!", uc.accrual as "unclaimed_accrual!",
                  r.job_name as "job_name?", r.business_date as "business_date?",
                  r.status as "status?: RunStatus", r.owner as "owner?", (r.lease_until < t.now) as "expired?",
                  (r.status = 'SUCCESS' and r.job_name = 'fine-settlement' and r.business_date >= $4::date
                   and fine_settler_month_late(r.business_date, $1::int, $2::int)) as "late?"
           from (select now() as now, pg_is_in_recovery() as in_recovery,
                        current_setting('transaction_read_only') = 'on' as read_only) t
           cross join fine_settler_pending_counts($1::int, $2::int) q
           cross join (select coalesce(array_agg(p.job_name order by p.job_name, p.shards), '{}') as jobs,
                              coalesce(array_agg(p.shards order by p.job_name, p.shards), '{}') as shards,
                              coalesce(array_agg(p.paused_by order by p.job_name, p.shards), '{}') as bys,
                              coalesce(array_agg(p.reason order by p.job_name, p.shards), '{}') as reasons,
                              coalesce(array_agg(p.paused_at order by p.job_name, p.shards), '{}') as since
                       from job_pauses p
                       where (p.shards = 0 and p.shard = 0) or (p.shards = $1::int and p.shard = $2::int)) pz
           cross join (select count(*) filter (where k.job = 'fine-settlement') as settlement,
                              count(*) filter (where k.job = 'overdue-accrual') as accrual
                       from (select 'fine-settlement'::text as job, (m + interval '1 month - 1 day')::date as day
                             from generate_series(date_trunc('month', $5::date), $6::date, interval '1 month') m
                             union all
                             select 'overdue-accrual'::text, a::date
                             from generate_series($7::date, $8::date, interval '1 day') a) k
                       cross join generate_series(0, $1::int - 1) s(shard)
                       where s.shard <> $2::int
                         -- Due long enough: this shard claimed the key at an earlier tick (a grace ago, or it was
                         -- claimed again since), so every replica that runs has had a tick to claim its own.
                         -- (Scalar probes with `limit 1`, not `exists`: with the series' sizes unknown in the
                         -- generic plan, `exists` was planned as hash joins over the whole of job_runs.)
                         and (select true from job_runs m
                              where m.job_name = k.job and m.business_date = k.day
                                and m.shards = $1::int and m.shard = $2::int
                                and (m.epoch > 1 or m.started_at < now() - $9::bigint * interval '1 millisecond')
                              limit 1)
                         and (select true from job_runs o
                              where o.job_name = k.job and o.business_date = k.day
                                and o.shards = $1::int and o.shard = s.shard
                                and (o.status = 'SUCCESS'
                                     or o.lease_until >= now() - $9::bigint * interval '1 millisecond')
                              limit 1) is null
                         -- Nor is a shard whose replica runs another key of the count right now (a long run:
                         -- the month-end settlement, a throttled or waiting run), before it claims the newer ones.
                         and (select true from job_runs b
                              where b.shards = $1::int and b.shard = s.shard and b.status = 'RUNNING'
                                and b.lease_until >= now()
                              limit 1) is null
                         and not exists (
                             select 1 from job_pauses p
                             where p.job_name = k.job
                               and ((p.shards = 0 and p.shard = 0) or (p.shards = $1::int and p.shard = s.shard)))) uc
           left join job_runs r
             on r.shards = $1::int and r.shard = $2::int
            and r.business_date >= $3"#,
        shard.shards(),
        shard.shard(),
        since,
        // A disabled probe asks from a date no key has, so that its subqueries are never evaluated.
        late.settlement_since.unwrap_or(NaiveDate::MAX),
        // A disabled job's range is null: its series is empty.
        late.due.settlement.map(|(first, _)| first),
        late.due.settlement.map(|(_, last)| last),
        late.due.accrual.map(|(first, _)| first),
        late.due.accrual.map(|(_, last)| last),
        i64::try_from(late.due.grace.as_millis()).unwrap_or(i64::MAX),
    )
    .fetch_all(&mut *conn)
    .await
}
