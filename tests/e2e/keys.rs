//! Accounts and API keys: the operator API, the CLI, the key routes, and a
//! deleted key refused on the very next request.

use rialto_test_kit::{Storage, Topology};
use serde_json::{Value, json};

use crate::both_topologies;
use crate::support::{World, assert_common_headers, world};

both_topologies!(
    key_lifecycle,
    key_routes_need_an_admin_key,
    operator_api_is_guarded,
    key_updates_and_model_privacy,
    operator_lists_and_suspends_accounts
);

async fn chat(world: &World, key: &str) -> reqwest::Response {
    chat_with(world, key, "mock-chat").await
}

async fn key_lifecycle(world: &World) {
    let sandbox = &world.sandbox;
    let account = sandbox.create_account("acme").await.unwrap();
    assert!(account.admin_key.starts_with("RIALTO_ADMIN_KEY_"));

    // Create an INFERENCE key: the secret is shown once.
    let response = sandbox
        .call(
            reqwest::Method::POST,
            "/api_keys",
            &account.admin_key,
            Some(
                &json!({"apiKeyType": "INFERENCE", "description": "ci", "expiresAt": "2099-01-01"}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_common_headers(&response);
    let created: Value = response.json().await.unwrap();
    assert_eq!(created["success"], true);
    let id = created["data"]["id"].as_str().unwrap().to_owned();
    let secret = created["data"]["apiKey"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("RIALTO_INFERENCE_KEY_"));
    assert_eq!(created["data"]["apiKeyType"], "INFERENCE");
    assert!(
        created["data"]["expiresAt"]
            .as_str()
            .unwrap()
            .starts_with("2099-01-01T23:59:59")
    );

    assert_eq!(chat(world, &secret).await.status(), 200);

    // List and get show the record, never the secret. Like every
    // authenticated answer, the list carries the balances and the client's
    // request time.
    let listed = sandbox
        .http()
        .get(sandbox.api("/api_keys"))
        .bearer_auth(&account.admin_key)
        .header("x-rialto-request-timestamp-ms", "1764000000123")
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status(), 200);
    assert!(listed.headers().contains_key("x-rialto-balance-usd"));
    assert!(listed.headers().contains_key("x-rialto-balance-diem"));
    assert_eq!(
        listed.headers()["x-rialto-request-timestamp-ms"],
        "1764000000123"
    );
    let list: Value = listed.json().await.unwrap();
    assert_eq!(list["object"], "list");
    assert_eq!(list["data"].as_array().unwrap().len(), 2);
    assert!(!list.to_string().contains(&secret[21..]));
    let record: Value = sandbox
        .call(
            reqwest::Method::GET,
            &format!("/api_keys/{id}"),
            &account.admin_key,
            None,
        )
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(record["data"]["id"], id.as_str());
    assert_eq!(record["data"]["last6Chars"], &secret[secret.len() - 6..]);
    for field in [
        "createdAt",
        "expiresAt",
        "lastUsedAt",
        "consumptionLimits",
        "limitPeriod",
        "modelPrivacy",
    ] {
        assert!(record["data"].get(field).is_some(), "record lacks {field}");
    }

    // Delete with ?id=, then the very next request is refused.
    let deleted = sandbox
        .call(
            reqwest::Method::DELETE,
            &format!("/api_keys?id={id}"),
            &account.admin_key,
            None,
        )
        .await
        .unwrap();
    assert_eq!(deleted.status(), 200);
    assert_eq!(
        deleted.json::<Value>().await.unwrap(),
        json!({"success": true})
    );
    let refused = chat(world, &secret).await;
    assert_eq!(refused.status(), 401);
    assert_common_headers(&refused);
    let body: Value = refused.json().await.unwrap();
    assert!(body["error"].is_string());

    // Deleting it again, by JSON body this time: the hosted API's 400.
    let again = sandbox
        .call(
            reqwest::Method::DELETE,
            "/api_keys",
            &account.admin_key,
            Some(&json!({"id": id})),
        )
        .await
        .unwrap();
    assert_eq!(again.status(), 400);
    assert_eq!(
        again.json::<Value>().await.unwrap(),
        json!({"error": "API key could not be found"})
    );

    // Without any id: a validation error with details.
    let missing = sandbox
        .call(
            reqwest::Method::DELETE,
            "/api_keys",
            &account.admin_key,
            None,
        )
        .await
        .unwrap();
    assert_eq!(missing.status(), 400);
    let body: Value = missing.json().await.unwrap();
    assert!(body["details"]["id"]["_errors"][0].is_string());

    // The admin key still works.
    assert_eq!(chat(world, &account.admin_key).await.status(), 200);
}

async fn chat_with(world: &World, key: &str, model: &str) -> reqwest::Response {
    world
        .sandbox
        .call(
            reqwest::Method::POST,
            "/chat/completions",
            key,
            Some(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})),
        )
        .await
        .unwrap()
}

