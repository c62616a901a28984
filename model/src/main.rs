//! `cargo run --release -p fine-settler-model`: checks every scenario and every mutation, prints what it found,
//! and ends with the summary line. Exits 1 on any violation or uncaught mutation.
//!
//! `-- --show "PROPERTY"` instead prints a shortest path to the property's counterexample (or example) in each
//! scenario that checks it; `MODEL_THREADS` sets the checker's threads (1 by default: the depth it reports is
//! then exact and the same every run).

use std::process::ExitCode;

use fine_settler_model::{
    check,
    check::{PropertyReport, Trace},
    Protocol, Setup, Summary,
};
use stateright::{Expectation, Model};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, property] = args.as_slice() {
        if flag == "--show" {
            return show(property);
        }
    }
    if !args.is_empty() {
        eprintln!("usage: fine-settler-model [--show PROPERTY]");
        return ExitCode::from(2);
    }
    let threads = std::env::var("MODEL_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(1);
    let summary = Summary::run(threads);
    for scenario in &summary.scenarios {
        println!(
            "scenario {}: {} states, depth {}, {:.1}s",
            scenario.name,
            scenario.states,
            scenario.depth,
            scenario.elapsed.as_secs_f64()
        );
        for p in &scenario.properties {
            print_property(p);
        }
    }
    for m in &summary.mutations {
        match &m.counterexample {
            Some(trace) => {
                println!(
                    "mutation {:?} ({}): caught, \"{}\" fails after {} steps ({} states, {:.1}s)",
                    m.mutation,
                    m.mutation.describe(),
                    m.mutation.breaks(),
                    trace.steps.len(),
                    m.states,
                    m.elapsed.as_secs_f64()
                );
                print_trace(trace);
            }
            None => println!(
                "mutation {:?} ({}): NOT caught: \"{}\" holds in all {} states",
                m.mutation,
                m.mutation.describe(),
                m.mutation.breaks(),
                m.states
            ),
        }
    }
    println!("{}", summary.line());
    if summary.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn show(property: &str) -> ExitCode {
    let mut shown = false;
    for setup in Setup::all() {
        let model = Protocol::new(setup, None);
        let Some(name) = model.properties().iter().map(|p| p.name).find(|n| *n == property) else {
            continue;
        };
        shown = true;
        match check::shortest(&model, name) {
            (Some(trace), states) => {
                println!(
                    "{}: \"{name}\", {} steps ({states} states):",
                    model.setup.name,
                    trace.steps.len()
                );
                print_trace(&trace);
            }
            (None, states) => println!("{}: \"{name}\": none in {states} states", model.setup.name),
        }
    }
    if shown {
        ExitCode::SUCCESS
    } else {
        eprintln!("no scenario checks \"{property}\"");
        ExitCode::from(2)
    }
}

fn print_property(p: &PropertyReport) {
    let verdict = if p.violated() { "VIOLATED" } else { "ok" };
    match (&p.expectation, &p.path) {
        (Expectation::Sometimes, Some(_)) => println!("  {verdict:8} reachable: {}", p.name),
        (Expectation::Sometimes, None) => println!("  {verdict:8} reachable: {} (never reached)", p.name),
        (_, None) => println!("  {verdict:8} always: {}", p.name),
        (_, Some(trace)) => {
            println!(
                "  {verdict:8} always: {} — counterexample of {} steps:",
                p.name,
                trace.steps.len()
            );
            print_trace(trace);
        }
    }
}

fn print_trace(trace: &Trace) {
    for (i, step) in trace.steps.iter().enumerate() {
        println!("      {:2}. {step}", i + 1);
    }
    if let Some((turns, run)) = &trace.stuck {
        println!(
            "      then, with no more faults ({turns:?} turns), the daemon gets stuck short of the goal:"
        );
        for step in run {
            println!("          {step}");
        }
    }
    if let Some(ledger) = &trace.ledger {
        println!("      ending with the {ledger}");
    }
}
