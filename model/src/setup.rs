//! What is modelled: the run keys, the loans, the limits that keep the state space finite (fault budget, epoch
//! bound, lease and batch timeout in clock steps), and the deliberate mistakes (mutations) the checker must catch.
//!
//! Two scenarios share one model. *Settlement* is the claim protocol at full width: three replicas on two shards
//! (a loan's shard is its id's remainder by 2, taken non-negative: loan -1 is shard 1's), an operator who may
//! force a rerun or release a key, and four loans, one of them returned late (back-dated into the month after the
//! cursor passed it or after the key succeeded) and one that libraryd may hold locked for a while. *Accrual* is two accrual days on one capped loan (cap 250, rate 100, 200 already
//! charged), the case the per-loan lock exists for. Keeping them apart keeps each exhaustive: their state spaces
//! would multiply, and the two jobs share nothing but the mechanism, which both scenarios check. The bounds are
//! what runs in about half a minute: two faults per behaviour in settlement (three cost ten times the states),
//! three in the much smaller accrual scenario, and epochs up to 6 (what two faults, a late return and a re-open
//! need; only the re-open loop while libraryd holds its lock goes further).

/// The job a key belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Job {
    /// `fine-settlement`: stamps each returned loan of the month once (`fine_settled_at`).
    Settlement,
    /// `overdue-accrual`: one ledger row per overdue loan and day, up to the cap.
    Accrual,
}

/// One `job_runs` key `(job, business_date, shards, shard)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeySpec {
    pub job: Job,
    pub shard: u8,
    /// How the key is shown in a counterexample.
    pub label: &'static str,
}

/// One `loans` row. Its shard is the non-negative remainder of `id` by `shards` ([`Setup::loan_shard`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoanSpec {
    pub id: i8,
    /// Returned in the month only later: libraryd records the return (back-dated) at a moment of its choosing.
    pub late: bool,
}

/// The accrual policy and the loan it is applied to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccrualSpec {
    /// Index into [`Setup::loans`] of the overdue loan every accrual key charges.
    pub loan: usize,
    pub rate: u16,
    pub cap: u16,
    /// What the ledger already held for the loan (earlier days) before the modelled days.
    pub already: u16,
}

/// A scenario: everything the model holds fixed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    pub name: &'static str,
    pub shards: u8,
    /// Replica `r` owns shard `r % shards`.
    pub replicas: u8,
    /// Oldest first: the order a tick runs its due keys in.
    pub keys: Vec<KeySpec>,
    /// In ascending id order (the keyset order batches walk).
    pub loans: Vec<LoanSpec>,
    pub accrual: Option<AccrualSpec>,
    pub batch_size: u8,
    /// `claim.lease` in clock steps.
    pub lease: i8,
    /// `claim.batch_timeout` in clock steps: the server's `idle_in_transaction_session_timeout`.
    pub batch_timeout: u8,
    /// How many faults (crashes, freezes, lost replies, stops, operator actions) one behaviour may contain.
    pub faults: u8,
    /// No claim takes a key past this epoch: the bound that keeps a re-open loop (a row libraryd keeps locked is
    /// skipped, the key succeeds, the next tick re-opens it) finite.
    pub max_epoch: u8,
    /// The key an operator may `settle --force`.
    pub force_key: Option<u8>,
    /// The loan (index) libraryd may hold locked for a while: batches skip it (`skip locked`) and leave it for the
    /// re-open. One row is enough to show the path; more would only multiply the states.
    pub libraryd_row: Option<usize>,
}

impl Setup {
    /// Three replicas on two shards settling one month: loans -1 (shard 1), 2, 4 and 6 (shard 0), where 4 is
    /// returned late — in the month, below 6, so a cursor can have passed it, and above 2, so a re-open's range
    /// update covers an already settled row.
    pub fn settlement() -> Setup {
        Setup {
            name: "settlement",
            shards: 2,
            replicas: 3,
            keys: vec![
                KeySpec {
                    job: Job::Settlement,
                    shard: 0,
                    label: "fine-settlement/0",
                },
                KeySpec {
                    job: Job::Settlement,
                    shard: 1,
                    label: "fine-settlement/1",
                },
            ],
            loans: vec![
                LoanSpec { id: -1, late: false },
                LoanSpec { id: 2, late: false },
                LoanSpec { id: 4, late: true },
                LoanSpec { id: 6, late: false },
            ],
            accrual: None,
            batch_size: 1,
            lease: 2,
            batch_timeout: 1,
            faults: 2,
            max_epoch: 6,
            force_key: Some(0),
            libraryd_row: Some(1),
        }
    }

