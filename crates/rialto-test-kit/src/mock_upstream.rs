//! A mock OpenAI-compatible upstream (chat completions and media) for tests and benchmarks.
//!
//! [`MockUpstream`] runs an actix-web server on its own thread (with its own actix `System`), so it
//! works from `#[tokio::test]` and plain tokio code alike. It serves `GET /v1/models`,
//! `POST /v1/chat/completions` (plain and SSE streaming) and OpenAI's media calls (see
//! [`crate::mock_media`]): `POST /v1/images/generations` and `/v1/images/edits` (real PNG, JPEG
//! or WebP made at request time), `POST /v1/audio/speech` (a streamed WAV or raw PCM tone that
//! carries its text) and `POST /v1/audio/transcriptions` (which reads that text back). It records
//! every request's body (a multipart form as JSON), path and headers, and obeys per-request
//! directives in the chat body field `mock`:
//! `reply`, `words`, `status`, `delay_ms`, `chunk_delay_ms`, `first_chunk_delay_ms` (a
//! stream's head leaves at once, its first chunk this much later), `fail_after_chunks`,
//! `cached_tokens`, `cache_write_tokens` and `prompt_tokens` (reported in
//! the usage), and `tool_call` (`{name, arguments}`: called when the
//! request offers that function, streamed or not).
//! [`MockUpstream::fail_next`] makes this one mock (not its siblings) fail its
//! next requests (chat or media), which is how a test fails one backend of several. The
//! server stops when the [`MockUpstream`] is dropped or [`MockUpstream::stop`]ped.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix_web::dev::ServerHandle;
use actix_web::http::{StatusCode, header};
use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use anyhow::Context as _;
use bytes::Bytes;
use serde_json::{Value, json};

use crate::{mock_media, mock_video};

/// One recorded request: the parsed body (a multipart form as JSON), its path and its headers.
struct Recorded {
    body: Value,
    path: String,
    headers: header::HeaderMap,
}

#[derive(Default)]
pub(crate) struct State {
    log: Mutex<Vec<Recorded>>,
    counter: AtomicU64,
    /// Requests (chat or media) still to fail, and with which status.
    failing: Mutex<(usize, u16)>,
    /// `GET /v1/models` requests served (health checks).
    model_lists: AtomicU64,
    /// Video jobs (`/v1/videos`).
    pub(crate) videos: crate::mock_video::Videos,
}

impl State {
    fn log(&self) -> MutexGuard<'_, Vec<Recorded>> {
        // A poisoned lock only means a handler panicked; the log itself is still usable.
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `body` as what `req` sent.
    fn record(&self, req: &HttpRequest, body: Value) {
        self.log().push(Recorded {
            body,
            path: req.path().to_owned(),
            headers: req.headers().clone(),
        });
    }

    /// Records `body` as what `req` sent, then the failure
    /// [`MockUpstream::fail_next`] still owes, if any (the request is
    /// recorded either way).
    pub(crate) fn record_or_fail(&self, req: &HttpRequest, body: Value) -> Option<HttpResponse> {
        self.record(req, body);
        self.take_failure()
    }

    /// The failure [`MockUpstream::fail_next`] still owes, if any, counting it as given.
    fn take_failure(&self) -> Option<HttpResponse> {
        let code = {
            let mut failing = self.failing.lock().unwrap_or_else(|e| e.into_inner());
            (failing.0 > 0).then(|| {
                failing.0 -= 1;
                failing.1
            })
        }?;
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Some(error_response(
            status,
            "mock failure",
            "server_error",
            "mock_failure",
        ))
    }
}

/// A running mock upstream; stops its server when dropped.
pub struct MockUpstream {
    addr: SocketAddr,
    state: Arc<State>,
    handle: ServerHandle,
    /// Disconnects when the server thread exits.
    done: mpsc::Receiver<()>,
}

impl MockUpstream {
    /// Starts the mock on `127.0.0.1` with an OS-chosen port.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Starts the mock on `addr` with one worker.
    pub async fn start_on(addr: SocketAddr) -> anyhow::Result<Self> {
        Self::start_with_workers(addr, 1).await
    }

