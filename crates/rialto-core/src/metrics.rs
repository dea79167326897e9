//! Prometheus metrics of this process, served on `GET /metrics`.
//!
//! One registry per process ([`metrics`]): every service records into it
//! where the event happens (the gateway's HTTP middleware, the gRPC layer,
//! the admission and settlement of a request, the usage consumer), and the
//! scrape renders it in the OpenMetrics text format. Values that are state
//! rather than events (a backend's circuit, requests in flight) are read at
//! scrape time through [`Metrics::on_scrape`] hooks, so the request path
//! pays nothing for them.
//!
//! The names are a contract with the dashboards under `deploy/grafana/`.

use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, OnceLock};

use prometheus_client::encoding::EncodeLabelSet;
pub use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HttpLabels {
    pub service: &'static str,
    /// The matched route pattern (`/api/v1/x402/balance/{wallet}`), never
    /// the raw path: bounded cardinality.
    pub route: String,
    pub method: &'static str,
    pub status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GrpcLabels {
    pub service: &'static str,
    /// `/rialto.router.v1.Router/Chat`.
    pub method: String,
    /// The gRPC status code name (`OK`, `UNAVAILABLE`, ...).
    pub code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `admitted` or `refused`.
    pub decision: &'static str,
    /// The window that refused (`RPM`, `TPM`, `RPD`), `none` when admitted.
    pub limit_type: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabels {
    pub model: String,
    /// `prompt` or `completion`.
    pub kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    pub model: String,
    pub backend: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendOutcomeLabels {
    pub model: String,
    pub backend: String,
    /// `ok`, `retry`, `busy`, `failover`, `skip` or `final`.
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConsumerLabels {
    pub stream: String,
    pub consumer: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaLabels {
    /// `limiter` or `billing`.
    pub service: &'static str,
    /// The replica as `remote.<service>` lists it.
    pub replica: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MoveLabels {
    pub service: &'static str,
    pub replica: String,
    /// `dead` (its principals moved away), `restarted` (moved away from a
    /// new incarnation until its rejoin delay ends), `rejoined` (moved back).
    pub cause: &'static str,
}

/// The build a process runs (`rialto_build_info`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    /// `<yyyymmdd>.<hhmmss>`, as `x-<brand>-version` says it.
    pub revision: String,
}

/// A database pool's connections by state (`rialto_db_pool_connections`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// The pool's owner: `main` (every service of the process shares it).
    pub pool: &'static str,
    /// `in_use` or `idle`.
    pub state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolNameLabels {
    pub pool: &'static str,
}

/// A ledger owner among the top spenders (`rialto_top_owner_spend_usd`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OwnerLabels {
    /// `account:<id>` or `wallet:<address>`.
    pub owner: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SecretReloadLabels {
    /// The configuration key of the file (`grpc.token_file`).
    pub secret: &'static str,
    /// `applied` or `refused`.
    pub outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    pub service: &'static str,
}

/// Half a second to about 17 minutes, doubling: how long a replica owned
/// nothing.
#[derive(Clone)]
pub struct AwayBuckets;

impl MetricConstructor<Histogram> for AwayBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(exponential_buckets(0.5, 2.0, 12))
    }
}

/// Latency buckets from 0.5 ms to ~65 s (doubling): the gateway's own
/// overhead and a long generation both land in a bucket of their own.
#[derive(Clone)]
pub struct LatencyBuckets;

impl MetricConstructor<Histogram> for LatencyBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(exponential_buckets(0.0005, 2.0, 18))
    }
}

/// Time to first token: 10 ms to ~82 s, doubling.
#[derive(Clone)]
pub struct FirstTokenBuckets;

impl MetricConstructor<Histogram> for FirstTokenBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(exponential_buckets(0.01, 2.0, 14))
    }
}

/// Time per output token: 0.5 ms to ~1 s, doubling.
#[derive(Clone)]
pub struct TokenGapBuckets;

impl MetricConstructor<Histogram> for TokenGapBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(exponential_buckets(0.0005, 2.0, 12))
    }
}

type Hook = Box<dyn Fn(&Metrics) + Send + Sync>;

