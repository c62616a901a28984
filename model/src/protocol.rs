//! The transitions. Each is one statement (or one commit) of the product as `src/store/job_runs.rs`,
//! `src/store/loans.rs`, `src/store/ledger.rs` and `src/jobs/runner.rs` implement it, one fault, or the clock;
//! the comment on each names what it stands for.
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

use stateright::{Model, Property};

use crate::{
    setup::{Job, Mutation, Setup},
    state::{
        Actor, Batch, ClaimKind, Db, Ending, JobRun, Libraryd, Loan, Phase, Run, State, Status, Tx, ACTORS,
        MAX_KEYS, MAX_LOANS, OPERATOR,
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
}

impl Protocol {
    pub fn new(setup: Setup, mutation: Option<Mutation>) -> Protocol {
        assert!(setup.keys.len() <= MAX_KEYS && setup.loans.len() <= MAX_LOANS);
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
                ledger: [None; MAX_KEYS],
                libraryd: Libraryd::Unused,
            },
            actors: [Actor {
                phase: Phase::Idle,
                frozen: false,
            }; ACTORS],
            faults_left: self.setup.faults,
            stale_commit: false,
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
            self.setup.loan_shard(i) == spec.shard
                && match spec.job {
                    Job::Settlement => true,
                    Job::Accrual => self.setup.accrual.is_some_and(|a| a.loan == i),
                }
        })
    }

    /// What the ledger holds for the accrual loan, all days together.
    pub fn ledger_total(&self, db: &Db) -> u16 {
        let already = self.setup.accrual.map_or(0, |a| a.already);
        already + db.ledger.iter().flatten().sum::<u16>()
    }

    /// `least(rate, cap - sum(ledger))`, never below 0.
    fn owed(&self, db: &Db) -> u16 {
        self.setup
            .accrual
            .map_or(0, |a| a.rate.min(a.cap.saturating_sub(self.ledger_total(db))))
    }

    /// Whether loan `i` still needs work under `key`, as the batch query sees committed data: for settlement
    /// `fine_settled_at is null and returned_on` in the month; for accrual no ledger row for the day and the
    /// ledger total still under the cap.
    pub fn to_do(&self, db: &Db, key: usize, i: usize) -> bool {
        match self.setup.keys[key].job {
            Job::Settlement => db.loans[i].eligible && !db.loans[i].settled,
            Job::Accrual => {
                db.ledger[key].is_none() && self.setup.accrual.is_some_and(|a| self.ledger_total(db) < a.cap)
            }
        }
    }

    /// Whether `key` still has rows to do (what the tick's status read reports for a re-open).
    pub fn undone(&self, db: &Db, key: usize) -> bool {
        self.loans_of(key).any(|i| self.to_do(db, key, i))
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
            Status::Success if self.undone(db, key) && !self.mutated(Mutation::NoReopen) => {
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
        Some(Batch {
            last: self.setup.loans[last].id,
            amount: self.owed(db),
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

    /// Whether `actor`'s next business write has to wait for a lock (the accrual loan's advisory lock).
    pub fn waits_for_lock(&self, s: &State, actor: usize) -> bool {
        match s.actors[actor].phase {
            Phase::Fetched(run, _) | Phase::CursorAhead(run, _) => {
                self.setup.keys[usize::from(run.key)].job == Job::Accrual && self.advisory_taken(s, actor)
            }
            _ => false,
        }
    }

    /// The batch transaction's business writes, not yet committed. `None` while it waits for a lock.
    fn write(&self, s: &State, actor: usize, run: &Run, batch: &Batch) -> Option<Tx> {
        let key = usize::from(run.key);
        let mut tx = Tx {
            locked: 0,
            skipped: 0,
            charge: None,
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
            // select pg_advisory_xact_lock(loan) (waits while another transaction holds it); then, under it,
            // amount = least(rate, cap - sum(fine_ledger of the loan)) and
            // insert into fine_ledger (loan, day, amount) ... on conflict do nothing (nothing when amount = 0).
            Job::Accrual => {
                if self.advisory_taken(s, actor) {
                    return None;
                }
                let amount = if self.mutated(Mutation::CapReadOutsideLock) {
                    batch.amount
                } else {
                    self.owed(&s.db)
                };
                tx.advisory = true;
                tx.charge = (amount > 0 && s.db.ledger[key].is_none()).then_some(amount);
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
        if (tx.locked != 0 || tx.charge.is_some()) && !current {
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
        if let Some(amount) = tx.charge {
            s.db.ledger[key] = Some(amount);
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
                    let tx = self.write(s, usize::from(a), &run, &batch)?;
                    n.actors[usize::from(a)].phase = Phase::InTx(run, batch, tx);
                }
                // CursorInOwnTransaction: the business writes commit on their own, after the cursor did.
                Phase::CursorAhead(run, batch) => {
                    let tx = self.write(s, usize::from(a), &run, &batch)?;
                    self.commit_writes(&mut n, &run, &tx);
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
                        self.commit_writes(&mut n, &run, &tx);
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
        }
        Some(n)
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
                    .filter(|&k| self.setup.keys[k].shard == shard)
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
            Action::Tick { actor, key } => {
                let kind = self
                    .claim(&s.db, usize::from(key), false, true)
                    .map(|(r, k)| (r.epoch, k));
                match kind {
                    Some((epoch, kind)) => format!(
                        "{}: tick claims {} ({kind:?}, epoch {epoch})",
                        who(actor),
                        label(key)
                    ),
                    None => format!("{}: tick claims {}", who(actor), label(key)),
                }
            }
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
            Action::Write(a) => format!("{}: business writes of {}", who(a), key_of(a)),
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
        }
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
        let faults = s.faults_left > 0;
        for (i, me) in s.actors.iter().enumerate() {
            let a = i as u8;
            if i != OPERATOR && self.shard_of(i).is_none() {
                continue;
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
                continue;
            }
            match me.phase {
                Phase::Idle => match self.shard_of(i) {
                    Some(shard) => {
                        for k in (0..self.setup.keys.len()).filter(|&k| self.setup.keys[k].shard == shard) {
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
                    }
                },
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

    #[test]
    fn the_second_charge_under_the_lock_is_what_the_cap_leaves() {
        let m = Protocol::new(Setup::accrual(), None);
        let mut s = m.initial();
        let run = |key| Run {
            key,
            epoch: 1,
            cursor: None,
            kind: ClaimKind::Inserted,
        };
        let first = m.fetch(&s.db, &run(0)).expect("overdue");
        assert_eq!(first.amount, 50);
        s.db.ledger[1] = Some(50); // the other day charged first
        let tx = m.write(&s, 0, &run(0), &first).expect("lock free");
        assert_eq!((tx.advisory, tx.charge), (true, None));
        s.actors[2].phase = Phase::InTx(run(1), first, tx);
        assert!(
            m.write(&s, 0, &run(0), &first).is_none(),
            "waits for the advisory lock"
        );
    }
}
