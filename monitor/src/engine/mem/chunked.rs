//! Fixed-width items in fixed-size chunks: [`Chunked`] (an indexed table) and [`ChunkedQueue`]
//! (a FIFO). Both grow by one chunk instead of doubling, and items never move.

use std::collections::VecDeque;

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
    /// checks, which cost a tenth of the engine's instructions.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_queue_is_a_fifo_across_chunks() {
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
}
