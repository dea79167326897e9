//! Each backend's health: a circuit breaker owned by one task per backend,
//! its watcher.
//!
//! ```text
//!            N consecutive failures                cooldown over, or
//!   closed ─────────────────────────▶ open ─────── a health check passed ──▶ half-open
//!     ▲                                 ▲                                      │ one trial
//!     │                                 └── trial failed (cooldown doubles) ◀──┤ request
//!     └──────────────────────────────────── trial passed ◀─────────────────────┘
//! ```
//!
//! The request path never locks and never waits on the watcher: it reads the
//! state from an atomic, takes a [`Permit`] (the one trial of a half-open
//! circuit is claimed by a compare-and-swap), and reports the outcome
//! through atomics, waking the watcher only when there is something to
//! decide (the failure threshold crossed, a trial's verdict). The watcher
//! alone makes every other transition. It also checks `openai` backends
//! every `health_check_interval_ms` (`GET <url><health_check_path>`): a
//! failed check counts as a failure while closed and reopens a half-open
//! circuit; a passing check of an open circuit half-opens it before its
//! cooldown ends. A `local` backend that failed to load is [`Health::down`]
//! for good, with no watcher.
//!
//! What counts as a failure is the caller's call (see `local.rs`): a backend
//! that cannot be reached, times out, answers 5xx, or refuses its own
//! credentials. A backend saying it is busy (429) or refusing a bad request
//! answered, and passes.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::future::{Fuse, FusedFuture as _};
use tokio::sync::Notify;
use tokio::time::Instant;

const CLOSED: u8 = 0;
const HALF_OPEN: u8 = 1;
/// Half-open with its trial request under way: nothing else gets through.
const TRIAL: u8 = 2;
const OPEN: u8 = 3;
const DOWN: u8 = 4;

const NO_VERDICT: u8 = 0;
const PASSED: u8 = 1;
const FAILED: u8 = 2;
/// The trial's request went away before an outcome (its caller left).
const ABANDONED: u8 = 3;

/// A backend's circuit, as [`crate::LocalRouter::backend_health`] shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// Serving.
    Closed,
    /// Failing: no requests until the cooldown ends or a health check passes.
    Open,
    /// Recovering: one trial request decides.
    HalfOpen,
    /// A `local` backend whose model did not load: never serves.
    Down,
}

/// One backend's health, for metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendHealth {
    pub model: String,
    /// The backend's public name (`x-<brand>-model-router`).
    pub backend: String,
    pub state: CircuitState,
    /// Requests sent to it and not finished (streams until their end).
    pub in_flight: usize,
    /// Requests it answered well since the router started (its error rate
    /// is `failed / (passed + failed)`).
    pub passed: u64,
    /// Requests that counted as its failure since the router started.
    pub failed: u64,
}

/// What the request path and the watcher share.
pub(crate) struct Health {
    state: AtomicU8,
    /// Consecutive failures while closed (requests and health checks).
    failures: AtomicU32,
    /// The outcome of the half-open trial, for the watcher.
    verdict: AtomicU8,
    in_flight: AtomicUsize,
    /// Outcomes since start, for error rates: counters only, never read on
    /// the request path.
    passed: AtomicU64,
    failed: AtomicU64,
    threshold: u32,
    wake: Notify,
}

impl Health {
    pub(crate) fn new(threshold: u32) -> Arc<Self> {
        Arc::new(Self::with_state(CLOSED, threshold))
    }

    /// A backend that will never serve (its model failed to load).
    pub(crate) fn down() -> Arc<Self> {
        Arc::new(Self::with_state(DOWN, 1))
    }

    fn with_state(state: u8, threshold: u32) -> Self {
        Self {
            state: AtomicU8::new(state),
            failures: AtomicU32::new(0),
            verdict: AtomicU8::new(NO_VERDICT),
            in_flight: AtomicUsize::new(0),
            passed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            threshold: threshold.max(1),
            wake: Notify::new(),
        }
    }

    /// Whether a request may be sent now: closed, or half-open with its
    /// trial still to take.
    pub(crate) fn selectable(&self) -> bool {
        matches!(self.state.load(Ordering::Acquire), CLOSED | HALF_OPEN)
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests passed and failed since start.
    pub(crate) fn outcomes(&self) -> (u64, u64) {
        (
            self.passed.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }

    pub(crate) fn state(&self) -> CircuitState {
        match self.state.load(Ordering::Acquire) {
            CLOSED => CircuitState::Closed,
            HALF_OPEN | TRIAL => CircuitState::HalfOpen,
            DOWN => CircuitState::Down,
            _ => CircuitState::Open,
        }
    }

    /// The right to send one request: always while closed; while half-open,
    /// to the one caller that claims the trial.
    pub(crate) fn admit(&self) -> Option<Permit<'_>> {
        match self.state.load(Ordering::Acquire) {
            CLOSED => Some(Permit {
                health: self,
                trial: false,
                reported: false,
            }),
            HALF_OPEN => self
                .state
                .compare_exchange(HALF_OPEN, TRIAL, Ordering::AcqRel, Ordering::Acquire)
                .ok()
                .map(|_| Permit {
                    health: self,
                    trial: true,
                    reported: false,
                }),
            _ => None,
        }
    }

    /// Counts a request in flight until the guard drops.
    pub(crate) fn start(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(self))
    }
}

