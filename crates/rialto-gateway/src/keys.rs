//! `/api/v1/api_keys`: list, create, get, update and delete API keys (ADMIN
//! keys only), in the hosted API's shapes; and the `modelPrivacy` check
//! every metered request passes.

use actix_web::{HttpRequest, HttpResponse, web};
use chrono::{DateTime, NaiveDate, SecondsFormat, Utc};
use std::collections::HashMap;

use rialto_proto::auth::v1 as pb;
use rialto_proto::billing::v1 as billing_pb;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{ApiError, Details, Gateway, authenticate_endpoint, parse_json, read_body};

/// Members `POST /api_keys` accepts (the hosted API refuses any other).
const CREATE_FIELDS: &[&str] = &[
    "apiKeyType",
    "description",
    "expiresAt",
    "consumptionLimit",
    "limitPeriod",
    "modelPrivacy",
];

pub async fn list(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate_endpoint(&gateway, &request, true).await?;
    let keys = gateway
        .services
        .auth
        .list_api_keys(pb::ListApiKeysRequest {
            account_id: principal.account_id.clone(),
        })
        .await?
        .keys;
    let spend = period_usage(&gateway, &crate::ledger_owner(&principal), &keys).await?;
    let data: Vec<Value> = keys.iter().map(|k| record_json(k, &spend)).collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

pub async fn get(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate_endpoint(&gateway, &request, true).await?;
    let record = gateway
        .services
        .auth
        .get_api_key(pb::GetApiKeyRequest {
            account_id: principal.account_id.clone(),
            id: id.into_inner(),
        })
        .await?;
    let spend = period_usage(
        &gateway,
        &crate::ledger_owner(&principal),
        std::slice::from_ref(&record),
    )
    .await?;
    Ok(HttpResponse::Ok().json(json!({"data": record_json(&record, &spend)})))
}

/// What each capped key among `keys` was charged in its current period, by
/// key id: one call to billing for all of them, none without caps.
async fn period_usage(
    gateway: &Gateway,
    owner: &str,
    keys: &[pb::ApiKeyRecord],
) -> Result<HashMap<String, billing_pb::KeySpend>, ApiError> {
    let capped: Vec<billing_pb::KeyLimit> = keys
        .iter()
        .filter_map(|k| crate::key_limit(&k.id, k.limit.as_ref()))
        .collect();
    if capped.is_empty() {
        return Ok(HashMap::new());
    }
    let spend = gateway
        .services
        .billing
        .key_spend(billing_pb::KeySpendRequest {
            owner: owner.to_owned(),
            keys: capped,
        })
        .await?;
    Ok(spend
        .keys
        .into_iter()
        .map(|s| (s.key_id.clone(), s))
        .collect())
}

pub async fn create(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate_endpoint(&gateway, &request, true).await?;
    let body = parse_json(&read_body(&gateway, &request, payload).await?)?;
    create_for(&gateway, principal.account_id, &body).await
}

/// A key for `account_id` from a `POST /api_keys` body (the operator's
/// `POST /admin/v1/accounts/{id}/keys`), answered as that route answers.
pub(crate) async fn create_for(
    gateway: &Gateway,
    account_id: String,
    body: &Value,
) -> Result<HttpResponse, ApiError> {
    Ok(created_json(create_key(gateway, account_id, body).await?))
}

/// Validates a `POST /api_keys` body and makes the key in `account_id`:
/// the one path every key takes (the API, the operator API, the console).
pub(crate) async fn create_key(
    gateway: &Gateway,
    account_id: String,
    body: &Value,
) -> Result<pb::CreatedKey, ApiError> {
    let create = validate_create(body, CREATE_FIELDS, None)?;
    Ok(gateway
        .services
        .auth
        .create_api_key(create.request(account_id))
        .await?)
}

/// An account's keys in the listing shape (what they spent is not read).
pub(crate) fn records_json(records: &[pb::ApiKeyRecord]) -> Vec<Value> {
    let spend = HashMap::new();
    records.iter().map(|r| record_json(r, &spend)).collect()
}

/// A created key in the hosted shape: its secret is in this answer only.
fn created_json(created: pb::CreatedKey) -> HttpResponse {
    let record = created.record.unwrap_or_default();
    let (limits, period) = limit_json(record.limit.as_ref());
    HttpResponse::Ok().json(json!({
        "success": true,
        "data": {
            "id": record.id,
            "apiKey": created.secret,
            "apiKeyType": key_type_name(record.key_type),
            "description": record.description,
            "expiresAt": record.expires_at_ms.map(iso),
            "consumptionLimit": limits,
            "limitPeriod": period,
            "modelPrivacy": privacy_name(&record.model_privacy),
        }
    }))
}

/// `GET /api_keys/generate_web3_key` (public): the token a wallet signs to
/// get a key, valid 15 minutes (see `rialto_auth::web3`).
pub async fn web3_token(gateway: web::Data<Gateway>) -> Result<HttpResponse, ApiError> {
    let domain = gateway
        .wallet
        .domains
        .first()
        .map_or("localhost", String::as_str);
    let token = rialto_auth::web3::issue_token(domain, chrono::Utc::now().timestamp_millis())
        .ok_or_else(|| rialto_core::Error::internal("no randomness for a token's nonce"))?;
    Ok(HttpResponse::Ok().json(json!({"success": true, "data": {"token": token}})))
}

/// Members `POST /api_keys/generate_web3_key` accepts.
const WEB3_FIELDS: &[&str] = &[
    "apiKeyType",
    "description",
    "expiresAt",
    "consumptionLimit",
    "limitPeriod",
    "modelPrivacy",
    "address",
    "signature",
    "token",
];

/// `POST /api_keys/generate_web3_key` (public: the signature is the
/// credential): `{apiKeyType, address, signature, token, description?
/// ("Web3 API Key"), expiresAt?, consumptionLimit?, limitPeriod?,
/// modelPrivacy?}`, answered as `POST /api_keys` is. The key belongs to the
/// wallet's account and spends the wallet's balance (x402 top-ups).
pub async fn create_web3(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body = parse_json(&read_body(&gateway, &request, payload).await?)?;
    let mut details = Details::new();
    let mut text = |field: &str| match body.get(field) {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) | None => {
            details.push(&[field], "Required");
            String::new()
        }
        Some(_) => {
            details.push(&[field], "Expected string");
            String::new()
        }
    };
    let (address, signature, token) = (text("address"), text("signature"), text("token"));
    let settings = validate_create(&body, WEB3_FIELDS, Some("Web3 API Key"));
    details.into_result()?;
    let settings = settings?;
    let created = gateway
        .services
        .auth
        .create_web3_key(pb::CreateWeb3KeyRequest {
            address,
            signature,
            token,
            // The account is the wallet's, which auth decides.
            key: Some(settings.request(String::new())),
        })
        .await?;
    Ok(created_json(created))
}

