//! The prepaid ledger end to end: holds that never let concurrent requests
//! overdraw a balance, 402 when the balance can't cover a request, the
//! balance headers, DIEM spent before USD, streams the client abandoned
//! billed for what was produced, and the balance endpoint.

use futures_util::future::join_all;
use reqwest::{Method, Response};
use rialto_test_kit::{MockUpstream, Sandbox, Storage, Topology};
use serde_json::{Value, json};

/// `paid-chat` costs $1 per million tokens in and out: a request's hold is
/// its prompt estimate plus `max_tokens`, in micro-dollars.
fn models(mock_url: &str) -> String {
    format!(
        r#"
[[models]]
id = "paid-chat"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]

[[models]]
id = "pricey-chat"
input_usd_per_mtok = 100.0
output_usd_per_mtok = 100.0
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]

# Rate limits far above these tests' bursts: this file tests money.
[limits.tiers.standard.XS]
rpm = 100000
tpm = 100000000
"#
    )
}

struct World {
    _mock: MockUpstream,
    sandbox: Sandbox,
}

async fn world(topology: Topology, storage: Storage) -> World {
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(topology)
        .storage(storage)
        .config(&models(&mock.base_url()))
        .start()
        .await
        .unwrap();
    World {
        _mock: mock,
        sandbox,
    }
}

/// An unfunded account and an INFERENCE key: (account id, admin, inference).
async fn account(sandbox: &Sandbox) -> (String, String, String) {
    let account = sandbox
        .create_unfunded_account("payer", "standard")
        .await
        .unwrap();
    let (_, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    (account.id, account.admin_key, key)
}

/// [`account`], credited `usd` (reference `seed`).
async fn funded(sandbox: &Sandbox, usd: &str) -> (String, String, String) {
    let (id, admin, key) = account(sandbox).await;
    sandbox.credit(&id, usd, "seed").await.unwrap();
    (id, admin, key)
}

/// "hello there" is estimated at 3 prompt tokens; the mock answers
/// `max_tokens` words: the request's hold is 1,003 micro-dollars and its
/// real cost (2 prompt words + 1,000) 1,002.
fn thousand_words() -> Value {
    json!({"model": "paid-chat", "max_tokens": 1000,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 1000}})
}

async fn chat(sandbox: &Sandbox, key: &str, body: &Value) -> Response {
    sandbox
        .call(Method::POST, "/chat/completions", key, Some(body))
        .await
        .unwrap()
}

