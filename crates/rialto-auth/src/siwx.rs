//! Sign-In-With-X: a wallet proves it controls an address by signing a
//! sign-in message (CAIP-122), sent base64-encoded JSON in the
//! `SIGN-IN-WITH-X` header (legacy `X-Sign-In-With-X`).
//!
//! Two shapes of the header are accepted:
//! - **structured** (x402's SIWX extension): `domain, address, uri, version,
//!   chainId, type, nonce, issuedAt, signature` (required) and
//!   `statement, expirationTime, notBefore, requestId, resources,
//!   signatureScheme` (optional). The message is rebuilt from the fields
//!   and the signature checked over it.
//! - **signed text** (the hosted API's): `address, message, signature`
//!   (required) and `chainId, type, timestamp` (optional). The message is
//!   parsed, its fields checked like the structured ones, and the
//!   signature checked over the text exactly as sent.
//!
//! EVM wallets (`eip191`, chain `eip155:<id>`) sign the EIP-4361 text with
//! EIP-191 `personal_sign`; the address is recovered with alloy. Solana
//! wallets (`ed25519`, chain `solana:<genesis>`) sign the SIWS text with
//! Ed25519 (ed25519-dalek, strict); address and signature are base58.
//! Timestamps are kept as sent: the message is rebuilt byte for byte.
//!
//! This module only verifies; that a nonce is used once per wallet is the
//! caller's (the auth service's nonce table).

use alloy_primitives::{Address, Signature};
use base64::Engine;
use chrono::{DateTime, Utc};
use serde_json::{Map, Value};

/// The Solana mainnet genesis hash: the reference of `solana:<ref>`.
pub const SOLANA_MAINNET: &str = "5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp";
/// How old `issuedAt` may be.
pub const MAX_AGE_MS: i64 = 5 * 60 * 1000;
/// How far in the future `issuedAt` may be (clock skew).
pub const FUTURE_SKEW_MS: i64 = 30 * 1000;

/// What a sign-in must match.
#[derive(Debug, Clone)]
pub struct SiwxPolicy {
    /// Accepted `domain` values (`host` or `host:port`), compared without
    /// case; the `uri` must name one of them too.
    pub domains: Vec<String>,
    /// Accepted EVM chain ids (`eip155:<id>`).
    pub evm_chains: Vec<u64>,
    /// Accepted Solana chain references (`solana:<ref>`).
    pub solana_chains: Vec<String>,
}

impl Default for SiwxPolicy {
    fn default() -> Self {
        Self {
            domains: vec!["localhost:8080".into(), "127.0.0.1:8080".into()],
            evm_chains: vec![8453],
            solana_chains: vec![SOLANA_MAINNET.into()],
        }
    }
}

/// The kind of wallet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Evm,
    Solana,
}

/// A verified sign-in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedIn {
    /// EIP-55 checksummed (EVM) or base58 (Solana).
    pub address: String,
    pub family: Family,
    /// CAIP-2, e.g. `eip155:8453`.
    pub chain_id: String,
    pub nonce: String,
    /// Unix ms after which the header is no longer accepted: the nonce must
    /// be remembered at least this long.
    pub valid_until_ms: i64,
}

/// Why a sign-in was refused: a stable code (the hosted API's
/// `X402_SIGN_IN_*`) and a message a developer can act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: &'static str,
    pub message: String,
}

fn refuse<T>(code: &'static str, message: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal {
        code,
        message: message.into(),
    })
}

/// The fields of a sign-in message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Fields {
    domain: String,
    address: String,
    statement: Option<String>,
    uri: String,
    version: String,
    /// The reference as written on the `Chain ID` line (`8453`,
    /// `5eykt4...`).
    chain_ref: String,
    nonce: String,
    issued_at: String,
    expiration_time: Option<String>,
    not_before: Option<String>,
    request_id: Option<String>,
    resources: Vec<String>,
}

impl Fields {
    /// The EIP-4361 (EVM) or SIWS (Solana) text these fields sign.
    fn message(&self, family: Family) -> String {
        let account = match family {
            Family::Evm => "Ethereum",
            Family::Solana => "Solana",
        };
        let mut text = format!(
            "{} wants you to sign in with your {account} account:\n{}\n\n",
            self.domain, self.address
        );
        match (&self.statement, family) {
            (Some(statement), _) => {
                text.push_str(statement);
                text.push_str("\n\n");
            }
            // EIP-4361: `address LF LF [statement LF] LF "URI: "`; x402's
            // SIWS formatter writes a single blank line.
            (None, Family::Evm) => text.push('\n'),
            (None, Family::Solana) => {}
        }
        text.push_str(&format!(
            "URI: {}\nVersion: {}\nChain ID: {}\nNonce: {}\nIssued At: {}",
            self.uri, self.version, self.chain_ref, self.nonce, self.issued_at
        ));
        for (label, value) in [
            ("Expiration Time", &self.expiration_time),
            ("Not Before", &self.not_before),
            ("Request ID", &self.request_id),
        ] {
            if let Some(value) = value {
                text.push_str(&format!("\n{label}: {value}"));
            }
        }
        if !self.resources.is_empty() {
            text.push_str("\nResources:");
            for resource in &self.resources {
                text.push_str(&format!("\n- {resource}"));
            }
        }
        text
    }

