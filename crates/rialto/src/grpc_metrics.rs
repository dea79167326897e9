//! A tower layer on the gRPC server: every call runs in a span whose parent
//! is the caller's trace (W3C `traceparent` in the metadata), and its
//! method, status code and time to its response head go to the process's
//! metrics.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use rialto_core::metrics::{GrpcLabels, metrics};

#[derive(Debug, Clone, Copy)]
pub struct GrpcMetricsLayer;

impl<S> tower::Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetrics(inner)
    }
}

#[derive(Debug, Clone)]
pub struct GrpcMetrics<S>(S);

impl<S, B, R> tower::Service<http::Request<B>> for GrpcMetrics<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = request.uri().path().to_owned();
        let started = Instant::now();
        // `/rialto.router.v1.Router/Chat`: service `rialto.router.v1.Router`,
        // method `Chat` (OpenTelemetry's RPC conventions).
        let (rpc_service, rpc_method) = method
            .trim_start_matches('/')
            .split_once('/')
            .unwrap_or((method.as_str(), ""));
        let span = tracing::info_span!(
            "grpc",
            otel.name = %method.trim_start_matches('/'),
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            rpc.system = "grpc",
            rpc.service = rpc_service,
            rpc.method = rpc_method,
            rpc.grpc.status_code = tracing::field::Empty,
        );
        let headers = request.headers();
        let parent = rialto_core::telemetry::extract(|name| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
        rialto_core::telemetry::set_parent(&span, parent);
        let call = {
            let _entered = span.enter();
            self.0.call(request)
        };
        Box::pin(tracing::Instrument::instrument(
            async move {
                let response = call.await;
                // An error status comes in the head (trailers-only); a success
                // leaves it to the trailers: no status in the head is OK.
                let number = match &response {
                    Ok(response) => response
                        .headers()
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<i32>().ok())
                        .unwrap_or(0),
                    Err(_) => 2,
                };
                let code = code_name(number);
                let span = tracing::Span::current();
                span.record("rpc.grpc.status_code", number);
                // Server errors only (UNKNOWN, DEADLINE_EXCEEDED,
                // UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS): a
                // refusal is the caller's, not the server's.
                if matches!(number, 2 | 4 | 12 | 13 | 14 | 15) {
                    span.record("otel.status_code", "ERROR");
                }
                metrics().record_grpc(
                    GrpcLabels {
                        service: service_of(&method),
                        method,
                        code,
                    },
                    started.elapsed().as_secs_f64(),
                );
                response
            },
            span,
        ))
    }
}

/// `/rialto.router.v1.Router/Chat` -> `router`; `grpc.health.v1...` -> `health`.
fn service_of(path: &str) -> &'static str {
    let service = path.trim_start_matches('/').split('/').next().unwrap_or("");
    match service {
        "rialto.auth.v1.Auth" => "auth",
        "rialto.limiter.v1.Limiter" => "limiter",
        "rialto.billing.v1.Billing" => "billing",
        "rialto.router.v1.Router" => "router",
        "grpc.health.v1.Health" => "health",
        _ => "other",
    }
}

fn code_name(code: i32) -> &'static str {
    match code {
        0 => "OK",
        1 => "CANCELLED",
        2 => "UNKNOWN",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        5 => "NOT_FOUND",
        6 => "ALREADY_EXISTS",
        7 => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        9 => "FAILED_PRECONDITION",
        10 => "ABORTED",
        11 => "OUT_OF_RANGE",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        15 => "DATA_LOSS",
        16 => "UNAUTHENTICATED",
        _ => "UNKNOWN",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn services_and_codes_have_bounded_names() {
        assert_eq!(service_of("/rialto.router.v1.Router/Chat"), "router");
        assert_eq!(service_of("/grpc.health.v1.Health/Check"), "health");
        assert_eq!(service_of("/x.Y/Z"), "other");
        assert_eq!(code_name(14), "UNAVAILABLE");
        assert_eq!(code_name(99), "UNKNOWN");
    }
}
