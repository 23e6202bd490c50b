//! Reading OTLP attributes without copying: lookups by key and lenient scalar conversions.
//!
//! Real exporters disagree on types (smg sends `status_code` as a string, SGLang sends
//! `bootstrap_room` as a hex string, Python sends ints as ints), so every numeric read accepts
//! the spellings seen in the wild.

use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value::Value};

use crate::event::BootstrapRoom;

pub fn get<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

pub fn has(attrs: &[KeyValue], key: &str) -> bool {
    get(attrs, key).is_some()
}

/// The attribute as text when it is a string; never converts other types, so a caller cannot
/// accidentally render a large array as a "reason".
pub fn str<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a str> {
    match get(attrs, key)? {
        Value::StringValue(s) => Some(s.as_str()),
        _ => None,
    }
}

/// Non-negative integer from an int, a whole double, a decimal string or a 0x-hex string.
pub fn u64(attrs: &[KeyValue], key: &str) -> Option<u64> {
    value_u64(get(attrs, key)?)
}

pub fn value_u64(v: &Value) -> Option<u64> {
    match v {
        Value::IntValue(i) => u64::try_from(*i).ok(),
        Value::DoubleValue(d) if d.is_finite() && *d >= 0.0 && d.fract() == 0.0 && *d < 1.8e19 => {
            Some(*d as u64)
        }
        Value::StringValue(s) => {
            let t = s.trim();
            match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => t.parse().ok(),
            }
        }
        _ => None,
    }
}

/// First key of `keys` that holds a non-negative integer.
pub fn first_u64(attrs: &[KeyValue], keys: &[&str]) -> Option<u64> {
    keys.iter().find_map(|k| u64(attrs, k))
}

pub fn room(attrs: &[KeyValue], key: &str) -> Option<BootstrapRoom> {
    match get(attrs, key)? {
        Value::StringValue(s) => s.parse().ok(),
        v => value_u64(v).map(BootstrapRoom),
    }
}

/// Text or integer attribute rendered as an id string (request ids are sometimes numeric).
pub fn id(attrs: &[KeyValue], key: &str) -> Option<Box<str>> {
    match get(attrs, key)? {
        Value::StringValue(s) if !s.is_empty() => Some(clip_id(s).into()),
        Value::IntValue(i) => Some(i.to_string().into()),
        _ => None,
    }
}

/// Ids come from the network: cap their length so one span cannot blow up the alias tables.
pub const MAX_ID_BYTES: usize = 128;

pub fn clip_id(s: &str) -> &str {
    if s.len() <= MAX_ID_BYTES {
        return s;
    }
    let mut end = MAX_ID_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Lowercase hex of a trace id; `None` for the invalid all-zero or wrongly sized id.
pub fn trace_id_hex(bytes: &[u8]) -> Option<Box<str>> {
    if bytes.len() != 16 || bytes.iter().all(|b| *b == 0) {
        return None;
    }
    Some(hex(bytes).into())
}

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// A span id as an integer key (8 bytes, big-endian); `None` when absent or malformed.
pub fn span_key(bytes: &[u8]) -> Option<u64> {
    let arr: [u8; 8] = bytes.try_into().ok()?;
    let v = u64::from_be_bytes(arr);
    (v != 0).then_some(v)
}

pub fn trace_key(bytes: &[u8]) -> u128 {
    match <[u8; 16]>::try_from(bytes) {
        Ok(arr) => u128::from_be_bytes(arr),
        Err(_) => 0,
    }
}

#[cfg(test)]
pub(crate) fn kv(key: &str, v: Value) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(v) }),
        key_strindex: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_in_their_many_spellings() {
        let a = vec![
            kv("s", Value::StringValue("400".into())),
            kv("h", Value::StringValue("0x10".into())),
            kv("i", Value::IntValue(7)),
            kv("neg", Value::IntValue(-7)),
            kv("d", Value::DoubleValue(3.0)),
            kv("frac", Value::DoubleValue(3.5)),
            kv("junk", Value::StringValue("four".into())),
        ];
        assert_eq!(u64(&a, "s"), Some(400));
        assert_eq!(u64(&a, "h"), Some(16));
        assert_eq!(u64(&a, "i"), Some(7));
        assert_eq!(u64(&a, "neg"), None);
        assert_eq!(u64(&a, "d"), Some(3));
        assert_eq!(u64(&a, "frac"), None);
        assert_eq!(u64(&a, "junk"), None);
        assert_eq!(u64(&a, "missing"), None);
        assert_eq!(first_u64(&a, &["missing", "junk", "i"]), Some(7));
    }

    #[test]
    fn ids() {
        assert_eq!(trace_id_hex(&[0; 16]), None);
        assert_eq!(trace_id_hex(&[1; 3]), None);
        assert_eq!(
            trace_id_hex(&[0xab; 16]).as_deref(),
            Some("abababababababababababababababab")
        );
        assert_eq!(span_key(&[0; 8]), None);
        assert_eq!(span_key(&[0, 0, 0, 0, 0, 0, 0, 1]), Some(1));
        let long = "x".repeat(1000);
        assert_eq!(clip_id(&long).len(), MAX_ID_BYTES);
    }
}
