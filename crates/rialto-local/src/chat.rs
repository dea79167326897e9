//! A GGUF chat model on llama.cpp, run by one engine thread per model.
//!
//! The engine thread owns the model and its context (llama.cpp contexts are
//! not shareable), takes generations from a bounded FIFO queue one at a time
//! and sends text as it is produced. A full queue refuses at once
//! ([`LocalError::QueueFull`]); a caller that goes away (its receiver
//! dropped) stops its generation at the next token.
//!
//! Between generations the engine keeps the previous prompt and answer in
//! the KV cache and evaluates only what a new prompt does not share with
//! them, so a conversation's next turn does not pay for its history again.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::LlamaToken;
use tokio::sync::mpsc as async_mpsc;

use crate::LocalError;
use crate::template::ChatTemplate;

/// How a chat model is run.
#[derive(Debug, Clone)]
pub struct ChatOptions {
    /// The GGUF file.
    pub path: PathBuf,
    /// CPU threads; all available cores when `None`.
    pub threads: Option<usize>,
    /// Context window in tokens; the model's trained context (capped at
    /// 8192) when `None`.
    pub context_size: Option<u32>,
    /// Generations that may wait while one runs.
    pub max_queue: usize,
    /// Events a reader may leave unread before its generation is cancelled
    /// ([`DEFAULT_READER_LAG`]): the model serves one generation at a time,
    /// so a reader that stops reading must not hold it for everyone.
    pub reader_lag: usize,
}

/// Events (text pieces, about a token each) a reader may fall behind.
pub const DEFAULT_READER_LAG: usize = 1024;

/// One message of a conversation, already flattened to text.
#[derive(Debug, Clone)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// What to generate and how to sample it.
#[derive(Debug, Clone)]
pub struct Generation {
    pub messages: Vec<Message>,
    /// Tokens to generate at most; up to the context's end when `None`.
    pub max_tokens: Option<u32>,
    /// 0 samples greedily.
    pub temperature: f32,
    pub top_p: f32,
    /// Strings that end the answer; they are not part of it.
    pub stop: Vec<String>,
    /// Fixes the sampler's randomness; random when `None`.
    pub seed: Option<u32>,
}

/// Why a generation ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model ended its turn or a stop string appeared.
    Stop,
    /// `max_tokens` or the context's end was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// What a generation sends, in order: text pieces, then `Done` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Text(String),
    Done {
        finish_reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
        /// Prompt tokens found in the KV cache from the previous generation.
        cached_tokens: u32,
        timings: Timings,
    },
    Failed(LocalError),
}

/// Where a generation's time went, for logs and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// Waiting in the queue.
    pub queued_ms: f64,
    /// Evaluating the prompt tokens not found in the cache.
    pub prompt_ms: f64,
    /// Sampling and evaluating the answer's tokens, text assembly included.
    pub generation_ms: f64,
}

/// What the model says about itself once loaded.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub context_size: u32,
    pub description: String,
}

struct Job {
    generation: Generation,
    events: async_mpsc::Sender<Event>,
    queued_at: Instant,
}

/// A handle on a loaded chat model; cheap to clone.
#[derive(Clone)]
pub struct ChatModel {
    jobs: SyncSender<Job>,
    info: Arc<ModelInfo>,
    reader_lag: usize,
}

impl std::fmt::Debug for ChatModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatModel")
            .field("info", &self.info)
            .finish()
    }
}

/// llama.cpp's backend is initialised once per process.
fn backend() -> Result<&'static LlamaBackend, LocalError> {
    static BACKEND: OnceLock<Result<LlamaBackend, String>> = OnceLock::new();
    BACKEND
        .get_or_init(|| {
            // llama.cpp logs through tracing (at debug), not to stderr.
            llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default());
            LlamaBackend::init().map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| LocalError::Load(format!("llama.cpp backend: {e}")))
}

