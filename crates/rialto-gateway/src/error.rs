//! The one place where errors become HTTP responses in the spec's shape:
//! `{"error": "..."}`, plus `details` for validation errors.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use rialto_core::{Error, ErrorCode};
use serde_json::{Map, Value, json};

/// An error on its way to the caller.
#[derive(Debug)]
pub struct ApiError {
    error: Error,
    details: Option<Details>,
    /// Rare: boxed so that the common error stays small.
    extra: Option<Box<Extra>>,
}

/// What an x402 or sign-in answer adds to an error.
#[derive(Debug, Default)]
struct Extra {
    /// A body of another shape, replacing `{error}`.
    body: Option<Value>,
    /// A status other than the code's (the x402 answers' 409, 504, ...).
    status: Option<StatusCode>,
    /// Extra headers (`PAYMENT-REQUIRED`, ...).
    headers: Vec<(String, String)>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Error::new(code, message).into()
    }

    /// A 400 "Invalid request parameters" with per-field messages.
    pub fn validation(details: Details) -> Self {
        Self {
            details: Some(details),
            ..Error::invalid("Invalid request parameters").into()
        }
    }

    /// An error answered with `body` as is (the x402 and sign-in shapes).
    pub fn with_body(code: ErrorCode, message: impl Into<String>, body: Value) -> Self {
        let mut error: Self = Error::new(code, message).into();
        error.extra_mut().body = Some(body);
        error
    }

    /// Answers with `status` instead of the code's.
    pub fn with_status(mut self, status: u16) -> Self {
        self.extra_mut().status = StatusCode::from_u16(status).ok();
        self
    }

    /// Adds a response header.
    pub fn with_header(mut self, name: impl Into<String>, value: String) -> Self {
        self.extra_mut().headers.push((name.into(), value));
        self
    }

    fn extra_mut(&mut self) -> &mut Extra {
        self.extra.get_or_insert_with(Box::default)
    }

    pub fn code(&self) -> ErrorCode {
        self.error.code
    }

    pub fn message(&self) -> &str {
        &self.error.message
    }

    /// Each validation message as `field: message` (just the message for
    /// the body as a whole), for a reader rather than a program.
    pub fn detail_lines(&self) -> Vec<String> {
        fn walk(path: &mut Vec<String>, node: &Map<String, Value>, lines: &mut Vec<String>) {
            for (key, value) in node {
                match (key.as_str(), value) {
                    ("_errors", Value::Array(errors)) => {
                        for error in errors.iter().filter_map(Value::as_str) {
                            lines.push(if path.is_empty() {
                                error.to_owned()
                            } else {
                                format!("{}: {error}", path.join("."))
                            });
                        }
                    }
                    (_, Value::Object(child)) => {
                        path.push(key.clone());
                        walk(path, child, lines);
                        path.pop();
                    }
                    _ => {}
                }
            }
        }
        let mut lines = Vec::new();
        if let Some(details) = &self.details {
            walk(&mut Vec::new(), &details.0, &mut lines);
        }
        lines
    }
}

impl From<Error> for ApiError {
    fn from(error: Error) -> Self {
        Self {
            error,
            details: None,
            extra: None,
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

/// The hosted API's message of a failed inference (its 500).
pub const INFERENCE_FAILED: &str = "Inference processing failed";

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.extra
            .as_ref()
            .and_then(|extra| extra.status)
            .unwrap_or_else(|| {
                StatusCode::from_u16(self.error.http_status())
                    .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
            })
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status_code());
        if let Some(extra) = &self.extra {
            for (name, value) in &extra.headers {
                response.insert_header((name.as_str(), value.as_str()));
            }
            if let Some(body) = &extra.body {
                return response.json(body);
            }
        }
        let mut body = Map::new();
        let message = match self.error.code {
            // The spec's words first, then what failed.
            ErrorCode::UpstreamFailed if !self.error.message.starts_with(INFERENCE_FAILED) => {
                format!("{INFERENCE_FAILED}: {}", self.error.message)
            }
            _ => self.error.message.clone(),
        };
        body.insert("error".into(), Value::String(message));
        if let Some(details) = &self.details {
            body.insert("details".into(), Value::Object(details.tree()));
        }
        if self.error.code == ErrorCode::PayloadTooLarge {
            body.insert("code".into(), json!("PAYLOAD_TOO_LARGE"));
        }
        response.json(Value::Object(body))
    }
}

/// Per-field validation messages in the nested shape of the hosted API:
/// `{"_errors": [], "messages": {"_errors": [], "0": {"content": {"_errors": ["..."]}}}}`.
#[derive(Debug, Clone)]
pub struct Details(Map<String, Value>);

impl Default for Details {
    fn default() -> Self {
        Self::new()
    }
}

impl Details {
    /// No messages. The tree is made at the first message: most requests
    /// validate without one, and a map with its `_errors` member made and
    /// dropped on each cost them ~500 instructions.
    pub fn new() -> Self {
        Self(Map::new())
    }

    /// Adds `message` at `path` (field names, and indices as strings); an
    /// empty path is the request as a whole.
    pub fn push(&mut self, path: &[&str], message: impl Into<String>) {
        if self.0.is_empty() {
            self.0 = node();
        }
        let mut current = &mut self.0;
        for segment in path {
            let child = current
                .entry((*segment).to_owned())
                .or_insert_with(|| Value::Object(node()));
            if !child.is_object() {
                *child = Value::Object(node());
            }
            let Value::Object(child) = child else { return };
            current = child;
        }
        if let Some(Value::Array(errors)) = current.get_mut("_errors") {
            errors.push(Value::String(message.into()));
        }
    }

    pub fn is_empty(&self) -> bool {
        fn empty(node: &Map<String, Value>) -> bool {
            node.iter().all(|(key, value)| match (key.as_str(), value) {
                ("_errors", Value::Array(errors)) => errors.is_empty(),
                (_, Value::Object(child)) => empty(child),
                _ => true,
            })
        }
        empty(&self.0)
    }

    /// The messages in the hosted API's nested shape (`{"_errors": []}`
    /// when there are none).
    fn tree(&self) -> Map<String, Value> {
        if self.0.is_empty() {
            node()
        } else {
            self.0.clone()
        }
    }

    /// Ok when nothing was pushed, the validation error otherwise.
    pub fn into_result(self) -> Result<(), ApiError> {
        if self.is_empty() {
            Ok(())
        } else {
            Err(ApiError::validation(self))
        }
    }
}

fn node() -> Map<String, Value> {
    let mut node = Map::new();
    node.insert("_errors".into(), Value::Array(Vec::new()));
    node
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn details_nest_like_the_hosted_api() {
        let mut details = Details::new();
        assert!(details.is_empty());
        assert_eq!(details.tree(), node());
        details.push(&["model"], "Required");
        details.push(&["messages", "0", "content", "1", "text"], "too short");
        assert!(!details.is_empty());
        let value = Value::Object(details.0);
        assert_eq!(value["_errors"], json!([]));
        assert_eq!(value["model"]["_errors"], json!(["Required"]));
        assert_eq!(
            value["messages"]["0"]["content"]["1"]["text"]["_errors"],
            json!(["too short"])
        );
    }

    #[test]
    fn errors_render_in_the_spec_shape() {
        let response =
            ApiError::new(ErrorCode::ApiKeyNotFound, "API key could not be found").error_response();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    }
}
