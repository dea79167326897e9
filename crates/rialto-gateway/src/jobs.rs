//! Asynchronous media jobs: `POST /video/queue|retrieve|quote|complete`,
//! `POST /audio/queue|retrieve|quote|complete`, and the worker pool that
//! runs the jobs.
//!
//! A queue request is admitted (the `video` or `audio` class) and holds the
//! job's price like any media request; the job is then stored by billing
//! (`SubmitJob`, a row of `media_jobs`) before the queue id is answered,
//! and the hold becomes the job's. Any gateway's workers claim queued jobs
//! with a lease (`media.job_lease_secs`), renew it while they work, and
//! report the result; billing charges a job when it completes, once, and
//! releases its hold when it fails or its owner cancels it. A gateway that
//! dies mid-job loses nothing: when its lease runs out the job is claimed
//! again, and a video job resumes polling the backend job it started.
//!
//! Video runs on OpenAI's video API (`POST /videos`, `GET /videos/{id}`,
//! `GET /videos/{id}/content`) on the backend that accepted the job (the
//! router pins the polls to it). Queued audio is a `tts` model's speech
//! (`/audio/speech`), made by a worker rather than while the client waits.
//! Jobs queued through one gateway wake the workers of all at once through
//! `<prefix>.media.jobs` when the bus is shared; workers also poll every
//! `media.job_poll_ms`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use actix_web::{HttpRequest, HttpResponse, web};
use futures_util::StreamExt;
use rialto_billing::jobs::{self as states, is_open};
use rialto_core::ErrorCode;
use rialto_proto::auth::v1 as auth_pb;
use rialto_proto::billing::v1 as billing_pb;
use rialto_proto::router::v1 as router_pb;
use rust_decimal::Decimal;
use serde_json::{Map, Value, json};

use crate::augment::{invalid_at, object_body};
use crate::media::{self, Members, unknown_members};
use crate::{ApiError, Details, Gateway, ModelEntry, authenticate};

/// Subject of job wake-ups, after the bus prefix.
pub const JOBS_SUBJECT: &str = "media.jobs";

/// Longest video prompt where the model sets no `prompt_character_limit`.
const DEFAULT_VIDEO_PROMPT_CHARS: usize = 2500;
/// Longest speech a job makes, in characters (a chapter, not a tweet: the
/// reason to queue it rather than wait).
const MAX_QUEUED_SPEECH_CHARS: usize = 100_000;
/// Members of the hosted video request this server does not offer: named
/// in a refusal rather than ignored.
const UNSUPPORTED_VIDEO_MEMBERS: &[&str] = &[
    "consents",
    "omni_reference_task_type",
    "upscale_factor",
    "image_url",
    "end_image_url",
    "audio_url",
    "video_url",
    "reference_image_urls",
    "reference_video_urls",
    "reference_audio_urls",
    "reference_document_urls",
    "elements",
    "scene_image_urls",
    "keyframes",
];
const VIDEO_MEMBERS: &[&str] = &[
    "model",
    "prompt",
    "negative_prompt",
    "duration",
    "aspect_ratio",
    "resolution",
    "audio",
];
const UNSUPPORTED_AUDIO_MEMBERS: &[&str] = &[
    "lyrics_prompt",
    "duration_seconds",
    "force_instrumental",
    "lyrics_optimizer",
    "loop",
];
const AUDIO_MEMBERS: &[&str] = &["model", "prompt", "voice", "language_code", "speed"];

/// The two kinds of job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Video,
    Audio,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Self::Video => "video",
            Self::Audio => "audio",
        }
    }

    fn model_types(self) -> &'static [&'static str] {
        match self {
            Self::Video => &["video"],
            Self::Audio => &["tts"],
        }
    }

    /// The limiter class of `retrieve` and `complete` (polls must not eat
    /// the queue's window).
    fn poll_class(self) -> &'static str {
        match self {
            Self::Video => "video_retrieve",
            Self::Audio => "audio",
        }
    }
}

/// A validated video request: what the backend is asked, and its price.
struct VideoOrder {
    seconds: u32,
    size: String,
}

fn refuse_unsupported(
    body: &Map<String, Value>,
    unsupported: &[&str],
    model: &str,
    details: &mut Details,
) {
    for name in unsupported {
        if body.get(*name).is_some_and(|v| !v.is_null()) {
            details.push(&[name], format!("{name} is not supported by {model}"));
        }
    }
}

