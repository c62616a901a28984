//! The model check as tests: the protocol holds every property in every scenario, and each deliberate mistake
//! breaks the property it must break — so the properties can fail, and a green run means something.

use fine_settler_model::{
    check::{self, check_mutation, check_scenario, ScenarioReport},
    properties, Mutation, Protocol, Setup,
};

fn assert_clean(report: &ScenarioReport) {
    let violated: Vec<&str> = report
        .properties
        .iter()
        .filter(|p| p.violated())
        .map(|p| p.name)
        .collect();
    assert!(violated.is_empty(), "{}: violated {violated:?}", report.name);
    assert!(report.states > 1 && report.depth > 1, "{report:?}");
}

#[test]
fn settlement_holds_every_property() {
    assert_clean(&check_scenario(Setup::settlement(), 1));
}

#[test]
fn accrual_holds_every_property() {
    assert_clean(&check_scenario(Setup::accrual(), 1));
}

#[test]
fn overlap_holds_every_property() {
    assert_clean(&check_scenario(Setup::overlap(), 1));
}

/// The mutation is caught by the property it must break, with a counterexample whose last step is `last`.
fn assert_caught(mutation: Mutation, last: &str) {
    let report = check_mutation(mutation);
    let trace = report.counterexample.unwrap_or_else(|| {
        panic!(
            "{mutation:?}: \"{}\" holds in {} states",
            mutation.breaks(),
            report.states
        )
    });
    let final_step = trace.steps.last().map(String::as_str).unwrap_or_default();
    assert!(final_step.contains(last), "{mutation:?}: {trace:#?}");
}

#[test]
fn a_fence_without_the_epoch_lets_a_stale_batch_commit() {
    assert_caught(Mutation::FenceWithoutEpoch, "fence of fine-settlement/0 commits");
}

#[test]
fn a_cursor_in_its_own_transaction_runs_ahead_of_the_writes() {
    assert_caught(
        Mutation::CursorInOwnTransaction,
        "fence of fine-settlement/0 commits",
    );
}

#[test]
fn an_unconditional_write_settles_a_loan_twice() {
    assert_caught(Mutation::UnconditionalWrite, "fence of fine-settlement/0 commits");
}

#[test]
fn a_charge_read_outside_the_lock_exceeds_the_cap() {
    assert_caught(Mutation::CapReadOutsideLock, "fence of overdue-accrual");
}

#[test]
fn an_amount_from_the_ledger_total_leaves_the_days_in_the_order_runs_came() {
    let report = check_mutation(Mutation::AmountFromLedgerTotal);
    let trace = report.counterexample.expect("caught");
    let (_, run) = trace
        .stuck
        .as_ref()
        .expect("the fault-free run that comes to rest short of the goal");
    assert!(
        run.iter()
            .any(|s| s.contains("overdue-accrual/day2/0: charge of 100")),
        "day 2 takes the full rate: {trace:#?}"
    );
    let ledger = trace.ledger.expect("the ledger at rest");
    assert!(
        ledger.contains("day 1 net 50") && ledger.contains("day 2 net 100"),
        "{ledger}"
    );
}

#[test]
fn a_correction_outside_the_fence_commits_for_a_run_that_lost_its_key() {
    let report = check_mutation(Mutation::CorrectionOutsideFence);
    let trace = report.counterexample.expect("caught");
    let last = trace.steps.last().map(String::as_str).unwrap_or_default();
    assert!(last.contains("committed at once on its own"), "{trace:#?}");
}

#[test]
fn a_correction_without_its_uniqueness_corrects_a_day_twice() {
    let report = check_mutation(Mutation::CorrectionWithoutUniqueness);
    let trace = report.counterexample.expect("caught");
    let corrections = trace
        .steps
        .iter()
        .filter(|s| s.contains("correction #1 of -100"))
        .count();
    assert_eq!(corrections, 2, "{trace:#?}");
    assert!(
        trace.ledger.is_some_and(|l| l.contains("day 1 net -100")),
        "corrected twice"
    );
}

#[test]
fn without_the_relief_the_cap_holds_back_a_changed_loans_day() {
    let report = check_mutation(Mutation::NoRelief);
    let trace = report.counterexample.expect("caught");
    // Day 1 charged 100 before the due date moved later: day 2 now owes 100, and the cap leaves it 50.
    let held = trace
        .steps
        .iter()
        .any(|s| s.contains("overdue-accrual/day2/0: charge of 50 (the cap holds back the rest)"));
    assert!(held, "{trace:#?}");
    let last = trace.steps.last().map(String::as_str).unwrap_or_default();
    assert!(
        last.contains("fence of overdue-accrual/day2/0 commits"),
        "{trace:#?}"
    );
}

#[test]
fn without_the_reopen_a_skipped_row_is_never_settled() {
    let report = check_mutation(Mutation::NoReopen);
    let trace = report.counterexample.expect("caught");
    let (_, stuck) = trace
        .stuck
        .expect("a liveness counterexample shows the fault-free run");
    assert!(
        stuck
            .last()
            .is_some_and(|s| s.contains("finishes fine-settlement/0 Success")),
        "{stuck:#?}"
    );
}

#[test]
fn the_summary_line_counts_what_was_checked() {
    let summary = check::Summary {
        scenarios: vec![check_scenario(Setup::overlap(), 1)],
        mutations: vec![check_mutation(Mutation::CorrectionWithoutUniqueness)],
    };
    let line = summary.line();
    let expected = format!(
        "model: states={} depth={} properties={} violations=0 mutations=1/1 caught",
        summary.scenarios[0].states,
        summary.scenarios[0].depth,
        summary.scenarios[0].properties.len()
    );
    assert_eq!(line, expected);
    assert!(summary.passed());
}

#[test]
fn from_the_start_the_daemon_settles_everything_in_either_order() {
    for setup in Setup::all() {
        let model = Protocol::new(setup, None);
        for turns in [properties::Turns::Ascending, properties::Turns::Descending] {
            for goal in [properties::Goal::Settled, properties::Goal::NetOwed] {
                let run = properties::fault_free_run(&model, &model.initial(), turns, goal);
                assert!(run.reached, "{}: {turns:?} {goal:?}", model.setup.name);
                assert!(!run.steps.is_empty());
            }
        }
    }
}
