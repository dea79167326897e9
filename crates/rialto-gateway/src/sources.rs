//! The web as a model's source: search providers (`[web_search]`) and page
//! scraping (`[web_scraping]`).
//!
//! A [`SearchProvider`] turns a query into [`SearchResult`]s: SearXNG's
//! JSON API (`GET {url}/search?q=…&format=json`) or the Brave Search API.
//! [`Scraper`] fetches a page under the file-URL rules of `files.rs`
//! (public addresses only unless the test switch is on, the checked
//! address pinned, no redirects, 15 s, 10 MiB) and reads it with the file
//! converters (a web page through Readability, as Markdown, in the
//! converter's bounded child process).

use std::time::Duration;

use async_trait::async_trait;
use rialto_core::config::{WebScrapingConfig, WebSearchConfig};
use rialto_core::metrics::{OutcomeLabels, metrics};
use secrecy::ExposeSecret;
use serde_json::Value;

/// Longest snippet of one result kept for the prompt, in characters.
pub(crate) const MAX_SNIPPET_CHARS: usize = 1_000;

/// Most URLs of one message that are scraped (the spec's limit).
pub(crate) const MAX_SCRAPED_URLS: usize = 5;

/// Longest query sent to a provider, in characters (the hosted API's
/// `/augment/search` limit).
pub(crate) const MAX_QUERY_CHARS: usize = 400;

/// One result of a search: what a citation shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SearchResult {
    pub title: String,
    pub url: String,
    /// A snippet of the page, as plain text.
    pub content: String,
    /// When the page was published, as the provider gave it.
    pub date: Option<String>,
}

/// A web search service. `limit` is at most 20.
#[async_trait]
pub(crate) trait SearchProvider: Send + Sync {
    async fn search(&self, query: &str, limit: usize) -> Result<Vec<SearchResult>, String>;
}

/// The configured search: a provider, its bounds and its price.
pub(crate) struct WebSearch {
    provider: Box<dyn SearchProvider>,
    pub max_results: usize,
    timeout: Duration,
    /// Price of one search, in USD nano-units.
    pub price_nanos: u64,
    /// Whether `on` asks the model for the query.
    pub query_from_model: bool,
}

impl WebSearch {
    /// The search `[web_search]` configures; None when it names no provider.
    pub(crate) fn from_config(config: &WebSearchConfig) -> anyhow::Result<Option<Self>> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(config.timeout_ms))
            .build()?;
        let provider: Box<dyn SearchProvider> = match config.provider.as_str() {
            "" => return Ok(None),
            "searxng" => Box::new(SearXng {
                url: format!("{}/search", config.url.trim_end_matches('/')),
                client,
            }),
            "brave" => {
                let key = match (&config.api_key, &config.api_key_file) {
                    (Some(key), Some(path)) => {
                        let key = rialto_core::secrets::LiveSecret::new(key.clone());
                        if tokio::runtime::Handle::try_current().is_ok() {
                            rialto_core::secrets::watch(
                                "web_search.api_key_file",
                                path.clone(),
                                key.clone(),
                                |_| Ok(()),
                            );
                        }
                        key
                    }
                    _ => {
                        let variable = config.api_key_env.as_deref().unwrap_or_default();
                        let key = std::env::var(variable).map_err(|_| {
                            anyhow::anyhow!(
                                "web_search.api_key_env names {variable}, which is not set: \
                                 Brave needs its subscription token there"
                            )
                        })?;
                        rialto_core::secrets::LiveSecret::new(key.into())
                    }
                };
                let url = if config.url.is_empty() {
                    "https://api.search.brave.com/res/v1/web/search".to_owned()
                } else {
                    config.url.clone()
                };
                Box::new(Brave { url, key, client })
            }
            other => anyhow::bail!("unknown web_search.provider {other:?}"),
        };
        Ok(Some(Self {
            provider,
            max_results: config.max_results,
            timeout: Duration::from_millis(config.timeout_ms),
            price_nanos: usd_nanos(config.usd_per_search),
            query_from_model: config.query == "model",
        }))
    }

    /// A search of `query` (cut to [`MAX_QUERY_CHARS`]) for at most `limit`
    /// results, within the configured time.
    pub(crate) async fn search(
        &self,
        query: &str,
        limit: usize,
    ) -> Result<Vec<SearchResult>, String> {
        let query: String = query.trim().chars().take(MAX_QUERY_CHARS).collect();
        if query.is_empty() {
            return Err("there is nothing to search for".to_owned());
        }
        let limit = limit.clamp(1, 20);
        let searched = tokio::time::timeout(self.timeout, self.provider.search(&query, limit))
            .await
            .map_err(|_| format!("the search took longer than {:?}", self.timeout))
            .and_then(|results| results);
        let outcome = if searched.is_ok() { "ok" } else { "failed" };
        metrics()
            .web_searches
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
        let mut results = searched?;
        results.truncate(limit);
        Ok(results)
    }
}

