//! The HTTP/1.1 client for plain-`http` backends: chat answers, streams and
//! embeddings, the calls every paying request makes.
//!
//! Each thread keeps its own pool of idle connections, each a hyper
//! connection whose socket is registered with that thread's runtime. No
//! task of its own drives a connection: the request's task does, from
//! sending the request through reading the answer's body, so the answer's
//! head and each chunk of a stream wake the task that relays them, not a
//! connection task that then wakes it (a hop that waits behind every task
//! ready on a busy worker, twice per request: the request written, the
//! head read). A backend's request line and `Host` are made once, when the
//! backend is built; a request is its head, its body and a connection.
//! reqwest, which this replaces on that path, parses the URL into a URI
//! again, builds its own header map, runs its redirect policy and a timer
//! re-armed at every chunk of a stream, and locks a pool shared by the
//! thread's requests, for each request. `https` backends, media calls,
//! health probes and a process whose environment names an HTTP proxy keep
//! reqwest.
//!
//! A connection goes back to its thread's pool with its answer's body. An
//! answer left before its end (a stream read up to `[DONE]`, whose end
//! came with it; a client gone mid-stream) is drained by hyper if the rest
//! has arrived, else the connection is closed, which tells the backend to
//! stop. An idle connection is not polled; the pool reads what came on it
//! before lending it, and lends only one that is open and waiting for a
//! request (one the backend closed meanwhile is dropped); a request that
//! comes back unsent from a connection that closed under it goes on a new
//! one. What waits on the backend is bounded by the caller: the head and a
//! whole answer by the backend's timeout, a stream's chunks by
//! [`crate::sse::Chunks`]'s stall limit.

use rialto_core::hashing::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::Stream;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Incoming};
use hyper::client::conn::http1::{Connection, SendRequest};
use hyper::header::{ACCEPT, CONTENT_TYPE, HOST, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, Uri};
use hyper_util::rt::TokioIo;
use rialto_core::per_thread::PerThread;

/// How long an idle connection stays in its pool (reqwest's setting here).
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Idle connections kept for one backend address on one thread.
const MAX_IDLE_PER_ADDRESS: usize = 256;

/// The idle time after which the kernel probes a connection.
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);

/// Whether plain-`http` backends may use this client: not when the
/// environment names a proxy for them, which reqwest honours.
pub(crate) fn usable() -> bool {
    ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"]
        .iter()
        .all(|name| std::env::var_os(name).is_none_or(|value| value.is_empty()))
}

/// Where a backend's calls go, made once from its URL.
#[derive(Debug)]
pub(crate) struct Endpoint {
    /// `host:port`: what is connected to, and the pool's key (shared, so
    /// a request's connection goes back without a copy of it).
    address: Arc<str>,
    host: HeaderValue,
    chat: Uri,
    embeddings: Uri,
}

impl Endpoint {
    /// The endpoint of a backend whose base URL is `base`
    /// (`http://host:port/v1`); `None` when it is not plain `http`.
    pub(crate) fn new(base: &reqwest::Url) -> Option<Self> {
        if base.scheme() != "http" || !base.username().is_empty() || base.password().is_some() {
            return None;
        }
        let host = base.host_str()?;
        let port = base.port_or_known_default()?;
        // An IPv6 literal keeps its brackets in both.
        let authority = match base.port() {
            Some(port) => format!("{host}:{port}"),
            None => host.to_owned(),
        };
        let path = base.path().trim_end_matches('/');
        let origin = |tail: &str| -> Option<Uri> {
            let mut uri = format!("{path}{tail}");
            if let Some(query) = base.query() {
                uri.push('?');
                uri.push_str(query);
            }
            uri.parse().ok()
        };
        Some(Self {
            address: format!("{host}:{port}").into(),
            host: HeaderValue::from_str(&authority).ok()?,
            chat: origin("/chat/completions")?,
            embeddings: origin("/embeddings")?,
        })
    }

    pub(crate) fn chat(&self) -> &Uri {
        &self.chat
    }

