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

use crate::engine::state::{
    Cands, Keep, Slot, SlotLayout, Slots, fold_into, fold_specs_full, packed, sparse,
};
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
/// Keys are 64-bit hashes of (namespace, alias); values are a 2-bit tag plus a 30-bit index. A
/// bucket is 8 bytes: a 32-bit fingerprint of the key and the value. A fingerprint match is only
/// a candidate: the caller's `verify` asks the owner the value names whether it really has the
/// alias (its room, rid, id text, or the full key), so two keys of equal fingerprint live side by
/// side and each finds its own owner. Linear probing from a multiply-shift home of the
/// fingerprint (so any capacity works and growth is by a quarter, not doubling), backward-shift
/// deletion (no tombstone markers). One probe sequence answers "live attempt, tombstone or
/// nothing" for an event's room, instead of one probe per map.
mod alias {
    /// A key's fingerprint (0 = empty bucket) and the value it maps to.
    #[derive(Clone, Copy, Default)]
    struct Bucket {
        fp: u32,
        val: u32,
    }

    pub const TAG_ATTEMPT: u32 = 0;
    pub const TAG_TOMB: u32 = 1 << 30;
    pub const TAG_REQUEST: u32 = 2 << 30;
    /// A request without a record, kept by its only attempt (the index is the attempt's).
    pub const TAG_SOLO: u32 = 3 << 30;
    pub const INDEX_MASK: u32 = (1 << 30) - 1;
    const TAG_MASK: u32 = 3 << 30;

    pub fn tag(v: u32) -> u32 {
        v & TAG_MASK
    }

    /// The bucket fingerprint of a 64-bit key: its high half (never 0, which marks an empty
    /// bucket). The home bucket is derived from it as well, so resizing needs no key. Owners
    /// confirm candidates against the rest of the key: the low half or the alias itself.
    #[inline]
    pub fn fingerprint(key: u64) -> u32 {
        let f = (key >> 32) as u32;
        #[cfg(test)]
        let f = f & tests::FP_MASK.with(|m| m.get());
        f.max(1)
    }

    /// Growing by `GROWTH` when an insert would pass `MAX_LOAD` keeps the load between 0.62 (just
    /// after growing) and 0.77. Measured (callgrind, engine_profile): loads up to 0.85 cost ~7% more instructions per
    /// event than the old 0.53-0.8 (linear probing's unsuccessful probes grow as 1/(1-load)^2,
    /// and every new attempt makes several); 0.62-0.77 stays close. Growth by a fifth instead
    /// of a quarter rehashed 6 times the final size instead of 5, for little memory.
    const MAX_LOAD: (usize, usize) = (77, 100);
    const GROWTH: (usize, usize) = (5, 4);
    /// Below this load (after a peak) the table is rebuilt at `REBUILT_LOAD`.
    const SHRINK_LOAD: (usize, usize) = (2, 5);
    const REBUILT_LOAD: (usize, usize) = (7, 10);
    const MIN_BUCKETS: usize = 1024;

    #[derive(Default)]
    pub struct Table {
        buckets: Vec<Bucket>,
        len: usize,
    }

    impl Table {
        #[inline]
        fn home(&self, fp: u32) -> usize {
            ((fp as u64 * self.buckets.len() as u64) >> 32) as usize
        }

        pub fn len(&self) -> usize {
            self.len
        }

        pub fn capacity_bytes(&self) -> usize {
            self.buckets.capacity() * std::mem::size_of::<Bucket>()
        }

        /// The bucket of fingerprint `fp` whose value `accept` takes (`Ok`), or the empty bucket
        /// ending the probe run (`Err`). The table must have at least one empty bucket.
        #[inline]
        fn probe(&self, fp: u32, mut accept: impl FnMut(u32) -> bool) -> Result<usize, usize> {
            let n = self.buckets.len();
            let mut i = self.home(fp);
            loop {
                // SAFETY: `home` is below `n` (a 32-bit fingerprint times `n`, shifted right by
                // 32) and `i` wraps to 0 at `n`.
                let b = unsafe { *self.buckets.get_unchecked(i) };
                if b.fp == fp && accept(b.val) {
                    return Ok(i);
                }
                if b.fp == 0 {
                    return Err(i);
                }
                i += 1;
                if i == n {
                    i = 0;
                }
            }
        }

        /// The value of `key`. Keys are only fingerprinted, so a fingerprint match is a candidate:
        /// `verify` asks the owner a value names whether it really has this alias (a rejected
        /// candidate is another key's, and probing goes on).
        #[inline]
        pub fn find(&self, key: u64, verify: impl FnMut(u32) -> bool) -> Option<u32> {
            if self.buckets.is_empty() {
                return None;
            }
            self.probe(fingerprint(key), verify)
                .ok()
                .map(|i| self.buckets[i].val)
        }

        /// Points `key` at `val`: overwrites the candidate `verify` confirms as `key`'s (returning
        /// its old value), else adds an entry.
        pub fn insert(
            &mut self,
            key: u64,
            val: u32,
            verify: impl FnMut(u32) -> bool,
        ) -> Option<u32> {
            if (self.len + 1) * MAX_LOAD.1 > self.buckets.len() * MAX_LOAD.0 {
                self.resize(self.buckets.len() * GROWTH.0 / GROWTH.1);
            }
            let fp = fingerprint(key);
            match self.probe(fp, verify) {
                Ok(i) => Some(std::mem::replace(&mut self.buckets[i].val, val)),
                Err(i) => {
                    self.buckets[i] = Bucket { fp, val };
                    self.len += 1;
                    None
                }
            }
        }

        /// Removes one entry of `key`'s fingerprint whose value `which` picks; returns its value.
        /// Entries of equal fingerprint and value are interchangeable (verification asks the
        /// value's owner), so removing `(key, val)` by value is exact as long as the owner stops
        /// claiming the alias at the same time.
        pub fn remove(&mut self, key: u64, which: impl FnMut(u32) -> bool) -> Option<u32> {
            if self.buckets.is_empty() {
                return None;
            }
            let i = self.probe(fingerprint(key), which).ok()?;
            let val = self.buckets[i].val;
            self.delete(i);
            Some(val)
        }

        /// Removes one entry of `key` whose value is `val` (an alias re-pointed elsewhere stays).
        pub fn remove_if(&mut self, key: u64, val: u32) -> bool {
            self.remove(key, |v| v == val).is_some()
        }

        /// Backward-shift deletion of bucket `i`: later entries of the run move into the hole
        /// when their home is not between the hole and themselves (cyclically).
        fn delete(&mut self, i: usize) {
            let n = self.buckets.len();
            let mut hole = i;
            let mut j = i;
            loop {
                j += 1;
                if j == n {
                    j = 0;
                }
                let b = self.buckets[j];
                if b.fp == 0 {
                    break;
                }
                let h = self.home(b.fp);
                let movable = if hole <= j {
                    h <= hole || h > j
                } else {
                    h <= hole && h > j
                };
                if movable {
                    self.buckets[hole] = b;
                    hole = j;
                }
            }
            self.buckets[hole] = Bucket::default();
            self.len -= 1;
            // Give memory back after a peak (e.g. live attempts compacted).
            if self.buckets.len() > 4 * MIN_BUCKETS
                && self.len * SHRINK_LOAD.1 < self.buckets.len() * SHRINK_LOAD.0
            {
                self.resize(self.len * REBUILT_LOAD.1 / REBUILT_LOAD.0);
            }
        }

        /// Adds an entry known to be new (rebuilding: no verification needed).
        fn place(&mut self, b: Bucket) {
            let i = match self.probe(b.fp, |_| false) {
                Ok(i) | Err(i) => i,
            };
            self.buckets[i] = b;
            self.len += 1;
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
            let n = self.buckets.len();
            self.rebuild(n, |b| keep(b.val));
        }

        fn resize(&mut self, n: usize) {
            self.rebuild(n.max(MIN_BUCKETS), |_| true);
        }

