//! Asynchronous media jobs end to end: `/video/*` and `/audio/queue|
//! retrieve|quote|complete` in both topologies against the mock upstream's
//! video API (real H.264 in MP4, read back here) and its speech; the exact
//! charge of each delivered job and nothing for the others; the video
//! class's requests per minute; and a process killed with jobs in every
//! state, after which each job finishes and is charged once.

use std::time::Duration;

use reqwest::Method;
use rialto_test_kit::mock_video::mp4_summary;
use rialto_test_kit::{MockUpstream, Sandbox, Storage, Topology};
use serde_json::{Value, json};

/// A video second costs $0.05 (`mock-video`), speech $0.015 per thousand
/// characters.
fn config(mock_url: &str, workers: usize) -> String {
    format!(
        r#"
[media]
job_workers = {workers}
job_lease_secs = 2
job_poll_ms = 50

[[models]]
id = "mock-video"
type = "video"
usd_per_video_second = 0.05
video_durations = [2, 1, 3, 5]
video_resolutions = ["144p", "240p"]
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-video-model" }}]

[[models]]
id = "rpm-video"
type = "video"
usd_per_video_second = 0.001
video_durations = [1]
video_resolutions = ["144p"]
backends = [{{ kind = "openai", url = "{mock_url}" }}]

[[models]]
id = "mock-tts"
type = "tts"
usd_per_thousand_characters = 0.015
voices = ["af_sky", "am_adam"]
audio_formats = ["wav"]
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-tts-model" }}]
"#
    )
}

const NANOS_PER_USD: i64 = 1_000_000_000;
/// `mock-video`'s price of one second, in nano-dollars.
const VIDEO_SECOND_NANOS: i64 = NANOS_PER_USD / 20;

struct World {
    upstream: MockUpstream,
    sandbox: Sandbox,
    key: String,
    admin: String,
}

