//! Identity correlation: which (request, attempt) does an event belong to?
//!
//! `request_id` (x-request-id) and `trace_id` name a client request; `bootstrap_room` and `rid`
//! name one attempt of it. Aliases are merged incrementally: an attempt holds at most one room (the
//! router mints a new room per retry, so two rooms are two attempts, never one), while requests
//! merge freely (union-find). Memory is bounded: live attempts are compacted into tombstones once
//! ended or idle past a TTL, tombstones expire after a retention window, and hard caps evict with
//! a counter. This module is sans-IO; the checker owns the per-attempt rule slots stored here.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;

use foldhash::fast::FixedState;

use crate::checker::slots::{Keep, Slot, SlotLayout, Slots, fold_into, packed, sparse};
use crate::event::Ids;

mod rows;
use rows::{RowRef, SlotRows};

pub const NONE: u32 = u32::MAX;

const HASH_SEED: u64 = 0x7265_7665_6e61_6e74; // "revenant"

/// Tags keep equal strings in different alias namespaces apart.
#[derive(Clone, Copy, Hash)]
#[repr(u8)]
enum AliasKind {
    RequestId = 1,
    TraceId = 2,
    Rid = 3,
    Room = 4,
}

fn hasher() -> FixedState {
    FixedState::with_seed(HASH_SEED)
}

fn key_str(kind: AliasKind, s: &str) -> u64 {
    hasher().hash_one((kind, s))
}

fn key_room(room: u64) -> u64 {
    hasher().hash_one((AliasKind::Room, room))
}

/// One open-addressing table for every alias (room, rid, request id, trace id) → where it points.
///
/// Keys are 64-bit hashes of (namespace, alias) (0 is reserved for "empty"); values are a 2-bit
/// tag plus a 30-bit index. A bucket is 12 bytes, linear probing from a multiply-shift home
/// (so any capacity works and growth is by half, not doubling), backward-shift deletion (no
/// tombstone markers). One probe sequence answers "live attempt, tombstone or nothing" for an
/// event's room, instead of one probe per map.
mod alias {
    #[derive(Clone, Copy, Default)]
    #[repr(C, packed(4))]
    struct Bucket {
        key: u64,
        val: u32,
    }

    pub const TAG_ATTEMPT: u32 = 0;
    pub const TAG_TOMB: u32 = 1 << 30;
    pub const TAG_REQUEST: u32 = 2 << 30;
    pub const INDEX_MASK: u32 = (1 << 30) - 1;
    const TAG_MASK: u32 = 3 << 30;

    pub fn tag(v: u32) -> u32 {
        v & TAG_MASK
    }

    /// Keys are hashes; 0 marks an empty bucket, so a hash of 0 is moved to 1.
    pub fn norm(key: u64) -> u64 {
        key.max(1)
    }

    #[derive(Default)]
    pub struct Table {
        buckets: Vec<Bucket>,
        len: usize,
    }

    impl Table {
        fn home(&self, key: u64) -> usize {
            ((key as u128 * self.buckets.len() as u128) >> 64) as usize
        }

        pub fn len(&self) -> usize {
            self.len
        }

        pub fn capacity_bytes(&self) -> usize {
            self.buckets.capacity() * std::mem::size_of::<Bucket>()
        }

        /// The bucket holding normalized `key`, or the empty bucket ending its probe run
        /// (`found` false). The table must have buckets and at least one empty one.
        #[inline]
        fn probe(&self, key: u64) -> (usize, bool) {
            let n = self.buckets.len();
            let mut i = self.home(key);
            loop {
                let k = self.buckets[i].key;
                if k == key {
                    return (i, true);
                }
                if k == 0 {
                    return (i, false);
                }
                i += 1;
                if i == n {
                    i = 0;
                }
            }
        }

        pub fn get(&self, key: u64) -> Option<u32> {
            if self.buckets.is_empty() {
                return None;
            }
            match self.probe(norm(key)) {
                (i, true) => Some(self.buckets[i].val),
                (_, false) => None,
            }
        }

        /// Inserts or overwrites; returns the previous value.
        pub fn insert(&mut self, key: u64, val: u32) -> Option<u32> {
            // Keep the load at most 0.8: probe chains stay within a cache line or two.
            if (self.len + 1) * 5 > self.buckets.len() * 4 {
                self.grow();
            }
            let key = norm(key);
            match self.probe(key) {
                (i, true) => Some(std::mem::replace(&mut self.buckets[i].val, val)),
                (i, false) => {
                    self.buckets[i] = Bucket { key, val };
                    self.len += 1;
                    None
                }
            }
        }

        /// Removes `key` if it maps to `val` (an alias re-pointed elsewhere stays).
        pub fn remove_if(&mut self, key: u64, val: u32) -> bool {
            let n = self.buckets.len();
            if n == 0 {
                return false;
            }
            let i = match self.probe(norm(key)) {
                (i, true) if self.buckets[i].val == val => i,
                _ => return false,
            };
            // Backward-shift deletion: pull later entries of the run into the hole when their
            // home is not between the hole and themselves (cyclically).
            let mut hole = i;
            let mut j = i;
            loop {
                j += 1;
                if j == n {
                    j = 0;
                }
                let k = self.buckets[j].key;
                if k == 0 {
                    break;
                }
                let h = self.home(k);
                let movable = if hole <= j {
                    h <= hole || h > j
                } else {
                    h <= hole && h > j
                };
                if movable {
                    self.buckets[hole] = self.buckets[j];
                    hole = j;
                }
            }
            self.buckets[hole] = Bucket::default();
            self.len -= 1;
            // Give memory back after a peak (e.g. live attempts compacted): below a third full,
            // rebuild at about 0.6.
            if self.buckets.len() > 4096 && self.len * 3 < self.buckets.len() {
                self.resize(self.len * 5 / 3);
            }
            true
        }

        /// An empty bucket array of `n`; large ones asked to be backed by huge pages.
        fn buckets(n: usize) -> Vec<Bucket> {
            let mut v = Vec::with_capacity(n);
            let bytes = n * std::mem::size_of::<Bucket>();
            advise_huge_pages(v.as_ptr() as usize, bytes, false);
            v.resize(n, Bucket::default());
            // The allocator may hand out memory already mapped with small pages (glibc serves
            // a freed large block again from its heap, e.g. the previous table after a resize),
            // which the advice alone does not convert: measured, the benchmark's tables got no
            // huge page at all. Collapse them now that they are populated.
            advise_huge_pages(v.as_ptr() as usize, bytes, true);
            v
        }

        /// Drops every entry for which `keep` says no (a full pass; callers amortise it).
        pub fn retain(&mut self, mut keep: impl FnMut(u32) -> bool) {
            let old = std::mem::take(&mut self.buckets);
            let n = old.len();
            self.buckets = Self::buckets(n);
            self.len = 0;
            for b in old {
                if b.key != 0 && keep(b.val) {
                    self.insert(b.key, b.val);
                }
            }
        }

        fn grow(&mut self) {
            self.resize(self.buckets.len() + self.buckets.len() / 2);
        }

        fn resize(&mut self, n: usize) {
            let n = n.max(1024);
            let old = std::mem::replace(&mut self.buckets, Self::buckets(n));
            self.len = 0;
            for b in old {
                if b.key != 0 {
                    self.insert(b.key, b.val);
                }
            }
        }
    }

