//! x402 v2 top-ups: a wallet pays USDC to us and its ledger
//! (`wallet:<address>`) is credited, once, after a facilitator settled the
//! payment on chain.
//!
//! `POST /x402/top-up` without a payment answers 402 with our payment
//! requirements ([`payment_required`]); with one (`PAYMENT-SIGNATURE`, or
//! the legacy `X-402-Payment` / `X-PAYMENT`; v1- or v2-shaped, always
//! answered in v2) [`X402::top_up`]:
//! 1. decodes it and takes network, asset, recipient and the EIP-712
//!    domain from *our* configuration, never from the payload;
//! 2. checks locally what can be checked: the EIP-3009 authorization is to
//!    our `payTo`, its value within `[min_usd, max_usd]`, its validity window
//!    open (with a margin for settlement), its nonce 32 bytes, and its
//!    EIP-712 signature recovers (alloy) to its `from`;
//! 3. claims the payment, keyed on (network, asset, payer, nonce): a
//!    payment already credited answers as it did, one being settled 409;
//! 4. asks the facilitator to `/verify` and `/settle` it, and credits the
//!    payer only after the settlement succeeded. A facilitator that cannot
//!    be reached gives 503 and frees the claim; one that refuses, 402.

use std::time::Duration;

use alloy_primitives::{Address, B256, Signature, U256};
use alloy_sol_types::{Eip712Domain, SolStruct, sol};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use rialto_core::config::X402Config;
use rialto_core::db::{Database, now_ms};
use rust_decimal::Decimal;
use serde_json::{Value, json};
use sqlx::Row;

use crate::ledger::Ledger;

sol! {
    /// EIP-3009's signed transfer (USDC `transferWithAuthorization`).
    struct TransferWithAuthorization {
        address from;
        address to;
        uint256 value;
        uint256 validAfter;
        uint256 validBefore;
        bytes32 nonce;
    }
}

/// USDC has 6 decimals; the ledger counts 9.
const NANOS_PER_ATOMIC: i64 = 1_000;
/// A payment must stay valid this long after we checked it: the
/// facilitator still has to settle it.
const VALID_BEFORE_MARGIN_SECS: u64 = 6;

/// A refused top-up: the HTTP status, the hosted API's code
/// (`INVALID_PAYMENT`, `AMOUNT_TOO_LOW`, ...), a message and a reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopUpError {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
    pub reason: String,
}

fn fail<T>(
    status: u16,
    code: &'static str,
    message: impl Into<String>,
    reason: &str,
) -> Result<T, TopUpError> {
    Err(TopUpError {
        status,
        code,
        message: message.into(),
        reason: reason.to_owned(),
    })
}

/// A credited top-up.
#[derive(Debug, Clone, PartialEq)]
pub struct TopUp {
    pub wallet: String,
    /// USD credited (exact decimal).
    pub amount_usd: String,
    /// The wallet's USD balance after it; empty for a replay.
    pub new_balance_usd: String,
    pub payment_id: String,
    /// The `SettleResponse` for the `PAYMENT-RESPONSE` header.
    pub settle_response: Value,
    /// False when this payment had been credited before (a replay).
    pub applied: bool,
}

/// USD as USDC atomic units (6 decimals), when it has no more decimals.
fn usd_to_atomic(text: &str) -> Option<u64> {
    use rust_decimal::prelude::ToPrimitive;
    let usd: Decimal = text.trim().parse().ok()?;
    // Checked: a product past the decimal's range would panic (found by
    // the property below).
    let atomic = usd.checked_mul(Decimal::from(1_000_000u32))?;
    (atomic.fract().is_zero() && !atomic.is_sign_negative()).then(|| atomic.to_u64())?
}

/// Atomic units as an exact USD decimal string.
fn atomic_to_usd(atomic: u64) -> String {
    // Through i128: `as i64` would turn amounts past i64::MAX negative
    // (found by the property below).
    Decimal::from_i128_with_scale(i128::from(atomic), 6)
        .normalize()
        .to_string()
}

