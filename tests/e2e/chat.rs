//! Chat completions end to end: plain, streamed, `n > 1`, pass-through,
//! errors before and after a stream starts, and the spec's headers.

use serde_json::{Value, json};

use crate::both_topologies;
use crate::support::{World, assert_common_headers};

both_topologies!(
    plain_chat,
    streamed_chat,
    several_choices,
    bad_requests_are_4xx,
    backend_failures,
    models_and_openapi,
);

async fn inference_key(world: &World) -> String {
    let account = world.sandbox.create_account("acme").await.unwrap();
    world
        .sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap()
        .1
}

async fn post(world: &World, key: &str, body: Value) -> reqwest::Response {
    world
        .sandbox
        .call(reqwest::Method::POST, "/chat/completions", key, Some(&body))
        .await
        .unwrap()
}

/// Splits an SSE body into its `data:` payloads.
fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

async fn plain_chat(world: &World) {
    let key = inference_key(world).await;
    let response = post(
        world,
        &key,
        json!({
            "model": "mock-chat",
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
            "rialto_parameters": {"include_rialto_system_prompt": false},
            "temperature": 0.2,
            "some_future_field": {"kept": true},
        }),
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_common_headers(&response);
    let headers = response.headers().clone();
    assert_eq!(headers["x-rialto-model-id"], "mock-chat");
    assert_eq!(headers["x-rialto-model-name"], "Mock Chat");
    // Backends are named, never shown by address.
    assert_eq!(headers["x-rialto-model-router"], "mock-chat/0");
    assert!(!headers.contains_key("x-rialto-model-deprecation-date"));
    let cf_ray = headers["cf-ray"].to_str().unwrap().to_owned();
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "mock-chat");
    assert_eq!(body["id"], format!("chatcmpl-{cf_ray}"));
    assert!(body["created"].as_i64().unwrap() > 1_700_000_000);
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], "Hello from mock: hello there");
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["index"], 0);
    assert!(choice.get("logprobs").is_some());
    assert!(body.get("system_fingerprint").is_none());
    // Usage from the upstream, cost priced from the model's config:
    // 4 prompt words * $0.5/M + 5 completion words * $1.5/M.
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9})
    );
    let usd = body["cost"]["usd"].as_f64().unwrap();
    assert!((usd - 0.0000095).abs() < 1e-12, "usd = {usd}");
    assert_eq!(body["cost"]["diem"], 0);
    let parameters = &body["rialto_parameters"];
    for member in [
        "enable_e2ee",
        "enable_web_search",
        "enable_web_citations",
        "enable_web_scraping",
        "include_rialto_system_prompt",
        "include_search_results_in_stream",
        "return_search_results_as_documents",
        "strip_thinking_response",
        "disable_thinking",
    ] {
        assert!(parameters.get(member).is_some(), "echo lacks {member}");
    }
    assert_eq!(parameters["include_rialto_system_prompt"], false);
    assert_eq!(parameters["enable_web_search"], "off");

    // The upstream got unknown fields untouched, its own model name, and no
    // service parameters.
    let sent = world.mock.requests().pop().unwrap();
    assert_eq!(sent["model"], "mock-model");
    assert_eq!(sent["some_future_field"], json!({"kept": true}));
    assert_eq!(sent["temperature"], 0.2);
    assert!(sent.get("rialto_parameters").is_none());
    // Keys never travel to the upstream.
    assert!(
        world
            .mock
            .authorization_headers()
            .iter()
            .all(Option::is_none)
    );

    // Compression on request, for non-streamed answers.
    let compressed = world
        .sandbox
        .http()
        .post(world.sandbox.api("/chat/completions"))
        .bearer_auth(&key)
        .header("accept-encoding", "gzip")
        .json(&json!({"model": "mock-chat", "messages": [{"role": "user", "content": "zip"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(compressed.headers()["content-encoding"], "gzip");

    // The key never reaches the logs (read once the request's line is there).
    let logs = world.sandbox.logs_containing(&cf_ray).await;
    assert!(logs.contains(&cf_ray), "request id not in logs");
    assert!(!logs.contains(&key), "secret in logs");
}

async fn streamed_chat(world: &World) {
    let key = inference_key(world).await;
    let response = world
        .sandbox
        .http()
        .post(world.sandbox.api("/chat/completions"))
        .bearer_auth(&key)
        .header("accept-encoding", "gzip")
        .json(&json!({
            "model": "mock-chat",
            "stream": true,
            "messages": [{"role": "user", "content": "stream this please"}],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_common_headers(&response);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    assert!(!response.headers().contains_key("content-encoding"));
    assert_eq!(response.headers()["x-rialto-model-id"], "mock-chat");
    let cf_ray = response.headers()["cf-ray"].to_str().unwrap().to_owned();
    let events = sse_events(&response.text().await.unwrap());
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text.trim(), "Hello from mock: stream this please");
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["model"], "mock-chat");
        assert_eq!(chunk["id"], format!("chatcmpl-{cf_ray}"));
    }
    // Usage and cost come once, in the final chunk.
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["prompt_tokens"], 3);
    assert_eq!(last["usage"]["completion_tokens"], 6);
    assert!(last["cost"]["usd"].as_f64().unwrap() > 0.0);
    assert_eq!(
        chunks.iter().filter(|c| c.get("usage").is_some()).count(),
        1
    );
}

async fn several_choices(world: &World) {
    let key = inference_key(world).await;
    let body: Value = post(
        world,
        &key,
        json!({"model": "mock-chat", "n": 2, "messages": [{"role": "user", "content": "two"}]}),
    )
    .await
    .json()
    .await
    .unwrap();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(choices[1]["index"], 1);
    assert_ne!(
        choices[0]["message"]["content"],
        choices[1]["message"]["content"]
    );

    let response = post(
        world,
        &key,
        json!({"model": "mock-chat", "n": 2, "stream": true, "messages": [{"role": "user", "content": "two"}]}),
    )
    .await;
    let events = sse_events(&response.text().await.unwrap());
    let indices: std::collections::BTreeSet<u64> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| c["choices"][0]["index"].as_u64())
        .collect();
    assert_eq!(indices.into_iter().collect::<Vec<_>>(), vec![0, 1]);
}

async fn bad_requests_are_4xx(world: &World) {
    let key = inference_key(world).await;
    let http = world.sandbox.http();
    let url = world.sandbox.api("/chat/completions");

    // Declared as anything but JSON: 415; the README's curl examples send
    // the header, and a body without one is read as JSON.
    let declared = http
        .post(&url)
        .bearer_auth(&key)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(r#"{"model": "mock-chat", "messages": []}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(declared.status(), 415);
    let body: Value = declared.json().await.unwrap();
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("Invalid request content-type")
    );
    let json_utf8 = http
        .post(&url)
        .bearer_auth(&key)
        .header("content-type", "application/json; charset=utf-8")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(json_utf8.status(), 400);

    let malformed = http
        .post(&url)
        .bearer_auth(&key)
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(malformed.status(), 400);
    assert_common_headers(&malformed);
    let body: Value = malformed.json().await.unwrap();
    assert_eq!(body["error"], "Invalid request parameters");
    assert!(
        body["details"]["_errors"][0]
            .as_str()
            .unwrap()
            .contains("Malformed JSON")
    );

    let missing = post(world, &key, json!({})).await;
    assert_eq!(missing.status(), 400);
    let body: Value = missing.json().await.unwrap();
    assert_eq!(body["details"]["model"]["_errors"], json!(["Required"]));
    assert_eq!(body["details"]["messages"]["_errors"], json!(["Required"]));

    let empty_text = post(
        world,
        &key,
        json!({"model": "mock-chat", "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}),
    )
    .await;
    assert_eq!(empty_text.status(), 400);
    let body: Value = empty_text.json().await.unwrap();
    assert!(body["details"]["messages"]["0"]["content"]["0"]["text"]["_errors"][0].is_string());

    let wrong_types = post(
        world,
        &key,
        json!({"model": "mock-chat", "messages": [], "n": 0, "stream": "yes",
               "rialto_parameters": {"enable_web_search": "sometimes"}}),
    )
    .await;
    assert_eq!(wrong_types.status(), 400);
    let body: Value = wrong_types.json().await.unwrap();
    for field in ["messages", "n", "stream"] {
        assert!(
            body["details"][field]["_errors"][0].is_string(),
            "no error for {field}"
        );
    }
    assert!(body["details"]["rialto_parameters"]["enable_web_search"]["_errors"][0].is_string());

    // Stop sequences are searched on every token: at most 4, each at most
    // 256 bytes (a list of thousands once froze the built-in model).
    let hi = json!([{"role": "user", "content": "hi"}]);
    for stop in [
        json!(vec!["x"; 5]),
        json!(["x".repeat(257)]),
        json!("x".repeat(257)),
        json!([""]),
        json!([]),
        json!([1]),
        json!(7),
    ] {
        let response = post(
            world,
            &key,
            json!({"model": "mock-chat", "messages": hi, "stop": stop}),
        )
        .await;
        assert_eq!(response.status(), 400, "stop {stop}");
        let body: Value = response.json().await.unwrap();
        assert!(body["details"]["stop"]["_errors"][0].is_string(), "{body}");
    }

    let unknown_model = post(
        world,
        &key,
        json!({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(unknown_model.status(), 404);
    assert_eq!(
        unknown_model.json::<Value>().await.unwrap()["error"],
        "Specified model not found"
    );

    let no_key = http
        .post(&url)
        .json(&json!({"model": "mock-chat", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    // No credentials at all: how to get some (x402 discovery).
    assert_eq!(no_key.status(), 402);
    assert!(no_key.headers().contains_key("payment-required"));
    assert_common_headers(&no_key);
    let bad_key = post(
        world,
        "RIALTO_INFERENCE_KEY_wrong",
        json!({"model": "mock-chat"}),
    )
    .await;
    assert_eq!(bad_key.status(), 401);
    assert_eq!(
        bad_key.json::<Value>().await.unwrap()["error"],
        "Authentication failed"
    );

    // The sandbox sets a 1 MiB limit.
    let big = "x".repeat(2 * 1024 * 1024);
    let too_large = post(
        world,
        &key,
        json!({"model": "mock-chat", "messages": [{"role": "user", "content": big}]}),
    )
    .await;
    assert_eq!(too_large.status(), 413);
    assert_eq!(
        too_large.json::<Value>().await.unwrap()["code"],
        "PAYLOAD_TOO_LARGE"
    );

    let not_found = http
        .get(format!("{}/nope", world.sandbox.url))
        .send()
        .await
        .unwrap();
    assert_eq!(not_found.status(), 404);
    assert_common_headers(&not_found);
    assert!(not_found.json::<Value>().await.unwrap()["error"].is_string());

    // None of that reached the upstream.
    assert_eq!(world.mock.request_count(), 0);
}

async fn backend_failures(world: &World) {
    let key = inference_key(world).await;
    let hi = json!([{"role": "user", "content": "hi"}]);

    let dead = post(world, &key, json!({"model": "dead-chat", "messages": hi})).await;
    assert_eq!(dead.status(), 503);
    assert_common_headers(&dead);
    assert!(dead.json::<Value>().await.unwrap()["error"].is_string());

    let failing = post(
        world,
        &key,
        json!({"model": "mock-chat", "messages": hi, "mock": {"status": 500}}),
    )
    .await;
    assert_eq!(failing.status(), 500);
    let failed: Value = failing.json().await.unwrap();
    assert!(
        failed["error"]
            .as_str()
            .unwrap()
            .starts_with("Inference processing failed: "),
        "{failed}"
    );

    let refused = post(
        world,
        &key,
        json!({"model": "mock-chat", "messages": hi, "mock": {"status": 400}}),
    )
    .await;
    assert_eq!(refused.status(), 400);

    // Before the stream starts: an ordinary HTTP error.
    let dead_stream = post(
        world,
        &key,
        json!({"model": "dead-chat", "messages": hi, "stream": true}),
    )
    .await;
    assert_eq!(dead_stream.status(), 503);

    // After it started: an in-band error, then [DONE].
    let broken = post(
        world,
        &key,
        json!({"model": "mock-chat", "messages": hi, "stream": true, "mock": {"fail_after_chunks": 2}}),
    )
    .await;
    assert_eq!(broken.status(), 200);
    let events = sse_events(&broken.text().await.unwrap());
    assert_eq!(events.last().unwrap(), "[DONE]");
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(error["error"]["message"].is_string(), "{error}");
    assert_eq!(error["error"]["type"], "api_error", "{error}");
    assert_eq!(error["error"]["code"], "upstream_error", "{error}");
    assert_eq!(
        events.len(),
        4,
        "two chunks, the error and [DONE]: {events:?}"
    );

    // A backend slower than router.request_timeout_secs (2 s here): 504.
    let slow = post(
        world,
        &key,
        json!({"model": "mock-chat", "messages": hi, "mock": {"delay_ms": 3000}}),
    )
    .await;
    assert_eq!(slow.status(), 504);

    // An upstream that refuses its own credentials is the operator's
    // problem: 500, and its message (which may quote a key) stays in the log.
    let misconfigured = post(
        world,
        &key,
        json!({"model": "mock-chat", "messages": hi, "mock": {"status": 401}}),
    )
    .await;
    assert_eq!(misconfigured.status(), 500);
    assert!(!misconfigured.text().await.unwrap().contains("mock failure"));

    // Deprecated models say so.
    let old = post(world, &key, json!({"model": "old-chat", "messages": hi})).await;
    assert_eq!(old.status(), 200);
    assert_eq!(
        old.headers()["x-rialto-model-deprecation-date"],
        "2026-12-01"
    );
    assert!(
        old.headers()
            .contains_key("x-rialto-model-deprecation-warning")
    );
}

async fn models_and_openapi(world: &World) {
    let http = world.sandbox.http();
    let response = http.get(world.sandbox.api("/models")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_common_headers(&response);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["object"], "list");
    assert_eq!(body["type"], "text");
    let ids: Vec<&str> = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["mock-chat", "dead-chat", "old-chat"]);
    let old = &body["data"][2]["model_spec"];
    assert_eq!(
        old["deprecation"],
        json!({"autoRemap": false, "date": "2026-12-01", "removesAt": "2026-12-01"})
    );
    assert_eq!(old["privacy"], "anonymized");
    let model = &body["data"][0];
    assert_eq!(model["object"], "model");
    assert_eq!(model["owned_by"], "rialto");
    assert_eq!(model["model_spec"]["name"], "Mock Chat");
    assert_eq!(model["model_spec"]["pricing"]["input"]["usd"], 0.5);
    assert_eq!(model["model_spec"]["pricing"]["output"]["usd"], 1.5);
    // When the build was made (no model here says when it was added).
    assert!(
        model["created"].as_i64().unwrap() > 1_700_000_000,
        "{model}"
    );

    let bogus = http
        .get(world.sandbox.api("/models?type=bogus"))
        .send()
        .await
        .unwrap();
    assert_eq!(bogus.status(), 400);
    assert!(bogus.json::<Value>().await.unwrap()["details"]["type"]["_errors"][0].is_string());

    let document = http
        .get(format!("{}/openapi.yaml", world.sandbox.url))
        .send()
        .await
        .unwrap();
    assert_eq!(document.status(), 200);
    let version = document.headers()["x-rialto-version"]
        .to_str()
        .unwrap()
        .to_owned();
    let text = document.text().await.unwrap();
    assert!(text.starts_with("openapi: 3.0") || text.contains("\nopenapi: 3.0"));
    assert!(
        text.contains(&format!("version: \"{version}\""))
            || text.contains(&format!("version: '{version}'"))
            || text.contains(&format!("version: {version}"))
    );
    assert!(text.contains("/api/v1/chat/completions"));
    assert!(!text.contains("{{"));
}

/// A client that sends a request's head slower than
/// `gateway.client_request_timeout_ms` (slowloris) is answered 408 and
/// its connection closed, and the server goes on answering others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_request_head_is_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sandbox = rialto_test_kit::Sandbox::builder(rialto_test_kit::Topology::OneProcess)
        .env("RIALTO_GATEWAY__CLIENT_REQUEST_TIMEOUT_MS", "500")
        .start()
        .await
        .unwrap();
    let address = sandbox.url.trim_start_matches("http://").to_owned();
    let mut slow = tokio::net::TcpStream::connect(&address).await.unwrap();
    // A head that never ends.
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: rialto\r\nX-Slow: 1\r\n")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        slow.read_to_end(&mut answer),
    )
    .await;
    assert!(read.is_ok(), "the slow connection was held open");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "cut off after {:?}",
        started.elapsed()
    );
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
    let healthy = sandbox
        .http()
        .get(format!("{}/healthz", sandbox.url))
        .send()
        .await
        .unwrap();
    assert_eq!(healthy.status(), 200);
}
