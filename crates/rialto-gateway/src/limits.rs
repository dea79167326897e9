//! The limits endpoints (`GET /api_keys/rate_limits`, the rate-limit log
//! under both of its paths), the `x-ratelimit-*` headers, and the abuse
//! guard's place in the request path.

use std::time::Instant;

use actix_web::body::EitherBody;
use actix_web::dev::ServiceResponse;
use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};
use actix_web::{HttpRequest, HttpResponse, ResponseError, web};
use chrono::{DateTime, Duration as ChronoDuration, SecondsFormat, Utc};
use rialto_core::ErrorCode;
use rialto_limiter::abuse::{AbuseGuard, Recorded, Subject, is_failure};
use rialto_limiter::{RateHeaders, Target};
use rialto_proto::auth::v1 as auth_pb;
use rialto_proto::billing::v1 as billing_pb;
use rialto_proto::limiter::v1 as limiter_pb;
use serde_json::{Value, json};

use crate::{ApiError, Authenticated, Gateway, authenticate_endpoint, caller};

const LIMIT_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
const REMAINING_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-requests");
const RESET_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");
const LIMIT_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
const REMAINING_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
const RESET_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");
const LIMIT_TYPE: HeaderName = HeaderName::from_static("x-ratelimit-type");
const RETRY_AFTER: HeaderName = HeaderName::from_static("retry-after");

/// Writes the `x-ratelimit-*` headers; on a 429 also `Retry-After`.
pub fn write_headers(headers: &mut HeaderMap, values: &RateHeaders, refused: bool) {
    let number = |n: i64| HeaderValue::from(n);
    let count = |n: u64| HeaderValue::from(n);
    headers.insert(
        LIMIT_REQUESTS,
        steady(Steady::LimitRequests, values.limit_requests.into()),
    );
    headers.insert(REMAINING_REQUESTS, count(values.remaining_requests));
    headers.insert(
        RESET_REQUESTS,
        steady(Steady::ResetRequests, values.reset_requests.into()),
    );
    if let Some(tokens) = &values.tokens {
        headers.insert(
            LIMIT_TOKENS,
            steady(Steady::LimitTokens, tokens.limit.into()),
        );
        headers.insert(REMAINING_TOKENS, count(tokens.remaining));
        headers.insert(
            RESET_TOKENS,
            steady(Steady::ResetTokens, tokens.reset_secs.into()),
        );
    }
    headers.insert(LIMIT_TYPE, HeaderValue::from_static(values.scope.as_str()));
    if refused {
        let wait = (values.reset_requests - Utc::now().timestamp()).max(1);
        headers.insert(RETRY_AFTER, number(wait));
    }
}

/// The rate-limit headers whose numbers stay the same from one response
/// to the next (a tier's limits; a window's reset, for a second at least).
#[derive(Clone, Copy)]
enum Steady {
    LimitRequests,
    ResetRequests,
    LimitTokens,
    ResetTokens,
}

thread_local! {
    /// This thread's last value of each [`Steady`] header, with its number:
    /// shared (a reference count) while the number stays, instead of a
    /// number formatted into a new allocation for every response.
    static STEADY: std::cell::RefCell<[(i128, Option<HeaderValue>); 4]> =
        const { std::cell::RefCell::new([const { (0, None) }; 4]) };
}

/// The value of `slot`'s header for `number` (any `u64` or `i64`), made
/// when it is not this thread's last.
fn steady(slot: Steady, number: i128) -> HeaderValue {
    STEADY.with(|cache| {
        let mut cache = cache.borrow_mut();
        let (last, value) = &mut cache[slot as usize];
        match value {
            Some(value) if *last == number => value.clone(),
            _ => {
                // Not an `i64`: a `u64` past `i64::MAX`.
                let fresh = i64::try_from(number)
                    .map_or_else(|_| HeaderValue::from(number as u64), HeaderValue::from);
                *last = number;
                *value = Some(fresh.clone());
                fresh
            }
        }
    })
}

/// What the abuse guard says before a request runs.
pub enum AbuseCheck {
    Clear,
    Blocked(AbuseRefusal),
    /// The client address is blocked: refuse unless the request's
    /// credentials are good.
    UnlessAuthenticated(AbuseRefusal),
}

/// The 429 of a blocked caller.
pub struct AbuseRefusal {
    error: ApiError,
    headers: RateHeaders,
}

impl AbuseRefusal {
    pub fn respond<B>(self, request: HttpRequest) -> ServiceResponse<EitherBody<B>> {
        let mut response = self.error.error_response();
        write_headers(response.headers_mut(), &self.headers, true);
        ServiceResponse::new(request, response).map_into_right_body()
    }
}

