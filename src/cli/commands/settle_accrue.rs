//! `settle` and `accrue`: one key of one job, run by hand through the same runner as the daemon, with a
//! shutdown token cancelled by SIGINT/SIGTERM; each prints one JSON report line.

use std::process::ExitCode;

use chrono::Datelike;

use super::{one_shot_shutdown, shard_arg};
use crate::{
    calendar,
    cli::{
        args::{AccrueArgs, SettleArgs, ShardArgs},
        CliError, Context,
    },
    jobs::{oneshot, JobName, RunKey},
    progress,
    shard::ShardSpec,
};

/// The shard of a one-shot command: `--shard`/`--shards`, defaulting to the instance's.
fn shard_spec(ctx: &Context, args: &ShardArgs) -> Result<ShardSpec, CliError> {
    let instance = ctx.settings.instance;
    shard_arg(
        args.shard.unwrap_or(i64::from(instance.shard())),
        args.shards.unwrap_or(i64::from(instance.shards())),
    )
}

/// Settles one business month for one shard; the exit code is the run's outcome's.
pub async fn settle(ctx: &Context, args: SettleArgs) -> Result<ExitCode, CliError> {
    let spec = shard_spec(ctx, &args.shard)?;
    calendar::settlement_month(args.business_date)
        .map_err(|e| CliError::Usage(format!("--business-date: {e}")))?;
    let key = RunKey {
        job: JobName::FineSettlement,
        business_date: args.business_date,
        shard: spec,
    };
    let options = run_options(args.force, args.ignore_pause);
    let report = oneshot::settle(&ctx.settings, key, options).await?;
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    Ok(ExitCode::from(report.outcome.exit_code()))
}

/// Accrues one day for one shard (after its due pending charges); the exit code is the run's outcome's.
pub async fn accrue(ctx: &Context, args: AccrueArgs) -> Result<ExitCode, CliError> {
    let spec = shard_spec(ctx, &args.shard)?;
    if args.date.year() < 1 {
        return Err(CliError::Usage(format!(
            "--date: {} is out of range (years 1 to 9999)",
            args.date
        )));
    }
    let key = RunKey {
        job: JobName::OverdueAccrual,
        business_date: args.date,
        shard: spec,
    };
    let options = run_options(args.force, args.ignore_pause);
    let report = oneshot::accrue(&ctx.settings, key, options).await?;
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    Ok(ExitCode::from(report.run.outcome.exit_code()))
}

/// How a one-shot run of a key goes: the operator's flags, progress bars when stderr is a terminal, and the
/// command line's shutdown token.
fn run_options(force: bool, ignore_pause: bool) -> oneshot::Options {
    oneshot::Options {
        force,
        ignore_pause,
        bars: progress::wanted(),
        shutdown: one_shot_shutdown(),
    }
}
