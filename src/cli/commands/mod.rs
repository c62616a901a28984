//! One function per command, each in a file of its own (a command and its twin share one: `pause`/`resume`),
//! and the few helpers several commands share: a shard from the flags, the operator's name, and the shutdown
//! token of a one-shot run. Every function takes the loaded [`Context`](super::Context) and its own flags, and
//! returns the exit code of a command that did its work.

mod backfill;
mod calendar;
mod config;
mod demo;
mod drift;
mod migrate;
mod pause;
mod pending;
mod plan;
mod policy;
mod release;
mod run;
mod runs;
mod settle_accrue;
mod verify;

pub use backfill::backfill;
pub use calendar::calendar;
pub use config::check_config;
pub use demo::demo_data;
pub use drift::drift;
pub use migrate::migrate;
pub use pause::{pause, resume};
pub use pending::pending;
pub use plan::plan;
pub use policy::policy;
pub use release::release;
pub use run::run;
pub use runs::runs;
pub use settle_accrue::{accrue, settle};
pub use verify::verify;

use tokio_util::sync::CancellationToken;

use super::CliError;
use crate::{jobs::runner::host_name, shard::ShardSpec, signals::Signals};

/// `--shard S --shards N` as a shard, or a usage error naming the flags.
fn shard_arg(shard: i64, shards: i64) -> Result<ShardSpec, CliError> {
    ShardSpec::new(shard, shards).map_err(|e| CliError::Usage(format!("--shard/--shards: {e}")))
}

/// `$USER@host`, naming an operator in the history.
fn operator() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "operator".into());
    format!("{user}@{}", host_name())
}

/// The shutdown token of a one-shot run, cancelled by the first SIGINT/SIGTERM so that the run finishes its
/// batch and hands its key back. A second signal exits at once with 1, as before the handlers existed a first one
/// did: an operator who presses Ctrl-C twice is not kept waiting on a statement (the key, if any, is taken over
/// when its lease expires). Handlers that cannot be installed do not keep the run from going ahead: it then runs
/// to its end, and a signal kills it as it would any process.
fn one_shot_shutdown() -> CancellationToken {
    match Signals::install() {
        Ok(signals) => {
            let hard_stop = signals.hard_stop;
            tokio::spawn(async move {
                hard_stop.cancelled().await;
                std::process::exit(1);
            });
            signals.shutdown
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot install signal handlers; SIGTERM will not release the key");
            CancellationToken::new()
        }
    }
}

/// Today in `time.zone`, by the database clock (the clock every replica agrees on).
async fn database_today(
    ctx: &super::Context,
    pool: &crate::store::Db,
) -> Result<chrono::NaiveDate, CliError> {
    let now = crate::store::database_now(pool).await?;
    Ok(now.with_timezone(&ctx.settings.zone).date_naive())
}