    /// Every event probes this table at a random place: with 4 KiB pages each probe is also a
    /// TLB miss once the table outgrows the TLB's reach (a few MiB). Asking for transparent huge
    /// pages (the kernel's `madvise` mode) removes most of those; `collapse` (Linux 6.1+)
    /// converts pages already mapped small, synchronously. Advisory: errors (older kernels, no
    /// huge page free) are ignored, and other systems skip it.
    fn advise_huge_pages(start: usize, len: usize, collapse: bool) {
        #[cfg(target_os = "linux")]
        {
            /// From linux/mman.h (the libc crate defines it for glibc targets only).
            const MADV_COLLAPSE: libc::c_int = 25;
            const HUGE: usize = 2 << 20;
            let from = (start + HUGE - 1) & !(HUGE - 1);
            let to = (start + len) & !(HUGE - 1);
            let advice = if collapse {
                MADV_COLLAPSE
            } else {
                libc::MADV_HUGEPAGE
            };
            if to > from {
                // SAFETY: madvise only advises the kernel about pages inside our own allocation
                // (rounded inwards to huge-page boundaries); neither advice changes their
                // contents (a collapse copies them into a huge page).
                unsafe {
                    libc::madvise(from as *mut libc::c_void, to - from, advice);
                }
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = (start, len, collapse);
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn chunked_queue_is_a_fifo_across_chunks() {
            use super::super::ChunkedQueue;
            let mut q = ChunkedQueue::new(2);
            let (mut next_in, mut next_out) = (0u32, 0u32);
            for round in 0..6 {
                for _ in 0..1500 {
                    q.push_back(&[next_in, !next_in]);
                    next_in += 1;
                }
                let pops = if round == 5 { q.len() } else { 1100 };
                for _ in 0..pops {
                    assert_eq!(q.item(0), &[next_out, !next_out]);
                    q.pop_front();
                    next_out += 1;
                }
                for i in 0..q.len() {
                    assert_eq!(q.item(i)[0], next_out + i as u32);
                }
            }
            assert!(q.is_empty());
            assert!(q.capacity_bytes() < 1024, "chunks freed once emptied");
            let mut z: ChunkedQueue<u32> = ChunkedQueue::new(0);
            z.push_back(&[]);
            assert_eq!((z.len(), z.item(0).len()), (1, 0));
            z.pop_front();
            assert!(z.is_empty());
        }

        #[test]
        fn hex_rids_parse_like_the_plain_definition() {
            use super::super::Rid;
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
        fn rids_keep_their_text() {
            use super::super::Rid;
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

        #[test]
        fn insert_get_remove_with_collisions_and_growth() {
            let mut t = Table::default();
            let mut rng = 1u64;
            let mut keys = Vec::new();
            for i in 0..20_000u32 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                // Few distinct high bits: long shared probe runs.
                let k = (rng & 0xff00_0000_0000_00ff) | 1;
                if t.insert(k, i).is_none() {
                    keys.push((k, i));
                }
            }
            for &(k, _) in &keys {
                assert!(t.get(k).is_some());
            }
            for (n, &(k, _)) in keys.iter().enumerate() {
                if n % 2 == 0 {
                    let v = t.get(k).unwrap();
                    assert!(!t.remove_if(k, v ^ 1));
                    assert!(t.remove_if(k, v));
                }
            }
            for (n, &(k, _)) in keys.iter().enumerate() {
                assert_eq!(t.get(k).is_some(), n % 2 == 1, "key {n}");
            }
            assert_eq!(t.len(), keys.len() / 2);
            t.retain(|v| v % 3 != 0);
            assert!(t.len() < keys.len() / 2);
        }
    }
}

use alias::{INDEX_MASK, TAG_ATTEMPT, TAG_REQUEST, TAG_TOMB, tag};

/// Fixed-width items in fixed-size chunks: growth adds one chunk instead of doubling (a doubling
/// Vec reserves up to 2x and copies everything when it grows), and items never move.
pub struct Chunked<T> {
    chunks: Vec<Box<[T]>>,
    width: usize,
    len: usize,
}

const CHUNK_BITS: usize = 10;
const CHUNK_ITEMS: usize = 1 << CHUNK_BITS;

impl<T: Clone> Chunked<T> {
    pub fn new(width: usize) -> Chunked<T> {
        assert!(width > 0, "items hold at least one element");
        Chunked {
            chunks: Vec::new(),
            width,
            len: 0,
        }
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends an item whose elements are all `fill`; returns its index.
    pub fn push(&mut self, fill: T) -> usize {
        if self.len == self.chunks.len() << CHUNK_BITS {
            self.chunks
                .push(vec![fill.clone(); CHUNK_ITEMS * self.width].into_boxed_slice());
        }
        let i = self.len;
        self.len += 1;
        self.item_mut(i).fill(fill);
        i
    }

    /// Item `i` (panics past the end, like a slice index). Records and slot rows are read this
    /// way a dozen times per event: one length check here replaces the chunk and sub-slice
    /// checks (a tenth of the engine's instructions before).
    #[inline]
    pub fn item(&self, i: usize) -> &[T] {
        assert!(i < self.len, "item {i} of {}", self.len);
        let off = (i & (CHUNK_ITEMS - 1)) * self.width;
        // SAFETY: `push` adds a chunk of `CHUNK_ITEMS * width` elements before the first item
        // that needs it, and chunks are never removed, so every item below `len` lies inside
        // chunk `i >> CHUNK_BITS` at `off..off + width`.
        unsafe {
            self.chunks
                .get_unchecked(i >> CHUNK_BITS)
                .get_unchecked(off..off + self.width)
        }
    }

    #[inline]
    pub fn item_mut(&mut self, i: usize) -> &mut [T] {
        assert!(i < self.len, "item {i} of {}", self.len);
        let off = (i & (CHUNK_ITEMS - 1)) * self.width;
        // SAFETY: as in `item`; `&mut self` makes the borrow exclusive.
        unsafe {
            self.chunks
                .get_unchecked_mut(i >> CHUNK_BITS)
                .get_unchecked_mut(off..off + self.width)
        }
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        let n = self.len * self.width;
        self.chunks.iter_mut().flat_map(|c| c.iter_mut()).take(n)
    }

    /// Heap bytes reserved.
    pub fn capacity_bytes(&self) -> usize {
        self.chunks.len() * CHUNK_ITEMS * self.width * std::mem::size_of::<T>()
            + self.chunks.capacity() * std::mem::size_of::<Box<[T]>>()
    }
}

/// The first element of item `i` (one bounds check: records are read this way several times
/// per event).
impl<T: Clone> std::ops::Index<usize> for Chunked<T> {
    type Output = T;
    #[inline]
    fn index(&self, i: usize) -> &T {
        assert!(i < self.len, "item {i} of {}", self.len);
        // SAFETY: as in `Chunked::item` (width >= 1 for indexed tables).
        unsafe {
            self.chunks
                .get_unchecked(i >> CHUNK_BITS)
                .get_unchecked((i & (CHUNK_ITEMS - 1)) * self.width)
        }
    }
}

impl<T: Clone> std::ops::IndexMut<usize> for Chunked<T> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        assert!(i < self.len, "item {i} of {}", self.len);
        // SAFETY: as in `Chunked::item`.
        unsafe {
            self.chunks
                .get_unchecked_mut(i >> CHUNK_BITS)
                .get_unchecked_mut((i & (CHUNK_ITEMS - 1)) * self.width)
        }
    }
}

/// A FIFO of fixed-width items in fixed-size chunks: the tombstone queue. Like [`Chunked`], it
/// grows by one chunk (a `VecDeque` doubles) and frees a chunk once its last item is popped.
pub struct ChunkedQueue<T> {
    chunks: VecDeque<Box<[T]>>,
    width: usize,
    /// Items already popped from the first chunk.
    head: usize,
    len: usize,
}

impl<T: Clone> ChunkedQueue<T> {
    pub fn new(width: usize) -> ChunkedQueue<T> {
        ChunkedQueue {
            chunks: VecDeque::new(),
            width,
            head: 0,
            len: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends an item (`item.len()` must be the width).
    pub fn push_back(&mut self, item: &[T]) {
        debug_assert_eq!(item.len(), self.width);
        let end = self.head + self.len;
        if end == self.chunks.len() << CHUNK_BITS {
            let Some(fill) = item.first() else {
                // Zero-width items need no storage; only count them.
                self.len += 1;
                return;
            };
            self.chunks
                .push_back(vec![fill.clone(); CHUNK_ITEMS * self.width].into_boxed_slice());
        }
        self.len += 1;
        self.item_mut(self.len - 1).clone_from_slice(item);
    }

    pub fn pop_front(&mut self) {
        if self.len == 0 {
            return;
        }
        self.len -= 1;
        self.head += 1;
        if self.head == CHUNK_ITEMS || self.len == 0 {
            if self.head == CHUNK_ITEMS || self.width != 0 {
                self.chunks.pop_front();
            }
            self.head = 0;
        }
    }

    pub fn item(&self, i: usize) -> &[T] {
        if self.width == 0 {
            return &[];
        }
        let j = self.head + i;
        let off = (j & (CHUNK_ITEMS - 1)) * self.width;
        &self.chunks[j >> CHUNK_BITS][off..off + self.width]
    }

    pub fn item_mut(&mut self, i: usize) -> &mut [T] {
        if self.width == 0 {
            return &mut [];
        }
        let j = self.head + i;
        let off = (j & (CHUNK_ITEMS - 1)) * self.width;
        &mut self.chunks[j >> CHUNK_BITS][off..off + self.width]
    }

    pub fn capacity_bytes(&self) -> usize {
        self.chunks.len() * CHUNK_ITEMS * self.width * std::mem::size_of::<T>()
            + self.chunks.capacity() * std::mem::size_of::<Box<[T]>>()
    }
}

/// Eight lowercase hex digits (little-endian bytes of `x`, the first digit in the low byte) as
/// a number, eight bytes at a time: every event naming a rid has it parsed to be compared with its
/// attempt's, so this runs on nearly half of all events.
#[inline]
fn hex8(x: u64) -> Option<u32> {
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
    fn hex(s: &str) -> Option<[u64; 2]> {
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
            Rid::Hex(h) => Self::hex(s) == Some(*h),
        }
    }

    pub fn to_string_opt(&self) -> Option<String> {
        self.with_str(str::to_owned)
    }

    fn key(&self) -> Option<u64> {
        self.with_str(|s| key_str(AliasKind::Rid, s))
    }
}

/// Live state of one attempt (88 bytes). Rule slots live in [`Store::attempt_rows`], found by
/// `slot_class`/`slot_row`.
///
/// Every alias key that points at the attempt is recorded here (room, first rid, a second rid)
/// or, beyond that, in [`Store::more_rids`], so that freeing the attempt removes all of them: an
/// alias left behind would hand a late event of this attempt to the next one reusing the record.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub generation: u32,
    pub request: u32,
    /// `request` is a union-find root as of this union epoch (0 = not known to be one): while no
    /// union happened since, the request record need not be read (one cache miss per event).
    request_epoch: u32,
    pub input_tokens: u32,
    /// The bootstrap room, when `flags` has `HAS_ROOM` (no `Option`: it would cost 8 bytes).
    room: u64,
    /// The first rid when it is SGLang-shaped (`RID_HEX`); other rids (`RID_TEXT`) keep their
    /// text in [`Store::rid_texts`].
    rid_hex: [u64; 2],
    /// Alias key of a second rid (0 = none), e.g. the decode leg's when it differs from prefill's.
    rid2_key: u64,
    pub last_ns: u64,
    /// Earliest pending deadline in the timer queue (0 = none); compaction waits for it.
    pub due_ns: u64,
    /// Bit per compiled rule that already produced a violation for this attempt.
    pub fired: u64,
    /// Per stage, the worker (or node) of the latest event naming one, as the checker's interned
    /// worker id (0 = none): keys capacity look-ups when a predicate is judged again later.
    pub worker_keys: [u16; 4],
    /// Bit per stage: a leg started (received/admitted/work) / ended (terminal kind).
    pub legs_open: u8,
    pub legs_closed: u8,
    flags: u8,
    /// Where its slot row is ([`RowRef`] as two fields: they fill the record's tail padding).
    slot_class: u8,
    slot_row: u32,
}

const LIVE: u8 = 1;
/// A predicate asked to be judged again (new facts); keeps the attempt live until it is.
const REJUDGE: u8 = 2;
const HAS_ROOM: u8 = 4;
const RID_HEX: u8 = 8;
const RID_TEXT: u8 = 16;
/// More alias keys than `rid2_key` holds: the rest are in `Store::more_rids`.
const MORE_RIDS: u8 = 32;

impl Attempt {
    fn ended(&self) -> bool {
        self.legs_closed != 0 && self.legs_open & !self.legs_closed == 0
    }
    pub fn is_live(&self) -> bool {
        self.flags & LIVE != 0
    }
    pub fn rejudge(&self) -> bool {
        self.flags & REJUDGE != 0
    }
    pub fn set_rejudge(&mut self, on: bool) {
        if on {
            self.flags |= REJUDGE;
        } else {
            self.flags &= !REJUDGE;
        }
    }
    pub fn room(&self) -> Option<u64> {
        (self.flags & HAS_ROOM != 0).then_some(self.room)
    }
    fn set_room(&mut self, room: u64) {
        self.room = room;
        self.flags |= HAS_ROOM;
    }
    fn has_rid(&self) -> bool {
        self.flags & (RID_HEX | RID_TEXT) != 0
    }
    #[inline]
    fn row(&self) -> RowRef {
        RowRef {
            class: self.slot_class,
            index: self.slot_row,
        }
    }
    #[inline]
    fn set_row(&mut self, r: RowRef) {
        self.slot_class = r.class;
        self.slot_row = r.index;
    }
}

/// A request (48 bytes): its aliases; its request-scope rule slots are in
/// [`Store::request_slots`]. It owns at most one request id and one trace id alias, so freeing
/// it removes every alias pointing at it; a second one of either kind gets a stub request merged
/// into this one.
#[derive(Debug, Clone)]
pub struct Request {
    pub generation: u32,
    /// Union-find parent; `NONE` for a root.
    pub parent: u32,
    /// Attempts and tombstones that point here.
    pub refs: u32,
    /// `REQ_LIVE`, `REQ_HAS_ID`, `REQ_HAS_TRACE`, and in the low bits the request id's length
    /// within `ids`.
    meta: u32,
    pub last_ns: u64,
    pub fired: u64,
    /// The request id followed by the trace id: one allocation instead of two `Option<Box<str>>`
    /// (16 bytes each in the record).
    ids: Option<Box<str>>,
}

const REQ_LIVE: u32 = 1 << 31;
const REQ_HAS_ID: u32 = 1 << 30;
const REQ_HAS_TRACE: u32 = 1 << 29;
const REQ_ID_LEN: u32 = (1 << 29) - 1;

impl Request {
    pub fn is_live(&self) -> bool {
        self.meta & REQ_LIVE != 0
    }
    fn split(&self) -> usize {
        (self.meta & REQ_ID_LEN) as usize
    }
    pub fn request_id(&self) -> Option<&str> {
        let ids = self.ids.as_deref()?;
        (self.meta & REQ_HAS_ID != 0).then(|| &ids[..self.split()])
    }
    pub fn trace_id(&self) -> Option<&str> {
        let ids = self.ids.as_deref()?;
        (self.meta & REQ_HAS_TRACE != 0).then(|| &ids[self.split()..])
    }
    /// Sets the request id (`trace` false) or trace id if it has none; false if it had one.
    fn set_id(&mut self, trace: bool, v: &str) -> bool {
        let (has, id, tr) = match trace {
            false => (REQ_HAS_ID, Some(v), self.trace_id()),
            true => (REQ_HAS_TRACE, self.request_id(), Some(v)),
        };
        if self.meta & has != 0 {
            return false;
        }
        let mut id = id.unwrap_or("");
        // The length field has 29 bits; ids come from transports whose messages are far smaller,
        // so this only guards against a mis-split.
        if id.len() > REQ_ID_LEN as usize {
            let mut end = REQ_ID_LEN as usize;
            while !id.is_char_boundary(end) {
                end -= 1;
            }
            id = &id[..end];
        }
        let joined: Box<str> = [id, tr.unwrap_or("")].concat().into();
        self.meta = (self.meta & !REQ_ID_LEN) | has | id.len() as u32;
        self.ids = Some(joined);
        true
    }
}

/// What is left of a finished attempt: enough to catch late activity on a rejected attempt.
#[derive(Debug, Clone, Copy)]
pub struct Tombstone {
    pub request: u32,
    /// Whole seconds of event time after which the tombstone is dropped.
    pub expires_s: u32,
    /// The attempt's fired bits of the rules judged on tombstones, compacted (see
    /// [`Store::tomb_fired`]), so late repeats do not fire again.
    fired: u32,
    /// Where its sparse slot row starts in the word queue (an absolute word index, wrapping).
    row_at: u32,
}

/// The bits of `mask` picked out of `bits`, packed towards bit 0 (a software `pext`).
fn compress_bits(mask: u64, bits: u64) -> u32 {
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
fn expand_bits(mask: u64, packed: u32) -> u64 {
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

/// Whose never-after verdict a set of reported evidence sources belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Owner {
    Attempt(u32),
    Tomb(u64),
    Request(u32),
}

/// Where an event's attempt lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptRef {
    Live(u32),
    Tomb(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    pub attempt: Option<AttemptRef>,
    pub request: Option<u32>,
    /// The attempt was (re)linked to a request by this event: request-scope state must be folded.
    pub linked: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CorrelateStats {
    pub attempts_created: u64,
    pub attempts_merged: u64,
    /// An event named a room and a rid that belong to different attempts with different rooms.
    pub alias_conflicts: u64,
    pub compacted_ended: u64,
    pub evicted_ttl: u64,
    pub evicted_cap: u64,
    pub tombstones_expired: u64,
    pub tombstones_evicted_cap: u64,
    pub requests_created: u64,
    pub requests_merged: u64,
    pub requests_expired: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_attempts: usize,
    pub max_tombstones: usize,
    /// Idle live attempts are compacted after this (ns).
    pub attempt_ttl_ns: u64,
    /// Ended attempts are compacted once quiet for this long (ns).
    pub linger_ns: u64,
    /// Tombstones, and requests nothing points to, are kept this long (ns).
    pub retention_ns: u64,
}

/// The clock hand's position, then advanced around `n` items. A compare instead of `% n`: the
/// sweep runs on every event, and a 64-bit division is tens of cycles.
fn next_hand(hand: &mut usize, n: usize) -> usize {
    if *hand >= n {
        *hand = 0;
    }
    let i = *hand;
    *hand += 1;
    i
}

/// One owner's row of packed slots (`1 + n` words, see [`packed`]) as a readable view, taking
/// the full slots from `wide` when the row is [`packed::WIDE`].
fn row_view<'a, K: std::hash::Hash + Eq>(
    row: &'a [u64],
    wide: &'a HashMap<K, Box<[Slot]>, FixedState>,
    id: K,
) -> Slots<'a> {
    if row[0] == packed::WIDE {
        Slots::Wide(wide.get(&id).expect("a wide row keeps its slots"))
    } else {
        Slots::Packed(row)
    }
}

/// Folds `slot` into every spec of an owner's row whose bit is set in `specs` (`keeps` indexed
/// by spec); a row that can no longer be packed becomes wide, its slots moving into `wide`.
/// Returns the specs whose slots changed.
fn row_fold<K: std::hash::Hash + Eq + Copy>(
    row: &mut [u64],
    wide: &mut HashMap<K, Box<[Slot]>, FixedState>,
    id: K,
    specs: u64,
    keeps: &[Keep],
    slot: Slot,
) -> u64 {
    if row[0] != packed::WIDE {
        match packed::fold_specs(row, specs, |k| keeps[k], slot) {
            Ok(changed) => return changed,
            Err(packed::Unpackable) => {
                wide.insert(id, packed::unpack_row(row).into());
                row[0] = packed::WIDE;
            }
        }
    }
    let slots = wide.get_mut(&id).expect("a wide row keeps its slots");
    let (mut bits, mut changed) = (specs, 0u64);
    while bits != 0 {
        let k = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        if fold_into(slots, k, keeps[k], slot) {
            changed |= 1 << k;
        }
    }
    changed
}

/// Replaces an owner's slots with `slots` (packed when they fit, else wide).
fn row_store<K: std::hash::Hash + Eq>(
    row: &mut [u64],
    wide: &mut HashMap<K, Box<[Slot]>, FixedState>,
    id: K,
    slots: &[Slot],
) {
    let was_wide = row[0] == packed::WIDE;
    if was_wide {
        row[0] = 0;
    }
    match packed::store_row(row, slots) {
        Ok(()) => {
            if was_wide {
                wide.remove(&id);
            }
        }
        Err(packed::Unpackable) => {
            row[0] = packed::WIDE;
            wide.insert(id, slots.into());
        }
    }
}

/// Empties an owner's row (a reused record), dropping its wide slots if it had some.
fn row_clear<K: std::hash::Hash + Eq>(
    row: &mut [u64],
    wide: &mut HashMap<K, Box<[Slot]>, FixedState>,
    id: K,
) {
    if row[0] == packed::WIDE {
        wide.remove(&id);
    }
    row.fill(0);
}

/// Folds every slot of `src` into `dst`, spec by spec (pairs as pairs).
fn fold_all(dst: &mut [Slot], src: &[Slot], keeps: &[Keep]) {
    for (k, &keep) in keeps.iter().enumerate() {
        match keep {
            Keep::PairTail => {}
            _ if keep.is_pair() => {
                fold_into(dst, k, keep, src[k]);
                fold_into(dst, k, keep, src[k + 1]);
            }
            _ => {
                fold_into(dst, k, keep, src[k]);
            }
        }
    }
}

/// The correlation store.
pub struct Store {
    pub limits: Limits,
    pub attempts: Chunked<Attempt>,
    /// Per attempt, its rule slots as a sparse row in a size class (see [`rows`]).
    attempt_rows: SlotRows,
    free_attempts: Vec<u32>,
    live_attempts: usize,
    /// Every alias: rooms and rids (live attempts, tombstones), request ids and trace ids.
    aliases: alias::Table,
    /// First rejection reason of attempts that have one (about 1% of them).
    reasons: HashMap<u32, Box<str>, FixedState>,
    /// The first rid of attempts whose rid is not SGLang-shaped hex (`RID_TEXT`).
    rid_texts: HashMap<u32, Box<str>, FixedState>,
    /// Alias keys of attempts seen with more than two rids, beyond `Attempt::rid2_key`.
    more_rids: HashMap<u32, Vec<u64>, FixedState>,
    /// Per (owner, rule) that fired: a bit per `Source` seen in its reported evidence, so a source
    /// that saw the breach later corroborates it once. Only owners with fired bits have entries.
    reported: HashMap<(Owner, u8), u8, FixedState>,
    /// The alias each request's first violation was fingerprinted with, for requests that fired
    /// only. Aliases arrive in any order (smg's span, the only one with the x-request-id, comes
    /// when the request is over), so later violations reuse it: one request, one fingerprint.
    pinned_alias: HashMap<u32, Box<str>, FixedState>,

    pub requests: Chunked<Request>,
    request_slots: Chunked<u64>,
    wide_requests: HashMap<u32, Box<[Slot]>, FixedState>,
    request_keeps: Vec<Keep>,
    free_requests: Vec<u32>,
    live_requests: usize,

    tombs: ChunkedQueue<Tombstone>,
    /// The tombstones' sparse slot rows (of `tomb_slot_map.len()` slots; see [`sparse`]), one
    /// after another in the order of `tombs`: a word queue.
    tomb_slots: ChunkedQueue<u64>,
    /// Absolute index of the queue's first word.
    tomb_words_base: u64,
    /// The rules whose fired bits tombstones keep (attempt-scope never-after).
    tomb_rule_mask: u64,
    /// Slots of tombstones whose row is wide, by tombstone sequence number.
    wide_tombs: HashMap<u64, Box<[Slot]>, FixedState>,
    /// Which attempt slots a tombstone keeps (those of attempt-scope never-after rules).
    tomb_slot_map: Vec<usize>,
    tomb_base: u64,
    /// Alias entries that may still point to dropped tombstones (purged in bulk).
    tomb_alias_stale: usize,

    attempt_hand: usize,
    request_hand: usize,
    /// Bumped by every request union (starts at 1; see [`Attempt::request_epoch`]).
    union_epoch: u32,
    pub stats: CorrelateStats,
}

impl Store {
    pub fn new(
        limits: Limits,
        attempt_keeps: Vec<Keep>,
        request_keeps: Vec<Keep>,
        tomb_slot_map: Vec<usize>,
        tomb_rule_mask: u64,
    ) -> Store {
        assert!(
            tomb_rule_mask.count_ones() as usize <= crate::checker::rules::MAX_TOMBSTONE_RULES,
            "tombstones keep at most 32 rules' fired bits"
        );
        // Alias values hold 30-bit indices; the tombstone window must stay far below that.
        let limits = Limits {
            max_attempts: limits.max_attempts.min(1 << 29),
            max_tombstones: limits.max_tombstones.min(1 << 28),
            ..limits
        };
        Store {
            limits,
            attempts: Chunked::new(1),
            attempt_rows: SlotRows::new(attempt_keeps),
            free_attempts: Vec::new(),
            live_attempts: 0,
            aliases: alias::Table::default(),
            reasons: HashMap::with_hasher(hasher()),
            rid_texts: HashMap::with_hasher(hasher()),
            more_rids: HashMap::with_hasher(hasher()),
            reported: HashMap::with_hasher(hasher()),
            pinned_alias: HashMap::with_hasher(hasher()),
            requests: Chunked::new(1),
            request_slots: Chunked::new(1 + request_keeps.len()),
            wide_requests: HashMap::with_hasher(hasher()),
            request_keeps,
            free_requests: Vec::new(),
            live_requests: 0,
            tombs: ChunkedQueue::new(1),
            tomb_slots: ChunkedQueue::new(1),
            tomb_words_base: 0,
            tomb_rule_mask,
            wide_tombs: HashMap::with_hasher(hasher()),
            tomb_slot_map,
            tomb_base: 0,
            tomb_alias_stale: 0,
            attempt_hand: 0,
            request_hand: 0,
            union_epoch: 1,
            stats: CorrelateStats::default(),
        }
    }

    pub fn live_attempts(&self) -> usize {
        self.live_attempts
    }
    pub fn live_requests(&self) -> usize {
        self.live_requests
    }
    pub fn tombstones(&self) -> usize {
        self.tombs.len()
    }
    pub fn alias_entries(&self) -> usize {
        self.aliases.len()
    }

    #[inline]
    pub fn attempt_slots(&self, a: u32) -> Slots<'_> {
        self.attempt_rows.view(self.attempts[a as usize].row(), a)
    }
    /// Folds `slot` into every spec of attempt `a` whose bit is set in `specs`; returns the
    /// specs whose slots changed.
    #[inline]
    pub fn fold_attempt_slots(&mut self, a: u32, specs: u64, slot: Slot) -> u64 {
        let at = &mut self.attempts[a as usize];
        let mut r = at.row();
        let changed = self.attempt_rows.fold(&mut r, a, specs, slot);
        at.set_row(r);
        changed
    }
    pub fn request_slots(&self, r: u32) -> Slots<'_> {
        row_view(self.request_slots.item(r as usize), &self.wide_requests, r)
    }
    /// Folds `slot` into every spec of request `r` whose bit is set in `specs`; returns the
    /// specs whose slots changed.
    pub fn fold_request_slots(&mut self, r: u32, specs: u64, slot: Slot) -> u64 {
        let row = self.request_slots.item_mut(r as usize);
        row_fold(
            row,
            &mut self.wide_requests,
            r,
            specs,
            &self.request_keeps,
            slot,
        )
    }
    /// Attempts, requests and tombstones whose slots did not fit a packed row, for the stats.
    pub fn wide_rows(&self) -> usize {
        self.attempt_rows.wide_len() + self.wide_requests.len() + self.wide_tombs.len()
    }