/// The payment options we accept for `amount` atomic units: one per
/// configured rail.
pub fn accepts(config: &X402Config, amount: u64) -> Vec<Value> {
    let mut accepts = Vec::new();
    if !config.pay_to_evm.is_empty() {
        accepts.push(json!({
            "scheme": "exact",
            "network": config.evm_network,
            "amount": amount.to_string(),
            "asset": config.evm_asset,
            "payTo": config.pay_to_evm,
            "maxTimeoutSeconds": config.max_timeout_secs,
            "extra": {"name": config.evm_asset_name, "version": config.evm_asset_version},
        }));
    }
    if !config.pay_to_solana.is_empty() {
        let mut extra = json!({"name": "USD Coin", "version": "2"});
        if !config.solana_fee_payer.is_empty() {
            extra["feePayer"] = json!(config.solana_fee_payer);
        }
        accepts.push(json!({
            "scheme": "exact",
            "network": config.solana_network,
            "amount": amount.to_string(),
            "asset": config.solana_asset,
            "payTo": config.pay_to_solana,
            "maxTimeoutSeconds": config.max_timeout_secs,
            "extra": extra,
        }));
    }
    accepts
}

/// The smallest top-up, in atomic units.
pub fn minimum_atomic(config: &X402Config) -> u64 {
    usd_to_atomic(&config.min_usd).unwrap_or(5_000_000)
}

/// A v2 `PaymentRequired` for `resource_url`, priced at `amount`.
pub fn payment_required(
    config: &X402Config,
    amount: u64,
    resource_url: &str,
    error: &str,
) -> Value {
    json!({
        "x402Version": 2,
        "error": error,
        "resource": {"url": resource_url, "description": "Top up a wallet's prepaid credit",
            "mimeType": "application/json"},
        "accepts": accepts(config, amount),
    })
}

/// Base64 (standard, padded) of `value`'s JSON: the x402 headers.
pub fn header_value(value: &Value) -> String {
    STANDARD.encode(value.to_string())
}

/// Whether top-ups are possible at all.
pub fn configured(config: &X402Config) -> bool {
    !config.facilitator_url.is_empty()
        && (!config.pay_to_evm.is_empty() || !config.pay_to_solana.is_empty())
}

/// A payment header, decoded into the parts we use.
#[derive(Debug, Clone)]
struct Payment {
    scheme: String,
    network: String,
    payload: Value,
}

fn decode_base64(text: &str) -> Option<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(text.trim()).ok())
}

/// The v1 network names clients still send, as CAIP-2.
fn caip2_network(network: &str) -> String {
    match network {
        "base" => "eip155:8453".to_owned(),
        "base-sepolia" => "eip155:84532".to_owned(),
        "solana" => "solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp".to_owned(),
        "solana-devnet" => "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1".to_owned(),
        other => other.to_owned(),
    }
}

/// Decodes a v2 (`accepted`) or v1 (top-level `scheme`, `network`) payload.
fn decode(header: &str) -> Result<Payment, TopUpError> {
    let parsed =
        decode_base64(header).and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok());
    let Some(Value::Object(object)) = parsed else {
        return fail(
            400,
            "INVALID_PAYMENT_FORMAT",
            "The payment header is not base64 of a JSON object",
            "invalid_payload",
        );
    };
    let from = object.get("accepted").unwrap_or(&Value::Null);
    let field = |name: &str| {
        from.get(name)
            .or_else(|| object.get(name))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let (Some(scheme), Some(network)) = (field("scheme"), field("network")) else {
        return fail(
            400,
            "INVALID_PAYMENT_FORMAT",
            "The payment names no scheme and network (accepted.scheme, accepted.network)",
            "invalid_payload",
        );
    };
    let Some(payload) = object.get("payload").cloned() else {
        return fail(
            400,
            "INVALID_PAYMENT_FORMAT",
            "The payment has no payload",
            "invalid_payload",
        );
    };
    Ok(Payment {
        scheme,
        network: caip2_network(&network),
        payload,
    })
}

/// An EIP-3009 authorization from a payload.
#[derive(Debug, Clone)]
struct Authorization {
    from: Address,
    to: Address,
    value: U256,
    valid_after: u64,
    valid_before: u64,
    nonce: B256,
    signature: Vec<u8>,
    /// As sent, for the facilitator.
    raw: Value,
}

