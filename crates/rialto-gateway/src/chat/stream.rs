//! A streamed answer: the router's chunks relayed as SSE, checkpointed
//! while they run, and ended with the usage, the `cost` chunk and
//! `[DONE]` once the settlement is durable.

use std::convert::Infallible;
use std::sync::Arc;

use actix_web::http::header::ContentEncoding;
use actix_web::{HttpResponse, web};
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use rialto_proto::router::v1 as router_pb;
use rialto_proto::router::v1::chat_stream_event::Event;
use serde_json::{Value, json};

use super::chunks::{Chunk, ChunkHead, read_chunk, read_chunk_tree, sse};
use super::metering::{BALANCE_REMAINING, Cost, Usage, UsageJson, usage_or_estimate};
use super::turns::Turn;
use super::{Exchange, in_band_error, model_headers, search_error_header};
use crate::augment;
use crate::{ApiError, Gateway, ModelEntry};

/// Answers with the router's stream. A failure before the backend is
/// named is still an HTTP status; the head leaves with the first chunk
/// (or after [`FIRST_CHUNK_WAIT`]), and the body is the [`Relay`] from there.
pub(super) async fn stream(
    gateway: &web::Data<Gateway>,
    model: &ModelEntry,
    router_request: rialto_router::Chat,
    exchange: Box<Exchange>,
) -> Result<HttpResponse, ApiError> {
    let mut exchange = exchange;
    let mut router_request = router_request;
    // The stream's hold lives on a lease that checkpoints renew: while the
    // web is searched and the backend thinks before its first byte too (a
    // long prompt can take longer than the lease), or the hold would
    // expire and the stream run free.
    let mut checkpoints = checkpoint_clock(exchange.checkpoint_every);
    if let Some(plan) = exchange.web.clone() {
        let searching = augment::run(gateway, model, &plan, &mut router_request);
        tokio::pin!(searching);
        let found = loop {
            tokio::select! {
                found = &mut searching => break found,
                _ = checkpoints.tick() => exchange.settlement.checkpoint(&Usage::completion_only(0)),
            }
        };
        exchange.found(found);
    }
    let opening = gateway.services.router.chat_stream(router_request);
    tokio::pin!(opening);
    let opened = loop {
        tokio::select! {
            opened = &mut opening => break opened,
            _ = checkpoints.tick() => exchange.settlement.checkpoint(&Usage::completion_only(0)),
        }
    };
    let mut events = match opened {
        Ok(events) => events,
        Err(error) => {
            exchange.failed(&error);
            return Err(error.into());
        }
    };
    // The first event names the backend; a failure before it is still an
    // ordinary HTTP error.
    let (backend, retries) = match events.next().await {
        Some(Ok(router_pb::ChatStreamEvent {
            event: Some(Event::Backend(name)),
            retry_count,
        })) => (name, retry_count),
        Some(Err(error)) => {
            exchange.failed(&error);
            return Err(error.into());
        }
        // A router that names no backend: keep whatever came first.
        Some(Ok(first)) => {
            events = Box::pin(futures_util::stream::iter([Ok(first)]).chain(events));
            (String::new(), 0)
        }
        None => (String::new(), 0),
    };
    // A stream's headers leave before its cost is known: what remains
    // after its hold (the most it can cost).
    let remaining = exchange.wallet_usd_before.map(|before| {
        let held: rust_decimal::Decimal = exchange.settlement.held_usd.parse().unwrap_or_default();
        (before - held).normalize().to_string()
    });
    let exchange_error = exchange.found.error.clone();
    // Only a stream that ends with the web's citations writes the echo.
    let echo_names = exchange
        .web
        .as_ref()
        .filter(|plan| plan.in_stream)
        .map(|_| {
            (
                gateway.brand.parameters_field.clone(),
                gateway.brand.include_system_prompt_field.clone(),
            )
        });
    let mut relay = Relay::new(exchange, echo_names);
    // The head leaves with the first chunk, in one write: answered at once,
    // it would go out alone and the first chunk a write (and two turns of
    // a busy worker's queue) later. Anything but an ordinary chunk (the
    // end, a failure, a chunk with nothing for the client) is left to the
    // body, and a backend slow to its first chunk gets its head after
    // `FIRST_CHUNK_WAIT`.
    let mut first = relay.documents_chunk();
    let mut ending = None;
    let deadline = tokio::time::Instant::now() + FIRST_CHUNK_WAIT;
    while first.is_none() && ending.is_none() {
        let Ok(event) = tokio::time::timeout_at(deadline, events.next()).await else {
            break;
        };
        match relay.read(event) {
            Read::Line(line) => first = Some(line),
            Read::Skip => {}
            Read::Ends(end) => ending = Some(end),
        }
    }
    let body = RelayBody::start(relay, events, checkpoints, first, ending);
    let mut response = HttpResponse::Ok();
    response
        .content_type("text/event-stream")
        // Streams are never compressed (the spec applies Accept-Encoding to
        // non-streamed responses only), and must not be buffered by proxies.
        .insert_header(ContentEncoding::Identity)
        .insert_header(("cache-control", "no-cache"))
        .insert_header(("x-accel-buffering", "no"));
    model_headers(&mut response, gateway, model, &backend, retries);
    if let Some(remaining) = remaining {
        response.insert_header((BALANCE_REMAINING, remaining));
    }
    search_error_header(&mut response, gateway, exchange_error.as_deref());
    Ok(response.streaming(body))
}