async fn balance(sandbox: &Sandbox, admin: &str) -> Value {
    let response = sandbox
        .call(Method::GET, "/billing/balance", admin, None)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// A balance that covers exactly 10 requests; 1,000 concurrent requests.
async fn ten_of_a_thousand(topology: Topology, storage: Storage) {
    let world = world(topology, storage).await;
    let sandbox = &world.sandbox;
    let (id, admin, key) = account(sandbox).await;
    sandbox.credit(&id, "0.01003", "exactly-ten").await.unwrap();
    let body = thousand_words();
    let responses = join_all((0..1000).map(|_| chat(sandbox, &key, &body))).await;
    let mut served = 0;
    for response in responses {
        match response.status().as_u16() {
            200 => served += 1,
            402 => {
                let body: Value = response.json().await.unwrap();
                assert!(
                    body["error"]
                        .as_str()
                        .unwrap()
                        .starts_with("Insufficient USD or Diem balance")
                );
            }
            // More than 20 refusals block the key for a while (abuse
            // protection counts 402s): refused too, never served.
            429 => {
                let body: Value = response.json().await.unwrap();
                let message = body["error"].as_str().unwrap();
                assert!(message.starts_with("Too many failed attempts"), "{message}");
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(served, 10);
    // Ten requests of 1,002 micro-dollars each were charged; the rest of
    // each hold (one token) went back. Nothing is held, nothing overdrawn.
    let balance = balance(sandbox, &admin).await;
    assert_eq!(balance["balances"]["usd"].to_string(), "0.00001");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_balance_for_ten_requests_serves_ten_of_a_thousand_one_process() {
    ten_of_a_thousand(Topology::OneProcess, Storage::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_balance_for_ten_requests_serves_ten_of_a_thousand_split_on_postgres() {
    ten_of_a_thousand(Topology::Split, Storage::Postgres).await;
}

/// The balance headers show the balances before the request; DIEM pays
/// first; an abandoned stream is billed for what it produced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balances_costs_and_abandoned_streams() {
    let world = world(Topology::OneProcess, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let (id, admin, key) = account(sandbox).await;
    sandbox
        .credit_both(&id, "1", "0.000005", "seed")
        .await
        .unwrap();
    let small = json!({"model": "paid-chat", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10}});
    let response = chat(sandbox, &key, &small).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-rialto-balance-usd"], "1");
    assert_eq!(response.headers()["x-rialto-balance-diem"], "0.000005");
    let body: Value = response.json().await.unwrap();
    // 2 + 10 tokens at $1/M = $0.000012: 0.000005 DIEM, then $0.000007.
    assert_eq!(
        body["cost"].to_string(),
        r#"{"diem":0.000005,"usd":0.000007}"#
    );
    let next = chat(sandbox, &key, &small).await;
    assert_eq!(next.headers()["x-rialto-balance-usd"], "0.999993");
    assert_eq!(next.headers()["x-rialto-balance-diem"], "0");

    // A stream the client leaves after a few chunks: billed for the prompt
    // and the words sent, far less than its hold of 5,003 micro-dollars.
    let before = balance(sandbox, &admin).await["balances"]["usd"]
        .as_f64()
        .unwrap();
    let stream = json!({"model": "paid-chat", "max_tokens": 5000, "stream": true,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 5000, "chunk_delay_ms": 20}});
    let mut response = chat(sandbox, &key, &stream).await;
    assert_eq!(response.status(), 200);
    for _ in 0..3 {
        response.chunk().await.unwrap().unwrap();
    }
    drop(response);
    let mut after = before;
    for _ in 0..100 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let now = balance(sandbox, &admin).await;
        after = now["balances"]["usd"].as_f64().unwrap();
        if after < before {
            break;
        }
    }
    let charged = before - after;
    assert!(charged > 0.0, "the abandoned stream was not billed");
    assert!(charged < 0.0005, "billed {charged}, more than it produced");
}

/// Sends a streamed chat and leaves once the backend has been asked for
/// it, `after` later: the request is aborted, which closes its connection.
async fn leave_a_stream(world: &World, key: &str, body: &Value, after: std::time::Duration) {
    let asked = world._mock.request_count();
    let request = world
        .sandbox
        .http()
        .post(world.sandbox.api("/chat/completions"))
        .bearer_auth(key)
        .json(body)
        .send();
    let request = tokio::spawn(request);
    for _ in 0..1000 {
        if world._mock.request_count() > asked {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    assert!(
        world._mock.request_count() > asked,
        "the backend was never asked"
    );
    tokio::time::sleep(after).await;
    assert!(
        !request.is_finished(),
        "the stream's head came before the client left"
    );
    request.abort();
}

/// Polls the USD balance until it reads `expected` (a few seconds: well
/// before a stream's 30 s lease could expire and end the hold instead).
async fn balance_reaches(sandbox: &Sandbox, admin: &str, expected: &str, what: &str) {
    let mut now = String::new();
    for _ in 0..50 {
        now = balance(sandbox, admin).await["balances"]["usd"].to_string();
        if now == expected {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("{what}: the balance reads {now}, not {expected}");
}

/// A stream's head waits (up to 200 ms) for its first chunk, to leave
/// with it. A client that leaves in that wait is charged what the stream
/// used (its prompt: 3 estimated tokens, nothing sent), at once; and one
/// that leaves before the backend answered at all is charged nothing, its
/// hold released at once rather than left for the lease to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_before_the_first_chunk_pays_only_its_prompt() {
    let world = world(Topology::OneProcess, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let (_, admin, key) = funded(sandbox, "1").await;
    let slow_first_chunk = json!({"model": "paid-chat", "max_tokens": 1000, "stream": true,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10, "first_chunk_delay_ms": 2000}});
    let after = std::time::Duration::from_millis(50);
    leave_a_stream(&world, &key, &slow_first_chunk, after).await;
    balance_reaches(
        sandbox,
        &admin,
        "0.999997",
        "left in the first chunk's wait",
    )
    .await;

    let slow_head = json!({"model": "paid-chat", "max_tokens": 1000, "stream": true,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10, "delay_ms": 2000}});
    leave_a_stream(&world, &key, &slow_head, after).await;
    // Nothing charged, and nothing held: a request whose hold is all but
    // 4 micro-dollars of the balance (3 + 999,990 tokens at $1/M of
    // 999,997) is served. It would be refused while the left stream's
    // hold (1,003) were still open.
    let whole = json!({"model": "paid-chat", "max_tokens": 999_990,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 1}});
    let mut answer = (0, String::new());
    for _ in 0..10 {
        let response = chat(sandbox, &key, &whole).await;
        answer = (response.status().as_u16(), response.text().await.unwrap());
        if answer.0 != 402 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert_eq!(
        answer.0, 200,
        "the left stream's hold is still open: {}",
        answer.1
    );
    // 2 prompt words and 1 completion.
    balance_reaches(
        sandbox,
        &admin,
        "0.999994",
        "left before the backend answered",
    )
    .await;
}

/// A client that leaves a non-streamed call while its backend works: the
/// backend's answer is still charged, what it used and not the hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_call_is_charged_what_its_backend_used() {
    let world = world(Topology::OneProcess, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let (_, admin, key) = funded(sandbox, "1").await;
    let before = balance(sandbox, &admin).await["balances"]["usd"].to_string();
    assert_eq!(before, "1");
    // Held: 3 + 1,000 tokens; used: 2 + 10, at $1/M.
    let slow = json!({"model": "paid-chat", "max_tokens": 1000,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10, "delay_ms": 1500}});
    let impatient = reqwest::Client::builder()
        .timeout(std::time::Duration::from_millis(300))
        .build()
        .unwrap();
    let left = impatient
        .post(sandbox.api("/chat/completions"))
        .bearer_auth(&key)
        .json(&slow)
        .send()
        .await;
    assert!(left.is_err(), "the call answered before the client left");
    let mut after = String::new();
    for _ in 0..100 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        after = balance(sandbox, &admin).await["balances"]["usd"].to_string();
        if after == "0.999988" {
            break;
        }
    }
    assert_eq!(
        after, "0.999988",
        "the abandoned call was not charged what it used"
    );
}

/// The hold counts everything the model reads: a $0.01 account sending one
/// 500 KB tool description with `max_tokens: 1` is refused before the
/// backend sees it; and with no `max_tokens` the backend is told the
/// completion limit the hold covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hold_covers_tools_and_bounds_the_completion() {
    let world = world(Topology::OneProcess, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let (_, _, key) = funded(sandbox, "0.01").await;
    let description = "x".repeat(500 * 1024);
    let tools = json!([{"type": "function", "function": {"name": "lookup",
        "description": description, "parameters": {"type": "object", "properties": {}}}}]);
    let heavy = json!({"model": "paid-chat", "max_tokens": 1, "tools": tools,
        "messages": [{"role": "user", "content": "hi"}]});
    let response = chat(sandbox, &key, &heavy).await;
    assert_eq!(response.status(), 402, "{}", response.text().await.unwrap());
    assert_eq!(world._mock.request_count(), 0, "the backend saw it");

    let open_ended = json!({"model": "paid-chat",
        "messages": [{"role": "user", "content": "hi"}]});
    let response = chat(sandbox, &key, &open_ended).await;
    assert_eq!(response.status(), 200);
    let seen = world._mock.requests().last().unwrap().clone();
    // The configured default_completion_tokens, which the hold covered.
    assert_eq!(seen["max_tokens"], 1024, "{seen}");
}

/// A backend that reports more than the hold assumed (its tokenizer counts
/// 30,000 prompt tokens where the gateway estimated 3): the request is
/// charged what the balance has, the rest is owed, the balance reads below
/// zero, the next request is refused with 402 until a top-up covers the
/// debt, and the request after the top-up pays it first. Split topology:
/// the debt crosses the gRPC hop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_above_the_hold_is_owed_not_written_off() {
    let world = world(Topology::Split, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let (id, admin, key) = funded(sandbox, "0.01").await;
    let heavy = json!({"model": "paid-chat", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10, "prompt_tokens": 30000}});
    let response = chat(sandbox, &key, &heavy).await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    // $0.03001 used; $0.01 charged; $0.02001 owed.
    assert_eq!(
        balance(sandbox, &admin).await["balances"]["usd"],
        json!(-0.02001)
    );
    let light = json!({"model": "paid-chat", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10}});
    let response = chat(sandbox, &key, &light).await;
    assert_eq!(response.status(), 402, "{}", response.text().await.unwrap());
    assert_eq!(
        world._mock.request_count(),
        1,
        "the backend saw the refused one"
    );
    sandbox.credit(&id, "0.05", "top-up").await.unwrap();
    let response = chat(sandbox, &key, &light).await;
    assert_eq!(response.status(), 200);
    // 0.06 - 0.03001 - 0.000012 (2 prompt + 10 completion tokens).
    assert_eq!(
        balance(sandbox, &admin).await["balances"]["usd"],
        json!(0.029978)
    );
}

/// A model whose tokenizer is configured (here all-MiniLM-L6-v2's, which
/// `make models` fetches): the hold counts the prompt with it. 4,000
/// exclamation marks are 4,000 tokens to it and 1,000 to the
/// four-characters guess, so a $0.002 account is refused with 402 before
/// the backend on that model, and served on the same model without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_tokenizer_counts_its_hold() {
    let mock = MockUpstream::start().await.unwrap();
    let tokenizer = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../models/all-minilm-l6-v2/tokenizer.json"
    );
    let tokenized = format!(
        r#"
[[models]]
id = "tokenized-chat"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
tokenizer = "{tokenizer}"
backends = [{{ kind = "openai", url = "{}", model = "mock-model" }}]
"#,
        mock.base_url()
    );
    let sandbox = Sandbox::builder(Topology::OneProcess)
        .config(&models(&mock.base_url()))
        .config(&tokenized)
        .start()
        .await
        .unwrap();
    let (_, _, key) = funded(&sandbox, "0.002").await;
    let shouting = |model: &str| {
        json!({"model": model, "max_tokens": 10, "mock": {"words": 10},
            "messages": [{"role": "user", "content": "!".repeat(4000)}]})
    };
    let response = chat(&sandbox, &key, &shouting("tokenized-chat")).await;
    assert_eq!(response.status(), 402, "{}", response.text().await.unwrap());
    assert_eq!(mock.request_count(), 0, "the backend saw it");
    let response = chat(&sandbox, &key, &shouting("paid-chat")).await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
}

