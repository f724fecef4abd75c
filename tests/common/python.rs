//! Python tools the tests run for real (Apache Airflow, Schemathesis, the
//! `rotel` OpenTelemetry collector), installed from PyPI into virtual
//! environments cached between runs: under `$NEWSNACK_TEST_CACHE`, else
//! `$XDG_CACHE_HOME/newsnack-tests`, else `~/.cache/newsnack-tests`, one
//! per pinned set of requirements. A missing `python3` or `venv` fails the
//! test with what to install: nothing passes by skipping.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Command;

/// `python3`, or a panic that says how to get it.
pub fn python3() -> &'static str {
    match Command::new("python3").arg("--version").output() {
        Ok(out) if out.status.success() => "python3",
        _ => panic!(
            "python3 is not installed: `apt-get install python3 python3-venv` \
             (the README's test command, scripts/test, installs it)"
        ),
    }
}

/// Where the tests keep what they install (venvs, unpacked packages).
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("NEWSNACK_TEST_CACHE") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("newsnack-tests")
}

/// The `bin` directory of a virtual environment named `name` holding
/// exactly `requirements` (pip specifiers, pinned), made on first use.
/// Blocking (an install takes minutes): call it from `spawn_blocking`.
/// Several test processes asking at once install it once.
pub fn venv(name: &str, requirements: &[&str]) -> PathBuf {
    let python = python3();
    let cache = cache_dir();
    std::fs::create_dir_all(&cache).unwrap();
    let tag: u64 = requirements
        .iter()
        .flat_map(|r| r.bytes().chain(std::iter::once(0)))
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
    let dir = cache.join(format!("{name}-{tag:016x}"));
    let lock = File::create(cache.join(format!("{name}.lock"))).unwrap();
    // SAFETY: flock on a file descriptor this function owns; released when
    // `lock` is dropped.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    let done = dir.join(".installed");
    if !done.exists() {
        let _ = std::fs::remove_dir_all(&dir);
        eprintln!(
            "installing {requirements:?} into {} (cached for later runs)",
            dir.display()
        );
        run_or_fail(
            Command::new(python).args(["-m", "venv"]).arg(&dir),
            |stderr| {
                format!(
                    "python3 -m venv failed: {stderr} (on Debian: apt-get install python3-venv)"
                )
            },
        );
        run_or_fail(
            Command::new(dir.join("bin/pip"))
                .args(["install", "--quiet", "--disable-pip-version-check"])
                .args(requirements),
            |stderr| format!("pip install {requirements:?} failed: {stderr}"),
        );
        std::fs::write(&done, requirements.join("\n")).unwrap();
    }
    dir.join("bin")
}

/// Runs `command` to its end, failing with `failed(its stderr)` unless it
/// succeeds.
fn run_or_fail(command: &mut Command, failed: impl FnOnce(String) -> String) {
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        failed(String::from_utf8_lossy(&out.stderr).into_owned())
    );
}

/// The Airflow provider in this checkout (`integrations/airflow`).
pub const PROVIDER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/integrations/airflow");
/// Apache Airflow 3 (the newest release) with the provider's test tools.
pub const AIRFLOW_3: &[&str] = &["apache-airflow==3.3.2", "pytest==9.2.0", "mypy==2.4.1"];
/// Apache Airflow 2.10, the oldest the provider supports.
pub const AIRFLOW_2: &[&str] = &["apache-airflow==2.10.5", "pytest==9.2.0"];

/// The `bin` directory of a venv holding `requirements` and the provider
/// as an editable install of this checkout (its edits need no reinstall).
pub async fn provider_venv(name: &'static str, requirements: &'static [&'static str]) -> PathBuf {
    tokio::task::spawn_blocking(move || {
        let mut all = requirements.to_vec();
        all.extend(["-e", PROVIDER]);
        venv(name, &all)
    })
    .await
    .unwrap()
}

/// The `rotel` OpenTelemetry collector (an OTLP receiver), pinned.
pub const ROTEL: &[&str] = &["rotel==0.0.1a15"];

/// The `rotel-agent` executable of the cached `rotel` venv, installed on
/// first use.
pub async fn rotel_agent() -> PathBuf {
    let bin = tokio::task::spawn_blocking(|| venv("rotel", ROTEL))
        .await
        .unwrap();
    let out = Command::new(bin.join("python"))
        .args([
            "-c",
            "import os, rotel; print(os.path.dirname(rotel.__file__))",
        ])
        .output()
        .expect("run the environment's python");
    let dir = String::from_utf8(out.stdout).unwrap();
    let agent = PathBuf::from(dir.trim()).join("rotel-agent");
    assert!(agent.exists(), "no rotel-agent in {}", dir.trim());
    agent
}

/// A running `rotel` collector (an OTLP receiver) on two free loopback
/// ports, discarding what it receives after printing it to `print`
/// (`verbosity` `basic`: a count per batch; `detailed`: every span).
/// Killed when dropped.
pub struct Rotel {
    child: std::process::Child,
    /// Its OTLP/gRPC and OTLP/HTTP addresses.
    pub grpc: std::net::SocketAddr,
    pub http: std::net::SocketAddr,
    /// The file its print goes to.
    pub print: PathBuf,
    _dir: tempfile::TempDir,
}

impl Rotel {
    /// Starts the collector; returns once both ports listen (at most 30 s).
    pub async fn start(verbosity: &str) -> Rotel {
        let agent = rotel_agent().await;
        let dir = tempfile::tempdir().unwrap();
        let print = dir.path().join("received.txt");
        let free = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
        };
        let (grpc, http) = (free(), free());
        let child = Command::new(&agent)
            .args(["start", "--exporter", "blackhole"])
            .args(["--debug-log", "traces", "--debug-log-verbosity", verbosity])
            .args(["--otlp-grpc-endpoint", &grpc.to_string()])
            .args(["--otlp-http-endpoint", &http.to_string()])
            .arg("--pid-file")
            .arg(dir.path().join("rotel.pid"))
            .arg("--log-file")
            .arg(dir.path().join("rotel.log"))
            .stdout(File::create(&print).unwrap())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", agent.display()));
        let rotel = Rotel {
            child,
            grpc,
            http,
            print,
            _dir: dir,
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        for port in [grpc, http] {
            while tokio::net::TcpStream::connect(port).await.is_err() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the collector did not listen within 30 s"
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
        rotel
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Rotel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
