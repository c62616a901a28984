//! The report's "Accrual" section, and `merge`, which puts it into an existing report in place of the one there
//! (so that the accrual section can be measured on its own and the other sections' figures kept).

use std::fmt::Write as _;

use super::{
    data::{CAP, GRACE, RATE},
    day::{DayRun, Way},
    recheck::Backdated,
    Accrual, Schema, WINDOW_DAYS,
};
use crate::{per_sec, verdict};

/// How the report names a way of accruing the day.
fn way_label(way: Way) -> &'static str {
    match way {
        Way::Accrue => "`fine-settler accrue --date D`",
        Way::AccrueJitOff => "the same, JIT off (`PGOPTIONS=-c jit=off`)",
        Way::Statement => "one `insert … select`",
        Way::GuardedStatement => "the same with the cap's guard (each charge only if it fits under what the loan's ledger leaves: its sums per loan; `on conflict do nothing`)",
        Way::BatchedStatement => "one `insert … select` without the guard, in batches (the next `accrual.batch_size` loans owing a charge by id, each its own transaction)",
    }
}

/// The heading the section starts with; `merge` finds it by this line.
const HEADING: &str = "## Accrual";

/// The header line that says which sections were measured when.
const MEASURED: &str = "- measured:";

/// The re-check target of issue #24: database time of one re-check with nothing to do.
const IDLE_RECHECK_TARGET_MS: f64 = 100.0;

/// The accrue target of issue #23: `accrue` against one statement writing the same charges.
const ACCRUE_TARGET: f64 = 0.8;

impl Accrual {
    /// The section, Markdown, its targets included.
    pub(crate) fn report(&self) -> String {
        let mut r = String::new();
        let _ = writeln!(r, "{HEADING}\n");
        let _ = writeln!(
            r,
            "Accrual day {day} (yesterday in `Asia/Shanghai` when the section ran); policy {RATE} cents a day, grace {GRACE}, cap {CAP} cents (15 days in full, the 16th the 50 cents left, nothing after); batches of {batch} (`accrual.batch_size`). Machine load (1-minute average) {} at the start of the section, {} at its end, on 2 cores shared with other work.\n",
            self.load.0,
            self.load.1,
            day = self.day,
            batch = self.args.batch,
        );
        self.day_section(&mut r);
        self.backdated_section(&mut r);
        self.sizes_section(&mut r);
        self.targets(&mut r);
        r
    }

    fn before_label(&self) -> String {
        match &self.before_commit {
            Some(c) => format!("{} ({c})", Schema::Before.label()),
            None => Schema::Before.label().to_string(),
        }
    }

