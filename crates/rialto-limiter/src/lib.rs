//! The limiter service: exact per-principal rate windows, the rate-limit
//! log, and the gateway's abuse guard.
//!
//! - [`LimiterService`] is one replica's interface: admit into a window,
//!   commit the real tokens, record and read limit hits. [`LocalLimiter`]
//!   implements it with the sliding-log windows ([`window`]) of every
//!   principal it holds in a sharded map of `std::sync::Mutex`es
//!   ([`principals`]): a decision is one short synchronous critical section
//!   on the caller's thread, with no `.await` between reading a window and
//!   updating it, so a principal's concurrent requests are decided one at a
//!   time, exactly. [`grpc`] carries the trait across processes.
//! - [`RateLimiter`] is what the gateway holds: it resolves the limits of a
//!   request from the configuration ([`policy`]) and picks the replica
//!   owning each window by a consistent hash. A window owned by the
//!   [`LocalLimiter`] of this process is decided, committed and released in
//!   place (no task, channel or thread hop, no owned copy of the request);
//!   other replicas get the trait's messages, with commits and hits as
//!   events on the bus.
//! - [`abuse::AbuseGuard`] counts failed requests in the gateway itself: it
//!   runs before anything else and must cost next to nothing.
//!
//! The limiter uses no actors (no actix dependency): its only background
//! work is Tokio tasks (the idle sweeper, the bus subscribers, the log
//! writer).

use std::sync::Arc;

use async_trait::async_trait;
use rialto_core::Result;
use rialto_proto::limiter::v1 as pb;

pub mod abuse;
pub mod clock;
pub mod grpc;
mod local;
pub mod policy;
pub mod principals;
mod rate_limiter;
pub mod window;

pub use local::LocalLimiter;
pub use policy::{Caller, Scope, Target};
pub use rate_limiter::{Admission, RateHeaders, RateLimiter, Ticket, TokenHeaders, owner_of};

/// Bus subject (after the prefix) of token commits; every replica listens.
pub const COMMITS_SUBJECT: &str = "limiter.commits";
/// Bus subject (with `.<replica index>`) of the admissions and releases a
/// replica decides, sent to the other of the principal's first two replicas
/// ([`pb::WindowEvent`]).
pub const REPLICATION_SUBJECT: &str = "limiter.replication";
/// Bus subject of limit hits; one replica (the log writer group) persists each.
pub const HITS_SUBJECT: &str = "limiter.hits";
/// Queue group of the rate-limit log writers.
pub const LOG_WRITERS: &str = "limiter-log-writers";
/// Entries `GET /api_keys/rate_limits/log` returns.
pub const LOG_PAGE: u32 = 50;
/// The most entries of every account's log one request returns.
pub const LOG_PAGE_ALL: u32 = 200;

/// One limiter replica in domain terms.
#[async_trait]
pub trait LimiterService: Send + Sync + 'static {
    /// Takes a request slot and an estimate of tokens in one window, or refuses.
    async fn admit(&self, request: pb::AdmitRequest) -> Result<pb::AdmitResponse>;
    /// Replaces the estimate taken at admission by the tokens really used,
    /// or releases the slot.
    async fn commit(&self, request: pb::CommitRequest) -> Result<pb::CommitResponse>;
    /// Applies each commit of `batch` as [`commit`](Self::commit) would,
    /// in order; fails with the first that fails, the others applied.
    async fn commit_many(&self, batch: pb::CommitBatch) -> Result<pb::CommitResponse> {
        let mut failed = None;
        for request in batch.commits {
            if let Err(error) = self.commit(request).await {
                failed.get_or_insert(error);
            }
        }
        failed.map_or(Ok(pb::CommitResponse {}), Err)
    }
    /// Records limit hits found elsewhere (the gateway's abuse guard).
    async fn record_hits(&self, request: pb::RecordHitsRequest) -> Result<pb::RecordHitsResponse>;
    /// The latest hits of an account (of every account with
    /// `all_accounts`), newest first.
    async fn recent_hits(&self, request: pb::RecentHitsRequest) -> Result<pb::RecentHitsResponse>;
}

/// A cloneable handle on one limiter replica, local or remote.
#[derive(Clone)]
pub struct LimiterClient {
    service: Arc<dyn LimiterService>,
    /// The same replica when it is a [`LocalLimiter`] of this process, so
    /// [`RateLimiter`] can decide in place rather than through the trait.
    local: Option<LocalLimiter>,
}

impl LimiterClient {
    pub fn new<S: LimiterService>(service: S) -> Self {
        let local = (&service as &dyn std::any::Any)
            .downcast_ref::<LocalLimiter>()
            .cloned();
        Self {
            service: Arc::new(service),
            local,
        }
    }

    /// The replica itself when it runs in this process.
    pub fn local(&self) -> Option<&LocalLimiter> {
        self.local.as_ref()
    }
}

impl std::ops::Deref for LimiterClient {
    type Target = dyn LimiterService;

    fn deref(&self) -> &Self::Target {
        self.service.as_ref()
    }
}

impl std::fmt::Debug for LimiterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimiterClient")
            .field("local", &self.local.is_some())
            .finish()
    }
}
