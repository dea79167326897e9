//! Adapters between [`LimiterService`](crate::LimiterService) and tonic.

use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use rialto_core::Result;
use rialto_core::grpc_auth::{ClientToken, RemoteChannel, ServerToken};
use rialto_core::per_thread::PerThread;
use rialto_proto::limiter::v1 as pb;
use rialto_proto::limiter::v1::limiter_client::LimiterClient as GrpcClient;
use rialto_proto::limiter::v1::limiter_server::{Limiter, LimiterServer};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::{LimiterClient, LimiterService};

/// Serves a [`LimiterClient`] over gRPC, behind the shared token.
pub fn server(
    client: LimiterClient,
    token: ServerToken,
) -> InterceptedService<LimiterServer<LimiterGrpc>, ServerToken> {
    InterceptedService::new(LimiterServer::new(LimiterGrpc(client)), token)
}

pub struct LimiterGrpc(LimiterClient);

#[async_trait]
impl Limiter for LimiterGrpc {
    async fn admit(
        &self,
        request: Request<pb::AdmitRequest>,
    ) -> Result<Response<pb::AdmitResponse>, Status> {
        Ok(Response::new(self.0.admit(request.into_inner()).await?))
    }

    async fn commit(
        &self,
        request: Request<pb::CommitRequest>,
    ) -> Result<Response<pb::CommitResponse>, Status> {
        Ok(Response::new(self.0.commit(request.into_inner()).await?))
    }

    async fn commit_many(
        &self,
        request: Request<pb::CommitBatch>,
    ) -> Result<Response<pb::CommitResponse>, Status> {
        Ok(Response::new(
            self.0.commit_many(request.into_inner()).await?,
        ))
    }

    async fn record_hits(
        &self,
        request: Request<pb::RecordHitsRequest>,
    ) -> Result<Response<pb::RecordHitsResponse>, Status> {
        Ok(Response::new(
            self.0.record_hits(request.into_inner()).await?,
        ))
    }

    async fn recent_hits(
        &self,
        request: Request<pb::RecentHitsRequest>,
    ) -> Result<Response<pb::RecentHitsResponse>, Status> {
        Ok(Response::new(
            self.0.recent_hits(request.into_inner()).await?,
        ))
    }
}

/// The limiter in another process, reached over gRPC.
pub struct RemoteLimiter {
    remote: RemoteChannel,
    /// The replica answered a `CommitMany`: a batch need not be kept for
    /// one `Commit` per record, which a replica older than the call needs.
    batches_known: AtomicBool,
}

impl RemoteLimiter {
    pub fn new(channel: impl Into<PerThread<Channel>>, token: ClientToken) -> Self {
        Self {
            remote: RemoteChannel::new(channel, token),
            batches_known: AtomicBool::new(false),
        }
    }

    /// A client on this thread's channel.
    fn client(&self) -> GrpcClient<InterceptedService<Channel, ClientToken>> {
        GrpcClient::new(self.remote.here())
    }
}

#[async_trait]
impl LimiterService for RemoteLimiter {
    async fn admit(&self, request: pb::AdmitRequest) -> Result<pb::AdmitResponse> {
        Ok(self.client().admit(request).await?.into_inner())
    }

    async fn commit(&self, request: pb::CommitRequest) -> Result<pb::CommitResponse> {
        Ok(self.client().commit(request).await?.into_inner())
    }

    async fn commit_many(&self, batch: pb::CommitBatch) -> Result<pb::CommitResponse> {
        if self.batches_known.load(Ordering::Relaxed) {
            return Ok(self.client().commit_many(batch).await?.into_inner());
        }
        match self.client().commit_many(batch.clone()).await {
            Ok(response) => {
                self.batches_known.store(true, Ordering::Relaxed);
                Ok(response.into_inner())
            }
            // A replica older than the batch call: one call per commit.
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                for request in batch.commits {
                    self.commit(request).await?;
                }
                Ok(pb::CommitResponse {})
            }
            Err(status) => Err(status.into()),
        }
    }

    async fn record_hits(&self, request: pb::RecordHitsRequest) -> Result<pb::RecordHitsResponse> {
        Ok(self.client().record_hits(request).await?.into_inner())
    }

    async fn recent_hits(&self, request: pb::RecentHitsRequest) -> Result<pb::RecentHitsResponse> {
        Ok(self.client().recent_hits(request).await?.into_inner())
    }
}
