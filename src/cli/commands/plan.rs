//! `plan`: what a tick at a given time would claim; writes nothing.

use std::process::ExitCode;

use chrono::Utc;

use crate::{
    cli::{args::PlanArgs, CliError, Context},
    daemon,
};

/// Prints the fine rules in force on the day of `--at` (default: now, by the configured clock) — `{"rules":
/// {"policies": [...], "closed_days": [...]}}`, the version of each class in force and those to come, and the
/// closed days of the coming month — and then one JSON line per key a tick at that time would consider.
pub async fn plan(ctx: &Context, args: PlanArgs) -> Result<ExitCode, CliError> {
    let at = args.at.map(|at| at.with_timezone(&Utc));
    let pool = ctx.connect("fine-settler plan").await?;
    let day = match at {
        Some(at) => Ok(at),
        None => match ctx.settings.time_source {
            crate::config::TimeSource::Database => crate::store::database_now(&pool).await,
            crate::config::TimeSource::System => Ok(Utc::now()),
        },
    };
    let rules = match day {
        Ok(day) => {
            let today = crate::calendar::local_date(day, ctx.settings.zone);
            crate::store::policies::rules_in_force(&pool, today).await
        }
        Err(e) => Err(e),
    };
    pool.close().await;
    println!("{}", serde_json::json!({ "rules": rules? }));
    for due in daemon::plan(&ctx.settings, at).await? {
        println!("{}", serde_json::to_string(&due).unwrap_or_default());
    }
    Ok(ExitCode::SUCCESS)
}
