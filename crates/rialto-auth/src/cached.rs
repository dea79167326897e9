//! A cache of authenticated principals in front of another [`AuthClient`]:
//! what a gateway whose auth service runs in another process holds, so a
//! request whose key was authenticated within the last [`PRINCIPAL_TTL`]
//! makes no Authenticate call.
//!
//! - Only successes are cached, keyed by the SHA-256 of the secret (the
//!   secret itself is neither kept nor logged); a refusal is asked again
//!   every time, so a key created a moment ago works at once.
//! - An entry is trusted for [`PRINCIPAL_TTL`] from the moment the lookup
//!   that filled it *began*, so whatever the inner service knew then is at
//!   most that old when it is used.
//! - Deleting a key or changing an account's tier through this client drops
//!   the affected entries at once; the same changes made elsewhere arrive as
//!   revocation events on the bus ([`CachedAuth::with_revocations`]) and
//!   drop them on arrival, or, when no event arrives, the entries simply
//!   expire with their time to live.
//! - Every revocation bumps a generation counter; a lookup that began before
//!   a revocation does not put what it read into the cache (it may have read
//!   what was just revoked).
//! - Wallet sign-ins and every other method pass through (a sign-in nonce is
//!   single-use: it is never answered from a cache).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use rialto_core::{Error, Result};
use rialto_proto::auth::v1 as pb;
use tokio::time::Instant;

use crate::local::{SecretHash, hash, plausible_secret};
use crate::revocation::Revocation;
use crate::{AuthClient, AuthService};

/// How long a cached principal is trusted after the lookup that filled it
/// began. Bounds how long a key deleted elsewhere keeps working on this
/// client when the revocation event does not arrive.
pub const PRINCIPAL_TTL: Duration = Duration::from_secs(1);

/// Most principals cached at once by [`CachedAuth::new`] (a few hundred
/// bytes each). Past it, new keys are not cached until expired entries are
/// swept: they are authenticated by the inner service every time.
pub const DEFAULT_CAPACITY: usize = 100_000;

/// [`AuthService`] with the authentications of the last second answered
/// from memory; see the module documentation.
pub struct CachedAuth {
    inner: AuthClient,
    cache: Arc<Cache>,
}

struct Cache {
    entries: RwLock<Entries>,
    /// Bumped by every revocation; a lookup that began before one must not
    /// fill the cache.
    generation: AtomicU64,
    capacity: usize,
}

struct Entries {
    map: HashMap<SecretHash, Entry>,
    /// When expired entries are next swept out (on a fill).
    next_sweep: Instant,
}

struct Entry {
    principal: pb::Principal,
    /// When the lookup that read it began.
    started: Instant,
}

impl CachedAuth {
    /// Caches up to [`DEFAULT_CAPACITY`] principals of `inner`.
    pub fn new(inner: AuthClient) -> Self {
        Self::with_capacity(inner, DEFAULT_CAPACITY)
    }

    /// Caches up to `capacity` principals of `inner`.
    pub fn with_capacity(inner: AuthClient, capacity: usize) -> Self {
        Self {
            inner,
            cache: Arc::new(Cache {
                entries: RwLock::new(Entries {
                    map: HashMap::new(),
                    next_sweep: Instant::now() + PRINCIPAL_TTL,
                }),
                generation: AtomicU64::new(0),
                capacity,
            }),
        }
    }

    /// Drops the principals that auth replicas revoke on `bus` (subject
    /// `<prefix>.auth.revocations`) as soon as each event arrives, so a key
    /// deleted anywhere stops here at once rather than within
    /// [`PRINCIPAL_TTL`] (needs a Tokio runtime).
    pub fn with_revocations(self, bus: rialto_core::bus::Bus) -> Self {
        crate::revocation::listen(&bus, Arc::downgrade(&self.cache), Cache::revoke);
        self
    }
}

impl Cache {
    /// The principal of `digest`, if a lookup that began less than
    /// [`PRINCIPAL_TTL`] ago read it.
    fn get(&self, digest: &SecretHash) -> Option<pb::Principal> {
        let entries = self.entries.read().unwrap_or_else(|p| p.into_inner());
        entries
            .map
            .get(digest)
            .filter(|entry| entry.started.elapsed() < PRINCIPAL_TTL)
            .map(|entry| entry.principal.clone())
    }

