//! Rate limits end to end: exactness under races (one process, split, and
//! two gateways with two limiter replicas on NATS), the x-ratelimit-*
//! headers, token estimates and commits, streams cut by the client, global
//! and tiered limits, window reset, abuse protection and the log endpoints.

use std::time::Duration;

use futures_util::future::join_all;
use reqwest::{Method, Response, StatusCode};
use rialto_test_kit::{MockUpstream, Sandbox, Storage, Topology};
use serde_json::{Value, json};

/// `m-chat` is an M-tier model: the spec's 50 requests and 750,000 tokens
/// per minute (`m-files` too, and it reads files). `scarce` has a global limit of 3 requests per window.
fn models(mock_url: &str) -> String {
    format!(
        r#"
[[models]]
id = "m-chat"
tier = "M"
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]

[[models]]
id = "m-files"
tier = "M"
capabilities = ["files"]
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]

[[models]]
id = "scarce"
tier = "XS"
global_rpm = 3
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]
"#
    )
}

struct World {
    mock: MockUpstream,
    sandbox: Sandbox,
}

async fn world(topology: Topology, extra: &str) -> World {
    world_with_env(topology, extra, &[]).await
}

async fn world_with_env(topology: Topology, extra: &str, envs: &[(&str, &str)]) -> World {
    world_on(topology, Storage::Sqlite, extra, envs).await
}

async fn world_on(
    topology: Topology,
    storage: Storage,
    extra: &str,
    envs: &[(&str, &str)],
) -> World {
    let mock = MockUpstream::start().await.unwrap();
    let mut builder = Sandbox::builder(topology)
        .storage(storage)
        .config(&models(&mock.base_url()))
        .config(extra);
    for (key, value) in envs {
        builder = builder.env(key, value);
    }
    let sandbox = builder.start().await.unwrap();
    World { mock, sandbox }
}

/// An account with its ADMIN key and one INFERENCE key: (account id,
/// admin secret, inference key id, inference secret).
async fn account(sandbox: &Sandbox, tier: &str) -> (String, String, String, String) {
    let account = sandbox.create_account_in_tier("acme", tier).await.unwrap();
    let (id, secret) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    (account.id, account.admin_key, id, secret)
}

fn hello(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1000})
}

