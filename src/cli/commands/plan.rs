//! `plan`: what a tick at a given time would claim; writes nothing.

use std::process::ExitCode;

use chrono::Utc;

use crate::{
    cli::{args::PlanArgs, CliError, Context},
    daemon,
};

/// Prints one JSON line per key a tick at `--at` (default: now, by the configured clock) would consider, on
/// stdout; and first, on stderr, the fine rules in force on that day — `{"rules": {"policies": [...],
/// "closed_days": [...]}}`, the version of each class in force and those to come, and the closed days of the
/// coming month — so that stdout stays the keys alone for scripts.
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
    eprintln!("{}", serde_json::json!({ "rules": rules? }));
    for due in daemon::plan(&ctx.settings, at).await? {
        println!("{}", serde_json::to_string(&due).unwrap_or_default());
    }
    Ok(ExitCode::SUCCESS)
}
