-- Accounts and their API keys. Portable SQL: runs on SQLite and PostgreSQL.
-- Times are Unix milliseconds.
CREATE TABLE accounts (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    tier TEXT NOT NULL DEFAULT 'standard',
    created_at_ms BIGINT NOT NULL
);

CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts (id),
    key_type TEXT NOT NULL,
    description TEXT NOT NULL,
    -- SHA-256 of the secret, hex; the secret itself is never stored.
    secret_sha256 TEXT NOT NULL UNIQUE,
    last6_chars TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT,
    last_used_at_ms BIGINT
);

CREATE INDEX api_keys_account ON api_keys (account_id);
