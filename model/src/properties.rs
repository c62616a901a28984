//! What must hold. Safety properties are invariants of every reachable state. Liveness is checked as an invariant
//! too: from every reachable state, a run of the daemon's own steps with no more faults (frozen processes thawed,
//! libraryd's lock released, each process stepping in turn, the clock advancing when none can) must reach the
//! goal. That is the fairness the daemon provides — every live replica ticks again, and a dead owner's lease
//! runs out — and, unlike stateright's `eventually`, it is sound on a state graph with cycles.
//!
//! Each scenario also names situations the model must reach (`sometimes`): a property nobody ever put to the
//! test proves nothing, so an example that is never found counts as a violation.

use stateright::Property;

use crate::{
    protocol::{Action, Protocol},
    setup::Setup,
    state::{ClaimKind, Ending, Libraryd, Phase, State, Status, ACTORS, OPERATOR},
};

pub const WRITTEN_ONCE: &str = "no loan is written twice";
pub const CURRENT_EPOCH: &str = "a write commits only under the key's current epoch";
pub const CURSOR: &str = "the committed cursor passes no unsettled eligible row but one left for the re-open";
pub const CAP: &str = "the ledger never holds more than the cap for a loan";
pub const SETTLES: &str = "once the faults stop, every key reaches SUCCESS with every row done";

pub const REOPENED_LATE: &str = "a late return is settled by a re-open";
pub const RESUMED: &str = "a takeover resumes from a dead owner's cursor";
pub const FENCED_OUT: &str = "a batch of a process that lost its key reaches the fence";
pub const ABORTED: &str = "the server aborts a frozen transaction before its lease runs out";
pub const RETRY_FINDS_OWN: &str = "a finish retry finds its own committed finish";
pub const FORCED_SUCCESS: &str = "a forced rerun takes a SUCCESS key";
pub const LIBRARYD_SKIP: &str = "a row libraryd holds locked is left for the re-open";
pub const STALE_LOCK_SKIP: &str = "a row locked by a batch that lost its key is left for the re-open";
pub const OUTLIVES_LEASE: &str = "a frozen transaction is still open after its lease ran out";
pub const CAP_LIMITS: &str = "the cap leaves the other day nothing";
pub const LOCK_WAIT: &str = "a charge waits for the per-loan lock";

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
    if setup.accrual.is_some() {
        all.push(Property::sometimes(CAP_LIMITS, cap_limits));
        all.push(Property::sometimes(LOCK_WAIT, lock_wait));
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

/// No row at or below a key's committed cursor still needs work, unless a batch left it for the re-open (it was
/// not yet returned in the month, or was locked, when the batch's update ran).
fn cursor_leaves_nothing_behind(m: &Protocol, s: &State) -> bool {
    (0..m.setup.keys.len()).all(|k| match s.db.runs[k].cursor {
        None => true,
        Some(c) => m
            .loans_of(k)
            .all(|i| m.setup.loans[i].id > c || !m.to_do(&s.db, k, i) || s.db.loans[i].left_for_reopen),
    })
}

fn within_cap(m: &Protocol, s: &State) -> bool {
    m.setup.accrual.is_none_or(|a| m.ledger_total(&s.db) <= a.cap)
}

/// The goal: every key SUCCESS, nothing left to do.
pub fn settled(m: &Protocol, s: &State) -> bool {
    (0..m.setup.keys.len()).all(|k| s.db.runs[k].status == Status::Success && !m.undone(&s.db, k))
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
        .all(|turns| fault_free_run(m, s, turns).settled)
}

/// Where a fault-free run went.
#[derive(Debug, Clone)]
pub struct FaultFreeRun {
    /// Whether it reached the goal.
    pub settled: bool,
    /// The steps it took (to the goal, or until nothing could move or the step limit), each with the state it
    /// was taken in.
    pub steps: Vec<(State, Action)>,
}

/// The fault-free run from `s`: every frozen process thawed, libraryd's lock released, then each process in turn
/// takes its next daemon step; when none can, the clock advances.
pub fn fault_free_run(m: &Protocol, s: &State, turns: Turns) -> FaultFreeRun {
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
        if settled(m, &s) {
            return FaultFreeRun { settled: true, steps };
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
        settled: false,
        steps,
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

fn cap_limits(m: &Protocol, s: &State) -> bool {
    settled(m, s)
        && m.setup.accrual.is_some_and(|a| m.ledger_total(&s.db) == a.cap)
        && s.db.ledger.iter().take(m.setup.keys.len()).any(Option::is_none)
}

fn lock_wait(m: &Protocol, s: &State) -> bool {
    (0..ACTORS).any(|a| m.waits_for_lock(s, a))
}
