//! `multipart/form-data` bodies (a document to parse, audio to transcribe,
//! images to edit), read whole under a cap.
//!
//! The body is capped before the multipart parser sees it: the parser
//! buffers until it finds a boundary, which a hostile body never sends. A
//! form must also arrive within [`READ_TIME`].

use actix_web::{HttpRequest, web};
use futures_util::StreamExt;
use rialto_core::ErrorCode;

use crate::{ApiError, Details};

/// What a form may hold besides its files (headers, boundaries, fields).
const OVERHEAD_BYTES: usize = 64 * 1024;

/// Largest text field.
const MAX_FIELD_BYTES: usize = 16 * 1024;

/// Most parts one form may have.
const MAX_PARTS: usize = 32;

/// How long a form may take to arrive.
const READ_TIME: std::time::Duration = std::time::Duration::from_secs(60);

/// One part of a form.
#[derive(Debug)]
pub(crate) struct Part {
    pub(crate) name: String,
    /// The file name a file part carries; None for a text field.
    pub(crate) filename: Option<String>,
    /// Its declared media type, unless none or `application/octet-stream`.
    pub(crate) media_type: Option<String>,
    pub(crate) bytes: Vec<u8>,
}

impl Part {
    /// A text field's value, trimmed.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).trim().to_owned()
    }
}

/// A form's parts in order. File parts (those with a file name, or named
/// in `file_fields`) may together hold `file_bytes`; a text field at most
/// 16 KiB.
pub(crate) async fn read(
    request: &HttpRequest,
    payload: web::Payload,
    file_fields: &[&str],
    file_bytes: usize,
) -> Result<Vec<Part>, ApiError> {
    let cap = file_bytes.saturating_add(OVERHEAD_BYTES);
    let too_large = || {
        ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("The form is larger than {cap} bytes"),
        )
    };
    let declared = request
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|length| length > cap) {
        return Err(too_large());
    }
    let overflowed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut seen = 0usize;
    let capped = {
        let overflowed = overflowed.clone();
        payload.into_inner().map(move |chunk| {
            let chunk = chunk?;
            seen = seen.saturating_add(chunk.len());
            if seen > cap {
                overflowed.store(true, std::sync::atomic::Ordering::Relaxed);
                return Err(actix_web::error::PayloadError::Overflow);
            }
            Ok(chunk)
        })
    };
    let reading = parts(
        actix_multipart::Multipart::new(request.headers(), capped),
        file_fields,
        file_bytes,
    );
    match tokio::time::timeout(READ_TIME, reading).await {
        Ok(Err(_)) if overflowed.load(std::sync::atomic::Ordering::Relaxed) => Err(too_large()),
        Ok(read) => read,
        Err(_) => Err(ApiError::new(
            ErrorCode::InvalidRequest,
            format!("The form took longer than {READ_TIME:?} to arrive"),
        )),
    }
}

async fn parts(
    mut form: actix_multipart::Multipart,
    file_fields: &[&str],
    file_bytes: usize,
) -> Result<Vec<Part>, ApiError> {
    let unreadable = |e: &dyn std::fmt::Display| {
        let mut details = Details::new();
        details.push(&[], format!("The form could not be read: {e}"));
        ApiError::validation(details)
    };
    let mut parts = Vec::new();
    let mut file_total = 0usize;
    while let Some(field) = form.next().await {
        if parts.len() == MAX_PARTS {
            let mut details = Details::new();
            details.push(&[], format!("The form has more than {MAX_PARTS} parts"));
            return Err(ApiError::validation(details));
        }
        let mut field = field.map_err(|e| unreadable(&e))?;
        let name = field.name().unwrap_or_default().to_owned();
        let filename = field
            .content_disposition()
            .and_then(|d| d.get_filename())
            .map(str::to_owned);
        let media_type = field
            .content_type()
            .map(|m| m.essence_str().to_owned())
            .filter(|m| m != "application/octet-stream");
        let is_file = filename.is_some() || file_fields.contains(&name.as_str());
        let limit = if is_file {
            file_bytes - file_total
        } else {
            MAX_FIELD_BYTES
        };
        let mut bytes = Vec::new();
        while let Some(chunk) = field.next().await {
            let chunk = chunk.map_err(|e| unreadable(&e))?;
            if bytes.len() + chunk.len() > limit {
                return Err(ApiError::new(
                    ErrorCode::PayloadTooLarge,
                    format!("The {name} field is larger than {limit} bytes"),
                ));
            }
            bytes.extend_from_slice(&chunk);
        }
        if is_file {
            file_total += bytes.len();
        }
        parts.push(Part {
            name,
            filename,
            media_type,
            bytes,
        });
    }
    Ok(parts)
}

/// Whether a request's body is a multipart form.
pub(crate) fn is_multipart(request: &HttpRequest) -> bool {
    request
        .headers()
        .get(actix_web::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("multipart/form-data"))
}
