//! Character discovery in both topologies: the hosted list's filters and
//! sorts, and reviews (written by accounts, paged newest first, counted in
//! each character's `stats`).

use futures_util::future::join_all;
use reqwest::Method;
use rialto_test_kit::{MockUpstream, Sandbox, Topology};
use serde_json::{Value, json};

async fn world(topology: Topology) -> (MockUpstream, Sandbox) {
    let mock = MockUpstream::start().await.unwrap();
    let config = format!(
        r#"
[[models]]
id = "paid-chat"
input_usd_per_mtok = 1.0
backends = [{{ kind = "openai", url = "{url}", model = "mock-model" }}]

[[models]]
id = "free-chat"
backends = [{{ kind = "openai", url = "{url}", model = "mock-model" }}]

[[characters]]
slug = "philosopher"
name = "The Philosopher"
description = "Answers with questions."
system_prompt = "You are a philosopher."
model_id = "paid-chat"
tags = ["Philosophy", "Calm"]
categories = ["thinking"]
created_at = "2025-01-01T00:00:00.000Z"

[[characters]]
slug = "coder"
name = "Coder"
description = "Writes Rust."
system_prompt = "You write Rust."
model_id = "free-chat"
tags = ["code"]
categories = ["work", "thinking"]
featured = true
web_enabled = true
created_at = "2025-03-01T00:00:00.000Z"

[[characters]]
slug = "bard"
name = "Bard"
description = "Sings."
system_prompt = "You sing."
model_id = "free-chat"
tags = ["music"]
categories = ["fun"]
adult = true
created_at = "2025-02-01T00:00:00.000Z"
"#,
        url = mock.base_url()
    );
    let sandbox = Sandbox::builder(topology)
        .config(&config)
        .start()
        .await
        .unwrap();
    (mock, sandbox)
}

async fn get(sandbox: &Sandbox, key: &str, path: &str) -> reqwest::Response {
    sandbox.call(Method::GET, path, key, None).await.unwrap()
}

async fn slugs(sandbox: &Sandbox, key: &str, query: &str) -> Vec<String> {
    let response = get(sandbox, key, &format!("/characters?{query}")).await;
    assert_eq!(response.status(), 200, "{query}");
    let body: Value = response.json().await.unwrap();
    body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["slug"].as_str().unwrap().to_owned())
        .collect()
}

async fn review(sandbox: &Sandbox, key: &str, slug: &str, body: Value) -> reqwest::Response {
    sandbox
        .call(
            Method::POST,
            &format!("/characters/{slug}/reviews"),
            key,
            Some(&body),
        )
        .await
        .unwrap()
}