impl ChatModel {
    /// Loads the model on a new engine thread and waits until it is ready.
    /// Blocking: call it from a blocking context at start.
    pub fn load(options: ChatOptions) -> Result<Self, LocalError> {
        if !options.path.is_file() {
            return Err(LocalError::Load(format!(
                "{} does not exist (make run fetches the built-in model)",
                options.path.display()
            )));
        }
        let (jobs, queue) = mpsc::sync_channel::<Job>(options.max_queue);
        let reader_lag = options.reader_lag.max(1);
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let name = format!(
            "llama:{}",
            options
                .path
                .file_stem()
                .map(|s| s.to_string_lossy())
                .unwrap_or_default()
        );
        std::thread::Builder::new()
            .name(name)
            .spawn(move || engine_thread(options, queue, ready_tx))
            .map_err(|e| LocalError::Load(format!("engine thread: {e}")))?;
        let info = ready_rx
            .recv()
            .map_err(|_| LocalError::Load("the engine thread died while loading".into()))??;
        Ok(Self {
            jobs,
            info: Arc::new(info),
            reader_lag,
        })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Queues a generation. Events arrive on the receiver as the model
    /// produces them; dropping it cancels the generation.
    pub fn generate(
        &self,
        generation: Generation,
    ) -> Result<async_mpsc::Receiver<Event>, LocalError> {
        let (events, receiver) = async_mpsc::channel(self.reader_lag);
        let job = Job {
            generation,
            events,
            queued_at: Instant::now(),
        };
        match self.jobs.try_send(job) {
            Ok(()) => Ok(receiver),
            Err(TrySendError::Full(_)) => Err(LocalError::QueueFull),
            Err(TrySendError::Disconnected(_)) => Err(LocalError::Stopped),
        }
    }
}

/// Runs on the engine thread: loads, reports ready, then serves jobs until
/// every handle is dropped.
fn engine_thread(
    options: ChatOptions,
    queue: mpsc::Receiver<Job>,
    ready: SyncSender<Result<ModelInfo, LocalError>>,
) {
    let engine = match Engine::load(&options) {
        Ok(engine) => engine,
        Err(error) => {
            let _ = ready.send(Err(error));
            return;
        }
    };
    let mut context = match engine.context() {
        Ok(context) => context,
        Err(error) => {
            let _ = ready.send(Err(error));
            return;
        }
    };
    let info = ModelInfo {
        context_size: context.n_ctx(),
        description: engine.description.clone(),
    };
    if ready.send(Ok(info)).is_err() {
        return;
    }
    let mut cache = KvCache::default();
    while let Ok(job) = queue.recv() {
        let waited = job.queued_at.elapsed();
        if job.events.is_closed() {
            continue;
        }
        let outcome = engine.run(&mut context, &mut cache, &job.generation, &job.events);
        match outcome {
            Ok(Some(mut done)) => {
                if let Event::Done {
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    timings,
                    ..
                } = &mut done
                {
                    timings.queued_ms = waited.as_secs_f64() * 1e3;
                    tracing::debug!(
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                        queued_ms = timings.queued_ms,
                        prompt_ms = timings.prompt_ms,
                        generation_ms = timings.generation_ms,
                        "local generation"
                    );
                }
                deliver(&job.events, done);
            }
            // The caller went away.
            Ok(None) => {}
            Err(error) => {
                // The KV cache may be half written: start clean next time.
                context.clear_kv_cache();
                cache.tokens.clear();
                deliver(&job.events, Event::Failed(error));
            }
        }
    }
}

/// Hands an event to the generation's reader without waiting: false when
/// the reader left, or fell [`ChatOptions::reader_lag`] events behind. Then
/// the generation ends there (its reader sees the events end without
/// `Done`), and the model goes on to the next one.
fn deliver(events: &async_mpsc::Sender<Event>, event: Event) -> bool {
    match events.try_send(event) {
        Ok(()) => true,
        Err(async_mpsc::error::TrySendError::Full(_)) => {
            tracing::warn!("a local generation's reader fell behind: generation cancelled");
            false
        }
        Err(async_mpsc::error::TrySendError::Closed(_)) => false,
    }
}

struct Engine {
    model: LlamaModel,
    template: ChatTemplate,
    threads: i32,
    context_size: u32,
    batch_size: usize,
    description: String,
}

/// The tokens whose keys and values the context holds, in order.
#[derive(Default)]
struct KvCache {
    tokens: Vec<LlamaToken>,
}

impl Engine {
    fn load(options: &ChatOptions) -> Result<Self, LocalError> {
        let backend = backend()?;
        let model =
            LlamaModel::load_from_file(backend, &options.path, &LlamaModelParams::default())
                .map_err(|e| LocalError::Load(format!("{}: {e}", options.path.display())))?;
        let source = model
            .meta_val_str("tokenizer.chat_template")
            .map_err(|_| LocalError::Load("the GGUF has no tokenizer.chat_template".into()))?;
        let vocab = model.vocab();
        let piece = |token: LlamaToken| {
            String::from_utf8_lossy(&vocab.token_to_piece(token, true, None)).into_owned()
        };
        let template = ChatTemplate::new(source, piece(vocab.bos()), piece(vocab.eos()))?;
        let threads = options
            .threads
            .or_else(|| std::thread::available_parallelism().ok().map(usize::from))
            .unwrap_or(1);
        let context_size = options
            .context_size
            .unwrap_or_else(|| model.n_ctx_train().min(8192))
            .max(64);
        let description = model
            .meta_val_str("general.name")
            .unwrap_or_else(|_| path_name(&options.path));
        Ok(Self {
            template,
            threads: i32::try_from(threads).unwrap_or(1).max(1),
            context_size,
            batch_size: 512,
            description,
            model,
        })
    }

