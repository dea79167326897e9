//! `bench-upstream`: a fast OpenAI-compatible mock upstream for benchmarks.
//!
//! Every chat completion gets the same precomputed answer of `--words` words
//! after `--latency-ms`; a request with `"stream": true` gets `--chunks`
//! content chunks `--chunk-delay-ms` apart, a usage chunk and `[DONE]`.
//! `/images/generations` answers one 256x256 PNG (base64 in JSON) and
//! `/audio/speech` one second of WAV, both made once at start.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http_body_util::channel::Channel;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::json;

#[derive(Parser, Clone)]
#[command(about = "Fast OpenAI-compatible mock upstream for benchmarks")]
struct Args {
    #[arg(long, default_value = "127.0.0.1:18999")]
    listen: SocketAddr,
    /// Fixed delay before each answer (and before a stream's first chunk).
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    /// Words in the answer.
    #[arg(long, default_value_t = 16)]
    words: usize,
    /// Content chunks in a stream.
    #[arg(long, default_value_t = 16)]
    chunks: usize,
    /// Delay between stream chunks.
    #[arg(long, default_value_t = 0)]
    chunk_delay_ms: u64,
    /// Runtime worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

/// Everything sent is computed once.
struct Answers {
    completion: Bytes,
    /// `{created, data: [{b64_json}]}` of a 256x256 PNG.
    image: Bytes,
    /// One second of 24 kHz 16-bit mono WAV.
    speech: Bytes,
    chunks: Vec<Bytes>,
    tail: Bytes,
    latency: Duration,
    chunk_delay: Duration,
}

fn answers(args: &Args) -> anyhow::Result<Answers> {
    let text: Vec<String> = (1..=args.words.max(1)).map(|i| format!("w{i}")).collect();
    let content = text.join(" ");
    let usage = json!({"prompt_tokens": 8, "completion_tokens": args.words, "total_tokens": 8 + args.words});
    let completion = serde_json::to_vec(&json!({
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1_800_000_000u64,
        "model": "bench-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "logprobs": null, "finish_reason": "stop"}],
        "usage": usage,
    }))?;
    let chunk_count = args.chunks.max(1);
    let per_chunk = text.len().div_ceil(chunk_count).max(1);
    let mut chunks = Vec::with_capacity(chunk_count);
    for i in 0..chunk_count {
        let words: Vec<&str> = text
            .iter()
            .skip(i * per_chunk)
            .take(per_chunk)
            .map(String::as_str)
            .collect();
        let mut piece = words.join(" ");
        if i + 1 < chunk_count {
            piece.push(' ');
        }
        let delta = if i == 0 {
            json!({"role": "assistant", "content": piece})
        } else {
            json!({"content": piece})
        };
        chunks.push(sse(&json!({
            "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1_800_000_000u64,
            "model": "bench-model",
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}],
        }))?);
    }
    let mut tail = sse(&json!({
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1_800_000_000u64,
        "model": "bench-model",
        "choices": [{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"}],
    }))?
    .to_vec();
    tail.extend_from_slice(&sse(&json!({
        "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1_800_000_000u64,
        "model": "bench-model", "choices": [], "usage": usage,
    }))?);
    tail.extend_from_slice(b"data: [DONE]\n\n");
    Ok(Answers {
        completion: Bytes::from(completion),
        image: Bytes::from(image_answer()?),
        speech: Bytes::from(speech_answer()?),
        chunks,
        tail: Bytes::from(tail),
        latency: Duration::from_millis(args.latency_ms),
        chunk_delay: Duration::from_millis(args.chunk_delay_ms),
    })
}

/// An image generation's answer: one 256x256 PNG of a gradient.
fn image_answer() -> anyhow::Result<Vec<u8>> {
    use base64::Engine as _;
    let image = image::RgbImage::from_fn(256, 256, |x, y| image::Rgb([x as u8, y as u8, 128]));
    let mut png = std::io::Cursor::new(Vec::new());
    image.write_to(&mut png, image::ImageFormat::Png)?;
    let b64 = base64::engine::general_purpose::STANDARD.encode(png.into_inner());
    Ok(serde_json::to_vec(
        &json!({"created": 1_800_000_000u64, "data": [{"b64_json": b64}]}),
    )?)
}

/// A speech answer: one second of a 440 Hz tone.
fn speech_answer() -> anyhow::Result<Vec<u8>> {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 24_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut wav = std::io::Cursor::new(Vec::new());
    let mut writer = hound::WavWriter::new(&mut wav, spec)?;
    for n in 0..24_000u32 {
        let phase = n as f32 * 440.0 * std::f32::consts::TAU / 24_000.0;
        writer.write_sample((phase.sin() * 8_000.0) as i16)?;
    }
    writer.finalize()?;
    Ok(wav.into_inner())
}

fn sse(value: &serde_json::Value) -> anyhow::Result<Bytes> {
    let mut line = b"data: ".to_vec();
    serde_json::to_writer(&mut line, value)?;
    line.extend_from_slice(b"\n\n");
    Ok(Bytes::from(line))
}

type Body = BoxBody<Bytes, Infallible>;

async fn handle(
    request: Request<Incoming>,
    answers: &'static Answers,
) -> Result<Response<Body>, Infallible> {
    let path = request.uri().path().to_owned();
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    if path.ends_with("/images/generations") {
        return Ok(typed_response("application/json", answers.image.clone()));
    }
    if path.ends_with("/audio/speech") {
        return Ok(typed_response("audio/wav", answers.speech.clone()));
    }
    if !path.ends_with("/chat/completions") {
        let models = r#"{"object":"list","data":[{"id":"bench-model","object":"model","created":0,"owned_by":"bench"}]}"#;
        return Ok(json_response(Bytes::from_static(models.as_bytes())));
    }
    if !answers.latency.is_zero() {
        tokio::time::sleep(answers.latency).await;
    }
    if !rialto_bench::wants_stream(&body) {
        return Ok(json_response(answers.completion.clone()));
    }
    let (mut sender, body) = Channel::<Bytes, Infallible>::new(8);
    tokio::spawn(async move {
        for (i, chunk) in answers.chunks.iter().enumerate() {
            if i > 0 && !answers.chunk_delay.is_zero() {
                tokio::time::sleep(answers.chunk_delay).await;
            }
            if sender.send_data(chunk.clone()).await.is_err() {
                return;
            }
        }
        let _ = sender.send_data(answers.tail.clone()).await;
    });
    let response = Response::builder()
        .header("content-type", "text/event-stream")
        .body(BodyExt::boxed(body))
        .unwrap_or_else(|_| Response::new(empty()));
    Ok(response)
}

fn empty() -> Body {
    BodyExt::boxed(Full::new(Bytes::new()))
}

fn json_response(body: Bytes) -> Response<Body> {
    typed_response("application/json", body)
}

fn typed_response(content_type: &str, body: Bytes) -> Response<Body> {
    Response::builder()
        .header("content-type", content_type)
        .body(BodyExt::boxed(Full::new(body)))
        .unwrap_or_else(|_| Response::new(empty()))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let answers: &'static Answers = Box::leak(Box::new(answers(&args)?));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = rialto_bench::listen(args.listen)?;
        println!(
            "bench-upstream listening on http://{}/v1",
            listener.local_addr()?
        );
        loop {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = service_fn(move |request| handle(request, answers));
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}