/// In a split deployment a caller that had room to spare a moment ago has
/// its route asked beside its admission and hold (the gateway's
/// `ahead.rs`), and held with its settlement in one call to billing once
/// the answer is in (`Charge`): its answer is the same, and when that hold
/// refuses after all (the balance went meanwhile) the answer is not
/// served: 402, nothing charged, and the caller's next request waits for
/// its hold again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_asked_ahead_serves_only_what_the_hold_covers() {
    let (mock, sandbox) = routing_ahead().await;
    let sandbox = &sandbox;
    let (id, admin, key) = funded(sandbox, "0.1").await;
    let (_, other_key) = sandbox.create_key(&admin, "INFERENCE").await.unwrap();
    let ahead = async |outcome| routes_ahead(sandbox, outcome).await;
    // The first request waits for its hold ($0.001003 of $0.1, room for
    // 64 more) and the second is asked ahead: served and charged alike.
    for (expected_ahead, before) in [(0.0, "0.1"), (1.0, "0.098998")] {
        let response = chat(sandbox, &key, &thousand_words()).await;
        assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
        // The balance before it, from its hold or from its charge.
        assert_eq!(response.headers()["x-rialto-balance-usd"], before);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["usage"]["completion_tokens"], 1000);
        assert_eq!(body["cost"]["usd"].to_string(), "0.001002");
        assert_eq!(ahead("used").await, expected_ahead);
    }
    // Another key of the account spends all but $0.000796 of it: 970 words
    // at $100 per million tokens, (2 + 970) * 0.0001.
    let pricey = json!({"model": "pricey-chat", "max_tokens": 970,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 970}});
    let response = chat(sandbox, &other_key, &pricey).await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    let usd = async || balance(sandbox, &admin).await["balances"]["usd"].to_string();
    assert_eq!(usd().await, "0.000796");
    // The first key still has room as far as this gateway knows: its route
    // is asked ahead and answered, and the charge's hold refuses it.
    let response = chat(sandbox, &key, &thousand_words()).await;
    assert_eq!(response.headers()["x-rialto-balance-usd"], "0.000796");
    assert_eq!(response.status(), 402, "{}", response.text().await.unwrap());
    assert_eq!(ahead("used").await, 2.0);
    assert_eq!(ahead("dropped").await, 0.0);
    // Now it has not: asked in order, refused before any backend call
    // (once the dropped call, which may have reached the backend, is done).
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let calls = mock.request_count();
    let response = chat(sandbox, &key, &thousand_words()).await;
    assert_eq!(response.status(), 402, "{}", response.text().await.unwrap());
    assert_eq!(ahead("used").await, 2.0);
    assert_eq!(mock.request_count(), calls, "the backend saw it");
    // Nothing of either refusal was charged or is still held.
    assert_eq!(usd().await, "0.000796");
    // A top-up serves it again, in order while the refusal stands.
    sandbox.credit(&id, "1", "top-up").await.unwrap();
    let response = chat(sandbox, &key, &thousand_words()).await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    assert_eq!(ahead("used").await, 2.0);
    assert_eq!(ahead("dropped").await, 0.0);
}

