//! `verify`: audit a settled month; exit 3 on any violation.

use std::process::ExitCode;

use crate::{
    calendar,
    cli::{args::VerifyArgs, output, CliError, Context},
    store,
};

/// Audits the business month of `--business-date` and prints the report (text, or JSON with `--json`).
pub async fn verify(ctx: &Context, args: VerifyArgs) -> Result<ExitCode, CliError> {
    let month = calendar::settlement_month(args.business_date)
        .map_err(|e| CliError::Usage(format!("--business-date: {e}")))?;
    let pool = ctx.connect("fine-settler verify").await?;
    let audit = store::audit::month(&pool, month).await?;
    output::print_audit(args.business_date, month, &audit, args.json);
    Ok(if audit.violations().is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}
