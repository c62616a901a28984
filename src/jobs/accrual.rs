//! Daily overdue accrual: for each loan of the shard owed day D, one ledger row `(loan, D, amount)` whose amount
//! is the day's canonical amount — a function of the loan, its policy (the version of its class in force on its
//! due date, `fine_policies`) and the closed days alone ([`crate::policy::Policy::day_amount`]): the earliest
//! chargeable days the rate, the day that reaches the cap the remainder, nothing after, nothing for a closed day —
//! so any order of runs leaves the ledger one sequential run leaves. A returned loan's net equals the fine the
//! month-end settlement sets.
//!
//! When a charged day is no longer owed as charged (a return back-dated before it, a due date moved), the run of
//! that day appends a correction ([`crate::store::corrections`]) in the same fenced batch transaction; a ledger
//! row is never updated or deleted. A batch writes its corrections first, then its charges.
//!
//! A batch first tries all its charges in one statement under a savepoint. If the database rejects it (a
//! constraint or trigger — deferred ones are checked inside the savepoint —, a lock or statement timeout), the
//! charges are retried one by one, each under its own savepoint, and those that still fail go to
//! `fine_pending` with the error; the rest of the batch commits, in the same fenced transaction. The
//! compensation pass ([`compensate`]) retries pending charges with capped exponential backoff until they
//! succeed or become DEAD after `accrual.max_attempts`.
//!
//! The cap holds in every committed state whatever runs at the same time: with a cap, every charge and correction locks
//! its loan (a transaction-scoped advisory lock, [`ledger::lock_loans`]) and clamps a positive amount to what is left
//! under the cap, read after the lock. The lock is what the cap still needs with canonical amounts: each run prices a
//! day from the loans row as its statement sees it, and two runs of different days of a loan libraryd changes meanwhile
//! could price from different rows — one before the change, one after — whose amounts together exceed the cap; under
//! the lock the second reads what the first wrote. While a loan's ledger is canonical the clamp never binds (canonical
//! amounts add up to at most the cap). A changed loan's ledger can hold more than owed on some days while another is
//! still short (a due date moved earlier); a batch whose day would not fit under the cap therefore first corrects that
//! loan's over-charged days, whatever their date ([`corrections::relieve`](crate::store::corrections::relieve)): one
//! pass over the days, in any order, leaves every day as owed. A charge is written only while the day is owed by the
//! loans row as the charge sees it.

use std::time::Duration;

use chrono::NaiveDate;
use sqlx::{Connection, PgConnection};

use crate::store::Db;

use super::{
    runner::{BatchJob, JobError, Written},
    RunKey,
};
use crate::{
    backoff::Backoff,
    shard::ShardSpec,
    store::{
        ledger::{self, Attempt, Charged, Clamp, Overdue, Pending, Scope},
        ledger_writes::LedgerWrites,
    },
};

