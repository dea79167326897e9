-- The rate-limit log: one row per limit hit (at most one per key, window,
-- limit type and second), read newest first per account; the newest 200 of
-- each account are kept, for at most 30 days. Times are Unix ms.
CREATE TABLE rate_limit_logs (
    id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    api_key_id TEXT NOT NULL,
    model_id TEXT NOT NULL,
    tier TEXT NOT NULL,
    limit_type TEXT NOT NULL,
    at_ms BIGINT NOT NULL
);

CREATE INDEX rate_limit_logs_account ON rate_limit_logs (account_id, at_ms);
CREATE INDEX rate_limit_logs_at ON rate_limit_logs (at_ms);
