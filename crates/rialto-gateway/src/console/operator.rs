//! The operator's pages: accounts (search, paging, creation), one account
//! (balances, stake, tier, keys, usage, limit hits, and the forms that
//! change them), models and backends, spend, the rate-limit log and the
//! top-ups received. Each reads and writes through the services the
//! operator API (`/admin/v1`) uses, with the same checks.

use std::collections::HashMap;

use actix_web::{HttpRequest, web};
use maud::{Markup, html};
use rialto_proto::auth::v1 as auth_pb;
use rialto_proto::billing::v1 as billing_pb;
use serde_json::{Value, json};

use super::layout::{self, Daily, Series, csrf, time};
use super::{Refusal, Reply, Visitor, html, operator_posted, operator_visitor, redirect};
use crate::operator::ledger_owner_of;
use crate::{ApiError, Details, Gateway};

const PAGE_SIZE: u32 = 25;

type Query = web::Query<HashMap<String, String>>;

fn page_number(query: &HashMap<String, String>) -> u32 {
    query
        .get("page")
        .and_then(|p| p.parse::<u32>().ok())
        .filter(|p| *p >= 1)
        .unwrap_or(1)
}

fn tiers(gateway: &Gateway) -> Vec<String> {
    gateway
        .services
        .limiter
        .policy()
        .tiers()
        .map(str::to_owned)
        .collect()
}

/// `GET /console/accounts?search&page`.
pub async fn accounts(gateway: web::Data<Gateway>, request: HttpRequest, query: Query) -> Reply {
    let visitor = operator_visitor(&gateway, &request).await?;
    let search: String = query
        .get("search")
        .map(|s| s.trim().chars().take(200).collect())
        .unwrap_or_default();
    let page = page_number(&query);
    let listed = gateway
        .services
        .auth
        .list_accounts(auth_pb::ListAccountsRequest {
            search: search.clone(),
            limit: PAGE_SIZE,
            offset: u64::from(page - 1) * u64::from(PAGE_SIZE),
        })
        .await?;
    let pages = listed.total.div_ceil(u64::from(PAGE_SIZE)).max(1);
    let link = |page: u64| {
        let mut url = form_urlencoded::Serializer::new(String::new());
        if !search.is_empty() {
            url.append_pair("search", &search);
        }
        url.append_pair("page", &page.to_string());
        format!("/console/accounts?{}", url.finish())
    };
    let body = html! {
        section aria-labelledby="find-heading" {
            h2 #find-heading { "Find an account" }
            form #search method="get" action="/console/accounts" role="search" class="inline" {
                label for="account-search" { "Name or id" }
                input #account-search type="search" name="search" value=(search);
                button type="submit" { "Search" }
            }
            div.scroll {
                table #accounts {
                    caption { (listed.total) " account" @if listed.total != 1 { "s" } @if !search.is_empty() { " matching “" (search) "”" } }
                    thead {
                        tr {
                            th scope="col" { "Name" }
                            th scope="col" { "Id" }
                            th scope="col" { "Tier" }
                            th scope="col" { "Created" }
                            th scope="col" { "Status" }
                        }
                    }
                    tbody {
                        @if listed.accounts.is_empty() { tr { td colspan="5" { "No accounts." } } }
                        @for account in &listed.accounts {
                            tr {
                                td { a href=(format!("/console/accounts/{}", account.id)) { (account.name) } }
                                td { code { (account.id) } }
                                td { (account.tier) }
                                td { (time(account.created_at_ms)) }
                                td { @if account.suspended_at_ms.is_some() { "suspended" } @else { "active" } }
                            }
                        }
                    }
                }
            }
            nav.pager aria-label="Pages of accounts" {
                @if page > 1 { a rel="prev" href=(link(u64::from(page) - 1)) { "Previous" } }
                span { "Page " (page) " of " (pages) }
                @if u64::from(page) < pages { a rel="next" href=(link(u64::from(page) + 1)) { "Next" } }
            }
        }
        section aria-labelledby="create-heading" {
            h2 #create-heading { "Create an account" }
            form #create-account method="post" action="/console/accounts" class="stack" {
                (csrf(&visitor))
                div.field {
                    label for="account-name" { "Name" }
                    input #account-name name="name" required maxlength="128";
                }
                div.field {
                    label for="account-tier" { "Rate-limit tier" }
                    select #account-tier name="tier" {
                        @for tier in tiers(&gateway) {
                            option value=(tier) selected[tier == "standard"] { (tier) }
                        }
                    }
                }
                button type="submit" { "Create account" }
            }
        }
    };
    Ok(html(layout::page(
        &visitor,
        "/console/accounts",
        "Accounts",
        None,
        body,
    )))
}

