//! The kills. Eight clients load the cluster without pause over both
//! gateways (plain and streamed chats, both models, four keys: one per
//! account and limiter replica, two accounts: one per billing replica).
//! Mid-load limiter-1, billing-0 and gateway-1 are killed with SIGKILL, one
//! after the other, each while requests it serves are in flight; the load
//! goes on through what survives (gateway-0 only once gateway-1 is gone);
//! then all three are started again and must serve again. Afterwards, once
//! the durable usage queue is empty and expired holds are swept:
//!
//! - every request answered 200 in full was charged exactly once, exactly
//!   its `cost.usd`, whether billing settled it at once or from the queue;
//! - no request refused before a backend answered (429, 503) was charged;
//!   the only requests charged without a 200 the client read are ones the
//!   killed gateway was serving (their answers died with it);
//! - each account's balance dropped by exactly the sum of its charges
//!   (usage history, over HTTP) and the ledger's journal adds up to it
//!   (PostgreSQL), with nothing left held;
//! - no key was ever admitted more than its limit in any window: for keys
//!   of the surviving limiter over the whole run, for keys of the killed one
//!   within each of its lives (a restarted replica starts from empty windows,
//!   as ARCHITECTURE.md says); and none was admitted while its limiter, or
//!   its account's billing replica, was down (503 instead);
//! - nothing failed but what the kills explain.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::Row;

use crate::client::{Account, Cluster, Reply, Span, chat, wait_until};
use crate::{CHAT_MODEL, LIMITED_MODEL, LIMITED_RPM, WINDOW};

const WORKERS: usize = 8;
/// Credit of each account of the load: far more than it can spend.
const CREDIT_USD: &str = "100";
const CREDIT: i64 = 100_000_000_000;
/// The longest wait for a phase's condition.
const PHASE: Duration = Duration::from_secs(45);

/// A key of the load: (account, limiter replica owning it).
struct Caller {
    payer: usize,
    limiter: usize,
    secret: String,
}

/// An account of the load and the billing replica owning its ledger.
struct Payer {
    account: Account,
    billing: usize,
}

struct Outcome {
    caller: usize,
    gateway: usize,
    /// When the gateway was chosen (before `sent`).
    chosen: Instant,
    model: &'static str,
    reply: Reply,
}

struct Load {
    http: reqwest::Client,
    /// The chat URL of each gateway.
    urls: Vec<String>,
    callers: Vec<Caller>,
    payers: Vec<Payer>,
    seq: AtomicUsize,
    stop: AtomicBool,
    /// Set once gateway-1 was killed, cleared once it is back: the load
    /// goes to gateway-0 only meanwhile.
    gateway1_down: AtomicBool,
    gateway1_in_flight: AtomicUsize,
    /// Streams of accounts of billing-0 in flight.
    billing0_streams: AtomicUsize,
    outcomes: Mutex<Vec<Outcome>>,
}

impl Load {
    fn count(&self, wanted: impl Fn(&Load, &Outcome) -> bool) -> usize {
        let outcomes = self.outcomes.lock().unwrap();
        outcomes.iter().filter(|o| wanted(self, o)).count()
    }

    fn limiter_of(&self, outcome: &Outcome) -> usize {
        self.callers[outcome.caller].limiter
    }

    fn billing_of(&self, outcome: &Outcome) -> usize {
        self.payers[self.callers[outcome.caller].payer].billing
    }
}

