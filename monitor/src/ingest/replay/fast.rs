//! A decoder for the lines the replay format's writers produce, an order of magnitude cheaper than
//! serde's: the line's strings are borrowed, not copied, and fields are matched by name without
//! an intermediate record.
//!
//! It accepts a strict subset of what serde accepts and decodes it to the same fields: one JSON
//! object of known fields, each at most once; strings without escapes; integers without sign,
//! fraction, exponent or leading zero, in their field's range; enum names spelled exactly. Anything
//! else (an escape, `null`, a number it is unsure of, an unknown field, a syntax error) makes it
//! give up, and the caller decodes the line with serde, whose messages say what is wrong where.
//! `replay`'s tests and its fuzz target hold the two to the same results.

use crate::event::{
    BootstrapRoom, Ids, Kind, Peer, ProtocolBreach, RoomHex, Source, Stage, room_from_fields,
};

/// One line's fields as written, strings borrowed from the line. The meaning (which time, `to`
/// only on some kinds, truncated reasons) is the caller's, the same for both decoders.
#[derive(Debug, PartialEq, Eq)]
pub struct Fields<'a> {
    pub time: Option<&'a str>,
    pub time_unix_nano: Option<u64>,
    pub stage: Stage,
    pub kind: Kind,
    pub ids: Ids,
    pub node: Option<&'a str>,
    pub pid: Option<u32>,
    pub source: Option<Source>,
    pub status: Option<u16>,
    pub reason: Option<&'a str>,
    pub detail: Option<&'a str>,
    pub to: Option<Stage>,
    pub peer: Option<Peer>,
    pub protocol_breach: Option<ProtocolBreach>,
    pub input_tokens: Option<u64>,
    pub context_tokens: Option<u64>,
    pub max_input_tokens: Option<u64>,
    pub max_total_tokens: Option<u64>,
    pub worker: Option<&'a str>,
}

/// The fields of `line` (trimmed, not empty), or `None` when the line is not in the subset this
/// decoder reads: then serde decides.
pub fn decode(line: &str) -> Option<Fields<'_>> {
    let mut p = Parser { s: line, i: 0 };
    // `stage` and `kind` are required: placeholders until read, the seen bits say whether they were.
    let mut f = Fields {
        time: None,
        time_unix_nano: None,
        stage: Stage::Router,
        kind: Kind::Received,
        ids: Ids::default(),
        node: None,
        pid: None,
        source: None,
        status: None,
        reason: None,
        detail: None,
        to: None,
        peer: None,
        protocol_breach: None,
        input_tokens: None,
        context_tokens: None,
        max_input_tokens: None,
        max_total_tokens: None,
        worker: None,
    };
    let mut seen = 0u32;
    p.object(|p, key| {
        // Serde refuses a field given twice; a bit per field finds the second.
        let bit = match key {
            "time" => {
                f.time = Some(p.string()?);
                0
            }
            "time_unix_nano" => {
                f.time_unix_nano = Some(p.integer()?);
                1
            }
            "stage" => {
                f.stage = named(&Stage::ALL, Stage::as_str, p.string()?)?;
                2
            }
            "kind" => {
                f.kind = named(&Kind::ALL, Kind::as_str, p.string()?)?;
                3
            }
            "ids" => {
                f.ids = p.ids()?;
                4
            }
            "node" => {
                f.node = Some(p.string()?);
                5
            }
            "pid" => {
                f.pid = Some(u32::try_from(p.integer()?).ok()?);
                6
            }
            "source" => {
                f.source = Some(named(&Source::ALL, Source::as_str, p.string()?)?);
                7
            }
            "status" => {
                f.status = Some(u16::try_from(p.integer()?).ok()?);
                8
            }
            "reason" => {
                f.reason = Some(p.string()?);
                9
            }
            "detail" => {
                f.detail = Some(p.string()?);
                10
            }
            "to" => {
                f.to = Some(named(&Stage::ALL, Stage::as_str, p.string()?)?);
                11
            }
            "peer" => {
                f.peer = Some(named(&Peer::ALL, Peer::as_str, p.string()?)?);
                12
            }
            "protocol_breach" => {
                f.protocol_breach = Some(named(
                    &ProtocolBreach::ALL,
                    ProtocolBreach::as_str,
                    p.string()?,
                )?);
                13
            }
            "input_tokens" => {
                f.input_tokens = Some(p.integer()?);
                14
            }
            "context_tokens" => {
                f.context_tokens = Some(p.integer()?);
                15
            }
            "max_input_tokens" => {
                f.max_input_tokens = Some(p.integer()?);
                16
            }
            "max_total_tokens" => {
                f.max_total_tokens = Some(p.integer()?);
                17
            }
            "worker" => {
                f.worker = Some(p.string()?);
                18
            }
            _ => return None,
        };
        once(&mut seen, bit)
    })?;
    p.ws();
    // Serde refuses anything after the object but whitespace.
    const REQUIRED: u32 = 1 << 2 | 1 << 3;
    (p.i == line.len() && seen & REQUIRED == REQUIRED).then_some(f)
}

