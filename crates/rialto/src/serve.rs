//! `rialto serve`: builds a client for each service (local or gRPC), serves
//! the HTTP API when the gateway runs here, and serves gRPC for the services
//! that run here when another process needs them.

use std::collections::BTreeSet;
use std::sync::Arc;

use anyhow::Context;
use rialto_auth::{AuthClient, CachedAuth, LocalAuth};
use rialto_billing::replicas::ReplicatedBilling;
use rialto_billing::{BillingClient, LocalBilling};
use rialto_core::Config;
use rialto_core::bus::Bus;
use rialto_core::config::SERVICES;
use rialto_core::membership::{Membership, Timing};
use rialto_gateway::{Gateway, Services};
use rialto_limiter::{LimiterClient, LocalLimiter, RateLimiter};
use rialto_router::{LocalRouter, RouterClient};
use secrecy::ExposeSecret;
use std::time::Duration;

use rialto_auth::grpc::RemoteAuth;
use rialto_billing::grpc::RemoteBilling;
use rialto_core::grpc_auth::{ClientToken, ServerToken};
use rialto_core::per_thread::PerThread;
use rialto_limiter::grpc::RemoteLimiter;
use rialto_router::grpc::RemoteRouter;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint};

use crate::REVISION;

pub fn run(config: Config, services: Option<Vec<String>>) -> anyhow::Result<()> {
    let here = selected_services(&config, services)?;
    refuse_open_exposure(&config, &here)?;
    rialto_core::metrics::metrics()
        .build_info
        .get_or_create(&rialto_core::metrics::BuildLabels {
            revision: crate::REVISION.to_owned(),
        })
        .set(1);
    // `rialto-gateway`, `rialto-billing`, or `rialto` for all in one.
    let name = if here.len() == SERVICES.len() {
        "rialto".to_owned()
    } else {
        format!(
            "rialto-{}",
            here.iter().copied().collect::<Vec<_>>().join("-")
        )
    };
    // Before any HTTP client is built, the OTLP exporter's included.
    let _ = rustls::crypto::ring::default_provider().install_default();
    rialto_core::telemetry::init(&config.log.format, &config.log.level, &name);
    // One process, one runtime: actix's System on a multi-thread Tokio
    // runtime, with tonic beside it.
    let result = actix_rt::System::with_tokio_rt(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|error| {
                eprintln!("rialto: cannot start the runtime: {error}");
                std::process::exit(1)
            })
    })
    .block_on(serve(config, here));
    rialto_core::telemetry::shutdown();
    result
}

fn selected_services(
    config: &Config,
    services: Option<Vec<String>>,
) -> anyhow::Result<BTreeSet<&'static str>> {
    let names = services.unwrap_or_else(|| config.services.clone());
    let mut here = BTreeSet::new();
    for name in names.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
        let known = SERVICES.iter().find(|s| **s == name).with_context(|| {
            format!(
                "unknown service {name:?}; expected some of {}",
                SERVICES.join(",")
            )
        })?;
        here.insert(*known);
    }
    anyhow::ensure!(!here.is_empty(), "no service to run");
    Ok(here)
}

/// With no operator token configured, the embedded default (SQLite) makes
/// one and keeps it beside the database (`data/operator-token`, readable by
/// its owner only), where `rialto admin` finds it: the operator API works
/// on a laptop with nothing set up. Elsewhere the API stays off until an
/// operator configures `operator.token[_file]`.
fn embedded_operator_token(config: &mut Config) -> anyhow::Result<()> {
    if config.operator.token.is_some() {
        return Ok(());
    }
    let Some(path) = config.embedded_operator_token_path() else {
        return Ok(());
    };
    let token = match rialto_core::secrets::read_file(&path) {
        Ok(token) => token,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            if let Some(folder) = path.parent().filter(|f| !f.as_os_str().is_empty()) {
                std::fs::create_dir_all(folder)
                    .with_context(|| format!("cannot create {}", folder.display()))?;
            }
            let token = rialto_core::ids::random_token().map_err(|error| {
                anyhow::anyhow!("no random bytes for the operator token: {error}")
            })?;
            write_private(&path, &token).with_context(|| {
                format!("cannot write the operator token to {}", path.display())
            })?;
            println!(
                "rialto: operator token written to {} (rialto admin reads it)",
                path.display()
            );
            secrecy::SecretString::from(token)
        }
        Err(error) => {
            return Err(error).with_context(|| format!("cannot read {}", path.display()));
        }
    };
    config.operator.token = Some(token);
    config.operator.token_file = Some(path);
    Ok(())
}

