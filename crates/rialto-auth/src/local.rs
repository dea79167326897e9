//! The auth service backed by the database, with an in-memory cache of
//! authenticated keys so the request path makes no database round trip.
//!
//! A cached key is trusted for [`KEY_RECHECK`] after the read that last
//! confirmed it began. A background task re-reads every key used in the last
//! [`KEEP_WARM`], all in one query per pass, every [`RECHECK_PASS`]: it
//! refreshes what changed (tier, spending cap, expiry) and drops what was
//! deleted or expired, so a key in use never waits for its re-check. Only a
//! key not in the cache (new, idle past [`KEEP_WARM`], revoked) or one the
//! passes failed to confirm in time (the database slow or down) is read on
//! the request path; that fallback is what makes the bound hold whatever
//! the background task does.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rialto_core::db::{Database, now_ms};
use rialto_core::{Error, ErrorCode, Result};
use rialto_proto::auth::v1 as pb;
use sha2::{Digest, Sha256};
use sqlx::Row;
use subtle::ConstantTimeEq;

use crate::AuthService;
use crate::revocation::{REVOCATIONS_SUBJECT, Revocation};

/// The SHA-256 of a secret: what keys are stored and cached by.
pub(crate) type SecretHash = [u8; 32];

/// How often buffered `last_used_at` times are written to the database.
const LAST_USED_FLUSH: Duration = Duration::from_secs(5);
/// How long a cached key is trusted after the read that confirmed it began.
/// This bounds how long a key deleted through *another* auth replica keeps
/// working when the revocation event does not arrive; deletions through this
/// replica take effect at once.
const KEY_RECHECK: Duration = Duration::from_secs(1);
/// How often the background pass re-reads the cached keys in use: well inside
/// [`KEY_RECHECK`], so a pass (one query) has half a second to finish before
/// a request would have to read the key itself.
const RECHECK_PASS: Duration = Duration::from_millis(500);
/// A key unused this long leaves the cache (and the passes); its next
/// request reads it again.
const KEEP_WARM: Duration = Duration::from_secs(60);
/// Most keys re-read by one statement; statements are built for powers of two
/// up to this, so a handful of them are prepared.
const RECHECK_BATCH: usize = 256;

pub struct LocalAuth {
    inner: Arc<Inner>,
    /// Where revocations are announced to the other auth replicas.
    revocations: Option<rialto_core::bus::Bus>,
    /// What wallet sign-ins must match, and their rate-limit tier.
    wallets: crate::siwx::SiwxPolicy,
    wallet_tier: String,
}

struct Inner {
    db: Database,
    /// `<BRAND>` prefix of new secrets.
    key_prefix: String,
    cache: RwLock<HashMap<SecretHash, CachedKey>>,
    /// Bumped by every deletion; a lookup that started before a deletion
    /// must not put what it read into the cache.
    generation: AtomicU64,
    /// key id -> last use of keys that left the cache before their use was
    /// flushed (uses of cached keys live in their entries).
    last_used: Mutex<HashMap<String, i64>>,
    /// Lookups made on the request path (a key not in the cache, or not
    /// confirmed in time): what the background passes are there to avoid.
    request_path_reads: AtomicU64,
}

struct CachedKey {
    principal: pb::Principal,
    expires_at_ms: Option<i64>,
    /// When the read that last confirmed the key began.
    checked_at: Instant,
    /// Shared by the entry's versions (a refresh, a reload).
    usage: Arc<KeyUse>,
}

/// A cached key's use: set by each request with one atomic update (none when
/// it already holds this millisecond), no lock; written to `last_used_at_ms`
/// every [`LAST_USED_FLUSH`].
struct KeyUse {
    key_id: String,
    last_used_ms: AtomicI64,
    flushed_ms: AtomicI64,
}

impl KeyUse {
    fn new(key_id: String) -> Self {
        Self {
            key_id,
            last_used_ms: AtomicI64::new(0),
            flushed_ms: AtomicI64::new(0),
        }
    }

    /// Records a use at `now` (Unix milliseconds).
    fn used(&self, now: i64) {
        if self.last_used_ms.load(Ordering::Relaxed) < now {
            self.last_used_ms.fetch_max(now, Ordering::AcqRel);
        }
    }

    /// The last use not yet written, if any, marking it written.
    fn take_unflushed(&self) -> Option<i64> {
        let used = self.last_used_ms.load(Ordering::Acquire);
        (self.flushed_ms.fetch_max(used, Ordering::AcqRel) < used).then_some(used)
    }
}

/// What one background pass read: the keys it asked for, and those found.
struct Recheck {
    generation: u64,
    started: Instant,
    asked: Vec<SecretHash>,
    found: HashMap<SecretHash, (pb::Principal, Option<i64>)>,
}

/// Whether a presented secret could be one of ours at all: keys are
/// `<BRAND>_<TYPE>_KEY_<base58>`. Anything else is refused without a
/// database query, so garbage keys cannot exhaust the pool.
pub(crate) fn plausible_secret(secret: &str) -> bool {
    (20..=256).contains(&secret.len())
        && secret
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl LocalAuth {
    /// Builds the service and starts the background flush of key use times
    /// (needs a Tokio runtime).
    pub fn new(db: Database, key_prefix: &str) -> Self {
        let inner = Arc::new(Inner {
            db,
            key_prefix: key_prefix.to_owned(),
            cache: RwLock::new(HashMap::new()),
            generation: AtomicU64::new(0),
            last_used: Mutex::new(HashMap::new()),
            request_path_reads: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(LAST_USED_FLUSH);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                inner.flush_last_used().await;
                inner.sweep_nonces().await;
            }
        });
        let weak = Arc::downgrade(&inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(RECHECK_PASS);
            // A slow pass is followed by a full interval, not a burst.
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                inner.recheck().await;
            }
        });
        Self {
            inner,
            revocations: None,
            wallets: crate::siwx::SiwxPolicy::default(),
            wallet_tier: "standard".to_owned(),
        }
    }

    /// Accepts wallet sign-ins under `[wallet]`.
    pub fn with_wallets(mut self, config: &rialto_core::config::WalletConfig) -> Self {
        self.wallets = crate::siwx::SiwxPolicy {
            domains: config.domains.clone(),
            evm_chains: config.evm_chain_ids.clone(),
            solana_chains: config.solana_chains.clone(),
        };
        self.wallet_tier = config.tier.clone();
        self
    }

    /// Announces deletions and tier changes on `bus` (subject
    /// `<prefix>.auth.revocations`) and drops what other replicas announce
    /// from this one's cache: a key deleted anywhere is refused everywhere
    /// as soon as the event arrives, not after the one-second re-check.
    pub fn with_revocations(mut self, bus: rialto_core::bus::Bus) -> Self {
        crate::revocation::listen(&bus, Arc::downgrade(&self.inner), Inner::revoke);
        self.revocations = Some(bus);
        self
    }

    /// Purges here and tells the other replicas.
    async fn announce(&self, revocation: Revocation) {
        self.inner.revoke(&revocation);
        if let (Some(bus), Ok(payload)) = (&self.revocations, serde_json::to_vec(&revocation))
            && let Err(error) = bus
                .publish(bus.subject(REVOCATIONS_SUBJECT), payload.into())
                .await
        {
            tracing::warn!(%error, "revocation not announced; other replicas re-check within a second");
        }
    }
}

impl Inner {
    fn revoke(&self, revocation: &Revocation) {
        // A lookup in flight must not put back what was revoked.
        self.generation.fetch_add(1, Ordering::AcqRel);
        let mut cache = self.cache.write().unwrap_or_else(|p| p.into_inner());
        cache.retain(|_, key| {
            let keep = !revocation.covers(&key.principal.key_id, &key.principal.account_id);
            if !keep {
                self.orphan_use(key);
            }
            keep
        });
    }

    /// Keeps the unflushed use of an entry leaving the cache.
    fn orphan_use(&self, key: &CachedKey) {
        if let Some(at) = key.usage.take_unflushed() {
            let mut pending = lock(&self.last_used);
            let entry = pending.entry(key.usage.key_id.clone()).or_insert(at);
            *entry = (*entry).max(at);
        }
    }
}