/// Counts one request in flight on a backend while it lives; a stream
/// carries it to its end.
pub(crate) struct InFlight(Arc<Health>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Leave to send one request; report how it went with [`Permit::passed`]
/// or [`Permit::failed`]. Dropped without a report (the caller left), it
/// tells nothing, except that a trial is free to be taken again.
pub(crate) struct Permit<'a> {
    health: &'a Health,
    trial: bool,
    reported: bool,
}

impl Permit<'_> {
    pub(crate) fn passed(mut self) {
        self.reported = true;
        let health = self.health;
        health.passed.fetch_add(1, Ordering::Relaxed);
        if self.trial {
            health.verdict.store(PASSED, Ordering::Release);
            health.wake.notify_one();
        } else if health.failures.load(Ordering::Relaxed) != 0 {
            health.failures.store(0, Ordering::Relaxed);
        }
    }

    pub(crate) fn failed(mut self) {
        self.reported = true;
        let health = self.health;
        health.failed.fetch_add(1, Ordering::Relaxed);
        if self.trial {
            health.verdict.store(FAILED, Ordering::Release);
            health.wake.notify_one();
        } else if health.failures.fetch_add(1, Ordering::Relaxed) + 1 >= health.threshold {
            health.wake.notify_one();
        }
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.trial && !self.reported {
            self.health.verdict.store(ABANDONED, Ordering::Release);
            self.health.wake.notify_one();
        }
    }
}

/// How the watcher treats failures.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Breaker {
    pub cooldown: Duration,
    pub max_cooldown: Duration,
}

/// An `openai` backend's active health check.
pub(crate) struct Probe {
    pub client: reqwest::Client,
    pub url: reqwest::Url,
    /// The backend's own headers (its credentials too).
    pub headers: std::sync::Arc<arc_swap::ArcSwap<reqwest::header::HeaderMap>>,
    pub interval: Duration,
    pub timeout: Duration,
}

impl Probe {
    /// Whether the backend answers at all: any status below 500 passes (a
    /// server without the path is up).
    async fn check(&self) -> bool {
        let request = self
            .client
            .get(self.url.clone())
            .headers(reqwest::header::HeaderMap::clone(&self.headers.load()))
            .timeout(self.timeout);
        request
            .send()
            .await
            .is_ok_and(|response| !response.status().is_server_error())
    }
}

type Check<'a> = Fuse<Pin<Box<dyn Future<Output = bool> + Send + 'a>>>;