    pub(crate) fn embeddings(&self) -> &Uri {
        &self.embeddings
    }
}

/// Why a request got no answer.
#[derive(Debug)]
pub(crate) enum SendError {
    /// No connection within the connect timeout.
    ConnectTimeout,
    /// No connection: refused, unreachable, a name that does not resolve.
    Connect(std::io::Error),
    /// The connection failed before the answer's head.
    Http(hyper::Error),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ConnectTimeout => f.write_str("connect timed out"),
            Self::Connect(error) => write!(f, "connect: {error}"),
            Self::Http(error) => write!(f, "{error}"),
        }
    }
}

/// The client: one pool per thread that sends.
pub(crate) struct Upstreams {
    pools: PerThread<Arc<Pool>>,
    connect_timeout: Duration,
}

impl Upstreams {
    pub(crate) fn new(connect_timeout: Duration) -> Self {
        Self {
            pools: PerThread::new(|| Arc::new(Pool::default())),
            connect_timeout,
        }
    }

    /// POSTs `body` (JSON) to `uri` of `endpoint` with `headers` (the
    /// backend's own) and the request's id; the answer's head, its body to
    /// be read.
    pub(crate) async fn post(
        &self,
        endpoint: &Endpoint,
        uri: &Uri,
        headers: &HeaderMap,
        request_id: &str,
        body: Vec<u8>,
    ) -> Result<Response<Answer>, SendError> {
        let mut request = Request::new(Full::new(Bytes::from(body)));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = uri.clone();
        let head = request.headers_mut();
        head.reserve(4 + headers.len());
        head.insert(HOST, endpoint.host.clone());
        head.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        head.insert(ACCEPT, HeaderValue::from_static("*/*"));
        if let Ok(id) = HeaderValue::from_str(request_id) {
            head.insert(HeaderName::from_static("x-request-id"), id);
        }
        for (name, value) in headers {
            head.append(name.clone(), value.clone());
        }
        let pool = self.pools.get();
        loop {
            let (mut conn, reused) = match pool.take(&endpoint.address) {
                Some(conn) => (conn, true),
                None => (self.connect(&endpoint.address).await?, false),
            };
            // hyper's future does not hold the sender: the connection is
            // driven beside it, by this task, until the answer's head.
            let mut answer = std::pin::pin!(conn.sender.try_send_request(request));
            let answer =
                std::future::poll_fn(|cx| conn.driving(cx, |cx| answer.as_mut().poll(cx))).await;
            match answer {
                Ok(response) => {
                    let lease = Lease {
                        pool,
                        address: endpoint.address.clone(),
                        conn: Some(conn),
                    };
                    return Ok(response.map(|body| Answer { body, lease }));
                }
                Err(mut error) => match error.take_message() {
                    // Closed under us before the request left: on another.
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(SendError::Http(error.into_error())),
                },
            }
        }
    }

    async fn connect(&self, address: &str) -> Result<Conn, SendError> {
        let stream = tokio::time::timeout(
            self.connect_timeout,
            tokio::net::TcpStream::connect(address),
        )
        .await
        .map_err(|_| SendError::ConnectTimeout)?
        .map_err(SendError::Connect)?;
        let _ = stream.set_nodelay(true);
        let _ = socket2::SockRef::from(&stream)
            .set_tcp_keepalive(&socket2::TcpKeepalive::new().with_time(TCP_KEEPALIVE));
        let (sender, driver) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(SendError::Http)?;
        let wakes = Arc::new(Wakes::default());
        Ok(Conn {
            sender,
            driver: Some(driver),
            waker: Waker::from(Arc::clone(&wakes)),
            wakes,
        })
    }
}

/// One connection: what sends its requests, and what reads and writes its
/// socket. No task of its own drives it: whoever waits on it does (the
/// request's task, until its answer's head and through its body), so an
/// answer's bytes reach the request's task without a hop through another
/// task, and a connection in the pool is not polled at all.
struct Conn {
    sender: SendRequest<Full<Bytes>>,
    /// `None` once the connection has ended.
    driver: Option<Driver>,
    /// What the connection and its answer are polled with: [`Wakes`].
    waker: Waker,
    wakes: Arc<Wakes>,
}

