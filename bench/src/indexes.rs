//! What fine-settler's four partial indexes on libraryd's `loans` cost libraryd's own writes, and what each buys
//! fine-settler. On copies of the settlement template, with all four, with none, and with each left out in turn:
//! libraryd's checkouts (`insert` of a new loan) and returns (`update loans set returned_on` of a loan still out),
//! one session, each statement its own transaction, timed one by one and their WAL counted; then, on the same
//! copy, the work the indexes serve — the month's settlement and its rerun (which asks for late rows), an accrual
//! day and its rerun (the late-row question of an accrual day) — and the questions asked between runs (the
//! `questions` module: the daemon's idle tick and re-check, `verify`).

use std::{fmt::Write as _, time::Instant};

use sqlx::PgPool;

use crate::{binary, Bench, Error, MONTH_END};

mod questions;

use questions::Questions;

/// One of fine-settler's indexes on `loans`: its name, what reads it, and the decision the section's figures
/// support (kept, or dropped by a migration), with its reason.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Index {
    pub name: &'static str,
    pub readers: &'static str,
    pub keep: bool,
    pub decision: &'static str,
    /// For an index a migration dropped: its definition as the migration that built it had it. The section
    /// builds it again on its template, so that each run still measures what dropping it saves.
    pub built_as: Option<&'static str>,
}

/// fine-settler's indexes on `loans`, in the order of their migrations.
pub(crate) const INDEXES: [Index; 4] = [
    Index {
        name: "loans_unsettled_returned_idx",
        readers: "settlement's batch walk (the shard's unsettled returned loans by id); `verify`'s not-finite \
                  check (its returned branch)",
        keep: true,
        decision: "keep: without it every batch walks the primary key through the settled history, so `settle` \
                   slows as the table ages; it costs libraryd WAL on returns (an entry in an id-ordered index: a \
                   page image after each checkpoint), not time",
        built_as: None,
    },
    Index {
        name: "loans_unsettled_by_return_idx",
        readers: "the tick's status statement (at every tick, each settled month of the window probed for late \
                  rows), settlement's month probe and its rerun",
        keep: true,
        decision: "keep: the daemon asks at every tick of every replica whether a settled month has late rows, \
                   and once the table has been analysed after the settlement that is one descent of this index \
                   instead of a walk of every unsettled loan (until then the planner walks the id-ordered index \
                   whichever is kept); it costs a return one small WAL record (ordered by return date, returns \
                   append to its last page) and no measurable time",
        built_as: None,
    },
    Index {
        name: "loans_open_by_due_idx",
        readers: "`verify`'s not-finite check (its open branch), `accrue`/`backfill`'s question whether a done \
                  day has work (its open branch; the daemon asks it too, rarely: when a claim finds a key a peer \
                  just finished), `calendar close`/`open` queueing the loans of a changed day; no longer the \
                  daemon's re-check (it reads the queue of changed loans)",
        keep: false,
        decision: "dropped (migration 20261203000059): none of the daemon's regular questions reads it any more, and every \
                   checkout paid an entry and about a third more WAL for operator commands (`verify`, a done \
                   day's `accrue`) that take a second or so longer without it, a scan of the table instead of \
                   the open loans",
        built_as: Some("create index loans_open_by_due_idx on loans (due_on, id) where returned_on is null"),
    },
    Index {
        name: "loans_returned_late_idx",
        readers: "`accrue`/`backfill`'s question whether a done day has work (its returned branch), `calendar \
                  close`/`open` queueing; no longer the daemon's re-check, which it was built for (it reads the \
                  queue of changed loans)",
        keep: false,
        decision: "dropped (migration 20261203000060): none of the daemon's regular questions reads it any more, and late \
                   returns and every settlement of a late loan paid an entry (it keeps every late return of \
                   history) for the other branch of the same operator questions, which without it scan the table",
        built_as: Some(
            "create index loans_returned_late_idx on loans (returned_on, id) include (due_on) \
             where returned_on > due_on",
        ),
    },
];

/// The accrual day measured: loans of the generated month still out or returned on or after it.
const DAY: &str = "2026-10-20";

/// Which of the indexes a copy keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kept {
    All,
    None,
    AllBut(usize),
    /// Those the decision keeps ([`Index::keep`]).
    Decided,
}

