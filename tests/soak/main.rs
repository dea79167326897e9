//! The abuse soak (issue 16): the real binary (one process, SQLite, its
//! default limits) serves a steady stream of valid priced requests while,
//! for `RIALTO_SOAK_SECS` (60 by default), the same machine throws at it
//! 10,000 idle connections, slowloris heads, oversized bodies, streams
//! nobody reads, sign-ins from ever new wallets, file bombs and bodies of
//! garbage. Checked at the end:
//!
//! - no answer to anyone is a 5xx, and the process is alive;
//! - every valid request is answered 200, and their p99 stays under
//!   [`STALL`] (`make bench` runs this test on the release build and
//!   reports the p99 alone and under abuse);
//! - the process's resident memory stays under [`RSS_BOUND_MB`];
//! - nothing is charged wrongly: the valid account paid exactly its
//!   responses' usage, and every ledger row equals the sums of its journal.
//!
//! It takes a minute and wants both cores, so it runs alone, after the
//! other tests: `make test` runs it as `make test-soak` (with
//! `RIALTO_SOAK=1`); without that variable it passes at once.

// Test code: a failed unwrap is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use alloy_signer_local::PrivateKeySigner;
use futures_util::FutureExt as _;
use futures_util::future::join_all;
use reqwest::Method;
use rialto_test_kit::{MockUpstream, Sandbox, Topology, documents};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[allow(dead_code)]
#[path = "../e2e/sign_in.rs"]
mod sign_in;

/// Connections opened and left silent at once.
const IDLE_CONNECTIONS: usize = 10_000;
/// Connections sending their head a byte at a time.
const SLOWLORIS: usize = 100;
/// Streams opened and never read.
const SLOW_READERS: usize = 16;
/// Valid requests per second, before and during the abuse.
const VALID_PER_SEC: u64 = 50;
/// How long the valid load runs alone first.
const BASELINE: Duration = Duration::from_secs(10);
/// The most resident memory the process may use at any moment. Measured:
/// ~65 MB alone (release; ~90 MB debug), ~285 MB (release; ~305 MB debug)
/// at the peak of the abuse, nearly all of it the 10,000 idle connections:
/// ~22 KB each (actix-http's 8 KiB read and write buffers and the
/// connection's state), which `gateway.max_connections` bounds.
const RSS_BOUND_MB: u64 = 400;
/// The valid requests' p99 under abuse must stay under this on the debug
/// build `make test` runs. Issue 16's bar, within 2× of the p99 alone, is a
/// latency figure: `make bench` measures it on the release build
/// (BENCHMARKS.md). Here a stall is what fails: a request that waited for a
/// SYN retry (a second; what a listen backlog of 128 did) or for a worker
/// that something blocked.
const STALL: Duration = Duration::from_millis(250);

/// `paid-chat` costs $1 per million tokens: a response's usage, in tokens,
/// is what it costs in micro-dollars. `abuse-chat` costs the same, reads
/// files, and has a mock upstream of its own, so that what the abusers
/// make the mock do (build 16 long streams) does not stand in the valid
/// requests' way there.
fn config(mock_url: &str, abuse_mock_url: &str) -> String {
    format!(
        r#"
[[models]]
id = "paid-chat"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]

[[models]]
id = "abuse-chat"
capabilities = ["files"]
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
backends = [{{ kind = "openai", url = "{abuse_mock_url}", model = "mock-model" }}]

[limits.tiers.standard.XS]
rpm = 100000
tpm = 1000000000

[wallet]
domains = ["127.0.0.1:8080"]

[x402]
facilitator_url = "http://127.0.0.1:9"
pay_to_evm = "0x2222222222222222222222222222222222222222"
min_usd = "5"
max_usd = "10000"
"#
    )
}

