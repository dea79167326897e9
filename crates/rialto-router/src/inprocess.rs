//! Models served inside this process: the `local` backend kind.
//!
//! An [`InProcessModel`] takes the same OpenAI request body an HTTP backend
//! would receive and answers in the same JSON shapes, so the router treats
//! both kinds alike: selection, retries and failover do not care which one
//! serves. [`load`] builds one from its backend's config: a `.gguf` file is
//! a chat model on llama.cpp, a directory a BERT embedding model on candle
//! (both from `rialto-local`).

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use futures_util::{Stream, StreamExt};
use rialto_core::config::BackendConfig;
use rialto_core::{Error, ErrorCode, Result};
use rialto_local::{
    ChatModel, ChatOptions, EmbeddingModel, EmbeddingOptions, Event, Generation, LocalError,
    Message,
};
use serde_json::{Map, Value, json};

/// Chunks of a streamed completion, each one `chat.completion.chunk` JSON
/// object (what an SSE `data:` line carries); the last one carries usage.
pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<Vec<u8>>> + Send>>;

#[async_trait]
pub trait InProcessModel: Send + Sync + 'static {
    /// A whole completion: `chat.completion` JSON.
    ///
    /// A full queue is `ErrorCode::Unavailable`, which the router may retry
    /// on another backend.
    async fn chat(&self, body: &Map<String, Value>) -> Result<Vec<u8>> {
        let _ = body;
        Err(Error::invalid("This model does not do chat completions"))
    }

    /// A streamed completion; resolves once the model has taken the request.
    async fn chat_stream(&self, body: &Map<String, Value>) -> Result<ChunkStream> {
        let _ = body;
        Err(Error::invalid("This model does not do chat completions"))
    }

    /// Embeddings of an `/embeddings` request body: the OpenAI
    /// `{object: "list", data, model, usage}` JSON.
    async fn embed(&self, body: &Map<String, Value>) -> Result<Vec<u8>> {
        let _ = body;
        Err(Error::invalid("This model does not produce embeddings"))
    }

    /// A media call (`/audio/speech`, ...): the answer's bytes and its
    /// content type.
    async fn media(&self, path: &str, body: &Map<String, Value>) -> Result<(Vec<u8>, String)> {
        let _ = body;
        Err(Error::invalid(format!("This model does not serve {path}")))
    }
}

/// Requests waiting for a local model beyond the one it runs, by default.
const DEFAULT_MAX_QUEUE: usize = 32;

/// Loads the model a `local` backend names. Blocking (reads the model):
/// call it at start.
pub fn load(model_id: &str, config: &BackendConfig) -> Result<Arc<dyn InProcessModel>> {
    let path = PathBuf::from(config.path.as_deref().unwrap_or_default());
    let max_queue = config.max_queue.unwrap_or(DEFAULT_MAX_QUEUE);
    let failed = |error: LocalError| {
        Error::new(
            ErrorCode::Unavailable,
            format!("model {model_id}: local backend: {error}"),
        )
    };
    let name = config.model.clone().unwrap_or_else(|| model_id.to_owned());
    if path
        .file_name()
        .is_some_and(|name| name == crate::speech::ESPEAK)
    {
        return Ok(Arc::new(crate::speech::Espeak::start(model_id, &path)?));
    }
    if path.is_dir() {
        let model = EmbeddingModel::load(&EmbeddingOptions { path, max_queue }).map_err(failed)?;
        return Ok(Arc::new(LocalEmbeddings { model, name }));
    }
    let model = ChatModel::load(ChatOptions {
        path,
        threads: config.threads,
        context_size: config.context_size,
        max_queue,
        reader_lag: rialto_local::DEFAULT_READER_LAG,
    })
    .map_err(failed)?;
    tracing::info!(
        model = model_id,
        context = model.info().context_size,
        description = model.info().description,
        "local chat model loaded"
    );
    Ok(Arc::new(LocalChat { model, name }))
}

/// What a local model's failure means to the router and the caller.
fn error(error: LocalError) -> Error {
    match error {
        LocalError::QueueFull => Error::new(
            ErrorCode::Unavailable,
            "The model is busy with other requests. Please try again shortly.",
        ),
        LocalError::Stopped | LocalError::Load(_) => {
            Error::new(ErrorCode::Unavailable, "The model is not available")
        }
        LocalError::ContextLength { .. }
        | LocalError::Template(_)
        | LocalError::InputTooLong { .. } => Error::invalid(error.to_string()),
        LocalError::Inference(_) => {
            tracing::warn!(%error, "local inference failed");
            Error::new(ErrorCode::UpstreamFailed, "The model failed to answer")
        }
    }
}