    pub fn reason(&self, a: u32) -> Option<&str> {
        self.reasons.get(&a).map(|r| &**r)
    }
    pub fn set_reason_once(&mut self, a: u32, reason: &str) {
        self.reasons.entry(a).or_insert_with(|| reason.into());
    }

    /// The fingerprint alias pinned by request `r`'s first violation (`r` a union-find root).
    pub fn pinned_alias(&self, r: u32) -> Option<&str> {
        self.pinned_alias.get(&r).map(|s| &**s)
    }
    pub fn pin_alias(&mut self, r: u32, alias: &str) {
        self.pinned_alias.entry(r).or_insert_with(|| alias.into());
    }

    /// Sources (bit per `Source`) in the evidence reported so far for `rule` of `owner`.
    pub fn reported(&self, owner: Owner, rule: usize) -> u8 {
        self.reported
            .get(&(owner, rule as u8))
            .copied()
            .unwrap_or(0)
    }
    pub fn add_reported(&mut self, owner: Owner, rule: usize, sources: u8) {
        *self.reported.entry((owner, rule as u8)).or_default() |= sources;
    }
    /// Moves the reported-source bits of the rules in `fired` (merges, compaction).
    fn move_reported(&mut self, from: Owner, to: Owner, fired: u64) {
        let mut bits = fired;
        while bits != 0 {
            let rule = bits.trailing_zeros() as u8;
            bits &= bits - 1;
            if let Some(v) = self.reported.remove(&(from, rule)) {
                *self.reported.entry((to, rule)).or_default() |= v;
            }
        }
    }
    fn drop_reported(&mut self, owner: Owner, fired: u64) {
        let mut bits = fired;
        while bits != 0 {
            let rule = bits.trailing_zeros() as u8;
            bits &= bits - 1;
            self.reported.remove(&(owner, rule));
        }
    }

