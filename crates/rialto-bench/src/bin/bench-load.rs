//! `bench-load`: a load generator with HDR histograms.
//!
//! - `closed`: N workers, each sending its next request when the previous
//!   answer is in; measures latency and throughput at a fixed concurrency.
//! - `open`: requests are due at a fixed rate (the i-th at `start + i/rate`)
//!   and spread over a pool of connections; latency counts from when a request
//!   was *due* whenever it could not be sent on time, so a server that falls
//!   behind shows its queueing instead of slowing the generator down (no
//!   coordinated omission).
//! - `stream`: N workers each running streamed requests back to back;
//!   measures time to first body chunk (first token) and total stream time.
//!   With `--spread`, the workers' first streams begin evenly over that
//!   many seconds: N streams then stay open with openings spread out, as
//!   N clients arriving independently would keep them, instead of N opening
//!   together whenever the last N end (streams of one length stay in step).
//!
//! Prints one JSON object with the counts and latency percentiles in µs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

#[derive(Parser)]
#[command(about = "Load generator with HDR histograms (closed, open-loop, streaming)")]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Fixed concurrency.
    Closed {
        #[command(flatten)]
        target: Target,
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
    },
    /// Fixed request rate.
    Open {
        #[command(flatten)]
        target: Target,
        /// Requests per second.
        #[arg(long)]
        rate: f64,
        /// Connections the requests are spread over.
        #[arg(long, default_value_t = 64)]
        connections: usize,
    },
    /// Concurrent streams, back to back.
    Stream {
        #[command(flatten)]
        target: Target,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        /// Seconds over which the workers' first streams begin, evenly
        /// (worker i at i/N of it); about one stream's length keeps the
        /// openings spread out. 0: all begin at once.
        #[arg(long, default_value_t = 0.0)]
        spread: f64,
    },
}

#[derive(Args, Clone)]
struct Target {
    /// Full URL, e.g. http://127.0.0.1:8080/api/v1/chat/completions.
    #[arg(long)]
    url: String,
    /// Request body (POST); GET without one.
    #[arg(long)]
    body: Option<String>,
    /// Extra header, `Name: value`; repeatable.
    #[arg(long = "header")]
    headers: Vec<String>,
    /// Seconds measured.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Seconds of load before measuring starts.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
}

/// What each worker needs to build a request.
struct Template {
    authority: String,
    addr: String,
    path: String,
    body: Option<Bytes>,
    headers: Vec<(String, String)>,
}

impl Template {
    fn new(target: &Target) -> anyhow::Result<Self> {
        let uri: hyper::Uri = target.url.parse().context("--url")?;
        if uri.scheme_str() != Some("http") {
            bail!("only http:// URLs are supported");
        }
        let authority = uri.authority().context("--url has no host")?.to_string();
        let headers = target
            .headers
            .iter()
            .map(|h| {
                let (name, value) = h
                    .split_once(':')
                    .context("--header must be `Name: value`")?;
                Ok((name.trim().to_owned(), value.trim().to_owned()))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self {
            addr: authority.clone(),
            authority,
            path: uri.path_and_query().map_or("/".into(), |p| p.to_string()),
            body: target.body.clone().map(Bytes::from),
            headers,
        })
    }

    fn request(&self) -> anyhow::Result<Request<Full<Bytes>>> {
        let mut builder = Request::builder()
            .method(if self.body.is_some() { "POST" } else { "GET" })
            .uri(&self.path)
            .header("host", &self.authority);
        if self.body.is_some() {
            builder = builder.header("content-type", "application/json");
        }
        for (name, value) in &self.headers {
            builder = builder.header(name, value);
        }
        Ok(builder.body(Full::new(self.body.clone().unwrap_or_default()))?)
    }

    async fn connect(&self) -> anyhow::Result<SendRequest<Full<Bytes>>> {
        let stream = tokio::net::TcpStream::connect(&self.addr).await?;
        stream.set_nodelay(true)?;
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        Ok(sender)
    }
}

/// One exchange: time to the first body chunk and to the end, or an error.
struct Timing {
    first: Duration,
    total: Duration,
}

async fn exchange(
    template: &Template,
    sender: &mut Option<SendRequest<Full<Bytes>>>,
) -> anyhow::Result<Timing> {
    if sender.as_ref().is_none_or(|s| s.is_closed()) {
        *sender = Some(template.connect().await?);
    }
    let Some(connection) = sender.as_mut() else {
        bail!("no connection");
    };
    connection.ready().await?;
    let started = Instant::now();
    let response = connection.send_request(template.request()?).await;
    let response = match response {
        Ok(response) => response,
        Err(error) => {
            *sender = None;
            return Err(error.into());
        }
    };
    let ok = response.status().is_success();
    let mut body = response.into_body();
    let mut first = None;
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        if first.is_none() && frame.data_ref().is_some_and(|d| !d.is_empty()) {
            first = Some(started.elapsed());
        }
    }
    let total = started.elapsed();
    if !ok {
        bail!("non-success status");
    }
    Ok(Timing {
        first: first.unwrap_or(total),
        total,
    })
}

/// 1 µs to 10 min at 3 significant digits.
fn histogram() -> anyhow::Result<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 600_000_000, 3)?)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

fn summary(h: &Histogram<u64>) -> Value {
    json!({
        "p50": h.value_at_quantile(0.50),
        "p90": h.value_at_quantile(0.90),
        "p99": h.value_at_quantile(0.99),
        "p999": h.value_at_quantile(0.999),
        "max": h.max(),
        "mean": (h.mean() * 10.0).round() / 10.0,
        "count": h.len(),
    })
}

