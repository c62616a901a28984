//! The command line: argument parsing, configuration loading, dispatch, and the mapping of errors to exit
//! codes (0 success or skip, 1 runtime failure, 2 usage or configuration, 3 `verify` found violations).
//! Reports go to stdout, logs to stderr.

use std::{collections::HashMap, path::PathBuf, process::ExitCode, sync::Arc};

use chrono::{DateTime, Datelike, NaiveDate, Utc};
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::{
    calendar,
    config::{self, ConfigError, RawSettings, Settings, TimeSource},
    daemon::{self, Daemon},
    demo,
    jobs::{
        accrual::{compensate, Accrual},
        runner::{host_name, process_owner, Runner},
        settlement::Settlement,
        JobName, Outcome, RunKey, RunReport,
    },
    schedule::{drift, SystemWall},
    sdnotify::{Notifier, Watchdog},
    shard::ShardSpec,
    signals::Signals,
    store::{self, StoreError},
    telemetry,
};

/// Settles library fines in PostgreSQL: idempotent, sharded, resumable.
#[derive(Debug, Parser)]
#[command(name = "fine-settler", version)]
pub struct Cli {
    /// The replica's TOML file; overrides the built-in defaults (see config/default.toml).
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the database migrations (idempotent).
    Migrate,
    /// Settle one business month (its last day) for one shard, and print a one-line JSON report.
    Settle {
        /// The business date: the last day of the month to settle, e.g. 2026-10-31.
        #[arg(long, value_name = "D")]
        business_date: NaiveDate,
        #[command(flatten)]
        shard: ShardArgs,
        /// Re-run a key that already succeeded, from the beginning (rows already settled are not touched).
        #[arg(long)]
        force: bool,
    },
    /// Run the replica: tick on the schedule, settling every due business date of this shard.
    Run {
        /// Do one tick, print its runs' reports, and exit (0 if every run settled or skipped).
        #[arg(long)]
        once: bool,
    },
    /// Print what a tick at that time would claim (one JSON line per due key); writes nothing.
    Plan {
        /// The time of the tick (default: now, by the configured clock).
        #[arg(long, value_name = "RFC3339")]
        at: Option<DateTime<chrono::FixedOffset>>,
    },
    /// Measure the scheduler: run it with simulated work and print each tick's start, lag and gap.
    Drift {
        #[arg(long, value_enum)]
        mode: DriftMode,
        /// The period (fixed-rate) or delay (fixed-delay).
        #[arg(long, value_parser = parse_duration, default_value = "200ms")]
        period: std::time::Duration,
        /// Simulated work per tick.
        #[arg(long, value_parser = parse_duration, default_value = "80ms")]
        work: std::time::Duration,
        #[arg(long, default_value_t = 6)]
        ticks: usize,
        /// Print at most this many table rows (the summary covers all ticks).
        #[arg(long, default_value_t = 20)]
        rows: usize,
    },
    /// Accrue one day's overdue fines for one shard (after retrying its due pending charges), and print a
    /// one-line JSON report with the shard's pending and dead counts.
    Accrue {
        /// The accrual day, before today in time.zone.
        #[arg(long, value_name = "D")]
        date: NaiveDate,
        #[command(flatten)]
        shard: ShardArgs,
        /// Re-run a day that already succeeded (days already charged are not charged again).
        #[arg(long)]
        force: bool,
    },
    /// The compensation queue of failed charges.
    Pending {
        #[command(subcommand)]
        action: PendingAction,
    },
    /// Show job_runs rows as a table (or the attempt history).
    Runs {
        /// Only this job (fine-settlement or overdue-accrual).
        #[arg(long, value_name = "J", value_parser = parse_job)]
        job: Option<JobName>,
        /// Only this business date.
        #[arg(long, value_name = "D")]
        business_date: Option<NaiveDate>,
        /// Show job_run_attempts instead: every claim, takeover, finish, failure, lost lease and release.
        #[arg(long)]
        history: bool,
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// End a stuck claim now: the key becomes FAILED with its lease ended, so the next run takes it over under a
    /// new epoch (fencing out the old owner); recorded in the history with who and why.
    Release {
        #[arg(long, value_name = "J", value_parser = parse_job)]
        job: JobName,
        #[arg(long, value_name = "D")]
        business_date: NaiveDate,
        #[arg(long, value_name = "N", allow_negative_numbers = true)]
        shards: i64,
        #[arg(long, value_name = "S", allow_negative_numbers = true)]
        shard: i64,
        /// Why, for the history.
        #[arg(long, default_value = "released by an operator")]
        reason: String,
        /// Who, for the history (default: $USER@host).
        #[arg(long)]
        by: Option<String>,
    },
    /// Audit a settled month; exit 3 on any violation.
    Verify {
        /// The business date (month end) to audit.
        #[arg(long, value_name = "D")]
        business_date: NaiveDate,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Validate the configuration and print the effective values (password redacted).
    CheckConfig,
    /// Insert deterministic demo loans (existing ids are left alone, so running it twice is a no-op).
    DemoData {
        /// How many loans.
        #[arg(long, default_value_t = 5000)]
        loans: u64,
        /// The generator's seed.
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// The month the loans cluster around, as YYYY-MM.
        #[arg(long, value_name = "YYYY-MM", value_parser = parse_month)]
        month: NaiveDate,
        /// The first loan id.
        #[arg(long, default_value_t = 1)]
        first_id: i64,
    },
}

/// `--shard S --shards N` of the one-shot commands; each defaults to the instance's.
#[derive(Debug, clap::Args)]
pub struct ShardArgs {
    /// The shard (default: instance.shard).
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    shard: Option<i64>,
    /// The shard count (default: instance.shards).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    shards: Option<i64>,
}

#[derive(Debug, Subcommand)]
pub enum PendingAction {
    /// List queued charges: loan, date, amount, attempts, next attempt, last error, status.
    List {
        /// Print JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Retry every PENDING charge now, whatever its next attempt time.
    Retry {
        /// Also give DEAD charges a fresh set of attempts first.
        #[arg(long)]
        dead: bool,
    },
}

/// The scheduler modes `drift` can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DriftMode {
    FixedRate,
    FixedDelay,
}

fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    match humantime::parse_duration(s) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err("must be longer than zero".into()),
        Err(e) => Err(format!("{s:?} is not a duration ({e})")),
    }
}

