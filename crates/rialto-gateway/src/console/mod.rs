//! The web console (`/console/`, on when `console.enabled`): pages for the
//! operator and for account holders, rendered on the server from maud
//! templates, with one small script (`assets/app.js`) for charts and the
//! wallet sign-in, and uPlot (vendored from npm, pinned) for the charts.
//!
//! Every page reads the same services the API uses (`gateway.services`):
//! the console has no path of its own to the database. Forms post
//! `application/x-www-form-urlencoded` and are answered with a redirect
//! (303) or a page, so everything but the charts and the wallet works
//! without script.
//!
//! - `session`: the signed cookie, CSRF tokens, the same-origin check.
//! - `layout`: the page frame, tables, charts, formatting.
//! - `login`: sign-in with the operator token, an ADMIN key or a wallet.
//! - `operator`: accounts, an account, models, spend, limits, top-ups.
//! - `account`: an account holder's balance, usage, keys and limits.

mod account;
mod layout;
mod login;
mod operator;
pub mod session;

use std::collections::HashMap;

use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpRequest, HttpResponse, ResponseError, web};
use maud::Markup;
use secrecy::ExposeSecret;

use crate::{ApiError, Gateway};
use session::{Claims, Invalid, Principal, Sessions};

/// The console's settings and session keys, built once at start.
#[derive(Debug)]
pub struct Console {
    sessions: Sessions,
}

impl Console {
    /// The console of `config`, or None when it is off.
    pub fn new(config: &rialto_core::config::ConsoleConfig) -> anyhow::Result<Option<Self>> {
        if !config.enabled {
            return Ok(None);
        }
        let key = match &config.session_key {
            Some(key) => key.expose_secret().as_bytes().to_vec(),
            None => {
                tracing::info!(
                    "console.session_key is not set: this process signs its own sessions; \
                     set it (the same on every gateway) to run more than one"
                );
                session::random::<32>()?.to_vec()
            }
        };
        Ok(Some(Self {
            sessions: Sessions::new(&key, config.session_ttl_secs)?,
        }))
    }
}

/// Registers the console's routes (when it is on).
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route(
        "/console",
        web::get().to(|| async { redirect("/console/") }),
    )
    .service(
        web::scope("/console")
            .wrap(
                actix_web::middleware::DefaultHeaders::new()
                    .add((header::CONTENT_SECURITY_POLICY, CSP))
                    .add((header::X_FRAME_OPTIONS, "DENY"))
                    // Not no-referrer: under it a browser sends `Origin: null`
                    // with a form's post, and the same-origin check needs it.
                    .add((header::REFERRER_POLICY, "same-origin"))
                    .add((header::X_CONTENT_TYPE_OPTIONS, "nosniff")),
            )
            .route("/", web::get().to(home))
            .route("/assets/{name}", web::get().to(asset))
            .route("/login", web::get().to(login::page))
            .route("/login/operator", web::post().to(login::operator))
            .route("/login/key", web::post().to(login::key))
            .route(
                "/login/wallet/message",
                web::post().to(login::wallet_message),
            )
            .route("/login/wallet", web::post().to(login::wallet))
            .route("/logout", web::post().to(login::logout))
            .route("/accounts", web::get().to(operator::accounts))
            .route("/accounts", web::post().to(operator::create_account))
            .route("/accounts/{id}", web::get().to(operator::account))
            .route("/accounts/{id}/credit", web::post().to(operator::credit))
            .route("/accounts/{id}/tier", web::post().to(operator::tier))
            .route("/accounts/{id}/stake", web::post().to(operator::stake))
            .route("/accounts/{id}/suspend", web::post().to(operator::suspend))
            .route("/accounts/{id}/resume", web::post().to(operator::resume))
            .route("/accounts/{id}/keys", web::post().to(operator::create_key))
            .route(
                "/accounts/{id}/keys/{key}/revoke",
                web::post().to(operator::revoke_key),
            )
            .route("/models", web::get().to(operator::models))
            .route("/spend", web::get().to(operator::spend))
            .route("/rate-limits", web::get().to(operator::rate_limits))
            .route("/top-ups", web::get().to(operator::top_ups))
            .route("/account", web::get().to(account::overview))
            .route("/account/usage", web::get().to(account::usage))
            .route("/account/usage.csv", web::get().to(account::usage_csv))
            .route("/account/keys", web::get().to(account::keys))
            .route("/account/keys", web::post().to(account::create_key))
            .route(
                "/account/keys/{key}/revoke",
                web::post().to(account::revoke_key),
            )
            .route("/account/limits", web::get().to(account::limits))
            .default_service(web::to(not_found)),
    );
}

/// No inline script or style anywhere: the JSON of a chart is data
/// (`type="application/json"`), never run.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
                   connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'; \
                   object-src 'none'";

