//! What each slot tracks ([`SlotSpec`]), the registry that dedups them while rules compile
//! ([`SlotLayout`]), and the table that finds the specs an event matches ([`SpecIndex`]).

use crate::engine::matcher::{Matcher, any_matches};
use crate::event::{Kind, LifecycleEvent, Stage};

use super::Keep;

/// What one slot tracks: the events matching `matchers`, keeping the earliest or the latest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotSpec {
    pub matchers: Vec<Matcher>,
    pub keep: Keep,
}

/// Returns the bit set of specs whose matchers match `e` (reference implementation; the engine
/// uses [`SpecIndex`], which must agree with it).
pub fn matching_specs(specs: &[SlotSpec], e: &LifecycleEvent) -> u64 {
    let mut hit = 0u64;
    for (i, s) in specs.iter().enumerate() {
        if any_matches(&s.matchers, e) {
            hit |= 1 << i;
        }
    }
    hit
}

const STAGE_KINDS: usize = Stage::ALL.len() * Kind::ALL.len();

fn stage_kind(stage: Stage, kind: Kind) -> usize {
    stage as usize * Kind::ALL.len() + kind as usize
}

/// Spec matching as table look-ups: per (stage, kind), the specs that match outright and those
/// that still need their source/status/target conditions checked. Every event pays this, so it is
/// one array index instead of walking each spec's matcher lists.
#[derive(Debug, Clone)]
pub struct SpecIndex {
    outright: [u64; STAGE_KINDS],
    conditional: [u64; STAGE_KINDS],
    specs: Vec<SlotSpec>,
}

impl SpecIndex {
    pub fn new(specs: &[SlotSpec]) -> SpecIndex {
        let mut outright = [0u64; STAGE_KINDS];
        let mut conditional = [0u64; STAGE_KINDS];
        for (i, spec) in specs.iter().enumerate() {
            for m in &spec.matchers {
                let plain = m.source.is_empty()
                    && m.to.is_empty()
                    && m.peer.is_empty()
                    && m.protocol_breach.is_empty()
                    && m.status_below.is_none()
                    && m.status_at_least.is_none();
                for stage in Stage::ALL {
                    for kind in Kind::ALL {
                        if (m.stage.is_empty() || m.stage.contains(&stage))
                            && (m.kind.is_empty() || m.kind.contains(&kind))
                        {
                            let table = if plain {
                                &mut outright
                            } else {
                                &mut conditional
                            };
                            table[stage_kind(stage, kind)] |= 1 << i;
                        }
                    }
                }
            }
        }
        SpecIndex {
            outright,
            conditional,
            specs: specs.to_vec(),
        }
    }

    pub fn matching(&self, e: &LifecycleEvent) -> u64 {
        let k = stage_kind(e.stage, e.kind);
        let mut hit = self.outright[k];
        let mut rest = self.conditional[k] & !hit;
        while rest != 0 {
            let i = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            if any_matches(&self.specs[i].matchers, e) {
                hit |= 1 << i;
            }
        }
        hit
    }
}

/// Deduplicating registry of slot specs, filled while compiling rules.
#[derive(Debug, Default, Clone)]
pub struct SlotLayout {
    pub specs: Vec<SlotSpec>,
}

impl SlotLayout {
    pub const MAX: usize = 64;

    /// The index of a slot tracking `matchers` with `keep`, shared with any identical one.
    pub fn slot(&mut self, matchers: &[Matcher], keep: Keep) -> usize {
        if let Some(i) = self
            .specs
            .iter()
            .position(|s| s.keep == keep && s.matchers == matchers)
        {
            return i;
        }
        self.specs.push(SlotSpec {
            matchers: matchers.to_vec(),
            keep,
        });
        if keep.is_pair() {
            self.specs.push(SlotSpec {
                matchers: Vec::new(),
                keep: Keep::PairTail,
            });
            return self.specs.len() - 2;
        }
        self.specs.len() - 1
    }

    pub fn len(&self) -> usize {
        self.specs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Source;

    #[test]
    fn spec_index_agrees_with_the_matchers() {
        let set = crate::engine::check::RuleSet::embedded_defaults();
        let (mut a, mut r) = (SlotLayout::default(), SlotLayout::default());
        crate::engine::rules::compile(&set, &mut a, &mut r);
        let index = SpecIndex::new(&a.specs);
        for stage in Stage::ALL {
            for kind in Kind::ALL {
                for source in Source::ALL {
                    for status in [None, Some(200), Some(400), Some(503)] {
                        for to in [None, Some(Stage::Decode)] {
                            let mut e = LifecycleEvent::new(1, stage, kind, source);
                            e.status = status;
                            e.to = to;
                            assert_eq!(index.matching(&e), matching_specs(&a.specs, &e), "{e:?}");
                        }
                    }
                }
            }
        }
    }
}
