//! `POST /api/v1/chat/completions`: validation, the service parameters, and
//! the relay of the router's answer as JSON or as SSE.
//!
//! Path of a request: authenticate -> validate -> limiter admits -> router
//! relays to a backend -> billing prices the usage -> the response carries
//! `cost`, the echoed `<brand>_parameters` and the model headers -> the
//! limiter commits the real tokens.
//!
//! This module keeps the HTTP side: the request read and planned, the
//! router asked, a whole answer written. The rest is one concern a file:
//! - `metering`: the money, handed to the limiter's and billing's clients
//!   (the admission and the hold before the call, the settlement after it);
//!   every priced endpoint uses it, not only chat;
//! - `stream`: a streamed answer relayed as SSE, with its checkpoints and
//!   its ending (usage, `cost`, `[DONE]`);
//! - `turns`: a worker's stream reads, a few after each poll of its I/O
//!   driver, so a new stream waits behind a few chunks, not a burst;
//! - `chunks`: one upstream chunk read (the fast path and the tree);
//! - `whole`: a whole answer read and written as ours (the same two ways);
//! - `validate`: the body's checks and the prompt's estimate;
//! - `echo`: the `<brand>_parameters` a chat's answer echoes.

mod chunks;
mod echo;
mod metering;
mod stream;
mod turns;
mod validate;
mod whole;

use std::sync::Arc;

use actix_web::{HttpMessage, HttpRequest, HttpResponse, HttpResponseBuilder, web};
use rialto_core::ErrorCode;
use rialto_limiter::{Admission, Target};
use rialto_proto::auth::v1 as auth_pb;
use rialto_proto::billing::v1 as billing_pb;
use rialto_proto::router::v1 as router_pb;
use serde_json::{Value, json};

use crate::augment;
use crate::headers::RequestId;
use crate::{
    ApiError, Details, Gateway, ModelEntry, RateLimitHeaders, authenticate, header_value,
    parse_json, read_body,
};
pub(crate) use echo::Echo;
use metering::BALANCE_REMAINING;
pub(crate) use metering::{
    Admitted, Cost, PendingSettlement, Priced, Reservation, Settlement, Usage, admit,
    balance_remaining, pending_settlements, settle_later,
};
use stream::stream;
use validate::{tokenizer_excess, validate};

/// What validation learned about a request.
struct Chat {
    model_id: String,
    stream: bool,
    /// The effective `<brand>_parameters`, echoed in the response.
    parameters: Echo,
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

/// `x-retry-count`: how many times the router sent the request again
/// before a backend answered; absent when the first attempt did.
const RETRY_COUNT: &str = "x-retry-count";

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
    // The futures awaited here are boxed where they are large or rare: a
    // future holds its largest state, and each one enclosing it is moved
    // (copied) when it is made and when actix boxes the handler, so an
    // unboxed stream's or file's state would be copied on every request.
    let limited = if has_files {
        let admission = Box::pin(files_admitted(
            gateway,
            request,
            principal,
            model,
            &request_id,
            &chat,
        ));
        let admission = admission.await?;
        if let Err(error) = Box::pin(convert_files(&mut body, &mut chat, gateway)).await {
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
    } = Box::pin(admit(
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
    ))
    .await?;

    // Boxed: moved into the answer's task or the stream's relay, and held
    // by every future on the way (an async fn keeps its arguments twice).
    let exchange = Box::new(Exchange {
        completion_id: ["chatcmpl-", &request_id].concat(),
        request_id,
        chat,
        settlement,
        wallet_usd_before,
        checkpoint_every: gateway.checkpoint_every,
        reader_patience: gateway.reader_patience,
        web,
        found: augment::Outcome::default(),
    });
    match route {
        Route::Later(router_request) if exchange.chat.stream => {
            Box::pin(stream(gateway, model, router_request, exchange)).await
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

pub(crate) fn invalid_answer() -> ApiError {
    ApiError::new(
        ErrorCode::UpstreamFailed,
        "The model's backend sent an invalid answer",
    )
}

/// A non-streamed answer, billed: what the response is built from.
struct Answered {
    /// Ours, as JSON.
    body: Vec<u8>,
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
    exchange: Box<Exchange>,
) -> Result<HttpResponse, ApiError> {
    // The backend's work and its settlement run as a task of their own: a
    // client that leaves meanwhile drops this handler but not the task, so
    // what the backend did is still charged (a dropped settlement would
    // leave the hold to expire free).
    let task = tokio::spawn({
        let gateway = gateway.clone();
        let model = Arc::clone(model);
        // In the request's span: the router's call continues its trace.
        // Boxed: the answer's state is kilobytes, and tokio moves a task's
        // future (and its stage, as large) several times between spawning
        // it and reading its output; a box is moved instead.
        tracing::Instrument::instrument(
            Box::pin(async move {
                // The balance before the request, when its charge told it
                // (a route asked ahead, which no hold answered before): on
                // the response whether it was served or refused.
                let mut balance = None;
                let answered = answer(&gateway, &model, route, exchange, &mut balance).await;
                (answered, balance)
            }),
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
    Ok(response
        .content_type(actix_web::http::header::ContentType::json())
        .body(answered.body))
}

/// Asks the router for the whole answer, bills it, and shapes the body.
/// `balance` gets the balance before the request when the charge told it.
async fn answer(
    gateway: &Gateway,
    model: &ModelEntry,
    route: Route,
    exchange: Box<Exchange>,
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
    let documents = exchange
        .web
        .as_ref()
        .and_then(|plan| augment::documents_call(plan, &exchange.found));
    let mut read =
        whole::Answer::read(&answer.body_json, documents.as_ref()).ok_or_else(invalid_answer)?;
    let usage = read.usage(exchange.chat.prompt_tokens_estimate);
    let billed = exchange.settlement.bill(&usage).await;
    *balance = exchange.settlement.balance_before.take();
    let cost = billed?;
    if let Some(plan) = &exchange.web {
        augment::echo(&mut exchange.chat.parameters, plan, &exchange.found);
    }
    let balance_remaining = exchange
        .wallet_usd_before
        .map(|before| cost.usd_left(before));
    let body = read.write(&whole::Ours {
        id: &exchange.completion_id,
        model: model_id,
        usage: &usage.json,
        cost: &cost,
        brand: &gateway.brand,
        parameters: &exchange.chat.parameters,
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

fn now() -> i64 {
    chrono::Utc::now().timestamp()
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
    // A file part that cannot be read is the request's fault, named by
    // where it is.
    let refused = |(m, p, why): (usize, usize, String)| {
        let mut details = Details::new();
        let (m, p) = (m.to_string(), p.to_string());
        details.push(&["messages", &m, "content", &p, "file"], why);
        ApiError::validation(details)
    };
    crate::files::fetch_urls(messages, allow_private)
        .await
        .map_err(refused)?;
    crate::files::convert(messages, &gateway.converter)
        .await
        .map_err(refused)?;
    // The files' text is prompt too (four characters a token, as above).
    let after: usize = messages.iter().map(|m| m.to_string().len()).sum();
    let added = (after.saturating_sub(before) as u64).div_ceil(4);
    chat.prompt_tokens_estimate = chat.prompt_tokens_estimate.saturating_add(added);
    chat.estimated_tokens = chat.estimated_tokens.saturating_add(added);
    Ok(())
}
