//! `promtool`, from Debian's `prometheus` package, unpacked (never
//! installed: no service starts) into the test cache the Python venvs use
//! (see [`super::python`]), once. `scripts/test` refreshes the package
//! lists where they are missing; a machine where `apt-get download` cannot
//! fetch the package fails the test with what to run.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Command;

/// The path of `promtool`, unpacked on first use. Blocking.
pub fn promtool() -> PathBuf {
    let cache = super::python::cache_dir();
    std::fs::create_dir_all(&cache).unwrap();
    let dir = cache.join("prometheus-deb");
    let promtool = dir.join("root/usr/bin/promtool");
    let lock = File::create(cache.join("prometheus-deb.lock")).unwrap();
    // SAFETY: flock on a file descriptor this function owns; released when
    // `lock` is dropped.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    if promtool.exists() {
        return promtool;
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    eprintln!(
        "unpacking Debian's prometheus package into {} (cached for later runs)",
        dir.display()
    );
    let download = Command::new("apt-get")
        .args(["download", "prometheus"])
        .current_dir(&dir)
        .output();
    let downloaded = match download {
        Ok(out) if out.status.success() => out,
        Ok(out) => panic!(
            "apt-get download prometheus failed: {} (run `apt-get update` first; scripts/test does)",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!(
            "cannot run apt-get ({e}): promtool comes from Debian's prometheus package \
             (`apt-get download prometheus && dpkg -x prometheus_*.deb DIR`)"
        ),
    };
    drop(downloaded);
    let deb = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .expect("apt-get download left a .deb");
    let unpacked = Command::new("dpkg")
        .arg("-x")
        .arg(&deb)
        .arg(dir.join("root"))
        .output()
        .expect("run dpkg -x");
    assert!(
        unpacked.status.success(),
        "dpkg -x {} failed: {}",
        deb.display(),
        String::from_utf8_lossy(&unpacked.stderr)
    );
    assert!(
        promtool.exists(),
        "the prometheus package holds no usr/bin/promtool"
    );
    promtool
}