fn parse_job(s: &str) -> Result<JobName, String> {
    [JobName::FineSettlement, JobName::OverdueAccrual]
        .into_iter()
        .find(|j| j.as_str() == s)
        .ok_or_else(|| format!("{s:?} is not fine-settlement or overdue-accrual"))
}

fn parse_month(s: &str) -> Result<NaiveDate, String> {
    NaiveDate::parse_from_str(&format!("{s}-01"), "%Y-%m-%d")
        .map_err(|_| format!("{s:?} is not a month like 2026-10"))
}

/// Why a command could not do its work.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad arguments; nothing was written.
    #[error("{0}")]
    Usage(String),
    /// Bad configuration; nothing was written.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The daemon could not look at its work (one-shot `run --once`).
    #[error(transparent)]
    Tick(#[from] daemon::TickError),
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers: {0}")]
    Signals(#[from] std::io::Error),
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Usage(_) | CliError::Config(_) => ExitCode::from(2),
            CliError::Store(_) | CliError::Tick(_) | CliError::Signals(_) => ExitCode::from(1),
        }
    }

    /// One line per problem, for stderr.
    pub fn lines(&self) -> Vec<String> {
        match self {
            CliError::Config(e) => e.lines(),
            other => vec![format!("fine-settler: {other}")],
        }
    }
}

impl From<sqlx::Error> for CliError {
    fn from(e: sqlx::Error) -> Self {
        CliError::Store(StoreError::Sql(e))
    }
}

/// Parses arguments (clap exits 2 on bad usage), runs the command, maps errors to exit codes.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fine-settler: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            for line in e.lines() {
                eprintln!("{line}");
            }
            e.exit_code()
        }
    }
}

/// The shard of a one-shot command: `--shard`/`--shards`, defaulting to the instance's.
fn shard_spec(settings: &Settings, args: &ShardArgs) -> Result<ShardSpec, CliError> {
    shard_arg(
        args.shard.unwrap_or(i64::from(settings.instance.shard())),
        args.shards.unwrap_or(i64::from(settings.instance.shards())),
    )
}

/// `--shard S --shards N` as a shard, or a usage error naming the flags.
fn shard_arg(shard: i64, shards: i64) -> Result<ShardSpec, CliError> {
    ShardSpec::new(shard, shards).map_err(|e| CliError::Usage(format!("--shard/--shards: {e}")))
}

