//! The impact section's report: the phases, where the load's sessions were, each `settle` phase against its
//! control, the latency-keyed phase, and the section's rows of the targets table.

use std::fmt::Write as _;

use super::{
    control, Impact, Of, Phase, PhaseResult, BUDGET_OF_IDLE_P99, CONTROL_MAX, GOVERNED_DEADLINE, MONTHS,
    PROBE_EVERY, SAMPLE_EVERY,
};
use crate::verdict;

impl Impact {
    fn p99_ratio(&self, p: &PhaseResult) -> f64 {
        p.load.p99_ms / self.idle.load.p99_ms.max(0.001)
    }

    /// The control of the `settle` phase `of`, if it ran.
    fn control(&self, of: Of) -> Option<&PhaseResult> {
        self.controls
            .iter()
            .find(|c| matches!(c.phase, Phase::Control { of: o, .. } if o == of))
    }

    /// The phase `of` stands for.
    fn settle_phase(&self, of: Of) -> Option<&PhaseResult> {
        match of {
            Of::Settle => Some(&self.settle),
            Of::Throttled => self.throttled.as_ref().ok(),
            Of::Governed => self.governed.as_ref().ok(),
        }
    }

    /// A `settle` phase's p99 over its control's.
    fn control_ratio(&self, of: Of) -> Option<f64> {
        let (p, c) = (self.settle_phase(of)?, self.control(of)?);
        Some(p.load.p99_ms / c.load.p99_ms.max(0.001))
    }

    fn wal_ratio(&self) -> f64 {
        self.wal_settle.per_row() / self.wal_statement.per_row().max(f64::MIN_POSITIVE)
    }

    /// The section of the report.
    pub(crate) fn report(&self) -> String {
        let a = &self.args;
        let mut r = String::new();
        let _ = writeln!(r, "## Impact on a live load\n");
        let _ = writeln!(
            r,
            "A libraryd-like load beside each phase: `pgbench` at {} transactions/s (`-R`, {} sessions, prepared statements), each transaction a point read of one random loan and `update loans set member_id = member_id` of another (by id: the row lock settlement's update needs, a new row version, nothing settlement reads). Each phase runs on a fresh copy of the {}-loan template, the load started {:.0} s before it and stopped {:.0} s after it; a phase's figures are the load's transactions scheduled while it ran. Every phase that settles settles the months ending {} one after another ({} rows). Latency is pgbench's, from each transaction's scheduled start (schedule lag included). Lock waits are sampled from `pg_stat_activity` every {} ms (a load session waiting on a lock, since its statement started): shorter waits can be missed. Machine CPU busy is `/proc/stat` over the phase, all cores, everything running on the machine.\n",
            a.rate,
            a.clients,
            self.loans,
            a.warmup.as_secs_f64(),
            a.cooldown.as_secs_f64(),
            MONTHS.join(", "),
            self.wal_settle.rows,
            SAMPLE_EVERY.as_millis()
        );
        r.push_str(&self.phases());
        r.push_str(&self.sessions());
        r.push_str(&self.floor());
        r.push_str(&self.governed_report());
        let _ = writeln!(
            r,
            "Rows/s is settlement's own: the runs' `elapsed_ms` (claim to finish), the statements' time. Beside the load, `settle` with its defaults reaches {:.2} of the single statement's rate.\n",
            self.settle.rows_per_sec() / self.statement.rows_per_sec().max(f64::MIN_POSITIVE)
        );
        if let Ok(p) = &self.throttled {
            let Phase::Throttled(cap) = p.phase else {
                unreachable!("the throttled phase is Phase::Throttled")
            };
            let _ = writeln!(
                r,
                "Throttled to {cap} rows/s (a quarter of the {:.0} rows/s the defaults reached above), `settle` averaged {:.0} rows/s ({:.2} of the cap).\n",
                self.settle.rows_per_sec(),
                p.rows_per_sec(),
                p.rows_per_sec() / cap as f64
            );
        }
        let _ = writeln!(
            r,
            "WAL per settled row, without the load, each on a fresh copy after a `checkpoint` (`pg_current_wal_lsn()` before and after, `pg_wal_lsn_diff`):\n"
        );
        let _ = writeln!(r, "| way | rows | WAL | bytes per row |");
        let _ = writeln!(r, "| --- | ---: | ---: | ---: |");
        for (label, w) in [
            (
                format!("`settle`, defaults (batches of {})", self.batch),
                self.wal_settle,
            ),
            ("single statement per month".to_string(), self.wal_statement),
        ] {
            let _ = writeln!(
                r,
                "| {label} | {} | {:.1} MiB | {:.1} |",
                w.rows,
                w.bytes as f64 / 1_048_576.0,
                w.per_row()
            );
        }
        let _ = writeln!(r);
        let _ = writeln!(
            r,
            "Ratios: defaults p99 / idle p99 = {:.2} (target ≤ 2); defaults max = {:.1} ms (target ≤ 250 ms); throttled p99 / idle p99 = {} (target ≤ 1.2); single statement p99 / idle p99 = {:.2}; settle WAL per row / statement WAL per row = {:.2} (target ≤ 1.1). `bench/README.md` says what limits a missed one.\n",
            self.p99_ratio(&self.settle),
            self.settle.load.max_ms,
            match &self.throttled {
                Ok(p) => format!("{:.2}", self.p99_ratio(p)),
                Err(_) => "not available".into(),
            },
            self.p99_ratio(&self.statement),
            self.wal_ratio()
        );
        r
    }

