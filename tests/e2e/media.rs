//! Images, speech and transcription end to end, in both topologies,
//! against the mock upstream's media calls (real PNG, JPEG, WebP and WAV
//! bytes): what the backends are asked, the decoded media, the hosted and
//! OpenAI shapes, the exact cost of each unit, refusals that cost nothing,
//! and the image class's requests per minute.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use reqwest::Method;
use rialto_test_kit::{MockUpstream, Sandbox, Storage, Topology};
use serde_json::{Value, json};

/// An image costs $0.04 (a tiered model's 1K $0.1, 2K $0.2), speech
/// $0.015 per thousand characters, transcription $0.0001 per second.
fn config(mock_url: &str) -> String {
    format!(
        r#"
[[models]]
id = "mock-image"
type = "image"
usd_per_image = 0.04
traits = ["default"]
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-image-model" }}]

[[models]]
id = "tiered-image"
type = "image"
usd_per_image_resolution = {{ "1K" = 0.1, "2K" = 0.2 }}
backends = [{{ kind = "openai", url = "{mock_url}" }}]

[[models]]
id = "rpm-image"
type = "image"
usd_per_image = 0.001
backends = [{{ kind = "openai", url = "{mock_url}" }}]

[[models]]
id = "mock-edit"
type = "inpaint"
usd_per_image = 0.03
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-edit-model" }}]

[[models]]
id = "mock-upscale"
type = "upscale"
usd_per_upscale = {{ "2x" = 0.02, "4x" = 0.08 }}
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-upscale-model" }}]

[[models]]
id = "mock-tts"
type = "tts"
usd_per_thousand_characters = 0.015
voices = ["af_sky", "am_adam"]
audio_formats = ["wav", "pcm"]
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-tts-model" }}]

[[models]]
id = "mock-asr"
type = "asr"
usd_per_audio_second = 0.0001
backends = [{{ kind = "openai", url = "{mock_url}", model = "whisper-1" }}]

[[models]]
id = "mock-chat"
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]
"#
    )
}

struct World {
    upstream: MockUpstream,
    sandbox: Sandbox,
    /// The INFERENCE key in use; each scenario takes a fresh one, since
    /// more than 20 refusals in 30 s would block a key (the abuse guard).
    key: std::sync::Mutex<String>,
    admin: String,
}

