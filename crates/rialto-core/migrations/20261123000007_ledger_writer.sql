-- The ledger decided in memory and written in batches (issue 15).
--
-- `fence` is the ownership epoch of an owner's ledger: a billing replica
-- that loads an owner into memory bumps it, and every batched write for
-- that owner is conditional on the value it loaded, so a replica that lost
-- ownership can no longer write for it.
ALTER TABLE ledgers ADD COLUMN fence BIGINT NOT NULL DEFAULT 0;

-- Only durable holds (streams) have rows here now; a stream checkpoints
-- what it used so far, and a hold nobody settles before its lease ends is
-- charged its last checkpoint.
ALTER TABLE holds ADD COLUMN model_id TEXT;
ALTER TABLE holds ADD COLUMN checkpoint_nanos BIGINT NOT NULL DEFAULT 0;
ALTER TABLE holds ADD COLUMN checkpoint_prompt_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE holds ADD COLUMN checkpoint_completion_tokens BIGINT NOT NULL DEFAULT 0;

CREATE INDEX holds_owner_open ON holds (owner, state);
