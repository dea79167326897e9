//! Which replica owns a principal: rendezvous (highest random weight)
//! hashing over the replicas' stable names (addresses as configured; in
//! Kubernetes, StatefulSet pod DNS names).
//!
//! Every process that lists the same replicas computes the same owner, with
//! no coordination; removing a replica moves only the principals it owned.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The hash seed of a replica, from its stable name.
pub fn replica_seed(name: &str) -> u64 {
    xxh3_64(name.as_bytes())
}

/// The score of `key` on the replica with `seed`: the highest score owns it.
pub fn score(key: &str, seed: u64) -> u64 {
    xxh3_64_with_seed(key.as_bytes(), seed)
}

/// The index, among replicas with `seeds`, of the one owning `key`.
pub fn owner_index(key: &str, seeds: impl Iterator<Item = u64>) -> usize {
    let mut best = (0, 0u64);
    for (index, seed) in seeds.enumerate() {
        let score = score(key, seed);
        if index == 0 || score > best.1 {
            best = (index, score);
        }
    }
    best.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_stable_and_spread() {
        let seeds: Vec<u64> = ["a:1", "b:2", "c:3"]
            .iter()
            .map(|n| replica_seed(n))
            .collect();
        let mut counts = [0; 3];
        for i in 0..3000 {
            let key = format!("account:{i}");
            let owner = owner_index(&key, seeds.iter().copied());
            assert_eq!(owner, owner_index(&key, seeds.iter().copied()));
            counts[owner] += 1;
            // Dropping another replica never moves this key.
            let other = (owner + 1) % 3;
            let kept: Vec<u64> = (0..3).filter(|i| *i != other).map(|i| seeds[i]).collect();
            assert_eq!(kept[owner_index(&key, kept.iter().copied())], seeds[owner]);
        }
        assert!(counts.iter().all(|c| *c > 800), "{counts:?}");
    }
}