    /// The table of the phases: the load's latency, lock waits and the machine's CPU in each, and what it
    /// settled.
    fn phases(&self) -> String {
        let mut r = String::new();
        let _ = writeln!(
            r,
            "| phase | duration | load tx | load tx/s | p50 | p99 | max | longest lock wait | load statements seen waiting | machine CPU busy | settled rows | rows/s |"
        );
        let _ = writeln!(
            r,
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        );
        let row = |r: &mut String, p: &PhaseResult| {
            let settles = !matches!(p.phase, Phase::Idle | Phase::Control { .. });
            let rate = if settles {
                format!("{:.0}", p.rows_per_sec())
            } else {
                String::new()
            };
            let settled = if settles {
                p.settled.to_string()
            } else {
                String::new()
            };
            let _ = writeln!(
                r,
                "| {}{} | {:.1} s | {} | {:.0} | {:.1} ms | {:.1} ms | {:.1} ms | {:.0} ms | {} ({:.2} % of the load's) | {} | {settled} | {rate} |",
                p.phase.label(self.batch),
                if p.caught_up { "" } else { " (load behind schedule when stopped)" },
                p.wall.as_secs_f64(),
                p.load.transactions,
                p.load_rate,
                p.load.p50_ms,
                p.load.p99_ms,
                p.load.max_ms,
                p.waits.longest_ms,
                p.waits.statements,
                100.0 * p.waits.statements as f64 / p.load.transactions.max(1) as f64,
                p.cpu.map_or_else(|| "?".to_string(), |c| format!("{:.0} %", c * 100.0)),
            );
        };
        row(&mut r, &self.idle);
        row(&mut r, &self.settle);
        row(&mut r, &self.statement);
        for (label, p) in [
            ("`settle`, throttled", &self.throttled),
            ("`settle`, max_commit_latency", &self.governed),
        ] {
            match p {
                Ok(p) => row(&mut r, p),
                Err(why) => {
                    let _ = writeln!(
                        r,
                        "| {label} | not available: {} | | | | | | | | | | |",
                        why.replace('|', "\\|")
                    );
                }
            }
        }
        for c in &self.controls {
            row(&mut r, c);
        }
        let _ = writeln!(r);
        r
    }

