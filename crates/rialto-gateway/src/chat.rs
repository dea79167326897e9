//! `POST /api/v1/chat/completions`: validation, the service parameters, and
//! the relay of the router's answer as JSON or as SSE.
//!
//! Path of a request: authenticate -> validate -> limiter admits -> router
//! relays to a backend -> billing prices the usage -> the response carries
//! `cost`, the echoed `<brand>_parameters` and the model headers -> the
//! limiter commits the real tokens.

use std::convert::Infallible;
use std::sync::Arc;

use actix_web::http::header::ContentEncoding;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, HttpResponseBuilder, web};
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use rialto_billing::BillingClient;
use rialto_billing::usage_queue::{Settled, settle_durably};
use rialto_core::ErrorCode;
use rialto_core::metrics::metrics;
use rialto_limiter::{Admission, RateLimiter, Target, Ticket};
use rialto_proto::auth::v1 as auth_pb;
use rialto_proto::billing::v1 as billing_pb;
use rialto_proto::router::v1 as router_pb;
use rialto_proto::router::v1::chat_stream_event::Event;
use serde_json::{Map, Value, json};

use crate::augment;
use crate::headers::RequestId;
use crate::holding::{Holder, Holding};
use crate::{
    ApiError, Details, Gateway, ModelEntry, RateLimitHeaders, authenticate, header_value,
    parse_json, read_body,
};

/// Most choices one request may ask for.
const MAX_N: u64 = 16;
const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// What validation learned about a request.
struct Chat {
    model_id: String,
    stream: bool,
    /// The effective `<brand>_parameters`, echoed in the response.
    parameters: Map<String, Value>,
    /// What of them the router applies.
    service: router_pb::ServiceParameters,
    prompt_tokens_estimate: u64,
    estimated_tokens: u64,
    /// `enable_x_search` (not echoed: the spec's echo has no such member).
    x_search: bool,
    /// Choices asked for (`n`).
    choices: u64,
}

/// Per-request facts the response needs.
struct Exchange {
    request_id: String,
    completion_id: String,
    chat: Chat,
    settlement: Settlement,
    /// A signed-in wallet's USD balance before the request, for
    /// `X-Balance-Remaining`.
    wallet_usd_before: Option<rust_decimal::Decimal>,
    /// How often the stream checkpoints its usage.
    checkpoint_every: std::time::Duration,
    /// How long a stream waits for its client to take a chunk.
    reader_patience: std::time::Duration,
    /// What the request asks of the web, and what came of it.
    web: Option<augment::Plan>,
    found: augment::Outcome,
}

/// `X-Balance-Remaining`: a wallet's USD balance after the request.
pub(crate) const BALANCE_REMAINING: &str = "x-balance-remaining";

/// Puts `X-Balance-Remaining` on a signed-in wallet's response: its USD
/// balance before the request (`before`; None for an account) less the
/// `cost` charged.
pub(crate) fn balance_remaining(
    response: &mut HttpResponseBuilder,
    before: Option<rust_decimal::Decimal>,
    cost: &Value,
) {
    if let Some(before) = before {
        let charged: rust_decimal::Decimal = cost["usd"].to_string().parse().unwrap_or_default();
        response.insert_header((
            BALANCE_REMAINING,
            (before - charged).normalize().to_string(),
        ));
    }
}

/// `x-retry-count`: how many times the router sent the request again
/// before a backend answered; absent when the first attempt did.
const RETRY_COUNT: &str = "x-retry-count";

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
    /// A hold is open in the ledger until the request is billed.
    held: bool,
    /// What the hold reserved (exact decimals).
    held_usd: String,
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
    charge: Option<(billing_pb::HoldRequest, u64)>,
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
    fn checkpoint(&self, usage: &Usage) {
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
    pub(crate) async fn bill(&mut self, usage: &Usage) -> Result<Value, ApiError> {
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
                    return Ok(json!({"usd": 0, "diem": 0}));
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
            let model = rialto_core::metrics::ModelLabels {
                model: self.model_id.clone(),
            };
            metrics().spend_usd.get_or_create(&model).inc_by(usd);
        }
        // Exact decimal strings become JSON numbers written digit for digit
        // (serde_json's arbitrary_precision), as the spec's `cost` wants.
        let number = |text: &str| serde_json::from_str::<Value>(text).unwrap_or(json!(0));
        Ok(json!({"usd": number(&cost.usd), "diem": number(&cost.diem)}))
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
        self.span
            .record("gen_ai.response.model", self.model_id.as_str());
        self.span.record("gen_ai.usage.input_tokens", usage.prompt);
        self.span
            .record("gen_ai.usage.output_tokens", usage.completion);
        for (kind, tokens) in [("prompt", usage.prompt), ("completion", usage.completion)] {
            if tokens > 0 {
                let labels = rialto_core::metrics::TokenLabels {
                    model: self.model_id.clone(),
                    kind,
                };
                metrics().tokens.get_or_create(&labels).inc_by(tokens);
            }
        }
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
                        count_settlement_outcome("settled");
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
    let outcome = if hold.placed { "placed" } else { "refused" };
    metrics()
        .ledger_holds
        .get_or_create(&rialto_core::metrics::OutcomeLabels { outcome })
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
        Ok(Settled::Now(_)) => "settled",
        Ok(Settled::Queued) => "queued",
        Err(_) => "failed",
    });
}

fn count_settlement_outcome(outcome: &'static str) {
    metrics()
        .ledger_settlements
        .get_or_create(&rialto_core::metrics::OutcomeLabels { outcome })
        .inc();
}

pub async fn completions(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let body = match read_body(&gateway, &request, payload).await {
        Ok(body) => parse_json(&body),
        Err(error) => Err(error),
    };
    match body {
        Ok(body) => serve(&gateway, &request, &principal, body).await,
        Err(error) => Err(error),
    }
}

/// A chat request's whole path from its parsed body: validation,
/// admission, the hold, the backend, the settlement; the answer as JSON or
/// SSE. `/responses` comes here too, with the chat body it translated.
pub(crate) async fn serve(
    gateway: &web::Data<Gateway>,
    request: &HttpRequest,
    principal: &auth_pb::Principal,
    body: Value,
) -> Result<HttpResponse, ApiError> {
    let mut requested_model = None;
    // One catalog for the whole request, whatever a reload does meanwhile.
    let catalog = gateway.catalog();
    let result = complete_or_stream(
        gateway,
        &catalog,
        request,
        body,
        principal,
        &mut requested_model,
    )
    .await;
    // An authenticated request refused before the limiter saw it (invalid,
    // too large) still gets its window's headers, when its model is known.
    let refused_early = result.as_ref().is_err_and(|e| {
        matches!(
            e.code(),
            ErrorCode::InvalidRequest | ErrorCode::PayloadTooLarge
        )
    });
    if refused_early
        && request.extensions().get::<RateLimitHeaders>().is_none()
        && let Some(model) = requested_model.as_deref().and_then(|id| catalog.model(id))
    {
        let target = Target::model(&model.config);
        match gateway
            .services
            .limiter
            .peek(crate::caller(principal), target)
            .await
        {
            Ok(Some(headers)) => {
                request.extensions_mut().insert(RateLimitHeaders(headers));
            }
            Ok(None) => {}
            Err(error) => tracing::debug!(%error, "no rate headers for a refused request"),
        }
    }
    result
}

async fn complete_or_stream(
    gateway: &web::Data<Gateway>,
    catalog: &crate::Catalog,
    request: &HttpRequest,
    mut body: Value,
    principal: &auth_pb::Principal,
    requested_model: &mut Option<String>,
) -> Result<HttpResponse, ApiError> {
    if let Some(model) = body.get("model").and_then(Value::as_str) {
        *requested_model = Some(model.to_owned());
    }
    let mut chat = validate(gateway, catalog, &mut body)?;
    let model = catalog
        .model(&chat.model_id)
        .ok_or_else(|| ApiError::new(ErrorCode::ModelNotFound, "Specified model not found"))?;
    // A trait or alias names the model from here on.
    chat.model_id.clone_from(&model.config.id);
    let request_id = RequestId::of(request);
    // What the user wrote, before any file becomes text: what is searched
    // for, and where links to scrape are found.
    let asks_for_web = augment::asks_for_web(&chat.parameters, chat.x_search);
    let user_text = asks_for_web.then(|| augment::last_user_text(&body));
    let has_files = body["messages"]
        .as_array()
        .is_some_and(|messages| crate::files::any(messages));
    let limited = if has_files {
        let admission = files_admitted(gateway, request, principal, model, &request_id, &chat);
        let admission = admission.await?;
        if let Err(error) = convert_files(&mut body, &mut chat, gateway).await {
            // The downloads and conversions were done: the request counts.
            gateway.services.limiter.commit(admission.ticket, 0);
            return Err(error);
        }
        Some(admission)
    } else {
        None
    };
    if let Some(tokenizer) = &model.tokenizer {
        let more = tokenizer_excess(tokenizer.clone(), &body).await;
        chat.prompt_tokens_estimate = chat.prompt_tokens_estimate.saturating_add(more);
        chat.estimated_tokens = chat.estimated_tokens.saturating_add(more);
    }
    // Validation refused anything but an object.
    let Value::Object(mut body) = body else {
        return Err(rialto_core::Error::internal("a validated chat body is not an object").into());
    };
    let web = match user_text {
        Some(user_text) => augment::plan(
            gateway,
            model,
            &mut chat.parameters,
            chat.x_search,
            &mut body,
            chat.prompt_tokens_estimate,
            user_text,
        ),
        None => Ok(None),
    };
    let web = match web {
        Ok(web) => web,
        Err(error) => {
            if let Some(admission) = limited {
                gateway.services.limiter.commit(admission.ticket, 0);
            }
            return Err(error);
        }
    };
    // The sources the plan may add are prompt too: held now, and replaced
    // by what was really added once they are found.
    let (most_prompt_tokens, query_tokens) = web.as_ref().map_or((0, 0), |plan| {
        (plan.most_prompt_tokens, plan.most_query_tokens)
    });
    chat.prompt_tokens_estimate = chat
        .prompt_tokens_estimate
        .saturating_add(most_prompt_tokens);
    chat.estimated_tokens = chat.estimated_tokens.saturating_add(most_prompt_tokens);

    // Handed over parsed: a router in this process reads no bytes again.
    let router_request = rialto_router::Chat {
        request_id: request_id.clone(),
        model_id: chat.model_id.clone(),
        body,
        parameters: std::mem::take(&mut chat.service),
    };
    // A plain answer for a caller with room to spare: its route is asked
    // now, beside the admission and the hold (`crate::ahead`). Not before
    // the key may send its prompt to this model at all.
    let ahead = match &gateway.route_ahead {
        Some(table) if !chat.stream && web.is_none() && limited.is_none() => {
            crate::keys::check_privacy(principal, &model.config)?;
            let caller = table.caller(principal, &chat.model_id);
            let tokens = chat.estimated_tokens.saturating_add(query_tokens);
            table.take(caller, tokens).then_some((table, caller))
        }
        _ => None,
    };
    // An account's route asked ahead is held with its settlement, in one
    // call to billing once the answer is known: a wallet's hold also
    // answers for its minimum balance and `X-Balance-Remaining`.
    let charged_after = ahead.is_some() && principal.wallet.is_empty();
    let route = match ahead {
        Some((table, caller)) => Route::Ahead(crate::ahead::Asked::ask(
            table,
            caller,
            &gateway.services.router,
            router_request,
        )),
        None => Route::Later(router_request),
    };
    let Admitted {
        settlement,
        wallet_usd_before,
    } = admit(
        gateway,
        request,
        principal,
        Priced::model(model),
        &request_id,
        Reservation {
            prompt_tokens: chat.prompt_tokens_estimate,
            total_tokens: chat.estimated_tokens,
            durable: chat.stream,
            extra_usd_nanos: web.as_ref().map_or(0, |plan| plan.most_extra_usd_nanos),
            // The model's query call counts in the windows; its price is in
            // the extras.
            limiter_extra_tokens: query_tokens,
            charged_after,
        },
        limited,
    )
    .await?;

    let exchange = Exchange {
        completion_id: format!("chatcmpl-{request_id}"),
        request_id,
        chat,
        settlement,
        wallet_usd_before,
        checkpoint_every: gateway.checkpoint_every,
        reader_patience: gateway.reader_patience,
        web,
        found: augment::Outcome::default(),
    };
    match route {
        Route::Later(router_request) if exchange.chat.stream => {
            stream(gateway, model, router_request, exchange).await
        }
        route => complete(gateway, request, model, route, exchange).await,
    }
}

