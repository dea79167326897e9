-- `POST /responses` (issue 20): a response made with `store` (the default)
-- is kept for `previous_response_id`, per owner, for 30 days: the
-- conversation it continued (as chat messages, without its instructions)
-- and its output, as JSON. A stored response is read by its id and owner,
-- never listed; expired ones are deleted as new ones are stored.
CREATE TABLE stored_responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    body TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL
);

CREATE INDEX stored_responses_expiry ON stored_responses (expires_at_ms);
