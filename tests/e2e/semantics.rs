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
traits = ["default", "fastest"]
aliases = ["gpt-4o"]
capabilities = ["tools"]
backends = [{{ kind = "openai", url = "{url}", model = "mock-model" }}]

[[models]]
id = "own-prompt"
traits = ["default_code", "fastest"]
system_prompt = "Model prompt."
thinking_control = "none"
backends = [{{ kind = "openai", url = "{url}", model = "mock-model" }}]

[[characters]]
slug = "philosopher"
name = "The Philosopher"
description = "Answers with questions."
system_prompt = "You are a philosopher."
model_id = "think-chat"
tags = ["philosophy"]

[[characters]]
slug = "secret"
name = "Secret"
system_prompt = "Hidden."
public = false
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

    // A character: its prompt after the service's, before the caller's.
    let with_character = chat(
        &sandbox,
        &key,
        hello("think-chat:character_slug=philosopher"),
    )
    .await;
    assert_eq!(
        with_character["rialto_parameters"]["character_slug"],
        "philosopher"
    );
    let sent = mock.requests().last().unwrap().clone();
    let prompts: Vec<&str> = sent["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "system")
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(
        prompts,
        [
            "You are Rialto.",
            "You are a philosopher.",
            "Caller prompt."
        ]
    );
    for slug in ["secret", "nobody"] {
        let response = sandbox
            .call(
                Method::POST,
                "/chat/completions",
                &key,
                Some(&hello(&format!("think-chat:character_slug={slug}"))),
            )
            .await
            .unwrap();
        assert_eq!(response.status(), 404, "{slug}");
    }
    let list: Value = sandbox
        .call(Method::GET, "/characters", &key, None)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["object"], "list");
    assert_eq!(
        list["data"].as_array().unwrap().len(),
        1,
        "private ones are not listed"
    );
    assert_eq!(list["data"][0]["slug"], "philosopher");
    assert_eq!(list["data"][0]["modelId"], "think-chat");
    let one = sandbox
        .call(Method::GET, "/characters/philosopher", &key, None)
        .await
        .unwrap();
    assert_eq!(one.status(), 200);
    let one: Value = one.json().await.unwrap();
    assert_eq!(one["object"], "character");
    assert_eq!(one["data"]["id"], list["data"][0]["id"]);
    let hidden = sandbox
        .call(Method::GET, "/characters/secret", &key, None)
        .await
        .unwrap();
    assert_eq!(hidden.status(), 404);
    let anonymous = sandbox
        .http()
        .get(sandbox.api("/characters"))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 402);

    // A character stored through the operator API: usable at once, listed,
    // gone once deleted.
    let operator = |method: Method, slug: &str, body: Option<Value>| {
        let mut request = sandbox
            .http()
            .request(
                method,
                format!("{}/admin/v1/characters/{slug}", sandbox.url),
            )
            .bearer_auth(&sandbox.operator_token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        async move { request.send().await.unwrap() }
    };
    let stored = operator(
        Method::PUT,
        "sage",
        Some(json!({"name": "The Sage", "system_prompt": "You are a sage.", "tags": ["wisdom"]})),
    )
    .await;
    assert_eq!(stored.status(), 200);
    let stored: Value = stored.json().await.unwrap();
    assert_eq!(stored["data"]["slug"], "sage");
    chat(&sandbox, &key, hello("think-chat:character_slug=sage")).await;
    let sent = mock.requests().last().unwrap().clone();
    assert_eq!(sent["messages"][1]["content"], "You are a sage.");
    let listed: Value = sandbox
        .call(Method::GET, "/characters", &key, None)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["data"].as_array().unwrap().len(), 2);
    assert_eq!(
        operator(
            Method::PUT,
            "Bad Slug",
            Some(json!({"name": "x", "system_prompt": "y"}))
        )
        .await
        .status(),
        400
    );
    assert_eq!(
        operator(Method::PUT, "empty", Some(json!({"name": "x"})))
            .await
            .status(),
        400
    );
    assert_eq!(operator(Method::DELETE, "sage", None).await.status(), 200);
    assert_eq!(operator(Method::DELETE, "sage", None).await.status(), 404);
    let gone = sandbox
        .call(
            Method::POST,
            "/chat/completions",
            &key,
            Some(&hello("think-chat:character_slug=sage")),
        )
        .await
        .unwrap();
    assert_eq!(gone.status(), 404);

    // The catalog: traits and compatibility aliases, usable as `model`.
    let get = |path: &'static str| {
        let request = sandbox.http().get(sandbox.api(path)).bearer_auth(&key);
        async move { request.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let traits = get("/models/traits").await;
    assert_eq!(
        traits,
        json!({"object": "list", "type": "text", "data":
            {"default": "think-chat", "fastest": "think-chat", "default_code": "own-prompt"}})
    );
    let mapping = get("/models/compatibility_mapping?type=text").await;
    assert_eq!(mapping["data"], json!({"gpt-4o": "think-chat"}));
    let listed = get("/models").await;
    let think = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "think-chat")
        .unwrap()
        .clone();
    assert_eq!(think["model_spec"]["traits"], json!(["default", "fastest"]));
    assert_eq!(
        think["model_spec"]["capabilities"]["supportsFunctionCalling"],
        true
    );
    assert_eq!(think["model_spec"]["capabilities"]["supportsVision"], false);
    let aliased = chat(&sandbox, &key, hello("gpt-4o")).await;
    assert_eq!(aliased["model"], "think-chat");
    let by_trait = chat(
        &sandbox,
        &key,
        hello("default_code:strip_thinking_response=true"),
    )
    .await;
    assert_eq!(by_trait["model"], "own-prompt");
    assert_eq!(by_trait["choices"][0]["message"]["content"], "Hello world");

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

