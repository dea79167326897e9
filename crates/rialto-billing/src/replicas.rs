//! Billing replicas: each ledger owner belongs to one replica, the first
//! live one in its rendezvous order over the replicas' stable names
//! ([`Membership`]), so the same owner's holds, settlements and credits
//! meet in one process, and move to the next replica when that one dies.
//! The ledger's fence stays the last guard: whatever the replicas believe
//! (two gateways' views differing for a moment), only the replica that
//! loaded an owner last can write for it, and no balance goes below zero.

use async_trait::async_trait;
use rialto_core::membership::Membership;
use rialto_core::placement::{owner_index, replica_seed};
use rialto_core::{Error, Result};
use rialto_proto::billing::v1 as pb;

use crate::{BillingClient, BillingService};

/// Billing over several replicas, each owning a share of ledger owners.
pub struct ReplicatedBilling {
    replicas: Vec<BillingClient>,
    membership: Membership,
}

impl ReplicatedBilling {
    /// `replicas`: (stable name, client), as listed in `remote.billing`;
    /// none is ever counted dead.
    pub fn new(replicas: Vec<(String, BillingClient)>) -> Result<Self> {
        let names = replicas.iter().map(|(name, _)| name.clone()).collect();
        Self::with_membership(
            replicas.into_iter().map(|(_, client)| client).collect(),
            Membership::fixed("billing", names),
        )
    }

    /// `replicas` in `membership`'s order: each owner goes to the first
    /// live replica in its rendezvous order.
    pub fn with_membership(replicas: Vec<BillingClient>, membership: Membership) -> Result<Self> {
        if replicas.is_empty() {
            return Err(Error::invalid("no billing replica configured"));
        }
        if replicas.len() != membership.len() {
            return Err(Error::internal(format_args!(
                "{} billing clients for {} listed replicas",
                replicas.len(),
                membership.len()
            )));
        }
        Ok(Self {
            replicas,
            membership,
        })
    }

    /// `call` on the replica owning ledger `owner`, and once more on the
    /// next one when that replica dies or hangs meanwhile
    /// ([`Membership::on_owner`]), or at once on the same replica when the
    /// call's record was fenced out ([`crate::writer::fenced_out`]), or on
    /// the replica that keeps the ledger when the one asked may not load it
    /// ([`crate::writer::kept_elsewhere`]: two views differing for a
    /// moment): each call routed so is keyed (request id) or a read, and
    /// answers the same the second time (a settlement reports what was
    /// charged), so a second run changes nothing twice.
    async fn routed<R, T, F, Fut>(&self, owner: &str, request: R, call: F) -> Result<T>
    where
        R: Clone,
        F: Fn(BillingClient, R) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let (call, request) = (&call, &request);
        self.membership
            .on_owner(owner, |index| async move {
                let mut at = index;
                let mut fenced = false;
                for pause in REDIRECT_PAUSES {
                    if !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                    }
                    let error = match call(self.replicas[at].clone(), request.clone()).await {
                        Err(error) => error,
                        answered => return answered,
                    };
                    if crate::writer::fenced_out(&error) && !fenced {
                        // Fenced out: another replica loaded the ledger while
                        // this call's record waited for its batch, so nothing
                        // was written, and this replica dropped it; asked
                        // again at once, it reads the ledger again and
                        // decides, or names the replica that keeps it now.
                        // (Not left to `on_owner`, which would wait for the
                        // view to move away from a replica that is alive.)
                        tracing::debug!("billing call fenced out; asked again");
                        fenced = true;
                        continue;
                    }
                    if crate::writer::is_moving(&error) {
                        // Let go by one replica, not yet taken: again, after
                        // a pause.
                        continue;
                    }
                    let keeper = crate::writer::kept_elsewhere(&error).and_then(|name| {
                        (0..self.membership.len()).find(|&i| self.membership.name(i) == name)
                    });
                    match keeper {
                        // A keeper this process no longer hears (dead or
                        // hung): not asked, as the call would wait for its
                        // timeout; the replica asked stops hearing it too
                        // in a moment and takes the ledger, so it is asked
                        // again after a pause.
                        Some(keeper) if !self.membership.is_live(keeper) => {}
                        Some(keeper) => {
                            tracing::debug!(
                                replica = keeper,
                                "billing call sent to the replica keeping its ledger"
                            );
                            at = keeper;
                        }
                        None => return Err(error),
                    }
                }
                Err(crate::writer::moving())
            })
            .await
            .1
    }

    /// `call` on any live replica, for a read that is no owner's (they
    /// share the database): the first in [`ANY`]'s order, so the same one
    /// while it lives, and the next when it dies.
    async fn any<R, T, F, Fut>(&self, request: R, call: F) -> Result<T>
    where
        R: Clone,
        F: Fn(BillingClient, R) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.routed(ANY, request, call).await
    }
}

