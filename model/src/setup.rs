//! What is modelled: the run keys, the loans, the limits that keep the state space finite (fault budget, epoch
//! bound, lease and batch timeout in clock steps), and the deliberate mistakes (mutations) the checker must catch.
//!
//! Three scenarios share one model. *Settlement* is the claim protocol at full width: three replicas on two shards
//! (a loan's shard is its id's remainder by 2, taken non-negative:
//! loan -1 is shard 1's), an operator who may force a rerun or release a key, and four loans, one of them returned
//! late (back-dated into the month after the cursor passed it or after the key succeeded) and one that libraryd
//! may hold locked for a while. *Accrual* is two accrual days of one capped loan run by the two replicas of its
//! shard while libraryd back-dates the loan's return and moves its due date (later or earlier), the case the
//! canonical amounts, the corrections, the per-loan lock and the relief of a changed loan's over-charged days
//! exist for. *Overlap* is one day of one uncapped loan
//! run under two shard counts at once (the fleet's key and an operator's `accrue --shards 1`): without a cap no
//! lock serialises the two runs, and only the correction's number (`seq`, unique per loan and day) keeps them from
//! correcting the day twice. Keeping them apart keeps each exhaustive: their state spaces would multiply, and the
//! jobs share nothing but the mechanism, which every scenario checks. The bounds are what runs in a minute or two
//! on one core: two faults per behaviour in settlement (three cost ten times the states), three in accrual
//! (libraryd's changes are not faults: they come on top), two in overlap (three cost seven times the states, and
//! the two shard counts meet on one correction without any fault), and epochs up to 6 (what two faults, a late
//! return and a re-open need; only the re-open loop while libraryd holds its lock goes further).

use crate::state::MAX_DAYS;

/// The job a key belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Job {
    /// `fine-settlement`: stamps each returned loan of the month once (`fine_settled_at`).
    Settlement,
    /// `overdue-accrual` of one day (an index into [`AccrualSpec::days`]): each owed day's canonical amount, and
    /// the corrections of a charged day no longer owed as charged.
    Accrual { day: u8 },
}

/// Which loans a key's runs walk, and so who runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Partition {
    /// Shard `s` of the scenario's shard count ([`Setup::loan_shard`]): the replicas of that shard run it.
    Shard(u8),
    /// `--shards 1 --shard 0`, which holds every loan: a key of another shard count than the fleet's, run only by
    /// the operator (`accrue --date D --shards 1`), beside the fleet's key of the same day.
    Whole,
}

/// One `job_runs` key `(job, business_date, shards, shard)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeySpec {
    pub job: Job,
    pub partition: Partition,
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

/// One change libraryd may make to the accrual loan's row, at any point and at most once per behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Change {
    /// The return is recorded late, back-dated to `on` (`returned_on = on`): the days after it are not owed.
    Return { on: i8 },
    /// The due date moves from where it started to `to` (later: the first days are no longer owed; earlier: the
    /// cap comes sooner). At most one move per behaviour: a move applies only to the starting due date.
    MoveDue { to: i8 },
}

