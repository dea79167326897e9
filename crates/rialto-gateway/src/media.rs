//! What the image and audio endpoints share: finding a model of the right
//! type, a hold of the most a request can cost in the model's unit (images,
//! characters, seconds), the call through the router, and the charge of
//! the units the backend delivered.
//!
//! A media model's tokens cost nothing: its price is the hold's and the
//! settlement's extra, so the ledger, the key caps and the wallet headers
//! work as for a chat.

use std::sync::Arc;

use actix_web::{HttpRequest, HttpResponse, HttpResponseBuilder};
use futures_util::StreamExt;
use rialto_core::ErrorCode;
use rialto_proto::auth::v1 as auth_pb;
use rialto_proto::router::v1 as router_pb;
use rust_decimal::Decimal;
use serde_json::{Map, Value};

use crate::chat::{
    Admitted, Cost, Priced, Reservation, Settlement, Usage, admit, balance_remaining, model_headers,
};
use crate::headers::RequestId;
use crate::{ApiError, Catalog, Details, Gateway, ModelEntry};

/// The model a request names, which must be one of `types`; with
/// `fallback`, a missing or unknown name (an OpenAI model's) is the
/// default model of the first type, as the hosted OpenAI-shaped routes do.
pub(crate) fn model_of(
    gateway: &Gateway,
    requested: Option<&str>,
    types: &[&str],
    fallback: bool,
) -> Result<Arc<ModelEntry>, ApiError> {
    let catalog = gateway.catalog();
    let found = requested.and_then(|id| catalog.model(id));
    let of_type = |m: &&Arc<ModelEntry>| types.contains(&m.config.model_type.as_str());
    match (found, requested) {
        (Some(model), _) if of_type(&model) => Ok(Arc::clone(model)),
        (Some(model), _) if !fallback => {
            let mut details = Details::new();
            details.push(
                &["model"],
                format!(
                    "{} is not a model of type {}",
                    model.config.id,
                    types.join(" or ")
                ),
            );
            Err(ApiError::validation(details))
        }
        (None, Some(_)) if !fallback => Err(ApiError::new(
            ErrorCode::ModelNotFound,
            "Specified model not found",
        )),
        _ => default_model(&catalog, types[0]).cloned().ok_or_else(|| {
            ApiError::new(
                ErrorCode::ModelNotFound,
                format!("No {} model is configured on this server", types[0]),
            )
        }),
    }
}

/// The model of `model_type` with the `default` trait, else the first.
pub(crate) fn default_model<'c>(
    catalog: &'c Catalog,
    model_type: &str,
) -> Option<&'c Arc<ModelEntry>> {
    let mut of_type = catalog
        .models
        .iter()
        .filter(|m| m.config.model_type == model_type);
    let first = of_type.clone().next();
    of_type
        .find(|m| m.config.traits.iter().any(|t| t == "default"))
        .or(first)
}

/// USD nano-units of `units` at `usd_per_unit`, rounded up to the nano;
/// no units (or fewer) cost nothing, and an amount past the ledger's range
/// is its largest (refused by the hold as more than any balance).
pub(crate) fn nanos(usd_per_unit: f64, units: Decimal) -> u64 {
    if units <= Decimal::ZERO {
        return 0;
    }
    let price = rialto_core::config::price_decimal(usd_per_unit);
    price
        .checked_mul(units)
        .and_then(|usd| rialto_billing::to_nanos(usd).ok())
        .and_then(|nanos| u64::try_from(nanos).ok())
        .unwrap_or(i64::MAX as u64)
}

/// A media request the limiter admitted and the ledger holds its most for.
/// It owns what it needs (no borrow of the gateway), so its exchange can
/// run in a task of its own ([`detached`]).
pub(crate) struct Metered {
    model_id: String,
    settlement: Settlement,
    wallet_usd_before: Option<Decimal>,
    request_id: String,
}

/// A backend's answer to a media call.
pub(crate) struct Delivered {
    pub(crate) body: Vec<u8>,
    backend: String,
    retry_count: u32,
}

/// A media request charged: what its response's headers say.
pub(crate) struct Charged {
    cost: Cost,
    backend: String,
    retry_count: u32,
    wallet_usd_before: Option<Decimal>,
}