    /// Parses a signed text back into its fields and wallet family.
    fn parse(text: &str) -> Result<(Self, Family), Refusal> {
        let bad = |why: &str| {
            refuse::<(Self, Family)>(
                "X402_SIGN_IN_INVALID_MESSAGE",
                format!("The signed message is not a sign-in message: {why}"),
            )
        };
        let mut lines = text.split('\n').peekable();
        let Some(first) = lines.next() else {
            return bad("it is empty");
        };
        let (domain, family) = if let Some(domain) =
            first.strip_suffix(" wants you to sign in with your Ethereum account:")
        {
            (domain, Family::Evm)
        } else if let Some(domain) =
            first.strip_suffix(" wants you to sign in with your Solana account:")
        {
            (domain, Family::Solana)
        } else {
            return bad(
                "the first line must be \"<domain> wants you to sign in with your Ethereum (or Solana) account:\"",
            );
        };
        let Some(address) = lines.next() else {
            return bad("the address line is missing");
        };
        let mut fields = Self {
            domain: domain.to_owned(),
            address: address.to_owned(),
            ..Self::default()
        };
        while lines.peek() == Some(&"") {
            lines.next();
        }
        if let Some(line) = lines.peek()
            && !line.starts_with("URI: ")
        {
            fields.statement = Some((*line).to_owned());
            lines.next();
            while lines.peek() == Some(&"") {
                lines.next();
            }
        }
        let mut take = |label: &str, required: bool| -> Result<Option<String>, Refusal> {
            match lines.peek().and_then(|l| l.strip_prefix(label)) {
                Some(value) => {
                    let value = value.to_owned();
                    lines.next();
                    Ok(Some(value))
                }
                None if required => refuse(
                    "X402_SIGN_IN_INVALID_MESSAGE",
                    format!(
                        "The signed message is not a sign-in message: the \"{}\" line is missing or out of order",
                        label.trim_end_matches(": ")
                    ),
                ),
                None => Ok(None),
            }
        };
        fields.uri = take("URI: ", true)?.unwrap_or_default();
        fields.version = take("Version: ", true)?.unwrap_or_default();
        fields.chain_ref = take("Chain ID: ", true)?.unwrap_or_default();
        fields.nonce = take("Nonce: ", true)?.unwrap_or_default();
        fields.issued_at = take("Issued At: ", true)?.unwrap_or_default();
        fields.expiration_time = take("Expiration Time: ", false)?;
        fields.not_before = take("Not Before: ", false)?;
        fields.request_id = take("Request ID: ", false)?;
        if lines.peek() == Some(&"Resources:") {
            lines.next();
            while let Some(resource) = lines.peek().and_then(|l| l.strip_prefix("- ")) {
                fields.resources.push(resource.to_owned());
                lines.next();
            }
        }
        if let Some(extra) = lines.next() {
            return bad(&format!("unexpected line {extra:?}"));
        }
        Ok((fields, family))
    }
}

/// The EIP-4361 text an EVM wallet signs to sign in (version 1), for a
/// client to present to the wallet: sent back as `message` with the
/// wallet's `address` and `signature` (the signed-text shape), it verifies
/// here. `statement` is one line (an empty one is none); the times are
/// RFC 3339, kept as given.
#[allow(clippy::too_many_arguments)]
pub fn evm_message(
    domain: &str,
    address: &str,
    statement: Option<&str>,
    uri: &str,
    chain_id: u64,
    nonce: &str,
    issued_at: &str,
    expiration_time: Option<&str>,
) -> String {
    let fields = Fields {
        domain: domain.to_owned(),
        address: address.to_owned(),
        statement: statement.filter(|s| !s.is_empty()).map(str::to_owned),
        uri: uri.to_owned(),
        version: "1".to_owned(),
        chain_ref: chain_id.to_string(),
        nonce: nonce.to_owned(),
        issued_at: issued_at.to_owned(),
        expiration_time: expiration_time.map(str::to_owned),
        ..Fields::default()
    };
    fields.message(Family::Evm)
}

/// Decodes base64 leniently: standard or URL-safe, padded or not.
fn decode_base64(text: &str) -> Option<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let text = text.trim();
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(text).ok())
}

fn string_field(object: &Map<String, Value>, name: &str) -> Result<Option<String>, Refusal> {
    match object.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => refuse(
            "X402_SIGN_IN_INVALID_PAYLOAD",
            format!("Sign-in field {name} must be a string"),
        ),
    }
}

fn required(object: &Map<String, Value>, name: &str) -> Result<String, Refusal> {
    string_field(object, name)?
        .filter(|s| !s.is_empty())
        .map_or_else(
            || {
                refuse(
                    "X402_SIGN_IN_INVALID_PAYLOAD",
                    format!("Sign-in field {name} is required"),
                )
            },
            Ok,
        )
}

