//! `plan`: what a tick at a given time would claim; writes nothing.

use std::process::ExitCode;

use chrono::Utc;

use crate::{
    cli::{args::PlanArgs, CliError, Context},
    daemon,
};

/// Prints one JSON line per key a tick at `--at` (default: now, by the configured clock) would consider.
pub async fn plan(ctx: &Context, args: PlanArgs) -> Result<ExitCode, CliError> {
    let at = args.at.map(|at| at.with_timezone(&Utc));
    for due in daemon::plan(&ctx.settings, at).await? {
        println!("{}", serde_json::to_string(&due).unwrap_or_default());
    }
    Ok(ExitCode::SUCCESS)
}