/// Before each call of one routed request: the first at once; the next
/// after a pause growing to about 0.6 s in all, when each replica asked
/// names the other (their views of who is ready differ until both have
/// heard the same heartbeats).
const REDIRECT_PAUSES: [std::time::Duration; 8] = {
    use std::time::Duration;
    [
        Duration::ZERO,
        Duration::ZERO,
        Duration::from_millis(10),
        Duration::from_millis(20),
        Duration::from_millis(40),
        Duration::from_millis(80),
        Duration::from_millis(160),
        Duration::from_millis(320),
    ]
};

/// The key [`ReplicatedBilling`] routes reads of every owner on.
const ANY: &str = "billing:any";

/// Which of `addresses` (as listed in `remote.billing`) owns ledger `owner`:
/// for operators and tests.
pub fn owner_of(owner: &str, addresses: &[&str]) -> usize {
    owner_index(owner, addresses.iter().map(|a| replica_seed(a)))
}

#[async_trait]
impl BillingService for ReplicatedBilling {
    async fn quote(&self, request: pb::QuoteRequest) -> Result<pb::Cost> {
        // Prices are configuration: any replica knows them.
        let model = request.model_id.clone();
        self.routed(&model, request, |billing, request| async move {
            billing.quote(request).await
        })
        .await
    }