/// `POST /console/accounts` (`name`, `tier`): the account and its first
/// ADMIN key, shown once.
pub async fn create_account(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    body: web::Bytes,
) -> Reply {
    let form = operator_posted(&gateway, &request, &body).await?;
    let visitor = operator_visitor(&gateway, &request).await?;
    let name = form.get("name");
    let mut details = Details::new();
    if name.is_empty() || name.chars().count() > 128 {
        details.push(&["name"], "Expected 1 to 128 characters");
    }
    let tier = form.get("tier");
    if !tier.is_empty() && !tiers(&gateway).iter().any(|t| t == tier) {
        details.push(&["tier"], "Unknown tier");
    }
    details.into_result()?;
    let created = gateway
        .services
        .auth
        .create_account(auth_pb::CreateAccountRequest {
            name: name.to_owned(),
            tier: tier.to_owned(),
        })
        .await?;
    let secret = created.api_key.map(|k| k.secret).unwrap_or_default();
    let href = format!("/console/accounts/{}", created.account_id);
    let body = html! {
        (layout::new_key(&secret))
        p { "This is the account's first ADMIN key: give it to the account holder." }
        p { a #account-link href=(href) { "Open the account " (name) } }
    };
    Ok(html(layout::page(
        &visitor,
        "/console/accounts",
        "Account created",
        None,
        body,
    )))
}

/// What a redirect back to the account page says (`?done=`): fixed
/// sentences, so a link cannot put words on the page.
fn notice(done: Option<&String>) -> Option<&'static str> {
    Some(match done?.as_str() {
        "credited" => "Credit added.",
        "credit-repeated" => "That credit reference was used already: nothing was added.",
        "tier" => "Tier changed.",
        "stake" => "Stake changed.",
        "suspended" => "Account suspended: its keys stop working at once.",
        "resumed" => "Account resumed.",
        "revoked" => "Key revoked: it stops working at once.",
        _ => return None,
    })
}

async fn existing_account(gateway: &Gateway, id: &str) -> Result<auth_pb::Account, Refusal> {
    Ok(gateway
        .services
        .auth
        .get_account(auth_pb::GetAccountRequest {
            account_id: id.to_owned(),
        })
        .await?)
}

/// `GET /console/accounts/{id}`.
pub async fn account(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    query: Query,
) -> Reply {
    let visitor = operator_visitor(&gateway, &request).await?;
    let body = account_page(&gateway, &visitor, &path, None).await?;
    let account_name = body.1;
    Ok(html(layout::page(
        &visitor,
        "/console/accounts",
        &format!("Account {account_name}"),
        notice(query.get("done")),
        body.0,
    )))
}

