//! The rules file: YAML parsed into [`RuleDef`]s, each built into a new [`Rule`] or patched onto
//! the rule of its name, validated (name, one shape, template placeholders that fit the shape,
//! matchers with a condition), and an error placed at the line and column of the field at fault.

use serde::{Deserialize, Serialize};

use super::{
    Distinct, MAX_RULES, MAX_TOMBSTONE_RULES, MustFollow, Never, NeverAfter, Position, Predicate,
    RequiresBefore, Rule, RuleError, RuleSet, RulesError, Scope, Shape,
};
use crate::violation::Severity;

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

impl RuleSet {
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
