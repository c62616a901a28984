//! A model of fine-settler's claim protocol — the claim, the fenced batches, the finish, the re-open, and the
//! accrual's canonical amounts, corrections, relief and cap — checked exhaustively with
//! [stateright](https://docs.rs/stateright).
//!
//! The model is the protocol as the product implements it (`src/store/job_runs.rs`, `src/store/loans.rs`,
//! `src/store/ledger.rs`, `src/store/corrections.rs`, `src/jobs/runner.rs`, `src/jobs/accrual.rs`), one
//! transition per statement or commit, against one linearizable database with its own clock, under crashes,
//! freezes, lost replies, graceful stops, operator actions, server-side aborts of idle transactions, libraryd's
//! changes to loans and the clock advancing. PostgreSQL itself (READ COMMITTED, row and advisory locks,
//! EvalPlanQual) is assumed, not modelled.
//!
//! - [`setup`]: the scenarios and the mutations;
//! - [`state`]: the database and the processes;
//! - [`protocol`]: the transitions;
//! - [`properties`]: what must hold, including liveness as "a fault-free run from every state settles" (and leaves
//!   every day's net at what is owed);
//! - [`check`]: running it all and the summary line.

pub mod check;
pub mod properties;
pub mod protocol;
pub mod setup;
pub mod state;

pub use check::Summary;
pub use protocol::{Action, Protocol};
pub use setup::{Mutation, Setup};
