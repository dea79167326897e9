//! Asks the built-in chat model one question and prints the answer with
//! its token counts and speed: `cargo run --release -p rialto-local
//! --example ask -- "Your question"`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use rialto_local::{ChatModel, ChatOptions, Event, Generation, Message};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let question = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "What is the capital of France?".into());
    let path = std::env::var("RIALTO_CHAT_MODEL")
        .unwrap_or_else(|_| "models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let model = ChatModel::load(ChatOptions {
        path: path.into(),
        threads: None,
        context_size: Some(2048),
        max_queue: 1,
        reader_lag: rialto_local::DEFAULT_READER_LAG,
    })
    .expect("load the model");
    let generation = Generation {
        messages: vec![Message {
            role: "user".into(),
            content: question,
        }],
        max_tokens: Some(64),
        temperature: 0.0,
        top_p: 1.0,
        stop: Vec::new(),
        seed: None,
    };
    let started = std::time::Instant::now();
    let mut events = model.generate(generation).expect("queue");
    while let Some(event) = events.recv().await {
        match event {
            Event::Text(text) => print!("{text}"),
            other => println!("\n{other:?} in {:?}", started.elapsed()),
        }
    }
}