impl Kept {
    fn sets() -> Vec<Kept> {
        let mut sets = vec![Kept::All, Kept::None];
        sets.extend((0..INDEXES.len()).map(Kept::AllBut));
        let kept = INDEXES.iter().filter(|index| index.keep).count();
        if kept > 0 && kept < INDEXES.len() - 1 {
            sets.push(Kept::Decided);
        }
        sets
    }

    fn dropped(self) -> Vec<&'static str> {
        INDEXES
            .iter()
            .enumerate()
            .filter(|(i, _)| match self {
                Kept::All => false,
                Kept::None => true,
                Kept::AllBut(d) => d == *i,
                Kept::Decided => !INDEXES[*i].keep,
            })
            .map(|(_, index)| index.name)
            .collect()
    }

    fn label(self) -> String {
        match self {
            Kept::All => "all four".into(),
            Kept::None => "none".into(),
            Kept::AllBut(i) => format!("all but `{}`", INDEXES[i].name),
            Kept::Decided => format!("as migrated: {}", names(INDEXES.iter().filter(|i| i.keep))),
        }
    }
}

/// Builds again on a template the indexes migrations dropped ([`Index::built_as`]), then analyses it.
async fn build_retired(pool: &PgPool) -> Result<(), Error> {
    for index in INDEXES.iter() {
        if let Some(definition) = index.built_as {
            sqlx::raw_sql(definition).execute(pool).await?;
        }
    }
    sqlx::raw_sql("vacuum analyze loans").execute(pool).await?;
    pool.close().await;
    Ok(())
}

/// `indexes`' names, quoted, joined with commas and a last "and".
fn names<'a>(indexes: impl Iterator<Item = &'a Index>) -> String {
    let names: Vec<String> = indexes.map(|i| format!("`{}`", i.name)).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.concat(),
    }
}

/// One kind of libraryd write, as timed: statements, their median and p99 in µs, WAL bytes, records and full
/// page images per statement.
#[derive(Debug, Clone, Copy, Default)]
struct Writes {
    n: usize,
    p50_us: f64,
    p99_us: f64,
    wal_per_op: f64,
    records_per_op: f64,
    fpi_per_op: f64,
}

/// The WAL statistics of the server (`pg_stat_wal`), after the session's own were flushed to them.
async fn wal_stats(conn: &mut sqlx::PgConnection) -> Result<(i64, i64), Error> {
    sqlx::query("select pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await?;
    sqlx::query("select pg_stat_clear_snapshot()")
        .execute(&mut *conn)
        .await?;
    Ok(sqlx::query_as("select wal_records, wal_fpi from pg_stat_wal")
        .fetch_one(&mut *conn)
        .await?)
}

/// One copy's figures.
#[derive(Debug, Clone)]
struct Row {
    kept: Kept,
    inserts: Writes,
    returns: Writes,
    /// `returns` that were HOT updates (no index entry written), from `pg_stat_user_tables`.
    hot_share: f64,
    settle_ms: u64,
    settle_rerun_ms: u64,
    accrue_ms: u64,
    accrue_rerun_ms: u64,
    /// The idle tick's and the re-check's statements, and `verify`.
    questions: Questions,
}

/// How the section runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IndexArgs {
    /// Loans of the template.
    pub loans: u64,
    /// Checkouts and returns timed on each copy.
    pub ops: usize,
    /// Years of settled loans (`loans` a year) added for the second round (0: no second round).
    pub history_years: u64,
    /// Runs of `plan` (the idle tick's questions) on each copy.
    pub plan_runs: usize,
    /// Runs of `verify` on each copy.
    pub verify_runs: usize,
}

/// What the section measured.
#[derive(Debug, Clone)]
pub(crate) struct IndexLeg {
    args: IndexArgs,
    rows: Vec<Row>,
    /// The copies of the first round measured again (see [`DISTURBED`]).
    again: Vec<Kept>,
    /// Settled loans of earlier years added to the template for the second round (0: none measured).
    history: u64,
    history_rows: Vec<Row>,
    history_again: Vec<Kept>,
}

/// A copy whose checkouts' or returns' median took more than this many times the round's median of them is
/// measured again on a fresh copy (at most [`REMEASURES`] times): its commits waited on something else — on a
/// shared machine, a busy disk made every commit's flush take 4 ms instead of 0.3.
const DISTURBED: f64 = 3.0;
/// How many times a round measures its disturbed copies again.
const REMEASURES: usize = 2;

