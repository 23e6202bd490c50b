//! Rules are data: a YAML file of named invariants, compiled into slot specs and checks.
//!
//! The defaults are embedded in the binary (`monitor/rules/default.yaml`); `--rules FILE` adds
//! rules or overrides defaults by name (a partial entry such as `{name: stuck-attempt, enabled:
//! false}` patches the default of that name).
//!
//! Here: what a rule is ([`Rule`], its [`Shape`] and [`Scope`], the [`RuleSet`]) and why one is
//! not valid ([`RuleError`], [`RulesError`]). `load` reads the file (parse, patch, validate,
//! place errors at their line and column); `compile` gives each enabled rule the slots it reads.
//! One shape per file (`never_after`, `must_follow`, `requires_before`, `predicate`, `distinct`,
//! `never`): its YAML form, its validation and its slots. A new shape is a file here, a variant
//! of [`Shape`], and its entry point in `engine/check`.

mod compile;
pub mod distinct;
mod load;
pub mod must_follow;
pub mod never;
pub mod never_after;
pub mod predicate;
pub mod requires_before;

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::event::Stage;

pub use compile::{CompiledRule, RuleSlots, compile};
pub use distinct::Distinct;
pub use load::{RuleDef, parse_message};
pub use must_follow::MustFollow;
pub use never::Never;
pub use never_after::NeverAfter;
pub use predicate::Predicate;
pub use requires_before::RequiresBefore;

use crate::violation::Severity;

/// The rules shipped with revenant.
pub const DEFAULT_RULES_YAML: &str = include_str!("../../../rules/default.yaml");

/// Whose events a rule relates: one attempt's, or all attempts of one client request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    #[default]
    Attempt,
    Request,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Attempt => "attempt",
            Scope::Request => "request",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    #[error("cannot read rules file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid rules in {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("rule {rule:?} in {origin}{}: {error}", at.map(|p| p.to_string()).unwrap_or_default())]
    Invalid {
        origin: String,
        rule: String,
        /// Where in the file: the field at fault (`output`, the second shape) or else the
        /// rule's `name`.
        at: Option<Position>,
        #[source]
        error: RuleError,
    },
}

/// A 1-based line and column in a rules file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub line: u64,
    pub column: u64,
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, " at line {}, column {}", self.line, self.column)
    }
}

/// Why one rule is not valid; [`RulesError::Invalid`] prefixes it with the rule and its origin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("defined twice in the same file")]
    DefinedTwice,
    #[error("names are 1-64 characters of a-z, 0-9, '-' and '_'")]
    Name { name: String },
    /// The shapes given (two or more).
    #[error(
        "a rule takes exactly one of never_after, must_follow, requires_before, predicate, \
         distinct, never"
    )]
    SeveralShapes { shapes: Vec<&'static str> },
    #[error(
        "no such default rule to patch, and no shape given (never_after, must_follow, \
         requires_before, predicate, distinct or never)"
    )]
    NoShape,
    #[error("missing description")]
    MissingDescription,
    #[error("missing severity")]
    MissingSeverity,
    #[error(transparent)]
    Template(#[from] crate::violation::TemplateError),
    /// Known placeholders that have no value in a rule of this shape (they would render `-`).
    #[error(
        "{} {} in output template: a {shape} rule has no value for {} (its placeholders: {})",
        if .names.len() == 1 { "placeholder" } else { "placeholders" },
        crate::violation::braced(.names),
        if .names.len() == 1 { "it" } else { "them" },
        Shape::placeholders_of(shape).join(", ")
    )]
    PlaceholderNotForShape {
        shape: &'static str,
        names: Vec<String>,
    },
    /// A matcher without any condition matches every event.
    #[error(
        "a matcher in `{role}` has no condition and would match every event: give it at least \
         one of stage, kind, source, to, peer, protocol_breach, status_below, status_at_least"
    )]
    CatchAllMatcher { role: &'static str },
    /// The number of matchers on each side (one of them is zero).
    #[error("never_after needs at least one trigger and one forbidden matcher")]
    NeverAfterMatchers { trigger: usize, forbidden: usize },
    /// The number of matchers on each side (one of them is zero).
    #[error("must_follow needs at least one trigger and one expect matcher")]
    MustFollowMatchers { trigger: usize, expect: usize },
    #[error("must_follow needs a non-zero `within`")]
    MustFollowZeroWithin,
    /// The number of matchers on each side (one of them is zero).
    #[error("requires_before needs at least one event and one requires matcher")]
    RequiresBeforeMatchers { event: usize, requires: usize },
    #[error("never needs at least one `event` matcher")]
    NeverMatchers,
    #[error("predicate needs at least one `on` matcher")]
    PredicateNoOn,
    /// The number of comparisons in each list (both zero, or both non-zero).
    #[error("predicate takes exactly one of `all` or `any` (a non-empty list of comparisons)")]
    PredicateAllOrAny { all: usize, any: usize },
    /// The operators the comparison sets (none, or two or more).
    #[error("comparison on {} needs exactly one of gt, ge, lt, le, eq", .field.as_str())]
    ComparisonOperator {
        field: predicate::NumField,
        ops: Vec<&'static str>,
    },
}

