//! `GET /api/v1/characters` and `GET /api/v1/characters/{slug}`: the public
//! characters of the configuration, in the hosted API's shapes. An API key is
//! required (no credentials: 402; a wallet sign-in: 401).

use actix_web::{HttpRequest, HttpResponse, web};
use rialto_core::ErrorCode;
use rialto_core::config::CharacterConfig;
use serde_json::{Value, json};

use rialto_proto::auth::v1 as auth_pb;

use crate::{ApiError, Details, Gateway, authenticate_endpoint};

/// Names characters' ids: stable UUIDs derived from the slug.
const CHARACTER_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x6a1f_2c0e_8d4b_4f7a_9e35_1b2c_3d4e_5f60);

/// A character's reviews in numbers (all zero when it has none).
#[derive(Debug, Default, Clone, Copy)]
struct Rating {
    count: u64,
    sum: u64,
    own: Option<i32>,
    latest_ms: i64,
}

impl Rating {
    fn average(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            // Two decimals, as the hosted API shows it.
            ((self.sum as f64 / self.count as f64) * 100.0).round() / 100.0
        }
    }
}

fn character_json(character: &CharacterConfig, rating: Rating) -> Value {
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
        "id": character_id(&character.slug),
        "name": character.name,
        "shareUrl": character.share_url,
        "photoUrl": character.photo_url,
        "slug": character.slug,
        "stats": {
            "averageRating": rating.average(),
            // Characters are not imported here: nothing counts imports.
            "imports": 0,
            "ratingCount": rating.count,
            "ratingSum": rating.sum,
            "userRating": rating.own,
        },
        "tags": character.tags,
        "updatedAt": created,
        "webEnabled": character.web_enabled,
        "modelId": character.model_id,
    })
}

fn character_id(slug: &str) -> String {
    uuid::Uuid::new_v5(&CHARACTER_NAMESPACE, slug.as_bytes()).to_string()
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
    /// The stored characters, kept for a reload of the configured ones.
    stored: Vec<CharacterConfig>,
}

impl CharacterSet {
    pub fn new(configured: Vec<CharacterConfig>, stored: Vec<auth_pb::Character>) -> Self {
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
            categories: c.categories,
            adult: c.adult,
            featured: c.featured,
            web_enabled: c.web_enabled,
            author: c.author,
            photo_url: c.photo_url,
            share_url: c.share_url,
        });
        Self::of(configured, stored.collect())
    }

    fn of(configured: Vec<CharacterConfig>, stored: Vec<CharacterConfig>) -> Self {
        let mut set = Self::default();
        for character in configured.into_iter().chain(stored.iter().cloned()) {
            if !set.by_slug.contains_key(&character.slug) {
                set.order.push(character.slug.clone());
            }
            set.by_slug.insert(character.slug.clone(), character);
        }
        set.stored = stored;
        set
    }

    /// The same stored characters after new configured ones (a reload).
    pub fn with_configured(&self, configured: Vec<CharacterConfig>) -> Self {
        Self::of(configured, self.stored.clone())
    }

    pub fn get(&self, slug: &str) -> Option<&CharacterConfig> {
        self.by_slug.get(slug)
    }

    fn in_order(&self) -> impl Iterator<Item = &CharacterConfig> {
        self.order.iter().filter_map(|slug| self.by_slug.get(slug))
    }
}

/// The sorts of `GET /characters?sortBy=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SortBy {
    Featured,
    HighestRating,
    HighlyRated,
    HighlyRatedAndRecent,
    Imports,
    MostRecent,
    RatingCount,
}

const SORTS: &[(&str, SortBy)] = &[
    ("featured", SortBy::Featured),
    ("highestRating", SortBy::HighestRating),
    ("highlyRated", SortBy::HighlyRated),
    ("highlyRatedAndRecent", SortBy::HighlyRatedAndRecent),
    ("imports", SortBy::Imports),
    ("mostRecent", SortBy::MostRecent),
    ("ratingCount", SortBy::RatingCount),
];

/// Ratings "highly rated" sorts lean on: an average weighted towards 3
/// stars by this many phantom reviews, so one 5-star review does not beat
/// forty 4.8-star ones (a Bayesian average).
const PRIOR_REVIEWS: f64 = 5.0;
const PRIOR_RATING: f64 = 3.0;

fn weighted_rating(rating: &Rating) -> f64 {
    (rating.sum as f64 + PRIOR_REVIEWS * PRIOR_RATING) / (rating.count as f64 + PRIOR_REVIEWS)
}

