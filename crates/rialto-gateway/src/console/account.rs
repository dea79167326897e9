//! An account holder's pages, signed in with an ADMIN key or a wallet:
//! balance, usage (chart and CSV), keys (create with caps, the secret once,
//! revoke), rate limits and their hits. What a page shows is what the same
//! principal's API calls answer.

use std::collections::HashMap;

use actix_web::http::header::{CACHE_CONTROL, CONTENT_DISPOSITION};
use actix_web::{HttpRequest, HttpResponse, web};
use maud::html;
use rialto_limiter::{Caller, Target};
use rialto_proto::auth::v1 as auth_pb;
use rialto_proto::billing::v1 as billing_pb;

use super::layout::{self, Daily, number};
use super::session::Principal;
use super::{Refusal, Reply, Visitor, html, posted, redirect, visitor};
use crate::Gateway;
use crate::operator::ledger_owner_of;

/// Whose pages these are.
struct Holder {
    /// The account: a key's, or the wallet's once it has one (its first
    /// web3 key made it).
    account: Option<auth_pb::Account>,
    /// The ledger the balance and usage are read from.
    owner: String,
    /// Whom the limiter counts (`wallet:<address>` for a wallet).
    limits_id: String,
    key_id: String,
    tier: String,
    wallet: Option<String>,
}

async fn holder(gateway: &Gateway, request: &HttpRequest) -> Result<(Visitor, Holder), Refusal> {
    let visitor = visitor(gateway, request).await?;
    let holder = match &visitor.claims.principal {
        Principal::Operator { .. } => {
            return Err(Refusal::Forbidden(
                "These pages are an account holder's: the operator sees accounts under Accounts.",
            ));
        }
        Principal::Key { account, key } => {
            let account = gateway
                .services
                .auth
                .get_account(auth_pb::GetAccountRequest {
                    account_id: account.clone(),
                })
                .await?;
            Holder {
                owner: ledger_owner_of(&account),
                limits_id: account.id.clone(),
                key_id: key.clone(),
                tier: account.tier.clone(),
                wallet: Some(account.wallet.clone()).filter(|w| !w.is_empty()),
                account: Some(account),
            }
        }
        Principal::Wallet { address } => {
            let account = gateway
                .services
                .auth
                .get_account(auth_pb::GetAccountRequest {
                    account_id: rialto_auth::wallet_account_id(address),
                })
                .await
                .ok();
            Holder {
                owner: rialto_billing::wallet_owner(address),
                limits_id: format!("wallet:{address}"),
                key_id: format!("wallet:{address}"),
                tier: account
                    .as_ref()
                    .map_or_else(|| gateway.wallet.tier.clone(), |a| a.tier.clone()),
                wallet: Some(address.clone()),
                account,
            }
        }
    };
    Ok((visitor, holder))
}

