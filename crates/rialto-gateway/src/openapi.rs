//! `GET /openapi.yaml`: the OpenAPI 3.0 description of what this server does.
//!
//! `openapi.yaml` is written with `{{brand}}` and `{{revision}}` placeholders,
//! filled once at start so the document names this deployment's headers and
//! fields and carries the build revision as `info.version`.

use actix_web::{HttpResponse, web};
use rialto_core::Brand;

use crate::Gateway;

const TEMPLATE: &str = include_str!("openapi.yaml");

pub fn render(brand: &Brand, revision: &str) -> String {
    TEMPLATE
        .replace("{{brand}}", &brand.name)
        .replace("{{revision}}", revision)
}

pub async fn document(gateway: web::Data<Gateway>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/yaml")
        .body(gateway.openapi.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_all_filled() {
        let document = render(&Brand::new("venice"), "20261122.001500");
        assert!(!document.contains("{{"));
        assert!(document.contains("venice_parameters"));
        assert!(document.contains("20261122.001500"));
    }
}