const DONE: &[u8] = b"data: [DONE]\n\n";

/// How long a stream's head waits for its first chunk to leave with it.
const FIRST_CHUNK_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// One event of the router's stream: `None` once it ended.
type StreamEvent = Option<rialto_core::Result<router_pb::ChatStreamEvent>>;

/// What [`Relay::read`] made of an event.
enum Read {
    /// A chunk for the client, counted.
    Line(Bytes),
    /// Nothing for the client (a usage-only chunk, an event that is not a
    /// chunk).
    Skip,
    /// The stream ends here.
    Ends(Ending),
}

/// How a stream ends.
enum Ending {
    /// It failed: this line for the client, then `[DONE]`.
    Failed(Bytes),
    /// The upstream's stream ended.
    End,
}

/// A stream's relay: what the upstream has sent so far, and the exchange
/// it is billed by. The first chunk is read by the handler (so it leaves
/// with the head), the rest by [`RelayBody`] from the events its
/// [`watch`] read.
struct Relay {
    exchange: Box<Exchange>,
    /// `<brand>_parameters` and `include_<brand>_system_prompt`, when the
    /// stream ends with a chunk of the web's citations.
    echo_names: Option<(String, String)>,
    head: ChunkHead,
    /// The upstream's own `usage`, when it sent one.
    upstream_usage: Option<Value>,
    /// Characters of text sent so far.
    completion_text: usize,
    /// Chunks with text sent so far.
    content_chunks: u64,
    /// Search results as documents: a tool call before the content, and
    /// the choices finish with `tool_calls`.
    documents: Option<Value>,
    /// Billed: its end reached, or ended early.
    ended: bool,
}

/// A relay dropped before it ended was left by its client: in the handler,
/// while it waited for the first chunk (actix drops a handler whose
/// client is gone), or with the response body (or the runtime stopped
/// under it). What the upstream sent so far is billed, off the response
/// path.
impl Drop for Relay {
    fn drop(&mut self) {
        if !self.ended {
            tracing::info!(
                request_id = self.exchange.request_id,
                "client left the stream"
            );
            self.bill_later();
        }
    }
}

impl Relay {
    fn new(exchange: Box<Exchange>, echo_names: Option<(String, String)>) -> Self {
        let head = ChunkHead::new(&exchange.completion_id, &exchange.chat.model_id);
        let documents = exchange
            .web
            .as_ref()
            .and_then(|plan| augment::documents_call(plan, &exchange.found));
        Self {
            exchange,
            echo_names,
            head,
            upstream_usage: None,
            completion_text: 0,
            content_chunks: 0,
            documents,
            ended: false,
        }
    }

