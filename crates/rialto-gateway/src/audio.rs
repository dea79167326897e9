//! Speech and transcription: `POST /audio/speech`, `POST
//! /audio/transcriptions` and `GET /audio/voices`, in OpenAI's shapes with
//! the hosted API's members.
//!
//! Speech costs the model's `usd_per_thousand_characters` for the input's
//! characters, all known before the call; with `streaming` the audio is
//! relayed as the backend sends it. A transcription costs
//! `usd_per_audio_second` for each started second of the audio: the hold is
//! for what the file can hold (a WAV's own length, else a bound from its
//! size: a second per 500 bytes), the charge for the duration the backend
//! reports (the call asks for `verbose_json`, whatever the caller wants
//! back) or a WAV's length, and never more than the hold.

use actix_web::{HttpRequest, HttpResponse, web};
use rialto_core::ErrorCode;
use rialto_proto::router::v1 as router_pb;
use rust_decimal::Decimal;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::augment::{invalid_at, object_body};
use crate::media::{self, Members, content_type_of, unknown_members};
use crate::{ApiError, Details, Gateway, authenticate};

/// Longest speech input (OpenAI's and the hosted API's limit).
const MAX_INPUT_CHARS: usize = 4096;

/// The members of `/audio/speech`: the hosted API's and OpenAI's.
const SPEECH_MEMBERS: &[&str] = &[
    "input",
    "model",
    "voice",
    "response_format",
    "speed",
    "streaming",
    "language",
    "prompt",
    "temperature",
    "top_p",
    "instructions",
    "stream_format",
];

/// `POST /audio/speech`: JSON in, the audio's bytes out.
pub async fn speech(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    let body = object_body(&gateway, &request, payload).await?;
    let mut details = Details::new();
    unknown_members(&body, SPEECH_MEMBERS, &mut details);
    let input = crate::augment::string_member(&body, "input", &mut details).map(str::to_owned);
    let mut members = Members {
        body: &body,
        details: &mut details,
    };
    let model_id = members.text("model", 1, 256);
    let voice = members.text("voice", 1, 512);
    // Any of OpenAI's here; the model's own formats are checked below.
    let format = members.choice("response_format", rialto_core::config::AUDIO_FORMATS);
    let speed = members.number("speed", 0.25, 4.0, false);
    let streaming = members.boolean("streaming").unwrap_or(false);
    // OpenAI's `sse` (events of base64 deltas) is not offered: the audio
    // streams as bytes with `streaming`.
    members.choice("stream_format", &["audio"]);
    let language = members.text("language", 2, 32);
    let style = members.text("prompt", 0, 500);
    let instructions = members.text("instructions", 0, 4096);
    let temperature = members.number("temperature", 0.0, 2.0, false);
    let top_p = members.number("top_p", 0.0, 1.0, false);
    details.into_result()?;
    let input = input.unwrap_or_default();
    let chars = input.chars().count();
    if chars == 0 || chars > MAX_INPUT_CHARS {
        return Err(invalid_at(
            &["input"],
            format!("String must contain 1 to {MAX_INPUT_CHARS} character(s)"),
        ));
    }
    let model = &media::model_of(&gateway, model_id.as_deref(), &["tts"], false)?;
    let config = &model.config;
    let voices = &config.voices;
    let voice = match voice {
        Some(voice) if voices.is_empty() || voices.contains(&voice) => voice,
        Some(voice) => {
            return Err(invalid_at(
                &["voice"],
                format!(
                    "{voice} is not a voice of {}: {}",
                    config.id,
                    voices.join(", ")
                ),
            ));
        }
        None => voices
            .first()
            .cloned()
            .unwrap_or_else(|| "af_sky".to_owned()),
    };
    let formats = config.audio_formats();
    let format = match format {
        Some(format) if formats.contains(&format.as_str()) => format,
        Some(format) => {
            return Err(invalid_at(
                &["response_format"],
                format!(
                    "{} does not produce {format}: it produces {}",
                    config.id,
                    formats.join(", ")
                ),
            ));
        }
        None => formats.first().copied().unwrap_or("mp3").to_owned(),
    };
    let mut upstream = Map::new();
    upstream.insert("input".into(), Value::String(input));
    upstream.insert("voice".into(), Value::String(voice));
    upstream.insert("response_format".into(), Value::String(format.clone()));
    // OpenAI's `instructions` is the hosted `prompt` (the delivery).
    media::insert_present(
        &mut upstream,
        [
            ("speed", speed.map(Value::from)),
            ("language", language.map(Value::from)),
            ("instructions", instructions.or(style).map(Value::from)),
            ("temperature", temperature.map(Value::from)),
            ("top_p", top_p.map(Value::from)),
        ],
    );
    let price = media::nanos(
        config.usd_per_thousand_characters,
        Decimal::from(chars) / Decimal::from(1000),
    );
    let mut metered = media::meter(&gateway, &request, &principal, model, price).await?;
    let content_type = content_type_of(&format);
    if streaming {
        return metered
            .relay(
                &gateway,
                model,
                "/audio/speech",
                &upstream,
                content_type,
                price,
            )
            .await;
    }
    let task_gateway = gateway.clone();
    let (audio, charged) = media::detached(async move {
        let delivered = metered
            .call(&task_gateway, "/audio/speech", &upstream, Vec::new())
            .await?;
        if !is_audio(&format, &delivered.body) {
            return Err(metered.unusable("not audio of the asked format"));
        }
        let charged = metered.bill(&delivered, price).await?;
        Ok((delivered.body, charged))
    })
    .await?;
    Ok(charged
        .response(&gateway, model)
        .content_type(content_type)
        .body(audio))
}

