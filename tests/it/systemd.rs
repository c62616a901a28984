//! The systemd side of a replica: the notification protocol against a real `NOTIFY_SOCKET`, and the unit file's
//! file-descriptor limit against what a replica holds open.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use sqlx::PgPool;
use tokio::net::UnixDatagram;

use crate::helpers::{
    daemon, database_url, due_now, exit_of, fine_settler, migrate, output, signal, slow_down, wait_until,
};

type Received = Arc<Mutex<Vec<(Instant, String)>>>;

/// Collects every datagram sent to `socket`, with its arrival time.
fn listen(socket: UnixDatagram) -> Received {
    let received: Received = Arc::default();
    let sink = received.clone();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        while let Ok(n) = socket.recv(&mut buf).await {
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            sink.lock().expect("lock").push((Instant::now(), msg));
        }
    });
    received
}

fn first(received: &Received, prefix: &str) -> Option<Instant> {
    received
        .lock()
        .expect("lock")
        .iter()
        .find(|(_, m)| m.lines().any(|l| l.starts_with(prefix)))
        .map(|(t, _)| *t)
}

/// READY=1 only once migrations are applied; WATCHDOG=1 follows the loop (an 8 s batch shows as an 8 s gap,
/// idle pets come every quarter of WatchdogSec), never late enough to trip the watchdog; STOPPING=1 on SIGTERM.
#[sqlx::test(migrations = false)]
async fn notify_protocol_ready_after_migrations_watchdog_from_progress_stopping(pool: PgPool) {
    let month_end = due_now(&pool, 1).await[0];
    let returned = month_end.to_string();
    // libraryd's table before fine-settler, ten loans returned in the due month, each update slowed to 0.8 s:
    // the one batch of ten takes 8 s.
    sqlx::raw_sql(&format!(
        "create table loans (id bigint primary key, member_id bigint not null, book_id bigint not null,
                             borrowed_on date not null, due_on date not null, returned_on date,
                             fine_cents bigint not null default 0);
         insert into loans select g, 1, 1, date '{returned}' - 40, date '{returned}' - 10, date '{returned}'
         from generate_series(1, 10) g;"
    ))
    .execute(&pool)
    .await
    .expect("libraryd schema");
    slow_down(&pool, "update on loans", 0.8).await;

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("notify");
    let received = listen(UnixDatagram::bind(&path).expect("bind NOTIFY_SOCKET"));
    let url = database_url(&pool);
    let watchdog = Duration::from_secs(20);
    let replica = daemon(
        &url,
        0,
        1,
        &[
            ("NOTIFY_SOCKET", path.to_str().expect("utf-8 path")),
            ("WATCHDOG_USEC", &watchdog.as_micros().to_string()),
            ("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "10s"),
            ("FINE_SETTLER__CLAIM__LEASE", "25s"),
            ("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", "10"),
            ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
        ],
    );

    wait_until("a not-ready status", Duration::from_secs(10), || async {
        first(&received, "STATUS=not ready: migrations missing").is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(first(&received, "READY=1").is_none(), "READY=1 before migrations");
    migrate(&url);
    let migrated = Instant::now();
    wait_until("READY=1", Duration::from_secs(40), || async {
        first(&received, "READY=1").is_some()
    })
    .await;
    let ready = first(&received, "READY=1").expect("ready");
    assert!(ready >= migrated);

    wait_until("the month settled", Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, String>("select status from job_runs")
            .fetch_optional(&pool)
            .await
            .ok()
            .flatten()
            .as_deref()
            == Some("SUCCESS")
    })
    .await;
    let settled = Instant::now();
    tokio::time::sleep(Duration::from_secs(16)).await;
    signal(&replica, "TERM");
    let (code, stderr) = exit_of(replica, Duration::from_secs(20)).await;
    assert_eq!(code, Some(0), "{stderr}");
    wait_until("STOPPING=1", Duration::from_secs(2), || async {
        first(&received, "STOPPING=1").is_some()
    })
    .await;

    // From READY=1 on, systemd expects a ping within every WatchdogSec.
    let pets: Vec<Instant> = std::iter::once(ready)
        .chain(
            received
                .lock()
                .expect("lock")
                .iter()
                .filter(|(t, m)| m == "WATCHDOG=1" && *t >= ready)
                .map(|(t, _)| *t),
        )
        .collect();
    for (t, m) in received.lock().expect("lock").iter() {
        eprintln!("{:>8.3} {m:?}", t.duration_since(migrated).as_secs_f64());
    }
    eprintln!("settled at {:.3}", settled.duration_since(migrated).as_secs_f64());
    let gaps: Vec<(Instant, Duration)> = pets.windows(2).map(|w| (w[1], w[1] - w[0])).collect();
    let during: Vec<Duration> = gaps.iter().filter(|(t, _)| *t <= settled).map(|g| g.1).collect();
    let idle: Vec<Duration> = gaps
        .iter()
        .filter(|(t, _)| *t > settled + Duration::from_secs(1))
        .map(|g| g.1)
        .collect();
    assert!(idle.len() >= 2, "idle pets: {gaps:?}");
    assert!(
        gaps.iter().all(|(_, g)| *g < watchdog),
        "a gap reached WatchdogSec: {gaps:?}"
    );
    assert!(
        idle.iter()
            .all(|g| *g >= watchdog / 4 - Duration::from_millis(50) && *g < Duration::from_millis(7500)),
        "idle pets every quarter of WatchdogSec: {idle:?}"
    );
    assert!(
        during.iter().any(|g| *g >= Duration::from_millis(7900)),
        "the 8 s batch shows as a gap (pets follow progress, not a timer): {during:?}"
    );
}

#[tokio::test]
async fn a_watchdog_shorter_than_two_batch_timeouts_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("notify");
    let _socket = UnixDatagram::bind(&path).expect("bind");
    let mut cmd = fine_settler("postgres://nobody:secret@127.0.0.1:1/none");
    cmd.env("NOTIFY_SOCKET", &path)
        .env("WATCHDOG_USEC", "50000000")
        .env("FINE_SETTLER__CLAIM__BATCH_TIMEOUT", "30s")
        .arg("run");
    let out = output(cmd);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("WatchdogSec (50s)"), "{stderr}");
    assert!(!stderr.contains("secret"), "{stderr}");
}

