//! Signing in and out: the operator token, an account's ADMIN key, or a
//! wallet's Sign-In-With-X signature, each exchanged for a session cookie.
//! The secret is checked by the service that owns it (the gateway's
//! operator token, auth's keys and sign-in nonces) and never stored.

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use base64::Engine;
use maud::{Markup, html};
use rialto_core::ErrorCode;
use rialto_proto::auth::v1 as auth_pb;
use serde_json::json;

use super::session::{self, Principal};
use super::{Form, Refusal, Reply, console, layout, now_secs, redirect};
use crate::{ApiError, Gateway};

/// The pre-session cookie of this request, or a new one to set.
fn login_cookie(
    request: &HttpRequest,
) -> Result<(String, Option<actix_web::cookie::Cookie<'static>>), Refusal> {
    Ok(match request.cookie(session::LOGIN_COOKIE) {
        Some(cookie) if cookie.value().len() == 32 => (cookie.value().to_owned(), None),
        _ => {
            let cookie = session::login_cookie(session::is_https(request))?;
            (cookie.value().to_owned(), Some(cookie))
        }
    })
}

fn login_markup(csrf: &str, alert: Option<&str>) -> Markup {
    layout::bare(
        "Sign in",
        html! {
            @if let Some(alert) = alert {
                div.alert role="alert" { (alert) }
            }
            div.cards {
                section.card aria-labelledby="operator-heading" {
                    h2 #operator-heading { "Operator" }
                    form #operator-login method="post" action="/console/login/operator" class="stack" {
                        input type="hidden" name="csrf" value=(csrf);
                        div.field {
                            label for="operator-token" { "Operator token" }
                            input #operator-token type="password" name="token" required autocomplete="current-password";
                        }
                        button type="submit" { "Sign in as operator" }
                    }
                }
                section.card aria-labelledby="key-heading" {
                    h2 #key-heading { "Account (API key)" }
                    form #key-login method="post" action="/console/login/key" class="stack" {
                        input type="hidden" name="csrf" value=(csrf);
                        div.field {
                            label for="api-key" { "ADMIN API key" }
                            input #api-key type="password" name="api_key" required autocomplete="current-password";
                        }
                        button type="submit" { "Sign in with key" }
                    }
                }
                section.card aria-labelledby="wallet-heading" {
                    h2 #wallet-heading { "Wallet" }
                    p { "Sign a message with your browser wallet (Sign-In-With-Ethereum); nothing is sent on chain." }
                    div #wallet-form data-csrf=(csrf) {
                        button #wallet-login type="button" { "Sign in with wallet" }
                    }
                    div #wallet-error role="alert" {}
                }
            }
        },
    )
}

/// `GET /console/login`.
pub async fn page(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<std::collections::HashMap<String, String>>,
) -> Reply {
    let console = console(&gateway)?;
    let (value, new_cookie) = login_cookie(&request)?;
    let csrf = console.sessions.login_csrf(&value);
    let alert = query
        .contains_key("expired")
        .then_some("Your session has expired: sign in again.");
    let mut response = super::html(login_markup(&csrf, alert));
    if let Some(cookie) = new_cookie {
        let _ = response.add_cookie(&cookie);
    }
    Ok(response)
}

/// The checks every sign-in post passes: from this origin, with the
/// sign-in forms' token.
fn check_login_post(
    gateway: &Gateway,
    request: &HttpRequest,
    form: &Form,
) -> Result<String, Refusal> {
    let console = console(gateway)?;
    if !session::same_origin(request) {
        return Err(Refusal::Forbidden(
            "This form was sent from another site, so it was refused.",
        ));
    }
    let cookie = request.cookie(session::LOGIN_COOKIE);
    match cookie {
        Some(cookie)
            if console
                .sessions
                .login_csrf_ok(cookie.value(), form.get("csrf")) =>
        {
            Ok(console.sessions.login_csrf(cookie.value()))
        }
        _ => Err(Refusal::Forbidden(
            "This sign-in form's security token is missing or wrong: reload the page and try again.",
        )),
    }
}

/// The sign-in page again, with why it failed (401).
fn refused(csrf: &str, why: &str) -> HttpResponse {
    super::html_with_status(StatusCode::UNAUTHORIZED, login_markup(csrf, Some(why)))
}

/// The session cookie set, the pre-session one dropped, and on to `to`.
fn signed_in(gateway: &Gateway, request: &HttpRequest, principal: Principal, to: &str) -> Reply {
    let console = console(gateway)?;
    let value = console.sessions.open(principal, now_secs())?;
    let mut response = redirect(to);
    let _ = response.add_cookie(&console.sessions.cookie(value, session::is_https(request)));
    let _ = response.add_cookie(&session::removal(session::LOGIN_COOKIE));
    Ok(response)
}

/// `POST /console/login/operator` (`token`).
pub async fn operator(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    body: web::Bytes,
) -> Reply {
    let form = Form::parse(&body);
    let csrf = check_login_post(&gateway, &request, &form)?;
    let Some(token) = &gateway.operator_token else {
        return Ok(refused(
            &csrf,
            "The operator sign-in is off: the platform has no operator token (operator.token).",
        ));
    };
    let presented = form.get("token");
    if presented.is_empty() || !token.accepts_current(presented.as_bytes()) {
        return Ok(refused(&csrf, "That operator token is not right."));
    }
    let op = console(&gateway)?
        .sessions
        .operator_fingerprint(presented.as_bytes());
    signed_in(
        &gateway,
        &request,
        Principal::Operator { op },
        "/console/accounts",
    )
}

