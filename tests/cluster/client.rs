//! The running cluster as the test sees it: its addresses (`cluster.env`,
//! written by `deploy/cluster.sh up`), its HTTP API (operator and account
//! calls, chats that record when they were sent and answered), and
//! `deploy/cluster.sh kill|start` for its processes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};

/// The cluster under test.
pub struct Cluster {
    /// Base URLs of gateway-0 and gateway-1.
    pub gateways: Vec<String>,
    pub operator_token: String,
    /// The limiter replicas as `remote.limiter` lists them (rendezvous
    /// hashing is over these strings).
    pub limiters: Vec<String>,
    /// The billing replicas as `remote.billing` lists them.
    pub billing: Vec<String>,
    pub database_url: String,
    pub nats: String,
    pub bus_prefix: String,
    /// The cluster's configuration file.
    pub config: PathBuf,
    /// Each process's metrics address (`host:port`), by name.
    metrics: HashMap<String, String>,
    /// Where each process logs (`NAME.log`).
    pub logs: PathBuf,
    /// The repository, where `deploy/cluster.sh` is.
    root: PathBuf,
    /// Pooled client for the scenarios.
    pub http: reqwest::Client,
}

/// An account made through the operator API.
#[derive(Debug, Clone)]
pub struct Account {
    pub id: String,
    pub admin_key: String,
}

/// When a `deploy/cluster.sh kill` or `start` began and returned.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    pub began: Instant,
    pub done: Instant,
}