/// The accrual job. Its amounts come from the database's fine rules (`fine_policies`, `library_closed_days`).
#[derive(Debug, Clone, Copy)]
pub struct Accrual {
    /// When a failed charge is retried: after its n-th failure, `backoff.delay(n)`.
    pub backoff: Backoff,
    /// Statement timeout of each charge while a failed batch is isolated row by row.
    pub row_timeout: Duration,
    /// How long isolating a rejected batch row by row may take; charges not tried by then are queued untried,
    /// so that the batch still commits well inside `claim.batch_timeout` (half of it).
    pub isolation_budget: Duration,
    /// How long a compensation retry waits for a row lock (`claim.lock_timeout`); a batch's charges run under
    /// the runner's.
    pub lock_timeout: Duration,
    /// Which loans a run looks at: every loan of the shard, or only those libraryd changed (a day the daemon's
    /// re-check re-opened).
    pub scope: Scope,
    /// The batch's writes as the server's engine plans them (`database.engine`).
    pub writes: LedgerWrites,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Accrual {
    /// The job as configured.
    pub fn from_settings(settings: &crate::config::Settings) -> Self {
        Accrual {
            backoff: Backoff::new(settings.accrual.retry_backoff, settings.accrual.retry_backoff_max),
            // Short enough that isolating a whole batch of locked rows stays inside the batch timeout.
            row_timeout: (settings.claim.lease.batch_timeout() / 20)
                .clamp(Duration::from_millis(50), Duration::from_secs(2)),
            isolation_budget: settings.claim.lease.batch_timeout() / 2,
            lock_timeout: settings.claim.lease.lock_timeout(),
            scope: Scope::Full,
            writes: LedgerWrites::new(settings.database.engine),
        }
    }

    /// The same job, looking only at the loans in `scope`.
    pub fn within(self, scope: Scope) -> Self {
        Accrual { scope, ..self }
    }

    /// One charge, under its own savepoint of `tx`: lock the loans (when some policy has a cap, unless the
    /// caller holds their locks already: a batch takes them all once), write, check deferred constraints. `Ok(Err(e))`: the
    /// database rejected it, and the savepoint was rolled back.
    async fn try_charge(
        &self,
        tx: &mut PgConnection,
        day: NaiveDate,
        ids: &[i64],
        locks: Locks,
        clamp: Clamp,
    ) -> Result<Result<Charged, sqlx::Error>, sqlx::Error> {
        let mut sp = tx.begin().await?;
        let attempt = async {
            if locks == Locks::Take {
                ledger::lock_loans(&mut sp, ids).await?;
            }
            let written = self.writes.charge(&mut sp, day, ids, clamp).await?;
            ledger::check_deferred_now(&mut sp).await?;
            Ok::<_, sqlx::Error>(written)
        }
        .await;
        match attempt {
            Ok(written) => {
                sp.commit().await?;
                Ok(Ok(written))
            }
            Err(e) if rejected(&e) => {
                sp.rollback().await?;
                Ok(Err(e))
            }
            Err(e) => Err(e),
        }
    }
}

/// Whether a charge takes its loans' locks itself or runs under those its batch took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Locks {
    Take,
    Held,
}

/// Whether the database rejected the statement (so the row can be isolated and queued), as opposed to the
/// connection failing (which fails the batch).
fn rejected(e: &sqlx::Error) -> bool {
    crate::store::classify(e).refused()
}

impl BatchJob for Accrual {
    type Batch = Vec<Overdue>;

    async fn late(&self, pool: &Db, key: &RunKey) -> Result<bool, JobError> {
        Ok(ledger::day_has_work(pool, key.business_date, key.shard).await?)
    }

    fn extent(batch: &Vec<Overdue>) -> (i64, i64) {
        (batch.last().map_or(i64::MAX, |r| r.id), batch.len() as i64)
    }

    async fn fetch(
        &self,
        pool: &Db,
        key: &RunKey,
        from_id: i64,
        limit: i64,
    ) -> Result<Option<Vec<Overdue>>, JobError> {
        let rows =
            ledger::overdue_batch(pool, key.business_date, key.shard, self.scope, from_id, limit).await?;
        Ok((!rows.is_empty()).then_some(rows))
    }

    async fn write(
        &self,
        tx: &mut PgConnection,
        key: &RunKey,
        epoch: i64,
        rows: &Vec<Overdue>,
    ) -> Result<Written, JobError> {
        // One day per batch: a loan gets either a correction (the day is charged) or a charge (it is not). When
        // some policy has a cap, every loan's lock is taken first, in the one lock order, and held to the batch's
        // end (a loan another transaction holds is left out, and queued); a loan whose day does not fit under
        // its cap is held back, and written once its other days are relieved (a loan without a cap is never
        // held back).
        let (day, retry_in) = (key.business_date, self.backoff.delay(1));
        let ids = lock_batch(
            tx,
            self.writes,
            day,
            rows.iter().map(|r| r.id).collect(),
            retry_in,
        )
        .await?;
        let clamp = Clamp::Hold;
        let (mut corrected, mut held) = self.writes.correct(tx, key, epoch, &ids, clamp).await?;
        let charged = self.charge_batch(tx, key.business_date, ids, clamp).await?;
        held.extend(charged.held);
        let relieved = if held.is_empty() {
            Written::default()
        } else {
            self.relieve_held(tx, key, epoch, held).await?
        };
        corrected.add(&relieved.corrected);
        Ok(Written {
            updated: charged.written + relieved.updated,
            corrected,
        })
    }
}

