//! Billing's write path: settlements per second its durable writer
//! sustains, the latency of one settlement, and the batch sizes the writer
//! reached, on SQLite and on PostgreSQL.
//!
//! Runs what `rialto serve` runs: `rialto_billing::book::Book` (every
//! ledger owner decided in memory, one writer task committing what waits in
//! batches) over a `Database` opened with `Database::connect` (migrations
//! applied; on SQLite WAL, `synchronous = NORMAL`, no WAL checkpoint in a
//! commit and the checkpointer task `rialto serve` spawns), with the same
//! pool size by default (`database.max_connections`, 16; the writer uses
//! one connection of it). SQLite uses a file in a temporary folder;
//! PostgreSQL a database of its own on the server (`--postgres`), created
//! before and dropped after: nothing is migrated into the server's
//! `postgres` database, which is only used to create and drop it. An
//! unreachable server is skipped, with a note.
//!
//! One *pair* is what a priced chat request costs billing: `Book::hold` of
//! the most it can cost (decided in memory, not written: a non-streamed
//! request's hold is not durable), then `Book::settle` of what it used,
//! which returns once the writer has committed the batch carrying its
//! record. A *stream* pair holds durably first (its opening record is
//! committed before the hold returns, as before a stream's first token),
//! then settles: two records. Rows, per database:
//!
//! - `c1_owners`: 1 task, pairs back to back, each next pair on the next of
//!   `--owners` owners: a settlement alone in its batch;
//! - `cM_owners`: `--mid-concurrency` tasks (the HTTP benchmark's 64
//!   connections), over many owners;
//! - `cN_owners`, `cN_one_owner`: `--concurrency` tasks over many owners,
//!   and all on one owner (one ledger row, one in-memory owner);
//! - `cN_streams`: `--concurrency` tasks of stream pairs over many owners;
//! - `cN_long_streams`: the same, each stream lasting `--stream-ms` (a
//!   checkpoint halfway) so that it outlives the writer's batches, as real
//!   streams do: pairs per second are bounded by that, and the row's figure
//!   is the writer's CPU a pair.
//!
//! For each: pairs (settlements) per second, the hold's, settlement's and
//! pair's latency, and the writer's batches in the measured window: their
//! count and records from `Book::batches` (records include the refreshes
//! each owner in use queues once a second), their mean size, and the
//! largest seen by sampling `Book::batches` every millisecond (exact when
//! one batch fell in a sample, a lower bound otherwise; the writer takes at
//! most 512 records from its queue per batch, and adds the opens it held
//! back of streams that end in it), and on SQLite the CPU time of the writer's
//! thread over the window, a pair (`/proc/self/task/*/schedstat`). Prints
//! one JSON object.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use hdrhistogram::Histogram;
use rialto_billing::book::{Book, HoldOrder, SettleOrder};
use rialto_billing::ledger::{HoldOutcome, Ledger, SettleOutcome};
use rialto_core::db::{Database, now_ms, redacted};
use serde_json::{Value, json};

#[derive(Parser)]
#[command(
    about = "Settlements per second billing's durable writer sustains, on SQLite and PostgreSQL"
)]
struct Cli {
    /// Seconds measured per row.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Seconds of the same load before each measurement.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Concurrent tasks in the most concurrent rows.
    #[arg(long, default_value_t = 512)]
    concurrency: usize,
    /// Concurrent tasks in the middle row.
    #[arg(long, default_value_t = 64)]
    mid_concurrency: usize,
    /// Owners (accounts) credited up front for the many-owners rows.
    #[arg(long, default_value_t = 1000)]
    owners: usize,
    /// Connections in the pool (`database.max_connections`'s default).
    #[arg(long, default_value_t = 16)]
    pool: u32,
    /// The PostgreSQL server (no database in the URL).
    #[arg(
        long,
        env = "E2E_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432"
    )]
    postgres: String,
    /// Measure SQLite only.
    #[arg(long)]
    no_postgres: bool,
    /// How long each stream of the long-streams row lasts, in milliseconds.
    #[arg(long, default_value_t = 200)]
    stream_ms: u64,
}

