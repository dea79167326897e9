//! The billing service: prices usage from the model catalog and keeps the
//! prepaid ledger.
//!
//! Prices are per million tokens, applied exactly (decimal arithmetic, never
//! floats). The ledger ([`ledger`]) lives in the database: before a call
//! the gateway has billing hold the most the call can cost (prompt estimate
//! plus its completion budget, at the model's prices), after it billing
//! settles the real usage against the hold, DIEM first, and releases the
//! rest. Amounts cross the interface as decimal strings; the ledger counts
//! integer nano-units. The prices follow configuration reloads
//! ([`LocalBilling::reload`]): a hold keeps the amount it reserved, and a
//! settlement is priced at the prices in force when it settles.

use rialto_core::hashing::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use rialto_core::config::price_decimal;
use rialto_core::{Error, ErrorCode, ModelConfig, Result};
use rialto_proto::billing::v1 as pb;
use rust_decimal::Decimal;

pub mod book;
pub mod grpc;
pub mod jobs;
pub mod ledger;
pub mod recovery;
pub mod replicas;
pub mod responses;
pub mod solana;
pub mod usage_queue;
pub mod writer;
pub mod x402;

/// Billing in domain terms.
#[async_trait]
pub trait BillingService: std::any::Any + Send + Sync {
    /// The cost of `usage` on `model_id`.
    async fn quote(&self, request: pb::QuoteRequest) -> Result<pb::Cost>;
    /// Reserves the most a request can cost, or says the balance can't.
    async fn hold(&self, request: pb::HoldRequest) -> Result<pb::HoldResponse>;
    /// Charges the real usage against the request's hold; idempotent.
    async fn settle(&self, request: pb::SettleRequest) -> Result<pb::Cost>;
    /// Holds and settles at once, for an answer already known: refused as
    /// [`hold`](Self::hold) refuses (nothing charged), else charged as
    /// [`settle`](Self::settle) charges. Here, the two in turn; over gRPC
    /// and across replicas, one call.
    async fn charge(&self, request: pb::ChargeRequest) -> Result<pb::ChargeResponse> {
        hold_then_settle(self, request).await
    }
    /// Records what a running stream used so far and renews its hold.
    async fn checkpoint(&self, request: pb::CheckpointRequest) -> Result<pb::CheckpointResponse>;
    /// Adds credit once per reference.
    async fn credit(&self, request: pb::CreditRequest) -> Result<pb::CreditResponse>;
    async fn get_balance(&self, request: pb::GetBalanceRequest) -> Result<pb::Balance>;
    /// A page of an owner's usage history.
    async fn usage_history(
        &self,
        request: pb::UsageHistoryRequest,
    ) -> Result<pb::UsageHistoryResponse>;
    /// Keeps a response of `POST /responses` for `previous_response_id`.
    async fn put_response(&self, request: pb::StoredResponse) -> Result<pb::PutResponseAck>;
    /// The owner's stored response, or NotFound.
    async fn get_response(&self, request: pb::GetResponseRequest) -> Result<pb::StoredResponse>;
    /// The owner's spend in a range by day, model, key and currency (every
    /// owner's summed with `all_owners`).
    async fn usage_analytics(
        &self,
        request: pb::UsageAnalyticsRequest,
    ) -> Result<pb::UsageAnalyticsResponse>;
    /// Sets the DIEM the owner's stake grants per UTC day.
    async fn set_stake(&self, request: pb::SetStakeRequest) -> Result<pb::Balance>;
    /// What capped keys were charged in their current periods.
    async fn key_spend(&self, request: pb::KeySpendRequest) -> Result<pb::KeySpendResponse>;
    /// An x402 top-up: verified, settled, credited once.
    async fn top_up(&self, request: pb::TopUpRequest) -> Result<pb::TopUpResponse>;
    /// A page of an owner's USD movements, newest first.
    async fn transactions(
        &self,
        request: pb::TransactionsRequest,
    ) -> Result<pb::TransactionsResponse>;
    /// A page of the x402 top-ups received, every wallet's, newest first.
    async fn top_ups(&self, request: pb::TopUpsRequest) -> Result<pb::TopUpsResponse>;
    /// Stores a queued media job (its hold placed already).
    async fn submit_job(&self, request: pb::SubmitJobRequest) -> Result<pb::Job>;
    /// Leases jobs to a worker: open ones, and finished ones whose charge
    /// is not recorded yet.
    async fn claim_jobs(&self, request: pb::ClaimJobsRequest) -> Result<pb::ClaimJobsResponse>;
    /// A worker's report; a final state charges the job (once).
    async fn update_job(&self, request: pb::UpdateJobRequest) -> Result<pb::Job>;
    /// The owner's job (and its media).
    async fn get_job(&self, request: pb::GetJobRequest) -> Result<pb::Job>;
    /// The owner is done with the job: its media is deleted, and a job
    /// still open is cancelled.
    async fn complete_job(&self, request: pb::CompleteJobRequest) -> Result<pb::Job>;
}

/// A charge as a hold and then its settlement ([`BillingService::charge`]).
async fn hold_then_settle<B: BillingService + ?Sized>(
    billing: &B,
    request: pb::ChargeRequest,
) -> Result<pb::ChargeResponse> {
    let usage = request.usage.unwrap_or_default();
    let hold = request
        .hold
        .ok_or_else(|| Error::invalid("a charge carries its hold"))?;
    let settle = pb::SettleRequest {
        request_id: hold.request_id.clone(),
        model_id: hold.model_id.clone(),
        usage: Some(usage),
        owner: hold.owner.clone(),
        key_id: request.key_id,
        key_limit: hold.key_limit.clone(),
        ..Default::default()
    };
    let held = billing.hold(hold).await?;
    if !held.placed {
        return Ok(pb::ChargeResponse {
            hold: Some(held),
            cost: None,
        });
    }
    let cost = if held.reserved {
        billing
            .settle(pb::SettleRequest {
                held_usd: held.held_usd.clone(),
                held_diem: held.held_diem.clone(),
                key_period: held.key_period.clone(),
                ..settle
            })
            .await?
    } else {
        // Nothing reserved (a free model): nothing to charge.
        pb::Cost {
            usd: "0".to_owned(),
            diem: "0".to_owned(),
        }
    };
    Ok(pb::ChargeResponse {
        hold: Some(held),
        cost: Some(cost),
    })
}

/// A cloneable handle on billing, local or remote.
#[derive(Clone)]
pub struct BillingClient(Arc<dyn BillingService>);

impl BillingClient {
    pub fn new(service: impl BillingService) -> Self {
        Self(Arc::new(service))
    }

    /// The billing of this process, when this client is it (a
    /// configuration reload changes its prices).
    pub fn local(&self) -> Option<&LocalBilling> {
        (self.0.as_ref() as &dyn std::any::Any).downcast_ref()
    }
}

impl std::ops::Deref for BillingClient {
    type Target = dyn BillingService;

    fn deref(&self) -> &Self::Target {
        self.0.as_ref()
    }
}

impl std::fmt::Debug for BillingClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BillingClient")
    }
}

/// Each model's prices, by id.
fn price_table(models: &[ModelConfig]) -> HashMap<String, Prices> {
    models
        .iter()
        .map(|m| (m.id.clone(), Prices::from_model(m)))
        .collect()
}

/// USD prices of one model per million tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Prices {
    pub input: Decimal,
    pub output: Decimal,
    pub cached_input: Decimal,
    pub cache_write: Decimal,
}

/// What the `model_id` of an augment endpoint's hold starts with
/// (`augment/search`): no tokens to price, only the extra it names.
pub const AUGMENT_PREFIX: &str = "augment/";

/// What the `model_id` of a crypto RPC proxy's hold starts with
/// (`crypto-rpc/ethereum-mainnet`): priced per credit, all extra.
pub const CRYPTO_RPC_PREFIX: &str = "crypto-rpc/";

