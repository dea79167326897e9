//! A mock SearXNG instance and web-page server, for web search and
//! scraping tests.
//!
//! `GET /search?q=…&format=json` answers as SearXNG's JSON API does
//! (`{"query", "results": [{"url", "title", "content", "publishedDate"}]}`)
//! with [`RESULTS`] results whose URLs point at this server's own pages,
//! and records every query. `GET /pages/{name}` serves HTML pages: any name
//! gives an article titled after it, `empty` a page with no text, and
//! `missing` a 404. [`MockSearxng::fail_with`] makes searches answer an
//! error status, [`MockSearxng::delay`] makes them slow. Like
//! [`MockUpstream`](crate::MockUpstream) it runs on a thread of its own and
//! stops when dropped.

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use actix_web::{HttpResponse, web};
use anyhow::Context as _;
use serde_json::json;

/// Results each search answers.
pub const RESULTS: usize = 3;

#[derive(Default)]
struct State {
    queries: Mutex<Vec<String>>,
    /// Pages served, by name.
    pages: Mutex<Vec<String>>,
    /// A status every search answers instead of results.
    failing: Mutex<Option<u16>>,
    delay: Mutex<Duration>,
    addr: Mutex<Option<SocketAddr>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running mock SearXNG.
pub struct MockSearxng {
    addr: SocketAddr,
    state: Arc<State>,
    _served: crate::server::Served,
}

impl MockSearxng {
    /// Starts on `127.0.0.1` with an OS-chosen port.
    pub async fn start() -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the mock SearXNG")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State::default());
        *lock(&state.addr) = Some(addr);
        let data = web::Data::from(Arc::clone(&state));
        let served = crate::server::serve("mock-searxng", listener, move |app| {
            app.app_data(data.clone())
                .route("/search", web::get().to(search))
                .route("/pages/{name}", web::get().to(page));
        })
        .await?;
        Ok(Self {
            addr,
            state,
            _served: served,
        })
    }

    /// The instance's base URL (`[web_search] url`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The URL of the page named `name`.
    pub fn page_url(&self, name: &str) -> String {
        format!("http://{}/pages/{name}", self.addr)
    }

    /// Every query searched so far, in order.
    pub fn queries(&self) -> Vec<String> {
        lock(&self.state.queries).clone()
    }

    /// Every page served so far, by name, in order.
    pub fn pages_served(&self) -> Vec<String> {
        lock(&self.state.pages).clone()
    }

    /// Searches answer `status` from now on (None: results again).
    pub fn fail_with(&self, status: Option<u16>) {
        *lock(&self.state.failing) = status;
    }

    /// Searches take `delay` before answering.
    pub fn delay(&self, delay: Duration) {
        *lock(&self.state.delay) = delay;
    }
}

/// The result `n` (1-based) of a search for `query`.
pub fn result_title(query: &str, n: usize) -> String {
    format!("Result {n} about {query}")
}

#[derive(serde::Deserialize)]
struct SearchQuery {
    q: String,
    format: Option<String>,
}

async fn search(state: web::Data<State>, query: web::Query<SearchQuery>) -> HttpResponse {
    lock(&state.queries).push(query.q.clone());
    let delay = *lock(&state.delay);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if let Some(status) = *lock(&state.failing) {
        let status = actix_web::http::StatusCode::from_u16(status)
            .unwrap_or(actix_web::http::StatusCode::INTERNAL_SERVER_ERROR);
        return HttpResponse::build(status).body("search engine unavailable");
    }
    if query.format.as_deref() != Some("json") {
        // SearXNG refuses formats its settings do not enable.
        return HttpResponse::Forbidden().finish();
    }
    let addr = lock(&state.addr).unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let results: Vec<_> = (1..=RESULTS)
        .map(|n| {
            json!({
                "url": format!("http://{addr}/pages/result-{n}"),
                "title": result_title(&query.q, n),
                "content": format!("Snippet <b>{n}</b>: what source {n} says about {}.", query.q),
                "publishedDate": if n == 1 { json!("2026-11-01T10:00:00") } else { json!(null) },
                "engine": "mock",
            })
        })
        .collect();
    HttpResponse::Ok().json(json!({
        "query": query.q,
        "number_of_results": RESULTS,
        "results": results,
        "answers": [],
        "suggestions": [],
    }))
}

async fn page(state: web::Data<State>, name: web::Path<String>) -> HttpResponse {
    let name = name.into_inner();
    lock(&state.pages).push(name.clone());
    match name.as_str() {
        "missing" => HttpResponse::NotFound().body("no such page"),
        "empty" => HttpResponse::Ok()
            .content_type("text/html")
            .body("<html><head></head><body></body></html>"),
        _ => HttpResponse::Ok()
            .content_type("text/html; charset=utf-8")
            .body(article(&name)),
    }
}

/// An article page: navigation and a footer around the text Readability
/// should keep.
pub fn article(name: &str) -> String {
    let paragraph = format!(
        "The page {name} explains its subject at length. It has several sentences, so \
         that a reader finds real content here, with commas, and more than a few words \
         in each paragraph of the article body."
    );
    format!(
        "<!DOCTYPE html><html><head><title>Page {name}</title></head><body>\
         <nav><a href=\"/\">Home</a> | <a href=\"/about\">About</a></nav>\
         <article><h1>Page {name}</h1><p>{paragraph}</p><p>Fact of {name}: the answer is \
         42.</p><p>{paragraph}</p></article>\
         <footer>Copyright footer text</footer></body></html>"
    )
}
