//! `run`: the replica, with the process's signals and the service manager (systemd) when the environment names
//! one; `run --once`: one tick, its reports, exit.

use std::{collections::HashMap, process::ExitCode, sync::Arc};

use crate::{
    cli::{args::RunArgs, CliError, Context},
    config::Settings,
    daemon::{self, Control},
    sdnotify::{Notifier, Watchdog},
    signals::Signals,
    store::policies,
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

/// Refuses to start (exit 2) when a `[fine]` key set in this replica's file or environment differs from the
/// database's `default` policy in force today, after seeding an empty `fine_policies` from those keys (as
/// `migrate` does) — in that order, so that of two replicas with different keys starting together on an empty
/// table one seeds and the other is refused. A replica that sets no key is not asked (it seeds once ready, with
/// the compiled-in values); one whose database cannot be reached now starts anyway (it rides out the outage as
/// ever) and says that the keys went unchecked. `run --once` included.
async fn check_fine_keys(ctx: &Context) -> Result<(), CliError> {
    if ctx.fine_keys.is_empty() {
        return Ok(());
    }
    let in_force = async {
        let pool = ctx.connect("fine-settler run").await?;
        if let Err(e) = policies::seed_default_by(&pool, &ctx.settings.fine, "run").await {
            pool.close().await;
            return Err(CliError::from(e));
        }
        let today = super::database_today(ctx, &pool).await;
        let version = match today {
            Ok(today) => policies::governing(&pool, None, today)
                .await
                .map_err(CliError::from),
            Err(e) => Err(e),
        };
        pool.close().await;
        version
    };
    match in_force.await {
        Ok(version) => Ok(ctx.fine_keys.check(version.as_ref())?),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the fine policy in force: the [fine] keys of this replica were \
                                        not compared with the database");
            Ok(())
        }
    }
}

/// Runs the replica until a signal stops it (exit 0 after a clean drain), or, with `--once`, one tick whose
/// reports it prints (exit: the worst run's).
pub async fn run(ctx: &Context, args: RunArgs) -> Result<ExitCode, CliError> {
    check_fine_keys(ctx).await?;
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
