//! Wallet access: Sign-In-With-X on every route that takes credentials, the
//! x402 answers (402 discovery, top-up instructions) and the `/x402` routes.
//!
//! - No credentials at all: 402 with the hosted API's discovery body (how to
//!   get a key, how to sign in, how to top up) and `PAYMENT-REQUIRED`.
//! - `SIGN-IN-WITH-X` (legacy `X-Sign-In-With-X`; it wins over
//!   `Authorization`): auth verifies it and consumes its nonce; a refusal is
//!   401 `{error, code}`.
//! - A signed-in wallet is a principal of its own: its ledger is
//!   `wallet:<address>`, its rate windows `wallet:<address>`. A balance that
//!   cannot cover a request gets 402 with top-up instructions.
//! - `POST /x402/top-up`, `GET /x402/balance/{wallet}` and
//!   `GET /x402/transactions/{wallet}` in the hosted API's shapes.

use actix_web::http::header::{HeaderMap, HeaderName};
use actix_web::{HttpRequest, HttpResponse, web};
use rialto_billing::x402;
use rialto_core::ErrorCode;
use rialto_proto::auth::v1 as auth_pb;
use rialto_proto::billing::v1 as billing_pb;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{ApiError, Gateway};

/// The sign-in header, canonical and legacy. Names, not strings: a
/// lookup by a string parses it into a name first (~200 instructions,
/// five lookups a request).
static SIGN_IN_HEADERS: [HeaderName; 2] = [
    HeaderName::from_static("sign-in-with-x"),
    HeaderName::from_static("x-sign-in-with-x"),
];
/// The payment header, canonical and legacy.
static PAYMENT_HEADERS: [HeaderName; 3] = [
    HeaderName::from_static("payment-signature"),
    HeaderName::from_static("x-402-payment"),
    HeaderName::from_static("x-payment"),
];
/// What a wallet is asked to top up by default, in USD.
const SUGGESTED_TOP_UP_USD: u64 = 10;

/// The `SIGN-IN-WITH-X` header's value, if the request carries one.
pub(crate) fn sign_in_header(headers: &HeaderMap) -> Option<&str> {
    SIGN_IN_HEADERS
        .iter()
        .find_map(|name| headers.get(name))
        .and_then(|value| value.to_str().ok())
}

fn payment_header(headers: &HeaderMap) -> Option<&str> {
    PAYMENT_HEADERS
        .iter()
        .find_map(|name| headers.get(name))
        .and_then(|value| value.to_str().ok())
}

/// Refuses a payment header on a route that is not the top-up.
pub(crate) fn refuse_payment_header(headers: &HeaderMap) -> Result<(), ApiError> {
    if payment_header(headers).is_some() {
        return Err(ApiError::with_body(
            ErrorCode::InvalidRequest,
            "Payment headers are only accepted by POST /api/v1/x402/top-up",
            json!({"error": "PAYMENT_HEADER_NOT_ACCEPTED",
                "message": "Payment headers are only accepted by POST /api/v1/x402/top-up: top up there, then sign in with SIGN-IN-WITH-X"}),
        ));
    }
    Ok(())
}

/// Verifies the sign-in; the wallet's principal, or 401 with the reason.
pub(crate) async fn sign_in(
    gateway: &Gateway,
    header: &str,
) -> Result<auth_pb::Principal, ApiError> {
    let answer = gateway
        .services
        .auth
        .sign_in(auth_pb::SignInRequest {
            header: header.to_owned(),
        })
        .await?;
    match answer.principal {
        Some(principal) => Ok(principal),
        None => Err(ApiError::with_body(
            ErrorCode::Unauthenticated,
            answer.refusal.clone(),
            json!({"error": answer.refusal, "code": answer.refusal_code}),
        )),
    }
}

/// `scheme://host` of this request, for resource URLs and sign-in URIs.
fn origin(request: &HttpRequest) -> String {
    let info = request.connection_info();
    format!("{}://{}", info.scheme(), info.host())
}

