//! One actix actor per ledger owner: the owner's operations in this process
//! run one after the other, and the actor caches the owner's row so a hold
//! needs no read first.
//!
//! Each message is an [`AtomicResponse`]: the actor handles nothing else
//! until the database has answered, so one owner's holds never race each
//! other here (no conditional update retried for nothing), while owners run
//! in parallel on one arbiter per core. The cache is a convenience, never
//! the truth: every write returns the row it left (`RETURNING`) and the
//! cache takes it; a snapshot older than [`SNAPSHOT_TTL`] is read again
//! (another process may have credited the owner); a hold decided on a
//! stale snapshot fails its conditional update and is decided again on a
//! fresh read, and a refusal is only ever made on a fresh read. With several
//! billing replicas, owners are spread by consistent hash
//! ([`crate::replicas`]), so an owner's actor lives on one replica.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use rialto_core::{Error, Result};

use crate::ledger::{
    Balance, HoldOutcome, HoldSpec, KeyCap, Ledger, SettleOutcome, Snapshot, UsageDetail,
};

/// How long a cached row is trusted before it is read again.
pub const SNAPSHOT_TTL: Duration = Duration::from_secs(1);
/// An actor stops after this long without a message.
const IDLE: Duration = Duration::from_secs(60);

/// A hold to place, owned (messages cross threads).
#[derive(Debug, Clone)]
pub struct Hold {
    pub request_id: String,
    pub amount: i64,
    pub expires_at_ms: i64,
    pub cap: Option<KeyCap>,
}

impl Message for Hold {
    type Result = Result<HoldOutcome>;
}

/// A settlement of the owner's hold `request_id`.
#[derive(Debug, Clone)]
pub struct Settle {
    pub request_id: String,
    pub cost: i64,
    pub model_id: String,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
}

impl Message for Settle {
    type Result = Result<SettleOutcome>;
}

/// The owner's row (cached when fresh).
#[derive(Debug, Clone)]
pub struct Read;

impl Message for Read {
    type Result = Result<Snapshot>;
}

/// The row changed elsewhere (a credit, a stake): drop the cache.
#[derive(Debug, Clone)]
pub struct Forget;

impl Message for Forget {
    type Result = ();
}

pub struct LedgerActor {
    owner: Arc<str>,
    ledger: Ledger,
    /// The row and when it was read.
    cached: Option<(Snapshot, Instant)>,
    last_active: Instant,
    registry: Arc<LedgerActors>,
}

impl LedgerActor {
    fn fresh(&self) -> Option<Snapshot> {
        self.cached
            .filter(|(_, read_at)| read_at.elapsed() < SNAPSHOT_TTL)
            .map(|(snapshot, _)| snapshot)
    }

    /// A write's resulting balance; keeps the read time, so the stake and
    /// epoch are still read again once the snapshot ages.
    fn remember(&mut self, balance: Option<Balance>) {
        if let (Some(balance), Some((snapshot, _))) = (balance, &mut self.cached) {
            snapshot.balance = balance;
        }
    }
}

impl Actor for LedgerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(IDLE / 2, |actor, ctx| {
            if actor.last_active.elapsed() >= IDLE {
                ctx.stop();
            }
        });
    }

    fn stopped(&mut self, ctx: &mut Self::Context) {
        self.registry.forget(&self.owner, &ctx.address());
    }
}

impl Handler<Hold> for LedgerActor {
    type Result = AtomicResponse<Self, Result<HoldOutcome>>;

    fn handle(&mut self, hold: Hold, _: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        let (ledger, owner, known) = (self.ledger.clone(), self.owner.clone(), self.fresh());
        let work = async move {
            // No fresh row: read it once, and the next holds of the next
            // second need no read.
            let read = match known {
                Some(_) => None,
                None => Some(ledger.snapshot(&owner).await?),
            };
            let spec = HoldSpec {
                owner: &owner,
                request_id: &hold.request_id,
                amount: hold.amount,
                expires_at_ms: hold.expires_at_ms,
                cap: hold.cap.as_ref(),
            };
            let (outcome, after) = ledger.hold_from(&spec, known.or(read)).await?;
            Ok((outcome, after, read))
        };
        AtomicResponse::new(Box::pin(work.into_actor(self).map(
            |result: Result<(HoldOutcome, Option<Balance>, Option<Snapshot>)>, actor, _| {
                match result {
                    Ok((outcome, after, read)) => {
                        if let Some(read) = read {
                            actor.cached = Some((read, Instant::now()));
                        }
                        actor.remember(after);
                        Ok(outcome)
                    }
                    Err(error) => {
                        actor.cached = None;
                        Err(error)
                    }
                }
            },
        )))
    }
}

