//! The mock upstream's media calls: OpenAI's image generation and edits, speech and transcription.
//!
//! [`MockUpstream`](crate::MockUpstream) routes these here. Every answer is real media made at
//! request time (no fixtures), so a test can decode what the gateway relays:
//!
//! - `POST /v1/images/generations` (JSON): `n` images (1 to 10) of `size` (`WxH`, each side
//!   1 to 2048, or `auto` = 1024x1024) in `output_format` (`png`, `jpeg` or lossless `webp`),
//!   as `{"created", "data": [{"b64_json"}]}` or, with `response_format: "url"`, `data:` URLs.
//!   The pixels (a vertical gradient with a few stripes, quick to compress) follow from a hash of
//!   the prompt, the `seed` and the image's index: one request's images differ, and the same
//!   request repeats exactly. A prompt with the word `forbidden` is refused as OpenAI's safety
//!   system refuses (`400`, code `moderation_blocked`).
//! - `POST /v1/images/edits` (multipart): the first `image` (or `image[]`) file with its colours
//!   inverted, at `size` if given, else the input's size; same answer shape.
//!   With `background: "transparent"` (png or webp) the image is not inverted: every pixel of the
//!   top-left pixel's colour becomes transparent instead (a background removed).
//! - `POST /v1/image/upscale` (the hosted API's call, JSON `{image: <base64>, scale}`): the image
//!   enlarged `scale` times (2 to 4, Lanczos), as PNG bytes.
//! - `POST /v1/audio/speech` (JSON): a 24 kHz mono 16-bit sine tone, 0.25 s per word of `input`
//!   divided by `speed`, as a WAV (`response_format: "wav"`) or raw little-endian PCM (`"pcm"`),
//!   streamed in 4 KiB pieces. Other formats (OpenAI's default `mp3` included) are a `400`: the
//!   mock cannot encode them. The WAV carries `input` in a `mock` RIFF chunk before its `data`
//!   chunk, which WAV readers skip and the mock transcription reads back.
//! - `POST /v1/audio/transcriptions` (multipart): reads `file` as a WAV; the transcript is the
//!   `mock` chunk's text, else `mock transcript of {seconds} seconds`, spread evenly over the
//!   audio in segments of one sentence or up to 8 words, answered as `json`, `text`,
//!   `verbose_json` (with `words` when `timestamp_granularities[]` asks for `word`), `srt` or
//!   `vtt`.
//!
//! Each request is recorded before it is answered
//! ([`MockUpstream::requests`](crate::MockUpstream::requests), with its path in
//! [`MockUpstream::paths`](crate::MockUpstream::paths)): a JSON body as sent; a multipart form as
//! an object of its fields, text fields as strings and file fields as
//! `{"filename", "content_type", "bytes": <length>}`, with a field that repeats or whose name ends
//! in `[]` as an array. [`MockUpstream::fail_next`](crate::MockUpstream::fail_next) fails media
//! calls as it fails chat ones.

use std::f64::consts::TAU;
use std::io::Cursor;

use actix_multipart::Multipart;
use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use futures_util::StreamExt as _;
use image::codecs::jpeg::JpegEncoder;
use image::codecs::png::{CompressionType, FilterType, PngEncoder};
use image::codecs::webp::WebPEncoder;
use image::{DynamicImage, RgbImage};
use serde_json::{Map, Value, json};

use crate::mock_upstream::{State, unix_now};

/// The most images one request may ask for (OpenAI's limit).
const MAX_IMAGES: u64 = 10;
/// The longest side of an image the mock draws.
const MAX_SIDE: u32 = 2048;
/// The speech sample rate (OpenAI's `wav` and `pcm` are 24 kHz mono 16-bit).
const SAMPLE_RATE: u32 = 24_000;
/// Speech length per word of input, at speed 1.
const SECONDS_PER_WORD: f64 = 0.25;
/// The longest speech input OpenAI accepts, in characters.
const MAX_SPEECH_INPUT: usize = 4096;
/// The RIFF chunk in which the mock's WAVs carry their text.
const TEXT_CHUNK: &[u8; 4] = b"mock";
/// The size of the pieces a speech body is streamed in.
const STREAM_PIECE: usize = 4096;
/// The most words in one transcription segment.
const SEGMENT_WORDS: usize = 8;

/// An OpenAI error answer not yet built: small enough to pass around with `?`, which an
/// [`HttpResponse`] is not.
struct Refusal {
    status: StatusCode,
    body: Value,
}

impl Refusal {
    fn new(status: StatusCode, kind: &str, code: &str, param: Option<&str>, message: &str) -> Self {
        Self {
            status,
            body: json!({"error": {"message": message, "type": kind, "code": code, "param": param}}),
        }
    }

    fn into_response(self) -> HttpResponse {
        HttpResponse::build(self.status).json(self.body)
    }
}

/// A `400` with OpenAI's error body for a bad parameter.
fn invalid(param: &str, code: &str, message: &str) -> Refusal {
    Refusal::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        code,
        Some(param),
        message,
    )
}

/// A `500` for something the mock itself failed to make.
fn internal(what: &str) -> Refusal {
    Refusal::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "mock_internal_error",
        None,
        &format!("the mock could not {what}"),
    )
}

/// Parses a JSON body, or answers OpenAI's `400` for one that is not (as the chat route does).
fn json_body(raw: &[u8]) -> Result<Value, Refusal> {
    serde_json::from_slice(raw).map_err(|e| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_json",
            None,
            &format!("invalid JSON body: {e}"),
        )
    })
}

// ---------------------------------------------------------------------------------------------
// Multipart forms
// ---------------------------------------------------------------------------------------------

/// One field of a multipart form.
enum Part {
    Text(String),
    File {
        filename: Option<String>,
        content_type: Option<String>,
        bytes: Vec<u8>,
    },
}

/// A multipart form's fields, in the order sent.
struct Form(Vec<(String, Part)>);

impl Form {
    /// Reads the whole form, or answers `400` for a body that is not one.
    async fn read(req: &HttpRequest, payload: web::Payload) -> Result<Self, Refusal> {
        let unreadable = |e: actix_multipart::MultipartError| {
            invalid(
                "body",
                "invalid_multipart",
                &format!("the multipart/form-data body could not be read: {e}"),
            )
        };
        let mut multipart = Multipart::new(req.headers(), payload);
        let mut fields = Vec::new();
        while let Some(field) = multipart.next().await {
            let mut field = field.map_err(unreadable)?;
            let name = field.name().unwrap_or_default().to_owned();
            let filename = field
                .content_disposition()
                .and_then(|d| d.get_filename())
                .map(str::to_owned);
            let content_type = field.content_type().map(ToString::to_string);
            let mut bytes = Vec::new();
            while let Some(chunk) = field.next().await {
                bytes.extend_from_slice(&chunk.map_err(unreadable)?);
            }
            // A part with a filename is a file, as browsers and SDKs send them.
            let part = match filename {
                Some(_) => Part::File {
                    filename,
                    content_type,
                    bytes,
                },
                None => Part::Text(String::from_utf8_lossy(&bytes).into_owned()),
            };
            fields.push((name, part));
        }
        Ok(Self(fields))
    }

    /// The first text field `name`, trimmed.
    fn text<'a>(&'a self, name: &'a str) -> Option<&'a str> {
        self.texts(name).next()
    }

    /// Every text field `name`, trimmed, in order.
    fn texts<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> {
        self.0.iter().filter_map(move |(n, part)| match part {
            Part::Text(text) if n == name => Some(text.trim()),
            _ => None,
        })
    }

