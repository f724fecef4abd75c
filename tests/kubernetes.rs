//! The Kubernetes manifests (`deploy/kubernetes`): the default deployment
//! and every overlay, rendered by `kubectl kustomize`, pass
//! `kubernetes-validate` in strict mode against the oldest and the newest
//! Kubernetes it ships schemas for; the KEDA objects pass KEDA's own CRD
//! schema (vendored in tests/kubernetes/keda, strict about unknown
//! fields); `checkov`'s Kubernetes checks pass, each waived check with its
//! reason beside it; and the manifests keep what docs/production.md says
//! of them. Each validator is also shown rejecting a broken manifest, so a
//! pass means something. The tools come from PyPI into cached venvs.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::kubernetes::{deployments, object, objects, render, root, tools, StopBudget};
use serde_json::Value;

const CHECKOV: &[&str] = &["checkov==3.3.30"];

/// The API group whose objects `kubernetes-validate` has no schema for,
/// and which validate_crd.py checks instead.
const KEDA_GROUP: &str = "keda.sh/";

/// Runs a blocking closure off the runtime (the venvs take minutes to make
/// the first time).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// Writes `yaml` to a file in `dir` named `name`.
fn write(dir: &Path, name: &str, yaml: &str) -> PathBuf {
    let path = dir.join(format!("{}.yaml", name.replace('/', "-")));
    std::fs::write(&path, yaml).unwrap();
    path
}

