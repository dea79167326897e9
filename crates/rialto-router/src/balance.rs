//! Which backend gets a request, and how long to wait before trying again.
//!
//! - [`two_choices`]: weighted power of two choices. Two distinct candidates
//!   are drawn at random in proportion to their weights, and the one with
//!   fewer requests in flight per unit of weight wins. Idle backends share
//!   traffic by weight; a slow or busy one sheds it to the others.
//! - [`rendezvous`]: weighted rendezvous hashing for `prompt_cache_key`, so
//!   one conversation keeps hitting one backend's prefix cache. With equal
//!   weights it agrees with [`rialto_core::placement::owner_index`].
//! - [`backoff`]: exponential backoff with full jitter.
//!
//! Candidates are a bit set (`u64`) over a model's backends: picking
//! allocates nothing. A model has at most [`MAX_BACKENDS`] backends.

use std::cell::Cell;
use std::time::Duration;

/// The most backends one model may have (one bit each in a `u64`).
pub(crate) const MAX_BACKENDS: usize = 64;

/// The bit of backend `index` in a candidate set.
pub(crate) fn bit(index: usize) -> u64 {
    1 << index
}

/// A random number from a per-thread wyrand generator seeded by the OS
/// (through std's `RandomState`). Fast and not cryptographic: it only
/// spreads load and jitters waits.
pub(crate) fn random() -> u64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(seed());
    }
    STATE.with(|state| {
        let next = state.get().wrapping_add(0xa076_1d64_78bd_642f);
        state.set(next);
        let product = u128::from(next) * u128::from(next ^ 0xe703_7ed1_a0b4_28db);
        (product as u64) ^ ((product >> 64) as u64)
    })
}

fn seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// Weighted power of two choices among the backends in `candidates`:
/// `weight(i)` is backend `i`'s share, `load(i)` its requests in flight.
/// None when there is no candidate.
pub(crate) fn two_choices(
    candidates: u64,
    weight: impl Fn(usize) -> u64,
    load: impl Fn(usize) -> u64,
    random: &mut impl FnMut() -> u64,
) -> Option<usize> {
    let total = members(candidates).map(&weight).sum::<u64>();
    let first = weighted_pick(candidates, &weight, total, random())?;
    let rest = candidates & !bit(first);
    let Some(second) = weighted_pick(rest, &weight, total - weight(first), random()) else {
        return Some(first);
    };
    // load(first) / weight(first) <= load(second) / weight(second), without
    // division; a tie keeps the first draw, itself drawn by weight.
    let first_cost = u128::from(load(first)) * u128::from(weight(second));
    let second_cost = u128::from(load(second)) * u128::from(weight(first));
    Some(if first_cost <= second_cost {
        first
    } else {
        second
    })
}

/// A member of `candidates` drawn with probability weight / `total`.
fn weighted_pick(
    candidates: u64,
    weight: &impl Fn(usize) -> u64,
    total: u64,
    random: u64,
) -> Option<usize> {
    if total == 0 {
        return None;
    }
    let mut point = random % total;
    for index in members(candidates) {
        let share = weight(index);
        if point < share {
            return Some(index);
        }
        point -= share;
    }
    None
}

/// The indices set in `set`, lowest first.
pub(crate) fn members(set: u64) -> impl Iterator<Item = usize> {
    let mut rest = set;
    std::iter::from_fn(move || {
        if rest == 0 {
            return None;
        }
        let index = rest.trailing_zeros() as usize;
        rest &= rest - 1;
        Some(index)
    })
}

