//! Asking the router before the limiter and billing have answered, for
//! callers they admitted with room to spare a moment ago.
//!
//! In a split deployment a priced chat costs three rounds of calls before
//! its answer can leave: the limiter's admission and billing's hold
//! (together), the route, the settlement. Each round wakes the gateway's
//! worker and another process on cores those processes share (bench/NOTES.md).
//! When the caller's last admission and hold on this model left room for
//! [`ROOM`] more requests like it, their answers are all but known: the route
//! is asked at once, beside the admission. An account's request is then held
//! and settled in one call once its answer is in (`Billing/Charge`, the
//! gateway's `Settlement::charge`; one whose call failed is settled without
//! a hold, `charge_durably`); a wallet's is held beside its route (its
//! hold also answers for the wallet's minimum). Nothing leaves before the
//! limiter and the hold said yes; a refusal of the limiter or a wallet's hold
//! drops the route (its upstream call is cancelled), a charge that refuses
//! keeps the answer from the client, and nothing is charged either way.
//!
//! A wrong guess costs an upstream call whose answer nobody gets, and it is
//! kept rare and bounded:
//! - the room is believed for `gateway.route_ahead_ms` (0 turns this off),
//!   and only a hold (or a charge) with room, not an admission alone,
//!   renews it;
//! - a refusal, an answer with less room, or a settlement above its hold
//!   marks the caller refused for as long, and no roomy answer in flight
//!   undoes that;
//! - at most [`ROOM`] / 2 of a caller's routes are out ahead at once (one
//!   not held until its charge counts until it is charged: [`Out`]), each
//!   no more than twice the size of the request whose answer showed the
//!   room, so together they fit in it;
//! - at most [`MOST_OUT`] routes of all callers are out ahead at once in
//!   one gateway, so that many callers refused together (a tier's limits
//!   lowered, billing's owners moving) cost a bounded number of upstream
//!   calls; beyond it a route waits for its admission, as without the
//!   table.
//!
//! The table is fixed (4,096 slots of one atomic word, no lock, no growth).
//! A caller lands on a slot by a keyed hash of its ledger owner, key and
//! model, and the slot's tag (other bits of the hash) tells it from a caller
//! that shares the slot; a caller that evicts another only costs that one
//! its next route ahead.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rialto_limiter::Admission;
use rialto_proto::auth::v1 as auth_pb;
use rialto_proto::billing::v1 as billing_pb;
use rialto_proto::router::v1 as router_pb;
use rust_decimal::Decimal;

/// Slots in the table (a power of two): 32 KiB.
const SLOTS: usize = 4096;

/// How many more requests like this one an answer must leave room for.
pub(crate) const ROOM: u64 = 64;

/// The most routes out ahead at once in one gateway, of all callers. An
/// admission and hold take about a millisecond, so at a few thousand
/// requests a second a handful are out at any moment; this bounds what a
/// wrong guess can cost, not what a right one may use.
pub(crate) const MOST_OUT: usize = 256;

/// A slot's word, from the low bits up: the time of its last answer (ms
/// since start, wrapping: 25 bits, 9 hours), the routes out ahead (7), the
/// state (2: empty, roomy, refused), the size of the answered request (6:
/// the bit length of its tokens), the tag (24, never 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    at: u32,
    out: u64,
    state: u64,
    size: u64,
    tag: u64,
}

const AT_BITS: u32 = 25;
const OUT_SHIFT: u32 = AT_BITS;
const STATE_SHIFT: u32 = OUT_SHIFT + 7;
const SIZE_SHIFT: u32 = STATE_SHIFT + 2;
const TAG_SHIFT: u32 = SIZE_SHIFT + 6;
const ROOMY: u64 = 1;
const REFUSED: u64 = 2;