fn parse_authorization(payload: &Value) -> Result<Authorization, TopUpError> {
    let invalid = |what: &str| {
        fail::<Authorization>(
            400,
            "INVALID_PAYMENT",
            format!("Invalid payment authorization: {what}"),
            "invalid_exact_evm_payload",
        )
    };
    let Some(authorization) = payload.get("authorization") else {
        return invalid("payload.authorization is missing");
    };
    let text = |name: &str| {
        authorization
            .get(name)
            .and_then(Value::as_str)
            .unwrap_or("")
    };
    let Ok(from) = text("from").parse::<Address>() else {
        return invalid("from is not an address");
    };
    let Ok(to) = text("to").parse::<Address>() else {
        return invalid("to is not an address");
    };
    // Decimal digits only: no sign, spaces, hex or fractions.
    let integer = |name: &str| {
        let value = text(name);
        (!value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()))
            .then(|| U256::from_str_radix(value, 10).ok())
            .flatten()
    };
    let Some(value) = integer("value") else {
        return invalid("value must be a decimal integer string");
    };
    let (Some(valid_after), Some(valid_before)) = (integer("validAfter"), integer("validBefore"))
    else {
        return invalid("validAfter and validBefore must be decimal integer strings");
    };
    let nonce = text("nonce");
    let nonce_ok = nonce.len() == 66
        && nonce.starts_with("0x")
        && nonce[2..].bytes().all(|b| b.is_ascii_hexdigit());
    let Some(nonce) = nonce_ok.then(|| nonce.parse::<B256>().ok()).flatten() else {
        return invalid("nonce must be 0x and 64 hex digits");
    };
    let signature = payload
        .get("signature")
        .and_then(Value::as_str)
        .and_then(|s| s.strip_prefix("0x"))
        .and_then(|hex| hex::decode(hex).ok())
        .unwrap_or_default();
    Ok(Authorization {
        from,
        to,
        value,
        valid_after: u64::try_from(valid_after).unwrap_or(u64::MAX),
        valid_before: u64::try_from(valid_before).unwrap_or(u64::MAX),
        nonce,
        signature,
        raw: authorization.clone(),
    })
}

/// Top-ups over the configured rails, the facilitator and the ledger.
#[derive(Debug, Clone)]
pub struct X402 {
    config: X402Config,
    db: Database,
    ledger: Ledger,
    http: reqwest::Client,
}

impl X402 {
    pub fn new(config: &X402Config, db: Database) -> Self {
        // reqwest is built without a bundled TLS provider; ring's, once.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(config.facilitator_timeout_secs.max(1)))
            .connect_timeout(Duration::from_secs(5))
            .build()
            .unwrap_or_default();
        Self {
            config: config.clone(),
            ledger: Ledger::new(db.clone()),
            db,
            http,
        }
    }

    /// The EIP-712 domain of our EVM asset.
    fn domain(&self) -> Result<Eip712Domain, TopUpError> {
        let chain_id = self
            .config
            .evm_network
            .strip_prefix("eip155:")
            .and_then(|id| id.parse::<u64>().ok());
        let asset = self.config.evm_asset.parse::<Address>().ok();
        let (Some(chain_id), Some(asset)) = (chain_id, asset) else {
            return fail(
                503,
                "X402_NOT_CONFIGURED",
                "x402.evm_network or x402.evm_asset is not valid",
                "not_configured",
            );
        };
        Ok(Eip712Domain::new(
            Some(self.config.evm_asset_name.clone().into()),
            Some(self.config.evm_asset_version.clone().into()),
            Some(U256::from(chain_id)),
            Some(asset),
            None,
        ))
    }

