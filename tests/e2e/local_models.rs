//! The built-in models through the real binary, in both topologies: the
//! `local` backend kind serving SmolLM2-135M (llama.cpp) and
//! all-MiniLM-L6-v2 (candle) from ./models/ (`make models`), and speech by
//! Debian's espeak-ng (`make test` installs it), driven over HTTP and with
//! the official `openai` Python SDK.

use std::path::PathBuf;
use std::time::Duration;

use rialto_test_kit::{MockSearxng, Sandbox, Topology};
use serde_json::{Value, json};

use crate::python::run_script;

fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models")
}

/// The built-in catalog's two models with absolute paths, and a second chat
/// model on the same file whose queue holds nobody (`max_queue = 0`).
fn local_models_toml(searxng: &str) -> String {
    let dir = models_dir();
    let gguf = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let embedder = dir.join("all-minilm-l6-v2");
    assert!(
        gguf.is_file() && embedder.join("model.safetensors").is_file(),
        "the built-in models are missing: run `make models`"
    );
    format!(
        r#"
[[models]]
id = "smollm2-135m"
type = "text"
context_length = 2048
traits = ["default"]
capabilities = ["web_search"]
backends = [{{ kind = "local", path = "{gguf}", name = "local-smollm2", context_size = 2048 }}]

[[models]]
id = "smollm2-no-queue"
type = "text"
backends = [{{ kind = "local", path = "{gguf}", name = "local-busy", context_size = 1024, max_queue = 0 }}]

[[models]]
id = "all-minilm-l6-v2"
type = "embedding"
embedding_dimensions = 384
max_input_tokens = 256
created = 1764000000
aliases = ["text-embedding-3-small"]
backends = [{{ kind = "local", path = "{embedder}", name = "local-minilm" }}]

[[models]]
id = "espeak-ng"
type = "tts"
usd_per_thousand_characters = 0.01
voices = ["en-us", "de"]
audio_formats = ["wav", "pcm"]
backends = [{{ kind = "local", path = "/usr/bin/espeak-ng", name = "local-espeak" }}]

[web_search]
provider = "searxng"
url = "{searxng}"
max_results = 3
"#,
        gguf = gguf.display(),
        embedder = embedder.display()
    )
}