impl Prices {
    /// Tokens cost nothing (an augment endpoint's charge is its extra).
    pub const FREE: Prices = Prices {
        input: Decimal::ZERO,
        output: Decimal::ZERO,
        cached_input: Decimal::ZERO,
        cache_write: Decimal::ZERO,
    };

    pub fn from_model(model: &ModelConfig) -> Self {
        let input = price_decimal(model.input_usd_per_mtok);
        Self {
            input,
            output: price_decimal(model.output_usd_per_mtok),
            // Without a cache price, cached tokens cost what input costs.
            cached_input: model.cached_input_usd_per_mtok.map_or(input, price_decimal),
            cache_write: model.cache_write_usd_per_mtok.map_or(input, price_decimal),
        }
    }

    /// Exact USD cost of `usage`.
    pub fn cost(&self, usage: &pb::Usage) -> Decimal {
        let cached = usage.cached_prompt_tokens.min(usage.prompt_tokens);
        let written = usage.cache_write_tokens.min(usage.prompt_tokens - cached);
        let plain = usage.prompt_tokens - cached - written;
        // Saturating: token counts come from backends, and a product past
        // the decimal's range would panic (it is refused as out of range
        // when turned into nano-units).
        let per_mtok = Decimal::from(plain)
            .saturating_mul(self.input)
            .saturating_add(Decimal::from(cached).saturating_mul(self.cached_input))
            .saturating_add(Decimal::from(written).saturating_mul(self.cache_write))
            .saturating_add(Decimal::from(usage.completion_tokens).saturating_mul(self.output));
        let extra = Decimal::from(usage.extra_usd_nanos) / Decimal::from(NANOS);
        (per_mtok / Decimal::from(1_000_000u32))
            .saturating_add(extra)
            .normalize()
    }
}

/// What the ledger charges when it settles `usage` against a hold of
/// `held_usd` and `held_diem` (DIEM first) when the hold covers it and
/// nothing is owed; the ledger charges any excess from the rest of the
/// balance later. The gateway reports it as `cost` when it had to queue
/// the settlement.
pub fn expected_cost(
    prices: &Prices,
    usage: &pb::Usage,
    held_usd: &str,
    held_diem: &str,
) -> Result<pb::Cost> {
    let cost = to_nanos(prices.cost(usage))?;
    let held_diem = parse_amount("held_diem", held_diem)?;
    let held_usd = parse_amount("held_usd", held_usd)?;
    let diem = cost.min(held_diem);
    let usd = (cost - diem).min(held_usd);
    Ok(pb::Cost {
        usd: from_nanos(usd),
        diem: from_nanos(diem),
    })
}

/// The ledger owner of an account (wallets get `wallet:<address>`).
pub fn account_owner(account_id: &str) -> String {
    ["account:", account_id].concat()
}

/// The ledger owner of a signed-in wallet (EIP-55 or base58 address).
pub fn wallet_owner(address: &str) -> String {
    ["wallet:", address].concat()
}

/// Nano-units per unit of USD or DIEM in the ledger.
const NANOS: i64 = 1_000_000_000;

/// How often closed holds past their retention are deleted.
const FORGET_CLOSED_HOLDS_EVERY: std::time::Duration = std::time::Duration::from_secs(3600);

/// A decimal amount as ledger nano-units, rounded up (a cost of a fraction
/// of a nano-dollar is charged as one).
pub fn to_nanos(amount: Decimal) -> Result<i64> {
    use rust_decimal::prelude::ToPrimitive;
    // Checked: an amount from a request may be as large as a decimal goes,
    // and an overflowing product panics (found by the property below).
    amount
        .checked_mul(Decimal::from(NANOS))
        .map(|nanos| nanos.ceil())
        .and_then(|nanos| nanos.to_i64())
        .ok_or_else(|| Error::invalid("amount out of range"))
}

/// Ledger nano-units as an exact decimal string (`"1.5"`, `"0"`,
/// `"-0.000000001"`): what `Decimal::new(nanos, 9).normalize()` writes,
/// digit by digit into a buffer, then one allocation of its length (a
/// priced request writes eight of these; `Decimal`'s way cost ~650
/// instructions each, `fmt`'s padded integers ~500, pushing each digit
/// into the `String` ~250).
pub fn from_nanos(nanos: i64) -> String {
    const NANOS_PER_UNIT: u64 = 1_000_000_000;
    // `-`, 10 whole digits (i64::MIN is -9,223,372,036.854775808 units),
    // `.`, 9 decimals: 21 at most.
    let mut text = [0u8; 24];
    let mut end = text.len();
    let magnitude = nanos.unsigned_abs();
    let (mut whole, mut fraction) = (magnitude / NANOS_PER_UNIT, magnitude % NANOS_PER_UNIT);
    if fraction > 0 {
        let mut width = 9;
        while fraction % 10 == 0 {
            fraction /= 10;
            width -= 1;
        }
        for _ in 0..width {
            end -= 1;
            text[end] = b'0' + (fraction % 10) as u8;
            fraction /= 10;
        }
        end -= 1;
        text[end] = b'.';
    }
    loop {
        end -= 1;
        text[end] = b'0' + (whole % 10) as u8;
        whole /= 10;
        if whole == 0 {
            break;
        }
    }
    if nanos < 0 {
        end -= 1;
        text[end] = b'-';
    }
    // ASCII digits, `.` and `-`: always UTF-8.
    std::str::from_utf8(&text[end..])
        .unwrap_or_default()
        .to_owned()
}

fn balance_pb(balance: &ledger::Balance) -> pb::Balance {
    pb::Balance {
        usd: from_nanos(balance.usd_net()),
        diem: from_nanos(balance.diem),
        usd_held: from_nanos(balance.usd_held),
        diem_held: from_nanos(balance.diem_held),
        diem_per_day: "0".to_owned(),
    }
}

/// A decimal amount from the wire: non-negative, at most nine decimals.
pub fn parse_amount(field: &str, text: &str) -> Result<i64> {
    let text = if text.trim().is_empty() {
        "0"
    } else {
        text.trim()
    };
    let amount: Decimal = text.parse().map_err(|_| {
        Error::invalid(format!(
            "{field} must be a decimal amount such as \"10.00\""
        ))
    })?;
    // Plain decimals only: digits, at most one point with digits on both
    // sides (the parser would also take "1_000", "+1" or ".5").
    let plain = match text.split_once('.') {
        None => text.bytes().all(|b| b.is_ascii_digit()),
        Some((whole, fraction)) => {
            !whole.is_empty()
                && !fraction.is_empty()
                && whole.bytes().all(|b| b.is_ascii_digit())
                && fraction.bytes().all(|b| b.is_ascii_digit())
        }
    };
    if amount.is_sign_negative() || amount.scale() > 9 {
        return Err(Error::invalid(format!(
            "{field} must be zero or more, with at most 9 decimals"
        )));
    }
    if !plain {
        return Err(Error::invalid(format!(
            "{field} must be a decimal amount such as \"10.00\""
        )));
    }
    to_nanos(amount)
}

/// A key's limit as the ledger enforces it, in the period of `now_ms`.
fn key_cap(limit: &pb::KeyLimit, now_ms: i64) -> Result<ledger::KeyCap> {
    let period = ledger::period_key(&limit.period, now_ms)
        .ok_or_else(|| Error::invalid("limitPeriod must be one of EPOCH, MONTH or LIFETIME"))?;
    Ok(ledger::KeyCap {
        key_id: limit.key_id.clone(),
        period,
        usd: limit.usd_nanos,
        diem: limit.diem_nanos,
    })
}

/// In-process billing over the configured price table and the ledger.
#[derive(Debug)]
pub struct LocalBilling {
    /// Each model's prices, replaced whole by a configuration reload
    /// ([`LocalBilling::reload`]); read once per call, without a lock.
    prices: ArcSwap<HashMap<String, Prices>>,
    ledger: ledger::Ledger,
    hold_ttl_ms: i64,
    /// The owners this process decides for, in memory ([`book`]), and
    /// their durable writer.
    book: book::Book,
    x402: x402::X402,
    /// Where top-ups are announced (`<prefix>.billing.topups`).
    events: Option<rialto_core::bus::Bus>,
    /// Asynchronous media jobs.
    jobs: jobs::JobStore,
    /// Responses kept for `previous_response_id`.
    responses: responses::ResponseStore,
}