/// A price in USD as nano-units (a configured price is validated finite
/// and not negative).
pub(crate) fn usd_nanos(usd: f64) -> u64 {
    let price = rialto_core::config::price_decimal(usd);
    rialto_billing::to_nanos(price)
        .ok()
        .and_then(|nanos| u64::try_from(nanos).ok())
        .unwrap_or(0)
}

/// The text of an HTML snippet (providers mark the matched words up).
fn plain(snippet: &str) -> String {
    let text = if snippet.contains('<') {
        dom_query::Document::fragment(snippet).text().to_string()
    } else {
        snippet.to_owned()
    };
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    text.chars().take(MAX_SNIPPET_CHARS).collect()
}

/// A provider's JSON answer to `request`, or why there is none.
async fn answer_of(provider: &str, request: reqwest::RequestBuilder) -> Result<Value, String> {
    let unusable = |error: reqwest::Error| {
        if error.is_timeout() {
            format!("{provider} did not answer in time")
        } else if let Some(status) = error.status() {
            format!("{provider} answered {status}")
        } else {
            format!("{provider} could not be reached ({})", error.without_url())
        }
    };
    request
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(unusable)?
        .json()
        .await
        .map_err(|e| format!("{provider} sent an invalid answer ({})", e.without_url()))
}

/// `url` with `pairs` as its query string, form-encoded.
fn with_query(url: &str, pairs: &[(&str, &str)]) -> Result<reqwest::Url, String> {
    reqwest::Url::parse_with_params(url, pairs)
        .map_err(|_| format!("the search provider's URL {url:?} is not a URL"))
}

/// A self-hosted SearXNG instance (its `json` output format enabled).
struct SearXng {
    url: String,
    client: reqwest::Client,
}

#[async_trait]
impl SearchProvider for SearXng {
    async fn search(&self, query: &str, limit: usize) -> Result<Vec<SearchResult>, String> {
        let url = with_query(&self.url, &[("q", query), ("format", "json")])?;
        let body = answer_of("SearXNG", self.client.get(url)).await?;
        let results = body["results"]
            .as_array()
            .ok_or("SearXNG's answer has no results list")?;
        Ok(results
            .iter()
            .filter_map(|result| {
                Some(SearchResult {
                    title: plain(result["title"].as_str()?),
                    url: result["url"].as_str()?.to_owned(),
                    content: plain(result["content"].as_str().unwrap_or_default()),
                    date: result["publishedDate"].as_str().map(str::to_owned),
                })
            })
            .take(limit)
            .collect())
    }
}

/// The Brave Search API (`X-Subscription-Token`).
struct Brave {
    url: String,
    /// The subscription token, rotated in place with `api_key_file`.
    key: rialto_core::secrets::LiveSecret,
    client: reqwest::Client,
}