/// The payload's `chainId` as CAIP-2: `8453`, `"8453"` and `"eip155:8453"`
/// are EVM; `"solana:<ref>"` (or a bare genesis reference) Solana.
fn caip2(value: Option<&Value>) -> Result<Option<String>, Refusal> {
    let text = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Number(n)) => n.to_string(),
        Some(Value::String(s)) => s.trim().to_owned(),
        Some(_) => {
            return refuse(
                "X402_SIGN_IN_INVALID_CHAIN_ID",
                "chainId must be a CAIP-2 string such as \"eip155:8453\", or a number",
            );
        }
    };
    if text.contains(':') {
        Ok(Some(text))
    } else if text.bytes().all(|b| b.is_ascii_digit()) && !text.is_empty() {
        Ok(Some(format!("eip155:{text}")))
    } else if !text.is_empty() {
        Ok(Some(format!("solana:{text}")))
    } else {
        refuse("X402_SIGN_IN_INVALID_CHAIN_ID", "chainId is empty")
    }
}

fn parse_time(field: &str, text: &str) -> Result<i64, Refusal> {
    DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&Utc).timestamp_millis())
        .or_else(|_| {
            refuse(
                "X402_SIGN_IN_INVALID_MESSAGE",
                format!("{field} must be an RFC 3339 time such as 2026-11-22T10:00:00.000Z"),
            )
        })
}

/// Verifies a `SIGN-IN-WITH-X` header value at `now_ms`.
pub fn verify(header: &str, policy: &SiwxPolicy, now_ms: i64) -> Result<SignedIn, Refusal> {
    let Some(bytes) = decode_base64(header) else {
        return refuse(
            "X402_SIGN_IN_PARSE_ERROR",
            "The SIGN-IN-WITH-X header is not base64",
        );
    };
    let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(&bytes) else {
        return refuse(
            "X402_SIGN_IN_PARSE_ERROR",
            "The SIGN-IN-WITH-X header is not base64 of a JSON object",
        );
    };
    let declared_type = string_field(&object, "type")?;
    if let Some(kind) = &declared_type
        && !matches!(kind.as_str(), "eip191" | "ed25519")
    {
        return refuse(
            "X402_SIGN_IN_INVALID_PAYLOAD",
            format!("Unknown sign-in type {kind:?}: use \"eip191\" (EVM) or \"ed25519\" (Solana)"),
        );
    }
    let signature = required(&object, "signature")?;
    let chain = caip2(object.get("chainId"))?;
    let (fields, family, message) = match string_field(&object, "message")? {
        Some(message) => {
            let (fields, family) = Fields::parse(&message)?;
            let address = required(&object, "address")?;
            if !same_address(&address, &fields.address, family) {
                return refuse(
                    "X402_SIGN_IN_ADDRESS_MISMATCH",
                    "The address does not match the one in the signed message",
                );
            }
            (fields, family, message)
        }
        None => {
            let family = match (declared_type.as_deref(), chain.as_deref()) {
                (Some("ed25519"), _) => Family::Solana,
                (Some("eip191"), _) => Family::Evm,
                (None, Some(c)) if c.starts_with("solana:") => Family::Solana,
                _ => Family::Evm,
            };
            let chain_ref = chain
                .as_deref()
                .and_then(|c| c.split_once(':'))
                .map(|(_, reference)| reference.to_owned())
                .ok_or_else(|| Refusal {
                    code: "X402_SIGN_IN_INVALID_PAYLOAD",
                    message: "Sign-in field chainId is required".into(),
                })?;
            let resources = match object.get("resources") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|item| item.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| Refusal {
                        code: "X402_SIGN_IN_INVALID_PAYLOAD",
                        message: "resources must be an array of strings".into(),
                    })?,
                Some(_) => {
                    return refuse(
                        "X402_SIGN_IN_INVALID_PAYLOAD",
                        "resources must be an array of strings",
                    );
                }
            };
            let fields = Fields {
                domain: required(&object, "domain")?,
                address: required(&object, "address")?,
                statement: string_field(&object, "statement")?.filter(|s| !s.is_empty()),
                uri: required(&object, "uri")?,
                version: required(&object, "version")?,
                chain_ref,
                nonce: required(&object, "nonce")?,
                issued_at: required(&object, "issuedAt")?,
                expiration_time: string_field(&object, "expirationTime")?,
                not_before: string_field(&object, "notBefore")?,
                request_id: string_field(&object, "requestId")?,
                resources,
            };
            if fields
                .statement
                .as_deref()
                .is_some_and(|s| s.contains('\n'))
            {
                return refuse(
                    "X402_SIGN_IN_INVALID_MESSAGE",
                    "The statement must be a single line",
                );
            }
            let message = fields.message(family);
            (fields, family, message)
        }
    };
    // The wallet family, the declared type and the chain must agree.
    let prefix = match family {
        Family::Evm => "eip155",
        Family::Solana => "solana",
    };
    if let Some(kind) = &declared_type {
        let expected = match family {
            Family::Evm => "eip191",
            Family::Solana => "ed25519",
        };
        if kind != expected {
            return refuse(
                "X402_SIGN_IN_CHAIN_MISMATCH",
                format!("Sign-in type {kind:?} does not fit a {prefix} wallet (use {expected:?})"),
            );
        }
    }
    let chain_id = format!("{prefix}:{}", fields.chain_ref);
    if let Some(declared) = &chain
        && *declared != chain_id
    {
        return refuse(
            "X402_SIGN_IN_CHAIN_MISMATCH",
            format!("chainId {declared} does not match the message's Chain ID ({chain_id})"),
        );
    }
    let supported = match family {
        Family::Evm => fields
            .chain_ref
            .parse::<u64>()
            .is_ok_and(|id| policy.evm_chains.contains(&id)),
        Family::Solana => policy.solana_chains.contains(&fields.chain_ref),
    };
    if !supported {
        let mut accepted: Vec<String> = policy
            .evm_chains
            .iter()
            .map(|id| format!("eip155:{id}"))
            .collect();
        accepted.extend(policy.solana_chains.iter().map(|r| format!("solana:{r}")));
        return refuse(
            "X402_SIGN_IN_UNSUPPORTED_CHAIN",
            format!(
                "Chain {chain_id} is not accepted here; sign in on one of {}",
                accepted.join(", ")
            ),
        );
    }
    check_fields(&fields, policy, now_ms)?;
    if let Some(timestamp) = object.get("timestamp").filter(|t| !t.is_null()) {
        let issued = parse_time("issuedAt", &fields.issued_at)?;
        let within = timestamp
            .as_i64()
            .and_then(|ms| ms.checked_sub(issued))
            .is_some_and(|gap| gap.unsigned_abs() <= FUTURE_SKEW_MS.unsigned_abs());
        if !within {
            return refuse(
                "X402_SIGN_IN_TIMESTAMP_MISMATCH",
                "timestamp (Unix ms) must be within 30 seconds of the message's Issued At",
            );
        }
    }
    let address = verify_signature(family, &fields.address, &message, &signature)?;
    let issued = parse_time("issuedAt", &fields.issued_at)?;
    let mut valid_until = issued + MAX_AGE_MS;
    if let Some(expiry) = &fields.expiration_time {
        valid_until = valid_until.min(parse_time("expirationTime", expiry)?);
    }
    Ok(SignedIn {
        address,
        family,
        chain_id,
        nonce: fields.nonce,
        valid_until_ms: valid_until,
    })
}

