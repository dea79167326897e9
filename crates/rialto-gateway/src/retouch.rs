//! Work on an image the caller has: `POST /image/upscale` and `POST
//! /image/background-remove`, in the hosted API's shapes (a multipart
//! `image`, or in JSON base64, a `data:` URL or, for background removal,
//! `image_url`), each answering the PNG.
//!
//! OpenAI's API has no upscale call, so an `upscale` model's backends are
//! asked the hosted API's own (`POST <url>/image/upscale`, JSON `{image,
//! scale, creativity}`, answering the image's bytes): the hosted API itself,
//! another Rialto, or a wrapper around an upscaler such as Real-ESRGAN. The
//! answer must be a PNG of the promised size (its header is read). A
//! background is removed by the default edit model (`type = "inpaint"`) as
//! an OpenAI `/images/edits` call with `background: "transparent"`, as
//! gpt-image-1 takes it; the PNG that comes back must have an alpha channel.

use actix_web::{HttpRequest, HttpResponse, web};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use rialto_core::ErrorCode;
use serde_json::{Map, Value, json};

use crate::augment::{invalid_at, object_body};
use crate::images::{Generation, ImageSource, base64_image, run};
use crate::media::{self, Members, unknown_members};
use crate::{ApiError, Details, Gateway, authenticate};

/// Fewest pixels of an image to upscale, and most of the result (the
/// hosted API's bounds).
const MIN_UPSCALE_PIXELS: u64 = 65_536;
const MAX_UPSCALED_PIXELS: u64 = 16_777_216;

/// What the prompt of a background removal asks of the edit model.
const REMOVE_BACKGROUND: &str = "Remove the background entirely: keep the main subject exactly as \
     it is, on a transparent background.";

/// A request's members and its image, from a form or a JSON body.
async fn read_image_request(
    gateway: &Gateway,
    request: &HttpRequest,
    payload: web::Payload,
) -> Result<(Map<String, Value>, Option<Vec<u8>>), ApiError> {
    if crate::forms::is_multipart(request) {
        let parts =
            crate::forms::read(request, payload, &["image"], gateway.max_upload_bytes).await?;
        let mut body = Map::new();
        let mut image = None;
        for part in parts {
            if part.name == "image" {
                image = Some(part.bytes);
            } else {
                let text = part.text();
                // Numbers in a form are text: read them as JSON numbers.
                let value = serde_json::from_str::<serde_json::Number>(&text)
                    .map_or(Value::String(text), Value::Number);
                body.insert(part.name, value);
            }
        }
        Ok((body, image))
    } else {
        let body = object_body(gateway, request, payload).await?;
        Ok((body, None))
    }
}

/// The image sent in JSON (`image`: base64 or a `data:` URL) or in the form.
fn image_bytes(
    body: &Map<String, Value>,
    uploaded: Option<Vec<u8>>,
) -> Result<Option<Vec<u8>>, ApiError> {
    match (uploaded, body.get("image")) {
        (Some(bytes), _) => Ok(Some(bytes)),
        (None, Some(Value::String(image))) => base64_image(image.trim())
            .map(Some)
            .map_err(|why| invalid_at(&["image"], why)),
        (None, Some(Value::Null) | None) => Ok(None),
        (None, Some(_)) => Err(invalid_at(&["image"], "Expected a base64 image")),
    }
}

/// The width and height an image's header declares.
fn dimensions(bytes: &[u8]) -> Result<(u32, u32), String> {
    image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| e.to_string())?
        .into_dimensions()
        .map_err(|_| "the image could not be read".to_owned())
}

/// The scale the result can have: `asked`, reduced until it fits
/// [`MAX_UPSCALED_PIXELS`], and never below 2.
fn fitting_scale(width: u32, height: u32, asked: f64) -> Option<f64> {
    let pixels = f64::from(width) * f64::from(height);
    // Down to a thousandth, so the rounded sides stay within the bound.
    let most = ((MAX_UPSCALED_PIXELS as f64 / pixels).sqrt() * 1000.0).floor() / 1000.0;
    let scale = asked.min(most);
    (scale >= 2.0).then_some(scale)
}

