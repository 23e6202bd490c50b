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

pub struct TimerQueue {
    runs: [VecDeque<Entry>; RUNS],
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
        let mut best = self.heap.peek().map(|r| (r.0, From::Heap));
        for (i, r) in self.runs.iter().enumerate() {
            if let Some(&f) = r.front()
                && best.as_ref().is_none_or(|(b, _)| f < *b)
            {
                best = Some((f, From::Run(i)));
            }
        }
        best
    }

    pub fn peek(&self) -> Option<Entry> {
        self.min().map(|(e, _)| e)
    }

    pub fn pop(&mut self) -> Option<Entry> {
        let (e, from) = self.min()?;
        match from {
            From::Run(i) => self.runs[i].pop_front(),
            From::Heap => self.heap.pop().map(|r| r.0),
        };
        self.refresh_next_due();
        Some(e)
    }

    pub fn len(&self) -> usize {
        self.heap.len() + self.runs.iter().map(VecDeque::len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps the entries `keep` says yes to (order preserved), giving back the memory of the
    /// rest. O(len): callers amortise it.
    pub fn retain(&mut self, mut keep: impl FnMut(&Entry) -> bool) {
        for r in &mut self.runs {
            r.retain(|e| keep(e));
            if r.capacity() > 2 * r.len() + 16 {
                r.shrink_to_fit();
            }
        }
        let heap = std::mem::take(&mut self.heap);
        self.heap = heap.into_iter().filter(|r| keep(&r.0)).collect();
        self.refresh_next_due();
    }

    /// Heap bytes reserved (capacity, not length).
    pub fn capacity_bytes(&self) -> usize {
        (self.heap.capacity() + self.runs.iter().map(VecDeque::capacity).sum::<usize>())
            * std::mem::size_of::<Entry>()
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
}
