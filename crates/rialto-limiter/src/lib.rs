//! The limiter service: exact per-principal rate windows, the rate-limit
//! log, and the gateway's abuse guard.
//!
//! - [`LimiterService`] is one replica's interface: admit into a window,
//!   commit the real tokens, record and read limit hits. [`LocalLimiter`]
//!   implements it with one actix actor per principal ([`actor`]) holding
//!   sliding-log windows ([`window`]); [`grpc`] carries it across processes.
//! - [`RateLimiter`] is what the gateway holds: it resolves the limits of a
//!   request from the configuration ([`policy`]), picks the replica owning
//!   each window by a consistent hash, and sends commits and hits as events
//!   on the bus.
//! - [`abuse::AbuseGuard`] counts failed requests in the gateway itself: it
//!   runs before anything else and must cost next to nothing.

use std::sync::Arc;

use async_trait::async_trait;
use rialto_core::Result;
use rialto_proto::limiter::v1 as pb;

pub mod abuse;
pub mod actor;
pub mod clock;
pub mod grpc;
mod local;
pub mod policy;
mod rate_limiter;
pub mod window;

pub use local::LocalLimiter;
pub use policy::{Caller, Scope, Target};
pub use rate_limiter::{Admission, RateHeaders, RateLimiter, Ticket, owner_of};

/// Bus subject (after the prefix) of token commits; every replica listens.
pub const COMMITS_SUBJECT: &str = "limiter.commits";
/// Bus subject of limit hits; one replica (the log writer group) persists each.
pub const HITS_SUBJECT: &str = "limiter.hits";
/// Queue group of the rate-limit log writers.
pub const LOG_WRITERS: &str = "limiter-log-writers";
/// Entries `GET /api_keys/rate_limits/log` returns.
pub const LOG_PAGE: u32 = 50;

/// One limiter replica in domain terms.
#[async_trait]
pub trait LimiterService: Send + Sync + 'static {
    /// Takes a request slot and an estimate of tokens in one window, or refuses.
    async fn admit(&self, request: pb::AdmitRequest) -> Result<pb::AdmitResponse>;
    /// Replaces the estimate taken at admission by the tokens really used,
    /// or releases the slot.
    async fn commit(&self, request: pb::CommitRequest) -> Result<pb::CommitResponse>;
    /// Records limit hits found elsewhere (the gateway's abuse guard).
    async fn record_hits(&self, request: pb::RecordHitsRequest) -> Result<pb::RecordHitsResponse>;
    /// The latest hits of an account, newest first.
    async fn recent_hits(&self, request: pb::RecentHitsRequest) -> Result<pb::RecentHitsResponse>;
}

/// A cloneable handle on one limiter replica, local or remote.
#[derive(Clone)]
pub struct LimiterClient(Arc<dyn LimiterService>);

impl LimiterClient {
    pub fn new(service: impl LimiterService) -> Self {
        Self(Arc::new(service))
    }
}

impl std::ops::Deref for LimiterClient {
    type Target = dyn LimiterService;

    fn deref(&self) -> &Self::Target {
        self.0.as_ref()
    }
}

impl std::fmt::Debug for LimiterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LimiterClient")
    }
}