/// A plain answer's call to the router: made once the caller is admitted
/// and held, or already made beside those ([`crate::ahead`]).
enum Route {
    Later(rialto_router::Chat),
    Ahead(crate::ahead::Asked),
}

/// A request with file parts is admitted by the limiter before its files
/// are downloaded and converted (the costly part, and before the hold: its
/// text is not known yet), so that file work counts in the caller's window
/// even when the files turn out unreadable.
async fn files_admitted(
    gateway: &Gateway,
    request: &HttpRequest,
    principal: &auth_pb::Principal,
    model: &ModelEntry,
    request_id: &str,
    chat: &Chat,
) -> Result<Admission, ApiError> {
    let mut admission = gateway
        .services
        .limiter
        .admit(
            crate::caller(principal),
            Target::model(&model.config),
            request_id,
            chat.estimated_tokens,
        )
        .await?;
    if let Some(headers) = admission.headers.take() {
        request.extensions_mut().insert(RateLimitHeaders(headers));
    }
    if let Some(refusal) = admission.refusal {
        return Err(refusal.into());
    }
    Ok(admission)
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
            prices: rialto_billing::Prices::from_model(&model.config),
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
        span.record("gen_ai.operation.name", operation);
        span.record("gen_ai.request.model", model.config.id.as_str());
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

/// The in-band error a stream ends with when its backend fails after the
/// headers went out, as the hosted API sends it: an overloaded model is a
/// `server_error` `model_overloaded` with `retry_after`, anything else an
/// `api_error` `upstream_error`.
fn in_band_error(error: &rialto_core::Error) -> Value {
    if error.code == ErrorCode::RateLimited {
        return json!({"error": {
            "message": error.message,
            "type": "server_error",
            "code": "model_overloaded",
            "param": null,
            "retry_after": 30,
        }});
    }
    json!({"error": {
        "message": format!("{}: {}", crate::error::INFERENCE_FAILED, error.message),
        "type": "api_error",
        "code": "upstream_error",
        "param": null,
    }})
}

/// Whether a wallet's USD balance is under `wallet.min_balance_usd`.
fn below_wallet_minimum(gateway: &Gateway, usd: &str) -> bool {
    !matches!(usd.parse::<rust_decimal::Decimal>(), Ok(balance) if balance >= gateway.wallet_min_balance)
}

pub(crate) fn invalid_answer() -> ApiError {
    ApiError::new(
        ErrorCode::UpstreamFailed,
        "The model's backend sent an invalid answer",
    )
}

/// A non-streamed answer, billed: what the response is built from.
struct Answered {
    body: Value,
    backend: String,
    retry_count: u32,
    /// `X-Balance-Remaining` of a signed-in wallet.
    balance_remaining: Option<String>,
    /// Why the web search was left out, if it was.
    search_error: Option<String>,
}

async fn complete(
    gateway: &web::Data<Gateway>,
    request: &HttpRequest,
    model: &Arc<ModelEntry>,
    route: Route,
    exchange: Exchange,
) -> Result<HttpResponse, ApiError> {
    // The backend's work and its settlement run as a task of their own: a
    // client that leaves meanwhile drops this handler but not the task, so
    // what the backend did is still charged (a dropped settlement would
    // leave the hold to expire free).
    let task = tokio::spawn({
        let gateway = gateway.clone();
        let model = Arc::clone(model);
        // In the request's span: the router's call continues its trace.
        tracing::Instrument::instrument(
            async move {
                // The balance before the request, when its charge told it
                // (a route asked ahead, which no hold answered before): on
                // the response whether it was served or refused.
                let mut balance = None;
                let answered = answer(&gateway, &model, route, exchange, &mut balance).await;
                (answered, balance)
            },
            tracing::Span::current(),
        )
    });
    let (answered, balance) = task
        .await
        .map_err(|e| rialto_core::Error::internal(format!("the answer's task failed: {e}")))?;
    if let Some(before) = balance {
        request.extensions_mut().insert(crate::BalanceHeaders {
            usd: before.usd,
            diem: before.diem,
        });
    }
    let answered = answered?;
    let mut response = HttpResponse::Ok();
    model_headers(
        &mut response,
        gateway,
        model,
        &answered.backend,
        answered.retry_count,
    );
    if let Some(remaining) = answered.balance_remaining {
        response.insert_header((BALANCE_REMAINING, remaining));
    }
    search_error_header(&mut response, gateway, answered.search_error.as_deref());
    Ok(response.json(answered.body))
}

/// Asks the router for the whole answer, bills it, and shapes the body.
/// `balance` gets the balance before the request when the charge told it.
async fn answer(
    gateway: &Gateway,
    model: &ModelEntry,
    route: Route,
    exchange: Exchange,
    balance: &mut Option<billing_pb::Balance>,
) -> Result<Answered, ApiError> {
    let mut exchange = exchange;
    let model_id = model.config.id.as_str();
    let answered = match route {
        Route::Later(mut router_request) => {
            search_the_web(gateway, model, &mut router_request, &mut exchange).await;
            gateway.services.router.chat(router_request).await
        }
        Route::Ahead(asked) => {
            let (answered, out) = asked.answer().await;
            // Not held yet: counted out ahead until it is charged.
            if exchange.settlement.charge.is_some() {
                exchange.settlement.out_ahead = Some(out);
            }
            answered
        }
    };
    let answer = match answered {
        Ok(answer) => answer,
        Err(error) => {
            exchange.failed(&error);
            return Err(error.into());
        }
    };
    let mut body: Value =
        serde_json::from_slice(&answer.body_json).map_err(|_| invalid_answer())?;
    let Some(object) = body.as_object_mut() else {
        return Err(invalid_answer());
    };
    object.insert("id".into(), json!(exchange.completion_id));
    object.insert("object".into(), json!("chat.completion"));
    object.insert("model".into(), json!(model_id));
    object.entry("created").or_insert_with(|| json!(now()));
    object.remove("system_fingerprint");
    if let Some(Value::Array(choices)) = object.get_mut("choices") {
        for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
            choice.entry("logprobs").or_insert(Value::Null);
            choice.entry("finish_reason").or_insert(Value::Null);
        }
    }
    let completion_text = completion_chars(object.get("choices"));
    let usage = usage_or_estimate(
        object.get("usage"),
        exchange.chat.prompt_tokens_estimate,
        completion_text,
    );
    let billed = exchange.settlement.bill(&usage).await;
    *balance = exchange.settlement.balance_before.take();
    let cost = billed?;
    object.insert("usage".into(), usage.json);
    object.insert("cost".into(), cost);
    object.entry("prompt_logprobs").or_insert(Value::Null);
    if let Some(plan) = &exchange.web {
        augment::echo(&mut exchange.chat.parameters, plan, &exchange.found);
        if let Some(call) = augment::documents_call(plan, &exchange.found) {
            augment::add_documents(object, &call);
        }
    }
    object.insert(
        gateway.brand.parameters_field.clone(),
        Value::Object(exchange.chat.parameters),
    );
    let balance_remaining = exchange.wallet_usd_before.map(|before| {
        let charged: rust_decimal::Decimal =
            body["cost"]["usd"].to_string().parse().unwrap_or_default();
        (before - charged).normalize().to_string()
    });
    Ok(Answered {
        body,
        backend: answer.backend,
        retry_count: answer.retry_count,
        balance_remaining,
        search_error: exchange.found.error,
    })
}

/// Carries out what the request asks of the web (after its hold), its
/// extras charged with whatever the request settles.
async fn search_the_web(
    gateway: &Gateway,
    model: &ModelEntry,
    router_request: &mut rialto_router::Chat,
    exchange: &mut Exchange,
) {
    let Some(plan) = &exchange.web else {
        return;
    };
    let found = augment::run(gateway, model, plan, router_request).await;
    exchange.found(found);
}

