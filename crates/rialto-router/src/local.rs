//! The in-process router: a model's backends, which one serves a request,
//! retries and failover, and the exchange with a backend, over HTTP or in
//! this process.
//!
//! One request's path through [`LocalRouter::dispatch`]: pick a backend
//! whose circuit lets requests through (weighted power of two choices over
//! requests in flight, or the `prompt_cache_key`'s rendezvous owner),
//! preferring backends this request has not tried yet; send; on a failure
//! that another attempt may cure, wait a jittered backoff and pick again,
//! up to `router.max_retries` times. Every outcome is reported to the
//! backend's circuit breaker (`health.rs`). Once a backend has accepted the
//! request (a whole answer read, or a stream's headers), the request is
//! never sent again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use futures_util::StreamExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use rialto_core::config::{BackendConfig, RouterConfig};
use rialto_core::{Error, ErrorCode, ModelConfig, Result};
use rialto_proto::router::v1 as pb;
use secrecy::ExposeSecret;
use serde_json::{Map, Value};
use tracing::Instrument as _;

use crate::balance::{self, MAX_BACKENDS, bit};
use crate::clients::Clients;
use crate::health::{self, BackendHealth, Breaker, Health, InFlight, Permit, Probe};
use crate::inprocess::{ChunkStream, InProcessModel};
use crate::sse::broken_off;
use crate::thinking::ThinkStripper;
use crate::upstream;
use crate::{Chat, ChatStream, MediaStream, RouterService};

pub struct LocalRouter {
    /// Each model's route. A configuration reload ([`LocalRouter::reload`])
    /// replaces the map whole; a request keeps the route it started with.
    models: ArcSwap<Routes>,
    http: Clients,
    /// Chat and embeddings calls to plain-`http` backends.
    upstreams: upstream::Upstreams,
    retry: Retry,
    /// `[router]` as the process started: backends a reload builds use it
    /// too.
    settings: RouterConfig,
    /// Seconds the HTTP clients wait between two reads of an answer (set
    /// at start from the longest backend timeout).
    read_timeout_secs: u64,
    /// Builds the `local` backends (loads their models).
    load: Box<Loader>,
}

/// What builds a `local` backend's model.
type Loader = dyn Fn(&str, &BackendConfig) -> Result<Arc<dyn InProcessModel>> + Send + Sync;

struct Retry {
    max: u32,
    base: Duration,
    cap: Duration,
}

struct ModelRoute {
    /// Shared with the routes before and after a reload that kept them.
    backends: Vec<Arc<Backend>>,
    /// The system prompt put first (the model's, else the service's).
    system_prompt: Option<Value>,
    /// Whether `disable_thinking` sets `chat_template_kwargs.enable_thinking`.
    thinking_kwargs: bool,
}

struct Backend {
    /// Public name, in `x-<brand>-model-router`.
    name: String,
    /// `host:port`, or `in-process`: for logs only.
    host: String,
    upstream_model: String,
    /// Share of the model's traffic (at least 1).
    weight: u32,
    /// Rendezvous seed of `name`, for `prompt_cache_key`.
    seed: u64,
    /// How long a whole non-streamed answer, or a stream's first response,
    /// may take.
    timeout: Duration,
    transport: Transport,
    health: Arc<Health>,
    /// `rialto_backend_requests_total` by outcome, looked up once: the
    /// request path only increments an atomic.
    outcomes: [Counter; OUTCOMES.len()],
    /// `rialto_time_to_first_token_seconds` and
    /// `rialto_time_per_output_token_seconds` of this backend.
    token_timing: TokenTiming,
    /// What it was built from: a reload keeps the backend when its
    /// configuration is the same.
    config: BackendConfig,
    /// Its circuit breaker's watcher, stopped when the backend is dropped
    /// (with the router, or once a reload removed it and its last request
    /// ended).
    watcher: Option<Watching>,
}

/// A backend's watcher task, aborted on drop.
struct Watching(tokio::task::AbortHandle);

impl Drop for Watching {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A backend's token-timing histograms, looked up once.
#[derive(Clone)]
struct TokenTiming {
    first_token: Histogram,
    per_output_token: Histogram,
}

impl TokenTiming {
    fn new(model: &str, backend: &str) -> Self {
        let labels = rialto_core::metrics::BackendLabels {
            model: model.to_owned(),
            backend: backend.to_owned(),
        };
        let metrics = rialto_core::metrics::metrics();
        Self {
            first_token: metrics.time_to_first_token.get_or_create_owned(&labels),
            per_output_token: metrics.time_per_output_token.get_or_create_owned(&labels),
        }
    }
}

/// Times one stream's chunks: the first at once, the gaps after it when the
/// stream ends (dropped: finished, broken or left by its client). A chunk
/// stands for a token, as OpenAI-compatible servers send them; the usage
/// chunk's `completion_tokens`, when present, counts better.
struct StreamClock {
    timing: TokenTiming,
    started: std::time::Instant,
    first: Option<std::time::Instant>,
    last: std::time::Instant,
    chunks: u64,
    completion_tokens: Option<u64>,
}

impl StreamClock {
    fn new(timing: TokenTiming, started: std::time::Instant) -> Self {
        Self {
            timing,
            started,
            first: None,
            last: started,
            chunks: 0,
            completion_tokens: None,
        }
    }

    fn chunk(&mut self, data: &[u8]) {
        let now = std::time::Instant::now();
        if self.first.is_none() {
            self.first = Some(now);
            self.timing
                .first_token
                .observe(now.duration_since(self.started).as_secs_f64());
        }
        self.last = now;
        self.chunks += 1;
        // Only the usage chunk says `completion_tokens`: parsed once. (The
        // searcher is built once: building it was more than the search.)
        static COMPLETION_TOKENS: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
            std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"completion_tokens\""));
        if COMPLETION_TOKENS.find(data).is_some()
            && let Some(tokens) = completion_tokens(data)
        {
            self.completion_tokens = Some(tokens);
        }
    }
}

/// The `usage.completion_tokens` of a chunk, read into these two structs
/// alone: serde skips the rest, where a `Value` would allocate every member
/// (its id, model and choices) to read one number.
fn completion_tokens(chunk: &[u8]) -> Option<u64> {
    #[derive(serde::Deserialize)]
    struct Chunk {
        usage: Option<Usage>,
    }
    #[derive(serde::Deserialize)]
    struct Usage {
        completion_tokens: Option<u64>,
    }
    serde_json::from_slice::<Chunk>(chunk)
        .ok()?
        .usage?
        .completion_tokens
}

impl Drop for StreamClock {
    fn drop(&mut self) {
        let Some(first) = self.first else {
            return;
        };
        let tokens = self.completion_tokens.unwrap_or(self.chunks);
        if tokens > 1 {
            let gaps = self.last.duration_since(first).as_secs_f64();
            self.timing
                .per_output_token
                .observe(gaps / (tokens - 1) as f64);
        }
    }
}

/// Largest whole media answer read from a backend (four large images,
/// minutes of audio): the gRPC messages between processes carry at least
/// this much.
const MAX_MEDIA_ANSWER_BYTES: usize = 64 << 20;

/// Outcomes of an attempt, as metric labels, in [`Backend::outcomes`] order.
const OUTCOMES: [&str; 6] = ["ok", "retry", "busy", "failover", "skip", "final"];

// One per backend, built at start and never moved: the size is no cost.
#[allow(clippy::large_enum_variant)]
enum Transport {
    /// An OpenAI-compatible server.
    Http {
        /// Parsed once: reqwest would parse a string on every request.
        chat_url: reqwest::Url,
        embeddings_url: reqwest::Url,
        /// The base URL (`http://host:port/v1`), before a media call's path.
        base: String,
        /// Where chat and embeddings calls go without reqwest: a
        /// plain-`http` backend, with no proxy in the environment.
        endpoint: Option<upstream::Endpoint>,
        /// The configured extra headers and the bearer token, marked
        /// sensitive (never printed); replaced whole when `api_key_file`
        /// changes.
        headers: Arc<ArcSwap<HeaderMap>>,
    },
    /// A model in this process (`local`).
    InProcess(Arc<dyn InProcessModel>),
}

/// What a request asks of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call<'a> {
    Chat,
    ChatStream,
    Embed,
    Media(&'a Media),
}

/// A media call's path and files (its members are the body).
#[derive(Debug, PartialEq, Eq)]
struct Media {
    path: String,
    files: Vec<pb::MediaFile>,
    /// Relay the answer as it arrives.
    stream: bool,
    /// `GET` (a job's status or content): no body is sent.
    get: bool,
    /// The one backend the call may go to (the one holding a job).
    backend: Option<String>,
}

/// A media answer's bytes as they arrive; a broken answer ends with one
/// error.
type ByteStream = std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<bytes::Bytes>> + Send>>;

/// What a backend answered.
enum Answer {
    /// A whole `chat.completion`.
    Whole(Vec<u8>),
    /// A media call's answer and its content type.
    Media(bytes::Bytes, String),
    /// A streamed media call's content type and bytes.
    MediaChunks(String, ByteStream),
    /// `chat.completion.chunk`s, the last one with usage.
    Chunks(ChunkStream),
}

/// Each model's route, by id (looked up once a request: foldhash, not
/// SipHash).
type Routes = rialto_core::hashing::HashMap<String, Arc<ModelRoute>>;

/// Routes built for a configuration reload, not yet in force
/// ([`LocalRouter::prepare_reload`]); dropped, they stop what they started.
pub struct RoutesReload {
    routes: Routes,
}

/// A request a backend accepted.
struct Served<'a> {
    backend: &'a Backend,
    answer: Answer,
    /// Attempts before the one that was accepted.
    retries: u32,
    /// Counts the request on the backend until the answer is consumed.
    in_flight: InFlight,
}

/// Why one attempt did not serve the request, and what may follow it.
enum Failure {
    /// Another attempt may work, on this backend too; it counts against
    /// the backend's health: a connection error, 500, 502, 503, 504, an
    /// answer broken off before its end.
    Retry(Error),
    /// The backend is busy (429, a full in-process queue): retried like
    /// [`Failure::Retry`], but a busy backend is not an unhealthy one.
    Busy(Error),
    /// No answer in time: the other backends may be tried (a retry), this
    /// one not again, since it already took its whole timeout.
    Failover(Error),
    /// This backend cannot serve (it refuses its own credentials or
    /// address, or failed in an unexpected way): the others are tried,
    /// without waiting and without using a retry.
    Skip(Error),
    /// The request is at fault: another backend would refuse it too.
    Final(Error),
}

