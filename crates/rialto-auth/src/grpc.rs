//! Adapters between [`AuthService`](crate::AuthService) and tonic: the server
//! side exposes any client over gRPC; the remote side is a client that
//! implements the domain trait over a channel.

use async_trait::async_trait;
use rialto_core::Result;
use rialto_core::grpc_auth::{ClientToken, RemoteChannel, ServerToken};
use rialto_core::per_thread::PerThread;
use rialto_proto::auth::v1 as pb;
use rialto_proto::auth::v1::auth_client::AuthClient as GrpcClient;
use rialto_proto::auth::v1::auth_server::{Auth, AuthServer};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::{AuthClient, AuthService};

/// Serves a [`AuthClient`] over gRPC, behind the shared token.
pub fn server(
    client: AuthClient,
    token: ServerToken,
) -> InterceptedService<AuthServer<AuthGrpc>, ServerToken> {
    InterceptedService::new(AuthServer::new(AuthGrpc(client)), token)
}

pub struct AuthGrpc(AuthClient);

#[async_trait]
impl Auth for AuthGrpc {
    async fn authenticate(
        &self,
        request: Request<pb::AuthenticateRequest>,
    ) -> Result<Response<pb::Principal>, Status> {
        Ok(Response::new(
            self.0.authenticate(request.into_inner()).await?,
        ))
    }

    async fn create_account(
        &self,
        request: Request<pb::CreateAccountRequest>,
    ) -> Result<Response<pb::CreateAccountResponse>, Status> {
        Ok(Response::new(
            self.0.create_account(request.into_inner()).await?,
        ))
    }

    async fn create_api_key(
        &self,
        request: Request<pb::CreateApiKeyRequest>,
    ) -> Result<Response<pb::CreatedKey>, Status> {
        Ok(Response::new(
            self.0.create_api_key(request.into_inner()).await?,
        ))
    }

    async fn list_api_keys(
        &self,
        request: Request<pb::ListApiKeysRequest>,
    ) -> Result<Response<pb::ListApiKeysResponse>, Status> {
        Ok(Response::new(
            self.0.list_api_keys(request.into_inner()).await?,
        ))
    }

    async fn get_api_key(
        &self,
        request: Request<pb::GetApiKeyRequest>,
    ) -> Result<Response<pb::ApiKeyRecord>, Status> {
        Ok(Response::new(
            self.0.get_api_key(request.into_inner()).await?,
        ))
    }

    async fn delete_api_key(
        &self,
        request: Request<pb::DeleteApiKeyRequest>,
    ) -> Result<Response<pb::DeleteApiKeyResponse>, Status> {
        Ok(Response::new(
            self.0.delete_api_key(request.into_inner()).await?,
        ))
    }

    async fn update_api_key(
        &self,
        request: Request<pb::UpdateApiKeyRequest>,
    ) -> Result<Response<pb::ApiKeyRecord>, Status> {
        Ok(Response::new(
            self.0.update_api_key(request.into_inner()).await?,
        ))
    }

    async fn put_character_review(
        &self,
        request: Request<pb::PutCharacterReviewRequest>,
    ) -> Result<Response<pb::CharacterReview>, Status> {
        Ok(Response::new(
            self.0.put_character_review(request.into_inner()).await?,
        ))
    }

    async fn list_character_reviews(
        &self,
        request: Request<pb::ListCharacterReviewsRequest>,
    ) -> Result<Response<pb::ListCharacterReviewsResponse>, Status> {
        Ok(Response::new(
            self.0.list_character_reviews(request.into_inner()).await?,
        ))
    }

    async fn character_ratings(
        &self,
        request: Request<pb::CharacterRatingsRequest>,
    ) -> Result<Response<pb::CharacterRatingsResponse>, Status> {
        Ok(Response::new(
            self.0.character_ratings(request.into_inner()).await?,
        ))
    }

    async fn list_accounts(
        &self,
        request: Request<pb::ListAccountsRequest>,
    ) -> Result<Response<pb::ListAccountsResponse>, Status> {
        Ok(Response::new(
            self.0.list_accounts(request.into_inner()).await?,
        ))
    }

    async fn set_account_suspended(
        &self,
        request: Request<pb::SetAccountSuspendedRequest>,
    ) -> Result<Response<pb::Account>, Status> {
        Ok(Response::new(
            self.0.set_account_suspended(request.into_inner()).await?,
        ))
    }

    async fn create_web3_key(
        &self,
        request: Request<pb::CreateWeb3KeyRequest>,
    ) -> Result<Response<pb::CreatedKey>, Status> {
        Ok(Response::new(
            self.0.create_web3_key(request.into_inner()).await?,
        ))
    }

    async fn get_account(
        &self,
        request: Request<pb::GetAccountRequest>,
    ) -> Result<Response<pb::Account>, Status> {
        Ok(Response::new(
            self.0.get_account(request.into_inner()).await?,
        ))
    }

    async fn set_account_tier(
        &self,
        request: Request<pb::SetAccountTierRequest>,
    ) -> Result<Response<pb::Account>, Status> {
        Ok(Response::new(
            self.0.set_account_tier(request.into_inner()).await?,
        ))
    }

    async fn sign_in(
        &self,
        request: Request<pb::SignInRequest>,
    ) -> Result<Response<pb::SignInResponse>, Status> {
        Ok(Response::new(self.0.sign_in(request.into_inner()).await?))
    }

