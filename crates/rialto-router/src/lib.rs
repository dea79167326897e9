//! The inference router: which backend serves a model, and the relay of the
//! OpenAI-compatible exchange with it.
//!
//! [`RouterService`] takes an already validated request body and returns the
//! upstream's answer, whole or as a stream of chunks. [`LocalRouter`] speaks
//! to any OpenAI-compatible server (vLLM, SGLang, llama.cpp, Ollama, hosted
//! APIs) and to models in this process, balancing over a model's backends
//! (weighted power of two choices), retrying with backoff and failing over
//! when a backend is unreachable or answers 5xx/429 before any output, and
//! keeping a circuit breaker per backend (`health.rs`).
//!
//! Invariant: a request is retried only before the first byte of output
//! reaches the caller; after that, failures travel in-band.

use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use futures_util::Stream;
use rialto_core::{Error, Result};
use rialto_proto::router::v1 as pb;
use serde_json::{Map, Value};

mod balance;
mod clients;
pub mod grpc;
mod health;
pub mod inprocess;
mod local;
mod speech;
mod sse;
pub mod thinking;
mod upstream;

pub use health::{BackendHealth, CircuitState};
pub use local::{LocalRouter, RoutesReload};

/// Events of a streamed chat: the backend's name first, then upstream chunks.
pub type ChatStream = Pin<Box<dyn Stream<Item = Result<pb::ChatStreamEvent>> + Send>>;

/// Events of a streamed media call: its start (backend, content type),
/// then the bytes.
pub type MediaStream = Pin<Box<dyn Stream<Item = Result<pb::MediaStreamEvent>> + Send>>;

/// A chat on its way to a backend, its body already parsed and validated by
/// the gateway. In one process it reaches the router as it is, so the body
/// is parsed once; only a hop over gRPC turns it into bytes and back.
#[derive(Debug, Clone, Default)]
pub struct Chat {
    pub request_id: String,
    pub model_id: String,
    /// The OpenAI-compatible request body.
    pub body: Map<String, Value>,
    /// The effective service parameters the router applies.
    pub parameters: pb::ServiceParameters,
}

impl Chat {
    /// The chat a gRPC request carries; 400 when its body is not a JSON object.
    pub fn from_wire(request: pb::ChatRequest) -> Result<Self> {
        let body = serde_json::from_slice(&request.body_json)
            .map_err(|e| Error::invalid(format!("request body is not a JSON object: {e}")))?;
        Ok(Self {
            request_id: request.request_id,
            model_id: request.model_id,
            body,
            parameters: request.parameters.unwrap_or_default(),
        })
    }

    /// The gRPC request that carries this chat to another process.
    pub fn into_wire(self) -> Result<pb::ChatRequest> {
        Ok(pb::ChatRequest {
            body_json: serde_json::to_vec(&self.body).map_err(Error::internal)?,
            request_id: self.request_id,
            model_id: self.model_id,
            parameters: Some(self.parameters),
        })
    }
}

/// The router in domain terms.
#[async_trait]
pub trait RouterService: std::any::Any + Send + Sync {
    async fn chat(&self, chat: Chat) -> Result<pb::ChatResponse>;
    /// Resolves once a backend has accepted the request; errors before that
    /// are returned here, errors after it arrive in the stream.
    async fn chat_stream(&self, chat: Chat) -> Result<ChatStream>;
    /// Embeddings, routed over the model's backends like a chat.
    async fn embed(&self, request: pb::EmbedRequest) -> Result<pb::EmbedResponse>;
    /// An image or audio call, routed over the model's backends like a
    /// chat; the answer's bytes are passed on as the backend sent them.
    async fn media(&self, request: pb::MediaRequest) -> Result<pb::MediaResponse>;
    /// A media call relayed as it arrives; errors before a backend
    /// accepted it are returned here, later ones end the stream.
    async fn media_stream(&self, request: pb::MediaRequest) -> Result<MediaStream>;
    /// Every backend's circuit and requests in flight, by model.
    async fn backends(&self) -> Result<pb::BackendsResponse>;
}

/// A cloneable handle on the router, local or remote.
#[derive(Clone)]
pub struct RouterClient(Arc<dyn RouterService>);

impl RouterClient {
    pub fn new(service: impl RouterService) -> Self {
        Self(Arc::new(service))
    }

    /// A handle on a router the caller keeps a reference to too.
    pub fn from_arc(service: Arc<dyn RouterService>) -> Self {
        Self(service)
    }

    /// The router of this process, when this client is it (a
    /// configuration reload changes its routes).
    pub fn local(&self) -> Option<&LocalRouter> {
        (self.0.as_ref() as &dyn std::any::Any).downcast_ref()
    }
}

impl std::ops::Deref for RouterClient {
    type Target = dyn RouterService;

    fn deref(&self) -> &Self::Target {
        self.0.as_ref()
    }
}

impl std::fmt::Debug for RouterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RouterClient")
    }
}