async fn patch(world: &World, admin: &str, body: Value) -> reqwest::Response {
    world
        .sandbox
        .call(reqwest::Method::PATCH, "/api_keys", admin, Some(&body))
        .await
        .unwrap()
}

/// `PATCH /api_keys` changes a key's description, cap, expiry and model
/// privacy, seen by its very next request; `modelPrivacy` refuses
/// anonymized models (the hosted 403) and is set at creation too.
async fn key_updates_and_model_privacy(world: &World) {
    let sandbox = &world.sandbox;
    let account = sandbox.create_account("patcher").await.unwrap();
    let admin = account.admin_key.as_str();
    let (id, secret) = sandbox.create_key(admin, "INFERENCE").await.unwrap();
    for model in ["mock-chat", "old-chat"] {
        assert_eq!(chat_with(world, &secret, model).await.status(), 200);
    }
    let response = patch(
        world,
        admin,
        json!({"id": id, "description": "after", "modelPrivacy": "PRIVATE_ONLY",
            "consumptionLimit": {"usd": 5}, "limitPeriod": "MONTH"}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let updated: Value = response.json().await.unwrap();
    assert_eq!(updated["success"], true);
    let data = &updated["data"];
    assert_eq!(data["description"], "after");
    assert_eq!(data["modelPrivacy"], "PRIVATE_ONLY");
    assert_eq!(data["consumptionLimits"]["usd"], 5);
    assert_eq!(data["limitPeriod"], "MONTH");
    // At once: the anonymized model is refused, the private one served.
    let refused = chat_with(world, &secret, "old-chat").await;
    assert_eq!(refused.status(), 403);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(
        body["error"],
        "This API key is set to 'PRIVATE_ONLY', but `old-chat` is an Anonymous model. Choose a \
         Private, TEE, or E2EE model, or change the model privacy setting of this API key."
    );
    assert_eq!(chat_with(world, &secret, "mock-chat").await.status(), 200);
    let read: Value = sandbox
        .call(
            reqwest::Method::GET,
            &format!("/api_keys/{id}"),
            admin,
            None,
        )
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(read["data"]["modelPrivacy"], "PRIVATE_ONLY");
    assert_eq!(read["data"]["description"], "after");
    // A PATCH changes only what it names: the cap stays.
    let response = patch(world, admin, json!({"id": id, "modelPrivacy": "ALL"})).await;
    let data = response.json::<Value>().await.unwrap()["data"].clone();
    assert_eq!(
        (data["modelPrivacy"].as_str(), data["limitPeriod"].as_str()),
        (Some("ALL"), Some("MONTH"))
    );
    assert_eq!(chat_with(world, &secret, "old-chat").await.status(), 200);
    // Expired now: its next request is refused; it cannot be patched back.
    let response = patch(world, admin, json!({"id": id, "expiresAt": "2020-01-01"})).await;
    assert_eq!(response.status(), 200);
    assert_eq!(chat_with(world, &secret, "mock-chat").await.status(), 401);
    let again = patch(world, admin, json!({"id": id, "expiresAt": ""})).await;
    assert_eq!(again.status(), 400);
    let body: Value = again.json().await.unwrap();
    assert_eq!(body["error"], "API key not found or expired");
    // Refusals.
    for (body, status) in [
        (json!({"id": "no-such-key", "description": "x"}), 400),
        (json!({"description": "no id"}), 400),
        (json!({"id": id, "apiKeyType": "ADMIN"}), 400),
        (json!({"id": id, "modelPrivacy": "SOME"}), 400),
        (json!({"id": id, "colour": "red"}), 400),
    ] {
        assert_eq!(
            patch(world, admin, body.clone()).await.status(),
            status,
            "{body}"
        );
    }
    assert_eq!(
        patch(world, &secret, json!({"id": id, "description": "x"}))
            .await
            .status(),
        401
    );
    // Created with a privacy: PRIVATE_TEXT restricts text models.
    let created: Value = sandbox
        .call(
            reqwest::Method::POST,
            "/api_keys",
            admin,
            Some(
                &json!({"apiKeyType": "INFERENCE", "description": "text only",
                "modelPrivacy": "PRIVATE_TEXT", "expiresAt": "2099-01-01"}),
            ),
        )
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(created["data"]["modelPrivacy"], "PRIVATE_TEXT");
    let text_only = created["data"]["apiKey"].as_str().unwrap();
    assert_eq!(chat_with(world, text_only, "old-chat").await.status(), 403);
    // Its list shows what it may use; without a key the list is whole.
    let listed = |key: Option<&str>| {
        let mut request = sandbox.http().get(sandbox.api("/models"));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        async move {
            let body: Value = request.send().await.unwrap().json().await.unwrap();
            body["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["id"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    assert!(
        !listed(Some(text_only))
            .await
            .contains(&"old-chat".to_owned())
    );
    assert!(listed(None).await.contains(&"old-chat".to_owned()));
    assert!(
        listed(Some("RIALTO_INFERENCE_KEY_nope"))
            .await
            .contains(&"old-chat".to_owned())
    );
    // `expiresAt: ""` removes an expiry.
    let cleared = patch(
        world,
        admin,
        json!({"id": created["data"]["id"], "expiresAt": ""}),
    )
    .await
    .json::<Value>()
    .await
    .unwrap();
    assert_eq!(cleared["data"]["expiresAt"], Value::Null);
    assert_eq!(cleared["data"]["modelPrivacy"], "PRIVATE_TEXT");
}

async fn key_routes_need_an_admin_key(world: &World) {
    let sandbox = &world.sandbox;
    let account = sandbox.create_account("acme").await.unwrap();
    let (_, inference) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    let response = sandbox
        .call(reqwest::Method::GET, "/api_keys", &inference, None)
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(
        response.json::<Value>().await.unwrap(),
        json!({"error": "Admin API key required"})
    );
    // Another account's key ids are invisible.
    let other = sandbox.create_account("other").await.unwrap();
    let (other_id, _) = sandbox
        .create_key(&other.admin_key, "INFERENCE")
        .await
        .unwrap();
    let response = sandbox
        .call(
            reqwest::Method::DELETE,
            &format!("/api_keys?id={other_id}"),
            &account.admin_key,
            None,
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    // Unknown create fields are refused like the hosted API does.
    let response = sandbox
        .call(
            reqwest::Method::POST,
            "/api_keys",
            &account.admin_key,
            Some(&json!({"apiKeyType": "INFERENCE", "description": "x", "color": "red"})),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert!(
        body["details"]["_errors"][0]
            .as_str()
            .unwrap()
            .contains("color")
    );
}

async fn operator_api_is_guarded(world: &World) {
    let sandbox = &world.sandbox;
    let url = format!("{}/admin/v1/accounts", sandbox.url);
    let wrong = sandbox
        .http()
        .post(&url)
        .bearer_auth("not-the-token")
        .json(&json!({"name": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let no_name = sandbox
        .http()
        .post(&url)
        .bearer_auth(&sandbox.operator_token)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(no_name.status(), 400);
    let body: Value = no_name.json().await.unwrap();
    assert_eq!(body["details"]["name"]["_errors"][0], "Required");
}

/// `rialto admin` goes through the server's operator API: what it does is
/// what the server then serves (the full command set is in `admin_cli`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_creates_accounts() {
    let world = world(Topology::OneProcess, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let admin = async |args: &[&str]| {
        let mut all = vec!["--url", sandbox.url.as_str(), "--output", "json"];
        all.extend_from_slice(args);
        crate::admin_cli::rialto_admin(sandbox.config_path(), &all).await
    };
    let output = admin(&["accounts", "create", "--name", "from-cli"]).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let created: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(created["api_key"]["type"], "ADMIN");
    let key = created["api_key"]["key"].as_str().unwrap();
    // No credit yet: the chat is refused for payment.
    assert_eq!(chat(&world, key).await.status(), 402);
    let id = created["id"].as_str().unwrap();
    let credit = [
        "accounts",
        "credit",
        "--id",
        id,
        "--usd",
        "5.00",
        "--reference",
        "cli-1",
    ];
    let first: Value = serde_json::from_slice(&admin(&credit).await.stdout).unwrap();
    assert_eq!(first["applied"], true);
    assert_eq!(first["balance"]["usd"], "5");
    let again: Value = serde_json::from_slice(&admin(&credit).await.stdout).unwrap();
    assert_eq!(again["applied"], false, "the same reference credits once");
    assert_eq!(again["balance"]["usd"], "5");
    assert_eq!(chat(&world, key).await.status(), 200);
    let tiered = admin(&["accounts", "tier", "--id", id, "--tier", "partner"]).await;
    let tiered: Value = serde_json::from_slice(&tiered.stdout).unwrap();
    assert_eq!(tiered["tier"], "partner");
    let unknown = admin(&["accounts", "tier", "--id", id, "--tier", "gold"]).await;
    assert_eq!(unknown.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("Unknown tier"));
}

/// The same lifecycle on PostgreSQL, in both topologies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_one_process() {
    let world = world(Topology::OneProcess, Storage::Postgres).await;
    key_lifecycle(&world).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_split() {
    let world = world(Topology::Split, Storage::Postgres).await;
    key_lifecycle(&world).await;
}

/// In the split topology the services answer only callers with the shared
/// gRPC token: a stranger cannot mint keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_refuses_callers_without_the_token() {
    use rialto_proto::auth::v1::{CreateAccountRequest, auth_client::AuthClient};
    let world = world(Topology::Split, Storage::Sqlite).await;
    let addr = world.sandbox.grpc_addr("auth").unwrap();
    let mut stranger = AuthClient::connect(format!("http://{addr}")).await.unwrap();
    let status = stranger
        .create_account(CreateAccountRequest {
            name: "intruder".into(),
            tier: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);

    let token: tonic::metadata::MetadataValue<_> =
        format!("Bearer {}", rialto_test_kit::GRPC_TOKEN)
            .parse()
            .unwrap();
    let mut request = tonic::Request::new(CreateAccountRequest {
        name: "insider".into(),
        tier: String::new(),
    });
    request.metadata_mut().insert("authorization", token);
    assert!(stranger.create_account(request).await.is_ok());
}

/// Two gateways whose auth is remote, each caching principals for a second:
/// a key deleted through one is refused by the other within that second
/// (at once when the revocation event crosses the bus, as it does here),
/// and by the gateway that deleted it on the very next request.
/// How a key is changed through gateway A, and what the other then answers.
enum Change {
    Delete,
    Privacy,
}

/// Both gateways serve a key (so both have it cached), it is changed
/// through gateway A; A answers `refused` to its very next request, and B
/// within the second (the revocation event drops its cached entry).
async fn a_change_through_one_gateway_reaches_the_other(change: Change, refused: u16) {
    let world = world(Topology::Replicated, Storage::Sqlite).await;
    let sandbox = &world.sandbox;
    let [a, b] = [&sandbox.gateway_urls[0], &sandbox.gateway_urls[1]];
    let account = sandbox.create_account("acme").await.unwrap();
    let (id, secret) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    // An anonymized model: served as ALL, refused as PRIVATE_ONLY.
    let chat_at = |base: &str| {
        sandbox
            .http()
            .post(format!("{base}/api/v1/chat/completions"))
            .bearer_auth(&secret)
            .json(&json!({"model": "old-chat", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
    };
    for base in [a, b, a, b] {
        assert_eq!(chat_at(base).await.unwrap().status(), 200);
    }
    let changing = match change {
        Change::Delete => sandbox
            .http()
            .delete(format!("{a}/api/v1/api_keys?id={id}")),
        Change::Privacy => sandbox
            .http()
            .patch(format!("{a}/api/v1/api_keys"))
            .json(&json!({"id": id, "modelPrivacy": "PRIVATE_ONLY"})),
    };
    let changed = changing
        .bearer_auth(&account.admin_key)
        .send()
        .await
        .unwrap();
    assert_eq!(changed.status(), 200);
    let started = std::time::Instant::now();
    assert_eq!(chat_at(a).await.unwrap().status(), refused);
    loop {
        let status = chat_at(b).await.unwrap().status();
        if status == refused {
            break;
        }
        assert_eq!(status, 200);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(1),
            "gateway B still serves the key as it was after a second"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(chat_at(a).await.unwrap().status(), refused);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_updated_through_one_gateway_holds_on_the_other() {
    a_change_through_one_gateway_reaches_the_other(Change::Privacy, 403).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_deleted_through_one_gateway_is_refused_by_the_other() {
    a_change_through_one_gateway_reaches_the_other(Change::Delete, 401).await;
}

/// Migrations as their own step: a server that may not migrate
/// (`database.migrate_on_start = false`) refuses a database `rialto
/// migrate` has not brought up to date, and `rialto admin`, which never
/// opens the database, has no server to call; `migrate --check` says so,
/// `migrate` applies them once, and then the server starts and the CLI
/// works through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_are_their_own_step() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("rialto.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"sqlite://{}/fresh.db\"\nmigrate_on_start = false\n\
             [gateway]\nlisten = \"127.0.0.1:0\"\nworkers = 1\n[grpc]\nlisten = \"127.0.0.1:0\"\n\
             [operator]\ntoken = \"migrations-token\"\n\
             [[models]]\nid = \"dead-chat\"\nname = \"Dead Chat\"\n\
             backends = [{{ kind = \"openai\", url = \"http://127.0.0.1:9/v1\" }}]\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let rialto = |args: &[&str]| {
        std::process::Command::new(rialto_test_kit::sandbox::rialto_binary().unwrap())
            .arg("--config")
            .arg(&config)
            .args(args)
            .output()
            .unwrap()
    };
    let check = rialto(&["migrate", "--check"]);
    assert_eq!(check.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&check.stderr).contains("run `rialto migrate`"));
    // No server yet: the CLI says so and leaves the database alone.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nowhere = format!("http://127.0.0.1:{port}");
    let early = crate::admin_cli::rialto_admin(
        &config,
        &["--url", &nowhere, "accounts", "create", "--name", "early"],
    )
    .await;
    assert!(!early.status.success());
    assert!(String::from_utf8_lossy(&early.stderr).contains("is not reachable"));
    assert_eq!(
        rialto(&["migrate", "--check"]).status.code(),
        Some(1),
        "rialto admin migrated the database"
    );
    let serve = rialto(&["serve"]);
    assert!(!serve.status.success(), "a server on an old schema started");
    assert!(String::from_utf8_lossy(&serve.stderr).contains("run `rialto migrate`"));

    let migrated = rialto(&["migrate"]);
    assert!(migrated.status.success());
    let applied = String::from_utf8_lossy(&migrated.stdout).to_string();
    assert!(applied.contains("applied 20261122000001_"), "{applied}");
    let again = rialto(&["migrate"]);
    assert!(!String::from_utf8_lossy(&again.stdout).contains("applied"));
    assert_eq!(rialto(&["migrate", "--check"]).status.code(), Some(0));
    let server = crate::admin_cli::Server::start(&config, dir.path()).await;
    let admin = crate::admin_cli::rialto_admin(
        &config,
        &[
            "--url",
            &server.url,
            "accounts",
            "create",
            "--name",
            "later",
        ],
    )
    .await;
    assert!(
        admin.status.success(),
        "{}",
        String::from_utf8_lossy(&admin.stderr)
    );
}

/// `GET /admin/v1/accounts` (search, paging), `GET /admin/v1/accounts/{id}`
/// with its balance, and suspending an account: its keys are refused on the
/// next request, on every gateway, until it is resumed.
async fn operator_lists_and_suspends_accounts(world: &World) {
    let sandbox = &world.sandbox;
    let operator = |method: reqwest::Method, path: &str| {
        sandbox
            .http()
            .request(method, format!("{}/admin/v1{path}", sandbox.url))
            .bearer_auth(&sandbox.operator_token)
            .send()
    };
    let first = sandbox.create_account("Zebra Works").await.unwrap();
    let second = sandbox.create_account("zebra_two").await.unwrap();
    sandbox.create_account("other").await.unwrap();

    let listed = operator_get(sandbox, "/accounts?search=ZEBRA&limit=1").await;
    assert_eq!(listed["total"], 2, "{listed}");
    assert_eq!(listed["data"].as_array().unwrap().len(), 1);
    assert_eq!(listed["data"][0]["id"], second.id.as_str(), "newest first");
    let page = operator_get(sandbox, "/accounts?search=zebra&offset=1").await;
    assert_eq!(page["data"][0]["name"], "Zebra Works");
    // `_` is a character, not LIKE's wildcard.
    let literal = operator_get(sandbox, "/accounts?search=a_w").await;
    assert_eq!(literal["total"], 0, "{literal}");
    assert_eq!(
        operator(reqwest::Method::GET, "/accounts?limit=0")
            .await
            .unwrap()
            .status(),
        400
    );

    let one = operator_get(sandbox, &format!("/accounts/{}", first.id)).await;
    assert_eq!(one["name"], "Zebra Works");
    assert_eq!(one["suspended"], false);
    assert!(one["balance"]["usd"].is_string(), "{one}");
    assert_eq!(
        operator(reqwest::Method::GET, "/accounts/nobody")
            .await
            .unwrap()
            .status(),
        404
    );

    assert_eq!(chat(world, &first.admin_key).await.status(), 200);
    let suspended: Value = operator(
        reqwest::Method::POST,
        &format!("/accounts/{}/suspend", first.id),
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    assert_eq!(suspended["suspended"], true);
    assert!(suspended["suspendedAt"].is_string());
    assert_eq!(chat(world, &first.admin_key).await.status(), 401);
    let keys = sandbox
        .call(reqwest::Method::GET, "/api_keys", &first.admin_key, None)
        .await
        .unwrap();
    assert_eq!(keys.status(), 401);
    // Another account is not touched.
    assert_eq!(chat(world, &second.admin_key).await.status(), 200);
    let resumed: Value = operator(
        reqwest::Method::POST,
        &format!("/accounts/{}/resume", first.id),
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    assert_eq!(resumed["suspended"], false);
    assert_eq!(chat(world, &first.admin_key).await.status(), 200);
    assert_eq!(
        operator(reqwest::Method::POST, "/accounts/nobody/suspend")
            .await
            .unwrap()
            .status(),
        404
    );

    // The operator makes, lists and revokes an account's keys.
    let made = sandbox
        .http()
        .post(format!(
            "{}/admin/v1/accounts/{}/keys",
            sandbox.url, first.id
        ))
        .bearer_auth(&sandbox.operator_token)
        .json(&json!({"apiKeyType": "INFERENCE", "description": "from the operator"}))
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), 200);
    let made: Value = made.json().await.unwrap();
    let secret = made["data"]["apiKey"].as_str().unwrap().to_owned();
    assert_eq!(chat(world, &secret).await.status(), 200);
    let keys = operator_get(sandbox, &format!("/accounts/{}/keys", first.id)).await;
    let descriptions: Vec<&str> = keys["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["description"].as_str().unwrap())
        .collect();
    assert!(descriptions.contains(&"from the operator"), "{keys}");
    assert!(
        !keys.to_string().contains(&secret[21..]),
        "no secrets listed"
    );
    let revoked = operator(
        reqwest::Method::DELETE,
        &format!(
            "/accounts/{}/keys/{}",
            first.id,
            made["data"]["id"].as_str().unwrap()
        ),
    )
    .await
    .unwrap();
    assert_eq!(revoked.status(), 200);
    assert_eq!(chat(world, &secret).await.status(), 401);
    let hits = operator_get(sandbox, &format!("/accounts/{}/limit-hits", first.id)).await;
    assert_eq!(hits["object"], "list");
    assert_eq!(
        operator(reqwest::Method::GET, "/accounts/nobody/keys")
            .await
            .unwrap()
            .status(),
        404
    );

    // The account's spend, as its own /billing/usage-analytics reads it.
    let usage = operator_get(
        sandbox,
        &format!("/accounts/{}/usage?lookback=1d", first.id),
    )
    .await;
    assert_eq!(usage["lookback"], "1d");
    assert_eq!(usage["byModel"][0]["modelName"], "Mock Chat", "{usage}");
    assert!(usage["byDate"][0]["USD"].as_f64().unwrap() > 0.0, "{usage}");

    // The backends' snapshot, from the router (over gRPC when split).
    let backends = operator_get(sandbox, "/backends").await;
    let of = |model: &str| {
        backends["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["model"] == model)
            .cloned()
            .unwrap_or_else(|| panic!("{model} missing: {backends}"))
    };
    assert_eq!(of("mock-chat")["state"], "closed");
    assert_eq!(of("mock-chat")["inFlight"], 0);
    assert!(of("dead-chat")["state"].is_string());
}

/// An operator API `GET` (`/admin/v1<path>`), answered 200 with JSON.
async fn operator_get(sandbox: &rialto_test_kit::Sandbox, path: &str) -> Value {
    let response = sandbox
        .http()
        .get(format!("{}/admin/v1{path}", sandbox.url))
        .bearer_auth(&sandbox.operator_token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{path}");
    response.json().await.unwrap()
}