/// The median of `values`.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The rows of `rows` whose writes took more than [`DISTURBED`] times the median of them.
fn disturbed(rows: &[Row]) -> Vec<usize> {
    let inserts = median(rows.iter().map(|r| r.inserts.p50_us).collect());
    let returns = median(rows.iter().map(|r| r.returns.p50_us).collect());
    (0..rows.len())
        .filter(|&i| {
            rows[i].inserts.p50_us > DISTURBED * inserts || rows[i].returns.p50_us > DISTURBED * returns
        })
        .collect()
}

/// The settled loans of `years` years before the template's month, `per_year` a year, added to the template
/// (ids after its own, with the triggers on `loans` off, as history the re-check has long read): each returned
/// around its due date — a tenth of them late, by 1 to 20 days — and settled, with no ledger. A real libraryd
/// table holds such years; fine-settler's partial indexes leave most of them out (all but the late returns of
/// `loans_returned_late_idx`), while a plan without them reads them all.
async fn add_history(pool: &PgPool, years: u64, per_year: u64) -> Result<u64, Error> {
    let mut tx = pool.begin().await?;
    sqlx::raw_sql("alter table loans disable trigger user")
        .execute(&mut *tx)
        .await?;
    let added = sqlx::query(
        "insert into loans (id, member_id, book_id, borrowed_on, due_on, returned_on, fine_cents, fine_settled_at)
         select m.top + g, 1 + g % 50000, 1 + g % 200000, d.due_on - 21, d.due_on, d.returned_on,
                case when d.returned_on > d.due_on then 50 * (d.returned_on - d.due_on)::bigint else 0 end,
                (d.returned_on + 40)::timestamptz
         from (select max(id) as top from loans) m
         cross join generate_series(1, $1::bigint) g
         cross join lateral (select date '2026-09-01' - 1 - (g % (365 * $2::bigint))::int as due_on) d0
         cross join lateral (select d0.due_on,
                                    d0.due_on + (case when g % 10 = 0 then 1 + (g / 10) % 20
                                                      else -((g / 10) % 7) end)::int as returned_on) d",
    )
    .bind(i64::try_from(years * per_year)?)
    .bind(i64::try_from(years)?)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    sqlx::raw_sql("alter table loans enable trigger user")
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    sqlx::raw_sql("vacuum analyze loans").execute(pool).await?;
    Ok(added)
}

impl Bench {
    /// The section on `args.loans` generated loans, `args.ops` checkouts and returns per copy; then again on the
    /// template with `args.history_years` years of settled loans added (`loans` a year), unless that is 0.
    pub(crate) async fn indexes(&self, args: IndexArgs) -> Result<IndexLeg, Error> {
        let IndexArgs {
            loans, history_years, ..
        } = args;
        let template = self.template(loans).await?;
        build_retired(&self.pool(&template, 1).await?).await?;
        let (rows, again) = self.index_round(&template, args, "indexes").await?;
        let mut history = 0;
        let (mut history_rows, mut history_again) = (Vec::new(), Vec::new());
        if history_years > 0 {
            eprintln!("   indexes: adding {history_years} years of settled loans");
            let pool = self.pool(&template, 1).await?;
            history = add_history(&pool, history_years, loans).await?;
            pool.close().await;
            (history_rows, history_again) =
                self.index_round(&template, args, "indexes, with history").await?;
        }
        self.drop_db(&template).await?;
        Ok(IndexLeg {
            args,
            rows,
            again,
            history,
            history_rows,
            history_again,
        })
    }

    /// A copy of `template` per set of indexes, measured; then the disturbed ones again. Their rows, and the sets
    /// measured again.
    async fn index_round(
        &self,
        template: &str,
        args: IndexArgs,
        round: &str,
    ) -> Result<(Vec<Row>, Vec<Kept>), Error> {
        let mut rows = Vec::new();
        for kept in Kept::sets() {
            eprintln!("   {round}: {}", kept.label());
            rows.push(self.index_copy(template, kept, args).await?);
        }
        let mut again = Vec::new();
        for _ in 0..REMEASURES {
            for i in disturbed(&rows) {
                let kept = rows[i].kept;
                eprintln!("   {round}: {}, again (its writes were disturbed)", kept.label());
                rows[i] = self.index_copy(template, kept, args).await?;
                if !again.contains(&kept) {
                    again.push(kept);
                }
            }
        }
        Ok((rows, again))
    }