/// Takes the batch's loan locks ([`ledger::lock_loans`]) under a savepoint, and returns the loans the batch then
/// writes. If a lock waits past `claim.lock_timeout` (or is chosen to break a deadlock) — another transaction holds the
/// loan: a concurrent key of a backfill, a peer's batch, a compensation retry, a manual `accrue` — the batch takes
/// instead every lock it can without waiting, and leaves out the loans whose lock is held (a lock wait never fails a
/// run: before this, one loan held past the lock timeout failed the whole run at every tick). A left-out loan not yet
/// charged on the day is queued in `fine_pending`, whose compensation pass charges it once the lock is let go, whatever
/// the day; one charged on the day (a correction) is queued for the accrual's re-check
/// ([`corrections::note_changes`](crate::store::corrections::note_changes)), which re-opens the day while it is in the
/// catch-up window — outside it, a plain `accrue --date D` re-opens the day (its late-row question sees the
/// correction).
async fn lock_batch(
    tx: &mut PgConnection,
    writes: LedgerWrites,
    day: NaiveDate,
    ids: Vec<i64>,
    retry_in: Duration,
) -> Result<Vec<i64>, JobError> {
    let mut all = tx.begin().await?;
    match ledger::lock_loans(&mut all, &ids).await {
        Ok(()) => {
            all.commit().await?;
            return Ok(ids);
        }
        Err(e) if crate::store::lock_not_available(&e) => {
            all.rollback().await?;
            tracing::debug!(error = %e, "a loan of the batch is locked by another transaction");
        }
        Err(e) => return Err(e.into()),
    }
    ledger::lock_loans(tx, &[]).await?;
    let held = ledger::try_lock_loans(tx, &ids).await?;
    if held.is_empty() {
        return Ok(ids);
    }
    let charged = ledger::charged_on(tx, day, &held).await?;
    let (corrections, charges): (Vec<i64>, Vec<i64>) =
        held.iter().partition(|id| charged.binary_search(id).is_ok());
    let error = "the loan was locked by another transaction past claim.lock_timeout; left out of its batch";
    writes.enqueue(tx, &charges, day, error, millis(retry_in)).await?;
    writes.note_changes(tx, &corrections).await?;
    const SHOWN: usize = 20;
    tracing::warn!(
        accrual_date = %day,
        left_out = held.len(),
        loans = ?&held[..held.len().min(SHOWN)],
        charges_queued = charges.len(),
        corrections_queued = corrections.len(),
        "loans locked by another transaction were left out of the batch: their charges are queued for \
         compensation, their corrections for the re-check"
    );
    Ok(ids
        .into_iter()
        .filter(|id| held.binary_search(id).is_err())
        .collect())
}

impl Accrual {
    /// The loans a batch held back (their day did not fit under the cap): their other over-charged days are corrected
    /// first ([`corrections::relieve`](crate::store::corrections::relieve)), then their day is corrected or charged
    /// again — it fits now, and the cap's guard cuts it should anything else have happened meanwhile. Returns what this
    /// wrote.
    async fn relieve_held(
        &self,
        tx: &mut PgConnection,
        key: &RunKey,
        epoch: i64,
        mut held: Vec<i64>,
    ) -> Result<Written, JobError> {
        held.sort_unstable();
        held.dedup();
        let mut corrected = self.writes.relieve(tx, key, epoch, &held).await?;
        let (again, _) = self.writes.correct(tx, key, epoch, &held, Clamp::Cut).await?;
        corrected.add(&again);
        let charged = self.charge_batch(tx, key.business_date, held, Clamp::Cut).await?;
        Ok(Written {
            updated: charged.written,
            corrected,
        })
    }