/// What a console handler answers when it cannot answer the page.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// No usable session: to the sign-in page (`expired` says why).
    SignIn { expired: bool },
    /// A post that failed the CSRF or origin check, or the wrong kind of
    /// session for the page.
    Forbidden(&'static str),
    /// The console is off (never registered then; kept for completeness).
    NotFound,
    /// A service refused or failed: its message, as a page.
    Api(ApiError),
}

impl From<ApiError> for Refusal {
    fn from(error: ApiError) -> Self {
        Self::Api(error)
    }
}

impl From<rialto_core::Error> for Refusal {
    fn from(error: rialto_core::Error) -> Self {
        Self::Api(error.into())
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::SignIn { .. } => f.write_str("sign in"),
            Self::Forbidden(why) => f.write_str(why),
            Self::NotFound => f.write_str("not found"),
            Self::Api(error) => error.fmt(f),
        }
    }
}

impl ResponseError for Refusal {
    fn status_code(&self) -> StatusCode {
        match self {
            Self::SignIn { .. } => StatusCode::SEE_OTHER,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::Api(error) => error.status_code(),
        }
    }

    fn error_response(&self) -> HttpResponse {
        match self {
            Self::SignIn { expired } => {
                let mut response = redirect(if *expired {
                    "/console/login?expired=1"
                } else {
                    "/console/login"
                });
                // A cookie that is no session any more is dropped.
                let _ = response.add_cookie(&session::removal(session::COOKIE));
                response
            }
            Self::Forbidden(why) => error_page(self.status_code(), "Refused", why, &[]),
            Self::NotFound => error_page(
                self.status_code(),
                "Not found",
                "There is no such console page.",
                &[],
            ),
            Self::Api(error) => error_page(
                self.status_code(),
                "That did not work",
                error.message(),
                &error.detail_lines(),
            ),
        }
    }
}

type Reply = Result<HttpResponse, Refusal>;

fn error_page(status: StatusCode, title: &str, message: &str, details: &[String]) -> HttpResponse {
    let body = layout::bare(
        title,
        maud::html! {
            div role="alert" class="alert" {
                p { (message) }
                @if !details.is_empty() {
                    ul { @for line in details { li { (line) } } }
                }
            }
            p { a href="/console/" { "Back to the console" } }
        },
    );
    html_with_status(status, body)
}

fn html_with_status(status: StatusCode, markup: Markup) -> HttpResponse {
    HttpResponse::build(status)
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .content_type("text/html; charset=utf-8")
        .body(markup.into_string())
}

fn html(markup: Markup) -> HttpResponse {
    html_with_status(StatusCode::OK, markup)
}

fn redirect(to: &str) -> HttpResponse {
    HttpResponse::SeeOther()
        .insert_header((header::LOCATION, to))
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .finish()
}

fn console(gateway: &Gateway) -> Result<&Console, Refusal> {
    gateway.console.as_ref().ok_or(Refusal::NotFound)
}

fn now_secs() -> i64 {
    chrono::Utc::now().timestamp()
}

/// A signed-in request: who, and the token its forms carry.
pub(crate) struct Visitor {
    pub claims: Claims,
    pub csrf: String,
}

/// The session of a page view, still valid: an operator session only while
/// the operator token it was opened with is in force; a key's only while
/// the key is an ADMIN key that has not been revoked or expired.
async fn visitor(gateway: &Gateway, request: &HttpRequest) -> Result<Visitor, Refusal> {
    let console = console(gateway)?;
    let cookie = request.cookie(session::COOKIE);
    let claims = match console
        .sessions
        .read(cookie.as_ref().map(|c| c.value()), now_secs())
    {
        Ok(claims) => claims,
        Err(Invalid::Expired) => return Err(Refusal::SignIn { expired: true }),
        Err(Invalid::Missing | Invalid::Forged) => return Err(Refusal::SignIn { expired: false }),
    };
    match &claims.principal {
        Principal::Operator { op } => {
            let current = gateway.operator_token.as_ref().map(|token| {
                console
                    .sessions
                    .operator_fingerprint(token.current().current.expose_secret().as_bytes())
            });
            if current.as_deref() != Some(op.as_str()) {
                return Err(Refusal::SignIn { expired: true });
            }
        }
        Principal::Key { account, key } => {
            let record = gateway
                .services
                .auth
                .get_api_key(rialto_proto::auth::v1::GetApiKeyRequest {
                    account_id: account.clone(),
                    id: key.clone(),
                })
                .await;
            let usable = record.is_ok_and(|record| {
                record.key_type == rialto_proto::auth::v1::KeyType::Admin as i32
                    && record
                        .expires_at_ms
                        .is_none_or(|at| at > chrono::Utc::now().timestamp_millis())
            });
            if !usable {
                return Err(Refusal::SignIn { expired: true });
            }
        }
        Principal::Wallet { .. } => {}
    }
    let csrf = console.sessions.csrf(&claims);
    Ok(Visitor { claims, csrf })
}