/// Who a request is, for the abuse guard, before authentication: the
/// fingerprint of its credential, and its client address.
pub struct AbuseSubjects {
    credential: Option<Subject>,
    address: Option<Subject>,
    started: Instant,
}

impl AbuseSubjects {
    pub fn of(gateway: &Gateway, request: &actix_web::dev::ServiceRequest) -> Self {
        let credential = crate::bearer_token(request.headers())
            .map(|token| gateway.abuse.credential(token.as_bytes()));
        let forwarded = gateway.client_address_header.as_ref().and_then(|name| {
            // The last line of the header: a proxy that adds its own line
            // leaves the client's lines before it.
            let value = request.headers().get_all(name).last()?;
            forwarded_address(value.as_bytes())
        });
        let address = forwarded
            .or_else(|| request.peer_addr().map(|a| a.ip()))
            .map(AbuseGuard::address);
        Self {
            credential,
            address,
            started: Instant::now(),
        }
    }

    /// Whether the request's credential authenticated here recently.
    pub fn is_vouched(&self, gateway: &Gateway) -> bool {
        self.credential
            .is_some_and(|c| gateway.abuse.is_vouched(&c, self.started))
    }

    /// Checked before anything else: a blocked credential is refused; a
    /// blocked address is refused unless the request brings good
    /// credentials (an address may be a proxy or a NAT shared with
    /// well-behaved callers).
    pub fn check(&self, gateway: &Gateway) -> AbuseCheck {
        let guard = &gateway.abuse;
        let blocked = |subject: &Option<Subject>| {
            subject
                .as_ref()
                .and_then(|s| guard.blocked_until(s, self.started))
        };
        if let Some(until) = blocked(&self.credential) {
            return AbuseCheck::Blocked(self.refusal(gateway, until));
        }
        match (blocked(&self.address), self.credential) {
            (Some(until), None) => AbuseCheck::Blocked(self.refusal(gateway, until)),
            (Some(until), Some(_)) => AbuseCheck::UnlessAuthenticated(self.refusal(gateway, until)),
            (None, _) => AbuseCheck::Clear,
        }
    }

    fn refusal(&self, gateway: &Gateway, until: Instant) -> AbuseRefusal {
        let guard = &gateway.abuse;
        let wait = until.saturating_duration_since(self.started);
        let reset = Utc::now().timestamp() + wait.as_secs_f64().ceil() as i64;
        let error = too_many_failures(guard, guard.block());
        let headers = RateHeaders {
            scope: rialto_limiter::Scope::ApiKey,
            limit_requests: guard.threshold() as u64,
            remaining_requests: 0,
            reset_requests: reset,
            tokens: None,
        };
        AbuseRefusal { error, headers }
    }

    /// Vouches for a credential that authenticated, and counts a finished
    /// request that failed; a block that starts now is logged as a
    /// FAILED_REQUESTS hit of the account.
    pub fn record(
        &self,
        gateway: &Gateway,
        status: u16,
        authenticated: Option<&Authenticated>,
        path: &str,
    ) {
        if let (Some(_), Some(credential)) = (authenticated, self.credential) {
            gateway.abuse.vouch(credential, Instant::now());
        }
        if !is_failure(status) {
            return;
        }
        let subjects = match authenticated {
            // A signed-in wallet brings no credential to fingerprint: its
            // address counts, and so does the client's (a new wallet costs
            // nothing to make).
            Some(who) if self.credential.is_none() => {
                [Some(wallet_subject(gateway, &who.account_id)), self.address]
            }
            Some(_) => [self.credential, None],
            None => [self.address, None],
        };
        let now = Instant::now();
        let blocked = subjects
            .into_iter()
            .flatten()
            .fold(false, |blocked, subject| {
                (gateway.abuse.record_failure(subject, now) == Recorded::Blocked) | blocked
            });
        if blocked {
            tracing::warn!(path, "too many failed requests: blocking the caller");
            if let Some(who) = authenticated {
                gateway.services.limiter.record_hit(limiter_pb::LimitHit {
                    account_id: who.account_id.clone(),
                    api_key_id: who.key_id.clone(),
                    model_id: format!("endpoint:{}", path.trim_start_matches('/')),
                    tier: who.tier.clone(),
                    limit_type: "FAILED_REQUESTS".to_owned(),
                    at_ms: rialto_core::db::now_ms(),
                });
            }
        }
    }
}

