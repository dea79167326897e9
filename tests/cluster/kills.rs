//! The faults. Eight clients load the cluster without pause over both
//! gateways (plain and streamed chats, both models, four keys: one per
//! account and limiter replica, two accounts: one per billing replica).
//! Mid-load each limiter and each billing replica in turn is killed with
//! SIGKILL and started again (gateway-1 too, while limiter-1 is learning
//! its windows back), then billing-0 and limiter-0 are each hung with
//! SIGSTOP for 10 s and let go (SIGCONT), and last both billing replicas
//! are killed at once (no successor: the durable usage queue keeps the
//! settlements until they are back).
//! A replica's principals move to the next live replica within the
//! detection window (`failover.dead_after_ms`) and back once it is up
//! again. Afterwards, once the durable usage queue is empty and expired
//! holds are swept:
//!
//! - 503s only for requests sent within `DETECTION` of a fault, by the
//!   callers whose replica it hit (with both billing replicas down, until
//!   they are back); none after, none at a hand-back (the longest gap per
//!   fault is printed): a request caught by a replica's death waits for
//!   the detection and is served by the next replica;
//! - every request answered 200 in full was charged exactly once, exactly
//!   its `cost.usd`, whether billing settled it at once or from the queue;
//! - no request refused before a backend answered (429, 503) was charged;
//!   the only requests charged without a 200 the client read are ones the
//!   killed gateway was serving (their answers died with it);
//! - each account's balance dropped by exactly the sum of its charges
//!   (usage history, over HTTP) and the ledger's journal adds up to it
//!   (PostgreSQL), with nothing left held;
//! - no key was ever admitted more than its limit in any window, over the
//!   whole run: a successor decides from the windows it heard, and a
//!   replica that comes back owns again only after a whole window;
//! - each restarted or resumed replica serves its principals again, and
//!   the gateways count it ready (`rialto_replica_up` 2).

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
    stream: bool,
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
    /// Streams in flight of the accounts of each billing replica.
    billing_streams: [AtomicUsize; 2],
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
            let _streaming =
                stream.then(|| InFlight::new(&load.billing_streams[load.payers[payer].billing]));
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
            stream,
            reply,
        });
        if refused {
            // Pacing, not synchronisation: refusals come back at once, and
            // eight clients spinning on them would only load the machine.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// How long after a fault a request may still be refused (503): the
/// issue's bound on detection. The cluster's `failover.dead_after_ms` is
/// 1.5 s, and the gateways recompute who is live every 50 ms.
const DETECTION: Duration = Duration::from_secs(2);

/// Which service a fault hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Service {
    Limiter,
    Billing,
    Gateway,
}

/// One fault injected: when, and when its process was back.
struct Fault {
    process: &'static str,
    service: Service,
    index: usize,
    /// SIGSTOP rather than SIGKILL.
    hung: bool,
    at: Span,
    back: Span,
    /// From its return until it served its principals again.
    taken_back: Duration,
}

impl Fault {
    /// Whether the fault hit the replica owning `outcome`'s principal.
    fn hits(&self, load: &Load, outcome: &Outcome) -> bool {
        match self.service {
            Service::Limiter => load.limiter_of(outcome) == self.index,
            Service::Billing => self.index == ALL || load.billing_of(outcome) == self.index,
            Service::Gateway => outcome.gateway == self.index,
        }
    }

    /// Until when a request sent may be refused: the detection window
    /// after the fault, or with every replica down (no successor), after
    /// they are back.
    fn refusals_until(&self) -> Instant {
        let from = if self.index == ALL {
            self.back.done
        } else {
            self.at.done
        };
        from + DETECTION
    }

    fn describe(&self) -> String {
        format!(
            "{} {}",
            if self.hung { "SIGSTOP" } else { "SIGKILL" },
            self.process
        )
    }
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

    let mut faults = Vec::new();
    for (process, service, index) in [
        ("limiter-1", Service::Limiter, 1),
        ("limiter-0", Service::Limiter, 0),
        ("billing-0", Service::Billing, 0),
        ("billing-1", Service::Billing, 1),
    ] {
        if service == Service::Billing {
            // Streams of its account in flight: their settlements fail
            // over to the durable queue.
            until(
                "streams of the replica's account in flight",
                Box::new(move |l: &Load| l.billing_streams[index].load(Ordering::SeqCst) >= 2),
            )
            .await;
        }
        let at = cluster.kill(process).await;
        served_through(&until, service, index, at.done).await;
        let back = cluster.start(process).await;
        if process == "limiter-1" {
            // gateway-1 dies and starts again while limiter-1 learns its
            // windows back: new, it must take limiter-1's word (its
            // heartbeat's run) that it is not ready yet.
            faults.push(kill_gateway(cluster, &load, &until).await);
        }
        let taken_back = taken_back(cluster, process, service, index, back.done).await;
        faults.push(Fault {
            process,
            service,
            index,
            hung: false,
            at,
            back,
            taken_back,
        });
    }