impl Backend {
    /// `index` names an unnamed backend (`<model>/<index>`): the public
    /// `x-<brand>-model-router` header must not reveal internal addresses.
    fn new(
        model_id: &str,
        index: usize,
        config: &BackendConfig,
        router: &RouterConfig,
        load: &Loader,
    ) -> Result<Self> {
        let name = backend_name(model_id, index, config);
        let timeout = Duration::from_secs(
            config
                .timeout_secs
                .unwrap_or(router.request_timeout_secs)
                .max(1),
        );
        let threshold = router.breaker_failure_threshold;
        let (host, transport, health) = if config.kind == "local" {
            match load(model_id, config) {
                Ok(model) => (
                    "in-process".to_owned(),
                    Transport::InProcess(model),
                    Health::new(threshold),
                ),
                // A broken model file must not take the service down: the
                // backend stays unavailable, the model's others serve.
                Err(error) => {
                    tracing::error!(
                        model = model_id,
                        backend = name,
                        %error,
                        "local backend did not load: it stays unavailable"
                    );
                    let model: Arc<dyn InProcessModel> = Arc::new(NotLoaded);
                    (
                        "in-process".to_owned(),
                        Transport::InProcess(model),
                        Health::down(),
                    )
                }
            }
        } else {
            let base = config.url.trim_end_matches('/');
            let url = |path: &str| {
                format!("{base}{path}")
                    .parse()
                    .map_err(|e| Error::invalid(format!("model {model_id}: backend url: {e}")))
            };
            let endpoint = if upstream::usable() {
                url("/")
                    .ok()
                    .and_then(|base: reqwest::Url| upstream::Endpoint::new(&base))
            } else {
                None
            };
            let transport = Transport::Http {
                chat_url: url("/chat/completions")?,
                embeddings_url: url("/embeddings")?,
                base: base.to_owned(),
                endpoint,
                headers: watched_headers(model_id, &name, config)?,
            };
            (backend_host(base), transport, Health::new(threshold))
        };
        let outcomes = OUTCOMES.map(|outcome| {
            rialto_core::metrics::metrics()
                .backend_requests
                .get_or_create_owned(&rialto_core::metrics::BackendOutcomeLabels {
                    model: model_id.to_owned(),
                    backend: name.clone(),
                    outcome,
                })
        });
        Ok(Self {
            outcomes,
            token_timing: TokenTiming::new(model_id, &name),
            seed: rialto_core::placement::replica_seed(&name),
            name,
            host,
            upstream_model: config.model.clone().unwrap_or_else(|| model_id.to_owned()),
            weight: config.weight.max(1),
            timeout,
            transport,
            health,
            config: config.clone(),
            watcher: None,
        })
    }

    /// Whether `config` would build this backend again, so a reload keeps
    /// it: the same settings, the same key (unless a file supplies it: the
    /// file's watcher keeps that current), and a backend that serves (a
    /// `local` model that did not load is tried again).
    fn unchanged(&self, config: &BackendConfig) -> bool {
        let same_key = config.api_key_file.is_some()
            || match (&self.config.api_key, &config.api_key) {
                (None, None) => true,
                (Some(old), Some(new)) => old.expose_secret() == new.expose_secret(),
                _ => false,
            };
        let same_settings = matches!(
            (serde_json::to_value(&self.config), serde_json::to_value(config)),
            (Ok(old), Ok(new)) if old == new
        );
        same_key && same_settings && self.health.state() != health::CircuitState::Down
    }
}

/// A backend's public name: its configured one, else `<model>/<index>`.
fn backend_name(model_id: &str, index: usize, config: &BackendConfig) -> String {
    config
        .name
        .clone()
        .unwrap_or_else(|| format!("{model_id}/{index}"))
}

/// The headers sent with every request to a backend: its configured
/// `headers`, and its bearer token from `api_key_env` (read now: a missing
/// variable is an error at start) or `api_key`. All marked sensitive.
fn backend_headers(model_id: &str, backend: &str, config: &BackendConfig) -> Result<HeaderMap> {
    let invalid =
        |what: String| Error::invalid(format!("model {model_id}: backend {backend}: {what}"));
    let mut headers = HeaderMap::new();
    for (name, value) in &config.headers {
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| invalid(format!("{name:?} is not a header name")))?;
        // The value may be a credential: never quoted.
        let mut value = HeaderValue::from_str(value)
            .map_err(|_| invalid(format!("the value of header {name} is not valid")))?;
        value.set_sensitive(true);
        headers.insert(header, value);
    }
    let key = match &config.api_key_env {
        Some(variable) => match std::env::var(variable) {
            Ok(key) if !key.is_empty() => Some(secrecy::SecretString::from(key)),
            _ => {
                return Err(invalid(format!(
                    "the environment variable {variable} (api_key_env) is not set"
                )));
            }
        },
        None => config.api_key.clone(),
    };
    if let Some(key) = key {
        let mut value = HeaderValue::from_str(&format!("Bearer {}", key.expose_secret()))
            .map_err(|_| invalid("its API key is not a valid header value".into()))?;
        value.set_sensitive(true);
        headers.insert(AUTHORIZATION, value);
    }
    Ok(headers)
}

/// [`backend_headers`], and with `api_key_file`, a task that builds them
/// again whenever the file changes (a rotated key: the next request sends
/// it). Outside a Tokio runtime (a unit test) the file is read once.
fn watched_headers(
    model_id: &str,
    backend: &str,
    config: &BackendConfig,
) -> Result<Arc<ArcSwap<HeaderMap>>> {
    let headers = Arc::new(ArcSwap::from_pointee(backend_headers(
        model_id, backend, config,
    )?));
    if let (Some(path), Some(key), Ok(_)) = (
        &config.api_key_file,
        &config.api_key,
        tokio::runtime::Handle::try_current(),
    ) {
        let (model_id, backend, config) = (model_id.to_owned(), backend.to_owned(), config.clone());
        // Weak: the watch ends with the backend (a reload that replaced it).
        let live = Arc::downgrade(&headers);
        let held = live.clone();
        rialto_core::secrets::watch_while(
            "api_key_file",
            path.clone(),
            rialto_core::secrets::LiveSecret::new(key.clone()),
            move || held.strong_count() > 0,
            move |key| {
                let config = BackendConfig {
                    api_key: Some(key.clone()),
                    ..config.clone()
                };
                let rebuilt = backend_headers(&model_id, &backend, &config)
                    .map_err(|error| error.to_string())?;
                if let Some(live) = live.upgrade() {
                    live.store(Arc::new(rebuilt));
                }
                Ok(())
            },
        );
    }
    Ok(headers)
}

/// `10.0.0.5:8000` -> `10.0.0.5` (`server.address`; `in-process` as is).
fn server_address(host: &str) -> &str {
    match host.rsplit_once(':') {
        Some((address, port)) if port.parse::<u16>().is_ok() => address,
        _ => host,
    }
}

/// `10.0.0.5:8000` -> 8000 (`server.port`), 0 without one.
fn server_port(host: &str) -> u64 {
    host.rsplit_once(':')
        .and_then(|(_, port)| port.parse::<u16>().ok())
        .map_or(0, u64::from)
}

/// `http://10.0.0.5:8000/v1` -> `10.0.0.5:8000`: names a backend in logs
/// without leaking credentials that might sit in a URL's user-info.
fn backend_host(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let host = rest.split('/').next().unwrap_or(rest);
    host.rsplit('@').next().unwrap_or(host).to_owned()
}

/// Stands in for a `local` model that did not load. Its backend is down,
/// so nothing calls it.
struct NotLoaded;

#[async_trait]
impl InProcessModel for NotLoaded {
    async fn chat(&self, _body: &Map<String, Value>) -> Result<Vec<u8>> {
        Err(not_loaded())
    }

    async fn chat_stream(&self, _body: &Map<String, Value>) -> Result<ChunkStream> {
        Err(not_loaded())
    }
}

fn not_loaded() -> Error {
    Error::new(ErrorCode::Unavailable, "The model's backend is not loaded")
}

impl ModelRoute {
    /// The backends whose circuit lets a request through now.
    fn selectable(&self) -> u64 {
        self.backends
            .iter()
            .enumerate()
            .filter(|(_, backend)| backend.health.selectable())
            .fold(0, |set, (index, _)| set | bit(index))
    }

    /// The backend to try among `candidates`: the owner of `sticky` when
    /// given, else the less loaded of two drawn by weight.
    fn pick(&self, candidates: u64, sticky: Option<&str>) -> Option<usize> {
        let weight = |index: usize| u64::from(self.backends[index].weight);
        match sticky {
            Some(key) => balance::rendezvous(key, candidates, |i| self.backends[i].seed, weight),
            None => balance::two_choices(
                candidates,
                weight,
                |index| self.backends[index].health.in_flight() as u64,
                &mut balance::random,
            ),
        }
    }
}

impl LocalRouter {
    pub fn new(models: &[ModelConfig], config: &RouterConfig) -> Result<Self> {
        Self::with_loader(models, config, crate::inprocess::load)
    }

    /// [`LocalRouter::new`] with `load` building the `local` backends.
    fn with_loader(
        models: &[ModelConfig],
        config: &RouterConfig,
        load: impl Fn(&str, &BackendConfig) -> Result<Arc<dyn InProcessModel>> + Send + Sync + 'static,
    ) -> Result<Self> {
        // reqwest is built without a bundled crypto provider; install ring's
        // once per process (a second install is a harmless no-op error).
        let _ = rustls::crypto::ring::default_provider().install_default();
        // Between two reads of an answer; a backend's own timeout may be
        // longer than the service's.
        let read_timeout = models
            .iter()
            .flat_map(|model| &model.backends)
            .filter_map(|backend| backend.timeout_secs)
            .fold(config.request_timeout_secs, u64::max)
            .max(1);
        let connect_timeout = Duration::from_secs(config.connect_timeout_secs.max(1));
        let http = Clients::new(move || {
            reqwest::Client::builder()
                .connect_timeout(connect_timeout)
                .read_timeout(Duration::from_secs(read_timeout))
                .pool_idle_timeout(Duration::from_secs(90))
                .pool_max_idle_per_host(256)
                .tcp_keepalive(Duration::from_secs(30))
                .tcp_nodelay(true)
                .build()
        })
        .map_err(|e| Error::internal(format_args!("http client: {e}")))?;
        let mut router = Self {
            models: ArcSwap::default(),
            http,
            upstreams: upstream::Upstreams::new(connect_timeout),
            retry: Retry {
                max: config.max_retries,
                base: Duration::from_millis(config.retry_backoff_base_ms),
                cap: Duration::from_millis(
                    config
                        .retry_backoff_cap_ms
                        .max(config.retry_backoff_base_ms),
                ),
            },
            settings: config.clone(),
            read_timeout_secs: read_timeout,
            load: Box::new(load),
        };
        let routes = router.build_routes(models, &Routes::default())?;
        router.models = ArcSwap::from_pointee(routes);
        Ok(router)
    }