/// A list parameter: repeated (`tags=a&tags=b`, also `tags[]=`) or
/// comma-separated (`tags=a,b`), at most 20 values of at most `max_len`.
fn list_parameter(
    query: &[(String, String)],
    name: &str,
    max_len: usize,
    details: &mut Details,
) -> Vec<String> {
    let bracketed = format!("{name}[]");
    let values: Vec<String> = query
        .iter()
        .filter(|(key, _)| *key == name || *key == bracketed)
        .flat_map(|(_, value)| value.split(','))
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
        .collect();
    if values.len() > 20 {
        details.push(&[name], "Array must contain at most 20 element(s)");
    }
    if values.iter().any(|v| v.chars().count() > max_len) {
        details.push(
            &[name],
            format!("String must contain at most {max_len} character(s)"),
        );
    }
    values
}

fn single<'a>(query: &'a [(String, String)], name: &str) -> Option<&'a str> {
    query
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, v)| v.as_str())
}

fn number(
    details: &mut Details,
    field: &str,
    value: Option<&str>,
    default: usize,
    range: std::ops::RangeInclusive<usize>,
) -> usize {
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
}

/// Every reviewed character's rating, with the caller's own.
async fn ratings(
    gateway: &Gateway,
    account_id: &str,
) -> Result<std::collections::HashMap<String, Rating>, ApiError> {
    let ratings = gateway
        .services
        .auth
        .character_ratings(auth_pb::CharacterRatingsRequest {
            account_id: account_id.to_owned(),
        })
        .await?
        .ratings;
    Ok(ratings
        .into_iter()
        .map(|r| {
            let rating = Rating {
                count: r.count,
                sum: r.sum,
                own: r.own,
                latest_ms: r.latest_ms,
            };
            (r.slug, rating)
        })
        .collect())
}

