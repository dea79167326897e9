//! [`RateLimiter`]: the limiter as the gateway sees it.
//!
//! For each request it resolves the windows that apply ([`Policy`]), takes a
//! slot in each from the replica that owns it, and turns the outcome into
//! the `x-ratelimit-*` values. Owners are chosen by rendezvous hashing over
//! the configured replica addresses: every gateway computes the same owner
//! with no coordination, and adding or losing a replica moves only the
//! principals it gains or held.
//!
//! A window whose owner is the [`LocalLimiter`](crate::LocalLimiter) of this
//! process is decided in place: [`LocalLimiter::decide`] and
//! [`LocalLimiter::apply`] on the caller's thread, with borrowed strings, no
//! spawned task and no bus event. Only windows of other replicas go through
//! [`LimiterService`](crate::LimiterService) messages.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use prost::Message;
use rialto_core::bus::Bus;
use rialto_core::membership::Membership;
use rialto_core::placement::{owner_index, replica_seed};
use rialto_core::{Config, Error, ErrorCode, Result};
use rialto_proto::limiter::v1 as pb;
use tokio::sync::mpsc;

use crate::policy::{Caller, Policy, Scope, Target, WindowSpec};
use crate::principals::{Admit, Commit};
use crate::{COMMITS_SUBJECT, HITS_SUBJECT, LOG_PAGE, LimiterClient, LocalLimiter};

/// A cloneable handle: the policy, the replicas and the bus.
#[derive(Clone, Debug)]
pub struct RateLimiter(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// The limits of `[limits]` and the catalog, replaced whole by a
    /// configuration reload ([`RateLimiter::reload`]); the windows, which
    /// the replicas hold, are not touched.
    policy: ArcSwap<Policy>,
    /// The windows' span, fixed for the process's life (a reload keeps it).
    span_ms: i64,
    replicas: Vec<LimiterClient>,
    /// Which replicas are alive to own principals (fixed without failover).
    membership: Membership,
    /// Commits and hits travel on this bus when it reaches the replicas
    /// (one process, or NATS); otherwise they go to the owner over gRPC.
    bus: Option<Bus>,
    /// Commits and releases for other processes' replicas that do not go
    /// on the bus, to the task that gathers them ([`send_gathered`]);
    /// started by the first.
    outbox: OnceLock<mpsc::UnboundedSender<pb::CommitRequest>>,
    /// The runtime this limiter was made on (the process's), where that
    /// task runs: not an HTTP worker's, which may stop before the process.
    home: Option<tokio::runtime::Handle>,
}

/// How long the commits for other replicas gather before they are sent,
/// one call per replica: they are off every response's path, and a window
/// that counts a request's estimate a few milliseconds longer refuses
/// nothing it should not.
const COMMIT_GATHER: Duration = Duration::from_millis(5);
/// The most commits one call carries.
const COMMIT_BATCH: usize = 1024;

/// The values of the `x-ratelimit-*` headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateHeaders {
    pub scope: Scope,
    pub limit_requests: u64,
    pub remaining_requests: u64,
    /// Unix seconds.
    pub reset_requests: i64,
    /// None when the window has no token limit.
    pub tokens: Option<TokenHeaders>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenHeaders {
    pub limit: u64,
    pub remaining: u64,
    /// Seconds from now.
    pub reset_secs: i64,
}

/// What the limiter decided about one request.
#[derive(Debug)]
pub struct Admission {
    /// The headers to send, when any window applies.
    pub headers: Option<RateHeaders>,
    /// The refusal, ready to return (429 with a clear message).
    pub refusal: Option<Error>,
    /// The slots held, to commit when the request ends.
    pub ticket: Ticket,
}

/// The windows a request holds a slot in.
#[derive(Debug, Default)]
pub struct Ticket {
    request_id: String,
    estimated_tokens: u64,
    /// The window name (model id or `endpoint:<path>`), the same in every
    /// principal held.
    window: String,
    /// (owner replica, principal) of each slot held.
    held: Vec<(usize, String)>,
}

