//! The sans-IO engine: identity correlation and the streaming checker, no clock, channel or I/O
//! inside. Layers point down: `mem` (containers) and `matcher` (event patterns) ← `state` (rule
//! slots and their encodings) ← `identity` (which attempt and request an event belongs to) and
//! `rules` (the rule file, one shape per file) ← `check` (observe, tick, verdicts) ← `shard` (the
//! engine split over several checkers by `partition`, the split cluster mode also uses).

pub mod check;
pub mod identity;
pub mod matcher;
pub mod mem;
pub mod partition;
pub mod rules;
pub mod shard;
pub mod state;
pub mod workload;
