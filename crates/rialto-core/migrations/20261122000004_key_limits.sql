-- Spending caps on API keys (the hosted API's consumptionLimit and
-- limitPeriod): at most this many nano-units per period; NULL, no cap.
ALTER TABLE api_keys ADD COLUMN limit_usd_nanos BIGINT;
ALTER TABLE api_keys ADD COLUMN limit_diem_nanos BIGINT;
ALTER TABLE api_keys ADD COLUMN limit_period TEXT NOT NULL DEFAULT 'EPOCH';

-- What each capped key spent and holds in a period ("EPOCH:<UTC day>",
-- "MONTH:<YYYY-MM>", "LIFETIME"), kept in the ledger's transactions.
CREATE TABLE key_spend (
    key_id TEXT NOT NULL,
    period TEXT NOT NULL,
    usd_nanos BIGINT NOT NULL DEFAULT 0,
    diem_nanos BIGINT NOT NULL DEFAULT 0,
    usd_held_nanos BIGINT NOT NULL DEFAULT 0,
    diem_held_nanos BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (key_id, period)
);

-- The capped key a hold counts against, and in which period.
ALTER TABLE holds ADD COLUMN key_id TEXT;
ALTER TABLE holds ADD COLUMN key_period TEXT;
