//! Wallet access end to end: Sign-In-With-X on the chat route, the 402
//! discovery and top-up answers, and x402 top-ups settled through a
//! facilitator double, all with real signatures (alloy's local signer).

use alloy_primitives::{Address, B256, U256};
use alloy_signer::SignerSync;
use alloy_signer_local::PrivateKeySigner;
use alloy_sol_types::{Eip712Domain, SolStruct, sol};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use futures_util::future::join_all;
use reqwest::{Method, Response};
use rialto_test_kit::{Behaviour, Facilitator, MockUpstream, Sandbox, Topology};
use serde_json::{Value, json};

use crate::sign_in::{fresh_nonce, iso, now_secs, sign_in};

sol! {
    struct TransferWithAuthorization {
        address from;
        address to;
        uint256 value;
        uint256 validAfter;
        uint256 validBefore;
        bytes32 nonce;
    }
}

const PAY_TO: &str = "0x2222222222222222222222222222222222222222";
const WALLET_KEY: &str = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80";

struct World {
    _mock: MockUpstream,
    facilitator: Facilitator,
    sandbox: Sandbox,
    wallet: PrivateKeySigner,
}

async fn world(topology: Topology) -> World {
    let mock = MockUpstream::start().await.unwrap();
    let facilitator = Facilitator::start().await.unwrap();
    let config = format!(
        r#"
[[models]]
id = "paid-chat"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
backends = [{{ kind = "openai", url = "{0}", model = "mock-model" }}]

[[models]]
id = "free-chat"
backends = [{{ kind = "openai", url = "{0}", model = "mock-model" }}]

[[models]]
id = "paid-image"
type = "image"
usd_per_image = 0.25
backends = [{{ kind = "openai", url = "{0}" }}]

[[models]]
id = "paid-video"
type = "video"
usd_per_video_second = 0.5
video_durations = [1]
video_resolutions = ["144p"]
backends = [{{ kind = "openai", url = "{0}" }}]

[wallet]
domains = ["127.0.0.1:8080", "localhost:8080"]

[x402]
facilitator_url = "{1}"
pay_to_evm = "{PAY_TO}"
pay_to_solana = "9xQeWvG816bUx9EPjHmaT23yvVM2ZWbrrpZb9PusVFin"
min_usd = "5"
max_usd = "10000"
"#,
        mock.base_url(),
        facilitator.url()
    );
    let sandbox = Sandbox::builder(topology)
        .config(&config)
        .start()
        .await
        .unwrap();
    World {
        _mock: mock,
        facilitator,
        sandbox,
        wallet: WALLET_KEY.parse().unwrap(),
    }
}

/// A v2 `PAYMENT-SIGNATURE` paying `value` atomic USDC to `to`, signed
/// under the EIP-712 domain `name` (Base USDC's is "USD Coin").
fn payment(
    wallet: &PrivateKeySigner,
    to: &str,
    value: u64,
    valid_for: u64,
    name: &str,
    nonce: B256,
) -> String {
    let now = now_secs();
    let authorization = TransferWithAuthorization {
        from: wallet.address(),
        to: to.parse::<Address>().unwrap(),
        value: U256::from(value),
        validAfter: U256::from(now - 600),
        validBefore: U256::from(now + valid_for),
        nonce,
    };
    let domain = Eip712Domain::new(
        Some(name.to_owned().into()),
        Some("2".into()),
        Some(U256::from(8453u64)),
        Some(
            "0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913"
                .parse()
                .unwrap(),
        ),
        None,
    );
    let signature = wallet
        .sign_hash_sync(&authorization.eip712_signing_hash(&domain))
        .unwrap();
    let payload = json!({
        "x402Version": 2,
        "accepted": {"scheme": "exact", "network": "eip155:8453", "amount": value.to_string(),
            "asset": "0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913", "payTo": to,
            "maxTimeoutSeconds": 300, "extra": {"name": "USD Coin", "version": "2"}},
        "payload": {
            "signature": format!("0x{}", hex::encode(signature.as_bytes())),
            "authorization": {"from": wallet.address().to_checksum(None), "to": to,
                "value": value.to_string(), "validAfter": (now - 600).to_string(),
                "validBefore": (now + valid_for).to_string(), "nonce": format!("{nonce:?}")},
        },
    });
    STANDARD.encode(payload.to_string())
}

fn random_nonce() -> B256 {
    B256::from_slice(&uuid::Uuid::new_v4().as_bytes().repeat(2))
}

async fn top_up(sandbox: &Sandbox, header: Option<&str>) -> Response {
    let mut request = sandbox.http().post(sandbox.api("/x402/top-up"));
    if let Some(header) = header {
        request = request.header("PAYMENT-SIGNATURE", header);
    }
    request.send().await.unwrap()
}

async fn chat_as(sandbox: &Sandbox, sign_in: Option<&str>) -> Response {
    let mut request = sandbox
        .http()
        .post(sandbox.api("/chat/completions"))
        .json(&json!({"model": "paid-chat", "max_tokens": 10,
            "messages": [{"role": "user", "content": "hello there"}], "mock": {"words": 10}}));
    if let Some(header) = sign_in {
        request = request.header("SIGN-IN-WITH-X", header);
    }
    request.send().await.unwrap()
}