/// Creates `path` readable and writable by its owner only.
fn write_private(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(text.as_bytes())?;
    file.write_all(b"\n")
}

/// Refuses to start where a default that is safe on loopback would open a
/// door on a public address: gRPC without `grpc.token` (services trust
/// their callers: anyone reaching the port could create keys or credit
/// accounts), and wallet sign-in with the localhost default of
/// `wallet.domains` (messages would not be bound to the host clients use).
fn refuse_open_exposure(config: &Config, here: &BTreeSet<&'static str>) -> anyhow::Result<()> {
    let serves_grpc = here.iter().any(|s| *s != "gateway") && here.len() != SERVICES.len();
    if serves_grpc && config.grpc.token.is_none() && !config.grpc.listen.ip().is_loopback() {
        anyhow::bail!(
            "grpc.listen = {} is not a loopback address and grpc.token is unset: anyone who \
             reaches the port could call the services; set grpc.token (RIALTO_GRPC__TOKEN) \
             in every process, or listen on 127.0.0.1",
            config.grpc.listen
        );
    }
    if here.contains("gateway")
        && !config.gateway.listen.ip().is_loopback()
        && config.wallet.domains == rialto_core::config::WalletConfig::default().domains
    {
        anyhow::bail!(
            "gateway.listen = {} is not a loopback address but wallet.domains is its localhost \
             default: name the host clients reach the gateway by in [wallet] domains \
             (e.g. RIALTO_WALLET__DOMAINS='[\"api.example.com\"]')",
            config.gateway.listen
        );
    }
    Ok(())
}

/// A lazy channel to a remote service: processes of a split deployment may
/// start in any order. Keepalives find dead peers; `call_timeout` bounds
/// unary calls (none for the router, whose streams may run for minutes).
/// Each thread that calls makes its own on first use, so that a call stays
/// on its HTTP worker's thread ([`PerThread`]).
fn channel(
    url: &str,
    service: &str,
    call_timeout: Option<Duration>,
) -> anyhow::Result<PerThread<Channel>> {
    let host = url
        .parse::<http::Uri>()
        .ok()
        .and_then(|uri| uri.host().map(str::to_owned))
        .unwrap_or_default();
    let endpoint = endpoint(url, service, call_timeout, &host)?;
    Ok(PerThread::new(move || endpoint.connect_lazy()))
}

/// The certificate authority `https://` remotes are checked against
/// (`grpc.tls.ca_file`), read once at start.
static REMOTE_CA: std::sync::OnceLock<tonic::transport::Certificate> = std::sync::OnceLock::new();

/// Reads `[grpc.tls]`: the CA for `https://` remotes, and this process's
/// server identity when it has one.
fn load_tls(config: &Config) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
    let tls = &config.grpc.tls;
    let read = |key: &str, path: &std::path::Path| {
        std::fs::read(path).with_context(|| format!("grpc.tls.{key} = {:?}", path.display()))
    };
    if let Some(path) = &tls.ca_file {
        let _ = REMOTE_CA.set(tonic::transport::Certificate::from_pem(read(
            "ca_file", path,
        )?));
    }
    match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => Ok(Some(tonic::transport::ServerTlsConfig::new().identity(
            tonic::transport::Identity::from_pem(read("cert_file", cert)?, read("key_file", key)?),
        ))),
        (None, None) => Ok(None),
        _ => anyhow::bail!("grpc.tls needs both cert_file and key_file, or neither"),
    }
}

/// The settings of every connection to `remote.<service>` at `url`; over
/// TLS for `https://`, checking the server's certificate names `tls_name`.
fn endpoint(
    url: &str,
    service: &str,
    call_timeout: Option<Duration>,
    tls_name: &str,
) -> anyhow::Result<Endpoint> {
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .with_context(|| format!("remote.{service} = {url:?} is not a valid URL"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true);
    if let Some(timeout) = call_timeout {
        endpoint = endpoint.timeout(timeout);
    }
    if url.starts_with("https://") {
        let ca = REMOTE_CA.get().with_context(|| {
            format!("remote.{service} is https:// but grpc.tls.ca_file is unset: set the CA that signed its certificate")
        })?;
        endpoint = endpoint.tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(ca.clone())
                .domain_name(tls_name),
        )?;
    }
    Ok(endpoint)
}