        fn rebuild(&mut self, n: usize, mut keep: impl FnMut(&Bucket) -> bool) {
            let old = std::mem::replace(&mut self.buckets, Self::buckets(n));
            self.len = 0;
            for b in old {
                if b.fp != 0 && keep(&b) {
                    self.place(b);
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

        thread_local! {
            /// Fingerprints are masked with this in tests, to force collisions of real keys.
            pub static FP_MASK: std::cell::Cell<u32> = const { std::cell::Cell::new(u32::MAX) };
        }

        /// Runs `f` with fingerprints masked by `mask` on this thread (0: every key collides).
        pub fn with_fp_mask<R>(mask: u32, f: impl FnOnce() -> R) -> R {
            FP_MASK.with(|m| m.set(mask));
            let r = f();
            FP_MASK.with(|m| m.set(u32::MAX));
            r
        }

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
        fn equal_fingerprints_are_told_apart_through_growth_removal_and_retain() {
            use std::collections::HashMap;
            // Keys of a few high halves share fingerprint and home: long shared probe runs where
            // every candidate but one must be rejected by verification. Random keys mixed in.
            let mut rng = 1u64;
            let mut next = || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let mut keys = Vec::new();
            for i in 0..6_000u64 {
                let k = match i % 3 {
                    0 => next(),
                    // High halves 0 and 1 both get fingerprint 1.
                    1 => ((i / 3) % 2) << 32 | (i << 8),
                    _ => 0xdead_beef_0000_0000 | (i << 4),
                };
                keys.push(k);
            }
            // Owner records: value -> the key it has (what verification consults).
            let mut owner: HashMap<u32, u64> = HashMap::new();
            let mut t = Table::default();
            for (i, &k) in keys.iter().enumerate() {
                let v = i as u32;
                owner.insert(v, k);
                let own = owner.clone();
                assert_eq!(t.insert(k, v, |x| own.get(&x) == Some(&k)), None, "key {i}");
            }
            assert_eq!(t.len(), keys.len());
            let grown = t.capacity_bytes();
            assert!(
                grown >= keys.len() * 8 * MAX_LOAD.1 / MAX_LOAD.0,
                "load at most 0.77"
            );
            let find = |t: &Table, owner: &HashMap<u32, u64>, k: u64| {
                t.find(k, |x| owner.get(&x) == Some(&k))
            };
            for (i, &k) in keys.iter().enumerate() {
                assert_eq!(find(&t, &owner, k), Some(i as u32), "key {i}");
            }
            // Absent keys of a shared fingerprint find nothing (every candidate is rejected).
            for k in [1 << 32 | 7, 0xdead_beef_0000_0003, 5] {
                assert_eq!(find(&t, &owner, k), None);
            }
            // Overwrite: the confirmed entry changes value, no entry is added.
            for (i, &k) in keys.iter().enumerate().filter(|(i, _)| i % 5 == 0) {
                let (old, new) = (i as u32, (i + keys.len()) as u32);
                let own = owner.clone();
                assert_eq!(t.insert(k, new, |x| own.get(&x) == Some(&k)), Some(old));
                owner.remove(&old);
                owner.insert(new, k);
            }
            assert_eq!(t.len(), keys.len());
            // Remove two keys in three, by value; a wrong value removes nothing.
            let val_of = |owner: &HashMap<u32, u64>, i: usize| {
                let v = i as u32;
                if owner.contains_key(&v) {
                    v
                } else {
                    v + keys.len() as u32
                }
            };
            for (i, &k) in keys.iter().enumerate() {
                if i % 3 != 0 {
                    let v = val_of(&owner, i);
                    assert!(!t.remove_if(k, v ^ (1 << 29)));
                    assert!(t.remove_if(k, v), "key {i}");
                    owner.remove(&v);
                }
            }
            assert_eq!(t.len(), keys.len() / 3);
            assert!(t.capacity_bytes() < grown, "shrunk after removals");
            for (i, &k) in keys.iter().enumerate() {
                let want = (i % 3 == 0).then(|| val_of(&owner, i));
                assert_eq!(find(&t, &owner, k), want, "key {i}");
            }
            // Retain keeps exactly the entries asked for, each still found.
            t.retain(|v| v % 2 == 0);
            for (i, &k) in keys.iter().enumerate() {
                let v = val_of(&owner, i);
                let want = (i % 3 == 0 && v % 2 == 0).then_some(v);
                assert_eq!(find(&t, &owner, k), want, "key {i}");
            }
        }

        /// With every fingerprint forced equal, each alias still resolves to its own owner:
        /// verification rejects the colliding aliases of other attempts, tombstones and requests.
        #[test]
        fn verification_rejects_a_colliding_alias_of_another_owner() {
            use super::super::{AttemptRef, Ids, Limits, Store};
            use crate::event::BootstrapRoom;
            with_fp_mask(0, || {
                let limits = Limits {
                    max_attempts: 1 << 20,
                    max_tombstones: 1 << 20,
                    attempt_ttl_ns: u64::MAX,
                    linger_ns: u64::MAX,
                    retention_ns: 1_000_000_000_000,
                };
                let mut s = Store::new(limits, vec![], vec![], vec![], vec![], 0);
                let ids = |room: Option<u64>, rid: Option<&str>, req: Option<&str>| Ids {
                    request_id: req.map(Into::into),
                    trace_id: None,
                    rid: rid.map(Into::into),
                    bootstrap_room: room.map(BootstrapRoom),
                };
                let live = |r: super::super::Resolved| match r.attempt {
                    Some(AttemptRef::Live(i)) => i,
                    other => panic!("not live: {other:?}"),
                };
                let a = live(s.resolve_t(&ids(Some(1), None, Some("req-a")), 1));
                let b = live(s.resolve_t(&ids(Some(2), None, Some("req-b")), 2));
                assert_ne!(a, b);
                // First rids (hex and text), second rids, a rid-only attempt.
                let hex_a = "0123456789abcdef0123456789abcdef";
                assert_eq!(live(s.resolve_t(&ids(Some(1), Some(hex_a), None), 3)), a);
                assert_eq!(live(s.resolve_t(&ids(Some(2), Some("rid-b"), None), 4)), b);
                assert_eq!(live(s.resolve_t(&ids(Some(1), Some("rid-a2"), None), 5)), a);
                assert_eq!(live(s.resolve_t(&ids(Some(1), Some("rid-a3"), None), 5)), a);
                let c = live(s.resolve_t(&ids(None, Some("rid-c"), None), 6));
                assert!(c != a && c != b);
                for (rid, want) in [
                    (hex_a, a),
                    ("rid-b", b),
                    ("rid-a2", a),
                    ("rid-a3", a),
                    ("rid-c", c),
                ] {
                    assert_eq!(
                        live(s.resolve_t(&ids(None, Some(rid), None), 7)),
                        want,
                        "{rid}"
                    );
                }
                // Solo requests (kept by their attempts) answer to their own ids; a request-level
                // trigger gives each the record of the right attempt.
                assert!(s.resolve_t(&ids(None, None, Some("req-a")), 8).solo);
                let ra = s
                    .resolve(&ids(None, None, Some("req-a")), 8, true)
                    .request
                    .unwrap();
                let rb = s
                    .resolve(&ids(None, None, Some("req-b")), 8, true)
                    .request
                    .unwrap();
                assert_ne!(ra, rb);
                assert_eq!(s.request_record(a), Some(ra));
                assert_eq!(s.request_record(b), Some(rb));
                assert_eq!(s.requests[ra as usize].request_id(), Some("req-a"));
                // A new room and a new rid are new attempts, not a colliding neighbour.
                let d = live(s.resolve_t(&ids(Some(3), None, None), 9));
                let e = live(s.resolve_t(&ids(None, Some("rid-e"), None), 9));
                assert_eq!([a, b, c].iter().filter(|&&x| x == d || x == e).count(), 0);
                assert_ne!(d, e);
                // Tombstones: `a` compacted answers by its room; `b`, still live, by its own.
                s.compact(a, 10);
                assert!(matches!(
                    s.resolve_t(&ids(Some(1), None, None), 11).attempt,
                    Some(AttemptRef::Tomb(_))
                ));
                assert_eq!(live(s.resolve_t(&ids(Some(2), None, None), 11)), b);
                // Its rids left with it: a rid of `a` now makes a new attempt.
                let f = live(s.resolve_t(&ids(None, Some("rid-a2"), None), 12));
                assert!(![b, c, d, e].contains(&f));
                let entries = s.alias_entries();
                assert_eq!(live(s.resolve_t(&ids(None, Some("rid-a2"), None), 13)), f);
                assert_eq!(s.alias_entries(), entries);
            });
        }

        /// The whole engine gives the same verdicts and stats with 16 distinct fingerprints as
        /// with full ones: collisions cost probes, never a wrong attribution.
        #[test]
        fn verdicts_do_not_depend_on_fingerprint_collisions() {
            use crate::engine::check::{Checker, CheckerConfig, RuleSet};
            use crate::engine::workload::{Mix, stream};
            let mix = Mix {
                attempts: 3_000,
                reject_every: 10,
                ..Mix::default()
            };
            let mut events = stream(&mix);
            // Some rid events without their room: rid-first attempts and merges.
            for (n, e) in events.iter_mut().enumerate() {
                if e.ids.rid.is_some() && n % 3 == 0 {
                    e.ids.bootstrap_room = None;
                }
            }
            let run = || {
                let cfg = CheckerConfig {
                    retention: std::time::Duration::from_secs(1),
                    ..CheckerConfig::default()
                };
                let mut c = Checker::new(RuleSet::embedded_defaults(), cfg);
                let mut out = Vec::new();
                let mut last = 0;
                for e in &events {
                    out.extend(c.observe(e).iter().map(|v| format!("{v:?}")));
                    last = e.time_ns;
                }
                out.extend(
                    c.tick(last + 3_600_000_000_000)
                        .iter()
                        .map(|v| format!("{v:?}")),
                );
                (out, format!("{:?}", c.stats()), c.alias_entries())
            };
            let full = run();
            let collided = with_fp_mask(0xf000_0000, run);
            assert!(!full.0.is_empty(), "the mix has violations");
            assert_eq!(full, collided);
        }
    }
}

use alias::{INDEX_MASK, TAG_ATTEMPT, TAG_REQUEST, TAG_SOLO, TAG_TOMB, tag};

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
    pub input_tokens: u32,
    /// Its request: a record, known to be a union-find root as of an epoch (while no union
    /// happened since, the record need not be read: one cache miss per event); or the ids of a
    /// request whose only attempt this is and which needed no record yet (no request-level
    /// trigger, no second attempt, no violation): the request's aliases then point here
    /// (`TAG_SOLO`), and its request-scope slots are this attempt's own. Most requests never
    /// need more, and a record with its slots costs ~90 bytes.
    request: RequestLink,
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

/// A request's ids, the request id and the trace id, behind one 8-byte pointer.
///
/// Every request keeps them, including the single-attempt requests that live in their attempt
/// (see [`RequestLink`]): a `Box<str>` plus its split would take 20 bytes there. The heap
/// block is a 4-byte header (each id's length + 1, 0 for "absent") followed by both ids.
#[repr(transparent)]
pub struct ReqIds(std::ptr::NonNull<u8>);

// SAFETY: `ReqIds` owns its heap block exclusively, like a `Box<[u8]>`.
unsafe impl Send for ReqIds {}
// SAFETY: it has no interior mutability.
unsafe impl Sync for ReqIds {}

const IDS_HEADER: usize = 4;
/// The longest id kept (u16 length + 1 in the header); ids come from transports whose messages
/// are far smaller, so cutting only guards the encoding.
const ID_MAX: usize = u16::MAX as usize - 1;

impl ReqIds {
    pub fn new(request_id: Option<&str>, trace_id: Option<&str>) -> ReqIds {
        let cut = |s: &str| -> usize {
            let mut end = s.len().min(ID_MAX);
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            end
        };
        let (a, b) = (
            request_id.map(|s| &s[..cut(s)]),
            trace_id.map(|s| &s[..cut(s)]),
        );
        let len_field = |s: Option<&str>| s.map_or(0u16, |s| s.len() as u16 + 1);
        let (la, lb) = (a.map_or(0, str::len), b.map_or(0, str::len));
        let layout = Self::layout(la + lb);
        // SAFETY: the layout has a non-zero size (the header).
        let p = unsafe { std::alloc::alloc(layout) };
        let Some(p) = std::ptr::NonNull::new(p) else {
            std::alloc::handle_alloc_error(layout)
        };
        let mut head = [0u8; IDS_HEADER];
        head[..2].copy_from_slice(&len_field(a).to_le_bytes());
        head[2..].copy_from_slice(&len_field(b).to_le_bytes());
        // SAFETY: the block holds IDS_HEADER + la + lb bytes; the copies fill it exactly.
        unsafe {
            std::ptr::copy_nonoverlapping(head.as_ptr(), p.as_ptr(), IDS_HEADER);
            let body = p.as_ptr().add(IDS_HEADER);
            std::ptr::copy_nonoverlapping(a.unwrap_or("").as_ptr(), body, la);
            std::ptr::copy_nonoverlapping(b.unwrap_or("").as_ptr(), body.add(la), lb);
        }
        ReqIds(p)
    }

    fn layout(body: usize) -> std::alloc::Layout {
        // Aligned to 2 so that a pointer to it is even: see `RequestLink`.
        std::alloc::Layout::from_size_align(IDS_HEADER + body, 2).expect("ids are short")
    }

    /// The two length fields (length + 1, 0 = absent).
    fn fields(&self) -> (usize, usize) {
        // SAFETY: every block starts with the 4-byte header.
        let h = unsafe { std::slice::from_raw_parts(self.0.as_ptr(), IDS_HEADER) };
        (
            u16::from_le_bytes([h[0], h[1]]) as usize,
            u16::from_le_bytes([h[2], h[3]]) as usize,
        )
    }

    fn body_len(&self) -> usize {
        let (a, b) = self.fields();
        a.saturating_sub(1) + b.saturating_sub(1)
    }

    fn text(&self, from: usize, len: usize) -> &str {
        // SAFETY: the body holds the bytes of two `&str`s one after the other, and `from, len`
        // is one of them (cut at char boundaries when built), so this is valid UTF-8.
        unsafe {
            let p = self.0.as_ptr().add(IDS_HEADER + from);
            std::str::from_utf8_unchecked(std::slice::from_raw_parts(p, len))
        }
    }

    pub fn request_id(&self) -> Option<&str> {
        let (a, _) = self.fields();
        (a != 0).then(|| self.text(0, a - 1))
    }

    pub fn trace_id(&self) -> Option<&str> {
        let (a, b) = self.fields();
        (b != 0).then(|| self.text(a.saturating_sub(1), b - 1))
    }

    /// The id of one kind (`trace` false: the request id).
    pub fn get(&self, trace: bool) -> Option<&str> {
        if trace {
            self.trace_id()
        } else {
            self.request_id()
        }
    }

    /// These ids with the id of one kind set, if they have none of that kind.
    fn with(&self, trace: bool, v: &str) -> Option<ReqIds> {
        if self.get(trace).is_some() {
            return None;
        }
        Some(match trace {
            false => ReqIds::new(Some(v), self.trace_id()),
            true => ReqIds::new(self.request_id(), Some(v)),
        })
    }

    /// The alias keys of the ids present.
    fn keys(&self) -> impl Iterator<Item = u64> + use<> {
        [
            self.request_id().map(|s| key_str(AliasKind::RequestId, s)),
            self.trace_id().map(|s| key_str(AliasKind::TraceId, s)),
        ]
        .into_iter()
        .flatten()
    }
}

impl Drop for ReqIds {
    fn drop(&mut self) {
        let layout = Self::layout(self.body_len());
        // SAFETY: allocated in `new` with this very layout (the header records the lengths).
        unsafe { std::alloc::dealloc(self.0.as_ptr(), layout) }
    }
}

impl Clone for ReqIds {
    fn clone(&self) -> ReqIds {
        ReqIds::new(self.request_id(), self.trace_id())
    }
}

impl std::fmt::Debug for ReqIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReqIds")
            .field("request_id", &self.request_id())
            .field("trace_id", &self.trace_id())
            .finish()
    }
}

/// An attempt's request in one word: none, a record (its index, and the union epoch at which it
/// was known to be a root), or the ids of a solo request (see [`RequestLink`]). Every attempt
/// has one; as three fields it took 16 bytes.
///
/// Encoding: null for none; a [`ReqIds`] pointer (even: its block is 2-aligned) for solo; a
/// record is `index << 32 | epoch << 1 | 1` (no provenance: it is never dereferenced).
#[repr(transparent)]
pub struct RequestLink(*mut u8);

// SAFETY: a solo link owns its `ReqIds` exclusively (which is Send and Sync); the other forms
// are plain numbers.
unsafe impl Send for RequestLink {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for RequestLink {}

const _: () = assert!(
    std::mem::size_of::<usize>() == 8,
    "RequestLink packs a record index and epoch into a pointer-sized word"
);

/// Union epochs wrap below this (they take 31 bits of a [`RequestLink`]).
const EPOCH_LIMIT: u32 = 1 << 31;

impl RequestLink {
    pub const NONE: RequestLink = RequestLink(std::ptr::null_mut());