impl Ticket {
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

impl RateLimiter {
    /// `replicas` are (address, client) pairs; the address only seeds the
    /// hash, so every gateway must list the same addresses.
    pub fn new(config: &Config, replicas: Vec<(String, LimiterClient)>, bus: Option<Bus>) -> Self {
        let names = replicas.iter().map(|(name, _)| name.clone()).collect();
        Self::with_membership(
            config,
            replicas.into_iter().map(|(_, client)| client).collect(),
            Membership::fixed("limiter", names),
            bus,
        )
    }

    /// Over `replicas` (in `membership`'s order), each principal owned by
    /// the first live replica in its rendezvous order.
    pub fn with_membership(
        config: &Config,
        replicas: Vec<LimiterClient>,
        membership: Membership,
        bus: Option<Bus>,
    ) -> Self {
        let policy = Policy::new(config);
        Self(Arc::new(Inner {
            span_ms: policy.span_ms,
            policy: ArcSwap::from_pointee(policy),
            replicas,
            membership,
            bus,
            outbox: OnceLock::new(),
            home: tokio::runtime::Handle::try_current().ok(),
        }))
    }

    /// The policy in force (a snapshot: a reload does not change it).
    pub fn policy(&self) -> Arc<Policy> {
        self.0.policy.load_full()
    }

    /// Puts the limits of `config` in force: tiers, overrides, account
    /// windows, the models' global windows and the default completion
    /// budget. The windows themselves (what each principal used) stay with
    /// their replicas, untouched; `limits.window_secs` keeps the value the
    /// process started with (the windows were sized by it).
    pub fn reload(&self, config: &Config) {
        let mut policy = Policy::new(config);
        policy.span_ms = self.0.span_ms;
        self.0.policy.store(Arc::new(policy));
    }

    fn owner(&self, principal: &str) -> usize {
        self.0.membership.owner(principal)
    }

    /// The replica at `index` when it is this process's own.
    fn local(&self, index: usize) -> Option<&LocalLimiter> {
        self.0.replicas.get(index).and_then(LimiterClient::local)
    }

    fn replica(&self, index: usize) -> Result<&LimiterClient> {
        self.0
            .replicas
            .get(index)
            .ok_or_else(|| Error::internal("no limiter replica configured"))
    }

