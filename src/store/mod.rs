//! The database layer: every SQL statement fine-settler sends lives below this module, checked at compile time
//! against the migrations (`.sqlx` holds the offline data, so building needs no database).
//!
//! How the product reaches PostgreSQL:
//! - [`db`]: [`Db`], the pool every statement goes through, directly or behind a pooler (one [`Unit`] at a time
//!   in transaction mode);
//! - `route` (private): `database.url`'s hosts, the choice among them for `target_session_attrs`, and which connections
//!   a move to another host makes stale; [`tls`]: `sslmode=prefer` as libpq means it, for a certificate rustls
//!   cannot use (Citus's);
//! - [`connect`]: the pools the product opens (the jobs', the daemon's lazy one, the status page's);
//! - [`session`]: the settings connections run under, a transaction's `lock_timeout`, the database clock, and
//!   the tick's dedicated [`Session`];
//! - [`error`]: [`StoreError`], [`ReadOnlyServer`], and [`classify`], the one reader of SQLSTATE codes: what a
//!   failure means ([`DbFailure`]) decides every retry, skip and queueing;
//! - [`migrations`]: the schema's migrations, [`migrate`] (under one lock, safe from many hosts at once), the
//!   indexes fine-settler owns and how far a database is from the schema;
//! - [`readiness`]: whether the schema is ready for this binary (every migration recorded, every owned index
//!   valid).
//!
//! What the product stores, one file per responsibility: [`job_runs`] the claim protocol, the fence and the
//! tick's status statement; [`loans`] settlement; [`ledger`] accrual and the compensation queue; [`pauses`]
//! `pause` / `resume`; [`audit`] `verify`; [`status`] the status page's reads; [`replication`] the standbys'
//! lag; [`latency`] the throttle's probe of the commit latency; [`policies`] the versioned fine rules (`policy
//! list` / `policy add`, the seed of `migrate`);
//! [`calendar`] the closed days (`calendar close` / `open` / `list`).
//!
//! The store depends on no layer above it (jobs, progress bars, the command line): what they need to know while
//! a statement runs, they are told through a callback ([`IndexBuildObserver`]).

pub mod audit;
pub mod calendar;
pub mod citus;
pub mod connect;
pub mod corrections;
pub mod db;
pub mod error;
pub mod job_runs;
pub mod latency;
pub mod ledger;
pub mod ledger_writes;
pub mod loans;
pub mod lock_table;
pub mod migrations;
pub mod pauses;
pub mod policies;
pub mod readiness;
pub mod replication;
mod route;
pub mod session;
pub mod status;
pub mod tls;

pub use connect::{connect, connect_lazy, connect_status};
pub use db::{Db, Unit};
pub use error::{classify, lock_not_available, read_only, DbFailure, ReadOnlyServer, StoreError};
pub use migrations::{
    index_build, migrate, owned_indexes, IndexBuild, IndexBuildObserver, Migrated, OwnedIndex, MIGRATOR,
};
pub use readiness::readiness;
pub use session::{database_now, set_local_lock_timeout, Session};
