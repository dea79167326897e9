//! `rialto serve`: builds a client for each service (local or gRPC), serves
//! the HTTP API when the gateway runs here, and serves gRPC for the services
//! that run here when another process needs them.

use std::collections::BTreeSet;
use std::sync::Arc;

use anyhow::Context;
use rialto_auth::{AuthClient, LocalAuth};
use rialto_billing::{BillingClient, LocalBilling};
use rialto_core::Config;
use rialto_core::config::SERVICES;
use rialto_gateway::{Gateway, Services};
use rialto_limiter::{LimiterClient, LocalLimiter};
use rialto_router::{LocalRouter, RouterClient};
use tonic::transport::{Channel, Endpoint};

use crate::REVISION;

pub fn run(config: Config, services: Option<Vec<String>>) -> anyhow::Result<()> {
    rialto_core::telemetry::init(&config.log.format, &config.log.level);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let here = selected_services(&config, services)?;
    // One process, one runtime: actix's System on a multi-thread Tokio
    // runtime, with tonic beside it.
    actix_rt::System::with_tokio_rt(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|error| {
                eprintln!("rialto: cannot start the runtime: {error}");
                std::process::exit(1)
            })
    })
    .block_on(serve(config, here))
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

fn channel(url: &str, service: &str) -> anyhow::Result<Channel> {
    // Lazy: processes of a split deployment may start in any order.
    Ok(Endpoint::from_shared(url.to_owned())
        .with_context(|| format!("remote.{service} = {url:?} is not a valid URL"))?
        .tcp_nodelay(true)
        .connect_lazy())
}

async fn serve(config: Config, here: BTreeSet<&'static str>) -> anyhow::Result<()> {
    let brand = rialto_core::Brand::new(&config.brand);
    let auth = if here.contains("auth") {
        let db = rialto_core::db::Database::connect(
            &config.database.url,
            config.database.max_connections,
        )
        .await
        .with_context(|| "cannot open the database (database.url)")?;
        AuthClient::new(LocalAuth::new(db, &brand.key_prefix))
    } else {
        AuthClient::new(rialto_auth::grpc::RemoteAuth::new(channel(
            &config.remote.auth,
            "auth",
        )?))
    };
    let limiter = if here.contains("limiter") {
        LimiterClient::new(LocalLimiter)
    } else {
        LimiterClient::new(rialto_limiter::grpc::RemoteLimiter::new(channel(
            &config.remote.limiter,
            "limiter",
        )?))
    };
    let billing = if here.contains("billing") {
        BillingClient::new(LocalBilling::new(&config.models))
    } else {
        BillingClient::new(rialto_billing::grpc::RemoteBilling::new(channel(
            &config.remote.billing,
            "billing",
        )?))
    };
    let router = if here.contains("router") {
        RouterClient::new(LocalRouter::new(&config.models, &config.router)?)
    } else {
        RouterClient::new(rialto_router::grpc::RemoteRouter::new(channel(
            &config.remote.router,
            "router",
        )?))
    };
    let services = Services {
        auth,
        limiter,
        billing,
        router,
    };

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();

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
            "rialto: grpc listening on {addr} ({})",
            backend_services.join(",")
        );
        tracing::info!(%addr, services = backend_services.join(","), "grpc listening");
        let (health, health_service) = tonic_health::server::health_reporter();
        let local = |name: &str| here.contains(name);
        for service in &backend_services {
            let name = format!("rialto.{service}.v1.{}", capitalized(service));
            health
                .set_service_status(name, tonic_health::ServingStatus::Serving)
                .await;
        }
        let server = tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .add_service(health_service)
            .add_optional_service(
                local("auth").then(|| rialto_auth::grpc::server(services.auth.clone())),
            )
            .add_optional_service(
                local("limiter").then(|| rialto_limiter::grpc::server(services.limiter.clone())),
            )
            .add_optional_service(
                local("billing").then(|| rialto_billing::grpc::server(services.billing.clone())),
            )
            .add_optional_service(
                local("router").then(|| rialto_router::grpc::server(services.router.clone())),
            );
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            server
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    async move {
                        let _ = stop.wait_for(|stopped| *stopped).await;
                    },
                )
                .await
                .context("grpc server failed")
        });
    }

    if here.contains("gateway") {
        let listener = std::net::TcpListener::bind(config.gateway.listen).with_context(|| {
            format!(
                "cannot listen on gateway.listen = {}",
                config.gateway.listen
            )
        })?;
        let addr = listener.local_addr()?;
        let gateway = Arc::new(Gateway::new(&config, services.clone(), REVISION)?);
        let server = rialto_gateway::serve(listener, gateway, config.gateway.workers)?;
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

    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        let _ = stop_tx.send(true);
    });
    while let Some(result) = tasks.join_next().await {
        result.context("server task panicked")??;
    }
    Ok(())
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
