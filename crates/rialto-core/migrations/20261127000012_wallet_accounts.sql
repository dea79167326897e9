-- Wallet accounts (issue 20): `POST /api_keys/generate_web3_key` creates an
-- API key for a wallet that signed a fresh token. The key belongs to the
-- wallet's account, one per wallet, created with its first key; the
-- account's keys spend the wallet's own ledger (`wallet:<address>`, the one
-- x402 top-ups credit), so a key and a Sign-In-With-X header of one wallet
-- see one balance. `wallet` is the EIP-55 or base58 address; NULL for
-- accounts an operator created.
ALTER TABLE accounts ADD COLUMN wallet TEXT;
CREATE UNIQUE INDEX accounts_wallet ON accounts (wallet);
