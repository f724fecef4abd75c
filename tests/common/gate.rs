//! TCP relays for outages and switch-overs on cue. A [`Relay`] on
//! 127.0.0.1 passes every connection to its upstream while it has one, and
//! hangs up on new ones (counting them) while it has none; [`DbGate`] is a
//! relay in front of the test database, for database outages.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::TestDb;

/// See the module docs.
pub struct Relay {
    /// Where clients connect.
    pub addr: SocketAddr,
    upstream: watch::Sender<Option<String>>,
    turned_away: watch::Receiver<u32>,
    relays: Arc<Mutex<JoinSet<()>>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// A relay to `upstream` (`host:port`), or turning connections away.
    pub async fn start(upstream: Option<String>) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (upstream_tx, upstream_rx) = watch::channel(upstream);
        let (turned_away_tx, turned_away) = watch::channel(0u32);
        let relays: Arc<Mutex<JoinSet<()>>> = Arc::default();
        let accepting = tokio::spawn({
            let relays = relays.clone();
            async move {
                loop {
                    let (mut inbound, _) = listener.accept().await.unwrap();
                    let Some(server) = upstream_rx.borrow().clone() else {
                        drop(inbound);
                        turned_away_tx.send_modify(|n| *n += 1);
                        continue;
                    };
                    relays.lock().unwrap().spawn(async move {
                        let mut outbound = TcpStream::connect(server).await.unwrap();
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    });
                }
            }
        });
        Relay {
            addr,
            upstream: upstream_tx,
            turned_away,
            relays,
            accepting,
        }
    }

    /// New connections go to `upstream` (or are turned away); those already
    /// relayed stay as they are.
    pub fn route(&self, upstream: Option<String>) {
        self.upstream.send_replace(upstream);
    }

    /// Cuts every connection relayed so far.
    pub fn cut(&self) {
        self.relays.lock().unwrap().abort_all();
    }

    /// Waits until at least `n` connections were turned away in all.
    pub async fn until_turned_away(&self, n: u32) {
        let mut turned_away = self.turned_away.clone();
        super::within(30, "connections turned away at the relay", async {
            turned_away.wait_for(|count| *count >= n).await.unwrap();
        })
        .await;
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.accepting.abort();
        self.relays.lock().unwrap().abort_all();
    }
}

/// A relay in front of the test database, open or closed.
pub struct DbGate {
    /// The database URL through the gate.
    pub url: String,
    server: String,
    relay: Relay,
}

impl DbGate {
    /// A gate in front of `db`, open or closed.
    pub async fn start(db: &TestDb, open: bool) -> DbGate {
        let server = match db.config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(host)) => {
                format!("{host}:{}", db.config.get_ports()[0])
            }
            other => panic!("the test cluster listens on TCP, not {other:?}"),
        };
        let relay = Relay::start(open.then(|| server.clone())).await;
        let port = db.config.get_ports()[0];
        let url = db
            .url
            .replace(&format!(":{port}/"), &format!(":{}/", relay.addr.port()));
        assert_ne!(url, db.url);
        DbGate { url, server, relay }
    }

    /// A pool of the service's kind whose sessions go through the gate.
    pub fn pool(&self) -> newsnack::db::DbPool {
        let gated = newsnack::db::Endpoint::parse(&self.url, "gated").unwrap();
        newsnack::db::pool(&gated, &newsnack::db::PoolOptions::default()).unwrap()
    }

    /// Lets connections through again.
    pub fn open(&self) {
        self.relay.route(Some(self.server.clone()));
    }

    /// Cuts every relayed connection and turns new ones away.
    pub fn close(&self) {
        self.relay.route(None);
        self.relay.cut();
    }

    /// Waits until at least `n` connections were turned away in all.
    pub async fn until_turned_away(&self, n: u32) {
        self.relay.until_turned_away(n).await;
    }
}
