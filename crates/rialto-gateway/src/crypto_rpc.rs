//! `GET /crypto/rpc/networks` and `POST /crypto/rpc/{network}`: a JSON-RPC
//! proxy to blockchain nodes, billed per credit.
//!
//! A call costs its network's `base_credits` times its method's tier (1
//! standard, 2 advanced, 4 large); a call the node answers with a JSON-RPC
//! `error` costs `error_credits` instead. A request (one call or a batch of
//! up to `max_batch`) holds what every call of it could cost and is charged
//! what the node's answer says, like any metered request: key or wallet
//! auth, the endpoint's rate-limit window, the balance headers. Methods are
//! an allow-list; a batch naming any other is refused whole, with the
//! methods named. The network's nodes are tried in order: one that cannot be
//! reached, times out, or answers 5xx, 429 or a body that is not JSON
//! hands the request to the next.

use std::collections::HashMap;
use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, web};
use bytes::Bytes;
use rialto_core::ErrorCode;
use rialto_core::config::CryptoRpcConfig;
use serde_json::{Map, Value, json};

use crate::augment::invalid_at;
use crate::{ApiError, Gateway, authenticate, parse_json, read_body};

/// What a model id of a crypto RPC charge starts with
/// (`crypto-rpc/ethereum-mainnet`).
pub use rialto_billing::CRYPTO_RPC_PREFIX;

/// Methods callers may use when the configuration names none, with their
/// tiers (the hosted API's classification).
const BUILT_IN_METHODS: &[(&str, u64)] = &[
    // EVM reads and writes: standard.
    ("eth_accounts", 1),
    ("eth_blobBaseFee", 1),
    ("eth_blockNumber", 1),
    ("eth_call", 1),
    ("eth_chainId", 1),
    ("eth_estimateGas", 1),
    ("eth_feeHistory", 1),
    ("eth_gasPrice", 1),
    ("eth_getBalance", 1),
    ("eth_getBlockByHash", 1),
    ("eth_getBlockByNumber", 1),
    ("eth_getBlockReceipts", 1),
    ("eth_getBlockTransactionCountByHash", 1),
    ("eth_getBlockTransactionCountByNumber", 1),
    ("eth_getCode", 1),
    ("eth_getLogs", 1),
    ("eth_getProof", 1),
    ("eth_getStorageAt", 1),
    ("eth_getTransactionByBlockHashAndIndex", 1),
    ("eth_getTransactionByBlockNumberAndIndex", 1),
    ("eth_getTransactionByHash", 1),
    ("eth_getTransactionCount", 1),
    ("eth_getTransactionReceipt", 1),
    ("eth_getUncleCountByBlockHash", 1),
    ("eth_getUncleCountByBlockNumber", 1),
    ("eth_maxPriorityFeePerGas", 1),
    ("eth_sendRawTransaction", 1),
    ("eth_syncing", 1),
    ("net_listening", 1),
    ("net_peerCount", 1),
    ("net_version", 1),
    ("web3_clientVersion", 1),
    ("web3_sha3", 1),
    // ERC-4337 bundlers: standard.
    ("eth_estimateUserOperationGas", 1),
    ("eth_getUserOperationByHash", 1),
    ("eth_getUserOperationReceipt", 1),
    ("eth_sendUserOperation", 1),
    ("eth_supportedEntryPoints", 1),
    // Traces and the transaction pool: advanced.
    ("arbtrace_block", 2),
    ("arbtrace_call", 2),
    ("arbtrace_transaction", 2),
    ("debug_traceBlockByHash", 2),
    ("debug_traceBlockByNumber", 2),
    ("debug_traceCall", 2),
    ("debug_traceTransaction", 2),
    ("trace_block", 2),
    ("trace_call", 2),
    ("trace_filter", 2),
    ("trace_get", 2),
    ("trace_transaction", 2),
    ("txpool_inspect", 2),
    ("txpool_status", 2),
    // Replays and whole pools: large.
    ("arbtrace_replayBlockTransactions", 4),
    ("arbtrace_replayTransaction", 4),
    ("trace_replayBlockTransactions", 4),
    ("trace_replayTransaction", 4),
    ("txpool_content", 4),
    // Solana.
    ("getAccountInfo", 1),
    ("getBalance", 1),
    ("getBlock", 1),
    ("getBlockHeight", 1),
    ("getBlockTime", 1),
    ("getEpochInfo", 1),
    ("getFeeForMessage", 1),
    ("getGenesisHash", 1),
    ("getHealth", 1),
    ("getLatestBlockhash", 1),
    ("getMinimumBalanceForRentExemption", 1),
    ("getMultipleAccounts", 1),
    ("getProgramAccounts", 1),
    ("getRecentPrioritizationFees", 1),
    ("getSignatureStatuses", 1),
    ("getSignaturesForAddress", 1),
    ("getSlot", 1),
    ("getTokenAccountBalance", 1),
    ("getTokenAccountsByOwner", 1),
    ("getTokenSupply", 1),
    ("getTransaction", 1),
    ("getVersion", 1),
    ("isBlockhashValid", 1),
    ("sendTransaction", 1),
    ("simulateTransaction", 1),
    ("getLargestAccounts", 4),
    ("getSupply", 4),
];

