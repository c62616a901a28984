//! A TCP proxy in front of PostgreSQL whose connections the test can cut at any moment.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use tokio::net::{TcpListener, TcpStream};

pub struct Proxy {
    port: u16,
    upstream: u16,
    cut: tokio::sync::watch::Sender<u64>,
    frozen: tokio::sync::watch::Sender<u64>,
    active: Arc<AtomicU64>,
}

impl Proxy {
    /// Listens on a free loopback port and relays every connection to `upstream`.
    pub async fn start(upstream: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("addr").port();
        let (cut, _) = tokio::sync::watch::channel(0u64);
        let (frozen, _) = tokio::sync::watch::channel(0u64);
        let active = Arc::new(AtomicU64::new(0));
        let (tx, freeze, count) = (cut.clone(), frozen.clone(), active.clone());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let mut cut = tx.subscribe();
                let mut frozen = freeze.subscribe();
                let count = count.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                        return;
                    };
                    count.fetch_add(1, Ordering::SeqCst);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.changed() => {}
                        // Black-holed: both sockets stay open, nothing more is relayed, until a cut.
                        _ = frozen.changed() => { let _ = cut.changed().await; }
                    }
                    count.fetch_sub(1, Ordering::SeqCst);
                    // Both sockets drop here: the replica and the server each see their connection end,
                    // whatever was in flight.
                });
            }
        });
        Proxy {
            port,
            upstream,
            cut,
            frozen,
            active,
        }
    }

    /// `url` (of the upstream server) rewritten to go through the proxy.
    pub fn route(&self, url: &str) -> String {
        url.replace(&format!(":{}/", self.upstream), &format!(":{}/", self.port))
    }

    /// Black-holes every connection open now (a lost route: the sockets stay open, no byte gets through either
    /// way) until the next cut; connections opened later are relayed.
    pub fn freeze_all(&self) {
        self.frozen.send_modify(|g| *g += 1);
    }

    /// Cuts every connection open now; returns how many.
    pub fn cut_all(&self) -> u64 {
        let n = self.active.load(Ordering::SeqCst);
        self.cut.send_modify(|g| *g += 1);
        n
    }
}
