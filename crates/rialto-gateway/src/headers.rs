//! Headers every response carries, and the request id that ties a response
//! to its log lines.

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Instant;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{CONTENT_ENCODING, HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{HttpMessage, web};
use rialto_core::Brand;
use rialto_core::hashing::HashMap;
use rialto_core::metrics::{HttpHandles, HttpLabels};
use tracing::Instrument;

use crate::limits::{AbuseCheck, AbuseSubjects};
use crate::{Authenticated, BalanceHeaders, Gateway, RateLimitHeaders};

/// The request id (`CF-RAY`), stored in the request's extensions.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

impl RequestId {
    /// The id `stamp` gave `request` (a fresh one outside the middleware).
    pub fn of(request: &actix_web::HttpRequest) -> String {
        request
            .extensions()
            .get::<RequestId>()
            .map(|id| id.0.clone())
            .unwrap_or_else(rialto_core::ids::request_id)
    }
}

/// Header names and values computed once at start.
#[derive(Debug)]
pub struct Stamp {
    version_name: HeaderName,
    version: HeaderValue,
    host_name_name: HeaderName,
    host_name: HeaderValue,
    pub model_id: HeaderName,
    pub model_name: HeaderName,
    pub model_router: HeaderName,
    pub deprecation_warning: HeaderName,
    pub deprecation_date: HeaderName,
    pub balance_usd: HeaderName,
    pub balance_diem: HeaderName,
    timestamp: HeaderName,
    request_timestamp_ms: HeaderName,
}

impl Stamp {
    pub fn new(brand: &Brand, revision: &str, host_name: &str) -> anyhow::Result<Self> {
        let name = |n: &str| HeaderName::from_bytes(n.as_bytes());
        Ok(Self {
            version_name: name(&brand.header_version)?,
            version: HeaderValue::from_str(revision)?,
            host_name_name: name(&brand.header_host_name)?,
            host_name: HeaderValue::from_str(host_name)?,
            model_id: name(&brand.header_model_id)?,
            model_name: name(&brand.header_model_name)?,
            model_router: name(&brand.header_model_router)?,
            deprecation_warning: name(&brand.header_model_deprecation_warning)?,
            deprecation_date: name(&brand.header_model_deprecation_date)?,
            balance_usd: name(&brand.header_balance_usd)?,
            balance_diem: name(&brand.header_balance_diem)?,
            timestamp: name(&brand.header_timestamp)?,
            request_timestamp_ms: name(&brand.header_request_timestamp_ms)?,
        })
    }
}

const CF_RAY: HeaderName = HeaderName::from_static("cf-ray");
/// Looked up in every request: a name, not a string to parse each time.
static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// Middleware: assigns the request id, refuses callers the abuse guard
/// blocks (before anything else), runs the request in a span that carries
/// its id, stamps the common and rate-limit headers, counts failures,
/// records the request's metrics and logs one line per request.
pub async fn stamp(
    request: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let request_id = rialto_core::ids::request_id();
    request
        .extensions_mut()
        .insert(RequestId(request_id.clone()));
    // The span's name is fixed when it starts, before routing: the path
    // names it only where it carries no id (a wallet, a key, a slug);
    // `http.route` is recorded once the route is known.
    let raw_path = request.path();
    // Attributes by OpenTelemetry's semantic conventions (HTTP, and GenAI
    // for the inference routes, which record theirs as they learn them:
    // [`record_gen_ai`]). The span's fields are also the context of the
    // request's log line; `otel.*` are for the exporter alone, so they are
    // recorded only when spans are exported (an empty field is not
    // formatted into the line, and the name's `format!` is not made).
    let span = tracing::info_span!(
        "request",
        otel.name = tracing::field::Empty,
        otel.kind = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        http.request.method = %request.method(),
        url.path = %raw_path,
        http.route = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        gen_ai.operation.name = tracing::field::Empty,
        gen_ai.request.model = tracing::field::Empty,
        gen_ai.response.model = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        request_id = %request_id,
    );
    if rialto_core::telemetry::spans_exported() {
        let dynamic = ["/x402/", "/api_keys/", "/characters/", "/admin/"]
            .iter()
            .any(|part| raw_path.contains(part));
        let name = if dynamic {
            request.method().to_string()
        } else {
            format!("{} {raw_path}", request.method())
        };
        // Before the span starts (its parent is set below): the exporter
        // takes its name and kind from these.
        span.record("otel.name", name);
        span.record("otel.kind", "server");
    }
    // A caller's trace (W3C `traceparent`) goes on here.
    let headers = request.headers();
    let parent = rialto_core::telemetry::extract(|name| {
        let value = match name {
            "traceparent" => headers.get(&TRACEPARENT),
            name => headers.get(name),
        };
        value.and_then(|v| v.to_str().ok()).map(str::to_owned)
    });
    rialto_core::telemetry::set_parent(&span, parent);
    let method = request.method().clone();
    let path = request.path().to_owned();
    let started = Instant::now();
    let gateway = request.app_data::<web::Data<Gateway>>().cloned();
    // The client's own request time, echoed (a number, or nothing).
    let client_time = gateway.as_ref().and_then(|gateway| {
        request
            .headers()
            .get(&gateway.stamp.request_timestamp_ms)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<i64>().ok())
    });
    // Everything is guarded but the probes and the document (a load
    // balancer's health checks must not lock themselves out). Exact raw
    // paths: an encoded spelling of a route is guarded like the route.
    let guarded = !matches!(path.as_str(), "/healthz" | "/readyz" | "/openapi.yaml");
    let subjects = gateway
        .as_ref()
        .filter(|_| guarded)
        .map(|gateway| AbuseSubjects::of(gateway, &request));
    let refusal = match (&gateway, &subjects) {
        (Some(gateway), Some(subjects)) => match subjects.check(gateway) {
            AbuseCheck::Clear => None,
            AbuseCheck::Blocked(refusal) => Some(refusal),
            // Its address is blocked: the request goes on only with the
            // operator token or a credential that authenticated here
            // recently; nothing else runs, not even a key lookup.
            AbuseCheck::UnlessAuthenticated(refusal) => {
                let operator = crate::operator::is_operator(gateway, request.headers());
                (!operator && !subjects.is_vouched(gateway)).then_some(refusal)
            }
        },
        _ => None,
    };
    let mut response = match refusal {
        Some(refusal) => {
            let (request, _) = request.into_parts();
            refusal.respond(request)
        }
        None => {
            let response = next.call(request).instrument(span.clone()).await?;
            let status = response.status().as_u16();
            let extensions = response.request().extensions();
            if let (Some(gateway), Some(subjects)) = (&gateway, &subjects) {
                let authenticated = extensions.get::<Authenticated>();
                subjects.record(gateway, status, authenticated, &path);
            }
            let rate = extensions.get::<RateLimitHeaders>().cloned();
            let balance = extensions.get::<BalanceHeaders>().cloned();
            drop(extensions);
            let mut response = response.map_into_left_body();
            if let Some(RateLimitHeaders(values)) = rate {
                crate::limits::write_headers(response.headers_mut(), &values, status == 429);
            }
            if let (Some(balance), Some(gateway)) = (balance, &gateway) {
                let headers = response.headers_mut();
                for (name, value) in [
                    (&gateway.stamp.balance_usd, balance.usd),
                    (&gateway.stamp.balance_diem, balance.diem),
                ] {
                    if let Ok(value) = HeaderValue::from_str(&value) {
                        headers.insert(name.clone(), value);
                    }
                }
            }
            response
        }
    };
    let status = response.status().as_u16();
    // The route's pattern, never the raw path: a metric label's values
    // must stay few.
    let route = route_of(response.request());
    tracing::record_all!(span, http.route = route, http.response.status_code = status);
    if status >= 500 && rialto_core::telemetry::spans_exported() {
        span.record("otel.status_code", "ERROR");
    }
    record_http(
        route,
        method_label(&method),
        status,
        started.elapsed().as_secs_f64(),
    );
    let headers = response.headers_mut();
    // Streams carry `Content-Encoding: identity` only to keep the Compress
    // middleware (which runs inside this one) off them; identity is the
    // default, and the spec allows only gzip or br in this header.
    if headers
        .get(CONTENT_ENCODING)
        .is_some_and(|v| v.as_bytes() == b"identity")
    {
        headers.remove(CONTENT_ENCODING);
    }
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        headers.insert(CF_RAY, value);
    }
    if let Some(gateway) = gateway {
        let stamp = &gateway.stamp;
        headers.insert(stamp.version_name.clone(), stamp.version.clone());
        headers.insert(stamp.host_name_name.clone(), stamp.host_name.clone());
        if let Some(value) = timestamp_now() {
            headers.insert(stamp.timestamp.clone(), value);
        }
        if let Some(time) = client_time {
            headers.insert(stamp.request_timestamp_ms.clone(), HeaderValue::from(time));
        }
    }
    // The line is written, and the span closed (exported, with
    // OpenTelemetry), by a task of this worker's that runs once the
    // dispatcher's turn that writes the response is over: their formatting
    // is not on the path of the answer or of a stream's first chunk.
    // With neither the line nor the span wanted, there is nothing to defer:
    // no task is spawned, and the disabled span drops here.
    if span.is_disabled() && !tracing::enabled!(tracing::Level::INFO) {
        return Ok(response);
    }
    let elapsed_us = started.elapsed().as_micros() as u64;
    actix_web::rt::spawn(async move {
        if span.is_disabled() {
            tracing::info!(%method, path, status, elapsed_us, "request served");
        } else {
            // The method, path and status are the span's fields, which
            // begin the line: not written twice.
            span.in_scope(|| tracing::info!(elapsed_us, "request served"));
        }
    });
    Ok(response)
}