/// Loads and validates the configuration; nothing touches the database before this has passed.
fn settings(cli: &Cli) -> Result<(RawSettings, Settings), CliError> {
    let env: HashMap<String, String> = std::env::vars().collect();
    let raw = config::load(cli.config.as_deref(), &env)?;
    let settings = raw.validate(&env)?;
    Ok((raw, settings))
}

/// The service manager's notification socket and watchdog, each present only when the environment names it.
type ServiceManager = (Option<Arc<Notifier>>, Option<Arc<Watchdog>>);

/// The systemd notification socket and watchdog, when the environment names them. A watchdog timeout shorter
/// than two batch timeouts is refused (exit 2): a batch may legitimately go that long without progress, and
/// systemd would kill a healthy replica mid-batch.
fn service_manager(settings: &Settings) -> Result<ServiceManager, CliError> {
    let env: HashMap<String, String> = std::env::vars().collect();
    let usage = |e: std::io::Error| CliError::Usage(format!("NOTIFY_SOCKET: {e}"));
    let Some(notifier) = Notifier::from_env(&env).map_err(usage)? else {
        return Ok((None, None));
    };
    let notifier = Arc::new(notifier);
    let dog = Watchdog::from_env(&env, notifier.clone()).map_err(CliError::Usage)?;
    if let Some(dog) = &dog {
        let min = settings.claim.lease.batch_timeout() * 2;
        if dog.timeout < min {
            return Err(CliError::Usage(format!(
                "WatchdogSec ({}) must be at least twice claim.batch_timeout ({}): a batch may take that long \
                 without progress",
                humantime::format_duration(dog.timeout),
                humantime::format_duration(settings.claim.lease.batch_timeout())
            )));
        }
    }
    Ok((Some(notifier), dog.map(Arc::new)))
}