/// Members `PATCH /api_keys` accepts: the key's id, and what may change.
const UPDATE_FIELDS: &[&str] = &[
    "id",
    "description",
    "expiresAt",
    "consumptionLimit",
    "limitPeriod",
    "modelPrivacy",
    "apiKeyType",
];

/// `PATCH /api_keys`: `{id, description?, expiresAt?, consumptionLimit?,
/// limitPeriod?, modelPrivacy?}`; what is absent stays as it was
/// (`expiresAt` `""` or null removes the expiry). Every cache of the key
/// drops it at once, so its next request runs under the new settings.
pub async fn update(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate_endpoint(&gateway, &request, true).await?;
    let body = parse_json(&read_body(&gateway, &request, payload).await?)?;
    let mut details = Details::new();
    let Some(object) = body.as_object() else {
        details.push(&[], "Expected object");
        return Err(ApiError::validation(details));
    };
    crate::media::unknown_members(object, UPDATE_FIELDS, &mut details);
    if object.contains_key("apiKeyType") {
        details.push(&["apiKeyType"], "A key's type cannot be changed");
    }
    let id = match object.get("id") {
        Some(Value::String(id)) if !id.trim().is_empty() => id.clone(),
        Some(Value::String(_)) => {
            details.push(&["id"], "String must contain at least 1 character(s)");
            String::new()
        }
        Some(_) => {
            details.push(&["id"], "Expected string");
            String::new()
        }
        None => {
            details.push(&["id"], "Required");
            String::new()
        }
    };
    // The fields a create validates, validated the same way.
    let mut changes = object.clone();
    changes.remove("id");
    changes.remove("apiKeyType");
    details.into_result()?;
    let checked = changes_of(&changes)?;
    let current = gateway
        .services
        .auth
        .get_api_key(pb::GetApiKeyRequest {
            account_id: principal.account_id.clone(),
            id: id.clone(),
        })
        .await
        .map_err(|error| match error.code {
            rialto_core::ErrorCode::ApiKeyNotFound => ApiError::new(
                rialto_core::ErrorCode::ApiKeyNotFound,
                "API key not found or expired",
            ),
            _ => error.into(),
        })?;
    let mut limit = current.limit.clone().unwrap_or_default();
    if let Some((usd, diem)) = checked.caps {
        limit.usd_nanos = usd;
        limit.diem_nanos = diem;
    }
    if let Some(period) = checked.period {
        limit.period = period;
    }
    let limit = (limit.usd_nanos.is_some()
        || limit.diem_nanos.is_some()
        || !matches!(limit.period.as_str(), "" | "EPOCH"))
    .then_some(limit);
    let record = gateway
        .services
        .auth
        .update_api_key(pb::UpdateApiKeyRequest {
            account_id: principal.account_id,
            id,
            description: checked.description.unwrap_or(current.description),
            expires_at_ms: match checked.expires_at_ms {
                Some(expiry) => expiry,
                None => current.expires_at_ms,
            },
            limit,
            model_privacy: checked.model_privacy.unwrap_or(current.model_privacy),
        })
        .await?;
    Ok(HttpResponse::Ok().json(json!({
        "success": true,
        "data": record_json(&record, &HashMap::new()),
    })))
}

