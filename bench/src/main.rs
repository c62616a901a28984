//! `fine-settler-bench`: the settlement benchmark. On a PostgreSQL server of its own choosing (`DATABASE_URL`,
//! normally the private bench cluster started by `scripts/bench.sh`) it generates loans into a template
//! database, then measures on fresh identical copies: what PostgreSQL itself reaches with one set-based update
//! (and with two concurrent sessions), `fine-settler settle` with 1 and 2 shards, a plain and a forced rerun,
//! the statements of an idle daemon tick, the process's peak RSS, a batch-size sweep and, optionally, scaling
//! and scheduler drift; with `--pgbouncer` also `settle` through PgBouncer in transaction and in session mode
//! beside a direct one, each bouncer started and stopped by that script; with `--pgbench` what settlement costs a
//! libraryd-like load beside it, and the WAL it writes per row (the `impact` module); and the accrual section
//! (the `accrual` module: one accrual day against one set-based statement, before and after canonical amounts,
//! and the re-check), which `--accrual-only --merge-into` measures on its own into an existing report. It prints a
//! Markdown report and writes it to `--out`.
//!
//! It runs the `fine-settler` binary found beside its own executable (both are built into the workspace's
//! `target/`), which also generates the loans (`fine-settler demo-data`); it does not link the product library.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use accrual::AccrualArgs;
use clap::Parser;
use impact::ImpactArgs;
use indexes::IndexArgs;
use sqlx::{
    postgres::{PgConnectOptions, PgPoolOptions},
    Connection, PgConnection, PgPool,
};

mod accrual;
mod citus;
mod impact;
mod indexes;
mod rules;

/// The month the generated loans cluster around (`fine-settler demo-data --month`), and its last day.
const MONTH: &str = "2026-10";
const MONTH_END: &str = "2026-10-31";

/// The practical limit of a settlement: one set-based update of the month's loans (a part of them, `id % $2 =
/// $3`) computing each fine as `settle` does — the loan's policy version from the database and its chargeable
/// days (`fine_settler_policy_of`, `fine_settler_policy_fine`) — so that the ratio compares like with like.
const LIMIT_SQL: &str = "update loans l
     set fine_cents = (select f.fine_cents
                       from fine_settler_policy_of(l.fine_class, l.due_on) p
                       cross join lateral fine_settler_policy_fine(l.due_on, l.returned_on, p.daily_rate_cents,
                                                                   p.grace_days, p.cap_cents,
                                                                   p.charge_closed_days) f),
         fine_settled_at = now()
     where l.returned_on between date_trunc('month', $1::date) and $1::date
       and l.fine_settled_at is null and isfinite(l.due_on) and l.id % $2 = $3";

#[derive(Debug, Parser)]
#[command(name = "fine-settler-bench")]
struct Args {
    /// Loans to generate.
    #[arg(long, default_value_t = 1_000_000)]
    loans: u64,
    /// Batch sizes to sweep (the first run of each on a fresh copy).
    #[arg(long, value_delimiter = ',', default_value = "1000,2000,5000,10000,20000")]
    sweep: Vec<u32>,
    /// Batch size for the main settle measurements (the configuration default).
    #[arg(long, default_value_t = 10000)]
    batch_size: u32,
    /// Also measure 100k, 4M and 10M loans, and 4 shards.
    #[arg(long)]
    scaling: bool,
    /// Also run `drift` for 1,000 fixed-rate ticks (about 200 s).
    #[arg(long)]
    drift: bool,
    /// `scripts/pgbouncer.sh`: measure `settle` through PgBouncer in transaction and in session mode beside a
    /// direct one, each behind a PgBouncer this script starts (`start bench MODE`) and stops. The server must be
    /// the script's `bench` cluster.
    #[arg(long)]
    pgbouncer: Option<PathBuf>,
    /// Rounds of the PgBouncer leg (each: direct, transaction, session); the report takes each way's median.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pooler_rounds: u32,
    /// `pgbench`: measure the impact of settlement on a libraryd-like load it drives beside each phase (the
    /// load alone, `settle`, the single statement, `settle` throttled to a quarter of its rate, `settle` under a
    /// commit latency budget, and each `settle` phase's control: a plain writer of its WAL rate).
    #[arg(long)]
    pgbench: Option<PathBuf>,
    /// The load's rate, transactions per second (`pgbench -R`).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..))]
    load_rate: u32,
    /// The load's sessions (`pgbench -c`).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    load_clients: u32,
    /// Seconds the idle phase (the load alone) lasts: long enough that its p99 — the yardstick of every other
    /// phase, and the latency-keyed phase's budget — includes the server's own slow moments, as the longer
    /// phases' do (over 10 s it rests on the 30 slowest of 3,000 transactions).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    idle_secs: u64,
    /// Seconds the load runs before each phase.
    #[arg(long, default_value_t = 2)]
    warmup_secs: u64,
    /// Seconds the load runs after each phase, so that what was scheduled in it finishes.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    cooldown_secs: u64,
    /// Where to write the Markdown report (stdout always gets it).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Leave out the accrual section.
    #[arg(long, conflicts_with = "accrual_only")]
    no_accrual: bool,
    /// Measure the accrual section alone (no settlement template, no other section).
    #[arg(long)]
    accrual_only: bool,
    /// With `--accrual-only`, `--rules-only`, `--indexes-only`, `--impact-only` or `--citus-only`: put the section into this report in place of its own, keeping
    /// every other section, and say in its header which sections were measured when.
    #[arg(long)]
    merge_into: Option<PathBuf>,
    /// Leave out the fine rules section.
    #[arg(long, conflicts_with = "rules_only")]
    no_rules: bool,
    /// Measure the fine rules section alone (settlement and an accrual day under versioned policies, item
    /// classes and closed days, against one statement each; a loan's cost by the length of its overdue span).
    #[arg(long, conflicts_with = "accrual_only")]
    rules_only: bool,
    /// Loans of the fine rules section.
    #[arg(long, default_value_t = 1_000_000)]
    rules_loans: u64,
    /// Leave out the section on fine-settler's indexes on `loans`.
    #[arg(long, conflicts_with = "indexes_only")]
    no_indexes: bool,
    /// Measure the section on fine-settler's indexes alone (what they cost libraryd's checkouts and returns,
    /// with all four, none and each left out; what each buys settlement and accrual).
    #[arg(long, conflicts_with_all = ["accrual_only", "rules_only"])]
    indexes_only: bool,
    /// Measure the Citus section alone on the coordinator at this URL (`scripts/bench.sh --citus` starts the
    /// cluster of `scripts/citus.sh` and passes its URL): the month's settlement by `settle` (1 and 2 replicas)
    /// against the same computation as one distributed update.
    #[arg(long, value_name = "URL", conflicts_with_all = ["accrual_only", "rules_only", "indexes_only"])]
    citus_only: Option<String>,
    /// Loans of the Citus section.
    #[arg(long, default_value_t = 1_000_000)]
    citus_loans: u64,
    /// Rounds of the Citus section (each way once a round, the median reported).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    citus_rounds: u32,
    /// Measure the impact section alone (needs `--pgbench`; a template of `--loans` loans), its rows of the
    /// targets table with it.
    #[arg(long, conflicts_with_all = ["accrual_only", "rules_only", "indexes_only"], requires = "pgbench")]
    impact_only: bool,
    /// Loans of the indexes section's template.
    #[arg(long, default_value_t = 1_000_000)]
    index_loans: u64,
    /// Years of settled loans (`--index-loans` a year) added to the indexes section's template for its second
    /// round (0: no second round).
    #[arg(long, default_value_t = 4)]
    index_history_years: u64,
    /// Checkouts and returns timed on each copy of the indexes section.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(1..))]
    index_ops: u64,
    /// Runs of `plan` (the idle tick's status statement and the re-check) on each copy of the indexes section;
    /// the report gives the first and the median of the others.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=1000))]
    index_plan_runs: u64,
    /// Runs of `verify` on each copy of the indexes section.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
    index_verify_runs: u64,
    /// Rounds of the fine rules section (each way on a fresh copy in each); the report takes the medians.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    rules_rounds: u32,
    /// Loans of the accrual day's template (also those of the back-dated returns).
    #[arg(long, default_value_t = 1_000_000)]
    accrual_loans: u64,
    /// Rounds of the accrual day (each way on a fresh copy in each); the report takes the medians.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    accrual_rounds: u32,
    /// Returns back-dated before charged days, for a replica to correct by itself.
    #[arg(long, default_value_t = 10_000)]
    recheck_returns: u64,
    /// Sizes (open overdue loans, a fifth past the cap) at which the re-check's cost is measured.
    #[arg(long, value_delimiter = ',', default_value = "1000000,5000000")]
    recheck_loans: Vec<u64>,
    /// Changed loans queued for the re-check that must find them all.
    #[arg(long, default_value_t = 1_000)]
    recheck_changed: u64,
    /// Seconds each replica of the accrual section ticks (every 200 ms).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    tick_secs: u64,
    /// The `fine-settler` binary of the ledger before canonical amounts (commit 71619a5), measured beside the
    /// current one on the same accrual day.
    #[arg(long)]
    before_binary: Option<PathBuf>,
}

