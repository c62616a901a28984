//! `fine_policies`: the versioned fine rules — `policy list`, `policy add`, the first `default` policy seeded by
//! `migrate`, and the policy in force for a class on a date. The rule itself (which version governs a loan, and
//! what it owes) is `crate::policy` and its SQL twin (migrations/20261203000053).

use chrono::NaiveDate;

use crate::{
    fine::{Cents, FinePolicy},
    policy::{FineClass, Policy, PolicyVersion},
    store::Db,
};

/// The `effective_from` of the policy `migrate` seeds: PostgreSQL's earliest date (4714-11-24 BC, written
/// -4713-11-24 in ISO 8601), so that it governs every loan no later version does.
pub fn earliest_date() -> NaiveDate {
    NaiveDate::from_ymd_opt(-4713, 11, 24).unwrap_or(NaiveDate::MIN)
}

/// A policy to add.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewPolicy {
    pub class: FineClass,
    /// The first due date it governs.
    pub effective_from: NaiveDate,
    pub policy: Policy,
    pub reason: String,
    pub by: String,
}

/// What `policy add` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Added {
    /// The row is new.
    Added(PolicyVersion),
    /// The same rule was already there for the class and date: nothing written.
    Unchanged(PolicyVersion),
    /// A different rule is there for the class and date: nothing written (a version is never rewritten).
    Conflict(PolicyVersion),
}

/// The columns of a `fine_policies` row, as read.
struct Row {
    fine_class: String,
    effective_from: NaiveDate,
    daily_rate_cents: i64,
    grace_days: i32,
    cap_cents: i64,
    charge_closed_days: bool,
    created_at: chrono::DateTime<chrono::Utc>,
    created_by: String,
    reason: String,
}

impl Row {
    /// The row as a version; the table's checks keep every stored row valid, so a refusal here is a row written
    /// around them (reported as a decoding error naming it).
    fn version(self) -> Result<PolicyVersion, sqlx::Error> {
        let bad = |what: String| {
            sqlx::Error::Decode(
                format!(
                    "fine_policies ({}, {}): {what}",
                    self.fine_class, self.effective_from
                )
                .into(),
            )
        };
        let class = FineClass::new(&self.fine_class).map_err(|e| bad(e.to_string()))?;
        let fine = FinePolicy::new(self.daily_rate_cents, i64::from(self.grace_days), self.cap_cents)
            .map_err(|e| bad(e.to_string()))?;
        Ok(PolicyVersion {
            class,
            effective_from: self.effective_from,
            policy: Policy {
                fine,
                charge_closed_days: self.charge_closed_days,
            },
            created_at: self.created_at,
            created_by: self.created_by,
            reason: self.reason,
        })
    }
}

/// What `plan` and the status page show of the rules on `today`: for each class the version in force (the
/// latest `effective_from <= today`) and every version that takes effect later, as `policy list --json` prints
/// them; and the closed days of the coming month (`today` to a month later).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RulesInForce {
    pub policies: Vec<serde_json::Value>,
    pub closed_days: Vec<NaiveDate>,
}

/// Reads [`RulesInForce`] for `today`, in one statement (the status page's reads are few and short).
pub async fn rules_in_force(pool: &Db, today: NaiveDate) -> Result<RulesInForce, sqlx::Error> {
    let until = today.checked_add_months(chrono::Months::new(1)).unwrap_or(today);
    let rows = sqlx::query!(
        r#"select f.fine_class as "fine_class?", f.effective_from as "effective_from?",
                  f.daily_rate_cents as "daily_rate_cents?", f.grace_days as "grace_days?",
                  f.cap_cents as "cap_cents?", f.charge_closed_days as "charge_closed_days?",
                  f.created_at as "created_at?", f.created_by as "created_by?", f.reason as "reason?",
                  c.days as "closed_days!"
           from (select coalesce(array_agg(d.day order by d.day), '{}') as days
                 from library_closed_days d where d.day between $1 and $2) c
           left join fine_policies f
             on f.effective_from > $1
             or f.effective_from = (select max(g.effective_from) from fine_policies g
                                    where g.fine_class = f.fine_class and g.effective_from <= $1)
           order by f.fine_class, f.effective_from"#,
        today,
        until,
    )
    .fetch_all(pool)
    .await?;
    let closed_days = rows.first().map(|r| r.closed_days.clone()).unwrap_or_default();
    let mut policies = Vec::new();
    for r in rows {
        let (
            Some(fine_class),
            Some(effective_from),
            Some(daily_rate_cents),
            Some(grace_days),
            Some(cap_cents),
        ) = (
            r.fine_class,
            r.effective_from,
            r.daily_rate_cents,
            r.grace_days,
            r.cap_cents,
        )
        else {
            continue;
        };
        let row = Row {
            fine_class,
            effective_from,
            daily_rate_cents,
            grace_days,
            cap_cents,
            charge_closed_days: r.charge_closed_days.unwrap_or(false),
            created_at: r.created_at.unwrap_or_default(),
            created_by: r.created_by.unwrap_or_default(),
            reason: r.reason.unwrap_or_default(),
        };
        policies.push(row.version()?.json());
    }
    Ok(RulesInForce {
        policies,
        closed_days,
    })
}

