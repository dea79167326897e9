//! Validation of a chat request's body and its service parameters
//! (`<brand>_parameters`, model suffixes), with the prompt estimate the
//! limiter and the hold count.

use rialto_core::ErrorCode;
use rialto_proto::router::v1 as router_pb;
use serde_json::{Map, Value};

use super::Chat;
use super::echo::Echo;
use crate::augment::SearchMode;
use crate::{ApiError, Details, Gateway};

/// Most choices one request may ask for.
const MAX_N: u64 = 16;

const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Splits `<model>:<param>=<value>&...` into the model and its service
/// parameters (form-encoded; `true` and `false` are booleans). A name with
/// a colon and no `=` after it (`org/model:latest`) is a model name whole.
fn split_model_suffix(model: &str) -> (&str, Map<String, Value>) {
    let mut suffix = Map::new();
    match model.split_once(':') {
        Some((id, settings)) if settings.contains('=') && !id.is_empty() => {
            for (key, value) in form_urlencoded::parse(settings.as_bytes()) {
                let value = match value.as_ref() {
                    "true" => Value::Bool(true),
                    "false" => Value::Bool(false),
                    text => Value::String(text.to_owned()),
                };
                suffix.insert(key.into_owned(), value);
            }
            (id, suffix)
        }
        _ => (model, suffix),
    }
}

