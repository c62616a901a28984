//! The real binary as a process: the command, one-shot runs and their reports, replicas running in the
//! background (killed if a test fails before stopping them), signals, and waiting for an exit.

use std::{
    io::Read,
    ops::{Deref, DerefMut},
    process::{Child, Command, Output, Stdio},
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::Duration,
};

/// The real binary, pointed at `url`, with no configuration inherited from the environment (and
/// `database.engine = "citus"` when `url` names a test database on the Citus cluster: [`super::citus`]).
pub fn fine_settler(url: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fine-settler"));
    for (k, _) in std::env::vars() {
        if k.starts_with("FINE_SETTLER") || k == "RUST_LOG" {
            cmd.env_remove(k);
        }
    }
    cmd.env("DATABASE_URL", url)
        .env("FINE_SETTLER__LOG__LEVEL", "info")
        .stdin(Stdio::null());
    let database = url.split('?').next().and_then(|u| u.rsplit('/').next());
    if database.is_some_and(super::citus::is_citus) {
        cmd.env("FINE_SETTLER__DATABASE__ENGINE", "citus");
    }
    cmd
}

/// Runs the binary to completion (blocking; call from `spawn_blocking` when running several).
pub fn output(mut cmd: Command) -> Output {
    cmd.output().expect("run fine-settler")
}

/// Fails the test, showing stderr, unless the process exited 0.
pub fn assert_success(out: &Output) {
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `fine-settler migrate` against `url`, which must succeed.
pub fn migrate(url: &str) {
    let mut cmd = fine_settler(url);
    cmd.arg("migrate");
    assert_success(&output(cmd));
}

/// The JSON report a one-shot command printed on stdout.
pub fn report(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_else(|| {
        panic!(
            "no report on stdout; stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    serde_json::from_str(line).unwrap_or_else(|e| panic!("report {line:?} is not JSON: {e}"))
}

/// A process the test started in the background. Dropping it kills (SIGKILL) and reaps the process if it is still
/// running, so that no process outlives a test that failed before stopping it.
#[derive(Debug)]
pub struct Running(Child);

impl Deref for Running {
    type Target = Child;

    fn deref(&self) -> &Child {
        &self.0
    }
}

impl DerefMut for Running {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // A child already reaped (by `exit_of` or `wait`) is not signalled again.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` in the background, with the stdio it was given.
pub fn spawn(cmd: &mut Command) -> Running {
    Running(cmd.spawn().expect("spawn fine-settler"))
}

/// `fine-settler run` as shard `shard` of `shards`, with short test timings (300 ms period, 3 s lease, 1 s batch
/// timeout, batches of 25) and then `extra`; stdout discarded, stderr piped (returned by [`exit_of`]).
pub fn daemon(url: &str, shard: i32, shards: i32, extra: &[(&str, &str)]) -> Running {
    let mut cmd = fine_settler(url);
    cmd.env("FINE_SETTLER__INSTANCE__SHARD", shard.to_string())
        .env("FINE_SETTLER__INSTANCE__SHARDS", shards.to_string())
        .env("FINE_SETTLER__SCHEDULE__PERIOD", "300ms")
        .env("FINE_SETTLER__CLAIM__LEASE", "3s")
        .env("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "1s")
        .env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "25");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.arg("run").stdout(Stdio::null()).stderr(Stdio::piped());
    spawn(&mut cmd)
}

/// `kill -NAME pid`; whether the signal was sent.
pub fn send_signal(pid: u32, name: &str) -> bool {
    Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// Sends SIG`name` to the process, which must be there to receive it.
pub fn signal(child: &Child, name: &str) {
    assert!(
        send_signal(child.id(), name),
        "kill -{name} {} failed",
        child.id()
    );
}

/// Waits for the process to exit (at most `limit`); returns its exit code and stderr (none if a [`StderrLog`] took
/// it).
pub async fn exit_of(mut child: Running, limit: Duration) -> (Option<i32>, String) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            return (status.code(), err);
        }
        if tokio::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("process did not exit within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// SIGTERM, then the exit code and stderr (within 10 s).
pub async fn stop(child: Running) -> (Option<i32>, String) {
    signal(&child, "TERM");
    exit_of(child, Duration::from_secs(10)).await
}

/// SIGKILL, and reap it.
pub fn sigkill(mut child: Running) {
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
}

/// A process's stderr, read by a thread as it is written, so that a test can look at it while the process runs.
#[derive(Debug)]
pub struct StderrLog {
    bytes: Arc<Mutex<Vec<u8>>>,
    reader: JoinHandle<()>,
}

impl StderrLog {
    /// Takes over the piped stderr of `child` ([`exit_of`] then returns none of it).
    pub fn collect(child: &mut Child) -> StderrLog {
        let mut pipe = child.stderr.take().expect("stderr is piped");
        let bytes: Arc<Mutex<Vec<u8>>> = Arc::default();
        let sink = bytes.clone();
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = pipe.read(&mut buf) {
                sink.lock().expect("lock").extend_from_slice(&buf[..n]);
            }
        });
        StderrLog { bytes, reader }
    }

    /// Whether the process has written `text` so far.
    pub fn contains(&self, text: &str) -> bool {
        String::from_utf8_lossy(&self.bytes.lock().expect("lock")).contains(text)
    }

    /// What the process has written so far.
    pub fn snapshot(&self) -> String {
        String::from_utf8_lossy(&self.bytes.lock().expect("lock")).into_owned()
    }

    /// Everything the process wrote; call once it has exited (the pipe then ends).
    pub fn finish(self) -> String {
        self.reader.join().expect("stderr reader");
        let bytes = self.bytes.lock().expect("lock");
        String::from_utf8_lossy(&bytes).into_owned()
    }
}