/// Runs one command.
pub async fn run(cli: Cli) -> Result<ExitCode, CliError> {
    let (raw, settings) = settings(&cli)?;
    match cli.command {
        Command::CheckConfig => {
            print!("{}", raw.to_redacted_toml(&settings));
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate => {
            telemetry::init(settings.log_format, &settings.log_level);
            store::migrate(&settings.database).await?;
            println!(
                "{}",
                serde_json::json!({"migrate": "ok", "migrations": store::MIGRATOR.iter().count()})
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Settle {
            business_date,
            shard,
            force,
        } => {
            let spec = shard_spec(&settings, &shard)?;
            calendar::settlement_month(business_date)
                .map_err(|e| CliError::Usage(format!("--business-date: {e}")))?;
            telemetry::init(settings.log_format, &settings.log_level);
            let key = RunKey {
                job: JobName::FineSettlement,
                business_date,
                shard: spec,
            };
            let report = settle(&settings, key, force).await;
            println!("{}", serde_json::to_string(&report).unwrap_or_default());
            Ok(ExitCode::from(report.outcome.exit_code()))
        }
        Command::Run { once } => {
            telemetry::init(settings.log_format, &settings.log_level);
            let (notifier, watchdog) = service_manager(&settings)?;
            let signals = Signals::install_notifying(notifier.clone())?;
            let drain_timeout = settings.schedule.drain_timeout;
            let http_listen = settings.http_listen;
            let health_window = crate::schedule::due::health_window(&settings, Utc::now());
            let mut daemon = Daemon::new(
                settings,
                Arc::new(SystemWall),
                signals.shutdown.clone(),
                signals.run_now.clone(),
            )
            .with_notifier(notifier);
            if let Some(dog) = watchdog {
                daemon.metrics().attach_watchdog(dog);
            }
            if once {
                let reports = daemon.tick().await?;
                for r in &reports {
                    println!("{}", serde_json::to_string(r).unwrap_or_default());
                }
                let worst = reports.iter().map(|r| r.outcome.exit_code()).max().unwrap_or(0);
                return Ok(ExitCode::from(worst));
            }
            if let Some(addr) = http_listen {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| CliError::Usage(format!("http.listen: cannot listen on {addr}: {e}")))?;
                tracing::info!(%addr, "serving /healthz, /readyz and /metrics");
                let probes = crate::http::Probes {
                    metrics: daemon.metrics(),
                    pool: daemon.pool(),
                    window: health_window,
                    started_ms: crate::metrics::unix_now_ms(),
                };
                tokio::spawn(crate::http::serve(listener, probes, signals.shutdown.clone()));
            }
            let drain_expired = async {
                signals.shutdown.cancelled().await;
                tokio::time::sleep(drain_timeout).await;
            };
            tokio::select! {
                () = daemon.run() => Ok(ExitCode::SUCCESS),
                () = signals.hard_stop.cancelled() => Ok(ExitCode::from(1)),
                () = drain_expired => {
                    tracing::error!(
                        drain_timeout_ms = drain_timeout.as_millis() as u64,
                        "drain timeout: exiting with a batch in flight; its key is taken over when the lease expires"
                    );
                    Ok(ExitCode::from(1))
                }
            }
        }
        Command::Accrue { date, shard, force } => {
            let spec = shard_spec(&settings, &shard)?;
            if date.year() < 1 {
                return Err(CliError::Usage(format!(
                    "--date: {date} is out of range (years 1 to 9999)"
                )));
            }
            telemetry::init(settings.log_format, &settings.log_level);
            let key = RunKey {
                job: JobName::OverdueAccrual,
                business_date: date,
                shard: spec,
            };
            let report = accrue(&settings, key, force).await?;
            println!("{}", serde_json::to_string(&report).unwrap_or_default());
            Ok(ExitCode::from(report.run.outcome.exit_code()))
        }
        Command::Pending { action } => {
            telemetry::init(settings.log_format, &settings.log_level);
            let pool = store::connect(
                &settings.database,
                "fine-settler pending",
                settings.claim.lease.batch_timeout(),
            )
            .await?;
            match action {
                PendingAction::List { json } => {
                    print_rows(&store::ledger::list(&pool).await?, json, pending_table);
                }
                PendingAction::Retry { dead } => {
                    let resurrected = if dead {
                        store::ledger::resurrect(&pool).await?
                    } else {
                        0
                    };
                    let job = Accrual::from_settings(&settings);
                    let done = compensate(&pool, &job, None, false, settings.accrual.max_attempts).await?;
                    let (pending, dead) = store::ledger::counts(&pool, None).await?;
                    println!(
                        "{}",
                        serde_json::json!({
                            "resurrected": resurrected, "charged": done.charged, "not_owed": done.not_owed,
                            "retried": done.retried,
                            "dead_now": done.dead, "pending": pending, "dead": dead
                        })
                    );
                }
            }
            pool.close().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Plan { at } => {
            telemetry::init(settings.log_format, &settings.log_level);
            let mut session = store::Session::new(
                &settings.database,
                "fine-settler plan",
                settings.claim.lease.batch_timeout(),
            );
            let around = at.map_or_else(Utc::now, |at| at.with_timezone(&Utc));
            let status = session
                .tick_status(
                    settings.instance,
                    crate::schedule::due::window_start(&settings, around),
                    crate::schedule::due::late_probe(&settings, around, true),
                )
                .await
                .map_err(daemon::TickError::from)?;
            let now = match (at, settings.time_source) {
                (Some(at), _) => at.with_timezone(&Utc),
                (None, TimeSource::Database) => status.now,
                (None, TimeSource::System) => Utc::now(),
            };
            for due in crate::schedule::due::plan(&settings, now, &status.keys) {
                println!("{}", serde_json::to_string(&due).unwrap_or_default());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Drift {
            mode,
            period,
            work,
            ticks,
            rows,
        } => {
            let report = drift::measure(mode == DriftMode::FixedRate, period, work, ticks).await;
            print!("{}", report.render(rows));
            Ok(ExitCode::SUCCESS)
        }
        Command::Runs {
            job,
            business_date,
            history,
            json,
        } => {
            telemetry::init(settings.log_format, &settings.log_level);
            let pool = store::connect(
                &settings.database,
                "fine-settler runs",
                settings.claim.lease.batch_timeout(),
            )
            .await?;
            let job = job.map(JobName::as_str);
            if history {
                let rows = store::job_runs::history(&pool, job, business_date).await?;
                print_rows(&rows, json, history_table);
            } else {
                let rows = store::job_runs::list(&pool, job, business_date).await?;
                print_rows(&rows, json, runs_table);
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Release {
            job,
            business_date,
            shards,
            shard,
            reason,
            by,
        } => {
            let spec = shard_arg(shard, shards)?;
            let by = by.unwrap_or_else(operator);
            telemetry::init(settings.log_format, &settings.log_level);
            let pool = store::connect(
                &settings.database,
                "fine-settler release",
                settings.claim.lease.batch_timeout(),
            )
            .await?;
            let key = RunKey {
                job,
                business_date,
                shard: spec,
            };
            let released = store::job_runs::release(&pool, &key, &by, &reason).await?;
            let report = serde_json::json!({
                "job": job.as_str(), "business_date": business_date, "shard": spec.shard(), "shards": spec.shards(),
                "found": released.is_some(),
                "released": released.as_ref().is_some_and(|r| r.released),
                "status": released.as_ref().map(|r| r.status),
                "epoch": released.as_ref().map(|r| r.epoch),
                "previous_owner": released.as_ref().map(|r| r.previous_owner.clone()),
                "by": by,
            });
            println!("{report}");
            if let Some(r) = &released {
                if r.released {
                    tracing::warn!(job = job.as_str(), %business_date, shard = spec.shard(), shards = spec.shards(),
                        epoch = r.epoch, previous_owner = %r.previous_owner, by = %by, reason = %reason, "claim released");
                }
            }
            Ok(if released.is_some() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Command::Verify { business_date, json } => {
            let month = calendar::settlement_month(business_date)
                .map_err(|e| CliError::Usage(format!("--business-date: {e}")))?;
            telemetry::init(settings.log_format, &settings.log_level);
            let pool = store::connect(
                &settings.database,
                "fine-settler verify",
                settings.claim.lease.batch_timeout(),
            )
            .await?;
            let audit = store::audit::month(&pool, month, &settings.fine).await?;
            let violations = audit.violations();
            if json {
                let out = serde_json::json!({"business_date": business_date, "audit": audit, "violations": violations});
                println!("{out}");
            } else {
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
                println!("  violations          {}", violations.len());
                for v in &violations {
                    println!("    - {v}");
                }
            }
            Ok(if violations.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(3)
            })
        }
        Command::DemoData {
            loans,
            seed,
            month,
            first_id,
        } => {
            telemetry::init(settings.log_format, &settings.log_level);
            let pool = store::connect(
                &settings.database,
                "fine-settler demo-data",
                settings.claim.lease.batch_timeout(),
            )
            .await?;
            let spec = demo::DemoSpec {
                loans,
                seed,
                month,
                first_id,
            };
            let mut inserted = 0;
            let mut chunk = Vec::with_capacity(10_000);
            for loan in demo::loans(spec) {
                chunk.push(loan);
                if chunk.len() == 10_000 {
                    inserted += store::loans::insert_new(&pool, &chunk).await?;
                    chunk.clear();
                }
            }
            inserted += store::loans::insert_new(&pool, &chunk).await?;
            println!(
                "{}",
                serde_json::json!({"loans": loans, "inserted": inserted, "seed": seed})
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A report for a run that could not start (no database).
fn not_started(key: RunKey, started: tokio::time::Instant, error: String) -> RunReport {
    RunReport {
        job: key.job.as_str(),
        business_date: key.business_date,
        shard: key.shard.shard(),
        shards: key.shard.shards(),
        outcome: Outcome::Failed,
        epoch: None,
        scanned: 0,
        updated: 0,
        elapsed_ms: started.elapsed().as_millis() as u64,
        detail: Some(error),
        held_until: None,
        reopened: false,
    }
}

/// A runner for a one-shot command, handing its key back cleanly on SIGINT/SIGTERM.
async fn one_shot_runner(settings: &Settings, key: RunKey, batch_size: u32) -> Result<Runner, String> {
    let app = format!("fine-settler {} {}", key.job, key.shard);
    let pool = store::connect(&settings.database, &app, settings.claim.lease.batch_timeout())
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "cannot connect to the database");
            e.to_string()
        })?;
    let cancel = match Signals::install() {
        Ok(signals) => signals.shutdown,
        Err(e) => {
            tracing::warn!(error = %e, "cannot install signal handlers; SIGTERM will not release the key");
            CancellationToken::new()
        }
    };
    Ok(Runner::new(
        pool,
        process_owner(),
        &settings.claim,
        batch_size,
        cancel,
    ))
}

/// Settles one key. Always returns a report.
async fn settle(settings: &Settings, key: RunKey, force: bool) -> RunReport {
    let started = tokio::time::Instant::now();
    match one_shot_runner(settings, key, settings.settlement.batch_size).await {
        Ok(runner) => {
            let report = runner
                .run(
                    &Settlement {
                        policy: settings.fine,
                    },
                    key,
                    force,
                )
                .await;
            runner.pool.close().await;
            report
        }
        Err(e) => not_started(key, started, e),
    }
}

/// The report of `accrue`: the run's, plus what the compensation pass did and the shard's queue.
#[derive(Debug, serde::Serialize)]
struct AccrualReport {
    #[serde(flatten)]
    run: RunReport,
    /// Pending charges of this shard written by the compensation pass before the run.
    compensated: u64,
    /// Why the compensation pass failed, if it did (the run went ahead).
    #[serde(skip_serializing_if = "Option::is_none")]
    compensation_error: Option<String>,
    /// This shard's PENDING charges after the run.
    pending: Option<i64>,
    /// This shard's DEAD charges after the run.
    dead: Option<i64>,
}

/// Accrues one day for one shard, after retrying the shard's due pending charges. Returns a report, or a usage
/// error when the day is not over yet by the configured clock (the database's by default, as for the daemon);
/// nothing is written then.
async fn accrue(settings: &Settings, key: RunKey, force: bool) -> Result<AccrualReport, CliError> {
    let started = tokio::time::Instant::now();
    let not_started = |e: String| AccrualReport {
        run: not_started(key, started, e),
        compensated: 0,
        compensation_error: None,
        pending: None,
        dead: None,
    };
    let runner = match one_shot_runner(settings, key, settings.accrual.batch_size).await {
        Ok(runner) => runner,
        Err(e) => return Ok(not_started(e)),
    };
    let now = match settings.time_source {
        TimeSource::System => Ok(Utc::now()),
        TimeSource::Database => store::database_now(&runner.pool).await,
    };
    let today = match now {
        Ok(now) => calendar::local_date(now, settings.zone),
        Err(e) => {
            let e = StoreError::from(e);
            tracing::error!(error = %e, "cannot read the database clock");
            runner.pool.close().await;
            return Ok(not_started(e.to_string()));
        }
    };
    if key.business_date >= today {
        runner.pool.close().await;
        return Err(CliError::Usage(format!(
            "--date: {} is not before today ({today} in {}); a day is accrued once it is over",
            key.business_date,
            settings.zone.name()
        )));
    }
    let job = Accrual::from_settings(settings);
    let max_attempts = settings.accrual.max_attempts;
    // A failing compensation pass (a missing grant, a broken trigger) does not keep the day from being accrued.
    let compensation = compensate(&runner.pool, &job, Some(key.shard), true, max_attempts)
        .await
        .map_err(|e| {
            let e = StoreError::from(e);
            tracing::error!(error = %e, "compensation pass failed; accruing the day anyway");
            e.to_string()
        });
    let run = runner.run(&job, key, force).await;
    let counts = store::ledger::counts(&runner.pool, Some(key.shard)).await.ok();
    runner.pool.close().await;
    Ok(AccrualReport {
        run,
        compensated: compensation.as_ref().map_or(0, |c| c.charged),
        compensation_error: compensation.err(),
        pending: counts.map(|c| c.0),
        dead: counts.map(|c| c.1),
    })
}

/// Rows on stdout: one JSON object per line with `--json`, else the table.
fn print_rows<T: serde::Serialize>(rows: &[T], json: bool, table: fn(&[T]) -> String) {
    if json {
        for row in rows {
            println!("{}", serde_json::to_string(row).unwrap_or_default());
        }
    } else {
        print!("{}", table(rows));
    }
}

fn pending_table(rows: &[store::ledger::Pending]) -> String {
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

/// `$USER@host`, naming an operator in the history.
fn operator() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "operator".into());
    format!("{user}@{}", host_name())
}

fn history_table(rows: &[store::job_runs::Attempt]) -> String {
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

fn runs_table(rows: &[store::job_runs::JobRun]) -> String {
    let mut out = format!(
        "{:<16} {:<10} {:>6} {:<8} {:>5} {:>8} {:>10} {:>10} {:>12}  {:<30} {}\n",
        "JOB",
        "DATE",
        "SHARD",
        "STATUS",
        "EPOCH",
        "LEASE_S",
        "SCANNED",
        "UPDATED",
        "CURSOR",
        "OWNER",
        "LAST_ERROR"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<16} {:<10} {:>6} {:<8} {:>5} {:>8.1} {:>10} {:>10} {:>12}  {:<30} {}\n",
            r.job_name,
            r.business_date,
            format!("{}/{}", r.shard, r.shards),
            r.status,
            r.epoch,
            r.lease_left_s,
            r.scanned,
            r.updated,
            r.cursor.map_or("-".to_string(), |c| c.to_string()),
            r.owner,
            r.last_error.as_deref().unwrap_or("")
        ));
    }
    out
}