    // billing-0, then limiter-0, hang for 10 s: counted dead, their
    // principals move; resumed, billing-0 reads its ledgers again before
    // deciding, and each takes its principals back after its rejoin delay.
    for (process, service, index) in [
        ("billing-0", Service::Billing, 0),
        ("limiter-0", Service::Limiter, 0),
    ] {
        if service == Service::Billing {
            until(
                "streams of billing-0's account in flight",
                Box::new(|l: &Load| l.billing_streams[0].load(Ordering::SeqCst) >= 2),
            )
            .await;
        }
        let at = cluster.pause(process).await;
        served_through(&until, service, index, at.done).await;
        tokio::time::sleep(HUNG.saturating_sub(at.done.elapsed())).await;
        let back = cluster.resume(process).await;
        let taken_back = taken_back(cluster, process, service, index, back.done).await;
        faults.push(Fault {
            process,
            service,
            index,
            hung: true,
            at,
            back,
            taken_back,
        });
    }

    // Both billing replicas die at once: no successor, so the holds are
    // refused (503) until they are back, and the settlements of the streams
    // in flight wait in the durable queue and are charged once after.
    until(
        "streams in flight",
        Box::new(|l: &Load| {
            l.billing_streams[0].load(Ordering::SeqCst)
                + l.billing_streams[1].load(Ordering::SeqCst)
                >= 2
        }),
    )
    .await;
    let began = cluster.kill("billing-0").await.began;
    let done = cluster.kill("billing-1").await.done;
    until(
        "503s with no billing replica",
        Box::new(move |l: &Load| {
            l.count(|_, o| o.reply.status == Some(503) && o.reply.sent > done) >= 5
        }),
    )
    .await;
    let restarted = cluster.start("billing-0").await.began;
    let back = cluster.start("billing-1").await.done;
    let mut taken_back_after = Duration::ZERO;
    for (process, index) in [("billing-0", 0), ("billing-1", 1)] {
        let took = taken_back(cluster, process, Service::Billing, index, back).await;
        taken_back_after = taken_back_after.max(took);
    }
    faults.push(Fault {
        process: "billing-0 and billing-1",
        service: Service::Billing,
        index: ALL,
        hung: false,
        at: Span { began, done },
        back: Span {
            began: restarted,
            done: back,
        },
        taken_back: taken_back_after,
    });

    load.stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.await.unwrap();
    }
    let loaded_for = start.elapsed();
    let outcomes = std::mem::take(&mut *load.outcomes.lock().unwrap());
    let total = outcomes.len();
    let ok = outcomes.iter().filter(|o| o.reply.ok()).count();
    println!(
        "cluster: kills: {total} requests in {loaded_for:?} ({ok} answered 200); faults: {}",
        faults
            .iter()
            .map(|f| format!(
                "{} (back after {:?})",
                f.describe(),
                f.back.done - f.at.began
            ))
            .collect::<Vec<_>>()
            .join(", ")
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
        "no settlement went through the durable queue while billing was down"
    );

    let per_fault = explained(&load, &outcomes, &faults);
    let (busiest, rate_limited) = limits_held(&load, &outcomes);
    drain(cluster, &load).await;
    charged_exactly_once(cluster, &load, &outcomes, queued).await;
    ledger_reconciled(cluster, &load).await;

    // The figures, for BENCHMARKS.md (bench/run.py --only failover).
    if let Ok(path) = std::env::var("RIALTO_CLUSTER_JSON") {
        let ms = |d: Duration| d.as_millis() as u64;
        let figures = json!({
            "clients": WORKERS,
            "requests": total,
            "ok": ok,
            "seconds": loaded_for.as_secs_f64(),
            "queued_settlements": queued,
            "limit": LIMITED_RPM,
            "window_secs": WINDOW.as_secs(),
            "busiest_window": busiest,
            "over_admissions": busiest.saturating_sub(LIMITED_RPM),
            "rate_limited": rate_limited,
            "detection_bound_ms": ms(DETECTION),
            "faults": faults.iter().zip(&per_fault).map(|(f, figures)| json!({
                "fault": f.describe(),
                "back_after_ms": ms(f.back.done - f.at.began),
                "taken_back_after_ms": ms(f.taken_back),
                "refused": figures.refused,
                "last_refused_sent_after_ms": ms(figures.last_refused),
                "first_served_sent_after_ms": ms(figures.first_served),
                "longest_wait_ms": ms(figures.longest_wait),
            })).collect::<Vec<_>>(),
        });
        std::fs::write(&path, serde_json::to_vec_pretty(&figures).unwrap()).unwrap();
    }
}

