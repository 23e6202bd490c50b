//! What each slot tracks ([`SlotSpec`]), the registry that dedups them while rules compile
//! ([`SlotLayout`]), and the table that finds the specs an event matches ([`SpecIndex`]).

use crate::engine::matcher::{Matcher, any_matches};
use crate::event::{Kind, LifecycleEvent, Source, Stage};

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

/// Table rows: one per (stage, kind, source, dispatch target or none) an event can have.
const KEYS: usize = Stage::ALL.len() * Kind::ALL.len() * Source::ALL.len() * (Stage::ALL.len() + 1);

/// The table row of an event with these fields.
#[inline(always)]
fn key(stage: Stage, kind: Kind, source: Source, to: Option<Stage>) -> usize {
    let to = to.map_or(0, |t| t as usize + 1);
    ((stage as usize * Kind::ALL.len() + kind as usize) * Source::ALL.len() + source as usize)
        * (Stage::ALL.len() + 1)
        + to
}

/// Bit of an optional field's value, the value's own or [`ABSENT`].
const ABSENT: u32 = 1 << 31;

#[inline(always)]
fn bit(v: Option<u8>) -> u32 {
    v.map_or(ABSENT, |v| 1 << v)
}

/// A list condition as a bit set: empty ("any") takes every value, absent included; a list
/// takes its values only (an absent value never matches a listed condition).
fn mask<T: Copy>(list: &[T], index: fn(T) -> u8) -> u32 {
    if list.is_empty() {
        u32::MAX
    } else {
        list.iter().fold(0, |m, &v| m | 1 << index(v))
    }
}

/// The status thresholds the matchers name (`status_below`, `status_at_least`), which split
/// statuses into classes a row can hold: class 0 is no status, class `j` the statuses with
/// `j - 1` thresholds at or below them. Every status of a class is on the same side of every
/// threshold, so a class decides a status condition as the status itself would.
#[derive(Debug, Clone, Default)]
struct StatusClasses {
    /// Sorted, distinct; empty when there are none or more than [`MAX_THRESHOLDS`] (status
    /// conditions are then judged per event).
    thresholds: Vec<u16>,
}

/// Thresholds beyond which the table would grow too much (rows per class): the default rules
/// name one (400).
const MAX_THRESHOLDS: usize = 6;

impl StatusClasses {
    fn of<'a>(matchers: impl Iterator<Item = &'a Matcher>) -> StatusClasses {
        let mut thresholds: Vec<u16> = matchers
            .flat_map(|m| [m.status_below, m.status_at_least])
            .flatten()
            .collect();
        thresholds.sort_unstable();
        thresholds.dedup();
        if thresholds.len() > MAX_THRESHOLDS {
            thresholds.clear();
        }
        StatusClasses { thresholds }
    }

    /// Whether rows hold status conditions.
    fn split(&self) -> bool {
        !self.thresholds.is_empty()
    }

    fn count(&self) -> usize {
        if self.split() {
            self.thresholds.len() + 2
        } else {
            1
        }
    }

    /// The class of an event's status (0 when rows do not split by status).
    #[inline(always)]
    fn of_status(&self, status: Option<u16>) -> usize {
        match status {
            Some(s) if self.split() => 1 + self.thresholds.iter().filter(|&&t| t <= s).count(),
            _ => 0,
        }
    }

    /// The classes a matcher's status conditions accept, as a bit set. With thresholds
    /// `t_1 < … < t_T`, class `j ≥ 1` holds the statuses from `t_(j-1)` up to below `t_j`:
    /// all of them are below `t_m` when `j ≤ m`, and all at least `t_m` when `j > m`.
    fn accepted(&self, m: &Matcher) -> u32 {
        let rank = |t: u16| 1 + self.thresholds.iter().position(|&x| x == t).expect("named");
        (0..self.count())
            .filter(|&j| {
                let below = m.status_below.is_none_or(|b| j == 0 || j <= rank(b));
                let at_least = m.status_at_least.is_none_or(|a| j > rank(a));
                below && at_least
            })
            .fold(0, |mask, j| mask | 1 << j)
    }
}

/// A matcher as bit sets, so that judging one is a few ANDs instead of walking its lists: the
/// conditions the table cannot hold (writer, protocol breach; status when the rules name too
/// many thresholds) are judged per event.
#[derive(Debug, Clone, Copy)]
struct Compiled {
    stage: u32,
    kind: u32,
    source: u32,
    to: u32,
    peer: u32,
    breach: u32,
    status_below: Option<u16>,
    status_at_least: Option<u16>,
    /// The status classes the status conditions accept (every class when rows do not split
    /// by status).
    status: u32,
}

