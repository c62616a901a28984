//! A claimed run as one handle: [`ClaimedRun`] owns what travels together from the claim to the end — the key,
//! the claimant (epoch and owner), the lease, the cursor the run last committed and its committed counts — and
//! its methods are the run's next steps: advance through the fence, renew the lease, and end the run (finish,
//! hand back, lease lost). The statements are those of [`super::fence`] and [`super::finish`]; the handle only
//! supplies their arguments, so that a step can never be given another run's epoch or a stale cursor.
//!
//! The handle is not `Clone`: one claim, one live handle. The methods that end the run take it by value and
//! leave a [`RunEnd`] (or a [`LostRun`]) whose statement may be sent again after a connection error — each is
//! safe to repeat — but through which the run can no longer advance or renew.

use std::time::Duration;

use sqlx::{PgConnection, Postgres, Transaction};

use super::{
    claim::{claim, Claim, ClaimKind, ClaimMode, Holder},
    fence::{self, Fence, Progress},
    finish::{self, Ending},
    Claimant,
};
use crate::{jobs::RunKey, store::Db};

/// A run this process holds: claimed, and not yet ended.
#[derive(Debug)]
pub struct ClaimedRun {
    pool: Db,
    key: RunKey,
    owner: String,
    epoch: i64,
    kind: ClaimKind,
    /// The lease every passed fence renews.
    lease: Duration,
    /// The key's cursor as this run last committed it (or claimed it): each fence, and the SUCCESS, expects it
    /// on the server.
    cursor: Option<i64>,
    /// Rows this run's committed batches read and wrote.
    scanned: i64,
    updated: i64,
    /// Ledger corrections this run's committed batches appended.
    corrected: i64,
}

/// What a claim attempt through [`ClaimedRun::claim`] got.
#[derive(Debug)]
pub enum Claimed {
    /// This process holds the run.
    Won(ClaimedRun),
    /// Someone finished the key, or a live owner holds it.
    Skipped(Holder),
}

/// What one batch covered: the last id (the next cursor) and its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Covered {
    pub last_id: i64,
    pub scanned: i64,
    pub updated: i64,
    /// Ledger corrections the batch appended (kept by the handle for the run's report; the corrections
    /// themselves record their run).
    pub corrected: i64,
}

impl ClaimedRun {
    /// Claims `key` for `owner` under `lease` in `mode` (see [`claim`]); a won claim becomes the run's handle.
    pub async fn claim(
        pool: &Db,
        key: RunKey,
        owner: &str,
        lease: Duration,
        mode: ClaimMode,
    ) -> Result<Claimed, sqlx::Error> {
        Ok(match claim(pool, &key, owner, lease, mode).await? {
            Claim::Won { epoch, cursor, kind } => Claimed::Won(ClaimedRun {
                pool: pool.clone(),
                key,
                owner: owner.to_string(),
                epoch,
                kind,
                lease,
                cursor,
                scanned: 0,
                updated: 0,
                corrected: 0,
            }),
            Claim::Skipped(holder) => Claimed::Skipped(holder),
        })
    }

    /// The key the run holds.
    pub fn key(&self) -> &RunKey {
        &self.key
    }

    /// The epoch the run holds the key under.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// How the claim was won.
    pub fn kind(&self) -> ClaimKind {
        self.kind
    }

    /// The last id a committed batch covered (or the claim found), `None` before any.
    pub fn cursor(&self) -> Option<i64> {
        self.cursor
    }

    /// Where the next batch starts: after the cursor; `None` when nothing can come after it (`i64::MAX`).
    pub fn next_id(&self) -> Option<i64> {
        match self.cursor {
            None => Some(i64::MIN),
            Some(c) => c.checked_add(1),
        }
    }

    /// Rows this run's committed batches read.
    pub fn scanned(&self) -> i64 {
        self.scanned
    }

    /// Rows this run's committed batches wrote.
    pub fn updated(&self) -> i64 {
        self.updated
    }

    /// Ledger corrections this run's committed batches appended.
    pub fn corrected(&self) -> i64 {
        self.corrected
    }

