//! The windows of every principal this replica holds, in a sharded map, and
//! the decisions made on them.
//!
//! A principal (`key:<id>`, `user:<account>`, `global:<model>`) lives in one
//! of a fixed number of shards, chosen by a hash of its name; each shard is a
//! `std::sync::Mutex` over a map from principal to its windows. A decision
//! (admit, peek, commit or release) locks the principal's shard, reads and
//! updates one window and unlocks: one short synchronous critical section on
//! the caller's thread, with no `.await`, channel or message between reading
//! a window and updating it. Concurrent requests of one principal are
//! therefore decided one after the other, exactly, whichever threads they
//! run on; principals of different shards are decided in parallel. Nothing
//! slow happens under a lock: a limit hit to log is built and queued after
//! the shard is unlocked.
//!
//! A sweeper (spawned by [`LocalLimiter::start`](crate::LocalLimiter::start))
//! drops the principals that have been idle for `limits.idle_secs` with
//! empty windows and no admitted request still waiting for its commit, so
//! dropping one loses nothing: its next request starts from the same empty
//! windows.

use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use rialto_core::hashing::{HashMap, RandomState};
use rialto_proto::limiter::v1 as pb;
use tokio::sync::mpsc;

use crate::clock::now_ms;
use crate::window::Window;

/// Where decisions send the limit hits they find. Bounded: when the log
/// cannot keep up, hits are dropped rather than held in memory.
pub type HitSink = mpsc::Sender<pb::LimitHit>;

/// The longest a request is expected to run: a principal's windows are kept
/// this long for the commits of admitted requests before they may be dropped.
const MAX_REQUEST_MS: i64 = 3_600_000;

/// At most one log entry per window and limit type per this many ms: a
/// client hammering a full window must not turn into a database flood.
const HIT_LOG_INTERVAL_MS: i64 = 1_000;

/// Entries of a window's hit-log throttle past which stale ones are swept.
const LOGGED_SWEEP_LEN: usize = 1024;

/// One admission (or, with `peek`, a look at a window), borrowed from the
/// caller: the fields of [`pb::AdmitRequest`] without owning them.
#[derive(Debug, Clone, Copy)]
pub struct Admit<'a> {
    pub request_id: &'a str,
    pub principal: &'a str,
    /// Window name: the model id, or `endpoint:<path>`.
    pub window: &'a str,
    pub limit: pb::Limit,
    pub estimated_tokens: u64,
    /// Who asked, for the rate-limit log.
    pub account_id: &'a str,
    pub key_id: &'a str,
    pub tier: &'a str,
    /// Only read the window's state; take nothing.
    pub peek: bool,
}

impl<'a> Admit<'a> {
    /// A borrowed view of a request received whole (gRPC, the trait).
    pub fn of(request: &'a pb::AdmitRequest) -> Self {
        Self {
            request_id: &request.request_id,
            principal: &request.principal,
            window: &request.window,
            limit: request.limit.unwrap_or_default(),
            estimated_tokens: request.estimated_tokens,
            account_id: &request.account_id,
            key_id: &request.key_id,
            tier: &request.tier,
            peek: request.peek,
        }
    }
}

/// The end of an admitted request, borrowed: the fields of
/// [`pb::CommitRequest`].
#[derive(Debug, Clone, Copy)]
pub struct Commit<'a> {
    pub request_id: &'a str,
    pub principal: &'a str,
    pub window: &'a str,
    /// The tokens taken at admission.
    pub estimated_tokens: u64,
    /// The tokens really used.
    pub used_tokens: u64,
    /// Gives the slot back (a request that never ran) instead.
    pub release: bool,
}

impl<'a> Commit<'a> {
    pub fn of(request: &'a pb::CommitRequest) -> Self {
        Self {
            request_id: &request.request_id,
            principal: &request.principal,
            window: &request.window,
            estimated_tokens: request.estimated_tokens,
            used_tokens: request.used_tokens,
            release: request.release,
        }
    }
}

struct NamedWindow {
    window: Window,
    /// When a hit was last logged, per (hash of the API key, limit type):
    /// account and global windows are shared by many keys, and each key's
    /// account must see its own hits.
    last_logged_ms: HashMap<(u64, u8), i64>,
    swept_ms: i64,
}

