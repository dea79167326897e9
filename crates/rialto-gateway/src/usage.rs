//! `GET /api/v1/billing/usage`: the account's usage history in the hosted
//! API's shape, paginated (the spec's `x-pagination-*` headers), as JSON or,
//! with `Accept: text/csv`, as a CSV download.

use actix_web::http::header::{ACCEPT, CONTENT_DISPOSITION, HeaderName};
use actix_web::{HttpRequest, HttpResponse, web};
use chrono::{DateTime, SecondsFormat};
use rialto_proto::billing::v1 as billing_pb;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{ApiError, Details, Gateway, authenticate_endpoint};

const MAX_LIMIT: u32 = 500;
const DEFAULT_LIMIT: u32 = 200;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageQuery {
    currency: Option<String>,
    start_date: Option<String>,
    end_date: Option<String>,
    limit: Option<String>,
    page: Option<String>,
    sort_order: Option<String>,
}

/// Parses the query into a request, with every problem in `details`.
fn parse(query: &UsageQuery, owner: String) -> Result<billing_pb::UsageHistoryRequest, ApiError> {
    let mut details = Details::new();
    let currency = match query.currency.as_deref() {
        None | Some("") => String::new(),
        Some(c @ ("USD" | "DIEM")) => c.to_owned(),
        Some(other) => {
            details.push(
                &["currency"],
                format!("Invalid enum value. Expected 'USD' | 'DIEM', received '{other}'"),
            );
            String::new()
        }
    };
    let mut time = |field: &str, value: &Option<String>, default: i64| match value.as_deref() {
        None | Some("") => default,
        Some(text) => match DateTime::parse_from_rfc3339(text) {
            Ok(time) => time.timestamp_millis(),
            Err(_) => {
                details.push(
                    &[field],
                    "Expected an ISO 8601 date-time such as 2026-01-01T00:00:00Z",
                );
                default
            }
        },
    };
    let start_ms = time("startDate", &query.start_date, 0);
    let end_ms = time("endDate", &query.end_date, i64::MAX);
    let mut number =
        |field: &str, value: &Option<String>, default: u32, max: u32| match value.as_deref() {
            None | Some("") => default,
            Some(text) => match text.parse::<u32>() {
                Ok(n) if (1..=max).contains(&n) => n,
                _ => {
                    details.push(&[field], format!("Expected an integer from 1 to {max}"));
                    default
                }
            },
        };
    let limit = number("limit", &query.limit, DEFAULT_LIMIT, MAX_LIMIT);
    let page = number("page", &query.page, 1, u32::MAX);
    let newest_first = match query.sort_order.as_deref() {
        None | Some("") | Some("desc") => true,
        Some("asc") => false,
        Some(other) => {
            details.push(
                &["sortOrder"],
                format!("Invalid enum value. Expected 'asc' | 'desc', received '{other}'"),
            );
            true
        }
    };
    details.into_result()?;
    Ok(billing_pb::UsageHistoryRequest {
        owner,
        currency,
        start_ms,
        end_ms,
        limit,
        page,
        newest_first,
        ..Default::default()
    })
}

fn number(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or(json!(0))
}

/// One entry in the hosted API's shape; `amount` is negative (a debit).
fn entry_json(entry: &billing_pb::UsageEntry) -> Value {
    let tokens = entry.prompt_tokens.saturating_add(entry.completion_tokens);
    // An augment call (`augment/search`) is one unit of its own SKU
    // (`augment-search`), priced as a whole.
    let flat = |prefix: &str, sku: &str| {
        let name = entry.model_id.strip_prefix(prefix)?;
        Some((format!("{sku}-{name}"), json!(1), number(&entry.amount)))
    };
    let priced_whole = flat(rialto_billing::AUGMENT_PREFIX, "augment")
        .or_else(|| flat(rialto_billing::CRYPTO_RPC_PREFIX, "crypto-rpc"));
    let (sku, units, price) = match priced_whole {
        Some(whole) => whole,
        None => (
            format!("{}-llm-mtoken", entry.model_id),
            number(
                &rust_decimal::Decimal::new(tokens.min(i64::MAX as u64) as i64, 6)
                    .normalize()
                    .to_string(),
            ),
            number(&entry.price_per_mtok_usd),
        ),
    };
    json!({
        "amount": number(&format!("-{}", entry.amount)),
        "currency": entry.currency,
        "inferenceDetails": {
            "completionTokens": entry.completion_tokens,
            "promptTokens": entry.prompt_tokens,
            "requestId": format!("chatcmpl-{}", entry.request_id),
            "inferenceExecutionTime": null,
        },
        "notes": "API Inference",
        "pricePerUnitUsd": price,
        "sku": sku,
        "timestamp": timestamp(entry.at_ms),
        "units": units,
    })
}