    /// Takes a slot and `estimated_tokens` in every window that applies to
    /// `caller` on `target`. A refusal by a later window gives back the
    /// slots taken before it.
    pub async fn admit(
        &self,
        caller: Caller<'_>,
        target: Target<'_>,
        request_id: &str,
        estimated_tokens: u64,
    ) -> Result<Admission> {
        let windows = self.0.policy.load().windows(caller, target);
        if windows.is_empty() {
            record_decision("none");
            return Ok(Admission {
                headers: None,
                refusal: None,
                ticket: Ticket::default(),
            });
        }
        let mut ticket = Ticket {
            request_id: request_id.to_owned(),
            estimated_tokens,
            window: target.window.to_owned(),
            held: Vec::with_capacity(windows.len()),
        };
        let mut shown: Option<(Scope, pb::WindowState)> = None;
        for WindowSpec {
            scope,
            principal,
            limit,
        } in windows
        {
            let owner = self.owner(&principal);
            let (owner, response) = match self.local(owner) {
                // Decided here and now: no copy of the request, no hop.
                Some(local) => (
                    owner,
                    Ok(local.decide(&Admit {
                        request_id,
                        principal: &principal,
                        window: target.window,
                        limit,
                        estimated_tokens,
                        account_id: caller.account_id,
                        key_id: caller.key_id,
                        tier: caller.tier,
                        peek: false,
                    })),
                ),
                // Another process: asked again of the next replica when
                // this one dies or hangs meanwhile.
                None => {
                    let request = pb::AdmitRequest {
                        request_id: request_id.to_owned(),
                        principal: principal.clone(),
                        window: target.window.to_owned(),
                        limit: Some(limit),
                        estimated_tokens,
                        account_id: caller.account_id.to_owned(),
                        key_id: caller.key_id.to_owned(),
                        tier: caller.tier.to_owned(),
                        peek: false,
                    };
                    self.0
                        .membership
                        .on_owner(&principal, |owner| {
                            let request = request.clone();
                            async move { self.replica(owner)?.admit(request).await }
                        })
                        .await
                }
            };
            let response = match response {
                Ok(response) => response,
                Err(error) => {
                    // The owner may have admitted before the call failed:
                    // release this window too (a release of nothing is
                    // a no-op).
                    ticket.held.push((owner, principal));
                    self.release(ticket);
                    return Err(error);
                }
            };
            let state = response.state.unwrap_or_default();
            if !response.admitted {
                self.release(ticket);
                let mut headers = headers(scope, &state, self.0.span_ms);
                // On a refusal, the reset is when this request would fit.
                headers.reset_requests = ceil_secs(response.retry_at_ms);
                record_decision(match response.refused_by.as_str() {
                    "RPM" => "RPM",
                    "TPM" => "TPM",
                    "RPD" => "RPD",
                    _ => "other",
                });
                let refusal = refusal_error(
                    &response.refused_by,
                    scope,
                    target.window,
                    &limit,
                    self.0.span_ms,
                    estimated_tokens,
                    response.retry_at_ms,
                );
                return Ok(Admission {
                    headers: Some(headers),
                    refusal: Some(refusal),
                    ticket: Ticket::default(),
                });
            }
            ticket.held.push((owner, principal));
            // Show the window closest to refusing.
            if shown
                .as_ref()
                .is_none_or(|(_, s)| state.remaining_requests < s.remaining_requests)
            {
                shown = Some((scope, state));
            }
        }
        record_decision("none");
        Ok(Admission {
            headers: shown.map(|(scope, state)| headers(scope, &state, self.0.span_ms)),
            refusal: None,
            ticket,
        })
    }

    /// The headers `admit` would show, taking nothing: for a request
    /// refused before admission (a validation error, say).
    pub async fn peek(
        &self,
        caller: Caller<'_>,
        target: Target<'_>,
    ) -> Result<Option<RateHeaders>> {
        let mut shown: Option<(Scope, pb::WindowState)> = None;
        let windows = self.0.policy.load().windows(caller, target);
        for spec in windows {
            let owner = self.owner(&spec.principal);
            let response = match self.local(owner) {
                Some(local) => local.decide(&Admit {
                    request_id: "",
                    principal: &spec.principal,
                    window: target.window,
                    limit: spec.limit,
                    estimated_tokens: 0,
                    account_id: "",
                    key_id: "",
                    tier: "",
                    peek: true,
                }),
                None => {
                    self.replica(owner)?
                        .admit(pb::AdmitRequest {
                            principal: spec.principal,
                            window: target.window.to_owned(),
                            limit: Some(spec.limit),
                            peek: true,
                            ..Default::default()
                        })
                        .await?
                }
            };
            let state = response.state.unwrap_or_default();
            if shown
                .as_ref()
                .is_none_or(|(_, s)| state.remaining_requests < s.remaining_requests)
            {
                shown = Some((spec.scope, state));
            }
        }
        Ok(shown.map(|(scope, state)| headers(scope, &state, self.0.span_ms)))
    }

    /// Tells the owners what the request used. A window of this process's
    /// replica is corrected in place, before this returns; for the others
    /// it is fire and forget, off the response path, as an event on the bus
    /// when the bus reaches the replicas.
    pub fn commit(&self, ticket: Ticket, used_tokens: u64) {
        self.send_commits(ticket, used_tokens, false);
    }

    /// Gives back the slots of a request that never ran (a later window, or
    /// billing, refused it). Applied in place for this process's replica,
    /// sent to each other owner directly, never on the bus (at most once
    /// there): a lost release would hold a slot for a whole window.
    pub fn release(&self, ticket: Ticket) {
        self.send_commits(ticket, 0, true);
    }