    /// The routes of `models`, with every backend of `previous` whose
    /// model, name and configuration are unchanged kept as it is (its
    /// circuit, its requests in flight, its health checks), and the others
    /// built, with their watchers running.
    fn build_routes(&self, models: &[ModelConfig], previous: &Routes) -> Result<Routes> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::internal("the router is built outside a Tokio runtime"))?;
        let mut routes = Routes::with_capacity_and_hasher(models.len(), Default::default());
        for model in models {
            if model.backends.len() > MAX_BACKENDS {
                return Err(Error::invalid(format!(
                    "model {}: at most {MAX_BACKENDS} backends",
                    model.id
                )));
            }
            let prompt = model
                .system_prompt
                .clone()
                .unwrap_or_else(|| self.settings.system_prompt.clone());
            let before = previous.get(&model.id);
            let mut backends: Vec<Arc<Backend>> = Vec::with_capacity(model.backends.len());
            for (index, config) in model.backends.iter().enumerate() {
                let name = backend_name(&model.id, index, config);
                let kept = before.and_then(|route| {
                    route.backends.iter().find(|backend| {
                        backend.name == name
                            && backend.unchanged(config)
                            && !backends.iter().any(|taken| Arc::ptr_eq(taken, backend))
                    })
                });
                backends.push(match kept {
                    Some(kept) => Arc::clone(kept),
                    None => Arc::new(self.start_backend(&model.id, index, config, &runtime)?),
                });
            }
            let route = ModelRoute {
                system_prompt: (!prompt.is_empty()).then_some(Value::String(prompt)),
                thinking_kwargs: model.thinking_control.as_deref() != Some("none"),
                backends,
            };
            routes.insert(model.id.clone(), Arc::new(route));
        }
        Ok(routes)
    }

    /// A new backend, its circuit watched (and health-checked) by a task
    /// of its own unless it is down for good.
    fn start_backend(
        &self,
        model_id: &str,
        index: usize,
        config: &BackendConfig,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Backend> {
        let settings = &self.settings;
        let mut backend = Backend::new(model_id, index, config, settings, &*self.load)?;
        if backend.health.state() == health::CircuitState::Down {
            return Ok(backend);
        }
        let breaker = Breaker {
            cooldown: Duration::from_millis(settings.breaker_cooldown_ms),
            max_cooldown: Duration::from_millis(
                settings
                    .breaker_max_cooldown_ms
                    .max(settings.breaker_cooldown_ms),
            ),
        };
        let probe = match &backend.transport {
            Transport::Http {
                chat_url, headers, ..
            } if settings.health_check_interval_ms > 0 => {
                probe_url(chat_url, &settings.health_check_path).map(|url| Probe {
                    client: self.http.shared(),
                    url,
                    headers: Arc::clone(headers),
                    interval: Duration::from_millis(settings.health_check_interval_ms),
                    timeout: Duration::from_millis(settings.health_check_timeout_ms.max(1)),
                })
            }
            _ => None,
        };
        let watcher = health::watch(
            Arc::clone(&backend.health),
            breaker,
            probe,
            backend.name.clone(),
        );
        backend.watcher = Some(Watching(runtime.spawn(watcher).abort_handle()));
        Ok(backend)
    }

    /// Builds the routes of a new catalog for a configuration reload:
    /// models and backends added, removed or changed (url, weight, key,
    /// headers, timeout, upstream name), each backend whose model, name and
    /// configuration are unchanged kept with its circuit and requests in
    /// flight. Nothing is in force before [`LocalRouter::apply_reload`]; an
    /// error (a new backend's `api_key_env` unset, a header that is not
    /// valid) refuses the reload. `[router]` keeps the values the process
    /// started with. One reload at a time: the caller's.
    pub fn prepare_reload(&self, models: &[ModelConfig]) -> Result<RoutesReload> {
        if let Some(backend) = models
            .iter()
            .flat_map(|model| &model.backends)
            .find(|backend| {
                backend
                    .timeout_secs
                    .is_some_and(|t| t > self.read_timeout_secs)
            })
        {
            tracing::warn!(
                timeout_secs = backend.timeout_secs,
                read_timeout_secs = self.read_timeout_secs,
                "a reloaded backend's timeout is longer than the wait between two reads the \
                 router started with; that wait applies until a restart"
            );
        }
        let current = self.models.load_full();
        Ok(RoutesReload {
            routes: self.build_routes(models, &current)?,
        })
    }

    /// Puts prepared routes in force: requests that start from now on use
    /// them; those under way finish on the routes they started with.
    pub fn apply_reload(&self, reload: RoutesReload) {
        let now = Arc::new(reload.routes);
        let before = self.models.swap(Arc::clone(&now));
        // The gauges of backends that are gone, so they do not stay at
        // their last value.
        let metrics = rialto_core::metrics::metrics();
        for (model, route) in before.iter() {
            for backend in &route.backends {
                let kept = now
                    .get(model)
                    .is_some_and(|route| route.backends.iter().any(|b| b.name == backend.name));
                if !kept {
                    let labels = rialto_core::metrics::BackendLabels {
                        model: model.clone(),
                        backend: backend.name.clone(),
                    };
                    metrics.backend_circuit_state.remove(&labels);
                    metrics.backend_in_flight.remove(&labels);
                }
            }
        }
    }

    /// [`LocalRouter::prepare_reload`], then [`LocalRouter::apply_reload`].
    pub fn reload(&self, models: &[ModelConfig]) -> Result<()> {
        let routes = self.prepare_reload(models)?;
        self.apply_reload(routes);
        Ok(())
    }

    /// Every backend's circuit and requests in flight, by model.
    pub fn backend_health(&self) -> Vec<BackendHealth> {
        let models = self.models.load();
        let mut all: Vec<BackendHealth> = models
            .iter()
            .flat_map(|(model, route)| {
                route.backends.iter().map(move |backend| {
                    let (passed, failed) = backend.health.outcomes();
                    BackendHealth {
                        model: model.clone(),
                        backend: backend.name.clone(),
                        state: backend.health.state(),
                        in_flight: backend.health.in_flight(),
                        passed,
                        failed,
                    }
                })
            })
            .collect();
        // Stable: a model's backends stay in their configured order.
        all.sort_by(|a, b| a.model.cmp(&b.model));
        all
    }

    /// The model's route in force now; the request keeps it to its end.
    fn route(&self, model_id: &str) -> Result<Arc<ModelRoute>> {
        let route = self
            .models
            .load()
            .get(model_id)
            .cloned()
            .ok_or_else(|| Error::new(ErrorCode::ModelNotFound, "Specified model not found"))?;
        if route.backends.is_empty() {
            return Err(Error::new(
                ErrorCode::Unavailable,
                format!("No backend is configured for model {model_id}"),
            ));
        }
        Ok(route)
    }

    /// The body the backends receive: the service's and the character's
    /// system prompts first, thinking turned off when asked, usage asked
    /// for in streams.
    fn upstream_body(route: &ModelRoute, chat: &mut Chat, stream: bool) {
        let parameters = &chat.parameters;
        let body = &mut chat.body;
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
    }

    /// Sends a chat to the model's backends until one accepts it.
    async fn dispatch_chat<'a>(
        &'a self,
        route: &'a ModelRoute,
        mut chat: Chat,
        stream: bool,
    ) -> Result<Served<'a>> {
        Self::upstream_body(route, &mut chat, stream);
        let call = if stream { Call::ChatStream } else { Call::Chat };
        self.dispatch(route, chat.body, &chat.request_id, call)
            .await
    }

    /// Sends `body` to the route's backends until one accepts it,
    /// retrying and failing over as [`Failure`] allows.
    async fn dispatch<'a>(
        &'a self,
        route: &'a ModelRoute,
        mut body: Map<String, Value>,
        request_id: &str,
        call: Call<'_>,
    ) -> Result<Served<'a>> {
        // Requests with one `prompt_cache_key` start at the same backend,
        // so its prefix cache hits.
        let sticky = match body.get("prompt_cache_key") {
            Some(Value::String(key)) if route.backends.len() > 1 => Some(key.clone()),
            _ => None,
        };
        // Backends this request tried, and those it must not try again
        // (all but one when the call is pinned to it).
        let (mut tried, mut excluded) = (0u64, 0u64);
        if let Call::Media(Media {
            backend: Some(name),
            ..
        }) = call
        {
            let index = route
                .backends
                .iter()
                .position(|backend| &backend.name == name)
                .ok_or_else(|| {
                    Error::new(
                        ErrorCode::Unavailable,
                        format!("backend {name} no longer serves this model"),
                    )
                })?;
            excluded = !bit(index);
        }
        let (mut attempts, mut retries) = (0u32, 0u32);
        let mut last_error = None;
        loop {
            let selectable = route.selectable() & !excluded;
            let untried = selectable & !tried;
            let candidates = if untried != 0 { untried } else { selectable };
            let Some(index) = route.pick(candidates, sticky.as_deref()) else {
                break;
            };
            let backend = &route.backends[index];
            let Some(permit) = backend.health.admit() else {
                // Half-open, and another request took its trial.
                excluded |= bit(index);
                continue;
            };
            tried |= bit(index);
            attempts += 1;
            body.insert(
                "model".into(),
                Value::String(backend.upstream_model.clone()),
            );
            let failure = match self.attempt(backend, permit, &body, call, request_id).await {
                Ok((answer, in_flight)) => {
                    return Ok(Served {
                        backend,
                        answer,
                        retries: attempts - 1,
                        in_flight,
                    });
                }
                Err(failure) => failure,
            };
            let (error, uses_a_retry, same_again) = match failure {
                Failure::Final(error) => return Err(error),
                Failure::Retry(error) | Failure::Busy(error) => (error, true, true),
                Failure::Failover(error) => (error, true, false),
                Failure::Skip(error) => (error, false, false),
            };
            tracing::warn!(
                request_id,
                backend = backend.name,
                host = backend.host,
                attempt = attempts,
                error = %error,
                "backend failed"
            );
            if !same_again {
                excluded |= bit(index);
            }
            last_error = Some(error);
            if uses_a_retry {
                if retries >= self.retry.max {
                    break;
                }
                retries += 1;
                let wait =
                    balance::backoff(retries, self.retry.base, self.retry.cap, balance::random());
                tokio::time::sleep(wait).await;
            }
        }
        Err(last_error.unwrap_or_else(|| {
            Error::new(
                ErrorCode::Unavailable,
                "No backend of the model is available right now. Please try again later.",
            )
        }))
    }

    /// One attempt on one backend; its outcome goes to the backend's
    /// circuit breaker.
    async fn attempt(
        &self,
        backend: &Backend,
        permit: Permit<'_>,
        body: &Map<String, Value>,
        call: Call<'_>,
        request_id: &str,
    ) -> Result<(Answer, InFlight), Failure> {
        let in_flight = backend.health.start();
        // One client span per attempt: retries and failovers show in the
        // trace (OpenTelemetry's GenAI conventions). Only when spans are
        // exported: the lines logged inside an attempt name their request
        // and backend themselves, and formatting the span's fields for the
        // log cost every request ~1% of a stream's CPU.
        let operation = match call {
            Call::Chat | Call::ChatStream => "chat",
            Call::Embed => "embeddings",
            Call::Media(_) => "generate_content",
        };
        let span = if rialto_core::telemetry::spans_exported() {
            tracing::info_span!(
                "backend attempt",
                otel.name = %format_args!("{operation} {}", backend.upstream_model),
                otel.kind = "client",
                otel.status_code = tracing::field::Empty,
                gen_ai.operation.name = operation,
                gen_ai.request.model = %backend.upstream_model,
                server.address = %server_address(&backend.host),
                server.port = server_port(&backend.host),
                rialto.backend = %backend.name,
                rialto.outcome = tracing::field::Empty,
            )
        } else {
            tracing::Span::none()
        };
        // The HTTP sends are boxed: each holds kilobytes of connection and
        // response state, which every future enclosing it (this attempt,
        // the dispatch, the router's call) would otherwise hold too, and
        // copy each time one of them is made.
        let result = async {
            match &backend.transport {
                Transport::Http { base, headers, .. } if let Call::Media(media) = call => {
                    let headers = headers.load();
                    Box::pin(self.send_media(backend, base, &headers, body, media, request_id))
                        .await
                }
                Transport::Http {
                    endpoint: Some(endpoint),
                    headers,
                    ..
                } => {
                    let uri = match call {
                        Call::Embed => endpoint.embeddings(),
                        Call::Chat | Call::ChatStream | Call::Media(_) => endpoint.chat(),
                    };
                    let stream = call == Call::ChatStream;
                    let headers = headers.load();
                    Box::pin(
                        self.send_upstream(
                            backend, endpoint, uri, &headers, body, stream, request_id,
                        ),
                    )
                    .await
                }
                Transport::Http {
                    chat_url,
                    embeddings_url,
                    headers,
                    ..
                } => {
                    let url = match call {
                        Call::Embed => embeddings_url,
                        Call::Chat | Call::ChatStream | Call::Media(_) => chat_url,
                    };
                    let headers = headers.load();
                    let stream = call == Call::ChatStream;
                    Box::pin(self.send_http(backend, url, &headers, body, stream, request_id)).await
                }
                Transport::InProcess(model) => {
                    send_in_process(model.as_ref(), backend.timeout, body, call).await
                }
            }
        }
        .instrument(span.clone())
        .await;
        match &result {
            Ok(_) | Err(Failure::Busy(_) | Failure::Final(_)) => permit.passed(),
            Err(Failure::Retry(_) | Failure::Failover(_) | Failure::Skip(_)) => permit.failed(),
        }
        let outcome = match &result {
            Ok(_) => 0,
            Err(Failure::Retry(_)) => 1,
            Err(Failure::Busy(_)) => 2,
            Err(Failure::Failover(_)) => 3,
            Err(Failure::Skip(_)) => 4,
            Err(Failure::Final(_)) => 5,
        };
        backend.outcomes[outcome].inc();
        span.record("rialto.outcome", OUTCOMES[outcome]);
        if outcome != 0 {
            span.record("otel.status_code", "ERROR");
        }
        result.map(|answer| (answer, in_flight))
    }

    /// A chat or embeddings call on [`upstream::Upstreams`]: what
    /// [`LocalRouter::send_http`] does with reqwest, for a plain-`http`
    /// backend.
    #[allow(clippy::too_many_arguments)]
    async fn send_upstream(
        &self,
        backend: &Backend,
        endpoint: &upstream::Endpoint,
        uri: &hyper::Uri,
        headers: &HeaderMap,
        body: &Map<String, Value>,
        stream: bool,
        request_id: &str,
    ) -> Result<Answer, Failure> {
        let bytes = serde_json::to_vec(body).map_err(|e| Failure::Final(Error::internal(e)))?;
        let exchange = async {
            let response = self
                .upstreams
                .post(endpoint, uri, headers, request_id, bytes)
                .await
                .map_err(|error| match error {
                    upstream::SendError::ConnectTimeout => timed_out(),
                    error => {
                        tracing::debug!(request_id, backend = backend.name, %error, "upstream unreachable");
                        unreachable()
                    }
                })?;
            let status = response.status();
            let body = response.into_body();
            if status.is_success() && stream {
                // Afterwards the stream's stall limit bounds each wait for
                // a chunk.
                return Ok(Ok(body));
            }
            // Nothing has reached the caller yet: an answer broken off here
            // may still be retried.
            let bytes = body
                .bytes()
                .await
                .map_err(|_| Failure::Retry(broken_off()))?;
            Ok(Err((status, bytes)))
        };
        // The head (a stream's), or the whole answer.
        let answer = tokio::time::timeout(backend.timeout, exchange)
            .await
            .map_err(|_| timed_out())??;
        match answer {
            Ok(chunks) => {
                let stall = Some(Duration::from_secs(self.read_timeout_secs));
                Ok(Answer::Chunks(Box::pin(crate::sse::Chunks::new(
                    chunks, request_id, stall,
                ))))
            }
            Err((status, body)) if status.is_success() => Ok(Answer::Whole(body.to_vec())),
            Err((status, body)) => Err(refusal(backend, status.as_u16(), &body, request_id)),
        }
    }

    async fn send_http(
        &self,
        backend: &Backend,
        url: &reqwest::Url,
        headers: &HeaderMap,
        body: &Map<String, Value>,
        stream: bool,
        request_id: &str,
    ) -> Result<Answer, Failure> {
        let bytes = serde_json::to_vec(body).map_err(|e| Failure::Final(Error::internal(e)))?;
        let mut builder = self
            .http
            .get()
            .post(url.clone())
            .header(CONTENT_TYPE, "application/json")
            .header("x-request-id", request_id)
            .body(bytes);
        for (name, value) in headers {
            builder = builder.header(name.clone(), value.clone());
        }
        let response = if stream {
            // Until the headers: afterwards the client's read timeout
            // bounds each wait for a chunk.
            tokio::time::timeout(backend.timeout, builder.send())
                .await
                .map_err(|_| timed_out())?
        } else {
            // The whole answer, body included.
            builder.timeout(backend.timeout).send().await
        };
        let response = response.map_err(|e| {
            if e.is_timeout() {
                timed_out()
            } else {
                unreachable()
            }
        })?;
        let status = response.status();
        if status.is_success() {
            if stream {
                // reqwest's own read timeout bounds each wait for a chunk.
                let chunks = crate::sse::Chunks::new(response.bytes_stream(), request_id, None);
                return Ok(Answer::Chunks(Box::pin(chunks)));
            }
            // Nothing has reached the caller yet: an answer broken off here
            // may still be retried.
            let body = response.bytes().await.map_err(|e| {
                if e.is_timeout() {
                    timed_out()
                } else {
                    Failure::Retry(broken_off())
                }
            })?;
            return Ok(Answer::Whole(body.to_vec()));
        }
        Err(refused(backend, response, request_id).await)
    }

    /// A media call: the members as JSON, or with files as a multipart
    /// form; the answer's bytes and content type, whatever they are.
    async fn send_media(
        &self,
        backend: &Backend,
        base: &str,
        headers: &HeaderMap,
        body: &Map<String, Value>,
        media: &Media,
        request_id: &str,
    ) -> Result<Answer, Failure> {
        let url = format!("{base}{}", media.path);
        let client = self.http.get();
        let mut builder = if media.get {
            client.get(url)
        } else {
            client.post(url)
        }
        .header("x-request-id", request_id);
        if !media.stream {
            // The whole answer, body included; a stream's wait for its
            // headers is bounded below.
            builder = builder.timeout(backend.timeout);
        }
        for (name, value) in headers {
            builder = builder.header(name.clone(), value.clone());
        }
        builder = if media.get {
            builder
        } else if media.files.is_empty() {
            let bytes = serde_json::to_vec(body).map_err(|e| Failure::Final(Error::internal(e)))?;
            builder.header(CONTENT_TYPE, "application/json").body(bytes)
        } else {
            builder.multipart(media_form(body, &media.files)?)
        };
        let response = tokio::time::timeout(backend.timeout, builder.send())
            .await
            .map_err(|_| timed_out())?
            .map_err(|e| {
                if e.is_timeout() {
                    timed_out()
                } else {
                    unreachable()
                }
            })?;
        if !response.status().is_success() {
            return Err(refused(backend, response, request_id).await);
        }
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("application/octet-stream")
            .to_owned();
        if media.stream {
            let request_id = Arc::<str>::from(request_id);
            let chunks = response.bytes_stream().map(move |chunk| {
                chunk.map_err(|error| {
                    tracing::warn!(request_id = %request_id, %error, "upstream media stream broke");
                    broken_off()
                })
            });
            return Ok(Answer::MediaChunks(content_type, Box::pin(chunks)));
        }
        // Read under a cap: an answer past it could not cross to another
        // process anyway.
        let too_large = || {
            Failure::Skip(Error::new(
                ErrorCode::UpstreamFailed,
                format!("The model's backend answered more than {MAX_MEDIA_ANSWER_BYTES} bytes"),
            ))
        };
        if response
            .content_length()
            .is_some_and(|length| length > MAX_MEDIA_ANSWER_BYTES as u64)
        {
            return Err(too_large());
        }
        let mut response = response;
        let mut body = bytes::BytesMut::new();
        loop {
            let chunk = response.chunk().await.map_err(|e| {
                if e.is_timeout() {
                    timed_out()
                } else {
                    Failure::Retry(broken_off())
                }
            })?;
            let Some(chunk) = chunk else { break };
            if body.len() + chunk.len() > MAX_MEDIA_ANSWER_BYTES {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Answer::Media(body.freeze(), content_type))
    }
}