/// `POST /image/upscale`.
pub async fn upscale(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let (body, uploaded) = read_image_request(&gateway, &request, payload).await?;
    let mut details = Details::new();
    unknown_members(
        &body,
        &["image", "scale", "creativity", "model"],
        &mut details,
    );
    let mut members = Members {
        body: &body,
        details: &mut details,
    };
    let model_id = members.text("model", 1, 256);
    let scale = members.number("scale", 2.0, 4.0, false).unwrap_or(2.0);
    // Clamped as the hosted API does.
    let creativity = members
        .number("creativity", 0.0, f64::MAX, false)
        .map(|c| c.min(0.02));
    details.into_result()?;
    let image = image_bytes(&body, uploaded)?
        .ok_or_else(|| invalid_at(&["image"], "Required: a file or a base64 image"))?;
    let (width, height) = dimensions(&image).map_err(|why| invalid_at(&["image"], why))?;
    if u64::from(width) * u64::from(height) < MIN_UPSCALE_PIXELS {
        return Err(invalid_at(
            &["image"],
            format!("The image must have at least {MIN_UPSCALE_PIXELS} pixels ({width}x{height})"),
        ));
    }
    let scale = fitting_scale(width, height, scale).ok_or_else(|| {
        invalid_at(
            &["image"],
            format!("Twice {width}x{height} is more than {MAX_UPSCALED_PIXELS} pixels"),
        )
    })?;
    let expected = (
        (f64::from(width) * scale).round() as u32,
        (f64::from(height) * scale).round() as u32,
    );
    let model = &media::model_of(&gateway, model_id.as_deref(), &["upscale"], false)?;
    let tier = if scale <= 2.0 { "2x" } else { "4x" };
    let price = media::nanos(
        model
            .config
            .usd_per_upscale
            .get(tier)
            .copied()
            .unwrap_or(0.0),
        rust_decimal::Decimal::ONE,
    );
    let mut upstream = Map::new();
    upstream.insert("image".into(), Value::String(BASE64.encode(&image)));
    upstream.insert("scale".into(), json!(scale));
    media::insert_present(&mut upstream, [("creativity", creativity.map(Value::from))]);
    let mut metered = media::meter(&gateway, &request, &principal, model, price).await?;
    let task_gateway = gateway.clone();
    let (png, charged) = media::detached(async move {
        let delivered = metered
            .call(&task_gateway, "/image/upscale", &upstream, Vec::new())
            .await?;
        let png = image::guess_format(&delivered.body).ok() == Some(image::ImageFormat::Png);
        match dimensions(&delivered.body) {
            Ok(size)
                if png && size.0.abs_diff(expected.0) <= 1 && size.1.abs_diff(expected.1) <= 1 => {}
            Ok(size) => {
                return Err(metered.unusable(&format!(
                    "a {}x{} image (png: {png}), not the {}x{} PNG asked",
                    size.0, size.1, expected.0, expected.1
                )));
            }
            Err(why) => return Err(metered.unusable(&why)),
        }
        let charged = metered.bill(&delivered, price).await?;
        Ok((delivered.body, charged))
    })
    .await?;
    Ok(charged
        .response(&gateway, model)
        .content_type("image/png")
        .body(png))
}

/// `POST /image/background-remove`.
pub async fn background_remove(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let (body, uploaded) = read_image_request(&gateway, &request, payload).await?;
    let mut details = Details::new();
    unknown_members(&body, &["image", "image_url"], &mut details);
    let mut members = Members {
        body: &body,
        details: &mut details,
    };
    let url = members.text("image_url", 1, 8192);
    details.into_result()?;
    let image = image_bytes(&body, uploaded)?;
    let source = match (image, url) {
        (Some(_), Some(_)) => {
            return Err(invalid_at(
                &["image_url"],
                "Send an image or an image_url, not both",
            ));
        }
        (Some(bytes), None) => {
            if image::guess_format(&bytes).is_err() {
                return Err(invalid_at(&["image"], "The image is not an image"));
            }
            ImageSource::Bytes(bytes)
        }
        (None, Some(url)) if url.starts_with("http://") || url.starts_with("https://") => {
            ImageSource::Url(url)
        }
        (None, Some(_)) => {
            return Err(invalid_at(&["image_url"], "Expected an http(s) URL"));
        }
        (None, None) => {
            return Err(invalid_at(
                &["image"],
                "Required: an image (a file or base64) or an image_url",
            ));
        }
    };
    let model = &media::default_model(&gateway.catalog(), "inpaint")
        .cloned()
        .ok_or_else(|| {
            ApiError::new(
                ErrorCode::ModelNotFound,
                "No image edit model is configured on this server",
            )
        })?;
    let usd_per_image = model
        .config
        .usd_per_image_resolution
        .values()
        .next()
        .copied()
        .unwrap_or(model.config.usd_per_image);
    let mut upstream = Map::new();
    upstream.insert("prompt".into(), Value::String(REMOVE_BACKGROUND.to_owned()));
    upstream.insert("n".into(), json!(1));
    upstream.insert("response_format".into(), json!("b64_json"));
    upstream.insert("output_format".into(), json!("png"));
    upstream.insert("background".into(), json!("transparent"));
    let generation = Generation {
        model: std::sync::Arc::clone(model),
        path: "/images/edits",
        upstream,
        sources: vec![("image", source)],
        count: 1,
        format: "png",
        usd_per_image,
        transparent: true,
    };
    let (images, mut response) = run(&gateway, &request, &principal, generation).await?;
    let image = images.encoded.into_iter().next().unwrap_or_default();
    Ok(response.content_type("image/png").body(image))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scale_shrinks_to_fit_the_largest_result() {
        assert_eq!(fitting_scale(512, 512, 4.0), Some(4.0));
        // 4096x4096 is the most: 2048 squared can double, not quadruple.
        assert_eq!(fitting_scale(2048, 2048, 4.0), Some(2.0));
        assert!(fitting_scale(3000, 3000, 2.0).is_none());
        let scale = fitting_scale(1500, 1000, 4.0).unwrap();
        let sides = (
            (1500.0 * scale).round() as u64,
            (1000.0 * scale).round() as u64,
        );
        assert!(
            scale < 4.0 && sides.0 * sides.1 <= MAX_UPSCALED_PIXELS,
            "{scale}"
        );
    }
}
