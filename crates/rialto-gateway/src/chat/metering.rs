//! The money of a chat (and of every priced endpoint): the limiter's
//! admission and billing's hold before the call ([`admit`]), and the
//! [`Settlement`] that bills what was used however the request ends. The
//! HTTP side (`super`) only asks and answers; what is decided here is
//! billing's and the limiter's, through their clients.

use std::sync::Arc;

use actix_web::{HttpMessage, HttpRequest, HttpResponseBuilder};
use rialto_billing::BillingClient;
use rialto_billing::usage_queue::{Settled, settle_durably};
use rialto_core::ErrorCode;
use rialto_core::metrics::{Counter, ModelCounters, OutcomeLabels, Resolved, TokenKind, metrics};
use rialto_limiter::{Admission, RateLimiter, Target, Ticket};
use rialto_proto::auth::v1 as auth_pb;
use rialto_proto::billing::v1 as billing_pb;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::chunks::{Members, repeats_a_name};
use crate::holding::{Holder, Holding};
use crate::{ApiError, Gateway, ModelEntry, RateLimitHeaders};

/// `X-Balance-Remaining`: a wallet's USD balance after the request.
pub(crate) const BALANCE_REMAINING: &str = "x-balance-remaining";

/// Puts `X-Balance-Remaining` on a signed-in wallet's response: its USD
/// balance before the request (`before`; None for an account) less the
/// `cost` charged.
pub(crate) fn balance_remaining(
    response: &mut HttpResponseBuilder,
    before: Option<rust_decimal::Decimal>,
    cost: &Cost,
) {
    if let Some(before) = before {
        response.insert_header((BALANCE_REMAINING, cost.usd_left(before)));
    }
}

/// What a request was charged: the response's `cost`, `{"usd", "diem"}`.
/// Billing's exact decimal strings are kept as JSON numbers written digit
/// for digit (serde_json's `arbitrary_precision`), as the spec wants, and
/// written by whoever writes the answer; not a `json!` map built per
/// request (two decimal strings parsed as whole JSON documents and a map
/// of two keys cost ~2,000 instructions a chat).
///
/// Its members are written in the order a tree wrote them (by name), so
/// answers read byte for byte as they did.
#[derive(Debug, serde::Serialize)]
pub(crate) struct Cost {
    diem: serde_json::Number,
    usd: serde_json::Number,
}

impl Cost {
    /// A request that cost nothing (a free model).
    pub(crate) fn free() -> Self {
        Self {
            usd: 0u64.into(),
            diem: 0u64.into(),
        }
    }

    /// Billing's cost. An amount that is not a JSON number (billing
    /// writes plain decimals, never anything else) reads as 0 rather than
    /// break the answer.
    pub(crate) fn of(cost: &billing_pb::Cost) -> Self {
        let number = |text: &str| text.parse().unwrap_or_else(|_| 0u64.into());
        Self {
            usd: number(&cost.usd),
            diem: number(&cost.diem),
        }
    }

    /// A price in USD alone, known before the call (`usd_nanos`).
    pub(crate) fn usd_nanos(usd_nanos: u64) -> Self {
        Self::of(&billing_pb::Cost {
            usd: rialto_billing::from_nanos(i64::try_from(usd_nanos).unwrap_or(i64::MAX)),
            diem: "0".into(),
        })
    }

    /// A wallet's USD balance after this charge, from its balance
    /// `before` (`X-Balance-Remaining`).
    pub(crate) fn usd_left(&self, before: rust_decimal::Decimal) -> String {
        let charged: rust_decimal::Decimal = self.usd.as_str().parse().unwrap_or_default();
        (before - charged).normalize().to_string()
    }

    /// As a JSON tree, for the answers built as one (the derived shape:
    /// one definition of it).
    pub(crate) fn to_value(&self) -> Value {
        // Two numbers under string keys: serializing cannot fail.
        serde_json::to_value(self).unwrap_or_default()
    }
}

/// Tells the limiter what an admitted request really used, at most once:
/// the real usage when the response ends (a stream cut by the client, or a
/// non-streamed call the client left, included: both run to their end in a
/// task of their own), none when no backend answered. A settlement dropped
/// any other way sends the limiter nothing, so its estimate stands, and
/// releases its hold.
pub(crate) struct Settlement {
    limiter: RateLimiter,
    ticket: Option<Ticket>,
    billing: BillingClient,
    /// Where a settlement billing cannot take now is queued.
    usage_queue: Option<rialto_core::bus::Bus>,
    owner: String,
    request_id: String,
    model_id: String,
    /// The model's spend and token counters.
    counters: Arc<ModelCounters>,
    /// A hold is open in the ledger until the request is billed.
    held: bool,
    /// What the hold reserved (exact decimals).
    pub(super) held_usd: String,
    held_diem: String,
    /// The capped key and the period its hold counted in, if any.
    key_id: String,
    key_period: String,
    /// That key's caps, which bound a charge beyond the hold.
    key_limit: Option<billing_pb::KeyLimit>,
    prices: rialto_billing::Prices,
    /// What the request cost besides its tokens (searches, scraped pages),
    /// in USD nano-units: charged with whatever usage it settles.
    pub(crate) extra_usd_nanos: u64,
    /// Tokens the request used besides its answer's (the model's search
    /// query), counted in its rate windows.
    pub(crate) extra_tokens: u64,
    /// The request's span, which gets the GenAI usage attributes (a stream
    /// keeps it open until its end).
    span: tracing::Span,
    /// The table of routes asked ahead (a split deployment's gateway) and
    /// the caller's slot in it, told when a charge goes beyond the hold.
    ahead: Option<(Arc<crate::ahead::RouteAhead>, crate::ahead::Caller)>,
    /// The hold not asked yet, of a route asked ahead, and the tokens the
    /// request counts in its windows: asked with the settlement, in one
    /// call ([`Settlement::charge`]).
    pub(super) charge: Option<(billing_pb::HoldRequest, u64)>,
    /// That route's place among the routes out ahead, given back once it
    /// is charged (or the settlement drops).
    pub(crate) out_ahead: Option<crate::ahead::Out>,
    /// The balance before the request, when the charge told it (else the
    /// hold did, in [`admit`]).
    pub(crate) balance_before: Option<billing_pb::Balance>,
}

