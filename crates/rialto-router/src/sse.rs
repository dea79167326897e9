//! The `data` of server-sent events, read from an upstream's body as it
//! arrives: what a chat stream's chunks are.
//!
//! The rules are the WHATWG HTML standard's ("Interpreting an event
//! stream"), reduced to what a relay needs: lines end with CRLF, LF or CR
//! (a CR at the end of what has arrived waits for the next bytes, which may
//! start with its LF); a line starting with `:` is a comment; `field:
//! value` loses one space after the colon; an event's `data` lines are
//! joined with `\n`; a blank line ends the event, which is given only if it
//! had data; an event the stream cut off before its blank line is dropped;
//! one byte-order mark at the very start is skipped. `event`, `id` and
//! `retry` are read and ignored. Nothing is decoded: the data stays bytes,
//! copied once out of the body (the line-by-line parser this replaced
//! decoded each piece as UTF-8, copied it three times and allocated per
//! line; it was a tenth of a streamed chat's CPU).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use rialto_core::{Error, ErrorCode};
use tokio::time::{Instant, Sleep};

/// A chat stream's chunks: the data of each event of an upstream's body
/// up to `[DONE]`, blank ones skipped. A failure of the body, or a body
/// that sends nothing for longer than the stall limit, is given once as
/// the error that the backend broke off, and ends the stream. One state
/// machine polled in place (the combinators it replaced were five layers
/// of futures a chunk).
pub struct Chunks<B> {
    body: B,
    parser: Parser,
    /// The body reached its end: what the parser holds is all there is.
    body_ended: bool,
    /// Nothing more is given (`[DONE]`, a failure, or the parser emptied
    /// after the body's end).
    done: bool,
    stall: Option<Stall>,
    /// For the log line of a broken stream.
    request_id: std::sync::Arc<str>,
}

impl<B, E> Chunks<B>
where
    B: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    /// The chunks of `body`; with `stall`, a wait for the body's next bytes
    /// longer than it breaks the stream off.
    pub fn new(body: B, request_id: &str, stall: Option<Duration>) -> Self {
        Self {
            body,
            parser: Parser::default(),
            body_ended: false,
            done: false,
            stall: stall.map(Stall::new),
            request_id: request_id.into(),
        }
    }

    fn broken(
        &mut self,
        error: &dyn std::fmt::Display,
    ) -> Poll<Option<rialto_core::Result<Vec<u8>>>> {
        tracing::warn!(request_id = %self.request_id, %error, "upstream stream broke");
        self.done = true;
        Poll::Ready(Some(Err(broken_off())))
    }
}

impl<B, E> Stream for Chunks<B>
where
    B: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    type Item = rialto_core::Result<Vec<u8>>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            if let Some(data) = this.parser.next_data() {
                let trimmed = data.trim_ascii();
                if trimmed == b"[DONE]" {
                    this.done = true;
                    return Poll::Ready(None);
                }
                if trimmed.is_empty() {
                    continue;
                }
                return Poll::Ready(Some(Ok(data)));
            }
            if this.body_ended {
                this.done = true;
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.body).poll_next(cx) {
                Poll::Ready(Some(Ok(bytes))) => {
                    this.parser.push(&bytes);
                    if let Some(stall) = &mut this.stall {
                        stall.read();
                    }
                }
                Poll::Ready(Some(Err(error))) => return this.broken(&error),
                Poll::Ready(None) => {
                    this.parser.finish();
                    this.body_ended = true;
                }
                Poll::Pending => {
                    if let Some(stall) = &mut this.stall
                        && stall.poll_expired(cx)
                    {
                        return this.broken(&"no bytes within the read timeout");
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

/// The error of a stream its backend broke off.
pub fn broken_off() -> Error {
    Error::new(
        ErrorCode::UpstreamFailed,
        "The model's backend broke off its answer",
    )
}

/// The longest wait for a body's next bytes. The timer is armed once and
/// moved only when it fires (to the last read plus the limit), so a read
/// costs a clock reading, not a timer re-armed per chunk.
struct Stall {
    limit: Duration,
    last: Instant,
    timer: Pin<Box<Sleep>>,
}

impl Stall {
    fn new(limit: Duration) -> Self {
        let now = Instant::now();
        Self {
            limit,
            last: now,
            timer: Box::pin(tokio::time::sleep_until(now + limit)),
        }
    }

    fn read(&mut self) {
        self.last = Instant::now();
    }

    /// Whether the limit passed since the last read (else the timer wakes
    /// `cx` when it might have).
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return false;
            }
            let deadline = self.last + self.limit;
            if deadline <= Instant::now() {
                return true;
            }
            self.timer.as_mut().reset(deadline);
        }
    }
}