impl Exchange {
    /// Records what the web search found: its extras ride on every
    /// settlement, and the prompt estimate counts the sources really added.
    fn found(&mut self, found: augment::Outcome) {
        self.settlement.extra_usd_nanos = found.extra_usd_nanos;
        self.settlement.extra_tokens = found.extra_tokens;
        // The hold counted the most the sources could add: count what
        // they did.
        let most = self.web.as_ref().map_or(0, |plan| plan.most_prompt_tokens);
        self.chat.prompt_tokens_estimate = self
            .chat
            .prompt_tokens_estimate
            .saturating_sub(most)
            .saturating_add((found.prompt_chars as u64).div_ceil(4));
        self.found = found;
    }

    /// The backend refused or failed: nothing is charged but what the
    /// search and pages cost when the backend said the request itself was
    /// wrong (searching for requests that could never be answered would
    /// otherwise be free).
    fn failed(&mut self, error: &rialto_core::Error) {
        if error.code == ErrorCode::InvalidRequest && self.settlement.extra_usd_nanos > 0 {
            self.settlement.bill_later(&Usage::none());
        } else {
            self.settlement.release();
        }
    }
}

/// `x-<brand>-web-search-error`: why the answer came without its search.
fn search_error_header(response: &mut HttpResponseBuilder, gateway: &Gateway, why: Option<&str>) {
    let Some(why) = why else {
        return;
    };
    // A header value is visible ASCII: the reason, kept to what fits.
    let text: String = why
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .take(200)
        .collect();
    if let Some(value) = header_value(&text) {
        response.insert_header((gateway.brand.header_web_search_error.clone(), value));
    }
}

async fn stream(
    gateway: &web::Data<Gateway>,
    model: &ModelEntry,
    router_request: rialto_router::Chat,
    exchange: Exchange,
) -> Result<HttpResponse, ApiError> {
    let mut exchange = exchange;
    let mut router_request = router_request;
    // The stream's hold lives on a lease that checkpoints renew: while the
    // web is searched and the backend thinks before its first byte too (a
    // long prompt can take longer than the lease), or the hold would
    // expire and the stream run free.
    let mut checkpoints = checkpoint_clock(exchange.checkpoint_every);
    if let Some(plan) = exchange.web.clone() {
        let searching = augment::run(gateway, model, &plan, &mut router_request);
        tokio::pin!(searching);
        let found = loop {
            tokio::select! {
                found = &mut searching => break found,
                _ = checkpoints.tick() => exchange.settlement.checkpoint(&Usage::completion_only(0)),
            }
        };
        exchange.found(found);
    }
    let opening = gateway.services.router.chat_stream(router_request);
    tokio::pin!(opening);
    let opened = loop {
        tokio::select! {
            opened = &mut opening => break opened,
            _ = checkpoints.tick() => exchange.settlement.checkpoint(&Usage::completion_only(0)),
        }
    };
    let mut events = match opened {
        Ok(events) => events,
        Err(error) => {
            exchange.failed(&error);
            return Err(error.into());
        }
    };
    // The first event names the backend; a failure before it is still an
    // ordinary HTTP error.
    let (backend, retries) = match events.next().await {
        Some(Ok(router_pb::ChatStreamEvent {
            event: Some(Event::Backend(name)),
            retry_count,
        })) => (name, retry_count),
        Some(Err(error)) => {
            exchange.failed(&error);
            return Err(error.into());
        }
        // A router that names no backend: keep whatever came first.
        Some(Ok(first)) => {
            events = Box::pin(futures_util::stream::iter([Ok(first)]).chain(events));
            (String::new(), 0)
        }
        None => (String::new(), 0),
    };
    // A stream's headers leave before its cost is known: what remains
    // after its hold (the most it can cost).
    let remaining = exchange.wallet_usd_before.map(|before| {
        let held: rust_decimal::Decimal = exchange.settlement.held_usd.parse().unwrap_or_default();
        (before - held).normalize().to_string()
    });
    let exchange_error = exchange.found.error.clone();
    let parameters_field = gateway.brand.parameters_field.clone();
    let mut relay = Relay::new(exchange, parameters_field);
    // The head leaves with the first chunk, in one write: answered at once,
    // it would go out alone and the first chunk a write (and two turns of
    // a busy worker's queue) later. Anything but an ordinary chunk (the
    // end, a failure, a chunk with nothing for the client) is left to the
    // body, and a backend slow to its first chunk gets its head after
    // `FIRST_CHUNK_WAIT`.
    let mut first = relay.documents_chunk();
    let mut ending = None;
    let deadline = tokio::time::Instant::now() + FIRST_CHUNK_WAIT;
    while first.is_none() && ending.is_none() {
        let Ok(event) = tokio::time::timeout_at(deadline, events.next()).await else {
            break;
        };
        match relay.read(event) {
            Read::Line(line) => first = Some(line),
            Read::Skip => {}
            Read::Ends(end) => ending = Some(end),
        }
    }
    let body = RelayBody::start(relay, events, checkpoints, first, ending);
    let mut response = HttpResponse::Ok();
    response
        .content_type("text/event-stream")
        // Streams are never compressed (the spec applies Accept-Encoding to
        // non-streamed responses only), and must not be buffered by proxies.
        .insert_header(ContentEncoding::Identity)
        .insert_header(("cache-control", "no-cache"))
        .insert_header(("x-accel-buffering", "no"));
    model_headers(&mut response, gateway, model, &backend, retries);
    if let Some(remaining) = remaining {
        response.insert_header((BALANCE_REMAINING, remaining));
    }
    search_error_header(&mut response, gateway, exchange_error.as_deref());
    Ok(response.streaming(body))
}

const DONE: &[u8] = b"data: [DONE]\n\n";

/// How long a stream's head waits for its first chunk to leave with it.
const FIRST_CHUNK_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// One event of the router's stream: `None` once it ended.
type StreamEvent = Option<rialto_core::Result<router_pb::ChatStreamEvent>>;

/// What [`Relay::read`] made of an event.
enum Read {
    /// A chunk for the client, counted.
    Line(Bytes),
    /// Nothing for the client (a usage-only chunk, an event that is not a
    /// chunk).
    Skip,
    /// The stream ends here.
    Ends(Ending),
}

/// How a stream ends.
enum Ending {
    /// It failed: this line for the client, then `[DONE]`.
    Failed(Bytes),
    /// The upstream's stream ended.
    End,
}

/// A stream's relay: what the upstream has sent so far, and the exchange
/// it is billed by. The first chunk is read by the handler (so it leaves
/// with the head), the rest by [`RelayBody`] as the client takes them.
struct Relay {
    exchange: Exchange,
    parameters_field: String,
    head: ChunkHead,
    /// The upstream's own `usage`, when it sent one.
    upstream_usage: Option<Value>,
    /// Characters of text sent so far.
    completion_text: usize,
    /// Chunks with text sent so far.
    content_chunks: u64,
    /// Search results as documents: a tool call before the content, and
    /// the choices finish with `tool_calls`.
    documents: Option<Value>,
    /// Billed: its end reached, or ended early.
    ended: bool,
}

/// A relay dropped before it ended was left by its client: in the handler,
/// while it waited for the first chunk (actix drops a handler whose
/// client is gone), or with the response body (or the runtime stopped
/// under it). What the upstream sent so far is billed, off the response
/// path.
impl Drop for Relay {
    fn drop(&mut self) {
        if !self.ended {
            tracing::info!(
                request_id = self.exchange.request_id,
                "client left the stream"
            );
            self.bill_later();
        }
    }
}

impl Relay {
    fn new(exchange: Exchange, parameters_field: String) -> Self {
        let head = ChunkHead::new(&exchange.completion_id, &exchange.chat.model_id);
        let documents = exchange
            .web
            .as_ref()
            .and_then(|plan| augment::documents_call(plan, &exchange.found));
        Self {
            exchange,
            parameters_field,
            head,
            upstream_usage: None,
            completion_text: 0,
            content_chunks: 0,
            documents,
            ended: false,
        }
    }

    /// The chunk that comes before the upstream's, when search results
    /// are documents: their tool call.
    fn documents_chunk(&mut self) -> Option<Bytes> {
        let call = self.documents.as_ref()?;
        let mut delta_call = call.clone();
        delta_call["index"] = json!(0);
        let choices: Vec<Value> = (0..self.exchange.chat.choices)
            .map(|index| {
                json!({"index": index, "delta": {"role": "assistant", "content": null,
                    "tool_calls": [delta_call]}, "logprobs": null, "finish_reason": null})
            })
            .collect();
        let first = json!({
            "id": self.exchange.completion_id,
            "object": "chat.completion.chunk",
            "created": self.head.created(|| None).clone(),
            "model": self.exchange.chat.model_id,
            "choices": choices,
        });
        Some(sse(&first))
    }

    /// Reads one event of the router's stream, counting the text it
    /// sends.
    fn read(&mut self, event: StreamEvent) -> Read {
        let json = match event {
            None => return Read::Ends(Ending::End),
            Some(Ok(router_pb::ChatStreamEvent {
                event: Some(Event::ChunkJson(json)),
                ..
            })) => json,
            Some(Ok(_)) => return Read::Skip,
            Some(Err(error)) => {
                tracing::warn!(request_id = self.exchange.request_id, %error, "stream failed upstream");
                return Read::Ends(Ending::Failed(sse(&in_band_error(&error))));
            }
        };
        let documents = self.documents.is_some();
        let read = if documents {
            None
        } else {
            read_chunk(&json, &mut self.head, &mut self.upstream_usage)
        };
        let read = read.unwrap_or_else(|| {
            read_chunk_tree(&json, &mut self.head, &mut self.upstream_usage, documents)
        });
        match read {
            Chunk::Forward { line, chars } => {
                self.completion_text += chars;
                self.content_chunks += u64::from(chars > 0);
                Read::Line(line)
            }
            // A usage-only chunk: folded into our final chunk.
            Chunk::Skip => Read::Skip,
            // The upstream reported a failure in-band: passed on as it is.
            Chunk::Error(line) => Read::Ends(Ending::Failed(line)),
        }
    }

