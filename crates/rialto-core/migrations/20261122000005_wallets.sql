-- Sign-In-With-X nonces: each is accepted once per wallet, remembered until
-- its header could no longer be accepted anyway (then swept).
CREATE TABLE wallet_nonces (
    wallet TEXT NOT NULL,
    nonce TEXT NOT NULL,
    expires_at_ms BIGINT NOT NULL,
    PRIMARY KEY (wallet, nonce)
);

CREATE INDEX wallet_nonces_expiry ON wallet_nonces (expires_at_ms);

-- x402 top-ups: one row per signed payment, keyed on what makes it unique
-- on chain (network, asset, payer, nonce); claimed before the facilitator
-- settles it, credited once after.
CREATE TABLE x402_payments (
    id TEXT PRIMARY KEY,
    payment_key TEXT NOT NULL UNIQUE,
    wallet TEXT NOT NULL,
    network TEXT NOT NULL,
    amount_nanos BIGINT NOT NULL,
    -- settling, settled
    state TEXT NOT NULL,
    transaction_ref TEXT,
    created_at_ms BIGINT NOT NULL,
    settled_at_ms BIGINT
);

CREATE INDEX x402_payments_wallet ON x402_payments (wallet, created_at_ms);