/// The split topology on SQLite, with a caller's room believed for a
/// minute, not 2 s: a test's steps on a busy machine must not outlast it
/// (a refusal, not time, ends it in these tests).
async fn routing_ahead() -> (MockUpstream, Sandbox) {
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(Topology::Split)
        .config(&models(&mock.base_url()))
        .env("RIALTO_GATEWAY__ROUTE_AHEAD_MS", "60000")
        .start()
        .await
        .unwrap();
    (mock, sandbox)
}

/// `rialto_routes_ahead_total{outcome}` of the gateway.
async fn routes_ahead(sandbox: &Sandbox, outcome: &str) -> f64 {
    let sample = format!("rialto_routes_ahead_total{{outcome=\"{outcome}\"}}");
    crate::support::metric(sandbox, &sample).await
}

/// A stream that cost more than its hold (its backend counted 30,000
/// prompt tokens where the gateway estimated 3) may have spent the balance
/// the hold's answer showed: the caller's next plain chat waits for its own
/// hold, which refuses it before any backend call, rather than being routed
/// ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_above_its_hold_ends_the_callers_routes_ahead() {
    let (mock, sandbox) = routing_ahead().await;
    let sandbox = &sandbox;
    let (_, _, key) = funded(sandbox, "0.01").await;
    let light = json!({"model": "paid-chat", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10}});
    // $0.01 holds these ($0.000013) 64 times over: the second goes ahead.
    for _ in 0..2 {
        let response = chat(sandbox, &key, &light).await;
        assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    }
    assert_eq!(routes_ahead(sandbox, "used").await, 1.0);
    let heavy = json!({"model": "paid-chat", "max_tokens": 10, "stream": true,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10, "prompt_tokens": 30000}});
    let response = chat(sandbox, &key, &heavy).await;
    assert_eq!(response.status(), 200);
    let events = response.text().await.unwrap();
    assert!(
        events.contains("\"cost\"") && events.ends_with("data: [DONE]\n\n"),
        "{events}"
    );
    // $0.03001 used of $0.009976: in debt, and told so.
    let calls = mock.request_count();
    let response = chat(sandbox, &key, &light).await;
    assert_eq!(response.status(), 402, "{}", response.text().await.unwrap());
    assert_eq!(mock.request_count(), calls, "the backend saw it");
    assert_eq!(routes_ahead(sandbox, "dropped").await, 0.0);
    assert_eq!(routes_ahead(sandbox, "used").await, 1.0);
}

/// An account without credit is refused with 402 before any backend call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_credit_no_call() {
    let world = world(Topology::Split, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let (_, admin, key) = account(sandbox).await;
    let response = chat(sandbox, &key, &thousand_words()).await;
    assert_eq!(response.status(), 402);
    assert_eq!(response.headers()["x-rialto-balance-usd"], "0");
    assert!(
        response
            .headers()
            .contains_key("x-ratelimit-remaining-requests")
    );
    assert_eq!(world._mock.request_count(), 0);
    let balance = balance(sandbox, &admin).await;
    assert_eq!(
        balance,
        json!({"canConsume": false, "consumptionCurrency": null,
            "balances": {"diem": 0, "usd": 0}, "diemEpochAllocation": 0})
    );
    let refused = sandbox
        .call(Method::GET, "/billing/balance", &key, None)
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
}

/// A stream whose backend is silent for longer than the stream's lease:
/// the gateway checkpoints on a clock, so the hold does not expire under
/// the live stream, and the stream pays its whole cost, not the checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_backend_does_not_let_a_stream_go_free() {
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(Topology::OneProcess)
        .config(&models(&mock.base_url()))
        .config("[billing]\nstream_lease_secs = 2\ncheckpoint_ms = 200\n")
        .start()
        .await
        .unwrap();
    let (_, admin, key) = funded(&sandbox, "1").await;
    // Three words, 3 s apart: each gap outlasts the 2 s lease.
    let stream = json!({"model": "paid-chat", "max_tokens": 100, "stream": true,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 3, "chunk_delay_ms": 3000}});
    let response = chat(&sandbox, &key, &stream).await;
    assert_eq!(response.status(), 200);
    let body = response.text().await.unwrap();
    let last = sse_data(&body)
        .into_iter()
        .rfind(|data| data != "[DONE]")
        .unwrap();
    let last: Value = serde_json::from_str(&last).unwrap();
    let cost = last["cost"]["usd"].to_string().parse::<f64>().unwrap();
    assert!(cost > 0.0, "{last}");
    let after = balance(&sandbox, &admin).await["balances"]["usd"]
        .as_f64()
        .unwrap();
    assert!(
        ((1.0 - after) - cost).abs() < 1e-12,
        "charged {} for a stream that cost {cost}",
        1.0 - after
    );
}

/// A client that stops reading a stream: the gateway waits half the
/// stream's lease for it to take a chunk, then ends the stream and charges
/// what it was sent, instead of holding the backend and the hold open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_reading_is_ended_and_charged() {
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(Topology::OneProcess)
        .config(&models(&mock.base_url()))
        .config("[billing]\nstream_lease_secs = 2\ncheckpoint_ms = 200\n")
        .start()
        .await
        .unwrap();
    let (_, admin, key) = funded(&sandbox, "1").await;
    // Far more than the socket buffers hold (~40 MB of chunks); the mock
    // takes seconds to start answering, longer than the 2 s lease, so the
    // hold must live through the wait for the first byte too.
    let stream = json!({"model": "paid-chat", "max_tokens": 200000, "stream": true,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 200000}});
    let mut response = chat(&sandbox, &key, &stream).await;
    assert_eq!(response.status(), 200);
    response.chunk().await.unwrap().unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    let mut rest = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while let Ok(Some(chunk)) = response.chunk().await {
            rest.extend_from_slice(&chunk);
        }
    })
    .await;
    assert!(read.is_ok(), "the stream went on");
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        !rest.contains("[DONE]"),
        "the whole stream waited for the reader"
    );
    let mut after = 1.0;
    for _ in 0..50 {
        after = balance(&sandbox, &admin).await["balances"]["usd"]
            .as_f64()
            .unwrap();
        if after < 1.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let charged = 1.0 - after;
    // Charged what it was sent: something, and less than the whole stream.
    assert!(charged > 0.0 && charged < 0.2, "charged {charged}");
}

