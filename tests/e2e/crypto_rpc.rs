//! The crypto JSON-RPC proxy in both topologies, against local node
//! doubles: the networks list, single calls and batches priced per credit
//! (errors cheaper), the allow-list refusing a batch whole, failover between
//! a network's nodes, and a balance that covers exactly five calls serving
//! five of ten racing. Then a real node: ganache, a local Ethereum devnet
//! from npm (`make devnet`), behind the proxy.

use futures_util::future::join_all;
use reqwest::{Method, Response};
use rialto_test_kit::{RpcNode, Sandbox, Topology};
use serde_json::{Value, json};

struct World {
    first: RpcNode,
    second: RpcNode,
    _solana: RpcNode,
    sandbox: Sandbox,
}

/// A credit is $0.001: a standard call on ethereum-mainnet (20 credits)
/// costs $0.02, a trace (tier 2) $0.04, an answered error $0.005.
async fn world(topology: Topology) -> World {
    let first = RpcNode::start(1).await.unwrap();
    let second = RpcNode::start(1).await.unwrap();
    let solana = RpcNode::start(0).await.unwrap();
    let config = format!(
        r#"
[crypto_rpc]
usd_per_credit = 0.001
max_batch = 4

[[crypto_rpc.networks]]
slug = "ethereum-mainnet"
urls = ["{}", "{}"]

[[crypto_rpc.networks]]
slug = "base-sepolia"
urls = ["{}"]
base_credits = 30
methods = ["eth_chainId"]
"#,
        first.url(),
        second.url(),
        solana.url()
    );
    let sandbox = Sandbox::builder(topology)
        .config(&config)
        .start()
        .await
        .unwrap();
    World {
        first,
        second,
        _solana: solana,
        sandbox,
    }
}

async fn rpc(sandbox: &Sandbox, key: &str, network: &str, body: &Value) -> Response {
    sandbox
        .call(
            Method::POST,
            &format!("/crypto/rpc/{network}"),
            key,
            Some(body),
        )
        .await
        .unwrap()
}

async fn usd(sandbox: &Sandbox, admin: &str) -> String {
    let balance: Value = sandbox
        .call(Method::GET, "/billing/balance", admin, None)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    balance["balances"]["usd"].to_string()
}

