//! PostgreSQL's shared lock table, which an accrual batch fills with one advisory lock per loan when a policy has
//! a cap ([`lock_loans`](crate::store::ledger::lock_loans)). The server holds about `max_locks_per_transaction ×
//! (max_connections + max_prepared_transactions)` locks for every session, libraryd's included: a batch that needs
//! more fails with "out of shared memory" (SQLSTATE 53200) at every attempt — its day never accrues — and while it
//! fills the table, libraryd's own transactions fail the same way. So a process cuts its accrual batches to a
//! share of the table ([`LockTable::fit`]), and says so — whether or not a policy has a cap now: a version with a
//! cap can be added while the process runs.

use crate::store::Db;

/// The share of the server's lock table fine-settler's accrual batches may hold at once: a quarter (the rest is
/// libraryd's), divided among the batches that run at the same time — a replica's among the fleet's replicas, a
/// backfill's among its concurrent runs.
const SHARE: i64 = 4;

/// The server's lock table, as its settings size it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockTable {
    pub per_transaction: i64,
    pub connections: i64,
    pub prepared: i64,
}

impl LockTable {
    /// The server's settings (one statement).
    pub async fn read(pool: &Db) -> Result<LockTable, sqlx::Error> {
        let row = sqlx::query!(
            r#"select current_setting('max_locks_per_transaction')::bigint as "per_transaction!",
                      current_setting('max_connections')::bigint as "connections!",
                      current_setting('max_prepared_transactions')::bigint as "prepared!""#
        )
        .fetch_one(pool)
        .await?;
        Ok(LockTable {
            per_transaction: row.per_transaction,
            connections: row.connections,
            prepared: row.prepared,
        })
    }

    /// About how many locks the table holds.
    pub fn slots(&self) -> i64 {
        self.per_transaction
            .saturating_mul(self.connections.saturating_add(self.prepared))
    }

    /// The most loans each of `at_once` batches running at the same time (a fleet's replicas, a backfill's
    /// concurrent runs) may lock: a quarter of the table shared among them, at least one.
    pub fn batch_budget(&self, at_once: u32) -> u32 {
        let share = self.slots() / SHARE / i64::from(at_once.max(1));
        u32::try_from(share.max(1)).unwrap_or(u32::MAX)
    }

    /// `configured` (`accrual.batch_size`), or the budget of `at_once` batches if it is smaller — with a warning
    /// that names the key and the server's settings.
    pub fn fit(&self, configured: u32, at_once: u32) -> u32 {
        let budget = self.batch_budget(at_once);
        if configured <= budget {
            return configured;
        }
        tracing::warn!(
            accrual_batch_size = configured,
            batches_at_once = at_once,
            batch_size_used = budget,
            lock_table = self.slots(),
            max_locks_per_transaction = self.per_transaction,
            max_connections = self.connections,
            max_prepared_transactions = self.prepared,
            "accrual.batch_size is more loan locks than a quarter of the server's lock table allows each of the \
             batches that run at once (the table: max_locks_per_transaction × (max_connections + \
             max_prepared_transactions), shared with libraryd; a batch takes one lock per loan when a policy has a \
             cap); accrual batches are cut to fit: lower accrual.batch_size (or the batches at once), or raise \
             max_locks_per_transaction and restart"
        );
        budget
    }
}

/// The accrual batch size for `at_once` batches on `pool`'s server ([`LockTable::fit`]), or why the server's
/// settings could not be read.
pub async fn fitted(pool: &Db, configured: u32, at_once: u32) -> Result<u32, sqlx::Error> {
    Ok(LockTable::read(pool).await?.fit(configured, at_once))
}

/// [`fitted`]; if the server's settings cannot be read, `configured` (the batch itself then fails as it would
/// have), with a warning.
pub async fn fit_accrual_batch(pool: &Db, configured: u32, at_once: u32) -> u32 {
    match fitted(pool, configured, at_once).await {
        Ok(size) => size,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the server's lock table settings; accrual batches keep accrual.batch_size");
            configured
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULTS: LockTable = LockTable {
        per_transaction: 64,
        connections: 100,
        prepared: 0,
    };

    #[test]
    fn a_default_server_holds_6400_locks_and_one_batch_may_take_a_quarter() {
        assert_eq!(DEFAULTS.slots(), 6400);
        assert_eq!(DEFAULTS.batch_budget(1), 1600);
        assert_eq!(DEFAULTS.batch_budget(8), 200);
        assert_eq!(DEFAULTS.batch_budget(0), 1600);
    }

    #[test]
    fn a_batch_that_fits_is_kept_and_one_that_does_not_is_cut() {
        assert_eq!(DEFAULTS.fit(1000, 1), 1000);
        assert_eq!(DEFAULTS.fit(10_000, 1), 1600);
        assert_eq!(DEFAULTS.fit(1000, 8), 200);
    }

    #[test]
    fn a_tiny_table_still_allows_one_loan_a_batch() {
        let tiny = LockTable {
            per_transaction: 1,
            connections: 1,
            prepared: 0,
        };
        assert_eq!(tiny.batch_budget(4), 1);
        assert_eq!(tiny.fit(50, 4), 1);
    }
}
