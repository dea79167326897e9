//! Web search, scraping and citations: the chat's `<brand>_parameters`
//! that bring the web into the prompt, and the endpoints that do it alone
//! (`POST /augment/search`, `/augment/scrape`, `/augment/text-parser`).
//!
//! A chat's [`Plan`] is made before admission (refusing what cannot be
//! done: search with no provider configured, x-search on a model whose
//! upstream does not search) so the hold covers the most it can cost;
//! [`run`] carries it out after the hold: it scrapes the URLs of the last
//! user message, or searches (with a query the model writes, or decides
//! to write, when asked), and puts what it found first in the prompt as a
//! system message of numbered sources. A provider that fails costs the
//! request its search, never its answer: the echo then says `off` and
//! `x-<brand>-web-search-error` says why.

use actix_web::{HttpRequest, HttpResponse, web};
use rialto_core::ErrorCode;
use rialto_proto::auth::v1 as auth_pb;
use serde_json::{Map, Value, json};

use crate::chat::{Admitted, Echo, Priced, Reservation, Usage, admit, balance_remaining};
use crate::headers::RequestId;
use crate::sources::{MAX_QUERY_CHARS, SearchResult};
use crate::{ApiError, Details, Gateway, ModelEntry, authenticate, parse_json, read_body};

/// Name of the search tool offered to a model under `auto`, and of the
/// synthetic tool call that carries the results as documents.
pub(crate) const SEARCH_TOOL: &str = "web_search";

/// Id of the synthetic documents tool call.
const DOCUMENTS_CALL_ID: &str = "web_search_call";

/// Completion tokens a model may spend writing a query or deciding to
/// search.
const QUERY_TOKENS: u64 = 256;

/// Longest title of a source kept, in characters.
const MAX_TITLE_CHARS: usize = 300;

/// Longest URL of a search result kept (a longer one drops the result).
const MAX_URL_CHARS: usize = 500;

/// Characters a source adds to the prompt besides its text, at most
/// (title, URL, date, numbering).
const RESULT_OVERHEAD_CHARS: usize = MAX_TITLE_CHARS + MAX_URL_CHARS + 100;

/// Whether and how a chat searches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SearchMode {
    Off,
    On,
    Auto,
}

impl SearchMode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            SearchMode::Off => "off",
            SearchMode::On => "on",
            SearchMode::Auto => "auto",
        }
    }
}

/// What a chat asks of the web, decided before admission.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) search: SearchMode,
    /// Ask the model for `[REF]n[/REF]` markers.
    citations: bool,
    /// A stream ends with a chunk carrying the citations.
    pub(crate) in_stream: bool,
    /// The results also come as a `web_search` tool call.
    pub(crate) documents: bool,
    /// The URLs to scrape (scraping bypasses search when there are some).
    scrape: Vec<String>,
    /// The upstream searches natively (its own price is in the extras).
    x_search_nanos: u64,
    /// What the user wrote last (before any file became text): searched
    /// for, and where the links to scrape were found.
    user_text: String,
    /// The prompt's estimate without sources: the model's query call reads
    /// about this much.
    prompt_tokens: u64,
    /// The most the plan adds to the request's cost (USD nano-units) and
    /// to its prompt (tokens): what the hold reserves for it.
    pub(crate) most_extra_usd_nanos: u64,
    pub(crate) most_prompt_tokens: u64,
    /// Tokens of the model's query call at most, which the rate windows
    /// count too.
    pub(crate) most_query_tokens: u64,
}

/// One numbered source of an answer: a search result or a scraped page.
#[derive(Debug, Clone)]
pub(crate) struct Source {
    title: String,
    url: String,
    /// A snippet (a page's first characters).
    content: String,
    date: Option<String>,
}

impl Source {
    fn citation(&self) -> Value {
        let mut citation = json!({"title": self.title, "url": self.url, "content": self.content});
        if let Some(date) = &self.date {
            citation["date"] = json!(date);
        }
        citation
    }
}

impl From<SearchResult> for Source {
    fn from(result: SearchResult) -> Self {
        Self {
            title: result.title,
            url: result.url,
            content: result.content,
            date: result.date,
        }
    }
}