/// The Kubernetes versions this kubernetes-validate has strict schemas
/// for: the oldest and the newest.
fn oldest_and_newest(bin: &Path) -> (String, String) {
    let out = Command::new(bin.join("python"))
        .args([
            "-c",
            "import os, kubernetes_validate as k; d = os.path.join(os.path.dirname(k.__file__), 'kubernetes-json-schema'); \
             print('\\n'.join(v[1:-len('-local-strict')] for v in os.listdir(d) if v.endswith('-local-strict')))",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut versions: Vec<Vec<u32>> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|v| v.split('.').map(|n| n.parse().unwrap()).collect())
        .collect();
    versions.sort();
    let show = |v: &Vec<u32>| v.iter().map(u32::to_string).collect::<Vec<_>>().join(".");
    (show(&versions[0]), show(versions.last().unwrap()))
}

/// `kubernetes-validate --strict` of `file` against `version`: whether it
/// passed, and what it said.
fn kubernetes_validate(bin: &Path, version: &str, file: &Path) -> (bool, String) {
    let out = Command::new(bin.join("kubernetes-validate"))
        .args(["--strict", "-k", version])
        .arg(file)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Only KEDA's kinds may go without a schema here: they are checked
    // against their CRD below.
    let unknown_kind = said.lines().any(|l| {
        l.contains("Couldn't find schema") && !l.contains(&format!("api version {KEDA_GROUP}"))
    });
    (out.status.success() && !unknown_kind, said)
}

#[tokio::test]
async fn every_deployment_passes_kubernetes_validate_strictly_on_the_oldest_and_newest_kubernetes()
{
    blocking(|| {
        let bin = tools();
        let (oldest, newest) = oldest_and_newest(&bin);
        eprintln!("kubernetes-validate's schemas: Kubernetes {oldest} to {newest}");
        let dir = tempfile::tempdir().unwrap();
        for (name, path) in deployments() {
            let rendered = render(&bin, &path);
            let file = write(dir.path(), &name, &rendered);
            let checked = objects(&bin, &rendered)
                .iter()
                .filter(|o| !o["apiVersion"].as_str().unwrap().starts_with(KEDA_GROUP))
                .count();
            for version in [&oldest, &newest] {
                let (passed, said) = kubernetes_validate(&bin, version, &file);
                assert!(passed, "{name} against Kubernetes {version}:\n{said}");
                assert_eq!(
                    said.matches("passed for resource").count(),
                    checked,
                    "{name} against Kubernetes {version}: not every object was checked:\n{said}"
                );
            }
        }

        // A field Kubernetes does not know is refused, on either version.
        let broken = render(&bin, &root().join("deploy/kubernetes")).replace(
            "terminationGracePeriodSeconds:",
            "terminationGracePeriodSecs:",
        );
        let file = write(dir.path(), "broken", &broken);
        for version in [&oldest, &newest] {
            let (passed, said) = kubernetes_validate(&bin, version, &file);
            assert!(
                !passed,
                "a misspelt field passed against {version}:\n{said}"
            );
        }
    })
    .await;
}

/// validate_crd.py on `file`: whether it passed, and what it said.
fn validate_crd(bin: &Path, file: &Path) -> (bool, String) {
    let out = Command::new(bin.join("python"))
        .arg(root().join("tests/kubernetes/validate_crd.py"))
        .arg(root().join("tests/kubernetes/keda"))
        .arg(file)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

#[tokio::test]
async fn keda_objects_pass_kedas_own_crd_schema() {
    blocking(|| {
        let bin = tools();
        let dir = tempfile::tempdir().unwrap();
        let rendered = render(&bin, &root().join("deploy/kubernetes/overlays/keda"));
        let file = write(dir.path(), "keda", &rendered);
        let (passed, said) = validate_crd(&bin, &file);
        assert!(passed, "{said}");
        for checked in [
            "valid ScaledObject/newsnack",
            "valid TriggerAuthentication/newsnack-scaler",
        ] {
            assert!(
                said.lines().any(|l| l == checked),
                "{checked} missing:\n{said}"
            );
        }

        // A misspelt field, and a value of the wrong type, are refused.
        for (from, to) in [
            ("minReplicaCount: 1", "minReplicas: 1"),
            ("pollingInterval: 30", "pollingInterval: soon"),
            (
                "parameter: connection",
                "parameter: connection\n      secretName: x",
            ),
        ] {
            assert!(rendered.contains(from), "{from}");
            let file = write(dir.path(), "keda-broken", &rendered.replacen(from, to, 1));
            let (passed, said) = validate_crd(&bin, &file);
            assert!(!passed, "`{to}` passed KEDA's schema:\n{said}");
        }
    })
    .await;
}

/// checkov's Kubernetes checks on `file`, offline: whether all passed,
/// and its report.
fn checkov(bin: &Path, file: &Path) -> (bool, String) {
    let out = Command::new(bin.join("checkov"))
        .args([
            "--framework",
            "kubernetes",
            "--compact",
            "--quiet",
            "--skip-download",
            "-f",
        ])
        .arg(file)
        // Nothing leaves the machine: no guidelines downloaded.
        .env("BC_SKIP_MAPPING", "TRUE")
        .current_dir(file.parent().unwrap())
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let passed = out.status.success() && said.contains("Failed checks: 0");
    (passed, said)
}

#[tokio::test]
async fn checkov_passes_every_deployment_and_each_waiver_says_why() {
    blocking(|| {
        let bin = tools();
        let checkov_bin = common::python::venv("checkov", CHECKOV);
        let dir = tempfile::tempdir().unwrap();
        for (name, path) in deployments() {
            let rendered = render(&bin, &path);
            let file = write(dir.path(), &name, &rendered);
            let (passed, said) = checkov(&checkov_bin, &file);
            assert!(passed, "{name}:\n{said}");
            for o in objects(&bin, &rendered) {
                let Some(annotations) = o["metadata"]["annotations"].as_object() else {
                    continue;
                };
                for (key, value) in annotations {
                    if key.starts_with("checkov.io/skip") {
                        let (check, reason) = value.as_str().unwrap().split_once('=').unwrap();
                        assert!(
                            check.starts_with("CKV") && reason.split_whitespace().count() >= 8,
                            "{name}: waiver {key} gives no reason: {value}"
                        );
                    }
                }
            }
        }

        // A container that may write its root filesystem fails a check.
        let broken = render(&bin, &root().join("deploy/kubernetes")).replace(
            "readOnlyRootFilesystem: true",
            "readOnlyRootFilesystem: false",
        );
        let file = write(dir.path(), "broken", &broken);
        let (passed, said) = checkov(&checkov_bin, &file);
        assert!(
            !passed,
            "a writable root filesystem passed checkov:\n{said}"
        );
        assert!(said.contains("CKV_K8S_22"), "{said}");
    })
    .await;
}

fn containers(deployment: &Value) -> Vec<&Value> {
    let pod = &deployment["spec"]["template"]["spec"];
    pod["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(pod["containers"].as_array().unwrap())
        .collect()
}

#[tokio::test]
async fn the_manifests_keep_what_the_documents_promise() {
    blocking(|| {
        let bin = tools();
        let base = objects(&bin, &render(&bin, &root().join("deploy/kubernetes")));
        let deployment = object(&base, "Deployment", "newsnack");
        assert!(deployment["spec"]["replicas"].as_u64().unwrap() >= 2);
        assert_eq!(
            deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"],
            0
        );
        let pod = &deployment["spec"]["template"]["spec"];
        assert_eq!(pod["automountServiceAccountToken"], false);
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        assert_eq!(
            pod["securityContext"]["seccompProfile"]["type"],
            "RuntimeDefault"
        );
        // Migrations before the server: an init container running `migrate`.
        assert_eq!(
            pod["initContainers"][0]["args"],
            serde_json::json!(["migrate"])
        );
        for c in containers(deployment) {
            let security = &c["securityContext"];
            assert_eq!(security["readOnlyRootFilesystem"], true, "{}", c["name"]);
            assert_eq!(security["allowPrivilegeEscalation"], false, "{}", c["name"]);
            assert_eq!(security["runAsNonRoot"], true, "{}", c["name"]);
            assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]));
            assert_eq!(security["seccompProfile"]["type"], "RuntimeDefault");
            for bound in ["requests", "limits"] {
                for resource in ["cpu", "memory"] {
                    assert!(
                        c["resources"][bound][resource].is_string(),
                        "{} {bound} {resource}",
                        c["name"]
                    );
                }
            }
            let from: Vec<_> = c["envFrom"].as_array().unwrap().iter().collect();
            assert!(from.iter().any(|f| f["configMapRef"]["name"] == "newsnack"));
            assert!(from.iter().any(|f| f["secretRef"]["name"] == "newsnack"));
        }
        let serve = &pod["containers"][0];
        assert_eq!(serve["startupProbe"]["httpGet"]["path"], "/healthz");
        assert_eq!(serve["livenessProbe"]["httpGet"]["path"], "/healthz");
        assert_eq!(serve["readinessProbe"]["httpGet"]["path"], "/readyz");

        // The grace period covers the preStop pause, the service's own
        // grace for generations, and ten seconds for closing the pool and
        // the locks.
        let stop = StopBudget::of_default_deployment();
        assert!(
            stop.termination_grace_s >= stop.pre_stop_pause_s + stop.shutdown_grace_s + 10,
            "terminationGracePeriodSeconds {} < preStop {} + NEWSNACK_SHUTDOWN_GRACE_S {} + 10",
            stop.termination_grace_s,
            stop.pre_stop_pause_s,
            stop.shutdown_grace_s
        );

        let secret = object(&base, "Secret", "newsnack");
        for key in [
            "DATABASE_URL",
            "NEWSNACK_DIRECT_DATABASE_URL",
            "NEWSNACK_API_TOKEN",
            "NEWSNACK_READ_TOKEN",
            "NEWSNACK_METRICS_TOKEN",
            "NEWSNACK_LLM_API_KEY",
            "NEWSNACK_LLM_FALLBACK_API_KEY",
        ] {
            assert!(
                secret["stringData"][key].is_string(),
                "the Secret has no {key}"
            );
        }
        let pdb = object(&base, "PodDisruptionBudget", "newsnack");
        assert_eq!(pdb["apiVersion"], "policy/v1");
        let service = object(&base, "Service", "newsnack");
        assert_eq!(service["spec"]["ports"][0]["targetPort"], "http");

        let keda = objects(
            &bin,
            &render(&bin, &root().join("deploy/kubernetes/overlays/keda")),
        );
        let scaled = object(&keda, "ScaledObject", "newsnack");
        assert_eq!(scaled["spec"]["minReplicaCount"], 1);
        assert_eq!(scaled["spec"]["scaleTargetRef"]["name"], "newsnack");
        let trigger = &scaled["spec"]["triggers"][0];
        assert_eq!(trigger["type"], "postgresql");
        assert!(trigger["metadata"]["query"]
            .as_str()
            .unwrap()
            .contains("newsnack_scale_hint("));
        let auth = trigger["authenticationRef"]["name"].as_str().unwrap();
        let auth = object(&keda, "TriggerAuthentication", auth);
        let secret = auth["spec"]["secretTargetRef"][0]["name"].as_str().unwrap();
        object(&keda, "Secret", secret);
        // KEDA owns the replica count.
        assert!(object(&keda, "Deployment", "newsnack")["spec"]["replicas"].is_null());

        let fenced = objects(
            &bin,
            &render(
                &bin,
                &root().join("deploy/kubernetes/overlays/network-policy"),
            ),
        );
        let policy = object(&fenced, "NetworkPolicy", "newsnack");
        assert_eq!(policy["spec"]["ingress"][0]["ports"][0]["port"], "http");
        assert_eq!(
            policy["spec"]["policyTypes"],
            serde_json::json!(["Ingress", "Egress"])
        );
    })
    .await;
}