/// The abuse guard's subject for a signed-in wallet (`wallet:<address>`).
fn wallet_subject(gateway: &Gateway, owner: &str) -> Subject {
    gateway.abuse.credential(owner.as_bytes())
}

/// A 429 when a signed-in wallet (`wallet:<address>`) failed too often of
/// late: checked once its signature is, since only then is the address
/// known (a claimed one could block somebody else's wallet).
pub fn refuse_blocked_wallet(gateway: &Gateway, owner: &str) -> Result<(), ApiError> {
    let now = Instant::now();
    match gateway
        .abuse
        .blocked_until(&wallet_subject(gateway, owner), now)
    {
        None => Ok(()),
        Some(until) => Err(too_many_failures(
            &gateway.abuse,
            until.saturating_duration_since(now),
        )),
    }
}

/// The abuse guard's 429, in the hosted API's words.
fn too_many_failures(guard: &AbuseGuard, wait: std::time::Duration) -> ApiError {
    ApiError::new(
        ErrorCode::RateLimited,
        format!(
            "Too many failed attempts (> {}) resulting in a non-success status code. \
             Please wait {}s and try again.",
            guard.threshold(),
            wait.as_secs().max(1)
        ),
    )
}

/// The client address in a proxy's header: only the last element, the one
/// the trusted proxy appended (`1.2.3.4`, `1.2.3.4:5678`, `::1` or
/// `[::1]:5678`). Anything to its left came from the client.
fn forwarded_address(value: &[u8]) -> Option<std::net::IpAddr> {
    // Split on bytes: only the last element needs to be readable.
    let last = value.rsplit(|b| *b == b',').next()?;
    let last = std::str::from_utf8(last).ok()?.trim();
    if let Ok(address) = last.parse::<std::net::IpAddr>() {
        return Some(address);
    }
    last.parse::<std::net::SocketAddr>().ok().map(|a| a.ip())
}

/// The next UTC midnight: when daily limits reset (`nextEpochBegins`).
fn next_epoch() -> String {
    let now = Utc::now();
    let midnight = now
        .date_naive()
        .and_hms_opt(0, 0, 0)
        .map(|t| t.and_utc() + ChronoDuration::days(1))
        .unwrap_or(now);
    iso(midnight)
}