/// A channel to a stateless service (auth, the router): when `url` names a
/// host rather than an address, calls are balanced over every address the
/// name resolves to ([`crate::discovery`]); otherwise as [`channel`].
fn stateless_channel(
    config: &Config,
    url: &str,
    service: &'static str,
    call_timeout: Option<Duration>,
) -> anyhow::Result<PerThread<Channel>> {
    let Some((host, port)) = crate::discovery::named_host(url) else {
        return channel(url, service, call_timeout);
    };
    let every = Duration::from_millis(config.remote.resolve_every_ms.max(100));
    let name = host.clone();
    crate::discovery::balanced_channel(url, host, port, every, move |address| {
        endpoint(address, service, call_timeout, &name)
    })
}

/// Bound on one unary call to auth.
const UNARY_TIMEOUT: Option<Duration> = Some(Duration::from_secs(30));
/// Bound on one call to a limiter or billing replica: a hung replica (its
/// successor took over after `failover.dead_after_ms`) must not hold the
/// requests that reached it before for long.
const REPLICA_TIMEOUT: Option<Duration> = Some(Duration::from_secs(5));
/// How long a shutdown waits for the ledger's writer to write what its
/// log holds.
const LEDGER_FLUSH_AT_SHUTDOWN: Duration = Duration::from_secs(5);

