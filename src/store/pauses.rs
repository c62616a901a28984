//! `job_pauses` and `job_pause_events`: an operator's pause of a job (every shard, or one shard of one shard
//! count), stored in the database so that every replica sees it, and the append-only history of pauses and
//! resumes. The tick reads the pauses that cover its shard in its status statement
//! ([`crate::store::job_runs::tick_status`]) and a run learns of one at its batch fence
//! ([`crate::store::job_runs::advance`]); this module holds the operator's statements.

use crate::store::Db;
use chrono::{DateTime, Utc};

use crate::{jobs::JobName, shard::ShardSpec};

/// What a pause covers. Stored as `(shards, shard)`, with `(0, 0)` for the whole job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseScope {
    /// Every shard of every shard count.
    Job,
    /// One shard of one shard count.
    Shard(ShardSpec),
}

impl PauseScope {
    /// The `(shards, shard)` columns.
    fn columns(self) -> (i32, i32) {
        match self {
            PauseScope::Job => (0, 0),
            PauseScope::Shard(s) => (s.shards(), s.shard()),
        }
    }

    /// The scope the columns `(shards, shard)` stand for; `None` for a pair the table's check refuses.
    pub fn from_columns(shards: i32, shard: i32) -> Option<Self> {
        if shards == 0 && shard == 0 {
            return Some(PauseScope::Job);
        }
        ShardSpec::new(i64::from(shard), i64::from(shards))
            .ok()
            .map(PauseScope::Shard)
    }

    /// Whether a pause of this scope stops the keys of `shard`.
    pub fn covers(self, shard: ShardSpec) -> bool {
        match self {
            PauseScope::Job => true,
            PauseScope::Shard(s) => s == shard,
        }
    }
}

impl std::fmt::Display for PauseScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PauseScope::Job => f.write_str("every shard"),
            PauseScope::Shard(s) => write!(f, "shard {} of {}", s.shard(), s.shards()),
        }
    }
}

/// A pause in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pause {
    pub job_name: String,
    pub scope: PauseScope,
    pub by: String,
    pub reason: String,
    /// When it was set (database time).
    pub since: DateTime<Utc>,
}

impl Pause {
    /// The `last_error` of a key a run handed back because of this pause.
    pub fn run_error(by: &str, reason: &str) -> String {
        format!("paused: {reason} (by {by})")
    }

    /// The JSON fields of the pause: `job`, `shards` and `shard` (null for the whole job), `by`, `reason`,
    /// `since`.
    pub fn json(&self) -> serde_json::Value {
        let (shards, shard) = match self.scope {
            PauseScope::Job => (None, None),
            PauseScope::Shard(s) => (Some(s.shards()), Some(s.shard())),
        };
        serde_json::json!({
            "job": self.job_name, "shards": shards, "shard": shard,
            "by": self.by, "reason": self.reason, "since": self.since,
        })
    }
}

impl std::fmt::Display for Pause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}) is paused by {} since {}: {}",
            self.job_name,
            self.scope,
            self.by,
            self.since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            self.reason
        )
    }
}

/// What `pause` found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paused {
    /// Whether this call set the pause (`false`: the scope was already paused, and that pause is unchanged).
    pub new: bool,
    /// The pause in force afterwards.
    pub pause: Pause,
}

/// How many times [`pause`] asks again when a concurrent resume removed the pause it conflicted with.
const PAUSE_ATTEMPTS: u32 = 5;

/// Pauses `job` for `scope`, recording it in the history. Idempotent: an existing pause of the same scope is
/// left as it is (its who, why and since stay those of the first pause) and nothing is recorded.
pub async fn pause(
    pool: &Db,
    job: JobName,
    scope: PauseScope,
    by: &str,
    reason: &str,
) -> Result<Paused, sqlx::Error> {
    let (shards, shard) = scope.columns();
    for _ in 0..PAUSE_ATTEMPTS {
        // A conflicting pause committed after this statement's snapshot is waited for by `on conflict` but not
        // seen by the second branch's read: then no row comes back, and the next statement sees it (or, if a
        // resume removed it meanwhile, inserts).
        let row = sqlx::query!(
            r#"with new as (
                   insert into job_pauses (job_name, shards, shard, paused_by, reason)
                   values ($1, $2, $3, $4, $5)
                   on conflict on constraint job_pauses_pkey do nothing
                   returning paused_by, reason, paused_at
               ), history as (
                   insert into job_pause_events (job_name, shards, shard, event, by, reason, paused_at)
                   select $1, $2, $3, 'paused', paused_by, reason, paused_at from new
               )
               select true as "new!", paused_by as "paused_by!", reason as "reason!", paused_at as "paused_at!"
               from new
               union all
               select false, paused_by, reason, paused_at from job_pauses
               where job_name = $1 and shards = $2 and shard = $3 and not exists (select 1 from new)"#,
            job.as_str(),
            shards,
            shard,
            by,
            reason,
        )
        .fetch_optional(pool)
        .await?;
        if let Some(r) = row {
            return Ok(Paused {
                new: r.new,
                pause: Pause {
                    job_name: job.as_str().to_string(),
                    scope,
                    by: r.paused_by,
                    reason: r.reason,
                    since: r.paused_at,
                },
            });
        }
    }
    Err(sqlx::Error::RowNotFound)
}