/// `duration`, `resolution` and `aspect_ratio` against the model's, with
/// the model's defaults.
fn video_order(
    model: &ModelEntry,
    members: &mut Members<'_>,
    required_duration: bool,
) -> Option<VideoOrder> {
    let config = &model.config;
    let durations = config.video_durations();
    let choices: Vec<String> = durations.iter().map(|d| format!("{d}s")).collect();
    let choices: Vec<&str> = choices.iter().map(String::as_str).collect();
    let duration = members.choice("duration", &choices);
    if duration.is_none() && required_duration && !members.present_member("duration") {
        members.details.push(&["duration"], "Required");
    }
    let resolution = members.choice("resolution", &config.video_resolutions());
    let ratio = members.choice("aspect_ratio", &config.aspect_ratios());
    let seconds = match duration {
        Some(duration) => duration.trim_end_matches('s').parse().ok()?,
        None => *durations.first()?,
    };
    let resolution = resolution.unwrap_or_else(|| config.video_resolutions()[0].to_owned());
    let ratio = ratio.unwrap_or_else(|| config.aspect_ratios()[0].to_owned());
    Some(VideoOrder {
        seconds,
        size: frame_size(&resolution, &ratio)?,
    })
}

/// OpenAI's `size` (`1280x720`) of a resolution and an aspect ratio: the
/// resolution is the shorter side, the longer one follows the ratio,
/// both even (what encoders need).
fn frame_size(resolution: &str, ratio: &str) -> Option<String> {
    let short = rialto_core::config::video_height(resolution)?;
    let (w, h) = rialto_core::config::aspect_ratio(ratio)?;
    let long = |short: u32, a: u32, b: u32| (u64::from(short) * u64::from(a) / u64::from(b)) as u32;
    let even = |n: u32| n.max(2) & !1;
    let (width, height) = if w >= h {
        (long(short, w, h), short)
    } else {
        (short, long(short, h, w))
    };
    Some(format!("{}x{}", even(width), even(height)))
}

fn video_price(model: &ModelEntry, seconds: u32) -> u64 {
    media::nanos(model.config.usd_per_video_second, Decimal::from(seconds))
}

fn speech_price(model: &ModelEntry, chars: usize) -> u64 {
    media::nanos(
        model.config.usd_per_thousand_characters,
        Decimal::from(chars) / Decimal::from(1000),
    )
}

/// `{"quote": <usd>}`, the number written digit for digit.
fn quote_response(nanos: u64) -> HttpResponse {
    let usd = rialto_billing::from_nanos(i64::try_from(nanos).unwrap_or(i64::MAX));
    let quote: Value = serde_json::from_str(&usd).unwrap_or(json!(0));
    HttpResponse::Ok().json(json!({ "quote": quote }))
}

/// `POST /video/quote`: the price of a video, from the model's price per
/// second (public, like the hosted one: it is arithmetic on the catalog).
pub async fn video_quote(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body = object_body(&gateway, &request, payload).await?;
    let mut details = Details::new();
    let mut members = Members {
        body: &body,
        details: &mut details,
    };
    let model_id = members.text("model", 1, 256);
    members.integer("upscale_factor", 1, 4);
    members.boolean("audio");
    members.text("video_url", 0, usize::MAX);
    members.number("reference_video_total_duration", 0.0, 150.0, false);
    if model_id.is_none() && !members.present_member("model") {
        details.push(&["model"], "Required");
    }
    details.into_result()?;
    let model = &media::model_of(
        &gateway,
        model_id.as_deref(),
        Kind::Video.model_types(),
        false,
    )?;
    let mut details = Details::new();
    let order = video_order(
        model,
        &mut Members {
            body: &body,
            details: &mut details,
        },
        true,
    );
    details.into_result()?;
    let order = order.ok_or_else(|| invalid_at(&["duration"], "Invalid duration"))?;
    Ok(quote_response(video_price(model, order.seconds)))
}

/// `POST /audio/quote`: the price of speech of `character_count`
/// characters.
pub async fn audio_quote(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body = object_body(&gateway, &request, payload).await?;
    let mut details = Details::new();
    unknown_members(
        &body,
        &["model", "duration_seconds", "character_count"],
        &mut details,
    );
    let mut members = Members {
        body: &body,
        details: &mut details,
    };
    let model_id = members.text("model", 1, 256);
    let chars = members.integer("character_count", 1, MAX_QUEUED_SPEECH_CHARS as i64);
    if body.get("duration_seconds").is_some_and(|v| !v.is_null()) {
        details.push(
            &["duration_seconds"],
            "duration_seconds is not supported: speech is priced by its characters",
        );
    }
    if model_id.is_none() && !body.contains_key("model") {
        details.push(&["model"], "Required");
    }
    if chars.is_none() && !body.contains_key("character_count") {
        details.push(
            &["character_count"],
            "Required: this model is priced per thousand characters",
        );
    }
    details.into_result()?;
    let model = &media::model_of(
        &gateway,
        model_id.as_deref(),
        Kind::Audio.model_types(),
        false,
    )?;
    let chars = usize::try_from(chars.unwrap_or(0)).unwrap_or(0);
    Ok(quote_response(speech_price(model, chars)))
}