    /// Where the load's active sessions were in each phase.
    fn sessions(&self) -> String {
        let mut r = String::new();
        let _ = writeln!(
            r,
            "Where the load's active sessions were, sampled from `pg_stat_activity` every {} ms over each phase: on CPU (no wait event), waiting for WAL (`IO:WALSync`, `IO:WALWrite`, `LWLock:WALWrite`, `LWLock:WALInsert` — a commit waiting for its flush, or for the right to write WAL), on a lock, or anything else (client reads, buffer I/O). Beside them, the commit latency probe of `throttle.max_commit_latency` (`begin`, `select 1`, one tiny logical message, `commit`: four round trips), taken by the benchmark every {} ms on a connection of its own in every phase: how its p99 follows the load's is how well it can stand for libraryd's latency.\n",
            SAMPLE_EVERY.as_millis(),
            PROBE_EVERY.as_millis()
        );
        let _ = writeln!(
            r,
            "| phase | active samples | on CPU | waiting for WAL | on a lock | other | probes | probe p50 | probe p99 | load p99 |"
        );
        let _ = writeln!(
            r,
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        );
        let phases = [Some(&self.idle), Some(&self.settle), Some(&self.statement)]
            .into_iter()
            .chain([self.throttled.as_ref().ok(), self.governed.as_ref().ok()])
            .flatten()
            .chain(&self.controls);
        for p in phases {
            let w = &p.waits;
            let (probes, p50, p99) = p.probe.map_or_else(
                || ("0".to_string(), String::new(), String::new()),
                |l| {
                    (
                        l.transactions.to_string(),
                        format!("{:.1} ms", l.p50_ms),
                        format!("{:.1} ms", l.p99_ms),
                    )
                },
            );
            let _ = writeln!(
                r,
                "| {} | {} | {:.0} % | {:.0} % | {:.0} % | {:.0} % | {probes} | {p50} | {p99} | {:.1} ms |",
                p.phase.label(self.batch),
                w.active,
                w.share(w.cpu),
                w.share(w.wal),
                w.share(w.lock),
                w.share(w.other),
                p.load.p99_ms
            );
        }
        let _ = writeln!(r);
        r
    }

    /// Each `settle` phase against its control: the floor of what its WAL volume costs the load.
    fn floor(&self) -> String {
        let mut r = String::new();
        if self.controls.is_empty() {
            return r;
        }
        let _ = writeln!(
            r,
            "Against the floor. Each `settle` phase's control is a writer that is not fine-settler — `insert`s of 300-byte rows into a table of its own, one transaction every {} ms — writing the WAL bytes per second that phase's settlement wrote (its rows × the {:.0} bytes per row `settle` writes without load, below, over the phase's duration; {:.0} bytes per row of the writer's, measured alone), for as long as that phase ran (5–{} s), on a fresh copy beside the same load:\n",
            control::TICK.as_millis(),
            self.wal_settle.per_row(),
            self.row_bytes,
            CONTROL_MAX.as_secs()
        );
        let _ = writeln!(
            r,
            "| `settle` phase | its WAL | the control's (written) | phase p99 | control p99 | phase p99 / control p99 | target |"
        );
        let _ = writeln!(r, "| --- | ---: | ---: | ---: | ---: | ---: | --- |");
        for (of, target) in [
            (Of::Settle, Some(2.0)),
            (Of::Throttled, Some(1.5)),
            (Of::Governed, None),
        ] {
            let (Some(p), Some(c)) = (self.settle_phase(of), self.control(of)) else {
                continue;
            };
            let Phase::Control { bytes_per_sec, .. } = c.phase else {
                continue;
            };
            let written = c.control_rows as f64 * self.row_bytes / c.wall.as_secs_f64().max(0.001);
            let ratio = p.load.p99_ms / c.load.p99_ms.max(0.001);
            let _ = writeln!(
                r,
                "| {} | {:.1} MB/s | {:.1} MB/s | {:.1} ms | {:.1} ms | {ratio:.2} | {} |",
                p.phase.label(self.batch),
                bytes_per_sec / 1e6,
                written / 1e6,
                p.load.p99_ms,
                c.load.p99_ms,
                target.map_or_else(|| "—".to_string(), |t| format!("≤ {t} ({})", verdict(ratio <= t)))
            );
        }
        let _ = writeln!(r);
        r
    }

