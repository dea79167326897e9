//! An OpenTelemetry collector double: receives OTLP over HTTP/JSON
//! (`POST /v1/traces`, what Rialto exports) and keeps every span, so tests
//! can check that one request's trace crosses the services. Runs its server
//! on a thread of its own and stops when dropped.

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};

use actix_web::{HttpResponse, web};
use anyhow::Context as _;
use serde_json::Value;

/// One span as the collector received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectedSpan {
    /// The exporting process's `service.name`.
    pub service: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub name: String,
    /// Its attributes, each value as text (`"200"` for an integer).
    pub attributes: std::collections::BTreeMap<String, String>,
}

impl CollectedSpan {
    /// One attribute's value, as text.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

#[derive(Default)]
struct State {
    spans: Mutex<Vec<CollectedSpan>>,
}

pub struct OtlpCollector {
    addr: SocketAddr,
    state: Arc<State>,
    _served: crate::server::Served,
}

impl OtlpCollector {
    pub async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the collector")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State::default());
        let data = web::Data::from(Arc::clone(&state));
        let served = crate::server::serve("otlp-collector", listener, move |app| {
            app.app_data(data.clone())
                .app_data(web::PayloadConfig::new(16 * 1024 * 1024))
                .route("/v1/traces", web::post().to(traces));
        })
        .await?;
        Ok(Self {
            addr,
            state,
            _served: served,
        })
    }

    /// `http://127.0.0.1:PORT`, for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<CollectedSpan> {
        self.state
            .spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// `ExportTraceServiceRequest` in OTLP's JSON mapping.
async fn traces(state: web::Data<State>, body: web::Bytes) -> HttpResponse {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return HttpResponse::BadRequest().finish();
    };
    let mut received = Vec::new();
    for resource in request["resourceSpans"].as_array().into_iter().flatten() {
        let service = resource["resource"]["attributes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| a["key"] == "service.name")
            .and_then(|a| a["value"]["stringValue"].as_str())
            .unwrap_or_default()
            .to_owned();
        for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
            for span in scope["spans"].as_array().into_iter().flatten() {
                let text = |key: &str| span[key].as_str().unwrap_or_default().to_owned();
                // AnyValue in OTLP's JSON: one of stringValue, intValue (a
                // string), boolValue, doubleValue.
                let attributes = span["attributes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|attribute| {
                        let key = attribute["key"].as_str()?.to_owned();
                        let value = attribute["value"].as_object()?.values().next()?;
                        let value = match value {
                            Value::String(text) => text.clone(),
                            other => other.to_string(),
                        };
                        Some((key, value))
                    })
                    .collect();
                received.push(CollectedSpan {
                    service: service.clone(),
                    trace_id: text("traceId"),
                    span_id: text("spanId"),
                    parent_span_id: text("parentSpanId"),
                    name: text("name"),
                    attributes,
                });
            }
        }
    }
    state
        .spans
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .extend(received);
    HttpResponse::Ok()
        .content_type("application/json")
        .body("{}")
}