impl Charged {
    /// A 200 with the model's headers and a wallet's balance after the
    /// charge.
    pub(crate) fn response(&self, gateway: &Gateway, model: &ModelEntry) -> HttpResponseBuilder {
        let mut response = HttpResponse::Ok();
        model_headers(
            &mut response,
            gateway,
            model,
            &self.backend,
            self.retry_count,
        );
        balance_remaining(&mut response, self.wallet_usd_before, &self.cost);
        response
    }
}

/// Admits a request to `model` in its class's window and holds
/// `most_nanos` (429 and 402 as for a chat). Not a stream's durable hold,
/// which lives on checkpoints for a cost that grows: a media request's
/// most is known, and a gateway that dies in the middle leaves its hold to
/// expire (`billing.hold_ttl_secs`).
pub(crate) async fn meter(
    gateway: &Gateway,
    request: &HttpRequest,
    principal: &auth_pb::Principal,
    model: &ModelEntry,
    most_nanos: u64,
) -> Result<Metered, ApiError> {
    let request_id = RequestId::of(request);
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
            prompt_tokens: 0,
            total_tokens: 0,
            durable: false,
            extra_usd_nanos: most_nanos,
            limiter_extra_tokens: 0,
            charged_after: false,
        },
        None,
    )
    .await?;
    Ok(Metered {
        model_id: model.config.id.clone(),
        settlement,
        wallet_usd_before,
        request_id,
    })
}

/// Runs a metered exchange (the backend's call, the checks, the charge) in
/// a task of its own, as a chat's: a client that leaves cancels neither the
/// backend's work nor its charge, and no hold is left to expire.
pub(crate) async fn detached<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::spawn(work).await.map_err(|e| {
        ApiError::from(rialto_core::Error::internal(format!(
            "a media exchange's task failed: {e}"
        )))
    })?
}

/// A backend's refusal, with `x-<brand>-is-content-violation` when its
/// content policy refused.
fn refused(gateway: &Gateway, error: rialto_core::Error) -> ApiError {
    let error = ApiError::from(error);
    if error.code() == ErrorCode::ContentViolation {
        return error.with_header(
            gateway.brand.header_is_content_violation.clone(),
            "true".to_owned(),
        );
    }
    error
}

impl Metered {
    fn request(&self, path: &str, body: &Map<String, Value>) -> router_pb::MediaRequest {
        router_pb::MediaRequest {
            request_id: self.request_id.clone(),
            model_id: self.model_id.clone(),
            path: path.to_owned(),
            // Serializing a map of JSON values cannot fail.
            body_json: serde_json::to_vec(body).unwrap_or_default(),
            files: Vec::new(),
            method: String::new(),
            backend: String::new(),
        }
    }

    /// The settlement a job made of this request will send when it
    /// finishes.
    pub(crate) fn job_settlement(&self) -> rialto_proto::billing::v1::SettleRequest {
        self.settlement.job_settlement()
    }

    /// The request is now a stored job, which owns its hold; a wallet's
    /// balance before it, for `X-Balance-Remaining`.
    pub(crate) fn handed_to_job(mut self) -> Option<Decimal> {
        self.settlement.handed_to_job();
        self.wallet_usd_before
    }

