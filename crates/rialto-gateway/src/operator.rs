//! The operator API (`/admin/v1`): for whoever runs the platform, not part of
//! the public spec. Authenticated by the configured operator token.

use actix_web::{HttpRequest, HttpResponse, web};
use rialto_core::ErrorCode;
use rialto_proto::auth::v1 as pb;
use rialto_proto::billing::v1 as billing_pb;
use serde_json::{Value, json};

use crate::{ApiError, Details, Gateway, parse_json, read_body};

pub(crate) fn check_operator(gateway: &Gateway, request: &HttpRequest) -> Result<(), ApiError> {
    if gateway.operator_token.is_none() {
        return Err(ApiError::new(
            ErrorCode::Unauthenticated,
            "The operator API is disabled: set operator.token (RIALTO_OPERATOR__TOKEN)",
        ));
    }
    if !is_operator(gateway, request.headers()) {
        return Err(ApiError::new(
            ErrorCode::Unauthenticated,
            "Authentication failed",
        ));
    }
    Ok(())
}

/// Whether the headers carry the operator token (compared in constant
/// time). Only the token in force: one rotated because it may have leaked
/// is refused as soon as the new one is read.
pub(crate) fn is_operator(gateway: &Gateway, headers: &actix_web::http::header::HeaderMap) -> bool {
    let Some(token) = &gateway.operator_token else {
        return false;
    };
    let presented = crate::bearer_token(headers).unwrap_or_default();
    !presented.is_empty() && token.accepts_current(presented.as_bytes())
}

/// `POST /admin/v1/accounts {"name": ..., "tier"?: ...}` -> 201 with the
/// first ADMIN key. `tier` picks the account's rate-limit table
/// (`standard` by default, `partner`).
pub async fn create_account(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let body = parse_json(&read_body(&gateway, &request, payload).await?)?;
    let name = match body.get("name") {
        Some(Value::String(name)) if !name.trim().is_empty() && name.chars().count() <= 128 => {
            name.clone()
        }
        other => {
            let mut details = Details::new();
            details.push(
                &["name"],
                if other.is_none() {
                    "Required"
                } else {
                    "Expected a string of 1 to 128 characters"
                },
            );
            return Err(ApiError::validation(details));
        }
    };
    let tier = match body.get("tier") {
        None | Some(Value::Null) => String::new(),
        tier => checked_tier(&gateway, tier)?,
    };
    let created = gateway
        .services
        .auth
        .create_account(pb::CreateAccountRequest { name, tier })
        .await?;
    Ok(HttpResponse::Created().json(account_json(&created)))
}

/// A tier of `[limits.tiers]`, or a validation error naming them.
fn checked_tier(gateway: &Gateway, value: Option<&Value>) -> Result<String, ApiError> {
    let mut details = Details::new();
    match value {
        Some(Value::String(tier)) => {
            let policy = gateway.services.limiter.policy();
            if policy.tiers().any(|t| t == tier) {
                return Ok(tier.clone());
            }
            let known: Vec<&str> = policy.tiers().collect();
            details.push(
                &["tier"],
                format!("Unknown tier; expected one of: {}", known.join(", ")),
            );
        }
        None | Some(Value::Null) => details.push(&["tier"], "Required"),
        Some(_) => details.push(&["tier"], "Expected string"),
    }
    Err(ApiError::validation(details))
}

/// `PUT /admin/v1/accounts/{id}/tier {"tier": "partner"}`: the account's
/// rate-limit table from now on.
pub async fn set_tier(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let body = parse_json(&read_body(&gateway, &request, payload).await?)?;
    let tier = checked_tier(&gateway, body.get("tier"))?;
    let account = gateway
        .services
        .auth
        .set_account_tier(pb::SetAccountTierRequest {
            account_id: path.into_inner(),
            tier,
        })
        .await?;
    Ok(HttpResponse::Ok().json(json!({
        "id": account.id,
        "name": account.name,
        "tier": account.tier,
    })))
}

/// The ledger owner of an account that exists (404 otherwise): a mistyped
/// id must not swallow money.
async fn existing_account_owner(gateway: &Gateway, account_id: &str) -> Result<String, ApiError> {
    Ok(ledger_owner_of(
        &existing_account(gateway, account_id).await?,
    ))
}

/// An account's ledger owner: a wallet account's is the wallet's ledger.
pub(crate) fn ledger_owner_of(account: &pb::Account) -> String {
    if account.wallet.is_empty() {
        rialto_billing::account_owner(&account.id)
    } else {
        rialto_billing::wallet_owner(&account.wallet)
    }
}

