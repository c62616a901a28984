//! `release`: end a stuck claim now, recorded in the history with who and why.

use std::process::ExitCode;

use super::{operator, shard_arg};
use crate::{
    cli::{args::ReleaseArgs, CliError, Context},
    jobs::RunKey,
    store,
};

/// Makes the key FAILED with its lease ended (so the next run takes it over under a new epoch) and prints what
/// it found; exit 1 when the key has no row.
pub async fn release(ctx: &Context, args: ReleaseArgs) -> Result<ExitCode, CliError> {
    let ReleaseArgs {
        job,
        business_date,
        shards,
        shard,
        reason,
        by,
    } = args;
    let spec = shard_arg(shard, shards)?;
    let by = by.unwrap_or_else(operator);
    let pool = ctx.connect("fine-settler release").await?;
    let key = RunKey {
        job,
        business_date,
        shard: spec,
    };
    let released = store::job_runs::release(&pool, &key, &by, &reason).await?;
    let report = serde_json::json!({
        "job": job.as_str(), "business_date": business_date, "shard": spec.shard(), "shards": spec.shards(),
        "found": released.is_some(),
        "released": released.as_ref().is_some_and(|r| r.released),
        "status": released.as_ref().map(|r| r.status),
        "epoch": released.as_ref().map(|r| r.epoch),
        "previous_owner": released.as_ref().map(|r| r.previous_owner.clone()),
        "by": by,
    });
    println!("{report}");
    if let Some(r) = released.as_ref().filter(|r| r.released) {
        tracing::warn!(job = job.as_str(), %business_date, shard = spec.shard(), shards = spec.shards(),
            epoch = r.epoch, previous_owner = %r.previous_owner, by = %by, reason = %reason, "claim released");
    }
    Ok(if released.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
