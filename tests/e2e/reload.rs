//! Configuration reloads without a restart, under load: a price and a
//! per-account override changed in the file reach the next requests while
//! no request fails; an invalid file is refused and the previous values
//! stay; SIGHUP reloads at once; the limiter's windows survive it all.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use reqwest::Method;
use rialto_test_kit::{MockUpstream, Sandbox, Topology};
use serde_json::{Value, json};

use crate::support::eventually;

/// `paid-chat` at $1 per million tokens in and out, and rate limits far
/// above the load's.
fn models(mock_url: &str) -> String {
    format!(
        r#"
[[models]]
id = "paid-chat"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]

[limits.tiers.standard.XS]
rpm = 100000
tpm = 100000000
"#
    )
}

/// "hello there" and ten words back: 12 tokens, $0.000012 at $1/M.
fn chat_body(model: &str) -> Value {
    json!({"model": model, "max_tokens": 10,
        "messages": [{"role": "user", "content": "hello there"}],
        "mock": {"words": 10}})
}

/// Replaces the configuration file as Kubernetes does: the new content
/// appears whole (written beside it, then renamed over it).
fn rewrite(sandbox: &Sandbox, edit: impl FnOnce(String) -> String) {
    let path = sandbox.config_path();
    let text = std::fs::read_to_string(path).unwrap();
    let next = path.with_extension("toml.next");
    std::fs::write(&next, edit(text)).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// `rialto_config_reloads_total{outcome}` of the gateway's process.
async fn reloads(sandbox: &Sandbox, outcome: &str) -> u64 {
    let sample = format!("rialto_config_reloads_total{{outcome=\"{outcome}\"}} ");
    crate::support::metric(sandbox, &sample).await as u64
}

/// A chat's status and, when served, the USD it cost.
async fn chat(sandbox: &Sandbox, key: &str, model: &str) -> (u16, String) {
    let response = sandbox
        .call(
            Method::POST,
            "/chat/completions",
            key,
            Some(&chat_body(model)),
        )
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    (status, body["cost"]["usd"].to_string())
}

async fn balance_nanos(sandbox: &Sandbox, admin: &str) -> i64 {
    let response = sandbox
        .call(Method::GET, "/billing/balance", admin, None)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    let usd: rust_decimal::Decimal = body["balances"]["usd"].to_string().parse().unwrap();
    (usd * rust_decimal::Decimal::from(1_000_000_000))
        .try_into()
        .unwrap()
}

/// Sends priced chats one after the other until `stop`; what every
/// answer was that is not a 200 at one of `costs`.
async fn keep_chatting(
    sandbox: Arc<Sandbox>,
    key: String,
    stop: Arc<AtomicBool>,
) -> (usize, Vec<String>) {
    let (mut sent, mut wrong) = (0, Vec::new());
    while !stop.load(Ordering::Relaxed) {
        let (status, cost) = chat(&sandbox, &key, "paid-chat").await;
        sent += 1;
        if status != 200 || !["0.000012", "0.000024"].contains(&cost.as_str()) {
            wrong.push(format!("{status} costing {cost}"));
        }
    }
    (sent, wrong)
}

async fn reloads_without_a_restart(topology: Topology) {
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = Arc::new(
        Sandbox::builder(topology)
            .config(&models(&mock.base_url()))
            .start()
            .await
            .unwrap(),
    );
    let payer = sandbox.create_account("payer").await.unwrap();
    let (_, payer_key) = sandbox
        .create_key(&payer.admin_key, "INFERENCE")
        .await
        .unwrap();
    let limited = sandbox.create_account("limited").await.unwrap();
    let (_, limited_key) = sandbox
        .create_key(&limited.admin_key, "INFERENCE")
        .await
        .unwrap();
    assert_eq!(
        chat(&sandbox, &payer_key, "paid-chat").await,
        (200, "0.000012".into())
    );

    // Under load: four clients chatting all along.
    let stop = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = (0..4)
        .map(|_| {
            tokio::spawn(keep_chatting(
                Arc::clone(&sandbox),
                payer_key.clone(),
                Arc::clone(&stop),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The price doubles, the `limited` account gets 3 requests a minute,
    // and a model is added.
    rewrite(&sandbox, |text| {
        text.replace(
            "input_usd_per_mtok = 1.0\noutput_usd_per_mtok = 1.0",
            "input_usd_per_mtok = 2.0\noutput_usd_per_mtok = 2.0",
        ) + &format!(
            r#"
[[limits.overrides]]
account = "{}"
rpm = 3

[[models]]
id = "added-chat"
input_usd_per_mtok = 3.0
output_usd_per_mtok = 3.0
backends = [{{ kind = "openai", url = "{}", model = "mock-model" }}]
"#,
            limited.id,
            mock.base_url()
        )
    });
    eventually("the gateway reloads", || async {
        reloads(&sandbox, "applied").await == 1
    })
    .await;
    eventually("the next requests cost the new price", || async {
        chat(&sandbox, &payer_key, "paid-chat").await == (200, "0.000024".into())
    })
    .await;
    eventually("the added model serves", || async {
        chat(&sandbox, &payer_key, "added-chat").await == (200, "0.000036".into())
    })
    .await;
    // From then on every request pays the new price, and the balance moves
    // by exactly that.
    let before = balance_nanos(&sandbox, &limited.admin_key).await;
    for _ in 0..3 {
        assert_eq!(
            chat(&sandbox, &limited_key, "paid-chat").await,
            (200, "0.000024".into())
        );
    }
    let after = balance_nanos(&sandbox, &limited.admin_key).await;
    assert_eq!(before - after, 3 * 24_000);
    // The override: the fourth request of the minute is refused.
    let refused = sandbox
        .call(
            Method::POST,
            "/chat/completions",
            &limited_key,
            Some(&chat_body("paid-chat")),
        )
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["x-ratelimit-limit-requests"], "3");

    stop.store(true, Ordering::Relaxed);
    let mut sent = 0;
    for task in load {
        let (count, wrong) = task.await.unwrap();
        assert!(
            wrong.is_empty(),
            "requests failed during the reload: {wrong:?}"
        );
        sent += count;
    }
    assert!(sent > 20, "only {sent} requests under load");

    // An invalid file (a model of no known type) is refused whole: the
    // previous prices and limits stay, and so does the window.
    rewrite(&sandbox, |text| {
        text + "\n[[models]]\nid = \"broken\"\ntype = \"hologram\"\n"
    });
    eventually("the invalid file is refused", || async {
        reloads(&sandbox, "refused").await == 1
    })
    .await;
    assert_eq!(reloads(&sandbox, "applied").await, 1);
    assert_eq!(
        chat(&sandbox, &payer_key, "paid-chat").await,
        (200, "0.000024".into())
    );
    assert_eq!(chat(&sandbox, &limited_key, "paid-chat").await.0, 429);
    let logs = sandbox
        .logs_containing("configuration reload refused")
        .await;
    assert!(
        logs.contains("configuration reload refused") && logs.contains("hologram"),
        "the refusal and its reason are logged"
    );

    // Valid again (the file watcher applies it), then SIGHUP reloads the
    // unchanged file at once.
    rewrite(&sandbox, |text| {
        text.replace("\n[[models]]\nid = \"broken\"\ntype = \"hologram\"\n", "")
    });
    eventually("the valid file is applied", || async {
        reloads(&sandbox, "applied").await == 2
    })
    .await;
    let process = match topology {
        Topology::OneProcess => "all",
        _ => "gateway",
    };
    let pid = sandbox.pid(process).unwrap();
    let signalled = std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .unwrap();
    assert!(signalled.success());
    eventually("SIGHUP reloads", || async {
        reloads(&sandbox, "applied").await == 3
    })
    .await;
    assert_eq!(reloads(&sandbox, "refused").await, 1);
    // Still serving, at the new price; the limited account's window, taken
    // before three reloads, still refuses.
    assert_eq!(
        chat(&sandbox, &payer_key, "paid-chat").await,
        (200, "0.000024".into())
    );
    assert_eq!(chat(&sandbox, &limited_key, "paid-chat").await.0, 429);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_price_and_an_override_reload_under_load_one_process() {
    reloads_without_a_restart(Topology::OneProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_price_and_an_override_reload_under_load_split() {
    reloads_without_a_restart(Topology::Split).await;
}