async fn discovery_and_reviews(topology: Topology) {
    let (_mock, sandbox) = world(topology).await;
    let mut keys = Vec::new();
    for name in ["ana", "ben", "cy"] {
        keys.push(sandbox.create_account(name).await.unwrap().admin_key);
    }
    let key = &keys[0];

    // Filters: each alone, then together.
    let cases: &[(&str, &[&str])] = &[
        ("", &["philosopher", "coder", "bard"]),
        ("isAdult=false", &["philosopher", "coder"]),
        ("isWebEnabled=true", &["coder"]),
        ("isPro=true", &["philosopher"]),
        ("isPro=false", &["coder", "bard"]),
        ("categories=thinking", &["philosopher", "coder"]),
        ("categories=fun,work", &["coder", "bard"]),
        ("categories[]=fun&categories[]=work", &["coder", "bard"]),
        ("tags=philosophy", &["philosopher"]),
        ("tags=code&tags=music", &["coder", "bard"]),
        ("modelId=free-chat", &["coder", "bard"]),
        ("modelId=paid-chat,none", &["philosopher"]),
        ("search=%23music", &["bard"]),
        ("search=calm", &["philosopher"]),
        ("search=rust", &["coder"]),
        ("categories=thinking&isPro=false", &["coder"]),
        ("sortBy=mostRecent", &["coder", "bard", "philosopher"]),
        (
            "sortBy=mostRecent&sortOrder=asc",
            &["philosopher", "bard", "coder"],
        ),
        ("sortBy=featured&limit=1", &["coder"]),
        ("sortBy=mostRecent&limit=1&offset=1", &["bard"]),
    ];
    for (query, expected) in cases {
        assert_eq!(slugs(&sandbox, key, query).await, *expected, "{query}");
    }
    for bad in [
        "sortBy=best",
        "sortOrder=up",
        "isPro=yes",
        "limit=0",
        "tags=a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p,q,r,s,t,u",
    ] {
        let response = get(&sandbox, key, &format!("/characters?{bad}")).await;
        assert_eq!(response.status(), 400, "{bad}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"], "Invalid request parameters", "{body}");
    }

    // Reviews: the philosopher gets 5 and 4 stars, the bard 5; ana changes
    // her mind about the philosopher (her review is replaced, not added).
    let first = review(&sandbox, &keys[0], "philosopher", json!({"rating": 2})).await;
    assert_eq!(first.status(), 200);
    let first: Value = first.json().await.unwrap();
    assert_eq!(first["data"]["username"], "ana");
    assert_eq!(first["data"]["isOwner"], true);
    // Racing with herself: still one review of hers.
    let racing = join_all((0..4).map(|_| {
        review(
            &sandbox,
            &keys[0],
            "philosopher",
            json!({"rating": 5, "message": "Deep.", "locale": "en"}),
        )
    }))
    .await;
    for response in racing {
        assert_eq!(response.status(), 200);
    }
    assert_eq!(
        review(&sandbox, &keys[1], "philosopher", json!({"rating": 4}))
            .await
            .status(),
        200
    );
    assert_eq!(
        review(&sandbox, &keys[2], "bard", json!({"rating": 5}))
            .await
            .status(),
        200
    );
    for (bad, slug) in [
        (json!({"rating": 6}), "philosopher"),
        (json!({"rating": 4.5}), "philosopher"),
        (json!({"message": "no stars"}), "philosopher"),
        (json!({"rating": 3, "stars": 3}), "philosopher"),
    ] {
        let response = review(&sandbox, &keys[1], slug, bad.clone()).await;
        assert_eq!(response.status(), 400, "{bad}");
    }
    assert_eq!(
        review(&sandbox, &keys[1], "nobody", json!({"rating": 3}))
            .await
            .status(),
        404
    );

    let response = get(
        &sandbox,
        &keys[1],
        "/characters/philosopher/reviews?pageSize=1",
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-pagination-total"], "2");
    assert_eq!(response.headers()["x-pagination-total-pages"], "2");
    let page: Value = response.json().await.unwrap();
    assert_eq!(page["object"], "list");
    assert_eq!(
        page["pagination"],
        json!({"page": 1, "pageSize": 1, "total": 2, "totalPages": 2})
    );
    assert_eq!(page["summary"]["averageRating"].as_f64(), Some(4.5));
    assert_eq!(page["summary"]["totalReviews"], 2);
    // Newest first: ben's; then ana's, with its message, not hers to ben.
    assert_eq!(page["data"][0]["username"], "ben");
    assert_eq!(page["data"][0]["isOwner"], true);
    let second: Value = get(
        &sandbox,
        &keys[1],
        "/characters/philosopher/reviews?page=2&pageSize=1",
    )
    .await
    .json()
    .await
    .unwrap();
    let theirs = &second["data"][0];
    assert_eq!(theirs["username"], "ana");
    assert_eq!(theirs["rating"], 5);
    assert_eq!(theirs["message"], "Deep.");
    assert_eq!(theirs["locale"], "en");
    assert_eq!(theirs["isOwner"], false);
    assert_eq!(theirs["characterId"], page["data"][0]["characterId"]);
    assert_eq!(theirs["id"], first["data"]["id"], "replaced, not added");
    for bad in ["page=0", "pageSize=101", "pageSize=x"] {
        let response = get(&sandbox, key, &format!("/characters/bard/reviews?{bad}")).await;
        assert_eq!(response.status(), 400, "{bad}");
    }
    assert_eq!(
        get(&sandbox, key, "/characters/nobody/reviews")
            .await
            .status(),
        404
    );

    // The list's stats and rating sorts follow the reviews.
    let listed: Value = get(&sandbox, &keys[0], "/characters?sortBy=ratingCount")
        .await
        .json()
        .await
        .unwrap();
    let philosopher = &listed["data"][0];
    assert_eq!(philosopher["slug"], "philosopher");
    assert_eq!(philosopher["stats"]["ratingCount"], 2);
    assert_eq!(philosopher["stats"]["ratingSum"], 9);
    assert_eq!(philosopher["stats"]["averageRating"].as_f64(), Some(4.5));
    assert_eq!(philosopher["stats"]["userRating"], 5, "ana's own");
    assert_eq!(listed["data"][1]["slug"], "bard");
    assert_eq!(listed["data"][1]["stats"]["userRating"], Value::Null);
    assert_eq!(
        slugs(&sandbox, key, "sortBy=highestRating").await,
        ["bard", "philosopher", "coder"]
    );
    // Two reviews averaging 4.5 outweigh one of 5.
    assert_eq!(
        slugs(&sandbox, key, "sortBy=highlyRated").await,
        ["philosopher", "bard", "coder"]
    );
    let one: Value = get(&sandbox, &keys[2], "/characters/bard")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(one["data"]["stats"]["userRating"], 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_and_reviews_one_process() {
    discovery_and_reviews(Topology::OneProcess).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_and_reviews_split() {
    discovery_and_reviews(Topology::Split).await;
}
