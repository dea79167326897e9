//! The billing service: prices usage from the model catalog.
//!
//! Here billing quotes what a request cost from the model's configured prices
//! per million tokens, exactly (decimal arithmetic, never floats). The prepaid
//! ledger (holds before the call, settlement after, balances, x402 top-ups)
//! arrives with the billing issue behind this same interface.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use rialto_core::config::price_decimal;
use rialto_core::{Error, ErrorCode, ModelConfig, Result};
use rialto_proto::billing::v1 as pb;
use rust_decimal::Decimal;

pub mod grpc;

/// Billing in domain terms.
#[async_trait]
pub trait BillingService: Send + Sync + 'static {
    /// The cost of `usage` on `model_id`.
    async fn quote(&self, request: pb::QuoteRequest) -> Result<pb::Cost>;
}

/// A cloneable handle on billing, local or remote.
#[derive(Clone)]
pub struct BillingClient(Arc<dyn BillingService>);

impl BillingClient {
    pub fn new(service: impl BillingService) -> Self {
        Self(Arc::new(service))
    }
}

impl std::ops::Deref for BillingClient {
    type Target = dyn BillingService;

    fn deref(&self) -> &Self::Target {
        self.0.as_ref()
    }
}

impl std::fmt::Debug for BillingClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BillingClient")
    }
}

/// USD prices of one model per million tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Prices {
    pub input: Decimal,
    pub output: Decimal,
    pub cached_input: Decimal,
    pub cache_write: Decimal,
}

impl Prices {
    pub fn from_model(model: &ModelConfig) -> Self {
        let input = price_decimal(model.input_usd_per_mtok);
        Self {
            input,
            output: price_decimal(model.output_usd_per_mtok),
            // Without a cache price, cached tokens cost what input costs.
            cached_input: model.cached_input_usd_per_mtok.map_or(input, price_decimal),
            cache_write: model.cache_write_usd_per_mtok.map_or(input, price_decimal),
        }
    }

    /// Exact USD cost of `usage`.
    pub fn cost(&self, usage: &pb::Usage) -> Decimal {
        let cached = usage.cached_prompt_tokens.min(usage.prompt_tokens);
        let written = usage.cache_write_tokens.min(usage.prompt_tokens - cached);
        let plain = usage.prompt_tokens - cached - written;
        let per_mtok = Decimal::from(plain) * self.input
            + Decimal::from(cached) * self.cached_input
            + Decimal::from(written) * self.cache_write
            + Decimal::from(usage.completion_tokens) * self.output;
        (per_mtok / Decimal::from(1_000_000u32)).normalize()
    }
}

/// In-process billing over the configured price table.
#[derive(Debug)]
pub struct LocalBilling {
    prices: HashMap<String, Prices>,
}

impl LocalBilling {
    pub fn new(models: &[ModelConfig]) -> Self {
        Self {
            prices: models
                .iter()
                .map(|m| (m.id.clone(), Prices::from_model(m)))
                .collect(),
        }
    }
}

#[async_trait]
impl BillingService for LocalBilling {
    async fn quote(&self, request: pb::QuoteRequest) -> Result<pb::Cost> {
        let prices = self
            .prices
            .get(&request.model_id)
            .ok_or_else(|| Error::new(ErrorCode::ModelNotFound, "Specified model not found"))?;
        let usage = request.usage.unwrap_or_default();
        Ok(pb::Cost {
            usd: prices.cost(&usage).to_string(),
            diem: "0".to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(input: f64, output: f64) -> ModelConfig {
        let toml = format!(
            "[[models]]\nid = \"m\"\ninput_usd_per_mtok = {input}\noutput_usd_per_mtok = {output}\n"
        );
        rialto_core::Config::from_toml(&toml).unwrap().models[0].clone()
    }

    #[tokio::test]
    async fn quotes_are_exact() {
        let billing = LocalBilling::new(&[model(0.15, 0.6)]);
        let cost = billing
            .quote(pb::QuoteRequest {
                model_id: "m".into(),
                usage: Some(pb::Usage {
                    prompt_tokens: 612,
                    completion_tokens: 146,
                    ..Default::default()
                }),
            })
            .await
            .unwrap();
        // 612 * 0.15 / 1e6 + 146 * 0.6 / 1e6 = 0.0000918 + 0.0000876
        assert_eq!(cost.usd, "0.0001794");
        assert_eq!(cost.diem, "0");
    }

    #[test]
    fn cached_tokens_use_the_cache_price() {
        let mut config = model(1.0, 2.0);
        config.cached_input_usd_per_mtok = Some(0.1);
        let prices = Prices::from_model(&config);
        let usage = pb::Usage {
            prompt_tokens: 1_000_000,
            cached_prompt_tokens: 500_000,
            completion_tokens: 0,
            cache_write_tokens: 0,
        };
        assert_eq!(prices.cost(&usage).to_string(), "0.55");
    }

    #[tokio::test]
    async fn unknown_models_have_no_price() {
        let billing = LocalBilling::new(&[]);
        let error = billing
            .quote(pb::QuoteRequest {
                model_id: "nope".into(),
                usage: None,
            })
            .await
            .unwrap_err();
        assert_eq!(error.code, ErrorCode::ModelNotFound);
    }
}
