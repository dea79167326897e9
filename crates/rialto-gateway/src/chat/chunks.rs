//! Reading one `chat.completion.chunk` from the upstream: the usual
//! chunk on a fast path that only finds what the relay needs, anything
//! else through a JSON tree; both agree (the tests say so).

use bytes::Bytes;
use serde_json::{Value, json};
use smallvec::SmallVec;

use super::now;

/// What the relay does with one upstream chunk.
pub(super) enum Chunk {
    /// Passed on as ours; `chars` of text in its deltas.
    Forward { line: Bytes, chars: usize },
    /// Nothing for the client (a usage-only chunk, or not an object).
    Skip,
    /// An in-band failure, passed on as it is; the stream ends.
    Error(Bytes),
}

/// What every chunk of a stream is rewritten with: our id, object and
/// model, and one `created` (the first chunk's own, or now).
pub(super) struct ChunkHead {
    id: String,
    model: String,
    created: Option<Value>,
    /// `data: {"id":…,"object":…,"model":…,"created":…`, once `created` is
    /// known.
    prefix: Vec<u8>,
}

impl ChunkHead {
    pub(super) fn new(id: &str, model: &str) -> Self {
        Self {
            id: id.to_owned(),
            model: model.to_owned(),
            created: None,
            prefix: Vec::new(),
        }
    }

    /// The stream's `created`: the first one asked for (`own`, the chunk's
    /// own), or now.
    pub(super) fn created(&mut self, own: impl FnOnce() -> Option<Value>) -> &Value {
        self.created
            .get_or_insert_with(|| own().unwrap_or_else(|| json!(now())))
    }

    /// The start of every line [`read_chunk`] writes, made once.
    fn prefix(&mut self, own: impl FnOnce() -> Option<Value>) -> &[u8] {
        if self.prefix.is_empty() {
            let created = self.created(own).clone();
            let mut prefix = Vec::with_capacity(128);
            prefix.extend_from_slice(b"data: {\"id\":");
            // Writing strings and a Value into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut prefix, &self.id);
            prefix.extend_from_slice(b",\"object\":\"chat.completion.chunk\",\"model\":");
            let _ = serde_json::to_writer(&mut prefix, &self.model);
            prefix.extend_from_slice(b",\"created\":");
            let _ = serde_json::to_writer(&mut prefix, &created);
            self.prefix = prefix;
        }
        &self.prefix
    }
}

/// Reads one upstream chunk without building its tree (most of a stream's
/// cost per chunk when it did), in one pass: its members stay raw JSON,
/// copied once into the line the client gets, and its choices are read for
/// the text of their deltas as that pass goes over them (their raw text is
/// then found by where they stand: [`value_text`]). `None` for a chunk out
/// of the ordinary (not an object of distinct, plainly named members;
/// choices not objects with string contents), left to [`read_chunk_tree`],
/// which reads anything.
pub(super) fn read_chunk(
    json: &[u8],
    head: &mut ChunkHead,
    usage: &mut Option<Value>,
) -> Option<Chunk> {
    if beyond_raw_reading(json) {
        return None;
    }
    // Checked as UTF-8 once here: read from bytes, each member's raw text
    // and each name would be checked again as it is borrowed.
    let text = std::str::from_utf8(json).ok()?;
    let Members(read): Members<ChunkValue> = serde_json::from_str(text).ok()?;
    if repeats_a_name(&read) {
        return None;
    }
    let mut choices = None;
    let mut members = SmallVec::<[(&str, &str); 8]>::with_capacity(read.len());
    for (i, (name, value)) in read.iter().enumerate() {
        let raw = match value {
            ChunkValue::Raw(raw) => raw.get(),
            ChunkValue::Choices(seen) => {
                choices = seen.as_ref();
                value_text(text, &read, i)?
            }
        };
        members.push((*name, raw));
    }
    let member = |wanted: &str| {
        members
            .iter()
            .find(|(name, _)| *name == wanted)
            .map(|(_, raw)| *raw)
    };
    if member("error").is_some() {
        return Some(Chunk::Error(sse_raw(json)));
    }
    if let Some(raw) = member("usage").filter(|raw| raw.starts_with('{')) {
        *usage = Some(serde_json::from_str(raw).ok()?);
    }
    let Some(&ChoicesText { chars, .. }) = choices.filter(|choices| choices.count > 0) else {
        return Some(Chunk::Skip);
    };
    let created = member("created");
    let prefix = head.prefix(|| created.and_then(|raw| serde_json::from_str(raw).ok()));
    let kept = || {
        members.iter().filter(|(name, _)| {
            !matches!(
                *name,
                "id" | "object" | "model" | "created" | "usage" | "system_fingerprint"
            )
        })
    };
    // The line's exact length, so that the `Vec`, full, becomes `Bytes`
    // without a second allocation.
    let length = prefix.len()
        + kept()
            .map(|(name, raw)| name.len() + raw.len() + 4)
            .sum::<usize>()
        + 3;
    let mut line = Vec::with_capacity(length);
    line.extend_from_slice(prefix);
    for (name, raw) in kept() {
        line.push(b',');
        write_member(&mut line, name, raw);
    }
    line.extend_from_slice(b"}\n\n");
    Some(Chunk::Forward {
        line: Bytes::from(line),
        chars,
    })
}

