//! Abuse protection: more than `threshold` failed requests within
//! `window` from one subject block all of its requests for `block`.
//!
//! A subject is the credential a request presents (a fingerprint of its
//! `Authorization` value, so the check needs no authentication and runs
//! before anything else) when the request authenticated, or the client's
//! address when it did not. The guard lives in each gateway process: a check
//! is one hash and one uncontended lock, with no call to another service. With
//! several gateways each counts what it sees; a client spread over N
//! gateways by a load balancer is blocked after at most N times the
//! threshold.
//!
//! Time is passed in (`Instant`), so tests drive it by hand.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rialto_core::config::AbuseConfig;

/// Who failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Subject {
    /// A fingerprint of a presented credential (see [`AbuseGuard::credential`]).
    Credential(u64),
    Address(IpAddr),
}

/// What recording a failure did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    Counted,
    /// This failure crossed the threshold: the subject is blocked from now.
    Blocked,
}

#[derive(Default)]
struct Record {
    failures: VecDeque<Instant>,
    blocked_until: Option<Instant>,
    /// When this credential last authenticated here: callers behind a
    /// blocked address get through only with a credential that did.
    vouched_at: Option<Instant>,
}

impl Record {
    fn is_live(&self, now: Instant, window: Duration) -> bool {
        self.blocked_until.is_some_and(|u| u > now)
            || self
                .failures
                .back()
                .is_some_and(|t| now.saturating_duration_since(*t) < window)
            || self
                .vouched_at
                .is_some_and(|t| now.saturating_duration_since(t) < VOUCH_TTL)
    }
}

const SHARDS: usize = 16;
/// How long a credential that authenticated stays good enough to pass a
/// blocked address without a new check.
const VOUCH_TTL: Duration = Duration::from_secs(600);
/// Subjects per shard before stale ones are swept (at most once a second).
const SWEEP_ABOVE: usize = 4096;

struct Shard {
    records: HashMap<Subject, Record>,
    swept_at: Option<Instant>,
}

pub struct AbuseGuard {
    threshold: usize,
    window: Duration,
    block: Duration,
    shards: [Mutex<Shard>; SHARDS],
    hasher: RandomState,
}

impl std::fmt::Debug for AbuseGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbuseGuard")
            .field("threshold", &self.threshold)
            .finish_non_exhaustive()
    }
}

impl AbuseGuard {
    pub fn new(config: &AbuseConfig) -> Self {
        Self {
            threshold: config.threshold as usize,
            window: Duration::from_secs(config.window_secs),
            block: Duration::from_secs(config.block_secs),
            shards: std::array::from_fn(|_| {
                Mutex::new(Shard {
                    records: HashMap::new(),
                    swept_at: None,
                })
            }),
            hasher: RandomState::new(),
        }
    }

    pub fn threshold(&self) -> usize {
        self.threshold
    }

    pub fn block(&self) -> Duration {
        self.block
    }

    /// A fingerprint of a credential (the bearer token, without scheme or
    /// spaces): keyed by a per-process random seed, never stored, never
    /// logged.
    pub fn credential(&self, token: &[u8]) -> Subject {
        Subject::Credential(self.hasher.hash_one(token))
    }

    /// A client address as a subject: IPv4-mapped IPv6 as IPv4, other IPv6
    /// addresses by their /64 (what one host usually holds).
    pub fn address(address: IpAddr) -> Subject {
        let address = match address {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => {
                    let mut octets = v6.octets();
                    octets[8..].fill(0);
                    IpAddr::V6(octets.into())
                }
            },
            v4 => v4,
        };
        Subject::Address(address)
    }

    fn shard(&self, subject: &Subject) -> std::sync::MutexGuard<'_, Shard> {
        let index = self.hasher.hash_one(subject) as usize % SHARDS;
        self.shards[index].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Until when `subject` is blocked, if it is.
    pub fn blocked_until(&self, subject: &Subject, now: Instant) -> Option<Instant> {
        let shard = self.shard(subject);
        shard
            .records
            .get(subject)
            .and_then(|r| r.blocked_until)
            .filter(|until| *until > now)
    }

    /// Records that `subject` (a credential) just authenticated.
    pub fn vouch(&self, subject: Subject, now: Instant) {
        let mut shard = self.shard(&subject);
        let record = shard.records.entry(subject).or_default();
        record.vouched_at = Some(now);
    }

    /// Whether `subject` authenticated within the last ten minutes.
    pub fn is_vouched(&self, subject: &Subject, now: Instant) -> bool {
        let shard = self.shard(subject);
        shard
            .records
            .get(subject)
            .and_then(|r| r.vouched_at)
            .is_some_and(|t| now.saturating_duration_since(t) < VOUCH_TTL)
    }

    /// Counts one failed request of `subject`.
    pub fn record_failure(&self, subject: Subject, now: Instant) -> Recorded {
        let mut shard = self.shard(&subject);
        let due = shard
            .swept_at
            .is_none_or(|t| now.saturating_duration_since(t) >= Duration::from_secs(1));
        if shard.records.len() > SWEEP_ABOVE && due {
            // Forget subjects with nothing recent, at most once a second:
            // memory follows the rate of failures, not the number of
            // addresses ever seen, and no request pays a sweep per call.
            let window = self.window;
            shard.records.retain(|_, r| r.is_live(now, window));
            shard.swept_at = Some(now);
        }
        let record = shard.records.entry(subject).or_default();
        if record.blocked_until.is_some_and(|until| until > now) {
            // Already blocked: the block is not extended by its own refusals.
            return Recorded::Counted;
        }
        while record
            .failures
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) >= self.window)
        {
            record.failures.pop_front();
        }
        record.failures.push_back(now);
        if record.failures.len() > self.threshold {
            record.failures.clear();
            record.blocked_until = Some(now + self.block);
            return Recorded::Blocked;
        }
        Recorded::Counted
    }
}