/// Whether `bytes` start as audio of `format` does (raw PCM has no mark).
pub(crate) fn is_audio(format: &str, bytes: &[u8]) -> bool {
    let starts = |mark: &[u8]| bytes.starts_with(mark);
    !bytes.is_empty()
        && match format {
            "wav" => starts(b"RIFF") && bytes.get(8..12) == Some(b"WAVE"),
            "flac" => starts(b"fLaC"),
            "opus" => starts(b"OggS"),
            // An ID3 tag, or an MPEG frame's sync bits.
            "mp3" => {
                starts(b"ID3")
                    || (bytes[0] == 0xFF && bytes.get(1).is_some_and(|b| b & 0xE0 == 0xE0))
            }
            // ADTS frames, or an MP4 (M4A) container.
            "aac" => {
                (bytes[0] == 0xFF && bytes.get(1).is_some_and(|b| b & 0xF0 == 0xF0))
                    || bytes.get(4..8) == Some(b"ftyp")
            }
            _ => true,
        }
}

/// What the caller wants back from a transcription.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transcript {
    /// The hosted shape: `{text, duration}` (and `timestamps` when asked).
    Json,
    Text,
    /// OpenAI's: the backend's answer as it is.
    VerboseJson,
    Srt,
    Vtt,
}

/// The smallest bit rate the size bound of a non-WAV file assumes (4 kbit/s,
/// below the lowest speech codecs' rates), in bytes per second. The ledger
/// never charges more than a hold, so the bound must not be short.
const MIN_BYTES_PER_SECOND: u64 = 500;

