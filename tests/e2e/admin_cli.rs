//! `rialto admin`: the CLI as a client of the operator API. Every command
//! against a running server, in text and as JSON; the token from each place
//! it may come from; and its errors: the API's message, no token, no
//! server.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use rialto_test_kit::{Sandbox, Storage, Topology};
use serde_json::{Value, json};

use crate::support::world;

/// Variables that would choose the gateway or the token behind a test's back.
const ADMIN_VARIABLES: [&str; 5] = [
    "RIALTO_ADMIN_URL",
    "RIALTO_OPERATOR_TOKEN",
    "RIALTO_OPERATOR__TOKEN",
    "RIALTO_OPERATOR__TOKEN_FILE",
    "RIALTO_CONFIG",
];

/// `rialto --config <config> admin <args>`, with no variable of the test's
/// environment choosing the gateway or the token.
pub async fn rialto_admin(config: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(rialto_test_kit::sandbox::rialto_binary().unwrap());
    command.arg("--config").arg(config).arg("admin").args(args);
    for variable in ADMIN_VARIABLES {
        command.env_remove(variable);
    }
    tokio::process::Command::from(command)
        .output()
        .await
        .unwrap()
}

/// `rialto admin --url <the sandbox's gateway> <args>` with the sandbox's
/// configuration (whose `operator.token` is the token).
async fn admin(sandbox: &Sandbox, args: &[&str]) -> Output {
    let mut all = vec!["--url", sandbox.url.as_str()];
    all.extend_from_slice(args);
    rialto_admin(sandbox.config_path(), &all).await
}

