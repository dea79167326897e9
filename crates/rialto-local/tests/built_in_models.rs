//! The built-in models, for real: `make models` (run by `make test`) puts
//! them under ./models/; these tests fail when they are missing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use rialto_local::{
    ChatModel, ChatOptions, EmbeddingModel, EmbeddingOptions, Event, FinishReason, Generation,
    LocalError, Message,
};

fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models")
}

fn chat_model(max_queue: usize) -> ChatModel {
    chat_model_with_lag(max_queue, rialto_local::DEFAULT_READER_LAG)
}

fn chat_model_with_lag(max_queue: usize, reader_lag: usize) -> ChatModel {
    ChatModel::load(ChatOptions {
        path: models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        threads: None,
        context_size: Some(2048),
        max_queue,
        reader_lag,
    })
    .expect("the built-in chat model (run `make models`)")
}

fn ask(question: &str, max_tokens: u32) -> Generation {
    Generation {
        messages: vec![Message {
            role: "user".into(),
            content: question.into(),
        }],
        max_tokens: Some(max_tokens),
        temperature: 0.0,
        top_p: 1.0,
        stop: Vec::new(),
        seed: None,
    }
}

async fn run(model: &ChatModel, generation: Generation) -> (String, Event) {
    let mut events = model.generate(generation).unwrap();
    let mut text = String::new();
    while let Some(event) = events.recv().await {
        match event {
            Event::Text(piece) => text.push_str(&piece),
            done => return (text, done),
        }
    }
    panic!("the generation ended without Done");
}

#[tokio::test]
async fn the_chat_model_answers_a_real_question_coherently() {
    let model = chat_model(4);
    let (answer, done) = run(
        &model,
        ask("What is the capital of France? Answer in one word.", 24),
    )
    .await;
    assert!(answer.contains("Paris"), "answer: {answer:?}");
    let Event::Done {
        prompt_tokens,
        completion_tokens,
        ..
    } = done
    else {
        panic!("{done:?}");
    };
    // The template's default system prompt is part of the prompt.
    assert!(prompt_tokens > 20, "{prompt_tokens}");
    assert!(completion_tokens > 0 && completion_tokens <= 24);
}

#[tokio::test]
async fn max_tokens_stop_and_seed_are_honoured() {
    let model = chat_model(4);
    let (_, done) = run(&model, ask("Count from one to fifty in words.", 5)).await;
    assert!(
        matches!(
            done,
            Event::Done {
                finish_reason: FinishReason::Length,
                completion_tokens: 5,
                ..
            }
        ),
        "{done:?}"
    );

    let mut counting = ask(
        "List the numbers 1, 2, 3, 4, 5, 6, 7, 8 separated by commas.",
        40,
    );
    counting.stop = vec!["4".into()];
    let (text, done) = run(&model, counting).await;
    assert!(!text.contains('4') && !text.contains('5'), "{text:?}");
    assert!(matches!(
        done,
        Event::Done {
            finish_reason: FinishReason::Stop,
            ..
        }
    ));

    let sampled = |seed| {
        let mut generation = ask("Write a sentence about the sea.", 16);
        generation.temperature = 1.0;
        generation.seed = Some(seed);
        generation
    };
    let (first, _) = run(&model, sampled(7)).await;
    let (again, _) = run(&model, sampled(7)).await;
    assert_eq!(first, again, "one seed, one answer");
}

#[tokio::test]
async fn the_next_turn_reuses_the_cached_prefix() {
    let model = chat_model(4);
    let (answer, first) = run(&model, ask("Name a colour.", 8)).await;
    let mut next = ask("Name a colour.", 8);
    next.messages.push(Message {
        role: "assistant".into(),
        content: answer,
    });
    next.messages.push(Message {
        role: "user".into(),
        content: "Another one?".into(),
    });
    let (_, second) = run(&model, next).await;
    let (
        Event::Done {
            prompt_tokens: p1, ..
        },
        Event::Done { cached_tokens, .. },
    ) = (first, second)
    else {
        panic!("not done");
    };
    assert!(
        cached_tokens as usize >= p1 as usize - 1,
        "{cached_tokens} of {p1}"
    );
}

#[tokio::test]
async fn a_full_queue_refuses_and_too_long_a_prompt_is_refused() {
    let model = chat_model(1);
    // One runs, one waits, the third finds the queue full.
    let mut running = model.generate(ask("Tell me a long story.", 200)).unwrap();
    // Once text arrives the engine has taken the first off the queue.
    assert!(matches!(running.recv().await, Some(Event::Text(_))));
    let waiting = model.generate(ask("Tell me a long story.", 200));
    let full = (0..4)
        .map(|_| model.generate(ask("hi", 1)))
        .find_map(Result::err);
    assert!(waiting.is_ok());
    assert_eq!(full, Some(LocalError::QueueFull));
    // Dropped receivers cancel their generations: the queue drains.
    drop((running, waiting));
    let mut events = loop {
        match model.generate(ask(&"word ".repeat(3000), 10)) {
            Ok(events) => break events,
            Err(LocalError::QueueFull) => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await
            }
            Err(error) => panic!("{error}"),
        }
    };
    let done = events.recv().await.unwrap();
    assert!(
        matches!(done, Event::Failed(LocalError::ContextLength { .. })),
        "{done:?}"
    );
}

#[test]
fn similar_sentences_embed_closer_than_unrelated_ones() {
    let model = EmbeddingModel::load(&EmbeddingOptions {
        path: models_dir().join("all-minilm-l6-v2"),
        max_queue: 4,
    })
    .expect("the built-in embedding model (run `make models`)");
    assert_eq!(model.dimensions(), 384);
    let embeddings = model
        .embed_blocking(vec![
            "A man is playing a guitar.".into(),
            "Someone plays a guitar.".into(),
            "The stock market fell sharply today.".into(),
        ])
        .unwrap();
    let v = &embeddings.vectors;
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let norm = dot(&v[0], &v[0]).sqrt();
    assert!((norm - 1.0).abs() < 1e-4, "unit length: {norm}");
    let similar = dot(&v[0], &v[1]);
    let unrelated = dot(&v[0], &v[2]);
    assert!(
        similar > 0.6 && unrelated < 0.2 && similar > unrelated + 0.4,
        "{similar} vs {unrelated}"
    );
    assert!(embeddings.tokens > 10);

    let too_long = model.embed_blocking(vec!["word ".repeat(400)]).unwrap_err();
    assert!(
        matches!(too_long, LocalError::InputTooLong { max: 256, .. }),
        "{too_long:?}"
    );
}

/// A reader that stops reading cannot hold the model: once it is
/// `reader_lag` events behind, its generation ends and the next one runs.
#[tokio::test]
async fn a_reader_that_stops_reading_does_not_freeze_the_model() {
    let model = chat_model_with_lag(4, 4);
    // Never read while the second generation runs.
    let mut stalled = model
        .generate(ask("Count from one to one hundred in words.", 400))
        .unwrap();
    let answered = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        run(
            &model,
            ask("What is the capital of France? Answer in one word.", 24),
        ),
    )
    .await
    .expect("the model froze behind a reader that stopped reading");
    assert!(answered.0.contains("Paris"), "answer: {:?}", answered.0);
    // What the stalled reader finds: the events it had room for, then the
    // end, without Done.
    let mut seen = 0;
    while let Some(event) = stalled.recv().await {
        assert!(matches!(event, Event::Text(_)), "{event:?}");
        seen += 1;
    }
    assert!(seen <= 4, "{seen} events");
}
