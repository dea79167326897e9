//! Asking the router before the limiter and billing have answered, for
//! callers they admitted with room to spare a moment ago.
//!
//! In a split deployment a priced chat costs three rounds of calls before
//! its answer can leave: the limiter's admission and billing's hold
//! (together), the route, the settlement. Each round wakes the gateway's
//! worker and another process on cores those processes share, and the tail
//! of the latency is those wake-ups queueing behind each other
//! (bench/NOTES.md). When the caller's last admission and hold left far more
//! room than this request can use, their answers are all but known: the
//! route is asked at once, beside them, and its answer waits for theirs.
//! Nothing leaves before both said yes; a refusal drops the route (its
//! upstream call is cancelled, and what the backend did is not charged).
//!
//! What this costs when the guess is wrong is only an upstream call whose
//! answer nobody gets, and the guess is wrong only for a caller whose room
//! went in the last [`FRESH_MS`]: that caller's refusal clears its slot.
//! The slots are a fixed table of tagged atomics (no lock, no growth): a
//! caller lands on a slot by a keyed hash of its ledger owner and key, and
//! the slot's tag (the hash's other half) tells it from a caller that
//! shares the slot.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use rialto_limiter::Admission;
use rialto_proto::billing::v1 as billing_pb;
use rialto_proto::router::v1 as router_pb;
use rust_decimal::Decimal;

/// Slots in the table (a power of two): 32 KiB.
const SLOTS: usize = 4096;

/// How long a caller's room is believed after its last admission and
/// hold, in milliseconds.
const FRESH_MS: u32 = 2_000;

/// How many requests like this one the room must still take: a caller
/// with less (a balance or a window nearly used) is asked in order.
pub(crate) const ROOM: u64 = 64;

/// The callers whose route may be asked before their admission's answer.
pub(crate) struct RouteAhead {
    /// `tag << 32 | milliseconds since start` (wrapping) of the last roomy
    /// answer; 0 when none.
    slots: Box<[AtomicU64]>,
    keys: std::hash::RandomState,
    start: Instant,
}

impl RouteAhead {
    pub(crate) fn new() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            keys: std::hash::RandomState::new(),
            start: Instant::now(),
        }
    }

    /// Whether the caller (a ledger owner and a key) had room on `model` a
    /// moment ago.
    pub(crate) fn roomy(&self, owner: &str, key: &str, model: &str) -> bool {
        let (slot, tag) = self.slot(owner, key, model);
        let value = self.slots[slot].load(Ordering::Relaxed);
        // Truncated to 32 bits on purpose: the clock wraps every 49 days,
        // and an answer that old reads fresh for two seconds at worst.
        let at = value as u32;
        value >> 32 == tag && self.now().wrapping_sub(at) < FRESH_MS
    }

    /// What the limiter and billing just answered the caller: room to
    /// spare, or not (a refusal, a window or balance running low).
    pub(crate) fn answered(&self, owner: &str, key: &str, model: &str, roomy: bool) {
        let (slot, tag) = self.slot(owner, key, model);
        let slot = &self.slots[slot];
        if roomy {
            slot.store(tag << 32 | u64::from(self.now()), Ordering::Relaxed);
        } else if slot.load(Ordering::Relaxed) >> 32 == tag {
            slot.store(0, Ordering::Relaxed);
        }
    }

    fn slot(&self, owner: &str, key: &str, model: &str) -> (usize, u64) {
        // The key as well as its ledger owner (an account or a wallet): a
        // key's own window can run out while its account has room; and the
        // model, whose window can run out while another's has room.
        let hash = self.keys.hash_one((owner, key, model));
        // The low bits pick the slot, the high 32 are its tag.
        (hash as usize & (SLOTS - 1), hash >> 32)
    }

    fn now(&self) -> u32 {
        // Wrapping, as [`RouteAhead::roomy`] reads it.
        self.start.elapsed().as_millis() as u32
    }
}

/// A route asked ahead, running as a task of its own: aborted (its call,
/// and the upstream's, cancelled) when dropped unanswered, as it is when
/// the admission or the hold refuses.
pub(crate) struct Asked(
    Option<tokio::task::JoinHandle<rialto_core::Result<router_pb::ChatResponse>>>,
);

impl Asked {
    pub(crate) fn ask(router: &rialto_router::RouterClient, chat: rialto_router::Chat) -> Self {
        let router = router.clone();
        // In the request's span: the router's call continues its trace.
        Self(Some(tokio::spawn(tracing::Instrument::instrument(
            async move { router.chat(chat).await },
            tracing::Span::current(),
        ))))
    }

    /// The router's answer, once the caller was admitted and held.
    pub(crate) async fn answer(mut self) -> rialto_core::Result<router_pb::ChatResponse> {
        // Always there: `answer` takes the only handle.
        let Some(task) = self.0.take() else {
            return Err(rialto_core::Error::internal("a route asked ahead is gone"));
        };
        count("used");
        task.await.map_err(|error| {
            rialto_core::Error::internal(format!("the route's task failed: {error}"))
        })?
    }
}

impl Drop for Asked {
    /// Dropped unanswered: refused (or its client left first).
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            count("dropped");
            task.abort();
        }
    }
}

fn count(outcome: &'static str) {
    rialto_core::metrics::metrics()
        .routes_ahead
        .get_or_create(&rialto_core::metrics::OutcomeLabels { outcome })
        .inc();
}