/// When a request sets no temperature or top_p: SmolLM2's recommended
/// sampling, sensible for small instruct models (OpenAI's default of 1 makes
/// a 135M model ramble).
const DEFAULT_TEMPERATURE: f32 = 0.2;
const DEFAULT_TOP_P: f32 = 0.9;

struct LocalChat {
    model: ChatModel,
    /// The name answers carry in `model`.
    name: String,
}

/// The conversation and sampling an OpenAI chat body asks for.
fn generation(body: &Map<String, Value>) -> Result<Generation> {
    let unsupported = |what: &str| {
        Err(Error::invalid(format!(
            "This model does not support {what}"
        )))
    };
    if body.get("n").and_then(Value::as_u64).unwrap_or(1) > 1 {
        return unsupported("n > 1");
    }
    if body
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
        && body.get("tool_choice").and_then(Value::as_str) != Some("none")
    {
        return unsupported("tools");
    }
    if body.get("logprobs").and_then(Value::as_bool) == Some(true) {
        return unsupported("logprobs");
    }
    let mut messages = Vec::new();
    for message in body
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let role = match message.get("role").and_then(Value::as_str) {
            Some("developer") => "system",
            Some(role) => role,
            None => return Err(Error::invalid("Every message needs a role")),
        };
        messages.push(Message {
            role: role.to_owned(),
            content: text_of(message.get("content")),
        });
    }
    if messages.is_empty() {
        return Err(Error::invalid("messages must not be empty"));
    }
    let number = |key: &str| body.get(key).and_then(Value::as_f64);
    let max_tokens = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    let stop = match body.get("stop") {
        Some(Value::String(stop)) => vec![stop.clone()],
        Some(Value::Array(stops)) => stops
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect(),
        _ => Vec::new(),
    };
    Ok(Generation {
        messages,
        max_tokens,
        temperature: number("temperature").map_or(DEFAULT_TEMPERATURE, |t| t as f32),
        top_p: number("top_p").map_or(DEFAULT_TOP_P, |p| p as f32),
        stop,
        // Any integer seeds; the sampler takes 32 bits.
        seed: body
            .get("seed")
            .and_then(|s| s.as_i64().or_else(|| s.as_u64().map(|u| u as i64)))
            .map(|s| s as u32),
    })
}