/// Checks the members the spec lists, takes `<brand>_parameters` out of the
/// body (the upstream does not know it), and leaves every other member
/// untouched for the upstream.
pub(super) fn validate(
    gateway: &Gateway,
    catalog: &crate::Catalog,
    body: &mut Value,
) -> Result<Chat, ApiError> {
    let mut details = Details::new();
    let Some(object) = body.as_object_mut() else {
        details.push(&[], "Expected a JSON object");
        return Err(ApiError::validation(details));
    };
    // `<model>:<param>=<value>&...`: the suffix sets service parameters and
    // wins over the body's.
    let mut suffix = Map::new();
    let model_id = match object.get("model") {
        Some(Value::String(model)) if !model.is_empty() => {
            let (id, settings) = split_model_suffix(model);
            suffix = settings;
            id.to_owned()
        }
        Some(Value::String(_)) => {
            details.push(&["model"], "String must contain at least 1 character(s)");
            String::new()
        }
        Some(_) => {
            details.push(&["model"], "Expected string");
            String::new()
        }
        None => {
            details.push(&["model"], "Required");
            String::new()
        }
    };
    let mut prompt_chars = 0usize;
    // An unknown model is a 404 later; its inputs are not judged.
    let capabilities = catalog
        .model(&model_id)
        .map(|m| m.config.capabilities.as_slice());
    match object.get("messages") {
        Some(Value::Array(messages)) if messages.is_empty() => {
            details.push(&["messages"], "Array must contain at least 1 element(s)");
        }
        Some(Value::Array(messages)) => {
            for (i, message) in messages.iter().enumerate() {
                prompt_chars += validate_message(
                    &mut details,
                    &i.to_string(),
                    message,
                    &model_id,
                    capabilities,
                );
            }
        }
        Some(_) => details.push(&["messages"], "Expected array"),
        None => details.push(&["messages"], "Required"),
    }
    let stream = match object.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => *stream,
        Some(_) => {
            details.push(&["stream"], "Expected boolean");
            false
        }
    };
    let n = match object.get("n") {
        None | Some(Value::Null) => 1,
        Some(value) => match value.as_u64() {
            Some(n) if (1..=MAX_N).contains(&n) => n,
            _ => {
                details.push(&["n"], format!("Expected an integer from 1 to {MAX_N}"));
                1
            }
        },
    };
    let mut max_tokens = None;
    for field in ["max_tokens", "max_completion_tokens"] {
        match object.get(field) {
            None | Some(Value::Null) => {}
            Some(value) => match value.as_u64() {
                Some(v) if v >= 1 => max_tokens = Some(max_tokens.map_or(v, |m: u64| m.min(v))),
                _ => details.push(&[field], "Expected a positive integer"),
            },
        }
    }
    check_stop(&mut details, object.get("stop"));
    if object
        .get("prompt_cache_key")
        .is_some_and(|v| !v.is_string() && !v.is_null())
    {
        details.push(&["prompt_cache_key"], "Expected string");
    }
    let logprobs = match object.get("logprobs") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(on)) => *on,
        Some(_) => {
            details.push(&["logprobs"], "Expected boolean");
            false
        }
    };
    match object.get("top_logprobs") {
        None | Some(Value::Null) => {}
        Some(value) => match value.as_u64() {
            Some(n) if n <= 20 && logprobs => {}
            Some(n) if n <= 20 => details.push(
                &["top_logprobs"],
                "top_logprobs requires logprobs to be true",
            ),
            _ => details.push(&["top_logprobs"], "Expected an integer from 0 to 20"),
        },
    }
    // Backends without prompt caching would refuse `cache_control`: drop it.
    if capabilities.is_some_and(|caps| !caps.iter().any(|c| c == "caching"))
        && let Some(Value::Array(messages)) = object.get_mut("messages")
    {
        for message in messages.iter_mut() {
            if let Some(Value::Array(parts)) = message.get_mut("content") {
                for part in parts.iter_mut().filter_map(Value::as_object_mut) {
                    part.remove("cache_control");
                }
            }
        }
    }
    // `enable_x_search` is not a suffix key (the hosted API's rule).
    suffix.remove("enable_x_search");
    let mut requested = object.remove(&gateway.brand.parameters_field);
    if !suffix.is_empty() {
        match &mut requested {
            Some(Value::Object(map)) => map.extend(suffix),
            // A malformed body member is still reported as such.
            Some(other) if !other.is_null() => {}
            _ => requested = Some(Value::Object(suffix)),
        }
    }
    let x_search = requested
        .as_ref()
        .and_then(|r| r.get("enable_x_search"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let (parameters, character_prompt) = effective_parameters(gateway, requested, &mut details)?;
    details.into_result()?;
    let service = router_pb::ServiceParameters {
        strip_thinking: parameters.strip_thinking_response,
        disable_thinking: parameters.disable_thinking,
        include_system_prompt: parameters.include_system_prompt,
        character_prompt,
    };

    let model = catalog.model(&model_id);
    let completion_budget = max_tokens
        .or_else(|| model.and_then(|m| m.config.max_completion_tokens))
        .unwrap_or(gateway.services.limiter.policy().default_completion_tokens);
    if max_tokens.is_none() {
        // The hold covers this many: the backend must not write more.
        object.insert("max_tokens".into(), Value::from(completion_budget));
    }
    // Everything else the model reads: tools and schemas, tool calls,
    // media, and the system prompts the router puts first.
    prompt_chars = prompt_chars
        .saturating_add(other_prompt_chars(object))
        .saturating_add(service.character_prompt.len());
    if service.include_system_prompt {
        let system_prompt = model
            .and_then(|m| m.config.system_prompt.as_ref())
            .map_or(gateway.system_prompt_chars, String::len);
        prompt_chars = prompt_chars.saturating_add(system_prompt);
    }
    let prompt_tokens_estimate = (prompt_chars as u64).div_ceil(4).max(1);
    Ok(Chat {
        model_id,
        stream,
        parameters,
        service,
        prompt_tokens_estimate,
        estimated_tokens: prompt_tokens_estimate
            .saturating_add(completion_budget.saturating_mul(n)),
        x_search,
        choices: n,
    })
}

/// What one image is counted as in a hold, in characters (four a token):
/// 1,600 tokens, above what the common vision encoders make of a
/// high-detail image.
const IMAGE_CHARS: usize = 1_600 * 4;

/// Characters of what reaches the model besides the messages' text: the
/// JSON of `tools`, `functions`, `response_format` and `tool_choice` and
/// of tool calls (as a chat template writes them), each image at
/// [`IMAGE_CHARS`], and audio and video parts at the length of their data.
fn other_prompt_chars(object: &Map<String, Value>) -> usize {
    let mut chars = ["tools", "functions", "response_format", "tool_choice"]
        .iter()
        .filter_map(|field| object.get(*field))
        .map(json_len)
        .fold(0usize, usize::saturating_add);
    let Some(Value::Array(messages)) = object.get("messages") else {
        return chars;
    };
    for message in messages {
        if let Some(calls) = message.get("tool_calls") {
            chars = chars.saturating_add(json_len(calls));
        }
        let Some(Value::Array(parts)) = message.get("content") else {
            continue;
        };
        for part in parts {
            chars = chars.saturating_add(match part.get("type").and_then(Value::as_str) {
                Some("image_url") => IMAGE_CHARS,
                Some("input_audio" | "video_url") => json_len(part),
                _ => 0,
            });
        }
    }
    chars
}

/// The length of a value's JSON, written nowhere.
fn json_len(value: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 = self.0.saturating_add(bytes.len());
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// Content part types beyond text, and the capability each needs.
const MEDIA_PARTS: [(&str, &str, &str); 4] = [
    ("image_url", "vision", "image"),
    ("input_audio", "audio", "audio"),
    ("video_url", "video", "video"),
    ("file", "files", "file"),
];

/// Validates one message; returns the characters of text it carries.
/// `capabilities` are the model's (None: the model is unknown).
/// The most stop sequences a request may give (the hosted API's bound).
const MAX_STOPS: usize = 4;

/// The longest stop sequence, in bytes: a backend searches each of them
/// in the text generated so far, on every token.
const MAX_STOP_BYTES: usize = 256;

/// `stop`: a string or up to four, none empty or longer than 256 bytes.
fn check_stop(details: &mut Details, stop: Option<&Value>) {
    let stops: Vec<&Value> = match stop {
        None | Some(Value::Null) => return,
        Some(Value::String(_)) => vec![stop.unwrap_or(&Value::Null)],
        Some(Value::Array(stops)) if (1..=MAX_STOPS).contains(&stops.len()) => {
            stops.iter().collect()
        }
        Some(Value::Array(_)) => {
            details.push(
                &["stop"],
                format!("Expected 1 to {MAX_STOPS} stop sequences"),
            );
            return;
        }
        Some(_) => {
            details.push(&["stop"], "Expected a string or an array of strings");
            return;
        }
    };
    for stop in stops {
        match stop.as_str() {
            Some(text) if !text.is_empty() && text.len() <= MAX_STOP_BYTES => {}
            _ => {
                details.push(
                    &["stop"],
                    format!("Each stop sequence must be a string of 1 to {MAX_STOP_BYTES} bytes"),
                );
                return;
            }
        }
    }
}

fn validate_message(
    details: &mut Details,
    index: &str,
    message: &Value,
    model_id: &str,
    capabilities: Option<&[String]>,
) -> usize {
    let Some(message) = message.as_object() else {
        details.push(&["messages", index], "Expected object");
        return 0;
    };
    let role = message.get("role").and_then(Value::as_str);
    match role {
        Some(role) if ROLES.contains(&role) => {}
        Some(other) => details.push(
            &["messages", index, "role"],
            format!(
                "Invalid enum value. Expected {}, received '{other}'",
                ROLES.join(" | ")
            ),
        ),
        None => details.push(&["messages", index, "role"], "Required"),
    }
    if role == Some("tool") {
        match message.get("tool_call_id") {
            Some(Value::String(id)) if !id.is_empty() => {}
            Some(Value::String(_)) => details.push(
                &["messages", index, "tool_call_id"],
                "String must contain at least 1 character(s)",
            ),
            Some(_) => details.push(&["messages", index, "tool_call_id"], "Expected string"),
            None => details.push(&["messages", index, "tool_call_id"], "Required"),
        }
    }
    let mut has_tool_calls = false;
    match message.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(Value::Array(calls)) => {
            has_tool_calls = !calls.is_empty();
            for (c, call) in calls.iter().enumerate() {
                let c = c.to_string();
                let text = |field: &str| call.pointer(field).and_then(Value::as_str).is_some();
                if !text("/id") {
                    details.push(
                        &["messages", index, "tool_calls", &c, "id"],
                        "Required string",
                    );
                }
                if call.get("type").and_then(Value::as_str) != Some("function") {
                    details.push(
                        &["messages", index, "tool_calls", &c, "type"],
                        "Invalid literal value, expected \"function\"",
                    );
                }
                if !text("/function/name") || !text("/function/arguments") {
                    details.push(
                        &["messages", index, "tool_calls", &c, "function"],
                        "Expected an object with string name and arguments",
                    );
                }
            }
        }
        Some(_) => details.push(&["messages", index, "tool_calls"], "Expected array"),
    }
    match message.get("content") {
        Some(Value::String(text)) => text.len(),
        Some(Value::Array(parts)) => {
            let mut chars = 0;
            for (p, part) in parts.iter().enumerate() {
                let p = p.to_string();
                let Some(part) = part.as_object() else {
                    details.push(&["messages", index, "content", &p], "Expected object");
                    continue;
                };
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => match part.get("text") {
                        Some(Value::String(text)) if !text.is_empty() => {
                            chars += text.len();
                            check_cache_control(details, index, &p, part.get("cache_control"));
                        }
                        Some(Value::String(_)) => details.push(
                            &["messages", index, "content", &p, "text"],
                            "String must contain at least 1 character(s)",
                        ),
                        Some(_) => details.push(
                            &["messages", index, "content", &p, "text"],
                            "Expected string",
                        ),
                        None => {
                            details.push(&["messages", index, "content", &p, "text"], "Required")
                        }
                    },
                    Some(kind) => match MEDIA_PARTS.iter().find(|(name, _, _)| *name == kind) {
                        Some((name, capability, noun)) => {
                            if !part.get(*name).is_some_and(Value::is_object) {
                                details.push(
                                    &["messages", index, "content", &p, name],
                                    "Required object",
                                );
                            } else if capabilities
                                .is_some_and(|caps| !caps.iter().any(|c| c == capability))
                            {
                                details.push(
                                    &["messages", index, "content", &p, "type"],
                                    format!("The model {model_id} does not accept {noun} input"),
                                );
                            }
                        }
                        None => details.push(
                            &["messages", index, "content", &p, "type"],
                            format!(
                                "Invalid enum value. Expected 'text' | 'image_url' | 'input_audio' | 'video_url' | 'file', received '{kind}'"
                            ),
                        ),
                    },
                    None => details.push(&["messages", index, "content", &p, "type"], "Required"),
                }
            }
            chars
        }
        // An assistant turn may carry only tool calls.
        Some(Value::Null) | None if role == Some("assistant") => {
            if !has_tool_calls {
                details.push(
                    &["messages", index, "content"],
                    "An assistant message must have content or tool_calls",
                );
            }
            0
        }
        Some(Value::Null) | None => {
            details.push(&["messages", index, "content"], "Required");
            0
        }
        Some(_) => {
            details.push(&["messages", index, "content"], "Expected string or array");
            0
        }
    }
}