/// Margin a used nonce is kept past the last moment its header could be
/// accepted (clock skew between replicas).
const NONCE_MARGIN_MS: i64 = 30_000;

impl Inner {
    fn new_secret(&self, key_type: pb::KeyType) -> Result<String> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| Error::internal(format_args!("rng: {e}")))?;
        let kind = match key_type {
            pb::KeyType::Admin => "ADMIN",
            _ => "INFERENCE",
        };
        Ok(format!(
            "{}_{kind}_KEY_{}",
            self.key_prefix,
            bs58::encode(bytes).into_string()
        ))
    }

    /// Stores a new key of `key_type` (checked by the caller) as `request`
    /// describes it.
    async fn insert_key(
        &self,
        tx: &mut sqlx::AnyConnection,
        key_type: pb::KeyType,
        request: pb::CreateApiKeyRequest,
    ) -> Result<pb::CreatedKey> {
        let pb::CreateApiKeyRequest {
            account_id,
            description,
            expires_at_ms,
            limit,
            model_privacy,
            ..
        } = request;
        let account_id = account_id.as_str();
        let description = description.as_str();
        let model_privacy = valid_privacy(&model_privacy)?;
        if let Some(limit) = &limit
            && !matches!(limit.period.as_str(), "EPOCH" | "MONTH" | "LIFETIME")
        {
            return Err(Error::invalid(
                "limitPeriod must be one of EPOCH, MONTH or LIFETIME",
            ));
        }
        let secret = self.new_secret(key_type)?;
        let record = pb::ApiKeyRecord {
            id: uuid::Uuid::new_v4().to_string(),
            account_id: account_id.to_owned(),
            key_type: key_type as i32,
            description: description.to_owned(),
            created_at_ms: now_ms(),
            expires_at_ms,
            last_used_at_ms: None,
            last6_chars: secret[secret.len() - 6..].to_owned(),
            limit,
            model_privacy: model_privacy.to_owned(),
        };
        let limit = record.limit.clone().unwrap_or_default();
        sqlx::query(
            "INSERT INTO api_keys (id, account_id, key_type, description, secret_sha256, \
             last6_chars, created_at_ms, expires_at_ms, limit_usd_nanos, limit_diem_nanos, \
             limit_period, model_privacy) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, \
             $12)",
        )
        .bind(&record.id)
        .bind(&record.account_id)
        .bind(key_type_name(key_type))
        .bind(&record.description)
        .bind(hex::encode(hash(&secret)))
        .bind(&record.last6_chars)
        .bind(record.created_at_ms)
        .bind(record.expires_at_ms)
        .bind(limit.usd_nanos)
        .bind(limit.diem_nanos)
        .bind(if limit.period.is_empty() {
            "EPOCH"
        } else {
            limit.period.as_str()
        })
        .bind(model_privacy)
        .execute(&mut *tx)
        .await?;
        Ok(pb::CreatedKey {
            record: Some(record),
            secret,
        })
    }

    /// Reads a key by the hash of its secret and caches it, used at `now`
    /// unless it has expired; a key that is gone is dropped from the cache.
    /// The request path's read.
    async fn load_key(&self, digest: SecretHash, now: i64) -> Result<(pb::Principal, Option<i64>)> {
        self.request_path_reads.fetch_add(1, Ordering::Relaxed);
        let generation = self.generation.load(Ordering::Acquire);
        let started = Instant::now();
        let row = sqlx::query(
            "SELECT k.id, k.account_id, k.key_type, k.expires_at_ms, k.secret_sha256, \
             a.tier, a.wallet, k.limit_usd_nanos, k.limit_diem_nanos, k.limit_period, \
             k.model_privacy FROM api_keys k JOIN accounts a ON a.id = k.account_id \
             WHERE k.secret_sha256 = $1 AND a.suspended_at_ms IS NULL",
        )
        .bind(hex::encode(digest))
        .fetch_optional(self.db.pool())
        .await?;
        let stored = match &row {
            Some(row) => {
                hex::decode(row.try_get::<String, _>("secret_sha256")?).unwrap_or_default()
            }
            None => Vec::new(),
        };
        let (Some(row), true) = (row, bool::from(stored.as_slice().ct_eq(&digest))) else {
            let mut cache = self.cache.write().unwrap_or_else(|p| p.into_inner());
            if let Some(gone) = cache.remove(&digest) {
                self.orphan_use(&gone);
            }
            return Err(Error::unauthenticated());
        };
        let (principal, expires_at_ms) = principal_from_row(&row)?;
        let mut cache = self.cache.write().unwrap_or_else(|p| p.into_inner());
        // The use so far of a key read again (its entry was not confirmed in
        // time) stays with it.
        let usage = match cache.get(&digest) {
            Some(old) if old.usage.key_id == principal.key_id => old.usage.clone(),
            _ => Arc::new(KeyUse::new(principal.key_id.clone())),
        };
        // Set before the entry is visible, so no pass takes it for idle.
        if expires_at_ms.is_none_or(|at| at > now) {
            usage.used(now);
        }
        // Checked under the write lock: a deletion bumps the generation before
        // it purges, so either we see the bump or it sees our entry.
        if self.generation.load(Ordering::Acquire) == generation {
            cache.insert(
                digest,
                CachedKey {
                    principal: principal.clone(),
                    expires_at_ms,
                    checked_at: started,
                    usage,
                },
            );
        }
        Ok((principal, expires_at_ms))
    }

    /// One background pass: drops the keys idle past [`KEEP_WARM`], re-reads
    /// the others in one query and applies what it read.
    async fn recheck(&self) {
        let Some(asked) = self.keys_to_recheck() else {
            return;
        };
        match self.read_keys(asked).await {
            Ok(read) => self.apply_recheck(read),
            Err(error) => {
                // The entries age; past KEY_RECHECK requests read their keys
                // themselves.
                tracing::warn!(%error, "cached keys not re-checked");
            }
        }
    }

    /// The keys used in the last [`KEEP_WARM`]; the others leave the cache.
    fn keys_to_recheck(&self) -> Option<Vec<SecretHash>> {
        let idle_before = now_ms().saturating_sub(KEEP_WARM.as_millis() as i64);
        let warm = |key: &CachedKey| key.usage.last_used_ms.load(Ordering::Acquire) >= idle_before;
        let (asked, idle) = {
            let cache = self.cache.read().unwrap_or_else(|p| p.into_inner());
            let asked: Vec<SecretHash> = cache
                .iter()
                .filter(|(_, key)| warm(key))
                .map(|(digest, _)| *digest)
                .collect();
            let idle = asked.len() < cache.len();
            (asked, idle)
        };
        if idle {
            let mut cache = self.cache.write().unwrap_or_else(|p| p.into_inner());
            cache.retain(|_, key| {
                let keep = warm(key);
                if !keep {
                    self.orphan_use(key);
                }
                keep
            });
        }
        (!asked.is_empty()).then_some(asked)
    }

    /// Reads `asked` from the database, [`RECHECK_BATCH`] at a time.
    async fn read_keys(&self, asked: Vec<SecretHash>) -> Result<Recheck> {
        let generation = self.generation.load(Ordering::Acquire);
        let started = Instant::now();
        let mut found = HashMap::with_capacity(asked.len());
        for chunk in asked.chunks(RECHECK_BATCH) {
            // Padded to a power of two with repeats: few distinct statements.
            let size = chunk.len().next_power_of_two();
            let mut query = sqlx::query(sqlx::AssertSqlSafe(recheck_sql(size)));
            for i in 0..size {
                query = query.bind(hex::encode(chunk[i.min(chunk.len() - 1)]));
            }
            for row in query.fetch_all(self.db.pool()).await? {
                let stored = hex::decode(row.try_get::<String, _>("secret_sha256")?)
                    .ok()
                    .and_then(|bytes| SecretHash::try_from(bytes).ok());
                if let Some(digest) = stored {
                    found.insert(digest, principal_from_row(&row)?);
                }
            }
        }
        Ok(Recheck {
            generation,
            started,
            asked,
            found,
        })
    }

    /// Applies a pass's reads: keys gone or expired leave the cache, the
    /// others are refreshed (a changed tier, cap or expiry included) and
    /// trusted from the moment the pass's read began. A pass that started
    /// before a revocation refreshes nothing (it may have read what was
    /// revoked); its removals still apply.
    fn apply_recheck(&self, mut read: Recheck) {
        let now = now_ms();
        let mut cache = self.cache.write().unwrap_or_else(|p| p.into_inner());
        let current = self.generation.load(Ordering::Acquire) == read.generation;
        for digest in &read.asked {
            let Some(entry) = cache.get_mut(digest) else {
                continue;
            };
            match read.found.remove(digest) {
                Some((principal, expires_at_ms))
                    if expires_at_ms.is_none_or(|at| at > now)
                        && principal.key_id == entry.usage.key_id =>
                {
                    if current && entry.checked_at < read.started {
                        entry.principal = principal;
                        entry.expires_at_ms = expires_at_ms;
                        entry.checked_at = read.started;
                    }
                }
                _ => {
                    if let Some(gone) = cache.remove(digest) {
                        self.orphan_use(&gone);
                    }
                }
            }
        }
    }

    async fn flush_last_used(&self) {
        let mut pending = std::mem::take(&mut *lock(&self.last_used));
        for key in self
            .cache
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            if let Some(at) = key.usage.take_unflushed() {
                let entry = pending.entry(key.usage.key_id.clone()).or_insert(at);
                *entry = (*entry).max(at);
            }
        }
        for (key_id, at) in pending {
            let result = sqlx::query(
                "UPDATE api_keys SET last_used_at_ms = $1 WHERE id = $2 \
                 AND (last_used_at_ms IS NULL OR last_used_at_ms < $1)",
            )
            .bind(at)
            .bind(&key_id)
            .execute(self.db.pool())
            .await;
            if let Err(error) = result {
                tracing::warn!(%error, key_id, "could not record key use");
            }
        }
    }

    /// Forgets nonces whose headers can no longer be accepted.
    async fn sweep_nonces(&self) {
        let result = sqlx::query("DELETE FROM wallet_nonces WHERE expires_at_ms < $1")
            .bind(now_ms())
            .execute(self.db.pool())
            .await;
        if let Err(error) = result {
            tracing::warn!(%error, "could not sweep wallet nonces");
        }
    }
}