    /// Index into the tombstone queue of tombstone `seq`, if it still exists.
    pub fn tomb_index(&self, seq: u64) -> Option<usize> {
        let i = seq.checked_sub(self.tomb_base)? as usize;
        (i < self.tombs.len()).then_some(i)
    }
    pub fn tomb(&self, i: usize) -> &Tombstone {
        &self.tombs.item(i)[0]
    }
    pub fn tomb_mut(&mut self, i: usize) -> &mut Tombstone {
        &mut self.tombs.item_mut(i)[0]
    }
    /// Fired bits (as in [`Attempt::fired`]) of tombstone `i`, for the rules judged on it.
    pub fn tomb_fired(&self, i: usize) -> u64 {
        expand_bits(self.tomb_rule_mask, self.tomb(i).fired)
    }
    pub fn add_tomb_fired(&mut self, i: usize, bits: u64) {
        let add = compress_bits(self.tomb_rule_mask, bits);
        self.tomb_mut(i).fired |= add;
    }

    /// Queue position of tombstone `i`'s row header.
    fn tomb_row(&self, i: usize) -> usize {
        self.tomb(i)
            .row_at
            .wrapping_sub(self.tomb_words_base as u32) as usize
    }

    /// A copy of tombstone `i`'s kept slots, in `tomb_slot_map` order.
    pub fn tomb_slots_of(&self, i: usize) -> Vec<Slot> {
        let at = self.tomb_row(i);
        let header = self.tomb_slots.item(at)[0];
        if header == packed::WIDE {
            let seq = self.tomb_base + i as u64;
            return self
                .wide_tombs
                .get(&seq)
                .expect("a wide row keeps its slots")
                .to_vec();
        }
        let n = self.tomb_slot_map.len();
        let words: Vec<u64> = (at..at + sparse::len(header, n))
            .map(|j| self.tomb_slots.item(j)[0])
            .collect();
        sparse::decode(&words, n)
    }

