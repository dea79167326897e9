//! One rate window: a sliding log of the requests admitted in the last
//! `span`, with their tokens, and a count of the requests of the UTC day.
//!
//! Why a sliding log: it is exact. "At most N requests in any `span`" holds
//! at every instant, with no burst at a window boundary (a fixed window lets
//! 2N through around the boundary) and no approximation (a sliding-window
//! counter interpolates, GCRA refills continuously so a burst test admits
//! "50 and a bit"). Its cost is one entry of 32 bytes per request in the
//! window, bounded by the limit itself, and O(1) amortized work per
//! decision. Token estimates are corrected in place when the real usage is
//! known, so the log also gives exact token windows.
//!
//! Time is passed in (Unix milliseconds), never read here: the tests drive
//! it by hand.

use std::collections::VecDeque;

use rialto_proto::limiter::v1 as pb;

const DAY_MS: i64 = 86_400_000;

#[derive(Debug, Clone, Copy)]
struct Entry {
    at_ms: i64,
    tokens: u64,
    /// Which request this is (a hash of its id), for commits.
    tag: u64,
    /// False for tokens a request used after its own entry left the window:
    /// they count as tokens, not as a request.
    request: bool,
}

/// Most tokens one entry counts: bounds every sum far below overflow, and
/// is far above any real request.
const MAX_ENTRY_TOKENS: u64 = 1 << 40;

/// What refused a request, and from when it would fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub by: LimitType,
    pub retry_at_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitType {
    Rpm,
    Tpm,
    Rpd,
}

impl LimitType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rpm => "RPM",
            Self::Tpm => "TPM",
            Self::Rpd => "RPD",
        }
    }
}

#[derive(Debug)]
pub struct Window {
    span_ms: i64,
    entries: VecDeque<Entry>,
    /// Entries that are requests.
    requests: u64,
    /// Sum of `entries[..].tokens`.
    tokens: u64,
    /// UTC day number and the requests admitted on it.
    day: (i64, u64),
}

impl Window {
    pub fn new(span_ms: i64) -> Self {
        Self {
            span_ms: span_ms.max(1),
            entries: VecDeque::new(),
            requests: 0,
            tokens: 0,
            day: (0, 0),
        }
    }

    fn expire(&mut self, now_ms: i64) {
        while let Some(front) = self.entries.front() {
            if front.at_ms + self.span_ms > now_ms {
                break;
            }
            self.tokens -= front.tokens;
            self.requests -= u64::from(front.request);
            self.entries.pop_front();
        }
        let today = now_ms.div_euclid(DAY_MS);
        if self.day.0 != today {
            self.day = (today, 0);
        }
    }

    /// Admits a request of `estimate` tokens under `limit`, or says why not.
    pub fn admit(
        &mut self,
        now_ms: i64,
        limit: &pb::Limit,
        estimate: u64,
        tag: u64,
    ) -> Result<(), Refusal> {
        self.expire(now_ms);
        let estimate = estimate.min(MAX_ENTRY_TOKENS);
        let mut refusal: Option<Refusal> = None;
        let mut refuse = |by, retry_at_ms: i64| {
            // Several limits may refuse: the caller may retry once all fit.
            if refusal.is_none_or(|r| retry_at_ms > r.retry_at_ms) {
                refusal = Some(Refusal { by, retry_at_ms });
            }
        };
        let count = self.requests;
        if count >= limit.requests {
            // A slot frees when enough of the oldest requests have left:
            // the (count - limit + 1)-th oldest, or never under a zero limit.
            let leaving = (count + 1).saturating_sub(limit.requests) as usize;
            let retry = self
                .entries
                .iter()
                .filter(|e| e.request)
                .nth(leaving.saturating_sub(1))
                .filter(|_| limit.requests > 0)
                .map_or(now_ms + self.span_ms, |e| e.at_ms + self.span_ms);
            refuse(LimitType::Rpm, retry);
        }
        if limit.tokens > 0 && self.tokens.saturating_add(estimate) > limit.tokens {
            refuse(
                LimitType::Tpm,
                self.tokens_fit_at(now_ms, limit.tokens, estimate),
            );
        }
        if limit.requests_per_day > 0 && self.day.1 >= limit.requests_per_day {
            refuse(LimitType::Rpd, (self.day.0 + 1) * DAY_MS);
        }
        if let Some(refusal) = refusal {
            return Err(refusal);
        }
        self.entries.push_back(Entry {
            at_ms: now_ms,
            tokens: estimate,
            tag,
            request: true,
        });
        self.requests += 1;
        self.tokens += estimate;
        // Days are counted only under a daily limit: otherwise the count
        // would keep every principal's windows held until midnight.
        if limit.requests_per_day > 0 {
            self.day.1 += 1;
        }
        Ok(())
    }