async fn proxied_and_priced(topology: Topology) {
    let world = world(topology).await;
    let sandbox = &world.sandbox;
    let account = sandbox
        .create_unfunded_account("rpc", "standard")
        .await
        .unwrap();
    sandbox.credit(&account.id, "1", "seed").await.unwrap();
    let key = &account.admin_key;

    // Public: the networks, sorted.
    let networks: Value = sandbox
        .http()
        .get(sandbox.api("/crypto/rpc/networks"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        networks,
        json!({"networks": ["base-sepolia", "ethereum-mainnet"]})
    );

    // One call: the node's answer, $0.02.
    let response = rpc(
        sandbox,
        key,
        "ethereum-mainnet",
        &json!({"jsonrpc": "2.0", "method": "eth_chainId", "params": [], "id": 7}),
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-rialto-balance-usd"], "1");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body, json!({"jsonrpc": "2.0", "id": 7, "result": "0x1"}));
    assert_eq!(usd(sandbox, key).await, "0.98");

    // A batch: a standard call, a trace (x2) and a call without an id
    // (given its place as id): 20 + 40 + 20 credits.
    let response = rpc(
        sandbox,
        key,
        "ethereum-mainnet",
        &json!([
            {"jsonrpc": "2.0", "method": "eth_blockNumber", "id": 1},
            {"jsonrpc": "2.0", "method": "trace_block", "params": ["latest"], "id": "t"},
            {"method": "eth_getBalance", "params": ["0x0000000000000000000000000000000000000001", "latest"]},
        ]),
    )
    .await;
    assert_eq!(response.status(), 200);
    let answers: Value = response.json().await.unwrap();
    assert_eq!(answers.as_array().unwrap().len(), 3);
    assert_eq!(answers[1]["id"], "t");
    assert_eq!(answers[2]["id"], 2);
    assert_eq!(answers[2]["result"], "0xde0b6b3a7640000");
    assert_eq!(usd(sandbox, key).await, "0.9");
    // A call the node answers with an error costs 5 credits, not 20.
    let response = rpc(
        sandbox,
        key,
        "ethereum-mainnet",
        &json!({"jsonrpc": "2.0", "method": "eth_call", "params": [{}], "id": 1}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], -32601);
    assert_eq!(usd(sandbox, key).await, "0.895");

    // Refused whole, charged nothing: methods outside the allow-list (the
    // network's own list too), malformed calls, batches too large.
    let refused: Vec<(&str, Value, u16, &str)> = vec![
        (
            "ethereum-mainnet",
            json!([{"method": "eth_chainId", "id": 1}, {"method": "eth_newFilter", "id": 2}]),
            400,
            "eth_getLogs",
        ),
        (
            "ethereum-mainnet",
            json!({"method": "eth_subscribe", "id": 1}),
            400,
            "WebSocket",
        ),
        (
            "base-sepolia",
            json!({"method": "eth_blockNumber", "id": 1}),
            400,
            "eth_blockNumber",
        ),
        ("ethereum-mainnet", json!([]), 400, "at least one"),
        (
            "ethereum-mainnet",
            json!([{"method": "eth_chainId"}, {"method": "eth_chainId"}, {"method": "eth_chainId"},
                {"method": "eth_chainId"}, {"method": "eth_chainId"}]),
            400,
            "at most 4",
        ),
        ("ethereum-mainnet", json!({"params": []}), 400, "method"),
        ("ethereum-mainnet", json!("eth_chainId"), 400, "JSON-RPC"),
        (
            "ethereum-mainnet",
            json!({"jsonrpc": "1.0", "method": "eth_chainId"}),
            400,
            "2.0",
        ),
        (
            "dogecoin",
            json!({"method": "eth_chainId"}),
            404,
            "networks",
        ),
    ];
    for (network, body, status, says) in refused {
        let response = rpc(sandbox, key, network, &body).await;
        assert_eq!(response.status(), status, "{body}");
        let text = response.text().await.unwrap();
        assert!(text.contains(says), "{body}: {text}");
    }
    assert_eq!(usd(sandbox, key).await, "0.895");

    // The first node down: the second answers. Both down: an upstream
    // failure, nothing charged.
    let before = world.second.methods().len();
    world.first.set_down(true);
    let response = rpc(
        sandbox,
        key,
        "ethereum-mainnet",
        &json!({"method": "eth_chainId", "id": 1}),
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(world.second.methods().len(), before + 1);
    world.second.set_down(true);
    let response = rpc(
        sandbox,
        key,
        "ethereum-mainnet",
        &json!({"method": "eth_chainId", "id": 1}),
    )
    .await;
    assert!(response.status().is_server_error(), "{}", response.status());
    let body: Value = response.json().await.unwrap();
    assert!(body["error"].is_string(), "{body}");
    assert_eq!(usd(sandbox, key).await, "0.875");
    world.first.set_down(false);
    world.second.set_down(false);

    // The usage history names the network.
    let history: Value = sandbox
        .call(Method::GET, "/billing/usage-history", key, None)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(history["data"][0]["sku"], "crypto-rpc-ethereum-mainnet");

    // Exactly five $0.02 calls in $0.10, however many race for it.
    let racer = sandbox
        .create_unfunded_account("racer", "standard")
        .await
        .unwrap();
    sandbox.credit(&racer.id, "0.1", "seed").await.unwrap();
    let calls: Vec<Value> = (0..10)
        .map(|i| json!({"method": "eth_chainId", "id": i}))
        .collect();
    let answers = join_all(
        calls
            .iter()
            .map(|call| rpc(sandbox, &racer.admin_key, "ethereum-mainnet", call)),
    )
    .await;
    let served = answers.iter().filter(|r| r.status() == 200).count();
    let refused = answers.iter().filter(|r| r.status() == 402).count();
    assert_eq!((served, refused), (5, 5));
    assert_eq!(usd(sandbox, &racer.admin_key).await, "0");

    // No credentials: the x402 discovery answer.
    let anonymous = sandbox
        .http()
        .post(sandbox.api("/crypto/rpc/ethereum-mainnet"))
        .json(&json!({"method": "eth_chainId", "id": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 402);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxied_and_priced_one_process() {
    proxied_and_priced(Topology::OneProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxied_and_priced_split() {
    proxied_and_priced(Topology::Split).await;
}

/// A real devnet: ganache (npm, `make devnet`) on a free port, killed when
/// dropped.
struct Devnet {
    child: std::process::Child,
    url: String,
}

impl Devnet {
    async fn start() -> Devnet {
        let bin = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("devnet/node_modules/.bin/ganache");
        assert!(
            bin.exists(),
            "{} is missing: run make devnet",
            bin.display()
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new(bin)
            .args(["--port", &port.to_string(), "--chain.chainId", "31337"])
            .args(["--wallet.deterministic", "--logging.quiet"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let url = format!("http://127.0.0.1:{port}");
        let devnet = Devnet { child, url };
        let http = rialto_test_kit::sandbox::http_client().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let answer = http
                .post(&devnet.url)
                .json(&json!({"jsonrpc": "2.0", "method": "eth_chainId", "id": 1}))
                .send()
                .await;
            if answer.is_ok_and(|a| a.status().is_success()) {
                return devnet;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "ganache never answered"
            );
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Devnet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The proxy in front of a real node: a chain's id, a funded account's
/// balance and a batch the node partly refuses (priced as errors).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_devnet_behind_the_proxy() {
    let devnet = Devnet::start().await;
    let config = format!(
        r#"
[crypto_rpc]
usd_per_credit = 0.001

[[crypto_rpc.networks]]
slug = "local-devnet"
urls = ["{}"]
"#,
        devnet.url
    );
    let sandbox = Sandbox::builder(Topology::OneProcess)
        .config(&config)
        .start()
        .await
        .unwrap();
    let account = sandbox
        .create_unfunded_account("devnet", "standard")
        .await
        .unwrap();
    sandbox.credit(&account.id, "1", "seed").await.unwrap();
    let key = &account.admin_key;
    let answer: Value = rpc(
        &sandbox,
        key,
        "local-devnet",
        &json!({"jsonrpc": "2.0", "method": "eth_chainId", "id": 1}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(answer["result"], "0x7a69");
    // Ganache's first deterministic account holds 1,000 ETH; trace_block
    // is not a method it has: an error, 5 credits instead of 40.
    let answers: Value = rpc(
        &sandbox,
        key,
        "local-devnet",
        &json!([
            {"jsonrpc": "2.0", "method": "eth_getBalance", "id": "balance",
                "params": ["0x90F8bf6A479f320ead074411a4B0e7944Ea8c9C1", "latest"]},
            {"jsonrpc": "2.0", "method": "eth_blockNumber", "id": "block"},
            {"jsonrpc": "2.0", "method": "trace_block", "params": ["latest"], "id": "trace"},
        ]),
    )
    .await
    .json()
    .await
    .unwrap();
    let by_id = |id: &str| {
        answers
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["id"] == id)
            .unwrap()
            .clone()
    };
    assert_eq!(by_id("balance")["result"], "0x3635c9adc5dea00000");
    assert!(by_id("block")["result"].is_string());
    assert!(by_id("trace")["error"].is_object());
    // $0.02 + $0.02 + $0.02 + $0.005.
    assert_eq!(usd(&sandbox, key).await, "0.935");
}
