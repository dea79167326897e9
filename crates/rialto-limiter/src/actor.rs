//! One actix actor per principal, owning that principal's windows, and the
//! registry that finds or starts it.
//!
//! A decision is one synchronous message handler: no `.await` between
//! reading a window and updating it, so concurrent requests of one principal
//! are decided one after the other, exactly. Actors of different principals
//! run in parallel on one arbiter (thread) per core, sharded by a hash of
//! the principal. An actor stops itself once idle with empty windows, so
//! stopping loses nothing.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::now_ms;
use actix::prelude::*;
use rialto_proto::limiter::v1 as pb;
use tokio::sync::mpsc;

use crate::window::Window;

/// Where actors send the limit hits they find. Bounded: when the log
/// cannot keep up, hits are dropped rather than held in memory.
pub type HitSink = mpsc::Sender<pb::LimitHit>;

/// The longest a request is expected to run: an actor waits this long for
/// the commits of admitted requests before it may stop.
const MAX_REQUEST_MS: i64 = 3_600_000;

/// At most one log entry per window and limit type per this many ms: a
/// client hammering a full window must not turn into a database flood.
const HIT_LOG_INTERVAL_MS: i64 = 1_000;

/// Shared, so a retry after an actor stopped needs no copy of the request.
pub struct Admit(pub Arc<pb::AdmitRequest>);

impl Message for Admit {
    type Result = pb::AdmitResponse;
}

pub struct Commit(pub pb::CommitRequest);

impl Message for Commit {
    type Result = ();
}

struct NamedWindow {
    window: Window,
    /// When a hit was last logged, per (hash of the API key, limit type):
    /// account and global windows are shared by many keys, and each key's
    /// account must see its own hits.
    last_logged_ms: HashMap<(u64, u8), i64>,
    swept_ms: i64,
}

pub struct PrincipalActor {
    principal: Arc<str>,
    windows: HashMap<String, NamedWindow>,
    span_ms: i64,
    idle_ms: i64,
    last_active_ms: i64,
    /// Admitted requests not yet committed or released.
    in_flight: u64,
    hits: HitSink,
    registry: Arc<Registry>,
    tags: RandomState,
}

impl PrincipalActor {
    fn tag(&self, request_id: &str) -> u64 {
        self.tags.hash_one(request_id)
    }

    fn is_idle(&mut self, now_ms: i64) -> bool {
        let quiet = now_ms - self.last_active_ms;
        // Requests still running (a long stream) will commit here: wait for
        // them, up to a bound for commits that never come (a crash).
        let waiting = self.in_flight > 0 && quiet < MAX_REQUEST_MS;
        quiet >= self.idle_ms
            && !waiting
            && self.windows.values_mut().all(|w| w.window.is_empty(now_ms))
    }
}

impl Actor for PrincipalActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let every = Duration::from_millis((self.idle_ms / 2).clamp(100, 30_000) as u64);
        ctx.run_interval(every, |actor, ctx| {
            if actor.is_idle(now_ms()) {
                ctx.stop();
            }
        });
    }

    fn stopped(&mut self, ctx: &mut Self::Context) {
        self.registry.forget(&self.principal, &ctx.address());
    }
}

impl Handler<Admit> for PrincipalActor {
    type Result = MessageResult<Admit>;