/// `GET /console/account`: balances.
pub async fn overview(gateway: web::Data<Gateway>, request: HttpRequest) -> Reply {
    let (visitor, holder) = holder(&gateway, &request).await?;
    let balance = gateway
        .services
        .billing
        .get_balance(billing_pb::GetBalanceRequest {
            owner: holder.owner.clone(),
        })
        .await?;
    let positive = |text: &str| text.parse::<f64>().is_ok_and(|n| n > 0.0);
    let can_consume = positive(&balance.usd) || positive(&balance.diem);
    let body = html! {
        dl.summary {
            @if let Some(account) = &holder.account {
                div { dt { "Account" } dd { (account.name) } }
            }
            @if let Some(wallet) = &holder.wallet {
                div { dt { "Wallet" } dd { code { (wallet) } } }
            }
            div { dt { "USD balance" } dd #balance-usd { (balance.usd) } }
            div { dt { "USD held by requests in flight" } dd #usd-held { (balance.usd_held) } }
            div { dt { "DIEM balance" } dd #balance-diem { (balance.diem) } }
            div { dt { "DIEM granted per day" } dd #diem-per-day { (balance.diem_per_day) } }
            div { dt { "Can make paid requests" } dd #can-consume { @if can_consume { "yes" } @else { "no" } } }
            div { dt { "Rate-limit tier" } dd { (holder.tier) } }
        }
        @if holder.wallet.is_some() && !can_consume {
            p.hint { "Top up with a stablecoin payment: POST /api/v1/x402/top-up (x402)." }
        }
        p { a href="/console/account/usage" { "See usage" } " · " a href="/console/account/keys" { "Manage API keys" } }
    };
    Ok(html(layout::page(
        &visitor,
        "/console/account",
        "Your account",
        None,
        body,
    )))
}

/// `GET /console/account/usage?days=`: spend by day, and by model.
pub async fn usage(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<HashMap<String, String>>,
) -> Reply {
    let (visitor, holder) = holder(&gateway, &request).await?;
    let days = layout::days_param(&query);
    let (first, last) = layout::last_days(days);
    let groups = gateway
        .services
        .billing
        .usage_analytics(billing_pb::UsageAnalyticsRequest {
            owner: holder.owner.clone(),
            start_ms: first * 86_400_000,
            end_ms: (last + 1) * 86_400_000,
            all_owners: false,
        })
        .await?
        .groups;
    let daily = Daily::of(&groups, first, last);
    let total = |values: &[rust_decimal::Decimal]| values.iter().sum::<rust_decimal::Decimal>();
    let body = html! {
        (layout::range_links("/console/account/usage", days))
        dl.summary {
            div { dt { "USD spent" } dd #usd-spent { (number(total(&daily.usd))) } }
            div { dt { "DIEM spent" } dd #diem-spent { (number(total(&daily.diem))) } }
            div { dt { "Requests" } dd #requests { (number(total(&daily.requests))) } }
        }
        (layout::chart("usage", &format!("Spend and requests by day, last {days} days"), "USD", &daily.days, &daily.series()))
        (layout::by_model_table(&daily))
        p { a #usage-csv href=(format!("/console/account/usage.csv?days={days}")) download { "Download every request as CSV" } }
    };
    Ok(html(layout::page(
        &visitor,
        "/console/account/usage",
        "Usage",
        None,
        body,
    )))
}

/// The most rows one CSV export holds.
const CSV_MAX_ROWS: usize = 50_000;

/// `GET /console/account/usage.csv?days=`: each charge of the range, as
/// `/billing/usage` writes CSV.
pub async fn usage_csv(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<HashMap<String, String>>,
) -> Reply {
    let (_, holder) = holder(&gateway, &request).await?;
    let days = layout::days_param(&query);
    let (first, last) = layout::last_days(days);
    let mut entries = Vec::new();
    let (mut after_at_ms, mut after_id) = (0, String::new());
    loop {
        let page = gateway
            .services
            .billing
            .usage_history(billing_pb::UsageHistoryRequest {
                owner: holder.owner.clone(),
                start_ms: first * 86_400_000,
                end_ms: (last + 1) * 86_400_000,
                limit: 500,
                walk: true,
                after_at_ms,
                after_id: after_id.clone(),
                ..Default::default()
            })
            .await?;
        let more = page.more;
        if let Some(last) = page.entries.last() {
            after_at_ms = last.at_ms;
            after_id = last.id.clone();
        }
        entries.extend(page.entries);
        if !more || entries.len() >= CSV_MAX_ROWS {
            break;
        }
    }
    let body = crate::usage::csv_of(&entries)?;
    Ok(HttpResponse::Ok()
        .content_type("text/csv; charset=utf-8")
        .insert_header((CACHE_CONTROL, "no-store"))
        .insert_header((
            CONTENT_DISPOSITION,
            format!(
                "attachment; filename=\"usage-{}-{}.csv\"",
                layout::date(first),
                layout::date(last)
            ),
        ))
        .body(body))
}

async fn keys_page(
    gateway: &Gateway,
    visitor: &Visitor,
    holder: &Holder,
    new_key: Option<&str>,
    notice: Option<&str>,
) -> Reply {
    let keys = match &holder.account {
        Some(account) => {
            gateway
                .services
                .auth
                .list_api_keys(auth_pb::ListApiKeysRequest {
                    account_id: account.id.clone(),
                })
                .await?
                .keys
        }
        None => Vec::new(),
    };
    let body = html! {
        @if let Some(secret) = new_key { (layout::new_key(secret)) }
        (layout::keys_table(visitor, &keys, "/console/account/keys"))
        section aria-labelledby="create-heading" {
            h2 #create-heading { "Create a key" }
            @if holder.account.is_some() {
                (layout::key_form(visitor, "/console/account/keys"))
            } @else {
                p { "A wallet's first key is made by signing for it: "
                    code { "GET /api/v1/api_keys/generate_web3_key" } ", then "
                    code { "POST" } " it back signed. Its keys are listed here after that." }
            }
        }
    };
    Ok(html(layout::page(
        visitor,
        "/console/account/keys",
        "API keys",
        notice,
        body,
    )))
}

/// `GET /console/account/keys`.
pub async fn keys(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<HashMap<String, String>>,
) -> Reply {
    let (visitor, holder) = holder(&gateway, &request).await?;
    let notice = query
        .get("done")
        .filter(|d| *d == "revoked")
        .map(|_| "Key revoked: it stops working at once.");
    keys_page(&gateway, &visitor, &holder, None, notice).await
}

/// `POST /console/account/keys`: the key, checked as `POST /api_keys`
/// checks it; its secret on the page once.
pub async fn create_key(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    body: web::Bytes,
) -> Reply {
    let (_, form) = posted(&gateway, &request, &body).await?;
    let (visitor, holder) = holder(&gateway, &request).await?;
    let Some(account) = &holder.account else {
        return Err(Refusal::Forbidden(
            "This wallet has no account yet: make its first key by signing (generate_web3_key).",
        ));
    };
    let created = crate::keys::create_key(
        &gateway,
        account.id.clone(),
        &super::operator::key_body(&form),
    )
    .await?;
    keys_page(
        &gateway,
        &visitor,
        &holder,
        Some(&created.secret),
        Some("Key created."),
    )
    .await
}

/// `POST /console/account/keys/{key}/revoke`.
pub async fn revoke_key(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    body: web::Bytes,
) -> Reply {
    posted(&gateway, &request, &body).await?;
    let (_, holder) = holder(&gateway, &request).await?;
    let Some(account) = &holder.account else {
        return Err(Refusal::NotFound);
    };
    gateway
        .services
        .auth
        .delete_api_key(auth_pb::DeleteApiKeyRequest {
            account_id: account.id.clone(),
            id: path.into_inner(),
        })
        .await?;
    Ok(redirect("/console/account/keys?done=revoked"))
}

/// `GET /console/account/limits`: each model's windows for this account's
/// tier, and the latest hits.
pub async fn limits(gateway: web::Data<Gateway>, request: HttpRequest) -> Reply {
    let (visitor, holder) = holder(&gateway, &request).await?;
    let hits = gateway
        .services
        .limiter
        .recent_hits(&holder.limits_id)
        .await?;
    let policy = gateway.services.limiter.policy();
    let caller = Caller {
        account_id: &holder.limits_id,
        key_id: &holder.key_id,
        tier: &holder.tier,
    };
    let catalog = gateway.catalog();
    let body = html! {
        p.hint { "Tier " strong { (holder.tier) } ". Each window counts per API key; requests past it are refused with 429 until it frees." }
        div.scroll {
            table #rate-limits {
                caption { "Limits per model" }
                thead {
                    tr {
                        th scope="col" { "Model" }
                        th scope="col" { "Requests a minute" }
                        th scope="col" { "Requests a day" }
                        th scope="col" { "Tokens a minute" }
                    }
                }
                tbody {
                    @for model in &catalog.models {
                        @let limit = policy.key_limit(caller, Target::model(&model.config));
                        tr {
                            th scope="row" { (model.config.id) }
                            @match limit {
                                Some(limit) => {
                                    td.num { (limit.rpm) }
                                    td.num { (limit.rpd.map_or_else(|| "–".to_owned(), |n| n.to_string())) }
                                    td.num { (limit.tpm.map_or_else(|| "–".to_owned(), |n| n.to_string())) }
                                }
                                None => { td colspan="3" { "not limited" } }
                            }
                        }
                    }
                }
            }
        }
        h2 { "Recent hits" }
        (layout::hits_table("limit-hits", &hits, false))
    };
    Ok(html(layout::page(
        &visitor,
        "/console/account/limits",
        "Rate limits",
        None,
        body,
    )))
}