    /// The contents of the first file among the fields named in `names`.
    fn first_file(&self, names: &[&str]) -> Option<&[u8]> {
        self.0.iter().find_map(|(n, part)| match part {
            Part::File { bytes, .. } if names.contains(&n.as_str()) => Some(bytes.as_slice()),
            _ => None,
        })
    }

    /// The form as the request log records it.
    fn to_json(&self) -> Value {
        let mut object = Map::new();
        for (name, part) in &self.0 {
            let value = match part {
                Part::Text(text) => Value::String(text.clone()),
                Part::File {
                    filename,
                    content_type,
                    bytes,
                } => {
                    json!({"filename": filename, "content_type": content_type, "bytes": bytes.len()})
                }
            };
            let repeated =
                name.ends_with("[]") || self.0.iter().filter(|(n, _)| n == name).count() > 1;
            if !repeated {
                object.insert(name.clone(), value);
            } else if let Value::Array(items) = object
                .entry(name.clone())
                .or_insert_with(|| Value::Array(Vec::new()))
            {
                items.push(value);
            }
        }
        object.into()
    }
}

// ---------------------------------------------------------------------------------------------
// Parameters
// ---------------------------------------------------------------------------------------------

fn missing(param: &str) -> Refusal {
    invalid(
        param,
        "missing_required_parameter",
        &format!("Missing required parameter: '{param}'."),
    )
}

/// JSON member `key` as a string: absent (or `null`) is `None`, another type a `400`.
fn string_member<'a>(body: &'a Value, key: &str) -> Result<Option<&'a str>, Refusal> {
    match &body[key] {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s)),
        _ => Err(invalid(
            key,
            "invalid_type",
            &format!("Invalid type for '{key}': expected a string."),
        )),
    }
}

/// The number of images asked for, from 1 to [`MAX_IMAGES`].
fn image_count(n: Option<u64>) -> Result<usize, Refusal> {
    match n.unwrap_or(1) {
        n @ 1..=MAX_IMAGES => Ok(n as usize),
        n => Err(invalid(
            "n",
            "invalid_value",
            &format!("Invalid 'n': expected an integer from 1 to {MAX_IMAGES}, got {n}."),
        )),
    }
}

/// `WxH` as a width and height; `None` for `auto` or no size (the caller's default).
fn image_size(size: Option<&str>) -> Result<Option<(u32, u32)>, Refusal> {
    let size = match size {
        None | Some("auto") => return Ok(None),
        Some(size) => size,
    };
    let side = |s: &str| s.parse::<u32>().ok().filter(|n| (1..=MAX_SIDE).contains(n));
    match size.split_once('x').and_then(|(w, h)| side(w).zip(side(h))) {
        Some(size) => Ok(Some(size)),
        None => Err(invalid(
            "size",
            "invalid_value",
            &format!(
                "Invalid value: '{size}'. Supported sizes are 'auto' and 'WxH' with each side from 1 to {MAX_SIDE}."
            ),
        )),
    }
}

/// Whether images are answered as `data:` URLs (`url`) rather than `b64_json`.
fn as_urls(response_format: Option<&str>) -> Result<bool, Refusal> {
    match response_format.unwrap_or("b64_json") {
        "b64_json" => Ok(false),
        "url" => Ok(true),
        other => Err(invalid(
            "response_format",
            "invalid_value",
            &format!("Invalid value: '{other}'. Supported values are: 'b64_json' and 'url'."),
        )),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ImageFormat {
    Png,
    Jpeg,
    Webp,
}

impl ImageFormat {
    fn parse(output_format: Option<&str>) -> Result<Self, Refusal> {
        match output_format.unwrap_or("png") {
            "png" => Ok(Self::Png),
            "jpeg" => Ok(Self::Jpeg),
            "webp" => Ok(Self::Webp),
            other => Err(invalid(
                "output_format",
                "invalid_value",
                &format!(
                    "Invalid value: '{other}'. Supported values are: 'png', 'jpeg', and 'webp'."
                ),
            )),
        }
    }

    fn mime(self) -> &'static str {
        match self {
            Self::Png => "image/png",
            Self::Jpeg => "image/jpeg",
            Self::Webp => "image/webp",
        }
    }
}

/// What an image request asks for besides its input and prompt.
struct ImageOptions {
    n: usize,
    size: Option<(u32, u32)>,
    urls: bool,
    format: ImageFormat,
}

// ---------------------------------------------------------------------------------------------
// Images
// ---------------------------------------------------------------------------------------------

/// Whether OpenAI's safety system (as the mock plays it) refuses `prompt`: it has the word
/// `forbidden` (in any case; not as part of a longer word).
fn moderated(prompt: &str) -> bool {
    prompt
        .split(|c: char| !c.is_alphanumeric())
        .any(|word| word.eq_ignore_ascii_case("forbidden"))
}

fn moderation_blocked() -> Refusal {
    Refusal::new(
        StatusCode::BAD_REQUEST,
        "image_generation_user_error",
        "moderation_blocked",
        None,
        "Your request was rejected by the safety system.",
    )
}

/// FNV-1a over `parts`, each closed by a separator so `("ab", "c")` and `("a", "bc")` differ:
/// stable across runs and Rust versions, unlike `DefaultHasher`.
pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    const PRIME: u64 = 0x0100_0000_01b3;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &byte in part.iter().chain(&[0xff]) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(PRIME);
        }
    }
    hash
}

/// SplitMix64: turns one hash into as many well-mixed numbers as a picture needs.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn colour(&mut self) -> [u8; 3] {
        let [r, g, b, ..] = self.next().to_le_bytes();
        [r, g, b]
    }
}

/// A picture drawn from `key`: a vertical gradient between two colours crossed by three
/// horizontal stripes. Every row is one colour, so the PNG filters leave little to compress and
/// even a debug build encodes 1024x1024 quickly.
fn generated_image(width: u32, height: u32, key: u64) -> Option<RgbImage> {
    let mut rng = SplitMix(key);
    let (top, bottom, stripe) = (rng.colour(), rng.colour(), rng.colour());
    let stripes: Vec<(u32, u32)> = (0..3)
        .map(|_| {
            let at = (rng.next() % u64::from(height.max(1))) as u32;
            let thickness = 1 + (rng.next() % u64::from(height / 16 + 1)) as u32;
            (at, at.saturating_add(thickness))
        })
        .collect();
    let span = f64::from(height.saturating_sub(1).max(1));
    let mut pixels = Vec::with_capacity(width as usize * height as usize * 3);
    for y in 0..height {
        let colour = if stripes.iter().any(|&(from, to)| (from..to).contains(&y)) {
            stripe
        } else {
            let t = f64::from(y) / span;
            let mix =
                |a: u8, b: u8| (f64::from(a) + (f64::from(b) - f64::from(a)) * t).round() as u8;
            [
                mix(top[0], bottom[0]),
                mix(top[1], bottom[1]),
                mix(top[2], bottom[2]),
            ]
        };
        pixels.extend_from_slice(&colour.repeat(width as usize));
    }
    RgbImage::from_raw(width, height, pixels)
}