    fn day_section(&self, r: &mut String) {
        let leg = &self.day_leg;
        let _ = writeln!(r, "### One accrual day\n");
        let generated = leg
            .generated
            .iter()
            .map(|(s, g)| {
                format!(
                    "{} ledger rows before the day, generated in {:.0} s ({})",
                    g.ledger_rows,
                    g.seconds,
                    s.short()
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            r,
            "{} loans generated around the day (60 % out and overdue by 1–24 days, a third of them past the cap; 15 % overdue and returned on the day or the next; 10 % not yet due; 15 % returned before it), with each loan's whole ledger before the day: {generated}. Each way on a fresh copy of the template, {} rounds, the median reported; time is the run's `elapsed_ms` (claim to finish) or the statement's. The statement writes `fine_settler_day_amount` for every loan that owes one (on the ledger before, which has no such function, the same expression written out); every run wrote the same charges.\n",
            leg.loans, self.args.rounds
        );
        let _ = writeln!(r, "| ledger | way | charges | cents | time (median) | rows/s | vs. the statement | statements | peak RSS | runs |");
        let _ = writeln!(
            r,
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
        );
        for (schema, way, runs) in &leg.runs {
            let Some(m) = leg.median(*schema, *way) else {
                continue;
            };
            let label = match schema {
                Schema::Current => Schema::Current.label().to_string(),
                Schema::Before => self.before_label(),
            };
            let vs = match way {
                Way::Statement => "1.00".to_string(),
                _ => leg
                    .ratio(*schema, *way)
                    .map_or(String::new(), |x| format!("{x:.2}")),
            };
            let rss = match way {
                Way::Accrue | Way::AccrueJitOff => format!("{:.1} MiB", m.peak_rss_kib as f64 / 1024.0),
                _ => String::new(),
            };
            let way_label = way_label(*way);
            let _ = writeln!(
                r,
                "| {label} | {way_label} | {} | {} | {} ms | {:.0} | {vs} | {} | {rss} | {} |",
                m.rows,
                m.cents,
                m.ms,
                per_sec(m.rows, m.ms),
                m.statements,
                runs.iter()
                    .map(|x: &DayRun| format!("{} ms", x.ms))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        self.limits(r);
        let _ = writeln!(r, "\nWhere the median `accrue` spent its database time (`pg_stat_statements`, execution of the three costliest statements; JIT compilation counts as execution):\n");
        for (schema, way) in [Schema::Current, Schema::Before]
            .into_iter()
            .flat_map(|s| [(s, Way::Accrue), (s, Way::AccrueJitOff)])
        {
            let Some(m) = leg.median(schema, way) else {
                continue;
            };
            let costliest = m
                .costliest
                .iter()
                .map(|c| format!("`{}…` {} calls, {:.0} ms", c.text, c.calls, c.exec_ms))
                .collect::<Vec<_>>()
                .join("; ");
            let _ = writeln!(r, "- {}, {}: {costliest}", schema.label(), way_label(way));
        }
        let now = leg.median(Schema::Current, Way::Accrue);
        if let (Some(now), Some(then)) = (now, leg.median(Schema::Before, Way::Accrue)) {
            let _ = writeln!(
                r,
                "\nBefore and after: `accrue` of the day took {} ms on the current ledger and {} ms on the {} ({:.2} × its time), {} and {} statements.",
                now.ms,
                then.ms,
                self.before_label(),
                now.ms as f64 / then.ms.max(1) as f64,
                now.statements,
                then.statements
            );
            let off = |schema| leg.median(schema, Way::AccrueJitOff).map_or(0, |m| m.ms);
            let _ = writeln!(
                r,
                "With JIT off: {} ms and {} ms.",
                off(Schema::Current),
                off(Schema::Before)
            );
        } else {
            let _ = writeln!(
                r,
                "\nThe ledger before canonical amounts was not measured: no `--before-binary`."
            );
        }
        let _ = writeln!(
            r,
            "JIT compilation: the server compiles a statement whose estimated cost is over `jit_above_cost` ({}) every time it runs (a prepared statement's generic plan keeps that choice); `PGOPTIONS=-c jit=off` turns it off for a process's sessions.\n",
            self.jit_above_cost
        );
    }

    fn backdated_section(&self, r: &mut String) {
        let b: &Backdated = &self.backdated;
        let charged: i64 = b
            .setup
            .iter()
            .filter(|x| x.business_date == self.day)
            .map(|x| x.updated)
            .sum();
        let looked: i64 = b.rechecks.iter().map(|f| f.changed).sum();
        let _ = writeln!(r, "### Re-check: back-dated returns\n");
        let _ = writeln!(
            r,
            "On a copy of the template, `run --once` (accrual enabled, settlement disabled) first accrued the window, {first} to {day} ({charged} charges on {day}; the days before it found nothing to do). Then `update loans set returned_on = '{ret}'` recorded {} open loans charged on {day} as returned the day before the window ({} changes queued by the triggers on `loans`), which makes {} of their charges owed no longer. Then a replica (`run`, ticking every 200 ms, `accrual.recheck_every` at its default) was started and timed until the ledger held every correction owed: its re-checks (each right after the last while changes were left unread) re-opened the days, whose runs looked at the changed loans only.\n",
            b.returns,
            b.queued,
            b.owed,
            first = self.day - chrono::Duration::days(WINDOW_DAYS - 1),
            day = self.day,
            ret = self.day - chrono::Duration::days(WINDOW_DAYS),
        );
        let _ = writeln!(r, "| time until corrected (replica start to the last correction) | corrections in the ledger | days after a return with a net (`fine_ledger_net`) | statements | re-checks that found days (changed loans each looked at) | re-check database time |");
        let _ = writeln!(r, "| ---: | ---: | ---: | ---: | --- | ---: |");
        let _ = writeln!(
            r,
            "| {} ms | {} of {} owed | {} | {} | {} ({}; {looked} in all) | {:.1} ms in {} calls |\n",
            b.wall_ms,
            b.written,
            b.owed,
            b.net_after_returns,
            b.statements.calls,
            b.rechecks.len(),
            b.rechecks
                .iter()
                .map(|f| f.changed.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            b.statements.recheck.exec_ms,
            b.statements.recheck.calls,
        );
        let _ = writeln!(r, "Statements are every statement of the database while the replica ran (start-up, re-checks, claims, batches, fences, finishes), from `pg_stat_statements`.\n");
    }

    fn sizes_section(&self, r: &mut String) {
        let _ = writeln!(
            r,
            "### The idle tick with accrual enabled, and the re-check's cost\n"
        );
        let _ = writeln!(
            r,
            "Databases of open overdue loans only (a fifth past the cap), with the ledger of the window ({WINDOW_DAYS} days, generated set-based) and each day of it recorded as accrued; nothing queued. A real replica (settlement and accrual enabled) ticks every 200 ms for about {} s: with `accrual.recheck_every` at its default (1m: its first tick re-checks, then one a minute), and re-checking at every tick (`recheck_every` 10 ms), with JIT as the server says and off. Statements and database time from `pg_stat_statements` (`track_planning` on), read right after the replica's first idle tick and right after its last: the steady idle ticks between, start-up and first tick left out.\n",
            self.args.tick_secs
        );
        let _ = writeln!(r, "| open overdue loans | past the cap | ledger rows | statements per idle tick, default `recheck_every` (ticks) | database time per idle tick | re-checks (all in the first tick) | RSS | statements per tick re-checking at every tick |");
        let _ = writeln!(r, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for s in &self.sizes {
            let _ = writeln!(
                r,
                "| {} | {} | {} | {:.2} ({}) | {:.2} ms | {} | {:.1} MiB | {:.2} |",
                s.loans,
                s.at_cap,
                s.ledger_rows,
                s.idle.per_tick(),
                s.idle.ticks,
                s.idle.ms_per_tick(),
                s.idle.total.recheck.calls,
                s.idle.rss_kib as f64 / 1024.0,
                s.every_tick.per_tick(),
            );
        }
        let _ = writeln!(
            r,
            "\nThe re-check, from the same replicas; then {} open loans charged on the day are back-dated before the window and one `run --once` re-checks them (a replica's first re-check looks at 1,000 changed loans; its log says what it found) and runs the days it re-opened.\n",
            self.args.changed
        );
        let _ = writeln!(r, "| open overdue loans | nothing queued: execution mean, max (calls) | planning per plan (plans) | nothing queued, JIT off: execution mean, max (calls) | {} changed: database time (execution + planning) | found (changed / with work), days re-opened | `run --once` with them |", self.args.changed);
        let _ = writeln!(r, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for s in &self.sizes {
            let (e, off) = (s.every_tick.steady.recheck, s.every_tick_jit_off.steady.recheck);
            let planned = s.every_tick.total.recheck;
            let c = &s.changed;
            let _ = writeln!(
                r,
                "| {} | {:.3} ms, {:.2} ms ({}) | {:.1} ms ({}) | {:.3} ms, {:.2} ms ({}) | {:.1} ms ({:.1} + {:.1}) | {} / {} of {}, {} | {} ms |",
                s.loans,
                e.exec_per_call_ms(),
                e.max_exec_ms,
                e.calls,
                planned.per_plan_ms(),
                planned.plans,
                off.exec_per_call_ms(),
                off.max_exec_ms,
                off.calls,
                c.recheck.exec_ms + c.recheck.plan_ms,
                c.recheck.exec_ms,
                c.recheck.plan_ms,
                c.found.changed,
                c.found.dirty,
                c.queued,
                c.found.days,
                c.wall_ms,
            );
        }
        let _ = writeln!(
            r,
            "\nThe re-check is a prepared statement: it is planned when a connection first runs it (and again while PostgreSQL tries custom plans before it keeps the generic one); its maximum execution counts every call since the replica started. Generating the databases took {}.\n",
            self.sizes
                .iter()
                .map(|s| format!("{:.0} s at {} loans", s.generated_secs, s.loans))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }

    /// What bounds `accrue`'s ratio, from the two statement ways beside it: the guard alone, and batches alone.
    fn limits(&self, r: &mut String) {
        let leg = &self.day_leg;
        let (Some(guarded), Some(batched), Some(accrue)) = (
            leg.ratio(Schema::Current, Way::GuardedStatement),
            leg.ratio(Schema::Current, Way::BatchedStatement),
            leg.ratio(Schema::Current, Way::Accrue),
        ) else {
            return;
        };
        let _ = writeln!(
            r,
            "\nWhat bounds the ratio, on the current ledger: one statement that keeps each loan under its cap whatever else was charged reads each charged loan's ledger (its sum) — {guarded:.2} × the statement without the guard, with no batches at all; the statement without the guard cut into batches of {} loans owing a charge, each its own transaction — {batched:.2} × the statement, with no guard. `accrue` does both (and claims, fences, locks each loan and checks for corrections): its rate {accrue:.2} × the statement's, {:.2} × the guarded statement's.",
            self.args.batch,
            accrue / guarded
        );
    }

    fn targets(&self, r: &mut String) {
        let _ = writeln!(r, "### Accrual targets\n");
        let _ = writeln!(r, "| target | measured | |");
        let _ = writeln!(r, "| --- | --- | --- |");
        if let Some(x) = self.day_leg.ratio(Schema::Current, Way::Accrue) {
            let off = self
                .day_leg
                .ratio(Schema::Current, Way::AccrueJitOff)
                .unwrap_or(0.0);
            let _ = writeln!(
                r,
                "| `accrue` of one day over {} loans ≥ {ACCRUE_TARGET} × one statement writing the same charges | {x:.2} ({off:.2} with JIT off; the statement with the cap's guard alone: {}) | {} |",
                self.day_leg.loans,
                self.day_leg
                    .ratio(Schema::Current, Way::GuardedStatement)
                    .map_or("not measured".to_string(), |g| format!("{g:.2}")),
                verdict(x >= ACCRUE_TARGET)
            );
        }
        let b = &self.backdated;
        let _ = writeln!(
            r,
            "| a replica corrects {} back-dated returns by itself: every charge after a return corrected, no day after a return left in `fine_ledger_net` | {} of {} corrected, {} days left | {} |",
            b.returns,
            b.written,
            b.owed,
            b.net_after_returns,
            verdict(b.written == b.owed && b.net_after_returns == 0)
        );
        for s in &self.sizes {
            let e = s.every_tick.steady.recheck;
            let coldest = s.every_tick.total.recheck.per_plan_ms() + e.max_exec_ms;
            let _ = writeln!(
                r,
                "| re-check with nothing to do at {} open overdue loans ≤ {IDLE_RECHECK_TARGET_MS:.0} ms of database time | {:.3} ms a call; the first, planned and slowest: {coldest:.1} ms | {} |",
                s.loans,
                e.per_call_ms(),
                verdict(e.per_call_ms() <= IDLE_RECHECK_TARGET_MS && coldest <= IDLE_RECHECK_TARGET_MS)
            );
            let c = &s.changed;
            let _ = writeln!(
                r,
                "| re-check with {} changed loans at {} loans finds all of them | {} found, {} with work | {} |",
                c.queued,
                s.loans,
                c.found.changed,
                c.found.dirty,
                verdict(c.found.changed == c.queued && c.found.dirty == c.queued)
            );
            let _ = writeln!(
                r,
                "| idle tick with accrual enabled at {} loans: one statement (and the re-check's own on its schedule) | {:.2} per tick ({:.2} re-checking at every tick) | {} |",
                s.loans,
                s.idle.per_tick(),
                s.every_tick.per_tick(),
                verdict(s.idle.per_tick() <= 1.05 && s.idle.steady.recheck.calls == 0)
            );
        }
        let _ = writeln!(r);
    }
}

/// `existing` with its accrual section replaced by `section` (put before "## Targets", or at the end, when it has
/// none) and its "- measured:" header line by `measured` (put after the "- commit:" line when it has none).
pub(crate) fn merge(existing: &str, section: &str, measured: &str) -> String {
    merge_section(existing, (HEADING, section), (MEASURED, measured))
}

/// `existing` with the section under `heading` replaced by `section` (put before "## Targets", or at the end,
/// when it has none) and its header line starting with `prefix` by `measured` (put after the "- commit:" line
/// when it has none): how a section measured alone goes into a whole report.
pub(crate) fn merge_section(
    existing: &str,
    (heading, section): (&str, &str),
    (prefix, measured): (&str, &str),
) -> String {
    let mut lines: Vec<&str> = existing.lines().collect();
    let new: Vec<&str> = section.trim_end().lines().chain([""]).collect();
    match lines.iter().position(|l| *l == heading) {
        Some(start) => {
            let end = lines[start + 1..]
                .iter()
                .position(|l| l.starts_with("## "))
                .map_or(lines.len(), |i| start + 1 + i);
            lines.splice(start..end, new);
        }
        None => {
            let at = lines
                .iter()
                .position(|l| *l == "## Targets")
                .unwrap_or(lines.len());
            lines.splice(at..at, new);
        }
    }
    match lines.iter().position(|l| l.starts_with(prefix)) {
        Some(i) => lines[i] = measured,
        None => {
            let at = lines
                .iter()
                .position(|l| l.starts_with("- commit:"))
                .map_or(1, |i| i + 1);
            lines.insert(at.min(lines.len()), measured);
        }
    }
    while lines.last() == Some(&"") {
        lines.pop();
    }
    let mut merged = lines.join("\n");
    merged.push('\n');
    merged
}

/// The header line of a report whose sections were all measured in one run.
pub(crate) fn measured_all() -> String {
    format!("{MEASURED} every section in this run, at the date and commit above")
}

/// The header line of a report whose accrual section was measured on its own, at `date` and `commit`.
pub(crate) fn measured_accrual(date: &str, commit: &str) -> String {
    format!(
        "{MEASURED} the Accrual section on {date} at commit {commit} (`scripts/bench.sh --accrual`); every other section at the date and commit above"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = "# Settlement benchmark\n\n- date: d\n- commit: c\n- machine: m\n\n## Throughput\n\nfigures\n\n## Targets\n\n| t |\n";

    #[test]
    fn a_report_without_the_section_gets_it_before_the_targets_and_a_measured_line() {
        let merged = merge(
            REPORT,
            "## Accrual\n\nnew\n\n### Accrual targets\n\nok\n",
            "- measured: x",
        );
        assert_eq!(
            merged,
            "# Settlement benchmark\n\n- date: d\n- commit: c\n- measured: x\n- machine: m\n\n## Throughput\n\nfigures\n\n## Accrual\n\nnew\n\n### Accrual targets\n\nok\n\n## Targets\n\n| t |\n"
        );
    }

    #[test]
    fn merging_again_replaces_the_section_and_the_measured_line_and_keeps_the_rest() {
        let once = merge(REPORT, "## Accrual\n\nfirst\n", "- measured: one");
        let twice = merge(&once, "## Accrual\n\nsecond\n", "- measured: two");
        assert!(twice.contains("\n## Accrual\n\nsecond\n\n## Targets\n"));
        assert!(!twice.contains("first") && !twice.contains("- measured: one"));
        assert_eq!(twice.matches("## Accrual").count(), 1);
        assert!(twice.contains("## Throughput\n\nfigures\n") && twice.ends_with("| t |\n"));
    }

    #[test]
    fn a_section_at_the_end_is_replaced_to_the_end() {
        let report = "# R\n\n- commit: c\n\n## Accrual\n\nold\n";
        assert_eq!(
            merge(report, "## Accrual\n\nnew", "- measured: m"),
            "# R\n\n- commit: c\n- measured: m\n\n## Accrual\n\nnew\n"
        );
    }
}