/// The largest answer read from a node.
const MAX_ANSWER_BYTES: usize = 32 << 20;

/// One network's nodes and what may be called on them.
#[derive(Debug)]
struct Network {
    urls: Vec<String>,
    base_credits: u64,
    /// Method -> tier.
    methods: HashMap<String, u64>,
}

/// The proxy's networks, prices and HTTP client.
#[derive(Debug)]
pub struct CryptoRpc {
    networks: HashMap<String, Network>,
    /// Sorted, as `GET /crypto/rpc/networks` answers them.
    slugs: Vec<String>,
    nanos_per_credit: u64,
    error_credits: u64,
    max_batch: usize,
    client: reqwest::Client,
}

impl CryptoRpc {
    pub fn from_config(config: &CryptoRpcConfig) -> anyhow::Result<Self> {
        let tiers: HashMap<String, u64> = if config.methods.is_empty() {
            BUILT_IN_METHODS
                .iter()
                .map(|(m, t)| ((*m).to_owned(), *t))
                .collect()
        } else {
            config.methods.clone().into_iter().collect()
        };
        let mut networks = HashMap::new();
        for network in &config.networks {
            let methods = if network.methods.is_empty() {
                tiers.clone()
            } else {
                let mut chosen = HashMap::new();
                for method in &network.methods {
                    let tier = tiers.get(method).ok_or_else(|| {
                        anyhow::anyhow!(
                            "crypto_rpc network {:?}: method {method:?} has no tier in \
                             crypto_rpc.methods",
                            network.slug
                        )
                    })?;
                    chosen.insert(method.clone(), *tier);
                }
                chosen
            };
            networks.insert(
                network.slug.clone(),
                Network {
                    urls: network.urls.clone(),
                    base_credits: network.base_credits,
                    methods,
                },
            );
        }
        let mut slugs: Vec<String> = networks.keys().cloned().collect();
        slugs.sort();
        // A credit's price in nano-USD, rounded up (a price below a
        // nano-dollar still costs one).
        let nanos = rialto_core::config::price_decimal(config.usd_per_credit)
            * rust_decimal::Decimal::from(1_000_000_000u64);
        let nanos_per_credit =
            rust_decimal::prelude::ToPrimitive::to_u64(&nanos.ceil()).unwrap_or(u64::MAX);
        // rustls needs its crypto provider chosen before a client is built.
        let _ = rustls::crypto::ring::default_provider().install_default();
        Ok(Self {
            networks,
            slugs,
            nanos_per_credit,
            error_credits: config.error_credits,
            max_batch: config.max_batch,
            client: reqwest::Client::builder()
                .timeout(Duration::from_millis(config.timeout_ms))
                .build()?,
        })
    }
}

/// `GET /crypto/rpc/networks` (public): the networks, sorted.
pub async fn networks(gateway: web::Data<Gateway>) -> HttpResponse {
    HttpResponse::Ok().json(json!({"networks": gateway.crypto_rpc.slugs}))
}

/// Why a method is not served, for the 400 that names it.
fn refusal(method: &str) -> String {
    let filter = [
        "eth_newFilter",
        "eth_newBlockFilter",
        "eth_newPendingTransactionFilter",
        "eth_getFilterChanges",
        "eth_getFilterLogs",
        "eth_uninstallFilter",
    ];
    if filter.contains(&method) {
        format!(
            "{method}: filters keep state on one node, which a load-balanced proxy cannot \
             promise; use eth_getLogs"
        )
    } else if method.ends_with("ubscribe") {
        format!("{method}: subscriptions need a WebSocket; this proxy is HTTP only")
    } else {
        format!("{method}: not a supported method on this network")
    }
}