/// The re-check's statement for `size` keys (a power of two up to
/// [`RECHECK_BATCH`]), built once: placeholders only, no input in the text.
fn recheck_sql(size: usize) -> &'static str {
    static STATEMENTS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let statements = STATEMENTS.get_or_init(|| {
        (0..=RECHECK_BATCH.trailing_zeros())
            .map(|power| {
                let placeholders = (1..=1usize << power)
                    .map(|i| format!("${i}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!(
                    "SELECT k.id, k.account_id, k.key_type, k.expires_at_ms, k.secret_sha256, \
                     a.tier, a.wallet, k.limit_usd_nanos, k.limit_diem_nanos, \
                     k.limit_period, k.model_privacy \
                     FROM api_keys k JOIN accounts a ON a.id = k.account_id \
                     WHERE k.secret_sha256 IN ({placeholders}) AND a.suspended_at_ms IS NULL"
                )
            })
            .collect()
    });
    let index = size.next_power_of_two().trailing_zeros() as usize;
    statements
        .get(index)
        .or(statements.last())
        .map_or("", String::as_str)
}

/// A key's principal and expiry from its row (the columns of the key
/// lookups).
fn principal_from_row(row: &sqlx::any::AnyRow) -> Result<(pb::Principal, Option<i64>)> {
    let key_type: String = row.try_get("key_type")?;
    Ok((
        pb::Principal {
            account_id: row.try_get("account_id")?,
            key_id: row.try_get("id")?,
            key_type: key_type_from_name(&key_type) as i32,
            tier: row.try_get("tier")?,
            key_limit: limit_from_row(row)?,
            // A wallet account's keys spend the wallet's ledger.
            wallet: row
                .try_get::<Option<String>, _>("wallet")?
                .unwrap_or_default(),
            model_privacy: row.try_get("model_privacy")?,
        },
        row.try_get("expires_at_ms")?,
    ))
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(crate) fn hash(secret: &str) -> SecretHash {
    Sha256::digest(secret.as_bytes()).into()
}

fn key_type_name(key_type: pb::KeyType) -> &'static str {
    match key_type {
        pb::KeyType::Admin => "ADMIN",
        _ => "INFERENCE",
    }
}

fn key_type_from_name(name: &str) -> pb::KeyType {
    if name == "ADMIN" {
        pb::KeyType::Admin
    } else {
        pb::KeyType::Inference
    }
}

fn record_from_row(row: &sqlx::any::AnyRow) -> Result<pb::ApiKeyRecord> {
    let key_type: String = row.try_get("key_type")?;
    Ok(pb::ApiKeyRecord {
        id: row.try_get("id")?,
        account_id: row.try_get("account_id")?,
        key_type: key_type_from_name(&key_type) as i32,
        description: row.try_get("description")?,
        created_at_ms: row.try_get("created_at_ms")?,
        expires_at_ms: row.try_get("expires_at_ms")?,
        last_used_at_ms: row.try_get("last_used_at_ms")?,
        last6_chars: row.try_get("last6_chars")?,
        limit: limit_from_row(row)?,
        model_privacy: row.try_get("model_privacy")?,
    })
}

/// The `modelPrivacy` values a key can have.
pub const MODEL_PRIVACY: &[&str] = &["ALL", "PRIVATE_TEXT", "PRIVATE_ONLY"];

/// A key's `modelPrivacy`, ALL when empty.
fn valid_privacy(privacy: &str) -> Result<&str> {
    match privacy {
        "" => Ok("ALL"),
        known if MODEL_PRIVACY.contains(&known) => Ok(known),
        other => Err(Error::invalid(format!(
            "modelPrivacy must be one of {}, not {other}",
            MODEL_PRIVACY.join(", ")
        ))),
    }
}

/// A key's spending cap from its row; None without caps or period.
fn limit_from_row(row: &sqlx::any::AnyRow) -> Result<Option<pb::ConsumptionLimit>> {
    let usd_nanos: Option<i64> = row.try_get("limit_usd_nanos")?;
    let diem_nanos: Option<i64> = row.try_get("limit_diem_nanos")?;
    let period: String = row.try_get("limit_period")?;
    let any = usd_nanos.is_some() || diem_nanos.is_some() || period != "EPOCH";
    Ok(any.then_some(pb::ConsumptionLimit {
        usd_nanos,
        diem_nanos,
        period,
    }))
}

/// The columns [`record_from_row`] reads, as a literal for `concat!`.
macro_rules! record_columns {
    () => {
        "id, account_id, key_type, description, created_at_ms, expires_at_ms, \
         last_used_at_ms, last6_chars, limit_usd_nanos, limit_diem_nanos, limit_period, \
         model_privacy"
    };
}

fn account_from_row(row: &sqlx::any::AnyRow) -> Result<pb::Account> {
    Ok(pb::Account {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        tier: row.try_get("tier")?,
        created_at_ms: row.try_get("created_at_ms")?,
        wallet: row
            .try_get::<Option<String>, _>("wallet")?
            .unwrap_or_default(),
        suspended_at_ms: row.try_get("suspended_at_ms")?,
    })
}

/// The columns [`review_from_row`] reads, as a literal for `concat!`.
macro_rules! review_columns {
    () => {
        "id, slug, account_id, rating, message, locale, username, created_at_ms"
    };
}

fn key_not_found() -> Error {
    Error::new(ErrorCode::ApiKeyNotFound, "API key could not be found")
}

