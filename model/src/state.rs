//! The model's state: the database (the `job_runs` rows, the loans, the ledger, libraryd's row lock) and each
//! process's own state, plus the history variables the properties need (marked *history*: nothing in the
//! protocol reads them).
//!
//! Time is kept relative: a lease is stored as `lease_until - now()` in clock steps, so the clock needs no value of
//! its own and may advance forever in a finite state space. Everything is small and `Copy`, so that millions of
//! states fit in memory and a fault-free run can be simulated from each of them.

/// Fixed array sizes; a [`crate::Setup`] uses at most these.
pub const MAX_KEYS: usize = 2;
pub const MAX_LOANS: usize = 4;
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

/// The database: one linearizable store with its own clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Db {
    pub runs: [JobRun; MAX_KEYS],
    pub loans: [Loan; MAX_LOANS],
    /// `fine_ledger` rows of the accrual loan, one per accrual key (day): the amount charged.
    pub ledger: [Option<u16>; MAX_KEYS],
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
    /// Accrual: what the fetch's read of the ledger total says to charge (used only by the
    /// [`crate::Mutation::CapReadOutsideLock`] mutation; the protocol recomputes it under the lock).
    pub amount: u16,
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
    pub charge: Option<u16>,
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
}