/// What [`run`] did.
#[derive(Debug, Clone, Default)]
pub(crate) struct Outcome {
    /// Whether sources were looked for (a search ran, or pages were
    /// scraped): the response then carries `web_search_citations`.
    pub(crate) looked: bool,
    pub(crate) sources: Vec<Source>,
    /// Why the search was left out, for `x-<brand>-web-search-error`.
    pub(crate) error: Option<String>,
    /// What it cost besides the answer's tokens (USD nano-units).
    pub(crate) extra_usd_nanos: u64,
    /// Tokens the model's query call used.
    pub(crate) extra_tokens: u64,
    /// Characters the sources added to the prompt.
    pub(crate) prompt_chars: usize,
    scraped: usize,
    searched: bool,
}

/// The text of the last user message (its text parts, joined).
pub(crate) fn last_user_text(body: &Value) -> String {
    let Some(message) = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|messages| {
            messages
                .iter()
                .rev()
                .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        })
    else {
        return String::new();
    };
    match message.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter(|part| part.get("type").and_then(Value::as_str) == Some("text"))
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// Whether a chat's echo asks for anything of the web (most do not: they
/// pay for no planning).
pub(crate) fn asks_for_web(parameters: &Echo, x_search: bool) -> bool {
    x_search || parameters.web_scraping || parameters.web_search != SearchMode::Off
}

/// The plan of a chat whose echo (`parameters`) holds what it asked for,
/// or None when it asks nothing of the web. Refuses (400) a search no
/// provider can make, search on a model that does not allow it, and
/// `enable_x_search` on a model whose upstream does not search; merges
/// the model's native-search members into `body` when it does.
pub(crate) fn plan(
    gateway: &Gateway,
    model: &ModelEntry,
    parameters: &mut Echo,
    x_search: bool,
    body: &mut Map<String, Value>,
    prompt_tokens: u64,
    user_text: String,
) -> Result<Option<Plan>, ApiError> {
    let field = gateway.brand.parameters_field.as_str();
    let config = &model.config;
    let mut search = parameters.web_search;
    let scraping = parameters.web_scraping;
    let mut x_search_nanos = 0;
    if x_search {
        let Some(native) = &config.native_search else {
            return Err(invalid_at(
                &[field, "enable_x_search"],
                format!(
                    "Model {} does not search natively; enable_x_search is only for models \
                     whose upstream does",
                    config.id
                ),
            ));
        };
        for (name, value) in native {
            body.insert(name.clone(), value.clone());
        }
        x_search_nanos = crate::sources::usd_nanos(config.native_search_usd);
        // The upstream's own search replaces ours.
        search = SearchMode::Off;
    }
    let scrape = if scraping {
        crate::sources::urls_in(&user_text)
    } else {
        Vec::new()
    };
    if !scrape.is_empty() {
        // Scraped pages are the sources: no search.
        search = SearchMode::Off;
    }
    if search != SearchMode::Off {
        if gateway.web_search.is_none() {
            return Err(invalid_at(
                &[field, "enable_web_search"],
                "Web search is not configured on this server: its operator sets \
                 [web_search] provider (searxng or brave)",
            ));
        }
        let allowed = config.capabilities.iter().any(|c| c == "web_search");
        let tools = config.capabilities.iter().any(|c| c == "tools");
        match search {
            SearchMode::On if !allowed => {
                return Err(invalid_at(
                    &[field, "enable_web_search"],
                    format!("Model {} does not support web search", config.id),
                ));
            }
            // `auto` is "if the model can": off where it cannot decide.
            SearchMode::Auto if !(allowed && tools) => search = SearchMode::Off,
            _ => {}
        }
    }
    parameters.web_search = search;
    parameters.web_scraping = !scrape.is_empty();
    let citations = parameters.web_citations;
    let in_stream = parameters.search_results_in_stream;
    let documents = parameters.search_results_as_documents;
    if search == SearchMode::Off && scrape.is_empty() && x_search_nanos == 0 {
        return Ok(None);
    }
    let prices = &model.prices;
    let query_cost = || {
        let most = prices.cost(&rialto_proto::billing::v1::Usage {
            prompt_tokens,
            completion_tokens: QUERY_TOKENS,
            ..Default::default()
        });
        rialto_billing::to_nanos(most)
            .ok()
            .and_then(|n| u64::try_from(n).ok())
            .unwrap_or(u64::MAX)
    };
    let mut most_extra_usd_nanos = x_search_nanos;
    let mut most_prompt_chars = 0usize;
    let mut most_query_tokens = 0;
    if let Some(provider) = gateway
        .web_search
        .as_ref()
        .filter(|_| search != SearchMode::Off)
    {
        most_extra_usd_nanos = most_extra_usd_nanos.saturating_add(provider.price_nanos);
        if search == SearchMode::Auto || provider.query_from_model {
            most_extra_usd_nanos = most_extra_usd_nanos.saturating_add(query_cost());
            most_query_tokens = prompt_tokens.saturating_add(QUERY_TOKENS);
        }
        most_prompt_chars = provider.max_results
            * (crate::sources::MAX_SNIPPET_CHARS + RESULT_OVERHEAD_CHARS)
            + RESULT_OVERHEAD_CHARS;
    }
    if !scrape.is_empty() {
        let pages = scrape.len() as u64;
        let scraper = &gateway.scraper;
        most_extra_usd_nanos =
            most_extra_usd_nanos.saturating_add(scraper.price_nanos.saturating_mul(pages));
        most_prompt_chars = scrape.len() * (scraper.max_chars() + RESULT_OVERHEAD_CHARS);
    }
    Ok(Some(Plan {
        search,
        citations,
        in_stream,
        documents,
        scrape,
        x_search_nanos,
        user_text,
        prompt_tokens,
        most_extra_usd_nanos,
        most_prompt_tokens: (most_prompt_chars as u64).div_ceil(4),
        most_query_tokens,
    }))
}

