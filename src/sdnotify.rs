//! The systemd notification protocol (`sd_notify(3)`), written out: one datagram per message to the socket
//! named by `NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace). Without `NOTIFY_SOCKET` every call
//! is a no-op, so the same binary runs under systemd, Kubernetes or a shell.
//!
//! - `READY=1` once the pool has connected and every migration is applied ([`crate::daemon::Daemon::run`]);
//! - `WATCHDOG=1` only from the replica's own progress: each wake of the scheduler loop (at most a second
//!   apart while idle), each tick attempt and each committed batch report to the replica's
//!   [`crate::health::Heartbeat`], which calls [`Watchdog::pet`]. A wedged loop stops petting and systemd
//!   restarts the unit after `WatchdogSec`;
//! - `STOPPING=1` on the first shutdown signal, `STATUS=…` for `systemctl status`.

use std::{
    os::unix::net::UnixDatagram,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// Where notifications go.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    target: Target,
}

#[derive(Debug)]
enum Target {
    Path(std::path::PathBuf),
    Abstract(Vec<u8>),
}

impl Notifier {
    /// The notifier named by `NOTIFY_SOCKET` in `env`, if any.
    pub fn from_env(env: &std::collections::HashMap<String, String>) -> std::io::Result<Option<Notifier>> {
        let Some(name) = env.get("NOTIFY_SOCKET").filter(|s| !s.is_empty()) else {
            return Ok(None);
        };
        let target = match name.strip_prefix('@') {
            Some(abs) => Target::Abstract(abs.as_bytes().to_vec()),
            None if name.starts_with('/') => Target::Path(name.into()),
            None => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("NOTIFY_SOCKET {name:?} is neither an absolute path nor an abstract name (@…)"),
                ))
            }
        };
        Ok(Some(Notifier {
            socket: UnixDatagram::unbound()?,
            target,
        }))
    }

    /// Sends one message (newline-separated `KEY=value` assignments).
    pub fn notify(&self, state: &str) -> std::io::Result<()> {
        let sent = match &self.target {
            Target::Path(path) => self.socket.send_to(state.as_bytes(), path)?,
            Target::Abstract(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                self.socket.send_to_addr(state.as_bytes(), &addr)?
            }
        };
        if sent != state.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                "short write to NOTIFY_SOCKET",
            ));
        }
        Ok(())
    }

    /// Sends `state`, logging (not failing) when the manager cannot be reached: notification is best effort,
    /// and a missed `WATCHDOG=1` is what the watchdog is for.
    pub fn send(&self, state: &str) {
        if let Err(e) = self.notify(state) {
            tracing::warn!(error = %e, state, "cannot notify the service manager");
        }
    }
}

/// The systemd watchdog: the interval systemd expects pings at (`WATCHDOG_USEC`), and the last ping sent.
#[derive(Debug)]
pub struct Watchdog {
    notifier: Arc<Notifier>,
    /// `WatchdogSec`.
    pub timeout: Duration,
    last: Mutex<Option<Instant>>,
}

impl Watchdog {
    /// The watchdog systemd asked for: `WATCHDOG_USEC` set (and `WATCHDOG_PID`, if set, naming this process).
    pub fn from_env(
        env: &std::collections::HashMap<String, String>,
        notifier: Arc<Notifier>,
    ) -> Result<Option<Watchdog>, String> {
        let Some(usec) = env.get("WATCHDOG_USEC").filter(|s| !s.is_empty()) else {
            return Ok(None);
        };
        if let Some(pid) = env.get("WATCHDOG_PID").filter(|s| !s.is_empty()) {
            if pid.parse::<u32>().ok() != Some(std::process::id()) {
                return Ok(None);
            }
        }
        let usec: u64 = usec
            .parse()
            .ok()
            .filter(|&u| u > 0)
            .ok_or_else(|| format!("WATCHDOG_USEC: {usec:?} is not a positive number of microseconds"))?;
        Ok(Some(Watchdog {
            notifier,
            timeout: Duration::from_micros(usec),
            last: Mutex::new(None),
        }))
    }

    /// Called by the loop whenever it makes progress; sends `WATCHDOG=1` at most every quarter of the timeout.
    pub fn pet(&self) {
        let now = Instant::now();
        let Ok(mut last) = self.last.lock() else {
            return;
        };
        if last.is_some_and(|t| now.duration_since(t) < self.timeout / 4) {
            return;
        }
        *last = Some(now);
        drop(last);
        self.notifier.send("WATCHDOG=1");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::env;

    #[test]
    fn no_socket_means_no_notifier() {
        assert!(Notifier::from_env(&env(&[])).expect("ok").is_none());
        assert!(Notifier::from_env(&env(&[("NOTIFY_SOCKET", "")]))
            .expect("ok")
            .is_none());
        assert!(Notifier::from_env(&env(&[("NOTIFY_SOCKET", "relative")])).is_err());
    }

    #[test]
    fn messages_arrive_on_a_path_socket_and_pets_are_rate_limited() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify.sock");
        let server = UnixDatagram::bind(&path).expect("bind");
        server.set_nonblocking(true).expect("nonblocking");
        let e = env(&[
            ("NOTIFY_SOCKET", path.to_str().expect("utf-8")),
            ("WATCHDOG_USEC", "4000000"),
        ]);
        let notifier = Notifier::from_env(&e).expect("ok").expect("notifier");
        notifier.send("READY=1\nSTATUS=ticking");
        let mut buf = [0u8; 256];
        let n = server.recv(&mut buf).expect("ready");
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=ticking");

        let dog = Watchdog::from_env(&e, Arc::new(notifier))
            .expect("ok")
            .expect("watchdog");
        assert_eq!(dog.timeout, Duration::from_secs(4));
        for _ in 0..100 {
            dog.pet();
        }
        let n = server.recv(&mut buf).expect("first pet");
        assert_eq!(&buf[..n], b"WATCHDOG=1");
        assert!(
            server.recv(&mut buf).is_err(),
            "pets within a quarter of the timeout are merged"
        );
    }

    #[test]
    fn abstract_sockets_and_foreign_watchdog_pids() {
        let name = format!("fine-settler-test-{}", std::process::id());
        let addr = {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).expect("addr")
        };
        let server = UnixDatagram::bind_addr(&addr).expect("bind abstract");
        let e = env(&[
            ("NOTIFY_SOCKET", &format!("@{name}")),
            ("WATCHDOG_USEC", "1000000"),
        ]);
        let notifier = Arc::new(Notifier::from_env(&e).expect("ok").expect("notifier"));
        notifier.send("STOPPING=1");
        let mut buf = [0u8; 64];
        let n = server.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..n], b"STOPPING=1");

        let mut foreign = e.clone();
        foreign.insert("WATCHDOG_PID".into(), "1".into());
        assert!(Watchdog::from_env(&foreign, notifier.clone())
            .expect("ok")
            .is_none());
        let mut bad = e.clone();
        bad.insert("WATCHDOG_USEC".into(), "soon".into());
        assert!(Watchdog::from_env(&bad, notifier)
            .expect_err("bad")
            .contains("WATCHDOG_USEC"));
    }
}
