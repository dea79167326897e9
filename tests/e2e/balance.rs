//! Balancing across pods: three router processes behind one name (as a
//! headless Service's pods), started one by one while a gateway serves.
//! Each serves within seconds of starting, and one that dies stops getting
//! calls.
//!
//! The name is resolved through the system resolver, as in a cluster: the
//! gateway runs in a mount namespace of its own (`unshare -m`) where
//! `/etc/hosts` lists the three loopback addresses the routers listen on;
//! the machine's `/etc/hosts` is not touched.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rialto_test_kit::{MockUpstream, rialto_binary};
use serde_json::{Value, json};

const NAME: &str = "routers.rialto.test";
const GRPC_TOKEN: &str = "balance-grpc-token";
const OPERATOR_TOKEN: &str = "balance-operator-token";

/// A process killed when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `program args`, logging to `log`, and waits for its
/// `rialto: <announce>` line; returns the process and the rest of the line.
fn start(mut command: Command, log: &std::path::Path, announce: &str) -> (Running, String) {
    let log = std::fs::File::create(log).unwrap();
    command
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log.try_clone().unwrap());
    let mut child = command.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (found_tx, found_rx) = std::sync::mpsc::channel();
    let wanted = announce.to_owned();
    std::thread::spawn(move || {
        let mut log = log;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = writeln!(log, "{line}");
            if let Some((_, rest)) = line.split_once(&wanted) {
                let _ = found_tx.send(rest.to_owned());
            }
        }
    });
    let rest = found_rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("no {announce:?} from the process"));
    (Running(child), rest)
}

fn model(backend_url: &str) -> String {
    format!(
        r#"
[[models]]
id = "free-chat"
input_usd_per_mtok = 0.0
output_usd_per_mtok = 0.0
backends = [{{ kind = "openai", url = "{backend_url}", model = "mock-model" }}]
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routers_started_one_by_one_all_serve_within_seconds() {
    if !Command::new("unshare")
        .args(["-m", "true"])
        .status()
        .is_ok_and(|s| s.success())
    {
        panic!("this test needs `unshare -m` (root, util-linux): run it as CI does");
    }
    let dir = tempfile::tempdir().unwrap();
    // One port, three addresses: pods of a headless Service.
    let port = std::net::TcpListener::bind("127.0.0.2:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let hosts = dir.path().join("hosts");
    std::fs::write(
        &hosts,
        format!("127.0.0.1 localhost\n127.0.0.2 {NAME}\n127.0.0.3 {NAME}\n127.0.0.4 {NAME}\n"),
    )
    .unwrap();

    let gateway_config = dir.path().join("gateway.toml");
    std::fs::write(
        &gateway_config,
        format!(
            r#"[gateway]
listen = "127.0.0.1:0"
workers = 2
[grpc]
token = "{GRPC_TOKEN}"
[database]
url = "sqlite://{}/rialto.db"
[operator]
token = "{OPERATOR_TOKEN}"
[remote]
router = "http://{NAME}:{port}"
resolve_every_ms = 200
{}"#,
            dir.path().display(),
            model("http://127.0.0.1:9/v1")
        ),
    )
    .unwrap();
    let binary = rialto_binary().unwrap();
    let mut gateway = Command::new("unshare");
    gateway
        .args([
            "-m",
            "sh",
            "-c",
            r#"mount --bind "$1" /etc/hosts && shift && exec "$@""#,
            "sh",
        ])
        .arg(&hosts)
        .arg(&binary)
        .arg("--config")
        .arg(&gateway_config)
        .args(["serve", "--services", "gateway,auth,limiter,billing"])
        .current_dir(dir.path());
    let (_gateway, url) = start(
        gateway,
        &dir.path().join("gateway.log"),
        "gateway listening on ",
    );
    let url = url.trim().to_owned();

    let http = rialto_test_kit::sandbox::http_client().unwrap();
    let created: Value = http
        .post(format!("{url}/admin/v1/accounts"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&json!({"name": "balanced"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let key = created["api_key"]["key"]
        .as_str()
        .or_else(|| created["key"].as_str())
        .unwrap_or_else(|| panic!("no key in {created}"))
        .to_owned();
    let chat = async || {
        http.post(format!("{url}/api/v1/chat/completions"))
            .bearer_auth(&key)
            .json(&json!({"model": "free-chat", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    };
    // No router yet: a call fails at once rather than waiting.
    let started = Instant::now();
    assert_ne!(chat().await, 200);
    assert!(started.elapsed() < Duration::from_secs(10));

    let mut mocks = Vec::new();
    let mut routers = Vec::new();
    for index in 0..3 {
        let mock = MockUpstream::start().await.unwrap();
        let config = dir.path().join(format!("router{index}.toml"));
        std::fs::write(
            &config,
            format!(
                "[grpc]\nlisten = \"127.0.0.{}:{port}\"\ntoken = \"{GRPC_TOKEN}\"\n{}",
                index + 2,
                model(&mock.base_url())
            ),
        )
        .unwrap();
        let mut command = Command::new(&binary);
        command
            .arg("--config")
            .arg(&config)
            .args(["serve", "--services", "router"])
            .current_dir(dir.path());
        let (router, _) = start(
            command,
            &dir.path().join(format!("router{index}.log")),
            "grpc listening on ",
        );
        routers.push(Some(router));
        mocks.push(mock);
        // This router gets calls within seconds of starting.
        let deadline = Instant::now() + Duration::from_secs(10);
        while mocks[index].request_count() == 0 {
            assert!(
                Instant::now() < deadline,
                "router {index} got no call in 10 s of starting; counts: {:?}",
                mocks
                    .iter()
                    .map(MockUpstream::request_count)
                    .collect::<Vec<_>>()
            );
            assert_eq!(chat().await, 200);
        }
    }
    // Calls spread over all three.
    let before: Vec<usize> = mocks.iter().map(MockUpstream::request_count).collect();
    for _ in 0..60 {
        assert_eq!(chat().await, 200);
    }
    for (index, mock) in mocks.iter().enumerate() {
        assert!(
            mock.request_count() > before[index],
            "router {index} got none of 60 calls"
        );
    }

    // A router that dies leaves the balance: after a probe's interval no
    // call goes to it and none fails.
    routers[1].take();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let dead = mocks[1].request_count();
    for _ in 0..30 {
        assert_eq!(chat().await, 200);
    }
    assert_eq!(mocks[1].request_count(), dead);
}
