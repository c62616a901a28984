//! `migrate`: apply the embedded migrations (idempotent, safe from many hosts at once).

use std::process::ExitCode;

use crate::{
    cli::{CliError, Context},
    config::Pooler,
    progress, store,
};

/// Applies every migration not yet applied, rebuilding any index fine-settler owns that is INVALID or gone and
/// dropping again any index a migration retired that was built again since, and seeds the first `default` fine
/// policy from the `[fine]` keys when `fine_policies` is empty, and prints
/// `{"migrate":"ok","migrations":N,"indexes":M,"rebuilt":[…],"dropped":[…],"policy_seeded":true|false}`. Exits 1, naming each migration or index
/// that falls short, if the schema is still incomplete at the end.
pub async fn migrate(ctx: &Context) -> Result<ExitCode, CliError> {
    if ctx.settings.database.pooler == Pooler::Transaction {
        // `migrate` holds a session-level advisory lock throughout, and indexes are built concurrently: both need
        // a session of their own, which a transaction-mode pool does not give.
        return Err(CliError::Usage(
            "migrate needs a session of its own, which database.pooler = \"transaction\" does not give: \
             run it against the server directly or through a session-mode pool (e.g. \
             FINE_SETTLER__DATABASE__POOLER=none DATABASE_URL=postgres://…direct…)"
                .into(),
        ));
    }
    let bars = progress::wanted().then(progress::index_build_bars);
    let migrated = store::migrate(&ctx.settings.database, bars).await?;
    if !migrated.gaps.is_empty() {
        eprintln!(
            "fine-settler: the schema is incomplete after migrate: {}",
            migrated.gaps
        );
        return Ok(ExitCode::from(1));
    }
    // The first `default` policy comes from this deployment's `[fine]` keys, when the table is still empty.
    let pool = ctx.connect("fine-settler migrate").await?;
    let seeded = store::policies::seed_default(&pool, &ctx.settings.fine).await;
    pool.close().await;
    let policy_seeded = seeded?;
    let rebuilt: Vec<&str> = migrated.rebuilt.iter().map(|i| i.name.as_str()).collect();
    let dropped: Vec<&str> = migrated.dropped.iter().map(|i| i.name.as_str()).collect();
    println!(
        "{}",
        serde_json::json!({
            "migrate": "ok",
            "migrations": store::MIGRATOR.iter().count(),
            "indexes": store::owned_indexes().len(),
            "rebuilt": rebuilt,
            "dropped": dropped,
            "policy_seeded": policy_seeded,
        })
    );
    Ok(ExitCode::SUCCESS)
}
