//! Layered configuration: built-in defaults, then a TOML file, then
//! `RIALTO_<SECTION>__<KEY>` environment variables.
//!
//! `rialto serve` with no file must start and serve, so every field has a
//! default. The model catalog (`[[models]]`) is configuration shared by all
//! services: the gateway validates against it, the limiter reads tiers, billing
//! reads prices and the router reads backends.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use rust_decimal::Decimal;
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

/// Whether a database URL carries a password (`postgres://user:pw@host`).
fn url_has_password(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    authority
        .rsplit_once('@')
        .is_some_and(|(user_info, _)| user_info.contains(':'))
}

/// Environment variable naming the configuration file.
pub const CONFIG_ENV: &str = "RIALTO_CONFIG";

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The brand every wire name carries (`<brand>_parameters`, `x-<brand>-version`).
    pub brand: String,
    /// Services this process runs when `--services` is not given.
    pub services: Vec<String>,
    pub gateway: GatewayConfig,
    pub grpc: GrpcConfig,
    pub database: DatabaseConfig,
    pub operator: OperatorConfig,
    pub secrets: SecretsConfig,
    pub remote: RemoteConfig,
    pub router: RouterConfig,
    pub log: LogConfig,
    pub limits: LimitsConfig,
    pub billing: BillingConfig,
    pub bus: BusConfig,
    pub wallet: WalletConfig,
    pub x402: X402Config,
    pub models: Vec<ModelConfig>,
    pub characters: Vec<CharacterConfig>,
    pub metrics: MetricsConfig,
    pub shutdown: ShutdownConfig,
    pub failover: FailoverConfig,
    pub web_search: WebSearchConfig,
    pub web_scraping: WebScrapingConfig,
    pub text_parser: TextParserConfig,
    pub media: MediaConfig,
    pub crypto_rpc: CryptoRpcConfig,
    pub console: ConsoleConfig,
    /// The file this configuration was read from (`--config`, else
    /// `RIALTO_CONFIG`), which a reload reads again; none for defaults.
    #[serde(skip)]
    pub file: Option<PathBuf>,
}

/// The web console (`[console]`, `/console/`): operators and account
/// holders in a browser. Off unless `enabled`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsoleConfig {
    /// Serve `/console/` on the gateway's port.
    pub enabled: bool,
    /// How long a session cookie lives (seconds).
    pub session_ttl_secs: u64,
    /// The key that signs session cookies. Every gateway replica must have
    /// the same one; when neither it nor `session_key_file` is set, each
    /// process draws its own at start (sessions end with the process).
    #[serde(skip_serializing)]
    pub session_key: Option<SecretString>,
    /// A file holding the session key (a mounted Secret), instead of
    /// `session_key`.
    pub session_key_file: Option<PathBuf>,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            session_ttl_secs: 8 * 3600,
            session_key: None,
            session_key_file: None,
        }
    }
}

/// The JSON-RPC proxy to blockchain nodes (`[crypto_rpc]`,
/// `POST /crypto/rpc/{network}`): each call costs its network's
/// `base_credits` times its method's tier, at `usd_per_credit`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CryptoRpcConfig {
    /// USD of one credit (the hosted API's is about 7e-7).
    pub usd_per_credit: f64,
    /// Credits a call the node answered with a JSON-RPC `error` costs,
    /// instead of its method's price.
    pub error_credits: u64,
    /// Calls a batch may hold.
    pub max_batch: usize,
    /// How long one upstream may take before the next is tried.
    pub timeout_ms: u64,
    /// The methods callers may use, each with its tier: the multiple of a
    /// network's `base_credits` it costs (1 standard, 2 advanced, 4
    /// large). Empty: the built-in list (read calls, transaction
    /// submission, traces and Solana's methods; never filters or
    /// subscriptions, which a load-balanced HTTP proxy cannot serve).
    pub methods: BTreeMap<String, u64>,
    pub networks: Vec<CryptoNetworkConfig>,
}

impl Default for CryptoRpcConfig {
    fn default() -> Self {
        Self {
            usd_per_credit: 0.0000007,
            error_credits: 5,
            max_batch: 100,
            timeout_ms: 10_000,
            methods: BTreeMap::new(),
            networks: Vec::new(),
        }
    }
}

/// One network of `[crypto_rpc]` (`[[crypto_rpc.networks]]`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CryptoNetworkConfig {
    /// The path's `{network}`, e.g. `ethereum-mainnet`.
    pub slug: String,
    /// The nodes' JSON-RPC URLs, tried in order: a node that cannot be
    /// reached, times out or answers 5xx or 429 hands the call to the next.
    pub urls: Vec<String>,
    /// Credits of a standard call (the hosted API's: 20 for most EVM chains
    /// and Starknet, 30 for zkSync Era and Solana).
    #[serde(default = "default_base_credits")]
    pub base_credits: u64,
    /// This network's methods, when not every method of `[crypto_rpc]
    /// methods` (names only; their tiers come from there).
    #[serde(default)]
    pub methods: Vec<String>,
}

fn default_base_credits() -> u64 {
    20
}

/// The image and audio endpoints (`[media]`); each model's prices are its
/// own (`usd_per_image`, `usd_per_thousand_characters`,
/// `usd_per_audio_second`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MediaConfig {
    /// `GET /image/styles`, and the `style_preset`s `/image/generate`
    /// accepts: a preset is added to the prompt (`<prompt>, <preset>
    /// style`), since OpenAI-compatible image servers know no presets.
    pub image_styles: Vec<String>,
    /// Largest uploaded file (audio to transcribe, an image to edit), in
    /// bytes; OpenAI's limit is 25 MB.
    pub max_upload_bytes: usize,
    /// How long the media of a finished asynchronous job (`/video/queue`,
    /// `/audio/queue`) is kept for `retrieve` when nobody completes it.
    pub retention_hours: u64,
    /// Jobs one gateway runs at once (each mostly waits on its backend).
    pub job_workers: usize,
    /// How long a worker's claim on a job holds without a renewal: a job
    /// whose process died is taken up again by another (or the restarted
    /// one) after this.
    pub job_lease_secs: u32,
    /// How often an idle gateway looks for queued jobs (a job queued
    /// through any gateway wakes them at once when the bus is shared), and
    /// the first wait between two polls of a backend's job (doubling to
    /// ten times this).
    pub job_poll_ms: u64,
}

impl Default for MediaConfig {
    fn default() -> Self {
        Self {
            image_styles: [
                "3D Model",
                "Analog Film",
                "Anime",
                "Cinematic",
                "Comic Book",
                "Digital Art",
                "Fantasy Art",
                "Line Art",
                "Neon Punk",
                "Origami",
                "Photographic",
                "Pixel Art",
                "Watercolor",
            ]
            .map(str::to_owned)
            .to_vec(),
            max_upload_bytes: 25 * 1024 * 1024,
            retention_hours: 24,
            job_workers: 4,
            job_lease_secs: 30,
            job_poll_ms: 1000,
        }
    }
}

/// The search provider behind `enable_web_search` and `POST
/// /augment/search` (`[web_search]`). With no `provider`, requests asking
/// for search are refused (400) and no model advertises it.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct WebSearchConfig {
    /// `searxng` (a SearXNG instance's JSON API at `url`) or `brave` (the
    /// Brave Search API; `url` defaults to its public endpoint); empty for
    /// none.
    pub provider: String,
    /// SearXNG: the instance's base URL (`http://searxng:8080`). Brave: the
    /// web-search endpoint, when not the public one.
    pub url: String,
    /// Environment variable holding the provider's API key (Brave's
    /// subscription token), read at start.
    pub api_key_env: Option<String>,
    /// A file holding the API key (a mounted Secret), re-read when it
    /// changes; instead of `api_key_env`.
    pub api_key_file: Option<PathBuf>,
    /// The key read from `api_key_file` at load.
    #[serde(skip)]
    pub api_key: Option<SecretString>,
    /// Results a search puts in the prompt (and `/augment/search` returns
    /// when the caller sets no `limit`); 1 to 20.
    pub max_results: usize,
    /// How long a search may take before the request goes on without it.
    pub timeout_ms: u64,
    /// Price of one search, added to the request's cost (USD).
    pub usd_per_search: f64,
    /// What `enable_web_search = "on"` searches for: `last_user_message`
    /// (its text, as written) or `model` (a query the model writes from the
    /// conversation first, priced at its token prices).
    pub query: String,
}

impl Default for WebSearchConfig {
    fn default() -> Self {
        Self {
            provider: String::new(),
            url: String::new(),
            api_key_env: None,
            api_key_file: None,
            api_key: None,
            max_results: 10,
            timeout_ms: 5_000,
            usd_per_search: 0.0,
            query: "last_user_message".to_owned(),
        }
    }
}

/// `enable_web_scraping` and `POST /augment/scrape` (`[web_scraping]`):
/// pages are fetched under the file-URL rules and limits (public addresses
/// only unless `gateway.file_urls_allow_private`, no redirects, 15 s, 10
/// MiB).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct WebScrapingConfig {
    /// Price of one successfully scraped URL (USD).
    pub usd_per_scraped_url: f64,
    /// Characters of one page's readable text kept for the prompt.
    pub max_chars_per_page: usize,
}

