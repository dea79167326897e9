//! `POST /responses`: OpenAI's Responses API, served from chat backends by
//! translation.
//!
//! A request becomes a chat request (`instructions` a system message,
//! `input` messages, `function_call` and `function_call_output` items
//! assistant tool calls and tool messages, function `tools`, `text.format` as
//! `response_format`, `max_output_tokens`), which goes down the chat path
//! whole: the same admission, hold, settlement, service parameters
//! (`<brand>_parameters` passes through) and headers. Its answer comes back
//! as a `response` object (`output` items, `usage`, `cost`), or, streamed,
//! as the Responses event types (`response.created` ...
//! `response.output_text.delta` ... `response.completed`).
//!
//! With `store` (the default) the response is kept 30 days by billing,
//! under the caller's ledger owner, with the conversation it continued:
//! `previous_response_id` continues it (its instructions do not carry
//! over, as in OpenAI's API), and another account's id is not found.

use std::convert::Infallible;
use std::pin::Pin;

use actix_web::body::MessageBody;
use actix_web::{HttpRequest, HttpResponse, web};
use bytes::Bytes;
use rialto_core::ErrorCode;
use rialto_proto::billing::v1 as billing_pb;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::headers::RequestId;
use crate::{ApiError, Details, Gateway, authenticate, parse_json, read_body};

/// Members this translation reads. Those after `user` are accepted and
/// have no effect here (or, `prompt_cache_key`, pass to the chat request).
/// Any other member goes to the chat request as it is, as a chat request's
/// unknown fields go to the backend (`<brand>_parameters` among them).
const MEMBERS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stream",
    "store",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "metadata",
    "user",
    "reasoning",
    "include",
    "prompt_cache_key",
    "safety_identifier",
    "service_tier",
    "truncation",
    "stream_options",
    "background",
];

/// What the response echoes of its request.
#[derive(Debug, Clone, Default)]
struct Echo {
    model: String,
    instructions: Value,
    previous_response_id: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: Value,
    store: bool,
    max_output_tokens: Value,
    temperature: Value,
    top_p: Value,
    text: Value,
    metadata: Value,
    user: Value,
}

/// A request translated: the chat body, and the conversation to store.
struct Translated {
    chat: Map<String, Value>,
    /// The chat messages after the instructions: what a later response
    /// continues.
    conversation: Vec<Value>,
    echo: Echo,
    stream: bool,
}

/// `POST /responses`.
pub async fn create(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let body = parse_json(&read_body(&gateway, &request, payload).await?)?;
    let Value::Object(body) = body else {
        return Err(crate::augment::invalid_at(&[], "Expected a JSON object"));
    };
    let owner = crate::ledger_owner(&principal);
    let translated = translate(&gateway, &owner, &body).await?;
    let id = format!("resp_{}", RequestId::of(&request));
    let answer = crate::chat::serve(
        &gateway,
        &request,
        &principal,
        Value::Object(translated.chat),
    )
    .await?;
    if !answer.status().is_success() {
        return Ok(answer);
    }
    let context = Context {
        id,
        owner,
        created_at: chrono::Utc::now().timestamp(),
        echo: translated.echo,
        conversation: translated.conversation,
        billing: gateway.services.billing.clone(),
    };
    if translated.stream {
        Ok(relay(answer, context))
    } else {
        complete(answer, context).await
    }
}

/// What building and storing the response needs.
struct Context {
    id: String,
    owner: String,
    created_at: i64,
    echo: Echo,
    conversation: Vec<Value>,
    billing: rialto_billing::BillingClient,
}

