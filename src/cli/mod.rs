//! The command line: argument parsing ([`args`]), configuration loading, the one place logging is initialised,
//! dispatch to one function per command ([`commands`]), output ([`output`]), and the mapping of errors to exit
//! codes (0 success or skip, 1 runtime failure, 2 usage or configuration, 3 `verify` found violations). Reports
//! go to stdout, logs to stderr. Signal handlers are installed by the commands here and nowhere else; the work
//! itself lives in [`crate::jobs::oneshot`] (the one-shot runs), [`crate::jobs::backfill`] (`backfill`),
//! [`crate::daemon`] (the replica) and [`crate::store`].

pub mod args;
mod commands;
pub mod output;

use std::{collections::HashMap, path::Path, process::ExitCode};

use clap::Parser;

use crate::{
    config::{self, ConfigError, FineKeys, RawSettings, Settings},
    daemon,
    jobs::{backfill::BackfillError, oneshot},
    store::{Db, StoreError},
    telemetry,
};
pub use args::{
    CalendarAction, Cli, Command, DriftMode, PauseScopeArgs, PendingAction, PolicyAction, ShardArgs,
};

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
    /// A `[fine]` key of this replica differs from the database's policy; nothing was written.
    #[error(transparent)]
    FineKeys(#[from] config::FineKeysDiffer),
    /// `settle`/`accrue` of a paused job (or shard) without `--ignore-pause`; nothing was written.
    #[error(transparent)]
    Paused(oneshot::Refused),
}

impl CliError {
    /// The process's exit code for this error: 2 when nothing was written because the input was wrong, else 1.
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Usage(_) | CliError::Config(_) | CliError::Start(_) | CliError::FineKeys(_) => {
                ExitCode::from(2)
            }
            CliError::Backfill(BackfillError::Usage { .. }) => ExitCode::from(2),
            // `database.engine` does not say what the server is: a configuration error, found before writing.
            CliError::Store(StoreError::Citus(e)) if e.is_engine_mismatch() => ExitCode::from(2),
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
            CliError::FineKeys(e) => vec![e.to_string()],
            other => vec![format!("fine-settler: {other}")],
        }
    }
}

impl From<oneshot::Refused> for CliError {
    fn from(e: oneshot::Refused) -> Self {
        match e {
            oneshot::Refused::NotOver(e) => CliError::Usage(format!("{}: {e}", e.flag())),
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

/// What every command starts from: the configuration, loaded and validated before anything else happens.
#[derive(Debug)]
pub struct Context {
    /// The layers as read (`check-config` prints them with the effective values).
    pub raw: RawSettings,
    /// The validated settings every other command works with.
    pub settings: Settings,
    /// The `[fine]` keys the file or environment sets, which `run` compares with the database's policy.
    pub fine_keys: FineKeys,
}

impl Context {
    /// Loads and validates the configuration; nothing touches the database before this has passed.
    pub fn load(file: Option<&Path>) -> Result<Self, CliError> {
        let env: HashMap<String, String> = std::env::vars().collect();
        let raw = config::load(file, &env)?;
        let settings = raw.validate(&env)?;
        let fine_keys = FineKeys::read(file, &env, settings.fine)?;
        Ok(Context {
            raw,
            settings,
            fine_keys,
        })
    }

    /// A pool for an operator command, named `application_name` in `pg_stat_activity`.
    pub async fn connect(&self, application_name: &str) -> Result<Db, StoreError> {
        crate::store::connect(
            &self.settings.database,
            application_name,
            self.settings.claim.lease.batch_timeout(),
        )
        .await
    }
}

/// Runs one command: loads the configuration, initialises logging once (for every command that logs), and
/// hands over to the command's function.
pub async fn run(cli: Cli) -> Result<ExitCode, CliError> {
    let ctx = Context::load(cli.config.as_deref())?;
    if cli.command.logs() {
        // Only the subscriber is installed here: it writes nothing, so a command that refuses its arguments
        // afterwards prints exactly what it printed when it checked them first.
        telemetry::init(ctx.settings.log_format, &ctx.settings.log_level);
    }
    match cli.command {
        Command::CheckConfig => commands::check_config(&ctx),
        Command::Migrate => commands::migrate(&ctx).await,
        Command::Run(args) => commands::run(&ctx, args).await,
        Command::Settle(args) => commands::settle(&ctx, args).await,
        Command::Accrue(args) => commands::accrue(&ctx, args).await,
        Command::Backfill(args) => commands::backfill(&ctx, args).await,
        Command::Pending { action } => commands::pending(&ctx, action).await,
        Command::Plan(args) => commands::plan(&ctx, args).await,
        Command::Drift(args) => commands::drift(args).await,
        Command::Runs(args) => commands::runs(&ctx, args).await,
        Command::Release(args) => commands::release(&ctx, args).await,
        Command::Pause(args) => commands::pause(&ctx, args).await,
        Command::Resume(args) => commands::resume(&ctx, args).await,
        Command::Verify(args) => commands::verify(&ctx, args).await,
        Command::DemoData(args) => commands::demo_data(&ctx, args).await,
        Command::Policy { action } => commands::policy(&ctx, action).await,
        Command::Calendar { action } => commands::calendar(&ctx, action).await,
    }
}
