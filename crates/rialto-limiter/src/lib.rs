//! The limiter service: per-principal rate windows and abuse protection.
//!
//! This crate sets the limiter's place in the request path and its interface
//! (admit before the call, commit the real tokens after). The decision logic
//! in [`LocalLimiter`] admits every request for now: exact per-key windows,
//! tiers, the spec's headers and abuse protection arrive with the limiter
//! issue and fill this service without re-plumbing the callers.

use std::sync::Arc;

use async_trait::async_trait;
use rialto_core::Result;
use rialto_proto::limiter::v1 as pb;

pub mod grpc;

/// The limiter in domain terms.
#[async_trait]
pub trait LimiterService: Send + Sync + 'static {
    /// Takes a request slot and an estimate of tokens, or refuses.
    async fn admit(&self, request: pb::AdmitRequest) -> Result<pb::AdmitResponse>;
    /// Replaces the estimate taken at admission by the tokens really used.
    async fn commit(&self, request: pb::CommitRequest) -> Result<pb::CommitResponse>;
}

/// A cloneable handle on the limiter, local or remote.
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

/// The in-process limiter. Admits everything until the limiter issue lands.
#[derive(Debug, Default)]
pub struct LocalLimiter;

#[async_trait]
impl LimiterService for LocalLimiter {
    async fn admit(&self, _request: pb::AdmitRequest) -> Result<pb::AdmitResponse> {
        Ok(pb::AdmitResponse {
            admitted: true,
            retry_at: 0,
        })
    }

    async fn commit(&self, _request: pb::CommitRequest) -> Result<pb::CommitResponse> {
        Ok(pb::CommitResponse {})
    }
}