/// Its stdout, once it succeeded.
fn success(output: &Output) -> String {
    assert!(
        output.status.success(),
        "exit {:?}: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).unwrap()
}

/// Its stderr, once it failed with exit code 1.
fn failure(output: &Output) -> String {
    assert_eq!(
        output.status.code(),
        Some(1),
        "stdout: {}",
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8(output.stderr.clone()).unwrap()
}

/// The value of a `key: value` line of a command's text output.
fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
        .map(str::trim)
}

/// A command's text output.
async fn text(sandbox: &Sandbox, args: &[&str]) -> String {
    success(&admin(sandbox, args).await)
}

/// A command's `--output json`, parsed.
async fn json_of(sandbox: &Sandbox, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend_from_slice(&["--output", "json"]);
    let stdout = success(&admin(sandbox, &all).await);
    serde_json::from_str(&stdout).unwrap_or_else(|error| panic!("{error}: {stdout}"))
}

async fn chat(sandbox: &Sandbox, key: &str) -> u16 {
    sandbox
        .call(
            reqwest::Method::POST,
            "/chat/completions",
            key,
            Some(&json!({"model": "mock-chat", "messages": [{"role": "user", "content": "hi"}]})),
        )
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// Every command, in the order an operator would use them, each checked by
/// what the server then does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_against_a_running_server() {
    let world = world(Topology::OneProcess, Storage::Sqlite).await;
    let sandbox = &world.sandbox;

    // create: the account and its first ADMIN key.
    let created = json_of(sandbox, &["accounts", "create", "--name", "cli-acme"]).await;
    assert_eq!(created["api_key"]["type"], "ADMIN");
    let id = created["id"].as_str().unwrap().to_owned();
    let admin_key = created["api_key"]["key"].as_str().unwrap().to_owned();
    assert!(admin_key.starts_with("RIALTO_ADMIN_KEY_"));
    let shown = text(
        sandbox,
        &[
            "accounts", "create", "--name", "cli-text", "--tier", "partner",
        ],
    )
    .await;
    assert!(
        field(&shown, "api_key.key").is_some_and(|k| k.starts_with("RIALTO_ADMIN_KEY_")),
        "{shown}"
    );
    assert_eq!(field(&shown, "api_key.type"), Some("ADMIN"), "{shown}");

    // list finds it, by search; get shows it with its balance.
    let listed = json_of(sandbox, &["accounts", "list", "--search", "CLI-ACME"]).await;
    assert_eq!(listed["total"], 1, "{listed}");
    assert_eq!(listed["data"][0]["id"], id.as_str());
    let paged = json_of(
        sandbox,
        &[
            "accounts", "list", "--search", "cli-", "--limit", "1", "--offset", "1",
        ],
    )
    .await;
    assert_eq!(paged["total"], 2, "{paged}");
    assert_eq!(paged["data"][0]["id"], id.as_str(), "newest first");
    let table = text(sandbox, &["accounts", "list", "--search", "cli-acme"]).await;
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("NAME"),
        "{table}"
    );
    assert!(
        lines[1].contains(&id) && lines[1].contains("cli-acme"),
        "{table}"
    );
    assert_eq!(lines[2], "1 of 1 account(s), from offset 0");
    let got = json_of(sandbox, &["accounts", "get", &id]).await;
    assert_eq!(got["name"], "cli-acme");
    assert_eq!(got["tier"], "standard");
    assert!(got["balance"]["usd"].is_string(), "{got}");
    let got = text(sandbox, &["accounts", "get", "--id", &id]).await;
    assert_eq!(field(&got, "name"), Some("cli-acme"), "{got}");
    assert!(field(&got, "balance.usd").is_some(), "{got}");

    // No credit yet; credit twice with one reference: applied once.
    assert_eq!(chat(sandbox, &admin_key).await, 402);
    let credit = [
        "accounts",
        "credit",
        "--id",
        &id,
        "--usd",
        "5.00",
        "--reference",
        "cli-1",
    ];
    let first = json_of(sandbox, &credit).await;
    assert_eq!(first["applied"], true);
    assert_eq!(first["balance"]["usd"], "5");
    let again = json_of(sandbox, &credit).await;
    assert_eq!(again["applied"], false, "the same reference credits once");
    assert_eq!(again["balance"]["usd"], "5");
    let again = text(sandbox, &credit).await;
    assert_eq!(field(&again, "applied"), Some("false"), "{again}");
    assert_eq!(field(&again, "balance.usd"), Some("5"), "{again}");
    assert_eq!(chat(sandbox, &admin_key).await, 200);

    // tier and stake.
    let tiered = json_of(
        sandbox,
        &["accounts", "tier", "--id", &id, "--tier", "partner"],
    )
    .await;
    assert_eq!(tiered["tier"], "partner");
    let got = json_of(sandbox, &["accounts", "get", &id]).await;
    assert_eq!(got["tier"], "partner");
    let staked = json_of(
        sandbox,
        &["accounts", "stake", "--id", &id, "--diem-per-day", "25"],
    )
    .await;
    assert_eq!(staked["diem_per_day"], "25", "{staked}");
    let got = json_of(sandbox, &["accounts", "get", &id]).await;
    assert_eq!(got["balance"]["diemPerDay"], "25", "{got}");

    // keys: create one, it works; listed without its secret; revoked, it is refused.
    let made = json_of(
        sandbox,
        &[
            "keys",
            "create",
            "--account",
            &id,
            "--description",
            "from the cli",
            "--limit-usd",
            "2.5",
            "--limit-period",
            "MONTH",
            "--expires-at",
            "2099-01-01",
        ],
    )
    .await;
    assert_eq!(made["success"], true);
    let data = &made["data"];
    assert_eq!(data["apiKeyType"], "INFERENCE");
    assert_eq!(data["consumptionLimit"]["usd"].to_string(), "2.5", "{made}");
    assert_eq!(data["limitPeriod"], "MONTH");
    let key_id = data["id"].as_str().unwrap().to_owned();
    let secret = data["apiKey"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("RIALTO_INFERENCE_KEY_"));
    let models = sandbox
        .http()
        .get(sandbox.api("/api_keys/rate_limits"))
        .bearer_auth(&secret)
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    assert_eq!(chat(sandbox, &secret).await, 200);
    let keys = json_of(sandbox, &["keys", "list", "--account", &id]).await;
    assert_eq!(keys["data"].as_array().unwrap().len(), 2, "{keys}");
    assert!(
        !keys.to_string().contains(&secret[21..]),
        "no secrets listed"
    );
    let table = text(sandbox, &["keys", "list", "--account", &id]).await;
    assert!(
        table.lines().next().unwrap().contains("DESCRIPTION"),
        "{table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&key_id) && l.contains("from the cli")),
        "{table}"
    );
    let shown = text(
        sandbox,
        &[
            "keys",
            "create",
            "--account",
            &id,
            "--description",
            "text",
            "--type",
            "ADMIN",
        ],
    )
    .await;
    assert!(
        field(&shown, "apiKey").is_some_and(|k| k.starts_with("RIALTO_ADMIN_KEY_")),
        "{shown}"
    );
    let revoked = json_of(
        sandbox,
        &["keys", "revoke", "--account", &id, "--key", &key_id],
    )
    .await;
    assert_eq!(revoked, json!({"success": true}));
    assert_eq!(chat(sandbox, &secret).await, 401);
    let again = failure(
        &admin(
            sandbox,
            &["keys", "revoke", "--account", &id, "--key", &key_id],
        )
        .await,
    );
    assert!(
        again.contains("rialto: the operator API answered"),
        "{again}"
    );

    // suspend: the account's keys are refused; resume: served again.
    let suspended = json_of(sandbox, &["accounts", "suspend", "--id", &id]).await;
    assert_eq!(suspended["suspended"], true);
    assert_eq!(chat(sandbox, &admin_key).await, 401);
    let resumed = text(sandbox, &["accounts", "resume", &id]).await;
    assert_eq!(field(&resumed, "suspended"), Some("false"), "{resumed}");
    assert_eq!(chat(sandbox, &admin_key).await, 200);

    // usage and limit hits.
    let usage = json_of(
        sandbox,
        &["accounts", "usage", "--id", &id, "--lookback", "1d"],
    )
    .await;
    assert_eq!(usage["lookback"], "1d");
    assert_eq!(usage["byModel"][0]["modelName"], "Mock Chat", "{usage}");
    let today = chrono::Utc::now().date_naive().to_string();
    let ranged = json_of(
        sandbox,
        &[
            "accounts",
            "usage",
            "--id",
            &id,
            "--start-date",
            &today,
            "--end-date",
            &today,
        ],
    )
    .await;
    assert_eq!(ranged["byModel"][0]["modelName"], "Mock Chat", "{ranged}");
    let shown = text(sandbox, &["accounts", "usage", "--id", &id]).await;
    assert!(shown.starts_with("lookback: 7d"), "{shown}");
    assert!(
        shown
            .lines()
            .any(|l| l.starts_with("Mock Chat") && l.ends_with("tokens")),
        "{shown}"
    );
    let hits = json_of(sandbox, &["accounts", "limit-hits", "--id", &id]).await;
    assert_eq!(hits["object"], "list");
    assert!(hits["data"].is_array());
    assert_eq!(
        text(sandbox, &["accounts", "limit-hits", &id]).await,
        "no rate-limit hits\n"
    );

    // backends: the configured ones and their circuits.
    let backends = json_of(sandbox, &["backends"]).await;
    let models: Vec<&str> = backends["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["model"].as_str().unwrap())
        .collect();
    for model in ["mock-chat", "dead-chat", "old-chat"] {
        assert!(models.contains(&model), "{model} missing: {backends}");
    }
    let table = text(sandbox, &["backends"]).await;
    assert!(table.starts_with("MODEL"), "{table}");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("mock-chat") && l.contains("closed")),
        "{table}"
    );

    // characters: stored from a file, usable at once, deleted.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("character.json");
    std::fs::write(
        &file,
        json!({"name": "The Sage", "system_prompt": "You are a sage.", "tags": ["wisdom"]})
            .to_string(),
    )
    .unwrap();
    let file = file.to_str().unwrap();
    let stored = json_of(
        sandbox,
        &["characters", "put", "--slug", "cli-sage", "--file", file],
    )
    .await;
    assert_eq!(stored["data"]["slug"], "cli-sage");
    let character = |slug: &'static str| {
        let request = sandbox
            .http()
            .get(sandbox.api(&format!("/characters/{slug}")))
            .bearer_auth(&admin_key);
        async move { request.send().await.unwrap().status() }
    };
    assert_eq!(character("cli-sage").await, 200);
    let shown = text(
        sandbox,
        &["characters", "put", "--slug", "cli-sage", "--file", file],
    )
    .await;
    assert_eq!(field(&shown, "name"), Some("The Sage"), "{shown}");
    let deleted = json_of(sandbox, &["characters", "delete", "--slug", "cli-sage"]).await;
    assert_eq!(deleted, json!({"success": true}));
    assert_eq!(character("cli-sage").await, 404);
    let again = failure(&admin(sandbox, &["characters", "delete", "--slug", "cli-sage"]).await);
    assert!(again.contains("404"), "{again}");
    std::fs::write(dir.path().join("bad.json"), "{not json").unwrap();
    let bad = dir.path().join("bad.json");
    let bad = failure(
        &admin(
            sandbox,
            &[
                "characters",
                "put",
                "--slug",
                "x",
                "--file",
                bad.to_str().unwrap(),
            ],
        )
        .await,
    );
    assert!(bad.contains("is not JSON"), "{bad}");
}