pub struct Metrics {
    registry: Registry,
    hooks: Mutex<Vec<Hook>>,
    pub http_requests: Family<HttpLabels, Counter>,
    pub http_duration: Family<HttpLabels, Histogram, LatencyBuckets>,
    pub grpc_requests: Family<GrpcLabels, Counter>,
    pub grpc_duration: Family<GrpcLabels, Histogram, LatencyBuckets>,
    pub limiter_decisions: Family<DecisionLabels, Counter>,
    pub ledger_holds: Family<OutcomeLabels, Counter>,
    /// Routes asked beside the caller's admission and hold (a split
    /// deployment's gateway): used, or dropped on a refusal.
    pub routes_ahead: Family<OutcomeLabels, Counter>,
    pub ledger_settlements: Family<OutcomeLabels, Counter>,
    /// The ledger writer's batches: how long each took to commit.
    pub ledger_batch_seconds: Histogram,
    /// And how many records each carried.
    pub ledger_batch_records: Histogram,
    pub spend_usd: Family<ModelLabels, Counter<f64, AtomicU64>>,
    pub tokens: Family<TokenLabels, Counter>,
    pub backend_circuit_state: Family<BackendLabels, Gauge>,
    pub backend_in_flight: Family<BackendLabels, Gauge>,
    pub backend_requests: Family<BackendOutcomeLabels, Counter>,
    pub nats_consumer_pending: Family<ConsumerLabels, Gauge>,
    /// Each limiter and billing replica as this process hears it: 2 ready
    /// (owns its principals), 1 heard but within its rejoin delay, 0 dead.
    pub replica_up: Family<ReplicaLabels, Gauge>,
    pub ownership_moves: Family<MoveLabels, Counter>,
    pub replica_away_seconds: Family<ServiceLabels, Histogram, AwayBuckets>,
    /// Web searches made for requests: `ok` or `failed` (the provider
    /// failed or timed out: the answer went on without it).
    pub web_searches: Family<OutcomeLabels, Counter>,
    /// Pages fetched for requests: `ok` or `failed`.
    pub pages_scraped: Family<OutcomeLabels, Counter>,
    /// Log lines dropped because stdout fell behind (set at scrape time by
    /// `telemetry`).
    pub log_lines_dropped: Counter,
    /// 1, labelled with the build's revision: what an upgrade's dashboards
    /// and alerts join on.
    pub build_info: Family<BuildLabels, Gauge>,
    /// Unix seconds this process started (a restart shows as a change).
    pub process_start_time: Gauge<f64, AtomicU64>,
    /// A streamed answer's first token, from the router's call (per backend attempt that answered).
    pub time_to_first_token: Family<BackendLabels, Histogram, FirstTokenBuckets>,
    /// A streamed answer's time between output tokens after the first.
    pub time_per_output_token: Family<BackendLabels, Histogram, TokenGapBuckets>,
    pub db_pool_connections: Family<PoolLabels, Gauge>,
    pub db_pool_max_connections: Family<PoolNameLabels, Gauge>,
    /// Spend since the process started of the top owners by it (billing's
    /// scrape hook sets them; bounded by `metrics.top_spenders`).
    pub top_owner_spend_usd: Family<OwnerLabels, Gauge<f64, AtomicU64>>,
    pub config_reloads: Family<OutcomeLabels, Counter>,
    pub secret_reloads: Family<SecretReloadLabels, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

/// This process's metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("rialto");
        let http_requests = Family::default();
        let http_duration = Family::new_with_constructor(LatencyBuckets);
        let grpc_requests = Family::default();
        let grpc_duration = Family::new_with_constructor(LatencyBuckets);
        let limiter_decisions = Family::default();
        let ledger_holds = Family::default();
        let routes_ahead = Family::default();
        let ledger_settlements = Family::default();
        // 50 µs to ~3 s, doubling.
        let ledger_batch_seconds = Histogram::new(exponential_buckets(0.00005, 2.0, 16));
        // 1 to 512 records, doubling.
        let ledger_batch_records = Histogram::new(exponential_buckets(1.0, 2.0, 10));
        let spend_usd = Family::default();
        let tokens = Family::default();
        let backend_circuit_state = Family::default();
        let backend_in_flight = Family::default();
        let backend_requests = Family::default();
        let nats_consumer_pending = Family::default();
        let replica_up = Family::default();
        let ownership_moves = Family::default();
        let replica_away_seconds = Family::new_with_constructor(AwayBuckets);
        let log_lines_dropped = Counter::default();
        let build_info = Family::default();
        let web_searches = Family::default();
        let pages_scraped = Family::default();
        registry.register(
            "http_requests",
            "HTTP requests answered, by route, method and status",
            http_requests.clone(),
        );
        registry.register(
            "http_request_duration_seconds",
            "Time from a request's arrival to its response head, by route, method and status",
            http_duration.clone(),
        );
        registry.register(
            "grpc_requests",
            "gRPC calls served, by method and status code",
            grpc_requests.clone(),
        );
        registry.register(
            "grpc_request_duration_seconds",
            "Time to a gRPC call's response head, by method and status code",
            grpc_duration.clone(),
        );
        registry.register(
            "limiter_decisions",
            "Rate-limit decisions on inference requests",
            limiter_decisions.clone(),
        );
        registry.register(
            "ledger_holds",
            "Credit holds asked of the ledger: placed or refused",
            ledger_holds.clone(),
        );
        registry.register(
            "routes_ahead",
            "Routes asked beside the caller's admission and hold: used, or dropped on a refusal",
            routes_ahead.clone(),
        );
        registry.register(
            "ledger_settlements",
            "Settlements of holds: settled now, queued for billing, or failed",
            ledger_settlements.clone(),
        );
        registry.register(
            "ledger_batch_seconds",
            "Time the ledger writer took to commit one batch",
            ledger_batch_seconds.clone(),
        );
        registry.register(
            "ledger_batch_records",
            "Records (settlements, durable holds, checkpoints, ...) in one ledger batch",
            ledger_batch_records.clone(),
        );
        registry.register(
            "spend_usd",
            "USD charged for inference, by model",
            spend_usd.clone(),
        );
        registry.register(
            "tokens",
            "Tokens billed, by model and kind (prompt, completion)",
            tokens.clone(),
        );
        registry.register(
            "backend_circuit_state",
            "A backend's circuit: 0 closed, 1 half-open, 2 open, 3 down",
            backend_circuit_state.clone(),
        );
        registry.register(
            "backend_in_flight",
            "Requests a backend is serving now",
            backend_in_flight.clone(),
        );
        registry.register(
            "backend_requests",
            "Attempts on a backend by outcome (ok, retry, busy, failover, skip, final)",
            backend_requests.clone(),
        );
        registry.register(
            "nats_consumer_pending",
            "Messages a JetStream consumer has not yet been delivered (its lag)",
            nats_consumer_pending.clone(),
        );
        registry.register(
            "replica_up",
            "A limiter or billing replica as this process hears its heartbeats: 2 ready \
             (owns its principals), 1 heard but within its rejoin delay, 0 dead",
            replica_up.clone(),
        );
        registry.register(
            "ownership_moves",
            "Times a replica's principals moved: away from it (cause dead or restarted) or \
             back to it (rejoined)",
            ownership_moves.clone(),
        );
        registry.register(
            "replica_away_seconds",
            "How long a replica owned nothing, from when it stopped being ready to when it \
             was ready again",
            replica_away_seconds.clone(),
        );
        registry.register(
            "web_searches",
            "Web searches made for requests, by outcome (ok, or failed: the answer went on \
             without it)",
            web_searches.clone(),
        );
        registry.register(
            "pages_scraped",
            "Web pages fetched and read for requests, by outcome (ok or failed)",
            pages_scraped.clone(),
        );
        registry.register(
            "log_lines_dropped",
            "Log lines dropped because stdout fell 128,000 lines behind",
            log_lines_dropped.clone(),
        );
        registry.register(
            "build_info",
            "1, labelled with the revision of the build this process runs",
            build_info.clone(),
        );
        let process_start_time = Gauge::<f64, AtomicU64>::default();
        process_start_time.set(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        );
        registry.register(
            "process_start_time_seconds",
            "Unix time this process started",
            process_start_time.clone(),
        );
        let time_to_first_token = Family::new_with_constructor(FirstTokenBuckets);
        registry.register(
            "time_to_first_token_seconds",
            "Streamed answers: from the router's call to the backend's first token, by model and backend",
            time_to_first_token.clone(),
        );
        let time_per_output_token = Family::new_with_constructor(TokenGapBuckets);
        registry.register(
            "time_per_output_token_seconds",
            "Streamed answers: the time between output tokens after the first, by model and backend",
            time_per_output_token.clone(),
        );
        let db_pool_connections = Family::default();
        registry.register(
            "db_pool_connections",
            "Database connections of the pool by state (in_use, idle)",
            db_pool_connections.clone(),
        );
        let db_pool_max_connections = Family::default();
        registry.register(
            "db_pool_max_connections",
            "The pool's most connections (database.max_connections)",
            db_pool_max_connections.clone(),
        );
        let top_owner_spend_usd = Family::default();
        registry.register(
            "top_owner_spend_usd",
            "USD settled since this process started, for the top ledger owners by it (bounded)",
            top_owner_spend_usd.clone(),
        );
        let config_reloads = Family::default();
        registry.register(
            "config_reloads",
            "Configuration reloads by outcome (applied, refused)",
            config_reloads.clone(),
        );
        let secret_reloads = Family::default();
        registry.register(
            "secret_reloads",
            "Secret files re-read after a change, by secret and outcome (applied, refused)",
            secret_reloads.clone(),
        );
        Self {
            registry,
            hooks: Mutex::new(Vec::new()),
            http_requests,
            http_duration,
            grpc_requests,
            grpc_duration,
            limiter_decisions,
            ledger_holds,
            routes_ahead,
            ledger_settlements,
            ledger_batch_seconds,
            ledger_batch_records,
            spend_usd,
            tokens,
            backend_circuit_state,
            backend_in_flight,
            backend_requests,
            nats_consumer_pending,
            replica_up,
            ownership_moves,
            replica_away_seconds,
            web_searches,
            pages_scraped,
            log_lines_dropped,
            build_info,
            process_start_time,
            time_to_first_token,
            time_per_output_token,
            db_pool_connections,
            db_pool_max_connections,
            top_owner_spend_usd,
            config_reloads,
            secret_reloads,
        }
    }

    pub fn count_secret_reload(&self, secret: &'static str, outcome: &'static str) {
        self.secret_reloads
            .get_or_create(&SecretReloadLabels { secret, outcome })
            .inc();
    }

    pub fn count_config_reload(&self, outcome: &'static str) {
        self.config_reloads
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// Runs `hook` before every scrape, to set gauges from live state.
    pub fn on_scrape(&self, hook: impl Fn(&Metrics) + Send + Sync + 'static) {
        self.hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Box::new(hook));
    }

    /// The OpenMetrics text of every metric.
    pub fn render(&self) -> String {
        for hook in self.hooks.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            hook(self);
        }
        let mut text = String::with_capacity(16 * 1024);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    pub fn record_http(&self, labels: HttpLabels, seconds: f64) {
        self.http_handles(&labels).record(seconds);
    }

    /// The counter and histogram of one label set, looked up once: a caller
    /// that keeps them records a request with no lookup and no allocation.
    pub fn http_handles(&self, labels: &HttpLabels) -> HttpHandles {
        HttpHandles {
            requests: self.http_requests.get_or_create(labels).clone(),
            duration: self.http_duration.get_or_create(labels).clone(),
        }
    }

    pub fn record_grpc(&self, labels: GrpcLabels, seconds: f64) {
        self.grpc_duration.get_or_create(&labels).observe(seconds);
        self.grpc_requests.get_or_create(&labels).inc();
    }
}

