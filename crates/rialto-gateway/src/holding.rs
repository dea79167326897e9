//! A hold on its way to billing, which a client that leaves cannot strand.
//!
//! A request's admission and its hold are asked together
//! ([`crate::chat::admit`]); once both answer, the hold belongs to the
//! request's `Settlement`, which bills or releases it however the request
//! ends. Before that, a handler dropped in the wait (its client closed the
//! connection) dropped the hold's answer with it: the credit stayed held,
//! for nothing served, until `billing.hold_ttl_secs` ran out. [`Holding`]
//! closes that window: dropped before [`Holding::finish`], it releases a
//! hold it was given, and hands one still on its way to a task that
//! releases it once placed.

use std::task::{Context, Poll};

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use rialto_billing::BillingClient;
use rialto_core::bus::Bus;
use rialto_proto::billing::v1 as billing_pb;

type Answer = rialto_core::Result<billing_pb::HoldResponse>;

/// Whose hold it is: what a release names.
pub(crate) struct Holder<'a> {
    pub(crate) billing: &'a BillingClient,
    pub(crate) usage_queue: Option<&'a Bus>,
    pub(crate) owner: &'a str,
    pub(crate) request_id: &'a str,
    pub(crate) model_id: &'a str,
    pub(crate) key_id: &'a str,
}

impl Holder<'_> {
    /// Gives back a hold the request will not use (it was refused, or
    /// left), off the request's path; nothing is charged.
    pub(crate) fn release(&self, hold: &billing_pb::HoldResponse) {
        if !(hold.placed && hold.reserved) {
            return;
        }
        tracing::debug!(
            request_id = self.request_id,
            "hold released: its request was refused or left before it ran"
        );
        crate::chat::settle_later(
            self.billing.clone(),
            self.usage_queue.cloned(),
            self.unused(hold),
            None,
        );
    }

    /// The settlement of nothing used against `hold`.
    fn unused(&self, hold: &billing_pb::HoldResponse) -> billing_pb::SettleRequest {
        billing_pb::SettleRequest {
            request_id: self.request_id.to_owned(),
            model_id: self.model_id.to_owned(),
            usage: Some(crate::chat::Usage::none().billed()),
            owner: self.owner.to_owned(),
            held_usd: hold.held_usd.clone(),
            held_diem: hold.held_diem.clone(),
            key_id: self.key_id.to_owned(),
            key_period: hold.key_period.clone(),
            key_limit: None,
        }
    }
}

/// A hold asked of billing: await [`Holding::answered`], then take the
/// answer with [`Holding::finish`].
pub(crate) struct Holding<'a> {
    holder: Holder<'a>,
    state: State,
}

// `Answered` is the larger by a `HoldResponse`; a State lives on the
// request's stack for one admission, and boxing it would allocate for each.
#[allow(clippy::large_enum_variant)]
enum State {
    Asked(BoxFuture<'static, Answer>),
    Answered(Answer),
    Finished,
}

impl<'a> Holding<'a> {
    /// `hold` is the call to billing, already made or about to be.
    pub(crate) fn start(holder: Holder<'a>, hold: BoxFuture<'static, Answer>) -> Self {
        Self {
            holder,
            state: State::Asked(hold),
        }
    }

    /// Drives the call; ready once billing answered.
    fn poll_answer(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if let State::Asked(hold) = &mut self.state {
            let answer = std::task::ready!(hold.poll_unpin(cx));
            self.state = State::Answered(answer);
        }
        Poll::Ready(())
    }

    /// Ready once billing answered.
    pub(crate) fn answered(&mut self) -> impl std::future::Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| self.poll_answer(cx))
    }

    /// Billing's answer, read in place.
    ///
    /// # Panics
    /// If billing has not answered yet (a bug of the caller's).
    pub(crate) fn answer(&self) -> &Answer {
        match &self.state {
            State::Answered(answer) => answer,
            _ => panic!("a hold read before billing answered"),
        }
    }

    /// The answer, now the request's to bill or release.
    ///
    /// # Panics
    /// If billing has not answered yet (a bug of the caller's).
    pub(crate) fn finish(mut self) -> Answer {
        match std::mem::replace(&mut self.state, State::Finished) {
            State::Answered(answer) => answer,
            _ => panic!("a hold finished before billing answered"),
        }
    }
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.state, State::Finished) {
            State::Finished | State::Answered(Err(_)) => {}
            State::Answered(Ok(hold)) => self.holder.release(&hold),
            State::Asked(hold) => {
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    return;
                };
                // Billing may place it yet: wait for its answer, then
                // release what it placed.
                let billing = self.holder.billing.clone();
                let queue = self.holder.usage_queue.cloned();
                let owned = OwnedHolder {
                    owner: self.holder.owner.to_owned(),
                    request_id: self.holder.request_id.to_owned(),
                    model_id: self.holder.model_id.to_owned(),
                    key_id: self.holder.key_id.to_owned(),
                };
                // Counted as a settlement in flight, which shutdown waits for.
                let pending = crate::chat::PendingSettlement::start();
                runtime.spawn(async move {
                    let Ok(hold) = hold.await else { return };
                    let holder = Holder {
                        billing: &billing,
                        usage_queue: queue.as_ref(),
                        owner: &owned.owner,
                        request_id: &owned.request_id,
                        model_id: &owned.model_id,
                        key_id: &owned.key_id,
                    };
                    holder.release(&hold);
                    drop(pending);
                });
            }
        }
    }
}

