-- Asynchronous media jobs (`/video/queue`, `/audio/queue`; issue 19). A
-- row is written before the queue answers, so a process that dies loses
-- none: a worker claims a job with a lease (`worker`, `lease_until_ms`),
-- renews it while it polls the backend, and a job whose lease ran out is
-- claimed again by whoever is alive. `settlement` is the encoded
-- `SettleRequest` of the job's hold; its completion (or a failure's
-- release) goes to the ledger under the job's request id, idempotent, and
-- `settled` records that it did, so a completion is charged exactly once
-- whichever process finishes it. The media lives apart in
-- `media_job_results` (polled rows stay small) until it is fetched with
-- deletion, completed, or `media.retention_hours` pass.
CREATE TABLE media_jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    model_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    request_json TEXT NOT NULL,
    settlement BYTEA NOT NULL,
    price_usd_nanos BIGINT NOT NULL,
    backend TEXT NOT NULL,
    backend_job_id TEXT NOT NULL,
    progress BIGINT NOT NULL,
    error TEXT NOT NULL,
    error_code TEXT NOT NULL,
    created_ms BIGINT NOT NULL,
    started_ms BIGINT NOT NULL,
    finished_ms BIGINT NOT NULL,
    settled BIGINT NOT NULL,
    attempts BIGINT NOT NULL,
    worker TEXT NOT NULL,
    lease_until_ms BIGINT NOT NULL
);
-- What workers claim: unfinished or unsettled jobs, oldest first.
CREATE INDEX media_jobs_open ON media_jobs (settled, lease_until_ms);
-- Recent execution times of a model (`average_execution_time`).
CREATE INDEX media_jobs_model ON media_jobs (model_id, finished_ms);

CREATE TABLE media_job_results (
    job_id TEXT PRIMARY KEY,
    content_type TEXT NOT NULL,
    data BYTEA NOT NULL
);
