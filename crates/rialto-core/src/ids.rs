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

/// A request id in the shape of a `CF-RAY` value: 16 lowercase hex digits.
pub fn request_id() -> String {
    hex::encode(random_bytes::<8>())
}

#[cfg(test)]
mod tests {
    #[test]
    fn request_ids_are_hex_and_distinct() {
        let a = super::request_id();
        let b = super::request_id();
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
