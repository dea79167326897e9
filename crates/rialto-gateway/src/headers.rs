//! Headers every response carries, and the request id that ties a response
//! to its log lines.

use std::time::Instant;

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{CONTENT_ENCODING, HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{HttpMessage, web};
use rialto_core::Brand;
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
        })
    }
}

const CF_RAY: HeaderName = HeaderName::from_static("cf-ray");

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
    let dynamic = ["/x402/", "/api_keys/", "/characters/", "/admin/"]
        .iter()
        .any(|part| raw_path.contains(part));
    let name = if dynamic {
        request.method().to_string()
    } else {
        format!("{} {raw_path}", request.method())
    };
    let span = tracing::info_span!(
        "request",
        otel.name = %name,
        otel.kind = "server",
        http.route = tracing::field::Empty,
        request_id = %request_id,
    );
    // A caller's trace (W3C `traceparent`) goes on here.
    let headers = request.headers();
    let parent = rialto_core::telemetry::extract(|name| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    rialto_core::telemetry::set_parent(&span, parent);
    let method = request.method().clone();
    let path = request.path().to_owned();
    let started = Instant::now();
    let gateway = request.app_data::<web::Data<Gateway>>().cloned();
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
    let route = response
        .request()
        .match_pattern()
        .unwrap_or_else(|| "unmatched".to_owned());
    span.record("http.route", route.as_str());
    rialto_core::metrics::metrics().record_http(
        rialto_core::metrics::HttpLabels {
            service: "gateway",
            route,
            method: method_label(&method),
            status,
        },
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
    }
    span.in_scope(|| {
        tracing::info!(
            %method,
            path,
            status,
            elapsed_us = started.elapsed().as_micros() as u64,
            "request served"
        );
    });
    Ok(response)
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