impl Slot {
    fn read(word: u64) -> Self {
        Self {
            at: (word & ((1 << AT_BITS) - 1)) as u32,
            out: (word >> OUT_SHIFT) & 0x7f,
            state: (word >> STATE_SHIFT) & 0x3,
            size: (word >> SIZE_SHIFT) & 0x3f,
            tag: word >> TAG_SHIFT,
        }
    }

    fn word(self) -> u64 {
        u64::from(self.at)
            | self.out << OUT_SHIFT
            | self.state << STATE_SHIFT
            | self.size << SIZE_SHIFT
            | self.tag << TAG_SHIFT
    }
}

/// The bit length of a request's tokens: two requests of one size differ
/// by less than twice.
fn size(tokens: u64) -> u64 {
    u64::from(u64::BITS - tokens.leading_zeros()).min(0x3f)
}

/// Where a caller's slot is, and its tag.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caller {
    slot: usize,
    tag: u64,
}

/// The callers whose route may be asked before their admission's answer.
pub(crate) struct RouteAhead {
    slots: Box<[AtomicU64]>,
    /// Routes out ahead, of all callers (at most [`MOST_OUT`]).
    out: AtomicUsize,
    keys: std::hash::RandomState,
    start: Instant,
    fresh_ms: u32,
}

impl RouteAhead {
    /// None when `fresh` is zero: every route waits for its admission.
    pub(crate) fn new(fresh: Duration) -> Option<Arc<Self>> {
        // Well below the clock's wrap, so that "fresh" cannot wrap.
        let fresh_ms = u32::try_from(fresh.as_millis())
            .unwrap_or(u32::MAX)
            .min(1 << (AT_BITS - 1));
        (fresh_ms > 0).then(|| {
            Arc::new(Self {
                slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
                out: AtomicUsize::new(0),
                keys: std::hash::RandomState::new(),
                start: Instant::now(),
                fresh_ms,
            })
        })
    }

    /// The slot of a principal's key on `model`. The key as well as its
    /// ledger owner (a wallet, else the account; hashed as they are, with
    /// no owner string made): a key's own window can run out while its
    /// account has room; and the model, whose window can run out while
    /// another's has room.
    pub(crate) fn caller(&self, principal: &auth_pb::Principal, model: &str) -> Caller {
        let owner = match principal.wallet.as_str() {
            "" => principal.account_id.as_str(),
            wallet => wallet,
        };
        let key = crate::api_key_id(principal);
        self.hash((owner, !principal.wallet.is_empty(), key, model))
    }

    fn hash(&self, what: impl std::hash::Hash) -> Caller {
        let hash = self.keys.hash_one(what);
        Caller {
            slot: hash as usize & (SLOTS - 1),
            tag: (hash >> TAG_SHIFT) | 1,
        }
    }

