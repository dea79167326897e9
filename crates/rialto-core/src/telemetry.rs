//! The tracing subscriber: structured logs to stdout, text or JSON, and,
//! when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set,
//! spans exported over OTLP (HTTP/JSON) to a collector.
//!
//! One trace follows a request across processes: W3C `traceparent` is
//! read from the incoming HTTP request, carried in gRPC metadata
//! ([`inject`] on the client side, [`extract`] on the server side) and in
//! NATS message headers. `RUST_LOG` overrides the configured level. Secrets
//! never reach a log line or a span: they are `secrecy` types and are not
//! recorded as fields.

use std::sync::OnceLock;

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

pub use opentelemetry::Context;

/// The exporter's provider, flushed by [`shutdown`].
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Whether spans are exported: the OTLP endpoint is configured.
pub fn exporting() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|name| std::env::var(name).is_ok_and(|v| !v.is_empty()))
}

/// Installs the subscriber. `service` names this process in its spans
/// (`service.name`, e.g. `rialto-gateway`); `OTEL_SERVICE_NAME` wins.
pub fn init(format: &str, level: &str, service: &str) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let otel = exporting()
        .then(|| tracer_provider(service))
        .flatten()
        .map(|provider| {
            let tracer = provider.tracer("rialto");
            let _ = PROVIDER.set(provider);
            tracing_opentelemetry::layer().with_tracer(tracer)
        });
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stdout);
    let registry = tracing_subscriber::registry().with(filter).with(otel);
    // A second init (tests) is harmless: keep the first subscriber.
    let _ = if format == "json" {
        registry.with(fmt.json()).try_init()
    } else {
        registry.with(fmt).try_init()
    };
}

fn tracer_provider(service: &str) -> Option<SdkTracerProvider> {
    // The endpoint, headers, timeout and batching come from the standard
    // OTEL_* variables.
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpJson)
        .build()
    {
        Ok(exporter) => exporter,
        Err(error) => {
            eprintln!("rialto: OTLP exporter not started: {error}");
            return None;
        }
    };
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_owned());
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(name)
        .build();
    Some(
        SdkTracerProvider::builder()
            .with_resource(resource)
            .with_batch_exporter(exporter)
            .build(),
    )
}

/// Flushes the spans not yet exported; call once before the process exits.
pub fn shutdown() {
    if let Some(provider) = PROVIDER.get() {
        let _ = provider.shutdown();
    }
}

/// The trace context a carrier (HTTP headers, gRPC metadata, NATS headers)
/// brings, through `get`.
pub fn extract(get: impl Fn(&str) -> Option<String>) -> Context {
    struct Carrier {
        traceparent: Option<String>,
        tracestate: Option<String>,
    }
    impl Extractor for Carrier {
        fn get(&self, key: &str) -> Option<&str> {
            match key {
                "traceparent" => self.traceparent.as_deref(),
                "tracestate" => self.tracestate.as_deref(),
                _ => None,
            }
        }
        fn keys(&self) -> Vec<&str> {
            vec!["traceparent", "tracestate"]
        }
    }
    let carrier = Carrier {
        traceparent: get("traceparent"),
        tracestate: get("tracestate"),
    };
    if carrier.traceparent.is_none() {
        return Context::new();
    }
    opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&carrier))
}

/// Sets `span`'s parent to the context a carrier brought (no-op when it
/// brought none).
pub fn set_parent(span: &tracing::Span, parent: Context) {
    let _ = span.set_parent(parent);
}

/// The current span's trace context as `(name, value)` pairs to send
/// (`traceparent`, `tracestate`): nothing when spans are not exported.
pub fn inject_current() -> Vec<(&'static str, String)> {
    struct Pairs(Vec<(&'static str, String)>);
    impl Injector for Pairs {
        fn set(&mut self, key: &str, value: String) {
            let key = match key {
                "traceparent" => "traceparent",
                "tracestate" => "tracestate",
                _ => return,
            };
            self.0.push((key, value));
        }
    }
    if PROVIDER.get().is_none() {
        return Vec::new();
    }
    let context = tracing::Span::current().context();
    let mut pairs = Pairs(Vec::new());
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut pairs);
    });
    pairs.0
}

/// The machine's host name, for `x-<brand>-host-name`.
pub fn host_name() -> String {
    gethostname::gethostname().to_string_lossy().into_owned()
}
