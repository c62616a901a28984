//! What the database must look like at the end: the invariants, checked by the oracle's SQL, and the figures the
//! run reports.

use std::collections::BTreeMap;

use chrono::NaiveDate;
use sqlx::PgPool;

use super::{faults::Zombie, history::History, scalar, CAP, FINAL_SHARDS, RATE};

/// The oracle's SQL, from the loans alone and the rule as docs/how-it-works.md states it (not the daemon's code):
/// the due months settle; the days of the accrual window `first..=last` hold the ledger a clean sequential run
/// leaves, by the loans' rows as they are at the end; the cap bounds both.
pub struct Oracle {
    /// The due months' last days, as an SQL list.
    months: String,
    first: NaiveDate,
    last: NaiveDate,
}

/// Loans libraryd changed after they were settled: their settlement stays as the change found it.
const SETTLED_THEN_CHANGED: &str = "select loan_id from loan_edits where settled_at is not null";

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

    /// `(loan_id, accrual_date, net_cents)`: the ledger a clean sequential run leaves for the loans `which` (an
    /// SQL condition on `l`), by their rows as they are now, on each day of the window whose accrual key of the
    /// loan's shard (final count) ended SUCCESS. A sequential run charges a loan's owed days in date order from
    /// the first day after its due date — the days before the window too — each the full rate until the cap, the
    /// day that reaches it what is left, nothing after. A day is owed when it is after the due date and not after
    /// the return; every day between the due date and an owed day is owed, so the loan's earlier days were
    /// charged `rate × (day - due_on - 1)` before the cap. A day that owes nothing has no row (as in
    /// fine_ledger_net).
    fn expected(&self, which: &str) -> String {
        format!(
            "select loan_id, accrual_date, least({RATE}, {CAP} - before)::bigint as net_cents
             from (select l.id as loan_id, k.business_date as accrual_date,
                          {RATE} * (k.business_date - l.due_on - 1)::bigint as before
                   from loans l
                   join job_runs k on k.job_name = 'overdue-accrual' and k.shards = {FINAL_SHARDS}
                                  and k.shard = ((l.id % {FINAL_SHARDS}) + {FINAL_SHARDS}) % {FINAL_SHARDS}
                                  and k.status = 'SUCCESS'
                                  and k.business_date between date '{}' and date '{}'
                   where ({which}) and l.due_on < k.business_date
                     and (l.returned_on is null or k.business_date <= l.returned_on)) x
             where before < {CAP}",
            self.first, self.last
        )
    }

    /// `(loan_id, accrual_date, want, have)`: the (loan, day) pairs of the loans `which` where the net ledger
    /// differs from [`Oracle::expected`] (0 where a side has no row).
    fn ledger_diff(&self, which: &str) -> String {
        format!(
            "select loan_id, accrual_date, coalesce(w.net_cents, 0) as want, coalesce(h.net_cents, 0) as have
             from ({}) w
             full join (select n.loan_id, n.accrual_date, n.net_cents from fine_ledger_net n
                        join loans l on l.id = n.loan_id where {which}) h using (loan_id, accrual_date)
             where w.net_cents is distinct from h.net_cents",
            self.expected(which)
        )
    }

    /// The ids of the loans libraryd wrote or changed late (`late_loans`, `loan_edits`) that the daemon has not
    /// caught up with: returned in a due month but unsettled, or a (loan, day) of the window whose net is not the
    /// sequential run's.
    fn late_outstanding(&self) -> String {
        let which = "l.id in (select id from late_loans union select loan_id from loan_edits)";
        format!(
            "select l.id from loans l where {which} and l.fine_settled_at is null and {}
             union
             select loan_id from ({}) d",
            self.in_due_month("l.returned_on"),
            self.ledger_diff(which)
        )
    }

    /// How many late or changed loans the daemon has not caught up with ([`Oracle::late_outstanding`]); i64::MAX
    /// while the database does not answer.
    pub async fn late_left(&self, pool: &PgPool) -> i64 {
        sqlx::query_scalar(&format!("select count(*) from ({}) x", self.late_outstanding()))
            .fetch_one(pool)
            .await
            .unwrap_or(i64::MAX)
    }

    /// The late or changed loans still outstanding, one line each, with what was written and changed and the days
    /// that differ (owed / net): for the failure report.
    pub async fn late_report(&self, pool: &PgPool) -> Vec<String> {
        let which = "l.id in (select id from late_loans union select loan_id from loan_edits)";
        sqlx::query_scalar(&format!(
            "select format('loan %s (%s) due %s returned %s: settled %s; days owed/net: %s', l.id,
                           concat_ws(', ', (select k.kind from late_loans k where k.id = l.id),
                                     (select string_agg(e.kind || ' at ' || e.at::time, ', ' order by e.seq)
                                      from loan_edits e where e.loan_id = l.id)),
                           l.due_on, coalesce(l.returned_on::text, 'no'), l.fine_settled_at is not null,
                           (select string_agg(d.accrual_date || ': ' || d.want || '/' || d.have, ', '
                                              order by d.accrual_date)
                            from ({}) d where d.loan_id = l.id))
             from loans l where l.id in ({}) order by l.id",
            self.ledger_diff(which),
            self.late_outstanding()
        ))
        .fetch_all(pool)
        .await
        .unwrap_or_default()
    }
}