async fn chat_at(sandbox: &Sandbox, base: &str, key: &str, body: &Value) -> Response {
    sandbox
        .http()
        .post(format!("{base}/api/v1/chat/completions"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

fn number(response: &Response, name: &str) -> i64 {
    response
        .headers()
        .get(name)
        .unwrap_or_else(|| panic!("no {name} on a {} response", response.status()))
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Fires `count` chat requests at once (spread over the sandbox's
/// gateways) and returns how many were admitted, checking every refusal.
async fn race(sandbox: &Sandbox, key: &str, count: usize) -> usize {
    let body = hello("m-chat");
    let requests = (0..count).map(|i| {
        let base = &sandbox.gateway_urls[i % sandbox.gateway_urls.len()];
        chat_at(sandbox, base, key, &body)
    });
    let mut admitted = 0;
    for response in join_all(requests).await {
        match response.status() {
            StatusCode::OK => admitted += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                assert_eq!(response.headers()["x-ratelimit-type"], "api_key");
                assert_eq!(number(&response, "x-ratelimit-limit-requests"), 50);
                assert_eq!(number(&response, "x-ratelimit-remaining-requests"), 0);
                let reset = number(&response, "x-ratelimit-reset-requests");
                assert!(reset > now() && reset <= now() + 61, "reset {reset}");
                assert!(number(&response, "retry-after") >= 1);
                let body: Value = response.json().await.unwrap();
                let message = body["error"].as_str().unwrap();
                assert!(
                    message.starts_with("Rate limit exceeded: 50 requests per minute on m-chat"),
                    "{message}"
                );
            }
            other => panic!("unexpected {other}: {}", response.text().await.unwrap()),
        }
    }
    admitted
}

/// The account's rate-limit log, polled until `wanted` shows up (the log is
/// written off the request path).
async fn log_until(sandbox: &Sandbox, admin: &str, path: &str, wanted: &str) -> Vec<Value> {
    for _ in 0..100 {
        let response = sandbox.call(Method::GET, path, admin, None).await.unwrap();
        assert_eq!(response.status(), 200);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["object"], "list");
        let data = body["data"].as_array().unwrap().clone();
        if data.iter().any(|e| e["rateLimitType"] == wanted) {
            return data;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no {wanted} entry in {path}");
}

async fn exactly_the_limit_under_a_race(topology: Topology, storage: Storage) {
    let world = world_on(topology, storage, "", &[]).await;
    let sandbox = &world.sandbox;
    let (_, admin, key_id, key) = account(sandbox, "standard").await;
    assert_eq!(race(sandbox, &key, 200).await, 50);
    // Refused requests reach no backend.
    assert_eq!(world.mock.request_count(), 50);

    // Both paths of the log, ADMIN only, in the hosted shape.
    for path in ["/api_keys/rate_limits/log", "/api_keys/rate_limit_logs"] {
        let data = log_until(sandbox, &admin, path, "RPM").await;
        let entry = &data[0];
        assert_eq!(entry["apiKeyId"], key_id.as_str());
        assert_eq!(entry["modelId"], "m-chat");
        assert_eq!(entry["rateLimitTier"], "standard");
        assert!(entry["timestamp"].as_str().unwrap().ends_with('Z'));
        assert_eq!(entry.as_object().unwrap().len(), 5);
        // Refusals are logged at most once a second, not 150 times.
        assert!(data.len() <= 5, "{}", data.len());
        let refused = sandbox.call(Method::GET, path, &key, None).await.unwrap();
        assert_eq!(refused.status(), 401);
        let body: Value = refused.json().await.unwrap();
        assert_eq!(body["error"], "Admin API key required");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_the_limit_under_a_race_one_process() {
    exactly_the_limit_under_a_race(Topology::OneProcess, Storage::Sqlite).await;
}

/// The rate-limit log on PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_the_limit_under_a_race_on_postgres() {
    exactly_the_limit_under_a_race(Topology::Split, Storage::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_the_limit_under_a_race_split() {
    exactly_the_limit_under_a_race(Topology::Split, Storage::Sqlite).await;
}

/// Two gateways and two limiter replicas: each key's window lives on one
/// replica, whichever gateway a request reaches; losing a replica loses
/// only the windows it owned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_the_limit_with_two_gateways_and_two_limiter_replicas() {
    let mut world = world(Topology::Replicated, "").await;
    let sandbox = &world.sandbox;
    let limiters = [
        format!("http://{}", sandbox.grpc_addr("limiter-0").unwrap()),
        format!("http://{}", sandbox.grpc_addr("limiter-1").unwrap()),
    ];
    let addresses: Vec<&str> = limiters.iter().map(String::as_str).collect();
    let (_, admin, _, _) = account(sandbox, "standard").await;
    let key0 = key_owned_by(sandbox, &admin, &addresses, 0).await;
    let key1 = key_owned_by(sandbox, &admin, &addresses, 1).await;
    let (a, b) = tokio::join!(race(sandbox, &key0, 200), race(sandbox, &key1, 200));
    assert_eq!((a, b), (50, 50));
    assert_eq!(world.mock.request_count(), 100);
    // Hits from both replicas reach the one log.
    log_until(sandbox, &admin, "/api_keys/rate_limits/log", "RPM").await;

    // A fresh key owned by each replica; then limiter-1 dies.
    let survivor_key = key_owned_by(sandbox, &admin, &addresses, 0).await;
    let orphan_key = key_owned_by(sandbox, &admin, &addresses, 1).await;
    world.sandbox.kill("limiter-1").unwrap();
    let sandbox = &world.sandbox;
    let body = hello("m-chat");
    for base in &sandbox.gateway_urls {
        let ok = chat_at(sandbox, base, &survivor_key, &body).await;
        assert_eq!(ok.status(), 200, "the other replica's keys are unaffected");
        let lost = chat_at(sandbox, base, &orphan_key, &body).await;
        assert_eq!(lost.status(), 503, "{}", lost.text().await.unwrap());
    }
    // The survivor's windows are intact: key0 is still at its limit.
    let refused = chat_at(sandbox, &sandbox.gateway_urls[1], &key0, &body).await;
    assert_eq!(refused.status(), 429);
}

/// A new INFERENCE key whose window the replica `owner` holds.
async fn key_owned_by(sandbox: &Sandbox, admin: &str, addresses: &[&str], owner: usize) -> String {
    loop {
        let (id, secret) = sandbox.create_key(admin, "INFERENCE").await.unwrap();
        if rialto_limiter::owner_of(&format!("key:{id}"), addresses) == owner {
            return secret;
        }
    }
}

async fn headers_estimates_and_commits(topology: Topology) {
    let world = world(topology, "").await;
    let sandbox = &world.sandbox;
    let (_, _, _, key) = account(sandbox, "standard").await;
    let body = hello("m-chat");
    let first = chat_at(sandbox, &sandbox.url, &key, &body).await;
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["x-ratelimit-type"], "api_key");
    assert_eq!(number(&first, "x-ratelimit-limit-requests"), 50);
    assert_eq!(number(&first, "x-ratelimit-remaining-requests"), 49);
    let reset = number(&first, "x-ratelimit-reset-requests");
    assert!(reset >= now() + 58 && reset <= now() + 61, "reset {reset}");
    assert_eq!(number(&first, "x-ratelimit-limit-tokens"), 750_000);
    let reset_tokens = number(&first, "x-ratelimit-reset-tokens");
    assert!((58..=60).contains(&reset_tokens), "{reset_tokens}");
    // Admitted on the estimate: the prompt plus max_tokens.
    let estimate = 750_000 - number(&first, "x-ratelimit-remaining-tokens");
    assert!(estimate > 1000 && estimate < 1100, "estimate {estimate}");
    let used = first.json::<Value>().await.unwrap()["usage"]["total_tokens"]
        .as_i64()
        .unwrap();
    assert!(used < 50);
    // Committed with the real usage once the response ended.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = chat_at(sandbox, &sandbox.url, &key, &body).await;
    assert_eq!(number(&second, "x-ratelimit-remaining-requests"), 48);
    assert_eq!(
        number(&second, "x-ratelimit-remaining-tokens"),
        750_000 - used - estimate
    );

    // A request refused before admission shows its window, untouched.
    let invalid = json!({"model": "m-chat", "messages": []});
    let refused = chat_at(sandbox, &sandbox.url, &key, &invalid).await;
    assert_eq!(refused.status(), 400);
    assert_eq!(number(&refused, "x-ratelimit-remaining-requests"), 48);
    assert_eq!(refused.headers()["x-ratelimit-type"], "api_key");

    // The authoritative limits, and the endpoint's own window.
    let limits = sandbox
        .call(Method::GET, "/api_keys/rate_limits", &key, None)
        .await
        .unwrap();
    assert_eq!(limits.status(), 200);
    assert_eq!(number(&limits, "x-ratelimit-limit-requests"), 500);
    let limits: Value = limits.json().await.unwrap();
    let data = &limits["data"];
    assert_eq!(data["accessPermitted"], true);
    assert_eq!(
        data["apiTier"],
        json!({"id": "standard", "isCharged": true})
    );
    assert_eq!(data["keyExpiration"], Value::Null);
    assert!(
        data["nextEpochBegins"]
            .as_str()
            .unwrap()
            .ends_with("T00:00:00.000Z")
    );
    let m_chat = data["rateLimits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["apiModelId"] == "m-chat")
        .unwrap();
    assert_eq!(
        m_chat["rateLimits"],
        json!([{"type": "RPM", "amount": 50}, {"type": "TPM", "amount": 750000}])
    );

    // A partner account gets the partner table.
    let (_, _, _, partner) = account(sandbox, "partner").await;
    let response = chat_at(sandbox, &sandbox.url, &partner, &body).await;
    assert_eq!(number(&response, "x-ratelimit-limit-requests"), 100);
    assert_eq!(number(&response, "x-ratelimit-limit-tokens"), 1_500_000);
    // The operator moves an account to the partner tier: its keys follow.
    let (id, _, _, moved) = account(sandbox, "standard").await;
    let before = chat_at(sandbox, &sandbox.url, &moved, &body).await;
    assert_eq!(number(&before, "x-ratelimit-limit-requests"), 50);
    let set = sandbox
        .http()
        .put(format!("{}/admin/v1/accounts/{id}/tier", sandbox.url))
        .bearer_auth(&sandbox.operator_token)
        .json(&json!({"tier": "partner"}))
        .send()
        .await
        .unwrap();
    assert_eq!(set.status(), 200);
    let response = chat_at(sandbox, &sandbox.url, &moved, &body).await;
    assert_eq!(number(&response, "x-ratelimit-limit-requests"), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_estimates_and_commits_one_process() {
    headers_estimates_and_commits(Topology::OneProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_estimates_and_commits_split() {
    headers_estimates_and_commits(Topology::Split).await;
}

/// A stream the client abandons is committed with what it used so far,
/// not with its estimate.
async fn a_cut_stream_commits_what_it_used(topology: Topology) {
    let world = world(topology, "").await;
    let sandbox = &world.sandbox;
    let (_, _, _, key) = account(sandbox, "standard").await;
    let stream = json!({"model": "m-chat", "stream": true, "max_tokens": 5000,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 500, "chunk_delay_ms": 20}});
    let mut response = chat_at(sandbox, &sandbox.url, &key, &stream).await;
    assert_eq!(response.status(), 200);
    let estimate = 750_000 - number(&response, "x-ratelimit-remaining-tokens");
    assert!(estimate > 5000);
    // Read a few chunks, then hang up.
    for _ in 0..3 {
        response.chunk().await.unwrap().unwrap();
    }
    drop(response);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let next = chat_at(sandbox, &sandbox.url, &key, &hello("m-chat")).await;
    assert_eq!(next.status(), 200);
    let remaining = number(&next, "x-ratelimit-remaining-tokens");
    let next_estimate = 750_000 - estimate; // an upper bound on what is left
    assert!(
        remaining > next_estimate - 1100,
        "the cut stream still counts its estimate: {remaining}"
    );
    assert!(remaining < 750_000 - 1000, "the cut stream counts nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_stream_commits_what_it_used_one_process() {
    a_cut_stream_commits_what_it_used(Topology::OneProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_stream_commits_what_it_used_split() {
    a_cut_stream_commits_what_it_used(Topology::Split).await;
}

/// A model's global window is shared by every caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_limit_is_shared_by_all_callers() {
    let world = world(Topology::OneProcess, "").await;
    let sandbox = &world.sandbox;
    let (_, _, _, alice) = account(sandbox, "standard").await;
    let (_, _, _, bob) = account(sandbox, "standard").await;
    let body = hello("scarce");
    let mut statuses = Vec::new();
    for key in [&alice, &bob, &alice, &bob] {
        let response = chat_at(sandbox, &sandbox.url, key, &body).await;
        statuses.push(response.status().as_u16());
        if response.status() == 429 {
            assert_eq!(response.headers()["x-ratelimit-type"], "global");
            assert_eq!(number(&response, "x-ratelimit-limit-requests"), 3);
            let body: Value = response.json().await.unwrap();
            assert!(body["error"].as_str().unwrap().contains("for all callers"));
        } else {
            // The tightest window is shown: the global one.
            assert_eq!(response.headers()["x-ratelimit-type"], "global");
        }
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
}

/// Issue 16, finding 3: a file's download and conversion count in the
/// caller's window before they are done, even when the file turns out
/// unreadable (a 400): a caller cannot have unlimited files converted by
/// sending ones that fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_work_counts_in_the_window_before_it_is_done() {
    use base64::Engine as _;
    let world = world(Topology::OneProcess, "[limits.tiers.standard.M]\nrpm = 3\n").await;
    let sandbox = &world.sandbox;
    let (_, _, _, key) = account(sandbox, "standard").await;
    let broken = base64::engine::general_purpose::STANDARD.encode(b"%PDF-1.7 not really");
    let body = json!({"model": "m-files", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "summarize"},
        {"type": "file", "file": {"filename": "broken.pdf", "file_data": broken}}]}]});
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let response = chat_at(sandbox, &sandbox.url, &key, &body).await;
        assert!(
            response
                .headers()
                .contains_key("x-ratelimit-remaining-requests")
        );
        statuses.push(response.status().as_u16());
    }
    assert_eq!(statuses, [400, 400, 400, 429]);
    assert_eq!(world.mock.request_count(), 0);
}

/// With a 2-second window: the limit, a refusal saying when, and admission
/// again once that time has come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_window_resets() {
    let world = world(
        Topology::OneProcess,
        "[limits]\nwindow_secs = 2\n[limits.tiers.standard.M]\nrpm = 3\n",
    )
    .await;
    let sandbox = &world.sandbox;
    let (_, _, _, key) = account(sandbox, "standard").await;
    let body = hello("m-chat");
    for _ in 0..3 {
        assert_eq!(
            chat_at(sandbox, &sandbox.url, &key, &body).await.status(),
            200
        );
    }
    let refused = chat_at(sandbox, &sandbox.url, &key, &body).await;
    assert_eq!(refused.status(), 429);
    let reset = number(&refused, "x-ratelimit-reset-requests");
    assert!(reset <= now() + 3, "reset {reset}");
    assert!(number(&refused, "retry-after") <= 3);
    let message = refused.json::<Value>().await.unwrap()["error"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("3 requests per 2 s"), "{message}");
    // Wait until the reset second has fully passed.
    let wait = (reset + 1 - now()).max(0) as u64;
    tokio::time::sleep(Duration::from_secs(wait)).await;
    assert_eq!(
        chat_at(sandbox, &sandbox.url, &key, &body).await.status(),
        200
    );
}

/// More than 20 failed requests in 30 s block a credential (and, for
/// unauthenticated failures, an address) for the block time (2 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abuse_protection_blocks_and_expires() {
    let world = world_with_env(
        Topology::OneProcess,
        "[limits.abuse]\nblock_secs = 2\n",
        &[("RIALTO_GATEWAY__CLIENT_ADDRESS_HEADER", "X-Forwarded-For")],
    )
    .await;
    let sandbox = &world.sandbox;
    let (_, admin, key_id, key) = account(sandbox, "standard").await;
    let (_, _, _, bystander) = account(sandbox, "standard").await;
    let missing = hello("no-such-model");
    for _ in 0..21 {
        let response = chat_at(sandbox, &sandbox.url, &key, &missing).await;
        assert_eq!(response.status(), 404);
    }
    let blocked = chat_at(sandbox, &sandbox.url, &key, &hello("m-chat")).await;
    assert_eq!(blocked.status(), 429);
    assert!(number(&blocked, "retry-after") <= 3);
    let message = blocked.json::<Value>().await.unwrap()["error"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.starts_with("Too many failed attempts (> 20)") && message.contains("wait 2s"),
        "{message}"
    );
    // The block follows the token, not the header's spelling.
    let respelled = sandbox
        .http()
        .post(sandbox.api("/chat/completions"))
        .header("authorization", format!("bearer   {key} "))
        .json(&hello("m-chat"))
        .send()
        .await
        .unwrap();
    assert_eq!(respelled.status(), 429);
    // Another caller is not affected; the block is logged for the account.
    let ok = chat_at(sandbox, &sandbox.url, &bystander, &hello("m-chat")).await;
    assert_eq!(ok.status(), 200);
    let data = log_until(
        sandbox,
        &admin,
        "/api_keys/rate_limits/log",
        "FAILED_REQUESTS",
    )
    .await;
    let entry = data
        .iter()
        .find(|e| e["rateLimitType"] == "FAILED_REQUESTS")
        .unwrap();
    assert_eq!(entry["apiKeyId"], key_id.as_str());
    assert_eq!(entry["modelId"], "endpoint:api/v1/chat/completions");
    // Wait: the block expires.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let again = chat_at(sandbox, &sandbox.url, &key, &hello("m-chat")).await;
    assert_eq!(again.status(), 200);

    // Unauthenticated failures count against the client's address (here
    // from X-Forwarded-For, as a trusted proxy would set it): 21 wrong keys
    // block the address for anyone who does not authenticate.
    let from = |address: &'static str, key: Option<&str>| {
        let mut request = sandbox
            .http()
            .post(sandbox.api("/chat/completions"))
            .header("x-forwarded-for", format!("203.0.113.9, {address}"))
            .json(&hello("m-chat"));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        async move { request.send().await.unwrap().status().as_u16() }
    };
    for i in 0..21 {
        let wrong = format!("RIALTO_INFERENCE_KEY_wrong{i}");
        assert_eq!(from("10.0.0.1", Some(&wrong)).await, 401);
    }
    assert_eq!(from("10.0.0.1", None).await, 429);
    assert_eq!(
        from("10.0.0.1", Some("RIALTO_INFERENCE_KEY_another")).await,
        429
    );
    // A key that authenticated here before still works behind the same
    // address (a shared proxy or NAT); another address is not blocked.
    assert_eq!(from("10.0.0.1", Some(&bystander)).await, 200);
    assert_eq!(from("10.0.0.2", None).await, 402);
    // A key never seen here waits out the block, unless it proves itself
    // from elsewhere first: nothing behind a blocked address costs a lookup.
    let (_, fresh) = sandbox.create_key(&admin, "INFERENCE").await.unwrap();
    assert_eq!(from("10.0.0.1", Some(&fresh)).await, 429);
    assert_eq!(from("10.0.0.3", Some(&fresh)).await, 200);
    assert_eq!(from("10.0.0.1", Some(&fresh)).await, 200);

    // The operator too; a wrong token is refused before its handler runs.
    let operator = |token: String| {
        let request = sandbox
            .http()
            .post(format!("{}/admin/v1/accounts", sandbox.url))
            .header("x-forwarded-for", "10.0.0.1")
            .bearer_auth(token)
            .json(&json!({"name": "behind-the-proxy"}));
        async move { request.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(operator(sandbox.operator_token.clone()).await, 201);
    assert_eq!(operator("wrong".to_owned()).await, 429);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(from("10.0.0.1", None).await, 402);
}