/// Every version, by class and then date.
pub async fn list(pool: &Db) -> Result<Vec<PolicyVersion>, sqlx::Error> {
    sqlx::query_as!(
        Row,
        r#"select fine_class, effective_from, daily_rate_cents, grace_days, cap_cents, charge_closed_days,
                  created_at, created_by, reason
           from fine_policies order by fine_class, effective_from"#
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(Row::version)
    .collect()
}

/// The policy of a loan of `class` (none: `default`) due on `due_on`, by the SQL rule
/// (`fine_settler_policy_of`); `None` when no version governs it.
pub async fn governing(
    pool: &Db,
    class: Option<&str>,
    due_on: NaiveDate,
) -> Result<Option<PolicyVersion>, sqlx::Error> {
    sqlx::query_as!(
        Row,
        r#"select f.fine_class, f.effective_from, f.daily_rate_cents, f.grace_days, f.cap_cents,
                  f.charge_closed_days, f.created_at, f.created_by, f.reason
           from fine_settler_policy_of($1, $2) p
           join fine_policies f on f.fine_class = p.fine_class and f.effective_from = p.effective_from"#,
        class,
        due_on,
    )
    .fetch_optional(pool)
    .await?
    .map(Row::version)
    .transpose()
}

/// Adds a version: idempotent for the same rule, refused for a different one (see [`Added`]). The caller has
/// checked that `effective_from` is after today.
pub async fn add(pool: &Db, new: &NewPolicy) -> Result<Added, sqlx::Error> {
    let f = &new.policy.fine;
    let inserted = sqlx::query_as!(
        Row,
        r#"insert into fine_policies (fine_class, effective_from, daily_rate_cents, grace_days, cap_cents,
                                      charge_closed_days, created_by, reason)
           values ($1, $2, $3, $4, $5, $6, $7, $8)
           on conflict on constraint fine_policies_pkey do nothing
           returning fine_class, effective_from, daily_rate_cents, grace_days, cap_cents, charge_closed_days,
                     created_at, created_by, reason"#,
        new.class.as_str(),
        new.effective_from,
        f.daily_rate().get(),
        i32::try_from(f.grace_days()).unwrap_or(i32::MAX),
        f.cap().map_or(0, Cents::get),
        new.policy.charge_closed_days,
        new.by,
        new.reason,
    )
    .fetch_optional(pool)
    .await?;
    if let Some(row) = inserted {
        return Ok(Added::Added(row.version()?));
    }
    // The key was taken (rows are never deleted, so it still is): the same rule or another one.
    let existing = sqlx::query_as!(
        Row,
        r#"select fine_class, effective_from, daily_rate_cents, grace_days, cap_cents, charge_closed_days,
                  created_at, created_by, reason
           from fine_policies where fine_class = $1 and effective_from = $2"#,
        new.class.as_str(),
        new.effective_from,
    )
    .fetch_one(pool)
    .await?
    .version()?;
    Ok(if existing.policy == new.policy {
        Added::Unchanged(existing)
    } else {
        Added::Conflict(existing)
    })
}

/// Seeds the first `default` version from the deployment's `[fine]` keys, effective from the earliest date,
/// when the table is empty; returns whether it did. Two `migrate`s at once: the first one's row stays.
pub async fn seed_default(pool: &Db, fine: &FinePolicy) -> Result<bool, sqlx::Error> {
    seed_default_by(pool, fine, "migrate").await
}

/// [`seed_default`], for a command other than `migrate` (`command` names it in the row's reason): every command
/// that prices loans — a replica at start, `settle`, `accrue`, `backfill`, `pending retry`, `policy add` — seeds
/// an empty table the same way, so that a database migrated by another means (or before the rules moved into the
/// database) never has loans no policy governs. Once seeded the table is never empty again: its rows cannot be
/// deleted (migrations/20261203000055). Logs when it seeded.
pub async fn seed_default_by(pool: &Db, fine: &FinePolicy, command: &str) -> Result<bool, sqlx::Error> {
    let seeded = sqlx::query_scalar!(
        r#"insert into fine_policies (fine_class, effective_from, daily_rate_cents, grace_days, cap_cents,
                                      charge_closed_days, reason)
           select 'default', $1, $2, $3, $4, false,
                  'seeded by ' || $5 || ' from the [fine] configuration keys'
           where not exists (select 1 from fine_policies)
           on conflict on constraint fine_policies_pkey do nothing
           returning true as "seeded!""#,
        earliest_date(),
        fine.daily_rate().get(),
        i32::try_from(fine.grace_days()).unwrap_or(i32::MAX),
        fine.cap().map_or(0, Cents::get),
        command,
    )
    .fetch_optional(pool)
    .await?;
    let seeded = seeded.unwrap_or(false);
    if seeded {
        tracing::info!(
            command,
            daily_rate_cents = fine.daily_rate().get(),
            grace_days = fine.grace_days(),
            cap_cents = fine.cap().map_or(0, Cents::get),
            "fine_policies was empty: seeded the first default policy from the [fine] configuration keys"
        );
    }
    Ok(seeded)
}
