//! `bench-proxy`: the leanest HTTP/1.1 proxy we know how to write, to
//! measure what being a proxy costs on this machine before any of Rialto's
//! work: each downstream connection gets one upstream connection, and each
//! request is passed through as it is (head and body streamed, nothing
//! parsed), on a Tokio runtime of `--threads` workers.
//!
//! `make bench` runs it as the `proxy` scenario beside the floor and
//! Rialto: the difference between it and the floor is the extra loopback
//! hop and wake-ups that any proxy pays here.

use std::net::SocketAddr;

use clap::Parser;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

#[derive(Parser, Clone)]
#[command(about = "A pass-through HTTP/1.1 proxy: the floor of any proxy")]
struct Args {
    #[arg(long, default_value = "127.0.0.1:18998")]
    listen: SocketAddr,
    /// The upstream's address (host:port).
    #[arg(long)]
    upstream: SocketAddr,
    /// Runtime worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?
        .block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let listener = TcpListener::bind(args.listen).await?;
    println!("bench-proxy listening on {}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let upstream = args.upstream;
        tokio::spawn(async move {
            if let Err(error) = connection(stream, upstream).await {
                eprintln!("connection: {error}");
            }
        });
    }
}

/// One downstream connection and its upstream connection: requests on a
/// keep-alive connection come one at a time, so one upstream suffices.
async fn connection(stream: TcpStream, upstream: SocketAddr) -> anyhow::Result<()> {
    let outbound = TcpStream::connect(upstream).await?;
    outbound.set_nodelay(true)?;
    let (sender, driver) = hyper::client::conn::http1::handshake(TokioIo::new(outbound)).await?;
    tokio::spawn(driver);
    let sender = std::sync::Arc::new(Mutex::new(sender));
    let service = service_fn(move |request: Request<Incoming>| {
        let sender = sender.clone();
        async move {
            let mut sender = sender.lock().await;
            sender.ready().await?;
            let response: Response<Incoming> = sender.send_request(request).await?;
            Ok::<_, hyper::Error>(response)
        }
    });
    http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await?;
    Ok(())
}
