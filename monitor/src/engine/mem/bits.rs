//! Bit tricks: SWAR parsing of hex digits and a software `pext`/`pdep`.

/// Eight lowercase hex digits (little-endian bytes of `x`, the first digit in the low byte) as
/// a number, eight bytes at a time: every event naming a rid has it parsed to be compared with its
/// attempt's, so this runs on nearly half of all events.
#[inline]
pub fn hex8(x: u64) -> Option<u32> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    if x & HIGH != 0 {
        return None;
    }
    // Bytes are below 0x80 now, so adding at most 0x50 to each never carries into the next:
    // the high bit of each sum tells whether the byte reached the bound.
    let at_least = |lo: u8| (x + (0x80 - lo as u64) * ONES) & HIGH;
    let digit = at_least(b'0') & !at_least(b'9' + 1);
    let letter = at_least(b'a') & !at_least(b'f' + 1);
    if digit | letter != HIGH {
        return None;
    }
    // Nibble per byte: the low four bits, plus 9 for a-f.
    let nibbles = (x & 0x0f0f_0f0f_0f0f_0f0f) + (letter >> 7) * 9;
    // Pairs of digits into bytes (the first digit is the high nibble), then four bytes in order.
    let pairs = ((nibbles & 0x000f_000f_000f_000f) << 4) | ((nibbles >> 8) & 0x000f_000f_000f_000f);
    let byte = |i: u32| ((pairs >> (16 * i)) & 0xff) as u32;
    Some(byte(0) << 24 | byte(1) << 16 | byte(2) << 8 | byte(3))
}

/// The bits of `mask` picked out of `bits`, packed towards bit 0 (a software `pext`).
pub fn compress_bits(mask: u64, bits: u64) -> u32 {
    let (mut m, mut out, mut j) = (mask, 0u32, 0);
    while m != 0 && j < 32 {
        let low = m & m.wrapping_neg();
        if bits & low != 0 {
            out |= 1 << j;
        }
        m &= m - 1;
        j += 1;
    }
    out
}

/// The inverse of [`compress_bits`] (a software `pdep`).
pub fn expand_bits(mask: u64, packed: u32) -> u64 {
    let (mut m, mut out, mut j) = (mask, 0u64, 0);
    while m != 0 && j < 32 {
        let low = m & m.wrapping_neg();
        if packed & (1 << j) != 0 {
            out |= low;
        }
        m &= m - 1;
        j += 1;
    }
    out
}