thread_local! {
    /// The last `x-<brand>-timestamp` this thread formatted, by its
    /// millisecond: responses of one millisecond share it.
    static TIMESTAMP: RefCell<(i64, Option<HeaderValue>)> = const { RefCell::new((0, None)) };
}

/// The server's time as `x-<brand>-timestamp` says it (ISO 8601, ms).
fn timestamp_now() -> Option<HeaderValue> {
    let now = chrono::Utc::now();
    let ms = now.timestamp_millis();
    TIMESTAMP.with(|cached| {
        let mut cached = cached.borrow_mut();
        if cached.0 != ms || cached.1.is_none() {
            let text = now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
            *cached = (ms, HeaderValue::from_str(&text).ok());
        }
        cached.1.clone()
    })
}

/// What this thread has resolved for the HTTP metrics: the route pattern of
/// each raw path that is its own pattern (a route without parameters, such
/// as `/api/v1/chat/completions`), and the metric handles of each (route,
/// method, status) it has served. Per thread (actix-web's workers each run
/// on one), so a hit takes no lock; both maps are bounded by the routes
/// (paths that are not a pattern are never keys), the methods and the
/// statuses.
#[derive(Default)]
struct RouteMetrics {
    patterns: HashMap<Box<str>, &'static str>,
    handles: HashMap<(&'static str, &'static str, u16), HttpHandles>,
}

