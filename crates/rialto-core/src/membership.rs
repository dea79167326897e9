//! Which replicas of a service are alive, and so which one owns a principal.
//!
//! A principal (a limiter's `key:<id>`, a billing ledger's `account:<id>`)
//! is owned by the first replica in its rendezvous order
//! ([`placement`](crate::placement)) that is *ready*. With failover on (the
//! bus is NATS and several replicas are listed), every limiter and billing
//! replica publishes a heartbeat on `<prefix>.replicas.<service>` every
//! `failover.heartbeat_ms`, and every process that routes to them (gateways,
//! and the replicas themselves) hears them:
//!
//! - a replica heard within `dead_after_ms` is *live*; one silent that long
//!   is dead (several heartbeats missed, never one late beat), and its
//!   principals go to the next ready replica in their order;
//! - a live replica is *ready* once it has been heard without a gap for
//!   `rejoin_after_ms` (a limiter: at least a rate window, so that it has
//!   heard every admission still in its windows); a restarted process (a
//!   new incarnation) or one silent past `dead_after_ms` (a SIGSTOP, a
//!   partition) starts that run again, and its principals come back to it
//!   only at its end.
//!
//! For its first `dead_after_ms` a process has not had time to hear anyone:
//! it counts every other replica as ready (the placement of a cluster where
//! nobody is down), and only itself as starting a run. When nobody is
//! ready the owner is the first live replica, and when nobody is live, the
//! plain rendezvous owner: without failover ([`Membership::fixed`]) that is
//! all there is.
//!
//! The request path reads two atomics (the ready and live bit sets) and
//! hashes the principal once per replica, as the plain placement did; a
//! watcher task recomputes the sets every 50 ms and logs and counts each
//! change (`rialto_replica_up`, `rialto_ownership_moves_total`,
//! `rialto_replica_away_seconds`).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::watch;

use crate::bus::Bus;
use crate::config::FailoverConfig;
use crate::placement::{replica_seed, score};

/// The most replicas one service may list: the sets are bits of a `u64`.
pub const MAX_REPLICAS: usize = 64;
/// How often the watcher recomputes who is live and ready.
const WATCH_EVERY: Duration = Duration::from_millis(50);
/// Never heard.
const NEVER: i64 = i64::MIN;
/// How long a replica back from being away still counts itself away: three
/// of the watcher's ticks, by which every other process heard it too.
const RETURN_GRACE_MS: i64 = 3 * WATCH_EVERY.as_millis() as i64;

/// The heartbeat's timing, from `[failover]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub heartbeat: Duration,
    pub dead_after: Duration,
    pub rejoin_after: Duration,
}

impl Timing {
    pub fn from_config(config: &FailoverConfig) -> Self {
        Self {
            heartbeat: Duration::from_millis(config.heartbeat_ms.max(1)),
            dead_after: Duration::from_millis(config.dead_after_ms.max(1)),
            rejoin_after: Duration::from_millis(config.rejoin_after_ms),
        }
    }

    /// The same, with a run of at least `at_least` before a replica that
    /// came back owns again.
    pub fn rejoining_after_at_least(mut self, at_least: Duration) -> Self {
        self.rejoin_after = self.rejoin_after.max(at_least);
        self
    }
}

/// What one process knows of the replicas of one service. Cloning shares it.
#[derive(Clone)]
pub struct Membership(Arc<Inner>);

struct Inner {
    service: &'static str,
    /// Heartbeats are heard (`track`): owners can move.
    tracked: std::sync::atomic::AtomicBool,
    names: Box<[String]>,
    seeds: Box<[u64]>,
    me: Option<usize>,
    timing: Timing,
    /// The origin of this process's milliseconds (monotonic).
    origin: Instant,
    slots: Box<[Slot]>,
    /// Bit `i`: replica `i` is ready (may own).
    ready: AtomicU64,
    /// Bit `i`: replica `i` is live.
    live: AtomicU64,
    /// Bit `i`: replica `i` is live and up about as long as the longest
    /// (the owners when nobody is ready).
    senior: AtomicU64,
    /// The number of changes of `ready`: owners may have moved.
    changes: watch::Sender<u64>,
    /// Called when this replica is heard again after a gap, before its own
    /// slot says so: what it held in memory may have been taken meanwhile.
    on_return: Mutex<Vec<Box<dyn Fn() + Send + Sync>>>,
    /// When this replica last heard itself again after being away.
    returned_ms: AtomicI64,
}