impl Args {
    /// How the impact section runs, when there is a `pgbench` to drive the load.
    fn impact(&self) -> Option<ImpactArgs> {
        Some(ImpactArgs {
            pgbench: self.pgbench.clone()?,
            rate: self.load_rate,
            clients: self.load_clients,
            idle: Duration::from_secs(self.idle_secs),
            warmup: Duration::from_secs(self.warmup_secs),
            cooldown: Duration::from_secs(self.cooldown_secs),
        })
    }

    fn indexes(&self) -> IndexArgs {
        IndexArgs {
            loans: self.index_loans,
            ops: self.index_ops as usize,
            history_years: self.index_history_years,
            plan_runs: self.index_plan_runs as usize,
            verify_runs: self.index_verify_runs as usize,
        }
    }

    fn accrual(&self) -> AccrualArgs {
        AccrualArgs {
            loans: self.accrual_loans,
            rounds: self.accrual_rounds,
            batch: self.batch_size,
            returns: self.recheck_returns,
            open_sizes: self.recheck_loans.clone(),
            changed: self.recheck_changed,
            tick_secs: self.tick_secs,
            before: self.before_binary.clone(),
        }
    }
}

type Error = Box<dyn std::error::Error + Send + Sync>;

fn server_url() -> Result<String, Error> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL to the benchmark server")?;
    let (base, _) = url.rsplit_once('/').ok_or("DATABASE_URL has no database path")?;
    Ok(base.to_string())
}

fn binary() -> Result<PathBuf, Error> {
    Ok(std::env::current_exe()?.with_file_name("fine-settler"))
}

struct Bench {
    server: String,
    admin: PgPool,
}

/// How `settle` reaches the server: a URL without its database, and the `database.pooler` to set.
#[derive(Debug, Clone)]
struct Via {
    server: String,
    pooler: &'static str,
}

impl Via {
    fn direct(server: &str) -> Self {
        Via {
            server: server.to_string(),
            pooler: "none",
        }
    }
}

/// A PgBouncer in front of the bench cluster in pool mode `mode`, started by `scripts/pgbouncer.sh start bench
/// MODE` and stopped (`stop bench MODE`) when dropped, whatever happened in between.
#[derive(Debug)]
struct Bouncer {
    script: PathBuf,
    mode: &'static str,
    via: Via,
}

impl Bouncer {
    fn start(script: &Path, mode: &'static str) -> Result<Self, Error> {
        let out = Command::new(script)
            .args(["start", "bench", mode])
            .stderr(Stdio::inherit())
            .output()?;
        if !out.status.success() {
            return Err(format!("{} start bench {mode} failed", script.display()).into());
        }
        let url = String::from_utf8(out.stdout)?.trim().to_string();
        let (server, _) = url
            .rsplit_once('/')
            .ok_or_else(|| format!("{} printed no URL: {url:?}", script.display()))?;
        // From here on, dropping the value stops the bouncer.
        Ok(Bouncer {
            script: script.to_path_buf(),
            mode,
            via: Via {
                server: server.to_string(),
                pooler: mode,
            },
        })
    }

    /// The port of the PostgreSQL server behind the bouncer (asked through it with a simple query and no startup
    /// parameter PgBouncer's defaults refuse).
    async fn server_port(&self) -> Result<i32, Error> {
        let options: PgConnectOptions = format!("{}/postgres", self.via.server).parse()?;
        let mut conn = PgConnection::connect_with(&options.extra_float_digits(None)).await?;
        let port: i32 = sqlx::query_scalar("select inet_server_port()")
            .persistent(false)
            .fetch_one(&mut conn)
            .await?;
        conn.close().await?;
        Ok(port)
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let stopped = Command::new(&self.script)
            .args(["stop", "bench", self.mode])
            .status()
            .is_ok_and(|s| s.success());
        if !stopped {
            eprintln!(
                "warning: `{} stop bench {}` failed; the bouncer may still run",
                self.script.display(),
                self.mode
            );
        }
    }
}

