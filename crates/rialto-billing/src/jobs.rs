//! Asynchronous media jobs (`/video/queue`, `/audio/queue`): durable rows in
//! `media_jobs`, claimed by the gateways' workers with a lease, charged
//! here once when they complete.
//!
//! Why in billing: a job is money held for minutes, and its completion is a
//! charge. Billing owns the ledger and the database, so a job's final state
//! and its settlement meet in the replica that owns its ledger owner (the
//! update is routed like a settlement), and the gateway keeps its invariant
//! of never touching the database.
//!
//! Exactly once: a job reaches a final state (completed, failed, deleted)
//! by one conditional `UPDATE` from an open state, so two finishers (a
//! worker and the owner's cancel, or two workers after a lease ran out)
//! cannot both win; the winner's settlement goes to the ledger under the
//! job's request id (idempotent there), and `settled` is set after it. A
//! job finished but not settled (the process died between the two) is
//! claimed again and its settlement sent again, which the ledger applies
//! once.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};

use prost::Message;
use rialto_core::db::{Database, now_ms};
use rialto_core::{Error, ErrorCode, Result};
use rialto_proto::billing::v1 as pb;
use sqlx::Row;

/// A job's states, as stored.
pub const QUEUED: &str = "queued";
pub const PROCESSING: &str = "processing";
pub const COMPLETED: &str = "completed";
pub const FAILED: &str = "failed";
/// Its media outlived `media.retention_hours`.
pub const EXPIRED: &str = "expired";
/// Its owner completed it (`/video/complete`): the media is gone, and a job
/// still open was cancelled.
pub const DELETED: &str = "deleted";

/// Whether a job in `state` is still to be worked on.
pub fn is_open(state: &str) -> bool {
    state == QUEUED || state == PROCESSING
}

/// Recent executions of a model the `average_execution_time` is the p80 of.
const EXECUTIONS_SAMPLED: i64 = 50;
/// When no job of the model finished yet.
const UNKNOWN_EXECUTION_MS: i64 = 60_000;
/// How long a model's p80 is reused before it is read again.
const EXECUTION_CACHE_MS: i64 = 10_000;
/// How often finished media past its retention is deleted, at most.
const SWEEP_EVERY_MS: i64 = 60_000;

/// The job table.
#[derive(Debug)]
pub struct JobStore {
    db: Database,
    retention_ms: i64,
    last_sweep_ms: AtomicI64,
    /// model -> (read at, p80 ms).
    executions: Mutex<HashMap<String, (i64, i64)>>,
}

/// What `finish` decided: the job as it now is, and whether this call
/// moved it to its final state (and so owes the ledger its settlement).
pub struct Finished {
    pub job: pb::Job,
    pub settle: bool,
}

/// One job's row, in the order [`job_of`] reads it.
const SELECT_JOB: &str = "SELECT id, owner, model_id, kind, state, request_json, settlement, \
     price_usd_nanos, backend, backend_job_id, progress, error, error_code, created_ms, \
     started_ms, finished_ms, settled, attempts, worker FROM media_jobs WHERE id = $1";

impl JobStore {
    pub fn new(db: Database, retention_hours: u64) -> Self {
        Self {
            db,
            retention_ms: i64::try_from(retention_hours.saturating_mul(3_600_000))
                .unwrap_or(i64::MAX),
            last_sweep_ms: AtomicI64::new(0),
            executions: Mutex::new(HashMap::new()),
        }
    }

    /// Stores a new job, queued.
    pub async fn submit(&self, job: pb::Job) -> Result<pb::Job> {
        if job.id.is_empty() || job.owner.is_empty() || job.model_id.is_empty() {
            return Err(Error::invalid("a job names its id, owner and model"));
        }
        let settlement = job.settlement.clone().unwrap_or_default().encode_to_vec();
        let created = now_ms();
        sqlx::query(
            "INSERT INTO media_jobs (id, owner, model_id, kind, state, request_json, settlement, \
             price_usd_nanos, backend, backend_job_id, progress, error, error_code, created_ms, \
             started_ms, finished_ms, settled, attempts, worker, lease_until_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, '', '', 0, '', '', $9, 0, 0, 0, 0, '', 0)",
        )
        .bind(&job.id)
        .bind(&job.owner)
        .bind(&job.model_id)
        .bind(&job.kind)
        .bind(QUEUED)
        .bind(String::from_utf8_lossy(&job.request_json).into_owned())
        .bind(settlement)
        .bind(nanos_column(job.price_usd_nanos))
        .bind(created)
        .execute(self.db.pool())
        .await
        .map_err(|e| Error::internal(format!("cannot store the job: {e}")))?;
        Ok(pb::Job {
            state: QUEUED.to_owned(),
            created_ms: created,
            ..job
        })
    }