/// `POST /crypto/rpc/{network}`: one JSON-RPC call or a batch, forwarded to
/// the network's nodes and answered as the node answered.
pub async fn proxy(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    network: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let rpc = &gateway.crypto_rpc;
    let Some(chain) = rpc.networks.get(network.as_str()) else {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            format!(
                "Unknown network {:?}: GET /api/v1/crypto/rpc/networks lists them",
                network.as_str()
            ),
        ));
    };
    let body = parse_json(&read_body(&gateway, &request, payload).await?)?;
    let (mut calls, batch) = match body {
        Value::Object(call) => (vec![call], false),
        Value::Array(items) if items.is_empty() => {
            return Err(invalid_at(&[], "A batch holds at least one call"));
        }
        Value::Array(items) if items.len() > rpc.max_batch => {
            return Err(invalid_at(
                &[],
                format!("A batch holds at most {} calls", rpc.max_batch),
            ));
        }
        Value::Array(items) => {
            let mut calls = Vec::with_capacity(items.len());
            for (i, item) in items.into_iter().enumerate() {
                match item {
                    Value::Object(call) => calls.push(call),
                    _ => {
                        return Err(invalid_at(
                            &[&i.to_string()],
                            "Expected a JSON-RPC call object",
                        ));
                    }
                }
            }
            (calls, true)
        }
        _ => {
            return Err(invalid_at(
                &[],
                "Expected a JSON-RPC call or an array of them",
            ));
        }
    };
    // Every call's method must be allowed: a batch is refused whole.
    let mut unsupported = Vec::new();
    let mut most_credits: u64 = 0;
    // Each call's price by its id (as JSON text), to price the answer.
    let mut price_by_id: HashMap<String, u64> = HashMap::with_capacity(calls.len());
    for (i, call) in calls.iter_mut().enumerate() {
        let method = match call.get("method") {
            Some(Value::String(m)) => m.clone(),
            _ => {
                return Err(invalid_at(
                    &[&i.to_string(), "method"],
                    "Required: the JSON-RPC method's name",
                ));
            }
        };
        if call
            .get("jsonrpc")
            .is_some_and(|v| v.as_str() != Some("2.0"))
        {
            return Err(invalid_at(&[&i.to_string(), "jsonrpc"], "Expected \"2.0\""));
        }
        let Some(tier) = chain.methods.get(&method) else {
            unsupported.push(refusal(&method));
            continue;
        };
        // A call without an id would be a notification, answered by
        // nothing: it gets its place in the batch as its id.
        call.insert("jsonrpc".to_owned(), json!("2.0"));
        let id = call.entry("id").or_insert_with(|| json!(i)).to_string();
        let credits = chain.base_credits.saturating_mul(*tier);
        most_credits = most_credits.saturating_add(credits);
        price_by_id.insert(id, credits);
    }
    if !unsupported.is_empty() {
        unsupported.dedup();
        return Err(invalid_at(
            &["method"],
            format!("Unsupported method(s): {}", unsupported.join("; ")),
        ));
    }
    let forwarded = if batch {
        Value::Array(calls.into_iter().map(Value::Object).collect())
    } else {
        Value::Object(calls.pop().unwrap_or_default())
    };
    let forwarded = Bytes::from(serde_json::to_vec(&forwarded).unwrap_or_default());
    let window = "api/v1/crypto/rpc";
    let model_id = format!("{CRYPTO_RPC_PREFIX}{}", network.as_str());
    let most_nanos = most_credits.saturating_mul(rpc.nanos_per_credit);
    let calling = async {
        let (answer, parsed) = forward(rpc, chain, forwarded).await?;
        let used = used_credits(&parsed, &price_by_id, rpc.error_credits);
        Ok((answer, used.saturating_mul(rpc.nanos_per_credit)))
    };
    let (answer, mut response) = crate::augment::metered_by_use(
        &gateway, &request, &principal, window, &model_id, most_nanos, calling,
    )
    .await?;
    Ok(response.content_type("application/json").body(answer))
}