/// A [`Holder`]'s names, kept by the task that outlives the request.
struct OwnedHolder {
    owner: String,
    request_id: String,
    model_id: String,
    key_id: String,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const OWNER: &str = "account:leaver";

    /// A hold of 1,000 tokens ($0.001) for `request_id`, reaching billing
    /// after `delay`.
    fn hold_after(
        billing: &BillingClient,
        request_id: &str,
        delay: Duration,
    ) -> BoxFuture<'static, Answer> {
        let billing = billing.clone();
        let request = billing_pb::HoldRequest {
            owner: OWNER.into(),
            request_id: request_id.into(),
            model_id: "m".into(),
            prompt_tokens: 500,
            max_completion_tokens: 500,
            ..Default::default()
        };
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            billing.hold(request).await
        })
    }

    fn holder<'a>(billing: &'a BillingClient, request_id: &'a str) -> Holder<'a> {
        Holder {
            billing,
            usage_queue: None,
            owner: OWNER,
            request_id,
            model_id: "m",
            key_id: "key-1",
        }
    }

    /// What `OWNER`'s open holds reserve, once it settles to `expected`
    /// (releases run in tasks of their own), or what it read last.
    async fn held_becomes(billing: &BillingClient, expected: &str) -> String {
        let mut held = String::new();
        for _ in 0..500 {
            let balance = billing
                .get_balance(billing_pb::GetBalanceRequest {
                    owner: OWNER.into(),
                })
                .await
                .unwrap();
            held = balance.usd_held;
            if held == expected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        held
    }

    /// Finished, the hold is the request's: nothing is released.
    #[tokio::test]
    async fn a_finished_hold_stays_held() {
        let (_dir, billing, _) = crate::test_billing::local_billing(OWNER).await;
        let mut holding = Holding::start(
            holder(&billing, "kept"),
            hold_after(&billing, "kept", Duration::ZERO),
        );
        holding.answered().await;
        let hold = holding.finish().unwrap();
        assert!(hold.placed && hold.reserved);
        // Whatever was to be released in the background has been.
        assert!(crate::chat::pending_settlements(Duration::from_secs(5)).await);
        let balance = billing
            .get_balance(billing_pb::GetBalanceRequest {
                owner: OWNER.into(),
            })
            .await
            .unwrap();
        assert_eq!(balance.usd_held, "0.001");
    }

    /// Answered but dropped (the limiter refused, or the client left
    /// while the limiter was asked): the hold is released.
    #[tokio::test]
    async fn an_answered_hold_dropped_is_released() {
        let (_dir, billing, _) = crate::test_billing::local_billing(OWNER).await;
        let mut holding = Holding::start(
            holder(&billing, "refused"),
            hold_after(&billing, "refused", Duration::ZERO),
        );
        holding.answered().await;
        assert!(holding.answer().as_ref().unwrap().placed);
        drop(holding);
        assert_eq!(held_becomes(&billing, "0").await, "0");
    }

    /// Dropped before billing answered (the client left while the hold
    /// was on its way to another process): the hold billing places after
    /// is released.
    #[tokio::test]
    async fn a_hold_on_its_way_when_dropped_is_released_once_placed() {
        let (_dir, billing, _) = crate::test_billing::local_billing(OWNER).await;
        // Billing's side of the call runs whatever the caller does, as a
        // remote replica's would: told here when it has placed the hold.
        let (placed, placed_seen) = tokio::sync::oneshot::channel();
        let call = tokio::spawn({
            let hold = hold_after(&billing, "left", Duration::from_millis(50));
            async move {
                let answer = hold.await;
                let _ = placed.send(answer.as_ref().is_ok_and(|h| h.placed));
                answer
            }
        });
        let mut holding = Holding::start(
            holder(&billing, "left"),
            Box::pin(async move { call.await.expect("the call does not panic") }),
        );
        let asked = tokio::time::timeout(Duration::from_millis(5), holding.answered()).await;
        assert!(asked.is_err(), "billing has not answered yet");
        drop(holding);
        assert!(placed_seen.await.unwrap(), "billing placed the hold after");
        assert_eq!(held_becomes(&billing, "0").await, "0", "and it is released");
        let balance = billing
            .get_balance(billing_pb::GetBalanceRequest {
                owner: OWNER.into(),
            })
            .await
            .unwrap();
        assert_eq!(balance.usd, "1", "nothing is charged");
        assert!(crate::chat::pending_settlements(Duration::from_secs(5)).await);
    }
}
