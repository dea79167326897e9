//! Benchmark instruments for `make bench` (see `bench/run.py` and
//! BENCHMARKS.md). Not used by the service.
//!
//! - `bench-upstream`: an OpenAI-compatible mock upstream built for speed: a
//!   precomputed answer of a fixed size, an optional fixed latency, and SSE
//!   streams with a set number of chunks and delay between them. It reads only
//!   enough of a request to know whether it asks for a stream.
//! - `bench-load`: a load generator with HDR histograms, closed-loop (fixed
//!   concurrency), open-loop (fixed rate, latency measured from each request's
//!   intended start so coordinated omission cannot hide queueing) and
//!   streaming (time to first token and total stream time).
//! - `bench-limiter`: the cost of one rate-limit decision, in process.
//! - `bench-ledger`: the prepaid ledger's holds and settlements per second
//!   and the latency of each, on SQLite and on PostgreSQL.
//!
//! The first two speak HTTP/1.1 over hyper with keep-alive connections; all
//! print their results as JSON.

/// A listener on `address` whose queue of connections not yet accepted
/// holds [`LISTEN_BACKLOG`], as Rialto's gateway's does
/// ([`rialto_core::net::listen`]): with Tokio's 128, 512 streams opening
/// together overflowed it, and a stream whose server opened an upstream
/// connection then read its first token a second late (the SYN's retry).
/// Call it inside a Tokio runtime.
pub fn listen(address: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let listener = rialto_core::net::listen(address, LISTEN_BACKLOG)?;
    listener.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(listener)
}

/// The instruments' listen backlog, as large as the load they take.
pub const LISTEN_BACKLOG: u32 = 4096;

/// Whether a JSON request body asks for a stream: `"stream"` followed by
/// optional white space, `:`, optional white space and `true`. Enough for
/// the bodies Rialto and LiteLLM send, without parsing them.
pub fn wants_stream(body: &[u8]) -> bool {
    let key = b"\"stream\"";
    let mut rest = body;
    while let Some(at) = find(rest, key) {
        let after = &rest[at + key.len()..];
        let after = skip_space(after);
        if let Some(after) = after.strip_prefix(b":")
            && skip_space(after).starts_with(b"true")
        {
            return true;
        }
        rest = &rest[at + key.len()..];
    }
    false
}

fn skip_space(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(bytes.len());
    &bytes[start..]
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::wants_stream;

    #[test]
    fn finds_stream_true_in_compact_and_spaced_json() {
        assert!(wants_stream(br#"{"model":"m","stream":true}"#));
        assert!(wants_stream(br#"{"model": "m", "stream" : true}"#));
        assert!(!wants_stream(br#"{"model":"m","stream":false}"#));
        assert!(!wants_stream(br#"{"model":"m"}"#));
        assert!(!wants_stream(
            br#"{"stream_options":{"include_usage":true}}"#
        ));
    }
}