    /// The batch's charges: in one statement under a savepoint; if the database rejects it, each charge under
    /// its own, and those rejected again (or not tried in the isolation budget) queued for compensation.
    async fn charge_batch(
        &self,
        tx: &mut PgConnection,
        day: NaiveDate,
        ids: Vec<i64>,
        clamp: Clamp,
    ) -> Result<Charged, JobError> {
        let started = tokio::time::Instant::now();
        match self.try_charge(tx, day, &ids, Locks::Held, clamp).await? {
            Ok(charged) => return Ok(charged),
            Err(e) => {
                tracing::warn!(error = %e, rows = ids.len(), "batch charge rejected; isolating the failing loans")
            }
        }

        let row_timeout = format!("{}ms", self.row_timeout.as_millis());
        let batch_timeout = ledger::set_local_statement_timeout(tx, &row_timeout).await?;
        // The batch's loan locks, taken before its first savepoint, are still held: isolating takes no new ones.
        let (mut charged, mut queued) = (Charged::default(), 0u64);
        let delay = millis(self.backoff.delay(1));
        for id in ids {
            let error = if started.elapsed() < self.isolation_budget {
                match self.try_charge(tx, day, &[id], Locks::Held, clamp).await? {
                    Ok(one) => {
                        charged.written += one.written;
                        charged.held.extend(one.held);
                        continue;
                    }
                    Err(e) => e.to_string(),
                }
            } else {
                // Isolating every row of a batch that meets, say, a table-wide lock would outlast the batch
                // timeout and fail the run; the rest is left to the compensation pass instead.
                "not tried: isolating a rejected batch ran out of time; the compensation pass retries it"
                    .into()
            };
            self.writes.enqueue(tx, &[id], day, &error, delay).await?;
            queued += 1;
            tracing::warn!(loan_id = id, accrual_date = %day, error = %error, "charge failed; queued for compensation");
        }
        // The batch's statements after these (relieving held loans, its fence) run under its own timeout.
        ledger::set_local_statement_timeout(tx, &batch_timeout).await?;
        tracing::info!(written = charged.written, queued, "isolated a rejected batch");
        Ok(charged)
    }
}

/// What a compensation pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Compensation {
    /// Pending charges written to the ledger.
    pub charged: u64,
    /// Pending charges resolved without a charge: the day was charged meanwhile, the cap was reached, or the
    /// loan is no longer overdue on that day (its return was back-dated before it).
    pub not_owed: u64,
    /// Pending charges whose day did not fit under the cap because other days of the loan hold more than they
    /// owe (the loan changed, or the policy did, since they were charged): resolved without a charge, and the
    /// loan queued for the accrual's re-check, whose run relieves those days and charges this one.
    pub held_back: u64,
    /// Charges that failed again and wait for their next attempt.
    pub retried: u64,
    /// Charges that failed for the last time and became DEAD.
    pub dead: u64,
    /// The pass stopped (shutdown, or its time budget spent) with charges of its snapshot not yet tried.
    pub stopped_early: bool,
}

/// Bounds on one compensation pass of the daemon's tick: it stops (between charges) on shutdown or once its time
/// budget is spent — the rest waits for the next tick — and reports each charge as progress, so that a long
/// backlog neither outlasts the drain timeout nor looks like a stalled loop to `/healthz` and the watchdog.
#[derive(Debug, Default)]
pub struct PassLimits {
    pub cancel: Option<tokio_util::sync::CancellationToken>,
    pub budget: Option<Duration>,
    /// Told of every charge as progress (the daemon's heartbeat), if anything is.
    pub heartbeat: Option<std::sync::Arc<crate::health::Heartbeat>>,
    /// Told of every charge the pass handles (one row scanned; one updated if charged), if anything is.
    pub progress: Option<crate::progress::RowsHook>,
}

/// Retries pending charges without limits (see [`compensate_within`]).
pub async fn compensate(
    pool: &Db,
    accrual: &Accrual,
    shard: Option<ShardSpec>,
    due_only: bool,
    max_attempts: u32,
) -> Result<Compensation, sqlx::Error> {
    compensate_within(
        pool,
        accrual,
        shard,
        due_only,
        max_attempts,
        &PassLimits::default(),
    )
    .await
}