/// `PUT /admin/v1/accounts/{id}/stake {"diem_per_day": "25"}`: the DIEM the
/// account's stake grants every UTC day (unspent DIEM does not roll over).
pub async fn set_stake(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let body = parse_json(&read_body(&gateway, &request, payload).await?)?;
    let per_day = match body.get("diem_per_day") {
        Some(Value::String(value)) => value.clone(),
        other => {
            let mut details = Details::new();
            let message = if other.is_none() {
                "Required"
            } else {
                "Expected a string such as \"25\""
            };
            details.push(&["diem_per_day"], message);
            return Err(ApiError::validation(details));
        }
    };
    let account_id = path.into_inner();
    let owner = existing_account_owner(&gateway, &account_id).await?;
    let balance = gateway
        .services
        .billing
        .set_stake(billing_pb::SetStakeRequest {
            owner,
            diem_per_day: per_day,
        })
        .await?;
    Ok(HttpResponse::Ok().json(json!({
        "id": account_id,
        "diem_per_day": balance.diem_per_day,
        "balance": {"usd": balance.usd, "diem": balance.diem},
    })))
}

/// `POST /admin/v1/accounts/{id}/credits {"usd": "10.00", "diem": "0",
/// "reference": "..."}`: adds credit once per reference (a repeated
/// reference changes nothing and answers `"applied": false`).
pub async fn credit_account(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let body = parse_json(&read_body(&gateway, &request, payload).await?)?;
    let mut details = Details::new();
    let mut text = |field: &str, required: bool| match body.get(field) {
        Some(Value::String(value)) => value.clone(),
        None | Some(Value::Null) if !required => String::new(),
        None | Some(Value::Null) => {
            details.push(&[field], "Required");
            String::new()
        }
        Some(_) => {
            details.push(&[field], "Expected a string such as \"10.00\"");
            String::new()
        }
    };
    let usd = text("usd", false);
    let diem = text("diem", false);
    let reference = text("reference", true);
    details.into_result()?;
    let owner = existing_account_owner(&gateway, &path.into_inner()).await?;
    let credited = gateway
        .services
        .billing
        .credit(billing_pb::CreditRequest {
            owner,
            usd,
            diem,
            reference,
        })
        .await?;
    let balance = credited.balance.unwrap_or_default();
    Ok(HttpResponse::Ok().json(json!({
        "applied": credited.applied,
        "balance": {"usd": balance.usd, "diem": balance.diem},
    })))
}

/// The operator API's account shape, shared with `rialto admin accounts create`.
pub fn account_json(created: &pb::CreateAccountResponse) -> Value {
    let key = created.api_key.clone().unwrap_or_default();
    json!({
        "id": created.account_id,
        "api_key": {
            "id": key.record.map(|r| r.id).unwrap_or_default(),
            "key": key.secret,
            "type": "ADMIN",
        }
    })
}

/// An account in the operator API's listing shape.
fn account_summary(account: &pb::Account) -> Value {
    let time = |ms: i64| {
        chrono::DateTime::<chrono::Utc>::from_timestamp_millis(ms)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
    };
    json!({
        "id": account.id,
        "name": account.name,
        "tier": account.tier,
        "wallet": Some(&account.wallet).filter(|w| !w.is_empty()),
        "createdAt": time(account.created_at_ms),
        "suspended": account.suspended_at_ms.is_some(),
        "suspendedAt": account.suspended_at_ms.and_then(time),
    })
}

#[derive(Debug, serde::Deserialize)]
pub struct AccountsQuery {
    search: Option<String>,
    limit: Option<String>,
    offset: Option<String>,
}

/// `GET /admin/v1/accounts?search&limit&offset`: accounts, newest first,
/// found by name or id (case-insensitive), with the total that match.
pub async fn list_accounts(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<AccountsQuery>,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let mut details = Details::new();
    let limit = match query.limit.as_deref().map(str::parse::<u32>) {
        None => 50,
        Some(Ok(n @ 1..=500)) => n,
        Some(_) => {
            details.push(&["limit"], "Expected an integer from 1 to 500");
            50
        }
    };
    let offset = match query.offset.as_deref().map(str::parse::<u64>) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            details.push(&["offset"], "Expected a non-negative integer");
            0
        }
    };
    let search = query.search.clone().unwrap_or_default();
    if search.chars().count() > 200 {
        details.push(&["search"], "String must contain at most 200 character(s)");
    }
    details.into_result()?;
    let listed = gateway
        .services
        .auth
        .list_accounts(pb::ListAccountsRequest {
            search,
            limit,
            offset,
        })
        .await?;
    let data: Vec<Value> = listed.accounts.iter().map(account_summary).collect();
    Ok(HttpResponse::Ok().json(json!({
        "object": "list",
        "data": data,
        "total": listed.total,
        "limit": limit,
        "offset": offset,
    })))
}