impl Compiled {
    fn of(m: &Matcher, classes: &StatusClasses) -> Compiled {
        Compiled {
            status: if classes.split() {
                classes.accepted(m)
            } else {
                u32::MAX
            },
            stage: mask(&m.stage, |v| v as u8),
            kind: mask(&m.kind, |v| v as u8),
            source: mask(&m.source, |v| v as u8),
            to: mask(&m.to, |v| v as u8),
            peer: mask(&m.peer, |v| v as u8),
            breach: mask(&m.protocol_breach, |v| v as u8),
            status_below: m.status_below,
            status_at_least: m.status_at_least,
        }
    }

    /// Whether the conditions the table rows are made of accept this row's fields.
    fn accepts(&self, stage: Stage, kind: Kind, source: Source, to: Option<Stage>) -> bool {
        self.stage & bit(Some(stage as u8)) != 0
            && self.kind & bit(Some(kind as u8)) != 0
            && self.source & bit(Some(source as u8)) != 0
            && self.to & bit(to.map(|t| t as u8)) != 0
    }

    /// Conditions beyond the row: the matcher is decided by its row alone without them.
    fn plain(&self, classes: &StatusClasses) -> bool {
        self.peer == u32::MAX
            && self.breach == u32::MAX
            && (classes.split() || (self.status_below.is_none() && self.status_at_least.is_none()))
    }

    /// [`Matcher::matches`], on the bit sets.
    #[inline]
    fn matches(&self, e: &LifecycleEvent) -> bool {
        self.stage & bit(Some(e.stage as u8)) != 0
            && self.kind & bit(Some(e.kind as u8)) != 0
            && self.source & bit(Some(e.source as u8)) != 0
            && self.to & bit(e.to.map(|t| t as u8)) != 0
            && self.peer & bit(e.peer.map(|p| p as u8)) != 0
            && self.breach & bit(e.protocol_breach.map(|b| b as u8)) != 0
            && self
                .status_below
                .is_none_or(|b| e.status.is_none_or(|s| s < b))
            && self
                .status_at_least
                .is_none_or(|a| e.status.is_some_and(|s| s >= a))
    }
}

/// The specs an event matches, in the attempt layout and in the request layout, and the table
/// row that decided them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hits {
    pub attempt: u64,
    pub request: u64,
    /// The row (see [`SpecIndex::attempt_rows`]): what depends only on the outright attempt
    /// specs can be precomputed per row.
    pub row: usize,
    /// The attempt specs matched beyond the row's outright ones (a condition judged per event).
    pub attempt_conditional: u64,
}

/// One table row: per layout, the specs that match outright and those that still need a
/// condition the row does not decide.
#[derive(Debug, Clone, Copy, Default)]
struct Row {
    attempt: u64,
    attempt_conditional: u64,
    request: u64,
    request_conditional: u64,
}

/// Spec matching as table look-ups, for both layouts at once: per (stage, kind, source,
/// dispatch target, status class), the specs that match outright and those that still need a
/// writer or protocol breach condition checked. Every event pays this once (the attempt's
/// rules and the request's read the same row), so it is one array index, and rarely a
/// compiled matcher or two, instead of walking each spec's matcher lists.
#[derive(Debug, Clone)]
pub struct SpecIndex {
    rows: Box<[Row]>,
    classes: StatusClasses,
    /// Per spec, its matchers compiled (read only for the conditional ones).
    attempt: Vec<Vec<Compiled>>,
    request: Vec<Vec<Compiled>>,
}

impl SpecIndex {
    pub fn new(attempt_specs: &[SlotSpec], request_specs: &[SlotSpec]) -> SpecIndex {
        let classes = StatusClasses::of(
            attempt_specs
                .iter()
                .chain(request_specs)
                .flat_map(|s| &s.matchers),
        );
        let compile = |specs: &[SlotSpec]| -> Vec<Vec<Compiled>> {
            specs
                .iter()
                .map(|s| {
                    s.matchers
                        .iter()
                        .map(|m| Compiled::of(m, &classes))
                        .collect()
                })
                .collect()
        };
        let (attempt, request) = (compile(attempt_specs), compile(request_specs));
        let n = classes.count();
        let mut rows = vec![Row::default(); KEYS * n].into_boxed_slice();
        let targets = std::iter::once(None).chain(Stage::ALL.map(Some));
        for stage in Stage::ALL {
            for kind in Kind::ALL {
                for source in Source::ALL {
                    for to in targets.clone() {
                        for class in 0..n {
                            let row = &mut rows[key(stage, kind, source, to) * n + class];
                            let accepting = |specs: &[Vec<Compiled>]| {
                                let (mut outright, mut conditional) = (0u64, 0u64);
                                for (i, spec) in specs.iter().enumerate() {
                                    let in_row = spec.iter().filter(|m| {
                                        m.accepts(stage, kind, source, to)
                                            && m.status & 1 << class != 0
                                    });
                                    for m in in_row {
                                        if m.plain(&classes) {
                                            outright |= 1 << i;
                                        } else {
                                            conditional |= 1 << i;
                                        }
                                    }
                                }
                                (outright, conditional & !outright)
                            };
                            (row.attempt, row.attempt_conditional) = accepting(&attempt);
                            (row.request, row.request_conditional) = accepting(&request);
                        }
                    }
                }
            }
        }
        SpecIndex {
            rows,
            classes,
            attempt,
            request,
        }
    }