#[async_trait]
impl SearchProvider for Brave {
    async fn search(&self, query: &str, limit: usize) -> Result<Vec<SearchResult>, String> {
        let count = limit.to_string();
        let url = with_query(&self.url, &[("q", query), ("count", count.as_str())])?;
        let request = self
            .client
            .get(url)
            .header("accept", "application/json")
            .header(
                "x-subscription-token",
                self.key.current().current.expose_secret(),
            );
        let body = answer_of("Brave Search", request).await?;
        let Some(results) = body["web"]["results"].as_array() else {
            // No web results for this query.
            return Ok(Vec::new());
        };
        Ok(results
            .iter()
            .filter_map(|result| {
                Some(SearchResult {
                    title: plain(result["title"].as_str()?),
                    url: result["url"].as_str()?.to_owned(),
                    content: plain(result["description"].as_str().unwrap_or_default()),
                    date: result["page_age"]
                        .as_str()
                        .or_else(|| result["age"].as_str())
                        .map(str::to_owned),
                })
            })
            .take(limit)
            .collect())
    }
}

/// A scraped page.
#[derive(Debug, Clone)]
pub(crate) struct Page {
    pub url: String,
    pub title: String,
    /// Its readable text, as Markdown.
    pub markdown: String,
}

/// Fetches pages and reads them.
#[derive(Clone)]
pub(crate) struct Scraper {
    allow_private: bool,
    max_chars: usize,
    /// Price of one scraped page, in USD nano-units.
    pub price_nanos: u64,
    /// Pages being fetched at once, from all requests: each may hold the
    /// file limit in memory while it arrives.
    slots: std::sync::Arc<tokio::sync::Semaphore>,
}

/// Pages fetched at once by one gateway, at most.
const SCRAPE_SLOTS: usize = 16;

impl Scraper {
    pub(crate) fn new(config: &WebScrapingConfig, allow_private: bool) -> Self {
        Self {
            allow_private,
            max_chars: config.max_chars_per_page,
            price_nanos: usd_nanos(config.usd_per_scraped_url),
            slots: std::sync::Arc::new(tokio::sync::Semaphore::new(SCRAPE_SLOTS)),
        }
    }

    /// Characters of one page's text kept at most.
    pub(crate) fn max_chars(&self) -> usize {
        self.max_chars
    }

    /// `url`'s readable text (at most the configured characters), or why
    /// it could not be had.
    pub(crate) async fn scrape(
        &self,
        url: &str,
        converter: &crate::convert::Converter,
    ) -> Result<Page, String> {
        let page = match self.slots.acquire().await {
            Ok(_slot) => self.read(url, converter).await,
            Err(_) => Err("the gateway is shutting down".to_owned()),
        };
        let outcome = if page.is_ok() { "ok" } else { "failed" };
        metrics()
            .pages_scraped
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
        page
    }

    async fn read(&self, url: &str, converter: &crate::convert::Converter) -> Result<Page, String> {
        let (media_type, bytes) =
            crate::files::fetch(url, self.allow_private, crate::files::MAX_FILE_BYTES).await?;
        let name = page_name(url, &media_type);
        let text = converter
            .to_text(&name, &media_type, bytes)
            .await
            .map_err(|why| why.replacen(&format!("{name:?}"), url, 1))?;
        let text = text.trim();
        if text.is_empty() {
            return Err(format!("{url} has no readable text"));
        }
        let (title, body) = match text.strip_prefix("# ") {
            Some(rest) => match rest.split_once('\n') {
                Some((title, body)) => (title.trim().to_owned(), body.trim_start()),
                None => (rest.trim().to_owned(), ""),
            },
            None => (String::new(), text),
        };
        let title = if title.is_empty() {
            url.to_owned()
        } else {
            title
        };
        let mut markdown: String = body.chars().take(self.max_chars).collect();
        if markdown.is_empty() {
            markdown.clone_from(&title);
        }
        Ok(Page {
            url: url.to_owned(),
            title,
            markdown,
        })
    }
}