/// The entries of a comma-separated `remote.<service>` list.
fn listed(addresses: &str) -> Vec<String> {
    addresses
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Which entry of `names` (`remote.<service>`) this process is: the one
/// equal to `grpc.advertise`, or else to `http://<grpc.listen>`.
fn own_entry(config: &Config, service: &str, names: &[String]) -> anyhow::Result<usize> {
    let wanted = if config.grpc.advertise.is_empty() {
        format!("http://{}", config.grpc.listen)
    } else {
        config.grpc.advertise.clone()
    };
    names
        .iter()
        .position(|name| name.trim_end_matches('/') == wanted.trim_end_matches('/'))
        .with_context(|| {
            format!(
                "this {service} replica is not in remote.{service} ({}) as {wanted:?}: set \
                 grpc.advertise (RIALTO_GRPC__ADVERTISE) to its entry there",
                names.join(",")
            )
        })
}

/// Heartbeats of a service's replicas when failover applies (several
/// replicas and a bus between processes); `me` when this process is one.
async fn membership(
    config: &Config,
    bus: &Bus,
    service: &'static str,
    names: &[String],
    me: Option<usize>,
    rejoin_at_least: Duration,
) -> anyhow::Result<Membership> {
    if names.len() < 2 || !bus.is_shared() {
        return Ok(Membership::fixed(service, names.to_vec()));
    }
    let timing = Timing::from_config(&config.failover).rejoining_after_at_least(rejoin_at_least);
    Ok(Membership::track(service, names.to_vec(), me, timing, bus).await?)
}

/// Largest gRPC message: a chat body or an uploaded file of the largest
/// accepted size, with room for the framing, and at least 64 MiB for the
/// media a backend answers (four large images, minutes of audio).
fn max_message_bytes(config: &Config) -> usize {
    config
        .gateway
        .max_body_bytes
        .max(config.media.max_upload_bytes)
        .saturating_mul(2)
        .max(64 << 20)
}

async fn serve(mut config: Config, here: BTreeSet<&'static str>) -> anyhow::Result<()> {
    if here.contains("gateway") {
        embedded_operator_token(&mut config)?;
    }
    let brand = rialto_core::Brand::new(&config.brand);
    let server_tls = load_tls(&config)?;
    let client_token = ClientToken::new(config.grpc.token.as_ref())?;
    let server_token = ServerToken::new(config.grpc.token.as_ref());
    if let (Some(path), Some(secret)) = (&config.grpc.token_file, server_token.secret()) {
        // The server checks the new token and every client of this process
        // sends it from the same moment on.
        let client = client_token.clone();
        rialto_core::secrets::watch(
            "grpc.token_file",
            path.clone(),
            secret.clone(),
            move |token| client.replace(token).map_err(|error| error.to_string()),
        );
    }
    let max_message = max_message_bytes(&config);
    let remote = &config.remote;
    let bus = rialto_core::bus::Bus::from_config(&config.bus, &brand.name)
        .await
        .context("cannot connect the event bus (bus.url)")?;
    let db = if ["auth", "limiter", "billing"]
        .iter()
        .any(|s| here.contains(s))
    {
        let (url, pool) = (&config.database.url, config.database.max_connections);
        let db = if config.database.migrate_on_start {
            rialto_core::db::Database::connect(url, pool).await
        } else {
            rialto_core::db::Database::connect_migrated(url, pool).await
        };
        Some(db.with_context(|| "cannot open the database (database.url)")?)
    } else {
        None
    };
    if let Some(db) = &db {
        db.spawn_checkpointer(std::time::Duration::from_secs(1));
        db.export_pool_metrics("main");
        if let Some(path) = &config.database.url_file {
            let url = rialto_core::secrets::LiveSecret::new(config.database.url.clone().into());
            let db = db.clone();
            rialto_core::secrets::watch("database.url_file", path.clone(), url, move |url| {
                db.set_url(url.expose_secret())
                    .map_err(|error| error.to_string())
            });
        }
    }
    let auth = if let Some(db) = db.clone().filter(|_| here.contains("auth")) {
        AuthClient::new(
            LocalAuth::new(db, &brand.key_prefix)
                .with_wallets(&config.wallet)
                .with_revocations(bus.clone()),
        )
    } else {
        let channel = stateless_channel(&config, &remote.auth, "auth", UNARY_TIMEOUT)?;
        // A key authenticated in the last second needs no call; revocations
        // on the bus drop cached principals at once.
        let remote_auth = AuthClient::new(RemoteAuth::new(channel, client_token.clone()));
        AuthClient::new(CachedAuth::new(remote_auth).with_revocations(bus.clone()))
    };
    // The limiter replica of this process, if it runs one; otherwise every
    // replica listed in remote.limiter, each owning a share of principals.
    if here.contains("limiter") && here.contains("gateway") && remote.limiter.contains(',') {
        anyhow::bail!(
            "remote.limiter lists several replicas, but this process runs a limiter of its \
             own and would ignore them (each process would keep its own windows): run the \
             limiter replicas as separate processes (--services limiter)"
        );
    }
    let limiter_names = listed(&remote.limiter);
    // A limiter replica that comes back owns again only once it has heard a
    // whole window of its successor's admissions.
    let window = Duration::from_secs(config.limits.window_secs);
    let local_limiter = match db.clone().filter(|_| here.contains("limiter")) {
        Some(db) if limiter_names.len() > 1 && bus.is_shared() => {
            let me = own_entry(&config, "limiter", &limiter_names)?;
            let membership =
                membership(&config, &bus, "limiter", &limiter_names, Some(me), window).await?;
            Some(LimiterClient::new(
                LocalLimiter::start_replica(&config, db, bus.clone(), membership).await?,
            ))
        }
        Some(db) => Some(LimiterClient::new(
            LocalLimiter::start(&config, db, bus.clone()).await?,
        )),
        None => None,
    };
    let limiter = match &local_limiter {
        // The bus of this process reaches its own replica.
        Some(local) => RateLimiter::new(
            &config,
            vec![("local".to_owned(), local.clone())],
            Some(bus.clone()),
        ),
        None => {
            let mut replicas = Vec::new();
            for address in &limiter_names {
                let channel = channel(address, "limiter", REPLICA_TIMEOUT)?;
                replicas.push(LimiterClient::new(RemoteLimiter::new(
                    channel,
                    client_token.clone(),
                )));
            }
            anyhow::ensure!(!replicas.is_empty(), "remote.limiter lists no address");
            let membership =
                membership(&config, &bus, "limiter", &limiter_names, None, window).await?;
            // Commits and hits ride the bus when it reaches other processes.
            let shared = bus.is_shared().then(|| bus.clone());
            RateLimiter::with_membership(&config, replicas, membership, shared)
        }
    };
    let billing_names = listed(&remote.billing);
    let billing_replicas = |local: Option<(usize, &BillingClient)>| {
        billing_names
            .iter()
            .enumerate()
            .map(|(index, address)| match local {
                Some((me, client)) if me == index => Ok(client.clone()),
                _ => Ok(BillingClient::new(RemoteBilling::new(
                    channel(address, "billing", REPLICA_TIMEOUT)?,
                    client_token.clone(),
                ))),
            })
            .collect::<anyhow::Result<Vec<_>>>()
    };
    // This process's ledger book, flushed at shutdown.
    let mut ledger_book = None;
    let billing = if let Some(db) = db.clone().filter(|_| here.contains("billing")) {
        let local = LocalBilling::new(&config, db).with_events(bus.clone());
        let book = local.book().clone();
        ledger_book = Some(book.clone());
        book.export_top_spenders(config.metrics.top_spenders);
        let replica = if billing_names.len() > 1 && bus.is_shared() {
            // One replica of several: it decides for its own ledgers, and
            // settles a queued usage record through the replica owning it.
            let me = own_entry(&config, "billing", &billing_names)?;
            let membership = membership(
                &config,
                &bus,
                "billing",
                &billing_names,
                Some(me),
                Duration::ZERO,
            )
            .await?;
            book.join(membership.clone());
            Some((me, membership))
        } else {
            None
        };
        // After the join: a replica's sweeper recovers only its own owners'
        // holds, and loads each as a replica (claiming, not taking it).
        local.spawn_sweeper();
        let billing = BillingClient::new(local);
        let consumer = match replica {
            Some((me, membership)) => BillingClient::new(ReplicatedBilling::with_membership(
                billing_replicas(Some((me, &billing)))?,
                membership,
            )?),
            None => billing.clone(),
        };
        rialto_billing::usage_queue::spawn_usage_consumer(consumer, bus.clone());
        billing
    } else {
        // Every replica listed in remote.billing, each owning a share of
        // ledger owners.
        let mut replicas = billing_replicas(None)?;
        anyhow::ensure!(!replicas.is_empty(), "remote.billing lists no address");
        if replicas.len() == 1 {
            replicas.remove(0)
        } else {
            let membership = membership(
                &config,
                &bus,
                "billing",
                &billing_names,
                None,
                Duration::ZERO,
            )
            .await?;
            BillingClient::new(ReplicatedBilling::with_membership(replicas, membership)?)
        }
    };
    let router = if here.contains("router") {
        let router = Arc::new(LocalRouter::new(&config.models, &config.router)?);
        export_backend_health(&router);
        RouterClient::from_arc(router)
    } else {
        let channel = stateless_channel(&config, &remote.router, "router", None)?;
        RouterClient::new(RemoteRouter::new(channel, client_token, max_message))
    };
    let services = Services {
        auth,
        limiter,
        billing,
        router,
        usage_queue: (here.contains("billing") || bus.is_shared()).then(|| bus.clone()),
        bus: Some(bus.clone()),
    };

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    // What readiness goes false on, first thing at shutdown.
    let mut grpc_health = None;
    let mut gateway_ready = None;
    let drain = Duration::from_secs(config.shutdown.drain_secs.max(1));

    // gRPC is served for the services that run here whenever the gateway
    // does not, or runs with others elsewhere; the all-in-one process needs none.
    let backend_services: Vec<&str> = here.iter().copied().filter(|s| *s != "gateway").collect();
    let all_in_one = here.len() == SERVICES.len();
    if !backend_services.is_empty() && !all_in_one {
        let listener = tokio::net::TcpListener::bind(config.grpc.listen)
            .await
            .with_context(|| format!("cannot listen on grpc.listen = {}", config.grpc.listen))?;
        let addr = listener.local_addr()?;
        println!(
            "rialto: grpc listening on {addr} ({}{})",
            backend_services.join(","),
            if config.grpc.tls.cert_file.is_some() {
                ", tls"
            } else {
                ""
            }
        );
        tracing::info!(%addr, services = backend_services.join(","), "grpc listening");
        let (health, health_service) = tonic_health::server::health_reporter();
        grpc_health = Some((
            health.clone(),
            backend_services
                .iter()
                .map(|service| format!("rialto.{service}.v1.{}", capitalized(service)))
                .collect::<Vec<_>>(),
        ));
        let local = |name: &str| here.contains(name);
        let token = &server_token;
        for service in &backend_services {
            let name = format!("rialto.{service}.v1.{}", capitalized(service));
            health
                .set_service_status(name, tonic_health::ServingStatus::Serving)
                .await;
        }
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = server_tls {
            builder = builder
                .tls_config(tls)
                .context("grpc.tls: the certificate or key is not valid PEM")?;
        }
        let server = builder
            .tcp_nodelay(true)
            .layer(crate::grpc_metrics::GrpcMetricsLayer)
            .add_service(health_service)
            .add_optional_service(
                local("auth")
                    .then(|| rialto_auth::grpc::server(services.auth.clone(), token.clone())),
            )
            .add_optional_service(
                local_limiter
                    .clone()
                    .map(|limiter| rialto_limiter::grpc::server(limiter, token.clone())),
            )
            .add_optional_service(
                local("billing")
                    .then(|| rialto_billing::grpc::server(services.billing.clone(), token.clone())),
            )
            .add_optional_service(local("router").then(|| {
                rialto_router::grpc::server(services.router.clone(), token.clone(), max_message)
            }));
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            server
                .serve_with_incoming_shutdown(
                    // Our own listener (bound to report its port), so tonic's
                    // tcp_nodelay does not reach accepted sockets: set it here,
                    // or Nagle's algorithm adds ~40 ms to small replies.
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    async move {
                        let _ = stop.wait_for(|stopped| *stopped).await;
                    },
                )
                .await
                .context("grpc server failed")
        });
    }

    if !config.metrics.listen.is_empty() {
        let listener = std::net::TcpListener::bind(&config.metrics.listen).with_context(|| {
            format!(
                "cannot listen on metrics.listen = {}",
                config.metrics.listen
            )
        })?;
        let addr = listener.local_addr()?;
        let server = rialto_gateway::serve_metrics(listener)?;
        let handle = server.handle();
        println!("rialto: metrics on http://{addr}/metrics");
        tracing::info!(%addr, "metrics listening");
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
            handle.stop(true).await;
        });
        tasks.spawn(async move { server.await.context("metrics server failed") });
    }

    if here.contains("gateway") {
        let listener =
            rialto_core::net::listen(config.gateway.listen, config.gateway.listen_backlog)
                .with_context(|| {
                    format!(
                        "cannot listen on gateway.listen = {}",
                        config.gateway.listen
                    )
                })?;
        let addr = listener.local_addr()?;
        // Documents are read by this binary in a bounded child process.
        let program = std::env::current_exe().context("cannot find this binary's path")?;
        let gateway = Arc::new(
            Gateway::new(&config, services.clone(), REVISION)?
                .with_converter(rialto_gateway::convert::Converter::subprocess(program)),
        );
        gateway_ready = Some(Arc::clone(&gateway));
        if let (Some(path), Some(token)) = (&config.operator.token_file, gateway.operator_token()) {
            rialto_core::secrets::watch("operator.token_file", path.clone(), token.clone(), |_| {
                Ok(())
            });
        }
        // Queued video and audio jobs, claimed from the shared job table.
        rialto_gateway::jobs::spawn_workers(Arc::clone(&gateway), stop_rx.clone());
        let server = rialto_gateway::serve(listener, gateway, config.gateway.workers, drain)?;
        let handle = server.handle();
        println!("rialto: gateway listening on http://{addr}");
        tracing::info!(%addr, revision = REVISION, brand = brand.name, "gateway listening");
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
            handle.stop(true).await;
        });
        tasks.spawn(async move { server.await.context("http server failed") });
    }

    // Models, prices, limits and characters follow the configuration file
    // (polled, and on SIGHUP) without a restart: see reload.rs.
    crate::reload::spawn(
        config.file.clone(),
        crate::reload::Targets {
            gateway: gateway_ready.clone(),
            limiter: services.limiter.clone(),
            billing: services.billing.clone(),
            router: services.router.clone(),
        },
    );

    let shutdown_delay = Duration::from_millis(config.shutdown.delay_ms);
    tokio::spawn(async move {
        shutdown_signal().await;
        // Readiness first, so load balancers stop sending; then the
        // listeners close and what is in flight drains.
        tracing::info!("shutting down: not ready any more");
        if let Some(gateway) = &gateway_ready {
            gateway.start_draining();
        }
        if let Some((health, names)) = &grpc_health {
            for name in names {
                health
                    .set_service_status(name, tonic_health::ServingStatus::NotServing)
                    .await;
            }
        }
        tokio::time::sleep(shutdown_delay).await;
        tracing::info!("shutting down: draining requests in flight");
        let _ = stop_tx.send(true);
    });
    while let Some(result) = tasks.join_next().await {
        result.context("server task panicked")??;
    }
    // Settlements handed to background tasks (clients that left, broken
    // streams) finish before the process does, and queued events leave.
    if !rialto_gateway::settlements_drained(drain).await {
        tracing::warn!("shutting down with settlements unfinished; their holds will expire");
    }
    if let Err(error) = bus.flush().await {
        tracing::warn!(%error, "events not flushed");
    }
    // What the ledger's log holds and the database does not yet (streams'
    // opens the writer held back among it) is written now, rather than
    // read and applied again at the next start. Not for ever: a database
    // that refuses writes has the writer retrying while its log keeps
    // every record, and the next start applies them.
    if let Some(book) = &ledger_book {
        let unflushed = "the ledger's writer not flushed; the next start applies its log";
        match tokio::time::timeout(LEDGER_FLUSH_AT_SHUTDOWN, book.flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "{unflushed}"),
            Err(_) => tracing::warn!(waited = ?LEDGER_FLUSH_AT_SHUTDOWN, "{unflushed}"),
        }
    }
    tracing::info!("shut down");
    Ok(())
}