    fn send_commits(&self, ticket: Ticket, used_tokens: u64, release: bool) {
        let Ticket {
            request_id,
            estimated_tokens,
            window,
            mut held,
        } = ticket;
        // The owner is the replica of this process: applied now, in place.
        held.retain(|(owner, principal)| match self.local(*owner) {
            Some(local) => {
                local.apply(&Commit {
                    request_id: &request_id,
                    principal,
                    window: &window,
                    estimated_tokens,
                    used_tokens,
                    release,
                });
                false
            }
            None => true,
        });
        if held.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let requests = held.into_iter().map(|(_, principal)| pb::CommitRequest {
            request_id: request_id.clone(),
            principal,
            window: window.clone(),
            used_tokens,
            release,
            estimated_tokens,
        });
        let Some(bus) = self.0.bus.as_ref().filter(|_| !release) else {
            let outbox = self.0.outbox.get_or_init(|| {
                let (sender, queue) = mpsc::unbounded_channel();
                let home = self.0.home.as_ref().unwrap_or(&runtime);
                home.spawn(send_gathered(Arc::downgrade(&self.0), queue));
                sender
            });
            for request in requests {
                // Refused only once the runtime is gone, and the task with it.
                let _ = outbox.send(request);
            }
            return;
        };
        let requests: Vec<_> = requests.collect();
        let bus = bus.clone();
        runtime.spawn(async move {
            for request in requests {
                let payload = Bytes::from(request.encode_to_vec());
                if let Err(error) = bus.publish(bus.subject(COMMITS_SUBJECT), payload).await {
                    tracing::warn!(%error, "limiter commit failed");
                }
            }
        });
    }

    /// Records a hit found outside the limiter; fire and forget.
    pub fn record_hit(&self, hit: pb::LimitHit) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let this = self.clone();
        runtime.spawn(async move {
            let sent = match &this.0.bus {
                Some(bus) => {
                    let payload = Bytes::from(hit.encode_to_vec());
                    bus.publish(bus.subject(HITS_SUBJECT), payload).await
                }
                None => {
                    let owner = this.owner(&format!("user:{}", hit.account_id));
                    match this.replica(owner) {
                        Ok(replica) => replica
                            .record_hits(pb::RecordHitsRequest { hits: vec![hit] })
                            .await
                            .map(|_| ()),
                        Err(error) => Err(error),
                    }
                }
            };
            if let Err(error) = sent {
                tracing::warn!(%error, "cannot record a limit hit");
            }
        });
    }

    /// The account's latest limit hits, newest first (at most 50).
    pub async fn recent_hits(&self, account_id: &str) -> Result<Vec<pb::LimitHit>> {
        let owner = self.owner(&format!("user:{account_id}"));
        let response = self
            .replica(owner)?
            .recent_hits(pb::RecentHitsRequest {
                account_id: account_id.to_owned(),
                limit: LOG_PAGE,
                all_accounts: false,
            })
            .await?;
        Ok(response.hits)
    }

    /// Every account's latest limit hits, newest first (at most
    /// [`LOG_PAGE_ALL`](crate::LOG_PAGE_ALL)): an operator's view. The log is one table, so any
    /// replica answers; the one a fixed key names, while it lives.
    pub async fn recent_hits_all(&self, limit: u32) -> Result<Vec<pb::LimitHit>> {
        let owner = self.owner("log:all");
        let response = self
            .replica(owner)?
            .recent_hits(pb::RecentHitsRequest {
                limit,
                all_accounts: true,
                ..Default::default()
            })
            .await?;
        Ok(response.hits)
    }
}

