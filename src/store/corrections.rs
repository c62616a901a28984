//! `fine_ledger_corrections` and `fine_loan_changes`: the corrections an accrual run appends when a charged day
//! is no longer owed as charged, and the re-check that finds which days need them from what libraryd changed.
//!
//! The net of a (loan, day) — its first charge in `fine_ledger` plus its corrections — must equal the day's
//! canonical amount (`fine_settler_day_amount`, [`crate::fine::FinePolicy::day_amount`]). A correction is the
//! difference, written as the day's next correction (`seq`) with `on conflict do nothing`: two writers that saw
//! the same net cannot both write it. With a cap, a positive difference (a day owed again, or owed more) that does
//! not fit under what the loan holds is held back; the batch then brings that loan's over-charged days down
//! ([`relieve`]) and writes it — still clamped to what is left under the cap, read under the loan's lock: the
//! guard that keeps the net under the cap in every committed state whatever else happens.

use chrono::NaiveDate;
use sqlx::PgConnection;

use crate::{
    jobs::RunKey,
    shard::ShardSpec,
    store::{ledger::Clamp, Db},
};

/// Why a correction was written. The names are those of the `reason` column and of the metric's label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reason {
    /// The loan was returned before the day (a return recorded late and back-dated).
    Returned,
    /// The day is no longer after the due date and its grace period (the due date moved later).
    DueDateMoved,
    /// The library is closed that day (closed after it was charged), and the loan's policy does not charge
    /// closed days.
    ClosedDay,
    /// The day is still owed but its amount changed: the day that reaches the cap moved (a due date moved
    /// earlier, or the day was charged less than owed while other days were being corrected).
    Cap,
    /// A day corrected away is owed again (a return removed, a due date moved back).
    Reinstated,
    /// A charge written before canonical amounts, in the order runs happened, brought to its canonical amount.
    Canonical,
}

impl Reason {
    pub const ALL: [Reason; 6] = [
        Reason::Returned,
        Reason::DueDateMoved,
        Reason::ClosedDay,
        Reason::Cap,
        Reason::Reinstated,
        Reason::Canonical,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Returned => "returned",
            Reason::DueDateMoved => "due-date-moved",
            Reason::ClosedDay => "closed-day",
            Reason::Cap => "cap",
            Reason::Reinstated => "reinstated",
            Reason::Canonical => "canonical",
        }
    }

    fn parse(s: &str) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// How many corrections of each reason a write appended.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Corrected(pub std::collections::BTreeMap<Reason, u64>);

impl Corrected {
    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// The count of each reason in `reasons`.
    fn of(reasons: impl Iterator<Item = Reason>) -> Self {
        let mut corrected = Corrected::default();
        for r in reasons {
            *corrected.0.entry(r).or_default() += 1;
        }
        corrected
    }

    /// The count of each reason named in `names` (values of the `reason` column).
    pub(crate) fn named(names: &[String]) -> Self {
        Self::of(names.iter().filter_map(|r| Reason::parse(r)))
    }

    pub fn add(&mut self, other: &Corrected) {
        for (r, n) in &other.0 {
            *self.0.entry(*r).or_default() += n;
        }
    }
}