/// Subject of top-up events, after the bus prefix: one JSON object per
/// credit applied (`{owner, usd, diem, reference, source}`, source
/// `operator` or `x402`), for dashboards, notifications and audits.
pub const TOPUPS_SUBJECT: &str = "billing.topups";

impl LocalBilling {
    pub fn new(config: &rialto_core::Config, db: rialto_core::db::Database) -> Self {
        Self::with_book(config, db, book::Book::start)
    }

    /// Billing for one operator's command (the CLI's `credit`, `set-stake`):
    /// the ledger's log stays with `rialto serve`, which may be running.
    pub fn for_command(config: &rialto_core::Config, db: rialto_core::db::Database) -> Self {
        Self::with_book(config, db, book::Book::start_unlogged)
    }

    fn with_book(
        config: &rialto_core::Config,
        db: rialto_core::db::Database,
        start: fn(rialto_core::db::Database, i64) -> book::Book,
    ) -> Self {
        Self {
            prices: ArcSwap::from_pointee(price_table(&config.models)),
            x402: x402::X402::new(&config.x402, db.clone()),
            jobs: jobs::JobStore::new(db.clone(), config.media.retention_hours),
            responses: responses::ResponseStore::new(db.clone()),
            book: start(
                db.clone(),
                (config.billing.stream_lease_secs as i64).saturating_mul(1000),
            ),
            ledger: ledger::Ledger::new(db),
            hold_ttl_ms: (config.billing.hold_ttl_secs as i64).saturating_mul(1000),
            events: None,
        }
    }

    /// Announces every top-up applied on `bus`.
    pub fn with_events(mut self, bus: rialto_core::bus::Bus) -> Self {
        self.events = Some(bus);
        self
    }

    /// Publishes a top-up event; a bus that is down loses the event, never
    /// the credit (the ledger has it).
    async fn announce_top_up(&self, event: serde_json::Value) {
        if let Some(bus) = &self.events
            && let Err(error) = bus
                .publish(bus.subject(TOPUPS_SUBJECT), event.to_string().into())
                .await
        {
            tracing::warn!(%error, "top-up event not published");
        }
    }

    /// Expires holds past their time (a stream's is charged its last
    /// checkpoint), drops idle owners, and, after a restart, loads owners
    /// whose streams' holds outlived their lease so they are charged: for
    /// ever, every second. Every hour (and at start), deletes the closed
    /// holds whose streams began over 30 days ago
    /// ([`recovery::CLOSED_HOLD_RETENTION_MS`]).
    pub fn spawn_sweeper(&self) {
        let book = self.book.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(std::time::Duration::from_secs(1));
            let mut ticks = 0u64;
            loop {
                every.tick().await;
                if ticks.is_multiple_of(5)
                    && let Err(error) = book.recover(rialto_core::db::now_ms()).await
                {
                    tracing::warn!(%error, "cannot recover open holds");
                }
                ticks += 1;
                match book.sweep(rialto_core::db::now_ms()) {
                    0 => {}
                    n => tracing::info!(holds = n, "expired holds"),
                }
            }
        });
        // Apart from the sweep, which must not wait for it: after an
        // upgrade its first run deletes every closed hold of a stream that
        // began over 30 days ago.
        let book = self.book.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(FORGET_CLOSED_HOLDS_EVERY);
            loop {
                every.tick().await;
                match book.forget_closed_holds(rialto_core::db::now_ms()).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(holds = n, "deleted closed holds past their retention"),
                    Err(error) => tracing::warn!(%error, "cannot delete closed holds"),
                }
            }
        });
    }

    /// The in-memory ledger (for tests and benchmarks).
    pub fn book(&self) -> &book::Book {
        &self.book
    }

    /// The database ledger (reads, credits).
    pub fn ledger(&self) -> &ledger::Ledger {
        &self.ledger
    }

    fn prices(&self, model_id: &str) -> Result<Prices> {
        if model_id.starts_with(AUGMENT_PREFIX) || model_id.starts_with(CRYPTO_RPC_PREFIX) {
            // An augment endpoint's or an RPC call's charge is all extra.
            return Ok(Prices::FREE);
        }
        self.prices
            .load()
            .get(model_id)
            .cloned()
            .ok_or_else(|| Error::new(ErrorCode::ModelNotFound, "Specified model not found"))
    }

    /// Puts the prices of `config`'s catalog in force, at once for every
    /// call that starts after it. A hold records its amount, not its
    /// prices: holds already placed keep what they reserved, and a
    /// settlement is priced at the prices in force when it is settled. A
    /// model the new catalog drops keeps its last prices here, so what is
    /// still running on it (a long stream) settles and checkpoints; the
    /// gateway no longer admits requests for it.
    pub fn reload(&self, config: &rialto_core::Config) {
        let mut table = price_table(&config.models);
        for (id, prices) in self.prices.load().iter() {
            table.entry(id.clone()).or_insert_with(|| prices.clone());
        }
        self.prices.store(Arc::new(table));
    }
}

#[async_trait]
impl BillingService for LocalBilling {
    async fn quote(&self, request: pb::QuoteRequest) -> Result<pb::Cost> {
        let usage = request.usage.unwrap_or_default();
        Ok(pb::Cost {
            usd: self.prices(&request.model_id)?.cost(&usage).to_string(),
            diem: "0".to_owned(),
        })
    }

    async fn hold(&self, request: pb::HoldRequest) -> Result<pb::HoldResponse> {
        let prices = self.prices(&request.model_id)?;
        let most = prices.cost(&pb::Usage {
            prompt_tokens: request.prompt_tokens,
            completion_tokens: request.max_completion_tokens,
            extra_usd_nanos: request.extra_usd_nanos,
            ..Default::default()
        });
        let now = rialto_core::db::now_ms();
        let expires = now.saturating_add(self.hold_ttl_ms);
        let cap = match &request.key_limit {
            Some(limit) => Some(key_cap(limit, now)?),
            None => None,
        };
        let order = book::HoldOrder {
            request_id: &request.request_id,
            amount: to_nanos(most)?,
            expires_at_ms: expires,
            cap: cap.as_ref(),
            durable: request.durable,
            model_id: &request.model_id,
        };
        let outcome = self.book.hold(&request.owner, &order).await?;
        let key_period = cap.map(|c| c.period).unwrap_or_default();
        Ok(match outcome {
            ledger::HoldOutcome::Placed { usd, diem, before } => pb::HoldResponse {
                placed: true,
                before: Some(balance_pb(&before)),
                reserved: usd > 0 || diem > 0,
                held_usd: from_nanos(usd),
                held_diem: from_nanos(diem),
                key_limit_reached: String::new(),
                key_period,
            },
            ledger::HoldOutcome::KeyLimitReached { before, currency } => pb::HoldResponse {
                placed: false,
                before: Some(balance_pb(&before)),
                key_limit_reached: currency.to_owned(),
                ..Default::default()
            },
            ledger::HoldOutcome::Insufficient { before } => pb::HoldResponse {
                placed: false,
                before: Some(balance_pb(&before)),
                ..Default::default()
            },
            // A retry of a request already holding: it may go on.
            ledger::HoldOutcome::Duplicate => pb::HoldResponse {
                placed: true,
                reserved: true,
                ..Default::default()
            },
        })
    }