/// The request's members as a chat request, with the stored conversation of
/// `previous_response_id` first.
async fn translate(
    gateway: &Gateway,
    owner: &str,
    body: &Map<String, Value>,
) -> Result<Translated, ApiError> {
    let mut details = Details::new();
    let model = match body.get("model") {
        Some(Value::String(model)) if !model.is_empty() => model.clone(),
        _ => {
            details.push(&["model"], "Required");
            String::new()
        }
    };
    if body
        .get("background")
        .is_some_and(|b| b != &Value::Bool(false))
    {
        details.push(
            &["background"],
            "Background responses are not supported: leave it false",
        );
    }
    let instructions = match body.get("instructions") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(text.clone()),
        Some(_) => {
            details.push(&["instructions"], "Expected string");
            None
        }
    };
    let input = match body.get("input") {
        Some(Value::String(text)) => vec![json!({"role": "user", "content": text})],
        Some(Value::Array(items)) => input_messages(items, &mut details),
        None if body.contains_key("previous_response_id") => Vec::new(),
        None => {
            details.push(&["input"], "Required");
            Vec::new()
        }
        Some(_) => {
            details.push(&["input"], "Expected a string or an array of input items");
            Vec::new()
        }
    };
    let tools = match body.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(tools)) => Some(chat_tools(tools, &mut details)),
        Some(_) => {
            details.push(&["tools"], "Expected an array");
            None
        }
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => *stream,
        Some(_) => {
            details.push(&["stream"], "Expected boolean");
            false
        }
    };
    let store = match body.get("store") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(store)) => *store,
        Some(_) => {
            details.push(&["store"], "Expected boolean");
            true
        }
    };
    let format = body
        .get("text")
        .and_then(|t| t.get("format"))
        .and_then(|f| response_format(f, &mut details));
    let previous = match body.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => Some(id.clone()),
        Some(_) => {
            details.push(&["previous_response_id"], "Expected string");
            None
        }
    };
    details.into_result()?;

    let mut conversation = match &previous {
        Some(id) => stored_conversation(gateway, owner, id).await?,
        None => Vec::new(),
    };
    conversation.extend(input);
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Some(instructions) = &instructions {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    messages.extend(conversation.iter().cloned());

    let mut chat = Map::new();
    chat.insert("model".into(), json!(model));
    chat.insert("messages".into(), Value::Array(messages));
    chat.insert("stream".into(), json!(stream));
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        chat.insert("tools".into(), Value::Array(tools));
    }
    if let Some(choice) = body.get("tool_choice").filter(|c| !c.is_null()) {
        chat.insert("tool_choice".into(), chat_tool_choice(choice));
    }
    if let Some(format) = format {
        chat.insert("response_format".into(), format);
    }
    let pass = [
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("user", "user"),
        ("prompt_cache_key", "prompt_cache_key"),
    ];
    for (from, to) in pass {
        if let Some(value) = body.get(from).filter(|v| !v.is_null()) {
            chat.insert(to.into(), value.clone());
        }
    }
    if let Some(effort) = body
        .get("reasoning")
        .and_then(|r| r.get("effort"))
        .filter(|e| e.is_string())
    {
        chat.insert("reasoning_effort".into(), effort.clone());
    }
    for (name, value) in body {
        if !MEMBERS.contains(&name.as_str()) && !chat.contains_key(name) {
            chat.insert(name.clone(), value.clone());
        }
    }
    if stream {
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    let echo = Echo {
        model,
        instructions: instructions.map_or(Value::Null, Value::String),
        previous_response_id: previous.map_or(Value::Null, Value::String),
        tools: body.get("tools").cloned().unwrap_or_else(|| json!([])),
        tool_choice: body
            .get("tool_choice")
            .cloned()
            .filter(|c| !c.is_null())
            .unwrap_or_else(|| json!("auto")),
        parallel_tool_calls: body
            .get("parallel_tool_calls")
            .cloned()
            .unwrap_or(Value::Bool(true)),
        store,
        max_output_tokens: body
            .get("max_output_tokens")
            .cloned()
            .unwrap_or(Value::Null),
        temperature: body.get("temperature").cloned().unwrap_or(Value::Null),
        top_p: body.get("top_p").cloned().unwrap_or(Value::Null),
        text: body
            .get("text")
            .cloned()
            .unwrap_or_else(|| json!({"format": {"type": "text"}})),
        metadata: body.get("metadata").cloned().unwrap_or_else(|| json!({})),
        user: body.get("user").cloned().unwrap_or(Value::Null),
    };
    Ok(Translated {
        chat,
        conversation,
        echo,
        stream,
    })
}

/// The conversation a stored response continued, and its output, as chat
/// messages.
async fn stored_conversation(
    gateway: &Gateway,
    owner: &str,
    id: &str,
) -> Result<Vec<Value>, ApiError> {
    let stored = gateway
        .services
        .billing
        .get_response(billing_pb::GetResponseRequest {
            id: id.to_owned(),
            owner: owner.to_owned(),
        })
        .await;
    let stored = match stored {
        Ok(stored) => stored,
        Err(error) if error.code == ErrorCode::NotFound => {
            return Err(crate::augment::invalid_at(
                &["previous_response_id"],
                format!("Previous response with id '{id}' not found."),
            ));
        }
        Err(error) => return Err(error.into()),
    };
    let body: Value = serde_json::from_str(&stored.body)
        .map_err(|e| rialto_core::Error::internal(format_args!("a stored response: {e}")))?;
    let mut messages: Vec<Value> = body["conversation"].as_array().cloned().unwrap_or_default();
    messages.extend(output_messages(&body["output"]));
    Ok(messages)
}

