//! Images: `POST /image/generate` (the hosted shape), `POST
//! /images/generations` (OpenAI's), `GET /image/styles`, and the edits,
//! `POST /image/edit` and `/image/multi-edit`. Background removal
//! (`retouch.rs`) is an edit too and goes through [`run`].
//!
//! Generation becomes one OpenAI `/images/generations` call to the model's
//! backends, an edit one `/images/edits` form, asking for base64 images in
//! the wanted format. What comes back is checked to be an image (its
//! header); one in another format than asked is decoded and re-encoded (a
//! backend that only makes PNGs still answers `webp`). Each image
//! delivered costs the model's `usd_per_image` (or its resolution tier's
//! price); the hold is for every image asked.

use actix_web::{HttpRequest, HttpResponse, web};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use rust_decimal::Decimal;
use serde_json::{Map, Value, json};

use crate::augment::{invalid_at, object_body};
use crate::headers::RequestId;
use crate::media::{self, Members, content_type_of, unknown_members};
use crate::{ApiError, Details, Gateway, ModelEntry, authenticate};

const FORMATS: &[&str] = &["jpeg", "png", "webp"];

const GENERATIONS: &str = "/images/generations";

/// Longest edit prompt when the model sets no limit.
const MAX_EDIT_PROMPT_CHARS: usize = 32768;

/// Most images one multi-edit may combine.
const MAX_EDIT_IMAGES: usize = 16;

/// Longest prompt of `/image/generate` when the model sets no limit.
const MAX_PROMPT_CHARS: usize = 7500;

/// Longest prompt of OpenAI's `/images/generations`.
const MAX_OPENAI_PROMPT_CHARS: usize = 1500;

/// Largest side of a generated image.
const MAX_SIDE: i64 = 1280;

/// Most images one request may ask for.
const MAX_IMAGES: i64 = 4;

/// Largest side of an image a backend sends back (8K), and the most memory
/// its decoding may take.
const MAX_DECODED_SIDE: u32 = 8192;
const MAX_DECODED_BYTES: u64 = 256 * 1024 * 1024;

