//! The in-process router: a model's backends, rotation, failover and the
//! HTTP exchange with OpenAI-compatible upstreams.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use rialto_core::config::{BackendConfig, RouterConfig};
use rialto_core::{Error, ErrorCode, ModelConfig, Result};
use rialto_proto::router::v1 as pb;
use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;

use crate::thinking::ThinkStripper;
use crate::{ChatStream, RouterService};

pub struct LocalRouter {
    models: HashMap<String, ModelRoute>,
    http: reqwest::Client,
    request_timeout: Duration,
}

struct ModelRoute {
    backends: Vec<Backend>,
    /// The system prompt put first (the model's, else the service's).
    system_prompt: Option<Value>,
    /// Whether `disable_thinking` sets `chat_template_kwargs.enable_thinking`.
    thinking_kwargs: bool,
    /// Round-robin cursor: each request starts at the next backend.
    next: AtomicUsize,
}

struct Backend {
    /// Public name, in `x-<brand>-model-router`.
    name: String,
    /// `host:port`, for logs only.
    host: String,
    /// Parsed once: reqwest would parse a string on every request.
    chat_url: reqwest::Url,
    upstream_model: String,
    api_key: Option<SecretString>,
}

impl Backend {
    /// `index` names an unnamed backend (`<model>/<index>`): the public
    /// `x-<brand>-model-router` header must not reveal internal addresses.
    fn new(model_id: &str, index: usize, config: &BackendConfig) -> Result<Self> {
        let base = config.url.trim_end_matches('/');
        let chat_url = format!("{base}/chat/completions")
            .parse()
            .map_err(|e| Error::invalid(format!("model {model_id}: backend url: {e}")))?;
        Ok(Self {
            name: config
                .name
                .clone()
                .unwrap_or_else(|| format!("{model_id}/{index}")),
            host: backend_host(base),
            chat_url,
            upstream_model: config.model.clone().unwrap_or_else(|| model_id.to_owned()),
            api_key: config.api_key.clone(),
        })
    }
}

/// `http://10.0.0.5:8000/v1` -> `10.0.0.5:8000`: names a backend in logs
/// without leaking credentials that might sit in a URL's user-info.
fn backend_host(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let host = rest.split('/').next().unwrap_or(rest);
    host.rsplit('@').next().unwrap_or(host).to_owned()
}

/// Why one backend did not serve a request.
enum Attempt {
    /// Retrying on another backend may help.
    Retryable(Error),
    /// The caller's request is at fault, or the failure is final.
    Final(Error),
}