/// `POST /video/queue`.
pub async fn video_queue(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let body = object_body(&gateway, &request, payload).await?;
    let (model, mut details) = queued_model(&gateway, &body, Kind::Video)?;
    let model = &*model;
    let limit = model
        .config
        .prompt_character_limit
        .map_or(DEFAULT_VIDEO_PROMPT_CHARS, |l| l as usize);
    let mut members = Members {
        body: &body,
        details: &mut details,
    };
    let prompt = required_text(&mut members, "prompt", limit);
    let negative = members.text("negative_prompt", 0, limit);
    let audio = members.boolean("audio");
    let order = video_order(model, &mut members, true);
    details.into_result()?;
    let (Some(prompt), Some(order)) = (prompt, order) else {
        return Err(invalid_at(&["duration"], "Invalid duration"));
    };
    let mut upstream = Map::new();
    upstream.insert("prompt".into(), Value::String(prompt));
    upstream.insert("seconds".into(), Value::String(order.seconds.to_string()));
    upstream.insert("size".into(), Value::String(order.size));
    media::insert_present(
        &mut upstream,
        [
            ("negative_prompt", negative.map(Value::from)),
            ("audio", audio.map(Value::from)),
        ],
    );
    let price = video_price(model, order.seconds);
    queue(
        &gateway,
        &request,
        &principal,
        model,
        Kind::Video,
        upstream,
        price,
    )
    .await
}

/// `POST /audio/queue`: speech of `prompt`, made by a worker.
pub async fn audio_queue(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let body = object_body(&gateway, &request, payload).await?;
    let (model, mut details) = queued_model(&gateway, &body, Kind::Audio)?;
    let model = &*model;
    let config = &model.config;
    let mut members = Members {
        body: &body,
        details: &mut details,
    };
    let prompt = required_text(&mut members, "prompt", MAX_QUEUED_SPEECH_CHARS);
    let voice = members.text("voice", 1, 512);
    let language = members.text("language_code", 2, 16);
    let speed = members.number("speed", 0.25, 4.0, false);
    if let Some(voice) = &voice
        && !config.voices.is_empty()
        && !config.voices.contains(voice)
    {
        details.push(
            &["voice"],
            format!(
                "{voice} is not a voice of {}: {}",
                config.id,
                config.voices.join(", ")
            ),
        );
    }
    details.into_result()?;
    let prompt = prompt.unwrap_or_default();
    let chars = prompt.chars().count();
    let format = config.audio_formats()[0].to_owned();
    let voice = voice
        .or_else(|| config.voices.first().cloned())
        .unwrap_or_else(|| "af_sky".to_owned());
    let mut upstream = Map::new();
    upstream.insert("input".into(), Value::String(prompt));
    upstream.insert("voice".into(), Value::String(voice));
    upstream.insert("response_format".into(), Value::String(format));
    media::insert_present(
        &mut upstream,
        [
            ("language", language.map(Value::from)),
            ("speed", speed.map(Value::from)),
        ],
    );
    let price = speech_price(model, chars);
    queue(
        &gateway,
        &request,
        &principal,
        model,
        Kind::Audio,
        upstream,
        price,
    )
    .await
}

/// A string member of 1 to `max` characters that must be there.
fn required_text(members: &mut Members<'_>, name: &str, max: usize) -> Option<String> {
    let text = members.text(name, 1, max);
    if text.is_none() && !members.present_member(name) {
        members.details.push(&[name], "Required");
    }
    text
}

/// The first checks of a queue request: no member the hosted request does
/// not have, a `model` of the kind, and the members this server does not
/// offer named for it. The checks that follow add to the returned details.
fn queued_model(
    gateway: &Gateway,
    body: &Map<String, Value>,
    kind: Kind,
) -> Result<(std::sync::Arc<ModelEntry>, Details), ApiError> {
    let (offered, unsupported) = match kind {
        Kind::Video => (VIDEO_MEMBERS, UNSUPPORTED_VIDEO_MEMBERS),
        Kind::Audio => (AUDIO_MEMBERS, UNSUPPORTED_AUDIO_MEMBERS),
    };
    let mut details = Details::new();
    let known: Vec<&str> = offered.iter().chain(unsupported).copied().collect();
    unknown_members(body, &known, &mut details);
    let model_id = required_text(
        &mut Members {
            body,
            details: &mut details,
        },
        "model",
        256,
    );
    details.into_result()?;
    let model = media::model_of(gateway, model_id.as_deref(), kind.model_types(), false)?;
    let mut details = Details::new();
    refuse_unsupported(body, unsupported, &model.config.id, &mut details);
    Ok((model, details))
}

