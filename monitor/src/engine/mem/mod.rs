//! Generic containers under the engine, with no knowledge of attempts or requests: an
//! open-addressing table of fingerprinted keys ([`alias_table`]), chunked arrays and queues that
//! grow a chunk at a time ([`chunked`]), SWAR and bit-packing helpers ([`bits`]), and the fixed
//! hasher that keeps alias keys the same on every run ([`stable_hash`]).

pub mod alias_table;
pub mod bits;
pub mod chunked;
pub mod stable_hash;

/// An index (into a [`chunked::Chunked`] table, a slab or a free list) that names nothing.
/// Tables hold at most 2^30 items, so `u32::MAX` is never a real index.
pub const NO_INDEX: u32 = u32::MAX;
