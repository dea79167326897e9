//! The gateway: Rialto's public HTTP API.
//!
//! It parses and validates requests, answers with the spec's headers and
//! error bodies, relays streams as SSE, and calls the other services through
//! their clients. It never touches the database and never knows whether a
//! service runs in this process or behind gRPC.
//!
//! Architecture invariants:
//! - Every response, errors included, carries `CF-RAY`, `x-<brand>-version`,
//!   `x-<brand>-host-name`, `Date` and `Content-Type` (see [`headers`]).
//! - Errors become `{"error": ...}` bodies in one place ([`error::ApiError`]);
//!   bad input is a 4xx with a clear message, never a 5xx.
//! - No secret reaches a log line: keys are passed on, never recorded.

use std::net::TcpListener;
use std::sync::Arc;

use actix_web::dev::Server;
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::{App, HttpMessage, HttpRequest, HttpServer, web};
use arc_swap::ArcSwap;
use bytes::Bytes;
use futures_util::StreamExt;
use rialto_auth::AuthClient;
use rialto_billing::BillingClient;
use rialto_core::hashing::HashMap;
use rialto_core::{Brand, Config, ErrorCode, ModelConfig};
use rialto_limiter::abuse::AbuseGuard;
use rialto_limiter::{Caller, RateHeaders, RateLimiter, Target};
use rialto_proto::auth::v1 as auth_pb;
use rialto_router::RouterClient;

mod ahead;
mod audio;
mod augment;
mod characters;
mod chat;
pub mod console;
pub mod convert;
mod crypto_rpc;
mod embeddings;
pub mod error;
mod files;
mod forms;
mod headers;
mod holding;
mod images;
pub mod jobs;
mod keys;
mod limits;
mod media;
mod models;
mod openapi;
pub mod operator;
mod responses;
mod retouch;
mod sources;
#[cfg(test)]
mod test_billing;
mod usage;
mod wallet;

pub use error::{ApiError, Details};

/// The clients of the services the gateway calls.
#[derive(Clone, Debug)]
pub struct Services {
    pub auth: AuthClient,
    pub limiter: RateLimiter,
    pub billing: BillingClient,
    pub router: RouterClient,
    /// Where settlements billing cannot take now are queued: the bus when a
    /// billing replica reads it (this process's, or NATS), else None.
    pub usage_queue: Option<rialto_core::bus::Bus>,
    /// The bus, for job wake-ups (`<prefix>.media.jobs`).
    pub bus: Option<rialto_core::bus::Bus>,
}

/// Everything a handler needs, built once at start and shared by all workers.
pub struct Gateway {
    services: Services,
    brand: Brand,
    /// `<yyyymmdd>.<hhmmss>`, in `x-<brand>-version` and the OpenAPI document.
    revision: String,
    /// The models and the configured characters, replaced whole by a
    /// configuration reload ([`Gateway::prepare_reload`]). A request loads
    /// it once ([`Gateway::catalog`], or the entry [`Gateway::model`]
    /// finds) and keeps what it loaded to its end: no lock, and one
    /// consistent catalog per request.
    catalog: ArcSwap<Catalog>,
    /// The operator API's bearer token (`operator.token[_file]`), rotated in
    /// place when its file changes.
    operator_token: Option<rialto_core::secrets::LiveSecret>,
    max_body_bytes: usize,
    /// Set when the process begins to shut down: `/readyz` answers 503.
    draining: std::sync::atomic::AtomicBool,
    /// `/metrics` on the public port: only while `metrics.listen` is unset
    /// (one process on a laptop); otherwise it has a port of its own.
    public_metrics: bool,
    openapi: Bytes,
    /// Precomputed header names and values stamped on every response.
    stamp: headers::Stamp,
    /// Failed-request counts per credential and client address.
    abuse: AbuseGuard,
    /// Where the client's address comes from, when a proxy sets it.
    client_address_header: Option<HeaderName>,
    /// Wallet sign-in and x402 top-ups (`[wallet]`, `[x402]`).
    wallet: rialto_core::config::WalletConfig,
    /// `wallet.min_balance_usd`, read once (validated at start).
    wallet_min_balance: rust_decimal::Decimal,
    x402: rialto_core::config::X402Config,
    /// The characters of the configuration and of the database (refreshed
    /// every few seconds and after each change through this gateway).
    characters: std::sync::RwLock<Arc<characters::CharacterSet>>,
    /// Whether `file` URLs may point inside the operator's network.
    file_urls_allow_private: bool,
    /// Where documents become text (a sandboxed child under `rialto serve`).
    converter: convert::Converter,
    /// The configured search provider, if any (`[web_search]`).
    web_search: Option<sources::WebSearch>,
    /// The JSON-RPC proxy's networks (`[crypto_rpc]`).
    crypto_rpc: crypto_rpc::CryptoRpc,
    /// Fetches and reads pages (`[web_scraping]`).
    scraper: sources::Scraper,
    /// Price of one `/augment/text-parser` file, in USD nano-units.
    text_parser_price_nanos: u64,
    /// `media.image_styles`: the `style_preset`s of `/image/generate`.
    image_styles: Vec<String>,
    /// `media.max_upload_bytes`: the largest audio or image uploaded.
    max_upload_bytes: usize,
    /// How this gateway's workers run asynchronous jobs.
    jobs: jobs::JobSettings,
    /// Length of `router.system_prompt`, counted in holds when it is sent.
    system_prompt_chars: usize,
    /// The web console (`console.enabled`), with its session keys.
    console: Option<console::Console>,
    /// Connections per HTTP worker, and the time a request's head may take.
    max_connections: usize,
    client_request_timeout: std::time::Duration,
    /// How often a running stream checkpoints what it used so far.
    checkpoint_every: std::time::Duration,
    /// How long a stream waits for its client to take a chunk: half the
    /// stream's lease, so a blocked relay cannot outlive its hold.
    reader_patience: std::time::Duration,
    /// Callers whose route is asked beside their admission and hold: only
    /// when billing is another process (in one process both are decided
    /// in memory before a route could start) and `gateway.route_ahead_ms`
    /// is not 0.
    route_ahead: Option<Arc<ahead::RouteAhead>>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("brand", &self.brand.name)
            .finish_non_exhaustive()
    }
}

