//! One trace per request across the split topology: the caller's W3C
//! `traceparent` is continued by the gateway, carried in gRPC metadata to
//! auth, the limiter, billing and the router, and every process exports
//! its spans over OTLP to a collector double.

use std::time::{Duration, Instant};

use rialto_test_kit::{MockUpstream, OtlpCollector, Sandbox, Topology};
use serde_json::json;

use crate::support::models_toml;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_chat_request_is_one_trace_across_every_service() {
    let collector = OtlpCollector::start().await.unwrap();
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(Topology::Split)
        .config(&models_toml(&mock.base_url()))
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.endpoint())
        // Export every 100 ms instead of every 5 s.
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("RIALTO_LOG__FORMAT", "json")
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("traced").await.unwrap();
    let (_, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    // The first attempt fails and is retried: two attempt spans.
    mock.fail_next(1, 503);
    let response = sandbox
        .http()
        .post(sandbox.api("/chat/completions"))
        .bearer_auth(&key)
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .json(&json!({"model": "mock-chat", "messages": [{"role": "user", "content": "trace me"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    let wanted = [
        "rialto-gateway",
        "rialto-auth",
        "rialto-limiter",
        "rialto-billing",
        "rialto-router",
    ];
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let spans: Vec<_> = collector
            .spans()
            .into_iter()
            .filter(|span| span.trace_id == trace_id)
            .collect();
        let missing: Vec<_> = wanted
            .iter()
            .filter(|service| !spans.iter().any(|span| span.service == **service))
            .collect();
        if missing.is_empty() {
            // The gateway's span continues the caller's, and names the route.
            assert!(
                spans.iter().any(|span| span.service == "rialto-gateway"
                    && span.parent_span_id == "00f067aa0ba902b7"
                    && span.name == "POST /api/v1/chat/completions"),
                "{spans:#?}"
            );
            assert!(
                spans.iter().any(|span| span.service == "rialto-router"
                    && span.name == "rialto.router.v1.Router/Chat"),
                "{spans:#?}"
            );
            // OpenTelemetry's semantic conventions: HTTP and GenAI on the
            // gateway's span, RPC on the services'.
            let gateway = spans
                .iter()
                .find(|span| {
                    span.service == "rialto-gateway" && span.parent_span_id == "00f067aa0ba902b7"
                })
                .unwrap();
            for (key, value) in [
                ("http.request.method", "POST"),
                ("url.path", "/api/v1/chat/completions"),
                ("http.route", "/api/v1/chat/completions"),
                ("http.response.status_code", "200"),
                ("gen_ai.operation.name", "chat"),
                ("gen_ai.request.model", "mock-chat"),
                ("gen_ai.response.model", "mock-chat"),
            ] {
                assert_eq!(gateway.attribute(key), Some(value), "{key} in {gateway:#?}");
            }
            for key in ["gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"] {
                let tokens: u64 = gateway
                    .attribute(key)
                    .unwrap_or_default()
                    .parse()
                    .unwrap_or(0);
                assert!(tokens > 0, "{key} in {gateway:#?}");
            }
            let router = spans
                .iter()
                .find(|span| {
                    span.service == "rialto-router" && span.name == "rialto.router.v1.Router/Chat"
                })
                .unwrap();
            // One client span per backend attempt, under the router's.
            let attempts: Vec<_> = spans
                .iter()
                .filter(|span| span.service == "rialto-router" && span.name == "chat mock-model")
                .collect();
            assert_eq!(attempts.len(), 2, "{spans:#?}");
            let outcomes: Vec<_> = attempts
                .iter()
                .map(|span| span.attribute("rialto.outcome").unwrap_or_default())
                .collect();
            assert!(
                outcomes.contains(&"retry") && outcomes.contains(&"ok"),
                "{outcomes:?}"
            );
            for attempt in &attempts {
                assert_eq!(attempt.attribute("gen_ai.operation.name"), Some("chat"));
                assert_eq!(
                    attempt.attribute("gen_ai.request.model"),
                    Some("mock-model")
                );
                assert_eq!(attempt.attribute("server.address"), Some("127.0.0.1"));
                let port: u16 = attempt.attribute("server.port").unwrap().parse().unwrap();
                assert!(port > 0);
            }
            // A JSON log line of the request leads to its trace.
            let served = |logs: &str| {
                logs.lines()
                    .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
                    .find(|line| {
                        line["fields"]["message"] == "request served"
                            && line["trace_id"] == trace_id
                    })
            };
            let logs = sandbox.logs_when(|logs| served(logs).is_some()).await;
            let line = served(&logs);
            assert!(
                line.is_some(),
                "no JSON line of the request with its trace_id in:\n{logs}"
            );
            for (key, value) in [
                ("rpc.system", "grpc"),
                ("rpc.service", "rialto.router.v1.Router"),
                ("rpc.method", "Chat"),
                ("rpc.grpc.status_code", "0"),
            ] {
                assert_eq!(router.attribute(key), Some(value), "{key} in {router:#?}");
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no spans of {missing:?} in the trace; received: {:#?}",
            collector.spans()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