    /// Up to `limit` jobs for `worker` to run: open ones, and finished ones
    /// whose settlement is not recorded, whose lease ran out (or never
    /// began), oldest first. Each is taken by a conditional update, so two
    /// workers never hold one job.
    pub async fn claim(&self, worker: &str, limit: u32, lease_secs: u32) -> Result<Vec<pb::Job>> {
        let now = now_ms();
        self.sweep(now).await;
        let candidates = sqlx::query(
            "SELECT id FROM media_jobs WHERE settled = 0 AND lease_until_ms < $1 \
             ORDER BY created_ms LIMIT $2",
        )
        .bind(now)
        .bind(i64::from(limit.max(1)))
        .fetch_all(self.db.pool())
        .await
        .map_err(read_failed)?;
        let lease_until = now.saturating_add(i64::from(lease_secs) * 1000);
        let mut jobs = Vec::new();
        for row in candidates {
            let id: String = row.try_get(0).map_err(read_failed)?;
            let taken = sqlx::query(
                "UPDATE media_jobs SET worker = $1, lease_until_ms = $2, attempts = attempts + 1, \
                 state = CASE WHEN state = 'queued' THEN 'processing' ELSE state END, \
                 started_ms = CASE WHEN started_ms = 0 THEN $3 ELSE started_ms END \
                 WHERE id = $4 AND settled = 0 AND lease_until_ms < $3",
            )
            .bind(worker)
            .bind(lease_until)
            .bind(now)
            .bind(&id)
            .execute(self.db.pool())
            .await
            .map_err(read_failed)?;
            if taken.rows_affected() == 1
                && let Some(job) = self.read(&id, None).await?
            {
                jobs.push(job);
            }
        }
        Ok(jobs)
    }

    /// Applies a worker's report. Progress and the backend's ids are
    /// recorded while the worker holds the lease; a final state is taken
    /// only from an open one (see [`Finished`]).
    pub async fn update(&self, request: &pb::UpdateJobRequest) -> Result<Finished> {
        let current = self
            .read(&request.id, Some(&request.owner))
            .await?
            .ok_or_else(not_found)?;
        let now = now_ms();
        let final_state = matches!(request.state.as_str(), COMPLETED | FAILED);
        if !request.state.is_empty() && !final_state && request.state != PROCESSING {
            return Err(Error::invalid(format!(
                "a job cannot be set {}",
                request.state
            )));
        }
        if !is_open(&current.state) {
            // Finished already (by this worker before a crash, or its owner):
            // what it owes the ledger is sent again until recorded.
            return Ok(Finished {
                settle: !current.settled,
                job: current,
            });
        }
        // A finished job keeps its worker's lease while its charge is sent
        // (no other worker claims it meanwhile); `mark_settled` ends it.
        let lease_until = if request.release {
            0
        } else {
            now.saturating_add(i64::from(request.lease_secs) * 1000)
        };
        let mut tx = self.db.pool().begin().await.map_err(read_failed)?;
        if final_state && request.state == COMPLETED {
            sqlx::query(
                "INSERT INTO media_job_results (job_id, content_type, data) VALUES ($1, $2, $3) \
                 ON CONFLICT (job_id) DO NOTHING",
            )
            .bind(&request.id)
            .bind(&request.content_type)
            .bind(request.result.clone())
            .execute(&mut *tx)
            .await
            .map_err(read_failed)?;
        }
        let updated = sqlx::query(
            "UPDATE media_jobs SET \
             state = CASE WHEN $1 = '' THEN state ELSE $1 END, \
             backend = CASE WHEN $2 = '' THEN backend ELSE $2 END, \
             backend_job_id = CASE WHEN $3 = '' THEN backend_job_id ELSE $3 END, \
             progress = CASE WHEN $4 > progress THEN $4 ELSE progress END, \
             error = $5, error_code = $6, lease_until_ms = $7, \
             finished_ms = CASE WHEN $8 = 1 THEN $9 ELSE finished_ms END \
             WHERE id = $10 AND state IN ('queued', 'processing') AND worker = $11",
        )
        .bind(&request.state)
        .bind(&request.backend)
        .bind(&request.backend_job_id)
        .bind(i64::from(request.progress.min(100)))
        .bind(&request.error)
        .bind(&request.error_code)
        .bind(lease_until)
        .bind(i64::from(final_state))
        .bind(now)
        .bind(&request.id)
        .bind(&request.worker)
        .execute(&mut *tx)
        .await
        .map_err(read_failed)?;
        if updated.rows_affected() == 0 {
            drop(tx);
            let job = self
                .read(&request.id, Some(&request.owner))
                .await?
                .ok_or_else(not_found)?;
            // Open still: another worker took it over (its `worker` says
            // so), and this one stops.
            return Ok(Finished {
                settle: !is_open(&job.state) && !job.settled,
                job,
            });
        }
        tx.commit().await.map_err(read_failed)?;
        let job = self
            .read(&request.id, Some(&request.owner))
            .await?
            .ok_or_else(not_found)?;
        Ok(Finished {
            settle: final_state,
            job,
        })
    }