    /// Replaces tombstone `i`'s kept slots. In place when the same slots are set (and fit);
    /// otherwise (a late event set an empty one) the row moves to the wide side table.
    pub fn set_tomb_slots(&mut self, i: usize, slots: &[Slot]) {
        let seq = self.tomb_base + i as u64;
        let n = self.tomb_slot_map.len();
        let at = self.tomb_row(i);
        let header = self.tomb_slots.item(at)[0];
        if header != packed::WIDE {
            let mut buf = [0u64; 1 + SlotLayout::MAX];
            if let Ok(len) = sparse::encode(&slots[..n], &mut buf)
                && len == sparse::len(header, n)
            {
                for (j, w) in buf[..len].iter().enumerate() {
                    self.tomb_slots.item_mut(at + j)[0] = *w;
                }
                return;
            }
            self.tomb_slots.item_mut(at)[0] = packed::WIDE;
        }
        self.wide_tombs.insert(seq, slots[..n].into());
    }
    pub fn tomb_slot_map(&self) -> &[usize] {
        &self.tomb_slot_map
    }

    /// The first rid attempt `a` was seen with.
    pub fn attempt_rid(&self, a: u32) -> Rid {
        let at = &self.attempts[a as usize];
        if at.flags & RID_HEX != 0 {
            Rid::Hex(at.rid_hex)
        } else if at.flags & RID_TEXT != 0 {
            self.rid_texts
                .get(&a)
                .map_or(Rid::None, |t| Rid::Text(t.clone()))
        } else {
            Rid::None
        }
    }

    /// Whether `rid` is the first rid of attempt `a` (without hashing it, for the hex form).
    fn rid_is_first(&self, a: u32, rid: &str) -> bool {
        let at = &self.attempts[a as usize];
        if at.flags & RID_HEX != 0 {
            Rid::hex(rid) == Some(at.rid_hex)
        } else if at.flags & RID_TEXT != 0 {
            self.rid_texts.get(&a).is_some_and(|t| **t == *rid)
        } else {
            false
        }
    }

    fn set_first_rid(&mut self, a: u32, rid: Rid) {
        let at = &mut self.attempts[a as usize];
        match rid {
            Rid::None => {}
            Rid::Hex(h) => {
                at.rid_hex = h;
                at.flags |= RID_HEX;
            }
            Rid::Text(t) => {
                at.flags |= RID_TEXT;
                self.rid_texts.insert(a, t);
            }
        }
    }