async fn world(topology: Topology) -> World {
    let upstream = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(topology)
        .storage(Storage::Sqlite)
        .config(&config(&upstream.base_url()))
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("media").await.unwrap();
    let (_, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    World {
        upstream,
        sandbox,
        key: std::sync::Mutex::new(key),
        admin: account.admin_key,
    }
}

mod images_and_audio {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_process() {
        super::scenarios(super::world(rialto_test_kit::Topology::OneProcess).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn split() {
        super::scenarios(super::world(rialto_test_kit::Topology::Split).await).await;
    }
}

async fn scenarios(world: World) {
    hosted_images(&world).await;
    openai_images(&world).await;
    image_refusals_cost_nothing(&world).await;
    world.new_key().await;
    image_edits(&world).await;
    world.new_key().await;
    upscale_and_background_removal(&world).await;
    world.new_key().await;
    speech_and_its_transcription(&world).await;
    world.new_key().await;
    listings(&world).await;
    openai_sdk(&world).await;
    the_media_classes_limit_requests_per_minute(&world).await;
}

/// The official `openai` Python SDK's `images.generate`,
/// `audio.speech.create` and `audio.transcriptions.create`.
async fn openai_sdk(world: &World) {
    let base_url = world.sandbox.api("");
    let stdout = crate::python::run_script(
        "openai_media_check.py",
        &[
            ("RIALTO_E2E_BASE_URL", &base_url),
            ("RIALTO_E2E_API_KEY", &world.key()),
        ],
    )
    .await;
    for check in [
        "images ok",
        "speech ok",
        "speech stream ok",
        "transcriptions ok",
    ] {
        assert!(stdout.contains(check), "{stdout}");
    }
}

/// $ in nano-dollars.
const NANOS_PER_USD: i64 = 1_000_000_000;

impl World {
    fn key(&self) -> String {
        self.key.lock().unwrap().clone()
    }

    /// Another INFERENCE key of the account, used from now on.
    async fn new_key(&self) {
        let (_, key) = self
            .sandbox
            .create_key(&self.admin, "INFERENCE")
            .await
            .unwrap();
        *self.key.lock().unwrap() = key;
    }

    async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.sandbox
            .call(Method::POST, path, &self.key(), Some(body))
            .await
            .unwrap()
    }

    async fn ok_json(&self, path: &str, body: &Value) -> (reqwest::header::HeaderMap, Value) {
        let response = self.post(path, body).await;
        let status = response.status();
        let headers = response.headers().clone();
        let text = response.text().await.unwrap();
        assert_eq!(status, 200, "{path}: {text}");
        (headers, serde_json::from_str(&text).unwrap())
    }

    async fn balance_nanos(&self) -> i64 {
        let balance: Value = self
            .sandbox
            .call(Method::GET, "/billing/balance", &self.admin, None)
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        rialto_billing::parse_amount("usd", &balance["balances"]["usd"].to_string()).unwrap()
    }

    /// The last request the upstream received, and its path.
    fn last_upstream(&self) -> (String, Value) {
        let paths = self.upstream.paths();
        let bodies = self.upstream.requests();
        (
            paths.last().cloned().unwrap_or_default(),
            bodies.last().cloned().unwrap_or_default(),
        )
    }

    /// A multipart form of text `fields` and one `file`, sent with the key.
    async fn form(
        &self,
        path: &str,
        fields: &[(&str, &str)],
        file: Option<(&str, &str, &[u8])>,
    ) -> reqwest::Response {
        let content_type = if path.starts_with("/image") {
            "image/png"
        } else {
            "audio/wav"
        };
        self.form_typed(path, fields, file, content_type).await
    }

    async fn form_typed(
        &self,
        path: &str,
        fields: &[(&str, &str)],
        file: Option<(&str, &str, &[u8])>,
        content_type: &str,
    ) -> reqwest::Response {
        let boundary = "rialto-media-test-boundary";
        let mut body = Vec::new();
        for (name, value) in fields {
            body.extend_from_slice(
                format!(
                    "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
                )
                .as_bytes(),
            );
        }
        if let Some((name, filename, bytes)) = file {
            body.extend_from_slice(
                format!(
                    "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; \
                     filename=\"{filename}\"\r\nContent-Type: {content_type}\r\n\r\n"
                )
                .as_bytes(),
            );
            body.extend_from_slice(bytes);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        self.sandbox
            .http()
            .post(self.sandbox.api(path))
            .bearer_auth(self.key())
            .header(
                "content-type",
                format!("multipart/form-data; boundary={boundary}"),
            )
            .body(body)
            .send()
            .await
            .unwrap()
    }
}

fn decode(b64: &Value) -> image::DynamicImage {
    let bytes = STANDARD.decode(b64.as_str().unwrap()).unwrap();
    image::load_from_memory(&bytes).unwrap()
}

fn format_of(bytes: &[u8]) -> image::ImageFormat {
    image::guess_format(bytes).unwrap()
}

async fn hosted_images(world: &World) {
    let before = world.balance_nanos().await;
    let (headers, body) = world
        .ok_json(
            "/image/generate",
            &json!({"model": "mock-image", "prompt": "a red fox", "width": 64, "height": 48,
                "variants": 2, "format": "png", "seed": 7, "negative_prompt": "rain",
                "style_preset": "Anime", "safe_mode": false}),
        )
        .await;
    // Two PNGs of the asked size, not the same picture.
    let images = body["images"].as_array().unwrap();
    assert_eq!(images.len(), 2);
    for image in images {
        let bytes = STANDARD.decode(image.as_str().unwrap()).unwrap();
        assert_eq!(format_of(&bytes), image::ImageFormat::Png);
        let decoded = decode(image);
        assert_eq!((decoded.width(), decoded.height()), (64, 48));
    }
    assert_ne!(images[0], images[1]);
    assert!(body["id"].as_str().unwrap().starts_with("generate-image-"));
    assert_eq!(body["request"]["prompt"], "a red fox");
    assert!(body["timing"]["total"].is_u64(), "{body}");
    assert_eq!(headers["x-rialto-is-blurred"], "false");
    assert_eq!(headers["x-rialto-is-content-violation"], "false");
    assert_eq!(headers["x-rialto-model-id"], "mock-image");
    // What the backend was asked: OpenAI's call, the style in the prompt.
    let (path, upstream) = world.last_upstream();
    assert_eq!(path, "/v1/images/generations");
    assert_eq!(upstream["model"], "mock-image-model");
    assert_eq!(upstream["prompt"], "a red fox, Anime style");
    assert_eq!(upstream["n"], 2);
    assert_eq!(upstream["size"], "64x48");
    assert_eq!(upstream["output_format"], "png");
    assert_eq!(upstream["response_format"], "b64_json");
    assert_eq!(upstream["seed"], 7);
    assert_eq!(upstream["negative_prompt"], "rain");
    assert_eq!(upstream["moderation"], "low");
    // Two images at $0.04.
    assert_eq!(before - world.balance_nanos().await, 2 * 40_000_000);

    // The bytes themselves, in the default and another format.
    let response = world
        .post(
            "/image/generate",
            &json!({"model": "mock-image", "prompt": "a fox", "width": 32, "height": 32,
                "return_binary": true, "format": "jpeg"}),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "image/jpeg");
    let bytes = response.bytes().await.unwrap();
    assert_eq!(format_of(&bytes), image::ImageFormat::Jpeg);
    assert_eq!(image::load_from_memory(&bytes).unwrap().width(), 32);
    let (_, body) = world
        .ok_json(
            "/image/generate",
            &json!({"model": "mock-image", "prompt": "a fox", "width": 16, "height": 16}),
        )
        .await;
    let webp = STANDARD
        .decode(body["images"][0].as_str().unwrap())
        .unwrap();
    assert_eq!(format_of(&webp), image::ImageFormat::WebP);

    // A resolution tier prices the image.
    let before = world.balance_nanos().await;
    world
        .ok_json(
            "/image/generate",
            &json!({"model": "tiered-image", "prompt": "a fox", "width": 16, "height": 16,
                "resolution": "2K"}),
        )
        .await;
    assert_eq!(before - world.balance_nanos().await, 200_000_000);
    let styles: Value = world
        .sandbox
        .http()
        .get(world.sandbox.api("/image/styles"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(styles["object"], "list");
    assert!(styles["data"].as_array().unwrap().contains(&json!("Anime")));
}

async fn openai_images(world: &World) {
    let before = world.balance_nanos().await;
    // An OpenAI model name is the default image model.
    let (_, body) = world
        .ok_json(
            "/images/generations",
            &json!({"model": "dall-e-3", "prompt": "a lighthouse", "size": "256x256",
                "response_format": "url", "quality": "hd", "style": "vivid"}),
        )
        .await;
    assert!(body["created"].is_i64());
    let url = body["data"][0]["url"].as_str().unwrap();
    let b64 = url.strip_prefix("data:image/png;base64,").unwrap();
    let decoded = decode(&json!(b64));
    assert_eq!((decoded.width(), decoded.height()), (256, 256));
    let (_, upstream) = world.last_upstream();
    assert_eq!(upstream["model"], "mock-image-model");
    assert_eq!(upstream["moderation"], "auto");
    let (_, body) = world
        .ok_json(
            "/images/generations",
            &json!({"prompt": "a lighthouse", "size": "256x256", "output_format": "webp", "n": 2}),
        )
        .await;
    assert_eq!(body["data"].as_array().unwrap().len(), 2);
    let webp = STANDARD
        .decode(body["data"][1]["b64_json"].as_str().unwrap())
        .unwrap();
    assert_eq!(format_of(&webp), image::ImageFormat::WebP);
    assert_eq!(before - world.balance_nanos().await, 3 * 40_000_000);
}

async fn image_refusals_cost_nothing(world: &World) {
    let before = world.balance_nanos().await;
    let asked = world.upstream.request_count();
    for (body, field) in [
        (
            json!({"model": "mock-image", "prompt": "x", "colour": "red"}),
            "_errors",
        ),
        (
            json!({"model": "mock-image", "prompt": "x", "width": 5000}),
            "width",
        ),
        (json!({"model": "mock-image"}), "prompt"),
        (
            json!({"model": "mock-image", "prompt": "x", "style_preset": "Cubism"}),
            "style_preset",
        ),
        (
            json!({"model": "mock-image", "prompt": "x", "variants": 2, "return_binary": true}),
            "variants",
        ),
        (json!({"model": "mock-tts", "prompt": "x"}), "model"),
        (
            json!({"model": "tiered-image", "prompt": "x", "resolution": "8K"}),
            "resolution",
        ),
    ] {
        let response = world.post("/image/generate", &body).await;
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"], "Invalid request parameters", "{error}");
        assert!(error["details"].get(field).is_some(), "{field}: {error}");
    }
    let response = world
        .post(
            "/image/generate",
            &json!({"model": "no-such-image", "prompt": "x"}),
        )
        .await;
    assert_eq!(response.status(), 404);
    assert_eq!(world.upstream.request_count(), asked, "nothing was sent");

    // The backend's content policy: a 400 that says so.
    let response = world
        .post(
            "/image/generate",
            &json!({"model": "mock-image", "prompt": "something forbidden", "width": 8, "height": 8}),
        )
        .await;
    assert_eq!(response.status(), 400);
    assert_eq!(response.headers()["x-rialto-is-content-violation"], "true");
    let error: Value = response.json().await.unwrap();
    assert!(
        error["error"].as_str().unwrap().contains("safety"),
        "{error}"
    );

    // Every backend attempt failing: an error, no charge.
    world.upstream.fail_next(10, 500);
    let response = world
        .post(
            "/images/generations",
            &json!({"prompt": "a lighthouse", "size": "256x256"}),
        )
        .await;
    assert!(response.status().is_server_error(), "{}", response.status());
    world.upstream.fail_next(0, 500);
    assert_eq!(world.balance_nanos().await, before);
}

/// A 16x8 PNG of one colour.
fn png(rgb: [u8; 3]) -> Vec<u8> {
    let image = image::RgbImage::from_pixel(16, 8, image::Rgb(rgb));
    let mut out = std::io::Cursor::new(Vec::new());
    image.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// The mock edits by inverting the colours of the (first) image.
async fn image_edits(world: &World) {
    let red = png([255, 0, 0]);
    let before = world.balance_nanos().await;
    let response = world
        .form(
            "/image/edit",
            &[
                ("model", "mock-edit"),
                ("prompt", "make it cyan"),
                ("safe_mode", "false"),
            ],
            Some(("image", "red.png", &red)),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "image/png");
    let edited = image::load_from_memory(&response.bytes().await.unwrap()).unwrap();
    assert_eq!((edited.width(), edited.height()), (16, 8));
    assert_eq!(edited.to_rgb8().get_pixel(3, 3).0, [0, 255, 255]);
    let (path, upstream) = world.last_upstream();
    assert_eq!(path, "/v1/images/edits");
    assert_eq!(upstream["model"], "mock-edit-model");
    assert_eq!(upstream["prompt"], "make it cyan");
    assert_eq!(upstream["moderation"], "low");
    assert_eq!(upstream["image"]["bytes"], red.len());
    assert_eq!(before - world.balance_nanos().await, 30_000_000);

    // JSON: a data URL in, WebP out.
    let data_url = format!("data:image/png;base64,{}", STANDARD.encode(&red));
    let response = world
        .post(
            "/image/edit",
            &json!({"modelId": "mock-edit", "prompt": "invert", "image": data_url,
                "output_format": "webp"}),
        )
        .await;
    assert_eq!(response.status(), 200);
    let bytes = response.bytes().await.unwrap();
    assert_eq!(format_of(&bytes), image::ImageFormat::WebP);

    // Several images, the first the base: `image[]` upstream.
    let blue = STANDARD.encode(png([0, 0, 255]));
    let response = world
        .post(
            "/image/multi-edit",
            &json!({"modelId": "mock-edit", "prompt": "combine", "images": [blue, STANDARD.encode(&red)]}),
        )
        .await;
    assert_eq!(response.status(), 200);
    let combined = image::load_from_memory(&response.bytes().await.unwrap()).unwrap();
    assert_eq!(combined.to_rgb8().get_pixel(0, 0).0, [255, 255, 0]);
    let (_, upstream) = world.last_upstream();
    assert_eq!(upstream["image[]"].as_array().unwrap().len(), 2);

    let before = world.balance_nanos().await;
    for (path, body, field) in [
        (
            "/image/edit",
            json!({"model": "mock-edit", "prompt": "x"}),
            "image",
        ),
        (
            "/image/edit",
            json!({"model": "mock-edit", "prompt": "x", "image": "%%% not base64"}),
            "image",
        ),
        (
            "/image/edit",
            json!({"model": "mock-edit", "prompt": "x", "image": STANDARD.encode(b"GIF? no")}),
            "image",
        ),
        (
            "/image/multi-edit",
            json!({"model": "mock-edit", "prompt": "x", "images": []}),
            "images",
        ),
        // Counted before anything is decoded or fetched.
        (
            "/image/multi-edit",
            json!({"model": "mock-edit", "prompt": "x", "images": vec!["http://192.0.2.1/x.png"; 17]}),
            "images",
        ),
        (
            "/image/edit",
            json!({"model": "mock-image", "prompt": "x", "image": blue}),
            "model",
        ),
    ] {
        let response = world.post(path, &body).await;
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert!(error["details"].get(field).is_some(), "{field}: {error}");
    }
    assert_eq!(world.balance_nanos().await, before);
}

/// A white picture with a red square in its middle, `side` pixels square.
fn red_square(side: u32) -> Vec<u8> {
    let image = image::RgbImage::from_fn(side, side, |x, y| {
        let inside = (side / 4..side * 3 / 4).contains(&x) && (side / 4..side * 3 / 4).contains(&y);
        image::Rgb(if inside { [255, 0, 0] } else { [255, 255, 255] })
    });
    let mut out = std::io::Cursor::new(Vec::new());
    image.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// `/image/upscale` (the hosted call on the backend; the mock resamples)
/// and `/image/background-remove` (an OpenAI edit with a transparent
/// background; the mock clears the corner's colour): the PNGs decoded, the
/// tiers' prices, refusals that cost nothing.
async fn upscale_and_background_removal(world: &World) {
    let picture = red_square(256);
    let before = world.balance_nanos().await;
    let response = world
        .post(
            "/image/upscale",
            &json!({"image": STANDARD.encode(&picture), "scale": 2}),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "image/png");
    assert_eq!(response.headers()["x-rialto-model-id"], "mock-upscale");
    let larger = image::load_from_memory(&response.bytes().await.unwrap()).unwrap();
    assert_eq!((larger.width(), larger.height()), (512, 512));
    assert_eq!(larger.to_rgb8().get_pixel(256, 256).0, [255, 0, 0]);
    let (path, upstream) = world.last_upstream();
    assert_eq!(path, "/v1/image/upscale");
    assert_eq!(upstream["model"], "mock-upscale-model");
    assert_eq!(upstream["scale"], 2.0);
    assert_eq!(before - world.balance_nanos().await, 20_000_000);

    // A form, 4x: the 4x tier's price.
    let before = world.balance_nanos().await;
    let response = world
        .form(
            "/image/upscale",
            &[("scale", "4"), ("model", "mock-upscale")],
            Some(("image", "square.png", &picture)),
        )
        .await;
    assert_eq!(response.status(), 200);
    let larger = image::load_from_memory(&response.bytes().await.unwrap()).unwrap();
    assert_eq!((larger.width(), larger.height()), (1024, 1024));
    assert_eq!(before - world.balance_nanos().await, 80_000_000);

    // The background goes: an edit of the default edit model.
    let before = world.balance_nanos().await;
    let response = world
        .post(
            "/image/background-remove",
            &json!({"image": format!("data:image/png;base64,{}", STANDARD.encode(red_square(64)))}),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "image/png");
    let cut = image::load_from_memory(&response.bytes().await.unwrap()).unwrap();
    assert!(cut.color().has_alpha());
    let cut = cut.to_rgba8();
    assert_eq!(cut.get_pixel(0, 0).0[3], 0, "the background is transparent");
    assert_eq!(
        cut.get_pixel(32, 32).0,
        [255, 0, 0, 255],
        "the subject stays"
    );
    let (path, upstream) = world.last_upstream();
    assert_eq!(path, "/v1/images/edits");
    assert_eq!(upstream["background"], "transparent");
    assert_eq!(upstream["model"], "mock-edit-model");
    assert_eq!(before - world.balance_nanos().await, 30_000_000);

    let before = world.balance_nanos().await;
    for (path, body, field) in [
        ("/image/upscale", json!({"scale": 2}), "image"),
        (
            "/image/upscale",
            json!({"image": STANDARD.encode(red_square(64))}),
            "image",
        ),
        (
            "/image/upscale",
            json!({"image": STANDARD.encode(&picture), "scale": 5}),
            "scale",
        ),
        (
            "/image/upscale",
            json!({"image": STANDARD.encode(b"not an image at all")}),
            "image",
        ),
        ("/image/background-remove", json!({}), "image"),
        (
            "/image/background-remove",
            json!({"image": STANDARD.encode(&picture), "image_url": "https://example.com/a.png"}),
            "image_url",
        ),
        (
            "/image/background-remove",
            json!({"image_url": "ftp://example.com/a.png"}),
            "image_url",
        ),
    ] {
        let response = world.post(path, &body).await;
        assert_eq!(response.status(), 400, "{path} {body}");
        let error: Value = response.json().await.unwrap();
        assert!(error["details"].get(field).is_some(), "{field}: {error}");
    }
    assert_eq!(world.balance_nanos().await, before);
}

async fn speech_and_its_transcription(world: &World) {
    let before = world.balance_nanos().await;
    let input = "Hello there, general Kenobi.";
    let response = world
        .post(
            "/audio/speech",
            &json!({"model": "mock-tts", "input": input, "voice": "am_adam",
                "response_format": "wav", "speed": 1.0, "prompt": "Calm."}),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "audio/wav");
    assert_eq!(response.headers()["x-rialto-model-id"], "mock-tts");
    let wav = response.bytes().await.unwrap().to_vec();
    let reader = hound::WavReader::new(std::io::Cursor::new(&wav)).unwrap();
    let seconds = f64::from(reader.duration()) / f64::from(reader.spec().sample_rate);
    assert!((seconds - 1.0).abs() < 0.01, "four words: {seconds} s");
    let (path, upstream) = world.last_upstream();
    assert_eq!(path, "/v1/audio/speech");
    assert_eq!(upstream["model"], "mock-tts-model");
    assert_eq!(upstream["voice"], "am_adam");
    assert_eq!(upstream["instructions"], "Calm.");
    // 28 characters at $0.015 a thousand.
    let chars = input.chars().count() as i64;
    assert_eq!(
        before - world.balance_nanos().await,
        chars * 15 * NANOS_PER_USD / 1000 / 1000
    );
    // Streamed: relayed as the backend sends it (chunked, no length),
    // the same audio, charged the same once it has ended.
    let before = world.balance_nanos().await;
    let response = world
        .post(
            "/audio/speech",
            &json!({"model": "mock-tts", "input": input, "voice": "am_adam",
                "response_format": "wav", "streaming": true}),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "audio/wav");
    assert!(response.headers().get("content-length").is_none());
    let streamed = response.bytes().await.unwrap();
    assert_eq!(streamed.as_ref(), wav.as_slice());
    let price = chars * 15 * NANOS_PER_USD / 1000 / 1000;
    let mut spent = 0;
    for _ in 0..50 {
        spent = before - world.balance_nanos().await;
        if spent != 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(spent, price, "charged once the stream ended");
    // The model's default format; formats and voices it lacks.
    let response = world
        .post(
            "/audio/speech",
            &json!({"model": "mock-tts", "input": "Hi."}),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "audio/wav");
    for (body, field) in [
        (
            json!({"model": "mock-tts", "input": "Hi.", "response_format": "mp3"}),
            "response_format",
        ),
        (
            json!({"model": "mock-tts", "input": "Hi.", "voice": "nobody"}),
            "voice",
        ),
        (json!({"model": "mock-tts", "input": ""}), "input"),
        (
            json!({"model": "mock-tts", "input": "Hi.", "speed": 9}),
            "speed",
        ),
    ] {
        let response = world.post("/audio/speech", &body).await;
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert!(error["details"].get(field).is_some(), "{field}: {error}");
    }

    // The speech, transcribed: one second, billed as one.
    let before = world.balance_nanos().await;
    let response = world
        .form(
            "/audio/transcriptions",
            &[("model", "mock-asr"), ("timestamps", "true")],
            Some(("file", "speech.wav", &wav)),
        )
        .await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["text"], input);
    assert_eq!(body["duration"], 1);
    let segments = body["timestamps"]["segment"].as_array().unwrap();
    assert!(!segments.is_empty(), "{body}");
    assert_eq!(segments.last().unwrap()["end"].as_f64().unwrap(), 1.0);
    assert!(!body["timestamps"]["word"].as_array().unwrap().is_empty());
    assert_eq!(before - world.balance_nanos().await, 100_000);
    let (path, upstream) = world.last_upstream();
    assert_eq!(path, "/v1/audio/transcriptions");
    assert_eq!(upstream["model"], "whisper-1");
    assert_eq!(upstream["response_format"], "verbose_json");
    assert_eq!(upstream["file"]["bytes"], wav.len());

    let response = world
        .form(
            "/audio/transcriptions",
            &[("model", "mock-asr"), ("response_format", "text")],
            Some(("file", "speech.wav", &wav)),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), input);
    let response = world
        .form(
            "/audio/transcriptions",
            &[("model", "mock-asr"), ("response_format", "srt")],
            Some(("file", "speech.wav", &wav)),
        )
        .await;
    let srt = response.text().await.unwrap();
    assert!(srt.starts_with("1\n00:00:00,000 --> "), "{srt}");
    let response = world
        .form(
            "/audio/transcriptions",
            &[("model", "mock-asr"), ("response_format", "verbose_json")],
            Some(("file", "speech.wav", &wav)),
        )
        .await;
    let verbose: Value = response.json().await.unwrap();
    assert_eq!(verbose["task"], "transcribe");
    assert!(verbose["segments"].is_array());

    // No file, or not a form: refused before anything is held.
    let response = world
        .form("/audio/transcriptions", &[("model", "mock-asr")], None)
        .await;
    assert_eq!(response.status(), 400);
    let response = world
        .post("/audio/transcriptions", &json!({"model": "mock-asr"}))
        .await;
    assert_eq!(response.status(), 415);
    // What the backend cannot read is its 400, and costs nothing.
    let before = world.balance_nanos().await;
    let response = world
        .form(
            "/audio/transcriptions",
            &[("model", "mock-asr")],
            Some(("file", "speech.wav", b"not a wav at all")),
        )
        .await;
    assert_eq!(response.status(), 400);
    assert_eq!(world.balance_nanos().await, before);
}

async fn listings(world: &World) {
    let voices: Value = world
        .sandbox
        .call(Method::GET, "/audio/voices", &world.key(), None)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = voices["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["af_sky", "am_adam"]);
    let models = |kind: &'static str| async move {
        let list: Value = world
            .sandbox
            .http()
            .get(world.sandbox.api(&format!("/models?type={kind}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        list["data"].as_array().unwrap().clone()
    };
    let images = models("image").await;
    assert_eq!(images.len(), 3);
    assert_eq!(
        images[0]["model_spec"]["pricing"]["generation"]["usd"]
            .to_string()
            .as_str(),
        "0.04"
    );
    assert_eq!(
        images[1]["model_spec"]["pricing"]["resolutions"]["2K"]["usd"].to_string(),
        "0.2"
    );
    assert_eq!(
        images[1]["model_spec"]["constraints"]["defaultResolution"],
        "1K"
    );
    let tts = models("tts").await;
    assert_eq!(
        tts[0]["model_spec"]["pricing"]["input"]["usd"].to_string(),
        "15"
    );
    assert_eq!(
        tts[0]["model_spec"]["supported_formats"],
        json!(["wav", "pcm"])
    );
    assert_eq!(tts[0]["model_spec"]["default_voice"], "af_sky");
    let upscale = models("upscale").await;
    assert_eq!(
        upscale[0]["model_spec"]["pricing"]["upscale"]["4x"]["usd"].to_string(),
        "0.08"
    );
    let asr = models("asr").await;
    assert_eq!(
        asr[0]["model_spec"]["pricing"]["per_audio_second"]["usd"].to_string(),
        "0.0001"
    );
}

/// The spec's image class (20 requests a minute) and audio class (60),
/// then 429, costing nothing.
async fn the_media_classes_limit_requests_per_minute(world: &World) {
    let body = json!({"model": "rpm-image", "prompt": "a dot", "width": 8, "height": 8});
    for n in 0..20 {
        let response = world.post("/image/generate", &body).await;
        assert_eq!(response.status(), 200, "request {n}");
        assert_eq!(response.headers()["x-ratelimit-limit-requests"], "20");
    }
    let before = world.balance_nanos().await;
    let response = world.post("/image/generate", &body).await;
    assert_eq!(response.status(), 429);
    assert!(
        response
            .headers()
            .contains_key("x-ratelimit-reset-requests")
    );
    assert_eq!(world.balance_nanos().await, before);

    // A speech model's window, in the audio class; this key already spent
    // some of it (the SDK's calls): what is left, then 429.
    let speech = json!({"model": "mock-tts", "input": "Hi.", "response_format": "pcm"});
    let mut admitted = 0;
    loop {
        let response = world.post("/audio/speech", &speech).await;
        if response.status() == 429 {
            break;
        }
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-ratelimit-limit-requests"], "60");
        admitted += 1;
        assert!(
            admitted <= 60,
            "past the audio class's 60 requests a minute"
        );
    }
    assert!(admitted > 0);
}