fn decode_header(response: &Response, name: &str) -> Value {
    let value = response.headers()[name].to_str().unwrap();
    serde_json::from_slice(&STANDARD.decode(value).unwrap()).unwrap()
}

/// A wallet with no account: discovery, sign-in, a $5 top-up, a chat whose
/// `X-Balance-Remaining` falls by its cost, replays refused or answered
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wallet_signs_in_tops_up_and_chats() {
    let world = world(Topology::Split).await;
    let sandbox = &world.sandbox;
    let wallet = &world.wallet;
    let address = wallet.address().to_checksum(None);

    // No credentials at all: 402 with how to pay or sign in.
    let response = chat_as(sandbox, None).await;
    assert_eq!(response.status(), 402);
    let required = decode_header(&response, "payment-required");
    assert_eq!(required["x402Version"], 2);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["x402Version"], 2);
    assert_eq!(body["accepts"][0]["network"], "eip155:8453");
    assert_eq!(body["accepts"][0]["payTo"], PAY_TO);
    assert_eq!(
        body["accepts"][1]["network"],
        "solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp"
    );
    assert_eq!(
        body["authOptions"]["x402Wallet"]["header"],
        "SIGN-IN-WITH-X"
    );
    assert_eq!(
        body["extensions"]["sign-in-with-x"]["info"]["domain"],
        "127.0.0.1:8080"
    );
    assert_eq!(required["accepts"], body["accepts"]);

    // Signed in, but nothing to pay with: 402 with top-up instructions.
    let response = chat_as(
        sandbox,
        Some(&sign_in(wallet, &fresh_nonce(), 0, "127.0.0.1:8080")),
    )
    .await;
    assert_eq!(response.status(), 402);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["code"], "PAYMENT_REQUIRED");
    assert_eq!(body["reason"], "insufficient_balance");
    assert_eq!(body["topUpInstructions"]["receiverWallet"], PAY_TO);

    // The top-up's requirements.
    let response = top_up(sandbox, None).await;
    assert_eq!(response.status(), 402);
    let required = decode_header(&response, "payment-required");
    assert_eq!(required["accepts"][0]["amount"], "5000000");
    assert_eq!(
        required["accepts"][0]["extra"],
        json!({"name": "USD Coin", "version": "2"})
    );

    // Pay $5: settled by the facilitator, credited once.
    let paid = payment(wallet, PAY_TO, 5_000_000, 300, "USD Coin", random_nonce());
    let response = top_up(sandbox, Some(&paid)).await;
    assert_eq!(response.status(), 200);
    let settled = decode_header(&response, "payment-response");
    assert_eq!(settled["success"], true);
    assert_eq!(settled["payer"], address.as_str());
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["data"]["walletAddress"], address.as_str());
    assert_eq!(body["data"]["amountCredited"].to_string(), "5");
    assert_eq!(body["data"]["newBalance"].to_string(), "5");
    let payment_id = body["data"]["paymentId"].clone();
    // The same payment again: the same answer, nothing credited twice, the
    // facilitator not asked again.
    let again = top_up(sandbox, Some(&paid)).await;
    assert_eq!(again.status(), 200);
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["data"]["paymentId"], payment_id);
    assert_eq!(again["data"]["amountCredited"].to_string(), "5");
    // Whoever replays a payment's bytes learns no balance.
    assert!(again["data"].get("newBalance").is_none(), "{again}");
    assert_eq!(world.facilitator.settlements().len(), 1);
    // What the facilitator was asked to settle: our requirements.
    let asked = &world.facilitator.settlements()[0];
    assert_eq!(asked["paymentRequirements"]["payTo"], PAY_TO);
    assert_eq!(asked["paymentRequirements"]["amount"], "5000000");

    // Chat as the wallet: billed to its ledger.
    let header = sign_in(wallet, &fresh_nonce(), 0, "127.0.0.1:8080");
    let response = chat_as(sandbox, Some(&header)).await;
    assert_eq!(response.status(), 200);
    let remaining = response.headers()["x-balance-remaining"]
        .to_str()
        .unwrap()
        .to_owned();
    let body: Value = response.json().await.unwrap();
    // 2 prompt + 10 completion tokens at $1/M.
    assert_eq!(body["cost"]["usd"].to_string(), "0.000012");
    assert_eq!(remaining, "4.999988");
    // One request per sign-in: the same header again is refused.
    let replay = chat_as(sandbox, Some(&header)).await;
    assert_eq!(replay.status(), 401);
    let refusal: Value = replay.json().await.unwrap();
    assert_eq!(refusal["code"], "X402_SIGN_IN_NONCE_REUSED");

    // The wallet's balance, for itself only.
    let balance = sandbox
        .http()
        .get(sandbox.api(&format!("/x402/balance/{address}")))
        .header(
            "SIGN-IN-WITH-X",
            sign_in(wallet, &fresh_nonce(), 0, "localhost:8080"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(balance.status(), 200);
    let balance: Value = balance.json().await.unwrap();
    assert_eq!(balance["data"]["balanceUsd"].to_string(), "4.999988");
    assert_eq!(balance["data"]["canConsume"], true);
    let other = sandbox
        .http()
        .get(sandbox.api("/x402/balance/0x2222222222222222222222222222222222222222"))
        .header(
            "SIGN-IN-WITH-X",
            sign_in(wallet, &fresh_nonce(), 0, "localhost:8080"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 403);
    let anonymous = sandbox
        .http()
        .get(sandbox.api(&format!("/x402/balance/{address}")))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 402);

    // Its history: the charge, then the top-up, each with the balance after.
    let history = |query: &str| {
        let request = sandbox
            .http()
            .get(sandbox.api(&format!("/x402/transactions/{address}{query}")))
            .header(
                "SIGN-IN-WITH-X",
                sign_in(wallet, &fresh_nonce(), 0, "localhost:8080"),
            );
        async move {
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 200);
            response.json::<Value>().await.unwrap()["data"].clone()
        }
    };
    let all = history("").await;
    assert_eq!(all["currentBalance"].to_string(), "4.999988");
    let entries = all["transactions"].as_array().unwrap();
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[0]["type"], "CHARGE");
    assert_eq!(entries[0]["amount"].to_string(), "-0.000012");
    assert_eq!(entries[0]["balanceAfter"].to_string(), "4.999988");
    assert_eq!(entries[0]["modelId"], "paid-chat");
    assert!(
        entries[0]["requestId"]
            .as_str()
            .unwrap()
            .starts_with("chatcmpl-")
    );
    assert_eq!(entries[1]["type"], "TOP_UP");
    assert_eq!(entries[1]["balanceAfter"].to_string(), "5");
    assert_eq!(entries[1]["requestId"], Value::Null);
    let second = history("?limit=1&offset=1").await;
    assert_eq!(second["transactions"][0]["type"], "TOP_UP");
    assert_eq!(second["transactions"][0]["balanceAfter"].to_string(), "5");
    assert_eq!(
        second["pagination"],
        json!({"limit": 1, "offset": 1, "hasMore": false})
    );
}

