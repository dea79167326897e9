//! The limiter's clock: Unix milliseconds that never jump.
//!
//! Windows compare times taken moments apart; a wall clock stepped back by
//! NTP would keep old requests "in the future" (a key locked out for as long
//! as the step), stepped forward it would empty every window. This clock
//! reads the wall clock once, then advances with the monotonic clock.

use std::sync::OnceLock;
use std::time::Instant;

static BASE: OnceLock<(Instant, i64)> = OnceLock::new();

/// Milliseconds on the Unix scale, monotonic within this process.
pub fn now_ms() -> i64 {
    let (start, unix_ms) = BASE.get_or_init(|| (Instant::now(), rialto_core::db::now_ms()));
    let elapsed = i64::try_from(start.elapsed().as_millis()).unwrap_or(i64::MAX / 2);
    unix_ms.saturating_add(elapsed)
}

#[cfg(test)]
mod tests {
    #[test]
    fn follows_the_wall_clock_and_never_goes_back() {
        let a = super::now_ms();
        let b = super::now_ms();
        assert!(b >= a);
        assert!((a - rialto_core::db::now_ms()).abs() < 5_000);
    }
}
