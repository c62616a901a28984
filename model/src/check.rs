//! Running the checker: each scenario exhaustively, breadth-first, and each mutation until it is caught; and the
//! summary line `scripts/check-model.sh` ends with. Every figure in it is counted here, none is written down.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use stateright::{Checker, CheckerVisitor, Expectation, HasDiscoveries, Model, Path};

use crate::{
    properties::{self, Goal, Turns},
    protocol::{Action, Protocol},
    setup::{Mutation, Setup},
    state::State,
};

/// The verdict on one property of one scenario.
#[derive(Debug, Clone)]
pub struct PropertyReport {
    pub name: &'static str,
    pub expectation: Expectation,
    /// The path the checker found: a counterexample (always) or an example (sometimes). Not necessarily a
    /// shortest one (the checker keeps the last it met in a block of states).
    pub path: Option<Trace>,
}

impl PropertyReport {
    /// A counterexample to an invariant, or an example that was never found.
    pub fn violated(&self) -> bool {
        match self.expectation {
            Expectation::Always | Expectation::Eventually => self.path.is_some(),
            Expectation::Sometimes => self.path.is_none(),
        }
    }
}

/// One scenario, checked exhaustively.
#[derive(Debug, Clone)]
pub struct ScenarioReport {
    pub name: &'static str,
    /// Distinct states reached.
    pub states: usize,
    /// The longest shortest path (breadth-first depth).
    pub depth: usize,
    pub properties: Vec<PropertyReport>,
    pub elapsed: Duration,
}

impl ScenarioReport {
    pub fn violations(&self) -> usize {
        self.properties.iter().filter(|p| p.violated()).count()
    }
}

/// One mutation, checked until it breaks the property it must break (or exhaustively, if it never does).
#[derive(Debug, Clone)]
pub struct MutationReport {
    pub mutation: Mutation,
    pub states: usize,
    /// A shortest counterexample to [`Mutation::breaks`].
    pub counterexample: Option<Trace>,
    pub elapsed: Duration,
}

impl MutationReport {
    pub fn caught(&self) -> bool {
        self.counterexample.is_some()
    }
}

/// A path in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// The steps from the initial state.
    pub steps: Vec<String>,
    /// For a state from which the daemon does not reach the goal: the fault-free run that gets stuck (and in
    /// which order the processes took turns).
    pub stuck: Option<(Turns, Vec<String>)>,
    /// With accrual: the loan and its ledger where the path (or the stuck run, if any) ends.
    pub ledger: Option<String>,
}

/// A path in words, and where a fault-free run from its end falls short of `goal`. A path of a
/// [`Protocol::symmetric`] model is first replayed without the symmetry, so that each replica keeps its name from
/// step to step.
pub fn describe(model: &Protocol, path: Path<State, Action>, goal: Goal) -> Trace {
    let (steps, last) = replay(model, path);
    let stuck = [Turns::Ascending, Turns::Descending]
        .into_iter()
        .map(|turns| (turns, properties::fault_free_run(model, &last, turns, goal)))
        .find(|(_, run)| !run.reached);
    let end = stuck.as_ref().map_or(last, |(_, run)| run.end);
    let ledger = model.setup.accrual.map(|_| model.describe_ledger(&end));
    let stuck = stuck.map(|(turns, run)| {
        (
            turns,
            run.steps.iter().map(|(s, a)| model.describe(s, *a)).collect(),
        )
    });
    Trace { steps, stuck, ledger }
}

/// The path's steps in words, and its last state with every replica under its own name.
fn replay(model: &Protocol, path: Path<State, Action>) -> (Vec<String>, State) {
    let path = path.into_vec();
    if !model.symmetric {
        let last = path.last().map_or_else(|| model.initial(), |(s, _)| *s);
        let steps = path
            .into_iter()
            .filter_map(|(state, action)| action.map(|a| model.describe(&state, a)))
            .collect();
        return (steps, last);
    }
    let plain = Protocol {
        symmetric: false,
        ..model.clone()
    };
    let mut real = model.initial();
    let mut steps = Vec::new();
    let mut actions = Vec::new();
    for window in path.windows(2) {
        let target = window[1].0;
        actions.clear();
        plain.actions(&real, &mut actions);
        let next = actions.iter().find_map(|&a| {
            let n = plain.next_state(&real, a)?;
            let mut c = n;
            model.canonical(&mut c);
            (c == target).then_some((a, n))
        });
        let Some((action, next)) = next else {
            steps.push("(the path cannot be replayed without the symmetry)".to_string());
            break;
        };
        steps.push(plain.describe(&real, action));
        real = next;
    }
    (steps, real)
}