    /// Verifies, settles and credits a payment header at `now_secs`.
    pub async fn top_up(
        &self,
        header: &str,
        resource_url: &str,
        now_secs: u64,
    ) -> Result<TopUp, TopUpError> {
        if !configured(&self.config) {
            return fail(
                503,
                "X402_NOT_CONFIGURED",
                "Top-ups are not configured on this service",
                "not_configured",
            );
        }
        let payment = decode(header)?;
        if payment.scheme != "exact" {
            return fail(
                400,
                "UNSUPPORTED_SCHEME",
                format!("Scheme {:?} is not accepted; use \"exact\"", payment.scheme),
                "unsupported_scheme",
            );
        }
        if payment.network == self.config.evm_network && !self.config.pay_to_evm.is_empty() {
            self.top_up_evm(&payment, resource_url, now_secs).await
        } else if payment.network == self.config.solana_network
            && !self.config.pay_to_solana.is_empty()
        {
            self.top_up_solana(&payment, resource_url).await
        } else {
            let accepted: Vec<String> = accepts(&self.config, 0)
                .iter()
                .filter_map(|a| a["network"].as_str().map(str::to_owned))
                .collect();
            fail(
                400,
                "UNSUPPORTED_NETWORK",
                format!(
                    "Network {} is not accepted for top-ups here; pay on {}",
                    payment.network,
                    accepted.join(", ")
                ),
                "invalid_network",
            )
        }
    }

    async fn top_up_evm(
        &self,
        payment: &Payment,
        resource_url: &str,
        now_secs: u64,
    ) -> Result<TopUp, TopUpError> {
        let authorization = parse_authorization(&payment.payload)?;
        let pay_to = self.config.pay_to_evm.parse::<Address>().ok();
        if pay_to != Some(authorization.to) {
            return fail(
                400,
                "INVALID_PAYMENT_RECIPIENT",
                format!(
                    "The payment is to {}, not to this service's {}",
                    authorization.to, self.config.pay_to_evm
                ),
                "invalid_exact_evm_payload_recipient_mismatch",
            );
        }
        let (min, max) = (
            usd_to_atomic(&self.config.min_usd).unwrap_or(5_000_000),
            usd_to_atomic(&self.config.max_usd).unwrap_or(10_000_000_000),
        );
        let value = u64::try_from(authorization.value).unwrap_or(u64::MAX);
        if value < min {
            return fail(
                400,
                "AMOUNT_TOO_LOW",
                format!("The smallest top-up is ${}", self.config.min_usd),
                "invalid_exact_evm_payload_authorization_value",
            );
        }
        if value > max {
            return fail(
                400,
                "AMOUNT_TOO_HIGH",
                format!("The largest top-up is ${}", self.config.max_usd),
                "invalid_exact_evm_payload_authorization_value",
            );
        }
        if authorization.valid_after > now_secs {
            return fail(
                400,
                "INVALID_PAYMENT",
                "The authorization is not valid yet (validAfter is in the future)",
                "invalid_exact_evm_payload_authorization_valid_after",
            );
        }
        if authorization.valid_before < now_secs.saturating_add(VALID_BEFORE_MARGIN_SECS) {
            return fail(
                400,
                "INVALID_PAYMENT",
                "The authorization expires too soon to be settled (validBefore): sign a new one",
                "invalid_exact_evm_payload_authorization_valid_before",
            );
        }
        let signed = TransferWithAuthorization {
            from: authorization.from,
            to: authorization.to,
            value: authorization.value,
            validAfter: U256::from(authorization.valid_after),
            validBefore: U256::from(authorization.valid_before),
            nonce: authorization.nonce,
        };
        let digest = signed.eip712_signing_hash(&self.domain()?);
        let signature = match authorization.signature.len() {
            65 => Signature::from_raw(&authorization.signature).ok(),
            64 => Some(Signature::from_erc2098(&authorization.signature)),
            _ => None,
        };
        let recovered = signature.and_then(|s| s.recover_address_from_prehash(&digest).ok());
        if recovered != Some(authorization.from) {
            return fail(
                400,
                "INVALID_PAYMENT",
                format!(
                    "The signature does not recover to {} under {}'s EIP-712 domain ({} version {})",
                    authorization.from,
                    self.config.evm_asset,
                    self.config.evm_asset_name,
                    self.config.evm_asset_version
                ),
                "invalid_exact_evm_payload_signature",
            );
        }
        let wallet = authorization.from.to_checksum(None);
        let payment_key = format!(
            "{}:{}:{}:{}",
            self.config.evm_network,
            self.config.evm_asset.to_lowercase(),
            wallet.to_lowercase(),
            authorization.nonce
        );
        // Our requirements at the paid amount; the payload re-shaped as v2
        // with them as `accepted`, whatever the client sent.
        let requirements = accepts(&self.config, value)
            .into_iter()
            .find(|a| a["network"] == self.config.evm_network.as_str())
            .unwrap_or_default();
        // Forwarded normalized (low s, v 27/28, 65 bytes): USDC's
        // (v, r, s) recovery refuses the other forms alloy accepts.
        let normalized = signature
            .map(|s| hex::encode(s.normalized_s().as_bytes()))
            .unwrap_or_default();
        let payload = json!({
            "x402Version": 2,
            "resource": {"url": resource_url, "mimeType": "application/json"},
            "accepted": requirements,
            "payload": {
                "signature": format!("0x{normalized}"),
                "authorization": authorization.raw,
            },
        });
        self.settle_and_credit(&payment_key, &wallet, value, payload, requirements)
            .await
    }

