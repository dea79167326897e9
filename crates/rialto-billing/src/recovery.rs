//! Recovery: holds nobody settles, and owners a dead process left open.
//!
//! A plain request's hold lives in memory only: when its time
//! (`billing.hold_ttl_secs`) is up it is dropped, charging nothing (its
//! gateway died before the answer, or billing restarted and the usage
//! record will be settled late from the balance). A stream's hold is in
//! the database with its last checkpoint and a lease that each checkpoint
//! renews: when the lease ends it is closed at its checkpoint (journaled
//! as `settle:<request id>`, kind `expire`); if the stream's usage record
//! arrives later after all (its gateway lived, billing did not answer and
//! the record waited in the durable queue), it is charged the rest of its
//! cost, once (`settle-rest:<request id>`). After a restart nobody has
//! those owners in memory:
//! [`Book::recover`] loads the owners whose durable holds outlived their
//! lease, and the next [`Book::sweep`] charges them.
//!
//! A closed hold stays in `holds` as the record of a stream's last
//! checkpoint for [`CLOSED_HOLD_RETENTION_MS`]; then
//! [`Book::forget_closed_holds`] deletes it, so the table keeps the size of
//! a month of streams rather than one row for every stream ever served.

use std::sync::Arc;

use rialto_core::Result;
use sqlx::Row;

use crate::book::{Book, IDLE, Owner, SettleOrder, decide_settle, queue};
use crate::writer::RecordKind;

/// How long a closed hold is kept after its stream began: 30 days.
pub const CLOSED_HOLD_RETENTION_MS: i64 = 30 * 86_400_000;

/// Closed holds deleted a statement.
const FORGET_BATCH: i64 = 1_000;

/// The shortest pause between two statements of deletions. On SQLite the
/// ledger's writer is another connection, on a thread of its own, that
/// waits (SQLite's busy handler: sleeps of 1 to 100 ms) for the write lock
/// a deletion holds: without a pause the next deletion would take the lock
/// again before the writer's next try, and its batches would wait for the
/// whole run.
const FORGET_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// One statement of deletions: at most `$2` closed holds whose streams
/// began before `$1`, found by `holds_closed`, the index of closed holds by
/// age.
pub(crate) const FORGET_CLOSED_HOLDS: &str = "DELETE FROM holds WHERE request_id IN \
     (SELECT request_id FROM holds WHERE state <> 'open' AND created_at_ms < $1 LIMIT $2)";

impl Book {
    /// Deletes the closed holds whose streams began over
    /// [`CLOSED_HOLD_RETENTION_MS`] before `now_ms`, a thousand a
    /// statement, with a pause after each at least twice as long as the
    /// statement took (and at least 100 ms), until none is left. Returns
    /// how many it deleted.
    ///
    /// Every billing replica runs it: on PostgreSQL two of them at once
    /// may delete the same rows (one waits for the other's row locks and
    /// then finds them gone) or, rarely, deadlock, which fails the run of
    /// one of them until the next.
    pub async fn forget_closed_holds(&self, now_ms: i64) -> Result<u64> {
        let before = now_ms.saturating_sub(CLOSED_HOLD_RETENTION_MS);
        let mut forgotten = 0;
        loop {
            let started = std::time::Instant::now();
            let deleted = sqlx::query(FORGET_CLOSED_HOLDS)
                .bind(before)
                .bind(FORGET_BATCH)
                .execute(self.shared.db.pool())
                .await?
                .rows_affected();
            forgotten += deleted;
            if deleted < FORGET_BATCH.unsigned_abs() {
                return Ok(forgotten);
            }
            tokio::time::sleep(FORGET_PAUSE.max(started.elapsed() * 2)).await;
        }
    }

    /// Expires holds past their time (a durable one is charged its last
    /// checkpoint) and drops idle owners. Returns how many holds expired.
    pub fn sweep(&self, now_ms: i64) -> usize {
        if self.shared.membership.get().is_some_and(|m| m.away()) {
            // Hung until a moment ago: what it holds is dropped once it
            // hears itself; nothing is expired from it before.
            return 0;
        }
        let owners: Vec<Arc<Owner>> = self
            .shared
            .shards
            .iter()
            .flat_map(|shard| {
                let shard = shard.lock().unwrap_or_else(|e| e.into_inner());
                shard.values().cloned().collect::<Vec<_>>()
            })
            .collect();
        let mut expired = 0;
        for entry in owners {
            let mut guard = entry.lock();
            let Some(state) = guard.as_mut().filter(|s| s.live) else {
                continue;
            };
            let due: Vec<Box<str>> = state
                .holds
                .iter()
                .filter(|(_, h)| h.expires_at_ms <= now_ms)
                .map(|(id, _)| id.clone())
                .collect();
            for request_id in due {
                let Some(hold) = state.holds.get(&request_id).cloned() else {
                    continue;
                };
                expired += 1;
                if !hold.durable {
                    // In memory only: released, nothing journaled, so that
                    // its usage record, if it comes late (billing was slow
                    // or hung, or the settlement took the durable queue),
                    // is still charged rather than found settled.
                    state.holds.remove(&request_id);
                    state.balance.usd_held -= hold.usd;
                    state.balance.diem_held -= hold.diem;
                    if let Some(spend) = hold.key.as_ref().and_then(|k| state.keys.get_mut(k)) {
                        spend.usd_held -= hold.usd;
                        spend.diem_held -= hold.diem;
                    }
                    continue;
                }
                let order = SettleOrder {
                    spent_by: "",
                    request_id: &request_id,
                    cost: hold.checkpoint,
                    model_id: &hold.model_id,
                    prompt_tokens: hold.checkpoint_tokens.0,
                    completion_tokens: hold.checkpoint_tokens.1,
                    cap: None,
                    key: None,
                    rest: false,
                };
                let (record, _) = decide_settle(&entry, state, &order);
                if let Some(mut record) = record {
                    record.kind = RecordKind::Expire;
                    if let Err(error) = queue(&self.shared.writer, state, record, false) {
                        tracing::warn!(%error, "cannot queue an expired hold");
                    }
                }
            }
            let idle =
                state.holds.is_empty() && state.pending == 0 && state.last_active.elapsed() >= IDLE;
            if idle {
                state.live = false;
                self.let_go(&entry, state);
                drop(guard);
                Self::drop_owner(&self.shared, &entry);
            }
        }
        expired
    }

    /// Loads owners that have durable holds past their lease and are not in
    /// memory (this process restarted): the next sweep charges them.
    pub async fn recover(&self, now_ms: i64) -> Result<usize> {
        let rows = sqlx::query(
            "SELECT DISTINCT owner FROM holds WHERE state = 'open' AND expires_at_ms <= $1 \
             LIMIT 100",
        )
        .bind(now_ms)
        .fetch_all(self.shared.db.pool())
        .await?;
        let mut loaded = 0;
        let membership = self.shared.membership.get();
        if membership.is_some_and(|m| m.away()) {
            return Ok(0);
        }
        for row in rows {
            let owner: String = row.try_get(0)?;
            // Another replica's owner is its to recover: loading it here
            // would take it away (the fence).
            if membership.is_some_and(|m| !m.owns(&owner)) {
                continue;
            }
            if self.loaded(&owner).is_none() {
                match self.with_owner(&owner, |_, _| Ok(())).await {
                    Ok(()) => loaded += 1,
                    // Another replica keeps it: its to recover.
                    Err(error) if crate::writer::kept_elsewhere(&error).is_some() => {}
                    Err(error) => return Err(error),
                }
            }
        }
        Ok(loaded)
    }
}