/// `cache_control` on a text part: `{type: "ephemeral", ttl?: string}`.
fn check_cache_control(details: &mut Details, index: &str, part: &str, value: Option<&Value>) {
    let path = ["messages", index, "content", part, "cache_control"];
    match value {
        None | Some(Value::Null) => {}
        Some(Value::Object(control)) => {
            if control.get("type").and_then(Value::as_str) != Some("ephemeral") {
                details.push(
                    &[&path[..], &["type"]].concat(),
                    "Invalid literal value, expected \"ephemeral\"",
                );
            }
            if control
                .get("ttl")
                .is_some_and(|t| !t.is_string() && !t.is_null())
            {
                details.push(&[&path[..], &["ttl"]].concat(), "Expected string");
            }
        }
        Some(_) => details.push(&path, "Expected object"),
    }
}

/// The `<brand>_parameters` echo: every required member, as requested
/// (the router applies the system prompt and the thinking flags; the web
/// members are what `augment::plan` then corrects to what is effective).
/// End-to-end encryption is not offered: reported off. With it, the
/// system prompt of the character it names (empty for none).
fn effective_parameters(
    gateway: &Gateway,
    requested: Option<Value>,
    details: &mut Details,
) -> Result<(Echo, String), ApiError> {
    let field = gateway.brand.parameters_field.as_str();
    let include_prompt = gateway.brand.include_system_prompt_field.as_str();
    let requested = match requested {
        None | Some(Value::Null) => return Ok((Echo::default(), String::new())),
        Some(Value::Object(map)) => map,
        Some(_) => {
            details.push(&[field], "Expected object");
            return Ok((Echo::default(), String::new()));
        }
    };
    let booleans = [
        "strip_thinking_response",
        "disable_thinking",
        "enable_web_scraping",
        "enable_x_search",
        "enable_web_citations",
        "include_search_results_in_stream",
        "return_search_results_as_documents",
        "enable_e2ee",
        include_prompt,
    ];
    for name in booleans {
        if requested
            .get(name)
            .is_some_and(|v| !v.is_boolean() && !v.is_null())
        {
            details.push(&[field, name], "Expected boolean");
        }
    }
    let web_search = match requested.get("enable_web_search") {
        None | Some(Value::Null) => SearchMode::Off,
        Some(value) => match value.as_str() {
            Some("on") => SearchMode::On,
            Some("auto") => SearchMode::Auto,
            Some("off") => SearchMode::Off,
            _ => {
                details.push(
                    &[field, "enable_web_search"],
                    "Invalid enum value. Expected 'auto' | 'off' | 'on'",
                );
                SearchMode::Off
            }
        },
    };
    let mut character_slug = None;
    let mut character_prompt = String::new();
    if let Some(slug) = requested.get("character_slug").filter(|v| !v.is_null()) {
        match slug.as_str() {
            // Private characters are as unknown as missing ones.
            Some(slug) => match gateway.character(slug).filter(|c| c.public) {
                Some(found) => {
                    character_slug = Some(found.slug);
                    character_prompt = found.system_prompt;
                }
                None => {
                    return Err(ApiError::new(
                        ErrorCode::NotFound,
                        "No character could be found from the provided character_slug",
                    ));
                }
            },
            None => details.push(&[field, "character_slug"], "Expected string"),
        }
    }
    let flag = |name: &str| {
        requested
            .get(name)
            .and_then(Value::as_bool)
            .unwrap_or(false)
    };
    let echo = Echo {
        character_slug,
        web_search,
        web_citations: flag("enable_web_citations"),
        web_scraping: flag("enable_web_scraping"),
        include_system_prompt: requested
            .get(include_prompt)
            .and_then(Value::as_bool)
            .unwrap_or(true),
        search_results_in_stream: flag("include_search_results_in_stream"),
        search_results_as_documents: flag("return_search_results_as_documents"),
        strip_thinking_response: flag("strip_thinking_response"),
        disable_thinking: flag("disable_thinking"),
        web_search_citations: None,
    };
    Ok((echo, character_prompt))
}

