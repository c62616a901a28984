//! What the commands print: JSON lines or tables for `runs` and `pending list`, and `verify`'s text report.

use chrono::NaiveDate;

use crate::store::{self, audit::MonthAudit};

/// Rows on stdout: one JSON object per line with `--json`, else the table.
pub fn print_rows<T: serde::Serialize>(rows: &[T], json: bool, table: fn(&[T]) -> String) {
    if json {
        for row in rows {
            println!("{}", serde_json::to_string(row).unwrap_or_default());
        }
    } else {
        print!("{}", table(rows));
    }
}

/// The pauses in force, above `runs`' rows: a `paused:` line each, or with `--json` one `{"record":"pause",…}`
/// line each (the rows' own lines are unchanged).
pub fn print_pauses(pauses: &[store::pauses::Pause], json: bool) {
    for p in pauses {
        if json {
            let mut line = serde_json::json!({"record": "pause"});
            if let (Some(line), serde_json::Value::Object(fields)) = (line.as_object_mut(), p.json()) {
                line.extend(fields);
            }
            println!("{line}");
        } else {
            println!("paused: {p}");
        }
    }
}

pub fn pending_table(rows: &[store::ledger::Pending]) -> String {
    let mut out = format!(
        "{:>12} {:<10} {:>10} {:>8} {:<25} {:<7} {}\n",
        "LOAN", "DATE", "AMOUNT", "ATTEMPTS", "NEXT_ATTEMPT", "STATUS", "LAST_ERROR"
    );
    for r in rows {
        out.push_str(&format!(
            "{:>12} {:<10} {:>10} {:>8} {:<25} {:<7} {}\n",
            r.loan_id,
            r.accrual_date,
            r.amount_cents,
            r.attempts,
            r.next_attempt_at
                .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            r.status,
            r.last_error.as_deref().unwrap_or("")
        ));
    }
    out
}

pub fn history_table(rows: &[store::job_runs::Attempt]) -> String {
    let mut out = format!(
        "{:>6} {:<16} {:<10} {:>6} {:>5} {:<11} {:>10} {:>10} {:<25} {:<30} {}\n",
        "ID", "JOB", "DATE", "SHARD", "EPOCH", "EVENT", "SCANNED", "UPDATED", "AT", "OWNER", "ERROR"
    );
    for r in rows {
        out.push_str(&format!(
            "{:>6} {:<16} {:<10} {:>6} {:>5} {:<11} {:>10} {:>10} {:<25} {:<30} {}\n",
            r.id,
            r.job_name,
            r.business_date,
            format!("{}/{}", r.shard, r.shards),
            r.epoch,
            r.event,
            r.scanned.map_or("-".into(), |n| n.to_string()),
            r.updated.map_or("-".into(), |n| n.to_string()),
            r.at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            r.owner,
            r.error.as_deref().unwrap_or("")
        ));
    }
    out
}

pub fn runs_table(rows: &[store::job_runs::JobRun]) -> String {
    let mut out = format!(
        "{:<16} {:<10} {:>6} {:<8} {:>5} {:>8} {:>10} {:>10} {:>10} {:>12}  {:<30} {}\n",
        "JOB",
        "DATE",
        "SHARD",
        "STATUS",
        "EPOCH",
        "LEASE_S",
        "SCANNED",
        "UPDATED",
        "CORRECTED",
        "CURSOR",
        "OWNER",
        "LAST_ERROR"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<16} {:<10} {:>6} {:<8} {:>5} {:>8.1} {:>10} {:>10} {:>10} {:>12}  {:<30} {}\n",
            r.job_name,
            r.business_date,
            format!("{}/{}", r.shard, r.shards),
            r.status,
            r.epoch,
            r.lease_left_s,
            r.scanned,
            r.updated,
            r.corrected,
            r.cursor.map_or("-".to_string(), |c| c.to_string()),
            r.owner,
            r.last_error.as_deref().unwrap_or("")
        ));
    }
    out
}

/// `verify`'s report: one JSON object with `--json`, else text.
pub fn print_audit(business_date: NaiveDate, month: (NaiveDate, NaiveDate), audit: &MonthAudit, json: bool) {
    let violations = audit.violations();
    let notes = audit.notes();
    if json {
        let out = serde_json::json!({"business_date": business_date, "audit": audit, "violations": violations,
                                     "notes": notes});
        println!("{out}");
        return;
    }
    println!("business month {} .. {}", month.0, month.1);
    println!("  loans returned      {}", audit.returned);
    println!("  settled             {}", audit.settled);
    println!(
        "  fine total (cents)  {} (policy: {})",
        audit.total_cents, audit.expected_cents
    );
    println!("  complete shard sets {:?}", audit.complete_shard_counts);
    println!(
        "  ledger reconciled   {} loans, {} mismatches",
        audit.ledger_checked, audit.ledger_mismatches
    );
    println!("  over-accrued loans  {}", audit.over_accrued);
    println!("  non-finite dates    {}", audit.not_finite);
    println!("  unknown classes     {} loans", audit.loans_without_class_policy);
    println!("  violations          {}", violations.len());
    for v in &violations {
        println!("    - {v}");
    }
    for n in &notes {
        println!("  note: {n}");
    }
}

/// One JSON line on stdout.
pub fn print_json<T: serde::Serialize>(value: &T) {
    println!("{}", serde_json::to_string(value).unwrap_or_default());
}

/// `policy list`'s table.
pub fn policies_table(rows: &[crate::policy::PolicyVersion]) -> String {
    let mut out = format!(
        "{:<16} {:<12} {:>10} {:>6} {:>10} {:<13} {:<25} {:<20} {}\n",
        "CLASS", "FROM", "RATE", "GRACE", "CAP", "CLOSED_DAYS", "CREATED_AT", "BY", "REASON"
    );
    for r in rows {
        let f = &r.policy.fine;
        out.push_str(&format!(
            "{:<16} {:<12} {:>10} {:>6} {:>10} {:<13} {:<25} {:<20} {}\n",
            r.class,
            r.effective_from.to_string(),
            f.daily_rate().get(),
            f.grace_days(),
            f.cap().map_or(0, |c| c.get()),
            if r.policy.charge_closed_days {
                "charged"
            } else {
                "free"
            },
            r.created_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            r.created_by,
            r.reason
        ));
    }
    out
}

/// `calendar list`'s table.
pub fn closed_days_table(rows: &[store::calendar::ClosedDay]) -> String {
    let mut out = format!("{:<12} {:<25} {:<20} {}\n", "DAY", "CREATED_AT", "BY", "REASON");
    for r in rows {
        out.push_str(&format!(
            "{:<12} {:<25} {:<20} {}\n",
            r.day.to_string(),
            r.created_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            r.created_by,
            r.reason
        ));
    }
    out
}
