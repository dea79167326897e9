//! Test kit: what Rialto's tests need to exercise the real thing.
//!
//! - [`MockUpstream`]: an OpenAI-compatible server (non-stream, stream, `n`,
//!   failures, delays), steered per request through a `mock` body member that
//!   the gateway passes through untouched; it also answers OpenAI's image and
//!   audio calls with real media made at request time ([`mock_media`]), and
//!   its video API with real MP4 files ([`mock_video`]).
//! - [`Sandbox`]: starts the real `rialto` binary in the one-process or the
//!   split topology on ephemeral ports, with a fresh SQLite file or a fresh
//!   PostgreSQL database, and cleans up after itself.
//!
//! - [`Facilitator`]: an x402 facilitator double (`/verify`, `/settle`)
//!   with answers the test chooses.
//!
//! - [`documents`]: PDFs and workbooks, plain and hostile, for file parts.
//!
//! - [`MockSearxng`]: a SearXNG JSON API that records its queries, and a
//!   server of web pages to scrape.
//!
//! Nothing here is used in production code.

pub mod collector;
pub mod documents;
pub mod facilitator;
pub mod mock_media;
pub mod mock_upstream;
pub mod mock_video;
pub mod rpc_node;
pub mod sandbox;
pub mod searxng;
mod server;

pub use collector::{CollectedSpan, OtlpCollector};
pub use facilitator::{Behaviour, Facilitator};
pub use mock_upstream::MockUpstream;
pub use rpc_node::RpcNode;
pub use sandbox::{Account, GRPC_TOKEN, Sandbox, SandboxBuilder, Storage, Topology, rialto_binary};
pub use searxng::MockSearxng;
