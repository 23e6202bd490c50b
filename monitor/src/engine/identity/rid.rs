//! An attempt's first rid, kept inline as 16 bytes when it is SGLang-shaped hex.

use super::keys::{AliasKind, key_str};
use crate::engine::mem::bits::hex8;

/// An attempt's first rid. SGLang rids are 32 lowercase hex digits (a uuid4 without dashes):
/// those are kept inline as 16 bytes (no heap string, and comparing one is no pointer chase);
/// any other rid keeps its text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Rid {
    #[default]
    None,
    Hex([u64; 2]),
    Text(Box<str>),
}

impl Rid {
    pub fn new(s: &str) -> Rid {
        match Self::hex(s) {
            Some(h) => Rid::Hex(h),
            None => Rid::Text(s.into()),
        }
    }

    /// 32 lowercase hex digits (so that printing gives back the same text), as two words.
    pub(super) fn hex(s: &str) -> Option<[u64; 2]> {
        let b: &[u8; 32] = s.as_bytes().try_into().ok()?;
        let mut v = [0u32; 4];
        for (i, out) in v.iter_mut().enumerate() {
            let chunk: [u8; 8] = b[i * 8..i * 8 + 8].try_into().expect("8 bytes");
            *out = hex8(u64::from_le_bytes(chunk))?;
        }
        Some([
            (v[0] as u64) << 32 | v[1] as u64,
            (v[2] as u64) << 32 | v[3] as u64,
        ])
    }

    /// Whether `s` is the hex form of `h` (as `Self::hex(s) == Some(h)`), eight digits at a
    /// time: another rid (a decode leg's, looked at against the prefill leg's) differs in its
    /// first eight, and the other 24 are not parsed.
    pub(super) fn hex_is(s: &str, h: [u64; 2]) -> bool {
        let Ok(b) = <&[u8; 32]>::try_from(s.as_bytes()) else {
            return false;
        };
        (0..4).all(|i| {
            let chunk: [u8; 8] = b[i * 8..i * 8 + 8].try_into().expect("8 bytes");
            let want = (h[i / 2] >> (32 * (1 - i % 2))) as u32;
            hex8(u64::from_le_bytes(chunk)) == Some(want)
        })
    }

    pub fn is_none(&self) -> bool {
        matches!(self, Rid::None)
    }

    /// Calls `f` with the rid's text (built on the stack for the inline form).
    fn with_str<R>(&self, f: impl FnOnce(&str) -> R) -> Option<R> {
        match self {
            Rid::None => None,
            Rid::Text(t) => Some(f(t)),
            Rid::Hex([hi, lo]) => {
                const DIGITS: &[u8; 16] = b"0123456789abcdef";
                let mut buf = [0u8; 32];
                for (i, v) in [hi, lo].into_iter().enumerate() {
                    for j in 0..16 {
                        buf[i * 16 + j] = DIGITS[((v >> (60 - 4 * j)) & 0xf) as usize];
                    }
                }
                Some(f(std::str::from_utf8(&buf).expect("hex digits are ASCII")))
            }
        }
    }

    pub fn matches(&self, s: &str) -> bool {
        match self {
            Rid::None => false,
            Rid::Text(t) => **t == *s,
            Rid::Hex(h) => Self::hex_is(s, *h),
        }
    }

    pub fn to_string_opt(&self) -> Option<String> {
        self.with_str(str::to_owned)
    }

    pub(super) fn key(&self) -> Option<u64> {
        self.with_str(|s| key_str(AliasKind::Rid, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_rids_parse_like_the_plain_definition() {
        let plain = |s: &[u8]| -> Option<[u64; 2]> {
            if s.len() != 32 || !s.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) {
                return None;
            }
            let s = std::str::from_utf8(s).ok()?;
            Some([
                u64::from_str_radix(&s[..16], 16).ok()?,
                u64::from_str_radix(&s[16..], 16).ok()?,
            ])
        };
        let base = *b"0123456789abcdeffedcba98765432100";
        // Every byte value at every position (invalid UTF-8 skipped: rids are `&str`).
        for pos in 0..32 {
            for byte in 0..=255u8 {
                let mut b = base;
                b[pos] = byte;
                let b = &b[..32];
                if let Ok(s) = std::str::from_utf8(b) {
                    assert_eq!(Rid::hex(s), plain(b), "{s:?}");
                }
            }
        }
        let mut rng = 7u64;
        for _ in 0..10_000 {
            let mut b = [0u8; 32];
            for c in b.iter_mut() {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                *c = b"0123456789abcdef"[(rng % 16) as usize];
            }
            let s = std::str::from_utf8(&b).unwrap();
            assert_eq!(Rid::hex(s), plain(&b), "{s}");
        }
        assert_eq!(Rid::hex("0123"), None);
    }

    #[test]
    fn hex_is_agrees_with_parsing() {
        let h = Rid::hex("0123456789abcdeffedcba9876543210").unwrap();
        let base = *b"0123456789abcdeffedcba9876543210";
        assert!(Rid::hex_is(std::str::from_utf8(&base).unwrap(), h));
        // One digit changed (or made invalid) at every position, and other lengths.
        for pos in 0..32 {
            for byte in [b'0', b'f', b'A', b'g', b' '] {
                let mut b = base;
                b[pos] = byte;
                let s = std::str::from_utf8(&b).unwrap();
                assert_eq!(Rid::hex_is(s, h), Rid::hex(s) == Some(h), "{s}");
            }
        }
        for s in ["", "0123", "0123456789abcdeffedcba98765432100"] {
            assert!(!Rid::hex_is(s, h));
        }
    }

    #[test]
    fn rids_keep_their_text() {
        for s in [
            "8f3c2b1a9d7e4f60a1b2c3d4e5f60718",
            "0000000000000000000000000000000a",
        ] {
            let r = Rid::new(s);
            assert!(matches!(r, Rid::Hex(_)), "{s}");
            assert_eq!(r.to_string_opt().as_deref(), Some(s));
            assert!(r.matches(s));
            assert!(!r.matches("8F3C2B1A9D7E4F60A1B2C3D4E5F60718"));
        }
        for s in [
            "rid-1",
            "8F3C2B1A9D7E4F60A1B2C3D4E5F60718",
            "cmpl-8f3c2b1a9d7e4f60a1b2c3d4e5f6",
        ] {
            let r = Rid::new(s);
            assert!(matches!(r, Rid::Text(_)), "{s}");
            assert_eq!(r.to_string_opt().as_deref(), Some(s));
            assert!(r.matches(s) && !r.matches("other"));
        }
        assert_eq!(Rid::None.to_string_opt(), None);
    }
}