/// The name a page is read under (the converter picks the format by the
/// name's extension first, then the media type): a page served as HTML,
/// or with no media type and no document extension, is HTML whatever its
/// URL ends with (`/post.php`, `/docs/`).
fn page_name(url: &str, media_type: &str) -> String {
    use crate::files::{Format, format_of};
    let last = url
        .split(['?', '#'])
        .next()
        .and_then(|u| u.trim_end_matches('/').rsplit('/').next())
        .filter(|segment| segment.contains('.') && !segment.contains(':'));
    let html = "page.html".to_owned();
    if matches!(media_type, "text/html" | "application/xhtml+xml") {
        return html;
    }
    let Some(last) = last else {
        // No name: the media type decides (none: a web page).
        return if media_type.is_empty() {
            html
        } else {
            "page".to_owned()
        };
    };
    let extension = last.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase());
    let documentish = matches!(
        extension.as_deref(),
        Some("txt" | "md" | "markdown" | "csv" | "json")
    );
    match format_of(last, "") {
        Some(Format::Text) if !documentish => {
            // A script's URL (`.php`, `.py`): what it serves decides.
            if media_type.is_empty() {
                html
            } else {
                "page".to_owned()
            }
        }
        Some(_) => last.to_owned(),
        None if media_type.is_empty() => html,
        None => "page".to_owned(),
    }
}

