//! The deadline queue: (due, attempt, generation) entries, popped earliest first.
//!
//! A binary heap of one entry per live attempt costs a sift through ~18 levels of scattered
//! memory per pop. But deadlines arrive nearly sorted: "judge again once the watermark passes
//! this event" follows the event stream, "admitted + 330 s" follows it too, shifted. So entries
//! go to a few monotone runs (push and pop O(1) at the ends); only an entry that fits no run
//! (an event that arrived late and out of order) goes to the heap.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

pub type Entry = (u64, u32, u32);

const RUNS: usize = 4;

/// Entries per chunk of a run (8 KiB; a power of two).
const CHUNK: usize = 512;

/// One monotone run: a FIFO of entries in fixed-size chunks. Its capacity tracks its length to
/// within a chunk: a doubling `VecDeque` reserves up to twice its length, and as a run holds
/// about one entry per live attempt, that slack would be most of the queue's memory.
#[derive(Default)]
struct Run {
    chunks: VecDeque<Box<Chunk>>,
    /// Entries already popped from the first chunk.
    head: usize,
    len: usize,
    /// The last chunk emptied, kept for the next one needed: a run that drains and refills does
    /// not allocate (and zero 8 KiB) each time.
    spare: Option<Box<Chunk>>,
    /// Copies of the first and last entries (valid while `len > 0`): every push compares with
    /// each run's last and every pop with each run's first, so these are read far more often
    /// than the chunks.
    first: Entry,
    last: Entry,
}

type Chunk = [Entry; CHUNK];

impl Run {
    #[inline]
    fn at(&self, k: usize) -> &Entry {
        let j = self.head + k;
        &self.chunks[j / CHUNK][j % CHUNK]
    }

    #[inline]
    fn front(&self) -> Option<&Entry> {
        (self.len > 0).then_some(&self.first)
    }

    #[inline]
    fn back(&self) -> Option<&Entry> {
        (self.len > 0).then_some(&self.last)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn push_back(&mut self, e: Entry) {
        let j = self.head + self.len;
        if j == self.chunks.len() * CHUNK {
            let chunk = self
                .spare
                .take()
                .unwrap_or_else(|| Box::new([(0, 0, 0); CHUNK]));
            self.chunks.push_back(chunk);
        }
        self.chunks[j / CHUNK][j % CHUNK] = e;
        if self.len == 0 {
            self.first = e;
        }
        self.last = e;
        self.len += 1;
    }

    fn pop_front(&mut self) -> Option<Entry> {
        let e = *self.front()?;
        self.head += 1;
        self.len -= 1;
        if self.head == CHUNK {
            // A chunk is added only when an entry needs it: the next entry is in the next one.
            self.spare = self.chunks.pop_front();
            self.head = 0;
        } else if self.len == 0 {
            self.head = 0;
        }
        if self.len > 0 {
            self.first = *self.at(0);
        }
        Some(e)
    }

    /// Keeps the entries `keep` says yes to, in order, in a fresh run (the memory of the rest
    /// is given back).
    fn retain(&mut self, mut keep: impl FnMut(&Entry) -> bool) {
        let old = std::mem::take(self);
        for k in 0..old.len {
            let e = old.at(k);
            if keep(e) {
                self.push_back(*e);
            }
        }
    }

    fn capacity_bytes(&self) -> usize {
        let chunks = self.chunks.len() + usize::from(self.spare.is_some());
        chunks * CHUNK * std::mem::size_of::<Entry>()
            + self.chunks.capacity() * std::mem::size_of::<Box<Chunk>>()
    }
}

pub struct TimerQueue {
    runs: [Run; RUNS],
    heap: BinaryHeap<Reverse<Entry>>,
    /// The earliest due time queued (`u64::MAX` when empty): the watermark moves on nearly every
    /// event, and this answers "anything due?" without looking at five queue heads.
    next_due: u64,
}

impl Default for TimerQueue {
    fn default() -> Self {
        TimerQueue {
            runs: Default::default(),
            heap: BinaryHeap::new(),
            next_due: u64::MAX,
        }
    }
}

enum From {
    Run(usize),
    Heap,
}

impl TimerQueue {
    /// Every queued entry, in no particular order (for end-of-input reports, not the hot path).
    pub fn for_each(&self, mut f: impl FnMut(&Entry)) {
        for r in &self.runs {
            for k in 0..r.len {
                f(r.at(k));
            }
        }
        for Reverse(e) in &self.heap {
            f(e);
        }
    }

    /// The earliest due time queued, `u64::MAX` if none.
    #[inline]
    pub fn next_due(&self) -> u64 {
        self.next_due
    }

    fn refresh_next_due(&mut self) {
        self.next_due = self.min().map_or(u64::MAX, |(e, _)| e.0);
    }

    pub fn push(&mut self, e: Entry) {
        self.next_due = self.next_due.min(e.0);
        // The run whose last entry is the latest one not after `e` keeps runs tight; an empty run
        // only when no run fits.
        let mut best: Option<(usize, u64)> = None;
        for (i, r) in self.runs.iter().enumerate() {
            match r.back() {
                Some(b) if b.0 <= e.0 && best.is_none_or(|(_, d)| b.0 >= d) => {
                    best = Some((i, b.0));
                }
                None if best.is_none() => best = Some((i, 0)),
                _ => {}
            }
        }
        match best {
            Some((i, _)) => self.runs[i].push_back(e),
            None => self.heap.push(Reverse(e)),
        }
    }

    fn min(&self) -> Option<(Entry, From)> {
        self.heads().map(|(e, from, _)| (e, from))
    }

