//! Billing of this process for unit tests: a fresh SQLite ledger, one
//! owner credited $1, and a model `m` at $1 per million tokens each way.

use rialto_billing::{BillingClient, LocalBilling, Prices};
use rialto_proto::billing::v1 as billing_pb;

/// That billing, `owner` credited $1, and `m`'s prices; the directory
/// holds the database for as long as it lives.
pub(crate) async fn local_billing(owner: &str) -> (tempfile::TempDir, BillingClient, Prices) {
    let config = config();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/billing.db", dir.path().display());
    let db = rialto_core::db::Database::connect(&url, 4).await.unwrap();
    let billing = BillingClient::new(LocalBilling::new(&config, db));
    billing
        .credit(billing_pb::CreditRequest {
            owner: owner.into(),
            usd: "1".into(),
            diem: "0".into(),
            reference: "seed".into(),
        })
        .await
        .unwrap();
    (dir, billing, prices())
}

/// `m`'s prices.
pub(crate) fn prices() -> Prices {
    Prices::from_model(&config().models[0])
}

fn config() -> rialto_core::Config {
    rialto_core::Config::from_toml(
        "[[models]]\nid = \"m\"\ninput_usd_per_mtok = 1.0\noutput_usd_per_mtok = 1.0\n",
    )
    .unwrap()
}