/// Admits and holds a job's price, stores the job, wakes the workers.
async fn queue(
    gateway: &web::Data<Gateway>,
    request: &HttpRequest,
    principal: &auth_pb::Principal,
    model: &ModelEntry,
    kind: Kind,
    upstream: Map<String, Value>,
    price: u64,
) -> Result<HttpResponse, ApiError> {
    let metered = media::meter(gateway, request, principal, model, price).await?;
    let id = uuid::Uuid::new_v4().to_string();
    let job = billing_pb::Job {
        id: id.clone(),
        owner: crate::ledger_owner(principal),
        model_id: model.config.id.clone(),
        kind: kind.name().to_owned(),
        // Serializing a map of JSON values cannot fail.
        request_json: serde_json::to_vec(&upstream).unwrap_or_default(),
        settlement: Some(metered.job_settlement()),
        price_usd_nanos: price,
        ..Default::default()
    };
    let submitted = gateway
        .services
        .billing
        .submit_job(billing_pb::SubmitJobRequest { job: Some(job) })
        .await;
    if let Err(error) = submitted {
        metered.release();
        return Err(error.into());
    }
    tracing::info!(
        queue_id = id,
        request_id = metered.request_id(),
        model = model.config.id,
        "job queued"
    );
    let wallet_before = metered.handed_to_job();
    if let Some(bus) = &gateway.services.bus
        && let Err(error) = bus
            .publish(bus.subject(JOBS_SUBJECT), bytes::Bytes::from(id.clone()))
            .await
    {
        // The workers' poll finds it anyway.
        tracing::debug!(%error, "job wake-up not published");
    }
    let mut response = HttpResponse::Ok();
    crate::chat::model_headers(&mut response, gateway, model, "", 0);
    let charged = crate::chat::Cost::usd_nanos(price);
    crate::chat::balance_remaining(&mut response, wallet_before, &charged);
    let answer = match kind {
        Kind::Video => json!({"model": model.config.id, "queue_id": id}),
        Kind::Audio => json!({"model": model.config.id, "queue_id": id, "status": "QUEUED"}),
    };
    Ok(response.json(answer))
}

/// `model` and `queue_id` (and `delete_media_on_completion` when
/// `retrieving`) of a retrieve or complete request.
fn job_reference(
    body: &Map<String, Value>,
    retrieving: bool,
) -> Result<(String, String, bool), ApiError> {
    let mut details = Details::new();
    let known: &[&str] = if retrieving {
        &["model", "queue_id", "delete_media_on_completion"]
    } else {
        &["model", "queue_id"]
    };
    unknown_members(body, known, &mut details);
    let mut members = Members {
        body,
        details: &mut details,
    };
    let model = members.text("model", 1, 256);
    let queue_id = members.text("queue_id", 1, 128);
    let delete = members
        .boolean("delete_media_on_completion")
        .unwrap_or(false);
    for (name, value) in [("model", &model), ("queue_id", &queue_id)] {
        if value.is_none() && !body.contains_key(name) {
            details.push(&[name], "Required");
        }
    }
    details.into_result()?;
    Ok((
        model.unwrap_or_default(),
        queue_id.unwrap_or_default(),
        delete,
    ))
}

/// Authenticates a poll of a job of `model` and takes a slot in its
/// window (`<model>:retrieve`, in the kind's poll class).
async fn admit_poll(
    gateway: &Gateway,
    request: &HttpRequest,
    kind: Kind,
    model: &ModelEntry,
) -> Result<auth_pb::Principal, ApiError> {
    let principal = authenticate(gateway, request).await?;
    let window = format!("{}:retrieve", model.config.id);
    let request_id = crate::headers::RequestId::of(request);
    let admission = gateway
        .services
        .limiter
        .admit(
            crate::caller(&principal),
            rialto_limiter::Target {
                window: &window,
                class: kind.poll_class(),
                model_id: Some(&model.config.id),
            },
            &request_id,
            0,
        )
        .await?;
    if let Some(headers) = admission.headers {
        use actix_web::HttpMessage;
        request
            .extensions_mut()
            .insert(crate::RateLimitHeaders(headers));
    }
    if let Some(refusal) = admission.refusal {
        return Err(refusal.into());
    }
    drop(admission.ticket);
    Ok(principal)
}