/// Carries `plan` out for `chat` (after its hold): the sources found go
/// first in its prompt.
pub(crate) async fn run(
    gateway: &Gateway,
    model: &ModelEntry,
    plan: &Plan,
    chat: &mut rialto_router::Chat,
) -> Outcome {
    let mut outcome = Outcome {
        extra_usd_nanos: plan.x_search_nanos,
        ..Outcome::default()
    };
    if !plan.scrape.is_empty() {
        scrape_into(gateway, plan, &mut outcome).await;
    } else if plan.search != SearchMode::Off
        && let Some(provider) = &gateway.web_search
    {
        search_into(gateway, provider, model, plan, chat, &mut outcome).await;
    }
    if !outcome.sources.is_empty() {
        let block = sources_prompt(plan, &outcome);
        outcome.prompt_chars = block.chars().count();
        if let Some(Value::Array(messages)) = chat.body.get_mut("messages") {
            messages.insert(0, json!({"role": "system", "content": block}));
        }
    }
    outcome
}

/// Scrapes the plan's URLs at once; each page read is a source, and billed.
async fn scrape_into(gateway: &Gateway, plan: &Plan, outcome: &mut Outcome) {
    let scraper = &gateway.scraper;
    let pages = futures_util::future::join_all(
        plan.scrape
            .iter()
            .map(|url| scraper.scrape(url, &gateway.converter)),
    )
    .await;
    outcome.looked = true;
    for (url, page) in plan.scrape.iter().zip(pages) {
        match page {
            Ok(page) => {
                outcome.scraped += 1;
                let markdown: String = page.markdown.chars().take(scraper.max_chars()).collect();
                outcome.sources.push(Source {
                    title: page.title.chars().take(MAX_TITLE_CHARS).collect(),
                    url: page.url,
                    content: markdown,
                    date: None,
                });
            }
            Err(why) => tracing::info!(url, why, "a linked page could not be scraped"),
        }
    }
    outcome.extra_usd_nanos = outcome
        .extra_usd_nanos
        .saturating_add(scraper.price_nanos.saturating_mul(outcome.scraped as u64));
}

/// Decides the query (the last user message, or one the model writes or
/// decides to write) and searches it.
async fn search_into(
    gateway: &Gateway,
    provider: &crate::sources::WebSearch,
    model: &ModelEntry,
    plan: &Plan,
    chat: &rialto_router::Chat,
    outcome: &mut Outcome,
) {
    let query = if plan.search == SearchMode::Auto || provider.query_from_model {
        let decide = plan.search == SearchMode::Auto;
        let asked = ask_for_query(gateway, model, chat, decide, plan.prompt_tokens).await;
        outcome.extra_usd_nanos = outcome.extra_usd_nanos.saturating_add(asked.cost_nanos);
        outcome.extra_tokens = asked.tokens;
        match asked.query {
            Ok(Some(query)) => query,
            // The model chose not to search.
            Ok(None) => return,
            Err(why) => {
                outcome.error = Some(why);
                return;
            }
        }
    } else {
        plan.user_text.clone()
    };
    match provider.search(&query, provider.max_results).await {
        Ok(results) => {
            outcome.looked = true;
            outcome.searched = true;
            outcome.extra_usd_nanos = outcome.extra_usd_nanos.saturating_add(provider.price_nanos);
            outcome.sources = results
                .into_iter()
                .filter(|result| result.url.chars().count() <= MAX_URL_CHARS)
                .map(|mut result| {
                    result.title = result.title.chars().take(MAX_TITLE_CHARS).collect();
                    Source::from(result)
                })
                .collect();
        }
        Err(why) => {
            tracing::warn!(why, "web search failed; answering without it");
            outcome.error = Some(why);
        }
    }
}

