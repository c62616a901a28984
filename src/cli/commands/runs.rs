//! `runs`: the pauses in force, then the `job_runs` rows (or, with `--history`, the attempts), as a table or
//! JSON lines.

use std::process::ExitCode;

use crate::{
    cli::{args::RunsArgs, output, CliError, Context},
    jobs::JobName,
    store,
};

/// Prints the pauses of the job (or of every job), then its keys or their history.
pub async fn runs(ctx: &Context, args: RunsArgs) -> Result<ExitCode, CliError> {
    let pool = ctx.connect("fine-settler runs").await?;
    let job = args.job.map(JobName::as_str);
    let pauses = store::pauses::list(&pool, job).await?;
    output::print_pauses(&pauses, args.json);
    if args.history {
        let rows = store::job_runs::history(&pool, job, args.business_date).await?;
        output::print_rows(&rows, args.json, output::history_table);
    } else {
        let rows = store::job_runs::list(&pool, job, args.business_date).await?;
        output::print_rows(&rows, args.json, output::runs_table);
    }
    Ok(ExitCode::SUCCESS)
}
