//! Adapters between [`RouterService`](crate::RouterService) and tonic. A
//! streamed chat is a server-streaming RPC.

use std::pin::Pin;

use async_trait::async_trait;
use futures_util::{Stream, StreamExt};
use rialto_core::grpc_auth::{ClientToken, RemoteChannel, ServerToken};
use rialto_core::per_thread::PerThread;
use rialto_core::{Error, Result};
use rialto_proto::router::v1 as pb;
use rialto_proto::router::v1::router_client::RouterClient as GrpcClient;
use rialto_proto::router::v1::router_server::{Router, RouterServer};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::{Chat, ChatStream, MediaStream, RouterClient, RouterService};

/// Serves a [`RouterClient`] over gRPC, behind the shared token. Chat bodies
/// can be large (images, documents): messages up to `max_message_bytes` pass.
pub fn server(
    client: RouterClient,
    token: ServerToken,
    max_message_bytes: usize,
) -> InterceptedService<RouterServer<RouterGrpc>, ServerToken> {
    let server = RouterServer::new(RouterGrpc(client))
        .max_decoding_message_size(max_message_bytes)
        .max_encoding_message_size(max_message_bytes);
    InterceptedService::new(server, token)
}

pub struct RouterGrpc(RouterClient);

type StatusStream = Pin<Box<dyn Stream<Item = Result<pb::ChatStreamEvent, Status>> + Send>>;
type MediaStatusStream = Pin<Box<dyn Stream<Item = Result<pb::MediaStreamEvent, Status>> + Send>>;

#[async_trait]
impl Router for RouterGrpc {
    type ChatStreamStream = StatusStream;
    type MediaStreamStream = MediaStatusStream;

    async fn backends(
        &self,
        _: Request<pb::BackendsRequest>,
    ) -> Result<Response<pb::BackendsResponse>, Status> {
        Ok(Response::new(self.0.backends().await?))
    }

    async fn chat(
        &self,
        request: Request<pb::ChatRequest>,
    ) -> Result<Response<pb::ChatResponse>, Status> {
        let chat = Chat::from_wire(request.into_inner())?;
        Ok(Response::new(self.0.chat(chat).await?))
    }

    async fn chat_stream(
        &self,
        request: Request<pb::ChatRequest>,
    ) -> Result<Response<Self::ChatStreamStream>, Status> {
        let chat = Chat::from_wire(request.into_inner())?;
        let stream = self.0.chat_stream(chat).await?;
        Ok(Response::new(Box::pin(
            stream.map(|event| event.map_err(Status::from)),
        )))
    }

    async fn embed(
        &self,
        request: Request<pb::EmbedRequest>,
    ) -> Result<Response<pb::EmbedResponse>, Status> {
        Ok(Response::new(self.0.embed(request.into_inner()).await?))
    }

    async fn media(
        &self,
        request: Request<pb::MediaRequest>,
    ) -> Result<Response<pb::MediaResponse>, Status> {
        Ok(Response::new(self.0.media(request.into_inner()).await?))
    }

    async fn media_stream(
        &self,
        request: Request<pb::MediaRequest>,
    ) -> Result<Response<Self::MediaStreamStream>, Status> {
        let stream = self.0.media_stream(request.into_inner()).await?;
        Ok(Response::new(Box::pin(
            stream.map(|event| event.map_err(Status::from)),
        )))
    }
}

/// The router in another process, reached over gRPC.
pub struct RemoteRouter {
    remote: RemoteChannel,
    max_message_bytes: usize,
}

impl RemoteRouter {
    pub fn new(
        channel: impl Into<PerThread<Channel>>,
        token: ClientToken,
        max_message_bytes: usize,
    ) -> Self {
        Self {
            remote: RemoteChannel::new(channel, token),
            max_message_bytes,
        }
    }

    /// A client on this thread's channel.
    fn client(&self) -> GrpcClient<InterceptedService<Channel, ClientToken>> {
        GrpcClient::new(self.remote.here())
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes)
    }
}

#[async_trait]
impl RouterService for RemoteRouter {
    async fn chat(&self, chat: Chat) -> Result<pb::ChatResponse> {
        Ok(self.client().chat(chat.into_wire()?).await?.into_inner())
    }

    async fn chat_stream(&self, chat: Chat) -> Result<ChatStream> {
        let stream = self
            .client()
            .chat_stream(chat.into_wire()?)
            .await?
            .into_inner();
        Ok(Box::pin(stream.map(|event| event.map_err(Error::from))))
    }

    async fn embed(&self, request: pb::EmbedRequest) -> Result<pb::EmbedResponse> {
        Ok(self.client().embed(request).await?.into_inner())
    }

    async fn media(&self, request: pb::MediaRequest) -> Result<pb::MediaResponse> {
        Ok(self.client().media(request).await?.into_inner())
    }

    async fn media_stream(&self, request: pb::MediaRequest) -> Result<MediaStream> {
        let stream = self.client().media_stream(request).await?.into_inner();
        Ok(Box::pin(stream.map(|event| event.map_err(Error::from))))
    }

    async fn backends(&self) -> Result<pb::BackendsResponse> {
        Ok(self
            .client()
            .backends(pb::BackendsRequest {})
            .await?
            .into_inner())
    }
}