impl Default for WebScrapingConfig {
    fn default() -> Self {
        Self {
            usd_per_scraped_url: 0.0,
            max_chars_per_page: 20_000,
        }
    }
}

/// `POST /augment/text-parser` (`[text_parser]`).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TextParserConfig {
    /// Price of one parsed file (USD); free when 0.
    pub usd_per_file: f64,
}

/// Failover among limiter and billing replicas (`[failover]`), when several
/// are listed in `remote.limiter` or `remote.billing` and the bus is NATS:
/// each replica publishes a heartbeat every `heartbeat_ms`; one not heard
/// for `dead_after_ms` is dead, and the principals and ledgers it owned go
/// to the next live replica in rendezvous order; one heard again without a
/// gap for `rejoin_after_ms` (a limiter: at least one rate window) takes
/// them back. See ARCHITECTURE.md, "Failover".
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct FailoverConfig {
    pub heartbeat_ms: u64,
    /// At least three heartbeats: a replica is never declared dead on one
    /// late beat.
    pub dead_after_ms: u64,
    pub rejoin_after_ms: u64,
}

impl Default for FailoverConfig {
    fn default() -> Self {
        Self {
            heartbeat_ms: 250,
            dead_after_ms: 1500,
            rejoin_after_ms: 1000,
        }
    }
}

/// Graceful shutdown (`[shutdown]`), on SIGTERM or Ctrl-C: readiness goes
/// false (`/readyz` 503, gRPC health NOT_SERVING), then after `delay_ms`
/// the servers stop accepting and drain in-flight requests and streams for
/// up to `drain_secs`, the settlements still on their way are awaited, the
/// bus is flushed, and the process exits.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownConfig {
    /// Time for load balancers to see readiness go false before the
    /// listeners close (Kubernetes: a few seconds).
    pub delay_ms: u64,
    /// The longest an in-flight request or stream may take to finish.
    pub drain_secs: u64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            delay_ms: 0,
            drain_secs: 30,
        }
    }
}

/// Prometheus metrics (`[metrics]`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Where `GET /metrics` is served, on its own port (in Kubernetes,
    /// `0.0.0.0:9464`, kept off the public Service). Empty: the gateway
    /// serves `/metrics` on its own port, and a process without a gateway
    /// serves none.
    pub listen: String,
    /// How many ledger owners `rialto_top_owner_spend_usd` shows: the top
    /// spenders since the process started (a bounded label, never one
    /// series per account). 0: none.
    pub top_spenders: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            listen: String::new(),
            top_spenders: 20,
        }
    }
}

/// A character (`[[characters]]`): a persona whose system prompt a chat
/// request applies with `character_slug`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CharacterConfig {
    /// Public id, in `character_slug` and `/characters/{slug}`.
    pub slug: String,
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Put before the caller's system prompts (after the service's).
    pub system_prompt: String,
    /// The model the character is meant for (informational).
    #[serde(default)]
    pub model_id: Option<String>,
    /// Listed and usable by everyone; a private character is neither.
    #[serde(default = "default_true")]
    pub public: bool,
    #[serde(default)]
    pub tags: Vec<String>,
    /// What `GET /characters?categories=` filters by.
    #[serde(default)]
    pub categories: Vec<String>,
    #[serde(default)]
    pub adult: bool,
    #[serde(default)]
    pub featured: bool,
    #[serde(default)]
    pub web_enabled: bool,
    #[serde(default)]
    pub author: String,
    #[serde(default)]
    pub photo_url: String,
    #[serde(default)]
    pub share_url: String,
    /// RFC 3339; the Unix epoch when unset.
    #[serde(default)]
    pub created_at: Option<String>,
}

fn default_true() -> bool {
    true
}

/// Wallet sign-in (`[wallet]`, Sign-In-With-X).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct WalletConfig {
    /// Domains (`host` or `host:port`) sign-in messages must name, in
    /// `domain` and in their `uri`.
    pub domains: Vec<String>,
    /// EVM chain ids a wallet may sign in on (`eip155:<id>`).
    pub evm_chain_ids: Vec<u64>,
    /// Solana chain references (genesis hashes) a wallet may sign in on.
    pub solana_chains: Vec<String>,
    /// The rate-limit tier of wallets.
    pub tier: String,
    /// The statement of the sign-in challenge in 402 answers.
    pub statement: String,
    /// USD a signed-in wallet must hold to be served at all, free models
    /// included: below it, the 402 with top-up instructions. Above 0, so
    /// a wallet made a moment ago is not a free account.
    pub min_balance_usd: String,
}

impl Default for WalletConfig {
    fn default() -> Self {
        Self {
            domains: vec!["127.0.0.1:8080".into(), "localhost:8080".into()],
            evm_chain_ids: vec![8453],
            solana_chains: vec!["5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp".into()],
            tier: "standard".into(),
            statement: "Sign in to Rialto".into(),
            min_balance_usd: "0.01".into(),
        }
    }
}

/// x402 top-ups (`[x402]`): USDC paid to us, credited to the payer's
/// wallet ledger once a facilitator settled it.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct X402Config {
    /// The facilitator's base URL (`/verify`, `/settle`); empty: top-ups
    /// are off (503).
    pub facilitator_url: String,
    /// Our USDC receiving address on Base; empty: no Base option.
    pub pay_to_evm: String,
    /// Our USDC receiving wallet on Solana; empty: no Solana option.
    pub pay_to_solana: String,
    /// The Solana fee payer to advertise (`extra.feePayer`), the
    /// facilitator's; required for the Solana option.
    pub solana_fee_payer: String,
    /// Smallest and largest top-up, in USD.
    pub min_usd: String,
    pub max_usd: String,
    /// How long a signed payment may take (`maxTimeoutSeconds`).
    pub max_timeout_secs: u64,
    /// Bound on each facilitator call.
    pub facilitator_timeout_secs: u64,
    /// The EVM network, its USDC contract and EIP-712 domain.
    pub evm_network: String,
    pub evm_asset: String,
    pub evm_asset_name: String,
    pub evm_asset_version: String,
    /// The Solana network and its USDC mint.
    pub solana_network: String,
    pub solana_asset: String,
}

impl Default for X402Config {
    fn default() -> Self {
        Self {
            facilitator_url: String::new(),
            pay_to_evm: String::new(),
            pay_to_solana: String::new(),
            solana_fee_payer: String::new(),
            min_usd: "5".into(),
            max_usd: "10000".into(),
            max_timeout_secs: 300,
            facilitator_timeout_secs: 30,
            evm_network: "eip155:8453".into(),
            evm_asset: "0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913".into(),
            evm_asset_name: "USD Coin".into(),
            evm_asset_version: "2".into(),
            solana_network: "solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp".into(),
            solana_asset: "EPjFWdd5AufqSSqeM2qN1xzybapC8G4wEGGkZwyTDt1v".into(),
        }
    }
}

/// The prepaid ledger (`[billing]`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct BillingConfig {
    /// Seconds an unsettled hold (a crashed gateway's) lives before it is
    /// released; longer than the longest request.
    pub hold_ttl_secs: u64,
    /// Seconds a stream's hold lives past its last checkpoint: a stream
    /// whose gateway died is charged its last checkpoint after this.
    pub stream_lease_secs: u64,
    /// How often a running stream records what it used so far
    /// (milliseconds).
    pub checkpoint_ms: u64,
}

