//! `drift`: measure the scheduler with simulated work (no database; it only prints, so it never logs).

use std::process::ExitCode;

use crate::{
    cli::{
        args::{DriftArgs, DriftMode},
        CliError,
    },
    schedule::drift,
};

/// Runs the scheduler for `--ticks` ticks of `--work` each and prints each tick's start, lag and gap.
pub async fn drift(args: DriftArgs) -> Result<ExitCode, CliError> {
    let report = drift::measure(
        args.mode == DriftMode::FixedRate,
        args.period,
        args.work,
        args.ticks,
    )
    .await;
    print!("{}", report.render(args.rows));
    Ok(ExitCode::SUCCESS)
}
