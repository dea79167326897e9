-- Usage analytics (issue 20): a settlement's journal row names the API key
-- that made the request (NULL for a wallet's signed-in request, a job, or a
-- hold that expired), so `GET /billing/usage-analytics` can break spend
-- down by key. `usage_records` shows it too; the usage history walks the
-- view in (at_ms, id) order, which the (owner, at_ms) index serves.
ALTER TABLE ledger_journal ADD COLUMN key_id TEXT;

DROP VIEW usage_records;
CREATE VIEW usage_records AS
SELECT id, owner, request_id, COALESCE(model_id, '') AS model_id, key_id, 'USD' AS currency,
    -usd_nanos AS amount_nanos, prompt_tokens, completion_tokens, at_ms
FROM ledger_journal WHERE kind IN ('settle', 'expire') AND usd_nanos <> 0
UNION ALL
SELECT id, owner, request_id, COALESCE(model_id, '') AS model_id, key_id, 'DIEM' AS currency,
    -diem_nanos AS amount_nanos, prompt_tokens, completion_tokens, at_ms
FROM ledger_journal WHERE kind IN ('settle', 'expire') AND diem_nanos <> 0;
