//! Crash safety of the metered path: 10,000 priced requests (plain and
//! streamed) against one `rialto serve`, SIGKILLed at three moments of the
//! run and started again each time; then the ledger is reconciled with
//! what every client saw:
//! - every 200 the client received in full is charged exactly once, with
//!   the `cost` it reported;
//! - a stream the kill cut is charged at most what a whole stream costs
//!   and at least its last durable checkpoint;
//! - a plain request that got no answer is charged nothing or exactly
//!   what an answer costs (its settlement may have been durable just
//!   before the kill), never more;
//! - the journal equals the balances, and the usage records equal the
//!   charges.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::StreamExt;
use rialto_test_kit::{MockUpstream, Sandbox, Topology};
use serde_json::{Value, json};
use sqlx::Row;
use tokio::sync::Mutex;

use crate::support::models_toml;

const REQUESTS: usize = 10_000;
const CLIENTS: usize = 16;

/// What one request's client saw.
#[derive(Debug)]
enum Seen {
    /// A whole answer and its `cost` (nano-USD).
    Answered { request_id: String, cost: i64 },
    /// A stream cut before its `[DONE]`.
    Cut { request_id: String },
    /// No answer at all (the process was down, or died before answering).
    Failed,
}

fn nanos(cost: &Value) -> i64 {
    rialto_billing::parse_amount("cost", &cost.to_string()).unwrap()
}