/// `LimitNOFILE` of the replica's unit leaves headroom (four times) over what a replica holds open at most: the
/// HTTP listener's client sockets (its places and one newcomer) and itself, `database.max_connections` of the
/// shipped configuration plus the tick's session, the status page's connection and a host search of each pool,
/// and at most 16 of its own (stdio, the runtime's).
#[test]
fn the_unit_s_file_descriptor_limit_leaves_headroom_over_what_a_replica_holds() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |rel: &str| std::fs::read_to_string(root.join(rel)).expect(rel);
    let unit = read("deploy/systemd/fine-settler@.service");
    let limits: Vec<&str> = unit
        .lines()
        .filter_map(|l| l.strip_prefix("LimitNOFILE="))
        .collect();
    assert_eq!(limits.len(), 1, "one LimitNOFILE: {limits:?}");
    let limit: usize = limits[0]
        .parse()
        .expect("one number: the same soft and hard limit");
    let max_connections = |rel: &str| {
        let toml: toml::Value = toml::from_str(&read(rel)).expect(rel);
        toml.get("database")
            .and_then(|d| d.get("max_connections"))
            .and_then(toml::Value::as_integer)
    };
    let database = max_connections("deploy/systemd/fine-settler.toml")
        .or_else(|| max_connections("config/default.toml"))
        .expect("database.max_connections");
    let need =
        (fine_settler::http::MAX_CONNECTIONS + 2) + (usize::try_from(database).expect("size") + 4) + 16;
    assert!(
        limit >= 4 * need,
        "LimitNOFILE={limit}, a replica holds up to {need} file descriptors"
    );
}
