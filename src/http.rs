//! The optional HTTP listener (`http.listen`): `/healthz`, `/readyz`, `/metrics`, `/status` and
//! `/status.json`, routed by `axum` and served by hyper's HTTP/1.1 connection, one request per connection.
//!
//! - `/healthz` (liveness): 200 while the replica makes progress — a tick, a committed batch or an outage retry —
//!   at least every `window`, and its ticks have not been failing for longer than `window` for a reason other
//!   than an outage; 503 with the reason otherwise (see [`crate::health`]).
//! - `/readyz` (readiness): 200 when the replica's ticks are not failing, the database answers and every
//!   migration this binary knows is applied; 503 with the reason otherwise.
//! - `/metrics`: the Prometheus text format (see [`crate::metrics`]).
//! - `/status` (HTML) and `/status.json`: where every shard of every job stands (see [`crate::status`]); 503
//!   with the reason when the database cannot be read within a few seconds.
//! - Any other path: 404 `not found`; any method but GET, on any path: 405 `only GET` (HEAD included).
//!
//! Bounds, so that a flood of probes or a slow client cannot take the replica's memory or tasks:
//! - **Connections**: at most [`MAX_CONNECTIONS`] are served at once. `axum::serve` has no such cap, so the
//!   accept loop here takes a semaphore permit *before* accepting: while all are in use, new connections wait in
//!   the kernel's accept backlog (and are refused by the kernel when that is full) instead of being accepted
//!   and then starved. Keep-alive is off (every response says `connection: close`, as the listener always did),
//!   so a connection is one request and the cap bounds concurrent requests too; no separate concurrency layer.
//! - **Time**: the request head must arrive within [`HEAD_TIMEOUT`] (hyper closes the connection otherwise), and
//!   the answer must be ready within [`REQUEST_TIMEOUT`] (`tower_http::timeout`: 503 after that).
//! - **Size**: the head is bounded by hyper's read buffer ([`MAX_HEAD_BYTES`], 431 past it), a body by
//!   [`MAX_BODY_BYTES`] (`tower_http::limit`: 413; no route reads one).
//!
//! Shutdown is an input: [`serve`] stops accepting when its token is cancelled, lets each request in flight
//! finish (closing idle connections at once) and returns when every connection is closed.

use std::{convert::Infallible, sync::Arc, time::Duration};

use axum::{
    extract::State,
    handler::Handler,
    http::{header, Method, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, MethodRouter},
    Router,
};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
};
use tokio_util::sync::CancellationToken;
use tower_http::{limit::RequestBodyLimitLayer, timeout::TimeoutLayer};

use crate::{
    health::{Health, Heartbeat},
    metrics::{unix_now_ms, Metrics},
    status::StatusSource,
    store::Db,
};

/// Connections served at once; more wait in the accept backlog.
pub const MAX_CONNECTIONS: usize = 32;
/// How long a client may take to send its request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a request may take to be answered: longer than the status page's own bound on the database (twice
/// [`crate::status::DATABASE_TIMEOUT`]), so that the page says why it is late rather than this layer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest request head read (hyper's smallest read buffer).
pub const MAX_HEAD_BYTES: usize = 8 * 1024;
/// The largest request body accepted (the routes take none).
pub const MAX_BODY_BYTES: usize = 1024;

/// The content type of the Prometheus text format, as the listener has always sent it.
const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4";
const TEXT: &str = "text/plain";

/// What the routes look at.
#[derive(Debug, Clone)]
pub struct Probes {
    pub metrics: Arc<Metrics>,
    /// The replica's liveness, for `/healthz` and `/readyz`.
    pub heartbeat: Arc<Heartbeat>,
    pub pool: Db,
    /// `/healthz` fails when the last progress is older than this, or ticks have been failing for longer.
    pub window: Duration,
    /// When the replica started (unix ms): before its first progress it counts as progress.
    pub started_ms: i64,
    /// What `/status` and `/status.json` show.
    pub status: StatusSource,
}

/// The routes, with the request timeout and the body limit.
pub fn router(probes: Probes) -> Router {
    Router::new()
        .route("/healthz", only_get(health))
        .route("/readyz", only_get(ready))
        .route("/metrics", only_get(metrics))
        .route("/status", only_get(status_html))
        .route("/status.json", only_get(status_json))
        .fallback(not_found)
        .layer(RequestBodyLimitLayer::new(MAX_BODY_BYTES))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            REQUEST_TIMEOUT,
        ))
        .with_state(probes)
}