/// One replica as heard here. Written only by the heartbeat listener.
struct Slot {
    /// When last heard (ms since `origin`), or `NEVER`.
    heard_ms: AtomicI64,
    /// Since when heard without a gap, in the same incarnation.
    run_since_ms: AtomicI64,
    incarnation: AtomicU64,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("service", &self.0.service)
            .field("replicas", &self.0.names.len())
            .field(
                "ready",
                &format_args!("{:b}", self.0.ready.load(Ordering::Relaxed)),
            )
            .finish()
    }
}

impl Membership {
    /// Replicas that are never declared dead: the plain rendezvous
    /// placement (one process, or no NATS to carry heartbeats).
    pub fn fixed(service: &'static str, names: Vec<String>) -> Self {
        let all = all_bits(names.len());
        let membership = Self::new(
            service,
            names,
            None,
            Timing::from_config(&Default::default()),
        );
        membership.0.ready.store(all, Ordering::Relaxed);
        membership.0.live.store(all, Ordering::Relaxed);
        membership.0.senior.store(all, Ordering::Relaxed);
        membership
    }

    fn new(
        service: &'static str,
        mut names: Vec<String>,
        me: Option<usize>,
        timing: Timing,
    ) -> Self {
        // Config validation refuses longer lists; never shift past a u64.
        names.truncate(MAX_REPLICAS);
        let seeds = names.iter().map(|n| replica_seed(n)).collect();
        let slots = names
            .iter()
            .map(|_| Slot {
                heard_ms: AtomicI64::new(NEVER),
                run_since_ms: AtomicI64::new(NEVER),
                incarnation: AtomicU64::new(0),
            })
            .collect();
        let all = all_bits(names.len());
        Self(Arc::new(Inner {
            service,
            tracked: std::sync::atomic::AtomicBool::new(false),
            names: names.into(),
            seeds,
            me,
            timing,
            origin: Instant::now(),
            slots,
            // Until heard otherwise, everyone but this replica (see `watch`).
            ready: AtomicU64::new(all & !me.map_or(0, |i| 1 << i)),
            live: AtomicU64::new(all),
            senior: AtomicU64::new(all),
            changes: watch::channel(0).0,
            on_return: Mutex::new(Vec::new()),
            returned_ms: AtomicI64::new(NEVER),
        }))
    }