    /// The chunk that comes before the upstream's, when search results
    /// are documents: their tool call.
    fn documents_chunk(&mut self) -> Option<Bytes> {
        let call = self.documents.as_ref()?;
        let mut delta_call = call.clone();
        delta_call["index"] = json!(0);
        let choices: Vec<Value> = (0..self.exchange.chat.choices)
            .map(|index| {
                json!({"index": index, "delta": {"role": "assistant", "content": null,
                    "tool_calls": [delta_call]}, "logprobs": null, "finish_reason": null})
            })
            .collect();
        let first = json!({
            "id": self.exchange.completion_id,
            "object": "chat.completion.chunk",
            "created": self.head.created(|| None).clone(),
            "model": self.exchange.chat.model_id,
            "choices": choices,
        });
        Some(sse(&first))
    }

    /// Reads one event of the router's stream, counting the text it
    /// sends.
    fn read(&mut self, event: StreamEvent) -> Read {
        let json = match event {
            None => return Read::Ends(Ending::End),
            Some(Ok(router_pb::ChatStreamEvent {
                event: Some(Event::ChunkJson(json)),
                ..
            })) => json,
            Some(Ok(_)) => return Read::Skip,
            Some(Err(error)) => {
                tracing::warn!(request_id = self.exchange.request_id, %error, "stream failed upstream");
                return Read::Ends(Ending::Failed(sse(&in_band_error(&error))));
            }
        };
        let documents = self.documents.is_some();
        let read = if documents {
            None
        } else {
            read_chunk(&json, &mut self.head, &mut self.upstream_usage)
        };
        let read = read.unwrap_or_else(|| {
            read_chunk_tree(&json, &mut self.head, &mut self.upstream_usage, documents)
        });
        match read {
            Chunk::Forward { line, chars } => {
                self.completion_text += chars;
                self.content_chunks += u64::from(chars > 0);
                Read::Line(line)
            }
            // A usage-only chunk: folded into our final chunk.
            Chunk::Skip => Read::Skip,
            // The upstream reported a failure in-band: passed on as it is.
            Chunk::Error(line) => Read::Ends(Ending::Failed(line)),
        }
    }

    /// Ends the stream before its end (it failed, or its reader was too
    /// slow): what it used so far is billed, off the response path.
    fn bill_later(&mut self) {
        self.ended = true;
        let used = self.used();
        self.exchange.settlement.bill_later(&used);
    }

    /// What the stream used, at its end: the upstream's count, or an
    /// estimate.
    fn used(&mut self) -> Usage {
        usage_or_estimate(
            self.upstream_usage.take(),
            self.exchange.chat.prompt_tokens_estimate,
            self.completion_text,
        )
    }

    /// Records the least the stream has used so far: a token per chunk of
    /// text and no prompt (estimates could overshoot the upstream's own
    /// count), so a crash never charges more than the stream would have
    /// cost. Each checkpoint renews the hold's lease.
    fn checkpoint(&self) {
        self.exchange
            .settlement
            .checkpoint(&Usage::completion_only(self.content_chunks));
    }

    /// The stream's end: billed, then the lines that end it: the final
    /// chunk with `usage` and `cost`, the citations when asked for, and
    /// `[DONE]`.
    async fn finish(mut self) -> Vec<Bytes> {
        self.ended = true;
        let usage = self.used();
        let exchange = &mut self.exchange;
        let created = self.head.created(|| None);
        let last = match exchange.settlement.bill(&usage).await {
            Ok(cost) => sse(&LastChunk {
                choices: [],
                cost: &cost,
                created,
                id: &exchange.completion_id,
                model: &exchange.chat.model_id,
                object: "chat.completion.chunk",
                usage: &usage.json,
            }),
            Err(error) => sse(&json!({"error": {
                "message": error.message(),
                "type": "server_error",
                "code": "billing_error",
                "param": null,
            }})),
        };
        let mut lines = vec![last];
        // The citations, when asked for in the stream: last before `[DONE]`.
        if let (Some(plan), Some((field, include_prompt))) = (
            exchange.web.as_ref().filter(|plan| plan.in_stream),
            &self.echo_names,
        ) {
            let mut parameters = std::mem::take(&mut exchange.chat.parameters);
            augment::echo(&mut parameters, plan, &exchange.found);
            if parameters.web_search_citations.is_some() {
                let citations = json!({
                    "id": exchange.completion_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": exchange.chat.model_id,
                    "choices": [],
                    field: parameters.to_value(include_prompt),
                });
                lines.push(sse(&citations));
            }
        }
        lines.push(Bytes::from_static(DONE));
        lines
    }
}

