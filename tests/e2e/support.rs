//! Shared set-up: a mock upstream, a sandbox configured with models that use
//! it, and assertions every response must pass.

use rialto_test_kit::{MockUpstream, Sandbox, Storage, Topology};

pub struct World {
    pub mock: MockUpstream,
    pub sandbox: Sandbox,
}

/// The issue's example model, pointed at a fresh mock upstream, plus a model
/// whose only backend is down and a deprecated one (anonymized: a third
/// party's, for `modelPrivacy`).
pub fn models_toml(mock_url: &str) -> String {
    format!(
        r#"
[[models]]
id = "mock-chat"
name = "Mock Chat"
type = "text"
tier = "XS"
input_usd_per_mtok = 0.5
output_usd_per_mtok = 1.5
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]

[[models]]
id = "dead-chat"
name = "Dead Chat"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
backends = [{{ kind = "openai", url = "http://127.0.0.1:9/v1" }}]

[[models]]
id = "old-chat"
name = "Old Chat"
deprecation_date = "2026-12-01"
privacy = "anonymized"
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]
"#
    )
}

pub async fn world(topology: Topology, storage: Storage) -> World {
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(topology)
        .storage(storage)
        .config(&models_toml(&mock.base_url()))
        .env("RIALTO_GATEWAY__MAX_BODY_BYTES", "1048576")
        .env("RIALTO_ROUTER__REQUEST_TIMEOUT_SECS", "2")
        .start()
        .await
        .unwrap();
    World { mock, sandbox }
}

/// Headers the spec puts on every response.
pub fn assert_common_headers(response: &reqwest::Response) {
    let headers = response.headers();
    for name in [
        "cf-ray",
        "x-rialto-version",
        "x-rialto-host-name",
        "date",
        "content-type",
        "x-rialto-timestamp",
    ] {
        assert!(
            headers.contains_key(name),
            "missing {name} on {}",
            response.url()
        );
    }
    let version = headers["x-rialto-version"].to_str().unwrap();
    let (day, time) = version.split_once('.').unwrap();
    assert!(day.len() == 8 && time.len() == 6, "revision {version}");
    assert_eq!(headers["cf-ray"].len(), 32);
    let stamp = headers["x-rialto-timestamp"].to_str().unwrap();
    assert!(
        chrono::DateTime::parse_from_rfc3339(stamp).is_ok() && stamp.ends_with('Z'),
        "x-rialto-timestamp {stamp}"
    );
}

/// Runs one scenario in both topologies, each with a fresh world.
#[macro_export]
macro_rules! both_topologies {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn one_process() {
                    let world = $crate::support::world(
                        rialto_test_kit::Topology::OneProcess,
                        rialto_test_kit::Storage::Sqlite,
                    ).await;
                    super::$name(&world).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn split() {
                    let world = $crate::support::world(
                        rialto_test_kit::Topology::Split,
                        rialto_test_kit::Storage::Sqlite,
                    ).await;
                    super::$name(&world).await;
                }
            }
        )*
    };
}

/// A loopback port nobody listens on (for a server a test starts on it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One sample of the gateway's `GET /metrics` (the line starting with
/// `sample`, labels included), 0 when absent.
pub async fn metric(sandbox: &Sandbox, sample: &str) -> f64 {
    let text = sandbox
        .http()
        .get(format!("{}/metrics", sandbox.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(sample)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Polls `check` every 100 ms until it holds, for at most 20 s (files are
/// read every 2 s; in the split topology each process on its own clock).
pub async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !check().await {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