    async fn put_character(
        &self,
        request: Request<pb::Character>,
    ) -> Result<Response<pb::Character>, Status> {
        Ok(Response::new(
            self.0.put_character(request.into_inner()).await?,
        ))
    }

    async fn delete_character(
        &self,
        request: Request<pb::DeleteCharacterRequest>,
    ) -> Result<Response<pb::DeleteCharacterResponse>, Status> {
        Ok(Response::new(
            self.0.delete_character(request.into_inner()).await?,
        ))
    }

    async fn list_characters(
        &self,
        request: Request<pb::ListCharactersRequest>,
    ) -> Result<Response<pb::ListCharactersResponse>, Status> {
        Ok(Response::new(
            self.0.list_characters(request.into_inner()).await?,
        ))
    }
}

/// The auth service in another process, reached over gRPC.
pub struct RemoteAuth(RemoteChannel);

impl RemoteAuth {
    pub fn new(channel: impl Into<PerThread<Channel>>, token: ClientToken) -> Self {
        Self(RemoteChannel::new(channel, token))
    }

    /// A client on this thread's channel.
    fn client(&self) -> GrpcClient<InterceptedService<Channel, ClientToken>> {
        GrpcClient::new(self.0.here())
    }
}

#[async_trait]
impl AuthService for RemoteAuth {
    async fn authenticate(&self, request: pb::AuthenticateRequest) -> Result<pb::Principal> {
        Ok(self.client().authenticate(request).await?.into_inner())
    }

    async fn create_account(
        &self,
        request: pb::CreateAccountRequest,
    ) -> Result<pb::CreateAccountResponse> {
        Ok(self.client().create_account(request).await?.into_inner())
    }

    async fn create_api_key(&self, request: pb::CreateApiKeyRequest) -> Result<pb::CreatedKey> {
        Ok(self.client().create_api_key(request).await?.into_inner())
    }

    async fn list_api_keys(
        &self,
        request: pb::ListApiKeysRequest,
    ) -> Result<pb::ListApiKeysResponse> {
        Ok(self.client().list_api_keys(request).await?.into_inner())
    }

    async fn get_api_key(&self, request: pb::GetApiKeyRequest) -> Result<pb::ApiKeyRecord> {
        Ok(self.client().get_api_key(request).await?.into_inner())
    }

    async fn delete_api_key(
        &self,
        request: pb::DeleteApiKeyRequest,
    ) -> Result<pb::DeleteApiKeyResponse> {
        Ok(self.client().delete_api_key(request).await?.into_inner())
    }

    async fn update_api_key(&self, request: pb::UpdateApiKeyRequest) -> Result<pb::ApiKeyRecord> {
        Ok(self.client().update_api_key(request).await?.into_inner())
    }

    async fn create_web3_key(&self, request: pb::CreateWeb3KeyRequest) -> Result<pb::CreatedKey> {
        Ok(self.client().create_web3_key(request).await?.into_inner())
    }

    async fn list_accounts(
        &self,
        request: pb::ListAccountsRequest,
    ) -> Result<pb::ListAccountsResponse> {
        Ok(self.client().list_accounts(request).await?.into_inner())
    }

    async fn set_account_suspended(
        &self,
        request: pb::SetAccountSuspendedRequest,
    ) -> Result<pb::Account> {
        Ok(self
            .client()
            .set_account_suspended(request)
            .await?
            .into_inner())
    }

    async fn put_character_review(
        &self,
        request: pb::PutCharacterReviewRequest,
    ) -> Result<pb::CharacterReview> {
        Ok(self
            .client()
            .put_character_review(request)
            .await?
            .into_inner())
    }

    async fn list_character_reviews(
        &self,
        request: pb::ListCharacterReviewsRequest,
    ) -> Result<pb::ListCharacterReviewsResponse> {
        Ok(self
            .client()
            .list_character_reviews(request)
            .await?
            .into_inner())
    }

    async fn character_ratings(
        &self,
        request: pb::CharacterRatingsRequest,
    ) -> Result<pb::CharacterRatingsResponse> {
        Ok(self.client().character_ratings(request).await?.into_inner())
    }

    async fn get_account(&self, request: pb::GetAccountRequest) -> Result<pb::Account> {
        Ok(self.client().get_account(request).await?.into_inner())
    }

    async fn set_account_tier(&self, request: pb::SetAccountTierRequest) -> Result<pb::Account> {
        Ok(self.client().set_account_tier(request).await?.into_inner())
    }

    async fn sign_in(&self, request: pb::SignInRequest) -> Result<pb::SignInResponse> {
        Ok(self.client().sign_in(request).await?.into_inner())
    }

    async fn put_character(&self, request: pb::Character) -> Result<pb::Character> {
        Ok(self.client().put_character(request).await?.into_inner())
    }

    async fn delete_character(
        &self,
        request: pb::DeleteCharacterRequest,
    ) -> Result<pb::DeleteCharacterResponse> {
        Ok(self.client().delete_character(request).await?.into_inner())
    }

    async fn list_characters(
        &self,
        request: pb::ListCharactersRequest,
    ) -> Result<pb::ListCharactersResponse> {
        Ok(self.client().list_characters(request).await?.into_inner())
    }
}
