//! The durable queue of usage records: how a settlement survives billing
//! being down.
//!
//! The gateway settles each request directly ([`settle_durably`]). When
//! billing cannot be reached (killed, restarting, partitioned), the
//! settlement request (a usage record) goes to the durable queue
//! [`USAGE_QUEUE`] instead, and the response goes out: the client got what
//! the backend produced. Billing's consumer ([`spawn_usage_consumer`])
//! settles each record once billing is back and acknowledges it only after
//! the settlement committed; a record delivered twice, or one whose request
//! was settled directly after all (the reply was lost, not the commit),
//! settles nothing the second time: settlements are idempotent on the
//! request id. A hold that expired before its record arrived is settled
//! late ([`Ledger::settle_usage`](crate::ledger::Ledger::settle_usage)).

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use prost::Message;
use rialto_core::bus::Bus;
use rialto_core::{ErrorCode, Result};
use rialto_proto::billing::v1 as pb;

use crate::BillingClient;

/// The durable queue of usage records (JetStream stream `<prefix>-usage`,
/// subject `<prefix>.usage`).
pub const USAGE_QUEUE: &str = "usage";
/// The durable consumer the billing replicas share.
pub const USAGE_CONSUMER: &str = "billing-settlers";

/// How a settlement was made.
#[derive(Debug, Clone, PartialEq)]
pub enum Settled {
    /// Billing settled it and said what it cost.
    Now(pb::Cost),
    /// Billing could not be reached: the record is in the durable queue.
    Queued,
}

/// Settles `request` directly, or queues it on `queue` when billing fails.
/// Fails only when both failed, or billing failed and there is no queue
/// (the hold then expires, unsettled).
pub async fn settle_durably(
    billing: &BillingClient,
    queue: Option<&Bus>,
    request: pb::SettleRequest,
) -> Result<Settled> {
    let error = match billing.settle(request.clone()).await {
        Ok(cost) => return Ok(Settled::Now(cost)),
        Err(error) => error,
    };
    let Some(bus) = queue else {
        return Err(error);
    };
    tracing::warn!(%error, request_id = request.request_id, "settlement failed; queueing its usage record");
    let id = request.request_id.clone();
    bus.enqueue(USAGE_QUEUE, &id, Bytes::from(request.encode_to_vec()))
        .await
        .map_err(|queue_error| {
            tracing::error!(%queue_error, request_id = id, "cannot queue a usage record");
            error
        })?;
    Ok(Settled::Queued)
}

/// Whether a settlement failure can never succeed (retrying it is useless).
pub fn is_permanent(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::InvalidRequest | ErrorCode::ModelNotFound | ErrorCode::NotFound
    )
}

/// Settles the queued usage records, for ever: each is acknowledged once its
/// settlement committed (or was made before), and delivered again after a
/// pause otherwise.
pub fn spawn_usage_consumer(billing: BillingClient, bus: Bus) {
    tokio::spawn(async move {
        loop {
            match bus.consume(USAGE_QUEUE, USAGE_CONSUMER).await {
                Ok(mut records) => {
                    while let Some(record) = records.next().await {
                        // One span per record, in the trace of the request
                        // that queued it.
                        let span =
                            tracing::info_span!("settle queued usage", otel.kind = "consumer");
                        rialto_core::telemetry::set_parent(&span, record.trace.clone());
                        tracing::Instrument::instrument(handle(&billing, record), span).await;
                    }
                    tracing::warn!("usage queue ended; consuming again");
                }
                Err(error) => tracing::warn!(%error, "cannot consume usage records"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
}

async fn handle(billing: &BillingClient, record: rialto_core::bus::Delivery) {
    let request = match pb::SettleRequest::decode(record.payload.as_ref()) {
        Ok(request) => request,
        Err(error) => {
            tracing::error!(%error, "dropping an unreadable usage record");
            let _ = record.ack().await;
            return;
        }
    };
    match billing.settle(request.clone()).await {
        Ok(cost) => {
            tracing::info!(
                request_id = request.request_id,
                usd = cost.usd,
                diem = cost.diem,
                "settled a queued usage record"
            );
            if let Err(error) = record.ack().await {
                // Delivered again, and settled to nothing the second time.
                tracing::warn!(%error, "cannot acknowledge a usage record");
            }
        }
        Err(error) if is_permanent(error.code) => {
            tracing::error!(%error, request_id = request.request_id, "dropping a usage record that cannot be settled");
            let _ = record.ack().await;
        }
        Err(error) => {
            tracing::warn!(%error, request_id = request.request_id, "cannot settle a usage record yet");
            record.retry_later(Duration::from_secs(2)).await;
        }
    }
}
