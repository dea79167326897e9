//! Removing `<think>…</think>` blocks from an answer, whole or streamed.
//!
//! A stream can split a tag anywhere (`<th` in one chunk, `ink>` in the
//! next), hold several blocks, or end inside one. [`ThinkStripper`] is a
//! small state machine fed chunk by chunk: it holds back only the
//! characters that could still be the start of a tag, so it emits every
//! visible character as soon as it can be sure of it. One stripper per
//! choice: with `n > 1` the choices interleave. Whitespace right after a
//! closed block (models put a blank line there) is dropped until the first
//! visible character.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Strips think blocks from text arriving in pieces.
#[derive(Debug, Clone)]
pub struct ThinkStripper {
    inside: bool,
    /// A tail that may be the beginning of the next tag.
    pending: String,
    /// Nothing visible since the last closed block (or the start): leading
    /// whitespace is dropped.
    at_start: bool,
}

impl Default for ThinkStripper {
    fn default() -> Self {
        Self {
            inside: false,
            pending: String::new(),
            at_start: true,
        }
    }
}

impl ThinkStripper {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds the next piece; returns what of the text is now known visible.
    pub fn push(&mut self, piece: &str) -> String {
        let mut text = std::mem::take(&mut self.pending);
        text.push_str(piece);
        let mut visible = String::new();
        let mut rest = text.as_str();
        loop {
            let tag = if self.inside { CLOSE } else { OPEN };
            if let Some(at) = rest.find(tag) {
                if !self.inside {
                    self.emit(&mut visible, &rest[..at]);
                }
                rest = &rest[at + tag.len()..];
                self.inside = !self.inside;
                if !self.inside {
                    self.at_start = true;
                }
                continue;
            }
            // Hold back the longest tail that could begin the tag.
            let keep = (1..tag.len())
                .rev()
                .find(|&n| {
                    rest.len() >= n
                        && rest.is_char_boundary(rest.len() - n)
                        && tag.starts_with(&rest[rest.len() - n..])
                })
                .unwrap_or(0);
            let (done, tail) = rest.split_at(rest.len() - keep);
            if !self.inside {
                self.emit(&mut visible, done);
            }
            self.pending = tail.to_owned();
            return visible;
        }
    }

    /// The end of the text: a held-back tail that never became a tag is
    /// text; an unclosed block is dropped.
    pub fn finish(&mut self) -> String {
        let pending = std::mem::take(&mut self.pending);
        let mut visible = String::new();
        if !self.inside {
            self.emit(&mut visible, &pending);
        }
        visible
    }

    fn emit(&mut self, visible: &mut String, text: &str) {
        let text = if self.at_start {
            text.trim_start()
        } else {
            text
        };
        if !text.is_empty() {
            self.at_start = false;
            visible.push_str(text);
        }
    }
}

/// Strips think blocks from a whole text.
pub fn strip(text: &str) -> String {
    let mut stripper = ThinkStripper::new();
    let mut visible = stripper.push(text);
    visible.push_str(&stripper.finish());
    visible
}

#[cfg(test)]
mod tests {
    use super::*;

    const CASES: [(&str, &str); 7] = [
        ("<think>plan</think>\n\nHello!", "Hello!"),
        (
            "Hello <think>a</think>world<think>b</think>!",
            "Hello world!",
        ),
        ("no tags at all", "no tags at all"),
        ("<think>never closed", ""),
        ("answer <thin", "answer <thin"),
        (
            "a < b and <thinking> is not a tag",
            "a < b and <thinking> is not a tag",
        ),
        ("<think>x</think><think>y</think> é ü", "é ü"),
    ];

    #[test]
    fn whole_texts() {
        for (input, expected) in CASES {
            assert_eq!(strip(input), expected, "{input:?}");
        }
    }

    /// Every way of cutting each case in two, and in three, and one
    /// character at a time, gives the same answer as the whole.
    #[test]
    fn every_split_position_gives_the_same_answer() {
        for (input, expected) in CASES {
            let bounds: Vec<usize> = (0..=input.len())
                .filter(|&i| input.is_char_boundary(i))
                .collect();
            for &a in &bounds {
                for &b in bounds.iter().filter(|&&b| b >= a) {
                    let mut stripper = ThinkStripper::new();
                    let mut out = stripper.push(&input[..a]);
                    out.push_str(&stripper.push(&input[a..b]));
                    out.push_str(&stripper.push(&input[b..]));
                    out.push_str(&stripper.finish());
                    assert_eq!(out, expected, "{input:?} cut at {a} and {b}");
                }
            }
            let mut stripper = ThinkStripper::new();
            let mut out: String = input
                .chars()
                .map(|c| stripper.push(&c.to_string()))
                .collect();
            out.push_str(&stripper.finish());
            assert_eq!(out, expected, "{input:?} one char at a time");
        }
    }

    /// Visible text is not held back longer than a possible tag needs.
    #[test]
    fn visible_text_streams_out_at_once() {
        let mut stripper = ThinkStripper::new();
        assert_eq!(stripper.push("Hello, wor"), "Hello, wor");
        assert_eq!(stripper.push("ld <"), "ld ");
        assert_eq!(stripper.push("b>"), "<b>");
    }
}

/// Properties over generated text: a stream may split a tag anywhere.
#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    /// Text made of pieces that look like tags, so that cuts land inside
    /// them, with multi-byte characters among them.
    fn texts() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            Just("<think>"),
            Just("</think>"),
            Just("<th"),
            Just("ink>"),
            Just("</"),
            Just("<"),
            Just(">"),
            Just("a"),
            Just(" "),
            Just("\n"),
            Just("é"),
            Just("思"),
        ];
        proptest::collection::vec(piece, 0..48).prop_map(|pieces| pieces.concat())
    }

    proptest! {
        /// However a stream cuts the text, the stripper lets through what
        /// stripping the whole text does; text without a block passes as it is.
        #[test]
        fn any_cutting_strips_as_the_whole(
            text in texts(),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let boundaries: Vec<usize> = text
                .char_indices()
                .map(|(i, _)| i)
                .chain([text.len()])
                .collect();
            let mut points: Vec<usize> =
                cuts.iter().map(|c| boundaries[c.index(boundaries.len())]).collect();
            points.sort_unstable();
            points.dedup();
            let mut stripper = ThinkStripper::new();
            let mut streamed = String::new();
            let mut last = 0;
            for point in points {
                streamed.push_str(&stripper.push(&text[last..point]));
                last = point;
            }
            streamed.push_str(&stripper.push(&text[last..]));
            streamed.push_str(&stripper.finish());
            let whole = strip(&text);
            prop_assert_eq!(&streamed, &whole);
            // Nothing visible is lost: without a block, the text passes
            // as it is, but for the white space it starts with.
            if !text.contains(OPEN) {
                prop_assert_eq!(whole.as_str(), text.trim_start());
            }
        }
    }
}