fn timestamp(at_ms: i64) -> String {
    DateTime::from_timestamp_millis(at_ms)
        .map(|t| t.to_rfc3339_opts(SecondsFormat::Millis, true))
        .unwrap_or_default()
}

pub async fn history(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<UsageQuery>,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate_endpoint(&gateway, &request, true).await?;
    let wanted = parse(&query, crate::ledger_owner(&principal))?;
    let (limit, page) = (wanted.limit, wanted.page);
    let history = gateway.services.billing.usage_history(wanted).await?;
    let total = history.total;
    let pages = total.div_ceil(u64::from(limit));
    let csv = wants_csv(&request);
    let mut response = HttpResponse::Ok();
    for (name, value) in [
        ("x-pagination-limit", u64::from(limit)),
        ("x-pagination-page", u64::from(page)),
        ("x-pagination-total", total),
        ("x-pagination-total-pages", pages),
    ] {
        response.insert_header((HeaderName::from_static(name), value));
    }
    if csv {
        let body = csv_of(&history.entries)?;
        return Ok(response
            .content_type("text/csv; charset=utf-8")
            .insert_header((CONTENT_DISPOSITION, "attachment; filename=\"usage.csv\""))
            .body(body));
    }
    let data: Vec<Value> = history.entries.iter().map(entry_json).collect();
    Ok(response.json(json!({
        "data": data,
        "pagination": {"limit": limit, "page": page, "total": total, "totalPages": pages},
    })))
}

/// Entries per page of `/billing/usage-history`: at least, at most, and
/// when the request does not say.
const WALK_PAGE: std::ops::RangeInclusive<u32> = 10..=1000;

/// Where a walk of `/billing/usage-history` stands: its filters, its page
/// size, and the last entry it answered. Sent back as `cursor`, in
/// base64url (the hosted pattern `[A-Za-z0-9_-]+`). It names no owner: the
/// caller's key decides whose history is walked, whatever a cursor says.
#[derive(Debug, serde::Serialize, Deserialize, PartialEq)]
struct Cursor {
    #[serde(rename = "c")]
    currency: String,
    #[serde(rename = "s")]
    start_ms: i64,
    #[serde(rename = "e")]
    end_ms: i64,
    #[serde(rename = "n")]
    page_size: u32,
    #[serde(rename = "t")]
    at_ms: i64,
    #[serde(rename = "i")]
    id: String,
}

impl Cursor {
    fn encode(&self) -> String {
        use base64::Engine;
        let json = serde_json::to_vec(self).unwrap_or_default();
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
    }