/// A response's output items as the chat messages that said them.
fn output_messages(output: &Value) -> Vec<Value> {
    let mut text = String::new();
    let mut calls = Vec::new();
    for item in output.as_array().into_iter().flatten() {
        match item["type"].as_str() {
            Some("message") => {
                for part in item["content"].as_array().into_iter().flatten() {
                    if let Some(t) = part["text"].as_str() {
                        text.push_str(t);
                    }
                }
            }
            Some("function_call") => calls.push(json!({
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            })),
            _ => {}
        }
    }
    let mut message = json!({"role": "assistant", "content": if text.is_empty() && !calls.is_empty() { Value::Null } else { Value::String(text) }});
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    vec![message]
}

/// Input items as chat messages: messages (easy or typed), function calls
/// (consecutive ones make one assistant message) and their outputs.
fn input_messages(items: &[Value], details: &mut Details) -> Vec<Value> {
    let mut messages: Vec<Value> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let index = i.to_string();
        let Some(object) = item.as_object() else {
            details.push(&["input", &index], "Expected an input item object");
            continue;
        };
        let kind = object
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        match kind {
            "message" => {
                let role = match object.get("role").and_then(Value::as_str) {
                    Some(role @ ("user" | "assistant" | "system")) => role,
                    Some("developer") => "system",
                    _ => {
                        details.push(
                            &["input", &index, "role"],
                            "Expected 'user' | 'assistant' | 'system' | 'developer'",
                        );
                        continue;
                    }
                };
                let content = match object.get("content") {
                    Some(Value::String(text)) => Value::String(text.clone()),
                    Some(Value::Array(parts)) => match content_parts(parts, role == "assistant") {
                        Ok(content) => content,
                        Err(why) => {
                            details.push(&["input", &index, "content"], why);
                            continue;
                        }
                    },
                    _ => {
                        details.push(
                            &["input", &index, "content"],
                            "Expected a string or an array of content parts",
                        );
                        continue;
                    }
                };
                messages.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let (Some(call_id), Some(name), Some(arguments)) = (
                    object.get("call_id").and_then(Value::as_str),
                    object.get("name").and_then(Value::as_str),
                    object.get("arguments").and_then(Value::as_str),
                ) else {
                    details.push(
                        &["input", &index],
                        "A function_call item has string call_id, name and arguments",
                    );
                    continue;
                };
                let call = json!({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}});
                // Calls of one turn belong to one assistant message.
                let last = messages.last_mut().filter(|m| {
                    m["role"] == "assistant" && m["tool_calls"].is_array() && m["content"].is_null()
                });
                match last {
                    Some(message) => {
                        if let Some(calls) = message["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    None => messages
                        .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let Some(call_id) = object.get("call_id").and_then(Value::as_str) else {
                    details.push(&["input", &index, "call_id"], "Required");
                    continue;
                };
                let output = match object.get("output") {
                    Some(Value::String(text)) => text.clone(),
                    Some(other) => other.to_string(),
                    None => String::new(),
                };
                messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            // What a model thought is not sent back.
            "reasoning" => {}
            other => details.push(
                &["input", &index, "type"],
                format!(
                    "Input items of type '{other}' are not supported: use messages, \
                     function_call and function_call_output"
                ),
            ),
        }
    }
    messages
}

/// Responses content parts as chat content: an assistant's text joined, a
/// user's parts as chat parts.
fn content_parts(parts: &[Value], assistant: bool) -> Result<Value, String> {
    if assistant {
        let mut text = String::new();
        for part in parts {
            match part["type"].as_str() {
                Some("output_text" | "input_text" | "text") => {
                    text.push_str(part["text"].as_str().unwrap_or_default());
                }
                Some("refusal") => text.push_str(part["refusal"].as_str().unwrap_or_default()),
                _ => return Err("An assistant's content is output_text parts".to_owned()),
            }
        }
        return Ok(Value::String(text));
    }
    let mut chat = Vec::with_capacity(parts.len());
    for part in parts {
        let converted = match part["type"].as_str() {
            Some("input_text" | "output_text" | "text") => {
                json!({"type": "text", "text": part["text"].as_str().unwrap_or_default()})
            }
            Some("input_image") => {
                let Some(url) = part["image_url"].as_str() else {
                    return Err("An input_image needs image_url (a URL or a data: URL)".to_owned());
                };
                let mut image = json!({"url": url});
                if let Some(detail) = part.get("detail").filter(|d| d.is_string()) {
                    image["detail"] = detail.clone();
                }
                json!({"type": "image_url", "image_url": image})
            }
            Some("input_file") => {
                let mut file = Map::new();
                for key in ["file_data", "filename", "file_url"] {
                    if let Some(value) = part.get(key).filter(|v| v.is_string()) {
                        file.insert(key.to_owned(), value.clone());
                    }
                }
                json!({"type": "file", "file": file})
            }
            other => {
                return Err(format!(
                    "Content parts of type {} are not supported: input_text, input_image, \
                     input_file",
                    other.unwrap_or("(none)")
                ));
            }
        };
        chat.push(converted);
    }
    Ok(Value::Array(chat))
}

/// Responses tools as chat tools: functions, and web search as the
/// service's own (`enable_web_search` is the caller's to set: a
/// `web_search` tool is refused with that advice).
fn chat_tools(tools: &[Value], details: &mut Details) -> Vec<Value> {
    let mut chat = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let index = i.to_string();
        match tool["type"].as_str() {
            Some("function") => {
                let Some(name) = tool["name"].as_str() else {
                    details.push(&["tools", &index, "name"], "Required");
                    continue;
                };
                let mut function = json!({"name": name});
                for key in ["description", "parameters", "strict"] {
                    if let Some(value) = tool.get(key).filter(|v| !v.is_null()) {
                        function[key] = value.clone();
                    }
                }
                chat.push(json!({"type": "function", "function": function}));
            }
            other => details.push(
                &["tools", &index, "type"],
                format!(
                    "Tools of type {} are not supported here: function tools only (web \
                     search is the service parameter enable_web_search)",
                    other.unwrap_or("(none)")
                ),
            ),
        }
    }
    chat
}

fn chat_tool_choice(choice: &Value) -> Value {
    match choice {
        Value::Object(object) if object.get("type") == Some(&json!("function")) => {
            json!({"type": "function", "function": {"name": object.get("name").cloned().unwrap_or(Value::Null)}})
        }
        other => other.clone(),
    }
}

/// `text.format` as a chat `response_format`.
fn response_format(format: &Value, details: &mut Details) -> Option<Value> {
    match format["type"].as_str() {
        Some("text") | None => None,
        Some("json_object") => Some(json!({"type": "json_object"})),
        Some("json_schema") => {
            let mut schema = json!({
                "name": format.get("name").cloned().unwrap_or_else(|| json!("response")),
                "schema": format.get("schema").cloned().unwrap_or_else(|| json!({})),
            });
            if let Some(strict) = format.get("strict").filter(|s| s.is_boolean()) {
                schema["strict"] = strict.clone();
            }
            Some(json!({"type": "json_schema", "json_schema": schema}))
        }
        Some(other) => {
            details.push(
                &["text", "format", "type"],
                format!("Expected 'text' | 'json_object' | 'json_schema', received '{other}'"),
            );
            None
        }
    }
}

/// The Responses `usage` of a chat `usage`.
fn usage_of(usage: &Value) -> Value {
    let input = usage["prompt_tokens"].as_u64().unwrap_or(0);
    let output = usage["completion_tokens"].as_u64().unwrap_or(0);
    json!({
        "input_tokens": input,
        "input_tokens_details": {
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": usage["completion_tokens_details"]["reasoning_tokens"]
                .as_u64()
                .unwrap_or(0),
        },
        "total_tokens": usage["total_tokens"].as_u64().unwrap_or(input + output),
    })
}

impl Context {
    fn message_id(&self) -> String {
        format!("msg_{}", self.id.trim_start_matches("resp_"))
    }

    fn call_id(&self, index: usize) -> String {
        format!("fc_{}_{index}", self.id.trim_start_matches("resp_"))
    }

    /// The `response` object.
    fn response(
        &self,
        status: &str,
        output: Vec<Value>,
        finish: Option<&str>,
        usage: Value,
        cost: Value,
    ) -> Value {
        let incomplete = match finish {
            Some("length") => json!({"reason": "max_output_tokens"}),
            Some("content_filter") => json!({"reason": "content_filter"}),
            _ => Value::Null,
        };
        let status = if status == "completed" && !incomplete.is_null() {
            "incomplete"
        } else {
            status
        };
        let echo = &self.echo;
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": incomplete,
            "instructions": echo.instructions,
            "max_output_tokens": echo.max_output_tokens,
            "model": echo.model,
            "output": output,
            "parallel_tool_calls": echo.parallel_tool_calls,
            "previous_response_id": echo.previous_response_id,
            "reasoning": {"effort": null, "summary": null},
            "store": echo.store,
            "temperature": echo.temperature,
            "text": echo.text,
            "tool_choice": echo.tool_choice,
            "tools": echo.tools,
            "top_p": echo.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": echo.user,
            "metadata": echo.metadata,
            "cost": cost,
        })
    }

    /// Keeps the response for `previous_response_id` (when `store`); a
    /// failure costs the caller only the continuation, and is logged.
    async fn store(&self, output: &[Value]) {
        if !self.echo.store {
            return;
        }
        let body = json!({"conversation": self.conversation, "output": output});
        let stored = self
            .billing
            .put_response(billing_pb::StoredResponse {
                id: self.id.clone(),
                owner: self.owner.clone(),
                body: body.to_string(),
                created_at_ms: 0,
            })
            .await;
        if let Err(error) = stored {
            tracing::warn!(%error, response = self.id, "a response could not be stored");
        }
    }
}