    /// Caches what a lookup that began at `started`, under `generation`,
    /// read; nothing when a revocation came since.
    fn fill(
        &self,
        digest: SecretHash,
        principal: &pb::Principal,
        generation: u64,
        started: Instant,
    ) {
        let now = Instant::now();
        if now.saturating_duration_since(started) >= PRINCIPAL_TTL {
            return;
        }
        let mut entries = self.entries.write().unwrap_or_else(|p| p.into_inner());
        // Checked under the write lock: a revocation bumps the generation
        // before it purges, so either we see the bump or it sees our entry.
        if self.generation.load(Ordering::Acquire) != generation {
            return;
        }
        if now >= entries.next_sweep {
            entries
                .map
                .retain(|_, entry| now.saturating_duration_since(entry.started) < PRINCIPAL_TTL);
            entries.next_sweep = now + PRINCIPAL_TTL;
        }
        match entries.map.get(&digest) {
            // A lookup that began later already answered.
            Some(entry) if entry.started >= started => return,
            Some(_) => {}
            // Full of live entries: this key waits for the next sweep.
            None if entries.map.len() >= self.capacity => return,
            None => {}
        }
        entries.map.insert(
            digest,
            Entry {
                principal: principal.clone(),
                started,
            },
        );
    }

    fn revoke(&self, revocation: &Revocation) {
        // A lookup in flight must not put back what was revoked.
        self.generation.fetch_add(1, Ordering::AcqRel);
        let mut entries = self.entries.write().unwrap_or_else(|p| p.into_inner());
        entries.map.retain(|_, entry| {
            !revocation.covers(&entry.principal.key_id, &entry.principal.account_id)
        });
    }
}

#[async_trait]
impl AuthService for CachedAuth {
    async fn authenticate(&self, request: pb::AuthenticateRequest) -> Result<pb::Principal> {
        // What the auth service would refuse without a query, refused
        // without a call.
        if !plausible_secret(&request.api_key) {
            return Err(Error::unauthenticated());
        }
        let digest = hash(&request.api_key);
        if let Some(principal) = self.cache.get(&digest) {
            return Ok(principal);
        }
        let generation = self.cache.generation.load(Ordering::Acquire);
        let started = Instant::now();
        let principal = self.inner.authenticate(request).await?;
        self.cache.fill(digest, &principal, generation, started);
        Ok(principal)
    }

    async fn create_account(
        &self,
        request: pb::CreateAccountRequest,
    ) -> Result<pb::CreateAccountResponse> {
        self.inner.create_account(request).await
    }

    async fn create_api_key(&self, request: pb::CreateApiKeyRequest) -> Result<pb::CreatedKey> {
        self.inner.create_api_key(request).await
    }

    async fn list_api_keys(
        &self,
        request: pb::ListApiKeysRequest,
    ) -> Result<pb::ListApiKeysResponse> {
        self.inner.list_api_keys(request).await
    }

    async fn get_api_key(&self, request: pb::GetApiKeyRequest) -> Result<pb::ApiKeyRecord> {
        self.inner.get_api_key(request).await
    }

    async fn delete_api_key(
        &self,
        request: pb::DeleteApiKeyRequest,
    ) -> Result<pb::DeleteApiKeyResponse> {
        let revocation = Revocation::Key(request.id.clone());
        let deleted = self.inner.delete_api_key(request).await;
        // Whatever the answer (a timeout may hide a deletion): the next
        // request asks again.
        self.cache.revoke(&revocation);
        deleted
    }

    async fn update_api_key(&self, request: pb::UpdateApiKeyRequest) -> Result<pb::ApiKeyRecord> {
        let revocation = Revocation::Key(request.id.clone());
        let updated = self.inner.update_api_key(request).await;
        // As for a deletion: whatever the answer, the next request asks.
        self.cache.revoke(&revocation);
        updated
    }

    async fn create_web3_key(&self, request: pb::CreateWeb3KeyRequest) -> Result<pb::CreatedKey> {
        self.inner.create_web3_key(request).await
    }

    async fn list_accounts(
        &self,
        request: pb::ListAccountsRequest,
    ) -> Result<pb::ListAccountsResponse> {
        self.inner.list_accounts(request).await
    }

    async fn set_account_suspended(
        &self,
        request: pb::SetAccountSuspendedRequest,
    ) -> Result<pb::Account> {
        // Cached principals of its keys: as for a deletion, the next
        // request asks again.
        let revocation = Revocation::Account(request.account_id.clone());
        let changed = self.inner.set_account_suspended(request).await;
        self.cache.revoke(&revocation);
        changed
    }