    /// Ends the stream before its end (it failed, or its reader was too
    /// slow): what it used so far is billed, off the response path.
    fn bill_later(&mut self) {
        self.ended = true;
        let used = self.used();
        self.exchange.settlement.bill_later(&used);
    }

    /// What the stream used so far: the upstream's count, or an estimate.
    fn used(&self) -> Usage {
        usage_or_estimate(
            self.upstream_usage.as_ref(),
            self.exchange.chat.prompt_tokens_estimate,
            self.completion_text,
        )
    }

    /// Records the least the stream has used so far: a token per chunk of
    /// text and no prompt (estimates could overshoot the upstream's own
    /// count), so a crash never charges more than the stream would have
    /// cost. Each checkpoint renews the hold's lease.
    fn checkpoint(&self) {
        self.exchange
            .settlement
            .checkpoint(&Usage::completion_only(self.content_chunks));
    }

    /// The stream's end: billed, then the lines that end it: the final
    /// chunk with `usage` and `cost`, the citations when asked for, and
    /// `[DONE]`.
    async fn finish(mut self) -> Vec<Bytes> {
        self.ended = true;
        let usage = self.used();
        let exchange = &mut self.exchange;
        let created = self.head.created(|| None).clone();
        let last = match exchange.settlement.bill(&usage).await {
            Ok(cost) => json!({
                "id": exchange.completion_id,
                "object": "chat.completion.chunk",
                "created": created.clone(),
                "model": exchange.chat.model_id,
                "choices": [],
                "usage": usage.json,
                "cost": cost,
            }),
            Err(error) => json!({"error": {
                "message": error.message(),
                "type": "server_error",
                "code": "billing_error",
                "param": null,
            }}),
        };
        let mut lines = vec![sse(&last)];
        // The citations, when asked for in the stream: last before `[DONE]`.
        if let Some(plan) = exchange.web.as_ref().filter(|plan| plan.in_stream) {
            let mut parameters = std::mem::take(&mut exchange.chat.parameters);
            augment::echo(&mut parameters, plan, &exchange.found);
            if parameters.contains_key("web_search_citations") {
                let citations = json!({
                    "id": exchange.completion_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": exchange.chat.model_id,
                    "choices": [],
                    &self.parameters_field: parameters,
                });
                lines.push(sse(&citations));
            }
        }
        lines.push(Bytes::from_static(DONE));
        lines
    }
}

/// The rest of a stream, as its response body. Actix's dispatcher polls it
/// when the client's connection has room, and it reads the upstream then:
/// a chunk takes one turn of the worker from the upstream's connection to
/// the client's (a relay task between them took a turn of its own, and a
/// channel). A slow client slows the reading of the upstream, as a proxy
/// would. What must happen whether the client reads or not (checkpoints,
/// and the end of a reader too slow to take its chunks) is done by the
/// stream's [`watch`] task on the checkpoint clock, which shares the relay.
struct RelayBody {
    relaying: Arc<std::sync::Mutex<Relaying>>,
    /// Lines to leave before the upstream is read again: the first chunk,
    /// or the lines that end the stream.
    queued: std::vec::IntoIter<Bytes>,
    /// The stream's end being billed by a task of its own (so a client
    /// that leaves meanwhile does not cut the settlement short), with the
    /// lines it ends with.
    finishing: Option<tokio::task::JoinHandle<Vec<Bytes>>>,
    /// The stream's watch: ended with the body, so a stream that ended
    /// leaves neither a task nor a timer behind it.
    watch: tokio::task::AbortHandle,
}

/// A body dropped (the stream ended, or its client left) ends its watch;
/// the relay, if still there, is billed as it drops.
impl Drop for RelayBody {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

/// What the body and its watch share.
struct Relaying {
    /// `None` once the stream is billed or its end is being billed.
    relay: Option<Relay>,
    events: rialto_router::ChatStream,
    /// When the body last handed the client a chunk, while the client has
    /// not come back for the next.
    handed: Option<std::time::Instant>,
}

impl RelayBody {
    /// The body after the handler's first read: `first`, the chunk to leave
    /// with the head, and `ending`, the end or the failure met before any
    /// chunk. Starts the stream's watch on `checkpoints`.
    fn start(
        relay: Relay,
        events: rialto_router::ChatStream,
        checkpoints: tokio::time::Interval,
        first: Option<Bytes>,
        ending: Option<Ending>,
    ) -> Self {
        let relaying = Arc::new(std::sync::Mutex::new(Relaying {
            relay: Some(relay),
            events,
            handed: None,
        }));
        let watch = tokio::spawn(watch(Arc::downgrade(&relaying), checkpoints)).abort_handle();
        let mut queued: Vec<Bytes> = first.into_iter().collect();
        let mut finishing = None;
        if let Some(ending) = ending {
            queued.extend(body_end(&mut lock(&relaying), ending, &mut finishing));
        }
        Self {
            relaying,
            queued: queued.into_iter(),
            finishing,
            watch,
        }
    }
}

/// What the stream's end leaves for the client: a failure's line and
/// `[DONE]` (what was sent is billed), or nothing yet while the end is
/// billed by a task of its own (`finishing`). Either way the relay leaves
/// `relaying`.
fn body_end(
    relaying: &mut Relaying,
    ending: Ending,
    finishing: &mut Option<tokio::task::JoinHandle<Vec<Bytes>>>,
) -> Vec<Bytes> {
    let Some(mut relay) = relaying.relay.take() else {
        return Vec::new();
    };
    match ending {
        Ending::Failed(line) => {
            relay.bill_later();
            vec![line, Bytes::from_static(DONE)]
        }
        Ending::End => {
            *finishing = Some(tokio::spawn(relay.finish()));
            Vec::new()
        }
    }
}

impl futures_util::Stream for RelayBody {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = self.get_mut();
        loop {
            if let Some(line) = this.queued.next() {
                return Poll::Ready(Some(Ok(line)));
            }
            if let Some(finishing) = this.finishing.as_mut() {
                // A billing task that panicked leaves the stream without
                // its last lines; it is not billed twice.
                let lines = std::task::ready!(finishing.poll_unpin(cx)).unwrap_or_default();
                this.finishing = None;
                this.queued = lines.into_iter();
                continue;
            }
            let mut relaying = lock(&this.relaying);
            relaying.handed = None;
            let Relaying { relay, events, .. } = &mut *relaying;
            // Billed already: ended by its watch, or its end met.
            let Some(relay) = relay.as_mut() else {
                return Poll::Ready(None);
            };
            let event = std::task::ready!(events.poll_next_unpin(cx));
            match relay.read(event) {
                Read::Line(line) => {
                    relaying.handed = Some(std::time::Instant::now());
                    return Poll::Ready(Some(Ok(line)));
                }
                Read::Skip => {}
                Read::Ends(end) => {
                    this.queued = body_end(&mut relaying, end, &mut this.finishing).into_iter()
                }
            }
        }
    }
}

/// A stream's watch, one task on its checkpoint clock for as long as its
/// body lives (the body's drop aborts it): the hold lives on a lease that
/// each checkpoint renews, so it checkpoints whether chunks come or not (a
/// backend silent for longer than the lease must not let the hold expire
/// and the stream go free); and a client that has not come back for
/// `reader_patience` after its last chunk is ended and charged what it was
/// sent (the upstream is let go at once, not when the client's connection
/// closes).
async fn watch(
    relaying: std::sync::Weak<std::sync::Mutex<Relaying>>,
    mut checkpoints: tokio::time::Interval,
) {
    loop {
        checkpoints.tick().await;
        // Gone with its body: billed as it dropped.
        let Some(relaying) = relaying.upgrade() else {
            return;
        };
        let mut relaying = lock(&relaying);
        let handed = relaying.handed;
        let Some(relay) = relaying.relay.as_mut() else {
            return;
        };
        let patience = relay.exchange.reader_patience;
        if handed.is_some_and(|handed| handed.elapsed() >= patience) {
            tracing::warn!(
                request_id = relay.exchange.request_id,
                patience_secs = patience.as_secs(),
                "the client stopped reading the stream: ended"
            );
            relay.bill_later();
            relaying.relay = None;
            relaying.events = Box::pin(futures_util::stream::empty());
            return;
        }
        relay.checkpoint();
    }
}

/// The lock of a stream's relay, shared by its body and its watch: neither
/// panics while holding it, and a relay left by one that did is still the
/// relay (its billing is what matters).
fn lock(relaying: &std::sync::Mutex<Relaying>) -> std::sync::MutexGuard<'_, Relaying> {
    relaying
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the relay does with one upstream chunk.
enum Chunk {
    /// Passed on as ours; `chars` of text in its deltas.
    Forward { line: Bytes, chars: usize },
    /// Nothing for the client (a usage-only chunk, or not an object).
    Skip,
    /// An in-band failure, passed on as it is; the stream ends.
    Error(Bytes),
}

/// What every chunk of a stream is rewritten with: our id, object and
/// model, and one `created` (the first chunk's own, or now).
struct ChunkHead {
    id: String,
    model: String,
    created: Option<Value>,
    /// `data: {"id":…,"object":…,"model":…,"created":…`, once `created` is
    /// known.
    prefix: Vec<u8>,
}

impl ChunkHead {
    fn new(id: &str, model: &str) -> Self {
        Self {
            id: id.to_owned(),
            model: model.to_owned(),
            created: None,
            prefix: Vec::new(),
        }
    }

    /// The stream's `created`: the first one asked for (`own`, the chunk's
    /// own), or now.
    fn created(&mut self, own: impl FnOnce() -> Option<Value>) -> &Value {
        self.created
            .get_or_insert_with(|| own().unwrap_or_else(|| json!(now())))
    }

    /// The start of every line [`read_chunk`] writes, made once.
    fn prefix(&mut self, own: impl FnOnce() -> Option<Value>) -> &[u8] {
        if self.prefix.is_empty() {
            let created = self.created(own).clone();
            let mut prefix = Vec::with_capacity(128);
            prefix.extend_from_slice(b"data: {\"id\":");
            // Writing strings and a Value into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut prefix, &self.id);
            prefix.extend_from_slice(b",\"object\":\"chat.completion.chunk\",\"model\":");
            let _ = serde_json::to_writer(&mut prefix, &self.model);
            prefix.extend_from_slice(b",\"created\":");
            let _ = serde_json::to_writer(&mut prefix, &created);
            self.prefix = prefix;
        }
        &self.prefix
    }
}

