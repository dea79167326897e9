//! A local JSON-RPC node double for the crypto RPC proxy: it answers a few
//! EVM methods from a small state of its own (a chain id, a block number
//! that grows with every call, balances), `error` for any other method, and
//! can be made to fail (503) to test failover. It records every call.
//!
//! Like every double here it serves on a thread of its own and stops when
//! dropped.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use actix_web::{HttpResponse, web};
use anyhow::Context as _;
use serde_json::{Value, json};

#[derive(Default)]
struct State {
    chain_id: u64,
    block: AtomicU64,
    down: AtomicBool,
    /// Every call's method, in order (batches flattened).
    methods: Mutex<Vec<String>>,
}

/// A running node double.
pub struct RpcNode {
    addr: SocketAddr,
    state: Arc<State>,
    _served: crate::server::Served,
}

impl RpcNode {
    /// Starts on `127.0.0.1` with an OS-chosen port, as chain `chain_id`.
    pub async fn start(chain_id: u64) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the RPC node")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            chain_id,
            block: AtomicU64::new(0x100),
            ..State::default()
        });
        let data = web::Data::from(Arc::clone(&state));
        let served = crate::server::serve("rpc-node", listener, move |app| {
            app.app_data(data.clone()).route("/", web::post().to(call));
        })
        .await?;
        Ok(Self {
            addr,
            state,
            _served: served,
        })
    }

    /// `http://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// While set, every request is answered 503.
    pub fn set_down(&self, down: bool) {
        self.state.down.store(down, Ordering::SeqCst);
    }

    /// Every call's method received, in order.
    pub fn methods(&self) -> Vec<String> {
        self.state
            .methods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

fn answer(state: &State, call: &Value) -> Value {
    let method = call["method"].as_str().unwrap_or_default().to_owned();
    state
        .methods
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(method.clone());
    let id = call.get("id").cloned().unwrap_or(Value::Null);
    let result = match method.as_str() {
        "eth_chainId" => json!(format!("{:#x}", state.chain_id)),
        "eth_blockNumber" => json!(format!("{:#x}", state.block.fetch_add(1, Ordering::SeqCst))),
        // Every address holds 1 ETH.
        "eth_getBalance" => json!("0xde0b6b3a7640000"),
        "net_version" => json!(state.chain_id.to_string()),
        "trace_block" => json!([]),
        _ => {
            return json!({"jsonrpc": "2.0", "id": id,
                "error": {"code": -32601, "message": format!("the method {method} does not exist")}});
        }
    };
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

async fn call(state: web::Data<State>, body: web::Json<Value>) -> HttpResponse {
    if state.down.load(Ordering::SeqCst) {
        return HttpResponse::ServiceUnavailable().body("down");
    }
    match body.into_inner() {
        Value::Array(calls) => {
            let answers: Vec<Value> = calls.iter().map(|c| answer(&state, c)).collect();
            HttpResponse::Ok().json(answers)
        }
        call => HttpResponse::Ok().json(answer(&state, &call)),
    }
}
