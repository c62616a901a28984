//! The replicas: the deployment's shared settings, one slot per replica process (its shard, its URL, its log
//! file), and the fleet of them — started per shard count, killed and restarted, stopped with SIGTERM.

use std::{
    collections::BTreeMap,
    fs::File,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use fine_settler::demo::SplitMix64;
use tempfile::TempDir;

use super::{proxy::Proxy, CAP, RATE, ZONE};
use crate::helpers::{fine_settler, send_signal, spawn, Running};

const LEASE: &str = "6s";
const BATCH_TIMEOUT: &str = "3s";

/// The real binary with the deployment's shared settings, as every replica, manual run and the operator's retry
/// have them: the fine policy (with its cap), the claim timings, the batch sizes, the zone and the compensation
/// queue's backoff.
pub fn deployment(url: &str) -> Command {
    let mut cmd = fine_settler(url);
    cmd.env("FINE_SETTLER__FINE__DAILY_RATE_CENTS", RATE.to_string())
        .env("FINE_SETTLER__FINE__CAP_CENTS", CAP.to_string())
        .env("FINE_SETTLER__CLAIM__LEASE", LEASE)
        .env("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", BATCH_TIMEOUT)
        .env("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "50")
        .env("FINE_SETTLER__ACCRUAL__BATCH_SIZE", "50")
        .env("FINE_SETTLER__ACCRUAL__MAX_ATTEMPTS", "3")
        .env("FINE_SETTLER__ACCRUAL__RETRY_BACKOFF", "200ms")
        .env("FINE_SETTLER__ACCRUAL__RETRY_BACKOFF_MAX", "1s")
        // Late overdue loans are found by the accrual's recheck; at the default 15 minutes the run would wait
        // that long for them.
        .env("FINE_SETTLER__ACCRUAL__RECHECK_EVERY", "2s")
        .env("FINE_SETTLER__TIME__ZONE", ZONE);
    cmd
}

/// One replica process slot: its shard, its URL (direct or through the proxy) and its log file. A replica still
/// running when its slot goes away — the test failed half-way — is killed ([`Running`]).
struct Replica {
    shard: i32,
    shards: i32,
    url: String,
    proxied: bool,
    log: PathBuf,
    child: Option<Running>,
    restart_at: Option<Instant>,
    starts: u32,
}

impl Replica {
    fn spawn(&mut self, accrual_days: u32) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut cmd = deployment(&self.url);
        cmd.env("FINE_SETTLER__INSTANCE__SHARD", self.shard.to_string())
            .env("FINE_SETTLER__INSTANCE__SHARDS", self.shards.to_string())
            .env("FINE_SETTLER__SCHEDULE__PERIOD", "300ms")
            .env("FINE_SETTLER__SCHEDULE__DRAIN_TIMEOUT", "15s")
            .env("FINE_SETTLER__DATABASE__MAX_CONNECTIONS", "2")
            .env("FINE_SETTLER__DATABASE__CONNECT_TIMEOUT", "2s")
            .env("FINE_SETTLER__ACCRUAL__ENABLED", "true")
            .env("FINE_SETTLER__ACCRUAL__CATCH_UP_DAYS", accrual_days.to_string())
            .arg("run")
            .stdout(Stdio::null())
            .stderr(log);
        self.child = Some(spawn(&mut cmd));
        self.starts += 1;
        self.restart_at = None;
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }
}

/// A live replica as a zombie candidate.
pub struct Candidate {
    pub pid: u32,
    pub shard: i32,
    pub shards: i32,
    pub log: PathBuf,
}

/// Three replicas per shard of the current shard count; replica 0 of shard 0 goes through the proxy.
pub struct Fleet {
    url: String,
    proxied_url: String,
    accrual_days: u32,
    logs: TempDir,
    replicas: Vec<Replica>,
}

impl Fleet {
    pub fn new(url: &str, proxy: &Proxy, accrual_days: u32) -> Fleet {
        Fleet {
            url: url.to_string(),
            proxied_url: proxy.route(url),
            accrual_days,
            logs: tempfile::tempdir().expect("log dir"),
            replicas: Vec::new(),
        }
    }

    /// Starts 3 replicas for each of `shards` shards.
    pub fn start(&mut self, shards: i32) {
        self.replicas = (0..shards)
            .flat_map(|s| (0..3).map(move |i| (s, i)))
            .map(|(shard, i)| {
                let proxied = shard == 0 && i == 0;
                Replica {
                    shard,
                    shards,
                    url: if proxied {
                        self.proxied_url.clone()
                    } else {
                        self.url.clone()
                    },
                    proxied,
                    log: self
                        .logs
                        .path()
                        .join(format!("shards{shards}-shard{shard}-{i}.log")),
                    child: None,
                    restart_at: None,
                    starts: 0,
                }
            })
            .collect();
        for r in &mut self.replicas {
            r.spawn(self.accrual_days);
        }
    }

    /// Changes the shard count: every replica of the old count gets SIGTERM (they hand their keys back and must
    /// exit 0), then the replicas of the new count start.
    pub fn reshard(&mut self, shards: i32) {
        for r in &self.replicas {
            if let Some(pid) = r.pid() {
                send_signal(pid, "TERM");
            }
        }
        for r in &mut self.replicas {
            if let Some(mut child) = r.child.take() {
                let status = child.wait().expect("wait");
                assert_eq!(status.code(), Some(0), "old-count replica: {}", log_tail(&r.log));
            }
        }
        self.start(shards);
    }

    /// The final SIGTERM: every replica must be running, and must exit 0.
    pub fn stop(&mut self) {
        for r in &self.replicas {
            send_signal(r.pid().expect("live"), "TERM");
        }
        for r in &mut self.replicas {
            let status = r.child.take().expect("live").wait().expect("wait");
            assert_eq!(status.code(), Some(0), "final SIGTERM: {}", log_tail(&r.log));
        }
    }

    /// Restarts the killed replicas whose pause is over.
    pub fn restart_due(&mut self) {
        for r in &mut self.replicas {
            if r.restart_at.is_some_and(|t| Instant::now() >= t) {
                r.spawn(self.accrual_days);
            }
        }
    }

    /// SIGKILLs a random running replica other than `spare`, to be restarted after a pause of 0.2–2 s; false if
    /// there was none.
    pub fn kill_one(&mut self, rng: &mut SplitMix64, spare: Option<u32>) -> bool {
        let live: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| self.replicas[i].child.is_some() && self.replicas[i].pid() != spare)
            .collect();
        if live.is_empty() {
            return false;
        }
        let r = &mut self.replicas[live[rng.below(live.len() as u64) as usize]];
        let mut child = r.child.take().expect("live");
        let _ = child.kill();
        let _ = child.wait();
        r.restart_at = Some(Instant::now() + Duration::from_millis(200 + rng.below(1800)));
        true
    }

    /// The running replicas.
    pub fn candidates(&self) -> Vec<Candidate> {
        self.replicas
            .iter()
            .filter_map(|r| {
                r.pid().map(|pid| Candidate {
                    pid,
                    shard: r.shard,
                    shards: r.shards,
                    log: r.log.clone(),
                })
            })
            .collect()
    }

    /// The pid of the replica that goes through the proxy, if it is running.
    pub fn proxied_pid(&self) -> Option<u32> {
        self.replicas.iter().find(|r| r.proxied).and_then(Replica::pid)
    }

    pub fn all_running(&self) -> bool {
        self.replicas.iter().all(|r| r.child.is_some())
    }

    /// How many times the replicas of the current shard count were started.
    pub fn starts(&self) -> u32 {
        self.replicas.iter().map(|r| r.starts).sum()
    }

    /// The end of the first replica's log.
    pub fn first_log_tail(&self) -> String {
        log_tail(&self.replicas[0].log)
    }

    /// The replicas' error events (JSON log lines at level error), counted by message and error, most frequent
    /// first: what to look at when an invariant breaks.
    pub fn errors(&self) -> Vec<(usize, String)> {
        replica_errors(self.logs.path())
    }
}

fn replica_errors(dir: &Path) -> Vec<(usize, String)> {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        for line in text.lines() {
            let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if event["level"] == "error" {
                let what = format!("{}: {}", event["message"], event["error"]);
                *counts.entry(what.chars().take(300).collect()).or_default() += 1;
            }
        }
    }
    let mut by_count: Vec<(usize, String)> = counts.into_iter().map(|(what, n)| (n, what)).collect();
    by_count.sort_by(|a, b| b.cmp(a));
    by_count
}

/// The last 15 lines of a replica's log.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}
