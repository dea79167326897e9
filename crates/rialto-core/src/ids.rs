//! Identifiers generated on the request path.

/// Random bytes from the operating system's generator.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    // The OS generator failing means the machine cannot make secrets at all;
    // fall back to a time-seeded value only for non-secret ids.
    if getrandom::fill(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
            .to_le_bytes();
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = nanos[i % nanos.len()];
        }
    }
    bytes
}

/// A secret token: 32 random bytes from the operating system, in hex. No
/// fallback: a machine whose generator fails cannot make secrets.
pub fn random_token() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)?;
    Ok(hex::encode(bytes))
}

/// A request id (the `CF-RAY` value): 32 lowercase hex digits, the
/// milliseconds since the Unix epoch (12 digits) and then 80 random bits.
///
/// The ledger keys a request's records by it (`settle:<id>`, the hold's
/// row), so it must be unique for the ledger's whole life: 64 random bits
/// (the id's shape before) would be expected to collide a few times a
/// year at 10,000 requests a second, and a collision reads as a replay.
/// In time order, each key goes to the end of its index instead of a
/// random page: a batch of settlements writes one index page, not one
/// each.
pub fn request_id() -> String {
    time_first_id(since_epoch().as_millis() as u64, 6)
}

/// A database row id: 32 lowercase hex digits, the microseconds since the
/// Unix epoch (14 digits) and then 72 random bits from the same per-thread
/// pool as [`request_id`] (the ledger's writer makes one per journal row:
/// a `getrandom` call each was a system call a record). Time first, so new
/// rows go to the end of the primary key's B-tree instead of a random page
/// (fewer pages written per commit).
pub fn row_id() -> String {
    time_first_id(since_epoch().as_micros() as u64, 7)
}

/// 32 lowercase hex digits: the last `time_bytes` bytes of `time`, big
/// endian (so ids sort by it), then random bits from [`id_random`].
fn time_first_id(time: u64, time_bytes: usize) -> String {
    let mut bytes = [0u8; 16];
    bytes[..time_bytes].copy_from_slice(&time.to_be_bytes()[8 - time_bytes..]);
    id_random(&mut bytes[time_bytes..]);
    // Into a buffer of twice the bytes' length (so it cannot fail):
    // `hex::encode` pushed one `char` at a time, ~1,060 instructions an id
    // against ~608, two ids a request (callgrind).
    let mut text = [0u8; 32];
    let _ = hex::encode_to_slice(bytes, &mut text);
    String::from_utf8_lossy(&text).into_owned()
}

/// The time since the Unix epoch (zero on a clock set before it).
fn since_epoch() -> std::time::Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}

/// Random bytes for ids (not secrets): taken from a per-thread buffer the
/// operating system's generator fills 4 KiB at a time, so that a request
/// makes no `getrandom` call of its own.
fn id_random(out: &mut [u8]) {
    use std::cell::RefCell;
    const POOL: usize = 4096;
    thread_local! {
        static BUFFER: RefCell<([u8; POOL], usize)> = const { RefCell::new(([0; POOL], POOL)) };
    }
    BUFFER.with_borrow_mut(|(pool, used)| {
        if *used + out.len() > POOL {
            *pool = random_bytes::<POOL>();
            *used = 0;
        }
        out.copy_from_slice(&pool[*used..*used + out.len()]);
        *used += out.len();
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn request_ids_are_hex_and_distinct() {
        let a = super::request_id();
        let b = super::request_id();
        assert_eq!(a.len(), 32);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        );
        assert_ne!(a, b);
        // In time order, to the millisecond.
        assert!(a[..12] <= b[..12]);
    }

    #[test]
    fn row_ids_are_hex_in_time_order_and_distinct() {
        let before = super::since_epoch().as_micros() as u64;
        let ids: Vec<String> = (0..2_000).map(|_| super::row_id()).collect();
        for id in &ids {
            assert_eq!(id.len(), 32);
            assert!(
                id.bytes()
                    .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
            );
        }
        // The first 14 digits are the time in microseconds, as the ids
        // written before (`{micros:014x}`) had them.
        let first = u64::from_str_radix(&ids[0][..14], 16).unwrap();
        assert!(
            first >= before && first - before < 60_000_000,
            "{first} {before}"
        );
        assert!(ids.windows(2).all(|pair| pair[0][..14] <= pair[1][..14]));
        let distinct: std::collections::HashSet<&String> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
    }

    #[test]
    fn request_ids_stay_distinct_across_refills_of_the_pool() {
        let ids: std::collections::HashSet<String> =
            (0..2_000).map(|_| super::request_id()).collect();
        assert_eq!(ids.len(), 2_000);
    }
}