/// What the model answered when asked for a query.
struct Asked {
    /// The query; None when it chose not to search.
    query: Result<Option<String>, String>,
    cost_nanos: u64,
    tokens: u64,
}

/// Asks the model (one non-streamed call, at most [`QUERY_TOKENS`]) for
/// a search query: through the search tool, which it may leave uncalled
/// (`decide`), or as its whole answer.
async fn ask_for_query(
    gateway: &Gateway,
    model: &ModelEntry,
    chat: &rialto_router::Chat,
    decide: bool,
    prompt_estimate: u64,
) -> Asked {
    let mut body = chat.body.clone();
    for member in [
        "stream",
        "stream_options",
        "n",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
        "response_format",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
    ] {
        body.remove(member);
    }
    body.insert("max_tokens".into(), json!(QUERY_TOKENS));
    if decide {
        body.insert(
            "tools".into(),
            json!([{"type": "function", "function": {
                "name": SEARCH_TOOL,
                "description": "Search the web for current information the conversation needs. \
                                Call it only when the answer depends on facts you may not know \
                                or that may have changed.",
                "parameters": {"type": "object", "properties": {
                    "query": {"type": "string", "description": "The search query"}},
                    "required": ["query"]}}}]),
        );
        body.insert("tool_choice".into(), json!("auto"));
    } else if let Some(Value::Array(messages)) = body.get_mut("messages") {
        messages.push(json!({"role": "user", "content":
            "Write the web search query that would best help answer the conversation above. \
             Reply with the query only, on one line."}));
    }
    let request = rialto_router::Chat {
        request_id: format!("{}-query", chat.request_id),
        model_id: chat.model_id.clone(),
        body,
        parameters: chat.parameters.clone(),
    };
    let answer = match gateway.services.router.chat(request).await {
        Ok(answer) => answer,
        Err(error) => {
            return Asked {
                query: Err(format!(
                    "the model could not write a search query ({error})"
                )),
                cost_nanos: 0,
                tokens: 0,
            };
        }
    };
    let reply: Value = serde_json::from_slice(&answer.body_json).unwrap_or_default();
    let message = &reply["choices"][0]["message"];
    // A backend that reports no usage is charged the estimate: the
    // prompt's, and four characters a token of what it wrote.
    let calls = &message["tool_calls"];
    let written = message["content"].as_str().map_or(0, str::len)
        + if calls.is_array() {
            calls.to_string().len()
        } else {
            0
        };
    let usage = rialto_proto::billing::v1::Usage {
        prompt_tokens: reply["usage"]["prompt_tokens"]
            .as_u64()
            .unwrap_or(prompt_estimate),
        completion_tokens: reply["usage"]["completion_tokens"]
            .as_u64()
            .unwrap_or((written as u64).div_ceil(4)),
        ..Default::default()
    };
    let cost = model.prices.cost(&usage);
    let cost_nanos = rialto_billing::to_nanos(cost)
        .ok()
        .and_then(|n| u64::try_from(n).ok())
        .unwrap_or(0);
    let query = if decide {
        message["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|call| call["function"]["name"] == SEARCH_TOOL)
            .and_then(|call| call["function"]["arguments"].as_str())
            .and_then(|arguments| serde_json::from_str::<Value>(arguments).ok())
            .and_then(|arguments| arguments["query"].as_str().map(str::to_owned))
    } else {
        message["content"].as_str().map(|text| {
            text.lines()
                .find(|line| !line.trim().is_empty())
                .unwrap_or_default()
                .trim()
                .trim_matches('"')
                .to_owned()
        })
    };
    let query = query
        .map(|q| q.chars().take(MAX_QUERY_CHARS).collect::<String>())
        .filter(|q| !q.trim().is_empty());
    Asked {
        query: match query {
            None if !decide => Err("the model wrote no search query".to_owned()),
            query => Ok(query),
        },
        cost_nanos,
        tokens: usage.prompt_tokens.saturating_add(usage.completion_tokens),
    }
}

/// The system message of numbered sources.
fn sources_prompt(plan: &Plan, outcome: &Outcome) -> String {
    use std::fmt::Write as _;
    let today = chrono::Utc::now().format("%Y-%m-%d");
    let mut block = if outcome.scraped > 0 {
        format!(
            "The user linked these web pages; their content follows (today is {today}). \
             Use it to answer.\n"
        )
    } else {
        format!(
            "Web search results for the user's question follow as numbered sources (today \
             is {today}). Use them where they help, and prefer them to what you remember \
             when they disagree.\n"
        )
    };
    if plan.citations {
        block.push_str(
            "Cite the sources you use right after the statement they support, with the \
             marker [REF]n[/REF] where n is the source's number, e.g. [REF]1[/REF].\n",
        );
    }
    for (n, source) in outcome.sources.iter().enumerate() {
        let _ = write!(
            block,
            "\n[{}] {}\nURL: {}\n",
            n + 1,
            source.title,
            source.url
        );
        if let Some(date) = &source.date {
            let _ = writeln!(block, "Published: {date}");
        }
        let _ = writeln!(block, "{}", source.content);
    }
    block
}

/// The echo's `web_search_citations` (when sources were looked for), in
/// the order the prompt numbered them.
pub(crate) fn echo(parameters: &mut Echo, plan: &Plan, outcome: &Outcome) {
    if outcome.error.is_some() {
        parameters.web_search = SearchMode::Off;
    }
    if plan.search != SearchMode::Off || outcome.looked {
        parameters.web_search_citations =
            Some(outcome.sources.iter().map(Source::citation).collect());
    }
    parameters.web_scraping = outcome.scraped > 0;
}

/// The synthetic tool call carrying the sources as documents, when asked
/// for and there are some.
pub(crate) fn documents_call(plan: &Plan, outcome: &Outcome) -> Option<Value> {
    if !plan.documents || outcome.sources.is_empty() {
        return None;
    }
    let documents: Vec<Value> = outcome
        .sources
        .iter()
        .enumerate()
        .map(|(n, source)| {
            json!({"id": (n + 1).to_string(), "title": source.title, "url": source.url,
                   "snippet": source.content, "published_at": source.date})
        })
        .collect();
    Some(json!({
        "id": DOCUMENTS_CALL_ID,
        "type": "function",
        "function": {
            "name": SEARCH_TOOL,
            "arguments": json!({"documents": documents}).to_string(),
        },
    }))
}

/// Puts the documents call first in each choice's tool calls (a choice
/// that stopped finishes with `tool_calls`).
pub(crate) fn add_documents(body: &mut Map<String, Value>, call: &Value) {
    let Some(Value::Array(choices)) = body.get_mut("choices") else {
        return;
    };
    for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
        if let Some(Value::Object(message)) = choice.get_mut("message") {
            let calls = message
                .entry("tool_calls")
                .or_insert_with(|| Value::Array(Vec::new()));
            if !calls.is_array() {
                *calls = Value::Array(Vec::new());
            }
            if let Value::Array(calls) = calls {
                calls.insert(0, call.clone());
            }
        }
        if choice.get("finish_reason").is_some_and(|r| r == "stop") {
            choice.insert("finish_reason".into(), json!("tool_calls"));
        }
    }
}