/// What the model's own tokenizer counts in the request's text (message
/// text, tool-call arguments, `tools`, `response_format`) beyond the
/// four-characters-a-token guess the estimate already holds for it; never
/// less than nothing. On the blocking pool: a long prompt takes
/// milliseconds. A text the tokenizer refuses counts a token a byte.
pub(super) async fn tokenizer_excess(
    tokenizer: std::sync::Arc<tokenizers::Tokenizer>,
    body: &Value,
) -> u64 {
    let texts = prompt_texts(body);
    let guessed: u64 = texts.iter().map(|t| (t.len() as u64).div_ceil(4)).sum();
    let counted = tokio::task::spawn_blocking(move || {
        texts
            .iter()
            .map(|text| {
                tokenizer
                    .encode_fast(text.as_str(), false)
                    .map_or(text.len(), |encoding| encoding.len()) as u64
            })
            .sum::<u64>()
    })
    .await
    .unwrap_or(0);
    counted.saturating_sub(guessed)
}

/// The text of a chat body that a tokenizer can count.
fn prompt_texts(body: &Value) -> Vec<String> {
    let mut texts = Vec::new();
    for message in body["messages"].as_array().into_iter().flatten() {
        match &message["content"] {
            Value::String(text) => texts.push(text.clone()),
            Value::Array(parts) => texts.extend(
                parts
                    .iter()
                    .filter_map(|p| p["text"].as_str().map(str::to_owned)),
            ),
            _ => {}
        }
        for call in message["tool_calls"].as_array().into_iter().flatten() {
            if let Some(arguments) = call["function"]["arguments"].as_str() {
                texts.push(arguments.to_owned());
            }
        }
    }
    for member in ["tools", "response_format"] {
        if let Some(value) = body.get(member).filter(|v| !v.is_null()) {
            texts.push(value.to_string());
        }
    }
    texts
}