/// A stream's last chunk, its usage and `cost`, written straight from
/// what the relay holds (building it as a `json!` tree first cost ~10k
/// instructions a stream). Its members are in the order such a tree wrote
/// them (by name), so the line is the one clients always got.
#[derive(serde::Serialize)]
struct LastChunk<'a> {
    choices: [(); 0],
    cost: &'a Cost,
    created: &'a Value,
    id: &'a str,
    model: &'a str,
    object: &'static str,
    usage: &'a UsageJson,
}

/// The rest of a stream, as its response body. The stream's [`watch`]
/// task reads the upstream's events, at most [`READ_AHEAD`] ahead of the
/// client; actix's dispatcher polls the body when the client's connection
/// has room, and the body rewrites the next event into a line and hands it
/// over. So the chunks that arrive together on a worker (a backend's
/// tokens come in bursts) are all read, then all written, one write after
/// another, as a proxy whose upstream connections are tasks of their own
/// does; read and written in one turn each, the writes came a read apart
/// and woke the client's reader for nearly every one (on the 512-stream
/// bench, the load generator on the same two cores), and a new stream's
/// request waited behind them. A slow client slows the reading of the
/// upstream, as a proxy would, and is billed what it was handed. The watch
/// also does what must happen whether the client reads or not:
/// checkpoints, and the end of a reader too slow to take its chunks.
struct RelayBody {
    relaying: Arc<std::sync::Mutex<Relaying>>,
    /// Lines to leave before the next event is taken: the first chunk, or
    /// the lines that end the stream.
    queued: std::vec::IntoIter<Bytes>,
    /// The stream's end being billed by a task of its own (so a client
    /// that leaves meanwhile does not cut the settlement short), with the
    /// lines it ends with.
    finishing: Option<tokio::task::JoinHandle<Vec<Bytes>>>,
    /// The stream's watch: ended with the body, so a stream that ended
    /// leaves neither a task nor a timer behind it.
    watch: tokio::task::AbortHandle,
}

