//! A gate in front of the test database, for database outages on cue: a
//! TCP relay on 127.0.0.1 that, while open, relays every connection to the
//! database and, while closed, hangs up on new ones (counting them) after
//! cutting those it was relaying.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::TestDb;

pub struct DbGate {
    /// The database URL through the gate.
    pub url: String,
    open: watch::Sender<bool>,
    turned_away: watch::Receiver<u32>,
    relays: Arc<Mutex<JoinSet<()>>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl DbGate {
    /// A gate in front of `db`, open or closed.
    pub async fn start(db: &TestDb, open: bool) -> DbGate {
        let gate = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gate_port = gate.local_addr().unwrap().port();
        let server = match db.config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(host)) => {
                format!("{host}:{}", db.config.get_ports()[0])
            }
            other => panic!("the test cluster listens on TCP, not {other:?}"),
        };
        let (open_tx, is_open) = watch::channel(open);
        let (turned_away_tx, turned_away) = watch::channel(0u32);
        let relays: Arc<Mutex<JoinSet<()>>> = Arc::default();
        let accepting = tokio::spawn({
            let relays = relays.clone();
            async move {
                loop {
                    let (mut inbound, _) = gate.accept().await.unwrap();
                    if !*is_open.borrow() {
                        drop(inbound);
                        turned_away_tx.send_modify(|n| *n += 1);
                        continue;
                    }
                    let server = server.clone();
                    relays.lock().unwrap().spawn(async move {
                        let mut outbound = TcpStream::connect(server).await.unwrap();
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    });
                }
            }
        });
        let port = db.config.get_ports()[0];
        let url = db
            .url
            .replace(&format!(":{port}/"), &format!(":{gate_port}/"));
        assert_ne!(url, db.url);
        DbGate {
            url,
            open: open_tx,
            turned_away,
            relays,
            accepting,
        }
    }

    /// Lets connections through again.
    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// Cuts every relayed connection and turns new ones away.
    pub fn close(&self) {
        self.open.send_replace(false);
        self.relays.lock().unwrap().abort_all();
    }

    /// Waits until at least `n` connections were turned away in all.
    pub async fn until_turned_away(&self, n: u32) {
        let mut turned_away = self.turned_away.clone();
        super::within(30, "connections turned away at the gate", async {
            turned_away.wait_for(|count| *count >= n).await.unwrap();
        })
        .await;
    }
}

impl Drop for DbGate {
    fn drop(&mut self) {
        self.accepting.abort();
        self.relays.lock().unwrap().abort_all();
    }
}