/// Each backend's circuit and requests in flight, read at every scrape.
fn export_backend_health(router: &Arc<LocalRouter>) {
    let router = Arc::downgrade(router);
    rialto_core::metrics::metrics().on_scrape(move |metrics| {
        let Some(router) = router.upgrade() else {
            return;
        };
        for backend in router.backend_health() {
            let labels = rialto_core::metrics::BackendLabels {
                model: backend.model,
                backend: backend.backend,
            };
            let state = match backend.state {
                rialto_router::CircuitState::Closed => 0,
                rialto_router::CircuitState::HalfOpen => 1,
                rialto_router::CircuitState::Open => 2,
                rialto_router::CircuitState::Down => 3,
            };
            metrics
                .backend_circuit_state
                .get_or_create(&labels)
                .set(state);
            metrics
                .backend_in_flight
                .get_or_create(&labels)
                .set(i64::try_from(backend.in_flight).unwrap_or(i64::MAX));
        }
    });
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}

fn capitalized(name: &str) -> String {
    let mut chars = name.chars();
    chars
        .next()
        .map(|first| first.to_ascii_uppercase().to_string() + chars.as_str())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> Config {
        Config::from_toml(text).unwrap()
    }

    fn services(names: &str) -> BTreeSet<&'static str> {
        let names = names.split(',').map(str::to_owned).collect();
        selected_services(&config(""), Some(names)).unwrap()
    }

    #[test]
    fn grpc_on_a_public_address_needs_a_token() {
        let billing = services("billing");
        let open = config("[grpc]\nlisten = \"0.0.0.0:9090\"");
        let error = refuse_open_exposure(&open, &billing).unwrap_err();
        assert!(error.to_string().contains("grpc.token"), "{error}");
        let closed = config("[grpc]\nlisten = \"0.0.0.0:9090\"\ntoken = \"t\"");
        refuse_open_exposure(&closed, &billing).unwrap();
        refuse_open_exposure(&config(""), &billing).unwrap();
        // The all-in-one process serves no gRPC at all.
        let all = services("gateway,auth,limiter,billing,router");
        refuse_open_exposure(&open, &all).unwrap();
    }

    #[test]
    fn a_public_gateway_needs_its_wallet_domains() {
        let gateway = services("gateway");
        let public = config("[gateway]\nlisten = \"0.0.0.0:8080\"");
        let error = refuse_open_exposure(&public, &gateway).unwrap_err();
        assert!(error.to_string().contains("wallet.domains"), "{error}");
        let named = config(
            "[gateway]\nlisten = \"0.0.0.0:8080\"\n[wallet]\ndomains = [\"api.example.com\"]",
        );
        refuse_open_exposure(&named, &gateway).unwrap();
        refuse_open_exposure(&config(""), &gateway).unwrap();
    }
}