/// `POST /audio/transcriptions`: a multipart form with `file`.
pub async fn transcriptions(
    gateway: web::Data<Gateway>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let principal = authenticate(&gateway, &request).await?;
    if !crate::forms::is_multipart(&request) {
        return Err(ApiError::new(
            ErrorCode::UnsupportedMediaType,
            "Expected a multipart/form-data body with the audio in `file`",
        ));
    }
    let parts = crate::forms::read(&request, payload, &["file"], gateway.max_upload_bytes).await?;
    let mut file = None;
    let mut fields = Map::new();
    let mut granularities = Vec::new();
    for part in parts {
        match part.name.as_str() {
            "file" => file = Some(part),
            "timestamp_granularities[]" | "timestamp_granularities" => {
                granularities.push(part.text());
            }
            name => {
                fields.insert(name.to_owned(), Value::String(part.text()));
            }
        }
    }
    let mut details = Details::new();
    let mut members = Members {
        body: &fields,
        details: &mut details,
    };
    let model_id = members.text("model", 1, 256);
    let format = members.choice(
        "response_format",
        &["json", "text", "verbose_json", "srt", "vtt"],
    );
    let timestamps = match fields.get("timestamps").and_then(Value::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => {
            details.push(&["timestamps"], "Expected boolean");
            false
        }
    };
    let mut members = Members {
        body: &fields,
        details: &mut details,
    };
    let language = members.text("language", 2, 32);
    let prompt = members.text("prompt", 0, 4096);
    let temperature = fields
        .get("temperature")
        .and_then(Value::as_str)
        .map(|t| t.parse::<f64>().ok().filter(|t| (0.0..=1.0).contains(t)));
    if let Some(None) = temperature {
        details.push(&["temperature"], "Expected a number from 0 to 1");
    }
    if let Some(bad) = granularities
        .iter()
        .find(|g| !matches!(g.as_str(), "segment" | "word"))
    {
        details.push(
            &["timestamp_granularities"],
            format!("Invalid enum value. Expected 'segment' | 'word', received '{bad}'"),
        );
    }
    let Some(file) = file.filter(|f| !f.bytes.is_empty()) else {
        details.push(&["file"], "Required: the audio file");
        return Err(ApiError::validation(details));
    };
    details.into_result()?;
    let transcript = match format.as_deref() {
        Some("text") => Transcript::Text,
        Some("verbose_json") => Transcript::VerboseJson,
        Some("srt") => Transcript::Srt,
        Some("vtt") => Transcript::Vtt,
        _ => Transcript::Json,
    };
    let words = timestamps || granularities.iter().any(|g| g == "word");
    let model = &media::model_of(&gateway, model_id.as_deref(), &["asr"], false)?;
    let per_second = model.config.usd_per_audio_second;
    let measured = wav_seconds(&file.bytes);
    let bound = measured
        .unwrap_or_else(|| Decimal::from((file.bytes.len() as u64).div_ceil(MIN_BYTES_PER_SECOND)));
    // At least a second: a hold of nothing would settle nothing.
    let most = media::nanos(per_second, bound.ceil().max(Decimal::ONE));
    let mut upstream = Map::new();
    upstream.insert("response_format".into(), json!("verbose_json"));
    let mut asked = vec![json!("segment")];
    if words {
        asked.push(json!("word"));
    }
    upstream.insert("timestamp_granularities[]".into(), Value::Array(asked));
    media::insert_present(
        &mut upstream,
        [
            ("language", language),
            ("prompt", prompt),
            ("temperature", temperature.flatten().map(|t| t.to_string())),
        ],
    );
    let upload = router_pb::MediaFile {
        field: "file".to_owned(),
        filename: file
            .filename
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "audio".to_owned()),
        content_type: file
            .media_type
            .clone()
            .unwrap_or_else(|| "application/octet-stream".to_owned()),
        data: file.bytes,
    };
    let mut metered = media::meter(&gateway, &request, &principal, model, most).await?;
    let task_gateway = gateway.clone();
    let (answer, seconds, charged) = media::detached(async move {
        let delivered = metered
            .call(
                &task_gateway,
                "/audio/transcriptions",
                &upstream,
                vec![upload],
            )
            .await?;
        let Some(answer) = serde_json::from_slice::<Value>(&delivered.body)
            .ok()
            .filter(|a| a.get("text").is_some_and(Value::is_string))
        else {
            return Err(metered.unusable("no text"));
        };
        // A length the backend reports must be one: finite and not negative
        // (some send -1 for unknown); float noise is cut to the millisecond.
        let reported = answer
            .get("duration")
            .and_then(Value::as_f64)
            .filter(|d| d.is_finite() && *d >= 0.0)
            .and_then(Decimal::from_f64_retain)
            .map(|d| d.round_dp(3))
            .or_else(|| {
                answer
                    .pointer("/usage/seconds")
                    .and_then(Value::as_u64)
                    .map(Decimal::from)
            });
        let Some(seconds) = reported.or(measured) else {
            return Err(metered.unusable("no duration for a file of unknown length"));
        };
        let used = media::nanos(per_second, seconds.ceil());
        let charged = metered.bill(&delivered, used).await?;
        Ok((answer, seconds, charged))
    })
    .await?;
    let mut response = charged.response(&gateway, model);
    let text = answer["text"]
        .as_str()
        .unwrap_or_default()
        .trim()
        .to_owned();
    let segments = spans(&answer, "segments", "text");
    Ok(match transcript {
        Transcript::Text => response
            .content_type("text/plain; charset=utf-8")
            .body(text),
        Transcript::VerboseJson => response.json(answer),
        Transcript::Srt => response
            .content_type("text/plain; charset=utf-8")
            .body(subtitles(&segments, false)),
        Transcript::Vtt => response
            .content_type("text/vtt; charset=utf-8")
            .body(subtitles(&segments, true)),
        Transcript::Json => {
            let duration = seconds.normalize();
            let mut body = json!({
                "text": text,
                "duration": serde_json::from_str::<Value>(&duration.to_string()).unwrap_or(json!(0)),
            });
            if timestamps {
                let segment: Vec<Value> = segments
                    .iter()
                    .map(|s| json!({"text": s.text, "start": s.start, "end": s.end}))
                    .collect();
                let word: Vec<Value> = spans(&answer, "words", "word")
                    .iter()
                    .map(|w| json!({"word": w.text, "start": w.start, "end": w.end}))
                    .collect();
                body["timestamps"] = json!({"segment": segment, "word": word});
            }
            response.json(body)
        }
    })
}