/// `GET /admin/v1/accounts/{id}`: the account and its balances.
pub async fn get_account(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let account = existing_account(&gateway, &path).await?;
    let owner = ledger_owner_of(&account);
    let balance = gateway
        .services
        .billing
        .get_balance(billing_pb::GetBalanceRequest { owner })
        .await?;
    let mut body = account_summary(&account);
    body["balance"] = json!({
        "usd": balance.usd, "diem": balance.diem,
        "usdHeld": balance.usd_held, "diemHeld": balance.diem_held,
        "diemPerDay": balance.diem_per_day,
    });
    Ok(HttpResponse::Ok().json(body))
}

/// `POST /admin/v1/accounts/{id}/suspend`: the account's keys stop
/// authenticating, on every gateway and auth replica at once.
pub async fn suspend_account(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    set_suspended(&gateway, &request, path.into_inner(), true).await
}

/// `POST /admin/v1/accounts/{id}/resume`: its keys authenticate again.
pub async fn resume_account(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    set_suspended(&gateway, &request, path.into_inner(), false).await
}

async fn set_suspended(
    gateway: &Gateway,
    request: &HttpRequest,
    account_id: String,
    suspended: bool,
) -> Result<HttpResponse, ApiError> {
    check_operator(gateway, request)?;
    let account = gateway
        .services
        .auth
        .set_account_suspended(pb::SetAccountSuspendedRequest {
            account_id,
            suspended,
        })
        .await?;
    Ok(HttpResponse::Ok().json(account_summary(&account)))
}

/// The account of the path, or the operator API's 404.
async fn existing_account(gateway: &Gateway, account_id: &str) -> Result<pb::Account, ApiError> {
    Ok(gateway
        .services
        .auth
        .get_account(pb::GetAccountRequest {
            account_id: account_id.to_owned(),
        })
        .await?)
}

/// `GET /admin/v1/accounts/{id}/keys`: the account's keys (never their
/// secrets).
pub async fn list_keys(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let account = existing_account(&gateway, &path).await?;
    let keys = gateway
        .services
        .auth
        .list_api_keys(pb::ListApiKeysRequest {
            account_id: account.id,
        })
        .await?
        .keys;
    Ok(
        HttpResponse::Ok()
            .json(json!({"object": "list", "data": crate::keys::records_json(&keys)})),
    )
}

/// `POST /admin/v1/accounts/{id}/keys`: a key for the account, from the
/// body `POST /api_keys` takes, answered as it answers (the secret once).
pub async fn create_key(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let body = parse_json(&read_body(&gateway, &request, payload).await?)?;
    let account = existing_account(&gateway, &path).await?;
    crate::keys::create_for(&gateway, account.id, &body).await
}

/// `DELETE /admin/v1/accounts/{id}/keys/{key}`: revokes the key on every
/// gateway at once, as the owner's own `DELETE /api_keys` does.
pub async fn revoke_key(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let (account_id, id) = path.into_inner();
    gateway
        .services
        .auth
        .delete_api_key(pb::DeleteApiKeyRequest { account_id, id })
        .await?;
    Ok(HttpResponse::Ok().json(json!({"success": true})))
}

/// `GET /admin/v1/accounts/{id}/limit-hits`: the account's last 50 rate
/// limit hits, newest first, as `/api_keys/rate_limits/log` shows them.
pub async fn limit_hits(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let account = existing_account(&gateway, &path).await?;
    let data = crate::limits::hits_json(&gateway, &account.id).await?;
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

/// `GET /admin/v1/backends`: every model's backends, their circuit
/// (`closed`, `half_open`, `open`, `down`) and requests in flight.
pub async fn backends(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let backends = gateway.services.router.backends().await?.backends;
    let data: Vec<Value> = backends
        .iter()
        .map(|b| json!({"model": b.model, "backend": b.backend, "state": b.state, "inFlight": b.in_flight}))
        .collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

/// `GET /admin/v1/accounts/{id}/usage?lookback=7d` (or `startDate` and
/// `endDate`): the account's spend by day, model and key, the shape of
/// `/billing/usage-analytics`.
pub async fn account_usage(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    query: web::Query<crate::usage::AnalyticsQuery>,
) -> Result<HttpResponse, ApiError> {
    check_operator(&gateway, &request)?;
    let account = existing_account(&gateway, &path).await?;
    crate::usage::account_analytics(&gateway, &account, &query).await
}