/// Statuses (or failures) seen, per kind of traffic.
#[derive(Default)]
struct Tally(Mutex<BTreeMap<&'static str, BTreeMap<String, u64>>>);

impl Tally {
    fn count(&self, kind: &'static str, outcome: impl ToString) {
        let mut tally = self.0.lock().unwrap();
        *tally
            .entry(kind)
            .or_default()
            .entry(outcome.to_string())
            .or_default() += 1;
    }

    /// Every 5xx answered to anyone.
    fn server_errors(&self) -> Vec<String> {
        let tally = self.0.lock().unwrap();
        tally
            .iter()
            .flat_map(|(kind, outcomes)| {
                outcomes
                    .iter()
                    .filter(|(outcome, _)| outcome.starts_with('5'))
                    .map(move |(outcome, n)| format!("{kind}: {n} × {outcome}"))
            })
            .collect()
    }
}

/// What the abusers share.
struct Target {
    /// `127.0.0.1:<port>` of the gateway.
    addr: String,
    chat_url: String,
    /// INFERENCE keys of funded accounts, one per kind of abuse (the abuse
    /// guard blocks each on its own failures).
    keys: BTreeMap<&'static str, String>,
    until: Instant,
    tally: Tally,
    client: reqwest::Client,
}

impl Target {
    fn over(&self) -> bool {
        Instant::now() >= self.until
    }

    fn key(&self, abuser: &str) -> &str {
        &self.keys[abuser]
    }

    /// A chat request (`request` adds its credentials and body), its
    /// status counted under `kind`, or `failure` when it could not be sent
    /// or answered; the response, when there is one.
    async fn post(
        &self,
        kind: &'static str,
        failure: &'static str,
        request: impl FnOnce(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> Option<reqwest::Response> {
        match request(self.client.post(&self.chat_url)).send().await {
            Ok(response) => {
                self.tally.count(kind, response.status().as_u16());
                Some(response)
            }
            Err(_) => {
                self.tally.count(kind, failure);
                None
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak() {
    if std::env::var("RIALTO_SOAK").as_deref() != Ok("1") {
        println!("skipped: set RIALTO_SOAK=1 (make test-soak)");
        return;
    }
    let secs: u64 = std::env::var("RIALTO_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let mock = MockUpstream::start().await.unwrap();
    let abuse_mock = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(Topology::OneProcess)
        .config(&config(&mock.base_url(), &abuse_mock.base_url()))
        .start()
        .await
        .unwrap();
    let pid = sandbox.pid("all").unwrap();
    let valid = sandbox
        .create_unfunded_account("valid", "standard")
        .await
        .unwrap();
    sandbox.credit(&valid.id, "1000", "seed").await.unwrap();
    let (_, valid_key) = sandbox
        .create_key(&valid.admin_key, "INFERENCE")
        .await
        .unwrap();
    let mut keys = BTreeMap::new();
    for abuser in ["oversized", "readers", "files", "garbage"] {
        let account = sandbox
            .create_unfunded_account(abuser, "standard")
            .await
            .unwrap();
        sandbox.credit(&account.id, "10", "seed").await.unwrap();
        let (_, key) = sandbox
            .create_key(&account.admin_key, "INFERENCE")
            .await
            .unwrap();
        keys.insert(abuser, key);
    }
    let chat_url = sandbox.api("/chat/completions");
    let addr = sandbox
        .url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();

    // 1. The valid load alone.
    let memory = Memory::watch(pid);
    let baseline = valid_load(&chat_url, &valid_key, Instant::now() + BASELINE).await;
    let rss_alone = memory.peak_mb();

    // 2. The same load under abuse.
    let started = Instant::now();
    let target = Arc::new(Target {
        addr,
        chat_url: chat_url.clone(),
        keys,
        until: started + Duration::from_secs(secs),
        tally: Tally::default(),
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap(),
    });
    // RIALTO_SOAK_ONLY=<name>[,<name>] runs only those abusers (to find
    // which one hurts).
    let only = std::env::var("RIALTO_SOAK_ONLY").unwrap_or_default();
    let wanted = |name: &str| only.is_empty() || only.split(',').any(|n| n == name);
    // The abusers run on a runtime of their own, on a thread of the lowest
    // priority: they stand for clients on other machines, so the valid
    // requests' latencies are not the abusers' own use of these two cores
    // (or their scheduling delays in this process), but what the server
    // does under their load.
    let abuse = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .on_thread_start(|| {
            // Linux applies nice per thread: this one only.
            let thread = rustix::thread::gettid();
            let _ = rustix::process::setpriority_process(Some(thread), 19);
        })
        .enable_all()
        .build()
        .unwrap();
    type Abuser = fn(Arc<Target>) -> futures_util::future::BoxFuture<'static, String>;
    let all: [(&str, Abuser); 7] = [
        ("idle", |t| idle_connections(t).boxed()),
        ("slowloris", |t| slowloris(t).boxed()),
        ("oversized", |t| oversized(t).boxed()),
        ("readers", |t| slow_readers(t).boxed()),
        ("wallets", |t| rotating_wallets(t).boxed()),
        ("files", |t| file_bombs(t).boxed()),
        ("garbage", |t| garbage(t).boxed()),
    ];
    let abusers: Vec<_> = all
        .into_iter()
        .filter(|(name, _)| wanted(name))
        .map(|(_, abuser)| abuse.spawn(abuser(target.clone())))
        .collect();
    let loaded = valid_load(&chat_url, &valid_key, target.until).await;
    let mut reports = Vec::new();
    for abuser in abusers {
        reports.push(abuser.await.unwrap());
    }
    abuse.shutdown_background();
    let rss_peak = memory.peak_mb();

    // 3. What it shows.
    let (p50_alone, p99_alone) = percentiles(&baseline);
    let (p50_loaded, p99_loaded) = percentiles(&loaded);
    println!(
        "soak: {secs} s; valid load {VALID_PER_SEC}/s: alone p50 {p50_alone:?} p99 \
         {p99_alone:?} ({} requests); under abuse p50 {p50_loaded:?} p99 {p99_loaded:?} ({} \
         requests); RSS alone {rss_alone} MB, peak {rss_peak} MB (bound {RSS_BOUND_MB} MB)",
        baseline.len(),
        loaded.len()
    );
    let mut slowest: Vec<_> = loaded.iter().collect();
    slowest.sort_by_key(|s| std::cmp::Reverse(s.latency));
    for sample in slowest.iter().take(5) {
        println!(
            "soak: slow valid request at {:?}: {:?}",
            sample.sent.duration_since(started),
            sample.latency
        );
    }
    for report in &reports {
        println!("soak: {report}");
    }
    for (kind, outcomes) in target.tally.0.lock().unwrap().iter() {
        println!("soak: {kind}: {outcomes:?}");
    }
    let logs = sandbox.logs();
    let warnings: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .collect();
    println!("soak: {} warnings or errors logged", warnings.len());
    for line in warnings.iter().take(20) {
        println!("soak: {line}");
    }

    // For `make bench` (bench/run.py's soak step), written before any
    // assertion can stop the test.
    if let Ok(path) = std::env::var("RIALTO_SOAK_JSON") {
        let tally: BTreeMap<_, _> = target.tally.0.lock().unwrap().clone();
        let figures = json!({
            "secs": secs,
            "valid_per_sec": VALID_PER_SEC,
            "idle_connections": IDLE_CONNECTIONS,
            "slowloris": SLOWLORIS,
            "slow_readers": SLOW_READERS,
            "alone": {"requests": baseline.len(), "p50_us": p50_alone.as_micros() as u64,
                "p99_us": p99_alone.as_micros() as u64},
            "abused": {"requests": loaded.len(), "p50_us": p50_loaded.as_micros() as u64,
                "p99_us": p99_loaded.as_micros() as u64},
            "rss_alone_mb": rss_alone,
            "rss_peak_mb": rss_peak,
            "rss_bound_mb": RSS_BOUND_MB,
            "reports": reports,
            "outcomes": tally,
        });
        std::fs::write(path, figures.to_string()).unwrap();
    }
    let errors = target.tally.server_errors();
    assert!(errors.is_empty(), "5xx answers: {errors:?}");
    for sample in baseline.iter().chain(&loaded) {
        assert_eq!(sample.status, 200, "a valid request was refused");
    }
    assert!(
        p99_loaded < STALL,
        "valid p99 {p99_loaded:?} under abuse, {p99_alone:?} alone"
    );
    assert!(rss_peak <= RSS_BOUND_MB, "RSS {rss_peak} MB");

    // 4. Alive, and nothing charged wrongly.
    // (With a key: the abuse guard blocks this address's anonymous requests
    // for a while after the wallets' failures.)
    let models = sandbox
        .call(Method::GET, "/models", &valid.admin_key, None)
        .await;
    assert_eq!(models.unwrap().status(), 200, "the process is gone");
    let used: u64 = baseline.iter().chain(&loaded).map(|s| s.tokens).sum();
    let balance = sandbox
        .call(Method::GET, "/billing/balance", &valid.admin_key, None)
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap();
    let usd = balance["balances"]["usd"].as_f64().unwrap();
    let expected = 1000.0 - used as f64 / 1e6;
    assert!(
        (usd - expected).abs() < 1e-7,
        "valid account: {usd}, its responses' usage says {expected}"
    );
    // The streams nobody read end within a lease; then every ledger row is
    // its journal's sums.
    reconcile(&sandbox).await;
}

/// One valid request's outcome.
struct Sample {
    sent: Instant,
    latency: Duration,
    status: u16,
    /// Prompt and completion tokens its usage reported (its micro-dollars).
    tokens: u64,
}

/// Valid priced requests at [`VALID_PER_SEC`], each on its own, until
/// `until`: open loop (a slow answer does not slow the next request).
async fn valid_load(chat_url: &str, key: &str, until: Instant) -> Vec<Sample> {
    // The gateway closes a connection idle for 5 s (actix-web's keep-alive):
    // a pooled one kept longer may be reused just as it closes, and the
    // request fails on the wire (hyper's IncompleteMessage), a race of the
    // client's, not a refusal. Idle connections are dropped well before.
    let client = reqwest::Client::builder()
        .pool_idle_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let body = json!({"model": "paid-chat", "max_tokens": 10, "mock": {"words": 10},
        "messages": [{"role": "user", "content": "hello there"}]});
    let mut ticker = tokio::time::interval(Duration::from_micros(1_000_000 / VALID_PER_SEC));
    let mut requests = Vec::new();
    while Instant::now() < until {
        ticker.tick().await;
        let request = client.post(chat_url).bearer_auth(key).json(&body);
        requests.push(tokio::spawn(async move {
            let started = Instant::now();
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap_or_default();
            Sample {
                sent: started,
                latency: started.elapsed(),
                status,
                tokens: body["usage"]["total_tokens"].as_u64().unwrap_or(0),
            }
        }));
    }
    let mut samples = Vec::new();
    for request in requests {
        samples.push(request.await.unwrap());
    }
    samples
}

fn percentiles(samples: &[Sample]) -> (Duration, Duration) {
    let mut latencies: Vec<_> = samples.iter().map(|s| s.latency).collect();
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// The process's resident memory, sampled every 100 ms.
struct Memory {
    peak_kb: Arc<std::sync::atomic::AtomicU64>,
}

impl Memory {
    fn watch(pid: u32) -> Self {
        let peak_kb = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let peak = peak_kb.clone();
        tokio::spawn(async move {
            loop {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status"));
                let Ok(status) = status else { return };
                let rss = status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                    .unwrap_or(0);
                peak.fetch_max(rss, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Self { peak_kb }
    }

    fn peak_mb(&self) -> u64 {
        self.peak_kb.load(Ordering::Relaxed) / 1024
    }
}

/// The status line's code of a raw HTTP answer, or what ended it.
async fn answer(stream: &mut TcpStream) -> String {
    let mut buffer = [0u8; 512];
    match stream.read(&mut buffer).await {
        Ok(0) => "closed".to_owned(),
        Ok(n) => String::from_utf8_lossy(&buffer[..n])
            .split(' ')
            .nth(1)
            .unwrap_or("garbled")
            .to_owned(),
        Err(_) => "reset".to_owned(),
    }
}

/// [`IDLE_CONNECTIONS`] connections that send nothing, opened over 5 s and
/// opened again whenever the server cuts one (at its request-head timeout).
async fn idle_connections(target: Arc<Target>) -> String {
    let open = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let tasks = (0..IDLE_CONNECTIONS).map(|i| {
        let (target, open, peak) = (target.clone(), open.clone(), peak.clone());
        tokio::spawn(async move {
            let delay = Duration::from_micros(i as u64 * 5_000_000 / IDLE_CONNECTIONS as u64);
            tokio::time::sleep(delay).await;
            while !target.over() {
                let Ok(mut stream) = TcpStream::connect(&target.addr).await else {
                    target.tally.count("idle", "connect failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let now = open.fetch_add(1, Ordering::Relaxed) + 1;
                peak.fetch_max(now, Ordering::Relaxed);
                let until = tokio::time::Instant::from_std(target.until);
                tokio::select! {
                    outcome = answer(&mut stream) => target.tally.count("idle", outcome),
                    () = tokio::time::sleep_until(until) => {}
                }
                open.fetch_sub(1, Ordering::Relaxed);
            }
        })
    });
    join_all(tasks).await;
    format!(
        "idle connections: {} open at the peak",
        peak.load(Ordering::Relaxed)
    )
}

/// [`SLOWLORIS`] connections sending a request head one byte every 500 ms.
async fn slowloris(target: Arc<Target>) -> String {
    let longest = Arc::new(Mutex::new(Duration::ZERO));
    let tasks = (0..SLOWLORIS).map(|_| {
        let (target, longest) = (target.clone(), longest.clone());
        tokio::spawn(async move {
            while !target.over() {
                let Ok(mut stream) = TcpStream::connect(&target.addr).await else {
                    target.tally.count("slowloris", "connect failed");
                    continue;
                };
                let started = Instant::now();
                let head = b"POST /api/v1/chat/completions HTTP/1.1\r\nHost: soak\r\nX-Slow: ";
                if stream.write_all(head).await.is_err() {
                    continue;
                }
                let outcome = loop {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if target.over() {
                        break None;
                    }
                    if stream.write_all(b"a").await.is_err() {
                        break Some("closed".to_owned());
                    }
                    let mut buffer = [0u8; 512];
                    match tokio::time::timeout(Duration::ZERO, stream.peek(&mut buffer)).await {
                        Ok(Ok(_)) | Ok(Err(_)) => break Some(answer(&mut stream).await),
                        Err(_) => {}
                    }
                };
                if let Some(outcome) = outcome {
                    target.tally.count("slowloris", outcome);
                    let mut longest = longest.lock().unwrap();
                    *longest = (*longest).max(started.elapsed());
                }
            }
        })
    });
    join_all(tasks).await;
    format!(
        "slowloris: the longest head lived {:?}",
        *longest.lock().unwrap()
    )
}

/// Five bodies a second announced at 100 MB, and one real 21 MB body every
/// second: 413, and the real one is not read to its end.
async fn oversized(target: Arc<Target>) -> String {
    let big = vec![b' '; 21 * 1024 * 1024];
    let mut round = 0u64;
    while !target.over() {
        round += 1;
        if round.is_multiple_of(5) {
            // Not sent to its end: the server answered 413 and closed.
            let body = big.clone();
            target
                .post("oversized body", "cut off", |request| {
                    request
                        .bearer_auth(target.key("oversized"))
                        .header("content-type", "application/json")
                        .body(body)
                })
                .await;
        } else if let Ok(mut stream) = TcpStream::connect(&target.addr).await {
            let head = format!(
                "POST /api/v1/chat/completions HTTP/1.1\r\nHost: soak\r\nAuthorization: Bearer \
                 {}\r\nContent-Type: application/json\r\nContent-Length: 104857600\r\n\r\n{{",
                target.key("oversized")
            );
            let _ = stream.write_all(head.as_bytes()).await;
            let outcome = answer(&mut stream).await;
            target.tally.count("announced 100 MB", outcome);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    "oversized: done".to_owned()
}

/// [`SLOW_READERS`] streams at a time, each opened, its head read, then
/// left unread for 20 s before it is dropped.
async fn slow_readers(target: Arc<Target>) -> String {
    // A minute of words, one every 20 ms.
    let body = json!({"model": "abuse-chat", "stream": true, "max_tokens": 3000,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 3000, "chunk_delay_ms": 20}});
    let tasks = (0..SLOW_READERS).map(|_| {
        let (target, body) = (target.clone(), body.clone());
        tokio::spawn(async move {
            while !target.over() {
                let sent = target
                    .post("slow reader", "failed", |request| {
                        request.bearer_auth(target.key("readers")).json(&body)
                    })
                    .await;
                match sent {
                    Some(response) => {
                        let until = tokio::time::Instant::from_std(target.until);
                        let later = tokio::time::Instant::now() + Duration::from_secs(20);
                        tokio::time::sleep_until(until.min(later)).await;
                        drop(response);
                    }
                    None => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        })
    });
    join_all(tasks).await;
    "slow readers: done".to_owned()
}

/// Five sign-ins a second, each from a wallet never seen before, with no
/// balance: 402 with the top-up instructions, or 429 once the abuse guard
/// counts this address's failures.
async fn rotating_wallets(target: Arc<Target>) -> String {
    let body = json!({"model": "abuse-chat", "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}]});
    let mut wallets = 0;
    while !target.over() {
        let wallet = PrivateKeySigner::random();
        let header = sign_in::sign_in(&wallet, &sign_in::fresh_nonce(), 0, "127.0.0.1:8080");
        wallets += 1;
        target
            .post("new wallet", "failed", |request| {
                request.header("SIGN-IN-WITH-X", header).json(&body)
            })
            .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    format!("rotating wallets: {wallets} wallets")
}

/// One file bomb a second, in turn: a PDF nested 5,000 deep, a sheet whose
/// two cells span 17 billion, and a DOCX that inflates to 64 MB of text.
async fn file_bombs(target: Arc<Target>) -> String {
    use base64::Engine as _;
    let text = "a".repeat(64 * 1024 * 1024);
    let bombs = [
        ("nested.pdf", documents::nested_pdf(5_000)),
        ("wide.xlsx", documents::far_apart_cells()),
        (
            "inflating.docx",
            documents::archive(&[("word/document.xml", text.as_str())]),
        ),
    ];
    drop(text);
    let bodies: Vec<Value> = bombs
        .iter()
        .map(|(name, bytes)| {
            let data = base64::engine::general_purpose::STANDARD.encode(bytes);
            json!({"model": "abuse-chat", "max_tokens": 10, "messages": [{"role": "user",
                "content": [{"type": "text", "text": "summarize"},
                    {"type": "file", "file": {"filename": name, "file_data": data}}]}]})
        })
        .collect();
    let mut sent_count = 0;
    while !target.over() {
        let body = &bodies[sent_count % bodies.len()];
        sent_count += 1;
        target
            .post("file bomb", "failed", |request| {
                request.bearer_auth(target.key("files")).json(body)
            })
            .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    format!("file bombs: {sent_count} sent")
}

/// Ten bodies of garbage a second, under a JSON content type.
async fn garbage(target: Arc<Target>) -> String {
    let mut round = 0u64;
    while !target.over() {
        round += 1;
        let bytes: Vec<u8> = (0..256)
            .map(|i| (round.wrapping_mul(2_654_435_761).wrapping_add(i) >> 3) as u8)
            .collect();
        target
            .post("garbage", "failed", |request| {
                request
                    .bearer_auth(target.key("garbage"))
                    .header("content-type", "application/json")
                    .body(bytes)
            })
            .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    "garbage: done".to_owned()
}

/// Once no hold is open (the unread streams ended), every owner's ledger
/// row equals the sums of its journal.
async fn reconcile(sandbox: &Sandbox) {
    use sqlx::Row;
    let pool = sqlx::SqlitePool::connect(sandbox.database_url())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let held: i64 = sqlx::query("SELECT COALESCE(SUM(usd_held_nanos), 0) FROM ledgers")
            .fetch_one(&pool)
            .await
            .unwrap()
            .get(0);
        if held == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "holds still open: {held}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The writer commits behind the answers: give it a moment.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rows = sqlx::query(
        "SELECT l.owner, l.usd_nanos, l.diem_nanos, l.owed_nanos, \
         (SELECT COALESCE(SUM(usd_nanos), 0) FROM ledger_journal j WHERE j.owner = l.owner), \
         (SELECT COALESCE(SUM(diem_nanos), 0) FROM ledger_journal j WHERE j.owner = l.owner), \
         (SELECT COALESCE(SUM(owed_nanos), 0) FROM ledger_journal j WHERE j.owner = l.owner) \
         FROM ledgers l",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    for row in rows {
        let owner: String = row.get(0);
        let ledger: [i64; 3] = [row.get(1), row.get(2), row.get(3)];
        let journal: [i64; 3] = [row.get(4), row.get(5), row.get(6)];
        assert_eq!(ledger, journal, "{owner}: ledger row against its journal");
    }
    pool.close().await;
}