/// Whether a settlement's `cost` stayed within what its hold reserved: a
/// backend that reported more than the hold assumed may have spent the
/// balance beyond what the hold's answer showed (or into debt).
pub(crate) fn within_hold(cost: &serde_json::Value, held_usd: &str, held_diem: &str) -> bool {
    let amount = |text: &str| text.parse::<Decimal>().unwrap_or_default();
    let charged = amount(&cost["usd"].to_string()) + amount(&cost["diem"].to_string());
    charged <= amount(held_usd) + amount(held_diem)
}

/// Whether the limiter's admission and billing's hold left room for
/// [`ROOM`] more requests like this one (`tokens` in the windows): the shown
/// window's requests and tokens, and the balance against what was held.
/// A capped key is never roomy: its cap's remainder is not in the answer.
pub(crate) fn room_left(
    admission: &rialto_core::Result<Admission>,
    hold: &rialto_core::Result<billing_pb::HoldResponse>,
    tokens: u64,
) -> bool {
    let (Ok(admission), Ok(hold)) = (admission, hold) else {
        return false;
    };
    if admission.refusal.is_some() || !hold.placed || !hold.key_period.is_empty() {
        return false;
    }
    let windows = admission.headers.as_ref().is_none_or(|shown| {
        shown.remaining_requests >= ROOM
            && shown
                .tokens
                .as_ref()
                .is_none_or(|window| window.remaining >= ROOM.saturating_mul(tokens))
    });
    let amount = |text: &str| text.parse::<Decimal>().unwrap_or_default();
    let held = amount(&hold.held_usd) + amount(&hold.held_diem);
    let balance = hold.before.as_ref().map_or(Decimal::ZERO, |before| {
        amount(&before.usd) + amount(&before.diem)
    });
    windows && (held.is_zero() || balance >= held * Decimal::from(ROOM))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_is_roomy_once_answered_so_and_not_after_a_refusal() {
        let ahead = RouteAhead::new();
        assert!(!ahead.roomy("acct", "key", "m"));
        ahead.answered("acct", "key", "m", true);
        assert!(ahead.roomy("acct", "key", "m"));
        assert!(!ahead.roomy("acct", "other key", "m"));
        assert!(!ahead.roomy("other acct", "key", "m"));
        assert!(!ahead.roomy("acct", "key", "other model"));
        ahead.answered("acct", "key", "m", false);
        assert!(!ahead.roomy("acct", "key", "m"));
    }

    #[test]
    fn another_callers_refusal_does_not_clear_a_slot_it_does_not_own() {
        let ahead = RouteAhead::new();
        ahead.answered("acct", "key", "m", true);
        // Every slot is someone else's refusal at least once: each clears
        // only its own tag.
        for n in 0..100_000 {
            ahead.answered(&format!("acct-{n}"), "key", "m", false);
        }
        assert!(ahead.roomy("acct", "key", "m"));
    }

    fn hold(before_usd: &str, held_usd: &str) -> rialto_core::Result<billing_pb::HoldResponse> {
        Ok(billing_pb::HoldResponse {
            placed: true,
            reserved: true,
            before: Some(billing_pb::Balance {
                usd: before_usd.into(),
                diem: "0".into(),
                ..Default::default()
            }),
            held_usd: held_usd.into(),
            held_diem: "0".into(),
            ..Default::default()
        })
    }

    fn admitted(remaining_requests: u64, remaining_tokens: u64) -> rialto_core::Result<Admission> {
        Ok(Admission {
            headers: Some(rialto_limiter::RateHeaders {
                scope: rialto_limiter::Scope::ApiKey,
                limit_requests: 1_000,
                remaining_requests,
                reset_requests: 0,
                tokens: Some(rialto_limiter::TokenHeaders {
                    limit: 1_000_000,
                    remaining: remaining_tokens,
                    reset_secs: 60,
                }),
            }),
            refusal: None,
            ticket: Default::default(),
        })
    }

    #[test]
    fn a_cost_within_its_hold() {
        let cost = serde_json::json!({"usd": 0.000_5, "diem": 0.000_5});
        assert!(within_hold(&cost, "0.0005", "0.0005"));
        assert!(within_hold(&cost, "0.001", "0"));
        assert!(!within_hold(&cost, "0.0009", "0"));
    }

    #[test]
    fn room_is_left_only_for_many_more_requests_like_this_one() {
        let tokens = 100;
        assert!(room_left(&admitted(64, 6_400), &hold("6.4", "0.1"), tokens));
        // The balance takes fewer than 64 more.
        assert!(!room_left(
            &admitted(64, 6_400),
            &hold("6.3", "0.1"),
            tokens
        ));
        // The window's requests, or its tokens.
        assert!(!room_left(
            &admitted(63, 6_400),
            &hold("100", "0.1"),
            tokens
        ));
        assert!(!room_left(
            &admitted(64, 6_399),
            &hold("100", "0.1"),
            tokens
        ));
        // A free model holds nothing: only the window counts.
        assert!(room_left(&admitted(64, 6_400), &hold("0", "0"), tokens));
        // Refusals.
        let mut refused = hold("100", "0.1");
        if let Ok(hold) = &mut refused {
            hold.placed = false;
        }
        assert!(!room_left(&admitted(64, 6_400), &refused, tokens));
        let mut capped = hold("100", "0.1");
        if let Ok(hold) = &mut capped {
            hold.key_period = "EPOCH:2026-11-27".into();
        }
        assert!(!room_left(&admitted(64, 6_400), &capped, tokens));
        let failed = Err(rialto_core::Error::internal("billing is down"));
        assert!(!room_left(&admitted(64, 6_400), &failed, tokens));
    }
}