/// The `host[:port]` a browser would reach for `uri`, read by the WHATWG
/// URL parser as browsers read it: in `http://evil.com\@localhost:8080`
/// the `\` ends the authority, so the host is `evil.com`. A scheme's
/// default port is left out, as browsers do.
fn authority(uri: &str) -> Option<String> {
    let url = url::Url::parse(uri).ok()?;
    let host = url.host_str()?;
    Some(match url.port() {
        Some(port) => format!("{host}:{port}"),
        None => host.to_owned(),
    })
}

fn check_fields(fields: &Fields, policy: &SiwxPolicy, now_ms: i64) -> Result<(), Refusal> {
    // One line each: a field with a line break could forge others.
    let texts = [
        &fields.domain,
        &fields.address,
        &fields.uri,
        &fields.version,
        &fields.chain_ref,
        &fields.nonce,
        &fields.issued_at,
    ]
    .into_iter()
    .chain(&fields.statement)
    .chain(&fields.expiration_time)
    .chain(&fields.not_before)
    .chain(&fields.request_id)
    .chain(&fields.resources);
    for text in texts {
        if text.chars().any(char::is_control) {
            return refuse(
                "X402_SIGN_IN_INVALID_MESSAGE",
                "Sign-in fields must not contain line breaks or other control characters",
            );
        }
    }
    let accepted = |name: &str| policy.domains.iter().any(|d| d.eq_ignore_ascii_case(name));
    if !accepted(&fields.domain) {
        return refuse(
            "X402_SIGN_IN_DOMAIN_MISMATCH",
            format!(
                "The message is for domain {:?}; this service accepts {}",
                fields.domain,
                policy.domains.join(", ")
            ),
        );
    }
    if !authority(&fields.uri).is_some_and(|name| accepted(&name)) {
        return refuse(
            "X402_SIGN_IN_DOMAIN_MISMATCH",
            format!(
                "The message's URI {:?} is not on an accepted domain ({})",
                fields.uri,
                policy.domains.join(", ")
            ),
        );
    }
    if fields.version != "1" {
        return refuse(
            "X402_SIGN_IN_INVALID_MESSAGE",
            format!("Version must be 1, not {:?}", fields.version),
        );
    }
    if fields.nonce.len() < 8 || !fields.nonce.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return refuse(
            "X402_SIGN_IN_MISSING_NONCE",
            "The nonce must be at least 8 letters or digits, new for every request",
        );
    }
    let issued = parse_time("issuedAt", &fields.issued_at)?;
    if issued > now_ms + FUTURE_SKEW_MS {
        return refuse(
            "X402_SIGN_IN_FUTURE_TIMESTAMP",
            "Issued At is in the future: check the client's clock",
        );
    }
    if now_ms - issued > MAX_AGE_MS {
        return refuse(
            "X402_SIGN_IN_EXPIRED",
            "The message was issued more than 5 minutes ago: sign a new one",
        );
    }
    if let Some(expiry) = &fields.expiration_time
        && parse_time("expirationTime", expiry)? <= now_ms
    {
        return refuse(
            "X402_SIGN_IN_EXPIRED",
            "The message has expired (Expiration Time): sign a new one",
        );
    }
    if let Some(not_before) = &fields.not_before
        && parse_time("notBefore", not_before)? > now_ms
    {
        return refuse(
            "X402_SIGN_IN_NOT_BEFORE",
            "The message is not valid yet (Not Before)",
        );
    }
    Ok(())
}