/// Counts a request in flight while it lives.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    fn new(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One client of the load, until told to stop. Requests cycle through
/// every combination of key, gateway, plain or streamed, and model.
async fn worker(load: Arc<Load>) {
    while !load.stop.load(Ordering::SeqCst) {
        let n = load.seq.fetch_add(1, Ordering::SeqCst);
        let caller = n % load.callers.len();
        let chosen = Instant::now();
        let gateway = if load.gateway1_down.load(Ordering::SeqCst) {
            0
        } else {
            (n / 4) % 2
        };
        let stream = (n / 8) % 2 == 1;
        let model = if (n / 16) % 4 == 3 {
            LIMITED_MODEL
        } else {
            CHAT_MODEL
        };
        // 2 prompt words and 20 answered: 22 micro-dollars, in about half
        // a second (streamed) or 30 ms (plain).
        let body = if stream {
            json!({"model": model, "stream": true, "max_tokens": 40,
                "messages": [{"role": "user", "content": "hello there"}],
                "mock": {"words": 20, "chunk_delay_ms": 25}})
        } else {
            json!({"model": model, "max_tokens": 40,
                "messages": [{"role": "user", "content": "hello there"}],
                "mock": {"words": 20, "delay_ms": 30}})
        };
        let payer = load.callers[caller].payer;
        let reply = {
            let _on_gateway1 = (gateway == 1).then(|| InFlight::new(&load.gateway1_in_flight));
            let _billing0 = (stream && load.payers[payer].billing == 0)
                .then(|| InFlight::new(&load.billing0_streams));
            chat(
                &load.http,
                &load.urls[gateway],
                &load.callers[caller].secret,
                &body,
            )
            .await
        };
        let refused = !reply.ok();
        load.outcomes.lock().unwrap().push(Outcome {
            caller,
            gateway,
            chosen,
            model,
            reply,
        });
        if refused {
            // Pacing, not synchronisation: refusals come back at once, and
            // eight clients spinning on them would only load the machine.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// When each process went down and came back.
struct Timeline {
    limiter_killed: Span,
    billing_killed: Span,
    gateway_killed: Span,
    /// When the load stopped sending to gateway-1.
    diverted: Instant,
    limiter_back: Span,
    billing_back: Span,
}

pub async fn kills(cluster: &Cluster) {
    let load = Arc::new(prepare(cluster).await);
    let logs_before: Vec<usize> = ["gateway-0", "gateway-1"]
        .iter()
        .map(|name| cluster.log(name).len())
        .collect();
    let start = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| tokio::spawn(worker(Arc::clone(&load))))
        .collect();
    let until = |what: &'static str, condition: Box<dyn Fn(&Load) -> bool + Send + Sync>| {
        let load = Arc::clone(&load);
        async move { wait_until(what, PHASE, || std::future::ready(condition(&load))).await }
    };
    until(
        "40 answers under load",
        Box::new(|l: &Load| l.count(|_, o| o.reply.ok()) >= 40),
    )
    .await;

    // limiter-1 dies: its keys get 503, the others go on.
    let limiter_killed = cluster.kill("limiter-1").await;
    let after = limiter_killed.done;
    until(
        "answers and 503s with limiter-1 down",
        Box::new(move |l: &Load| {
            l.count(|_, o| o.reply.ok() && o.reply.sent > after) >= 40
                && l.count(|l, o| {
                    o.reply.status == Some(503) && l.limiter_of(o) == 1 && o.reply.sent > after
                }) >= 3
        }),
    )
    .await;

    // billing-0 dies while streams of its accounts run: their settlements
    // go to the durable queue; its accounts' new requests get 503.
    until(
        "streams of billing-0's account in flight",
        Box::new(|l: &Load| l.billing0_streams.load(Ordering::SeqCst) >= 2),
    )
    .await;
    let billing_killed = cluster.kill("billing-0").await;
    let after = billing_killed.done;
    until(
        "answers and 503s with billing-0 down",
        Box::new(move |l: &Load| {
            l.count(|_, o| o.reply.ok() && o.reply.sent > after) >= 40
                && l.count(|l, o| {
                    o.reply.status == Some(503)
                        && l.billing_of(o) == 0
                        && l.limiter_of(o) == 0
                        && o.reply.sent > after
                }) >= 3
        }),
    )
    .await;

    // gateway-1 dies while requests run through it; the load moves to
    // gateway-0.
    until(
        "requests in flight on gateway-1",
        Box::new(|l: &Load| l.gateway1_in_flight.load(Ordering::SeqCst) >= 2),
    )
    .await;
    let gateway_killed = cluster.kill("gateway-1").await;
    load.gateway1_down.store(true, Ordering::SeqCst);
    let diverted = Instant::now();
    until(
        "answers through gateway-0 alone",
        Box::new(move |l: &Load| l.count(|_, o| o.reply.ok() && o.reply.sent > diverted) >= 40),
    )
    .await;
    let down_for = diverted.elapsed();

    // All three come back on their addresses and serve again.
    let limiter_back = cluster.start("limiter-1").await;
    let billing_back = cluster.start("billing-0").await;
    let gateway_back = cluster.start("gateway-1").await;
    load.gateway1_down.store(false, Ordering::SeqCst);
    let back = Instant::now();
    let recovered = until(
        "service from every restarted process",
        Box::new(move |l: &Load| {
            let served = |f: &dyn Fn(&Load, &Outcome) -> bool| {
                l.count(|l, o| o.reply.ok() && o.reply.sent > back && f(l, o))
            };
            served(&|_, o| o.gateway == 1) >= 10
                && served(&|l, o| l.limiter_of(o) == 1) >= 10
                && served(&|l, o| l.billing_of(o) == 0) >= 10
                && served(&|l, o| {
                    l.limiter_of(o) == 1 && l.billing_of(o) == 0 && o.model == LIMITED_MODEL
                }) >= 1
        }),
    )
    .await;
    load.stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.await.unwrap();
    }
    let loaded_for = start.elapsed();
    let timeline = Timeline {
        limiter_killed,
        billing_killed,
        gateway_killed,
        diverted,
        limiter_back,
        billing_back,
    };
    let outcomes = std::mem::take(&mut *load.outcomes.lock().unwrap());
    let total = outcomes.len();
    let ok = outcomes.iter().filter(|o| o.reply.ok()).count();
    let took = |span: Span| span.done.duration_since(span.began);
    println!(
        "cluster: kills: {total} requests in {loaded_for:?} ({ok} answered 200); killed limiter-1, \
         billing-0, gateway-1; {down_for:?} on the survivors; restarts took {:?}, {:?}, {:?}; \
         every restarted process served again {recovered:?} after them",
        took(limiter_back),
        took(billing_back),
        took(gateway_back),
    );
    let queued: usize = ["gateway-0", "gateway-1"]
        .iter()
        .zip(&logs_before)
        .map(|(name, before)| {
            let log = cluster.log(name);
            log.get(*before..)
                .unwrap_or(&log)
                .matches("queueing its usage record")
                .count()
        })
        .sum();
    assert!(
        queued > 0,
        "no settlement went through the durable queue while billing-0 was down"
    );

    explained(&load, &outcomes, &timeline);
    limits_held(&load, &outcomes, &timeline);
    drain(cluster, &load).await;
    charged_exactly_once(cluster, &load, &outcomes, queued).await;
    ledger_reconciled(cluster, &load).await;
}

