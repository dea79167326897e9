//! End-to-end tests: the real `rialto` binary on loopback ports, driven over
//! HTTP, in the one-process and the split (gRPC) topologies with the same
//! scenarios. `make test` builds the binary and the Python venv first.

// Scenario helpers are not `#[test]` functions, but they are test code: a
// failed unwrap is a failed assertion.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod admin_cli;
mod balance;
mod billing;
mod characters;
mod chat;
mod console;
mod crash;
mod crypto_rpc;
mod documents;
mod fuzz;
mod internal_tls;
mod keys;
mod limits;
mod local_models;
mod media;
mod media_jobs;
mod metrics;
mod pgbouncer;
mod python;
mod reload;
mod responses;
mod router;
mod secrets;
mod semantics;
mod shutdown;
mod sign_in;
mod support;
mod tracing;
mod wallet;
mod web;