/// What a PATCH changes; None: unchanged.
struct Changes {
    description: Option<String>,
    /// Some(None): the expiry removed.
    expires_at_ms: Option<Option<i64>>,
    /// The new caps (either may be None: not capped).
    caps: Option<(Option<i64>, Option<i64>)>,
    period: Option<String>,
    model_privacy: Option<String>,
}

/// The PATCH members present, checked as a create checks them.
fn changes_of(changes: &serde_json::Map<String, Value>) -> Result<Changes, ApiError> {
    // A create body with what a create requires filled in: its checks
    // apply member by member, and only present members are taken.
    let mut as_create = changes.clone();
    as_create.insert("apiKeyType".into(), json!("INFERENCE"));
    as_create.entry("description").or_insert_with(|| json!(""));
    let create = validate_create(&Value::Object(as_create), CREATE_FIELDS, None)?;
    let limit = create.limit.clone().unwrap_or_default();
    Ok(Changes {
        description: changes
            .contains_key("description")
            .then_some(create.description),
        expires_at_ms: changes
            .contains_key("expiresAt")
            .then_some(create.expires_at_ms),
        caps: changes
            .contains_key("consumptionLimit")
            .then_some((limit.usd_nanos, limit.diem_nanos)),
        period: changes.contains_key("limitPeriod").then(|| {
            if limit.period.is_empty() {
                "EPOCH".to_owned()
            } else {
                limit.period.clone()
            }
        }),
        model_privacy: changes
            .contains_key("modelPrivacy")
            .then_some(create.model_privacy),
    })
}

/// The hosted API's name of a key's privacy (ALL when unset).
fn privacy_name(privacy: &str) -> &str {
    if privacy.is_empty() { "ALL" } else { privacy }
}