    fn record(r: u32, epoch: u32) -> RequestLink {
        debug_assert!(epoch < EPOCH_LIMIT);
        let bits = (r as usize) << 32 | ((epoch as usize) << 1) | 1;
        RequestLink(std::ptr::without_provenance_mut(bits))
    }

    fn solo(ids: ReqIds) -> RequestLink {
        RequestLink(std::mem::ManuallyDrop::new(ids).0.as_ptr())
    }

    fn bits(&self) -> usize {
        self.0.addr()
    }

    /// The record's index (`NONE` when there is no record).
    pub fn index(&self) -> u32 {
        match self.bits() & 1 {
            1 => (self.bits() >> 32) as u32,
            _ => NONE,
        }
    }

    /// The union epoch at which the record was known to be a root (0 when not a record).
    fn epoch(&self) -> u32 {
        match self.bits() & 1 {
            1 => ((self.bits() as u32) >> 1) & (EPOCH_LIMIT - 1),
            _ => 0,
        }
    }

    fn is_solo(&self) -> bool {
        self.bits() != 0 && self.bits() & 1 == 0
    }

    /// No request at all (neither a record nor a solo one).
    fn is_none(&self) -> bool {
        self.bits() == 0
    }

    fn solo_ids(&self) -> Option<&ReqIds> {
        // SAFETY: a solo link holds a live `ReqIds` pointer, and both types are
        // `repr(transparent)` over a pointer: the link can be read as the `ReqIds` it owns.
        self.is_solo()
            .then(|| unsafe { &*(self as *const RequestLink as *const ReqIds) })
    }