fn same_address(a: &str, b: &str, family: Family) -> bool {
    match family {
        Family::Evm => a.eq_ignore_ascii_case(b),
        Family::Solana => a == b,
    }
}

/// Checks `signature` of `message` by `address`'s wallet (EIP-191 for EVM,
/// Ed25519 for Solana); returns the address as it is written canonically.
pub(crate) fn verify_signature(
    family: Family,
    address: &str,
    message: &str,
    signature: &str,
) -> Result<String, Refusal> {
    match family {
        Family::Evm => verify_evm(address, message, signature),
        Family::Solana => verify_solana(address, message, signature),
    }
}

/// EIP-191 recovery: returns the checksummed address when the signature
/// recovers to `address`.
fn verify_evm(address: &str, message: &str, signature: &str) -> Result<String, Refusal> {
    let Ok(claimed) = address.parse::<Address>() else {
        return refuse(
            "X402_SIGN_IN_INVALID_WALLET",
            format!("{address:?} is not an EVM address (0x and 40 hex digits)"),
        );
    };
    let bytes = signature
        .strip_prefix("0x")
        .and_then(|hex| hex::decode(hex).ok())
        .unwrap_or_default();
    let parsed = match bytes.len() {
        65 => Signature::from_raw(&bytes).ok(),
        64 => Some(Signature::from_erc2098(&bytes)),
        _ => None,
    };
    let Some(parsed) = parsed else {
        return refuse(
            "X402_SIGN_IN_INVALID_SIGNATURE",
            "The signature must be 0x and 65 bytes of hex (r, s, v)",
        );
    };
    match parsed.recover_address_from_msg(message.as_bytes()) {
        Ok(recovered) if recovered == claimed => Ok(claimed.to_checksum(None)),
        _ => refuse(
            "X402_SIGN_IN_INVALID_SIGNATURE",
            "The signature does not verify for this address and message",
        ),
    }
}

/// Ed25519 over the message's UTF-8 bytes; the key is the address.
fn verify_solana(address: &str, message: &str, signature: &str) -> Result<String, Refusal> {
    use ed25519_dalek::{Signature as EdSignature, VerifyingKey};
    let key = bs58::decode(address)
        .into_vec()
        .ok()
        .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
        .and_then(|bytes| VerifyingKey::from_bytes(&bytes).ok());
    let Some(key) = key else {
        return refuse(
            "X402_SIGN_IN_INVALID_WALLET",
            format!("{address:?} is not a Solana address (base58 of 32 bytes)"),
        );
    };
    // Base58 as the standard says; base64 as some wallets send it.
    let bytes = bs58::decode(signature)
        .into_vec()
        .ok()
        .filter(|b| b.len() == 64)
        .or_else(|| decode_base64(signature).filter(|b| b.len() == 64));
    let Some(bytes) = bytes.and_then(|b| <[u8; 64]>::try_from(b).ok()) else {
        return refuse(
            "X402_SIGN_IN_INVALID_SIGNATURE",
            "The signature must be base58 of 64 bytes",
        );
    };
    match key.verify_strict(message.as_bytes(), &EdSignature::from_bytes(&bytes)) {
        Ok(()) => Ok(address.to_owned()),
        Err(_) => refuse(
            "X402_SIGN_IN_INVALID_SIGNATURE",
            "The signature does not verify for this address and message",
        ),
    }
}

/// Test helpers: builds and signs headers with real keys.
#[cfg(test)]
mod tests {
    use super::*;
    use alloy_signer::SignerSync;
    use alloy_signer_local::PrivateKeySigner;
    use base64::engine::general_purpose::STANDARD;
    use ed25519_dalek::{Signer, SigningKey};
    use serde_json::json;

    const ANVIL_0: &str = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80";
    const NOW: i64 = 1_763_805_600_000; // 2025-11-22T10:00:00Z

    fn policy() -> SiwxPolicy {
        SiwxPolicy {
            domains: vec!["127.0.0.1:8080".into(), "localhost:8080".into()],
            ..SiwxPolicy::default()
        }
    }

    fn iso(ms: i64) -> String {
        DateTime::<Utc>::from_timestamp_millis(ms)
            .unwrap()
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    }

    fn evm_fields(signer: &PrivateKeySigner) -> Value {
        json!({
            "domain": "127.0.0.1:8080",
            "address": signer.address().to_checksum(None),
            "statement": "Sign in to Rialto",
            "uri": "http://127.0.0.1:8080",
            "version": "1",
            "chainId": "eip155:8453",
            "type": "eip191",
            "nonce": "a1b2c3d4e5f67890",
            "issuedAt": iso(NOW - 1000),
            "expirationTime": iso(NOW + 240_000),
        })
    }

