//! What must hold. Safety properties are invariants of every reachable state. Liveness is checked as an invariant
//! too: from every reachable state, a run of the daemon's own steps with no more faults (frozen processes thawed,
//! libraryd's lock released and no more changes from it, each process stepping in turn, the clock advancing when
//! none can) must reach the goal. That is the fairness the daemon provides — every live replica ticks again, a
//! dead owner's lease runs out, the re-check re-opens a day with work until it has none — and, unlike
//! stateright's `eventually`, it is sound on a state graph with cycles.
//!
//! Each scenario also names situations the model must reach (`sometimes`): a property nobody ever put to the
//! test proves nothing, so an example that is never found counts as a violation.

use stateright::Property;

use crate::{
    protocol::{Action, Protocol},
    setup::{Change, Job, Partition, Setup},
    state::{ClaimKind, Ending, Libraryd, Phase, Run, State, Status, ACTORS, OPERATOR},
};

pub const WRITTEN_ONCE: &str = "no loan is written twice";
pub const CURRENT_EPOCH: &str = "a write commits only under the key's current epoch";
pub const CURSOR: &str = "the committed cursor passes no unsettled eligible row but one left for the re-open";
pub const CAP: &str = "the ledger never holds more than the cap for a loan";
pub const SETTLES: &str = "once the faults stop, every key reaches SUCCESS with every row done";
pub const NET_OWED: &str =
    "once the faults and libraryd's changes stop, every day's net is what the loan owes";
pub const CORRECTED_ONCE: &str = "no correction is written twice";
pub const NOT_HELD_BACK: &str = "no batch commits less than its day owes because of the cap";

pub const REOPENED_LATE: &str = "a late return is settled by a re-open";
pub const RESUMED: &str = "a takeover resumes from a dead owner's cursor";
pub const FENCED_OUT: &str = "a batch of a process that lost its key reaches the fence";
pub const ABORTED: &str = "the server aborts a frozen transaction before its lease runs out";
pub const RETRY_FINDS_OWN: &str = "a finish retry finds its own committed finish";
pub const FORCED_SUCCESS: &str = "a forced rerun takes a SUCCESS key";
pub const LIBRARYD_SKIP: &str = "a row libraryd holds locked is left for the re-open";
pub const STALE_LOCK_SKIP: &str = "a row locked by a batch that lost its key is left for the re-open";
pub const OUTLIVES_LEASE: &str = "a frozen transaction is still open after its lease ran out";
pub const LOCK_WAIT: &str = "a charge waits for the per-loan lock";
pub const RETURN_CORRECTED: &str = "a day charged before a back-dated return is corrected to what is owed";
pub const DUE_CORRECTED: &str = "a day charged before its due date moved is corrected to what is owed";
pub const RELIEVED: &str =
    "a run first brings down another day that holds more than it owes, and the days end as owed";
pub const SAME_CORRECTION_WAITS: &str =
    "a correction waits for the same correction of another shard count's run";

/// How many steps a fault-free run may take to reach the goal. Far more than needed: every run of the
/// scenarios is a handful of batches, and the clock needs at most `lease + 1` steps to expire a lease.
pub const FAULT_FREE_STEPS: usize = 400;

/// The properties checked in a scenario.
pub fn properties(setup: &Setup) -> Vec<Property<Protocol>> {
    let mut all = vec![
        Property::always(WRITTEN_ONCE, written_once),
        Property::always(CURRENT_EPOCH, current_epoch),
        Property::always(CURSOR, cursor_leaves_nothing_behind),
        Property::always(CAP, within_cap),
        Property::always(SETTLES, settles_without_faults),
        Property::always(CORRECTED_ONCE, corrected_once),
        Property::sometimes(RESUMED, resumed),
        Property::sometimes(FENCED_OUT, fenced_out),
        Property::sometimes(ABORTED, aborted),
        Property::sometimes(RETRY_FINDS_OWN, retry_finds_own),
    ];
    if setup.loans.iter().any(|l| l.late) {
        all.push(Property::sometimes(REOPENED_LATE, reopened_late));
        all.push(Property::sometimes(STALE_LOCK_SKIP, stale_lock_skip));
        all.push(Property::sometimes(OUTLIVES_LEASE, outlives_lease));
    }
    if setup.force_key.is_some() {
        all.push(Property::sometimes(FORCED_SUCCESS, forced_success));
    }
    if setup.libraryd_row.is_some() {
        all.push(Property::sometimes(LIBRARYD_SKIP, libraryd_skip));
    }
    if let Some(a) = setup.accrual {
        all.push(Property::always(NET_OWED, net_owed_without_faults));
        if a.cap > 0 {
            all.push(Property::always(NOT_HELD_BACK, not_held_back));
            all.push(Property::sometimes(LOCK_WAIT, lock_wait));
            all.push(Property::sometimes(RELIEVED, relieved));
        }
        if a.changes.iter().any(|c| matches!(c, Change::Return { .. })) {
            all.push(Property::sometimes(RETURN_CORRECTED, return_corrected));
        }
        if a.changes.iter().any(|c| matches!(c, Change::MoveDue { .. })) {
            all.push(Property::sometimes(DUE_CORRECTED, due_corrected));
        }
    }
    if setup.keys.iter().any(|k| k.partition == Partition::Whole) {
        all.push(Property::sometimes(SAME_CORRECTION_WAITS, same_correction_waits));
    }
    all
}

