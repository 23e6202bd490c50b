//! An open-addressing table from 64-bit keys to 32-bit values, keeping only a fingerprint of
//! each key. Identity keeps every alias (room, rid, request id, trace id) in one: one probe
//! sequence answers "live attempt, tombstone or nothing" for an event's room, instead of one
//! probe per map.
//!
//! A bucket is 8 bytes: a 32-bit fingerprint of the key and the value (opaque here). A
//! fingerprint match is only a candidate: the caller's `verify` asks the owner the value names
//! whether it really has the key (its room, rid, id text, or the full key), so two keys of equal
//! fingerprint live side by side and each finds its own owner. Linear probing from a
//! multiply-shift home of the fingerprint (so any capacity works and growth is by a quarter, not
//! doubling), backward-shift deletion (no tombstone markers).

/// A key's fingerprint (0 = empty bucket) and the value it maps to.
#[derive(Clone, Copy, Default)]
struct Bucket {
    fp: u32,
    val: u32,
}

/// The bucket fingerprint of a 64-bit key: its high half (never 0, which marks an empty
/// bucket). The home bucket is derived from it as well, so resizing needs no key. Owners
/// confirm candidates against the rest of the key: the low half or the alias itself.
#[inline]
pub fn fingerprint(key: u64) -> u32 {
    let f = (key >> 32) as u32;
    #[cfg(test)]
    let f = f & FP_MASK.with(|m| m.get());
    f.max(1)
}

/// Growing by `GROWTH` when an insert would pass `MAX_LOAD` keeps the load between 0.62 (just
/// after growing) and 0.77. Measured (callgrind, engine_profile): loads up to 0.85 cost ~7% more
/// instructions per event than loads of 0.53-0.8 (linear probing's unsuccessful probes grow as
/// 1/(1-load)^2, and every new attempt makes several); 0.62-0.77 stays close. Growth by a fifth
/// instead of a quarter rehashes 6 times the final size instead of 5, for little memory.
const MAX_LOAD: (usize, usize) = (77, 100);
const GROWTH: (usize, usize) = (5, 4);
/// Below this load (after a peak) the table is rebuilt at `REBUILT_LOAD`.
const SHRINK_LOAD: (usize, usize) = (2, 5);
const REBUILT_LOAD: (usize, usize) = (7, 10);
const MIN_BUCKETS: usize = 1024;

#[derive(Default)]
pub struct Table {
    buckets: Buckets,
    len: usize,
}

/// A table's bucket array: on the heap while small; from a mapping of its own once it spans
/// huge pages, asked to be backed by them (see [`advise_huge_pages`]) and unmapped when the
/// table is rebuilt. Advice given to a block of the allocator's outlives the block: the range
/// went back to the allocator's heap, still marked for huge pages, and small objects placed
/// there later were faulted in 2 MiB at a time, memory no estimate counts. A pointer and a
/// length either way, so that a probe reads it as it would a `Vec`'s.
struct Buckets {
    ptr: std::ptr::NonNull<Bucket>,
    len: usize,
    /// From `mmap` (else a `Vec`'s block of capacity `len`).
    mapped: bool,
}

// SAFETY: `Buckets` owns its block exclusively, as a `Vec` does.
unsafe impl Send for Buckets {}
// SAFETY: shared references only read it.
unsafe impl Sync for Buckets {}

impl Default for Buckets {
    fn default() -> Self {
        Buckets::heap(Vec::new())
    }
}

/// Bucket arrays from this size on get a mapping of their own (the size of a huge page).
const MAPPED_FROM_BYTES: usize = 2 << 20;

impl Buckets {
    fn heap(v: Vec<Bucket>) -> Buckets {
        let mut v = std::mem::ManuallyDrop::new(v.into_boxed_slice());
        Buckets {
            ptr: std::ptr::NonNull::from(&mut v[..]).cast(),
            len: v.len(),
            mapped: false,
        }
    }

    /// `n` empty buckets.
    fn new(n: usize) -> Buckets {
        let bytes = n * std::mem::size_of::<Bucket>();
        #[cfg(target_os = "linux")]
        if bytes >= MAPPED_FROM_BYTES {
            // SAFETY: a fresh private anonymous mapping, owned by the value returned; the
            // kernel zero-fills it, and a zeroed bucket is an empty one (`fp` 0).
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p != libc::MAP_FAILED
                && let Some(ptr) = std::ptr::NonNull::new(p.cast::<Bucket>())
            {
                // Before the first touch: each 2 MiB of it is then faulted in as a huge page.
                advise_huge_pages(p as usize, bytes);
                return Buckets {
                    ptr,
                    len: n,
                    mapped: true,
                };
            }
        }
        Buckets::heap(vec![Bucket::default(); n])
    }
}

