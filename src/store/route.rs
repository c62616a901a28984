//! Which server a pool uses: `database.url`'s hosts, in order, each with the options a connection behind
//! `database.pooler` opens with; the choice among them for `target_session_attrs`; and the generation that tells
//! a connection opened before the last choice from one opened after.

use std::{
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};

use sqlx::{postgres::PgConnectOptions, Connection};

use super::{session::Gucs, tls::PreferTls, ReadOnlyServer};
use crate::{
    config::{DatabaseSettings, Pooler, TargetSessionAttrs},
    redact::secrets_in as redact_secrets_in,
};

/// `host`'s options as a connection of `application_name` behind `pooler` opens them: the application name shows
/// the replica in `pg_stat_activity`. Behind a pooler, sqlx's `extra_float_digits` startup parameter is not sent
/// (PgBouncer refuses every startup parameter it does not know; fine-settler reads no floats); behind one in
/// transaction mode no statement is kept prepared beyond its transaction (see [`Db`](super::Db)).
fn for_pooler(pooler: Pooler, host: &PgConnectOptions, application_name: &str) -> PgConnectOptions {
    let options = host.clone().application_name(application_name);
    match pooler {
        Pooler::None => options,
        Pooler::Session => options.extra_float_digits(None),
        Pooler::Transaction => options.extra_float_digits(None).statement_cache_capacity(0),
    }
}

/// The options of each of `database.url`'s hosts, in order, for a connection with settings `gucs`, and what must
/// run on it after it connects.
fn hosts_with(
    db: &DatabaseSettings,
    application_name: &str,
    gucs: &Gucs,
) -> (Vec<PgConnectOptions>, Option<String>) {
    let hosts = db
        .url
        .hosts()
        .iter()
        .map(|host| {
            let options = for_pooler(db.pooler, host, application_name);
            match db.pooler {
                Pooler::None if !gucs.is_empty() => gucs.apply(options),
                _ => options,
            }
        })
        .collect();
    let after = (db.pooler == Pooler::Session).then(|| gucs.set_session());
    (hosts, after)
}

/// The servers a [`Db`](super::Db) may use — `database.url`'s hosts, in order, each with the options this pool
/// opens connections with — and since when its connections count as fresh.
///
/// sqlx connects a pool to one host. A `Db` starts on the first; [`Db::reconnect`](super::Db::reconnect) (after
/// a connection error or a read-only server) tries the hosts in order again, the first that qualifies for
/// `target_session_attrs` becomes the pool's, and every connection opened before is dropped at its next checkout
/// instead of being used (a connection left on a demoted primary passes sqlx's ping and fails every write).
#[derive(Debug)]
pub(super) struct Route {
    hosts: Vec<PgConnectOptions>,
    /// Per host: what its TLS handshake came to under `sslmode=prefer` (see [`super::tls`]).
    tls: Vec<PreferTls>,
    target: TargetSessionAttrs,
    /// Per host (`connect_timeout` in the URL), else `database.connect_timeout`.
    pub(super) host_timeout: Duration,
    /// Run on a new connection before it is used (behind a session-mode pooler: the settings).
    pub(super) after_connect: Option<String>,
    fresh_since: Mutex<Instant>,
    /// Counts [`Route::stale`] calls: a connection opened outside the pool (the tick's session) compares it.
    generation: AtomicU64,
    /// How many times the pool moved to another host.
    switches: AtomicU64,
    /// Which host the pool connects to now.
    current: AtomicUsize,
}

impl Route {
    /// `database.url`'s hosts for a connection of `application_name` with settings `gucs`.
    pub(super) fn new(db: &DatabaseSettings, application_name: &str, gucs: &Gucs) -> Self {
        let (hosts, after_connect) = hosts_with(db, application_name, gucs);
        Route {
            tls: hosts.iter().map(|_| PreferTls::default()).collect(),
            hosts,
            target: db.url.target(),
            host_timeout: db.host_timeout(),
            after_connect,
            fresh_since: Mutex::new(Instant::now()),
            generation: AtomicU64::new(0),
            switches: AtomicU64::new(0),
            current: AtomicUsize::new(0),
        }
    }

    /// The one host of a pool opened elsewhere (a test's), taken as it is.
    pub(super) fn direct(options: PgConnectOptions) -> Self {
        Route {
            hosts: vec![options],
            tls: vec![PreferTls::default()],
            target: TargetSessionAttrs::Any,
            host_timeout: Duration::from_secs(10),
            after_connect: None,
            fresh_since: Mutex::new(Instant::now()),
            generation: AtomicU64::new(0),
            switches: AtomicU64::new(0),
            current: AtomicUsize::new(0),
        }
    }