impl Gateway {
    pub fn new(config: &Config, services: Services, revision: &str) -> anyhow::Result<Self> {
        let brand = Brand::new(&config.brand);
        let host_name = if config.gateway.host_name.is_empty() {
            rialto_core::telemetry::host_name()
        } else {
            config.gateway.host_name.clone()
        };
        let stamp = headers::Stamp::new(&brand, revision, &host_name)?;
        let catalog = Catalog::new(config, &stamp)?;
        let route_ahead = match services.billing.local() {
            Some(_) => None,
            None => ahead::RouteAhead::new(std::time::Duration::from_millis(
                config.gateway.route_ahead_ms,
            )),
        };
        Ok(Self {
            catalog: ArcSwap::from_pointee(catalog),
            openapi: Bytes::from(openapi::render(&brand, revision)),
            services,
            revision: revision.to_owned(),
            operator_token: config
                .operator
                .token
                .clone()
                .map(rialto_core::secrets::LiveSecret::new),
            max_body_bytes: config.gateway.max_body_bytes,
            public_metrics: config.metrics.listen.is_empty(),
            draining: std::sync::atomic::AtomicBool::new(false),
            stamp,
            brand,
            abuse: AbuseGuard::new(&config.limits.abuse),
            wallet: config.wallet.clone(),
            wallet_min_balance: config
                .wallet
                .min_balance_usd
                .trim()
                .parse()
                .unwrap_or_default(),
            x402: config.x402.clone(),
            characters: std::sync::RwLock::new(Arc::new(characters::CharacterSet::new(
                config.characters.clone(),
                Vec::new(),
            ))),
            file_urls_allow_private: config.gateway.file_urls_allow_private,
            converter: convert::Converter::in_process(),
            web_search: sources::WebSearch::from_config(&config.web_search)?,
            crypto_rpc: crypto_rpc::CryptoRpc::from_config(&config.crypto_rpc)?,
            scraper: sources::Scraper::new(
                &config.web_scraping,
                config.gateway.file_urls_allow_private,
            ),
            text_parser_price_nanos: sources::usd_nanos(config.text_parser.usd_per_file),
            image_styles: config.media.image_styles.clone(),
            max_upload_bytes: config.media.max_upload_bytes,
            jobs: jobs::JobSettings::new(&config.media),
            system_prompt_chars: config.router.system_prompt.len(),
            console: console::Console::new(&config.console)?,
            max_connections: config.gateway.max_connections,
            client_request_timeout: std::time::Duration::from_millis(
                config.gateway.client_request_timeout_ms,
            ),
            checkpoint_every: std::time::Duration::from_millis(
                config.billing.checkpoint_ms.max(100),
            ),
            reader_patience: std::time::Duration::from_millis(
                config
                    .billing
                    .stream_lease_secs
                    .saturating_mul(500)
                    .max(500),
            ),
            route_ahead,
            client_address_header: match config.gateway.client_address_header.as_str() {
                "" => None,
                name => Some(
                    HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()).map_err(|_| {
                        anyhow::anyhow!(
                            "gateway.client_address_header {name:?} is not a header name"
                        )
                    })?,
                ),
            },
        })
    }

    pub fn revision(&self) -> &str {
        &self.revision
    }

    /// Where documents become text: `rialto serve` passes a sandboxed
    /// [`convert::Converter::subprocess`]; the default converts in process.
    pub fn with_converter(mut self, converter: convert::Converter) -> Self {
        self.converter = converter;
        self
    }

    /// The catalog in force: what a request that looks at several models
    /// (or at one more than once) reads them from.
    fn catalog(&self) -> Arc<Catalog> {
        self.catalog.load_full()
    }

    /// A model by id, or by a trait or compatibility alias of one: for a
    /// request about this one model, which keeps the entry it got.
    fn model(&self, id: &str) -> Option<Arc<ModelEntry>> {
        self.catalog.load().model(id).cloned()
    }

    /// Builds what `config`'s catalog gives the gateway (the models with
    /// their headers and tokenizers, the configured characters), for a
    /// configuration reload; nothing is in force before
    /// [`Gateway::apply_reload`]. An error (a tokenizer that cannot be
    /// read, a name that cannot be a header) refuses the reload.
    pub fn prepare_reload(&self, config: &Config) -> anyhow::Result<CatalogReload> {
        Ok(CatalogReload(Catalog::new(config, &self.stamp)?))
    }

    /// Puts a prepared catalog in force: requests that start from now on
    /// see it; those under way keep the one they loaded. The characters
    /// are rebuilt at once with the stored ones already read.
    pub fn apply_reload(&self, reload: CatalogReload) {
        let catalog = Arc::new(reload.0);
        let mut characters = self.characters.write().unwrap_or_else(|e| e.into_inner());
        self.catalog.store(Arc::clone(&catalog));
        *characters = Arc::new(characters.with_configured(catalog.characters.clone()));
    }

    /// The characters now (a cheap snapshot).
    fn characters(&self) -> Arc<characters::CharacterSet> {
        self.characters
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn character(&self, slug: &str) -> Option<rialto_core::config::CharacterConfig> {
        self.characters().get(slug).cloned()
    }

    /// Reads the stored characters again (configuration ones first).
    async fn refresh_characters(&self) -> Result<(), ApiError> {
        let stored = self
            .services
            .auth
            .list_characters(auth_pb::ListCharactersRequest {})
            .await?
            .characters;
        // The configured ones read under the lock a reload takes too, so a
        // refresh that started before a reload never puts back the old ones.
        let mut characters = self.characters.write().unwrap_or_else(|e| e.into_inner());
        let configured = self.catalog.load().characters.clone();
        *characters = Arc::new(characters::CharacterSet::new(configured, stored));
        Ok(())
    }
}