/// A settlement dropped with its hold open was never billed: its handler
/// was dropped (a stream's client left before the backend answered) or a
/// path ended without a word to billing. Nothing was served through it (a
/// stream that sent anything is billed by its relay), so the hold is
/// released now instead of waiting out its lease; the limiter is told
/// nothing, and the request's estimate stands in its windows.
impl Drop for Settlement {
    fn drop(&mut self) {
        if self.held {
            tracing::debug!(
                request_id = self.request_id,
                "unbilled hold released as its request drops"
            );
            self.ticket = None;
            self.release();
        }
    }
}

impl Settlement {
    fn settle(&mut self, used_tokens: u64) {
        if let Some(ticket) = self.ticket.take() {
            let used_tokens = used_tokens.saturating_add(self.extra_tokens);
            self.limiter.commit(ticket, used_tokens);
        }
    }

    /// The request never ran: its rate-limit slots are given back.
    fn refused(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            self.limiter.release(ticket);
        }
    }

    /// `usage` with the request's extras, as billing prices it.
    fn billed(&self, usage: &Usage) -> billing_pb::Usage {
        billing_pb::Usage {
            extra_usd_nanos: self.extra_usd_nanos,
            ..usage.billed()
        }
    }

    fn settle_request(&self, usage: &Usage) -> billing_pb::SettleRequest {
        billing_pb::SettleRequest {
            request_id: self.request_id.clone(),
            model_id: self.model_id.clone(),
            usage: Some(self.billed(usage)),
            owner: self.owner.clone(),
            held_usd: self.held_usd.clone(),
            held_diem: self.held_diem.clone(),
            key_id: self.key_id.clone(),
            key_period: self.key_period.clone(),
            key_limit: self.key_limit.clone(),
        }
    }

    /// The settlement, with no hold, of a charge whose call failed
    /// ([`charge_durably`]): in the key's period now, as billing names it
    /// (a hold would have said).
    fn unheld_request(
        &self,
        usage: &Usage,
        key_limit: Option<billing_pb::KeyLimit>,
    ) -> billing_pb::SettleRequest {
        let key_period = key_limit
            .as_ref()
            .and_then(|limit| {
                rialto_billing::ledger::period_key(&limit.period, rialto_core::db::now_ms())
            })
            .unwrap_or_default();
        billing_pb::SettleRequest {
            key_period,
            key_limit,
            ..self.settle_request(usage)
        }
    }

    /// Records what a running stream used so far (off the stream's path):
    /// a crash from here on still charges at least this much.
    pub(super) fn checkpoint(&self, usage: &Usage) {
        if !self.held {
            return;
        }
        let billing = self.billing.clone();
        let request = billing_pb::CheckpointRequest {
            request_id: self.request_id.clone(),
            owner: self.owner.clone(),
            model_id: self.model_id.clone(),
            usage: Some(self.billed(usage)),
        };
        tokio::spawn(async move {
            if let Err(error) = billing.checkpoint(request).await {
                tracing::warn!(%error, "stream checkpoint failed");
            }
        });
    }

    /// Charges `usage` against the hold (and commits its tokens to the
    /// limiter); the `cost` object of the response.
    pub(crate) async fn bill(&mut self, usage: &Usage) -> Result<Cost, ApiError> {
        let cost = match self.charge.take() {
            Some((hold, tokens)) => {
                // A refusal gives the limiter its slots back (`charge`).
                let charged = self.charge(hold, tokens, usage).await;
                self.out_ahead = None;
                self.settle(usage.total());
                let cost = charged?;
                self.count_tokens(usage);
                cost
            }
            None => {
                self.settle(usage.total());
                self.count_tokens(usage);
                if !std::mem::take(&mut self.held) {
                    // Nothing was reserved (a free model): nothing to
                    // charge, and no round trip to the ledger.
                    return Ok(Cost::free());
                }
                let request = self.settle_request(usage);
                let billed = request.usage.unwrap_or_default();
                let settled =
                    settle_durably(&self.billing, self.usage_queue.as_ref(), request).await;
                count_settlement(&settled);
                let cost = match settled? {
                    Settled::Now(cost) => cost,
                    // Billing will settle the queued record as the ledger
                    // would now.
                    Settled::Queued => rialto_billing::expected_cost(
                        &self.prices,
                        &billed,
                        &self.held_usd,
                        &self.held_diem,
                    )?,
                };
                if let Some((table, caller)) = &self.ahead {
                    let held = crate::ahead::held(&self.held_usd, &self.held_diem);
                    table.settled(*caller, &cost, held);
                }
                cost
            }
        };
        if let Ok(usd) = cost.usd.parse::<f64>() {
            self.counters.spend_usd(usd);
        }
        Ok(Cost::of(&cost))
    }

    /// Holds and settles in one call to billing, the answer of a route
    /// asked ahead in hand: one call fewer than a hold and a settlement. A
    /// refusal is the hold's (402, nothing charged), and the answer is not
    /// served. A charge whose call failed is settled without a hold and
    /// the answer served ([`charge_durably`]).
    async fn charge(
        &mut self,
        hold: billing_pb::HoldRequest,
        tokens: u64,
        usage: &Usage,
    ) -> Result<billing_pb::Cost, ApiError> {
        // (None for a route asked ahead but for a key whose limits cap
        // nothing: a capped key is never roomy.)
        let key_limit = hold.key_limit.clone();
        let request = billing_pb::ChargeRequest {
            hold: Some(hold),
            usage: Some(self.billed(usage)),
            key_id: self.key_id.clone(),
        };
        let charged = charge_durably(
            &self.billing,
            self.usage_queue.as_ref(),
            &self.prices,
            request,
            || self.unheld_request(usage, key_limit.clone()),
        )
        .await;
        let (hold, cost) = match charged {
            Ok(Charged::Held(hold, cost)) => (Some(hold), Ok(cost)),
            Ok(Charged::Refused(hold)) => {
                // Not served: as a refused hold, the request never ran.
                self.refused();
                let period = key_limit.as_ref().map_or("EPOCH", |l| l.period.as_str());
                let refusal = refused_by_hold(&hold, period);
                (Some(hold), Err(refusal))
            }
            Ok(Charged::Unheld(cost)) => (None, Ok(cost)),
            Err(error) => (None, Err(error)),
        };
        if let Some(hold) = &hold {
            count_hold(hold);
            self.balance_before.clone_from(&hold.before);
        }
        if let Some((table, caller)) = &self.ahead {
            match (&hold, &cost) {
                (Some(hold), Ok(cost)) => table.charged(*caller, tokens, hold, cost),
                // Refused, failed, or charged with no hold to show the room
                // left: the caller's next route waits for its hold.
                _ => table.answered(*caller, 0, false),
            }
        }
        cost
    }

    /// Like `bill`, off the response path (the client is gone or the
    /// stream failed): what the upstream produced is still billed.
    pub(crate) fn bill_later(&mut self, usage: &Usage) {
        self.settle(usage.total());
        self.count_tokens(usage);
        self.out_ahead = None;
        if let Some((hold, _)) = self.charge.take() {
            // Not held yet: what nothing used costs nothing to charge.
            if usage.total() > 0 || self.extra_usd_nanos > 0 {
                let unheld = self.unheld_request(usage, hold.key_limit.clone());
                let request = billing_pb::ChargeRequest {
                    hold: Some(hold),
                    usage: Some(self.billed(usage)),
                    key_id: self.key_id.clone(),
                };
                charge_later(
                    self.billing.clone(),
                    self.usage_queue.clone(),
                    self.prices.clone(),
                    request,
                    unheld,
                );
            }
            return;
        }
        if !std::mem::take(&mut self.held) {
            return;
        }
        let request = self.settle_request(usage);
        let ahead = self.ahead.clone().map(|(table, caller)| {
            let held = crate::ahead::held(&self.held_usd, &self.held_diem);
            (table, caller, held)
        });
        settle_later(
            self.billing.clone(),
            self.usage_queue.clone(),
            request,
            ahead,
        );
    }

    fn count_tokens(&self, usage: &Usage) {
        // In one call: each `record` is a round through the subscriber's
        // layers (the log's layer formats what it is given into the span).
        tracing::record_all!(
            self.span,
            gen_ai.response.model = self.model_id.as_str(),
            gen_ai.usage.input_tokens = usage.prompt,
            gen_ai.usage.output_tokens = usage.completion,
        );
        self.counters.tokens(TokenKind::Prompt, usage.prompt);
        self.counters
            .tokens(TokenKind::Completion, usage.completion);
    }

    /// The settlement a durable job will make (billing sends it when the
    /// job finishes, whichever process finishes it).
    pub(crate) fn job_settlement(&self) -> billing_pb::SettleRequest {
        self.settle_request(&Usage::none())
    }

    /// The hold now belongs to a stored job: the limiter's slot is
    /// committed (the job was admitted), and nothing is settled here.
    pub(crate) fn handed_to_job(&mut self) {
        self.settle(0);
        self.held = false;
    }

    /// No backend answered: nothing used, nothing charged (not the
    /// searches either: a request that fails costs nothing), the hold
    /// released.
    pub(crate) fn release(&mut self) {
        self.extra_usd_nanos = 0;
        self.bill_later(&Usage::none());
    }
}