/// The API's refusals reach the operator as its message and details, exit
/// code 1; a command clap cannot parse is exit code 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_print_the_apis_message() {
    let world = world(Topology::OneProcess, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("wrong-token");
    std::fs::write(&wrong, "not-the-token\n").unwrap();
    let refused = failure(
        &admin(
            sandbox,
            &["--token-file", wrong.to_str().unwrap(), "accounts", "list"],
        )
        .await,
    );
    assert!(refused.contains("answered 401"), "{refused}");
    assert!(refused.contains("Authentication failed"), "{refused}");
    assert!(
        refused.contains("--token-file"),
        "names where the token came from: {refused}"
    );

    let unknown = failure(&admin(sandbox, &["accounts", "get", "nobody"]).await);
    assert!(unknown.contains("answered 404"), "{unknown}");

    let account = sandbox.create_account("refusals").await.unwrap();
    let tier = failure(
        &admin(
            sandbox,
            &["accounts", "tier", "--id", &account.id, "--tier", "gold"],
        )
        .await,
    );
    assert!(tier.contains("Invalid request parameters"), "{tier}");
    assert!(
        tier.contains("\n  tier: Unknown tier; expected one of: "),
        "{tier}"
    );
    let limit = failure(&admin(sandbox, &["accounts", "list", "--limit", "0"]).await);
    assert!(
        limit.contains("limit: Expected an integer from 1 to 500"),
        "{limit}"
    );

    // Usage errors are clap's: exit code 2, nothing sent.
    for args in [
        &["accounts", "credit", "--id", "x", "--usd", "1"][..],
        &["accounts", "get"],
        &["accounts", "get", "a", "--id", "b"],
        &[
            "keys",
            "create",
            "--account",
            "x",
            "--description",
            "d",
            "--type",
            "ROOT",
        ],
        &[
            "keys",
            "create",
            "--account",
            "x",
            "--description",
            "d",
            "--limit-usd",
            "lots",
        ],
        &["--output", "yaml", "backends"],
    ] {
        let output = admin(sandbox, args).await;
        assert_eq!(output.status.code(), Some(2), "{args:?}");
    }
}

