//! `GET /api/v1/models`: the model catalog in the hosted API's list shape.

use actix_web::{HttpResponse, web};
use rialto_core::ModelConfig;
use rialto_core::config::price_decimal;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{ApiError, Details, Gateway};

/// Values of `?type=` the hosted API accepts: the model types, `all` and
/// `code`.
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

/// `GET /models?type=`: public; a key presented whose `modelPrivacy` is
/// not ALL sees only the models it may use (one that does not
/// authenticate is as none: the list is public).
pub async fn list(
    gateway: web::Data<Gateway>,
    request: actix_web::HttpRequest,
    query: web::Query<Query>,
) -> Result<HttpResponse, ApiError> {
    let caller = match crate::bearer_token(request.headers()) {
        Some(_) => crate::authenticate_caller(&gateway, &request, false)
            .await
            .ok(),
        None => None,
    };
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
        .catalog()
        .models
        .iter()
        .map(|entry| &entry.config)
        .filter(|m| match wanted {
            "all" => true,
            // No model declares itself optimized for code yet.
            "code" => false,
            other => m.model_type == other,
        })
        .filter(|m| {
            caller
                .as_ref()
                .is_none_or(|caller| crate::keys::check_privacy(caller, m).is_ok())
        })
        .map(|m| {
            model_json(
                m,
                &gateway.brand.name,
                gateway.web_search.is_some(),
                built_at(&gateway.revision),
            )
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "type": wanted, "data": data})))
}

#[derive(Deserialize)]
pub struct TypeQuery {
    #[serde(rename = "type")]
    model_type: Option<String>,
}

/// The `?type=` of the trait and mapping routes (text by default).
fn wanted_type(query: &TypeQuery) -> Result<&str, ApiError> {
    let wanted = query.model_type.as_deref().unwrap_or("text");
    if TYPES.contains(&wanted) && wanted != "all" && wanted != "code" {
        return Ok(wanted);
    }
    let mut details = Details::new();
    details.push(
        &["type"],
        format!("Invalid enum value, received '{wanted}'"),
    );
    Err(ApiError::validation(details))
}

/// `GET /models/traits?type=`: each trait and the first model of the type
/// that has it.
pub async fn traits(
    gateway: web::Data<Gateway>,
    query: web::Query<TypeQuery>,
) -> Result<HttpResponse, ApiError> {
    let wanted = wanted_type(&query)?;
    let mut data = serde_json::Map::new();
    for model in gateway
        .catalog()
        .models
        .iter()
        .map(|e| &e.config)
        .filter(|m| m.model_type == wanted)
    {
        for trait_name in &model.traits {
            data.entry(trait_name.clone())
                .or_insert_with(|| json!(model.id));
        }
    }
    Ok(HttpResponse::Ok().json(json!({"object": "list", "type": wanted, "data": data})))
}

/// `GET /models/compatibility_mapping?type=`: each alias and its model.
pub async fn compatibility_mapping(
    gateway: web::Data<Gateway>,
    query: web::Query<TypeQuery>,
) -> Result<HttpResponse, ApiError> {
    let wanted = wanted_type(&query)?;
    let mut data = serde_json::Map::new();
    for model in gateway
        .catalog()
        .models
        .iter()
        .map(|e| &e.config)
        .filter(|m| m.model_type == wanted)
    {
        for alias in &model.aliases {
            data.entry(alias.clone()).or_insert_with(|| json!(model.id));
        }
    }
    Ok(HttpResponse::Ok().json(json!({"object": "list", "type": wanted, "data": data})))
}

fn price(usd: f64) -> Value {
    // Exact decimal on the wire; DIEM is priced 1:1 with USD.
    let value: Value = serde_json::from_str(&price_decimal(usd).to_string()).unwrap_or(json!(usd));
    json!({"usd": value, "diem": value})
}

/// Whether using the model costs anything (what `GET /characters?isPro=`
/// asks of a character's model: Rialto has no subscription tiers, so a
/// "pro" model is one that is paid for).
pub(crate) fn is_priced(model: &ModelConfig) -> bool {
    let flat = [
        model.input_usd_per_mtok,
        model.output_usd_per_mtok,
        model.usd_per_image,
        model.usd_per_thousand_characters,
        model.usd_per_audio_second,
        model.usd_per_video_second,
    ];
    flat.into_iter()
        .chain(model.usd_per_image_resolution.values().copied())
        .chain(model.usd_per_upscale.values().copied())
        .any(|usd| usd > 0.0)
}

/// A model's `pricing` in the hosted shape of its type.
fn pricing(model: &ModelConfig) -> Value {
    match model.model_type.as_str() {
        "image" if !model.usd_per_image_resolution.is_empty() => {
            json!({"resolutions": tier_prices(model)})
        }
        "image" => json!({"generation": price(model.usd_per_image)}),
        "inpaint" if !model.usd_per_image_resolution.is_empty() => {
            // The default tier's price (what an edit without `resolution`
            // costs), then each tier's.
            let first = model.usd_per_image_resolution.values().next().copied();
            json!({"inpaint": price(first.unwrap_or_default()), "resolutions": tier_prices(model)})
        }
        "inpaint" => json!({"inpaint": price(model.usd_per_image)}),
        // Per million characters, as the hosted API publishes it.
        "tts" => json!({"input": price_scaled(model.usd_per_thousand_characters, 1000)}),
        "asr" => json!({"per_audio_second": price(model.usd_per_audio_second)}),
        "video" => json!({"per_second": price(model.usd_per_video_second)}),
        "upscale" => {
            let tier = |name: &str| price(model.usd_per_upscale.get(name).copied().unwrap_or(0.0));
            json!({"upscale": {"2x": tier("2x"), "4x": tier("4x")}})
        }
        _ => {
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
            pricing
        }
    }
}

