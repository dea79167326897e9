//! The router's resilience end to end, in both topologies: every request
//! still succeeds when one of two backends dies mid-run, `x-retry-count`
//! says when a request was sent again, and a model whose backends are all
//! down answers 503 at once even with a ten-minute request timeout.

use std::time::{Duration, Instant};

use reqwest::Method;
use rialto_test_kit::{MockUpstream, Sandbox, Topology};
use serde_json::{Value, json};

struct World {
    /// The two backends of `pair-chat`.
    survivor: MockUpstream,
    victim: Option<MockUpstream>,
    /// The one backend of `flaky-chat`.
    flaky: MockUpstream,
    /// A backend of `down-chat` that accepts connections and never answers.
    _hung: std::net::TcpListener,
    sandbox: Sandbox,
    key: String,
}

async fn world(topology: Topology) -> World {
    let survivor = MockUpstream::start().await.unwrap();
    let victim = MockUpstream::start().await.unwrap();
    let flaky = MockUpstream::start().await.unwrap();
    // Never accepted: the kernel completes the connections, nobody answers.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let config = format!(
        r#"
[router]
request_timeout_secs = 600
breaker_failure_threshold = 3
breaker_cooldown_ms = 60000
breaker_max_cooldown_ms = 120000
health_check_interval_ms = 200
health_check_timeout_ms = 300

[[models]]
id = "pair-chat"
backends = [
  {{ kind = "openai", url = "{survivor}", model = "mock-model" }},
  {{ kind = "openai", url = "{victim}", model = "mock-model" }},
]

[[models]]
id = "flaky-chat"
backends = [{{ kind = "openai", url = "{flaky}", model = "mock-model" }}]

[[models]]
id = "down-chat"
backends = [
  {{ kind = "openai", url = "http://127.0.0.1:9/v1" }},
  {{ kind = "openai", url = "http://{hung}/v1" }},
]
"#,
        survivor = survivor.base_url(),
        victim = victim.base_url(),
        flaky = flaky.base_url(),
        hung = hung.local_addr().unwrap(),
    );
    let sandbox = Sandbox::builder(topology)
        .config(&config)
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("router").await.unwrap();
    let (_, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    World {
        survivor,
        victim: Some(victim),
        flaky,
        _hung: hung,
        sandbox,
        key,
    }
}

async fn post(world: &World, body: Value) -> reqwest::Response {
    world
        .sandbox
        .call(Method::POST, "/chat/completions", &world.key, Some(&body))
        .await
        .unwrap()
}

fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})
}

fn streamed(model: &str) -> Value {
    let mut body = chat(model);
    body["stream"] = json!(true);
    body
}

fn served_by(response: &reqwest::Response) -> String {
    response.headers()["x-rialto-model-router"]
        .to_str()
        .unwrap()
        .to_owned()
}

