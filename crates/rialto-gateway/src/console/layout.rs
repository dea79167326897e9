//! The console's page frame and the pieces pages share: navigation, forms'
//! CSRF field, tables, charts, and how times and amounts read.

use maud::{DOCTYPE, Markup, html};
use rust_decimal::Decimal;
use rust_decimal::prelude::ToPrimitive;
use serde_json::json;

use super::Visitor;
use super::session::Principal;

/// Assets' URLs carry the build, so a new binary's are fetched anew.
fn asset(name: &str) -> String {
    format!("/console/assets/{name}?v={}", env!("CARGO_PKG_VERSION"))
}

fn head(title: &str) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            meta name="referrer" content="same-origin";
            title { (title) " · Console" }
            link rel="stylesheet" href=(asset("uPlot.min.css"));
            link rel="stylesheet" href=(asset("app.css"));
            script src=(asset("uPlot.iife.min.js")) defer {}
            script src=(asset("app.js")) defer {}
        }
    }
}

/// A page without navigation: sign-in, errors.
pub fn bare(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body {
                a.skip href="#main" { "Skip to content" }
                header.top {
                    span.brand { "Console" }
                }
                main #main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    }
}

const OPERATOR_NAV: &[(&str, &str)] = &[
    ("/console/accounts", "Accounts"),
    ("/console/models", "Models"),
    ("/console/spend", "Spend"),
    ("/console/rate-limits", "Rate limits"),
    ("/console/top-ups", "Top-ups"),
];

const ACCOUNT_NAV: &[(&str, &str)] = &[
    ("/console/account", "Overview"),
    ("/console/account/usage", "Usage"),
    ("/console/account/keys", "API keys"),
    ("/console/account/limits", "Rate limits"),
];

/// A signed-in page: navigation for who is signed in, the sign-out form,
/// an optional status message, then `body`.
pub fn page(
    visitor: &Visitor,
    current: &str,
    title: &str,
    notice: Option<&str>,
    body: Markup,
) -> Markup {
    let (nav, who) = match &visitor.claims.principal {
        Principal::Operator { .. } => (OPERATOR_NAV, "Operator".to_owned()),
        Principal::Key { .. } => (ACCOUNT_NAV, "Account (API key)".to_owned()),
        Principal::Wallet { address } => (ACCOUNT_NAV, format!("Wallet {}", short(address))),
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body {
                a.skip href="#main" { "Skip to content" }
                header.top {
                    span.brand { "Console" }
                    nav aria-label="Console" {
                        ul {
                            @for (href, label) in nav {
                                li {
                                    @if *href == current {
                                        a href=(href) aria-current="page" { (label) }
                                    } @else {
                                        a href=(href) { (label) }
                                    }
                                }
                            }
                        }
                    }
                    div.who {
                        span { (who) }
                        form #logout method="post" action="/console/logout" {
                            (csrf(visitor))
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                main #main {
                    h1 { (title) }
                    @if let Some(notice) = notice {
                        div.notice role="status" { (notice) }
                    }
                    (body)
                }
            }
        }
    }
}

/// The hidden CSRF field every form carries.
pub fn csrf(visitor: &Visitor) -> Markup {
    html! { input type="hidden" name="csrf" value=(visitor.csrf); }
}

/// `0x1234…abcd`.
pub fn short(address: &str) -> String {
    if address.len() > 12 {
        format!("{}…{}", &address[..6], &address[address.len() - 4..])
    } else {
        address.to_owned()
    }
}

/// A time in UTC, to the minute.
pub fn time(ms: i64) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp_millis(ms)
        .map(|t| t.format("%Y-%m-%d %H:%M UTC").to_string())
        .unwrap_or_default()
}

pub fn date(day: i64) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp(day * 86_400, 0)
        .map(|t| t.format("%Y-%m-%d").to_string())
        .unwrap_or_default()
}

/// A series of a chart over days: its name and one exact value a day. A
/// series of counts (`count`) is drawn against an axis of its own.
pub struct Series {
    pub label: String,
    pub values: Vec<Decimal>,
    pub count: bool,
}