/// What the gateway derives from the catalog of the configuration: swapped
/// whole by a reload.
pub(crate) struct Catalog {
    /// The models in configuration order, each with its response headers
    /// built once.
    pub(crate) models: Vec<Arc<ModelEntry>>,
    index: HashMap<String, usize>,
    /// Traits (the first model of each) and compatibility aliases.
    names: HashMap<String, usize>,
    /// `[[characters]]`, first in the character set.
    characters: Vec<rialto_core::config::CharacterConfig>,
}

impl Catalog {
    fn new(config: &Config, stamp: &headers::Stamp) -> anyhow::Result<Self> {
        let models: Vec<Arc<ModelEntry>> = config
            .models
            .iter()
            .map(|model| ModelEntry::new(model, stamp).map(Arc::new))
            .collect::<anyhow::Result<_>>()?;
        let index = models
            .iter()
            .enumerate()
            .map(|(i, m)| (m.config.id.clone(), i))
            .collect();
        let mut names = HashMap::default();
        for (i, model) in models.iter().enumerate() {
            for name in model.config.aliases.iter().chain(&model.config.traits) {
                names.entry(name.clone()).or_insert(i);
            }
        }
        Ok(Self {
            models,
            index,
            names,
            characters: config.characters.clone(),
        })
    }

    /// A model by id, or by a trait or compatibility alias of one.
    pub(crate) fn model(&self, id: &str) -> Option<&Arc<ModelEntry>> {
        self.index
            .get(id)
            .or_else(|| self.names.get(id))
            .map(|&i| &self.models[i])
    }
}

/// A catalog built for a configuration reload, not yet in force
/// ([`Gateway::prepare_reload`]).
pub struct CatalogReload(Catalog);

/// A model of the catalog with the headers every response about it carries
/// (`x-<brand>-model-id`, `-model-name`, and the deprecation pair).
pub struct ModelEntry {
    config: ModelConfig,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// `tokenizer`, loaded at start.
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    /// Its spend and token counters, each looked up once.
    counters: Arc<rialto_core::metrics::ModelCounters>,
    /// Its prices as exact decimals, read once (from the configuration's
    /// floats, through their shortest text: ~1,600 instructions a request).
    prices: rialto_billing::Prices,
}

impl ModelEntry {
    fn new(config: &ModelConfig, stamp: &headers::Stamp) -> anyhow::Result<Self> {
        let value = |text: &str| {
            HeaderValue::from_str(text).map_err(|_| {
                anyhow::anyhow!("model {}: {text:?} cannot be a header value", config.id)
            })
        };
        let mut headers = vec![
            (stamp.model_id.clone(), value(&config.id)?),
            (stamp.model_name.clone(), value(config.display_name())?),
        ];
        if let Some(date) = &config.deprecation_date {
            let warning = config.deprecation_warning.clone().unwrap_or_else(|| {
                format!(
                    "The model {} is deprecated and will be removed on {date}.",
                    config.id
                )
            });
            headers.push((stamp.deprecation_date.clone(), value(date)?));
            headers.push((stamp.deprecation_warning.clone(), value(&warning)?));
        }
        let tokenizer = match &config.tokenizer {
            Some(path) => {
                let mut tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|error| {
                    anyhow::anyhow!(
                        "model {}: cannot read its tokenizer {path}: {error}",
                        config.id
                    )
                })?;
                // All of the text counts: no truncation, no padding (an
                // embedding model's file may set both).
                tokenizer
                    .with_truncation(None)
                    .map_err(|error| anyhow::anyhow!("model {}: {error}", config.id))?;
                tokenizer.with_padding(None);
                Some(Arc::new(tokenizer))
            }
            None => None,
        };
        Ok(Self {
            config: config.clone(),
            headers,
            tokenizer,
            counters: Arc::new(rialto_core::metrics::ModelCounters::new(&config.id)),
            prices: rialto_billing::Prices::from_model(config),
        })
    }
}

