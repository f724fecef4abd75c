//! The zero-configuration default: a private, throwaway PostgreSQL cluster
//! started from the machine's server binaries on a free loopback port and
//! stopped (and deleted) when dropped. [`EmbeddedPostgres::restart`] takes
//! it down and up again in place, for fault-injection tests.
//!
//! `initdb` refuses to run as root, so under root the cluster is created and
//! run as the `postgres` system user. The server is a child of a keeper
//! thread that lives as long as the cluster; the child asks the kernel for
//! SIGQUIT when that thread dies, so even a SIGKILLed newsnack leaves no
//! server behind.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Why the embedded cluster could not be started.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error(
        "no PostgreSQL server binaries found (looked on PATH, via pg_config --bindir and under /usr/lib/postgresql/*/bin): \
         install PostgreSQL 13 or newer (e.g. `apt-get install postgresql`) or set DATABASE_URL"
    )]
    NoBinaries,
    #[error(
        "running as root, and initdb refuses root: create a `postgres` system user \
         (e.g. `useradd --system postgres`) or set DATABASE_URL"
    )]
    NoUnprivilegedUser,
    #[error("{step} failed: {detail}")]
    Step { step: &'static str, detail: String },
    #[error("I/O error while preparing the cluster: {0}")]
    Io(#[from] std::io::Error),
}

/// Server settings for the throwaway cluster.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// `fsync` and synchronous commit. Off is fine for tests and demos.
    pub durable: bool,
    /// Extra `-c name=value` server settings.
    pub settings: Vec<(String, String)>,
    /// Files written into the data directory before the server first
    /// starts, readable by the server only (a certificate and its key).
    pub files: Vec<(String, Vec<u8>)>,
    /// `pg_hba.conf`, replacing initdb's (which trusts every local
    /// connection).
    pub pg_hba: Option<String>,
    /// The superuser's password, for a `pg_hba.conf` that asks for one.
    pub superuser_password: Option<String>,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        EmbeddedOptions {
            durable: true,
            settings: vec![("max_connections".into(), "200".into())],
            files: Vec::new(),
            pg_hba: None,
            superuser_password: None,
        }
    }
}

/// A running throwaway cluster. Dropping it stops the server and deletes its
/// files.
pub struct EmbeddedPostgres {
    port: u16,
    dir: Option<tempfile::TempDir>,
    /// How the server was launched, to launch it again on restart.
    launch: Option<Launch>,
    stop: Option<mpsc::Sender<()>>,
    keeper: Option<JoinHandle<()>>,
}

const SUPERUSER: &str = "postgres";
/// The server's log, in the cluster directory.
const SERVER_LOG: &str = "server.log";

/// How to launch the server of a cluster (again).
struct Launch {
    bin: PathBuf,
    run_as: Option<(u32, u32)>,
    options: EmbeddedOptions,
}

impl Launch {
    /// Starts `postgres` on the cluster in `dir` at `port`, logging to a
    /// fresh `server.log`, kept by a thread of its own.
    fn spawn(
        &self,
        dir: &Path,
        port: u16,
    ) -> Result<(u32, mpsc::Sender<()>, JoinHandle<()>), EmbeddedError> {
        let log_path = dir.join(SERVER_LOG);
        let log = std::fs::File::create(&log_path)?;
        if let Some((uid, gid)) = self.run_as {
            std::os::unix::fs::chown(&log_path, Some(uid), Some(gid))?;
        }
        let mut server = Command::new(self.bin.join("postgres"));
        server
            .arg("-D")
            .arg(dir.join("data"))
            .arg("-p")
            .arg(port.to_string())
            .arg("-c")
            .arg("listen_addresses=127.0.0.1")
            .arg("-c")
            .arg(format!("unix_socket_directories={}", dir.display()))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if !self.options.durable {
            server.args([
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ]);
        }
        for (name, value) in &self.options.settings {
            server.arg("-c").arg(format!("{name}={value}"));
        }
        as_user(&mut server, self.run_as);
        // SAFETY: prctl is async-signal-safe; it runs in the child after
        // fork (and after the uid change, which would clear it).
        unsafe {
            server.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGQUIT) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        spawn_kept(server)
    }
}