    /// One copy of `template` keeping the indexes `kept` names, measured.
    async fn index_copy(&self, template: &str, kept: Kept, args: IndexArgs) -> Result<Row, Error> {
        let ops = args.ops;
        let db = self.copy(template, "fsb_indexes").await?;
        let pool = self.pool(&db, 1).await?;
        for name in kept.dropped() {
            sqlx::raw_sql(&format!("drop index {name}"))
                .execute(&pool)
                .await?;
        }
        // Each figure is taken in a known state of the table — right after the runs before it, or, for the
        // questions, also after `vacuum analyze` — not in whichever one autovacuum left it.
        sqlx::raw_sql("alter table loans set (autovacuum_enabled = off)")
            .execute(&pool)
            .await?;
        sqlx::raw_sql("checkpoint").execute(&pool).await?;
        // Checkouts take ids after every loan; returns pick among the loans still out (none of the history's).
        let first: i64 = sqlx::query_scalar("select max(id) + 1 from loans")
            .fetch_one(&pool)
            .await?;
        let inserts = checkouts(&pool, ops, first).await?;
        let (returns, hot_share) = returns(&pool, ops, first).await?;
        pool.close().await;
        let settle_ms = self
            .command(&db, &["settle", "--business-date", MONTH_END], "settled")
            .await?;
        let settle_rerun_ms = self
            .command(&db, &["settle", "--business-date", MONTH_END], "skipped")
            .await?;
        let accrue_ms = self.command(&db, &["accrue", "--date", DAY], "settled").await?;
        let accrue_rerun_ms = self.command(&db, &["accrue", "--date", DAY], "skipped").await?;
        let questions = self.questions(&db, args.plan_runs, args.verify_runs).await?;
        self.drop_db(&db).await?;
        Ok(Row {
            kept,
            inserts,
            returns,
            hot_share,
            settle_ms,
            settle_rerun_ms,
            accrue_ms,
            accrue_rerun_ms,
            questions,
        })
    }

    /// `fine-settler ARGS` on `db`: its report's `elapsed_ms`, once its outcome is `outcome`.
    async fn command(&self, db: &str, args: &[&str], outcome: &str) -> Result<u64, Error> {
        let out = std::process::Command::new(binary()?)
            .args(args)
            .env("DATABASE_URL", format!("{}/{db}", self.server))
            .env("FINE_SETTLER__LOG__LEVEL", "warn")
            .output()?;
        let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let report: serde_json::Value = serde_json::from_str(&line)
            .map_err(|e| format!("fine-settler {}: {e}: {line:?}", args.join(" ")))?;
        if report["outcome"].as_str() != Some(outcome) {
            return Err(format!("fine-settler {}: expected {outcome}, got {line}", args.join(" ")).into());
        }
        Ok(report["elapsed_ms"].as_u64().unwrap_or(0))
    }
}

/// The WAL insert position, in bytes.
async fn wal(conn: &mut sqlx::PgConnection) -> Result<i64, Error> {
    Ok(
        sqlx::query_scalar("select pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint")
            .fetch_one(conn)
            .await?,
    )
}

/// Times `ops` statements, each its own transaction, `statement(i)` binding the i-th's values.
async fn timed<F>(pool: &PgPool, ops: usize, statement: F) -> Result<Writes, Error>
where
    F: Fn(usize) -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>,
{
    let mut conn = pool.acquire().await?;
    let stats_before = wal_stats(&mut conn).await?;
    let before = wal(&mut conn).await?;
    let mut us = Vec::with_capacity(ops);
    for i in 0..ops {
        let started = Instant::now();
        let done = statement(i).execute(&mut *conn).await?;
        us.push(started.elapsed().as_secs_f64() * 1e6);
        if done.rows_affected() != 1 {
            return Err(format!("a libraryd write touched {} rows", done.rows_affected()).into());
        }
    }
    let after = wal(&mut conn).await?;
    let stats_after = wal_stats(&mut conn).await?;
    drop(conn);
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() as f64 * q).ceil() as usize).clamp(1, us.len()) - 1];
    Ok(Writes {
        n: ops,
        p50_us: at(0.5),
        p99_us: at(0.99),
        wal_per_op: (after - before) as f64 / ops as f64,
        // Less the two statements that read the position (no WAL of their own).
        records_per_op: (stats_after.0 - stats_before.0) as f64 / ops as f64,
        fpi_per_op: (stats_after.1 - stats_before.1) as f64 / ops as f64,
    })
}

