//! A private PostgreSQL server for the tests that must restart the server or load a preload library: initdb in a
//! fresh folder, a free loopback port, stopped and removed on drop. Its programs are those of
//! [`crate::helpers::pg_bin`].

use std::{
    path::PathBuf,
    process::{Command, Stdio},
};

pub struct PrivateServer {
    dir: String,
    port: u16,
    bin: PathBuf,
    as_postgres: bool,
}

impl PrivateServer {
    /// Initialises and starts a server; `extra` are `-c name=value` settings.
    pub fn start(extra: &[&str]) -> Self {
        Self::start_with(extra, None)
    }

    /// Starts a server whose TCP connections need `postgres`'s password (scram-sha-256).
    pub fn start_with_password(password: &str) -> Self {
        Self::start_with(&[], Some(password))
    }

    fn start_with(extra: &[&str], password: Option<&str>) -> Self {
        let as_postgres = Command::new("id")
            .arg("-u")
            .output()
            .map(|o| o.stdout == b"0\n")
            .unwrap_or(false);
        let mut mktemp = Self::command_as(as_postgres, "mktemp");
        mktemp.args(["-d", "-t", "fine-settler-it-XXXXXX"]);
        let dir = String::from_utf8(mktemp.output().expect("mktemp").stdout)
            .expect("utf8")
            .trim()
            .to_string();
        let server = PrivateServer {
            dir,
            port: crate::helpers::free_port(),
            bin: crate::helpers::pg_bin(),
            as_postgres,
        };
        let mut initdb = server.tool("initdb");
        initdb.args(["-D", &server.data(), "-U", "postgres", "--no-sync"]);
        match password {
            None => {
                initdb.arg("--auth=trust");
            }
            Some(password) => {
                let file = format!("{}/pwfile", server.dir);
                std::fs::write(&file, password).expect("password file");
                initdb.args([
                    "--auth-local=trust",
                    "--auth-host=scram-sha-256",
                    &format!("--pwfile={file}"),
                ]);
            }
        }
        server.check(initdb, "initdb");
        let mut options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories= -c fsync=off -c max_connections=100",
            server.port
        );
        for setting in extra {
            options.push_str(" -c ");
            options.push_str(setting);
        }
        let mut start = server.tool("pg_ctl");
        start.args([
            "-D",
            &server.data(),
            "-l",
            &format!("{}/log", server.dir),
            "-o",
            &options,
            "-w",
            "start",
        ]);
        server.check(start, "pg_ctl start");
        server
    }

    fn command_as(as_postgres: bool, program: &str) -> Command {
        if as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", program]);
            c
        } else {
            Command::new(program)
        }
    }

    fn tool(&self, name: &str) -> Command {
        let mut c = Self::command_as(self.as_postgres, &self.bin.join(name).to_string_lossy());
        c.stdout(Stdio::null()).stderr(Stdio::piped());
        c
    }

    fn check(&self, mut cmd: Command, what: &str) {
        let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(
            out.status.success(),
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn data(&self) -> String {
        format!("{}/data", self.dir)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Creates `database`, applies the migrations with the real binary, and returns its URL.
    pub async fn migrated_database(&self, database: &str) -> String {
        let admin = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&self.url("postgres"))
            .await
            .expect("connect");
        sqlx::query(&format!("create database {database}"))
            .execute(&admin)
            .await
            .expect("create database");
        admin.close().await;
        let url = self.url(database);
        crate::helpers::migrate(&url);
        url
    }

    /// What the server has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(format!("{}/log", self.dir)).unwrap_or_default()
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// `pg_ctl restart -m fast`: every connection is cut, in-flight transactions roll back.
    pub fn restart(&self) {
        let mut restart = self.tool("pg_ctl");
        restart.args(["-D", &self.data(), "-m", "fast", "-w", "restart"]);
        self.check(restart, "pg_ctl restart");
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        let mut stop = self.tool("pg_ctl");
        stop.args(["-D", &self.data(), "-m", "immediate", "-w", "stop"]);
        let _ = stop.output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
