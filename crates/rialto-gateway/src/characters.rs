//! `GET /api/v1/characters` and `GET /api/v1/characters/{slug}`: the public
//! characters of the configuration, in the hosted API's shapes. An API key is
//! required (no credentials: 402; a wallet sign-in: 401).

use actix_web::{HttpRequest, HttpResponse, web};
use rialto_core::ErrorCode;
use rialto_core::config::CharacterConfig;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{ApiError, Details, Gateway, authenticate_endpoint};

/// Names characters' ids: stable UUIDs derived from the slug.
const CHARACTER_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x6a1f_2c0e_8d4b_4f7a_9e35_1b2c_3d4e_5f60);

#[derive(Deserialize, Default)]
pub struct ListQuery {
    limit: Option<String>,
    offset: Option<String>,
    search: Option<String>,
    #[serde(rename = "isAdult")]
    is_adult: Option<String>,
    #[serde(rename = "isWebEnabled")]
    is_web_enabled: Option<String>,
}

fn character_json(character: &CharacterConfig) -> Value {
    let created = character
        .created_at
        .clone()
        .unwrap_or_else(|| "1970-01-01T00:00:00.000Z".to_owned());
    json!({
        "adult": character.adult,
        "author": character.author,
        "createdAt": created,
        "description": character.description,
        "featured": character.featured,
        "id": uuid::Uuid::new_v5(&CHARACTER_NAMESPACE, character.slug.as_bytes()).to_string(),
        "name": character.name,
        "shareUrl": character.share_url,
        "photoUrl": character.photo_url,
        "slug": character.slug,
        "stats": {"averageRating": 0, "imports": 0, "ratingCount": 0, "ratingSum": 0, "userRating": null},
        "tags": character.tags,
        "updatedAt": created,
        "webEnabled": character.web_enabled,
        "modelId": character.model_id,
    })
}

fn flag(details: &mut Details, field: &str, value: Option<&str>) -> Option<bool> {
    match value {
        None => None,
        Some("true") => Some(true),
        Some("false") => Some(false),
        Some(_) => {
            details.push(&[field], "Expected \"true\" or \"false\"");
            None
        }
    }
}

pub async fn list(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<ListQuery>,
) -> Result<HttpResponse, ApiError> {
    let mut details = Details::new();
    let number = |details: &mut Details,
                  field: &str,
                  value: Option<&str>,
                  default: usize,
                  range: std::ops::RangeInclusive<usize>| {
        match value.map(str::parse::<usize>) {
            None => default,
            Some(Ok(n)) if range.contains(&n) => n,
            Some(_) => {
                details.push(
                    &[field],
                    format!(
                        "Expected an integer from {} to {}",
                        range.start(),
                        range.end()
                    ),
                );
                default
            }
        }
    };
    let limit = number(&mut details, "limit", query.limit.as_deref(), 50, 1..=100);
    let offset = number(
        &mut details,
        "offset",
        query.offset.as_deref(),
        0,
        0..=usize::MAX,
    );
    let adult = flag(&mut details, "isAdult", query.is_adult.as_deref());
    let web = flag(
        &mut details,
        "isWebEnabled",
        query.is_web_enabled.as_deref(),
    );
    let search = query.search.as_deref().map(str::to_lowercase);
    if search.as_deref().is_some_and(|s| s.chars().count() > 200) {
        details.push(&["search"], "String must contain at most 200 character(s)");
    }
    details.into_result()?;
    authenticate_endpoint(&gateway, &request, false).await?;
    let data: Vec<Value> = gateway
        .character_order
        .iter()
        .filter_map(|slug| gateway.character(slug))
        .filter(|c| c.public)
        .filter(|c| adult.is_none_or(|a| c.adult == a))
        .filter(|c| web.is_none_or(|w| c.web_enabled == w))
        .filter(|c| {
            search.as_deref().is_none_or(|s| {
                c.name.to_lowercase().contains(s) || c.description.to_lowercase().contains(s)
            })
        })
        .skip(offset)
        .take(limit)
        .map(character_json)
        .collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

pub async fn get(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    slug: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    authenticate_endpoint(&gateway, &request, false).await?;
    let character = gateway
        .character(&slug)
        .filter(|c| c.public)
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, "Character not found"))?;
    Ok(HttpResponse::Ok().json(json!({"object": "character", "data": character_json(character)})))
}