/// A job of another model, or of nobody, is as unknown as one that never
/// was.
fn media_not_found() -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        "Media could not be found. Request may be invalid, expired, or deleted.",
    )
}

pub async fn video_retrieve(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    retrieve(gateway, request, payload, Kind::Video).await
}

pub async fn audio_retrieve(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    retrieve(gateway, request, payload, Kind::Audio).await
}

/// What `retrieve` and `complete` start with: the body's job reference
/// (`delete_media_on_completion` where `deletable`), its model, and the
/// caller admitted in the kind's polling window.
async fn polled(
    gateway: &Gateway,
    request: &HttpRequest,
    payload: web::Payload,
    kind: Kind,
    deletable: bool,
) -> Result<(auth_pb::Principal, String, bool, std::sync::Arc<ModelEntry>), ApiError> {
    let body = object_body(gateway, request, payload).await?;
    let (model_id, queue_id, delete) = job_reference(&body, deletable)?;
    let model = media::model_of(gateway, Some(&model_id), kind.model_types(), false)?;
    let principal = admit_poll(gateway, request, kind, &model).await?;
    Ok((principal, queue_id, delete, model))
}

/// `retrieve`: the status while the job runs, the media once it is done.
async fn retrieve(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
    kind: Kind,
) -> Result<HttpResponse, ApiError> {
    let (principal, queue_id, delete, model) =
        polled(&gateway, &request, payload, kind, true).await?;
    let model = &*model;
    let job = gateway
        .services
        .billing
        .get_job(billing_pb::GetJobRequest {
            id: queue_id,
            owner: crate::ledger_owner(&principal),
            // Another model's job is not found, and its media not deleted
            // (the model names the kind too).
            model_id: model.config.id.clone(),
            with_result: true,
            delete_result: delete,
        })
        .await?;
    let mut response = HttpResponse::Ok();
    crate::chat::model_headers(&mut response, &gateway, model, &job.backend, 0);
    match job.state.as_str() {
        states::COMPLETED => Ok(response
            .content_type(job.content_type.clone())
            .body(job.result)),
        states::QUEUED | states::PROCESSING => {
            let now = rialto_core::db::now_ms();
            let since = if job.started_ms > 0 {
                job.started_ms
            } else {
                job.created_ms
            };
            Ok(response.json(json!({
                "status": "PROCESSING",
                "average_execution_time": job.average_execution_ms,
                "execution_duration": (now - since).max(0),
                "progress": job.progress,
            })))
        }
        states::FAILED => Err(job_failure(&gateway, &job)),
        _ => Err(media_not_found()),
    }
}

/// A failed job's error as its owner sees it.
fn job_failure(gateway: &Gateway, job: &billing_pb::Job) -> ApiError {
    if job.error_code == ErrorCode::ContentViolation.as_str() {
        return ApiError::new(ErrorCode::ContentViolation, job.error.clone()).with_header(
            gateway.brand.header_is_content_violation.clone(),
            "true".to_owned(),
        );
    }
    // Rendered as the spec's "Inference processing failed: <error>".
    ApiError::new(ErrorCode::UpstreamFailed, job.error.clone())
}

pub async fn video_complete(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    complete(gateway, request, payload, Kind::Video).await
}

pub async fn audio_complete(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    complete(gateway, request, payload, Kind::Audio).await
}

/// `complete`: the media is deleted; a job still running is cancelled
/// (nothing charged).
async fn complete(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
    kind: Kind,
) -> Result<HttpResponse, ApiError> {
    let (principal, queue_id, _, model) = polled(&gateway, &request, payload, kind, false).await?;
    gateway
        .services
        .billing
        .complete_job(billing_pb::CompleteJobRequest {
            id: queue_id,
            owner: crate::ledger_owner(&principal),
            model_id: model.config.id.clone(),
        })
        .await?;
    Ok(HttpResponse::Ok().json(json!({"success": true})))
}

/// `POST /video/transcriptions`: retired by the hosted API (410), and so
/// here.
pub async fn video_transcriptions() -> Result<HttpResponse, ApiError> {
    Err(ApiError::new(
        ErrorCode::Gone,
        "Video transcription is no longer offered: extract the audio and use \
         /audio/transcriptions",
    ))
}