/// Sign-ins the service refuses, each with its reason.
/// A wallet made a moment ago is not a free account: free models want
/// `wallet.min_balance_usd` too, and signed-in wallets' failures count
/// against the wallet and against the client's address, so rotating
/// wallets ends in 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_wallets_are_not_free_accounts() {
    let world = world(Topology::OneProcess).await;
    let sandbox = &world.sandbox;
    let mut statuses = Vec::new();
    for _ in 0..30 {
        let wallet = PrivateKeySigner::random();
        let response = sandbox
            .http()
            .post(sandbox.api("/chat/completions"))
            .header(
                "SIGN-IN-WITH-X",
                sign_in(&wallet, &fresh_nonce(), 0, "127.0.0.1:8080"),
            )
            .json(&json!({"model": "free-chat", "max_tokens": 10,
                "messages": [{"role": "user", "content": "hello"}]}))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        if statuses.is_empty() {
            let body: Value = response.json().await.unwrap();
            assert_eq!(body["reason"], "insufficient_balance", "{body}");
            assert!(body["topUpInstructions"].is_object(), "{body}");
        }
        statuses.push(status);
    }
    assert!(
        statuses.iter().all(|s| *s == 402 || *s == 429),
        "{statuses:?}"
    );
    assert_eq!(statuses[0], 402);
    // The default threshold is 20 failures in the window.
    assert_eq!(statuses.last(), Some(&429), "{statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sign_in_refusals() {
    let world = world(Topology::OneProcess).await;
    let sandbox = &world.sandbox;
    let wallet = &world.wallet;
    let refused = |header: String| async move {
        let response = chat_as(sandbox, Some(&header)).await;
        assert_eq!(response.status(), 401, "{header}");
        let body: Value = response.json().await.unwrap();
        body["code"].as_str().unwrap().to_owned()
    };
    assert_eq!(
        refused("not base64!".into()).await,
        "X402_SIGN_IN_PARSE_ERROR"
    );
    assert_eq!(
        refused(sign_in(wallet, &fresh_nonce(), 0, "evil.example")).await,
        "X402_SIGN_IN_DOMAIN_MISMATCH"
    );
    assert_eq!(
        refused(sign_in(wallet, &fresh_nonce(), 301, "127.0.0.1:8080")).await,
        "X402_SIGN_IN_EXPIRED"
    );
    assert_eq!(
        refused(sign_in(wallet, &fresh_nonce(), -120, "127.0.0.1:8080")).await,
        "X402_SIGN_IN_FUTURE_TIMESTAMP"
    );
    // Key-only routes refuse a wallet (its nonce is not spent); a wallet
    // path that is no address is a 400.
    let header = sign_in(wallet, &fresh_nonce(), 0, "127.0.0.1:8080");
    let keys = sandbox
        .http()
        .get(sandbox.api("/api_keys/rate_limits"))
        .header("SIGN-IN-WITH-X", &header)
        .send()
        .await
        .unwrap();
    assert_eq!(keys.status(), 401);
    assert_eq!(
        chat_as(sandbox, Some(&header)).await.status(),
        402,
        "the nonce is still fresh"
    );
    let malformed = sandbox
        .http()
        .get(sandbox.api("/x402/balance/not-a-wallet"))
        .header(
            "SIGN-IN-WITH-X",
            sign_in(wallet, &fresh_nonce(), 0, "127.0.0.1:8080"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(malformed.status(), 400);
    // A payment header on the chat route.
    let response = sandbox
        .http()
        .post(sandbox.api("/chat/completions"))
        .header("PAYMENT-SIGNATURE", "e30=")
        .json(&json!({"model": "paid-chat", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"], "PAYMENT_HEADER_NOT_ACCEPTED");
}

/// Payments refused before the facilitator, and by it; a facilitator that
/// is down; concurrent copies of one payment credited once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_up_refusals_and_races() {
    let world = world(Topology::OneProcess).await;
    let sandbox = &world.sandbox;
    let wallet = &world.wallet;
    let code = |response: Response| async move {
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap();
        (
            status,
            body["error"].as_str().unwrap_or_default().to_owned(),
        )
    };
    let nonce = random_nonce;
    let other_recipient = "0x3333333333333333333333333333333333333333";
    assert_eq!(
        code(
            top_up(
                sandbox,
                Some(&payment(
                    wallet,
                    other_recipient,
                    5_000_000,
                    300,
                    "USD Coin",
                    nonce()
                ))
            )
            .await
        )
        .await,
        (400, "INVALID_PAYMENT_RECIPIENT".into())
    );
    assert_eq!(
        code(
            top_up(
                sandbox,
                Some(&payment(
                    wallet,
                    PAY_TO,
                    4_999_999,
                    300,
                    "USD Coin",
                    nonce()
                ))
            )
            .await
        )
        .await,
        (400, "AMOUNT_TOO_LOW".into())
    );
    assert_eq!(
        code(
            top_up(
                sandbox,
                Some(&payment(
                    wallet,
                    PAY_TO,
                    10_000_000_001,
                    300,
                    "USD Coin",
                    nonce()
                ))
            )
            .await
        )
        .await,
        (400, "AMOUNT_TOO_HIGH".into())
    );
    assert_eq!(
        code(
            top_up(
                sandbox,
                Some(&payment(wallet, PAY_TO, 5_000_000, 2, "USD Coin", nonce()))
            )
            .await
        )
        .await,
        (400, "INVALID_PAYMENT".into())
    );
    // Signed under Base Sepolia's domain name: does not recover here.
    assert_eq!(
        code(
            top_up(
                sandbox,
                Some(&payment(wallet, PAY_TO, 5_000_000, 300, "USDC", nonce()))
            )
            .await
        )
        .await,
        (400, "INVALID_PAYMENT".into())
    );
    assert_eq!(
        code(top_up(sandbox, Some("%%%")).await).await,
        (400, "INVALID_PAYMENT_FORMAT".into())
    );
    // A v1-shaped payload (network "base", top-level scheme) in the legacy
    // X-PAYMENT header is understood, and answered in v2.
    let v2: Value = serde_json::from_slice(
        &STANDARD
            .decode(payment(wallet, PAY_TO, 5_000_000, 300, "USD Coin", nonce()))
            .unwrap(),
    )
    .unwrap();
    let v1 =
        json!({"x402Version": 1, "scheme": "exact", "network": "base", "payload": v2["payload"]});
    let response = sandbox
        .http()
        .post(sandbox.api("/x402/top-up"))
        .header("X-PAYMENT", STANDARD.encode(v1.to_string()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        world.facilitator.settlements()[0]["paymentPayload"]["x402Version"],
        2
    );
    assert_eq!(
        world.facilitator.verifications().len(),
        1,
        "only the valid v1 payment reached the facilitator"
    );

    // The facilitator refuses, then is down: nothing credited.
    world
        .facilitator
        .set(Behaviour::RefuseVerify("insufficient_funds".into()));
    assert_eq!(
        code(
            top_up(
                sandbox,
                Some(&payment(
                    wallet,
                    PAY_TO,
                    5_000_000,
                    300,
                    "USD Coin",
                    nonce()
                ))
            )
            .await
        )
        .await,
        (402, "PAYMENT_VERIFICATION_FAILED".into())
    );
    world
        .facilitator
        .set(Behaviour::FailSettle("invalid_transaction_state".into()));
    let failed = payment(wallet, PAY_TO, 5_000_000, 300, "USD Coin", nonce());
    assert_eq!(
        code(top_up(sandbox, Some(&failed)).await).await,
        (402, "SETTLEMENT_FAILED".into())
    );
    // Sent again, it is refused as it was, without asking the facilitator.
    let asked = world.facilitator.settlements().len();
    assert_eq!(
        code(top_up(sandbox, Some(&failed)).await).await,
        (402, "SETTLEMENT_FAILED".into())
    );
    assert_eq!(world.facilitator.settlements().len(), asked);
    // A settlement that may have been broadcast but was not confirmed: the
    // claim stays, never freed for a second credit.
    world.facilitator.set(Behaviour::SettleUnavailable);
    let unconfirmed = payment(wallet, PAY_TO, 5_000_000, 300, "USD Coin", nonce());
    assert_eq!(
        code(top_up(sandbox, Some(&unconfirmed)).await).await,
        (504, "SETTLEMENT_TIMEOUT".into())
    );
    world.facilitator.set(Behaviour::Accept);
    assert_eq!(
        code(top_up(sandbox, Some(&unconfirmed)).await).await,
        (409, "PAYMENT_IN_PROGRESS".into())
    );
    world.facilitator.set(Behaviour::Unavailable);
    let retried = payment(wallet, PAY_TO, 5_000_000, 300, "USD Coin", nonce());
    assert_eq!(
        code(top_up(sandbox, Some(&retried)).await).await,
        (503, "FACILITATOR_UNAVAILABLE".into())
    );
    let balance = |sandbox: &Sandbox| {
        let request = sandbox
            .http()
            .get(sandbox.api(&format!(
                "/x402/balance/{}",
                wallet.address().to_checksum(None)
            )))
            .header(
                "SIGN-IN-WITH-X",
                sign_in(wallet, &fresh_nonce(), 0, "127.0.0.1:8080"),
            );
        async move {
            let body: Value = request.send().await.unwrap().json().await.unwrap();
            body["data"]["balanceUsd"].to_string()
        }
    };
    assert_eq!(balance(sandbox).await, "5");
    // Back up: the same payment now goes through (its claim was freed).
    world.facilitator.set(Behaviour::Accept);
    assert_eq!(top_up(sandbox, Some(&retried)).await.status(), 200);
    assert_eq!(balance(sandbox).await, "10");

    // Ten copies of one payment at once: credited once.
    let paid = payment(wallet, PAY_TO, 7_000_000, 300, "USD Coin", nonce());
    let answers = join_all((0..10).map(|_| top_up(sandbox, Some(&paid)))).await;
    let mut ok = 0;
    for answer in answers {
        match answer.status().as_u16() {
            200 => ok += 1,
            409 => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert!(ok >= 1);
    assert_eq!(balance(sandbox).await, "17");
    let settled = world.facilitator.settlements().len();
    assert_eq!(
        world
            .facilitator
            .settlements()
            .iter()
            .filter(|s| s["paymentRequirements"]["amount"] == "7000000")
            .count(),
        1,
        "{settled} settlements"
    );
    let _ = Method::GET;
}

/// A v0 Solana transaction paying `amount` atomic USDC from `payer` to
/// `to`'s USDC account, the fee payer's slot left empty: what an x402
/// client sends. Written here from the wire format.
fn solana_payment(
    payer: &ed25519_dalek::SigningKey,
    fee_payer: [u8; 32],
    to: &str,
    amount: u64,
) -> String {
    use ed25519_dalek::Signer;
    let key =
        |text: &str| -> [u8; 32] { bs58::decode(text).into_vec().unwrap().try_into().unwrap() };
    let token = key("TokenkegQfeZyiNwAJbNbGKPFXCWuBvf9Ss623VQ5DA");
    let mint = key("EPjFWdd5AufqSSqeM2qN1xzybapC8G4wEGGkZwyTDt1v");
    let owner = payer.verifying_key().to_bytes();
    let ata = |owner: &[u8; 32]| {
        rialto_billing::solana::associated_token_account(owner, &token, &mint).unwrap()
    };
    let keys = [
        fee_payer,
        owner,
        ata(&owner),
        ata(&key(to)),
        mint,
        token,
        key("ComputeBudget111111111111111111111111111111"),
    ];
    let mut message = vec![0x80, 2, 0, 3, keys.len() as u8];
    for k in keys {
        message.extend(k);
    }
    message.extend([42u8; 32]);
    let mut price = vec![3];
    price.extend(1u64.to_le_bytes());
    let mut transfer = vec![12];
    transfer.extend(amount.to_le_bytes());
    transfer.push(6);
    message.push(2);
    message.extend([6, 0, price.len() as u8]);
    message.extend(price);
    message.extend([5, 4, 2, 4, 3, 1, transfer.len() as u8]);
    message.extend(transfer);
    message.push(0);
    let mut transaction = vec![2];
    transaction.extend([0u8; 64]);
    transaction.extend(payer.sign(&message).to_bytes());
    transaction.extend(message);
    let payload = json!({"x402Version": 2,
        "accepted": {"scheme": "exact", "network": "solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp"},
        "payload": {"transaction": STANDARD.encode(transaction)}});
    STANDARD.encode(payload.to_string())
}

/// A SIWS sign-in (the hosted API's signed-text shape) for a Solana wallet.
fn solana_sign_in(wallet: &ed25519_dalek::SigningKey) -> String {
    use ed25519_dalek::Signer;
    let address = bs58::encode(wallet.verifying_key().to_bytes()).into_string();
    let message = format!(
        "127.0.0.1:8080 wants you to sign in with your Solana account:\n{address}\n\nSign in to Rialto\n\nURI: http://127.0.0.1:8080\nVersion: 1\nChain ID: 5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp\nNonce: {}\nIssued At: {}",
        fresh_nonce(),
        iso(now_secs() as i64)
    );
    let signature = bs58::encode(wallet.sign(message.as_bytes()).to_bytes()).into_string();
    let payload = json!({"address": address, "message": message, "signature": signature,
        "chainId": "solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp", "type": "ed25519"});
    STANDARD.encode(payload.to_string())
}

/// A Solana wallet: a USDC top-up checked locally (transfer, mint,
/// destination, amount, the payer's signature) and settled by the
/// facilitator, then a chat signed in with SIWS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_solana_wallet_tops_up_and_chats() {
    let fee_payer = ed25519_dalek::SigningKey::from_bytes(&[3u8; 32])
        .verifying_key()
        .to_bytes();
    let mock = MockUpstream::start().await.unwrap();
    let facilitator = Facilitator::start().await.unwrap();
    let config = format!(
        r#"
[[models]]
id = "paid-chat"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
backends = [{{ kind = "openai", url = "{}", model = "mock-model" }}]
[wallet]
domains = ["127.0.0.1:8080"]
[x402]
facilitator_url = "{}"
# Replays are answered this long after the payment, then refused.
max_timeout_secs = 2
pay_to_solana = "9xQeWvG816bUx9EPjHmaT23yvVM2ZWbrrpZb9PusVFin"
solana_fee_payer = "{}"
"#,
        mock.base_url(),
        facilitator.url(),
        bs58::encode(fee_payer).into_string()
    );
    let sandbox = Sandbox::builder(Topology::OneProcess)
        .config(&config)
        .start()
        .await
        .unwrap();
    let wallet = ed25519_dalek::SigningKey::from_bytes(&[9u8; 32]);
    let address = bs58::encode(wallet.verifying_key().to_bytes()).into_string();
    let pay_to = "9xQeWvG816bUx9EPjHmaT23yvVM2ZWbrrpZb9PusVFin";

    let required = top_up(&sandbox, None).await;
    let required = decode_header(&required, "payment-required");
    assert_eq!(required["accepts"].as_array().unwrap().len(), 1);
    assert_eq!(
        required["accepts"][0]["extra"]["feePayer"],
        bs58::encode(fee_payer).into_string()
    );

    // To someone else's account, and with another fee payer: refused here.
    let elsewhere = bs58::encode([5u8; 32]).into_string();
    let refused = top_up(
        &sandbox,
        Some(&solana_payment(&wallet, fee_payer, &elsewhere, 5_000_000)),
    )
    .await;
    assert_eq!(refused.status(), 400);
    let other_fee = ed25519_dalek::SigningKey::from_bytes(&[4u8; 32])
        .verifying_key()
        .to_bytes();
    let refused = top_up(
        &sandbox,
        Some(&solana_payment(&wallet, other_fee, pay_to, 5_000_000)),
    )
    .await;
    assert_eq!(refused.status(), 400);
    assert!(facilitator.verifications().is_empty());

    let paid = solana_payment(&wallet, fee_payer, pay_to, 6_000_000);
    let response = top_up(&sandbox, Some(&paid)).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["data"]["walletAddress"], address.as_str());
    assert_eq!(body["data"]["newBalance"].to_string(), "6");
    // Replayed: credited once. The same message with other bytes in the
    // fee payer's slot is the same payment.
    assert_eq!(top_up(&sandbox, Some(&paid)).await.status(), 200);
    let payload: Value = serde_json::from_slice(&STANDARD.decode(&paid).unwrap()).unwrap();
    let mut transaction = STANDARD
        .decode(payload["payload"]["transaction"].as_str().unwrap())
        .unwrap();
    transaction[1] ^= 0xff;
    let copy = json!({"x402Version": 2, "accepted": payload["accepted"],
        "payload": {"transaction": STANDARD.encode(transaction)}});
    let again = top_up(&sandbox, Some(&STANDARD.encode(copy.to_string()))).await;
    assert_eq!(again.status(), 200);
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["data"]["amountCredited"].to_string(), "6");
    assert!(again["data"].get("newBalance").is_none(), "{again}");
    assert_eq!(facilitator.settlements().len(), 1);
    assert_eq!(
        facilitator.settlements()[0]["paymentRequirements"]["network"],
        "solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp"
    );

    let response = chat_as(&sandbox, Some(&solana_sign_in(&wallet))).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-balance-remaining"], "5.999988");

    // Past the payment's window (2 s here), a replay is refused.
    tokio::time::sleep(std::time::Duration::from_millis(2_500)).await;
    let late = top_up(&sandbox, Some(&paid)).await;
    assert_eq!(late.status(), 402);
    let late: Value = late.json().await.unwrap();
    assert_eq!(late["error"], "PAYMENT_EXPIRED", "{late}");
    assert_eq!(facilitator.settlements().len(), 1);
}

/// A wallet pays for an image as for a chat: refused until it tops up,
/// then charged the image's price, its balance in `X-Balance-Remaining`;
/// and for a video job, held when queued and charged once when made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wallet_pays_for_an_image_and_a_video() {
    let world = world(Topology::OneProcess).await;
    let sandbox = &world.sandbox;
    let wallet = &world.wallet;
    let generate = |header: String| {
        sandbox
            .http()
            .post(sandbox.api("/image/generate"))
            .header("SIGN-IN-WITH-X", header)
            .json(&json!({"model": "paid-image", "prompt": "a coin", "width": 8, "height": 8}))
            .send()
    };
    let response = generate(sign_in(wallet, &fresh_nonce(), 0, "127.0.0.1:8080"))
        .await
        .unwrap();
    assert_eq!(response.status(), 402);
    let paid = payment(wallet, PAY_TO, 5_000_000, 300, "USD Coin", random_nonce());
    assert_eq!(top_up(sandbox, Some(&paid)).await.status(), 200);
    let response = generate(sign_in(wallet, &fresh_nonce(), 0, "127.0.0.1:8080"))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-balance-remaining"], "4.75");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["images"].as_array().unwrap().len(), 1);

    // A video job: held (and shown) when queued, charged when made, and
    // retrieved by the same wallet.
    let post = |path: &'static str, body: Value| {
        sandbox
            .http()
            .post(sandbox.api(path))
            .header(
                "SIGN-IN-WITH-X",
                sign_in(wallet, &fresh_nonce(), 0, "127.0.0.1:8080"),
            )
            .json(&body)
            .send()
    };
    let queued = post(
        "/video/queue",
        json!({"model": "paid-video", "prompt": "a coin spinning", "duration": "1s"}),
    )
    .await
    .unwrap();
    assert_eq!(queued.status(), 200);
    assert_eq!(queued.headers()["x-balance-remaining"], "4.25");
    let queue_id = queued.json::<Value>().await.unwrap()["queue_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let retrieved = post(
            "/video/retrieve",
            json!({"model": "paid-video", "queue_id": queue_id}),
        )
        .await
        .unwrap();
        assert_eq!(retrieved.status(), 200);
        if retrieved.headers()["content-type"] == "video/mp4" {
            let (width, height, _, _) =
                rialto_test_kit::mock_video::mp4_summary(&retrieved.bytes().await.unwrap())
                    .unwrap();
            assert_eq!((width, height), (256, 144));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the job never finished"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // Charged once: $5 less the image and the second of video.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let balance: Value = sandbox
            .http()
            .get(sandbox.api(&format!(
                "/x402/balance/{}",
                wallet.address().to_checksum(None)
            )))
            .header(
                "SIGN-IN-WITH-X",
                sign_in(wallet, &fresh_nonce(), 0, "127.0.0.1:8080"),
            )
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if balance["data"]["balanceUsd"] == 4.25 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{balance}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

async fn web3_token(sandbox: &Sandbox) -> String {
    // No credentials: the token is public.
    let response = sandbox
        .http()
        .get(sandbox.api("/api_keys/generate_web3_key"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["success"], true);
    body["data"]["token"].as_str().unwrap().to_owned()
}

async fn create_web3_key(sandbox: &Sandbox, body: &Value) -> Response {
    sandbox
        .http()
        .post(sandbox.api("/api_keys/generate_web3_key"))
        .json(body)
        .send()
        .await
        .unwrap()
}

fn signed_by(wallet: &PrivateKeySigner, token: &str) -> String {
    let signature = wallet.sign_message_sync(token.as_bytes()).unwrap();
    format!("0x{}", hex::encode(signature.as_bytes()))
}

/// `GET` and `POST /api_keys/generate_web3_key`: a wallet signs the token
/// and gets a key of its own account, which spends the wallet's balance
/// (what x402 top-ups credit); a token makes one key, however many race
/// with it; what another wallet signed, a token for another service, and
/// a token altered after signing are refused.
async fn a_wallet_gets_an_api_key(topology: Topology) {
    let world = world(topology).await;
    let sandbox = &world.sandbox;
    let wallet = &world.wallet;
    let address = wallet.address().to_checksum(None);

    let token = web3_token(sandbox).await;
    assert!(
        token.starts_with("127.0.0.1:8080 asks you to sign"),
        "{token}"
    );
    // Refusals first, and none of them uses the token up.
    let response = create_web3_key(sandbox, &json!({"apiKeyType": "ADMIN"})).await;
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    for field in ["address", "signature", "token"] {
        assert_eq!(body["details"][field]["_errors"][0], "Required", "{body}");
    }
    let stranger: PrivateKeySigner =
        "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d"
            .parse()
            .unwrap();
    let forged = json!({"apiKeyType": "ADMIN", "address": address, "token": token,
        "signature": signed_by(&stranger, &token)});
    let altered = token.replace("Nonce: ", "Nonce: 0");
    let tampered = json!({"apiKeyType": "ADMIN", "address": address, "token": altered,
        "signature": signed_by(wallet, &token)});
    let elsewhere = token.replacen("127.0.0.1:8080", "evil.example", 1);
    let foreign = json!({"apiKeyType": "ADMIN", "address": address, "token": elsewhere,
        "signature": signed_by(wallet, &elsewhere)});
    for refused in [forged, tampered, foreign] {
        let response = create_web3_key(sandbox, &refused).await;
        assert_eq!(response.status(), 401, "{refused}");
        let body: Value = response.json().await.unwrap();
        assert!(body["error"].is_string(), "{body}");
    }
    let unknown = json!({"apiKeyType": "ADMIN", "address": address, "token": token,
        "signature": signed_by(wallet, &token), "account": "someone else's"});
    assert_eq!(create_web3_key(sandbox, &unknown).await.status(), 400);

    // Signed by the wallet: a key, in the hosted shape, once. Four more
    // requests with the same token race the first; exactly one wins.
    let good = json!({"apiKeyType": "ADMIN", "address": address.to_lowercase(),
        "token": token, "signature": signed_by(wallet, &token),
        "consumptionLimit": {"usd": 1}, "limitPeriod": "MONTH"});
    let answers = join_all((0..5).map(|_| create_web3_key(sandbox, &good))).await;
    let mut created = Vec::new();
    for response in answers {
        match response.status().as_u16() {
            200 => created.push(response.json::<Value>().await.unwrap()),
            401 => {}
            other => panic!("{other}: {}", response.text().await.unwrap()),
        }
    }
    assert_eq!(created.len(), 1, "a token makes one key");
    let data = &created[0]["data"];
    assert_eq!(created[0]["success"], true);
    assert_eq!(data["apiKeyType"], "ADMIN");
    assert_eq!(data["description"], "Web3 API Key");
    assert_eq!(data["consumptionLimit"]["usd"].as_f64(), Some(1.0));
    assert_eq!(data["limitPeriod"], "MONTH");
    let admin = data["apiKey"].as_str().unwrap().to_owned();

    // The key's account is the wallet's: a second key lands beside it.
    let token = web3_token(sandbox).await;
    let response = create_web3_key(
        sandbox,
        &json!({"apiKeyType": "INFERENCE", "address": address, "token": token,
            "signature": signed_by(wallet, &token), "description": "bot"}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let inference = response.json::<Value>().await.unwrap()["data"]["apiKey"]
        .as_str()
        .unwrap()
        .to_owned();
    let listed: Value = sandbox
        .call(Method::GET, "/api_keys", &admin, None)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut descriptions: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["description"].as_str().unwrap())
        .collect();
    descriptions.sort_unstable();
    assert_eq!(descriptions, ["Web3 API Key", "bot"]);

    // Nothing to spend yet; a $5 top-up by the wallet is the keys' balance.
    let chat = json!({"model": "paid-chat", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello"}], "mock": {"words": 10}});
    let response = sandbox
        .call(Method::POST, "/chat/completions", &inference, Some(&chat))
        .await
        .unwrap();
    assert_eq!(response.status(), 402);
    let paid = payment(wallet, PAY_TO, 5_000_000, 300, "USD Coin", random_nonce());
    assert_eq!(top_up(sandbox, Some(&paid)).await.status(), 200);
    let balance: Value = sandbox
        .call(Method::GET, "/billing/balance", &admin, None)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(balance["balances"]["usd"].as_f64(), Some(5.0), "{balance}");
    let response = sandbox
        .call(Method::POST, "/chat/completions", &inference, Some(&chat))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let remaining: f64 = response.headers()["x-rialto-balance-usd"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(remaining <= 5.0, "{remaining}");
    // The wallet signed in sees the same balance, lower by the chat.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let balance: Value = sandbox
            .http()
            .get(sandbox.api(&format!("/x402/balance/{address}")))
            .header(
                "SIGN-IN-WITH-X",
                sign_in(wallet, &fresh_nonce(), 0, "127.0.0.1:8080"),
            )
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let usd = balance["data"]["balanceUsd"].as_f64().unwrap();
        if usd < 5.0 {
            assert!(usd > 4.99, "{balance}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{balance}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    // A Solana wallet signs the same way (Ed25519, base58).
    use ed25519_dalek::Signer;
    let solana = ed25519_dalek::SigningKey::from_bytes(&[7u8; 32]);
    let token = web3_token(sandbox).await;
    let signature = bs58::encode(solana.sign(token.as_bytes()).to_bytes()).into_string();
    let response = create_web3_key(
        sandbox,
        &json!({"apiKeyType": "INFERENCE", "token": token, "signature": signature,
            "address": bs58::encode(solana.verifying_key().to_bytes()).into_string()}),
    )
    .await;
    assert_eq!(response.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wallet_gets_an_api_key_one_process() {
    a_wallet_gets_an_api_key(Topology::OneProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wallet_gets_an_api_key_split() {
    a_wallet_gets_an_api_key(Topology::Split).await;
}
