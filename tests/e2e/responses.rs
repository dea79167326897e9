//! `POST /responses` beyond what the SDK check sees: what reaches the
//! backend for a continued conversation, stored responses that belong to
//! their account only, `store: false`, the raw event stream, and a
//! response's cost being exactly what the balance lost.

use reqwest::Method;
use serde_json::{Value, json};

use crate::both_topologies;
use crate::support::World;

both_topologies!(responses_translate_and_belong_to_their_account);

async fn create(world: &World, key: &str, body: Value) -> reqwest::Response {
    world
        .sandbox
        .call(Method::POST, "/responses", key, Some(&body))
        .await
        .unwrap()
}

async fn usd(world: &World, admin: &str) -> rust_decimal::Decimal {
    let balance: Value = world
        .sandbox
        .call(Method::GET, "/billing/balance", admin, None)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    balance["balances"]["usd"].to_string().parse().unwrap()
}

async fn responses_translate_and_belong_to_their_account(world: &World) {
    let ours = world.sandbox.create_account("ours").await.unwrap();
    let theirs = world.sandbox.create_account("theirs").await.unwrap();
    let before = usd(world, &ours.admin_key).await;

    let first = create(
        world,
        &ours.admin_key,
        json!({"model": "mock-chat", "instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "one"}]}]}),
    )
    .await;
    assert_eq!(first.status(), 200);
    crate::support::assert_common_headers(&first);
    let first: Value = first.json().await.unwrap();
    assert_eq!(first["object"], "response");
    assert_eq!(first["instructions"], "Be brief.");
    let cost: rust_decimal::Decimal = first["cost"]["usd"].to_string().parse().unwrap();
    assert!(cost > rust_decimal::Decimal::ZERO);
    assert_eq!(
        usd(world, &ours.admin_key).await,
        before - cost,
        "charged its cost"
    );

    // Continued: the backend gets the first turn's input and answer (not its
    // instructions), then the new instructions and input.
    let second = create(
        world,
        &ours.admin_key,
        json!({"model": "mock-chat", "input": "two", "instructions": "Be kind.",
            "previous_response_id": first["id"]}),
    )
    .await;
    assert_eq!(second.status(), 200);
    let sent = world.mock.requests().last().unwrap().clone();
    let roles: Vec<(&str, &str)> = sent["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap(),
                m["content"].as_str().unwrap_or("(parts)"),
            )
        })
        .collect();
    assert_eq!(
        roles,
        [
            ("system", "Be kind."),
            ("user", "(parts)"),
            ("assistant", "Hello from mock: one"),
            ("user", "two"),
        ]
    );

    // Another account cannot continue it; nor can anyone continue a
    // response made with `store: false`.
    let stolen = create(
        world,
        &theirs.admin_key,
        json!({"model": "mock-chat", "input": "x", "previous_response_id": first["id"]}),
    )
    .await;
    assert_eq!(stolen.status(), 400);
    let body: Value = stolen.json().await.unwrap();
    assert!(
        body["details"]["previous_response_id"]["_errors"][0]
            .as_str()
            .unwrap()
            .contains("not found"),
        "{body}"
    );
    let unstored: Value = create(
        world,
        &ours.admin_key,
        json!({"model": "mock-chat", "input": "x", "store": false}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(unstored["store"], false);
    let continued = create(
        world,
        &ours.admin_key,
        json!({"model": "mock-chat", "input": "x", "previous_response_id": unstored["id"]}),
    )
    .await;
    assert_eq!(continued.status(), 400);

    // Refused before anything is charged.
    for bad in [
        json!({"input": "no model"}),
        json!({"model": "mock-chat"}),
        json!({"model": "mock-chat", "input": [{"type": "item_reference", "id": "x"}]}),
        json!({"model": "mock-chat", "input": "x", "tools": [{"type": "file_search"}]}),
        json!({"model": "mock-chat", "input": "x", "background": true}),
        json!({"model": "mock-chat", "input": 7}),
    ] {
        let response = create(world, &ours.admin_key, bad.clone()).await;
        assert_eq!(response.status(), 400, "{bad}");
    }
    assert_eq!(
        create(
            world,
            &ours.admin_key,
            json!({"model": "nope", "input": "x"})
        )
        .await
        .status(),
        404
    );

    // The raw stream: the Responses event types in order, each named twice
    // (the SSE `event:` line and the JSON `type`).
    let streamed = create(
        world,
        &ours.admin_key,
        json!({"model": "mock-chat", "input": "stream", "stream": true}),
    )
    .await;
    assert_eq!(streamed.status(), 200);
    assert!(
        streamed.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = streamed.text().await.unwrap();
    let mut kinds = Vec::new();
    for frame in text.split("\n\n").filter(|f| !f.is_empty()) {
        let (event, data) = frame.split_once('\n').unwrap();
        let kind = event.strip_prefix("event: ").unwrap();
        let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(data["type"], kind);
        assert_eq!(data["sequence_number"], kinds.len());
        kinds.push(kind.to_owned());
    }
    assert_eq!(
        kinds[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
    );
    assert!(kinds.contains(&"response.output_text.delta".to_owned()));
    assert_eq!(
        kinds[kinds.len() - 4..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
}