/// The gateway dies in the middle of a stream: the stream's hold outlives
/// it only until its lease ends, and is then charged the stream's last
/// checkpoint, once; the rest of the hold is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateways_stream_is_charged_its_last_checkpoint() {
    use rialto_proto::billing::v1::GetBalanceRequest;
    use rialto_proto::billing::v1::billing_client::BillingClient;
    let mock = MockUpstream::start().await.unwrap();
    let mut sandbox = Sandbox::builder(Topology::Split)
        .config(&models(&mock.base_url()))
        .config("[billing]\nhold_ttl_secs = 2\nstream_lease_secs = 2\ncheckpoint_ms = 100\n")
        .start()
        .await
        .unwrap();
    let (id, _, key) = funded(&sandbox, "1").await;
    let stream = json!({"model": "paid-chat", "max_tokens": 5000, "stream": true,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 5000, "chunk_delay_ms": 50}});
    let mut response = chat(&sandbox, &key, &stream).await;
    assert_eq!(response.status(), 200);
    response.chunk().await.unwrap().unwrap();

    let addr = sandbox.grpc_addr("billing").unwrap().to_owned();
    let token: tonic::metadata::MetadataValue<_> =
        format!("Bearer {}", rialto_test_kit::GRPC_TOKEN)
            .parse()
            .unwrap();
    let billing = BillingClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let balance = || {
        let mut request = tonic::Request::new(GetBalanceRequest {
            owner: format!("account:{id}"),
        });
        request
            .metadata_mut()
            .insert("authorization", token.clone());
        let mut billing = billing.clone();
        async move { billing.get_balance(request).await.unwrap().into_inner() }
    };
    // 5,003 micro-dollars are held while the stream runs.
    assert_eq!(balance().await.usd_held, "0.005003");
    // Half a second of stream: a few checkpoints (every 100 ms).
    let started = std::time::Instant::now();
    while started.elapsed() < std::time::Duration::from_millis(500) {
        response.chunk().await.unwrap().unwrap();
    }
    sandbox.kill("gateway").unwrap();
    drop(response);
    // The lease ends (2 s) and the sweeper closes the hold at its last
    // checkpoint: something was charged, at most the hold, nothing is
    // held any more.
    let mut now = balance().await;
    for _ in 0..100 {
        if now.usd_held == "0" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        now = balance().await;
    }
    assert_eq!(now.usd_held, "0");
    let charged = 1.0 - now.usd.parse::<f64>().unwrap();
    assert!(
        charged > 0.0 && charged <= 0.005003,
        "charged {charged} for a stream cut after ~500 ms"
    );
}

/// The usage history: every charge, paginated, filtered, as JSON and CSV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_history_pages_filters_and_exports() {
    let world = world(Topology::OneProcess, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let (_, admin, key) = funded(sandbox, "1").await;
    let small = json!({"model": "paid-chat", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10}});
    let mut request_ids = Vec::new();
    for _ in 0..3 {
        let response = chat(sandbox, &key, &small).await;
        assert_eq!(response.status(), 200);
        let body: Value = response.json().await.unwrap();
        request_ids.push(body["id"].as_str().unwrap().to_owned());
    }
    let get = |query: &str, accept: &str| {
        let request = sandbox
            .http()
            .get(format!("{}?{query}", sandbox.api("/billing/usage")))
            .bearer_auth(&admin)
            .header("accept", accept);
        async move { request.send().await.unwrap() }
    };
    let first = get("limit=2&page=1", "application/json").await;
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["x-pagination-total"], "3");
    assert_eq!(first.headers()["x-pagination-total-pages"], "2");
    assert_eq!(first.headers()["x-pagination-limit"], "2");
    assert_eq!(first.headers()["x-pagination-page"], "1");
    let first: Value = first.json().await.unwrap();
    assert_eq!(
        first["pagination"],
        json!({"limit": 2, "page": 1, "total": 3, "totalPages": 2})
    );
    let entry = &first["data"][0];
    // Newest first: the last request; 2 + 10 tokens at $1/M.
    assert_eq!(
        entry["inferenceDetails"]["requestId"],
        request_ids[2].as_str()
    );
    assert_eq!(entry["amount"].to_string(), "-0.000012");
    assert_eq!(entry["currency"], "USD");
    assert_eq!(entry["sku"], "paid-chat-llm-mtoken");
    assert_eq!(entry["units"].to_string(), "0.000012");
    assert_eq!(entry["pricePerUnitUsd"].to_string(), "1");
    assert_eq!(entry["inferenceDetails"]["promptTokens"], 2);
    assert_eq!(entry["inferenceDetails"]["completionTokens"], 10);
    let second: Value = get("limit=2&page=2", "application/json")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(second["data"].as_array().unwrap().len(), 1);
    let oldest: Value = get("sortOrder=asc&limit=1", "application/json")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        oldest["data"][0]["inferenceDetails"]["requestId"],
        request_ids[0].as_str()
    );
    let diem: Value = get("currency=DIEM", "application/json")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(diem["data"], json!([]));
    let future: Value = get("startDate=2999-01-01T00:00:00Z", "application/json")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(future["pagination"]["total"], 0);

    let csv = get("", "text/csv").await;
    assert_eq!(csv.status(), 200);
    assert!(
        csv.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/csv")
    );
    assert_eq!(
        csv.headers()["content-disposition"],
        "attachment; filename=\"usage.csv\""
    );
    let text = csv.text().await.unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(lines[0].starts_with("timestamp,sku,currency,amount"));
    assert!(lines[1].contains(",paid-chat-llm-mtoken,USD,-0.000012,"));

    let bad = get(
        "limit=0&currency=EUR&sortOrder=up&startDate=yesterday",
        "application/json",
    )
    .await;
    assert_eq!(bad.status(), 400);
    let bad: Value = bad.json().await.unwrap();
    for field in ["limit", "currency", "sortOrder", "startDate"] {
        assert!(
            bad["details"][field]["_errors"][0].is_string(),
            "{field}: {bad}"
        );
    }
    let refused = sandbox
        .call(Method::GET, "/billing/usage", &key, None)
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
}