/// `ops` checkouts: new loans, due in three weeks, ids from `first`.
async fn checkouts(pool: &PgPool, ops: usize, first: i64) -> Result<Writes, Error> {
    timed(pool, ops, move |i| {
        let id = first + i as i64;
        sqlx::query(
            "insert into loans (id, member_id, book_id, borrowed_on, due_on)
             values ($1, $2, $3, date '2026-11-20', date '2026-12-11')",
        )
        .bind(id)
        .bind(id % 50_000)
        .bind(id % 200_000)
    })
    .await
}

/// `ops` returns of the template's loans still out (ids below `below`, spread over them), on 15 November, and the
/// share of them that were HOT updates.
async fn returns(pool: &PgPool, ops: usize, below: i64) -> Result<(Writes, f64), Error> {
    let ids: Vec<i64> =
        sqlx::query_scalar("select id from loans where returned_on is null and id < $1 order by id")
            .bind(below)
            .fetch_all(pool)
            .await?;
    if ids.len() < ops {
        return Err(format!("{} loans still out, fewer than {ops}", ids.len()).into());
    }
    let step = ids.len() / ops;
    let picked: Vec<i64> = (0..ops).map(|i| ids[i * step]).collect();
    let hot = || async {
        let mut conn = pool.acquire().await?;
        sqlx::query("select pg_stat_force_next_flush()")
            .execute(&mut *conn)
            .await?;
        sqlx::query("select pg_stat_clear_snapshot()")
            .execute(&mut *conn)
            .await?;
        let hot: i64 =
            sqlx::query_scalar("select n_tup_hot_upd from pg_stat_user_tables where relname = 'loans'")
                .fetch_one(&mut *conn)
                .await?;
        Ok::<i64, Error>(hot)
    };
    let hot_before = hot().await?;
    let writes = timed(pool, ops, move |i| {
        sqlx::query("update loans set returned_on = date '2026-11-15' where id = $1 and returned_on is null")
            .bind(picked[i])
    })
    .await?;
    let hot_after = hot().await?;
    Ok((writes, (hot_after - hot_before) as f64 / ops as f64))
}

/// The section's heading, as [`IndexLeg::report`] writes it.
const HEADING: &str = "## fine-settler's indexes on libraryd's loans";
/// The report header line that says when the section was measured.
const MEASURED: &str = "- indexes measured:";

/// The header line for a section measured at `date`, commit `commit`.
pub(crate) fn measured(date: &str, commit: &str) -> String {
    format!("{MEASURED} {date} at commit {commit}")
}

/// `existing` with its indexes section replaced by `section` and its header line by `measured`.
pub(crate) fn merge(existing: &str, section: &str, measured: &str) -> String {
    crate::accrual::merge_section(existing, (HEADING, section), (MEASURED, measured))
}

