//! A sentence-embedding BERT (all-MiniLM-L6-v2 and its kind) on candle:
//! safetensors weights, a Hugging Face `tokenizer.json`, mean pooling over
//! the attention mask and L2 normalisation, as sentence-transformers does.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer};
use tokio::sync::Semaphore;

use crate::LocalError;

/// How an embedding model is run.
#[derive(Debug, Clone)]
pub struct EmbeddingOptions {
    /// Directory with `config.json`, `tokenizer.json` and
    /// `model.safetensors` (and optionally `sentence_bert_config.json`).
    pub path: PathBuf,
    /// Batches that may wait while one runs.
    pub max_queue: usize,
}

/// The vectors of one batch of inputs.
#[derive(Debug, Clone)]
pub struct Embeddings {
    /// One unit-length vector per input, in input order.
    pub vectors: Vec<Vec<f32>>,
    /// Tokens embedded, special tokens included.
    pub tokens: u32,
}

/// A loaded embedding model; cheap to clone.
#[derive(Clone)]
pub struct EmbeddingModel {
    inner: Arc<Inner>,
}

struct Inner {
    model: BertModel,
    tokenizer: Tokenizer,
    /// Longest input in tokens (`max_seq_length`), special tokens included.
    max_tokens: usize,
    dimensions: usize,
    /// A permit per batch allowed to run or wait.
    admission: Semaphore,
    /// One batch computes at a time; candle already uses every core.
    running: Semaphore,
}

impl std::fmt::Debug for EmbeddingModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddingModel")
            .field("dimensions", &self.inner.dimensions)
            .finish()
    }
}

fn load_error(what: impl std::fmt::Display) -> LocalError {
    LocalError::Load(what.to_string())
}

impl EmbeddingModel {
    /// Loads the model; blocking (reads ~90 MB).
    pub fn load(options: &EmbeddingOptions) -> Result<Self, LocalError> {
        let dir = &options.path;
        let read = |name: &str| {
            std::fs::read(dir.join(name))
                .map_err(|e| load_error(format!("{}/{name}: {e}", dir.display())))
        };
        let config: Config = serde_json::from_slice(&read("config.json")?)
            .map_err(|e| load_error(format!("config.json: {e}")))?;
        let max_tokens = read("sentence_bert_config.json")
            .ok()
            .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
            .and_then(|c| c["max_seq_length"].as_u64())
            .map_or(config.max_position_embeddings, |n| n as usize)
            .min(config.max_position_embeddings);
        let mut tokenizer = Tokenizer::from_bytes(read("tokenizer.json")?)
            .map_err(|e| load_error(format!("tokenizer.json: {e}")))?;
        // Inputs are padded to the longest of their batch and never cut:
        // a too-long input is refused rather than silently truncated.
        tokenizer.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            ..Default::default()
        }));
        tokenizer
            .with_truncation(None)
            .map_err(|e| load_error(format!("tokenizer: {e}")))?;
        let weights = VarBuilder::from_buffered_safetensors(
            read("model.safetensors")?,
            DType::F32,
            &Device::Cpu,
        )
        .map_err(|e| load_error(format!("model.safetensors: {e}")))?;
        let model =
            BertModel::load(weights, &config).map_err(|e| load_error(format!("BERT: {e}")))?;
        Ok(Self {
            inner: Arc::new(Inner {
                model,
                tokenizer,
                max_tokens,
                dimensions: config.hidden_size,
                admission: Semaphore::new(options.max_queue + 1),
                running: Semaphore::new(1),
            }),
        })
    }

    pub fn dimensions(&self) -> usize {
        self.inner.dimensions
    }

    /// Embeds `inputs`; refuses at once when the queue is full.
    pub async fn embed(&self, inputs: Vec<String>) -> Result<Embeddings, LocalError> {
        let _admitted = self
            .inner
            .admission
            .try_acquire()
            .map_err(|_| LocalError::QueueFull)?;
        let _running = self
            .inner
            .running
            .acquire()
            .await
            .map_err(|_| LocalError::Stopped)?;
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || inner.embed(inputs))
            .await
            .map_err(|e| LocalError::Inference(e.to_string()))?
    }

    /// Embeds on the calling thread (blocking).
    pub fn embed_blocking(&self, inputs: Vec<String>) -> Result<Embeddings, LocalError> {
        self.inner.embed(inputs)
    }
}

impl Inner {
    fn embed(&self, inputs: Vec<String>) -> Result<Embeddings, LocalError> {
        if inputs.is_empty() {
            return Ok(Embeddings {
                vectors: Vec::new(),
                tokens: 0,
            });
        }
        let encodings = self
            .tokenizer
            .encode_batch(inputs, true)
            .map_err(|e| LocalError::Inference(format!("tokenizer: {e}")))?;
        let mut tokens = 0usize;
        for encoding in &encodings {
            let length = encoding
                .get_attention_mask()
                .iter()
                .filter(|&&m| m == 1)
                .count();
            if length > self.max_tokens {
                return Err(LocalError::InputTooLong {
                    tokens: length,
                    max: self.max_tokens,
                });
            }
            tokens += length;
        }
        let rows = encodings.len();
        let width = encodings.first().map_or(0, |e| e.get_ids().len());
        let flat = |field: fn(&tokenizers::Encoding) -> &[u32]| {
            let values: Vec<u32> = encodings
                .iter()
                .flat_map(|e| field(e).iter().copied())
                .collect();
            Tensor::from_vec(values, (rows, width), &Device::Cpu)
        };
        let compute = || -> candle_core::Result<Vec<Vec<f32>>> {
            let ids = flat(tokenizers::Encoding::get_ids)?;
            let type_ids = flat(tokenizers::Encoding::get_type_ids)?;
            let mask = flat(tokenizers::Encoding::get_attention_mask)?;
            let hidden = self.model.forward(&ids, &type_ids, Some(&mask))?;
            // Mean over the real tokens only, then unit length.
            let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
            let summed = hidden.broadcast_mul(&mask)?.sum(1)?;
            let counts = mask.sum(1)?;
            let mean = summed.broadcast_div(&counts)?;
            let norms = mean.sqr()?.sum_keepdim(1)?.sqrt()?;
            mean.broadcast_div(&norms)?.to_vec2::<f32>()
        };
        let vectors = compute().map_err(|e| LocalError::Inference(e.to_string()))?;
        Ok(Embeddings {
            vectors,
            tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
        })
    }
}