// ---------------------------------------------------------------------
// The augment endpoints.

/// Runs an augment call's `work` metered: a slot in the caller's window
/// of the endpoint, a hold of `price_nanos`, then the price charged as
/// `augment/<name>` when the work succeeds (with `X-Balance-Remaining` for a
/// wallet) or the hold released when it fails.
async fn metered<T>(
    gateway: &Gateway,
    request: &HttpRequest,
    principal: &auth_pb::Principal,
    name: &str,
    price_nanos: u64,
    work: impl std::future::Future<Output = Result<T, ApiError>>,
) -> Result<(T, actix_web::HttpResponseBuilder), ApiError> {
    let window = format!("api/v1/augment/{name}");
    let model_id = format!("{}{name}", rialto_billing::AUGMENT_PREFIX);
    let work = async { work.await.map(|done| (done, price_nanos)) };
    metered_by_use(
        gateway,
        request,
        principal,
        &window,
        &model_id,
        price_nanos,
        work,
    )
    .await
}

/// A request priced in USD rather than tokens: admitted in the endpoint's
/// window (`api/v1/...`), holding `most_nanos`; `work` answers what it did
/// and what that cost (at most `most_nanos`), which is charged under
/// `model_id` (a flat-priced id of billing's). A failed `work` releases the
/// hold and charges nothing.
pub(crate) async fn metered_by_use<T>(
    gateway: &Gateway,
    request: &HttpRequest,
    principal: &auth_pb::Principal,
    window: &str,
    model_id: &str,
    most_nanos: u64,
    work: impl std::future::Future<Output = Result<(T, u64), ApiError>>,
) -> Result<(T, actix_web::HttpResponseBuilder), ApiError> {
    let window = format!("endpoint:{window}");
    let request_id = RequestId::of(request);
    let Admitted {
        mut settlement,
        wallet_usd_before,
    } = admit(
        gateway,
        request,
        principal,
        Priced {
            target: rialto_limiter::Target::endpoint(&window),
            model_id,
            prices: rialto_billing::Prices::FREE,
            model: None,
        },
        &request_id,
        Reservation {
            prompt_tokens: 0,
            total_tokens: 0,
            durable: false,
            extra_usd_nanos: most_nanos,
            limiter_extra_tokens: 0,
            charged_after: false,
        },
        None,
    )
    .await?;
    let (done, used_nanos) = match work.await {
        Ok(done) => done,
        Err(error) => {
            settlement.release();
            return Err(error);
        }
    };
    settlement.extra_usd_nanos = used_nanos.min(most_nanos);
    let cost = settlement.bill(&Usage::none()).await?;
    let mut response = HttpResponse::Ok();
    balance_remaining(&mut response, wallet_usd_before, &cost);
    Ok((done, response))
}