/// A message's text: the string, or its text parts joined by newlines.
fn text_of(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn usage(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

fn completion_id() -> String {
    format!("chatcmpl-{}", rialto_core::ids::request_id())
}

#[async_trait]
impl InProcessModel for LocalChat {
    async fn chat(&self, body: &Map<String, Value>) -> Result<Vec<u8>> {
        let mut events = self.model.generate(generation(body)?).map_err(error)?;
        let mut content = String::new();
        while let Some(event) = events.recv().await {
            match event {
                Event::Text(text) => content.push_str(&text),
                Event::Failed(failure) => return Err(error(failure)),
                Event::Done {
                    finish_reason,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    ..
                } => {
                    let answer = json!({
                        "id": completion_id(),
                        "object": "chat.completion",
                        "created": unix_now(),
                        "model": self.name,
                        "choices": [{
                            "index": 0,
                            "message": {"role": "assistant", "content": content},
                            "finish_reason": finish_reason.as_str(),
                            "logprobs": null,
                        }],
                        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
                    });
                    return serde_json::to_vec(&answer).map_err(Error::internal);
                }
            }
        }
        Err(error(LocalError::Stopped))
    }

    async fn chat_stream(&self, body: &Map<String, Value>) -> Result<ChunkStream> {
        let events = self.model.generate(generation(body)?).map_err(error)?;
        let id = completion_id();
        let created = unix_now();
        let name = self.name.clone();
        let chunk = move |delta: Value, finish_reason: Value, usage: Option<Value>| {
            let mut chunk = json!({
                "id": id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "choices": if usage.is_some() { json!([]) } else {
                    json!([{"index": 0, "delta": delta, "finish_reason": finish_reason}])
                },
            });
            if let Some(usage) = usage {
                chunk["usage"] = usage;
            }
            serde_json::to_vec(&chunk).map_err(Error::internal)
        };
        let first = chunk(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
            None,
        );
        let rest = tokio_stream::wrappers::ReceiverStream::new(events).flat_map(move |event| {
            let items = match event {
                Event::Text(text) => vec![chunk(json!({"content": text}), Value::Null, None)],
                Event::Done {
                    finish_reason,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    ..
                } => vec![
                    chunk(json!({}), json!(finish_reason.as_str()), None),
                    chunk(
                        Value::Null,
                        Value::Null,
                        Some(usage(prompt_tokens, completion_tokens, cached_tokens)),
                    ),
                ],
                Event::Failed(failure) => vec![Err(error(failure))],
            };
            futures_util::stream::iter(items)
        });
        Ok(Box::pin(futures_util::stream::iter([first]).chain(rest)))
    }
}

struct LocalEmbeddings {
    model: EmbeddingModel,
    name: String,
}

/// Most inputs one embeddings request may carry (OpenAI's limit).
const MAX_EMBEDDING_INPUTS: usize = 2048;

#[async_trait]
impl InProcessModel for LocalEmbeddings {
    async fn embed(&self, body: &Map<String, Value>) -> Result<Vec<u8>> {
        let inputs: Vec<String> = match body.get("input") {
            Some(Value::String(text)) => vec![text.clone()],
            Some(Value::Array(items)) if items.iter().all(Value::is_string) => items
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
            _ => {
                return Err(Error::invalid(
                    "This model embeds text: input must be a string or an array of strings",
                ));
            }
        };
        if inputs.is_empty() || inputs.len() > MAX_EMBEDDING_INPUTS {
            return Err(Error::invalid(format!(
                "input must hold 1 to {MAX_EMBEDDING_INPUTS} strings"
            )));
        }
        if let Some(dimensions) = body.get("dimensions").and_then(Value::as_u64)
            && dimensions as usize != self.model.dimensions()
        {
            return Err(Error::invalid(format!(
                "This model's embeddings have {} dimensions",
                self.model.dimensions()
            )));
        }
        let base64 = body.get("encoding_format").and_then(Value::as_str) == Some("base64");
        let embeddings = self.model.embed(inputs).await.map_err(error)?;
        let data: Vec<Value> = embeddings
            .vectors
            .iter()
            .enumerate()
            .map(|(index, vector)| {
                let embedding = if base64 {
                    // Little-endian f32s, as OpenAI's base64 format carries them.
                    let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!(base64::Engine::encode(
                        &base64::engine::general_purpose::STANDARD,
                        bytes
                    ))
                } else {
                    json!(vector)
                };
                json!({"object": "embedding", "index": index, "embedding": embedding})
            })
            .collect();
        let answer = json!({
            "object": "list",
            "data": data,
            "model": self.name,
            "usage": {"prompt_tokens": embeddings.tokens, "total_tokens": embeddings.tokens},
        });
        serde_json::to_vec(&answer).map_err(Error::internal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => unreachable!(),
        }
    }

    #[test]
    fn generation_reads_the_openai_parameters() {
        let generation = generation(&body(json!({
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5,
            "stop": "END", "seed": 42,
        })))
        .unwrap();
        assert_eq!(generation.messages[0].role, "system");
        assert_eq!(generation.messages[1].content, "a\nb");
        assert_eq!(generation.max_tokens, Some(7));
        assert_eq!(generation.temperature, 0.0);
        assert_eq!(generation.top_p, 0.5);
        assert_eq!(generation.stop, vec!["END".to_owned()]);
        assert_eq!(generation.seed, Some(42));
    }

    #[test]
    fn what_the_model_cannot_do_is_refused_as_the_callers_error() {
        for extra in [
            json!({"n": 2}),
            json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            json!({"logprobs": true}),
        ] {
            let mut request = json!({"messages": [{"role": "user", "content": "hi"}]});
            for (key, value) in extra.as_object().unwrap() {
                request[key] = value.clone();
            }
            let refused = generation(&body(request)).unwrap_err();
            assert_eq!(refused.code, ErrorCode::InvalidRequest);
        }
    }

    #[test]
    fn a_full_queue_is_unavailable_and_too_long_a_prompt_is_invalid() {
        assert_eq!(error(LocalError::QueueFull).code, ErrorCode::Unavailable);
        let long = LocalError::ContextLength {
            prompt_tokens: 9000,
            max_tokens: 10,
            context_size: 8192,
        };
        assert_eq!(error(long).code, ErrorCode::InvalidRequest);
    }
}
