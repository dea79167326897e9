//! Service parameters the router applies, in both topologies: model
//! suffixes, the service's system prompt, and thinking stripped from whole
//! and streamed answers (each choice of `n > 1` on its own), with what the
//! backend received recorded by the mock.

use reqwest::Method;
use rialto_test_kit::{MockUpstream, Sandbox, Topology};
use serde_json::{Value, json};

const THINKING: &str = "<think>plan the answer</think> Hello world";

async fn world(topology: Topology) -> (MockUpstream, Sandbox, String) {
    let mock = MockUpstream::start().await.unwrap();
    let config = format!(
        r#"
[router]
system_prompt = "You are Rialto."

[[models]]
id = "think-chat"
backends = [{{ kind = "openai", url = "{url}", model = "mock-model" }}]

[[models]]
id = "own-prompt"
system_prompt = "Model prompt."
thinking_control = "none"
backends = [{{ kind = "openai", url = "{url}", model = "mock-model" }}]
"#,
        url = mock.base_url()
    );
    let sandbox = Sandbox::builder(topology)
        .config(&config)
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("semantics").await.unwrap();
    let (_, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    (mock, sandbox, key)
}

async fn chat(sandbox: &Sandbox, key: &str, body: Value) -> Value {
    let response = sandbox
        .call(Method::POST, "/chat/completions", key, Some(&body))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

fn hello(model: &str) -> Value {
    json!({"model": model, "messages": [
        {"role": "system", "content": "Caller prompt."},
        {"role": "user", "content": "hi"}],
        "mock": {"reply": THINKING}})
}

async fn service_parameters(topology: Topology) {
    let (mock, sandbox, key) = world(topology).await;

    // Nothing asked: the service prompt first, the answer untouched.
    let plain = chat(&sandbox, &key, hello("think-chat")).await;
    assert_eq!(plain["choices"][0]["message"]["content"], THINKING);
    let sent = mock.requests().last().unwrap().clone();
    assert_eq!(
        sent["messages"][0],
        json!({"role": "system", "content": "You are Rialto."})
    );
    assert_eq!(sent["messages"][1]["content"], "Caller prompt.");
    assert!(sent.get("chat_template_kwargs").is_none());
    assert_eq!(plain["rialto_parameters"]["strip_thinking_response"], false);

    // A suffix strips the thinking; the body turns the prompt off.
    let mut body = hello("think-chat:strip_thinking_response=true");
    body["rialto_parameters"] = json!({"include_rialto_system_prompt": false,
        "strip_thinking_response": false});
    let stripped = chat(&sandbox, &key, body).await;
    assert_eq!(stripped["model"], "think-chat");
    assert_eq!(stripped["choices"][0]["message"]["content"], "Hello world");
    assert_eq!(
        stripped["rialto_parameters"]["strip_thinking_response"], true,
        "the suffix wins"
    );
    assert_eq!(
        stripped["rialto_parameters"]["include_rialto_system_prompt"],
        false
    );
    let sent = mock.requests().last().unwrap().clone();
    assert_eq!(sent["messages"][0]["content"], "Caller prompt.");

    // disable_thinking (URL-encoded values, unknown keys ignored) asks the
    // backend not to think, and strips what it thinks anyway.
    let disabled = chat(
        &sandbox,
        &key,
        hello("think-chat:disable_thinking=true&unknown=x%20y"),
    )
    .await;
    assert_eq!(disabled["choices"][0]["message"]["content"], "Hello world");
    assert_eq!(disabled["rialto_parameters"]["disable_thinking"], true);
    let sent = mock.requests().last().unwrap().clone();
    assert_eq!(
        sent["chat_template_kwargs"],
        json!({"enable_thinking": false})
    );
    // A model whose backend takes no such flag: only stripped; its own prompt.
    let own = chat(&sandbox, &key, hello("own-prompt:disable_thinking=true")).await;
    assert_eq!(own["choices"][0]["message"]["content"], "Hello world");
    let sent = mock.requests().last().unwrap().clone();
    assert!(sent.get("chat_template_kwargs").is_none());
    assert_eq!(sent["messages"][0]["content"], "Model prompt.");

    // A stream of two choices, the block spread over several chunks.
    let mut body = hello("think-chat:strip_thinking_response=true");
    body["stream"] = json!(true);
    body["n"] = json!(2);
    let response = sandbox
        .call(Method::POST, "/chat/completions", &key, Some(&body))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let mut contents = [String::new(), String::new()];
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            let index = choice["index"].as_u64().unwrap() as usize;
            if let Some(piece) = choice["delta"]["content"].as_str() {
                contents[index].push_str(piece);
            }
        }
    }
    assert_eq!(contents[0], "Hello world");
    assert_eq!(contents[1], "Hello world (choice 1)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_parameters_one_process() {
    service_parameters(Topology::OneProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_parameters_split() {
    service_parameters(Topology::Split).await;
}
