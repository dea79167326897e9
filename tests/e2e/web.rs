//! Web search, scraping and citations end to end, in both topologies,
//! against a mock SearXNG that records its queries and serves the pages to
//! scrape: each service parameter's effect on the prompt the upstream
//! reads, on the response and on the stream; citation numbers that index
//! `web_search_citations`; costs that include the search and scrape
//! prices; a failing provider that leaves the answer without its search;
//! and the augment endpoints.

use reqwest::Method;
use rialto_test_kit::{MockSearxng, MockUpstream, Sandbox, Storage, Topology};
use serde_json::{Value, json};

/// $1 per million tokens in and out; a search costs $0.01, a scraped page
/// $0.002, a parsed file $0.0005, an x-search $0.05.
fn config(mock_url: &str, searxng: Option<&str>) -> String {
    let search = searxng.map_or(String::new(), |url| {
        format!(
            r#"
[web_search]
provider = "searxng"
url = "{url}"
usd_per_search = 0.01
timeout_ms = 1500
"#
        )
    });
    format!(
        r#"
[[models]]
id = "search-chat"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
capabilities = ["web_search", "tools"]
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]

[[models]]
id = "plain-chat"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]

[[models]]
id = "x-chat"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 1.0
native_search = {{ search_parameters = {{ mode = "on" }} }}
native_search_usd = 0.05
backends = [{{ kind = "openai", url = "{mock_url}", model = "mock-model" }}]

[web_scraping]
usd_per_scraped_url = 0.002

[text_parser]
usd_per_file = 0.0005
{search}
"#
    )
}

struct World {
    upstream: MockUpstream,
    searxng: MockSearxng,
    sandbox: Sandbox,
    key: String,
    admin: String,
}

async fn world(topology: Topology) -> World {
    let upstream = MockUpstream::start().await.unwrap();
    let searxng = MockSearxng::start().await.unwrap();
    let sandbox = Sandbox::builder(topology)
        .storage(Storage::Sqlite)
        .config(&config(&upstream.base_url(), Some(&searxng.url())))
        // The page server is on loopback.
        .env("RIALTO_GATEWAY__FILE_URLS_ALLOW_PRIVATE", "true")
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("web").await.unwrap();
    let (_, key) = sandbox
        .create_key(&account.admin_key, "INFERENCE")
        .await
        .unwrap();
    World {
        upstream,
        searxng,
        sandbox,
        key,
        admin: account.admin_key,
    }
}

mod web_search {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_process() {
        super::scenarios(super::world(rialto_test_kit::Topology::OneProcess).await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn split() {
        super::scenarios(super::world(rialto_test_kit::Topology::Split).await).await;
    }
}

/// A cost's USD in nano-dollars.
fn nanos(cost: &Value) -> i64 {
    rialto_billing::parse_amount("usd", &cost["usd"].to_string()).unwrap()
}

/// What `usage` costs at $1 per million tokens, in nano-dollars.
fn token_nanos(usage: &Value) -> i64 {
    let tokens =
        usage["prompt_tokens"].as_i64().unwrap() + usage["completion_tokens"].as_i64().unwrap();
    tokens * 1_000
}

const SEARCH_NANOS: i64 = 10_000_000;
const PAGE_NANOS: i64 = 2_000_000;

impl World {
    async fn chat(&self, body: &Value) -> reqwest::Response {
        self.sandbox
            .call(Method::POST, "/chat/completions", &self.key, Some(body))
            .await
            .unwrap()
    }