impl EmbeddedPostgres {
    /// Creates and starts a cluster. Blocking: call it from a plain thread
    /// or `spawn_blocking`.
    pub fn start(options: &EmbeddedOptions) -> Result<Self, EmbeddedError> {
        let bin = find_bin_dir().ok_or(EmbeddedError::NoBinaries)?;
        let run_as = unprivileged_user()?;
        let dir = tempfile::Builder::new().prefix("newsnack-pg-").tempdir()?;
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))?;
        }
        let data = init_cluster(&bin, run_as, dir.path(), options)?;
        write_server_files(&data, run_as, options)?;
        let launch = Launch {
            bin,
            run_as,
            options: options.clone(),
        };
        Self::launch_on_a_free_port(dir, launch)
    }

    /// Starts the server on a free port, trying another should the port be
    /// taken between choosing it and binding it.
    fn launch_on_a_free_port(
        dir: tempfile::TempDir,
        launch: Launch,
    ) -> Result<Self, EmbeddedError> {
        let log_path = dir.path().join(SERVER_LOG);
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = free_port()?;
            let (child, stop, keeper) = launch.spawn(dir.path(), port)?;
            let mut cluster = EmbeddedPostgres {
                port,
                dir: None,
                launch: None,
                stop: Some(stop),
                keeper: Some(keeper),
            };
            match wait_ready(&log_path, child) {
                Ok(()) => {
                    cluster.dir = Some(dir);
                    cluster.launch = Some(launch);
                    return Ok(cluster);
                }
                Err(e) => {
                    cluster.shutdown();
                    last_error = format!(
                        "{e}; server log: {}",
                        last_lines(&std::fs::read_to_string(&log_path).unwrap_or_default(), 5)
                    );
                }
            }
        }
        Err(EmbeddedError::Step {
            step: "starting postgres",
            detail: last_error,
        })
    }

    /// Restarts the server as `pg_ctl restart -m fast` does: a fast shutdown
    /// (every session is disconnected, open transactions roll back), then a
    /// start on the same data directory and port. Blocking.
    pub fn restart(&mut self) -> Result<(), EmbeddedError> {
        self.shutdown();
        let (Some(dir), Some(launch)) = (&self.dir, &self.launch) else {
            return Err(EmbeddedError::Step {
                step: "restarting postgres",
                detail: "the cluster was never started".into(),
            });
        };
        let (child, stop, keeper) = launch.spawn(dir.path(), self.port)?;
        self.stop = Some(stop);
        self.keeper = Some(keeper);
        wait_ready(&dir.path().join(SERVER_LOG), child).map_err(|detail| EmbeddedError::Step {
            step: "restarting postgres",
            detail,
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// A URL for `database` on this cluster, as the superuser.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{database}", self.port)
    }

    /// The directory holding the cluster and its `server.log`.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_ref().map(|d| d.path())
    }

    /// Stops the server (fast shutdown) and waits for it to exit.
    pub fn shutdown(&mut self) {
        drop(self.stop.take());
        if let Some(keeper) = self.keeper.take() {
            let _ = keeper.join();
        }
    }
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Runs `initdb` in `dir` as `run_as`; returns the data directory.
fn init_cluster(
    bin: &Path,
    run_as: Option<(u32, u32)>,
    dir: &Path,
    options: &EmbeddedOptions,
) -> Result<PathBuf, EmbeddedError> {
    let data = dir.join("data");
    let mut initdb = Command::new(bin.join("initdb"));
    let pwfile = dir.join("superuser.pw");
    if let Some(password) = &options.superuser_password {
        std::fs::write(&pwfile, password)?;
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&pwfile, Some(uid), Some(gid))?;
        }
        initdb.arg(format!("--pwfile={}", pwfile.display()));
    }
    initdb
        .arg("-D")
        .arg(&data)
        .args([
            "-U",
            SUPERUSER,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        ])
        .current_dir(dir);
    as_user(&mut initdb, run_as);
    let out = initdb.output()?;
    let _ = std::fs::remove_file(&pwfile);
    if !out.status.success() {
        return Err(EmbeddedError::Step {
            step: "initdb",
            detail: last_lines(&String::from_utf8_lossy(&out.stderr), 5),
        });
    }
    Ok(data)
}

