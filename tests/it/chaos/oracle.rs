//! What the database must look like at the end: the invariants, checked by the oracle's SQL, and the figures the
//! run reports.

use std::collections::BTreeMap;

use chrono::NaiveDate;
use sqlx::PgPool;

use super::{faults::Zombie, scalar, CAP, RATE};

/// The oracle's SQL, from the loans alone and the rule as docs/how-it-works.md states it (not the daemon's code): the due
/// months settle, each overdue day of the accrual window `first..=last` is charged, the cap bounds both.
pub struct Oracle {
    /// The due months' last days, as an SQL list.
    months: String,
    first: NaiveDate,
    last: NaiveDate,
}

impl Oracle {
    pub fn new(months: &[NaiveDate], first: NaiveDate, last: NaiveDate) -> Oracle {
        Oracle {
            months: months
                .iter()
                .map(|m| format!("'{m}'"))
                .collect::<Vec<_>>()
                .join(","),
            first,
            last,
        }
    }

    /// Whether the date `column` falls in a due month.
    fn in_due_month(&self, column: &str) -> String {
        format!(
            "(date_trunc('month', {column}) + interval '1 month' - interval '1 day')::date in ({})",
            self.months
        )
    }

    /// `(loan_id, accrual_date)`: every day of the window on which the loan is overdue, before any cap.
    fn overdue_days(&self) -> String {
        format!(
            "select l.id as loan_id, d::date as accrual_date
             from loans l, generate_series(date '{}', date '{}', interval '1 day') d
             where l.due_on < d::date and (l.returned_on is null or d::date <= l.returned_on)",
            self.first, self.last
        )
    }

    /// `(loan_id, days, total)`: per loan, its overdue days and what they owe under the cap.
    fn totals(&self) -> String {
        format!(
            "select loan_id, count(*) as days, least({CAP}, {RATE} * count(*))::bigint as total
             from ({}) o group by loan_id",
            self.overdue_days()
        )
    }

    /// `(loan_id, accrual_date, amount_cents)`: the ledger when each loan's days are charged in date order — the
    /// full rate each overdue day until the cap, the day that reaches it what is left under it, nothing after.
    /// `before` is what the loan's earlier days were charged.
    fn in_order_ledger(&self) -> String {
        format!(
            "select loan_id, accrual_date, least({RATE}, {CAP} - before)::bigint as amount_cents
             from (select loan_id, accrual_date,
                          coalesce(sum({RATE}) over (partition by loan_id order by accrual_date
                                                     rows between unbounded preceding and 1 preceding), 0)
                              as before
                   from ({}) o) x
             where before < {CAP}",
            self.overdue_days()
        )
    }

    /// Late loans the daemon has not caught up with — returned in a due month but unsettled, or charged other
    /// than their total: `(kind, id, due_on, returned_on, settled, charged, owed)`.
    fn late_outstanding(&self) -> String {
        format!(
            "select k.kind, l.id, l.due_on, l.returned_on, l.fine_settled_at is not null as settled,
                    coalesce(f.total, 0) as charged, coalesce(o.total, 0) as owed
             from late_loans k join loans l using (id)
             left join (select loan_id, sum(amount_cents) as total from fine_ledger
                        where loan_id in (select id from late_loans) group by 1) f on f.loan_id = k.id
             left join ({}) o on o.loan_id = k.id
             where (l.fine_settled_at is null and {})
                or coalesce(f.total, 0) <> coalesce(o.total, 0)",
            self.totals(),
            self.in_due_month("l.returned_on")
        )
    }

    /// How many late loans the daemon has not caught up with ([`Oracle::late_outstanding`]); i64::MAX while the
    /// database does not answer.
    pub async fn late_left(&self, pool: &PgPool) -> i64 {
        sqlx::query_scalar(&format!("select count(*) from ({}) x", self.late_outstanding()))
            .fetch_one(pool)
            .await
            .unwrap_or(i64::MAX)
    }

    /// The late loans still outstanding, one line each, with the days charged: for the failure report.
    pub async fn late_report(&self, pool: &PgPool) -> Vec<String> {
        sqlx::query_scalar(&format!(
            "select format('%s loan %s due %s returned %s: settled %s, charged %s of %s (%s)', kind, id, due_on,
                           coalesce(returned_on::text, 'no'), settled, charged, owed,
                           (select string_agg(f.accrual_date || ': ' || f.amount_cents, ', ' order by f.accrual_date)
                            from fine_ledger f where f.loan_id = x.id))
             from ({}) x order by id",
            self.late_outstanding()
        ))
        .fetch_all(pool)
        .await
        .unwrap_or_default()
    }
}