    /// What the latency-keyed phase kept, and the rate it found.
    fn governed_report(&self) -> String {
        let mut r = String::new();
        let Ok(p) = &self.governed else {
            return r;
        };
        let _ = writeln!(
            r,
            "Under `throttle.max_commit_latency` = {:.1} ms ({BUDGET_OF_IDLE_P99} × the idle phase's p99), `settle` settled {} of the {} months ({} rows; no month is started after {} s) at {:.0} rows/s — {:.2} of the defaults' {:.0} rows/s — and the load's p99 was {:.1} ms, {:.2} × idle (target ≤ 1.6).\n",
            self.budget.as_secs_f64() * 1000.0,
            p.months,
            MONTHS.len(),
            p.settled,
            GOVERNED_DEADLINE.as_secs(),
            p.rows_per_sec(),
            p.rows_per_sec() / self.settle.rows_per_sec().max(f64::MIN_POSITIVE),
            self.settle.rows_per_sec(),
            p.load.p99_ms,
            self.p99_ratio(p)
        );
        r
    }

    /// Rows of the report's targets table.
    pub(crate) fn targets(&self) -> String {
        let mut r = String::new();
        let ratio = self.p99_ratio(&self.settle);
        let _ = writeln!(
            r,
            "| load p99 during `settle` (defaults) ≤ 2 × idle p99 | {ratio:.2} ({:.1} ms vs {:.1} ms) | {} |",
            self.settle.load.p99_ms,
            self.idle.load.p99_ms,
            verdict(ratio <= 2.0)
        );
        let _ = writeln!(
            r,
            "| load max during `settle` (defaults) ≤ 250 ms | {:.1} ms | {} |",
            self.settle.load.max_ms,
            verdict(self.settle.load.max_ms <= 250.0)
        );
        match &self.throttled {
            Ok(p) => {
                let ratio = self.p99_ratio(p);
                let _ = writeln!(
                    r,
                    "| load p99 during `settle` throttled to a quarter ≤ 1.2 × idle p99 | {ratio:.2} ({:.1} ms) | {} |",
                    p.load.p99_ms,
                    verdict(ratio <= 1.2)
                );
            }
            Err(_) => {
                let _ = writeln!(
                    r,
                    "| load p99 during `settle` throttled to a quarter ≤ 1.2 × idle p99 | not available | not measured |"
                );
            }
        }
        for (of, target, text) in [
            (
                Of::Settle,
                2.0,
                "load p99 during `settle` (defaults) ≤ 2 × its control's p99",
            ),
            (
                Of::Throttled,
                1.5,
                "load p99 during `settle` throttled to a quarter ≤ 1.5 × its control's p99",
            ),
        ] {
            let _ = match self.control_ratio(of) {
                Some(ratio) => writeln!(r, "| {text} | {ratio:.2} | {} |", verdict(ratio <= target)),
                None => writeln!(r, "| {text} | not available | not measured |"),
            };
        }
        let text = "load p99 during `settle` under `max_commit_latency` = 1.5 × idle p99 ≤ 1.6 × idle p99";
        let _ = match &self.governed {
            Ok(p) => {
                let ratio = self.p99_ratio(p);
                writeln!(
                    r,
                    "| {text} | {ratio:.2} ({:.1} ms), at {:.0} rows/s ({:.2} of the defaults') | {} |",
                    p.load.p99_ms,
                    p.rows_per_sec(),
                    p.rows_per_sec() / self.settle.rows_per_sec().max(f64::MIN_POSITIVE),
                    verdict(ratio <= 1.6)
                )
            }
            Err(_) => writeln!(r, "| {text} | not available | not measured |"),
        };
        let ratio = self.wal_ratio();
        let _ = writeln!(
            r,
            "| settle WAL per row ≤ 1.1 × the single statement's | {ratio:.2} ({:.0} vs {:.0} bytes) | {} |",
            self.wal_settle.per_row(),
            self.wal_statement.per_row(),
            verdict(ratio <= 1.1)
        );
        r
    }
}