/// Per-worker results, merged at the end.
struct Tally {
    latency: Histogram<u64>,
    first: Histogram<u64>,
    errors: u64,
}

impl Tally {
    fn new() -> anyhow::Result<Self> {
        Ok(Self {
            latency: histogram()?,
            first: histogram()?,
            errors: 0,
        })
    }

    fn merge(&mut self, other: &Tally) {
        let _ = self.latency.add(&other.latency);
        let _ = self.first.add(&other.first);
        self.errors += other.errors;
    }
}

/// Closed loop and streams: `workers` connections, each back to back, the
/// i-th beginning at i/workers of `spread` seconds.
async fn run_closed(target: &Target, workers: usize, spread: f64) -> anyhow::Result<(Tally, f64)> {
    if !spread.is_finite() || spread < 0.0 || spread > target.warmup {
        bail!("--spread must be between 0 and --warmup");
    }
    let template = Arc::new(Template::new(target)?);
    let start = Instant::now();
    let begin = start + Duration::from_secs_f64(target.warmup);
    let end = begin + Duration::from_secs_f64(target.duration);
    let workers = workers.max(1);
    let mut tasks = Vec::with_capacity(workers);
    for worker in 0..workers {
        let template = template.clone();
        let first = start + Duration::from_secs_f64(spread * worker as f64 / workers as f64);
        tasks.push(tokio::spawn(async move {
            let mut tally = Tally::new()?;
            let mut sender = None;
            tokio::time::sleep_until(first.into()).await;
            while Instant::now() < end {
                let result = exchange(&template, &mut sender).await;
                // Counted when it ends in the window: a slow stream begun
                // during warm-up still shows up.
                let measured = Instant::now() >= begin;
                match result {
                    Ok(timing) if measured => {
                        let _ = tally.latency.record(micros(timing.total));
                        let _ = tally.first.record(micros(timing.first));
                    }
                    Ok(_) => {}
                    Err(_) if measured => tally.errors += 1,
                    Err(_) => {}
                }
            }
            anyhow::Ok(tally)
        }));
    }
    let mut total = Tally::new()?;
    for task in tasks {
        total.merge(&task.await??);
    }
    Ok((total, target.duration))
}

/// Open loop: the i-th request is due at `begin + i / rate`.
async fn run_open(target: &Target, rate: f64, connections: usize) -> anyhow::Result<(Tally, f64)> {
    if !rate.is_finite() || rate <= 0.0 {
        bail!("--rate must be positive");
    }
    let template = Arc::new(Template::new(target)?);
    let start = Instant::now();
    let begin = start + Duration::from_secs_f64(target.warmup);
    let end = begin + Duration::from_secs_f64(target.duration);
    let next = Arc::new(AtomicU64::new(0));
    let interval = 1.0 / rate;
    let mut tasks = Vec::with_capacity(connections);
    for _ in 0..connections.max(1) {
        let (template, next) = (template.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut tally = Tally::new()?;
            let mut sender = None;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let due = start + Duration::from_secs_f64(i as f64 * interval);
                if due >= end {
                    break;
                }
                // A request that is late because this connection was busy
                // counts from when it was due; one that waited for its time
                // counts from when the timer woke it (the timer's ~1 ms
                // granularity is ours, not the server's).
                let origin = if due > Instant::now() {
                    tokio::time::sleep_until(due.into()).await;
                    Instant::now()
                } else {
                    due
                };
                let result = exchange(&template, &mut sender).await;
                if due < begin {
                    continue;
                }
                match result {
                    Ok(_) => {
                        let _ = tally.latency.record(micros(origin.elapsed()));
                    }
                    Err(_) => tally.errors += 1,
                }
            }
            anyhow::Ok(tally)
        }));
    }
    let mut total = Tally::new()?;
    for task in tasks {
        total.merge(&task.await??);
    }
    Ok((total, target.duration))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = runtime.block_on(async {
        let report = match &cli.mode {
            Mode::Closed {
                target,
                concurrency,
            } => {
                let (tally, seconds) = run_closed(target, *concurrency, 0.0).await?;
                json!({
                    "mode": "closed",
                    "concurrency": concurrency,
                    "duration_s": seconds,
                    "requests": tally.latency.len(),
                    "errors": tally.errors,
                    "rps": (tally.latency.len() as f64 / seconds).round(),
                    "latency_us": summary(&tally.latency),
                })
            }
            Mode::Open {
                target,
                rate,
                connections,
            } => {
                let (tally, seconds) = run_open(target, *rate, *connections).await?;
                json!({
                    "mode": "open",
                    "target_rps": rate,
                    "connections": connections,
                    "duration_s": seconds,
                    "requests": tally.latency.len(),
                    "errors": tally.errors,
                    "rps": (tally.latency.len() as f64 / seconds).round(),
                    "latency_us": summary(&tally.latency),
                })
            }
            Mode::Stream {
                target,
                concurrency,
                spread,
            } => {
                let (tally, seconds) = run_closed(target, *concurrency, *spread).await?;
                json!({
                    "mode": "stream",
                    "concurrency": concurrency,
                    "spread_s": spread,
                    "duration_s": seconds,
                    "streams": tally.latency.len(),
                    "errors": tally.errors,
                    "streams_per_s": (tally.latency.len() as f64 / seconds).round(),
                    "first_token_us": summary(&tally.first),
                    "total_us": summary(&tally.latency),
                })
            }
        };
        anyhow::Ok(report)
    })?;
    println!("{report}");
    Ok(())
}
