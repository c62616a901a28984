//! `policy list` and `policy add`: the versioned fine rules in the database.

use std::process::ExitCode;

use super::{database_today, operator};
use crate::{
    cli::{
        args::{PolicyAction, PolicyAddArgs},
        output, CliError, Context,
    },
    fine::{FinePolicy, PolicyError},
    policy::{FineClass, Policy, PolicyVersion},
    store::policies::{self, Added, NewPolicy},
};

/// Lists the versions, or adds one.
pub async fn policy(ctx: &Context, action: PolicyAction) -> Result<ExitCode, CliError> {
    match action {
        PolicyAction::List { json } => {
            let pool = ctx.connect("fine-settler policy").await?;
            let versions = policies::list(&pool).await?;
            pool.close().await;
            if json {
                for v in &versions {
                    println!("{}", v.json());
                }
            } else {
                print!("{}", output::policies_table(&versions));
            }
            Ok(ExitCode::SUCCESS)
        }
        PolicyAction::Add(args) => add(ctx, args).await,
    }
}

/// The version `policy add` asks for, or a usage error naming the first bad value. Checked before connecting.
fn new_policy(args: PolicyAddArgs) -> Result<NewPolicy, CliError> {
    let class = FineClass::new_name(&args.class)
        .map_err(|e| CliError::Usage(format!("--class {:?}: {e}", args.class)))?;
    let fine = FinePolicy::new(args.daily_rate_cents, args.grace_days, args.cap_cents).map_err(|e| {
        let flag = match e {
            PolicyError::Rate(v) => format!("--daily-rate-cents {v}"),
            PolicyError::Grace(v) => format!("--grace-days {v}"),
            PolicyError::Cap(v) => format!("--cap-cents {v}"),
        };
        CliError::Usage(format!("{flag}: {e}"))
    })?;
    Ok(NewPolicy {
        class,
        effective_from: args.from,
        policy: Policy {
            fine,
            charge_closed_days: args.charge_closed_days,
        },
        reason: args.reason,
        by: args.by.unwrap_or_else(operator),
    })
}

/// Adds a version and prints it with `"policy": "added"` or `"unchanged"`. Refused (exit 2, nothing written):
/// a bad value, a first due date not after today, a different version for the same class and date.
async fn add(ctx: &Context, args: PolicyAddArgs) -> Result<ExitCode, CliError> {
    let new = new_policy(args)?;
    let pool = ctx.connect("fine-settler policy").await?;
    let today = database_today(ctx, &pool).await?;
    if new.effective_from <= today {
        pool.close().await;
        return Err(CliError::Usage(format!(
            "--from {}: must be after today ({today} in {}): a new rule governs loans falling due from then on, \
             never loans already due",
            new.effective_from, ctx.settings.zone
        )));
    }
    // A first version of another class must not leave loans of no class (and of other classes) without one.
    let added = match policies::seed_default_by(&pool, &ctx.settings.fine, "policy add").await {
        Ok(_) => policies::add(&pool, &new).await,
        Err(e) => Err(e),
    };
    pool.close().await;
    let (state, version) = match added? {
        Added::Added(v) => ("added", v),
        Added::Unchanged(v) => ("unchanged", v),
        Added::Conflict(v) => return Err(conflict(&v)),
    };
    let mut line = serde_json::json!({ "policy": state });
    if let (Some(line), serde_json::Value::Object(fields)) = (line.as_object_mut(), version.json()) {
        line.extend(fields);
    }
    println!("{line}");
    if state == "added" {
        tracing::info!(class = %version.class, from = %version.effective_from, by = %version.created_by,
                       "fine policy added");
    }
    Ok(ExitCode::SUCCESS)
}

/// The refusal of a different version for a class and date that have one.
fn conflict(existing: &PolicyVersion) -> CliError {
    let f = &existing.policy.fine;
    CliError::Usage(format!(
        "--from {}: class {} already has a different policy from that date (daily_rate_cents {}, grace_days {}, \
         cap_cents {}, charge_closed_days {}): a version is never rewritten; add one from a later date",
        existing.effective_from,
        existing.class,
        f.daily_rate().get(),
        f.grace_days(),
        f.cap().map_or(0, |c| c.get()),
        existing.policy.charge_closed_days,
    ))
}