impl Conn {
    /// Polls `poll` (the answer's head, or its body) with the connection
    /// moved on first, both on the connection's waker ([`Wakes`]), which
    /// wakes the caller's task only for what happens outside this call.
    fn driving<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        let Conn {
            driver,
            waker,
            wakes,
            ..
        } = self;
        wakes.task.register(cx.waker());
        wakes.polling.store(true, Ordering::SeqCst);
        let mut own = Context::from_waker(waker);
        drive(driver, &mut own);
        let polled = poll(&mut own);
        wakes.polling.store(false, Ordering::SeqCst);
        // Something asked to go on while this call was in it: a caller
        // given its answer polls again for the next, and the connection
        // moves on then; a caller told to wait must be polled again.
        if wakes.woken.swap(false, Ordering::SeqCst) && polled.is_pending() {
            cx.waker().wake_by_ref();
        }
        polled
    }

    /// Moves the connection on as far as it goes now, waking no one.
    fn drive_now(&mut self) {
        drive(&mut self.driver, &mut Context::from_waker(Waker::noop()));
    }

    /// Open, and waiting for a request (its last answer read or drained).
    fn is_idle(&self) -> bool {
        self.driver.is_some() && self.sender.is_ready()
    }
}

type Driver = Connection<TokioIo<tokio::net::TcpStream>, Full<Bytes>>;

/// Moves a connection on: writes what is to be written, reads what
/// arrived, and has `cx` woken when it can go on; `None` once it ended.
fn drive(driver: &mut Option<Driver>, cx: &mut Context<'_>) {
    if let Some(connection) = driver.as_mut()
        && let Poll::Ready(ended) = Pin::new(connection).poll(cx)
    {
        if let Err(error) = ended {
            tracing::debug!(%error, "upstream connection ended");
        }
        *driver = None;
    }
}

/// The waker a connection and its answer's body are polled with. Both are
/// polled by the same task, in one call ([`Conn::driving`]), and each
/// wakes the other within it: a chunk the connection reads wakes the body,
/// and the body, taking it, wakes the connection to read on. On the
/// task's own waker each such wake polls the whole task again for nothing,
/// once a chunk (measured: ~4,500 instructions a chunk, actix's dispatcher
/// and the relay). A wake during the call is noted instead, and passed on
/// only if the call ends waiting; one from outside it (the socket, a
/// timer) wakes the task at once.
#[derive(Default)]
struct Wakes {
    /// The task polling the connection now.
    task: futures_util::task::AtomicWaker,
    polling: AtomicBool,
    woken: AtomicBool,
}

impl Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Ordered with `driving`'s store then swap: either the call sees
        // `woken`, or this sees it ended and wakes the task.
        if self.polling.load(Ordering::SeqCst) {
            self.woken.store(true, Ordering::SeqCst);
        } else {
            self.task.wake();
        }
    }
}

/// A thread's idle connections, by address, the most recently used last.
#[derive(Default)]
struct Pool {
    idle: Mutex<HashMap<Arc<str>, Vec<Idle>>>,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

impl Pool {
    /// The most recently used connection to `address` that is still open.
    fn take(&self, address: &str) -> Option<Conn> {
        loop {
            let mut conn = {
                let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                let idle = idle.get_mut(address)?;
                let taken = idle.pop()?;
                if taken.since.elapsed() > IDLE_TIMEOUT {
                    // The rest are older still.
                    idle.clear();
                    return None;
                }
                taken.conn
            };
            // Reads what came while it was idle: the backend's close.
            conn.drive_now();
            if conn.is_idle() {
                return Some(conn);
            }
        }
    }

