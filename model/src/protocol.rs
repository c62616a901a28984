//! The transitions. Each is one statement (or one commit) of the product as `src/store/job_runs.rs`,
//! `src/store/loans.rs`, `src/store/ledger.rs`, `src/store/corrections.rs` and `src/jobs/runner.rs` implement it,
//! one fault, a change libraryd makes, or the clock; the comment on each names what it stands for.
//!
//! Granularity, and why it is enough:
//! - The tick's status read and the claim statement are one step. Every claim statement re-checks the row itself
//!   (`on conflict do nothing`, the takeover's and the re-open's `where`), so a status read gone stale between
//!   the two can only make the claim skip or re-open a key with nothing left, never win a key it should not.
//! - The fence and the commit are one step. Between them the transaction holds the `job_runs` row lock with the
//!   renewed lease, so a takeover in between waits and then re-reads the row (EvalPlanQual): it is ordered after
//!   the commit, or after the rollback if the transaction is aborted.
//! - A process that is not frozen takes no time inside a run: its batches end well within `batch_timeout`
//!   (the runner abandons a slower one) and `batch_timeout < lease`. The clock advances only while every process
//!   is idle, frozen or waiting for a lock, so a lease lapses only when its owner stops (a crash, a freeze), which
//!   is what the lease is for. A *slow* process is a frozen one that thaws.
//! - Faults that are other faults in disguise are not steps of their own: a claim whose reply is lost is a claim
//!   followed by a crash (the key stays RUNNING under an epoch nobody works on until its lease runs out); a batch
//!   that commits but whose reply is lost is a commit followed by a stop (the run fails and ends FAILED, its finish
//!   retried); a fetch that fails is a stop before the fetch. The finish's lost reply is its own fault: its retry
//!   is a different statement outcome (0 rows, the row already in the target state under its own epoch).
//! - `first_id` (the "anything to do at all?" read at the start of a run) is not modelled: when it says nothing,
//!   the first fetch finds nothing too.
//! - PostgreSQL's own isolation is assumed: each statement reads the latest committed state (READ COMMITTED), an
//!   uncommitted write is invisible and its row locked until commit or rollback.
//! - An accrual batch's writes — with a cap the per-loan lock and the relief, then the corrections and the
//!   charges — are one step, taken once nothing it must wait for is held: the lock, or (without a cap) a row with
//!   the same key another open transaction inserted (the day's charge, or its correction with the same `seq`).
//!   The statements after the lock read committed state after every other writer of the loan ended, plus what the
//!   batch's own earlier statements wrote (the relief's corrections, which the correction's and the charge's room
//!   under the cap counts); without a cap (and so without relief), a statement that waits on a key took its
//!   snapshot before the wait, but what it then writes is what the step writes in a behaviour where libraryd's
//!   change (the only other writer, which commutes with the other transaction's commit or rollback) comes after
//!   it. For one loan and day only one of the two statements writes: a correction needs the day's charge
//!   committed, a charge needs it absent; the relief writes only on the loan's other days.

use stateright::{Model, Property};

use crate::{
    setup::{Change, Job, Mutation, Partition, Setup},
    state::{
        Actor, Batch, ClaimKind, Day, Db, Ending, JobRun, Libraryd, Loan, LoanDates, Phase, Run, State,
        Status, Tx, ACTORS, MAX_DAYS, MAX_KEYS, MAX_LOANS, OPERATOR,
    },
};

/// The protocol of one scenario, possibly with one deliberate mistake.
#[derive(Clone, Debug)]
pub struct Protocol {
    pub setup: Setup,
    pub mutation: Option<Mutation>,
    /// Whether states that differ only in which replica of a shard is which count as one (see [`Self::canonical`]).
    pub symmetric: bool,
}

/// A step of the model. `u8` fields are process (actor) indices unless named `key`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A replica's tick: its status read, then the claim statement for `key`.
    Tick { actor: u8, key: u8 },
    /// The operator's `settle --force` claims the force key.
    Force,
    /// The operator's `release`.
    Release { key: u8 },
    /// The batch read, outside the transaction.
    Fetch(u8),
    /// The batch transaction's business writes.
    Write(u8),
    /// The fence and the commit (or, when the fence matches nothing, the rollback).
    Commit(u8),
    /// Fault: the connection breaks inside the batch transaction; it rolls back and the run fails.
    ConnectionLost(u8),
    /// The statement that ends the run.
    Finish(u8),
    /// Fault: the finish commits but the reply is lost; the runner retries it.
    FinishReplyLost(u8),
    /// Fault: SIGTERM; the run stops between batches and hands its key back.
    Stop(u8),
    /// Fault: SIGKILL; the process restarts with nothing, its open transaction rolls back.
    Crash(u8),
    /// Fault: SIGSTOP (or a paused VM).
    Freeze(u8),
    /// SIGCONT.
    Thaw(u8),
    /// The server aborts a transaction idle for `batch_timeout` (`idle_in_transaction_session_timeout`).
    IdleAbort(u8),
    /// The database clock advances one step.
    ClockTick,
    /// libraryd records the late loan's return, back-dated into the settled month.
    LateReturn,
    /// libraryd's transaction locks a loan row.
    LibrarydLocks(u8),
    /// libraryd's transaction ends.
    LibrarydCommits,
    /// libraryd changes the accrual loan's row: the change of that index in [`crate::setup::AccrualSpec::changes`].
    Change(u8),
}

/// What a run's write of one accrual day does, read from committed state (`corrections::relieve` with a cap,
/// `corrections::correct`, then `ledger::charge`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DayWrite {
    /// The relief's corrections of the loan's other days, by day: `seq` and amount.
    pub relief: [Option<(u8, i16)>; MAX_DAYS],
    /// The charge inserted, if the day has none.
    pub charge: Option<i16>,
    /// The correction inserted, if the day has a charge and its net is not its amount: `seq` and amount.
    pub correction: Option<(u8, i16)>,
    /// The cap held back some of a positive amount.
    pub held: bool,
}

impl Protocol {
    pub fn new(setup: Setup, mutation: Option<Mutation>) -> Protocol {
        assert!(setup.keys.len() <= MAX_KEYS && setup.loans.len() <= MAX_LOANS);
        assert!(setup
            .accrual
            .is_none_or(|a| usize::from(a.day_count) <= MAX_DAYS && a.day_count >= 1));
        assert!(usize::from(setup.replicas) <= OPERATOR);
        assert!(
            setup.loans.windows(2).all(|w| w[0].id < w[1].id),
            "loans in id order"
        );
        assert!(setup.batch_size >= 1 && setup.lease >= 1);
        // claim.lease must exceed claim.batch_timeout (config.rs enforces it): the server aborts a frozen
        // process's transaction before that process's lease can run out.
        assert!(i16::from(setup.lease) > i16::from(setup.batch_timeout));
        Protocol {
            setup,
            mutation,
            symmetric: false,
        }
    }

    /// The same protocol, with replicas of one shard interchangeable.
    pub fn symmetric(self) -> Protocol {
        Protocol {
            symmetric: true,
            ..self
        }
    }

    /// Symmetry reduction: replicas of the same shard run the same code and the database does not record which
    /// process owns a key (the owner name is only for people), so swapping two of them changes nothing any
    /// property or step can tell. Sorting them gives one representative per class (about half the states).
    pub fn canonical(&self, s: &mut State) {
        for shard in 0..self.setup.shards {
            let same: Vec<usize> = (0..OPERATOR)
                .filter(|&a| self.shard_of(a) == Some(shard))
                .collect();
            let mut actors: Vec<Actor> = same.iter().map(|&a| s.actors[a]).collect();
            actors.sort();
            for (&a, actor) in same.iter().zip(actors) {
                s.actors[a] = actor;
            }
        }
    }

    pub fn mutated(&self, m: Mutation) -> bool {
        self.mutation == Some(m)
    }

