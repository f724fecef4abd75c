//! The `newsnack` binary as a child process: one command run to its end
//! ([`newsnack`]), and `newsnack serve` for tests that need real processes:
//! SIGKILL, SIGTERM, several instances on one database, memory per
//! instance, output that cannot be written. The address it serves on is
//! read from its stdout (or chosen beforehand, when its stdout goes where
//! nobody reads).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// `newsnack ARGS`, logging warnings only, with no database named: the
/// one way tests start the binary. A test changes what it needs on the
/// command returned (its environment, its pipes) before running it.
pub fn binary(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_newsnack"));
    command.args(args).env("RUST_LOG", "warn");
    command
}

/// `newsnack ARGS` on the database at `database_url` (see [`binary`]).
pub fn command(database_url: &str, args: &[&str]) -> Command {
    let mut command = binary(args);
    command.env("DATABASE_URL", database_url);
    command
}

/// Runs `newsnack ARGS` on the database at `database_url` to its end.
/// Blocking: from a multi-threaded test, call it from `block_in_place`.
pub fn newsnack(database_url: &str, args: &[&str]) -> std::process::Output {
    command(database_url, args).output().expect("run newsnack")
}

/// A command's output as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Where a `serve` started by [`ServeProcess::spawn_writing_to`] writes its
/// stdout and stderr.
pub enum Output<'a> {
    /// One pipe for both (as a log shipper reads them), read until the
    /// address is printed, then closed by its reader: every later write
    /// fails with `EPIPE`.
    ClosedPipe,
    /// This file for both, e.g. `/dev/full`, where every write fails with
    /// `ENOSPC`.
    File(&'a Path),
}

/// A running `newsnack serve`. Dropping it SIGKILLs it if it still runs, so
/// a failing test leaves no process behind.
pub struct ServeProcess {
    child: Child,
    pub addr: SocketAddr,
    pub name: String,
}

impl ServeProcess {
    /// Starts `newsnack serve` as instance `name` on `database_url`, on a
    /// free loopback port, with `env` on top (e.g. `NEWSNACK_LLM_URL`), and
    /// returns once it is serving. Blocking: call it from `block_in_place`.
    pub fn spawn(database_url: &str, name: &str, env: &[(&str, &str)]) -> ServeProcess {
        let mut child = command(database_url, &["serve"])
            .env("NEWSNACK_LISTEN", "127.0.0.1:0")
            .env("NEWSNACK_INSTANCE", name)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start newsnack serve");
        let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let addr = loop {
            let line = lines
                .next()
                .unwrap_or_else(|| panic!("serve {name} exited before serving"))
                .expect("read serve's stdout");
            if let Some(rest) = line.strip_prefix("newsnack serving on http://") {
                break rest.trim().parse().expect("serve printed its address");
            }
        };
        // Keep reading, so a later line never meets a closed pipe.
        std::thread::spawn(move || lines.for_each(drop));
        ServeProcess {
            child,
            addr,
            name: name.to_string(),
        }
    }

    /// Starts `newsnack serve` like [`ServeProcess::spawn`], its stdout and
    /// stderr going to `output`; returns once it answers. Blocking.
    pub fn spawn_writing_to(
        database_url: &str,
        name: &str,
        env: &[(&str, &str)],
        output: Output<'_>,
    ) -> ServeProcess {
        let mut command = command(database_url, &["serve"]);
        command
            .env("NEWSNACK_INSTANCE", name)
            .envs(env.iter().copied())
            .stdin(Stdio::null());
        match output {
            Output::ClosedPipe => {
                let (read, write) = pipe();
                command
                    .env("NEWSNACK_LISTEN", "127.0.0.1:0")
                    .stdout(write.try_clone().expect("dup the pipe"))
                    .stderr(write);
                let mut child = command.spawn().expect("start newsnack serve");
                // The parent's copies of the write end went with `command`'s
                // spawn; this is the only read end.
                drop(command);
                let mut lines = BufReader::new(File::from(read)).lines();
                let addr = loop {
                    let Some(line) = lines.next() else {
                        let status = child.wait().expect("reap serve");
                        panic!("serve {name} exited ({status}) before serving");
                    };
                    let line = line.expect("read serve's output");
                    if let Some(rest) = line.strip_prefix("newsnack serving on http://") {
                        break rest.trim().parse().expect("serve printed its address");
                    }
                };
                // The reader goes away.
                drop(lines);
                ServeProcess {
                    child,
                    addr,
                    name: name.to_string(),
                }
            }
            Output::File(path) => {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .expect("open the output file");
                let addr = free_port();
                command
                    .env("NEWSNACK_LISTEN", addr.to_string())
                    .stdout(file.try_clone().expect("dup the file"))
                    .stderr(file);
                let child = command.spawn().expect("start newsnack serve");
                let mut serve = ServeProcess {
                    child,
                    addr,
                    name: name.to_string(),
                };
                serve.until_answering(Duration::from_secs(60));
                serve
            }
        }
    }

    /// Waits until `GET /healthz` is answered, failing if the process
    /// exits first or `limit` passes. Blocking.
    fn until_answering(&mut self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("poll serve") {
                panic!("serve {} exited ({status}) before serving", self.name);
            }
            if healthz_answers(self.addr) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "serve {} did not answer within {limit:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `http://ADDR`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, and reap it.
    pub fn kill(&mut self) {
        self.child.kill().expect("SIGKILL serve");
        self.child.wait().expect("reap serve");
    }

    /// Waits for it to exit (after a signal the test sent). Blocking.
    pub fn wait(&mut self) -> ExitStatus {
        self.child.wait().expect("wait for serve to exit")
    }

    /// SIGTERM, then wait for it to exit. Blocking.
    pub fn terminate(&mut self) -> ExitStatus {
        self.stop_with(libc::SIGTERM)
    }

    /// `signal` (SIGTERM, SIGINT), then wait for it to exit. Blocking.
    pub fn stop_with(&mut self, signal: libc::c_int) -> ExitStatus {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, signal);
        }
        self.child.wait().expect("wait for serve to exit")
    }

    /// The resident memory of the process (VmRSS), in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A pipe: its read end and its write end.
fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2(2) fills both descriptors on success; each is then
    // owned exactly once.
    let made = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(made, 0, "pipe2: {}", std::io::Error::last_os_error());
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// A loopback address with a port nobody listens on right now.
fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|socket| socket.local_addr())
        .expect("find a free port")
}

/// Whether `GET /healthz` at `addr` answers 200.
fn healthz_answers(addr: SocketAddr) -> bool {
    use std::io::{Read, Write};
    let Ok(mut socket) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = socket.set_read_timeout(Some(Duration::from_secs(5)));
    let request = format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let mut answer = String::new();
    socket.write_all(request.as_bytes()).is_ok()
        && socket.read_to_string(&mut answer).is_ok()
        && answer.starts_with("HTTP/1.1 200")
}