    async fn top_up_solana(
        &self,
        payment: &Payment,
        resource_url: &str,
    ) -> Result<TopUp, TopUpError> {
        let Some(transaction) = payment
            .payload
            .get("transaction")
            .and_then(Value::as_str)
            .and_then(decode_base64)
        else {
            return fail(
                400,
                "INVALID_PAYMENT_FORMAT",
                "payload.transaction must be a base64 Solana transaction",
                "invalid_exact_svm_payload_transaction",
            );
        };
        let (min, max) = (
            usd_to_atomic(&self.config.min_usd).unwrap_or(5_000_000),
            usd_to_atomic(&self.config.max_usd).unwrap_or(10_000_000_000),
        );
        let rail = crate::solana::Rail {
            mint: &self.config.solana_asset,
            pay_to: &self.config.pay_to_solana,
            fee_payer: &self.config.solana_fee_payer,
        };
        let transfer = match crate::solana::check(&transaction, &rail, 0, u64::MAX) {
            Ok(transfer) => transfer,
            Err(why) => {
                return fail(
                    400,
                    "INVALID_PAYMENT",
                    format!("Invalid Solana payment: {why}"),
                    "invalid_exact_svm_payload_transaction",
                );
            }
        };
        if transfer.amount < min {
            return fail(
                400,
                "AMOUNT_TOO_LOW",
                format!("The smallest top-up is ${}", self.config.min_usd),
                "invalid_exact_svm_payload_amount",
            );
        }
        if transfer.amount > max {
            return fail(
                400,
                "AMOUNT_TOO_HIGH",
                format!("The largest top-up is ${}", self.config.max_usd),
                "invalid_exact_svm_payload_amount",
            );
        }
        let payment_key = format!(
            "{}:{}:{}:{}",
            self.config.solana_network,
            self.config.solana_asset,
            transfer.payer,
            transfer.message_hash
        );
        let requirements = accepts(&self.config, transfer.amount)
            .into_iter()
            .find(|a| a["network"] == self.config.solana_network.as_str())
            .unwrap_or_default();
        let payload = json!({
            "x402Version": 2,
            "resource": {"url": resource_url, "mimeType": "application/json"},
            "accepted": requirements,
            "payload": {"transaction": STANDARD.encode(&transaction)},
        });
        self.settle_and_credit(
            &payment_key,
            &transfer.payer,
            transfer.amount,
            payload,
            requirements,
        )
        .await
    }

