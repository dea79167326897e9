//! The brand, and every wire name derived from it.
//!
//! The spec writes `service` where the brand goes. Deriving all names here
//! means a deployment that sets `brand = "venice"` speaks that API's dialect
//! everywhere at once.

/// Wire names derived from the configured brand, computed once at start.
#[derive(Debug, Clone)]
pub struct Brand {
    pub name: String,
    /// `<brand>_parameters`, the request and response member.
    pub parameters_field: String,
    /// `include_<brand>_system_prompt`, a member of the parameters object.
    pub include_system_prompt_field: String,
    /// `<BRAND>`, the prefix of API key secrets (`<BRAND>_INFERENCE_KEY_...`).
    pub key_prefix: String,
    pub header_version: String,
    pub header_host_name: String,
    pub header_model_id: String,
    pub header_model_name: String,
    pub header_model_router: String,
    pub header_model_deprecation_warning: String,
    pub header_model_deprecation_date: String,
    pub header_balance_usd: String,
    pub header_balance_diem: String,
    /// The server's time when it answered (ISO 8601, milliseconds).
    pub header_timestamp: String,
    /// The client's own request time in milliseconds, echoed when sent.
    pub header_request_timestamp_ms: String,
    /// Why a request's web search was left out (the provider failed).
    pub header_web_search_error: String,
    /// Whether a generated image came back blurred (safe mode).
    pub header_is_blurred: String,
    /// Whether what was asked for broke the content policy.
    pub header_is_content_violation: String,
}

impl Brand {
    pub fn new(name: &str) -> Self {
        let name = name.trim().to_ascii_lowercase();
        let header = |suffix: &str| format!("x-{name}-{suffix}");
        Self {
            parameters_field: format!("{name}_parameters"),
            include_system_prompt_field: format!("include_{name}_system_prompt"),
            key_prefix: name.to_ascii_uppercase().replace('-', "_"),
            header_version: header("version"),
            header_host_name: header("host-name"),
            header_model_id: header("model-id"),
            header_model_name: header("model-name"),
            header_model_router: header("model-router"),
            header_model_deprecation_warning: header("model-deprecation-warning"),
            header_model_deprecation_date: header("model-deprecation-date"),
            header_balance_usd: header("balance-usd"),
            header_balance_diem: header("balance-diem"),
            header_timestamp: header("timestamp"),
            header_request_timestamp_ms: header("request-timestamp-ms"),
            header_web_search_error: header("web-search-error"),
            header_is_blurred: header("is-blurred"),
            header_is_content_violation: header("is-content-violation"),
            name,
        }
    }

    /// Whether a brand name is usable in header names and JSON members.
    pub fn is_valid_name(name: &str) -> bool {
        !name.is_empty()
            && name.len() <= 32
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    }
}

impl Default for Brand {
    fn default() -> Self {
        Self::new("rialto")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_brand() {
        let brand = Brand::new("Venice");
        assert_eq!(brand.parameters_field, "venice_parameters");
        assert_eq!(
            brand.include_system_prompt_field,
            "include_venice_system_prompt"
        );
        assert_eq!(brand.header_version, "x-venice-version");
        assert_eq!(brand.header_model_router, "x-venice-model-router");
        assert_eq!(brand.key_prefix, "VENICE");
    }

    #[test]
    fn rejects_names_that_cannot_be_headers() {
        assert!(Brand::is_valid_name("rialto"));
        assert!(!Brand::is_valid_name(""));
        assert!(!Brand::is_valid_name("two words"));
        assert!(!Brand::is_valid_name("x:y"));
    }
}
