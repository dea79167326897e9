//! `bench-proxy`: the leanest HTTP/1.1 proxy we know how to write, to
//! measure what being a proxy costs on this machine before any of Rialto's
//! work: each downstream connection gets one upstream connection, and each
//! request is passed through as it is (head and body streamed, nothing
//! parsed), on a Tokio runtime of `--threads` workers.
//!
//! `make bench` runs it as the `proxy` scenario beside the floor and
//! Rialto: the difference between it and the floor is the extra loopback
//! hop and wake-ups that any proxy pays here.
//!
//! `--server actix` is the same pass-through on Rialto's HTTP server:
//! actix-web's workers (a single-threaded runtime each, a connection pinned
//! to one) with a reqwest client per worker (the gateway's router keeps a
//! client of its own for plain-`http` backends, which wakes its worker once
//! less a request). Its difference from the hyper proxy is about what that
//! server costs before any of Rialto's work (`make bench`'s `actix-proxy`
//! scenario; `bench/ab.py --proxy --proxy-server actix`).
//!
//! `--server hyper-pinned` is the hyper proxy on `--threads` single-threaded
//! runtimes, each keeping the connections it accepted, as actix-web's
//! workers do: whether a connection pinned to a busy worker is what a
//! stream's first token waits for (`bench/ab.py --proxy --proxy-server
//! hyper-pinned`; session 72 in bench/NOTES.md: it is not).

use std::net::SocketAddr;

use clap::Parser;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::Mutex;

#[derive(Parser, Clone)]
#[command(about = "A pass-through HTTP/1.1 proxy: the floor of any proxy")]
struct Args {
    #[arg(long, default_value = "127.0.0.1:18998")]
    listen: SocketAddr,
    /// The upstream's address (host:port).
    #[arg(long)]
    upstream: SocketAddr,
    /// Runtime worker threads (actix-web's workers with `--server actix`).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// The HTTP stack: hyper on one work-stealing Tokio runtime, or
    /// actix-web's workers with a reqwest client each.
    #[arg(long, value_enum, default_value_t = Server::Hyper)]
    server: Server,
}

#[derive(clap::ValueEnum, Clone, Copy)]
enum Server {
    Hyper,
    /// hyper on `--threads` single-threaded runtimes, each accepting and
    /// keeping its own connections (as actix-web's workers do): the same
    /// proxy without work stealing.
    HyperPinned,
    Actix,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match args.server {
        Server::Actix => return actix::serve(args),
        Server::HyperPinned => return pinned(args),
        Server::Hyper => {}
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?
        .block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let listener = rialto_bench::listen(args.listen)?;
    println!("bench-proxy listening on {}", listener.local_addr()?);
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(accepted(stream, args.upstream));
    }
}

/// Serves one accepted connection until it ends, reporting a failure.
async fn accepted(stream: TcpStream, upstream: SocketAddr) {
    let served = match stream.set_nodelay(true) {
        Ok(()) => connection(stream, upstream).await,
        Err(error) => Err(error.into()),
    };
    if let Err(error) = served {
        eprintln!("connection: {error}");
    }
}

/// `--server hyper-pinned`: one listener, and a thread per worker, each a
/// single-threaded runtime that accepts from it and serves what it
/// accepted.
fn pinned(args: Args) -> anyhow::Result<()> {
    let listener = rialto_core::net::listen(args.listen, 4096)?;
    listener.set_nonblocking(true)?;
    println!("bench-proxy listening on {}", listener.local_addr()?);
    let workers = (0..args.threads.max(1))
        .map(|_| {
            let listener = listener.try_clone()?;
            let upstream = args.upstream;
            Ok(std::thread::spawn(move || -> anyhow::Result<()> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                let local = tokio::task::LocalSet::new();
                local.block_on(&runtime, async move {
                    let listener = tokio::net::TcpListener::from_std(listener)?;
                    loop {
                        let (stream, _) = listener.accept().await?;
                        tokio::task::spawn_local(accepted(stream, upstream));
                    }
                })
            }))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for worker in workers {
        worker
            .join()
            .map_err(|_| anyhow::anyhow!("a worker panicked"))??;
    }
    Ok(())
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

/// The pass-through on actix-web and reqwest.
mod actix {
    use actix_web::{HttpRequest, HttpResponse, web};

    use super::Args;

    /// One worker's way upstream: its own client, so its connections are
    /// tasks of its own runtime.
    struct Upstream {
        client: reqwest::Client,
        base: String,
    }

    pub(super) fn serve(args: Args) -> anyhow::Result<()> {
        // reqwest is built without a TLS provider of its own, as Rialto's.
        let _ = rustls::crypto::ring::default_provider().install_default();
        actix_web::rt::System::new().block_on(async move {
            let base = format!("http://{}", args.upstream);
            let build = || {
                reqwest::Client::builder()
                    .tcp_nodelay(true)
                    .pool_max_idle_per_host(1024)
                    .build()
            };
            // Built first, so that a bad setting fails at start; a worker
            // whose own cannot be built shares it.
            let fallback = build()?;
            let server = actix_web::HttpServer::new(move || {
                // Called on each worker's thread.
                let client = build().unwrap_or_else(|_| fallback.clone());
                let upstream = Upstream {
                    client,
                    base: base.clone(),
                };
                actix_web::App::new()
                    .app_data(web::Data::new(upstream))
                    .default_service(web::to(pass))
            })
            .workers(args.threads.max(1))
            // As the gateway's: a stream's chunks leave as they come.
            .tcp_nodelay(true)
            .bind(args.listen)?;
            println!("bench-proxy listening on {}", server.addrs()[0]);
            server.run().await?;
            Ok(())
        })
    }

    /// Headers that belong to one connection, not to the request.
    fn hop_by_hop(name: &str) -> bool {
        matches!(
            name,
            "host" | "connection" | "content-length" | "transfer-encoding" | "keep-alive"
        )
    }

    /// The request sent upstream as it came, and the answer streamed back
    /// as it comes.
    async fn pass(
        request: HttpRequest,
        body: web::Bytes,
        upstream: web::Data<Upstream>,
    ) -> HttpResponse {
        let method = reqwest::Method::from_bytes(request.method().as_str().as_bytes())
            .unwrap_or(reqwest::Method::GET);
        let mut outbound = upstream
            .client
            .request(method, format!("{}{}", upstream.base, request.uri()))
            .body(body);
        for (name, value) in request.headers() {
            if !hop_by_hop(name.as_str()) {
                outbound = outbound.header(name.as_str(), value.as_bytes());
            }
        }
        let answer = match outbound.send().await {
            Ok(answer) => answer,
            Err(error) => return HttpResponse::BadGateway().body(error.to_string()),
        };
        let status = actix_web::http::StatusCode::from_u16(answer.status().as_u16())
            .unwrap_or(actix_web::http::StatusCode::BAD_GATEWAY);
        let mut response = HttpResponse::build(status);
        for (name, value) in answer.headers() {
            if !hop_by_hop(name.as_str()) {
                response.append_header((name.as_str(), value.as_bytes()));
            }
        }
        response.streaming(answer.bytes_stream())
    }
}
