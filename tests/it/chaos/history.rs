//! The ledger's history as the test saw it. The ledger is append-only — a first charge in `fine_ledger`, then
//! numbered corrections in `fine_ledger_corrections` — and the cap holds in every committed state, so every
//! snapshot taken while the replicas run (every progress report, before and after each round of libraryd's
//! changes, at the end) must find each row an earlier one saw still there and unchanged, and no loan's net above
//! the cap. Each snapshot is one statement, so it reads one committed state.

use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::PgPool;

use super::{scalar, CAP};

/// The snapshots taken, and the tables they fill: `ledger_seen` (every row seen, a first charge as `seq` 0),
/// `ledger_changed` (rows seen once and later missing or different) and `net_over_cap` (loans whose net a
/// snapshot found above the cap).
#[derive(Debug, Default)]
pub struct History {
    taken: AtomicU64,
    failed: AtomicU64,
}

impl History {
    /// Creates the tables.
    pub async fn install(pool: &PgPool) -> History {
        sqlx::raw_sql(
            "create table ledger_seen (
                 loan_id bigint not null,
                 accrual_date date not null,
                 seq int not null,
                 amount_cents bigint not null,
                 at timestamptz not null,
                 reason text not null,
                 primary key (loan_id, accrual_date, seq)
             );
             create table ledger_changed (
                 loan_id bigint not null,
                 accrual_date date not null,
                 seq int not null,
                 primary key (loan_id, accrual_date, seq)
             );
             create table net_over_cap (loan_id bigint primary key, net_cents bigint not null);",
        )
        .execute(pool)
        .await
        .expect("ledger history tables");
        History::default()
    }

    /// Takes a snapshot: records the rows seen before that are gone or changed, and the loans above the cap,
    /// then remembers the new rows. A snapshot the database cannot answer (it is being restarted) is skipped and
    /// counted.
    pub async fn snapshot(&self, pool: &PgPool) {
        let taken = sqlx::raw_sql(&format!(
            "with now_rows as (
                 select loan_id, accrual_date, 0 as seq, amount_cents, charged_at as at, '' as reason
                 from fine_ledger
                 union all
                 select loan_id, accrual_date, seq, amount_cents, corrected_at, reason from fine_ledger_corrections
             ), changed as (
                 insert into ledger_changed
                 select s.loan_id, s.accrual_date, s.seq from ledger_seen s
                 where not exists (select 1 from now_rows n
                                   where n.loan_id = s.loan_id and n.accrual_date = s.accrual_date
                                     and n.seq = s.seq and n.amount_cents = s.amount_cents and n.at = s.at
                                     and n.reason = s.reason)
                 on conflict do nothing
             ), over_cap as (
                 insert into net_over_cap
                 select loan_id, sum(amount_cents) from now_rows group by 1 having sum(amount_cents) > {CAP}
                 on conflict do nothing
             )
             insert into ledger_seen select * from now_rows on conflict do nothing"
        ))
        .execute(pool)
        .await;
        match taken {
            Ok(_) => self.taken.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.failed.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// (snapshots taken, snapshots skipped).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.taken.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }

    /// The invariants: rows a snapshot saw that a later one found changed or gone, and loans whose net a
    /// snapshot found above the cap (both 0). Takes a last snapshot first.
    pub async fn violations(&self, pool: &PgPool) -> [(&'static str, i64); 2] {
        self.snapshot(pool).await;
        [
            (
                "ledger or correction row changed or gone after a snapshot saw it",
                scalar(pool, "select count(*) from ledger_changed").await,
            ),
            (
                "loan whose net a snapshot found above the cap",
                scalar(pool, "select count(*) from net_over_cap").await,
            ),
        ]
    }

    /// Ledger and correction rows the snapshots followed.
    pub async fn rows_seen(pool: &PgPool) -> i64 {
        scalar(pool, "select count(*) from ledger_seen").await
    }
}