/// The output items of a chat completion's first choice.
fn output_items(context: &Context, message: &Value) -> Vec<Value> {
    let mut output = Vec::new();
    if let Some(text) = message["content"].as_str().filter(|t| !t.is_empty()) {
        output.push(json!({
            "type": "message",
            "id": context.message_id(),
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }));
    }
    for (i, call) in message["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        output.push(json!({
            "type": "function_call",
            "id": context.call_id(i),
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }));
    }
    output
}

/// A non-streamed chat answer as a `response`, its headers kept.
async fn complete(answer: HttpResponse, context: Context) -> Result<HttpResponse, ApiError> {
    let (head, body) = answer.into_parts();
    let bytes = actix_web::body::to_bytes(body)
        .await
        .map_err(|_| rialto_core::Error::internal("the chat answer could not be read"))?;
    let chat: Value = serde_json::from_slice(&bytes).map_err(|_| crate::chat::invalid_answer())?;
    let choice = &chat["choices"][0];
    let output = output_items(&context, &choice["message"]);
    let response = context.response(
        "completed",
        output.clone(),
        choice["finish_reason"].as_str(),
        usage_of(&chat["usage"]),
        chat["cost"].clone(),
    );
    context.store(&output).await;
    let body = serde_json::to_vec(&response).unwrap_or_default();
    Ok(head.set_body(body).map_into_boxed_body())
}