    /// Adds a request another replica admitted at `at_ms` with `estimate`
    /// tokens, unless the window holds it already: a copy of the owner's
    /// window, kept to take the principal over. Entries stay in time order
    /// (an admission may arrive after later ones from another decider).
    /// `day_count`, under a daily limit: the owner's count of the day with
    /// this admission, which the copy's count is raised to. Whether it was
    /// added.
    pub fn replay(
        &mut self,
        now_ms: i64,
        at_ms: i64,
        estimate: u64,
        tag: u64,
        day_count: Option<u64>,
    ) -> bool {
        self.expire(now_ms);
        let known = self.entries.iter().any(|e| e.tag == tag && e.request);
        if known || at_ms + self.span_ms <= now_ms {
            return false;
        }
        let estimate = estimate.min(MAX_ENTRY_TOKENS);
        let at = self
            .entries
            .iter()
            .rposition(|e| e.at_ms <= at_ms)
            .map_or(0, |i| i + 1);
        self.entries.insert(
            at,
            Entry {
                at_ms,
                tokens: estimate,
                tag,
                request: true,
            },
        );
        self.requests += 1;
        self.tokens += estimate;
        if let Some(count) = day_count
            && at_ms.div_euclid(DAY_MS) == self.day.0
        {
            self.day.1 = self.day.1.max(count);
        }
        true
    }

    /// The requests admitted on the UTC day of `now_ms` (counted only under
    /// a daily limit).
    pub fn day_count(&mut self, now_ms: i64) -> u64 {
        self.expire(now_ms);
        self.day.1
    }

    /// When enough tokens will have left the window for `estimate` more to
    /// fit under `limit`. A request larger than the whole limit never fits:
    /// it is told to come back after a full window.
    fn tokens_fit_at(&self, now_ms: i64, limit: u64, estimate: u64) -> i64 {
        if estimate > limit {
            return now_ms + self.span_ms;
        }
        let mut in_window = self.tokens;
        for entry in &self.entries {
            in_window -= entry.tokens;
            if in_window + estimate <= limit {
                return entry.at_ms + self.span_ms;
            }
        }
        now_ms + self.span_ms
    }

    /// Replaces the estimate of the request tagged `tag` (admitted with
    /// `estimate` tokens) by the `used` tokens, or with `release`, removes
    /// the request. When the request already left the window (a long
    /// stream), what it used beyond its estimate is counted now, as tokens
    /// without a request: they were produced recently.
    pub fn commit(&mut self, now_ms: i64, tag: u64, estimate: u64, used: u64, release: bool) {
        self.expire(now_ms);
        let used = used.min(MAX_ENTRY_TOKENS);
        // Commits come soon after admission: search from the newest end.
        let Some(index) = self.entries.iter().rposition(|e| e.tag == tag && e.request) else {
            let excess = used.saturating_sub(estimate.min(MAX_ENTRY_TOKENS));
            if !release && excess > 0 {
                self.entries.push_back(Entry {
                    at_ms: now_ms,
                    tokens: excess,
                    tag,
                    request: false,
                });
                self.tokens += excess;
            }
            return;
        };
        if release {
            if let Some(entry) = self.entries.remove(index) {
                self.tokens -= entry.tokens;
                self.requests -= 1;
                // Only a request counted today gives back today's count.
                if entry.at_ms.div_euclid(DAY_MS) == self.day.0 {
                    self.day.1 = self.day.1.saturating_sub(1);
                }
            }
            return;
        }
        let entry = &mut self.entries[index];
        self.tokens = self.tokens - entry.tokens + used;
        entry.tokens = used;
    }

