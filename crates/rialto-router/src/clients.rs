//! The upstream HTTP client, one per thread.
//!
//! A pooled connection of a `reqwest::Client` is a task of the runtime
//! that opened it, so with one client for the process a request on one
//! HTTP worker that reuses a connection opened by another waits for two
//! cross-thread wake-ups. Each thread here gets its own client, built the
//! same way ([`PerThread`]), so its requests use the connections its own
//! runtime drives.

use rialto_core::per_thread::PerThread;

/// Clients of one router, one per thread that sends.
pub(crate) struct Clients {
    per_thread: PerThread<reqwest::Client>,
    /// Built first (so a bad setting fails at start), and a thread's client
    /// when its own cannot be built; the health probes use it.
    shared: reqwest::Client,
}

impl Clients {
    pub(crate) fn new(
        build: impl Fn() -> reqwest::Result<reqwest::Client> + Send + Sync + 'static,
    ) -> reqwest::Result<Self> {
        let shared = build()?;
        let fallback = shared.clone();
        Ok(Self {
            per_thread: PerThread::new(move || build().unwrap_or_else(|_| fallback.clone())),
            shared,
        })
    }

    /// The calling thread's client (built at its first request).
    pub(crate) fn get(&self) -> reqwest::Client {
        self.per_thread.get()
    }

    /// A client for tasks that may run on any thread (health probes).
    pub(crate) fn shared(&self) -> reqwest::Client {
        self.shared.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn each_thread_builds_its_own_client_once() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let built = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&built);
        let clients = Arc::new(
            Clients::new(move || {
                counter.fetch_add(1, Ordering::Relaxed);
                reqwest::Client::builder().build()
            })
            .unwrap(),
        );
        assert_eq!(built.load(Ordering::Relaxed), 1, "the shared one, at start");
        let _ = clients.get();
        let _ = clients.get();
        assert_eq!(built.load(Ordering::Relaxed), 2, "one for this thread");
        let elsewhere = Arc::clone(&clients);
        std::thread::spawn(move || {
            let _ = elsewhere.get();
        })
        .join()
        .unwrap();
        assert_eq!(
            built.load(Ordering::Relaxed),
            3,
            "another thread builds its own"
        );
        let _ = clients.shared();
        assert_eq!(built.load(Ordering::Relaxed), 3);
    }
}