async fn one_request(http: &reqwest::Client, url: &str, key: &str, index: usize) -> Seen {
    let stream = index.is_multiple_of(10);
    let body = json!({
        "model": "mock-chat",
        "stream": stream,
        "messages": [{"role": "user", "content": format!("request {index}")}],
        "mock": {"reply": "one two three four five six seven eight", "chunk_delay_ms": 40},
    });
    let response = match http
        .post(format!("{url}/api/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
    {
        Ok(response) if response.status() == 200 => response,
        Ok(response) => panic!("request {index}: {}", response.status()),
        Err(_) => return Seen::Failed,
    };
    if !stream {
        return match response.json::<Value>().await {
            Ok(body) => Seen::Answered {
                request_id: body["id"]
                    .as_str()
                    .unwrap()
                    .trim_start_matches("chatcmpl-")
                    .to_owned(),
                cost: nanos(&body["cost"]["usd"]),
            },
            Err(_) => Seen::Failed,
        };
    }
    let mut text = String::new();
    let mut chunks = response.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        match chunk {
            Ok(bytes) => text.push_str(&String::from_utf8_lossy(&bytes)),
            Err(_) => break,
        }
    }
    let events: Vec<Value> = text
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str(data).ok())
        .collect();
    let Some(request_id) = events
        .iter()
        .find_map(|e| e["id"].as_str())
        .map(|id| id.trim_start_matches("chatcmpl-").to_owned())
    else {
        return Seen::Failed;
    };
    match events.iter().find(|e| e.get("cost").is_some()) {
        Some(last) if text.trim_end().ends_with("data: [DONE]") => Seen::Answered {
            request_id,
            cost: nanos(&last["cost"]["usd"]),
        },
        _ => Seen::Cut { request_id },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_priced_requests_survive_three_kills() {
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(Topology::OneProcess)
        .config(&format!(
            "{}\n[limits.tiers.standard]\nXS = {{ rpm = 1000000000, tpm = 1000000000000 }}\n",
            models_toml(&mock.base_url())
        ))
        .env("RIALTO_BILLING__STREAM_LEASE_SECS", "2")
        .env("RIALTO_BILLING__CHECKPOINT_MS", "100")
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("crashes").await.unwrap();
    let owner = rialto_billing::account_owner(&account.id);
    let (http, url, key) = (
        sandbox.http().clone(),
        sandbox.url.clone(),
        account.admin_key.clone(),
    );
    let database = sandbox.database_url().to_owned();
    let sandbox = Arc::new(Mutex::new(sandbox));

    let next = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (http, url, key, next) = (http.clone(), url.clone(), key.clone(), next.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    if index >= REQUESTS {
                        return seen;
                    }
                    let outcome = one_request(&http, &url, &key, index).await;
                    if matches!(outcome, Seen::Failed) {
                        // Down: don't burn through the run while it restarts.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    seen.push(outcome);
                }
            })
        })
        .collect();

    // Three kills at moments spread over the run (when 20-30 %, 50-60 % and
    // 75-85 % of the requests have started, the exact point drawn at random).
    let seed = u64::from(std::process::id()) ^ (chrono::Utc::now().timestamp_micros() as u64);
    for (round, (from, to)) in [(20, 30), (50, 60), (75, 85)].into_iter().enumerate() {
        let span = (to - from) * REQUESTS / 100;
        let at = from * REQUESTS / 100 + (seed.rotate_left(round as u32 * 13) as usize % span);
        while next.load(Ordering::Relaxed) < at {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut sandbox = sandbox.lock().await;
        sandbox.kill("all").unwrap();
        sandbox.restart("all").await.unwrap();
    }
    let mut seen = Vec::new();
    for client in clients {
        seen.extend(client.await.unwrap());
    }

    let pool = sqlx::SqlitePool::connect(&database).await.unwrap();
    // Cut streams are charged once their lease (2 s) ends: wait for it.
    let mut open = i64::MAX;
    for _ in 0..200 {
        open = sqlx::query("SELECT COUNT(*) FROM holds WHERE state = 'open'")
            .fetch_one(&pool)
            .await
            .unwrap()
            .get(0);
        if open == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(open, 0, "every durable hold was closed");
    // This test reads the database file itself; billing's readers first
    // commit what its ledger log holds, and so does this, by asking
    // billing for the usage history once.
    let flushed = {
        let sandbox = sandbox.lock().await;
        http.get(sandbox.api("/billing/usage"))
            .bearer_auth(&key)
            .send()
            .await
            .unwrap()
    };
    assert_eq!(flushed.status(), 200);

    let charged: HashMap<String, i64> = sqlx::query(
        "SELECT request_id, usd_nanos FROM ledger_journal WHERE idempotency_key LIKE 'settle:%'",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .iter()
    .map(|row| (row.get::<String, _>(0), -row.get::<i64, _>(1)))
    .collect();
    let checkpoints: HashMap<String, i64> =
        sqlx::query("SELECT request_id, checkpoint_nanos FROM holds")
            .fetch_all(&pool)
            .await
            .unwrap()
            .iter()
            .map(|row| (row.get::<String, _>(0), row.get::<i64, _>(1)))
            .collect();

    let (mut answered, mut cut, mut failed, mut charged_cut) = (0, 0, 0, 0);
    let mut whole_stream = 0;
    let mut whole_answer = 0;
    for outcome in &seen {
        if let Seen::Answered { request_id, cost } = outcome {
            answered += 1;
            assert_eq!(
                charged.get(request_id),
                Some(cost),
                "{request_id}: charged what it reported, once"
            );
            if checkpoints.contains_key(request_id) {
                whole_stream = whole_stream.max(*cost);
            } else {
                whole_answer = whole_answer.max(*cost);
            }
        }
    }
    for outcome in &seen {
        match outcome {
            Seen::Cut { request_id } => {
                cut += 1;
                let paid = charged.get(request_id).copied().unwrap_or(0);
                let checkpoint = checkpoints.get(request_id).copied().unwrap_or(0);
                charged_cut += usize::from(paid > 0);
                assert!(
                    paid >= checkpoint && paid <= whole_stream,
                    "{request_id}: paid {paid}, checkpoint {checkpoint}, a whole stream {whole_stream}"
                );
            }
            Seen::Failed => failed += 1,
            Seen::Answered { .. } => {}
        }
    }
    // Charges nobody saw: plain requests answered by a process that died
    // before the answer left, each at most an answer's cost.
    let reported: std::collections::HashSet<&str> = seen
        .iter()
        .filter_map(|o| match o {
            Seen::Answered { request_id, .. } | Seen::Cut { request_id } => {
                Some(request_id.as_str())
            }
            Seen::Failed => None,
        })
        .collect();
    let unseen: Vec<i64> = charged
        .iter()
        .filter(|(id, _)| !reported.contains(id.as_str()))
        .map(|(_, paid)| *paid)
        .collect();
    assert!(
        unseen.len() <= failed,
        "{} charges nobody saw, {failed} requests failed",
        unseen.len()
    );
    for paid in &unseen {
        assert!(
            *paid <= whole_answer.max(whole_stream),
            "an unseen charge of {paid}"
        );
    }
    assert!(
        answered > REQUESTS * 8 / 10,
        "{answered} answered of {REQUESTS}"
    );
    eprintln!(
        "answered {answered}, cut streams {cut} ({charged_cut} charged), failed {failed}, \
         charged unseen {}",
        unseen.len()
    );

    // The books balance: journal = balances, usage records = charges.
    let row = sqlx::query("SELECT usd_nanos, usd_held_nanos FROM ledgers WHERE owner = $1")
        .bind(&owner)
        .fetch_one(&pool)
        .await
        .unwrap();
    let (usd, held): (i64, i64) = (row.get(0), row.get(1));
    let journal = sqlx::query(
        "SELECT SUM(usd_nanos), SUM(usd_held_nanos) FROM ledger_journal WHERE owner = $1",
    )
    .bind(&owner)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (usd, held),
        (journal.get::<i64, _>(0), journal.get::<i64, _>(1))
    );
    assert_eq!(held, 0);
    let usage: i64 = sqlx::query(
        "SELECT COALESCE(SUM(amount_nanos), 0) FROM usage_records WHERE owner = $1 AND currency = 'USD'",
    )
    .bind(&owner)
    .fetch_one(&pool)
    .await
    .unwrap()
    .get(0);
    assert_eq!(usage, charged.values().sum::<i64>());
    let seed =
        rialto_billing::parse_amount("seed", rialto_test_kit::sandbox::SEED_CREDIT_USD).unwrap();
    assert_eq!(usd, seed - usage, "the balance moved by the charges alone");
    pool.close().await;
}
