//! `pending list` and `pending retry`: the compensation queue of failed charges.

use std::process::ExitCode;

use super::one_shot_shutdown;
use crate::{
    cli::{args::PendingAction, output, CliError, Context},
    jobs::oneshot,
    progress, store,
};

/// Lists the queue, or retries every PENDING charge now (stopping between two charges on SIGINT/SIGTERM, then
/// exit 1). A retry is refused while a pause covers the accrual, unless `--ignore-pause`: exit 1, one line
/// naming the pause, nothing written.
pub async fn pending(ctx: &Context, action: PendingAction) -> Result<ExitCode, CliError> {
    let pool = ctx.connect("fine-settler pending").await?;
    let code = match action {
        PendingAction::List { json } => {
            output::print_rows(&store::ledger::list(&pool).await?, json, output::pending_table);
            ExitCode::SUCCESS
        }
        PendingAction::Retry { dead, ignore_pause } => {
            if !ignore_pause {
                if let Some(refused) = oneshot::retry_refused(&pool).await? {
                    pool.close().await;
                    return Err(refused.into());
                }
            }
            let shutdown = one_shot_shutdown();
            let report =
                oneshot::retry_pending(&ctx.settings, &pool, dead, progress::wanted(), shutdown).await?;
            let code = ExitCode::from(report.exit_code());
            // As a JSON value, so that its keys print in order, as they always have.
            let report = serde_json::to_value(report).unwrap_or_default();
            println!("{report}");
            code
        }
    };
    pool.close().await;
    Ok(code)
}
