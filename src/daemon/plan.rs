//! `plan`'s view of a tick: what a tick at a given time would do, from the same status statement and the same
//! plan as the tick itself; writes nothing.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{
    recheck::{self, CHANGES_PER_RECHECK},
    TickError,
};
use crate::{
    config::{Settings, TimeSource},
    schedule::due::{self, Due},
    store::{self, corrections, Session},
};

/// What a tick at `at` would do (default: now, by the configured clock), one line per due key, as `plan`
/// prints it. Reads the tick status; writes nothing.
pub async fn plan(settings: &Settings, at: Option<DateTime<Utc>>) -> Result<Vec<Due>, TickError> {
    let pool = store::connect_lazy(
        &settings.database,
        "fine-settler plan",
        settings.claim.lease.batch_timeout(),
    );
    pool.reconnect().await?;
    let mut session = Session::new(
        &pool,
        "fine-settler plan",
        settings.database.connect_timeout,
        settings.claim.lease.batch_timeout() + settings.database.connect_timeout,
    );
    // The status statement's bounds (the oldest key read, the months probed for late returns) by the clock the
    // tick uses: with `time.source = "database"` the database's, so that a host clock ahead or behind plans what
    // the tick then does.
    let around = match (at, settings.time_source) {
        (Some(at), _) => at,
        (None, TimeSource::Database) => crate::store::database_now(&pool).await?,
        (None, TimeSource::System) => Utc::now(),
    };
    let mut status = session
        .tick_status(
            settings.instance,
            due::window_start(settings, around),
            due::late_probe(settings, around),
        )
        .await?;
    let now = match (at, settings.time_source) {
        (Some(at), _) => at,
        (None, TimeSource::Database) => status.now,
        (None, TimeSource::System) => Utc::now(),
    };
    // The accrual days a re-check would re-open, asked without clearing anything.
    if let Some((first, last)) = recheck::window(settings, now) {
        let found = corrections::recheck(
            &pool,
            settings.instance,
            first,
            last,
            CHANGES_PER_RECHECK,
            false,
            Duration::ZERO,
        )
        .await?;
        recheck::mark_late(&mut status.keys, &found.days.into_iter().collect());
    }
    Ok(due::plan(settings, now, &status.keys, &status.pauses))
}