    fn give_back(&self, address: Arc<str>, conn: Conn) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let idle = idle.entry(address).or_default();
        if idle
            .first()
            .is_some_and(|oldest| oldest.since.elapsed() > IDLE_TIMEOUT)
        {
            idle.retain(|kept| kept.since.elapsed() <= IDLE_TIMEOUT);
        }
        if idle.len() < MAX_IDLE_PER_ADDRESS {
            idle.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }
}

/// A connection lent to one request, back to its pool when dropped if it
/// can serve another.
struct Lease {
    pool: Arc<Pool>,
    address: Arc<str>,
    /// `None` only inside its `drop`, which moves the connection out.
    conn: Option<Conn>,
}

/// Dropped after its answer's body (see [`Answer`]), the connection sees
/// that body gone: hyper drains it if the rest has arrived (a stream read
/// up to `[DONE]`, whose end came with it), else closes the connection,
/// which tells the backend to stop. Only a connection idle after that goes
/// back.
impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            conn.drive_now();
            // The request's task may have ended: not kept alive by the
            // connection's waker while it idles.
            drop(conn.wakes.task.take());
            if conn.is_idle() {
                self.pool.give_back(Arc::clone(&self.address), conn);
            }
        }
    }
}

/// An answer's body, driving its connection as it is read.
pub(crate) struct Answer {
    // Dropped before the lease (fields drop in order), so the connection
    // sees the body gone when the lease decides whether it goes back.
    body: Incoming,
    lease: Lease,
}

impl Answer {
    /// The whole body.
    pub(crate) async fn bytes(self) -> Result<Bytes, hyper::Error> {
        Ok(BodyExt::collect(self).await?.to_bytes())
    }
}

