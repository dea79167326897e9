//! A whole (non-streamed) answer from the upstream, read and written as
//! ours: the usual answer on a fast path that keeps its members as raw
//! JSON, anything else (and an answer that gets the web's documents)
//! through a JSON tree; both say the same (the tests say so).
//!
//! Reading comes before billing (the usage and the text to estimate it
//! from), writing after it (the `usage`, `cost` and parameters ours has).

use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use super::chunks::{
    MemberValue, Members, TextLen, beyond_raw_reading, repeats_a_name, text_chars, write_member,
};
use super::echo::Echo;
use super::metering::{
    Cost, Counts, Usage, UsageJson, usage_counted, usage_is_told, usage_or_estimate,
};
use super::now;
use crate::augment;

/// An upstream answer, read: what billing needs of it, and the rest kept
/// for [`Answer::write`].
pub(super) struct Answer<'a> {
    /// Bytes of text in the choices' messages, the completion's tokens
    /// estimated from them when the usage does not tell them (the fast
    /// reader measures them only then).
    completion_chars: usize,
    /// The upstream's `usage`, as it said it.
    usage: Option<Upstream<'a>>,
    body: Body<'a>,
}

/// The upstream's `usage`, read.
enum Upstream<'a> {
    /// Its raw text, and the counts it tells (the fast reader's way).
    Counted(&'a RawValue, Counts),
    /// As a tree: the answer read as one, or a `usage` the raw reading
    /// does not take.
    Tree(Value),
}

impl Upstream<'_> {
    /// Whether it tells the tokens (else they are estimated).
    fn told(&self) -> bool {
        match self {
            Upstream::Counted(_, counts) => counts.told(),
            Upstream::Tree(tree) => usage_is_told(tree),
        }
    }
}

enum Body<'a> {
    /// The answer's members in their order, borrowed from the upstream's
    /// bytes (`len` of them): raw JSON, but the choices read to their
    /// members.
    Raw {
        members: Vec<(&'a str, Member<'a>)>,
        len: usize,
    },
    /// The answer as a tree, its choices already as ours has them.
    Tree(Map<String, Value>),
}

/// A member of an answer read the fast way.
enum Member<'a> {
    Raw(&'a RawValue),
    /// `choices`: each choice's members, raw.
    Choices(Vec<Members<'a>>),
    /// `usage`, raw (read to its counts after).
    Usage(&'a RawValue),
}

/// What ours says whatever the upstream said.
pub(super) struct Ours<'a> {
    pub(super) id: &'a str,
    pub(super) model: &'a str,
    pub(super) usage: &'a UsageJson,
    pub(super) cost: &'a Cost,
    /// The brand's names: `<brand>_parameters`, and a member of what it
    /// echoes.
    pub(super) brand: &'a rialto_core::Brand,
    pub(super) parameters: &'a Echo,
}

impl<'a> Answer<'a> {
    /// Reads `json`, the upstream's answer; `documents`, the web's sources
    /// as a tool call, goes first in every choice's message. `None` when it
    /// is not an answer (not a JSON object).
    pub(super) fn read(json: &'a [u8], documents: Option<&Value>) -> Option<Self> {
        match documents {
            None => read_raw(json).or_else(|| read_tree(json, None)),
            Some(call) => read_tree(json, Some(call)),
        }
    }

    /// The tokens to bill: the upstream's usage when it tells them, else
    /// estimated (`prompt_estimate` and the completion's text).
    pub(super) fn usage(&mut self, prompt_estimate: u64) -> Usage {
        let chars = self.completion_chars;
        match self.usage.take() {
            Some(Upstream::Counted(raw, counts)) => {
                usage_counted(raw, &counts, prompt_estimate, chars)
            }
            Some(Upstream::Tree(tree)) => usage_or_estimate(Some(tree), prompt_estimate, chars),
            None => usage_or_estimate(None, prompt_estimate, chars),
        }
    }

    /// Ours, as JSON: the upstream's members with our id, object, model,
    /// usage, cost and parameters; `created` and `prompt_logprobs` kept
    /// when told; no `system_fingerprint`.
    pub(super) fn write(self, ours: &Ours) -> Vec<u8> {
        match self.body {
            Body::Raw { members, len } => write_raw(&members, len, ours),
            Body::Tree(object) => write_tree(object, ours),
        }
    }
}

/// The fast way, in one pass over the bytes: the members stay raw, the
/// choices are read to their members (and their messages to their text
/// when the usage does not tell the tokens). `None` for an answer out of
/// the ordinary (not an object of distinct, plainly named members;
/// `choices` not an array of such objects; or, when measured, a message's
/// content neither text nor null), left to [`read_tree`], which reads
/// anything.
fn read_raw(json: &[u8]) -> Option<Answer<'_>> {
    if beyond_raw_reading(json) {
        return None;
    }
    // Checked as UTF-8 once here: read from bytes, each member's raw text
    // and each name would be checked again as it is borrowed.
    let text = std::str::from_utf8(json).ok()?;
    let Members(members): Members<Member> = serde_json::from_str(text).ok()?;
    let choice_repeats = |member: &Member| match member {
        Member::Choices(choices) => choices.iter().any(|Members(m)| repeats_a_name(m)),
        _ => false,
    };
    if repeats_a_name(&members) || members.iter().any(|(_, member)| choice_repeats(member)) {
        return None;
    }
    // A raw member a tree cannot read (too deep, a lone surrogate) never
    // gets here: `beyond_raw_reading` left the answer to the tree.
    let usage = members.iter().find_map(|(_, member)| match member {
        Member::Usage(usage) => Some(match Counts::read(usage) {
            Some(counts) => Upstream::Counted(usage, counts),
            None => Upstream::Tree(serde_json::from_str(usage.get()).unwrap_or_default()),
        }),
        _ => None,
    });
    let mut completion_chars = 0;
    if !usage.as_ref().is_some_and(Upstream::told) {
        for (_, member) in &members {
            if let Member::Choices(choices) = member {
                completion_chars = measure(choices)?;
            }
        }
    }
    Some(Answer {
        completion_chars,
        usage,
        body: Body::Raw {
            members: members.into_vec(),
            len: json.len(),
        },
    })
}

