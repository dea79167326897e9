//! Rialto's in-process models, for the `local` backend kind: a GGUF chat
//! model run by llama.cpp ([`chat`]) and a BERT sentence-embedding model
//! run by candle ([`embed`]).
//!
//! This crate knows nothing of OpenAI's wire shapes or of the router: it
//! takes messages and sampling settings and gives text and token counts.
//! The router adapts it to the OpenAI exchange.
//!
//! Why llama.cpp (through `llama-cpp-2`) for generation: on this project's
//! 2-core reference machine it runs SmolLM2-135M's Q4_1 GGUF at ~100
//! generated tokens/s, where candle's quantized llama has no SIMD kernel
//! for Q4_1 (~20 tok/s as shipped). Embeddings use candle's BERT because the
//! embedding model ships as safetensors, which llama.cpp cannot read.

pub mod chat;
pub mod embed;
mod template;

pub use chat::{
    ChatModel, ChatOptions, DEFAULT_READER_LAG, Event, FinishReason, Generation, Message,
    ModelInfo, Timings,
};
pub use embed::{EmbeddingModel, EmbeddingOptions, Embeddings};

/// Why an in-process model could not serve.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LocalError {
    #[error("the model could not be loaded: {0}")]
    Load(String),
    #[error("the model is busy: its queue is full")]
    QueueFull,
    #[error("the model has stopped")]
    Stopped,
    #[error(
        "the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) exceed the model's context of {context_size} tokens"
    )]
    ContextLength {
        prompt_tokens: u32,
        max_tokens: u32,
        context_size: u32,
    },
    #[error("the chat template refused the conversation: {0}")]
    Template(String),
    #[error("the input is too long: {tokens} tokens, the model takes {max}")]
    InputTooLong { tokens: usize, max: usize },
    #[error("inference failed: {0}")]
    Inference(String),
}
