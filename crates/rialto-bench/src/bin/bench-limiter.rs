//! `bench-limiter`: what one rate-limit decision costs, in process.
//!
//! Runs the real limiter of `rialto serve` (a [`LocalLimiter`]: the windows
//! of every principal in a sharded map of mutexes, decided in place on the
//! caller's thread; a temporary SQLite database for the rate-limit log, the
//! in-process bus) behind the [`RateLimiter`] the gateway calls, inside an
//! actix `System` on a multi-thread Tokio runtime with one worker per core
//! (as in `rialto serve`), and measures:
//!
//! - `window`: [`Window::admit`] on one thread, the data structure alone,
//!   with a simulated clock (one decision per millisecond in a 60 s window:
//!   60,000 live entries, expiring as fast as they are added);
//!   `window_with_state` adds the `state` read the limiter makes after each
//!   decision;
//! - `many_keys`: [`RateLimiter::admit`] (policy, shard lock, decision) from
//!   `--concurrency` tasks over `--keys` principals; `many_keys_commit`
//!   commits each admission too (applied in place), as a request does;
//! - `one_key`: the same tasks all on one principal, so every decision
//!   takes the same shard's lock;
//! - `c1`: one task, admissions back to back, with the latency of each.
//!
//! Limits are far above the offered load, so everything is admitted (a
//! refusal would be counted and reported). Rates are per second of wall
//! time; `per_core_per_s` divides by the runtime's workers
//! (`available_parallelism`). Prints one JSON object.

use std::fmt::Write as _;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use hdrhistogram::Histogram;
use rialto_core::bus::Bus;
use rialto_core::config::Limit;
use rialto_core::db::{Database, now_ms};
use rialto_core::{Config, ModelConfig};
use rialto_limiter::policy::to_pb;
use rialto_limiter::window::Window;
use rialto_limiter::{Caller, LimiterClient, LocalLimiter, RateLimiter, Target};
use serde_json::{Value, json};

#[derive(Parser)]
#[command(about = "Cost of one rate-limit decision: the window alone and through the limiter")]
struct Cli {
    /// Seconds measured per scenario.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Seconds of the same load before each measurement.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Concurrent tasks in the throughput scenarios.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Principals (API keys) in the many-keys scenarios.
    #[arg(long, default_value_t = 10_000)]
    keys: usize,
}

/// The limiter's configuration: the default 60 s window, and an `XS` limit
/// in the standard tier far above anything this program can offer.
const CONFIG: &str = r#"
[limits.tiers.standard]
XS = { rpm = 1000000000000, tpm = 1000000000000000000 }
[[models]]
id = "bench-model"
tier = "XS"
"#;

/// Tokens each admission reserves: what the gateway estimates for the
/// benchmark's chat request (a 20-character prompt and the default
/// completion budget of 1024).
const ESTIMATE: u64 = 1029;
/// Tokens each commit reports.
const USED: u64 = 24;

#[derive(Clone, Copy)]
struct Timing {
    warmup: Duration,
    measured: Duration,
}

/// One thread, no limiter around it: `Window::admit` (and optionally `state`) with a
/// simulated clock advancing 1 ms per decision.
fn window_decisions(timing: Timing, with_state: bool) -> Value {
    let limit = to_pb(Limit {
        rpm: 1_000_000_000_000,
        tpm: Some(1_000_000_000_000_000_000),
        rpd: None,
    });
    let mut window = Window::new(60_000);
    let mut now = now_ms();
    let mut tag = 0u64;
    let mut refused = 0u64;
    let mut step = |count: u64, refused: &mut u64| {
        for _ in 0..count {
            now += 1;
            tag += 1;
            let decision = window.admit(now, black_box(&limit), black_box(ESTIMATE), tag);
            *refused += u64::from(decision.is_err());
            if with_state {
                black_box(window.state(now, &limit));
            }
        }
    };
    let warm_until = Instant::now() + timing.warmup;
    let mut ignored = 0;
    while Instant::now() < warm_until {
        step(4096, &mut ignored);
    }
    let begin = Instant::now();
    let end = begin + timing.measured;
    let mut decisions = 0u64;
    while Instant::now() < end {
        step(4096, &mut refused);
        decisions += 4096;
    }
    let elapsed = begin.elapsed().as_secs_f64();
    json!({
        "decisions": decisions,
        "refused": refused,
        "per_s": (decisions as f64 / elapsed).round(),
        "ns_per_decision": round1(elapsed * 1e9 / decisions.max(1) as f64),
    })
}

/// The principals of the many-keys scenarios: (account id, key id).
type Keys = Arc<Vec<(String, String)>>;

struct Tally {
    decisions: u64,
    refused: u64,
    errors: u64,
    latency_ns: Histogram<u64>,
}