thread_local! {
    static ROUTE_METRICS: RefCell<RouteMetrics> = RefCell::default();
}

/// The route pattern `request` matched, or `unmatched`. A path that is its
/// own pattern is found in this thread's map (no allocation, no matching);
/// any other path is matched by actix's `match_pattern` (which builds a
/// String) and its pattern interned.
fn route_of(request: &actix_web::HttpRequest) -> &'static str {
    let path = request.path();
    if let Some(route) = ROUTE_METRICS.with_borrow(|cache| cache.patterns.get(path).copied()) {
        return route;
    }
    let Some(pattern) = request.match_pattern() else {
        return "unmatched";
    };
    let route = intern(&pattern);
    // Which route a path matches depends on the path alone (guards do not
    // take part in `match_pattern`), so the answer can be kept.
    if pattern == path {
        ROUTE_METRICS.with_borrow_mut(|cache| {
            cache.patterns.insert(path.into(), route);
        });
    }
    route
}

/// One `&'static str` per route pattern, for the whole process: there are
/// as many as the routes `configure` lists, so leaking them is bounded.
fn intern(pattern: &str) -> &'static str {
    static PATTERNS: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let mut patterns = PATTERNS.lock().unwrap_or_else(|e| e.into_inner());
    let patterns = patterns.get_or_insert_with(HashSet::new);
    if let Some(interned) = patterns.get(pattern) {
        return interned;
    }
    let interned: &'static str = Box::leak(pattern.into());
    patterns.insert(interned);
    interned
}

