//! The upstream HTTP client, one per thread.
//!
//! A pooled connection of a `reqwest::Client` is a task of the runtime
//! that opened it. actix-web runs each HTTP worker on a single-thread
//! runtime of its own, so with one client for the process a request on one
//! worker that reuses a connection opened by another waits for two
//! cross-thread wake-ups: the other worker writes the request and reads
//! the answer. Each thread here gets its own client, built the same way,
//! so its requests use the connections its own runtime drives.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Builds a client; every thread's is built by the same function.
type Build = dyn Fn() -> reqwest::Result<reqwest::Client> + Send + Sync;

/// Clients of one router, one per thread that sends.
pub(crate) struct Clients {
    id: u64,
    build: Arc<Build>,
    /// Built first (so a bad setting fails at start), and a thread's client
    /// when its own cannot be built; the health probes use it.
    shared: reqwest::Client,
}

thread_local! {
    /// This thread's client of each router (by id).
    static OWN: RefCell<Vec<(u64, reqwest::Client)>> = const { RefCell::new(Vec::new()) };
}

impl Clients {
    pub(crate) fn new(
        build: impl Fn() -> reqwest::Result<reqwest::Client> + Send + Sync + 'static,
    ) -> reqwest::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let shared = build()?;
        Ok(Self {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            build: Arc::new(build),
            shared,
        })
    }

    /// The calling thread's client (built at its first request).
    pub(crate) fn get(&self) -> reqwest::Client {
        OWN.with(|own| {
            let mut own = own.borrow_mut();
            if let Some((_, client)) = own.iter().find(|(id, _)| *id == self.id) {
                return client.clone();
            }
            let client = (self.build)().unwrap_or_else(|_| self.shared.clone());
            own.push((self.id, client.clone()));
            client
        })
    }

    /// A client for tasks that may run on any thread (health probes).
    pub(crate) fn shared(&self) -> reqwest::Client {
        self.shared.clone()
    }
}

impl Drop for Clients {
    fn drop(&mut self) {
        // This thread's entry; other threads' go when they end.
        let _ = OWN.try_with(|own| own.borrow_mut().retain(|(id, _)| *id != self.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_thread_has_its_own_client_and_each_router_its_own() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let clients = Arc::new(Clients::new(|| reqwest::Client::builder().build()).unwrap());
        let _ = clients.get();
        assert_eq!(
            OWN.with(|own| own.borrow().len()),
            1,
            "one client of this router on this thread"
        );
        // The same thread's client again: no second one.
        let _ = clients.get();
        assert_eq!(OWN.with(|own| own.borrow().len()), 1);
        let other = Clients::new(|| reqwest::Client::builder().build()).unwrap();
        let _ = other.get();
        assert_eq!(OWN.with(|own| own.borrow().len()), 2);
        drop(other);
        assert_eq!(OWN.with(|own| own.borrow().len()), 1);
        let elsewhere = {
            let clients = clients.clone();
            std::thread::spawn(move || {
                let _ = clients.get();
                OWN.with(|own| own.borrow().len())
            })
            .join()
            .unwrap()
        };
        assert_eq!(elsewhere, 1, "another thread builds its own");
    }
}