    /// The owner's completion: the media is deleted, and a job still open
    /// is cancelled (its hold released, nothing charged).
    pub async fn complete(&self, id: &str, owner: &str, model_id: &str) -> Result<Finished> {
        let current = self
            .read(id, Some(owner))
            .await?
            .filter(|job| of_model(job, model_id))
            .ok_or_else(not_found)?;
        let now = now_ms();
        let cancelled = sqlx::query(
            "UPDATE media_jobs SET state = 'deleted', finished_ms = $1, lease_until_ms = 0, \
             error_code = 'CANCELLED', error = 'cancelled by its owner' \
             WHERE id = $2 AND state IN ('queued', 'processing')",
        )
        .bind(now)
        .bind(id)
        .execute(self.db.pool())
        .await
        .map_err(read_failed)?;
        if cancelled.rows_affected() == 0 && current.state == COMPLETED {
            sqlx::query(
                "UPDATE media_jobs SET state = 'deleted' WHERE id = $1 AND state = 'completed'",
            )
            .bind(id)
            .execute(self.db.pool())
            .await
            .map_err(read_failed)?;
        }
        self.delete_result(id).await?;
        let job = self.read(id, Some(owner)).await?.ok_or_else(not_found)?;
        Ok(Finished {
            settle: cancelled.rows_affected() == 1,
            job,
        })
    }

    /// Records that the job's settlement reached the ledger.
    pub async fn mark_settled(&self, id: &str) -> Result<()> {
        sqlx::query("UPDATE media_jobs SET settled = 1, lease_until_ms = 0 WHERE id = $1")
            .bind(id)
            .execute(self.db.pool())
            .await
            .map_err(read_failed)?;
        Ok(())
    }

    /// The owner's job, with its media when asked for (and deleted after,
    /// when asked to).
    pub async fn get(&self, request: &pb::GetJobRequest) -> Result<pb::Job> {
        let mut job = self
            .read(&request.id, Some(&request.owner))
            .await?
            .filter(|job| of_model(job, &request.model_id))
            .ok_or_else(not_found)?;
        job.average_execution_ms = self.average_execution_ms(&job.model_id).await;
        if request.with_result && job.state == COMPLETED {
            let row =
                sqlx::query("SELECT content_type, data FROM media_job_results WHERE job_id = $1")
                    .bind(&request.id)
                    .fetch_optional(self.db.pool())
                    .await
                    .map_err(read_failed)?;
            match row {
                Some(row) => {
                    job.content_type = row.try_get(0).map_err(read_failed)?;
                    job.result = row.try_get(1).map_err(read_failed)?;
                }
                // Deleted by a concurrent retrieve: gone for this one too.
                None => job.state = DELETED.to_owned(),
            }
            if request.delete_result && job.state == COMPLETED {
                sqlx::query(
                    "UPDATE media_jobs SET state = 'deleted' WHERE id = $1 AND state = 'completed'",
                )
                .bind(&request.id)
                .execute(self.db.pool())
                .await
                .map_err(read_failed)?;
                self.delete_result(&request.id).await?;
            }
        }
        Ok(job)
    }

    async fn delete_result(&self, id: &str) -> Result<()> {
        sqlx::query("DELETE FROM media_job_results WHERE job_id = $1")
            .bind(id)
            .execute(self.db.pool())
            .await
            .map_err(read_failed)?;
        Ok(())
    }