/// The http(s) URLs of `text`, first seen first, each once, at most
/// [`MAX_SCRAPED_URLS`].
pub(crate) fn urls_in(text: &str) -> Vec<String> {
    let mut finder = linkify::LinkFinder::new();
    finder.kinds(&[linkify::LinkKind::Url]);
    let mut urls: Vec<String> = Vec::new();
    for link in finder.links(text) {
        let url = link.as_str();
        let lower = url.to_ascii_lowercase();
        if !(lower.starts_with("http://") || lower.starts_with("https://")) {
            continue;
        }
        if !urls.iter().any(|seen| seen == url) {
            urls.push(url.to_owned());
        }
        if urls.len() == MAX_SCRAPED_URLS {
            break;
        }
    }
    urls
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serves one HTTP request with `body` (JSON) and hands back the
    /// request's head.
    async fn answer_once(body: &'static str) -> (String, tokio::sync::oneshot::Receiver<String>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (sender, receiver) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut head = vec![0u8; 4096];
            let read = socket.read(&mut head).await.unwrap();
            let _ = sender.send(String::from_utf8_lossy(&head[..read]).into_owned());
            let answer = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            );
            socket.write_all(answer.as_bytes()).await.unwrap();
        });
        (url, receiver)
    }

    fn client() -> reqwest::Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::Client::new()
    }

    /// Brave Search's documented shape: `web.results[]` with `title`,
    /// `url`, `description` (marked up) and `page_age`; the key goes in
    /// `X-Subscription-Token`, the limit in `count`.
    #[tokio::test]
    async fn brave_answers_are_read_and_keyed() {
        let (url, head) = answer_once(
            r#"{"type":"search","query":{"original":"rust 2026"},"web":{"type":"search","results":[
              {"title":"Rust <strong>2026</strong>","url":"https://blog.rust-lang.org/","description":"The <strong>Rust</strong> team's plans.","page_age":"2026-01-05T10:00:00","age":"January 5, 2026"},
              {"title":"Second","url":"https://example.org/2","description":"Two."}]}}"#,
        )
        .await;
        let brave = Brave {
            url: format!("{url}/res/v1/web/search"),
            key: rialto_core::secrets::LiveSecret::new("brave-key".to_owned().into()),
            client: client(),
        };
        let results = brave.search("rust 2026", 2).await.unwrap();
        let head = head.await.unwrap().to_ascii_lowercase();
        assert!(
            head.starts_with("get /res/v1/web/search?q=rust+2026&count=2 "),
            "{head}"
        );
        assert!(head.contains("x-subscription-token: brave-key"), "{head}");
        assert_eq!(
            results,
            [
                SearchResult {
                    title: "Rust 2026".to_owned(),
                    url: "https://blog.rust-lang.org/".to_owned(),
                    content: "The Rust team's plans.".to_owned(),
                    date: Some("2026-01-05T10:00:00".to_owned()),
                },
                SearchResult {
                    title: "Second".to_owned(),
                    url: "https://example.org/2".to_owned(),
                    content: "Two.".to_owned(),
                    date: None,
                },
            ]
        );
        // No web results for a query is no results, not a failure.
        let (url, _) = answer_once(r#"{"type":"search","query":{"original":"zzz"}}"#).await;
        let brave = Brave {
            url,
            key: rialto_core::secrets::LiveSecret::new("k".to_owned().into()),
            client: client(),
        };
        assert!(brave.search("zzz", 5).await.unwrap().is_empty());
    }

    /// SearXNG's JSON: results cut to the limit, a result without a URL
    /// skipped, `publishedDate` as the date.
    #[tokio::test]
    async fn searxng_answers_are_read_and_cut_to_the_limit() {
        let (url, head) = answer_once(
            r#"{"query":"q","results":[
              {"url":"https://a.example/","title":"A","content":"first","publishedDate":"2026-02-01T00:00:00"},
              {"title":"no url"},
              {"url":"https://b.example/","title":"B","content":"second","publishedDate":null},
              {"url":"https://c.example/","title":"C","content":"third"}]}"#,
        )
        .await;
        let searxng = SearXng {
            url: format!("{url}/search"),
            client: client(),
        };
        let results = searxng.search("what & why", 2).await.unwrap();
        let head = head.await.unwrap();
        assert!(
            head.starts_with("GET /search?q=what+%26+why&format=json "),
            "{head}"
        );
        let urls: Vec<&str> = results.iter().map(|r| r.url.as_str()).collect();
        assert_eq!(urls, ["https://a.example/", "https://b.example/"]);
        assert_eq!(results[0].date.as_deref(), Some("2026-02-01T00:00:00"));
        assert_eq!(results[1].date, None);
    }

    #[test]
    fn urls_are_found_once_in_order_and_at_most_five() {
        let text = "see https://a.example/x, then (http://b.example/y?z=1) and \
                    https://a.example/x again; ftp://c.example/ is not the web";
        assert_eq!(
            urls_in(text),
            ["https://a.example/x", "http://b.example/y?z=1"]
        );
        let many: String = (0..8).map(|i| format!("https://{i}.example/ ")).collect();
        assert_eq!(urls_in(&many).len(), MAX_SCRAPED_URLS);
        assert!(urls_in("no links here, just example.com").is_empty());
    }

    #[test]
    fn snippets_lose_their_markup_and_length() {
        assert_eq!(
            plain("Why the <strong>sky</strong> is  blue"),
            "Why the sky is blue"
        );
        assert_eq!(plain(&"x".repeat(5_000)).len(), MAX_SNIPPET_CHARS);
    }

    #[test]
    fn pages_are_read_by_their_media_type() {
        assert_eq!(
            page_name("https://a.example/docs/", "text/html"),
            "page.html"
        );
        assert_eq!(page_name("https://a.example/post.php", ""), "page.html");
        assert_eq!(
            page_name("https://a.example/report.pdf", "application/pdf"),
            "report.pdf"
        );
        assert_eq!(page_name("https://a.example/notes.md", ""), "notes.md");
        assert_eq!(
            page_name("https://a.example/get", "application/pdf"),
            "page"
        );
        assert_eq!(page_name("https://a.example/run.py", "text/plain"), "page");
    }

    #[test]
    fn prices_are_exact_nanos() {
        assert_eq!(usd_nanos(0.01), 10_000_000);
        assert_eq!(usd_nanos(0.0), 0);
        assert_eq!(usd_nanos(0.000000001), 1);
    }
}