    /// Sends one more route of `caller` ahead when its last answer, fresh,
    /// left room for this request (`tokens` in the windows) and few of its
    /// routes (and of the gateway's) are out ahead already.
    pub(crate) fn take(&self, caller: Caller, tokens: u64) -> bool {
        let counted = self
            .out
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |out| {
                (out < MOST_OUT).then_some(out + 1)
            })
            .is_ok();
        if !counted {
            return false;
        }
        let now = self.now();
        let taken = self.update(caller.slot, |slot| {
            (slot.tag == caller.tag
                && slot.state == ROOMY
                && self.fresh(now, slot.at)
                && size(tokens) <= slot.size
                && slot.out < ROOM / 2)
                .then_some(Slot {
                    out: slot.out + 1,
                    ..slot
                })
        });
        if !taken {
            self.out.fetch_sub(1, Ordering::Relaxed);
        }
        taken
    }

    /// A route sent ahead has its admission's answer (or was dropped).
    fn returned(&self, caller: Caller) {
        // Counted back whether or not its slot is still the caller's.
        self.out.fetch_sub(1, Ordering::Relaxed);
        self.update(caller.slot, |slot| {
            (slot.tag == caller.tag && slot.out > 0).then_some(Slot {
                out: slot.out - 1,
                ..slot
            })
        });
    }

    /// A settlement of `caller` charged `cost` against a hold of `held`
    /// ([`held`]): beyond it, the balance may be gone (a backend reported
    /// more than the hold assumed), and the caller's next request waits for
    /// its own hold.
    pub(crate) fn settled(&self, caller: Caller, cost: &billing_pb::Cost, held: Option<Decimal>) {
        if !within_hold(&cost.usd, &cost.diem, held) {
            self.answered(caller, 0, false);
        }
    }

    /// A charge (a hold and its settlement in one call, for a route asked
    /// ahead) of a request of `tokens` answered `hold` and charged `cost`:
    /// a hold with room, and a charge within it, is what keeps the caller
    /// roomy (its admission alone does not: [`Answer::charged_later`]);
    /// anything else sends its next request in order.
    pub(crate) fn charged(
        &self,
        caller: Caller,
        tokens: u64,
        hold: &billing_pb::HoldResponse,
        cost: &billing_pb::Cost,
    ) {
        let within = within_hold(&cost.usd, &cost.diem, held(&hold.held_usd, &hold.held_diem));
        let roomy = hold_room(hold) && within;
        self.answered(caller, if roomy { tokens } else { 0 }, roomy);
    }

    /// What the limiter and billing answered the caller for a request of
    /// `tokens`: room for [`ROOM`] more like it, or not (a refusal, little
    /// room, a settlement above its hold). Not-roomy stands for as long as
    /// room is believed: a roomy answer that was in flight meanwhile
    /// leaves it.
    pub(crate) fn answered(&self, caller: Caller, tokens: u64, roomy: bool) {
        let now = self.now();
        self.update(caller.slot, |slot| {
            let ours = slot.tag == caller.tag;
            let out = if ours { slot.out } else { 0 };
            if ours && slot.state == REFUSED && self.fresh(now, slot.at) && roomy {
                return None;
            }
            Some(Slot {
                at: now,
                out,
                state: if roomy { ROOMY } else { REFUSED },
                size: if roomy { size(tokens) } else { 0 },
                tag: caller.tag,
            })
        });
    }

    /// Applies `change` to the slot's word atomically; whether it changed.
    fn update(&self, slot: usize, change: impl Fn(Slot) -> Option<Slot>) -> bool {
        self.slots[slot]
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
                change(Slot::read(word)).map(Slot::word)
            })
            .is_ok()
    }

    fn fresh(&self, now: u32, at: u32) -> bool {
        now.wrapping_sub(at) & ((1 << AT_BITS) - 1) < self.fresh_ms
    }

    fn now(&self) -> u32 {
        // Truncated on purpose: the slot keeps the low bits, and
        // [`RouteAhead::fresh`] reads them wrapping.
        (self.start.elapsed().as_millis() as u32) & ((1 << AT_BITS) - 1)
    }
}

/// A route asked ahead, running as a task of its own: aborted (its call,
/// and the upstream's, cancelled) when dropped unanswered, as it is when
/// the admission or the hold refuses.
pub(crate) struct Asked {
    task: Option<tokio::task::JoinHandle<rialto_core::Result<router_pb::ChatResponse>>>,
    ahead: Arc<RouteAhead>,
    caller: Caller,
}

impl Asked {
    pub(crate) fn ask(
        ahead: &Arc<RouteAhead>,
        caller: Caller,
        router: &rialto_router::RouterClient,
        chat: rialto_router::Chat,
    ) -> Self {
        let router = router.clone();
        // In the request's span: the router's call continues its trace.
        // Boxed, as the answer's task is (`chat::complete`).
        let task = tokio::spawn(tracing::Instrument::instrument(
            Box::pin(async move { router.chat(chat).await }),
            tracing::Span::current(),
        ));
        Self {
            task: Some(task),
            ahead: Arc::clone(ahead),
            caller,
        }
    }

