//! `check-config`: the effective configuration, secrets redacted. It only prints, so it never logs.

use std::process::ExitCode;

use crate::cli::{CliError, Context};

/// Prints the effective configuration (every layer applied, the password redacted) as TOML.
pub fn check_config(ctx: &Context) -> Result<ExitCode, CliError> {
    print!("{}", ctx.raw.to_redacted_toml(&ctx.settings));
    Ok(ExitCode::SUCCESS)
}