/// A chart over `days` (days since the epoch): uPlot draws it from the
/// JSON block `<id>-data`; the same figures are a table below it (the
/// table is what a screen reader, and a browser without script, reads).
pub fn chart(id: &str, caption: &str, unit: &str, days: &[i64], series: &[Series]) -> Markup {
    let data = json!({
        "unit": unit,
        "x": days.iter().map(|d| d * 86_400).collect::<Vec<_>>(),
        "series": series.iter().map(|s| json!({
            "label": s.label,
            "count": s.count,
            "values": s.values.iter().map(|v| v.to_f64().unwrap_or(0.0)).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    });
    let chart_id = format!("{id}-chart");
    let data_id = format!("{id}-data");
    let table_id = format!("{id}-table");
    html! {
        figure.chart-figure {
            div.chart #(chart_id) data-chart=(data_id) role="img" aria-label=(format!("Chart: {caption}")) {}
            script type="application/json" #(data_id) { (maud::PreEscaped(json_for_script(&data))) }
            div.scroll {
                table #(table_id) {
                    caption { (caption) }
                    thead {
                        tr {
                            th scope="col" { "Date" }
                            @for s in series { th scope="col" { (s.label) } }
                        }
                    }
                    tbody {
                        @for (i, day) in days.iter().enumerate() {
                            tr {
                                th scope="row" { (date(*day)) }
                                @for s in series {
                                    td.num { (number(s.values.get(i).copied().unwrap_or_default())) }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// JSON safe inside `<script>`: no `</script>` or `<!--` can close it.
fn json_for_script(value: &serde_json::Value) -> String {
    value
        .to_string()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
}

/// An exact figure, without trailing zeros.
pub fn number(value: Decimal) -> String {
    value.normalize().to_string()
}

/// A key's cap, as one line.
pub fn cap(limit: Option<&rialto_proto::auth::v1::ConsumptionLimit>) -> String {
    let Some(limit) = limit else {
        return "none".to_owned();
    };
    let mut parts = Vec::new();
    if let Some(usd) = limit.usd_nanos {
        parts.push(format!("${}", rialto_billing::from_nanos(usd)));
    }
    if let Some(diem) = limit.diem_nanos {
        parts.push(format!("{} DIEM", rialto_billing::from_nanos(diem)));
    }
    if parts.is_empty() {
        return "none".to_owned();
    }
    let period = if limit.period.is_empty() {
        "LIFETIME"
    } else {
        &limit.period
    };
    format!("{} per {}", parts.join(" + "), period.to_lowercase())
}

/// The key-creating form, the same for the operator and an account holder.
pub fn key_form(visitor: &Visitor, action: &str) -> Markup {
    html! {
        form #create-key method="post" action=(action) class="stack" {
            (csrf(visitor))
            div.field {
                label for="key-description" { "Description" }
                input #key-description name="description" required maxlength="64" value="Console key";
            }
            div.field {
                label for="key-type" { "Type" }
                select #key-type name="type" {
                    option value="INFERENCE" selected { "INFERENCE (calls the models)" }
                    option value="ADMIN" { "ADMIN (also manages keys and billing)" }
                }
            }
            div.field {
                label for="key-usd-cap" { "USD cap (optional)" }
                input #key-usd-cap name="usd_cap" inputmode="decimal" placeholder="e.g. 5";
            }
            div.field {
                label for="key-diem-cap" { "DIEM cap (optional)" }
                input #key-diem-cap name="diem_cap" inputmode="decimal" placeholder="e.g. 10";
            }
            div.field {
                label for="key-period" { "Cap period" }
                select #key-period name="period" {
                    option value="LIFETIME" { "Lifetime" }
                    option value="MONTH" { "Month" }
                    option value="EPOCH" { "Day (epoch)" }
                }
            }
            button type="submit" { "Create key" }
        }
    }
}

/// A key's secret, shown once after it is made.
pub fn new_key(secret: &str) -> Markup {
    html! {
        div.new-key role="status" {
            p { strong { "Copy this key now: it is not shown again." } }
            p { code #new-key { (secret) } }
        }
    }
}

/// An account's keys, each with its revoke form posting to
/// `<revoke_base>/<id>/revoke`.
pub fn keys_table(
    visitor: &Visitor,
    keys: &[rialto_proto::auth::v1::ApiKeyRecord],
    revoke_base: &str,
) -> Markup {
    html! {
        div.scroll {
            table #keys {
                caption { "API keys" }
                thead {
                    tr {
                        th scope="col" { "Description" }
                        th scope="col" { "Type" }
                        th scope="col" { "Ends with" }
                        th scope="col" { "Created" }
                        th scope="col" { "Last used" }
                        th scope="col" { "Cap" }
                        th scope="col" { span.visually-hidden { "Actions" } }
                    }
                }
                tbody {
                    @if keys.is_empty() {
                        tr { td colspan="7" { "No keys." } }
                    }
                    @for key in keys {
                        tr data-key-id=(key.id) {
                            td { (key.description) }
                            td { (key_type(key.key_type)) }
                            td { code { "…" (key.last6_chars) } }
                            td { (time(key.created_at_ms)) }
                            td { (key.last_used_at_ms.map(time).unwrap_or_else(|| "never".to_owned())) }
                            td { (cap(key.limit.as_ref())) }
                            td {
                                form.revoke-key method="post" action=(format!("{revoke_base}/{}/revoke", key.id)) {
                                    (csrf(visitor))
                                    button.danger type="submit" aria-label=(format!("Revoke key {}", key.description)) { "Revoke" }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

pub fn key_type(key_type: i32) -> &'static str {
    if key_type == rialto_proto::auth::v1::KeyType::Admin as i32 {
        "ADMIN"
    } else {
        "INFERENCE"
    }
}

/// Recent rate-limit hits.
pub fn hits_table(
    id: &str,
    hits: &[rialto_proto::limiter::v1::LimitHit],
    with_account: bool,
) -> Markup {
    html! {
        div.scroll {
            table #(id) {
                caption { "Rate-limit hits (newest first)" }
                thead {
                    tr {
                        th scope="col" { "When" }
                        @if with_account { th scope="col" { "Account" } }
                        th scope="col" { "Key" }
                        th scope="col" { "Model or endpoint" }
                        th scope="col" { "Tier" }
                        th scope="col" { "Limit" }
                    }
                }
                tbody {
                    @if hits.is_empty() {
                        tr { td colspan=(if with_account { "6" } else { "5" }) { "No hits." } }
                    }
                    @for hit in hits {
                        tr {
                            td { (time(hit.at_ms)) }
                            @if with_account {
                                td {
                                    @if hit.account_id.starts_with("wallet:") {
                                        (hit.account_id)
                                    } @else {
                                        a href=(format!("/console/accounts/{}", hit.account_id)) { (hit.account_id) }
                                    }
                                }
                            }
                            td { (hit.api_key_id) }
                            td { (hit.model_id) }
                            td { (hit.tier) }
                            td { (hit.limit_type) }
                        }
                    }
                }
            }
        }
    }
}

/// Usage groups summed by day (and by model), exactly.
pub struct Daily {
    pub days: Vec<i64>,
    pub usd: Vec<Decimal>,
    pub diem: Vec<Decimal>,
    pub requests: Vec<Decimal>,
    /// USD, DIEM and requests per model over the range, most spent first.
    pub by_model: Vec<(String, Decimal, Decimal, u64)>,
}

impl Daily {
    pub fn of(groups: &[rialto_proto::billing::v1::UsageGroup], first: i64, last: i64) -> Self {
        let days: Vec<i64> = (first..=last).collect();
        let n = days.len();
        let zero = || vec![Decimal::ZERO; n];
        let (mut usd, mut diem, mut requests) = (zero(), zero(), zero());
        let mut by_model: std::collections::BTreeMap<String, (Decimal, Decimal, u64)> =
            Default::default();
        for group in groups {
            let amount: Decimal = group.amount.parse().unwrap_or_default();
            let model = by_model.entry(group.model_id.clone()).or_default();
            model.2 += group.requests;
            if group.currency == "DIEM" {
                model.1 += amount;
            } else {
                model.0 += amount;
            }
            let Some(i) = usize::try_from(group.day - first).ok().filter(|i| *i < n) else {
                continue;
            };
            requests[i] += Decimal::from(group.requests);
            if group.currency == "DIEM" {
                diem[i] += amount;
            } else {
                usd[i] += amount;
            }
        }
        let mut by_model: Vec<(String, Decimal, Decimal, u64)> = by_model
            .into_iter()
            .map(|(model, (usd, diem, requests))| (model, usd, diem, requests))
            .collect();
        by_model.sort_by_key(|model| std::cmp::Reverse(model.1 + model.2));
        Self {
            days,
            usd,
            diem,
            requests,
            by_model,
        }
    }

    /// The usual three series: USD, DIEM, and requests on their own axis.
    pub fn series(&self) -> Vec<Series> {
        vec![
            Series {
                label: "USD".into(),
                values: self.usd.clone(),
                count: false,
            },
            Series {
                label: "DIEM".into(),
                values: self.diem.clone(),
                count: false,
            },
            Series {
                label: "Requests".into(),
                values: self.requests.clone(),
                count: true,
            },
        ]
    }
}

/// The days of the last `days` days, today included, and the range in ms.
pub fn last_days(days: i64) -> (i64, i64) {
    let today = chrono::Utc::now().timestamp().div_euclid(86_400);
    (today - days + 1, today)
}

/// `?days=` of a usage page: 7, 30 or 90.
pub fn days_param(query: &std::collections::HashMap<String, String>) -> i64 {
    match query.get("days").map(String::as_str) {
        Some("7") => 7,
        Some("90") => 90,
        _ => 30,
    }
}

/// The by-model table under a usage chart.
pub fn by_model_table(daily: &Daily) -> Markup {
    html! {
        div.scroll {
            table #by-model {
                caption { "By model" }
                thead { tr { th scope="col" { "Model" } th scope="col" { "USD" } th scope="col" { "DIEM" } th scope="col" { "Requests" } } }
                tbody {
                    @if daily.by_model.is_empty() { tr { td colspan="4" { "No usage in this range." } } }
                    @for (model, usd, diem, requests) in &daily.by_model {
                        tr { th scope="row" { (model) } td.num { (number(*usd)) } td.num { (number(*diem)) } td.num { (requests) } }
                    }
                }
            }
        }
    }
}

/// Links to the other ranges of a usage page.
pub fn range_links(base: &str, days: i64) -> Markup {
    html! {
        p.ranges {
            "Range: "
            @for choice in [7, 30, 90] {
                @if choice == days {
                    strong aria-current="true" { (choice) " days" }
                } @else {
                    a href=(format!("{base}?days={choice}")) { (choice) " days" }
                }
                " "
            }
        }
    }
}
