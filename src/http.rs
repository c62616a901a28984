//! The optional HTTP listener (`http.listen`): `/healthz`, `/readyz`, `/metrics`, `/status` and
//! `/status.json`, routed by `axum` and served by hyper's HTTP/1.1 connection, one request per connection.
//!
//! - `/healthz` (liveness): 200 while the replica makes progress — a tick, a committed batch or an outage retry —
//!   at least every `window`, and its ticks have not been failing for longer than `window` for a reason other
//!   than an outage; 503 with the reason otherwise (see [`crate::health`]).
//! - `/readyz` (readiness): 200 when the replica's ticks are not failing, the database answers and every
//!   migration this binary knows is applied, and the work loop is not waiting for the database (at start, or
//!   in an outage: ready again once a tick has read its status); 503 with the reason otherwise.
//! - `/metrics`: the Prometheus text format (see [`crate::metrics`]).
//! - `/status` (HTML) and `/status.json`: where every shard of every job stands (see [`crate::status`]); 503
//!   with the reason when the database cannot be read within a few seconds, or at once when
//!   [`crate::status::MAX_WAITING`] page loads are waiting for it already.
//! - Any other path: 404 `not found`; any method but GET, on any path: 405 `only GET` (HEAD included).
//!
//! Bounds, so that a flood of requests or of idle connections cannot take the replica's memory, tasks or file
//! descriptors, nor keep the probes from being answered:
//! - **Connections**: at most [`MAX_CONNECTIONS`] are served at once, each in one *place*. `axum::serve` has no
//!   such cap, so the accept loop here accepts a connection only for a place: while every place is taken, new
//!   connections wait in the kernel's accept backlog (and are refused by the kernel when that is full) instead
//!   of being accepted — the replica holds at most `MAX_CONNECTIONS + 1` client sockets, whatever the flood.
//!   A connection that has not sent a byte of its request keeps its place from a newcomer for [`IDLE_GRACE`]
//!   only: when every place is taken and a connection is waiting in the backlog, the one that has been idle the
//!   longest is closed for it once it has been idle that long. So idle connections cannot starve the probes,
//!   whose request is there as soon as they are accepted (a flood of idle connections delays a newcomer by
//!   [`IDLE_GRACE`] per [`MAX_CONNECTIONS`] of them ahead of it); only connections serving a request (each bounded
//!   in time, below) make newcomers wait longer.
//!   Keep-alive is off (every response says `connection: close`, as the listener always did), so a connection
//!   is one request and the cap bounds concurrent requests too.
//! - **The page's database work**: page loads share one read at a time and at most
//!   [`crate::status::MAX_WAITING`] wait for it, so they hold few places, briefly; the probes never wait on the
//!   page (`/healthz` and `/metrics` read memory, `/readyz` the jobs' pool).
//! - **Time**: the request head must arrive within [`HEAD_TIMEOUT`] (hyper closes the connection otherwise), and
//!   the answer must be ready within [`REQUEST_TIMEOUT`] (`tower_http::timeout`: 503 after that).
//! - **Size**: the head is bounded by hyper's read buffer ([`MAX_HEAD_BYTES`], 431 past it), a body by
//!   [`MAX_BODY_BYTES`] (`tower_http::limit`: 413; no route reads one).
//!
//! Shutdown is an input: [`serve`] stops accepting when its token is cancelled, lets each request in flight
//! finish (closing idle connections at once) and returns when every connection is closed.

use std::{
    collections::VecDeque,
    convert::Infallible,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

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

/// Connections served at once; more wait in the accept backlog (or take the place of an idle one).
pub const MAX_CONNECTIONS: usize = 32;
/// How long a client may take to send its request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection that has sent nothing keeps its place from a newcomer when every place is taken: long
/// enough for any client that connects to send its request, short enough that a flood of idle connections
/// delays the probes behind it by a fraction of a second per [`MAX_CONNECTIONS`] of them.
pub const IDLE_GRACE: Duration = Duration::from_millis(100);
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
    serve_in(listener, router(probes), Places::new(), shutdown).await
}