/// Registers every route on an actix `App`.
pub fn configure(gateway: web::Data<Gateway>) -> impl FnOnce(&mut web::ServiceConfig) {
    let gateway_has_console = gateway.console.is_some();
    move |cfg| {
        cfg.app_data(gateway)
            // Malformed query strings and paths get the spec's error body too.
            .app_data(web::QueryConfig::default().error_handler(|error, _| {
                let mut details = Details::new();
                details.push(&[], format!("Invalid query string: {error}"));
                ApiError::validation(details).into()
            }))
            .app_data(web::PathConfig::default().error_handler(|error, _| {
                let mut details = Details::new();
                details.push(&[], format!("Invalid path: {error}"));
                ApiError::validation(details).into()
            }))
            .configure(|cfg| {
                if gateway_has_console {
                    console::configure(cfg);
                }
            })
            .route("/openapi.yaml", web::get().to(openapi::document))
            .route("/healthz", web::get().to(health))
            .route("/metrics", web::get().to(public_metrics))
            .route("/readyz", web::get().to(ready))
            .service(
                web::scope("/api/v1")
                    .route("/chat/completions", web::post().to(chat::completions))
                    .route("/responses", web::post().to(responses::create))
                    .route("/embeddings", web::post().to(embeddings::create))
                    .route("/image/generate", web::post().to(images::generate))
                    .route("/images/generations", web::post().to(images::generations))
                    .route("/image/styles", web::get().to(images::styles))
                    .route("/image/edit", web::post().to(images::edit))
                    .route("/image/multi-edit", web::post().to(images::multi_edit))
                    .route("/image/upscale", web::post().to(retouch::upscale))
                    .route(
                        "/image/background-remove",
                        web::post().to(retouch::background_remove),
                    )
                    .route("/audio/speech", web::post().to(audio::speech))
                    .route(
                        "/audio/transcriptions",
                        web::post().to(audio::transcriptions),
                    )
                    .route("/audio/voices", web::get().to(audio::voices))
                    .route("/audio/queue", web::post().to(jobs::audio_queue))
                    .route("/audio/retrieve", web::post().to(jobs::audio_retrieve))
                    .route("/audio/quote", web::post().to(jobs::audio_quote))
                    .route("/audio/complete", web::post().to(jobs::audio_complete))
                    .route("/video/queue", web::post().to(jobs::video_queue))
                    .route("/video/retrieve", web::post().to(jobs::video_retrieve))
                    .route("/video/quote", web::post().to(jobs::video_quote))
                    .route("/video/complete", web::post().to(jobs::video_complete))
                    .route(
                        "/video/transcriptions",
                        web::post().to(jobs::video_transcriptions),
                    )
                    .route("/augment/search", web::post().to(augment::search))
                    .route("/crypto/rpc/networks", web::get().to(crypto_rpc::networks))
                    .route("/crypto/rpc/{network}", web::post().to(crypto_rpc::proxy))
                    .route("/augment/scrape", web::post().to(augment::scrape))
                    .route("/augment/text-parser", web::post().to(augment::text_parser))
                    .route("/models", web::get().to(models::list))
                    .route("/models/traits", web::get().to(models::traits))
                    .route(
                        "/models/compatibility_mapping",
                        web::get().to(models::compatibility_mapping),
                    )
                    .route("/api_keys", web::get().to(keys::list))
                    .route("/api_keys", web::post().to(keys::create))
                    .route("/api_keys", web::delete().to(keys::delete))
                    .route("/api_keys", web::patch().to(keys::update))
                    // Before `/api_keys/{id}`, which would match them too.
                    .route(
                        "/api_keys/generate_web3_key",
                        web::get().to(keys::web3_token),
                    )
                    .route(
                        "/api_keys/generate_web3_key",
                        web::post().to(keys::create_web3),
                    )
                    .route("/api_keys/rate_limits", web::get().to(limits::rate_limits))
                    .route("/api_keys/rate_limits/log", web::get().to(limits::log))
                    .route("/api_keys/rate_limit_logs", web::get().to(limits::log))
                    .route("/billing/balance", web::get().to(limits::billing_balance))
                    .route("/billing/usage", web::get().to(usage::history))
                    .route("/billing/usage-history", web::get().to(usage::walk))
                    .route("/billing/usage-analytics", web::get().to(usage::analytics))
                    .route("/characters", web::get().to(characters::list))
                    .route("/characters/{slug}", web::get().to(characters::get))
                    .route(
                        "/characters/{slug}/reviews",
                        web::get().to(characters::reviews),
                    )
                    .route(
                        "/characters/{slug}/reviews",
                        web::post().to(characters::review),
                    )
                    .route("/x402/top-up", web::post().to(wallet::top_up))
                    .route("/x402/balance/{wallet}", web::get().to(wallet::balance))
                    .route(
                        "/x402/transactions/{wallet}",
                        web::get().to(wallet::transactions),
                    )
                    .route("/api_keys/{id}", web::get().to(keys::get)),
            )
            .service(
                web::scope("/admin/v1")
                    .route("/accounts", web::post().to(operator::create_account))
                    .route("/accounts", web::get().to(operator::list_accounts))
                    .route("/backends", web::get().to(operator::backends))
                    .route("/accounts/{id}", web::get().to(operator::get_account))
                    .route(
                        "/accounts/{id}/suspend",
                        web::post().to(operator::suspend_account),
                    )
                    .route("/accounts/{id}/keys", web::get().to(operator::list_keys))
                    .route("/accounts/{id}/keys", web::post().to(operator::create_key))
                    .route(
                        "/accounts/{id}/keys/{key}",
                        web::delete().to(operator::revoke_key),
                    )
                    .route(
                        "/accounts/{id}/limit-hits",
                        web::get().to(operator::limit_hits),
                    )
                    .route(
                        "/accounts/{id}/usage",
                        web::get().to(operator::account_usage),
                    )
                    .route(
                        "/accounts/{id}/resume",
                        web::post().to(operator::resume_account),
                    )
                    .route(
                        "/accounts/{id}/credits",
                        web::post().to(operator::credit_account),
                    )
                    .route("/accounts/{id}/tier", web::put().to(operator::set_tier))
                    .route("/accounts/{id}/stake", web::put().to(operator::set_stake))
                    .route(
                        "/characters/{slug}",
                        web::put().to(characters::put_character),
                    )
                    .route(
                        "/characters/{slug}",
                        web::delete().to(characters::delete_character),
                    ),
            )
            .default_service(web::to(not_found));
    }
}