    async fn put_character_review(
        &self,
        request: pb::PutCharacterReviewRequest,
    ) -> Result<pb::CharacterReview> {
        self.inner.put_character_review(request).await
    }

    async fn list_character_reviews(
        &self,
        request: pb::ListCharacterReviewsRequest,
    ) -> Result<pb::ListCharacterReviewsResponse> {
        self.inner.list_character_reviews(request).await
    }

    async fn character_ratings(
        &self,
        request: pb::CharacterRatingsRequest,
    ) -> Result<pb::CharacterRatingsResponse> {
        self.inner.character_ratings(request).await
    }

    async fn get_account(&self, request: pb::GetAccountRequest) -> Result<pb::Account> {
        self.inner.get_account(request).await
    }

    async fn set_account_tier(&self, request: pb::SetAccountTierRequest) -> Result<pb::Account> {
        // Cached principals carry the tier.
        let revocation = Revocation::Account(request.account_id.clone());
        let set = self.inner.set_account_tier(request).await;
        self.cache.revoke(&revocation);
        set
    }

    async fn sign_in(&self, request: pb::SignInRequest) -> Result<pb::SignInResponse> {
        self.inner.sign_in(request).await
    }

    async fn put_character(&self, request: pb::Character) -> Result<pb::Character> {
        self.inner.put_character(request).await
    }

    async fn delete_character(
        &self,
        request: pb::DeleteCharacterRequest,
    ) -> Result<pb::DeleteCharacterResponse> {
        self.inner.delete_character(request).await
    }

