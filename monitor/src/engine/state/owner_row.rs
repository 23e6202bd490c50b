//! One owner's row of packed slots in a [`Chunked`](crate::engine::mem::chunked::Chunked)
//! table (requests), with the full slots of rows that do not pack in a side map.

use std::collections::HashMap;

use foldhash::fast::FixedState;

use super::{Keep, Slot, Slots, fold_specs_full, packed};

/// One owner's row of packed slots (`1 + n` words, see [`packed`]) as a readable view, taking
/// the full slots from `wide` when the row is [`packed::WIDE`].
pub fn row_view<'a, K: std::hash::Hash + Eq>(
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
pub fn row_fold<K: std::hash::Hash + Eq + Copy>(
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
pub fn row_store<K: std::hash::Hash + Eq>(
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
pub fn row_clear<K: std::hash::Hash + Eq>(
    row: &mut [u64],
    wide: &mut HashMap<K, Box<[Slot]>, FixedState>,
    id: K,
) {
    if row[0] == packed::WIDE {
        wide.remove(&id);
    }
    row.fill(0);
}