/// The ledger invariants, every loan but `skip` compared with the sequential run day by day.
///
/// A day's amount is a function of the loan alone, so whatever order the days are charged in, and whatever
/// libraryd changed meanwhile, the net of each (loan, day) ends as a clean sequential run by the loans' final rows
/// leaves it — row for row, not only in total. The corrections behind it are numbered 1, 2, … per day without a
/// gap, each of a day that was charged; no loan's net is above the cap.
async fn ledger_checks(pool: &PgPool, oracle: &Oracle, skip: &[i64]) -> Vec<(&'static str, i64)> {
    let skip = format!(
        "'{{{}}}'::bigint[]",
        skip.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
    );
    vec![
        (
            "(loan, day) whose net differs from a clean sequential run's",
            scalar(
                pool,
                &format!(
                    "select count(*) from ({}) d",
                    oracle.ledger_diff(&format!("l.id <> all({skip})"))
                ),
            )
            .await,
        ),
        (
            "net ledger row of a loan that no longer exists",
            scalar(
                pool,
                "select count(*) from fine_ledger_net n
                 where not exists (select 1 from loans l where l.id = n.loan_id)",
            )
            .await,
        ),
        (
            "loan whose net is above the cap",
            scalar(
                pool,
                &format!(
                    "select count(*) from (select loan_id from fine_ledger_net group by 1
                                           having sum(net_cents) > {CAP}) x"
                ),
            )
            .await,
        ),
        (
            "day whose corrections are not numbered 1, 2, … without a gap",
            scalar(
                pool,
                "select count(*) from (select loan_id, accrual_date from fine_ledger_corrections group by 1, 2
                                       having min(seq) <> 1 or max(seq) <> count(*)) x",
            )
            .await,
        ),
        (
            "correction of a day never charged",
            scalar(
                pool,
                "select count(*) from fine_ledger_corrections c where not exists (
                     select 1 from fine_ledger f where f.loan_id = c.loan_id and f.accrual_date = c.accrual_date)",
            )
            .await,
        ),
    ]
}

/// Each invariant with its number of violations (0 where it holds), and the DEAD charges the replicas left.
pub struct Verdict {
    pub violations: BTreeMap<String, i64>,
    pub dead: i64,
}

impl Verdict {
    /// The invariants on the database as the replicas left it; `late_left` is what [`Oracle::late_left`] said
    /// once the wait for the late rows ended.
    pub async fn check(
        pool: &PgPool,
        oracle: &Oracle,
        history: &History,
        poisoned: &[i64],
        late_left: i64,
    ) -> Verdict {
        let mut violations: BTreeMap<String, i64> = BTreeMap::new();
        for (name, n) in settlement_checks(pool, oracle).await {
            violations.insert(name.to_string(), n);
        }
        violations.insert(
            "key of the final count not SUCCESS".to_string(),
            scalar(
                pool,
                &format!(
                    "select count(*) from job_runs where shards = {FINAL_SHARDS} and status <> 'SUCCESS'"
                ),
            )
            .await,
        );
        violations.insert(
            "late or changed loan not settled or charged within LATE_LIMIT of the last round".to_string(),
            late_left,
        );
        for (name, n) in poisoned_checks(pool, oracle, poisoned).await {
            violations.insert(name.to_string(), n);
        }
        let dead = scalar(pool, "select count(*) from fine_pending").await;
        // The ledger, the poisoned loans aside (their days wait in fine_pending), and its history.
        for (name, n) in ledger_checks(pool, oracle, poisoned).await {
            violations.insert(name.to_string(), n);
        }
        for (name, n) in history.violations(pool).await {
            violations.insert(name.to_string(), n);
        }
        Verdict { violations, dead }
    }