/// Reads one upstream chunk without building its tree (most of a stream's
/// cost per chunk when it did): its members stay raw JSON, copied once into
/// the line the client gets, and only the text of its deltas is measured.
/// `None` for a chunk out of the ordinary (not an object of distinct,
/// plainly named members; choices not objects with string contents), left
/// to [`read_chunk_tree`], which reads anything.
fn read_chunk(json: &[u8], head: &mut ChunkHead, usage: &mut Option<Value>) -> Option<Chunk> {
    // Checked as UTF-8 once here: read from bytes, each member's raw text
    // and each name would be checked again as it is borrowed.
    let text = std::str::from_utf8(json).ok()?;
    let Members(members) = serde_json::from_str(text).ok()?;
    let repeated = members
        .iter()
        .enumerate()
        .any(|(i, (name, _))| members[..i].iter().any(|(seen, _)| seen == name));
    if repeated {
        return None;
    }
    let member = |wanted: &str| {
        members
            .iter()
            .find(|(name, _)| *name == wanted)
            .map(|(_, raw)| *raw)
    };
    if member("error").is_some() {
        return Some(Chunk::Error(sse_raw(json)));
    }
    let choices: Option<ChoicesText> = match member("choices") {
        Some(raw) if raw.get().starts_with('[') => Some(serde_json::from_str(raw.get()).ok()?),
        _ => None,
    };
    if let Some(raw) = member("usage").filter(|raw| raw.get().starts_with('{')) {
        *usage = Some(serde_json::from_str(raw.get()).ok()?);
    }
    let Some(ChoicesText { chars, .. }) = choices.filter(|choices| choices.count > 0) else {
        return Some(Chunk::Skip);
    };
    let created = member("created");
    let prefix = head.prefix(|| created.and_then(|raw| serde_json::from_str(raw.get()).ok()));
    let mut line = Vec::with_capacity(prefix.len() + json.len() + 4);
    line.extend_from_slice(prefix);
    for (name, raw) in &members {
        if matches!(
            *name,
            "id" | "object" | "model" | "created" | "usage" | "system_fingerprint"
        ) {
            continue;
        }
        line.push(b',');
        let _ = serde_json::to_writer(&mut line, name);
        line.push(b':');
        line.extend_from_slice(raw.get().as_bytes());
    }
    line.extend_from_slice(b"}\n\n");
    Some(Chunk::Forward {
        line: Bytes::from(line),
        chars,
    })
}

/// Reads one upstream chunk as a tree: any chunk [`read_chunk`] leaves, and
/// every chunk of a stream whose choices are rewritten (search results as
/// documents: the finish reason and the tool calls' indexes).
fn read_chunk_tree(
    json: &[u8],
    head: &mut ChunkHead,
    usage: &mut Option<Value>,
    documents: bool,
) -> Chunk {
    let Ok(Value::Object(mut chunk)) = serde_json::from_slice::<Value>(json) else {
        return Chunk::Skip;
    };
    if chunk.contains_key("error") {
        return Chunk::Error(sse(&Value::Object(chunk)));
    }
    if let Some(found) = chunk.remove("usage").filter(Value::is_object) {
        *usage = Some(found);
    }
    let has_choices = chunk
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty());
    if !has_choices {
        return Chunk::Skip;
    }
    let chars = delta_chars(chunk.get("choices"));
    chunk.insert("id".into(), json!(head.id));
    chunk.insert("object".into(), json!("chat.completion.chunk"));
    chunk.insert("model".into(), json!(head.model));
    let created = head.created(|| chunk.get("created").cloned()).clone();
    chunk.insert("created".into(), created);
    chunk.remove("system_fingerprint");
    if documents && let Some(Value::Array(choices)) = chunk.get_mut("choices") {
        for choice in choices.iter_mut() {
            if choice.get("finish_reason").is_some_and(|r| r == "stop") {
                choice["finish_reason"] = json!("tool_calls");
            }
            // The documents call is the choice's tool call 0: the model's
            // own calls come after it.
            let calls = choice
                .get_mut("delta")
                .and_then(|delta| delta.get_mut("tool_calls"));
            if let Some(Value::Array(calls)) = calls {
                for call in calls.iter_mut() {
                    if let Some(index) = call.get("index").and_then(Value::as_u64) {
                        call["index"] = json!(index + 1);
                    }
                }
            }
        }
    }
    Chunk::Forward {
        line: sse(&Value::Object(chunk)),
        chars,
    }
}

/// An object's members as raw JSON, in their order.
struct Members<'a>(Vec<(&'a str, &'a serde_json::value::RawValue)>);

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut members = Vec::with_capacity(8);
                while let Some(member) = map.next_entry()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

/// A chunk's choices, as far as the relay reads them: how many, and the
/// characters of text their deltas carry (summed as they are read, with
/// no vector of them).
struct ChoicesText {
    count: usize,
    chars: usize,
}

impl<'de> serde::Deserialize<'de> for ChoicesText {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = ChoicesText;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array of choices")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut choices = ChoicesText { count: 0, chars: 0 };
                while let Some(choice) = seq.next_element::<ChoiceText>()? {
                    choices.count += 1;
                    choices.chars += choice.chars();
                }
                Ok(choices)
            }
        }
        deserializer.deserialize_seq(Visit)
    }
}

/// A choice of a chunk, as far as the relay reads it: its delta's text.
#[derive(serde::Deserialize)]
struct ChoiceText {
    #[serde(default)]
    delta: Option<DeltaText>,
}

#[derive(serde::Deserialize)]
struct DeltaText {
    #[serde(default)]
    content: Option<TextLen>,
}

impl ChoiceText {
    fn chars(&self) -> usize {
        self.delta
            .as_ref()
            .and_then(|delta| delta.content.as_ref())
            .map_or(0, |text| text.0)
    }
}

/// The length of a JSON string, read without keeping the string.
struct TextLen(usize);

impl<'de> serde::Deserialize<'de> for TextLen {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = TextLen;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<TextLen, E> {
                Ok(TextLen(text.len()))
            }
        }
        deserializer.deserialize_str(Visit)
    }
}

/// `json` as a server-sent event, as it is.
fn sse_raw(json: &[u8]) -> Bytes {
    let mut line = Vec::with_capacity(json.len() + 8);
    line.extend_from_slice(b"data: ");
    line.extend_from_slice(json);
    line.extend_from_slice(b"\n\n");
    Bytes::from(line)
}

fn sse(value: &Value) -> Bytes {
    let mut line = Vec::with_capacity(256);
    line.extend_from_slice(b"data: ");
    // Serializing a Value cannot fail.
    let _ = serde_json::to_writer(&mut line, value);
    line.extend_from_slice(b"\n\n");
    Bytes::from(line)
}

pub(crate) fn model_headers(
    response: &mut HttpResponseBuilder,
    gateway: &Gateway,
    model: &ModelEntry,
    backend: &str,
    retries: u32,
) {
    for (name, value) in &model.headers {
        response.insert_header((name.clone(), value.clone()));
    }
    if let Some(value) = header_value(backend).filter(|_| !backend.is_empty()) {
        response.insert_header((gateway.stamp.model_router.clone(), value));
    }
    if retries > 0 {
        response.insert_header((RETRY_COUNT, retries));
    }
}

/// Token counts of a finished exchange, and their JSON for the response.
pub(crate) struct Usage {
    prompt: u64,
    completion: u64,
    cached: u64,
    cache_write: u64,
    json: Value,
}

impl Usage {
    /// Prompt tokens only (embeddings); `json` is the response's `usage`.
    pub(crate) fn prompt_only(prompt: u64) -> Self {
        Self {
            prompt,
            completion: 0,
            cached: 0,
            cache_write: 0,
            json: json!({"prompt_tokens": prompt, "total_tokens": prompt}),
        }
    }

    /// Completion tokens only, no `json` (a stream's checkpoint).
    fn completion_only(completion: u64) -> Self {
        Self {
            prompt: 0,
            completion,
            cached: 0,
            cache_write: 0,
            json: Value::Null,
        }
    }

