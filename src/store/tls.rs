//! `sslmode=prefer` as libpq means it, for a server whose TLS certificate rustls cannot use.
//!
//! libpq's `prefer` (its default, and the URL's when it says nothing) tries TLS and, if that fails, connects
//! without it; below `verify-ca` it checks nothing of the certificate. sqlx's `prefer` connects without TLS only
//! when the server declines it: a handshake that fails fails the connection. The case that matters is a
//! certificate rustls refuses to read at all — X.509 version 1, the self-signed certificate Citus generates for
//! every node it sets up (`UnsupportedCertVersion`) — which `psql` accepts under `prefer` and `require` alike.
//!
//! So, for each host whose URL says `prefer`, [`PreferTls`] remembers what its handshake came to: once a TLS
//! handshake with it failed and a connection without TLS then succeeded, the pool connects to that host without
//! TLS, and the process says so once (a warning naming the host and the handshake's error). A host whose TLS
//! worked is asked again after a connection error (its server may have changed behind the same address).
//! `require`, `verify-ca` and `verify-full` are never downgraded: their connections fail, and [`database_error`]
//! says what was wrong with the certificate and what to do about it.

use std::{
    collections::HashSet,
    sync::{
        atomic::{AtomicU8, Ordering},
        Mutex,
    },
};

use sqlx::{
    postgres::{PgConnectOptions, PgSslMode},
    ConnectOptions, PgConnection,
};

use super::route::host_of;
use crate::redact::secrets_in as redact_secrets_in;

/// What a host's TLS handshake came to under `sslmode=prefer`.
#[derive(Debug, Default)]
pub(super) struct PreferTls(AtomicU8);

/// Not known yet (or the URL does not say `prefer`: nothing to learn).
const UNKNOWN: u8 = 0;
/// A connection with TLS, or one the server declined TLS for, succeeded: `prefer` works as sqlx has it.
const WORKS: u8 = 1;
/// The TLS handshake failed and a connection without TLS succeeded: connect without TLS from now on.
const PLAIN: u8 = 2;

impl PreferTls {
    /// `host`'s options as a connection to it opens them now: without TLS once its handshake was found to fail
    /// under `prefer`.
    pub(super) fn options(&self, host: &PgConnectOptions) -> PgConnectOptions {
        Self::options_in(self.0.load(Ordering::Acquire), host)
    }

    fn options_in(state: u8, host: &PgConnectOptions) -> PgConnectOptions {
        match state {
            PLAIN => host.clone().ssl_mode(PgSslMode::Disable),
            _ => host.clone(),
        }
    }

    /// Whether the host is connected to without TLS.
    pub(super) fn plain(&self) -> bool {
        self.0.load(Ordering::Acquire) == PLAIN
    }

    /// Whether a connection to `host` may still teach something: its URL says `prefer` and no connection to it
    /// has succeeded since it was last asked to learn again.
    pub(super) fn unsettled(&self, host: &PgConnectOptions) -> bool {
        Self::unsettled_in(self.0.load(Ordering::Acquire), host)
    }

    fn unsettled_in(state: u8, host: &PgConnectOptions) -> bool {
        matches!(host.get_ssl_mode(), PgSslMode::Prefer) && state == UNKNOWN
    }

    /// After a connection error: a host whose TLS worked is asked again at its next connection (its server may
    /// have moved behind the same address, or its certificate changed). One connected to without TLS stays so.
    pub(super) fn relearn(&self) {
        let _ = self
            .0
            .compare_exchange(WORKS, UNKNOWN, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Connects to `host` as [`PreferTls::options`] says; under `prefer`, a TLS handshake that fails is followed
    /// by a connection without TLS, and if that one succeeds the host is connected to without TLS from then on.
    pub(super) async fn connect(&self, host: &PgConnectOptions) -> Result<PgConnection, sqlx::Error> {
        let state = self.0.load(Ordering::Acquire);
        let options = Self::options_in(state, host);
        let unsettled = Self::unsettled_in(state, host);
        match options.connect().await {
            Ok(conn) => {
                if unsettled {
                    self.settle(WORKS);
                }
                Ok(conn)
            }
            Err(e) if unsettled && handshake_failed(&e) => {
                let conn = options.clone().ssl_mode(PgSslMode::Disable).connect().await?;
                if self.settle(PLAIN) {
                    said_once(host, &e.to_string());
                }
                Ok(conn)
            }
            Err(e) => Err(e),
        }
    }

    /// Records what a connection learnt, unless another learnt something first; whether this one did.
    fn settle(&self, state: u8) -> bool {
        self.0
            .compare_exchange(UNKNOWN, state, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// Whether `e` is a failed TLS handshake: sqlx's own TLS error (a certificate or key file it could not load), or
/// the TLS library's error as the connection's I/O met it (the server's certificate refused, say).
fn handshake_failed(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Tls(_) => true,
        sqlx::Error::Io(io) => io.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()),
        _ => false,
    }
}

/// Warns that `host` is connected to without TLS, once per process and host (every pool of the process learns it
/// for itself).
fn said_once(host: &PgConnectOptions, handshake: &str) {
    static SAID: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let host = host_of(host);
    let first = SAID
        .lock()
        .map(|mut said| said.get_or_insert_with(HashSet::new).insert(host.clone()))
        .unwrap_or(true);
    if first {
        tracing::warn!(host = %host, error = %redact_secrets_in(handshake),
            "sslmode=prefer: the TLS handshake with the server failed, so fine-settler connects to it without TLS, \
             as libpq does under prefer; to insist on TLS, give the server a certificate fine-settler can use and \
             set sslmode=require or stricter (said once per host)");
    }
}

/// A database error as the product says it: the URL's password redacted, and for a TLS handshake refused
/// because of the server's certificate, what that means and what to do.
pub fn database_error(e: &sqlx::Error) -> String {
    let message = redact_secrets_in(&e.to_string());
    let certificate = match e {
        sqlx::Error::Io(io) => io
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>()),
        _ => None,
    };
    match certificate {
        Some(rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other)))
            if other.to_string().contains("UnsupportedCertVersion") =>
        {
            format!(
            "{message} (the server's TLS certificate is X.509 version 1, which fine-settler's TLS library does not \
             accept — Citus generates such a certificate for its nodes; give the server a version 3 certificate \
             (ssl_cert_file); under sslmode=prefer, fine-settler connects to such a server without TLS, as libpq \
             does)"
            )
        }
        _ => message,
    }
}
