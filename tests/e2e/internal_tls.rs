//! TLS between the processes (`[grpc.tls]`): the split topology serves with
//! every gRPC hop over TLS, and a service's port refuses a plaintext call.

use rialto_proto::billing::v1::GetBalanceRequest;
use rialto_proto::billing::v1::billing_client::BillingClient;
use rialto_test_kit::{MockUpstream, Sandbox, Topology};
use serde_json::json;

use crate::support::models_toml;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_split_topology_serves_over_internal_tls() {
    let mock = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(Topology::Split)
        .grpc_tls()
        .config(&models_toml(&mock.base_url()))
        .start()
        .await
        .unwrap();
    // Auth, the limiter, billing and the router, each over TLS.
    let account = sandbox.create_account("encrypted").await.unwrap();
    let answer = sandbox
        .call(
            reqwest::Method::POST,
            "/chat/completions",
            &account.admin_key,
            Some(&json!({"model": "mock-chat", "messages": [{"role": "user", "content": "hi"}]})),
        )
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(mock.request_count(), 1);

    let addr = sandbox.grpc_addr("billing").unwrap().to_owned();
    let request = || {
        let mut request = tonic::Request::new(GetBalanceRequest {
            owner: format!("account:{}", account.id),
        });
        let token = format!("Bearer {}", rialto_test_kit::GRPC_TOKEN);
        request
            .metadata_mut()
            .insert("authorization", token.parse().unwrap());
        request
    };
    // In plaintext the port answers nothing a gRPC client can read.
    let plaintext = BillingClient::connect(format!("http://{addr}")).await;
    let refused = match plaintext {
        Err(_) => true,
        Ok(mut client) => client.get_balance(request()).await.is_err(),
    };
    assert!(refused, "billing answered a plaintext call");
    // Over TLS, trusting the sandbox's CA, the same call is answered.
    let ca = std::fs::read(sandbox.secret_file("ca.crt")).unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(ca))
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await
        .unwrap();
    let balance = BillingClient::new(channel)
        .get_balance(request())
        .await
        .unwrap()
        .into_inner();
    assert!(!balance.usd.is_empty());
}
