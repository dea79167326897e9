//! Models served inside this process: the `local` backend kind.
//!
//! An [`InProcessModel`] takes the same OpenAI request body an HTTP backend
//! would receive and answers in the same JSON shapes, so the router treats
//! both kinds alike: selection, retries and failover do not care which one
//! serves.

use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use futures_util::Stream;
use rialto_core::config::BackendConfig;
use rialto_core::{Error, ErrorCode, Result};
use serde_json::{Map, Value};

/// Chunks of a streamed completion, each one `chat.completion.chunk` JSON
/// object (what an SSE `data:` line carries); the last one carries usage.
pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<Vec<u8>>> + Send>>;

#[async_trait]
pub trait InProcessModel: Send + Sync + 'static {
    /// A whole completion: `chat.completion` JSON.
    ///
    /// A full queue is `ErrorCode::Unavailable`, which the router may retry
    /// on another backend.
    async fn chat(&self, body: &Map<String, Value>) -> Result<Vec<u8>>;
    /// A streamed completion; resolves once the model has taken the request.
    async fn chat_stream(&self, body: &Map<String, Value>) -> Result<ChunkStream>;
}

/// Loads the model a `local` backend names.
pub fn load(model_id: &str, config: &BackendConfig) -> Result<Arc<dyn InProcessModel>> {
    let _ = config;
    Err(Error::new(
        ErrorCode::Unavailable,
        format!("model {model_id}: local backends are not built in yet"),
    ))
}