    pub(crate) fn json(&self) -> &Value {
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
            json: Value::Null,
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

/// The upstream's usage, or an estimate (4 characters a token) when the
/// upstream reported none.
fn usage_or_estimate(
    upstream: Option<&Value>,
    prompt_estimate: u64,
    completion_chars: usize,
) -> Usage {
    let count = |v: &Value, key: &str| v.get(key).and_then(Value::as_u64);
    if let Some(usage) = upstream.filter(|u| count(u, "prompt_tokens").is_some()) {
        let prompt = count(usage, "prompt_tokens").unwrap_or_default();
        let completion = count(usage, "completion_tokens").unwrap_or_default();
        let details = usage.get("prompt_tokens_details").unwrap_or(&Value::Null);
        let mut json = usage.clone();
        json["total_tokens"] = json!(prompt.saturating_add(completion));
        return Usage {
            prompt,
            completion,
            cached: count(details, "cached_tokens").unwrap_or_default(),
            cache_write: count(details, "cache_creation_input_tokens").unwrap_or_default(),
            json,
        };
    }
    let completion = (completion_chars as u64).div_ceil(4);
    Usage {
        prompt: prompt_estimate,
        completion,
        cached: 0,
        cache_write: 0,
        json: json!({
            "prompt_tokens": prompt_estimate,
            "completion_tokens": completion,
            "total_tokens": prompt_estimate.saturating_add(completion),
        }),
    }
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

fn completion_chars(choices: Option<&Value>) -> usize {
    choices
        .and_then(Value::as_array)
        .map(|choices| {
            choices
                .iter()
                .map(|c| c["message"]["content"].as_str().map_or(0, str::len))
                .sum()
        })
        .unwrap_or_default()
}

fn delta_chars(choices: Option<&Value>) -> usize {
    choices
        .and_then(Value::as_array)
        .map(|choices| {
            choices
                .iter()
                .map(|c| c["delta"]["content"].as_str().map_or(0, str::len))
                .sum()
        })
        .unwrap_or_default()
}

/// The clock of a stream's checkpoints, one from its hold to its end: first
/// after `every`, then every `every` from the last tick (a late tick does
/// not bring a burst).
fn checkpoint_clock(every: std::time::Duration) -> tokio::time::Interval {
    let mut clock = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    clock.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    clock
}

/// What the model's own tokenizer counts in the request's text (message
/// text, tool-call arguments, `tools`, `response_format`) beyond the
/// four-characters-a-token guess the estimate already holds for it; never
/// less than nothing. On the blocking pool: a long prompt takes
/// milliseconds. A text the tokenizer refuses counts a token a byte.
async fn tokenizer_excess(tokenizer: std::sync::Arc<tokenizers::Tokenizer>, body: &Value) -> u64 {
    let texts = prompt_texts(body);
    let guessed: u64 = texts.iter().map(|t| (t.len() as u64).div_ceil(4)).sum();
    let counted = tokio::task::spawn_blocking(move || {
        texts
            .iter()
            .map(|text| {
                tokenizer
                    .encode_fast(text.as_str(), false)
                    .map_or(text.len(), |encoding| encoding.len()) as u64
            })
            .sum::<u64>()
    })
    .await
    .unwrap_or(0);
    counted.saturating_sub(guessed)
}

/// The text of a chat body that a tokenizer can count.
fn prompt_texts(body: &Value) -> Vec<String> {
    let mut texts = Vec::new();
    for message in body["messages"].as_array().into_iter().flatten() {
        match &message["content"] {
            Value::String(text) => texts.push(text.clone()),
            Value::Array(parts) => texts.extend(
                parts
                    .iter()
                    .filter_map(|p| p["text"].as_str().map(str::to_owned)),
            ),
            _ => {}
        }
        for call in message["tool_calls"].as_array().into_iter().flatten() {
            if let Some(arguments) = call["function"]["arguments"].as_str() {
                texts.push(arguments.to_owned());
            }
        }
    }
    for member in ["tools", "response_format"] {
        if let Some(value) = body.get(member).filter(|v| !v.is_null()) {
            texts.push(value.to_string());
        }
    }
    texts
}

/// Turns the `file` parts of a request that has some into text parts (on
/// the blocking pool), counting their text in the request's estimates.
async fn convert_files(
    body: &mut Value,
    chat: &mut Chat,
    gateway: &Gateway,
) -> Result<(), ApiError> {
    let allow_private = gateway.file_urls_allow_private;
    let Some(Value::Array(messages)) = body.get_mut("messages") else {
        return Ok(());
    };
    let before: usize = messages.iter().map(|m| m.to_string().len()).sum();
    if let Err((m, p, why)) = crate::files::fetch_urls(messages, allow_private).await {
        let mut details = Details::new();
        details.push(
            &[
                "messages",
                &m.to_string(),
                "content",
                &p.to_string(),
                "file",
            ],
            why,
        );
        return Err(ApiError::validation(details));
    }
    if let Err((m, p, why)) = crate::files::convert(messages, &gateway.converter).await {
        let mut details = Details::new();
        details.push(
            &[
                "messages",
                &m.to_string(),
                "content",
                &p.to_string(),
                "file",
            ],
            why,
        );
        return Err(ApiError::validation(details));
    }
    // The files' text is prompt too (four characters a token, as above).
    let after: usize = messages.iter().map(|m| m.to_string().len()).sum();
    let added = (after.saturating_sub(before) as u64).div_ceil(4);
    chat.prompt_tokens_estimate = chat.prompt_tokens_estimate.saturating_add(added);
    chat.estimated_tokens = chat.estimated_tokens.saturating_add(added);
    Ok(())
}

/// Splits `<model>:<param>=<value>&...` into the model and its service
/// parameters (form-encoded; `true` and `false` are booleans). A name with
/// a colon and no `=` after it (`org/model:latest`) is a model name whole.
fn split_model_suffix(model: &str) -> (&str, Map<String, Value>) {
    let mut suffix = Map::new();
    match model.split_once(':') {
        Some((id, settings)) if settings.contains('=') && !id.is_empty() => {
            for (key, value) in form_urlencoded::parse(settings.as_bytes()) {
                let value = match value.as_ref() {
                    "true" => Value::Bool(true),
                    "false" => Value::Bool(false),
                    text => Value::String(text.to_owned()),
                };
                suffix.insert(key.into_owned(), value);
            }
            (id, suffix)
        }
        _ => (model, suffix),
    }
}

/// Checks the members the spec lists, takes `<brand>_parameters` out of the
/// body (the upstream does not know it), and leaves every other member
/// untouched for the upstream.
fn validate(
    gateway: &Gateway,
    catalog: &crate::Catalog,
    body: &mut Value,
) -> Result<Chat, ApiError> {
    let mut details = Details::new();
    let Some(object) = body.as_object_mut() else {
        details.push(&[], "Expected a JSON object");
        return Err(ApiError::validation(details));
    };
    // `<model>:<param>=<value>&...`: the suffix sets service parameters and
    // wins over the body's.
    let mut suffix = Map::new();
    let model_id = match object.get("model") {
        Some(Value::String(model)) if !model.is_empty() => {
            let (id, settings) = split_model_suffix(model);
            suffix = settings;
            id.to_owned()
        }
        Some(Value::String(_)) => {
            details.push(&["model"], "String must contain at least 1 character(s)");
            String::new()
        }
        Some(_) => {
            details.push(&["model"], "Expected string");
            String::new()
        }
        None => {
            details.push(&["model"], "Required");
            String::new()
        }
    };
    let mut prompt_chars = 0usize;
    // An unknown model is a 404 later; its inputs are not judged.
    let capabilities = catalog
        .model(&model_id)
        .map(|m| m.config.capabilities.as_slice());
    match object.get("messages") {
        Some(Value::Array(messages)) if messages.is_empty() => {
            details.push(&["messages"], "Array must contain at least 1 element(s)");
        }
        Some(Value::Array(messages)) => {
            for (i, message) in messages.iter().enumerate() {
                prompt_chars += validate_message(
                    &mut details,
                    &i.to_string(),
                    message,
                    &model_id,
                    capabilities,
                );
            }
        }
        Some(_) => details.push(&["messages"], "Expected array"),
        None => details.push(&["messages"], "Required"),
    }
    let stream = match object.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => *stream,
        Some(_) => {
            details.push(&["stream"], "Expected boolean");
            false
        }
    };
    let n = match object.get("n") {
        None | Some(Value::Null) => 1,
        Some(value) => match value.as_u64() {
            Some(n) if (1..=MAX_N).contains(&n) => n,
            _ => {
                details.push(&["n"], format!("Expected an integer from 1 to {MAX_N}"));
                1
            }
        },
    };
    let mut max_tokens = None;
    for field in ["max_tokens", "max_completion_tokens"] {
        match object.get(field) {
            None | Some(Value::Null) => {}
            Some(value) => match value.as_u64() {
                Some(v) if v >= 1 => max_tokens = Some(max_tokens.map_or(v, |m: u64| m.min(v))),
                _ => details.push(&[field], "Expected a positive integer"),
            },
        }
    }
    check_stop(&mut details, object.get("stop"));
    if object
        .get("prompt_cache_key")
        .is_some_and(|v| !v.is_string() && !v.is_null())
    {
        details.push(&["prompt_cache_key"], "Expected string");
    }
    let logprobs = match object.get("logprobs") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(on)) => *on,
        Some(_) => {
            details.push(&["logprobs"], "Expected boolean");
            false
        }
    };
    match object.get("top_logprobs") {
        None | Some(Value::Null) => {}
        Some(value) => match value.as_u64() {
            Some(n) if n <= 20 && logprobs => {}
            Some(n) if n <= 20 => details.push(
                &["top_logprobs"],
                "top_logprobs requires logprobs to be true",
            ),
            _ => details.push(&["top_logprobs"], "Expected an integer from 0 to 20"),
        },
    }
    // Backends without prompt caching would refuse `cache_control`: drop it.
    if capabilities.is_some_and(|caps| !caps.iter().any(|c| c == "caching"))
        && let Some(Value::Array(messages)) = object.get_mut("messages")
    {
        for message in messages.iter_mut() {
            if let Some(Value::Array(parts)) = message.get_mut("content") {
                for part in parts.iter_mut().filter_map(Value::as_object_mut) {
                    part.remove("cache_control");
                }
            }
        }
    }
    // `enable_x_search` is not a suffix key (the hosted API's rule).
    suffix.remove("enable_x_search");
    let mut requested = object.remove(&gateway.brand.parameters_field);
    if !suffix.is_empty() {
        match &mut requested {
            Some(Value::Object(map)) => map.extend(suffix),
            // A malformed body member is still reported as such.
            Some(other) if !other.is_null() => {}
            _ => requested = Some(Value::Object(suffix)),
        }
    }
    let x_search = requested
        .as_ref()
        .and_then(|r| r.get("enable_x_search"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let parameters = effective_parameters(gateway, requested, &mut details)?;
    details.into_result()?;
    let flag = |name: &str| {
        parameters
            .get(name)
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    let character_prompt = parameters
        .get("character_slug")
        .and_then(Value::as_str)
        .and_then(|slug| gateway.character(slug))
        .map(|c| c.system_prompt.clone())
        .unwrap_or_default();
    let service = router_pb::ServiceParameters {
        strip_thinking: flag("strip_thinking_response"),
        disable_thinking: flag("disable_thinking"),
        include_system_prompt: flag(&gateway.brand.include_system_prompt_field),
        character_prompt,
    };

    let model = catalog.model(&model_id);
    let completion_budget = max_tokens
        .or_else(|| model.and_then(|m| m.config.max_completion_tokens))
        .unwrap_or(gateway.services.limiter.policy().default_completion_tokens);
    if max_tokens.is_none() {
        // The hold covers this many: the backend must not write more.
        object.insert("max_tokens".into(), Value::from(completion_budget));
    }
    // Everything else the model reads: tools and schemas, tool calls,
    // media, and the system prompts the router puts first.
    prompt_chars = prompt_chars
        .saturating_add(other_prompt_chars(object))
        .saturating_add(service.character_prompt.len());
    if service.include_system_prompt {
        let system_prompt = model
            .and_then(|m| m.config.system_prompt.as_ref())
            .map_or(gateway.system_prompt_chars, String::len);
        prompt_chars = prompt_chars.saturating_add(system_prompt);
    }
    let prompt_tokens_estimate = (prompt_chars as u64).div_ceil(4).max(1);
    Ok(Chat {
        model_id,
        stream,
        parameters,
        service,
        prompt_tokens_estimate,
        estimated_tokens: prompt_tokens_estimate
            .saturating_add(completion_budget.saturating_mul(n)),
        x_search,
        choices: n,
    })
}

/// What one image is counted as in a hold, in characters (four a token):
/// 1,600 tokens, above what the common vision encoders make of a
/// high-detail image.
const IMAGE_CHARS: usize = 1_600 * 4;

/// Characters of what reaches the model besides the messages' text: the
/// JSON of `tools`, `functions`, `response_format` and `tool_choice` and
/// of tool calls (as a chat template writes them), each image at
/// [`IMAGE_CHARS`], and audio and video parts at the length of their data.
fn other_prompt_chars(object: &Map<String, Value>) -> usize {
    let mut chars = ["tools", "functions", "response_format", "tool_choice"]
        .iter()
        .filter_map(|field| object.get(*field))
        .map(json_len)
        .fold(0usize, usize::saturating_add);
    let Some(Value::Array(messages)) = object.get("messages") else {
        return chars;
    };
    for message in messages {
        if let Some(calls) = message.get("tool_calls") {
            chars = chars.saturating_add(json_len(calls));
        }
        let Some(Value::Array(parts)) = message.get("content") else {
            continue;
        };
        for part in parts {
            chars = chars.saturating_add(match part.get("type").and_then(Value::as_str) {
                Some("image_url") => IMAGE_CHARS,
                Some("input_audio" | "video_url") => json_len(part),
                _ => 0,
            });
        }
    }
    chars
}

/// The length of a value's JSON, written nowhere.
fn json_len(value: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 = self.0.saturating_add(bytes.len());
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// Content part types beyond text, and the capability each needs.
const MEDIA_PARTS: [(&str, &str, &str); 4] = [
    ("image_url", "vision", "image"),
    ("input_audio", "audio", "audio"),
    ("video_url", "video", "video"),
    ("file", "files", "file"),
];

/// Validates one message; returns the characters of text it carries.
/// `capabilities` are the model's (None: the model is unknown).
/// The most stop sequences a request may give (the hosted API's bound).
const MAX_STOPS: usize = 4;
/// The longest stop sequence, in bytes: a backend searches each of them
/// in the text generated so far, on every token.
const MAX_STOP_BYTES: usize = 256;

/// `stop`: a string or up to four, none empty or longer than 256 bytes.
fn check_stop(details: &mut Details, stop: Option<&Value>) {
    let stops: Vec<&Value> = match stop {
        None | Some(Value::Null) => return,
        Some(Value::String(_)) => vec![stop.unwrap_or(&Value::Null)],
        Some(Value::Array(stops)) if (1..=MAX_STOPS).contains(&stops.len()) => {
            stops.iter().collect()
        }
        Some(Value::Array(_)) => {
            details.push(
                &["stop"],
                format!("Expected 1 to {MAX_STOPS} stop sequences"),
            );
            return;
        }
        Some(_) => {
            details.push(&["stop"], "Expected a string or an array of strings");
            return;
        }
    };
    for stop in stops {
        match stop.as_str() {
            Some(text) if !text.is_empty() && text.len() <= MAX_STOP_BYTES => {}
            _ => {
                details.push(
                    &["stop"],
                    format!("Each stop sequence must be a string of 1 to {MAX_STOP_BYTES} bytes"),
                );
                return;
            }
        }
    }
}

fn validate_message(
    details: &mut Details,
    index: &str,
    message: &Value,
    model_id: &str,
    capabilities: Option<&[String]>,
) -> usize {
    let Some(message) = message.as_object() else {
        details.push(&["messages", index], "Expected object");
        return 0;
    };
    let role = message.get("role").and_then(Value::as_str);
    match role {
        Some(role) if ROLES.contains(&role) => {}
        Some(other) => details.push(
            &["messages", index, "role"],
            format!(
                "Invalid enum value. Expected {}, received '{other}'",
                ROLES.join(" | ")
            ),
        ),
        None => details.push(&["messages", index, "role"], "Required"),
    }
    if role == Some("tool") {
        match message.get("tool_call_id") {
            Some(Value::String(id)) if !id.is_empty() => {}
            Some(Value::String(_)) => details.push(
                &["messages", index, "tool_call_id"],
                "String must contain at least 1 character(s)",
            ),
            Some(_) => details.push(&["messages", index, "tool_call_id"], "Expected string"),
            None => details.push(&["messages", index, "tool_call_id"], "Required"),
        }
    }
    let mut has_tool_calls = false;
    match message.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            has_tool_calls = !calls.is_empty();
            for (c, call) in calls.iter().enumerate() {
                let c = c.to_string();
                let text = |field: &str| call.pointer(field).and_then(Value::as_str).is_some();
                if !text("/id") {
                    details.push(
                        &["messages", index, "tool_calls", &c, "id"],
                        "Required string",
                    );
                }
                if call.get("type").and_then(Value::as_str) != Some("function") {
                    details.push(
                        &["messages", index, "tool_calls", &c, "type"],
                        "Invalid literal value, expected \"function\"",
                    );
                }
                if !text("/function/name") || !text("/function/arguments") {
                    details.push(
                        &["messages", index, "tool_calls", &c, "function"],
                        "Expected an object with string name and arguments",
                    );
                }
            }
        }
        Some(_) => details.push(&["messages", index, "tool_calls"], "Expected array"),
    }
    match message.get("content") {
        Some(Value::String(text)) => text.len(),
        Some(Value::Array(parts)) => {
            let mut chars = 0;
            for (p, part) in parts.iter().enumerate() {
                let p = p.to_string();
                let Some(part) = part.as_object() else {
                    details.push(&["messages", index, "content", &p], "Expected object");
                    continue;
                };
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => match part.get("text") {
                        Some(Value::String(text)) if !text.is_empty() => {
                            chars += text.len();
                            check_cache_control(details, index, &p, part.get("cache_control"));
                        }
                        Some(Value::String(_)) => details.push(
                            &["messages", index, "content", &p, "text"],
                            "String must contain at least 1 character(s)",
                        ),
                        Some(_) => details.push(
                            &["messages", index, "content", &p, "text"],
                            "Expected string",
                        ),
                        None => {
                            details.push(&["messages", index, "content", &p, "text"], "Required")
                        }
                    },
                    Some(kind) => match MEDIA_PARTS.iter().find(|(name, _, _)| *name == kind) {
                        Some((name, capability, noun)) => {
                            if !part.get(*name).is_some_and(Value::is_object) {
                                details.push(
                                    &["messages", index, "content", &p, name],
                                    "Required object",
                                );
                            } else if capabilities
                                .is_some_and(|caps| !caps.iter().any(|c| c == capability))
                            {
                                details.push(
                                    &["messages", index, "content", &p, "type"],
                                    format!("The model {model_id} does not accept {noun} input"),
                                );
                            }
                        }
                        None => details.push(
                            &["messages", index, "content", &p, "type"],
                            format!(
                                "Invalid enum value. Expected 'text' | 'image_url' | 'input_audio' | 'video_url' | 'file', received '{kind}'"
                            ),
                        ),
                    },
                    None => details.push(&["messages", index, "content", &p, "type"], "Required"),
                }
            }
            chars
        }
        // An assistant turn may carry only tool calls.
        Some(Value::Null) | None if role == Some("assistant") => {
            if !has_tool_calls {
                details.push(
                    &["messages", index, "content"],
                    "An assistant message must have content or tool_calls",
                );
            }
            0
        }
        Some(Value::Null) | None => {
            details.push(&["messages", index, "content"], "Required");
            0
        }
        Some(_) => {
            details.push(&["messages", index, "content"], "Expected string or array");
            0
        }
    }
}

/// `cache_control` on a text part: `{type: "ephemeral", ttl?: string}`.
fn check_cache_control(details: &mut Details, index: &str, part: &str, value: Option<&Value>) {
    let path = ["messages", index, "content", part, "cache_control"];
    match value {
        None | Some(Value::Null) => {}
        Some(Value::Object(control)) => {
            if control.get("type").and_then(Value::as_str) != Some("ephemeral") {
                details.push(
                    &[&path[..], &["type"]].concat(),
                    "Invalid literal value, expected \"ephemeral\"",
                );
            }
            if control
                .get("ttl")
                .is_some_and(|t| !t.is_string() && !t.is_null())
            {
                details.push(&[&path[..], &["ttl"]].concat(), "Expected string");
            }
        }
        Some(_) => details.push(&path, "Expected object"),
    }
}

/// The `<brand>_parameters` echo: every required member, as requested
/// (the router applies the system prompt and the thinking flags; the web
/// members are what `augment::plan` then corrects to what is effective).
/// End-to-end encryption is not offered: reported off.
fn effective_parameters(
    gateway: &Gateway,
    requested: Option<Value>,
    details: &mut Details,
) -> Result<Map<String, Value>, ApiError> {
    let field = gateway.brand.parameters_field.as_str();
    let include_prompt = gateway.brand.include_system_prompt_field.as_str();
    let requested = match requested {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(map)) => map,
        Some(_) => {
            details.push(&[field], "Expected object");
            Map::new()
        }
    };
    let booleans = [
        "strip_thinking_response",
        "disable_thinking",
        "enable_web_scraping",
        "enable_x_search",
        "enable_web_citations",
        "include_search_results_in_stream",
        "return_search_results_as_documents",
        "enable_e2ee",
        include_prompt,
    ];
    for name in booleans {
        if requested
            .get(name)
            .is_some_and(|v| !v.is_boolean() && !v.is_null())
        {
            details.push(&[field, name], "Expected boolean");
        }
    }
    if let Some(value) = requested.get("enable_web_search").filter(|v| !v.is_null())
        && !matches!(value.as_str(), Some("off" | "on" | "auto"))
    {
        details.push(
            &[field, "enable_web_search"],
            "Invalid enum value. Expected 'auto' | 'off' | 'on'",
        );
    }
    let mut character = None;
    if let Some(slug) = requested.get("character_slug").filter(|v| !v.is_null()) {
        match slug.as_str() {
            // Private characters are as unknown as missing ones.
            Some(slug) => match gateway.character(slug).filter(|c| c.public) {
                Some(found) => character = Some(found.slug.clone()),
                None => {
                    return Err(ApiError::new(
                        ErrorCode::NotFound,
                        "No character could be found from the provided character_slug",
                    ));
                }
            },
            None => details.push(&[field, "character_slug"], "Expected string"),
        }
    }
    let mut echo = Map::new();
    if let Some(slug) = character {
        echo.insert("character_slug".into(), json!(slug));
    }
    let flag = |name: &str| {
        requested
            .get(name)
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    echo.insert("enable_e2ee".into(), json!(false));
    let search = requested
        .get("enable_web_search")
        .and_then(Value::as_str)
        .filter(|mode| matches!(*mode, "on" | "auto"))
        .unwrap_or("off");
    echo.insert("enable_web_search".into(), json!(search));
    echo.insert(
        "enable_web_citations".into(),
        json!(flag("enable_web_citations")),
    );
    echo.insert(
        "enable_web_scraping".into(),
        json!(flag("enable_web_scraping")),
    );
    echo.insert(
        include_prompt.into(),
        json!(
            requested
                .get(include_prompt)
                .and_then(Value::as_bool)
                .unwrap_or(true)
        ),
    );
    echo.insert(
        "include_search_results_in_stream".into(),
        json!(flag("include_search_results_in_stream")),
    );
    echo.insert(
        "return_search_results_as_documents".into(),
        json!(flag("return_search_results_as_documents")),
    );
    echo.insert(
        "strip_thinking_response".into(),
        json!(flag("strip_thinking_response")),
    );
    echo.insert("disable_thinking".into(), json!(flag("disable_thinking")));
    Ok(echo)
}

/// Properties of the model-suffix parser: any string is split without a
/// panic, and what a client encodes comes back.
#[cfg(test)]
mod properties {
    use super::split_model_suffix;
    use proptest::prelude::*;
    use serde_json::{Map, Value};