/// The member of `candidates` owning `key` by weighted rendezvous hashing:
/// the highest `weight / -ln(u)`, where `u` in (0, 1) is the key's hash on
/// the backend's seed. A backend's share of keys is its share of weight,
/// and removing a backend moves only the keys it owned.
pub(crate) fn rendezvous(
    key: &str,
    candidates: u64,
    seed: impl Fn(usize) -> u64,
    weight: impl Fn(usize) -> u64,
) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for index in members(candidates) {
        let hash = rialto_core::placement::score(key, seed(index));
        // The top 53 bits, as a uniform float strictly inside (0, 1).
        let unit = ((hash >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let score = weight(index) as f64 / -unit.ln();
        if best.is_none_or(|(_, top)| score > top) {
            best = Some((index, score));
        }
    }
    best.map(|(index, _)| index)
}

/// The wait before retry number `retry` (1 for the first): a uniform random
/// time between zero and `min(cap, base * 2^(retry - 1))`.
pub(crate) fn backoff(retry: u32, base: Duration, cap: Duration, random: u64) -> Duration {
    let ceiling = base
        .saturating_mul(1 << retry.saturating_sub(1).min(30))
        .min(cap);
    let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(random % nanos.saturating_add(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_backends_share_traffic_by_weight() {
        let weights = [1u64, 3, 0, 4];
        // Backend 2 is not a candidate (say, its circuit is open).
        let candidates = bit(0) | bit(1) | bit(3);
        let mut counts = [0u32; 4];
        for _ in 0..80_000 {
            let pick = two_choices(candidates, |i| weights[i], |_| 0, &mut random).unwrap();
            counts[pick] += 1;
        }
        assert_eq!(counts[2], 0);
        // Expected 10,000 / 30,000 / 40,000.
        assert!((9_000..11_000).contains(&counts[0]), "{counts:?}");
        assert!((28_500..31_500).contains(&counts[1]), "{counts:?}");
        assert!((38_500..41_500).contains(&counts[3]), "{counts:?}");
    }

    #[test]
    fn the_less_loaded_of_two_wins() {
        let loads = [7u64, 0, 7];
        let mut counts = [0u32; 3];
        for _ in 0..30_000 {
            let pick = two_choices(0b111, |_| 1, |i| loads[i], &mut random).unwrap();
            counts[pick] += 1;
        }
        // The idle backend is in two pairs of three and wins both: 2/3.
        assert!((19_000..21_000).contains(&counts[1]), "{counts:?}");
        // Load counts per unit of weight: 4 in flight on weight 4 beats 2 on 1.
        let weights = [1u64, 4];
        let loads = [2u64, 4];
        for _ in 0..100 {
            let pick = two_choices(0b11, |i| weights[i], |i| loads[i], &mut random);
            assert_eq!(pick, Some(1));
        }
    }

    #[test]
    fn no_candidate_no_pick_and_one_candidate_always() {
        assert_eq!(two_choices(0, |_| 1, |_| 0, &mut random), None);
        for _ in 0..100 {
            assert_eq!(two_choices(bit(5), |_| 1, |_| 9, &mut random), Some(5));
        }
        assert_eq!(rendezvous("k", 0, |i| i as u64, |_| 1), None);
        assert_eq!(
            members(bit(0) | bit(9) | bit(63)).collect::<Vec<_>>(),
            [0, 9, 63]
        );
    }

    #[test]
    fn rendezvous_is_sticky_weighted_and_matches_placement() {
        let seeds: Vec<u64> = ["m/0", "m/1", "m/2"]
            .iter()
            .map(|n| rialto_core::placement::replica_seed(n))
            .collect();
        let mut counts = [0u32; 3];
        for i in 0..30_000 {
            let key = format!("conversation-{i}");
            let owner = rendezvous(&key, 0b111, |i| seeds[i], |_| 1).unwrap();
            assert_eq!(
                owner,
                rialto_core::placement::owner_index(&key, seeds.iter().copied())
            );
            // Without its owner, a key moves; without another, it stays.
            let other = (owner + 1) % 3;
            assert_eq!(
                rendezvous(&key, 0b111 & !bit(other), |i| seeds[i], |_| 1),
                Some(owner)
            );
            let weighted = rendezvous(&key, 0b111, |i| seeds[i], |i| [1, 1, 2][i]).unwrap();
            counts[weighted] += 1;
        }
        // Expected 7,500 / 7,500 / 15,000.
        assert!((7_000..8_000).contains(&counts[0]), "{counts:?}");
        assert!((14_300..15_700).contains(&counts[2]), "{counts:?}");
    }

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let base = Duration::from_millis(25);
        let cap = Duration::from_millis(1_000);
        let ceilings = [25, 50, 100, 200, 400, 800, 1_000, 1_000, 1_000];
        for (retry, ceiling) in (1..).zip(ceilings) {
            let ceiling = Duration::from_millis(ceiling);
            let waits: Vec<Duration> = (0..2_000)
                .map(|_| backoff(retry, base, cap, random()))
                .collect();
            assert!(waits.iter().all(|w| *w <= ceiling), "retry {retry}");
            // Full jitter: spread over the whole range, not bunched.
            assert!(waits.iter().any(|w| *w < ceiling / 4), "retry {retry}");
            assert!(waits.iter().any(|w| *w > ceiling * 3 / 4), "retry {retry}");
        }
        // The ceiling itself can be drawn; huge retry numbers neither
        // overflow nor pass the cap.
        assert_eq!(
            backoff(3, base, cap, 100_000_000),
            Duration::from_millis(100)
        );
        assert!(backoff(u32::MAX, base, cap, random()) <= cap);
        assert_eq!(backoff(1, Duration::ZERO, cap, random()), Duration::ZERO);
    }
}
