//! Whether the schema is ready for this binary: the `/readyz` and startup check.

use std::time::Duration;

use super::{
    migrations::{schema, Gaps},
    Db, ReadOnlyServer,
};

/// How long the database has to answer every question of the check.
const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// Whether the replica can work: the database answers within 2 s, can write, records every migration this binary
/// embeds as applied (not only the latest: a migration forgotten in the middle counts), and has every index
/// fine-settler owns present and valid. `Err` carries the reason, naming each migration or index that falls
/// short, for `/readyz` and the startup log.
pub async fn readiness(pool: &Db) -> Result<(), String> {
    match tokio::time::timeout(ANSWER_WITHIN, look(pool)).await {
        Err(_) => Err("database did not answer within 2 s".into()),
        Ok(Err(e)) => Err(format!(
            "database unavailable: {}",
            super::tls::database_error(&e)
        )),
        Ok(Ok(Err(reason))) => Err(reason),
        Ok(Ok(Ok(()))) => Ok(()),
    }
}

/// The check's three questions, each a statement of its own (behind a transaction-mode pooler, each its own
/// transaction): can the server write, which migrations are recorded, where the owned indexes stand.
async fn look(pool: &Db) -> Result<Result<(), String>, sqlx::Error> {
    // The first user of a lazy pool: it learns whether the server's TLS works before it connects.
    pool.learn_tls().await;
    let (in_recovery, read_only) = sqlx::query_as::<_, (bool, bool)>(
        "select pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'",
    )
    .fetch_one(pool)
    .await?;
    if let Some(r) = ReadOnlyServer::of(in_recovery, read_only) {
        return Ok(Err(r.to_string()));
    }
    let recorded = schema::recorded(pool).await?;
    let indexes = schema::index_states(pool).await?;
    let gaps = Gaps::of(recorded.as_deref(), &indexes);
    Ok(if gaps.is_empty() {
        Ok(())
    } else {
        Err(gaps.to_string())
    })
}
