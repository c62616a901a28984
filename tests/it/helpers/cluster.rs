//! A primary and its streaming standbys as real PostgreSQL processes, for the tests of failover and of throttling
//! on replica lag: `initdb` for a primary, `pg_basebackup -R` for a standby, `pg_ctl` to stop, start and promote,
//! and the server's own views to wait on. Each server lives in a fresh folder, listens on a free loopback port
//! (TCP only, no Unix socket) and is stopped (immediately) and removed on drop.
//!
//! PostgreSQL refuses to run as root, so as root every server program runs as the `postgres` user, in a folder
//! that user owns.

use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use sqlx::{Connection, PgConnection};
use tempfile::TempDir;
use tokio::process::Command;

/// How long a server may take to start, stop, promote, pause or catch up before the test fails.
const PATIENCE: Duration = Duration::from_secs(60);

/// Appended to every primary's postgresql.conf; a standby inherits it through the base backup. Durability is
/// traded for speed (fsync off, small buffers): nothing here is worth keeping.
const SETTINGS: &str = "
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
max_connections = 50
shared_buffers = '16MB'
fsync = off
wal_level = replica
max_wal_senders = 5
# A standby stopped for a while catches up by streaming, without an archive.
wal_keep_size = '256MB'
hot_standby = on
# A standby reports its positions every second (default 10 s), so the primary's pg_stat_replication is at most a
# second behind the standby's replay, also when no WAL is arriving.
wal_receiver_status_interval = '1s'
";

/// Every connection, replication included, from loopback only and without a password.
const PG_HBA: &str = "host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n";

fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// One PostgreSQL server: a primary from [`Cluster::primary`] or a standby from [`Cluster::standby`].
#[derive(Debug)]
pub struct Cluster {
    /// Its `cluster_name`, which a standby's walreceiver also uses as its `application_name`: the name of its row
    /// in the primary's `pg_stat_replication`.
    name: String,
    port: u16,
    /// Holds `data/` and the server log `log`.
    dir: TempDir,
    /// The folder of the server programs it runs.
    bin: PathBuf,
}

impl Cluster {
    /// Initialises a fresh primary, starts it and waits until it accepts connections.
    pub async fn primary() -> Cluster {
        let primary = Cluster::empty("primary", super::free_port(), super::postgres::pg_bin());
        let mut initdb = primary.program("initdb");
        initdb
            .arg("--pgdata")
            .arg(primary.data())
            .args(["--username=postgres", "--auth=trust", "--encoding=UTF8"])
            .args(["--locale=C.UTF-8", "--no-sync", "--no-instructions"]);
        primary.run(initdb, "initdb").await;
        std::fs::write(primary.data().join("pg_hba.conf"), PG_HBA).expect("write pg_hba.conf");
        primary.configure(SETTINGS);
        primary.start().await;
        primary
    }

    /// A streaming standby of this primary: a base backup (`pg_basebackup -R`), started on another port; returns
    /// once the primary shows it `streaming` in `pg_stat_replication`.
    pub async fn standby(&self) -> Cluster {
        self.standby_with("").await
    }

    /// [`Cluster::standby`] with `settings` appended to its postgresql.conf before it first starts, so that its
    /// walreceiver runs with them from the start (a reload reaches the walreceiver some time after
    /// `pg_reload_conf()` returns).
    pub async fn standby_with(&self, settings: &str) -> Cluster {
        let standby = Cluster::empty("standby", super::free_port(), super::postgres::pg_bin());
        standby.follow(self.port, settings).await;
        standby
    }

    /// A streaming standby, on `port`, of a server this test did not start (a Citus worker): a base backup of
    /// the server on `primary_port` with the programs of `bin` (its PostgreSQL's), `settings` appended to the
    /// postgresql.conf it copied; returns once the server shows it `streaming`. Stopped and removed on drop; the
    /// server it follows is left alone.
    pub async fn standby_of(primary_port: u16, port: u16, bin: PathBuf, settings: &str) -> Cluster {
        let standby = Cluster::empty("standby", port, bin);
        standby.follow(primary_port, settings).await;
        standby
    }

