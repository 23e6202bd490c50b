//! Request ids, bootstrap rooms, the clock and the token count, as every role draws and
//! counts them.

use std::time::{SystemTime, UNIX_EPOCH};

use rand::RngExt;

pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// SGLang request ids are uuid4 hex (32 lowercase hex chars).
pub fn new_rid() -> String {
    format!("{:032x}", rand::rng().random::<u128>())
}

/// Rooms are random non-negative i64 values, as the router draws them (fits Python ints and
/// JSON numbers that some clients parse as i64).
pub fn new_room() -> u64 {
    rand::rng().random::<u64>() & (i64::MAX as u64)
}

/// How SGLang prints a room in spans: Python's `hex(room)` — lowercase, `0x`, no padding.
pub fn room_hex(room: u64) -> String {
    format!("{room:#x}")
}

/// Token count used everywhere in the simulator: whitespace-separated words. Real servers use
/// a model tokenizer; a word count keeps the load generator, the limits and the tests in
/// exact agreement without shipping a tokenizer.
pub fn count_tokens(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_whitespace_words() {
        assert_eq!(count_tokens("  a b\tc\nd  "), 4);
        assert_eq!(count_tokens(""), 0);
    }

    #[test]
    fn room_hex_is_python_hex() {
        assert_eq!(room_hex(0x314783f6bef71155), "0x314783f6bef71155");
        assert_eq!(room_hex(5), "0x5");
    }
}