/// The account page's body (and the account's name), with a new key's
/// secret when one was just made.
async fn account_page(
    gateway: &Gateway,
    visitor: &Visitor,
    id: &str,
    new_key: Option<&str>,
) -> Result<(Markup, String), Refusal> {
    let account = existing_account(gateway, id).await?;
    let owner = ledger_owner_of(&account);
    let (first, last) = layout::last_days(30);
    let (balance, keys, usage, hits) = tokio::join!(
        gateway
            .services
            .billing
            .get_balance(billing_pb::GetBalanceRequest {
                owner: owner.clone()
            }),
        gateway
            .services
            .auth
            .list_api_keys(auth_pb::ListApiKeysRequest {
                account_id: account.id.clone()
            }),
        gateway
            .services
            .billing
            .usage_analytics(billing_pb::UsageAnalyticsRequest {
                owner: owner.clone(),
                start_ms: first * 86_400_000,
                end_ms: (last + 1) * 86_400_000,
                all_owners: false,
            }),
        gateway.services.limiter.recent_hits(&account.id),
    );
    let (balance, keys, usage, hits) = (balance?, keys?.keys, usage?.groups, hits?);
    let daily = Daily::of(&usage, first, last);
    let base = format!("/console/accounts/{}", account.id);
    let suspended = account.suspended_at_ms.is_some();
    let reference = uuid::Uuid::new_v4().to_string();
    let markup = html! {
        @if let Some(secret) = new_key { (layout::new_key(secret)) }
        section aria-labelledby="summary-heading" {
            h2 #summary-heading { "Summary" }
            dl.summary {
                div { dt { "Id" } dd { code { (account.id) } } }
                @if !account.wallet.is_empty() { div { dt { "Wallet" } dd { code { (account.wallet) } } } }
                div { dt { "Status" } dd #status { @if suspended { "suspended" } @else { "active" } } }
                div { dt { "Tier" } dd #tier-value { (account.tier) } }
                div { dt { "USD balance" } dd #balance-usd { (balance.usd) } }
                div { dt { "USD held by requests in flight" } dd #usd-held { (balance.usd_held) } }
                div { dt { "DIEM balance" } dd #balance-diem { (balance.diem) } }
                div { dt { "DIEM stake (per day)" } dd #stake-value { (balance.diem_per_day) } }
            }
        }
        section aria-labelledby="usage-heading" {
            h2 #usage-heading { "Usage, last 30 days" }
            (layout::chart("usage", "Spend and requests by day", "USD", &daily.days, &daily.series()))
            (layout::by_model_table(&daily))
        }
        section aria-labelledby="keys-heading" {
            h2 #keys-heading { "API keys" }
            (layout::keys_table(visitor, &keys, &format!("{base}/keys")))
            details {
                summary { "Create a key" }
                (layout::key_form(visitor, &format!("{base}/keys")))
            }
        }
        section aria-labelledby="hits-heading" {
            h2 #hits-heading { "Rate-limit hits" }
            (layout::hits_table("limit-hits", &hits, false))
        }
        section aria-labelledby="manage-heading" {
            h2 #manage-heading { "Manage" }
            div.cards {
                form #credit method="post" action=(format!("{base}/credit")) class="card stack" {
                    h3 { "Add credit" }
                    (csrf(visitor))
                    input type="hidden" name="reference" value=(reference);
                    div.field {
                        label for="credit-usd" { "USD" }
                        input #credit-usd name="usd" inputmode="decimal" placeholder="10.00";
                    }
                    div.field {
                        label for="credit-diem" { "DIEM" }
                        input #credit-diem name="diem" inputmode="decimal" placeholder="0";
                    }
                    p.hint { "Reference " code { (reference) } ": sending this form twice adds the credit once." }
                    button type="submit" { "Add credit" }
                }
                form #tier method="post" action=(format!("{base}/tier")) class="card stack" {
                    h3 { "Tier" }
                    (csrf(visitor))
                    div.field {
                        label for="tier-select" { "Rate-limit tier" }
                        select #tier-select name="tier" {
                            @for tier in tiers(gateway) {
                                option value=(tier) selected[tier == account.tier] { (tier) }
                            }
                        }
                    }
                    button type="submit" { "Change tier" }
                }
                form #stake method="post" action=(format!("{base}/stake")) class="card stack" {
                    h3 { "DIEM stake" }
                    (csrf(visitor))
                    div.field {
                        label for="stake-diem" { "DIEM per day" }
                        input #stake-diem name="diem_per_day" inputmode="decimal" value=(balance.diem_per_day) required;
                    }
                    button type="submit" { "Set stake" }
                }
                @if suspended {
                    form #resume method="post" action=(format!("{base}/resume")) class="card stack" {
                        h3 { "Resume" }
                        (csrf(visitor))
                        p { "The account's keys work again." }
                        button type="submit" { "Resume account" }
                    }
                } @else {
                    form #suspend method="post" action=(format!("{base}/suspend")) class="card stack" {
                        h3 { "Suspend" }
                        (csrf(visitor))
                        p { "Every key of the account stops working at once." }
                        button.danger type="submit" { "Suspend account" }
                    }
                }
            }
        }
    };
    Ok((markup, account.name))
}