    /// Signs the structured payload's message with `signer`.
    fn sign_evm(signer: &PrivateKeySigner, mut payload: Value) -> String {
        let object = payload.as_object().unwrap().clone();
        let fields = Fields {
            domain: object["domain"].as_str().unwrap().into(),
            address: object["address"].as_str().unwrap().into(),
            statement: object
                .get("statement")
                .and_then(Value::as_str)
                .map(Into::into),
            uri: object["uri"].as_str().unwrap().into(),
            version: object["version"].as_str().unwrap().into(),
            chain_ref: object["chainId"]
                .as_str()
                .unwrap()
                .split_once(':')
                .unwrap()
                .1
                .into(),
            nonce: object["nonce"].as_str().unwrap().into(),
            issued_at: object["issuedAt"].as_str().unwrap().into(),
            expiration_time: object
                .get("expirationTime")
                .and_then(Value::as_str)
                .map(Into::into),
            ..Fields::default()
        };
        let signature = signer
            .sign_message_sync(fields.message(Family::Evm).as_bytes())
            .unwrap();
        payload["signature"] = json!(format!("0x{}", hex::encode(signature.as_bytes())));
        STANDARD.encode(payload.to_string())
    }

    fn solana_key() -> SigningKey {
        let seed: [u8; 32] = core::array::from_fn(|i| i as u8 + 1);
        SigningKey::from_bytes(&seed)
    }

    fn solana_header(key: &SigningKey, issued: i64) -> (String, String) {
        let address = bs58::encode(key.verifying_key().as_bytes()).into_string();
        let fields = Fields {
            domain: "localhost:8080".into(),
            address: address.clone(),
            statement: Some("Sign in to Rialto".into()),
            uri: "http://localhost:8080".into(),
            version: "1".into(),
            chain_ref: SOLANA_MAINNET.into(),
            nonce: "3f2a91c4d80b7e15".into(),
            issued_at: iso(issued),
            ..Fields::default()
        };
        let message = fields.message(Family::Solana);
        let signature = bs58::encode(key.sign(message.as_bytes()).to_bytes()).into_string();
        let payload = json!({"address": address, "message": message, "signature": signature,
            "chainId": format!("solana:{SOLANA_MAINNET}"), "type": "ed25519"});
        (STANDARD.encode(payload.to_string()), address)
    }

    #[test]
    fn a_structured_evm_sign_in_verifies() {
        let signer: PrivateKeySigner = ANVIL_0.parse().unwrap();
        let header = sign_evm(&signer, evm_fields(&signer));
        let signed = verify(&header, &policy(), NOW).unwrap();
        assert_eq!(signed.address, "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266");
        assert_eq!(signed.family, Family::Evm);
        assert_eq!(signed.chain_id, "eip155:8453");
        assert_eq!(signed.valid_until_ms, NOW + 240_000);
    }

    #[test]
    fn the_hosted_apis_signed_text_shape_verifies() {
        let signer: PrivateKeySigner = ANVIL_0.parse().unwrap();
        let mut fields = evm_fields(&signer);
        fields["statement"] = Value::Null;
        let header = sign_evm(&signer, fields.clone());
        // Rebuild the text the structured form signed and send it as
        // `message` with a numeric chain id.
        let payload: Value = serde_json::from_slice(&STANDARD.decode(&header).unwrap()).unwrap();
        let text = format!(
            "127.0.0.1:8080 wants you to sign in with your Ethereum account:\n{}\n\n\nURI: http://127.0.0.1:8080\nVersion: 1\nChain ID: 8453\nNonce: a1b2c3d4e5f67890\nIssued At: {}\nExpiration Time: {}",
            signer.address().to_checksum(None),
            fields["issuedAt"].as_str().unwrap(),
            fields["expirationTime"].as_str().unwrap()
        );
        let hosted = json!({"address": signer.address().to_string().to_lowercase(),
            "message": text, "signature": payload["signature"], "chainId": 8453,
            "timestamp": NOW - 1000});
        let signed = verify(&STANDARD.encode(hosted.to_string()), &policy(), NOW).unwrap();
        assert_eq!(signed.nonce, "a1b2c3d4e5f67890");
    }