/// An answer's members are read in one pass: `choices` to each choice's
/// members, the rest raw (`usage` is read to its counts after).
impl<'de> MemberValue<'de> for Member<'de> {
    fn next<A: serde::de::MapAccess<'de>>(name: &'de str, map: &mut A) -> Result<Self, A::Error> {
        Ok(match name {
            "choices" => Member::Choices(map.next_value()?),
            "usage" => Member::Usage(map.next_value()?),
            _ => Member::Raw(map.next_value()?),
        })
    }
}

/// The bytes of text in the choices' messages; `None` when a message's
/// content is neither text nor null.
fn measure(choices: &[Members]) -> Option<usize> {
    let mut chars = 0;
    for Members(members) in choices {
        for (name, raw) in members {
            if *name == "message" && raw.get().starts_with('{') {
                let message: MessageText = serde_json::from_str(raw.get()).ok()?;
                chars += message.content.map_or(0, |text| text.0);
            }
        }
    }
    Some(chars)
}

/// The choices as ours writes them: every one with `logprobs` and
/// `finish_reason`, null when not told.
fn write_choices(out: &mut Vec<u8>, choices: &[Members]) {
    out.push(b'[');
    for (i, Members(members)) in choices.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.push(b'{');
        for (j, (name, raw)) in members.iter().enumerate() {
            if j > 0 {
                out.push(b',');
            }
            write_member(out, name, raw.get());
        }
        let mut empty = members.is_empty();
        for untold in ["logprobs", "finish_reason"] {
            if !members.iter().any(|(name, _)| *name == untold) {
                if !empty {
                    out.push(b',');
                }
                out.push(b'"');
                out.extend_from_slice(untold.as_bytes());
                out.extend_from_slice(b"\":null");
                empty = false;
            }
        }
        out.push(b'}');
    }
    out.push(b']');
}

/// A choice's message, as far as the reader reads it: its text.
#[derive(serde::Deserialize)]
struct MessageText {
    #[serde(default)]
    content: Option<TextLen>,
}