/// The ledger invariants, for every loan except `skip` where a loan's total is compared.
///
/// Whichever order the days are charged in, the cap must hold: no loan's ledger ever sums past it (checked on
/// its own, it is the point). Beyond that the per-day split depends on the order in which each loan's days were
/// charged, which the rule does not fix: every day is its own key, and a later day can be charged first — a
/// manual `accrue` of a later day, a peer running the next day while the key of the day before waits for a
/// takeover, a compensated charge of an earlier day (a DEAD day retried after later days were charged gets only
/// what is left under the cap). The split then differs from the in-order oracle while the total does not. So
/// the ledger is compared per loan total, day by day for the loans the cap never truncates, and for the others
/// through what holds in any order: charges only on overdue days, none above the rate, at most one partial
/// charge (the one that reached the cap).
async fn ledger_checks(pool: &PgPool, oracle: &Oracle, skip: &[i64]) -> Vec<(&'static str, i64)> {
    let skip = format!(
        "'{{{}}}'::bigint[]",
        skip.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
    );
    let (overdue, totals) = (oracle.overdue_days(), oracle.totals());
    vec![
        (
            "loan charged more than the cap in total",
            scalar(
                pool,
                &format!(
                    "select count(*) from (select loan_id from fine_ledger group by 1
                                           having sum(amount_cents) > {CAP}) x"
                ),
            )
            .await,
        ),
        (
            "ledger row for a day its loan was not overdue (or outside the window)",
            scalar(
                pool,
                &format!(
                    "select count(*) from fine_ledger f where not exists (
                         select 1 from ({overdue}) o where o.loan_id = f.loan_id and o.accrual_date = f.accrual_date)"
                ),
            )
            .await,
        ),
        (
            "ledger row above the daily rate, or a second partial row of a loan",
            scalar(
                pool,
                &format!(
                    "select count(*) from (select loan_id from fine_ledger group by 1
                                           having max(amount_cents) > {RATE}
                                              or count(*) filter (where amount_cents < {RATE}) > 1) x"
                ),
            )
            .await,
        ),
        (
            "loan whose ledger total differs from the oracle's",
            scalar(
                pool,
                &format!(
                    "select count(*) from (select loan_id, sum(amount_cents) as total from fine_ledger group by 1) f
                     full join ({totals}) o using (loan_id)
                     where coalesce(f.total, 0) <> coalesce(o.total, 0) and loan_id <> all({skip})"
                ),
            )
            .await,
        ),
        (
            "overdue day of a loan under the cap not charged the full rate",
            scalar(
                pool,
                &format!(
                    "with uncapped as (select loan_id from ({totals}) o
                                       where days * {RATE} <= {CAP} and loan_id <> all({skip})),
                          want as (select loan_id, accrual_date, {RATE}::bigint as amount_cents from ({overdue}) o
                                   where loan_id in (select loan_id from uncapped)),
                          have as (select loan_id, accrual_date, amount_cents from fine_ledger
                                   where loan_id in (select loan_id from uncapped))
                     select count(*) from ((select * from want except all select * from have)
                                           union all (select * from have except all select * from want)) x"
                ),
            )
            .await,
        ),
    ]
}

/// Loans whose ledger differs from the in-order oracle (their days were charged out of date order; see
/// [`ledger_checks`]): a figure, not a violation.
async fn charged_out_of_order(pool: &PgPool, oracle: &Oracle) -> i64 {
    let in_order = oracle.in_order_ledger();
    scalar(
        pool,
        &format!(
            "select count(distinct loan_id) from (
                 (select loan_id, accrual_date, amount_cents from fine_ledger except all ({in_order}))
                 union all (({in_order}) except all select loan_id, accrual_date, amount_cents from fine_ledger)) x"
        ),
    )
    .await
}

/// Each invariant with its number of violations (0 where it holds), and the DEAD charges the replicas left.
pub struct Verdict {
    pub violations: BTreeMap<String, i64>,
    pub dead: i64,
}

impl Verdict {
    /// The invariants on the database as the replicas left it; `late_left` is what [`Oracle::late_left`] said
    /// once the wait for the late rows ended.
    pub async fn check(pool: &PgPool, oracle: &Oracle, poisoned: &[i64], late_left: i64) -> Verdict {
        let mut violations: BTreeMap<String, i64> = BTreeMap::new();
        let mut check = |name: &str, n: i64| {
            violations.insert(name.to_string(), n);
        };
        // Every loan returned in a settled month — the late ones too — is settled with the policy's fine.
        check(
            "loan of a settled month unsettled or with the wrong fine",
            scalar(
                pool,
                &format!(
                    "select count(*) from loans
                     where {} and (fine_settled_at is null
                                   or fine_cents <> least({CAP}, greatest(0, returned_on - due_on) * {RATE}))",
                    oracle.in_due_month("returned_on")
                ),
            )
            .await,
        );
        // Loans outside the settled months are untouched.
        check(
            "loan outside the settled months touched",
            scalar(
                pool,
                &format!(
                    "select count(*) from loans l join loans_before b using (id)
                     where (l.returned_on is null or not {})
                       and (l.fine_settled_at is not null or l.fine_cents <> b.fine_cents)",
                    oracle.in_due_month("l.returned_on")
                ),
            )
            .await,
        );
        check(
            "loan updated more than once",
            scalar(pool, "select count(*) from loan_updates where n > 1").await,
        );
        // Every key of the final count is SUCCESS.
        check(
            "key of the final count not SUCCESS",
            scalar(
                pool,
                "select count(*) from job_runs where shards = 4 and status <> 'SUCCESS'",
            )
            .await,
        );
        check(
            "late loan not settled or charged within LATE_LIMIT of the last round",
            late_left,
        );
        // fine_pending holds only the poisoned loans, all DEAD.
        let poisoned_sql = poisoned.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        check(
            "pending charge of a loan the test did not poison, or not DEAD",
            scalar(
                pool,
                &format!(
                    "select count(*) from fine_pending where loan_id not in ({poisoned_sql}) or status <> 'DEAD'"
                ),
            )
            .await,
        );
        let dead = scalar(pool, "select count(*) from fine_pending").await;
        // The poisoned loans' ledger stays empty, so the cap never stops their charges: every overdue day of the
        // window waits, DEAD, in fine_pending.
        check(
            "overdue day of a poisoned loan not DEAD in fine_pending",
            scalar(
                pool,
                &format!(
                    "select count(*) from ({}) o where o.loan_id in ({poisoned_sql})
                     and not exists (select 1 from fine_pending p where p.loan_id = o.loan_id
                                     and p.accrual_date = o.accrual_date and p.status = 'DEAD')",
                    oracle.overdue_days()
                ),
            )
            .await,
        );
        // The ledger, the poisoned loans' totals aside.
        for (name, n) in ledger_checks(pool, oracle, poisoned).await {
            check(name, n);
        }
        Verdict { violations, dead }
    }

