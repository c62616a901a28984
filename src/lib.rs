//! fine-settler: a cron-style daemon that settles library fines in PostgreSQL, sharded across replicas, safe to
//! run twice, concurrently, after a crash or by hand.
//!
//! Module map:
//! - [`config`]: layered settings validated into typed [`config::Settings`].
//! - [`calendar`], [`fine`], [`shard`]: the pure domain (business months, the fine policy, shard membership).
//! - [`store`]: every SQL statement (claims, fences, loans, audit) and the migrations.
//! - [`jobs`]: the generic claim → fenced batches → finish runner and the jobs on top of it.
//! - [`schedule`]: slots, the slot guard, the scheduler loop and the drift measurement.
//! - [`daemon`]: the long-running replica (ticks, catch-up window, outages); [`signals`]: signal handling.
//! - [`demo`]: deterministic demo loans.
//! - [`cli`]: the command line; `main.rs` only calls [`cli::main`].
//! - [`telemetry`]: structured logs.

pub mod backoff;
pub mod calendar;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod demo;
pub mod fine;
pub mod http;
pub mod jobs;
pub mod metrics;
pub mod redact;
pub mod schedule;
pub mod sdnotify;
pub mod shard;
pub mod signals;
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
