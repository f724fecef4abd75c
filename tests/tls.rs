//! newsnack against a PostgreSQL that takes only TLS sessions
//! (`hostssl`-only `pg_hba.conf`, certificates made at test time; see
//! `common/tls.rs`): migrate, serve, claims to `DONE`, a gapless tail and a
//! wait over `verify-full`, with `/readyz` saying the sessions are
//! encrypted and verified; a client certificate; and every refusal names
//! its cause in one line: a certificate from another CA, a certificate for
//! another name, `require` against a server without TLS, a plain session
//! against a TLS-only server, a missing root file, an unknown `sslmode`.

mod common;

use std::process::Output;
use std::sync::Arc;

use common::http::{get_json, post_json};
use common::process::{self, text};
use common::subscribers::Recording;
use common::tls::{self, TlsCluster};
use common::{Setup, TestDb};
use newsnack::db::tls::{SessionSecurity, Verification};
use newsnack::writer::OfflineWriter;
use serde_json::{json, Value};

fn newsnack(url: &str, args: &[&str]) -> Output {
    process::command(url, args)
        .env_remove("NEWSNACK_DIRECT_DATABASE_URL")
        .env("RUST_LOG", "error")
        .output()
        .expect("run newsnack")
}

fn verify_full(cluster: &TlsCluster, database: &str) -> String {
    cluster.url(
        database,
        &format!("sslmode=verify-full&sslrootcert={}", cluster.ca().display()),
    )
}

