//! `mock-upstream`: runs Rialto's mock OpenAI-compatible upstream until Ctrl-C.
//!
//! Useful for manual testing and benchmarks:
//! `mock-upstream --listen 127.0.0.1:18999 --workers 4`.

use std::net::SocketAddr;

use clap::Parser;
use rialto_test_kit::MockUpstream;

/// Mock OpenAI-compatible chat-completions upstream.
#[derive(Parser, Debug)]
#[command(name = "mock-upstream", version, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:18999")]
    listen: SocketAddr,
    /// Number of server worker threads.
    #[arg(long, default_value_t = 1)]
    workers: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mock = MockUpstream::start_with_workers(args.listen, args.workers).await?;
    println!("mock upstream listening on {}", mock.base_url());
    tokio::signal::ctrl_c().await?;
    Ok(())
}