    /// Two accrual days of shard 0 on loan 2, capped at 250 with a rate of 100 and 200 already charged: whichever
    /// day charges first may charge 50, the other nothing.
    pub fn accrual() -> Setup {
        Setup {
            name: "accrual",
            shards: 2,
            replicas: 3,
            keys: vec![
                KeySpec {
                    job: Job::Accrual,
                    shard: 0,
                    label: "overdue-accrual/day1/0",
                },
                KeySpec {
                    job: Job::Accrual,
                    shard: 0,
                    label: "overdue-accrual/day2/0",
                },
            ],
            loans: vec![LoanSpec { id: 2, late: false }],
            accrual: Some(AccrualSpec {
                loan: 0,
                rate: 100,
                cap: 250,
                already: 200,
            }),
            batch_size: 1,
            lease: 2,
            batch_timeout: 1,
            faults: 3,
            max_epoch: 6,
            force_key: None,
            libraryd_row: None,
        }
    }

    /// The shard of loan `i`: `fine_settler_shard_of(id, shards)`, the remainder taken non-negative, so that a
    /// negative id (loan -1) belongs to a shard like any other.
    pub fn loan_shard(&self, i: usize) -> u8 {
        // In 0..shards, so it fits in u8.
        i16::from(self.loans[i].id).rem_euclid(i16::from(self.shards)) as u8
    }
}

/// A deliberate mistake in the protocol. The model with any one of them must fail a property: that is what shows
/// the properties can fail at all (the last one, that liveness can).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// The fence without `epoch = mine`: `where key and status = 'RUNNING'`.
    FenceWithoutEpoch,
    /// The cursor (with the fence and the lease) committed in a transaction of its own, before the business writes.
    CursorInOwnTransaction,
    /// The range update without `fine_settled_at is null`.
    UnconditionalWrite,
    /// The charge computed from the total the batch's fetch read, outside the per-loan lock.
    CapReadOutsideLock,
    /// No re-open: a SUCCESS key is claimed again only by `--force` (the protocol before the re-open existed).
    NoReopen,
}

impl Mutation {
    pub const ALL: [Mutation; 5] = [
        Mutation::FenceWithoutEpoch,
        Mutation::CursorInOwnTransaction,
        Mutation::UnconditionalWrite,
        Mutation::CapReadOutsideLock,
        Mutation::NoReopen,
    ];

    /// The scenario in which the mistake matters.
    pub fn setup(self) -> Setup {
        match self {
            Mutation::CapReadOutsideLock => Setup::accrual(),
            _ => Setup::settlement(),
        }
    }

    /// The property the mistake must break.
    pub fn breaks(self) -> &'static str {
        use crate::properties::{CAP, CURRENT_EPOCH, CURSOR, SETTLES, WRITTEN_ONCE};
        match self {
            Mutation::FenceWithoutEpoch => CURRENT_EPOCH,
            Mutation::CursorInOwnTransaction => CURSOR,
            Mutation::UnconditionalWrite => WRITTEN_ONCE,
            Mutation::CapReadOutsideLock => CAP,
            Mutation::NoReopen => SETTLES,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Mutation::FenceWithoutEpoch => "fence without `epoch = mine`",
            Mutation::CursorInOwnTransaction => "cursor committed in its own transaction",
            Mutation::UnconditionalWrite => "range update without `fine_settled_at is null`",
            Mutation::CapReadOutsideLock => "charge computed from a read outside the per-loan lock",
            Mutation::NoReopen => "no re-open of a SUCCESS key with rows left",
        }
    }
}