/// Appends, for each loan of `ids` charged on the run's day, the correction that brings the day's net to its
/// canonical amount by the loans row as it is now — within the cap: call
/// [`lock_loans`](crate::store::ledger::lock_loans) first in the same transaction when there is a cap. A loan
/// libraryd deleted is not corrected (there is nothing to correct against; the re-check reports it). Returns the
/// corrections written, by reason, and the loans whose positive difference did not fit under the cap and was
/// held back ([`Clamp::Hold`]; with [`Clamp::Cut`] what is left under the cap is written instead, if anything).
/// The cap's sums are read only for a positive difference (each difference is computed once, behind the
/// `offset 0` fence; the reason only for what is written): a re-run of a charged day probes each charge, nothing
/// more.
pub async fn correct(
    tx: &mut PgConnection,
    key: &RunKey,
    epoch: i64,
    ids: &[i64],
    clamp: Clamp,
) -> Result<(Corrected, Vec<i64>), sqlx::Error> {
    let row = sqlx::query!(
        r#"with w as (
               select f.loan_id, n.seq, l.due_on, l.returned_on, p.grace_days, p.charge_closed_days,
                      a.amount_cents as target, n.net, f.charged_at,
                      case when a.amount_cents <= n.net or p.cap_cents = 0 then a.amount_cents - n.net
                           else least(a.amount_cents - n.net,
                                      p.cap_cents
                                      - coalesce((select sum(x.amount_cents) from fine_ledger x
                                                  where x.loan_id = f.loan_id), 0)
                                      - coalesce((select sum(y.amount_cents) from fine_ledger_corrections y
                                                  where y.loan_id = f.loan_id), 0))
                      end as delta
               -- Each loan's charge by its key (tested against the list instead, as `f.loan_id = any($2)`,
               -- the day's charges were planned on statistics from before them as a filter of the day's
               -- index: every charge of the day compared with every id of the batch, 1.7 s a batch of
               -- 10,000 on a day of 20,000 charges).
               from unnest($2::bigint[]) as b (id)
               cross join lateral (select f.loan_id, f.accrual_date, f.amount_cents, f.charged_at
                                   from fine_ledger f
                                   where f.loan_id = b.id and f.accrual_date = $1 offset 0) f
               -- The loan by its key for each charge (a join, planned on a ledger whose statistics
               -- predate the day's charges, scanned the whole loans table for each).
               cross join lateral (select l.id, l.due_on, l.returned_on, l.fine_class from loans l
                                   where l.id = f.loan_id offset 0) l
               cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
               cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1, p.daily_rate_cents,
                                                                 p.grace_days, p.cap_cents,
                                                                 p.charge_closed_days) a
               cross join lateral (select f.amount_cents + coalesce(sum(c.amount_cents), 0) as net,
                                          coalesce(max(c.seq), 0) + 1 as seq
                                   from fine_ledger_corrections c
                                   where c.loan_id = f.loan_id and c.accrual_date = f.accrual_date) n
               where isfinite(l.due_on) and coalesce(isfinite(l.returned_on), true)
               offset 0
           ), written as (
               insert into fine_ledger_corrections (loan_id, accrual_date, seq, amount_cents, reason,
                                                    job_name, business_date, shards, shard, epoch)
               select w.loan_id, $1, w.seq, w.delta,
                      fine_settler_correction_reason(w.due_on, w.returned_on, $1, w.grace_days,
                                                     w.charge_closed_days, w.target, w.net, w.seq, w.charged_at),
                      $3, $1, $4, $5, $6
               from w
               where w.target < w.net
                  or (w.target > w.net and w.delta > 0 and (not $7 or w.delta = w.target - w.net))
               on conflict on constraint fine_ledger_corrections_pkey do nothing
               returning reason
           )
           select coalesce((select array_agg(x.reason) from written x), '{}') as "reasons!",
                  coalesce((select array_agg(w.loan_id order by w.loan_id) from w
                            where $7 and w.target > w.net and w.delta < w.target - w.net), '{}') as "held!""#,
        key.business_date,
        ids,
        key.job.as_str(),
        key.shard.shards(),
        key.shard.shard(),
        epoch,
        clamp == Clamp::Hold,
    )
    .fetch_one(&mut *tx)
    .await?;
    Ok((Corrected::named(&row.reasons), row.held))
}