#[async_trait]
impl AuthService for LocalAuth {
    async fn authenticate(&self, request: pb::AuthenticateRequest) -> Result<pb::Principal> {
        let inner = &self.inner;
        if !plausible_secret(&request.api_key) {
            return Err(Error::unauthenticated());
        }
        let digest = hash(&request.api_key);
        let now = now_ms();
        // A key the passes confirmed within KEY_RECHECK: no database, and
        // its use is one atomic update under the read lock.
        let cached = inner
            .cache
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&digest)
            .filter(|key| key.checked_at.elapsed() < KEY_RECHECK)
            .map(|key| {
                let expired = key.expires_at_ms.is_some_and(|at| at <= now);
                if !expired {
                    key.usage.used(now);
                }
                (expired, key.principal.clone())
            });
        let (expired, principal) = match cached {
            Some(cached) => cached,
            None => {
                let (principal, expires_at_ms) = inner.load_key(digest, now).await?;
                (expires_at_ms.is_some_and(|at| at <= now), principal)
            }
        };
        if expired {
            return Err(Error::new(
                ErrorCode::Unauthenticated,
                "Authentication failed: the API key has expired",
            ));
        }
        Ok(principal)
    }

    async fn create_account(
        &self,
        request: pb::CreateAccountRequest,
    ) -> Result<pb::CreateAccountResponse> {
        let name = request.name.trim();
        if name.is_empty() || name.chars().count() > 128 {
            return Err(Error::invalid("account name must be 1 to 128 characters"));
        }
        let tier = valid_tier(&request.tier)?;
        let account_id = uuid::Uuid::new_v4().to_string();
        let mut tx = self.inner.db.pool().begin().await?;
        sqlx::query("INSERT INTO accounts (id, name, tier, created_at_ms) VALUES ($1, $2, $3, $4)")
            .bind(&account_id)
            .bind(name)
            .bind(tier)
            .bind(now_ms())
            .execute(&mut *tx)
            .await?;
        let key = self
            .inner
            .insert_key(
                &mut tx,
                pb::KeyType::Admin,
                pb::CreateApiKeyRequest {
                    account_id: account_id.clone(),
                    description: "Default admin key".to_owned(),
                    ..Default::default()
                },
            )
            .await?;
        tx.commit().await?;
        tracing::info!(account_id, "account created");
        Ok(pb::CreateAccountResponse {
            account_id,
            api_key: Some(key),
        })
    }

    async fn create_api_key(&self, request: pb::CreateApiKeyRequest) -> Result<pb::CreatedKey> {
        let key_type = match pb::KeyType::try_from(request.key_type) {
            Ok(t @ (pb::KeyType::Admin | pb::KeyType::Inference)) => t,
            _ => return Err(Error::invalid("apiKeyType must be ADMIN or INFERENCE")),
        };
        let mut conn = self.inner.db.pool().acquire().await?;
        let key = self.inner.insert_key(&mut conn, key_type, request).await?;
        if let Some(record) = &key.record {
            tracing::info!(
                key_id = record.id,
                account_id = record.account_id,
                "api key created"
            );
        }
        Ok(key)
    }

    async fn list_api_keys(
        &self,
        request: pb::ListApiKeysRequest,
    ) -> Result<pb::ListApiKeysResponse> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            record_columns!(),
            " FROM api_keys WHERE account_id = $1 ORDER BY created_at_ms, id"
        ))
        .bind(&request.account_id)
        .fetch_all(self.inner.db.pool())
        .await?;
        let keys = rows.iter().map(record_from_row).collect::<Result<_>>()?;
        Ok(pb::ListApiKeysResponse { keys })
    }

    async fn get_api_key(&self, request: pb::GetApiKeyRequest) -> Result<pb::ApiKeyRecord> {
        let row = sqlx::query(concat!(
            "SELECT ",
            record_columns!(),
            " FROM api_keys WHERE id = $1 AND account_id = $2"
        ))
        .bind(&request.id)
        .bind(&request.account_id)
        .fetch_optional(self.inner.db.pool())
        .await?
        .ok_or_else(|| Error::new(ErrorCode::ApiKeyNotFound, "API key not found"))?;
        record_from_row(&row)
    }

    async fn delete_api_key(
        &self,
        request: pb::DeleteApiKeyRequest,
    ) -> Result<pb::DeleteApiKeyResponse> {
        let deleted = sqlx::query("DELETE FROM api_keys WHERE id = $1 AND account_id = $2")
            .bind(&request.id)
            .bind(&request.account_id)
            .execute(self.inner.db.pool())
            .await?
            .rows_affected();
        if deleted == 0 {
            return Err(key_not_found());
        }
        self.announce(Revocation::Key(request.id.clone())).await;
        lock(&self.inner.last_used).remove(&request.id);
        tracing::info!(
            key_id = request.id,
            account_id = request.account_id,
            "api key deleted"
        );
        Ok(pb::DeleteApiKeyResponse {})
    }

    async fn create_web3_key(&self, request: pb::CreateWeb3KeyRequest) -> Result<pb::CreatedKey> {
        let settings = request.key.unwrap_or_default();
        let key_type = match pb::KeyType::try_from(settings.key_type) {
            Ok(t @ (pb::KeyType::Admin | pb::KeyType::Inference)) => t,
            _ => return Err(Error::invalid("apiKeyType must be ADMIN or INFERENCE")),
        };
        let signed = crate::web3::verify(
            &request.address,
            &request.signature,
            &request.token,
            &self.wallets,
            now_ms(),
        )
        .map_err(|refusal| Error::new(ErrorCode::Unauthenticated, refusal.message))?;
        let account_id = wallet_account_id(&signed.address);
        let mut tx = self.inner.db.pool().begin().await?;
        // The token is good for one key: its nonce is consumed in the key's
        // transaction (a key that could not be made leaves it unused), and
        // of two requests racing with it, the second waits for the first and
        // finds it taken.
        let consumed = sqlx::query(
            "INSERT INTO wallet_nonces (wallet, nonce, expires_at_ms) VALUES ($1, $2, $3)",
        )
        .bind(&signed.address)
        .bind(format!("web3-key:{}", signed.nonce))
        .bind(signed.expires_at_ms.saturating_add(NONCE_MARGIN_MS))
        .execute(&mut *tx)
        .await;
        match consumed {
            Ok(_) => {}
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                return Err(Error::new(
                    ErrorCode::Unauthenticated,
                    "This token was used already: get a new token for every key",
                ));
            }
            Err(error) => return Err(error.into()),
        }
        sqlx::query(
            "INSERT INTO accounts (id, name, tier, created_at_ms, wallet) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (id) DO NOTHING",
        )
        .bind(&account_id)
        .bind(&signed.address)
        .bind(&self.wallet_tier)
        .bind(now_ms())
        .bind(&signed.address)
        .execute(&mut *tx)
        .await?;
        let key = self
            .inner
            .insert_key(
                &mut tx,
                key_type,
                pb::CreateApiKeyRequest {
                    account_id: account_id.clone(),
                    ..settings
                },
            )
            .await?;
        tx.commit().await?;
        tracing::info!(account_id, wallet = signed.address, "web3 api key created");
        Ok(key)
    }

    async fn update_api_key(&self, request: pb::UpdateApiKeyRequest) -> Result<pb::ApiKeyRecord> {
        let model_privacy = valid_privacy(&request.model_privacy)?;
        let limit = request.limit.clone().unwrap_or_default();
        if !matches!(limit.period.as_str(), "" | "EPOCH" | "MONTH" | "LIFETIME") {
            return Err(Error::invalid(
                "limitPeriod must be one of EPOCH, MONTH or LIFETIME",
            ));
        }
        let updated = sqlx::query(
            "UPDATE api_keys SET description = $1, expires_at_ms = $2, limit_usd_nanos = $3, \
             limit_diem_nanos = $4, limit_period = $5, model_privacy = $6 \
             WHERE id = $7 AND account_id = $8 AND (expires_at_ms IS NULL OR expires_at_ms > $9)",
        )
        .bind(&request.description)
        .bind(request.expires_at_ms)
        .bind(limit.usd_nanos)
        .bind(limit.diem_nanos)
        .bind(if limit.period.is_empty() {
            "EPOCH"
        } else {
            limit.period.as_str()
        })
        .bind(model_privacy)
        .bind(&request.id)
        .bind(&request.account_id)
        .bind(now_ms())
        .execute(self.inner.db.pool())
        .await?
        .rows_affected();
        if updated == 0 {
            return Err(Error::new(
                ErrorCode::ApiKeyNotFound,
                "API key not found or expired",
            ));
        }
        // Cached principals carry the cap, the expiry and the privacy: every
        // replica drops the key, and its next request reads it again.
        self.announce(Revocation::Key(request.id.clone())).await;
        tracing::info!(
            key_id = request.id,
            account_id = request.account_id,
            "api key updated"
        );
        self.get_api_key(pb::GetApiKeyRequest {
            account_id: request.account_id,
            id: request.id,
        })
        .await
    }

    async fn get_account(&self, request: pb::GetAccountRequest) -> Result<pb::Account> {
        let row = sqlx::query(
            "SELECT id, name, tier, created_at_ms, wallet, suspended_at_ms FROM accounts \
             WHERE id = $1",
        )
        .bind(&request.account_id)
        .fetch_optional(self.inner.db.pool())
        .await?
        .ok_or_else(|| Error::new(ErrorCode::NotFound, "Account not found"))?;
        account_from_row(&row)
    }

    async fn list_accounts(
        &self,
        request: pb::ListAccountsRequest,
    ) -> Result<pb::ListAccountsResponse> {
        // LIKE's wildcards in the search are literal.
        let search: String = request
            .search
            .trim()
            .to_lowercase()
            .chars()
            .flat_map(|c| match c {
                '\\' | '%' | '_' => vec!['\\', c],
                c => vec![c],
            })
            .collect();
        let pattern = format!("%{search}%");
        let total: i64 = sqlx::query(
            "SELECT CAST(COUNT(*) AS BIGINT) FROM accounts \
             WHERE LOWER(name) LIKE $1 ESCAPE '\\' OR LOWER(id) LIKE $1 ESCAPE '\\'",
        )
        .bind(&pattern)
        .fetch_one(self.inner.db.pool())
        .await?
        .try_get(0)?;
        let rows = sqlx::query(
            "SELECT id, name, tier, created_at_ms, wallet, suspended_at_ms FROM accounts \
             WHERE LOWER(name) LIKE $1 ESCAPE '\\' OR LOWER(id) LIKE $1 ESCAPE '\\' \
             ORDER BY created_at_ms DESC, id LIMIT $2 OFFSET $3",
        )
        .bind(&pattern)
        .bind(i64::from(request.limit.clamp(1, 500)))
        .bind(i64::try_from(request.offset).unwrap_or(i64::MAX))
        .fetch_all(self.inner.db.pool())
        .await?;
        Ok(pb::ListAccountsResponse {
            accounts: rows.iter().map(account_from_row).collect::<Result<_>>()?,
            total: u64::try_from(total).unwrap_or(0),
        })
    }

    async fn set_account_suspended(
        &self,
        request: pb::SetAccountSuspendedRequest,
    ) -> Result<pb::Account> {
        let updated = sqlx::query(
            "UPDATE accounts SET suspended_at_ms = CASE WHEN $2 = 1 \
             THEN COALESCE(suspended_at_ms, $3) ELSE NULL END WHERE id = $1",
        )
        .bind(&request.account_id)
        .bind(i64::from(request.suspended))
        .bind(now_ms())
        .execute(self.inner.db.pool())
        .await?
        .rows_affected();
        if updated == 0 {
            return Err(Error::new(ErrorCode::NotFound, "Account not found"));
        }
        // Its keys are cached as principals: every replica drops them, and
        // a suspended account's keys no longer resolve.
        self.announce(Revocation::Account(request.account_id.clone()))
            .await;
        tracing::info!(
            account_id = request.account_id,
            suspended = request.suspended,
            "account suspension changed"
        );
        self.get_account(pb::GetAccountRequest {
            account_id: request.account_id,
        })
        .await
    }

    async fn set_account_tier(&self, request: pb::SetAccountTierRequest) -> Result<pb::Account> {
        let tier = valid_tier(&request.tier)?;
        let updated = sqlx::query("UPDATE accounts SET tier = $2 WHERE id = $1")
            .bind(&request.account_id)
            .bind(tier)
            .execute(self.inner.db.pool())
            .await?
            .rows_affected();
        if updated == 0 {
            return Err(Error::new(ErrorCode::NotFound, "Account not found"));
        }
        // Cached principals carry the tier: drop the account's.
        self.announce(Revocation::Account(request.account_id.clone()))
            .await;
        tracing::info!(account_id = request.account_id, tier, "account tier set");
        self.get_account(pb::GetAccountRequest {
            account_id: request.account_id,
        })
        .await
    }

    async fn put_character(&self, request: pb::Character) -> Result<pb::Character> {
        let slug = request.slug.trim();
        let valid_slug = (1..=64).contains(&slug.len())
            && slug
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !valid_slug {
            return Err(Error::invalid(
                "slug must be 1 to 64 lowercase letters, digits or dashes",
            ));
        }
        if request.name.trim().is_empty() || request.system_prompt.trim().is_empty() {
            return Err(Error::invalid("name and system_prompt are required"));
        }
        let now = now_ms();
        let tags = serde_json::to_string(&request.tags).map_err(Error::internal)?;
        let categories = serde_json::to_string(&request.categories).map_err(Error::internal)?;
        sqlx::query(
            "INSERT INTO characters (slug, name, description, system_prompt, model_id, public, \
             tags, adult, featured, web_enabled, author, photo_url, share_url, created_at_ms, \
             updated_at_ms, categories) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, \
             $12, $13, $14, $14, $15) ON CONFLICT (slug) DO UPDATE SET name = excluded.name, \
             description = excluded.description, system_prompt = excluded.system_prompt, \
             model_id = excluded.model_id, public = excluded.public, tags = excluded.tags, \
             adult = excluded.adult, featured = excluded.featured, \
             web_enabled = excluded.web_enabled, author = excluded.author, \
             photo_url = excluded.photo_url, share_url = excluded.share_url, \
             updated_at_ms = excluded.updated_at_ms, categories = excluded.categories",
        )
        .bind(slug)
        .bind(&request.name)
        .bind(&request.description)
        .bind(&request.system_prompt)
        .bind(&request.model_id)
        .bind(i64::from(request.public))
        .bind(tags)
        .bind(i64::from(request.adult))
        .bind(i64::from(request.featured))
        .bind(i64::from(request.web_enabled))
        .bind(&request.author)
        .bind(&request.photo_url)
        .bind(&request.share_url)
        .bind(now)
        .bind(categories)
        .execute(self.inner.db.pool())
        .await?;
        let characters = self
            .list_characters(pb::ListCharactersRequest {})
            .await?
            .characters;
        characters
            .into_iter()
            .find(|c| c.slug == slug)
            .ok_or_else(|| Error::internal("a stored character vanished"))
    }

    async fn delete_character(
        &self,
        request: pb::DeleteCharacterRequest,
    ) -> Result<pb::DeleteCharacterResponse> {
        let deleted = sqlx::query("DELETE FROM characters WHERE slug = $1")
            .bind(&request.slug)
            .execute(self.inner.db.pool())
            .await?
            .rows_affected();
        if deleted == 0 {
            return Err(Error::new(ErrorCode::NotFound, "Character not found"));
        }
        Ok(pb::DeleteCharacterResponse {})
    }

    async fn list_characters(
        &self,
        _: pb::ListCharactersRequest,
    ) -> Result<pb::ListCharactersResponse> {
        let rows = sqlx::query(
            "SELECT slug, name, description, system_prompt, model_id, public, tags, adult, \
             featured, web_enabled, author, photo_url, share_url, created_at_ms, updated_at_ms, \
             categories FROM characters ORDER BY created_at_ms, slug",
        )
        .fetch_all(self.inner.db.pool())
        .await?;
        let characters = rows
            .iter()
            .map(|row| {
                let tags: String = row.try_get("tags")?;
                let categories: String = row.try_get("categories")?;
                Ok(pb::Character {
                    categories: serde_json::from_str(&categories).unwrap_or_default(),
                    slug: row.try_get("slug")?,
                    name: row.try_get("name")?,
                    description: row.try_get("description")?,
                    system_prompt: row.try_get("system_prompt")?,
                    model_id: row.try_get("model_id")?,
                    public: row.try_get::<i64, _>("public")? != 0,
                    tags: serde_json::from_str(&tags).unwrap_or_default(),
                    adult: row.try_get::<i64, _>("adult")? != 0,
                    featured: row.try_get::<i64, _>("featured")? != 0,
                    web_enabled: row.try_get::<i64, _>("web_enabled")? != 0,
                    author: row.try_get("author")?,
                    photo_url: row.try_get("photo_url")?,
                    share_url: row.try_get("share_url")?,
                    created_at_ms: row.try_get("created_at_ms")?,
                    updated_at_ms: row.try_get("updated_at_ms")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(pb::ListCharactersResponse { characters })
    }

    async fn put_character_review(
        &self,
        request: pb::PutCharacterReviewRequest,
    ) -> Result<pb::CharacterReview> {
        if !(1..=5).contains(&request.rating) {
            return Err(Error::invalid("rating must be an integer from 1 to 5"));
        }
        let account = self
            .get_account(pb::GetAccountRequest {
                account_id: request.account_id.clone(),
            })
            .await?;
        // A wallet's account is named by its address: shown shortened.
        let username = if account.wallet.is_empty() {
            account.name
        } else {
            let address = &account.wallet;
            let (head, tail) = (
                address.get(..6).unwrap_or(address),
                address.get(address.len().saturating_sub(4)..).unwrap_or(""),
            );
            format!("{head}…{tail}")
        };
        let now = now_ms();
        // One review per account and character: a second replaces the first
        // (and keeps its id and creation time).
        sqlx::query(
            "INSERT INTO character_reviews (id, slug, account_id, rating, message, locale, \
             username, created_at_ms, updated_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8) \
             ON CONFLICT (slug, account_id) DO UPDATE SET rating = excluded.rating, \
             message = excluded.message, locale = excluded.locale, \
             username = excluded.username, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(uuid::Uuid::new_v4().to_string())
        .bind(&request.slug)
        .bind(&request.account_id)
        .bind(i64::from(request.rating))
        .bind(&request.message)
        .bind(&request.locale)
        .bind(&username)
        .bind(now)
        .execute(self.inner.db.pool())
        .await?;
        let row = sqlx::query(concat!(
            "SELECT ",
            review_columns!(),
            " FROM character_reviews WHERE slug = $1 AND account_id = $2"
        ))
        .bind(&request.slug)
        .bind(&request.account_id)
        .fetch_one(self.inner.db.pool())
        .await?;
        review_from_row(&row)
    }

    async fn list_character_reviews(
        &self,
        request: pb::ListCharacterReviewsRequest,
    ) -> Result<pb::ListCharacterReviewsResponse> {
        let page_size = request.page_size.clamp(1, 100);
        let offset = u64::from(request.page.max(1) - 1) * u64::from(page_size);
        let totals = sqlx::query(
            "SELECT COUNT(*) AS total, COALESCE(SUM(rating), 0) AS rating_sum \
             FROM character_reviews WHERE slug = $1",
        )
        .bind(&request.slug)
        .fetch_one(self.inner.db.pool())
        .await?;
        let rows = sqlx::query(concat!(
            "SELECT ",
            review_columns!(),
            " FROM character_reviews WHERE slug = $1 \
             ORDER BY created_at_ms DESC, id LIMIT $2 OFFSET $3"
        ))
        .bind(&request.slug)
        .bind(i64::from(page_size))
        .bind(i64::try_from(offset).unwrap_or(i64::MAX))
        .fetch_all(self.inner.db.pool())
        .await?;
        Ok(pb::ListCharacterReviewsResponse {
            reviews: rows.iter().map(review_from_row).collect::<Result<_>>()?,
            total: u64::try_from(totals.try_get::<i64, _>("total")?).unwrap_or(0),
            rating_sum: u64::try_from(totals.try_get::<i64, _>("rating_sum")?).unwrap_or(0),
        })
    }

    async fn character_ratings(
        &self,
        request: pb::CharacterRatingsRequest,
    ) -> Result<pb::CharacterRatingsResponse> {
        // One pass over the reviews: every character's count, sum, newest
        // review, and the asking account's own rating.
        let rows = sqlx::query(
            "SELECT slug, COUNT(*) AS count, SUM(rating) AS rating_sum, \
             MAX(created_at_ms) AS latest_ms, \
             MAX(CASE WHEN account_id = $1 THEN rating ELSE 0 END) AS own \
             FROM character_reviews GROUP BY slug",
        )
        .bind(&request.account_id)
        .fetch_all(self.inner.db.pool())
        .await?;
        let ratings = rows
            .iter()
            .map(|row| {
                let own: i64 = row.try_get("own")?;
                Ok(pb::CharacterRating {
                    slug: row.try_get("slug")?,
                    count: u64::try_from(row.try_get::<i64, _>("count")?).unwrap_or(0),
                    sum: u64::try_from(row.try_get::<i64, _>("rating_sum")?).unwrap_or(0),
                    own: (own > 0).then(|| i32::try_from(own).unwrap_or(0)),
                    latest_ms: row.try_get("latest_ms")?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(pb::CharacterRatingsResponse { ratings })
    }

    async fn sign_in(&self, request: pb::SignInRequest) -> Result<pb::SignInResponse> {
        let refused = |code: &str, message: String| pb::SignInResponse {
            principal: None,
            refusal_code: code.to_owned(),
            refusal: message,
        };
        let now = now_ms();
        let signed = match crate::siwx::verify(&request.header, &self.wallets, now) {
            Ok(signed) => signed,
            Err(refusal) => return Ok(refused(refusal.code, refusal.message)),
        };
        // One request per header: the nonce is consumed here, atomically
        // across replicas (the primary key), whatever happens next.
        let consumed = sqlx::query(
            "INSERT INTO wallet_nonces (wallet, nonce, expires_at_ms) VALUES ($1, $2, $3)",
        )
        .bind(&signed.address)
        .bind(&signed.nonce)
        .bind(signed.valid_until_ms.saturating_add(NONCE_MARGIN_MS))
        .execute(self.inner.db.pool())
        .await;
        match consumed {
            Ok(_) => {}
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                return Ok(refused(
                    "X402_SIGN_IN_NONCE_REUSED",
                    "This sign-in nonce was used already: sign a new message with a fresh nonce \
                     for every request"
                        .to_owned(),
                ));
            }
            Err(error) => return Err(error.into()),
        }
        let principal_id = format!("wallet:{}", signed.address);
        Ok(pb::SignInResponse {
            principal: Some(pb::Principal {
                account_id: principal_id.clone(),
                key_id: principal_id,
                key_type: pb::KeyType::Inference as i32,
                tier: self.wallet_tier.clone(),
                key_limit: None,
                wallet: signed.address,
                model_privacy: String::new(),
            }),
            refusal_code: String::new(),
            refusal: String::new(),
        })
    }
}

fn review_from_row(row: &sqlx::any::AnyRow) -> Result<pb::CharacterReview> {
    Ok(pb::CharacterReview {
        id: row.try_get("id")?,
        slug: row.try_get("slug")?,
        account_id: row.try_get("account_id")?,
        rating: i32::try_from(row.try_get::<i64, _>("rating")?).unwrap_or(0),
        message: row.try_get("message")?,
        locale: row.try_get("locale")?,
        username: row.try_get("username")?,
        created_at_ms: row.try_get("created_at_ms")?,
    })
}

/// Names wallet accounts: the id of a wallet's account is derived from its
/// address, so two replicas making a wallet's first key make one account.
const WALLET_ACCOUNTS: uuid::Uuid =
    uuid::Uuid::from_u128(0x3c8e_51f0_9a2d_4b6e_8f17_0d4c_2a9b_6e53);

/// The account of a wallet (its EIP-55 or base58 address): a name-based
/// UUID, so anyone holding the address (an operator's console) finds the
/// account without asking the auth service.
pub fn wallet_account_id(address: &str) -> String {
    uuid::Uuid::new_v5(&WALLET_ACCOUNTS, address.as_bytes()).to_string()
}

/// A tier name: 1 to 32 letters, digits, `-` or `_`; empty means standard.
fn valid_tier(tier: &str) -> Result<&str> {
    match tier.trim() {
        "" => Ok("standard"),
        tier if tier.len() <= 32
            && tier
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
        {
            Ok(tier)
        }
        _ => Err(Error::invalid(
            "account tier must be 1 to 32 letters, digits, - or _",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn service() -> (LocalAuth, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/auth.db", dir.path().display());
        let db = Database::connect(&url, 4).await.unwrap();
        (LocalAuth::new(db, "RIALTO"), dir)
    }

    /// Two replicas on one database and one bus: a key deleted through one
    /// is refused by the other as soon as the event arrives, well inside
    /// the one-second re-check that bounds it without events.
    #[tokio::test]
    async fn a_revocation_reaches_the_other_replica_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/auth.db", dir.path().display());
        let bus = rialto_core::bus::Bus::in_process("test");
        let one = LocalAuth::new(Database::connect(&url, 4).await.unwrap(), "RIALTO")
            .with_revocations(bus.clone());
        let other = LocalAuth::new(Database::connect(&url, 4).await.unwrap(), "RIALTO")
            .with_revocations(bus);
        let (account_id, _) = account(&one).await;
        let key = one
            .create_api_key(pb::CreateApiKeyRequest {
                account_id: account_id.clone(),
                key_type: pb::KeyType::Inference as i32,
                description: "revoked".into(),
                expires_at_ms: None,
                limit: None,
                model_privacy: String::new(),
            })
            .await
            .unwrap();
        // The other replica caches the key...
        other.authenticate(authn(&key.secret)).await.unwrap();
        tokio::task::yield_now().await;
        one.delete_api_key(pb::DeleteApiKeyRequest {
            account_id,
            id: key.record.unwrap().id,
        })
        .await
        .unwrap();
        // ...and drops it on the event, long before its re-check is due.
        let started = std::time::Instant::now();
        while other.authenticate(authn(&key.secret)).await.is_ok() {
            assert!(
                started.elapsed() < Duration::from_millis(200),
                "the other replica still accepts a deleted key"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn account(auth: &LocalAuth) -> (String, String) {
        let created = auth
            .create_account(pb::CreateAccountRequest {
                name: "acme".into(),
                tier: String::new(),
            })
            .await
            .unwrap();
        (created.account_id, created.api_key.unwrap().secret)
    }

    fn authn(secret: &str) -> pb::AuthenticateRequest {
        pb::AuthenticateRequest {
            api_key: secret.to_owned(),
        }
    }

    /// A new INFERENCE key of `account_id`, expiring at `expires_at_ms`.
    async fn inference_key(
        auth: &LocalAuth,
        account_id: &str,
        expires_at_ms: Option<i64>,
    ) -> pb::CreatedKey {
        auth.create_api_key(pb::CreateApiKeyRequest {
            account_id: account_id.to_owned(),
            key_type: pb::KeyType::Inference as i32,
            description: "test".into(),
            expires_at_ms,
            limit: None,
            model_privacy: String::new(),
        })
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn a_new_account_key_authenticates_as_admin() {
        let (auth, _dir) = service().await;
        let (account_id, secret) = account(&auth).await;
        assert!(secret.starts_with("RIALTO_ADMIN_KEY_"));
        let principal = auth.authenticate(authn(&secret)).await.unwrap();
        assert_eq!(principal.account_id, account_id);
        assert_eq!(principal.key_type, pb::KeyType::Admin as i32);
        // Cached now; a second lookup agrees.
        assert_eq!(auth.authenticate(authn(&secret)).await.unwrap(), principal);
    }

    #[tokio::test]
    async fn secrets_are_stored_hashed() {
        let (auth, _dir) = service().await;
        let (_, secret) = account(&auth).await;
        let rows = sqlx::query("SELECT * FROM api_keys")
            .fetch_all(auth.inner.db.pool())
            .await
            .unwrap();
        for row in rows {
            for i in 0..row.len() {
                let value: Option<String> = row.try_get(i).unwrap_or(None);
                assert!(!value.unwrap_or_default().contains(&secret[17..]));
            }
        }
    }

    #[tokio::test]
    async fn unknown_and_deleted_keys_are_refused() {
        let (auth, _dir) = service().await;
        let (account_id, admin) = account(&auth).await;
        let error = auth
            .authenticate(authn("RIALTO_ADMIN_KEY_nope"))
            .await
            .unwrap_err();
        assert_eq!(error.code, ErrorCode::Unauthenticated);

        let key = inference_key(&auth, &account_id, None).await;
        let id = key.record.unwrap().id;
        auth.authenticate(authn(&key.secret)).await.unwrap();
        auth.delete_api_key(pb::DeleteApiKeyRequest {
            account_id: account_id.clone(),
            id: id.clone(),
        })
        .await
        .unwrap();
        let error = auth.authenticate(authn(&key.secret)).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::Unauthenticated);
        // The admin key is untouched.
        auth.authenticate(authn(&admin)).await.unwrap();

        let again = auth
            .delete_api_key(pb::DeleteApiKeyRequest { account_id, id })
            .await
            .unwrap_err();
        assert_eq!(again.code, ErrorCode::ApiKeyNotFound);
        assert_eq!(again.message, "API key could not be found");
    }

    #[tokio::test]
    async fn keys_of_another_account_are_invisible() {
        let (auth, _dir) = service().await;
        let (first, _) = account(&auth).await;
        let (second, _) = account(&auth).await;
        let keys = auth
            .list_api_keys(pb::ListApiKeysRequest {
                account_id: first.clone(),
            })
            .await
            .unwrap()
            .keys;
        assert_eq!(keys.len(), 1);
        let error = auth
            .delete_api_key(pb::DeleteApiKeyRequest {
                account_id: second,
                id: keys[0].id.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(error.code, ErrorCode::ApiKeyNotFound);
    }

    /// Lookups racing a deletion: once the deletion has returned, no lookup
    /// may succeed, whatever was in flight.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_deletion_wins_over_concurrent_lookups() {
        let (auth, _dir) = service().await;
        let auth = Arc::new(auth);
        let (account_id, _) = account(&auth).await;
        for round in 0..20 {
            let key = auth
                .create_api_key(pb::CreateApiKeyRequest {
                    account_id: account_id.clone(),
                    key_type: pb::KeyType::Inference as i32,
                    description: format!("round {round}"),
                    expires_at_ms: None,
                    limit: None,
                    model_privacy: String::new(),
                })
                .await
                .unwrap();
            let deleted = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let lookups: Vec<_> = (0..8)
                .map(|_| {
                    let (auth, secret, deleted) =
                        (auth.clone(), key.secret.clone(), deleted.clone());
                    tokio::spawn(async move {
                        for _ in 0..50 {
                            let after_delete = deleted.load(Ordering::SeqCst);
                            let result = auth.authenticate(authn(&secret)).await;
                            assert!(
                                !(after_delete && result.is_ok()),
                                "a deleted key authenticated"
                            );
                            tokio::task::yield_now().await;
                        }
                    })
                })
                .collect();
            tokio::task::yield_now().await;
            auth.delete_api_key(pb::DeleteApiKeyRequest {
                account_id: account_id.clone(),
                id: key.record.unwrap().id,
            })
            .await
            .unwrap();
            deleted.store(true, Ordering::SeqCst);
            for lookup in lookups {
                lookup.await.unwrap();
            }
            assert!(auth.authenticate(authn(&key.secret)).await.is_err());
        }
    }

    #[tokio::test]
    async fn keys_deleted_elsewhere_stop_working_within_the_recheck_interval() {
        let (auth, _dir) = service().await;
        let (account_id, _) = account(&auth).await;
        let key = inference_key(&auth, &account_id, None).await;
        auth.authenticate(authn(&key.secret)).await.unwrap();
        // Another replica deletes it: straight in the database.
        sqlx::query("DELETE FROM api_keys WHERE id = $1")
            .bind(key.record.unwrap().id)
            .execute(auth.inner.db.pool())
            .await
            .unwrap();
        tokio::time::sleep(KEY_RECHECK).await;
        assert!(auth.authenticate(authn(&key.secret)).await.is_err());
    }

    fn request_path_reads(auth: &LocalAuth) -> u64 {
        auth.inner.request_path_reads.load(Ordering::Relaxed)
    }

    /// A key in steady use is re-checked by the background passes only: no
    /// request after the first reads the database, and a deletion made
    /// elsewhere (no event) is still refused within the re-check interval.
    #[tokio::test]
    async fn a_key_in_use_is_rechecked_in_the_background_and_a_deletion_still_lands_in_time() {
        let (auth, _dir) = service().await;
        let (account_id, _) = account(&auth).await;
        let key = inference_key(&auth, &account_id, None).await;
        auth.authenticate(authn(&key.secret)).await.unwrap();
        assert_eq!(request_path_reads(&auth), 1);
        // Well past KEY_RECHECK, requests every 20 ms never wait for a read.
        let until = Instant::now() + KEY_RECHECK * 2 + RECHECK_PASS;
        while Instant::now() < until {
            auth.authenticate(authn(&key.secret)).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            request_path_reads(&auth),
            1,
            "a cached key was read on the request path"
        );
        sqlx::query("DELETE FROM api_keys WHERE id = $1")
            .bind(key.record.unwrap().id)
            .execute(auth.inner.db.pool())
            .await
            .unwrap();
        let deleted = Instant::now();
        while auth.authenticate(authn(&key.secret)).await.is_ok() {
            assert!(
                deleted.elapsed() < KEY_RECHECK,
                "a key deleted elsewhere still works after the re-check interval"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A tier, cap or expiry changed elsewhere (no event) reaches the cached
    /// principal through the passes; an expiry moved into the past refuses.
    #[tokio::test]
    async fn changes_made_elsewhere_reach_the_cache_in_the_background() {
        let (auth, _dir) = service().await;
        let (account_id, _) = account(&auth).await;
        let key = inference_key(&auth, &account_id, None).await;
        let principal = auth.authenticate(authn(&key.secret)).await.unwrap();
        assert_eq!(principal.tier, "standard");
        sqlx::query("UPDATE accounts SET tier = 'partner' WHERE id = $1")
            .bind(&account_id)
            .execute(auth.inner.db.pool())
            .await
            .unwrap();
        let changed = Instant::now();
        loop {
            let principal = auth.authenticate(authn(&key.secret)).await.unwrap();
            if principal.tier == "partner" {
                break;
            }
            assert!(changed.elapsed() < KEY_RECHECK, "the tier never changed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(request_path_reads(&auth), 1);
        sqlx::query("UPDATE api_keys SET expires_at_ms = $1 WHERE id = $2")
            .bind(now_ms() - 1)
            .bind(key.record.unwrap().id)
            .execute(auth.inner.db.pool())
            .await
            .unwrap();
        // The pass drops it; the next request reads it and is refused.
        let expired = Instant::now();
        while auth.authenticate(authn(&key.secret)).await.is_ok() {
            assert!(
                expired.elapsed() < KEY_RECHECK,
                "an expired key still works"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A pass that read a key before it was deleted (or its account
    /// re-tiered) through this replica does not bring back what it read.
    #[tokio::test]
    async fn a_pass_that_read_before_a_revocation_does_not_undo_it() {
        let (auth, _dir) = service().await;
        let (account_id, _) = account(&auth).await;
        let key = inference_key(&auth, &account_id, None).await;
        let other = inference_key(&auth, &account_id, None).await;
        auth.authenticate(authn(&key.secret)).await.unwrap();
        auth.authenticate(authn(&other.secret)).await.unwrap();
        let asked = auth.inner.keys_to_recheck().unwrap();
        let read = auth.inner.read_keys(asked).await.unwrap();
        auth.delete_api_key(pb::DeleteApiKeyRequest {
            account_id: account_id.clone(),
            id: key.record.unwrap().id,
        })
        .await
        .unwrap();
        auth.inner.apply_recheck(read);
        assert!(auth.authenticate(authn(&key.secret)).await.is_err());

        let asked = auth.inner.keys_to_recheck().unwrap();
        let read = auth.inner.read_keys(asked).await.unwrap();
        auth.set_account_tier(pb::SetAccountTierRequest {
            account_id,
            tier: "partner".into(),
        })
        .await
        .unwrap();
        auth.inner.apply_recheck(read);
        let principal = auth.authenticate(authn(&other.secret)).await.unwrap();
        assert_eq!(principal.tier, "partner");
    }

    /// Without a pass in time (the database slow, the task stalled), a
    /// cached key is read on the request path again: the bound does not
    /// depend on the background task.
    #[tokio::test]
    async fn an_entry_not_confirmed_in_time_is_read_on_the_request_path() {
        let (auth, _dir) = service().await;
        let (account_id, _) = account(&auth).await;
        let key = inference_key(&auth, &account_id, None).await;
        auth.authenticate(authn(&key.secret)).await.unwrap();
        sqlx::query("DELETE FROM api_keys WHERE id = $1")
            .bind(key.record.unwrap().id)
            .execute(auth.inner.db.pool())
            .await
            .unwrap();
        for entry in auth.inner.cache.write().unwrap().values_mut() {
            entry.checked_at = Instant::now().checked_sub(KEY_RECHECK).unwrap();
        }
        assert!(auth.authenticate(authn(&key.secret)).await.is_err());
        assert_eq!(request_path_reads(&auth), 2);
    }

    #[tokio::test]
    async fn idle_keys_leave_the_cache_with_their_use_kept() {
        let (auth, _dir) = service().await;
        let (account_id, secret) = account(&auth).await;
        auth.authenticate(authn(&secret)).await.unwrap();
        let used = {
            let cache = auth.inner.cache.read().unwrap();
            let entry = cache.values().next().unwrap();
            let used = entry.usage.last_used_ms.load(Ordering::Acquire);
            // As if it were used KEEP_WARM ago.
            entry
                .usage
                .last_used_ms
                .store(used - KEEP_WARM.as_millis() as i64 - 1, Ordering::Release);
            used - KEEP_WARM.as_millis() as i64 - 1
        };
        assert!(auth.inner.keys_to_recheck().is_none());
        assert!(auth.inner.cache.read().unwrap().is_empty());
        auth.inner.flush_last_used().await;
        let keys = auth
            .list_api_keys(pb::ListApiKeysRequest { account_id })
            .await
            .unwrap()
            .keys;
        assert_eq!(keys[0].last_used_at_ms, Some(used));
    }

    #[tokio::test]
    async fn garbage_secrets_are_refused_without_a_query() {
        assert!(!plausible_secret("short"));
        assert!(!plausible_secret(
            "RIALTO_ADMIN_KEY_has spaces and more text"
        ));
        assert!(plausible_secret(
            "RIALTO_ADMIN_KEY_6gNXwu1AeVCrRwg7nr3zSYkYv38cVuG6oYseVXTsRSik"
        ));
    }

    #[tokio::test]
    async fn expired_keys_are_refused() {
        let (auth, _dir) = service().await;
        let (account_id, _) = account(&auth).await;
        let key = inference_key(&auth, &account_id, Some(now_ms() - 1)).await;
        let error = auth.authenticate(authn(&key.secret)).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::Unauthenticated);
    }

    #[tokio::test]
    async fn key_use_is_recorded_off_the_request_path() {
        let (auth, _dir) = service().await;
        let (account_id, secret) = account(&auth).await;
        auth.authenticate(authn(&secret)).await.unwrap();
        auth.inner.flush_last_used().await;
        let last_used = || async {
            auth.list_api_keys(pb::ListApiKeysRequest {
                account_id: account_id.clone(),
            })
            .await
            .unwrap()
            .keys[0]
                .last_used_at_ms
        };
        let first = last_used().await.unwrap();
        // A use whose entry left the cache (its account re-tiered) before
        // the flush is still written.
        tokio::time::sleep(Duration::from_millis(5)).await;
        auth.authenticate(authn(&secret)).await.unwrap();
        auth.set_account_tier(pb::SetAccountTierRequest {
            account_id: account_id.clone(),
            tier: "partner".into(),
        })
        .await
        .unwrap();
        assert!(auth.inner.cache.read().unwrap().is_empty());
        auth.inner.flush_last_used().await;
        assert!(last_used().await.unwrap() > first);
    }
}