    /// Records that alias `key` (pointing at attempt `a`) belongs to it, unless it is its room's
    /// or first rid's key, which are recorded already. `maybe_first`: `key` may be the first
    /// rid's (false when the caller knows the rid differs: it saves rebuilding that rid's text).
    fn own_alias(&mut self, a: u32, key: u64, maybe_first: bool) {
        let at = &self.attempts[a as usize];
        if at.room().map(key_room) == Some(key) || at.rid2_key == key {
            return;
        }
        if maybe_first && at.has_rid() && self.attempt_rid(a).key() == Some(key) {
            return;
        }
        let at = &mut self.attempts[a as usize];
        if at.rid2_key == 0 {
            at.rid2_key = key;
            return;
        }
        at.flags |= MORE_RIDS;
        let more = self.more_rids.entry(a).or_default();
        if !more.contains(&key) {
            more.push(key);
        }
    }

    /// Every alias key attempt `a` owns: room, first rid, second rid (no allocation: this runs
    /// for every attempt freed), then any further ones.
    fn attempt_keys(&self, a: u32) -> impl Iterator<Item = u64> + use<> {
        let at = &self.attempts[a as usize];
        let inline = [
            at.room().map(key_room),
            self.attempt_rid(a).key(),
            (at.rid2_key != 0).then_some(at.rid2_key),
        ];
        let more = match at.flags & MORE_RIDS {
            0 => None,
            _ => self.more_rids.get(&a).cloned(),
        };
        inline
            .into_iter()
            .flatten()
            .chain(more.into_iter().flatten())
    }

    /// The union-find root of request `r` (path halving keeps chains short).
    pub fn find(&mut self, mut r: u32) -> u32 {
        loop {
            let p = self.requests[r as usize].parent;
            if p == NONE {
                return r;
            }
            let gp = self.requests[p as usize].parent;
            if gp != NONE {
                // Re-point r from p to gp; reference counts follow the pointer.
                self.requests[r as usize].parent = gp;
                self.requests[p as usize].refs -= 1;
                self.requests[gp as usize].refs += 1;
            }
            r = p;
        }
    }

    /// Finds or creates the request and attempt named by `ids`, merging aliases.
    pub fn resolve(&mut self, ids: &Ids, time_ns: u64) -> Resolved {
        let mut request = self.resolve_request(ids, time_ns);

        let room_key = ids.bootstrap_room.map(|r| key_room(r.0));
        if room_key.is_none() && ids.rid.is_none() {
            return Resolved {
                attempt: None,
                request,
                linked: false,
            };
        }
        let by_room = room_key.and_then(|k| self.lookup_attempt(k));
        // Most events repeat the rid the attempt already has: skip the second table probe.
        let rid_known = match (by_room, ids.rid.as_deref()) {
            (Some(AttemptRef::Live(i)), Some(rid)) => self.rid_is_first(i, rid),
            _ => false,
        };
        // Hashing the rid (32 bytes) is only needed when it is not the attempt's known one.
        let rid_key = if rid_known {
            None
        } else {
            ids.rid.as_deref().map(|s| key_str(AliasKind::Rid, s))
        };
        let by_rid = if rid_known {
            by_room
        } else {
            rid_key.and_then(|k| self.lookup_attempt(k))
        };
        // A merge brings the other attempt's history: request-scope state must be folded again.
        let mut linked = matches!((by_room, by_rid), (Some(a), Some(b)) if a != b);
        let attempt = match (by_room, by_rid) {
            (Some(a), Some(b)) if a == b => a,
            (Some(a), Some(b)) => self.merge_attempts(a, b),
            (Some(a), None) => {
                if let (Some(k), AttemptRef::Live(i)) = (rid_key, a) {
                    self.aliases.insert(k, i);
                    if !self.attempts[i as usize].has_rid()
                        && let Some(rid) = ids.rid.as_deref()
                    {
                        self.set_first_rid(i, Rid::new(rid));
                    } else {
                        // Not the first rid: `rid_is_first` said so before the probe.
                        self.own_alias(i, k, false);
                    }
                }
                a
            }
            (None, Some(b)) => match (ids.bootstrap_room, b) {
                (Some(room), AttemptRef::Live(i)) => match self.attempts[i as usize].room() {
                    None => {
                        self.attempts[i as usize].set_room(room.0);
                        self.aliases.insert(key_room(room.0), i);
                        b
                    }
                    Some(other) if other == room.0 => b,
                    Some(_) => {
                        // A rid reused across attempts (client-chosen rid, router retry): the room
                        // decides; the rid stays with the attempt that had it first.
                        self.stats.alias_conflicts += 1;
                        AttemptRef::Live(self.new_attempt(Some(room.0), Rid::None, room_key, None))
                    }
                },
                _ => b,
            },
            (None, None) => AttemptRef::Live(self.new_attempt(
                ids.bootstrap_room.map(|r| r.0),
                ids.rid.as_deref().map_or(Rid::None, Rid::new),
                room_key,
                rid_key,
            )),
        };

        let current = match attempt {
            AttemptRef::Live(i) => self.attempts[i as usize].request,
            AttemptRef::Tomb(seq) => self
                .tomb_index(seq)
                .map(|i| self.tomb(i).request)
                .unwrap_or(NONE),
        };
        // Events of a live attempt whose request is a known root skip the request record: its
        // idle time is brought up to date when the attempt leaves (`note_request_activity`).
        let mut touch = true;
        match (request, current) {
            (Some(r), NONE) => {
                match attempt {
                    AttemptRef::Live(i) => {
                        let at = &mut self.attempts[i as usize];
                        at.request = r;
                        at.request_epoch = self.union_epoch;
                    }
                    AttemptRef::Tomb(seq) => {
                        if let Some(i) = self.tomb_index(seq) {
                            self.tomb_mut(i).request = r;
                        }
                    }
                }
                self.requests[r as usize].refs += 1;
                linked = true;
            }
            (Some(r), cur) => {
                let cur = self.find(cur);
                if cur != r {
                    request = Some(self.union_requests(cur, r));
                    linked = true;
                }
            }
            (None, NONE) => {}
            (None, cur) => match attempt {
                AttemptRef::Live(i)
                    if self.attempts[i as usize].request_epoch == self.union_epoch =>
                {
                    request = Some(cur);
                    touch = false;
                }
                AttemptRef::Live(i) => {
                    let root = self.find(cur);
                    if root != cur {
                        // Point the attempt at the root; its reference follows.
                        self.requests[cur as usize].refs -= 1;
                        self.requests[root as usize].refs += 1;
                        self.attempts[i as usize].request = root;
                    }
                    self.attempts[i as usize].request_epoch = self.union_epoch;
                    request = Some(root);
                }
                AttemptRef::Tomb(_) => request = Some(self.find(cur)),
            },
        }
        if let Some(r) = request
            && touch
        {
            let req = &mut self.requests[r as usize];
            req.last_ns = req.last_ns.max(time_ns);
        }
        Resolved {
            attempt: Some(attempt),
            request,
            linked,
        }
    }

    fn resolve_request(&mut self, ids: &Ids, time_ns: u64) -> Option<u32> {
        let keys = [
            ids.request_id
                .as_deref()
                .map(|s| key_str(AliasKind::RequestId, s)),
            ids.trace_id
                .as_deref()
                .map(|s| key_str(AliasKind::TraceId, s)),
        ];
        let mut request = None;
        for key in keys.iter().flatten() {
            if let Some(r) = self.request_of(*key) {
                let r = self.find(r);
                request = Some(match request {
                    None => r,
                    Some(into) => self.union_requests(r, into),
                });
            }
        }
        if request.is_none() && keys.iter().any(Option::is_some) {
            request = Some(self.new_request());
        }
        let r = request?;
        for (n, key) in keys.iter().enumerate() {
            let Some(key) = key else { continue };
            if self.aliases.get(*key).is_some() {
                continue;
            }
            let text = if n == 0 {
                &ids.request_id
            } else {
                &ids.trace_id
            };
            let text = text.as_deref().unwrap_or("");
            if self.requests[r as usize].set_id(n == 1, text) {
                self.aliases.insert(*key, TAG_REQUEST | r);
            } else {
                // A second id of the same kind (e.g. a new trace under one x-request-id): a
                // stub request owns its alias, merged into this one.
                let stub = self.new_request();
                self.requests[stub as usize].set_id(n == 1, text);
                self.requests[stub as usize].last_ns = time_ns;
                self.aliases.insert(*key, TAG_REQUEST | stub);
                self.union_requests(stub, r);
            }
        }
        let req = &mut self.requests[r as usize];
        req.last_ns = req.last_ns.max(time_ns);
        Some(r)
    }

    fn request_of(&self, key: u64) -> Option<u32> {
        let v = self.aliases.get(key)?;
        (tag(v) == TAG_REQUEST).then_some(v & INDEX_MASK)
    }