impl Default for BillingConfig {
    fn default() -> Self {
        Self {
            hold_ttl_secs: 900,
            stream_lease_secs: 30,
            checkpoint_ms: 2000,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Address of the public HTTP API.
    pub listen: SocketAddr,
    /// Largest accepted request body; larger ones get 413.
    pub max_body_bytes: usize,
    /// Value of `x-<brand>-host-name`; the machine's host name when empty.
    pub host_name: String,
    /// HTTP worker threads; 0 means one per core.
    pub workers: usize,
    /// Header naming the client's address when a trusted proxy sets it
    /// (`x-forwarded-for`, `x-real-ip`); the rightmost address in it is
    /// used. Empty: the TCP peer address.
    pub client_address_header: String,
    /// Whether `file` parts given by URL may point at loopback, private or
    /// link-local addresses (off: the gateway must not be a way into the
    /// operator's network; tests turn it on).
    pub file_urls_allow_private: bool,
    /// Connections each HTTP worker holds at most; beyond, new ones wait
    /// in the listen backlog.
    pub max_connections: usize,
    /// Time a client has to send a request's head (method, path and
    /// headers) once connected or between keep-alive requests; slower
    /// (slowloris) connections are answered 408 and closed.
    pub client_request_timeout_ms: u64,
    /// Connections the kernel queues for the gateway before it accepts
    /// them (capped by `net.core.somaxconn`); a burst beyond it waits for
    /// the client's SYN retry, a second or more.
    pub listen_backlog: u32,
    /// For how long a caller's last admission and hold, when they left
    /// room for 64 more requests like it, let a plain chat's route start
    /// beside its next admission and hold rather than after them (a split
    /// deployment: one round of calls fewer). A refusal drops the route
    /// (its upstream call cancelled) and stops this for the caller as
    /// long. 0: every route waits for its admission.
    pub route_ahead_ms: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcConfig {
    /// Where this process serves the services it runs, when any but the gateway.
    pub listen: SocketAddr,
    /// Shared bearer token of the internal gRPC interfaces; set it wherever
    /// the gRPC port is reachable by anyone but Rialto's own processes.
    #[serde(skip_serializing)]
    pub token: Option<SecretString>,
    /// A file holding the token, re-read when it changes; instead of `token`.
    pub token_file: Option<PathBuf>,
    /// TLS on the internal gRPC interfaces (`[grpc.tls]`): off unless set.
    pub tls: GrpcTlsConfig,
    /// This replica's address exactly as `remote.limiter` or
    /// `remote.billing` lists it (a StatefulSet pod's DNS name), which names
    /// its heartbeats. Empty: the entry that is `http://<listen>`.
    pub advertise: String,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseConfig {
    /// `sqlite://path/to/file.db` or `postgres://user@host:port/db`.
    pub url: String,
    pub max_connections: u32,
    /// Whether `rialto serve` applies pending migrations as it starts (the
    /// embedded default); when false it refuses a schema behind the binary,
    /// and `rialto migrate` (a Kubernetes Job) applies them.
    pub migrate_on_start: bool,
    /// The URL `rialto migrate` connects with, when the user that may
    /// change the schema is not the one that serves; `url` when unset.
    pub migrate_url: Option<String>,
    /// A file holding `url` (a mounted Secret), re-read when it changes: new
    /// connections use the new URL (a rotated password).
    pub url_file: Option<PathBuf>,
    /// A file holding `migrate_url`.
    pub migrate_url_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct OperatorConfig {
    /// Bearer token of the operator API (`/admin/v1`); the API is off when unset.
    #[serde(skip_serializing)]
    pub token: Option<SecretString>,
    /// A file holding the token (a mounted Secret), read at start and again
    /// whenever it changes; instead of `token`.
    pub token_file: Option<PathBuf>,
}

/// TLS between Rialto's processes (`[grpc.tls]`), with certificates from
/// files (a mounted Secret, such as cert-manager's `tls.crt`, `tls.key`,
/// `ca.crt`). A process that serves gRPC with `cert_file` and `key_file`
/// serves TLS only; a process calls an `https://` entry of `[remote]` over
/// TLS, trusting `ca_file`. The shared `grpc.token` still authenticates
/// the caller.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcTlsConfig {
    /// This process's certificate chain (PEM), for its gRPC server.
    pub cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    pub key_file: Option<PathBuf>,
    /// The certificate authority (PEM) that signed the servers' certificates,
    /// for `https://` entries of `[remote]`.
    pub ca_file: Option<PathBuf>,
}

/// Where secrets may be written (`[secrets]`).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecretsConfig {
    /// Refuse a secret written in the configuration file itself
    /// (`operator.token`, `grpc.token`, a password in `database.url`, a
    /// backend's `api_key`): where the file is a ConfigMap every pod and
    /// reader of the namespace sees, secrets come from `*_file` or the
    /// environment.
    pub refuse_inline: bool,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteConfig {
    pub auth: String,
    /// One limiter address, or several separated by commas: each principal
    /// is owned by one of them, chosen by a consistent hash.
    pub limiter: String,
    pub billing: String,
    pub router: String,
    /// How often a name in `auth` or `router` (a headless Service) is
    /// resolved again: each call goes to one of the addresses it lists
    /// that accept connections, so new pods get traffic within this time.
    pub resolve_every_ms: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Seconds to wait for a backend to accept a connection.
    pub connect_timeout_secs: u64,
    /// Seconds a whole non-streamed upstream call may take.
    pub request_timeout_secs: u64,
    /// The service's system prompt, put before the caller's system prompts
    /// unless the request turns it off; a model's `system_prompt` replaces
    /// it. Empty: none.
    pub system_prompt: String,
    /// Times a request is sent again after a failed attempt (a connection
    /// error, a timeout before the answer's headers, 429, 500, 502, 503,
    /// 504), each time to the next backend when the model has another.
    /// A backend refusing its own credentials or address (401, 403, 404,
    /// 408) is skipped without using a retry. Never after the first byte of
    /// a stream. 0: no retries.
    pub max_retries: u32,
    /// Exponential backoff before a retry, with full jitter: the n-th retry
    /// waits a random time up to `min(cap, base * 2^(n-1))` milliseconds.
    pub retry_backoff_base_ms: u64,
    /// The longest wait before a retry, in milliseconds.
    pub retry_backoff_cap_ms: u64,
    /// Consecutive failures (requests or health checks) that open a
    /// backend's circuit: it then gets no requests until it recovers.
    pub breaker_failure_threshold: u32,
    /// Milliseconds an open circuit waits before letting one trial request
    /// through (half-open); a failed trial doubles the wait, up to
    /// `breaker_max_cooldown_ms`.
    pub breaker_cooldown_ms: u64,
    /// The longest wait of an open circuit, in milliseconds.
    pub breaker_max_cooldown_ms: u64,
    /// Milliseconds between health checks of each `openai` backend: a GET
    /// of `health_check_path` under its `url`. A failed check counts as a
    /// failure; a passing check of an open circuit half-opens it at once.
    /// 0: no health checks.
    pub health_check_interval_ms: u64,
    /// Path of the health check, after the backend's `url` (`/models` under
    /// `http://host/v1` is `http://host/v1/models`). Any answer below 500
    /// passes.
    pub health_check_path: String,
    /// Milliseconds a health check may take before it counts as failed.
    pub health_check_timeout_ms: u64,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `text` or `json`.
    pub format: String,
    /// A `tracing` filter such as `info` or `rialto=debug,info`; `RUST_LOG` wins.
    pub level: String,
}

/// Rate limits (`[limits]`). Every number is a limit per window
/// (`window_secs`, a minute by default) unless its name says otherwise.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Length of the rolling window of `rpm` and `tpm`, in seconds.
    pub window_secs: u64,
    /// Completion tokens assumed at admission when a request sets no
    /// `max_tokens` and its model no `max_completion_tokens`.
    pub default_completion_tokens: u64,
    /// Seconds an idle principal's actor lives after its windows empty.
    pub idle_secs: u64,
    /// Per-key limits: account tier (`standard`, `partner`, ...) -> limit
    /// class -> limit. A text model's class is its tier (`XS`, `S`, `M`,
    /// `L`); another model's is its type (`image`, `audio`, `embedding`,
    /// `video`); `endpoint` covers the non-inference endpoints. A class
    /// missing from the table is not limited.
    pub tiers: BTreeMap<String, BTreeMap<String, Limit>>,
    /// Replacements of the tier table for one account's keys or one key.
    pub overrides: Vec<LimitOverride>,
    /// Account-wide (`user`) windows shared by all keys of an account.
    pub user: Vec<UserLimit>,
    pub abuse: AbuseConfig,
}

/// Requests per window, and optionally tokens per window and requests per
/// UTC day.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    pub rpm: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpd: Option<u64>,
}

/// `[[limits.overrides]]`: for the keys of `account`, or for the one key
/// `key`, and for `model` or every model, the given fields replace the
/// tier's.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LimitOverride {
    #[serde(default)]
    pub account: Option<String>,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub rpm: Option<u64>,
    #[serde(default)]
    pub tpm: Option<u64>,
    #[serde(default)]
    pub rpd: Option<u64>,
}

/// `[[limits.user]]`: one window for all keys of `account` together, on
/// `model` or on each model.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UserLimit {
    pub account: String,
    #[serde(default)]
    pub model: Option<String>,
    pub rpm: u64,
    #[serde(default)]
    pub tpm: Option<u64>,
    #[serde(default)]
    pub rpd: Option<u64>,
}

impl UserLimit {
    pub fn limit(&self) -> Limit {
        Limit {
            rpm: self.rpm,
            tpm: self.tpm,
            rpd: self.rpd,
        }
    }
}

/// Abuse protection: more than `threshold` failed requests within
/// `window_secs` block the principal (or client address) for `block_secs`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct AbuseConfig {
    pub threshold: u32,
    pub window_secs: u64,
    pub block_secs: u64,
}