/// Serves `listener` until `shutdown`, at most [`MAX_CONNECTIONS`] connections at once; returns once every
/// connection has closed.
pub async fn serve(listener: TcpListener, probes: Probes, shutdown: CancellationToken) {
    let app = router(probes);
    let connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.keep_alive(false)
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES);
    loop {
        // The permit first: a connection is accepted only when it can be served.
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            permit = connections.clone().acquire_owned() => permit,
        };
        let Ok(permit) = permit else {
            break; // The semaphore is never closed.
        };
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                let connection = connection(http.clone(), stream, app.clone(), shutdown.clone(), permit);
                tokio::spawn(connection);
            }
            Err(e) => {
                // Out of file descriptors, typically: wait a little rather than spin.
                tracing::warn!(error = %e, "http accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    drop(listener);
    // Every connection holds a permit until it has closed.
    let all = u32::try_from(MAX_CONNECTIONS).unwrap_or(u32::MAX);
    let _ = connections.acquire_many(all).await;
}

/// Serves one connection; on shutdown, finishes the request in flight (or closes an idle connection).
async fn connection(
    http: hyper::server::conn::http1::Builder,
    stream: TcpStream,
    app: Router,
    shutdown: CancellationToken,
    _permit: OwnedSemaphorePermit,
) {
    let served = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
    let mut served = std::pin::pin!(served);
    let result = tokio::select! {
        result = served.as_mut() => result,
        _ = shutdown.cancelled() => {
            served.as_mut().graceful_shutdown();
            served.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "http connection failed");
    }
}

/// A GET route: every other method (HEAD too, which axum would otherwise answer from GET) gets 405.
fn only_get<H, T>(handler: H) -> MethodRouter<Probes, Infallible>
where
    H: Handler<T, Probes>,
    T: 'static,
{
    get(handler).head(not_get).fallback(not_get)
}

fn reply(status: StatusCode, content_type: &'static str, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, content_type)], body).into_response()
}

async fn not_get() -> Response {
    reply(StatusCode::METHOD_NOT_ALLOWED, TEXT, "only GET\n".into())
}

async fn not_found(method: Method) -> Response {
    if method == Method::GET {
        reply(StatusCode::NOT_FOUND, TEXT, "not found\n".into())
    } else {
        not_get().await
    }
}

async fn health(State(probes): State<Probes>) -> Response {
    match probes
        .heartbeat
        .health(unix_now_ms(), probes.started_ms, probes.window)
    {
        Health::Live { age } => reply(
            StatusCode::OK,
            TEXT,
            format!("ok: last progress {} ms ago\n", age.as_millis()),
        ),
        Health::Stalled { age, window } => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            TEXT,
            format!(
                "stalled: no progress for {} ms (limit {} ms)\n",
                age.as_millis(),
                window.as_millis()
            ),
        ),
        Health::Failing { failing, window } => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            TEXT,
            format!(
                "failing: ticks failing for {} ms, longer than {} ms ({} attempts); last error: {}\n",
                failing.age.as_millis(),
                window.as_millis(),
                failing.attempts,
                failing.reason
            ),
        ),
    }
}

async fn ready(State(probes): State<Probes>) -> Response {
    // Ticks failing on a server that answers: not ready, whatever the database says to the check below.
    if let Some(failing) = probes.heartbeat.failing(unix_now_ms()) {
        return reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{failing}\n"));
    }
    match crate::store::readiness(&probes.pool).await {
        Ok(()) => reply(StatusCode::OK, TEXT, "ready\n".into()),
        Err(reason) => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{reason}\n")),
    }
}

async fn metrics(State(probes): State<Probes>) -> Response {
    reply(StatusCode::OK, METRICS_CONTENT_TYPE, probes.metrics.render())
}

async fn status_html(State(probes): State<Probes>) -> Response {
    match probes.status.read().await {
        Ok(status) => reply(
            StatusCode::OK,
            "text/html; charset=utf-8",
            crate::status::render(&status),
        ),
        Err(e) => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{e}\n")),
    }
}