/// [`serve`] with `places` of the caller's (a test looks at them).
async fn serve_in(listener: TcpListener, app: Router, places: Arc<Places>, shutdown: CancellationToken) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.keep_alive(false)
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES);
    while let Some((stream, permit)) = next_connection(&listener, &places, &shutdown).await {
        let (stream, spoken) = match has_spoken(stream) {
            Ok(seen) => seen,
            Err(e) => {
                tracing::debug!(error = %e, "http connection lost at accept");
                continue;
            }
        };
        let place = places.take(permit, !spoken);
        let connection = connection(http.clone(), stream, app.clone(), shutdown.clone(), place);
        tokio::spawn(connection);
    }
    drop(listener);
    // Every connection holds a place until it has closed.
    let all = u32::try_from(MAX_CONNECTIONS).unwrap_or(u32::MAX);
    let _ = places.free.acquire_many(all).await;
}

/// The next connection and its place; `None` on shutdown.
///
/// A free place is taken first, then a connection accepted for it. When every place is taken, the next
/// connection is accepted anyway (one socket past the cap) and waits for a place: one given back, or that of the
/// connection idle the longest, closed once it has been idle for [`IDLE_GRACE`].
async fn next_connection(
    listener: &TcpListener,
    places: &Arc<Places>,
    shutdown: &CancellationToken,
) -> Option<(TcpStream, OwnedSemaphorePermit)> {
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return None,
            permit = places.free.clone().acquire_owned() => {
                let permit = permit.ok()?; // The semaphore is never closed.
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    accepted = listener.accept() => accepted.map(|(stream, _)| (stream, Some(permit))),
                }
            }
            accepted = listener.accept() => accepted.map(|(stream, _)| (stream, None)),
        };
        match accepted {
            Ok((stream, Some(permit))) => return Some((stream, permit)),
            Ok((stream, None)) => {
                let given_back = tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    permit = places.free.clone().acquire_owned() => Some(permit.ok()?),
                    () = places.evict_oldest_idle() => None,
                };
                let permit = match given_back {
                    Some(permit) => permit,
                    // The evicted connection gives its place back as it closes.
                    None => tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        permit = places.free.clone().acquire_owned() => permit.ok()?,
                    },
                };
                return Some((stream, permit));
            }
            Err(e) => {
                // Out of file descriptors, typically: wait a little rather than spin.
                tracing::warn!(error = %e, "http accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Whether the client has sent anything yet, asked once, without waiting: a probe's request is there as soon as
/// its connection is accepted. (The socket leaves the runtime for a moment because tokio reads only when the
/// reactor has said the socket is readable, which it cannot have said yet.)
fn has_spoken(stream: TcpStream) -> std::io::Result<(TcpStream, bool)> {
    let stream = stream.into_std()?;
    let spoken = matches!(stream.peek(&mut [0u8; 1]), Ok(n) if n > 0);
    Ok((TcpStream::from_std(stream)?, spoken))
}

/// The listener's places: at most [`MAX_CONNECTIONS`] connections at once, and which of them are idle (have
/// not sent a byte of their request), oldest first.
#[derive(Debug)]
struct Places {
    free: Arc<Semaphore>,
    idle: Mutex<VecDeque<Idle>>,
    next_id: AtomicU64,
}

/// A connection that has not sent a byte of its request: since when, and how to close it.
#[derive(Debug)]
struct Idle {
    id: u64,
    since: tokio::time::Instant,
    evicted: CancellationToken,
}

/// One connection's place, given back when the connection closes.
#[derive(Debug)]
struct Place {
    places: Arc<Places>,
    id: u64,
    /// Cancelled when the connection, idle, must give its place to a newcomer.
    evicted: CancellationToken,
    _permit: OwnedSemaphorePermit,
}

impl Places {
    fn new() -> Arc<Self> {
        Arc::new(Places {
            free: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            idle: Mutex::new(VecDeque::with_capacity(MAX_CONNECTIONS)),
            next_id: AtomicU64::new(0),
        })
    }

    /// The place of a connection accepted under `permit`; an `idle` one may be closed for a newcomer until its
    /// request arrives.
    fn take(self: &Arc<Self>, permit: OwnedSemaphorePermit, idle: bool) -> Place {
        let place = Place {
            places: self.clone(),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            evicted: CancellationToken::new(),
            _permit: permit,
        };
        if idle {
            self.waiting().push_back(Idle {
                id: place.id,
                since: tokio::time::Instant::now(),
                evicted: place.evicted.clone(),
            });
        }
        place
    }

    /// Connection `id` has a request (or has closed): it is not idle any more.
    fn busy(&self, id: u64) {
        self.waiting().retain(|idle| idle.id != id);
    }

    /// Closes the connection that has been idle the longest, once it has been idle for [`IDLE_GRACE`]. Never
    /// returns while no connection is idle: the caller, holding the accept loop, waits for a place given back.
    async fn evict_oldest_idle(&self) {
        loop {
            let oldest = self.waiting().front().map(|idle| (idle.id, idle.since));
            let Some((id, since)) = oldest else {
                // No connection becomes idle while nothing is accepted.
                return std::future::pending().await;
            };
            tokio::time::sleep_until(since + IDLE_GRACE).await;
            let mut waiting = self.waiting();
            if waiting.front().is_some_and(|idle| idle.id == id) {
                if let Some(idle) = waiting.pop_front() {
                    idle.evicted.cancel();
                }
                return;
            }
            // It spoke or closed meanwhile: the next one.
        }
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, VecDeque<Idle>> {
        // The queue is whole whatever a panicking holder was doing: a list of ids and tokens.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.places.busy(self.id);
    }
}

/// Serves one connection; on shutdown, finishes the request in flight (or closes an idle connection). Closed at
/// once if, still idle, it must give its place to a newcomer.
async fn connection(
    http: hyper::server::conn::http1::Builder,
    stream: TcpStream,
    app: Router,
    shutdown: CancellationToken,
    place: Place,
) {
    let routes = TowerToHyperService::new(app);
    let (places, id) = (place.places.clone(), place.id);
    let service = hyper::service::service_fn(move |request| {
        places.busy(id);
        hyper::service::Service::call(&routes, request)
    });
    let served = http.serve_connection(TokioIo::new(stream), service);
    let mut served = std::pin::pin!(served);
    let result = tokio::select! {
        result = served.as_mut() => result,
        _ = place.evicted.cancelled() => {
            tracing::debug!("closed an idle http connection to make room for a new one");
            Ok(())
        }
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
        // The loop's next attempt comes now rather than after its backoff: the next probe sees whether it worked.
        probes.heartbeat.probed_while_failing(unix_now_ms());
        return reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{failing}\n"));
    }
    let outage = probes.heartbeat.outage_since();
    match crate::store::readiness(&probes.pool).await {
        // The work loop is waiting for the database (at start, or in an outage): ready once a tick has read its
        // status (the loop retries at once, now that the database answers).
        Ok(()) if outage.is_some() => {
            probes.heartbeat.database_answers();
            let since = outage.map_or(0, |since| unix_now_ms().saturating_sub(since));
            reply(
                StatusCode::SERVICE_UNAVAILABLE,
                TEXT,
                format!(
                    "database reachable again; the replica has not read its status since it began waiting {since} ms ago\n"
                ),
            )
        }
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

    /// `/readyz` agrees with the work loop: on a database that answers, not ready while the loop is in an outage
    /// (and the loop is woken to retry at once), ready once a tick succeeded.
    #[sqlx::test]
    async fn readyz_is_not_ready_until_the_work_loop_has_left_its_outage(pool: sqlx::PgPool) {
        let probes = Probes {
            pool: crate::store::Db::from(pool),
            ..probes()
        };
        let heartbeat = probes.heartbeat.clone();
        let answer = |probes: Probes| async move { ready(State(probes)).await.status() };
        assert_eq!(answer(probes.clone()).await, StatusCode::OK);
        heartbeat.tick_failed(unix_now_ms(), TickFailure::Outage);
        assert_eq!(answer(probes.clone()).await, StatusCode::SERVICE_UNAVAILABLE);
        let woken = tokio::time::timeout(Duration::from_secs(1), heartbeat.database_answered());
        assert!(woken.await.is_ok(), "the probe woke the loop");
        heartbeat.tick_succeeded();
        assert_eq!(answer(probes).await, StatusCode::OK);
    }

    /// A listener being served, its port, its places and the token that stops it.
    struct Served {
        port: u16,
        places: Arc<Places>,
        shutdown: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }

    /// A loopback listener on a free port (not served yet: connections wait in its backlog).
    async fn bound() -> (TcpListener, u16) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        (listener, port)
    }

    fn start(listener: TcpListener, probes: Probes) -> Served {
        let port = listener.local_addr().expect("addr").port();
        let (places, shutdown) = (Places::new(), CancellationToken::new());
        let task = tokio::spawn(serve_in(
            listener,
            router(probes),
            places.clone(),
            shutdown.clone(),
        ));
        Served {
            port,
            places,
            shutdown,
            task,
        }
    }

    async fn listening() -> (u16, CancellationToken, tokio::task::JoinHandle<()>) {
        let (listener, _) = bound().await;
        let served = start(listener, probes());
        (served.port, served.shutdown, served.task)
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

    /// Waits until every place is taken (by connections the test opened before the listener was served).
    async fn all_taken(places: &Places) {
        while places.free.available_permits() > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Whether the server has closed `stream` (false: still open, nothing to read).
    fn closed(stream: &TcpStream) -> bool {
        match stream.try_read(&mut [0u8; 64]) {
            Ok(_) => true,
            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
        }
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
        let (listener, _) = bound().await;
        let served = start(listener, probes);
        let timeout = "cannot read the tick status: canceling statement due to statement timeout";
        heartbeat.tick_failed(unix_now_ms(), TickFailure::Error(timeout.into()));
        let ready = exchange(served.port, &get("/readyz")).await;
        let (status, _, body) = parts(&ready);
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable", "{ready}");
        assert!(body.starts_with("ticks failing for "), "{body}");
        assert!(
            body.ends_with(&format!("(1 attempts); last error: {timeout}\n")),
            "{body}"
        );
        // Within the window (60 s), liveness holds ...
        let health = exchange(served.port, &get("/healthz")).await;
        assert!(health.starts_with("HTTP/1.1 200 OK\r\n"), "{health}");
        // ... past it, it fails and says why.
        heartbeat.tick_failed(unix_now_ms() - 61_000, TickFailure::Outage);
        heartbeat.tick_failed(unix_now_ms() - 61_000, TickFailure::Error(timeout.into()));
        heartbeat.tick_failed(unix_now_ms(), TickFailure::Error(timeout.into()));
        heartbeat.progress_now();
        let health = exchange(served.port, &get("/healthz")).await;
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
        let health = exchange(served.port, &get("/healthz")).await;
        assert!(health.starts_with("HTTP/1.1 200 OK\r\n"), "{health}");
        let ready = exchange(served.port, &get("/readyz")).await;
        let (status, _, body) = parts(&ready);
        assert_eq!(status, "HTTP/1.1 503 Service Unavailable", "{ready}");
        assert!(body.starts_with("database "), "{body}");
        served.shutdown.cancel();
        served.task.await.expect("served");
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
    async fn an_idle_connection_gives_its_place_to_a_newcomer_and_shutdown_closes_the_rest() {
        let (listener, port) = bound().await;
        // Connections that never send a byte, waiting in the backlog before the listener is served, take every
        // place.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(TcpStream::connect(("127.0.0.1", port)).await.expect("connect"));
        }
        let served = start(listener, probes());
        all_taken(&served.places).await;
        // A probe is answered at once: the oldest idle connection is closed for it, the others keep theirs.
        let response = exchange(port, &get("/healthz")).await;
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert_eq!(read_all(&mut idle[0]).await, "", "closed without a response");
        assert!(
            idle[1..].iter().all(|s| !closed(s)),
            "only the oldest idle connection was closed"
        );

        // Shutdown closes the idle connections (no request in flight) and the listener returns.
        served.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), served.task)
            .await
            .expect("the listener stops within the head timeout's bound")
            .expect("served");
        for mut stream in idle.into_iter().skip(1) {
            assert_eq!(read_all(&mut stream).await, "", "closed without a response");
        }
        assert!(
            TcpStream::connect(("127.0.0.1", port)).await.is_err(),
            "the port is free"
        );
    }

    #[tokio::test]
    async fn with_every_place_serving_a_request_a_newcomer_waits_for_one_to_end() {
        let (listener, port) = bound().await;
        // Requests whose head is not complete yet (sent before the listener is served): each holds its place.
        let mut started = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            let mut stream = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\n")
                .await
                .expect("send");
            started.push(stream);
        }
        let served = start(listener, probes());
        all_taken(&served.places).await;
        assert!(served.places.waiting().is_empty(), "none of them is idle");
        let mut waiting = TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
        waiting.write_all(&get("/healthz")).await.expect("send");
        let mut byte = [0u8; 1];
        let early = tokio::time::timeout(Duration::from_millis(300), waiting.read(&mut byte)).await;
        assert!(early.is_err(), "answered past the connection cap");
        // One of them completes its head and is answered; its place goes to the newcomer.
        started[0].write_all(b"host: x\r\n\r\n").await.expect("send");
        assert!(read_all(&mut started[0]).await.starts_with("HTTP/1.1 200 OK\r\n"));
        let response = read_all(&mut waiting).await;
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        drop(started);
        served.shutdown.cancel();
        served.task.await.expect("served");
    }
}