/// One Responses stream event.
fn event(kind: &str, sequence: &mut u64, mut data: Value) -> Bytes {
    data["type"] = json!(kind);
    data["sequence_number"] = json!(*sequence);
    *sequence += 1;
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

/// What a stream has produced so far.
#[derive(Default)]
struct Produced {
    text: String,
    /// The message item's output index, once its first text arrived.
    message_index: Option<usize>,
    /// Function calls by the chat's tool-call index: (output index, call
    /// id, name, arguments).
    calls: Vec<(usize, usize, String, String, String)>,
    next_index: usize,
    finish: Option<String>,
    usage: Value,
    cost: Value,
    error: Option<Value>,
}

/// A streamed chat answer as Responses events, its headers kept.
fn relay(answer: HttpResponse, context: Context) -> HttpResponse {
    let (head, body) = answer.into_parts();
    let (sender, receiver) = mpsc::channel::<Bytes>(64);
    // On this worker's own thread: the chat body is not `Send`.
    actix_web::rt::spawn(translate_stream(body, sender, context));
    let events = futures_util::stream::unfold(receiver, |mut receiver| async move {
        receiver
            .recv()
            .await
            .map(|bytes| (Ok::<_, Infallible>(bytes), receiver))
    });
    let mut response = head.set_body(actix_web::body::BodyStream::new(events));
    response.headers_mut().insert(
        actix_web::http::header::CONTENT_TYPE,
        actix_web::http::header::HeaderValue::from_static("text/event-stream"),
    );
    response.map_into_boxed_body()
}

/// Reads the chat SSE stream and sends its events as Responses events. The
/// client leaving (the channel closed) drops the chat stream, which then
/// ends and bills as any chat stream a client leaves.
async fn translate_stream(
    body: actix_web::body::BoxBody,
    sender: mpsc::Sender<Bytes>,
    context: Context,
) {
    let mut body = Box::pin(body);
    let mut sequence = 0u64;
    let mut produced = Produced::default();
    let skeleton = context.response("in_progress", Vec::new(), None, Value::Null, Value::Null);
    for kind in ["response.created", "response.in_progress"] {
        if sender
            .send(event(kind, &mut sequence, json!({"response": skeleton})))
            .await
            .is_err()
        {
            return;
        }
    }
    let mut pending = Vec::new();
    loop {
        let chunk = std::future::poll_fn(|cx| Pin::new(&mut body).poll_next(cx)).await;
        let Some(Ok(chunk)) = chunk else { break };
        pending.extend_from_slice(&chunk);
        // Whole SSE events only: `data: ...` up to a blank line.
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let frame: Vec<u8> = pending.drain(..end + 2).collect();
            let Some(data) = std::str::from_utf8(&frame)
                .ok()
                .and_then(|f| f.trim().strip_prefix("data: "))
                .map(str::to_owned)
            else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let Ok(chunk) = serde_json::from_str::<Value>(&data) else {
                continue;
            };
            for bytes in on_chunk(&context, &mut produced, &mut sequence, &chunk) {
                if sender.send(bytes).await.is_err() {
                    return;
                }
            }
        }
    }
    for bytes in finish(&context, &mut produced, &mut sequence).await {
        if sender.send(bytes).await.is_err() {
            return;
        }
    }
}