/// Starts the HTTP server on `listener` (bind port 0 in tests). The returned
/// server runs until its handle is stopped.
pub fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    workers: usize,
    drain: std::time::Duration,
) -> std::io::Result<Server> {
    // Characters stored through any gateway reach this one within seconds.
    let refresher = Arc::downgrade(&gateway);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            every.tick().await;
            let Some(gateway) = refresher.upgrade() else {
                break;
            };
            if let Err(error) = gateway.refresh_characters().await {
                tracing::debug!(%error, "cannot refresh characters");
            }
        }
    });
    let (max_connections, request_timeout) =
        (gateway.max_connections, gateway.client_request_timeout);
    let gateway = web::Data::from(gateway);
    let mut server = HttpServer::new(move || {
        App::new()
            .wrap(actix_web::middleware::Compress::default())
            .wrap(actix_web::middleware::from_fn(headers::stamp))
            .configure(configure(gateway.clone()))
    })
    .disable_signals()
    // A graceful stop waits this long for requests and streams in flight.
    .shutdown_timeout(drain.as_secs().max(1))
    // Without it, a stream's first chunk waits for the ACK of its headers
    // (Nagle against delayed ACK): ~40 ms to the first token.
    .tcp_nodelay(true)
    // Bounds on what idle or slow clients hold: connections per worker,
    // and the time a request's head may take (slowloris).
    .max_connections(max_connections)
    .client_request_timeout(request_timeout)
    // A client that closes its side has left: its handler is dropped at
    // once (a stream's upstream call cancelled and what it used billed, a
    // hold released) instead of running on until a write fails. HTTP/1.1
    // clients do not half-close to wait for an answer.
    .h1_allow_half_closed(false)
    .listen(listener)?;
    if workers > 0 {
        server = server.workers(workers);
    }
    Ok(server.run())
}

async fn health() -> actix_web::HttpResponse {
    actix_web::HttpResponse::Ok().json(serde_json::json!({"status": "ok"}))
}

impl Gateway {
    /// The operator token in force, for a watcher of `operator.token_file`.
    pub fn operator_token(&self) -> Option<&rialto_core::secrets::LiveSecret> {
        self.operator_token.as_ref()
    }