/// Marks field `bit` seen; `None` if it was already.
fn once(seen: &mut u32, bit: u32) -> Option<()> {
    let was = *seen & (1 << bit) != 0;
    *seen |= 1 << bit;
    (!was).then_some(())
}

struct Parser<'a> {
    s: &'a str,
    i: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.i).copied()
    }

    /// Skips JSON whitespace (serde's four characters, no others).
    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    fn expect(&mut self, c: u8) -> Option<()> {
        self.ws();
        (self.peek()? == c).then(|| self.i += 1)
    }

    /// An object: `field` reads the value of each key (the parser on the value's first byte).
    fn object(&mut self, mut field: impl FnMut(&mut Self, &'a str) -> Option<()>) -> Option<()> {
        self.expect(b'{')?;
        self.ws();
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        loop {
            let key = self.string()?;
            self.expect(b':')?;
            field(self, key)?;
            self.ws();
            match self.peek()? {
                b',' => self.i += 1,
                b'}' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A string without escapes or control characters, borrowed.
    fn string(&mut self) -> Option<&'a str> {
        self.ws();
        let bytes = self.s.as_bytes();
        if bytes.get(self.i) != Some(&b'"') {
            return None;
        }
        let start = self.i + 1;
        let end = start + plain_len(&bytes[start..]);
        // An escape is serde's to decode; a raw control character is an error it reports.
        if bytes.get(end) != Some(&b'"') {
            return None;
        }
        self.i = end + 1;
        // Both ends are ASCII quotes, so the slice falls on character boundaries.
        self.s.get(start..end)
    }

    /// A non-negative integer as serde reads it into a `u64`: digits, no leading zero, not
    /// followed by a fraction or an exponent (serde reads those as floats and refuses them).
    fn integer(&mut self) -> Option<u64> {
        self.ws();
        let bytes = &self.s.as_bytes()[self.i..];
        let digits = bytes.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits > 1 && bytes[0] == b'0' {
            return None;
        }
        let n = decimal(&bytes[..digits])?;
        self.i += digits;
        match self.peek() {
            Some(b'.' | b'e' | b'E') => None,
            _ => Some(n),
        }
    }

    /// `ids`: its known fields, each at most once; the room in either spelling, both agreeing.
    fn ids(&mut self) -> Option<Ids> {
        let mut ids = Ids::default();
        let (mut room, mut hex) = (None, None);
        let mut seen = 0u32;
        self.object(|p, key| {
            let bit = match key {
                "request_id" => {
                    ids.request_id = Some(p.string()?.into());
                    0
                }
                "trace_id" => {
                    ids.trace_id = Some(p.string()?.into());
                    1
                }
                "rid" => {
                    ids.rid = Some(p.string()?.into());
                    2
                }
                "bootstrap_room" => {
                    room = Some(BootstrapRoom(p.room()?));
                    3
                }
                "bootstrap_room_hex" => {
                    hex = Some(RoomHex(p.room()?));
                    4
                }
                _ => return None,
            };
            once(&mut seen, bit)
        })?;
        ids.bootstrap_room = room_from_fields(room, hex).ok()?.map(BootstrapRoom);
        Some(ids)
    }

    /// A room: a number, or a string in any spelling [`BootstrapRoom`] reads.
    fn room(&mut self) -> Option<u64> {
        self.ws();
        if self.peek()? != b'"' {
            return self.integer();
        }
        let s = self.string()?;
        // The spellings every writer uses, hex and decimal digits, folded directly; any other
        // through `FromStr`.
        let folded = match s.strip_prefix("0x") {
            Some(h) => hex(h.as_bytes()),
            None if s.bytes().all(|b| b.is_ascii_digit()) => decimal(s.as_bytes()),
            None => None,
        };
        folded.or_else(|| s.parse::<BootstrapRoom>().ok().map(|r| r.0))
    }
}

/// The value of 1 to 20 decimal digits (leading zeros allowed), `None` if it exceeds a `u64`.
fn decimal(digits: &[u8]) -> Option<u64> {
    // Up to 19 digits cannot overflow: checked arithmetic only for the last of 20.
    let (head, last) = match digits.len() {
        1..=19 => (digits, None),
        20 => (&digits[..19], Some(digits[19])),
        _ => return None,
    };
    let n = head.iter().fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
    match last {
        None => Some(n),
        Some(d) => n.checked_mul(10)?.checked_add(u64::from(d - b'0')),
    }
}

/// The value of 1 to 16 hex digits (either case), `None` for anything else.
fn hex(digits: &[u8]) -> Option<u64> {
    if !(1..=16).contains(&digits.len()) {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &b| {
        let d = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => return None,
        };
        Some(n << 4 | u64::from(d))
    })
}

/// How many bytes at the start of `bytes` may stand in a string as they are: up to the first
/// quote, backslash or control character. Eight bytes at a time: most strings are short ids and
/// numbers, and a byte loop was the decoder's largest cost.
fn plain_len(bytes: &[u8]) -> usize {
    const ONES: u64 = u64::from_le_bytes([1; 8]);
    const HIGH: u64 = ONES << 7;
    let mut i = 0;
    while let Some(word) = bytes.get(i..i + 8) {
        let w = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        let quote = w ^ (ONES * u64::from(b'"'));
        let backslash = w ^ (ONES * u64::from(b'\\'));
        // The high bit of each byte below 0x20 or equal to either (the classic "has zero byte"
        // tests): borrows can only mark bytes after a marked one, so the first mark is exact.
        let stop = (w.wrapping_sub(ONES * 0x20) & !w
            | quote.wrapping_sub(ONES) & !quote
            | backslash.wrapping_sub(ONES) & !backslash)
            & HIGH;
        if stop != 0 {
            return i + (stop.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    i + bytes[i..]
        .iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
        .unwrap_or(bytes.len() - i)
}

/// The value named `s` among `all`, spelled exactly as serde writes it (its `as_str`).
fn named<T: Copy>(all: &[T], as_str: fn(T) -> &'static str, s: &str) -> Option<T> {
    all.iter().copied().find(|&v| as_str(v) == s)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn plain_len_stops_where_a_byte_loop_does(
            bytes in prop::collection::vec(
                prop_oneof![4 => 0x20u8..0x7f, 1 => any::<u8>(), 1 => Just(b'"'), 1 => Just(b'\\')],
                0..40,
            )
        ) {
            let byte_loop = bytes
                .iter()
                .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
                .unwrap_or(bytes.len());
            prop_assert_eq!(super::plain_len(&bytes), byte_loop);
        }
    }
}