    /// The router's answer, once the caller was admitted (and held, unless
    /// its hold comes with its charge), and the route's place among those
    /// out ahead: given back when [`Out`] drops, at once for a request
    /// held already, after its charge for one that is not, so that the
    /// routes of a caller not yet held stay within the room shown.
    pub(crate) async fn answer(mut self) -> (rialto_core::Result<router_pb::ChatResponse>, Out) {
        let out = Out {
            ahead: Arc::clone(&self.ahead),
            caller: self.caller,
        };
        // Always there: `answer` takes the only handle.
        let Some(task) = self.task.take() else {
            let gone = rialto_core::Error::internal("a route asked ahead is gone");
            return (Err(gone), out);
        };
        count(true);
        let answered = task.await.map_err(|error| {
            rialto_core::Error::internal(format!("the route's task failed: {error}"))
        });
        (answered.and_then(|answered| answered), out)
    }
}

/// A route asked ahead, answered, still counted out ahead until this drops.
pub(crate) struct Out {
    ahead: Arc<RouteAhead>,
    caller: Caller,
}

impl Drop for Out {
    fn drop(&mut self) {
        self.ahead.returned(self.caller);
    }
}

impl Drop for Asked {
    /// Dropped unanswered: refused (or its client left first).
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            self.ahead.returned(self.caller);
            count(false);
            task.abort();
        }
    }
}

/// What an admission and hold answered a caller, told to the table when
/// dropped: their room ([`room_left`]) once [`Answer::admitted`] says
/// nothing was left to refuse the request; not roomy otherwise (a return
/// with an error on the way, the wallet's minimum for one).
pub(crate) struct Answer {
    ahead: Arc<RouteAhead>,
    caller: Caller,
    tokens: u64,
    roomy: bool,
    admitted: bool,
    charged_later: bool,
}

impl Answer {
    pub(crate) fn new(ahead: &Arc<RouteAhead>, caller: Caller, tokens: u64, roomy: bool) -> Self {
        Self {
            ahead: Arc::clone(ahead),
            caller,
            tokens,
            roomy,
            admitted: false,
            charged_later: false,
        }
    }

    pub(crate) fn admitted(&mut self) {
        self.admitted = true;
    }

    /// The request is held with its charge, after its answer: only the
    /// charge ([`RouteAhead::charged`]) tells that the caller has room; this
    /// answer (the windows alone) only tells when it has not.
    pub(crate) fn charged_later(&mut self) {
        self.charged_later = true;
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        let roomy = self.admitted && self.roomy;
        if roomy && self.charged_later {
            return;
        }
        self.ahead.answered(self.caller, self.tokens, roomy);
    }
}

/// Counts a route asked ahead that was `used` or `dropped`.
fn count(used: bool) {
    use rialto_core::metrics::{Counter, OutcomeLabels, Resolved, metrics};
    static USED: Resolved<Counter> = Resolved::new();
    static DROPPED: Resolved<Counter> = Resolved::new();
    let (resolved, outcome) = if used {
        (&USED, "used")
    } else {
        (&DROPPED, "dropped")
    };
    resolved
        .of(&metrics().routes_ahead, || OutcomeLabels { outcome })
        .inc();
}

/// An exact amount; None when it is not one (a field an older peer left
/// empty): room is then not assumed.
fn amount(text: &str) -> Option<Decimal> {
    text.parse().ok()
}

/// What a hold reserved of both currencies (exact decimals); None when
/// it cannot be read.
pub(crate) fn held(usd: &str, diem: &str) -> Option<Decimal> {
    amount(usd)?.checked_add(amount(diem)?)
}

/// Whether a charge (exact decimals, USD and DIEM) stayed within what its
/// hold reserved. What cannot be read is not within.
fn within_hold(usd: &str, diem: &str, held: Option<Decimal>) -> bool {
    matches!((self::held(usd, diem), held), (Some(charged), Some(held)) if charged <= held)
}