    fn context(&self) -> Result<LlamaContext<'_>, LocalError> {
        let backend = backend()?;
        let params = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(self.context_size))
            .with_n_batch(self.batch_size as u32)
            .with_n_threads(self.threads)
            .with_n_threads_batch(self.threads);
        self.model
            .new_context(backend, params)
            .map_err(|e| LocalError::Load(format!("context: {e}")))
    }

    /// Generates one answer. `Ok(None)` when the caller went away.
    fn run(
        &self,
        context: &mut LlamaContext<'_>,
        cache: &mut KvCache,
        generation: &Generation,
        events: &async_mpsc::Sender<Event>,
    ) -> Result<Option<Event>, LocalError> {
        let vocab = self.model.vocab();
        let prompt = self.template.render(&generation.messages)?;
        // The template may write the BOS itself; otherwise the vocabulary
        // says whether one goes first.
        let add_special = !self.template.starts_with_bos(&prompt);
        let tokens = vocab.tokenize(prompt.as_bytes(), add_special, true);
        let prompt_tokens = tokens.len() as u32;
        let context_size = context.n_ctx();
        let room = context_size.saturating_sub(prompt_tokens);
        if room == 0 || generation.max_tokens.is_some_and(|max| max > room) {
            return Err(LocalError::ContextLength {
                prompt_tokens,
                max_tokens: generation.max_tokens.unwrap_or(0),
                context_size,
            });
        }
        let budget = generation.max_tokens.unwrap_or(room);

        // Reuse the cached prefix; at least one token is evaluated so the
        // logits belong to this prompt.
        let shared = cache
            .tokens
            .iter()
            .zip(&tokens)
            .take_while(|(a, b)| a == b)
            .count()
            .min(tokens.len() - 1);
        if shared < cache.tokens.len()
            && !context
                .clear_kv_cache_seq(Some(0), Some(shared as u32), None)
                .unwrap_or(false)
        {
            // The cache could not be trimmed: evaluate everything again.
            context.clear_kv_cache();
            cache.tokens.clear();
        }
        let shared = shared.min(cache.tokens.len());
        cache.tokens.truncate(shared);

        let prompt_started = Instant::now();
        let mut batch = LlamaBatch::new(self.batch_size, 1);
        let pending = &tokens[shared..];
        for (chunk_index, chunk) in pending.chunks(self.batch_size).enumerate() {
            batch.clear();
            let base = shared + chunk_index * self.batch_size;
            for (i, token) in chunk.iter().enumerate() {
                let position = base + i;
                let last = position == tokens.len() - 1;
                batch
                    .add(*token, position as i32, &[0], last)
                    .map_err(|e| LocalError::Inference(e.to_string()))?;
            }
            context
                .decode(&mut batch)
                .map_err(|e| LocalError::Inference(e.to_string()))?;
            cache.tokens.extend_from_slice(chunk);
        }

        let prompt_ms = prompt_started.elapsed().as_secs_f64() * 1e3;
        let generation_started = Instant::now();
        let mut sampler = sampler(generation);
        let mut text = TextAssembler::new(&generation.stop);
        let mut generated = 0u32;
        let mut finish_reason = FinishReason::Length;
        let mut position = tokens.len();
        while generated < budget {
            let token = sampler.sample(context, batch.n_tokens() - 1);
            if vocab.is_eog(token) {
                finish_reason = FinishReason::Stop;
                break;
            }
            generated += 1;
            let (visible, stopped) = text.push(&vocab.token_to_piece(token, false, None));
            if !visible.is_empty() && !deliver(events, Event::Text(visible)) {
                return Ok(None);
            }
            if stopped {
                finish_reason = FinishReason::Stop;
                break;
            }
            if position + 1 >= context_size as usize {
                break;
            }
            batch.clear();
            batch
                .add(token, position as i32, &[0], true)
                .map_err(|e| LocalError::Inference(e.to_string()))?;
            context
                .decode(&mut batch)
                .map_err(|e| LocalError::Inference(e.to_string()))?;
            cache.tokens.push(token);
            position += 1;
        }
        let rest = text.finish();
        if !rest.is_empty() && !deliver(events, Event::Text(rest)) {
            return Ok(None);
        }
        Ok(Some(Event::Done {
            finish_reason,
            prompt_tokens,
            completion_tokens: generated,
            cached_tokens: shared as u32,
            timings: Timings {
                queued_ms: 0.0,
                prompt_ms,
                generation_ms: generation_started.elapsed().as_secs_f64() * 1e3,
            },
        }))
    }
}

