//! MessagePack as `msgspec.msgpack` writes it: the vLLM flavour's side channels (NIXL's
//! handshake, Mooncake's transfer metadata and status) carry msgspec-encoded values, and
//! revenant reads those bytes off the socket, so pd-sim writes the same bytes msgspec does:
//! the smallest integer form (unsigned forms for non-negative values), `float64` for every
//! float, `str8` from 32 bytes, `bin` for Python `bytes`, maps in field order.

use bytes::BufMut;

/// A decoded (or to-be-encoded) value. Maps keep their order (a dataclass or Struct encodes
/// its fields in declaration order).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
}

impl Value {
    pub fn str(s: impl Into<String>) -> Value {
        Value::Str(s.into())
    }

    /// A map with string keys, in the given order.
    pub fn map<const N: usize>(fields: [(&str, Value); N]) -> Value {
        Value::Map(
            fields
                .into_iter()
                .map(|(k, v)| (Value::str(k), v))
                .collect(),
        )
    }

    pub fn ints(v: impl IntoIterator<Item = i64>) -> Value {
        Value::Array(v.into_iter().map(Value::Int).collect())
    }

    /// A field of a map with string keys.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(m) => m
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A `str` or `bytes` field as bytes (msgspec writes Python `bytes` as `bin`).
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Value::Str(s) => Some(s.as_bytes()),
            Value::Bin(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        self.write(&mut out);
        out
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        match self {
            Value::Nil => out.put_u8(0xc0),
            Value::Bool(b) => out.put_u8(if *b { 0xc3 } else { 0xc2 }),
            Value::Int(i) => write_int(out, *i),
            Value::Float(f) => {
                out.put_u8(0xcb);
                out.put_f64(*f);
            }
            Value::Str(s) => {
                let n = s.len();
                match n {
                    0..=31 => out.put_u8(0xa0 | n as u8),
                    32..=0xff => {
                        out.put_u8(0xd9);
                        out.put_u8(n as u8);
                    }
                    0x100..=0xffff => {
                        out.put_u8(0xda);
                        out.put_u16(n as u16);
                    }
                    _ => {
                        out.put_u8(0xdb);
                        out.put_u32(n as u32);
                    }
                }
                out.put_slice(s.as_bytes());
            }
            Value::Bin(b) => {
                let n = b.len();
                match n {
                    0..=0xff => {
                        out.put_u8(0xc4);
                        out.put_u8(n as u8);
                    }
                    0x100..=0xffff => {
                        out.put_u8(0xc5);
                        out.put_u16(n as u16);
                    }
                    _ => {
                        out.put_u8(0xc6);
                        out.put_u32(n as u32);
                    }
                }
                out.put_slice(b);
            }
            Value::Array(a) => {
                write_len(out, a.len(), 0x90, 0xdc);
                for v in a {
                    v.write(out);
                }
            }
            Value::Map(m) => {
                write_len(out, m.len(), 0x80, 0xde);
                for (k, v) in m {
                    k.write(out);
                    v.write(out);
                }
            }
        }
    }
}

fn write_len(out: &mut Vec<u8>, n: usize, fix: u8, sixteen: u8) {
    match n {
        0..=15 => out.put_u8(fix | n as u8),
        16..=0xffff => {
            out.put_u8(sixteen);
            out.put_u16(n as u16);
        }
        _ => {
            out.put_u8(sixteen + 1);
            out.put_u32(n as u32);
        }
    }
}

fn write_int(out: &mut Vec<u8>, i: i64) {
    if i >= 0 {
        let u = i as u64;
        match u {
            0..=0x7f => out.put_u8(u as u8),
            0x80..=0xff => {
                out.put_u8(0xcc);
                out.put_u8(u as u8);
            }
            0x100..=0xffff => {
                out.put_u8(0xcd);
                out.put_u16(u as u16);
            }
            0x1_0000..=0xffff_ffff => {
                out.put_u8(0xce);
                out.put_u32(u as u32);
            }
            _ => {
                out.put_u8(0xcf);
                out.put_u64(u);
            }
        }
    } else {
        match i {
            -32..=-1 => out.put_u8(i as i8 as u8),
            -0x80..=-33 => {
                out.put_u8(0xd0);
                out.put_i8(i as i8);
            }
            -0x8000..=-0x81 => {
                out.put_u8(0xd1);
                out.put_i16(i as i16);
            }
            -0x8000_0000..=-0x8001 => {
                out.put_u8(0xd2);
                out.put_i32(i as i32);
            }
            _ => {
                out.put_u8(0xd3);
                out.put_i64(i);
            }
        }
    }
}

/// Why bytes are not one MessagePack value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("msgpack ends early")]
    Truncated,
    #[error("msgpack type byte {0:#04x} is not supported")]
    Unsupported(u8),
    #[error("msgpack string is not UTF-8")]
    Utf8,
    #[error("{0} bytes after the msgpack value")]
    Trailing(usize),
    #[error("msgpack nests deeper than {MAX_DEPTH}")]
    TooDeep,
}

const MAX_DEPTH: usize = 32;