/// `POST /console/accounts/{id}/credit` (`usd`, `diem`, `reference`).
pub async fn credit(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    body: web::Bytes,
) -> Reply {
    let form = operator_posted(&gateway, &request, &body).await?;
    let account = existing_account(&gateway, &path).await?;
    let (usd, diem) = (form.get("usd"), form.get("diem"));
    if usd.is_empty() && diem.is_empty() {
        let mut details = Details::new();
        details.push(&["usd"], "Enter an amount in USD or DIEM");
        return Err(ApiError::validation(details).into());
    }
    let credited = gateway
        .services
        .billing
        .credit(billing_pb::CreditRequest {
            owner: ledger_owner_of(&account),
            usd: usd.to_owned(),
            diem: diem.to_owned(),
            reference: form.get("reference").to_owned(),
        })
        .await?;
    let done = if credited.applied {
        "credited"
    } else {
        "credit-repeated"
    };
    Ok(redirect(&format!(
        "/console/accounts/{}?done={done}",
        account.id
    )))
}

/// `POST /console/accounts/{id}/tier` (`tier`).
pub async fn tier(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    body: web::Bytes,
) -> Reply {
    let form = operator_posted(&gateway, &request, &body).await?;
    let tier = form.get("tier");
    if !tiers(&gateway).iter().any(|t| t == tier) {
        let mut details = Details::new();
        details.push(
            &["tier"],
            format!(
                "Unknown tier; expected one of: {}",
                tiers(&gateway).join(", ")
            ),
        );
        return Err(ApiError::validation(details).into());
    }
    let account = gateway
        .services
        .auth
        .set_account_tier(auth_pb::SetAccountTierRequest {
            account_id: path.into_inner(),
            tier: tier.to_owned(),
        })
        .await?;
    Ok(redirect(&format!(
        "/console/accounts/{}?done=tier",
        account.id
    )))
}

/// `POST /console/accounts/{id}/stake` (`diem_per_day`).
pub async fn stake(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    body: web::Bytes,
) -> Reply {
    let form = operator_posted(&gateway, &request, &body).await?;
    let account = existing_account(&gateway, &path).await?;
    gateway
        .services
        .billing
        .set_stake(billing_pb::SetStakeRequest {
            owner: ledger_owner_of(&account),
            diem_per_day: form.get("diem_per_day").to_owned(),
        })
        .await?;
    Ok(redirect(&format!(
        "/console/accounts/{}?done=stake",
        account.id
    )))
}

async fn set_suspended(
    gateway: &Gateway,
    request: &HttpRequest,
    id: String,
    body: &web::Bytes,
    suspended: bool,
) -> Reply {
    operator_posted(gateway, request, body).await?;
    let account = gateway
        .services
        .auth
        .set_account_suspended(auth_pb::SetAccountSuspendedRequest {
            account_id: id,
            suspended,
        })
        .await?;
    let done = if suspended { "suspended" } else { "resumed" };
    Ok(redirect(&format!(
        "/console/accounts/{}?done={done}",
        account.id
    )))
}

/// `POST /console/accounts/{id}/suspend`.
pub async fn suspend(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    body: web::Bytes,
) -> Reply {
    set_suspended(&gateway, &request, path.into_inner(), &body, true).await
}

/// `POST /console/accounts/{id}/resume`.
pub async fn resume(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    body: web::Bytes,
) -> Reply {
    set_suspended(&gateway, &request, path.into_inner(), &body, false).await
}

/// The `POST /api_keys` body of the key form's fields: the key is then
/// checked exactly as the API checks it.
pub(super) fn key_body(form: &super::Form) -> Value {
    let mut body = json!({
        "description": form.get("description"),
        "apiKeyType": form.get("type"),
    });
    let amount = |text: &str| serde_json::from_str::<Value>(text).unwrap_or_else(|_| json!(text));
    let (usd, diem) = (form.get("usd_cap"), form.get("diem_cap"));
    if !usd.is_empty() || !diem.is_empty() {
        let mut limit = serde_json::Map::new();
        if !usd.is_empty() {
            limit.insert("usd".into(), amount(usd));
        }
        if !diem.is_empty() {
            limit.insert("diem".into(), amount(diem));
        }
        body["consumptionLimit"] = Value::Object(limit);
        if !form.get("period").is_empty() {
            body["limitPeriod"] = json!(form.get("period"));
        }
    }
    body
}