fn path_name(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Top-p then temperature then a seeded draw; greedy at temperature 0.
fn sampler(generation: &Generation) -> LlamaSampler {
    if generation.temperature <= 0.0 {
        return LlamaSampler::greedy();
    }
    let seed = generation.seed.unwrap_or_else(rand_seed);
    LlamaSampler::chain_simple([
        LlamaSampler::top_p(generation.top_p.clamp(0.0, 1.0), 1),
        LlamaSampler::temp(generation.temperature),
        LlamaSampler::dist(seed),
    ])
}

fn rand_seed() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now()) as u32
}

/// Turns token pieces into text a client can be sent: whole UTF-8
/// characters only (a character may span tokens), and nothing that could
/// still become a stop string.
struct TextAssembler<'a> {
    stop: &'a [String],
    bytes: Vec<u8>,
    /// Decoded text not yet released because a stop string may begin in it.
    held: String,
    stopped: bool,
}

impl<'a> TextAssembler<'a> {
    fn new(stop: &'a [String]) -> Self {
        Self {
            stop,
            bytes: Vec::new(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Adds a piece; returns the text now safe to send and whether a stop
    /// string was found (the text before it is returned, the rest dropped).
    fn push(&mut self, piece: &[u8]) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.bytes.extend_from_slice(piece);
        let valid = match std::str::from_utf8(&self.bytes) {
            Ok(text) => text.len(),
            Err(error) => error.valid_up_to(),
        };
        // `valid` ends on a character boundary, so this always decodes.
        if let Ok(text) = std::str::from_utf8(&self.bytes[..valid]) {
            self.held.push_str(text);
        }
        self.bytes.drain(..valid);
        if let Some(at) = self
            .stop
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.held.truncate(at);
            self.stopped = true;
            return (std::mem::take(&mut self.held), true);
        }
        // Keep back the longest tail that is a prefix of a stop string.
        let keep = self
            .stop
            .iter()
            .map(|s| longest_suffix_prefix(&self.held, s))
            .max()
            .unwrap_or(0);
        let release = self.held.len() - keep;
        let rest = self.held.split_off(release);
        (std::mem::replace(&mut self.held, rest), false)
    }

    /// What is left when the generation ends without a stop string.
    fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let mut rest = std::mem::take(&mut self.held);
        rest.push_str(&String::from_utf8_lossy(&self.bytes));
        self.bytes.clear();
        rest
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`,
/// ending on a char boundary of `text`.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = stop.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop
                    .as_bytes()
                    .starts_with(&text.as_bytes()[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assemble(stop: &[&str], pieces: &[&[u8]]) -> (String, bool) {
        let stop: Vec<String> = stop.iter().map(|s| (*s).to_owned()).collect();
        let mut text = TextAssembler::new(&stop);
        let mut out = String::new();
        for piece in pieces {
            let (visible, stopped) = text.push(piece);
            out.push_str(&visible);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&text.finish());
        (out, false)
    }

    #[test]
    fn characters_split_over_tokens_are_sent_whole() {
        let euro = "€".as_bytes();
        let stop: Vec<String> = Vec::new();
        let mut text = TextAssembler::new(&stop);
        assert_eq!(text.push(&euro[..1]).0, "");
        assert_eq!(text.push(&euro[1..]).0, "€");
    }

    #[test]
    fn a_stop_string_ends_the_text_before_it_even_across_pieces() {
        assert_eq!(
            assemble(&["END"], &[b"one E", b"N", b"D two"]),
            ("one ".into(), true)
        );
        assert_eq!(assemble(&["\n\n"], &[b"a\n", b"b"]), ("a\nb".into(), false));
    }

    #[test]
    fn held_text_that_never_became_a_stop_string_is_released() {
        assert_eq!(assemble(&["STOP"], &[b"ST"]), ("ST".into(), false));
    }

    #[test]
    fn suffix_prefix_respects_char_boundaries() {
        assert_eq!(longest_suffix_prefix("abc", "cde"), 1);
        assert_eq!(longest_suffix_prefix("aé", "éx"), 2);
        assert_eq!(longest_suffix_prefix("abc", "xyz"), 0);
    }
}
