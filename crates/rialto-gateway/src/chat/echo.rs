//! The `<brand>_parameters` echo of a chat: what it asked for, corrected to
//! what was effective, written into its answer (and a stream's citations
//! chunk).
//!
//! A struct, not a JSON map: the map's ten members cost every chat ~3,000
//! instructions of inserts and key strings to build and as many to write
//! and drop, for members whose names are fixed (one is the brand's).

use serde_json::Value;

use crate::augment::SearchMode;

/// The echo's members. `enable_e2ee` is always false (end-to-end
/// encryption is not offered).
#[derive(Debug)]
pub(crate) struct Echo {
    /// A public character the chat speaks as.
    pub(crate) character_slug: Option<String>,
    pub(crate) web_search: SearchMode,
    pub(crate) web_citations: bool,
    pub(crate) web_scraping: bool,
    /// `include_<brand>_system_prompt`.
    pub(crate) include_system_prompt: bool,
    pub(crate) search_results_in_stream: bool,
    pub(crate) search_results_as_documents: bool,
    pub(crate) strip_thinking_response: bool,
    pub(crate) disable_thinking: bool,
    /// The sources found, when the web was looked at.
    pub(crate) web_search_citations: Option<Vec<Value>>,
}

impl Default for Echo {
    fn default() -> Self {
        Self {
            character_slug: None,
            web_search: SearchMode::Off,
            web_citations: false,
            web_scraping: false,
            include_system_prompt: true,
            search_results_in_stream: false,
            search_results_as_documents: false,
            strip_thinking_response: false,
            disable_thinking: false,
            web_search_citations: None,
        }
    }
}

impl Echo {
    /// Writes the echo as a JSON object, its members in the hosted API's
    /// order; `include_prompt_field` is `include_<brand>_system_prompt`.
    pub(crate) fn write_json(&self, out: &mut Vec<u8>, include_prompt_field: &str) {
        fn flag(out: &mut Vec<u8>, name: &[u8], value: bool) {
            out.extend_from_slice(name);
            out.extend_from_slice(if value { b"true" } else { b"false" });
        }
        // Writing strings and trees into a Vec cannot fail.
        out.extend_from_slice(b"{\"enable_e2ee\":false,");
        let _ = serde_json::to_writer(&mut *out, include_prompt_field);
        flag(out, b":", self.include_system_prompt);
        flag(
            out,
            b",\"include_search_results_in_stream\":",
            self.search_results_in_stream,
        );
        flag(
            out,
            b",\"return_search_results_as_documents\":",
            self.search_results_as_documents,
        );
        if let Some(citations) = &self.web_search_citations {
            out.extend_from_slice(b",\"web_search_citations\":");
            let _ = serde_json::to_writer(&mut *out, citations);
        }
        out.extend_from_slice(b",\"enable_web_search\":\"");
        out.extend_from_slice(self.web_search.name().as_bytes());
        out.push(b'"');
        flag(out, b",\"enable_web_scraping\":", self.web_scraping);
        flag(out, b",\"enable_web_citations\":", self.web_citations);
        flag(
            out,
            b",\"strip_thinking_response\":",
            self.strip_thinking_response,
        );
        flag(out, b",\"disable_thinking\":", self.disable_thinking);
        if let Some(slug) = &self.character_slug {
            out.extend_from_slice(b",\"character_slug\":");
            let _ = serde_json::to_writer(&mut *out, slug);
        }
        out.push(b'}');
    }

    /// The echo as a JSON tree, for the answers written as one (rare: an
    /// answer with the web's documents, one the fast reader did not read,
    /// a stream's citations chunk).
    pub(crate) fn to_value(&self, include_prompt_field: &str) -> Value {
        let mut out = Vec::with_capacity(512);
        self.write_json(&mut out, include_prompt_field);
        serde_json::from_slice(&out).unwrap_or(Value::Null)
    }
}

#[cfg(test)]
mod tests {
    use super::Echo;
    use crate::augment::SearchMode;
    use serde_json::json;

    #[test]
    fn the_default_echo_is_every_required_member_off_but_the_system_prompt() {
        assert_eq!(
            Echo::default().to_value("include_rialto_system_prompt"),
            json!({
                "enable_e2ee": false,
                "include_rialto_system_prompt": true,
                "include_search_results_in_stream": false,
                "return_search_results_as_documents": false,
                "enable_web_search": "off",
                "enable_web_scraping": false,
                "enable_web_citations": false,
                "strip_thinking_response": false,
                "disable_thinking": false,
            })
        );
    }

    #[test]
    fn every_member_is_written_and_strings_are_escaped() {
        let echo = Echo {
            character_slug: Some("the \"quoted\" \\ é\n".into()),
            web_search: SearchMode::Auto,
            web_citations: true,
            web_scraping: true,
            include_system_prompt: false,
            search_results_in_stream: true,
            search_results_as_documents: true,
            strip_thinking_response: true,
            disable_thinking: true,
            web_search_citations: Some(vec![json!({"title": "A \"page\"", "url": "https://a/"})]),
        };
        let mut out = Vec::new();
        echo.write_json(&mut out, "include_odd\"brand_system_prompt");
        let written: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            written,
            json!({
                "enable_e2ee": false,
                "include_odd\"brand_system_prompt": false,
                "include_search_results_in_stream": true,
                "return_search_results_as_documents": true,
                "web_search_citations": [{"title": "A \"page\"", "url": "https://a/"}],
                "enable_web_search": "auto",
                "enable_web_scraping": true,
                "enable_web_citations": true,
                "strip_thinking_response": true,
                "disable_thinking": true,
                "character_slug": "the \"quoted\" \\ é\n",
            })
        );
        // The hosted API's order of members.
        let text = String::from_utf8(out).unwrap();
        let at = |name: &str| text.find(name).unwrap();
        assert!(at("enable_e2ee") < at("include_odd"));
        assert!(at("web_search_citations") < at("enable_web_search"));
        assert!(at("disable_thinking") < at("character_slug"));
    }

    #[test]
    fn citations_found_empty_are_an_empty_list() {
        let echo = Echo {
            web_search: SearchMode::On,
            web_search_citations: Some(Vec::new()),
            ..Echo::default()
        };
        assert_eq!(echo.to_value("x")["web_search_citations"], json!([]));
    }
}
