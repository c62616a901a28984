//! The accrual's writes for Citus (`src/store/citus/ledger.rs`) and its re-check for Citus
//! (`src/store/citus/recheck.rs`) compute what PostgreSQL's statements compute. Both are plain SQL, so both run
//! here, on PostgreSQL, against the same ledger: every batch write of a day — corrections, charges, the relief of
//! a loan at its cap, the queue — and every re-check write the same rows and return the same answers on either
//! engine's statements.

use std::time::Duration;

use chrono::NaiveDate;
use fine_settler::{
    config::Engine,
    jobs::{JobName, RunKey},
    shard::ShardSpec,
    store::{
        corrections::{self, Recheck},
        ledger::{self, Clamp},
        ledger_writes::LedgerWrites,
        Db,
    },
};
use sqlx::{PgPool, Postgres, Transaction};

use crate::helpers::{d, db, insert, loan, set_policy};

/// A ledger that needs every kind of write: loans due on different days, some returned, one deleted, one moved
/// earlier after its charges (its days over-charged and its day under the cap held back), charges and corrections
/// that no longer match what is owed, and a queued charge.
async fn fixture(pool: &PgPool) {
    set_policy(
        pool,
        fine_settler::fine::FinePolicy::new(100, 1, 500).expect("policy"),
    )
    .await;
    let mut loans = Vec::new();
    for id in 1..=40_i64 {
        let due = format!("2026-10-{:02}", 1 + id % 9);
        let returned = match id % 5 {
            0 => Some("2026-10-08".to_string()),
            1 => Some("2026-10-14".to_string()),
            _ => None,
        };
        loans.push(loan(id, &due, returned.as_deref()));
    }
    insert(pool, &loans).await;
    // Charges of earlier days as the loans were (some no longer owed, some over the amount), and corrections.
    sqlx::raw_sql(
        "insert into fine_ledger (loan_id, accrual_date, amount_cents)
         select l.id, g::date, case when l.id % 7 = 0 then 150 else 100 end
         from loans l, generate_series('2026-10-03'::date, '2026-10-11', interval '1 day') g
         where l.due_on + 1 < g::date and l.id % 3 <> 0;
         insert into fine_ledger_corrections (loan_id, accrual_date, seq, amount_cents, reason, job_name,
                                              business_date, shards, shard, epoch)
         select loan_id, accrual_date, 1, -50, 'cap', 'overdue-accrual', accrual_date, 1, 0, 1
         from fine_ledger where loan_id % 11 = 0;
         update loans set due_on = due_on - 4 where id in (8, 16, 17);
         delete from loans where id = 40;
         insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (4, '2026-10-12', 100, 1, 'test', now());",
    )
    .execute(pool)
    .await
    .expect("the ledger");
}

/// Everything the writes can change, in order, without the times they were written.
async fn state(tx: &mut Transaction<'_, Postgres>) -> String {
    let rows: Vec<(String,)> = sqlx::query_as(
        "select format('L %s %s %s', loan_id, accrual_date, amount_cents) from fine_ledger
         union all
         select format('C %s %s %s %s %s', loan_id, accrual_date, seq, amount_cents, reason)
         from fine_ledger_corrections
         union all
         select format('P %s %s %s %s', loan_id, accrual_date, amount_cents, status) from fine_pending
         union all
         select format('Q %s %s', loan_id, cleared_at is null) from fine_loan_changes
         order by 1",
    )
    .fetch_all(&mut **tx)
    .await
    .expect("the state");
    rows.into_iter().map(|(r,)| r).collect::<Vec<_>>().join("\n")
}

fn accrual_key(day: NaiveDate) -> RunKey {
    RunKey {
        job: JobName::OverdueAccrual,
        business_date: day,
        shard: ShardSpec::SINGLE,
    }
}

/// A batch's writes of `day` for every loan, as [`fine_settler::jobs::accrual::Accrual`] does them (held loans
/// relieved, then corrected and charged again under the cut), and the queue's and the re-check's writes; what
/// each returned, and the state after, rolled back.
async fn writes(pool: &PgPool, writes: LedgerWrites, day: NaiveDate) -> (String, String, bool) {
    let mut tx = pool.begin().await.expect("begin");
    let ids: Vec<i64> = (1..=41).collect();
    let key = accrual_key(day);
    ledger::lock_loans(&mut tx, &ids).await.expect("lock");
    let (corrected, held) = writes
        .correct(&mut tx, &key, 1, &ids, Clamp::Hold)
        .await
        .expect("correct");
    let charged = writes
        .charge(&mut tx, day, &ids, Clamp::Hold)
        .await
        .expect("charge");
    let mut all_held = held.clone();
    all_held.extend(charged.held.clone());
    all_held.sort_unstable();
    let relieved = writes
        .relieve(&mut tx, &key, 1, &all_held)
        .await
        .expect("relieve");
    let (again, _) = writes
        .correct(&mut tx, &key, 1, &all_held, Clamp::Cut)
        .await
        .expect("correct again");
    let cut = writes
        .charge(&mut tx, day, &all_held, Clamp::Cut)
        .await
        .expect("charge again");
    writes
        .enqueue(&mut tx, &[2, 3, 5, 40, 41], day, "left out", 1000)
        .await
        .expect("enqueue");
    // (Loans that exist: for a deleted loan the Citus form queues nothing, its deletion queued it already.)
    writes.note_changes(&mut tx, &[1, 2, 3]).await.expect("note");
    let answers = format!("{corrected:?} {held:?} {charged:?} {relieved:?} {again:?} {cut:?}");
    let after = state(&mut tx).await;
    tx.rollback().await.expect("rollback");
    (answers, after, !all_held.is_empty())
}

