//! `backfill`: every business date of a job in a range × every shard, through the runner; `--dry-run` only
//! reads. The real run stops starting keys on SIGINT/SIGTERM, and the runs in flight hand their keys back.

use std::process::ExitCode;

use crate::{
    cli::{args::BackfillArgs, output, CliError, Context},
    jobs::backfill,
    progress,
    signals::Signals,
};

/// Runs (or, with `--dry-run`, describes) the backfill, printing each key's line and then the summary; exit 1
/// if any run failed or the backfill was interrupted.
pub async fn backfill(ctx: &Context, args: BackfillArgs) -> Result<ExitCode, CliError> {
    let settings = &ctx.settings;
    let request = backfill::Request {
        job: args.job,
        from: args.from,
        to: args.to,
        shards: args.shards.unwrap_or(i64::from(settings.instance.shards())),
        reprocess: args.reprocess,
        concurrency: args.concurrency,
        ignore_pause: args.ignore_pause,
    };
    let plan = backfill::prepare(settings, request)?;
    let pool = backfill::connect(settings, &plan).await?;
    if args.dry_run {
        let summary = backfill::dry_run(settings, &plan, &pool, output::print_json).await;
        pool.close().await;
        output::print_json(&summary?);
        return Ok(ExitCode::SUCCESS);
    }
    if let Err(e) = crate::store::policies::seed_default_by(&pool, &settings.fine, "backfill").await {
        pool.close().await;
        return Err(e.into());
    }
    let signals = Signals::install()?;
    let summary = backfill::run(
        settings,
        &plan,
        pool,
        signals.shutdown,
        progress::wanted(),
        output::print_json,
    )
    .await?;
    output::print_json(&summary);
    Ok(ExitCode::from(summary.exit_code()))
}