/// With a cap, for each loan of `ids` whose run's day could not be brought to its amount under the cap — what the
/// loan holds plus what the day still owes exceeds the cap — brings down its other over-charged days first: every
/// other day of the loan whose net exceeds its canonical amount gets the negative correction that makes it
/// canonical, written by this run (its key and epoch) under the day it corrects. A ledger holds more than owed on
/// some day after libraryd changed the loan (a due date moved earlier moves the day that reaches the cap), or
/// after the policy changed: without this, the day would be left short until another run came back to it (for a
/// day before the catch-up window, only another `accrue` of it). Afterwards the loan's net is at most the sum of
/// its canonical amounts, so the day's own amount fits. Called with the loans a charge or correction held back
/// ([`Clamp::Hold`]); call [`lock_loans`](crate::store::ledger::lock_loans) first in the same transaction.
/// Returns the corrections written, by reason.
pub async fn relieve(
    tx: &mut PgConnection,
    key: &RunKey,
    epoch: i64,
    ids: &[i64],
) -> Result<Corrected, sqlx::Error> {
    let reasons = sqlx::query_scalar!(
        r#"insert into fine_ledger_corrections (loan_id, accrual_date, seq, amount_cents, reason,
                                                job_name, business_date, shards, shard, epoch)
           select w.loan_id, w.accrual_date, w.seq, w.delta, w.reason, $3, $1, $4, $5, $6
           from (select f.loan_id, f.accrual_date, n.seq, a.amount_cents - n.net as delta,
                        fine_settler_correction_reason(l.due_on, l.returned_on, f.accrual_date, l.grace_days,
                                                       l.charge_closed_days, a.amount_cents, n.net, n.seq,
                                                       f.charged_at) as reason
                 from (select l.id, l.due_on, l.returned_on, p.daily_rate_cents, p.grace_days, p.cap_cents,
                              p.charge_closed_days
                       from loans l
                       cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
                       cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, $1,
                                                                         p.daily_rate_cents, p.grace_days,
                                                                         p.cap_cents, p.charge_closed_days) a
                       where l.id = any($2::bigint[]) and a.amount_cents > 0 and p.cap_cents > 0
                         and isfinite(l.due_on) and coalesce(isfinite(l.returned_on), true)
                         -- what the loan holds, plus what the day still owes, is over the cap
                         and coalesce((select sum(x.amount_cents) from fine_ledger x where x.loan_id = l.id), 0)
                           + coalesce((select sum(y.amount_cents) from fine_ledger_corrections y
                                       where y.loan_id = l.id), 0)
                           + greatest(a.amount_cents
                                      - coalesce((select sum(x.amount_cents) from fine_ledger x
                                                  where x.loan_id = l.id and x.accrual_date = $1), 0)
                                      - coalesce((select sum(y.amount_cents) from fine_ledger_corrections y
                                                  where y.loan_id = l.id and y.accrual_date = $1), 0), 0)
                           > p.cap_cents
                       offset 0) l
                 join fine_ledger f on f.loan_id = l.id and f.accrual_date <> $1
                 cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, f.accrual_date,
                                                                   l.daily_rate_cents, l.grace_days, l.cap_cents,
                                                                   l.charge_closed_days) a
                 cross join lateral (select f.amount_cents + coalesce(sum(c.amount_cents), 0) as net,
                                            coalesce(max(c.seq), 0) + 1 as seq
                                     from fine_ledger_corrections c
                                     where c.loan_id = f.loan_id and c.accrual_date = f.accrual_date) n
                 where a.amount_cents < n.net
                 offset 0) w
           on conflict on constraint fine_ledger_corrections_pkey do nothing
           returning reason"#,
        key.business_date,
        ids,
        key.job.as_str(),
        key.shard.shards(),
        key.shard.shard(),
        epoch,
    )
    .fetch_all(&mut *tx)
    .await?;
    Ok(Corrected::named(&reasons))
}

/// Queues each loan of `ids` for the re-check, as libraryd's changes are queued (a day of it is left for a run
/// to finish), unless a change of it is queued and not
/// yet found owed (such a change is not removed before a later re-check, at least `settle` after this
/// transaction, has looked at the loan again: a change already found owed might be, so it does not count).
pub async fn note_changes(tx: &mut PgConnection, ids: &[i64]) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "insert into fine_loan_changes (loan_id)
         select x.id from unnest($1::bigint[]) as x (id)
         where not exists (select 1 from fine_loan_changes c where c.loan_id = x.id and c.cleared_at is null)",
        ids
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// What one re-check found among the loans libraryd changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recheck {
    /// The days of the window with a changed loan still to charge or to correct: their accrual keys re-open.
    pub days: Vec<NaiveDate>,
    /// Changed loans looked at.
    pub changed: i64,
    /// Of them, loans with a day still to charge or to correct (their changes stay queued until it is done).
    pub dirty: i64,
    /// Changed loans libraryd deleted that have ledger rows: nothing is corrected for them.
    pub orphaned: Vec<i64>,
    /// Queued changes removed (their loans' ledgers are as owed in the window, or the loans are gone).
    pub cleared: i64,
    /// Queued changes marked as found owed for the first time, or unmarked because their loan needs work again.
    pub marked: i64,
    /// The re-check looked at its limit of queued changes: more wait.
    pub more: bool,
}

