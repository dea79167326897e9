//! Python clients against Rialto, in both topologies: the official `openai`
//! SDK (a plain chat, a streamed chat, `n = 2`; tests/python/openai_sdk_check.py)
//! and an OpenAPI conformance check of the published document against real
//! exchanges (tests/python/openapi_conformance.py), in a sandbox with one
//! more model whose global window refuses its second request of a minute.

use std::path::PathBuf;

use rialto_test_kit::{MockSearxng, MockUpstream, Sandbox, Storage, Topology};

use crate::both_topologies;
use crate::support::{World, models_toml};

both_topologies!(openai_python_sdk);

/// The venv's Python that `make test` prepares (or `E2E_PYTHON`).
fn python() -> PathBuf {
    if let Some(path) = std::env::var_os("E2E_PYTHON") {
        return PathBuf::from(path);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run `make test` (it creates the venv with the openai SDK)",
        python.display()
    );
    python
}

/// Runs `tests/python/<script>` with `envs`; fails the test with its output
/// unless it exits 0. Returns its stdout.
pub async fn run_script(script: &str, envs: &[(&str, &str)]) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(script);
    let output = tokio::process::Command::new(python())
        .arg(path)
        .envs(envs.iter().copied())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{script} failed:\n{stdout}\n{stderr}"
    );
    stdout
}

async fn openai_python_sdk(world: &World) {
    let account = world.sandbox.create_account("sdk").await.unwrap();
    let (_, key) = world
        .sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    let base_url = world.sandbox.api("");
    let stdout = run_script(
        "openai_sdk_check.py",
        &[
            ("RIALTO_E2E_BASE_URL", &base_url),
            ("RIALTO_E2E_API_KEY", &key),
            ("RIALTO_E2E_MODEL", "mock-chat"),
        ],
    )
    .await;
    for check in [
        "plain ok",
        "stream ok",
        "n=2 ok",
        "thinking ok",
        "auth error ok",
    ] {
        assert!(stdout.contains(check), "{stdout}");
    }
}

mod openapi_conformance {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_process() {
        let (world, searxng) = conformance_world(Topology::OneProcess).await;
        super::openapi_conformance(&world, &searxng).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn split() {
        let (world, searxng) = conformance_world(Topology::Split).await;
        super::openapi_conformance(&world, &searxng).await;
    }
}

/// A model limited to one request per minute for all callers together, so
/// that the conformance check meets a real 429 from the limiter.
const LIMITED_MODEL: &str = "limited-chat";

/// A model that searches the web, with a mock SearXNG behind it.
const SEARCH_MODEL: &str = "search-chat";

/// The shared world's catalog plus [`LIMITED_MODEL`] and [`SEARCH_MODEL`],
/// and the mock SearXNG (which also serves the pages to scrape).
async fn conformance_world(topology: Topology) -> (World, MockSearxng) {
    let mock = MockUpstream::start().await.unwrap();
    let searxng = MockSearxng::start().await.unwrap();
    let limited = format!(
        r#"
[[models]]
id = "{LIMITED_MODEL}"
name = "Limited Chat"
tier = "XS"
global_rpm = 1
backends = [{{ kind = "openai", url = "{0}", model = "mock-model" }}]

[[models]]
id = "{SEARCH_MODEL}"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
capabilities = ["web_search", "tools"]
backends = [{{ kind = "openai", url = "{0}", model = "mock-model" }}]

[[models]]
id = "conformance-image"
type = "image"
usd_per_image = 0.01
backends = [{{ kind = "openai", url = "{0}" }}]

[[models]]
id = "conformance-edit"
type = "inpaint"
usd_per_image = 0.01
backends = [{{ kind = "openai", url = "{0}" }}]

[[models]]
id = "conformance-tts"
type = "tts"
usd_per_thousand_characters = 0.01
voices = ["af_sky"]
audio_formats = ["wav"]
backends = [{{ kind = "openai", url = "{0}" }}]

[[models]]
id = "conformance-asr"
type = "asr"
usd_per_audio_second = 0.001
backends = [{{ kind = "openai", url = "{0}" }}]

[[models]]
id = "conformance-upscale"
type = "upscale"
usd_per_upscale = {{ "2x" = 0.02, "4x" = 0.04 }}
backends = [{{ kind = "openai", url = "{0}" }}]

[[models]]
id = "conformance-video"
type = "video"
usd_per_video_second = 0.01
video_durations = [1]
video_resolutions = ["144p"]
backends = [{{ kind = "openai", url = "{0}" }}]

[web_search]
provider = "searxng"
url = "{1}"
usd_per_search = 0.01

[web_scraping]
usd_per_scraped_url = 0.002

# The script signs in an empty wallet and uses free models with it (the
# default minimum refuses that: tests/e2e/wallet.rs).
[wallet]
min_balance_usd = "0"
"#,
        mock.base_url(),
        searxng.url()
    );
    let sandbox = Sandbox::builder(topology)
        .storage(Storage::Sqlite)
        .config(&models_toml(&mock.base_url()))
        .config(&limited)
        // The mock SearXNG's pages are on loopback.
        .env("RIALTO_GATEWAY__FILE_URLS_ALLOW_PRIVATE", "true")
        .start()
        .await
        .unwrap();
    (World { mock, sandbox }, searxng)
}

/// An independent wallet (eth-account for the sign-in, the x402 Python SDK
/// for the payment) against a facilitator double.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x402_python_wallet() {
    let mock = MockUpstream::start().await.unwrap();
    let facilitator = rialto_test_kit::Facilitator::start().await.unwrap();
    let config = format!(
        r#"
[[models]]
id = "paid-chat"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
backends = [{{ kind = "openai", url = "{}", model = "mock-model" }}]

[wallet]
domains = ["127.0.0.1:8080", "localhost:8080"]

[x402]
facilitator_url = "{}"
pay_to_evm = "0x2222222222222222222222222222222222222222"
min_usd = "5"
max_usd = "10000"
"#,
        mock.base_url(),
        facilitator.url()
    );
    let sandbox = Sandbox::builder(Topology::OneProcess)
        .config(&config)
        .start()
        .await
        .unwrap();
    let stdout = run_script(
        "x402_wallet_check.py",
        &[
            ("RIALTO_E2E_BASE_URL", &sandbox.api("")),
            ("RIALTO_E2E_MODEL", "paid-chat"),
            ("RIALTO_E2E_DOMAIN", "localhost:8080"),
        ],
    )
    .await;
    for check in ["sign-in ok", "top-up ok", "chat ok"] {
        assert!(stdout.contains(check), "{stdout}");
    }
    assert_eq!(facilitator.settlements().len(), 1);
}

async fn openapi_conformance(world: &World, searxng: &MockSearxng) {
    let page = searxng.page_url("conformance");
    let stdout = run_script(
        "openapi_conformance.py",
        &[
            ("RIALTO_E2E_ROOT_URL", &world.sandbox.url),
            ("RIALTO_E2E_OPERATOR_TOKEN", &world.sandbox.operator_token),
            ("RIALTO_E2E_MODEL", "mock-chat"),
            ("RIALTO_E2E_LIMITED_MODEL", LIMITED_MODEL),
            ("RIALTO_E2E_SEARCH_MODEL", SEARCH_MODEL),
            ("RIALTO_E2E_PAGE_URL", &page),
        ],
    )
    .await;
    assert!(stdout.contains("conformance ok"), "{stdout}");
}