/// Whether a response status counts as a failed request: a 4xx other than
/// 429. A 429 is already the limiter's answer (counting it would turn a
/// client's backoff retries into a lockout), and a 5xx is our failure, not
/// the caller's.
pub fn is_failure(status: u16) -> bool {
    (400..500).contains(&status) && status != 429
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard() -> AbuseGuard {
        AbuseGuard::new(&AbuseConfig::default())
    }

    #[test]
    fn twenty_failures_are_tolerated_the_twenty_first_blocks_for_30_s() {
        let guard = guard();
        let start = Instant::now();
        let who = guard.credential(b"Bearer nope");
        for i in 0..20 {
            let at = start + Duration::from_millis(i * 100);
            assert_eq!(guard.record_failure(who, at), Recorded::Counted);
            assert_eq!(guard.blocked_until(&who, at), None);
        }
        let at = start + Duration::from_secs(3);
        assert_eq!(guard.record_failure(who, at), Recorded::Blocked);
        assert_eq!(
            guard.blocked_until(&who, at),
            Some(at + Duration::from_secs(30))
        );
        // Others are not affected.
        let other = Subject::Address("127.0.0.1".parse().unwrap());
        assert_eq!(guard.blocked_until(&other, at), None);
        // The block expires after 30 s, and the count starts over.
        let after = at + Duration::from_secs(30);
        assert_eq!(guard.blocked_until(&who, after), None);
        assert_eq!(guard.record_failure(who, after), Recorded::Counted);
    }

    #[test]
    fn failures_older_than_the_window_do_not_count() {
        let guard = guard();
        let start = Instant::now();
        let who = Subject::Address("10.0.0.1".parse().unwrap());
        for i in 0..100 {
            // One failure every 2 s: at most 15 in any 30 s.
            let at = start + Duration::from_secs(2 * i);
            assert_eq!(guard.record_failure(who, at), Recorded::Counted);
        }
    }

    #[test]
    fn statuses_that_count() {
        assert!(is_failure(400));
        assert!(is_failure(401));
        assert!(is_failure(404));
        assert!(!is_failure(429));
        assert!(!is_failure(200));
        assert!(!is_failure(503));
    }

    #[test]
    fn addresses_group_by_host() {
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().unwrap();
        let v4: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(AbuseGuard::address(mapped), AbuseGuard::address(v4));
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(AbuseGuard::address(a), AbuseGuard::address(b));
        assert_ne!(AbuseGuard::address(a), AbuseGuard::address(c));
    }

    #[test]
    fn vouching_lasts_ten_minutes() {
        let guard = guard();
        let now = Instant::now();
        let who = guard.credential(b"k");
        assert!(!guard.is_vouched(&who, now));
        guard.vouch(who, now);
        assert!(guard.is_vouched(&who, now + Duration::from_secs(599)));
        assert!(!guard.is_vouched(&who, now + Duration::from_secs(600)));
    }

    #[test]
    fn credentials_have_distinct_fingerprints() {
        let guard = guard();
        assert_ne!(guard.credential(b"Bearer a"), guard.credential(b"Bearer b"));
        assert_eq!(guard.credential(b"Bearer a"), guard.credential(b"Bearer a"));
    }
}