    fn decode(text: &str) -> Option<Self> {
        use base64::Engine;
        if text.len() > 512 {
            return None;
        }
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(text)
            .ok()?;
        serde_json::from_slice(&bytes).ok()
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WalkQuery {
    currency: Option<String>,
    cursor: Option<String>,
    start_timestamp: Option<String>,
    end_timestamp: Option<String>,
    page_size: Option<String>,
}

/// The walk a query asks for: a new one from its filters, or the one its
/// cursor continues (with no filters beside it).
fn walk_of(query: &WalkQuery) -> Result<Cursor, ApiError> {
    let mut details = Details::new();
    if let Some(cursor) = query.cursor.as_deref() {
        let filters = [
            ("currency", &query.currency),
            ("startTimestamp", &query.start_timestamp),
            ("endTimestamp", &query.end_timestamp),
            ("pageSize", &query.page_size),
        ];
        for (name, value) in filters {
            if value.is_some() {
                details.push(
                    &[name],
                    "The cursor carries the walk's filters: send it alone",
                );
            }
        }
        let walk = Cursor::decode(cursor);
        if walk.is_none() {
            details.push(
                &["cursor"],
                "Not a cursor this API answered: send nextCursor unchanged",
            );
        }
        details.into_result()?;
        return walk.ok_or_else(|| ApiError::validation(Details::new()));
    }
    let currency = match query.currency.as_deref() {
        None => String::new(),
        Some(c @ ("USD" | "DIEM" | "BUNDLED_CREDITS")) => c.to_owned(),
        Some(other) => {
            details.push(
                &["currency"],
                format!(
                    "Invalid enum value. Expected 'USD' | 'DIEM' | 'BUNDLED_CREDITS', \
                     received '{other}'"
                ),
            );
            String::new()
        }
    };
    let mut time = |field: &str, value: &Option<String>, default: i64| match value.as_deref() {
        None => default,
        Some(text) => match DateTime::parse_from_rfc3339(text) {
            Ok(time) if text.len() <= 40 && text.ends_with('Z') => time.timestamp_millis(),
            _ => {
                details.push(
                    &[field],
                    "Expected an ISO 8601 UTC date-time ending in Z, such as \
                     2026-01-01T00:00:00.000Z",
                );
                default
            }
        },
    };
    let start_ms = time("startTimestamp", &query.start_timestamp, 0);
    let end_ms = time("endTimestamp", &query.end_timestamp, i64::MAX);
    if end_ms <= start_ms {
        details.push(&["endTimestamp"], "Must be later than startTimestamp");
    }
    let page_size = match query.page_size.as_deref().map(str::parse::<u32>) {
        None => *WALK_PAGE.end(),
        Some(Ok(n)) if WALK_PAGE.contains(&n) => n,
        Some(_) => {
            details.push(
                &["pageSize"],
                format!(
                    "Expected an integer from {} to {}",
                    WALK_PAGE.start(),
                    WALK_PAGE.end()
                ),
            );
            0
        }
    };
    details.into_result()?;
    Ok(Cursor {
        currency,
        start_ms,
        end_ms,
        page_size,
        at_ms: 0,
        id: String::new(),
    })
}

/// `GET /billing/usage-history`: the caller's usage, oldest first, a page
/// at a time; `nextCursor` (the `x-next-cursor` header for CSV) continues
/// the walk, and is null on its last page. ADMIN key.
pub async fn walk(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<WalkQuery>,
) -> Result<HttpResponse, ApiError> {
    let walk = walk_of(&query)?;
    let principal = authenticate_endpoint(&gateway, &request, true).await?;
    let page = if walk.currency == "BUNDLED_CREDITS" {
        // Rialto has no bundled credits: nothing was ever charged in them.
        billing_pb::UsageHistoryResponse::default()
    } else {
        gateway
            .services
            .billing
            .usage_history(billing_pb::UsageHistoryRequest {
                owner: crate::ledger_owner(&principal),
                currency: walk.currency.clone(),
                start_ms: walk.start_ms,
                end_ms: walk.end_ms,
                limit: walk.page_size,
                walk: true,
                after_at_ms: walk.at_ms,
                after_id: walk.id.clone(),
                ..Default::default()
            })
            .await?
    };
    let next = page.entries.last().filter(|_| page.more).map(|last| {
        Cursor {
            at_ms: last.at_ms,
            id: last.id.clone(),
            currency: walk.currency.clone(),
            ..walk
        }
        .encode()
    });
    if wants_csv(&request) {
        let mut response = HttpResponse::Ok();
        if let Some(next) = &next {
            response.insert_header(("x-next-cursor", next.as_str()));
        }
        let stamp = chrono::Utc::now().format("%Y%m%dT%H%M%S%3fZ");
        return Ok(response
            .content_type("text/csv; charset=utf-8")
            .insert_header((
                CONTENT_DISPOSITION,
                format!("attachment; filename=billing-usage-history-{stamp}.csv"),
            ))
            .body(csv_of(&page.entries)?));
    }
    let data: Vec<Value> = page.entries.iter().map(entry_json).collect();
    Ok(HttpResponse::Ok().json(json!({"data": data, "nextCursor": next})))
}

fn wants_csv(request: &HttpRequest) -> bool {
    request
        .headers()
        .get(ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/csv"))
}

/// Usage entries as CSV, the columns of the JSON entries.
pub(crate) fn csv_of(entries: &[billing_pb::UsageEntry]) -> Result<Vec<u8>, ApiError> {
    let failed = |e: &dyn std::fmt::Display| rialto_core::Error::internal(format_args!("csv: {e}"));
    let mut writer = csv::Writer::from_writer(Vec::new());
    writer
        .write_record([
            "timestamp",
            "sku",
            "currency",
            "amount",
            "units",
            "pricePerUnitUsd",
            "requestId",
            "promptTokens",
            "completionTokens",
            "notes",
        ])
        .map_err(|e| failed(&e))?;
    for entry in entries {
        let json = entry_json(entry);
        let field = |name: &str| match &json[name] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        writer
            .write_record([
                field("timestamp"),
                field("sku"),
                field("currency"),
                field("amount"),
                field("units"),
                field("pricePerUnitUsd"),
                format!("chatcmpl-{}", entry.request_id),
                entry.prompt_tokens.to_string(),
                entry.completion_tokens.to_string(),
                "API Inference".to_owned(),
            ])
            .map_err(|e| failed(&e))?;
    }
    Ok(writer.into_inner().map_err(|e| failed(&e))?)
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AnalyticsQuery {
    lookback: Option<String>,
    start_date: Option<String>,
    end_date: Option<String>,
}

/// The most days analytics cover.
const MAX_DAYS: i64 = 90;
const DAY_MS: i64 = 86_400_000;
/// Models and keys the daily charts show.
const TOP: usize = 8;

/// The days `[first, last]` (days since the epoch) and the `lookback`
/// label a query asks for.
fn analytics_range(query: &AnalyticsQuery, today: i64) -> Result<(i64, i64, String), ApiError> {
    let mut details = Details::new();
    let day_of =
        |details: &mut Details, field: &str, text: &str| match chrono::NaiveDate::parse_from_str(
            text, "%Y-%m-%d",
        ) {
            Ok(date) if text.len() == 10 => Some(
                date.and_time(chrono::NaiveTime::MIN)
                    .and_utc()
                    .timestamp_millis()
                    .div_euclid(DAY_MS),
            ),
            _ => {
                details.push(&[field], "Expected a date YYYY-MM-DD");
                None
            }
        };
    let range = match (&query.start_date, &query.end_date) {
        (Some(start), Some(end)) => {
            let first = day_of(&mut details, "startDate", start);
            let last = day_of(&mut details, "endDate", end);
            match (first, last) {
                (Some(first), Some(last)) if last < first => {
                    details.push(&["endDate"], "Must not be before startDate");
                    None
                }
                (Some(first), Some(last)) if last - first >= MAX_DAYS => {
                    details.push(&["endDate"], format!("At most {MAX_DAYS} days of usage"));
                    None
                }
                (Some(first), Some(last)) => Some((first, last, format!("{start}:{end}"))),
                _ => None,
            }
        }
        (Some(_), None) => {
            details.push(&["endDate"], "Required with startDate");
            None
        }
        (None, Some(_)) => {
            details.push(&["startDate"], "Required with endDate");
            None
        }
        (None, None) => {
            let lookback = query.lookback.as_deref().unwrap_or("7d");
            let days = lookback
                .strip_suffix('d')
                .filter(|n| !n.starts_with('0'))
                .and_then(|n| n.parse::<i64>().ok())
                .filter(|n| (1..=MAX_DAYS).contains(n));
            match days {
                Some(days) => Some((today - days + 1, today, lookback.to_owned())),
                None => {
                    details.push(
                        &["lookback"],
                        format!("Expected a number of days from 1d to {MAX_DAYS}d, such as 7d"),
                    );
                    None
                }
            }
        }
    };
    details.into_result()?;
    range.ok_or_else(|| ApiError::validation(Details::new()))
}

/// Sums per name, and per name and day, in USD and DIEM.
#[derive(Default)]
struct Tally {
    usd: rust_decimal::Decimal,
    diem: rust_decimal::Decimal,
    units: u64,
    by_day: std::collections::BTreeMap<i64, rust_decimal::Decimal>,
}

impl Tally {
    fn add(&mut self, group: &billing_pb::UsageGroup, amount: rust_decimal::Decimal, units: u64) {
        if group.currency == "DIEM" {
            self.diem += amount;
        } else {
            self.usd += amount;
        }
        self.units = self.units.saturating_add(units);
        *self.by_day.entry(group.day).or_default() += amount;
    }

    fn total(&self) -> rust_decimal::Decimal {
        self.usd + self.diem
    }
}

fn decimal_json(amount: rust_decimal::Decimal) -> Value {
    number(&amount.normalize().to_string())
}

/// The top [`TOP`] tallies' amounts per day: `[{date, <name>: amount}]`,
/// one entry per day of the range.
fn daily_chart(ranked: &[(String, &Tally)], first: i64, last: i64) -> (Vec<Value>, Vec<String>) {
    let top: Vec<&(String, &Tally)> = ranked.iter().take(TOP).collect();
    let chart = (first..=last)
        .map(|day| {
            let mut entry = serde_json::Map::new();
            entry.insert("date".to_owned(), json!(day * DAY_MS));
            for (name, tally) in &top {
                let amount = tally.by_day.get(&day).copied().unwrap_or_default();
                entry.insert(name.clone(), decimal_json(amount));
            }
            Value::Object(entry)
        })
        .collect();
    (chart, top.iter().map(|(name, _)| name.clone()).collect())
}

/// The units a model's usage is counted in, and its type, as the hosted
/// analytics name them.
fn unit_and_type(model: Option<&rialto_core::config::ModelConfig>) -> (&'static str, Value) {
    match model.map(|m| m.model_type.as_str()) {
        Some("image" | "upscale" | "inpaint") => ("images", json!("IMAGE")),
        Some("tts") => ("chars", json!("TTS")),
        Some("asr") => ("seconds", json!("ASR")),
        Some("video") => ("seconds", json!("VIDEO")),
        Some("embedding") => ("tokens", json!("EMBEDDING")),
        Some(_) => ("tokens", json!("LLM")),
        None => ("requests", Value::Null),
    }
}

/// `GET /billing/usage-analytics?lookback=7d` (or `startDate` and
/// `endDate`): the caller's spend by day, by model and by API key, with the
/// top 8 models' and keys' daily charts. ADMIN key.
pub async fn analytics(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<AnalyticsQuery>,
) -> Result<HttpResponse, ApiError> {
    let today = chrono::Utc::now().timestamp_millis().div_euclid(DAY_MS);
    let range = analytics_range(&query, today)?;
    let principal = authenticate_endpoint(&gateway, &request, true).await?;
    let owner = crate::ledger_owner(&principal);
    analytics_of(&gateway, &owner, &principal.account_id, range).await
}

/// The operator's `GET /admin/v1/accounts/{id}/usage`: the account's
/// analytics, as its own ADMIN key reads them.
pub(crate) async fn account_analytics(
    gateway: &Gateway,
    account: &rialto_proto::auth::v1::Account,
    query: &AnalyticsQuery,
) -> Result<HttpResponse, ApiError> {
    let today = chrono::Utc::now().timestamp_millis().div_euclid(DAY_MS);
    let range = analytics_range(query, today)?;
    let owner = crate::operator::ledger_owner_of(account);
    analytics_of(gateway, &owner, &account.id, range).await
}

/// The analytics of `owner` (whose keys are `account_id`'s) over the days
/// of `range`.
async fn analytics_of(
    gateway: &Gateway,
    owner: &str,
    account_id: &str,
    (first, last, label): (i64, i64, String),
) -> Result<HttpResponse, ApiError> {
    let (groups, keys) = tokio::join!(
        gateway
            .services
            .billing
            .usage_analytics(billing_pb::UsageAnalyticsRequest {
                owner: owner.to_owned(),
                start_ms: first * DAY_MS,
                end_ms: (last + 1) * DAY_MS,
                all_owners: false,
            }),
        gateway
            .services
            .auth
            .list_api_keys(rialto_proto::auth::v1::ListApiKeysRequest {
                account_id: account_id.to_owned(),
            }),
    );
    let groups = groups?.groups;
    let catalog = gateway.catalog();
    let descriptions: std::collections::HashMap<String, String> = keys?
        .keys
        .into_iter()
        .map(|k| (k.id, k.description))
        .collect();
    let mut by_date: std::collections::BTreeMap<i64, Tally> =
        (first..=last).map(|day| (day, Tally::default())).collect();
    let mut by_model: std::collections::HashMap<String, Tally> = Default::default();
    let mut by_key: std::collections::HashMap<String, Tally> = Default::default();
    for group in &groups {
        let amount: rust_decimal::Decimal = group.amount.parse().unwrap_or_default();
        let model = catalog.model(&group.model_id).map(|m| &m.config);
        let units = match unit_and_type(model).0 {
            "tokens" => group.prompt_tokens.saturating_add(group.completion_tokens),
            _ => group.requests,
        };
        if let Some(day) = by_date.get_mut(&group.day) {
            day.add(group, amount, units);
        }
        by_model
            .entry(group.model_id.clone())
            .or_default()
            .add(group, amount, units);
        by_key
            .entry(group.key_id.clone())
            .or_default()
            .add(group, amount, units);
    }
    fn ranked(tallies: &std::collections::HashMap<String, Tally>) -> Vec<(String, &Tally)> {
        let mut ranked: Vec<(&String, &Tally)> = tallies.iter().collect();
        // Highest spend first; ties by name, so the order is stable.
        ranked.sort_by(|a, b| b.1.total().cmp(&a.1.total()).then(a.0.cmp(b.0)));
        ranked
            .into_iter()
            .map(|(name, tally)| (name.clone(), tally))
            .collect()
    }
    let date_text = |day: i64| {
        DateTime::from_timestamp_millis(day * DAY_MS)
            .map(|t| t.format("%Y-%m-%d").to_string())
            .unwrap_or_default()
    };
    let models = ranked(&by_model);
    let model_name = |id: &str| {
        catalog
            .model(id)
            .map_or_else(|| id.to_owned(), |m| m.config.display_name().to_owned())
    };
    let by_model_json: Vec<Value> = models
        .iter()
        .map(|(id, tally)| {
            let (unit, kind) = unit_and_type(catalog.model(id).map(|m| &m.config));
            json!({
                "modelName": model_name(id),
                "unitType": unit,
                "modelType": kind,
                "totalUsd": decimal_json(tally.usd),
                "totalDiem": decimal_json(tally.diem),
                "totalUnits": tally.units,
            })
        })
        .collect();
    let named_models: Vec<(String, &Tally)> = models
        .iter()
        .map(|(id, tally)| (model_name(id), *tally))
        .collect();
    let (by_model_daily, top_models) = daily_chart(&named_models, first, last);
    let keys = ranked(&by_key);
    let key_name = |id: &str| {
        if id.is_empty() {
            NO_KEY.to_owned()
        } else {
            descriptions
                .get(id)
                .cloned()
                .unwrap_or_else(|| "Deleted API key".to_owned())
        }
    };
    let by_key_json: Vec<Value> = keys
        .iter()
        .map(|(id, tally)| {
            json!({
                "apiKeyId": Some(id).filter(|id| !id.is_empty()),
                "description": key_name(id),
                "totalUsd": decimal_json(tally.usd),
                "totalDiem": decimal_json(tally.diem),
                "totalUnits": tally.units,
            })
        })
        .collect();
    let named_keys: Vec<(String, &Tally)> = keys
        .iter()
        .map(|(id, tally)| (key_name(id), *tally))
        .collect();
    let (by_key_daily, top_keys) = daily_chart(&named_keys, first, last);
    let by_date_json: Vec<Value> = by_date
        .iter()
        .map(|(day, tally)| {
            json!({"date": date_text(*day), "USD": decimal_json(tally.usd),
                "DIEM": decimal_json(tally.diem)})
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "lookback": label,
        "byDate": by_date_json,
        "byModel": by_model_json,
        "byModelDaily": by_model_daily,
        "topModels": top_models,
        "byKey": by_key_json,
        "byKeyDaily": by_key_daily,
        "topKeyNames": top_keys,
    })))
}

/// What `byKey` calls spend no API key made: a wallet's signed-in
/// requests (the hosted API's requests from its web app).
const NO_KEY: &str = "Without an API key";
