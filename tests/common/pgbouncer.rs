//! A real PgBouncer (Debian's, 1.18 or newer) in transaction pooling mode
//! with its default settings, in front of the test server: started per
//! test, stopped when dropped. Only what a test needs to reach it is set
//! (address, trust authentication, an admin user for `SHOW SERVERS`, its
//! own files); `pool_mode = transaction` is the point.

use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running PgBouncer. Dropping it stops it.
pub struct PgBouncer {
    child: Child,
    pub port: u16,
    dir: tempfile::TempDir,
}

/// Where PgBouncer is installed, or a panic that says how to install it:
/// the tests never pass by skipping what is missing.
fn binary() -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("pgbouncer"))
            .find(|p| p.is_file())
    });
    on_path
        .or_else(|| Some(PathBuf::from("/usr/sbin/pgbouncer")).filter(|p| p.is_file()))
        .unwrap_or_else(|| {
            panic!(
                "PgBouncer is not installed: `apt-get install pgbouncer` \
                 (the README's test command, scripts/test, installs it)"
            )
        })
}

impl PgBouncer {
    /// Starts PgBouncer in front of the server at `127.0.0.1:server_port`,
    /// letting in `users` (trust authentication, as the test server's).
    /// Blocking: call it from `spawn_blocking`.
    pub fn start(server_port: u16, users: &[&str]) -> PgBouncer {
        let run_as = newsnack::embedded::unprivileged_user().expect("a user to run PgBouncer as");
        let dir = tempfile::Builder::new()
            .prefix("newsnack-pgbouncer-")
            .tempdir()
            .unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let userlist: String = users.iter().map(|u| format!("\"{u}\" \"\"\n")).collect();
        std::fs::write(dir.path().join("userlist.txt"), userlist).unwrap();
        let ini = format!(
            "[databases]\n\
             * = host=127.0.0.1 port={server_port}\n\
             \n\
             [pgbouncer]\n\
             pool_mode = transaction\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir = {dir}\n\
             auth_type = trust\n\
             auth_file = {dir}/userlist.txt\n\
             admin_users = postgres\n\
             logfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\n",
            dir = dir.path().display()
        );
        std::fs::write(dir.path().join("pgbouncer.ini"), ini).unwrap();
        let mut command = Command::new(binary());
        command
            .arg(dir.path().join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some((uid, gid)) = run_as {
            for entry in std::fs::read_dir(dir.path()).unwrap() {
                std::os::unix::fs::chown(entry.unwrap().path(), Some(uid), Some(gid)).unwrap();
            }
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap();
            command.uid(uid).gid(gid);
        }
        // SAFETY: prctl is async-signal-safe; PgBouncer goes when the test
        // process does, however it ends.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("start pgbouncer");
        let bouncer = PgBouncer { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "PgBouncer did not listen within 20 s: {}",
                bouncer.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        bouncer
    }

    /// A URL for `database` through PgBouncer, as `user`.
    pub fn url(&self, user: &str, database: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{database}", self.port)
    }

    /// PgBouncer's log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }

    /// The backend pids of PgBouncer's server connections to `database`
    /// (`SHOW SERVERS` on its admin console).
    pub async fn server_pids(&self, database: &str) -> Vec<i32> {
        let (admin, connection) = tokio_postgres::connect(
            &format!(
                "host=127.0.0.1 port={} user=postgres dbname=pgbouncer",
                self.port
            ),
            tokio_postgres::NoTls,
        )
        .await
        .expect("PgBouncer's admin console");
        tokio::spawn(connection);
        let rows = admin.simple_query("SHOW SERVERS").await.unwrap();
        rows.iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => Some(r),
                _ => None,
            })
            .filter(|r| r.get("database") == Some(database))
            .filter_map(|r| r.get("remote_pid").and_then(|p| p.parse().ok()))
            .collect()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}