    /// Makes this empty server a standby of the server on `primary_port` and starts it (see
    /// [`Cluster::standby_with`]).
    async fn follow(&self, primary_port: u16, settings: &str) {
        let standby = self;
        let mut backup = self.program("pg_basebackup");
        backup
            .arg("--pgdata")
            .arg(standby.data())
            .args([
                "--host=127.0.0.1",
                &format!("--port={primary_port}"),
                "--username=postgres",
            ])
            // --write-recovery-conf (-R): standby.signal and primary_conninfo, so that it follows the primary.
            // The backup starts with a checkpoint: a fast one, not one spread over checkpoint_timeout.
            .args([
                "--write-recovery-conf",
                "--checkpoint=fast",
                "--wal-method=stream",
                "--no-sync",
            ]);
        self.run(backup, "pg_basebackup").await;
        // -R writes every libpq option pg_basebackup's libpq knows into primary_conninfo; a server whose
        // walreceiver links an older libpq refuses the newer ones (PyPI's PostgreSQL 18 build: "invalid
        // connection option sslnegotiation"), so the standby follows with the few that matter (the last setting
        // in postgresql.auto.conf wins).
        {
            use std::io::Write;
            let mut auto = std::fs::OpenOptions::new()
                .append(true)
                .open(standby.data().join("postgresql.auto.conf"))
                .expect("open postgresql.auto.conf");
            writeln!(
                auto,
                "primary_conninfo = 'host=127.0.0.1 port={primary_port} user=postgres'"
            )
            .expect("write postgresql.auto.conf");
            // Without TLS, as the tests connect: a Citus node's backup carries the `ssl = on` Citus set with
            // `alter system` when its extension was created.
            writeln!(auto, "ssl = off").expect("write postgresql.auto.conf");
        }
        standby.configure(settings);
        standby.start().await;
        self.wait_at(
            &format!("postgres://postgres@127.0.0.1:{primary_port}/postgres?sslmode=disable"),
            &format!("{} streaming", standby.name),
            &format!(
                "select exists (select from pg_stat_replication
                                where application_name = '{}' and state = 'streaming')",
                standby.name
            ),
        )
        .await;
    }

    /// A fresh folder, owned by the user the server runs as, and a free port.
    fn empty(role: &str, port: u16, bin: PathBuf) -> Cluster {
        let dir = tempfile::Builder::new()
            .prefix(&format!("fine-settler-{role}-"))
            .tempdir()
            .expect("temporary folder");
        if running_as_root() {
            let chown = std::process::Command::new("chown")
                .arg("postgres:")
                .arg(dir.path())
                .status()
                .expect("chown");
            assert!(chown.success(), "chown postgres: {}", dir.path().display());
        }
        Cluster {
            name: format!("{role}_{port}"),
            port,
            dir,
            bin,
        }
    }

    /// Appends `settings`, then this server's own port and name, to its postgresql.conf (the last setting of a
    /// name wins, so a standby's own replace those it copied from its primary).
    fn configure(&self, settings: &str) {
        use std::io::Write;
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(self.data().join("postgresql.conf"))
            .expect("open postgresql.conf");
        write!(
            conf,
            "{settings}\nport = {}\ncluster_name = '{}'\n",
            self.port, self.name
        )
        .expect("write postgresql.conf");
    }

    /// The server program `name`, run as `postgres` when we are root, in the server's folder (blocking, for drop).
    fn blocking_program(&self, name: &str) -> std::process::Command {
        let path = self.bin.join(name);
        let mut cmd = if running_as_root() {
            let mut runuser = std::process::Command::new("runuser");
            runuser.args(["-u", "postgres", "--"]).arg(path);
            runuser
        } else {
            std::process::Command::new(path)
        };
        cmd.current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        cmd
    }

    /// The server program `name`, run as `postgres` when we are root, in the server's folder.
    fn program(&self, name: &str) -> Command {
        let mut cmd = Command::from(self.blocking_program(name));
        cmd.kill_on_drop(true);
        cmd
    }

    /// Runs `cmd` to completion; fails the test with its stderr and the server log unless it succeeded.
    async fn run(&self, mut cmd: Command, what: &str) {
        let out = cmd.output().await.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(
            out.status.success(),
            "{what} ({}) failed: {}\nserver log:\n{}",
            self.name,
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
    }

    /// `pg_ctl` with `args` on this server's data folder.
    async fn pg_ctl(&self, args: &[&str], what: &str) {
        let mut pg_ctl = self.program("pg_ctl");
        pg_ctl
            .arg("--pgdata")
            .arg(self.data())
            .args(["--wait", &format!("--timeout={}", PATIENCE.as_secs())])
            .args(args);
        self.run(pg_ctl, what).await;
    }

    /// Polls `sql`, which returns one boolean, every 50 ms until it is true; fails with the server log after
    /// [`PATIENCE`].
    async fn wait_for(&self, what: &str, sql: &str) {
        self.wait_at(&self.url("postgres"), what, sql).await;
    }

    /// [`Cluster::wait_for`] on the server at `url` (this one's log shown on failure).
    async fn wait_at(&self, url: &str, what: &str, sql: &str) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        let mut conn = PgConnection::connect(url)
            .await
            .unwrap_or_else(|e| panic!("{what}: connect to {url}: {e}"));
        loop {
            let done: bool = sqlx::query_scalar(sql)
                .fetch_one(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            if done {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}; server log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The server's folder (its data folder and log); gone once the `Cluster` is dropped.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Freezes the server (SIGSTOP to the postmaster and every process it started): it keeps its sockets but
    /// answers nothing, as a frozen host or a partition does.
    pub fn freeze(&self) {
        self.signal_all("STOP");
    }

    /// Thaws a frozen server.
    pub fn thaw(&self) {
        self.signal_all("CONT");
    }

    /// Sends `signal` to the postmaster first (stopped, it starts no new process), then to every process it
    /// started. A child that exits meanwhile (a backend ending, an autovacuum worker done) is not an error: `kill`
    /// fails for it alone, after signalling the others.
    fn signal_all(&self, signal: &str) {
        let pid = std::fs::read_to_string(self.data().join("postmaster.pid")).expect("postmaster.pid");
        let pid = pid.lines().next().expect("pid").trim().to_string();
        let kill = |pids: &[String]| {
            std::process::Command::new("kill")
                .arg(format!("-{signal}"))
                .args(pids)
                .stderr(std::process::Stdio::null())
                .status()
                .expect("kill")
        };
        assert!(kill(std::slice::from_ref(&pid)).success(), "kill -{signal} {pid}");
        let children = std::process::Command::new("pgrep")
            .args(["-P", &pid])
            .output()
            .expect("pgrep");
        let children: Vec<String> = String::from_utf8_lossy(&children.stdout)
            .split_whitespace()
            .map(str::to_string)
            .collect();
        if !children.is_empty() {
            kill(&children);
        }
    }

    /// Its `cluster_name`; a standby's row in the primary's `pg_stat_replication` has it as `application_name`.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:PORT/DATABASE`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// A fresh primary with an empty database `libraryd` (not migrated).
    pub async fn primary_with_libraryd() -> Cluster {
        let primary = Cluster::primary().await;
        sqlx::Executor::execute(&mut primary.connect().await, "create database libraryd")
            .await
            .expect("create database");
        primary
    }

    /// A new connection to the `postgres` database.
    pub async fn connect(&self) -> PgConnection {
        PgConnection::connect(&self.url("postgres"))
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.name))
    }

    /// Starts the server (again, after a stop: same folder, same port) and waits until it accepts connections.
    pub async fn start(&self) {
        let log = self.dir.path().join("log");
        let log = log.to_str().expect("a UTF-8 temporary folder");
        self.pg_ctl(&["--log", log, "start"], "pg_ctl start").await;
    }

    /// `pg_ctl stop -m immediate`: the server dies as in a crash, without a shutdown checkpoint; in-flight
    /// transactions are lost, and what was not yet sent to a standby never reaches it.
    pub async fn stop_immediate(&self) {
        self.pg_ctl(&["--mode=immediate", "stop"], "pg_ctl stop -m immediate")
            .await;
    }

    /// `pg_ctl stop -m fast`: connections are cut, in-flight transactions roll back, a shutdown checkpoint is
    /// written (and, on a primary, streamed to its standbys) before the server exits.
    pub async fn stop_fast(&self) {
        self.pg_ctl(&["--mode=fast", "stop"], "pg_ctl stop -m fast").await;
    }

    /// Promotes a standby (`pg_ctl promote -w`) and waits until `pg_is_in_recovery()` is false: it then takes
    /// writes, on a new timeline.
    pub async fn promote(&self) {
        self.pg_ctl(&["promote"], "pg_ctl promote").await;
        self.wait_for(
            &format!("{} out of recovery", self.name),
            "select not pg_is_in_recovery()",
        )
        .await;
    }

    /// Pauses a standby's replay (`pg_wal_replay_pause()`) and waits until it has paused: WAL still arrives and is
    /// reported received, but none of it is applied, so the standby's data and `replay_lsn` stand still.
    pub async fn pause_replay(&self) {
        sqlx::query("select pg_wal_replay_pause()")
            .execute(&mut self.connect().await)
            .await
            .expect("pg_wal_replay_pause()");
        self.wait_for(
            &format!("{} replay paused", self.name),
            "select pg_get_wal_replay_pause_state() = 'paused'",
        )
        .await;
    }

    /// Resumes a standby's paused replay (`pg_wal_replay_resume()`).
    pub async fn resume_replay(&self) {
        sqlx::query("select pg_wal_replay_resume()")
            .execute(&mut self.connect().await)
            .await
            .expect("pg_wal_replay_resume()");
        self.wait_for(
            &format!("{} replay resumed", self.name),
            "select pg_get_wal_replay_pause_state() = 'not paused'",
        )
        .await;
    }

    /// Waits until this standby has replayed everything `primary` had written when called (its
    /// `pg_last_wal_replay_lsn()` reached the primary's `pg_current_wal_lsn()`).
    pub async fn wait_replayed(&self, primary: &Cluster) {
        let lsn: String = sqlx::query_scalar("select pg_current_wal_lsn()::text")
            .fetch_one(&mut primary.connect().await)
            .await
            .expect("pg_current_wal_lsn()");
        self.wait_for(
            &format!("{} replayed up to {lsn}", self.name),
            &format!("select pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"),
        )
        .await;
    }

    /// What the server has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Blocking, as drop must be. A server already stopped makes pg_ctl fail, which is fine. The folder is
        // removed when `dir` drops, right after this.
        let mut stop = self.blocking_program("pg_ctl");
        stop.arg("--pgdata")
            .arg(self.data())
            .args(["--wait", "--mode=immediate", "stop"]);
        let _ = stop.output();
    }
}