/// `fine_settled_at` is stamped once: no committed write touches a settled loan again.
fn written_once(_: &Protocol, s: &State) -> bool {
    s.db.loans.iter().all(|l| l.writes <= 1)
}

/// Every commit of business writes happened while its epoch was the key's current one, RUNNING.
fn current_epoch(_: &Protocol, s: &State) -> bool {
    !s.stale_commit
}

/// No row at or below a key's committed cursor still needs work, unless it was left for the re-open: a settlement
/// batch had to leave it (not yet returned in the month, or locked, when the batch's update ran); an accrual loan
/// libraryd changed, which the re-check reads.
fn cursor_leaves_nothing_behind(m: &Protocol, s: &State) -> bool {
    (0..m.setup.keys.len()).all(|k| match s.db.runs[k].cursor {
        None => true,
        Some(c) => m.loans_of(k).all(|i| {
            let left = match m.setup.keys[k].job {
                Job::Settlement => s.db.loans[i].left_for_reopen,
                Job::Accrual { .. } => s.db.dates.changed,
            };
            m.setup.loans[i].id > c || !m.to_do(&s.db, k, i) || left
        }),
    })
}

/// The loan's net — every charge and correction of it — never exceeds the cap, in any committed state.
fn within_cap(m: &Protocol, s: &State) -> bool {
    m.setup
        .accrual
        .is_none_or(|a| a.cap == 0 || m.ledger_total(&s.db) <= a.cap)
}

/// Each correction is written once: no committed correction took a `seq` another of its day already had.
fn corrected_once(m: &Protocol, s: &State) -> bool {
    m.days().all(|d| !s.db.ledger[d].twice)
}

/// The goal: every key the fleet runs SUCCESS, nothing left that would re-open it. (The operator's keys of
/// another shard count are the operator's to run; nothing runs them again by itself.)
pub fn settled(m: &Protocol, s: &State) -> bool {
    (0..m.setup.keys.len())
        .filter(|&k| matches!(m.setup.keys[k].partition, Partition::Shard(_)))
        .all(|k| s.db.runs[k].status == Status::Success && !m.reopens(&s.db, k))
}

/// At rest: settled, and no process in a run.
pub fn quiescent(m: &Protocol, s: &State) -> bool {
    settled(m, s) && s.actors.iter().all(|a| a.phase == Phase::Idle)
}

/// Every modelled day's net is its canonical amount.
pub fn nets_owed(m: &Protocol, s: &State) -> bool {
    m.days()
        .all(|d| s.db.ledger[d].net() == m.day_amount(&s.db.dates, d))
}

/// Where a fault-free run must arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Goal {
    /// [`settled`].
    Settled,
    /// [`quiescent`], with every day's net what is owed.
    NetOwed,
}

impl Goal {
    /// The goal whose failure is a counterexample to `property` (the settled goal for every other property).
    pub fn of(property: &str) -> Goal {
        if property == NET_OWED {
            Goal::NetOwed
        } else {
            Goal::Settled
        }
    }

    pub fn reached(self, m: &Protocol, s: &State) -> bool {
        match self {
            Goal::Settled => settled(m, s),
            Goal::NetOwed => quiescent(m, s) && nets_owed(m, s),
        }
    }
}