async fn world(topology: Topology, storage: Storage, workers: usize) -> World {
    let upstream = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(topology)
        .storage(storage)
        .config(&config(&upstream.base_url(), workers))
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("jobs").await.unwrap();
    let (_, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    World {
        upstream,
        sandbox,
        key,
        admin: account.admin_key,
    }
}

impl World {
    async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.post_as(&self.key, path, body).await
    }

    async fn post_as(&self, key: &str, path: &str, body: &Value) -> reqwest::Response {
        self.sandbox
            .call(Method::POST, path, key, Some(body))
            .await
            .unwrap()
    }

    async fn ok_json(&self, path: &str, body: &Value) -> Value {
        let response = self.post(path, body).await;
        let status = response.status();
        let text = response.text().await.unwrap();
        assert_eq!(status, 200, "{path}: {text}");
        serde_json::from_str(&text).unwrap()
    }

    async fn refused(&self, path: &str, body: &Value, status: u16) -> Value {
        let response = self.post(path, body).await;
        assert_eq!(response.status(), status, "{path} {body}");
        response.json().await.unwrap()
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

    /// Queues a video; its queue id.
    async fn queue_video(&self, prompt: &str, duration: &str) -> String {
        let queued = self
            .ok_json(
                "/video/queue",
                &json!({"model": "mock-video", "prompt": prompt, "duration": duration,
                    "resolution": "144p", "aspect_ratio": "16:9"}),
            )
            .await;
        assert_eq!(queued["model"], "mock-video", "{queued}");
        queued["queue_id"].as_str().unwrap().to_owned()
    }

    /// Polls `retrieve` until the job is no longer processing; its last
    /// answer.
    async fn finished(&self, path: &str, model: &str, queue_id: &str) -> reqwest::Response {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let response = self
                .post(path, &json!({"model": model, "queue_id": queue_id}))
                .await;
            let json = response.headers().get("content-type").is_some_and(|t| {
                t.to_str()
                    .unwrap_or_default()
                    .starts_with("application/json")
            });
            if !(response.status() == 200 && json) {
                return response;
            }
            let status: Value = response.json().await.unwrap();
            assert_eq!(status["status"], "PROCESSING", "{status}");
            assert!(status["average_execution_time"].as_i64().unwrap() > 0);
            assert!(status["execution_duration"].as_i64().unwrap() >= 0);
            assert!(
                std::time::Instant::now() < deadline,
                "{queue_id} still processing"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until `retrieve` says the job is being made (the backend has
    /// it), not merely queued.
    async fn wait_progress(&self, queue_id: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let status: Value = self
                .post(
                    "/video/retrieve",
                    &json!({"model": "mock-video", "queue_id": queue_id}),
                )
                .await
                .json()
                .await
                .unwrap();
            if status["progress"].as_u64().unwrap_or(0) > 0 {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no progress: {status}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the balance is `expected` (a settlement after a job's
    /// last report may land a moment after `retrieve` shows the media).
    async fn balance_becomes(&self, expected: i64) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let balance = self.balance_nanos().await;
            if balance == expected {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "balance {balance}, expected {expected}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// An MP4 the job delivered: H.264 of the asked size and length.
async fn assert_video(response: reqwest::Response, size: (u16, u16), seconds: f64) {
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "video/mp4");
    assert_eq!(response.headers()["x-rialto-model-id"], "mock-video");
    let bytes = response.bytes().await.unwrap();
    let (width, height, length, frames) = mp4_summary(&bytes).unwrap();
    assert_eq!((width, height), size);
    assert!((length - seconds).abs() < 0.01, "{length}");
    assert_eq!(frames, (seconds as u32) * rialto_test_kit::mock_video::FPS);
}

mod video_and_audio_jobs {
    use rialto_test_kit::{Storage, Topology};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_process() {
        super::scenarios(super::world(Topology::OneProcess, Storage::Sqlite, 4).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn split() {
        super::scenarios(super::world(Topology::Split, Storage::Postgres, 4).await).await;
    }
}

async fn scenarios(world: World) {
    quotes(&world).await;
    a_video_is_made_delivered_and_charged(&world).await;
    jobs_that_deliver_nothing_cost_nothing(&world).await;
    refusals(&world).await;
    queued_speech(&world).await;
    python_client(&world).await;
    the_video_class_limits_queued_requests(&world).await;
}

async fn quotes(world: &World) {
    let quote = world
        .ok_json(
            "/video/quote",
            &json!({"model": "mock-video", "duration": "5s", "resolution": "240p"}),
        )
        .await;
    assert_eq!(quote["quote"].to_string(), "0.25");
    let refused = world
        .refused(
            "/video/quote",
            &json!({"model": "mock-video", "duration": "7s"}),
            400,
        )
        .await;
    assert!(refused["details"]["duration"].is_object(), "{refused}");
    let quote = world
        .ok_json(
            "/audio/quote",
            &json!({"model": "mock-tts", "character_count": 2000}),
        )
        .await;
    assert_eq!(quote["quote"].to_string(), "0.03");
    let refused = world
        .refused("/audio/quote", &json!({"model": "mock-tts"}), 400)
        .await;
    assert!(
        refused["details"]["character_count"].is_object(),
        "{refused}"
    );
}

async fn a_video_is_made_delivered_and_charged(world: &World) {
    let before = world.balance_nanos().await;
    let queue_id = world.queue_video("a gondola at dawn", "2s").await;
    // The backend was asked in OpenAI's shape.
    let response = world
        .finished("/video/retrieve", "mock-video", &queue_id)
        .await;
    let create = world
        .upstream
        .paths()
        .iter()
        .zip(world.upstream.requests())
        .find(|(path, body)| *path == "/v1/videos" && body["prompt"] == "a gondola at dawn")
        .map(|(_, body)| body)
        .unwrap();
    assert_eq!(
        create,
        json!({"model": "mock-video-model", "prompt": "a gondola at dawn", "seconds": "2",
            "size": "256x144"})
    );
    assert_video(response, (256, 144), 2.0).await;
    world.balance_becomes(before - 2 * VIDEO_SECOND_NANOS).await;

    // Retrieved again: the same video, until it is completed.
    let again = world
        .post(
            "/video/retrieve",
            &json!({"model": "mock-video", "queue_id": queue_id}),
        )
        .await;
    assert_video(again, (256, 144), 2.0).await;
    let done = world
        .ok_json(
            "/video/complete",
            &json!({"model": "mock-video", "queue_id": queue_id}),
        )
        .await;
    assert_eq!(done, json!({"success": true}));
    world
        .refused(
            "/video/retrieve",
            &json!({"model": "mock-video", "queue_id": queue_id}),
            404,
        )
        .await;

    // `delete_media_on_completion`: answered once, then gone.
    let queue_id = world.queue_video("a bridge of sighs", "1s").await;
    let response = world
        .finished("/video/retrieve", "mock-video", &queue_id)
        .await;
    assert_video(response, (256, 144), 1.0).await;
    let last = world
        .post(
            "/video/retrieve",
            &json!({"model": "mock-video", "queue_id": queue_id,
                "delete_media_on_completion": true}),
        )
        .await;
    assert_video(last, (256, 144), 1.0).await;
    world
        .refused(
            "/video/retrieve",
            &json!({"model": "mock-video", "queue_id": queue_id}),
            404,
        )
        .await;
    world.balance_becomes(before - 3 * VIDEO_SECOND_NANOS).await;
}

async fn jobs_that_deliver_nothing_cost_nothing(world: &World) {
    let before = world.balance_nanos().await;
    // The backend's content policy fails the job: the retrieve says why.
    let queue_id = world.queue_video("something forbidden", "1s").await;
    let response = world
        .finished("/video/retrieve", "mock-video", &queue_id)
        .await;
    assert_eq!(response.status(), 400);
    assert_eq!(response.headers()["x-rialto-is-content-violation"], "true");
    let body: Value = response.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("safety"), "{body}");

    // Cancelled while it is being made: nothing charged, nothing kept.
    let queue_id = world.queue_video("a long canal [slow]", "3s").await;
    world.wait_progress(&queue_id).await;
    let done = world
        .ok_json(
            "/video/complete",
            &json!({"model": "mock-video", "queue_id": queue_id}),
        )
        .await;
    assert_eq!(done, json!({"success": true}));
    world
        .refused(
            "/video/retrieve",
            &json!({"model": "mock-video", "queue_id": queue_id}),
            404,
        )
        .await;
    // Another account's job is nobody's.
    let other = world.sandbox.create_account("other").await.unwrap();
    let mine = world.queue_video("a mask", "1s").await;
    let response = world
        .post_as(
            &other.admin_key,
            "/video/retrieve",
            &json!({"model": "mock-video", "queue_id": mine}),
        )
        .await;
    assert_eq!(response.status(), 404);
    let response = world.finished("/video/retrieve", "mock-video", &mine).await;
    assert_video(response, (256, 144), 1.0).await;
    world.balance_becomes(before - VIDEO_SECOND_NANOS).await;
}

async fn refusals(world: &World) {
    let before = world.balance_nanos().await;
    let base = json!({"model": "mock-video", "prompt": "a lagoon", "duration": "2s"});
    let with = |name: &str, value: Value| {
        let mut body = base.clone();
        body[name] = value;
        body
    };
    for (body, member) in [
        (
            with("image_url", json!("https://example.com/a.png")),
            "image_url",
        ),
        (with("colour", json!("red")), "colour"),
        (with("duration", json!("4s")), "duration"),
        (with("resolution", json!("1080p")), "resolution"),
        (with("aspect_ratio", json!("4:3")), "aspect_ratio"),
        (with("prompt", json!("")), "prompt"),
    ] {
        let refused = world.refused("/video/queue", &body, 400).await;
        // Named in the details (an unknown member, under the object's own).
        assert!(
            refused["details"].to_string().contains(member),
            "{member}: {refused}"
        );
    }
    let refused = world
        .refused(
            "/video/queue",
            &json!({"model": "mock-tts", "prompt": "a", "duration": "2s"}),
            400,
        )
        .await;
    assert!(refused["details"]["model"].is_object(), "{refused}");
    world
        .refused(
            "/video/queue",
            &json!({"model": "no-such", "prompt": "a", "duration": "2s"}),
            404,
        )
        .await;
    world
        .refused(
            "/video/retrieve",
            &json!({"model": "mock-video", "queue_id": "00000000-0000-0000-0000-000000000000"}),
            404,
        )
        .await;
    world
        .refused("/video/retrieve", &json!({"model": "mock-video"}), 400)
        .await;
    let gone = world
        .refused(
            "/video/transcriptions",
            &json!({"url": "https://example.com/v.mp4"}),
            410,
        )
        .await;
    assert!(
        gone["error"]
            .as_str()
            .unwrap()
            .contains("/audio/transcriptions")
    );
    let refused = world
        .refused(
            "/audio/queue",
            &json!({"model": "mock-tts", "prompt": "Hi", "lyrics_prompt": "la la"}),
            400,
        )
        .await;
    assert!(refused["details"]["lyrics_prompt"].is_object(), "{refused}");
    // Unauthenticated: 401, as every metered call.
    let response = world.post_as("not-a-key", "/video/queue", &base).await;
    assert_eq!(response.status(), 401);
    assert_eq!(world.balance_nanos().await, before);
}

async fn queued_speech(world: &World) {
    let before = world.balance_nanos().await;
    let prompt = "Queued speech is made by a worker, not while the client waits.";
    let queued = world
        .ok_json(
            "/audio/queue",
            &json!({"model": "mock-tts", "prompt": prompt, "voice": "am_adam"}),
        )
        .await;
    assert_eq!(queued["status"], "QUEUED");
    let queue_id = queued["queue_id"].as_str().unwrap();
    let response = world
        .finished("/audio/retrieve", "mock-tts", queue_id)
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "audio/wav");
    let wav = response.bytes().await.unwrap();
    let reader = hound::WavReader::new(std::io::Cursor::new(wav.to_vec())).unwrap();
    let words = prompt.split_whitespace().count() as f64;
    let seconds = f64::from(reader.duration()) / f64::from(reader.spec().sample_rate);
    assert!((seconds - words * 0.25).abs() < 0.01, "{seconds}");
    let speech = world
        .upstream
        .requests()
        .into_iter()
        .rev()
        .find(|body| body["input"] == prompt)
        .unwrap();
    assert_eq!(speech["voice"], "am_adam");
    assert_eq!(speech["model"], "mock-tts-model");
    // $0.015 per thousand characters.
    let chars = prompt.chars().count() as i64;
    world
        .balance_becomes(before - chars * 15 * NANOS_PER_USD / 1_000_000)
        .await;
    let done = world
        .ok_json(
            "/audio/complete",
            &json!({"model": "mock-tts", "queue_id": queue_id}),
        )
        .await;
    assert_eq!(done, json!({"success": true}));
}

/// A Python client with `requests`, and the video decoded frame by frame
/// by FFmpeg's H.264 decoder (PyAV).
async fn python_client(world: &World) {
    let base_url = world.sandbox.api("");
    let stdout = crate::python::run_script(
        "video_job_check.py",
        &[
            ("RIALTO_E2E_BASE_URL", &base_url),
            ("RIALTO_E2E_API_KEY", &world.key),
        ],
    )
    .await;
    assert!(stdout.contains("video job ok"), "{stdout}");
}

/// The spec's video class: 40 queued jobs a minute, then 429 (nothing
/// held); `retrieve` has a window of its own.
async fn the_video_class_limits_queued_requests(world: &World) {
    let (_, key) = world
        .sandbox
        .create_key(&world.admin, "INFERENCE")
        .await
        .unwrap();
    let body = json!({"model": "rpm-video", "prompt": "a dot", "duration": "1s"});
    let mut last = String::new();
    for n in 0..40 {
        let response = world.post_as(&key, "/video/queue", &body).await;
        assert_eq!(response.status(), 200, "request {n}");
        assert_eq!(response.headers()["x-ratelimit-limit-requests"], "40");
        let queued: Value = response.json().await.unwrap();
        last = queued["queue_id"].as_str().unwrap().to_owned();
    }
    let response = world.post_as(&key, "/video/queue", &body).await;
    assert_eq!(response.status(), 429);
    let response = world
        .post_as(
            &key,
            "/video/retrieve",
            &json!({"model": "rpm-video", "queue_id": last}),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-ratelimit-limit-requests"], "120");
}

/// `rialto serve` killed (SIGKILL) with a job completed and not fetched, a
/// job failed, a job being made on the backend and a job queued behind it
/// (one worker): after the restart the job being made is polled again on
/// the backend that has it (not started twice), the queued one runs, and
/// each delivered job is charged exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_survive_a_kill() {
    let mut world = world(Topology::OneProcess, Storage::Sqlite, 1).await;
    let before = world.balance_nanos().await;
    let completed = world.queue_video("a finished fresco", "1s").await;
    let response = world
        .finished("/video/retrieve", "mock-video", &completed)
        .await;
    assert_eq!(response.status(), 200);
    let failed = world.queue_video("a forbidden fresco", "1s").await;
    let response = world
        .finished("/video/retrieve", "mock-video", &failed)
        .await;
    assert_eq!(response.status(), 400);
    let making = world.queue_video("a slow fresco [slow]", "3s").await;
    world.wait_progress(&making).await;
    let queued = world.queue_video("a queued fresco", "2s").await;
    assert_eq!(world.upstream.videos_created(), 3);

    world.sandbox.kill("all").unwrap();
    world.sandbox.restart("all").await.unwrap();

    for (id, seconds) in [(&making, 3.0), (&queued, 2.0), (&completed, 1.0)] {
        let response = world.finished("/video/retrieve", "mock-video", id).await;
        assert_video(response, (256, 144), seconds).await;
    }
    let response = world
        .post(
            "/video/retrieve",
            &json!({"model": "mock-video", "queue_id": failed}),
        )
        .await;
    assert_eq!(response.status(), 400);
    // The job being made was resumed, not made again.
    assert_eq!(world.upstream.videos_created(), 4);
    world.balance_becomes(before - 6 * VIDEO_SECOND_NANOS).await;
    // And it stays so: nothing is charged twice later.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(world.balance_nanos().await, before - 6 * VIDEO_SECOND_NANOS);
}