    async fn settle(&self, request: pb::SettleRequest) -> Result<pb::Cost> {
        let usage = request.usage.unwrap_or_default();
        let cost = self.prices(&request.model_id)?.cost(&usage);
        if request.owner.is_empty() {
            return Err(Error::invalid("a settlement names its ledger owner"));
        }
        let key = Some((request.key_id.as_str(), request.key_period.as_str()))
            .filter(|(id, period)| !id.is_empty() && !period.is_empty());
        let cap = key
            .and(request.key_limit.as_ref())
            .map(|limit| (limit.usd_nanos, limit.diem_nanos));
        let order = book::SettleOrder {
            spent_by: &request.key_id,
            request_id: &request.request_id,
            cost: to_nanos(cost)?,
            model_id: &request.model_id,
            prompt_tokens: i64::try_from(usage.prompt_tokens).unwrap_or(i64::MAX),
            completion_tokens: i64::try_from(usage.completion_tokens).unwrap_or(i64::MAX),
            key,
            cap,
            rest: false,
        };
        let settled = self.book.settle(&request.owner, &order).await?;
        match settled {
            ledger::SettleOutcome::Settled { usd, diem, .. } => Ok(pb::Cost {
                usd: from_nanos(usd),
                diem: from_nanos(diem),
            }),
            // Settled before (a retry), or nothing was held (free model):
            // report what was charged, if anything.
            ledger::SettleOutcome::NotOpen => {
                self.book.caught_up_with(&request.owner).await?;
                let mut settled = self.ledger.settled(&request.request_id).await?;
                let short = order.cost - settled.usd - settled.diem;
                if settled.expired && short > 0 {
                    // A stream's hold expired at its checkpoint before its
                    // usage record arrived (billing was down or hung, and
                    // the record waited in the durable queue): the rest of
                    // its cost, once.
                    let rest = book::SettleOrder {
                        spent_by: "",
                        cost: short,
                        rest: true,
                        ..order
                    };
                    self.book.settle(&request.owner, &rest).await?;
                    self.book.caught_up_with(&request.owner).await?;
                    settled = self.ledger.settled(&request.request_id).await?;
                }
                Ok(pb::Cost {
                    usd: from_nanos(settled.usd),
                    diem: from_nanos(settled.diem),
                })
            }
        }
    }

    async fn charge(&self, request: pb::ChargeRequest) -> Result<pb::ChargeResponse> {
        let (request_id, owner) = request
            .hold
            .as_ref()
            .map(|hold| (hold.request_id.clone(), hold.owner.clone()))
            .unwrap_or_default();
        let mut charged = hold_then_settle(self, request).await?;
        if charged.cost.is_none() {
            // A charge asked again (the replica that made it died before
            // it answered, and the next one is asked) finds the balance it
            // paid from spent: it was charged, not refused.
            self.book.caught_up_with(&owner).await?;
            let settled = self.ledger.settled(&request_id).await?;
            if settled.usd > 0 || settled.diem > 0 {
                let hold = charged.hold.get_or_insert_default();
                hold.placed = true;
                hold.reserved = true;
                charged.cost = Some(pb::Cost {
                    usd: from_nanos(settled.usd),
                    diem: from_nanos(settled.diem),
                });
            }
        }
        Ok(charged)
    }

    async fn checkpoint(&self, request: pb::CheckpointRequest) -> Result<pb::CheckpointResponse> {
        let usage = request.usage.unwrap_or_default();
        let cost = to_nanos(self.prices(&request.model_id)?.cost(&usage))?;
        let tokens = (
            i64::try_from(usage.prompt_tokens).unwrap_or(i64::MAX),
            i64::try_from(usage.completion_tokens).unwrap_or(i64::MAX),
        );
        let recorded = self
            .book
            .checkpoint(&request.owner, &request.request_id, cost, tokens)
            .await?;
        Ok(pb::CheckpointResponse { recorded })
    }

    async fn credit(&self, request: pb::CreditRequest) -> Result<pb::CreditResponse> {
        let usd = parse_amount("usd", &request.usd)?;
        let diem = parse_amount("diem", &request.diem)?;
        let reference = request.reference.trim();
        if reference.is_empty() || reference.chars().count() > 200 {
            return Err(Error::invalid("reference must be 1 to 200 characters"));
        }
        let applied = self
            .ledger
            .credit(&request.owner, usd, diem, reference)
            .await?;
        self.book.refresh_now(&request.owner).await?;
        if applied {
            self.announce_top_up(serde_json::json!({
                "owner": request.owner, "usd": request.usd, "diem": request.diem,
                "reference": reference, "source": "operator",
            }))
            .await;
        }
        let balance = match self.book.current_snapshot(&request.owner).await? {
            Some(snapshot) => snapshot.balance,
            None => {
                self.book.caught_up_with(&request.owner).await?;
                self.ledger.balance(&request.owner).await?
            }
        };
        Ok(pb::CreditResponse {
            applied,
            balance: Some(balance_pb(&balance)),
        })
    }

    async fn get_balance(&self, request: pb::GetBalanceRequest) -> Result<pb::Balance> {
        let snapshot = match self.book.current_snapshot(&request.owner).await? {
            Some(snapshot) => snapshot,
            None => {
                self.book.caught_up_with(&request.owner).await?;
                self.ledger.snapshot(&request.owner).await?
            }
        };
        let mut balance = balance_pb(&snapshot.balance);
        balance.diem_per_day = from_nanos(snapshot.stake.unwrap_or(0));
        Ok(balance)
    }

    async fn set_stake(&self, request: pb::SetStakeRequest) -> Result<pb::Balance> {
        let per_day = parse_amount("diem_per_day", &request.diem_per_day)?;
        self.ledger.set_stake(&request.owner, per_day).await?;
        self.book.refresh_now(&request.owner).await?;
        self.get_balance(pb::GetBalanceRequest {
            owner: request.owner,
        })
        .await
    }

    async fn top_up(&self, request: pb::TopUpRequest) -> Result<pb::TopUpResponse> {
        let now_secs = u64::try_from(rialto_core::db::now_ms() / 1000).unwrap_or(0);
        match self
            .x402
            .top_up(&request.payment, &request.resource_url, now_secs)
            .await
        {
            Ok(top_up) => {
                self.book.refresh_now(&wallet_owner(&top_up.wallet)).await?;
                if top_up.applied {
                    self.announce_top_up(serde_json::json!({
                        "owner": wallet_owner(&top_up.wallet), "usd": top_up.amount_usd,
                        "diem": "0", "reference": top_up.payment_id, "source": "x402",
                    }))
                    .await;
                }
                Ok(pb::TopUpResponse {
                    ok: true,
                    wallet: top_up.wallet,
                    amount_usd: top_up.amount_usd,
                    new_balance_usd: top_up.new_balance_usd,
                    payment_id: top_up.payment_id,
                    settle_response_json: top_up.settle_response.to_string(),
                    applied: top_up.applied,
                    ..Default::default()
                })
            }
            Err(refused) => Ok(pb::TopUpResponse {
                ok: false,
                status: u32::from(refused.status),
                code: refused.code.to_owned(),
                message: refused.message,
                reason: refused.reason,
                ..Default::default()
            }),
        }
    }

    async fn transactions(
        &self,
        request: pb::TransactionsRequest,
    ) -> Result<pb::TransactionsResponse> {
        let limit = i64::from(request.limit.clamp(1, 100));
        let offset = i64::from(request.offset);
        self.book.caught_up_with(&request.owner).await?;
        let (movements, has_more) = self
            .ledger
            .usd_movements(&request.owner, limit, offset)
            .await?;
        let current = self.ledger.balance(&request.owner).await?.usd;
        Ok(pb::TransactionsResponse {
            current_balance: from_nanos(current),
            transactions: movements
                .into_iter()
                .map(|m| pb::Transaction {
                    id: m.id,
                    amount: from_nanos(m.amount),
                    balance_after: from_nanos(m.balance_after),
                    kind: if m.kind == "settle" {
                        "CHARGE"
                    } else {
                        "TOP_UP"
                    }
                    .to_owned(),
                    at_ms: m.at_ms,
                    request_id: m.request_id.unwrap_or_default(),
                    model_id: m.model_id.unwrap_or_default(),
                })
                .collect(),
            has_more,
        })
    }

