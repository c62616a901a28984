//! The accrual's writes for Citus (`src/store/citus/ledger.rs`), its re-check for Citus
//! (`src/store/citus/recheck.rs`) and `verify`'s audit for Citus (`src/store/citus/audit.rs`) compute what
//! PostgreSQL's statements compute. Both are plain SQL, so both run here, on PostgreSQL, against the same ledger:
//! every batch write of a day — corrections, charges, the relief of a loan at its cap, the queue — and every
//! re-check write the same rows and return the same answers on either engine's statements, and the audit of a
//! month finds the same on either.

use std::time::Duration;

use chrono::{Datelike, NaiveDate};
use fine_settler::{
    config::Engine,
    jobs::{JobName, RunKey},
    shard::ShardSpec,
    store::{
        audit::Audit,
        corrections::{self, Recheck},
        ledger::{self, Clamp},
        ledger_writes::LedgerWrites,
        Db,
    },
};
use sqlx::{PgPool, Postgres, Transaction};

use crate::helpers::{add_versions, d, db, insert, loan, set_policy};

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

/// Months for the audit to find everything in: loans of several classes (one misspelt, one due before its class's
/// first version) under versions with and without grace, cap and closed days charged; returns before the due
/// date, within the grace period and after it; due dates that are not finite or at the ends of the calendar;
/// fines settled by the rule, changed by hand and never settled; ledgers charged by the rule day by day, then
/// over-charged, corrected and left short; accrual keys SUCCESS under one shard count, FAILED, or SUCCESS for one
/// shard of two only.
async fn audit_fixture(pool: &PgPool) {
    set_policy(
        pool,
        fine_settler::fine::FinePolicy::new(100, 1, 500).expect("policy"),
    )
    .await;
    add_versions(
        pool,
        "insert into fine_policies (fine_class, effective_from, daily_rate_cents, grace_days, cap_cents,
                                    charge_closed_days, reason) values
           ('adult', '2026-01-01', 50, 0, 0, true, 'test'),
           ('adult', '2026-10-15', 70, 2, 300, false, 'test'),
           ('child', '2026-10-10', 20, 3, 0, false, 'test')",
    )
    .await;
    sqlx::raw_sql(
        "insert into library_closed_days (day, reason) values
           ('2026-09-28', 'test'), ('2026-10-05', 'test'), ('2026-10-12', 'test'), ('2026-10-25', 'test');
         insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on, fine_class)
         select g, 1, 1, '2026-08-01', date '2026-09-22' + g % 31,
                case when g % 6 <> 0 then date '2026-09-22' + g % 31 + g % 17 - 3 end,
                (array[null, 'adult', 'child', 'adlut', null])[1 + g % 5]
         from generate_series(1, 120) g;
         insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on, fine_class) values
           (201, 1, 1, '2026-08-01', '-infinity', '2026-10-05', null),
           (202, 1, 1, '2026-08-01', 'infinity', '2026-10-06', 'adult'),
           (203, 1, 1, '2026-08-01', '-infinity', '2026-10-07', null),
           (204, 1, 1, '2026-08-01', '2026-09-20', 'infinity', null),
           (205, 1, 1, '2026-08-01', '-infinity', null, null),
           (206, 1, 1, '2026-08-01', '5874897-12-31', '2026-10-08', null),
           (207, 1, 1, '4713-01-01 BC', '4713-01-01 BC', '2026-10-09', 'child'),
           (208, 1, 1, '2026-08-01', '2026-10-01', '2026-10-10', 'child');
         -- Settled by the rule, but for one in eight; some changed by hand; one not finite settled.
         update loans set fine_cents = fine_settler_loan_fine(fine_class, due_on, returned_on) + (id % 10 = 3)::int,
                          fine_settled_at = now()
         where returned_on is not null and isfinite(returned_on) and isfinite(due_on) and id % 8 <> 0;
         update loans set fine_settled_at = now() where id = 203;
         -- Charged by the rule, day by day, up to the end of October (or the return).
         insert into fine_ledger (loan_id, accrual_date, amount_cents)
         select l.id, g::date, fine_settler_loan_day_amount(l.fine_class, l.due_on, l.returned_on, g::date)
         from loans l, generate_series('2026-09-20'::date, '2026-10-31', interval '1 day') g
         where isfinite(l.due_on) and l.due_on > '2026-01-01' and l.due_on < '2027-01-01'
           and fine_settler_loan_day_amount(l.fine_class, l.due_on, l.returned_on, g::date) > 0
           and l.id % 11 <> 5;
         -- Over-charged: a day after a return, a day charged twice its amount (and one of those corrected back).
         insert into fine_ledger (loan_id, accrual_date, amount_cents)
         select id, returned_on + 1, 100 from loans
         where id % 7 = 1 and returned_on between '2026-09-01' and '2026-10-30' and isfinite(due_on)
         on conflict do nothing;
         insert into fine_ledger_corrections (loan_id, accrual_date, seq, amount_cents, reason, job_name,
                                              business_date, shards, shard, epoch)
         select loan_id, accrual_date, 1, amount_cents, 'canonical', 'overdue-accrual', accrual_date, 1, 0, 1
         from fine_ledger where loan_id % 9 = 2 and accrual_date = '2026-10-20';
         insert into fine_ledger_corrections (loan_id, accrual_date, seq, amount_cents, reason, job_name,
                                              business_date, shards, shard, epoch)
         select loan_id, accrual_date, 1, -amount_cents, 'returned', 'overdue-accrual', accrual_date, 1, 0, 1
         from fine_ledger where loan_id % 9 = 4 and accrual_date = '2026-10-18';
         -- A day with a correction and no charge (written by hand: the accrual corrects charged days only).
         insert into fine_ledger_corrections (loan_id, accrual_date, seq, amount_cents, reason, job_name,
                                              business_date, shards, shard, epoch)
         select id, returned_on + 2, 1, 40, 'reinstated', 'overdue-accrual', returned_on + 2, 1, 0, 1
         from loans
         where id % 13 = 6 and returned_on between '2026-09-01' and '2026-10-28' and isfinite(due_on);
         -- The months settled; the days accrued by one shard count, but for one day FAILED, and one day
         -- accrued by shard 0 of 2 only.
         insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch, lease_until)
         values ('fine-settlement', '2026-09-30', 1, 0, 'SUCCESS', 'test', 1, now()),
                ('fine-settlement', '2026-10-31', 2, 0, 'SUCCESS', 'test', 1, now()),
                ('fine-settlement', '2026-10-31', 2, 1, 'SUCCESS', 'test', 1, now()),
                ('fine-settlement', '2026-10-31', 3, 0, 'SUCCESS', 'test', 1, now());
         insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch, lease_until)
         select 'overdue-accrual', g::date, 1, 0,
                case when g::date in ('2026-10-14', '2026-10-22') then 'FAILED' else 'SUCCESS' end, 'test', 1, now()
         from generate_series('2026-09-01'::date, '2026-10-31', interval '1 day') g;
         insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch, lease_until)
         values ('overdue-accrual', '2026-10-22', 2, 0, 'SUCCESS', 'test', 1, now());",
    )
    .execute(pool)
    .await
    .expect("the months");
}