/// One `settle` of the template and the statements the server ran for it (`pg_stat_statements` calls in its
/// database).
#[derive(Debug, Clone, Copy)]
struct Counted {
    settle: Settle,
    statements: i64,
}

/// How `settle` reached the server in the PgBouncer leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    Direct,
    Transaction,
    Session,
}

impl Way {
    const ALL: [Way; 3] = [Way::Direct, Way::Transaction, Way::Session];

    /// PgBouncer's pool mode (and `database.pooler`) for this way, if it goes through one.
    fn mode(self) -> Option<&'static str> {
        match self {
            Way::Direct => None,
            Way::Transaction => Some("transaction"),
            Way::Session => Some("session"),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Way::Direct => "direct (`pooler = \"none\"`)",
            Way::Transaction => "PgBouncer, transaction mode (`pooler = \"transaction\"`)",
            Way::Session => "PgBouncer, session mode (`pooler = \"session\"`)",
        }
    }
}

/// The same settlement three ways, `rounds` times (each round direct, transaction, session, each on a fresh
/// copy of the template): per way, its runs in order.
#[derive(Debug, Clone)]
struct PoolerLeg {
    runs: Vec<(Way, Vec<Counted>)>,
}

impl PoolerLeg {
    /// The median run of `way` by wall time (of an even number, the faster of the middle two).
    fn median(&self, way: Way) -> Counted {
        let mut runs = self
            .runs
            .iter()
            .find(|(w, _)| *w == way)
            .map(|(_, runs)| runs.clone())
            .unwrap_or_default();
        runs.sort_by_key(|c| c.settle.elapsed_ms);
        runs[(runs.len().max(1) - 1) / 2]
    }

    fn rate(&self, way: Way) -> f64 {
        let c = self.median(way);
        per_sec(c.settle.updated, c.settle.elapsed_ms)
    }
}

/// What one `settle` measurement runs: the business date, the shard count (one process per shard, all at once),
/// the batch size, `--force`, and environment settings beyond those (`FINE_SETTLER__…`).
#[derive(Debug, Clone, Copy)]
struct SettleJob<'a> {
    business_date: &'a str,
    shards: i32,
    batch: u32,
    force: bool,
    env: &'a [(&'a str, String)],
}

/// One `settle` process as measured.
#[derive(Debug, Clone, Copy)]
struct Settle {
    scanned: i64,
    updated: i64,
    elapsed_ms: u64,
    peak_rss_kib: u64,
}

impl Bench {
    async fn exec(&self, sql: &str) -> Result<(), Error> {
        sqlx::raw_sql(sql).execute(&self.admin).await?;
        Ok(())
    }

    async fn pool(&self, db: &str, connections: u32) -> Result<PgPool, Error> {
        Ok(PgPoolOptions::new()
            .max_connections(connections)
            .connect(&format!("{}/{db}", self.server))
            .await?)
    }

    /// A template database with `n` loans, migrated, vacuumed and analysed.
    async fn template(&self, n: u64) -> Result<String, Error> {
        let name = format!("fsb_template_{n}");
        self.exec(&format!("drop database if exists {name}")).await?;
        self.exec(&format!("create database {name}")).await?;
        let status = Command::new(binary()?)
            .arg("migrate")
            .env("DATABASE_URL", format!("{}/{name}", self.server))
            .env("FINE_SETTLER__LOG__LEVEL", "warn")
            .stdout(Stdio::null())
            .status()?;
        if !status.success() {
            return Err("migrate failed".into());
        }
        // The deterministic demo loans (seed 42, ids from 1), inserted by the product's own generator.
        let out = Command::new(binary()?)
            .args(["demo-data", "--loans", &n.to_string(), "--seed", "42"])
            .args(["--month", MONTH, "--first-id", "1"])
            .env("DATABASE_URL", format!("{}/{name}", self.server))
            .env("FINE_SETTLER__LOG__LEVEL", "warn")
            .stderr(Stdio::inherit())
            .output()?;
        if !out.status.success() {
            return Err("demo-data failed".into());
        }
        let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        if report["inserted"].as_u64() != Some(n) {
            return Err(format!("demo-data inserted {} of {n} loans", report["inserted"]).into());
        }
        let pool = self.pool(&name, 2).await?;
        sqlx::raw_sql("vacuum analyze loans").execute(&pool).await?;
        pool.close().await;
        Ok(name)
    }

    /// A fresh copy of `template` named `name`, after a checkpoint so that no earlier run's dirty pages are
    /// written during the next measurement.
    async fn copy(&self, template: &str, name: &str) -> Result<String, Error> {
        self.exec(&format!("drop database if exists {name}")).await?;
        // Another session may still be in the template (a worker of the vacuum that followed years of history
        // added): wait for it, for up to 10 minutes, saying once who it is.
        let mut tries = 0;
        loop {
            match self
                .exec(&format!("create database {name} template {template}"))
                .await
            {
                Err(e) if tries < 100 && object_in_use(&*e) => {
                    if tries == 0 {
                        let sessions: Vec<String> = sqlx::query_scalar(
                            "select format('pid %s, %s, %s, %s: %s', pid, backend_type, application_name, state,
                                           left(query, 80))
                             from pg_stat_activity where datname = $1",
                        )
                        .bind(template)
                        .fetch_all(&self.admin)
                        .await?;
                        eprintln!("   waiting for the sessions in {template}: {sessions:?}");
                    }
                    // A session of the benchmark's own left idle in the template (a pool's connection handed
                    // back after its pool was closed) never leaves by itself: ended, as the template is ours.
                    sqlx::query(
                        "select pg_terminate_backend(pid) from pg_stat_activity
                         where datname = $1 and backend_type = 'client backend' and state = 'idle'
                           and pid <> pg_backend_pid()",
                    )
                    .bind(template)
                    .execute(&self.admin)
                    .await?;
                    tries += 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                done => break done?,
            }
        }
        self.exec("checkpoint").await?;
        Ok(name.to_string())
    }

    async fn drop_db(&self, name: &str) -> Result<(), Error> {
        self.exec(&format!("drop database if exists {name} with (force)"))
            .await
    }

    /// The single set-based update of the month (the practical limit), split `sessions` ways by `id % sessions`,
    /// all sessions at once. Returns (rows, seconds).
    async fn limit(&self, db: &str, sessions: i64) -> Result<(u64, f64), Error> {
        self.limit_of(db, MONTH_END, sessions).await
    }