/// `POST /console/login/key` (`api_key`): an ADMIN key of an account.
pub async fn key(gateway: web::Data<Gateway>, request: HttpRequest, body: web::Bytes) -> Reply {
    let form = Form::parse(&body);
    let csrf = check_login_post(&gateway, &request, &form)?;
    let api_key = form.get("api_key");
    if api_key.is_empty() {
        return Ok(refused(&csrf, "Enter an ADMIN API key."));
    }
    let principal = match gateway
        .services
        .auth
        .authenticate(auth_pb::AuthenticateRequest {
            api_key: api_key.to_owned(),
        })
        .await
    {
        Ok(principal) => principal,
        Err(error) if error.code == ErrorCode::Unauthenticated => {
            return Ok(refused(&csrf, "That API key is not valid."));
        }
        Err(error) => return Err(error.into()),
    };
    if principal.key_type != auth_pb::KeyType::Admin as i32 {
        return Ok(refused(
            &csrf,
            "That is an INFERENCE key: the console takes an ADMIN key.",
        ));
    }
    signed_in(
        &gateway,
        &request,
        Principal::Key {
            account: principal.account_id,
            key: principal.key_id,
        },
        "/console/account",
    )
}

/// An EVM address, `0x` and 40 hex digits.
fn evm_address(text: &str) -> bool {
    text.len() == 42 && text.starts_with("0x") && text[2..].bytes().all(|b| b.is_ascii_hexdigit())
}

/// `POST /console/login/wallet/message` (`address`): the EIP-4361 text the
/// wallet signs, with a fresh nonce, for this console's domain.
pub async fn wallet_message(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    body: web::Bytes,
) -> Reply {
    let form = Form::parse(&body);
    check_login_post(&gateway, &request, &form)?;
    let address = form.get("address");
    if !evm_address(address) {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "address must be an EVM address (0x and 40 hex digits)",
        )
        .into());
    }
    let host = request.connection_info().host().to_owned();
    let domain = gateway
        .wallet
        .domains
        .iter()
        .find(|d| d.eq_ignore_ascii_case(&host))
        .or(gateway.wallet.domains.first())
        .cloned()
        .unwrap_or(host);
    let Some(chain_id) = gateway.wallet.evm_chain_ids.first().copied() else {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "Wallet sign-in takes no EVM chain here (wallet.evm_chain_ids is empty)",
        )
        .into());
    };
    let now = chrono::Utc::now();
    let iso =
        |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let scheme = request.connection_info().scheme().to_owned();
    let message = rialto_auth::siwx::evm_message(
        &domain,
        address,
        Some(&gateway.wallet.statement)
            .filter(|s| !s.is_empty())
            .map(String::as_str),
        &format!("{scheme}://{domain}"),
        chain_id,
        &hex::encode(session::random::<16>()?),
        &iso(now),
        Some(&iso(now + chrono::Duration::minutes(5))),
    );
    Ok(HttpResponse::Ok()
        .insert_header((actix_web::http::header::CACHE_CONTROL, "no-store"))
        .json(json!({"message": message, "chainId": format!("0x{chain_id:x}")})))
}

/// `POST /console/login/wallet` (`address`, `message`, `signature`): the
/// signed message goes to auth as a `SIGN-IN-WITH-X` header would, so its
/// nonce is spent once and every rule of the API's sign-in applies. Called
/// by script: answers JSON (`redirect`, or `error`).
pub async fn wallet(gateway: web::Data<Gateway>, request: HttpRequest, body: web::Bytes) -> Reply {
    let form = Form::parse(&body);
    check_login_post(&gateway, &request, &form)?;
    let header = base64::engine::general_purpose::STANDARD.encode(
        json!({
            "address": form.get("address"),
            "message": form.get("message"),
            "signature": form.get("signature"),
            "type": "eip191",
        })
        .to_string(),
    );
    let principal = match crate::wallet::sign_in(&gateway, &header).await {
        Ok(principal) => principal,
        Err(error) => {
            return Ok(HttpResponse::Unauthorized().json(json!({"error": error.message()})));
        }
    };
    crate::limits::refuse_blocked_wallet(&gateway, &principal.account_id)?;
    let console = console(&gateway)?;
    let value = console.sessions.open(
        Principal::Wallet {
            address: principal.wallet,
        },
        now_secs(),
    )?;
    // Script follows the JSON, not a redirect.
    let mut answer = HttpResponse::Ok()
        .insert_header((actix_web::http::header::CACHE_CONTROL, "no-store"))
        .json(json!({"redirect": "/console/account"}));
    let _ = answer.add_cookie(&console.sessions.cookie(value, session::is_https(&request)));
    let _ = answer.add_cookie(&session::removal(session::LOGIN_COOKIE));
    Ok(answer)
}

/// `POST /console/logout`: the cookie goes. The form carries the CSRF
/// token like every other; a cookie that is no session any more is simply
/// dropped.
pub async fn logout(gateway: web::Data<Gateway>, request: HttpRequest, body: web::Bytes) -> Reply {
    let console = console(&gateway)?;
    if !session::same_origin(&request) {
        return Err(Refusal::Forbidden(
            "This form was sent from another site, so it was refused.",
        ));
    }
    let form = Form::parse(&body);
    let cookie = request.cookie(session::COOKIE);
    if let Ok(claims) = console
        .sessions
        .read(cookie.as_ref().map(|c| c.value()), now_secs())
        && !console.sessions.csrf_ok(&claims, form.get("csrf"))
    {
        return Err(Refusal::Forbidden(
            "This form's security token is missing or wrong: reload the page and send it again.",
        ));
    }
    let mut response = redirect("/console/login");
    let _ = response.add_cookie(&session::removal(session::COOKIE));
    Ok(response)
}