    async fn top_ups(&self, request: pb::TopUpsRequest) -> Result<pb::TopUpsResponse> {
        let limit = i64::from(request.limit.clamp(1, 100));
        let (records, total) = self
            .ledger
            .top_ups(limit, i64::from(request.offset))
            .await?;
        Ok(pb::TopUpsResponse {
            top_ups: records
                .into_iter()
                .map(|r| pb::TopUpRecord {
                    id: r.id,
                    wallet: r.wallet,
                    network: r.network,
                    amount: from_nanos(r.amount_nanos),
                    state: r.state,
                    transaction_ref: r.transaction_ref.unwrap_or_default(),
                    created_at_ms: r.created_at_ms,
                    settled_at_ms: r.settled_at_ms,
                })
                .collect(),
            total: u64::try_from(total).unwrap_or(0),
        })
    }

    async fn key_spend(&self, request: pb::KeySpendRequest) -> Result<pb::KeySpendResponse> {
        let now = rialto_core::db::now_ms();
        self.book.caught_up_with(&request.owner).await?;
        let mut keys = Vec::with_capacity(request.keys.len());
        for limit in &request.keys {
            let cap = key_cap(limit, now)?;
            let (usd, diem) = self.ledger.key_spent(&cap.key_id, &cap.period).await?;
            keys.push(pb::KeySpend {
                key_id: cap.key_id,
                usd: from_nanos(usd),
                diem: from_nanos(diem),
            });
        }
        Ok(pb::KeySpendResponse { keys })
    }

    async fn usage_history(
        &self,
        request: pb::UsageHistoryRequest,
    ) -> Result<pb::UsageHistoryResponse> {
        let most = if request.walk { 1000 } else { 500 };
        let limit = i64::from(request.limit.clamp(1, most));
        let page = i64::from(request.page.max(1));
        self.book.caught_up_with(&request.owner).await?;
        let query = ledger::HistoryQuery {
            owner: &request.owner,
            currency: Some(request.currency.as_str()).filter(|c| !c.is_empty()),
            start_ms: request.start_ms,
            end_ms: request.end_ms,
            limit,
            offset: (page - 1).saturating_mul(limit),
            newest_first: request.newest_first,
        };
        let (records, total, more) = if request.walk {
            let after = Some((request.after_at_ms, request.after_id.as_str()))
                .filter(|(_, id)| !id.is_empty());
            let (records, more) = self.ledger.usage_walk(&query, after).await?;
            (records, 0, more)
        } else {
            let (records, total) = self.ledger.usage_history(&query).await?;
            (records, total, false)
        };
        let prices = self.prices.load();
        let entries = records
            .into_iter()
            .map(|r| {
                let prompt = u64::try_from(r.prompt_tokens).unwrap_or(0);
                let completion = u64::try_from(r.completion_tokens).unwrap_or(0);
                let tokens = prompt.saturating_add(completion);
                // The request's blended USD price per million tokens.
                let price = prices
                    .get(&r.model_id)
                    .filter(|_| tokens > 0)
                    .map(|p| {
                        let cost = p.cost(&pb::Usage {
                            prompt_tokens: prompt,
                            completion_tokens: completion,
                            ..Default::default()
                        });
                        (cost * Decimal::from(1_000_000u32) / Decimal::from(tokens))
                            .round_dp(9)
                            .normalize()
                            .to_string()
                    })
                    .unwrap_or_else(|| "0".to_owned());
                pb::UsageEntry {
                    id: r.id,
                    request_id: r.request_id,
                    model_id: r.model_id,
                    currency: r.currency,
                    amount: from_nanos(r.amount_nanos),
                    prompt_tokens: prompt,
                    completion_tokens: completion,
                    at_ms: r.at_ms,
                    price_per_mtok_usd: price,
                }
            })
            .collect();
        Ok(pb::UsageHistoryResponse {
            entries,
            total: u64::try_from(total).unwrap_or(0),
            more,
        })
    }

    async fn put_response(&self, request: pb::StoredResponse) -> Result<pb::PutResponseAck> {
        self.responses.put(request).await?;
        Ok(pb::PutResponseAck {})
    }

    async fn get_response(&self, request: pb::GetResponseRequest) -> Result<pb::StoredResponse> {
        self.responses.get(&request).await
    }