/// `rialto_http_requests_total` and `rialto_http_request_duration_seconds`
/// of one (service, route, method, status): clones of the family's members
/// (they share their values), from [`Metrics::http_handles`].
#[derive(Debug, Clone)]
pub struct HttpHandles {
    requests: Counter,
    duration: Histogram,
}

impl HttpHandles {
    /// Counts one request that took `seconds`.
    pub fn record(&self, seconds: f64) {
        self.duration.observe(seconds);
        self.requests.inc();
    }
}

/// One member of a family, looked up the first time it is counted and kept:
/// counting then hashes no labels, takes no lock and allocates nothing
/// (`Family::get_or_create` does all three). A member never counted never
/// appears in the text, as with `get_or_create`, so a series still starts
/// at its first event (the alerts on `rialto_ledger_settlements_total`
/// watch a `failed` series appear).
#[derive(Debug)]
pub struct Resolved<M>(OnceLock<M>);

impl<M> Resolved<M> {
    pub const fn new() -> Self {
        Self(OnceLock::new())
    }
}

impl<M> Default for Resolved<M> {
    fn default() -> Self {
        Self::new()
    }
}

impl<M: Clone> Resolved<M> {
    /// The member of `family` labelled `labels()`, looked up once.
    pub fn of<S, C>(&self, family: &Family<S, M, C>, labels: impl FnOnce() -> S) -> &M
    where
        S: Clone + std::hash::Hash + Eq,
        C: MetricConstructor<M>,
    {
        self.0.get_or_init(|| family.get_or_create_owned(&labels()))
    }
}