/// `POST /console/accounts/{id}/keys`: the account page again, with the
/// new key's secret (once).
pub async fn create_key(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<String>,
    body: web::Bytes,
) -> Reply {
    let form = operator_posted(&gateway, &request, &body).await?;
    let visitor = operator_visitor(&gateway, &request).await?;
    let account = existing_account(&gateway, &path).await?;
    let created = crate::keys::create_key(&gateway, account.id.clone(), &key_body(&form)).await?;
    let (markup, name) =
        account_page(&gateway, &visitor, &account.id, Some(&created.secret)).await?;
    Ok(html(layout::page(
        &visitor,
        "/console/accounts",
        &format!("Account {name}"),
        Some("Key created."),
        markup,
    )))
}

/// `POST /console/accounts/{id}/keys/{key}/revoke`.
pub async fn revoke_key(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    path: web::Path<(String, String)>,
    body: web::Bytes,
) -> Reply {
    operator_posted(&gateway, &request, &body).await?;
    let (account_id, id) = path.into_inner();
    gateway
        .services
        .auth
        .delete_api_key(auth_pb::DeleteApiKeyRequest {
            account_id: account_id.clone(),
            id,
        })
        .await?;
    Ok(redirect(&format!(
        "/console/accounts/{account_id}?done=revoked"
    )))
}

/// `GET /console/models`: each model's backends, their circuit, requests
/// in flight and what failed since the router started.
pub async fn models(gateway: web::Data<Gateway>, request: HttpRequest) -> Reply {
    let visitor = operator_visitor(&gateway, &request).await?;
    let backends = gateway.services.router.backends().await?.backends;
    let catalog = gateway.catalog();
    let body = html! {
        section aria-labelledby="backends-heading" {
            h2 #backends-heading { "Backends" }
            p.hint { "Circuit: closed serves; open rests after failures; half-open tries one request; down never loaded. Counts are since the router started." }
            div.scroll {
                table #backends {
                    caption { "Backends by model" }
                    thead {
                        tr {
                            th scope="col" { "Model" }
                            th scope="col" { "Backend" }
                            th scope="col" { "Circuit" }
                            th scope="col" { "In flight" }
                            th scope="col" { "Succeeded" }
                            th scope="col" { "Failed" }
                            th scope="col" { "Error rate" }
                        }
                    }
                    tbody {
                        @if backends.is_empty() { tr { td colspan="7" { "No backends." } } }
                        @for backend in &backends {
                            @let total = backend.passed + backend.failed;
                            tr {
                                th scope="row" { (backend.model) }
                                td { (backend.backend) }
                                td { span class=(format!("state state-{}", backend.state)) { (backend.state.replace('_', "-")) } }
                                td.num { (backend.in_flight) }
                                td.num { (backend.passed) }
                                td.num { (backend.failed) }
                                td.num {
                                    @if total == 0 { "–" } @else { (format!("{:.1}", 100.0 * backend.failed as f64 / total as f64)) "%" }
                                }
                            }
                        }
                    }
                }
            }
        }
        section aria-labelledby="catalog-heading" {
            h2 #catalog-heading { "Models" }
            div.scroll {
                table #models {
                    caption { "The catalog" }
                    thead { tr { th scope="col" { "Id" } th scope="col" { "Name" } th scope="col" { "Type" } } }
                    tbody {
                        @for model in &catalog.models {
                            tr { th scope="row" { code { (model.config.id) } } td { (model.config.display_name()) } td { (model.config.model_type) } }
                        }
                    }
                }
            }
        }
    };
    Ok(html(layout::page(
        &visitor,
        "/console/models",
        "Models and backends",
        None,
        body,
    )))
}