    fn take_solo(&mut self) -> Option<ReqIds> {
        if !self.is_solo() {
            return None;
        }
        let p = std::mem::replace(&mut self.0, std::ptr::null_mut());
        // SAFETY: a solo link's pointer came from `ReqIds::into` above and is non-null; the
        // link no longer holds it, so ownership moves back out exactly once.
        Some(ReqIds(unsafe { std::ptr::NonNull::new_unchecked(p) }))
    }
}

impl Drop for RequestLink {
    fn drop(&mut self) {
        drop(self.take_solo());
    }
}

impl Clone for RequestLink {
    fn clone(&self) -> RequestLink {
        match self.solo_ids() {
            Some(ids) => RequestLink::solo(ids.clone()),
            None => RequestLink(self.0),
        }
    }
}

impl std::fmt::Debug for RequestLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.solo_ids() {
            Some(ids) => f.debug_tuple("Solo").field(ids).finish(),
            None if self.bits() == 0 => f.write_str("None"),
            None => f
                .debug_struct("Record")
                .field("index", &self.index())
                .field("epoch", &self.epoch())
                .finish(),
        }
    }
}

/// A request record (40 bytes): its ids; its request-scope rule slots are in
/// [`Store::request_slots`]. It owns at most one request id and one trace id alias, so freeing
/// it removes every alias pointing at it; a second one of either kind gets a stub request merged
/// into this one. A request with a single attempt has no record until something needs one
/// (see [`RequestLink`]).
#[derive(Debug, Clone)]
pub struct Request {
    pub generation: u32,
    /// Union-find parent; `NONE` for a root.
    pub parent: u32,
    /// Attempts and tombstones that point here.
    pub refs: u32,
    live: bool,
    pub last_ns: u64,
    pub fired: u64,
    ids: Option<ReqIds>,
}