/// Sends the commits queued for other processes' replicas: whatever
/// gathered over [`COMMIT_GATHER`] after the first, in one call to each
/// replica that owns some of them now (after a failover, the one that took
/// the principal over, and holds the slot to give back). Ends with the
/// limiter.
async fn send_gathered(
    limiter: Weak<Inner>,
    mut queue: mpsc::UnboundedReceiver<pb::CommitRequest>,
) {
    let mut batch = Vec::with_capacity(COMMIT_BATCH);
    while queue.recv_many(&mut batch, COMMIT_BATCH).await > 0 {
        tokio::time::sleep(COMMIT_GATHER).await;
        // What gathered meanwhile, never waiting for more.
        while batch.len() < COMMIT_BATCH
            && let Ok(request) = queue.try_recv()
        {
            batch.push(request);
        }
        let Some(inner) = limiter.upgrade() else {
            return;
        };
        let this = RateLimiter(inner);
        let mut by_owner: HashMap<usize, Vec<pb::CommitRequest>> = HashMap::new();
        for request in batch.drain(..) {
            by_owner
                .entry(this.owner(&request.principal))
                .or_default()
                .push(request);
        }
        for (owner, commits) in by_owner {
            let this = this.clone();
            // Each replica on its own: a hung one delays only its own.
            tokio::spawn(async move {
                let sent = match this.replica(owner) {
                    Ok(replica) => replica.commit_many(pb::CommitBatch { commits }).await,
                    Err(error) => Err(error),
                };
                if let Err(error) = sent {
                    tracing::warn!(%error, "limiter commit failed");
                }
            });
        }
    }
}

/// The index of the replica owning `principal`: the highest of
/// hash(principal, replica) over the replicas (rendezvous hashing).
/// Which of `addresses` (as listed in `remote.limiter`) owns `principal`
/// (`key:<id>`, `user:<account>`, `global:<model>`): for operators and tests.
pub fn owner_of(principal: &str, addresses: &[&str]) -> usize {
    owner_index(principal, addresses.iter().map(|a| replica_seed(a)))
}

fn ceil_secs(ms: i64) -> i64 {
    ms.div_euclid(1000) + i64::from(ms.rem_euclid(1000) > 0)
}

/// The headers of a window's `state`. Its times are on the clock of the
/// process that owns the window, which may be another replica's: one that
/// reads a few milliseconds ahead of this one's would show a token reset
/// beyond the window's span (61 s of a minute), so the reset is bounded by
/// `span_ms`, the most a sliding window can be from its reset.
fn headers(scope: Scope, state: &pb::WindowState, span_ms: i64) -> RateHeaders {
    let now = crate::clock::now_ms();
    RateHeaders {
        scope,
        limit_requests: state.limit_requests,
        remaining_requests: state.remaining_requests,
        reset_requests: ceil_secs(state.reset_requests_ms),
        tokens: (state.limit_tokens > 0).then(|| TokenHeaders {
            limit: state.limit_tokens,
            remaining: state.remaining_tokens,
            reset_secs: ceil_secs((state.reset_tokens_ms - now).clamp(0, span_ms)),
        }),
    }
}

fn per_window(span_ms: i64) -> String {
    if span_ms == 60_000 {
        "per minute".to_owned()
    } else {
        format!("per {} s", span_ms / 1000)
    }
}

/// Counts an admission (`limit_type` "none") or a refusal by its window.
fn record_decision(limit_type: &'static str) {
    use rialto_core::metrics::{Counter, DecisionLabels, Resolved, metrics};
    // Admissions, one a request, count through a member looked up once.
    static ADMITTED: Resolved<Counter> = Resolved::new();
    let family = &metrics().limiter_decisions;
    if limit_type == "none" {
        let labels = || DecisionLabels {
            decision: "admitted",
            limit_type,
        };
        ADMITTED.of(family, labels).inc();
    } else {
        let labels = DecisionLabels {
            decision: "refused",
            limit_type,
        };
        family.get_or_create(&labels).inc();
    }
}