/// Everything a replica holds about one principal.
struct PrincipalWindows {
    /// Per window name (model id or `endpoint:<path>`).
    windows: HashMap<Box<str>, NamedWindow>,
    last_active_ms: i64,
    /// Admitted requests not yet committed or released.
    in_flight: u64,
}

impl PrincipalWindows {
    fn is_idle(&mut self, now_ms: i64, idle_ms: i64) -> bool {
        let quiet = now_ms.saturating_sub(self.last_active_ms);
        // Requests still running (a long stream) will commit here: wait for
        // them, up to a bound for commits that never come (a crash).
        let waiting = self.in_flight > 0 && quiet < MAX_REQUEST_MS;
        quiet >= idle_ms && !waiting && self.windows.values_mut().all(|w| w.window.is_empty(now_ms))
    }
}

type Shard = Mutex<HashMap<Box<str>, PrincipalWindows>>;

/// The sharded windows of one replica.
pub struct Principals {
    shards: Box<[Shard]>,
    /// Picks a principal's shard.
    hasher: RandomState,
    /// Tags requests (a hash of the request id) and keys (for the hit log).
    tags: RandomState,
    span_ms: i64,
    idle_ms: i64,
    hits: HitSink,
}

impl std::fmt::Debug for Principals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Principals")
            .field("shards", &self.shards.len())
            .field("held", &self.len())
            .finish()
    }
}

/// What a refusal leaves to do once the shard is unlocked.
struct HitToLog {
    limit_type: &'static str,
    at_ms: i64,
}

impl Principals {
    /// `shards` mutexes (at least one), windows of `span_ms`, principals
    /// dropped after `idle_ms` idle with empty windows.
    pub fn new(shards: usize, span_ms: i64, idle_ms: i64, hits: HitSink) -> Self {
        let shards = (0..shards.max(1))
            .map(|_| Mutex::new(HashMap::default()))
            .collect();
        Self {
            shards,
            hasher: RandomState::default(),
            tags: RandomState::default(),
            span_ms,
            idle_ms,
            hits,
        }
    }

    /// The shard count for a machine of `cores` cores: enough that two
    /// threads rarely want the same lock for different principals.
    pub fn shards_for(cores: usize) -> usize {
        cores.saturating_mul(16).clamp(16, 1024).next_power_of_two()
    }

