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

use bytes::Bytes;
use futures_util::{Stream, StreamExt};

/// The data of each event of `body`, in order; a failure of `body` is
/// given once, and ends the stream.
pub fn data_events<S, E>(body: S) -> impl Stream<Item = Result<Vec<u8>, E>>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
{
    futures_util::stream::unfold(
        (body, Parser::default(), false),
        |(mut body, mut parser, mut ended)| async move {
            loop {
                if let Some(data) = parser.next_data() {
                    return Some((Ok(data), (body, parser, ended)));
                }
                if ended {
                    return None;
                }
                match body.next().await {
                    Some(Ok(bytes)) => parser.push(&bytes),
                    Some(Err(error)) => {
                        ended = true;
                        return Some((Err(error), (body, parser, ended)));
                    }
                    None => {
                        parser.finish();
                        ended = true;
                    }
                }
            }
        },
    )
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

    #[tokio::test]
    async fn a_failed_body_is_given_once_after_what_came_before() {
        let pieces: Vec<Result<Bytes, &str>> = vec![
            Ok(Bytes::from_static(b"data: x\n\ndata: y")),
            Err("reset"),
            Ok(Bytes::from_static(b"\n\n")),
        ];
        let events: Vec<_> = data_events(futures_util::stream::iter(pieces))
            .collect()
            .await;
        assert_eq!(events, vec![Ok(b"x".to_vec()), Err("reset")]);
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