/// Retries pending charges: those of `shard` that are due (or, with `due_only = false`, every PENDING one).
/// Each charge is its own transaction: lock the pending row (skipping one another replica holds, or one that
/// changed since the list was read), charge it under the loan's lock and remove it; or, if the charge is
/// rejected again, count the attempt and schedule the next (DEAD after `max_attempts`; a retry held up by a lock
/// counts none, see [`reschedule`]).
pub async fn compensate_within(
    pool: &Db,
    accrual: &Accrual,
    shard: Option<ShardSpec>,
    due_only: bool,
    max_attempts: u32,
    limits: &PassLimits,
) -> Result<Compensation, sqlx::Error> {
    let started = tokio::time::Instant::now();
    let over = || {
        limits.cancel.as_ref().is_some_and(|c| c.is_cancelled())
            || limits.budget.is_some_and(|b| started.elapsed() >= b)
    };
    let mut result = Compensation::default();
    // Due-only passes loop: every row they process leaves the due set (charged, or rescheduled). A retry-now pass
    // takes one snapshot of every PENDING row, since a row that fails again stays PENDING.
    let limit = if due_only { 500 } else { i64::MAX };
    loop {
        let batch = ledger::due_pending(pool, shard, due_only, limit).await?;
        if batch.is_empty() {
            break;
        }
        let mut progressed = false;
        for p in &batch {
            if over() {
                result.stopped_early = true;
                return Ok(result);
            }
            if let Some(h) = &limits.heartbeat {
                h.progress_now();
            }
            let Some(retried) = retry_pending(pool, accrual, p, due_only, max_attempts).await? else {
                continue;
            };
            // A charge that only waited for a lock may be due again before the pass ends, and would be
            // retried again and again while the lock is held: it is no progress.
            progressed |= retried != Retried::Busy;
            result.count(retried);
            if let Some(progress) = &limits.progress {
                progress.call(1, 0);
            }
        }
        // A batch without progress is held by other replicas: leave it to them.
        if !due_only || !progressed {
            break;
        }
    }
    Ok(result)
}

/// What became of one pending charge a compensation pass retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retried {
    /// Written to the ledger.
    Charged,
    /// Resolved without a charge: nothing is owed for that day any more.
    NotOwed,
    /// Rejected again; it waits for its next attempt.
    Again,
    /// Waited too long for a lock (or was cancelled to break a deadlock); it waits for its next attempt, which
    /// this one did not spend.
    Busy,
    /// Rejected for the last time: DEAD.
    Dead,
    /// Held back by the cap while other days of the loan hold more than they owe: left to the re-check.
    HeldBack,
}

impl Compensation {
    fn count(&mut self, retried: Retried) {
        match retried {
            Retried::Charged => self.charged += 1,
            Retried::NotOwed => self.not_owed += 1,
            Retried::Again | Retried::Busy => self.retried += 1,
            Retried::Dead => self.dead += 1,
            Retried::HeldBack => self.held_back += 1,
        }
    }
}