/// The accrual re-check of `shard` over the days `first..=last`: looks at (at most `limit`) queued changes of
/// the shard's loans, finds the days on which a changed loan is still to charge (owed, neither charged nor
/// queued) or to correct (charged, and its net is not what is owed), and — when `clear` — removes the changes of the loans that need nothing (and of
/// loans libraryd deleted) once two re-checks at least `settle` apart found them so: a batch that priced a day
/// from the loan's row before libraryd changed it, and had not committed when the first re-check looked, has
/// committed or failed by then (`settle` is `claim.batch_timeout`, which bounds a batch), and the second sees its
/// charge. One statement; its cost grows with the changes queued, not with the loans: each changed loan's row is
/// read by a key probe (the `offset 0` fence; as a join, the planner hashed the whole `loans` table for a
/// thousand changed loans, 539 ms of 871 ms at 1,000,000 loans). On Citus, several statements in one transaction
/// ([`crate::store::citus::recheck`]).
#[allow(clippy::too_many_arguments)]
pub async fn recheck(
    pool: &Db,
    shard: ShardSpec,
    first: NaiveDate,
    last: NaiveDate,
    limit: i64,
    clear: bool,
    settle: std::time::Duration,
) -> Result<Recheck, sqlx::Error> {
    if pool.engine() == crate::config::Engine::Citus {
        return crate::store::citus::recheck::recheck(pool, shard, first, last, limit, clear, settle).await;
    }
    let settle_ms = i64::try_from(settle.as_millis()).unwrap_or(i64::MAX) as f64;
    let row = sqlx::query!(
        r#"with seen as (
               select c.seq, c.loan_id from fine_loan_changes c
               where fine_settler_shard_of(c.loan_id, $1) = $2
               order by c.seq
               limit $5
           ), changed as (
               select distinct loan_id from seen
           ), work as (
               select t.loan_id, d.day
               from changed t
               cross join lateral (select l.due_on, l.returned_on, p.daily_rate_cents, p.grace_days, p.cap_cents,
                                          p.charge_closed_days
                                   from loans l
                                   cross join lateral fine_settler_policy_of(l.fine_class, l.due_on) p
                                   where l.id = t.loan_id offset 0) l
               cross join (select g::date as day from generate_series($3::date, $4::date, interval '1 day') g) d
               cross join lateral fine_settler_policy_day_amount(l.due_on, l.returned_on, d.day,
                                                                 l.daily_rate_cents, l.grace_days, l.cap_cents,
                                                                 l.charge_closed_days) a
               left join fine_ledger f on f.loan_id = t.loan_id and f.accrual_date = d.day
               cross join lateral (select coalesce(f.amount_cents, 0) + coalesce(sum(c.amount_cents), 0) as net
                                   from fine_ledger_corrections c
                                   where c.loan_id = t.loan_id and c.accrual_date = d.day) n
               where $3::date <= $4::date
                 and ((f.loan_id is null and a.amount_cents > 0
                       and not exists (select 1 from fine_pending p
                                       where p.loan_id = t.loan_id and p.accrual_date = d.day))
                   or (f.loan_id is not null and a.amount_cents <> n.net
                       and isfinite(l.due_on) and coalesce(isfinite(l.returned_on), true)))
           ), dirty as (
               select distinct loan_id from work
           ), orphaned as (
               select ch.loan_id from changed ch
               where not exists (select 1 from loans l where l.id = ch.loan_id)
                 and exists (select 1 from fine_ledger f where f.loan_id = ch.loan_id)
           ), cleared as (
               -- Found as owed by an earlier re-check long enough ago (`settle`), and again now.
               delete from fine_loan_changes c
               using seen s
               where $6 and c.seq = s.seq and not exists (select 1 from dirty x where x.loan_id = s.loan_id)
                 and c.cleared_at < now() - $7 * interval '1 millisecond'
               returning c.seq
           ), marked as (
               update fine_loan_changes c set cleared_at = now()
               from seen s
               where $6 and c.seq = s.seq and not exists (select 1 from dirty x where x.loan_id = s.loan_id)
                 and c.cleared_at is null
               returning c.seq
           ), unmarked as (
               update fine_loan_changes c set cleared_at = null
               from seen s
               where $6 and c.seq = s.seq and exists (select 1 from dirty x where x.loan_id = s.loan_id)
                 and c.cleared_at is not null
               returning c.seq
           )
           select coalesce((select array_agg(distinct w.day order by w.day) from work w), '{}') as "days!",
                  (select count(*) from changed) as "changed!",
                  (select count(*) from dirty) as "dirty!",
                  coalesce((select array_agg(o.loan_id order by o.loan_id) from orphaned o), '{}') as "orphaned!",
                  (select count(*) from cleared) as "cleared!",
                  (select count(*) from marked) + (select count(*) from unmarked) as "marked!",
                  (select count(*) from seen) >= $5 as "more!""#,
        shard.shards(),
        shard.shard(),
        first,
        last,
        limit,
        clear,
        settle_ms,
    )
    .fetch_one(pool)
    .await?;
    Ok(Recheck {
        days: row.days,
        changed: row.changed,
        dirty: row.dirty,
        orphaned: row.orphaned,
        cleared: row.cleared,
        marked: row.marked,
        more: row.more,
    })
}