    /// The request id its hold is under (a job's queue id follows it).
    pub(crate) fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Nothing was asked of a backend after all (an image to fetch could
    /// not be): the hold is released.
    pub(crate) fn release(mut self) {
        self.settlement.release();
    }

    /// Sends the call to the model's backends (`body` as JSON, or with
    /// `files` as a form); a failure releases the hold.
    pub(crate) async fn call(
        &mut self,
        gateway: &Gateway,
        path: &str,
        body: &Map<String, Value>,
        files: Vec<router_pb::MediaFile>,
    ) -> Result<Delivered, ApiError> {
        let request = router_pb::MediaRequest {
            files,
            ..self.request(path, body)
        };
        match gateway.services.router.media(request).await {
            Ok(answer) => Ok(Delivered {
                body: answer.body,
                backend: answer.backend,
                retry_count: answer.retry_count,
            }),
            Err(error) => {
                self.settlement.release();
                Err(refused(gateway, error))
            }
        }
    }

    /// The backend answered what cannot be passed on: nothing delivered,
    /// nothing charged.
    pub(crate) fn unusable(mut self, why: &str) -> ApiError {
        tracing::warn!(model = self.model_id, why, "unusable media answer");
        self.settlement.release();
        crate::chat::invalid_answer()
    }

    /// Charges `used_nanos` (what was delivered).
    pub(crate) async fn bill(
        mut self,
        delivered: &Delivered,
        used_nanos: u64,
    ) -> Result<Charged, ApiError> {
        self.settlement.extra_usd_nanos = used_nanos;
        let cost = self.settlement.bill(&Usage::none()).await?;
        Ok(Charged {
            cost,
            backend: delivered.backend.clone(),
            retry_count: delivered.retry_count,
            wallet_usd_before: self.wallet_usd_before,
        })
    }

    /// Relays a streamed media call (speech sent as it is made), in a task
    /// of its own: the response starts once a backend accepted the call,
    /// and its bytes pass as they arrive. `price_nanos` is charged once the
    /// stream ends whole, or once the client leaves it (or stops reading
    /// for `reader_patience`) after some of it reached the client; nothing
    /// when nothing did, or when the backend breaks it off (the client's
    /// connection is then broken too: its audio is not whole).
    pub(crate) async fn relay(
        self,
        gateway: &actix_web::web::Data<Gateway>,
        model: &ModelEntry,
        path: &str,
        body: &Map<String, Value>,
        content_type: &'static str,
        price_nanos: u64,
    ) -> Result<HttpResponse, ApiError> {
        use router_pb::media_stream_event::Event;
        type Chunks = tokio::sync::mpsc::Receiver<Result<bytes::Bytes, std::io::Error>>;
        let request = self.request(path, body);
        let (started_sender, started) =
            tokio::sync::oneshot::channel::<Result<(router_pb::MediaStart, Chunks), ApiError>>();
        let task_gateway = gateway.clone();
        let Metered {
            mut settlement,
            wallet_usd_before,
            ..
        } = self;
        tokio::spawn(async move {
            let gateway = task_gateway;
            let opened = match gateway.services.router.media_stream(request).await {
                Ok(mut events) => match events.next().await {
                    Some(Ok(router_pb::MediaStreamEvent {
                        event: Some(Event::Start(start)),
                    })) => Ok((start, events)),
                    Some(Err(error)) => Err(refused(&gateway, error)),
                    _ => Err(crate::chat::invalid_answer()),
                },
                Err(error) => Err(refused(&gateway, error)),
            };
            let (start, mut events) = match opened {
                Ok(opened) => opened,
                Err(error) => {
                    settlement.release();
                    let _ = started_sender.send(Err(error));
                    return;
                }
            };
            let (sender, receiver) = tokio::sync::mpsc::channel(16);
            if started_sender.send(Ok((start, receiver))).is_err() {
                // The client left before the first byte.
                settlement.release();
                return;
            }
            let (mut sent, mut broken) = (0usize, false);
            while let Some(event) = events.next().await {
                let data = match event {
                    Ok(router_pb::MediaStreamEvent {
                        event: Some(Event::Data(data)),
                    }) => data,
                    Ok(_) => continue,
                    Err(error) => {
                        broken = true;
                        let _ = sender.try_send(Err(std::io::Error::other(error.message)));
                        break;
                    }
                };
                let length = data.len();
                let delivery = sender.send(Ok(bytes::Bytes::from(data)));
                match tokio::time::timeout(gateway.reader_patience, delivery).await {
                    Ok(Ok(())) => sent += length,
                    // The client left, or stopped reading.
                    _ => break,
                }
            }
            if broken || sent == 0 {
                settlement.release();
            } else {
                settlement.extra_usd_nanos = price_nanos;
                settlement.bill_later(&Usage::none());
            }
        });
        let (start, receiver) = started.await.map_err(|_| crate::chat::invalid_answer())??;
        let mut response = HttpResponse::Ok();
        model_headers(
            &mut response,
            gateway,
            model,
            &start.backend,
            start.retry_count,
        );
        // The price is known before the stream: the balance after it too.
        balance_remaining(
            &mut response,
            wallet_usd_before,
            &Cost::usd_nanos(price_nanos),
        );
        let body = futures_util::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|item| (item, receiver))
        });
        Ok(response.content_type(content_type).streaming(body))
    }
}

/// The `Content-Type` of an audio or image format name.
pub(crate) fn content_type_of(format: &str) -> &'static str {
    match format {
        "png" => "image/png",
        "jpeg" => "image/jpeg",
        "webp" => "image/webp",
        "mp3" => "audio/mpeg",
        "opus" => "audio/opus",
        "aac" => "audio/aac",
        "flac" => "audio/flac",
        "wav" => "audio/wav",
        "pcm" => "audio/pcm",
        _ => "application/octet-stream",
    }
}