/// Settles `request` in a task of its own (awaited at shutdown), telling
/// the table of routes asked ahead what it cost.
pub(crate) fn settle_later(
    billing: BillingClient,
    queue: Option<rialto_core::bus::Bus>,
    request: billing_pb::SettleRequest,
    ahead: Option<(
        Arc<crate::ahead::RouteAhead>,
        crate::ahead::Caller,
        Option<rust_decimal::Decimal>,
    )>,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let pending = PendingSettlement::start();
    runtime.spawn(async move {
        let settled = settle_durably(&billing, queue.as_ref(), request).await;
        count_settlement(&settled);
        match settled {
            Ok(Settled::Now(cost)) => {
                if let Some((table, caller, held)) = ahead {
                    table.settled(caller, &cost, held);
                }
            }
            Ok(Settled::Queued) => {}
            Err(error) => {
                tracing::warn!(%error, "settlement failed; the hold will expire");
            }
        }
        drop(pending);
    });
}

/// Charges `request` (a hold and its settlement in one) in a task of its
/// own, awaited at shutdown.
fn charge_later(
    billing: BillingClient,
    queue: Option<rialto_core::bus::Bus>,
    prices: rialto_billing::Prices,
    request: billing_pb::ChargeRequest,
    unheld: billing_pb::SettleRequest,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let pending = PendingSettlement::start();
    runtime.spawn(async move {
        // (No path comes here with usage today: a route asked ahead is a
        // plain chat, billed in its own task however its client goes.)
        match charge_durably(&billing, queue.as_ref(), &prices, request, || unheld).await {
            Ok(Charged::Held(..) | Charged::Unheld(_)) => {}
            Ok(Charged::Refused(_)) => {
                tracing::warn!("charge refused: what was used goes uncharged");
            }
            Err(error) => tracing::warn!(%error, "charge failed: what was used goes uncharged"),
        }
        drop(pending);
    });
}

/// What a charge came to ([`charge_durably`]).
#[derive(Debug)]
enum Charged {
    /// Held and charged in one call: the hold's answer and the cost.
    Held(billing_pb::HoldResponse, billing_pb::Cost),
    /// The hold refused: nothing was charged.
    Refused(billing_pb::HoldResponse),
    /// The call failed: settled with no hold, now or from the durable
    /// queue, for this cost.
    Unheld(billing_pb::Cost),
}

/// Charges `request`, a hold and its settlement in one call, the answer
/// in hand.
///
/// A call that failed may have been charged all the same (only its reply
/// was lost), so it is not asked again as a hold: that charge may have
/// spent the room the hold would look for, and a billing that cannot be
/// reached answers no hold. It is settled without a hold, idempotent on
/// the request id as every settlement is (a charge made settles nothing
/// more), and queued durably when billing cannot take it; only an error
/// that no retry changes (a model billing does not know) refuses. A
/// settlement with no hold charges the balance and owes what it does not
/// cover; a route is asked ahead only for a caller that had room for many
/// more like it a moment before, which bounds that. `unheld` makes that
/// settlement, only when it is needed.
async fn charge_durably(
    billing: &BillingClient,
    queue: Option<&rialto_core::bus::Bus>,
    prices: &rialto_billing::Prices,
    request: billing_pb::ChargeRequest,
    unheld: impl FnOnce() -> billing_pb::SettleRequest,
) -> Result<Charged, ApiError> {
    let error = match billing.charge(request).await {
        Ok(charged) => {
            let hold = charged.hold.unwrap_or_default();
            return Ok(match charged.cost.filter(|_| hold.placed) {
                Some(cost) => {
                    if hold.reserved {
                        count_settlement_outcome(Outcome::Settled);
                    }
                    Charged::Held(hold, cost)
                }
                None => Charged::Refused(hold),
            });
        }
        Err(error) => error,
    };
    if rialto_billing::usage_queue::is_permanent(error.code) {
        return Err(error.into());
    }
    tracing::warn!(%error, "charge failed; settling it without a hold");
    let settle = unheld();
    let billed = settle.usage.unwrap_or_default();
    let settled = settle_durably(billing, queue, settle).await;
    count_settlement(&settled);
    let cost = match settled? {
        Settled::Now(cost) => cost,
        // Its price, as USD: billing takes Diem first from a balance that
        // has it, which this gateway does not know (the total is the same).
        Settled::Queued => {
            let usd = rialto_billing::to_nanos(prices.cost(&billed))?;
            billing_pb::Cost {
                usd: rialto_billing::from_nanos(usd),
                diem: "0".to_owned(),
            }
        }
    };
    Ok(Charged::Unheld(cost))
}