impl Body for Answer {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        let Answer { body, lease } = &mut *self;
        match lease.conn.as_mut() {
            Some(conn) => conn.driving(cx, |cx| Pin::new(body).poll_frame(cx)),
            None => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// The body's data as it arrives (trailers are skipped).
impl Stream for Answer {
    type Item = Result<Bytes, hyper::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            return match std::task::ready!(self.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => Poll::Ready(Some(Ok(data))),
                    Err(_) => continue,
                },
                Some(Err(error)) => Poll::Ready(Some(Err(error))),
                None => Poll::Ready(None),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn url(text: &str) -> reqwest::Url {
        text.parse().unwrap()
    }

    #[test]
    fn an_endpoint_is_made_once_from_the_base_url() {
        let endpoint = Endpoint::new(&url("http://10.0.0.7:8000/v1/")).unwrap();
        assert_eq!(&*endpoint.address, "10.0.0.7:8000");
        assert_eq!(endpoint.host, "10.0.0.7:8000");
        assert_eq!(endpoint.chat(), "/v1/chat/completions");
        assert_eq!(endpoint.embeddings(), "/v1/embeddings");
        let endpoint = Endpoint::new(&url("http://models.internal/openai?api-version=2")).unwrap();
        assert_eq!(&*endpoint.address, "models.internal:80");
        assert_eq!(endpoint.host, "models.internal");
        assert_eq!(endpoint.chat(), "/openai/chat/completions?api-version=2");
        let endpoint = Endpoint::new(&url("http://[::1]:9/")).unwrap();
        assert_eq!(&*endpoint.address, "[::1]:9");
        assert_eq!(endpoint.chat(), "/chat/completions");
        // Not for this client: TLS, and credentials in the URL.
        assert!(Endpoint::new(&url("https://api.example.com/v1")).is_none());
        assert!(Endpoint::new(&url("http://user:pw@host/v1")).is_none());
    }

    /// A backend answering every request on its `n`th connection with
    /// `answers[n]` (the last for the rest), counting the connections it
    /// accepted; with `close_after` it closes each connection after that
    /// many answers.
    async fn backend(
        answers: &'static [&'static [u8]],
        close_after: Option<usize>,
    ) -> (Endpoint, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                let nth = counter.fetch_add(1, Ordering::SeqCst);
                let answer = answers[nth.min(answers.len() - 1)];
                tokio::spawn(async move {
                    let mut served = 0;
                    let mut buffer = vec![0; 65536];
                    let mut read = Vec::new();
                    loop {
                        let n = socket.read(&mut buffer).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        read.extend_from_slice(&buffer[..n]);
                        // Whole requests: a head and its 2-byte body.
                        while let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
                            if read.len() < end + 4 + 2 {
                                break;
                            }
                            read.drain(..end + 4 + 2);
                            socket.write_all(answer).await.unwrap();
                            served += 1;
                            if close_after == Some(served) {
                                return;
                            }
                        }
                    }
                });
            }
        });
        let endpoint = Endpoint::new(&url(&format!("http://{address}/v1"))).unwrap();
        (endpoint, accepted)
    }

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
    /// A stream whose last event and end arrive together.
    const STREAM: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
        e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n";
    /// A stream that has not ended.
    const UNENDED: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
        e\r\ndata: [DONE]\n\n\r\n";

    async fn send(
        upstreams: &Upstreams,
        endpoint: &Endpoint,
    ) -> Result<Response<Answer>, SendError> {
        let headers = HeaderMap::new();
        upstreams
            .post(endpoint, endpoint.chat(), &headers, "r", b"{}".to_vec())
            .await
    }

    async fn post(upstreams: &Upstreams, endpoint: &Endpoint) -> Result<Bytes, String> {
        let response = send(upstreams, endpoint).await.map_err(|e| e.to_string())?;
        response
            .into_body()
            .bytes()
            .await
            .map_err(|e| e.to_string())
    }

    #[tokio::test]
    async fn a_connection_read_to_the_end_serves_the_next_request() {
        let (endpoint, accepted) = backend(&[OK], None).await;
        let upstreams = Upstreams::new(Duration::from_secs(1));
        for _ in 0..5 {
            assert_eq!(post(&upstreams, &endpoint).await.unwrap(), "hello");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    /// Connections the backend saw for a stream read up to `[DONE]` and
    /// left there, then an ordinary request.
    async fn connections_after_leaving(stream: &'static [u8]) -> usize {
        let (endpoint, accepted) = backend(Box::leak(Box::new([stream, OK])), None).await;
        let upstreams = Upstreams::new(Duration::from_secs(1));
        let mut body = send(&upstreams, &endpoint).await.unwrap().into_body();
        let first = futures_util::StreamExt::next(&mut body)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first, "data: [DONE]\n\n");
        drop(body);
        // On the same connection, the stream again; on a new one, `OK`.
        let again = post(&upstreams, &endpoint).await.unwrap();
        let connections = accepted.load(Ordering::SeqCst);
        let expected: &[u8] = if connections == 1 {
            b"data: [DONE]\n\n"
        } else {
            b"hello"
        };
        assert_eq!(again, expected);
        connections
    }

    #[tokio::test]
    async fn an_answer_left_once_its_end_arrived_gives_its_connection_back() {
        assert_eq!(connections_after_leaving(STREAM).await, 1);
    }

    #[tokio::test]
    async fn an_answer_left_mid_body_takes_its_connection_with_it() {
        assert_eq!(connections_after_leaving(UNENDED).await, 2);
    }

    #[tokio::test]
    async fn a_connection_the_backend_closed_is_not_used_again() {
        let (endpoint, accepted) = backend(&[OK], Some(1)).await;
        let upstreams = Upstreams::new(Duration::from_secs(1));
        for _ in 0..4 {
            assert_eq!(post(&upstreams, &endpoint).await.unwrap(), "hello");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 4);
    }

    /// The request's own task drives its connection: a runtime that sent
    /// requests and streams, with their connections pooled, runs no task.
    #[tokio::test]
    async fn no_task_drives_a_connection_but_its_request() {
        // The backend on a runtime of its own, so that only the client's
        // tasks are counted here.
        let (ready, endpoint) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                ready.send(backend(&[OK], None).await).unwrap();
                std::future::pending::<()>().await
            });
        });
        let (endpoint, accepted) = endpoint.recv().unwrap();
        let upstreams = Upstreams::new(Duration::from_secs(1));
        let answers = futures_util::future::join_all((0..3).map(|_| post(&upstreams, &endpoint)));
        for answer in answers.await {
            assert_eq!(answer.unwrap(), "hello");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        assert_eq!(
            tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks(),
            0
        );
        // And the pooled connections serve again.
        for _ in 0..3 {
            assert_eq!(post(&upstreams, &endpoint).await.unwrap(), "hello");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    /// Chunks that arrive apart each wake the reader, on a runtime of one
    /// thread and on one of several (where the socket's wake-up can come
    /// from another thread while the reader is being polled).
    async fn chunks_arriving_apart_are_each_read() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buffer = [0; 4096];
            let mut read = Vec::new();
            while !read.ends_with(b"\r\n\r\n{}") {
                let n = socket.read(&mut buffer).await.unwrap();
                read.extend_from_slice(&buffer[..n]);
            }
            socket
                .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                .await
                .unwrap();
            for n in 0..20 {
                tokio::time::sleep(Duration::from_millis(2)).await;
                let event = format!("data: {n}\n\n");
                let chunk = format!("{:x}\r\n{event}\r\n", event.len());
                socket.write_all(chunk.as_bytes()).await.unwrap();
            }
            socket.write_all(b"0\r\n\r\n").await.unwrap();
        });
        let endpoint = Endpoint::new(&url(&format!("http://{address}/v1"))).unwrap();
        let upstreams = Upstreams::new(Duration::from_secs(1));
        let body = send(&upstreams, &endpoint).await.unwrap().into_body();
        let read = tokio::time::timeout(
            Duration::from_secs(10),
            futures_util::StreamExt::collect::<Vec<_>>(body),
        )
        .await
        .expect("every chunk read, none waited on forever");
        let read: Vec<u8> = read.into_iter().flat_map(|c| c.unwrap().to_vec()).collect();
        let expected: String = (0..20).map(|n| format!("data: {n}\n\n")).collect();
        assert_eq!(String::from_utf8(read).unwrap(), expected);
    }

    #[tokio::test]
    async fn chunks_arriving_apart_are_each_read_on_one_thread() {
        chunks_arriving_apart_are_each_read().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn chunks_arriving_apart_are_each_read_on_several() {
        for _ in 0..5 {
            chunks_arriving_apart_are_each_read().await;
        }
    }

    #[tokio::test]
    async fn a_backend_that_is_not_listening_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        drop(listener);
        let endpoint = Endpoint::new(&url(&format!("http://{address}/v1"))).unwrap();
        let upstreams = Upstreams::new(Duration::from_secs(1));
        let Err(error) = send(&upstreams, &endpoint).await else {
            panic!("a connection to a closed port");
        };
        assert!(matches!(error, SendError::Connect(_)), "{error}");
    }

    #[tokio::test]
    async fn the_request_carries_host_type_id_and_the_backends_headers() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let seen = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut read = Vec::new();
            let mut buffer = [0; 4096];
            while !read.ends_with(b"\r\n\r\n{}") {
                let n = socket.read(&mut buffer).await.unwrap();
                read.extend_from_slice(&buffer[..n]);
            }
            socket.write_all(OK).await.unwrap();
            String::from_utf8(read).unwrap().to_ascii_lowercase()
        });
        let endpoint = Endpoint::new(&url(&format!("http://{address}/v1"))).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("authorization", HeaderValue::from_static("Bearer k"));
        let upstreams = Upstreams::new(Duration::from_secs(1));
        let response = upstreams
            .post(
                &endpoint,
                endpoint.chat(),
                &headers,
                "req-9",
                b"{}".to_vec(),
            )
            .await
            .unwrap();
        assert_eq!(response.into_body().bytes().await.unwrap(), "hello");
        let request = seen.await.unwrap();
        assert!(
            request.starts_with("post /v1/chat/completions http/1.1\r\n"),
            "{request}"
        );
        for line in [
            format!("host: {address}"),
            "content-type: application/json".to_owned(),
            "x-request-id: req-9".to_owned(),
            "authorization: bearer k".to_owned(),
            "content-length: 2".to_owned(),
        ] {
            assert!(
                request.contains(&format!("{line}\r\n")),
                "{line} in {request}"
            );
        }
    }
}