/// Retries one pending charge in a transaction of its own; `None` if its row is not to be had (another replica
/// holds it, or it changed since the list was read).
async fn retry_pending(
    pool: &Db,
    accrual: &Accrual,
    p: &Pending,
    due_only: bool,
    max_attempts: u32,
) -> Result<Option<Retried>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    crate::store::set_local_lock_timeout(&mut tx, accrual.lock_timeout).await?;
    let Some(attempts) = ledger::lock_pending(&mut tx, p, due_only).await? else {
        return Ok(None);
    };
    if spent(attempts, max_attempts) {
        // Every attempt is used: the batch's own failed charge was the first (`attempts` 1 when queued), so with
        // `max_attempts = 1` a queued charge is never tried again; so is one whose `max_attempts` was lowered.
        ledger::give_up(&mut tx, p.loan_id, p.accrual_date).await?;
        tx.commit().await?;
        tracing::error!(loan_id = p.loan_id, accrual_date = %p.accrual_date, attempts,
            "pending charge is DEAD: it had all its attempts; an operator must look at it");
        return Ok(Some(Retried::Dead));
    }
    let charge = accrual
        .try_charge(&mut tx, p.accrual_date, &[p.loan_id], Locks::Take, Clamp::Hold)
        .await?;
    let retried = match charge {
        Ok(charged) if !charged.held.is_empty() => {
            // Relieving the other days is a run's work (each correction names the run that wrote it): the
            // loan goes to the re-check, which re-opens this day once its pending row is gone.
            ledger::resolve(&mut tx, p.loan_id, p.accrual_date).await?;
            accrual.writes.note_changes(&mut tx, &[p.loan_id]).await?;
            tx.commit().await?;
            tracing::warn!(loan_id = p.loan_id, accrual_date = %p.accrual_date,
                "pending charge held back: the loan's other days hold more than they owe under the cap; \
                 left to the accrual's re-check, which corrects them and charges this day while it is in the \
                 catch-up window (an older day: run `fine-settler accrue --date` with this day)");
            Retried::HeldBack
        }
        Ok(charged) => {
            ledger::resolve(&mut tx, p.loan_id, p.accrual_date).await?;
            tx.commit().await?;
            if charged.written > 0 {
                tracing::info!(loan_id = p.loan_id, accrual_date = %p.accrual_date, attempts = attempts + 1, "pending charge compensated");
                Retried::Charged
            } else {
                tracing::info!(loan_id = p.loan_id, accrual_date = %p.accrual_date,
                    "pending charge resolved without a charge: nothing is owed for that day any more");
                Retried::NotOwed
            }
        }
        Err(e) => reschedule(tx, accrual, p, attempts, &e, max_attempts).await?,
    };
    Ok(Some(retried))
}

/// Whether a charge tried `attempts` times has had all of `max_attempts` (`accrual.max_attempts` counts every
/// attempt, the batch's first charge included).
fn spent(attempts: i32, max_attempts: u32) -> bool {
    u32::try_from(attempts).unwrap_or(0) >= max_attempts
}

/// A retried charge failed again: schedules the next attempt, or makes it DEAD after `max_attempts`; commits
/// `tx`. A charge the database rejected spends an attempt. One that only waited too long for a lock, or was
/// cancelled to break a deadlock (`lock_not_available`: libraryd or a peer's batch holding the loan), spends
/// none — a lock says nothing of the charge, and on a busy server such waits sent sound charges to DEAD — and waits
/// twice as long as last time before the next try, up to `accrual.retry_backoff_max`; it is never made DEAD for
/// that, and once its wait reaches the maximum every such retry is logged at error level.
async fn reschedule(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    accrual: &Accrual,
    p: &Pending,
    attempts: i32,
    error: &sqlx::Error,
    max_attempts: u32,
) -> Result<Retried, sqlx::Error> {
    let key = (p.loan_id, p.accrual_date);
    if crate::store::lock_not_available(error) {
        let (first, max) = (accrual.backoff.delay(1), accrual.backoff.delay(u32::MAX));
        let waits =
            ledger::retry_failed(&mut tx, key, &error.to_string(), Attempt::Busy { first, max }).await?;
        tx.commit().await?;
        if waits + Duration::from_millis(1) >= max {
            tracing::error!(loan_id = p.loan_id, accrual_date = %p.accrual_date, error = %error,
                wait = %humantime::format_duration(waits),
                "pending charge held up by a lock at every retry: it is retried every accrual.retry_backoff_max \
                 until the lock is let go; look for the transaction holding it (pg_locks)");
        } else {
            tracing::debug!(loan_id = p.loan_id, accrual_date = %p.accrual_date, error = %error,
                wait = %humantime::format_duration(waits), "pending charge held up by a lock; retried later");
        }
        return Ok(Retried::Busy);
    }
    let attempts = attempts.saturating_add(1);
    let dead = spent(attempts, max_attempts);
    let retry_in = accrual.backoff.delay(u32::try_from(attempts).unwrap_or(0));
    ledger::retry_failed(
        &mut tx,
        key,
        &error.to_string(),
        Attempt::Spent { retry_in, dead },
    )
    .await?;
    tx.commit().await?;
    if !dead {
        return Ok(Retried::Again);
    }
    tracing::error!(
        loan_id = p.loan_id,
        accrual_date = %p.accrual_date,
        attempts,
        error = %error,
        "pending charge is DEAD after its last attempt; an operator must look at it"
    );
    Ok(Retried::Dead)
}
