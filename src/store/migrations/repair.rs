//! Before the migrations run, under the migrate lock: what an earlier run left half-done is undone, so that the
//! migration that makes it runs again. An owned index left INVALID by an interrupted build is dropped and its
//! migration forgotten (`create index … if not exists` would otherwise take the leftover for the index); an
//! owned index that is gone while its migration is recorded has that migration forgotten. Nothing a live
//! session is building is ever dropped: `migrate` waits for that build to end first. And after the migrations,
//! an index a migration retired that was built again since is dropped again.

use std::time::Duration;

use sqlx::PgConnection;

use super::{
    owned::{retired_indexes, RetiredIndex},
    schema::{self, IndexState, IndexStatus, Recorded},
    OwnedIndex,
};

/// How often the builds another session is running are looked at again.
const BUILD_POLL: Duration = Duration::from_secs(1);

/// Readies the rebuild of every owned index that is INVALID or gone: the migrations that create them run
/// again. Returns those indexes.
pub(super) async fn prepare_rebuilds(
    conn: &mut PgConnection,
) -> Result<Vec<&'static OwnedIndex>, sqlx::Error> {
    let recorded = schema::recorded(&mut *conn).await?;
    let is_recorded = |version: i64| {
        recorded
            .as_deref()
            .is_some_and(|r: &[Recorded]| r.iter().any(|m| m.version == version))
    };
    let mut rebuilt = Vec::new();
    for status in after_builds(conn).await? {
        let index = status.index;
        match (status.state, status.regclass) {
            (IndexState::Invalid, Some(regclass)) => {
                tracing::warn!(index = %index.name, migration = index.migration,
                    "dropping an invalid index left by an interrupted build; it is rebuilt next");
                // Concurrently, so that libraryd keeps writing to the table meanwhile. `regclass` is the name
                // PostgreSQL gave back, quoted where it needs to be.
                sqlx::query(&format!("drop index concurrently if exists {regclass}"))
                    .execute(&mut *conn)
                    .await?;
            }
            (IndexState::Missing, _) if is_recorded(index.migration) => {
                tracing::warn!(index = %index.name, migration = index.migration,
                    "an index is missing although its migration is recorded; it is rebuilt next");
            }
            _ => continue,
        }
        if is_recorded(index.migration) {
            forget(conn, index.migration).await?;
        }
        rebuilt.push(index);
    }
    Ok(rebuilt)
}

/// Where every owned index stands once no other session is building any of them: waits (polling, holding no
/// snapshot in between) while one is.
async fn after_builds(conn: &mut PgConnection) -> Result<Vec<IndexStatus>, sqlx::Error> {
    let mut told = false;
    loop {
        let states = schema::index_states(&mut *conn).await?;
        let building: Vec<&str> = states
            .iter()
            .filter(|s| s.state == IndexState::Building)
            .map(|s| s.index.name.as_str())
            .collect();
        if building.is_empty() {
            return Ok(states);
        }
        if !told {
            tracing::warn!(indexes = ?building,
                "another session is building an index; waiting for that build to end before looking at it");
            told = true;
        }
        tokio::time::sleep(BUILD_POLL).await;
    }
}

/// Makes sqlx's migrator run migration `version` again.
async fn forget(conn: &mut PgConnection, version: i64) -> Result<(), sqlx::Error> {
    // `_sqlx_migrations` belongs to sqlx, not to the checked schema: an unchecked query.
    sqlx::query("delete from _sqlx_migrations where version = $1")
        .bind(version)
        .execute(conn)
        .await?;
    Ok(())
}

/// After the migrations ran: drops every index a recorded migration retired that exists all the same — built
/// again by a binary from before the drop (its `migrate` takes such an index for its own gone missing, forgets the
/// migration that built it and runs that again; the drop, already recorded, would never run again). Returns
/// those indexes.
pub(super) async fn drop_retired(conn: &mut PgConnection) -> Result<Vec<&'static RetiredIndex>, sqlx::Error> {
    let recorded = schema::recorded(&mut *conn).await?;
    let mut dropped = Vec::new();
    for index in retired_indexes() {
        let retired = recorded
            .as_deref()
            .is_some_and(|r: &[Recorded]| r.iter().any(|m| m.version == index.dropped_by));
        if !retired {
            continue;
        }
        // Resolved through the search path, as the migrations that built and dropped it named it.
        let regclass: Option<String> = sqlx::query_scalar("select to_regclass($1)::text")
            .bind(&index.name)
            .fetch_one(&mut *conn)
            .await?;
        let Some(regclass) = regclass else {
            continue;
        };
        tracing::warn!(index = %index.name, migration = index.dropped_by,
            "dropping an index a migration retired, built again since (by the migrate of an older release)");
        sqlx::query(&format!("drop index concurrently if exists {regclass}"))
            .execute(&mut *conn)
            .await?;
        dropped.push(index);
    }
    Ok(dropped)
}
