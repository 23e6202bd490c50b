//! Rules are data: a YAML file of named invariants, compiled into slot specs and checks.
//!
//! The defaults are embedded in the binary (`monitor/rules/default.yaml`); `--rules FILE` adds
//! rules or overrides defaults by name (a partial entry such as `{name: stuck-attempt, enabled:
//! false}` patches the default of that name).

pub mod distinct;
pub mod must_follow;
pub mod never;
pub mod never_after;
pub mod predicate;
pub mod requires_before;

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::engine::state::SlotLayout;
use crate::event::Stage;

pub use distinct::Distinct;
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

/// One rule as written in YAML. Every field but `name` is optional so that a user file can patch
/// a default rule; a new rule must give description, severity and exactly one shape.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleDef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub severity: Option<Severity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<Scope>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Summary template; see [`crate::violation::TEMPLATE_FIELDS`] for the placeholders.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub never_after: Option<NeverAfter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub must_follow: Option<MustFollow>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requires_before: Option<RequiresBefore>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicate: Option<Predicate>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distinct: Option<Distinct>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub never: Option<Never>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RulesFile {
    rules: Vec<RuleDef>,
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
         one of stage, kind, source, to, peer, status_below, status_at_least"
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
        const EVENT: [&str; 4] = ["event.stage", "event.kind", "event.source", "event.status"];
        const TRIGGER: [&str; 5] = [
            "trigger.stage",
            "trigger.kind",
            "trigger.source",
            "trigger.status",
            "trigger.reason",
        ];
        const NEVER_AFTER: &[&str] = &const_concat::<14>(&[
            &["rule", "severity", "request", "attempt", "delay"],
            &TRIGGER,
            &EVENT,
        ]);
        const MUST_FOLLOW: &[&str] = &const_concat::<10>(&[
            &["rule", "severity", "request", "attempt", "within"],
            &TRIGGER,
        ]);
        const REQUIRES_BEFORE: &[&str] =
            &const_concat::<8>(&[&["rule", "severity", "request", "attempt"], &EVENT]);
        const PREDICATE: &[&str] = &const_concat::<10>(&[
            &["rule", "severity", "request", "attempt", "worker", "breach"],
            &EVENT,
        ]);
        const DISTINCT: &[&str] = &const_concat::<9>(&[
            &["rule", "severity", "request", "attempt", "breach"],
            &EVENT,
        ]);
        const NEVER: &[&str] = &const_concat::<9>(&[
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
    fn matchers(&self) -> Vec<(&'static str, &[crate::engine::matcher::Matcher])> {
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

    /// Adds the rules of `text`; an entry named like an existing rule patches it.
    pub fn apply_yaml(&mut self, text: &str, origin: &str) -> Result<(), RulesError> {
        if text.trim().is_empty() {
            return Err(RulesError::Parse {
                origin: origin.to_owned(),
                message: "the file is empty: a rules file is a mapping with a `rules:` list".into(),
            });
        }
        let file: RulesFile = serde_saphyr::from_str(text).map_err(|e| RulesError::Parse {
            origin: origin.to_owned(),
            message: parse_message(&e.to_string(), origin),
        })?;
        let base = self.rules.len();
        let mut seen = std::collections::HashSet::new();
        for (index, def) in file.rules.into_iter().enumerate() {
            if !seen.insert(def.name.clone()) {
                let err = invalid(origin, &def.name, RuleError::DefinedTwice);
                return Err(locate(err, text, index));
            }
            match self.rules.iter().position(|r| r.name == def.name) {
                Some(i) => {
                    let patched =
                        patch(&self.rules[i], def, origin).map_err(|e| locate(e, text, index))?;
                    self.rules[i] = patched;
                }
                None => {
                    let rule = build(def, origin).map_err(|e| locate(e, text, index))?;
                    self.rules.push(rule);
                }
            }
        }
        let kept_on_tombstones = self.tombstone_rules();
        if kept_on_tombstones > MAX_TOMBSTONE_RULES {
            return Err(RulesError::Parse {
                origin: origin.to_owned(),
                message: format!(
                    "{kept_on_tombstones} never_after rules of scope attempt and distinct \
                     rules; at most {MAX_TOMBSTONE_RULES} are supported"
                ),
            });
        }
        if self.rules.len() > MAX_RULES {
            return Err(RulesError::Parse {
                origin: origin.to_owned(),
                message: format!(
                    "{} rules ({} added by this file to the {base} already loaded, the embedded \
                     defaults included); at most {MAX_RULES} are supported",
                    self.rules.len(),
                    self.rules.len() - base,
                ),
            });
        }
        Ok(())
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

/// Tombstones keep the fired bits of attempt-scope never-after rules (the only ones judged on
/// them) in 32 bits.
pub const MAX_TOMBSTONE_RULES: usize = 32;

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

/// The parser's message for a person: its snippet names the file (it says `<input>`), and the
/// shape mistakes it words as parser states say what was expected.
pub fn parse_message(parser: &str, origin: &str) -> String {
    let text = parser.replace("<input>", origin);
    let first = text.lines().next().unwrap_or_default();
    let hint = if first.ends_with(": expected sequence start") {
        Some(
            "a list is expected here, in brackets: `stage: [decode]`, `event: [{stage: [decode]}]`",
        )
    } else if first.ends_with("line 1 column 1: expected mapping start") {
        Some("the file must be a mapping with a `rules:` list")
    } else if first.ends_with(": expected mapping start") {
        Some("a mapping is expected here: `{stage: [decode], kind: [work]}`")
    } else {
        None
    };
    match hint {
        Some(h) => match text.split_once('\n') {
            Some((first, snippet)) => format!("{first} ({h})\n{snippet}"),
            None => format!("{text} ({h})"),
        },
        None => text,
    }
}

fn invalid(origin: &str, rule: &str, error: RuleError) -> RulesError {
    RulesError::Invalid {
        origin: origin.to_owned(),
        rule: rule.to_owned(),
        at: None,
        error,
    }
}

/// Where each rule of a rules file and its fields are, read only to place an error.
#[derive(Deserialize)]
struct SpansFile {
    rules: Vec<RuleSpans>,
}

#[derive(Deserialize)]
struct RuleSpans {
    name: serde_saphyr::Spanned<serde::de::IgnoredAny>,
    #[serde(default)]
    output: Option<serde_saphyr::Spanned<serde::de::IgnoredAny>>,
    #[serde(default)]
    never_after: Option<serde_saphyr::Spanned<serde::de::IgnoredAny>>,
    #[serde(default)]
    must_follow: Option<serde_saphyr::Spanned<serde::de::IgnoredAny>>,
    #[serde(default)]
    requires_before: Option<serde_saphyr::Spanned<serde::de::IgnoredAny>>,
    #[serde(default)]
    predicate: Option<serde_saphyr::Spanned<serde::de::IgnoredAny>>,
    #[serde(default)]
    distinct: Option<serde_saphyr::Spanned<serde::de::IgnoredAny>>,
    never: Option<serde_saphyr::Spanned<serde::de::IgnoredAny>>,
}

/// Adds the position of rule `index` of `text` to an [`RulesError::Invalid`]: the field the
/// error is about (`output` for template errors, the second shape of a rule with several),
/// else the rule's `name`.
fn locate(err: RulesError, text: &str, index: usize) -> RulesError {
    let RulesError::Invalid {
        origin,
        rule,
        at: None,
        error,
    } = err
    else {
        return err;
    };
    let spans = serde_saphyr::from_str::<SpansFile>(text)
        .ok()
        .and_then(|f| f.rules.into_iter().nth(index));
    let at = spans.map(|r| {
        let field = match &error {
            RuleError::Template(_) | RuleError::PlaceholderNotForShape { .. } => r.output.as_ref(),
            RuleError::SeveralShapes { shapes } => match shapes.get(1).copied() {
                Some("never_after") => r.never_after.as_ref(),
                Some("must_follow") => r.must_follow.as_ref(),
                Some("requires_before") => r.requires_before.as_ref(),
                Some("predicate") => r.predicate.as_ref(),
                Some("distinct") => r.distinct.as_ref(),
                Some("never") => r.never.as_ref(),
                _ => None,
            },
            _ => None,
        };
        let loc = field.map_or(r.name.referenced, |f| f.referenced);
        Position {
            line: loc.line(),
            column: loc.column(),
        }
    });
    RulesError::Invalid {
        origin,
        rule,
        at: at.filter(|p| p.line > 0),
        error,
    }
}

fn shape_of(def: &mut RuleDef) -> Result<Option<Shape>, RuleError> {
    let mut shapes = Vec::new();
    if let Some(s) = def.never_after.take() {
        shapes.push(Shape::NeverAfter(s));
    }
    if let Some(s) = def.must_follow.take() {
        shapes.push(Shape::MustFollow(s));
    }
    if let Some(s) = def.requires_before.take() {
        shapes.push(Shape::RequiresBefore(s));
    }
    if let Some(s) = def.predicate.take() {
        shapes.push(Shape::Predicate(s));
    }
    if let Some(s) = def.distinct.take() {
        shapes.push(Shape::Distinct(s));
    }
    if let Some(s) = def.never.take() {
        shapes.push(Shape::Never(s));
    }
    match shapes.len() {
        0 => Ok(None),
        1 => Ok(shapes.pop()),
        _ => Err(RuleError::SeveralShapes {
            shapes: shapes.iter().map(Shape::kind_name).collect(),
        }),
    }
}

fn build(mut def: RuleDef, origin: &str) -> Result<Rule, RulesError> {
    let name = def.name.clone();
    validate_name(&name).map_err(|m| invalid(origin, &name, m))?;
    let shape = shape_of(&mut def)
        .map_err(|m| invalid(origin, &name, m))?
        .ok_or_else(|| invalid(origin, &name, RuleError::NoShape))?;
    let rule = Rule {
        description: def
            .description
            .ok_or_else(|| invalid(origin, &name, RuleError::MissingDescription))?,
        severity: def
            .severity
            .ok_or_else(|| invalid(origin, &name, RuleError::MissingSeverity))?,
        scope: def.scope.unwrap_or_default(),
        enabled: def.enabled.unwrap_or(true),
        output: def
            .output
            .unwrap_or_else(|| default_output(&shape).to_owned()),
        shape,
        name,
    };
    validate(&rule).map_err(|m| invalid(origin, &rule.name, m))?;
    Ok(rule)
}

fn patch(base: &Rule, mut def: RuleDef, origin: &str) -> Result<Rule, RulesError> {
    let mut rule = base.clone();
    if let Some(shape) = shape_of(&mut def).map_err(|m| invalid(origin, &rule.name, m))? {
        if def.output.is_none() && rule.shape.kind_name() != shape.kind_name() {
            rule.output = default_output(&shape).to_owned();
        }
        rule.shape = shape;
    }
    if let Some(v) = def.description {
        rule.description = v;
    }
    if let Some(v) = def.severity {
        rule.severity = v;
    }
    if let Some(v) = def.scope {
        rule.scope = v;
    }
    if let Some(v) = def.enabled {
        rule.enabled = v;
    }
    if let Some(v) = def.output {
        rule.output = v;
    }
    validate(&rule).map_err(|m| invalid(origin, &rule.name, m))?;
    Ok(rule)
}

fn validate_name(name: &str) -> Result<(), RuleError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(RuleError::Name {
            name: name.to_owned(),
        })
    }
}

fn validate(rule: &Rule) -> Result<(), RuleError> {
    crate::violation::validate_template(&rule.output)?;
    let fits = rule.shape.placeholders();
    let misfits: Vec<String> = crate::violation::placeholders(&rule.output)?
        .into_iter()
        .filter(|p| !fits.contains(p))
        .map(str::to_owned)
        .collect();
    if !misfits.is_empty() {
        return Err(RuleError::PlaceholderNotForShape {
            shape: rule.shape.kind_name(),
            names: misfits,
        });
    }
    for (role, matchers) in rule.shape.matchers() {
        if matchers
            .iter()
            .any(|m| *m == crate::engine::matcher::Matcher::default())
        {
            return Err(RuleError::CatchAllMatcher { role });
        }
    }
    match &rule.shape {
        Shape::NeverAfter(s) => s.validate(),
        Shape::MustFollow(s) => s.validate(),
        Shape::RequiresBefore(s) => s.validate(),
        Shape::Predicate(s) => s.validate(),
        Shape::Distinct(_) => Ok(()),
        Shape::Never(s) => s.validate(),
    }
}

fn default_output(shape: &Shape) -> &'static str {
    match shape {
        Shape::NeverAfter(_) => {
            "{rule}: {event.stage} {event.kind} ({event.source}) after {trigger.stage} {trigger.kind} of {attempt}"
        }
        Shape::MustFollow(_) => {
            "{rule}: no expected event within the deadline after {trigger.stage} {trigger.kind} of {attempt}"
        }
        Shape::RequiresBefore(_) => {
            "{rule}: {event.stage} {event.kind} of {attempt} without the required earlier event"
        }
        Shape::Predicate(_) => {
            "{rule}: {event.stage} {event.kind} of {attempt} breaks the condition"
        }
        Shape::Distinct(_) => "{rule}: {attempt} carries {breach}",
        Shape::Never(_) => "{rule}: forbidden {event.stage} {event.kind} ({event.source})",
    }
}

impl Rule {
    pub fn to_def(&self) -> RuleDef {
        let mut def = RuleDef {
            name: self.name.clone(),
            description: Some(self.description.clone()),
            severity: Some(self.severity),
            scope: Some(self.scope),
            enabled: Some(self.enabled),
            output: Some(self.output.clone()),
            ..Default::default()
        };
        match &self.shape {
            Shape::NeverAfter(s) => def.never_after = Some(s.clone()),
            Shape::MustFollow(s) => def.must_follow = Some(s.clone()),
            Shape::RequiresBefore(s) => def.requires_before = Some(s.clone()),
            Shape::Predicate(s) => def.predicate = Some(s.clone()),
            Shape::Distinct(s) => def.distinct = Some(s.clone()),
            Shape::Never(s) => def.never = Some(s.clone()),
        }
        def
    }

    /// Longest time after its trigger this rule may still need an attempt's live state.
    pub fn horizon(&self) -> Duration {
        match &self.shape {
            Shape::MustFollow(s) => s.within.0,
            Shape::RequiresBefore(s) => s.grace.0,
            _ => Duration::ZERO,
        }
    }
}

/// Slot indices a compiled rule reads; filled by [`compile`].
#[derive(Debug, Clone, Copy, Default)]
pub struct RuleSlots {
    /// never_after: earliest trigger; must_follow: latest trigger; requires_before: earliest event.
    pub trigger: usize,
    /// never_after: latest forbidden; must_follow: earliest expected; requires_before: earliest required.
    pub other: usize,
    /// must_follow: latest expected.
    pub other_latest: usize,
    /// must_follow: earliest `given` event, when the rule has a `given`.
    pub given: Option<u8>,
    /// predicate: the earliest matching event per stage (capacity is per stage). Slot indices
    /// are below [`SlotLayout::MAX`]; bytes keep this struct small, as it is copied per rule
    /// per event.
    pub per_stage: [Option<u8>; 4],
}

impl RuleSlots {
    /// Bit set of the per-stage slots.
    pub fn stage_mask(&self) -> u64 {
        self.per_stage
            .iter()
            .flatten()
            .fold(0, |m, &k| m | (1u64 << k))
    }
}

/// A rule ready for the engine.
#[derive(Debug, Clone)]
pub struct CompiledRule {
    pub index: usize,
    pub rule: Rule,
    pub slots: RuleSlots,
}

/// Compiles the enabled rules, sharing identical slots.
///
/// Attempt-level slots live in `attempt`; request-scope never-after rules keep their trigger and
/// forbidden slots in `request` too, because their trigger may be request-level only.
pub fn compile(
    set: &RuleSet,
    attempt: &mut SlotLayout,
    request: &mut SlotLayout,
) -> Vec<CompiledRule> {
    let mut out = Vec::new();
    for (index, rule) in set.enabled().enumerate() {
        let slots = match &rule.shape {
            Shape::NeverAfter(s) => s.slots(rule.scope, attempt, request),
            Shape::MustFollow(s) => s.slots(attempt),
            Shape::RequiresBefore(s) => s.slots(attempt),
            // The earliest matching event per stage is judged again at the watermark, so facts
            // that arrive later (the input length, a capacity report) still count.
            Shape::Predicate(p) => p.slots(attempt),
            // Judged on the ids as the correlator resolves them (distinct), or on the event
            // alone as it is observed (never): no slots.
            Shape::Distinct(_) | Shape::Never(_) => RuleSlots::default(),
        };
        out.push(CompiledRule {
            index,
            rule: rule.clone(),
            slots,
        });
    }
    out
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
mod tests {
    use super::*;
    use crate::violation::TemplateError;

    #[test]
    fn distinct_takes_only_the_alias_classes_it_can_judge() {
        let ok = "rules:\n  - name: one-id-per-room\n    description: d\n    severity: info\n    distinct: {alias: request_id, per: bootstrap_room}\n";
        let set = RuleSet::from_yaml(ok, "ok.yaml").unwrap();
        assert!(matches!(set.rules[0].shape, Shape::Distinct(_)));
        let bad = ok.replace("request_id", "trace_id");
        let err = RuleSet::from_yaml(&bad, "bad.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bad.yaml") && err.contains("trace_id") && err.contains("request_id"),
            "{err}"
        );
        // A distinct rule has no trigger: `{trigger.*}` is an error at load.
        let tpl = ok.replace(
            "    distinct:",
            "    output: \"{rule} {trigger.kind}\"\n    distinct:",
        );
        let err = RuleSet::from_yaml(&tpl, "tpl.yaml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("a distinct rule has no value for"), "{err}");
    }

    #[test]
    fn embedded_defaults_have_the_documented_rules() {
        let set = RuleSet::embedded_defaults();
        let names: Vec<_> = set.rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "activity-after-rejection",
                "advanced-before-rejection",
                "handoff-after-rejection",
                "activity-after-request-failed",
                "orphaned-leg",
                "unknown-room",
                "room-collision",
                "success-after-abort",
                "stranded-kv",
                "held-decode-slot",
                "failed-room-advanced",
                "rejected-room-reused",
                "over-capacity-admitted",
                "stuck-attempt",
                "context-exceeds-capacity",
                "foreign-bootstrap-writer"
            ]
        );
        let sev = |n: &str| set.rules.iter().find(|r| r.name == n).unwrap().severity;
        assert_eq!(sev("activity-after-rejection"), Severity::Critical);
        assert_eq!(sev("handoff-after-rejection"), Severity::Critical);
        assert_eq!(sev("advanced-before-rejection"), Severity::Critical);
        assert_eq!(sev("failed-room-advanced"), Severity::Critical);
        assert_eq!(sev("rejected-room-reused"), Severity::Critical);
        assert_eq!(sev("orphaned-leg"), Severity::Warning);
        assert_eq!(sev("unknown-room"), Severity::Warning);
        assert_eq!(sev("success-after-abort"), Severity::Critical);
        assert_eq!(sev("stranded-kv"), Severity::Warning);
        assert_eq!(sev("held-decode-slot"), Severity::Warning);
        assert_eq!(sev("over-capacity-admitted"), Severity::Critical);
        assert_eq!(sev("foreign-bootstrap-writer"), Severity::Critical);
    }

    #[test]
    fn unknown_fields_report_line_and_column() {
        let yaml = "rules:\n  - name: x\n    severity: critical\n    descripton: typo\n";
        let err = RuleSet::from_yaml(yaml, "t.yaml").unwrap_err().to_string();
        assert!(err.contains("descripton"), "{err}");
        assert!(err.contains("line 4"), "{err}");
    }

    #[test]
    fn user_file_patches_and_extends_defaults() {
        let mut set = RuleSet::embedded_defaults();
        set.apply_yaml(
            "rules:\n  - name: stuck-attempt\n    enabled: false\n  - name: decode-needs-admission\n    description: d\n    severity: warning\n    requires_before:\n      event: [{stage: [decode], kind: [work]}]\n      requires: [{stage: [prefill], kind: [admitted]}]\n",
            "user.yaml",
        )
        .unwrap();
        assert!(
            !set.rules
                .iter()
                .find(|r| r.name == "stuck-attempt")
                .unwrap()
                .enabled
        );
        assert!(set.rules.iter().any(|r| r.name == "decode-needs-admission"));
    }

    #[test]
    fn tombstone_rules_are_limited_with_a_clear_error() {
        let rules = |n: usize| {
            let mut y = String::from("rules:\n");
            for i in 0..n {
                y.push_str(&format!(
                    "  - name: na-{i}\n    description: d\n    severity: info\n    never_after: {{trigger: [{{kind: [rejected]}}], forbidden: [{{kind: [work]}}]}}\n"
                ));
            }
            y
        };
        // The defaults already hold some attempt-scope never_after rules.
        let room = MAX_TOMBSTONE_RULES - RuleSet::embedded_defaults().tombstone_rules();
        let mut set = RuleSet::embedded_defaults();
        set.apply_yaml(&rules(room), "ok.yaml").unwrap();
        let mut set = RuleSet::embedded_defaults();
        let err = set
            .apply_yaml(&rules(room + 1), "u.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("33 never_after rules of scope attempt"),
            "{err}"
        );
    }

    #[test]
    fn new_rule_needs_a_shape_and_a_severity() {
        let err = RuleSet::embedded_defaults()
            .apply_yaml(
                "rules:\n  - name: brand-new\n    description: d\n    severity: info\n",
                "u.yaml",
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                RulesError::Invalid {
                    error: RuleError::NoShape,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("no shape given"), "{err}");
        let err = RuleSet::from_yaml(
            "rules:\n  - name: n\n    description: d\n    never_after: {trigger: [{kind: [rejected]}], forbidden: [{kind: [work]}]}\n",
            "u.yaml",
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                RulesError::Invalid {
                    error: RuleError::MissingSeverity,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("missing severity"), "{err}");
    }

    #[test]
    fn invalid_rules_name_the_rule_the_origin_and_the_failure() {
        let err = RuleSet::embedded_defaults()
            .apply_yaml(
                "rules:\n  - name: brand-new\n    description: d\n    severity: info\n",
                "u.yaml",
            )
            .unwrap_err();
        assert!(
            matches!(&err, RulesError::Invalid { rule, error: RuleError::NoShape, .. } if rule == "brand-new"),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "rule \"brand-new\" in u.yaml at line 2, column 11: no such default rule to patch, and no shape given \
             (never_after, must_follow, requires_before, predicate, distinct or never)"
        );
        let err = RuleSet::from_yaml(
            "rules:\n  - name: Bad\n    description: d\n    severity: info\n    never_after: {trigger: [{kind: [rejected]}], forbidden: []}\n",
            "u.yaml",
        )
        .unwrap_err();
        assert!(
            matches!(&err, RulesError::Invalid { error: RuleError::Name { name }, .. } if name == "Bad"),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "rule \"Bad\" in u.yaml at line 2, column 11: names are 1-64 characters of a-z, 0-9, '-' and '_'"
        );
        let err = RuleSet::from_yaml(
            "rules:\n  - name: n\n    description: d\n    severity: info\n    never_after: {trigger: [{kind: [rejected]}], forbidden: []}\n",
            "u.yaml",
        )
        .unwrap_err();
        assert!(
            matches!(
                &err,
                RulesError::Invalid {
                    error: RuleError::NeverAfterMatchers {
                        trigger: 1,
                        forbidden: 0
                    },
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "rule \"n\" in u.yaml at line 2, column 11: never_after needs at least one trigger and one forbidden matcher"
        );
    }

    #[test]
    fn template_and_shape_errors_carry_line_and_column_and_every_placeholder() {
        let text = "rules:\n  - name: my-rule\n    description: d\n    severity: info\n    \
                    output: \"{rule} {event.node} {foo}\"\n    never_after:\n      trigger: \
                    [{kind: [rejected]}]\n      forbidden: [{kind: [work]}]\n";
        let err = RuleSet::from_yaml(text, "r.yaml").unwrap_err().to_string();
        assert!(
            err.starts_with(
                "rule \"my-rule\" in r.yaml at line 5, column 13: unknown placeholders \
                 {event.node}, {foo} in output template"
            ),
            "{err}"
        );
        let text = "rules:\n  - name: two\n    description: d\n    severity: info\n    \
                    never_after: {trigger: [{kind: [rejected]}], forbidden: [{kind: [work]}]}\n    \
                    predicate: {on: [{kind: [admitted]}], all: [{field: input_tokens, gt: {value: 1}}]}\n";
        let err = RuleSet::from_yaml(text, "r.yaml").unwrap_err();
        assert!(
            matches!(
                &err,
                RulesError::Invalid {
                    at: Some(Position { line: 6, .. }),
                    error: RuleError::SeveralShapes { .. },
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("at line 6, column "), "{err}");
        // Errors without a field of their own point at the rule's name.
        let err = RuleSet::from_yaml(
            "rules:\n  - name: a\n    description: d\n    severity: info\n    \
             never_after: {trigger: [{kind: [rejected]}], forbidden: [{kind: [work]}]}\n  \
             - name: a\n",
            "r.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("in r.yaml at line 6, column 11: defined twice"),
            "{err}"
        );
    }

    #[test]
    fn placeholders_that_do_not_fit_the_shape_are_errors_at_load() {
        let predicate = "rules:\n  - name: p\n    description: d\n    severity: info\n    \
                         output: \"trigger={trigger.stage}/{trigger.kind} within={within} \
                         delay={delay} {breach}\"\n    predicate: {on: [{kind: [admitted]}], \
                         all: [{field: input_tokens, gt: {value: 1}}]}\n";
        let err = RuleSet::from_yaml(predicate, "r.yaml").unwrap_err();
        assert!(
            matches!(
                &err,
                RulesError::Invalid {
                    error: RuleError::PlaceholderNotForShape { shape: "predicate", names },
                    ..
                } if names == &["trigger.stage", "trigger.kind", "within", "delay"]
            ),
            "{err:?}"
        );
        assert!(
            err.to_string().contains(
                "placeholders {trigger.stage}, {trigger.kind}, {within}, {delay} in output \
                 template: a predicate rule has no value for them"
            ),
            "{err}"
        );
        // Patching a default's output is checked against its shape too.
        let err = RuleSet::embedded_defaults()
            .apply_yaml(
                "rules:\n  - name: orphaned-leg\n    output: \"{event.kind}\"\n",
                "u.yaml",
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a must_follow rule has no value for it"),
            "{err}"
        );
        // Every default fits its shape.
        for r in &RuleSet::embedded_defaults().rules {
            for p in crate::violation::placeholders(&r.output).unwrap() {
                assert!(r.shape.placeholders().contains(&p), "{}: {p}", r.name);
            }
            for p in r.shape.placeholders() {
                assert!(crate::violation::TEMPLATE_FIELDS.contains(p), "{p}");
            }
        }
    }

    #[test]
    fn catch_all_matchers_are_errors() {
        let err = RuleSet::from_yaml(
            "rules:\n  - name: all\n    description: d\n    severity: info\n    \
             never_after: {trigger: [{}], forbidden: [{kind: [work]}]}\n",
            "r.yaml",
        )
        .unwrap_err();
        assert!(
            matches!(
                &err,
                RulesError::Invalid {
                    error: RuleError::CatchAllMatcher { role: "trigger" },
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("would match every event"), "{err}");
    }

    #[test]
    fn never_rules_load_and_their_errors_carry_line_and_column() {
        let set = RuleSet::from_yaml(
            "rules:\n  - name: no-foreign\n    description: d\n    severity: critical\n    \
             never:\n      event: [{stage: [transfer], peer: [foreign, unattributed]}]\n",
            "r.yaml",
        )
        .unwrap();
        let Shape::Never(n) = &set.rules[0].shape else {
            panic!("{:?}", set.rules[0].shape)
        };
        assert_eq!(
            n.event[0].peer,
            [
                crate::event::Peer::Foreign,
                crate::event::Peer::Unattributed
            ]
        );
        // An empty list, an unknown peer, a catch-all matcher, a placeholder it has no value for.
        let err = RuleSet::from_yaml(
            "rules:\n  - name: n\n    description: d\n    severity: info\n    never: {event: []}\n",
            "r.yaml",
        )
        .unwrap_err();
        assert!(
            matches!(
                &err,
                RulesError::Invalid {
                    error: RuleError::NeverMatchers,
                    at: Some(Position { line: 2, .. }),
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("at line 2, column 11"), "{err}");
        let err = RuleSet::from_yaml(
            "rules:\n  - name: n\n    description: d\n    severity: info\n    never:\n      \
             event: [{peer: [stranger]}]\n",
            "r.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("stranger") && err.contains("line 6"), "{err}");
        let err = RuleSet::from_yaml(
            "rules:\n  - name: n\n    description: d\n    severity: info\n    never: {event: [{}]}\n",
            "r.yaml",
        )
        .unwrap_err();
        assert!(
            matches!(
                &err,
                RulesError::Invalid {
                    error: RuleError::CatchAllMatcher { role: "event" },
                    ..
                }
            ),
            "{err:?}"
        );
        let err = RuleSet::from_yaml(
            "rules:\n  - name: n\n    description: d\n    severity: info\n    \
             output: \"{delay}\"\n    never: {event: [{peer: [foreign]}]}\n",
            "r.yaml",
        )
        .unwrap_err();
        assert!(
            matches!(
                &err,
                RulesError::Invalid {
                    error: RuleError::PlaceholderNotForShape { shape: "never", .. },
                    at: Some(Position { line: 5, .. }),
                    ..
                }
            ),
            "{err:?}"
        );
        // Two shapes: the second one is pointed at.
        let err = RuleSet::from_yaml(
            "rules:\n  - name: n\n    description: d\n    severity: info\n    \
             predicate: {on: [{kind: [admitted]}], all: [{field: input_tokens, gt: {value: 1}}]}\n    \
             never: {event: [{peer: [foreign]}]}\n",
            "r.yaml",
        )
        .unwrap_err();
        assert!(
            matches!(
                &err,
                RulesError::Invalid {
                    error: RuleError::SeveralShapes { .. },
                    at: Some(Position { line: 6, .. }),
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn syntax_errors_name_the_file() {
        let err = RuleSet::from_yaml("rules:\n  - name: [\n", "r.yaml")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("<input>"), "{err}");
    }

    #[test]
    fn bad_template_and_duration_are_errors() {
        let err = RuleSet::embedded_defaults()
            .apply_yaml(
                "rules:\n  - name: orphaned-leg\n    output: \"{nope}\"\n",
                "u.yaml",
            )
            .unwrap_err();
        assert!(
            matches!(
                &err,
                RulesError::Invalid {
                    error: RuleError::Template(TemplateError::UnknownPlaceholder { names }),
                    ..
                } if names == &["nope"]
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("{nope}"), "{err}");
        let err = RuleSet::embedded_defaults()
            .apply_yaml(
                "rules:\n  - name: x\n    description: d\n    severity: info\n    must_follow: {trigger: [{kind: [admitted]}], expect: [{kind: [completed]}], within: soon}\n",
                "u.yaml",
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains("invalid duration"), "{err}");
    }
}