    fn handle(&mut self, Admit(request): Admit, _: &mut Self::Context) -> Self::Result {
        let now = now_ms();
        self.last_active_ms = now;
        let tag = self.tag(&request.request_id);
        let limit = request.limit.unwrap_or_default();
        // Two lookups rather than `entry`, whose key would be a fresh
        // String on every decision.
        if !self.windows.contains_key(&request.window) {
            let window = NamedWindow {
                window: Window::new(self.span_ms),
                last_logged_ms: HashMap::new(),
                swept_ms: 0,
            };
            self.windows.insert(request.window.clone(), window);
        }
        let Some(named) = self.windows.get_mut(&request.window) else {
            return MessageResult(pb::AdmitResponse::default());
        };
        if request.peek {
            return MessageResult(pb::AdmitResponse {
                admitted: true,
                state: Some(named.window.state(now, &limit)),
                ..Default::default()
            });
        }
        let decision = named
            .window
            .admit(now, &limit, request.estimated_tokens, tag);
        let state = Some(named.window.state(now, &limit));
        if decision.is_ok() {
            self.in_flight += 1;
        }
        MessageResult(match decision {
            Ok(()) => pb::AdmitResponse {
                admitted: true,
                refused_by: String::new(),
                retry_at_ms: 0,
                state,
            },
            Err(refusal) => {
                let slot = (self.tags.hash_one(&request.key_id), refusal.by as u8);
                let logged = &mut named.last_logged_ms;
                // Swept at most once an interval: a flood of keys refused by a
                // shared window costs one pass a second, not one per refusal.
                if logged.len() > 1024 && now.saturating_sub(named.swept_ms) >= HIT_LOG_INTERVAL_MS
                {
                    logged.retain(|_, at| now.saturating_sub(*at) < HIT_LOG_INTERVAL_MS);
                    named.swept_ms = now;
                }
                let last = logged.get(&slot).copied().unwrap_or(i64::MIN);
                if now.saturating_sub(last) >= HIT_LOG_INTERVAL_MS {
                    logged.insert(slot, now);
                    let _ = self.hits.try_send(pb::LimitHit {
                        account_id: request.account_id.clone(),
                        api_key_id: request.key_id.clone(),
                        model_id: request.window.clone(),
                        tier: request.tier.clone(),
                        limit_type: refusal.by.as_str().to_owned(),
                        at_ms: now,
                    });
                }
                pb::AdmitResponse {
                    admitted: false,
                    refused_by: refusal.by.as_str().to_owned(),
                    retry_at_ms: refusal.retry_at_ms,
                    state,
                }
            }
        })
    }
}

impl Handler<Commit> for PrincipalActor {
    type Result = ();

    fn handle(&mut self, Commit(request): Commit, _: &mut Self::Context) {
        let now = now_ms();
        self.in_flight = self.in_flight.saturating_sub(1);
        let tag = self.tag(&request.request_id);
        if let Some(named) = self.windows.get_mut(&request.window) {
            named.window.commit(
                now,
                tag,
                request.estimated_tokens,
                request.used_tokens,
                request.release,
            );
        }
    }
}

/// Finds the actor of a principal, starting it on its shard's arbiter on
/// first use.
pub struct Registry {
    shards: Vec<Shard>,
    hasher: RandomState,
    span_ms: i64,
    idle_ms: i64,
    hits: HitSink,
}

struct Shard {
    arbiter: ArbiterHandle,
    actors: Mutex<HashMap<Arc<str>, Addr<PrincipalActor>>>,
}

impl Registry {
    /// One arbiter per shard; `shards` is usually the number of cores.
    /// Must be called where an actix `System` runs.
    pub fn new(shards: usize, span_ms: i64, idle_ms: i64, hits: HitSink) -> Arc<Self> {
        let shards = (0..shards.max(1))
            .map(|_| Shard {
                arbiter: Arbiter::new().handle(),
                actors: Mutex::new(HashMap::new()),
            })
            .collect();
        Arc::new(Self {
            shards,
            hasher: RandomState::new(),
            span_ms,
            idle_ms,
            hits,
        })
    }

    fn shard(&self, principal: &str) -> &Shard {
        let index = self.hasher.hash_one(principal) as usize % self.shards.len();
        &self.shards[index]
    }

    /// The principal's actor, started if it has none (or its last one stopped).
    pub fn get(self: &Arc<Self>, principal: &str) -> Addr<PrincipalActor> {
        let shard = self.shard(principal);
        let mut actors = shard.actors.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(addr) = actors.get(principal).filter(|a| a.connected()) {
            return addr.clone();
        }
        let principal: Arc<str> = principal.into();
        let actor = PrincipalActor {
            principal: principal.clone(),
            windows: HashMap::new(),
            span_ms: self.span_ms,
            idle_ms: self.idle_ms,
            last_active_ms: now_ms(),
            in_flight: 0,
            hits: self.hits.clone(),
            registry: self.clone(),
            tags: RandomState::new(),
        };
        let addr = PrincipalActor::start_in_arbiter(&shard.arbiter, move |_| actor);
        actors.insert(principal, addr.clone());
        addr
    }

    /// The principal's actor if it has one: commits never start an actor
    /// (a replica without the principal's windows has nothing to correct).
    pub fn existing(&self, principal: &str) -> Option<Addr<PrincipalActor>> {
        let actors = self
            .shard(principal)
            .actors
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        actors.get(principal).filter(|a| a.connected()).cloned()
    }

    fn forget(&self, principal: &str, addr: &Addr<PrincipalActor>) {
        let mut actors = self
            .shard(principal)
            .actors
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if actors.get(principal) == Some(addr) {
            actors.remove(principal);
        }
    }

    /// Live actors, for tests and metrics.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.actors.lock().map(|a| a.len()).unwrap_or_default())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
