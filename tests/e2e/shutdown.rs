//! Graceful shutdown: on SIGTERM readiness goes false first, a stream in
//! flight runs to its end (usage and cost included) and is billed, and the
//! process exits cleanly; started again, the ledger shows the charge.

use std::time::Duration;

use futures_util::StreamExt;
use rialto_test_kit::{MockUpstream, Sandbox, Topology};
use serde_json::{Value, json};

use crate::support::models_toml;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_stream_and_bills_it() {
    let mock = MockUpstream::start().await.unwrap();
    let mut sandbox = Sandbox::builder(Topology::OneProcess)
        .config(&models_toml(&mock.base_url()))
        // Time for a load balancer to see /readyz go false.
        .env("RIALTO_SHUTDOWN__DELAY_MS", "600")
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("drained").await.unwrap();
    let balance = |sandbox: &Sandbox, key: String| {
        let request = sandbox
            .http()
            .get(sandbox.api("/billing/balance"))
            .bearer_auth(key);
        async move {
            let body: Value = request.send().await.unwrap().json().await.unwrap();
            body["balances"]["usd"].as_f64().unwrap()
        }
    };
    let before = balance(&sandbox, account.admin_key.clone()).await;

    // Twenty words, 100 ms apart: about two seconds of stream.
    let words: Vec<String> = (0..20).map(|i| format!("w{i}")).collect();
    let response = sandbox
        .http()
        .post(sandbox.api("/chat/completions"))
        .bearer_auth(&account.admin_key)
        .json(&json!({
            "model": "mock-chat", "stream": true,
            "messages": [{"role": "user", "content": "a long answer"}],
            "mock": {"reply": words.join(" "), "chunk_delay_ms": 100},
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let mut received = String::from_utf8_lossy(&body.next().await.unwrap().unwrap()).into_owned();

    let url = sandbox.url.clone();
    let http = sandbox.http().clone();
    let terminated = {
        let sandbox = &mut sandbox;
        async move { sandbox.terminate("all", Duration::from_secs(20)).await }
    };
    let readiness = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        http.get(format!("{url}/readyz"))
            .send()
            .await
            .map(|r| r.status().as_u16())
    };
    let reading = async {
        while let Some(chunk) = body.next().await {
            received.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        }
        received
    };
    let (status, ready, received) = tokio::join!(terminated, readiness, reading);
    assert!(status.unwrap().success(), "a clean exit");
    assert_eq!(ready.unwrap(), 503, "readiness goes false first");
    assert!(
        received.contains("w19"),
        "the whole stream arrived: {received}"
    );
    assert!(received.trim_end().ends_with("data: [DONE]"), "{received}");
    let cost_line = received
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .find(|chunk| chunk.get("cost").is_some())
        .expect("a final chunk with cost");
    let cost = cost_line["cost"]["usd"].as_f64().unwrap();
    assert!(cost > 0.0);

    // Started again on the same database: the stream was charged, once.
    sandbox.restart("all").await.unwrap();
    let after = balance(&sandbox, account.admin_key.clone()).await;
    assert!(
        (before - after - cost).abs() < 1e-9,
        "{before} - {after} != {cost}"
    );
}
