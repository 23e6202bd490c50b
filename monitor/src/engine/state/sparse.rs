//! Sparse packed rows, for tombstones: they are written once and rarely change, and most of
//! their kept slots are empty (a rejection's trigger pair, a second node), so only the set ones
//! are stored. A row is a header word, the base (a multiple of 2^23 ns) with a bit per slot in
//! its low [`SPARSE_MAX`] bits, then one packed word per set slot in order. Rows of more slots
//! than that are stored whole, after a plain base word.

use super::Slot;
use super::packed::{Unpackable, WIDE, base_for, pack, unpack};

pub const SPARSE_MAX: usize = 23;
const MASK: u64 = (1 << SPARSE_MAX) - 1;

/// Words in the row whose header is `header` (not [`WIDE`]), for rows of `n` slots.
pub fn len(header: u64, n: usize) -> usize {
    debug_assert_ne!(header, WIDE);
    if n > SPARSE_MAX {
        1 + n
    } else {
        1 + (header & MASK).count_ones() as usize
    }
}

/// Encodes `slots` into `out`; returns the number of words used.
pub fn encode(slots: &[Slot], out: &mut [u64]) -> Result<usize, Unpackable> {
    let whole = slots.len() > SPARSE_MAX;
    let base = base_for(slots, if whole { 0 } else { SPARSE_MAX as u32 })?.unwrap_or(0);
    let mut n = 1;
    let mut bits = 0u64;
    for (k, s) in slots.iter().enumerate() {
        if whole || s.is_set() {
            out[n] = pack(*s, base).ok_or(Unpackable)?;
            n += 1;
            bits |= 1 << k;
        }
    }
    out[0] = if whole { base } else { base | bits };
    Ok(n)
}

/// The `n` slots of the row `words` (not [`WIDE`]).
pub fn decode(words: &[u64], n: usize) -> Vec<Slot> {
    let header = words[0];
    if n > SPARSE_MAX {
        return (0..n).map(|k| unpack(words[1 + k], header)).collect();
    }
    let base = header & !MASK;
    let mut next = 1;
    (0..n)
        .map(|k| {
            if header & (1 << k) == 0 {
                return Slot::EMPTY;
            }
            next += 1;
            unpack(words[next - 1], base)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::state::SlotLayout;
    use crate::event::{Kind, LifecycleEvent, Source, Stage};

    #[test]
    fn sparse_rows_keep_only_set_slots() {
        const S: u64 = 1_000_000_000;
        let t0 = 1_795_986_920 * S + 123_456_789;
        let at = |t: u64, status| {
            let mut e = LifecycleEvent::new(t, Stage::Decode, Kind::Work, Source::Otlp);
            e.status = status;
            Slot::from_event(&e, 2)
        };
        let mut out = [0u64; 1 + SlotLayout::MAX];
        let slots = [
            Slot::EMPTY,
            at(t0, Some(400)),
            Slot::EMPTY,
            at(t0 - 30 * S, None),
        ];
        let n = encode(&slots, &mut out).unwrap();
        assert_eq!(n, 3, "header and the two set slots");
        assert_eq!(len(out[0], 4), 3);
        assert_eq!(decode(&out[..n], 4), slots.to_vec());
        let none = [Slot::EMPTY; 4];
        let n = encode(&none, &mut out).unwrap();
        assert_eq!((n, len(out[0], 4)), (1, 1));
        assert_eq!(decode(&out[..n], 4), none.to_vec());
        // More slots than the header has bits: stored whole.
        let mut many = vec![Slot::EMPTY; 30];
        many[29] = at(t0, None);
        let n = encode(&many, &mut out).unwrap();
        assert_eq!((n, len(out[0], 30)), (31, 31));
        assert_eq!(decode(&out[..n], 30), many);
        // Spans past the window do not encode.
        let far = [at(t0, None), at(t0 + 600 * S, None)];
        assert_eq!(encode(&far, &mut out), Err(Unpackable));
    }
}
