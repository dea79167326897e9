//! `GET /api/v1/models`: the model catalog in the hosted API's list shape.

use actix_web::{HttpResponse, web};
use rialto_core::ModelConfig;
use rialto_core::config::price_decimal;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{ApiError, Details, Gateway};

/// Values of `?type=` the hosted API accepts.
const TYPES: &[&str] = &[
    "asr",
    "embedding",
    "image",
    "music",
    "text",
    "tts",
    "upscale",
    "inpaint",
    "video",
    "all",
    "code",
];

#[derive(Deserialize)]
pub struct Query {
    #[serde(rename = "type")]
    model_type: Option<String>,
}

pub async fn list(
    gateway: web::Data<Gateway>,
    query: web::Query<Query>,
) -> Result<HttpResponse, ApiError> {
    let wanted = query.model_type.as_deref().unwrap_or("text");
    if !TYPES.contains(&wanted) {
        let mut details = Details::new();
        details.push(
            &["type"],
            format!(
                "Invalid enum value. Expected {}, received '{wanted}'",
                TYPES.join(" | ")
            ),
        );
        return Err(ApiError::validation(details));
    }
    let data: Vec<Value> = gateway
        .models
        .iter()
        .map(|entry| &entry.config)
        .filter(|m| match wanted {
            "all" => true,
            // No model declares itself optimized for code yet.
            "code" => false,
            other => m.model_type == other,
        })
        .map(|m| model_json(m, &gateway.brand.name))
        .collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "type": wanted, "data": data})))
}

fn price(usd: f64) -> Value {
    // Exact decimal on the wire; DIEM is priced 1:1 with USD.
    let value: Value = serde_json::from_str(&price_decimal(usd).to_string()).unwrap_or(json!(usd));
    json!({"usd": value, "diem": value})
}

fn model_json(model: &ModelConfig, brand: &str) -> Value {
    let mut pricing = json!({
        "input": price(model.input_usd_per_mtok),
        "output": price(model.output_usd_per_mtok),
    });
    if let Some(cached) = model.cached_input_usd_per_mtok {
        pricing["cache_input"] = price(cached);
    }
    if let Some(write) = model.cache_write_usd_per_mtok {
        pricing["cache_write"] = price(write);
    }
    let mut spec = json!({
        "name": model.display_name(),
        "privacy": "private",
        "offline": model.backends.is_empty(),
        "beta": false,
        "pricing": pricing,
        "traits": [],
    });
    if let Some(description) = &model.description {
        spec["description"] = json!(description);
    }
    if let Some(context) = model.context_length {
        spec["availableContextTokens"] = json!(context);
    }
    if let Some(max) = model.max_completion_tokens {
        spec["maxCompletionTokens"] = json!(max);
    }
    if let Some(date) = &model.deprecation_date {
        spec["deprecation"] = json!({"date": date});
    }
    let mut entry = json!({
        "id": model.id,
        "object": "model",
        "created": 0,
        "owned_by": brand,
        "type": model.model_type,
        "model_spec": spec,
    });
    if let Some(context) = model.context_length {
        entry["context_length"] = json!(context);
    }
    entry
}
