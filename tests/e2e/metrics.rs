//! `GET /metrics` after real traffic: the gateway's HTTP counters and
//! latency histograms, the limiter's decisions, the ledger's holds and
//! settlements, spend and tokens by model; in one process also the router's
//! backend health (in the split topology the router's own process has it).

use serde_json::json;

use crate::both_topologies;
use crate::support::World;

both_topologies!(metrics_after_a_chat);

async fn metrics_after_a_chat(world: &World) {
    let sandbox = &world.sandbox;
    let account = sandbox.create_account("metrics").await.unwrap();
    let (_, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    let body = json!({"model": "mock-chat", "messages": [{"role": "user", "content": "hello"}]});
    let response = sandbox
        .call(
            reqwest::Method::POST,
            "/chat/completions",
            &key,
            Some(&body),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let response = sandbox
        .http()
        .get(format!("{}/metrics", sandbox.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    let text = response.text().await.unwrap();
    for expected in [
        r#"rialto_http_requests_total{service="gateway",route="/api/v1/chat/completions",method="POST",status="200"} 1"#,
        r#"rialto_http_request_duration_seconds_count{service="gateway",route="/api/v1/chat/completions",method="POST",status="200"} 1"#,
        r#"rialto_limiter_decisions_total{decision="admitted",limit_type="none"}"#,
        r#"rialto_ledger_holds_total{outcome="placed"} 1"#,
        r#"rialto_ledger_settlements_total{outcome="settled"} 1"#,
        r#"rialto_spend_usd_total{model="mock-chat"}"#,
        r#"rialto_tokens_total{model="mock-chat",kind="prompt"}"#,
    ] {
        assert!(text.contains(expected), "{expected} missing from:\n{text}");
    }
    let version = response_version(&text);
    assert!(
        text.lines().any(|l| l.starts_with("rialto_build_info{")
            && l.contains(&format!("revision=\"{version}\""))
            && l.ends_with(" 1")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("rialto_process_start_time_seconds ")),
        "{text}"
    );
    if sandbox.grpc_addr("router").is_none() {
        assert!(
            text.contains(r#"rialto_backend_circuit_state{model="mock-chat""#),
            "{text}"
        );
        assert!(text.contains(r#"rialto_backend_requests_total{model="mock-chat""#));
        // One process: the pool, the top spenders and the stream timing
        // are this process's too.
        assert!(text.contains(r#"rialto_db_pool_connections{pool="main",state="idle"}"#));
        assert!(
            text.contains(r#"rialto_db_pool_max_connections{pool="main"} 8"#),
            "{text}"
        );
        let spender = format!(
            r#"rialto_top_owner_spend_usd{{owner="account:{}"}} "#,
            account.id
        );
        let spent: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(spender.as_str()))
            .unwrap_or_else(|| panic!("{spender} missing from:\n{text}"))
            .parse()
            .unwrap();
        assert!(spent > 0.0, "{spent}");
        let stream = json!({"model": "mock-chat", "stream": true,
            "messages": [{"role": "user", "content": "hello"}]});
        let streamed = sandbox
            .call(
                reqwest::Method::POST,
                "/chat/completions",
                &key,
                Some(&stream),
            )
            .await
            .unwrap();
        assert_eq!(streamed.status(), 200);
        streamed.text().await.unwrap();
        let text = sandbox
            .http()
            .get(format!("{}/metrics", sandbox.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for expected in [
            r#"rialto_time_to_first_token_seconds_count{model="mock-chat",backend="mock-chat/0"} 1"#,
            r#"rialto_time_per_output_token_seconds_count{model="mock-chat",backend="mock-chat/0"} 1"#,
        ] {
            assert!(text.contains(expected), "{expected} missing from:\n{text}");
        }
    }
    // Raw paths never become labels: an unknown path is `unmatched`.
    let _ = sandbox
        .http()
        .get(format!("{}/api/v1/no/such/path/12345", sandbox.url))
        .send()
        .await
        .unwrap();
    let text = sandbox
        .http()
        .get(format!("{}/metrics", sandbox.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // Look for the path, not its number: a latency sum such as
    // `0.003612345` contains "12345" too.
    assert!(!text.contains("no/such/path"), "{text}");
}

/// With `metrics.listen` set, `/metrics` has a port of its own (kept off
/// the public Service in Kubernetes) and the public port no longer shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_on_their_own_port() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sandbox = rialto_test_kit::Sandbox::builder(rialto_test_kit::Topology::OneProcess)
        .env("RIALTO_METRICS__LISTEN", &format!("127.0.0.1:{port}"))
        .start()
        .await
        .unwrap();
    let own = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap();
    assert_eq!(own.status(), 200);
    assert!(own.text().await.unwrap().ends_with("# EOF\n"));
    let public = sandbox
        .http()
        .get(format!("{}/metrics", sandbox.url))
        .send()
        .await
        .unwrap();
    assert_eq!(public.status(), 404);
}

/// The revision a build_info line names (any build: the test only checks
/// that it has the shape `<yyyymmdd>.<hhmmss>`).
fn response_version(text: &str) -> String {
    let line = text
        .lines()
        .find(|l| l.starts_with("rialto_build_info{"))
        .unwrap_or_else(|| panic!("no rialto_build_info in:\n{text}"));
    let revision = line
        .split("revision=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap();
    let (day, time) = revision.split_once('.').unwrap();
    assert!(day.len() == 8 && time.len() == 6, "{revision}");
    revision.to_owned()
}
