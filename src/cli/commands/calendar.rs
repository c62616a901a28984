//! `calendar close`, `calendar open` and `calendar list`: the days the library is closed.

use std::process::ExitCode;

use chrono::{Months, NaiveDate};

use super::{database_today, operator};
use crate::{
    cli::{
        args::{CalendarAction, CalendarRangeArgs},
        output, CliError, Context,
    },
    store::calendar::{self, CalendarError, Changed},
};

/// The longest range one command changes: ten years.
const MAX_RANGE: Months = Months::new(120);

/// The days a calendar may hold: the years 1 to 9999. No library's calendar reaches further, and PostgreSQL
/// cannot compute the month of its own first days (the settled-month check), so a day beyond is refused as a
/// value rather than failed as a statement.
fn on_calendar(flag: &str, day: NaiveDate) -> Result<(), CliError> {
    use chrono::Datelike;
    if (1..=9999).contains(&day.year()) {
        return Ok(());
    }
    Err(CliError::Usage(format!(
        "{flag} {day}: a calendar day must fall in the years 1 to 9999"
    )))
}

/// `--from D1 [--to D2]` as a range, or a usage error naming the bad value.
fn range(args: &CalendarRangeArgs) -> Result<(NaiveDate, NaiveDate), CliError> {
    let from = args.from;
    let to = args.to.unwrap_or(from);
    on_calendar("--from", from)?;
    on_calendar("--to", to)?;
    if to < from {
        return Err(CliError::Usage(format!(
            "--to {to}: must not be before --from {from}"
        )));
    }
    if from.checked_add_months(MAX_RANGE).is_none_or(|limit| to > limit) {
        return Err(CliError::Usage(format!(
            "--to {to}: the range from {from} is longer than ten years"
        )));
    }
    Ok((from, to))
}

/// Closes days, opens them, or lists them.
pub async fn calendar(ctx: &Context, action: CalendarAction) -> Result<ExitCode, CliError> {
    match action {
        CalendarAction::List(args) => {
            if let (Some(from), Some(to)) = (args.from, args.to) {
                range(&CalendarRangeArgs { from, to: Some(to) })?;
            }
            let pool = ctx.connect("fine-settler calendar").await?;
            let days = calendar::list(&pool, args.from, args.to).await?;
            pool.close().await;
            output::print_rows(&days, args.json, output::closed_days_table);
            Ok(ExitCode::SUCCESS)
        }
        CalendarAction::Close(args) => {
            let days = range(&args.range)?;
            let by = args.by.unwrap_or_else(operator);
            let pool = ctx.connect("fine-settler calendar").await?;
            let today = database_today(ctx, &pool).await?;
            let changed = calendar::close(&pool, days, &args.reason, &by, today).await;
            pool.close().await;
            report(ctx, "closed", days, today, changed)
        }
        CalendarAction::Open(args) => {
            let days = range(&args)?;
            let pool = ctx.connect("fine-settler calendar").await?;
            let today = database_today(ctx, &pool).await?;
            let changed = calendar::open(&pool, days, today).await;
            pool.close().await;
            report(ctx, "opened", days, today, changed)
        }
    }
}

/// Prints `{"calendar": "closed"|"opened", "from", "to", "days": [...], "loans_queued", "days_outside_window":
/// [...]}`; a refusal is a usage error (exit 2, nothing written). `days_outside_window` are the changed days
/// already over that are older than the accrual's catch-up window (on `today`): the replicas do not re-run them,
/// so their charges are corrected only by a backfill, which a warning on stderr names.
fn report(
    ctx: &Context,
    what: &str,
    (from, to): (NaiveDate, NaiveDate),
    today: NaiveDate,
    changed: Result<Changed, CalendarError>,
) -> Result<ExitCode, CliError> {
    let changed = match changed {
        Ok(c) => c,
        Err(e @ CalendarError::Settled { .. }) => {
            return Err(CliError::Usage(format!("calendar {what}: {e}")))
        }
        Err(CalendarError::Sql(e)) => return Err(e.into()),
    };
    let window = crate::schedule::due::accrual_due(today, ctx.settings.accrual.catch_up_days);
    let oldest = window.first().copied().unwrap_or(today);
    let outside: Vec<NaiveDate> = changed.days.iter().copied().filter(|d| *d < oldest).collect();
    println!(
        "{}",
        serde_json::json!({
            "calendar": what, "from": from, "to": to, "days": changed.days,
            "loans_queued": changed.loans_queued, "days_outside_window": outside,
        })
    );
    if let (Some(first), Some(last)) = (outside.first(), outside.last()) {
        eprintln!(
            "fine-settler: {} changed day(s) from {first} to {last} are older than the accrual's catch-up window \
             (accrual.catch_up_days = {}): the replicas do not re-run them; correct their charges with \
             `fine-settler backfill --job overdue-accrual --from {first} --to {last} --reprocess all`",
            outside.len(),
            ctx.settings.accrual.catch_up_days
        );
    }
    if !changed.days.is_empty() {
        tracing::info!(what, from = %from, to = %to, days = changed.days.len(), loans_queued = changed.loans_queued,
                       "library calendar changed");
    }
    Ok(ExitCode::SUCCESS)
}