/// Ours from the upstream's `members` (`len` bytes of JSON).
fn write_raw(members: &[(&str, Member)], len: usize, ours: &Ours) -> Vec<u8> {
    let told = |wanted: &str| members.iter().find(|(name, _)| *name == wanted);
    let mut out = Vec::with_capacity(len + 512);
    // Writing strings and trees into a Vec cannot fail.
    out.extend_from_slice(b"{\"id\":");
    let _ = serde_json::to_writer(&mut out, ours.id);
    out.extend_from_slice(b",\"object\":\"chat.completion\",\"model\":");
    let _ = serde_json::to_writer(&mut out, ours.model);
    out.extend_from_slice(b",\"created\":");
    match told("created") {
        Some((_, Member::Raw(raw))) => out.extend_from_slice(raw.get().as_bytes()),
        _ => {
            let _ = serde_json::to_writer(&mut out, &now());
        }
    }
    for (name, member) in members {
        match (*name, member) {
            ("id" | "object" | "model" | "created" | "system_fingerprint" | "cost", _)
            | (_, Member::Usage(_)) => {}
            (name, _) if name == ours.brand.parameters_field => {}
            (_, Member::Choices(choices)) => {
                out.extend_from_slice(b",\"choices\":");
                write_choices(&mut out, choices);
            }
            (name, Member::Raw(raw)) => {
                out.push(b',');
                write_member(&mut out, name, raw.get());
            }
        }
    }
    out.extend_from_slice(b",\"usage\":");
    let _ = serde_json::to_writer(&mut out, ours.usage);
    out.extend_from_slice(b",\"cost\":");
    let _ = serde_json::to_writer(&mut out, ours.cost);
    if told("prompt_logprobs").is_none() {
        out.extend_from_slice(b",\"prompt_logprobs\":null");
    }
    out.push(b',');
    let _ = serde_json::to_writer(&mut out, &ours.brand.parameters_field);
    out.push(b':');
    ours.parameters
        .write_json(&mut out, &ours.brand.include_system_prompt_field);
    out.push(b'}');
    out
}

/// The tree way: any answer that is a JSON object.
fn read_tree<'a>(json: &[u8], documents: Option<&Value>) -> Option<Answer<'a>> {
    let Ok(Value::Object(mut object)) = serde_json::from_slice::<Value>(json) else {
        return None;
    };
    if let Some(Value::Array(choices)) = object.get_mut("choices") {
        for choice in choices.iter_mut().filter_map(Value::as_object_mut) {
            choice.entry("logprobs").or_insert(Value::Null);
            choice.entry("finish_reason").or_insert(Value::Null);
        }
    }
    let completion_chars = text_chars(object.get("choices"), "message");
    if let Some(call) = documents {
        augment::add_documents(&mut object, call);
    }
    Some(Answer {
        completion_chars,
        usage: object.remove("usage").map(Upstream::Tree),
        body: Body::Tree(object),
    })
}

