-- The usage history is read from the journal (issue 15): a settlement is
-- one journal row carrying its model and tokens, instead of that row plus
-- a row per currency in `usage_records`. With the journal keyed by its
-- idempotency key (it had a separate `id` key too), a settlement writes
-- four pages of the database instead of eight: its owner's balance, the
-- journal, the journal's key and its (owner, at_ms) index.
--
-- `usage_records` stays, as a view with the columns it had: a row per
-- currency that paid, for each settlement (and expiry) of the journal.

CREATE TABLE ledger_journal_keyed (
    idempotency_key TEXT PRIMARY KEY,
    id TEXT NOT NULL,
    owner TEXT NOT NULL,
    -- credit, hold, settle, release, expire, epoch
    kind TEXT NOT NULL,
    usd_nanos BIGINT NOT NULL,
    diem_nanos BIGINT NOT NULL,
    usd_held_nanos BIGINT NOT NULL,
    diem_held_nanos BIGINT NOT NULL,
    written_off_nanos BIGINT NOT NULL DEFAULT 0,
    request_id TEXT,
    reference TEXT,
    -- What a settlement (or expiry) was for.
    model_id TEXT,
    prompt_tokens BIGINT NOT NULL DEFAULT 0,
    completion_tokens BIGINT NOT NULL DEFAULT 0,
    at_ms BIGINT NOT NULL
);

INSERT INTO ledger_journal_keyed (idempotency_key, id, owner, kind, usd_nanos, diem_nanos,
    usd_held_nanos, diem_held_nanos, written_off_nanos, request_id, reference, model_id,
    prompt_tokens, completion_tokens, at_ms)
SELECT j.idempotency_key, j.id, j.owner, j.kind, j.usd_nanos, j.diem_nanos,
    j.usd_held_nanos, j.diem_held_nanos, j.written_off_nanos, j.request_id, j.reference,
    u.model_id, COALESCE(u.prompt_tokens, 0), COALESCE(u.completion_tokens, 0), j.at_ms
FROM ledger_journal j
LEFT JOIN (
    SELECT owner, request_id, MAX(model_id) AS model_id, MAX(prompt_tokens) AS prompt_tokens,
        MAX(completion_tokens) AS completion_tokens
    FROM usage_records GROUP BY owner, request_id
) u ON u.owner = j.owner AND u.request_id = j.request_id AND j.kind IN ('settle', 'expire');

DROP TABLE ledger_journal;
ALTER TABLE ledger_journal_keyed RENAME TO ledger_journal;
CREATE INDEX ledger_journal_owner ON ledger_journal (owner, at_ms);

DROP TABLE usage_records;
CREATE VIEW usage_records AS
SELECT id, owner, request_id, COALESCE(model_id, '') AS model_id, 'USD' AS currency, -usd_nanos AS amount_nanos,
    prompt_tokens, completion_tokens, at_ms
FROM ledger_journal WHERE kind IN ('settle', 'expire') AND usd_nanos <> 0
UNION ALL
SELECT id, owner, request_id, COALESCE(model_id, '') AS model_id, 'DIEM' AS currency, -diem_nanos AS amount_nanos,
    prompt_tokens, completion_tokens, at_ms
FROM ledger_journal WHERE kind IN ('settle', 'expire') AND diem_nanos <> 0;