/// A fresh sign-in challenge (`extensions["sign-in-with-x"]`, `siwxChallenge`).
fn challenge(gateway: &Gateway, request: &HttpRequest) -> Value {
    let domain = gateway
        .wallet
        .domains
        .first()
        .cloned()
        .unwrap_or_else(|| request.connection_info().host().to_owned());
    let now = chrono::Utc::now();
    let iso =
        |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let mut chains: Vec<Value> = gateway
        .wallet
        .evm_chain_ids
        .iter()
        .map(|id| json!({"chainId": format!("eip155:{id}"), "type": "eip191"}))
        .collect();
    chains.extend(
        gateway
            .wallet
            .solana_chains
            .iter()
            .map(|r| json!({"chainId": format!("solana:{r}"), "type": "ed25519"})),
    );
    json!({
        "info": {
            "domain": domain,
            "uri": format!("http://{domain}"),
            "version": "1",
            "nonce": hex::encode(rialto_core::ids::random_bytes::<16>()),
            "issuedAt": iso(now),
            "expirationTime": iso(now + chrono::Duration::minutes(5)),
            "statement": gateway.wallet.statement,
        },
        "supportedChains": chains,
    })
}

/// The `PAYMENT-REQUIRED` document of an inference route's 402.
fn payment_required(gateway: &Gateway, request: &HttpRequest, error: &str) -> Value {
    let amount = (SUGGESTED_TOP_UP_USD * 1_000_000).max(x402::minimum_atomic(&gateway.x402));
    let mut document = x402::payment_required(
        &gateway.x402,
        amount,
        &format!("{}{}", origin(request), request.path()),
        error,
    );
    document["resource"]["description"] = json!(format!("{} API", gateway.brand.name));
    document["extensions"] = json!({"sign-in-with-x": challenge(gateway, request)});
    document
}

/// 402 for a request with no credentials at all: how to get them.
pub(crate) fn discovery(gateway: &Gateway, request: &HttpRequest) -> ApiError {
    let mut body = payment_required(gateway, request, "Authentication required");
    body["authOptions"] = json!({
        "apiKey": {"header": "Authorization: Bearer YOUR_API_KEY",
            "getKey": "Ask the operator of this service for an account (POST /admin/v1/accounts)",
            "docs": format!("{}/openapi.yaml", origin(request))},
        "x402Wallet": {"header": "SIGN-IN-WITH-X", "legacyHeader": "X-Sign-In-With-X",
            "topUp": "POST /api/v1/x402/top-up",
            "docs": format!("{}/openapi.yaml", origin(request))},
    });
    let header = x402::header_value(&payment_required(
        gateway,
        request,
        "Authentication required",
    ));
    ApiError::with_body(
        ErrorCode::PaymentRequired,
        "Authentication required: send an API key (Authorization: Bearer) or sign in with a wallet (SIGN-IN-WITH-X)",
        body,
    )
    .with_header("PAYMENT-REQUIRED", header)
}

/// 402 for a wallet whose balance cannot cover a request: how to top up.
pub(crate) fn insufficient(
    gateway: &Gateway,
    request: &HttpRequest,
    balance_usd: &str,
) -> ApiError {
    let config = &gateway.x402;
    let number = |text: &str| serde_json::from_str::<Value>(text).unwrap_or(json!(0));
    let mut chains = Vec::new();
    if !config.pay_to_evm.is_empty() {
        chains.push("base");
    }
    if !config.pay_to_solana.is_empty() {
        chains.push("solana");
    }
    let body = json!({
        "error": "Payment required",
        "code": "PAYMENT_REQUIRED",
        "reason": "insufficient_balance",
        "currentBalanceUsd": number(balance_usd),
        "description": format!("{} API", gateway.brand.name),
        "suggestedTopUpUsd": SUGGESTED_TOP_UP_USD,
        "minimumTopUpUsd": number(&config.min_usd),
        "supportedTokens": ["USDC"],
        "supportedChains": chains,
        "topUpInstructions": {
            "step1": "POST /api/v1/x402/top-up with no payment header to get payment requirements",
            "step2": "Choose a payment option from accepts and sign a USDC transfer authorization with an x402 client",
            "step3": "POST /api/v1/x402/top-up with the signed PAYMENT-SIGNATURE header",
            "receiverWallet": config.pay_to_evm,
            "tokenAddress": config.evm_asset,
            "tokenDecimals": 6,
            "network": config.evm_network,
            "minimumAmountUsd": number(&config.min_usd),
        },
        "siwxChallenge": challenge(gateway, request),
    });
    let header = x402::header_value(&payment_required(gateway, request, "Insufficient balance"));
    ApiError::with_body(
        ErrorCode::PaymentRequired,
        "Insufficient wallet balance: top up with POST /api/v1/x402/top-up",
        body,
    )
    .with_header("PAYMENT-REQUIRED", header)
}