/// Refuses a request of a key whose `modelPrivacy` does not allow
/// `model`: PRIVATE_ONLY allows private models only, PRIVATE_TEXT private
/// text and embedding models (and any model of another type). The hosted API's 403.
pub(crate) fn check_privacy(
    principal: &rialto_proto::auth::v1::Principal,
    model: &rialto_core::ModelConfig,
) -> Result<(), ApiError> {
    let restricted = match principal.model_privacy.as_str() {
        "PRIVATE_ONLY" => true,
        // Text and embedding models read what the caller writes.
        "PRIVATE_TEXT" => matches!(model.model_type.as_str(), "text" | "embedding"),
        _ => false,
    };
    if restricted && model.privacy != "private" {
        return Err(ApiError::new(
            rialto_core::ErrorCode::Forbidden,
            format!(
                "This API key is set to '{}', but `{}` is an Anonymous model. Choose a Private, \
                 TEE, or E2EE model, or change the model privacy setting of this API key.",
                principal.model_privacy, model.id
            ),
        ));
    }
    Ok(())
}

#[derive(Deserialize, Default)]
pub struct DeleteQuery {
    id: Option<String>,
}

pub async fn delete(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<DeleteQuery>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate_endpoint(&gateway, &request, true).await?;
    // The id comes as `?id=` (the hosted API's documented form) or as a JSON
    // body `{"id": ...}` (also accepted there).
    let id = match query.into_inner().id {
        Some(id) => id,
        None => {
            let body = read_body(&gateway, &request, payload).await?;
            let from_body = if body.iter().all(u8::is_ascii_whitespace) {
                None
            } else {
                parse_json(&body)?
                    .get("id")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            };
            from_body.ok_or_else(|| {
                let mut details = Details::new();
                details.push(
                    &["id"],
                    "Required: pass the key id as ?id= or in a JSON body",
                );
                ApiError::validation(details)
            })?
        }
    };
    if id.trim().is_empty() {
        let mut details = Details::new();
        details.push(&["id"], "String must contain at least 1 character(s)");
        return Err(ApiError::validation(details));
    }
    gateway
        .services
        .auth
        .delete_api_key(pb::DeleteApiKeyRequest {
            account_id: principal.account_id,
            id,
        })
        .await?;
    Ok(HttpResponse::Ok().json(json!({"success": true})))
}

#[derive(Debug)]
struct CreateKey {
    key_type: pb::KeyType,
    description: String,
    expires_at_ms: Option<i64>,
    limit: Option<pb::ConsumptionLimit>,
    model_privacy: String,
}

impl CreateKey {
    /// The auth request that makes this key in `account_id`.
    fn request(self, account_id: String) -> pb::CreateApiKeyRequest {
        pb::CreateApiKeyRequest {
            account_id,
            key_type: self.key_type as i32,
            description: self.description,
            expires_at_ms: self.expires_at_ms,
            limit: self.limit,
            model_privacy: self.model_privacy,
        }
    }
}