/// Concurrent requests to `pair-chat` while one of its backends is killed
/// half-way: each one succeeds (those in flight on the victim are sent
/// again to the survivor), and afterwards only the survivor serves.
async fn failover_when_a_backend_dies(mut world: World) {
    const WORKERS: usize = 6;
    let started = Instant::now();
    let kill_at = Duration::from_millis(1_200);
    let end_at = Duration::from_millis(3_000);
    let victim = world.victim.take().unwrap();
    let worker = |_| {
        let world = &world;
        async move {
            // (sent at, status, backend)
            let mut seen = Vec::new();
            while started.elapsed() < end_at {
                let sent = started.elapsed();
                let mut body = chat("pair-chat");
                // Slow enough that requests are in flight when the victim dies.
                body["mock"] = json!({"delay_ms": 40});
                let response = post(world, body).await;
                let status = response.status().as_u16();
                let backend = if status == 200 {
                    served_by(&response)
                } else {
                    response.text().await.unwrap()
                };
                seen.push((sent, status, backend));
            }
            seen
        }
    };
    let killer = async move {
        tokio::time::sleep(kill_at).await;
        victim.stop().await;
    };
    let (results, ()) = tokio::join!(
        futures_util::future::join_all((0..WORKERS).map(worker)),
        killer
    );
    let results: Vec<_> = results.into_iter().flatten().collect();
    let failed: Vec<_> = results
        .iter()
        .filter(|(_, status, _)| *status != 200)
        .collect();
    assert!(failed.is_empty(), "failed requests: {failed:?}");
    let before: Vec<&str> = results
        .iter()
        .filter(|(sent, _, _)| *sent < kill_at)
        .map(|(_, _, backend)| backend.as_str())
        .collect();
    assert!(before.contains(&"pair-chat/0") && before.contains(&"pair-chat/1"));
    // Sent after the kill (and its few milliseconds): the survivor only.
    let after: Vec<&str> = results
        .iter()
        .filter(|(sent, _, _)| *sent > kill_at + Duration::from_millis(100))
        .map(|(_, _, backend)| backend.as_str())
        .collect();
    assert!(after.len() > WORKERS, "{after:?}");
    assert!(after.iter().all(|backend| *backend == "pair-chat/0"));
    assert!(world.survivor.request_count() > after.len());
    // Requests did meet the dead backend, and were sent again.
    let logs = world.sandbox.logs_containing("backend failed").await;
    let failovers = logs
        .lines()
        .filter(|line| line.contains("backend failed") && line.contains("pair-chat/1"))
        .count();
    assert!(failovers > 0, "no request met the dead backend:\n{logs}");

    // Streams too, now that the victim's circuit is open.
    for _ in 0..4 {
        let response = post(&world, streamed("pair-chat")).await;
        assert_eq!(response.status(), 200);
        assert_eq!(served_by(&response), "pair-chat/0");
        assert!(response.text().await.unwrap().ends_with("data: [DONE]\n\n"));
    }
}

/// `x-retry-count` appears exactly when a request was sent more than once.
async fn retry_count_header(world: World) {
    let response = post(&world, chat("flaky-chat")).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("x-retry-count").is_none());

    world.flaky.clear_requests();
    world.flaky.fail_next(1, 503);
    let response = post(&world, chat("flaky-chat")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-retry-count"], "1");
    assert_eq!(served_by(&response), "flaky-chat/0");
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "Hello from mock: hi"
    );
    assert_eq!(world.flaky.request_count(), 2);

    // A stream is retried only before its first byte, and says so.
    world.flaky.fail_next(2, 500);
    let response = post(&world, streamed("flaky-chat")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-retry-count"], "2");
    assert!(response.text().await.unwrap().ends_with("data: [DONE]\n\n"));

    let response = post(&world, streamed("flaky-chat")).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("x-retry-count").is_none());

    // A refused request is not sent again: no header on the 400.
    let mut refused = chat("flaky-chat");
    refused["mock"] = json!({"status": 400});
    let response = post(&world, refused).await;
    assert_eq!(response.status(), 400);
    assert!(response.headers().get("x-retry-count").is_none());
}

/// `down-chat`'s backends are a closed port and a server that never
/// answers. The health checks open both circuits without any request;
/// from then on every request is a 503 `{error}` at once, although a
/// request may take ten minutes.
async fn all_backends_down(world: World) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let logs = world.sandbox.logs();
        let opened = |backend: &str| {
            logs.lines()
                .any(|line| line.contains("circuit opened") && line.contains(backend))
        };
        if opened("down-chat/0") && opened("down-chat/1") {
            break;
        }
        assert!(Instant::now() < deadline, "circuits never opened:\n{logs}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for body in [
        chat("down-chat"),
        streamed("down-chat"),
        chat("down-chat"),
        streamed("down-chat"),
    ] {
        let started = Instant::now();
        let response = post(&world, body).await;
        let elapsed = started.elapsed();
        assert_eq!(response.status(), 503);
        assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
        let body: Value = response.json().await.unwrap();
        assert!(body["error"].is_string(), "{body}");
    }
    // The other models are untouched.
    let response = post(&world, chat("flaky-chat")).await;
    assert_eq!(response.status(), 200);
}

macro_rules! both_topologies {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn one_process() {
                    super::$name(super::world(rialto_test_kit::Topology::OneProcess).await).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn split() {
                    super::$name(super::world(rialto_test_kit::Topology::Split).await).await;
                }
            }
        )*
    };
}

both_topologies!(
    failover_when_a_backend_dies,
    retry_count_header,
    all_backends_down
);