    /// The earliest entry (ties to the heap, then to the first run), where it is, and the
    /// earliest due of the other heads (`u64::MAX` if none): one look at the queue's heads.
    /// Inlined always, so that [`Self::min`] does not pay for the other heads' due.
    #[inline(always)]
    fn heads(&self) -> Option<(Entry, From, u64)> {
        let mut best = self.heap.peek().map(|r| (r.0, From::Heap));
        let mut others = u64::MAX;
        for (i, r) in self.runs.iter().enumerate() {
            let Some(&f) = r.front() else { continue };
            match &best {
                Some((b, _)) if f >= *b => others = others.min(f.0),
                _ => {
                    if let Some((b, _)) = &best {
                        others = others.min(b.0);
                    }
                    best = Some((f, From::Run(i)));
                }
            }
        }
        best.map(|(e, from)| (e, from, others))
    }

    pub fn peek(&self) -> Option<Entry> {
        self.min().map(|(e, _)| e)
    }

    /// The earliest entry, removed. One look at the queue's heads ([`Self::heads`]) finds it
    /// and the earliest due of the others: the next due is the smaller of that and the new head
    /// of the one popped, with no second look at them all.
    pub fn pop(&mut self) -> Option<Entry> {
        let (e, from, others) = self.heads()?;
        let head = match from {
            From::Run(i) => {
                self.runs[i].pop_front();
                self.runs[i].front().map_or(u64::MAX, |f| f.0)
            }
            From::Heap => {
                self.heap.pop();
                self.heap.peek().map_or(u64::MAX, |r| r.0.0)
            }
        };
        self.next_due = others.min(head);
        Some(e)
    }

    pub fn len(&self) -> usize {
        self.heap.len() + self.runs.iter().map(Run::len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps the entries `keep` says yes to (order preserved), giving back the memory of the
    /// rest. O(len): callers amortise it.
    pub fn retain(&mut self, mut keep: impl FnMut(&Entry) -> bool) {
        for r in &mut self.runs {
            r.retain(&mut keep);
        }
        let heap = std::mem::take(&mut self.heap);
        self.heap = heap.into_iter().filter(|r| keep(&r.0)).collect();
        self.refresh_next_due();
    }

    /// Heap bytes reserved (capacity, not length).
    pub fn capacity_bytes(&self) -> usize {
        self.heap.capacity() * std::mem::size_of::<Reverse<Entry>>()
            + self.runs.iter().map(Run::capacity_bytes).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pops_in_due_order_whatever_the_push_order() {
        let mut q = TimerQueue::default();
        let mut rng = 7u64;
        let mut all = Vec::new();
        for i in 0..5_000u32 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            // Mostly increasing streams plus out-of-order stragglers.
            let due = match i % 5 {
                0 => rng % 100_000,
                1 | 2 => i as u64 * 10,
                _ => i as u64 * 10 + 330_000,
            };
            q.push((due, i, 0));
            all.push(due);
            assert_eq!(Some(q.next_due()), q.peek().map(|e| e.0));
            if i % 7 == 0 {
                // Interleave pops with pushes, as the engine does.
                let before = q.peek().unwrap();
                assert_eq!(q.pop(), Some(before));
                let pos = all.iter().position(|&d| d == before.0).unwrap();
                assert_eq!(all.iter().min(), Some(&before.0));
                all.swap_remove(pos);
            }
        }
        // Dropping entries keeps the rest in order.
        q.retain(|e| e.1 % 3 != 0);
        assert_eq!(Some(q.next_due()), q.peek().map(|e| e.0));
        all = Vec::new();
        let mut copy = TimerQueue::default();
        while let Some(e) = q.pop() {
            all.push(e.0);
            copy.push(e);
        }
        q = copy;
        assert!(all.windows(2).all(|w| w[0] <= w[1]));
        all.sort();
        let mut got = Vec::new();
        while let Some(e) = q.pop() {
            got.push(e.0);
            assert_eq!(q.next_due(), q.peek().map_or(u64::MAX, |e| e.0));
        }
        assert_eq!(got, all);
        assert!(q.is_empty());
    }

    #[test]
    fn reserved_memory_tracks_the_length() {
        let mut q = TimerQueue::default();
        let entry = std::mem::size_of::<Entry>();
        let n = 20 * CHUNK as u32 + 7;
        for i in 0..n {
            // Two interleaved monotone streams: two runs.
            let due = if i % 2 == 0 {
                i as u64
            } else {
                1_000_000 + i as u64
            };
            q.push((due, i, 0));
        }
        let bound = |len: usize| len * entry + RUNS * 2 * CHUNK * entry + 4096;
        assert!(
            q.capacity_bytes() <= bound(q.len()),
            "{} B for {}",
            q.capacity_bytes(),
            q.len()
        );
        let mut last = 0;
        while q.len() > 100 {
            let e = q.pop().unwrap();
            assert!(e.0 >= last);
            last = e.0;
        }
        assert!(
            q.capacity_bytes() <= bound(q.len()),
            "{} B for {}",
            q.capacity_bytes(),
            q.len()
        );
        // Drained and refilled across chunk boundaries: still in order.
        for i in 0..3 * CHUNK as u32 {
            q.push((2_000_000 + i as u64, i, 1));
        }
        let mut got = 0;
        while let Some(e) = q.pop() {
            assert!(e.0 >= last);
            last = e.0;
            got += 1;
        }
        assert_eq!(got, 100 + 3 * CHUNK);
        assert!(q.capacity_bytes() <= bound(0));
    }
}