/// A model's spend and token counters (`rialto_spend_usd_total`,
/// `rialto_tokens_total`), each looked up the first time it counts: kept
/// with the model, so a settlement counts with no lookup and no copy of the
/// model's name.
#[derive(Debug, Default)]
pub struct ModelCounters {
    model: String,
    spend_usd: Resolved<Counter<f64, AtomicU64>>,
    prompt_tokens: Resolved<Counter>,
    completion_tokens: Resolved<Counter>,
}

impl ModelCounters {
    pub fn new(model: &str) -> Self {
        Self {
            model: model.to_owned(),
            ..Self::default()
        }
    }

    pub fn spend_usd(&self, usd: f64) {
        let model = || ModelLabels {
            model: self.model.clone(),
        };
        self.spend_usd.of(&metrics().spend_usd, model).inc_by(usd);
    }

    /// Counts `tokens` of `kind` (`prompt` or `completion`); none is no
    /// event.
    pub fn tokens(&self, kind: TokenKind, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let (resolved, kind) = match kind {
            TokenKind::Prompt => (&self.prompt_tokens, "prompt"),
            TokenKind::Completion => (&self.completion_tokens, "completion"),
        };
        let labels = || TokenLabels {
            model: self.model.clone(),
            kind,
        };
        resolved.of(&metrics().tokens, labels).inc_by(tokens);
    }
}