/// A timed piece of a transcript (a segment or a word).
struct Span {
    text: String,
    start: f64,
    end: f64,
}

/// The `list` of a verbose answer (`segments`, `words`), each item's
/// `field` text and times.
fn spans(answer: &Value, list: &str, field: &str) -> Vec<Span> {
    answer
        .get(list)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|item| {
            Some(Span {
                text: item.get(field)?.as_str()?.trim().to_owned(),
                start: item.get("start")?.as_f64()?,
                end: item.get("end")?.as_f64()?,
            })
        })
        .collect()
}

/// SubRip (`vtt`: WebVTT) subtitles of the segments.
fn subtitles(segments: &[Span], vtt: bool) -> String {
    let time = |seconds: f64| {
        let ms = (seconds.max(0.0) * 1000.0).round() as u64;
        let (h, m, s, ms) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
        let mark = if vtt { '.' } else { ',' };
        format!("{h:02}:{m:02}:{s:02}{mark}{ms:03}")
    };
    let mut out = String::new();
    if vtt {
        out.push_str("WEBVTT\n\n");
    }
    for (index, segment) in segments.iter().enumerate() {
        if !vtt {
            out.push_str(&format!("{}\n", index + 1));
        }
        out.push_str(&format!(
            "{} --> {}\n{}\n\n",
            time(segment.start),
            time(segment.end),
            segment.text
        ));
    }
    out
}

/// The length of a WAV file: its header's, but never more than the bytes
/// sent can hold (a streamed recording declares 0, or the largest length,
/// and a backend reads to the end of the file).
fn wav_seconds(bytes: &[u8]) -> Option<Decimal> {
    let reader = hound::WavReader::new(std::io::Cursor::new(bytes)).ok()?;
    let spec = reader.spec();
    let frame_bytes = u64::from(spec.channels) * u64::from(spec.bits_per_sample).div_ceil(8);
    if spec.sample_rate == 0 || frame_bytes == 0 {
        return None;
    }
    let declared = u64::from(reader.duration());
    // The reader stands at the first sample: what follows is the data.
    let data_offset = reader.into_inner().position();
    let present = (bytes.len() as u64).saturating_sub(data_offset) / frame_bytes;
    let frames = if declared == 0 || declared > present {
        present
    } else {
        declared
    };
    Some(Decimal::from(frames) / Decimal::from(spec.sample_rate))
}