/// What a route asks of the backends.
pub(crate) struct Generation {
    pub(crate) model: std::sync::Arc<ModelEntry>,
    /// `/images/generations`, or `/images/edits` (a form with `files`).
    pub(crate) path: &'static str,
    /// The upstream body (an edit's form fields).
    pub(crate) upstream: Map<String, Value>,
    /// An edit's images, each with its form field (`image`, `image[]`).
    pub(crate) sources: Vec<(&'static str, ImageSource)>,
    pub(crate) count: usize,
    pub(crate) format: &'static str,
    /// Price of one image, in USD.
    pub(crate) usd_per_image: f64,
    /// Each image must have an alpha channel (a background removed).
    pub(crate) transparent: bool,
}

/// `GET /image/styles`.
pub async fn styles(gateway: web::Data<Gateway>) -> HttpResponse {
    HttpResponse::Ok().json(json!({"object": "list", "data": gateway.image_styles}))
}

/// `POST /image/generate`.
pub async fn generate(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let body = object_body(&gateway, &request, payload).await?;
    let started = std::time::Instant::now();
    let (generation, binary) = hosted_generation(&gateway, &body)?;
    let (images, mut response) = run(&gateway, &request, &principal, generation).await?;
    let format = images.format;
    if binary {
        let image = images.encoded.into_iter().next().unwrap_or_default();
        return Ok(response.content_type(content_type_of(format)).body(image));
    }
    let total = started.elapsed().as_millis() as u64;
    let encoded: Vec<String> = images.encoded.iter().map(|i| BASE64.encode(i)).collect();
    Ok(response.json(json!({
        "id": format!("generate-image-{}", RequestId::of(&request)),
        "images": encoded,
        "request": body,
        "timing": {
            "inferenceDuration": images.backend_ms,
            "inferencePreprocessingTime": 0,
            "inferenceQueueTime": 0,
            "total": total,
        },
    })))
}

/// `POST /images/generations`.
pub async fn generations(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let body = object_body(&gateway, &request, payload).await?;
    let (generation, data_urls) = openai_generation(&gateway, &body)?;
    let (images, mut response) = run(&gateway, &request, &principal, generation).await?;
    let format = images.format;
    let data: Vec<Value> = images
        .encoded
        .iter()
        .map(|image| {
            let b64 = BASE64.encode(image);
            if data_urls {
                json!({"url": format!("data:{};base64,{b64}", content_type_of(format))})
            } else {
                json!({"b64_json": b64})
            }
        })
        .collect();
    Ok(response.json(json!({"created": chrono::Utc::now().timestamp(), "data": data})))
}

/// The members of `/image/generate` (its schema refuses others).
const HOSTED_MEMBERS: &[&str] = &[
    "model",
    "prompt",
    "negative_prompt",
    "width",
    "height",
    "format",
    "return_binary",
    "variants",
    "safe_mode",
    "seed",
    "style_preset",
    "cfg_scale",
    "steps",
    "aspect_ratio",
    "resolution",
    "quality",
    "hide_watermark",
    "embed_exif_metadata",
    "lora_strength",
    "inpaint",
    "enable_web_search",
    "disable_prompt_optimization_thinking",
    "enhance_prompt",
    "style_references",
];

/// Validates a `/image/generate` body; the generation, and whether the
/// answer is the image's bytes.
fn hosted_generation(
    gateway: &Gateway,
    body: &Map<String, Value>,
) -> Result<(Generation, bool), ApiError> {
    let mut details = Details::new();
    unknown_members(body, HOSTED_MEMBERS, &mut details);
    let model_id = crate::augment::string_member(body, "model", &mut details).map(str::to_owned);
    let mut members = Members {
        body,
        details: &mut details,
    };
    let negative = members.text("negative_prompt", 0, MAX_PROMPT_CHARS);
    let width = members.integer("width", 1, MAX_SIDE).unwrap_or(1024);
    let height = members.integer("height", 1, MAX_SIDE).unwrap_or(1024);
    let format = members.choice("format", FORMATS);
    let binary = members.boolean("return_binary").unwrap_or(false);
    let variants = members.integer("variants", 1, MAX_IMAGES).unwrap_or(1);
    let safe = members.boolean("safe_mode").unwrap_or(true);
    let seed = members.integer("seed", -999_999_999, 999_999_999);
    let style = members.text("style_preset", 1, 100);
    let cfg_scale = members.number("cfg_scale", 0.0, 20.0, true);
    let steps = members.integer("steps", 1, 150);
    let aspect_ratio = members.text("aspect_ratio", 1, 16);
    let resolution = members.text("resolution", 1, 16);
    let quality = members.choice("quality", &["low", "medium", "high"]);
    let lora = members.integer("lora_strength", 0, 100);
    for flag in [
        "hide_watermark",
        "embed_exif_metadata",
        "disable_prompt_optimization_thinking",
    ] {
        // Accepted: the backends add no watermark and write no metadata.
        members.boolean(flag);
    }
    // Features no OpenAI-compatible image server offers.
    for feature in ["enable_web_search", "enhance_prompt"] {
        if members.boolean(feature) == Some(true) {
            members
                .details
                .push(&[feature], "Not supported by the models of this server");
        }
    }
    for feature in ["inpaint", "style_references"] {
        if members.present_member(feature) {
            members
                .details
                .push(&[feature], "Not supported by the models of this server");
        }
    }
    if binary && variants > 1 {
        members
            .details
            .push(&["variants"], "Only one image can be returned as binary");
    }
    if let Some(style) = &style
        && !gateway.image_styles.contains(style)
    {
        members.details.push(
            &["style_preset"],
            "Unknown style: GET /image/styles lists them",
        );
    }
    let prompt = crate::augment::string_member(body, "prompt", &mut details).map(str::to_owned);
    details.into_result()?;
    let model = &media::model_of(gateway, model_id.as_deref(), &["image"], false)?;
    let prompt = media::checked_prompt(prompt, prompt_limit(model, MAX_PROMPT_CHARS))?;
    let (resolution, usd_per_image) = tier_of(model, resolution.as_deref())?;
    let prompt = match &style {
        Some(style) => format!("{prompt}, {style} style"),
        None => prompt,
    };
    let format = format_name(format.as_deref().unwrap_or("webp"));
    let mut upstream = base_request(prompt, variants, width, height, format, safe);
    media::insert_present(
        &mut upstream,
        [
            ("negative_prompt", negative.map(Value::from)),
            ("seed", seed.map(Value::from)),
            ("cfg_scale", cfg_scale.map(Value::from)),
            ("steps", steps.map(Value::from)),
            ("aspect_ratio", aspect_ratio.map(Value::from)),
            ("resolution", resolution.map(Value::from)),
            ("quality", quality.map(Value::from)),
            ("lora_strength", lora.map(Value::from)),
        ],
    );
    Ok((
        Generation {
            model: std::sync::Arc::clone(model),
            path: GENERATIONS,
            upstream,
            sources: Vec::new(),
            count: variants as usize,
            format,
            usd_per_image,
            transparent: false,
        },
        binary,
    ))
}

/// The members of OpenAI's `/images/generations`.
const OPENAI_MEMBERS: &[&str] = &[
    "model",
    "prompt",
    "n",
    "size",
    "output_format",
    "response_format",
    "moderation",
    "background",
    "output_compression",
    "quality",
    "style",
    "user",
];

const SIZES: &[&str] = &[
    "auto",
    "256x256",
    "512x512",
    "1024x1024",
    "1536x1024",
    "1024x1536",
    "1792x1024",
    "1024x1792",
];

/// Validates an OpenAI `/images/generations` body; the generation, and
/// whether images go back as data URLs.
fn openai_generation(
    gateway: &Gateway,
    body: &Map<String, Value>,
) -> Result<(Generation, bool), ApiError> {
    let mut details = Details::new();
    unknown_members(body, OPENAI_MEMBERS, &mut details);
    let prompt = crate::augment::string_member(body, "prompt", &mut details).map(str::to_owned);
    let mut members = Members {
        body,
        details: &mut details,
    };
    let model_id = members.text("model", 1, 256);
    let count = members.integer("n", 1, MAX_IMAGES).unwrap_or(1);
    let size = members.choice("size", SIZES);
    let format = members.choice("output_format", FORMATS);
    let data_urls = members.choice("response_format", &["b64_json", "url"]) == Some("url".into());
    let safe = members.choice("moderation", &["low", "auto"]) != Some("low".into());
    // Accepted for compatibility; they change nothing here.
    members.choice("background", &["transparent", "opaque", "auto"]);
    members.integer("output_compression", 0, 100);
    members.choice(
        "quality",
        &["auto", "high", "medium", "low", "hd", "standard"],
    );
    members.choice("style", &["vivid", "natural"]);
    members.text("user", 0, 512);
    details.into_result()?;
    let prompt = media::checked_prompt(prompt, MAX_OPENAI_PROMPT_CHARS)?;
    // An unknown model (an OpenAI name) is the default image model.
    let model = &media::model_of(gateway, model_id.as_deref(), &["image"], true)?;
    let (width, height) = match size.as_deref() {
        None | Some("auto") => (1024, 1024),
        Some(size) => parse_size(size).unwrap_or((1024, 1024)),
    };
    let format = format_name(format.as_deref().unwrap_or("png"));
    let (resolution, usd_per_image) = tier_of(model, None)?;
    let mut upstream = base_request(prompt, count, width, height, format, safe);
    if let Some(tier) = resolution {
        upstream.insert("resolution".into(), Value::String(tier));
    }
    Ok((
        Generation {
            model: std::sync::Arc::clone(model),
            path: GENERATIONS,
            upstream,
            sources: Vec::new(),
            count: count as usize,
            format,
            usd_per_image,
            transparent: false,
        },
        data_urls,
    ))
}

fn parse_size(size: &str) -> Option<(i64, i64)> {
    let (w, h) = size.split_once('x')?;
    Some((w.parse().ok()?, h.parse().ok()?))
}

fn format_name(format: &str) -> &'static str {
    FORMATS
        .iter()
        .find(|f| **f == format)
        .copied()
        .unwrap_or("png")
}