    /// [`Bench::limit`] for the month that ends on `month_end`.
    async fn limit_of(&self, db: &str, month_end: &str, sessions: i64) -> Result<(u64, f64), Error> {
        let pool = self.pool(db, sessions as u32).await?;
        // Warm the connections so that connecting is not timed.
        let mut conns = Vec::new();
        for _ in 0..sessions {
            conns.push(pool.acquire().await?);
        }
        drop(conns);
        let started = Instant::now();
        let mut tasks = Vec::new();
        for part in 0..sessions {
            let pool = pool.clone();
            let month_end = month_end.to_string();
            tasks.push(tokio::spawn(async move {
                sqlx::query(LIMIT_SQL)
                    .bind(month_end.parse::<chrono::NaiveDate>().ok())
                    .bind(sessions)
                    .bind(part)
                    .execute(&pool)
                    .await
                    .map(|r| r.rows_affected())
            }));
        }
        let mut rows = 0;
        for t in tasks {
            rows += t.await??;
        }
        let secs = started.elapsed().as_secs_f64();
        pool.close().await;
        Ok((rows, secs))
    }

    /// `fine-settler settle` for every shard of `shards` at once on `db`; the slowest shard's time.
    async fn settle(&self, db: &str, shards: i32, batch: u32, force: bool) -> Result<Settle, Error> {
        self.settle_via(&Via::direct(&self.server), db, shards, batch, force)
            .await
    }

    /// [`Bench::settle`] through `via`.
    async fn settle_via(
        &self,
        via: &Via,
        db: &str,
        shards: i32,
        batch: u32,
        force: bool,
    ) -> Result<Settle, Error> {
        let job = SettleJob {
            business_date: MONTH_END,
            shards,
            batch,
            force,
            env: &[],
        };
        self.settle_job(via, db, &job).await
    }

    /// `fine-settler settle` as `job` describes, every shard at once, through `via`; the slowest shard's time.
    async fn settle_job(&self, via: &Via, db: &str, job: &SettleJob<'_>) -> Result<Settle, Error> {
        let SettleJob {
            business_date,
            shards,
            batch,
            force,
            env,
        } = *job;
        let mut children = Vec::new();
        for shard in 0..shards {
            let mut cmd = Command::new(binary()?);
            cmd.args([
                "settle",
                "--business-date",
                business_date,
                "--shards",
                &shards.to_string(),
                "--shard",
            ])
            .arg(shard.to_string())
            .env("DATABASE_URL", format!("{}/{db}", via.server))
            .env("FINE_SETTLER__DATABASE__POOLER", via.pooler)
            .env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", batch.to_string())
            .env("FINE_SETTLER__LOG__LEVEL", "warn")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped());
            if force {
                cmd.arg("--force");
            }
            children.push(cmd.spawn()?);
        }
        let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
        let watcher = std::thread::spawn(move || peak_rss(&pids));
        let mut total = Settle {
            scanned: 0,
            updated: 0,
            elapsed_ms: 0,
            peak_rss_kib: 0,
        };
        for child in children {
            let out = child.wait_with_output()?;
            let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
            let report: serde_json::Value = serde_json::from_str(&line)?;
            if !matches!(report["outcome"].as_str(), Some("settled" | "skipped")) {
                return Err(format!("settle failed: {line}").into());
            }
            total.scanned += report["scanned"].as_i64().unwrap_or(0);
            total.updated += report["updated"].as_i64().unwrap_or(0);
            total.elapsed_ms = total.elapsed_ms.max(report["elapsed_ms"].as_u64().unwrap_or(0));
        }
        total.peak_rss_kib = watcher.join().map_err(|_| "rss watcher panicked")?;
        Ok(total)
    }

    /// `settle` (1 shard) of a fresh copy of `template` through `via`, counting the statements of its database.
    async fn settle_counted(&self, via: &Via, template: &str, batch: u32) -> Result<Counted, Error> {
        let db = self.copy(template, "fsb_pooler").await?;
        sqlx::query("select pg_stat_statements_reset()")
            .execute(&self.admin)
            .await?;
        let settle = self.settle_via(via, &db, 1, batch, false).await?;
        let statements: i64 = sqlx::query_scalar(
            "select coalesce(sum(calls), 0)::bigint from pg_stat_statements
             where dbid = (select oid from pg_database where datname = $1)",
        )
        .bind(&db)
        .fetch_one(&self.admin)
        .await?;
        self.drop_db(&db).await?;
        Ok(Counted { settle, statements })
    }

    /// The PgBouncer leg: `rounds` times, `settle` of `template` directly, through PgBouncer in transaction mode
    /// and through PgBouncer in session mode (each bouncer started by `script` for its measurement and stopped
    /// after it, so both modes may share one port).
    async fn pooler_leg(
        &self,
        template: &str,
        batch: u32,
        script: &Path,
        rounds: u32,
    ) -> Result<PoolerLeg, Error> {
        sqlx::raw_sql("create extension if not exists pg_stat_statements")
            .execute(&self.admin)
            .await?;
        let port: i32 = sqlx::query_scalar("select inet_server_port()")
            .fetch_one(&self.admin)
            .await?;
        let mut leg = PoolerLeg {
            runs: Way::ALL.iter().map(|w| (*w, Vec::new())).collect(),
        };
        for round in 1..=rounds {
            for (way, runs) in &mut leg.runs {
                let Some(mode) = way.mode() else {
                    eprintln!("   round {round}/{rounds}: settle, 1 shard, direct");
                    runs.push(
                        self.settle_counted(&Via::direct(&self.server), template, batch)
                            .await?,
                    );
                    continue;
                };
                eprintln!("   round {round}/{rounds}: settle, 1 shard, through PgBouncer in {mode} mode");
                let bouncer = Bouncer::start(script, mode)?;
                let behind = bouncer.server_port().await?;
                if behind != port {
                    return Err(format!(
                        "the {mode}-mode PgBouncer fronts the server on port {behind}, not the benchmark's \
                         ({port}); set FINE_SETTLER_PG_PORT to the benchmark cluster's port"
                    )
                    .into());
                }
                runs.push(self.settle_counted(&bouncer.via, template, batch).await?);
                drop(bouncer);
            }
        }
        let direct = leg.median(Way::Direct).settle.updated;
        for (way, runs) in &leg.runs {
            if let Some(c) = runs.iter().find(|c| c.settle.updated != direct) {
                return Err(format!(
                    "settle {} updated {} rows, directly {direct}",
                    way.label(),
                    c.settle.updated
                )
                .into());
            }
        }
        Ok(leg)
    }

    /// Statements per idle tick, and the RSS of a daemon ticking every 200 ms for 3 s on a settled database.
    async fn idle(&self, db: &str) -> Result<(f64, u64, u64), Error> {
        let url = format!("{}/{db}", self.server);
        let once = Command::new(binary()?)
            .args(["run", "--once"])
            .env("DATABASE_URL", &url)
            .env("FINE_SETTLER__LOG__LEVEL", "warn")
            .stdout(Stdio::null())
            .status()?;
        if !once.success() {
            return Err("run --once failed".into());
        }
        let pool = self.pool(db, 1).await?;
        sqlx::raw_sql("create extension if not exists pg_stat_statements")
            .execute(&pool)
            .await?;
        sqlx::query("select pg_stat_statements_reset()")
            .execute(&pool)
            .await?;
        let daemon = Command::new(binary()?)
            .arg("run")
            .env("DATABASE_URL", &url)
            .env("FINE_SETTLER__SCHEDULE__PERIOD", "200ms")
            .env("FINE_SETTLER__LOG__LEVEL", "fine_settler=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let (rss, hwm) = rss_of(daemon.id());
        Command::new("kill")
            .args(["-TERM", &daemon.id().to_string()])
            .status()?;
        let out = daemon.wait_with_output()?;
        let ticks = String::from_utf8_lossy(&out.stderr)
            .matches("tick: nothing due")
            .count();
        let statements: i64 = sqlx::query_scalar(
            "select coalesce(sum(calls), 0)::bigint from pg_stat_statements
             where dbid = (select oid from pg_database where datname = current_database())
               and query not like '%pg_stat_statements%'",
        )
        .fetch_one(&pool)
        .await?;
        pool.close().await;
        if ticks == 0 {
            return Err("the daemon logged no idle tick".into());
        }
        Ok((statements as f64 / ticks as f64, rss, hwm))
    }
}