    async fn hold(&self, request: pb::HoldRequest) -> Result<pb::HoldResponse> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.hold(request).await
        })
        .await
    }

    async fn settle(&self, request: pb::SettleRequest) -> Result<pb::Cost> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.settle(request).await
        })
        .await
    }

    async fn charge(&self, request: pb::ChargeRequest) -> Result<pb::ChargeResponse> {
        let owner = request
            .hold
            .as_ref()
            .map(|hold| hold.owner.clone())
            .unwrap_or_default();
        self.routed(&owner, request, |billing, request| async move {
            billing.charge(request).await
        })
        .await
    }

    async fn checkpoint(&self, request: pb::CheckpointRequest) -> Result<pb::CheckpointResponse> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.checkpoint(request).await
        })
        .await
    }

    async fn credit(&self, request: pb::CreditRequest) -> Result<pb::CreditResponse> {
        // Not asked twice: it would answer "not applied" for a credit the
        // first call applied. The caller retries with its reference.
        self.replicas[self.membership.owner(&request.owner)]
            .credit(request)
            .await
    }

    async fn get_balance(&self, request: pb::GetBalanceRequest) -> Result<pb::Balance> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.get_balance(request).await
        })
        .await
    }

    async fn usage_history(
        &self,
        request: pb::UsageHistoryRequest,
    ) -> Result<pb::UsageHistoryResponse> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.usage_history(request).await
        })
        .await
    }

    async fn put_response(&self, request: pb::StoredResponse) -> Result<pb::PutResponseAck> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.put_response(request).await
        })
        .await
    }

    async fn get_response(&self, request: pb::GetResponseRequest) -> Result<pb::StoredResponse> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.get_response(request).await
        })
        .await
    }

    async fn usage_analytics(
        &self,
        request: pb::UsageAnalyticsRequest,
    ) -> Result<pb::UsageAnalyticsResponse> {
        let call =
            |billing: BillingClient, request| async move { billing.usage_analytics(request).await };
        if request.all_owners {
            return self.any(request, call).await;
        }
        let owner = request.owner.clone();
        self.routed(&owner, request, call).await
    }

    async fn set_stake(&self, request: pb::SetStakeRequest) -> Result<pb::Balance> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.set_stake(request).await
        })
        .await
    }

    async fn key_spend(&self, request: pb::KeySpendRequest) -> Result<pb::KeySpendResponse> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.key_spend(request).await
        })
        .await
    }

    async fn transactions(
        &self,
        request: pb::TransactionsRequest,
    ) -> Result<pb::TransactionsResponse> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.transactions(request).await
        })
        .await
    }

    async fn top_up(&self, request: pb::TopUpRequest) -> Result<pb::TopUpResponse> {
        // The payer is inside the signed payment; any live replica can
        // verify it, and the payment's key makes the credit happen once.
        let replica = self.replicas.get(self.membership.owner(&request.payment));
        match replica {
            Some(client) => client.top_up(request).await,
            None => Err(Error::invalid("no billing replica configured")),
        }
    }

    async fn top_ups(&self, request: pb::TopUpsRequest) -> Result<pb::TopUpsResponse> {
        self.any(request, |billing, request| async move {
            billing.top_ups(request).await
        })
        .await
    }

    async fn submit_job(&self, request: pb::SubmitJobRequest) -> Result<pb::Job> {
        let owner = request.job.as_ref().map(|job| job.owner.clone());
        let owner = owner.unwrap_or_default();
        self.routed(&owner, request, |billing, request| async move {
            billing.submit_job(request).await
        })
        .await
    }

    async fn claim_jobs(&self, request: pb::ClaimJobsRequest) -> Result<pb::ClaimJobsResponse> {
        // Any replica can lease jobs (the table is shared); a worker asks
        // the same one each time.
        let worker = request.worker.clone();
        self.routed(&worker, request, |billing, request| async move {
            billing.claim_jobs(request).await
        })
        .await
    }

    async fn update_job(&self, request: pb::UpdateJobRequest) -> Result<pb::Job> {
        // The owner's replica: a final state is a settlement of its hold.
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.update_job(request).await
        })
        .await
    }

    async fn get_job(&self, request: pb::GetJobRequest) -> Result<pb::Job> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.get_job(request).await
        })
        .await
    }

    async fn complete_job(&self, request: pb::CompleteJobRequest) -> Result<pb::Job> {
        let owner = request.owner.clone();
        self.routed(&owner, request, |billing, request| async move {
            billing.complete_job(request).await
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::book::tests::ScratchDatabase;

    const NAMES: [&str; 2] = ["first", "second"];

    /// Two replicas over one PostgreSQL database (claiming as replicas
    /// when `claiming`), a `ReplicatedBilling` over them, and an owner the
    /// first one owns by placement, credited 1 USD through it.
    struct Pair {
        db: rialto_core::db::Database,
        first: BillingClient,
        second: BillingClient,
        billing: ReplicatedBilling,
        owner: String,
        scratch: ScratchDatabase,
    }

    impl Pair {
        async fn start(owners: &str, claiming: bool) -> Self {
            let (db, scratch) = crate::book::tests::postgres().await;
            let config = rialto_core::Config::from_toml(
                "[[models]]\nid = \"m\"\ninput_usd_per_mtok = 1.0\noutput_usd_per_mtok = 1.0\n",
            )
            .unwrap();
            let local = |me: usize| {
                let billing = crate::LocalBilling::new(&config, db.clone());
                if claiming {
                    *billing.book().shared.test_claim.lock().unwrap() =
                        Some(crate::writer::Claim {
                            me: NAMES[me].into(),
                            live: NAMES[1 - me].into(),
                            elsewhere: None,
                        });
                }
                BillingClient::new(billing)
            };
            let (first, second) = (local(0), local(1));
            let owner = (0..)
                .map(|i| format!("account:{owners}-{i}"))
                .find(|owner| owner_of(owner, &NAMES) == 0)
                .unwrap();
            let billing = ReplicatedBilling::new(vec![
                (NAMES[0].to_owned(), first.clone()),
                (NAMES[1].to_owned(), second.clone()),
            ])
            .unwrap();
            billing
                .credit(pb::CreditRequest {
                    owner: owner.clone(),
                    usd: "1".into(),
                    diem: "0".into(),
                    reference: "seed".into(),
                })
                .await
                .unwrap();
            Self {
                db,
                first,
                second,
                billing,
                owner,
                scratch,
            }
        }

        fn hold(&self, id: &str) -> pb::HoldRequest {
            pb::HoldRequest {
                owner: self.owner.clone(),
                request_id: id.into(),
                model_id: "m".into(),
                prompt_tokens: 500,
                max_completion_tokens: 500,
                ..Default::default()
            }
        }

        /// The settlement of `id` (placed as `placed`): 100 + 100 tokens,
        /// 0.0002 USD.
        fn settle(&self, id: &str, placed: &pb::HoldResponse) -> pb::SettleRequest {
            pb::SettleRequest {
                request_id: id.into(),
                model_id: "m".into(),
                usage: Some(pb::Usage {
                    prompt_tokens: 100,
                    completion_tokens: 100,
                    ..Default::default()
                }),
                owner: self.owner.clone(),
                held_usd: placed.held_usd.clone(),
                held_diem: placed.held_diem.clone(),
                ..Default::default()
            }
        }

        /// What the journal charged `id`, (USD, DIEM) nano-units.
        async fn charged(&self, id: &str) -> (i64, i64) {
            let ledger = crate::ledger::Ledger::new(self.db.clone());
            ledger.charged(id).await.unwrap()
        }

        /// Stops the replicas' writers before the database is dropped.
        fn end(self) {
            let Self {
                first,
                second,
                billing,
                scratch,
                ..
            } = self;
            drop((billing, first, second));
            drop(scratch);
        }
    }

    /// A call whose record another replica fenced out (it loaded the
    /// ledger after this one decided) is asked again, and the replica
    /// that owns the ledger decides it on the ledger as written: served,
    /// not refused, and charged once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_fenced_out_at_a_hand_back_is_asked_again() {
        let pair = Pair::start("handback", false).await;
        let placed = pair.billing.hold(pair.hold("h1")).await.unwrap();
        assert!(placed.placed);
        // The second replica loads the ledger (as at a hand-back, a
        // gateway's view a moment behind): the first one is fenced out.
        assert!(pair.second.hold(pair.hold("h2")).await.unwrap().placed);
        // Routed to the first replica, whose record is fenced out, then
        // asked again there: it reads the ledger again and settles.
        let cost = pair
            .billing
            .settle(pair.settle("h1", &placed))
            .await
            .unwrap();
        assert_eq!(cost.usd, "0.0002");
        assert_eq!(pair.charged("h1").await, (200_000, 0));
        pair.end();
    }

    /// A call routed to a replica that may not load the ledger (another
    /// live replica keeps it, as while two views differ) is sent on to the
    /// replica it names, and served and charged there, once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_is_sent_on_to_the_replica_keeping_the_ledger() {
        let pair = Pair::start("kept", true).await;
        // The second replica keeps the ledger (a gateway's view a moment
        // apart sent it a request): the first may not load it.
        assert!(pair.second.hold(pair.hold("k1")).await.unwrap().placed);
        let refused = pair.first.hold(pair.hold("k2")).await.unwrap_err();
        assert_eq!(crate::writer::kept_elsewhere(&refused), Some("second"));
        // Routed to the first, sent on to the second: placed and settled.
        let placed = pair.billing.hold(pair.hold("k2")).await.unwrap();
        assert!(placed.placed);
        let cost = pair
            .billing
            .settle(pair.settle("k2", &placed))
            .await
            .unwrap();
        assert_eq!(cost.usd, "0.0002");
        assert_eq!(pair.charged("k2").await, (200_000, 0));
        pair.end();
    }
}