impl Handler<Settle> for LedgerActor {
    type Result = AtomicResponse<Self, Result<SettleOutcome>>;

    fn handle(&mut self, settle: Settle, _: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        let ledger = self.ledger.clone();
        let work = async move {
            let usage = UsageDetail {
                model_id: &settle.model_id,
                prompt_tokens: settle.prompt_tokens,
                completion_tokens: settle.completion_tokens,
            };
            ledger
                .settle_tracked(&settle.request_id, settle.cost, &usage)
                .await
        };
        AtomicResponse::new(Box::pin(work.into_actor(self).map(
            |result, actor, _| match result {
                Ok((outcome, after)) => {
                    actor.remember(after);
                    Ok(outcome)
                }
                Err(error) => {
                    actor.cached = None;
                    Err(error)
                }
            },
        )))
    }
}

impl Handler<Read> for LedgerActor {
    type Result = AtomicResponse<Self, Result<Snapshot>>;

    fn handle(&mut self, _: Read, _: &mut Self::Context) -> Self::Result {
        self.last_active = Instant::now();
        if let Some(snapshot) = self.fresh() {
            return AtomicResponse::new(Box::pin(actix::fut::ready(Ok(snapshot))));
        }
        let (ledger, owner) = (self.ledger.clone(), self.owner.clone());
        let work = async move { ledger.snapshot(&owner).await };
        AtomicResponse::new(Box::pin(work.into_actor(self).map(|result, actor, _| {
            actor.cached = result.as_ref().ok().map(|s| (*s, Instant::now()));
            result
        })))
    }
}

impl Handler<Forget> for LedgerActor {
    type Result = ();

    fn handle(&mut self, _: Forget, _: &mut Self::Context) {
        self.cached = None;
    }
}

/// Finds or starts the actor of an owner, on its shard's arbiter.
pub struct LedgerActors {
    ledger: Ledger,
    shards: Vec<Shard>,
    hasher: RandomState,
}

impl std::fmt::Debug for LedgerActors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerActors")
            .field("shards", &self.shards.len())
            .finish()
    }
}

struct Shard {
    arbiter: ArbiterHandle,
    actors: Mutex<HashMap<Arc<str>, Addr<LedgerActor>>>,
}

impl LedgerActors {
    /// One arbiter per shard (usually one per core). Must be called where an
    /// actix `System` runs.
    pub fn start(ledger: Ledger, shards: usize) -> Arc<Self> {
        Arc::new(Self {
            ledger,
            shards: (0..shards.max(1))
                .map(|_| Shard {
                    arbiter: Arbiter::new().handle(),
                    actors: Mutex::new(HashMap::new()),
                })
                .collect(),
            hasher: RandomState::new(),
        })
    }

    fn shard(&self, owner: &str) -> &Shard {
        &self.shards[self.hasher.hash_one(owner) as usize % self.shards.len()]
    }

    fn get(self: &Arc<Self>, owner: &str) -> Addr<LedgerActor> {
        let shard = self.shard(owner);
        let mut actors = shard.actors.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(addr) = actors.get(owner).filter(|a| a.connected()) {
            return addr.clone();
        }
        let owner: Arc<str> = owner.into();
        let actor = LedgerActor {
            owner: owner.clone(),
            ledger: self.ledger.clone(),
            cached: None,
            last_active: Instant::now(),
            registry: self.clone(),
        };
        let addr = LedgerActor::start_in_arbiter(&shard.arbiter, move |_| actor);
        actors.insert(owner, addr.clone());
        addr
    }

    fn forget(&self, owner: &str, addr: &Addr<LedgerActor>) {
        let mut actors = self
            .shard(owner)
            .actors
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if actors.get(owner) == Some(addr) {
            actors.remove(owner);
        }
    }

    /// Sends `message` to the owner's actor; once more to a new actor if
    /// that one stopped meanwhile.
    pub async fn send<M>(self: &Arc<Self>, owner: &str, message: M) -> Result<M::Result>
    where
        M: Message + Clone + Send + 'static,
        M::Result: Send,
        LedgerActor: Handler<M>,
    {
        match self.get(owner).send(message.clone()).await {
            Ok(result) => Ok(result),
            Err(_) => self
                .get(owner)
                .send(message)
                .await
                .map_err(|e| Error::internal(format_args!("ledger actor: {e}"))),
        }
    }

    /// Drops the owner's cached row, if it has an actor.
    pub fn forget_cache(&self, owner: &str) {
        let actors = self
            .shard(owner)
            .actors
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(addr) = actors.get(owner) {
            addr.do_send(Forget);
        }
    }
}
