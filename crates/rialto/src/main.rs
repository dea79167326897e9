//! `rialto`: serves any subset of Rialto's services, and administers it.
//!
//! - `rialto serve` runs all five services in one process (the embedded
//!   default: in-process calls, SQLite under `./data/`).
//! - `rialto serve --services gateway` (any comma-separated subset of
//!   `gateway,auth,limiter,billing,router`) runs only those; the others are
//!   reached over gRPC at the addresses in `[remote]`.
//! - `rialto admin accounts create --name NAME [--tier TIER]` creates an account and its
//!   first ADMIN key directly in the configured database (never migrating it).
//! - `rialto migrate [--check] [--wait SECS]` applies the database migrations
//!   (a step of its own where `database.migrate_on_start` is false).
//!
//! This crate is wiring only: which service is local and which is remote is
//! decided here and nowhere else.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use rialto_core::Config;

mod grpc_metrics;
mod serve;

// The request path allocates many short-lived buffers (JSON values, headers);
// glibc's malloc and free were a quarter of the gateway's CPU under load.
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
    /// Administer accounts.
    Admin {
        #[command(subcommand)]
        command: AdminCommand,
    },
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

#[derive(Subcommand)]
enum AdminCommand {
    /// Accounts and their keys.
    Accounts {
        #[command(subcommand)]
        command: AccountsCommand,
    },
}

#[derive(Subcommand)]
enum AccountsCommand {
    /// Create an account with its first ADMIN key and print both as JSON.
    Create {
        #[arg(long)]
        name: String,
        /// Rate-limit tier: `standard` (default), `partner`, or another of [limits.tiers].
        #[arg(long, default_value = "standard")]
        tier: String,
    },
    /// Set an account's rate-limit tier (one of [limits.tiers]); print the account as JSON.
    Tier {
        /// The account id.
        #[arg(long)]
        id: String,
        #[arg(long)]
        tier: String,
    },
    /// Set the DIEM an account's stake grants every UTC day; print the balance as JSON.
    Stake {
        /// The account id.
        #[arg(long)]
        id: String,
        /// DIEM per day, e.g. 25.
        #[arg(long)]
        diem_per_day: String,
    },
    /// Add prepaid credit to an account, once per reference; print the balance as JSON.
    Credit {
        /// The account id.
        #[arg(long)]
        id: String,
        /// USD to add, e.g. 10.00.
        #[arg(long, default_value = "0")]
        usd: String,
        /// DIEM to add.
        #[arg(long, default_value = "0")]
        diem: String,
        /// Idempotency reference: crediting the same reference twice adds once.
        #[arg(long)]
        reference: String,
    },
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
        Command::Admin {
            command:
                AdminCommand::Accounts {
                    command: AccountsCommand::Create { name, tier },
                },
        } => create_account(config, name, tier),
        Command::Admin {
            command:
                AdminCommand::Accounts {
                    command:
                        AccountsCommand::Credit {
                            id,
                            usd,
                            diem,
                            reference,
                        },
                },
        } => credit_account(config, id, usd, diem, reference),
        Command::Admin {
            command:
                AdminCommand::Accounts {
                    command: AccountsCommand::Tier { id, tier },
                },
        } => set_tier(config, id, tier),
        Command::Admin {
            command:
                AdminCommand::Accounts {
                    command: AccountsCommand::Stake { id, diem_per_day },
                },
        } => set_stake(config, id, diem_per_day),
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

/// Runs one administrative command against the configured database, on a
/// runtime of its own.
fn with_database<F, Fut>(config: &Config, command: F) -> anyhow::Result<()>
where
    F: FnOnce(rialto_core::db::Database) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        // Administration never changes the schema: `rialto migrate` does.
        let db = rialto_core::db::Database::connect_migrated(
            &config.database.url,
            config.database.max_connections,
        )
        .await?;
        command(db).await
    })
}

/// A tier of `[limits.tiers]`, or an error naming them.
fn ensure_tier(config: &Config, tier: &str) -> anyhow::Result<()> {
    let tiers = &config.limits.tiers;
    anyhow::ensure!(
        tiers.contains_key(tier),
        "unknown tier {tier:?}; [limits.tiers] defines: {}",
        tiers.keys().cloned().collect::<Vec<_>>().join(", ")
    );
    Ok(())
}

fn local_auth(config: &Config, db: rialto_core::db::Database) -> rialto_auth::LocalAuth {
    rialto_auth::LocalAuth::new(db, &rialto_core::Brand::new(&config.brand).key_prefix)
}

fn set_tier(config: Config, id: String, tier: String) -> anyhow::Result<()> {
    use rialto_auth::AuthService;
    ensure_tier(&config, &tier)?;
    with_database(&config, async |db| {
        let account = local_auth(&config, db)
            .set_account_tier(rialto_proto::auth::v1::SetAccountTierRequest {
                account_id: id,
                tier,
            })
            .await?;
        println!(
            "{}",
            serde_json::json!({"id": account.id, "name": account.name, "tier": account.tier})
        );
        Ok(())
    })
}

fn set_stake(config: Config, id: String, diem_per_day: String) -> anyhow::Result<()> {
    use rialto_billing::BillingService;
    with_database(&config, async |db| {
        let balance = rialto_billing::LocalBilling::for_command(&config, db)
            .set_stake(rialto_proto::billing::v1::SetStakeRequest {
                owner: rialto_billing::account_owner(&id),
                diem_per_day,
            })
            .await?;
        println!(
            "{}",
            serde_json::json!({
                "id": id,
                "diem_per_day": balance.diem_per_day,
                "balance": {"usd": balance.usd, "diem": balance.diem},
            })
        );
        Ok(())
    })
}

fn credit_account(
    config: Config,
    id: String,
    usd: String,
    diem: String,
    reference: String,
) -> anyhow::Result<()> {
    use rialto_billing::BillingService;
    with_database(&config, async |db| {
        let credited = rialto_billing::LocalBilling::for_command(&config, db)
            .credit(rialto_proto::billing::v1::CreditRequest {
                owner: rialto_billing::account_owner(&id),
                usd,
                diem,
                reference,
            })
            .await?;
        let balance = credited.balance.unwrap_or_default();
        println!(
            "{}",
            serde_json::json!({
                "applied": credited.applied,
                "balance": {"usd": balance.usd, "diem": balance.diem},
            })
        );
        Ok(())
    })
}

fn create_account(config: Config, name: String, tier: String) -> anyhow::Result<()> {
    use rialto_auth::AuthService;
    ensure_tier(&config, &tier)?;
    with_database(&config, async |db| {
        let created = local_auth(&config, db)
            .create_account(rialto_proto::auth::v1::CreateAccountRequest { name, tier })
            .await?;
        println!(
            "{}",
            serde_json::to_string_pretty(&rialto_gateway::operator::account_json(&created))?
        );
        Ok(())
    })
}