    async fn chat_ok(&self, body: &Value) -> Value {
        let response = self.chat(body).await;
        let status = response.status();
        let text = response.text().await.unwrap();
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    /// The data events of a streamed chat, parsed (`[DONE]` as a string).
    async fn stream(&self, body: &Value) -> (reqwest::header::HeaderMap, Vec<Value>) {
        let response = self.chat(body).await;
        assert_eq!(response.status(), 200);
        let headers = response.headers().clone();
        let text = response.text().await.unwrap();
        let events = text
            .split("\n\n")
            .filter_map(|event| event.strip_prefix("data: "))
            .map(|data| serde_json::from_str(data).unwrap_or_else(|_| json!(data)))
            .collect();
        (headers, events)
    }

    /// The system message the upstream's last request began with (the
    /// sources block), or "".
    fn last_sources_block(&self) -> String {
        let request = self.upstream.requests().last().cloned().unwrap();
        request["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "system")
            .filter_map(|m| m["content"].as_str())
            .find(|text| text.contains("URL: "))
            .unwrap_or_default()
            .to_owned()
    }

    async fn balance_nanos(&self) -> i64 {
        let balance: Value = self
            .sandbox
            .call(Method::GET, "/billing/balance", &self.admin, None)
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        rialto_billing::parse_amount("usd", &balance["balances"]["usd"].to_string()).unwrap()
    }
}

async fn scenarios(world: World) {
    search_on_with_citations(&world).await;
    suffix_and_stream_citations(&world).await;
    documents(&world).await;
    scraping(&world).await;
    auto(&world).await;
    failing_provider(&world).await;
    refusals_and_x_search(&world).await;
    endpoints(&world).await;
    openai_sdk(&world).await;
}

/// The official `openai` SDK finds the citations in `model_extra`.
async fn openai_sdk(world: &World) {
    let base_url = world.sandbox.api("");
    let stdout = crate::python::run_script(
        "openai_web_search_check.py",
        &[
            ("RIALTO_E2E_BASE_URL", &base_url),
            ("RIALTO_E2E_API_KEY", &world.key),
            ("RIALTO_E2E_MODEL", "search-chat"),
        ],
    )
    .await;
    assert!(stdout.contains("stream citations ok"), "{stdout}");
}

/// `on`: the last user message is searched, the results are numbered
/// sources first in the prompt with the citation instructions, and the
/// answer carries them as `web_search_citations`, charged one search.
async fn search_on_with_citations(world: &World) {
    let body = json!({"model": "search-chat", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "why is the sky blue"}],
        "rialto_parameters": {"enable_web_search": "on", "enable_web_citations": true},
        "mock": {"reply": "Rayleigh scattering [REF]1[/REF]."}});
    let answer = world.chat_ok(&body).await;
    assert_eq!(
        world.searxng.queries().last().unwrap(),
        "why is the sky blue"
    );
    let block = world.last_sources_block();
    assert!(
        block.contains("[1] Result 1 about why is the sky blue"),
        "{block}"
    );
    assert!(block.contains("[3] Result 3 about"), "{block}");
    assert!(block.contains("[REF]n[/REF]"), "{block}");
    assert!(block.contains("Published: 2026-11-01T10:00:00"), "{block}");
    // The snippet's markup is gone.
    assert!(block.contains("Snippet 1: what source 1 says"), "{block}");
    // The sources come before the caller's own system prompt.
    let sent = world.upstream.requests().last().cloned().unwrap();
    let position = |needle: &str| {
        sent["messages"]
            .as_array()
            .unwrap()
            .iter()
            .position(|m| m["content"].as_str().unwrap_or("").contains(needle))
            .unwrap()
    };
    assert!(position("URL: ") < position("Be brief."), "{sent}");
    let echo = &answer["rialto_parameters"];
    assert_eq!(echo["enable_web_search"], "on", "{echo}");
    assert_eq!(echo["enable_web_citations"], true);
    let citations = echo["web_search_citations"].as_array().unwrap();
    assert_eq!(citations.len(), 3, "{echo}");
    // [REF]1[/REF] indexes the first citation, as the prompt numbered it.
    let content = answer["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.contains("[REF]1[/REF]"), "{content}");
    assert_eq!(citations[0]["title"], "Result 1 about why is the sky blue");
    assert!(
        citations[0]["url"]
            .as_str()
            .unwrap()
            .ends_with("/pages/result-1")
    );
    assert_eq!(citations[0]["date"], "2026-11-01T10:00:00");
    assert!(citations[1].get("date").is_none(), "{}", citations[1]);
    assert_eq!(
        nanos(&answer["cost"]),
        token_nanos(&answer["usage"]) + SEARCH_NANOS,
        "{answer}"
    );
    // Without search: no citations member, no search, no price.
    let queries = world.searxng.queries().len();
    let plain = world
        .chat_ok(&json!({"model": "search-chat", "messages": [{"role": "user", "content": "hi"}]}))
        .await;
    assert_eq!(world.searxng.queries().len(), queries);
    assert_eq!(plain["rialto_parameters"]["enable_web_search"], "off");
    assert!(
        plain["rialto_parameters"]
            .get("web_search_citations")
            .is_none()
    );
    assert_eq!(nanos(&plain["cost"]), token_nanos(&plain["usage"]));
}

/// Parameters in the model suffix work as in the body; a stream carries
/// the citations in a last `choices: []` chunk only when asked.
async fn suffix_and_stream_citations(world: &World) {
    let body = json!({"model": "search-chat:enable_web_search=on&include_search_results_in_stream=true",
        "stream": true, "messages": [{"role": "user", "content": "latest rust release"}]});
    let (_, events) = world.stream(&body).await;
    assert_eq!(
        world.searxng.queries().last().unwrap(),
        "latest rust release"
    );
    assert_eq!(events.last().unwrap(), "[DONE]");
    let citations = &events[events.len() - 2];
    assert_eq!(citations["choices"], json!([]), "{citations}");
    assert_eq!(citations["object"], "chat.completion.chunk");
    let listed = citations["rialto_parameters"]["web_search_citations"]
        .as_array()
        .unwrap();
    assert_eq!(listed.len(), 3, "{citations}");
    assert_eq!(listed[2]["title"], "Result 3 about latest rust release");
    // The usage chunk before it charges the search.
    let usage = &events[events.len() - 3];
    assert_eq!(
        nanos(&usage["cost"]),
        token_nanos(&usage["usage"]) + SEARCH_NANOS,
        "{usage}"
    );
    // Without the flag, no citations in the stream.
    let body = json!({"model": "search-chat:enable_web_search=on", "stream": true,
        "messages": [{"role": "user", "content": "latest rust release"}]});
    let (_, events) = world.stream(&body).await;
    assert!(
        events.iter().all(|e| e.get("rialto_parameters").is_none()),
        "{events:?}"
    );
}

/// `return_search_results_as_documents`: a `web_search` tool call with
/// the documents, first in the message (a stream's first chunk), and the
/// finish reason `tool_calls`.
async fn documents(world: &World) {
    let parameters = json!({"enable_web_search": "on", "return_search_results_as_documents": true});
    let body = json!({"model": "search-chat", "rialto_parameters": parameters,
        "messages": [{"role": "user", "content": "what is new"}]});
    let answer = world.chat_ok(&body).await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{answer}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["id"], "web_search_call");
    assert_eq!(call["function"]["name"], "web_search");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    let documents = arguments["documents"].as_array().unwrap();
    assert_eq!(documents.len(), 3);
    assert_eq!(documents[0]["id"], "1");
    assert_eq!(documents[0]["title"], "Result 1 about what is new");
    assert_eq!(documents[0]["published_at"], "2026-11-01T10:00:00");
    assert!(
        documents[1]["snippet"]
            .as_str()
            .unwrap()
            .contains("source 2")
    );
    assert!(choice["message"]["content"].as_str().is_some());