/// Properties of the model-suffix parser: any string is split without a
/// panic, and what a client encodes comes back.
#[cfg(test)]
mod properties {
    use super::split_model_suffix;
    use proptest::prelude::*;
    use serde_json::{Map, Value};

    proptest! {
        /// Any model string: a verdict, never a panic, and the model part
        /// is a prefix of the input.
        #[test]
        fn any_model_string_splits(model in any::<String>()) {
            let (id, _) = split_model_suffix(&model);
            prop_assert!(model.starts_with(id));
        }

        /// Parameters form-encoded after `:` come back exactly, booleans as
        /// booleans, and the model name without them.
        #[test]
        fn encoded_parameters_round_trip(
            id in "[a-zA-Z0-9._/-]{1,40}",
            parameters in proptest::collection::btree_map("[a-z_]{1,20}", any::<String>(), 1..6),
        ) {
            let mut encoder = form_urlencoded::Serializer::new(String::new());
            for (key, value) in &parameters {
                encoder.append_pair(key, value);
            }
            let model = format!("{id}:{}", encoder.finish());
            let (split, settings) = split_model_suffix(&model);
            prop_assert_eq!(split, id.as_str());
            let expected: Map<String, Value> = parameters
                .into_iter()
                .map(|(key, value)| {
                    let value = match value.as_str() {
                        "true" => Value::Bool(true),
                        "false" => Value::Bool(false),
                        _ => Value::String(value),
                    };
                    (key, value)
                })
                .collect();
            prop_assert_eq!(settings, expected);
        }

        /// A colon with no `=` after it is part of the model's name.
        #[test]
        fn a_tag_without_parameters_is_the_name(
            id in "[a-zA-Z0-9._/-]{1,40}",
            tag in "[a-zA-Z0-9._-]{0,20}",
        ) {
            let model = format!("{id}:{tag}");
            let (split, settings) = split_model_suffix(&model);
            prop_assert_eq!(split, model.as_str());
            prop_assert!(settings.is_empty());
        }
    }
}