#[derive(Deserialize, Default)]
pub struct TopUpQuery {
    /// USD to be asked for in the requirements (default the minimum).
    amount: Option<String>,
}

/// `POST /x402/top-up`.
pub async fn top_up(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<TopUpQuery>,
) -> Result<HttpResponse, ApiError> {
    let config = &gateway.x402;
    if !x402::configured(config) {
        return Err(ApiError::with_body(
            ErrorCode::Unavailable,
            "Top-ups are not configured on this service",
            json!({"error": "X402_NOT_CONFIGURED",
                "message": "Top-ups are not configured on this service (x402.facilitator_url and a pay_to address)"}),
        ));
    }
    let resource = format!("{}{}", origin(&request), request.path());
    let Some(payment) = payment_header(request.headers()) else {
        let minimum = x402::minimum_atomic(config);
        let amount = match &query.amount {
            None => minimum,
            Some(text) => requested_amount(config, text)?,
        };
        let document = x402::payment_required(
            config,
            amount,
            &resource,
            "PAYMENT-SIGNATURE header is required",
        );
        return Err(ApiError::with_body(
            ErrorCode::PaymentRequired,
            "PAYMENT-SIGNATURE header is required",
            document.clone(),
        )
        .with_header("PAYMENT-REQUIRED", x402::header_value(&document)));
    };
    let answer = gateway
        .services
        .billing
        .top_up(billing_pb::TopUpRequest {
            payment: payment.to_owned(),
            resource_url: resource.clone(),
        })
        .await?;
    if !answer.ok {
        let status = u16::try_from(answer.status).unwrap_or(500);
        let mut error = ApiError::with_body(
            ErrorCode::InvalidRequest,
            answer.message.clone(),
            json!({"error": answer.code, "message": answer.message,
                "details": {"reason": answer.reason}}),
        )
        .with_status(status);
        if status == 402 {
            let document = x402::payment_required(
                config,
                x402::minimum_atomic(config),
                &resource,
                &answer.message,
            );
            error = error.with_header("PAYMENT-REQUIRED", x402::header_value(&document));
        }
        return Err(error);
    }
    let number = |text: &str| serde_json::from_str::<Value>(text).unwrap_or(json!(0));
    let settle: Value = serde_json::from_str(&answer.settle_response_json).unwrap_or(json!({}));
    let mut data = json!({
        "walletAddress": answer.wallet,
        "amountCredited": number(&answer.amount_usd),
        "paymentId": answer.payment_id,
    });
    // A replay (the payment credited before) is told no balance: its
    // sender holds only the payment's bytes, not the wallet.
    if answer.applied {
        data["newBalance"] = number(&answer.new_balance_usd);
    }
    Ok(HttpResponse::Ok()
        .insert_header(("PAYMENT-RESPONSE", x402::header_value(&settle)))
        .json(json!({"success": true, "data": data})))
}

/// `?amount=` of the discovery call: USD within the configured bounds.
fn requested_amount(config: &rialto_core::config::X402Config, text: &str) -> Result<u64, ApiError> {
    let invalid = |message: String| {
        ApiError::with_body(
            ErrorCode::InvalidRequest,
            message.clone(),
            json!({"error": "INVALID_AMOUNT", "message": message}),
        )
    };
    let usd: rust_decimal::Decimal = text
        .trim()
        .parse()
        .map_err(|_| invalid(format!("amount must be USD such as \"10\", not {text:?}")))?;
    let min: rust_decimal::Decimal = config.min_usd.parse().unwrap_or_default();
    let max: rust_decimal::Decimal = config.max_usd.parse().unwrap_or_default();
    if usd < min
        || usd > max
        || (usd * rust_decimal::Decimal::from(1_000_000u32)).fract() != rust_decimal::Decimal::ZERO
    {
        return Err(invalid(format!(
            "amount must be between {} and {} USD, with at most 6 decimals",
            config.min_usd, config.max_usd
        )));
    }
    use rust_decimal::prelude::ToPrimitive;
    (usd * rust_decimal::Decimal::from(1_000_000u32))
        .to_u64()
        .ok_or_else(|| invalid("amount out of range".into()))
}

