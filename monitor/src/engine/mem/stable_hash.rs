//! One hasher with a fixed seed for every map and alias key in the engine: the same input hashes
//! the same way on every run and every machine, so alias keys (and the table layout they give)
//! do not change between a run and its replay.

use foldhash::fast::FixedState;

const HASH_SEED: u64 = 0x7265_7665_6e61_6e74; // "revenant"

/// A `BuildHasher` with the fixed seed: equal keys hash equally on every run.
pub fn stable_hasher() -> FixedState {
    FixedState::with_seed(HASH_SEED)
}