/// `image` encoded as `format` (JPEG has no alpha: it gets the RGB of an RGBA image).
fn encode(image: &DynamicImage, format: ImageFormat) -> image::ImageResult<Vec<u8>> {
    let mut out = Vec::new();
    match format {
        // Fast deflate over the `Sub` filter, which turns a one-colour row into zeros: about
        // 70 ms and 22 KB for 1024x1024 in a debug build (the adaptive filter: three times as
        // long).
        ImageFormat::Png => image.write_with_encoder(PngEncoder::new_with_quality(
            &mut out,
            CompressionType::Fast,
            FilterType::Sub,
        ))?,
        ImageFormat::Jpeg if image.color().has_alpha() => DynamicImage::ImageRgb8(image.to_rgb8())
            .write_with_encoder(JpegEncoder::new_with_quality(&mut out, 90))?,
        ImageFormat::Jpeg => {
            image.write_with_encoder(JpegEncoder::new_with_quality(&mut out, 90))?;
        }
        ImageFormat::Webp => image.write_with_encoder(WebPEncoder::new_lossless(&mut out))?,
    }
    Ok(out)
}

/// OpenAI's images answer: `{"created", "data": [{"b64_json"} or {"url"}]}`.
fn images_response(images: &[Vec<u8>], options: &ImageOptions) -> HttpResponse {
    let data: Vec<Value> = images
        .iter()
        .map(|bytes| {
            let b64 = BASE64.encode(bytes);
            if options.urls {
                json!({"url": format!("data:{};base64,{b64}", options.format.mime())})
            } else {
                json!({"b64_json": b64})
            }
        })
        .collect();
    HttpResponse::Ok().json(json!({"created": unix_now(), "data": data}))
}

/// `POST /v1/images/generations`.
pub(crate) async fn image_generations(
    req: HttpRequest,
    raw: web::Bytes,
    state: web::Data<State>,
) -> HttpResponse {
    let body = match json_body(&raw) {
        Ok(body) => body,
        Err(refusal) => return refusal.into_response(),
    };
    if let Some(failure) = state.record_or_fail(&req, body.clone()) {
        return failure;
    }
    generate(&body).await.unwrap_or_else(Refusal::into_response)
}