/// `tasks` tasks admitting back to back; task `t`'s `i`-th request goes to
/// key `(t + i * tasks) % keys`. With `latency`, each decision is timed.
async fn actor_decisions(
    rate: &RateLimiter,
    model: &Arc<ModelConfig>,
    keys: &Keys,
    tasks: usize,
    commit: bool,
    timing: Timing,
) -> anyhow::Result<Tally> {
    let begin = Instant::now() + timing.warmup;
    let end = begin + timing.measured;
    let mut handles = Vec::with_capacity(tasks);
    for task in 0..tasks.max(1) {
        let (rate, model, keys) = (rate.clone(), model.clone(), keys.clone());
        handles.push(tokio::spawn(async move {
            let mut tally = Tally {
                decisions: 0,
                refused: 0,
                errors: 0,
                latency_ns: Histogram::new_with_bounds(1, 60_000_000_000, 3)?,
            };
            let mut request_id = String::with_capacity(32);
            let mut index = task % keys.len().max(1);
            let mut i = 0u64;
            loop {
                let (account_id, key_id) = keys.get(index).context("no keys")?;
                index = (index + tasks) % keys.len();
                i += 1;
                request_id.clear();
                write!(request_id, "bench-{task}-{i}")?;
                let caller = Caller {
                    account_id,
                    key_id,
                    tier: "standard",
                };
                let started = Instant::now();
                let admission = rate
                    .admit(caller, Target::model(&model), &request_id, ESTIMATE)
                    .await;
                let finished = Instant::now();
                if finished >= end {
                    break;
                }
                let measured = started >= begin;
                match admission {
                    Ok(admission) => {
                        if measured {
                            tally.decisions += 1;
                            tally.refused += u64::from(admission.refusal.is_some());
                            let ns = u64::try_from((finished - started).as_nanos())
                                .unwrap_or(u64::MAX)
                                .max(1);
                            let _ = tally.latency_ns.record(ns);
                        }
                        if commit {
                            rate.commit(admission.ticket, USED);
                        }
                    }
                    Err(_) if measured => tally.errors += 1,
                    Err(_) => {}
                }
            }
            anyhow::Ok(tally)
        }));
    }
    let mut total = Tally {
        decisions: 0,
        refused: 0,
        errors: 0,
        latency_ns: Histogram::new_with_bounds(1, 60_000_000_000, 3)?,
    };
    for handle in handles {
        let tally = handle.await??;
        total.decisions += tally.decisions;
        total.refused += tally.refused;
        total.errors += tally.errors;
        total.latency_ns.add(&tally.latency_ns)?;
    }
    Ok(total)
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn throughput(tally: &Tally, tasks: usize, keys: usize, timing: Timing, cores: usize) -> Value {
    let per_s = tally.decisions as f64 / timing.measured.as_secs_f64();
    json!({
        "tasks": tasks,
        "keys": keys,
        "decisions": tally.decisions,
        "refused": tally.refused,
        "errors": tally.errors,
        "per_s": per_s.round(),
        "per_core_per_s": (per_s / cores as f64).round(),
        "latency_ns": latency(&tally.latency_ns),
    })
}

fn latency(h: &Histogram<u64>) -> Value {
    json!({
        "p50": h.value_at_quantile(0.50),
        "p90": h.value_at_quantile(0.90),
        "p99": h.value_at_quantile(0.99),
        "p999": h.value_at_quantile(0.999),
        "max": h.max(),
        "mean": round1(h.mean()),
    })
}

/// A folder for the rate-limit log's SQLite file, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos();
        let path = std::env::temp_dir().join(format!(
            "rialto-bench-limiter-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn run(cli: &Cli, timing: Timing, cores: usize) -> anyhow::Result<Value> {
    let config = Config::from_toml(CONFIG)?;
    let model = Arc::new(
        config
            .model("bench-model")
            .context("the bench model is missing")?
            .clone(),
    );
    let dir = TempDir::new()?;
    let url = format!("sqlite://{}/limiter.db", dir.0.display());
    let db = Database::connect(&url, 2).await?;
    let bus = Bus::in_process("bench");
    let local = LocalLimiter::start(&config, db, bus.clone()).await?;
    let rate = RateLimiter::new(
        &config,
        vec![("local".to_owned(), LimiterClient::new(local))],
        Some(bus),
    );
    let keys: Keys = Arc::new(
        (0..cli.keys.max(1))
            .map(|i| (format!("bench-account-{i}"), format!("bench-key-{i}")))
            .collect(),
    );
    let hot: Keys = Arc::new(vec![("bench-hot".to_owned(), "bench-hot".to_owned())]);
    let tasks = cli.concurrency.max(1);

    let many = actor_decisions(&rate, &model, &keys, tasks, false, timing).await?;
    let many_commit = actor_decisions(&rate, &model, &keys, tasks, true, timing).await?;
    let one = actor_decisions(&rate, &model, &hot, tasks, false, timing).await?;
    let c1 = actor_decisions(&rate, &model, &keys, 1, true, timing).await?;
    drop(dir);
    Ok(json!({
        "many_keys": throughput(&many, tasks, keys.len(), timing, cores),
        "many_keys_commit": throughput(&many_commit, tasks, keys.len(), timing, cores),
        "one_key": throughput(&one, tasks, 1, timing, cores),
        "c1": throughput(&c1, 1, keys.len(), timing, cores),
    }))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    anyhow::ensure!(
        cli.seconds > 0.0 && cli.warmup >= 0.0,
        "--seconds must be positive and --warmup not negative"
    );
    let timing = Timing {
        warmup: Duration::from_secs_f64(cli.warmup),
        measured: Duration::from_secs_f64(cli.seconds),
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());

    let window = window_decisions(timing, false);
    let window_with_state = window_decisions(timing, true);

    // As `rialto serve` runs it: actix's System on a multi-thread runtime.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .enable_all()
        .build()?;
    let system = actix_rt::System::with_tokio_rt(move || runtime);
    let actors = system.block_on(async {
        let actors = run(&cli, timing, cores).await;
        actix_rt::System::current().stop();
        actors
    })?;

    let mut report = json!({
        "cores": cores,
        "seconds": cli.seconds,
        "warmup_s": cli.warmup,
        "window": window,
        "window_with_state": window_with_state,
    });
    if let (Some(report), Some(actors)) = (report.as_object_mut(), actors.as_object()) {
        report.extend(actors.clone());
    }
    println!("{report}");
    Ok(())
}