/// Starts the worker pool of this gateway: it claims jobs while there is
/// room (`media.job_workers`), on a wake-up or every `media.job_poll_ms`,
/// until `stop`.
pub fn spawn_workers(
    gateway: Arc<Gateway>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let worker = format!(
            "{}-{}-{}",
            rialto_core::telemetry::host_name(),
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let slots = Arc::new(tokio::sync::Semaphore::new(gateway.jobs.workers));
        let wake = Arc::new(tokio::sync::Notify::new());
        if let Some(bus) = gateway.services.bus.clone() {
            let wake = wake.clone();
            match bus.subscribe(bus.subject(JOBS_SUBJECT), None).await {
                Ok(mut events) => {
                    tokio::spawn(async move {
                        while events.next().await.is_some() {
                            wake.notify_one();
                        }
                    });
                }
                Err(error) => tracing::warn!(%error, "job wake-ups unavailable; polling only"),
            }
        }
        loop {
            let free = slots.available_permits();
            if free > 0 {
                let claimed = gateway
                    .services
                    .billing
                    .claim_jobs(billing_pb::ClaimJobsRequest {
                        worker: worker.clone(),
                        limit: u32::try_from(free).unwrap_or(u32::MAX),
                        lease_secs: gateway.jobs.lease_secs,
                    })
                    .await;
                match claimed {
                    Ok(claimed) => {
                        for job in claimed.jobs {
                            let Ok(permit) = slots.clone().try_acquire_owned() else {
                                break;
                            };
                            let runner = Runner {
                                gateway: gateway.clone(),
                                worker: worker.clone(),
                                progress: Arc::new(AtomicU32::new(job.progress)),
                            };
                            let wake = wake.clone();
                            tokio::spawn(async move {
                                runner.run(job).await;
                                drop(permit);
                                // Room again: look for more at once.
                                wake.notify_one();
                            });
                        }
                    }
                    Err(error) => tracing::warn!(%error, "cannot claim jobs"),
                }
            }
            tokio::select! {
                _ = stop.wait_for(|stopped| *stopped) => return,
                () = wake.notified() => {}
                () = tokio::time::sleep(gateway.jobs.poll) => {}
            }
        }
    })
}

/// How this gateway runs jobs (`[media]`).
#[derive(Debug, Clone)]
pub(crate) struct JobSettings {
    pub(crate) workers: usize,
    pub(crate) lease_secs: u32,
    pub(crate) poll: Duration,
}

impl JobSettings {
    pub(crate) fn new(media: &rialto_core::config::MediaConfig) -> Self {
        Self {
            workers: media.job_workers,
            lease_secs: media.job_lease_secs,
            poll: Duration::from_millis(media.job_poll_ms),
        }
    }
}

/// How a job ended, as the worker reports it.
enum Outcome {
    Done {
        media: Vec<u8>,
        content_type: String,
    },
    Failed {
        error: String,
        code: String,
    },
    /// Another worker has it now, or its owner cancelled it.
    Lost,
}

/// Runs one claimed job.
struct Runner {
    gateway: Arc<Gateway>,
    worker: String,
    /// What the backend last reported, sent with each lease renewal.
    progress: Arc<AtomicU32>,
}

/// Consecutive failed polls of a backend's job before the job fails.
const MAX_POLL_FAILURES: u32 = 20;
/// Tries of a queued speech before its job fails.
const MAX_SPEECH_TRIES: u32 = 3;

impl Runner {
    async fn run(&self, job: billing_pb::Job) {
        if !is_open(&job.state) {
            // Finished before, its charge not recorded: send it again.
            let _ = self.report(&job, UpdateKind::Settle).await;
            return;
        }
        tracing::info!(queue_id = job.id, attempt = job.attempts, "job started");
        let work = async {
            match job.kind.as_str() {
                "video" => self.video(&job).await,
                "audio" => self.speech(&job).await,
                other => Outcome::Failed {
                    error: format!("unknown job kind {other}"),
                    code: ErrorCode::Internal.as_str().to_owned(),
                },
            }
        };
        // The lease is renewed while the work goes on.
        let outcome = tokio::select! {
            outcome = work => outcome,
            () = self.renew(&job) => Outcome::Lost,
        };
        let update = match outcome {
            Outcome::Lost => return,
            Outcome::Done {
                media,
                content_type,
            } => UpdateKind::Done {
                media,
                content_type,
            },
            Outcome::Failed { error, code } => UpdateKind::Failed { error, code },
        };
        // A report that does not arrive leaves the job to the next claim
        // (the lease runs out): it is worked again, and charged once.
        match self.report(&job, update).await {
            Ok(done) => tracing::info!(queue_id = job.id, state = done.state, "job finished"),
            Err(error) => tracing::warn!(queue_id = job.id, %error, "job result not recorded"),
        }
    }

