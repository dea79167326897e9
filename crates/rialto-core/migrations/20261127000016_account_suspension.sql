-- Operator API (issue 21): an account can be suspended and resumed. Its keys
-- do not authenticate while it is suspended (every auth replica drops them
-- at once, as for a deleted key); nothing else of the account changes.
ALTER TABLE accounts ADD COLUMN suspended_at_ms BIGINT;