/// A configuration with no operator token: only the database, in `dir`.
fn tokenless_config(dir: &Path, extra: &str) -> PathBuf {
    let path = dir.join("admin.toml");
    std::fs::write(
        &path,
        format!(
            "[database]\nurl = \"sqlite://{}/admin.db\"\n{extra}",
            dir.display()
        ),
    )
    .unwrap();
    path
}

/// The token from `RIALTO_OPERATOR_TOKEN` or `operator.token_file`; with
/// none anywhere, an error naming every way to give one; with no server,
/// one saying where it looked and how to point elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_and_the_gateway_are_found_or_named() {
    let world = world(Topology::OneProcess, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let dir = tempfile::tempdir().unwrap();
    let config = tokenless_config(dir.path(), "");
    let url = sandbox.url.as_str();

    let missing = failure(&rialto_admin(&config, &["--url", url, "backends"]).await);
    for way in [
        "no operator token",
        "--token-file",
        "RIALTO_OPERATOR_TOKEN",
        "operator.token",
        "operator.token_file",
        "rialto serve",
    ] {
        assert!(missing.contains(way), "{way} not named: {missing}");
    }

    let mut command = Command::new(rialto_test_kit::sandbox::rialto_binary().unwrap());
    command
        .arg("--config")
        .arg(&config)
        .args(["admin", "backends", "--output", "json"])
        .env("RIALTO_ADMIN_URL", url)
        .env("RIALTO_OPERATOR_TOKEN", &sandbox.operator_token);
    let output = tokio::process::Command::from(command)
        .output()
        .await
        .unwrap();
    let backends: Value = serde_json::from_str(&success(&output)).unwrap();
    assert_eq!(backends["object"], "list");

    let token_file = dir.path().join("operator-token-secret");
    std::fs::write(&token_file, format!("{}\n", sandbox.operator_token)).unwrap();
    let configured = tokenless_config(
        dir.path(),
        &format!("[operator]\ntoken_file = \"{}\"\n", token_file.display()),
    );
    let listed = success(&rialto_admin(&configured, &["--url", url, "accounts", "list"]).await);
    assert!(listed.ends_with("account(s), from offset 0\n"), "{listed}");

    // Nothing listens on a port just released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nowhere = format!("http://127.0.0.1:{port}");
    let unreachable = failure(
        &rialto_admin(
            sandbox.config_path(),
            &["--url", &nowhere, "accounts", "list"],
        )
        .await,
    );
    assert!(
        unreachable.contains(&format!("the gateway at {nowhere}/ is not reachable")),
        "{unreachable}"
    );
    assert!(unreachable.contains("--url"), "{unreachable}");
}