    async fn read(&self, id: &str, owner: Option<&str>) -> Result<Option<pb::Job>> {
        let row = sqlx::query(SELECT_JOB)
            .bind(id)
            .fetch_optional(self.db.pool())
            .await
            .map_err(read_failed)?;
        let Some(row) = row else {
            return Ok(None);
        };
        let job = job_of(&row).map_err(read_failed)?;
        // Another owner's job is as unknown as a job that never was.
        Ok(owner.is_none_or(|owner| owner == job.owner).then_some(job))
    }

    /// The p80 of the model's recent execution times, read at most every
    /// few seconds.
    async fn average_execution_ms(&self, model_id: &str) -> i64 {
        let now = now_ms();
        if let Ok(cache) = self.executions.lock()
            && let Some((at, p80)) = cache.get(model_id)
            && now - at < EXECUTION_CACHE_MS
        {
            return *p80;
        }
        let rows = sqlx::query(
            "SELECT finished_ms - started_ms FROM media_jobs \
             WHERE model_id = $1 AND state IN ('completed', 'deleted') AND started_ms > 0 \
             AND finished_ms > 0 ORDER BY finished_ms DESC LIMIT $2",
        )
        .bind(model_id)
        .bind(EXECUTIONS_SAMPLED)
        .fetch_all(self.db.pool())
        .await
        .unwrap_or_default();
        let mut times: Vec<i64> = rows
            .iter()
            .filter_map(|row| row.try_get::<i64, _>(0).ok())
            .collect();
        times.sort_unstable();
        let p80 = match times.len() {
            0 => UNKNOWN_EXECUTION_MS,
            n => times[(n * 4 / 5).min(n - 1)],
        };
        if let Ok(mut cache) = self.executions.lock() {
            cache.insert(model_id.to_owned(), (now, p80));
        }
        p80
    }

    /// Deletes the media of jobs finished more than `retention` ago (they
    /// become `expired`), at most once a minute.
    async fn sweep(&self, now: i64) {
        if !once_per(&self.last_sweep_ms, SWEEP_EVERY_MS, now) {
            return;
        }
        let before = now.saturating_sub(self.retention_ms);
        let swept = async {
            let mut tx = self.db.pool().begin().await?;
            sqlx::query(
                "DELETE FROM media_job_results WHERE job_id IN (SELECT id FROM media_jobs \
                 WHERE state = 'completed' AND settled = 1 AND finished_ms < $1)",
            )
            .bind(before)
            .execute(&mut *tx)
            .await?;
            let expired = sqlx::query(
                "UPDATE media_jobs SET state = 'expired' \
                 WHERE state = 'completed' AND settled = 1 AND finished_ms < $1",
            )
            .bind(before)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok::<u64, sqlx::Error>(expired.rows_affected())
        };
        match swept.await {
            Ok(0) => {}
            Ok(expired) => tracing::info!(expired, "media past its retention deleted"),
            Err(error) => tracing::warn!(%error, "media retention sweep failed"),
        }
    }
}

/// Whether `job` is of the model a caller names (any, when none).
fn of_model(job: &pb::Job, model_id: &str) -> bool {
    model_id.is_empty() || job.model_id == model_id
}

/// Marks a job its owner cancelled while it was open (`error_code`).
pub const CANCELLED: &str = "CANCELLED";

/// The settlement a finished job owes the ledger: its price when it was
/// delivered (finished with no error: completed, and perhaps since deleted
/// or expired), nothing otherwise (failed, cancelled: its hold released).
pub fn settlement_of(job: &pb::Job) -> pb::SettleRequest {
    let mut settlement = job.settlement.clone().unwrap_or_default();
    let mut usage = settlement.usage.unwrap_or_default();
    let delivered = job.finished_ms > 0 && job.error_code.is_empty() && job.state != FAILED;
    usage.extra_usd_nanos = if delivered { job.price_usd_nanos } else { 0 };
    settlement.usage = Some(usage);
    settlement
}