/// A 400 whose details name one member (`[]`: the body as a whole).
pub(crate) fn invalid_at(path: &[&str], why: impl Into<String>) -> ApiError {
    let mut details = Details::new();
    details.push(path, why);
    ApiError::validation(details)
}

/// The string member `field` of a request body; its absence or another
/// type goes in `details`.
pub(crate) fn string_member<'a>(
    body: &'a Map<String, Value>,
    field: &str,
    details: &mut Details,
) -> Option<&'a str> {
    match body.get(field) {
        Some(Value::String(text)) => Some(text),
        Some(_) => {
            details.push(&[field], "Expected string");
            None
        }
        None => {
            details.push(&[field], "Required");
            None
        }
    }
}

/// The JSON object of a request body, or a 400.
pub(crate) async fn object_body(
    gateway: &Gateway,
    request: &HttpRequest,
    payload: web::Payload,
) -> Result<Map<String, Value>, ApiError> {
    let body = read_body(gateway, request, payload).await?;
    match parse_json(&body)? {
        Value::Object(object) => Ok(object),
        _ => Err(invalid_at(&[], "Expected a JSON object")),
    }
}

/// `POST /augment/search`: `{query, limit?, search_provider?}` ->
/// `{query, results: [{title, url, content, date}]}`.
pub async fn search(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let body = object_body(&gateway, &request, payload).await?;
    let mut details = Details::new();
    let query = string_member(&body, "query", &mut details).map_or("", str::trim);
    if query.is_empty() && body.get("query").is_some_and(Value::is_string)
        || query.chars().count() > MAX_QUERY_CHARS
    {
        details.push(&["query"], "String must contain 1 to 400 character(s)");
    }
    let limit = match body.get("limit") {
        None | Some(Value::Null) => 10,
        Some(value) => match value.as_u64() {
            Some(n @ 1..=20) => n as usize,
            _ => {
                details.push(&["limit"], "Expected an integer from 1 to 20");
                10
            }
        },
    };
    // One provider serves every search; the hosted API's choice of two
    // is accepted as a preference this server has no second to honour.
    if let Some(provider) = body.get("search_provider").filter(|v| !v.is_null())
        && !matches!(provider.as_str(), Some("google" | "brave"))
    {
        details.push(
            &["search_provider"],
            "Invalid enum value. Expected 'google' | 'brave'",
        );
    }
    details.into_result()?;
    let Some(provider) = &gateway.web_search else {
        return Err(ApiError::new(
            ErrorCode::InvalidRequest,
            "Web search is not configured on this server: its operator sets [web_search] \
             provider (searxng or brave)",
        ));
    };
    let searching = async {
        provider.search(query, limit).await.map_err(|why| {
            ApiError::new(
                ErrorCode::UpstreamFailed,
                format!("The search failed: {why}"),
            )
        })
    };
    let price = provider.price_nanos;
    let (results, mut response) =
        metered(&gateway, &request, &principal, "search", price, searching).await?;
    let results: Vec<Value> = results
        .into_iter()
        .map(|r| {
            json!({"title": r.title, "url": r.url, "content": r.content,
                   "date": r.date.unwrap_or_default()})
        })
        .collect();
    Ok(response.json(json!({"query": query, "results": results})))
}

