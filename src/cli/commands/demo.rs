//! `demo-data`: deterministic demo loans.

use std::process::ExitCode;

use crate::{
    cli::{args::DemoDataArgs, CliError, Context},
    demo,
};

/// Inserts `--loans` deterministic loans (existing ids are left alone) and prints how many were new.
pub async fn demo_data(ctx: &Context, args: DemoDataArgs) -> Result<ExitCode, CliError> {
    let pool = ctx.connect("fine-settler demo-data").await?;
    let DemoDataArgs {
        loans,
        seed,
        month,
        first_id,
    } = args;
    let spec = demo::DemoSpec {
        loans,
        seed,
        month,
        first_id,
    };
    let inserted = demo::insert(&pool, spec).await?;
    println!(
        "{}",
        serde_json::json!({"loans": loans, "inserted": inserted, "seed": seed})
    );
    Ok(ExitCode::SUCCESS)
}
