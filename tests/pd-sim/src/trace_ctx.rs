//! W3C trace context (`traceparent`) and the random trace and span ids of the simulator's
//! spans.

use rand::RngExt;

/// W3C trace context: `00-<trace id>-<parent span id>-<flags>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
}

impl TraceParent {
    pub fn parse(s: &str) -> Option<Self> {
        let mut it = s.trim().split('-');
        let version = it.next()?;
        let trace = it.next()?;
        let span = it.next()?;
        let _flags = it.next()?;
        if version.len() != 2 || trace.len() != 32 || span.len() != 16 {
            return None;
        }
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        hex_decode(trace, &mut trace_id)?;
        hex_decode(span, &mut span_id)?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent { trace_id, span_id })
    }

    pub fn header_value(&self) -> String {
        format!("00-{}-{}-01", hex(&self.trace_id), hex(&self.span_id))
    }
}

pub fn hex(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push(DIGITS[(x >> 4) as usize] as char);
        s.push(DIGITS[(x & 0xf) as usize] as char);
    }
    s
}

fn hex_decode(s: &str, out: &mut [u8]) -> Option<()> {
    let b = s.as_bytes();
    for (i, o) in out.iter_mut().enumerate() {
        let hi = *b.get(2 * i)?;
        let lo = *b.get(2 * i + 1)?;
        *o = (nib(hi)? << 4) | nib(lo)?;
    }
    Some(())
}

fn nib(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

pub fn random_trace_id() -> [u8; 16] {
    loop {
        let v: [u8; 16] = rand::rng().random();
        if v != [0; 16] {
            return v;
        }
    }
}

pub fn random_span_id() -> [u8; 8] {
    loop {
        let v: [u8; 8] = rand::rng().random();
        if v != [0; 8] {
            return v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trip_and_rejects_garbage() {
        let tp = TraceParent {
            trace_id: random_trace_id(),
            span_id: random_span_id(),
        };
        assert_eq!(TraceParent::parse(&tp.header_value()), Some(tp));
        assert_eq!(TraceParent::parse("00-zz-11-01"), None);
        assert_eq!(
            TraceParent::parse("00-00000000000000000000000000000000-0000000000000001-01"),
            None
        );
        assert_eq!(TraceParent::parse(""), None);
    }

    #[test]
    fn hex_is_lowercase_and_padded() {
        assert_eq!(hex(&[0x00, 0x0f, 0xab, 0xff]), "000fabff");
    }
}
