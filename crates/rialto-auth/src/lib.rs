//! The auth service: accounts and API keys (wallet sign-in comes later).
//!
//! [`AuthService`] is the domain interface; [`AuthClient`] is what callers
//! hold, built either from [`LocalAuth`] (in-process) or from a gRPC channel
//! ([`grpc::RemoteAuth`]). Only the binary's wiring knows which. A gateway
//! whose auth service is remote wraps it in [`CachedAuth`], which answers
//! the authentications of the last second from memory.
//!
//! Invariants:
//! - A secret is returned once, on creation, and stored only as its SHA-256.
//!   Lookup is by hash; the stored hash is compared in constant time.
//! - A deleted key is refused on the very next request: deletion purges the
//!   in-memory cache, and a lookup racing a deletion never re-fills it.

use std::sync::Arc;

use async_trait::async_trait;
use rialto_core::Result;
use rialto_proto::auth::v1 as pb;

mod cached;
pub mod grpc;
mod local;
mod revocation;
pub mod siwx;
pub mod web3;

pub use cached::{CachedAuth, DEFAULT_CAPACITY, PRINCIPAL_TTL};
pub use local::{LocalAuth, MODEL_PRIVACY, wallet_account_id};
pub use pb::KeyType;

/// The auth service in domain terms.
#[async_trait]
pub trait AuthService: Send + Sync + 'static {
    /// Resolves a bearer secret to its principal; `Unauthenticated` otherwise.
    async fn authenticate(&self, request: pb::AuthenticateRequest) -> Result<pb::Principal>;
    async fn create_account(
        &self,
        request: pb::CreateAccountRequest,
    ) -> Result<pb::CreateAccountResponse>;
    async fn create_api_key(&self, request: pb::CreateApiKeyRequest) -> Result<pb::CreatedKey>;
    async fn list_api_keys(
        &self,
        request: pb::ListApiKeysRequest,
    ) -> Result<pb::ListApiKeysResponse>;
    async fn get_api_key(&self, request: pb::GetApiKeyRequest) -> Result<pb::ApiKeyRecord>;
    async fn delete_api_key(
        &self,
        request: pb::DeleteApiKeyRequest,
    ) -> Result<pb::DeleteApiKeyResponse>;
    /// Sets a key's description, expiry, cap and model privacy; every
    /// cache of it is dropped at once.
    async fn update_api_key(&self, request: pb::UpdateApiKeyRequest) -> Result<pb::ApiKeyRecord>;
    /// A key for the wallet that signed a token of [`web3::issue_token`],
    /// in the wallet's account; a token is good for one key.
    async fn create_web3_key(&self, request: pb::CreateWeb3KeyRequest) -> Result<pb::CreatedKey>;
    /// The account, or NotFound.
    async fn get_account(&self, request: pb::GetAccountRequest) -> Result<pb::Account>;
    /// Changes the account's rate-limit tier; its keys see it at once here
    /// and within the cache's re-check on other auth replicas.
    async fn set_account_tier(&self, request: pb::SetAccountTierRequest) -> Result<pb::Account>;
    /// Accounts a page at a time, newest first, found by name or id.
    async fn list_accounts(
        &self,
        request: pb::ListAccountsRequest,
    ) -> Result<pb::ListAccountsResponse>;
    /// Suspends (its keys stop authenticating, everywhere at once) or
    /// resumes an account.
    async fn set_account_suspended(
        &self,
        request: pb::SetAccountSuspendedRequest,
    ) -> Result<pb::Account>;
    /// Verifies a Sign-In-With-X header and consumes its nonce; a refusal is
    /// an answer (with its code), not an error.
    async fn sign_in(&self, request: pb::SignInRequest) -> Result<pb::SignInResponse>;
    /// Creates or replaces a stored character.
    async fn put_character(&self, request: pb::Character) -> Result<pb::Character>;
    /// Deletes a stored character; NotFound when there is none.
    async fn delete_character(
        &self,
        request: pb::DeleteCharacterRequest,
    ) -> Result<pb::DeleteCharacterResponse>;
    async fn list_characters(
        &self,
        request: pb::ListCharactersRequest,
    ) -> Result<pb::ListCharactersResponse>;
    /// Creates or replaces the account's review of a character.
    async fn put_character_review(
        &self,
        request: pb::PutCharacterReviewRequest,
    ) -> Result<pb::CharacterReview>;
    /// A page of a character's reviews, newest first, and their totals.
    async fn list_character_reviews(
        &self,
        request: pb::ListCharacterReviewsRequest,
    ) -> Result<pb::ListCharacterReviewsResponse>;
    /// Every reviewed character's count and sum of ratings.
    async fn character_ratings(
        &self,
        request: pb::CharacterRatingsRequest,
    ) -> Result<pb::CharacterRatingsResponse>;
}

/// A cloneable handle on the auth service, local or remote.
#[derive(Clone)]
pub struct AuthClient(Arc<dyn AuthService>);

impl AuthClient {
    pub fn new(service: impl AuthService) -> Self {
        Self(Arc::new(service))
    }
}

impl std::ops::Deref for AuthClient {
    type Target = dyn AuthService;

    fn deref(&self) -> &Self::Target {
        self.0.as_ref()
    }
}

impl std::fmt::Debug for AuthClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthClient")
    }
}
