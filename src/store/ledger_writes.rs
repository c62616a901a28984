//! The accrual's writes as the server's engine plans them: [`crate::store::ledger`]'s and
//! [`crate::store::corrections`]' statements on PostgreSQL, their forms for Citus ([`crate::store::citus::ledger`])
//! on a Citus coordinator. Both compute the same rows.

use chrono::NaiveDate;
use sqlx::PgConnection;

use crate::{
    config::Engine,
    jobs::RunKey,
    store::{
        citus,
        corrections::{self, Corrected},
        ledger::{self, Charged, Clamp},
    },
};

/// The accrual's writes for one engine (`database.engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LedgerWrites {
    engine: Engine,
}

impl LedgerWrites {
    pub fn new(engine: Engine) -> Self {
        LedgerWrites { engine }
    }

    /// See [`ledger::charge`].
    pub async fn charge(
        self,
        tx: &mut PgConnection,
        day: NaiveDate,
        ids: &[i64],
        clamp: Clamp,
    ) -> Result<Charged, sqlx::Error> {
        match self.engine {
            Engine::Postgresql => ledger::charge(tx, day, ids, clamp).await,
            Engine::Citus => citus::ledger::charge(tx, day, ids, clamp).await,
        }
    }

    /// See [`corrections::correct`].
    pub async fn correct(
        self,
        tx: &mut PgConnection,
        key: &RunKey,
        epoch: i64,
        ids: &[i64],
        clamp: Clamp,
    ) -> Result<(Corrected, Vec<i64>), sqlx::Error> {
        match self.engine {
            Engine::Postgresql => corrections::correct(tx, key, epoch, ids, clamp).await,
            Engine::Citus => citus::ledger::correct(tx, key, epoch, ids, clamp).await,
        }
    }

    /// See [`corrections::relieve`].
    pub async fn relieve(
        self,
        tx: &mut PgConnection,
        key: &RunKey,
        epoch: i64,
        ids: &[i64],
    ) -> Result<Corrected, sqlx::Error> {
        match self.engine {
            Engine::Postgresql => corrections::relieve(tx, key, epoch, ids).await,
            Engine::Citus => citus::ledger::relieve(tx, key, epoch, ids).await,
        }
    }

    /// See [`ledger::enqueue`].
    pub async fn enqueue(
        self,
        tx: &mut PgConnection,
        ids: &[i64],
        day: NaiveDate,
        error: &str,
        retry_in_ms: i64,
    ) -> Result<(), sqlx::Error> {
        match self.engine {
            Engine::Postgresql => ledger::enqueue(tx, ids, day, error, retry_in_ms).await,
            Engine::Citus => citus::ledger::enqueue(tx, ids, day, error, retry_in_ms).await,
        }
    }

    /// See [`corrections::note_changes`].
    pub async fn note_changes(self, tx: &mut PgConnection, ids: &[i64]) -> Result<(), sqlx::Error> {
        match self.engine {
            Engine::Postgresql => corrections::note_changes(tx, ids).await,
            Engine::Citus => citus::ledger::note_changes(tx, ids).await,
        }
    }
}