/// A body dropped (the stream ended, or its client left) ends its watch;
/// the relay, if still there, is billed as it drops.
impl Drop for RelayBody {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

/// What the body and its watch share.
struct Relaying {
    /// `None` once the stream is billed or its end is being billed.
    relay: Option<Relay>,
    events: rialto_router::ChatStream,
    /// When the body last handed the client a chunk, while the client has
    /// not come back for the next.
    handed: Option<std::time::Instant>,
    /// The upstream's events the watch read ahead of the client, at most
    /// [`READ_AHEAD`]: the body turns each into a line as it hands it over.
    ahead: std::collections::VecDeque<StreamEvent>,
    /// The watch has read the stream's last event (its end, or a failure).
    read_all: bool,
    /// The body, waiting for an event.
    body: Option<std::task::Waker>,
    /// The watch, waiting for the body to take an event.
    reader: Option<std::task::Waker>,
}

/// Events the watch reads ahead of a client that has not taken them: more
/// than one, so that the watch, having read one, goes on to wait on the
/// upstream rather than on the body; few, so that a client that stops
/// reading soon stops the reading of the upstream.
const READ_AHEAD: usize = 4;

impl RelayBody {
    /// The body after the handler's first read: `first`, the chunk to leave
    /// with the head, and `ending`, the end or the failure met before any
    /// chunk. Starts the stream's watch on `checkpoints`.
    fn start(
        relay: Relay,
        events: rialto_router::ChatStream,
        checkpoints: tokio::time::Interval,
        first: Option<Bytes>,
        ending: Option<Ending>,
    ) -> Self {
        let relaying = Arc::new(std::sync::Mutex::new(Relaying {
            relay: Some(relay),
            events,
            handed: None,
            ahead: std::collections::VecDeque::with_capacity(READ_AHEAD),
            read_all: false,
            body: None,
            reader: None,
        }));
        let watch = tokio::spawn(watch(Arc::downgrade(&relaying), checkpoints)).abort_handle();
        let mut queued: Vec<Bytes> = first.into_iter().collect();
        let mut finishing = None;
        if let Some(ending) = ending {
            queued.extend(body_end(&mut lock(&relaying), ending, &mut finishing));
        }
        Self {
            relaying,
            queued: queued.into_iter(),
            finishing,
            watch,
        }
    }
}

/// What the stream's end leaves for the client: a failure's line and
/// `[DONE]` (what was sent is billed), the last chunk and `[DONE]` once
/// billed, or nothing yet while the end is billed by a task of its own
/// (`finishing`). Either way the relay leaves `relaying`.
fn body_end(
    relaying: &mut Relaying,
    ending: Ending,
    finishing: &mut Option<tokio::task::JoinHandle<Vec<Bytes>>>,
) -> Vec<Bytes> {
    let Some(mut relay) = relaying.relay.take() else {
        return Vec::new();
    };
    match ending {
        Ending::Failed(line) => {
            relay.bill_later();
            vec![line, Bytes::from_static(DONE)]
        }
        Ending::End => {
            // Billed here when billing answers at once (one process: decided
            // in memory, durable once logged), so that the last lines leave
            // in the write that carries the chunk before them; otherwise in
            // a task of its own, which a client that leaves cannot cut
            // short. The task polls again with its own waker.
            let mut billing = Box::pin(relay.finish());
            let mut now = std::task::Context::from_waker(std::task::Waker::noop());
            match billing.as_mut().poll(&mut now) {
                std::task::Poll::Ready(lines) => lines,
                std::task::Poll::Pending => {
                    *finishing = Some(tokio::spawn(billing));
                    Vec::new()
                }
            }
        }
    }
}

impl futures_util::Stream for RelayBody {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = self.get_mut();
        loop {
            if let Some(line) = this.queued.next() {
                return Poll::Ready(Some(Ok(line)));
            }
            if let Some(finishing) = this.finishing.as_mut() {
                // A billing task that panicked leaves the stream without
                // its last lines; it is not billed twice.
                let lines = std::task::ready!(finishing.poll_unpin(cx)).unwrap_or_default();
                this.finishing = None;
                this.queued = lines.into_iter();
                continue;
            }
            let mut relaying = lock(&this.relaying);
            relaying.handed = None;
            let Relaying {
                relay,
                ahead,
                body,
                reader,
                ..
            } = &mut *relaying;
            // Billed already: ended by its watch, or its end met.
            let Some(relay) = relay.as_mut() else {
                return Poll::Ready(None);
            };
            let Some(event) = ahead.pop_front() else {
                *body = Some(cx.waker().clone());
                return Poll::Pending;
            };
            if let Some(reader) = reader.take() {
                reader.wake();
            }
            match relay.read(event) {
                Read::Line(line) => {
                    relaying.handed = Some(std::time::Instant::now());
                    return Poll::Ready(Some(Ok(line)));
                }
                Read::Skip => {}
                Read::Ends(end) => {
                    this.queued = body_end(&mut relaying, end, &mut this.finishing).into_iter()
                }
            }
        }
    }
}