fn count_hold(hold: &billing_pb::HoldResponse) {
    static PLACED: Resolved<Counter> = Resolved::new();
    static REFUSED: Resolved<Counter> = Resolved::new();
    let (resolved, outcome) = if hold.placed {
        (&PLACED, "placed")
    } else {
        (&REFUSED, "refused")
    };
    resolved
        .of(&metrics().ledger_holds, || OutcomeLabels { outcome })
        .inc();
}

/// The 402 of a hold refused for an account's key: its spending cap for
/// `period`, or the balance.
fn refused_by_hold(hold: &billing_pb::HoldResponse, period: &str) -> ApiError {
    if hold.key_limit_reached.is_empty() {
        return ApiError::new(
            ErrorCode::PaymentRequired,
            "Insufficient USD or Diem balance to complete request. \
             Add credits to your account and try again.",
        );
    }
    ApiError::new(
        ErrorCode::PaymentRequired,
        format!(
            "This API key has reached its {} consumption limit for the current {} period. \
             Raise the key's consumptionLimit or wait for the next period.",
            hold.key_limit_reached, period
        ),
    )
}

/// Settlements running in background tasks, awaited at shutdown so no
/// charge is lost when the process exits.
static PENDING_SETTLEMENTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

static SETTLEMENT_DONE: tokio::sync::Notify = tokio::sync::Notify::const_new();

pub(crate) struct PendingSettlement;

impl PendingSettlement {
    pub(crate) fn start() -> Self {
        PENDING_SETTLEMENTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self
    }
}

impl Drop for PendingSettlement {
    fn drop(&mut self) {
        PENDING_SETTLEMENTS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        SETTLEMENT_DONE.notify_waiters();
    }
}

/// Whether every background settlement finished within `limit`.
pub(crate) async fn pending_settlements(limit: std::time::Duration) -> bool {
    let wait = async {
        loop {
            let done = SETTLEMENT_DONE.notified();
            if PENDING_SETTLEMENTS.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                return;
            }
            done.await;
        }
    };
    tokio::time::timeout(limit, wait).await.is_ok()
}

fn count_settlement<E>(settled: &Result<Settled, E>) {
    count_settlement_outcome(match settled {
        Ok(Settled::Now(_)) => Outcome::Settled,
        Ok(Settled::Queued) => Outcome::Queued,
        Err(_) => Outcome::Failed,
    });
}

/// How a settlement went (`rialto_ledger_settlements_total{outcome}`).
#[derive(Clone, Copy)]
enum Outcome {
    Settled,
    Queued,
    Failed,
}

fn count_settlement_outcome(outcome: Outcome) {
    static SETTLED: Resolved<Counter> = Resolved::new();
    static QUEUED: Resolved<Counter> = Resolved::new();
    static FAILED: Resolved<Counter> = Resolved::new();
    let (resolved, outcome) = match outcome {
        Outcome::Settled => (&SETTLED, "settled"),
        Outcome::Queued => (&QUEUED, "queued"),
        Outcome::Failed => (&FAILED, "failed"),
    };
    resolved
        .of(&metrics().ledger_settlements, || OutcomeLabels { outcome })
        .inc();
}

/// A request the limiter admitted and the ledger holds credit for.
pub(crate) struct Admitted {
    /// Settles the limiter's slot and the hold however the request ends.
    pub(crate) settlement: Settlement,
    /// A signed-in wallet's USD balance before the request, for
    /// `X-Balance-Remaining`.
    pub(crate) wallet_usd_before: Option<rust_decimal::Decimal>,
}

/// How much of the limiter and of the ledger a request asks for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reservation {
    /// The prompt's estimated tokens.
    pub(crate) prompt_tokens: u64,
    /// Prompt and completion together.
    pub(crate) total_tokens: u64,
    /// A stream's hold: written before the first token, so a crash after
    /// it still charges the stream.
    pub(crate) durable: bool,
    /// The most the request can cost besides its tokens (USD nano-units).
    pub(crate) extra_usd_nanos: u64,
    /// Tokens the rate windows count besides `total_tokens`, which the
    /// hold does not (their price is in the extras).
    pub(crate) limiter_extra_tokens: u64,
    /// Held with its settlement, in one call, once the answer is known (a
    /// route asked ahead: [`Settlement::charge`]), not now.
    pub(crate) charged_after: bool,
}

/// What a request is limited and priced as: a model, or an endpoint
/// whose price is all extra.
pub(crate) struct Priced<'a> {
    pub(crate) target: Target<'a>,
    pub(crate) model_id: &'a str,
    pub(crate) prices: rialto_billing::Prices,
    /// The model as the request found it in the catalog (None for an
    /// endpoint): what its privacy is checked against, whatever a reload
    /// does meanwhile.
    pub(crate) model: Option<&'a ModelEntry>,
}

impl<'a> Priced<'a> {
    pub(crate) fn model(model: &'a ModelEntry) -> Self {
        Self {
            target: Target::model(&model.config),
            model_id: &model.config.id,
            prices: model.prices.clone(),
            model: Some(model),
        }
    }
}