    /// Claims the payment, has the facilitator verify and settle it, and
    /// credits `wallet` once.
    async fn settle_and_credit(
        &self,
        payment_key: &str,
        wallet: &str,
        value: u64,
        payload: Value,
        requirements: Value,
    ) -> Result<TopUp, TopUpError> {
        let owner = crate::wallet_owner(wallet);
        let payment_id = format!(
            "x402-{}",
            hex::encode(rialto_core::ids::random_bytes::<12>())
        );
        let claimed = sqlx::query(
            "INSERT INTO x402_payments (id, payment_key, wallet, network, amount_nanos, state, \
             created_at_ms) VALUES ($1, $2, $3, $4, $5, 'settling', $6)",
        )
        .bind(&payment_id)
        .bind(payment_key)
        .bind(wallet)
        .bind(requirements["network"].as_str().unwrap_or_default())
        .bind(
            i64::try_from(value)
                .unwrap_or(i64::MAX)
                .saturating_mul(NANOS_PER_ATOMIC),
        )
        .bind(now_ms())
        .execute(self.db.pool())
        .await;
        match claimed {
            Ok(_) => {}
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                return self.replayed(payment_key).await;
            }
            Err(error) => return Err(internal(error)),
        }
        let body = json!({"x402Version": 2, "paymentPayload": payload, "paymentRequirements": requirements});
        let verified = match self.facilitator("verify", &body).await {
            Ok(verified) => verified,
            Err(error) => {
                self.unclaim(payment_key).await;
                return Err(error);
            }
        };
        if verified["isValid"] != true {
            self.unclaim(payment_key).await;
            let reason = verified["invalidReason"]
                .as_str()
                .unwrap_or("invalid_payment");
            return fail(
                402,
                "PAYMENT_VERIFICATION_FAILED",
                format!("The facilitator refused the payment: {reason}"),
                reason,
            );
        }
        let settled = match self.facilitator("settle", &body).await {
            Ok(settled) => settled,
            Err(_) => {
                // The settlement may have been broadcast: the claim stays
                // (retries get 409) until an operator reconciles it, so the
                // payment can never be credited twice nor freed while it
                // may still land.
                tracing::error!(payment_key, "x402 settlement unconfirmed; the claim stays");
                return fail(
                    504,
                    "SETTLEMENT_TIMEOUT",
                    "The facilitator did not confirm the settlement; it may still land. It will \
                     be credited at most once: do not sign another payment for it, contact the \
                     operator if it is not credited",
                    "settlement_timeout",
                );
            }
        };
        if settled["success"] != true {
            self.mark_failed(payment_key).await;
            let reason = settled["errorReason"]
                .as_str()
                .unwrap_or("settlement_failed");
            return fail(
                402,
                "SETTLEMENT_FAILED",
                format!("The payment could not be settled: {reason}"),
                reason,
            );
        }
        let transaction = settled["transaction"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        // Credit once (the reference is the payment's key), and record the
        // claim settled, in one transaction.
        let usd_nanos = i64::try_from(value)
            .unwrap_or(i64::MAX)
            .saturating_mul(NANOS_PER_ATOMIC);
        let applied = self
            .ledger
            .credit_payment(
                &owner,
                usd_nanos,
                &format!("x402:{payment_key}"),
                payment_key,
                &transaction,
            )
            .await
            .map_err(|e| internal(e.message))?;
        let balance = self
            .ledger
            .balance(&owner)
            .await
            .map_err(|e| internal(e.message))?;
        tracing::info!(
            wallet,
            usd = atomic_to_usd(value),
            transaction,
            "x402 top-up credited"
        );
        Ok(TopUp {
            wallet: wallet.to_owned(),
            amount_usd: atomic_to_usd(value),
            new_balance_usd: crate::from_nanos(balance.usd),
            payment_id,
            settle_response: json!({"success": true, "network": requirements["network"],
                "payer": wallet, "transaction": transaction}),
            applied,
        })
    }

