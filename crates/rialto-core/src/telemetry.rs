//! The tracing subscriber: structured logs to stdout, text or JSON.
//!
//! `RUST_LOG` overrides the configured level. Secrets never reach a log line:
//! they are `secrecy` types and are not recorded as fields.

use tracing_subscriber::EnvFilter;

pub fn init(format: &str, level: &str) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stdout);
    // A second init (tests) is harmless: keep the first subscriber.
    let _ = if format == "json" {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// The machine's host name, for `x-<brand>-host-name`.
pub fn host_name() -> String {
    gethostname::gethostname().to_string_lossy().into_owned()
}
