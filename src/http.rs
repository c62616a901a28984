//! The optional HTTP listener (`http.listen`): `/healthz`, `/readyz`, `/metrics`, `/status` and
//! `/status.json`. A deliberately tiny HTTP/1.1 responder — a few GET routes, one response per connection —
//! rather than a web framework.
//!
//! - `/healthz` (liveness): 200 while the replica makes progress — a tick, a committed batch or an outage retry —
//!   at least every `window`; 503 when the loop has stalled.
//! - `/readyz` (readiness): 200 when the database answers and every migration this binary knows is applied; 503
//!   with the reason otherwise.
//! - `/metrics`: the Prometheus text format (see [`crate::metrics`]).
//! - `/status` (HTML) and `/status.json`: where every shard of every job stands (see [`crate::status`]); 503
//!   with the reason when the database cannot be read within a few seconds.

use std::{sync::Arc, time::Duration};

use crate::store::Db;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};
use tokio_util::sync::CancellationToken;

use crate::{
    metrics::{unix_now_ms, Metrics},
    status::StatusSource,
};

/// What the routes look at.
#[derive(Debug, Clone)]
pub struct Probes {
    pub metrics: Arc<Metrics>,
    pub pool: Db,
    /// `/healthz` fails when the last progress is older than this.
    pub window: Duration,
    /// When the replica started (unix ms): before its first progress it counts as progress.
    pub started_ms: i64,
    /// What `/status` and `/status.json` show.
    pub status: StatusSource,
}

/// Serves until `shutdown`; each connection is handled on its own task.
pub async fn serve(listener: TcpListener, probes: Probes, shutdown: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                let probes = probes.clone();
                tokio::spawn(async move {
                    if let Err(e) = respond(stream, &probes).await {
                        tracing::debug!(error = %e, "http connection failed");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "http accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn respond(mut stream: TcpStream, probes: &Probes) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    // Read the request head (bounded in size and time); the body, if any, is ignored.
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        while len < buf.len() {
            let n = stream.read(&mut buf[len..]).await?;
            if n == 0 {
                break;
            }
            len += n;
            if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
    if read.is_err() {
        return Ok(());
    }
    let head = String::from_utf8_lossy(&buf[..len]);
    let mut parts = head.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, content_type, body) = match (method, path) {
        ("GET", "/healthz") => health(probes),
        ("GET", "/readyz") => ready(probes).await,
        ("GET", "/metrics") => (200, "text/plain; version=0.0.4", probes.metrics.render()),
        ("GET", "/status") => status(probes, false).await,
        ("GET", "/status.json") => status(probes, true).await,
        ("GET", _) => (404, "text/plain", "not found\n".to_string()),
        _ => (405, "text/plain", "only GET\n".to_string()),
    };
    let reason = match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Service Unavailable",
    };
    let response = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

fn health(probes: &Probes) -> (u16, &'static str, String) {
    let last = probes.metrics.last_progress_ms().max(probes.started_ms);
    let age_ms = unix_now_ms().saturating_sub(last);
    let window_ms = i64::try_from(probes.window.as_millis()).unwrap_or(i64::MAX);
    if age_ms <= window_ms {
        (200, "text/plain", format!("ok: last progress {age_ms} ms ago\n"))
    } else {
        (
            503,
            "text/plain",
            format!("stalled: no progress for {age_ms} ms (limit {window_ms} ms)\n"),
        )
    }
}

async fn ready(probes: &Probes) -> (u16, &'static str, String) {
    match crate::store::readiness(&probes.pool).await {
        Ok(()) => (200, "text/plain", "ready\n".into()),
        Err(reason) => (503, "text/plain", format!("{reason}\n")),
    }
}

async fn status(probes: &Probes, json: bool) -> (u16, &'static str, String) {
    match probes.status.read().await {
        Ok(status) if json => match serde_json::to_string(&status) {
            Ok(body) => (200, "application/json", body),
            Err(e) => (503, "text/plain", format!("status unavailable: {e}\n")),
        },
        Ok(status) => (200, "text/html; charset=utf-8", crate::status::render(&status)),
        Err(e) => (503, "text/plain", format!("{e}\n")),
    }
}