    /// Once the operator has fixed the poisoned loans and retried the DEAD charges: nothing is pending, and the
    /// ledger is the oracle's, compared as [`ledger_checks`] says — a DEAD day compensated after a later day was
    /// charged could split a loan's total differently from the in-order oracle.
    pub async fn check_after_the_retry(&mut self, pool: &PgPool, oracle: &Oracle) {
        self.violations.insert(
            "pending after the operator's retry".to_string(),
            scalar(pool, "select count(*) from fine_pending").await,
        );
        for (name, n) in ledger_checks(pool, oracle, &[]).await {
            self.violations.insert(format!("after the retry: {name}"), n);
        }
    }

    /// The invariants violated.
    pub fn broken(&self) -> Vec<(&String, &i64)> {
        self.violations.iter().filter(|(_, n)| **n != 0).collect()
    }
}

/// Each zombie found its key taken over, committed nothing after that, and recorded the lost lease.
pub async fn assert_zombies_recorded_lost_leases(pool: &PgPool, zombies: &[Zombie]) {
    for Zombie { owner, date, job } in zombies {
        let lost = scalar(
            pool,
            &format!(
                "select count(*) from job_run_attempts where owner = '{owner}' and event = 'lease_lost'
                   and job_name = '{job}' and business_date = '{date}'"
            ),
        )
        .await;
        assert!(
            lost >= 1,
            "zombie {owner} ({job} {date}) did not report a lost lease"
        );
    }
}

/// What the run did to the database, for its report.
pub struct Figures {
    pub settled: i64,
    pub settled_at_cap: i64,
    pub ledger: i64,
    pub ledger_loans: i64,
    pub charged_to_cap: i64,
    pub out_of_order: i64,
    pub checked: i64,
    pub keys: i64,
    pub takeovers: i64,
    pub lost: i64,
    /// Keys re-opened, by job.
    pub reopened: Vec<(String, i64)>,
}

impl Figures {
    pub async fn read(pool: &PgPool, oracle: &Oracle) -> Figures {
        let settled = scalar(
            pool,
            "select count(*) from loans where fine_settled_at is not null",
        )
        .await;
        let settled_at_cap = scalar(
            pool,
            &format!("select count(*) from loans where fine_settled_at is not null and fine_cents = {CAP}"),
        )
        .await;
        let ledger = scalar(pool, "select count(*) from fine_ledger").await;
        let ledger_loans = scalar(pool, "select count(distinct loan_id) from fine_ledger").await;
        let charged_to_cap = scalar(
            pool,
            &format!(
                "select count(*) from (select loan_id from fine_ledger group by 1 having sum(amount_cents) = {CAP}) x"
            ),
        )
        .await;
        let out_of_order = charged_out_of_order(pool, oracle).await;
        let checked = scalar(pool, "select count(*) from loans").await;
        let keys = scalar(pool, "select count(*) from job_runs").await;
        let takeovers = scalar(
            pool,
            "select count(*) from job_run_attempts where event = 'takeover'",
        )
        .await;
        let lost = scalar(
            pool,
            "select count(*) from job_run_attempts where event = 'lease_lost'",
        )
        .await;
        let reopened: Vec<(String, i64)> = sqlx::query_as(
            "select job_name, count(*) from job_run_attempts where event = 'reopened' group by 1 order by 1",
        )
        .fetch_all(pool)
        .await
        .expect("re-opens");
        Figures {
            settled,
            settled_at_cap,
            ledger,
            ledger_loans,
            charged_to_cap,
            out_of_order,
            checked,
            keys,
            takeovers,
            lost,
            reopened,
        }
    }
}