    /// Renews the job's lease every third of it; returns when the job is
    /// no longer this worker's.
    async fn renew(&self, job: &billing_pb::Job) {
        let every = Duration::from_millis(u64::from(self.gateway.jobs.lease_secs) * 1000 / 3);
        loop {
            tokio::time::sleep(every).await;
            match self.report(job, UpdateKind::Renew).await {
                Ok(current) if is_open(&current.state) && current.worker == self.worker => {}
                Ok(_) => return,
                Err(error) => tracing::warn!(queue_id = job.id, %error, "job lease not renewed"),
            }
        }
    }

    async fn report(
        &self,
        job: &billing_pb::Job,
        update: UpdateKind,
    ) -> rialto_core::Result<billing_pb::Job> {
        let mut request = billing_pb::UpdateJobRequest {
            id: job.id.clone(),
            owner: job.owner.clone(),
            worker: self.worker.clone(),
            lease_secs: self.gateway.jobs.lease_secs,
            progress: self.progress.load(Ordering::Relaxed),
            ..Default::default()
        };
        match update {
            UpdateKind::Renew | UpdateKind::Settle => {}
            UpdateKind::Started {
                backend,
                backend_job_id,
            } => {
                request.backend = backend;
                request.backend_job_id = backend_job_id;
            }
            UpdateKind::Done {
                media,
                content_type,
            } => {
                request.state = states::COMPLETED.to_owned();
                request.progress = 100;
                request.result = media;
                request.content_type = content_type;
            }
            UpdateKind::Failed { error, code } => {
                request.state = states::FAILED.to_owned();
                request.error = error;
                request.error_code = code;
            }
        }
        self.gateway.services.billing.update_job(request).await
    }

    fn media_request(
        &self,
        job: &billing_pb::Job,
        path: String,
        body: &Map<String, Value>,
        get: bool,
        backend: &str,
    ) -> router_pb::MediaRequest {
        router_pb::MediaRequest {
            request_id: job.settlement.as_ref().map_or_else(
                || job.id.clone(),
                |settlement| settlement.request_id.clone(),
            ),
            model_id: job.model_id.clone(),
            path,
            body_json: if get {
                b"{}".to_vec()
            } else {
                serde_json::to_vec(body).unwrap_or_default()
            },
            files: Vec::new(),
            method: if get { "GET" } else { "" }.to_owned(),
            backend: backend.to_owned(),
        }
    }

    /// A video: started on a backend (unless an earlier worker did), its
    /// status polled with backoff until it is done, then its content
    /// fetched from the same backend.
    async fn video(&self, job: &billing_pb::Job) -> Outcome {
        let router = &self.gateway.services.router;
        let body: Map<String, Value> =
            serde_json::from_slice(&job.request_json).unwrap_or_default();
        let (backend, video_id) = if job.backend_job_id.is_empty() {
            let created = router
                .media(self.media_request(job, "/videos".to_owned(), &body, false, ""))
                .await;
            let answer = match created {
                Ok(answer) => answer,
                Err(error) => return failed(&error),
            };
            let status: Value = serde_json::from_slice(&answer.body).unwrap_or_default();
            let Some(id) = status["id"].as_str().filter(|id| valid_id(id)) else {
                return Outcome::Failed {
                    error: "the backend answered no video id".to_owned(),
                    code: ErrorCode::UpstreamFailed.as_str().to_owned(),
                };
            };
            let started = UpdateKind::Started {
                backend: answer.backend.clone(),
                backend_job_id: id.to_owned(),
            };
            match self.report(job, started).await {
                Ok(current) if current.worker == self.worker && is_open(&current.state) => {}
                Ok(_) => return Outcome::Lost,
                Err(error) => tracing::warn!(queue_id = job.id, %error, "video id not recorded"),
            }
            (answer.backend, id.to_owned())
        } else {
            (job.backend.clone(), job.backend_job_id.clone())
        };
        let first_wait = self.gateway.jobs.poll;
        let mut wait = first_wait;
        let mut failures = 0;
        loop {
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(first_wait * 10);
            let polled = router
                .media(self.media_request(
                    job,
                    format!("/videos/{video_id}"),
                    &body,
                    true,
                    &backend,
                ))
                .await;
            let status: Value = match polled {
                Ok(answer) => serde_json::from_slice(&answer.body).unwrap_or_default(),
                Err(error) if is_final(&error) => return failed(&error),
                Err(error) => {
                    failures += 1;
                    tracing::warn!(queue_id = job.id, %error, failures, "video status unavailable");
                    if failures >= MAX_POLL_FAILURES {
                        return failed(&error);
                    }
                    continue;
                }
            };
            failures = 0;
            if let Some(progress) = status["progress"].as_u64() {
                self.progress
                    .store(progress.min(99) as u32, Ordering::Relaxed);
            }
            match status["status"].as_str() {
                Some("completed") => break,
                Some("failed") => {
                    let error = &status["error"];
                    let code = match error["code"].as_str() {
                        Some("moderation_blocked" | "content_policy_violation") => {
                            ErrorCode::ContentViolation
                        }
                        _ => ErrorCode::UpstreamFailed,
                    };
                    return Outcome::Failed {
                        error: error["message"]
                            .as_str()
                            .unwrap_or("the backend could not make the video")
                            .chars()
                            .take(500)
                            .collect(),
                        code: code.as_str().to_owned(),
                    };
                }
                _ => {}
            }
        }
        let content = router
            .media(self.media_request(
                job,
                format!("/videos/{video_id}/content"),
                &body,
                true,
                &backend,
            ))
            .await;
        match content {
            Ok(answer) if is_mp4(&answer.body) => Outcome::Done {
                media: answer.body,
                content_type: "video/mp4".to_owned(),
            },
            Ok(_) => Outcome::Failed {
                error: "the backend's video is not an MP4".to_owned(),
                code: ErrorCode::UpstreamFailed.as_str().to_owned(),
            },
            Err(error) => failed(&error),
        }
    }