    async fn list_characters(
        &self,
        request: pb::ListCharactersRequest,
    ) -> Result<pb::ListCharactersResponse> {
        self.inner.list_characters(request).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::AtomicUsize;

    use rialto_core::ErrorCode;
    use tokio::sync::Notify;

    use super::*;

    const SECRET: &str = "RIALTO_INFERENCE_KEY_abcdefghijklmnopqrstuvwxyz";
    const OTHER: &str = "RIALTO_INFERENCE_KEY_zyxwvutsrqponmlkjihgfedcba";

    /// An inner auth service that counts its calls: secrets map to
    /// principals, lookups take `delay` and, when `gated`, wait for
    /// `release` after announcing themselves on `entered`.
    #[derive(Default)]
    struct Fake {
        keys: Mutex<HashMap<String, pb::Principal>>,
        authentications: AtomicUsize,
        sign_ins: AtomicUsize,
        delay: Duration,
        gated: bool,
        entered: Notify,
        release: Notify,
    }

    impl Fake {
        fn with_key(self, secret: &str, key_id: &str, account_id: &str) -> Self {
            self.add_key(secret, key_id, account_id);
            self
        }

        fn add_key(&self, secret: &str, key_id: &str, account_id: &str) {
            self.keys.lock().unwrap().insert(
                secret.to_owned(),
                pb::Principal {
                    account_id: account_id.to_owned(),
                    key_id: key_id.to_owned(),
                    key_type: pb::KeyType::Inference as i32,
                    tier: "standard".to_owned(),
                    key_limit: None,
                    wallet: String::new(),
                    model_privacy: String::new(),
                },
            );
        }

        fn calls(&self) -> usize {
            self.authentications.load(Ordering::SeqCst)
        }
    }

    struct Shared(Arc<Fake>);

    fn unused<T>() -> Result<T> {
        Err(Error::new(ErrorCode::Internal, "not used by these tests"))
    }

    #[async_trait]
    impl AuthService for Shared {
        async fn authenticate(&self, request: pb::AuthenticateRequest) -> Result<pb::Principal> {
            let fake = &self.0;
            fake.authentications.fetch_add(1, Ordering::SeqCst);
            // What it answers is read at the start of the lookup.
            let found = fake.keys.lock().unwrap().get(&request.api_key).cloned();
            if fake.gated {
                fake.entered.notify_one();
                fake.release.notified().await;
            }
            tokio::time::sleep(fake.delay).await;
            found.ok_or_else(Error::unauthenticated)
        }
        async fn create_account(
            &self,
            _: pb::CreateAccountRequest,
        ) -> Result<pb::CreateAccountResponse> {
            unused()
        }
        async fn create_api_key(&self, _: pb::CreateApiKeyRequest) -> Result<pb::CreatedKey> {
            unused()
        }
        async fn list_api_keys(
            &self,
            _: pb::ListApiKeysRequest,
        ) -> Result<pb::ListApiKeysResponse> {
            unused()
        }
        async fn get_api_key(&self, _: pb::GetApiKeyRequest) -> Result<pb::ApiKeyRecord> {
            unused()
        }
        async fn delete_api_key(
            &self,
            request: pb::DeleteApiKeyRequest,
        ) -> Result<pb::DeleteApiKeyResponse> {
            self.0
                .keys
                .lock()
                .unwrap()
                .retain(|_, principal| principal.key_id != request.id);
            Ok(pb::DeleteApiKeyResponse {})
        }
        async fn update_api_key(&self, _: pb::UpdateApiKeyRequest) -> Result<pb::ApiKeyRecord> {
            unused()
        }
        async fn create_web3_key(&self, _: pb::CreateWeb3KeyRequest) -> Result<pb::CreatedKey> {
            unused()
        }
        async fn list_accounts(
            &self,
            _: pb::ListAccountsRequest,
        ) -> Result<pb::ListAccountsResponse> {
            unused()
        }
        async fn set_account_suspended(
            &self,
            _: pb::SetAccountSuspendedRequest,
        ) -> Result<pb::Account> {
            unused()
        }
        async fn put_character_review(
            &self,
            _: pb::PutCharacterReviewRequest,
        ) -> Result<pb::CharacterReview> {
            unused()
        }
        async fn list_character_reviews(
            &self,
            _: pb::ListCharacterReviewsRequest,
        ) -> Result<pb::ListCharacterReviewsResponse> {
            unused()
        }
        async fn character_ratings(
            &self,
            _: pb::CharacterRatingsRequest,
        ) -> Result<pb::CharacterRatingsResponse> {
            unused()
        }
        async fn get_account(&self, _: pb::GetAccountRequest) -> Result<pb::Account> {
            unused()
        }
        async fn set_account_tier(
            &self,
            request: pb::SetAccountTierRequest,
        ) -> Result<pb::Account> {
            for principal in self.0.keys.lock().unwrap().values_mut() {
                if principal.account_id == request.account_id {
                    principal.tier.clone_from(&request.tier);
                }
            }
            Ok(pb::Account {
                id: request.account_id,
                tier: request.tier,
                ..Default::default()
            })
        }
        async fn sign_in(&self, _: pb::SignInRequest) -> Result<pb::SignInResponse> {
            self.0.sign_ins.fetch_add(1, Ordering::SeqCst);
            Ok(pb::SignInResponse::default())
        }
        async fn put_character(&self, _: pb::Character) -> Result<pb::Character> {
            unused()
        }
        async fn delete_character(
            &self,
            _: pb::DeleteCharacterRequest,
        ) -> Result<pb::DeleteCharacterResponse> {
            unused()
        }
        async fn list_characters(
            &self,
            _: pb::ListCharactersRequest,
        ) -> Result<pb::ListCharactersResponse> {
            unused()
        }
    }

    fn cached(fake: Fake) -> (Arc<Fake>, CachedAuth) {
        let fake = Arc::new(fake);
        let auth = CachedAuth::new(AuthClient::new(Shared(fake.clone())));
        (fake, auth)
    }

    fn authn(secret: &str) -> pb::AuthenticateRequest {
        pb::AuthenticateRequest {
            api_key: secret.to_owned(),
        }
    }

    fn cached_len(auth: &CachedAuth) -> usize {
        auth.cache.entries.read().unwrap().map.len()
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_seen_within_a_second_makes_no_call() {
        let (fake, auth) = cached(Fake::default().with_key(SECRET, "k1", "a1"));
        let first = auth.authenticate(authn(SECRET)).await.unwrap();
        assert_eq!(first.key_id, "k1");
        assert_eq!(fake.calls(), 1);
        tokio::time::advance(Duration::from_millis(900)).await;
        for _ in 0..10 {
            assert_eq!(auth.authenticate(authn(SECRET)).await.unwrap(), first);
        }
        assert_eq!(fake.calls(), 1, "answered from the cache");
        // Keys are cached each under their own secret.
        let (fake, auth) = cached(
            Fake::default()
                .with_key(SECRET, "k1", "a1")
                .with_key(OTHER, "k2", "a1"),
        );
        assert_eq!(auth.authenticate(authn(SECRET)).await.unwrap().key_id, "k1");
        assert_eq!(auth.authenticate(authn(OTHER)).await.unwrap().key_id, "k2");
        assert_eq!(auth.authenticate(authn(SECRET)).await.unwrap().key_id, "k1");
        assert_eq!(fake.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_entry_expires_a_second_after_its_lookup_began() {
        // The lookup takes 600 ms: the entry is a second old 400 ms after
        // it was filled, not a second after.
        let (fake, auth) = cached(Fake {
            delay: Duration::from_millis(600),
            ..Fake::default().with_key(SECRET, "k1", "a1")
        });
        auth.authenticate(authn(SECRET)).await.unwrap();
        assert_eq!(fake.calls(), 1);
        tokio::time::advance(Duration::from_millis(350)).await;
        auth.authenticate(authn(SECRET)).await.unwrap();
        assert_eq!(fake.calls(), 1, "950 ms after the lookup began");
        tokio::time::advance(Duration::from_millis(100)).await;
        auth.authenticate(authn(SECRET)).await.unwrap();
        assert_eq!(fake.calls(), 2, "1,050 ms after the lookup began");
        // A key deleted behind the cache's back is refused once its entry
        // expired.
        fake.keys.lock().unwrap().clear();
        tokio::time::advance(PRINCIPAL_TTL).await;
        assert_eq!(
            auth.authenticate(authn(SECRET)).await.unwrap_err().code,
            ErrorCode::Unauthenticated
        );
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_are_not_cached() {
        let (fake, auth) = cached(Fake::default());
        let refused = auth.authenticate(authn(SECRET)).await.unwrap_err();
        assert_eq!(refused.code, ErrorCode::Unauthenticated);
        // The key is created a moment later: it works at once.
        fake.add_key(SECRET, "k1", "a1");
        assert_eq!(auth.authenticate(authn(SECRET)).await.unwrap().key_id, "k1");
        assert_eq!(fake.calls(), 2);
        // What cannot be a key is refused without a call.
        for garbage in ["", "short", "RIALTO_INFERENCE_KEY_not a key at all"] {
            let refused = auth.authenticate(authn(garbage)).await.unwrap_err();
            assert_eq!(refused.code, ErrorCode::Unauthenticated);
        }
        assert_eq!(fake.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn changes_through_the_cache_drop_what_they_change() {
        let (fake, auth) = cached(
            Fake::default()
                .with_key(SECRET, "k1", "a1")
                .with_key(OTHER, "k2", "a2"),
        );
        auth.authenticate(authn(SECRET)).await.unwrap();
        auth.authenticate(authn(OTHER)).await.unwrap();
        assert_eq!(fake.calls(), 2);
        // A tier change: the account's keys are read again, with it.
        auth.set_account_tier(pb::SetAccountTierRequest {
            account_id: "a1".into(),
            tier: "partner".into(),
        })
        .await
        .unwrap();
        assert_eq!(
            auth.authenticate(authn(SECRET)).await.unwrap().tier,
            "partner"
        );
        assert_eq!(fake.calls(), 3);
        auth.authenticate(authn(OTHER)).await.unwrap();
        assert_eq!(fake.calls(), 3, "another account's key stays cached");
        // A deletion: refused on the very next request.
        auth.delete_api_key(pb::DeleteApiKeyRequest {
            account_id: "a1".into(),
            id: "k1".into(),
        })
        .await
        .unwrap();
        assert!(auth.authenticate(authn(SECRET)).await.is_err());
        auth.authenticate(authn(OTHER)).await.unwrap();
        assert_eq!(fake.calls(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_revocation_event_drops_the_entry() {
        let bus = rialto_core::bus::Bus::in_process("test");
        let (fake, auth) = cached(
            Fake::default()
                .with_key(SECRET, "k1", "a1")
                .with_key(OTHER, "k2", "a2"),
        );
        let auth = auth.with_revocations(bus.clone());
        // The listener subscribes.
        tokio::time::sleep(Duration::from_millis(1)).await;
        let began = Instant::now();
        auth.authenticate(authn(SECRET)).await.unwrap();
        auth.authenticate(authn(OTHER)).await.unwrap();
        assert_eq!(fake.calls(), 2);
        // Another auth replica deletes k1 and announces it.
        fake.keys.lock().unwrap().remove(SECRET);
        let publish = |revocation: Revocation| {
            let bus = bus.clone();
            async move {
                let payload = serde_json::to_vec(&revocation).unwrap();
                bus.publish(
                    bus.subject(crate::revocation::REVOCATIONS_SUBJECT),
                    payload.into(),
                )
                .await
                .unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        publish(Revocation::Key("k1".into())).await;
        // Refused long before the entry would have expired.
        assert!(auth.authenticate(authn(SECRET)).await.is_err());
        assert_eq!(fake.calls(), 3);
        auth.authenticate(authn(OTHER)).await.unwrap();
        assert_eq!(fake.calls(), 3, "k2 is untouched");
        // An account's revocation drops every key of it.
        publish(Revocation::Account("a2".into())).await;
        auth.authenticate(authn(OTHER)).await.unwrap();
        assert_eq!(fake.calls(), 4);
        assert!(
            began.elapsed() < PRINCIPAL_TTL,
            "all of it inside the time to live"
        );
        // The format is local.rs's: {"key": id} / {"account": id}.
        assert_eq!(
            serde_json::to_string(&Revocation::Key("k1".into())).unwrap(),
            r#"{"key":"k1"}"#
        );
    }

    /// A lookup that read the key before its revocation and answers after it
    /// must not put the key back into the cache.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lookup_racing_a_revocation_does_not_refill() {
        for through_bus in [false, true] {
            let bus = rialto_core::bus::Bus::in_process("test");
            let (fake, auth) = cached(Fake {
                gated: true,
                ..Fake::default().with_key(SECRET, "k1", "a1")
            });
            let auth = Arc::new(auth.with_revocations(bus.clone()));
            tokio::time::sleep(Duration::from_millis(20)).await;
            let lookup = tokio::spawn({
                let auth = auth.clone();
                async move { auth.authenticate(authn(SECRET)).await }
            });
            // The inner service has read the key...
            fake.entered.notified().await;
            // ...then it is deleted and revoked...
            fake.keys.lock().unwrap().clear();
            if through_bus {
                let payload = serde_json::to_vec(&Revocation::Key("k1".into())).unwrap();
                bus.publish(
                    bus.subject(crate::revocation::REVOCATIONS_SUBJECT),
                    payload.into(),
                )
                .await
                .unwrap();
                let generation = || auth.cache.generation.load(Ordering::SeqCst);
                while generation() == 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            } else {
                auth.delete_api_key(pb::DeleteApiKeyRequest {
                    account_id: "a1".into(),
                    id: "k1".into(),
                })
                .await
                .unwrap();
            }
            // ...and then the lookup answers with what it read.
            fake.release.notify_one();
            assert_eq!(lookup.await.unwrap().unwrap().key_id, "k1");
            assert_eq!(cached_len(&auth), 0, "the old read did not fill the cache");
            fake.release.notify_one();
            assert!(auth.authenticate(authn(SECRET)).await.is_err());
            assert_eq!(fake.calls(), 2);
        }
        // Without a revocation the same lookup fills it.
        let (fake, auth) = cached(Fake {
            gated: true,
            ..Fake::default().with_key(SECRET, "k1", "a1")
        });
        fake.release.notify_one();
        auth.authenticate(authn(SECRET)).await.unwrap();
        auth.authenticate(authn(SECRET)).await.unwrap();
        assert_eq!(fake.calls(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn sign_ins_always_pass_through() {
        let (fake, auth) = cached(Fake::default());
        for _ in 0..3 {
            auth.sign_in(pb::SignInRequest {
                header: "the same header".into(),
            })
            .await
            .unwrap();
        }
        assert_eq!(fake.sign_ins.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn the_cache_is_bounded() {
        let fake = Arc::new(Fake::default());
        let auth = CachedAuth::with_capacity(AuthClient::new(Shared(fake.clone())), 2);
        let secrets: Vec<String> = (0..4).map(|i| format!("{SECRET}{i}")).collect();
        for (i, secret) in secrets.iter().enumerate() {
            fake.add_key(secret, &format!("k{i}"), "a1");
            auth.authenticate(authn(secret)).await.unwrap();
        }
        assert_eq!(cached_len(&auth), 2);
        // The keys past the bound still authenticate, through the inner
        // service.
        auth.authenticate(authn(&secrets[3])).await.unwrap();
        assert_eq!(fake.calls(), 5);
        // Once the first entries expired, they make room.
        tokio::time::advance(PRINCIPAL_TTL).await;
        auth.authenticate(authn(&secrets[3])).await.unwrap();
        auth.authenticate(authn(&secrets[3])).await.unwrap();
        assert_eq!(fake.calls(), 6);
        assert_eq!(cached_len(&auth), 1);
    }
}