    pub fn initial(&self) -> State {
        let unsettled = Loan {
            eligible: false,
            settled: false,
            writes: 0,
            by_reopen: false,
            left_for_reopen: false,
        };
        let mut loans = [unsettled; MAX_LOANS];
        for (loan, spec) in loans.iter_mut().zip(&self.setup.loans) {
            loan.eligible = !spec.late;
        }
        State {
            db: Db {
                runs: [JobRun::ABSENT; MAX_KEYS],
                loans,
                dates: LoanDates {
                    due_on: self.setup.accrual.map_or(0, |a| a.due_on),
                    returned_on: None,
                    changed: false,
                },
                ledger: [Day::EMPTY; MAX_DAYS],
                libraryd: Libraryd::Unused,
            },
            actors: [Actor {
                phase: Phase::Idle,
                frozen: false,
            }; ACTORS],
            faults_left: self.setup.faults,
            stale_commit: false,
            held_back: false,
            relieved: false,
        }
    }

    /// The shard a replica owns; the operator owns none.
    pub fn shard_of(&self, actor: usize) -> Option<u8> {
        (actor < usize::from(self.setup.replicas)).then(|| actor as u8 % self.setup.shards)
    }

    /// The loans (indices) a key's runs work on: the key's shard of the month's loans, or its shard's overdue loan.
    pub fn loans_of(&self, key: usize) -> impl Iterator<Item = usize> + '_ {
        let spec = self.setup.keys[key];
        (0..self.setup.loans.len()).filter(move |&i| {
            let member = match spec.partition {
                Partition::Shard(shard) => self.setup.loan_shard(i) == shard,
                Partition::Whole => true,
            };
            member
                && match spec.job {
                    Job::Settlement => true,
                    Job::Accrual { .. } => self.setup.accrual.is_some_and(|a| a.loan == i),
                }
        })
    }

    /// The accrual day (an index into the days) `key` runs, if it is an accrual key.
    pub fn day_of(&self, key: usize) -> Option<usize> {
        match self.setup.keys[key].job {
            Job::Settlement => None,
            Job::Accrual { day } => Some(usize::from(day)),
        }
    }

    /// The accrual days in use.
    pub fn days(&self) -> std::ops::Range<usize> {
        0..self.setup.accrual.map_or(0, |a| usize::from(a.day_count))
    }

    /// `fine_settler_day_amount` (grace 0): the canonical amount of day `d` for the loan as `dates` has it, a
    /// function of the loan alone — 0 if the day is not owed (on or before the due date, or after the return),
    /// else `clamp(cap - rate * k, 0, rate)` with `k` owed days before it (the rate when there is no cap).
    pub fn day_amount(&self, dates: &LoanDates, d: usize) -> i16 {
        let Some(a) = self.setup.accrual else {
            return 0;
        };
        let day = a.days[d];
        if !owed(dates, day) {
            return 0;
        }
        if a.cap == 0 {
            return a.rate;
        }
        let before = i32::from(day) - i32::from(dates.due_on) - 1;
        let left = i32::from(a.cap) - i32::from(a.rate) * before;
        left.clamp(0, i32::from(a.rate)) as i16
    }

    /// What the ledger holds for the accrual loan, every day's net together.
    pub fn ledger_total(&self, db: &Db) -> i16 {
        self.days().map(|d| db.ledger[d].net()).sum()
    }

    /// A positive amount as far as the cap leaves room for it (`least(amount, cap - net_total)`), and whether the
    /// cap held some of it back.
    fn within_room(&self, db: &Db, amount: i16) -> (i16, bool) {
        let cap = self.setup.accrual.map_or(0, |a| a.cap);
        if cap == 0 {
            return (amount, false);
        }
        let room = (cap - self.ledger_total(db)).max(0);
        (amount.min(room), amount > room)
    }

    /// The relief of a batch of day `d` (`corrections::relieve`, with a cap, under the lock, before anything else
    /// the batch writes): for a changed loan whose day `d` is owed (its amount above 0) and would not fit under
    /// the cap — what the loan holds in total plus `max(amount(d) - net(d), 0)` exceeds it — every other charged
    /// day `e` whose net exceeds its amount gets the correction `amount(e) - net(e)`, as its next `seq`. Nothing
    /// under [`Mutation::NoRelief`].
    pub fn relief(&self, db: &Db, d: usize) -> [Option<(u8, i16)>; MAX_DAYS] {
        let mut relief = [None; MAX_DAYS];
        let Some(a) = self.setup.accrual else {
            return relief;
        };
        let target = self.day_amount(&db.dates, d);
        let owing = (target - db.ledger[d].net()).max(0);
        if a.cap == 0
            || self.mutated(Mutation::NoRelief)
            || !db.dates.changed
            || target <= 0
            || self.ledger_total(db) + owing <= a.cap
        {
            return relief;
        }
        for e in self.days().filter(|&e| e != d) {
            let entry = db.ledger[e];
            let amount = self.day_amount(&db.dates, e);
            if entry.charge.is_some() && amount < entry.net() {
                relief[e] = Some((entry.seq + 1, amount - entry.net()));
            }
        }
        relief
    }

    /// What a write of day `d` does against the `committed` state. With a cap, the relief first
    /// ([`Self::relief`]); the statements after it see its corrections. Then the correction
    /// (`corrections::correct`): for a charged day whose net is not its canonical amount, the difference as the
    /// day's next `seq`, a positive one within the cap. Then the charge (`ledger::charge`): for a day not charged,
    /// its canonical amount within the cap — or, with [`Mutation::AmountFromLedgerTotal`], `least(rate, cap -
    /// sum)` for an owed day.
    pub fn day_write(&self, committed: &Db, d: usize) -> DayWrite {
        let relief = self.relief(committed, d);
        let mut relieved = *committed;
        for (entry, correction) in relieved.ledger.iter_mut().zip(relief) {
            if let Some((seq, amount)) = correction {
                self.commit_correction(entry, seq, amount);
            }
        }
        let db = &relieved;
        let entry = db.ledger[d];
        let target = self.day_amount(&db.dates, d);
        let mut write = DayWrite {
            relief,
            charge: None,
            correction: None,
            held: false,
        };
        match entry.charge {
            None => {
                let amount = match self.setup.accrual {
                    Some(a) if self.mutated(Mutation::AmountFromLedgerTotal) => {
                        if owed(&db.dates, a.days[d]) {
                            a.rate
                        } else {
                            0
                        }
                    }
                    _ => target,
                };
                let (amount, held) = self.within_room(db, amount);
                write.charge = (amount > 0).then_some(amount);
                write.held = held;
            }
            Some(_) => {
                let delta = target - entry.net();
                let (delta, held) = if delta > 0 {
                    self.within_room(db, delta)
                } else {
                    (delta, false)
                };
                write.correction = (delta != 0).then_some((entry.seq + 1, delta));
                write.held = held;
            }
        }
        write
    }

    /// Whether loan `i` still needs work under `key`, as the batch query sees committed data, whichever loans the
    /// run looks at: for settlement `fine_settled_at is null and returned_on` in the month; for accrual a charge
    /// or a correction of the key's day ([`Self::day_has_work`]).
    pub fn to_do(&self, db: &Db, key: usize, i: usize) -> bool {
        match self.setup.keys[key].job {
            Job::Settlement => db.loans[i].eligible && !db.loans[i].settled,
            Job::Accrual { day } => {
                self.setup.accrual.is_some_and(|a| a.loan == i) && self.day_has_work(db, usize::from(day))
            }
        }
    }

    /// Whether day `d` of the accrual loan has work, as `ledger::overdue_batch`, `ledger::day_has_work` and the
    /// re-check find it: not charged and owed (its amount above 0), or charged and its net not its amount. The
    /// cap is not asked: a loan at its cap is found too (its write is then what [`Self::day_write`] says, which
    /// the relief keeps from being clamped).
    pub fn day_has_work(&self, db: &Db, d: usize) -> bool {
        let entry = db.ledger[d];
        let target = self.day_amount(&db.dates, d);
        match entry.charge {
            None => target > 0,
            Some(_) => entry.net() != target,
        }
    }

    /// Whether `key` still has rows to do, in any loan of its partition.
    pub fn undone(&self, db: &Db, key: usize) -> bool {
        self.loans_of(key).any(|i| self.to_do(db, key, i))
    }

    /// Whether a SUCCESS `key` is re-opened. Settlement: the tick's status read finds rows still to do. The fleet's
    /// accrual key: the re-check finds its day has work on a loan libraryd changed (it reads only those; a day
    /// whose work no change explains is never re-opened). The operator's key: `accrue` asks about every loan of the
    /// day (`ledger::day_has_work`). A run the re-check re-opened looks only at the changed loans
    /// (`Scope::Changed`); here that is the loan, which is changed for good once it is.
    pub fn reopens(&self, db: &Db, key: usize) -> bool {
        let spec = self.setup.keys[key];
        match (spec.job, spec.partition) {
            (Job::Accrual { .. }, Partition::Shard(_)) => db.dates.changed && self.undone(db, key),
            _ => self.undone(db, key),
        }
    }

    /// The claim statements (`job_runs::claim`), each one statement at database time, in the order a run tries
    /// them. `bounded` applies the model's epoch bound (the fault-free runs that check liveness ignore it).
    pub fn claim(&self, db: &Db, key: usize, force: bool, bounded: bool) -> Option<(JobRun, ClaimKind)> {
        let row = db.runs[key];
        let lease = self.setup.lease;
        let (kind, cursor) = match row.status {
            // insert (..., 'RUNNING', epoch 1, lease_until = now() + lease) on conflict do nothing returning epoch
            Status::Absent => {
                let run = JobRun {
                    status: Status::Running,
                    epoch: 1,
                    lease,
                    cursor: None,
                };
                return Some((run, ClaimKind::Inserted));
            }
            // A live RUNNING owner is never displaced, not even by force.
            Status::Running if row.held() => return None,
            // update ... set epoch = epoch + 1, lease_until = now() + lease
            //   where key and (status = 'FAILED' or (status = 'RUNNING' and lease_until < now()) or ($force and
            //   status = 'SUCCESS')); force also sets cursor = null.
            Status::Failed | Status::Running if force => (ClaimKind::Forced { from_success: false }, None),
            Status::Failed | Status::Running => (
                ClaimKind::TakenOver {
                    resumed: row.cursor.is_some(),
                },
                row.cursor,
            ),
            Status::Success if force => (ClaimKind::Forced { from_success: true }, None),
            // The re-open: a SUCCESS key whose business date still has rows of its shard to do is claimed under
            // epoch + 1 with the cursor reset (`where key and status = 'SUCCESS'`), and walks what is left.
            Status::Success if self.reopens(db, key) && !self.mutated(Mutation::NoReopen) => {
                (ClaimKind::Reopened, None)
            }
            Status::Success => return None,
        };
        let epoch = row.epoch + 1;
        if bounded && epoch > self.setup.max_epoch {
            return None;
        }
        let run = JobRun {
            status: Status::Running,
            epoch,
            lease,
            cursor,
        };
        Some((run, kind))
    }

    /// The batch read (`loans::next_batch` / `ledger::overdue_batch`), outside the transaction: up to `batch_size`
    /// rows still to do with `id > cursor`, in id order. `None`: nothing left, the run is done.
    pub fn fetch(&self, db: &Db, run: &Run) -> Option<Batch> {
        let key = usize::from(run.key);
        let last = self
            .loans_of(key)
            .filter(|&i| after(run.cursor, self.setup.loans[i].id) && self.to_do(db, key, i))
            .take(usize::from(self.setup.batch_size))
            .last()?;
        // Only the mutation reads it; recorded otherwise, it would split states that differ in nothing else.
        let amount = match self.day_of(key) {
            Some(d) if self.mutated(Mutation::CapReadOutsideLock) => {
                self.day_write(db, d).charge.unwrap_or(0)
            }
            _ => 0,
        };
        Some(Batch {
            last: self.setup.loans[last].id,
            amount,
        })
    }

    /// Whether loan `i` is locked by a transaction other than `actor`'s: an open batch that wrote it, or libraryd.
    fn row_locked(&self, s: &State, actor: usize, i: usize) -> bool {
        s.db.libraryd == Libraryd::Holds(i as u8)
            || s.actors.iter().enumerate().any(|(a, other)| {
                a != actor && matches!(other.phase, Phase::InTx(_, _, tx) if tx.locked & (1 << i) != 0)
            })
    }

    /// Whether another process's transaction holds the accrual loan's advisory lock.
    fn advisory_taken(&self, s: &State, actor: usize) -> bool {
        s.actors
            .iter()
            .enumerate()
            .any(|(a, other)| a != actor && matches!(other.phase, Phase::InTx(_, _, tx) if tx.advisory))
    }

    /// Whether another process's open transaction inserted a row with a key `write` would insert: the day's charge
    /// (`fine_ledger_pkey`), or its correction with the same `seq` (`fine_ledger_corrections_pkey`; none under
    /// [`Mutation::CorrectionWithoutUniqueness`]). An insert waits for that transaction to end. Its correction has
    /// the same `seq`: it was computed from the same committed corrections, since a third that committed one in
    /// between would have waited for it.
    pub fn key_taken(&self, s: &State, actor: usize, d: usize, write: &DayWrite) -> bool {
        s.actors.iter().enumerate().any(|(a, other)| match other.phase {
            Phase::InTx(run, _, tx) if a != actor && self.day_of(usize::from(run.key)) == Some(d) => {
                (write.charge.is_some() && tx.charge.is_some())
                    || (write.correction.is_some()
                        && tx.correction.is_some()
                        && !self.mutated(Mutation::CorrectionWithoutUniqueness))
            }
            _ => false,
        })
    }

    /// Whether `actor`'s next business write has to wait for a lock: the accrual loan's advisory lock (with a cap),
    /// or a key another transaction inserted.
    pub fn waits_for_lock(&self, s: &State, actor: usize) -> bool {
        match s.actors[actor].phase {
            Phase::Fetched(run, _) | Phase::CursorAhead(run, _) => {
                self.day_of(usize::from(run.key)).is_some_and(|d| {
                    (self.capped() && self.advisory_taken(s, actor))
                        || self.key_taken(s, actor, d, &self.day_write(&s.db, d))
                })
            }
            _ => false,
        }
    }

    /// Whether the accrual policy has a cap (and so every charge and correction takes the per-loan lock).
    fn capped(&self) -> bool {
        self.setup.accrual.is_some_and(|a| a.cap > 0)
    }

    /// The batch transaction's business writes, not yet committed. `None` while it waits for a lock.
    fn write(&self, s: &State, actor: usize, run: &Run, batch: &Batch) -> Option<Tx> {
        let key = usize::from(run.key);
        let mut tx = Tx {
            locked: 0,
            skipped: 0,
            charge: None,
            correction: None,
            relief: [None; MAX_DAYS],
            held: false,
            advisory: false,
            idle: self.setup.batch_timeout,
        };
        match self.setup.keys[key].job {
            // update loans set fine_cents = <policy>, fine_settled_at = now()
            //   where id between from and last and fine_settler_shard_of(id, shards) = shard and returned_on in the month
            //     and fine_settled_at is null   -- the conditional predicate (dropped by UnconditionalWrite)
            //     and id in (select ... for no key update skip locked)
            Job::Settlement => {
                for i in self.loans_of(key) {
                    let id = self.setup.loans[i].id;
                    if !after(run.cursor, id) || id > batch.last {
                        continue;
                    }
                    let loan = s.db.loans[i];
                    if loan.settled && !self.mutated(Mutation::UnconditionalWrite) {
                        continue;
                    }
                    if loan.eligible && !self.row_locked(s, actor, i) {
                        tx.locked |= 1 << i;
                    } else if !loan.settled {
                        // Not returned in the month yet (or not yet committed), or locked: `skip locked` leaves it.
                        tx.skipped |= 1 << i;
                    }
                }
            }
            // With a cap: select pg_advisory_xact_lock(loan) (waits while another transaction holds it). Then, under
            // it, the relief: insert into fine_ledger_corrections (loan, other day, seq, amount) select ... the next
            // seq, canonical - net ... where the loan is changed and its day would not fit under the cap and the
            // other day's net exceeds its canonical amount ... on conflict do nothing. Then the day's own: insert
            // into fine_ledger_corrections (loan, day, seq, amount) select ... the next seq, canonical - net (a
            // positive one least(.., cap - net_total)) ... on conflict do nothing; and insert into fine_ledger
            // (loan, day, amount) select least(canonical, cap - net_total) ... where amount > 0 on conflict do
            // nothing. Without a cap, an insert waits for another transaction's row with its key (and there is no
            // relief; with a cap, the lock keeps every other writer of the loan out).
            Job::Accrual { day } => {
                let d = usize::from(day);
                let write = self.day_write(&s.db, d);
                if (self.capped() && self.advisory_taken(s, actor)) || self.key_taken(s, actor, d, &write) {
                    return None;
                }
                tx.advisory = self.capped();
                tx.relief = write.relief;
                tx.correction = write.correction;
                tx.held = write.held;
                if self.mutated(Mutation::CapReadOutsideLock) && s.db.ledger[d].charge.is_none() {
                    tx.charge = (batch.amount > 0).then_some(batch.amount);
                    tx.held = false;
                } else {
                    tx.charge = write.charge;
                }
            }
        }
        Some(tx)
    }

    /// The fence: `update job_runs set cursor, lease_until = now() + lease ... where key and status = 'RUNNING'
    /// and epoch = mine` (without `epoch = mine` under FenceWithoutEpoch). `false`: it matched no row.
    fn fence_matches(&self, db: &Db, run: &Run) -> bool {
        let row = db.runs[usize::from(run.key)];
        row.status == Status::Running && (row.epoch == run.epoch || self.mutated(Mutation::FenceWithoutEpoch))
    }

    /// The fence's effect: the cursor moves to the batch's last id and the lease is renewed.
    fn advance(&self, db: &mut Db, run: &Run, batch: &Batch) {
        let row = &mut db.runs[usize::from(run.key)];
        row.cursor = Some(batch.last);
        row.lease = self.setup.lease;
    }

    /// The business writes become committed (and visible).
    fn commit_writes(&self, s: &mut State, run: &Run, tx: &Tx) {
        let key = usize::from(run.key);
        let row = s.db.runs[key];
        let current = row.status == Status::Running && row.epoch == run.epoch;
        let relief = tx.relief.iter().any(Option::is_some);
        if (tx.locked != 0 || tx.charge.is_some() || tx.correction.is_some() || relief) && !current {
            s.stale_commit = true;
        }
        for (i, loan) in s.db.loans.iter_mut().enumerate() {
            if tx.locked & (1 << i) != 0 {
                loan.settled = true;
                loan.writes = (loan.writes + 1).min(2);
                loan.by_reopen = run.kind == ClaimKind::Reopened;
                loan.left_for_reopen = false;
            } else if tx.skipped & (1 << i) != 0 && !loan.settled {
                loan.left_for_reopen = true;
            }
        }
        if let Some(d) = self.day_of(key) {
            for (entry, correction) in s.db.ledger.iter_mut().zip(tx.relief) {
                if let Some((seq, amount)) = correction {
                    self.commit_correction(entry, seq, amount);
                }
            }
            s.relieved |= relief;
            let entry = &mut s.db.ledger[d];
            if let Some((seq, amount)) = tx.correction {
                self.commit_correction(entry, seq, amount);
            }
            // `on conflict do nothing`: a charge that found the day charged (after waiting) wrote nothing.
            if entry.charge.is_none() {
                entry.charge = tx.charge;
            }
            s.held_back |= tx.held;
        }
    }

    /// A correction becomes committed: the day's next `seq`, or — its number taken — nothing (`on conflict do
    /// nothing`), unless there is no uniqueness to conflict on.
    fn commit_correction(&self, entry: &mut Day, seq: u8, amount: i16) {
        if seq > entry.seq || self.mutated(Mutation::CorrectionWithoutUniqueness) {
            entry.twice |= seq <= entry.seq;
            entry.corrected += amount;
            entry.seq = entry.seq.max(seq);
        }
    }

    /// The statement that ends a run (`job_runs::finish`): `status = SUCCESS|FAILED, lease_until = now() where
    /// key and status = 'RUNNING' and epoch = mine`. Whether it matched.
    fn finish(&self, db: &mut Db, run: &Run, ending: Ending) -> bool {
        let row = &mut db.runs[usize::from(run.key)];
        if row.status == Status::Running && row.epoch == run.epoch {
            row.status = match ending {
                Ending::Success => Status::Success,
                Ending::Failed => Status::Failed,
            };
            row.lease = 0;
            true
        } else {
            false
        }
    }

    /// Whether the clock may advance: every process is idle, frozen or waiting for a lock, and no idle transaction
    /// is due for the server's abort (that fires first).
    fn clock_may_advance(&self, s: &State) -> bool {
        s.actors.iter().enumerate().all(|(a, actor)| {
            let due = matches!(actor.phase, Phase::InTx(_, _, tx) if tx.idle == 0);
            !due && (actor.frozen || actor.phase == Phase::Idle || self.waits_for_lock(s, a))
        })
    }

    /// One step. `bounded` applies the epoch bound to claims.
    pub fn step(&self, s: &State, action: Action, bounded: bool) -> Option<State> {
        let mut n = *s;
        match action {
            Action::Tick { .. } | Action::Force | Action::Release { .. } => {
                self.claim_step(s, &mut n, action, bounded)?
            }
            Action::Fetch(_) | Action::Write(_) | Action::Commit(_) => self.batch_step(s, &mut n, action)?,
            Action::ConnectionLost(_)
            | Action::Finish(_)
            | Action::FinishReplyLost(_)
            | Action::Stop(_)
            | Action::Crash(_)
            | Action::Freeze(_)
            | Action::Thaw(_)
            | Action::IdleAbort(_) => self.process_step(s, &mut n, action)?,
            Action::ClockTick
            | Action::LateReturn
            | Action::LibrarydLocks(_)
            | Action::LibrarydCommits
            | Action::Change(_) => self.world_step(s, &mut n, action)?,
        }
        Some(n)
    }

    /// The claim statements: a replica's tick, the operator's `settle --force` and `release`.
    fn claim_step(&self, s: &State, n: &mut State, action: Action, bounded: bool) -> Option<()> {
        match action {
            Action::Tick { actor, key } => {
                let (row, kind) = self.claim(&s.db, usize::from(key), false, bounded)?;
                n.db.runs[usize::from(key)] = row;
                n.actors[usize::from(actor)].phase = Phase::Between(Run {
                    key,
                    epoch: row.epoch,
                    cursor: row.cursor,
                    kind,
                });
            }
            Action::Force => {
                let key = self.setup.force_key?;
                let (row, kind) = self.claim(&s.db, usize::from(key), true, bounded)?;
                n.db.runs[usize::from(key)] = row;
                n.actors[OPERATOR].phase = Phase::Between(Run {
                    key,
                    epoch: row.epoch,
                    cursor: row.cursor,
                    kind,
                });
                n.faults_left -= 1;
            }
            // update job_runs set status = 'FAILED', lease_until = now() where key and status = 'RUNNING'
            Action::Release { key } => {
                let row = &mut n.db.runs[usize::from(key)];
                if row.status != Status::Running {
                    return None;
                }
                row.status = Status::Failed;
                row.lease = 0;
                n.faults_left -= 1;
            }
            _ => return None,
        }
        Some(())
    }

    /// A run's batch: the fetch, the business writes, the fence and commit.
    fn batch_step(&self, s: &State, n: &mut State, action: Action) -> Option<()> {
        match action {
            Action::Fetch(a) => {
                let Phase::Between(run) = s.actors[usize::from(a)].phase else {
                    return None;
                };
                n.actors[usize::from(a)].phase = match self.fetch(&s.db, &run) {
                    Some(batch) => Phase::Fetched(run, batch),
                    None => finishing(run, Ending::Success),
                };
            }
            Action::Write(a) => match s.actors[usize::from(a)].phase {
                Phase::Fetched(run, batch) if !self.mutated(Mutation::CursorInOwnTransaction) => {
                    let mut tx = self.write(s, usize::from(a), &run, &batch)?;
                    if self.mutated(Mutation::CorrectionOutsideFence) {
                        // The corrections (the relief's too) commit on their own, ahead of the charges and the
                        // fence.
                        let alone = Tx {
                            charge: None,
                            held: false,
                            ..tx
                        };
                        self.commit_writes(n, &run, &alone);
                        tx.correction = None;
                        tx.relief = [None; MAX_DAYS];
                    }
                    n.actors[usize::from(a)].phase = Phase::InTx(run, batch, tx);
                }
                // CursorInOwnTransaction: the business writes commit on their own, after the cursor did.
                Phase::CursorAhead(run, batch) => {
                    let tx = self.write(s, usize::from(a), &run, &batch)?;
                    self.commit_writes(n, &run, &tx);
                    n.actors[usize::from(a)].phase = Phase::Between(Run {
                        cursor: Some(batch.last),
                        ..run
                    });
                }
                _ => return None,
            },
            Action::Commit(a) => match s.actors[usize::from(a)].phase {
                Phase::InTx(run, batch, tx) => {
                    n.actors[usize::from(a)].phase = if self.fence_matches(&s.db, &run) {
                        self.commit_writes(n, &run, &tx);
                        self.advance(&mut n.db, &run, &batch);
                        Phase::Between(Run {
                            cursor: Some(batch.last),
                            ..run
                        })
                    } else {
                        // 0 rows: rollback; the run ends lease_lost (recorded in the history only).
                        Phase::Idle
                    };
                }
                // CursorInOwnTransaction: the fence, cursor and lease commit first, alone.
                Phase::Fetched(run, batch) if self.mutated(Mutation::CursorInOwnTransaction) => {
                    n.actors[usize::from(a)].phase = if self.fence_matches(&s.db, &run) {
                        self.advance(&mut n.db, &run, &batch);
                        Phase::CursorAhead(run, batch)
                    } else {
                        Phase::Idle
                    };
                }
                _ => return None,
            },
            _ => return None,
        }
        Some(())
    }

    /// The end of a run, and what happens to a process: the finish, stops, crashes, freezes, aborts.
    fn process_step(&self, s: &State, n: &mut State, action: Action) -> Option<()> {
        match action {
            Action::ConnectionLost(a) => {
                let Phase::InTx(run, _, _) = s.actors[usize::from(a)].phase else {
                    return None;
                };
                n.actors[usize::from(a)].phase = finishing(run, Ending::Failed);
                n.faults_left -= 1;
            }
            Action::Finish(a) => {
                let Phase::Finishing(run, ending, _retry) = s.actors[usize::from(a)].phase else {
                    return None;
                };
                // Matched: the run ended. Not matched: a retry that finds the row in the target state under its
                // own epoch takes it as done; otherwise the key was taken over (lease_lost, history only).
                self.finish(&mut n.db, &run, ending);
                n.actors[usize::from(a)].phase = Phase::Idle;
            }
            Action::FinishReplyLost(a) => {
                let Phase::Finishing(run, ending, _) = s.actors[usize::from(a)].phase else {
                    return None;
                };
                if !self.finish(&mut n.db, &run, ending) {
                    return None;
                }
                n.actors[usize::from(a)].phase = Phase::Finishing(run, ending, true);
                n.faults_left -= 1;
            }
            // Graceful stop: the loop sees the cancellation between batches and finishes FAILED, lease_until =
            // now(), so a peer takes the key over at its next tick.
            Action::Stop(a) => {
                let Phase::Between(run) = s.actors[usize::from(a)].phase else {
                    return None;
                };
                n.actors[usize::from(a)].phase = finishing(run, Ending::Failed);
                n.faults_left -= 1;
            }
            // The connection closes with the process: the server rolls its transaction back.
            Action::Crash(a) => {
                n.actors[usize::from(a)] = Actor {
                    phase: Phase::Idle,
                    frozen: false,
                };
                n.faults_left -= 1;
            }
            Action::Freeze(a) => {
                n.actors[usize::from(a)].frozen = true;
                n.faults_left -= 1;
            }
            Action::Thaw(a) => n.actors[usize::from(a)].frozen = false,
            // The aborted transaction's locks are released; the process learns of it at its next statement (a
            // connection error), so its run fails.
            Action::IdleAbort(a) => {
                let Phase::InTx(run, _, tx) = s.actors[usize::from(a)].phase else {
                    return None;
                };
                if tx.idle != 0 {
                    return None;
                }
                n.actors[usize::from(a)].phase = finishing(run, Ending::Failed);
            }
            _ => return None,
        }
        Some(())
    }

    /// What happens around the daemon: the clock, and libraryd's returns, row locks and changes.
    fn world_step(&self, s: &State, n: &mut State, action: Action) -> Option<()> {
        match action {
            Action::ClockTick => {
                if !self.clock_may_advance(s) {
                    return None;
                }
                let mut moved = false;
                for row in n.db.runs.iter_mut().filter(|r| r.status == Status::Running) {
                    if row.lease >= 0 {
                        row.lease -= 1;
                        moved = true;
                    }
                }
                for actor in &mut n.actors {
                    if let Phase::InTx(_, _, tx) = &mut actor.phase {
                        if tx.idle > 0 {
                            tx.idle -= 1;
                            moved = true;
                        }
                    }
                }
                if !moved {
                    return None;
                }
            }
            Action::LateReturn => {
                let i = self.setup.loans.iter().position(|l| l.late)?;
                if n.db.loans[i].eligible {
                    return None;
                }
                n.db.loans[i].eligible = true;
            }
            // libraryd's own transaction on a loan row (waits for a batch holding it, so only a free row).
            Action::LibrarydLocks(i) => {
                let i = usize::from(i);
                if s.db.libraryd != Libraryd::Unused || self.row_locked(s, usize::MAX, i) {
                    return None;
                }
                n.db.libraryd = Libraryd::Holds(i as u8);
            }
            Action::LibrarydCommits => {
                let Libraryd::Holds(_) = s.db.libraryd else {
                    return None;
                };
                n.db.libraryd = Libraryd::Done;
            }
            // update loans set returned_on = .. / due_on = .. where id = loan; the trigger queues the change in
            // fine_loan_changes. Accrual takes no lock on the loans row, so nothing waits.
            Action::Change(c) => {
                let change = *self.setup.accrual?.changes.get(usize::from(c))?;
                if !self.may_change(&s.db.dates, change) {
                    return None;
                }
                match change {
                    Change::Return { on } => n.db.dates.returned_on = Some(on),
                    Change::MoveDue { to } => n.db.dates.due_on = to,
                }
                n.db.dates.changed = true;
            }
            _ => return None,
        }
        Some(())
    }

    /// Whether libraryd may still make `change`: each at most once, and the due date moves only from where it
    /// started.
    fn may_change(&self, dates: &LoanDates, change: Change) -> bool {
        match change {
            Change::Return { .. } => dates.returned_on.is_none(),
            Change::MoveDue { to } => self
                .setup
                .accrual
                .is_some_and(|a| dates.due_on == a.due_on && to != a.due_on),
        }
    }

    /// What one process may do next: its own step, and the faults that may befall it.
    fn process_actions(&self, s: &State, i: usize, out: &mut Vec<Action>) {
        let faults = s.faults_left > 0;
        let me = s.actors[i];
        let a = i as u8;
        if i != OPERATOR && self.shard_of(i).is_none() {
            return;
        }
        if me.frozen {
            out.push(Action::Thaw(a));
        }
        if matches!(me.phase, Phase::InTx(_, _, tx) if tx.idle == 0) {
            out.push(Action::IdleAbort(a));
        }
        if me.phase != Phase::Idle && faults {
            out.push(Action::Crash(a));
            if !me.frozen {
                out.push(Action::Freeze(a));
            }
        }
        if me.frozen {
            return;
        }
        match me.phase {
            Phase::Idle => self.claim_actions(s, i, out),
            Phase::Between(_) => {
                out.push(Action::Fetch(a));
                if faults {
                    out.push(Action::Stop(a));
                }
            }
            Phase::Fetched(..) => {
                if self.mutated(Mutation::CursorInOwnTransaction) {
                    out.push(Action::Commit(a));
                } else if !self.waits_for_lock(s, i) {
                    out.push(Action::Write(a));
                }
            }
            Phase::InTx(..) => {
                out.push(Action::Commit(a));
                if faults {
                    out.push(Action::ConnectionLost(a));
                }
            }
            Phase::CursorAhead(..) => {
                if !self.waits_for_lock(s, i) {
                    out.push(Action::Write(a));
                }
            }
            Phase::Finishing(run, _, _) => {
                out.push(Action::Finish(a));
                let row = s.db.runs[usize::from(run.key)];
                if faults && row.status == Status::Running && row.epoch == run.epoch {
                    out.push(Action::FinishReplyLost(a));
                }
            }
        }
    }

    /// The claims an idle process may make: a replica's tick of its shard's keys; the operator's `settle --force`
    /// (a fault) and `accrue --shards 1`.
    fn claim_actions(&self, s: &State, i: usize, out: &mut Vec<Action>) {
        let a = i as u8;
        let faults = s.faults_left > 0;
        match self.shard_of(i) {
            Some(shard) => {
                for k in (0..self.setup.keys.len())
                    .filter(|&k| self.setup.keys[k].partition == Partition::Shard(shard))
                {
                    if self.claim(&s.db, k, false, true).is_some() {
                        out.push(Action::Tick {
                            actor: a,
                            key: k as u8,
                        });
                    }
                }
            }
            None => {
                let forceable = self
                    .setup
                    .force_key
                    .is_some_and(|k| self.claim(&s.db, usize::from(k), true, true).is_some());
                if faults && forceable {
                    out.push(Action::Force);
                }
                // `accrue --date D --shards 1`, by hand: the keys of the other shard count.
                for k in
                    (0..self.setup.keys.len()).filter(|&k| self.setup.keys[k].partition == Partition::Whole)
                {
                    if self.claim(&s.db, k, false, true).is_some() {
                        out.push(Action::Tick {
                            actor: a,
                            key: k as u8,
                        });
                    }
                }
            }
        }
    }

    /// What may happen around the processes: `release` (a fault), the clock, and libraryd.
    fn world_actions(&self, s: &State, out: &mut Vec<Action>) {
        let faults = s.faults_left > 0;
        if faults {
            for (k, row) in s.db.runs.iter().enumerate().take(self.setup.keys.len()) {
                if row.status == Status::Running {
                    out.push(Action::Release { key: k as u8 });
                }
            }
        }
        if self.clock_may_advance(s) {
            out.push(Action::ClockTick);
        }
        if self
            .setup
            .loans
            .iter()
            .zip(&s.db.loans)
            .any(|(spec, loan)| spec.late && !loan.eligible)
        {
            out.push(Action::LateReturn);
        }
        if let Some(i) = self.setup.libraryd_row {
            match s.db.libraryd {
                Libraryd::Unused => {
                    let loan = s.db.loans[i];
                    if loan.eligible && !loan.settled && !self.row_locked(s, usize::MAX, i) {
                        out.push(Action::LibrarydLocks(i as u8));
                    }
                }
                Libraryd::Holds(_) => out.push(Action::LibrarydCommits),
                Libraryd::Done => {}
            }
        }
        if let Some(a) = self.setup.accrual {
            for (c, change) in a.changes.iter().enumerate() {
                if self.may_change(&s.db.dates, *change) {
                    out.push(Action::Change(c as u8));
                }
            }
        }
    }

    /// The step a process takes next when nothing goes wrong (the daemon's own steps, oldest due key first), if it
    /// can take one.
    pub fn daemon_step(&self, s: &State, actor: usize, bounded: bool) -> Option<Action> {
        let a = actor as u8;
        let me = s.actors[actor];
        if me.frozen {
            return None;
        }
        match me.phase {
            Phase::Idle => {
                let shard = self.shard_of(actor)?;
                (0..self.setup.keys.len())
                    .filter(|&k| self.setup.keys[k].partition == Partition::Shard(shard))
                    .find(|&k| self.claim(&s.db, k, false, bounded).is_some())
                    .map(|k| Action::Tick {
                        actor: a,
                        key: k as u8,
                    })
            }
            Phase::Between(_) => Some(Action::Fetch(a)),
            Phase::Fetched(..) if self.mutated(Mutation::CursorInOwnTransaction) => Some(Action::Commit(a)),
            Phase::Fetched(..) | Phase::CursorAhead(..) => {
                (!self.waits_for_lock(s, actor)).then_some(Action::Write(a))
            }
            Phase::InTx(..) => Some(Action::Commit(a)),
            Phase::Finishing(..) => Some(Action::Finish(a)),
        }
    }

    /// A step in words, for counterexamples.
    pub fn describe(&self, s: &State, action: Action) -> String {
        let who = |a: u8| match usize::from(a) {
            OPERATOR => "operator".to_string(),
            r => format!("replica {r}"),
        };
        let key_of = |a: u8| {
            s.actors[usize::from(a)]
                .phase
                .run()
                .map_or("?", |r| self.setup.keys[usize::from(r.key)].label)
        };
        let label = |k: u8| self.setup.keys[usize::from(k)].label;
        match action {
            Action::Tick { actor, key } => self.describe_tick(s, actor, key),
            Action::Force => match self.setup.force_key {
                Some(k) => format!("operator: settle --force {}", label(k)),
                None => "operator: settle --force".to_string(),
            },
            Action::Release { key } => format!("operator: release {}", label(key)),
            Action::Fetch(a) => {
                let batch = s.actors[usize::from(a)]
                    .phase
                    .run()
                    .and_then(|run| self.fetch(&s.db, run));
                match batch {
                    Some(b) => format!(
                        "{}: fetches the batch up to id {} of {}",
                        who(a),
                        b.last,
                        key_of(a)
                    ),
                    None => format!("{}: fetches nothing more for {}", who(a), key_of(a)),
                }
            }
            Action::Write(a) => format!("{}: {}", who(a), self.describe_write(s, usize::from(a))),
            Action::Commit(a) => {
                let fenced = s.actors[usize::from(a)]
                    .phase
                    .run()
                    .is_some_and(|run| self.fence_matches(&s.db, run));
                let what = if fenced {
                    "commits"
                } else {
                    "matches nothing, rolls back"
                };
                format!("{}: fence of {} {what}", who(a), key_of(a))
            }
            Action::ConnectionLost(a) => format!("{}: connection lost mid-batch of {}", who(a), key_of(a)),
            Action::Finish(a) => match s.actors[usize::from(a)].phase {
                Phase::Finishing(_, ending, retry) => {
                    let again = if retry { " (retry)" } else { "" };
                    format!("{}: finishes {} {ending:?}{again}", who(a), key_of(a))
                }
                _ => format!("{}: finishes", who(a)),
            },
            Action::FinishReplyLost(a) => {
                format!("{}: finish of {} commits, the reply is lost", who(a), key_of(a))
            }
            Action::Stop(a) => format!("{}: SIGTERM, stops {}", who(a), key_of(a)),
            Action::Crash(a) => format!("{}: SIGKILL", who(a)),
            Action::Freeze(a) => format!("{}: SIGSTOP", who(a)),
            Action::Thaw(a) => format!("{}: SIGCONT", who(a)),
            Action::IdleAbort(a) => format!("server: aborts the idle transaction of {}", who(a)),
            Action::ClockTick => "the clock advances".to_string(),
            Action::LateReturn => "libraryd: records the late return, back-dated into the month".to_string(),
            Action::LibrarydLocks(i) => {
                format!("libraryd: locks loan {}", self.setup.loans[usize::from(i)].id)
            }
            Action::LibrarydCommits => "libraryd: commits, releases its lock".to_string(),
            Action::Change(c) => self.describe_change(s, c),
        }
    }

    /// A claim in words.
    fn describe_tick(&self, s: &State, actor: u8, key: u8) -> String {
        let (who, how) = if usize::from(actor) == OPERATOR {
            ("operator".to_string(), "accrue --shards 1")
        } else {
            (format!("replica {actor}"), "tick")
        };
        let label = self.setup.keys[usize::from(key)].label;
        match self.claim(&s.db, usize::from(key), false, true) {
            Some((row, kind)) => format!("{who}: {how} claims {label} ({kind:?}, epoch {})", row.epoch),
            None => format!("{who}: {how} claims {label}"),
        }
    }

    /// libraryd's change in words.
    fn describe_change(&self, s: &State, c: u8) -> String {
        match self.setup.accrual.and_then(|a| a.changes.get(usize::from(c))) {
            Some(Change::Return { on }) => {
                format!("libraryd: records the return, back-dated to day {on}")
            }
            Some(Change::MoveDue { to }) => {
                let from = s.db.dates.due_on;
                let way = if *to > from { "later" } else { "earlier" };
                format!("libraryd: moves the due date {way}, from day {from} to day {to}")
            }
            None => "libraryd: changes the loan".to_string(),
        }
    }

    /// A batch's business writes in words; for accrual, what it inserts.
    fn describe_write(&self, s: &State, actor: usize) -> String {
        let (Phase::Fetched(run, batch) | Phase::CursorAhead(run, batch)) = s.actors[actor].phase else {
            return "business writes".to_string();
        };
        let label = self.setup.keys[usize::from(run.key)].label;
        let tx = match self.day_of(usize::from(run.key)) {
            Some(_) => self.write(s, actor, &run, &batch),
            None => return format!("business writes of {label}"),
        };
        let Some(tx) = tx else {
            return format!("writes of {label} wait");
        };
        let alone = if self.mutated(Mutation::CorrectionOutsideFence) {
            ", committed at once on its own"
        } else {
            ""
        };
        let mut parts = Vec::new();
        for (e, correction) in tx.relief.iter().enumerate() {
            if let (Some((seq, amount)), Some(a)) = (correction, self.setup.accrual) {
                parts.push(format!(
                    "relief: correction #{seq} of {amount:+} of day {}{alone}",
                    a.days[e]
                ));
            }
        }
        if let Some((seq, amount)) = tx.correction {
            parts.push(format!("correction #{seq} of {amount:+}{alone}"));
        }
        if let Some(amount) = tx.charge {
            parts.push(format!("charge of {amount}"));
        }
        if parts.is_empty() {
            parts.push("nothing".to_string());
        }
        let held = if tx.held {
            " (the cap holds back the rest)"
        } else {
            ""
        };
        format!("writes of {label}: {}{held}", parts.join(", "))
    }

    /// The accrual loan and its ledger in words: its dates, and each day's net beside what it owes.
    pub fn describe_ledger(&self, s: &State) -> String {
        let dates = s.db.dates;
        let returned = dates
            .returned_on
            .map_or(String::new(), |r| format!(", returned on day {r}"));
        let days: Vec<String> = self
            .days()
            .filter_map(|d| {
                let day = self.setup.accrual?.days[d];
                let entry = s.db.ledger[d];
                Some(format!(
                    "day {day} net {} (charge {}, {} correction(s)), owes {}",
                    entry.net(),
                    entry.charge.map_or("none".to_string(), |c| c.to_string()),
                    entry.seq,
                    self.day_amount(&dates, d)
                ))
            })
            .collect();
        format!("loan due on day {}{returned}: {}", dates.due_on, days.join("; "))
    }
}