/// A stream's watch, one task for as long as its body lives (the body's
/// drop aborts it). It reads the upstream's events for the body, at most
/// [`READ_AHEAD`] ahead of the client, each time it is woken once its
/// [`Turn`] comes (its worker's waiting watches go on a few after each
/// poll of the I/O driver, so new streams are not kept behind a burst).
/// On its checkpoint clock: the hold lives on a lease that each checkpoint
/// renews, so it checkpoints whether chunks come or not (a backend silent
/// for longer than the lease must not let the hold expire and the stream
/// go free); and a client that has not come back for `reader_patience`
/// after its last chunk is ended and charged what it was sent (the
/// upstream is let go at once, not when the client's connection closes).
async fn watch(
    relaying: std::sync::Weak<std::sync::Mutex<Relaying>>,
    mut checkpoints: tokio::time::Interval,
) {
    use std::task::Poll;
    let mut turn = Turn::default();
    std::future::poll_fn(|cx| {
        // Woken with something to do: after what the worker found readable
        // meanwhile, and a few watches at a time.
        std::task::ready!(turn.poll(cx));
        // Gone with its body: billed as it dropped.
        let Some(relaying) = relaying.upgrade() else {
            return Poll::Ready(());
        };
        let mut relaying = lock(&relaying);
        while checkpoints.poll_tick(cx).is_ready() {
            let handed = relaying.handed;
            let Some(relay) = relaying.relay.as_mut() else {
                return Poll::Ready(());
            };
            let patience = relay.exchange.reader_patience;
            if handed.is_some_and(|handed| handed.elapsed() >= patience) {
                tracing::warn!(
                    request_id = relay.exchange.request_id,
                    patience_secs = patience.as_secs(),
                    "the client stopped reading the stream: ended"
                );
                relay.bill_later();
                relaying.relay = None;
                relaying.events = Box::pin(futures_util::stream::empty());
                relaying.ahead.clear();
                if let Some(body) = relaying.body.take() {
                    body.wake();
                }
                return Poll::Ready(());
            }
            relay.checkpoint();
        }
        // Reads ahead of the client: the chunks of a burst are read by
        // their watches first, and rewritten and written by their bodies
        // after, one write after another.
        loop {
            let Relaying {
                relay,
                events,
                ahead,
                read_all,
                body,
                reader,
                ..
            } = &mut *relaying;
            if relay.is_none() {
                return Poll::Ready(());
            }
            if *read_all {
                return Poll::Pending;
            }
            if ahead.len() >= READ_AHEAD {
                *reader = Some(cx.waker().clone());
                return Poll::Pending;
            }
            let event = std::task::ready!(events.poll_next_unpin(cx));
            *read_all = !matches!(event, Some(Ok(_)));
            ahead.push_back(event);
            if let Some(body) = body.take() {
                body.wake();
            }
        }
    })
    .await
}

/// The lock of a stream's relay, shared by its body and its watch: neither
/// panics while holding it, and a relay left by one that did is still the
/// relay (its billing is what matters).
fn lock(relaying: &std::sync::Mutex<Relaying>) -> std::sync::MutexGuard<'_, Relaying> {
    relaying
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The clock of a stream's checkpoints, one from its hold to its end: first
/// after `every`, then every `every` from the last tick (a late tick does
/// not bring a burst).
fn checkpoint_clock(every: std::time::Duration) -> tokio::time::Interval {
    let mut clock = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    clock.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    clock
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{Cost, LastChunk, UsageJson};

    /// The last chunk written from the relay's parts is, byte for byte,
    /// the line a `json!` tree of the same members wrote.
    #[test]
    fn the_last_chunk_is_the_line_a_tree_wrote() {
        let cost = Cost::of(&rialto_proto::billing::v1::Cost {
            usd: "0.000123".into(),
            diem: "0".into(),
        });
        let usage = json!({"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46,
            "prompt_tokens_details": {"cached_tokens": 0}});
        let created = json!(1_764_000_000);
        let (id, model) = ("chatcmpl-\"quoted\"", "llama-3.3-70b");
        let written = serde_json::to_string(&LastChunk {
            choices: [],
            cost: &cost,
            created: &created,
            id,
            model,
            object: "chat.completion.chunk",
            usage: &UsageJson::Tree(usage.clone()),
        })
        .unwrap();
        let tree = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": usage,
            "cost": cost.to_value(),
        });
        assert_eq!(written, tree.to_string());
    }
}
