//! The model's state: the database (the `job_runs` rows, the loans, the ledger and its corrections, libraryd's row
//! lock and its changes to the accrual loan) and each process's own state, plus the history variables the
//! properties need (marked *history*: nothing in the protocol reads them).
//!
//! Time is kept relative: a lease is stored as `lease_until - now()` in clock steps, so the clock needs no value of
//! its own and may advance forever in a finite state space. Everything is small and `Copy`, so that millions of
//! states fit in memory and a fault-free run can be simulated from each of them.

/// Fixed array sizes; a [`crate::Setup`] uses at most these.
pub const MAX_KEYS: usize = 2;
pub const MAX_LOANS: usize = 4;
/// Accrual days.
pub const MAX_DAYS: usize = 2;
/// Three replicas and the operator (`settle --force`, `release`), who runs in a process of their own.
pub const ACTORS: usize = 4;
pub const OPERATOR: usize = 3;

/// `job_runs.status`; `Absent` is a key without a row yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Absent,
    Running,
    Success,
    Failed,
}

/// One `job_runs` row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct JobRun {
    pub status: Status,
    pub epoch: u8,
    /// `lease_until - now()` in clock steps, kept only while RUNNING (0 otherwise). Below 0 the lease has expired
    /// (`lease_until < now()`); it is never stored below -1, since no statement tells -1 from -2.
    pub lease: i8,
    /// The last id a committed batch covered; `None` is null (start from the beginning).
    pub cursor: Option<i8>,
}

impl JobRun {
    pub const ABSENT: JobRun = JobRun {
        status: Status::Absent,
        epoch: 0,
        lease: 0,
        cursor: None,
    };

    /// RUNNING with a lease that has not run out: a live owner, whom no claim displaces.
    pub fn held(&self) -> bool {
        self.status == Status::Running && self.lease >= 0
    }
}

/// How a claim was won (`ClaimKind` in the product, plus the re-open).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ClaimKind {
    /// No row existed: inserted with epoch 1.
    Inserted,
    /// FAILED, or RUNNING with an expired lease: epoch + 1, resuming from the cursor (`resumed`: it had one).
    TakenOver { resumed: bool },
    /// SUCCESS with rows still to do (a late return, a row that was locked): epoch + 1, cursor reset.
    Reopened,
    /// `settle --force`: epoch + 1, cursor reset; `from_success` when it took a SUCCESS row.
    Forced { from_success: bool },
}

/// One `loans` row, as far as settlement is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loan {
    /// Returned in the business month (`returned_on between first and last`). Only the late loan starts false.
    pub eligible: bool,
    /// `fine_settled_at is not null`.
    pub settled: bool,
    /// *History:* committed settlement writes of this row, saturating at 2.
    pub writes: u8,
    /// *History:* settled by a re-opened run.
    pub by_reopen: bool,
    /// *History:* a committed cursor passed the row while it was unsettled, because when the batch's update ran
    /// the row was not yet eligible (a late return) or was locked (libraryd's lock, or another transaction's,
    /// skipped by `skip locked`). Such a row is the re-open's to settle. Cleared once the row is settled.
    pub left_for_reopen: bool,
}

/// libraryd's row lock (held by one of its own transactions for a while), at most once per behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Libraryd {
    Unused,
    Holds(u8),
    Done,
}

/// The accrual loan's row as accrual reads it: its dates (day numbers) and whether libraryd changed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LoanDates {
    pub due_on: i8,
    pub returned_on: Option<i8>,
    /// The loan has rows in `fine_loan_changes` (a trigger on `loans` adds one at every change): the re-check
    /// reads it, a re-opened run of a day looks only at such loans, and a batch relieves only such a loan's
    /// over-charged days (`corrections::relieve`). The model has no queue: a loan libraryd changed counts as
    /// changed from then on, through quiescence. The re-check removes a loan's changes only once none of its days
    /// has work, and from then on only another change gives one work again (every committed write brings its day
    /// to its amount, relieving the loan's other days first where the cap would otherwise hold it short), so a
    /// kept change re-opens nothing; and a relief needs a day that holds more than it owes, which a ledger with no
    /// work left does not have, so a kept change relieves nothing either.
    pub changed: bool,
}

/// The accrual loan's ledger for one day: its charge in `fine_ledger` and its corrections in
/// `fine_ledger_corrections`, summed (the net is their total).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Day {
    /// The first charge (primary key `(loan_id, accrual_date)`), if any.
    pub charge: Option<i16>,
    /// The sum of the day's corrections.
    pub corrected: i16,
    /// How many corrections the day has: the largest `seq`, since each is written as the next one.
    pub seq: u8,
    /// *History:* a correction was committed whose `seq` another correction of the day already had: computed from
    /// a net that one had already corrected, it corrects the same cause a second time.
    pub twice: bool,
}

