//! Secrets from files, rotated while the deployment serves: the operator
//! token and the internal gRPC token are replaced in their files (as the
//! kubelet replaces a mounted Secret) under load, and no request fails.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rialto_test_kit::{MockUpstream, Sandbox, Topology};
use serde_json::json;

use crate::support::{eventually as wait_for, metric, models_toml};

const NEW_GRPC_TOKEN: &str = "rotated-grpc-token";
const NEW_OPERATOR_TOKEN: &str = "rotated-operator-token";

#[tokio::test]
async fn rotated_secret_files_one_process() {
    rotation(Topology::OneProcess).await;
}

#[tokio::test]
async fn rotated_secret_files_split() {
    rotation(Topology::Split).await;
}

async fn operator_status(sandbox: &Sandbox, token: &str) -> u16 {
    sandbox
        .http()
        .get(format!("{}/admin/v1/accounts?limit=1", sandbox.url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

async fn rotation(topology: Topology) {
    let mock = MockUpstream::start().await.unwrap();
    let keyed = MockUpstream::start().await.unwrap();
    let key_dir = tempfile::tempdir().unwrap();
    let key_file = key_dir.path().join("upstream-key");
    std::fs::write(&key_file, "sk-first\n").unwrap();
    let mut sandbox = Sandbox::builder(topology)
        .secrets_in_files()
        .config(&models_toml(&mock.base_url()))
        .config(&format!(
            r#"
[[models]]
id = "keyed-chat"
backends = [{{ kind = "openai", url = "{}", api_key_file = "{}" }}]
"#,
            keyed.base_url(),
            key_file.display()
        ))
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("rotating").await.unwrap();
    let old_operator = sandbox.operator_token.clone();

    // Priced chats all along, through every service.
    let stop = Arc::new(AtomicBool::new(false));
    let (served, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut load = Vec::new();
    for _ in 0..2 {
        let (http, url, key) = (
            sandbox.http().clone(),
            sandbox.api("/chat/completions"),
            account.admin_key.clone(),
        );
        let (stop, served, failed) = (stop.clone(), served.clone(), failed.clone());
        load.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let status = http
                    .post(&url)
                    .bearer_auth(&key)
                    .json(&json!({"model": "mock-chat", "messages": [{"role": "user", "content": "hi"}]}))
                    .send()
                    .await
                    .map(|r| r.status().as_u16());
                match status {
                    Ok(200) => served.fetch_add(1, Ordering::Relaxed),
                    other => {
                        eprintln!("a chat failed during the rotation: {other:?}");
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
                // Below the standard tier's requests a minute.
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    std::fs::write(
        sandbox.secret_file("grpc-token"),
        format!("{NEW_GRPC_TOKEN}\n"),
    )
    .unwrap();
    std::fs::write(
        sandbox.secret_file("operator-token"),
        format!("{NEW_OPERATOR_TOKEN}\n"),
    )
    .unwrap();
    wait_for("the new operator token opening the API", async || {
        operator_status(&sandbox, NEW_OPERATOR_TOKEN).await == 200
    })
    .await;
    // The operator token it replaced is refused at once: it is rotated
    // because it may have leaked (only the gRPC token, which the pods
    // hold on both sides, keeps a grace).
    assert_eq!(operator_status(&sandbox, &old_operator).await, 401);
    assert_eq!(operator_status(&sandbox, "a-guess").await, 401);
    wait_for("the gRPC token's reload", async || {
        metric(
            &sandbox,
            r#"rialto_secret_reloads_total{secret="grpc.token_file",outcome="applied"}"#,
        )
        .await
            == 1.0
    })
    .await;
    // A backend's key, from its file: the next calls send the new one.
    let keyed_chat = async || {
        let answer = sandbox
            .call(
                reqwest::Method::POST,
                "/chat/completions",
                &account.admin_key,
                Some(&json!({"model": "keyed-chat", "messages": [{"role": "user", "content": "hi"}]})),
            )
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
        keyed.authorization_headers().last().cloned().flatten()
    };
    assert_eq!(keyed_chat().await.as_deref(), Some("Bearer sk-first"));
    std::fs::write(&key_file, "sk-second\n").unwrap();
    wait_for("the backend's new key", async || {
        keyed_chat().await.as_deref() == Some("Bearer sk-second")
    })
    .await;
    let before = served.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        served.load(Ordering::Relaxed) > before,
        "chats go on after the rotation"
    );

    // An unusable value keeps the one in force, and says so.
    std::fs::write(sandbox.secret_file("operator-token"), "\n").unwrap();
    wait_for("the empty file's refusal", async || {
        metric(
            &sandbox,
            r#"rialto_secret_reloads_total{secret="operator.token_file",outcome="refused"}"#,
        )
        .await
            >= 1.0
    })
    .await;
    assert_eq!(operator_status(&sandbox, NEW_OPERATOR_TOKEN).await, 200);

    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.unwrap();
    }
    assert_eq!(failed.load(Ordering::Relaxed), 0, "no request failed");
    assert!(served.load(Ordering::Relaxed) > 0);

    if topology == Topology::Split {
        // A gateway started now sends only the new token: the services
        // accept it because they rotated, not because of the grace.
        sandbox.kill("gateway").unwrap();
        std::fs::write(
            sandbox.secret_file("operator-token"),
            format!("{NEW_OPERATOR_TOKEN}\n"),
        )
        .unwrap();
        sandbox.restart("gateway").await.unwrap();
        let answer = sandbox
            .call(
                reqwest::Method::POST,
                "/chat/completions",
                &account.admin_key,
                Some(
                    &json!({"model": "mock-chat", "messages": [{"role": "user", "content": "hi"}]}),
                ),
            )
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
        assert_eq!(
            operator_status(&sandbox, &old_operator).await,
            401,
            "no grace after a restart"
        );
    }
}