    async fn usage_analytics(
        &self,
        request: pb::UsageAnalyticsRequest,
    ) -> Result<pb::UsageAnalyticsResponse> {
        let owner = (!request.all_owners).then_some(request.owner.as_str());
        self.book.caught_up_for(owner).await?;
        let groups = self
            .ledger
            .usage_groups(owner, request.start_ms, request.end_ms)
            .await?
            .into_iter()
            .flat_map(|g| {
                // A group per currency that paid; the tokens and requests
                // once, with the first.
                let paid: Vec<(&str, i64)> = [("USD", g.usd_nanos), ("DIEM", g.diem_nanos)]
                    .into_iter()
                    .filter(|(_, nanos)| *nanos != 0)
                    .collect();
                paid.into_iter()
                    .enumerate()
                    .map(|(i, (currency, nanos))| pb::UsageGroup {
                        day: g.day,
                        model_id: g.model_id.clone(),
                        key_id: g.key_id.clone(),
                        currency: currency.to_owned(),
                        amount: from_nanos(nanos),
                        prompt_tokens: if i == 0 {
                            u64::try_from(g.prompt_tokens).unwrap_or(0)
                        } else {
                            0
                        },
                        completion_tokens: if i == 0 {
                            u64::try_from(g.completion_tokens).unwrap_or(0)
                        } else {
                            0
                        },
                        requests: if i == 0 {
                            u64::try_from(g.requests).unwrap_or(0)
                        } else {
                            0
                        },
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        Ok(pb::UsageAnalyticsResponse { groups })
    }

    async fn submit_job(&self, request: pb::SubmitJobRequest) -> Result<pb::Job> {
        let job = request
            .job
            .ok_or_else(|| Error::invalid("a job to submit is missing"))?;
        self.jobs.submit(job).await
    }

    async fn claim_jobs(&self, request: pb::ClaimJobsRequest) -> Result<pb::ClaimJobsResponse> {
        let claimed = self
            .jobs
            .claim(&request.worker, request.limit, request.lease_secs)
            .await?;
        Ok(pb::ClaimJobsResponse { jobs: claimed })
    }

    async fn update_job(&self, request: pb::UpdateJobRequest) -> Result<pb::Job> {
        let finished = self.jobs.update(&request).await?;
        self.settle_job(finished).await
    }

    async fn get_job(&self, request: pb::GetJobRequest) -> Result<pb::Job> {
        self.jobs.get(&request).await
    }

    async fn complete_job(&self, request: pb::CompleteJobRequest) -> Result<pb::Job> {
        let finished = self
            .jobs
            .complete(&request.id, &request.owner, &request.model_id)
            .await?;
        self.settle_job(finished).await
    }
}

impl LocalBilling {
    /// Sends a finished job's settlement to the ledger when it owes one,
    /// then records that it did; a job whose settlement failed is claimed
    /// again and sent again (the ledger applies it once).
    async fn settle_job(&self, finished: jobs::Finished) -> Result<pb::Job> {
        let jobs::Finished { mut job, settle } = finished;
        if settle {
            self.settle(jobs::settlement_of(&job)).await?;
            self.jobs.mark_settled(&job.id).await?;
            job.settled = true;
        }
        Ok(job)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(input: f64, output: f64) -> rialto_core::Config {
        let toml = format!(
            "[[models]]\nid = \"m\"\ninput_usd_per_mtok = {input}\noutput_usd_per_mtok = {output}\n"
        );
        rialto_core::Config::from_toml(&toml).unwrap()
    }

    fn model(input: f64, output: f64) -> ModelConfig {
        config(input, output).models[0].clone()
    }

    async fn billing(config: &rialto_core::Config) -> (tempfile::TempDir, LocalBilling) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/billing.db", dir.path().display());
        let db = rialto_core::db::Database::connect(&url, 4).await.unwrap();
        (dir, LocalBilling::new(config, db))
    }

    /// A credit applied is announced once on the bus; its replay is not.
    #[tokio::test]
    async fn top_ups_are_announced_once() {
        use futures_util::StreamExt;
        let (_dir, billing) = billing(&config(0.15, 0.6)).await;
        let bus = rialto_core::bus::Bus::in_process("test");
        let mut events = bus
            .subscribe(bus.subject(TOPUPS_SUBJECT), None)
            .await
            .unwrap();
        let billing = billing.with_events(bus);
        let credit = pb::CreditRequest {
            owner: "acct-1".into(),
            usd: "12.50".into(),
            diem: "0".into(),
            reference: "invoice-7".into(),
        };
        assert!(billing.credit(credit.clone()).await.unwrap().applied);
        assert!(!billing.credit(credit).await.unwrap().applied);
        let event: serde_json::Value =
            serde_json::from_slice(&events.next().await.unwrap()).unwrap();
        assert_eq!(event["owner"], "acct-1");
        assert_eq!(event["usd"], "12.50");
        assert_eq!(event["source"], "operator");
        let replay =
            tokio::time::timeout(std::time::Duration::from_millis(100), events.next()).await;
        assert!(replay.is_err(), "a replayed credit is not announced again");
    }

    /// A stream's hold expires at its checkpoint before its usage record
    /// arrives (billing was hung, the record waited in the durable queue):
    /// the record then charges the rest of the cost, once, so the stream
    /// is charged exactly what its answer reported.
    #[tokio::test]
    async fn a_stream_expired_before_its_usage_arrived_is_charged_the_rest() {
        let (_dir, billing) = billing(&config(1.0, 1.0)).await;
        let owner = "account:x".to_owned();
        billing
            .credit(pb::CreditRequest {
                owner: owner.clone(),
                usd: "1".into(),
                diem: "0".into(),
                reference: "seed".into(),
            })
            .await
            .unwrap();
        let placed = billing
            .hold(pb::HoldRequest {
                owner: owner.clone(),
                request_id: "s1".into(),
                model_id: "m".into(),
                prompt_tokens: 10,
                max_completion_tokens: 1000,
                key_limit: None,
                durable: true,
                extra_usd_nanos: 0,
            })
            .await
            .unwrap();
        assert!(placed.placed);
        let usage = |completion_tokens| pb::Usage {
            prompt_tokens: 10,
            completion_tokens,
            ..Default::default()
        };
        // 100 tokens so far, then the hold's lease ends unsettled.
        let checkpoint = billing
            .checkpoint(pb::CheckpointRequest {
                request_id: "s1".into(),
                owner: owner.clone(),
                model_id: "m".into(),
                usage: Some(usage(90)),
            })
            .await
            .unwrap();
        assert!(checkpoint.recorded);
        let later = rialto_core::db::now_ms() + 3_600_000;
        assert_eq!(billing.book().sweep(later), 1);
        billing.book().flush().await.unwrap();
        assert_eq!(billing.ledger().charged("s1").await.unwrap(), (100_000, 0));
        // The stream's usage record: 510 tokens in all.
        let settle = pb::SettleRequest {
            request_id: "s1".into(),
            model_id: "m".into(),
            usage: Some(usage(500)),
            owner: owner.clone(),
            ..Default::default()
        };
        let cost = billing.settle(settle.clone()).await.unwrap();
        assert_eq!(cost.usd, "0.00051");
        // Delivered again: nothing more.
        let again = billing.settle(settle).await.unwrap();
        assert_eq!(again.usd, "0.00051");
        assert_eq!(billing.ledger().charged("s1").await.unwrap(), (510_000, 0));
        let balance = billing.ledger().balance(&owner).await.unwrap();
        assert_eq!(balance.usd, 1_000_000_000 - 510_000);
        assert_eq!(
            balance,
            billing.ledger().journal_sums(&owner).await.unwrap()
        );
    }

    /// Every owner's spend, summed by day and model; one owner's alone
    /// without `all_owners`.
    #[tokio::test]
    async fn analytics_of_all_owners_sum_every_owner() {
        let (_dir, billing) = billing(&config(1.0, 1.0)).await;
        for (owner, completion) in [("account:a", 1000), ("wallet:0xb", 3000)] {
            billing
                .credit(pb::CreditRequest {
                    owner: owner.into(),
                    usd: "1".into(),
                    diem: "0".into(),
                    reference: "seed".into(),
                })
                .await
                .unwrap();
            let request_id = format!("r-{owner}");
            let hold = pb::HoldRequest {
                owner: owner.into(),
                request_id: request_id.clone(),
                model_id: "m".into(),
                prompt_tokens: 1000,
                max_completion_tokens: 5000,
                ..Default::default()
            };
            assert!(billing.hold(hold).await.unwrap().placed);
            let settle = pb::SettleRequest {
                request_id,
                model_id: "m".into(),
                usage: Some(pb::Usage {
                    prompt_tokens: 1000,
                    completion_tokens: completion,
                    ..Default::default()
                }),
                owner: owner.into(),
                ..Default::default()
            };
            billing.settle(settle).await.unwrap();
        }
        let now = rialto_core::db::now_ms();
        let analytics = |all_owners| pb::UsageAnalyticsRequest {
            owner: "account:a".into(),
            start_ms: now - 86_400_000,
            end_ms: now + 86_400_000,
            all_owners,
        };
        let all = billing.usage_analytics(analytics(true)).await.unwrap();
        let [group] = all.groups.as_slice() else {
            panic!("one group expected: {:?}", all.groups);
        };
        // $0.002 + $0.004 at $1/M.
        assert_eq!(
            (
                group.model_id.as_str(),
                group.currency.as_str(),
                group.amount.as_str()
            ),
            ("m", "USD", "0.006")
        );
        assert_eq!((group.prompt_tokens, group.completion_tokens), (2000, 4000));
        assert_eq!(group.requests, 2);
        let one = billing.usage_analytics(analytics(false)).await.unwrap();
        let [group] = one.groups.as_slice() else {
            panic!("one group expected: {:?}", one.groups);
        };
        assert_eq!((group.amount.as_str(), group.requests), ("0.002", 1));
    }

    /// The x402 payments received, newest first, a page at a time.
    #[tokio::test]
    async fn top_ups_are_listed_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/billing.db", dir.path().display());
        let db = rialto_core::db::Database::connect(&url, 4).await.unwrap();
        let billing = LocalBilling::new(&config(1.0, 1.0), db.clone());
        let empty = billing.top_ups(pb::TopUpsRequest::default()).await.unwrap();
        assert_eq!((empty.top_ups.len(), empty.total), (0, 0));
        let payments = [
            ("x402-1", "0xa", "settled", Some("0xt1"), 1_000, Some(1_500)),
            ("x402-2", "0xb", "settling", None, 2_000, None),
        ];
        for (id, wallet, state, transaction, created, settled) in payments {
            sqlx::query(
                "INSERT INTO x402_payments (id, payment_key, wallet, network, amount_nanos, \
                 state, transaction_ref, created_at_ms, settled_at_ms) \
                 VALUES ($1, $2, $3, 'eip155:8453', 2500000000, $4, $5, $6, $7)",
            )
            .bind(id)
            .bind(format!("key-{id}"))
            .bind(wallet)
            .bind(state)
            .bind(transaction)
            .bind(created)
            .bind(settled)
            .execute(db.pool())
            .await
            .unwrap();
        }
        let page = |limit, offset| pb::TopUpsRequest { limit, offset };
        let listed = billing.top_ups(page(0, 0)).await.unwrap();
        assert_eq!(listed.total, 2);
        assert_eq!(
            listed.top_ups,
            [pb::TopUpRecord {
                id: "x402-2".into(),
                wallet: "0xb".into(),
                network: "eip155:8453".into(),
                amount: "2.5".into(),
                state: "settling".into(),
                transaction_ref: String::new(),
                created_at_ms: 2_000,
                settled_at_ms: None,
            }],
            "a limit of 0 is 1"
        );
        let next = billing.top_ups(page(10, 1)).await.unwrap();
        let [settled] = next.top_ups.as_slice() else {
            panic!("one top-up expected: {:?}", next.top_ups);
        };
        assert_eq!(settled.id, "x402-1");
        assert_eq!(settled.transaction_ref, "0xt1");
        assert_eq!(settled.settled_at_ms, Some(1_500));
        assert_eq!(next.total, 2);
    }

    #[tokio::test]
    async fn quotes_are_exact() {
        let (_dir, billing) = billing(&config(0.15, 0.6)).await;
        let cost = billing
            .quote(pb::QuoteRequest {
                model_id: "m".into(),
                usage: Some(pb::Usage {
                    prompt_tokens: 612,
                    completion_tokens: 146,
                    ..Default::default()
                }),
            })
            .await
            .unwrap();
        // 612 * 0.15 / 1e6 + 146 * 0.6 / 1e6 = 0.0000918 + 0.0000876
        assert_eq!(cost.usd, "0.0001794");
        assert_eq!(cost.diem, "0");
    }

    /// A reload changes the prices of what follows: an open hold keeps its
    /// amount, its settlement is priced at the prices in force, and a model
    /// the new catalog drops still settles at its last prices.
    #[tokio::test]
    async fn a_reload_prices_what_follows_and_keeps_open_holds() {
        let (_dir, billing) = billing(&config(1.0, 1.0)).await;
        let client = BillingClient::new(billing);
        let billing = client.local().expect("a local billing is found again");
        let owner = "account:r".to_owned();
        billing
            .credit(pb::CreditRequest {
                owner: owner.clone(),
                usd: "1".into(),
                diem: "0".into(),
                reference: "seed".into(),
            })
            .await
            .unwrap();
        let hold = |id: &str| pb::HoldRequest {
            owner: owner.clone(),
            request_id: id.into(),
            model_id: "m".into(),
            prompt_tokens: 10,
            max_completion_tokens: 990,
            ..Default::default()
        };
        let before = billing.hold(hold("h1")).await.unwrap();
        assert_eq!(before.held_usd, "0.001");
        billing.reload(&config(3.0, 3.0));
        let after = billing.hold(hold("h2")).await.unwrap();
        assert_eq!(after.held_usd, "0.003");
        let quote = |model: &str| pb::QuoteRequest {
            model_id: model.into(),
            usage: Some(pb::Usage {
                prompt_tokens: 1_000_000,
                ..Default::default()
            }),
        };
        assert_eq!(billing.quote(quote("m")).await.unwrap().usd, "3");
        // h1 was held at the old prices; it settles at the new ones.
        let settle = |id: &str| pb::SettleRequest {
            request_id: id.into(),
            model_id: "m".into(),
            usage: Some(pb::Usage {
                prompt_tokens: 10,
                completion_tokens: 90,
                ..Default::default()
            }),
            owner: owner.clone(),
            ..Default::default()
        };
        assert_eq!(billing.settle(settle("h1")).await.unwrap().usd, "0.0003");
        // The catalog drops `m` for `n`: `n` is priced, and `m`, still
        // running, settles at its last prices.
        let renamed = rialto_core::Config::from_toml(
            "[[models]]\nid = \"n\"\ninput_usd_per_mtok = 5\noutput_usd_per_mtok = 5\n",
        )
        .unwrap();
        billing.reload(&renamed);
        assert_eq!(billing.quote(quote("n")).await.unwrap().usd, "5");
        assert_eq!(billing.settle(settle("h2")).await.unwrap().usd, "0.0003");
        billing.book().flush().await.unwrap();
        let balance = billing.ledger().balance(&owner).await.unwrap();
        assert_eq!(balance.usd, 1_000_000_000 - 600_000);
        assert_eq!(
            balance,
            billing.ledger().journal_sums(&owner).await.unwrap()
        );
    }

    #[test]
    fn cached_tokens_use_the_cache_price() {
        let mut config = model(1.0, 2.0);
        config.cached_input_usd_per_mtok = Some(0.1);
        let prices = Prices::from_model(&config);
        let usage = pb::Usage {
            prompt_tokens: 1_000_000,
            cached_prompt_tokens: 500_000,
            completion_tokens: 0,
            cache_write_tokens: 0,
            extra_usd_nanos: 0,
        };
        assert_eq!(prices.cost(&usage).to_string(), "0.55");
    }

    #[tokio::test]
    async fn holds_cover_the_most_a_request_can_cost_and_settle_the_real_usage() {
        let (_dir, billing) = billing(&config(1.0, 2.0)).await;
        let owner = "account:a".to_owned();
        let credit = |usd: &str, diem: &str, reference: &str| pb::CreditRequest {
            owner: owner.clone(),
            usd: usd.into(),
            diem: diem.into(),
            reference: reference.into(),
        };
        billing
            .credit(credit("0.003", "0.001", "seed"))
            .await
            .unwrap();
        let hold = |id: &str| pb::HoldRequest {
            owner: owner.clone(),
            request_id: id.into(),
            model_id: "m".into(),
            prompt_tokens: 1000,
            max_completion_tokens: 1000,
            key_limit: None,
            durable: false,
            extra_usd_nanos: 0,
        };
        // At most 1000 * $1/M + 1000 * $2/M = $0.003: fits in 0.001 DIEM + $0.003.
        let placed = billing.hold(hold("r1")).await.unwrap();
        assert!(placed.placed);
        assert_eq!(placed.before.unwrap().usd, "0.003");
        // The rest ($0.001) cannot cover another.
        assert!(!billing.hold(hold("r2")).await.unwrap().placed);
        let usage = pb::Usage {
            prompt_tokens: 500,
            completion_tokens: 500,
            ..Default::default()
        };
        let settle = pb::SettleRequest {
            request_id: "r1".into(),
            model_id: "m".into(),
            usage: Some(usage),
            owner: owner.clone(),
            ..Default::default()
        };
        // $0.0015: 0.001 DIEM first, then $0.0005.
        let cost = billing.settle(settle.clone()).await.unwrap();
        assert_eq!((cost.usd.as_str(), cost.diem.as_str()), ("0.0005", "0.001"));
        // A retry charges nothing more and reports the same split.
        assert_eq!(billing.settle(settle).await.unwrap(), cost);
        let balance = billing
            .get_balance(pb::GetBalanceRequest {
                owner: owner.clone(),
            })
            .await
            .unwrap();
        assert_eq!(
            (balance.usd.as_str(), balance.diem.as_str()),
            ("0.0025", "0")
        );
        assert_eq!(balance.usd_held, "0");
        // Bad amounts are refused with a clear message.
        for amount in ["-1", "1_000", "+1", ".5", "1.", "1e3", "ten"] {
            let bad = billing
                .credit(credit(amount, "0", "bad"))
                .await
                .unwrap_err();
            assert_eq!(bad.code, ErrorCode::InvalidRequest, "{amount}");
        }
        // References are per owner: another account's same reference counts.
        let other = pb::CreditRequest {
            owner: "account:b".into(),
            ..credit("1", "0", "seed")
        };
        assert!(billing.credit(other).await.unwrap().applied);
        let bad = billing
            .credit(credit("1.0000000001", "0", "fine"))
            .await
            .unwrap_err();
        assert!(bad.message.contains("9 decimals"));
    }

    /// A charge holds and settles in one: its cost is the real usage's, a
    /// refusal holds and charges nothing, and 1,000 raced against a balance
    /// for 10 charge exactly 10.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn charges_hold_and_settle_at_once_and_serve_ten_of_a_thousand() {
        let (_dir, billing) = billing(&config(1.0, 2.0)).await;
        let billing = Arc::new(billing);
        let owner = "account:charged".to_owned();
        billing
            .credit(pb::CreditRequest {
                owner: owner.clone(),
                usd: "0.03".into(),
                diem: "0".into(),
                reference: "seed".into(),
            })
            .await
            .unwrap();
        // At most $0.003 (1000 tokens each way), and it used all of it.
        let charge = |id: String| pb::ChargeRequest {
            hold: Some(pb::HoldRequest {
                owner: owner.clone(),
                request_id: id,
                model_id: "m".into(),
                prompt_tokens: 1000,
                max_completion_tokens: 1000,
                ..Default::default()
            }),
            usage: Some(pb::Usage {
                prompt_tokens: 1000,
                completion_tokens: 1000,
                ..Default::default()
            }),
            key_id: "key".into(),
        };
        let charges = (0..1000).map(|i| {
            let billing = Arc::clone(&billing);
            let request = charge(format!("r{i}"));
            tokio::spawn(async move { billing.charge(request).await })
        });
        let mut served = Vec::new();
        for (i, charged) in futures_util::future::join_all(charges)
            .await
            .into_iter()
            .enumerate()
        {
            let charged = charged.unwrap().unwrap();
            let hold = charged.hold.unwrap();
            match charged.cost {
                Some(cost) => {
                    assert!(hold.placed);
                    assert_eq!((cost.usd.as_str(), cost.diem.as_str()), ("0.003", "0"));
                    served.push(format!("r{i}"));
                }
                None => assert!(!hold.placed && hold.key_limit_reached.is_empty()),
            }
        }
        assert_eq!(served.len(), 10);
        let emptied = async || {
            let balance = billing
                .get_balance(pb::GetBalanceRequest {
                    owner: owner.clone(),
                })
                .await
                .unwrap();
            assert_eq!(
                (balance.usd.as_str(), balance.usd_held.as_str()),
                ("0", "0")
            );
        };
        emptied().await;
        // A charge made and asked again (its answer lost, the next replica
        // asked): the balance it spent refuses its hold, and it answers
        // what it was charged, once, rather than a refusal.
        let again = billing.charge(charge(served[0].clone())).await.unwrap();
        assert!(again.hold.unwrap().placed);
        assert_eq!(again.cost.unwrap().usd, "0.003");
        emptied().await;
        // A charge with no hold in it is refused, clearly.
        let bad = billing
            .charge(pb::ChargeRequest::default())
            .await
            .unwrap_err();
        assert_eq!(bad.code, ErrorCode::InvalidRequest);
    }

    /// Through the ledger actors: a balance for 10 of 1,000 concurrent
    /// holds; each placed hold settled twice at once, charged once; the
    /// cached balance agrees with the database throughout.
    #[actix_rt::test]
    async fn ledger_actors_serve_ten_of_a_thousand() {
        let config = config(1.0, 0.0);
        let (_dir, billing) = billing(&config).await;
        let billing = Arc::new(billing);
        let owner = "account:actors".to_owned();
        billing
            .credit(pb::CreditRequest {
                owner: owner.clone(),
                usd: "0.01".into(),
                diem: "0".into(),
                reference: "seed".into(),
            })
            .await
            .unwrap();
        // Read once: the actor caches the row before the burst.
        let before = billing
            .get_balance(pb::GetBalanceRequest {
                owner: owner.clone(),
            })
            .await
            .unwrap();
        assert_eq!(before.usd, "0.01");
        // Each hold is 1,000 input tokens at $1/M = $0.001.
        let holds = (0..1000).map(|i| {
            let billing = billing.clone();
            let owner = owner.clone();
            async move {
                let hold = pb::HoldRequest {
                    owner,
                    request_id: format!("a{i}"),
                    model_id: "m".into(),
                    prompt_tokens: 1000,
                    max_completion_tokens: 0,
                    key_limit: None,
                    durable: false,
                    extra_usd_nanos: 0,
                };
                (i, billing.hold(hold).await.unwrap())
            }
        });
        let placed: Vec<usize> = futures_util::future::join_all(holds)
            .await
            .into_iter()
            .filter(|(_, hold)| hold.placed)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(placed.len(), 10);
        let settles = placed.iter().flat_map(|i| {
            let request = pb::SettleRequest {
                request_id: format!("a{i}"),
                model_id: "m".into(),
                usage: Some(pb::Usage {
                    prompt_tokens: 500,
                    ..Default::default()
                }),
                owner: owner.clone(),
                ..Default::default()
            };
            [request.clone(), request].map(|request| {
                let billing = billing.clone();
                async move { billing.settle(request).await.unwrap() }
            })
        });
        for cost in futures_util::future::join_all(settles).await {
            assert_eq!(cost.usd, "0.0005");
        }
        let cached = billing
            .get_balance(pb::GetBalanceRequest {
                owner: owner.clone(),
            })
            .await
            .unwrap();
        assert_eq!(
            (cached.usd.as_str(), cached.usd_held.as_str()),
            ("0.005", "0")
        );
        let stored = billing.ledger.balance(&owner).await.unwrap();
        assert_eq!(stored, billing.ledger.journal_sums(&owner).await.unwrap());
        assert_eq!(from_nanos(stored.usd), "0.005");
    }

    #[tokio::test]
    async fn unknown_models_have_no_price() {
        let (_dir, billing) = billing(&config(1.0, 1.0)).await;
        let error = billing
            .quote(pb::QuoteRequest {
                model_id: "nope".into(),
                usage: None,
            })
            .await
            .unwrap_err();
        assert_eq!(error.code, ErrorCode::ModelNotFound);
    }
}

/// Properties of the amounts on the wire.
#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nanos_at_the_edges_are_written_as_their_normalized_decimal() {
        for nanos in [
            0,
            1,
            -1,
            10,
            1_000_000_000,
            -1_000_000_000,
            1_500_000_000,
            123_456_789_000,
            i64::MAX,
            i64::MIN,
        ] {
            assert_eq!(
                from_nanos(nanos),
                Decimal::new(nanos, 9).normalize().to_string(),
                "{nanos}"
            );
        }
        assert_eq!(from_nanos(-1), "-0.000000001");
        assert_eq!(from_nanos(1_500_000_000), "1.5");
    }