/// Checks `setup` (without mutation) exhaustively, breadth-first, one state per class of interchangeable
/// replicas.
pub fn check_scenario(setup: Setup, threads: usize) -> ScenarioReport {
    let started = Instant::now();
    let model = Protocol::new(setup, None).symmetric();
    let name = model.setup.name;
    let properties = model.properties();
    let checker = model.clone().checker().threads(threads).spawn_bfs().join();
    let mut found = checker.discoveries();
    let properties = properties
        .into_iter()
        .map(|p| PropertyReport {
            name: p.name,
            expectation: p.expectation,
            path: found
                .remove(p.name)
                .map(|path| describe(&model, path, Goal::of(p.name))),
        })
        .collect();
    ScenarioReport {
        name,
        states: checker.unique_state_count(),
        depth: checker.max_depth(),
        properties,
        elapsed: started.elapsed(),
    }
}

/// Keeps the first path, in the order the checker visits states, whose last state has `condition == holds`. On
/// one thread, breadth-first, that is a shortest one. (The checker's own record of a discovery is the last such
/// state of a block, not the first.)
#[derive(Debug)]
struct First {
    condition: fn(&Protocol, &State) -> bool,
    holds: bool,
    found: Arc<Mutex<Option<Path<State, Action>>>>,
}

impl CheckerVisitor<Protocol> for First {
    fn visit(&self, model: &Protocol, path: Path<State, Action>) {
        if (self.condition)(model, path.last_state()) == self.holds {
            let mut found = self.found.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            found.get_or_insert(path);
        }
    }
}

/// Explores `model` breadth-first on one thread until the first state that `property` discovers (fails an
/// invariant, or matches a `sometimes`): a shortest path to it, the same every time, and the states explored.
pub fn shortest(model: &Protocol, property: &'static str) -> (Option<Trace>, usize) {
    let target = model.property(property);
    let sometimes = target.expectation == Expectation::Sometimes;
    let found = Arc::new(Mutex::new(None));
    let checker = model
        .clone()
        .checker()
        .threads(1)
        .visitor(First {
            condition: target.condition,
            holds: sometimes,
            found: Arc::clone(&found),
        })
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([target.name])))
        .spawn_bfs()
        .join();
    let first = found
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .take();
    (
        first.map(|path| describe(model, path, Goal::of(property))),
        checker.unique_state_count(),
    )
}

/// Checks the model with `mutation` until it breaks the property it must break.
pub fn check_mutation(mutation: Mutation) -> MutationReport {
    let started = Instant::now();
    let model = Protocol::new(mutation.setup(), Some(mutation));
    let (counterexample, states) = shortest(&model, mutation.breaks());
    MutationReport {
        mutation,
        states,
        counterexample,
        elapsed: started.elapsed(),
    }
}

/// Everything `scripts/check-model.sh` reports.
#[derive(Debug, Clone)]
pub struct Summary {
    pub scenarios: Vec<ScenarioReport>,
    pub mutations: Vec<MutationReport>,
}

impl Summary {
    pub fn run(threads: usize) -> Summary {
        Summary {
            scenarios: Setup::all()
                .into_iter()
                .map(|setup| check_scenario(setup, threads))
                .collect(),
            mutations: Mutation::ALL.into_iter().map(check_mutation).collect(),
        }
    }

    pub fn violations(&self) -> usize {
        self.scenarios.iter().map(ScenarioReport::violations).sum()
    }

    pub fn caught(&self) -> usize {
        self.mutations.iter().filter(|m| m.caught()).count()
    }

    /// Whether everything holds and every mutation was caught.
    pub fn passed(&self) -> bool {
        self.violations() == 0 && self.caught() == self.mutations.len()
    }

    /// `model: states=N depth=D properties=K violations=V mutations=C/M caught`. States are summed over the
    /// scenarios, depth is the deepest, properties counts distinct properties checked.
    pub fn line(&self) -> String {
        let states: usize = self.scenarios.iter().map(|s| s.states).sum();
        let depth = self.scenarios.iter().map(|s| s.depth).max().unwrap_or(0);
        let properties: BTreeSet<&str> = self
            .scenarios
            .iter()
            .flat_map(|s| s.properties.iter().map(|p| p.name))
            .collect();
        format!(
            "model: states={states} depth={depth} properties={} violations={} mutations={}/{} caught",
            properties.len(),
            self.violations(),
            self.caught(),
            self.mutations.len()
        )
    }
}
