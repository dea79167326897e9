//! What every double of the test kit shares: an actix-web server on a
//! thread of its own (its own runtime, so a test's runtime neither drives
//! nor blocks it), one worker, no signal handling, stopped when dropped.

use std::net::TcpListener;
use std::sync::mpsc;
use std::time::Duration;

use actix_web::dev::ServerHandle;
use actix_web::{App, HttpServer, web};
use anyhow::Context as _;

/// A running server; dropping it stops it and waits (a little) for its
/// thread.
pub(crate) struct Served {
    handle: ServerHandle,
    done: mpsc::Receiver<()>,
}

/// Serves the routes `configure` adds on `listener`, on a thread named
/// `name`.
pub(crate) async fn serve(
    name: &str,
    listener: TcpListener,
    configure: impl Fn(&mut web::ServiceConfig) + Send + Clone + 'static,
) -> anyhow::Result<Served> {
    let (handle_tx, handle_rx) = tokio::sync::oneshot::channel();
    let (done_tx, done) = mpsc::channel::<()>();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let _done_tx = done_tx;
            actix_web::rt::System::new().block_on(async move {
                let server = HttpServer::new(move || App::new().configure(configure.clone()))
                    .workers(1)
                    .disable_signals()
                    .shutdown_timeout(1)
                    .listen(listener);
                match server {
                    Ok(server) => {
                        let server = server.run();
                        let _ = handle_tx.send(Ok(server.handle()));
                        let _ = server.await;
                    }
                    Err(e) => {
                        let _ = handle_tx.send(Err(e));
                    }
                }
            });
        })?;
    let handle = handle_rx
        .await
        .with_context(|| format!("{name}: its thread exited before starting"))?
        .with_context(|| format!("starting {name}"))?;
    Ok(Served { handle, done })
}

impl Drop for Served {
    fn drop(&mut self) {
        drop(self.handle.stop(false));
        let _ = self.done.recv_timeout(Duration::from_secs(2));
    }
}
