//! The foundation's scenarios and the limiter's and billing's race tests,
//! against the running cluster through both gateways.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use reqwest::Method;
use rialto_test_kit::MockUpstream;
use serde_json::{Value, json};

use crate::client::{Cluster, chat, sse_events, wait_until};
use crate::support::assert_common_headers;
use crate::{CHAT_MODEL, LIMITED_MODEL, LIMITED_RPM, WINDOW};

/// An account (operator API), its credit, a key, plain and streamed chats
/// and the models list on each gateway, the balance and usage history they
/// leave, and a key deleted on one gateway refused on the other.
pub async fn foundation(cluster: &Cluster, mock: &MockUpstream) {
    let account = cluster.create_account(0, "foundation").await;
    // Credited through the other gateway, once per reference.
    let credited = cluster.credit(1, &account.id, "1", "foundation-seed").await;
    assert_eq!(credited["applied"], true, "{credited}");
    assert_eq!(credited["balance"]["usd"], "1", "{credited}");
    let again = cluster.credit(0, &account.id, "1", "foundation-seed").await;
    assert_eq!(again["applied"], false, "{again}");
    let (key_id, key) = cluster.create_key(1, &account.admin_key, "INFERENCE").await;
    mock.clear_requests();

    let mut charged = HashMap::new();
    for gateway in 0..2 {
        // The models list.
        let response = cluster
            .call(gateway, Method::GET, "/models", &key, None)
            .await;
        assert_eq!(response.status(), 200);
        assert_common_headers(&response);
        let models: Value = response.json().await.unwrap();
        let ids: Vec<&str> = models["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["id"].as_str())
            .collect();
        assert_eq!(ids, [CHAT_MODEL, LIMITED_MODEL], "{models}");
        assert_eq!(models["data"][0]["model_spec"]["name"], "Cluster Chat");

        // A plain chat: 2 prompt words and 5 answered, a micro-dollar each.
        let body = json!({"model": CHAT_MODEL,
            "messages": [{"role": "user", "content": "hello there"}]});
        let response = cluster
            .call(
                gateway,
                Method::POST,
                "/chat/completions",
                &key,
                Some(&body),
            )
            .await;
        assert_eq!(response.status(), 200, "plain chat on gateway-{gateway}");
        assert_common_headers(&response);
        let headers = response.headers().clone();
        assert_eq!(headers["x-rialto-model-id"], CHAT_MODEL);
        assert_eq!(headers["x-rialto-model-name"], "Cluster Chat");
        assert_eq!(headers["x-rialto-model-router"], "cluster-chat/0");
        assert_eq!(headers["x-ratelimit-type"], "api_key");
        let ray = headers["cf-ray"].to_str().unwrap().to_owned();
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["id"], format!("chatcmpl-{ray}"));
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(
            body["choices"][0]["message"]["content"],
            "Hello from mock: hello there"
        );
        assert_eq!(
            body["usage"],
            json!({"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7})
        );
        assert_eq!(body["cost"].to_string(), r#"{"diem":0,"usd":0.000007}"#);
        charged.insert(ray, 7_000);

        // A streamed chat: usage and cost once, in the last chunk.
        let body = json!({"model": CHAT_MODEL, "stream": true,
            "messages": [{"role": "user", "content": "stream this please"}]});
        let response = cluster
            .call(
                gateway,
                Method::POST,
                "/chat/completions",
                &key,
                Some(&body),
            )
            .await;
        assert_eq!(response.status(), 200, "streamed chat on gateway-{gateway}");
        assert_common_headers(&response);
        assert!(
            response.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        let ray = response.headers()["cf-ray"].to_str().unwrap().to_owned();
        let events = sse_events(&response.text().await.unwrap());
        assert_eq!(events.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text.trim(), "Hello from mock: stream this please");
        assert!(
            chunks
                .iter()
                .all(|c| c["id"] == format!("chatcmpl-{ray}").as_str())
        );
        let last = chunks.last().unwrap();
        assert_eq!(last["usage"]["prompt_tokens"], 3);
        assert_eq!(last["usage"]["completion_tokens"], 6);
        assert_eq!(last["cost"].to_string(), r#"{"diem":0,"usd":0.000009}"#);
        assert_eq!(
            chunks.iter().filter(|c| c.get("usage").is_some()).count(),
            1
        );
        charged.insert(ray, 9_000);
    }
    // The upstream got its own model name and never a key.
    assert_eq!(mock.request_count(), 4);
    assert!(mock.requests().iter().all(|r| r["model"] == "mock-model"));
    assert!(mock.authorization_headers().iter().all(Option::is_none));

    // Each gateway sees the same ledger: the balance and the history.
    // (Both read before either is checked: a miss then says which request
    // each of them lacks.)
    for gateway in 0..2 {
        let balance = cluster.balance(gateway, &account.admin_key).await;
        let usage = cluster.usage(gateway, &account.admin_key).await;
        let seen = format!("through gateway-{gateway}: usage {usage:?}, charged {charged:?}");
        assert_eq!(balance, 1_000_000_000 - 2 * (7_000 + 9_000), "{seen}");
        assert_eq!(usage.len(), 4, "{seen}");
        assert_eq!(usage.into_iter().collect::<HashMap<_, _>>(), charged);
    }

    // A key deleted through one gateway is refused by the other.
    let path = format!("/api_keys?id={key_id}");
    let deleted = cluster
        .call(0, Method::DELETE, &path, &account.admin_key, None)
        .await;
    assert_eq!(deleted.status(), 200);
    let body = json!({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let refused_in = wait_until(
        "the deleted key refused by gateway-1",
        Duration::from_secs(2),
        || async {
            let response = cluster
                .call(1, Method::POST, "/chat/completions", &key, Some(&body))
                .await;
            assert!(matches!(response.status().as_u16(), 200 | 401));
            response.status() == 401
        },
    )
    .await;
    println!("cluster: foundation scenarios passed (deleted key refused after {refused_in:?})");
}

/// Two keys (one per limiter replica) each race 60 requests over both
/// gateways at once: exactly the limit of each is admitted, every refusal
/// is a well-formed 429, and no refused request reaches the backend.
pub async fn limiter_race(cluster: &Cluster, mock: &MockUpstream) {
    const RACERS: usize = 60;
    let account = cluster.create_account(0, "limiter-race").await;
    cluster.credit(0, &account.id, "10", "seed").await;
    let keys = [
        cluster.key_owned_by(&account.admin_key, 0).await.1,
        cluster.key_owned_by(&account.admin_key, 1).await.1,
    ];
    let body = json!({"model": LIMITED_MODEL, "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}]});
    let before = mock.request_count();
    let start = Instant::now();
    let urls = [0, 1].map(|gateway| cluster.api(gateway, "/chat/completions"));
    let requests = keys.iter().flat_map(|key| {
        let (urls, body) = (&urls, &body);
        (0..RACERS).map(move |i| {
            cluster
                .http
                .post(&urls[i % 2])
                .bearer_auth(key)
                .json(body)
                .send()
        })
    });
    let responses = join_all(requests).await;
    let elapsed = start.elapsed();
    assert!(
        elapsed < WINDOW,
        "the race took {elapsed:?}, longer than the {WINDOW:?} window: the machine is too slow to \
         say how many requests one window admits"
    );
    let mut admitted = [0, 0];
    for (i, response) in responses.into_iter().enumerate() {
        let response = response.unwrap();
        match response.status().as_u16() {
            200 => admitted[i / RACERS] += 1,
            429 => {
                let headers = response.headers();
                assert_eq!(headers["x-ratelimit-type"], "api_key");
                assert_eq!(headers["x-ratelimit-limit-requests"], "10");
                assert_eq!(headers["x-ratelimit-remaining-requests"], "0");
                assert!(headers.contains_key("retry-after"));
                let body: Value = response.json().await.unwrap();
                let message = body["error"].as_str().unwrap();
                assert!(
                    message.starts_with(&format!(
                        "Rate limit exceeded: {LIMITED_RPM} requests per 10 s on {LIMITED_MODEL}"
                    )),
                    "{message}"
                );
            }
            other => panic!("unexpected {other}: {}", response.text().await.unwrap()),
        }
    }
    assert_eq!(admitted, [LIMITED_RPM, LIMITED_RPM]);
    // Refused requests reached no backend.
    assert_eq!(mock.request_count() - before, 2 * LIMITED_RPM);
    println!(
        "cluster: limiter race: {} of {} admitted per key, one key per replica, in {elapsed:?}",
        LIMITED_RPM, RACERS
    );
}

/// Two accounts (one per billing replica), each with credit for exactly
/// ten requests, race 150 requests each over both gateways at once: ten of
/// each are served, the rest refused before any backend, the balance never
/// goes below zero and drops by exactly what the served requests report,
/// and the usage history lists exactly those requests.
pub async fn billing_race(cluster: &Cluster, mock: &MockUpstream) {
    const RACERS: usize = 150;
    let mut payers = Vec::new();
    for replica in 0..2 {
        let account = cluster.account_owned_by(0, "billing-race", replica).await;
        // "hello there" is estimated at 3 prompt tokens and the answer may
        // use 1,000: each request holds 1,003 micro-dollars and costs 1,002.
        let credited = cluster
            .credit(replica, &account.id, "0.01003", "exactly-ten")
            .await;
        assert_eq!(credited["balance"]["usd"], "0.01003");
        let (_, key) = cluster
            .create_key(1 - replica, &account.admin_key, "INFERENCE")
            .await;
        payers.push((account, key));
    }
    let body = json!({"model": CHAT_MODEL, "max_tokens": 1000,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 1000}});
    let before = mock.request_count();
    let start = Instant::now();
    let urls = [0, 1].map(|gateway| cluster.api(gateway, "/chat/completions"));
    let requests = payers.iter().flat_map(|(_, key)| {
        let (urls, body) = (&urls, &body);
        (0..RACERS).map(move |i| chat(&cluster.http, &urls[i % 2], key, body))
    });
    let replies = join_all(requests).await;
    let elapsed = start.elapsed();
    for (index, (account, _)) in payers.iter().enumerate() {
        let replies = &replies[index * RACERS..(index + 1) * RACERS];
        let mut served = HashMap::new();
        for reply in replies {
            match reply.status {
                Some(200) => {
                    assert!(reply.complete, "{reply:?}");
                    served.insert(reply.request_id.clone().unwrap(), reply.cost.unwrap());
                }
                Some(402) => assert!(
                    reply
                        .error
                        .as_deref()
                        .unwrap()
                        .starts_with("Insufficient USD or Diem balance"),
                    "{reply:?}"
                ),
                // More than 20 refusals block the key on a gateway for a
                // while (abuse protection counts 402s): refused too.
                Some(429) => assert!(
                    reply
                        .error
                        .as_deref()
                        .unwrap()
                        .starts_with("Too many failed attempts"),
                    "{reply:?}"
                ),
                _ => panic!("unexpected answer: {reply:?}"),
            }
        }
        assert_eq!(served.len(), 10, "account {index}");
        assert!(served.values().all(|cost| *cost == 1_002_000), "{served:?}");
        let balance = cluster.balance(index, &account.admin_key).await;
        assert!(balance >= 0);
        let charged: i64 = served.values().sum();
        assert_eq!(10_030_000 - balance, charged);
        assert_eq!(balance, 10_000);
        // Each served request charged once, what it reported; no other.
        let usage = cluster.usage(1 - index, &account.admin_key).await;
        assert_eq!(usage.len(), 10, "{usage:?}");
        assert_eq!(usage.into_iter().collect::<HashMap<_, _>>(), served);
        // The other gateway reads the same balance.
        assert_eq!(cluster.balance(1 - index, &account.admin_key).await, 10_000);
    }
    // Only the served requests reached the backend.
    assert_eq!(mock.request_count() - before, 20);
    println!(
        "cluster: billing race: 10 of {RACERS} served per account, one account per replica, \
         balances exact, in {elapsed:?}"
    );
}

/// A ledger handed back in the middle of a race. billing-0 dies, and
/// billing-1 takes its account (a request is served meanwhile). billing-0
/// comes back: ten requests that take 4 s each are held on billing-1 while
/// billing-0 rejoins, and once both gateways count billing-0 ready again
/// (billing-1 let the ledger go, its ten holds written first), twelve more
/// find nothing left: the ten holds came over with the ledger. Exactly
/// eleven served, charged once each; the balance drops by exactly that.
pub async fn billing_race_across_a_hand_back(cluster: &Cluster, mock: &MockUpstream) {
    const PHASE: Duration = Duration::from_secs(45);
    let account = cluster.account_owned_by(0, "hand-back-race", 0).await;
    // Eleven requests (1,002 micro-dollars each, holding 1,003) and a
    // micro-dollar: the ten held across the hand-back fit, nothing more.
    let credited = cluster
        .credit(0, &account.id, "0.011033", "hand-back-race")
        .await;
    assert_eq!(credited["balance"]["usd"], "0.011033", "{credited}");
    let (_, held_key) = cluster.create_key(0, &account.admin_key, "INFERENCE").await;
    let (_, probe_key) = cluster.create_key(1, &account.admin_key, "INFERENCE").await;
    let body = |delay_ms: u64| {
        json!({"model": CHAT_MODEL, "max_tokens": 1000,
            "messages": [{"role": "user", "content": "hello there"}],
            "mock": {"words": 1000, "delay_ms": delay_ms}})
    };
    let urls = [0, 1].map(|gateway| cluster.api(gateway, "/chat/completions"));
    let up = format!(
        "rialto_replica_up{{service=\"billing\",replica=\"{}\"}}",
        cluster.billing[0]
    );
    let counted = |state: f64| {
        let up = up.clone();
        move || {
            let up = up.clone();
            async move {
                let mut all = true;
                for gateway in ["gateway-0", "gateway-1"] {
                    all &= cluster.metric(gateway, &up).await == Some(state);
                }
                all
            }
        }
    };
    let before = mock.request_count();

    cluster.kill("billing-0").await;
    wait_until("billing-0 counted dead", PHASE, counted(0.0)).await;
    let first = chat(&cluster.http, &urls[0], &held_key, &body(0)).await;
    assert_eq!(first.status, Some(200), "{first:?}");

    cluster.start("billing-0").await;
    let (slow, quick) = (body(4000), body(0));
    let held = join_all((0..12).map(|i| chat(&cluster.http, &urls[i % 2], &held_key, &slow)));
    let probe = async {
        wait_until("billing-0 ready again", PHASE, counted(2.0)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        join_all((0..12).map(|i| chat(&cluster.http, &urls[i % 2], &probe_key, &quick))).await
    };
    let (held, probe) = tokio::join!(held, probe);

    let mut served = HashMap::from([(first.request_id.clone().unwrap(), first.cost.unwrap())]);
    for reply in &held {
        match reply.status {
            Some(200) => {
                assert!(reply.complete, "{reply:?}");
                served.insert(reply.request_id.clone().unwrap(), reply.cost.unwrap());
            }
            Some(402) => {}
            _ => panic!("unexpected answer: {reply:?}"),
        }
    }
    assert_eq!(served.len(), 11, "{held:?}");
    for reply in &probe {
        assert_eq!(
            reply.status,
            Some(402),
            "served past the balance after the hand-back: {reply:?}"
        );
    }
    assert!(served.values().all(|cost| *cost == 1_002_000), "{served:?}");
    let balance = cluster.balance(1, &account.admin_key).await;
    assert_eq!(balance, 11_033_000 - served.values().sum::<i64>());
    let usage = cluster.usage(0, &account.admin_key).await;
    assert_eq!(usage.into_iter().collect::<HashMap<_, _>>(), served);
    assert_eq!(mock.request_count() - before, 11);
    println!(
        "cluster: billing race across a hand-back: 10 holds came over with the ledger, \
         12 later requests refused, 11 served and charged once"
    );
}
