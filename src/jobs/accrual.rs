//! Daily overdue accrual: for each loan of the shard overdue on day D, one ledger row `(loan, D, rate)`, until
//! the loan's ledger total reaches the cap. With the same policy, a returned loan's ledger total equals the fine
//! the month-end settlement sets: the days charged are exactly `due_on + grace_days < D <= returned_on`.
//!
//! A batch first tries all its charges in one statement under a savepoint. If the database rejects it (a
//! constraint or trigger, a lock or statement timeout), the charges are retried one by one, each under its own
//! savepoint, and those that still fail go to `fine_pending` with the error; the rest of the batch commits, in
//! the same fenced transaction. The compensation pass ([`compensate`]) retries pending charges with capped
//! exponential backoff until they succeed or become DEAD after `accrual.max_attempts`.

use std::time::Duration;

use chrono::NaiveDate;
use sqlx::{Connection, PgConnection, PgPool};

use super::{
    runner::{BatchJob, JobError},
    JobName, RunKey,
};
use crate::{
    fine::FinePolicy,
    shard::ShardSpec,
    store::ledger::{self, Overdue},
};

/// The accrual job under one fine policy.
#[derive(Debug, Clone, Copy)]
pub struct Accrual {
    pub policy: FinePolicy,
    /// First retry delay of a failed charge; doubled per attempt up to `backoff_max`.
    pub backoff: Duration,
    pub backoff_max: Duration,
    /// Statement timeout of each charge while a failed batch is isolated row by row.
    pub row_timeout: Duration,
}

/// The delay before retry number `attempts + 1` of a charge that has failed `attempts` times (1-based):
/// `base * 2^(attempts - 1)`, capped at `max`.
pub fn retry_delay(attempts: i32, base: Duration, max: Duration) -> Duration {
    let exponent = u32::try_from(attempts.saturating_sub(1)).unwrap_or(0).min(32);
    base.saturating_mul(2u32.saturating_pow(exponent)).min(max)
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Accrual {
    /// The job as configured.
    pub fn from_settings(settings: &crate::config::Settings) -> Self {
        Accrual {
            policy: settings.fine,
            backoff: settings.accrual.retry_backoff,
            backoff_max: settings.accrual.retry_backoff_max,
            // Short enough that isolating a whole batch of locked rows stays inside the batch timeout.
            row_timeout: (settings.claim.batch_timeout / 20)
                .clamp(Duration::from_millis(50), Duration::from_secs(2)),
        }
    }

    /// What to charge a loan that already accrued `accrued` cents: the daily rate, or what is left under the cap.
    pub fn amount(&self, accrued: i64) -> i64 {
        let rate = self.policy.daily_rate().get();
        match self.policy.cap() {
            Some(cap) => rate.min(cap.get().saturating_sub(accrued).max(0)),
            None => rate,
        }
    }
}

/// Whether the database rejected the statement (so the row can be isolated and queued), as opposed to the
/// connection failing (which fails the batch).
fn rejected(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(_))
}

impl BatchJob for Accrual {
    type Batch = Vec<Overdue>;

    fn name(&self) -> JobName {
        JobName::OverdueAccrual
    }

    fn extent(batch: &Vec<Overdue>) -> (i64, i64) {
        (batch.last().map_or(i64::MAX, |r| r.id), batch.len() as i64)
    }

    async fn fetch(
        &self,
        pool: &PgPool,
        key: &RunKey,
        from_id: i64,
        limit: i64,
    ) -> Result<Option<Vec<Overdue>>, JobError> {
        let cap = self.policy.cap().map_or(0, |c| c.get());
        let rows = ledger::overdue_batch(
            pool,
            key.business_date,
            key.shard,
            self.policy.grace_days(),
            cap,
            from_id,
            limit,
        )
        .await?;
        Ok((!rows.is_empty()).then_some(rows))
    }

    async fn write(&self, tx: &mut PgConnection, key: &RunKey, rows: &Vec<Overdue>) -> Result<u64, JobError> {
        let day = key.business_date;
        let charges: Vec<(i64, i64)> = rows
            .iter()
            .map(|r| (r.id, self.amount(r.accrued)))
            .filter(|(_, amount)| *amount > 0)
            .collect();
        let ids: Vec<i64> = charges.iter().map(|c| c.0).collect();
        let amounts: Vec<i64> = charges.iter().map(|c| c.1).collect();

        let mut all = tx.begin().await?;
        match ledger::charge(&mut all, day, &ids, &amounts).await {
            Ok(written) => {
                all.commit().await?;
                return Ok(written);
            }
            Err(e) if rejected(&e) => {
                all.rollback().await?;
                tracing::warn!(error = %e, rows = ids.len(), "batch charge rejected; isolating the failing loans");
            }
            Err(e) => return Err(e.into()),
        }

        ledger::set_local_statement_timeout(tx, self.row_timeout.as_millis() as u64).await?;
        let (mut written, mut queued) = (0u64, 0u64);
        for (id, amount) in charges {
            let mut one = tx.begin().await?;
            match ledger::charge(&mut one, day, &[id], &[amount]).await {
                Ok(n) => {
                    one.commit().await?;
                    written += n;
                }
                Err(e) if rejected(&e) => {
                    one.rollback().await?;
                    let error = e.to_string();
                    let delay = retry_delay(1, self.backoff, self.backoff_max);
                    ledger::enqueue(tx, id, day, amount, &error, millis(delay)).await?;
                    queued += 1;
                    tracing::warn!(loan_id = id, accrual_date = %day, error = %error, "charge failed; queued for compensation");
                }
                Err(e) => return Err(e.into()),
            }
        }
        tracing::info!(written, queued, "isolated a rejected batch");
        Ok(written)
    }
}