    /// Starts the mock on `addr` with `workers` actix worker threads (at least one).
    pub async fn start_with_workers(addr: SocketAddr, workers: usize) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(addr).with_context(|| format!("binding {addr}"))?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State::default());
        let data = web::Data::from(Arc::clone(&state));
        let (handle_tx, handle_rx) = tokio::sync::oneshot::channel();
        let (done_tx, done) = mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("mock-upstream".into())
            .spawn(move || {
                let _done_tx = done_tx; // dropped when this thread ends
                actix_web::rt::System::new().block_on(async move {
                    let server = HttpServer::new(move || {
                        App::new()
                            .app_data(data.clone())
                            .app_data(web::PayloadConfig::new(64 * 1024 * 1024))
                            .route("/v1/models", web::get().to(models))
                            .route("/v1/chat/completions", web::post().to(chat))
                            .route(
                                "/v1/images/generations",
                                web::post().to(mock_media::image_generations),
                            )
                            .route("/v1/images/edits", web::post().to(mock_media::image_edits))
                            .route("/v1/image/upscale", web::post().to(mock_media::upscale))
                            .route("/v1/audio/speech", web::post().to(mock_media::speech))
                            .route(
                                "/v1/audio/transcriptions",
                                web::post().to(mock_media::transcriptions),
                            )
                            .route("/v1/videos", web::post().to(mock_video::create))
                            .route("/v1/videos/{id}", web::get().to(mock_video::retrieve))
                            .route(
                                "/v1/videos/{id}/content",
                                web::get().to(mock_video::content),
                            )
                    })
                    .workers(workers.max(1))
                    .disable_signals()
                    .shutdown_timeout(1)
                    .listen(listener);
                    match server {
                        Ok(server) => {
                            let server = server.run();
                            let _ = handle_tx.send(Ok(server.handle()));
                            let _ = server.await;
                        }
                        Err(e) => {
                            let _ = handle_tx.send(Err(e));
                        }
                    }
                });
            })?;
        let handle = handle_rx
            .await
            .context("mock upstream thread exited before starting")?
            .context("starting mock upstream server")?;
        Ok(Self {
            addr,
            state,
            handle,
            done,
        })
    }

    /// The address the mock listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The OpenAI base URL, e.g. `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Every request body received, in order: chat and JSON media bodies as
    /// sent (valid JSON only), multipart forms as an object of their fields
    /// (see [`crate::mock_media`]).
    pub fn requests(&self) -> Vec<Value> {
        self.state
            .log()
            .iter()
            .map(|entry| entry.body.clone())
            .collect()
    }

    /// The path of each recorded request (e.g. `/v1/audio/speech`), in the
    /// same order as [`Self::requests`].
    pub fn paths(&self) -> Vec<String> {
        self.state
            .log()
            .iter()
            .map(|entry| entry.path.clone())
            .collect()
    }

    /// The `Authorization` header of each recorded request, in the same order as [`Self::requests`].
    pub fn authorization_headers(&self) -> Vec<Option<String>> {
        self.header_values("authorization")
    }

    /// The value of header `name` on each recorded request, in order.
    pub fn header_values(&self, name: &str) -> Vec<Option<String>> {
        self.state
            .log()
            .iter()
            .map(|entry| {
                entry
                    .headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            })
            .collect()
    }

    /// Makes the next `count` chat or media requests to this mock answer `status`
    /// (with an OpenAI error body), whatever they ask; they are recorded.
    pub fn fail_next(&self, count: usize, status: u16) {
        *self.state.failing.lock().unwrap_or_else(|e| e.into_inner()) = (count, status);
    }

    /// How many `GET /v1/models` requests (health checks) were served.
    pub fn model_list_count(&self) -> u64 {
        self.state.model_lists.load(Ordering::Relaxed)
    }

    /// Stops the server at once, as a crash would: connections in progress
    /// are dropped and the port refuses new ones.
    pub async fn stop(self) {
        self.handle.stop(false).await;
    }

    /// How many requests (chat and media) were recorded.
    /// Video jobs created so far (`POST /v1/videos` accepted).
    pub fn videos_created(&self) -> usize {
        self.state.videos.count()
    }

    pub fn request_count(&self) -> usize {
        self.state.log().len()
    }

    /// Forgets all recorded requests.
    pub fn clear_requests(&self) {
        self.state.log().clear();
    }
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        // `stop` sends its command eagerly; the returned future only waits for completion.
        drop(self.handle.stop(false));
        // Give the server thread a moment to release the port, but never block forever.
        let _ = self.done.recv_timeout(Duration::from_secs(2));
    }
}

async fn models(state: web::Data<State>) -> HttpResponse {
    state.model_lists.fetch_add(1, Ordering::Relaxed);
    HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [{"id": "mock-model", "object": "model", "created": 0, "owned_by": "mock"}]
    }))
}