/// Decode exactly one value (trailing bytes are an error, as for msgspec).
pub fn decode(b: &[u8]) -> Result<Value, DecodeError> {
    let mut r = Reader { b, pos: 0 };
    let v = r.value(0)?;
    match b.len() - r.pos {
        0 => Ok(v),
        n => Err(DecodeError::Trailing(n)),
    }
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::Truncated)?;
        let s = self.b.get(self.pos..end).ok_or(DecodeError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    fn uint(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
    }

    fn sint(&mut self, n: usize) -> Result<i64, DecodeError> {
        let u = self.uint(n)?;
        let shift = 64 - 8 * n as u32;
        Ok(((u << shift) as i64) >> shift)
    }

    fn value(&mut self, depth: usize) -> Result<Value, DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep);
        }
        let t = self.take(1)?[0];
        Ok(match t {
            0x00..=0x7f => Value::Int(i64::from(t)),
            0x80..=0x8f => self.map(usize::from(t & 0x0f), depth)?,
            0x90..=0x9f => self.array(usize::from(t & 0x0f), depth)?,
            0xa0..=0xbf => self.string(usize::from(t & 0x1f))?,
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.uint(1 << (t - 0xc4))? as usize;
                Value::Bin(self.take(n)?.to_vec())
            }
            0xca => Value::Float(f64::from(f32::from_bits(self.uint(4)? as u32))),
            0xcb => Value::Float(f64::from_bits(self.uint(8)?)),
            0xcc..=0xcf => {
                let u = self.uint(1 << (t - 0xcc))?;
                Value::Int(i64::try_from(u).map_err(|_| DecodeError::Unsupported(t))?)
            }
            0xd0..=0xd3 => Value::Int(self.sint(1 << (t - 0xd0))?),
            0xd9..=0xdb => {
                let n = self.uint(1 << (t - 0xd9))? as usize;
                self.string(n)?
            }
            0xdc | 0xdd => {
                let n = self.uint(2 << (t - 0xdc))? as usize;
                self.array(n, depth)?
            }
            0xde | 0xdf => {
                let n = self.uint(2 << (t - 0xde))? as usize;
                self.map(n, depth)?
            }
            0xe0..=0xff => Value::Int(i64::from(t as i8)),
            _ => return Err(DecodeError::Unsupported(t)),
        })
    }

    fn string(&mut self, n: usize) -> Result<Value, DecodeError> {
        let s = std::str::from_utf8(self.take(n)?).map_err(|_| DecodeError::Utf8)?;
        Ok(Value::Str(s.to_owned()))
    }

    fn array(&mut self, n: usize, depth: usize) -> Result<Value, DecodeError> {
        // Each element takes at least one byte: a length beyond what is left is a lie.
        if n > self.b.len() - self.pos {
            return Err(DecodeError::Truncated);
        }
        (0..n)
            .map(|_| self.value(depth + 1))
            .collect::<Result<_, _>>()
            .map(Value::Array)
    }

    fn map(&mut self, n: usize, depth: usize) -> Result<Value, DecodeError> {
        if n > (self.b.len() - self.pos) / 2 {
            return Err(DecodeError::Truncated);
        }
        (0..n)
            .map(|_| Ok((self.value(depth + 1)?, self.value(depth + 1)?)))
            .collect::<Result<_, _>>()
            .map(Value::Map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn encodes_as_msgspec_does() {
        // msgspec.msgpack.encode((b"get_meta_msg", 0, 0))
        let v = Value::Array(vec![
            Value::Bin(b"get_meta_msg".to_vec()),
            Value::Int(0),
            Value::Int(0),
        ]);
        assert_eq!(hex(&v.encode()), "93c40c6765745f6d6574615f6d73670000");
        // msgspec.msgpack.encode([200, 70000, -5, -200, 1.5, "a"*40, None, {"k": []}])
        let v = Value::Array(vec![
            Value::Int(200),
            Value::Int(70000),
            Value::Int(-5),
            Value::Int(-200),
            Value::Float(1.5),
            Value::str("a".repeat(40)),
            Value::Nil,
            Value::map([("k", Value::Array(vec![]))]),
        ]);
        assert_eq!(
            hex(&v.encode()),
            format!(
                "98ccc8ce00011170fbd1ff38cb3ff8000000000000d928{}c081a16b90",
                "61".repeat(40)
            )
        );
    }

    #[test]
    fn decodes_what_it_encodes_and_refuses_garbage() {
        let v = Value::map([
            ("a", Value::ints([0, -1, 300, -40_000, 1 << 40, i64::MIN])),
            ("b", Value::Bin(vec![7; 300])),
            ("c", Value::Float(-2.25)),
            ("d", Value::Bool(true)),
            ("e", Value::str("x".repeat(70_000))),
        ]);
        assert_eq!(decode(&v.encode()).unwrap(), v);
        assert_eq!(decode(&[0x92, 0x01]), Err(DecodeError::Truncated));
        assert_eq!(decode(&[0x01, 0x02]), Err(DecodeError::Trailing(1)));
        assert_eq!(decode(&[0xc1]), Err(DecodeError::Unsupported(0xc1)));
        assert_eq!(
            decode(&[0xdd, 0xff, 0xff, 0xff, 0xff]),
            Err(DecodeError::Truncated)
        );
        assert_eq!(decode(&[0x91; 64]), Err(DecodeError::TooDeep));
    }
}
