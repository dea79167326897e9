//! Stored responses of `POST /responses`: what `previous_response_id`
//! continues. Billing keeps them because it owns the per-owner database
//! rows; a response is read by its id and its owner only, so one account
//! can never continue another's conversation.

use std::sync::atomic::AtomicI64;

use rialto_core::db::{Database, now_ms};
use rialto_core::{Error, ErrorCode, Result};
use rialto_proto::billing::v1 as pb;
use sqlx::Row;

/// How long a stored response can be continued (OpenAI keeps them 30 days).
pub const RETENTION_MS: i64 = 30 * 24 * 3600 * 1000;
/// How often storing one also deletes the expired.
const SWEEP_EVERY_MS: i64 = 60 * 1000;
/// The largest stored body (a conversation's messages and its output).
pub const MAX_BODY_BYTES: usize = 8 << 20;

#[derive(Debug)]
pub struct ResponseStore {
    db: Database,
    last_sweep_ms: AtomicI64,
}

impl ResponseStore {
    pub fn new(db: Database) -> Self {
        Self {
            db,
            last_sweep_ms: AtomicI64::new(0),
        }
    }

    pub async fn put(&self, response: pb::StoredResponse) -> Result<()> {
        if response.id.is_empty() || response.owner.is_empty() {
            return Err(Error::invalid("a stored response has an id and an owner"));
        }
        if response.body.len() > MAX_BODY_BYTES {
            return Err(Error::invalid(format!(
                "a stored response is at most {MAX_BODY_BYTES} bytes"
            )));
        }
        let now = now_ms();
        self.sweep(now).await;
        sqlx::query(
            "INSERT INTO stored_responses (id, owner, body, created_at_ms, expires_at_ms) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (id) DO NOTHING",
        )
        .bind(&response.id)
        .bind(&response.owner)
        .bind(&response.body)
        .bind(now)
        .bind(now.saturating_add(RETENTION_MS))
        .execute(self.db.pool())
        .await?;
        Ok(())
    }

    pub async fn get(&self, request: &pb::GetResponseRequest) -> Result<pb::StoredResponse> {
        let row = sqlx::query(
            "SELECT body, created_at_ms FROM stored_responses \
             WHERE id = $1 AND owner = $2 AND expires_at_ms > $3",
        )
        .bind(&request.id)
        .bind(&request.owner)
        .bind(now_ms())
        .fetch_optional(self.db.pool())
        .await?
        .ok_or_else(|| Error::new(ErrorCode::NotFound, "Response not found"))?;
        Ok(pb::StoredResponse {
            id: request.id.clone(),
            owner: request.owner.clone(),
            body: row.try_get("body")?,
            created_at_ms: row.try_get("created_at_ms")?,
        })
    }

    async fn sweep(&self, now: i64) {
        if !crate::jobs::once_per(&self.last_sweep_ms, SWEEP_EVERY_MS, now) {
            return;
        }
        let swept = sqlx::query("DELETE FROM stored_responses WHERE expires_at_ms < $1")
            .bind(now)
            .execute(self.db.pool())
            .await;
        if let Err(error) = swept {
            tracing::warn!(%error, "could not delete expired stored responses");
        }
    }
}