fn error_response(status: StatusCode, message: &str, kind: &str, code: &str) -> HttpResponse {
    HttpResponse::build(status).json(json!({
        "error": {"message": message, "type": kind, "code": code, "param": null}
    }))
}

/// The text of a message's `content`: a string, or the `text` parts of an array joined by spaces.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter(|p| p["type"] == "text")
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

fn word_count(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

/// Truncates `text` to `max` words if it is longer, returning the text and its finish reason.
fn truncate(text: String, max: Option<u64>) -> (String, &'static str) {
    match max {
        Some(max) if word_count(&text) > max => {
            let words: Vec<&str> = text.split_whitespace().take(max as usize).collect();
            (words.join(" "), "length")
        }
        _ => (text, "stop"),
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn chat(req: HttpRequest, raw: web::Bytes, state: web::Data<State>) -> HttpResponse {
    let body: Value = match serde_json::from_slice(&raw) {
        Ok(v) => v,
        Err(e) => {
            let msg = format!("invalid JSON body: {e}");
            return error_response(
                StatusCode::BAD_REQUEST,
                &msg,
                "invalid_request_error",
                "invalid_json",
            );
        }
    };
    if let Some(failure) = state.record_or_fail(&req, body.clone()) {
        return failure;
    }

    let mock = &body["mock"];
    let directive = |key: &str| mock[key].as_u64();
    if let Some(ms) = directive("delay_ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(code) = directive("status") {
        let status = u16::try_from(code)
            .ok()
            .and_then(|c| StatusCode::from_u16(c).ok())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return error_response(status, "mock failure", "server_error", "mock_failure");
    }

    let messages = body["messages"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let base = if let Some(n) = directive("words") {
        (1..=n)
            .map(|i| format!("w{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    } else if let Some(reply) = mock["reply"].as_str() {
        reply.to_owned()
    } else {
        let last_user = messages.iter().rev().find(|m| m["role"] == "user");
        let text = last_user
            .map(|m| content_text(&m["content"]))
            .unwrap_or_default();
        format!("Hello from mock: {text}")
    };
    let n = body["n"].as_u64().unwrap_or(1).clamp(1, 128) as usize;
    let max = body["max_completion_tokens"]
        .as_u64()
        .or(body["max_tokens"].as_u64());
    let choices: Vec<(String, &str)> = (0..n)
        .map(|i| match i {
            0 => truncate(base.clone(), max),
            _ => truncate(format!("{base} (choice {i})"), max),
        })
        .collect();

    // `prompt_tokens`: a tokenizer that counts more than the gateway's
    // estimate (what a hold cannot know in advance).
    let prompt_tokens = directive("prompt_tokens").unwrap_or_else(|| {
        messages
            .iter()
            .map(|m| word_count(&content_text(&m["content"])))
            .sum::<u64>()
            .max(1)
    });
    let completion_tokens = choices.first().map_or(0, |(t, _)| word_count(t)) * n as u64;
    let mut usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    // A prompt cache's report: `cached_tokens` read from it,
    // `cache_write_tokens` written to it.
    if directive("cached_tokens").is_some() || directive("cache_write_tokens").is_some() {
        usage["prompt_tokens_details"] = json!({
            "cached_tokens": directive("cached_tokens").unwrap_or(0),
            "cache_creation_input_tokens": directive("cache_write_tokens").unwrap_or(0),
        });
    }
    let id = format!(
        "chatcmpl-mock{}",
        state.counter.fetch_add(1, Ordering::Relaxed) + 1
    );
    let created = unix_now();
    let model = body["model"].as_str().unwrap_or("mock-model");

    // `tool_call: {name, arguments}`: when the request offers a function
    // of that name, the (non-streamed) answer calls it instead of writing.
    let offered = |name: &str| {
        body["tools"]
            .as_array()
            .is_some_and(|tools| tools.iter().any(|t| t["function"]["name"] == name))
    };
    let streamed = body["stream"].as_bool() == Some(true);
    if let Some(name) = mock["tool_call"]["name"].as_str()
        && offered(name)
        && streamed
    {
        // The call in two deltas (name, then arguments), as servers stream it.
        let chunk = |choice: Value| {
            format!(
                "data: {}\n\n",
                json!({"id": id, "object": "chat.completion.chunk", "created": created,
                       "model": model, "choices": [choice]})
            )
        };
        let mut events = vec![
            chunk(
                json!({"index": 0, "finish_reason": null, "delta": {"role": "assistant",
                "tool_calls": [{"index": 0, "id": "call_mock", "type": "function",
                    "function": {"name": name, "arguments": ""}}]}}),
            ),
            chunk(
                json!({"index": 0, "finish_reason": null, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": mock["tool_call"]["arguments"].to_string()}}]}}),
            ),
            chunk(json!({"index": 0, "finish_reason": "tool_calls", "delta": {}})),
        ];
        if body["stream_options"]["include_usage"].as_bool() == Some(true) {
            let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": 10,
                "total_tokens": prompt_tokens + 10});
            events.push(format!(
                "data: {}\n\n",
                json!({"id": id, "object": "chat.completion.chunk", "created": created,
                       "model": model, "choices": [], "usage": usage})
            ));
        }
        events.push("data: [DONE]\n\n".to_owned());
        return HttpResponse::Ok()
            .content_type("text/event-stream")
            .body(events.concat());
    }
    if let Some(name) = mock["tool_call"]["name"].as_str()
        && offered(name)
        && !streamed
    {
        let call = json!({"id": "call_mock", "type": "function", "function": {
            "name": name, "arguments": mock["tool_call"]["arguments"].to_string()}});
        return HttpResponse::Ok().json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "logprobs": null, "finish_reason": "tool_calls",
                "message": {"role": "assistant", "content": null, "tool_calls": [call]}}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 10,
                "total_tokens": prompt_tokens + 10},
        }));
    }

    if body["stream"].as_bool() != Some(true) {
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(i, (text, finish))| {
                json!({
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": null,
                    "finish_reason": finish,
                })
            })
            .collect();
        return HttpResponse::Ok().json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": "fp_mock", "choices": choices, "usage": usage,
        }));
    }

    let chunk = |choices: Value, usage: Option<&Value>| {
        let mut c = json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": "fp_mock", "choices": choices,
        });
        if let Some(u) = usage {
            c["usage"] = u.clone();
        }
        format!("data: {c}\n\n")
    };
    let delta = |i: usize, delta: Value, finish: Option<&str>| {
        chunk(
            json!([{"index": i, "delta": delta, "logprobs": null, "finish_reason": finish}]),
            None,
        )
    };
    let mut events: Vec<String> = (0..n)
        .map(|i| delta(i, json!({"role": "assistant", "content": ""}), None))
        .collect();
    let words: Vec<Vec<&str>> = choices
        .iter()
        .map(|(t, _)| t.split_whitespace().collect())
        .collect();
    let longest = words.iter().map(Vec::len).max().unwrap_or(0);
    for w in 0..longest {
        for (i, choice_words) in words.iter().enumerate() {
            if let Some(word) = choice_words.get(w) {
                let piece = if w + 1 < choice_words.len() {
                    format!("{word} ")
                } else {
                    (*word).to_owned()
                };
                events.push(delta(i, json!({"content": piece}), None));
            }
        }
    }
    for (i, (_, finish)) in choices.iter().enumerate() {
        events.push(delta(i, json!({}), Some(finish)));
    }
    if body["stream_options"]["include_usage"].as_bool() == Some(true) {
        events.push(chunk(json!([]), Some(&usage)));
    }
    events.push("data: [DONE]\n\n".to_owned());

    let mut items: Vec<Result<Bytes, std::io::Error>> =
        events.into_iter().map(|e| Ok(Bytes::from(e))).collect();
    if let Some(k) = directive("fail_after_chunks").map(|k| k as usize)
        && k < items.len()
    {
        items.truncate(k);
        items.push(Err(std::io::Error::other("mock: fail_after_chunks")));
    }
    let chunk_delay = directive("chunk_delay_ms").map(Duration::from_millis);
    let first_chunk_delay = directive("first_chunk_delay_ms").map(Duration::from_millis);
    let stream = futures_util::stream::unfold(
        (items.into_iter(), false),
        move |(mut it, started)| async move {
            let item = it.next()?;
            let delay = if started {
                chunk_delay
            } else {
                first_chunk_delay
            };
            if let Some(d) = delay {
                tokio::time::sleep(d).await;
            }
            if item.is_err() {
                // Let actix flush the status line and earlier chunks before aborting the connection,
                // so the client sees a started-then-broken stream rather than no response at all.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Some((item, (it, true)))
        },
    );
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .streaming(stream)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt as _;

    fn client() -> reqwest::Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::new()
    }

    async fn post(mock: &MockUpstream, body: Value) -> reqwest::Response {
        client()
            .post(format!("{}/chat/completions", mock.base_url()))
            .bearer_auth("sk-test")
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    /// Reads a body to its end; returns the text received and whether it ended in an error.
    async fn read_all(resp: reqwest::Response) -> (String, bool) {
        let mut text = String::new();
        let mut stream = resp.bytes_stream();
        while let Some(item) = stream.next().await {
            match item {
                Ok(b) => text.push_str(&String::from_utf8_lossy(&b)),
                Err(_) => return (text, true),
            }
        }
        (text, false)
    }

    fn data_events(text: &str) -> Vec<&str> {
        text.split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .collect()
    }

    #[tokio::test]
    async fn non_stream_reply_and_usage() {
        let mock = MockUpstream::start().await.unwrap();
        let models: Value = client()
            .get(format!("{}/models", mock.base_url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(models["data"][0]["id"], "mock-model");

        let body = json!({"model": "m1", "messages": [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
        ]});
        let resp = post(&mock, body.clone()).await;
        assert_eq!(resp.status(), 200);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["model"], "m1");
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(
            v["choices"][0]["message"]["content"],
            "Hello from mock: hi there"
        );
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9})
        );
        assert_eq!(mock.requests(), vec![body]);
        assert_eq!(
            mock.authorization_headers(),
            vec![Some("Bearer sk-test".to_owned())]
        );

        let v: Value = post(
            &mock,
            json!({"model": "m", "max_tokens": 2, "mock": {"words": 10}}),
        )
        .await
        .json()
        .await
        .unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "w1 w2");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(mock.request_count(), 2);

        let resp = client()
            .post(format!("{}/chat/completions", mock.base_url()))
            .body("{not json")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);
        assert_eq!(mock.request_count(), 2);
    }

    #[tokio::test]
    async fn n_gives_distinct_choices() {
        let mock = MockUpstream::start().await.unwrap();
        let body = json!({"model": "m", "n": 2, "mock": {"reply": "one two"}, "messages": []});
        let v: Value = post(&mock, body).await.json().await.unwrap();
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2);
        assert_eq!(choices[0]["message"]["content"], "one two");
        assert_eq!(choices[1]["index"], 1);
        assert_ne!(
            choices[0]["message"]["content"],
            choices[1]["message"]["content"]
        );
        assert_eq!(v["usage"]["completion_tokens"], 4);
    }

    #[tokio::test]
    async fn stream_ends_with_usage_then_done() {
        let mock = MockUpstream::start().await.unwrap();
        let body = json!({"model": "m", "stream": true, "stream_options": {"include_usage": true},
            "mock": {"reply": "a b c", "chunk_delay_ms": 5}, "messages": [{"role": "user", "content": "x"}]});
        let resp = post(&mock, body).await;
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let (text, errored) = read_all(resp).await;
        assert!(!errored);
        let events = data_events(&text);
        assert_eq!(events.last(), Some(&"[DONE]"));
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let usage = chunks.last().unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], 3);
        let content: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(content, "a b c");
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(
            chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
            "stop"
        );
        assert!(
            chunks
                .iter()
                .all(|c| c["object"] == "chat.completion.chunk")
        );
    }

    #[tokio::test]
    async fn a_streams_head_leaves_before_its_delayed_first_chunk() {
        let mock = MockUpstream::start().await.unwrap();
        let body = json!({"model": "m", "stream": true,
            "mock": {"reply": "a b", "first_chunk_delay_ms": 1500}, "messages": []});
        let start = std::time::Instant::now();
        let mut resp = post(&mock, body).await;
        let head = start.elapsed();
        assert!(head < Duration::from_millis(1000), "the head took {head:?}");
        resp.chunk().await.unwrap().unwrap();
        let first = start.elapsed();
        assert!(
            first >= Duration::from_millis(1500),
            "the first chunk came at {first:?}"
        );
    }

    #[tokio::test]
    async fn status_directive_returns_that_status() {
        let mock = MockUpstream::start().await.unwrap();
        let resp = post(&mock, json!({"model": "m", "mock": {"status": 503}})).await;
        assert_eq!(resp.status(), 503);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["code"], "mock_failure");
    }

    #[tokio::test]
    async fn fail_after_chunks_truncates_stream() {
        let mock = MockUpstream::start().await.unwrap();
        let body =
            json!({"model": "m", "stream": true, "mock": {"words": 20, "fail_after_chunks": 3}});
        let (text, errored) = read_all(post(&mock, body).await).await;
        assert!(errored, "stream should end with an error");
        assert!(!text.contains("[DONE]"));
        assert_eq!(data_events(&text).len(), 3, "three chunks before the abort");
    }
}
