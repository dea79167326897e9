//! Per-request balancing over every pod behind a name.
//!
//! A Kubernetes ClusterIP Service hides its pods behind one address, and one
//! HTTP/2 connection to it lands on one pod for its whole life: pods started
//! later get no traffic from a gateway that is already connected. With a
//! headless Service the name resolves to every ready pod instead. For a
//! stateless service named by DNS (`remote.auth`, `remote.router`), the
//! gateway resolves the name every `remote.resolve_every_ms`, keeps a
//! connection to each address that accepts one, and sends each call to the
//! less loaded of two picked at random (tonic's balance channel, tower's
//! power of two choices). One resolver per process finds the addresses;
//! each thread that calls keeps a balancing channel of its own on them, so
//! that a call stays on the calling thread (`rialto_core::per_thread`). An address is added once a connection to it
//! succeeds and removed when the name stops listing it or two probes in a
//! row fail, so a pod that is listed before it listens, or that died before
//! DNS noticed, gets no calls for long.

use std::collections::{BTreeSet, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use rialto_core::per_thread::PerThread;
use tokio::sync::watch;
use tonic::transport::channel::Change;
use tonic::transport::{Channel, Endpoint};

/// How long a probe's connection may take before the address counts as down.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// The key of the stand-in endpoint (the name itself) used while no
/// address is up: calls then fail at once, as on a plain channel, instead of
/// waiting for an address that may never come.
const STAND_IN: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::UNSPECIFIED,
    0,
));

/// The host and port of `url` when its host is a name to resolve, not an
/// address: `http://rialto-router:9090` -> `("rialto-router", 9090)`.
pub fn named_host(url: &str) -> Option<(String, u16)> {
    let uri: http::Uri = url.parse().ok()?;
    let host = uri.host()?;
    let literal = host.trim_start_matches('[').trim_end_matches(']');
    if literal.parse::<std::net::IpAddr>().is_ok() {
        return None;
    }
    let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
        Some("https") => 443,
        _ => 80,
    });
    Some((host.to_owned(), port))
}

/// A channel that balances calls over every address `host` resolves to,
/// each connected with `endpoint_for(address_url)`. One resolver for the
/// process finds the addresses that are up; each thread that calls gets a
/// balancing channel of its own ([`PerThread`]), which follows them. The
/// resolver runs on the current runtime until every channel is dropped.
pub fn balanced_channel(
    url: &str,
    host: String,
    port: u16,
    every: Duration,
    endpoint_for: impl Fn(&str) -> anyhow::Result<Endpoint> + Send + Sync + 'static,
) -> anyhow::Result<PerThread<Channel>> {
    let uri: http::Uri = url
        .parse()
        .with_context(|| format!("{url:?} is not a valid URL"))?;
    // Built once to refuse a bad URL at start, not in a task.
    endpoint_for(url)?;
    // `None` until the first resolution: calls wait for it rather than
    // fail on the stand-in.
    let (up_tx, up_rx) = watch::channel(None);
    tokio::spawn(resolve(host, port, every, up_tx));
    let follow = Arc::new(Follow {
        scheme: uri.scheme_str().unwrap_or("http").to_owned(),
        uri,
        url: url.to_owned(),
        endpoint_for,
    });
    Ok(PerThread::new(move || {
        let (channel, changes) = Channel::balance_channel::<SocketAddr>(64);
        tokio::spawn(Arc::clone(&follow).run(up_rx.clone(), changes));
        channel
    }))
}