/// An image model's price of each resolution tier.
fn tier_prices(model: &ModelConfig) -> serde_json::Map<String, Value> {
    model
        .usd_per_image_resolution
        .iter()
        .map(|(tier, usd)| (tier.clone(), price(*usd)))
        .collect()
}

/// `usd` times `factor`, exactly.
fn price_scaled(usd: f64, factor: u32) -> Value {
    let scaled = price_decimal(usd) * rust_decimal::Decimal::from(factor);
    let value: Value = serde_json::from_str(&scaled.normalize().to_string()).unwrap_or(json!(0));
    json!({"usd": value, "diem": value})
}

/// The build's time (Unix seconds) from its revision, `<yyyymmdd>.<hhmmss>`:
/// what `created` says of a model that does not say when it was added.
fn built_at(revision: &str) -> i64 {
    chrono::NaiveDateTime::parse_from_str(revision, "%Y%m%d.%H%M%S")
        .map(|t| t.and_utc().timestamp())
        .unwrap_or(0)
}

/// A model's `/models` entry; `web_search`: whether a search provider is
/// configured (a model advertises search only with one).
fn model_json(model: &ModelConfig, brand: &str, web_search: bool, built: i64) -> Value {
    let pricing = pricing(model);
    let mut spec = json!({
        "name": model.display_name(),
        "privacy": model.privacy,
        "offline": model.backends.is_empty(),
        "beta": false,
        "pricing": pricing,
        "traits": model.traits,
    });
    if model.model_type == "text" {
        let has = |name: &str| model.capabilities.iter().any(|c| c == name);
        spec["capabilities"] = json!({
            "optimizedForCode": model.traits.iter().any(|t| t == "default_code"),
            "quantization": "not-available",
            "supportsFunctionCalling": has("tools"),
            "supportsAudioInput": has("audio"),
            "supportsReasoning": has("reasoning"),
            "supportsReasoningEffort": false,
            "supportsResponseSchema": has("response_schema"),
            "supportsMultipleImages": has("vision"),
            "supportsVision": has("vision"),
            "supportsVideoInput": has("video"),
            "supportsWebSearch": web_search && has("web_search"),
            "supportsLogProbs": has("logprobs"),
            "supportsTeeAttestation": false,
            "supportsE2EE": false,
            "supportsXSearch": model.native_search.is_some(),
        });
    }
    match model.model_type.as_str() {
        "image" | "inpaint" => {
            // The routes' own limits when the model sets none.
            let prompt_limit = if model.model_type == "inpaint" {
                32_768
            } else {
                7_500
            };
            spec["constraints"] = json!({
                "promptCharacterLimit": model.prompt_character_limit.unwrap_or(prompt_limit),
                "steps": {"default": 8, "max": 150},
                "widthHeightDivisor": 1,
            });
            if let Some(first) = model.usd_per_image_resolution.keys().next() {
                spec["constraints"]["resolutions"] =
                    json!(model.usd_per_image_resolution.keys().collect::<Vec<_>>());
                spec["constraints"]["defaultResolution"] = json!(first);
            }
        }
        "video" => {
            let durations: Vec<String> = model
                .video_durations()
                .iter()
                .map(|seconds| format!("{seconds}s"))
                .collect();
            spec["constraints"] = json!({
                "aspect_ratios": model.aspect_ratios(),
                "resolutions": model.video_resolutions(),
                "durations": durations,
                "model_type": "text-to-video",
                "audio": false,
                "audio_configurable": false,
                "prompt_character_limit": model.prompt_character_limit.unwrap_or(2500),
            });
        }
        "embedding" => {
            if let Some(dimensions) = model.embedding_dimensions {
                spec["embeddingDimensions"] = json!(dimensions);
            }
            if let Some(tokens) = model.max_input_tokens {
                spec["maxInputTokens"] = json!(tokens);
            }
            spec["supportsCustomDimensions"] = json!(model.custom_dimensions);
        }
        "tts" => {
            let formats = model.audio_formats();
            spec["voices"] = json!(model.voices);
            if let Some(voice) = model.voices.first() {
                spec["default_voice"] = json!(voice);
            }
            spec["default_format"] = json!(formats.first());
            spec["supported_formats"] = json!(formats);
        }
        _ => {}
    }
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
        // Nothing is remapped: the model serves until the operator removes it.
        spec["deprecation"] = json!({"autoRemap": false, "date": date, "removesAt": date});
    }
    let mut entry = json!({
        "id": model.id,
        "object": "model",
        "created": model.created.unwrap_or(built),
        "owned_by": brand,
        "type": model.model_type,
        "model_spec": spec,
    });
    if let Some(context) = model.context_length {
        entry["context_length"] = json!(context);
    }
    entry
}