    /// The text `evm_message` builds parses back to its fields, and a
    /// wallet's signature over it verifies in the signed-text shape.
    #[test]
    fn an_evm_message_built_here_parses_and_verifies() {
        let signer: PrivateKeySigner = ANVIL_0.parse().unwrap();
        let address = signer.address().to_checksum(None);
        let (issued, expires) = (iso(NOW - 1000), iso(NOW + 240_000));
        let text = evm_message(
            "127.0.0.1:8080",
            &address,
            Some("Sign in to Rialto"),
            "http://127.0.0.1:8080",
            8453,
            "a1b2c3d4e5f67890",
            &issued,
            Some(&expires),
        );
        let expected = Fields {
            domain: "127.0.0.1:8080".into(),
            address: address.clone(),
            statement: Some("Sign in to Rialto".into()),
            uri: "http://127.0.0.1:8080".into(),
            version: "1".into(),
            chain_ref: "8453".into(),
            nonce: "a1b2c3d4e5f67890".into(),
            issued_at: issued.clone(),
            expiration_time: Some(expires.clone()),
            ..Fields::default()
        };
        assert_eq!(Fields::parse(&text).unwrap(), (expected, Family::Evm));
        // Without a statement too.
        let bare = evm_message("a:1", &address, None, "http://a:1", 1, "n", "t", None);
        let (fields, _) = Fields::parse(&bare).unwrap();
        assert_eq!((fields.statement, fields.expiration_time), (None, None));

        let signature = signer.sign_message_sync(text.as_bytes()).unwrap();
        let header = json!({"address": address, "message": text,
            "signature": format!("0x{}", hex::encode(signature.as_bytes()))});
        let signed = verify(&STANDARD.encode(header.to_string()), &policy(), NOW).unwrap();
        assert_eq!(signed.address, address);
        assert_eq!(signed.family, Family::Evm);
        assert_eq!(signed.chain_id, "eip155:8453");
        assert_eq!(signed.nonce, "a1b2c3d4e5f67890");
        assert_eq!(signed.valid_until_ms, NOW + 240_000);
    }

    /// The siwe-rs test vector: a message signed by a wallet we do not hold.
    #[test]
    fn a_published_siwe_vector_parses_and_verifies() {
        let text = "localhost:4361 wants you to sign in with your Ethereum account:\n0x6Da01670d8fc844e736095918bbE11fE8D564163\n\nSIWE Notepad Example\n\nURI: http://localhost:4361\nVersion: 1\nChain ID: 1\nNonce: kEWepMt9knR6lWJ6A\nIssued At: 2021-12-07T18:28:18.807Z";
        let (fields, family) = Fields::parse(text).unwrap();
        assert_eq!(fields.message(family), text);
        let signature = "0x6228b3ecd7bf2df018183aeab6b6f1db1e9f4e3cbe24560404112e25363540eb679934908143224d746bbb5e1aa65ab435684081f4dbb74a0fec57f98f40f5051c";
        let address = "0x6Da01670d8fc844e736095918bbE11fE8D564163";
        assert_eq!(verify_evm(address, text, signature).unwrap(), address);
        let tampered = signature.replacen("0x62", "0x72", 1);
        assert!(verify_evm(address, text, &tampered).is_err());
    }

    #[test]
    fn a_solana_sign_in_verifies() {
        let key = solana_key();
        let (header, address) = solana_header(&key, NOW - 5_000);
        assert_eq!(address, "9C6hybhQ6Aycep9jaUnP6uL9ZYvDjUp1aSkFWPUFJtpj");
        let signed = verify(&header, &policy(), NOW).unwrap();
        assert_eq!(signed.address, address);
        assert_eq!(signed.family, Family::Solana);
        assert_eq!(signed.valid_until_ms, NOW - 5_000 + MAX_AGE_MS);
    }