/// `POST /augment/scrape`: `{url}` -> `{url, content, format: "markdown"}`.
pub async fn scrape(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let body = object_body(&gateway, &request, payload).await?;
    let mut details = Details::new();
    let url = string_member(&body, "url", &mut details).unwrap_or_default();
    let web_url = reqwest::Url::parse(url).is_ok_and(|u| matches!(u.scheme(), "http" | "https"));
    if body.get("url").is_some_and(Value::is_string) && !web_url {
        details.push(&["url"], "Invalid url: expected an http(s) URL");
    }
    details.into_result()?;
    let scraping = async {
        let page = gateway.scraper.scrape(url, &gateway.converter).await;
        page.map_err(|why| invalid_at(&["url"], format!("The page could not be scraped: {why}")))
    };
    let price = gateway.scraper.price_nanos;
    let (page, mut response) =
        metered(&gateway, &request, &principal, "scrape", price, scraping).await?;
    let content = if page.title == page.url {
        page.markdown
    } else {
        format!("# {}\n\n{}", page.title, page.markdown)
    };
    Ok(response.json(json!({"url": page.url, "content": content, "format": "markdown"})))
}

/// `POST /augment/text-parser`: a multipart `file` (and `response_format`:
/// `json`, the default, or `text`) -> `{text, tokens}` or the text alone.
pub async fn text_parser(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let (name, media_type, bytes, format) = read_file_form(&request, payload).await?;
    let parsing = async {
        let text = gateway.converter.to_text(&name, &media_type, bytes).await;
        text.map_err(|why| invalid_at(&["file"], why))
    };
    let price = gateway.text_parser_price_nanos;
    let (text, mut response) = metered(
        &gateway,
        &request,
        &principal,
        "text-parser",
        price,
        parsing,
    )
    .await?;
    if format == "text" {
        return Ok(response
            .content_type("text/plain; charset=utf-8")
            .body(text));
    }
    // Four characters a token, as holds count text.
    let tokens = (text.chars().count() as u64).div_ceil(4);
    Ok(response.json(json!({"text": text, "tokens": tokens})))
}

/// The `file` part (name, media type, bytes, at most the file limit) and
/// `response_format` of a text-parser form; other fields are ignored, as
/// unknown JSON members are.
async fn read_file_form(
    request: &HttpRequest,
    payload: web::Payload,
) -> Result<(String, String, Vec<u8>, String), ApiError> {
    let parts =
        crate::forms::read(request, payload, &["file"], crate::files::MAX_FILE_BYTES).await?;
    let mut file = None;
    let mut format = "json".to_owned();
    for part in parts {
        match part.name.as_str() {
            "file" => {
                let filename = part
                    .filename
                    .filter(|n| !n.is_empty())
                    .unwrap_or_else(|| "file".to_owned());
                file = Some((filename, part.media_type.unwrap_or_default(), part.bytes));
            }
            "response_format" => {
                format = part.text();
                if !matches!(format.as_str(), "json" | "text") {
                    return Err(invalid_at(
                        &["response_format"],
                        "Invalid enum value. Expected 'json' | 'text'",
                    ));
                }
            }
            _ => {}
        }
    }
    let (name, media_type, bytes) = file.ok_or_else(|| invalid_at(&["file"], "Required"))?;
    Ok((name, media_type, bytes, format))
}
