//! The cluster test: the local cluster of `make cluster` (two gateways, two
//! limiter replicas, two billing replicas, auth and router, each its own
//! process, on PostgreSQL and NATS), driven over HTTP through both gateways
//! with the models of `cluster.toml` on a mock upstream this test starts:
//! the foundation's scenarios, the limiter's and billing's races, then
//! limiter-1, billing-0 and gateway-1 killed under load and started again
//! (`kills.rs` says what is checked).
//!
//! It needs the running cluster, so it runs only with `RIALTO_CLUSTER=1`:
//! `make test-cluster` starts the cluster with `tests/cluster/cluster.toml`,
//! runs it and stops the cluster, whatever the outcome. By hand:
//!
//! ```sh
//! CLUSTER_EXTRA_TOML=tests/cluster/cluster.toml make cluster
//! RIALTO_CLUSTER=1 cargo test --workspace --test cluster -- --nocapture
//! make cluster-down
//! ```
//!
//! The cluster's addresses come from `$CLUSTER_DIR/cluster.env`, which
//! `deploy/cluster.sh up` writes; `deploy/cluster.sh` (with the same
//! `CLUSTER_*` environment) kills and starts its processes. Without
//! `RIALTO_CLUSTER=1` the test passes at once, so a plain `cargo test` needs
//! no cluster.

// Scenario helpers are test code: a failed unwrap is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use reqwest::Method;
use rialto_test_kit::MockUpstream;
use serde_json::json;

mod client;
mod kills;
mod scenarios;
// The end-to-end tests' shared assertions (the spec's headers).
#[allow(dead_code)]
#[path = "../e2e/support.rs"]
mod support;

/// Where the mock upstream listens: `cluster.toml`'s backends point here.
pub const MOCK_ADDR: &str = "127.0.0.1:28990";
/// `cluster.toml`'s models: one with limits far above the load, one with
/// `LIMITED_RPM` requests per `WINDOW`.
pub const CHAT_MODEL: &str = "cluster-chat";
pub const LIMITED_MODEL: &str = "limited-chat";
pub const LIMITED_RPM: usize = 10;
pub const WINDOW: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster() {
    if std::env::var("RIALTO_CLUSTER").as_deref() != Ok("1") {
        println!("skipped: set RIALTO_CLUSTER=1 with a running cluster (make test-cluster)");
        return;
    }
    let started = Instant::now();
    let cluster = client::Cluster::from_env();
    let config = std::fs::read_to_string(&cluster.config).unwrap();
    assert!(
        config.contains(&format!("http://{MOCK_ADDR}/v1")),
        "{} does not route to the mock upstream on {MOCK_ADDR}: start the cluster with \
         CLUSTER_EXTRA_TOML=tests/cluster/cluster.toml",
        cluster.config.display()
    );
    let mock = MockUpstream::start_with_workers(MOCK_ADDR.parse().unwrap(), 2)
        .await
        .unwrap();
    let ready_in = warm_up(&cluster).await;
    println!("cluster: both gateways serve through the mock upstream after {ready_in:?}");

    scenarios::foundation(&cluster, &mock).await;
    scenarios::limiter_race(&cluster, &mock).await;
    scenarios::billing_race(&cluster, &mock).await;
    scenarios::billing_race_across_a_hand_back(&cluster, &mock).await;
    kills::kills(&cluster).await;
    println!("cluster: passed in {:?}", started.elapsed());
}

/// Until a chat goes through each gateway: the router may have marked the
/// backend down while the mock was not listening yet (its health checks
/// run every 5 s).
async fn warm_up(cluster: &client::Cluster) -> Duration {
    let account = cluster.create_account(0, "warm-up").await;
    cluster.credit(0, &account.id, "1", "seed").await;
    let (_, key) = cluster.create_key(0, &account.admin_key, "INFERENCE").await;
    let body = json!({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}]});
    client::wait_until(
        "a chat through each gateway",
        Duration::from_secs(60),
        || async {
            let mut served = true;
            for gateway in 0..2 {
                let response = cluster
                    .call(
                        gateway,
                        Method::POST,
                        "/chat/completions",
                        &key,
                        Some(&body),
                    )
                    .await;
                served &= response.status() == 200;
            }
            served
        },
    )
    .await
}