impl LocalRouter {
    pub fn new(models: &[ModelConfig], config: &RouterConfig) -> Result<Self> {
        // reqwest is built without a bundled crypto provider; install ring's
        // once per process (a second install is a harmless no-op error).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let request_timeout = Duration::from_secs(config.request_timeout_secs.max(1));
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(config.connect_timeout_secs.max(1)))
            .read_timeout(request_timeout)
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| Error::internal(format_args!("http client: {e}")))?;
        let models = models
            .iter()
            .map(|model| {
                let prompt = model
                    .system_prompt
                    .clone()
                    .unwrap_or_else(|| config.system_prompt.clone());
                let route = ModelRoute {
                    system_prompt: (!prompt.is_empty()).then_some(Value::String(prompt)),
                    thinking_kwargs: model.thinking_control.as_deref() != Some("none"),
                    backends: model
                        .backends
                        .iter()
                        .enumerate()
                        .map(|(i, b)| Backend::new(&model.id, i, b))
                        .collect::<Result<_>>()?,
                    next: AtomicUsize::new(0),
                };
                Ok((model.id.clone(), route))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            models,
            http,
            request_timeout,
        })
    }

    fn route(&self, model_id: &str) -> Result<&ModelRoute> {
        let route = self
            .models
            .get(model_id)
            .ok_or_else(|| Error::new(ErrorCode::ModelNotFound, "Specified model not found"))?;
        if route.backends.is_empty() {
            return Err(Error::new(
                ErrorCode::Unavailable,
                format!("No backend is configured for model {model_id}"),
            ));
        }
        Ok(route)
    }

    /// Sends `request` to the model's backends in rotation until one answers
    /// with a success status; returns that response and the backend.
    async fn send(
        &self,
        request: &pb::ChatRequest,
        stream: bool,
    ) -> Result<(reqwest::Response, &Backend)> {
        let route = self.route(&request.model_id)?;
        let mut body: serde_json::Map<String, Value> =
            serde_json::from_slice(&request.body_json)
                .map_err(|e| Error::invalid(format!("request body is not a JSON object: {e}")))?;
        let parameters = request.parameters.clone().unwrap_or_default();
        if let Some(Value::Array(messages)) = body.get_mut("messages") {
            // Before the caller's own system prompts: the service's, then
            // the character's.
            if !parameters.character_prompt.is_empty() {
                let prompt = serde_json::json!({"role": "system",
                    "content": parameters.character_prompt});
                messages.insert(0, prompt);
            }
            if let (true, Some(prompt)) = (parameters.include_system_prompt, &route.system_prompt) {
                messages.insert(0, serde_json::json!({"role": "system", "content": prompt}));
            }
        }
        if parameters.disable_thinking && route.thinking_kwargs {
            let kwargs = body
                .entry("chat_template_kwargs")
                .or_insert_with(|| Value::Object(Default::default()));
            if let Value::Object(kwargs) = kwargs {
                kwargs.insert("enable_thinking".into(), Value::Bool(false));
            }
        }
        if stream {
            // Ask for the usage chunk: the final chunk must carry usage and cost.
            let options = body
                .entry("stream_options")
                .or_insert_with(|| Value::Object(Default::default()));
            if let Value::Object(options) = options {
                options.insert("include_usage".into(), Value::Bool(true));
            }
        }
        let count = route.backends.len();
        // Requests with one `prompt_cache_key` start at the same backend
        // (rendezvous hash of the key over the backends' names), so its
        // prefix cache hits; the others rotate.
        let start = match body.get("prompt_cache_key").and_then(Value::as_str) {
            Some(key) if count > 1 => rialto_core::placement::owner_index(
                key,
                route
                    .backends
                    .iter()
                    .map(|b| rialto_core::placement::replica_seed(&b.name)),
            ),
            _ => route.next.fetch_add(1, Ordering::Relaxed),
        };
        let mut last_error = None;
        for offset in 0..count {
            let backend = &route.backends[(start + offset) % count];
            body.insert(
                "model".into(),
                Value::String(backend.upstream_model.clone()),
            );
            match self
                .attempt(backend, &body, stream, &request.request_id)
                .await
            {
                Ok(response) => return Ok((response, backend)),
                Err(Attempt::Final(error)) => return Err(error),
                Err(Attempt::Retryable(error)) => {
                    tracing::warn!(
                        request_id = request.request_id,
                        backend = backend.name,
                        host = backend.host,
                        error = %error,
                        "backend failed, trying the next"
                    );
                    last_error = Some(error);
                }
            }
        }
        Err(last_error
            .unwrap_or_else(|| Error::new(ErrorCode::Unavailable, "No backend available")))
    }

    async fn attempt(
        &self,
        backend: &Backend,
        body: &serde_json::Map<String, Value>,
        stream: bool,
        request_id: &str,
    ) -> Result<reqwest::Response, Attempt> {
        let bytes = serde_json::to_vec(body).map_err(|e| Attempt::Final(Error::internal(e)))?;
        let mut builder = self
            .http
            .post(backend.chat_url.clone())
            .header("content-type", "application/json")
            .header("x-request-id", request_id)
            .body(bytes);
        if !stream {
            builder = builder.timeout(self.request_timeout);
        }
        if let Some(key) = &backend.api_key {
            builder = builder.bearer_auth(key.expose_secret());
        }
        let response = builder.send().await.map_err(|e| {
            if e.is_timeout() {
                Attempt::Retryable(Error::new(
                    ErrorCode::Timeout,
                    "The model's backend timed out",
                ))
            } else {
                Attempt::Retryable(Error::new(
                    ErrorCode::Unavailable,
                    "No backend of the model is reachable",
                ))
            }
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let code = status.as_u16();
        let detail = upstream_message(response).await;
        tracing::info!(
            request_id,
            backend = backend.name,
            host = backend.host,
            status = code,
            detail,
            "upstream error"
        );
        Err(match code {
            429 => Attempt::Retryable(Error::new(
                ErrorCode::RateLimited,
                "The model is currently overloaded. Please try again later.",
            )),
            // The backend's own credentials or address are wrong: the
            // operator's fault, and another backend may be fine. The detail
            // (which may quote a key) stays in the log.
            401 | 403 | 404 | 408 | 500..=599 => Attempt::Retryable(Error::new(
                ErrorCode::UpstreamFailed,
                format!("The model's backend failed (status {code})"),
            )),
            // Any other 4xx blames the request: another backend would refuse
            // it too. Its message helps the caller fix it.
            _ => Attempt::Final(Error::invalid(truncated(detail, 500))),
        })
    }
}

fn truncated(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// The message of an upstream error body, in any of the usual shapes.
async fn upstream_message(response: reqwest::Response) -> String {
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    let message = match &body["error"] {
        Value::String(message) => Some(message.clone()),
        Value::Object(error) => error
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => body
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_owned),
    };
    message.unwrap_or_else(|| format!("The model's backend refused the request (status {status})"))
}

#[async_trait]
impl RouterService for LocalRouter {
    async fn chat(&self, request: pb::ChatRequest) -> Result<pb::ChatResponse> {
        let strip = stripping(&request);
        let (response, backend) = self.send(&request, false).await?;
        let body = response.bytes().await.map_err(|e| {
            if e.is_timeout() {
                Error::new(ErrorCode::Timeout, "The model's backend timed out")
            } else {
                Error::new(
                    ErrorCode::UpstreamFailed,
                    "The model's backend broke off its answer",
                )
            }
        })?;
        let body_json = if strip {
            strip_answer(&body).unwrap_or_else(|| body.to_vec())
        } else {
            body.to_vec()
        };
        Ok(pb::ChatResponse {
            body_json,
            backend: backend.name.clone(),
        })
    }

    async fn chat_stream(&self, request: pb::ChatRequest) -> Result<ChatStream> {
        let strip = stripping(&request);
        let (response, backend) = self.send(&request, true).await?;
        // One stripper per choice: with n > 1 the choices interleave.
        let mut strippers: HashMap<u64, ThinkStripper> = HashMap::new();
        let first = futures_util::stream::once(std::future::ready(Ok(pb::ChatStreamEvent {
            event: Some(pb::chat_stream_event::Event::Backend(backend.name.clone())),
        })));
        let request_id = Arc::<str>::from(request.request_id);
        let chunks = response
            .bytes_stream()
            .eventsource()
            .take_while(|event| {
                let done = matches!(event, Ok(event) if event.data.trim() == "[DONE]");
                std::future::ready(!done)
            })
            .filter_map(move |event| {
                let item = match event {
                    Ok(event) if event.data.trim().is_empty() => None,
                    Ok(event) => {
                        let data = if strip {
                            strip_chunk(&event.data, &mut strippers)
                                .unwrap_or_else(|| event.data.into_bytes())
                        } else {
                            event.data.into_bytes()
                        };
                        Some(Ok(pb::ChatStreamEvent {
                            event: Some(pb::chat_stream_event::Event::ChunkJson(data)),
                        }))
                    }
                    Err(error) => {
                        tracing::warn!(request_id = %request_id, %error, "upstream stream broke");
                        Some(Err(Error::new(
                            ErrorCode::UpstreamFailed,
                            "The model's backend broke off its answer",
                        )))
                    }
                };
                std::future::ready(item)
            });
        // Nothing follows a broken upstream: end after the first error.
        let mut failed = false;
        let chunks = chunks.take_while(move |item| {
            let keep = !failed;
            failed |= item.is_err();
            std::future::ready(keep)
        });
        Ok(Box::pin(first.chain(chunks)))
    }
}

/// Whether the answer loses its think blocks.
fn stripping(request: &pb::ChatRequest) -> bool {
    request
        .parameters
        .as_ref()
        .is_some_and(|p| p.strip_thinking || p.disable_thinking)
}

/// A whole answer without think blocks in any choice's content; None when
/// it is not JSON (then relayed as is, for the gateway to refuse).
fn strip_answer(body: &[u8]) -> Option<Vec<u8>> {
    let mut answer: Value = serde_json::from_slice(body).ok()?;
    if let Some(Value::Array(choices)) = answer.get_mut("choices") {
        for choice in choices {
            if let Some(Value::String(content)) = choice.pointer_mut("/message/content") {
                *content = crate::thinking::strip(content);
            }
        }
    }
    serde_json::to_vec(&answer).ok()
}

/// One stream chunk with each choice's content passed through its
/// stripper; what a stripper still holds is released with the choice's
/// `finish_reason`. `reasoning_content` is left as received.
fn strip_chunk(data: &str, strippers: &mut HashMap<u64, ThinkStripper>) -> Option<Vec<u8>> {
    let mut chunk: Value = serde_json::from_str(data).ok()?;
    if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
        for choice in choices {
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            let finished = choice
                .get("finish_reason")
                .is_some_and(|reason| !reason.is_null());
            let stripper = strippers.entry(index).or_default();
            let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) else {
                continue;
            };
            let mut visible = match delta.get("content") {
                Some(Value::String(content)) => stripper.push(content),
                _ => String::new(),
            };
            if finished {
                visible.push_str(&stripper.finish());
            }
            if delta.contains_key("content") || !visible.is_empty() {
                delta.insert("content".into(), Value::String(visible));
            }
        }
    }
    serde_json::to_vec(&chunk).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rialto_test_kit::MockUpstream;

    fn models(urls: &[String]) -> Vec<ModelConfig> {
        let backends: Vec<String> = urls
            .iter()
            .map(|u| format!("{{ kind = \"openai\", url = \"{u}\", model = \"mock-model\" }}"))
            .collect();
        let toml = format!(
            "[[models]]\nid = \"m\"\nbackends = [{}]\n",
            backends.join(", ")
        );
        rialto_core::Config::from_toml(&toml).unwrap().models
    }

    fn request(body: Value) -> pb::ChatRequest {
        pb::ChatRequest {
            request_id: "r1".into(),
            model_id: "m".into(),
            body_json: serde_json::to_vec(&body).unwrap(),
            parameters: None,
        }
    }

    fn hello() -> Value {
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    }

    #[tokio::test]
    async fn relays_to_the_upstream_with_its_model_name() {
        let mock = MockUpstream::start().await.unwrap();
        let router = LocalRouter::new(&models(&[mock.base_url()]), &Default::default()).unwrap();
        let response = router.chat(request(hello())).await.unwrap();
        let body: Value = serde_json::from_slice(&response.body_json).unwrap();
        assert_eq!(
            body["choices"][0]["message"]["content"],
            "Hello from mock: hi"
        );
        assert_eq!(mock.requests()[0]["model"], "mock-model");
        assert_eq!(response.backend, "m/0");
    }

    #[tokio::test]
    async fn fails_over_from_a_dead_backend() {
        let mock = MockUpstream::start().await.unwrap();
        // Port 9 on loopback: nothing listens, the connection is refused.
        let dead = "http://127.0.0.1:9/v1".to_owned();
        let router =
            LocalRouter::new(&models(&[dead, mock.base_url()]), &Default::default()).unwrap();
        for _ in 0..4 {
            router.chat(request(hello())).await.unwrap();
        }
        assert_eq!(mock.request_count(), 4);
    }

    #[tokio::test]
    async fn no_reachable_backend_is_unavailable() {
        let dead = "http://127.0.0.1:9/v1".to_owned();
        let router = LocalRouter::new(&models(&[dead]), &Default::default()).unwrap();
        let error = router.chat(request(hello())).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::Unavailable);
    }

    #[tokio::test]
    async fn upstream_4xx_blames_the_request_and_5xx_the_backend() {
        let mock = MockUpstream::start().await.unwrap();
        let router = LocalRouter::new(&models(&[mock.base_url()]), &Default::default()).unwrap();
        let mut body = hello();
        body["mock"] = serde_json::json!({"status": 400});
        let error = router.chat(request(body.clone())).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidRequest);
        body["mock"] = serde_json::json!({"status": 500});
        let error = router.chat(request(body)).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::UpstreamFailed);
    }

    #[tokio::test]
    async fn streams_name_the_backend_then_relay_chunks_with_usage() {
        let mock = MockUpstream::start().await.unwrap();
        let router = LocalRouter::new(&models(&[mock.base_url()]), &Default::default()).unwrap();
        let mut body = hello();
        body["stream"] = Value::Bool(true);
        let events: Vec<_> = router
            .chat_stream(request(body))
            .await
            .unwrap()
            .collect()
            .await;
        assert!(matches!(
            &events[0],
            Ok(pb::ChatStreamEvent {
                event: Some(pb::chat_stream_event::Event::Backend(_))
            })
        ));
        let last = match events.last() {
            Some(Ok(pb::ChatStreamEvent {
                event: Some(pb::chat_stream_event::Event::ChunkJson(json)),
            })) => serde_json::from_slice::<Value>(json).unwrap(),
            other => panic!("unexpected last event {other:?}"),
        };
        assert!(last["usage"]["total_tokens"].as_u64().unwrap() > 0);
        assert_eq!(mock.requests()[0]["stream_options"]["include_usage"], true);
    }

    #[tokio::test]
    async fn a_broken_stream_ends_with_one_error() {
        let mock = MockUpstream::start().await.unwrap();
        let router = LocalRouter::new(&models(&[mock.base_url()]), &Default::default()).unwrap();
        let mut body = hello();
        body["stream"] = Value::Bool(true);
        body["mock"] = serde_json::json!({"fail_after_chunks": 2});
        let events: Vec<_> = router
            .chat_stream(request(body))
            .await
            .unwrap()
            .collect()
            .await;
        assert!(events.last().unwrap().is_err());
        assert_eq!(events.iter().filter(|e| e.is_err()).count(), 1);
    }

    #[test]
    fn backend_hosts_hide_credentials() {
        assert_eq!(
            backend_host("https://user:pw@api.example.com/v1"),
            "api.example.com"
        );
        assert_eq!(backend_host("http://127.0.0.1:8000/v1"), "127.0.0.1:8000");
    }

    #[tokio::test]
    async fn a_backend_refusing_its_credentials_fails_over_without_leaking() {
        let bad = MockUpstream::start().await.unwrap();
        let good = MockUpstream::start().await.unwrap();
        let router = LocalRouter::new(
            &models(&[bad.base_url(), good.base_url()]),
            &Default::default(),
        )
        .unwrap();
        let mut body = hello();
        body["mock"] = serde_json::json!({"status": 401});
        // Both mocks obey the directive, so both fail: a 502, not the 401.
        let error = router.chat(request(body)).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::UpstreamFailed);
        assert!(!error.message.contains("mock failure"));
        assert_eq!(bad.request_count() + good.request_count(), 2);
    }
}