async fn local_models(topology: Topology) {
    let searxng = MockSearxng::start().await.unwrap();
    let sandbox = Sandbox::builder(topology)
        .config(&local_models_toml(&searxng.url()))
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("local").await.unwrap();
    let (_, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    let http = sandbox.http();

    // The capital of France, asked of `model` (with its suffix).
    let ask = |model: &'static str| {
        http.post(sandbox.api("/chat/completions"))
            .bearer_auth(&key)
            .json(&json!({
                "model": model,
                "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                "temperature": 0,
                "max_tokens": 24,
            }))
            .send()
    };

    // A real answer with real token counts, from the in-process backend.
    let response = ask("smollm2-135m").await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-rialto-model-router"], "local-smollm2");
    let body: Value = response.json().await.unwrap();
    let answer = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
    let completion_tokens = body["usage"]["completion_tokens"].as_u64().unwrap();
    // SmolLM2's template adds its default system prompt: ~42 tokens in all.
    assert!((30..60).contains(&prompt_tokens), "{body}");
    assert!((1..=24).contains(&completion_tokens), "{body}");

    // The same question with web search: the real model reads the sources
    // (its own tokenizer counts them in the prompt) and the answer lists
    // them.
    let response = ask("smollm2-135m:enable_web_search=on&enable_web_citations=true")
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let searched: Value = response.json().await.unwrap();
    assert_eq!(
        searxng.queries(),
        ["What is the capital of France? Answer in one word."]
    );
    let citations = searched["rialto_parameters"]["web_search_citations"]
        .as_array()
        .unwrap();
    assert_eq!(citations.len(), 3, "{searched}");
    let prompt = |answer: &Value| answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        prompt(&searched) > prompt(&body) + 100,
        "the sources reached the model: {searched} vs {body}"
    );

    // Embeddings: OpenAI's shape, unit vectors, similar texts closer.
    let response = http
        .post(sandbox.api("/embeddings"))
        .bearer_auth(&key)
        .json(&json!({
            "model": "text-embedding-3-small",
            "input": ["A man is playing a guitar.", "Someone plays a guitar.", "Interest rates rose again."],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-rialto-model-router"], "local-minilm");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["object"], "list");
    assert_eq!(body["model"], "all-minilm-l6-v2");
    let vectors: Vec<Vec<f64>> = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| serde_json::from_value(item["embedding"].clone()).unwrap())
        .collect();
    assert_eq!(vectors.len(), 3);
    assert_eq!(vectors[0].len(), 384);
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    assert!(dot(&vectors[0], &vectors[1]) > dot(&vectors[0], &vectors[2]) + 0.3);
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 10);
    // `/models` says as much.
    let listed: Value = http
        .get(sandbox.api("/models?type=embedding"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let minilm = &listed["data"][0];
    assert_eq!(minilm["created"], 1764000000);
    assert_eq!(minilm["model_spec"]["embeddingDimensions"], 384);
    assert_eq!(minilm["model_spec"]["maxInputTokens"], 256);
    assert_eq!(minilm["model_spec"]["supportsCustomDimensions"], false);

    // Bad input is the caller's 400, in the spec's shape.
    let response = http
        .post(sandbox.api("/embeddings"))
        .bearer_auth(&key)
        .json(&json!({"model": "all-minilm-l6-v2", "input": [1, 2, 3]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert!(body["error"].is_string(), "{body}");

    // A model busy with one request and no queue answers the next one 503.
    let busy = http
        .post(sandbox.api("/chat/completions"))
        .bearer_auth(&key)
        .json(&json!({
            "model": "smollm2-no-queue",
            "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
            "max_tokens": 400, "stream": true,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(busy.status(), 200);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let refused = http
        .post(sandbox.api("/chat/completions"))
        .bearer_auth(&key)
        .json(&json!({
            "model": "smollm2-no-queue",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    let body: Value = refused.json().await.unwrap();
    assert!(body["error"].is_string(), "{body}");
    drop(busy);

    // Speech made in process: a WAV whose lengths are true, its samples
    // alone as `pcm`, and as a queued job.
    let speak = |format: &'static str, voice: &'static str| {
        http.post(sandbox.api("/audio/speech"))
            .bearer_auth(&key)
            .json(
                &json!({"model": "espeak-ng", "input": "Good morning from Venice.",
                "voice": voice, "response_format": format}),
            )
            .send()
    };
    let wav = speak("wav", "en-us").await.unwrap();
    assert_eq!(wav.status(), 200);
    assert_eq!(wav.headers()["content-type"], "audio/wav");
    let wav = wav.bytes().await.unwrap();
    let reader = hound::WavReader::new(std::io::Cursor::new(wav.to_vec())).unwrap();
    let seconds = f64::from(reader.duration()) / f64::from(reader.spec().sample_rate);
    assert!((0.8..5.0).contains(&seconds), "{seconds} s of speech");
    let loudest = reader
        .into_samples::<i16>()
        .map(|s| s.unwrap().unsigned_abs())
        .max()
        .unwrap();
    assert!(loudest > 1000, "speech, not silence: {loudest}");
    let pcm = speak("pcm", "de").await.unwrap();
    assert_eq!(pcm.status(), 200);
    assert!(pcm.bytes().await.unwrap().len() > 10_000);
    assert_eq!(speak("mp3", "en-us").await.unwrap().status(), 400);
    let queued: Value = http
        .post(sandbox.api("/audio/queue"))
        .bearer_auth(&key)
        .json(&json!({"model": "espeak-ng", "prompt": "A queued sentence."}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let queue_id = queued["queue_id"].as_str().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let retrieved = http
            .post(sandbox.api("/audio/retrieve"))
            .bearer_auth(&key)
            .json(&json!({"model": "espeak-ng", "queue_id": queue_id}))
            .send()
            .await
            .unwrap();
        assert_eq!(retrieved.status(), 200);
        if retrieved.headers()["content-type"] == "audio/wav" {
            let wav = retrieved.bytes().await.unwrap();
            assert!(hound::WavReader::new(std::io::Cursor::new(wav.to_vec())).is_ok());
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the speech job never finished"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The official SDK: a chat, a stream and embeddings (base64, the SDK's
    // default encoding), and speech.
    let stdout = run_script(
        "local_models_check.py",
        &[
            ("RIALTO_E2E_BASE_URL", &sandbox.api("")),
            ("RIALTO_E2E_API_KEY", &key),
        ],
    )
    .await;
    for check in ["chat ok", "stream ok", "embeddings ok", "speech ok"] {
        assert!(stdout.contains(check), "{stdout}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process() {
    local_models(Topology::OneProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split() {
    local_models(Topology::Split).await;
}