/// The accrual policy, the loan it is applied to, the modelled days and what libraryd may change. Dates are day
/// numbers. Grace is 0 (a grace period only shifts the first owed day, as a later due date does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccrualSpec {
    /// Index into [`Setup::loans`] of the overdue loan every accrual key charges.
    pub loan: usize,
    pub rate: i16,
    /// 0 = no cap (and then no per-loan lock: the product takes it only with a cap).
    pub cap: i16,
    /// The accrual days modelled, as [`Job::Accrual`] indexes them. Days of the loan outside them are outside the
    /// accrual window: never charged, though they count in a day's canonical amount.
    pub days: [i8; MAX_DAYS],
    /// How many of [`Self::days`] are used.
    pub day_count: u8,
    /// The loan's due date as the behaviour starts (not returned).
    pub due_on: i8,
    /// What libraryd may change.
    pub changes: &'static [Change],
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
                    partition: Partition::Shard(0),
                    label: "fine-settlement/0",
                },
                KeySpec {
                    job: Job::Settlement,
                    partition: Partition::Shard(1),
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

    /// Two accrual days (1 and 2) of shard 0 on loan 2, due on day 0, rate 100, cap 150: day 1 owes 100 and day 2
    /// the 50 that reaches the cap. The replicas 0 and 2 of shard 0 may run the two days at once; libraryd may
    /// back-date the return to day 1 (day 2 owes nothing) and move the due date later to day 1 (day 1 owes
    /// nothing, day 2 the full 100: with both days charged, day 2's +50 fits under the cap only once day 1's -100
    /// is written, which day 2's run writes first, the relief) or earlier to day -1 (the cap comes sooner: day 1
    /// owes 50, day 2 nothing), each at any point.
    pub fn accrual() -> Setup {
        Setup {
            name: "accrual",
            shards: 2,
            replicas: 3,
            keys: vec![
                KeySpec {
                    job: Job::Accrual { day: 0 },
                    partition: Partition::Shard(0),
                    label: "overdue-accrual/day1/0",
                },
                KeySpec {
                    job: Job::Accrual { day: 1 },
                    partition: Partition::Shard(0),
                    label: "overdue-accrual/day2/0",
                },
            ],
            loans: vec![LoanSpec { id: 2, late: false }],
            accrual: Some(AccrualSpec {
                loan: 0,
                rate: 100,
                cap: 150,
                days: [1, 2],
                day_count: 2,
                due_on: 0,
                changes: &[
                    Change::Return { on: 1 },
                    Change::MoveDue { to: 1 },
                    Change::MoveDue { to: -1 },
                ],
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

    /// Day 1 of loan 2, due on day 0, rate 100 and no cap, under two shard counts: the fleet's key (shard 0 of 2,
    /// replicas 0 and 2) and the operator's `accrue --date day1 --shards 1`. libraryd may back-date the return to
    /// day 0, after which the day owes nothing and both runs may set out to correct it at once.
    pub fn overlap() -> Setup {
        Setup {
            name: "overlap",
            shards: 2,
            replicas: 3,
            keys: vec![
                KeySpec {
                    job: Job::Accrual { day: 0 },
                    partition: Partition::Shard(0),
                    label: "overdue-accrual/day1/0-of-2",
                },
                KeySpec {
                    job: Job::Accrual { day: 0 },
                    partition: Partition::Whole,
                    label: "overdue-accrual/day1/0-of-1",
                },
            ],
            loans: vec![LoanSpec { id: 2, late: false }],
            accrual: Some(AccrualSpec {
                loan: 0,
                rate: 100,
                cap: 0,
                days: [1, 0],
                day_count: 1,
                due_on: 0,
                changes: &[Change::Return { on: 0 }],
            }),
            batch_size: 1,
            lease: 2,
            batch_timeout: 1,
            faults: 2,
            max_epoch: 6,
            force_key: None,
            libraryd_row: None,
        }
    }

    /// Every scenario, in the order they are checked.
    pub fn all() -> [Setup; 3] {
        [Setup::settlement(), Setup::accrual(), Setup::overlap()]
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
    /// A charge's amount computed from the ledger total, `least(rate, cap - sum)` for an owed day (the rule before
    /// canonical amounts), instead of the day's canonical amount: which day gets the remainder depends on the
    /// order of runs.
    AmountFromLedgerTotal,
    /// The corrections written in a transaction of their own, committed before the batch's charges and fence.
    CorrectionOutsideFence,
    /// The correction written without its uniqueness: no primary key on `(loan_id, accrual_date, seq)`, so
    /// `on conflict do nothing` never finds a correction's number taken.
    CorrectionWithoutUniqueness,
    /// No relief (`corrections::relieve` not called): a batch of a changed loan writes its day's correction and
    /// charge without first bringing the loan's other over-charged days down, so the cap clamps them where they
    /// do not fit (the batch walks still find the day, as they no longer skip a loan at its cap).
    NoRelief,
}

impl Mutation {
    pub const ALL: [Mutation; 9] = [
        Mutation::FenceWithoutEpoch,
        Mutation::CursorInOwnTransaction,
        Mutation::UnconditionalWrite,
        Mutation::CapReadOutsideLock,
        Mutation::NoReopen,
        Mutation::AmountFromLedgerTotal,
        Mutation::CorrectionOutsideFence,
        Mutation::CorrectionWithoutUniqueness,
        Mutation::NoRelief,
    ];

    /// The scenario in which the mistake matters.
    pub fn setup(self) -> Setup {
        match self {
            Mutation::CapReadOutsideLock
            | Mutation::AmountFromLedgerTotal
            | Mutation::CorrectionOutsideFence
            | Mutation::NoRelief => Setup::accrual(),
            // With a cap the per-loan lock serialises every writer of the loan; only without one do two runs of a
            // day correct it at the same time.
            Mutation::CorrectionWithoutUniqueness => Setup::overlap(),
            Mutation::FenceWithoutEpoch
            | Mutation::CursorInOwnTransaction
            | Mutation::UnconditionalWrite
            | Mutation::NoReopen => Setup::settlement(),
        }
    }

    /// The property the mistake must break.
    pub fn breaks(self) -> &'static str {
        use crate::properties::{
            CAP, CORRECTED_ONCE, CURRENT_EPOCH, CURSOR, NET_OWED, NOT_HELD_BACK, SETTLES, WRITTEN_ONCE,
        };
        match self {
            Mutation::FenceWithoutEpoch | Mutation::CorrectionOutsideFence => CURRENT_EPOCH,
            Mutation::CursorInOwnTransaction => CURSOR,
            Mutation::UnconditionalWrite => WRITTEN_ONCE,
            Mutation::CapReadOutsideLock => CAP,
            Mutation::NoReopen => SETTLES,
            Mutation::AmountFromLedgerTotal => NET_OWED,
            Mutation::CorrectionWithoutUniqueness => CORRECTED_ONCE,
            Mutation::NoRelief => NOT_HELD_BACK,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Mutation::FenceWithoutEpoch => "fence without `epoch = mine`",
            Mutation::CursorInOwnTransaction => "cursor committed in its own transaction",
            Mutation::UnconditionalWrite => "range update without `fine_settled_at is null`",
            Mutation::CapReadOutsideLock => "charge computed from a read outside the per-loan lock",
            Mutation::NoReopen => "no re-open of a SUCCESS key with rows left",
            Mutation::AmountFromLedgerTotal => {
                "charge computed from the ledger total, not the day's canonical amount"
            }
            Mutation::CorrectionOutsideFence => "corrections committed outside the fenced batch transaction",
            Mutation::CorrectionWithoutUniqueness => "correction without the uniqueness of its number",
            Mutation::NoRelief => {
                "no relief of a changed loan's over-charged days before the day's own amount"
            }
        }
    }
}