/// Nano-units (1e-9 USD) per USD.
const NANOS: i64 = 1_000_000_000;
/// What each owner is credited: $1,000,000.
const CREDIT: i64 = 1_000_000 * NANOS;
/// The hold of the benchmark's chat request on `bench-fast` (bench/run.py):
/// 5 prompt tokens at $0.5/M and the default completion budget of 1024 at
/// $1.5/M.
const HOLD: i64 = 5 * 500 + 1024 * 1500;
/// Its settlement: 10 prompt and 20 completion tokens.
const COST: i64 = 10 * 500 + 20 * 1500;
/// Holds expire after the default `billing.hold_ttl_secs` (900 s); no
/// sweeper runs here, so none expires meanwhile.
const HOLD_TTL_MS: i64 = 900_000;
/// A stream's lease (`billing.stream_lease_secs`' default order of
/// magnitude); no sweeper runs, so it only bounds the hold's expiry.
const LEASE_MS: i64 = 60_000;
const MODEL: &str = "bench-fast";
/// How often the batch counters are sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(1);

#[derive(Clone, Copy)]
struct Timing {
    warmup: Duration,
    measured: Duration,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A non-streamed request: the hold in memory, the settlement durable.
    Priced,
    /// A stream: the hold durable, then the settlement durable.
    Stream,
    /// A stream lasting this long, checkpointed halfway.
    LongStream(Duration),
}

struct Tally {
    pairs: u64,
    /// Holds not placed, or settlements that did not charge the cost.
    refused: u64,
    errors: u64,
    first_error: Option<String>,
    hold_ns: Histogram<u64>,
    settle_ns: Histogram<u64>,
    pair_ns: Histogram<u64>,
}

impl Tally {
    fn new() -> anyhow::Result<Self> {
        let histogram = || Histogram::new_with_bounds(1, 120_000_000_000, 3);
        Ok(Self {
            pairs: 0,
            refused: 0,
            errors: 0,
            first_error: None,
            hold_ns: histogram()?,
            settle_ns: histogram()?,
            pair_ns: histogram()?,
        })
    }

    fn add(&mut self, other: &Self) -> anyhow::Result<()> {
        self.pairs += other.pairs;
        self.refused += other.refused;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error.clone_from(&other.first_error);
        }
        self.hold_ns.add(&other.hold_ns)?;
        self.settle_ns.add(&other.settle_ns)?;
        self.pair_ns.add(&other.pair_ns)?;
        Ok(())
    }

    fn error(&mut self, error: impl std::fmt::Display) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(error.to_string());
        }
    }
}

fn ns(from: Instant, to: Instant) -> u64 {
    u64::try_from((to - from).as_nanos())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// One hold and its settlement, with the instants it started, the hold
/// returned and the settlement returned. The outcome is `Ok(true)` when both
/// did what they should, `Ok(false)` when one did not (a hold not placed is
/// not settled), `Err` when billing failed.
async fn pair(
    book: &Book,
    kind: Kind,
    owner: &str,
    request_id: &str,
) -> (Instant, Instant, Instant, Result<bool, rialto_core::Error>) {
    let started = Instant::now();
    let hold = book
        .hold(
            owner,
            &HoldOrder {
                request_id,
                amount: HOLD,
                expires_at_ms: now_ms() + HOLD_TTL_MS,
                cap: None,
                durable: kind != Kind::Priced,
                model_id: MODEL,
            },
        )
        .await;
    let held = Instant::now();
    match hold {
        Ok(HoldOutcome::Placed { .. }) => {}
        Ok(_) => return (started, held, held, Ok(false)),
        Err(error) => return (started, held, held, Err(error)),
    }
    if let Kind::LongStream(lasting) = kind {
        tokio::time::sleep(lasting / 2).await;
        if let Err(error) = book.checkpoint(owner, request_id, COST / 2, (10, 10)).await {
            return (started, held, Instant::now(), Err(error));
        }
        tokio::time::sleep(lasting / 2).await;
    }
    let settled = book
        .settle(
            owner,
            &SettleOrder {
                spent_by: "",
                request_id,
                cost: COST,
                model_id: MODEL,
                prompt_tokens: 10,
                completion_tokens: 20,
                cap: None,
                key: None,
                rest: false,
            },
        )
        .await
        .map(|outcome| matches!(outcome, SettleOutcome::Settled { usd, diem, .. } if usd + diem == COST));
    (started, held, Instant::now(), settled)
}

/// The writer's batches during the measured window.
#[derive(Default)]
struct Batches {
    batches: u64,
    records: u64,
    /// The largest records-per-batch of any sample.
    largest: f64,
    /// Whether `largest` was one batch alone in its sample (exact).
    exact: bool,
    /// CPU time of the SQLite writer's thread over the window.
    writer_cpu: Option<Duration>,
}

/// CPU time so far of the SQLite writer's thread (`rialto-ledger-writer`,
/// which the kernel cuts to 15 bytes), if this process has one.
fn writer_cpu() -> Option<Duration> {
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let path = task.ok()?.path();
        let name = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if name.trim_end() == "rialto-ledger-w" {
            let schedstat = std::fs::read_to_string(path.join("schedstat")).ok()?;
            let nanos = schedstat.split_whitespace().next()?.parse().ok()?;
            return Some(Duration::from_nanos(nanos));
        }
    }
    None
}