    /// The tombstone sequence number an alias value names, if that tombstone still exists.
    /// Values keep 30 bits of it; tombstones are capped well below 2^30 and stale entries are
    /// purged every `tombs.len()` drops, so the window decides unambiguously.
    fn tomb_seq(&self, v: u32) -> Option<u64> {
        let d = (v & INDEX_MASK).wrapping_sub(self.tomb_base as u32) & INDEX_MASK;
        ((d as usize) < self.tombs.len()).then(|| self.tomb_base + d as u64)
    }

    fn lookup_attempt(&mut self, key: u64) -> Option<AttemptRef> {
        let v = self.aliases.get(key)?;
        match tag(v) {
            TAG_ATTEMPT => Some(AttemptRef::Live(v)),
            TAG_TOMB => match self.tomb_seq(v) {
                Some(seq) => Some(AttemptRef::Tomb(seq)),
                None => {
                    self.aliases.remove_if(key, v);
                    self.tomb_alias_stale = self.tomb_alias_stale.saturating_sub(1);
                    None
                }
            },
            _ => None,
        }
    }

    fn new_attempt(
        &mut self,
        room: Option<u64>,
        rid: Rid,
        room_key: Option<u64>,
        rid_key: Option<u64>,
    ) -> u32 {
        if self.live_attempts >= self.limits.max_attempts {
            self.evict_one_attempt();
        }
        let fresh = Attempt {
            generation: 0,
            request: NONE,
            request_epoch: 0,
            input_tokens: 0,
            room: room.unwrap_or(0),
            rid_hex: [0; 2],
            rid2_key: 0,
            last_ns: 0,
            due_ns: 0,
            fired: 0,
            worker_keys: [0; 4],
            legs_open: 0,
            legs_closed: 0,
            flags: LIVE | if room.is_some() { HAS_ROOM } else { 0 },
            slot_class: RowRef::NONE.class,
            slot_row: RowRef::NONE.index,
        };
        let i = match self.free_attempts.pop() {
            Some(i) => {
                let generation = self.attempts[i as usize].generation;
                self.attempts[i as usize] = Attempt {
                    generation,
                    ..fresh
                };
                // Its slot row was freed with it.
                i
            }
            None => self.attempts.push(fresh) as u32,
        };
        self.set_first_rid(i, rid);
        for k in [room_key, rid_key].into_iter().flatten() {
            self.aliases.insert(k, i);
        }
        self.live_attempts += 1;
        self.stats.attempts_created += 1;
        i
    }

    fn new_request(&mut self) -> u32 {
        let fresh = Request {
            generation: 0,
            parent: NONE,
            refs: 0,
            meta: REQ_LIVE,
            last_ns: 0,
            fired: 0,
            ids: None,
        };
        let i = match self.free_requests.pop() {
            Some(i) => {
                let generation = self.requests[i as usize].generation;
                self.requests[i as usize] = Request {
                    generation,
                    ..fresh
                };
                // Its slot row was cleared when it was freed.
                i
            }
            None => {
                self.request_slots.push(0);
                self.requests.push(fresh) as u32
            }
        };
        self.live_requests += 1;
        self.stats.requests_created += 1;
        i
    }

    /// Merges root `from` into root `into`: `from` becomes a forwarding stub.
    fn union_requests(&mut self, from: u32, into: u32) -> u32 {
        if from == into {
            return into;
        }
        // Cached roots may now be stubs.
        self.union_epoch += 1;
        if self.union_epoch == u32::MAX {
            for a in self.attempts.iter_mut() {
                a.request_epoch = 0;
            }
            self.union_epoch = 1;
        }
        let src = self.request_slots(from).to_vec();
        let mut dst = self.request_slots(into).to_vec();
        fold_all(&mut dst, &src, &self.request_keeps);
        let row = self.request_slots.item_mut(into as usize);
        row_store(row, &mut self.wide_requests, into, &dst);
        let (f, t) = (from as usize, into as usize);
        self.requests[f].parent = into;
        self.requests[t].refs += 1;
        self.requests[t].fired |= self.requests[f].fired;
        let fired = self.requests[f].fired;
        if fired != 0 {
            self.move_reported(Owner::Request(from), Owner::Request(into), fired);
        }
        // The merged request keeps the older pin when both have one (its alerts went out first).
        if let Some(p) = self.pinned_alias.remove(&from) {
            self.pinned_alias.entry(into).or_insert(p);
        }
        self.requests[t].last_ns = self.requests[t].last_ns.max(self.requests[f].last_ns);
        // The merged request shows the ids it lacks (the stub keeps owning their aliases).
        for trace in [false, true] {
            let from = &self.requests[f];
            let v = if trace {
                from.trace_id()
            } else {
                from.request_id()
            };
            if let Some(v) = v.map(str::to_owned) {
                self.requests[t].set_id(trace, &v);
            }
        }
        self.stats.requests_merged += 1;
        into
    }

    /// Two attempts turned out to be one (a rid first seen alone, then with its room).
    fn merge_attempts(&mut self, a: AttemptRef, b: AttemptRef) -> AttemptRef {
        let (AttemptRef::Live(x), AttemptRef::Live(y)) = (a, b) else {
            // A live attempt and a tombstone: keep the live one; the tombstone expires on its own.
            return if matches!(b, AttemptRef::Live(_)) {
                b
            } else {
                a
            };
        };
        let (rx, ry) = (
            self.attempts[x as usize].room(),
            self.attempts[y as usize].room(),
        );
        if rx.is_some() && ry.is_some() && rx != ry {
            self.stats.alias_conflicts += 1;
            return a; // `a` was found by the event's room: the room decides
        }
        let src = self.attempt_slots(y).to_vec();
        let mut dst = self.attempt_slots(x).to_vec();
        fold_all(&mut dst, &src, self.attempt_rows.keeps());
        let at = &mut self.attempts[x as usize];
        let mut r = at.row();
        self.attempt_rows.store(&mut r, x, &dst);
        at.set_row(r);
        let ya = self.attempts[y as usize].clone();
        let y_keys: Vec<u64> = self.attempt_keys(y).collect();
        let y_rid = self.attempt_rid(y);
        if !self.attempts[x as usize].has_rid() {
            self.set_first_rid(x, y_rid);
        }
        let xa = &mut self.attempts[x as usize];
        if let (None, Some(room)) = (xa.room(), ya.room()) {
            xa.set_room(room);
        }
        xa.last_ns = xa.last_ns.max(ya.last_ns);
        xa.input_tokens = xa.input_tokens.max(ya.input_tokens);
        xa.legs_open |= ya.legs_open;
        xa.legs_closed |= ya.legs_closed;
        xa.fired |= ya.fired;
        xa.due_ns = match (xa.due_ns, ya.due_ns) {
            (0, d) | (d, 0) => d,
            (p, q) => p.min(q),
        };
        if xa.request == NONE && ya.request != NONE {
            xa.request = ya.request;
            self.requests[ya.request as usize].refs += 1;
        }
        if let Some(r) = self.reasons.remove(&y) {
            self.reasons.entry(x).or_insert(r);
        }
        if ya.fired != 0 {
            self.move_reported(Owner::Attempt(y), Owner::Attempt(x), ya.fired);
        }
        self.free_attempt(y);
        for k in y_keys {
            self.aliases.insert(k, x);
            self.own_alias(x, k, true);
        }
        self.stats.attempts_merged += 1;
        a
    }

    /// The request of attempt `i` was not touched by its events (cached root): bring its idle
    /// time up to date before the attempt stops holding it.
    fn note_request_activity(&mut self, i: u32) {
        let at = &self.attempts[i as usize];
        if at.request != NONE {
            let last = at.last_ns;
            let root = self.find(at.request);
            let req = &mut self.requests[root as usize];
            req.last_ns = req.last_ns.max(last);
        }
    }

    /// Forgets live attempt `i` entirely (its aliases, its request reference).
    fn free_attempt(&mut self, i: u32) {
        self.note_request_activity(i);
        for k in self.attempt_keys(i) {
            self.aliases.remove_if(k, i);
        }
        let at = &self.attempts[i as usize];
        let request = at.request;
        let fired = at.fired;
        if request != NONE {
            self.requests[request as usize].refs -= 1;
        }
        if fired != 0 {
            self.drop_reported(Owner::Attempt(i), fired);
        }
        let at = &mut self.attempts[i as usize];
        if at.flags & RID_TEXT != 0 {
            self.rid_texts.remove(&i);
        }
        if at.flags & MORE_RIDS != 0 {
            self.more_rids.remove(&i);
        }
        at.flags = 0;
        at.rid2_key = 0;
        let mut r = at.row();
        self.attempt_rows.clear(&mut r, i);
        at.set_row(r);
        at.request = NONE;
        at.generation = at.generation.wrapping_add(1);
        self.reasons.remove(&i);
        self.free_attempts.push(i);
        self.live_attempts -= 1;
    }