/// `newsnack status` on `url` fails, and its one line of error says `cause`.
fn refused_saying(url: &str, cause: &str) {
    let out = newsnack(url, &["status"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{url}: {stderr}");
    assert!(
        stderr.contains(cause),
        "{url}: expected {cause:?} in {stderr:?}"
    );
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_service_runs_over_verify_full_against_a_tls_only_server() {
    let cluster = tls::cluster();
    let name = cluster.database().await;
    let url = verify_full(cluster, &name);
    let migrated = newsnack(&url, &["migrate"]);
    assert!(migrated.status.success(), "{}", text(&migrated.stderr));

    let small_pool = Setup {
        pool_size: Some(8),
        ..Setup::default()
    };
    let service = common::start_service(&url, "tls", Arc::new(OfflineWriter), small_pool).await;
    let base = format!("http://{}", service.addr);
    let http = reqwest::Client::new();
    let ready: Value = get_json(&http, &format!("{base}/readyz")).await;
    let verified = json!({ "encrypted": true, "verified": "chain_and_host" });
    assert_eq!(
        ready["sessions"],
        json!({ "pooled": verified, "direct": verified }),
        "{ready}"
    );
    assert_eq!(
        (&ready["database"], &ready["listener"]),
        (&json!(true), &json!(true))
    );

    let tail = Recording::follow_tail("tail", &url, 0);
    let issues: Vec<Value> = (0..5)
        .map(|i| json!({"title": format!("issue {i}")}))
        .collect();
    let (_, added) = post_json(
        &http,
        &format!("{base}/issues"),
        &json!({ "issues": issues }),
    )
    .await;
    let claim = http
        .post(format!("{base}/ai-articles"))
        .json(&json!({ "issue_ids": added["ids"] }))
        .send()
        .await
        .unwrap();
    assert_eq!(claim.status(), 202);
    let (_, waited) = post_json(
        &http,
        &format!("{base}/waits"),
        &json!({ "issue_ids": added["ids"], "timeout_s": 300 }),
    )
    .await;
    assert_eq!(waited["outcome"], "all_pass", "{waited}");
    assert_eq!(waited["completed"], added["ids"]);
    // 5 new, 5 claimed, 5 done: the tail saw all 15, in order, once each.
    assert!(tail.reaches(15, 30).await, "the tail follows over TLS");
    assert_eq!(tail.seen(), (1..=15).collect::<Vec<i64>>());
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_certificates_and_unmet_tls_demands_name_their_cause() {
    let cluster = tls::cluster();
    let name = cluster.database().await;

    // Signed by another CA.
    refused_saying(
        &cluster.url(
            &name,
            &format!("sslmode=verify-full&sslrootcert={}", cluster.other_ca().display()),
        ),
        &format!(
            "TLS handshake failed: the server's certificate is not signed by a root of sslrootcert {}",
            cluster.other_ca().display()
        ),
    );
    // The right CA, another name: verify-full refuses, verify-ca accepts.
    let by_other_name = |mode: &str| {
        format!(
            "postgres://postgres:{}@db.example.invalid:{}/{name}?hostaddr=127.0.0.1&sslmode={mode}&sslrootcert={}",
            tls::PASSWORD,
            cluster.port(),
            cluster.ca().display()
        )
    };
    refused_saying(
        &by_other_name("verify-full"),
        "certificate not valid for name \"db.example.invalid\"",
    );
    let accepted = newsnack(&by_other_name("verify-ca"), &["migrate"]);
    assert!(accepted.status.success(), "{}", text(&accepted.stderr));
    // A plain session where the server takes only TLS.
    refused_saying(
        &cluster.url(&name, "sslmode=disable"),
        "no encryption (the server accepts only encrypted sessions here: use sslmode=require or stronger)",
    );
    // A root file that is not there.
    refused_saying(
        &cluster.url(&name, "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem"),
        "sslrootcert file /nonexistent/ca.pem cannot be read",
    );
    // An sslmode libpq does not know.
    refused_saying(
        &cluster.url(&name, "sslmode=strict"),
        "invalid sslmode \"strict\": expected one of disable, allow, prefer, require, verify-ca, verify-full",
    );

    // TLS demanded of a server that has none (the suite's main cluster).
    let plain = TestDb::new().await;
    let separator = if plain.url.contains('?') { '&' } else { '?' };
    refused_saying(
        &format!("{}{separator}sslmode=require", plain.url),
        "the server does not accept TLS connections (its ssl setting is off), but the URL's sslmode requires TLS",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_mode_encrypts_and_verifies_as_libpq_does() {
    let cluster = tls::cluster();
    let name = cluster.database().await;
    let security = |params: String| {
        let url = cluster.url(&name, &params);
        async move {
            let endpoint = newsnack::db::Endpoint::parse(&url, "tls-test").expect("the URL parses");
            let (_, connection, security) = endpoint.connect_raw().await.expect("connects");
            drop(connection);
            security
        }
    };
    let ca = cluster.ca().display().to_string();
    let encrypted = |verified| SessionSecurity {
        encrypted: true,
        verified,
    };
    // The default, prefer: encrypted where the server offers it; nothing
    // to check the server against, so nothing checked.
    assert_eq!(security(String::new()).await, encrypted(Verification::None));
    assert_eq!(
        security("sslmode=allow".into()).await,
        encrypted(Verification::None),
        "allow: plain is refused here, so TLS"
    );
    assert_eq!(
        security(format!("sslmode=require&sslrootcert={ca}")).await,
        encrypted(Verification::Chain),
        "require with a root file checks the chain, as in libpq"
    );
    assert_eq!(
        security(format!("sslmode=verify-ca&sslrootcert={ca}")).await,
        encrypted(Verification::Chain)
    );
    assert_eq!(
        security(format!("sslmode=verify-full&sslrootcert={ca}")).await,
        encrypted(Verification::ChainAndHost)
    );
    // Against the suite's plain server, prefer falls back to plain.
    let plain = TestDb::new().await;
    let (_, connection, security) = plain.endpoint.connect_raw().await.unwrap();
    drop(connection);
    assert_eq!(
        security,
        SessionSecurity {
            encrypted: false,
            verified: Verification::None
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_logs_in_where_pg_hba_asks_for_one() {
    let cluster = tls::cluster();
    let name = cluster.database().await;
    let admin = newsnack::db::Endpoint::parse(&verify_full(cluster, &name), "tls-test")
        .unwrap()
        .connect()
        .await
        .unwrap();
    common::login_role(&admin, "certuser").await;
    let (cert, key) = cluster.client_cert();
    let as_certuser = |extra: String| {
        format!(
            "postgres://certuser@localhost:{}/{name}?sslmode=verify-full&sslrootcert={}{extra}",
            cluster.port(),
            cluster.ca().display()
        )
    };
    let with_cert = as_certuser(format!(
        "&sslcert={}&sslkey={}",
        cert.display(),
        key.display()
    ));
    let client = newsnack::db::Endpoint::parse(&with_cert, "tls-test")
        .unwrap()
        .connect()
        .await
        .expect("certificate login");
    let user: String = client
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(user, "certuser");
    refused_saying(&as_certuser(String::new()), "certificate");
}