/// The OpenAI request every generation starts from.
fn base_request(
    prompt: String,
    count: i64,
    width: i64,
    height: i64,
    format: &str,
    safe: bool,
) -> Map<String, Value> {
    let mut upstream = Map::new();
    upstream.insert("prompt".into(), Value::String(prompt));
    upstream.insert("n".into(), json!(count));
    upstream.insert("size".into(), json!(format!("{width}x{height}")));
    upstream.insert("response_format".into(), json!("b64_json"));
    upstream.insert("output_format".into(), json!(format));
    upstream.insert("moderation".into(), moderation(safe));
    upstream
}

/// OpenAI's moderation level of safe mode: `auto` filters, `low` less so.
fn moderation(safe: bool) -> Value {
    json!(if safe { "auto" } else { "low" })
}

fn prompt_limit(model: &ModelEntry, default: usize) -> usize {
    model
        .config
        .prompt_character_limit
        .map_or(default, |limit| limit as usize)
}

/// The resolution to ask the backend for, and the price of one image:
/// for a model that prices tiers, the requested tier (else its first in
/// sort order, "1K" before "2K"), always sent so that what is made is what
/// is paid; else the request's resolution as given and `usd_per_image`.
fn tier_of(
    model: &ModelEntry,
    resolution: Option<&str>,
) -> Result<(Option<String>, f64), ApiError> {
    let tiers = &model.config.usd_per_image_resolution;
    if tiers.is_empty() {
        return Ok((resolution.map(str::to_owned), model.config.usd_per_image));
    }
    let chosen = match resolution {
        None => tiers.iter().next(),
        Some(tier) => tiers.get_key_value(tier),
    };
    match chosen {
        Some((tier, usd)) => Ok((Some(tier.clone()), *usd)),
        None => {
            let known: Vec<&str> = tiers.keys().map(String::as_str).collect();
            Err(invalid_at(
                &["resolution"],
                format!("This model's resolutions are {}", known.join(", ")),
            ))
        }
    }
}