/// A `rialto serve` of the test's own, stopped when dropped.
pub struct Server {
    child: Child,
    pub url: String,
}

impl Server {
    /// Starts `rialto --config <config> serve` in `dir` and waits until its
    /// gateway answers `/healthz`; its output goes to `dir/serve.log`.
    pub async fn start(config: &Path, dir: &Path) -> Self {
        let log = std::fs::File::create(dir.join("serve.log")).unwrap();
        let mut command = Command::new(rialto_test_kit::sandbox::rialto_binary().unwrap());
        command
            .arg("--config")
            .arg(config)
            .arg("serve")
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        for variable in ADMIN_VARIABLES {
            command.env_remove(variable);
        }
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (sender, announced) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(url) = line.strip_prefix("rialto: gateway listening on ") {
                    let _ = sender.send(url.to_owned());
                }
            }
        });
        let mut server = Self {
            child,
            url: String::new(),
        };
        server.url = announced
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| {
                panic!(
                    "rialto serve did not start: {}",
                    std::fs::read_to_string(dir.join("serve.log")).unwrap_or_default()
                )
            });
        let http = rialto_test_kit::sandbox::http_client().unwrap();
        for _ in 0..100 {
            let health = http.get(format!("{}/healthz", server.url)).send().await;
            if health.is_ok_and(|r| r.status().is_success()) {
                return server;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("rialto serve at {} never became healthy", server.url);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The make-run hint: on the embedded default (SQLite, no token
/// configured) `rialto admin accounts create --name me` needs neither
/// `--url` nor a token: the gateway's listen address and the token `rialto
/// serve` wrote beside its database are found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_default_needs_no_url_and_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = tokenless_config(
        dir.path(),
        &format!(
            "[gateway]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n\
             [grpc]\nlisten = \"127.0.0.1:0\"\n\
             [[models]]\nid = \"dead-chat\"\nname = \"Dead Chat\"\n\
             backends = [{{ kind = \"openai\", url = \"http://127.0.0.1:9/v1\" }}]\n"
        ),
    );
    let server = Server::start(&config, dir.path()).await;
    assert!(
        dir.path().join("operator-token").exists(),
        "rialto serve wrote no operator token beside its database"
    );
    let created = success(&rialto_admin(&config, &["accounts", "create", "--name", "me"]).await);
    let key = field(&created, "api_key.key").unwrap_or_else(|| panic!("no key in {created}"));
    assert!(key.starts_with("RIALTO_ADMIN_KEY_"), "{created}");
    let keys = rialto_test_kit::sandbox::http_client()
        .unwrap()
        .get(format!("{}/api/v1/api_keys", server.url))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    assert_eq!(keys.status(), 200);
}