/// Two accounts (one per billing replica), each with a key per limiter
/// replica, made and credited before anything dies.
async fn prepare(cluster: &Cluster) -> Load {
    let mut payers = Vec::new();
    let mut callers = Vec::new();
    for billing in 0..2 {
        let account = cluster.account_owned_by(0, "kills", billing).await;
        let credited = cluster.credit(1, &account.id, CREDIT_USD, "seed").await;
        assert_eq!(credited["applied"], true);
        for limiter in 0..2 {
            let (_, secret) = cluster.key_owned_by(&account.admin_key, limiter).await;
            callers.push(Caller {
                payer: payers.len(),
                limiter,
                secret,
            });
        }
        payers.push(Payer { account, billing });
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        // A fresh connection per request: none outlives the gateway it went to.
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    Load {
        http,
        urls: (0..2)
            .map(|g| cluster.api(g, "/chat/completions"))
            .collect(),
        callers,
        payers,
        seq: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        gateway1_down: AtomicBool::new(false),
        gateway1_in_flight: AtomicUsize::new(0),
        billing0_streams: AtomicUsize::new(0),
        outcomes: Mutex::new(Vec::new()),
    }
}

/// Whether [sent, answered] of `reply` overlaps [from, to].
fn overlaps(reply: &Reply, from: Instant, to: Instant) -> bool {
    reply.sent <= to && reply.answered.unwrap_or(reply.sent) >= from
}

/// Every outcome but a whole 200 is one the kills explain.
fn explained(load: &Load, outcomes: &[Outcome], t: &Timeline) {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for o in outcomes {
        let r = &o.reply;
        let what = match (r.status, r.complete) {
            (Some(200), true) => "200",
            (Some(429), _) => {
                let message = r.error.as_deref().unwrap_or_default();
                assert!(
                    o.model == LIMITED_MODEL && message.starts_with("Rate limit exceeded"),
                    "a 429 the limits do not explain: {r:?}"
                );
                "429 (rate limit)"
            }
            (Some(503), _) => {
                let limiter_down = load.limiter_of(o) == 1
                    && overlaps(r, t.limiter_killed.began, t.limiter_back.done);
                let billing_down = load.billing_of(o) == 0
                    && overlaps(r, t.billing_killed.began, t.billing_back.done);
                assert!(
                    limiter_down || billing_down,
                    "a 503 no kill explains (limiter-{}, billing-{}): {r:?}",
                    load.limiter_of(o),
                    load.billing_of(o)
                );
                "503 (owner down)"
            }
            // No answer, or an answer cut: only from the killed gateway.
            (None, _) | (Some(200), false) => {
                assert!(
                    o.gateway == 1
                        && o.chosen <= t.diverted
                        && r.finished >= t.gateway_killed.began,
                    "a request failed that no kill explains (gateway-{}): {r:?}",
                    o.gateway
                );
                if r.status.is_none() {
                    "no answer (gateway-1 killed)"
                } else {
                    "cut (gateway-1 killed)"
                }
            }
            _ => panic!("unexpected answer on gateway-{}: {r:?}", o.gateway),
        };
        *counts.entry(what.to_owned()).or_default() += 1;
        // Nobody is admitted while the replica owning them is down.
        if r.status == Some(200) {
            let answered = r.answered.unwrap();
            assert!(
                !(load.limiter_of(o) == 1
                    && r.sent > t.limiter_killed.done
                    && answered < t.limiter_back.began),
                "admitted while its limiter replica was down: {r:?}"
            );
            assert!(
                !(load.billing_of(o) == 0
                    && r.sent > t.billing_killed.done
                    && answered < t.billing_back.began),
                "served while its billing replica was down: {r:?}"
            );
        }
    }
    let mut counts: Vec<_> = counts.into_iter().collect();
    counts.sort();
    println!("cluster: kills: outcomes {counts:?}");
}

/// The most requests of `admitted` (each admitted somewhere in [sent,
/// answered]) that certainly fell within one window: those whose
/// intervals lie within less than the window from the earliest's start.
fn most_in_a_window(admitted: &[&Reply]) -> usize {
    let mut spans: Vec<(Instant, Instant)> = admitted
        .iter()
        .map(|r| (r.sent, r.answered.unwrap()))
        .collect();
    spans.sort();
    (0..spans.len())
        .map(|i| {
            let start = spans[i].0;
            spans[i..]
                .iter()
                .filter(|(_, end)| end.duration_since(start) < WINDOW)
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// No key was admitted more than its limit within any window.
fn limits_held(load: &Load, outcomes: &[Outcome], t: &Timeline) {
    let mut refused = 0;
    let mut busiest = 0;
    for (index, caller) in load.callers.iter().enumerate() {
        let limited: Vec<&Outcome> = outcomes
            .iter()
            .filter(|o| o.caller == index && o.model == LIMITED_MODEL)
            .collect();
        refused += limited
            .iter()
            .filter(|o| o.reply.status == Some(429))
            .count();
        let admitted: Vec<&Reply> = limited
            .iter()
            .map(|o| &o.reply)
            .filter(|r| r.status == Some(200))
            .collect();
        // The lives of the key's limiter replica: one, or for limiter-1 the
        // one before the kill and the one after the restart (it starts from
        // empty windows). A request spanning the whole downtime could be
        // either's: left out.
        let lives: Vec<Vec<&Reply>> = if caller.limiter == 0 {
            vec![admitted]
        } else {
            vec![
                admitted
                    .iter()
                    .copied()
                    .filter(|r| r.answered.unwrap() < t.limiter_back.began)
                    .collect(),
                admitted
                    .iter()
                    .copied()
                    .filter(|r| r.sent > t.limiter_killed.done)
                    .collect(),
            ]
        };
        for life in lives {
            let most = most_in_a_window(&life);
            busiest = busiest.max(most);
            assert!(
                most <= LIMITED_RPM,
                "key {index} (limiter-{}) was admitted {most} times within one {WINDOW:?} window, \
                 over its limit of {LIMITED_RPM}",
                caller.limiter
            );
        }
    }
    assert!(refused > 0, "the load never reached the rate limit");
    println!(
        "cluster: kills: rate limits held (at most {busiest} of {LIMITED_RPM} admissions in any \
         window; {refused} refused)"
    );
}

/// Until the durable usage queue is empty (every queued settlement
/// committed and acknowledged) and no hold of the load's accounts is open
/// (those of requests the killed gateway never settled expire after
/// `hold_ttl_secs`, released without a charge).
async fn drain(cluster: &Cluster, load: &Load) {
    let stream = rialto_core::bus::Bus::in_process(&cluster.bus_prefix)
        .queue_stream(rialto_billing::usage_queue::USAGE_QUEUE);
    let nats = async_nats::connect(cluster.nats.as_str()).await.unwrap();
    let jetstream = async_nats::jetstream::new(nats);
    let queue_drained = wait_until("the usage queue to drain", PHASE, || {
        let jetstream = jetstream.clone();
        let stream = stream.clone();
        async move {
            let mut stream = jetstream.get_stream(&stream).await.unwrap();
            stream.info().await.unwrap().state.messages == 0
        }
    })
    .await;
    let db = sqlx::PgPool::connect(&cluster.database_url).await.unwrap();
    let owners = owners(load);
    let holds_closed = wait_until("the killed gateway's holds to expire", PHASE, || {
        let db = db.clone();
        let owners = owners.clone();
        async move {
            let open: i64 = sqlx::query(
                "SELECT CAST(COUNT(*) AS BIGINT) FROM holds WHERE state = 'open' AND owner = ANY($1)",
            )
            .bind(&owners)
            .fetch_one(&db)
            .await
            .unwrap()
            .get(0);
            open == 0
        }
    })
    .await;
    let expired: i64 = sqlx::query(
        "SELECT CAST(COUNT(*) AS BIGINT) FROM ledger_journal WHERE kind = 'expire' AND owner = ANY($1)",
    )
    .bind(&owners)
    .fetch_one(&db)
    .await
    .unwrap()
    .get(0);
    db.close().await;
    println!(
        "cluster: kills: usage queue empty after {queue_drained:?}, no hold open after a further \
         {holds_closed:?} ({expired} released unsettled when they expired)"
    );
}

fn owners(load: &Load) -> Vec<String> {
    load.payers
        .iter()
        .map(|p| format!("account:{}", p.account.id))
        .collect()
}

/// Every whole 200 charged exactly once, exactly its `cost`; nothing
/// refused charged; the balances dropped by exactly the charges.
async fn charged_exactly_once(cluster: &Cluster, load: &Load, outcomes: &[Outcome], queued: usize) {
    let mut served_total = 0;
    let mut unseen_total = 0;
    for (index, payer) in load.payers.iter().enumerate() {
        let mine: Vec<&Reply> = outcomes
            .iter()
            .filter(|o| load.callers[o.caller].payer == index)
            .map(|o| &o.reply)
            .collect();
        let mut charges: HashMap<String, Vec<i64>> = HashMap::new();
        // Read through the gateway that was killed and restarted.
        for (id, amount) in cluster.usage(1, &payer.account.admin_key).await {
            charges.entry(id).or_default().push(amount);
        }
        let mut known = HashSet::new();
        let mut served = 0;
        let mut unseen = 0; // charged, but the client saw no whole answer
        for reply in &mine {
            let Some(id) = &reply.request_id else {
                continue;
            };
            known.insert(id.clone());
            let charged = charges.get(id).cloned().unwrap_or_default();
            if reply.ok() {
                let cost = reply.cost.expect("a whole answer reports its cost");
                assert_eq!(
                    charged,
                    [cost],
                    "request {id} answered 200 with cost {cost} nano-dollars"
                );
                served += cost;
            } else if reply.status == Some(200) {
                // Cut by the gateway's death: charged once at most.
                assert!(charged.len() <= 1, "request {id} charged {charged:?}");
                unseen += charged.iter().sum::<i64>();
            } else {
                assert!(
                    charged.is_empty(),
                    "request {id} was refused ({:?}) but charged {charged:?}",
                    reply.status
                );
            }
        }
        // Charges of requests the client got no answer from at all: only
        // ones the killed gateway was serving, each once.
        let unanswered = mine.iter().filter(|r| r.status.is_none()).count();
        let strangers: Vec<(&String, &Vec<i64>)> = charges
            .iter()
            .filter(|(id, _)| !known.contains(*id))
            .collect();
        assert!(
            strangers.len() <= unanswered && strangers.iter().all(|(_, c)| c.len() == 1),
            "charges of unknown requests {strangers:?} ({unanswered} requests got no answer)"
        );
        unseen += strangers.iter().map(|(_, c)| c[0]).sum::<i64>();
        let balance = cluster.balance(index, &payer.account.admin_key).await;
        assert!(balance >= 0);
        let charged: i64 = charges.values().flatten().sum();
        assert_eq!(
            CREDIT - balance,
            charged,
            "the balance of account {index} (billing-{}) dropped by other than its charges",
            payer.billing
        );
        assert_eq!(CREDIT - balance, served + unseen);
        served_total += served;
        unseen_total += unseen;
    }
    println!(
        "cluster: kills: every 200 charged exactly once ({} nano-dollars; {queued} settled through \
         the durable queue), nothing refused charged, {} nano-dollars charged for answers lost \
         with gateway-1",
        served_total, unseen_total
    );
}

/// The ledger itself: each account's balance is the sum of its journal,
/// nothing is held.
async fn ledger_reconciled(cluster: &Cluster, load: &Load) {
    let db = sqlx::PgPool::connect(&cluster.database_url).await.unwrap();
    for owner in owners(load) {
        let row = sqlx::query(
            "SELECT l.usd_nanos, l.usd_held_nanos, \
             (SELECT CAST(SUM(usd_nanos) AS BIGINT) FROM ledger_journal j WHERE j.owner = l.owner), \
             (SELECT CAST(COALESCE(SUM(amount_nanos), 0) AS BIGINT) FROM usage_records u \
              WHERE u.owner = l.owner) \
             FROM ledgers l WHERE l.owner = $1",
        )
        .bind(&owner)
        .fetch_one(&db)
        .await
        .unwrap();
        let (usd, held, journal, usage): (i64, i64, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        assert_eq!((held, journal), (0, usd), "{owner}");
        assert_eq!(CREDIT - usd, usage, "{owner}");
    }
    db.close().await;
}
