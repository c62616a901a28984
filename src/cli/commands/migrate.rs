//! `migrate`: apply the embedded migrations (idempotent, safe from many hosts at once).

use std::process::ExitCode;

use crate::{
    cli::{CliError, Context},
    config::Pooler,
    progress, store,
};

/// Applies every migration not yet applied and prints `{"migrate":"ok","migrations":N}`.
pub async fn migrate(ctx: &Context) -> Result<ExitCode, CliError> {
    if ctx.settings.database.pooler == Pooler::Transaction {
        // sqlx's migrator holds a session-level advisory lock, and indexes are built concurrently: both need a
        // session of their own, which a transaction-mode pool does not give.
        return Err(CliError::Usage(
            "migrate needs a session of its own, which database.pooler = \"transaction\" does not give: \
             run it against the server directly or through a session-mode pool (e.g. \
             FINE_SETTLER__DATABASE__POOLER=none DATABASE_URL=postgres://…direct…)"
                .into(),
        ));
    }
    let bars = progress::wanted().then(progress::index_build_bars);
    store::migrate(&ctx.settings.database, bars).await?;
    println!(
        "{}",
        serde_json::json!({"migrate": "ok", "migrations": store::MIGRATOR.iter().count()})
    );
    Ok(ExitCode::SUCCESS)
}