/// `GET /characters`: the public characters, filtered by `categories`,
/// `isAdult`, `isPro` (the character's model is priced), `isWebEnabled`,
/// `modelId`, `search` (name, description or tags; `#tag` for a tag) and
/// `tags`, sorted by `sortBy` and `sortOrder` (default: the configuration's
/// order), paged by `limit` and `offset`.
pub async fn list(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    query: web::Query<Vec<(String, String)>>,
) -> Result<HttpResponse, ApiError> {
    let query = query.into_inner();
    let mut details = Details::new();
    let limit = number(&mut details, "limit", single(&query, "limit"), 50, 1..=100);
    let offset = number(
        &mut details,
        "offset",
        single(&query, "offset"),
        0,
        0..=usize::MAX,
    );
    let adult = flag(&mut details, "isAdult", single(&query, "isAdult"));
    let web = flag(&mut details, "isWebEnabled", single(&query, "isWebEnabled"));
    let pro = flag(&mut details, "isPro", single(&query, "isPro"));
    let search = single(&query, "search").map(str::to_lowercase);
    if search.as_deref().is_some_and(|s| s.chars().count() > 200) {
        details.push(&["search"], "String must contain at most 200 character(s)");
    }
    let lower = |values: Vec<String>| -> Vec<String> {
        values.into_iter().map(|v| v.to_lowercase()).collect()
    };
    let categories = lower(list_parameter(&query, "categories", 100, &mut details));
    let tags = lower(list_parameter(&query, "tags", 100, &mut details));
    let model_ids = list_parameter(&query, "modelId", 200, &mut details);
    let sort = match single(&query, "sortBy") {
        None => None,
        Some(name) => match SORTS.iter().find(|(n, _)| *n == name) {
            Some((_, sort)) => Some(*sort),
            None => {
                let names: Vec<String> = SORTS.iter().map(|(n, _)| format!("'{n}'")).collect();
                details.push(
                    &["sortBy"],
                    format!(
                        "Invalid enum value. Expected {}, received '{name}'",
                        names.join(" | ")
                    ),
                );
                None
            }
        },
    };
    let ascending = match single(&query, "sortOrder") {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(other) => {
            details.push(
                &["sortOrder"],
                format!("Invalid enum value. Expected 'asc' | 'desc', received '{other}'"),
            );
            false
        }
    };
    details.into_result()?;
    let principal = authenticate_endpoint(&gateway, &request, false).await?;
    let ratings = ratings(&gateway, &principal.account_id).await?;
    let rating_of = |c: &CharacterConfig| ratings.get(&c.slug).copied().unwrap_or_default();
    let catalog = gateway.catalog();
    let priced = |c: &CharacterConfig| {
        c.model_id
            .as_deref()
            .and_then(|id| catalog.model(id))
            .is_some_and(|m| crate::models::is_priced(&m.config))
    };
    let has_any = |wanted: &[String], have: &[String]| {
        wanted.is_empty()
            || have
                .iter()
                .any(|h| wanted.iter().any(|w| h.eq_ignore_ascii_case(w)))
    };
    let matches_search = |c: &CharacterConfig| {
        let Some(search) = search.as_deref() else {
            return true;
        };
        let tag_hit = |needle: &str| c.tags.iter().any(|t| t.to_lowercase().contains(needle));
        match search.strip_prefix('#') {
            Some(tag) => tag_hit(tag),
            None => {
                c.name.to_lowercase().contains(search)
                    || c.description.to_lowercase().contains(search)
                    || tag_hit(search)
            }
        }
    };
    let characters = gateway.characters();
    let mut chosen: Vec<&CharacterConfig> = characters
        .in_order()
        .filter(|c| c.public)
        .filter(|c| adult.is_none_or(|a| c.adult == a))
        .filter(|c| web.is_none_or(|w| c.web_enabled == w))
        .filter(|c| pro.is_none_or(|p| priced(c) == p))
        .filter(|c| has_any(&categories, &c.categories))
        .filter(|c| has_any(&tags, &c.tags))
        .filter(|c| {
            model_ids.is_empty()
                || c.model_id
                    .as_ref()
                    .is_some_and(|m| model_ids.iter().any(|w| w == m))
        })
        .filter(|c| matches_search(c))
        .collect();
    if let Some(sort) = sort {
        // A stable sort: ties keep the configuration's order.
        let created = |c: &CharacterConfig| c.created_at.clone().unwrap_or_default();
        let by = |a: &&CharacterConfig, b: &&CharacterConfig| {
            let (ra, rb) = (rating_of(a), rating_of(b));
            match sort {
                SortBy::Featured => a.featured.cmp(&b.featured),
                SortBy::HighestRating => ra.average().total_cmp(&rb.average()),
                SortBy::HighlyRated => weighted_rating(&ra).total_cmp(&weighted_rating(&rb)),
                SortBy::HighlyRatedAndRecent => weighted_rating(&ra)
                    .total_cmp(&weighted_rating(&rb))
                    .then(ra.latest_ms.cmp(&rb.latest_ms)),
                SortBy::Imports => std::cmp::Ordering::Equal,
                SortBy::MostRecent => created(a).cmp(&created(b)),
                SortBy::RatingCount => ra.count.cmp(&rb.count),
            }
        };
        if ascending {
            chosen.sort_by(by);
        } else {
            chosen.sort_by(|a, b| by(b, a));
        }
    }
    let data: Vec<Value> = chosen
        .into_iter()
        .skip(offset)
        .take(limit)
        .map(|c| character_json(c, rating_of(c)))
        .collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

pub async fn get(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    slug: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate_endpoint(&gateway, &request, false).await?;
    let character = public_character(&gateway, &slug)?;
    let rating = ratings(&gateway, &principal.account_id)
        .await?
        .remove(&character.slug)
        .unwrap_or_default();
    Ok(HttpResponse::Ok()
        .json(json!({"object": "character", "data": character_json(&character, rating)})))
}

fn public_character(gateway: &Gateway, slug: &str) -> Result<CharacterConfig, ApiError> {
    gateway
        .character(slug)
        .filter(|c| c.public)
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, "Character not found"))
}