/// Admits a request to `model` through the limiter (its rate-limit headers
/// go on the response) and holds the most it can cost in the ledger, both
/// at once (in a split deployment each is a call to another process);
/// refuses it (429, 402) when either says no, and gives back what the
/// other one granted.
pub(crate) async fn admit(
    gateway: &Gateway,
    request: &HttpRequest,
    principal: &auth_pb::Principal,
    priced: Priced<'_>,
    request_id: &str,
    reservation: Reservation,
    limited: Option<Admission>,
) -> Result<Admitted, ApiError> {
    let Priced {
        target,
        model_id,
        prices,
        model,
    } = priced;
    // A model's counters are kept with it; an endpoint's are looked up.
    let counters = model.map_or_else(
        || Arc::new(ModelCounters::new(model_id)),
        |model| Arc::clone(&model.counters),
    );
    if let Some(model) = model {
        crate::keys::check_privacy(principal, &model.config)?;
        // GenAI's semantic conventions, on the request's span.
        let path = request.path();
        let operation = if path.ends_with("/embeddings") {
            "embeddings"
        } else if path.ends_with("/chat/completions") || path.ends_with("/responses") {
            "chat"
        } else {
            "generate_content"
        };
        let span = tracing::Span::current();
        tracing::record_all!(
            span,
            gen_ai.operation.name = operation,
            gen_ai.request.model = model.config.id.as_str(),
        );
    }
    let limiter = &gateway.services.limiter;
    let owner = crate::ledger_owner(principal);
    // A request with files showed its windows when it was admitted.
    let windows_shown = limited.is_none();
    // Sent with the hold, and with the settlement (a charge beyond the hold
    // stays within it).
    let key_limit = crate::key_limit(&principal.key_id, principal.key_limit.as_ref());
    let admitting = async {
        match limited {
            // Admitted before its file work; the commit counts the tokens
            // its files added.
            Some(admission) => Ok(admission),
            None => {
                limiter
                    .admit(
                        crate::caller(principal),
                        target,
                        request_id,
                        reservation
                            .total_tokens
                            .saturating_add(reservation.limiter_extra_tokens),
                    )
                    .await
            }
        }
    };
    let hold = billing_pb::HoldRequest {
        owner: owner.clone(),
        request_id: request_id.to_owned(),
        model_id: model_id.to_owned(),
        prompt_tokens: reservation.prompt_tokens,
        max_completion_tokens: reservation
            .total_tokens
            .saturating_sub(reservation.prompt_tokens),
        key_limit: key_limit.clone(),
        durable: reservation.durable,
        extra_usd_nanos: reservation.extra_usd_nanos,
    };
    // A route asked ahead is held with its settlement, in one call
    // ([`Settlement::charge`]); any other request is held now.
    let tokens = reservation
        .total_tokens
        .saturating_add(reservation.limiter_extra_tokens);
    let (mut holding, charge) = if reservation.charged_after {
        (None, Some((hold, tokens)))
    } else {
        let billing = gateway.services.billing.clone();
        // A client that leaves during the wait drops this handler: the
        // hold, answered or on its way, is then released
        // (`crate::holding`).
        let holding = Holding::start(
            Holder {
                billing: &gateway.services.billing,
                usage_queue: gateway.services.usage_queue.as_ref(),
                owner: &owner,
                request_id,
                model_id,
                key_id: &principal.key_id,
            },
            Box::pin(async move { billing.hold(hold).await }),
        );
        (Some(holding), None)
    };
    let held = async {
        if let Some(holding) = holding.as_mut() {
            holding.answered().await;
        }
    };
    let (admission, ()) = futures_util::future::join(admitting, held).await;
    // What the table of routes asked ahead learns from this answer: told
    // when this returns, roomy only if it returns admitted.
    let mut told = gateway.route_ahead.as_ref().map(|table| {
        let hold = holding.as_ref().map(Holding::answer);
        let roomy = crate::ahead::room_left(&admission, windows_shown, hold, tokens);
        let caller = table.caller(principal, model_id);
        let mut answer = crate::ahead::Answer::new(table, caller, tokens, roomy);
        if holding.is_none() {
            answer.charged_later();
        }
        (answer, table, caller)
    });
    // A hold the limiter's refusal makes useless is released at once, as
    // `holding` drops.
    let admission = admission?;
    if let Some(headers) = admission.headers {
        request.extensions_mut().insert(RateLimitHeaders(headers));
    }
    if let Some(refusal) = admission.refusal {
        return Err(refusal.into());
    }
    let hold = holding.map(Holding::finish);
    // From here on the limiter hears back however the request ends.
    let mut settlement = Settlement {
        limiter: limiter.clone(),
        ticket: Some(admission.ticket),
        billing: gateway.services.billing.clone(),
        usage_queue: gateway.services.usage_queue.clone(),
        owner,
        request_id: request_id.to_owned(),
        model_id: model_id.to_owned(),
        counters,
        held: false,
        held_usd: String::new(),
        held_diem: String::new(),
        // The usage analytics break spend down by the key that made it.
        key_id: crate::api_key_id(principal).to_owned(),
        key_period: String::new(),
        key_limit: None,
        prices,
        extra_usd_nanos: 0,
        extra_tokens: 0,
        span: tracing::Span::current(),
        ahead: told
            .as_ref()
            .map(|(_, table, caller)| (Arc::clone(table), *caller)),
        charge,
        out_ahead: None,
        balance_before: None,
    };
    let hold = match hold {
        Some(Ok(hold)) => hold,
        Some(Err(error)) => {
            settlement.refused();
            return Err(error.into());
        }
        // Held with its settlement: admitted as far as is known now.
        None => {
            if let Some((told, ..)) = &mut told {
                told.admitted();
            }
            return Ok(Admitted {
                settlement,
                wallet_usd_before: None,
            });
        }
    };
    count_hold(&hold);
    if let Some(before) = &hold.before {
        request.extensions_mut().insert(crate::BalanceHeaders {
            usd: before.usd.clone(),
            diem: before.diem.clone(),
        });
    }
    if !hold.placed && hold.key_limit_reached.is_empty() && !principal.wallet.is_empty() {
        settlement.refused();
        let usd = hold.before.as_ref().map_or("0", |b| b.usd.as_str());
        return Err(crate::wallet::insufficient(gateway, request, usd));
    }
    if !hold.placed {
        settlement.refused();
        let period = principal
            .key_limit
            .as_ref()
            .map_or("EPOCH", |l| l.period.as_str());
        return Err(refused_by_hold(&hold, period));
    }
    settlement.held = hold.reserved;
    settlement.held_usd = hold.held_usd;
    settlement.held_diem = hold.held_diem;
    if !hold.key_period.is_empty() {
        settlement.key_id.clone_from(&principal.key_id);
        settlement.key_period = hold.key_period;
        settlement.key_limit = key_limit;
    }
    if !principal.wallet.is_empty() {
        // A hold of nothing (a free model) is placed for any wallet: one
        // made a moment ago must still hold `wallet.min_balance_usd`.
        let usd = hold.before.as_ref().map_or("0", |b| b.usd.as_str());
        if below_wallet_minimum(gateway, usd) {
            settlement.release();
            return Err(crate::wallet::insufficient(gateway, request, usd));
        }
    }
    let wallet_usd_before = if principal.wallet.is_empty() {
        None
    } else {
        hold.before.as_ref().and_then(|b| b.usd.parse().ok())
    };
    if let Some((told, ..)) = &mut told {
        told.admitted();
    }
    Ok(Admitted {
        settlement,
        wallet_usd_before,
    })
}