/// Sends `body` to the network's nodes in order; the first JSON answer.
async fn forward(
    rpc: &CryptoRpc,
    chain: &Network,
    body: Bytes,
) -> Result<(Bytes, Value), ApiError> {
    let mut last = String::new();
    for url in &chain.urls {
        let sent = rpc
            .client
            .post(url)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(error) => {
                last = format!("a node could not be reached ({})", error.without_url());
                continue;
            }
        };
        let status = response.status();
        if status.is_server_error() || status.as_u16() == 429 {
            last = format!("a node answered {status}");
            continue;
        }
        let answer = match read_bounded(response).await {
            Ok(answer) => answer,
            Err(why) => {
                last = why;
                continue;
            }
        };
        match serde_json::from_slice::<Value>(&answer) {
            Ok(parsed @ (Value::Object(_) | Value::Array(_))) => return Ok((answer, parsed)),
            _ => last = format!("a node answered {status} without JSON-RPC"),
        }
    }
    tracing::warn!(reason = last, "every node of a crypto RPC network failed");
    Err(ApiError::new(
        ErrorCode::UpstreamFailed,
        format!("The network's nodes failed: {last}"),
    ))
}

async fn read_bounded(mut response: reqwest::Response) -> Result<Bytes, String> {
    let mut answer = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if answer.len() + chunk.len() > MAX_ANSWER_BYTES {
                    return Err("a node's answer was too large".to_owned());
                }
                answer.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(Bytes::from(answer)),
            Err(error) => {
                return Err(format!(
                    "a node's answer broke off ({})",
                    error.without_url()
                ));
            }
        }
    }
}

/// Credits an answer costs: each call's price, or `error_credits` for a
/// call answered with an `error` (never more than the call's price).
fn used_credits(answer: &Value, price_by_id: &HashMap<String, u64>, error_credits: u64) -> u64 {
    let items: Vec<&Map<String, Value>> = match answer {
        Value::Array(items) => items.iter().filter_map(Value::as_object).collect(),
        Value::Object(item) => vec![item],
        _ => Vec::new(),
    };
    let mut priced: HashMap<&str, u64> = HashMap::new();
    for item in items {
        let id = item.get("id").map(Value::to_string).unwrap_or_default();
        let Some((key, price)) = price_by_id.get_key_value(&id) else {
            continue;
        };
        let cost = if item.contains_key("error") {
            error_credits.min(*price)
        } else {
            *price
        };
        priced.insert(key.as_str(), cost);
    }
    priced.values().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_costs_its_calls_and_errors_cost_less() {
        let prices: HashMap<String, u64> = [("1".to_owned(), 20), ("\"b\"".to_owned(), 80)]
            .into_iter()
            .collect();
        let both = json!([{"jsonrpc": "2.0", "id": 1, "result": "0x1"},
            {"jsonrpc": "2.0", "id": "b", "result": {}}]);
        assert_eq!(used_credits(&both, &prices, 5), 100);
        let one_failed = json!([{"jsonrpc": "2.0", "id": 1, "result": "0x1"},
            {"jsonrpc": "2.0", "id": "b", "error": {"code": -32601, "message": "no"}}]);
        assert_eq!(used_credits(&one_failed, &prices, 5), 25);
        // An id the request did not have, or twice, is not charged twice.
        let odd = json!([{"id": 1, "result": 1}, {"id": 1, "result": 1}, {"id": 9, "result": 1}]);
        assert_eq!(used_credits(&odd, &prices, 5), 20);
        assert_eq!(used_credits(&json!({"id": 1, "result": 1}), &prices, 5), 20);
    }

    #[test]
    fn networks_take_their_methods_from_the_tiers() {
        use rialto_core::config::CryptoNetworkConfig;
        let network = |slug: &str, methods: &[&str]| CryptoNetworkConfig {
            slug: slug.to_owned(),
            urls: vec!["http://127.0.0.1:1".to_owned()],
            base_credits: 30,
            methods: methods.iter().map(|m| (*m).to_owned()).collect(),
        };
        let config = CryptoRpcConfig {
            networks: vec![
                network("solana-mainnet", &["getBalance", "getSupply"]),
                network("base-mainnet", &[]),
            ],
            ..CryptoRpcConfig::default()
        };
        let rpc = CryptoRpc::from_config(&config).unwrap();
        assert_eq!(rpc.slugs, ["base-mainnet", "solana-mainnet"]);
        assert_eq!(rpc.nanos_per_credit, 700);
        let solana = &rpc.networks["solana-mainnet"];
        assert_eq!(solana.methods.len(), 2);
        assert_eq!(solana.methods["getSupply"], 4);
        assert!(
            rpc.networks["base-mainnet"]
                .methods
                .contains_key("eth_call")
        );
        let unknown = CryptoRpcConfig {
            networks: vec![network("x", &["eth_newFilter"])],
            ..CryptoRpcConfig::default()
        };
        assert!(CryptoRpc::from_config(&unknown).is_err());
    }
}
