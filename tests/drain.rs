//! Stopping a pod as the Kubernetes manifests do, at the process level:
//! `newsnack serve` under claim load gets SIGUSR1 (the preStop hook), its
//! `/readyz` turns 503 while it goes on answering, and then SIGTERM. No
//! request in flight fails, generations in flight finish within
//! `NEWSNACK_SHUTDOWN_GRACE_S` or are released for another instance, and
//! the process exits before the grace period the rendered manifests give
//! (less the preStop pause, which the kubelet counts in it).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::fake_llm::{FakeLlm, Reply};
use common::kubernetes::StopBudget;
use common::process::ServeProcess;
use common::{within, TestDb};

/// Issues claimed; each client walks windows of five over all of them.
const ISSUES: usize = 600;
const CLIENTS: usize = 8;
/// Every this many LLM calls, one never answers: it must be released.
const HANGING_EVERY: u64 = 5;

/// What the claim clients saw.
#[derive(Default)]
struct Tally {
    /// Claims answered 202 or 409.
    answered: AtomicU64,
    /// Requests that got something else: another status, or no answer.
    failed: AtomicU64,
    /// Connections refused once the instance stopped accepting: never let
    /// in (a load balancer tries another pod).
    refused: AtomicU64,
}

/// A closed-loop client on its own keep-alive connection, walking windows
/// of five ids, until `stop`: a load balancer that sends until the pod is
/// out of its endpoints. Every request it sent gets an answer it checks.
async fn claim_client(
    base: String,
    ids: Arc<Vec<i64>>,
    offset: usize,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
    failures: Arc<std::sync::Mutex<Vec<String>>>,
) {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .unwrap();
    let mut at = offset;
    while !stop.load(Ordering::SeqCst) {
        let window: Vec<i64> = (0..5).map(|k| ids[(at + k) % ids.len()]).collect();
        at = (at + 2) % ids.len();
        let answer = http
            .post(format!("{base}/ai-articles"))
            .json(&serde_json::json!({ "issue_ids": window }))
            .send()
            .await;
        match answer {
            Ok(r) if r.status() == 202 || r.status() == 409 => {
                tally.answered.fetch_add(1, Ordering::SeqCst);
            }
            Ok(r) => {
                tally.failed.fetch_add(1, Ordering::SeqCst);
                failures
                    .lock()
                    .unwrap()
                    .push(format!("status {}", r.status()));
            }
            Err(e) if e.is_connect() => {
                tally.refused.fetch_add(1, Ordering::SeqCst);
            }
            Err(e) => {
                tally.failed.fetch_add(1, Ordering::SeqCst);
                failures.lock().unwrap().push(format!("{e:?}"));
            }
        }
    }
}

async fn answered_at_least(tally: &Tally, n: u64) {
    while tally.answered.load(Ordering::SeqCst) < n {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_drains_within_the_grace_period_the_manifests_give() {
    let stop_budget = tokio::task::spawn_blocking(StopBudget::of_default_deployment)
        .await
        .unwrap();
    let db = TestDb::new().await;
    let ids = Arc::new(db.add_issues(ISSUES).await);
    // Most calls take a second and a half; every fifth never answers.
    let llm = FakeLlm::start(|n, _| {
        if n % HANGING_EVERY == 0 {
            Reply::Hang
        } else {
            Reply::Slow {
                delay: Duration::from_millis(1500),
                content: "Headline\n\nBody of the article.".into(),
            }
        }
    })
    .await;
    let grace = stop_budget.shutdown_grace_s.to_string();
    let mut serve = tokio::task::block_in_place(|| {
        ServeProcess::spawn(
            &db.url,
            "draining",
            &[
                ("NEWSNACK_LLM_URL", &llm.url),
                ("NEWSNACK_LLM_MODEL", "fake"),
                ("NEWSNACK_SHUTDOWN_GRACE_S", &grace),
            ],
        )
    });
    let base = serve.base_url();
    let http = reqwest::Client::new();
    let readyz = |http: reqwest::Client, base: String| async move {
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status()
    };
    within(30, "the instance to be ready", async {
        while readyz(http.clone(), base.clone()).await != 200 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;

    let stop_sending = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            tokio::spawn(claim_client(
                base.clone(),
                ids.clone(),
                c * ISSUES / CLIENTS,
                stop_sending.clone(),
                tally.clone(),
                failures.clone(),
            ))
        })
        .collect();
    within(60, "claims under way", answered_at_least(&tally, 300)).await;
    llm.until_requests(2 * HANGING_EVERY).await;

    // The preStop hook: readiness turns 503, and everything else goes on.
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(serve.pid() as libc::pid_t, libc::SIGUSR1) };
    within(10, "/readyz to answer 503", async {
        while readyz(http.clone(), base.clone()).await != 503 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let health = http.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200, "alive while draining");
    let at_503 = tally.answered.load(Ordering::SeqCst);
    within(
        30,
        "claims answered while draining",
        answered_at_least(&tally, at_503 + 300),
    )
    .await;

    // SIGTERM, with requests in flight; the load balancer sends no new
    // ones from here on.
    let in_progress_before: i64 = db
        .scalar_i64("SELECT count(*) FROM issue WHERE processing_status = 'IN_PROGRESS'")
        .await;
    assert!(in_progress_before > 0, "generations in flight at SIGTERM");
    let seq_at_sigterm = db
        .scalar_i64("SELECT COALESCE(max(seq), 0) FROM issue_transition")
        .await;
    let pid = serve.pid();
    let terminated = Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    stop_sending.store(true, Ordering::SeqCst);
    for client in clients {
        client.await.unwrap();
    }
    let status = tokio::task::block_in_place(|| serve.wait());
    let took = terminated.elapsed();

    assert!(status.success(), "serve exited with {status:?}");
    assert_eq!(
        tally.failed.load(Ordering::SeqCst),
        0,
        "requests let in that failed: {:?}",
        failures.lock().unwrap()
    );
    let budget =
        Duration::from_secs(stop_budget.termination_grace_s - stop_budget.pre_stop_pause_s);
    assert!(
        took < budget,
        "serve took {took:?} after SIGTERM; the manifests give it {budget:?}"
    );
    eprintln!(
        "drained in {took:?} after SIGTERM (the manifests give {budget:?}); {} claims answered, {} refused at connect after SIGTERM, {in_progress_before} generations in flight at SIGTERM",
        tally.answered.load(Ordering::SeqCst),
        tally.refused.load(Ordering::SeqCst)
    );

    // Nothing is left claimed by the stopped instance: what was in flight
    // finished, or was released as FAILED with the reason `shutdown` for
    // another instance to retry.
    let held: i64 = db
        .scalar_i64("SELECT count(*) FROM issue WHERE processing_status = 'IN_PROGRESS'")
        .await;
    assert_eq!(
        held, 0,
        "issues still IN_PROGRESS after the instance stopped"
    );
    let finished_after: i64 = db
        .query_one(
            "SELECT count(*) FROM issue_transition WHERE to_status = 'DONE' AND seq > $1",
            &[&seq_at_sigterm],
        )
        .await
        .get(0);
    let released: i64 = db
        .scalar_i64("SELECT count(*) FROM issue WHERE processing_status = 'FAILED' AND last_error = 'shutdown'")
        .await;
    assert!(
        finished_after > 0,
        "no generation finished within the grace"
    );
    assert!(released > 0, "no hanging generation was released");
    // A new connection is not let in any more.
    assert!(std::net::TcpStream::connect(serve.addr).is_err());
}
