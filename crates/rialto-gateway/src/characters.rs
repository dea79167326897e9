//! `GET /api/v1/characters` and `GET /api/v1/characters/{slug}`: the public
//! characters of the configuration, in the hosted API's shapes. An API key is
//! required (no credentials: 402; a wallet sign-in: 401).

use actix_web::{HttpRequest, HttpResponse, web};
use rialto_core::ErrorCode;
use rialto_core::config::CharacterConfig;
use serde::Deserialize;
use serde_json::{Value, json};

use rialto_proto::auth::v1 as auth_pb;

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

/// Characters by slug, in listing order: the configuration's, then the
/// stored ones (a stored character replaces a configured one of its slug).
#[derive(Debug, Default)]
pub struct CharacterSet {
    by_slug: std::collections::HashMap<String, CharacterConfig>,
    order: Vec<String>,
}

impl CharacterSet {
    pub fn new(configured: Vec<CharacterConfig>, stored: Vec<auth_pb::Character>) -> Self {
        let mut set = Self::default();
        let stored = stored.into_iter().map(|c| CharacterConfig {
            created_at: chrono::DateTime::<chrono::Utc>::from_timestamp_millis(c.created_at_ms)
                .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)),
            slug: c.slug,
            name: c.name,
            description: c.description,
            system_prompt: c.system_prompt,
            model_id: c.model_id,
            public: c.public,
            tags: c.tags,
            adult: c.adult,
            featured: c.featured,
            web_enabled: c.web_enabled,
            author: c.author,
            photo_url: c.photo_url,
            share_url: c.share_url,
        });
        for character in configured.into_iter().chain(stored) {
            if !set.by_slug.contains_key(&character.slug) {
                set.order.push(character.slug.clone());
            }
            set.by_slug.insert(character.slug.clone(), character);
        }
        set
    }

    pub fn get(&self, slug: &str) -> Option<&CharacterConfig> {
        self.by_slug.get(slug)
    }

    fn in_order(&self) -> impl Iterator<Item = &CharacterConfig> {
        self.order.iter().filter_map(|slug| self.by_slug.get(slug))
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
    let characters = gateway.characters();
    let data: Vec<Value> = characters
        .in_order()
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
    Ok(HttpResponse::Ok().json(json!({"object": "character", "data": character_json(&character)})))
}

/// `PUT /admin/v1/characters/{slug}` (operator): creates or replaces a
/// stored character: `{name, system_prompt, description?, model_id?,
/// public? (true), tags?, adult?, featured?, web_enabled?, author?,
/// photo_url?, share_url?}`.
pub async fn put_character(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    slug: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    crate::operator::check_operator(&gateway, &request)?;
    let body = crate::parse_json(&crate::read_body(&gateway, &request, payload).await?)?;
    let mut details = Details::new();
    let text = |details: &mut Details, field: &str, required: bool| match body.get(field) {
        Some(Value::String(value)) if !(required && value.trim().is_empty()) => value.clone(),
        None | Some(Value::Null) if !required => String::new(),
        Some(Value::String(_)) | None | Some(Value::Null) => {
            details.push(&[field], "Required");
            String::new()
        }
        Some(_) => {
            details.push(&[field], "Expected string");
            String::new()
        }
    };
    let boolean = |details: &mut Details, field: &str, default: bool| match body.get(field) {
        None | Some(Value::Null) => default,
        Some(Value::Bool(value)) => *value,
        Some(_) => {
            details.push(&[field], "Expected boolean");
            default
        }
    };
    let tags = match body.get("tags") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|t| t.as_str().map(str::to_owned))
            .collect(),
        Some(_) => {
            details.push(&["tags"], "Expected an array of strings");
            Vec::new()
        }
    };
    let character = auth_pb::Character {
        slug: slug.into_inner(),
        name: text(&mut details, "name", true),
        description: text(&mut details, "description", false),
        system_prompt: text(&mut details, "system_prompt", true),
        model_id: Some(text(&mut details, "model_id", false)).filter(|m| !m.is_empty()),
        public: boolean(&mut details, "public", true),
        tags,
        adult: boolean(&mut details, "adult", false),
        featured: boolean(&mut details, "featured", false),
        web_enabled: boolean(&mut details, "web_enabled", false),
        author: text(&mut details, "author", false),
        photo_url: text(&mut details, "photo_url", false),
        share_url: text(&mut details, "share_url", false),
        ..Default::default()
    };
    details.into_result()?;
    let stored = gateway.services.auth.put_character(character).await?;
    gateway.refresh_characters().await?;
    let set = CharacterSet::new(Vec::new(), vec![stored]);
    let shown = set
        .in_order()
        .next()
        .map(character_json)
        .unwrap_or(Value::Null);
    Ok(HttpResponse::Ok().json(json!({"object": "character", "data": shown})))
}

/// `DELETE /admin/v1/characters/{slug}` (operator): removes a stored
/// character (those of the configuration stay).
pub async fn delete_character(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    slug: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    crate::operator::check_operator(&gateway, &request)?;
    gateway
        .services
        .auth
        .delete_character(auth_pb::DeleteCharacterRequest {
            slug: slug.into_inner(),
        })
        .await?;
    gateway.refresh_characters().await?;
    Ok(HttpResponse::Ok().json(json!({"success": true})))
}