fn iso(time: DateTime<Utc>) -> String {
    time.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// `GET /api/v1/api_keys/rate_limits`: the calling key's limits per model.
pub async fn rate_limits(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate_endpoint(&gateway, &request, false).await?;
    let key = gateway
        .services
        .auth
        .get_api_key(auth_pb::GetApiKeyRequest {
            account_id: principal.account_id.clone(),
            id: principal.key_id.clone(),
        })
        .await?;
    let balance = gateway
        .services
        .billing
        .get_balance(billing_pb::GetBalanceRequest {
            owner: crate::ledger_owner(&principal),
        })
        .await?;
    let policy = gateway.services.limiter.policy();
    let rate_limits: Vec<Value> = gateway
        .catalog()
        .models
        .iter()
        .map(|model| {
            let limits = match policy.key_limit(caller(&principal), Target::model(&model.config)) {
                Some(limit) => {
                    let mut list = vec![json!({"type": "RPM", "amount": limit.rpm})];
                    if let Some(rpd) = limit.rpd {
                        list.push(json!({"type": "RPD", "amount": rpd}));
                    }
                    if let Some(tpm) = limit.tpm {
                        list.push(json!({"type": "TPM", "amount": tpm}));
                    }
                    list
                }
                None => Vec::new(),
            };
            json!({"apiModelId": model.config.id, "rateLimits": limits})
        })
        .collect();
    let key_expiration = key
        .expires_at_ms
        .and_then(DateTime::from_timestamp_millis)
        .map(iso);
    Ok(HttpResponse::Ok().json(json!({
        "data": {
            "accessPermitted": true,
            "apiTier": {"id": principal.tier, "isCharged": true},
            "balances": {"USD": decimal(&balance.usd), "DIEM": decimal(&balance.diem)},
            "keyExpiration": key_expiration,
            "nextEpochBegins": next_epoch(),
            "rateLimits": rate_limits,
        }
    })))
}

/// A decimal string as a JSON number, digit for digit.
fn decimal(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or(json!(0))
}

/// `GET /api/v1/billing/balance` (ADMIN key): the account's balances in the
/// hosted API's shape, as booked (credit held by requests in flight is
/// still included).
pub async fn billing_balance(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate_endpoint(&gateway, &request, true).await?;
    let balance = gateway
        .services
        .billing
        .get_balance(billing_pb::GetBalanceRequest {
            owner: crate::ledger_owner(&principal),
        })
        .await?;
    let diem = decimal(&balance.diem);
    let usd = decimal(&balance.usd);
    let positive = |v: &Value| v.as_f64().is_some_and(|n| n > 0.0);
    let currency = if positive(&diem) {
        json!("DIEM")
    } else if positive(&usd) {
        json!("USD")
    } else {
        Value::Null
    };
    Ok(HttpResponse::Ok().json(json!({
        "canConsume": !currency.is_null(),
        "consumptionCurrency": currency,
        "balances": {"diem": diem, "usd": usd},
        "diemEpochAllocation": decimal(&balance.diem_per_day),
    })))
}

/// `GET /api/v1/api_keys/rate_limits/log` (and `/api_keys/rate_limit_logs`):
/// the account's last 50 limit hits, newest first. ADMIN keys only.
pub async fn log(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate_endpoint(&gateway, &request, true).await?;
    let data = hits_json(&gateway, &principal.account_id).await?;
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

/// An account's last limit hits, newest first, in the hosted shape.
pub(crate) async fn hits_json(gateway: &Gateway, account_id: &str) -> Result<Vec<Value>, ApiError> {
    let hits = gateway.services.limiter.recent_hits(account_id).await?;
    Ok(hits
        .into_iter()
        .map(|hit| {
            let timestamp = DateTime::from_timestamp_millis(hit.at_ms)
                .map(iso)
                .unwrap_or_default();
            json!({
                "apiKeyId": hit.api_key_id,
                "modelId": hit.model_id,
                "rateLimitTier": hit.tier,
                "rateLimitType": hit.limit_type,
                "timestamp": timestamp,
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::forwarded_address;

    /// A header's number read back, response after response: a number kept
    /// from the last response only while it is the same.
    #[test]
    fn rate_headers_say_each_response_s_own_numbers() {
        use actix_web::http::header::HeaderMap;
        use rialto_limiter::{RateHeaders, TokenHeaders};
        let written = |values: &RateHeaders| {
            let mut headers = HeaderMap::new();
            super::write_headers(&mut headers, values, false);
            let read = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
            [
                "x-ratelimit-limit-requests",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
                "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset-tokens",
            ]
            .map(read)
        };
        let mut values = RateHeaders {
            scope: rialto_limiter::Scope::User,
            limit_requests: 500,
            remaining_requests: 499,
            reset_requests: 1_800_000_060,
            tokens: Some(TokenHeaders {
                limit: u64::MAX,
                remaining: 1_000,
                reset_secs: 60,
            }),
        };
        let say = |numbers: [&str; 6]| numbers.map(|n| Some(n.to_owned()));
        let max = u64::MAX.to_string();
        let expected = say(["500", "499", "1800000060", &max, "1000", "60"]);
        assert_eq!(written(&values), expected);
        assert_eq!(written(&values), expected);
        values.limit_requests = 20;
        values.remaining_requests = 19;
        values.reset_requests = -1;
        values.tokens = Some(TokenHeaders {
            limit: 7,
            remaining: 0,
            reset_secs: 59,
        });
        assert_eq!(written(&values), say(["20", "19", "-1", "7", "0", "59"]));
        values.tokens = None;
        let [limit, remaining, reset, tokens @ ..] = written(&values);
        assert_eq!(
            [limit, remaining, reset],
            ["20", "19", "-1"].map(|n| Some(n.to_owned()))
        );
        assert_eq!(tokens, [None, None, None]);
    }

    #[test]
    fn only_the_address_the_proxy_appended_counts() {
        let ip = |s: &str| Some(s.parse().unwrap());
        assert_eq!(forwarded_address(b"10.0.0.1"), ip("10.0.0.1"));
        assert_eq!(forwarded_address(b"6.6.6.6, 10.0.0.1"), ip("10.0.0.1"));
        assert_eq!(forwarded_address(b"6.6.6.6, 10.0.0.1:443"), ip("10.0.0.1"));
        assert_eq!(
            forwarded_address(b"6.6.6.6, [2001:db8::1]:443"),
            ip("2001:db8::1")
        );
        // An unreadable last element does not fall back to the client's.
        // Bytes the client wrote before do not matter.
        assert_eq!(forwarded_address(b"\xff\xfe, 10.0.0.1"), ip("10.0.0.1"));
        assert_eq!(forwarded_address(b"6.6.6.6, garbage"), None);
    }
}