/// What one fault cost the load.
#[derive(Debug, Default, Clone, Copy)]
struct FaultFigures {
    /// Requests of its principals refused (503).
    refused: usize,
    /// The latest such request, sent this long after the fault.
    last_refused: Duration,
    /// The first request of its principals sent after it and served.
    first_served: Duration,
    /// The longest a request of its principals that was served took to its
    /// whole answer (a stream's own half second included), among those
    /// running from the fault to the end of its detection window: the
    /// wait for the next replica.
    longest_wait: Duration,
}

/// A fault's `index` when it hit every replica of its service.
const ALL: usize = usize::MAX;

/// How long a hung replica stays stopped.
const HUNG: Duration = Duration::from_secs(10);

/// gateway-1 dies while requests run through it; the load moves to
/// gateway-0, then comes back to gateway-1 once it is restarted.
async fn kill_gateway<F, Fut>(cluster: &Cluster, load: &Load, until: &F) -> Fault
where
    F: Fn(&'static str, Box<dyn Fn(&Load) -> bool + Send + Sync>) -> Fut,
    Fut: std::future::Future<Output = Duration>,
{
    until(
        "requests in flight on gateway-1",
        Box::new(|l: &Load| l.gateway1_in_flight.load(Ordering::SeqCst) >= 2),
    )
    .await;
    let at = cluster.kill("gateway-1").await;
    load.gateway1_down.store(true, Ordering::SeqCst);
    let diverted = Instant::now();
    until(
        "answers through gateway-0 alone",
        Box::new(move |l: &Load| l.count(|_, o| o.reply.ok() && o.reply.sent > diverted) >= 40),
    )
    .await;
    let back = cluster.start("gateway-1").await;
    load.gateway1_down.store(false, Ordering::SeqCst);
    let returned = back.done;
    until(
        "answers through the restarted gateway-1",
        Box::new(move |l: &Load| {
            l.count(|_, o| o.reply.ok() && o.gateway == 1 && o.reply.sent > returned) >= 10
        }),
    )
    .await;
    Fault {
        process: "gateway-1",
        service: Service::Gateway,
        index: 1,
        hung: false,
        at,
        back,
        taken_back: returned.elapsed(),
    }
}

/// Until 20 requests of the principals of `service`'s replica `index`,
/// sent after `after`, were answered 200: another replica serves them.
async fn served_through<F, Fut>(until: &F, service: Service, index: usize, after: Instant)
where
    F: Fn(&'static str, Box<dyn Fn(&Load) -> bool + Send + Sync>) -> Fut,
    Fut: std::future::Future<Output = Duration>,
{
    let what = match service {
        Service::Limiter => "its keys served by the next limiter replica",
        _ => "its accounts served by the next billing replica",
    };
    until(
        what,
        Box::new(move |l: &Load| {
            l.count(|l, o| {
                o.reply.ok()
                    && o.reply.sent > after
                    && match service {
                        Service::Limiter => l.limiter_of(o) == index,
                        Service::Billing => l.billing_of(o) == index,
                        Service::Gateway => o.gateway == index,
                    }
            }) >= 20
        }),
    )
    .await;
}

/// Until the replica `process`, back since `back`, serves its principals
/// again (its own count of admissions or holds grew by 10) and both
/// gateways count it ready.
async fn taken_back(
    cluster: &Cluster,
    process: &'static str,
    service: Service,
    index: usize,
    back: Instant,
) -> Duration {
    let (name, method, address) = match service {
        Service::Limiter => (
            "limiter",
            "/rialto.limiter.v1.Limiter/Admit",
            &cluster.limiters[index],
        ),
        _ => (
            "billing",
            "/rialto.billing.v1.Billing/Hold",
            &cluster.billing[index],
        ),
    };
    let series =
        format!("rialto_grpc_requests_total{{service=\"{name}\",method=\"{method}\",code=\"OK\"}}");
    let ready = format!("rialto_replica_up{{service=\"{name}\",replica=\"{address}\"}}");
    let before = cluster.metric(process, &series).await.unwrap_or(0.0);
    wait_until("the replica to take its principals back", PHASE, || {
        let (series, ready) = (series.clone(), ready.clone());
        async move {
            let served = cluster.metric(process, &series).await.unwrap_or(0.0);
            let mut counted = served >= before + 10.0;
            for gateway in ["gateway-0", "gateway-1"] {
                counted &= cluster.metric(gateway, &ready).await == Some(2.0);
            }
            counted
        }
    })
    .await;
    let took = back.elapsed();
    println!("cluster: kills: {process} serves its principals again {took:?} after it was back");
    took
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
        billing_streams: [AtomicUsize::new(0), AtomicUsize::new(0)],
        outcomes: Mutex::new(Vec::new()),
    }
}

/// Each fault and when it began and was over, for a failure's message.
fn timeline(faults: &[Fault]) -> Vec<(String, Instant, Instant)> {
    faults
        .iter()
        .map(|f| (f.describe(), f.at.began, f.back.done))
        .collect()
}

/// Every outcome but a whole 200 is one a fault explains: a 503 for a
/// request sent within `DETECTION` of a fault on its replica (and the
/// longest such gap per fault is reported), a lost or cut answer from the
/// killed gateway.
fn explained(load: &Load, outcomes: &[Outcome], faults: &[Fault]) -> Vec<FaultFigures> {
    let mut counts: HashMap<String, usize> = HashMap::new();
    // Per fault: the requests it refused and the latest one sent.
    let mut refused: Vec<(usize, Duration)> = vec![(0, Duration::ZERO); faults.len()];
    let gateway_fault = faults
        .iter()
        .find(|f| f.service == Service::Gateway)
        .expect("gateway-1 was killed");
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
                let answered = r.answered.unwrap_or(r.finished);
                let cause = faults.iter().position(|f| {
                    f.service != Service::Gateway
                        && f.hits(load, o)
                        && answered >= f.at.began
                        && r.sent <= f.refusals_until()
                });
                let Some(cause) = cause else {
                    panic!(
                        "a 503 no fault explains within {DETECTION:?} (limiter-{}, billing-{}): \
                         {r:?}; faults at {:?}",
                        load.limiter_of(o),
                        load.billing_of(o),
                        timeline(faults)
                    );
                };
                let entry = &mut refused[cause];
                entry.0 += 1;
                entry.1 = entry
                    .1
                    .max(r.sent.saturating_duration_since(faults[cause].at.began));
                "503 (replica down, before its successor took over)"
            }
            // No answer, or an answer cut: only from the killed gateway.
            (None, _) | (Some(200), false) => {
                let f = gateway_fault;
                assert!(
                    o.gateway == 1 && o.chosen <= f.back.began && r.finished >= f.at.began,
                    "a request failed that no fault explains (gateway-{}, limiter-{}, billing-{}, \
                     {}, streamed: {}): {r:?}; faults at {:?}",
                    o.gateway,
                    load.limiter_of(o),
                    load.billing_of(o),
                    o.model,
                    o.stream,
                    timeline(faults)
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
    }
    let mut counts: Vec<_> = counts.into_iter().collect();
    counts.sort();
    println!("cluster: kills: outcomes {counts:?}");
    let mut figures = Vec::new();
    for (fault, (count, latest)) in faults.iter().zip(&refused) {
        if fault.service == Service::Gateway {
            figures.push(FaultFigures::default());
            continue;
        }
        // The first request of the fault's principals sent after it and
        // answered 200: how long they could not be served.
        let first_served = outcomes
            .iter()
            .filter(|o| o.reply.ok() && fault.hits(load, o) && o.reply.sent >= fault.at.done)
            .map(|o| o.reply.sent.saturating_duration_since(fault.at.began))
            .min()
            .unwrap_or_default();
        let longest_wait = outcomes
            .iter()
            .filter(|o| {
                o.reply.ok()
                    && fault.hits(load, o)
                    && o.reply.answered.unwrap_or(o.reply.sent) >= fault.at.began
                    && o.reply.sent <= fault.at.done + DETECTION
            })
            .map(|o| o.reply.finished - o.reply.sent)
            .max()
            .unwrap_or_default();
        println!(
            "cluster: kills: {}: {count} requests refused (503), the last sent {latest:?} after \
             the fault; its principals served again by a request sent {first_served:?} after it; \
             a served request waited at most {longest_wait:?}",
            fault.describe()
        );
        figures.push(FaultFigures {
            refused: *count,
            last_refused: *latest,
            first_served,
            longest_wait,
        });
    }
    figures
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

/// No key was admitted more than its limit within any window, over the
/// whole run: through every failover and hand-back.
fn limits_held(load: &Load, outcomes: &[Outcome]) -> (usize, usize) {
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
        let most = most_in_a_window(&admitted);
        busiest = busiest.max(most);
        assert!(
            most <= LIMITED_RPM,
            "key {index} (limiter-{}) was admitted {most} times within one {WINDOW:?} window, \
             over its limit of {LIMITED_RPM}",
            caller.limiter
        );
    }
    assert!(refused > 0, "the load never reached the rate limit");
    println!(
        "cluster: kills: rate limits held through every fault (at most {busiest} of \
         {LIMITED_RPM} admissions in any window, 0 over; {refused} refused)"
    );
    (busiest, refused)
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
                // Once, or (a stream whose hold expired at its checkpoint
                // before its usage record arrived) its checkpoint and then
                // the rest: exactly its cost either way.
                assert!(
                    !charged.is_empty()
                        && charged.len() <= 2
                        && charged.iter().sum::<i64>() == cost,
                    "request {id} answered 200 with cost {cost} nano-dollars, charged {charged:?}"
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