    /// Readiness goes false: the first step of a graceful shutdown.
    pub fn start_draining(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Waits, at most `limit`, for the settlements requests handed off to
/// background tasks (clients that left, broken streams) to finish.
pub async fn settlements_drained(limit: std::time::Duration) -> bool {
    chat::pending_settlements(limit).await
}

/// `GET /readyz`: 503 once the process is shutting down, so load balancers
/// stop sending before the listener closes.
async fn ready(gateway: web::Data<Gateway>) -> actix_web::HttpResponse {
    if gateway.draining.load(std::sync::atomic::Ordering::Relaxed) {
        actix_web::HttpResponse::ServiceUnavailable()
            .json(serde_json::json!({"status": "draining"}))
    } else {
        health().await
    }
}

/// `GET /metrics`: this process's Prometheus metrics.
async fn metrics() -> actix_web::HttpResponse {
    actix_web::HttpResponse::Ok()
        .content_type(rialto_core::metrics::CONTENT_TYPE)
        .body(rialto_core::metrics::metrics().render())
}

async fn public_metrics(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
) -> Result<actix_web::HttpResponse, ApiError> {
    if gateway.public_metrics {
        Ok(metrics().await)
    } else {
        not_found(request).await
    }
}

/// Serves `GET /metrics` alone on `listener` (`metrics.listen`): the port
/// Prometheus scrapes, for every process whatever services it runs.
pub fn serve_metrics(listener: TcpListener) -> std::io::Result<Server> {
    Ok(
        HttpServer::new(|| App::new().route("/metrics", web::get().to(metrics)))
            .workers(1)
            .disable_signals()
            .listen(listener)?
            .run(),
    )
}

async fn not_found(request: HttpRequest) -> Result<actix_web::HttpResponse, ApiError> {
    Err(ApiError::new(
        ErrorCode::NotFound,
        format!("No route for {} {}", request.method(), request.path()),
    ))
}

/// Reads a request body, refusing it with 413 past the configured limit
/// without buffering more than the limit.
async fn read_body(
    gateway: &Gateway,
    request: &HttpRequest,
    mut payload: web::Payload,
) -> Result<Bytes, ApiError> {
    // Every body read here is JSON: a body declared as something else is the
    // spec's 415 (no Content-Type at all is read as JSON).
    if let Some(content_type) = request.headers().get(actix_web::http::header::CONTENT_TYPE) {
        let essence = content_type.as_bytes();
        let essence = essence
            .split(|&b| b == b';')
            .next()
            .unwrap_or_default()
            .trim_ascii();
        let json = essence.eq_ignore_ascii_case(b"application/json")
            || essence.len() >= 5 && essence[essence.len() - 5..].eq_ignore_ascii_case(b"+json");
        if !json {
            return Err(ApiError::new(
                ErrorCode::UnsupportedMediaType,
                "Invalid request content-type: send the body as JSON, with Content-Type: \
                 application/json",
            ));
        }
    }
    let limit = gateway.max_body_bytes;
    let too_large = || {
        ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("Request body is larger than the limit of {limit} bytes"),
        )
    };
    let declared = request
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(too_large());
    }
    let mut body = web::BytesMut::with_capacity(declared.unwrap_or(1024).min(limit));
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::new(ErrorCode::InvalidRequest, format!("{e}")))?;
        if body.len() + chunk.len() > limit {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// Parses a JSON body; malformed JSON is a validation error.
fn parse_json(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let mut details = Details::new();
        details.push(&[], format!("Malformed JSON body: {e}"));
        ApiError::validation(details)
    })
}

/// The caller's principal from `Authorization: Bearer <key>`.
async fn authenticate(
    gateway: &Gateway,
    request: &HttpRequest,
) -> Result<auth_pb::Principal, ApiError> {
    authenticate_caller(gateway, request, true).await
}

/// Authenticates a key, or where `wallets` (inference routes) a signed-in
/// wallet, whose sign-in then wins over a key. Key-only routes ignore a
/// sign-in beside a key, and refuse one alone without consuming its nonce.
async fn authenticate_caller(
    gateway: &Gateway,
    request: &HttpRequest,
    wallets: bool,
) -> Result<auth_pb::Principal, ApiError> {
    wallet::refuse_payment_header(request.headers())?;
    let has_key = request
        .headers()
        .contains_key(actix_web::http::header::AUTHORIZATION);
    if !wallets && !has_key && wallet::sign_in_header(request.headers()).is_some() {
        return Err(ApiError::new(
            ErrorCode::Unauthenticated,
            "This route takes an API key (Authorization: Bearer <API_KEY>); a signed-in wallet \
             can use the inference routes and /api/v1/x402",
        ));
    }
    if let Some(header) = wallet::sign_in_header(request.headers()).filter(|_| wallets) {
        let principal = wallet::sign_in(gateway, header).await?;
        limits::refuse_blocked_wallet(gateway, &principal.account_id)?;
        request.extensions_mut().insert(Authenticated {
            account_id: principal.account_id.clone(),
            key_id: principal.key_id.clone(),
            tier: principal.tier.clone(),
        });
        return Ok(principal);
    }
    if !request
        .headers()
        .contains_key(actix_web::http::header::AUTHORIZATION)
    {
        // No credentials at all: how to get some (a key, or a wallet).
        return Err(wallet::discovery(gateway, request));
    }
    let key = bearer_token(request.headers()).ok_or_else(|| {
        ApiError::new(
            ErrorCode::Unauthenticated,
            "Authentication failed: the Authorization header must be `Bearer <API_KEY>`",
        )
    })?;
    let principal = gateway
        .services
        .auth
        .authenticate(auth_pb::AuthenticateRequest {
            api_key: key.to_owned(),
        })
        .await?;
    if let Some(id) = request.extensions().get::<headers::RequestId>() {
        tracing::debug!(request_id = %id.0, key_id = principal.key_id, "authenticated");
    }
    // Failures from here on count against the credential, not the address.
    request.extensions_mut().insert(Authenticated {
        account_id: principal.account_id.clone(),
        key_id: principal.key_id.clone(),
        tier: principal.tier.clone(),
    });
    Ok(principal)
}