/// What a compensation pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Compensation {
    /// Pending charges written to the ledger (or found already there, or no longer owed under the cap).
    pub charged: u64,
    /// Charges that failed again and wait for their next attempt.
    pub retried: u64,
    /// Charges that failed for the last time and became DEAD.
    pub dead: u64,
}

/// Retries pending charges: those of `shard` that are due (or, with `due_only = false`, every PENDING one).
/// Each charge is its own transaction: lock the pending row (skipping one another replica holds), charge it and
/// remove it; or, if the charge is rejected again, count the attempt and schedule the next (DEAD after
/// `max_attempts`).
pub async fn compensate(
    pool: &PgPool,
    accrual: &Accrual,
    shard: Option<ShardSpec>,
    due_only: bool,
    max_attempts: u32,
) -> Result<Compensation, sqlx::Error> {
    let mut result = Compensation::default();
    // Due-only passes loop: every row they process leaves the due set (charged, or rescheduled). A retry-now pass
    // takes one snapshot of every PENDING row, since a row that fails again stays PENDING.
    let limit = if due_only { 500 } else { i64::MAX };
    loop {
        let batch = ledger::due_pending(pool, shard, due_only, limit).await?;
        if batch.is_empty() {
            break;
        }
        let mut progressed = false;
        for p in &batch {
            let mut tx = pool.begin().await?;
            let Some(attempts) = ledger::lock_pending(&mut tx, p.loan_id, p.accrual_date).await? else {
                continue;
            };
            progressed = true;
            let amount = accrual
                .amount(ledger::accrued(&mut tx, p.loan_id).await?)
                .min(p.amount_cents);
            if amount <= 0 {
                // The cap was reached meanwhile: nothing is owed for this day any more.
                ledger::resolve(&mut tx, p.loan_id, p.accrual_date).await?;
                tx.commit().await?;
                result.charged += 1;
                continue;
            }
            let mut one = tx.begin().await?;
            match ledger::charge(&mut one, p.accrual_date, &[p.loan_id], &[amount]).await {
                Ok(_) => {
                    one.commit().await?;
                    ledger::resolve(&mut tx, p.loan_id, p.accrual_date).await?;
                    tx.commit().await?;
                    result.charged += 1;
                    tracing::info!(loan_id = p.loan_id, accrual_date = %p.accrual_date, attempts = attempts + 1, "pending charge compensated");
                }
                Err(e) if rejected(&e) => {
                    one.rollback().await?;
                    let attempts = attempts.saturating_add(1);
                    let dead = u32::try_from(attempts).unwrap_or(u32::MAX) >= max_attempts;
                    let delay = retry_delay(attempts, accrual.backoff, accrual.backoff_max);
                    ledger::retry_failed(
                        &mut tx,
                        p.loan_id,
                        p.accrual_date,
                        &e.to_string(),
                        millis(delay),
                        dead,
                    )
                    .await?;
                    tx.commit().await?;
                    if dead {
                        result.dead += 1;
                        tracing::error!(
                            loan_id = p.loan_id,
                            accrual_date = %p.accrual_date,
                            attempts,
                            error = %e,
                            "pending charge is DEAD after its last attempt; an operator must look at it"
                        );
                    } else {
                        result.retried += 1;
                    }
                }
                Err(e) => return Err(e),
            }
        }
        // A batch without progress is held by other replicas: leave it to them.
        if !due_only || !progressed {
            break;
        }
    }
    Ok(result)
}

/// The accrual days due on local date `today`: yesterday and the `n - 1` days before it, oldest first.
pub fn due_days(today: NaiveDate, n: u32) -> Vec<NaiveDate> {
    (1..=i64::from(n))
        .rev()
        .filter_map(|back| today.checked_sub_signed(chrono::Duration::days(back)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_double_and_are_capped() {
        let (base, max) = (Duration::from_secs(60), Duration::from_secs(3600));
        let delays: Vec<u64> = (1..=9).map(|a| retry_delay(a, base, max).as_secs()).collect();
        assert_eq!(delays, vec![60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]);
        assert_eq!(retry_delay(i32::MAX, base, max), max);
        assert_eq!(retry_delay(0, base, max), base);
    }

    #[test]
    fn the_last_charge_before_the_cap_is_partial() {
        let a = Accrual {
            policy: FinePolicy::new(100, 0, 250).expect("policy"),
            backoff: Duration::from_secs(1),
            backoff_max: Duration::from_secs(1),
            row_timeout: Duration::from_secs(1),
        };
        assert_eq!(
            (a.amount(0), a.amount(200), a.amount(250), a.amount(900)),
            (100, 50, 0, 0)
        );
    }

    #[test]
    fn due_days_are_yesterday_and_before() {
        let d = |s: &str| s.parse::<NaiveDate>().expect("date");
        assert_eq!(
            due_days(d("2027-01-01"), 3),
            vec![d("2026-12-29"), d("2026-12-30"), d("2026-12-31")]
        );
    }
}