/// A new key's settings from a create request's members (`fields` are the
/// members it may have); `default_description` when it may omit one.
fn validate_create(
    body: &Value,
    fields: &[&str],
    default_description: Option<&str>,
) -> Result<CreateKey, ApiError> {
    let mut details = Details::new();
    let Some(object) = body.as_object() else {
        details.push(&[], "Expected object");
        return Err(ApiError::validation(details));
    };
    crate::media::unknown_members(object, fields, &mut details);
    let key_type = match object.get("apiKeyType").and_then(Value::as_str) {
        Some("ADMIN") => pb::KeyType::Admin,
        Some("INFERENCE") => pb::KeyType::Inference,
        Some(other) => {
            details.push(
                &["apiKeyType"],
                format!("Invalid enum value. Expected 'INFERENCE' | 'ADMIN', received '{other}'"),
            );
            pb::KeyType::Unspecified
        }
        None => {
            details.push(&["apiKeyType"], "Required");
            pb::KeyType::Unspecified
        }
    };
    let description = match object.get("description") {
        Some(Value::String(d)) if d.chars().count() > 64 => {
            details.push(
                &["description"],
                "String must contain at most 64 character(s)",
            );
            String::new()
        }
        Some(Value::String(d)) => d.clone(),
        Some(_) => {
            details.push(&["description"], "Expected string");
            String::new()
        }
        None => match default_description {
            Some(description) => description.to_owned(),
            None => {
                details.push(&["description"], "Required");
                String::new()
            }
        },
    };
    let expires_at_ms = match object.get("expiresAt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) => match parse_expiry(s) {
            Some(ms) => Some(ms),
            None => {
                details.push(
                    &["expiresAt"],
                    "Expected \"\", YYYY-MM-DD or an ISO 8601 date-time such as 2026-12-31T23:59:59Z",
                );
                None
            }
        },
        Some(_) => {
            details.push(&["expiresAt"], "Expected string");
            None
        }
    };
    let (usd_nanos, diem_nanos) = match object.get("consumptionLimit") {
        None | Some(Value::Null) => (None, None),
        Some(Value::Object(limit)) => {
            let unknown: Vec<&str> = limit
                .keys()
                .map(String::as_str)
                .filter(|k| !["usd", "diem", "vcu"].contains(k))
                .collect();
            if !unknown.is_empty() {
                details.push(
                    &["consumptionLimit"],
                    format!("Unrecognized key(s) in object: '{}'", unknown.join("', '")),
                );
            }
            if limit.get("vcu").is_some_and(|v| !v.is_null()) {
                details.push(
                    &["consumptionLimit", "vcu"],
                    "VCU is deprecated and not a currency here: set diem instead",
                );
            }
            (
                cap_amount(limit.get("usd"), "usd", &mut details),
                cap_amount(limit.get("diem"), "diem", &mut details),
            )
        }
        Some(_) => {
            details.push(&["consumptionLimit"], "Expected object");
            (None, None)
        }
    };
    let period =
        match object.get("limitPeriod") {
            None | Some(Value::Null) => "EPOCH",
            Some(Value::String(p)) if ["EPOCH", "MONTH", "LIFETIME"].contains(&p.as_str()) => p,
            Some(other) => {
                details.push(
                &["limitPeriod"],
                format!(
                    "Invalid enum value. Expected 'EPOCH' | 'MONTH' | 'LIFETIME', received '{}'",
                    other.as_str().map_or_else(|| other.to_string(), str::to_owned)
                ),
            );
                "EPOCH"
            }
        };
    let limit = (usd_nanos.is_some() || diem_nanos.is_some() || period != "EPOCH").then(|| {
        pb::ConsumptionLimit {
            usd_nanos,
            diem_nanos,
            period: period.to_owned(),
        }
    });
    let model_privacy = match object.get("modelPrivacy") {
        None | Some(Value::Null) => "ALL".to_owned(),
        Some(Value::String(p)) if rialto_auth::MODEL_PRIVACY.contains(&p.as_str()) => p.clone(),
        Some(other) => {
            details.push(
                &["modelPrivacy"],
                format!(
                    "Invalid enum value. Expected 'ALL' | 'PRIVATE_TEXT' | 'PRIVATE_ONLY', received '{}'",
                    other.as_str().map_or_else(|| other.to_string(), str::to_owned)
                ),
            );
            String::new()
        }
    };
    details.into_result()?;
    Ok(CreateKey {
        key_type,
        description,
        expires_at_ms,
        limit,
        model_privacy,
    })
}

/// The most a key's cap may be in either currency (the hosted API's bound).
const MAX_CAP: i64 = 9_999_999_999;

/// One currency of `consumptionLimit`: null, or a number from 0 to
/// 9,999,999,999 with at most 9 decimals, as nano-units.
fn cap_amount(value: Option<&Value>, field: &str, details: &mut Details) -> Option<i64> {
    let value = value.filter(|v| !v.is_null())?;
    let path = ["consumptionLimit", field];
    let Value::Number(number) = value else {
        details.push(&path, "Expected number, received string");
        return None;
    };
    // JSON clients write small numbers with exponents (Python: 1e-09).
    let text = number.to_string();
    let parsed = if text.contains(['e', 'E']) {
        rust_decimal::Decimal::from_scientific(&text)
    } else {
        text.parse()
    };
    let amount = match parsed {
        Ok(amount) => amount.normalize(),
        Err(_) => {
            details.push(&path, "Number must be less than or equal to 9999999999");
            return None;
        }
    };
    if amount.is_sign_negative() && !amount.is_zero() {
        details.push(&path, "Number must be greater than or equal to 0");
        return None;
    }
    if amount > rust_decimal::Decimal::from(MAX_CAP) {
        details.push(&path, "Number must be less than or equal to 9999999999");
        return None;
    }
    if amount.scale() > 9 {
        details.push(&path, format!("{field} may have at most 9 decimals"));
        return None;
    }
    match rialto_billing::to_nanos(amount) {
        Ok(nanos) => Some(nanos),
        Err(error) => {
            details.push(&path, error.message);
            None
        }
    }
}