/// `GET /console/spend?days=`: what every account spent, per model per day.
pub async fn spend(gateway: web::Data<Gateway>, request: HttpRequest, query: Query) -> Reply {
    let visitor = operator_visitor(&gateway, &request).await?;
    let days = layout::days_param(&query);
    let (first, last) = layout::last_days(days);
    let groups = gateway
        .services
        .billing
        .usage_analytics(billing_pb::UsageAnalyticsRequest {
            owner: String::new(),
            start_ms: first * 86_400_000,
            end_ms: (last + 1) * 86_400_000,
            all_owners: true,
        })
        .await?
        .groups;
    let daily = Daily::of(&groups, first, last);
    // One series per model (USD and DIEM together), the five that spent
    // most, the rest as one.
    const SHOWN: usize = 5;
    let top: Vec<&str> = daily
        .by_model
        .iter()
        .take(SHOWN)
        .map(|m| m.0.as_str())
        .collect();
    let mut series: Vec<Series> = top
        .iter()
        .map(|model| Series {
            label: (*model).to_owned(),
            values: vec![rust_decimal::Decimal::ZERO; daily.days.len()],
            count: false,
        })
        .collect();
    let mut other = vec![rust_decimal::Decimal::ZERO; daily.days.len()];
    for group in &groups {
        let Some(i) = usize::try_from(group.day - first)
            .ok()
            .filter(|i| *i < daily.days.len())
        else {
            continue;
        };
        let amount: rust_decimal::Decimal = group.amount.parse().unwrap_or_default();
        match top.iter().position(|m| *m == group.model_id) {
            Some(s) => series[s].values[i] += amount,
            None => other[i] += amount,
        }
    }
    if daily.by_model.len() > SHOWN {
        series.push(Series {
            label: "Other models".into(),
            values: other,
            count: false,
        });
    }
    let body = html! {
        (layout::range_links("/console/spend", days))
        p.hint { "USD and DIEM added together, by the UTC day the request settled." }
        (layout::chart("spend", &format!("Spend per model per day, last {days} days"), "USD + DIEM", &daily.days, &series))
        (layout::by_model_table(&daily))
    };
    Ok(html(layout::page(
        &visitor,
        "/console/spend",
        "Spend",
        None,
        body,
    )))
}

/// `GET /console/rate-limits`: every account's latest limit hits.
pub async fn rate_limits(gateway: web::Data<Gateway>, request: HttpRequest) -> Reply {
    let visitor = operator_visitor(&gateway, &request).await?;
    let hits = gateway.services.limiter.recent_hits_all(100).await?;
    let body = html! {
        p.hint { "The latest 100 requests refused by a rate limit, across every account." }
        (layout::hits_table("rate-limit-log", &hits, true))
    };
    Ok(html(layout::page(
        &visitor,
        "/console/rate-limits",
        "Rate-limit log",
        None,
        body,
    )))
}

/// `GET /console/top-ups?page`: x402 top-ups received, newest first.
pub async fn top_ups(gateway: web::Data<Gateway>, request: HttpRequest, query: Query) -> Reply {
    let visitor = operator_visitor(&gateway, &request).await?;
    let page = page_number(&query);
    let listed = gateway
        .services
        .billing
        .top_ups(billing_pb::TopUpsRequest {
            limit: PAGE_SIZE,
            offset: (page - 1) * PAGE_SIZE,
        })
        .await?;
    let pages = listed.total.div_ceil(u64::from(PAGE_SIZE)).max(1);
    let body = html! {
        div.scroll {
            table #top-ups {
                caption { (listed.total) " top-up" @if listed.total != 1 { "s" } }
                thead {
                    tr {
                        th scope="col" { "Received" }
                        th scope="col" { "Wallet" }
                        th scope="col" { "Network" }
                        th scope="col" { "USD" }
                        th scope="col" { "State" }
                        th scope="col" { "Transaction" }
                    }
                }
                tbody {
                    @if listed.top_ups.is_empty() { tr { td colspan="6" { "No top-ups yet." } } }
                    @for top_up in &listed.top_ups {
                        tr {
                            td { (time(top_up.created_at_ms)) }
                            td { code title=(top_up.wallet) { (layout::short(&top_up.wallet)) } }
                            td { (top_up.network) }
                            td.num { (top_up.amount) }
                            td { (top_up.state) }
                            td { code { (layout::short(&top_up.transaction_ref)) } }
                        }
                    }
                }
            }
        }
        nav.pager aria-label="Pages of top-ups" {
            @if page > 1 { a rel="prev" href=(format!("/console/top-ups?page={}", page - 1)) { "Previous" } }
            span { "Page " (page) " of " (pages) }
            @if u64::from(page) < pages { a rel="next" href=(format!("/console/top-ups?page={}", page + 1)) { "Next" } }
        }
    };
    Ok(html(layout::page(
        &visitor,
        "/console/top-ups",
        "Top-ups received",
        None,
        body,
    )))
}
