//! Prompt and generation speed of a GGUF chat model in Rialto's engine,
//! for BENCHMARKS.md: `cargo run --release -p rialto-local --example
//! tokens_per_second -- [model.gguf] [repetitions]`.
//!
//! Each repetition sends a ~48-token prompt whose system message differs
//! from the last one's (so the KV cache reuses almost nothing) and
//! generates exactly 64 tokens greedily, like `llama-bench -p 48 -n 64`.
//! Prints one JSON object.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use rialto_local::{ChatModel, ChatOptions, Event, Generation, Message};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .unwrap_or_else(|| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let repetitions: usize = args.next().map_or(5, |n| n.parse().expect("repetitions"));
    let model = ChatModel::load(ChatOptions {
        path: path.clone().into(),
        threads: None,
        context_size: Some(2048),
        max_queue: 1,
        reader_lag: rialto_local::DEFAULT_READER_LAG,
    })
    .expect("load the model");
    let mut prompt = Vec::new();
    let mut generation = Vec::new();
    let mut prompt_tokens = 0;
    // The first run warms caches and is not counted.
    for rep in 0..=repetitions {
        let request = Generation {
            messages: vec![
                Message {
                    role: "system".into(),
                    content: format!("{rep} You are a helpful assistant who answers questions about science."),
                },
                Message {
                    role: "user".into(),
                    content: "Explain in a few sentences why the sky looks blue during the day and red at sunset.".into(),
                },
            ],
            // Never stop early: the length is the measure.
            max_tokens: Some(64),
            temperature: 0.0,
            top_p: 1.0,
            stop: Vec::new(),
            seed: None,
        };
        let mut events = model.generate(request).expect("queue");
        while let Some(event) = events.recv().await {
            if let Event::Done {
                prompt_tokens: p,
                completion_tokens,
                cached_tokens,
                timings,
                ..
            } = event
                && rep > 0
            {
                let evaluated = f64::from(p - cached_tokens);
                prompt.push(evaluated / (timings.prompt_ms / 1e3));
                generation.push(f64::from(completion_tokens) / (timings.generation_ms / 1e3));
                prompt_tokens = p - cached_tokens;
            }
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    println!(
        "{}",
        serde_json::json!({
            "model": path,
            "threads": std::thread::available_parallelism().map_or(1, usize::from),
            "repetitions": repetitions,
            "prompt_tokens_evaluated": prompt_tokens,
            "generated_tokens": 64,
            "prompt_tokens_per_second": (mean(&prompt) * 10.0).round() / 10.0,
            "generation_tokens_per_second": (mean(&generation) * 10.0).round() / 10.0,
        })
    );
}