/// The token of `Authorization: Bearer <token>` (scheme in either case,
/// surrounding spaces ignored), the one form every check reads.
///
/// Read as bytes, the token checked as UTF-8 only (word at a time):
/// `HeaderValue::to_str` checked each byte of the whole header for visible
/// ASCII, 1,209 instructions a call against 385, twice a request
/// (callgrind). A token with other bytes is one no key matches.
fn bearer_token(headers: &actix_web::http::header::HeaderMap) -> Option<&str> {
    let header = headers
        .get(actix_web::http::header::AUTHORIZATION)?
        .as_bytes()
        .trim_ascii_start();
    let space = header.iter().position(|&b| b == b' ')?;
    let token = header[space + 1..].trim_ascii();
    if !header[..space].eq_ignore_ascii_case(b"bearer") || token.is_empty() {
        return None;
    }
    std::str::from_utf8(token).ok()
}

/// Marks a request whose credentials were accepted (request extensions).
#[derive(Debug, Clone)]
pub(crate) struct Authenticated {
    account_id: String,
    key_id: String,
    tier: String,
}

/// The caller's balances before the request (request extensions), for
/// `x-<brand>-balance-usd` and `-diem`.
#[derive(Debug, Clone)]
pub(crate) struct BalanceHeaders {
    pub usd: String,
    pub diem: String,
}

/// The API key a principal authenticated with; "" for a wallet's
/// `SIGN-IN-WITH-X` (whose key id names the wallet).
fn api_key_id(principal: &auth_pb::Principal) -> &str {
    if principal.key_id.starts_with("wallet:") {
        ""
    } else {
        &principal.key_id
    }
}

/// The ledger owner of a principal: its account.
fn ledger_owner(principal: &auth_pb::Principal) -> String {
    if principal.wallet.is_empty() {
        rialto_billing::account_owner(&principal.account_id)
    } else {
        rialto_billing::wallet_owner(&principal.wallet)
    }
}

/// A key's cap as billing enforces it; None when it caps no currency.
fn key_limit(
    key_id: &str,
    limit: Option<&auth_pb::ConsumptionLimit>,
) -> Option<rialto_proto::billing::v1::KeyLimit> {
    let limit = limit.filter(|l| l.usd_nanos.is_some() || l.diem_nanos.is_some())?;
    Some(rialto_proto::billing::v1::KeyLimit {
        key_id: key_id.to_owned(),
        usd_nanos: limit.usd_nanos,
        diem_nanos: limit.diem_nanos,
        period: limit.period.clone(),
    })
}

/// The `x-ratelimit-*` values of a request (request extensions); the stamp
/// middleware writes them on the response, whatever its status.
#[derive(Debug, Clone)]
pub(crate) struct RateLimitHeaders(pub RateHeaders);

fn caller(principal: &auth_pb::Principal) -> Caller<'_> {
    Caller {
        account_id: &principal.account_id,
        key_id: &principal.key_id,
        tier: &principal.tier,
    }
}

/// Authenticates a call of a non-inference endpoint (ADMIN keys only when
/// `admin`) and takes a slot in the caller's window of that endpoint.
async fn authenticate_endpoint(
    gateway: &Gateway,
    request: &HttpRequest,
    admin: bool,
) -> Result<auth_pb::Principal, ApiError> {
    let principal = if admin {
        authenticate_admin(gateway, request).await?
    } else {
        authenticate_caller(gateway, request, false).await?
    };
    let window = format!(
        "endpoint:{}",
        request
            .match_pattern()
            .as_deref()
            .unwrap_or(request.path())
            .trim_start_matches('/')
    );
    let request_id = request
        .extensions()
        .get::<headers::RequestId>()
        .map(|id| id.0.clone())
        .unwrap_or_default();
    // The balance before the request, for its headers, read while the
    // limiter decides.
    let balance =
        gateway
            .services
            .billing
            .get_balance(rialto_proto::billing::v1::GetBalanceRequest {
                owner: ledger_owner(&principal),
            });
    let admission = gateway.services.limiter.admit(
        caller(&principal),
        Target::endpoint(&window),
        &request_id,
        0,
    );
    let (balance, admission) = tokio::join!(balance, admission);
    let admission = admission?;
    match balance {
        Ok(balance) => {
            request.extensions_mut().insert(BalanceHeaders {
                usd: balance.usd,
                diem: balance.diem,
            });
        }
        // Headers are not worth failing a request that needs no money.
        Err(error) => tracing::debug!(%error, "no balance for the headers"),
    }
    if let Some(headers) = admission.headers {
        request.extensions_mut().insert(RateLimitHeaders(headers));
    }
    if let Some(refusal) = admission.refusal {
        return Err(refusal.into());
    }
    // No tokens to correct: the slot stays taken for the window.
    drop(admission.ticket);
    Ok(principal)
}

/// Like [`authenticate`], and the key must be an ADMIN key.
async fn authenticate_admin(
    gateway: &Gateway,
    request: &HttpRequest,
) -> Result<auth_pb::Principal, ApiError> {
    let principal = authenticate_caller(gateway, request, false).await?;
    if principal.key_type != auth_pb::KeyType::Admin as i32 {
        return Err(ApiError::new(
            ErrorCode::AdminRequired,
            "Admin API key required",
        ));
    }
    Ok(principal)
}