/// Samples `book.batches()` every millisecond from `begin` to `end`.
async fn sample_batches(book: Book, begin: Instant, end: Instant) -> Batches {
    tokio::time::sleep_until(begin.into()).await;
    let first = book.batches();
    let cpu_before = writer_cpu();
    let mut last = first;
    let mut found = Batches::default();
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while Instant::now() < end {
        tick.tick().await;
        let now = book.batches();
        let (batches, records) = (now.0 - last.0, now.1.saturating_sub(last.1));
        if batches > 0 {
            let size = records as f64 / batches as f64;
            if size > found.largest || (size == found.largest && batches == 1) {
                found.largest = size;
                found.exact = batches == 1;
            }
        }
        last = now;
    }
    found.writer_cpu = cpu_before
        .zip(writer_cpu())
        .map(|(a, b)| b.saturating_sub(a));
    found.batches = last.0 - first.0;
    found.records = last.1.saturating_sub(first.1);
    found
}

/// `tasks` tasks running pairs back to back for the warm-up and the
/// measured time; task `t`'s `i`-th pair goes to owner
/// `(t + i * tasks) % owners`.
async fn pairs(
    book: &Book,
    kind: Kind,
    owners: &Arc<Vec<String>>,
    tasks: usize,
    tag: &str,
    timing: Timing,
) -> anyhow::Result<(Tally, Batches)> {
    // Each row starts with the writer caught up: what the row before left
    // queued (durable in the log, not committed yet) would otherwise be
    // this row's to wait for, a stream's hold waiting for its own batch
    // behind it (a short run's streams row read no pair at all).
    book.flush().await?;
    let begin = Instant::now() + timing.warmup;
    let end = begin + timing.measured;
    let sampler = tokio::spawn(sample_batches(book.clone(), begin, end));
    let mut handles = Vec::with_capacity(tasks);
    for task in 0..tasks.max(1) {
        let (book, owners, tag) = (book.clone(), owners.clone(), tag.to_owned());
        handles.push(tokio::spawn(async move {
            let mut tally = Tally::new()?;
            let mut index = task % owners.len().max(1);
            let mut i = 0u64;
            loop {
                let owner = owners.get(index).context("no owners")?;
                index = (index + tasks) % owners.len();
                i += 1;
                let request_id = format!("{tag}-{task}-{i}");
                let (started, held, settled, outcome) = pair(&book, kind, owner, &request_id).await;
                if settled >= end {
                    break;
                }
                if started < begin {
                    continue;
                }
                match outcome {
                    Ok(ok) => {
                        tally.pairs += 1;
                        tally.refused += u64::from(!ok);
                        let _ = tally.hold_ns.record(ns(started, held));
                        let _ = tally.settle_ns.record(ns(held, settled));
                        let _ = tally.pair_ns.record(ns(started, settled));
                    }
                    Err(error) => tally.error(error),
                }
            }
            anyhow::Ok(tally)
        }));
    }
    let mut total = Tally::new()?;
    for handle in handles {
        total.add(&handle.await??)?;
    }
    Ok((total, sampler.await?))
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn latency_us(h: &Histogram<u64>) -> Value {
    let us = |ns: u64| round1(ns as f64 / 1000.0);
    json!({
        "p50": us(h.value_at_quantile(0.50)),
        "p90": us(h.value_at_quantile(0.90)),
        "p99": us(h.value_at_quantile(0.99)),
        "p999": us(h.value_at_quantile(0.999)),
        "max": us(h.max()),
        "mean": round1(h.mean() / 1000.0),
    })
}

fn row(
    (tally, batches): &(Tally, Batches),
    kind: Kind,
    tasks: usize,
    owners: usize,
    timing: Timing,
) -> Value {
    let seconds = timing.measured.as_secs_f64();
    let kind = match kind {
        Kind::Priced => json!("priced"),
        Kind::Stream => json!("stream"),
        Kind::LongStream(lasting) => json!(format!("stream of {} ms", lasting.as_millis())),
    };
    let writer_us = batches
        .writer_cpu
        .filter(|_| tally.pairs > 0)
        .map(|cpu| round1(cpu.as_secs_f64() * 1e6 / tally.pairs as f64));
    json!({
        "kind": kind,
        "writer_cpu_us_per_pair": writer_us,
        "tasks": tasks,
        "owners": owners,
        "pairs": tally.pairs,
        "per_s": (tally.pairs as f64 / seconds).round(),
        "refused": tally.refused,
        "errors": tally.errors,
        "first_error": tally.first_error,
        "hold_us": latency_us(&tally.hold_ns),
        "settle_us": latency_us(&tally.settle_ns),
        "pair_us": latency_us(&tally.pair_ns),
        "batches": {
            "count": batches.batches,
            "records": batches.records,
            "per_s": (batches.batches as f64 / seconds).round(),
            "records_per_s": (batches.records as f64 / seconds).round(),
            "mean": if batches.batches > 0 {
                round1(batches.records as f64 / batches.batches as f64)
            } else {
                0.0
            },
            "max_sampled": round1(batches.largest),
            "max_exact": batches.exact,
        },
    })
}

/// Every row on one database.
async fn measure(db: Database, cli: &Cli, timing: Timing) -> anyhow::Result<Value> {
    let ledger = Ledger::new(db.clone());
    let owners: Arc<Vec<String>> = Arc::new(
        (0..cli.owners.max(1))
            .map(|i| format!("account:bench-{i}"))
            .collect(),
    );
    let hot: Arc<Vec<String>> = Arc::new(vec!["account:bench-hot".to_owned()]);
    // Credit every owner, a pool's worth at a time, before billing loads
    // any of them.
    let credited = Instant::now();
    let everyone: Vec<String> = owners.iter().chain(hot.iter()).cloned().collect();
    let stripes = usize::try_from(cli.pool).unwrap_or(1).max(1);
    let mut handles = Vec::new();
    for stripe in 0..stripes {
        let (ledger, everyone) = (ledger.clone(), everyone.clone());
        handles.push(tokio::spawn(async move {
            for owner in everyone.iter().skip(stripe).step_by(stripes) {
                ledger.credit(owner, CREDIT, 0, "bench-seed").await?;
            }
            anyhow::Ok(())
        }));
    }
    for handle in handles {
        handle.await??;
    }
    let credit_s = credited.elapsed().as_secs_f64();

    let book = Book::start(db, LEASE_MS);
    let n = cli.concurrency.max(1);
    let m = cli.mid_concurrency.max(1);
    let many = owners.len();
    let c1_owners = pairs(&book, Kind::Priced, &owners, 1, "c1o", timing).await?;
    let cm_owners = pairs(&book, Kind::Priced, &owners, m, "cmo", timing).await?;
    let cn_owners = pairs(&book, Kind::Priced, &owners, n, "cno", timing).await?;
    let cn_one = pairs(&book, Kind::Priced, &hot, n, "cnh", timing).await?;
    let cn_streams = pairs(&book, Kind::Stream, &owners, n, "cns", timing).await?;
    let long = Kind::LongStream(Duration::from_millis(cli.stream_ms));
    let cn_long = pairs(&book, long, &owners, n, "cnl", timing).await?;
    book.flush().await?;

    // The books still balance, on the owner that took the most: the
    // database's balance is its journal's, nothing is held, and memory
    // agrees with the database once everything is written.
    let hot_owner = hot.first().context("no hot owner")?;
    let balance = ledger.balance(hot_owner).await?;
    let journal = ledger.journal_sums(hot_owner).await?;
    anyhow::ensure!(
        balance == journal && balance.usd_held == 0,
        "the ledger of {hot_owner} does not reconcile: {balance:?} vs journal {journal:?}"
    );
    if let Some(memory) = book.snapshot(hot_owner) {
        anyhow::ensure!(
            memory.balance.usd == balance.usd && memory.balance.usd_held == 0,
            "billing's memory of {hot_owner} ({:?}) is not the database's ({balance:?})",
            memory.balance
        );
    }
    Ok(json!({
        "credit_s": round1(credit_s),
        "c1_owners": row(&c1_owners, Kind::Priced, 1, many, timing),
        "cM_owners": row(&cm_owners, Kind::Priced, m, many, timing),
        "cN_owners": row(&cn_owners, Kind::Priced, n, many, timing),
        "cN_one_owner": row(&cn_one, Kind::Priced, n, 1, timing),
        "cN_streams": row(&cn_streams, Kind::Stream, n, many, timing),
        "cN_long_streams": row(&cn_long, long, n, many, timing),
    }))
}

async fn sqlite(cli: &Cli, timing: Timing) -> anyhow::Result<Value> {
    let dir = tempfile::Builder::new()
        .prefix("rialto-bench-ledger-")
        .tempdir()?;
    let url = format!("sqlite://{}/ledger.db", dir.path().display());
    let db = Database::connect(&url, cli.pool).await?;
    // As `rialto serve` does: the WAL is checkpointed by a task, never in
    // a commit.
    db.spawn_checkpointer(Duration::from_secs(1));
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(db.pool())
        .await?;
    let sync: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(db.pool())
        .await?;
    let autocheckpoint: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
        .fetch_one(db.pool())
        .await?;
    let version: String = sqlx::query_scalar("SELECT sqlite_version()")
        .fetch_one(db.pool())
        .await?;
    let mut result = measure(db.clone(), cli, timing).await?;
    db.pool().close().await;
    if let Some(object) = result.as_object_mut() {
        object.insert(
            "server".into(),
            json!(format!(
                "SQLite {version}, journal_mode={mode}, synchronous={}, wal_autocheckpoint={autocheckpoint} \
                 (a task checkpoints every second)",
                ["OFF", "NORMAL", "FULL", "EXTRA"]
                    .get(usize::try_from(sync).unwrap_or(9))
                    .unwrap_or(&"?")
            )),
        );
        object.insert("pool".into(), json!(cli.pool));
        object.insert("file".into(), json!("a file in the temporary folder"));
    }
    Ok(result)
}

/// Runs `sql` on the server's `postgres` database (CREATE and DROP
/// DATABASE only).
async fn admin(server: &str, sql: &str) -> anyhow::Result<()> {
    use sqlx::Connection;
    let mut conn = tokio::time::timeout(
        Duration::from_secs(10),
        sqlx::postgres::PgConnection::connect(&format!("{server}/postgres")),
    )
    .await
    .context("timed out connecting")??;
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    Ok(())
}

async fn postgres_settings(url: &str) -> anyhow::Result<String> {
    use sqlx::Connection;
    let mut conn = sqlx::postgres::PgConnection::connect(url).await?;
    let mut settings = Vec::new();
    for name in [
        "server_version",
        "synchronous_commit",
        "fsync",
        "shared_buffers",
    ] {
        let value: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {name}")))
            .fetch_one(&mut conn)
            .await?;
        settings.push(if name == "server_version" {
            format!("PostgreSQL {value}")
        } else {
            format!("{name}={value}")
        });
    }
    conn.close().await?;
    Ok(settings.join(", "))
}

async fn postgres(cli: &Cli, timing: Timing) -> anyhow::Result<Value> {
    let server = cli.postgres.trim_end_matches('/');
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let name = format!("rialto_bench_ledger_{}_{nanos}", std::process::id());
    if let Err(error) = admin(server, &format!("CREATE DATABASE {name}")).await {
        return Ok(json!({
            "skipped": true,
            "note": format!(
                "PostgreSQL at {} is unreachable or refused CREATE DATABASE: {error:#}",
                redacted(server)
            ),
        }));
    }
    let url = format!("{server}/{name}");
    let measured = async {
        let db = Database::connect(&url, cli.pool).await?;
        let settings = postgres_settings(&url).await?;
        let result = measure(db.clone(), cli, timing).await;
        db.pool().close().await;
        let mut result = result?;
        if let Some(object) = result.as_object_mut() {
            object.insert("server".into(), json!(settings));
            object.insert("pool".into(), json!(cli.pool));
            object.insert("database".into(), json!(name));
        }
        anyhow::Ok(result)
    }
    .await;
    // Dropped whatever happened.
    let dropped = admin(
        server,
        &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
    )
    .await;
    let result = measured?;
    dropped.with_context(|| format!("dropping the database {name}"))?;
    Ok(result)
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
    // As `rialto serve` runs: one runtime worker per core.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores)
        .enable_all()
        .build()?;
    let report = runtime.block_on(async {
        let sqlite = sqlite(&cli, timing).await.context("SQLite")?;
        let postgres = if cli.no_postgres {
            json!({"skipped": true, "note": "--no-postgres"})
        } else {
            postgres(&cli, timing).await.context("PostgreSQL")?
        };
        anyhow::Ok(json!({
            "cores": cores,
            "seconds": cli.seconds,
            "warmup_s": cli.warmup,
            "concurrency": cli.concurrency.max(1),
            "mid_concurrency": cli.mid_concurrency.max(1),
            "owners": cli.owners.max(1),
            "hold_nanos": HOLD,
            "settle_nanos": COST,
            "lease_ms": LEASE_MS,
            "sample_ms": SAMPLE_EVERY.as_millis() as u64,
            "sqlite": sqlite,
            "postgres": postgres,
        }))
    })?;
    println!("{report}");
    Ok(())
}
