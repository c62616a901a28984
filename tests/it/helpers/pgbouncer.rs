//! A real PgBouncer (Debian's package) in front of the test server, one process per test: its own configuration,
//! port and log in a temporary folder, killed when the test drops it.
//!
//! The configuration keeps PgBouncer's defaults (no `ignore_startup_parameters`, no `max_prepared_statements`,
//! `server_reset_query = DISCARD ALL`), because those are what the product has to live with. It sets only:
//! - `listen_addr = 127.0.0.1` and a free `listen_port`; `unix_socket_dir =` (none), because a bouncer killed
//!   by a failing test would leave its socket file in /tmp (the test server has no Unix socket either);
//! - `pool_mode`;
//! - one wildcard database, `* = host=… port=…` (the test server of `DATABASE_URL`), so every per-test database
//!   of `#[sqlx::test]` is reachable under its own name;
//! - `auth_type = trust` with an `auth_file` naming the test server's user: the test server trusts loopback
//!   connections, and PgBouncer's `trust` still admits only users listed in its auth file (with no auth file,
//!   every login fails with `"trust" authentication failed`). The password in it is empty; nothing is secret;
//! - `default_pool_size = 50` (default 20): in session mode a client keeps its server connection for its whole
//!   session, so the pool of one database must hold every client connection at once, or the surplus clients
//!   queue for `query_wait_timeout` (two minutes) instead of failing. A test with 6 replicas opens up to
//!   6 × (4 job connections + 1 status page connection) = 30, plus the test's own pool (up to 10);
//! - `max_client_conn = 200` (default 100): several such databases' clients with room to spare, well under the
//!   1024 file descriptors PgBouncer gets here (it needs about one per client and one per server connection).
//!
//! PgBouncer refuses to run as root; as root, the process is started as the `postgres` user (set on the child
//! itself, so no `runuser` stands between the test and the process it kills). Its log goes to stderr (it logs
//! there when it runs in the foreground, including a configuration error it meets before any log file would be
//! opened), which is a file in the temporary folder, read by [`PgBouncer::log`].

use std::{
    fs::File,
    os::unix::{
        fs::{chown, MetadataExt},
        process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    str::FromStr,
    time::Duration,
};

use sqlx::postgres::PgConnectOptions;
use tempfile::TempDir;

use super::free_port;

/// Where Debian's package installs the binary (often not on PATH); PATH is searched after it.
const DEBIAN_BINARY: &str = "/usr/sbin/pgbouncer";

/// How long PgBouncer may take to start listening.
const START_LIMIT: Duration = Duration::from_secs(10);

/// PgBouncer's `pool_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// A server connection is a client's only for one transaction.
    Transaction,
    /// A server connection is a client's from login to logout.
    Session,
}

impl PoolMode {
    fn as_config(self) -> &'static str {
        match self {
            PoolMode::Transaction => "transaction",
            PoolMode::Session => "session",
        }
    }
}

/// A running PgBouncer in front of the server named by `DATABASE_URL`. Dropping it kills the process.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    port: u16,
    log: PathBuf,
    // Removed after the process is killed (fields drop after `Drop::drop`).
    _dir: TempDir,
}

impl PgBouncer {
    /// Starts a PgBouncer in `mode` and waits until it accepts connections. Panics with the reason (and the
    /// bouncer's log) if it cannot start.
    pub async fn start(mode: PoolMode) -> PgBouncer {
        let server = std::env::var("DATABASE_URL").expect("DATABASE_URL");
        PgBouncer::start_in_front_of(&server, mode).await
    }