fn refusal_error(
    refused_by: &str,
    scope: Scope,
    window: &str,
    limit: &pb::Limit,
    span_ms: i64,
    estimated_tokens: u64,
    retry_at_ms: i64,
) -> Error {
    let whose = match scope {
        Scope::ApiKey => "this API key",
        Scope::User => "this account",
        Scope::Global => "all callers",
    };
    let retry = chrono::DateTime::from_timestamp_millis(retry_at_ms)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_default();
    let what = match refused_by {
        "TPM" if estimated_tokens > limit.tokens => {
            return Error::new(
                ErrorCode::RateLimited,
                format!(
                    "Rate limit exceeded: this request may use up to {estimated_tokens} tokens, \
                     more than the {} tokens {} allowed on {window} for {whose}; \
                     lower max_tokens or shorten the prompt",
                    limit.tokens,
                    per_window(span_ms)
                ),
            );
        }
        "TPM" => format!("{} tokens {}", limit.tokens, per_window(span_ms)),
        "RPD" => format!("{} requests per day", limit.requests_per_day),
        _ => format!("{} requests {}", limit.requests, per_window(span_ms)),
    };
    Error::new(
        ErrorCode::RateLimited,
        format!("Rate limit exceeded: {what} on {window} for {whose}; retry at {retry}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendezvous_owners_are_stable_and_spread() {
        let config = Config::default();
        let clients = |addresses: &[&str]| {
            let replicas = addresses
                .iter()
                .map(|a| ((*a).to_owned(), LimiterClient::new(Unreachable)))
                .collect();
            RateLimiter::new(&config, replicas, None)
        };
        let two = clients(&["http://limiter-0:9090", "http://limiter-1:9090"]);
        let same = clients(&["http://limiter-0:9090", "http://limiter-1:9090"]);
        let three = clients(&[
            "http://limiter-0:9090",
            "http://limiter-1:9090",
            "http://limiter-2:9090",
        ]);
        let mut counts = [0usize; 2];
        let mut moved_between_survivors = 0;
        for i in 0..1000 {
            let principal = format!("key:{i}");
            let owner = two.owner(&principal);
            assert_eq!(owner, same.owner(&principal), "every gateway agrees");
            counts[owner] += 1;
            let with_third = three.owner(&principal);
            if with_third != 2 && with_third != owner {
                moved_between_survivors += 1;
            }
        }
        assert!(counts.iter().all(|&c| c > 400), "{counts:?}");
        // Adding a replica only takes principals; none move between the others.
        assert_eq!(moved_between_survivors, 0);
    }

    /// A window owned by a replica whose clock reads ahead of this
    /// process's shows a token reset of at most its span, not a second more.
    #[test]
    fn a_token_reset_from_a_clock_ahead_is_at_most_the_span() {
        let state = pb::WindowState {
            limit_tokens: 1_000,
            remaining_tokens: 900,
            reset_tokens_ms: crate::clock::now_ms() + 60_000 + 20,
            ..Default::default()
        };
        let shown = headers(Scope::ApiKey, &state, 60_000);
        assert_eq!(shown.tokens.map(|tokens| tokens.reset_secs), Some(60));
    }

    #[test]
    fn reset_seconds_round_up() {
        assert_eq!(ceil_secs(1_000), 1);
        assert_eq!(ceil_secs(1_001), 2);
        assert_eq!(ceil_secs(0), 0);
    }

    struct Unreachable;

    #[async_trait::async_trait]
    impl crate::LimiterService for Unreachable {
        async fn admit(&self, _: pb::AdmitRequest) -> Result<pb::AdmitResponse> {
            Err(Error::internal("unreachable"))
        }
        async fn commit(&self, _: pb::CommitRequest) -> Result<pb::CommitResponse> {
            Err(Error::internal("unreachable"))
        }
        async fn record_hits(&self, _: pb::RecordHitsRequest) -> Result<pb::RecordHitsResponse> {
            Err(Error::internal("unreachable"))
        }
        async fn recent_hits(&self, _: pb::RecentHitsRequest) -> Result<pb::RecentHitsResponse> {
            Err(Error::internal("unreachable"))
        }
    }
}