/// Whether the limiter's admission and billing's hold left room for
/// [`ROOM`] more requests like this one (`tokens` in the windows): the shown
/// window's requests and tokens, and the balance against what was held
/// ([`hold_room`]; `hold` None: the hold comes with the charge, after the
/// answer, and only the windows are known now).
/// Nor is an admission whose windows were shown elsewhere (`windows_shown`
/// false: a request with files, admitted before its file work) roomy.
pub(crate) fn room_left(
    admission: &rialto_core::Result<Admission>,
    windows_shown: bool,
    hold: Option<&rialto_core::Result<billing_pb::HoldResponse>>,
    tokens: u64,
) -> bool {
    let Ok(admission) = admission else {
        return false;
    };
    if !windows_shown || admission.refusal.is_some() {
        return false;
    }
    let windows = admission.headers.as_ref().is_none_or(|shown| {
        shown.remaining_requests >= ROOM
            && shown
                .tokens
                .as_ref()
                .is_none_or(|window| window.remaining >= ROOM.saturating_mul(tokens))
    });
    windows && hold.is_none_or(|hold| hold.as_ref().is_ok_and(hold_room))
}

/// Whether a hold left room for [`ROOM`] more like it: placed, and the
/// balance before it at least that many times what it held. A capped key
/// is never roomy (its cap's remainder is not in the answer).
pub(crate) fn hold_room(hold: &billing_pb::HoldResponse) -> bool {
    if !hold.placed || !hold.key_period.is_empty() {
        return false;
    }
    let balance = || {
        let before = hold.before.as_ref()?;
        let held = amount(&hold.held_usd)?.checked_add(amount(&hold.held_diem)?)?;
        let balance = amount(&before.usd)?.checked_add(amount(&before.diem)?)?;
        Some(held.is_zero() || balance >= held.checked_mul(Decimal::from(ROOM))?)
    };
    balance() == Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Arc<RouteAhead> {
        RouteAhead::new(Duration::from_secs(2)).unwrap()
    }

    fn principal(account: &str, key: &str) -> auth_pb::Principal {
        auth_pb::Principal {
            account_id: account.into(),
            key_id: key.into(),
            ..Default::default()
        }
    }

    /// A table, and a caller whose admission of 100 tokens left room.
    fn answered_roomy() -> (Arc<RouteAhead>, Caller) {
        let ahead = table();
        let caller = ahead.caller(&principal("acct", "key"), "m");
        ahead.answered(caller, 100, true);
        (ahead, caller)
    }

    #[test]
    fn a_slot_word_reads_back_as_written() {
        let slot = Slot {
            at: (1 << AT_BITS) - 1,
            out: 0x7f,
            state: REFUSED,
            size: 0x3f,
            tag: (1 << (64 - TAG_SHIFT)) - 1,
        };
        assert_eq!(Slot::read(slot.word()), slot);
        let slot = Slot {
            at: 12_345,
            out: 3,
            state: ROOMY,
            size: 10,
            tag: 1,
        };
        assert_eq!(Slot::read(slot.word()), slot);
    }

    #[test]
    fn a_caller_goes_ahead_once_answered_roomy_and_not_after_a_refusal() {
        let ahead = table();
        let caller = ahead.caller(&principal("acct", "key"), "m");
        assert!(!ahead.take(caller, 100));
        ahead.answered(caller, 100, true);
        assert!(ahead.take(caller, 100));
        ahead.returned(caller);
        for other in [
            ahead.caller(&principal("acct", "other key"), "m"),
            ahead.caller(&principal("other acct", "key"), "m"),
            ahead.caller(&principal("acct", "key"), "other model"),
        ] {
            assert!(!ahead.take(other, 100));
        }
        ahead.answered(caller, 100, false);
        assert!(!ahead.take(caller, 100));
        // A roomy answer that was in flight does not undo the refusal.
        ahead.answered(caller, 100, true);
        assert!(!ahead.take(caller, 100));
    }

    #[test]
    fn only_requests_of_the_answered_size_go_ahead() {
        let (ahead, caller) = answered_roomy();
        // 100 has 7 bits: up to 127 goes ahead, 128 waits.
        assert!(ahead.take(caller, 127));
        assert!(!ahead.take(caller, 128));
        assert!(ahead.take(caller, 1));
    }

    #[test]
    fn at_most_half_the_room_is_out_ahead_at_once() {
        let (ahead, caller) = answered_roomy();
        for _ in 0..ROOM / 2 {
            assert!(ahead.take(caller, 100));
        }
        assert!(!ahead.take(caller, 100));
        // Another roomy answer keeps the count of those out.
        ahead.answered(caller, 100, true);
        assert!(!ahead.take(caller, 100));
        ahead.returned(caller);
        assert!(ahead.take(caller, 100));
    }

    #[test]
    fn a_route_is_counted_out_until_it_returns_even_when_racing() {
        let (ahead, caller) = answered_roomy();
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..10_000 {
                        if ahead.take(caller, 100) {
                            ahead.returned(caller);
                        }
                    }
                });
            }
        });
        assert_eq!(
            Slot::read(ahead.slots[caller.slot].load(Ordering::Relaxed)).out,
            0
        );
        assert_eq!(ahead.out.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn another_callers_answers_only_evict_it_from_a_shared_slot() {
        let ahead = table();
        let caller = ahead.caller(&principal("acct", "key"), "m");
        ahead.answered(caller, 100, true);
        let mut shared = 0;
        for n in 0..100_000 {
            let other = ahead.caller(&principal(&format!("acct-{n}"), "key"), "m");
            if other.slot == caller.slot {
                shared += 1;
                continue;
            }
            ahead.answered(other, 100, false);
        }
        assert!(shared > 0);
        assert!(ahead.take(caller, 100));
    }

    #[test]
    fn at_most_so_many_routes_of_all_callers_are_out_at_once() {
        let ahead = table();
        let callers: Vec<Caller> = (0..MOST_OUT)
            .map(|n| {
                let caller = ahead.caller(&principal(&format!("acct-{n}"), "key"), "m");
                ahead.answered(caller, 100, true);
                caller
            })
            .collect();
        // Callers that share a slot evict each other: only the last of
        // each slot is roomy, so count what went ahead.
        let taken: Vec<Caller> = callers
            .iter()
            .chain(&callers)
            .copied()
            .filter(|caller| ahead.take(*caller, 100))
            .collect();
        assert_eq!(taken.len(), MOST_OUT);
        let last = ahead.caller(&principal("one more", "key"), "m");
        ahead.answered(last, 100, true);
        assert!(!ahead.take(last, 100));
        // One back, one more may go; a refused take counts nothing.
        ahead.returned(taken[0]);
        assert!(ahead.take(last, 100));
        assert!(!ahead.take(last, 100));
        for caller in taken.iter().skip(1).chain([&last]) {
            ahead.returned(*caller);
        }
        assert_eq!(ahead.out.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn zero_turns_it_off() {
        assert!(RouteAhead::new(Duration::ZERO).is_none());
    }

    #[test]
    fn a_cost_within_its_hold() {
        assert!(within_hold("0.0005", "0.0005", held("0.0005", "0.0005")));
        assert!(within_hold("0.0005", "0.0005", held("0.001", "0")));
        assert!(!within_hold("0.0005", "0.0005", held("0.0009", "0")));
        // What cannot be read is not within.
        assert!(!within_hold("0.0005", "0.0005", held("", "0")));
        assert!(!within_hold("", "0", held("1", "0")));
    }

    #[test]
    fn a_charge_beyond_its_hold_ends_the_room() {
        let (ahead, caller) = answered_roomy();
        let cost = |usd: &str| billing_pb::Cost {
            usd: usd.into(),
            diem: "0".into(),
        };
        ahead.settled(caller, &cost("0.001"), held("0.001", "0"));
        assert!(ahead.take(caller, 100));
        ahead.settled(caller, &cost("0.0011"), held("0.001", "0"));
        assert!(!ahead.take(caller, 100));
    }

    /// A charge (hold and settlement at once) that left room keeps the
    /// caller roomy; one without room, or above its hold, does not.
    #[test]
    fn a_charge_without_room_sends_the_caller_in_order() {
        let charged = |before: &str, cost_usd: &str| {
            let (ahead, caller) = answered_roomy();
            let hold = hold(before, "0.1").unwrap();
            let cost = billing_pb::Cost {
                usd: cost_usd.into(),
                diem: "0".into(),
            };
            ahead.charged(caller, 100, &hold, &cost);
            ahead.take(caller, 100)
        };
        assert!(charged("6.4", "0.1"));
        assert!(!charged("6.3", "0.1"));
        assert!(!charged("100", "0.11"));
    }

    /// The admission of a request held with its charge tells only a lack
    /// of room: the room it shows is not believed before the charge says so.
    #[test]
    fn an_admission_alone_does_not_renew_the_room() {
        let ahead = table();
        let caller = ahead.caller(&principal("acct", "key"), "m");
        let mut answer = Answer::new(&ahead, caller, 100, true);
        answer.charged_later();
        answer.admitted();
        drop(answer);
        assert!(!ahead.take(caller, 100), "roomy on its windows alone");
        // Not roomy: told.
        let (ahead, caller) = answered_roomy();
        let mut answer = Answer::new(&ahead, caller, 100, false);
        answer.charged_later();
        answer.admitted();
        drop(answer);
        assert!(!ahead.take(caller, 100));
    }

    /// A route not held until its charge counts out ahead until its `Out`
    /// drops: a caller's unheld routes stay within half the room.
    #[test]
    fn an_unheld_route_counts_out_ahead_until_charged() {
        let (ahead, caller) = answered_roomy();
        let outs: Vec<Out> = (0..ROOM / 2)
            .map(|_| {
                assert!(ahead.take(caller, 100));
                Out {
                    ahead: Arc::clone(&ahead),
                    caller,
                }
            })
            .collect();
        assert!(!ahead.take(caller, 100));
        drop(outs);
        assert!(ahead.take(caller, 100));
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
    fn room_is_left_only_for_many_more_requests_like_this_one() {
        let tokens = 100;
        let roomy = |admission, hold| room_left(&admission, true, Some(&hold), tokens);
        assert!(roomy(admitted(64, 6_400), hold("6.4", "0.1")));
        // The balance takes fewer than 64 more.
        assert!(!roomy(admitted(64, 6_400), hold("6.3", "0.1")));
        // The window's requests, or its tokens.
        assert!(!roomy(admitted(63, 6_400), hold("100", "0.1")));
        assert!(!roomy(admitted(64, 6_399), hold("100", "0.1")));
        // A free model holds nothing: only the window counts.
        assert!(roomy(admitted(64, 6_400), hold("0", "0")));
        // What cannot be read is not room.
        assert!(!roomy(admitted(64, 6_400), hold("100", "")));
        assert!(!roomy(admitted(64, 6_400), hold("-", "0.1")));
        // Windows shown elsewhere (a request with files).
        let elsewhere = room_left(
            &admitted(64, 6_400),
            false,
            Some(&hold("100", "0.1")),
            tokens,
        );
        assert!(!elsewhere);
        // Refusals.
        let mut refused = hold("100", "0.1");
        if let Ok(hold) = &mut refused {
            hold.placed = false;
        }
        assert!(!roomy(admitted(64, 6_400), refused));
        let mut capped = hold("100", "0.1");
        if let Ok(hold) = &mut capped {
            hold.key_period = "EPOCH:2026-11-27".into();
        }
        assert!(!roomy(admitted(64, 6_400), capped));
        let failed = Err(rialto_core::Error::internal("billing is down"));
        assert!(!roomy(admitted(64, 6_400), failed));
    }
}