impl Day {
    pub const EMPTY: Day = Day {
        charge: None,
        corrected: 0,
        seq: 0,
        twice: false,
    };

    /// The day's net: its charge plus its corrections (`fine_ledger_net`).
    pub fn net(&self) -> i16 {
        self.charge.unwrap_or(0) + self.corrected
    }
}

/// The database: one linearizable store with its own clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Db {
    pub runs: [JobRun; MAX_KEYS],
    pub loans: [Loan; MAX_LOANS],
    /// The accrual loan's dates.
    pub dates: LoanDates,
    /// The accrual loan's ledger, one entry per accrual day.
    pub ledger: [Day; MAX_DAYS],
    pub libraryd: Libraryd,
}

/// What a process holds while it runs a key (the runner's local variables).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Run {
    pub key: u8,
    pub epoch: u8,
    /// The last id this run knows to be covered; the next batch starts after it.
    pub cursor: Option<i8>,
    pub kind: ClaimKind,
}

/// A batch as the fetch found it (outside any transaction).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Batch {
    /// The batch covers ids `cursor < id <= last`.
    pub last: i8,
    /// Accrual, only under the [`crate::Mutation::CapReadOutsideLock`] mutation (0 otherwise): what the fetch's
    /// read of the loan and the ledger total says to charge. The protocol computes it under the lock.
    pub amount: i16,
}

/// The open batch transaction after its business writes, before the fence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tx {
    /// Loans (bit per index) the range update wrote and therefore holds locked.
    pub locked: u8,
    /// Loans in the batch's range left unwritten while still unsettled: not yet returned in the month, or locked
    /// by another transaction (`skip locked`). Once the cursor commits past them they are the re-open's.
    pub skipped: u8,
    /// Accrual: the ledger row inserted, uncommitted.
    pub charge: Option<i16>,
    /// Accrual: the correction inserted, uncommitted: its `seq` and amount.
    pub correction: Option<(u8, i16)>,
    /// Accrual: the relief's corrections inserted, uncommitted, by the day they correct (never the batch's own
    /// day): their `seq` and amount.
    pub relief: [Option<(u8, i16)>; MAX_DAYS],
    /// Accrual: the cap held back some of the write's positive amount.
    pub held: bool,
    /// Accrual: `pg_advisory_xact_lock(loan)` held.
    pub advisory: bool,
    /// Clock steps left before the server aborts the transaction for being idle (batch_timeout).
    pub idle: u8,
}

/// Where a run ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Ending {
    Success,
    Failed,
}

/// A process's position in the runner's loop (`Runner::claim_and_run`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Between runs: the next tick reads the status and claims.
    Idle,
    /// Holds a claim, between batches (where the loop checks for shutdown).
    Between(Run),
    /// Read the next batch, outside the transaction.
    Fetched(Run, Batch),
    /// Inside the batch transaction: business writes done, the fence not yet.
    InTx(Run, Batch, Tx),
    /// Only with [`crate::Mutation::CursorInOwnTransaction`]: the cursor is committed, the business writes not yet.
    CursorAhead(Run, Batch),
    /// Sending the statement that ends the run; `retry` once a reply was lost after the statement committed.
    Finishing(Run, Ending, bool),
}

impl Phase {
    pub fn run(&self) -> Option<&Run> {
        match self {
            Phase::Idle => None,
            Phase::Between(r)
            | Phase::Fetched(r, _)
            | Phase::InTx(r, _, _)
            | Phase::CursorAhead(r, _)
            | Phase::Finishing(r, _, _) => Some(r),
        }
    }
}

/// A replica process or the operator's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Actor {
    pub phase: Phase,
    /// SIGSTOPped (or a paused VM): takes no step until thawed, while the clock goes on.
    pub frozen: bool,
}

/// The whole model state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub db: Db,
    pub actors: [Actor; ACTORS],
    /// Faults this behaviour may still contain.
    pub faults_left: u8,
    /// *History:* a transaction committed business writes while its epoch was not the key's current one.
    pub stale_commit: bool,
    /// *History:* a batch committed a charge or a positive correction smaller than the day's difference from its
    /// canonical amount (or none at all), because the cap left no more room.
    pub held_back: bool,
    /// *History:* a batch committed a relief: a correction of another day of the loan than its own.
    pub relieved: bool,
}
