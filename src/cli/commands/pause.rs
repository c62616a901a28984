//! `pause` and `resume`: the fleet-wide pause of a job (or of one shard of it), stored in the database.

use std::process::ExitCode;

use super::{operator, shard_arg};
use crate::{
    cli::{
        args::{PauseArgs, PauseScopeArgs, ResumeArgs},
        CliError, Context,
    },
    store::pauses::{self, PauseScope},
};

/// What `pause`/`resume` apply to: `--shards N --shard S` (clap requires both or neither), else the whole job.
fn pause_scope(args: &PauseScopeArgs) -> Result<PauseScope, CliError> {
    match (args.shard, args.shards) {
        (Some(shard), Some(shards)) => Ok(PauseScope::Shard(shard_arg(shard, shards)?)),
        _ => Ok(PauseScope::Job),
    }
}

/// Pauses the job (idempotent) and prints the pause, saying whether it was new.
pub async fn pause(ctx: &Context, args: PauseArgs) -> Result<ExitCode, CliError> {
    let PauseArgs {
        job,
        scope,
        reason,
        by,
    } = args;
    let scope = pause_scope(&scope)?;
    let by = by.unwrap_or_else(operator);
    let pool = ctx.connect("fine-settler pause").await?;
    let done = pauses::pause(&pool, job, scope, &by, &reason).await?;
    let mut report = done.pause.json();
    report["paused"] = done.new.into();
    report["already_paused"] = (!done.new).into();
    println!("{report}");
    if done.new {
        tracing::warn!(job = job.as_str(), scope = %scope, by = %by, reason = %reason, "job paused");
    }
    pool.close().await;
    Ok(ExitCode::SUCCESS)
}

/// Lifts the pause of that scope and prints what was lifted and which pauses of the job remain.
pub async fn resume(ctx: &Context, args: ResumeArgs) -> Result<ExitCode, CliError> {
    let ResumeArgs { job, scope, by } = args;
    let scope = pause_scope(&scope)?;
    let by = by.unwrap_or_else(operator);
    let pool = ctx.connect("fine-settler resume").await?;
    let lifted = pauses::resume(&pool, job, scope, &by).await?;
    let still: Vec<_> = pauses::list(&pool, Some(job.as_str()))
        .await?
        .iter()
        .map(pauses::Pause::json)
        .collect();
    let (shards, shard) = match scope {
        PauseScope::Job => (None, None),
        PauseScope::Shard(s) => (Some(s.shards()), Some(s.shard())),
    };
    let report = serde_json::json!({
        "job": job.as_str(), "shards": shards, "shard": shard,
        "resumed": lifted.is_some(),
        "paused_by": lifted.as_ref().map(|p| p.by.clone()),
        "reason": lifted.as_ref().map(|p| p.reason.clone()),
        "since": lifted.as_ref().map(|p| p.since),
        "by": by,
        "still_paused": still,
    });
    println!("{report}");
    if let Some(p) = &lifted {
        tracing::info!(job = job.as_str(), scope = %scope, by = %by, paused_by = %p.by, "job resumed");
    }
    pool.close().await;
    Ok(ExitCode::SUCCESS)
}