impl Cluster {
    /// The cluster described by `$CLUSTER_DIR/cluster.env` (`data/cluster`
    /// under the repository by default, as deploy/cluster.sh has it).
    pub fn from_env() -> Self {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("tests/ is in the repository")
            .to_path_buf();
        let dir = std::env::var("CLUSTER_DIR").unwrap_or_else(|_| "data/cluster".to_owned());
        let file = root.join(dir).join("cluster.env");
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| {
            panic!(
                "cannot read {}: {e}; start the cluster first (make test-cluster does)",
                file.display()
            )
        });
        let vars: HashMap<&str, &str> = text
            .lines()
            .filter_map(|line| line.split_once('='))
            .collect();
        let var = |name: &str| {
            (*vars
                .get(name)
                .unwrap_or_else(|| panic!("{name} missing from {}", file.display())))
            .to_owned()
        };
        let path = |name: &str| {
            let value = PathBuf::from(var(name));
            if value.is_absolute() {
                value
            } else {
                root.join(value)
            }
        };
        Self {
            gateways: var("CLUSTER_GATEWAYS")
                .split(',')
                .map(str::to_owned)
                .collect(),
            operator_token: var("CLUSTER_OPERATOR_TOKEN"),
            limiters: ["CLUSTER_LIMITER_0", "CLUSTER_LIMITER_1"]
                .iter()
                .map(|name| format!("http://{}", var(name)))
                .collect(),
            billing: ["CLUSTER_BILLING_0", "CLUSTER_BILLING_1"]
                .iter()
                .map(|name| format!("http://{}", var(name)))
                .collect(),
            database_url: var("CLUSTER_DATABASE_URL"),
            nats: var("CLUSTER_NATS"),
            bus_prefix: var("CLUSTER_BUS_PREFIX"),
            config: path("CLUSTER_CONFIG"),
            metrics: [
                "gateway-0",
                "gateway-1",
                "auth",
                "limiter-0",
                "limiter-1",
                "billing-0",
                "billing-1",
                "router",
            ]
            .iter()
            .map(|name| {
                let key = format!("CLUSTER_{}_METRICS", name.to_uppercase().replace('-', "_"));
                ((*name).to_owned(), var(&key))
            })
            .collect(),
            logs: path("CLUSTER_LOGS"),
            root,
            http: rialto_test_kit::sandbox::http_client().unwrap(),
        }
    }

    /// `<gateway>/api/v1<path>`.
    pub fn api(&self, gateway: usize, path: &str) -> String {
        format!("{}/api/v1{path}", self.gateways[gateway])
    }

    /// `method` on `/api/v1<path>` of a gateway with `key` as the bearer.
    pub async fn call(
        &self,
        gateway: usize,
        method: Method,
        path: &str,
        key: &str,
        body: Option<&Value>,
    ) -> reqwest::Response {
        let mut request = self
            .http
            .request(method, self.api(gateway, path))
            .bearer_auth(key);
        if let Some(body) = body {
            request = request.json(body);
        }
        request.send().await.unwrap()
    }

    /// An account without credit, through the operator API of `gateway`.
    pub async fn create_account(&self, gateway: usize, name: &str) -> Account {
        let response = self
            .http
            .post(format!("{}/admin/v1/accounts", self.gateways[gateway]))
            .bearer_auth(&self.operator_token)
            .json(&json!({"name": name, "tier": "standard"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "creating account {name}");
        let body: Value = response.json().await.unwrap();
        Account {
            id: body["id"].as_str().unwrap().to_owned(),
            admin_key: body["api_key"]["key"].as_str().unwrap().to_owned(),
        }
    }

    /// A new account whose ledger billing replica `replica` owns.
    pub async fn account_owned_by(&self, gateway: usize, name: &str, replica: usize) -> Account {
        let addresses: Vec<&str> = self.billing.iter().map(String::as_str).collect();
        loop {
            let account = self.create_account(gateway, name).await;
            let owner = format!("account:{}", account.id);
            if rialto_billing::replicas::owner_of(&owner, &addresses) == replica {
                return account;
            }
        }
    }

    /// Credits `usd` once per `reference`; the operator API's answer.
    pub async fn credit(&self, gateway: usize, account: &str, usd: &str, reference: &str) -> Value {
        let response = self
            .http
            .post(format!(
                "{}/admin/v1/accounts/{account}/credits",
                self.gateways[gateway]
            ))
            .bearer_auth(&self.operator_token)
            .json(&json!({"usd": usd, "reference": reference}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "crediting {account}");
        response.json().await.unwrap()
    }

    /// A new key of `key_type`: (id, secret).
    pub async fn create_key(
        &self,
        gateway: usize,
        admin: &str,
        key_type: &str,
    ) -> (String, String) {
        let body = json!({"apiKeyType": key_type, "description": "cluster test"});
        let response = self
            .call(gateway, Method::POST, "/api_keys", admin, Some(&body))
            .await;
        assert_eq!(response.status(), 200, "creating a key");
        let body: Value = response.json().await.unwrap();
        (
            body["data"]["id"].as_str().unwrap().to_owned(),
            body["data"]["apiKey"].as_str().unwrap().to_owned(),
        )
    }

    /// A new INFERENCE key whose windows limiter replica `replica` holds.
    pub async fn key_owned_by(&self, admin: &str, replica: usize) -> (String, String) {
        let addresses: Vec<&str> = self.limiters.iter().map(String::as_str).collect();
        loop {
            let (id, secret) = self.create_key(0, admin, "INFERENCE").await;
            if rialto_limiter::owner_of(&format!("key:{id}"), &addresses) == replica {
                return (id, secret);
            }
        }
    }

    /// The account's USD balance in nano-dollars (`GET /billing/balance`;
    /// as booked, so credit held by requests in flight is included).
    pub async fn balance(&self, gateway: usize, admin: &str) -> i64 {
        let response = self
            .call(gateway, Method::GET, "/billing/balance", admin, None)
            .await;
        assert_eq!(response.status(), 200);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["balances"]["diem"].to_string(), "0", "{body}");
        nanos(&body["balances"]["usd"])
    }

    /// The account's whole usage history (`GET /billing/usage`, every
    /// page): (request id as in `CF-RAY`, nano-dollars charged).
    pub async fn usage(&self, gateway: usize, admin: &str) -> Vec<(String, i64)> {
        let mut entries = Vec::new();
        for page in 1.. {
            let path = format!("/billing/usage?limit=500&page={page}&sortOrder=asc");
            let response = self.call(gateway, Method::GET, &path, admin, None).await;
            assert_eq!(response.status(), 200);
            let pages: u64 = response.headers()["x-pagination-total-pages"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            let body: Value = response.json().await.unwrap();
            for entry in body["data"].as_array().unwrap() {
                assert_eq!(entry["currency"], "USD", "{entry}");
                let id = entry["inferenceDetails"]["requestId"].as_str().unwrap();
                let id = id.strip_prefix("chatcmpl-").unwrap_or(id).to_owned();
                entries.push((id, -nanos(&entry["amount"])));
            }
            if page >= pages {
                break;
            }
        }
        entries
    }

    /// `deploy/cluster.sh kill NAME`: SIGKILL, as a crash would.
    pub async fn kill(&self, name: &str) -> Span {
        self.script(&["kill", name]).await
    }

    /// `deploy/cluster.sh pause NAME`: SIGSTOP, a hung process.
    pub async fn pause(&self, name: &str) -> Span {
        self.script(&["pause", name]).await
    }

    /// `deploy/cluster.sh resume NAME`: SIGCONT.
    pub async fn resume(&self, name: &str) -> Span {
        self.script(&["resume", name]).await
    }

    /// The value of the metric line starting with `series` (name and
    /// labels, as rendered) on process `name`, or None when it has none
    /// (or does not answer).
    pub async fn metric(&self, name: &str, series: &str) -> Option<f64> {
        let url = format!("http://{}/metrics", self.metrics[name]);
        let text = self.http.get(url).send().await.ok()?.text().await.ok()?;
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
    }

    /// `deploy/cluster.sh start NAME`: on its address again, returning once
    /// it listens (a gateway: once `/readyz` answers 200).
    pub async fn start(&self, name: &str) -> Span {
        self.script(&["start", name]).await
    }

    async fn script(&self, args: &[&str]) -> Span {
        let began = Instant::now();
        let output = tokio::process::Command::new(self.root.join("deploy/cluster.sh"))
            .args(args)
            .current_dir(&self.root)
            .output()
            .await
            .unwrap();
        assert!(
            output.status.success(),
            "deploy/cluster.sh {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        Span {
            began,
            done: Instant::now(),
        }
    }

    /// Everything process `name` logged so far.
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.logs.join(format!("{name}.log"))).unwrap_or_default()
    }
}

