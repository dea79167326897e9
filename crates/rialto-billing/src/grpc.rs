//! Adapters between [`BillingService`](crate::BillingService) and tonic.

use async_trait::async_trait;
use rialto_core::Result;
use rialto_core::grpc_auth::{ClientToken, RemoteChannel, ServerToken};
use rialto_core::per_thread::PerThread;
use rialto_proto::billing::v1 as pb;
use rialto_proto::billing::v1::billing_client::BillingClient as GrpcClient;
use rialto_proto::billing::v1::billing_server::{Billing, BillingServer};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::{BillingClient, BillingService};

/// Serves a [`BillingClient`] over gRPC, behind the shared token.
pub fn server(
    client: BillingClient,
    token: ServerToken,
) -> InterceptedService<BillingServer<BillingGrpc>, ServerToken> {
    let server = BillingServer::new(BillingGrpc(client))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    InterceptedService::new(server, token)
}

/// The largest message either way: a finished job's media crosses in one
/// (a video of a minute is tens of megabytes); tonic's default is 4 MiB.
pub const MAX_MESSAGE_BYTES: usize = 96 * 1024 * 1024;

pub struct BillingGrpc(BillingClient);

#[async_trait]
impl Billing for BillingGrpc {
    async fn quote(
        &self,
        request: Request<pb::QuoteRequest>,
    ) -> Result<Response<pb::Cost>, Status> {
        Ok(Response::new(self.0.quote(request.into_inner()).await?))
    }

    async fn hold(
        &self,
        request: Request<pb::HoldRequest>,
    ) -> Result<Response<pb::HoldResponse>, Status> {
        Ok(Response::new(self.0.hold(request.into_inner()).await?))
    }

    async fn charge(
        &self,
        request: Request<pb::ChargeRequest>,
    ) -> Result<Response<pb::ChargeResponse>, Status> {
        Ok(Response::new(self.0.charge(request.into_inner()).await?))
    }

    async fn checkpoint(
        &self,
        request: Request<pb::CheckpointRequest>,
    ) -> Result<Response<pb::CheckpointResponse>, Status> {
        Ok(Response::new(
            self.0.checkpoint(request.into_inner()).await?,
        ))
    }

    async fn settle(
        &self,
        request: Request<pb::SettleRequest>,
    ) -> Result<Response<pb::Cost>, Status> {
        Ok(Response::new(self.0.settle(request.into_inner()).await?))
    }

    async fn credit(
        &self,
        request: Request<pb::CreditRequest>,
    ) -> Result<Response<pb::CreditResponse>, Status> {
        Ok(Response::new(self.0.credit(request.into_inner()).await?))
    }

    async fn get_balance(
        &self,
        request: Request<pb::GetBalanceRequest>,
    ) -> Result<Response<pb::Balance>, Status> {
        Ok(Response::new(
            self.0.get_balance(request.into_inner()).await?,
        ))
    }

    async fn usage_history(
        &self,
        request: Request<pb::UsageHistoryRequest>,
    ) -> Result<Response<pb::UsageHistoryResponse>, Status> {
        Ok(Response::new(
            self.0.usage_history(request.into_inner()).await?,
        ))
    }

    async fn put_response(
        &self,
        request: Request<pb::StoredResponse>,
    ) -> Result<Response<pb::PutResponseAck>, Status> {
        Ok(Response::new(
            self.0.put_response(request.into_inner()).await?,
        ))
    }

    async fn get_response(
        &self,
        request: Request<pb::GetResponseRequest>,
    ) -> Result<Response<pb::StoredResponse>, Status> {
        Ok(Response::new(
            self.0.get_response(request.into_inner()).await?,
        ))
    }

    async fn usage_analytics(
        &self,
        request: Request<pb::UsageAnalyticsRequest>,
    ) -> Result<Response<pb::UsageAnalyticsResponse>, Status> {
        Ok(Response::new(
            self.0.usage_analytics(request.into_inner()).await?,
        ))
    }

    async fn set_stake(
        &self,
        request: Request<pb::SetStakeRequest>,
    ) -> Result<Response<pb::Balance>, Status> {
        Ok(Response::new(self.0.set_stake(request.into_inner()).await?))
    }

    async fn key_spend(
        &self,
        request: Request<pb::KeySpendRequest>,
    ) -> Result<Response<pb::KeySpendResponse>, Status> {
        Ok(Response::new(self.0.key_spend(request.into_inner()).await?))
    }

    async fn top_up(
        &self,
        request: Request<pb::TopUpRequest>,
    ) -> Result<Response<pb::TopUpResponse>, Status> {
        Ok(Response::new(self.0.top_up(request.into_inner()).await?))
    }

    async fn transactions(
        &self,
        request: Request<pb::TransactionsRequest>,
    ) -> Result<Response<pb::TransactionsResponse>, Status> {
        Ok(Response::new(
            self.0.transactions(request.into_inner()).await?,
        ))
    }

    async fn top_ups(
        &self,
        request: Request<pb::TopUpsRequest>,
    ) -> Result<Response<pb::TopUpsResponse>, Status> {
        Ok(Response::new(self.0.top_ups(request.into_inner()).await?))
    }

    async fn submit_job(
        &self,
        request: Request<pb::SubmitJobRequest>,
    ) -> Result<Response<pb::Job>, Status> {
        Ok(Response::new(
            self.0.submit_job(request.into_inner()).await?,
        ))
    }