/// Writes the options' extra server files and `pg_hba.conf` into `data`,
/// readable by the server's user only.
fn write_server_files(
    data: &Path,
    run_as: Option<(u32, u32)>,
    options: &EmbeddedOptions,
) -> Result<(), EmbeddedError> {
    use std::os::unix::fs::PermissionsExt;
    let server_files = options
        .files
        .iter()
        .map(|(name, contents)| (name.as_str(), contents.as_slice()))
        .chain(
            options
                .pg_hba
                .as_deref()
                .map(|hba| ("pg_hba.conf", hba.as_bytes())),
        );
    for (name, contents) in server_files {
        let path = data.join(name);
        std::fs::write(&path, contents)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&path, Some(uid), Some(gid))?;
        }
    }
    Ok(())
}

/// Starts `command` from a thread that stays alive until told to stop, so
/// the child's parent-death signal fires only when the process goes away.
fn spawn_kept(
    mut command: Command,
) -> Result<(u32, mpsc::Sender<()>, JoinHandle<()>), EmbeddedError> {
    let (started_tx, started_rx) = mpsc::channel::<std::io::Result<u32>>();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let keeper = std::thread::Builder::new()
        .name("newsnack-pg-keeper".into())
        .spawn(move || {
            let mut child: Child = match command.spawn() {
                Ok(child) => child,
                Err(e) => {
                    let _ = started_tx.send(Err(e));
                    return;
                }
            };
            let _ = started_tx.send(Ok(child.id()));
            // Blocks until stop is requested or the owner is dropped.
            let _ = stop_rx.recv();
            stop_child(&mut child);
        })?;
    let pid = started_rx.recv().map_err(|_| EmbeddedError::Step {
        step: "starting postgres",
        detail: "keeper thread died".into(),
    })??;
    Ok((pid, stop_tx, keeper))
}

/// SIGINT is PostgreSQL's fast shutdown; escalate to SIGKILL after 15 s.
fn stop_child(child: &mut Child) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Ready when the server says so in its log (messages are in English:
/// the cluster is created with `--no-locale`), or failed when it exits.
fn wait_ready(log_path: &Path, pid: u32) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let log = std::fs::read_to_string(log_path).unwrap_or_default();
        if log.contains("database system is ready to accept connections") {
            return Ok(());
        }
        // SAFETY: signal 0 only checks that the process exists.
        if unsafe { libc::kill(pid as libc::pid_t, 0) } != 0 {
            return Err("postgres exited during start-up".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err("postgres did not become ready within 30 s".into())
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn as_user(command: &mut Command, run_as: Option<(u32, u32)>) {
    if let Some((uid, gid)) = run_as {
        command.uid(uid).gid(gid);
    }
}

/// Who the embedded server runs as: `None` when not root (the current
/// user), the `postgres` user's ids when root. Also for other servers a
/// test starts beside it (a connection pooler that refuses root).
pub fn unprivileged_user() -> Result<Option<(u32, u32)>, EmbeddedError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let name = std::ffi::CString::new(SUPERUSER).expect("no NUL in a constant");
    // SAFETY: getpwnam returns a pointer into static storage or NULL; the
    // fields are copied out immediately, before any other call.
    let entry = unsafe { libc::getpwnam(name.as_ptr()) };
    if entry.is_null() {
        return Err(EmbeddedError::NoUnprivilegedUser);
    }
    let (uid, gid) = unsafe { ((*entry).pw_uid, (*entry).pw_gid) };
    Ok(Some((uid, gid)))
}

/// Where `initdb` and `postgres` live: on PATH, via `pg_config --bindir`, or
/// the newest `/usr/lib/postgresql/*/bin`.
pub fn find_bin_dir() -> Option<PathBuf> {
    let has_server = |dir: &Path| dir.join("initdb").is_file() && dir.join("postgres").is_file();
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(dir) = std::env::split_paths(&path).find(|d| has_server(d)) {
            // Follow symlinks (e.g. /usr/local/bin/initdb) to the real
            // installation, whose sibling tools match its version.
            return dir
                .join("initdb")
                .canonicalize()
                .ok()
                .and_then(|p| p.parent().map(Path::to_path_buf))
                .filter(|d| has_server(d))
                .or(Some(dir));
        }
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && has_server(&dir) {
            return Some(dir);
        }
    }
    let mut candidates: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let version = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            Some((version, e.path().join("bin")))
        })
        .filter(|(_, dir)| has_server(dir))
        .collect();
    candidates.sort();
    candidates.pop().map(|(_, dir)| dir)
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}