/// The order processes take turns in during a fault-free run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turns {
    /// Replica 0, 1, 2, the operator, replica 0, ...
    Ascending,
    /// The operator, replica 2, 1, 0, the operator, ...
    Descending,
}

/// From `s`, the faults stop: does the daemon reach the goal? Checked with processes taking turns in both orders,
/// so that no result depends on who happens to move first.
pub fn settles_without_faults(m: &Protocol, s: &State) -> bool {
    [Turns::Ascending, Turns::Descending]
        .into_iter()
        .all(|turns| fault_free_run(m, s, turns, Goal::Settled).reached)
}

/// From `s`, the faults and libraryd's changes stop: the runs the re-check re-opens, repeated until none has
/// anything left to write, come to rest with every day's net what the loan owes.
fn net_owed_without_faults(m: &Protocol, s: &State) -> bool {
    [Turns::Ascending, Turns::Descending]
        .into_iter()
        .all(|turns| fault_free_run(m, s, turns, Goal::NetOwed).reached)
}

/// Where a fault-free run went.
#[derive(Debug, Clone)]
pub struct FaultFreeRun {
    /// Whether it reached the goal.
    pub reached: bool,
    /// The steps it took (to the goal, or until nothing could move or the step limit), each with the state it
    /// was taken in.
    pub steps: Vec<(State, Action)>,
    /// The state it ended in.
    pub end: State,
}

/// The fault-free run from `s` towards `goal`: every frozen process thawed, libraryd's lock released, then each
/// process in turn takes its next daemon step; when none can, the clock advances.
pub fn fault_free_run(m: &Protocol, s: &State, turns: Turns, goal: Goal) -> FaultFreeRun {
    let mut s = *s;
    for actor in &mut s.actors {
        actor.frozen = false;
    }
    if let Libraryd::Holds(_) = s.db.libraryd {
        s.db.libraryd = Libraryd::Done;
    }
    s.faults_left = 0;
    let mut steps = Vec::new();
    let mut next = 0;
    for _ in 0..FAULT_FREE_STEPS {
        if goal.reached(m, &s) {
            return FaultFreeRun {
                reached: true,
                steps,
                end: s,
            };
        }
        let turn = (0..ACTORS)
            .map(|i| (next + i) % ACTORS)
            .map(|i| match turns {
                Turns::Ascending => i,
                Turns::Descending => ACTORS - 1 - i,
            })
            .find_map(|i| m.daemon_step(&s, i, false).map(|a| (i, a)));
        let action = match turn {
            Some((i, action)) => {
                // The next turn is the process after this one, in this order.
                next = match turns {
                    Turns::Ascending => i + 1,
                    Turns::Descending => ACTORS - i,
                };
                action
            }
            None => Action::ClockTick,
        };
        let Some(after) = m.step(&s, action, false) else {
            // Nobody can move and the clock changes nothing: stuck short of the goal.
            break;
        };
        steps.push((s, action));
        s = after;
    }
    FaultFreeRun {
        reached: false,
        steps,
        end: s,
    }
}

fn reopened_late(m: &Protocol, s: &State) -> bool {
    m.setup
        .loans
        .iter()
        .zip(&s.db.loans)
        .any(|(spec, loan)| spec.late && loan.by_reopen)
}

fn resumed(_: &Protocol, s: &State) -> bool {
    s.actors.iter().any(|a| {
        matches!(
            a.phase,
            Phase::Between(run) if run.kind == ClaimKind::TakenOver { resumed: true }
        )
    })
}

fn fenced_out(_: &Protocol, s: &State) -> bool {
    s.actors.iter().any(|a| {
        !a.frozen
            && matches!(a.phase, Phase::InTx(run, _, _) if s.db.runs[usize::from(run.key)].epoch != run.epoch)
    })
}

fn aborted(_: &Protocol, s: &State) -> bool {
    s.actors.iter().any(|a| match a.phase {
        Phase::InTx(run, _, tx) => {
            let row = s.db.runs[usize::from(run.key)];
            a.frozen && tx.idle == 0 && row.held() && row.epoch == run.epoch
        }
        _ => false,
    })
}