async fn status_json(State(probes): State<Probes>) -> Response {
    match probes.status.read().await {
        Ok(status) => match serde_json::to_string(&status) {
            Ok(body) => reply(StatusCode::OK, "application/json", body),
            Err(e) => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                TEXT,
                format!("status unavailable: {e}\n"),
            ),
        },
        Err(e) => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{e}\n")),
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::health::TickFailure;

    /// A replica's probes (the database, at a port nothing listens on, answers no route but `/readyz`, which
    /// says so).
    fn probes() -> Probes {
        let env = crate::testing::env(&[("DATABASE_URL", "postgres://u@127.0.0.1:1/db")]);
        let settings = crate::config::load(None, &env)
            .and_then(|raw| raw.validate(&env))
            .expect("valid");
        let metrics = Arc::new(Metrics::new("0/1".into()).with_watched_series_at_zero());
        let heartbeat = Arc::new(Heartbeat::exporting(metrics.last_progress()));
        Probes {
            metrics: metrics.clone(),
            heartbeat: heartbeat.clone(),
            pool: crate::store::connect_lazy(&settings.database, "test", Duration::from_secs(1)),
            window: Duration::from_secs(60),
            started_ms: unix_now_ms(),
            status: StatusSource::new(&settings, "test", metrics, heartbeat),
        }
    }

    /// A listener on a free loopback port serving `probes`, and the token that stops it.
    async fn listening_with(probes: Probes) -> (u16, CancellationToken, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let shutdown = CancellationToken::new();
        let served = tokio::spawn(serve(listener, probes, shutdown.clone()));
        (port, shutdown, served)
    }

    async fn listening() -> (u16, CancellationToken, tokio::task::JoinHandle<()>) {
        listening_with(probes()).await
    }

    /// Sends `request` on a new connection and reads the response until the server closes it.
    async fn exchange(port: u16, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
        stream.write_all(request).await.expect("send");
        read_all(&mut stream).await
    }

    async fn read_all(stream: &mut TcpStream) -> String {
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.expect("read");
        String::from_utf8_lossy(&response).into_owned()
    }

    fn get(path: &str) -> Vec<u8> {
        format!("GET {path} HTTP/1.1\r\nhost: localhost\r\n\r\n").into_bytes()
    }

    /// The status line, the content type and the body of `response`.
    fn parts(response: &str) -> (&str, Option<&str>, &str) {
        let (head, body) = response.split_once("\r\n\r\n").unwrap_or((response, ""));
        let status = head.lines().next().unwrap_or("");
        let content_type = head.lines().find_map(|l| l.strip_prefix("content-type: "));
        (status, content_type, body)
    }

    #[tokio::test]
    async fn routes_answer_with_their_status_content_type_and_body() {
        let (port, shutdown, served) = listening().await;
        let health = exchange(port, &get("/healthz")).await;
        let (status, content_type, body) = parts(&health);
        assert_eq!((status, content_type), ("HTTP/1.1 200 OK", Some("text/plain")));
        assert!(body.starts_with("ok: last progress "), "{health}");
        assert!(health.contains("\r\nconnection: close\r\n"), "{health}");

        let metrics = exchange(port, &get("/metrics")).await;
        let (status, content_type, body) = parts(&metrics);
        assert_eq!(
            (status, content_type),
            ("HTTP/1.1 200 OK", Some("text/plain; version=0.0.4"))
        );
        assert!(body.contains("fine_settler_paused{job=\"fine-settlement\",shard=\"0/1\"} 0\n"));

        let missing = exchange(port, &get("/nope")).await;
        assert_eq!(
            parts(&missing),
            ("HTTP/1.1 404 Not Found", Some("text/plain"), "not found\n")
        );
        for request in [
            "POST /healthz HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
            "DELETE /nope HTTP/1.1\r\nhost: x\r\n\r\n",
            "PUT /metrics HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
        ] {
            let response = exchange(port, request.as_bytes()).await;
            assert_eq!(
                parts(&response),
                (
                    "HTTP/1.1 405 Method Not Allowed",
                    Some("text/plain"),
                    "only GET\n"
                ),
                "{request}"
            );
        }
        // HEAD is not GET here either (its response has no body).
        let head = exchange(port, b"HEAD /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await;
        assert!(head.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"), "{head}");
        shutdown.cancel();
        served.await.expect("served");
    }

    #[tokio::test]
    async fn ticks_failing_on_a_server_that_answers_fail_readyz_at_once_and_healthz_after_the_window() {
        let probes = probes();
        let heartbeat = probes.heartbeat.clone();
        let (port, shutdown, served) = listening_with(probes).await;
        let timeout = "cannot read the tick status: canceling statement due to statement timeout";
        heartbeat.tick_failed(unix_now_ms(), TickFailure::Error(timeout.into()));
        let ready = exchange(port, &get("/readyz")).await;
        let (status, _, body) = parts(&ready);
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable", "{ready}");
        assert!(body.starts_with("ticks failing for "), "{body}");
        assert!(
            body.ends_with(&format!("(1 attempts); last error: {timeout}\n")),
            "{body}"
        );
        // Within the window (60 s), liveness holds ...
        let health = exchange(port, &get("/healthz")).await;
        assert!(health.starts_with("HTTP/1.1 200 OK\r\n"), "{health}");
        // ... past it, it fails and says why.
        heartbeat.tick_failed(unix_now_ms() - 61_000, TickFailure::Outage);
        heartbeat.tick_failed(unix_now_ms() - 61_000, TickFailure::Error(timeout.into()));
        heartbeat.tick_failed(unix_now_ms(), TickFailure::Error(timeout.into()));
        heartbeat.progress_now();
        let health = exchange(port, &get("/healthz")).await;
        let (status, _, body) = parts(&health);
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable", "{health}");
        assert!(body.starts_with("failing: ticks failing for 6"), "{body}");
        assert!(
            body.ends_with(&format!(
                " ms, longer than 60000 ms (2 attempts); last error: {timeout}\n"
            )),
            "{body}"
        );
        // An outage is waited out: live, and /readyz says the database is unavailable.
        heartbeat.tick_failed(unix_now_ms(), TickFailure::Outage);
        let health = exchange(port, &get("/healthz")).await;
        assert!(health.starts_with("HTTP/1.1 200 OK\r\n"), "{health}");
        let ready = exchange(port, &get("/readyz")).await;
        let (status, _, body) = parts(&ready);
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable", "{ready}");
        assert!(body.starts_with("database "), "{body}");
        shutdown.cancel();
        served.await.expect("served");
    }

    #[tokio::test]
    async fn oversized_heads_and_bodies_are_refused() {
        let (port, shutdown, served) = listening().await;
        let long = format!(
            "GET /healthz HTTP/1.1\r\nhost: x\r\nx-padding: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES)
        );
        let response = exchange(port, long.as_bytes()).await;
        assert!(
            response.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            "{response}"
        );
        let body = "b".repeat(MAX_BODY_BYTES + 1);
        let request = format!(
            "GET /healthz HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let response = exchange(port, request.as_bytes()).await;
        assert!(
            response.starts_with("HTTP/1.1 413 Payload Too Large\r\n"),
            "{response}"
        );
        shutdown.cancel();
        served.await.expect("served");
    }

    #[tokio::test]
    async fn connections_past_the_cap_wait_for_a_free_one_and_shutdown_closes_idle_ones() {
        let (port, shutdown, served) = listening().await;
        // Connections that never send a request each hold one of the places (until the head timeout).
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(TcpStream::connect(("127.0.0.1", port)).await.expect("connect"));
        }
        // Proof that every idle one was accepted: a request behind them is not answered ...
        let mut waiting = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
        waiting.write_all(&get("/healthz")).await.expect("send");
        let mut byte = [0u8; 1];
        let early = tokio::time::timeout(Duration::from_millis(300), waiting.read(&mut byte)).await;
        assert!(early.is_err(), "answered past the connection cap");
        // ... until one of them closes.
        drop(idle.pop());
        let response = read_all(&mut waiting).await;
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");

        // Shutdown closes the idle connections (no request in flight) and the listener returns.
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), served)
            .await
            .expect("the listener stops within the head timeout's bound")
            .expect("served");
        for mut stream in idle {
            assert_eq!(read_all(&mut stream).await, "", "closed without a response");
        }
        assert!(
            TcpStream::connect(("127.0.0.1", port)).await.is_err(),
            "the port is free"
        );
    }
}