    proptest! {
        /// Any usage a backend reports is a cost or out of range, never a
        /// panic, at any configured price.
        #[test]
        fn any_usage_has_a_cost_or_is_out_of_range(
            prompt in any::<u64>(),
            completion in any::<u64>(),
            cached in any::<u64>(),
            price in 0u64..=u64::MAX,
        ) {
            let price = Decimal::from(price);
            let prices = Prices { input: price, output: price, cached_input: price, cache_write: price };
            let usage = pb::Usage {
                prompt_tokens: prompt,
                completion_tokens: completion,
                cached_prompt_tokens: cached,
                ..Default::default()
            };
            let _ = to_nanos(prices.cost(&usage));
        }

        /// Nano-units are written as `Decimal` writes them, normalized.
        #[test]
        fn nanos_are_written_as_their_normalized_decimal(nanos in any::<i64>()) {
            prop_assert_eq!(from_nanos(nanos), Decimal::new(nanos, 9).normalize().to_string());
        }

        /// Nano-units written as a decimal read back exactly.
        #[test]
        fn nanos_round_trip_through_their_decimal(nanos in any::<i64>()) {
            let text = from_nanos(nanos);
            let back = to_nanos(text.parse::<Decimal>().unwrap()).unwrap();
            prop_assert_eq!(back, nanos);
        }

        /// Any decimal string is an amount or a refusal, never a panic;
        /// an amount is never less than what was asked (rounded up).
        #[test]
        fn any_amount_text_is_read_or_refused(text in "-?[0-9]{0,30}(\\.[0-9]{0,30})?") {
            if let Ok(amount) = text.parse::<Decimal>()
                && let Ok(nanos) = to_nanos(amount)
            {
                let exact = amount.checked_mul(Decimal::from(NANOS));
                prop_assert!(exact.is_some_and(|exact| Decimal::from(nanos) >= exact));
            }
        }
    }
}