#[sqlx::test(fixtures("default_policy"))]
async fn the_citus_accrual_writes_write_what_the_postgresql_ones_write(pool: PgPool) {
    fixture(&pool).await;
    let mut any_held = false;
    for day in [
        "2026-10-05",
        "2026-10-09",
        "2026-10-12",
        "2026-10-13",
        "2026-10-16",
    ] {
        let day = d(day);
        let postgresql = writes(&pool, LedgerWrites::new(Engine::Postgresql), day).await;
        let citus = writes(&pool, LedgerWrites::new(Engine::Citus), day).await;
        assert_eq!(postgresql, citus, "the writes of {day}");
        any_held |= postgresql.2;
    }
    assert!(any_held, "the fixture exercises the cap");
}

/// One re-check on `db` with `engine`'s statements.
async fn recheck(db: &Db, engine: Engine, first: NaiveDate, last: NaiveDate) -> Recheck {
    match engine {
        Engine::Postgresql => {
            corrections::recheck(db, ShardSpec::SINGLE, first, last, 500, true, Duration::ZERO).await
        }
        Engine::Citus => {
            fine_settler::store::citus::recheck::recheck(
                db,
                ShardSpec::SINGLE,
                first,
                last,
                500,
                true,
                Duration::ZERO,
            )
            .await
        }
    }
    .expect("recheck")
}

#[sqlx::test(fixtures("default_policy"))]
async fn the_citus_recheck_finds_and_clears_what_the_postgresql_one_does(pool: PgPool) {
    fixture(&pool).await;
    // Loan 50 owes 100 cents on each of its first five days (the cap); all are charged but the 5th, whose
    // charge is queued: it has no work of its own.
    insert(&pool, &[loan(50, "2026-10-01", None)]).await;
    sqlx::raw_sql(
        "insert into fine_loan_changes (loan_id) select id from loans where id % 4 = 0;
         insert into fine_loan_changes (loan_id) values (40);
         insert into fine_ledger (loan_id, accrual_date, amount_cents)
         select 50, g::date, 100 from generate_series('2026-10-03'::date, '2026-10-07', interval '1 day') g
         where g::date <> '2026-10-05';
         insert into fine_pending (loan_id, accrual_date, amount_cents, attempts, last_error, next_attempt_at)
         values (50, '2026-10-05', 100, 1, 'test', now());",
    )
    .execute(&pool)
    .await
    .expect("changes");
    // Each engine's re-check runs on a copy of the same database: the changes it clears are committed.
    let template: String = sqlx::query_scalar("select current_database()")
        .fetch_one(&pool)
        .await
        .expect("the database");
    let url = crate::helpers::database_url(&pool);
    let (server, _) = url.rsplit_once('/').expect("a database path");
    let admin = sqlx::PgPool::connect(&format!("{server}/postgres"))
        .await
        .expect("admin");
    pool.close().await;
    let mut found = Vec::new();
    for (engine, name) in [(Engine::Postgresql, "pg"), (Engine::Citus, "citus")] {
        // (Names are cut at 63 bytes: the test database's own name is nearly that long.)
        let copy = format!(
            "engines_{name}_{}",
            &template[template.len().saturating_sub(16)..]
        );
        sqlx::query(&format!(r#"create database "{copy}" template "{template}""#))
            .execute(&admin)
            .await
            .expect("copy");
        let pool = sqlx::PgPool::connect(&format!("{server}/{copy}"))
            .await
            .expect("connect");
        let on = db(&pool);
        // Twice: the first marks the changes found owed, the second (no wait) clears them.
        let first = recheck(&on, engine, d("2026-10-05"), d("2026-10-14")).await;
        let second = recheck(&on, engine, d("2026-10-05"), d("2026-10-14")).await;
        let mut tx = pool.begin().await.expect("begin");
        let after = state(&mut tx).await;
        tx.rollback().await.expect("rollback");
        pool.close().await;
        sqlx::query(&format!(r#"drop database "{copy}""#))
            .execute(&admin)
            .await
            .expect("drop the copy");
        found.push((format!("{first:?}"), format!("{second:?}"), after));
    }
    assert_eq!(found[0], found[1]);
    assert!(
        !found[0].2.contains("Q 50 "),
        "loan 50, whose only owed day is queued, is found with nothing to do and its change cleared: {}",
        found[0].2
    );
    assert!(
        found[0].0.contains("days: [2026"),
        "the fixture has days to re-open: {}",
        found[0].0
    );
}