/// A stake grants DIEM for the day, spent before any USD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stake_pays_in_diem() {
    let world = world(Topology::Split, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let (id, admin, key) = account(sandbox).await;
    let stake = |account: String, body: Value| {
        let request = sandbox
            .http()
            .put(format!("{}/admin/v1/accounts/{account}/stake", sandbox.url))
            .bearer_auth(&sandbox.operator_token)
            .json(&body);
        async move { request.send().await.unwrap() }
    };
    let set = stake(id.clone(), json!({"diem_per_day": "0.00002"})).await;
    assert_eq!(set.status(), 200);
    let set: Value = set.json().await.unwrap();
    assert_eq!(set["diem_per_day"], "0.00002");
    assert_eq!(set["balance"]["diem"], "0.00002");
    let before = balance(sandbox, &admin).await;
    assert_eq!(before["consumptionCurrency"], "DIEM");
    assert_eq!(before["diemEpochAllocation"].to_string(), "0.00002");
    let small = json!({"model": "paid-chat", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10}});
    let response = chat(sandbox, &key, &small).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["cost"].to_string(), r#"{"diem":0.000012,"usd":0}"#);
    let after = balance(sandbox, &admin).await;
    assert_eq!(after["balances"]["diem"].to_string(), "0.000008");
    // Bad input and unknown accounts are refused.
    let missing = stake(id.clone(), json!({})).await;
    assert_eq!(missing.status(), 400);
    let negative = stake(id, json!({"diem_per_day": "-1"})).await;
    assert_eq!(negative.status(), 400);
    let unknown = stake("nobody".into(), json!({"diem_per_day": "1"})).await;
    assert_eq!(unknown.status(), 404);
}

/// With two billing replicas (and two gateways and limiters) on
/// PostgreSQL, the balance still covers exactly ten of a thousand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_balance_for_ten_requests_serves_ten_of_a_thousand_two_billing_replicas_on_postgres() {
    ten_of_a_thousand(Topology::Replicated, Storage::Postgres).await;
}

/// The data of each server-sent event of a stream's body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