    /// Queued speech: one `/audio/speech` call (the router retries and
    /// fails over inside it), tried again a few times when no backend could
    /// take it.
    async fn speech(&self, job: &billing_pb::Job) -> Outcome {
        let body: Map<String, Value> =
            serde_json::from_slice(&job.request_json).unwrap_or_default();
        let format = body["response_format"].as_str().unwrap_or("mp3").to_owned();
        let mut wait = self.gateway.jobs.poll;
        let mut tries = 0;
        loop {
            tries += 1;
            let answer = self
                .gateway
                .services
                .router
                .media(self.media_request(job, "/audio/speech".to_owned(), &body, false, ""))
                .await;
            match answer {
                Ok(answer) if crate::audio::is_audio(&format, &answer.body) => {
                    return Outcome::Done {
                        media: answer.body,
                        content_type: media::content_type_of(&format).to_owned(),
                    };
                }
                Ok(_) => {
                    return Outcome::Failed {
                        error: format!("the backend's audio is not {format}"),
                        code: ErrorCode::UpstreamFailed.as_str().to_owned(),
                    };
                }
                Err(error) if is_final(&error) || tries >= MAX_SPEECH_TRIES => {
                    return failed(&error);
                }
                Err(error) => {
                    tracing::warn!(queue_id = job.id, %error, tries, "queued speech failed; trying again");
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                }
            }
        }
    }
}

/// What a worker tells billing.
enum UpdateKind {
    Renew,
    Settle,
    Started {
        backend: String,
        backend_job_id: String,
    },
    Done {
        media: Vec<u8>,
        content_type: String,
    },
    Failed {
        error: String,
        code: String,
    },
}

/// A refusal that asking again will not change (the request's fault, the
/// content policy's), as opposed to a backend that is down or busy.
fn is_final(error: &rialto_core::Error) -> bool {
    matches!(
        error.code,
        ErrorCode::InvalidRequest | ErrorCode::ContentViolation | ErrorCode::ModelNotFound
    )
}

fn failed(error: &rialto_core::Error) -> Outcome {
    Outcome::Failed {
        error: error.message.chars().take(500).collect(),
        code: error.code.as_str().to_owned(),
    }
}

/// A backend's job id goes into a path: nothing but what ids are made of.
fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 200
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && id != "."
        && id != ".."
}

/// Whether `bytes` start as an MP4 (ISO base media file) does.
fn is_mp4(bytes: &[u8]) -> bool {
    bytes.get(4..8) == Some(b"ftyp")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_sizes_follow_the_resolution_and_the_ratio() {
        assert_eq!(frame_size("720p", "16:9").unwrap(), "1280x720");
        assert_eq!(frame_size("720p", "9:16").unwrap(), "720x1280");
        assert_eq!(frame_size("1080p", "1:1").unwrap(), "1080x1080");
        assert_eq!(frame_size("480p", "4:3").unwrap(), "640x480");
        assert_eq!(frame_size("360p", "21:9").unwrap(), "840x360");
        assert!(frame_size("tall", "16:9").is_none());
    }

    #[test]
    fn backend_ids_cannot_leave_their_path() {
        assert!(valid_id("video_68d7512d07848190"));
        for bad in ["", "..", "../x", "a/b", "a?b=c", "a b"] {
            assert!(!valid_id(bad), "{bad}");
        }
    }
}
