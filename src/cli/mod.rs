//! The command line: argument parsing ([`args`]), configuration loading, dispatch, output ([`output`]), and the
//! mapping of errors to exit codes (0 success or skip, 1 runtime failure, 2 usage or configuration, 3 `verify`
//! found violations). Reports go to stdout, logs to stderr. The work itself lives in [`crate::jobs::oneshot`]
//! (the one-shot runs), [`crate::jobs::backfill`] (`backfill`), [`crate::daemon`] (the replica) and
//! [`crate::store`].

pub mod args;
pub mod output;

use std::{collections::HashMap, process::ExitCode, sync::Arc};

use chrono::{Datelike, Utc};
use clap::Parser;

use crate::{
    calendar,
    config::{self, ConfigError, RawSettings, Settings},
    daemon::{self, Control},
    demo,
    jobs::{
        backfill::{self, BackfillError},
        oneshot,
        runner::host_name,
        JobName, RunKey,
    },
    progress,
    schedule::drift,
    sdnotify::{Notifier, Watchdog},
    shard::ShardSpec,
    signals::Signals,
    store::{self, StoreError},
    telemetry,
};
pub use args::{Cli, Command, DriftMode, PauseScopeArgs, PendingAction, ShardArgs};

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
    /// The replica could not start (its HTTP listener).
    #[error(transparent)]
    Start(#[from] daemon::StartError),
    /// A backfill could not run (bad arguments: exit 2, nothing written).
    #[error(transparent)]
    Backfill(#[from] BackfillError),
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers: {0}")]
    Signals(#[from] std::io::Error),
    /// `settle`/`accrue` of a paused job (or shard) without `--ignore-pause`; nothing was written.
    #[error(transparent)]
    Paused(oneshot::Refused),
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Usage(_) | CliError::Config(_) | CliError::Start(_) => ExitCode::from(2),
            CliError::Backfill(BackfillError::Usage { .. }) => ExitCode::from(2),
            CliError::Backfill(BackfillError::Paused(_)) => ExitCode::from(1),
            CliError::Store(_)
            | CliError::Tick(_)
            | CliError::Signals(_)
            | CliError::Paused(_)
            | CliError::Backfill(_) => ExitCode::from(1),
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

impl From<oneshot::Refused> for CliError {
    fn from(e: oneshot::Refused) -> Self {
        match e {
            oneshot::Refused::NotOver(e) => CliError::Usage(format!("--date: {e}")),
            paused => CliError::Paused(paused),
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

/// What `pause`/`resume` apply to: `--shards N --shard S` (clap requires both or neither), else the whole job.
fn pause_scope(args: &PauseScopeArgs) -> Result<store::pauses::PauseScope, CliError> {
    match (args.shard, args.shards) {
        (Some(shard), Some(shards)) => Ok(store::pauses::PauseScope::Shard(shard_arg(shard, shards)?)),
        _ => Ok(store::pauses::PauseScope::Job),
    }
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
            if settings.database.pooler == crate::config::Pooler::Transaction {
                // sqlx's migrator holds a session-level advisory lock, and indexes are built concurrently: both
                // need a session of their own, which a transaction-mode pool does not give.
                return Err(CliError::Usage(
                    "migrate needs a session of its own, which database.pooler = \"transaction\" does not give: \
                     run it against the server directly or through a session-mode pool (e.g. \
                     FINE_SETTLER__DATABASE__POOLER=none DATABASE_URL=postgres://…direct…)"
                        .into(),
                ));
            }
            telemetry::init(settings.log_format, &settings.log_level);
            let bars = progress::wanted().then(progress::index_build_bars);
            store::migrate(&settings.database, bars).await?;
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
            ignore_pause,
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
            let report = oneshot::settle(&settings, key, force, ignore_pause, progress::wanted()).await?;
            println!("{}", serde_json::to_string(&report).unwrap_or_default());
            Ok(ExitCode::from(report.outcome.exit_code()))
        }
        Command::Run { once } => {
            telemetry::init(settings.log_format, &settings.log_level);
            let (notifier, watchdog) = service_manager(&settings)?;
            let signals = Signals::install_notifying(notifier.clone())?;
            let control = Control::from_signals(signals, notifier, watchdog);
            if once {
                let reports = daemon::run_once(settings, control).await?;
                for r in &reports {
                    println!("{}", serde_json::to_string(r).unwrap_or_default());
                }
                let worst = reports.iter().map(|r| r.outcome.exit_code()).max().unwrap_or(0);
                return Ok(ExitCode::from(worst));
            }
            let stopped = daemon::run(settings, control).await?;
            Ok(ExitCode::from(stopped.exit_code()))
        }
        Command::Accrue {
            date,
            shard,
            force,
            ignore_pause,
        } => {
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
            let report = oneshot::accrue(&settings, key, force, ignore_pause, progress::wanted()).await?;
            println!("{}", serde_json::to_string(&report).unwrap_or_default());
            Ok(ExitCode::from(report.run.outcome.exit_code()))
        }
        Command::Backfill {
            job,
            from,
            to,
            shards,
            reprocess,
            concurrency,
            dry_run,
            ignore_pause,
        } => {
            let request = backfill::Request {
                job,
                from,
                to,
                shards: shards.unwrap_or(i64::from(settings.instance.shards())),
                reprocess,
                concurrency,
                ignore_pause,
            };
            let plan = backfill::prepare(&settings, request)?;
            telemetry::init(settings.log_format, &settings.log_level);
            let pool = backfill::connect(&settings, &plan).await?;
            if dry_run {
                let summary = backfill::dry_run(&settings, &plan, &pool, output::print_json).await;
                pool.close().await;
                output::print_json(&summary?);
                return Ok(ExitCode::SUCCESS);
            }
            let signals = Signals::install()?;
            let summary = backfill::run(
                &settings,
                &plan,
                pool,
                signals.shutdown,
                progress::wanted(),
                output::print_json,
            )
            .await?;
            output::print_json(&summary);
            Ok(ExitCode::from(summary.exit_code()))
        }
        Command::Pending { action } => {
            telemetry::init(settings.log_format, &settings.log_level);
            let pool = connect(&settings, "fine-settler pending").await?;
            match action {
                PendingAction::List { json } => {
                    output::print_rows(&store::ledger::list(&pool).await?, json, output::pending_table);
                }
                PendingAction::Retry { dead } => {
                    let report = oneshot::retry_pending(&settings, &pool, dead, progress::wanted()).await?;
                    // As a JSON value, so that its keys print in order, as they always have.
                    let report = serde_json::to_value(report).unwrap_or_default();
                    println!("{report}");
                }
            }
            pool.close().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Plan { at } => {
            telemetry::init(settings.log_format, &settings.log_level);
            let at = at.map(|at| at.with_timezone(&Utc));
            for due in daemon::plan(&settings, at).await? {
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
            let pool = connect(&settings, "fine-settler runs").await?;
            let job = job.map(JobName::as_str);
            let pauses = store::pauses::list(&pool, job).await?;
            output::print_pauses(&pauses, json);
            if history {
                let rows = store::job_runs::history(&pool, job, business_date).await?;
                output::print_rows(&rows, json, output::history_table);
            } else {
                let rows = store::job_runs::list(&pool, job, business_date).await?;
                output::print_rows(&rows, json, output::runs_table);
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
            let pool = connect(&settings, "fine-settler release").await?;
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
            if let Some(r) = released.as_ref().filter(|r| r.released) {
                tracing::warn!(job = job.as_str(), %business_date, shard = spec.shard(), shards = spec.shards(),
                    epoch = r.epoch, previous_owner = %r.previous_owner, by = %by, reason = %reason, "claim released");
            }
            Ok(if released.is_some() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Command::Pause {
            job,
            scope,
            reason,
            by,
        } => {
            let scope = pause_scope(&scope)?;
            let by = by.unwrap_or_else(operator);
            telemetry::init(settings.log_format, &settings.log_level);
            let pool = connect(&settings, "fine-settler pause").await?;
            let done = store::pauses::pause(&pool, job, scope, &by, &reason).await?;
            let mut report = done.pause.json();
            report["paused"] = done.new.into();
            report["already_paused"] = (!done.new).into();
            println!("{report}");
            if done.new {
                tracing::warn!(job = job.as_str(), scope = %scope, by = %by, reason = %reason, "job paused");
            }
            pool.close().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Resume { job, scope, by } => {
            let scope = pause_scope(&scope)?;
            let by = by.unwrap_or_else(operator);
            telemetry::init(settings.log_format, &settings.log_level);
            let pool = connect(&settings, "fine-settler resume").await?;
            let lifted = store::pauses::resume(&pool, job, scope, &by).await?;
            let still: Vec<_> = store::pauses::list(&pool, Some(job.as_str()))
                .await?
                .iter()
                .map(store::pauses::Pause::json)
                .collect();
            let (shards, shard) = match scope {
                store::pauses::PauseScope::Job => (None, None),
                store::pauses::PauseScope::Shard(s) => (Some(s.shards()), Some(s.shard())),
            };
            let report = serde_json::json!({
                "job": job.as_str(), "shards": shards, "shard": shard,
                "resumed": lifted.is_some(),
                "paused_by": lifted.as_ref().map(|p| p.by.clone()),
                "reason": lifted.as_ref().map(|p| p.reason.clone()),
                "since": lifted.as_ref().map(|p| p.since),
                "by": by,
                "still_paused": still,
            });
            println!("{report}");
            if let Some(p) = &lifted {
                tracing::info!(job = job.as_str(), scope = %scope, by = %by, paused_by = %p.by, "job resumed");
            }
            pool.close().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Verify { business_date, json } => {
            let month = calendar::settlement_month(business_date)
                .map_err(|e| CliError::Usage(format!("--business-date: {e}")))?;
            telemetry::init(settings.log_format, &settings.log_level);
            let pool = connect(&settings, "fine-settler verify").await?;
            let audit = store::audit::month(&pool, month, &settings.fine).await?;
            output::print_audit(business_date, month, &audit, json);
            Ok(if audit.violations().is_empty() {
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
            let pool = connect(&settings, "fine-settler demo-data").await?;
            let spec = demo::DemoSpec {
                loans,
                seed,
                month,
                first_id,
            };
            let inserted = demo::insert(&pool, spec).await?;
            println!(
                "{}",
                serde_json::json!({"loans": loans, "inserted": inserted, "seed": seed})
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A pool for an operator command.
async fn connect(settings: &Settings, application_name: &str) -> Result<crate::store::Db, StoreError> {
    store::connect(
        &settings.database,
        application_name,
        settings.claim.lease.batch_timeout(),
    )
    .await
}

/// `$USER@host`, naming an operator in the history.
fn operator() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "operator".into());
    format!("{user}@{}", host_name())
}