/// Counts one request in `rialto_http_requests_total` and
/// `rialto_http_request_duration_seconds`: after the first request of a
/// (route, method, status) on this thread, an increment and an observation
/// on handles kept here, with no family lookup and no allocation.
fn record_http(route: &'static str, method: &'static str, status: u16, seconds: f64) {
    ROUTE_METRICS.with_borrow_mut(|cache| {
        cache
            .handles
            .entry((route, method, status))
            .or_insert_with(|| {
                rialto_core::metrics::metrics().http_handles(&HttpLabels {
                    service: "gateway",
                    route: route.to_owned(),
                    method,
                    status,
                })
            })
            .record(seconds);
    });
}

/// A method as a metric label (static: no allocation per request).
fn method_label(method: &actix_web::http::Method) -> &'static str {
    use actix_web::http::Method;
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "OTHER",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::{App, HttpResponse, test};

    fn count(text: &str, route: &str, status: u16) -> Option<u64> {
        let series = format!(
            r#"rialto_http_requests_total{{service="gateway",route="{route}",method="GET",status="{status}"}} "#
        );
        text.lines()
            .find_map(|line| line.strip_prefix(series.as_str()))
            .and_then(|value| value.trim().parse().ok())
    }

    #[actix_web::test]
    async fn requests_are_counted_by_route_pattern_with_handles_resolved_once() {
        let app = test::init_service(
            App::new()
                .wrap(actix_web::middleware::from_fn(stamp))
                .route(
                    "/stamp-test/plain",
                    web::get().to(|| async { HttpResponse::Ok().finish() }),
                )
                .route(
                    "/stamp-test/things/{id}",
                    web::get().to(|| async { HttpResponse::Accepted().finish() }),
                ),
        )
        .await;
        for uri in [
            "/stamp-test/plain",
            "/stamp-test/plain",
            "/stamp-test/plain",
            "/stamp-test/things/1",
            "/stamp-test/things/2",
        ] {
            let response =
                test::call_service(&app, test::TestRequest::get().uri(uri).to_request()).await;
            assert!(response.status().is_success(), "{uri}");
        }
        let text = rialto_core::metrics::metrics().render();
        assert_eq!(count(&text, "/stamp-test/plain", 200), Some(3), "{text}");
        assert_eq!(
            count(&text, "/stamp-test/things/{id}", 202),
            Some(2),
            "{text}"
        );
        assert!(
            text.contains(r#"rialto_http_request_duration_seconds_count{service="gateway",route="/stamp-test/plain",method="GET",status="200"} 3"#),
            "{text}"
        );
        // The parameterless route's path is remembered, the others' are not.
        ROUTE_METRICS.with_borrow(|cache| {
            assert_eq!(
                cache.patterns.get("/stamp-test/plain"),
                Some(&"/stamp-test/plain")
            );
            assert!(!cache.patterns.contains_key("/stamp-test/things/1"));
            assert!(
                cache
                    .handles
                    .contains_key(&("/stamp-test/things/{id}", "GET", 202))
            );
        });
        // One interned string per pattern.
        assert!(std::ptr::eq(
            intern("/stamp-test/things/{id}"),
            intern("/stamp-test/things/{id}")
        ));
    }

    #[actix_web::test]
    async fn an_unmatched_path_is_one_label_and_never_a_key() {
        let app = test::init_service(App::new().wrap(actix_web::middleware::from_fn(stamp))).await;
        let response = test::call_service(
            &app,
            test::TestRequest::get()
                .uri("/stamp-test/nowhere/42")
                .to_request(),
        )
        .await;
        assert_eq!(response.status().as_u16(), 404);
        let text = rialto_core::metrics::metrics().render();
        assert!(
            count(&text, "unmatched", 404).is_some_and(|n| n >= 1),
            "{text}"
        );
        ROUTE_METRICS.with_borrow(|cache| {
            assert!(!cache.patterns.contains_key("/stamp-test/nowhere/42"));
        });
    }
}