/// The event bus (`[bus]`): in-process when `url` is empty, else NATS.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct BusConfig {
    /// `nats://host:port`; empty for the in-process bus of one process.
    pub url: String,
    /// First token of every subject; the brand when empty.
    pub subject_prefix: String,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub id: String,
    /// Display name (`x-<brand>-model-name`); the id when absent.
    #[serde(default)]
    pub name: Option<String>,
    /// One of [`MODEL_TYPES`]: `text` (chat), `embedding`, `image`
    /// (generation), `tts` (speech), `asr` (transcription), ...
    #[serde(default = "default_model_type", rename = "type")]
    pub model_type: String,
    /// Rate-limit tier: `XS`, `S`, `M` or `L`.
    #[serde(default = "default_tier")]
    pub tier: String,
    #[serde(default)]
    pub input_usd_per_mtok: f64,
    #[serde(default)]
    pub output_usd_per_mtok: f64,
    #[serde(default)]
    pub cached_input_usd_per_mtok: Option<f64>,
    #[serde(default)]
    pub cache_write_usd_per_mtok: Option<f64>,
    #[serde(default)]
    pub context_length: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub description: Option<String>,
    /// ISO 8601 date from which the model is deprecated.
    #[serde(default)]
    pub deprecation_date: Option<String>,
    #[serde(default)]
    pub deprecation_warning: Option<String>,
    /// Requests per window for all callers together, protecting the backends.
    #[serde(default)]
    pub global_rpm: Option<u64>,
    /// Tokens per window for all callers together.
    #[serde(default)]
    pub global_tpm: Option<u64>,
    /// Roles the model plays in the catalog (`default`, `fastest`,
    /// `default_code`, ...): `/models/traits` maps each to its first model of
    /// a type, and a trait may be sent as `model`.
    #[serde(default)]
    pub traits: Vec<String>,
    /// Other names clients may send as `model` (`gpt-4o`):
    /// `/models/compatibility_mapping`.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// What the model accepts beyond text: `vision` (`image_url` parts),
    /// `audio` (`input_audio`), `video` (`video_url`), `files` (`file`),
    /// `caching` (`cache_control` is passed on; otherwise it is dropped).
    /// Published in `/models` only: `tools`, `logprobs`, `reasoning`,
    /// `response_schema`, `web_search`.
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// This model's system prompt, instead of `router.system_prompt`
    /// (empty: none for this model).
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// How `disable_thinking` reaches the backend: `chat_template_kwargs`
    /// (vLLM, SGLang: `enable_thinking = false`; the default) or `none`
    /// (the answer is only stripped).
    #[serde(default)]
    pub thinking_control: Option<String>,
    /// The model's tokenizer, a Hugging Face `tokenizer.json`: a request's
    /// hold counts its text with it, where the four-characters-a-token
    /// guess would count less (code, punctuation, other scripts).
    #[serde(default)]
    pub tokenizer: Option<String>,
    /// Members merged into the upstream body when a request sets
    /// `enable_x_search` (the model's upstream searches the web and social
    /// media itself, e.g. `{ search_parameters = { mode = "on" } }`); a
    /// request setting it on a model without this is refused.
    #[serde(default)]
    pub native_search: Option<serde_json::Map<String, serde_json::Value>>,
    /// Price of one request with `enable_x_search` on (USD), on top of its
    /// tokens.
    #[serde(default)]
    pub native_search_usd: f64,
    /// `image`: price of one image (USD), where no resolution tier prices it.
    #[serde(default)]
    pub usd_per_image: f64,
    /// `image`: price of one image per resolution tier (`"1K" = 0.18`);
    /// a request's `resolution` picks one (the first tier by default), and
    /// the model then accepts only these.
    #[serde(default)]
    pub usd_per_image_resolution: BTreeMap<String, f64>,
    /// `image`: longest prompt, in characters (`promptCharacterLimit`).
    #[serde(default)]
    pub prompt_character_limit: Option<u64>,
    /// `tts`: price of a thousand characters of input (USD).
    #[serde(default)]
    pub usd_per_thousand_characters: f64,
    /// `tts`: the voices it speaks (the first is the default); any voice
    /// when empty.
    #[serde(default)]
    pub voices: Vec<String>,
    /// `tts`: the `response_format`s its backends produce (the first is
    /// the default); all of OpenAI's when empty.
    #[serde(default)]
    pub audio_formats: Vec<String>,
    /// `asr`: price of one second of transcribed audio (USD).
    #[serde(default)]
    pub usd_per_audio_second: f64,
    /// `private` (the default: the operator's own backends keep nothing) or
    /// `anonymized` (a third party sees the requests, without who sent
    /// them); published in `/models`. A key whose `modelPrivacy` is not ALL
    /// is refused on an anonymized model.
    #[serde(default = "default_privacy")]
    pub privacy: String,
    /// `upscale`: price of one upscale by tier, `2x` (a scale up to 2) and
    /// `4x` (above); a tier left out costs nothing.
    #[serde(default)]
    pub usd_per_upscale: BTreeMap<String, f64>,
    /// `video`: price of one second of generated video (USD).
    #[serde(default)]
    pub usd_per_video_second: f64,
    /// When the model was added (Unix seconds), `created` in `/models`;
    /// the build's time when unset.
    #[serde(default)]
    pub created: Option<i64>,
    /// `embedding`: the length of its vectors (`embeddingDimensions`).
    #[serde(default)]
    pub embedding_dimensions: Option<u64>,
    /// `embedding`: the most tokens an input may have (`maxInputTokens`).
    #[serde(default)]
    pub max_input_tokens: Option<u64>,
    /// `embedding`: whether its backends honour a request's `dimensions`
    /// (`supportsCustomDimensions`).
    #[serde(default)]
    pub custom_dimensions: bool,
    /// `video`: the durations it makes, in seconds (the first is the
    /// default); 5 and 10 when empty.
    #[serde(default)]
    pub video_durations: Vec<u32>,
    /// `video`: its resolutions (`720p`, the first is the default); 720p
    /// when empty.
    #[serde(default)]
    pub video_resolutions: Vec<String>,
    /// `video`: its aspect ratios (`16:9`, the first is the default); 16:9,
    /// 9:16 and 1:1 when empty.
    #[serde(default)]
    pub aspect_ratios: Vec<String>,
    #[serde(default)]
    pub backends: Vec<BackendConfig>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// `openai` (any OpenAI-compatible server at `url`) or `local` (a model
    /// file at `path`, run in this process).
    pub kind: String,
    /// `openai`: base URL including the version path, e.g. `http://127.0.0.1:8000/v1`.
    #[serde(default)]
    pub url: String,
    /// `local`: the model file (a GGUF for text, a directory with
    /// `model.safetensors` and `tokenizer.json` for embeddings), relative to
    /// the working directory.
    #[serde(default)]
    pub path: Option<String>,
    /// Model name to send upstream; the catalog id when absent.
    #[serde(default)]
    pub model: Option<String>,
    /// Name reported in `x-<brand>-model-router`; `<model>/<index>` when absent.
    #[serde(default)]
    pub name: Option<String>,
    /// Bearer token for the upstream, if it needs one.
    #[serde(default, skip_serializing)]
    pub api_key: Option<SecretString>,
    /// Environment variable holding the bearer token (read at start), so
    /// the key stays out of the config file.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// A file holding the bearer token (a mounted Secret), re-read when it
    /// changes, so a rotated key needs no restart.
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// Extra headers sent with every request to this backend.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// Share of the model's traffic relative to its other backends.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Seconds a whole non-streamed call may take; `router.request_timeout_secs`
    /// when absent.
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    /// `local`: CPU threads for inference; all cores when absent.
    #[serde(default)]
    pub threads: Option<usize>,
    /// `local`: requests waiting for the model beyond the one it runs; a
    /// request finding the queue full is answered 503.
    #[serde(default)]
    pub max_queue: Option<usize>,
    /// `local`: context window in tokens; the model's own when absent.
    #[serde(default)]
    pub context_size: Option<u32>,
}

/// The height of a video resolution (`720p` -> 720).
pub fn video_height(resolution: &str) -> Option<u32> {
    let height: u32 = resolution.strip_suffix('p')?.parse().ok()?;
    (16..=4320).contains(&height).then_some(height)
}

/// An aspect ratio's two sides (`16:9` -> (16, 9)).
pub fn aspect_ratio(ratio: &str) -> Option<(u32, u32)> {
    let (width, height) = ratio.split_once(':')?;
    let (width, height): (u32, u32) = (width.parse().ok()?, height.parse().ok()?);
    ((1..=64).contains(&width) && (1..=64).contains(&height)).then_some((width, height))
}

fn default_privacy() -> String {
    "private".to_owned()
}

fn default_weight() -> u32 {
    1
}

fn default_model_type() -> String {
    "text".to_owned()
}

fn default_tier() -> String {
    "XS".to_owned()
}

/// Top-level keys of [`Config`], the only ones `RIALTO_*` variables may set.
const TOP_LEVEL_KEYS: [&str; 24] = [
    "secrets",
    "console",
    "web_search",
    "web_scraping",
    "text_parser",
    "brand",
    "services",
    "gateway",
    "grpc",
    "database",
    "operator",
    "remote",
    "router",
    "log",
    "limits",
    "billing",
    "bus",
    "wallet",
    "x402",
    "models",
    "characters",
    "metrics",
    "shutdown",
    "failover",
];

/// The services a process can run, in start order.
pub const SERVICES: [&str; 5] = ["auth", "limiter", "billing", "router", "gateway"];

impl Default for Config {
    fn default() -> Self {
        Self {
            brand: "rialto".to_owned(),
            services: SERVICES.iter().map(|s| (*s).to_owned()).collect(),
            gateway: GatewayConfig::default(),
            grpc: GrpcConfig::default(),
            database: DatabaseConfig::default(),
            operator: OperatorConfig::default(),
            secrets: SecretsConfig::default(),
            remote: RemoteConfig::default(),
            router: RouterConfig::default(),
            log: LogConfig::default(),
            limits: LimitsConfig::default(),
            billing: BillingConfig::default(),
            bus: BusConfig::default(),
            wallet: WalletConfig::default(),
            x402: X402Config::default(),
            models: built_in_models(),
            characters: Vec::new(),
            metrics: MetricsConfig::default(),
            shutdown: ShutdownConfig::default(),
            failover: FailoverConfig::default(),
            web_search: WebSearchConfig::default(),
            web_scraping: WebScrapingConfig::default(),
            text_parser: TextParserConfig::default(),
            media: MediaConfig::default(),
            crypto_rpc: CryptoRpcConfig::default(),
            console: ConsoleConfig::default(),
            file: None,
        }
    }
}