    /// How many hosts the URL lists.
    pub(super) fn len(&self) -> usize {
        self.hosts.len()
    }

    /// The options host `i` is connected to with now (without TLS once its handshake failed under `prefer`).
    pub(super) fn options(&self, i: usize) -> PgConnectOptions {
        self.tls[i].options(&self.hosts[i])
    }

    /// Under `sslmode=prefer`, until a connection to host `i` has succeeded: connects to it once to learn
    /// whether its TLS handshake works (see [`super::tls`]). Whether the host is now connected to without TLS
    /// (it was not before); any other failure is left to the connections that follow.
    pub(super) async fn learn_tls(&self, i: usize) -> bool {
        if !self.tls[i].unsettled(&self.hosts[i]) {
            return false;
        }
        let connected = tokio::time::timeout(self.host_timeout, self.tls[i].connect(&self.hosts[i])).await;
        if let Ok(Ok(conn)) = connected {
            let _ = conn.close().await;
        }
        self.tls[i].plain()
    }

    /// After a connection error: every host whose TLS worked under `prefer` is asked again (see
    /// [`PreferTls::relearn`]).
    pub(super) fn relearn_tls(&self) {
        self.tls.iter().for_each(PreferTls::relearn);
    }

    /// Every connection opened until now is stale: it is dropped at its next checkout instead of being used.
    pub(super) fn stale(&self) {
        *self.fresh_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// How many times every connection was made stale: a connection opened in an older generation is.
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Counts a move of the pool to another host.
    pub(super) fn switched(&self) {
        self.switches.fetch_add(1, Ordering::SeqCst);
    }

    /// Which host the pool connects to now.
    pub(super) fn current(&self) -> usize {
        self.current.load(Ordering::SeqCst)
    }

    /// The pool now connects to host `i`.
    pub(super) fn set_current(&self, i: usize) {
        self.current.store(i, Ordering::SeqCst);
    }

    /// How many times the pool moved to another host.
    pub(super) fn switches(&self) -> u64 {
        self.switches.load(Ordering::SeqCst)
    }

    /// Whether a connection `age` old was opened after the last [`Route::stale`].
    pub(super) fn fresh(&self, age: Duration) -> bool {
        let since = *self.fresh_since.lock().unwrap_or_else(|e| e.into_inner());
        Instant::now()
            .checked_sub(age)
            .is_none_or(|opened| opened >= since)
    }

    /// The first host, in order, that answers within the host timeout and qualifies for the target: its index,
    /// or the last host's error.
    pub(super) async fn choose(&self) -> Result<usize, sqlx::Error> {
        let mut last = None;
        for (i, host) in self.hosts.iter().enumerate() {
            match tokio::time::timeout(self.host_timeout, self.probe(i)).await {
                Ok(Ok(())) => return Ok(i),
                Ok(Err(e)) => {
                    tracing::debug!(host = %host_of(host), error = %redact_secrets_in(&e.to_string()),
                        "host does not qualify");
                    last = Some(e);
                }
                Err(_) => {
                    tracing::debug!(host = %host_of(host), "host did not answer within its connect timeout");
                    last = Some(sqlx::Error::PoolTimedOut);
                }
            }
        }
        Err(last.unwrap_or(sqlx::Error::PoolTimedOut))
    }

    /// Connects to host `i` and asks whether it qualifies for the target.
    async fn probe(&self, i: usize) -> Result<(), sqlx::Error> {
        let mut conn = self.tls[i].connect(&self.hosts[i]).await?;
        let fit = match self.target {
            TargetSessionAttrs::Any => Ok(None),
            TargetSessionAttrs::ReadWrite => ReadOnlyServer::ask(&mut conn).await,
            // libpq's `primary`: not in recovery (read-only transactions by default do not disqualify it).
            TargetSessionAttrs::Primary => ReadOnlyServer::ask(&mut conn)
                .await
                .map(|r| r.filter(|r| *r == ReadOnlyServer::InRecovery)),
        };
        let _ = conn.close().await;
        match fit? {
            None => Ok(()),
            Some(r) => Err(r.into()),
        }
    }
}

/// `host:port` of a connection's options, for logs.
pub(super) fn host_of(options: &PgConnectOptions) -> String {
    format!("{}:{}", options.get_host(), options.get_port())
}
