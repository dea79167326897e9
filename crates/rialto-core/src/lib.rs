//! Shared pieces of Rialto that every service needs and none owns.
//!
//! - [`brand`]: every wire name that carries the brand (`<brand>_parameters`,
//!   `x-<brand>-version`, ...) is derived here and nowhere else.
//! - [`config`]: the layered configuration (defaults, TOML file, `RIALTO_`
//!   environment variables) and the model catalog it declares.
//! - [`error`]: the one error type services return, its code table, and its
//!   mapping to HTTP statuses and gRPC codes.
//! - [`bus`]: the event bus, in-process or NATS.
//! - [`db`]: opening the database chosen by URL scheme and applying migrations.
//! - [`placement`] and [`membership`]: which replica owns a principal, and
//!   which replicas are alive (heartbeats on the bus) to own it.
//! - [`per_thread`]: a client (a gRPC channel, an HTTP client) made on each
//!   thread that calls through it, so its connections run on that thread.
//! - [`telemetry`]: the tracing subscriber.
//!
//! This crate holds no service logic and no HTTP or actor code.

pub mod brand;
pub mod bus;
pub mod config;
pub mod db;
pub mod error;
pub mod grpc_auth;
pub mod hashing;
pub mod ids;
pub mod log_writer;
pub mod membership;
pub mod metrics;
pub mod net;
pub mod per_thread;
pub mod placement;
pub mod secrets;
pub mod telemetry;

pub use brand::Brand;
pub use config::{Config, ModelConfig};
pub use error::{Error, ErrorCode, Result};