/// The signed-in wallet that may read `wallet`'s data: 402 without a
/// sign-in, 403 for another wallet.
async fn own_wallet(
    gateway: &Gateway,
    request: &HttpRequest,
    wallet: &str,
) -> Result<String, ApiError> {
    refuse_payment_header(request.headers())?;
    if !plausible_wallet(wallet) {
        let mut details = crate::Details::new();
        details.push(
            &["walletAddress"],
            "Expected an EVM address (0x and 40 hex digits) or a Solana address (base58)",
        );
        return Err(ApiError::validation(details));
    }
    let Some(header) = sign_in_header(request.headers()) else {
        return Err(discovery(gateway, request));
    };
    let principal = sign_in(gateway, header).await?;
    let same = if principal.wallet.starts_with("0x") {
        principal.wallet.eq_ignore_ascii_case(wallet)
    } else {
        principal.wallet == wallet
    };
    if !same {
        return Err(ApiError::with_body(
            ErrorCode::Forbidden,
            "You can only access balance for your own wallet",
            json!({"error": "You can only access balance for your own wallet", "code": "X402_WALLET_MISMATCH"}),
        ));
    }
    Ok(principal.wallet)
}

#[derive(Deserialize, Default)]
pub struct TransactionsQuery {
    limit: Option<u32>,
    offset: Option<u32>,
}

/// `GET /x402/transactions/{walletAddress}?limit=1..100&offset=0`.
pub async fn transactions(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    wallet: web::Path<String>,
    query: web::Query<TransactionsQuery>,
) -> Result<HttpResponse, ApiError> {
    let limit = query.limit.unwrap_or(50);
    if !(1..=100).contains(&limit) {
        let mut details = crate::Details::new();
        details.push(&["limit"], "Number must be between 1 and 100");
        return Err(ApiError::validation(details));
    }
    let offset = query.offset.unwrap_or(0);
    let wallet = own_wallet(&gateway, &request, &wallet).await?;
    let page = gateway
        .services
        .billing
        .transactions(billing_pb::TransactionsRequest {
            owner: rialto_billing::wallet_owner(&wallet),
            limit,
            offset,
        })
        .await?;
    let number = |text: &str| serde_json::from_str::<Value>(text).unwrap_or(json!(0));
    let transactions: Vec<Value> = page
        .transactions
        .iter()
        .map(|t| {
            let optional = |text: &str, prefix: &str| {
                if text.is_empty() {
                    Value::Null
                } else {
                    json!(format!("{prefix}{text}"))
                }
            };
            json!({
                "id": t.id,
                "amount": number(&t.amount),
                "balanceAfter": number(&t.balance_after),
                "type": t.kind,
                "createdAt": chrono::DateTime::<chrono::Utc>::from_timestamp_millis(t.at_ms)
                    .unwrap_or_default()
                    .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                "requestId": optional(&t.request_id, "chatcmpl-"),
                "modelId": optional(&t.model_id, ""),
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "success": true,
        "data": {
            "walletAddress": wallet,
            "currentBalance": number(&page.current_balance),
            "transactions": transactions,
            "pagination": {"limit": limit, "offset": offset, "hasMore": page.has_more},
        }
    })))
}

/// `^(0x[a-fA-F0-9]{40}|[1-9A-HJ-NP-Za-km-z]{32,44})$`.
fn plausible_wallet(address: &str) -> bool {
    match address.strip_prefix("0x") {
        Some(hex) => hex.len() == 40 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        None => {
            (32..=44).contains(&address.len())
                && address
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() && !b"0OIl".contains(&b))
        }
    }
}

/// `GET /x402/balance/{walletAddress}`.
pub async fn balance(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    wallet: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let wallet = own_wallet(&gateway, &request, &wallet).await?;
    let balance = gateway
        .services
        .billing
        .get_balance(billing_pb::GetBalanceRequest {
            owner: rialto_billing::wallet_owner(&wallet),
        })
        .await?;
    let number = |text: &str| serde_json::from_str::<Value>(text).unwrap_or(json!(0));
    let usd: rust_decimal::Decimal = balance.usd.parse().unwrap_or_default();
    let diem: rust_decimal::Decimal = balance.diem.parse().unwrap_or_default();
    let can_consume =
        usd >= rust_decimal::Decimal::new(10, 2) || diem > rust_decimal::Decimal::ZERO;
    Ok(HttpResponse::Ok().json(json!({
        "success": true,
        "data": {
            "walletAddress": wallet,
            "balanceUsd": number(&balance.usd),
            "canConsume": can_consume,
            "minimumTopUpUsd": number(&gateway.x402.min_usd),
            "suggestedTopUpUsd": SUGGESTED_TOP_UP_USD,
            "diemBalanceUsd": number(&balance.diem),
        }
    })))
}