fn job_of(row: &sqlx::any::AnyRow) -> std::result::Result<pb::Job, sqlx::Error> {
    let settlement: Vec<u8> = row.try_get(6)?;
    let request_json: String = row.try_get(5)?;
    let price: i64 = row.try_get(7)?;
    let progress: i64 = row.try_get(10)?;
    let settled: i64 = row.try_get(16)?;
    let attempts: i64 = row.try_get(17)?;
    Ok(pb::Job {
        id: row.try_get(0)?,
        owner: row.try_get(1)?,
        model_id: row.try_get(2)?,
        kind: row.try_get(3)?,
        state: row.try_get(4)?,
        request_json: request_json.into_bytes(),
        settlement: pb::SettleRequest::decode(settlement.as_slice()).ok(),
        price_usd_nanos: u64::try_from(price).unwrap_or(0),
        backend: row.try_get(8)?,
        backend_job_id: row.try_get(9)?,
        progress: u32::try_from(progress).unwrap_or(0),
        error: row.try_get(11)?,
        error_code: row.try_get(12)?,
        created_ms: row.try_get(13)?,
        started_ms: row.try_get(14)?,
        finished_ms: row.try_get(15)?,
        settled: settled != 0,
        attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
        worker: row.try_get(18)?,
        ..pb::Job::default()
    })
}

fn nanos_column(nanos: u64) -> i64 {
    i64::try_from(nanos).unwrap_or(i64::MAX)
}

fn not_found() -> Error {
    Error::new(
        ErrorCode::NotFound,
        "Media could not be found. Request may be invalid, expired, or deleted.",
    )
}

fn read_failed(error: sqlx::Error) -> Error {
    Error::new(
        ErrorCode::Unavailable,
        format!("the job table cannot be read: {error}"),
    )
}