/// The shape a rule takes, once validated.
#[derive(Debug, Clone, PartialEq)]
pub enum Shape {
    NeverAfter(NeverAfter),
    MustFollow(MustFollow),
    RequiresBefore(RequiresBefore),
    Predicate(Predicate),
    Distinct(Distinct),
    Never(Never),
}

impl Shape {
    /// The placeholders a rule of shape `kind` (as [`Shape::kind_name`] names it) can fill.
    pub fn placeholders_of(kind: &str) -> &'static [&'static str] {
        const EVENT: [&str; 5] = [
            "event.stage",
            "event.kind",
            "event.source",
            "event.status",
            "event.reason",
        ];
        const TRIGGER: [&str; 5] = [
            "trigger.stage",
            "trigger.kind",
            "trigger.source",
            "trigger.status",
            "trigger.reason",
        ];
        const NEVER_AFTER: &[&str] = &const_concat::<15>(&[
            &["rule", "severity", "request", "attempt", "delay"],
            &TRIGGER,
            &EVENT,
        ]);
        const MUST_FOLLOW: &[&str] = &const_concat::<10>(&[
            &["rule", "severity", "request", "attempt", "within"],
            &TRIGGER,
        ]);
        const REQUIRES_BEFORE: &[&str] =
            &const_concat::<9>(&[&["rule", "severity", "request", "attempt"], &EVENT]);
        const PREDICATE: &[&str] = &const_concat::<11>(&[
            &["rule", "severity", "request", "attempt", "worker", "breach"],
            &EVENT,
        ]);
        const DISTINCT: &[&str] = &const_concat::<10>(&[
            &["rule", "severity", "request", "attempt", "breach"],
            &EVENT,
        ]);
        const NEVER: &[&str] = &const_concat::<10>(&[
            &["rule", "severity", "request", "attempt", "worker"],
            &EVENT,
        ]);
        match kind {
            "never_after" => NEVER_AFTER,
            "distinct" => DISTINCT,
            "must_follow" => MUST_FOLLOW,
            "requires_before" => REQUIRES_BEFORE,
            "never" => NEVER,
            _ => PREDICATE,
        }
    }

    /// The placeholders a rule of this shape can fill: `{delay}` needs a trigger and an
    /// offending event, `{within}` a deadline, `{breach}` and `{worker}` a predicate.
    pub fn placeholders(&self) -> &'static [&'static str] {
        Shape::placeholders_of(self.kind_name())
    }

    /// The matcher lists of this shape, by the key each is written under.
    pub fn matchers(&self) -> Vec<(&'static str, &[crate::engine::matcher::Matcher])> {
        match self {
            Shape::NeverAfter(s) => vec![("trigger", &s.trigger), ("forbidden", &s.forbidden)],
            Shape::MustFollow(s) => vec![
                ("trigger", &s.trigger),
                ("expect", &s.expect),
                ("given", &s.given),
            ],
            Shape::RequiresBefore(s) => vec![("event", &s.event), ("requires", &s.requires)],
            Shape::Predicate(s) => vec![("on", &s.on)],
            Shape::Distinct(_) => vec![],
            Shape::Never(s) => vec![("event", &s.event)],
        }
    }

    pub fn kind_name(&self) -> &'static str {
        match self {
            Shape::NeverAfter(_) => "never_after",
            Shape::MustFollow(_) => "must_follow",
            Shape::RequiresBefore(_) => "requires_before",
            Shape::Predicate(_) => "predicate",
            Shape::Distinct(_) => "distinct",
            Shape::Never(_) => "never",
        }
    }
}