/// Inputs a model's capabilities allow or refuse, `cache_control` kept or
/// dropped, the tool and logprob members validated, and `prompt_cache_key`
/// pinning a conversation to one backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_caching_and_tools() {
    let first = MockUpstream::start().await.unwrap();
    let second = MockUpstream::start().await.unwrap();
    let config = format!(
        r#"
[[models]]
id = "text-only"
input_usd_per_mtok = 1.0
cached_input_usd_per_mtok = 0.1
cache_write_usd_per_mtok = 2.0
backends = [{{ kind = "openai", url = "{a}", model = "mock-model" }}]

[[models]]
id = "vision-cache"
capabilities = ["vision", "caching", "files"]
backends = [{{ kind = "openai", url = "{a}", model = "mock-model" }}]

[[models]]
id = "pinned"
backends = [
  {{ kind = "openai", url = "{a}", model = "mock-model", name = "b0" }},
  {{ kind = "openai", url = "{b}", model = "mock-model", name = "b1" }},
]
"#,
        a = first.base_url(),
        b = second.base_url()
    );
    let sandbox = Sandbox::builder(Topology::OneProcess)
        .config(&config)
        // The file server below is on loopback.
        .env("RIALTO_GATEWAY__FILE_URLS_ALLOW_PRIVATE", "true")
        // A proxy that is not there, for everything but the backends on
        // 127.0.0.1: a file fetch that took it (and resolved the name
        // again behind our address check) would fail.
        .env("HTTP_PROXY", "http://127.0.0.1:9")
        .env("HTTPS_PROXY", "http://127.0.0.1:9")
        .env("ALL_PROXY", "http://127.0.0.1:9")
        .env("NO_PROXY", "127.0.0.1")
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("inputs").await.unwrap();
    let (_, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    let send = |body: Value| {
        let request = sandbox
            .http()
            .post(sandbox.api("/chat/completions"))
            .bearer_auth(&key)
            .json(&body);
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        }
    };
    let picture = |model: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?", "cache_control": {"type": "ephemeral"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    };
    let (status, body) = send(picture("text-only")).await;
    assert_eq!(status, 400);
    assert_eq!(
        body["details"]["messages"]["0"]["content"]["1"]["type"]["_errors"][0],
        "The model text-only does not accept image input"
    );
    let (status, _) = send(picture("vision-cache")).await;
    assert_eq!(status, 200);
    let kept = first.requests().last().unwrap().clone();
    assert_eq!(
        kept["messages"][0]["content"][0]["cache_control"],
        json!({"type": "ephemeral"})
    );
    // Without the caching capability, cache_control is dropped.
    let text = json!({"model": "text-only", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]});
    assert_eq!(send(text).await.0, 200);
    let dropped = first.requests().last().unwrap().clone();
    assert!(
        dropped["messages"][0]["content"][0]
            .get("cache_control")
            .is_none()
    );
    let bad_cache = json!({"model": "text-only", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "persistent"}}]}]});
    let (status, body) = send(bad_cache).await;
    assert_eq!(status, 400);
    assert!(body["details"].to_string().contains("ephemeral"), "{body}");

    // A DOCX file becomes text before the model sees it; a model without
    // the files capability refuses it; a broken file is a 400 naming it.
    let docx = {
        use std::io::Write;
        let mut writer = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        writer
            .start_file(
                "word/document.xml",
                zip::write::SimpleFileOptions::default(),
            )
            .unwrap();
        writer
            .write_all(br#"<w:document xmlns:w="w"><w:body><w:p><w:r><w:t>Quarterly revenue grew.</w:t></w:r></w:p></w:body></w:document>"#)
            .unwrap();
        writer.finish().unwrap().into_inner()
    };
    use base64::Engine;
    let encoded = base64::engine::general_purpose::STANDARD.encode(&docx);
    let with_file = |model: &str, data: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "summarize"},
            {"type": "file", "file": {"filename": "report.docx", "file_data": data}}]}]})
    };
    assert_eq!(send(with_file("vision-cache", &encoded)).await.0, 200);
    let seen = first.requests().last().unwrap().clone();
    assert_eq!(seen["messages"][0]["content"][1]["type"], "text");
    assert!(
        seen["messages"][0]["content"][1]["text"]
            .as_str()
            .unwrap()
            .contains("Quarterly revenue grew."),
        "{seen}"
    );
    let (status, body) = send(with_file("text-only", &encoded)).await;
    assert_eq!(status, 400);
    assert!(
        body.to_string().contains("does not accept file input"),
        "{body}"
    );
    let broken = base64::engine::general_purpose::STANDARD.encode(b"PK not a zip");
    let (status, body) = send(with_file("vision-cache", &broken)).await;
    assert_eq!(status, 400);
    assert!(
        body["details"]["messages"]["0"]["content"]["1"]["file"]["_errors"][0]
            .as_str()
            .unwrap()
            .contains("could not be read as a DOCX file"),
        "{body}"
    );

    // Hostile documents: each once aborted the whole process (a parser's
    // stack overflow, a 550 GB allocation). Now each is a 400 naming its
    // part, and the server goes on serving.
    let named = |name: &str, bytes: &[u8]| {
        let data = base64::engine::general_purpose::STANDARD.encode(bytes);
        json!({"model": "vision-cache", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "summarize"},
            {"type": "file", "file": {"filename": name, "file_data": data}}]}]})
    };
    use rialto_test_kit::documents::{far_apart_cells, nested_pdf, page_pdf};
    let nested = nested_pdf(5_000);
    // Arrays nested 5,000 deep inside a page's content stream: the checks
    // before parsing skip stream bytes, so only the sandbox stands between
    // the content parser and the server.
    let deep = page_pdf(&format!(
        "BT /F1 12 Tf 100 700 Td {}(x){} TJ ET",
        "[".repeat(5_000),
        "]".repeat(5_000)
    ));
    let sheet = far_apart_cells();
    for (name, bytes) in [
        ("nested.pdf", nested.as_slice()),
        ("deep.pdf", deep.as_slice()),
        ("wide.xlsx", sheet.as_slice()),
    ] {
        let (status, body) = send(named(name, bytes)).await;
        assert_eq!(status, 400, "{name}: {body}");
        let why = body["details"]["messages"]["0"]["content"]["1"]["file"]["_errors"][0]
            .as_str()
            .unwrap_or_default();
        assert!(why.contains(name), "{name}: {body}");
    }
    assert_eq!(send(with_file("vision-cache", &encoded)).await.0, 200);

    // A file by URL: fetched, then converted.
    // On 127.0.0.2, which NO_PROXY above does not name.
    let files = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let file_url = format!("http://{}/sales.csv", files.local_addr().unwrap());
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut socket, _)) = files.accept().await {
            let mut request = [0u8; 2048];
            let _ = socket.read(&mut request).await;
            let body = "region,revenue\nnorth,42\n";
            let answer = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/csv\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = socket.write_all(answer.as_bytes()).await;
        }
    });
    let by_url = json!({"model": "vision-cache", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "summarize"},
        {"type": "file", "file": {"file_url": file_url}}]}]});
    assert_eq!(send(by_url).await.0, 200);
    let seen = first.requests().last().unwrap().clone();
    let text = seen["messages"][0]["content"][1]["text"].as_str().unwrap();
    assert!(
        text.contains("File sales.csv") && text.contains("north,42"),
        "{text}"
    );

    // Cached and cache-written prompt tokens: reported as the backend said,
    // priced at the model's cache prices. The mock counts "one two three four"
    // as 4 prompt tokens: 1 plain at $1/M, 2 cached at $0.1/M, 1 written at $2/M.
    let cached = json!({"model": "text-only", "max_tokens": 1,
        "messages": [{"role": "user", "content": "one two three four"}],
        "mock": {"reply": "", "cached_tokens": 2, "cache_write_tokens": 1}});
    let (status, body) = send(cached).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 4, "{body}");
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cache_creation_input_tokens"],
        1
    );
    assert_eq!(body["cost"]["usd"].to_string(), "0.0000032");

    // Tools: a call and its answer pass; a tool message needs its call id,
    // an assistant message content or tool calls.
    let call = json!({"id": "call_1", "type": "function",
        "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}});
    let round_trip = json!({"model": "text-only", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]});
    assert_eq!(send(round_trip).await.0, 200);
    let orphan = json!({"model": "text-only", "messages": [
        {"role": "tool", "content": "sunny"}]});
    let (status, body) = send(orphan).await;
    assert_eq!(status, 400);
    assert_eq!(
        body["details"]["messages"]["0"]["tool_call_id"]["_errors"][0],
        "Required"
    );
    let empty = json!({"model": "text-only", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]});
    assert_eq!(send(empty).await.0, 400);
    let top = json!({"model": "text-only", "top_logprobs": 3,
        "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(send(top).await.0, 400);

    // One conversation key, one backend; without a key, both share the load.
    let before = (first.request_count(), second.request_count());
    for _ in 0..6 {
        let pinned = json!({"model": "pinned", "prompt_cache_key": "conversation-1",
            "messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(send(pinned).await.0, 200);
    }
    let pinned = (
        first.request_count() - before.0,
        second.request_count() - before.1,
    );
    assert!(pinned == (6, 0) || pinned == (0, 6), "{pinned:?}");
    let before = (first.request_count(), second.request_count());
    for _ in 0..20 {
        let spread = json!({"model": "pinned", "messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(send(spread).await.0, 200);
    }
    // Idle backends of equal weight are drawn at random: all twenty on one
    // has a chance of 2^-19.
    let spread = (
        first.request_count() - before.0,
        second.request_count() - before.1,
    );
    assert!(spread.0 > 0 && spread.1 > 0, "{spread:?}");
}