/// The embedded default catalog (`built_in_models.toml`).
pub fn built_in_models() -> Vec<ModelConfig> {
    #[derive(Deserialize)]
    struct Catalog {
        models: Vec<ModelConfig>,
    }
    Figment::from(Toml::string(include_str!("built_in_models.toml")))
        .extract::<Catalog>()
        .map(|catalog| catalog.models)
        // The file is ours and a test parses it: this cannot fail at run time.
        .unwrap_or_default()
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 20 * 1024 * 1024,
            host_name: String::new(),
            workers: 0,
            client_address_header: String::new(),
            file_urls_allow_private: false,
            max_connections: 25_000,
            client_request_timeout_ms: 5_000,
            listen_backlog: 4_096,
            route_ahead_ms: 2_000,
        }
    }
}

impl Default for GrpcConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            token: None,
            token_file: None,
            tls: GrpcTlsConfig::default(),
            advertise: String::new(),
        }
    }
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: "sqlite://data/rialto.db".to_owned(),
            max_connections: 16,
            migrate_on_start: true,
            migrate_url: None,
            url_file: None,
            migrate_url_file: None,
        }
    }
}

impl Default for RemoteConfig {
    fn default() -> Self {
        let local = "http://127.0.0.1:9090".to_owned();
        Self {
            resolve_every_ms: 5_000,
            auth: local.clone(),
            limiter: local.clone(),
            billing: local.clone(),
            router: local,
        }
    }
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            connect_timeout_secs: 5,
            request_timeout_secs: 600,
            system_prompt: String::new(),
            max_retries: 2,
            retry_backoff_base_ms: 25,
            retry_backoff_cap_ms: 1_000,
            breaker_failure_threshold: 5,
            breaker_cooldown_ms: 5_000,
            breaker_max_cooldown_ms: 60_000,
            health_check_interval_ms: 5_000,
            health_check_path: "/models".to_owned(),
            health_check_timeout_ms: 2_000,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: "text".to_owned(),
            level: "info".to_owned(),
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        let limit = |rpm, tpm| Limit {
            rpm,
            tpm,
            rpd: None,
        };
        let table = |rows: &[(&str, u64, Option<u64>)]| {
            rows.iter()
                .map(|(class, rpm, tpm)| ((*class).to_owned(), limit(*rpm, *tpm)))
                .collect::<BTreeMap<_, _>>()
        };
        // The spec's defaults ("Limits"); `endpoint` is ours.
        let standard = table(&[
            ("XS", 500, Some(1_000_000)),
            ("S", 75, Some(750_000)),
            ("M", 50, Some(750_000)),
            ("L", 20, Some(500_000)),
            ("image", 20, None),
            ("audio", 60, None),
            ("embedding", 500, None),
            ("video", 40, None),
            ("video_retrieve", 120, None),
            ("endpoint", 500, None),
        ]);
        let partner = table(&[
            ("XS", 500, Some(2_000_000)),
            ("S", 150, Some(1_500_000)),
            ("M", 100, Some(1_500_000)),
            ("L", 60, Some(1_000_000)),
            ("image", 60, None),
            ("audio", 120, None),
            ("embedding", 500, None),
            ("video", 40, None),
            ("video_retrieve", 120, None),
            ("endpoint", 500, None),
        ]);
        Self {
            window_secs: 60,
            default_completion_tokens: 1024,
            idle_secs: 120,
            tiers: BTreeMap::from([
                ("standard".to_owned(), standard),
                ("partner".to_owned(), partner),
            ]),
            overrides: Vec::new(),
            user: Vec::new(),
            abuse: AbuseConfig::default(),
        }
    }
}

impl Default for AbuseConfig {
    fn default() -> Self {
        Self {
            threshold: 20,
            window_secs: 30,
            block_secs: 30,
        }
    }
}

/// The model types a catalog may hold (`/models?type=` takes these).
pub const MODEL_TYPES: &[&str] = &[
    "text",
    "embedding",
    "image",
    "upscale",
    "inpaint",
    "tts",
    "asr",
    "video",
    "music",
];

/// OpenAI's speech `response_format`s: a `tts` model's formats when it
/// lists none.
pub const AUDIO_FORMATS: &[&str] = &["mp3", "opus", "aac", "flac", "wav", "pcm"];

impl ModelConfig {
    /// The limit class of this model in the tier tables: a text model's
    /// tier; the spec's `image` class for image generation, upscaling and
    /// editing, `audio` for speech and transcription; else its type.
    pub fn limit_class(&self) -> &str {
        match self.model_type.as_str() {
            "text" => &self.tier,
            "image" | "upscale" | "inpaint" => "image",
            "tts" | "asr" => "audio",
            other => other,
        }
    }

    /// A `video` model's durations in seconds, the default first.
    pub fn video_durations(&self) -> Vec<u32> {
        if self.video_durations.is_empty() {
            vec![5, 10]
        } else {
            self.video_durations.clone()
        }
    }

    /// A `video` model's resolutions, the default first.
    pub fn video_resolutions(&self) -> Vec<&str> {
        if self.video_resolutions.is_empty() {
            vec!["720p"]
        } else {
            self.video_resolutions.iter().map(String::as_str).collect()
        }
    }

    /// A `video` model's aspect ratios, the default first.
    pub fn aspect_ratios(&self) -> Vec<&str> {
        if self.aspect_ratios.is_empty() {
            vec!["16:9", "9:16", "1:1"]
        } else {
            self.aspect_ratios.iter().map(String::as_str).collect()
        }
    }

    /// A `tts` model's formats, the default first.
    pub fn audio_formats(&self) -> Vec<&str> {
        if self.audio_formats.is_empty() {
            AUDIO_FORMATS.to_vec()
        } else {
            self.audio_formats.iter().map(String::as_str).collect()
        }
    }
}

impl Config {
    /// `[web_search]`, `[web_scraping]`, `[text_parser]` and the models'
    /// native search.
    fn validate_crypto_rpc(&self) -> Result<(), ConfigError> {
        let invalid = |msg: String| Err(ConfigError::Invalid(msg));
        let rpc = &self.crypto_rpc;
        if !(rpc.usd_per_credit.is_finite() && rpc.usd_per_credit >= 0.0) {
            return invalid("crypto_rpc.usd_per_credit must be a price of 0 or more".into());
        }
        if !(1..=1000).contains(&rpc.max_batch) || rpc.timeout_ms == 0 {
            return invalid(
                "crypto_rpc.max_batch must be 1 to 1000 and crypto_rpc.timeout_ms at least 1"
                    .into(),
            );
        }
        if let Some((method, tier)) = rpc.methods.iter().find(|(_, tier)| **tier == 0) {
            return invalid(format!(
                "crypto_rpc.methods.{method} = {tier}: a tier is a multiple of at least 1"
            ));
        }
        let mut slugs = std::collections::HashSet::new();
        for network in &rpc.networks {
            let slug_ok = !network.slug.is_empty()
                && network
                    .slug
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if !slug_ok || !slugs.insert(network.slug.as_str()) {
                return invalid(format!(
                    "crypto_rpc.networks slug {:?} must be unique lowercase letters, digits and -",
                    network.slug
                ));
            }
            let urls_ok = !network.urls.is_empty()
                && network
                    .urls
                    .iter()
                    .all(|u| u.starts_with("http://") || u.starts_with("https://"));
            if !urls_ok || network.base_credits == 0 {
                return invalid(format!(
                    "crypto_rpc network {:?} needs http(s) urls and base_credits of at least 1",
                    network.slug
                ));
            }
        }
        Ok(())
    }

    fn validate_augment(&self) -> Result<(), ConfigError> {
        let invalid = |msg: String| Err(ConfigError::Invalid(msg));
        let search = &self.web_search;
        match search.provider.as_str() {
            "" | "brave" => {}
            "searxng"
                if search.url.starts_with("http://") || search.url.starts_with("https://") => {}
            "searxng" => {
                return invalid(format!(
                    "web_search.url {:?} must be the SearXNG instance's http(s) base URL",
                    search.url
                ));
            }
            other => {
                return invalid(format!(
                    "web_search.provider {other:?} must be \"searxng\", \"brave\" or empty"
                ));
            }
        }
        if search.provider == "brave"
            && search.api_key_env.as_deref().unwrap_or("").is_empty()
            && search.api_key_file.is_none()
        {
            return invalid(
                "web_search.provider \"brave\" needs web_search.api_key_file (a file holding \
                 the subscription token) or web_search.api_key_env (a variable holding it)"
                    .into(),
            );
        }
        if !(1..=20).contains(&search.max_results) || search.timeout_ms == 0 {
            return invalid(
                "web_search.max_results must be 1 to 20 and web_search.timeout_ms at least 1"
                    .into(),
            );
        }
        if !matches!(search.query.as_str(), "last_user_message" | "model") {
            return invalid(format!(
                "web_search.query {:?} must be \"last_user_message\" or \"model\"",
                search.query
            ));
        }
        let scraping = &self.web_scraping;
        if scraping.max_chars_per_page == 0 {
            return invalid("web_scraping.max_chars_per_page must be at least 1".into());
        }
        let prices = [
            ("web_search.usd_per_search", search.usd_per_search),
            (
                "web_scraping.usd_per_scraped_url",
                scraping.usd_per_scraped_url,
            ),
            ("text_parser.usd_per_file", self.text_parser.usd_per_file),
        ];
        let models = self
            .models
            .iter()
            .map(|m| ("native_search_usd", m.native_search_usd));
        for (name, price) in prices.into_iter().chain(models) {
            if !price.is_finite() || price < 0.0 {
                return invalid(format!("{name} must be a price of at least 0"));
            }
        }
        Ok(())
    }
}

