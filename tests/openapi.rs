//! `GET /openapi.json` describes the API the router actually serves.

mod common;

use std::sync::Arc;

use common::http::get_json;
use common::TestDb;
use newsnack::writer::OfflineWriter;

#[tokio::test]
async fn the_openapi_document_lists_every_contract_endpoint() {
    let db = TestDb::new().await;
    let service = db.serve("openapi", Arc::new(OfflineWriter)).await;
    let doc: serde_json::Value = get_json(
        &reqwest::Client::new(),
        &format!("http://{}/openapi.json", service.addr),
    )
    .await;
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for (path, method) in [
        ("/issues", "post"),
        ("/issues/{id}", "get"),
        ("/ai-articles", "post"),
        ("/waits", "post"),
        ("/today-newsnack", "post"),
        ("/healthz", "get"),
        ("/readyz", "get"),
    ] {
        assert!(
            doc["paths"][path][method].is_object(),
            "{method} {path} is documented"
        );
    }
    let schemas = &doc["components"]["schemas"];
    assert!(schemas["WaitReport"]["properties"]["outcome"].is_object());
    assert!(schemas["IssueView"]["properties"]["status"].is_object());
    service.stop().await.unwrap();
}