/// Billing dies (both replicas, the owner of the account first) while an
/// account's streams run, and comes back: the streams end normally with
/// their `cost`, their usage records wait in JetStream while their holds
/// stay open, and once billing is back every hold is settled exactly once
/// with what the response said (the journal reconciled against the usage
/// records and the balance).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settlements_survive_a_killed_billing_replica() {
    use sqlx::Row;
    let mock = MockUpstream::start().await.unwrap();
    let mut sandbox = Sandbox::builder(Topology::Replicated)
        .storage(Storage::Postgres)
        .config(&models(&mock.base_url()))
        .start()
        .await
        .unwrap();
    let (id, _, key) = funded(&sandbox, "1").await;
    let owner = format!("account:{id}");
    let replicas: Vec<String> = ["billing-0", "billing-1"]
        .iter()
        .map(|name| format!("http://{}", sandbox.grpc_addr(name).unwrap()))
        .collect();
    let addresses: Vec<&str> = replicas.iter().map(String::as_str).collect();
    let owner_index = rialto_billing::replicas::owner_of(&owner, &addresses);
    let victim = format!("billing-{owner_index}");
    let other = format!("billing-{}", 1 - owner_index);

    // 12 streams of 30 words, one word every 60 ms (about 2 s each).
    let stream = json!({"model": "paid-chat", "max_tokens": 100, "stream": true,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 30, "chunk_delay_ms": 60}});
    let mut streams = Vec::new();
    for _ in 0..12 {
        let request = sandbox
            .http()
            .post(sandbox.api("/chat/completions"))
            .bearer_auth(&key)
            .json(&stream);
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 200);
        streams.push(tokio::spawn(async move { response.text().await.unwrap() }));
    }
    sandbox.kill(&victim).unwrap();
    sandbox.kill(&other).unwrap();
    let mut reported = std::collections::HashMap::new();
    for stream in streams {
        let events = sse_data(&stream.await.unwrap());
        assert_eq!(events.last().unwrap(), "[DONE]", "{events:?}");
        let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        let request_id = last["id"]
            .as_str()
            .unwrap()
            .trim_start_matches("chatcmpl-")
            .to_owned();
        // 2 prompt tokens and 30 words at $1/M.
        assert_eq!(last["cost"].to_string(), r#"{"diem":0,"usd":0.000032}"#);
        reported.insert(request_id, 32_000i64);
    }
    assert!(
        sandbox
            .logs_containing("queueing its usage record")
            .await
            .contains("queueing its usage record"),
        "the streams ended while billing was down"
    );
    let db = sqlx::PgPool::connect(sandbox.database_url()).await.unwrap();
    let open = || async {
        sqlx::query("SELECT CAST(COUNT(*) AS BIGINT) FROM holds WHERE state = 'open'")
            .fetch_one(&db)
            .await
            .unwrap()
            .get::<i64, _>(0)
    };
    assert_eq!(open().await, 12, "nothing settles while billing is down");
    sandbox.restart(&other).await.unwrap();
    sandbox.restart(&victim).await.unwrap();
    for _ in 0..200 {
        if open().await == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(open().await, 0, "every hold settled");
    // One settlement per request, charging what its response reported.
    let settled = sqlx::query(
        "SELECT request_id, -usd_nanos FROM ledger_journal WHERE owner = $1 AND kind = 'settle'",
    )
    .bind(&owner)
    .fetch_all(&db)
    .await
    .unwrap();
    let settled: std::collections::HashMap<String, i64> =
        settled.iter().map(|row| (row.get(0), row.get(1))).collect();
    assert_eq!(settled, reported);
    // The usage records agree with the journal, the journal with the balance.
    let records: i64 = sqlx::query(
        "SELECT CAST(COALESCE(SUM(amount_nanos), 0) AS BIGINT) FROM usage_records WHERE owner = $1",
    )
    .bind(&owner)
    .fetch_one(&db)
    .await
    .unwrap()
    .get(0);
    assert_eq!(records, 12 * 32_000);
    let row = sqlx::query(
        "SELECT l.usd_nanos, l.usd_held_nanos, \
         (SELECT CAST(SUM(usd_nanos) AS BIGINT) FROM ledger_journal j WHERE j.owner = l.owner) \
         FROM ledgers l WHERE l.owner = $1",
    )
    .bind(&owner)
    .fetch_one(&db)
    .await
    .unwrap();
    let (usd, held, journal): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert_eq!((usd, held, journal), (1_000_000_000 - 12 * 32_000, 0, usd));
    // The restarted replica serves again.
    let response = chat(&sandbox, &key, &thousand_words()).await;
    assert_eq!(response.status(), 200);
    db.close().await;
}

/// A key capped at $0.003 a day: of 50 concurrent requests that each hold
/// $0.001003, two are served (a third would overrun the cap) though the
/// account could pay for all; the key's record shows its cap and what it
/// spent this period; bad caps are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_consumption_limit_caps_concurrent_spending() {
    let world = world(Topology::Split, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let (_, admin, _) = funded(sandbox, "10").await;
    let create = |body: Value| {
        let request = sandbox
            .http()
            .post(sandbox.api("/api_keys"))
            .bearer_auth(&admin)
            .json(&body);
        async move { request.send().await.unwrap() }
    };
    for (bad, field) in [
        (json!({"usd": -1}), "consumptionLimit.usd"),
        (json!({"usd": 10_000_000_000u64}), "consumptionLimit.usd"),
        (json!({"diem": "5"}), "consumptionLimit.diem"),
        (json!({"vcu": 3}), "consumptionLimit.vcu"),
    ] {
        let response = create(json!({"apiKeyType": "INFERENCE", "description": "bad",
            "consumptionLimit": bad}))
        .await;
        assert_eq!(response.status(), 400);
        let body: Value = response.json().await.unwrap();
        assert!(
            body["details"]
                .to_string()
                .contains(field.split('.').next_back().unwrap()),
            "{body}"
        );
    }
    let response = create(json!({"apiKeyType": "INFERENCE", "description": "bad",
        "limitPeriod": "WEEK"}))
    .await;
    assert_eq!(response.status(), 400);

    let response = create(json!({"apiKeyType": "INFERENCE", "description": "capped",
        "consumptionLimit": {"usd": 0.003, "diem": null, "vcu": null}, "limitPeriod": "EPOCH"}))
    .await;
    assert_eq!(response.status(), 200);
    let created: Value = response.json().await.unwrap();
    assert_eq!(
        created["data"]["consumptionLimit"].to_string(),
        r#"{"diem":null,"usd":0.003,"vcu":null}"#
    );
    let key_id = created["data"]["id"].as_str().unwrap().to_owned();
    let key = created["data"]["apiKey"].as_str().unwrap().to_owned();

    let body = thousand_words();
    let responses = join_all((0..50).map(|_| chat(sandbox, &key, &body))).await;
    let mut served = 0;
    for response in responses {
        match response.status().as_u16() {
            200 => served += 1,
            402 => {
                let body: Value = response.json().await.unwrap();
                let message = body["error"].as_str().unwrap();
                assert!(message.contains("USD consumption limit"), "{message}");
            }
            429 => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(served, 2);
    let response = sandbox
        .call(Method::GET, &format!("/api_keys/{key_id}"), &admin, None)
        .await
        .unwrap();
    let record: Value = response.json().await.unwrap();
    assert_eq!(
        record["data"]["currentPeriodUsage"],
        json!({"usd": "0.002004", "diem": "0"})
    );
    assert_eq!(record["data"]["limitPeriod"], "EPOCH");
    assert_eq!(
        record["data"]["consumptionLimits"].to_string(),
        r#"{"diem":null,"usd":0.003,"vcu":null}"#
    );
    // The account's other keys are not capped, and show no period usage.
    let list: Value = sandbox
        .call(Method::GET, "/api_keys", &admin, None)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let uncapped: Vec<&Value> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|k| k["id"] != key_id.as_str())
        .collect();
    assert!(
        uncapped
            .iter()
            .all(|k| k.get("currentPeriodUsage").is_none())
    );
    let balance = balance(sandbox, &admin).await;
    assert_eq!(balance["balances"]["usd"].to_string(), "9.997996");
}

/// `GET /billing/usage-history` walks every charge oldest first with a
/// cursor, in JSON and CSV; `GET /billing/usage-analytics` sums them by
/// day, model and key.
async fn usage_walk_and_analytics(topology: Topology, storage: Storage) {
    let world = world(topology, storage).await;
    let sandbox = &world.sandbox;
    let (_, admin, first_key) = funded(sandbox, "1").await;
    let (_, second_key) = sandbox.create_key(&admin, "INFERENCE").await.unwrap();
    let small = json!({"model": "paid-chat", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10}});
    // Seven by one key, five by the other, at once: 12 charges of $0.000012.
    let keys: Vec<&str> = std::iter::repeat_n(first_key.as_str(), 7)
        .chain(std::iter::repeat_n(second_key.as_str(), 5))
        .collect();
    let answers = join_all(keys.iter().map(|key| chat(sandbox, key, &small))).await;
    let mut request_ids: Vec<String> = Vec::new();
    for answer in answers {
        assert_eq!(answer.status(), 200);
        let body: Value = answer.json().await.unwrap();
        request_ids.push(body["id"].as_str().unwrap().to_owned());
    }
    let get = |path: &str, accept: &str| {
        let request = sandbox
            .http()
            .get(sandbox.api(path))
            .bearer_auth(&admin)
            .header("accept", accept);
        async move { request.send().await.unwrap() }
    };

    // The walk: 10, then 2, in time order, each charge once.
    let page: Value = get("/billing/usage-history?pageSize=10", "application/json")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(page["data"].as_array().unwrap().len(), 10, "{page}");
    let cursor = page["nextCursor"].as_str().unwrap().to_owned();
    assert!(
        cursor
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    );
    let rest: Value = get(
        &format!("/billing/usage-history?cursor={cursor}"),
        "application/json",
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(rest["data"].as_array().unwrap().len(), 2, "{rest}");
    assert_eq!(rest["nextCursor"], Value::Null);
    let walked: Vec<&Value> = page["data"]
        .as_array()
        .unwrap()
        .iter()
        .chain(rest["data"].as_array().unwrap())
        .collect();
    let times: Vec<&str> = walked
        .iter()
        .map(|e| e["timestamp"].as_str().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    let mut seen: Vec<String> = walked
        .iter()
        .map(|e| {
            e["inferenceDetails"]["requestId"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    seen.sort();
    let mut expected = request_ids.clone();
    expected.sort();
    assert_eq!(seen, expected, "every charge once");
    assert_eq!(walked[0]["amount"].to_string(), "-0.000012");

    // CSV: the cursor in a header, a file name stamped with the time.
    let csv = get("/billing/usage-history?pageSize=10", "text/csv").await;
    assert_eq!(csv.status(), 200);
    let disposition = csv.headers()["content-disposition"].to_str().unwrap();
    assert!(
        disposition.starts_with("attachment; filename=billing-usage-history-")
            && disposition.ends_with("Z.csv")
            && disposition.len() == "attachment; filename=billing-usage-history-".len() + 23,
        "{disposition}"
    );
    let next = csv.headers()["x-next-cursor"].to_str().unwrap().to_owned();
    assert_eq!(csv.text().await.unwrap().lines().count(), 11);
    let last = get(&format!("/billing/usage-history?cursor={next}"), "text/csv").await;
    assert!(last.headers().get("x-next-cursor").is_none());
    assert_eq!(last.text().await.unwrap().lines().count(), 3);

    // Filters, and what they refuse.
    let diem: Value = get("/billing/usage-history?currency=DIEM", "application/json")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(diem, json!({"data": [], "nextCursor": null}));
    let future: Value = get(
        "/billing/usage-history?startTimestamp=2999-01-01T00:00:00.000Z",
        "application/json",
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(future["data"], json!([]));
    for bad in [
        format!("cursor={cursor}&pageSize=10"),
        "cursor=not-a-cursor".to_owned(),
        "pageSize=5".to_owned(),
        "currency=EUR".to_owned(),
        "startTimestamp=2026-01-02T00:00:00Z&endTimestamp=2026-01-01T00:00:00Z".to_owned(),
        "startTimestamp=yesterday".to_owned(),
    ] {
        let response = get(&format!("/billing/usage-history?{bad}"), "application/json").await;
        assert_eq!(response.status(), 400, "{bad}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"], "Invalid request parameters", "{body}");
    }

    // Analytics: today's total, the one model, the two keys by spend.
    let analytics: Value = get("/billing/usage-analytics?lookback=3d", "application/json")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(analytics["lookback"], "3d");
    let days = analytics["byDate"].as_array().unwrap();
    assert_eq!(days.len(), 3);
    let today = chrono::Utc::now().format("%Y-%m-%d").to_string();
    assert_eq!(days[2]["date"], today.as_str());
    assert_eq!(days[2]["USD"].to_string(), "0.000144", "{analytics}");
    assert_eq!(days[0]["USD"].to_string(), "0");
    let model = &analytics["byModel"][0];
    assert_eq!(model["modelName"], "paid-chat");
    assert_eq!(model["modelType"], "LLM");
    assert_eq!(model["unitType"], "tokens");
    assert_eq!(model["totalUsd"].to_string(), "0.000144");
    assert_eq!(model["totalUnits"], 144);
    assert_eq!(analytics["topModels"], json!(["paid-chat"]));
    assert_eq!(analytics["byModelDaily"].as_array().unwrap().len(), 3);
    assert_eq!(
        analytics["byModelDaily"][2]["paid-chat"].to_string(),
        "0.000144"
    );
    let by_key = analytics["byKey"].as_array().unwrap();
    assert_eq!(by_key.len(), 2, "{analytics}");
    assert_eq!(by_key[0]["totalUsd"].to_string(), "0.000084");
    assert_eq!(by_key[1]["totalUsd"].to_string(), "0.00006");
    assert_eq!(by_key[0]["totalUnits"], 84);
    assert!(by_key[0]["apiKeyId"].is_string());
    assert_eq!(analytics["topKeyNames"].as_array().unwrap().len(), 2);
    let dated: Value = get(
        &format!("/billing/usage-analytics?startDate={today}&endDate={today}"),
        "application/json",
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(dated["lookback"], format!("{today}:{today}"));
    assert_eq!(dated["byDate"][0]["USD"].to_string(), "0.000144");
    for bad in [
        "lookback=0d",
        "lookback=91d",
        "lookback=week",
        "startDate=2026-01-01",
        "startDate=2026-01-02&endDate=2026-01-01",
        "startDate=2026-01-01&endDate=2026-06-01",
    ] {
        let response = get(
            &format!("/billing/usage-analytics?{bad}"),
            "application/json",
        )
        .await;
        assert_eq!(response.status(), 400, "{bad}");
    }
    // An INFERENCE key reads neither.
    for path in ["/billing/usage-history", "/billing/usage-analytics"] {
        let refused = sandbox
            .call(Method::GET, path, &first_key, None)
            .await
            .unwrap();
        assert_eq!(refused.status(), 401, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_walk_and_analytics_one_process() {
    usage_walk_and_analytics(Topology::OneProcess, Storage::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_walk_and_analytics_split_on_postgres() {
    usage_walk_and_analytics(Topology::Split, Storage::Postgres).await;
}