impl Request {
    pub fn is_live(&self) -> bool {
        self.live
    }
    pub fn request_id(&self) -> Option<&str> {
        self.ids.as_ref()?.request_id()
    }
    pub fn trace_id(&self) -> Option<&str> {
        self.ids.as_ref()?.trace_id()
    }
    /// Sets the request id (`trace` false) or trace id if it has none; false if it had one.
    fn set_id(&mut self, trace: bool, v: &str) -> bool {
        let next = match &self.ids {
            None if trace => ReqIds::new(None, Some(v)),
            None => ReqIds::new(Some(v), None),
            Some(ids) => match ids.with(trace, v) {
                Some(next) => next,
                None => return false,
            },
        };
        self.ids = Some(next);
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
    /// The low half of its primary alias's key (the alias table's fingerprint is the high
    /// half): how an alias entry naming this tombstone is verified.
    key_lo: u32,
}

/// What an alias is, so that the owner an alias entry names can confirm it has it (the table
/// keeps only a 32-bit fingerprint of the key).
#[derive(Clone, Copy)]
enum Name<'a> {
    Room(u64),
    Rid(&'a str),
    RequestId(&'a str),
    TraceId(&'a str),
    /// Only the key is known (keys recorded in attempts, re-pointed aliases).
    Key,
}

/// An alias: its 64-bit key (the hash of namespace and name) and, when known, the name itself.
#[derive(Clone, Copy)]
struct Alias<'a> {
    key: u64,
    name: Name<'a>,
}

impl<'a> Alias<'a> {
    fn room(room: u64) -> Alias<'a> {
        Alias {
            key: key_room(room),
            name: Name::Room(room),
        }
    }
    fn rid(rid: &'a str) -> Alias<'a> {
        Alias {
            key: key_str(AliasKind::Rid, rid),
            name: Name::Rid(rid),
        }
    }
    fn request_id(id: &'a str) -> Alias<'a> {
        Alias {
            key: key_str(AliasKind::RequestId, id),
            name: Name::RequestId(id),
        }
    }
    fn trace_id(id: &'a str) -> Alias<'a> {
        Alias {
            key: key_str(AliasKind::TraceId, id),
            name: Name::TraceId(id),
        }
    }
    fn key(key: u64) -> Alias<'a> {
        Alias {
            key,
            name: Name::Key,
        }
    }
}

/// The common verification hits, inline: a live attempt by its room, or by its second rid (a
/// decode leg's). Every event pays this once or twice; false sends the caller to
/// [`Owners::owns_slow`], which decides.
#[inline(always)]
fn owns_fast(attempts: &Chunked<Attempt>, v: u32, a: &Alias) -> bool {
    if tag(v) != TAG_ATTEMPT {
        return false;
    }
    let at = &attempts[v as usize];
    match a.name {
        Name::Room(r) => at.flags & (LIVE | HAS_ROOM) == LIVE | HAS_ROOM && at.room == r,
        Name::Rid(_) => at.flags & LIVE != 0 && at.rid2_key == a.key,
        _ => false,
    }
}

/// The records alias verification reads, borrowed apart from the alias table so that the table
/// can be probed mutably while owners are asked (see [`Store::aliases_and_owners`]).
struct Owners<'a> {
    attempts: &'a Chunked<Attempt>,
    rid_texts: &'a HashMap<u32, Box<str>, FixedState>,
    more_rids: &'a HashMap<u32, Vec<u64>, FixedState>,
    requests: &'a Chunked<Request>,
    tombs: &'a ChunkedQueue<Tombstone>,
    tomb_base: u64,
}

impl Owners<'_> {
    /// Whether the owner named by alias value `v` has alias `a`: the verification every
    /// fingerprint match goes through. A value of a tag with no arm in [`Self::owns_slow`] is
    /// never confirmed.
    #[inline(always)]
    fn owns(&self, v: u32, a: &Alias) -> bool {
        owns_fast(self.attempts, v, a) || self.owns_slow(v, a)
    }

    #[inline(never)]
    fn owns_slow(&self, v: u32, a: &Alias) -> bool {
        match tag(v) {
            TAG_ATTEMPT => self.attempt_owns(v, a),
            TAG_TOMB => self
                .tomb_index(v)
                .is_some_and(|i| self.tombs.item(i)[0].key_lo == a.key as u32),
            TAG_REQUEST => self.request_owns(v & INDEX_MASK, a),
            TAG_SOLO => self.solo_owns(v & INDEX_MASK, a),
            _ => false,
        }
    }

    /// Index into the tombstone queue of the tombstone an alias value names, if it still
    /// exists. Values keep 30 bits of its sequence number; tombstones are capped well below
    /// 2^30 and stale entries are purged every `tombs.len()` drops, so the window decides
    /// unambiguously (and verification checks the key besides).
    fn tomb_index(&self, v: u32) -> Option<usize> {
        let d = (v & INDEX_MASK).wrapping_sub(self.tomb_base as u32) & INDEX_MASK;
        ((d as usize) < self.tombs.len()).then_some(d as usize)
    }

    fn attempt_owns(&self, i: u32, a: &Alias) -> bool {
        let at = &self.attempts[i as usize];
        if !at.is_live() {
            return false;
        }
        // The common case first: the alias the lookup names is the attempt's room or first rid
        // (no hashing); keys recorded by hash are compared by hash.
        let named = match a.name {
            Name::Room(r) => at.room() == Some(r),
            Name::Rid(s) => at.rid2_key == a.key || self.rid_is_first(i, s),
            Name::RequestId(_) | Name::TraceId(_) => return false,
            Name::Key => {
                at.rid2_key == a.key
                    || at.room().map(key_room) == Some(a.key)
                    || self.first_rid_key(i) == Some(a.key)
            }
        };
        named
            || (at.flags & MORE_RIDS != 0
                && self.more_rids.get(&i).is_some_and(|m| m.contains(&a.key)))
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

    /// The alias key of attempt `a`'s first rid (no allocation).
    fn first_rid_key(&self, a: u32) -> Option<u64> {
        let at = &self.attempts[a as usize];
        if at.flags & RID_HEX != 0 {
            Rid::Hex(at.rid_hex).key()
        } else if at.flags & RID_TEXT != 0 {
            self.rid_texts.get(&a).map(|t| key_str(AliasKind::Rid, t))
        } else {
            None
        }
    }

    /// Whether live attempt `i` keeps a solo request named `a`.
    fn solo_owns(&self, i: u32, a: &Alias) -> bool {
        let at = &self.attempts[i as usize];
        match at.request.solo_ids().filter(|_| at.is_live()) {
            Some(ids) => ids_named(ids.request_id(), ids.trace_id(), a),
            None => false,
        }
    }

    fn request_owns(&self, r: u32, a: &Alias) -> bool {
        let req = &self.requests[r as usize];
        req.is_live() && ids_named(req.request_id(), req.trace_id(), a)
    }
}

/// Whether a request with these ids is named by alias `a` (texts compared, or keys by hash).
fn ids_named(request_id: Option<&str>, trace_id: Option<&str>, a: &Alias) -> bool {
    match a.name {
        Name::RequestId(s) => request_id == Some(s),
        Name::TraceId(s) => trace_id == Some(s),
        Name::Room(_) | Name::Rid(_) => false,
        Name::Key => {
            request_id.map(|s| key_str(AliasKind::RequestId, s)) == Some(a.key)
                || trace_id.map(|s| key_str(AliasKind::TraceId, s)) == Some(a.key)
        }
    }
}

#[cfg(test)]
impl Store {
    /// Resolves as for an event that triggers no request-scope rule.
    fn resolve_t(&mut self, ids: &Ids, time_ns: u64) -> Resolved {
        self.resolve(ids, time_ns, false)
    }
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

/// Where a request's state is: its record (a union-find root), or its only attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReqAt {
    Record(u32),
    Solo(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    pub attempt: Option<AttemptRef>,
    /// The request's record (its union-find root).
    pub request: Option<u32>,
    /// The attempt was (re)linked to a request by this event: request-scope state must be folded.
    pub linked: bool,
    /// This event showed two attempts to be one: the merged history must be judged again, even
    /// by rules the event itself does not match.
    pub merged: bool,
    /// The event's request has no record: its only attempt keeps it (see [`RequestLink`]).
    pub solo: bool,
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
    /// Requests given a record after living in their only attempt (see [`RequestLink`]).
    pub requests_materialized: u64,
    /// Records of requests taken over by their first attempt (made by a request-level event).
    pub requests_adopted: u64,
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

/// Whether tombstone alias value `v` names a tombstone still queued (`base`: the low bits of the
/// first one's sequence number; `len`: how many are queued).
fn tomb_alive(v: u32, base: u32, len: usize) -> bool {
    (((v & INDEX_MASK).wrapping_sub(base) & INDEX_MASK) as usize) < len
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
    fold_specs_full(slots, keeps, specs, slot)
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

/// [`Owners`] borrowed from a [`Store`] field by field (a method borrowing the whole store
/// could not be used while the alias table is borrowed mutably).
macro_rules! owners {
    ($store:expr) => {
        Owners {
            attempts: &$store.attempts,
            rid_texts: &$store.rid_texts,
            more_rids: &$store.more_rids,
            requests: &$store.requests,
            tombs: &$store.tombs,
            tomb_base: $store.tomb_base,
        }
    };
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
    /// (attempt spec, request spec) pairs: what an attempt linked to a request brings to it (its
    /// own latest forbidden events, for request-scope never-after rules).
    request_links: Vec<(usize, usize)>,
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
    /// Bumped by every request union (starts at 1; see [`RequestLink`]).
    union_epoch: u32,
    pub stats: CorrelateStats,
}

impl Store {
    pub fn new(
        limits: Limits,
        attempt_keeps: Vec<Keep>,
        request_keeps: Vec<Keep>,
        request_links: Vec<(usize, usize)>,
        tomb_slot_map: Vec<usize>,
        tomb_rule_mask: u64,
    ) -> Store {
        assert!(
            tomb_rule_mask.count_ones() as usize <= crate::engine::rules::MAX_TOMBSTONE_RULES,
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
            request_links,
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
    /// Live requests with a record (forwarding stubs of merged ones included).
    pub fn request_records(&self) -> usize {
        self.requests.len() - self.free_requests.len()
    }
    pub fn tombstones(&self) -> usize {
        self.tombs.len()
    }
    pub fn alias_entries(&self) -> usize {
        self.aliases.len()
    }

    /// The records alias verification reads.
    fn owners(&self) -> Owners<'_> {
        owners!(self)
    }

    /// The alias table and, borrowed apart from it, the records its verification reads.
    fn aliases_and_owners(&mut self) -> (&mut alias::Table, Owners<'_>) {
        (&mut self.aliases, owners!(self))
    }

    /// [`Owners::owns`] for lookups, which borrow the store whole: the common hits without
    /// building an [`Owners`] first.
    #[inline(always)]
    fn owns(&self, v: u32, a: &Alias) -> bool {
        owns_fast(&self.attempts, v, a) || self.owners().owns_slow(v, a)
    }

    /// The value of alias `a`, confirmed by the owner it names.
    #[inline]
    fn alias_get(&self, a: &Alias) -> Option<u32> {
        self.aliases.find(a.key, |v| self.owns(v, a))
    }

    /// Points alias `key` at `val`; returns the value it had (the entry an owner confirmed).
    /// Only fingerprint matches are verified, rarely more than one bucket, so the key alone is
    /// enough here (owners compare it by hash).
    fn alias_insert(&mut self, key: u64, val: u32) -> Option<u32> {
        let (table, owners) = self.aliases_and_owners();
        let a = Alias::key(key);
        table.insert(key, val, |v| owners.owns(v, &a))
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
        if maybe_first && self.owners().first_rid_key(a) == Some(key) {
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
            self.owners().first_rid_key(a),
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
    /// `request_trigger`: the event may trigger a request-scope rule, so a request it names
    /// without naming an attempt needs a record.
    pub fn resolve(&mut self, ids: &Ids, time_ns: u64, request_trigger: bool) -> Resolved {
        let (attempt, merged) = self.resolve_attempt(ids);
        let names = [
            ids.request_id.as_deref().map(Alias::request_id),
            ids.trace_id.as_deref().map(Alias::trace_id),
        ];
        let (request, linked) = if names.iter().all(Option::is_none) {
            (self.request_at(attempt, time_ns), false)
        } else {
            let (r, linked) = self.resolve_request(ids, names, attempt, time_ns, request_trigger);
            (Some(r), linked)
        };
        Resolved {
            attempt,
            request: match request {
                Some(ReqAt::Record(r)) => Some(r),
                _ => None,
            },
            solo: matches!(request, Some(ReqAt::Solo(_))),
            linked: merged || linked,
            merged,
        }
    }

    /// The live attempt or tombstone an event's room and rid name, created if new; true when two
    /// attempts turned out to be one (the merged history must reach the request).
    fn resolve_attempt(&mut self, ids: &Ids) -> (Option<AttemptRef>, bool) {
        let room_alias = ids.bootstrap_room.map(|r| Alias::room(r.0));
        let room_key = room_alias.map(|a| a.key);
        if room_key.is_none() && ids.rid.is_none() {
            return (None, false);
        }
        let by_room = room_alias.and_then(|a| self.lookup_attempt(&a));
        // Most events repeat the rid the attempt already has: skip the second table probe.
        let rid_known = match (by_room, ids.rid.as_deref()) {
            (Some(AttemptRef::Live(i)), Some(rid)) => self.owners().rid_is_first(i, rid),
            _ => false,
        };
        // Hashing the rid (32 bytes) is only needed when it is not the attempt's known one.
        let rid_alias = if rid_known {
            None
        } else {
            ids.rid.as_deref().map(Alias::rid)
        };
        let rid_key = rid_alias.map(|a| a.key);
        let by_rid = if rid_known {
            by_room
        } else {
            rid_alias.and_then(|a| self.lookup_attempt(&a))
        };
        // A merge brings the other attempt's history: request-scope state must be folded again.
        let merged = matches!((by_room, by_rid), (Some(a), Some(b)) if a != b);
        let attempt = match (by_room, by_rid) {
            (Some(a), Some(b)) if a == b => a,
            (Some(a), Some(b)) => self.merge_attempts(a, b),
            (Some(a), None) => {
                if let (Some(k), AttemptRef::Live(i)) = (rid_key, a) {
                    self.alias_insert(k, i);
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
                        self.alias_insert(key_room(room.0), i);
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

        (Some(attempt), merged)
    }

    /// The request of an event's attempt, for an event naming no request.
    fn request_at(&mut self, attempt: Option<AttemptRef>, time_ns: u64) -> Option<ReqAt> {
        match attempt {
            Some(AttemptRef::Live(i)) if self.attempts[i as usize].request.is_solo() => {
                Some(ReqAt::Solo(i))
            }
            _ => self.current_request(attempt, time_ns).map(ReqAt::Record),
        }
    }

    /// The request record of an event's attempt, for an event naming no request: its union-find
    /// root, or `None` when the attempt has no request or keeps it solo.
    fn current_request(&mut self, attempt: Option<AttemptRef>, time_ns: u64) -> Option<u32> {
        let root = match attempt? {
            AttemptRef::Live(i) => {
                let at = &self.attempts[i as usize];
                let cur = at.request.index();
                if cur == NONE {
                    return None;
                }
                // Events of a live attempt whose request is a known root skip the request
                // record: its idle time is brought up to date when the attempt leaves
                // (`note_request_activity`).
                if at.request.epoch() == self.union_epoch {
                    return Some(cur);
                }
                let root = self.find(cur);
                if root != cur {
                    // Point the attempt at the root; its reference follows.
                    self.requests[cur as usize].refs -= 1;
                    self.requests[root as usize].refs += 1;
                }
                self.attempts[i as usize].request = RequestLink::record(root, self.union_epoch);
                root
            }
            AttemptRef::Tomb(seq) => {
                let cur = self.tomb_index(seq).map_or(NONE, |t| self.tomb(t).request);
                if cur == NONE {
                    return None;
                }
                self.find(cur)
            }
        };
        let req = &mut self.requests[root as usize];
        req.last_ns = req.last_ns.max(time_ns);
        Some(root)
    }

    /// The request an event's request id / trace id (`names`) name, with the event's attempt:
    /// found, linked to the attempt, merged with the attempt's own when they differ, or created
    /// (kept solo in the attempt when there is a live one). Returns the request and whether an
    /// attempt was newly linked to a record.
    fn resolve_request(
        &mut self,
        ids: &Ids,
        names: [Option<Alias>; 2],
        attempt: Option<AttemptRef>,
        time_ns: u64,
        request_trigger: bool,
    ) -> (ReqAt, bool) {
        let cur = self.request_at(attempt, time_ns);
        let mut found = None;
        let mut known = [false; 2];
        // Each alias is looked up once.
        for (n, name) in names.iter().enumerate() {
            let Some(v) = name.and_then(|a| self.alias_get(&a)) else {
                continue;
            };
            known[n] = true;
            let named = match tag(v) {
                TAG_REQUEST => ReqAt::Record(self.find(v & INDEX_MASK)),
                TAG_SOLO => ReqAt::Solo(v & INDEX_MASK),
                _ => continue,
            };
            found = Some(match found {
                None => named,
                Some(into) => self.join(named, into),
            });
        }
        let mut linked = false;
        let mut target = match (cur, found) {
            (Some(c), Some(f)) if c == f => c,
            (Some(c), Some(f)) => {
                linked = true;
                self.join(c, f)
            }
            (Some(c), None) => c,
            (None, Some(f)) => match (attempt, f) {
                // The router's own events about a solo request (its answer to the client): the
                // request is no less alive, and nothing else needs a record.
                (None, ReqAt::Solo(i)) if !request_trigger => {
                    let at = &mut self.attempts[i as usize];
                    at.last_ns = at.last_ns.max(time_ns);
                    f
                }
                // The router dispatching a request it received (a request-level event, which
                // made a record): its first attempt takes the request over, solo.
                (Some(AttemptRef::Live(i)), ReqAt::Record(r)) if self.bare(r) => {
                    self.adopt(i, r);
                    ReqAt::Solo(i)
                }
                _ => {
                    let r = self.record(f);
                    linked = self.link(attempt, r);
                    ReqAt::Record(r)
                }
            },
            (None, None) => {
                self.stats.requests_created += 1;
                self.live_requests += 1;
                match attempt {
                    Some(AttemptRef::Live(i)) => {
                        // The usual first sight of a request: its router dispatch, naming the
                        // attempt's room. It stays in the attempt until something needs more.
                        let request_id = ids.request_id.as_deref().filter(|_| !known[0]);
                        let trace_id = ids.trace_id.as_deref().filter(|_| !known[1]);
                        let solo = ReqIds::new(request_id, trace_id);
                        let keys = solo.keys();
                        self.attempts[i as usize].request = RequestLink::solo(solo);
                        for key in keys {
                            self.alias_insert(key, TAG_SOLO | i);
                        }
                        known = [true; 2];
                        ReqAt::Solo(i)
                    }
                    _ => {
                        let r = self.new_request_record();
                        linked = self.link(attempt, r);
                        ReqAt::Record(r)
                    }
                }
            }
        };
        for (n, name) in names.iter().enumerate() {
            let Some(key) = name.map(|a| a.key) else {
                continue;
            };
            if known[n] {
                continue;
            }
            let text = if n == 0 {
                &ids.request_id
            } else {
                &ids.trace_id
            };
            target = self.add_id(target, n == 1, key, text.as_deref().unwrap_or(""), time_ns);
        }
        if let ReqAt::Record(r) = target {
            let req = &mut self.requests[r as usize];
            req.last_ns = req.last_ns.max(time_ns);
        }
        (target, linked)
    }

    /// Whether record `r` holds nothing a solo request could not: no attempt or tombstone, no
    /// merged request, no slots, nothing fired or pinned. A request-level event made it.
    fn bare(&self, r: u32) -> bool {
        let q = &self.requests[r as usize];
        q.refs == 0
            && q.parent == NONE
            && q.fired == 0
            && self.request_slots.item(r as usize).iter().all(|&w| w == 0)
            && !self.pinned_alias.contains_key(&r)
    }

    /// Live attempt `i` (without a request) takes bare record `r` over as its solo request.
    fn adopt(&mut self, i: u32, r: u32) {
        // Re-pointed while the record still has the ids: an overwrite asks the old owner.
        let keys = self.requests[r as usize].ids.as_ref().map(ReqIds::keys);
        for key in keys.into_iter().flatten() {
            self.alias_insert(key, TAG_SOLO | i);
        }
        let req = &mut self.requests[r as usize];
        let ids = req.ids.take().unwrap_or_else(|| ReqIds::new(None, None));
        let last = req.last_ns;
        // Still the same live request: only its record goes.
        self.free_request(r);
        self.live_requests += 1;
        let at = &mut self.attempts[i as usize];
        at.request = RequestLink::solo(ids);
        at.last_ns = at.last_ns.max(last);
        self.stats.requests_adopted += 1;
    }

    /// Gives request `to` an id it was not known by (alias `key`). A second id of one kind (e.g.
    /// a new trace under one x-request-id) gets a stub record owning its alias, merged into it.
    fn add_id(&mut self, to: ReqAt, trace: bool, key: u64, text: &str, time_ns: u64) -> ReqAt {
        let r = match to {
            ReqAt::Solo(i) => {
                let solo = self.attempts[i as usize].request.solo_ids().expect("solo");
                match solo.with(trace, text) {
                    Some(next) => {
                        self.attempts[i as usize].request = RequestLink::solo(next);
                        self.alias_insert(key, TAG_SOLO | i);
                        return to;
                    }
                    None => self.materialize(i),
                }
            }
            ReqAt::Record(r) => r,
        };
        if self.requests[r as usize].set_id(trace, text) {
            self.alias_insert(key, TAG_REQUEST | r);
        } else {
            let stub = self.new_request();
            self.requests[stub as usize].set_id(trace, text);
            self.requests[stub as usize].last_ns = time_ns;
            self.alias_insert(key, TAG_REQUEST | stub);
            self.union_requests(stub, r);
        }
        ReqAt::Record(r)
    }

    /// One request from two (the event names both): their records, merged.
    fn join(&mut self, from: ReqAt, into: ReqAt) -> ReqAt {
        if from == into {
            return into;
        }
        let (from, into) = (self.record(from), self.record(into));
        ReqAt::Record(self.union_requests(from, into))
    }

    /// The record of a request (its union-find root), created for a solo one.
    fn record(&mut self, at: ReqAt) -> u32 {
        match at {
            ReqAt::Solo(i) => self.materialize(i),
            ReqAt::Record(r) => self.find(r),
        }
    }

    /// Points an attempt without a request at record `r`; true if there was one to point.
    fn link(&mut self, attempt: Option<AttemptRef>, r: u32) -> bool {
        match attempt {
            Some(AttemptRef::Live(i)) => {
                let at = &mut self.attempts[i as usize];
                at.request = RequestLink::record(r, self.union_epoch);
            }
            Some(AttemptRef::Tomb(seq)) => match self.tomb_index(seq) {
                Some(t) => self.tomb_mut(t).request = r,
                None => return false,
            },
            None => return false,
        }
        self.requests[r as usize].refs += 1;
        true
    }

    /// The record of attempt `a`'s request (its root), created if the request is solo; `None`
    /// when the attempt has no request. For what needs a record: a request-level trigger, a
    /// violation naming the request.
    pub fn request_record(&mut self, a: u32) -> Option<u32> {
        let at = &self.attempts[a as usize];
        if at.request.is_solo() {
            return Some(self.materialize(a));
        }
        match at.request.index() {
            NONE => None,
            r => Some(self.find(r)),
        }
    }

    /// Takes attempt `i`'s solo request ids, its aliases pointed at `to` first: an overwrite asks
    /// the old owner, so they move while the attempt still has the ids.
    fn take_solo(&mut self, i: u32, to: u32) -> ReqIds {
        let keys = self.attempts[i as usize]
            .request
            .solo_ids()
            .expect("a solo request")
            .keys();
        for key in keys {
            self.alias_insert(key, to);
        }
        self.attempts[i as usize]
            .request
            .take_solo()
            .expect("a solo request")
    }

    /// Gives attempt `i`'s solo request a record: its aliases move there, and the attempt's
    /// history is folded into the record's request-scope slots, as linking the attempt would.
    fn materialize(&mut self, i: u32) -> u32 {
        let r = self.new_request_record();
        let ids = self.take_solo(i, TAG_REQUEST | r);
        let at = &mut self.attempts[i as usize];
        at.request = RequestLink::record(r, self.union_epoch);
        let last = at.last_ns;
        let req = &mut self.requests[r as usize];
        req.ids = Some(ids);
        req.refs = 1;
        req.last_ns = last;
        for n in 0..self.request_links.len() {
            let (from, to) = self.request_links[n];
            let own = Cands::of(
                &self.attempt_slots(i),
                from,
                self.attempt_rows.keeps()[from],
            );
            for &slot in own.iter() {
                self.fold_request_slots(r, 1 << to, slot);
            }
        }
        self.stats.requests_materialized += 1;
        r
    }

    /// The live attempt or tombstone alias `a` names. Entries of dropped tombstones met on the
    /// way (they fail verification) are removed.
    fn lookup_attempt(&mut self, a: &Alias) -> Option<AttemptRef> {
        let mut stale = false;
        let found = self.aliases.find(a.key, |v| {
            self.owns(v, a) || {
                stale |= tag(v) == TAG_TOMB && self.owners().tomb_index(v).is_none();
                false
            }
        });
        match found {
            Some(v) if tag(v) == TAG_ATTEMPT => Some(AttemptRef::Live(v)),
            Some(v) if tag(v) == TAG_TOMB => {
                let i = self.owners().tomb_index(v).expect("verified");
                Some(AttemptRef::Tomb(self.tomb_base + i as u64))
            }
            Some(_) => None,
            None => {
                if stale {
                    let (base, len) = (self.tomb_base as u32, self.tombs.len());
                    while self
                        .aliases
                        .remove(a.key, |v| tag(v) == TAG_TOMB && !tomb_alive(v, base, len))
                        .is_some()
                    {
                        self.tomb_alias_stale = self.tomb_alias_stale.saturating_sub(1);
                    }
                }
                None
            }
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
            request: RequestLink::NONE,
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
            self.alias_insert(k, i);
        }
        self.live_attempts += 1;
        self.stats.attempts_created += 1;
        i
    }

    /// A new request with a record from the start (request-level events, stubs).
    fn new_request(&mut self) -> u32 {
        self.live_requests += 1;
        self.stats.requests_created += 1;
        self.new_request_record()
    }

    /// A record for a request already counted (created solo, or just now by `new_request`).
    fn new_request_record(&mut self) -> u32 {
        let fresh = Request {
            generation: 0,
            parent: NONE,
            refs: 0,
            live: true,
            last_ns: 0,
            fired: 0,
            ids: None,
        };
        match self.free_requests.pop() {
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
        }
    }

    /// Merges root `from` into root `into`: `from` becomes a forwarding stub.
    fn union_requests(&mut self, from: u32, into: u32) -> u32 {
        if from == into {
            return into;
        }
        // Cached roots may now be stubs.
        self.union_epoch += 1;
        if self.union_epoch == EPOCH_LIMIT {
            for a in self.attempts.iter_mut() {
                if a.request.index() != NONE {
                    a.request = RequestLink::record(a.request.index(), 0);
                }
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
        if self.attempts[y as usize].request.is_solo() {
            let xa = &self.attempts[x as usize];
            if xa.request.is_none() {
                // `x` takes over `y`'s request, still solo.
                let ids = self.take_solo(y, TAG_SOLO | x);
                self.attempts[x as usize].request = RequestLink::solo(ids);
            } else {
                self.materialize(y);
            }
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
        if xa.request.index() == NONE && ya.request.index() != NONE {
            xa.request = RequestLink::record(ya.request.index(), 0);
            self.requests[ya.request.index() as usize].refs += 1;
        }
        if let Some(r) = self.reasons.remove(&y) {
            self.reasons.entry(x).or_insert(r);
        }
        if ya.fired != 0 {
            self.move_reported(Owner::Attempt(y), Owner::Attempt(x), ya.fired);
        }
        self.free_attempt(y);
        for k in y_keys {
            self.alias_insert(k, x);
            self.own_alias(x, k, true);
        }
        self.stats.attempts_merged += 1;
        a
    }

    /// The request of attempt `i` was not touched by its events (cached root): bring its idle
    /// time up to date before the attempt stops holding it.
    fn note_request_activity(&mut self, i: u32) {
        let at = &self.attempts[i as usize];
        if at.request.index() != NONE {
            let last = at.last_ns;
            let root = self.find(at.request.index());
            let req = &mut self.requests[root as usize];
            req.last_ns = req.last_ns.max(last);
        }
    }

    /// Forgets live attempt `i` entirely (its aliases, its request reference).
    fn free_attempt(&mut self, i: u32) {
        if self.attempts[i as usize].request.is_solo() {
            // The request outlives the attempt (retention): it needs a record.
            self.materialize(i);
        }
        self.note_request_activity(i);
        for k in self.attempt_keys(i) {
            self.aliases.remove_if(k, i);
        }
        let at = &self.attempts[i as usize];
        let request = at.request.index();
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
        at.request = RequestLink::NONE;
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
        if self.attempts[i as usize].request.is_solo() {
            // The tombstone keeps the request for late activity: it needs a record.
            self.materialize(i);
        }
        let at = &self.attempts[i as usize];
        let key = at
            .room()
            .map(key_room)
            .or_else(|| self.owners().first_rid_key(i));
        let expires_s = ((watermark_ns.saturating_add(self.limits.retention_ns)) / 1_000_000_000)
            .min(u32::MAX as u64) as u32
            + 1;
        let fired = at.fired;
        let tomb = Tombstone {
            request: at.request.index(),
            expires_s,
            fired: compress_bits(self.tomb_rule_mask, fired),
            row_at: (self.tomb_words_base + self.tomb_slots.len() as u64) as u32,
            key_lo: key.unwrap_or(0) as u32,
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
        self.attempts[i as usize].request = RequestLink::NONE;
        self.free_attempt(i);
        if let Some(key) = key {
            let val = TAG_TOMB | (seq as u32 & INDEX_MASK);
            if self
                .alias_insert(key, val)
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
            self.aliases
                .retain(|v| tag(v) != TAG_TOMB || tomb_alive(v, base, len));
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
        r.live = false;
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

#[cfg(test)]
mod request_tests {
    use super::*;
    use crate::event::{BootstrapRoom, Kind, LifecycleEvent, Source, Stage};

    fn store() -> Store {
        let limits = Limits {
            max_attempts: 1000,
            max_tombstones: 1000,
            attempt_ttl_ns: 60_000_000_000,
            linger_ns: 1_000_000_000,
            retention_ns: 600_000_000_000,
        };
        // One attempt spec linked to one request spec, as a request-scope rule has them.
        Store::new(
            limits,
            vec![Keep::Latest],
            vec![Keep::Latest],
            vec![(0, 0)],
            Vec::new(),
            0,
        )
    }

    fn ids(request_id: Option<&str>, trace_id: Option<&str>, room: Option<u64>) -> Ids {
        Ids {
            request_id: request_id.map(Into::into),
            trace_id: trace_id.map(Into::into),
            rid: None,
            bootstrap_room: room.map(BootstrapRoom),
        }
    }

    fn live(r: &Resolved) -> u32 {
        match r.attempt {
            Some(AttemptRef::Live(a)) => a,
            other => panic!("not a live attempt: {other:?}"),
        }
    }

    #[test]
    fn request_ids_round_trip_behind_one_pointer() {
        assert_eq!(std::mem::size_of::<Option<ReqIds>>(), 8);
        for (id, trace) in [
            (None, None),
            (Some("req-1"), None),
            (None, Some("4bf92f3577b34da6a3ce929d0e0e4736")),
            (Some(""), Some("")),
            (Some("réq-ü"), Some("t")),
        ] {
            let ids = ReqIds::new(id, trace);
            assert_eq!((ids.request_id(), ids.trace_id()), (id, trace));
            let copy = ids.clone();
            assert_eq!((copy.request_id(), copy.trace_id()), (id, trace));
            assert_eq!(ids.keys().count(), id.iter().count() + trace.iter().count());
        }
        let with = ReqIds::new(Some("a"), None).with(true, "t").unwrap();
        assert_eq!((with.request_id(), with.trace_id()), (Some("a"), Some("t")));
        assert!(
            with.with(false, "b").is_none(),
            "a second request id is refused"
        );
        // Overlong ids are cut at a char boundary, never mid-character.
        let long = "é".repeat(40_000);
        let ids = ReqIds::new(Some(&long), Some("t"));
        let kept = ids.request_id().unwrap();
        assert!(kept.len() <= ID_MAX && long.starts_with(kept));
        assert_eq!(ids.trace_id(), Some("t"));
    }

    #[test]
    fn request_links_hold_a_record_or_solo_ids_in_one_word() {
        assert_eq!(std::mem::size_of::<RequestLink>(), 8);
        let none = RequestLink::NONE;
        assert_eq!(
            (none.index(), none.epoch(), none.is_solo()),
            (NONE, 0, false)
        );
        for (r, epoch) in [
            (0, 0),
            (7, 1),
            (NONE - 1, EPOCH_LIMIT - 1),
            (1 << 29, 12345),
        ] {
            let l = RequestLink::record(r, epoch);
            assert_eq!((l.index(), l.epoch(), l.is_solo()), (r, epoch, false));
            assert!(l.solo_ids().is_none());
            let c = l.clone();
            assert_eq!((c.index(), c.epoch()), (r, epoch));
        }
        let mut l = RequestLink::solo(ReqIds::new(Some("q"), Some("t")));
        assert!(l.is_solo());
        assert_eq!((l.index(), l.epoch()), (NONE, 0));
        let c = l.clone();
        assert_eq!(c.solo_ids().unwrap().request_id(), Some("q"));
        drop(c);
        let ids = l.take_solo().unwrap();
        assert_eq!(ids.trace_id(), Some("t"));
        assert!(!l.is_solo() && l.take_solo().is_none());
        // Overwriting a solo link frees its ids (a leak would show in the state_size bench's
        // counting allocator).
        let mut l = RequestLink::solo(ids);
        assert!(l.is_solo());
        l = RequestLink::record(3, 4);
        assert_eq!(l.index(), 3);
    }

    #[test]
    fn a_single_attempt_request_has_no_record_until_something_needs_one() {
        let mut s = store();
        let first = s.resolve_t(&ids(Some("req-1"), None, Some(1)), 1_000);
        let a = live(&first);
        assert_eq!(first.request, None, "kept solo in its attempt");
        assert_eq!((s.live_requests(), s.requests.len()), (1, 0));
        // More events of the attempt, and the request id again with its room: still solo.
        for t in [2_000, 3_000] {
            assert_eq!(s.resolve_t(&ids(None, None, Some(1)), t).request, None);
        }
        assert_eq!(
            s.resolve_t(&ids(Some("req-1"), None, Some(1)), 4_000)
                .request,
            None
        );
        // A trace id for it is one more alias of the same solo request.
        assert_eq!(
            s.resolve_t(&ids(None, Some("tr"), Some(1)), 4_500).request,
            None
        );
        // The checker keeps the attempt's latest event in its slot (here, by hand).
        let work = LifecycleEvent::new(4_500, Stage::Decode, Kind::Work, Source::Ebpf);
        s.fold_attempt_slots(a, 1, Slot::from_event(&work, 0));
        assert_eq!(s.requests.len(), 0);

        // A retry: a new room under the same request id. Both attempts now share one record,
        // which has both ids.
        let retry = s.resolve_t(&ids(Some("req-1"), None, Some(2)), 5_000);
        let b = live(&retry);
        let r = retry.request.expect("a record now");
        assert!(
            retry.linked,
            "the new attempt's history must reach the request"
        );
        assert_eq!(s.stats.requests_materialized, 1);
        assert_eq!(s.request_record(a), Some(r));
        assert_eq!(s.request_record(b), Some(r));
        let req = &s.requests[r as usize];
        assert_eq!(
            (req.request_id(), req.trace_id()),
            (Some("req-1"), Some("tr"))
        );
        assert_eq!((req.refs, s.live_requests()), (2, 1));
        // The first attempt's latest event (time 4 500) reached the record's slot.
        assert_eq!(s.request_slots(r).get(0).time(), 4_500);
        // Either id leads to the record.
        assert_eq!(
            s.resolve_t(&ids(None, Some("tr"), None), 6_000).request,
            Some(r)
        );
        assert_eq!(
            s.resolve_t(&ids(Some("req-1"), None, None), 6_000).request,
            Some(r)
        );
    }

    #[test]
    fn request_level_events_compaction_and_second_ids_give_solo_requests_a_record() {
        let mut s = store();
        // A request-level event (the router's answer, request id only) that is no trigger leaves
        // the request solo; one that may trigger a request-scope rule gives it a record.
        let a = live(&s.resolve_t(&ids(Some("q1"), None, Some(10)), 1_000));
        let answer = s.resolve_t(&ids(Some("q1"), None, None), 2_000);
        assert_eq!(
            (answer.attempt, answer.request, answer.solo),
            (None, None, true)
        );
        assert_eq!(
            s.attempts[a as usize].last_ns, 2_000,
            "the request is active"
        );
        let r = s.resolve(&ids(Some("q1"), None, None), 2_500, true).request;
        assert!(r.is_some());
        assert_eq!(r, s.request_record(a));

        // Compaction: the tombstone keeps a record of the request.
        let b = live(&s.resolve_t(&ids(Some("q2"), None, Some(20)), 1_000));
        s.compact(b, 10_000);
        let t = match s.resolve_t(&ids(None, None, Some(20)), 11_000) {
            Resolved {
                attempt: Some(AttemptRef::Tomb(seq)),
                request: Some(r),
                ..
            } => (seq, r),
            other => panic!("{other:?}"),
        };
        assert_eq!(s.requests[t.1 as usize].request_id(), Some("q2"));
        assert_eq!(
            s.resolve_t(&ids(Some("q2"), None, None), 12_000).request,
            Some(t.1)
        );

        // A second trace id on a solo request: a stub record merged into the request's.
        let c = live(&s.resolve_t(&ids(None, Some("t1"), Some(30)), 1_000));
        let r = s
            .resolve_t(&ids(None, Some("t2"), Some(30)), 2_000)
            .request
            .expect("a record");
        assert_eq!(s.request_record(c), Some(r));
        assert_eq!(s.requests[r as usize].trace_id(), Some("t1"));
        assert_eq!(
            s.resolve_t(&ids(None, Some("t2"), None), 3_000).request,
            Some(r)
        );
        assert_eq!(s.live_requests(), 4, "q1, q2, t1 and its stub t2");
    }

    #[test]
    fn the_first_attempt_takes_over_the_record_a_request_level_event_made() {
        let mut s = store();
        // The router received the request (request id only: no room yet): a record.
        let got = s.resolve_t(&ids(Some("q"), Some("tr"), None), 1_000);
        let r = got.request.expect("a record");
        assert_eq!((s.requests.len(), s.live_requests()), (1, 1));
        // Its dispatch names the room: the attempt takes the request over, solo.
        let d = s.resolve_t(&ids(Some("q"), None, Some(5)), 2_000);
        let a = live(&d);
        assert_eq!((d.request, d.solo), (None, true));
        assert_eq!(s.stats.requests_adopted, 1);
        assert!(
            !s.requests[r as usize].is_live(),
            "the record is free again"
        );
        assert_eq!(s.live_requests(), 1);
        // Both ids still lead to it.
        assert!(s.resolve_t(&ids(None, Some("tr"), None), 2_500).solo);
        let retry = s.resolve_t(&ids(Some("q"), None, Some(6)), 3_000);
        let r2 = retry.request.expect("a second attempt needs a record");
        assert_eq!(s.request_record(a), Some(r2));
        assert_eq!(s.requests[r2 as usize].trace_id(), Some("tr"));

        // A record that already holds something (here a second attempt's reference) stays.
        let third = s.resolve_t(&ids(Some("q"), None, Some(7)), 4_000);
        assert_eq!(third.request, Some(r2));
        assert_eq!(s.requests[r2 as usize].refs, 3);
    }

    #[test]
    fn a_merged_attempt_hands_its_solo_request_over() {
        let mut s = store();
        // A rid seen alone first (its own attempt, with the request id), then with a room.
        let with_rid = |rid: &str, request_id: Option<&str>, room: Option<u64>| Ids {
            rid: Some(rid.into()),
            ..ids(request_id, None, room)
        };
        let y = live(&s.resolve_t(&with_rid("r-1", Some("q"), None), 1_000));
        let x = live(&s.resolve_t(&ids(None, None, Some(7)), 1_500));
        assert_ne!(x, y);
        let merged = s.resolve_t(&with_rid("r-1", None, Some(7)), 2_000);
        assert_eq!(live(&merged), x);
        assert_eq!(
            merged.request, None,
            "still solo, now in the surviving attempt"
        );
        assert_eq!(s.requests.len(), 0);
        let r = s.resolve(&ids(Some("q"), None, None), 3_000, true).request;
        assert_eq!(r, s.request_record(x));
        assert_eq!(s.requests[r.unwrap() as usize].request_id(), Some("q"));
    }
}