/// How one chat request went, as its client saw it.
#[derive(Debug, Clone)]
pub struct Reply {
    pub sent: Instant,
    /// When the status and headers arrived (the request was admitted, or
    /// refused, before that).
    pub answered: Option<Instant>,
    /// None: no answer at all (connection refused or dropped).
    pub status: Option<u16>,
    /// `CF-RAY`: the request id billing records.
    pub request_id: Option<String>,
    /// The whole body arrived (a stream: up to `data: [DONE]`, no in-band
    /// error).
    pub complete: bool,
    /// `cost.usd` of a whole answer, in nano-dollars.
    pub cost: Option<i64>,
    /// The error message of a refusal, or what went wrong on the wire.
    pub error: Option<String>,
    /// When the answer was read to its end, or failed.
    pub finished: Instant,
}

impl Reply {
    pub fn ok(&self) -> bool {
        self.status == Some(200) && self.complete
    }
}

/// Sends one chat request to `url` and reads its answer to the end.
pub async fn chat(http: &reqwest::Client, url: &str, key: &str, body: &Value) -> Reply {
    let sent = Instant::now();
    let mut reply = Reply {
        sent,
        answered: None,
        status: None,
        request_id: None,
        complete: false,
        cost: None,
        error: None,
        finished: sent,
    };
    let response = match http.post(url).bearer_auth(key).json(body).send().await {
        Ok(response) => response,
        Err(error) => {
            reply.error = Some(format!("{error:?}"));
            reply.finished = Instant::now();
            return reply;
        }
    };
    reply.answered = Some(Instant::now());
    reply.status = Some(response.status().as_u16());
    reply.request_id = response
        .headers()
        .get("cf-ray")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let streamed = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let text = match response.text().await {
        Ok(text) => text,
        Err(error) => {
            reply.error = Some(format!("body cut: {error:?}"));
            reply.finished = Instant::now();
            return reply;
        }
    };
    if streamed {
        let events = sse_events(&text);
        let chunks: Vec<Value> = events
            .iter()
            .filter(|e| *e != "[DONE]")
            .filter_map(|e| serde_json::from_str(e).ok())
            .collect();
        let failed = chunks.iter().find(|c| c.get("error").is_some());
        reply.complete = events.last().is_some_and(|e| e == "[DONE]") && failed.is_none();
        if let Some(failed) = failed {
            reply.error = Some(failed["error"].to_string());
        }
        reply.cost = chunks
            .iter()
            .find_map(|c| c.get("cost"))
            .map(|cost| nanos(&cost["usd"]));
    } else {
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        reply.complete = true;
        if reply.status == Some(200) {
            reply.cost = body.get("cost").map(|cost| nanos(&cost["usd"]));
        } else {
            reply.error = Some(body["error"].as_str().unwrap_or(&text).to_owned());
        }
    }
    reply.finished = Instant::now();
    reply
}

/// The `data:` payloads of a server-sent event stream.
pub fn sse_events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

/// An exact decimal amount (a JSON number or string, written digit for
/// digit) in nano-units.
pub fn nanos(value: &Value) -> i64 {
    let text = value.to_string();
    let text = text.trim_matches('"');
    let (mantissa, exponent) = match text.split_once(['e', 'E']) {
        Some((mantissa, exponent)) => (mantissa, exponent.parse::<i32>().unwrap()),
        None => (text, 0),
    };
    let negative = mantissa.starts_with('-');
    let digits = mantissa.trim_start_matches(['-', '+']);
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    let number: i128 = format!("{whole}{fraction}")
        .parse()
        .unwrap_or_else(|_| panic!("{text} is not a decimal number"));
    let scale = exponent + 9 - i32::try_from(fraction.len()).unwrap();
    let magnitude = if scale >= 0 {
        number * 10i128.pow(scale.unsigned_abs())
    } else {
        let divisor = 10i128.pow(scale.unsigned_abs());
        assert_eq!(number % divisor, 0, "{text} is finer than a nano-unit");
        number / divisor
    };
    i64::try_from(if negative { -magnitude } else { magnitude }).unwrap()
}

/// Polls `condition` every 20 ms until it holds; panics with `what` after
/// `limit`. Returns how long it took.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut condition: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if condition().await {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_to_nanos() {
        for (text, expected) in [
            ("0.000022", 22_000),
            ("-0.001002", -1_002_000),
            ("1", 1_000_000_000),
            ("0", 0),
            ("2.2e-5", 22_000),
            ("\"10.00\"", 10_000_000_000),
        ] {
            let value: Value = serde_json::from_str(text).unwrap();
            assert_eq!(nanos(&value), expected, "{text}");
        }
    }
}