    /// A payment seen before: credited (answer as then), or still settling.
    async fn replayed(&self, payment_key: &str) -> Result<TopUp, TopUpError> {
        let row = sqlx::query(
            "SELECT id, wallet, network, amount_nanos, state, transaction_ref, created_at_ms \
             FROM x402_payments WHERE payment_key = $1",
        )
        .bind(payment_key)
        .fetch_optional(self.db.pool())
        .await
        .map_err(internal)?;
        let Some(row) = row else {
            // Freed meanwhile (the facilitator refused it): try again.
            return fail(
                409,
                "PAYMENT_IN_PROGRESS",
                "This payment is being processed; retry shortly",
                "payment_in_progress",
            );
        };
        let state: String = row.try_get("state").map_err(internal)?;
        if state == "failed" {
            return fail(
                402,
                "SETTLEMENT_FAILED",
                "This payment failed to settle before: sign a new payment",
                "settlement_failed",
            );
        }
        if state != "settled" {
            return fail(
                409,
                "PAYMENT_IN_PROGRESS",
                "This payment is being settled; retry shortly",
                "payment_in_progress",
            );
        }
        let wallet: String = row.try_get("wallet").map_err(internal)?;
        let amount: i64 = row.try_get("amount_nanos").map_err(internal)?;
        let network: String = row.try_get("network").map_err(internal)?;
        let created: i64 = row.try_get("created_at_ms").map_err(internal)?;
        // An EVM authorization carries its own window (validBefore, checked
        // before this); a Solana transaction's is its blockhash, which only
        // a node can date. Its replays are answered within the window we
        // offered (maxTimeoutSeconds) after we first saw it, then refused.
        let window_ms = i64::try_from(self.config.max_timeout_secs)
            .unwrap_or(i64::MAX)
            .saturating_mul(1000);
        if network.starts_with("solana:") && now_ms().saturating_sub(created) > window_ms {
            return fail(
                402,
                "PAYMENT_EXPIRED",
                "This payment is older than its window: sign a new payment",
                "payment_expired",
            );
        }
        let transaction: Option<String> = row.try_get("transaction_ref").map_err(internal)?;
        Ok(TopUp {
            wallet: wallet.clone(),
            amount_usd: crate::from_nanos(amount),
            // Whoever replays a payment holds only its signed bytes, which
            // travel in headers and logs: they learn nothing of the
            // wallet's balance now.
            new_balance_usd: String::new(),
            payment_id: row.try_get("id").map_err(internal)?,
            settle_response: json!({"success": true, "network": network, "payer": wallet,
                "transaction": transaction.unwrap_or_default()}),
            applied: false,
        })
    }

    /// Records that the facilitator refused to settle a claimed payment: a
    /// replay of it answers so, without asking again.
    async fn mark_failed(&self, payment_key: &str) {
        let result = sqlx::query(
            "UPDATE x402_payments SET state = 'failed' WHERE payment_key = $1 AND state = 'settling'",
        )
        .bind(payment_key)
        .execute(self.db.pool())
        .await;
        if let Err(error) = result {
            tracing::warn!(%error, "could not record a failed payment");
        }
    }

    /// Frees a claim whose payment was not settled (so it may be retried).
    async fn unclaim(&self, payment_key: &str) {
        let result =
            sqlx::query("DELETE FROM x402_payments WHERE payment_key = $1 AND state = 'settling'")
                .bind(payment_key)
                .execute(self.db.pool())
                .await;
        if let Err(error) = result {
            tracing::warn!(%error, "could not free a payment claim");
        }
    }

    /// POSTs `body` to the facilitator's `/verify` or `/settle`.
    async fn facilitator(&self, action: &str, body: &Value) -> Result<Value, TopUpError> {
        let url = format!(
            "{}/{action}",
            self.config.facilitator_url.trim_end_matches('/')
        );
        // The detail is logged, never answered: the facilitator's URL may
        // carry credentials.
        let unavailable = |why: String| {
            tracing::warn!(action, why, "x402 facilitator unavailable");
            TopUpError {
                status: 503,
                code: "FACILITATOR_UNAVAILABLE",
                message: "The payment facilitator could not be reached; nothing was charged or \
                          credited, retry later"
                    .to_owned(),
                reason: "facilitator_unavailable".to_owned(),
            }
        };
        let response = self
            .http
            .post(&url)
            .json(body)
            .send()
            .await
            .map_err(|e| unavailable(e.without_url().to_string()))?;
        let status = response.status();
        if status.is_server_error() {
            return Err(unavailable(format!("{action} answered {status}")));
        }
        response
            .json()
            .await
            .map_err(|e| unavailable(e.without_url().to_string()))
    }
}