/// A multipart form of a media call: each member a text field (an array
/// repeats its field), then the files.
fn media_form(
    body: &Map<String, Value>,
    files: &[pb::MediaFile],
) -> Result<reqwest::multipart::Form, Failure> {
    let mut form = reqwest::multipart::Form::new();
    for (name, value) in body {
        let values = match value {
            Value::Array(items) => items.iter().collect(),
            Value::Null => Vec::new(),
            other => vec![other],
        };
        for value in values {
            let text = match value {
                Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            form = form.text(name.clone(), text);
        }
    }
    for file in files {
        let part = reqwest::multipart::Part::bytes(file.data.clone())
            .file_name(file.filename.clone())
            .mime_str(&file.content_type)
            .map_err(|_| Failure::Final(Error::invalid("an uploaded file's type is not valid")))?;
        form = form.part(file.field.clone(), part);
    }
    Ok(form)
}

/// [`refusal`] of a reqwest answer, its body read whole.
async fn refused(backend: &Backend, response: reqwest::Response, request_id: &str) -> Failure {
    let code = response.status().as_u16();
    let body = response.bytes().await.unwrap_or_default();
    refusal(backend, code, &body, request_id)
}

/// Why a backend refused a call (an answer of status `code` that is not
/// a success), and what may follow (see [`Failure`]): its body's message
/// is logged, and told to the caller when the request is to blame.
fn refusal(backend: &Backend, code: u16, body: &[u8], request_id: &str) -> Failure {
    let (detail, kind) = upstream_error(code, body);
    tracing::info!(
        request_id,
        backend = backend.name,
        host = backend.host,
        status = code,
        detail,
        "upstream error"
    );
    let failed = || {
        Error::new(
            ErrorCode::UpstreamFailed,
            format!("The model's backend failed (status {code})"),
        )
    };
    match code {
        429 => Failure::Busy(Error::new(
            ErrorCode::RateLimited,
            "The model is currently overloaded. Please try again later.",
        )),
        500 | 502 | 503 | 504 => Failure::Retry(failed()),
        // The backend's own credentials or address are wrong (the
        // operator's fault, and another backend may be fine), or it
        // fails in a way a retry will not cure. The detail (which may
        // quote a key) stays in the log.
        401 | 403 | 404 | 408 | 500..=599 => Failure::Skip(failed()),
        // The backend's content policy (OpenAI's image and moderation
        // codes): the request's fault, and the caller is told which kind.
        400 if kind.as_deref().is_some_and(|kind| {
            matches!(
                kind,
                "moderation_blocked" | "content_policy_violation" | "content_filter"
            )
        }) =>
        {
            Failure::Final(Error::new(
                ErrorCode::ContentViolation,
                truncated(detail, 500),
            ))
        }
        // Any other 4xx blames the request: another backend would refuse
        // it too. Its message helps the caller fix it.
        _ => Failure::Final(Error::invalid(truncated(detail, 500))),
    }
}

async fn send_in_process(
    model: &dyn InProcessModel,
    timeout: Duration,
    body: &Map<String, Value>,
    call: Call<'_>,
) -> Result<Answer, Failure> {
    let answer = match call {
        Call::Media(media) => tokio::time::timeout(timeout, model.media(&media.path, body))
            .await
            .map_err(|_| timed_out())?
            .map(|(bytes, content_type)| {
                let bytes = bytes::Bytes::from(bytes);
                if media.stream {
                    // Made whole in process: relayed as one piece.
                    let once = futures_util::stream::once(std::future::ready(Ok(bytes)));
                    Answer::MediaChunks(content_type, Box::pin(once))
                } else {
                    Answer::Media(bytes, content_type)
                }
            }),
        Call::ChatStream => tokio::time::timeout(timeout, model.chat_stream(body))
            .await
            .map_err(|_| timed_out())?
            .map(Answer::Chunks),
        Call::Chat => tokio::time::timeout(timeout, model.chat(body))
            .await
            .map_err(|_| timed_out())?
            .map(Answer::Whole),
        Call::Embed => tokio::time::timeout(timeout, model.embed(body))
            .await
            .map_err(|_| timed_out())?
            .map(Answer::Whole),
    };
    answer.map_err(|error| match error.code {
        ErrorCode::InvalidRequest => Failure::Final(error),
        // A full queue: another backend, or this one a moment later.
        ErrorCode::Unavailable | ErrorCode::RateLimited => Failure::Busy(error),
        ErrorCode::Timeout => Failure::Failover(error),
        _ => Failure::Skip(error),
    })
}

/// A backend that could not be reached (refused, reset before its
/// answer): the next one, or this one again after a backoff.
fn unreachable() -> Failure {
    Failure::Retry(Error::new(
        ErrorCode::Unavailable,
        "No backend of the model is reachable",
    ))
}

fn timed_out() -> Failure {
    Failure::Failover(Error::new(
        ErrorCode::Timeout,
        "The model's backend timed out",
    ))
}

fn probe_url(chat_url: &reqwest::Url, path: &str) -> Option<reqwest::Url> {
    let base = chat_url.as_str().strip_suffix("/chat/completions")?;
    format!("{base}{path}").parse().ok()
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

/// The message of an upstream error body, in any of the usual shapes, and
/// its `code` when it has one.
fn upstream_error(status: u16, body: &[u8]) -> (String, Option<String>) {
    let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let code = body
        .pointer("/error/code")
        .and_then(Value::as_str)
        .map(str::to_owned);
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
    let message = message
        .unwrap_or_else(|| format!("The model's backend refused the request (status {status})"));
    (message, code)
}

#[async_trait]
impl RouterService for LocalRouter {
    async fn backends(&self) -> Result<pb::BackendsResponse> {
        let backends = self
            .backend_health()
            .into_iter()
            .map(|health| pb::BackendStatus {
                model: health.model,
                backend: health.backend,
                state: match health.state {
                    health::CircuitState::Closed => "closed",
                    health::CircuitState::HalfOpen => "half_open",
                    health::CircuitState::Open => "open",
                    health::CircuitState::Down => "down",
                }
                .to_owned(),
                in_flight: health.in_flight as u64,
                passed: health.passed,
                failed: health.failed,
            })
            .collect();
        Ok(pb::BackendsResponse { backends })
    }

    async fn chat(&self, chat: Chat) -> Result<pb::ChatResponse> {
        let strip = stripping(&chat.parameters);
        let route = self.route(&chat.model_id)?;
        let served = self.dispatch_chat(&route, chat, false).await?;
        let Answer::Whole(body) = served.answer else {
            return Err(Error::internal("a backend streamed a whole answer"));
        };
        let body_json = if strip {
            strip_answer(&body).unwrap_or(body)
        } else {
            body
        };
        Ok(pb::ChatResponse {
            body_json,
            backend: served.backend.name.clone(),
            retry_count: served.retries,
        })
    }

    async fn chat_stream(&self, chat: Chat) -> Result<ChatStream> {
        let started = std::time::Instant::now();
        let strip = stripping(&chat.parameters);
        let route = self.route(&chat.model_id)?;
        let served = self.dispatch_chat(&route, chat, true).await?;
        let mut clock = StreamClock::new(served.backend.token_timing.clone(), started);
        let Answer::Chunks(chunks) = served.answer else {
            return Err(Error::internal("a backend answered a stream whole"));
        };
        let first = futures_util::stream::once(std::future::ready(Ok(pb::ChatStreamEvent {
            event: Some(pb::chat_stream_event::Event::Backend(
                served.backend.name.clone(),
            )),
            retry_count: served.retries,
        })));
        let in_flight = served.in_flight;
        // One stripper per choice: with n > 1 the choices interleave.
        let mut strippers: HashMap<u64, ThinkStripper> = HashMap::new();
        let events = chunks.map(move |chunk| {
            // The stream counts on its backend until it is dropped.
            let _in_flight = &in_flight;
            let data = chunk?;
            clock.chunk(&data);
            let data = if strip {
                strip_chunk(&data, &mut strippers).unwrap_or(data)
            } else {
                data
            };
            Ok(pb::ChatStreamEvent {
                event: Some(pb::chat_stream_event::Event::ChunkJson(data)),
                retry_count: 0,
            })
        });
        Ok(Box::pin(first.chain(until_broken(events))))
    }

    async fn media(&self, request: pb::MediaRequest) -> Result<pb::MediaResponse> {
        let route = self.route(&request.model_id)?;
        let body: Map<String, Value> = serde_json::from_slice(&request.body_json)
            .map_err(|e| Error::invalid(format!("request body is not a JSON object: {e}")))?;
        let media = Media {
            path: request.path,
            files: request.files,
            stream: false,
            get: request.method.eq_ignore_ascii_case("GET"),
            backend: Some(request.backend).filter(|name| !name.is_empty()),
        };
        let served = self
            .dispatch(&route, body, &request.request_id, Call::Media(&media))
            .await?;
        let Answer::Media(body, content_type) = served.answer else {
            return Err(Error::internal("a backend answered a media call as a chat"));
        };
        Ok(pb::MediaResponse {
            body: body.to_vec(),
            content_type,
            backend: served.backend.name.clone(),
            retry_count: served.retries,
        })
    }

    async fn media_stream(&self, request: pb::MediaRequest) -> Result<MediaStream> {
        use pb::media_stream_event::Event as MediaEvent;
        let route = self.route(&request.model_id)?;
        let body: Map<String, Value> = serde_json::from_slice(&request.body_json)
            .map_err(|e| Error::invalid(format!("request body is not a JSON object: {e}")))?;
        let media = Media {
            path: request.path,
            files: request.files,
            stream: true,
            get: false,
            backend: None,
        };
        let served = self
            .dispatch(&route, body, &request.request_id, Call::Media(&media))
            .await?;
        let Answer::MediaChunks(content_type, chunks) = served.answer else {
            return Err(Error::internal("a backend answered a media stream whole"));
        };
        let first = futures_util::stream::once(std::future::ready(Ok(pb::MediaStreamEvent {
            event: Some(MediaEvent::Start(pb::MediaStart {
                backend: served.backend.name.clone(),
                content_type,
                retry_count: served.retries,
            })),
        })));
        let in_flight = served.in_flight;
        let events = chunks.map(move |chunk| {
            // The stream counts on its backend until it is dropped.
            let _in_flight = &in_flight;
            Ok(pb::MediaStreamEvent {
                event: Some(MediaEvent::Data(chunk?.to_vec())),
            })
        });
        Ok(Box::pin(first.chain(until_broken(events))))
    }

    async fn embed(&self, request: pb::EmbedRequest) -> Result<pb::EmbedResponse> {
        let route = self.route(&request.model_id)?;
        let body: Map<String, Value> = serde_json::from_slice(&request.body_json)
            .map_err(|e| Error::invalid(format!("request body is not a JSON object: {e}")))?;
        let served = self
            .dispatch(&route, body, &request.request_id, Call::Embed)
            .await?;
        let Answer::Whole(body_json) = served.answer else {
            return Err(Error::internal("a backend streamed embeddings"));
        };
        Ok(pb::EmbedResponse {
            body_json,
            backend: served.backend.name.clone(),
            retry_count: served.retries,
        })
    }
}

/// `events` up to its first error, included: nothing follows a broken
/// upstream.
fn until_broken<T>(
    events: impl futures_util::Stream<Item = Result<T>>,
) -> impl futures_util::Stream<Item = Result<T>> {
    let mut failed = false;
    events.take_while(move |event| {
        let keep = !failed;
        failed |= event.is_err();
        std::future::ready(keep)
    })
}

/// Whether the answer loses its think blocks.
fn stripping(parameters: &pb::ServiceParameters) -> bool {
    parameters.strip_thinking || parameters.disable_thinking
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
fn strip_chunk(data: &[u8], strippers: &mut HashMap<u64, ThinkStripper>) -> Option<Vec<u8>> {
    let mut chunk: Value = serde_json::from_slice(data).ok()?;
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
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    use super::*;
    use crate::CircuitState;
    use rialto_test_kit::MockUpstream;
    use serde_json::json;

    /// Router settings for tests: no health checks unless a test asks.
    fn settings() -> RouterConfig {
        RouterConfig {
            health_check_interval_ms: 0,
            ..Default::default()
        }
    }

    fn catalog(backends: &[String]) -> Vec<ModelConfig> {
        let toml = format!(
            "[[models]]\nid = \"m\"\nbackends = [{}]\n",
            backends.join(", ")
        );
        rialto_core::Config::from_toml(&toml).unwrap().models
    }

    fn models(urls: &[String]) -> Vec<ModelConfig> {
        let backends: Vec<String> = urls
            .iter()
            .map(|u| format!("{{ kind = \"openai\", url = \"{u}\", model = \"mock-model\" }}"))
            .collect();
        catalog(&backends)
    }

    fn router(urls: &[String], config: &RouterConfig) -> LocalRouter {
        LocalRouter::new(&models(urls), config).unwrap()
    }

    fn request(body: Value) -> Chat {
        let Value::Object(body) = body else {
            panic!("a chat body is an object")
        };
        Chat {
            request_id: "r1".into(),
            model_id: "m".into(),
            body,
            parameters: Default::default(),
        }
    }

    fn hello() -> Value {
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    }

    fn streamed(mut body: Value) -> Value {
        body["stream"] = Value::Bool(true);
        body
    }

    fn first_event(event: &Result<pb::ChatStreamEvent>) -> (String, u32) {
        match event {
            Ok(pb::ChatStreamEvent {
                event: Some(pb::chat_stream_event::Event::Backend(name)),
                retry_count,
            }) => (name.clone(), *retry_count),
            other => panic!("the first event names no backend: {other:?}"),
        }
    }

    fn state_of(router: &LocalRouter, backend: &str) -> CircuitState {
        router
            .backend_health()
            .into_iter()
            .find(|health| health.backend == backend)
            .unwrap()
            .state
    }

    /// Waits (up to 5 s of the test's clock) for a backend's circuit.
    async fn wait_for(router: &LocalRouter, backend: &str, state: CircuitState) {
        for _ in 0..500 {
            if state_of(router, backend) == state {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "{backend} never got to {state:?}: {:?}",
            router.backend_health()
        );
    }

    /// An in-process model: answers, fails with a code, or holds its
    /// streams open after one chunk.
    #[derive(Default)]
    struct Fake {
        calls: AtomicUsize,
        failing: Mutex<Option<ErrorCode>>,
        hold: bool,
    }

    impl Fake {
        fn fail_with(&self, code: Option<ErrorCode>) {
            *self.failing.lock().unwrap() = code;
        }

        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }

        fn called(&self) -> Result<()> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            match *self.failing.lock().unwrap() {
                Some(code) => Err(Error::new(code, "fake failure")),
                None => Ok(()),
            }
        }
    }

    #[async_trait]
    impl InProcessModel for Fake {
        async fn chat(&self, _body: &Map<String, Value>) -> Result<Vec<u8>> {
            self.called()?;
            let answer = json!({"choices": [{"index": 0,
                "message": {"role": "assistant", "content": "fake"}, "finish_reason": "stop"}]});
            Ok(serde_json::to_vec(&answer).unwrap())
        }

        async fn chat_stream(&self, _body: &Map<String, Value>) -> Result<ChunkStream> {
            self.called()?;
            let chunk = json!({"choices": [{"index": 0, "delta": {"content": "fake"}}]});
            let first = futures_util::stream::iter([Ok(serde_json::to_vec(&chunk).unwrap())]);
            Ok(if self.hold {
                Box::pin(first.chain(futures_util::stream::pending()))
            } else {
                Box::pin(first)
            })
        }
    }

    /// A router over `local` backends named like their fakes (`path` picks
    /// the fake; a path without one fails to load).
    fn fake_router(
        backends: &[(&str, u32)],
        fakes: &[(&str, &Arc<Fake>)],
        config: &RouterConfig,
    ) -> LocalRouter {
        let backends: Vec<String> = backends
            .iter()
            .map(|(name, weight)| {
                format!("{{ kind = \"local\", path = \"{name}\", name = \"{name}\", weight = {weight} }}")
            })
            .collect();
        let fakes: HashMap<String, Arc<Fake>> = fakes
            .iter()
            .map(|(name, fake)| ((*name).to_owned(), Arc::clone(fake)))
            .collect();
        LocalRouter::with_loader(&catalog(&backends), config, move |_, backend| {
            let path = backend.path.clone().unwrap_or_default();
            match fakes.get(&path) {
                Some(fake) => Ok(Arc::clone(fake) as Arc<dyn InProcessModel>),
                None => Err(Error::new(ErrorCode::Unavailable, "no such model file")),
            }
        })
        .unwrap()
    }

    /// Lets the watchers run (in paused time nothing else advances).
    async fn settle() {
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn relays_to_the_upstream_with_its_model_name() {
        let mock = MockUpstream::start().await.unwrap();
        let router = router(&[mock.base_url()], &settings());
        let response = router.chat(request(hello())).await.unwrap();
        let body: Value = serde_json::from_slice(&response.body_json).unwrap();
        assert_eq!(
            body["choices"][0]["message"]["content"],
            "Hello from mock: hi"
        );
        assert_eq!(mock.requests()[0]["model"], "mock-model");
        assert_eq!(response.backend, "m/0");
        assert_eq!(response.retry_count, 0);
    }

    #[tokio::test]
    async fn fails_over_from_a_dead_backend() {
        let mock = MockUpstream::start().await.unwrap();
        // Port 9 on loopback: nothing listens, the connection is refused.
        let dead = "http://127.0.0.1:9/v1".to_owned();
        let router = router(&[dead, mock.base_url()], &settings());
        for _ in 0..8 {
            let response = router.chat(request(hello())).await.unwrap();
            assert_eq!(response.backend, "m/1");
        }
        assert_eq!(mock.request_count(), 8);
    }

    #[tokio::test]
    async fn no_reachable_backend_is_unavailable() {
        let dead = "http://127.0.0.1:9/v1".to_owned();
        let router = router(&[dead], &settings());
        let error = router.chat(request(hello())).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::Unavailable);
    }

    #[tokio::test]
    async fn upstream_4xx_blames_the_request_and_5xx_the_backend() {
        let mock = MockUpstream::start().await.unwrap();
        let router = router(&[mock.base_url()], &settings());
        let mut body = hello();
        body["mock"] = json!({"status": 400});
        let error = router.chat(request(body.clone())).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidRequest);
        // The request's fault: never sent again.
        assert_eq!(mock.request_count(), 1);
        body["mock"] = json!({"status": 500});
        let error = router.chat(request(body)).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::UpstreamFailed);
        // The first attempt and two retries.
        assert_eq!(mock.request_count(), 4);
    }

    #[tokio::test]
    async fn retries_with_backoff_and_counts_them() {
        let mock = MockUpstream::start().await.unwrap();
        let router = router(&[mock.base_url()], &settings());
        mock.fail_next(2, 503);
        let response = router.chat(request(hello())).await.unwrap();
        assert_eq!(response.retry_count, 2);
        assert_eq!(mock.request_count(), 3);

        // A busy backend is retried too, and a stream says so first.
        mock.fail_next(1, 429);
        let events: Vec<_> = router
            .chat_stream(request(streamed(hello())))
            .await
            .unwrap()
            .collect()
            .await;
        assert_eq!(first_event(&events[0]), ("m/0".to_owned(), 1));
        assert!(events.iter().all(Result::is_ok));

        // Three failures in a row exhaust two retries.
        mock.clear_requests();
        mock.fail_next(3, 502);
        let started = Instant::now();
        let error = router.chat(request(hello())).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::UpstreamFailed);
        assert_eq!(mock.request_count(), 3);
        // Backoff of at most 25 ms, then 50 ms.
        assert!(started.elapsed() < Duration::from_millis(500));

        let response = router.chat(request(hello())).await.unwrap();
        assert_eq!(response.retry_count, 0);

        // Without retries a failure is final.
        let config = RouterConfig {
            max_retries: 0,
            ..settings()
        };
        let once = LocalRouter::new(&models(&[mock.base_url()]), &config).unwrap();
        mock.clear_requests();
        mock.fail_next(1, 500);
        once.chat(request(hello())).await.unwrap_err();
        assert_eq!(mock.request_count(), 1);
    }

    #[tokio::test]
    async fn a_timeout_fails_over_but_never_waits_twice_on_one_backend() {
        let slow = MockUpstream::start().await.unwrap();
        let backends = [format!(
            "{{ kind = \"openai\", url = \"{}\", timeout_secs = 1 }}",
            slow.base_url()
        )];
        let router = LocalRouter::new(&catalog(&backends), &settings()).unwrap();
        let mut body = hello();
        body["mock"] = json!({"delay_ms": 3000});
        let started = Instant::now();
        let error = router.chat(request(body.clone())).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::Timeout);
        // The backend's own timeout (1 s), not the router's (600 s), once.
        assert!(started.elapsed() < Duration::from_millis(2_500));
        assert_eq!(slow.request_count(), 1);
        // A stream's headers are bounded the same way.
        let error = router
            .chat_stream(request(streamed(body)))
            .await
            .err()
            .unwrap();
        assert_eq!(error.code, ErrorCode::Timeout);
    }

    #[tokio::test]
    async fn streams_name_the_backend_then_relay_chunks_with_usage() {
        let mock = MockUpstream::start().await.unwrap();
        let router = router(&[mock.base_url()], &settings());
        let events: Vec<_> = router
            .chat_stream(request(streamed(hello())))
            .await
            .unwrap()
            .collect()
            .await;
        assert_eq!(first_event(&events[0]), ("m/0".to_owned(), 0));
        let last = match events.last() {
            Some(Ok(pb::ChatStreamEvent {
                event: Some(pb::chat_stream_event::Event::ChunkJson(json)),
                ..
            })) => serde_json::from_slice::<Value>(json).unwrap(),
            other => panic!("unexpected last event {other:?}"),
        };
        assert!(last["usage"]["total_tokens"].as_u64().unwrap() > 0);
        assert_eq!(mock.requests()[0]["stream_options"]["include_usage"], true);
    }

    #[tokio::test]
    async fn a_stream_broken_after_its_first_byte_is_never_retried() {
        let first = MockUpstream::start().await.unwrap();
        let second = MockUpstream::start().await.unwrap();
        let router = router(&[first.base_url(), second.base_url()], &settings());
        let mut body = streamed(hello());
        body["mock"] = json!({"fail_after_chunks": 2});
        let events: Vec<_> = router
            .chat_stream(request(body))
            .await
            .unwrap()
            .collect()
            .await;
        assert_eq!(first_event(&events[0]).1, 0);
        // The backend's name, two chunks, then one error, and nothing else.
        assert_eq!(events.len(), 4, "{events:?}");
        assert!(events.last().unwrap().is_err());
        assert_eq!(events.iter().filter(|e| e.is_err()).count(), 1);
        assert_eq!(first.request_count() + second.request_count(), 1);
    }

    #[test]
    fn a_streams_completion_tokens_come_from_its_usage_chunk_alone() {
        let usage = br#"{"id":"c","object":"chat.completion.chunk","model":"m","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":16,"total_tokens":23}}"#;
        assert_eq!(completion_tokens(usage), Some(16));
        // The name in a token's text, a usage of null or without the
        // count, a number that is no count, a chunk that is not JSON.
        for chunk in [
            &br#"{"choices":[{"index":0,"delta":{"content":"\"completion_tokens\": 3"}}]}"#[..],
            br#"{"choices":[],"usage":null}"#,
            br#"{"choices":[],"usage":{"prompt_tokens":7}}"#,
            br#"{"usage":{"completion_tokens":-1}}"#,
            br#"{"usage":{"completion_tokens":16.0}}"#,
            br#"{"usage":{"completion_tokens":"16"}}"#,
            br#"{"usage":{"completion_tokens":1"#,
        ] {
            assert_eq!(
                completion_tokens(chunk),
                None,
                "{}",
                String::from_utf8_lossy(chunk)
            );
        }
        let mut clock = StreamClock::new(
            TokenTiming::new("m", "a_streams_completion_tokens"),
            Instant::now(),
        );
        clock.chunk(br#"{"choices":[{"index":0,"delta":{"content":"hi"}}]}"#);
        assert_eq!(clock.completion_tokens, None);
        clock.chunk(usage);
        assert_eq!((clock.chunks, clock.completion_tokens), (2, Some(16)));
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
        let router = router(&[bad.base_url(), good.base_url()], &settings());
        let mut body = hello();
        body["mock"] = json!({"status": 401});
        // Both mocks obey the directive, so both fail: a 502, not the 401.
        let error = router.chat(request(body)).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::UpstreamFailed);
        assert!(!error.message.contains("mock failure"));
        // Each once: a refused credential is not retried on its backend.
        assert_eq!(bad.request_count(), 1);
        assert_eq!(good.request_count(), 1);
    }

    #[tokio::test]
    async fn backend_keys_from_the_environment_and_extra_headers() {
        let mock = MockUpstream::start().await.unwrap();
        // Cargo sets this variable for the tests it runs.
        let backends = [format!(
            "{{ kind = \"openai\", url = \"{}\", api_key_env = \"CARGO_MANIFEST_DIR\", \
             headers = {{ \"x-tenant\" = \"acme\" }} }}",
            mock.base_url()
        )];
        let router = LocalRouter::new(&catalog(&backends), &settings()).unwrap();
        router.chat(request(hello())).await.unwrap();
        assert_eq!(
            mock.authorization_headers(),
            [Some(format!("Bearer {}", env!("CARGO_MANIFEST_DIR")))]
        );
        assert_eq!(mock.header_values("x-tenant"), [Some("acme".to_owned())]);

        let missing = [format!(
            "{{ kind = \"openai\", url = \"{}\", api_key_env = \"RIALTO_TEST_NO_SUCH_VARIABLE\" }}",
            mock.base_url()
        )];
        let error = LocalRouter::new(&catalog(&missing), &settings())
            .err()
            .unwrap();
        assert!(
            error.message.contains("RIALTO_TEST_NO_SUCH_VARIABLE"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn the_circuit_opens_and_an_open_model_answers_at_once() {
        let mock = MockUpstream::start().await.unwrap();
        let config = RouterConfig {
            breaker_failure_threshold: 3,
            max_retries: 0,
            ..settings()
        };
        let router = router(&[mock.base_url()], &config);
        let mut failing = hello();
        failing["mock"] = json!({"status": 500});
        for _ in 0..3 {
            let error = router.chat(request(failing.clone())).await.unwrap_err();
            assert_eq!(error.code, ErrorCode::UpstreamFailed);
        }
        wait_for(&router, "m/0", CircuitState::Open).await;
        // No network attempt while open, whole or streamed.
        let started = Instant::now();
        for _ in 0..5 {
            let error = router.chat(request(hello())).await.unwrap_err();
            assert_eq!(error.code, ErrorCode::Unavailable);
            let error = router
                .chat_stream(request(streamed(hello())))
                .await
                .err()
                .unwrap();
            assert_eq!(error.code, ErrorCode::Unavailable);
        }
        assert!(started.elapsed() < Duration::from_millis(100));
        assert_eq!(mock.request_count(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn the_circuit_half_opens_after_its_cooldown_and_closes_on_success() {
        let fake = Arc::new(Fake::default());
        let config = RouterConfig {
            breaker_failure_threshold: 2,
            breaker_cooldown_ms: 10_000,
            max_retries: 0,
            ..settings()
        };
        let router = fake_router(&[("a", 1)], &[("a", &fake)], &config);
        fake.fail_with(Some(ErrorCode::Internal));
        for _ in 0..2 {
            router.chat(request(hello())).await.unwrap_err();
        }
        settle().await;
        assert_eq!(state_of(&router, "a"), CircuitState::Open);
        fake.fail_with(None);
        let error = router.chat(request(hello())).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::Unavailable);
        assert_eq!(fake.calls(), 2);

        tokio::time::sleep(Duration::from_millis(9_990)).await;
        assert_eq!(state_of(&router, "a"), CircuitState::Open);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(state_of(&router, "a"), CircuitState::HalfOpen);
        // The trial passes and closes the circuit.
        router.chat(request(hello())).await.unwrap();
        settle().await;
        assert_eq!(state_of(&router, "a"), CircuitState::Closed);
        assert_eq!(fake.calls(), 3);

        // Open again; this time the trial fails: open for twice as long.
        fake.fail_with(Some(ErrorCode::Internal));
        for _ in 0..2 {
            router.chat(request(hello())).await.unwrap_err();
        }
        settle().await;
        tokio::time::sleep(Duration::from_millis(10_010)).await;
        assert_eq!(state_of(&router, "a"), CircuitState::HalfOpen);
        router.chat(request(hello())).await.unwrap_err();
        settle().await;
        assert_eq!(state_of(&router, "a"), CircuitState::Open);
        fake.fail_with(None);
        tokio::time::sleep(Duration::from_millis(19_990)).await;
        assert_eq!(state_of(&router, "a"), CircuitState::Open);
        tokio::time::sleep(Duration::from_millis(20)).await;
        router.chat(request(hello())).await.unwrap();
        settle().await;
        assert_eq!(state_of(&router, "a"), CircuitState::Closed);
    }

    /// A catalog of `local` backends named like their fakes, per model.
    fn local_catalog(models: &[(&str, &[&str])]) -> Vec<ModelConfig> {
        let toml: String = models
            .iter()
            .map(|(id, backends)| {
                let backends: Vec<String> = backends
                    .iter()
                    .map(|name| {
                        format!("{{ kind = \"local\", path = \"{name}\", name = \"{name}\" }}")
                    })
                    .collect();
                format!(
                    "[[models]]\nid = \"{id}\"\nbackends = [{}]\n",
                    backends.join(", ")
                )
            })
            .collect();
        rialto_core::Config::from_toml(&toml).unwrap().models
    }

    /// A reload keeps the backends it does not change, with their circuits
    /// and requests in flight; it adds and removes the others, and a
    /// request under way finishes on the route it started with.
    #[tokio::test(start_paused = true)]
    async fn a_reload_keeps_unchanged_backends_and_their_state() {
        let sick = Arc::new(Fake::default());
        let slow = Arc::new(Fake {
            hold: true,
            ..Default::default()
        });
        let new = Arc::new(Fake::default());
        let config = RouterConfig {
            breaker_failure_threshold: 2,
            breaker_cooldown_ms: 600_000,
            ..settings()
        };
        let router = fake_router(
            &[("sick", 1), ("slow", 1)],
            &[("sick", &sick), ("slow", &slow), ("new", &new)],
            &config,
        );
        let client = crate::RouterClient::new(router);
        let router = client.local().expect("the router of this process");
        sick.fail_with(Some(ErrorCode::Internal));
        for _ in 0..20 {
            router.chat(request(hello())).await.unwrap();
            settle().await;
        }
        assert_eq!(state_of(router, "sick"), CircuitState::Open);
        let mut held = router
            .chat_stream(request(streamed(hello())))
            .await
            .unwrap();
        assert_eq!(first_event(&held.next().await.unwrap()).0, "slow");
        held.next().await.unwrap().unwrap();
        let in_flight = |name: &str| {
            router
                .backend_health()
                .into_iter()
                .find(|health| health.backend == name)
                .map(|health| (health.state, health.in_flight))
        };
        assert_eq!(in_flight("slow"), Some((CircuitState::Closed, 1)));

        // A backend added, another model added: the others are kept.
        router
            .reload(&local_catalog(&[
                ("m", &["sick", "slow", "new"]),
                ("m2", &["new"]),
            ]))
            .unwrap();
        settle().await;
        assert_eq!(state_of(router, "sick"), CircuitState::Open);
        assert_eq!(in_flight("slow"), Some((CircuitState::Closed, 1)));
        assert_eq!(in_flight("new"), Some((CircuitState::Closed, 0)));
        let mut m2 = request(hello());
        m2.model_id = "m2".into();
        assert_eq!(router.chat(m2).await.unwrap().backend, "new");

        // A reload the configuration cannot build changes nothing.
        let unset = rialto_core::Config::from_toml(
            "[[models]]\nid = \"m\"\nbackends = [{ kind = \"openai\", url = \
             \"http://127.0.0.1:9/v1\", api_key_env = \"RIALTO_TEST_NEVER_SET\" }]\n",
        )
        .unwrap();
        let error = router.reload(&unset.models).unwrap_err();
        assert!(error.message.contains("RIALTO_TEST_NEVER_SET"), "{error}");
        assert_eq!(state_of(router, "sick"), CircuitState::Open);

        // `sick` and `slow` removed, `m2` gone: the held stream goes on,
        // on the route it started with.
        router.reload(&local_catalog(&[("m", &["new"])])).unwrap();
        settle().await;
        let names: Vec<String> = router
            .backend_health()
            .into_iter()
            .map(|health| format!("{}:{}", health.model, health.backend))
            .collect();
        assert_eq!(names, ["m:new"]);
        let mut m2 = request(hello());
        m2.model_id = "m2".into();
        assert_eq!(
            router.chat(m2).await.unwrap_err().code,
            ErrorCode::ModelNotFound
        );
        let (slow_calls, new_calls) = (slow.calls(), new.calls());
        for _ in 0..5 {
            assert_eq!(router.chat(request(hello())).await.unwrap().backend, "new");
        }
        assert_eq!(
            slow.calls(),
            slow_calls,
            "nothing goes to a removed backend"
        );
        assert_eq!(new.calls(), new_calls + 5);
        assert!(
            futures_util::FutureExt::now_or_never(held.next()).is_none(),
            "the stream is still open, not cut by the reload"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_open_backend_loses_its_traffic_to_the_others() {
        let sick = Arc::new(Fake::default());
        let well = Arc::new(Fake::default());
        let config = RouterConfig {
            breaker_failure_threshold: 3,
            ..settings()
        };
        let router = fake_router(
            &[("sick", 1), ("well", 1)],
            &[("sick", &sick), ("well", &well)],
            &config,
        );
        sick.fail_with(Some(ErrorCode::Internal));
        // Every request succeeds, on `well` after `sick` when it is tried first.
        for _ in 0..40 {
            let response = router.chat(request(hello())).await.unwrap();
            assert_eq!(response.backend, "well");
            settle().await;
        }
        assert_eq!(state_of(&router, "sick"), CircuitState::Open);
        assert_eq!(sick.calls(), 3);
        assert_eq!(well.calls(), 40);
    }

    #[tokio::test]
    async fn a_busy_in_process_model_fails_over_without_opening_its_circuit() {
        let busy = Arc::new(Fake::default());
        let idle = Arc::new(Fake::default());
        let config = RouterConfig {
            breaker_failure_threshold: 2,
            ..settings()
        };
        let router = fake_router(
            &[("busy", 1), ("idle", 1)],
            &[("busy", &busy), ("idle", &idle)],
            &config,
        );
        // A full queue answers Unavailable.
        busy.fail_with(Some(ErrorCode::Unavailable));
        let mut retried = 0;
        for _ in 0..30 {
            let response = router.chat(request(hello())).await.unwrap();
            assert_eq!(response.backend, "idle");
            retried += response.retry_count;
        }
        assert_eq!(retried as usize, busy.calls());
        assert!(busy.calls() > 0);
        tokio::task::yield_now().await;
        assert_eq!(state_of(&router, "busy"), CircuitState::Closed);
    }

    #[tokio::test]
    async fn a_local_backend_that_fails_to_load_is_down_and_the_rest_serve() {
        let fake = Arc::new(Fake::default());
        let router = fake_router(
            &[("broken", 1), ("fine", 1)],
            &[("fine", &fake)],
            &settings(),
        );
        assert_eq!(state_of(&router, "broken"), CircuitState::Down);
        for _ in 0..10 {
            assert_eq!(router.chat(request(hello())).await.unwrap().backend, "fine");
        }
        let only_broken = fake_router(&[("broken", 1)], &[], &settings());
        let error = only_broken.chat(request(hello())).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::Unavailable);
    }

    #[tokio::test]
    async fn the_less_loaded_backend_wins_by_weight() {
        let light = Arc::new(Fake {
            hold: true,
            ..Default::default()
        });
        let heavy = Arc::new(Fake {
            hold: true,
            ..Default::default()
        });
        let router = fake_router(
            &[("light", 1), ("heavy", 3)],
            &[("light", &light), ("heavy", &heavy)],
            &settings(),
        );
        // Twelve streams held open: three quarters go to weight 3.
        let mut streams = Vec::new();
        for _ in 0..12 {
            let mut stream = router
                .chat_stream(request(streamed(hello())))
                .await
                .unwrap();
            stream.next().await.unwrap().unwrap();
            streams.push(stream);
        }
        let in_flight = |name: &str| {
            router
                .backend_health()
                .into_iter()
                .find(|h| h.backend == name)
                .unwrap()
                .in_flight
        };
        // Each pick compares in_flight / weight, so the split stays within
        // one request of 3:9.
        assert!(
            (2..=4).contains(&in_flight("light")),
            "{:?}",
            router.backend_health()
        );
        assert_eq!(in_flight("light") + in_flight("heavy"), 12);
        // A stream counts until it is dropped.
        drop(streams);
        assert_eq!(in_flight("light") + in_flight("heavy"), 0);
    }

    #[tokio::test]
    async fn a_prompt_cache_key_sticks_to_one_backend() {
        let mocks = [
            MockUpstream::start().await.unwrap(),
            MockUpstream::start().await.unwrap(),
            MockUpstream::start().await.unwrap(),
        ];
        let urls: Vec<String> = mocks.iter().map(MockUpstream::base_url).collect();
        let router = router(&urls, &settings());
        let mut sticky = hello();
        sticky["prompt_cache_key"] = json!("conversation-1");
        let owner = router.chat(request(sticky.clone())).await.unwrap().backend;
        for _ in 0..20 {
            assert_eq!(
                router.chat(request(sticky.clone())).await.unwrap().backend,
                owner
            );
        }
        let counts: Vec<usize> = mocks.iter().map(MockUpstream::request_count).collect();
        assert_eq!(counts.iter().filter(|c| **c == 21).count(), 1, "{counts:?}");
        // Other keys land elsewhere too.
        let mut owners = std::collections::HashSet::new();
        for i in 0..30 {
            sticky["prompt_cache_key"] = json!(format!("conversation-{i}"));
            owners.insert(router.chat(request(sticky.clone())).await.unwrap().backend);
        }
        assert_eq!(owners.len(), 3);
    }

    #[tokio::test]
    async fn health_checks_open_a_dead_backend_without_any_request() {
        let config = RouterConfig {
            breaker_failure_threshold: 2,
            health_check_interval_ms: 50,
            health_check_timeout_ms: 500,
            ..Default::default()
        };
        let router = router(&["http://127.0.0.1:9/v1".to_owned()], &config);
        wait_for(&router, "m/0", CircuitState::Open).await;
    }

    #[tokio::test]
    async fn a_passing_health_check_half_opens_before_the_cooldown_ends() {
        let mock = MockUpstream::start().await.unwrap();
        let config = RouterConfig {
            breaker_failure_threshold: 2,
            breaker_cooldown_ms: 60_000,
            max_retries: 0,
            health_check_interval_ms: 50,
            ..Default::default()
        };
        let router = router(&[mock.base_url()], &config);
        let mut failing = hello();
        failing["mock"] = json!({"status": 503});
        for _ in 0..2 {
            router.chat(request(failing.clone())).await.unwrap_err();
        }
        // The mock's model list still answers: the next check half-opens.
        wait_for(&router, "m/0", CircuitState::HalfOpen).await;
        assert!(mock.model_list_count() > 0);
        router.chat(request(hello())).await.unwrap();
        wait_for(&router, "m/0", CircuitState::Closed).await;
    }
}
