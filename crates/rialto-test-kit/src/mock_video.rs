//! The mock upstream's video calls: OpenAI's video API, answered with real MP4 files.
//!
//! - `POST /v1/videos` (JSON `{model, prompt, seconds, size}`): a job, `{"id", "object":
//!   "video", "status": "queued", ...}`. It is `in_progress` until `seconds` × 100 ms have passed
//!   since it was created (× 1 s when the prompt holds `[slow]`), `progress` growing with the
//!   time, then `completed`; a prompt with the word `forbidden` ends `failed` with OpenAI's
//!   `moderation_blocked` error instead.
//! - `GET /v1/videos/{id}`: the job as it is now; an unknown id is a `404`.
//! - `GET /v1/videos/{id}/content`: the video, once completed, as `video/mp4`.
//!
//! The video is an H.264 stream in an MP4 file, `seconds` long at [`FPS`] frames a second, of
//! `size` (each side even, 16 to 1920): one IDR frame whose macroblocks are raw samples (I_PCM: a
//! picture without a real encoder, which every decoder reads) coloured by a hash of the prompt,
//! and P frames that skip every macroblock (the picture holds). It is encoded at request time:
//! no fixture.
//!
//! Requests are recorded like the other calls (a `GET` with a `null` body), and
//! [`MockUpstream::fail_next`](crate::MockUpstream::fail_next) fails them as it fails others.

use std::collections::HashMap;
use std::io::Cursor;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use serde_json::{Value, json};

use crate::mock_upstream::{State, unix_now};

/// Frames per second of the mock's videos.
pub const FPS: u32 = 8;
/// How long the mock takes per second of video (× 10 with `[slow]`).
const MAKING_PER_SECOND: Duration = Duration::from_millis(100);

/// One video job.
#[derive(Clone)]
pub(crate) struct VideoJob {
    created: Instant,
    created_at: u64,
    model: String,
    prompt: String,
    seconds: u32,
    width: u32,
    height: u32,
    making: Duration,
}

/// The mock's video jobs by id.
#[derive(Default)]
pub(crate) struct Videos(Mutex<HashMap<String, VideoJob>>);