    /// Once the operator has fixed the poisoned loans and retried the DEAD charges: nothing is pending, and the
    /// ledger of every loan — the poisoned ones too — is the sequential run's, day by day.
    pub async fn check_after_the_retry(&mut self, pool: &PgPool, oracle: &Oracle, history: &History) {
        self.violations.insert(
            "pending after the operator's retry".to_string(),
            scalar(pool, "select count(*) from fine_pending").await,
        );
        for (name, n) in ledger_checks(pool, oracle, &[]).await {
            self.violations.insert(format!("after the retry: {name}"), n);
        }
        for (name, n) in history.violations(pool).await {
            self.violations.insert(format!("after the retry: {name}"), n);
        }
    }

    /// The invariants violated.
    pub fn broken(&self) -> Vec<(&String, &i64)> {
        self.violations.iter().filter(|(_, n)| **n != 0).collect()
    }
}

/// Settlement: every loan returned in a settled month — the late ones too — is settled with the policy's fine by
/// its final row, no other loan changed, no loan row updated twice by the daemon. A loan libraryd changed after
/// it was settled keeps its settlement as the change found it (a settled row is never changed again).
async fn settlement_checks(pool: &PgPool, oracle: &Oracle) -> Vec<(&'static str, i64)> {
    vec![
        (
            "loan of a settled month unsettled or with the wrong fine",
            scalar(
                pool,
                &format!(
                    "select count(*) from loans
                     where {} and id not in ({SETTLED_THEN_CHANGED})
                       and (fine_settled_at is null
                            or fine_cents <> least({CAP}, greatest(0, returned_on - due_on) * {RATE}))",
                    oracle.in_due_month("returned_on")
                ),
            )
            .await,
        ),
        (
            "loan outside the settled months touched",
            scalar(
                pool,
                &format!(
                    "select count(*) from loans l join loans_before b using (id)
                     where (l.returned_on is null or not {}) and l.id not in ({SETTLED_THEN_CHANGED})
                       and (l.fine_settled_at is not null or l.fine_cents <> b.fine_cents)",
                    oracle.in_due_month("l.returned_on")
                ),
            )
            .await,
        ),
        (
            "settled loan libraryd changed whose settlement changed",
            scalar(
                pool,
                "select count(*) from loan_edits e join loans l on l.id = e.loan_id
                 where e.settled_at is not null
                   and (l.fine_settled_at is distinct from e.settled_at or l.fine_cents <> e.fine_cents)",
            )
            .await,
        ),
        (
            "loan updated more than once",
            scalar(pool, "select count(*) from loan_updates where n > 1").await,
        ),
    ]
}

/// fine_pending holds only the poisoned loans, all DEAD; their ledger stays empty, so every day they owe waits,
/// DEAD, in fine_pending.
async fn poisoned_checks(pool: &PgPool, oracle: &Oracle, poisoned: &[i64]) -> Vec<(&'static str, i64)> {
    let poisoned_sql = poisoned.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    vec![
        (
            "pending charge of a loan the test did not poison, or not DEAD",
            scalar(
                pool,
                &format!(
                    "select count(*) from fine_pending where loan_id not in ({poisoned_sql}) or status <> 'DEAD'"
                ),
            )
            .await,
        ),
        (
            "owed day of a poisoned loan not DEAD in fine_pending",
            scalar(
                pool,
                &format!(
                    "select count(*) from ({}) o
                     where not exists (select 1 from fine_pending p where p.loan_id = o.loan_id
                                       and p.accrual_date = o.accrual_date and p.status = 'DEAD')",
                    oracle.expected(&format!("l.id in ({poisoned_sql})"))
                ),
            )
            .await,
        ),
    ]
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
    /// First charges (fine_ledger rows).
    pub ledger: i64,
    /// (loan, day) pairs of the net ledger, compared with the sequential run.
    pub net: i64,
    pub ledger_loans: i64,
    pub charged_to_cap: i64,
    /// Corrections, by reason.
    pub corrections: Vec<(String, i64)>,
    /// Ledger and correction rows the snapshots followed.
    pub seen: i64,
    pub checked: i64,
    pub keys: i64,
    pub takeovers: i64,
    pub lost: i64,
    /// Keys re-opened, by job.
    pub reopened: Vec<(String, i64)>,
}