/// `consumptionLimit(s)` and `limitPeriod` of a key, as the hosted API
/// renders them.
fn limit_json(limit: Option<&pb::ConsumptionLimit>) -> (Value, &str) {
    let amount = |nanos: Option<i64>| {
        nanos.map_or(Value::Null, |n| {
            serde_json::from_str(&rialto_billing::from_nanos(n)).unwrap_or(Value::Null)
        })
    };
    match limit {
        Some(limit) => (
            json!({"usd": amount(limit.usd_nanos), "diem": amount(limit.diem_nanos), "vcu": null}),
            if limit.period.is_empty() {
                "EPOCH"
            } else {
                limit.period.as_str()
            },
        ),
        None => (json!({"usd": null, "diem": null, "vcu": null}), "EPOCH"),
    }
}

/// `YYYY-MM-DD` (end of that day, UTC) or an RFC 3339 date-time.
fn parse_expiry(text: &str) -> Option<i64> {
    if let Ok(date) = NaiveDate::parse_from_str(text, "%Y-%m-%d") {
        return date
            .and_hms_milli_opt(23, 59, 59, 999)
            .map(|t| t.and_utc().timestamp_millis());
    }
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.timestamp_millis())
}

fn iso(ms: i64) -> String {
    DateTime::<Utc>::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn key_type_name(key_type: i32) -> &'static str {
    if key_type == pb::KeyType::Admin as i32 {
        "ADMIN"
    } else {
        "INFERENCE"
    }
}

fn record_json(record: &pb::ApiKeyRecord, spend: &HashMap<String, billing_pb::KeySpend>) -> Value {
    let (limits, period) = limit_json(record.limit.as_ref());
    let mut json = json!({
        "id": record.id,
        "apiKeyType": key_type_name(record.key_type),
        "description": record.description,
        "createdAt": iso(record.created_at_ms),
        "expiresAt": record.expires_at_ms.map(iso),
        "lastUsedAt": record.last_used_at_ms.map(iso),
        "last6Chars": record.last6_chars,
        "consumptionLimits": limits,
        "limitPeriod": period,
        "modelPrivacy": privacy_name(&record.model_privacy),
    });
    // Only keys with a cap report their usage in the current period.
    if let Some(spent) = spend.get(&record.id) {
        json["currentPeriodUsage"] = json!({"usd": spent.usd, "diem": spent.diem});
    }
    json
}

#[cfg(test)]
mod tests {
    use super::*;
    use rialto_core::ErrorCode;

    #[test]
    fn create_bodies_are_validated_like_the_hosted_api() {
        let ok = validate_create(
            &json!({"apiKeyType": "INFERENCE", "description": "ci"}),
            CREATE_FIELDS,
            None,
        )
        .unwrap();
        assert_eq!(ok.key_type, pb::KeyType::Inference);
        let error = validate_create(
            &json!({"apiKeyType": "ROOT", "bogus": 1}),
            CREATE_FIELDS,
            None,
        )
        .unwrap_err();
        assert_eq!(error.code(), ErrorCode::InvalidRequest);
        assert!(
            validate_create(
                &json!({"apiKeyType": "ADMIN", "description": "x".repeat(65)}),
                CREATE_FIELDS,
                None,
            )
            .is_err()
        );
    }

    #[test]
    fn expiry_accepts_dates_and_date_times() {
        assert!(parse_expiry("2026-12-31").is_some());
        assert!(parse_expiry("2026-12-31T23:59:59.000Z").is_some());
        assert!(parse_expiry("tomorrow").is_none());
    }

    #[test]
    fn times_render_like_the_hosted_api() {
        assert_eq!(iso(0), "1970-01-01T00:00:00.000Z");
    }
}