fn header_value(value: &str) -> Option<HeaderValue> {
    HeaderValue::from_str(value).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bearer_token_is_read_in_every_form_a_client_sends_it() {
        let token = |value: &[u8]| {
            let mut headers = actix_web::http::header::HeaderMap::new();
            headers.insert(
                actix_web::http::header::AUTHORIZATION,
                actix_web::http::header::HeaderValue::from_bytes(value).unwrap(),
            );
            bearer_token(&headers).map(str::to_owned)
        };
        assert_eq!(token(b"Bearer rk_abc").as_deref(), Some("rk_abc"));
        assert_eq!(token(b"bearer rk_abc").as_deref(), Some("rk_abc"));
        assert_eq!(token(b"  BEARER   rk_abc \t").as_deref(), Some("rk_abc"));
        assert_eq!(token(b"Basic cmtfYWJj"), None);
        assert_eq!(token(b"Bearer"), None);
        assert_eq!(token(b"Bearer    "), None);
        assert_eq!(token(b"Bearerrk_abc"), None);
        assert_eq!(token(b"Bearer \xff\xfe"), None, "not UTF-8");
        assert_eq!(
            bearer_token(&actix_web::http::header::HeaderMap::new()),
            None
        );
    }

    /// A gateway whose services are never called: lazy channels to a port
    /// nothing listens on.
    fn gateway(config: &Config) -> Gateway {
        let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:9").connect_lazy();
        let token = rialto_core::grpc_auth::ClientToken::new(None).unwrap();
        let limiter = rialto_limiter::LimiterClient::new(rialto_limiter::grpc::RemoteLimiter::new(
            channel.clone(),
            token.clone(),
        ));
        let services = Services {
            auth: AuthClient::new(rialto_auth::grpc::RemoteAuth::new(
                channel.clone(),
                token.clone(),
            )),
            limiter: RateLimiter::new(config, vec![("limiter".into(), limiter)], None),
            billing: BillingClient::new(rialto_billing::grpc::RemoteBilling::new(
                channel.clone(),
                token.clone(),
            )),
            router: RouterClient::new(rialto_router::grpc::RemoteRouter::new(
                channel,
                token,
                1 << 20,
            )),
            usage_queue: None,
            bus: None,
        };
        Gateway::new(config, services, "20260101.000000").unwrap()
    }

    fn config(models: &str) -> Config {
        Config::from_toml(models).unwrap()
    }

    const BEFORE: &str = r#"
[[models]]
id = "old"
traits = ["default"]
[[characters]]
slug = "pirate"
name = "Pirate"
system_prompt = "Arr"
"#;

    const AFTER: &str = r#"
[[models]]
id = "new"
name = "New Model"
traits = ["default"]
aliases = ["gpt-4o"]
[[characters]]
slug = "poet"
name = "Poet"
system_prompt = "Rhyme"
"#;

    #[tokio::test]
    async fn a_reload_swaps_the_catalog_and_keeps_a_request_on_its_own() {
        let gateway = gateway(&config(BEFORE));
        // A stored character, as the refresh reads them from auth.
        let stored = auth_pb::Character {
            slug: "stored".into(),
            name: "Stored".into(),
            public: true,
            ..Default::default()
        };
        *gateway.characters.write().unwrap() = Arc::new(characters::CharacterSet::new(
            config(BEFORE).characters,
            vec![stored],
        ));
        let request = gateway.catalog();
        assert!(
            gateway
                .model("default")
                .is_some_and(|m| m.config.id == "old")
        );

        let prepared = gateway.prepare_reload(&config(AFTER)).unwrap();
        assert!(
            gateway.model("old").is_some(),
            "nothing changes before it is applied"
        );
        gateway.apply_reload(prepared);

        assert!(gateway.model("old").is_none());
        let new = gateway.model("gpt-4o").unwrap();
        assert_eq!(new.config.id, "new");
        assert_eq!(gateway.model("default").unwrap().config.id, "new");
        assert_eq!(gateway.catalog().models.len(), 1);
        // Its headers are built for the new entry.
        assert!(new.headers.iter().any(|(_, value)| value == "New Model"));
        // A request that loaded the catalog before keeps it whole.
        assert_eq!(request.model("default").unwrap().config.id, "old");
        assert!(request.model("gpt-4o").is_none());
        // The configured characters are replaced; the stored one stays.
        assert!(gateway.character("pirate").is_none());
        assert_eq!(gateway.character("poet").unwrap().system_prompt, "Rhyme");
        assert!(gateway.character("stored").is_some());
    }

    #[tokio::test]
    async fn a_catalog_that_cannot_be_built_is_refused_whole() {
        let gateway = gateway(&config(BEFORE));
        let unreadable =
            config("[[models]]\nid = \"new\"\ntokenizer = \"/nonexistent/tokenizer.json\"\n");
        let error = gateway.prepare_reload(&unreadable).err().unwrap();
        assert!(error.to_string().contains("tokenizer"), "{error}");
        assert!(gateway.model("old").is_some());
        assert!(gateway.model("new").is_none());
        assert!(gateway.character("pirate").is_some());
    }
}
