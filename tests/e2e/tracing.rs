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
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("traced").await.unwrap();
    let (_, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
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