/// The parser's state between the pieces of a body.
#[derive(Default)]
pub struct Parser {
    /// What has arrived and is not read yet, from `start` on.
    buffer: Vec<u8>,
    start: usize,
    /// The data lines of the event being read, each followed by `\n`.
    data: Vec<u8>,
    /// The byte-order mark is behind us (or was not there).
    started: bool,
    /// The body ended: a CR at the very end ends its line.
    ended: bool,
}

const BOM: &[u8] = b"\xEF\xBB\xBF";

impl Parser {
    /// Takes the next piece of the body.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.start == self.buffer.len() {
            self.buffer.clear();
            self.start = 0;
        } else if self.start >= 4096 {
            self.buffer.drain(..self.start);
            self.start = 0;
        }
        self.buffer.extend_from_slice(bytes);
    }

    /// The body ended.
    pub fn finish(&mut self) {
        self.ended = true;
    }

    /// The data of the next whole event that has arrived, if one has.
    pub fn next_data(&mut self) -> Option<Vec<u8>> {
        if !self.started {
            let rest = &self.buffer[self.start..];
            if rest.len() < BOM.len() && BOM.starts_with(rest) && !self.ended {
                return None;
            }
            if rest.starts_with(BOM) {
                self.start += BOM.len();
            }
            self.started = true;
        }
        loop {
            let rest = &self.buffer[self.start..];
            let end = memchr::memchr2(b'\n', b'\r', rest)?;
            let ending = match (rest[end], rest.get(end + 1)) {
                (b'\r', Some(b'\n')) => 2,
                // A CR that may be the first half of a CRLF.
                (b'\r', None) if !self.ended => return None,
                _ => 1,
            };
            let line = self.start..self.start + end;
            self.start += end + ending;
            let line = &self.buffer[line];
            if line.is_empty() {
                if self.data.is_empty() {
                    continue;
                }
                let mut data = std::mem::take(&mut self.data);
                data.pop();
                return Some(data);
            }
            if line[0] == b':' {
                continue;
            }
            let (field, value) = match memchr::memchr(b':', line) {
                Some(colon) => {
                    let value = &line[colon + 1..];
                    (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
                }
                None => (line, &b""[..]),
            };
            if field == b"data" {
                self.data.extend_from_slice(value);
                self.data.push(b'\n');
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use proptest::prelude::*;

    /// The standard's algorithm over the whole stream at once: the
    /// reference every way of cutting the stream must agree with.
    fn reference(stream: &[u8]) -> Vec<Vec<u8>> {
        let stream = stream.strip_prefix(BOM).unwrap_or(stream);
        let mut events = Vec::new();
        let mut data: Option<Vec<u8>> = None;
        let mut rest = stream;
        while let Some(end) = rest.iter().position(|b| *b == b'\n' || *b == b'\r') {
            let line = &rest[..end];
            let ending = if rest[end] == b'\r' && rest.get(end + 1) == Some(&b'\n') {
                2
            } else {
                1
            };
            rest = &rest[end + ending..];
            if line.is_empty() {
                if let Some(mut event) = data.take() {
                    event.pop();
                    events.push(event);
                }
            } else if line[0] != b':' {
                let (field, value) = match line.iter().position(|b| *b == b':') {
                    Some(colon) => (&line[..colon], {
                        let value = &line[colon + 1..];
                        value.strip_prefix(b" ").unwrap_or(value)
                    }),
                    None => (line, &b""[..]),
                };
                if field == b"data" {
                    let buffer = data.get_or_insert_with(Vec::new);
                    buffer.extend_from_slice(value);
                    buffer.push(b'\n');
                }
            }
        }
        events
    }

    fn parse_in_pieces(stream: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut parser = Parser::default();
        let mut events = Vec::new();
        let mut from = 0;
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (stream.len() + 1)).collect();
        cuts.sort_unstable();
        for cut in cuts.into_iter().chain([stream.len()]) {
            parser.push(&stream[from..cut.max(from)]);
            from = cut.max(from);
            while let Some(data) = parser.next_data() {
                events.push(data);
            }
        }
        parser.finish();
        while let Some(data) = parser.next_data() {
            events.push(data);
        }
        events
    }

    #[test]
    fn a_chat_stream_reads_as_its_chunks() {
        let stream = b"\xEF\xBB\xBFdata: {\"a\":1}\n\n: keep-alive\n\nevent: message\nid: 7\ndata:{\"b\":2}\r\n\r\ndata: one\ndata:  two\ndata\n\nretry: 10\n\ndata: [DONE]\n\ndata: cut off";
        let want: Vec<&[u8]> = vec![b"{\"a\":1}", b"{\"b\":2}", b"one\n two\n", b"[DONE]"];
        assert_eq!(parse_in_pieces(stream, &[]), want);
        assert_eq!(reference(stream), want);
        // Every single cut, including between CR and LF.
        for cut in 0..=stream.len() {
            assert_eq!(parse_in_pieces(stream, &[cut]), want, "cut at {cut}");
        }
    }

    #[test]
    fn a_cr_ends_a_line_when_no_lf_follows() {
        assert_eq!(
            parse_in_pieces(b"data: a\r\rdata: b\r", &[8]),
            vec![b"a".to_vec()]
        );
        assert_eq!(parse_in_pieces(b"data: a\r\r", &[8]), vec![b"a".to_vec()]);
    }

    fn chunks_of(
        pieces: Vec<Result<Bytes, &'static str>>,
    ) -> Chunks<impl Stream<Item = Result<Bytes, &'static str>> + Unpin> {
        Chunks::new(futures_util::stream::iter(pieces), "r", None)
    }

    #[tokio::test]
    async fn a_failed_body_is_given_once_after_what_came_before() {
        let pieces = vec![
            Ok(Bytes::from_static(b"data: x\n\ndata: y")),
            Err("reset"),
            Ok(Bytes::from_static(b"\n\n")),
        ];
        let chunks: Vec<_> = chunks_of(pieces).collect().await;
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0].as_ref().unwrap(), b"x");
        assert_eq!(
            chunks[1].as_ref().unwrap_err().code,
            ErrorCode::UpstreamFailed
        );
    }

    #[tokio::test]
    async fn a_stream_ends_at_done_and_skips_blank_chunks() {
        let pieces = vec![
            Ok(Bytes::from_static(b"data: a\n\ndata:  \n\ndata: b\n")),
            Ok(Bytes::from_static(b"\ndata: [DONE]\n\ndata: after\n\n")),
        ];
        let chunks: Vec<_> = chunks_of(pieces).map(Result::unwrap).collect().await;
        assert_eq!(chunks, vec![b"a".to_vec(), b"b".to_vec()]);
        // Without `[DONE]`, the body's end ends it.
        let pieces = vec![Ok(Bytes::from_static(b"data: a\n\ndata: cut"))];
        let chunks: Vec<_> = chunks_of(pieces).map(Result::unwrap).collect().await;
        assert_eq!(chunks, vec![b"a".to_vec()]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_silent_past_the_stall_limit_is_broken_off() {
        // A chunk, then one every 3 s (each within the 5 s limit), then
        // silence.
        let body = futures_util::stream::unfold(0, |sent| async move {
            if sent > 0 {
                tokio::time::sleep(Duration::from_secs(if sent < 4 { 3 } else { 3600 })).await;
            }
            Some((
                Ok::<_, &str>(Bytes::from(format!("data: {sent}\n\n"))),
                sent + 1,
            ))
        });
        let started = Instant::now();
        let chunks: Vec<_> = Chunks::new(Box::pin(body), "r", Some(Duration::from_secs(5)))
            .collect()
            .await;
        assert_eq!(chunks.len(), 5, "four chunks and the error");
        assert!(chunks[..4].iter().all(Result::is_ok));
        assert_eq!(
            chunks[4].as_ref().unwrap_err().code,
            ErrorCode::UpstreamFailed
        );
        // Broken off 5 s after the last chunk (at 9 s), not before.
        assert_eq!(started.elapsed(), Duration::from_secs(14));
    }

    fn stream_bytes() -> impl Strategy<Value = Vec<u8>> {
        let piece = prop_oneof![
            Just(b"data: ".to_vec()),
            Just(b"data:".to_vec()),
            Just(b"data".to_vec()),
            Just(b": comment".to_vec()),
            Just(b"event: x".to_vec()),
            Just(b"\n".to_vec()),
            Just(b"\r".to_vec()),
            Just(b"\r\n".to_vec()),
            Just(b" ".to_vec()),
            Just(b":".to_vec()),
            Just(BOM.to_vec()),
            proptest::collection::vec(any::<u8>(), 0..8),
        ];
        proptest::collection::vec(piece, 0..40).prop_map(|pieces| pieces.concat())
    }

    proptest! {
        /// However a stream is cut into pieces, its events are the
        /// standard's.
        #[test]
        fn any_cutting_reads_as_the_whole(
            stream in stream_bytes(),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            prop_assert_eq!(parse_in_pieces(&stream, &cuts), reference(&stream));
        }
    }
}
