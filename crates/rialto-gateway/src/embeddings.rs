//! `POST /api/v1/embeddings`: OpenAI's request and response shapes, routed
//! over the model's backends like a chat, limited in the `embedding` class
//! and billed for its prompt tokens.

use actix_web::{HttpRequest, HttpResponse, web};
use rialto_core::ErrorCode;
use rialto_proto::router::v1 as router_pb;
use serde_json::{Value, json};

use crate::chat::{
    Admitted, Priced, Reservation, Usage, admit, balance_remaining, invalid_answer, model_headers,
};
use crate::headers::RequestId;
use crate::{ApiError, Details, Gateway, ModelEntry, authenticate, parse_json, read_body};

/// Most inputs one request may carry (OpenAI's and the hosted API's limit).
const MAX_INPUTS: usize = 2048;

pub async fn create(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let body = read_body(&gateway, &request, payload).await?;
    let mut body = parse_json(&body)?;
    let (model, prompt_estimate) = validate(&gateway, &mut body)?;
    let model = &*model;
    let request_id = RequestId::of(&request);
    let Admitted {
        mut settlement,
        wallet_usd_before,
    } = admit(
        &gateway,
        &request,
        &principal,
        Priced::model(model),
        &request_id,
        Reservation {
            prompt_tokens: prompt_estimate,
            total_tokens: prompt_estimate,
            durable: false,
            extra_usd_nanos: 0,
            limiter_extra_tokens: 0,
            charged_after: false,
        },
        None,
    )
    .await?;
    let routed = gateway
        .services
        .router
        .embed(router_pb::EmbedRequest {
            request_id,
            model_id: model.config.id.clone(),
            body_json: serde_json::to_vec(&body).map_err(rialto_core::Error::internal)?,
        })
        .await;
    let answer = match routed {
        Ok(answer) => answer,
        Err(error) => {
            settlement.release();
            return Err(error.into());
        }
    };
    let Some(mut data) = serde_json::from_slice::<Value>(&answer.body_json)
        .ok()
        .and_then(|mut answer| answer.get_mut("data").map(Value::take))
        .filter(Value::is_array)
    else {
        // The backend worked, but what it said cannot be passed on: the
        // estimate is billed, as for a chat answer that cannot be read.
        settlement.bill_later(&Usage::prompt_only(prompt_estimate));
        return Err(invalid_answer());
    };
    let reported = serde_json::from_slice::<Value>(&answer.body_json)
        .ok()
        .and_then(|answer| {
            answer
                .pointer("/usage/prompt_tokens")
                .and_then(Value::as_u64)
        });
    let usage = Usage::prompt_only(reported.unwrap_or(prompt_estimate));
    let cost = settlement.bill(&usage).await?;
    for item in data.as_array_mut().into_iter().flatten() {
        if let Some(item) = item.as_object_mut() {
            item.entry("object").or_insert_with(|| json!("embedding"));
        }
    }
    let mut response = HttpResponse::Ok();
    model_headers(
        &mut response,
        &gateway,
        model,
        &answer.backend,
        answer.retry_count,
    );
    balance_remaining(&mut response, wallet_usd_before, &cost);
    Ok(response.json(json!({
        "object": "list",
        "data": data,
        "model": model.config.id,
        "usage": usage.json(),
    })))
}

/// Checks the members OpenAI's `/embeddings` defines; returns the model
/// (an alias or trait resolved) and an estimate of the prompt tokens (four
/// characters a token). `user` is dropped: it is not passed on.
fn validate(
    gateway: &Gateway,
    body: &mut Value,
) -> Result<(std::sync::Arc<ModelEntry>, u64), ApiError> {
    let mut details = Details::new();
    let Some(object) = body.as_object_mut() else {
        details.push(&[], "Expected a JSON object");
        return Err(ApiError::validation(details));
    };
    object.remove("user");
    let model = match object.get("model") {
        Some(Value::String(id)) if !id.is_empty() => gateway.model(id),
        _ => {
            details.push(&["model"], "Required: the id of an embedding model");
            None
        }
    };
    let mut chars = 0usize;
    match object.get("input") {
        Some(Value::String(text)) if !text.is_empty() => chars = text.len(),
        Some(Value::Array(items))
            if !items.is_empty()
                && items.len() <= MAX_INPUTS
                && items
                    .iter()
                    .all(|i| i.as_str().is_some_and(|s| !s.is_empty())) =>
        {
            chars = items.iter().filter_map(Value::as_str).map(str::len).sum();
        }
        Some(Value::Array(items)) if items.len() > MAX_INPUTS => {
            details.push(
                &["input"],
                format!("At most {MAX_INPUTS} inputs per request"),
            );
        }
        _ => details.push(
            &["input"],
            "Expected a non-empty string or an array of non-empty strings",
        ),
    }
    match object.get("encoding_format") {
        None | Some(Value::Null) => {}
        Some(Value::String(format)) if format == "float" || format == "base64" => {}
        _ => details.push(&["encoding_format"], "Expected \"float\" or \"base64\""),
    }
    match object.get("dimensions") {
        None | Some(Value::Null) => {}
        Some(value) if value.as_u64().is_some_and(|d| d > 0) => {}
        _ => details.push(&["dimensions"], "Expected a positive integer"),
    }
    details.into_result()?;
    let Some(model) = model else {
        return Err(ApiError::new(
            ErrorCode::ModelNotFound,
            "Specified model not found",
        ));
    };
    if model.config.model_type != "embedding" {
        let mut details = Details::new();
        details.push(
            &["model"],
            format!("{} is not an embedding model", model.config.id),
        );
        return Err(ApiError::validation(details));
    }
    Ok((model, (chars as u64).div_ceil(4).max(1)))
}