    /// The window in the terms of the `x-ratelimit-*` headers.
    pub fn state(&mut self, now_ms: i64, limit: &pb::Limit) -> pb::WindowState {
        self.expire(now_ms);
        let reset_requests_ms = self
            .entries
            .iter()
            .find(|e| e.request)
            .map_or(now_ms, |e| e.at_ms + self.span_ms);
        let reset_tokens_ms = self
            .entries
            .iter()
            .find(|e| e.tokens > 0)
            .map_or(now_ms, |e| e.at_ms + self.span_ms);
        pb::WindowState {
            limit_requests: limit.requests,
            remaining_requests: limit.requests.saturating_sub(self.requests),
            reset_requests_ms,
            limit_tokens: limit.tokens,
            remaining_tokens: limit.tokens.saturating_sub(self.tokens),
            reset_tokens_ms,
        }
    }

    /// Whether nothing in the window would change a future decision.
    pub fn is_empty(&mut self, now_ms: i64) -> bool {
        self.expire(now_ms);
        self.entries.is_empty() && self.day.1 == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: i64 = 60_000;
    /// Noon on some day, so day boundaries are far.
    const T0: i64 = 1_800_000_000_000 - 1_800_000_000_000 % DAY_MS + DAY_MS / 2;

    fn limit(requests: u64, tokens: u64) -> pb::Limit {
        pb::Limit {
            requests,
            tokens,
            requests_per_day: 0,
        }
    }

    /// A copy fed the owner's admissions in any order, once or twice,
    /// refuses and admits as the owner does.
    #[test]
    fn a_replayed_window_decides_as_the_owners_does() {
        let three = limit(3, 0);
        let mut owner = Window::new(MINUTE);
        let mut copy = Window::new(MINUTE);
        for (tag, at) in [(1, T0), (2, T0 + 10), (3, T0 + 20)] {
            owner.admit(at, &three, 5, tag).unwrap();
        }
        for (tag, at) in [(3, T0 + 20), (1, T0), (2, T0 + 10), (2, T0 + 10)] {
            copy.replay(T0 + 25, at, 5, tag, None);
        }
        // Older than the window by the time it arrives: nothing to keep.
        assert!(!copy.replay(T0 + 25, T0 - MINUTE, 5, 4, None));
        let refused = owner.admit(T0 + 30, &three, 5, 9).unwrap_err();
        assert_eq!(copy.admit(T0 + 30, &three, 5, 9).unwrap_err(), refused);
        assert_eq!(refused.retry_at_ms, T0 + MINUTE);
        assert_eq!(copy.state(T0 + 30, &three), owner.state(T0 + 30, &three));
        // The first leaves the window at the same time in both.
        assert!(owner.admit(T0 + MINUTE, &three, 5, 9).is_ok());
        assert!(copy.admit(T0 + MINUTE, &three, 5, 9).is_ok());
    }

    #[test]
    fn admits_exactly_the_limit_within_a_window() {
        let mut window = Window::new(MINUTE);
        let limit = limit(50, 0);
        let admitted = (0..200)
            .filter(|i| window.admit(T0 + i, &limit, 0, *i as u64).is_ok())
            .count();
        assert_eq!(admitted, 50);
        let state = window.state(T0 + 200, &limit);
        assert_eq!(state.remaining_requests, 0);
        assert_eq!(state.reset_requests_ms, T0 + MINUTE);
    }

    #[test]
    fn the_window_slides_request_by_request() {
        let mut window = Window::new(MINUTE);
        let limit = limit(2, 0);
        window.admit(T0, &limit, 0, 1).unwrap();
        window.admit(T0 + 10_000, &limit, 0, 2).unwrap();
        let refusal = window.admit(T0 + 20_000, &limit, 0, 3).unwrap_err();
        assert_eq!(refusal.by, LimitType::Rpm);
        // The first request leaves at T0 + 60 s: one slot, not two.
        assert_eq!(refusal.retry_at_ms, T0 + MINUTE);
        assert!(window.admit(T0 + MINUTE - 1, &limit, 0, 4).is_err());
        window.admit(T0 + MINUTE, &limit, 0, 5).unwrap();
        assert!(window.admit(T0 + MINUTE, &limit, 0, 6).is_err());
        // No boundary burst: after a full quiet minute, the limit again.
        assert!(window.admit(T0 + 3 * MINUTE, &limit, 0, 7).is_ok());
        assert!(window.admit(T0 + 3 * MINUTE, &limit, 0, 8).is_ok());
        assert!(window.admit(T0 + 3 * MINUTE, &limit, 0, 9).is_err());
    }

    #[test]
    fn tokens_are_admitted_on_the_estimate_and_corrected_on_commit() {
        let mut window = Window::new(MINUTE);
        let limit = limit(100, 1000);
        window.admit(T0, &limit, 600, 1).unwrap();
        // 600 + 500 > 1000: refused on tokens, until the first one leaves.
        let refusal = window.admit(T0 + 1, &limit, 500, 2).unwrap_err();
        assert_eq!(refusal.by, LimitType::Tpm);
        assert_eq!(refusal.retry_at_ms, T0 + MINUTE);
        // The first request really used 100 tokens: now 500 fit.
        window.commit(T0 + 2, 1, 600, 100, false);
        window.admit(T0 + 3, &limit, 500, 2).unwrap();
        let state = window.state(T0 + 4, &limit);
        assert_eq!(state.remaining_tokens, 400);
        assert_eq!(state.reset_tokens_ms, T0 + MINUTE);
        // A commit above the estimate counts the real usage.
        window.commit(T0 + 5, 2, 500, 900, false);
        assert_eq!(window.state(T0 + 6, &limit).remaining_tokens, 0);
    }

    #[test]
    fn a_request_larger_than_the_token_limit_never_fits() {
        let mut window = Window::new(MINUTE);
        let refusal = window.admit(T0, &limit(10, 100), 101, 1).unwrap_err();
        assert_eq!(refusal.by, LimitType::Tpm);
        assert_eq!(refusal.retry_at_ms, T0 + MINUTE);
    }

    #[test]
    fn release_gives_the_slot_back_and_late_commits_change_nothing() {
        let mut window = Window::new(MINUTE);
        let limit = limit(1, 1000);
        window.admit(T0, &limit, 10, 1).unwrap();
        window.commit(T0 + 1, 1, 10, 0, true);
        window.admit(T0 + 2, &limit, 10, 2).unwrap();
        // Request 2 left the window before its commit arrived: only what it
        // used beyond its estimate counts, from now, and not as a request.
        window.commit(T0 + 2 * MINUTE, 2, 10, 10, false);
        assert_eq!(window.state(T0 + 2 * MINUTE, &limit).remaining_tokens, 1000);
        window.commit(T0 + 2 * MINUTE, 2, 10, 810, false);
        let state = window.state(T0 + 2 * MINUTE, &limit);
        assert_eq!(state.remaining_tokens, 200);
        assert_eq!(state.remaining_requests, 1);
        window.admit(T0 + 2 * MINUTE, &limit, 10, 3).unwrap();
        assert!(window.admit(T0 + 2 * MINUTE, &limit, 500, 4).is_err());
    }

    #[test]
    fn absurd_token_counts_cannot_overflow() {
        let mut window = Window::new(MINUTE);
        let limit = limit(10, 0);
        window.admit(T0, &limit, u64::MAX, 1).unwrap();
        window.admit(T0, &limit, u64::MAX, 2).unwrap();
        window.commit(T0, 1, u64::MAX, u64::MAX, false);
        window.commit(T0 + 2 * MINUTE, 2, 0, u64::MAX, false);
        assert!(window.state(T0 + 2 * MINUTE, &limit).remaining_requests == 10);
    }

    #[test]
    fn requests_per_day_reset_at_utc_midnight() {
        let mut window = Window::new(MINUTE);
        let limit = pb::Limit {
            requests: 100,
            tokens: 0,
            requests_per_day: 2,
        };
        window.admit(T0, &limit, 0, 1).unwrap();
        window.admit(T0 + 1, &limit, 0, 2).unwrap();
        let refusal = window.admit(T0 + 2 * MINUTE, &limit, 0, 3).unwrap_err();
        assert_eq!(refusal.by, LimitType::Rpd);
        let midnight = T0 - T0 % DAY_MS + DAY_MS;
        assert_eq!(refusal.retry_at_ms, midnight);
        assert!(
            !window.is_empty(T0 + 2 * MINUTE),
            "the day's count is state"
        );
        window.admit(midnight, &limit, 0, 4).unwrap();
    }

    #[test]
    fn the_latest_retry_wins_when_several_limits_refuse() {
        let mut window = Window::new(MINUTE);
        let limit = limit(1, 100);
        window.admit(T0, &limit, 100, 1).unwrap();
        let refusal = window.admit(T0 + 1, &limit, 1, 2).unwrap_err();
        assert_eq!(refusal.retry_at_ms, T0 + MINUTE);
    }
}