    let mut body = body;
    body["stream"] = json!(true);
    let (_, events) = world.stream(&body).await;
    let first = &events[0]["choices"][0]["delta"];
    assert_eq!(
        first["tool_calls"][0]["function"]["name"], "web_search",
        "{first}"
    );
    assert_eq!(first["tool_calls"][0]["index"], 0);
    let finishes: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"].get(0))
        .map(|c| &c["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes, [&json!("tool_calls")], "{events:?}");
    // The model's own streamed call comes after the documents: its
    // index moves from 0 to 1.
    let own = json!({"model": "search-chat", "stream": true, "rialto_parameters": parameters,
        "messages": [{"role": "user", "content": "weather in Paris"}],
        "tools": [{"type": "function", "function": {"name": "weather",
            "parameters": {"type": "object", "properties": {}}}}],
        "mock": {"tool_call": {"name": "weather", "arguments": {"city": "Paris"}}}});
    let (_, events) = world.stream(&own).await;
    let calls: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"].get(0))
        .filter_map(|c| c["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls[0]["function"]["name"], "web_search", "{events:?}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[1]["function"]["name"], "weather", "{events:?}");
    assert!(
        calls[1..].iter().all(|call| call["index"] == 1),
        "{events:?}"
    );
    // The non-streamed call keeps the model's own calls after it.
    assert_eq!(
        answer["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

/// `enable_web_scraping`: the URLs of the last user message are fetched and
/// read (only their article), put in the prompt, and only those read are
/// billed; search is bypassed.
async fn scraping(world: &World) {
    let alpha = world.searxng.page_url("alpha");
    let missing = world.searxng.page_url("missing");
    let queries = world.searxng.queries().len();
    let body = json!({"model": "search-chat", "messages": [{"role": "user",
            "content": format!("Compare {alpha} with {missing}, please.")}],
        "rialto_parameters": {"enable_web_scraping": true, "enable_web_search": "on"}});
    let answer = world.chat_ok(&body).await;
    let served = world.searxng.pages_served();
    assert!(
        served.contains(&"alpha".to_owned()) && served.contains(&"missing".to_owned()),
        "{served:?}"
    );
    assert_eq!(
        world.searxng.queries().len(),
        queries,
        "scraping bypasses search"
    );
    let block = world.last_sources_block();
    // A page that could not be read says why in the log (CI once saw an
    // empty block here, with both pages served).
    let why = || {
        world
            .sandbox
            .logs()
            .lines()
            .filter(|line| line.contains("scrape") || line.contains("convert"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(
        block.contains("Fact of alpha: the answer is 42."),
        "sources {block:?}; answer {answer}; log:\n{}",
        why()
    );
    assert!(block.contains(&format!("URL: {alpha}")), "{block}");
    assert!(!block.contains(&missing), "{block}");
    let echo = &answer["rialto_parameters"];
    assert_eq!(echo["enable_web_scraping"], true, "{echo}");
    assert_eq!(echo["enable_web_search"], "off", "{echo}");
    assert_eq!(echo["web_search_citations"][0]["url"], alpha.as_str());
    assert_eq!(
        nanos(&answer["cost"]),
        token_nanos(&answer["usage"]) + PAGE_NANOS,
        "one page read, one billed: {answer}"
    );
}

/// `auto`: the model decides through the search tool; its query is
/// searched and its decision priced; a model that does not call the tool
/// gets no search. A model without function calling behaves as `off`.
async fn auto(world: &World) {
    let before = world.upstream.request_count();
    let body = json!({"model": "search-chat", "messages": [{"role": "user", "content": "any news?"}],
        "rialto_parameters": {"enable_web_search": "auto"},
        "mock": {"tool_call": {"name": "web_search", "arguments": {"query": "news today"}}}});
    let answer = world.chat_ok(&body).await;
    assert_eq!(world.searxng.queries().last().unwrap(), "news today");
    let requests = world.upstream.requests();
    assert_eq!(requests.len(), before + 2, "a decision, then the answer");
    let decision = &requests[before];
    assert_eq!(decision["tools"][0]["function"]["name"], "web_search");
    assert_eq!(decision["max_tokens"], 256);
    assert!(requests[before + 1].get("tools").is_none());
    assert_eq!(answer["rialto_parameters"]["enable_web_search"], "auto");
    assert_eq!(
        answer["rialto_parameters"]["web_search_citations"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    // The decision's tokens: its prompt (the mock counts words) and 10.
    let decision_words: i64 = decision["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m["content"]
                .as_str()
                .unwrap_or("")
                .split_whitespace()
                .count() as i64
        })
        .sum();
    assert_eq!(
        nanos(&answer["cost"]),
        token_nanos(&answer["usage"]) + SEARCH_NANOS + (decision_words + 10) * 1_000,
        "{answer}"
    );

    let queries = world.searxng.queries().len();
    let declined = json!({"model": "search-chat", "messages": [{"role": "user", "content": "hello"}],
        "rialto_parameters": {"enable_web_search": "auto"}});
    let answer = world.chat_ok(&declined).await;
    assert_eq!(world.searxng.queries().len(), queries);
    assert_eq!(answer["rialto_parameters"]["enable_web_search"], "auto");
    assert_eq!(
        answer["rialto_parameters"]["web_search_citations"],
        json!([])
    );

    let before = world.upstream.request_count();
    let no_tools = json!({"model": "plain-chat", "messages": [{"role": "user", "content": "hello"}],
        "rialto_parameters": {"enable_web_search": "auto"}});
    let answer = world.chat_ok(&no_tools).await;
    assert_eq!(world.upstream.request_count(), before + 1);
    assert_eq!(answer["rialto_parameters"]["enable_web_search"], "off");
}

/// A provider that fails or is too slow: the answer comes without search,
/// the echo says `off`, `x-rialto-web-search-error` says why, and the
/// search is not charged.
async fn failing_provider(world: &World) {
    // The backend refuses the request as invalid after the search: the
    // search was made and is charged; nothing else is.
    let balance = world.balance_nanos().await;
    let refused = json!({"model": "search-chat", "messages": [{"role": "user", "content": "sky"}],
        "rialto_parameters": {"enable_web_search": "on"}, "mock": {"status": 400}});
    assert_eq!(world.chat(&refused).await.status(), 400);
    // The settlement of a failed request runs off the response's path.
    let mut spent = 0;
    for _ in 0..50 {
        spent = balance - world.balance_nanos().await;
        if spent != 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(spent, SEARCH_NANOS);

    world.searxng.fail_with(Some(500));
    let body = json!({"model": "search-chat", "messages": [{"role": "user", "content": "sky"}],
        "rialto_parameters": {"enable_web_search": "on"}});
    let response = world.chat(&body).await;
    assert_eq!(response.status(), 200);
    let why = response.headers()["x-rialto-web-search-error"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(why.contains("500"), "{why}");
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["rialto_parameters"]["enable_web_search"], "off");
    assert_eq!(world.last_sources_block(), "");
    assert_eq!(nanos(&answer["cost"]), token_nanos(&answer["usage"]));
    world.searxng.fail_with(None);

    world.searxng.delay(std::time::Duration::from_secs(3));
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (headers, events) = world.stream(&streamed).await;
    assert!(headers.contains_key("x-rialto-web-search-error"));
    assert_eq!(events.last().unwrap(), "[DONE]");
    world.searxng.delay(std::time::Duration::ZERO);
}

/// Search on a model that does not allow it, and x-search on one whose
/// upstream does not search, are 400s; x-search on one that does is
/// passed to the upstream (and priced), with no search of ours.
async fn refusals_and_x_search(world: &World) {
    for (model, parameters, field) in [
        (
            "plain-chat",
            json!({"enable_web_search": "on"}),
            "enable_web_search",
        ),
        (
            "search-chat",
            json!({"enable_x_search": true}),
            "enable_x_search",
        ),
    ] {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
            "rialto_parameters": parameters});
        let response = world.chat(&body).await;
        assert_eq!(response.status(), 400);
        let error: Value = response.json().await.unwrap();
        assert!(
            error["details"]["rialto_parameters"][field]["_errors"][0].is_string(),
            "{error}"
        );
    }
    let queries = world.searxng.queries().len();
    let body = json!({"model": "x-chat", "messages": [{"role": "user", "content": "trending"}],
        "rialto_parameters": {"enable_x_search": true, "enable_web_search": "on"}});
    let answer = world.chat_ok(&body).await;
    assert_eq!(world.searxng.queries().len(), queries);
    let sent = world.upstream.requests().last().cloned().unwrap();
    assert_eq!(sent["search_parameters"], json!({"mode": "on"}));
    assert_eq!(
        nanos(&answer["cost"]),
        token_nanos(&answer["usage"]) + 50_000_000,
        "{answer}"
    );
    // `/models` advertises what each model can do here.
    let models: Value = world
        .sandbox
        .http()
        .get(world.sandbox.api("/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let capability = |id: &str, name: &str| {
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["id"] == id)
            .map(|m| m["model_spec"]["capabilities"][name].clone())
            .unwrap()
    };
    assert_eq!(capability("search-chat", "supportsWebSearch"), true);
    assert_eq!(capability("plain-chat", "supportsWebSearch"), false);
    assert_eq!(capability("x-chat", "supportsXSearch"), true);
}

/// A multipart form with one file.
fn form(name: &str, content: &[u8], format: Option<&str>) -> (String, Vec<u8>) {
    let boundary = "rialto-test-boundary";
    let mut body = Vec::new();
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(content);
    body.extend_from_slice(b"\r\n");
    if let Some(format) = format {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"response_format\"\r\n\r\n{format}\r\n"
            )
            .as_bytes(),
        );
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// `/augment/search`, `/augment/scrape` and `/augment/text-parser` in the
/// hosted API's shapes, each billed its price, and refused cleanly.
async fn endpoints(world: &World) {
    let balance = world.balance_nanos().await;
    let search = |body: Value| async move {
        world
            .sandbox
            .call(Method::POST, "/augment/search", &world.key, Some(&body))
            .await
    };
    let response = search(json!({"query": "rust", "limit": 2})).await.unwrap();
    assert_eq!(response.status(), 200);
    let found: Value = response.json().await.unwrap();
    assert_eq!(found["query"], "rust");
    assert_eq!(found["results"].as_array().unwrap().len(), 2, "{found}");
    assert_eq!(found["results"][0]["title"], "Result 1 about rust");
    assert_eq!(found["results"][1]["date"], "");
    for bad in [
        json!({}),
        json!({"query": ""}),
        json!({"query": "x", "limit": 21}),
        json!({"query": "x", "search_provider": "bing"}),
    ] {
        assert_eq!(search(bad.clone()).await.unwrap().status(), 400, "{bad}");
    }

    let scrape = |url: String| async move {
        let body = json!({"url": url});
        world
            .sandbox
            .call(Method::POST, "/augment/scrape", &world.key, Some(&body))
            .await
    };
    let response = scrape(world.searxng.page_url("beta")).await.unwrap();
    let status = response.status();
    let page: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["format"], "markdown");
    let content = page["content"].as_str().unwrap();
    assert!(content.starts_with("# Page beta"), "{content}");
    assert!(
        content.contains("Fact of beta: the answer is 42."),
        "{content}"
    );
    let refused = scrape(world.searxng.page_url("missing")).await.unwrap();
    assert_eq!(refused.status(), 400);
    assert_eq!(
        scrape("ftp://example.com/".into()).await.unwrap().status(),
        400
    );

    let parse = |name: &str, content: &[u8], format: Option<&str>| {
        let (content_type, body) = form(name, content, format);
        world
            .sandbox
            .http()
            .post(world.sandbox.api("/augment/text-parser"))
            .bearer_auth(&world.key)
            .header("content-type", content_type)
            .body(body)
            .send()
    };
    let response = parse("notes.md", b"# Notes\n\nFour words of text.", None)
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let parsed: Value = response.json().await.unwrap();
    assert_eq!(parsed["text"], "# Notes\n\nFour words of text.");
    assert_eq!(parsed["tokens"], 7);
    let response = parse(
        "page.html",
        rialto_test_kit::searxng::article("gamma").as_bytes(),
        Some("text"),
    )
    .await
    .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    assert!(response.text().await.unwrap().contains("Fact of gamma"));
    let refused = parse("tool.exe", b"MZ", None).await.unwrap();
    assert_eq!(refused.status(), 400);
    // A form past the file limit is refused before it is all read.
    let huge = vec![b'a'; 11 * 1024 * 1024];
    let refused = parse("big.txt", &huge, None).await.unwrap();
    assert_eq!(refused.status(), 413);

    // One search, one page and two files were billed; the refusals were
    // not.
    let spent = balance - world.balance_nanos().await;
    assert_eq!(spent, SEARCH_NANOS + PAGE_NANOS + 2 * 500_000);
}

/// Without `[web_search]`: a request asking for search is a 400 naming
/// the configuration, and no model advertises search.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_needs_a_provider() {
    let upstream = MockUpstream::start().await.unwrap();
    let sandbox = Sandbox::builder(Topology::OneProcess)
        .storage(Storage::Sqlite)
        .config(&config(&upstream.base_url(), None))
        .start()
        .await
        .unwrap();
    let account = sandbox.create_account("nosearch").await.unwrap();
    for mode in ["on", "auto"] {
        let body = json!({"model": "search-chat", "messages": [{"role": "user", "content": "hi"}],
            "rialto_parameters": {"enable_web_search": mode}});
        let response = sandbox
            .call(
                Method::POST,
                "/chat/completions",
                &account.admin_key,
                Some(&body),
            )
            .await
            .unwrap();
        assert_eq!(response.status(), 400);
        let error: Value = response.json().await.unwrap();
        let why = error["details"]["rialto_parameters"]["enable_web_search"]["_errors"][0]
            .as_str()
            .unwrap();
        assert!(why.contains("[web_search]"), "{why}");
    }
    assert_eq!(upstream.request_count(), 0);
    let response = sandbox
        .call(
            Method::POST,
            "/augment/search",
            &account.admin_key,
            Some(&json!({"query": "x"})),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let models: Value = sandbox
        .http()
        .get(sandbox.api("/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["model_spec"]["capabilities"]["supportsWebSearch"] != true),
        "{models}"
    );
}