/// Puts the members that are present (optional request members passed on)
/// into an upstream body.
pub(crate) fn insert_present<V: Into<Value>>(
    upstream: &mut Map<String, Value>,
    members: impl IntoIterator<Item = (&'static str, Option<V>)>,
) {
    for (name, value) in members {
        if let Some(value) = value {
            upstream.insert(name.into(), value.into());
        }
    }
}

/// A prompt of 1 to `limit` characters (not only white space), or a 400.
pub(crate) fn checked_prompt(prompt: Option<String>, limit: usize) -> Result<String, ApiError> {
    match prompt {
        Some(prompt) if !prompt.trim().is_empty() && prompt.chars().count() <= limit => Ok(prompt),
        _ => Err(crate::augment::invalid_at(
            &["prompt"],
            format!("String must contain 1 to {limit} character(s)"),
        )),
    }
}

/// Members of a body outside `known`, as the hosted API's strict schemas
/// refuse them.
pub(crate) fn unknown_members(body: &Map<String, Value>, known: &[&str], details: &mut Details) {
    let unknown: Vec<String> = body
        .keys()
        .filter(|k| !known.contains(&k.as_str()))
        .map(|k| format!("'{k}'"))
        .collect();
    if !unknown.is_empty() {
        details.push(
            &[],
            format!("Unrecognized key(s) in object: {}", unknown.join(", ")),
        );
    }
}

/// Checks of optional members, each failure a per-field message.
pub(crate) struct Members<'a> {
    pub(crate) body: &'a Map<String, Value>,
    pub(crate) details: &'a mut Details,
}

impl Members<'_> {
    fn present(&self, name: &str) -> Option<&Value> {
        self.body.get(name).filter(|v| !v.is_null())
    }

    /// Whether the member is there and not null.
    pub(crate) fn present_member(&self, name: &str) -> bool {
        self.present(name).is_some()
    }

    /// A string of `min..=max` characters.
    pub(crate) fn text(&mut self, name: &str, min: usize, max: usize) -> Option<String> {
        let value = self.present(name)?;
        match value.as_str() {
            Some(text) if (min..=max).contains(&text.chars().count()) => Some(text.to_owned()),
            Some(_) => {
                self.details.push(
                    &[name],
                    format!("String must contain {min} to {max} character(s)"),
                );
                None
            }
            None => {
                self.details.push(&[name], "Expected string");
                None
            }
        }
    }

    /// One of `choices`.
    pub(crate) fn choice(&mut self, name: &str, choices: &[&str]) -> Option<String> {
        let value = self.present(name)?;
        match value.as_str() {
            Some(text) if choices.contains(&text) => Some(text.to_owned()),
            _ => {
                let expected: Vec<String> = choices.iter().map(|c| format!("'{c}'")).collect();
                self.details.push(
                    &[name],
                    format!("Invalid enum value. Expected {}", expected.join(" | ")),
                );
                None
            }
        }
    }

    /// An integer in `min..=max`.
    pub(crate) fn integer(&mut self, name: &str, min: i64, max: i64) -> Option<i64> {
        let value = self.present(name)?;
        match value.as_i64() {
            Some(n) if (min..=max).contains(&n) => Some(n),
            _ => {
                self.details
                    .push(&[name], format!("Expected an integer from {min} to {max}"));
                None
            }
        }
    }

    /// A number in `min..=max` (`min` itself excluded when `open`).
    pub(crate) fn number(&mut self, name: &str, min: f64, max: f64, open: bool) -> Option<f64> {
        let value = self.present(name)?;
        match value.as_f64() {
            Some(n) if n <= max && (n > min || (!open && n == min)) => Some(n),
            _ => {
                let from = if open { "above" } else { "from" };
                self.details
                    .push(&[name], format!("Expected a number {from} {min} to {max}"));
                None
            }
        }
    }

    pub(crate) fn boolean(&mut self, name: &str) -> Option<bool> {
        let value = self.present(name)?;
        match value.as_bool() {
            Some(flag) => Some(flag),
            None => {
                self.details.push(&[name], "Expected boolean");
                None
            }
        }
    }
}