    async fn claim_jobs(
        &self,
        request: Request<pb::ClaimJobsRequest>,
    ) -> Result<Response<pb::ClaimJobsResponse>, Status> {
        Ok(Response::new(
            self.0.claim_jobs(request.into_inner()).await?,
        ))
    }

    async fn update_job(
        &self,
        request: Request<pb::UpdateJobRequest>,
    ) -> Result<Response<pb::Job>, Status> {
        Ok(Response::new(
            self.0.update_job(request.into_inner()).await?,
        ))
    }

    async fn get_job(
        &self,
        request: Request<pb::GetJobRequest>,
    ) -> Result<Response<pb::Job>, Status> {
        Ok(Response::new(self.0.get_job(request.into_inner()).await?))
    }

    async fn complete_job(
        &self,
        request: Request<pb::CompleteJobRequest>,
    ) -> Result<Response<pb::Job>, Status> {
        Ok(Response::new(
            self.0.complete_job(request.into_inner()).await?,
        ))
    }
}

/// Billing in another process, reached over gRPC.
pub struct RemoteBilling(RemoteChannel);

impl RemoteBilling {
    pub fn new(channel: impl Into<PerThread<Channel>>, token: ClientToken) -> Self {
        Self(RemoteChannel::new(channel, token))
    }

    /// A client on this thread's channel.
    fn client(&self) -> GrpcClient<InterceptedService<Channel, ClientToken>> {
        GrpcClient::new(self.0.here())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }
}

#[async_trait]
impl BillingService for RemoteBilling {
    async fn quote(&self, request: pb::QuoteRequest) -> Result<pb::Cost> {
        Ok(self.client().quote(request).await?.into_inner())
    }

    async fn hold(&self, request: pb::HoldRequest) -> Result<pb::HoldResponse> {
        Ok(self.client().hold(request).await?.into_inner())
    }

    async fn checkpoint(&self, request: pb::CheckpointRequest) -> Result<pb::CheckpointResponse> {
        Ok(self.client().checkpoint(request).await?.into_inner())
    }

    async fn settle(&self, request: pb::SettleRequest) -> Result<pb::Cost> {
        Ok(self.client().settle(request).await?.into_inner())
    }

    async fn charge(&self, request: pb::ChargeRequest) -> Result<pb::ChargeResponse> {
        Ok(self.client().charge(request).await?.into_inner())
    }

    async fn credit(&self, request: pb::CreditRequest) -> Result<pb::CreditResponse> {
        Ok(self.client().credit(request).await?.into_inner())
    }

    async fn get_balance(&self, request: pb::GetBalanceRequest) -> Result<pb::Balance> {
        Ok(self.client().get_balance(request).await?.into_inner())
    }

    async fn usage_history(
        &self,
        request: pb::UsageHistoryRequest,
    ) -> Result<pb::UsageHistoryResponse> {
        Ok(self.client().usage_history(request).await?.into_inner())
    }

    async fn put_response(&self, request: pb::StoredResponse) -> Result<pb::PutResponseAck> {
        Ok(self.client().put_response(request).await?.into_inner())
    }

    async fn get_response(&self, request: pb::GetResponseRequest) -> Result<pb::StoredResponse> {
        Ok(self.client().get_response(request).await?.into_inner())
    }

    async fn usage_analytics(
        &self,
        request: pb::UsageAnalyticsRequest,
    ) -> Result<pb::UsageAnalyticsResponse> {
        Ok(self.client().usage_analytics(request).await?.into_inner())
    }

    async fn set_stake(&self, request: pb::SetStakeRequest) -> Result<pb::Balance> {
        Ok(self.client().set_stake(request).await?.into_inner())
    }

    async fn key_spend(&self, request: pb::KeySpendRequest) -> Result<pb::KeySpendResponse> {
        Ok(self.client().key_spend(request).await?.into_inner())
    }

    async fn top_up(&self, request: pb::TopUpRequest) -> Result<pb::TopUpResponse> {
        Ok(self.client().top_up(request).await?.into_inner())
    }

    async fn transactions(
        &self,
        request: pb::TransactionsRequest,
    ) -> Result<pb::TransactionsResponse> {
        Ok(self.client().transactions(request).await?.into_inner())
    }

    async fn top_ups(&self, request: pb::TopUpsRequest) -> Result<pb::TopUpsResponse> {
        Ok(self.client().top_ups(request).await?.into_inner())
    }

    async fn submit_job(&self, request: pb::SubmitJobRequest) -> Result<pb::Job> {
        Ok(self.client().submit_job(request).await?.into_inner())
    }

    async fn claim_jobs(&self, request: pb::ClaimJobsRequest) -> Result<pb::ClaimJobsResponse> {
        Ok(self.client().claim_jobs(request).await?.into_inner())
    }

    async fn update_job(&self, request: pb::UpdateJobRequest) -> Result<pb::Job> {
        Ok(self.client().update_job(request).await?.into_inner())
    }

    async fn get_job(&self, request: pb::GetJobRequest) -> Result<pb::Job> {
        Ok(self.client().get_job(request).await?.into_inner())
    }

    async fn complete_job(&self, request: pb::CompleteJobRequest) -> Result<pb::Job> {
        Ok(self.client().complete_job(request).await?.into_inner())
    }
}