    /// Every refusal, each with its code.
    #[test]
    fn refusals_say_why() {
        let signer: PrivateKeySigner = ANVIL_0.parse().unwrap();
        let code = |header: &str| verify(header, &policy(), NOW).unwrap_err().code;
        let with = |change: &dyn Fn(&mut Value)| {
            let mut fields = evm_fields(&signer);
            change(&mut fields);
            sign_evm(&signer, fields)
        };
        assert_eq!(code("%%%"), "X402_SIGN_IN_PARSE_ERROR");
        assert_eq!(code(&STANDARD.encode("[1]")), "X402_SIGN_IN_PARSE_ERROR");
        assert_eq!(
            code(&with(&|f| f["domain"] = json!("evil.example:8080"))),
            "X402_SIGN_IN_DOMAIN_MISMATCH"
        );
        assert_eq!(
            code(&with(&|f| f["uri"] = json!("https://evil.example/"))),
            "X402_SIGN_IN_DOMAIN_MISMATCH"
        );
        // Browsers read `\` as `/`: the host is evil.com, not the one after `@`.
        for uri in [
            "http://evil.com\\@localhost:8080",
            "http://evil.com\\@127.0.0.1:8080/",
            "http://localhost:8080@evil.com/",
            "http://localhost:8081/",
            "not a uri",
        ] {
            assert_eq!(
                code(&with(&|f| f["uri"] = json!(uri))),
                "X402_SIGN_IN_DOMAIN_MISMATCH",
                "{uri}"
            );
        }
        assert_eq!(
            code(&with(&|f| f["chainId"] = json!("eip155:1"))),
            "X402_SIGN_IN_UNSUPPORTED_CHAIN"
        );
        assert_eq!(
            code(&with(&|f| f["type"] = json!("eip1271"))),
            "X402_SIGN_IN_INVALID_PAYLOAD"
        );
        assert_eq!(
            code(&with(&|f| f["expirationTime"] = json!(iso(NOW - 1)))),
            "X402_SIGN_IN_EXPIRED"
        );
        assert_eq!(
            code(&with(&|f| f["issuedAt"] = json!(iso(NOW - MAX_AGE_MS - 1)))),
            "X402_SIGN_IN_EXPIRED"
        );
        assert_eq!(
            code(&with(&|f| f["issuedAt"] = json!(iso(NOW + 60_000)))),
            "X402_SIGN_IN_FUTURE_TIMESTAMP"
        );
        assert_eq!(
            code(&with(&|f| f["notBefore"] = json!(iso(NOW + 60_000)))),
            "X402_SIGN_IN_NOT_BEFORE"
        );
        assert_eq!(
            code(&with(&|f| f["nonce"] = json!("short"))),
            "X402_SIGN_IN_MISSING_NONCE"
        );
        assert_eq!(
            code(&with(&|f| f["requestId"] = json!("a\nNonce: other"))),
            "X402_SIGN_IN_INVALID_MESSAGE"
        );
        // A timestamp far from issuedAt, even one that would overflow.
        for timestamp in [i64::MIN, NOW - 120_000] {
            let header = sign_evm(&signer, evm_fields(&signer));
            let mut payload: Value =
                serde_json::from_slice(&STANDARD.decode(&header).unwrap()).unwrap();
            payload["timestamp"] = json!(timestamp);
            assert_eq!(
                code(&STANDARD.encode(payload.to_string())),
                "X402_SIGN_IN_TIMESTAMP_MISMATCH"
            );
        }
        // Signed by another key than the address says.
        let other: PrivateKeySigner =
            "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d"
                .parse()
                .unwrap();
        let mut forged = evm_fields(&signer);
        let header = sign_evm(&other, forged.clone());
        let mut payload: Value =
            serde_json::from_slice(&STANDARD.decode(&header).unwrap()).unwrap();
        payload["address"] = forged["address"].take();
        assert_eq!(
            code(&STANDARD.encode(payload.to_string())),
            "X402_SIGN_IN_INVALID_SIGNATURE"
        );
        // A Solana signature over another message.
        let key = solana_key();
        let (header, _) = solana_header(&key, NOW - 5_000);
        let mut payload: Value =
            serde_json::from_slice(&STANDARD.decode(&header).unwrap()).unwrap();
        payload["message"] = json!(
            payload["message"]
                .as_str()
                .unwrap()
                .replace("3f2a91c4", "00000000")
        );
        assert_eq!(
            code(&STANDARD.encode(payload.to_string())),
            "X402_SIGN_IN_INVALID_SIGNATURE"
        );
        // Declared type against the wallet family.
        let (header, _) = solana_header(&key, NOW - 5_000);
        let mut payload: Value =
            serde_json::from_slice(&STANDARD.decode(&header).unwrap()).unwrap();
        payload["type"] = json!("eip191");
        assert_eq!(
            code(&STANDARD.encode(payload.to_string())),
            "X402_SIGN_IN_CHAIN_MISMATCH"
        );
    }
}

/// Properties: no header, however malformed, panics the verifier.
#[cfg(test)]
mod properties {
    use super::*;
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use proptest::prelude::*;

    const NOW: i64 = 1_763_805_600_000;

    fn policy() -> SiwxPolicy {
        SiwxPolicy {
            domains: vec!["127.0.0.1:8080".into()],
            ..SiwxPolicy::default()
        }
    }

    /// A structured payload with each field drawn from strings that are
    /// near misses of valid ones.
    fn payloads() -> impl Strategy<Value = String> {
        let field = prop_oneof![
            Just(String::new()),
            Just("127.0.0.1:8080".to_owned()),
            Just("http://evil.com\\@127.0.0.1:8080".to_owned()),
            Just("eip155:8453".to_owned()),
            Just("solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp".to_owned()),
            Just("0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266".to_owned()),
            Just("2025-11-22T10:00:00.000Z".to_owned()),
            Just("eip191".to_owned()),
            Just("ed25519".to_owned()),
            ".{0,40}",
        ];
        proptest::collection::vec(field, 12).prop_map(|f| {
            serde_json::json!({
                "domain": f[0], "address": f[1], "statement": f[2], "uri": f[3],
                "version": f[4], "chainId": f[5], "type": f[6], "nonce": f[7],
                "issuedAt": f[8], "expirationTime": f[9], "signature": f[10],
                "message": f[11],
            })
            .to_string()
        })
    }

    proptest! {
        #[test]
        fn arbitrary_headers_are_refused_not_panicked_on(header in ".{0,200}") {
            prop_assert!(verify(&header, &policy(), NOW).is_err());
        }

        #[test]
        fn arbitrary_bytes_in_base64_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            prop_assert!(verify(&STANDARD.encode(bytes), &policy(), NOW).is_err());
        }

        /// Fields of the right names with wrong or hostile values: a
        /// refusal, never a panic, and never a sign-in without a signature
        /// that verifies.
        #[test]
        fn near_miss_payloads_are_refused(payload in payloads()) {
            prop_assert!(verify(&STANDARD.encode(payload), &policy(), NOW).is_err());
        }
    }
}
