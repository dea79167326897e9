-- A key's `modelPrivacy` (issue 20): ALL, PRIVATE_TEXT (text and embedding
-- models must be private, other types are not restricted) or PRIVATE_ONLY (every model
-- must be private). A model is private unless the configuration marks it
-- otherwise (`privacy = "anonymized"`).
ALTER TABLE api_keys ADD COLUMN model_privacy TEXT NOT NULL DEFAULT 'ALL';