    proptest! {
        /// Any model string: a verdict, never a panic, and the model part
        /// is a prefix of the input.
        #[test]
        fn any_model_string_splits(model in any::<String>()) {
            let (id, _) = split_model_suffix(&model);
            prop_assert!(model.starts_with(id));
        }

        /// Parameters form-encoded after `:` come back exactly, booleans as
        /// booleans, and the model name without them.
        #[test]
        fn encoded_parameters_round_trip(
            id in "[a-zA-Z0-9._/-]{1,40}",
            parameters in proptest::collection::btree_map("[a-z_]{1,20}", any::<String>(), 1..6),
        ) {
            let mut encoder = form_urlencoded::Serializer::new(String::new());
            for (key, value) in &parameters {
                encoder.append_pair(key, value);
            }
            let model = format!("{id}:{}", encoder.finish());
            let (split, settings) = split_model_suffix(&model);
            prop_assert_eq!(split, id.as_str());
            let expected: Map<String, Value> = parameters
                .into_iter()
                .map(|(key, value)| {
                    let value = match value.as_str() {
                        "true" => Value::Bool(true),
                        "false" => Value::Bool(false),
                        _ => Value::String(value),
                    };
                    (key, value)
                })
                .collect();
            prop_assert_eq!(settings, expected);
        }

        /// A colon with no `=` after it is part of the model's name.
        #[test]
        fn a_tag_without_parameters_is_the_name(
            id in "[a-zA-Z0-9._/-]{1,40}",
            tag in "[a-zA-Z0-9._-]{0,20}",
        ) {
            let model = format!("{id}:{tag}");
            let (split, settings) = split_model_suffix(&model);
            prop_assert_eq!(split, model.as_str());
            prop_assert!(settings.is_empty());
        }
    }
}

#[cfg(test)]
mod chunks {
    use super::{Chunk, ChunkHead, read_chunk, read_chunk_tree};
    use proptest::prelude::*;
    use serde_json::{Value, json};