#[sqlx::test(fixtures("default_policy"))]
async fn the_citus_audit_finds_what_the_postgresql_one_finds(pool: PgPool) {
    audit_fixture(&pool).await;
    let on = db(&pool);
    let audit = |engine, month: &str| {
        let on = on.clone();
        let last = d(month);
        let first = last.with_day(1).expect("the month's first day");
        async move { Audit::new(engine).month(&on, (first, last)).await.expect("audit") }
    };
    let mut seen = Vec::new();
    for month in ["2026-09-30", "2026-10-31", "2026-11-30"] {
        let postgresql = audit(Engine::Postgresql, month).await;
        let citus = audit(Engine::Citus, month).await;
        assert_eq!(postgresql, citus, "the audit of {month}");
        seen.push(postgresql);
    }
    let october = &seen[1];
    for (what, n) in [
        ("returned", october.returned),
        ("unsettled", october.unsettled),
        ("wrong_fine", october.wrong_fine),
        ("ledger_checked", october.ledger_checked),
        ("ledger_mismatches", october.ledger_mismatches),
        ("over_accrued", october.over_accrued),
        ("not_finite", october.not_finite),
        ("loans_without_class_policy", october.loans_without_class_policy),
    ] {
        assert!(n > 0, "the fixture has loans for {what}: {october:?}");
    }
    assert!(
        october.ledger_checked + october.unsettled < october.returned,
        "some loans are not reconciled (a day not accrued): {october:?}"
    );

    // No policy at all (the table emptied by hand): the loans no policy governs counted alike.
    add_versions(&pool, "delete from fine_policies where fine_class <> 'adult'").await;
    let postgresql = audit(Engine::Postgresql, "2026-10-31").await;
    assert!(postgresql.without_policy > 0, "{postgresql:?}");
    assert_eq!(postgresql, audit(Engine::Citus, "2026-10-31").await);
}