/// The events one chat chunk makes.
fn on_chunk(
    context: &Context,
    produced: &mut Produced,
    sequence: &mut u64,
    chunk: &Value,
) -> Vec<Bytes> {
    let mut events = Vec::new();
    if let Some(error) = chunk.get("error") {
        produced.error = Some(error.clone());
        return events;
    }
    if chunk.get("usage").is_some_and(|u| !u.is_null()) {
        produced.usage = usage_of(&chunk["usage"]);
    }
    if let Some(cost) = chunk.get("cost") {
        produced.cost = cost.clone();
    }
    let choice = &chunk["choices"][0];
    if let Some(finish) = choice["finish_reason"].as_str() {
        produced.finish = Some(finish.to_owned());
    }
    let delta = &choice["delta"];
    if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
        let item_id = context.message_id();
        let index = match produced.message_index {
            Some(index) => index,
            None => {
                let index = produced.next_index;
                produced.next_index += 1;
                produced.message_index = Some(index);
                events.push(event(
                    "response.output_item.added",
                    sequence,
                    json!({"output_index": index, "item": {"type": "message", "id": item_id,
                        "status": "in_progress", "role": "assistant", "content": []}}),
                ));
                events.push(event(
                    "response.content_part.added",
                    sequence,
                    json!({"item_id": item_id, "output_index": index, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}}),
                ));
                index
            }
        };
        produced.text.push_str(text);
        events.push(event(
            "response.output_text.delta",
            sequence,
            json!({"item_id": item_id, "output_index": index, "content_index": 0,
                "delta": text, "logprobs": []}),
        ));
    }
    for call in delta["tool_calls"].as_array().into_iter().flatten() {
        let chat_index = call["index"].as_u64().unwrap_or(0) as usize;
        let position = produced.calls.iter().position(|c| c.0 == chat_index);
        let position = match position {
            Some(position) => position,
            None => {
                let output_index = produced.next_index;
                produced.next_index += 1;
                let call_id = call["id"].as_str().unwrap_or_default().to_owned();
                let name = call["function"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                events.push(event(
                    "response.output_item.added",
                    sequence,
                    json!({"output_index": output_index, "item": {"type": "function_call",
                        "id": context.call_id(produced.calls.len()), "call_id": call_id,
                        "name": name, "arguments": "", "status": "in_progress"}}),
                ));
                produced
                    .calls
                    .push((chat_index, output_index, call_id, name, String::new()));
                produced.calls.len() - 1
            }
        };
        if let Some(arguments) = call["function"]["arguments"]
            .as_str()
            .filter(|a| !a.is_empty())
        {
            produced.calls[position].4.push_str(arguments);
            events.push(event(
                "response.function_call_arguments.delta",
                sequence,
                json!({"item_id": context.call_id(position), "output_index": produced.calls[position].1,
                    "delta": arguments}),
            ));
        }
    }
    events
}