/// The run about to send its ending statement. Only its key and epoch matter from here on: the cursor and the
/// claim kind are dropped, so that runs ending the same way are the same state.
fn finishing(run: Run, ending: Ending) -> Phase {
    let run = Run {
        cursor: None,
        kind: ClaimKind::Inserted,
        ..run
    };
    Phase::Finishing(run, ending, false)
}

/// Whether `day` is owed by a loan with these dates: after the due date, and not after the return.
fn owed(dates: &LoanDates, day: i8) -> bool {
    day > dates.due_on && dates.returned_on.is_none_or(|r| day <= r)
}

/// `id > cursor` (a null cursor is before every id).
fn after(cursor: Option<i8>, id: i8) -> bool {
    cursor.is_none_or(|c| id > c)
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![self.initial()]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        for actor in 0..ACTORS {
            self.process_actions(s, actor, out);
        }
        self.world_actions(s, out);
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = self.step(s, action, true)?;
        if self.symmetric {
            self.canonical(&mut n);
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        crate::properties::properties(&self.setup)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settlement() -> Protocol {
        Protocol::new(Setup::settlement(), None)
    }

    fn running(epoch: u8, lease: i8, cursor: Option<i8>) -> JobRun {
        JobRun {
            status: Status::Running,
            epoch,
            lease,
            cursor,
        }
    }

    #[test]
    fn a_live_owner_is_never_displaced_not_even_by_force() {
        let m = settlement();
        let mut db = m.initial().db;
        db.runs[0] = running(1, 0, Some(2));
        assert_eq!(m.claim(&db, 0, false, true), None);
        assert_eq!(m.claim(&db, 0, true, true), None);
    }

    #[test]
    fn a_takeover_resumes_after_the_cursor_and_force_starts_over() {
        let m = settlement();
        let mut db = m.initial().db;
        db.runs[0] = running(1, -1, Some(2));
        let (row, kind) = m.claim(&db, 0, false, true).expect("expired lease");
        assert_eq!(
            (row.epoch, row.cursor, kind),
            (2, Some(2), ClaimKind::TakenOver { resumed: true })
        );
        let (row, kind) = m.claim(&db, 0, true, true).expect("forced");
        assert_eq!(
            (row.epoch, row.cursor, kind),
            (2, None, ClaimKind::Forced { from_success: false })
        );
    }

    #[test]
    fn a_success_key_is_reopened_only_with_rows_left() {
        let m = settlement();
        let mut db = m.initial().db;
        db.runs[0] = JobRun {
            status: Status::Success,
            epoch: 1,
            lease: 0,
            cursor: Some(6),
        };
        for loan in &mut db.loans {
            loan.settled = loan.eligible;
        }
        assert_eq!(m.claim(&db, 0, false, true), None, "nothing left");
        db.loans[2].eligible = true; // loan 4 returned late
        let (row, kind) = m.claim(&db, 0, false, true).expect("re-opened");
        assert_eq!((row.epoch, row.cursor, kind), (2, None, ClaimKind::Reopened));
        db.runs[0].epoch = m.setup.max_epoch;
        assert_eq!(m.claim(&db, 0, false, true), None, "the epoch bound");
        assert!(m.claim(&db, 0, false, false).is_some(), "unbounded");
    }

    #[test]
    fn a_batch_of_a_lost_claim_rolls_back() {
        let m = settlement();
        let mut s = m.initial();
        let run = Run {
            key: 0,
            epoch: 1,
            cursor: None,
            kind: ClaimKind::Inserted,
        };
        let batch = m.fetch(&s.db, &run).expect("loan 2");
        let tx = m.write(&s, 0, &run, &batch).expect("no lock wait");
        assert_eq!(tx.locked, 0b0010);
        s.actors[0].phase = Phase::InTx(run, batch, tx);
        s.db.runs[0] = running(2, 2, None); // taken over meanwhile
        let after = m.step(&s, Action::Commit(0), true).expect("commit step");
        assert_eq!(after.actors[0].phase, Phase::Idle);
        assert!(!after.db.loans[1].settled && !after.stale_commit);
        assert_eq!(after.db.runs[0], s.db.runs[0]);
    }

    #[test]
    fn a_locked_row_is_skipped_and_left_for_the_reopen() {
        let m = settlement();
        let mut s = m.initial();
        s.db.libraryd = Libraryd::Holds(1);
        s.db.runs[0] = running(1, 2, None);
        let run = Run {
            key: 0,
            epoch: 1,
            cursor: None,
            kind: ClaimKind::Inserted,
        };
        let batch = m.fetch(&s.db, &run).expect("loan 2 is unsettled, locked or not");
        let tx = m.write(&s, 0, &run, &batch).expect("skip locked never waits");
        assert_eq!((tx.locked, tx.skipped), (0, 0b0010));
        s.actors[0].phase = Phase::InTx(run, batch, tx);
        let after = m.step(&s, Action::Commit(0), true).expect("commit step");
        assert_eq!(after.db.runs[0].cursor, Some(2));
        assert!(after.db.loans[1].left_for_reopen && !after.db.loans[1].settled);
    }

    #[test]
    fn the_clock_waits_for_running_processes_and_for_a_due_abort() {
        let m = settlement();
        let mut s = m.initial();
        s.db.runs[0] = running(1, 2, None);
        let run = Run {
            key: 0,
            epoch: 1,
            cursor: None,
            kind: ClaimKind::Inserted,
        };
        s.actors[0].phase = Phase::Between(run);
        assert_eq!(
            m.step(&s, Action::ClockTick, true),
            None,
            "a live process between batches"
        );
        s.actors[0].frozen = true;
        let later = m.step(&s, Action::ClockTick, true).expect("frozen: time passes");
        assert_eq!(later.db.runs[0].lease, 1);
        let batch = Batch { last: 2, amount: 0 };
        let tx = Tx {
            locked: 0b0010,
            skipped: 0,
            charge: None,
            correction: None,
            relief: [None; MAX_DAYS],
            held: false,
            advisory: false,
            idle: 0,
        };
        s.actors[0].phase = Phase::InTx(run, batch, tx);
        assert_eq!(
            m.step(&s, Action::ClockTick, true),
            None,
            "the server's abort comes first"
        );
        let aborted = m.step(&s, Action::IdleAbort(0), true).expect("due");
        assert!(matches!(
            aborted.actors[0].phase,
            Phase::Finishing(_, Ending::Failed, false)
        ));
    }

    fn accrual_run(key: u8, kind: ClaimKind) -> Run {
        Run {
            key,
            epoch: 1,
            cursor: None,
            kind,
        }
    }

    fn charged(net: i16) -> Day {
        Day {
            charge: Some(net),
            ..Day::EMPTY
        }
    }

    #[test]
    fn a_day_amount_is_a_function_of_the_loan_alone() {
        let m = Protocol::new(Setup::accrual(), None);
        let amounts = |due_on, returned_on| {
            let dates = LoanDates {
                due_on,
                returned_on,
                changed: false,
            };
            [m.day_amount(&dates, 0), m.day_amount(&dates, 1)]
        };
        assert_eq!(amounts(0, None), [100, 50], "day 2 reaches the cap of 150");
        assert_eq!(amounts(1, None), [0, 100], "due later: day 1 not owed");
        assert_eq!(amounts(-1, None), [50, 0], "due earlier: the cap comes sooner");
        assert_eq!(amounts(0, Some(1)), [100, 0], "returned on day 1");

        // Day 2 charged first: canonical, it is 50 whatever else the ledger holds; from the ledger total it would
        // be the full rate, and day 1 would get the remainder.
        let db = m.initial().db;
        assert_eq!(m.day_write(&db, 1).charge, Some(50));
        let old = Protocol::new(Setup::accrual(), Some(Mutation::AmountFromLedgerTotal));
        assert_eq!(old.day_write(&db, 1).charge, Some(100));
        let mut db = db;
        db.ledger[1] = charged(100);
        assert_eq!(old.day_write(&db, 0).charge, Some(50));
    }

    #[test]
    fn a_changed_loan_is_relieved_before_its_day_so_the_cap_holds_nothing_back() {
        let mut db = Protocol::new(Setup::accrual(), None).initial().db;
        db.ledger = [charged(100), charged(50)];
        db.dates.due_on = 1; // moved later: day 1 owes 0, day 2 owes 100
        db.dates.changed = true;
        // Day 2's run corrects day 1 first (150 held + 50 owed > 150), then its own +50 fits.
        let m = Protocol::new(Setup::accrual(), None);
        assert!(m.reopens(&db, 1), "the re-check finds day 2 at the cap");
        let write = m.day_write(&db, 1);
        assert_eq!(write.relief, [Some((1, -100)), None]);
        assert_eq!((write.correction, write.held), (Some((1, 50)), false));
        // Day 1's own run needs no relief: its amount is 0.
        assert_eq!(m.relief(&db, 0), [None, None]);
        assert_eq!(m.day_write(&db, 0).correction, Some((1, -100)));
        // Without the relief the cap leaves day 2 no room: found, written as nothing, until day 1 is corrected.
        let old = Protocol::new(Setup::accrual(), Some(Mutation::NoRelief));
        let held = old.day_write(&db, 1);
        assert_eq!(
            (held.relief, held.correction, held.held),
            ([None, None], None, true)
        );
        assert!(old.reopens(&db, 1), "found again and again");
        // A loan libraryd did not change is never relieved (its ledger holds no more than it owes anyway).
        db.dates.changed = false;
        assert_eq!(m.relief(&db, 1), [None, None]);
    }

    #[test]
    fn the_relief_runs_only_where_the_day_would_not_fit_under_the_cap() {
        let m = Protocol::new(Setup::accrual(), None);
        let mut db = m.initial().db;
        db.dates.due_on = 1; // day 1 owes 0, day 2 owes 100
        db.dates.changed = true;
        db.ledger[0] = charged(100);
        // 100 held + 100 owed > 150: day 1 is brought down first, and day 2 is charged in full.
        let write = m.day_write(&db, 1);
        assert_eq!((write.relief, write.charge), ([Some((1, -100)), None], Some(100)));
        // 50 held + 100 owed fits: day 1 (which owes 0, and holds 50) is left to its own run.
        db.ledger[0] = charged(50);
        let write = m.day_write(&db, 1);
        assert_eq!((write.relief, write.charge), ([None, None], Some(100)));
    }

    #[test]
    fn a_capped_loan_has_one_writer_at_a_time() {
        let m = Protocol::new(Setup::accrual(), None);
        let mut s = m.initial();
        let run = |key| accrual_run(key, ClaimKind::Inserted);
        let first = m.fetch(&s.db, &run(0)).expect("overdue");
        let tx = m.write(&s, 0, &run(0), &first).expect("lock free");
        assert_eq!((tx.advisory, tx.charge), (true, Some(100)));
        s.actors[0].phase = Phase::InTx(run(0), first, tx);
        let second = m.fetch(&s.db, &run(1)).expect("overdue");
        s.actors[2].phase = Phase::Fetched(run(1), second);
        assert!(m.write(&s, 2, &run(1), &second).is_none());
        assert!(m.waits_for_lock(&s, 2), "waits for the per-loan lock");
    }

    #[test]
    fn the_same_correction_of_another_shard_count_waits_and_then_finds_its_number_taken() {
        for (mutation, twice) in [(None, false), (Some(Mutation::CorrectionWithoutUniqueness), true)] {
            let m = Protocol::new(Setup::overlap(), mutation);
            let mut s = m.initial();
            s.db.ledger[0] = charged(100);
            s.db.dates.returned_on = Some(0);
            s.db.dates.changed = true;
            s.db.runs = [JobRun {
                cursor: None,
                ..running(2, 2, None)
            }; MAX_KEYS];
            let fleet = Run {
                epoch: 2,
                ..accrual_run(0, ClaimKind::Reopened)
            };
            let operator = Run {
                epoch: 2,
                ..accrual_run(1, ClaimKind::Reopened)
            };
            let batch = m.fetch(&s.db, &fleet).expect("day 1 is not owed any more");
            let tx = m.write(&s, 0, &fleet, &batch).expect("no lock without a cap");
            assert_eq!((tx.advisory, tx.correction), (false, Some((1, -100))));
            s.actors[0].phase = Phase::InTx(fleet, batch, tx);
            s.actors[OPERATOR].phase = Phase::Fetched(operator, batch);
            let s = match mutation {
                None => {
                    assert!(m.waits_for_lock(&s, OPERATOR), "waits for seq 1");
                    let s = m.step(&s, Action::Commit(0), true).expect("fleet commits");
                    assert_eq!(m.day_write(&s.db, 0).correction, None, "nothing left");
                    s
                }
                Some(_) => {
                    let s = m.step(&s, Action::Write(OPERATOR as u8), true).expect("no wait");
                    let s = m.step(&s, Action::Commit(0), true).expect("fleet commits");
                    m.step(&s, Action::Commit(OPERATOR as u8), true)
                        .expect("operator commits")
                }
            };
            assert_eq!(s.db.ledger[0].twice, twice);
            assert_eq!(s.db.ledger[0].net(), if twice { -100 } else { 0 });
        }
    }
}