fn write_tree(mut object: Map<String, Value>, ours: &Ours) -> Vec<u8> {
    object.insert("id".into(), json!(ours.id));
    object.insert("object".into(), json!("chat.completion"));
    object.insert("model".into(), json!(ours.model));
    object.entry("created").or_insert_with(|| json!(now()));
    object.remove("system_fingerprint");
    object.insert("usage".into(), ours.usage.to_value());
    object.insert("cost".into(), ours.cost.to_value());
    object.entry("prompt_logprobs").or_insert(Value::Null);
    object.insert(
        ours.brand.parameters_field.clone(),
        ours.parameters
            .to_value(&ours.brand.include_system_prompt_field),
    );
    // A tree with string keys cannot fail to serialize.
    serde_json::to_vec(&object).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::{Answer, Body, Echo, Ours, UsageJson, read_raw, read_tree};
    use proptest::prelude::*;
    use serde_json::{Map, Value, json};

    /// Ours, written from an answer read one way or the other.
    fn written(answer: Answer) -> Value {
        let usage = json!({"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8});
        written_with(answer, &UsageJson::Tree(usage))
    }

    /// Ours with `usage`.
    fn written_with(answer: Answer, usage: &UsageJson) -> Value {
        let ours = Ours {
            id: "chatcmpl-ours",
            model: "our-model",
            usage,
            cost: &super::Cost::of(&rialto_proto::billing::v1::Cost {
                usd: "0.0001".into(),
                diem: "0".into(),
            }),
            brand: &rialto_core::Brand::new("rialto"),
            parameters: &Echo::default(),
        };
        serde_json::from_slice(&answer.write(&ours)).unwrap()
    }

    /// Both readers on one answer: the fast one's reading and writing,
    /// when it reads the answer at all, are the tree's.
    fn agree(json: &[u8]) -> Result<bool, TestCaseError> {
        let tree = read_tree(json, None);
        let Some(mut fast) = read_raw(json) else {
            return Ok(false);
        };
        let Some(mut tree) = tree else {
            return Err(TestCaseError::fail(format!(
                "only the fast reader read {}",
                String::from_utf8_lossy(json)
            )));
        };
        let (fast_usage, tree_usage) = (fast.usage(11), tree.usage(11));
        prop_assert_eq!(&fast_usage, &tree_usage);
        let told_created = serde_json::from_slice::<Value>(json)
            .is_ok_and(|answer| answer.get("created").is_some());
        let (mut fast, mut tree) = (
            written_with(fast, &fast_usage.json),
            written_with(tree, &tree_usage.json),
        );
        if !told_created {
            // Now, in both: it may be a second apart.
            fast.as_object_mut().unwrap().remove("created");
            tree.as_object_mut().unwrap().remove("created");
        }
        prop_assert_eq!(fast, tree);
        Ok(true)
    }

    #[test]
    fn the_usual_answers_take_the_fast_way_and_agree() {
        for answer in [
            json!({"id": "up", "object": "chat.completion", "created": 1_800_000_000u64, "model": "up-model",
                   "system_fingerprint": "fp", "choices": [{"index": 0, "message": {"role": "assistant", "content": "héllo \"q\" \n"},
                   "logprobs": null, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}),
            json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [{"id": "t"}]}}]}),
            json!({"choices": [{}, {"message": "not an object"}], "usage": null, "cost": 7, "rialto_parameters": {}}),
            json!({"choices": [], "prompt_logprobs": [1, 2.50]}),
            // A number no f64 holds, kept as it was written.
            serde_json::from_str(
                r#"{"choices": [], "x-extra": 1e400, "y": 0.1000000000000000000001}"#,
            )
            .unwrap(),
            json!({}),
        ] {
            let json = serde_json::to_vec(&answer).unwrap();
            assert!(agree(&json).unwrap(), "{answer} went the tree way");
            // Pretty-printed too: a raw member is read without its spaces.
            let json = serde_json::to_vec_pretty(&answer).unwrap();
            assert!(agree(&json).unwrap(), "{answer} (pretty) went the tree way");
        }
    }

    #[test]
    fn answers_out_of_the_ordinary_go_the_tree_way() {
        for json in [
            &br#"{"choices":[],"choices":[]}"#[..],
            br#"{"choices":[{"message":{"content":"a"},"message":{}}]}"#,
            br#"{"choices":[{"message":{"content":[{"type":"text","text":"a"}]}}]}"#,
            br#"{"choices":[{"message":{"content":"a","content":"b"}}]}"#,
            br#"{"ch\u006fices":[{"message":{"content":"a"}}]}"#,
            br#"{"choices":[{"mess\u0061ge":{"content":"a"}}]}"#,
            br#"{"choices":[{"message":{"content":"a"}}, null, 3]}"#,
            br#"{"choices":{"not":"an array"}}"#,
        ] {
            assert!(
                read_raw(json).is_none(),
                "{}",
                String::from_utf8_lossy(json)
            );
            assert!(read_tree(json, None).is_some());
            assert!(Answer::read(json, None).is_some());
        }
        // What a raw member would pass on unchecked: the tree refuses it.
        let deep = format!(
            r#"{{"choices":[],"x":{}{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        for json in [
            &br#"{"choices":[],"x":"\ud800"}"#[..],
            br#"{"choices":[{"message":{"content":"\uDC00"}}],"usage":{"prompt_tokens":1}}"#,
            deep.as_bytes(),
        ] {
            assert!(
                read_raw(json).is_none(),
                "{}",
                String::from_utf8_lossy(json)
            );
            assert!(Answer::read(json, None).is_none());
        }
        // A surrogate pair is text (the tree way), a `\\u` is not an escape.
        for json in [
            &br#"{"choices":[{"message":{"content":"\ud83d\ude00"}}]}"#[..],
            br#"{"choices":[{"message":{"content":"\\ud800"}}]}"#,
        ] {
            assert!(Answer::read(json, None).is_some());
        }
        assert!(read_raw(br#"{"choices":[{"message":{"content":"\\ud800"}}]}"#).is_some());
        for json in [&br#"[1,2]"#[..], b"not json", b"{\"a\":\"\xff\"}", b"{} {}"] {
            assert!(read_raw(json).is_none());
            assert!(Answer::read(json, None).is_none());
        }
    }

    #[test]
    fn documents_go_the_tree_way_first_in_each_choice() {
        let json = br#"{"choices":[{"message":{"content":"a","tool_calls":[{"id":"own"}]},"finish_reason":"stop"}]}"#;
        let call = json!({"id": "documents"});
        let answer = Answer::read(json, Some(&call)).unwrap();
        assert!(matches!(answer.body, Body::Tree(_)));
        assert_eq!(answer.completion_chars, 1);
        let choice = &written(answer)["choices"][0];
        assert_eq!(choice["message"]["tool_calls"][0], call);
        assert_eq!(choice["message"]["tool_calls"][1]["id"], "own");
        assert_eq!(choice["finish_reason"], "tool_calls");
    }

    fn text() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<String>().prop_map(Value::from),
            Just(json!(7)),
            Just(json!([{"type": "text", "text": "parts"}])),
        ]
    }

    fn choice() -> impl Strategy<Value = Value> {
        let message = prop_oneof![
            text().prop_map(|content| json!({"role": "assistant", "content": content})),
            Just(json!({"role": "assistant"})),
            Just(Value::Null),
        ];
        let object = (
            proptest::option::of(message),
            proptest::option::of(prop_oneof![
                Just(json!("stop")),
                Just(json!("length")),
                Just(Value::Null)
            ]),
            proptest::option::of(Just(Value::Null)),
            proptest::option::of(0u64..4),
        )
            .prop_map(|(message, finish, logprobs, index)| {
                let mut choice = Map::new();
                if let Some(index) = index {
                    choice.insert("index".into(), json!(index));
                }
                if let Some(message) = message {
                    choice.insert("message".into(), message);
                }
                if let Some(finish) = finish {
                    choice.insert("finish_reason".into(), finish);
                }
                if let Some(logprobs) = logprobs {
                    choice.insert("logprobs".into(), logprobs);
                }
                Value::Object(choice)
            });
        prop_oneof![8 => object, 1 => Just(Value::Null), 1 => Just(json!("x"))]
    }

    fn member() -> impl Strategy<Value = (String, Value)> {
        let named = |name: &'static str, value: BoxedStrategy<Value>| {
            value.prop_map(move |v| (name.to_owned(), v))
        };
        prop_oneof![
            named(
                "choices",
                proptest::collection::vec(choice(), 0..3)
                    .prop_map(Value::from)
                    .boxed()
            ),
            named("choices", Just(json!({"not": "an array"})).boxed()),
            named(
                "usage",
                prop_oneof![
                    (0u64..1000).prop_map(|n| json!({"prompt_tokens": 2, "completion_tokens": n})),
                    Just(Value::Null),
                    usage(),
                ]
                .boxed()
            ),
            named(
                "created",
                prop_oneof![
                    Just(json!(1_800_000_000u64)),
                    Just(Value::Null),
                    Just(json!("x"))
                ]
                .boxed()
            ),
            named("prompt_logprobs", Just(json!([null])).boxed()),
            named("system_fingerprint", Just(json!("fp")).boxed()),
            named("rialto_parameters", Just(json!({"theirs": true})).boxed()),
            named("cost", Just(json!(1.5)).boxed()),
            named("id", any::<String>().prop_map(Value::from).boxed()),
            ("[a-z_]{1,12}", any::<String>()).prop_map(|(k, v)| (k, Value::from(v))),
            // Any name: one that needs an escape goes the tree way.
            (any::<String>(), any::<String>()).prop_map(|(k, v)| (k, Value::from(v))),
        ]
    }

    /// A `usage` of any of the shapes upstreams send, and some they
    /// should not: counts that are not `u64`s, a total that is not the
    /// sum, details that are not an object.
    fn usage() -> impl Strategy<Value = Value> {
        let count = prop_oneof![
            6 => (0u64..1000).prop_map(Value::from),
            1 => Just(json!(u64::MAX)),
            1 => Just(json!(2.0)),
            1 => Just(json!(-1)),
            1 => Just(json!("2")),
            1 => Just(Value::Null),
        ];
        let details = prop_oneof![
            proptest::option::of(count.clone())
                .prop_map(|cached| json!({"cached_tokens": cached, "audio_tokens": 0})),
            (count.clone(), count.clone()).prop_map(|(cached, written)| {
                json!({"cached_tokens": cached, "cache_creation_input_tokens": written})
            }),
            Just(json!(3)),
        ];
        (
            // Mostly present, so many cases reach the raw way.
            proptest::option::weighted(0.9, count.clone()),
            proptest::option::of(count),
            0u8..3,
            proptest::option::of(details),
        )
            .prop_map(|(prompt, completion, total, details)| {
                let mut usage = Map::new();
                if let Some(prompt) = &prompt {
                    usage.insert("prompt_tokens".into(), prompt.clone());
                }
                if let Some(completion) = &completion {
                    usage.insert("completion_tokens".into(), completion.clone());
                }
                let sum = prompt
                    .as_ref()
                    .and_then(Value::as_u64)
                    .unwrap_or(0)
                    .saturating_add(completion.as_ref().and_then(Value::as_u64).unwrap_or(0));
                match total {
                    // The sum (the usual answer), one more, or none.
                    0 => usage.insert("total_tokens".into(), json!(sum)),
                    1 => usage.insert("total_tokens".into(), json!(sum.wrapping_add(1))),
                    _ => None,
                };
                if let Some(details) = details {
                    usage.insert("prompt_tokens_details".into(), details);
                }
                Value::Object(usage)
            })
    }

    /// The usual `usage` (its total the sum) is written as the upstream
    /// wrote it; one without its total, or a name repeated or escaped,
    /// goes through a tree; each says what the tree says.
    #[test]
    fn a_usage_told_whole_is_written_as_it_came() {
        let answer = |usage: &str| format!(r#"{{"choices":[],"usage":{usage}}}"#);
        let json = answer(r#"{"total_tokens":8,"prompt_tokens":3,"completion_tokens":5}"#);
        assert!(agree(json.as_bytes()).unwrap());
        let usage = read_raw(json.as_bytes()).unwrap().usage(11);
        assert_eq!(
            usage.billed(),
            rialto_proto::billing::v1::Usage {
                prompt_tokens: 3,
                completion_tokens: 5,
                ..Default::default()
            }
        );
        match &usage.json {
            UsageJson::Told(raw) => assert_eq!(
                raw.get(),
                r#"{"total_tokens":8,"prompt_tokens":3,"completion_tokens":5}"#
            ),
            UsageJson::Tree(tree) => panic!("read to a tree: {tree}"),
        }
        for usage in [
            r#"{"prompt_tokens":3,"completion_tokens":5}"#,
            r#"{"prompt_tokens":3,"completion_tokens":5,"total_tokens":9}"#,
            r#"{"prompt_tokens":1,"prompt_tokens":3,"completion_tokens":5,"total_tokens":6}"#,
            r#"{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8,"x":1,"x":2}"#,
            r#"{"prompt\u005ftokens":3,"completion_tokens":5,"total_tokens":8}"#,
            r#"{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8,"prompt_tokens_details":{"cached_tokens":1,"cached_tokens":2}}"#,
        ] {
            let json = answer(usage);
            assert!(agree(json.as_bytes()).unwrap(), "{usage} went the tree way");
            let read = read_raw(json.as_bytes()).unwrap().usage(11);
            assert!(matches!(read.json, UsageJson::Tree(_)), "{usage}");
        }
    }

    proptest! {
        /// Any `usage` alone (most answers' shape), compact or pretty: the
        /// fast reader's counts and written usage are the tree reader's.
        #[test]
        fn the_fast_usage_is_the_tree_usage(usage in usage(), pretty in any::<bool>()) {
            let usage = if pretty {
                serde_json::to_string_pretty(&usage).unwrap()
            } else {
                usage.to_string()
            };
            let json = format!(r#"{{"choices":[],"usage":{usage}}}"#);
            prop_assert!(agree(json.as_bytes())?);
        }

        /// Any answer: the fast reader reads and writes it as the tree
        /// reader does, or leaves it to the tree.
        #[test]
        fn the_fast_reader_is_the_tree_reader(
            members in proptest::collection::vec(member(), 0..7),
            pretty in any::<bool>(),
        ) {
            let mut object = String::from("{");
            for (i, (name, value)) in members.iter().enumerate() {
                if i > 0 {
                    object.push(',');
                }
                object.push_str(&serde_json::to_string(name).unwrap());
                object.push_str(if pretty { " : " } else { ":" });
                if pretty {
                    object.push_str(&serde_json::to_string_pretty(value).unwrap());
                } else {
                    object.push_str(&value.to_string());
                }
            }
            object.push('}');
            agree(object.as_bytes())?;
        }
    }
}