/// A complete, validated rule.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub name: String,
    pub description: String,
    pub severity: Severity,
    pub scope: Scope,
    pub enabled: bool,
    pub output: String,
    pub shape: Shape,
}

/// The active rule list: embedded defaults plus any user overrides.
#[derive(Debug, Clone)]
pub struct RuleSet {
    pub rules: Vec<Rule>,
}

impl RuleSet {
    pub fn embedded_defaults() -> RuleSet {
        RuleSet::from_yaml(DEFAULT_RULES_YAML, "embedded default rules")
            .expect("embedded default rules are valid (covered by tests)")
    }

    /// Parses a full rules document (no defaults underneath).
    pub fn from_yaml(text: &str, origin: &str) -> Result<RuleSet, RulesError> {
        let mut set = RuleSet { rules: Vec::new() };
        set.apply_yaml(text, origin)?;
        Ok(set)
    }

    /// The defaults, extended and overridden by the file at `path`.
    pub fn from_file(path: &Path) -> Result<RuleSet, RulesError> {
        let text = std::fs::read_to_string(path).map_err(|source| RulesError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let mut set = RuleSet::embedded_defaults();
        set.apply_yaml(&text, &path.display().to_string())?;
        Ok(set)
    }

    /// The defaults with the rules named in `names` (comma-separated) turned off, as
    /// `{name: NAME, enabled: false}` does; the first name that is no rule is the error.
    pub fn embedded_defaults_without(names: &str) -> Result<RuleSet, String> {
        let mut set = RuleSet::embedded_defaults();
        for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match set.rules.iter_mut().find(|r| r.name == name) {
                Some(r) => r.enabled = false,
                None => return Err(name.to_owned()),
            }
        }
        Ok(set)
    }

    /// How many rules a tombstone keeps state for (attempt-scope never_after, distinct): at
    /// most [`MAX_TOMBSTONE_RULES`].
    pub fn tombstone_rules(&self) -> usize {
        self.rules
            .iter()
            .filter(|r| {
                matches!(r.shape, Shape::NeverAfter(_)) && r.scope == Scope::Attempt
                    || matches!(r.shape, Shape::Distinct(_))
            })
            .count()
    }

    pub fn enabled(&self) -> impl Iterator<Item = &Rule> {
        self.rules.iter().filter(|r| r.enabled)
    }

    /// The set as a YAML document (what `revenant rules list --yaml` prints).
    pub fn to_defs(&self) -> Vec<RuleDef> {
        self.rules.iter().map(Rule::to_def).collect()
    }
}

/// Fired-rule bookkeeping uses a u64 bit set per attempt.
pub const MAX_RULES: usize = 64;

/// How many rules a tombstone keeps fired bits for (the storage's limit, checked here when a rule
/// set is compiled).
pub use crate::engine::state::MAX_TOMBSTONE_RULES;

/// The lists of `parts` one after the other (`N` is their total length).
const fn const_concat<const N: usize>(parts: &[&[&'static str]]) -> [&'static str; N] {
    let mut out = [""; N];
    let (mut i, mut at) = (0, 0);
    while i < parts.len() {
        let mut j = 0;
        while j < parts[i].len() {
            out[at] = parts[i][j];
            at += 1;
            j += 1;
        }
        i += 1;
    }
    assert!(at == N, "N is the total length of the parts");
    out
}

impl Rule {
    /// Longest time after its trigger this rule may still need an attempt's live state.
    pub fn horizon(&self) -> Duration {
        match &self.shape {
            Shape::MustFollow(s) => s.within.0,
            Shape::RequiresBefore(s) => s.grace.0,
            _ => Duration::ZERO,
        }
    }
}

/// A rule's duration, written as "50ms", "5s", "5m30s".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct HumanDuration(#[serde(with = "crate::duration")] pub Duration);

impl HumanDuration {
    pub fn is_zero(&self) -> bool {
        self.0.is_zero()
    }

    /// In nanoseconds, as event times are, saturated at `u64::MAX`.
    pub fn ns(&self) -> u64 {
        self.0.as_nanos().min(u64::MAX as u128) as u64
    }
}

/// Stages are small; used by shapes that name one.
pub fn stage_list(stages: &[Stage]) -> String {
    stages
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join("|")
}

#[cfg(test)]
mod tests;