fn internal(error: impl std::fmt::Display) -> TopUpError {
    tracing::error!(%error, "x402 top-up failed");
    TopUpError {
        status: 500,
        code: "INTERNAL_ERROR",
        message: "An unknown error occurred".to_owned(),
        reason: "internal".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Base mainnet USDC domain separator, pinned: "USD Coin" / "2".
    #[test]
    fn the_base_usdc_domain_is_pinned() {
        let config = X402Config::default();
        let domain = Eip712Domain::new(
            Some(config.evm_asset_name.clone().into()),
            Some(config.evm_asset_version.clone().into()),
            Some(U256::from(8453u64)),
            Some(config.evm_asset.parse().unwrap()),
            None,
        );
        assert_eq!(
            format!("{:?}", domain.separator()),
            "0x02fa7265e7c5d81118673727957699e4d68f74cd74b7db77da710fe8a2c7834f"
        );
    }

    /// The x402 specification's example authorization (Base Sepolia) and
    /// the one generated for Base mainnet recover to their signers.
    #[test]
    fn published_authorizations_recover() {
        let sepolia = Eip712Domain::new(
            Some("USDC".into()),
            Some("2".into()),
            Some(U256::from(84532u64)),
            Some(
                "0x036CbD53842c5426634e7929541eC2318f3dCF7e"
                    .parse()
                    .unwrap(),
            ),
            None,
        );
        let signed = TransferWithAuthorization {
            from: "0x857b06519E91e3A54538791bDbb0E22373e36b66"
                .parse()
                .unwrap(),
            to: "0x209693Bc6afc0C5328bA36FaF03C514EF312287C"
                .parse()
                .unwrap(),
            value: U256::from(10_000u64),
            validAfter: U256::from(1_740_672_089u64),
            validBefore: U256::from(1_740_672_154u64),
            nonce: "0xf3746613c2d920b5fdabc0856f2aeb2d4f88ee6037b8cc5d04a71a4462f13480"
                .parse()
                .unwrap(),
        };
        let digest = signed.eip712_signing_hash(&sepolia);
        assert_eq!(
            format!("{digest:?}"),
            "0xf256992871671abcb27ff92885a7afa46218724e5fc0bac35d050115aa1d22e6"
        );
        let signature = hex::decode("2d6a7588d6acca505cbf0d9a4a227e0c52c6c34008c8e8986a1283259764173608a2ce6496642e377d6da8dbbf5836e9bd15092f9ecab05ded3d6293af148b571c").unwrap();
        let recovered = Signature::from_raw(&signature)
            .unwrap()
            .recover_address_from_prehash(&digest)
            .unwrap();
        assert_eq!(recovered, signed.from);
    }

    #[test]
    fn amounts_convert_exactly() {
        assert_eq!(usd_to_atomic("5"), Some(5_000_000));
        assert_eq!(usd_to_atomic("0.000001"), Some(1));
        assert_eq!(usd_to_atomic("0.0000001"), None);
        assert_eq!(atomic_to_usd(5_000_000), "5");
        assert_eq!(caip2_network("base"), "eip155:8453");
    }
}

/// Properties: no payment header, however malformed, panics its parsing.
#[cfg(test)]
mod properties {
    use super::*;
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use proptest::prelude::*;

    /// JSON of the payload's shape with values drawn from near misses.
    fn payloads() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            ".{0,24}".prop_map(Value::from),
            Just(Value::from("0x2222222222222222222222222222222222222222")),
            Just(Value::from(
                "115792089237316195423570985008687907853269984665640564039457584007913129639936"
            )),
            Just(Value::from("eip155:8453")),
            Just(Value::from("exact")),
        ];
        leaf.prop_recursive(3, 24, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::btree_map(
                    prop::sample::select(vec![
                        "x402Version",
                        "accepted",
                        "payload",
                        "authorization",
                        "from",
                        "to",
                        "value",
                        "validAfter",
                        "validBefore",
                        "nonce",
                        "signature",
                        "transaction",
                        "scheme",
                        "network",
                        "asset",
                        "amount",
                        "payTo",
                    ]),
                    inner,
                    0..6,
                )
                .prop_map(|map| Value::Object(
                    map.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
                )),
            ]
        })
    }

    proptest! {
        #[test]
        fn arbitrary_headers_are_refused(header in ".{0,300}") {
            prop_assert!(decode(&header).is_err());
        }

        #[test]
        fn payload_shaped_json_is_parsed_or_refused(payload in payloads()) {
            let header = STANDARD.encode(payload.to_string());
            if let Ok(payment) = decode(&header) {
                let _ = parse_authorization(&payment.payload);
            }
            let _ = parse_authorization(&payload);
        }

        #[test]
        fn usd_amounts_are_read_or_refused(text in "-?[0-9]{0,40}(\\.[0-9]{0,12})?") {
            if let Some(atomic) = usd_to_atomic(&text) {
                prop_assert_eq!(usd_to_atomic(&atomic_to_usd(atomic)), Some(atomic));
            }
        }
    }
}