/// A member as it was: its name, borrowed from the upstream's JSON, and its
/// raw value. A borrowed name is written as it came: serde_json lends only
/// a name without escapes, and a name that needs none holds no `"`, `\` or
/// control character.
pub(super) fn write_member(out: &mut Vec<u8>, name: &str, raw: &str) {
    out.push(b'"');
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\":");
    out.extend_from_slice(raw.as_bytes());
}

/// Whether `json` may be one that raw members would pass on where a tree
/// refuses it (an invalid answer): a raw member is checked for its syntax
/// but neither decoded nor bounded in depth. So a chunk or an answer that escapes a
/// UTF-16 surrogate (`\uD800`-`\uDFFF`, refused when lone) or opens more
/// than 100 arrays and objects in all (serde_json refuses nesting deeper
/// than 128) is left to the tree; these are rare, and the check is one
/// pass over the bytes.
pub(super) fn beyond_raw_reading(json: &[u8]) -> bool {
    // memchr's searches, a vector at a time, from bracket to bracket and
    // from backslash to backslash: a chunk has a few of each or none. (A
    // count of the bytes that are brackets cost ~7 instructions a byte,
    // ~1,200 a chunk; a loop matching each byte ~13.)
    if memchr::memchr2_iter(b'[', b'{', json).nth(100).is_some() {
        return true;
    }
    let mut rest = json;
    while let Some(at) = memchr::memchr(b'\\', rest) {
        if rest.get(at + 1) == Some(&b'u') && rest.get(at + 2).is_some_and(|hex| hex | 0x20 == b'd')
        {
            return true;
        }
        // Past the escaped byte, so `\\u` (a backslash, then `u`) is not
        // taken for an escape.
        rest = rest.get(at + 2..).unwrap_or_default();
    }
    false
}

/// A chunk's member as [`read_chunk`] reads it: raw, or, its `choices`,
/// read for their text (`None` when they are not an array).
enum ChunkValue<'a> {
    Raw(&'a serde_json::value::RawValue),
    Choices(Option<ChoicesText>),
}

impl<'de> MemberValue<'de> for ChunkValue<'de> {
    fn next<A: serde::de::MapAccess<'de>>(name: &'de str, map: &mut A) -> Result<Self, A::Error> {
        if name == "choices" {
            map.next_value::<ChoicesMember>()
                .map(|ChoicesMember(seen)| Self::Choices(seen))
        } else {
            map.next_value().map(Self::Raw)
        }
    }
}