/// Whether a wallet's USD balance is under `wallet.min_balance_usd`.
fn below_wallet_minimum(gateway: &Gateway, usd: &str) -> bool {
    !matches!(usd.parse::<rust_decimal::Decimal>(), Ok(balance) if balance >= gateway.wallet_min_balance)
}

/// Token counts of a finished exchange, and their JSON for the response.
#[cfg_attr(test, derive(Debug, PartialEq))]
pub(crate) struct Usage {
    prompt: u64,
    completion: u64,
    cached: u64,
    cache_write: u64,
    pub(super) json: UsageJson,
}

/// A response's `usage`: the upstream's own text when it already says
/// what ours would (it tells the tokens, and its `total_tokens` is their
/// sum), written as it came; otherwise a tree. Reading the usual usage to
/// a tree, setting its total and writing it back cost ~7,000 instructions
/// a chat (a `BTreeMap`, and a string for each name and number).
#[derive(Debug, serde::Serialize)]
#[serde(untagged)]
pub(crate) enum UsageJson {
    Told(Box<RawValue>),
    Tree(Value),
}

impl UsageJson {
    /// As a JSON tree, for the answers built as one.
    pub(crate) fn to_value(&self) -> Value {
        match self {
            Self::Told(raw) => serde_json::from_str(raw.get()).unwrap_or_default(),
            Self::Tree(tree) => tree.clone(),
        }
    }
}

/// The same JSON, whichever way it is held (member order aside).
#[cfg(test)]
impl PartialEq for UsageJson {
    fn eq(&self, other: &Self) -> bool {
        self.to_value() == other.to_value()
    }
}

impl Usage {
    /// Prompt tokens only (embeddings); `json` is the response's `usage`.
    pub(crate) fn prompt_only(prompt: u64) -> Self {
        Self {
            prompt,
            completion: 0,
            cached: 0,
            cache_write: 0,
            json: UsageJson::Tree(json!({"prompt_tokens": prompt, "total_tokens": prompt})),
        }
    }

    /// Completion tokens only, no `json` (a stream's checkpoint).
    pub(super) fn completion_only(completion: u64) -> Self {
        Self {
            prompt: 0,
            completion,
            cached: 0,
            cache_write: 0,
            json: UsageJson::Tree(Value::Null),
        }
    }

    pub(crate) fn json(&self) -> &UsageJson {
        &self.json
    }

    fn total(&self) -> u64 {
        self.prompt.saturating_add(self.completion)
    }

    pub(crate) fn none() -> Self {
        Self {
            prompt: 0,
            completion: 0,
            cached: 0,
            cache_write: 0,
            json: UsageJson::Tree(Value::Null),
        }
    }

    pub(crate) fn billed(&self) -> billing_pb::Usage {
        billing_pb::Usage {
            prompt_tokens: self.prompt,
            completion_tokens: self.completion,
            cached_prompt_tokens: self.cached,
            cache_write_tokens: self.cache_write,
            // The settlement adds the request's extras.
            extra_usd_nanos: 0,
        }
    }
}

/// Whether the upstream's `usage` tells the tokens (else they are
/// estimated from the text).
pub(super) fn usage_is_told(upstream: &Value) -> bool {
    upstream
        .get("prompt_tokens")
        .and_then(Value::as_u64)
        .is_some()
}

/// The upstream's usage (taken: ours writes it, with its total), or an
/// estimate (4 characters a token) when the upstream reported none.
pub(super) fn usage_or_estimate(
    upstream: Option<Value>,
    prompt_estimate: u64,
    completion_chars: usize,
) -> Usage {
    let count = |v: &Value, key: &str| v.get(key).and_then(Value::as_u64);
    if let Some(mut json) = upstream.filter(usage_is_told) {
        let prompt = count(&json, "prompt_tokens").unwrap_or_default();
        let completion = count(&json, "completion_tokens").unwrap_or_default();
        let details = json.get("prompt_tokens_details").unwrap_or(&Value::Null);
        let cached = count(details, "cached_tokens").unwrap_or_default();
        let cache_write = count(details, "cache_creation_input_tokens").unwrap_or_default();
        json["total_tokens"] = json!(prompt.saturating_add(completion));
        return Usage {
            prompt,
            completion,
            cached,
            cache_write,
            json: UsageJson::Tree(json),
        };
    }
    let completion = (completion_chars as u64).div_ceil(4);
    Usage {
        prompt: prompt_estimate,
        completion,
        cached: 0,
        cache_write: 0,
        json: UsageJson::Tree(json!({
            "prompt_tokens": prompt_estimate,
            "completion_tokens": completion,
            "total_tokens": prompt_estimate.saturating_add(completion),
        })),
    }
}

/// The counts an upstream's `usage` tells, read from its raw members as
/// [`usage_or_estimate`] reads them from a tree (a count is a member
/// whose number text is a `u64`, as `Value::as_u64` takes it under
/// `arbitrary_precision`; anything else is not told).
#[derive(Default)]
pub(super) struct Counts {
    prompt: Option<u64>,
    completion: Option<u64>,
    total: Option<u64>,
    cached: Option<u64>,
    cache_write: Option<u64>,
}