/// `GET /characters/{slug}/reviews?page&pageSize`: the character's reviews,
/// newest first, with the `x-pagination-*` headers.
pub async fn reviews(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    slug: web::Path<String>,
    query: web::Query<Vec<(String, String)>>,
) -> Result<HttpResponse, ApiError> {
    let mut details = Details::new();
    let page = number(
        &mut details,
        "page",
        single(&query, "page"),
        1,
        1..=1_000_000,
    );
    let page_size = number(
        &mut details,
        "pageSize",
        single(&query, "pageSize"),
        20,
        1..=100,
    );
    details.into_result()?;
    let principal = authenticate_endpoint(&gateway, &request, false).await?;
    let character = public_character(&gateway, &slug)?;
    let listed = gateway
        .services
        .auth
        .list_character_reviews(auth_pb::ListCharacterReviewsRequest {
            slug: character.slug.clone(),
            page: u32::try_from(page).unwrap_or(u32::MAX),
            page_size: u32::try_from(page_size).unwrap_or(100),
        })
        .await?;
    let total_pages = listed.total.div_ceil(page_size as u64);
    let id = character_id(&character.slug);
    let data: Vec<Value> = listed
        .reviews
        .iter()
        .map(|review| review_json(review, &id, &principal.account_id))
        .collect();
    let summary = Rating {
        count: listed.total,
        sum: listed.rating_sum,
        ..Rating::default()
    };
    Ok(HttpResponse::Ok()
        .insert_header(("x-pagination-limit", page_size.to_string()))
        .insert_header(("x-pagination-page", page.to_string()))
        .insert_header(("x-pagination-total", listed.total.to_string()))
        .insert_header(("x-pagination-total-pages", total_pages.to_string()))
        .json(json!({
            "object": "list",
            "data": data,
            "pagination": {"page": page, "pageSize": page_size, "total": listed.total,
                "totalPages": total_pages},
            "summary": {"averageRating": summary.average(), "totalReviews": listed.total},
        })))
}

fn review_json(review: &auth_pb::CharacterReview, character_id: &str, caller: &str) -> Value {
    let created = chrono::DateTime::<chrono::Utc>::from_timestamp_millis(review.created_at_ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    json!({
        "id": review.id,
        "characterId": character_id,
        "createdAt": created,
        "rating": review.rating,
        "message": review.message,
        "locale": review.locale,
        "username": review.username,
        "isOwner": review.account_id == caller,
        "userAvatarUrl": null,
    })
}

/// Members a review may have.
const REVIEW_FIELDS: &[&str] = &["rating", "message", "locale"];

/// `POST /characters/{slug}/reviews` (Rialto's; the hosted API has no way
/// to write one): `{rating: 1..5, message?, locale?}` from an API key; the
/// account's review of the character, made or replaced.
pub async fn review(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    slug: web::Path<String>,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate_endpoint(&gateway, &request, false).await?;
    let character = public_character(&gateway, &slug)?;
    let body = crate::parse_json(&crate::read_body(&gateway, &request, payload).await?)?;
    let mut details = Details::new();
    let Some(object) = body.as_object() else {
        details.push(&[], "Expected object");
        return Err(ApiError::validation(details));
    };
    crate::media::unknown_members(object, REVIEW_FIELDS, &mut details);
    let rating = match object.get("rating") {
        Some(Value::Number(n)) if n.as_i64().is_some_and(|r| (1..=5).contains(&r)) => {
            n.as_i64().unwrap_or(0) as i32
        }
        None => {
            details.push(&["rating"], "Required");
            0
        }
        Some(_) => {
            details.push(&["rating"], "Expected an integer from 1 to 5");
            0
        }
    };
    let mut text = |field: &str, max: usize| match object.get(field) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.chars().count() <= max => Some(s.clone()),
        Some(Value::String(_)) => {
            details.push(
                &[field],
                format!("String must contain at most {max} character(s)"),
            );
            None
        }
        Some(_) => {
            details.push(&[field], "Expected string");
            None
        }
    };
    let (message, locale) = (text("message", 2000), text("locale", 35));
    details.into_result()?;
    let review = gateway
        .services
        .auth
        .put_character_review(auth_pb::PutCharacterReviewRequest {
            slug: character.slug.clone(),
            account_id: principal.account_id.clone(),
            rating,
            message,
            locale,
        })
        .await?;
    Ok(HttpResponse::Ok().json(json!({
        "object": "review",
        "data": review_json(&review, &character_id(&character.slug), &principal.account_id),
    })))
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
    let strings = |details: &mut Details, field: &str| match body.get(field) {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => items
            .iter()
            .filter_map(|t| t.as_str().map(str::to_owned))
            .collect(),
        Some(_) => {
            details.push(&[field], "Expected an array of strings");
            Vec::new()
        }
    };
    let tags = strings(&mut details, "tags");
    let categories = strings(&mut details, "categories");
    let character = auth_pb::Character {
        slug: slug.into_inner(),
        name: text(&mut details, "name", true),
        description: text(&mut details, "description", false),
        system_prompt: text(&mut details, "system_prompt", true),
        model_id: Some(text(&mut details, "model_id", false)).filter(|m| !m.is_empty()),
        public: boolean(&mut details, "public", true),
        tags,
        categories,
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
        .map(|c| character_json(c, Rating::default()))
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