/// The raw JSON text of the value of `members[i]`, members read from the
/// object `text` with their names borrowed from it. Between a name and its
/// value stand only whitespace and `:`, and between a value and the next
/// name (or the object's `}`) only whitespace and `,`, so the value is what
/// lies between them, trimmed (of ASCII whitespace, which adds only the
/// form feed to JSON's, and JSON holds none there). A borrowed name had no escapes, so its
/// text in `text` is the name itself, in quotes. `None` (never for an
/// object serde_json read) when the bytes around are not so.
fn value_text<'a, V>(text: &'a str, members: &[(&'a str, V)], i: usize) -> Option<&'a str> {
    let at = |name: &str| (name.as_ptr() as usize).checked_sub(text.as_ptr() as usize);
    let (name, _) = members.get(i)?;
    let start = at(name)? + name.len();
    let rest = text.get(start..)?.strip_prefix('"')?;
    let rest = rest.trim_ascii_start().strip_prefix(':')?;
    let value_start = text.len() - rest.len();
    let value_end = match members.get(i + 1) {
        Some((next, _)) => {
            let before = text.get(..at(next)?)?.strip_suffix('"')?;
            before.trim_ascii_end().strip_suffix(',')?.len()
        }
        None => text.trim_ascii_end().strip_suffix('}')?.len(),
    };
    Some(text.get(value_start..value_end)?.trim_ascii())
}

/// Reads one upstream chunk as a tree: any chunk [`read_chunk`] leaves, and
/// every chunk of a stream whose choices are rewritten (search results as
/// documents: the finish reason and the tool calls' indexes).
pub(super) fn read_chunk_tree(
    json: &[u8],
    head: &mut ChunkHead,
    usage: &mut Option<Value>,
    documents: bool,
) -> Chunk {
    let Ok(Value::Object(mut chunk)) = serde_json::from_slice::<Value>(json) else {
        return Chunk::Skip;
    };
    if chunk.contains_key("error") {
        return Chunk::Error(sse(&Value::Object(chunk)));
    }
    if let Some(found) = chunk.remove("usage").filter(Value::is_object) {
        *usage = Some(found);
    }
    let has_choices = chunk
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty());
    if !has_choices {
        return Chunk::Skip;
    }
    let chars = text_chars(chunk.get("choices"), "delta");
    chunk.insert("id".into(), json!(head.id));
    chunk.insert("object".into(), json!("chat.completion.chunk"));
    chunk.insert("model".into(), json!(head.model));
    let created = head.created(|| chunk.get("created").cloned()).clone();
    chunk.insert("created".into(), created);
    chunk.remove("system_fingerprint");
    if documents && let Some(Value::Array(choices)) = chunk.get_mut("choices") {
        for choice in choices.iter_mut() {
            if choice.get("finish_reason").is_some_and(|r| r == "stop") {
                choice["finish_reason"] = json!("tool_calls");
            }
            // The documents call is the choice's tool call 0: the model's
            // own calls come after it.
            let calls = choice
                .get_mut("delta")
                .and_then(|delta| delta.get_mut("tool_calls"));
            if let Some(Value::Array(calls)) = calls {
                for call in calls.iter_mut() {
                    if let Some(index) = call.get("index").and_then(Value::as_u64) {
                        call["index"] = json!(index + 1);
                    }
                }
            }
        }
    }
    Chunk::Forward {
        line: sse(&Value::Object(chunk)),
        chars,
    }
}

/// An object's members in their order, each value read as `V` reads it
/// (raw JSON unless told otherwise). Up to eight on the stack: a chunk's
/// are read with no allocation.
pub(super) struct Members<'a, V = &'a serde_json::value::RawValue>(
    pub(super) SmallVec<[(&'a str, V); 8]>,
);

/// How a member's value is read, knowing its name.
pub(super) trait MemberValue<'de>: Sized {
    fn next<A: serde::de::MapAccess<'de>>(name: &'de str, map: &mut A) -> Result<Self, A::Error>;
}

impl<'de> MemberValue<'de> for &'de serde_json::value::RawValue {
    fn next<A: serde::de::MapAccess<'de>>(_: &'de str, map: &mut A) -> Result<Self, A::Error> {
        map.next_value()
    }
}

