//! `rialto`: serves any subset of Rialto's services, and administers it.
//!
//! - `rialto serve` runs all five services in one process (the embedded
//!   default: in-process calls, SQLite under `./data/`).
//! - `rialto serve --services gateway` (any comma-separated subset of
//!   `gateway,auth,limiter,billing,router`) runs only those; the others are
//!   reached over gRPC at the addresses in `[remote]`.
//! - `rialto admin ...` (`accounts`, `keys`, `backends`, `characters`) is a
//!   client of the operator API (`/admin/v1`) of a running gateway: `--url`
//!   (else `RIALTO_ADMIN_URL`, else the configured `gateway.listen`), the
//!   operator token from `--token-file`, `RIALTO_OPERATOR_TOKEN`, the
//!   configuration, or the file `rialto serve` writes on the embedded
//!   default; `--output json` prints the API's answers as they are (see
//!   `admin.rs`). It never opens the database.
//! - `rialto migrate [--check] [--wait SECS]` applies the database migrations
//!   (a step of its own where `database.migrate_on_start` is false); the
//!   only command besides `serve` that opens the database.
//!
//! This crate is wiring only: which service is local and which is remote is
//! decided here and nowhere else.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use rialto_core::Config;

mod admin;
mod discovery;
mod grpc_metrics;
mod reload;
mod serve;

// The request path allocates many short-lived buffers (JSON values, headers);
// glibc's malloc and free were a quarter of the gateway's CPU under load.
// Built without transparent huge pages (the `no_thp` feature, which takes
// out mimalloc's MADV_HUGEPAGE altogether): with them each 2 MiB of its arena
// that any thread touched was resident, 30 MB of a 60 MB idle process; without,
// idle is ~40 MB, and 64-connection throughput moved less than this VM's noise
// (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The build revision, `<yyyymmdd>.<hhmmss>` (see build.rs).
pub const REVISION: &str = env!("RIALTO_REVISION");

#[derive(Parser)]
#[command(name = "rialto", version = REVISION, about = "Self-hostable inference API platform")]
struct Cli {
    /// Configuration file (TOML); also RIALTO_CONFIG. Defaults apply without one.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the API and services.
    Serve(ServeArgs),
    /// Administer the platform through the operator API (`/admin/v1`) of a
    /// running gateway: accounts, keys, backends, characters.
    Admin(admin::AdminArgs),
    /// Apply the database migrations this binary has and the database
    /// lacks (with `database.migrate_url` when set), and print what was
    /// applied; `--check` applies nothing and fails while some are missing.
    Migrate(MigrateArgs),
    /// Print the build revision.
    Version,
    /// Read a document on stdin, print its text (the gateway runs this in a
    /// bounded child process for each PDF, DOCX, PPTX or XLSX part).
    #[command(hide = true, name = "convert-file")]
    ConvertFile {
        #[arg(long)]
        name: String,
        #[arg(long, default_value = "")]
        media_type: String,
    },
}

#[derive(Args)]
struct ServeArgs {
    /// Comma-separated services to run here: gateway,auth,limiter,billing,router.
    #[arg(long, value_delimiter = ',')]
    services: Option<Vec<String>>,
}

#[derive(Args)]
struct MigrateArgs {
    /// Apply nothing: exit 0 when the schema is this binary's, 1 otherwise
    /// (with --wait, once it is, or when the time is up).
    #[arg(long)]
    check: bool,
    /// Seconds to keep trying while the database cannot be reached (or,
    /// with --check, while migrations are missing): an init container
    /// waits for the migration Job this way.
    #[arg(long, default_value_t = 0)]
    wait: u64,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if let Command::ConvertFile { name, media_type } = &cli.command {
        // No configuration, no telemetry: a converter reads stdin only.
        return rialto_gateway::convert::child_main(name, media_type);
    }
    let config = match Config::load(cli.config.as_deref()) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("rialto: {error}");
            return std::process::ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Serve(args) => serve::run(config, args.services),
        Command::Admin(args) => admin::run(&config, args),
        Command::Migrate(args) => migrate(&config, &args),
        Command::Version => {
            println!("{REVISION}");
            Ok(())
        }
        Command::ConvertFile { .. } => unreachable!("handled before the configuration"),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("rialto: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// `rialto migrate [--check] [--wait SECS]`.
fn migrate(config: &Config, args: &MigrateArgs) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let url = config
        .database
        .migrate_url
        .as_deref()
        .unwrap_or(&config.database.url);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(args.wait);
        loop {
            let attempt = async {
                let db = rialto_core::db::Database::open_unmigrated(url, 1).await?;
                let pending = db.pending_migrations().await?;
                if args.check {
                    return Ok(pending);
                }
                db.migrate().await.context("applying the migrations")?;
                for migration in &pending {
                    println!("applied {migration}");
                }
                Ok(Vec::new())
            };
            let outcome: anyhow::Result<Vec<String>> = attempt.await;
            let done = matches!(&outcome, Ok(pending) if pending.is_empty());
            if done || std::time::Instant::now() >= deadline {
                return match outcome {
                    Ok(pending) if pending.is_empty() => {
                        println!("the schema is up to date");
                        Ok(())
                    }
                    Ok(pending) => anyhow::bail!(
                        "{} migration(s) to apply, the first {}: run `rialto migrate`",
                        pending.len(),
                        pending[0]
                    ),
                    Err(error) => Err(error.context("cannot reach the database")),
                };
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    })
}