/// A configuration that cannot be loaded or makes no sense.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Load(#[from] Box<figment::Error>),
    #[error("configuration file {0} does not exist")]
    MissingFile(String),
    #[error("configuration: {0}")]
    Invalid(String),
}

impl Config {
    /// Where the embedded default keeps the operator token it made itself:
    /// beside the SQLite database (`data/operator-token`). `rialto serve`
    /// writes it when the gateway runs with no `operator.token` nor
    /// `operator.token_file`, and `rialto admin` reads it, so a laptop needs
    /// no token set up by hand. `None` on PostgreSQL, where an operator
    /// configures the token.
    pub fn embedded_operator_token_path(&self) -> Option<PathBuf> {
        let path = self.database.url.strip_prefix("sqlite://")?;
        let path = path.split('?').next().unwrap_or(path);
        if path.is_empty() || path == ":memory:" {
            return None;
        }
        let folder = Path::new(path).parent().unwrap_or(Path::new(""));
        Some(folder.join("operator-token"))
    }

    /// Defaults, then `file` (or the file named by `RIALTO_CONFIG`), then
    /// `RIALTO_<SECTION>__<KEY>` variables.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        let env_file = std::env::var_os(CONFIG_ENV).map(std::path::PathBuf::from);
        let file = file.map(Path::to_path_buf).or(env_file);
        if let Some(path) = &file {
            if !path.exists() {
                return Err(ConfigError::MissingFile(path.display().to_string()));
            }
            figment = figment.merge(Toml::file_exact(path));
        }
        // Only variables naming a known top-level key are configuration:
        // others with the prefix (Kubernetes service links such as
        // RIALTO_AUTH_SERVICE_HOST) are not ours. A typo inside a known
        // section is still refused. (`filter` sees the name without prefix.)
        figment = figment.merge(
            Env::prefixed("RIALTO_")
                .filter(|key| {
                    let section = key.as_str().split("__").next().unwrap_or_default();
                    TOP_LEVEL_KEYS
                        .iter()
                        .any(|k| section.eq_ignore_ascii_case(k))
                })
                .split("__"),
        );
        let mut config = Self::from_figment(figment.clone())?;
        config.refuse_inline_secrets(&figment)?;
        config.read_secret_files()?;
        config.file = file;
        Ok(config)
    }

    /// With `secrets.refuse_inline`, a secret whose value the configuration
    /// file itself holds is an error naming the key and its `_file`.
    fn refuse_inline_secrets(&self, figment: &Figment) -> Result<(), ConfigError> {
        if !self.secrets.refuse_inline {
            return Ok(());
        }
        let from_file = |key: &str| {
            figment
                .find_metadata(key)
                .is_some_and(|meta| matches!(meta.source, Some(figment::Source::File(_))))
        };
        let refuse = |key: &str, instead: &str| {
            Err(ConfigError::Invalid(format!(
                "{key} is written in the configuration file, and secrets.refuse_inline is set: \
                 put the secret in a file (a mounted Secret) and name it with {instead}, or set \
                 it in the environment"
            )))
        };
        if self.operator.token.is_some() && from_file("operator.token") {
            return refuse("operator.token", "operator.token_file");
        }
        if self.grpc.token.is_some() && from_file("grpc.token") {
            return refuse("grpc.token", "grpc.token_file");
        }
        if self.console.session_key.is_some() && from_file("console.session_key") {
            return refuse("console.session_key", "console.session_key_file");
        }
        if url_has_password(&self.database.url) && from_file("database.url") {
            return refuse("database.url (its password)", "database.url_file");
        }
        if self
            .database
            .migrate_url
            .as_deref()
            .is_some_and(url_has_password)
            && from_file("database.migrate_url")
        {
            return refuse(
                "database.migrate_url (its password)",
                "database.migrate_url_file",
            );
        }
        // Only the file can hold a backend (the environment sets no arrays).
        for model in &self.models {
            for (index, backend) in model.backends.iter().enumerate() {
                if backend.api_key.is_some() {
                    return refuse(
                        &format!("models {:?}: backend {index}: api_key", model.id),
                        "api_key_file (or api_key_env)",
                    );
                }
            }
        }
        Ok(())
    }

    /// Puts the content of each `*_file` in its key: the values in force at
    /// start (watchers re-read the files later, see [`crate::secrets`]).
    fn read_secret_files(&mut self) -> Result<(), ConfigError> {
        fn read(key: &str, path: &Path) -> Result<SecretString, ConfigError> {
            crate::secrets::read_file(path).map_err(|error| {
                ConfigError::Invalid(format!("{key} = {:?}: {error}", path.display()))
            })
        }
        fn both(key: &str) -> ConfigError {
            ConfigError::Invalid(format!("set {key} or {key}_file, not both"))
        }
        if let Some(path) = &self.operator.token_file {
            if self.operator.token.is_some() {
                return Err(both("operator.token"));
            }
            self.operator.token = Some(read("operator.token_file", path)?);
        }
        if let Some(path) = &self.grpc.token_file {
            if self.grpc.token.is_some() {
                return Err(both("grpc.token"));
            }
            self.grpc.token = Some(read("grpc.token_file", path)?);
        }
        if let Some(path) = &self.database.url_file {
            self.database.url = read("database.url_file", path)?.expose_secret().to_owned();
        }
        if let Some(path) = &self.database.migrate_url_file {
            if self.database.migrate_url.is_some() {
                return Err(both("database.migrate_url"));
            }
            // Optional: a Secret without the key leaves the file out, and
            // `rialto migrate` uses `url`.
            match crate::secrets::read_file(path) {
                Ok(url) => self.database.migrate_url = Some(url.expose_secret().to_owned()),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(_) => {
                    read("database.migrate_url_file", path)?;
                }
            }
        }
        if let Some(path) = &self.web_search.api_key_file {
            self.web_search.api_key = Some(read("web_search.api_key_file", path)?);
        }
        if let Some(path) = &self.console.session_key_file {
            if self.console.session_key.is_some() {
                return Err(both("console.session_key"));
            }
            self.console.session_key = Some(read("console.session_key_file", path)?);
        }
        for model in &mut self.models {
            for (index, backend) in model.backends.iter_mut().enumerate() {
                let Some(path) = &backend.api_key_file else {
                    continue;
                };
                if backend.api_key.is_some() || backend.api_key_env.is_some() {
                    return Err(ConfigError::Invalid(format!(
                        "models {:?}: backend {index}: set one of api_key, api_key_env and api_key_file",
                        model.id
                    )));
                }
                let key = format!("models {:?}: backend {index}: api_key_file", model.id);
                backend.api_key = Some(read(&key, path)?);
            }
        }
        Ok(())
    }

    /// Parses a TOML document on top of the defaults (tests, examples).
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Self::from_figment(
            Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(text)),
        )
    }

    fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        let config: Config = figment.extract().map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |msg: String| Err(ConfigError::Invalid(msg));
        if !crate::Brand::is_valid_name(&self.brand) {
            return invalid(format!(
                "brand {:?} must be letters, digits, - or _",
                self.brand
            ));
        }
        for service in &self.services {
            if !SERVICES.contains(&service.as_str()) {
                return invalid(format!(
                    "unknown service {service:?}; expected some of {}",
                    SERVICES.join(",")
                ));
            }
        }
        let limits = &self.limits;
        const DAY_SECS: u64 = 86_400;
        let durations = [
            limits.window_secs,
            limits.idle_secs,
            limits.abuse.window_secs,
            limits.abuse.block_secs,
        ];
        if limits.window_secs == 0
            || limits.abuse.window_secs == 0
            || durations.iter().any(|&d| d > DAY_SECS)
        {
            return invalid(
                "limits.window_secs, idle_secs and abuse.window_secs/block_secs must be at \
                 most 86400 seconds, and window_secs and abuse.window_secs at least 1"
                    .into(),
            );
        }
        if !limits.tiers.contains_key("standard") {
            return invalid("limits.tiers must define the \"standard\" tier".into());
        }
        let zero = |tpm: Option<u64>, rpd: Option<u64>| tpm == Some(0) || rpd == Some(0);
        let zero_in_tiers = limits
            .tiers
            .values()
            .flat_map(|classes| classes.values())
            .any(|l| zero(l.tpm, l.rpd));
        if zero_in_tiers
            || limits.overrides.iter().any(|o| zero(o.tpm, o.rpd))
            || limits.user.iter().any(|u| zero(u.tpm, u.rpd))
            || self.models.iter().any(|m| m.global_tpm == Some(0))
        {
            return invalid(
                "a tpm, rpd or global_tpm of 0 would refuse everything; leave it out for no limit"
                    .into(),
            );
        }
        for o in &limits.overrides {
            if o.account.is_some() == o.key.is_some() {
                return invalid(
                    "each [[limits.overrides]] names exactly one of `account` or `key`".into(),
                );
            }
        }
        for (service, list) in [
            ("limiter", &self.remote.limiter),
            ("billing", &self.remote.billing),
        ] {
            let replicas = list.split(',').filter(|a| !a.trim().is_empty()).count();
            if replicas > crate::membership::MAX_REPLICAS {
                return invalid(format!(
                    "remote.{service} lists {replicas} replicas; at most {} are supported",
                    crate::membership::MAX_REPLICAS
                ));
            }
        }
        let failover = &self.failover;
        if failover.heartbeat_ms == 0
            || failover.dead_after_ms < failover.heartbeat_ms.saturating_mul(3)
            || failover.dead_after_ms > 60_000
            || failover.rejoin_after_ms > 600_000
        {
            return invalid(
                "failover.heartbeat_ms must be at least 1, dead_after_ms at least three \
                 heartbeats and at most 60000, rejoin_after_ms at most 600000"
                    .into(),
            );
        }
        if !(self.bus.url.is_empty() || self.bus.url.starts_with("nats://")) {
            return invalid(format!(
                "bus.url {:?} must be empty (in-process) or nats://host:port",
                crate::db::redacted(&self.bus.url)
            ));
        }
        if self.gateway.max_connections == 0
            || self.gateway.client_request_timeout_ms == 0
            || self.gateway.listen_backlog == 0
        {
            return invalid(
                "gateway.max_connections, gateway.client_request_timeout_ms and \
                 gateway.listen_backlog must be at least 1"
                    .into(),
            );
        }
        if !matches!(
            self.wallet.min_balance_usd.trim().parse::<Decimal>(),
            Ok(usd) if !usd.is_sign_negative()
        ) {
            return invalid(format!(
                "wallet.min_balance_usd {:?} must be a USD amount such as \"0.01\"",
                self.wallet.min_balance_usd
            ));
        }
        self.validate_augment()?;
        self.validate_crypto_rpc()?;
        if self.console.session_ttl_secs == 0 || self.console.session_ttl_secs > 30 * 86_400 {
            return invalid("console.session_ttl_secs must be from 1 to 2592000 (30 days)".into());
        }
        if let Some(key) = &self.console.session_key
            && key.expose_secret().len() < 32
        {
            return invalid(
                "console.session_key must be at least 32 characters (e.g. openssl rand -hex 32)"
                    .into(),
            );
        }
        let media = &self.media;
        if media.job_workers == 0 || media.job_lease_secs < 2 || media.job_poll_ms < 10 {
            return invalid(
                "media: job_workers must be at least 1, job_lease_secs at least 2 and \
                 job_poll_ms at least 10"
                    .into(),
            );
        }
        let billing = &self.billing;
        if billing.stream_lease_secs == 0
            || billing.checkpoint_ms.saturating_mul(2)
                >= billing.stream_lease_secs.saturating_mul(1000)
        {
            // A stream waits at most half its lease for a slow client, and
            // checkpoints between: both together must fit in the lease.
            return invalid(format!(
                "billing.checkpoint_ms ({}) must be under half of billing.stream_lease_secs ({} s)",
                billing.checkpoint_ms, billing.stream_lease_secs
            ));
        }
        if self
            .grpc
            .token
            .as_ref()
            .is_some_and(|t| t.expose_secret().is_empty())
        {
            // An empty token would match a call that sends none.
            return invalid(
                "grpc.token must not be empty: leave it out on loopback, or set a secret".into(),
            );
        }
        let router = &self.router;
        if router.breaker_failure_threshold == 0
            || router.retry_backoff_cap_ms < router.retry_backoff_base_ms
            || router.breaker_max_cooldown_ms < router.breaker_cooldown_ms
            || !router.health_check_path.starts_with('/')
        {
            return invalid(
                "router: breaker_failure_threshold must be at least 1, each cap (retry_backoff_cap_ms, \
                 breaker_max_cooldown_ms) at least its base, and health_check_path must start with /"
                    .into(),
            );
        }
        let mut seen = HashSet::new();
        for model in &self.models {
            if model.global_tpm.is_some() && model.global_rpm.is_none() {
                return invalid(format!(
                    "model {}: global_tpm needs a global_rpm (its requests per window)",
                    model.id
                ));
            }
            if model.id.is_empty() || model.id.contains(':') {
                return invalid(format!(
                    "model id {:?} must be non-empty without ':'",
                    model.id
                ));
            }
            if !seen.insert(model.id.as_str()) {
                return invalid(format!("model {} is declared twice", model.id));
            }
            if !MODEL_TYPES.contains(&model.model_type.as_str()) {
                return invalid(format!(
                    "model {}: type {:?} is not one of {}",
                    model.id,
                    model.model_type,
                    MODEL_TYPES.join(", ")
                ));
            }
            if let Some(bad) = model
                .video_resolutions
                .iter()
                .find(|r| video_height(r).is_none())
            {
                return invalid(format!(
                    "model {}: video resolution {bad:?} is not <height>p (480p, 720p, 1080p)",
                    model.id
                ));
            }
            if let Some(bad) = model
                .aspect_ratios
                .iter()
                .find(|r| aspect_ratio(r).is_none())
            {
                return invalid(format!(
                    "model {}: aspect ratio {bad:?} is not <width>:<height> (16:9)",
                    model.id
                ));
            }
            if !["private", "anonymized"].contains(&model.privacy.as_str()) {
                return invalid(format!(
                    "model {}: privacy {:?} is not private or anonymized",
                    model.id, model.privacy
                ));
            }
            if let Some(tier) = model
                .usd_per_upscale
                .keys()
                .find(|tier| !["2x", "4x"].contains(&tier.as_str()))
            {
                return invalid(format!(
                    "model {}: upscale tier {tier:?} is not 2x or 4x",
                    model.id
                ));
            }
            if model.video_durations.iter().any(|&d| d == 0 || d > 600) {
                return invalid(format!(
                    "model {}: video durations are 1 to 600 seconds",
                    model.id
                ));
            }
            if let Some(format) = model
                .audio_formats
                .iter()
                .find(|f| !AUDIO_FORMATS.contains(&f.as_str()))
            {
                return invalid(format!(
                    "model {}: audio format {format:?} is not one of {}",
                    model.id,
                    AUDIO_FORMATS.join(", ")
                ));
            }
            for price in [
                model.input_usd_per_mtok,
                model.output_usd_per_mtok,
                model.usd_per_image,
                model.usd_per_thousand_characters,
                model.usd_per_audio_second,
                model.usd_per_video_second,
            ]
            .into_iter()
            .chain(model.cached_input_usd_per_mtok)
            .chain(model.cache_write_usd_per_mtok)
            .chain(model.usd_per_image_resolution.values().copied())
            .chain(model.usd_per_upscale.values().copied())
            {
                if !price.is_finite() || price < 0.0 {
                    return invalid(format!(
                        "model {} has a negative or invalid price",
                        model.id
                    ));
                }
            }
            for backend in &model.backends {
                match backend.kind.as_str() {
                    "openai" => {
                        if !(backend.url.starts_with("http://")
                            || backend.url.starts_with("https://"))
                        {
                            return invalid(format!(
                                "model {}: backend url {:?} must start with http:// or https://",
                                model.id, backend.url
                            ));
                        }
                    }
                    "local" => {
                        if backend.path.as_deref().is_none_or(str::is_empty) {
                            return invalid(format!(
                                "model {}: a local backend needs `path` (its model file)",
                                model.id
                            ));
                        }
                    }
                    kind => {
                        return invalid(format!(
                            "model {}: backend kind {kind:?} is not supported (use \"openai\" or \"local\")",
                            model.id
                        ));
                    }
                }
                if backend.weight == 0 {
                    return invalid(format!(
                        "model {}: a backend's weight must be at least 1",
                        model.id
                    ));
                }
            }
        }
        Ok(())
    }

    pub fn model(&self, id: &str) -> Option<&ModelConfig> {
        self.models.iter().find(|m| m.id == id)
    }
}