/// Whether `every_ms` has passed since `last` (Unix ms), which it then
/// becomes: of callers racing, one wins.
pub(crate) fn once_per(last: &AtomicI64, every_ms: i64, now: i64) -> bool {
    let before = last.load(Ordering::Relaxed);
    now - before >= every_ms
        && last
            .compare_exchange(before, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn store() -> (tempfile::TempDir, JobStore) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/jobs.db", dir.path().display());
        let db = Database::connect(&url, 8).await.unwrap();
        (dir, JobStore::new(db, 24))
    }

    fn job(id: &str) -> pb::Job {
        pb::Job {
            id: id.to_owned(),
            owner: "account:1".to_owned(),
            model_id: "video".to_owned(),
            kind: "video".to_owned(),
            request_json: b"{}".to_vec(),
            settlement: Some(pb::SettleRequest {
                request_id: format!("request-{id}"),
                ..Default::default()
            }),
            price_usd_nanos: 500,
            ..Default::default()
        }
    }

    fn report(id: &str, worker: &str, state: &str) -> pb::UpdateJobRequest {
        pb::UpdateJobRequest {
            id: id.to_owned(),
            owner: "account:1".to_owned(),
            worker: worker.to_owned(),
            lease_secs: 30,
            state: state.to_owned(),
            result: b"media".to_vec(),
            content_type: "video/mp4".to_owned(),
            error_code: if state == FAILED {
                "INFERENCE_FAILED".to_owned()
            } else {
                String::new()
            },
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_workers_never_hold_one_job_on_sqlite() {
        let (_dir, jobs) = store().await;
        claims_race(jobs).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_workers_never_hold_one_job_on_postgres() {
        let (db, scratch) = crate::book::tests::postgres().await;
        claims_race(JobStore::new(db, 24)).await;
        drop(scratch);
    }

    async fn claims_race(jobs: JobStore) {
        for n in 0..20 {
            jobs.submit(job(&format!("j{n}"))).await.unwrap();
        }
        let (jobs, a, b) = (std::sync::Arc::new(jobs), "worker-a", "worker-b");
        // Eight claims at once, again and again: they contend for the same
        // oldest rows, and each row goes to one of them.
        let mut ids = Vec::new();
        for _ in 0..20 {
            let claims = futures_util::future::join_all((0..8).map(|n| {
                let jobs = jobs.clone();
                async move {
                    jobs.claim(if n % 2 == 0 { a } else { b }, 5, 30)
                        .await
                        .unwrap()
                }
            }))
            .await;
            ids.extend(claims.into_iter().flatten().map(|job| job.id));
            if ids.len() >= 20 {
                break;
            }
        }
        let claimed = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), claimed, "a job was claimed twice");
        assert_eq!(claimed, 20);
        // Leased: nothing left to claim until a lease runs out.
        assert!(jobs.claim(a, 5, 30).await.unwrap().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_finishes_once_whoever_races_to_finish_it() {
        let (_dir, jobs) = store().await;
        for round in 0..10 {
            let id = format!("race{round}");
            jobs.submit(job(&id)).await.unwrap();
            let worker = jobs.claim("w", 1, 30).await.unwrap();
            assert_eq!(worker[0].id, id);
            let made = report(&id, "w", COMPLETED);
            let (done, cancelled) =
                tokio::join!(jobs.update(&made), jobs.complete(&id, "account:1", ""));
            let (done, cancelled) = (done.unwrap(), cancelled.unwrap());
            // Whoever won, every settlement sent says the same amount: the
            // price when the media was made first, nothing when the cancel
            // was (the ledger takes the first one by the request id).
            let made = cancelled.job.error_code.is_empty();
            let owed = if made { 500 } else { 0 };
            for finished in [&done, &cancelled] {
                if finished.settle {
                    let sent = settlement_of(&finished.job).usage.unwrap().extra_usd_nanos;
                    assert_eq!(sent, owed, "round {round}");
                }
            }
            assert!(
                done.settle || cancelled.settle,
                "round {round}: nobody settles"
            );
            jobs.mark_settled(&id).await.unwrap();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unsettled_finished_job_is_claimed_again_until_marked() {
        let (_dir, jobs) = store().await;
        jobs.submit(job("j")).await.unwrap();
        jobs.claim("w", 1, 30).await.unwrap();
        let finished = jobs.update(&report("j", "w", FAILED)).await.unwrap();
        assert!(finished.settle);
        assert_eq!(
            settlement_of(&finished.job).usage.unwrap().extra_usd_nanos,
            0
        );
        // The worker died before the charge was recorded: once its lease
        // runs out the job is claimed again, and owes its settlement still.
        sqlx::query("UPDATE media_jobs SET lease_until_ms = 0")
            .execute(jobs.db.pool())
            .await
            .unwrap();
        let again = jobs.claim("other", 1, 30).await.unwrap();
        assert_eq!(again[0].state, FAILED);
        let resent = jobs.update(&report("j", "other", "")).await.unwrap();
        assert!(resent.settle);
        jobs.mark_settled("j").await.unwrap();
        assert!(jobs.claim("other", 1, 30).await.unwrap().is_empty());
        // A worker that lost its lease is told, and changes nothing.
        jobs.submit(job("k")).await.unwrap();
        jobs.claim("w", 1, 30).await.unwrap();
        let lost = jobs.update(&report("k", "thief", COMPLETED)).await.unwrap();
        assert!(!lost.settle);
        assert_eq!(
            (lost.job.state.as_str(), lost.job.worker.as_str()),
            (PROCESSING, "w")
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn media_past_its_retention_expires() {
        let (_dir, jobs) = store().await;
        jobs.submit(job("old")).await.unwrap();
        jobs.claim("w", 1, 30).await.unwrap();
        jobs.update(&report("old", "w", COMPLETED)).await.unwrap();
        jobs.mark_settled("old").await.unwrap();
        let get = |delete_result| pb::GetJobRequest {
            id: "old".to_owned(),
            owner: "account:1".to_owned(),
            model_id: "video".to_owned(),
            with_result: true,
            delete_result,
        };
        assert_eq!(jobs.get(&get(false)).await.unwrap().result, b"media");
        // Named with another model: not found, and its media not deleted.
        let elsewhere = pb::GetJobRequest {
            model_id: "image".to_owned(),
            ..get(true)
        };
        assert_eq!(
            jobs.get(&elsewhere).await.unwrap_err().code,
            ErrorCode::NotFound
        );
        assert_eq!(jobs.get(&get(false)).await.unwrap().result, b"media");
        // Finished 25 hours ago (retention 24).
        let long_ago = now_ms() - 25 * 3_600_000;
        sqlx::query("UPDATE media_jobs SET finished_ms = $1")
            .bind(long_ago)
            .execute(jobs.db.pool())
            .await
            .unwrap();
        // The claim above swept a moment ago; the next sweep is due now.
        jobs.last_sweep_ms.store(0, Ordering::Relaxed);
        jobs.sweep(now_ms()).await;
        let expired = jobs.get(&get(false)).await.unwrap();
        assert_eq!(expired.state, EXPIRED);
        assert!(expired.result.is_empty());
        // Another owner's job is as unknown as one that never was.
        let stranger = pb::GetJobRequest {
            owner: "account:2".to_owned(),
            ..get(false)
        };
        assert_eq!(
            jobs.get(&stranger).await.unwrap_err().code,
            ErrorCode::NotFound
        );
    }
}
