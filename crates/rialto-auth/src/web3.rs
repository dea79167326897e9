//! Keys for wallets: the token `GET /api_keys/generate_web3_key` answers,
//! and the check of a wallet's signature over it.
//!
//! The token is readable text, as a sign-in message is, because a wallet
//! shows the person what they sign: it names the service's domain, what the
//! signature is for, a nonce and a 15-minute validity. It needs no server
//! secret: what proves the wallet is its signature over a fresh text that
//! names this service, and what closes replays is the nonce, consumed once
//! per wallet when a key is made (the sign-in nonces' table). A token made
//! up by a client is as good as one we issued, and no worse.

use chrono::{DateTime, SecondsFormat, Utc};

use crate::siwx::{Family, Refusal, SiwxPolicy};

/// How long a token may be signed and used.
pub const TOKEN_LIFETIME_MS: i64 = 15 * 60 * 1000;
/// How far in the future `Issued At` may be (clock skew between replicas).
const FUTURE_SKEW_MS: i64 = 30 * 1000;
/// The first line's text after the domain.
const ASKS: &str = " asks you to sign this message to create an API key for your wallet.";
/// What the token is for: a signature over another message is not one.
const PURPOSE: &str = "generate_web3_key";

/// A token for `domain`, valid from `now_ms` for [`TOKEN_LIFETIME_MS`];
/// none when the operating system has no randomness to give.
pub fn issue_token(domain: &str, now_ms: i64) -> Option<String> {
    let mut nonce = [0u8; 16];
    getrandom::fill(&mut nonce).ok()?;
    Some(format!(
        "{domain}{ASKS}\n\nPurpose: {PURPOSE}\nNonce: {}\nIssued At: {}\nExpiration Time: {}",
        hex::encode(nonce),
        rfc3339(now_ms),
        rfc3339(now_ms.saturating_add(TOKEN_LIFETIME_MS)),
    ))
}

fn rfc3339(ms: i64) -> String {
    DateTime::<Utc>::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// A signed token that verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedToken {
    /// EIP-55 checksummed (EVM) or base58 (Solana).
    pub address: String,
    pub nonce: String,
    /// Unix ms after which the token is refused anyway.
    pub expires_at_ms: i64,
}

fn refuse<T>(message: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal {
        code: "WEB3_KEY_INVALID_TOKEN",
        message: message.into(),
    })
}

/// Checks that `token` is one of ours, for one of `policy`'s domains, in
/// its validity at `now_ms`, and that `address`'s wallet signed it.
pub fn verify(
    address: &str,
    signature: &str,
    token: &str,
    policy: &SiwxPolicy,
    now_ms: i64,
) -> Result<SignedToken, Refusal> {
    let mut lines = token.lines();
    let domain = lines
        .next()
        .and_then(|first| first.strip_suffix(ASKS))
        .unwrap_or_default();
    if !policy
        .domains
        .iter()
        .any(|d| d.eq_ignore_ascii_case(domain))
    {
        return refuse(
            "The token is not one this service issued: get one from GET \
             /api/v1/api_keys/generate_web3_key and sign it unchanged",
        );
    }
    let field = |name: &str| {
        token
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(": "))
    };
    let time = |name: &str| {
        field(name)
            .and_then(|text| DateTime::parse_from_rfc3339(text).ok())
            .map(|t| t.with_timezone(&Utc).timestamp_millis())
    };
    let (Some(PURPOSE), Some(nonce), Some(issued), Some(expires)) = (
        field("Purpose"),
        field("Nonce"),
        time("Issued At"),
        time("Expiration Time"),
    ) else {
        return refuse("The token is malformed: sign it exactly as it was answered");
    };
    if nonce.len() < 16 || !nonce.chars().all(|c| c.is_ascii_alphanumeric()) {
        return refuse("The token's nonce must be at least 16 letters or digits");
    }
    if issued > now_ms.saturating_add(FUTURE_SKEW_MS)
        || expires <= issued
        || expires - issued > TOKEN_LIFETIME_MS
    {
        return refuse("The token's times are not valid: get a new token");
    }
    if now_ms >= expires {
        return refuse("The token has expired: get a new token and sign it");
    }
    let family = if address.starts_with("0x") {
        Family::Evm
    } else {
        Family::Solana
    };
    let address = crate::siwx::verify_signature(family, address, token, signature)?;
    Ok(SignedToken {
        address,
        nonce: nonce.to_owned(),
        expires_at_ms: expires,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloy_signer::SignerSync;
    use alloy_signer_local::PrivateKeySigner;

    const NOW: i64 = 1_763_805_600_000; // 2025-11-22T10:00:00Z
    const ANVIL_0: &str = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80";

    fn policy() -> SiwxPolicy {
        SiwxPolicy {
            domains: vec!["api.example.com".into()],
            ..SiwxPolicy::default()
        }
    }

    fn signed(token: &str) -> (String, String) {
        let signer: PrivateKeySigner = ANVIL_0.parse().unwrap();
        let signature = signer.sign_message_sync(token.as_bytes()).unwrap();
        (
            signer.address().to_string(),
            format!("0x{}", hex::encode(signature.as_bytes())),
        )
    }

    #[test]
    fn a_signed_token_verifies_once_per_nonce_and_names_the_wallet() {
        let token = issue_token("api.example.com", NOW).unwrap();
        let (address, signature) = signed(&token);
        let verified = verify(
            &address.to_lowercase(),
            &signature,
            &token,
            &policy(),
            NOW + 1000,
        )
        .unwrap();
        assert_eq!(verified.address, address, "checksummed");
        assert_eq!(verified.expires_at_ms, NOW + TOKEN_LIFETIME_MS);
        assert_ne!(
            issue_token("api.example.com", NOW).unwrap(),
            token,
            "a new nonce"
        );
    }

    #[test]
    fn tokens_that_are_not_ours_expired_or_signed_by_another_are_refused() {
        let token = issue_token("api.example.com", NOW).unwrap();
        let (address, signature) = signed(&token);
        let check = |token: &str, signature: &str, now: i64| {
            verify(&address, signature, token, &policy(), now).map(|_| ())
        };
        assert!(check(&token, &signature, NOW + TOKEN_LIFETIME_MS).is_err());
        let elsewhere = issue_token("evil.example", NOW).unwrap();
        let (_, elsewhere_signature) = signed(&elsewhere);
        assert!(check(&elsewhere, &elsewhere_signature, NOW).is_err());
        let stretched = token.replace(
            &rfc3339(NOW + TOKEN_LIFETIME_MS),
            &rfc3339(NOW + 2 * TOKEN_LIFETIME_MS),
        );
        let (_, stretched_signature) = signed(&stretched);
        assert!(check(&stretched, &stretched_signature, NOW).is_err());
        let other = issue_token("api.example.com", NOW).unwrap();
        assert!(check(&other, &signature, NOW).is_err(), "signed another");
        assert!(check(&token, "0x1234", NOW).is_err());
    }
}
