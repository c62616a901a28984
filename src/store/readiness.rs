//! Whether the schema is ready for this binary: the `/readyz` and startup check.

use std::time::Duration;

use super::{classify, migrations::MIGRATOR, Db, DbFailure, ReadOnlyServer};
use crate::redact::secrets_in as redact_secrets_in;

/// Whether the replica can work: the database answers within 2 s and every migration this binary knows is
/// applied. `Err` carries the reason, for `/readyz` and the startup log.
pub async fn readiness(pool: &Db) -> Result<(), String> {
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    // `_sqlx_migrations` is sqlx's own table, not part of the checked schema: an unchecked query.
    let applied = tokio::time::timeout(
        Duration::from_secs(2),
        sqlx::query_as::<_, (Option<i64>, bool, bool)>(
            "select max(version), pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'
             from _sqlx_migrations where success",
        )
        .fetch_one(pool),
    )
    .await;
    match applied {
        Err(_) => Err("database did not answer within 2 s".into()),
        // No `_sqlx_migrations` table: nothing was ever migrated.
        Ok(Err(e)) if classify(&e) == DbFailure::UndefinedTable => Err(format!(
            "migrations missing: none applied, binary needs {latest}; run `fine-settler migrate`"
        )),
        Ok(Err(e)) => Err(format!(
            "database unavailable: {}",
            redact_secrets_in(&e.to_string())
        )),
        Ok(Ok((v, in_recovery, read_only))) => match ReadOnlyServer::of(in_recovery, read_only) {
            Some(r) => Err(r.to_string()),
            None if v.unwrap_or(0) < latest => Err(format!(
                "migrations missing: database at {}, binary needs {latest}; run `fine-settler migrate`",
                v.unwrap_or(0)
            )),
            None => Ok(()),
        },
    }
}