impl IndexLeg {
    pub(crate) fn report(&self) -> String {
        let mut r = String::new();
        let _ = writeln!(r, "{HEADING}\n");
        let _ = writeln!(
            r,
            "fine-settler added four partial indexes to libraryd's `loans`; the figures below decided which two stay \
             (the decision, at the end), and migrations drop the other two, which the section builds again on its \
             template as they were built, to keep measuring what dropping them saves. Each row is a fresh copy of \
             the {}-loan template keeping the indexes it names (the others dropped), on which, in order: libraryd's checkouts \
             (`insert` of a new loan, due in three weeks) and returns (`update loans set returned_on` of a loan \
             still out), {} each, one session, each statement its own transaction (committed with \
             `synchronous_commit = on`), timed one by one, with the WAL they wrote (`pg_current_wal_insert_lsn()` \
             before and after; records and full-page images from `pg_stat_wal` — the copy starts after a \
             checkpoint, so the first change to each page writes its image, as libraryd's writes do after each \
             checkpoint) and the share of returns that were HOT updates (`pg_stat_user_tables`); then \
             `settle` of the month ending {MONTH_END} and its rerun, `accrue` of {DAY} and its rerun (a rerun \
             finds the key done and asks whether late rows re-open it), each the report's `elapsed_ms`. \
             The template's own indexes besides these: the primary key.\n",
            self.args.loans,
            self.rows.first().map_or(0, |r| r.inserts.n)
        );
        table(&mut r, &self.rows);
        measured_again(&mut r, &self.again);
        let _ = writeln!(
            r,
            "\nThen, on the same copy, the questions asked between runs, with the months ending {} settled too \
             (so that every month end of the window of a tick at {} is done): `fine-settler plan --at {}` (the \
             accrual enabled) {} times — the idle tick's status statement, which probes each of the three settled \
             months for late rows, and the accrual re-check, which prices up to 10,000 queued changed loans (the \
             template's and the copy's own) over the window's 7 days — then, after `vacuum analyze loans`, `plan` \
             as many times again and `verify --business-date {MONTH_END}` {} times. Autovacuum is off on the \
             copy's `loans`, so the first `plan`s see the table as the runs left it until autovacuum comes by \
             (the settled months' dead entries in the indexes, the planner's statistics from before the \
             settlements). Each cell is the median of the runs after the first, the first in brackets (each run a \
             new process, so each statement is planned anew; the daemon's generic plans were found to be the \
             same); a statement's time is the server's (`pg_stat_statements`, reset before each run), `verify`'s \
             the command's wall clock, and its not-finite check the one of its statements that can read these \
             indexes (its others read the month by `returned_on`, which none of them holds whole):\n",
            questions::EARLIER_MONTH_ENDS.join(" and "),
            questions::PLAN_AT,
            questions::PLAN_AT,
            self.args.plan_runs,
            self.args.verify_runs
        );
        questions::table(
            &mut r,
            self.rows.iter().map(|row| (row.kept.label(), &row.questions)),
        );
        let _ = writeln!(r, "\nWhat reads each index:\n");
        for index in INDEXES {
            let _ = writeln!(r, "- `{}`: {}.", index.name, index.readers);
        }
        if let (Some(all), Some(none)) = (
            self.rows.iter().find(|r| r.kept == Kept::All),
            self.rows.iter().find(|r| r.kept == Kept::None),
        ) {
            let _ = writeln!(
                r,
                "\nAll four against none: a checkout {:.2}× the time (p50) and {:.2}× the WAL; a return {:.2}× the \
                 time and {:.2}× the WAL.",
                all.inserts.p50_us / none.inserts.p50_us,
                all.inserts.wal_per_op / none.inserts.wal_per_op,
                all.returns.p50_us / none.returns.p50_us,
                all.returns.wal_per_op / none.returns.wal_per_op
            );
        }
        let decided_on = if self.history_rows.is_empty() {
            &self.rows
        } else {
            self.history_report(&mut r);
            &self.history_rows
        };
        let _ = writeln!(
            r,
            "\nEach index left out, against all four{} — what libraryd's writes save, and what fine-settler's \
             questions take without it:\n",
            if self.history_rows.is_empty() {
                ""
            } else {
                ", with the history"
            }
        );
        left_out(&mut r, decided_on);
        let _ = writeln!(
            r,
            "\nThe decision (each index pays for itself or goes; a drop is a migration of its own):\n"
        );
        for index in INDEXES {
            let _ = writeln!(r, "- `{}`: {}.", index.name, index.decision);
        }
        r
    }

    /// The second round: the same copies and measurements on the template with years of settled loans.
    fn history_report(&self, r: &mut String) {
        let _ = writeln!(
            r,
            "\n### With {} years of history\n\nThe same, on the template with {} settled loans of the {} years \
             before its month added ({} a year: returned around their due dates, a tenth of them late by 1 to 20 \
             days; settled; no ledger), {} loans in all — the history a real libraryd table holds, which the \
             partial indexes leave out (but for the late returns, in `loans_returned_late_idx`):\n",
            self.args.history_years,
            self.history,
            self.args.history_years,
            self.args.loans,
            self.args.loans + self.history
        );
        table(r, &self.history_rows);
        measured_again(r, &self.history_again);
        let _ = writeln!(r, "\nThe questions asked between runs, measured as above:\n");
        questions::table(
            r,
            self.history_rows
                .iter()
                .map(|row| (row.kept.label(), &row.questions)),
        );
    }
}