impl ModelConfig {
    pub fn display_name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.id)
    }
}

/// A price from the configuration as an exact decimal.
///
/// Prices are written as TOML floats for convenience; the shortest decimal
/// that round-trips the float (`0.15`, not `0.1499999...`) is the price meant.
pub fn price_decimal(price: f64) -> Decimal {
    price.to_string().parse().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder of its own under the temporary directory, removed by the caller.
    fn scratch(name: &str) -> PathBuf {
        let folder =
            std::env::temp_dir().join(format!("rialto-config-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&folder).unwrap();
        folder
    }

    #[test]
    fn secrets_come_from_their_files() {
        let folder = scratch("files");
        std::fs::write(folder.join("operator"), "op-token\n").unwrap();
        std::fs::write(folder.join("grpc"), "grpc-token").unwrap();
        std::fs::write(folder.join("db"), "postgres://u:pw@db:5432/rialto\n").unwrap();
        std::fs::write(folder.join("key"), "sk-upstream\n").unwrap();
        let file = folder.join("rialto.toml");
        std::fs::write(
            &file,
            format!(
                r#"
[secrets]
refuse_inline = true
[operator]
token_file = "{0}/operator"
[grpc]
token_file = "{0}/grpc"
[database]
url_file = "{0}/db"
migrate_url_file = "{0}/absent"
[[models]]
id = "m"
backends = [{{ kind = "openai", url = "http://127.0.0.1:1/v1", api_key_file = "{0}/key" }}]
"#,
                folder.display()
            ),
        )
        .unwrap();
        let config = Config::load(Some(&file)).unwrap();
        assert_eq!(config.operator.token.unwrap().expose_secret(), "op-token");
        assert_eq!(config.grpc.token.unwrap().expose_secret(), "grpc-token");
        assert_eq!(config.database.url, "postgres://u:pw@db:5432/rialto");
        assert_eq!(config.database.migrate_url, None, "an absent optional file");
        let key = config.models[0].backends[0].api_key.as_ref().unwrap();
        assert_eq!(key.expose_secret(), "sk-upstream");

        std::fs::write(folder.join("operator"), "\n").unwrap();
        let error = Config::load(Some(&file)).unwrap_err().to_string();
        assert!(
            error.contains("operator.token_file") && error.contains("empty"),
            "{error}"
        );
        std::fs::remove_dir_all(&folder).unwrap();
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closure type, not ours
    fn refuse_inline_refuses_each_secret_written_in_the_file() {
        // In a Jail: Config::load reads RIALTO_* variables, which another
        // test sets inside one.
        figment::Jail::expect_with(|_| {
            let folder = scratch("inline");
            let file = folder.join("rialto.toml");
            let cases = [
                ("[operator]\ntoken = \"t\"", "operator.token_file"),
                ("[grpc]\ntoken = \"t\"", "grpc.token_file"),
                (
                    "[database]\nurl = \"postgres://u:pw@h/db\"",
                    "database.url_file",
                ),
                (
                    "[[models]]\nid = \"m\"\nbackends = [{ kind = \"openai\", url = \"http://h/v1\", api_key = \"k\" }]",
                    "api_key_file",
                ),
                (
                    "[console]\nsession_key = \"0123456789abcdef0123456789abcdef\"",
                    "console.session_key_file",
                ),
            ];
            for (text, instead) in cases {
                std::fs::write(&file, format!("[secrets]\nrefuse_inline = true\n{text}\n"))
                    .unwrap();
                let error = Config::load(Some(&file)).unwrap_err().to_string();
                assert!(
                    error.contains(instead) && error.contains("refuse_inline"),
                    "{error}"
                );
                // Without the setting, the same file loads.
                std::fs::write(&file, format!("{text}\n")).unwrap();
                Config::load(Some(&file)).unwrap();
            }
            // A URL without a password is no secret.
            std::fs::write(
            &file,
            "[secrets]\nrefuse_inline = true\n[database]\nurl = \"postgres://rialto@db/rialto\"\n",
        )
        .unwrap();
            Config::load(Some(&file)).unwrap();
            std::fs::remove_dir_all(&folder).unwrap();
            Ok(())
        });
    }

    #[test]
    fn the_example_configuration_is_valid() {
        let text = include_str!("../../../deploy/rialto.example.toml");
        let config = Config::from_toml(text).unwrap();
        assert!(config.models.iter().any(|m| m.id == "smollm2-135m"));
    }

    #[test]
    fn the_kubernetes_configurations_are_valid() {
        for text in [
            include_str!("../../../k8s/base/rialto.toml"),
            include_str!("../../../k8s/overlays/prod/rialto.toml"),
        ] {
            let config = Config::from_toml(text).unwrap();
            assert_eq!(config.metrics.listen, "0.0.0.0:9464");
            assert!(config.remote.limiter.contains(','), "two limiter replicas");
            assert_eq!(config.shutdown.delay_ms, 5000);
            assert_ne!(config.wallet.domains, WalletConfig::default().domains);
        }
    }

    #[test]
    fn the_built_in_catalog_parses_and_a_config_file_replaces_it() {
        let defaults = Config::default();
        let ids: Vec<&str> = defaults.models.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["smollm2-135m", "all-minilm-l6-v2", "espeak-ng"]);
        defaults.validate().unwrap();
        assert_eq!(defaults.models[0].backends[0].kind, "local");
        let config = Config::from_toml(
            "[[models]]\nid = \"m\"\nbackends = [{ kind = \"openai\", url = \"http://127.0.0.1:1/v1\" }]\n",
        )
        .unwrap();
        assert_eq!(config.models.len(), 1);
        assert_eq!(config.models[0].id, "m");
    }

    /// The example from the foundation issue, verbatim.
    const ISSUE_EXAMPLE: &str = r#"
brand = "rialto"
[gateway]
listen = "127.0.0.1:8080"
[grpc]
listen = "127.0.0.1:9090"           # where this process serves the services it runs
[database]
url = "sqlite://data/rialto.db"     # or postgres://postgres@127.0.0.1:5432/rialto
[operator]
token = "change-me"                 # bearer token of the operator API below
[remote]                            # used only for services this process does not run
auth = "http://127.0.0.1:9090"
limiter = "http://127.0.0.1:9090"
billing = "http://127.0.0.1:9090"
router = "http://127.0.0.1:9090"
[[models]]
id = "mock-chat"
name = "Mock Chat"
type = "text"
tier = "XS"
input_usd_per_mtok = 0.5
output_usd_per_mtok = 1.5
backends = [{ kind = "openai", url = "http://127.0.0.1:18999/v1", model = "mock-model" }]
"#;

    #[test]
    fn the_issue_example_loads() {
        use secrecy::ExposeSecret;
        let config = Config::from_toml(ISSUE_EXAMPLE).unwrap();
        assert_eq!(config.gateway.listen.port(), 8080);
        assert_eq!(
            config.operator.token.as_ref().unwrap().expose_secret(),
            "change-me"
        );
        let model = config.model("mock-chat").unwrap();
        assert_eq!(model.display_name(), "Mock Chat");
        assert_eq!(model.backends[0].model.as_deref(), Some("mock-model"));
    }

    #[test]
    fn defaults_serve_on_8080_with_sqlite() {
        let config = Config::from_toml("").unwrap();
        assert_eq!(config.gateway.listen.to_string(), "127.0.0.1:8080");
        assert!(config.database.url.starts_with("sqlite://data/"));
        assert_eq!(config.services.len(), 5);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused() {
        assert!(Config::from_toml("[gateway]\nlisten_port = 1").is_err());
        assert!(Config::from_toml("brand = \"a b\"").is_err());
        assert!(Config::from_toml("[limits.tiers.standard.XS]\ntpm = 0").is_err());
        assert!(Config::from_toml("[[limits.overrides]]\nrpm = 1").is_err());
        assert!(Config::from_toml("[bus]\nurl = \"redis://x\"").is_err());
        let partner = Config::from_toml("[limits.tiers.partner.M]\nrpm = 300").unwrap();
        let m = partner.limits.tiers["partner"]["M"];
        assert_eq!(
            (m.rpm, m.tpm),
            (300, Some(1_500_000)),
            "one field changes one number"
        );
        let twice = "[[models]]\nid = \"a\"\n[[models]]\nid = \"a\"\n";
        assert!(Config::from_toml(twice).is_err());
    }

    #[test]
    fn prices_are_exact_decimals() {
        assert_eq!(price_decimal(0.15).to_string(), "0.15");
        assert_eq!(price_decimal(1.5).to_string(), "1.5");
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment::Jail's closure type, not ours
    fn environment_overrides_the_file_and_ignores_foreign_variables() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("rialto.toml", ISSUE_EXAMPLE)?;
            jail.set_env("RIALTO_GATEWAY__LISTEN", "127.0.0.1:9999");
            jail.set_env("RIALTO_OPERATOR__TOKEN", "from-env");
            // What Kubernetes injects for a Service named rialto-auth.
            jail.set_env("RIALTO_AUTH_SERVICE_HOST", "10.0.0.1");
            let config = Config::load(Some(Path::new("rialto.toml"))).map_err(|e| e.to_string())?;
            assert_eq!(config.gateway.listen.port(), 9999);
            use secrecy::ExposeSecret;
            assert_eq!(
                config.operator.token.as_ref().unwrap().expose_secret(),
                "from-env"
            );
            jail.set_env("RIALTO_GATEWAY__LISTN", "127.0.0.1:1");
            assert!(Config::load(Some(Path::new("rialto.toml"))).is_err());
            Ok(())
        });
    }

    #[test]
    fn an_empty_grpc_token_is_refused() {
        let error = Config::from_toml("[grpc]\ntoken = \"\"").unwrap_err();
        assert!(error.to_string().contains("grpc.token"), "{error}");
        assert!(Config::from_toml("[grpc]\ntoken = \"s3cret\"").is_ok());
    }

    #[test]
    fn a_bad_bus_url_is_named_without_its_credentials() {
        let error = Config::from_toml("[bus]\nurl = \"tls://rialto:s3cret@nats:4222\"")
            .unwrap_err()
            .to_string();
        assert!(error.contains("bus.url"), "{error}");
        assert!(!error.contains("s3cret"), "{error}");
    }

    #[test]
    fn secrets_do_not_print() {
        let config = Config::from_toml(ISSUE_EXAMPLE).unwrap();
        assert!(!format!("{config:?}").contains("change-me"));
    }
}