/// The watcher of one backend: owns its circuit's transitions until the
/// router drops it (its task is aborted).
pub(crate) async fn watch(
    health: Arc<Health>,
    breaker: Breaker,
    probe: Option<Probe>,
    backend: String,
) {
    let mut watcher = Watcher {
        health,
        breaker,
        cooldown: breaker.cooldown,
        reopen_at: None,
        backend,
    };
    let interval = probe.as_ref().map(|probe| probe.interval);
    let mut next_check = interval.map(|interval| Instant::now() + interval);
    let mut check: Check<'_> = Fuse::terminated();
    loop {
        let reopen_at = watcher.reopen_at;
        tokio::select! {
            () = watcher.health.wake.notified() => watcher.settle(),
            () = sleep_until(reopen_at), if reopen_at.is_some() => watcher.half_open(),
            healthy = &mut check, if !check.is_terminated() => watcher.checked(healthy),
            () = sleep_until(next_check), if next_check.is_some() && check.is_terminated() => {
                next_check = interval.map(|interval| Instant::now() + interval);
                if let Some(probe) = &probe {
                    check = probe.check().boxed().fuse();
                }
            }
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

struct Watcher {
    health: Arc<Health>,
    breaker: Breaker,
    /// The next open period.
    cooldown: Duration,
    /// When an open circuit half-opens.
    reopen_at: Option<Instant>,
    backend: String,
}

impl Watcher {
    /// Acts on what the request path reported.
    fn settle(&mut self) {
        let health = &self.health;
        match health.state.load(Ordering::Acquire) {
            CLOSED if health.failures.load(Ordering::Relaxed) >= health.threshold => {
                self.open(CLOSED);
            }
            TRIAL => match health.verdict.swap(NO_VERDICT, Ordering::AcqRel) {
                PASSED => self.close(),
                FAILED => {
                    self.lengthen();
                    self.open(TRIAL);
                }
                ABANDONED => health.state.store(HALF_OPEN, Ordering::Release),
                _ => {}
            },
            _ => {}
        }
    }

    /// Acts on a health check.
    fn checked(&mut self, healthy: bool) {
        match (self.health.state.load(Ordering::Acquire), healthy) {
            (CLOSED, false) => {
                self.health.failures.fetch_add(1, Ordering::Relaxed);
                self.settle();
            }
            (OPEN, true) => self.half_open(),
            (HALF_OPEN, false) => {
                self.lengthen();
                self.open(HALF_OPEN);
            }
            _ => {}
        }
    }

    fn lengthen(&mut self) {
        self.cooldown = self
            .cooldown
            .saturating_mul(2)
            .min(self.breaker.max_cooldown);
    }

    /// Opens the circuit if it is still in state `from` (a half-open one
    /// may have had its trial claimed meanwhile).
    fn open(&mut self, from: u8) {
        let opened = self
            .health
            .state
            .compare_exchange(from, OPEN, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if opened {
            self.reopen_at = Some(Instant::now() + self.cooldown);
            tracing::warn!(
                backend = self.backend,
                cooldown_ms = self.cooldown.as_millis() as u64,
                "circuit opened: the backend gets no requests until it recovers"
            );
        }
    }

    fn half_open(&mut self) {
        self.reopen_at = None;
        self.health.verdict.store(NO_VERDICT, Ordering::Release);
        let half_opened = self
            .health
            .state
            .compare_exchange(OPEN, HALF_OPEN, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if half_opened {
            tracing::info!(
                backend = self.backend,
                "circuit half-open: the next request is a trial"
            );
        }
    }

    fn close(&mut self) {
        self.health.failures.store(0, Ordering::Relaxed);
        self.cooldown = self.breaker.cooldown;
        self.health.state.store(CLOSED, Ordering::Release);
        tracing::info!(backend = self.backend, "circuit closed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker {
            cooldown: Duration::from_secs(5),
            max_cooldown: Duration::from_secs(12),
        }
    }

    /// Lets the watcher run (paused time: nothing else advances).
    async fn settle() {
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_state_machine_with_doubling_cooldowns() {
        let health = Health::new(3);
        let watcher = tokio::spawn(watch(Arc::clone(&health), breaker(), None, "b".into()));
        // Successes in between reset the count: never three in a row.
        for _ in 0..5 {
            health.admit().unwrap().failed();
            health.admit().unwrap().failed();
            health.admit().unwrap().passed();
        }
        settle().await;
        assert_eq!(health.state(), CircuitState::Closed);
        for _ in 0..3 {
            health.admit().unwrap().failed();
        }
        settle().await;
        assert_eq!(health.state(), CircuitState::Open);
        assert!(health.admit().is_none());
        assert!(!health.selectable());

        // Half-open after the cooldown: one trial, nobody else.
        tokio::time::sleep(Duration::from_millis(4_900)).await;
        assert_eq!(health.state(), CircuitState::Open);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(health.state(), CircuitState::HalfOpen);
        let trial = health.admit().unwrap();
        assert!(health.admit().is_none());
        // A failed trial reopens for twice as long (10 s)...
        trial.failed();
        settle().await;
        assert_eq!(health.state(), CircuitState::Open);
        tokio::time::sleep(Duration::from_millis(9_900)).await;
        assert_eq!(health.state(), CircuitState::Open);
        tokio::time::sleep(Duration::from_millis(200)).await;
        // ...an abandoned trial frees the trial for the next caller...
        drop(health.admit().unwrap());
        settle().await;
        assert_eq!(health.state(), CircuitState::HalfOpen);
        // ...the cooldown is capped (12 s, not 20)...
        health.admit().unwrap().failed();
        settle().await;
        tokio::time::sleep(Duration::from_millis(12_100)).await;
        assert_eq!(health.state(), CircuitState::HalfOpen);
        // ...and a passed trial closes, resetting the cooldown.
        health.admit().unwrap().passed();
        settle().await;
        assert_eq!(health.state(), CircuitState::Closed);
        for _ in 0..3 {
            health.admit().unwrap().failed();
        }
        settle().await;
        tokio::time::sleep(Duration::from_millis(5_100)).await;
        assert_eq!(health.state(), CircuitState::HalfOpen);
        watcher.abort();
    }

    #[test]
    fn in_flight_counts_until_the_guard_drops() {
        let health = Health::new(1);
        let first = health.start();
        let second = health.start();
        assert_eq!(health.in_flight(), 2);
        drop(first);
        assert_eq!(health.in_flight(), 1);
        drop(second);
        assert_eq!(health.in_flight(), 0);
        assert_eq!(Health::down().state(), CircuitState::Down);
        assert!(Health::down().admit().is_none());
    }

    #[test]
    fn outcomes_count_passed_and_failed() {
        let health = Health::new(10);
        assert_eq!(health.outcomes(), (0, 0));
        health.admit().unwrap().passed();
        health.admit().unwrap().passed();
        health.admit().unwrap().failed();
        // A permit dropped without a report counts as neither.
        drop(health.admit().unwrap());
        assert_eq!(health.outcomes(), (2, 1));
    }
}