/// The lease is renewed by the previous batch's fence, not when a transaction starts: a process that stalls between
/// batches and then again inside the next transaction holds its row locks past its lease (by up to
/// `batch_timeout`), so `lease > batch_timeout` alone does not make the server's abort come first.
fn outlives_lease(_: &Protocol, s: &State) -> bool {
    s.actors.iter().any(|a| match a.phase {
        Phase::InTx(run, _, tx) => {
            let row = s.db.runs[usize::from(run.key)];
            a.frozen
                && tx.locked != 0
                && row.status == Status::Running
                && row.epoch == run.epoch
                && row.lease < 0
        }
        _ => false,
    })
}

fn retry_finds_own(_: &Protocol, s: &State) -> bool {
    s.actors.iter().any(|a| match a.phase {
        Phase::Finishing(run, ending, true) => {
            let row = s.db.runs[usize::from(run.key)];
            let target = match ending {
                Ending::Success => Status::Success,
                Ending::Failed => Status::Failed,
            };
            row.status == target && row.epoch == run.epoch
        }
        _ => false,
    })
}

fn forced_success(_: &Protocol, s: &State) -> bool {
    matches!(
        s.actors[OPERATOR].phase,
        Phase::Between(run) if run.kind == ClaimKind::Forced { from_success: true }
    )
}

fn libraryd_skip(_: &Protocol, s: &State) -> bool {
    matches!(s.db.libraryd, Libraryd::Holds(i) if s.db.loans[usize::from(i)].left_for_reopen)
}

/// A row an owner's committed cursor passed unsettled because a batch that had already lost the key held it
/// locked (its update ran before the fence that rolls it back).
fn stale_lock_skip(m: &Protocol, s: &State) -> bool {
    s.actors.iter().any(|a| match a.phase {
        Phase::InTx(run, _, tx) if s.db.runs[usize::from(run.key)].epoch != run.epoch => {
            (0..m.setup.loans.len()).any(|i| {
                tx.locked & (1 << i) != 0
                    && s.db.loans[i].left_for_reopen
                    && !m.setup.loans[i].late
                    && s.db.libraryd != Libraryd::Holds(i as u8)
            })
        }
        _ => false,
    })
}

fn lock_wait(m: &Protocol, s: &State) -> bool {
    (0..ACTORS).any(|a| m.waits_for_lock(s, a))
}

/// Settled with every day's net owed, after a correction of a day charged before libraryd's change.
fn corrected_at_rest(m: &Protocol, s: &State) -> bool {
    settled(m, s) && nets_owed(m, s) && m.days().any(|d| s.db.ledger[d].seq > 0)
}

fn return_corrected(m: &Protocol, s: &State) -> bool {
    let moved = m.setup.accrual.is_some_and(|a| s.db.dates.due_on != a.due_on);
    s.db.dates.returned_on.is_some() && !moved && corrected_at_rest(m, s)
}

fn due_corrected(m: &Protocol, s: &State) -> bool {
    let moved = m.setup.accrual.is_some_and(|a| s.db.dates.due_on != a.due_on);
    moved && s.db.dates.returned_on.is_none() && corrected_at_rest(m, s)
}

/// No committed charge or positive correction was clamped by the cap: every batch wrote its day's whole
/// difference from the canonical amount. For a changed loan the relief made the room first; an unchanged loan's
/// ledger holds only canonical amounts, which add up to at most the cap.
fn not_held_back(_: &Protocol, s: &State) -> bool {
    !s.held_back
}

/// A batch committed a relief (a correction of another day than its own), and the days are now as owed.
fn relieved(m: &Protocol, s: &State) -> bool {
    s.relieved && settled(m, s) && nets_owed(m, s)
}

/// A run's correction waits for the same correction, uncommitted, of a run of the same day under another shard
/// count.
fn same_correction_waits(m: &Protocol, s: &State) -> bool {
    let waiting = |run: &Run| {
        let key = usize::from(run.key);
        let day = m.day_of(key);
        let wants = day.is_some_and(|d| m.day_write(&s.db, d).correction.is_some());
        wants
            && s.actors.iter().any(|other| match other.phase {
                Phase::InTx(r, _, tx) => {
                    let theirs = usize::from(r.key);
                    m.day_of(theirs) == day
                        && m.setup.keys[theirs].partition != m.setup.keys[key].partition
                        && tx.correction.is_some()
                }
                _ => false,
            })
    };
    (0..ACTORS).any(|a| match s.actors[a].phase {
        Phase::Fetched(run, _) => waiting(&run) && m.waits_for_lock(s, a),
        _ => false,
    })
}