/// Lifts the pause of `job` for exactly `scope` (a pause of the whole job is not lifted by resuming one shard,
/// nor the other way round), recording who did it. Returns the pause that was lifted, `None` if there was none.
pub async fn resume(
    pool: &Db,
    job: JobName,
    scope: PauseScope,
    by: &str,
) -> Result<Option<Pause>, sqlx::Error> {
    let (shards, shard) = scope.columns();
    let row = sqlx::query!(
        r#"with gone as (
               delete from job_pauses where job_name = $1 and shards = $2 and shard = $3
               returning paused_by, reason, paused_at
           ), history as (
               insert into job_pause_events (job_name, shards, shard, event, by, reason, paused_at)
               select $1, $2, $3, 'resumed', $4, reason, paused_at from gone
           )
           select paused_by, reason, paused_at from gone"#,
        job.as_str(),
        shards,
        shard,
        by,
    )
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|r| Pause {
        job_name: job.as_str().to_string(),
        scope,
        by: r.paused_by,
        reason: r.reason,
        since: r.paused_at,
    }))
}

/// Every pause in force, optionally of one job: by job, the whole job's first, then by shard count and shard.
pub async fn list(pool: &Db, job: Option<&str>) -> Result<Vec<Pause>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"select job_name, shards, shard, paused_by, reason, paused_at from job_pauses
           where $1::text is null or job_name = $1
           order by job_name, shards, shard"#,
        job,
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| {
            Some(Pause {
                scope: PauseScope::from_columns(r.shards, r.shard)?,
                job_name: r.job_name,
                by: r.paused_by,
                reason: r.reason,
                since: r.paused_at,
            })
        })
        .collect())
}

/// The pause that stops `job` on `shard`, if any (the whole job's before the shard's own).
pub async fn covering(pool: &Db, job: JobName, shard: ShardSpec) -> Result<Option<Pause>, sqlx::Error> {
    Ok(list(pool, Some(job.as_str()))
        .await?
        .into_iter()
        .find(|p| p.scope.covers(shard)))
}

/// One row of `job_pause_events`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PauseEvent {
    pub id: i64,
    pub job_name: String,
    pub shards: i32,
    pub shard: i32,
    pub event: String,
    pub by: String,
    pub reason: Option<String>,
    pub paused_at: Option<DateTime<Utc>>,
    pub at: DateTime<Utc>,
}

/// The pause history, optionally of one job, oldest first.
pub async fn history(pool: &Db, job: Option<&str>) -> Result<Vec<PauseEvent>, sqlx::Error> {
    sqlx::query_as!(
        PauseEvent,
        r#"select id, job_name, shards, shard, event, by, reason, paused_at, at from job_pause_events
           where $1::text is null or job_name = $1
           order by id"#,
        job,
    )
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_pause_covers_every_shard_and_a_shard_pause_only_its_own() {
        let s = |shard, shards| ShardSpec::new(shard, shards).expect("shard");
        assert!(PauseScope::Job.covers(s(2, 4)));
        assert!(PauseScope::Shard(s(2, 4)).covers(s(2, 4)));
        assert!(!PauseScope::Shard(s(2, 4)).covers(s(1, 4)));
        // Shard 2 of 3 holds other rows than shard 2 of 4.
        assert!(!PauseScope::Shard(s(2, 4)).covers(s(2, 3)));
        assert_eq!(PauseScope::from_columns(0, 0), Some(PauseScope::Job));
        assert_eq!(PauseScope::from_columns(4, 2), Some(PauseScope::Shard(s(2, 4))));
        assert_eq!(PauseScope::from_columns(4, 4), None);
        assert_eq!(PauseScope::Shard(s(2, 4)).columns(), (4, 2));
        assert_eq!(PauseScope::Job.columns(), (0, 0));
    }
}