/// The note on the copies measured again, if any.
fn measured_again(r: &mut String, again: &[Kept]) {
    if again.is_empty() {
        return;
    }
    let labels: Vec<String> = again.iter().map(|k| k.label()).collect();
    let _ = writeln!(
        r,
        "\nMeasured again on a fresh copy, their first writes' median over {DISTURBED}× the round's (commits that \
         waited on the shared machine's disk): {}.",
        labels.join("; ")
    );
}

/// One line per index of `rows` left out, against the copy with all four.
fn left_out(r: &mut String, rows: &[Row]) {
    let Some(all) = rows.iter().find(|r| r.kept == Kept::All) else {
        return;
    };
    let (qa, ms) = (&all.questions, questions::ms);
    for row in rows {
        let without = match row.kept {
            Kept::AllBut(i) => format!("without `{}`", INDEXES[i].name),
            Kept::Decided => format!(
                "without {} (the decision)",
                names(INDEXES.iter().filter(|i| !i.keep))
            ),
            Kept::All | Kept::None => continue,
        };
        let q = &row.questions;
        let _ = writeln!(
            r,
            "- {without}: a checkout writes {:.0} B of WAL against {:.0} B, a return {:.0} B against {:.0} B \
             ({:.2} page images against {:.2}); `settle` {} ms against {}, its rerun {} against {}, `accrue` {} \
             against {}, its rerun {} against {}; the idle tick's status statement {} against {} right after the \
             runs and {} against {} vacuumed, the re-check {} against {}, `verify` {} against {} (its not-finite \
             check {} against {}).",
            row.inserts.wal_per_op,
            all.inserts.wal_per_op,
            row.returns.wal_per_op,
            all.returns.wal_per_op,
            row.returns.fpi_per_op,
            all.returns.fpi_per_op,
            row.settle_ms,
            all.settle_ms,
            row.settle_rerun_ms,
            all.settle_rerun_ms,
            row.accrue_ms,
            all.accrue_ms,
            row.accrue_rerun_ms,
            all.accrue_rerun_ms,
            ms(q.status_unvacuumed.median),
            ms(qa.status_unvacuumed.median),
            ms(q.status.median),
            ms(qa.status.median),
            ms(q.recheck.median),
            ms(qa.recheck.median),
            ms(q.verify.median),
            ms(qa.verify.median),
            ms(q.not_finite.median),
            ms(qa.not_finite.median)
        );
    }
}

/// The figures of `rows`, one table row each.
fn table(r: &mut String, rows: &[Row]) {
    let _ = writeln!(
        r,
        "| indexes kept | checkout p50 | checkout p99 | checkout WAL (records, images) | return p50 | return p99 | \
         return WAL (records, images) | returns HOT | settle | settle rerun | accrue | accrue rerun |"
    );
    let _ = writeln!(
        r,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for row in rows {
        let _ = writeln!(
            r,
            "| {} | {:.0} µs | {:.0} µs | {:.0} B ({:.2}, {:.2}) | {:.0} µs | {:.0} µs | {:.0} B ({:.2}, {:.2}) | {:.0} % | {} ms | {} ms | {} ms | {} ms |",
            row.kept.label(),
            row.inserts.p50_us,
            row.inserts.p99_us,
            row.inserts.wal_per_op,
            row.inserts.records_per_op,
            row.inserts.fpi_per_op,
            row.returns.p50_us,
            row.returns.p99_us,
            row.returns.wal_per_op,
            row.returns.records_per_op,
            row.returns.fpi_per_op,
            row.hot_share * 100.0,
            row.settle_ms,
            row.settle_rerun_ms,
            row.accrue_ms,
            row.accrue_rerun_ms
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(checkout_us: f64, return_us: f64) -> Row {
        let writes = |p50_us| Writes {
            p50_us,
            ..Writes::default()
        };
        Row {
            kept: Kept::All,
            inserts: writes(checkout_us),
            returns: writes(return_us),
            hot_share: 0.0,
            settle_ms: 0,
            settle_rerun_ms: 0,
            accrue_ms: 0,
            accrue_rerun_ms: 0,
            questions: Questions::default(),
        }
    }

    #[test]
    fn a_copy_whose_commits_waited_is_measured_again() {
        let rows = [
            row(261.0, 613.0),
            row(3981.0, 719.0),
            row(286.0, 3995.0),
            row(182.0, 287.0),
            row(353.0, 404.0),
        ];
        assert_eq!(disturbed(&rows), vec![1, 2]);
        assert!(disturbed(&rows[3..]).is_empty());
    }
}