impl Videos {
    fn get(&self, id: &str) -> Option<VideoJob> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
    }

    fn insert(&self, id: String, job: VideoJob) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, job);
    }

    /// Jobs created so far.
    pub(crate) fn count(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

fn refusal(status: StatusCode, param: Option<&str>, code: &str, message: &str) -> HttpResponse {
    HttpResponse::build(status).json(json!({"error": {
        "message": message, "type": "invalid_request_error", "code": code, "param": param}}))
}

/// `WxH`, each side even and 16 to 1920.
fn frame_size(size: &str) -> Option<(u32, u32)> {
    let (w, h) = size.split_once('x')?;
    let (w, h): (u32, u32) = (w.parse().ok()?, h.parse().ok()?);
    let fits = |side: u32| (16..=1920).contains(&side) && side.is_multiple_of(2);
    (fits(w) && fits(h)).then_some((w, h))
}

/// `POST /v1/videos`.
pub(crate) async fn create(
    req: HttpRequest,
    raw: web::Bytes,
    state: web::Data<State>,
) -> HttpResponse {
    let body: Value = match serde_json::from_slice(&raw) {
        Ok(body) => body,
        Err(e) => {
            return refusal(
                StatusCode::BAD_REQUEST,
                None,
                "invalid_json",
                &e.to_string(),
            );
        }
    };
    if let Some(failure) = state.record_or_fail(&req, body.clone()) {
        return failure;
    }
    let Some(prompt) = body["prompt"].as_str().filter(|p| !p.is_empty()) else {
        return refusal(
            StatusCode::BAD_REQUEST,
            Some("prompt"),
            "missing_required_parameter",
            "prompt is required",
        );
    };
    let seconds = match &body["seconds"] {
        Value::Null => 4,
        Value::String(text) => text.parse().unwrap_or(0),
        Value::Number(n) => n.as_u64().unwrap_or(0) as u32,
        _ => 0,
    };
    if !(1..=60).contains(&seconds) {
        return refusal(
            StatusCode::BAD_REQUEST,
            Some("seconds"),
            "invalid_value",
            "seconds must be 1 to 60",
        );
    }
    let Some((width, height)) = frame_size(body["size"].as_str().unwrap_or("1280x720")) else {
        return refusal(
            StatusCode::BAD_REQUEST,
            Some("size"),
            "invalid_value",
            "size must be WxH, even sides of 16 to 1920",
        );
    };
    let slow = if prompt.contains("[slow]") { 10 } else { 1 };
    let job = VideoJob {
        created: Instant::now(),
        created_at: unix_now(),
        model: body["model"].as_str().unwrap_or("mock-video").to_owned(),
        prompt: prompt.to_owned(),
        seconds,
        width,
        height,
        making: MAKING_PER_SECOND * seconds * slow,
    };
    let id = format!("video_{}", uuid::Uuid::new_v4().simple());
    let answer = status_of(&id, &job);
    state.videos.insert(id, job);
    HttpResponse::Ok().json(answer)
}

fn status_of(id: &str, job: &VideoJob) -> Value {
    let elapsed = job.created.elapsed();
    let done = elapsed >= job.making;
    let forbidden = job
        .prompt
        .split(|c: char| !c.is_alphanumeric())
        .any(|w| w.eq_ignore_ascii_case("forbidden"));
    let progress = if done {
        100
    } else {
        (elapsed.as_millis() * 100 / job.making.as_millis().max(1)) as u64
    };
    let status = match (done, forbidden) {
        (true, true) => "failed",
        (true, false) => "completed",
        (false, _) if progress == 0 => "queued",
        (false, _) => "in_progress",
    };
    let mut answer = json!({
        "id": id,
        "object": "video",
        "model": job.model,
        "status": status,
        "progress": progress,
        "created_at": job.created_at,
        "seconds": job.seconds.to_string(),
        "size": format!("{}x{}", job.width, job.height),
    });
    if status == "failed" {
        answer["error"] = json!({"code": "moderation_blocked",
            "message": "Your request was rejected by the safety system."});
    }
    if done {
        answer["completed_at"] = json!(job.created_at + job.making.as_secs());
    }
    answer
}

/// `GET /v1/videos/{id}`.
pub(crate) async fn retrieve(
    req: HttpRequest,
    id: web::Path<String>,
    state: web::Data<State>,
) -> HttpResponse {
    if let Some(failure) = state.record_or_fail(&req, Value::Null) {
        return failure;
    }
    match state.videos.get(&id) {
        Some(job) => HttpResponse::Ok().json(status_of(&id, &job)),
        None => refusal(StatusCode::NOT_FOUND, None, "not_found", "no such video"),
    }
}

/// `GET /v1/videos/{id}/content`.
pub(crate) async fn content(
    req: HttpRequest,
    id: web::Path<String>,
    state: web::Data<State>,
) -> HttpResponse {
    if let Some(failure) = state.record_or_fail(&req, Value::Null) {
        return failure;
    }
    let Some(job) = state.videos.get(&id) else {
        return refusal(StatusCode::NOT_FOUND, None, "not_found", "no such video");
    };
    if status_of(&id, &job)["status"] != "completed" {
        return refusal(
            StatusCode::BAD_REQUEST,
            None,
            "video_not_ready",
            "the video is not completed",
        );
    }
    let shade = crate::mock_media::fnv1a(&[job.prompt.as_bytes()]);
    match mp4(job.width, job.height, job.seconds, shade) {
        Ok(bytes) => HttpResponse::Ok().content_type("video/mp4").body(bytes),
        Err(error) => refusal(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            "mock_internal_error",
            &error,
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// H.264 (Baseline, CAVLC) without an encoder
// ---------------------------------------------------------------------------------------------

/// Bits of an RBSP, most significant first.
#[derive(Default)]
struct Bits {
    bytes: Vec<u8>,
    used: u32,
}

impl Bits {
    fn bit(&mut self, one: bool) {
        if self.used.is_multiple_of(8) {
            self.bytes.push(0);
        }
        if one {
            let last = self.bytes.len() - 1;
            self.bytes[last] |= 0x80 >> (self.used % 8);
        }
        self.used += 1;
    }

    /// `u(n)`.
    fn u(&mut self, n: u32, value: u32) {
        for i in (0..n).rev() {
            self.bit(value >> i & 1 == 1);
        }
    }

    /// `ue(v)`: Exp-Golomb.
    fn ue(&mut self, value: u32) {
        let coded = value + 1;
        let length = 32 - coded.leading_zeros();
        self.u(length - 1, 0);
        self.u(length, coded);
    }

    /// `se(v)` of zero (the only signed value written here).
    fn se_zero(&mut self) {
        self.ue(0);
    }

    fn aligned(&self) -> bool {
        self.used.is_multiple_of(8)
    }

    fn align_zero(&mut self) {
        while !self.aligned() {
            self.bit(false);
        }
    }

    fn byte(&mut self, byte: u8) {
        debug_assert!(self.aligned());
        self.bytes.push(byte);
        self.used += 8;
    }

    /// `rbsp_trailing_bits`.
    fn trailing(mut self) -> Vec<u8> {
        self.bit(true);
        self.align_zero();
        self.bytes
    }
}

/// A NAL unit: its header byte and the RBSP with emulation prevention.
fn nal(ref_idc: u8, kind: u8, rbsp: &[u8]) -> Vec<u8> {
    let mut unit = vec![ref_idc << 5 | kind];
    let mut zeros = 0;
    for &byte in rbsp {
        if zeros >= 2 && byte <= 3 {
            unit.push(3);
            zeros = 0;
        }
        unit.push(byte);
        zeros = if byte == 0 { zeros + 1 } else { 0 };
    }
    unit
}

/// Frame numbers are 4 bits (`log2_max_frame_num_minus4 = 0`).
const FRAME_NUM_BITS: u32 = 4;

fn sps(width: u32, height: u32) -> Vec<u8> {
    let (mbs_wide, mbs_high) = (width.div_ceil(16), height.div_ceil(16));
    let mut b = Bits::default();
    b.u(8, 66); // profile_idc: Baseline
    b.u(8, 0b1100_0000); // constraint_set0 and 1: decodable by Baseline and Main
    b.u(8, 40); // level 4.0
    b.ue(0); // seq_parameter_set_id
    b.ue(FRAME_NUM_BITS - 4); // log2_max_frame_num_minus4
    b.ue(2); // pic_order_cnt_type: output order is decoding order
    b.ue(1); // max_num_ref_frames
    b.bit(false); // gaps_in_frame_num_value_allowed_flag
    b.ue(mbs_wide - 1);
    b.ue(mbs_high - 1);
    b.bit(true); // frame_mbs_only_flag
    b.bit(true); // direct_8x8_inference_flag
    let (crop_right, crop_bottom) = ((mbs_wide * 16 - width) / 2, (mbs_high * 16 - height) / 2);
    let cropped = crop_right > 0 || crop_bottom > 0;
    b.bit(cropped);
    if cropped {
        b.ue(0);
        b.ue(crop_right);
        b.ue(0);
        b.ue(crop_bottom);
    }
    b.bit(false); // vui_parameters_present_flag
    nal(3, 7, &b.trailing())
}

fn pps() -> Vec<u8> {
    let mut b = Bits::default();
    b.ue(0); // pic_parameter_set_id
    b.ue(0); // seq_parameter_set_id
    b.bit(false); // entropy_coding_mode_flag: CAVLC
    b.bit(false); // bottom_field_pic_order_in_frame_present_flag
    b.ue(0); // num_slice_groups_minus1
    b.ue(0); // num_ref_idx_l0_default_active_minus1
    b.ue(0); // num_ref_idx_l1_default_active_minus1
    b.bit(false); // weighted_pred_flag
    b.u(2, 0); // weighted_bipred_idc
    b.se_zero(); // pic_init_qp_minus26
    b.se_zero(); // pic_init_qs_minus26
    b.se_zero(); // chroma_qp_index_offset
    b.bit(false); // deblocking_filter_control_present_flag
    b.bit(false); // constrained_intra_pred_flag
    b.bit(false); // redundant_pic_cnt_present_flag
    nal(3, 8, &b.trailing())
}

/// The IDR picture: every macroblock I_PCM, a luma gradient and chroma from `shade`.
fn idr(width: u32, height: u32, shade: u64) -> Vec<u8> {
    let (mbs_wide, mbs_high) = (width.div_ceil(16), height.div_ceil(16));
    let (cb, cr) = (64 + (shade & 0x7F) as u8, 64 + (shade >> 8 & 0x7F) as u8);
    let mut b = Bits::default();
    b.ue(0); // first_mb_in_slice
    b.ue(7); // slice_type: I (all slices)
    b.ue(0); // pic_parameter_set_id
    b.u(FRAME_NUM_BITS, 0); // frame_num
    b.ue(0); // idr_pic_id
    b.bit(false); // no_output_of_prior_pics_flag
    b.bit(false); // long_term_reference_flag
    b.se_zero(); // slice_qp_delta
    for mb_y in 0..mbs_high {
        for mb_x in 0..mbs_wide {
            b.ue(25); // mb_type: I_PCM
            b.align_zero();
            for y in 0..16 {
                for x in 0..16 {
                    let (px, py) = (mb_x * 16 + x, mb_y * 16 + y);
                    // Never 0: early decoders refuse a PCM sample of 0.
                    let luma = 16 + ((px * 200 / width.max(1) + py * 20 / height.max(1)) % 220);
                    b.byte(luma as u8);
                }
            }
            for value in [cb, cr] {
                for _ in 0..64 {
                    b.byte(value);
                }
            }
        }
    }
    nal(3, 5, &b.trailing())
}

/// A P picture that skips every macroblock: the previous picture again.
fn skipped(width: u32, height: u32, frame_num: u32) -> Vec<u8> {
    let macroblocks = width.div_ceil(16) * height.div_ceil(16);
    let mut b = Bits::default();
    b.ue(0); // first_mb_in_slice
    b.ue(5); // slice_type: P (all slices)
    b.ue(0); // pic_parameter_set_id
    b.u(FRAME_NUM_BITS, frame_num % (1 << FRAME_NUM_BITS));
    b.bit(false); // num_ref_idx_active_override_flag
    b.bit(false); // ref_pic_list_modification_flag_l0
    b.bit(false); // adaptive_ref_pic_marking_mode_flag
    b.se_zero(); // slice_qp_delta
    b.ue(macroblocks); // mb_skip_run
    nal(2, 1, &b.trailing())
}

/// An MP4 of `seconds` of `width`x`height` video (see the module's doc).
pub fn mp4(width: u32, height: u32, seconds: u32, shade: u64) -> Result<Vec<u8>, String> {
    let config = mp4::Mp4Config {
        major_brand: str::parse("isom").map_err(|e| format!("{e}"))?,
        minor_version: 512,
        compatible_brands: ["isom", "iso2", "avc1", "mp41"]
            .iter()
            .map(|brand| str::parse(brand))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{e}"))?,
        timescale: 1000,
    };
    let mut writer =
        mp4::Mp4Writer::write_start(Cursor::new(Vec::new()), &config).map_err(|e| e.to_string())?;
    let track = mp4::TrackConfig {
        track_type: mp4::TrackType::Video,
        timescale: FPS * 100,
        language: "und".to_owned(),
        media_conf: mp4::MediaConfig::AvcConfig(mp4::AvcConfig {
            width: u16::try_from(width).map_err(|e| e.to_string())?,
            height: u16::try_from(height).map_err(|e| e.to_string())?,
            seq_param_set: sps(width, height),
            pic_param_set: pps(),
        }),
    };
    writer.add_track(&track).map_err(|e| e.to_string())?;
    // AVCC samples: each NAL unit after its 4-byte length.
    let sample = |unit: Vec<u8>| {
        let mut bytes = (unit.len() as u32).to_be_bytes().to_vec();
        bytes.extend_from_slice(&unit);
        bytes
    };
    for frame in 0..seconds * FPS {
        let (unit, is_sync) = if frame == 0 {
            (idr(width, height, shade), true)
        } else {
            (skipped(width, height, frame), false)
        };
        writer
            .write_sample(
                1,
                &mp4::Mp4Sample {
                    start_time: u64::from(frame) * 100,
                    duration: 100,
                    rendering_offset: 0,
                    is_sync,
                    bytes: sample(unit).into(),
                },
            )
            .map_err(|e| e.to_string())?;
    }
    writer.write_end().map_err(|e| e.to_string())?;
    Ok(writer.into_writer().into_inner())
}

/// What an MP4 holds, read back with the `mp4` crate: (width, height, seconds, frames).
pub fn mp4_summary(bytes: &[u8]) -> Result<(u16, u16, f64, u32), String> {
    let reader = mp4::Mp4Reader::read_header(Cursor::new(bytes), bytes.len() as u64)
        .map_err(|e| e.to_string())?;
    let track = reader
        .tracks()
        .values()
        .find(|t| matches!(t.track_type(), Ok(mp4::TrackType::Video)))
        .ok_or("the MP4 has no video track")?;
    if !matches!(track.media_type(), Ok(mp4::MediaType::H264)) {
        return Err("the video track is not H.264".to_owned());
    }
    Ok((
        track.width(),
        track.height(),
        reader.duration().as_secs_f64(),
        track.sample_count(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_golomb_codes() {
        let mut b = Bits::default();
        for v in [0, 1, 2, 3, 25] {
            b.ue(v);
        }
        // 1 010 011 00100 000011010
        let bits: String = b.bytes.iter().map(|x| format!("{x:08b}")).collect();
        assert!(bits.starts_with("101001100100000011010"), "{bits}");
    }

    #[test]
    fn emulation_prevention_escapes_start_codes() {
        assert_eq!(
            nal(3, 7, &[0, 0, 1, 0, 0, 0]),
            vec![0x67, 0, 0, 3, 1, 0, 0, 3, 0]
        );
    }

    #[test]
    fn an_mp4_reads_back_with_its_size_and_length() {
        let bytes = mp4(256, 144, 2, 7).unwrap();
        assert_eq!(&bytes[4..8], b"ftyp");
        let (w, h, seconds, frames) = mp4_summary(&bytes).unwrap();
        assert_eq!((w, h, frames), (256, 144, 2 * FPS));
        assert!((seconds - 2.0).abs() < 0.01, "{seconds}");
    }
}
