//! fine-settler: a cron-style daemon that settles library fines in PostgreSQL, sharded across replicas, safe to
//! run twice, concurrently, after a crash or by hand.
//!
//! Module map (each holds one job):
//! - [`config`]: layered settings ([`config::raw`]) validated, one function per section ([`config::validate`]),
//!   into the types the code uses ([`config::settings`]; the database URL in [`config::database_url`]);
//!   [`redact`] keeps the password out of everything printed.
//! - [`calendar`], [`fine`], [`shard`]: the pure domain (business months, the fine policy, shard membership);
//!   [`backoff`]: the one retry policy; [`policy`]: the fine rules as data (a versioned policy per item class,
//!   the closed days, and the rule that prices a loan under them — the Rust twin of the SQL functions).
//! - [`store`]: every SQL statement and the migrations; [`store`]'s root is the map. [`store::job_runs`] the claim
//!   protocol, the claimed run's handle ([`store::job_runs::ClaimedRun`]: advance through the one fence, renew,
//!   finish, hand back) and the tick's status statement; [`store::loans`] settlement; [`store::ledger`] accrual
//!   and the compensation queue; [`store::audit`] `verify`; [`store::pauses`] `pause` / `resume` and their
//!   history; the pool, hosts, sessions, migrations and readiness in files of their own; [`store::classify`]
//!   the one reader of SQLSTATEs.
//! - [`jobs`]: the generic claim → fenced batches → finish runner ([`jobs::runner`], its steps in files of their
//!   own), the two jobs on top of it ([`jobs::settlement`], [`jobs::accrual`]), the one-shot commands' runs
//!   ([`jobs::oneshot`]) and the backfill of a range of business dates ([`jobs::backfill`]).
//! - [`schedule`]: slots and their arithmetic, the slot guard, the scheduler loop, the drift measurement, and
//!   what is due at a given time ([`schedule::due`]).
//! - [`daemon`]: the long-running replica (the tick's steps, outages, the compensation pass, abandoned keys) and
//!   its lifecycle from start to exit ([`daemon::run`]); [`signals`]: signal handling, installed by [`cli`]
//!   alone; [`sdnotify`]: systemd's notify protocol and watchdog; [`health`]: liveness (progress, ticks, the
//!   watchdog); [`http`]: `/healthz`, `/readyz`, `/metrics`, `/status` on axum; [`metrics`]: the replica's typed
//!   metric families (prometheus-client); [`status`]: the status page and its data.
//! - [`demo`]: deterministic demo loans.
//! - [`cli`]: the command line (arguments, dispatch, one function per command in `cli::commands`, output);
//!   `main.rs` only calls [`cli::main`].
//! - [`telemetry`]: structured logs; [`progress`]: the one-shot commands' progress bars on a terminal.

pub mod backoff;
pub mod calendar;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod demo;
pub mod fine;
pub mod health;
pub mod http;
pub mod jobs;
pub mod metrics;
pub mod policy;
pub mod progress;
pub mod redact;
pub mod schedule;
pub mod sdnotify;
pub mod shard;
pub mod signals;
pub mod status;
pub mod store;
pub mod telemetry;

/// Helpers shared by the unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::collections::HashMap;

    /// An environment made of `pairs`.
    pub fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}
