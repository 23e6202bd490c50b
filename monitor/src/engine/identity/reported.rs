//! What the checker has reported, per owner: the evidence sources seen for each fired rule (so
//! a later source corroborates once) and the alias a request's first violation was
//! fingerprinted with.

use super::{Owner, Store};

impl Store {
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
    pub(super) fn move_reported(&mut self, from: Owner, to: Owner, fired: u64) {
        let mut bits = fired;
        while bits != 0 {
            let rule = bits.trailing_zeros() as u8;
            bits &= bits - 1;
            if let Some(v) = self.reported.remove(&(from, rule)) {
                *self.reported.entry((to, rule)).or_default() |= v;
            }
        }
    }
    pub(super) fn drop_reported(&mut self, owner: Owner, fired: u64) {
        let mut bits = fired;
        while bits != 0 {
            let rule = bits.trailing_zeros() as u8;
            bits &= bits - 1;
            self.reported.remove(&(owner, rule));
        }
    }
}