    fn claimant(&self) -> Claimant<'_> {
        Claimant {
            epoch: self.epoch,
            owner: &self.owner,
        }
    }

    /// Ends a batch: runs the fence as the last statement of `tx` (whose business writes are done) and commits
    /// it — the handle's cursor and counts then move to the batch's — or, if the fence found another owner, rolls
    /// it back ([`Fence::Lost`]) and changes nothing.
    pub async fn advance(
        &mut self,
        mut tx: Transaction<'_, Postgres>,
        covered: Covered,
    ) -> Result<Fence, sqlx::Error> {
        let progress = Progress {
            after: self.cursor,
            cursor: covered.last_id,
            scanned: covered.scanned,
            updated: covered.updated,
        };
        let fence = fence::advance(&mut tx, &self.key, self.claimant(), progress, self.lease).await?;
        match fence {
            Fence::Lost => tx.rollback().await?,
            Fence::Passed { .. } => {
                tx.commit().await?;
                self.cursor = Some(covered.last_id);
                self.scanned += covered.scanned;
                self.updated += covered.updated;
                self.corrected += covered.corrected;
            }
        }
        Ok(fence)
    }

    /// The fence of `tx`, which writes part of a batch beside the batch's own transaction: adds the part's
    /// `scanned` and `updated` rows to the key's counters and renews the lease while this run holds the key at
    /// its cursor (see [`fence::beside`]); `false`: `tx` must roll back. Once `tx` committed, the caller adds
    /// them to the handle's counts ([`ClaimedRun::count_beside`]).
    pub async fn pass_beside(
        &self,
        tx: &mut PgConnection,
        scanned: i64,
        updated: i64,
    ) -> Result<bool, sqlx::Error> {
        let holder = self.claimant();
        fence::beside(tx, &self.key, holder, self.cursor, (scanned, updated), self.lease).await
    }

    /// Rows (and corrections) that parts beside a batch committed ([`ClaimedRun::pass_beside`]).
    pub fn count_beside(&mut self, scanned: i64, updated: i64, corrected: i64) {
        self.scanned += scanned;
        self.updated += updated;
        self.corrected += corrected;
    }

    /// Renews the lease while the run waits between batches: the fence with no rows (see [`fence::renew`]).
    pub async fn renew(&self) -> Result<Fence, sqlx::Error> {
        fence::renew(&self.pool, &self.key, self.claimant(), self.cursor, self.lease).await
    }

    /// Ends the run SUCCESS, or FAILED with the lease ended; the statement goes with [`RunEnd::send`].
    pub fn finish(self, ending: Ending<'_>) -> RunEnd {
        let error = match ending {
            Ending::Success => None,
            Ending::Failed(e) => Some(e.to_string()),
        };
        RunEnd { run: self, error }
    }

    /// Hands the key back before it is done (a graceful stop, a pause): FAILED with `why` and the lease ended,
    /// so that a peer takes it over at its next tick and goes on after the cursor.
    pub fn hand_back(self, why: &str) -> RunEnd {
        self.finish(Ending::Failed(why))
    }

    /// The run found its lease lost (a fence, or its finish, matched another epoch): only its history row is
    /// left to write ([`LostRun::record`]).
    pub fn lose(self) -> LostRun {
        LostRun { run: self }
    }
}

/// A run ended by [`ClaimedRun::finish`] or [`ClaimedRun::hand_back`], its statement not yet known to have
/// committed.
#[derive(Debug)]
pub struct RunEnd {
    run: ClaimedRun,
    /// `None`: SUCCESS; else FAILED with this `last_error`.
    error: Option<String>,
}

impl RunEnd {
    /// Sends the end of the run ([`finish::finish`]): `true` once the key is in its final state under this run's
    /// epoch, `false` if another epoch holds it (or, for a SUCCESS, the server lacks the run's last cursor).
    /// Safe to send again after a connection error.
    pub async fn send(&self) -> Result<bool, sqlx::Error> {
        let ending = match &self.error {
            None => Ending::Success,
            Some(e) => Ending::Failed(e),
        };
        let run = &self.run;
        finish::finish(
            &run.pool,
            &run.key,
            run.claimant(),
            run.cursor,
            ending,
            run.scanned,
            run.updated,
        )
        .await
    }

    /// The end found another epoch holding the key: the run lost its lease after its last batch.
    pub fn lost(self) -> LostRun {
        self.run.lose()
    }
}

/// A run that lost its lease: the key belongs to another epoch; only the history learns of this run's end.
#[derive(Debug)]
pub struct LostRun {
    run: ClaimedRun,
}

impl LostRun {
    /// Appends the `lease_lost` history row ([`finish::record_lease_lost`]), with the run's committed counts.
    pub async fn record(&self) -> Result<(), sqlx::Error> {
        let run = &self.run;
        finish::record_lease_lost(
            &run.pool,
            &run.key,
            run.epoch,
            &run.owner,
            run.scanned,
            run.updated,
        )
        .await
    }
}
