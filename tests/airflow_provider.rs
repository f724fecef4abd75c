//! The Airflow provider (`integrations/airflow`) under its own tests:
//! pytest, in a virtual environment holding Apache Airflow (3, and 2.10)
//! and the provider, against a real `serve` this test starts and names in
//! `NEWSNACK_TEST_URL` / `NEWSNACK_TEST_TOKEN`; and mypy over the package.
//! The service's writer writes every article at once, except for issues
//! whose title starts with `refuse`: those fail for good.
//!
//! The venvs are cached (`common::python`); they hold the provider as an
//! editable install of this checkout, so its edits need no reinstall. The
//! wheel users install is built and checked by pytest too
//! (`tests/test_wheel.py`: `pip wheel`, then a throwaway venv).

mod common;

use std::process::{Output, Stdio};
use std::sync::Arc;

use common::python::{provider_venv, AIRFLOW_2, AIRFLOW_3, PROVIDER};
use common::writers::FatalFor;
use common::{within, Setup, TestDb};

const TOKEN: &str = "airflow-provider-token-5e21";
const REFUSING: FatalFor = FatalFor {
    name: "refusing",
    prefix: "refuse",
    message: "the model refused this issue",
};

/// Runs `program args` in the provider's directory with a throwaway
/// `AIRFLOW_HOME`; fails showing its output unless it succeeds.
async fn run_ok(bin: &std::path::Path, program: &str, args: &[&str], service_url: &str) -> Output {
    let home = tempfile::tempdir().unwrap();
    let out = tokio::process::Command::new(bin.join(program))
        .args(args)
        .current_dir(PROVIDER)
        .env("AIRFLOW_HOME", home.path())
        .env("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
        .env("NEWSNACK_TEST_URL", service_url)
        .env("NEWSNACK_TEST_TOKEN", TOKEN)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let out = within(600, program, out).await.unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "{program} {args:?} failed:\n{text}");
    out
}

async fn pytest_against_a_real_service(name: &'static str, requirements: &'static [&'static str]) {
    let bin = provider_venv(name, requirements).await;
    let db = TestDb::new().await;
    let setup = Setup {
        pool_size: Some(8),
        tokens: newsnack::http::auth::Tokens::api(TOKEN),
        ..Setup::default()
    };
    let service = db
        .serve_with("airflow-provider", Arc::new(REFUSING), setup)
        .await;
    let url = format!("http://{}", service.addr);
    let out = run_ok(
        &bin,
        "python",
        &["-m", "pytest", "-p", "no:cacheprovider", "-q"],
        &url,
    )
    .await;
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(
        summary.contains(" passed") && !summary.contains("skipped"),
        "{summary}"
    );
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_providers_tests_pass_on_airflow_3() {
    pytest_against_a_real_service("airflow3-provider", AIRFLOW_3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_providers_tests_pass_on_airflow_2_10() {
    pytest_against_a_real_service("airflow2-provider", AIRFLOW_2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_provider_is_mypy_clean() {
    let bin = provider_venv("airflow3-provider", AIRFLOW_3).await;
    run_ok(&bin, "mypy", &[], "").await;
}