async fn operator_visitor(gateway: &Gateway, request: &HttpRequest) -> Result<Visitor, Refusal> {
    let visitor = visitor(gateway, request).await?;
    match visitor.claims.principal {
        Principal::Operator { .. } => Ok(visitor),
        _ => Err(Refusal::Forbidden(
            "This page is for the operator: sign in with the operator token.",
        )),
    }
}

/// A form's fields (the first value of each name).
pub(crate) struct Form(HashMap<String, String>);

impl Form {
    fn parse(body: &[u8]) -> Self {
        let mut fields = HashMap::new();
        for (name, value) in form_urlencoded::parse(body) {
            fields
                .entry(name.into_owned())
                .or_insert_with(|| value.into_owned());
        }
        Self(fields)
    }

    /// The field, trimmed; "" when absent.
    pub fn get(&self, name: &str) -> &str {
        self.0.get(name).map_or("", |v| v.trim())
    }
}

/// Reads a posted form and checks that a signed-in page of this origin
/// sent it: same origin, a session, and the session's CSRF token.
async fn posted(
    gateway: &Gateway,
    request: &HttpRequest,
    body: &web::Bytes,
) -> Result<(Visitor, Form), Refusal> {
    if !session::same_origin(request) {
        return Err(Refusal::Forbidden(
            "This form was sent from another site, so it was refused.",
        ));
    }
    let form = Form::parse(body);
    let console = console(gateway)?;
    let cookie = request.cookie(session::COOKIE);
    let Ok(claims) = console
        .sessions
        .read(cookie.as_ref().map(|c| c.value()), now_secs())
    else {
        return Err(Refusal::Forbidden(
            "Your session has expired or is not valid: sign in again, then send the form again.",
        ));
    };
    if !console.sessions.csrf_ok(&claims, form.get("csrf")) {
        return Err(Refusal::Forbidden(
            "This form's security token is missing or wrong: reload the page and send it again.",
        ));
    }
    // And the session is still one (a revoked key, a rotated token).
    let visitor = visitor(gateway, request)
        .await
        .map_err(|refusal| match refusal {
            Refusal::SignIn { .. } => Refusal::Forbidden(
                "Your session has ended: sign in again, then send the form again.",
            ),
            other => other,
        })?;
    Ok((visitor, form))
}

async fn operator_posted(
    gateway: &Gateway,
    request: &HttpRequest,
    body: &web::Bytes,
) -> Result<Form, Refusal> {
    let (visitor, form) = posted(gateway, request, body).await?;
    match visitor.claims.principal {
        Principal::Operator { .. } => Ok(form),
        _ => Err(Refusal::Forbidden(
            "This form is for the operator: sign in with the operator token.",
        )),
    }
}

/// `GET /console/`: the signed-in home, or the sign-in page.
async fn home(gateway: web::Data<Gateway>, request: HttpRequest) -> Reply {
    let visitor = visitor(&gateway, &request).await?;
    Ok(redirect(match visitor.claims.principal {
        Principal::Operator { .. } => "/console/accounts",
        _ => "/console/account",
    }))
}

async fn not_found(gateway: web::Data<Gateway>) -> Reply {
    console(&gateway)?;
    Err(Refusal::NotFound)
}

/// The console's files, compiled into the binary.
const ASSETS: &[(&str, &str, &[u8])] = &[
    (
        "app.css",
        "text/css; charset=utf-8",
        include_bytes!("../../console/app.css"),
    ),
    (
        "app.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../console/app.js"),
    ),
    (
        "uPlot.iife.min.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../console/vendor/uPlot.iife.min.js"),
    ),
    (
        "uPlot.min.css",
        "text/css; charset=utf-8",
        include_bytes!("../../console/vendor/uPlot.min.css"),
    ),
];

/// `GET /console/assets/{name}`. Their URLs carry the build's revision
/// (`?v=`), so a browser may keep them for a day without asking.
async fn asset(gateway: web::Data<Gateway>, name: web::Path<String>) -> Reply {
    console(&gateway)?;
    let Some((_, content_type, bytes)) = ASSETS.iter().find(|(n, _, _)| *n == name.as_str()) else {
        return Err(Refusal::NotFound);
    };
    Ok(HttpResponse::Ok()
        .insert_header((
            header::CACHE_CONTROL,
            HeaderValue::from_static("public, max-age=86400"),
        ))
        .content_type(*content_type)
        .body(*bytes))
}