/// `POST /image/edit`: one image (`image`: a file of a multipart form, or
/// in JSON base64, a `data:` URL or an http(s) URL) edited as `prompt`
/// says; the answer is the edited image's bytes.
pub async fn edit(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    edit_route(gateway, request, payload, false).await
}

/// `POST /image/multi-edit`: `images` (1 to 16; the first is the base)
/// edited together as `prompt` says.
pub async fn multi_edit(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    edit_route(gateway, request, payload, true).await
}

/// The members of `/image/edit` and `/image/multi-edit`.
const EDIT_MEMBERS: &[&str] = &[
    "model",
    "modelId",
    "prompt",
    "image",
    "images",
    "output_format",
    "safe_mode",
    "aspect_ratio",
    "resolution",
    "quality",
    "enhance_prompt",
    "disable_prompt_optimization_thinking",
];

/// The boolean members of an edit.
const EDIT_FLAGS: &[&str] = &[
    "safe_mode",
    "enhance_prompt",
    "disable_prompt_optimization_thinking",
];

const ASPECT_RATIOS: &[&str] = &[
    "auto", "1:1", "3:2", "16:9", "21:9", "9:16", "2:3", "3:4", "4:5",
];

async fn edit_route(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
    multi: bool,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let list = if multi { "images" } else { "image" };
    let (body, mut uploads) = if crate::forms::is_multipart(&request) {
        let parts = crate::forms::read(
            &request,
            payload,
            &["image", "images", "images[]"],
            gateway.max_upload_bytes,
        )
        .await?;
        let mut body = Map::new();
        let mut uploads = Vec::new();
        for part in parts {
            match part.name.as_str() {
                "image" | "images" | "images[]" => uploads.push(part.bytes),
                name => {
                    // A flag's `true`/`false` in a form is the boolean.
                    let text = part.text();
                    let flag = EDIT_FLAGS.contains(&name);
                    let value = match text.as_str() {
                        "true" if flag => Value::Bool(true),
                        "false" if flag => Value::Bool(false),
                        _ => Value::String(text),
                    };
                    body.insert(name.to_owned(), value);
                }
            }
        }
        (body, uploads)
    } else {
        (object_body(&gateway, &request, payload).await?, Vec::new())
    };
    let mut details = Details::new();
    unknown_members(&body, EDIT_MEMBERS, &mut details);
    let wrong = if multi { "image" } else { "images" };
    if body.contains_key(wrong) {
        details.push(&[wrong], format!("Send `{list}` to this route"));
    }
    let prompt = crate::augment::string_member(&body, "prompt", &mut details).map(str::to_owned);
    let mut members = Members {
        body: &body,
        details: &mut details,
    };
    let model_id = members
        .text("model", 1, 256)
        .or_else(|| members.text("modelId", 1, 256));
    let format = match body.get("output_format") {
        // The hosted API's other name of JPEG.
        Some(Value::String(jpg)) if jpg == "jpg" => Some("jpeg".to_owned()),
        _ => members.choice("output_format", FORMATS),
    };
    let safe = members.boolean("safe_mode").unwrap_or(true);
    let aspect_ratio = members.choice("aspect_ratio", ASPECT_RATIOS);
    let resolution = members.text("resolution", 1, 10);
    let quality = members.choice("quality", &["low", "medium", "high"]);
    members.boolean("disable_prompt_optimization_thinking");
    if members.boolean("enhance_prompt") == Some(true) {
        members.details.push(
            &["enhance_prompt"],
            "Not supported by the models of this server",
        );
    }
    // Images sent in JSON: base64, data URLs or web addresses.
    let mut sent = Vec::new();
    match (body.get(list), multi) {
        (None, _) => {}
        (Some(Value::String(image)), false) => sent.push(image.clone()),
        (Some(Value::Array(images)), true) if images.iter().all(Value::is_string) => {
            sent.extend(images.iter().filter_map(Value::as_str).map(str::to_owned));
        }
        _ => members.details.push(
            &[list],
            if multi {
                "Expected an array of images (base64 or URLs)"
            } else {
                "Expected an image (base64 or a URL)"
            },
        ),
    }
    details.into_result()?;
    // Counted before anything is decoded or fetched.
    let most = if multi { MAX_EDIT_IMAGES } else { 1 };
    let count = uploads.len() + sent.len();
    if count == 0 || count > most {
        return Err(invalid_at(
            &[list],
            format!("Required: 1 to {most} image(s)"),
        ));
    }
    let field = if multi { "image[]" } else { "image" };
    let mut sources: Vec<(&'static str, ImageSource)> = uploads
        .drain(..)
        .map(|bytes| (field, ImageSource::Bytes(bytes)))
        .collect();
    for image in sent {
        let image = image.trim();
        let source = if image.starts_with("http://") || image.starts_with("https://") {
            ImageSource::Url(image.to_owned())
        } else {
            ImageSource::Bytes(base64_image(image).map_err(|why| invalid_at(&[list], why))?)
        };
        sources.push((field, source));
    }
    for (index, (_, source)) in sources.iter().enumerate() {
        if let ImageSource::Bytes(bytes) = source
            && image::guess_format(bytes).is_err()
        {
            return Err(invalid_at(
                &[list],
                format!("Image {} is not an image", index + 1),
            ));
        }
    }
    let model = &media::model_of(&gateway, model_id.as_deref(), &["inpaint"], false)?;
    let prompt = media::checked_prompt(prompt, prompt_limit(model, MAX_EDIT_PROMPT_CHARS))?;
    let (resolution, usd_per_image) = tier_of(model, resolution.as_deref())?;
    let format = format_name(format.as_deref().unwrap_or("png"));
    let mut upstream = Map::new();
    upstream.insert("prompt".into(), Value::String(prompt));
    upstream.insert("n".into(), json!(1));
    upstream.insert("response_format".into(), json!("b64_json"));
    upstream.insert("output_format".into(), json!(format));
    upstream.insert("moderation".into(), moderation(safe));
    media::insert_present(
        &mut upstream,
        [
            ("aspect_ratio", aspect_ratio),
            ("resolution", resolution),
            ("quality", quality),
        ],
    );
    let generation = Generation {
        model: std::sync::Arc::clone(model),
        path: "/images/edits",
        upstream,
        sources,
        count: 1,
        format,
        usd_per_image,
        transparent: false,
    };
    let (images, mut response) = run(&gateway, &request, &principal, generation).await?;
    let image = images.encoded.into_iter().next().unwrap_or_default();
    Ok(response.content_type(content_type_of(format)).body(image))
}

/// An image sent in JSON as a `data:` URL or base64.
pub(crate) fn base64_image(image: &str) -> Result<Vec<u8>, String> {
    let b64 = match image.strip_prefix("data:") {
        Some(rest) => rest
            .split_once(";base64,")
            .map(|(_, b64)| b64)
            .ok_or("a data URL must be base64")?,
        None => image,
    };
    BASE64
        .decode(b64)
        .map_err(|_| "an image must be base64, a data URL or an http(s) URL".to_owned())
}

/// Images a backend delivered, in the wanted format.
pub(crate) struct Images {
    pub(crate) encoded: Vec<Vec<u8>>,
    format: &'static str,
    /// How long the backend took.
    backend_ms: u64,
}

/// Holds the price of every image asked, calls the backends, checks and
/// converts what they made, and charges the images delivered.
pub(crate) async fn run(
    gateway: &web::Data<Gateway>,
    request: &HttpRequest,
    principal: &rialto_proto::auth::v1::Principal,
    generation: Generation,
) -> Result<(Images, actix_web::HttpResponseBuilder), ApiError> {
    let Generation {
        model,
        path,
        upstream,
        sources,
        count,
        format,
        usd_per_image,
        transparent,
    } = generation;
    let model = &*model;
    let most = media::nanos(usd_per_image, Decimal::from(count));
    let mut metered = media::meter(gateway, request, principal, model, most).await?;
    let task_gateway = gateway.clone();
    let (images, charged) = media::detached(async move {
        let gateway = task_gateway;
        // Images to edit named by URL are fetched only now, admitted and
        // held for.
        let files = match edit_files(&gateway, sources).await {
            Ok(files) => files,
            Err(error) => {
                metered.release();
                return Err(error);
            }
        };
        let started = std::time::Instant::now();
        let delivered = metered.call(&gateway, path, &upstream, files).await?;
        let backend_ms = started.elapsed().as_millis() as u64;
        let answer: Value = match serde_json::from_slice(&delivered.body) {
            Ok(answer) => answer,
            Err(_) => return Err(metered.unusable("not JSON")),
        };
        let items: Vec<Value> = match answer.get("data") {
            Some(Value::Array(items)) => items.iter().take(count).cloned().collect(),
            _ => return Err(metered.unusable("no data")),
        };
        let converted = tokio::task::spawn_blocking(move || {
            items
                .iter()
                .map(|item| {
                    image_of(item, format).and_then(|image| {
                        if transparent && !has_alpha(&image) {
                            return Err("an image without transparency".to_owned());
                        }
                        Ok(image)
                    })
                })
                .collect::<Vec<Result<Vec<u8>, String>>>()
        })
        .await
        .unwrap_or_default();
        // The images that are images are delivered (and charged); one that
        // is not is logged and left out.
        let mut encoded = Vec::with_capacity(converted.len());
        let mut why = None;
        for image in converted {
            match image {
                Ok(image) => encoded.push(image),
                Err(error) => why = Some(error),
            }
        }
        if let Some(why) = &why {
            tracing::warn!(
                why,
                delivered = encoded.len(),
                "a backend's image was left out"
            );
        }
        if encoded.is_empty() {
            return Err(metered.unusable(why.as_deref().unwrap_or("no image")));
        }
        let used = media::nanos(usd_per_image, Decimal::from(encoded.len()));
        let charged = metered.bill(&delivered, used).await?;
        let images = Images {
            encoded,
            format,
            backend_ms,
        };
        Ok((images, charged))
    })
    .await?;
    let mut response = charged.response(gateway, model);
    // Safe mode is the backend's moderation: what it refuses is a content
    // violation (a 400 with the header); nothing here is blurred.
    response.insert_header((gateway.brand.header_is_blurred.as_str(), "false"));
    response.insert_header((gateway.brand.header_is_content_violation.as_str(), "false"));
    Ok((images, response))
}

/// An image to edit: its bytes, or where to fetch them once the request
/// is admitted.
pub(crate) enum ImageSource {
    Bytes(Vec<u8>),
    Url(String),
}

/// The images of an edit as form files, in order (the first is the base):
/// each must be an image; those named by URL are fetched within the upload
/// budget the others leave.
async fn edit_files(
    gateway: &Gateway,
    sources: Vec<(&'static str, ImageSource)>,
) -> Result<Vec<rialto_proto::router::v1::MediaFile>, ApiError> {
    let mut budget = gateway.max_upload_bytes.saturating_sub(
        sources
            .iter()
            .map(|(_, source)| match source {
                ImageSource::Bytes(bytes) => bytes.len(),
                ImageSource::Url(_) => 0,
            })
            .sum(),
    );
    let multi = sources.len() > 1 || sources.first().is_some_and(|(f, _)| *f == "image[]");
    let list = if multi { "images" } else { "image" };
    let mut files = Vec::with_capacity(sources.len());
    for (index, (field, source)) in sources.into_iter().enumerate() {
        let bytes = match source {
            ImageSource::Bytes(bytes) => bytes,
            ImageSource::Url(url) => {
                let (_, bytes) = crate::files::fetch(&url, gateway.file_urls_allow_private, budget)
                    .await
                    .map_err(|why| invalid_at(&[list], why))?;
                budget -= bytes.len();
                bytes
            }
        };
        let kind = image::guess_format(&bytes)
            .map_err(|_| invalid_at(&[list], format!("Image {} is not an image", index + 1)))?;
        let extension = kind.extensions_str().first().copied().unwrap_or("png");
        files.push(rialto_proto::router::v1::MediaFile {
            field: field.to_owned(),
            filename: format!("image-{}.{extension}", index + 1),
            content_type: kind.to_mime_type().to_owned(),
            data: bytes,
        });
    }
    Ok(files)
}

/// Whether an image (PNG or WebP, as the backend encoded it) can be
/// transparent: a PNG of a colour type with alpha or with a `tRNS` chunk,
/// a WebP whose decoder reports alpha.
fn has_alpha(bytes: &[u8]) -> bool {
    match image::guess_format(bytes) {
        Ok(image::ImageFormat::Png) => {
            // IHDR's colour type: 4 (grey and alpha) or 6 (RGBA).
            matches!(bytes.get(25), Some(4 | 6))
                || bytes.windows(4).take(64 * 1024).any(|w| w == b"tRNS")
        }
        Ok(format) => image::ImageReader::with_format(std::io::Cursor::new(bytes), format)
            .decode()
            .is_ok_and(|image| image.color().has_alpha()),
        Err(_) => false,
    }
}

/// One image of a backend's answer (`b64_json`, or a `data:` URL) as bytes
/// of `format`: in that format, its header is read to prove it is one; in
/// another, it is decoded and re-encoded.
fn image_of(item: &Value, format: &str) -> Result<Vec<u8>, String> {
    let b64 = match (item.get("b64_json"), item.get("url")) {
        (Some(Value::String(b64)), _) => b64.as_str(),
        (_, Some(Value::String(url))) => url
            .strip_prefix("data:")
            .and_then(|rest| rest.split_once(";base64,"))
            .map(|(_, b64)| b64)
            .ok_or("an image URL that is not a data URL")?,
        _ => return Err("an item without b64_json".into()),
    };
    let bytes = BASE64
        .decode(b64.trim())
        .map_err(|_| "an image that is not base64")?;
    let wanted = match format {
        "jpeg" => image::ImageFormat::Jpeg,
        "webp" => image::ImageFormat::WebP,
        _ => image::ImageFormat::Png,
    };
    let found = image::guess_format(&bytes).map_err(|_| "bytes that are not an image")?;
    // A few bytes can claim a huge picture: decoding is bounded.
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_DECODED_SIDE);
    limits.max_image_height = Some(MAX_DECODED_SIDE);
    limits.max_alloc = Some(MAX_DECODED_BYTES);
    let mut reader = image::ImageReader::with_format(std::io::Cursor::new(&bytes), found);
    reader.limits(limits);
    if found == wanted {
        // Its header read is proof enough; the pixels pass untouched.
        reader
            .into_dimensions()
            .map_err(|e| format!("an image whose header does not decode: {e}"))?;
        return Ok(bytes);
    }
    let decoded = reader
        .decode()
        .map_err(|e| format!("an image that does not decode: {e}"))?;
    let decoded = match wanted {
        // JPEG has no alpha channel.
        image::ImageFormat::Jpeg => image::DynamicImage::ImageRgb8(decoded.to_rgb8()),
        _ => decoded,
    };
    let mut out = std::io::Cursor::new(Vec::new());
    decoded
        .write_to(&mut out, wanted)
        .map_err(|e| format!("the image could not be re-encoded: {e}"))?;
    Ok(out.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(width: u32, height: u32) -> Vec<u8> {
        let image = image::RgbaImage::from_pixel(width, height, image::Rgba([10, 20, 30, 255]));
        let mut out = std::io::Cursor::new(Vec::new());
        image.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    #[test]
    fn an_image_in_the_wanted_format_passes_untouched() {
        let bytes = png(8, 4);
        let item = json!({"b64_json": BASE64.encode(&bytes)});
        assert_eq!(image_of(&item, "png").unwrap(), bytes);
    }

    #[test]
    fn an_image_in_another_format_is_reencoded() {
        let item = json!({"url": format!("data:image/png;base64,{}", BASE64.encode(png(8, 4)))});
        for (format, wanted) in [
            ("jpeg", image::ImageFormat::Jpeg),
            ("webp", image::ImageFormat::WebP),
        ] {
            let bytes = image_of(&item, format).unwrap();
            assert_eq!(image::guess_format(&bytes).unwrap(), wanted);
            let decoded = image::load_from_memory(&bytes).unwrap();
            assert_eq!((decoded.width(), decoded.height()), (8, 4));
        }
    }

    #[test]
    fn a_picture_larger_than_its_bound_is_refused_not_decoded() {
        let huge = image::GrayImage::new(MAX_DECODED_SIDE + 1, 1);
        let mut out = std::io::Cursor::new(Vec::new());
        huge.write_to(&mut out, image::ImageFormat::Png).unwrap();
        let item = json!({"b64_json": BASE64.encode(out.into_inner())});
        let why = image_of(&item, "jpeg").unwrap_err();
        assert!(why.contains("does not decode"), "{why}");
    }

    #[test]
    fn what_is_not_an_image_is_refused() {
        for item in [
            json!({"b64_json": BASE64.encode(b"GIF89a not really")}),
            json!({"b64_json": "%%%"}),
            json!({"url": "https://example.com/a.png"}),
            json!({}),
        ] {
            assert!(image_of(&item, "png").is_err(), "{item}");
        }
    }
}
