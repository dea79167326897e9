//! Sign-In-With-X headers signed with real keys (alloy's local signer), for
//! the wallet tests and the abuse soak.

use std::time::{SystemTime, UNIX_EPOCH};

use alloy_signer::SignerSync;
use alloy_signer_local::PrivateKeySigner;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_json::json;

pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

pub fn iso(secs: i64) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp(secs, 0)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// A structured SIWX header for `wallet`, issued `age` seconds ago, with its
/// EIP-4361 text written here independently of the service's formatter.
pub fn sign_in(wallet: &PrivateKeySigner, nonce: &str, age: i64, domain: &str) -> String {
    let address = wallet.address().to_checksum(None);
    let issued = iso(now_secs() as i64 - age);
    let message = format!(
        "{domain} wants you to sign in with your Ethereum account:\n{address}\n\nSign in to Rialto\n\nURI: http://{domain}\nVersion: 1\nChain ID: 8453\nNonce: {nonce}\nIssued At: {issued}"
    );
    let signature = wallet.sign_message_sync(message.as_bytes()).unwrap();
    let payload = json!({"domain": domain, "address": address, "statement": "Sign in to Rialto",
        "uri": format!("http://{domain}"), "version": "1", "chainId": "eip155:8453",
        "type": "eip191", "nonce": nonce, "issuedAt": issued,
        "signature": format!("0x{}", hex::encode(signature.as_bytes()))});
    STANDARD.encode(payload.to_string())
}

pub fn fresh_nonce() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}