impl Figures {
    pub async fn read(pool: &PgPool) -> Figures {
        let by = |sql: &'static str| async move {
            sqlx::query_as::<_, (String, i64)>(sql)
                .fetch_all(pool)
                .await
                .expect(sql)
        };
        Figures {
            settled: scalar(
                pool,
                "select count(*) from loans where fine_settled_at is not null",
            )
            .await,
            settled_at_cap: scalar(
                pool,
                &format!("select count(*) from loans where fine_settled_at is not null and fine_cents = {CAP}"),
            )
            .await,
            ledger: scalar(pool, "select count(*) from fine_ledger").await,
            net: scalar(pool, "select count(*) from fine_ledger_net").await,
            ledger_loans: scalar(pool, "select count(distinct loan_id) from fine_ledger_net").await,
            charged_to_cap: scalar(
                pool,
                &format!(
                    "select count(*) from (select loan_id from fine_ledger_net group by 1
                                           having sum(net_cents) = {CAP}) x"
                ),
            )
            .await,
            corrections: by("select reason, count(*) from fine_ledger_corrections group by 1 order by 1").await,
            seen: History::rows_seen(pool).await,
            checked: scalar(pool, "select count(*) from loans").await,
            keys: scalar(pool, "select count(*) from job_runs").await,
            takeovers: scalar(
                pool,
                "select count(*) from job_run_attempts where event = 'takeover'",
            )
            .await,
            lost: scalar(
                pool,
                "select count(*) from job_run_attempts where event = 'lease_lost'",
            )
            .await,
            reopened: by(
                "select job_name, count(*) from job_run_attempts where event = 'reopened' group by 1 order by 1",
            )
            .await,
        }
    }
}

/// What a failed run needs to be understood, on stderr: the keys of the final count not SUCCESS with their
/// history, and the (loan, day) nets that differ from the sequential run's, by day and shard.
pub async fn diagnose(pool: &PgPool, oracle: &Oracle) {
    let keys: Vec<String> = sqlx::query_scalar(&format!(
        "select format('%s %s shard %s: %s epoch %s owner %s lease_until %s cursor %s last_error %s; history: %s',
                       k.job_name, k.business_date, k.shard, k.status, k.epoch, k.owner, k.lease_until,
                       k.cursor, k.last_error,
                       (select string_agg(a.event || '@' || a.epoch || ' ' || a.at::time || coalesce(' ' || a.error, ''), ', ' order by a.id)
                        from job_run_attempts a
                        where (a.job_name, a.business_date, a.shards, a.shard)
                            = (k.job_name, k.business_date, k.shards, k.shard)))
         from job_runs k where k.shards = {FINAL_SHARDS} and k.status <> 'SUCCESS' order by 1"
    ))
    .fetch_all(pool)
    .await
    .unwrap_or_else(|e| vec![format!("cannot read job_runs: {e}")]);
    for key in keys {
        eprintln!("chaos: key not SUCCESS: {key}");
    }
    let days: Vec<String> = sqlx::query_scalar(&format!(
        "select format('%s shard %s: %s (loan, day) differ, want %s have %s, e.g. loans %s',
                       d.accrual_date, mod(d.loan_id, {FINAL_SHARDS}), count(*), sum(d.want), sum(d.have),
                       (array_agg(d.loan_id order by d.loan_id))[1:5])
         from ({}) d group by d.accrual_date, mod(d.loan_id, {FINAL_SHARDS}) order by 1",
        oracle.ledger_diff("true")
    ))
    .fetch_all(pool)
    .await
    .unwrap_or_else(|e| vec![format!("cannot compare the ledger: {e}")]);
    for day in days {
        eprintln!("chaos: ledger differs on {day}");
    }
}