/// Whether `e` is PostgreSQL's "object in use" (55006: a database others are connected to).
fn object_in_use(e: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
    e.downcast_ref::<sqlx::Error>()
        .and_then(sqlx::Error::as_database_error)
        .and_then(|d| d.code())
        .is_some_and(|code| code == "55006")
}

/// (VmRSS, VmHWM) of a process, in KiB.
fn rss_of(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The largest VmHWM seen for any of `pids` until they have all exited.
fn peak_rss(pids: &[u32]) -> u64 {
    let mut peak = 0;
    loop {
        let mut alive = false;
        for pid in pids {
            let (rss, hwm) = rss_of(*pid);
            if rss > 0 {
                alive = true;
                peak = peak.max(hwm);
            }
        }
        if !alive {
            return peak;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn per_sec(rows: i64, ms: u64) -> f64 {
    rows as f64 / (ms.max(1) as f64 / 1000.0)
}

fn sh(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "MISSED"
    }
}

/// Everything measured for one loan count.
struct Run {
    loans: u64,
    to_settle: u64,
    limit1: (u64, f64),
    limit2: (u64, f64),
    one: Settle,
    two: Settle,
    rerun_ms: u64,
    forced: Settle,
    forced_after_vacuum: Settle,
}

async fn measure(bench: &Bench, loans: u64, batch: u32) -> Result<(Run, String), Error> {
    eprintln!("== {loans} loans: generating the template");
    let template = bench.template(loans).await?;
    eprintln!("   limit: one set-based update");
    let db = bench.copy(&template, "fsb_limit1").await?;
    let limit1 = bench.limit(&db, 1).await?;
    bench.drop_db(&db).await?;
    eprintln!("   limit: two sessions");
    let db = bench.copy(&template, "fsb_limit2").await?;
    let limit2 = bench.limit(&db, 2).await?;
    bench.drop_db(&db).await?;
    eprintln!("   settle, 2 shards");
    let db = bench.copy(&template, "fsb_two").await?;
    let two = bench.settle(&db, 2, batch, false).await?;
    bench.drop_db(&db).await?;
    eprintln!("   settle, 1 shard; rerun; forced rerun");
    let db = bench.copy(&template, "fsb_one").await?;
    let one = bench.settle(&db, 1, batch, false).await?;
    let rerun = bench.settle(&db, 1, batch, false).await?;
    let forced = bench.settle(&db, 1, batch, true).await?;
    // What autovacuum does soon after a run that changed this much of the table (its default threshold is 20 %):
    // clear the dead index entries the run left behind, which an immediate forced rerun has to step over.
    let pool = bench.pool(&db, 1).await?;
    sqlx::raw_sql("vacuum loans").execute(&pool).await?;
    pool.close().await;
    let forced_after_vacuum = bench.settle(&db, 1, batch, true).await?;
    Ok((
        Run {
            loans,
            to_settle: limit1.0,
            limit1,
            limit2,
            one,
            two,
            rerun_ms: rerun.elapsed_ms,
            forced,
            forced_after_vacuum,
        },
        db,
    ))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Error> {
    let args = Args::parse();
    if let Some(url) = &args.citus_only {
        return citus_only(url, &args).await;
    }
    let server = server_url()?;
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect(&format!("{server}/postgres"))
        .await?;
    let bench = Bench { server, admin };
    if args.accrual_only {
        return accrual_only(&bench, &args).await;
    }
    if args.rules_only {
        return rules_only(&bench, &args).await;
    }
    if args.indexes_only {
        return indexes_only(&bench, &args).await;
    }
    if args.impact_only {
        return impact_only(&bench, &args).await;
    }
    if args.merge_into.is_some() {
        return Err(
            "--merge-into needs --accrual-only, --rules-only, --indexes-only or --impact-only".into(),
        );
    }

    let (main, settled_db) = measure(&bench, args.loans, args.batch_size).await?;
    eprintln!("   idle daemon");
    let (statements_per_tick, idle_rss, idle_hwm) = bench.idle(&settled_db).await?;
    bench.drop_db(&settled_db).await?;

    let template = format!("fsb_template_{}", args.loans);
    let pooler = match &args.pgbouncer {
        Some(script) => {
            eprintln!("   PgBouncer leg");
            Some(
                bench
                    .pooler_leg(&template, args.batch_size, script, args.pooler_rounds)
                    .await?,
            )
        }
        None => None,
    };

    let impact = match args.impact() {
        Some(impact_args) => Some(
            bench
                .impact(&template, args.loans, args.batch_size, &impact_args)
                .await?,
        ),
        None => None,
    };

    eprintln!("   batch-size sweep");
    let mut sweep = Vec::new();
    for size in &args.sweep {
        let db = bench.copy(&template, "fsb_sweep").await?;
        sweep.push((*size, bench.settle(&db, 1, *size, false).await?));
        bench.drop_db(&db).await?;
    }

    let mut scaling = Vec::new();
    let mut four_shards = None;
    if args.scaling {
        // The largest copy is dropped as soon as it is measured: 10M loans take about 2 GB per database.
        for n in [100_000, 4_000_000, 10_000_000] {
            let (run, db) = measure(&bench, n, args.batch_size).await?;
            bench.drop_db(&db).await?;
            bench.drop_db(&format!("fsb_template_{n}")).await?;
            scaling.push(run);
        }
        let db = bench.copy(&template, "fsb_four").await?;
        four_shards = Some(bench.settle(&db, 4, args.batch_size, false).await?);
        bench.drop_db(&db).await?;
    }
    bench.drop_db(&template).await?;

    let drift = if args.drift {
        eprintln!("   drift: 1000 ticks of fixed-rate 200ms / 80ms work");
        let out = Command::new(binary()?)
            .args([
                "drift",
                "--mode",
                "fixed-rate",
                "--period",
                "200ms",
                "--work",
                "80ms",
                "--ticks",
                "1000",
                "--rows",
                "0",
            ])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.lines()
            .find(|l| l.starts_with("summary:"))
            .map(str::to_string)
    } else {
        None
    };

    let accrual_section = if args.no_accrual {
        None
    } else {
        Some(bench.accrual(&args.accrual()).await?)
    };
    let rules_section = if args.no_rules {
        None
    } else {
        eprintln!("   fine rules");
        Some(
            bench
                .rules(args.rules_loans, args.rules_rounds, args.batch_size)
                .await?,
        )
    };
    let indexes_section = if args.no_indexes {
        None
    } else {
        eprintln!("   indexes");
        Some(bench.indexes(args.indexes()).await?)
    };

    // ---- the report ----
    let version: String = sqlx::query_scalar("select version()")
        .fetch_one(&bench.admin)
        .await?;
    let settings: Vec<(String, String)> = sqlx::query_as(
        "select name, setting || coalesce(unit, '') from pg_settings
         where name in ('shared_buffers', 'max_wal_size', 'synchronous_commit', 'fsync') order by name",
    )
    .fetch_all(&bench.admin)
    .await?;
    let mut r = String::new();
    let _ = writeln!(r, "# Settlement benchmark\n");
    let _ = writeln!(
        r,
        "Produced by `scripts/bench.sh` (`fine-settler-bench`). Do not edit by hand.\n"
    );
    let _ = writeln!(r, "- date: {}", sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]));
    let _ = writeln!(r, "- commit: {}", sh("git", &["rev-parse", "--short", "HEAD"]));
    let _ = writeln!(r, "{}", accrual::measured_all());
    let _ = writeln!(
        r,
        "- machine: {} cores, {} ({})",
        sh("nproc", &[]),
        sh(
            "sh",
            &[
                "-c",
                "grep MemTotal /proc/meminfo | awk '{printf \"%.1f GiB RAM\", $2/1048576}'"
            ]
        ),
        sh("uname", &["-srm"])
    );
    let _ = writeln!(r, "- PostgreSQL: {version}");
    let _ = writeln!(
        r,
        "- server settings: {}",
        settings
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(
        r,
        "- data: {} generated loans (seed 42), {} of them returned in October 2026 and settled by business date {MONTH_END}; batch size {}\n",
        main.loans, main.to_settle, args.batch_size
    );

    let l1 = main.limit1.0 as f64 / main.limit1.1;
    let l2 = main.limit2.0 as f64 / main.limit2.1;
    let s1 = per_sec(main.one.updated, main.one.elapsed_ms);
    let s2 = per_sec(main.two.updated, main.two.elapsed_ms);
    let _ = writeln!(r, "## Throughput\n");
    let _ = writeln!(
        r,
        "| measurement | rows | wall time | rows/s | vs. limit | peak RSS |"
    );
    let _ = writeln!(r, "| --- | ---: | ---: | ---: | ---: | ---: |");
    let _ = writeln!(
        r,
        "| limit: one set-based `update` | {} | {:.0} ms | {:.0} | 1.00 | |",
        main.limit1.0,
        main.limit1.1 * 1e3,
        l1
    );
    let _ = writeln!(
        r,
        "| limit: two sessions (`id % 2`) | {} | {:.0} ms | {:.0} | 1.00 | |",
        main.limit2.0,
        main.limit2.1 * 1e3,
        l2
    );
    let _ = writeln!(
        r,
        "| `settle`, 1 shard | {} | {} ms | {:.0} | {:.2} of one update | {:.1} MiB |",
        main.one.updated,
        main.one.elapsed_ms,
        s1,
        s1 / l1,
        main.one.peak_rss_kib as f64 / 1024.0
    );
    let _ = writeln!(
        r,
        "| `settle`, 2 shards at once | {} | {} ms | {:.0} | {:.2} of two sessions | {:.1} MiB each at most |",
        main.two.updated, main.two.elapsed_ms, s2, s2 / l2, main.two.peak_rss_kib as f64 / 1024.0
    );
    let _ = writeln!(r, "| plain rerun (skipped) | 0 | {} ms | | | |", main.rerun_ms);
    let _ = writeln!(
        r,
        "| forced rerun, right after the run | scanned {} | {} ms | | {:.2} % of the first run's time | |",
        main.forced.scanned,
        main.forced.elapsed_ms,
        100.0 * main.forced.elapsed_ms as f64 / main.one.elapsed_ms.max(1) as f64
    );
    let _ = writeln!(
        r,
        "| forced rerun, after `vacuum loans` | scanned {} | {} ms | | {:.2} % of the first run's time | |\n",
        main.forced_after_vacuum.scanned,
        main.forced_after_vacuum.elapsed_ms,
        100.0 * main.forced_after_vacuum.elapsed_ms as f64 / main.one.elapsed_ms.max(1) as f64
    );
    let _ = writeln!(r, "Two sessions of PostgreSQL itself reach {:.2}x one session on this machine; two shards of `settle` reach {:.2}x one shard.\n", l2 / l1, s2 / s1);

    let _ = writeln!(r, "## Through PgBouncer\n");
    match &pooler {
        None => {
            let _ = writeln!(
                r,
                "Not measured: no `--pgbouncer` script (`scripts/bench.sh` passes one when the server is its own bench cluster).\n"
            );
        }
        Some(leg) => {
            let batches = |c: &Counted| {
                (c.settle.updated as u64)
                    .div_ceil(u64::from(args.batch_size))
                    .max(1)
            };
            let direct = leg.median(Way::Direct);
            let _ = writeln!(
                r,
                "`settle`, 1 shard, batches of {}, on the {}-loan template; {} rounds, each settling a fresh copy directly, then through PgBouncer in transaction mode, then in session mode (each bouncer started for its run by `scripts/pgbouncer.sh`, PgBouncer's defaults); each way's median run. Statements: `pg_stat_statements` calls in the copy's database during the run (claim and finish included), per batch.\n",
                args.batch_size, main.loans, args.pooler_rounds
            );
            let _ = writeln!(
                r,
                "| connection | rows | wall time (median) | rows/s | vs. direct | statements per batch | runs |"
            );
            let _ = writeln!(r, "| --- | ---: | ---: | ---: | ---: | ---: | --- |");
            for (way, runs) in &leg.runs {
                let c = leg.median(*way);
                let _ = writeln!(
                    r,
                    "| {} | {} | {} ms | {:.0} | {:.2} | {:.1} | {} |",
                    way.label(),
                    c.settle.updated,
                    c.settle.elapsed_ms,
                    leg.rate(*way),
                    leg.rate(*way) / leg.rate(Way::Direct),
                    c.statements as f64 / batches(&c) as f64,
                    runs.iter()
                        .map(|c| format!("{} ms", c.settle.elapsed_ms))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            let per_batch = |way: Way| {
                (leg.median(way).settle.elapsed_ms as f64 - direct.settle.elapsed_ms as f64)
                    / batches(&direct) as f64
            };
            let _ = writeln!(
                r,
                "\nOver {} batches (and one claim and finish), the median run through PgBouncer in transaction mode takes {:+.2} ms per batch against a direct connection, in session mode {:+.2} ms.\n",
                batches(&direct),
                per_batch(Way::Transaction),
                per_batch(Way::Session)
            );
        }
    }

    let _ = writeln!(r, "## Idle daemon\n");
    let _ = writeln!(
        r,
        "A replica ticking every 200 ms for 3 s on a settled database (settlement enabled, accrual disabled): {statements_per_tick:.2} statements per idle tick (`pg_stat_statements` calls over the ticks the replica logged), RSS {:.1} MiB (peak {:.1} MiB).\n",
        idle_rss as f64 / 1024.0,
        idle_hwm as f64 / 1024.0
    );

    let _ = writeln!(r, "## Batch size\n");
    let _ = writeln!(r, "| batch size | wall time | rows/s | vs. limit | peak RSS |");
    let _ = writeln!(r, "| ---: | ---: | ---: | ---: | ---: |");
    for (size, s) in &sweep {
        let rate = per_sec(s.updated, s.elapsed_ms);
        let _ = writeln!(
            r,
            "| {size} | {} ms | {rate:.0} | {:.2} | {:.1} MiB |",
            s.elapsed_ms,
            rate / l1,
            s.peak_rss_kib as f64 / 1024.0
        );
    }
    let _ = writeln!(r);

    if !scaling.is_empty() {
        let _ = writeln!(r, "## Scaling\n");
        let _ = writeln!(r, "| loans | to settle | limit | settle, 1 shard | ratio | settle, 2 shards | time per settled row | peak RSS, 1 shard |");
        let _ = writeln!(r, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        let mut all: Vec<&Run> = scaling.iter().collect();
        all.push(&main);
        all.sort_by_key(|run| run.loans);
        for run in all {
            let limit = run.limit1.0 as f64 / run.limit1.1;
            let one = per_sec(run.one.updated, run.one.elapsed_ms);
            let _ = writeln!(
                r,
                "| {} | {} | {:.0} ms | {} ms | {:.2} | {} ms | {:.2} µs | {:.1} MiB |",
                run.loans,
                run.to_settle,
                run.limit1.1 * 1e3,
                run.one.elapsed_ms,
                one / limit,
                run.two.elapsed_ms,
                run.one.elapsed_ms as f64 * 1000.0 / run.to_settle.max(1) as f64,
                run.one.peak_rss_kib as f64 / 1024.0
            );
        }
        if let Some(four) = four_shards {
            let _ = writeln!(
                r,
                "\nShards at {} loans: 1 shard {} ms, 2 shards {} ms, 4 shards {} ms.",
                main.loans, main.one.elapsed_ms, main.two.elapsed_ms, four.elapsed_ms
            );
        }
        let _ = writeln!(r);
    }

    match &impact {
        Some(impact) => r.push_str(&impact.report()),
        None => {
            let _ = writeln!(r, "## Impact on a live load\n");
            let _ = writeln!(
                r,
                "Not measured: no `--pgbench` (`scripts/bench.sh` passes the one beside the server binaries).\n"
            );
        }
    }

    if let Some(line) = &drift {
        let _ = writeln!(r, "## Scheduler drift\n");
        let _ = writeln!(
            r,
            "`fine-settler drift --mode fixed-rate --period 200ms --work 80ms --ticks 1000`:\n"
        );
        let _ = writeln!(r, "```\n{line}\n```\n");
    }

    match &accrual_section {
        Some(section) => r.push_str(&section.report()),
        None => {
            let _ = writeln!(r, "## Accrual\n\nNot measured: `--no-accrual`.\n");
        }
    }
    match &rules_section {
        Some(section) => {
            r.push_str(&section.report());
            r.push('\n');
        }
        None => {
            let _ = writeln!(
                r,
                "## Fine rules: policy versions, item classes, closed days\n\nNot measured: `--no-rules`.\n"
            );
        }
    }

    match &indexes_section {
        Some(section) => {
            r.push_str(&section.report());
            r.push('\n');
        }
        None => {
            let _ = writeln!(
                r,
                "## fine-settler's indexes on libraryd's loans\n\nNot measured: `--no-indexes`.\n"
            );
        }
    }

    let _ = writeln!(r, "## Targets\n");
    let _ = writeln!(r, "| target | measured | |");
    let _ = writeln!(r, "| --- | --- | --- |");
    let _ = writeln!(
        r,
        "| settle, 1 shard ≥ 0.8 × one update | {:.2} | {} |",
        s1 / l1,
        verdict(s1 / l1 >= 0.8)
    );
    let _ = writeln!(
        r,
        "| settle, 2 shards ≥ 0.8 × two sessions | {:.2} | {} |",
        s2 / l2,
        verdict(s2 / l2 >= 0.8)
    );
    let _ = writeln!(
        r,
        "| 2 shards faster than 1 | {} ms vs {} ms | {} |",
        main.two.elapsed_ms,
        main.one.elapsed_ms,
        verdict(main.two.elapsed_ms < main.one.elapsed_ms)
    );
    let share = |s: &Settle| s.elapsed_ms as f64 / main.one.elapsed_ms.max(1) as f64;
    let _ = writeln!(
        r,
        "| forced rerun scans 0 rows in < 1 % of the first run's time, right after the run | {} rows, {:.2} % | {} |",
        main.forced.scanned,
        share(&main.forced) * 100.0,
        verdict(main.forced.scanned == 0 && share(&main.forced) < 0.01)
    );
    let _ = writeln!(
        r,
        "| ... once the run's dead tuples are vacuumed | {} rows, {:.2} % | {} |",
        main.forced_after_vacuum.scanned,
        share(&main.forced_after_vacuum) * 100.0,
        verdict(main.forced_after_vacuum.scanned == 0 && share(&main.forced_after_vacuum) < 0.01)
    );
    if let Some(leg) = &pooler {
        let direct = leg.rate(Way::Direct);
        let tx = leg.rate(Way::Transaction);
        let _ = writeln!(
            r,
            "| settle through PgBouncer (transaction mode) ≥ 0.8 × direct | {:.2} | {} |",
            tx / direct,
            verdict(tx / direct >= 0.8)
        );
    }
    let _ = writeln!(
        r,
        "| idle tick ≤ 2 round trips per job | {statements_per_tick:.2} statements | {} |",
        verdict(statements_per_tick <= 2.0)
    );
    let _ = writeln!(
        r,
        "| idle RSS ≤ 20 MiB | {:.1} MiB | {} |",
        idle_rss as f64 / 1024.0,
        verdict(idle_rss <= 20 * 1024)
    );
    let _ = writeln!(
        r,
        "| RSS during the settle ≤ 64 MiB | {:.1} MiB | {} |",
        main.one.peak_rss_kib as f64 / 1024.0,
        verdict(main.one.peak_rss_kib <= 64 * 1024)
    );

    if let Some(impact) = &impact {
        r.push_str(&impact.targets());
    }
    if let Some(largest) = scaling.iter().max_by_key(|run| run.loans) {
        let _ = writeln!(
            r,
            "| RSS while settling {} loans ≤ 64 MiB | {:.1} MiB | {} |",
            largest.loans,
            largest.one.peak_rss_kib as f64 / 1024.0,
            verdict(largest.one.peak_rss_kib <= 64 * 1024)
        );
    }

    print!("{r}");
    if let Some(path) = args.out {
        // The full run does not measure Citus (`--citus-only` does, on its own cluster): a Citus section the
        // report had stays, with its date.
        let kept = std::fs::read_to_string(&path)
            .ok()
            .and_then(|old| citus::kept(&old));
        let r = match kept {
            Some((section, measured)) => citus::merge(&r, &section, &measured),
            None => r,
        };
        std::fs::write(&path, &r)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// `--citus-only URL`: the Citus section alone, printed, and written to `--out` or merged into `--merge-into`.
async fn citus_only(url: &str, args: &Args) -> Result<(), Error> {
    let section = citus::section(url, args.citus_loans, args.citus_rounds).await?;
    print!("{section}");
    if let Some(path) = &args.merge_into {
        let existing =
            std::fs::read_to_string(path).map_err(|e| format!("--merge-into {}: {e}", path.display()))?;
        let measured = citus::measured(
            &sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
            &sh("git", &["rev-parse", "--short", "HEAD"]),
        );
        std::fs::write(path, citus::merge(&existing, &section, &measured))?;
        eprintln!("merged the Citus section into {}", path.display());
    }
    if let Some(path) = &args.out {
        std::fs::write(path, &section)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// `--rules-only`: the fine rules section alone, printed, and written to `--out` or merged into `--merge-into`.
async fn rules_only(bench: &Bench, args: &Args) -> Result<(), Error> {
    let section = bench
        .rules(args.rules_loans, args.rules_rounds, args.batch_size)
        .await?
        .report();
    print!("{section}");
    if let Some(path) = &args.merge_into {
        let existing =
            std::fs::read_to_string(path).map_err(|e| format!("--merge-into {}: {e}", path.display()))?;
        let measured = rules::measured(
            &sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
            &sh("git", &["rev-parse", "--short", "HEAD"]),
        );
        std::fs::write(path, rules::merge(&existing, &section, &measured))?;
        eprintln!("merged the fine rules section into {}", path.display());
    }
    if let Some(path) = &args.out {
        std::fs::write(path, &section)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// `--impact-only`: the impact section alone on a fresh template of `--loans` loans, printed, and written to
/// `--out` or merged into `--merge-into` (with its rows of the targets table).
async fn impact_only(bench: &Bench, args: &Args) -> Result<(), Error> {
    let impact_args = args.impact().ok_or("--impact-only needs --pgbench")?;
    eprintln!("   template of {} loans", args.loans);
    let template = bench.template(args.loans).await?;
    let impact = bench
        .impact(&template, args.loans, args.batch_size, &impact_args)
        .await?;
    bench.drop_db(&template).await?;
    let section = impact.report();
    print!("{section}");
    if let Some(path) = &args.merge_into {
        let existing =
            std::fs::read_to_string(path).map_err(|e| format!("--merge-into {}: {e}", path.display()))?;
        let measured = impact::measured(
            &sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
            &sh("git", &["rev-parse", "--short", "HEAD"]),
        );
        std::fs::write(
            path,
            impact::merge(&existing, &section, &impact.targets(), &measured),
        )?;
        eprintln!("merged the impact section into {}", path.display());
    }
    if let Some(path) = &args.out {
        std::fs::write(path, &section)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// `--indexes-only`: the indexes section alone, printed, and written to `--out` or merged into `--merge-into`.
async fn indexes_only(bench: &Bench, args: &Args) -> Result<(), Error> {
    let section = bench.indexes(args.indexes()).await?.report();
    print!("{section}");
    if let Some(path) = &args.merge_into {
        let existing =
            std::fs::read_to_string(path).map_err(|e| format!("--merge-into {}: {e}", path.display()))?;
        let measured = indexes::measured(
            &sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
            &sh("git", &["rev-parse", "--short", "HEAD"]),
        );
        std::fs::write(path, indexes::merge(&existing, &section, &measured))?;
        eprintln!("merged the indexes section into {}", path.display());
    }
    if let Some(path) = &args.out {
        std::fs::write(path, &section)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// `--accrual-only`: the accrual section alone, printed, and written to `--out` or merged into `--merge-into`.
async fn accrual_only(bench: &Bench, args: &Args) -> Result<(), Error> {
    let section = bench.accrual(&args.accrual()).await?.report();
    print!("{section}");
    if let Some(path) = &args.merge_into {
        let existing =
            std::fs::read_to_string(path).map_err(|e| format!("--merge-into {}: {e}", path.display()))?;
        let measured = accrual::measured_accrual(
            &sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
            &sh("git", &["rev-parse", "--short", "HEAD"]),
        );
        std::fs::write(path, accrual::merge(&existing, &section, &measured))?;
        eprintln!("merged the accrual section into {}", path.display());
    }
    if let Some(path) = &args.out {
        std::fs::write(path, &section)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