/// Whether two of `members` have one name (a tree keeps the last; the
/// fast readers leave such an object to it). Compared pairwise when few,
/// sorted when many: an upstream's object of many thousand members must
/// not cost a worker seconds.
pub(super) fn repeats_a_name<T>(members: &[(&str, T)]) -> bool {
    if members.len() <= 16 {
        return members
            .iter()
            .enumerate()
            .any(|(i, (name, _))| members[..i].iter().any(|(seen, _)| seen == name));
    }
    let mut names: Vec<&str> = members.iter().map(|(name, _)| *name).collect();
    names.sort_unstable();
    names.windows(2).any(|pair| pair[0] == pair[1])
}

impl<'de, V: MemberValue<'de>> serde::Deserialize<'de> for Members<'de, V> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit<V>(std::marker::PhantomData<V>);
        impl<'de, V: MemberValue<'de>> serde::de::Visitor<'de> for Visit<V> {
            type Value = Members<'de, V>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                let mut members = SmallVec::new();
                while let Some(name) = map.next_key::<&'de str>()? {
                    members.push((name, V::next(name, &mut map)?));
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// A chunk's choices, as far as the relay reads them: how many, and the
/// characters of text their deltas carry (summed as they are read, with
/// no vector of them).
struct ChoicesText {
    count: usize,
    chars: usize,
}

/// A chunk's `choices` member: read as [`ChoicesText`] when it is an
/// array, passed over when it is anything else (which a tree reads as no
/// choices).
struct ChoicesMember(Option<ChoicesText>);

impl<'de> serde::Deserialize<'de> for ChoicesMember {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::IgnoredAny;
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = ChoicesMember;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a chunk's choices")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut choices = ChoicesText { count: 0, chars: 0 };
                while let Some(Object(choice)) = seq.next_element::<Object<ChoiceText>>()? {
                    choices.count += 1;
                    choices.chars += choice.chars();
                }
                Ok(ChoicesMember(Some(choices)))
            }
            // An object (a number too, under `arbitrary_precision`).
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(ChoicesMember(None))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(ChoicesMember(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(ChoicesMember(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(ChoicesMember(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(ChoicesMember(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(ChoicesMember(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
                Ok(ChoicesMember(None))
            }
        }
        deserializer.deserialize_any(Visit)
    }
}

/// A choice of a chunk, as far as the relay reads it: its delta's text.
#[derive(serde::Deserialize)]
struct ChoiceText {
    #[serde(default)]
    delta: Option<Object<DeltaText>>,
}

#[derive(serde::Deserialize)]
struct DeltaText {
    #[serde(default)]
    content: Option<TextLen>,
}

impl ChoiceText {
    fn chars(&self) -> usize {
        self.delta
            .as_ref()
            .and_then(|Object(delta)| delta.content.as_ref())
            .map_or(0, |text| text.0)
    }
}

/// `T` read from a JSON object only: a derived struct also reads an array
/// (its elements as the fields, in order), where a tree finds no members.
struct Object<T>(T);

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for Object<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for Visit<T> {
            type Value = Object<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<Object<T>, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Object)
            }
        }
        deserializer.deserialize_map(Visit(std::marker::PhantomData))
    }
}

/// The length of a JSON string, read without keeping the string.
pub(super) struct TextLen(pub(super) usize);

impl<'de> serde::Deserialize<'de> for TextLen {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = TextLen;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<TextLen, E> {
                Ok(TextLen(text.len()))
            }
        }
        deserializer.deserialize_str(Visit)
    }
}

/// `json` as a server-sent event, as it is.
fn sse_raw(json: &[u8]) -> Bytes {
    let mut line = Vec::with_capacity(json.len() + 8);
    line.extend_from_slice(b"data: ");
    line.extend_from_slice(json);
    line.extend_from_slice(b"\n\n");
    Bytes::from(line)
}

pub(super) fn sse(value: &(impl serde::Serialize + ?Sized)) -> Bytes {
    let mut line = Vec::with_capacity(256);
    line.extend_from_slice(b"data: ");
    // What is written here (JSON trees, and structs of them with string
    // keys) cannot fail to serialize.
    let _ = serde_json::to_writer(&mut line, value);
    line.extend_from_slice(b"\n\n");
    Bytes::from(line)
}