    /// Replicas heard through heartbeats on `bus`. With `me` (this process
    /// is replica `me`), it publishes its own heartbeats too. Starts the
    /// listener, the watcher and the heartbeat as tasks of the current Tokio
    /// runtime; they end with it.
    pub async fn track(
        service: &'static str,
        names: Vec<String>,
        me: Option<usize>,
        timing: Timing,
        bus: &Bus,
    ) -> crate::Result<Self> {
        if names.len() > MAX_REPLICAS {
            return Err(crate::Error::invalid(format!(
                "at most {MAX_REPLICAS} {service} replicas may be listed"
            )));
        }
        let membership = Self::new(service, names, me, timing);
        membership.0.tracked.store(true, Ordering::Relaxed);
        let subject = bus.subject(&format!("replicas.{service}"));
        let mut heartbeats = bus.subscribe(subject.clone(), None).await?;
        let listener = membership.clone();
        tokio::spawn(async move {
            while let Some(payload) = heartbeats.next().await {
                listener.heard(&payload);
            }
            tracing::error!(
                service,
                "the heartbeat subscription ended: replicas are no longer heard"
            );
        });
        let watcher = membership.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(WATCH_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut watched = Watched {
                sets: None,
                unready_since: vec![None; watcher.len()],
            };
            loop {
                tick.tick().await;
                watcher.watch(&mut watched);
            }
        });
        if let Some(me) = me {
            let incarnation = u64::from_le_bytes(crate::ids::random_bytes());
            let bus = bus.clone();
            let beating = membership.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(timing.heartbeat);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    // `<incarnation> <ms this replica has heard itself
                    // without a gap> <name>`: a process that starts now
                    // learns who is ready from the claim, not by waiting.
                    let payload = Bytes::from(format!(
                        "{incarnation:016x} {} {}",
                        beating.own_run_ms(),
                        beating.name(me)
                    ));
                    if let Err(error) = bus.publish(subject.clone(), payload).await {
                        tracing::warn!(%error, service, "cannot publish a heartbeat");
                    }
                }
            });
        }
        Ok(membership)
    }

    /// The service's name (`limiter`, `billing`).
    pub fn service(&self) -> &'static str {
        self.0.service
    }

    /// How many replicas are listed.
    pub fn len(&self) -> usize {
        self.0.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.names.is_empty()
    }

    /// The name of replica `index`, as listed.
    pub fn name(&self, index: usize) -> &str {
        &self.0.names[index]
    }

    /// This process's own index, when it is one of the replicas.
    pub fn me(&self) -> Option<usize> {
        self.0.me
    }

    /// The replica owning `key`: the first ready one in its rendezvous
    /// order; when none is ready, the first of the live ones up about as
    /// long as the longest; when none is live, the first.
    pub fn owner(&self, key: &str) -> usize {
        self.owner_among(key, self.owners())
    }

    /// The replicas that own principals now, as a bit set.
    pub fn owners(&self) -> u64 {
        match self.0.ready.load(Ordering::Relaxed) {
            0 => match self.0.senior.load(Ordering::Relaxed) {
                0 => all_bits(self.0.seeds.len()),
                senior => senior,
            },
            ready => ready,
        }
    }

    /// The first of `owners` (a bit set) in `key`'s rendezvous order.
    pub fn owner_among(&self, key: &str, owners: u64) -> usize {
        let mut best = (0, 0u64, false);
        for (index, seed) in self.0.seeds.iter().enumerate().take(MAX_REPLICAS) {
            if owners & (1 << index) == 0 {
                continue;
            }
            let score = score(key, *seed);
            if !best.2 || score > best.1 {
                best = (index, score, true);
            }
        }
        best.0
    }

    /// Runs `call` on the replica owning `key`, and once more on the one
    /// owning it next when the first cannot serve: it failed as unavailable
    /// (killed: connection refused) and the view then moves `key` within
    /// `dead_after` and a little, or the view moves `key` while the call is
    /// still running (hung). So a request caught by a replica's death
    /// waits for the detection and is served by the successor instead of
    /// failing. `call` must be safe to run twice (every call to a limiter
    /// or billing replica is: keyed by request). Returns the replica that
    /// answered. Without failover, one plain call.
    pub async fn on_owner<T, F, Fut>(&self, key: &str, call: F) -> (usize, crate::Result<T>)
    where
        F: Fn(usize) -> Fut,
        Fut: std::future::Future<Output = crate::Result<T>>,
    {
        let first = self.owner(key);
        if !self.0.tracked.load(Ordering::Relaxed) {
            return (first, call(first).await);
        }
        let mut changes = self.changes();
        let attempt = call(first);
        tokio::pin!(attempt);
        let outcome = loop {
            tokio::select! {
                result = &mut attempt => break Some(result),
                changed = changes.changed() => {
                    if changed.is_err() || self.owner(key) != first {
                        break None;
                    }
                }
            }
        };
        match outcome {
            Some(Err(error)) if error.code == crate::ErrorCode::Unavailable => {
                let wait = tokio::time::sleep(self.0.timing.dead_after + WATCH_EVERY * 2);
                tokio::pin!(wait);
                while self.owner(key) == first {
                    tokio::select! {
                        changed = changes.changed() => {
                            if changed.is_err() {
                                return (first, Err(error));
                            }
                        }
                        () = &mut wait => return (first, Err(error)),
                    }
                }
            }
            Some(result) => return (first, result),
            // Moved while the call ran: abandoned, asked again below.
            None => {}
        }
        let next = self.owner(key);
        (next, call(next).await)
    }

    /// Whether replica `index` is live (heard within `dead_after`) in this
    /// process's view.
    pub fn is_live(&self, index: usize) -> bool {
        index < MAX_REPLICAS && self.0.live.load(Ordering::Relaxed) & (1 << index) != 0
    }

    /// Whether replica `index` is ready (may own) in this process's view.
    pub fn is_ready(&self, index: usize) -> bool {
        index < MAX_REPLICAS && self.0.ready.load(Ordering::Relaxed) & (1 << index) != 0
    }

    /// Whether this process is the replica owning `key` in its own view.
    pub fn owns(&self, key: &str) -> bool {
        self.0.me.is_some_and(|me| self.owner(key) == me)
    }

    /// The first two replicas in `key`'s rendezvous order over every
    /// listed replica, dead or alive: its owner when all are up, and the
    /// one that takes over when the owner dies (none with one replica).
    pub fn first_two(&self, key: &str) -> (usize, Option<usize>) {
        let mut first: Option<(usize, u64)> = None;
        let mut second: Option<(usize, u64)> = None;
        for (index, seed) in self.0.seeds.iter().enumerate() {
            let score = score(key, *seed);
            if first.is_none_or(|(_, best)| score > best) {
                second = first;
                first = Some((index, score));
            } else if second.is_none_or(|(_, next)| score > next) {
                second = Some((index, score));
            }
        }
        (
            first.map_or(0, |(index, _)| index),
            second.map(|(index, _)| index),
        )
    }

    /// Whether this replica has not heard its own heartbeat for
    /// `dead_after`: the others count it dead (or will before it is heard
    /// again), so what it holds in memory may no longer be its own. Still
    /// away for [`RETURN_GRACE_MS`] after it hears itself again: the others
    /// count it live only at their watcher's next tick, and until then they
    /// may still take what it would claim.
    pub fn away(&self) -> bool {
        let Some(me) = self.0.me else {
            return false;
        };
        let now = self.now_ms();
        let heard = self.0.slots[me].heard_ms.load(Ordering::Acquire);
        let returned = self.0.returned_ms.load(Ordering::Acquire);
        if returned != NEVER && now.saturating_sub(returned) < RETURN_GRACE_MS {
            return true;
        }
        // Never heard: away once past the start, when it should have been
        // (the bus is down, or this replica's name is not in the list).
        now >= self.dead_after_ms()
            && (heard == NEVER || now.saturating_sub(heard) >= self.dead_after_ms())
    }

    /// Runs `callback` (on the listener's task) each time this replica is
    /// heard again after being away, before [`away`](Self::away) turns
    /// false.
    pub fn on_return(&self, callback: impl Fn() + Send + Sync + 'static) {
        self.0
            .on_return
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Box::new(callback));
    }

    /// Changes each time the ready set changes (owners may have moved).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.0.changes.subscribe()
    }

    fn now_ms(&self) -> i64 {
        i64::try_from(self.0.origin.elapsed().as_millis()).unwrap_or(i64::MAX)
    }

    fn dead_after_ms(&self) -> i64 {
        millis(self.0.timing.dead_after)
    }

    /// How long this replica has heard itself without a gap, in ms (0
    /// when it is not one, or has not).
    fn own_run_ms(&self) -> i64 {
        let Some(me) = self.0.me else {
            return 0;
        };
        let slot = &self.0.slots[me];
        let since = slot.run_since_ms.load(Ordering::Acquire);
        if since == NEVER || self.away() {
            return 0;
        }
        self.now_ms().saturating_sub(since).max(0)
    }

    /// Records a heartbeat (`<incarnation hex> <run ms> <name>`).
    fn heard(&self, payload: &[u8]) {
        let parsed = std::str::from_utf8(payload).ok().and_then(|text| {
            let mut parts = text.splitn(3, ' ');
            let incarnation = u64::from_str_radix(parts.next()?, 16).ok()?;
            let run_ms: i64 = parts.next()?.parse().ok()?;
            Some((incarnation, run_ms.max(0), parts.next()?))
        });
        let Some((incarnation, claimed_run_ms, name)) = parsed else {
            tracing::warn!(service = self.0.service, "unreadable heartbeat");
            return;
        };
        let Some(index) = self.0.names.iter().position(|n| n == name) else {
            // A replica not in this process's list: a list that differs
            // between processes, worth a line now and then, not per beat.
            return;
        };
        let slot = &self.0.slots[index];
        let now = self.now_ms();
        let last = slot.heard_ms.load(Ordering::Acquire);
        let gap = last == NEVER || now.saturating_sub(last) >= self.dead_after_ms();
        let restarted = slot.incarnation.swap(incarnation, Ordering::AcqRel) != incarnation;
        if gap || restarted {
            // Heard within this process's first `dead_after`, another
            // replica's run is what it says (nobody here could have heard
            // it yet); later, a run starts when this process hears it.
            let grace = now < self.dead_after_ms() && Some(index) != self.0.me && last == NEVER;
            let since = if grace {
                now.saturating_sub(claimed_run_ms)
            } else {
                now
            };
            slot.run_since_ms.store(since, Ordering::Release);
            if Some(index) == self.0.me && last != NEVER {
                self.0.returned_ms.store(now, Ordering::Release);
                for callback in self
                    .0
                    .on_return
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                {
                    callback();
                }
            }
        }
        slot.heard_ms.store(now, Ordering::Release);
    }

    /// Recomputes the sets from what was heard; logs and counts changes.
    fn watch(&self, watched: &mut Watched) {
        let now = self.now_ms();
        let dead_after = self.dead_after_ms();
        let rejoin = millis(self.0.timing.rejoin_after);
        let starting = now < dead_after;
        let mut sets = Sets::default();
        // Each live replica's run: since when it has been heard (the start
        // of time for one this process could not have heard yet).
        let mut runs = [None; MAX_REPLICAS];
        for (index, slot) in self.0.slots.iter().enumerate() {
            let heard = slot.heard_ms.load(Ordering::Acquire);
            let mine = Some(index) == self.0.me;
            let since = if heard == NEVER {
                (starting && !mine).then_some(NEVER + 1)
            } else {
                (now.saturating_sub(heard) < dead_after)
                    .then(|| slot.run_since_ms.load(Ordering::Acquire))
            };
            let Some(since) = since else {
                continue;
            };
            runs[index] = Some(since);
            sets.live |= 1 << index;
            if since.saturating_add(rejoin) <= now {
                sets.ready |= 1 << index;
            }
        }
        // Nobody ready (a cluster starting, or every replica but the
        // starting ones lost): the live replicas that have been up about
        // as long as the longest, so a replica back a moment ago does not
        // take principals from one that has been hearing them.
        let earliest = runs.iter().flatten().min().copied();
        for (index, since) in runs.iter().enumerate() {
            if let (Some(since), Some(earliest)) = (since, earliest)
                && since.saturating_sub(earliest) <= dead_after
            {
                sets.senior |= 1 << index;
            }
        }
        self.0.live.store(sets.live, Ordering::Relaxed);
        self.0.ready.store(sets.ready, Ordering::Relaxed);
        self.0.senior.store(sets.senior, Ordering::Relaxed);
        let was = watched.sets.replace(sets);
        if was != Some(sets) {
            // In its first `dead_after` a process is still hearing who is
            // there: gauges only, no moves to log or count.
            let was = was.filter(|_| !starting);
            self.report(was, sets, now, &mut watched.unready_since);
            self.0.changes.send_modify(|n| *n += 1);
        }
    }

    /// Gauges for every replica; a log line and counts for each change.
    fn report(&self, was: Option<Sets>, now: Sets, now_ms: i64, unready_since: &mut [Option<i64>]) {
        let metrics = crate::metrics::metrics();
        for (index, name) in self.0.names.iter().enumerate() {
            let (before, after) = (was.map(|w| w.state(index)), now.state(index));
            let labels = crate::metrics::ReplicaLabels {
                service: self.0.service,
                replica: name.clone(),
            };
            metrics.replica_up.get_or_create(&labels).set(after as i64);
            let Some(before) = before.filter(|b| *b != after) else {
                continue;
            };
            let slot = &self.0.slots[index];
            let moved = |cause| {
                metrics
                    .ownership_moves
                    .get_or_create(&crate::metrics::MoveLabels {
                        service: self.0.service,
                        replica: name.clone(),
                        cause,
                    })
                    .inc();
            };
            if before == Up::Ready {
                unready_since[index] = Some(now_ms);
                if after == Up::Dead {
                    moved("dead");
                    let heard = slot.heard_ms.load(Ordering::Acquire);
                    tracing::warn!(
                        service = self.0.service,
                        replica = name.as_str(),
                        silent_ms = if heard == NEVER {
                            now_ms
                        } else {
                            now_ms - heard
                        },
                        "replica declared dead: its principals move to the next ready replica"
                    );
                } else {
                    // Heard again before it was declared dead, but a new
                    // incarnation: it starts from nothing.
                    moved("restarted");
                    tracing::warn!(
                        service = self.0.service,
                        replica = name.as_str(),
                        "replica restarted: its principals move to the next ready replica \
                         until it has been up for its rejoin delay"
                    );
                }
            } else if after == Up::Ready {
                moved("rejoined");
                let away_ms = unready_since[index].take().map(|since| now_ms - since);
                if let Some(away_ms) = away_ms {
                    metrics
                        .replica_away_seconds
                        .get_or_create(&crate::metrics::ServiceLabels {
                            service: self.0.service,
                        })
                        .observe(away_ms as f64 / 1000.0);
                }
                tracing::info!(
                    service = self.0.service,
                    replica = name.as_str(),
                    away_ms,
                    "replica ready again: its principals move back to it"
                );
            } else if before == Up::Dead {
                tracing::info!(
                    service = self.0.service,
                    replica = name.as_str(),
                    "replica heard again: it takes its principals back after its rejoin delay"
                );
            }
        }
    }
}