    fn shard(&self, principal: &str) -> MutexGuard<'_, HashMap<Box<str>, PrincipalWindows>> {
        let index = self.hasher.hash_one(principal) as usize % self.shards.len();
        // A panic under the lock cannot leave a window half-updated in a way
        // that matters more than refusing every request of the shard would.
        self.shards[index].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits a request into its window (creating the principal and the
    /// window on first use), or refuses it and queues a limit hit; with
    /// `peek`, only reports the window's state.
    pub fn admit(&self, request: &Admit<'_>) -> pb::AdmitResponse {
        let tag = self.tags.hash_one(request.request_id);
        let (response, hit) = {
            let mut shard = self.shard(request.principal);
            // Read under the lock: a window's entries must be in the order
            // of their times.
            let now = now_ms();
            // Two lookups rather than `entry`, whose key would be a fresh
            // allocation on every decision.
            if !shard.contains_key(request.principal) {
                shard.insert(
                    request.principal.into(),
                    PrincipalWindows {
                        windows: HashMap::default(),
                        last_active_ms: now,
                        in_flight: 0,
                    },
                );
            }
            let Some(principal) = shard.get_mut(request.principal) else {
                return pb::AdmitResponse::default();
            };
            principal.last_active_ms = now;
            if !principal.windows.contains_key(request.window) {
                principal.windows.insert(
                    request.window.into(),
                    NamedWindow {
                        window: Window::new(self.span_ms),
                        last_logged_ms: HashMap::default(),
                        swept_ms: 0,
                    },
                );
            }
            let Some(named) = principal.windows.get_mut(request.window) else {
                return pb::AdmitResponse::default();
            };
            if request.peek {
                return pb::AdmitResponse {
                    admitted: true,
                    state: Some(named.window.state(now, &request.limit)),
                    ..Default::default()
                };
            }
            let decision = named
                .window
                .admit(now, &request.limit, request.estimated_tokens, tag);
            let state = Some(named.window.state(now, &request.limit));
            match decision {
                Ok(()) => {
                    principal.in_flight += 1;
                    let response = pb::AdmitResponse {
                        admitted: true,
                        refused_by: String::new(),
                        retry_at_ms: 0,
                        state,
                    };
                    (response, None)
                }
                Err(refusal) => {
                    let slot = (self.tags.hash_one(request.key_id), refusal.by as u8);
                    let logged = &mut named.last_logged_ms;
                    // Swept at most once an interval: a flood of keys refused
                    // by a shared window costs one pass a second, not one per
                    // refusal.
                    if logged.len() > LOGGED_SWEEP_LEN
                        && now.saturating_sub(named.swept_ms) >= HIT_LOG_INTERVAL_MS
                    {
                        logged.retain(|_, at| now.saturating_sub(*at) < HIT_LOG_INTERVAL_MS);
                        named.swept_ms = now;
                    }
                    let last = logged.get(&slot).copied().unwrap_or(i64::MIN);
                    let hit = (now.saturating_sub(last) >= HIT_LOG_INTERVAL_MS).then(|| {
                        logged.insert(slot, now);
                        HitToLog {
                            limit_type: refusal.by.as_str(),
                            at_ms: now,
                        }
                    });
                    let response = pb::AdmitResponse {
                        admitted: false,
                        refused_by: refusal.by.as_str().to_owned(),
                        retry_at_ms: refusal.retry_at_ms,
                        state,
                    };
                    (response, hit)
                }
            }
        };
        if let Some(hit) = hit {
            let _ = self.hits.try_send(pb::LimitHit {
                account_id: request.account_id.to_owned(),
                api_key_id: request.key_id.to_owned(),
                model_id: request.window.to_owned(),
                tier: request.tier.to_owned(),
                limit_type: hit.limit_type.to_owned(),
                at_ms: hit.at_ms,
            });
        }
        response
    }

    /// Replaces an admitted request's estimate by the tokens it used, or
    /// releases its slot. A principal this replica does not hold is left
    /// alone: a replica without its windows has nothing to correct.
    pub fn commit(&self, request: &Commit<'_>) {
        let tag = self.tags.hash_one(request.request_id);
        let mut shard = self.shard(request.principal);
        let Some(principal) = shard.get_mut(request.principal) else {
            return;
        };
        principal.in_flight = principal.in_flight.saturating_sub(1);
        if let Some(named) = principal.windows.get_mut(request.window) {
            named.window.commit(
                now_ms(),
                tag,
                request.estimated_tokens,
                request.used_tokens,
                request.release,
            );
        }
    }

    /// Applies another replica's admission or release (a
    /// [`pb::WindowEvent`]) to this replica's copy of the principal's
    /// window, creating it when missing: the copy the successor decides
    /// from once the owner is gone. An admission counts from now, when it
    /// is heard (never earlier than the owner counted it, whatever the two
    /// clocks say). Idempotent per request.
    pub fn replay(&self, event: &pb::WindowEvent) {
        let tag = self.tags.hash_one(&event.request_id);
        let mut shard = self.shard(&event.principal);
        let now = now_ms();
        if event.release {
            let Some(principal) = shard.get_mut(event.principal.as_str()) else {
                return;
            };
            if let Some(named) = principal.windows.get_mut(event.window.as_str()) {
                principal.in_flight = principal.in_flight.saturating_sub(1);
                named
                    .window
                    .commit(now, tag, event.estimated_tokens, 0, true);
            }
            return;
        }
        // Lookups first: a key is allocated only for a principal or window
        // met for the first time.
        if !shard.contains_key(event.principal.as_str()) {
            shard.insert(
                event.principal.as_str().into(),
                PrincipalWindows {
                    windows: HashMap::default(),
                    last_active_ms: now,
                    in_flight: 0,
                },
            );
        }
        let Some(principal) = shard.get_mut(event.principal.as_str()) else {
            return;
        };
        principal.last_active_ms = now;
        if !principal.windows.contains_key(event.window.as_str()) {
            principal.windows.insert(
                event.window.as_str().into(),
                NamedWindow {
                    window: Window::new(self.span_ms),
                    last_logged_ms: HashMap::default(),
                    swept_ms: 0,
                },
            );
        }
        let Some(named) = principal.windows.get_mut(event.window.as_str()) else {
            return;
        };
        let day_count = (event.day_count > 0).then_some(event.day_count);
        let added = named
            .window
            .replay(now, now, event.estimated_tokens, tag, day_count);
        // Its commit arrives on the bus like the owner's.
        principal.in_flight += u64::from(added);
    }

    /// The requests of `principal` admitted in `window` on the UTC day of
    /// `now_ms` (0 when it has none here).
    pub fn day_count(&self, principal: &str, window: &str, now_ms: i64) -> u64 {
        let mut shard = self.shard(principal);
        shard
            .get_mut(principal)
            .and_then(|p| p.windows.get_mut(window))
            .map_or(0, |named| named.window.day_count(now_ms))
    }

    /// Drops the principals idle with empty windows, one shard at a time;
    /// returns how many were dropped.
    pub fn sweep(&self) -> usize {
        (0..self.shards.len()).map(|i| self.sweep_shard(i)).sum()
    }

    fn sweep_shard(&self, index: usize) -> usize {
        let Some(shard) = self.shards.get(index) else {
            return 0;
        };
        let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
        let before = shard.len();
        let now = now_ms();
        shard.retain(|_, principal| !principal.is_idle(now, self.idle_ms));
        before - shard.len()
    }

    /// How often the sweeper looks for idle principals.
    fn sweep_every(&self) -> Duration {
        Duration::from_millis((self.idle_ms / 2).clamp(100, 30_000) as u64)
    }

    /// Principals held, for tests and metrics.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Sweeps `principals` every `idle_secs / 2` (at least every 30 s) on the
/// current Tokio runtime, until they are dropped. Yields between shards, so
/// a sweep of many principals never holds a worker for long.
pub fn spawn_sweeper(principals: &Arc<Principals>) {
    let every = principals.sweep_every();
    let shards = principals.shards.len();
    let principals: Weak<Principals> = Arc::downgrade(principals);
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            for index in 0..shards {
                let Some(principals) = principals.upgrade() else {
                    return;
                };
                principals.sweep_shard(index);
                drop(principals);
                tokio::task::yield_now().await;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(requests: u64) -> pb::Limit {
        pb::Limit {
            requests,
            tokens: 0,
            requests_per_day: 0,
        }
    }

    fn admit<'a>(principal: &'a str, request_id: &'a str, limit: pb::Limit) -> Admit<'a> {
        Admit {
            request_id,
            principal,
            window: "chat",
            limit,
            estimated_tokens: 0,
            account_id: "acct",
            key_id: "k",
            tier: "standard",
            peek: false,
        }
    }

    #[test]
    fn commits_never_create_a_principal_and_sweeps_wait_for_in_flight_requests() {
        let (hits, _events) = mpsc::channel(16);
        // Windows of 1 ms, dropped as soon as idle.
        let principals = Principals::new(4, 1, 0, hits);
        let one = limit(1);
        principals.commit(&Commit {
            request_id: "r",
            principal: "key:absent",
            window: "chat",
            estimated_tokens: 0,
            used_tokens: 10,
            release: false,
        });
        assert!(principals.is_empty());
        assert!(principals.admit(&admit("key:a", "r1", one)).admitted);
        std::thread::sleep(Duration::from_millis(5));
        // The window is empty again, but r1 has not committed yet.
        assert_eq!(principals.sweep(), 0);
        principals.commit(&Commit {
            request_id: "r1",
            principal: "key:a",
            window: "chat",
            estimated_tokens: 0,
            used_tokens: 0,
            release: false,
        });
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(principals.sweep(), 1);
        assert!(principals.is_empty());
    }

    #[test]
    fn a_refusal_is_logged_once_a_second_per_key_and_limit() {
        let (hits, mut events) = mpsc::channel(16);
        let principals = Principals::new(4, 60_000, 60_000, hits);
        let one = limit(1);
        assert!(principals.admit(&admit("user:a", "r1", one)).admitted);
        for i in 0..5 {
            let id = format!("r{}", i + 2);
            let refused = principals.admit(&admit("user:a", &id, one));
            assert!(!refused.admitted);
            assert_eq!(refused.refused_by, "RPM");
        }
        let mut other = admit("user:a", "r9", one);
        other.key_id = "k2";
        assert!(!principals.admit(&other).admitted);
        let first = events.try_recv().unwrap();
        assert_eq!(
            (first.api_key_id.as_str(), first.limit_type.as_str()),
            ("k", "RPM")
        );
        assert_eq!(events.try_recv().unwrap().api_key_id, "k2");
        assert!(events.try_recv().is_err());
    }
}