    #[inline]
    pub fn matching(&self, e: &LifecycleEvent) -> Hits {
        let n = self.classes.count();
        let class = self.classes.of_status(e.status);
        let index = key(e.stage, e.kind, e.source, e.to) * n + class;
        let row = &self.rows[index];
        let conditional = |mut rest: u64, specs: &[Vec<Compiled>]| {
            let mut hit = 0;
            while rest != 0 {
                let i = rest.trailing_zeros() as usize;
                rest &= rest - 1;
                if specs[i].iter().any(|m| m.matches(e)) {
                    hit |= 1 << i;
                }
            }
            hit
        };
        let mut hits = Hits {
            attempt: row.attempt,
            request: row.request,
            row: index,
            attempt_conditional: 0,
        };
        if row.attempt_conditional | row.request_conditional != 0 {
            hits.attempt_conditional = conditional(row.attempt_conditional, &self.attempt);
            hits.attempt |= hits.attempt_conditional;
            hits.request |= conditional(row.request_conditional, &self.request);
        }
        hits
    }

    /// Per row, in row order, the attempt specs its events match outright.
    pub fn attempt_rows(&self) -> impl Iterator<Item = u64> + '_ {
        self.rows.iter().map(|r| r.attempt)
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
    use crate::event::{Peer, ProtocolBreach};

    #[test]
    fn spec_index_agrees_with_the_matchers() {
        let set = crate::engine::check::RuleSet::embedded_defaults();
        let (mut a, mut r) = (SlotLayout::default(), SlotLayout::default());
        crate::engine::rules::compile(&set, &mut a, &mut r);
        let index = SpecIndex::new(&a.specs, &r.specs);
        for stage in Stage::ALL {
            for kind in Kind::ALL {
                for source in Source::ALL {
                    for status in [None, Some(0), Some(200), Some(399), Some(400), Some(503)] {
                        for to in std::iter::once(None).chain(Stage::ALL.map(Some)) {
                            for peer in std::iter::once(None).chain(Peer::ALL.map(Some)) {
                                for breach in
                                    std::iter::once(None).chain(ProtocolBreach::ALL.map(Some))
                                {
                                    let mut e = LifecycleEvent::new(1, stage, kind, source);
                                    e.status = status;
                                    e.to = to;
                                    e.peer = peer;
                                    e.protocol_breach = breach;
                                    let hits = index.matching(&e);
                                    let want = (
                                        matching_specs(&a.specs, &e),
                                        matching_specs(&r.specs, &e),
                                    );
                                    assert_eq!((hits.attempt, hits.request), want, "{e:?}");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Status conditions by class agree with the matchers for thresholds on both sides of
    /// every status, and past the most thresholds rows split by (judged per event then).
    #[test]
    fn status_classes_agree_with_the_matchers() {
        let spec = |below: Option<u16>, at_least: Option<u16>| SlotSpec {
            matchers: vec![Matcher {
                kind: vec![Kind::Completed],
                status_below: below,
                status_at_least: at_least,
                ..Default::default()
            }],
            keep: crate::engine::state::Keep::Earliest,
        };
        let few = vec![
            spec(Some(400), None),
            spec(None, Some(400)),
            spec(Some(500), Some(200)),
            spec(None, Some(0)),
            spec(Some(0), None),
        ];
        let many: Vec<SlotSpec> = (1..=9u16)
            .map(|i| spec(Some(100 * i), None))
            .chain([spec(None, Some(250))])
            .collect();
        for specs in [few, many] {
            let index = SpecIndex::new(&specs, &specs);
            let mut statuses = vec![None, Some(u16::MAX)];
            for t in [0u16, 100, 200, 250, 300, 400, 500, 600, 700, 800, 900] {
                statuses.extend([t.checked_sub(1), Some(t), Some(t + 1)]);
            }
            for status in statuses {
                let mut e = LifecycleEvent::new(1, Stage::Decode, Kind::Completed, Source::Ebpf);
                e.status = status;
                let want = matching_specs(&specs, &e);
                let hits = index.matching(&e);
                assert_eq!((hits.attempt, hits.request), (want, want), "{status:?}");
            }
        }
    }
}