impl Counts {
    /// `None` for a `usage` the raw reading leaves to a tree: not an
    /// object of plainly named members (an escaped name is not borrowed),
    /// or one naming a member twice, at its top or in its
    /// `prompt_tokens_details` (a tree keeps the last), where a count is
    /// read. Deeper than that its text is written as it came, as every
    /// raw member of an answer is (escapes and a repeated name in, say,
    /// `completion_tokens_details` kept as the upstream wrote them).
    pub(super) fn read(usage: &RawValue) -> Option<Self> {
        let Members(members) = serde_json::from_str::<Members>(usage.get()).ok()?;
        if repeats_a_name(&members) {
            return None;
        }
        let count = |raw: &RawValue| raw.get().parse::<u64>().ok();
        let mut counts = Counts::default();
        for (name, raw) in &members {
            match *name {
                "prompt_tokens" => counts.prompt = count(raw),
                "completion_tokens" => counts.completion = count(raw),
                "total_tokens" => counts.total = count(raw),
                // Not an object: it tells nothing, as a tree's lookup.
                "prompt_tokens_details" if raw.get().starts_with('{') => {
                    let Members(details) = serde_json::from_str::<Members>(raw.get()).ok()?;
                    if repeats_a_name(&details) {
                        return None;
                    }
                    for (name, raw) in &details {
                        match *name {
                            "cached_tokens" => counts.cached = count(raw),
                            "cache_creation_input_tokens" => counts.cache_write = count(raw),
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        Some(counts)
    }

    /// Whether the usage tells the tokens (else they are estimated).
    pub(super) fn told(&self) -> bool {
        self.prompt.is_some()
    }
}

/// [`usage_or_estimate`] for a `usage` read raw (`counts` from
/// `upstream`): the same counts, and ours is the upstream's text when its
/// total is already the sum (what ours would set it to).
pub(super) fn usage_counted(
    upstream: &RawValue,
    counts: &Counts,
    prompt_estimate: u64,
    completion_chars: usize,
) -> Usage {
    let Some(prompt) = counts.prompt else {
        return usage_or_estimate(None, prompt_estimate, completion_chars);
    };
    let completion = counts.completion.unwrap_or_default();
    if counts.total != Some(prompt.saturating_add(completion)) {
        // Ours sets the total: through a tree (rare).
        let tree = serde_json::from_str(upstream.get()).ok();
        return usage_or_estimate(tree, prompt_estimate, completion_chars);
    }
    Usage {
        prompt,
        completion,
        cached: counts.cached.unwrap_or_default(),
        cache_write: counts.cache_write.unwrap_or_default(),
        json: UsageJson::Told(upstream.to_owned()),
    }
}

#[cfg(test)]
mod cost {
    use super::*;

    fn cost(usd: &str, diem: &str) -> Cost {
        Cost::of(&billing_pb::Cost {
            usd: usd.into(),
            diem: diem.into(),
        })
    }

    /// Billing's decimals are written as JSON numbers, digit for digit:
    /// no rounding through a float, however many digits.
    #[test]
    fn written_as_the_numbers_billing_gave() {
        let written = |c: &Cost| serde_json::to_string(c).unwrap();
        assert_eq!(
            written(&cost("0.000123", "0")),
            r#"{"diem":0,"usd":0.000123}"#
        );
        assert_eq!(
            written(&cost("12345678901234567890.000000001", "1.5")),
            r#"{"diem":1.5,"usd":12345678901234567890.000000001}"#
        );
        assert_eq!(written(&Cost::free()), r#"{"diem":0,"usd":0}"#);
        // The tree is the same text.
        let c = cost("0.1", "0.000000001");
        assert_eq!(c.to_value().to_string(), written(&c));
    }

    /// What is not a JSON number (billing never sends one) reads as 0,
    /// never as a string or a broken answer.
    #[test]
    fn what_is_not_a_number_is_zero() {
        for bad in ["", "abc", "1.", "1e", "0.1 ", "\"1\"", "1,5"] {
            assert_eq!(
                serde_json::to_string(&cost(bad, bad)).unwrap(),
                r#"{"diem":0,"usd":0}"#,
                "{bad:?}"
            );
        }
    }

    /// `X-Balance-Remaining`: the balance before less the USD charged.
    #[test]
    fn usd_left_after_the_charge() {
        let before: rust_decimal::Decimal = "10.5".parse().unwrap();
        assert_eq!(cost("0.000123", "0").usd_left(before), "10.499877");
        assert_eq!(cost("10.5", "0").usd_left(before), "0");
        assert_eq!(Cost::free().usd_left(before), "10.5");
        assert_eq!(Cost::usd_nanos(500_000_000).usd_left(before), "10");
        assert_eq!(
            serde_json::to_string(&Cost::usd_nanos(1)).unwrap(),
            r#"{"diem":0,"usd":0.000000001}"#
        );
    }
}

#[cfg(test)]
mod charging {
    use std::time::Duration;

    use rialto_core::bus::Bus;

    use super::*;

    const OWNER: &str = "account:charged";

    /// A channel to a service that cannot be reached (nothing listens on
    /// port 9), and the token its calls would carry.
    fn nowhere() -> (
        tonic::transport::Channel,
        rialto_core::grpc_auth::ClientToken,
    ) {
        let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:9").connect_lazy();
        (
            channel,
            rialto_core::grpc_auth::ClientToken::new(None).unwrap(),
        )
    }

    /// A billing that cannot be reached.
    fn unreachable() -> BillingClient {
        let (channel, token) = nowhere();
        BillingClient::new(rialto_billing::grpc::RemoteBilling::new(channel, token))
    }

    /// A charge of `tokens` each way ($0.000001 a token) on `model`.
    fn charge(request_id: &str, model: &str, tokens: u64) -> billing_pb::ChargeRequest {
        billing_pb::ChargeRequest {
            hold: Some(billing_pb::HoldRequest {
                owner: OWNER.into(),
                request_id: request_id.into(),
                model_id: model.into(),
                prompt_tokens: tokens,
                max_completion_tokens: tokens,
                ..Default::default()
            }),
            usage: Some(billing_pb::Usage {
                prompt_tokens: tokens,
                completion_tokens: tokens,
                ..Default::default()
            }),
            key_id: String::new(),
        }
    }

    /// The settlement `admit` makes for a route asked ahead whose hold is
    /// `hold`, for key `key_id`: nothing held yet, the hold asked with the
    /// charge. Its limiter is never called (no ticket).
    fn ahead_settlement(
        billing: &BillingClient,
        prices: &rialto_billing::Prices,
        hold: &billing_pb::HoldRequest,
        key_id: &str,
    ) -> Settlement {
        let config = rialto_core::Config::default();
        let (channel, token) = nowhere();
        let limiter = rialto_limiter::LimiterClient::new(rialto_limiter::grpc::RemoteLimiter::new(
            channel, token,
        ));
        Settlement {
            limiter: RateLimiter::new(&config, vec![("limiter".into(), limiter)], None),
            ticket: None,
            billing: billing.clone(),
            usage_queue: None,
            owner: hold.owner.clone(),
            request_id: hold.request_id.clone(),
            model_id: hold.model_id.clone(),
            counters: Arc::new(ModelCounters::new(&hold.model_id)),
            held: false,
            held_usd: String::new(),
            held_diem: String::new(),
            key_id: key_id.to_owned(),
            key_period: String::new(),
            key_limit: None,
            prices: prices.clone(),
            extra_usd_nanos: 0,
            extra_tokens: 0,
            span: tracing::Span::none(),
            ahead: None,
            charge: None,
            out_ahead: None,
            balance_before: None,
        }
    }

    /// Usage of `tokens` each way.
    fn used(tokens: u64) -> Usage {
        Usage {
            prompt: tokens,
            completion: tokens,
            cached: 0,
            cache_write: 0,
            json: UsageJson::Tree(Value::Null),
        }
    }

    /// [`charge_durably`] of `request`, with the settlement without a hold
    /// that the gateway's own [`Settlement`] makes of its usage
    /// (`Settlement::charge`).
    async fn charge_durably_of(
        billing: &BillingClient,
        queue: Option<&Bus>,
        prices: &rialto_billing::Prices,
        request: billing_pb::ChargeRequest,
    ) -> Result<Charged, ApiError> {
        let hold = request.hold.clone().unwrap_or_default();
        let tokens = hold.prompt_tokens;
        let settlement = ahead_settlement(billing, prices, &hold, &request.key_id);
        charge_durably(billing, queue, prices, request, || {
            settlement.unheld_request(&used(tokens), hold.key_limit.clone())
        })
        .await
    }

    /// The settlement of a charge whose call failed: the charge's owner,
    /// request, model and usage with its extras; no hold; and a capped
    /// key's caps with the period they count in now, as billing names it,
    /// so that what it charges counts against the key.
    #[tokio::test]
    async fn a_failed_charge_settles_unheld_in_the_keys_period_now() {
        let prices = crate::test_billing::prices();
        let hold = charge("r1", "m", 500).hold.unwrap();
        let mut settlement = ahead_settlement(&unreachable(), &prices, &hold, "k1");
        settlement.extra_usd_nanos = 7;
        let limit = |period: &str| billing_pb::KeyLimit {
            key_id: "k1".into(),
            usd_nanos: Some(1_000_000),
            diem_nanos: None,
            period: period.into(),
        };
        let before = rialto_core::db::now_ms();
        let unheld = settlement.unheld_request(&used(500), Some(limit("MONTH")));
        let after = rialto_core::db::now_ms();
        assert_eq!(
            (
                unheld.owner.as_str(),
                unheld.request_id.as_str(),
                unheld.model_id.as_str()
            ),
            (OWNER, "r1", "m")
        );
        let usage = unheld.usage.unwrap();
        assert_eq!(
            (
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.extra_usd_nanos
            ),
            (500, 500, 7)
        );
        assert_eq!(
            (unheld.held_usd.as_str(), unheld.held_diem.as_str()),
            ("", "")
        );
        assert_eq!(unheld.key_id, "k1");
        assert_eq!(unheld.key_limit, Some(limit("MONTH")));
        // The period as of the call (a month's turn between the two reads
        // allows either).
        let periods =
            [before, after].map(|now| rialto_billing::ledger::period_key("MONTH", now).unwrap());
        assert!(
            periods.contains(&unheld.key_period),
            "{}",
            unheld.key_period
        );
        let daily = settlement.unheld_request(&used(500), Some(limit("EPOCH")));
        assert!(
            daily.key_period.starts_with("EPOCH:"),
            "{}",
            daily.key_period
        );
        // An uncapped key: no caps, no period.
        let uncapped = settlement.unheld_request(&used(500), None);
        assert_eq!(
            (uncapped.key_limit, uncapped.key_period.as_str()),
            (None, "")
        );
    }

    async fn usd(billing: &BillingClient) -> String {
        billing
            .get_balance(billing_pb::GetBalanceRequest {
                owner: OWNER.into(),
            })
            .await
            .unwrap()
            .usd
    }

    /// Held and charged in one call; refused whole (nothing charged) when
    /// the balance is short; a model billing does not know refuses for
    /// good, and is not settled.
    #[tokio::test]
    async fn a_charge_is_held_and_settled_or_refused_whole() {
        let (_dir, billing, prices) = crate::test_billing::local_billing(OWNER).await;
        let charged = charge_durably_of(&billing, None, &prices, charge("a", "m", 500)).await;
        let Ok(Charged::Held(hold, cost)) = charged else {
            panic!("not held: {charged:?}");
        };
        assert!(hold.placed && hold.reserved);
        assert_eq!((cost.usd.as_str(), cost.diem.as_str()), ("0.001", "0"));
        let charged = charge_durably_of(&billing, None, &prices, charge("b", "m", 600_000)).await;
        assert!(matches!(charged, Ok(Charged::Refused(ref hold)) if !hold.placed));
        let unknown = charge_durably_of(&billing, None, &prices, charge("c", "nope", 5)).await;
        assert!(unknown.is_err(), "{unknown:?}");
        assert_eq!(usd(&billing).await, "0.999");
    }

    /// The charge of a lost reply (applied, then the call failed) and a
    /// charge billing never got, billing unreachable after: both answers
    /// are served on a usage record in the durable queue, and once billing
    /// reads the queue each was charged exactly once. With no queue, the
    /// failure is the request's (503).
    #[tokio::test]
    async fn a_failed_charge_is_settled_once_from_the_durable_queue() {
        let (_dir, billing, prices) = crate::test_billing::local_billing(OWNER).await;
        let down = unreachable();
        let bus = Bus::in_process("charging-test");
        // Applied, its reply lost.
        let lost = charge("lost", "m", 500);
        billing.charge(lost.clone()).await.unwrap();
        assert_eq!(usd(&billing).await, "0.999");
        for request in [lost, charge("never", "m", 500)] {
            let charged = charge_durably_of(&down, Some(&bus), &prices, request).await;
            let Ok(Charged::Unheld(cost)) = charged else {
                panic!("not queued: {charged:?}");
            };
            assert_eq!((cost.usd.as_str(), cost.diem.as_str()), ("0.001", "0"));
        }
        let failed = charge_durably_of(&down, None, &prices, charge("gone", "m", 500)).await;
        assert_eq!(failed.unwrap_err().code(), ErrorCode::Unavailable);

        rialto_billing::usage_queue::spawn_usage_consumer(billing.clone(), bus.clone());
        let mut balance = String::new();
        for _ in 0..500 {
            balance = usd(&billing).await;
            if balance == "0.998" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(balance, "0.998");
        // Both settled, once each: settling again charges nothing more.
        for id in ["lost", "never"] {
            let settle = billing_pb::SettleRequest {
                request_id: id.into(),
                model_id: "m".into(),
                owner: OWNER.into(),
                usage: charge(id, "m", 500).usage,
                ..Default::default()
            };
            let cost = billing.settle(settle).await.unwrap();
            assert_eq!(cost.usd, "0.001", "{id}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(usd(&billing).await, "0.998");
    }
}
