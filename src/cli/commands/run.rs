//! `run`: the replica, with the process's signals and the service manager (systemd) when the environment names
//! one; `run --once`: one tick, its reports, exit.

use std::{collections::HashMap, process::ExitCode, sync::Arc};

use crate::{
    cli::{args::RunArgs, CliError, Context},
    config::Settings,
    daemon::{self, Control},
    sdnotify::{Notifier, Watchdog},
    signals::Signals,
};

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

/// Runs the replica until a signal stops it (exit 0 after a clean drain), or, with `--once`, one tick whose
/// reports it prints (exit: the worst run's).
pub async fn run(ctx: &Context, args: RunArgs) -> Result<ExitCode, CliError> {
    let (notifier, watchdog) = service_manager(&ctx.settings)?;
    let signals = Signals::install_notifying(notifier.clone())?;
    let control = Control::from_signals(signals, notifier, watchdog);
    let settings = ctx.settings.clone();
    if args.once {
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
