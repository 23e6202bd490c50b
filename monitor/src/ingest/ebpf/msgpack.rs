//! Just enough MessagePack to read the keys of vLLM's KV-connector messages (msgspec encodes
//! them): maps, arrays, strings, binaries and integers, walked without building a tree. Floats,
//! extensions and everything nested past [`MAX_DEPTH`] are skipped or refused, never trusted.
//! Values are borrowed from the message; only the few ids a caller keeps are copied.

/// Deepest nesting walked (vLLM's structures nest four deep: a map of tuples of lists of lists).
const MAX_DEPTH: u32 = 8;

/// One decoded value, its containers unread.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    Nil,
    Bool(bool),
    Int(i128),
    /// A float: its value is never needed.
    Float,
    Str(&'a [u8]),
    Bin(&'a [u8]),
    /// An array of this many items, which follow.
    Array(u32),
    /// A map of this many key/value pairs, which follow.
    Map(u32),
    /// An extension type: its bytes are skipped.
    Ext,
}

/// A cursor over a message's bytes. Every read either advances past a whole value or returns
/// `None` (the message ended or is not MessagePack) and leaves the reader unusable.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, at: 0 }
    }

    /// Every byte was read.
    pub fn at_end(&self) -> bool {
        self.at == self.buf.len()
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.buf.get(self.at..end)?;
        self.at = end;
        Some(s)
    }

    fn uint(&mut self, n: usize) -> Option<u64> {
        Some(
            self.take(n)?
                .iter()
                .fold(0u64, |v, &b| (v << 8) | u64::from(b)),
        )
    }

    fn sized(&mut self, n: usize) -> Option<usize> {
        usize::try_from(self.uint(n)?).ok()
    }

    /// The next value's head (a container's items are not read).
    pub fn value(&mut self) -> Option<Value<'a>> {
        let b = *self.buf.get(self.at)?;
        self.at += 1;
        Some(match b {
            0x00..=0x7f => Value::Int(i128::from(b)),
            0x80..=0x8f => Value::Map(u32::from(b & 0x0f)),
            0x90..=0x9f => Value::Array(u32::from(b & 0x0f)),
            0xa0..=0xbf => Value::Str(self.take(usize::from(b & 0x1f))?),
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4 => {
                let n = self.sized(1)?;
                Value::Bin(self.take(n)?)
            }
            0xc5 => {
                let n = self.sized(2)?;
                Value::Bin(self.take(n)?)
            }
            0xc6 => {
                let n = self.sized(4)?;
                Value::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = self.sized(1 << (b - 0xc7))?;
                self.take(n.checked_add(1)?)?;
                Value::Ext
            }
            0xca => {
                self.take(4)?;
                Value::Float
            }
            0xcb => {
                self.take(8)?;
                Value::Float
            }
            0xcc..=0xcf => Value::Int(i128::from(self.uint(1 << (b - 0xcc))?)),
            0xd0..=0xd3 => {
                let n = 1usize << (b - 0xd0);
                let raw = self.uint(n)?;
                let shift = 64 - 8 * n as u32;
                Value::Int(i128::from(((raw << shift) as i64) >> shift))
            }
            0xd4..=0xd8 => {
                self.take((1usize << (b - 0xd4)) + 1)?;
                Value::Ext
            }
            0xd9 => {
                let n = self.sized(1)?;
                Value::Str(self.take(n)?)
            }
            0xda => {
                let n = self.sized(2)?;
                Value::Str(self.take(n)?)
            }
            0xdb => {
                let n = self.sized(4)?;
                Value::Str(self.take(n)?)
            }
            0xdc => Value::Array(u32::try_from(self.uint(2)?).ok()?),
            0xdd => Value::Array(u32::try_from(self.uint(4)?).ok()?),
            0xde => Value::Map(u32::try_from(self.uint(2)?).ok()?),
            0xdf => Value::Map(u32::try_from(self.uint(4)?).ok()?),
            0xe0..=0xff => Value::Int(i128::from(b as i8)),
            // 0xc1 is never used.
            _ => return None,
        })
    }

    /// Skips the rest of a value whose head `v` was just read.
    pub fn skip_rest(&mut self, v: Value<'a>) -> Option<()> {
        self.skip_items(v, 0)
    }

    /// Reads and skips one whole value.
    pub fn skip(&mut self) -> Option<()> {
        let v = self.value()?;
        self.skip_rest(v)
    }

    fn skip_items(&mut self, v: Value<'a>, depth: u32) -> Option<()> {
        let items = match v {
            Value::Array(n) => u64::from(n),
            Value::Map(n) => 2 * u64::from(n),
            _ => return Some(()),
        };
        if depth >= MAX_DEPTH {
            return None;
        }
        for _ in 0..items {
            let v = self.value()?;
            self.skip_items(v, depth + 1)?;
        }
        Some(())
    }

    /// Reads a string (or binary) value.
    pub fn bytes(&mut self) -> Option<&'a [u8]> {
        match self.value()? {
            Value::Str(s) | Value::Bin(s) => Some(s),
            _ => None,
        }
    }

    /// Reads an integer value.
    pub fn int(&mut self) -> Option<i128> {
        match self.value()? {
            Value::Int(i) => Some(i),
            _ => None,
        }
    }

    /// Reads a map head; then `count` key/value pairs follow.
    pub fn map(&mut self) -> Option<u32> {
        match self.value()? {
            Value::Map(n) => Some(n),
            _ => None,
        }
    }

    /// Reads an array head; then `count` items follow.
    pub fn array(&mut self) -> Option<u32> {
        match self.value()? {
            Value::Array(n) => Some(n),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_each_kind_and_skips_containers() {
        // {"a": [1, -1, 300, -200, "x"], "b": {"c": 1.5}, "d": b"\x00\x01", "e": nil, "f": true}
        let msg: &[u8] = &[
            0x85, 0xa1, b'a', 0x95, 0x01, 0xff, 0xcd, 0x01, 0x2c, 0xd1, 0xff, 0x38, 0xa1, b'x',
            0xa1, b'b', 0x81, 0xa1, b'c', 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0xa1, b'd', 0xc4,
            0x02, 0x00, 0x01, 0xa1, b'e', 0xc0, 0xa1, b'f', 0xc3,
        ];
        let mut r = Reader::new(msg);
        assert_eq!(r.map(), Some(5));
        assert_eq!(r.bytes(), Some(&b"a"[..]));
        assert_eq!(r.array(), Some(5));
        assert_eq!(r.int(), Some(1));
        assert_eq!(r.int(), Some(-1));
        assert_eq!(r.int(), Some(300));
        assert_eq!(r.int(), Some(-200));
        assert_eq!(r.bytes(), Some(&b"x"[..]));
        assert_eq!(r.bytes(), Some(&b"b"[..]));
        r.skip().unwrap();
        assert_eq!(r.bytes(), Some(&b"d"[..]));
        assert_eq!(r.bytes(), Some(&[0u8, 1][..]));
        assert_eq!(r.bytes(), Some(&b"e"[..]));
        assert_eq!(r.value(), Some(Value::Nil));
        assert_eq!(r.bytes(), Some(&b"f"[..]));
        assert_eq!(r.value(), Some(Value::Bool(true)));
        assert!(r.at_end());
    }

    #[test]
    fn truncated_reserved_and_deep_input_is_refused() {
        assert_eq!(Reader::new(&[0xa5, b'a']).value(), None);
        assert_eq!(Reader::new(&[0xc1]).value(), None);
        assert_eq!(Reader::new(&[0xdb, 0xff, 0xff, 0xff, 0xff]).value(), None);
        let deep = [0x91u8; 64];
        assert_eq!(Reader::new(&deep).skip(), None);
        // A huge declared count with no items ends, it does not loop.
        assert_eq!(Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).skip(), None);
    }
}