#[derive(Deserialize)]
pub struct VoicesQuery {
    model: Option<String>,
}

/// `GET /audio/voices[?model=]`: the voices of the speech models.
pub async fn voices(
    gateway: web::Data<Gateway>,
    query: web::Query<VoicesQuery>,
) -> Result<HttpResponse, ApiError> {
    if let Some(id) = &query.model {
        media::model_of(&gateway, Some(id), &["tts"], false)?;
    }
    let data: Vec<Value> = gateway
        .catalog()
        .models
        .iter()
        .map(|m| &m.config)
        .filter(|m| m.model_type == "tts")
        .filter(|m| query.model.as_ref().is_none_or(|id| *id == m.id))
        .flat_map(|m| {
            m.voices
                .iter()
                .map(|voice| json!({"id": voice, "object": "voice", "model": m.id}))
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wav(seconds: u32, rate: u32) -> Vec<u8> {
        let spec = hound::WavSpec {
            channels: 1,
            sample_rate: rate,
            bits_per_sample: 16,
            sample_format: hound::SampleFormat::Int,
        };
        let mut out = std::io::Cursor::new(Vec::new());
        let mut writer = hound::WavWriter::new(&mut out, spec).unwrap();
        for _ in 0..seconds * rate {
            writer.write_sample(0i16).unwrap();
        }
        writer.finalize().unwrap();
        out.into_inner()
    }

    #[test]
    fn a_wav_measures_its_own_length() {
        assert_eq!(wav_seconds(&wav(3, 8000)), Some(Decimal::from(3)));
        assert_eq!(wav_seconds(b"ID3 not a wav"), None);
    }

    #[test]
    fn a_wav_is_as_long_as_its_bytes_whatever_its_header_declares() {
        // The data chunk's length (bytes 40..44 of this canonical header).
        let mut streamed = wav(3, 8000);
        streamed[40..44].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(wav_seconds(&streamed), Some(Decimal::from(3)));
        // A length past the file: refused by the reader (then the size
        // bound holds), never taken at its word.
        let mut inflated = wav(3, 8000);
        inflated[40..44].copy_from_slice(&(u32::MAX - 1).to_le_bytes());
        assert!(wav_seconds(&inflated).is_none_or(|s| s <= Decimal::from(3)));
        // Cut short: only what was sent counts.
        let whole = wav(4, 8000);
        assert_eq!(wav_seconds(&whole[..44 + 2 * 8000]), Some(Decimal::from(1)));
    }

    #[test]
    fn audio_is_told_by_its_first_bytes() {
        assert!(is_audio("wav", &wav(1, 8000)));
        assert!(!is_audio("wav", b"{\"error\": 1}"));
        assert!(is_audio("mp3", b"ID3\x04rest"));
        assert!(is_audio("flac", b"fLaCrest"));
        assert!(!is_audio("flac", b"OggS"));
        assert!(is_audio("pcm", &[0, 1, 2]));
        assert!(!is_audio("pcm", &[]));
    }

    #[test]
    fn subtitles_number_and_time_the_segments() {
        let segments = [
            Span {
                text: "Hello there.".into(),
                start: 0.0,
                end: 1.5,
            },
            Span {
                text: "Bye.".into(),
                start: 61.25,
                end: 3723.004,
            },
        ];
        assert_eq!(
            subtitles(&segments, false),
            "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n\
             2\n00:01:01,250 --> 01:02:03,004\nBye.\n\n"
        );
        assert!(
            subtitles(&segments, true).starts_with("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\n")
        );
    }
}
