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
    let (sku, units, price) = match entry.model_id.strip_prefix(rialto_billing::AUGMENT_PREFIX) {
        Some(name) => (format!("augment-{name}"), json!(1), number(&entry.amount)),
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
    let csv = request
        .headers()
        .get(ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/csv"));
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
        let mut writer = csv::Writer::from_writer(Vec::new());
        let write = |writer: &mut csv::Writer<Vec<u8>>, row: &[String]| {
            writer
                .write_record(row)
                .map_err(|e| rialto_core::Error::internal(format_args!("csv: {e}")))
        };
        write(
            &mut writer,
            &[
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
            ]
            .map(str::to_owned),
        )?;
        for entry in &history.entries {
            let json = entry_json(entry);
            let field = |name: &str| match &json[name] {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            write(
                &mut writer,
                &[
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
                ],
            )?;
        }
        let body = writer
            .into_inner()
            .map_err(|e| rialto_core::Error::internal(format_args!("csv: {e}")))?;
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