    /// Like [`PgBouncer::start`], in front of the server `server_url` names (a private one).
    pub async fn start_in_front_of(server_url: &str, mode: PoolMode) -> PgBouncer {
        let binary = locate(&search_path()).unwrap_or_else(|e| panic!("{e}"));
        let server = PgConnectOptions::from_str(server_url).expect("a PostgreSQL URL");
        // Another process may take the free port before PgBouncer binds it; then PgBouncer exits, and a new
        // port is tried.
        let mut last_log = String::new();
        for _ in 0..5 {
            let port = free_port();
            let dir = write_config(&server, mode, port);
            let log = dir.path().join("pgbouncer.log");
            let mut cmd = Command::new(&binary);
            cmd.arg(dir.path().join("pgbouncer.ini"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(File::create(&log).expect("create pgbouncer.log"));
            if let Some((uid, gid)) = unprivileged_user() {
                cmd.uid(uid).gid(gid);
            }
            let child = cmd.spawn().expect("spawn pgbouncer");
            let mut bouncer = PgBouncer {
                child,
                port,
                log,
                _dir: dir,
            };
            if bouncer.wait_listening().await {
                return bouncer;
            }
            last_log = bouncer.log();
        }
        panic!("pgbouncer did not start; its log:\n{last_log}");
    }

    /// The port it listens on, at 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `database_url` (a database on the test server) as reached through this bouncer: same user, same
    /// database name and parameters, the bouncer's address.
    pub fn url_for(&self, database_url: &str) -> String {
        let (scheme, rest) = database_url
            .split_once("://")
            .unwrap_or_else(|| panic!("{database_url:?} is not a URL"));
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let user = authority.rsplit_once('@').map(|(user, _)| user);
        match user {
            Some(user) => format!("{scheme}://{user}@127.0.0.1:{}{path}", self.port),
            None => format!("{scheme}://127.0.0.1:{}{path}", self.port),
        }
    }

    /// Everything PgBouncer has logged so far (for a failing test's message).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_else(|e| format!("(cannot read {:?}: {e})", self.log))
    }

    /// Polls the port until PgBouncer accepts a connection (true), or it exits or the time is up (false).
    async fn wait_listening(&mut self) -> bool {
        let deadline = tokio::time::Instant::now() + START_LIMIT;
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return true;
            }
            if self.child.try_wait().expect("try_wait").is_some() || tokio::time::Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // A bouncer that already exited is not signalled again.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The PgBouncer binary among `candidates`, or the error to fail with.
pub fn locate(candidates: &[PathBuf]) -> Result<PathBuf, String> {
    candidates
        .iter()
        .find(|path| path.is_file())
        .cloned()
        .ok_or_else(|| "pgbouncer not found; scripts/test.sh installs it".to_string())
}

/// Debian's location, then every folder on PATH.
fn search_path() -> Vec<PathBuf> {
    let mut candidates = vec![PathBuf::from(DEBIAN_BINARY)];
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|dir| dir.join("pgbouncer")));
    }
    candidates
}

/// The `postgres` user's uid and gid when this process is root (PgBouncer refuses to run as root), else none.
fn unprivileged_user() -> Option<(u32, u32)> {
    // /proc/self belongs to the process's effective user.
    let me = std::fs::metadata("/proc/self").expect("stat /proc/self").uid();
    if me != 0 {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").expect("read /etc/passwd");
    let entry = passwd
        .lines()
        .find(|line| line.starts_with("postgres:"))
        .expect("as root, pgbouncer runs as the postgres user, which /etc/passwd does not have");
    let fields: Vec<&str> = entry.split(':').collect();
    Some((
        fields[2].parse().expect("postgres uid"),
        fields[3].parse().expect("postgres gid"),
    ))
}

/// A temporary folder with `pgbouncer.ini` and its auth file, readable by the user PgBouncer runs as.
fn write_config(server: &PgConnectOptions, mode: PoolMode, port: u16) -> TempDir {
    let dir = tempfile::Builder::new()
        .prefix("fine-settler-pgbouncer-")
        .tempdir()
        .expect("tempdir");
    let auth_file = dir.path().join("users.txt");
    std::fs::write(&auth_file, format!("\"{}\" \"\"\n", server.get_username())).expect("write auth file");
    let ini = format!(
        "[databases]\n\
         * = host={host} port={server_port}\n\
         \n\
         [pgbouncer]\n\
         listen_addr = 127.0.0.1\n\
         listen_port = {port}\n\
         unix_socket_dir =\n\
         pool_mode = {mode}\n\
         auth_type = trust\n\
         auth_file = {auth_file}\n\
         default_pool_size = 50\n\
         max_client_conn = 200\n",
        host = server.get_host(),
        server_port = server.get_port(),
        mode = mode.as_config(),
        auth_file = auth_file.display(),
    );
    std::fs::write(dir.path().join("pgbouncer.ini"), ini).expect("write pgbouncer.ini");
    if let Some((uid, gid)) = unprivileged_user() {
        for path in [dir.path(), &auth_file, &dir.path().join("pgbouncer.ini")] {
            chown(path, Some(uid), Some(gid)).expect("chown the pgbouncer folder");
        }
    }
    dir
}

#[test]
fn a_missing_binary_is_named_with_the_way_to_install_it() {
    let missing = [Path::new("/nonexistent/pgbouncer").to_path_buf()];
    assert_eq!(
        locate(&missing),
        Err("pgbouncer not found; scripts/test.sh installs it".to_string())
    );
}