impl std::ops::Deref for Buckets {
    type Target = [Bucket];
    #[inline]
    fn deref(&self) -> &[Bucket] {
        // SAFETY: `len` initialised buckets live at `ptr` (a boxed slice's, or a zero-filled
        // mapping's) for as long as `self` does.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for Buckets {
    #[inline]
    fn deref_mut(&mut self) -> &mut [Bucket] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Buckets {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: the mapping `new` made, of this size, unmapped once.
            #[cfg(target_os = "linux")]
            unsafe {
                libc::munmap(
                    self.ptr.as_ptr().cast(),
                    self.len * std::mem::size_of::<Bucket>(),
                );
            }
        } else {
            // SAFETY: the boxed slice `heap` leaked, rebuilt once.
            drop(unsafe {
                Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                    self.ptr.as_ptr(),
                    self.len,
                ))
            });
        }
    }
}

impl Table {
    #[inline]
    fn home(&self, fp: u32) -> usize {
        ((fp as u64 * self.buckets.len() as u64) >> 32) as usize
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity_bytes(&self) -> usize {
        self.buckets.len() * std::mem::size_of::<Bucket>()
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
    pub fn insert(&mut self, key: u64, val: u32, verify: impl FnMut(u32) -> bool) -> Option<u32> {
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

    /// Drops every entry for which `keep` says no (a full pass; callers amortise it).
    pub fn retain(&mut self, mut keep: impl FnMut(u32) -> bool) {
        let n = self.buckets.len();
        self.rebuild(n, |b| keep(b.val));
    }

    fn resize(&mut self, n: usize) {
        self.rebuild(n.max(MIN_BUCKETS), |_| true);
    }

    fn rebuild(&mut self, n: usize, mut keep: impl FnMut(&Bucket) -> bool) {
        let old = std::mem::replace(&mut self.buckets, Buckets::new(n));
        self.len = 0;
        for &b in old.iter() {
            if b.fp != 0 && keep(&b) {
                self.place(b);
            }
        }
    }
}

/// Every event probes this table at a random place: with 4 KiB pages each probe is also a
/// TLB miss once the table outgrows the TLB's reach (a few MiB). Asking for transparent huge
/// pages (the kernel's `madvise` mode) before the mapping is touched removes most of those.
/// Advisory: errors (older kernels, no huge page free) are ignored.
#[cfg(target_os = "linux")]
fn advise_huge_pages(start: usize, len: usize) {
    const HUGE: usize = 2 << 20;
    let from = (start + HUGE - 1) & !(HUGE - 1);
    let to = (start + len) & !(HUGE - 1);
    if to > from {
        // SAFETY: madvise only advises the kernel about pages inside our own mapping (rounded
        // inwards to huge-page boundaries); the advice does not change their contents.
        unsafe {
            libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Fingerprints are masked with this in tests, to force collisions of real keys.
    static FP_MASK: std::cell::Cell<u32> = const { std::cell::Cell::new(u32::MAX) };
}

/// Runs `f` with fingerprints masked by `mask` on this thread (0: every key collides).
#[cfg(test)]
pub(crate) fn with_fp_mask<R>(mask: u32, f: impl FnOnce() -> R) -> R {
    FP_MASK.with(|m| m.set(mask));
    let r = f();
    FP_MASK.with(|m| m.set(u32::MAX));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table that grows past a huge page moves its buckets to a mapping of their own, keeps
    /// every entry through the move, the growth and the shrink back to the heap.
    #[test]
    fn large_tables_keep_their_entries_in_a_mapping_of_their_own() {
        // Keys as identity makes them: hashes, spread over the whole range (splitmix64).
        let key = |i: u64| {
            let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let verify = |i: u64| move |v: u32| v as u64 == i;
        let mut t = Table::default();
        let n = 400_000u64;
        for i in 0..n {
            assert_eq!(t.insert(key(i), i as u32, verify(i)), None);
        }
        assert!(t.buckets.mapped, "{} bytes", t.capacity_bytes());
        assert!(t.capacity_bytes() >= MAPPED_FROM_BYTES);
        for i in (0..n).step_by(7) {
            assert_eq!(t.find(key(i), verify(i)), Some(i as u32));
        }
        for i in 0..n - 1000 {
            assert!(t.remove_if(key(i), i as u32));
        }
        assert_eq!(t.len(), 1000);
        assert!(!t.buckets.mapped, "shrunk to the heap");
        for i in n - 1000..n {
            assert_eq!(t.find(key(i), verify(i)), Some(i as u32));
        }
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
        let find =
            |t: &Table, owner: &HashMap<u32, u64>, k: u64| t.find(k, |x| owner.get(&x) == Some(&k));
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
}