    /// Shrinks live attempt `i` to a tombstone indexed by its primary alias (room, else rid).
    pub fn compact(&mut self, i: u32, watermark_ns: u64) {
        if self.tombs.len() >= self.limits.max_tombstones {
            self.pop_tomb();
            self.stats.tombstones_evicted_cap += 1;
        }
        let at = &self.attempts[i as usize];
        let key = at
            .room()
            .map(key_room)
            .or_else(|| self.attempt_rid(i).key());
        let expires_s = ((watermark_ns.saturating_add(self.limits.retention_ns)) / 1_000_000_000)
            .min(u32::MAX as u64) as u32
            + 1;
        let fired = at.fired;
        let tomb = Tombstone {
            request: at.request,
            expires_s,
            fired: compress_bits(self.tomb_rule_mask, fired),
            row_at: (self.tomb_words_base + self.tomb_slots.len() as u64) as u32,
        };
        let kept = self.attempt_slots(i);
        let mut buf = [Slot::EMPTY; SlotLayout::MAX];
        for (j, &k) in self.tomb_slot_map.iter().enumerate() {
            buf[j] = kept.get(k);
        }
        let n = self.tomb_slot_map.len();
        let seq = self.tomb_base + self.tombs.len() as u64;
        let mut row = [0u64; 1 + SlotLayout::MAX];
        let len = match sparse::encode(&buf[..n], &mut row) {
            Ok(len) => len,
            Err(packed::Unpackable) => {
                self.wide_tombs.insert(seq, buf[..n].into());
                row[0] = packed::WIDE;
                1
            }
        };
        for w in &row[..len] {
            self.tomb_slots.push_back(std::slice::from_ref(w));
        }
        self.tombs.push_back(&[tomb]);
        if fired != 0 {
            self.move_reported(Owner::Attempt(i), Owner::Tomb(seq), fired);
        }
        // The tombstone inherits the request reference: take it away before freeing.
        self.note_request_activity(i);
        self.attempts[i as usize].request = NONE;
        self.free_attempt(i);
        if let Some(key) = key {
            let val = TAG_TOMB | (seq as u32 & INDEX_MASK);
            if self
                .aliases
                .insert(key, val)
                .is_some_and(|old| tag(old) == TAG_TOMB)
            {
                self.tomb_alias_stale = self.tomb_alias_stale.saturating_sub(1);
            }
        }
    }

    fn pop_tomb(&mut self) {
        if self.tombs.is_empty() {
            return;
        }
        let t = *self.tomb(0);
        let words = if self.tombs.len() > 1 {
            self.tomb(1).row_at.wrapping_sub(t.row_at) as usize
        } else {
            self.tomb_slots.len()
        };
        if self.tomb_slots.item(0)[0] == packed::WIDE {
            self.wide_tombs.remove(&self.tomb_base);
        }
        self.tombs.pop_front();
        for _ in 0..words {
            self.tomb_slots.pop_front();
        }
        self.tomb_words_base += words as u64;
        if t.request != NONE {
            self.requests[t.request as usize].refs -= 1;
        }
        if t.fired != 0 {
            let fired = expand_bits(self.tomb_rule_mask, t.fired);
            self.drop_reported(Owner::Tomb(self.tomb_base), fired);
        }
        self.tomb_base += 1;
        self.tomb_alias_stale += 1;
        if self.tomb_alias_stale > 1024 && self.tomb_alias_stale > self.tombs.len() {
            let (base, len) = (self.tomb_base as u32, self.tombs.len());
            self.aliases.retain(|v| {
                tag(v) != TAG_TOMB
                    || (((v & INDEX_MASK).wrapping_sub(base) & INDEX_MASK) as usize) < len
            });
            self.tomb_alias_stale = 0;
        }
    }

    fn evict_one_attempt(&mut self) {
        let n = self.attempts.len();
        for _ in 0..n {
            let i = next_hand(&mut self.attempt_hand, n);
            if self.attempts[i].is_live() {
                let wm = self.attempts[i].last_ns;
                self.compact(i as u32, wm);
                self.stats.evicted_cap += 1;
                return;
            }
        }
    }

    /// Bounded housekeeping: examines up to `steps` attempts and requests, compacts what ended or
    /// idled, and drops expired tombstones and unreferenced requests.
    pub fn sweep(&mut self, watermark_ns: u64, steps: usize) {
        let wm_s = (watermark_ns / 1_000_000_000) as u32;
        while !self.tombs.is_empty() && self.tomb(0).expires_s <= wm_s {
            self.pop_tomb();
            self.stats.tombstones_expired += 1;
        }
        let n = self.attempts.len();
        for _ in 0..steps.min(n) {
            let i = next_hand(&mut self.attempt_hand, n);
            let at = &self.attempts[i];
            if !at.is_live() || (at.due_ns != 0 && at.due_ns > watermark_ns) {
                continue;
            }
            let idle = watermark_ns.saturating_sub(at.last_ns);
            if at.ended() && idle > self.limits.linger_ns {
                self.compact(i as u32, watermark_ns);
                self.stats.compacted_ended += 1;
            } else if idle > self.limits.attempt_ttl_ns {
                self.compact(i as u32, watermark_ns);
                self.stats.evicted_ttl += 1;
            }
        }
        let n = self.requests.len();
        for _ in 0..steps.min(n) {
            let i = next_hand(&mut self.request_hand, n);
            let r = &self.requests[i];
            if r.is_live()
                && r.refs == 0
                && watermark_ns.saturating_sub(r.last_ns) > self.limits.retention_ns
            {
                self.free_request(i as u32);
                self.stats.requests_expired += 1;
            }
        }
    }

    fn free_request(&mut self, i: u32) {
        let r = &self.requests[i as usize];
        let keys = [
            r.request_id().map(|s| key_str(AliasKind::RequestId, s)),
            r.trace_id().map(|s| key_str(AliasKind::TraceId, s)),
        ];
        for k in keys.into_iter().flatten() {
            self.aliases.remove_if(k, TAG_REQUEST | i);
        }
        let parent = r.parent;
        let fired = r.fired;
        if parent != NONE {
            self.requests[parent as usize].refs -= 1;
        }
        if fired != 0 {
            self.drop_reported(Owner::Request(i), fired);
        }
        self.pinned_alias.remove(&i);
        let row = self.request_slots.item_mut(i as usize);
        row_clear(row, &mut self.wide_requests, i);
        let r = &mut self.requests[i as usize];
        r.meta = 0;
        r.parent = NONE;
        r.ids = None;
        r.generation = r.generation.wrapping_add(1);
        self.free_requests.push(i);
        self.live_requests -= 1;
    }

    /// Heap bytes held by the tombstone tables (capacity-based: what is really reserved).
    pub fn tombstone_bytes(&self) -> usize {
        // The alias table is shared: tombstones are charged their share of its entries.
        let alias_share = if self.aliases.len() == 0 {
            0
        } else {
            self.aliases.capacity_bytes() * self.tombs.len().min(self.aliases.len())
                / self.aliases.len()
        };
        self.tombs.capacity_bytes() + self.tomb_slots.capacity_bytes() + alias_share
    }

    /// [`Self::table_bytes`] per table, for the memory benchmark's breakdown.
    pub fn table_breakdown(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("attempts", self.attempts.capacity_bytes()),
            ("attempt slots", self.attempt_rows.capacity_bytes()),
            ("alias table", self.aliases.capacity_bytes()),
            ("requests", self.requests.capacity_bytes()),
            ("request slots", self.request_slots.capacity_bytes()),
            ("tombstones", self.tombs.capacity_bytes()),
            ("tombstone slots", self.tomb_slots.capacity_bytes()),
        ]
    }

    /// Heap bytes held by the store's tables (capacity, not length), for memory accounting.
    pub fn table_bytes(&self) -> usize {
        self.attempts.capacity_bytes()
            + self.attempt_rows.capacity_bytes()
            + self.aliases.capacity_bytes()
            + self.requests.capacity_bytes()
            + self.request_slots.capacity_bytes()
            + self.tombs.capacity_bytes()
            + self.tomb_slots.capacity_bytes()
    }
}