/// The watcher's memory between two passes.
struct Watched {
    sets: Option<Sets>,
    /// Per replica: when it stopped being ready (ms), until it is again.
    unready_since: Vec<Option<i64>>,
}

/// A replica's state as `rialto_replica_up` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Up {
    Dead = 0,
    /// Heard, within its rejoin delay.
    Starting = 1,
    Ready = 2,
}

impl Sets {
    fn state(self, index: usize) -> Up {
        let bit = 1u64 << index;
        if self.ready & bit != 0 {
            Up::Ready
        } else if self.live & bit != 0 {
            Up::Starting
        } else {
            Up::Dead
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Sets {
    live: u64,
    ready: u64,
    senior: u64,
}

fn all_bits(count: usize) -> u64 {
    match count {
        0 => 0,
        n if n >= 64 => u64::MAX,
        n => (1u64 << n) - 1,
    }
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAST: Timing = Timing {
        heartbeat: Duration::from_millis(20),
        dead_after: Duration::from_millis(150),
        rejoin_after: Duration::from_millis(150),
    };

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("http://replica-{i}:9090")).collect()
    }

    /// A key owned by replica `wanted` when all three are ready.
    fn key_of(fixed: &Membership, wanted: usize) -> String {
        (0..)
            .map(|i| format!("key:{i}"))
            .find(|k| fixed.owner(k) == wanted)
            .unwrap()
    }

    /// Until `condition` holds, checked every 10 ms, for at most 3 s.
    async fn until(what: &str, condition: impl Fn() -> bool) -> Duration {
        let started = Instant::now();
        while !condition() {
            assert!(started.elapsed() < Duration::from_secs(3), "never: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        started.elapsed()
    }

    #[test]
    fn fixed_membership_is_the_rendezvous_placement() {
        let fixed = Membership::fixed("limiter", names(3));
        for i in 0..300 {
            let key = format!("key:{i}");
            let seeds = names(3).iter().map(|n| replica_seed(n)).collect::<Vec<_>>();
            let plain = crate::placement::owner_index(&key, seeds.into_iter());
            assert_eq!(fixed.owner(&key), plain);
        }
    }

    /// A replica silent past `dead_after` loses its principals to the next
    /// in their order, and only those; heard again, it takes them back
    /// after `rejoin_after`, not at its first beat.
    #[tokio::test]
    async fn a_silent_replica_is_declared_dead_and_rejoins_after_its_delay() {
        let bus = Bus::in_process("membership-test");
        let subject = bus.subject("replicas.limiter");
        let view = Membership::track("limiter", names(3), None, FAST, &bus)
            .await
            .unwrap();
        let fixed = Membership::fixed("limiter", names(3));
        let beat = |i: usize, incarnation: u64| {
            let bus = bus.clone();
            let subject = subject.clone();
            async move {
                let payload = format!("{incarnation:016x} 0 http://replica-{i}:9090");
                bus.publish(subject, Bytes::from(payload)).await.unwrap();
            }
        };
        let owned_by_1 = key_of(&fixed, 1);
        let owned_by_2 = key_of(&fixed, 2);
        // All three beat; at first every replica counts as ready.
        assert_eq!(view.owner(&owned_by_1), 1);
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(400) {
            for i in 0..3 {
                beat(i, 7).await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(view.owner(&owned_by_1), 1);
        // Replica 1 goes silent: declared dead after dead_after, not before.
        let silent = Instant::now();
        let beating = |skip: Option<usize>| {
            let beat = &beat;
            async move {
                for i in (0..3).filter(|i| Some(*i) != skip) {
                    beat(i, 7).await;
                }
            }
        };
        while view.owner(&owned_by_1) == 1 {
            beating(Some(1)).await;
            assert!(
                silent.elapsed() < Duration::from_secs(2),
                "never declared dead"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let detected = silent.elapsed();
        assert!(
            // Its last beat went out up to 20 ms before `silent`.
            detected + Duration::from_millis(25) >= FAST.dead_after
                && detected < FAST.dead_after * 2,
            "declared dead after {detected:?}"
        );
        let successor = view.owner(&owned_by_1);
        assert_ne!(successor, 1);
        assert_eq!(view.owner(&owned_by_2), 2, "other principals stay");
        // Heard again: still away for rejoin_after, then back.
        let back = Instant::now();
        while view.owner(&owned_by_1) != 1 {
            beating(None).await;
            assert!(back.elapsed() < Duration::from_secs(2), "never rejoined");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let rejoined = back.elapsed();
        assert!(rejoined >= FAST.rejoin_after, "rejoined after {rejoined:?}");
        // A new incarnation (a restart faster than dead_after) also waits.
        beat(1, 8).await;
        until("the restarted replica to lose its principals", || {
            view.owner(&owned_by_1) != 1
        })
        .await;
        let restarted = Instant::now();
        while view.owner(&owned_by_1) != 1 {
            for i in 0..3 {
                beat(i, if i == 1 { 8 } else { 7 }).await;
            }
            assert!(
                restarted.elapsed() < Duration::from_secs(2),
                "never rejoined"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(restarted.elapsed() >= FAST.rejoin_after - Duration::from_millis(60));
    }

    /// A replica's own view: it does not count itself ready until it has
    /// heard itself for the rejoin delay; stopped longer than `dead_after`
    /// it is away, and its return callback runs before it is not.
    #[tokio::test]
    async fn a_replica_knows_when_it_was_away() {
        let bus = Bus::in_process("membership-self");
        let me = Membership::track("billing", names(2), Some(0), FAST, &bus)
            .await
            .unwrap();
        let fixed = Membership::fixed("billing", names(2));
        let mine = key_of(&fixed, 0);
        // Returns counted, and whether each callback ran while away.
        let returned = Arc::new(AtomicU64::new(0));
        let away_in_callback = Arc::new(AtomicU64::new(0));
        let (counter, seen, view) = (returned.clone(), away_in_callback.clone(), me.clone());
        me.on_return(move || {
            seen.fetch_add(u64::from(view.away()), Ordering::SeqCst);
            counter.fetch_add(1, Ordering::SeqCst);
        });
        // Its own heartbeats make it ready after the rejoin delay.
        until("ready in its own view", || me.owns(&mine)).await;
        assert!(!me.away());
        // A process stopped past dead_after: simulated by a gap in what it
        // heard of itself (the listener heard nothing for 10 s).
        me.0.slots[0]
            .heard_ms
            .store(me.now_ms() - 10_000, Ordering::Release);
        until("heard again", || returned.load(Ordering::SeqCst) == 1).await;
        assert_eq!(away_in_callback.load(Ordering::SeqCst), 1);
        // Still away for a few of the others' watcher ticks, until they
        // have heard it too.
        assert!(me.away());
        until("not away", || !me.away()).await;
        // And the run starts again: since it heard itself again.
        assert!(me.own_run_ms() < RETURN_GRACE_MS + 60);
    }

    /// A process that starts while one replica has just come back learns
    /// it from the heartbeat's claim: that one is not ready yet, the others
    /// are at once. And with nobody ready, a replica back a moment ago does
    /// not take principals from those up for longer.
    #[tokio::test]
    async fn a_new_process_believes_the_claimed_runs() {
        let bus = Bus::in_process("membership-claims");
        let subject = bus.subject("replicas.limiter");
        let view = Membership::track("limiter", names(3), None, FAST, &bus)
            .await
            .unwrap();
        let fixed = Membership::fixed("limiter", names(3));
        let owned_by_1 = key_of(&fixed, 1);
        let claim = |i: usize, run_ms: i64| {
            let (bus, subject) = (bus.clone(), subject.clone());
            async move {
                let payload = format!("{:016x} {run_ms} http://replica-{i}:9090", i + 1);
                bus.publish(subject, Bytes::from(payload)).await.unwrap();
            }
        };
        claim(0, 60_000).await;
        claim(1, 0).await;
        claim(2, 60_000).await;
        until("replica 1 to be starting", || view.owner(&owned_by_1) != 1).await;
        assert!(view.is_ready(0) && view.is_ready(2) && !view.is_ready(1));

        // Nobody ready: the senior ones own, not the one just back.
        // (No tasks: the passes are made here.)
        let cold = Membership::new("limiter", names(3), None, FAST);
        let beat =
            |i: usize, run_ms: i64| format!("{:016x} {run_ms} http://replica-{i}:9090", i + 1);
        cold.heard(beat(0, 50).as_bytes());
        cold.heard(beat(2, 60).as_bytes());
        // Replica 1 up for a moment only, heard well after the others.
        cold.0.slots[1]
            .heard_ms
            .store(cold.now_ms(), Ordering::Release);
        cold.0.slots[1]
            .run_since_ms
            .store(cold.now_ms() + 10_000, Ordering::Release);
        cold.0.slots[1].incarnation.store(2, Ordering::Release);
        let mut watched = Watched {
            sets: None,
            unready_since: vec![None; 3],
        };
        cold.watch(&mut watched);
        assert_eq!(cold.owners(), 0b101, "{:?}", watched.sets);
        assert_ne!(cold.owner(&owned_by_1), 1);
    }

    /// A call that reaches a dying replica is asked again of the next one
    /// once the view moves its key: at once when it failed as unavailable
    /// (killed), by abandoning it when it hangs; any other error is the
    /// answer; without failover there is one call only.
    #[tokio::test]
    async fn a_call_caught_by_a_replica_death_goes_to_the_next() {
        use crate::{Error, ErrorCode};
        let bus = Bus::in_process("membership-calls");
        let subject = bus.subject("replicas.billing");
        let view = Membership::track("billing", names(2), None, FAST, &bus)
            .await
            .unwrap();
        let fixed = Membership::fixed("billing", names(2));
        let key = key_of(&fixed, 1);
        // Both beat past the start; then only replica 0 does.
        let beating = Arc::new(AtomicU64::new(0b11));
        let beats = beating.clone();
        tokio::spawn(async move {
            loop {
                for i in 0..2 {
                    if beats.load(Ordering::SeqCst) & (1 << i) != 0 {
                        let payload = format!("{:016x} 60000 http://replica-{i}:9090", i + 1);
                        bus.publish(subject.clone(), Bytes::from(payload))
                            .await
                            .unwrap();
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        until("both ready", || view.is_ready(0) && view.is_ready(1)).await;

        let calls = Arc::new(AtomicU64::new(0));
        let unavailable = |index: usize| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if index == 1 {
                    Err(Error::new(ErrorCode::Unavailable, "connection refused"))
                } else {
                    Ok(index)
                }
            }
        };
        // Replica 1 killed: refused at once, served by 0 after detection.
        beating.store(0b01, Ordering::SeqCst);
        let started = Instant::now();
        let (answered, result) = view.on_owner(&key, unavailable).await;
        assert_eq!((answered, result.unwrap()), (0, 0));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert!(
            started.elapsed() < FAST.dead_after * 3,
            "{:?}",
            started.elapsed()
        );

        // Replica 1 back and ready; then hung: the call never answers.
        beating.store(0b11, Ordering::SeqCst);
        until("replica 1 ready again", || view.owner(&key) == 1).await;
        let hung = |index: usize| async move {
            if index == 1 {
                std::future::pending::<()>().await;
            }
            Ok::<_, Error>(index)
        };
        beating.store(0b01, Ordering::SeqCst);
        let (answered, result) = view.on_owner(&key, hung).await;
        assert_eq!((answered, result.unwrap()), (0, 0));

        // Another error is the answer; no second call.
        calls.store(0, Ordering::SeqCst);
        let refused = |_index: usize| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<usize, _>(Error::new(ErrorCode::PaymentRequired, "no credit")) }
        };
        let (_, result) = view.on_owner(&key, refused).await;
        assert_eq!(result.unwrap_err().code, ErrorCode::PaymentRequired);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Without failover: one call, whatever it answers.
        calls.store(0, Ordering::SeqCst);
        let (answered, result) = fixed.on_owner(&key, unavailable).await;
        assert_eq!(answered, 1);
        assert_eq!(result.unwrap_err().code, ErrorCode::Unavailable);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_first_two_are_the_owner_and_its_successor() {
        let fixed = Membership::fixed("limiter", names(4));
        let mut seconds = [0; 4];
        for i in 0..400 {
            let key = format!("key:{i}");
            let mut order: Vec<usize> = (0..4).collect();
            order.sort_by_key(|r| std::cmp::Reverse(score(&key, replica_seed(&names(4)[*r]))));
            assert_eq!(order[0], fixed.owner(&key));
            assert_eq!(fixed.first_two(&key), (order[0], Some(order[1])), "{key}");
            // Without the owner, the second owns.
            assert_eq!(fixed.owner_among(&key, 0b1111 & !(1 << order[0])), order[1]);
            seconds[order[1]] += 1;
        }
        assert!(seconds.iter().all(|n| *n > 60), "{seconds:?}");
        let one = Membership::fixed("limiter", names(1));
        assert_eq!(one.first_two("key:1"), (0, None));
    }
}