/// Every `every`, resolves `host` and probes each address; publishes the
/// set that is up whenever it changes.
async fn resolve(
    host: String,
    port: u16,
    every: Duration,
    up_tx: watch::Sender<Option<BTreeSet<SocketAddr>>>,
) {
    let mut connected: BTreeSet<SocketAddr> = BTreeSet::new();
    let mut failed_once: HashSet<SocketAddr> = HashSet::new();
    loop {
        let listed: HashSet<SocketAddr> = match tokio::net::lookup_host((host.as_str(), port)).await
        {
            Ok(addresses) => addresses.collect(),
            Err(error) => {
                // Keep what works: DNS may be down for a moment.
                tracing::warn!(%host, %error, "cannot resolve; keeping the known addresses");
                connected.iter().copied().collect()
            }
        };
        // Probe every listed address, in parallel.
        let probes = listed.iter().map(|address| async move {
            let up = tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(address))
                .await
                .is_ok_and(|connection| connection.is_ok());
            (*address, up)
        });
        // An address in the balance leaves it after two failed probes in a
        // row (one slow connect under load is no reason to drop a pod) or
        // when the name stops listing it; a new one joins on its first
        // success.
        let mut up = BTreeSet::new();
        for (address, answered) in futures_util::future::join_all(probes).await {
            if answered {
                failed_once.remove(&address);
                up.insert(address);
            } else if connected.contains(&address) && failed_once.insert(address) {
                up.insert(address);
            } else {
                failed_once.remove(&address);
            }
        }
        failed_once.retain(|address| listed.contains(address));
        for gone in connected.difference(&up) {
            tracing::info!(%host, address = %gone, "address left the balance");
        }
        for new in up.difference(&connected) {
            tracing::info!(%host, address = %new, "address joined the balance");
        }
        let first = up_tx.borrow().is_none();
        if first || up != connected {
            up_tx.send_replace(Some(up.clone()));
        }
        connected = up;
        tokio::time::sleep(every).await;
        if up_tx.is_closed() {
            return;
        }
    }
}

/// What a thread's balancing channel needs to follow the resolver.
struct Follow<E> {
    uri: http::Uri,
    scheme: String,
    url: String,
    endpoint_for: E,
}

impl<E: Fn(&str) -> anyhow::Result<Endpoint>> Follow<E> {
    /// Keeps one thread's balancing channel (`changes`) on the addresses
    /// that are up, until the channel or the resolver is gone.
    async fn run(
        self: Arc<Self>,
        mut up_rx: watch::Receiver<Option<BTreeSet<SocketAddr>>>,
        changes: tokio::sync::mpsc::Sender<Change<SocketAddr, Endpoint>>,
    ) {
        let mut inserted: HashSet<SocketAddr> = HashSet::new();
        let mut stand_in = false;
        loop {
            let up = up_rx.borrow_and_update().clone();
            if let Some(up) = up {
                let gone: Vec<SocketAddr> = inserted
                    .iter()
                    .filter(|address| !up.contains(address))
                    .copied()
                    .collect();
                for address in gone {
                    inserted.remove(&address);
                    if changes.send(Change::Remove(address)).await.is_err() {
                        return;
                    }
                }
                for &address in &up {
                    if inserted.contains(&address) {
                        continue;
                    }
                    let endpoint =
                        match (self.endpoint_for)(&format!("{}://{address}", self.scheme)) {
                            // Calls still name the service, not the pod
                            // (`:authority`, and the server name TLS checks).
                            Ok(endpoint) => endpoint.origin(self.uri.clone()),
                            Err(error) => {
                                tracing::warn!(%address, %error, "cannot connect");
                                continue;
                            }
                        };
                    inserted.insert(address);
                    if changes
                        .send(Change::Insert(address, endpoint))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                let none_up = up.is_empty();
                if none_up != stand_in {
                    let change = match (self.endpoint_for)(&self.url) {
                        Ok(endpoint) if none_up => Change::Insert(STAND_IN, endpoint),
                        _ => Change::Remove(STAND_IN),
                    };
                    if changes.send(change).await.is_err() {
                        return;
                    }
                    stand_in = none_up;
                }
            }
            tokio::select! {
                changed = up_rx.changed() => if changed.is_err() { return },
                () = changes.closed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_are_resolved() {
        assert_eq!(
            named_host("http://rialto-router:9090"),
            Some(("rialto-router".to_owned(), 9090))
        );
        assert_eq!(
            named_host("https://auth.rialto.svc"),
            Some(("auth.rialto.svc".to_owned(), 443))
        );
        assert_eq!(named_host("http://127.0.0.1:9090"), None);
        assert_eq!(named_host("http://[::1]:9090"), None);
    }
}
