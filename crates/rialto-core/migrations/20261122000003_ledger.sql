-- The prepaid ledger. Amounts are integer nano-units (1e-9 USD or DIEM),
-- never floats. `ledgers` holds each owner's balances and the part of them
-- reserved by open holds; `ledger_journal` is the append-only record of
-- every change, one row per change with an idempotency key, written in the
-- same transaction as the balance it changes (its sums equal the balances).
-- The CHECKs are the last guard: no balance below zero, no hold above it.
CREATE TABLE ledgers (
    owner TEXT PRIMARY KEY,
    usd_nanos BIGINT NOT NULL DEFAULT 0,
    diem_nanos BIGINT NOT NULL DEFAULT 0,
    usd_held_nanos BIGINT NOT NULL DEFAULT 0,
    diem_held_nanos BIGINT NOT NULL DEFAULT 0,
    -- UTC day (days since the epoch) of the last staking allocation.
    diem_epoch BIGINT NOT NULL DEFAULT 0,
    updated_at_ms BIGINT NOT NULL,
    CHECK (usd_held_nanos >= 0 AND diem_held_nanos >= 0),
    CHECK (usd_nanos >= usd_held_nanos AND diem_nanos >= diem_held_nanos)
);

CREATE TABLE ledger_journal (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    -- credit, hold, settle, release, expire
    kind TEXT NOT NULL,
    idempotency_key TEXT NOT NULL UNIQUE,
    -- Signed effects on the balances and on the held amounts.
    usd_nanos BIGINT NOT NULL,
    diem_nanos BIGINT NOT NULL,
    usd_held_nanos BIGINT NOT NULL,
    diem_held_nanos BIGINT NOT NULL,
    -- Cost beyond the hold that was not charged (settlements only).
    written_off_nanos BIGINT NOT NULL DEFAULT 0,
    request_id TEXT,
    reference TEXT,
    at_ms BIGINT NOT NULL
);

CREATE INDEX ledger_journal_owner ON ledger_journal (owner, at_ms);

CREATE TABLE holds (
    request_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    usd_nanos BIGINT NOT NULL,
    diem_nanos BIGINT NOT NULL,
    -- open, settled, released, expired
    state TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL
);

CREATE INDEX holds_open ON holds (state, expires_at_ms);

-- What each settled request was charged, one row per currency that paid,
-- written in the settlement's transaction: the usage history.
CREATE TABLE usage_records (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    request_id TEXT NOT NULL,
    model_id TEXT NOT NULL,
    -- USD or DIEM
    currency TEXT NOT NULL,
    amount_nanos BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    at_ms BIGINT NOT NULL
);

CREATE INDEX usage_records_owner ON usage_records (owner, at_ms);

-- DIEM staking: an owner's stake grants this much DIEM per UTC day; the
-- day's unspent DIEM does not roll over.
CREATE TABLE stakes (
    owner TEXT PRIMARY KEY,
    diem_per_day_nanos BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    CHECK (diem_per_day_nanos >= 0)
);
