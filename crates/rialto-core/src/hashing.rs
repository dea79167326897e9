//! The hasher of the in-memory maps a request looks up on its way (the
//! limiter's windows, the ledger's owners, and the shards that hold them).
//!
//! The standard library's SipHash-1-3 cost a priced request ~7,000
//! instructions over a few dozen lookups of short keys (callgrind), about
//! half of it in these maps. foldhash's
//! `quality` hasher is several times cheaper on such keys, is seeded at
//! random per map (so an outsider who cannot read the hashes cannot aim
//! collisions at a map), and mixes its output fully, so its low bits can
//! pick a shard. A hash that names something (the abuse guard's credential
//! subject) keeps SipHash.

/// A per-map random seed for foldhash's `quality` hasher.
pub type RandomState = foldhash::quality::RandomState;

/// A `HashMap` on [`RandomState`]; made with `default()`.
pub type HashMap<K, V> = std::collections::HashMap<K, V, RandomState>;