async fn generate(body: &Value) -> Result<HttpResponse, Refusal> {
    let prompt = string_member(body, "prompt")?.ok_or_else(|| missing("prompt"))?;
    let n = match &body["n"] {
        Value::Null => None,
        n => Some(n.as_u64().ok_or_else(|| {
            invalid(
                "n",
                "invalid_type",
                "Invalid type for 'n': expected an integer.",
            )
        })?),
    };
    let options = ImageOptions {
        n: image_count(n)?,
        size: image_size(string_member(body, "size")?)?,
        urls: as_urls(string_member(body, "response_format")?)?,
        format: ImageFormat::parse(string_member(body, "output_format")?)?,
    };
    // The seed's JSON text keys the pixels; no seed keys them as the empty string.
    let seed = match &body["seed"] {
        Value::Null => String::new(),
        seed if seed.is_i64() || seed.is_u64() => seed.to_string(),
        _ => {
            return Err(invalid(
                "seed",
                "invalid_type",
                "Invalid type for 'seed': expected an integer.",
            ));
        }
    };
    if moderated(prompt) {
        return Err(moderation_blocked());
    }
    let (width, height) = options.size.unwrap_or((1024, 1024));
    let (prompt, n, format) = (prompt.to_owned(), options.n, options.format);
    // Encoding is CPU work: off the server's thread, so other requests keep being served.
    let drawn = web::block(move || {
        (0..n)
            .map(|index| {
                let key = fnv1a(&[prompt.as_bytes(), seed.as_bytes(), &index.to_le_bytes()]);
                let image = generated_image(width, height, key)
                    .ok_or_else(|| "the pixel buffer has the wrong length".to_owned())?;
                encode(&DynamicImage::ImageRgb8(image), format).map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, String>>()
    })
    .await;
    match drawn {
        Ok(Ok(images)) => Ok(images_response(&images, &options)),
        Ok(Err(e)) => Err(internal(&format!("draw the image: {e}"))),
        Err(e) => Err(internal(&format!("draw the image: {e}"))),
    }
}

/// Why an edit failed: its input, or the mock.
enum EditFailure {
    Input(String),
    Mock(String),
}

/// `POST /v1/images/edits`.
pub(crate) async fn image_edits(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<State>,
) -> HttpResponse {
    let form = match Form::read(&req, payload).await {
        Ok(form) => form,
        Err(refusal) => return refusal.into_response(),
    };
    if let Some(failure) = state.record_or_fail(&req, form.to_json()) {
        return failure;
    }
    edit(&form).await.unwrap_or_else(Refusal::into_response)
}

async fn edit(form: &Form) -> Result<HttpResponse, Refusal> {
    let prompt = form.text("prompt").ok_or_else(|| missing("prompt"))?;
    let n = match form.text("n") {
        None => None,
        Some(n) => Some(n.parse::<u64>().map_err(|_| {
            invalid(
                "n",
                "invalid_type",
                "Invalid type for 'n': expected an integer.",
            )
        })?),
    };
    let options = ImageOptions {
        n: image_count(n)?,
        size: image_size(form.text("size"))?,
        urls: as_urls(form.text("response_format"))?,
        format: ImageFormat::parse(form.text("output_format"))?,
    };
    let input = form
        .first_file(&["image", "image[]"])
        .ok_or_else(|| missing("image"))?
        .to_vec();
    if moderated(prompt) {
        return Err(moderation_blocked());
    }
    let (size, format) = (options.size, options.format);
    let transparent = match form.text("background") {
        None | Some("auto" | "opaque") => false,
        Some("transparent") if format != ImageFormat::Jpeg => true,
        Some("transparent") => {
            return Err(invalid(
                "background",
                "invalid_value",
                "A transparent background needs png or webp.",
            ));
        }
        Some(other) => {
            return Err(invalid(
                "background",
                "invalid_value",
                &format!("Invalid value: '{other}'."),
            ));
        }
    };
    let edited = web::block(move || {
        let decoded =
            image::load_from_memory(&input).map_err(|e| EditFailure::Input(e.to_string()))?;
        let mut image = if transparent {
            // The background is the top-left pixel's colour: every pixel of it becomes
            // transparent, the rest is kept as it was.
            let mut rgba = decoded.to_rgba8();
            let background = *rgba.get_pixel(0, 0);
            for pixel in rgba.pixels_mut() {
                if pixel.0[..3] == background.0[..3] {
                    pixel.0[3] = 0;
                }
            }
            DynamicImage::ImageRgba8(rgba)
        } else if decoded.color().has_alpha() {
            // Plain 8-bit RGB(A), which every encoder here takes.
            DynamicImage::ImageRgba8(decoded.to_rgba8())
        } else {
            DynamicImage::ImageRgb8(decoded.to_rgb8())
        };
        if !transparent {
            // Inverted colours: plainly derived from the input, so a test can tell it was
            // edited.
            image.invert();
        }
        if let Some((width, height)) = size
            && (width, height) != (image.width(), image.height())
        {
            image = image.resize_exact(width, height, image::imageops::FilterType::Nearest);
        }
        encode(&image, format).map_err(|e| EditFailure::Mock(e.to_string()))
    })
    .await;
    match edited {
        Ok(Ok(bytes)) => Ok(images_response(&vec![bytes; options.n], &options)),
        Ok(Err(EditFailure::Input(e))) => Err(invalid(
            "image",
            "invalid_image_format",
            &format!("Invalid image file: the image could not be decoded ({e})."),
        )),
        Ok(Err(EditFailure::Mock(e))) => Err(internal(&format!("encode the image: {e}"))),
        Err(e) => Err(internal(&format!("edit the image: {e}"))),
    }
}

/// `POST /v1/image/upscale` (the hosted API's call, JSON): `image` (base64) enlarged `scale`
/// times (2 to 4) with a Lanczos filter, answered as PNG bytes.
pub(crate) async fn upscale(
    req: HttpRequest,
    raw: web::Bytes,
    state: web::Data<State>,
) -> HttpResponse {
    let body = match json_body(&raw) {
        Ok(body) => body,
        Err(refusal) => return refusal.into_response(),
    };
    let mut recorded = body.clone();
    if let Some(image) = recorded.get_mut("image") {
        // The log keeps the image's length, not the image.
        *image = json!({"bytes": image.as_str().map_or(0, str::len)});
    }
    if let Some(failure) = state.record_or_fail(&req, recorded) {
        return failure;
    }
    let scale = body["scale"].as_f64().unwrap_or(2.0);
    if !(2.0..=4.0).contains(&scale) {
        return invalid("scale", "invalid_value", "scale must be 2 to 4").into_response();
    }
    let Some(input) = body["image"]
        .as_str()
        .and_then(|b64| BASE64.decode(b64).ok())
    else {
        return invalid("image", "invalid_image", "image must be base64").into_response();
    };
    let upscaled = web::block(move || {
        let image = image::load_from_memory(&input).map_err(|e| e.to_string())?;
        let (width, height) = (
            (f64::from(image.width()) * scale).round() as u32,
            (f64::from(image.height()) * scale).round() as u32,
        );
        let larger = image.resize_exact(width, height, image::imageops::FilterType::Lanczos3);
        encode(&larger, ImageFormat::Png).map_err(|e| e.to_string())
    })
    .await;
    match upscaled {
        Ok(Ok(png)) => HttpResponse::Ok().content_type("image/png").body(png),
        Ok(Err(e)) => invalid("image", "invalid_image_format", &e).into_response(),
        Err(e) => internal(&format!("upscale the image: {e}")).into_response(),
    }
}

// ---------------------------------------------------------------------------------------------
// Speech
// ---------------------------------------------------------------------------------------------

/// A 440 Hz tone as long as `words` words spoken at `speed` (at least one word's length).
fn tone(words: usize, speed: f64) -> Vec<i16> {
    let seconds = (SECONDS_PER_WORD * words as f64 / speed).max(SECONDS_PER_WORD);
    let count = (seconds * f64::from(SAMPLE_RATE)).round() as usize;
    let step = TAU * 440.0 / f64::from(SAMPLE_RATE);
    (0..count)
        .map(|i| ((i as f64 * step).sin() * 8000.0) as i16)
        .collect()
}

/// Where chunk `id` of a RIFF/WAVE file starts (its header) and its contents (cut at the end of
/// the file); `None` if the file is not RIFF/WAVE or has no such chunk.
fn find_chunk<'a>(wav: &'a [u8], id: &[u8; 4]) -> Option<(usize, &'a [u8])> {
    if wav.get(0..4)? != b"RIFF" || wav.get(8..12)? != b"WAVE" {
        return None;
    }
    let mut at = 12usize;
    while let Some(header) = wav.get(at..at.checked_add(8)?) {
        let size = u32::from_le_bytes(header[4..8].try_into().ok()?) as usize;
        let start = at + 8;
        if &header[..4] == id {
            let end = start.saturating_add(size).min(wav.len());
            return Some((at, &wav[start..end]));
        }
        // RIFF pads a chunk of odd size with one byte.
        at = start.checked_add(size)?.checked_add(size % 2)?;
    }
    None
}

/// `wav` with a chunk `id` holding `contents` inserted before its `data` chunk, and its RIFF
/// size fixed. Readers (hound's included) skip a chunk they do not know before `data`.
fn insert_chunk(mut wav: Vec<u8>, id: &[u8; 4], contents: &[u8]) -> Result<Vec<u8>, String> {
    let (at, _) = find_chunk(&wav, b"data").ok_or("the WAV has no data chunk")?;
    // hound skips an unknown chunk by its declared size without RIFF's pad byte: an even size
    // (a NUL added to odd contents) reads the same in hound and in spec-following readers.
    let mut contents = contents.to_vec();
    if contents.len() % 2 == 1 {
        contents.push(0);
    }
    let size = u32::try_from(contents.len()).map_err(|_| "the chunk is too large")?;
    let mut chunk = Vec::with_capacity(8 + contents.len());
    chunk.extend_from_slice(id);
    chunk.extend_from_slice(&size.to_le_bytes());
    chunk.extend_from_slice(&contents);
    wav.splice(at..at, chunk);
    let riff_size = u32::try_from(wav.len() - 8).map_err(|_| "the WAV is too large")?;
    wav.get_mut(4..8)
        .ok_or("the WAV has no RIFF header")?
        .copy_from_slice(&riff_size.to_le_bytes());
    Ok(wav)
}

/// `samples` as a 24 kHz mono 16-bit WAV that carries `text` in its `mock` chunk.
fn wav_with_text(samples: &[i16], text: &str) -> Result<Vec<u8>, String> {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: SAMPLE_RATE,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut wav = Cursor::new(Vec::with_capacity(64 + samples.len() * 2));
    let mut writer = hound::WavWriter::new(&mut wav, spec).map_err(|e| e.to_string())?;
    for &sample in samples {
        writer.write_sample(sample).map_err(|e| e.to_string())?;
    }
    writer.finalize().map_err(|e| e.to_string())?;
    insert_chunk(wav.into_inner(), TEXT_CHUNK, text.as_bytes())
}

/// `bytes` as a streamed (chunked) body in [`STREAM_PIECE`]-byte pieces, as a relaying client
/// would see a real text-to-speech server send it.
fn streamed(bytes: Vec<u8>, content_type: &'static str) -> HttpResponse {
    let bytes = Bytes::from(bytes);
    let pieces: Vec<Result<Bytes, std::io::Error>> = (0..bytes.len())
        .step_by(STREAM_PIECE)
        .map(|at| Ok(bytes.slice(at..(at + STREAM_PIECE).min(bytes.len()))))
        .collect();
    HttpResponse::Ok()
        .content_type(content_type)
        .streaming(futures_util::stream::iter(pieces))
}

/// `POST /v1/audio/speech`.
pub(crate) async fn speech(
    req: HttpRequest,
    raw: web::Bytes,
    state: web::Data<State>,
) -> HttpResponse {
    let body = match json_body(&raw) {
        Ok(body) => body,
        Err(refusal) => return refusal.into_response(),
    };
    if let Some(failure) = state.record_or_fail(&req, body.clone()) {
        return failure;
    }
    speak(&body).await.unwrap_or_else(Refusal::into_response)
}

async fn speak(body: &Value) -> Result<HttpResponse, Refusal> {
    let input = string_member(body, "input")?.ok_or_else(|| missing("input"))?;
    if input.chars().count() > MAX_SPEECH_INPUT {
        return Err(invalid(
            "input",
            "string_above_max_length",
            &format!(
                "Invalid 'input': string too long. Expected a string with maximum length {MAX_SPEECH_INPUT}."
            ),
        ));
    }
    // OpenAI's default is mp3, which the mock cannot encode: it says so rather than mislabel a WAV.
    let wav = match string_member(body, "response_format")?.unwrap_or("mp3") {
        "wav" => true,
        "pcm" => false,
        other => {
            return Err(invalid(
                "response_format",
                "unsupported_value",
                &format!(
                    "Unsupported response_format '{other}': the mock upstream produces only 'wav' and 'pcm'."
                ),
            ));
        }
    };
    let speed = match &body["speed"] {
        Value::Null => 1.0,
        speed => speed
            .as_f64()
            .filter(|s| (0.25..=4.0).contains(s))
            .ok_or_else(|| {
                invalid(
                    "speed",
                    "invalid_value",
                    "Invalid 'speed': expected a number from 0.25 to 4.0.",
                )
            })?,
    };
    let (words, text) = (input.split_whitespace().count(), input.to_owned());
    let audio = web::block(move || {
        let samples = tone(words, speed);
        if wav {
            wav_with_text(&samples, &text)
        } else {
            Ok(samples.iter().flat_map(|s| s.to_le_bytes()).collect())
        }
    })
    .await;
    match audio {
        Ok(Ok(bytes)) => Ok(streamed(bytes, if wav { "audio/wav" } else { "audio/pcm" })),
        Ok(Err(e)) => Err(internal(&format!("make the audio: {e}"))),
        Err(e) => Err(internal(&format!("make the audio: {e}"))),
    }
}

// ---------------------------------------------------------------------------------------------
// Transcription
// ---------------------------------------------------------------------------------------------

/// A stretch of the transcript and when it is spoken, in seconds.
struct Timed {
    text: String,
    start: f64,
    end: f64,
}

/// Seconds rounded to the millisecond, as JSON shows them.
fn millis(seconds: f64) -> f64 {
    (seconds * 1000.0).round() / 1000.0
}

/// `HH:MM:SS,mmm` (SRT, `separator` `,`) or `HH:MM:SS.mmm` (WebVTT, `.`).
fn subtitle_time(seconds: f64, separator: char) -> String {
    let ms = (seconds * 1000.0).round() as u64;
    format!(
        "{:02}:{:02}:{:02}{separator}{:03}",
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000
    )
}

/// The transcript's words and segments (a sentence, or up to [`SEGMENT_WORDS`] words), every
/// word given an equal share of `duration`, so the segments cover it end to end.
fn timeline(text: &str, duration: f64) -> (Vec<Timed>, Vec<Timed>) {
    let words: Vec<&str> = text.split_whitespace().collect();
    let share = duration / words.len().max(1) as f64;
    let timed_words = words
        .iter()
        .enumerate()
        .map(|(i, word)| Timed {
            text: (*word).to_owned(),
            start: i as f64 * share,
            end: (i + 1) as f64 * share,
        })
        .collect();
    let mut segments = Vec::new();
    let mut first = 0;
    for (i, word) in words.iter().enumerate() {
        let last = i + 1 == words.len();
        if last || i + 1 - first == SEGMENT_WORDS || word.ends_with(['.', '!', '?']) {
            segments.push(Timed {
                text: words[first..=i].join(" "),
                start: first as f64 * share,
                end: (i + 1) as f64 * share,
            });
            first = i + 1;
        }
    }
    (timed_words, segments)
}

/// `POST /v1/audio/transcriptions`.
pub(crate) async fn transcriptions(
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<State>,
) -> HttpResponse {
    let form = match Form::read(&req, payload).await {
        Ok(form) => form,
        Err(refusal) => return refusal.into_response(),
    };
    if let Some(failure) = state.record_or_fail(&req, form.to_json()) {
        return failure;
    }
    transcribe(&form).unwrap_or_else(Refusal::into_response)
}

fn transcribe(form: &Form) -> Result<HttpResponse, Refusal> {
    let format = form.text("response_format").unwrap_or("json");
    if !matches!(format, "json" | "text" | "verbose_json" | "srt" | "vtt") {
        return Err(invalid(
            "response_format",
            "invalid_value",
            &format!(
                "Invalid value: '{format}'. Supported values are: 'json', 'text', 'srt', 'verbose_json', and 'vtt'."
            ),
        ));
    }
    let audio = form.first_file(&["file"]).ok_or_else(|| missing("file"))?;
    let reader = hound::WavReader::new(Cursor::new(audio)).map_err(|e| {
        invalid(
            "file",
            "invalid_value",
            &format!(
                "The audio file could not be decoded or its format is not supported (the mock reads WAV only: {e})."
            ),
        )
    })?;
    let duration = f64::from(reader.duration()) / f64::from(reader.spec().sample_rate.max(1));
    let text = find_chunk(audio, TEXT_CHUNK)
        .map(|(_, contents)| {
            String::from_utf8_lossy(contents)
                .trim_end_matches('\0')
                .trim()
                .to_owned()
        })
        .filter(|text| !text.is_empty())
        .unwrap_or_else(|| format!("mock transcript of {duration:.2} seconds"));
    let (words, segments) = timeline(&text, duration);
    let usage = json!({"type": "duration", "seconds": duration.ceil() as u64});
    let plain = |body: String, content_type: &str| {
        HttpResponse::Ok()
            .content_type(format!("{content_type}; charset=utf-8"))
            .body(body)
    };
    Ok(match format {
        "text" => plain(text, "text/plain"),
        "srt" => plain(
            segments
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    format!(
                        "{}\n{} --> {}\n{}\n\n",
                        i + 1,
                        subtitle_time(s.start, ','),
                        subtitle_time(s.end, ','),
                        s.text
                    )
                })
                .collect(),
            "text/plain",
        ),
        "vtt" => plain(
            segments.iter().fold("WEBVTT\n\n".to_owned(), |out, s| {
                format!(
                    "{out}{} --> {}\n{}\n\n",
                    subtitle_time(s.start, '.'),
                    subtitle_time(s.end, '.'),
                    s.text
                )
            }),
            "text/vtt",
        ),
        "verbose_json" => {
            let language = form
                .text("language")
                .filter(|l| !l.is_empty())
                .unwrap_or("english");
            let segments: Vec<Value> = segments
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    json!({
                        "id": i,
                        // Whisper's seek: the 30-second window's start, in 10 ms frames.
                        "seek": (s.start / 30.0).floor() as u64 * 3000,
                        "start": millis(s.start),
                        "end": millis(s.end),
                        "text": s.text,
                        "tokens": [],
                        "temperature": 0.0,
                        "avg_logprob": -0.25,
                        "compression_ratio": 1.0,
                        "no_speech_prob": 0.01,
                    })
                })
                .collect();
            let mut answer = json!({
                "task": "transcribe",
                "language": language,
                "duration": duration,
                "text": text,
                "segments": segments,
                "usage": usage,
            });
            let mut granularities = form
                .texts("timestamp_granularities[]")
                .chain(form.texts("timestamp_granularities"));
            if granularities.any(|g| g == "word") {
                answer["words"] = words
                    .iter()
                    .map(
                        |w| json!({"word": w.text, "start": millis(w.start), "end": millis(w.end)}),
                    )
                    .collect();
            }
            HttpResponse::Ok().json(answer)
        }
        _ => HttpResponse::Ok().json(json!({"text": text, "usage": usage})),
    })
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::MockUpstream;

    fn client() -> reqwest::Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::new()
    }

    async fn post_json(mock: &MockUpstream, path: &str, body: &Value) -> reqwest::Response {
        client()
            .post(format!("{}{path}", mock.base_url()))
            .json(body)
            .send()
            .await
            .unwrap()
    }

    /// One part of a test's multipart form.
    enum Field<'a> {
        Text(&'a str, &'a str),
        /// Name, filename, content type, contents.
        File(&'a str, &'a str, &'a str, &'a [u8]),
    }

    const BOUNDARY: &str = "----rialto-mock-boundary-7MA4YWxkTrZu0gW";

    /// A `multipart/form-data` body, built by hand (reqwest here has no `multipart` feature).
    fn form_body(fields: &[Field<'_>]) -> Vec<u8> {
        let mut body = Vec::new();
        for field in fields {
            match field {
                Field::Text(name, value) => body.extend_from_slice(
                    format!(
                        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
                    )
                    .as_bytes(),
                ),
                Field::File(name, filename, content_type, contents) => {
                    body.extend_from_slice(
                        format!(
                            "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{filename}\"\r\nContent-Type: {content_type}\r\n\r\n"
                        )
                        .as_bytes(),
                    );
                    body.extend_from_slice(contents);
                    body.extend_from_slice(b"\r\n");
                }
            }
        }
        body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
        body
    }

    async fn post_form(mock: &MockUpstream, path: &str, fields: &[Field<'_>]) -> reqwest::Response {
        client()
            .post(format!("{}{path}", mock.base_url()))
            .header(
                "content-type",
                format!("multipart/form-data; boundary={BOUNDARY}"),
            )
            .body(form_body(fields))
            .send()
            .await
            .unwrap()
    }

    /// The images of an images answer, decoded from base64.
    async fn images_of(resp: reqwest::Response) -> Vec<Vec<u8>> {
        assert_eq!(resp.status(), 200);
        let v: Value = resp.json().await.unwrap();
        assert!(v["created"].as_u64().unwrap() > 0);
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| BASE64.decode(d["b64_json"].as_str().unwrap()).unwrap())
            .collect()
    }

    fn png_of(image: DynamicImage) -> Vec<u8> {
        encode(&image, ImageFormat::Png).unwrap()
    }

    #[tokio::test]
    async fn generations_are_real_images_of_the_asked_size_and_format() {
        let mock = MockUpstream::start().await.unwrap();
        for (format, expected) in [
            ("png", image::ImageFormat::Png),
            ("jpeg", image::ImageFormat::Jpeg),
            ("webp", image::ImageFormat::WebP),
        ] {
            let body = json!({"model": "gpt-image-1", "prompt": "a lighthouse", "n": 2,
                "size": "96x64", "output_format": format, "negative_prompt": "fog"});
            let images = images_of(post_json(&mock, "/images/generations", &body).await).await;
            assert_eq!(images.len(), 2);
            for bytes in &images {
                assert_eq!(image::guess_format(bytes).unwrap(), expected);
                let decoded = image::load_from_memory_with_format(bytes, expected).unwrap();
                assert_eq!((decoded.width(), decoded.height()), (96, 64), "{format}");
            }
            assert_ne!(images[0], images[1], "one request's images differ");
        }
        assert_eq!(mock.request_count(), 3);
        assert_eq!(mock.paths(), vec!["/v1/images/generations"; 3]);
        assert_eq!(mock.requests()[0]["negative_prompt"], "fog");
    }

    #[tokio::test]
    async fn generations_repeat_exactly_and_follow_prompt_and_seed() {
        let mock = MockUpstream::start().await.unwrap();
        let body = json!({"model": "m", "prompt": "a cat", "size": "32x32", "seed": 7});
        let first = images_of(post_json(&mock, "/images/generations", &body).await).await;
        let again = images_of(post_json(&mock, "/images/generations", &body).await).await;
        assert_eq!(first, again, "the same request draws the same image");
        let other_seed = json!({"model": "m", "prompt": "a cat", "size": "32x32", "seed": 8});
        let reseeded = images_of(post_json(&mock, "/images/generations", &other_seed).await).await;
        assert_ne!(first, reseeded);
        let other_prompt = json!({"model": "m", "prompt": "a dog", "size": "32x32", "seed": 7});
        let reprompted =
            images_of(post_json(&mock, "/images/generations", &other_prompt).await).await;
        assert_ne!(first, reprompted);
    }

    #[tokio::test]
    async fn generations_default_size_is_quick_and_urls_are_data_urls() {
        let mock = MockUpstream::start().await.unwrap();
        let started = Instant::now();
        let resp = post_json(
            &mock,
            "/images/generations",
            &json!({"model": "m", "prompt": "big", "size": "auto", "response_format": "url"}),
        )
        .await;
        let elapsed = started.elapsed();
        assert_eq!(resp.status(), 200);
        let v: Value = resp.json().await.unwrap();
        let url = v["data"][0]["url"].as_str().unwrap();
        let b64 = url.strip_prefix("data:image/png;base64,").unwrap();
        let decoded = image::load_from_memory(&BASE64.decode(b64).unwrap()).unwrap();
        assert_eq!((decoded.width(), decoded.height()), (1024, 1024));
        assert!(v["data"][0].get("b64_json").is_none());
        // Well under a second in a debug build; the bound leaves room for a loaded machine.
        assert!(elapsed < Duration::from_secs(3), "took {elapsed:?}");
    }

    #[tokio::test]
    async fn generations_refuse_bad_parameters_and_forbidden_prompts() {
        let mock = MockUpstream::start().await.unwrap();
        for (body, param) in [
            (json!({"prompt": "x", "size": "4096x4096"}), "size"),
            (json!({"prompt": "x", "size": "2049x10"}), "size"),
            (json!({"prompt": "x", "size": "large"}), "size"),
            (json!({"prompt": "x", "size": "0x10"}), "size"),
            (json!({"prompt": "x", "n": 11}), "n"),
            (json!({"prompt": "x", "n": 0}), "n"),
            (
                json!({"prompt": "x", "output_format": "gif"}),
                "output_format",
            ),
            (
                json!({"prompt": "x", "response_format": "blob"}),
                "response_format",
            ),
            (json!({"prompt": "x", "seed": "seven"}), "seed"),
            (json!({"model": "m"}), "prompt"),
        ] {
            let resp = post_json(&mock, "/images/generations", &body).await;
            assert_eq!(resp.status(), 400, "{body}");
            let v: Value = resp.json().await.unwrap();
            assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
            assert_eq!(v["error"]["param"], param, "{body}");
        }
        let resp = post_json(
            &mock,
            "/images/generations",
            &json!({"prompt": "draw something Forbidden, please"}),
        )
        .await;
        assert_eq!(resp.status(), 400);
        assert_eq!(
            resp.json::<Value>().await.unwrap(),
            json!({"error": {"message": "Your request was rejected by the safety system.",
                "type": "image_generation_user_error", "code": "moderation_blocked", "param": null}})
        );
        // A word that merely contains it passes.
        let resp = post_json(
            &mock,
            "/images/generations",
            &json!({"prompt": "unforbiddenness", "size": "8x8"}),
        )
        .await;
        assert_eq!(resp.status(), 200);
    }

    #[tokio::test]
    async fn edits_invert_the_input() {
        let mock = MockUpstream::start().await.unwrap();
        let input = png_of(DynamicImage::ImageRgb8(RgbImage::from_pixel(
            12,
            8,
            image::Rgb([10, 20, 30]),
        )));
        let other = png_of(DynamicImage::ImageRgb8(RgbImage::new(4, 4)));
        let resp = post_form(
            &mock,
            "/images/edits",
            &[
                Field::Text("model", "gpt-image-1"),
                Field::Text("prompt", "invert it"),
                Field::Text("n", "2"),
                Field::File("image[]", "a.png", "image/png", &input),
                Field::File("image[]", "b.png", "image/png", &other),
                Field::File("mask", "mask.png", "image/png", &other),
            ],
        )
        .await;
        let images = images_of(resp).await;
        assert_eq!(images.len(), 2);
        let edited = image::load_from_memory(&images[0]).unwrap().to_rgb8();
        assert_eq!(edited.dimensions(), (12, 8), "the input's size");
        assert!(edited.pixels().all(|p| p.0 == [245, 235, 225]), "inverted");

        // A size and another format.
        let resp = post_form(
            &mock,
            "/images/edits",
            &[
                Field::Text("prompt", "bigger"),
                Field::Text("size", "24x16"),
                Field::Text("output_format", "webp"),
                Field::File("image", "a.png", "image/png", &input),
            ],
        )
        .await;
        let images = images_of(resp).await;
        assert_eq!(
            image::guess_format(&images[0]).unwrap(),
            image::ImageFormat::WebP
        );
        let edited = image::load_from_memory(&images[0]).unwrap().to_rgb8();
        assert_eq!(edited.dimensions(), (24, 16));
        assert_eq!(edited.get_pixel(5, 5).0, [245, 235, 225]);

        assert_eq!(
            mock.requests()[0],
            json!({
                "model": "gpt-image-1", "prompt": "invert it", "n": "2",
                "image[]": [
                    {"filename": "a.png", "content_type": "image/png", "bytes": input.len()},
                    {"filename": "b.png", "content_type": "image/png", "bytes": other.len()},
                ],
                "mask": {"filename": "mask.png", "content_type": "image/png", "bytes": other.len()},
            })
        );
        assert_eq!(mock.paths(), vec!["/v1/images/edits"; 2]);
    }

    #[tokio::test]
    async fn edits_refuse_what_is_not_an_image() {
        let mock = MockUpstream::start().await.unwrap();
        let resp = post_form(
            &mock,
            "/images/edits",
            &[
                Field::Text("prompt", "x"),
                Field::File("image", "a.png", "image/png", b"not an image at all"),
            ],
        )
        .await;
        assert_eq!(resp.status(), 400);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["param"], "image");
        // Not a form at all.
        let resp = post_json(&mock, "/images/edits", &json!({"prompt": "x"})).await;
        assert_eq!(resp.status(), 400);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }

    /// Asks the mock for speech; returns the body and checks it came streamed.
    async fn speak(mock: &MockUpstream, body: Value) -> (String, Vec<u8>) {
        let resp = post_json(mock, "/audio/speech", &body).await;
        assert_eq!(resp.status(), 200, "{body}");
        assert!(
            resp.headers().get("content-length").is_none(),
            "a streamed (chunked) body"
        );
        let content_type = resp.headers()["content-type"].to_str().unwrap().to_owned();
        (content_type, resp.bytes().await.unwrap().to_vec())
    }

    #[tokio::test]
    async fn speech_is_a_wav_of_the_texts_length() {
        let mock = MockUpstream::start().await.unwrap();
        let text = "one two three four five six seven eight nine ten eleven twelve";
        let (content_type, wav) = speak(
            &mock,
            json!({"model": "tts-1", "input": text, "voice": "alloy", "response_format": "wav"}),
        )
        .await;
        assert_eq!(content_type, "audio/wav");
        assert!(wav.len() > 3 * STREAM_PIECE, "several pieces");
        let reader = hound::WavReader::new(Cursor::new(&wav)).unwrap();
        let spec = reader.spec();
        assert_eq!(
            (spec.channels, spec.sample_rate, spec.bits_per_sample),
            (1, 24_000, 16)
        );
        assert_eq!(reader.duration(), 3 * 24_000, "12 words of 0.25 s");
        assert_eq!(
            find_chunk(&wav, TEXT_CHUNK).unwrap().1,
            text.as_bytes(),
            "the text rides along"
        );

        // Faster speech is shorter, and never under a quarter second.
        let (_, fast) = speak(
            &mock,
            json!({"input": "a b c d", "voice": "alloy", "response_format": "wav", "speed": 2}),
        )
        .await;
        let reader = hound::WavReader::new(Cursor::new(&fast)).unwrap();
        assert_eq!(reader.duration(), 12_000);
        let (_, short) = speak(
            &mock,
            json!({"input": "hi", "voice": "alloy", "response_format": "wav", "speed": 4.0}),
        )
        .await;
        let reader = hound::WavReader::new(Cursor::new(&short)).unwrap();
        assert_eq!(reader.duration(), 6_000);

        // Raw PCM: the same samples, without a header.
        let (content_type, pcm) = speak(
            &mock,
            json!({"input": text, "voice": "alloy", "response_format": "pcm"}),
        )
        .await;
        assert_eq!(content_type, "audio/pcm");
        let samples: Vec<i16> = hound::WavReader::new(Cursor::new(&wav))
            .unwrap()
            .into_samples::<i16>()
            .map(Result::unwrap)
            .collect();
        let raw: Vec<u8> = samples.iter().flat_map(|s| s.to_le_bytes()).collect();
        assert_eq!(pcm, raw);
        assert_eq!(mock.paths(), vec!["/v1/audio/speech"; 4]);
        assert_eq!(mock.requests()[0]["voice"], "alloy");
    }

    #[tokio::test]
    async fn speech_refuses_formats_it_cannot_make() {
        let mock = MockUpstream::start().await.unwrap();
        for body in [
            json!({"model": "tts-1", "input": "hello", "voice": "alloy"}),
            json!({"model": "tts-1", "input": "hello", "voice": "alloy", "response_format": "mp3"}),
            json!({"model": "tts-1", "input": "hello", "voice": "alloy", "response_format": "opus"}),
        ] {
            let resp = post_json(&mock, "/audio/speech", &body).await;
            assert_eq!(resp.status(), 400);
            let v: Value = resp.json().await.unwrap();
            assert_eq!(v["error"]["param"], "response_format");
            let message = v["error"]["message"].as_str().unwrap();
            assert!(
                message.contains("'wav'") && message.contains("'pcm'"),
                "{message}"
            );
        }
        let resp = post_json(
            &mock,
            "/audio/speech",
            &json!({"input": "x", "response_format": "wav", "speed": 5}),
        )
        .await;
        assert_eq!(resp.status(), 400);
    }

    #[test]
    fn hound_skips_the_text_chunk() {
        // Odd-length text: the chunk is padded to an even size hound and RIFF agree on.
        let samples: Vec<i16> = (0..1001).map(|i| (i * 7) as i16).collect();
        let wav = wav_with_text(&samples, "odd").unwrap();
        let riff_size = u32::from_le_bytes(wav[4..8].try_into().unwrap());
        assert_eq!(riff_size as usize, wav.len() - 8);
        let (mock_at, contents) = find_chunk(&wav, TEXT_CHUNK).unwrap();
        let (data_at, _) = find_chunk(&wav, b"data").unwrap();
        assert!(mock_at < data_at, "the text chunk comes before the data");
        assert_eq!(contents, b"odd\0");
        let mut reader = hound::WavReader::new(Cursor::new(&wav)).unwrap();
        assert_eq!(reader.duration(), 1001);
        let read: Vec<i16> = reader.samples::<i16>().map(Result::unwrap).collect();
        assert_eq!(read, samples);
        // And even-length text goes in as it is.
        let wav = wav_with_text(&samples, "even").unwrap();
        assert_eq!(find_chunk(&wav, TEXT_CHUNK).unwrap().1, b"even");
        assert_eq!(
            hound::WavReader::new(Cursor::new(&wav)).unwrap().len(),
            1001
        );
    }

    async fn transcribe(mock: &MockUpstream, wav: &[u8], extra: &[Field<'_>]) -> reqwest::Response {
        let mut fields = vec![
            Field::Text("model", "whisper-1"),
            Field::File("file", "speech.wav", "audio/wav", wav),
        ];
        fields.extend(extra.iter().map(|f| match f {
            Field::Text(n, v) => Field::Text(n, v),
            Field::File(n, f, c, b) => Field::File(n, f, c, b),
        }));
        post_form(mock, "/audio/transcriptions", &fields).await
    }

    #[tokio::test]
    async fn transcription_reads_back_the_spoken_text() {
        let mock = MockUpstream::start().await.unwrap();
        let text =
            "Hello there. This mock speaks a sentence that is longer than eight words in all! Bye.";
        let (_, wav) = speak(
            &mock,
            json!({"model": "tts-1", "input": text, "voice": "alloy", "response_format": "wav"}),
        )
        .await;
        let duration = 16.0 * 0.25;

        let v: Value = transcribe(&mock, &wav, &[]).await.json().await.unwrap();
        assert_eq!(
            v,
            json!({"text": text, "usage": {"type": "duration", "seconds": 4}})
        );

        let resp = transcribe(&mock, &wav, &[Field::Text("response_format", "text")]).await;
        assert!(
            resp.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/plain")
        );
        assert_eq!(resp.text().await.unwrap(), text);

        let v: Value = transcribe(
            &mock,
            &wav,
            &[
                Field::Text("response_format", "verbose_json"),
                Field::Text("timestamp_granularities[]", "segment"),
                Field::Text("timestamp_granularities[]", "word"),
                Field::Text("language", "en"),
                Field::Text("temperature", "0"),
            ],
        )
        .await
        .json()
        .await
        .unwrap();
        assert_eq!(v["task"], "transcribe");
        assert_eq!(v["language"], "en");
        assert_eq!(v["duration"].as_f64().unwrap(), duration);
        assert_eq!(v["text"], text);
        let segments = v["segments"].as_array().unwrap();
        let texts: Vec<&str> = segments
            .iter()
            .map(|s| s["text"].as_str().unwrap())
            .collect();
        assert_eq!(
            texts,
            [
                "Hello there.",
                "This mock speaks a sentence that is longer",
                "than eight words in all!",
                "Bye."
            ]
        );
        assert_eq!(segments[0]["start"].as_f64().unwrap(), 0.0);
        assert_eq!(segments[3]["end"].as_f64().unwrap(), duration);
        for pair in segments.windows(2) {
            assert_eq!(pair[0]["end"], pair[1]["start"], "no gaps");
        }
        for (i, s) in segments.iter().enumerate() {
            assert_eq!(s["id"], i);
            for key in [
                "seek",
                "tokens",
                "temperature",
                "avg_logprob",
                "compression_ratio",
                "no_speech_prob",
            ] {
                assert!(s.get(key).is_some(), "segment member {key}");
            }
        }
        let words = v["words"].as_array().unwrap();
        assert_eq!(words.len(), 16);
        assert_eq!(
            words[1],
            json!({"word": "there.", "start": 0.25, "end": 0.5})
        );

        // Without word granularity there are no words; the language defaults to English.
        let v: Value = transcribe(
            &mock,
            &wav,
            &[Field::Text("response_format", "verbose_json")],
        )
        .await
        .json()
        .await
        .unwrap();
        assert!(v.get("words").is_none());
        assert_eq!(v["language"], "english");

        let srt = transcribe(&mock, &wav, &[Field::Text("response_format", "srt")])
            .await
            .text()
            .await
            .unwrap();
        assert!(
            srt.starts_with("1\n00:00:00,000 --> 00:00:00,500\nHello there.\n\n2\n00:00:00,500 --> 00:00:02,500\n"),
            "{srt}"
        );
        assert!(
            srt.ends_with("4\n00:00:03,750 --> 00:00:04,000\nBye.\n\n"),
            "{srt}"
        );
        let vtt = transcribe(&mock, &wav, &[Field::Text("response_format", "vtt")])
            .await
            .text()
            .await
            .unwrap();
        assert!(
            vtt.starts_with("WEBVTT\n\n00:00:00.000 --> 00:00:00.500\nHello there.\n\n"),
            "{vtt}"
        );

        let recorded = mock.requests();
        assert_eq!(
            recorded[3],
            json!({
                "model": "whisper-1",
                "file": {"filename": "speech.wav", "content_type": "audio/wav", "bytes": wav.len()},
                "response_format": "verbose_json",
                "timestamp_granularities[]": ["segment", "word"],
                "language": "en",
                "temperature": "0",
            })
        );
        assert_eq!(mock.paths()[0], "/v1/audio/speech");
        assert_eq!(mock.paths()[1..], vec!["/v1/audio/transcriptions"; 6]);
    }

    #[tokio::test]
    async fn transcription_of_a_plain_wav_and_of_what_is_not_one() {
        let mock = MockUpstream::start().await.unwrap();
        // A WAV without the text chunk: 1.5 s at 16 kHz.
        let mut wav = Cursor::new(Vec::new());
        let spec = hound::WavSpec {
            channels: 1,
            sample_rate: 16_000,
            bits_per_sample: 16,
            sample_format: hound::SampleFormat::Int,
        };
        let mut writer = hound::WavWriter::new(&mut wav, spec).unwrap();
        for _ in 0..24_000 {
            writer.write_sample(0i16).unwrap();
        }
        writer.finalize().unwrap();
        let v: Value = transcribe(&mock, wav.get_ref(), &[])
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(
            v,
            json!({"text": "mock transcript of 1.50 seconds", "usage": {"type": "duration", "seconds": 2}})
        );

        let resp = transcribe(&mock, b"ID3 this is an mp3, honest", &[]).await;
        assert_eq!(resp.status(), 400);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "file");

        let resp = transcribe(
            &mock,
            wav.get_ref(),
            &[Field::Text("response_format", "xml")],
        )
        .await;
        assert_eq!(resp.status(), 400);
    }

    #[tokio::test]
    async fn fail_next_fails_media_calls_and_paths_follow_the_log() {
        let mock = MockUpstream::start().await.unwrap();
        mock.fail_next(2, 503);
        let body = json!({"prompt": "x", "size": "8x8"});
        let resp = post_json(&mock, "/images/generations", &body).await;
        assert_eq!(resp.status(), 503);
        assert_eq!(
            resp.json::<Value>().await.unwrap()["error"]["code"],
            "mock_failure"
        );
        let resp = post_json(
            &mock,
            "/audio/speech",
            &json!({"input": "x", "response_format": "wav"}),
        )
        .await;
        assert_eq!(resp.status(), 503);
        let resp = post_json(&mock, "/images/generations", &body).await;
        assert_eq!(resp.status(), 200);
        let resp = post_json(
            &mock,
            "/chat/completions",
            &json!({"model": "m", "messages": []}),
        )
        .await;
        assert_eq!(resp.status(), 200);
        assert_eq!(
            mock.paths(),
            [
                "/v1/images/generations",
                "/v1/audio/speech",
                "/v1/images/generations",
                "/v1/chat/completions"
            ]
        );
        assert_eq!(mock.requests()[2], body);
        assert_eq!(mock.request_count(), 4);
    }
}
