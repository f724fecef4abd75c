//! `newsnack serve` as a child process, for tests that need real processes:
//! SIGKILL, SIGTERM, several instances on one database, memory per
//! instance. The address it serves on is read from its stdout.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};

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
        let mut child = Command::new(env!("CARGO_BIN_EXE_newsnack"))
            .arg("serve")
            .env("DATABASE_URL", database_url)
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

    /// SIGTERM, then wait for it to exit. Blocking.
    pub fn terminate(&mut self) -> ExitStatus {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
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