    /// What a line says: its JSON, after `data: `.
    fn said(line: &[u8]) -> Value {
        let text = std::str::from_utf8(line).unwrap();
        let json = text
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        serde_json::from_str(json).unwrap()
    }

    /// Both readers on one chunk (each with a fresh stream): the fast one's
    /// verdict, when it gives one, is the tree's.
    fn agree(json: &[u8]) -> Result<bool, TestCaseError> {
        let (mut fast_head, mut tree_head) = (
            ChunkHead::new("chatcmpl-x", "m"),
            ChunkHead::new("chatcmpl-x", "m"),
        );
        let (mut fast_usage, mut tree_usage) = (None, None);
        let tree = read_chunk_tree(json, &mut tree_head, &mut tree_usage, false);
        let Some(fast) = read_chunk(json, &mut fast_head, &mut fast_usage) else {
            return Ok(false);
        };
        prop_assert_eq!(&fast_usage, &tree_usage);
        match (fast, tree) {
            (Chunk::Skip, Chunk::Skip) => {}
            (Chunk::Error(a), Chunk::Error(b)) => prop_assert_eq!(said(&a), said(&b)),
            (Chunk::Forward { line: a, chars: x }, Chunk::Forward { line: b, chars: y }) => {
                prop_assert_eq!(x, y);
                let (a, b) = (said(&a), said(&b));
                // `created` is now in both when the chunk has none.
                if json_has(json, "created") {
                    prop_assert_eq!(a, b);
                } else {
                    let strip = |mut v: Value| {
                        v.as_object_mut().unwrap().remove("created");
                        v
                    };
                    prop_assert_eq!(strip(a), strip(b));
                }
            }
            _ => prop_assert!(
                false,
                "the readers disagree on {}",
                String::from_utf8_lossy(json)
            ),
        }
        Ok(true)
    }

    fn json_has(json: &[u8], key: &str) -> bool {
        serde_json::from_slice::<Value>(json).is_ok_and(|v| v.get(key).is_some())
    }

    #[test]
    fn the_usual_chunks_take_the_fast_way_and_agree() {
        for chunk in [
            json!({"id": "up", "object": "chat.completion.chunk", "created": 1_800_000_000u64, "model": "up-model",
                   "system_fingerprint": "fp", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "héllo \"q\" \n"},
                   "logprobs": null, "finish_reason": null}]}),
            json!({"id": "up", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}),
            json!({"id": "up", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}),
            json!({"error": {"message": "overloaded", "type": "server_error"}}),
            json!({"choices": [{"delta": {"content": null, "tool_calls": [{"index": 0}]}}, {"delta": {"content": "ab"}}], "x-extra": [1, 2.50]}),
        ] {
            let json = serde_json::to_vec(&chunk).unwrap();
            assert!(agree(&json).unwrap(), "{chunk} went the slow way");
        }
    }

    #[test]
    fn chunks_out_of_the_ordinary_go_the_tree_way() {
        for json in [
            &br#"{"choices":[{"delta":{"content":"a"}}],"choices":[]}"#[..],
            br#"{"choices":[{"delta":{"content":[{"type":"text","text":"a"}]}}]}"#,
            br#"{"choices":[null]}"#,
            br#"{"ch\u006fices":[{"delta":{"content":"a"}}]}"#,
            // A name with an escape (serde_json cannot lend it).
            br#"{"choices":[{"delta":{"content":"a"}}],"a\"b":1}"#,
            br#"[1,2]"#,
            b"not json",
            // Not UTF-8 (the tree reader skips it).
            b"{\"choices\":[{\"delta\":{\"content\":\"\xff\"}}]}",
        ] {
            let (mut head, mut usage) = (ChunkHead::new("c", "m"), None);
            assert!(
                read_chunk(json, &mut head, &mut usage).is_none(),
                "{}",
                String::from_utf8_lossy(json)
            );
        }
    }

    fn member() -> impl Strategy<Value = (String, Value)> {
        let text = prop_oneof![
            Just(Value::Null),
            any::<String>().prop_map(Value::from),
            Just(json!(7))
        ];
        let choice = (text, proptest::option::of(prop_oneof![Just("stop"), Just("length")]))
            .prop_map(|(content, finish)| json!({"index": 0, "delta": {"content": content}, "finish_reason": finish}));
        prop_oneof![
            proptest::collection::vec(choice, 0..3)
                .prop_map(|c| ("choices".to_owned(), Value::from(c))),
            (0u64..1000).prop_map(|n| ("usage".to_owned(), json!({"completion_tokens": n}))),
            Just(("usage".to_owned(), Value::Null)),
            Just(("error".to_owned(), json!({"message": "no"}))),
            prop_oneof![
                Just(json!(1_800_000_000u64)),
                Just(Value::Null),
                Just(json!("x"))
            ]
            .prop_map(|v| ("created".to_owned(), v)),
            ("[a-z_]{1,12}", any::<String>()).prop_map(|(k, v)| (k, Value::from(v))),
            // Any name: one that needs an escape goes the tree way.
            (any::<String>(), any::<String>()).prop_map(|(k, v)| (k, Value::from(v))),
        ]
    }

    proptest! {
        /// Any chunk: the fast reader answers as the tree reader does, or
        /// leaves the chunk to it.
        #[test]
        fn the_fast_reader_is_the_tree_reader(members in proptest::collection::vec(member(), 0..6)) {
            let mut object = String::from("{");
            for (i, (name, value)) in members.iter().enumerate() {
                if i > 0 {
                    object.push(',');
                }
                object.push_str(&serde_json::to_string(name).unwrap());
                object.push(':');
                object.push_str(&value.to_string());
            }
            object.push('}');
            agree(object.as_bytes())?;
        }
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
            json: Value::Null,
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