/// The bytes of text in `choices`' `member` (`message` of an answer,
/// `delta` of a chunk): what a completion's tokens are estimated from when
/// its usage is not told.
pub(super) fn text_chars(choices: Option<&Value>, member: &str) -> usize {
    choices
        .and_then(Value::as_array)
        .map(|choices| {
            choices
                .iter()
                .map(|c| c[member]["content"].as_str().map_or(0, str::len))
                .sum()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::{Chunk, ChunkHead, Members, read_chunk, read_chunk_tree, value_text};
    use proptest::prelude::*;
    use serde_json::{Value, json};

    /// What a line says: its JSON, after `data: `.
    fn said(line: &[u8]) -> Value {
        let text = std::str::from_utf8(line).unwrap();
        let json = text
            .strip_prefix("data: ")
            .unwrap()
            .strip_suffix("\n\n")
            .unwrap();
        serde_json::from_str(json).unwrap()
    }

    /// Both readers on one chunk (each with a fresh stream): the fast one's
    /// verdict, when it gives one, is the tree's.
    fn agree(json: &[u8]) -> Result<bool, TestCaseError> {
        let (mut fast_head, mut tree_head) = (
            ChunkHead::new("chatcmpl-x", "m"),
            ChunkHead::new("chatcmpl-x", "m"),
        );
        let (mut fast_usage, mut tree_usage) = (None, None);
        let tree = read_chunk_tree(json, &mut tree_head, &mut tree_usage, false);
        let Some(fast) = read_chunk(json, &mut fast_head, &mut fast_usage) else {
            return Ok(false);
        };
        prop_assert_eq!(&fast_usage, &tree_usage);
        match (fast, tree) {
            (Chunk::Skip, Chunk::Skip) => {}
            (Chunk::Error(a), Chunk::Error(b)) => prop_assert_eq!(said(&a), said(&b)),
            (Chunk::Forward { line: a, chars: x }, Chunk::Forward { line: b, chars: y }) => {
                prop_assert_eq!(x, y);
                // Written into a buffer of its exact length (no second
                // allocation to make it `Bytes`).
                let a = Vec::from(a);
                prop_assert_eq!(a.len(), a.capacity());
                let (a, b) = (said(&a), said(&b));
                // `created` is now in both when the chunk has none.
                if json_has(json, "created") {
                    prop_assert_eq!(a, b);
                } else {
                    let strip = |mut v: Value| {
                        v.as_object_mut().unwrap().remove("created");
                        v
                    };
                    prop_assert_eq!(strip(a), strip(b));
                }
            }
            _ => prop_assert!(
                false,
                "the readers disagree on {}",
                String::from_utf8_lossy(json)
            ),
        }
        Ok(true)
    }

    fn json_has(json: &[u8], key: &str) -> bool {
        serde_json::from_slice::<Value>(json).is_ok_and(|v| v.get(key).is_some())
    }

    #[test]
    fn the_usual_chunks_take_the_fast_way_and_agree() {
        for chunk in [
            json!({"id": "up", "object": "chat.completion.chunk", "created": 1_800_000_000u64, "model": "up-model",
                   "system_fingerprint": "fp", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "héllo \"q\" \n"},
                   "logprobs": null, "finish_reason": null}]}),
            json!({"id": "up", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}),
            json!({"id": "up", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}),
            json!({"error": {"message": "overloaded", "type": "server_error"}}),
            json!({"choices": [{"delta": {"content": null, "tool_calls": [{"index": 0}]}}, {"delta": {"content": "ab"}}], "x-extra": [1, 2.50]}),
        ] {
            for json in [
                serde_json::to_vec(&chunk).unwrap(),
                serde_json::to_vec_pretty(&chunk).unwrap(),
            ] {
                assert!(agree(&json).unwrap(), "{chunk} went the slow way");
            }
        }
    }

    /// Past eight members (those read into the heap), the fast way still.
    #[test]
    fn a_chunk_of_many_members_takes_the_fast_way_and_agrees() {
        let mut chunk = json!({"id": "up", "object": "chat.completion.chunk", "created": 1_800_000_000u64,
            "model": "up-model", "choices": [{"index": 0, "delta": {"content": "hi"}}]});
        for i in 0..8 {
            chunk[format!("x_{i}")] = json!(i);
        }
        let json = serde_json::to_vec(&chunk).unwrap();
        assert!(agree(&json).unwrap(), "{chunk} went the slow way");
    }

    #[test]
    fn chunks_out_of_the_ordinary_go_the_tree_way() {
        for json in [
            &br#"{"choices":[{"delta":{"content":"a"}}],"choices":[]}"#[..],
            br#"{"choices":[{"delta":{"content":[{"type":"text","text":"a"}]}}]}"#,
            br#"{"choices":[null]}"#,
            br#"{"ch\u006fices":[{"delta":{"content":"a"}}]}"#,
            // A name with an escape (serde_json cannot lend it).
            br#"{"choices":[{"delta":{"content":"a"}}],"a\"b":1}"#,
            br#"[1,2]"#,
            b"not json",
            // Not UTF-8 (the tree reader skips it).
            b"{\"choices\":[{\"delta\":{\"content\":\"\xff\"}}]}",
            // A choice or a delta that is an array (a derived struct reads
            // its elements as the fields; a tree finds no text).
            br#"{"choices":[[{"content":"ab"}]]}"#,
            br#"{"choices":[{"delta":["ab"]}]}"#,
            // What raw members pass on and a tree refuses: an escaped
            // surrogate, or more than a hundred arrays and objects.
            br#"{"choices":[{"delta":{"content":"a"}}],"x":"\ud800"}"#,
            br#"{"error":{"message":"\udc00"}}"#,
        ] {
            let (mut head, mut usage) = (ChunkHead::new("c", "m"), None);
            assert!(
                read_chunk(json, &mut head, &mut usage).is_none(),
                "{}",
                String::from_utf8_lossy(json)
            );
        }
        let deep = format!(
            r#"{{"choices":[{{"delta":{{"content":"a"}}}}],"x":{}1{}}}"#,
            "[".repeat(130),
            "]".repeat(130)
        );
        let (mut head, mut usage) = (ChunkHead::new("c", "m"), None);
        assert!(read_chunk(deep.as_bytes(), &mut head, &mut usage).is_none());
    }

    #[test]
    fn repeated_names_are_found_among_few_members_and_many() {
        use super::repeats_a_name;
        for count in [0, 1, 2, 16, 17, 50_000] {
            let names: Vec<String> = (0..count).map(|n| format!("k{n}")).collect();
            let mut members: Vec<(&str, ())> = names.iter().map(|n| (n.as_str(), ())).collect();
            assert!(!repeats_a_name(&members), "{count} distinct");
            if count > 0 {
                members.push((names[count / 2].as_str(), ()));
                assert!(repeats_a_name(&members), "{count} and a repeat");
            }
        }
    }

    fn member() -> impl Strategy<Value = (String, Value)> {
        let text = prop_oneof![
            Just(Value::Null),
            any::<String>().prop_map(Value::from),
            Just(json!(7))
        ];
        let choice = (text, proptest::option::of(prop_oneof![Just("stop"), Just("length")]))
            .prop_map(|(content, finish)| json!({"index": 0, "delta": {"content": content}, "finish_reason": finish}));
        prop_oneof![
            proptest::collection::vec(choice, 0..3)
                .prop_map(|c| ("choices".to_owned(), Value::from(c))),
            // Choices that are not an array: no choices, to a tree.
            prop_oneof![
                Just(Value::Null),
                Just(json!({"0": {"delta": {"content": "a"}}})),
                Just(json!("choices")),
                Just(json!(true)),
                // Numbers of every kind serde_json reads (`arbitrary_precision`
                // hands the visitor any of them as a map).
                prop_oneof![
                    Just("12.5"),
                    Just("-1"),
                    Just("1"),
                    Just("1e400"),
                    Just("-0"),
                    Just("18446744073709551616"),
                ]
                .prop_map(|n| serde_json::from_str::<Value>(n).unwrap()),
            ]
            .prop_map(|c| ("choices".to_owned(), c)),
            (0u64..1000).prop_map(|n| ("usage".to_owned(), json!({"completion_tokens": n}))),
            Just(("usage".to_owned(), Value::Null)),
            Just(("error".to_owned(), json!({"message": "no"}))),
            prop_oneof![
                Just(json!(1_800_000_000u64)),
                Just(Value::Null),
                Just(json!("x"))
            ]
            .prop_map(|v| ("created".to_owned(), v)),
            ("[a-z_]{1,12}", any::<String>()).prop_map(|(k, v)| (k, Value::from(v))),
            // Any name: one that needs an escape goes the tree way.
            (any::<String>(), any::<String>()).prop_map(|(k, v)| (k, Value::from(v))),
        ]
    }

    proptest! {
        /// Any chunk: the fast reader answers as the tree reader does, or
        /// leaves the chunk to it.
        #[test]
        fn the_fast_reader_is_the_tree_reader(
            members in proptest::collection::vec((member(), spaces()), 0..12),
            last in space(),
            pretty in any::<bool>(),
        ) {
            let mut object = String::from("{");
            for (i, ((name, value), [a, b, c, d])) in members.iter().enumerate() {
                if i > 0 {
                    object.push(',');
                }
                object.push_str(a);
                object.push_str(&serde_json::to_string(name).unwrap());
                object.push_str(b);
                object.push(':');
                object.push_str(c);
                if pretty {
                    object.push_str(&serde_json::to_string_pretty(value).unwrap());
                } else {
                    object.push_str(&value.to_string());
                }
                object.push_str(d);
            }
            object.push('}');
            object.push_str(last);
            agree(object.as_bytes())?;
        }

        /// The text found for each member by where it stands is the text
        /// serde_json captures raw, whatever the whitespace around it.
        #[test]
        fn a_value_found_by_its_place_is_the_raw_value(
            members in proptest::collection::vec((name(), any_json(), spaces()), 1..8),
            first in space(),
            last in space(),
        ) {
            let mut object = format!("{first}{{");
            for (i, (name, value, [a, b, c, d])) in members.iter().enumerate() {
                if i > 0 {
                    object.push(',');
                }
                object.push_str(&format!("{a}\"{name}\"{b}:{c}{value}{d}"));
            }
            object.push('}');
            object.push_str(last);
            let Members(read): Members = serde_json::from_str(&object).unwrap();
            for (i, (_, raw)) in read.iter().enumerate() {
                prop_assert_eq!(value_text(&object, &read, i), Some(raw.get()));
            }
        }
    }

    /// A name serde_json lends (one with no escapes): any text but `"`,
    /// `\` and control characters, the empty name and others not ASCII
    /// among them.
    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            "[a-z_]{1,8}",
            any::<String>().prop_map(|name| name
                .chars()
                .filter(|c| !matches!(c, '"' | '\\') && !c.is_control())
                .collect()),
        ]
    }

    /// JSON's whitespace, as it may stand around a name or a value.
    fn space() -> impl Strategy<Value = &'static str> {
        prop_oneof![Just(""), Just(""), Just(" "), Just("\n  "), Just("\t\r\n ")]
    }

    fn spaces() -> impl Strategy<Value = [&'static str; 4]> {
        [space(), space(), space(), space()]
    }

    /// A JSON value's text, compact or pretty, of any kind.
    fn any_json() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<String>().prop_map(Value::from),
        ];
        let value = leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::btree_map("[a-z]{1,3}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        });
        (value, any::<bool>()).prop_map(|(value, pretty)| {
            if pretty {
                serde_json::to_string_pretty(&value).unwrap()
            } else {
                value.to_string()
            }
        })
    }
}