/// What [`ModelCounters::tokens`] counts.
#[derive(Debug, Clone, Copy)]
pub enum TokenKind {
    Prompt,
    Completion,
}

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_recorded_values_with_the_prefix_and_runs_hooks() {
        let metrics = Metrics::new();
        metrics.record_http(
            HttpLabels {
                service: "gateway",
                route: "/api/v1/models".into(),
                method: "GET",
                status: 200,
            },
            0.002,
        );
        metrics.on_scrape(|m| {
            m.backend_in_flight
                .get_or_create(&BackendLabels {
                    model: "m".into(),
                    backend: "b".into(),
                })
                .set(3);
        });
        let text = metrics.render();
        assert!(text.contains(
            r#"rialto_http_requests_total{service="gateway",route="/api/v1/models",method="GET",status="200"} 1"#
        ), "{text}");
        assert!(text.contains("rialto_http_request_duration_seconds_bucket"));
        assert!(text.contains(r#"rialto_backend_in_flight{model="m",backend="b"} 3"#));
        assert!(text.ends_with("# EOF\n"));
    }

    /// A model's counters count into the families the text renders, each
    /// series appearing with its first event (none for a count of zero),
    /// and every later count goes to the same member.
    #[test]
    fn model_counters_count_into_their_families_from_their_first_event() {
        let model = "counted-once-model";
        let counters = ModelCounters::new(model);
        counters.tokens(TokenKind::Prompt, 0);
        counters.tokens(TokenKind::Completion, 5);
        counters.tokens(TokenKind::Completion, 2);
        let text = metrics().render();
        assert!(
            text.contains(&format!(
                r#"rialto_tokens_total{{model="{model}",kind="completion"}} 7"#
            )),
            "{text}"
        );
        assert!(!text.contains(&format!(r#"model="{model}",kind="prompt""#)));
        assert!(!text.contains(&format!(r#"rialto_spend_usd_total{{model="{model}"}}"#)));
        counters.spend_usd(0.25);
        counters.tokens(TokenKind::Prompt, 3);
        ModelCounters::new(model).spend_usd(0.5);
        let text = metrics().render();
        assert!(
            text.contains(&format!(
                r#"rialto_spend_usd_total{{model="{model}"}} 0.75"#
            )),
            "{text}"
        );
        assert!(text.contains(&format!(
            r#"rialto_tokens_total{{model="{model}",kind="prompt"}} 3"#
        )));
    }
}