/// The closing events: each item done, then `response.completed` (or
/// `error` and `response.failed`), after the response is stored.
async fn finish(context: &Context, produced: &mut Produced, sequence: &mut u64) -> Vec<Bytes> {
    let mut events = Vec::new();
    let mut output: Vec<(usize, Value)> = Vec::new();
    if let Some(index) = produced.message_index {
        let item_id = context.message_id();
        let part = json!({"type": "output_text", "text": produced.text, "annotations": []});
        events.push(event(
            "response.output_text.done",
            sequence,
            json!({"item_id": item_id, "output_index": index, "content_index": 0,
                "text": produced.text, "logprobs": []}),
        ));
        events.push(event(
            "response.content_part.done",
            sequence,
            json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": part}),
        ));
        let item = json!({"type": "message", "id": item_id, "status": "completed",
            "role": "assistant", "content": [part]});
        events.push(event(
            "response.output_item.done",
            sequence,
            json!({"output_index": index, "item": item}),
        ));
        output.push((index, item));
    }
    for (position, (_, index, call_id, name, arguments)) in produced.calls.iter().enumerate() {
        let item_id = context.call_id(position);
        events.push(event(
            "response.function_call_arguments.done",
            sequence,
            json!({"item_id": item_id, "output_index": index, "arguments": arguments}),
        ));
        let item = json!({"type": "function_call", "id": item_id, "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"});
        events.push(event(
            "response.output_item.done",
            sequence,
            json!({"output_index": index, "item": item}),
        ));
        output.push((*index, item));
    }
    output.sort_by_key(|(index, _)| *index);
    let output: Vec<Value> = output.into_iter().map(|(_, item)| item).collect();
    if let Some(error) = produced.error.take() {
        events.push(event(
            "error",
            sequence,
            json!({"code": error["code"], "message": error["message"], "param": null}),
        ));
        let mut failed = context.response(
            "failed",
            output,
            None,
            produced.usage.clone(),
            produced.cost.clone(),
        );
        failed["error"] = json!({"code": "server_error", "message": error["message"]});
        events.push(event(
            "response.failed",
            sequence,
            json!({"response": failed}),
        ));
        return events;
    }
    context.store(&output).await;
    let response = context.response(
        "completed",
        output,
        produced.finish.as_deref(),
        std::mem::take(&mut produced.usage),
        std::mem::take(&mut produced.cost),
    );
    events.push(event(
        "response.completed",
        sequence,
        json!({"response": response}),
    ));
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_items_become_chat_messages() {
        let mut details = Details::new();
        let items = json!([
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is in "},
                {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "low"}]},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        ]);
        let messages = input_messages(items.as_array().unwrap(), &mut details);
        assert!(details.into_result().is_ok());
        assert_eq!(
            messages[0],
            json!({"role": "system", "content": "Be brief."})
        );
        assert_eq!(
            messages[1]["content"][1]["image_url"]["url"],
            "https://example.com/a.png"
        );
        assert_eq!(
            messages[2]["tool_calls"].as_array().unwrap().len(),
            2,
            "one turn"
        );
        assert_eq!(
            messages[3],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
        );
        assert_eq!(
            messages[4],
            json!({"role": "assistant", "content": "Sunny."})
        );
    }

    #[test]
    fn unsupported_items_and_tools_are_named() {
        let mut details = Details::new();
        input_messages(
            &[json!({"type": "item_reference", "id": "x"}), json!(3)],
            &mut details,
        );
        chat_tools(&[json!({"type": "file_search"})], &mut details);
        let error = details.into_result().unwrap_err();
        let text = format!("{:?}", error);
        assert!(
            text.contains("item_reference") && text.contains("file_search"),
            "{text}"
        );
    }

    #[test]
    fn stored_output_continues_as_an_assistant_message() {
        let output = json!([
            {"type": "message", "content": [{"type": "output_text", "text": "Hi"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        ]);
        let messages = output_messages(&output);
        assert_eq!(messages[0]["content"], "Hi");
        assert_eq!(messages[0]["tool_calls"][0]["id"], "c");
    }
}
