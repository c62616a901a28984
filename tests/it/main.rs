//! Integration tests against a real PostgreSQL: each `#[sqlx::test]` gets a fresh database with the migrations
//! applied. `DATABASE_URL` names the server (scripts/test.sh starts a private one).

mod accrual;
mod backfill;
mod bad_input;
mod chaos;
mod claim;
mod claimed;
mod cli;
mod clock;
mod daemon;
mod deploy;
mod docs;
mod failover;
mod fencing;
mod helpers;
mod ledger;
mod lifecycle;
mod live;
mod migrate;
mod multihost;
mod pause;
mod pooled;
mod pooler;
mod progress;
mod read_only;
mod recheck;
mod replication;
mod scripts;
mod server;
mod settlement;
mod shards;
mod standby_first;
mod status;
mod stops;
mod systemd;
mod throttle;
