//! `predicate`: a condition on the numbers of one event, e.g. admitted input above capacity.
//!
//! Operands are literal values, other fields of the event, or the stage's capacity: the event's
//! own limits when it carries them, else the latest `capacity` report of the same worker (or,
//! without a worker, the same node) and stage.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{RuleError, RuleSlots};
use crate::engine::matcher::Matcher;
use crate::engine::state::{Keep, SlotLayout};
use crate::event::{Kind, LifecycleEvent, Stage};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NumField {
    InputTokens,
    ContextTokens,
    MaxInputTokens,
    MaxTotalTokens,
    Status,
}

impl NumField {
    pub fn as_str(self) -> &'static str {
        match self {
            NumField::InputTokens => "input_tokens",
            NumField::ContextTokens => "context_tokens",
            NumField::MaxInputTokens => "max_input_tokens",
            NumField::MaxTotalTokens => "max_total_tokens",
            NumField::Status => "status",
        }
    }

    fn of(self, e: &LifecycleEvent) -> Option<u64> {
        match self {
            NumField::InputTokens => e.input_tokens,
            NumField::ContextTokens => e.context_tokens,
            NumField::MaxInputTokens => e.max_input_tokens,
            NumField::MaxTotalTokens => e.max_total_tokens,
            NumField::Status => e.status.map(u64::from),
        }
    }
}

/// What a stage can really process, as last reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capacity {
    pub context_tokens: Option<u64>,
    pub max_input_tokens: Option<u64>,
    pub max_total_tokens: Option<u64>,
}

impl Capacity {
    pub fn from_event(e: &LifecycleEvent) -> Capacity {
        Capacity {
            context_tokens: e.context_tokens,
            max_input_tokens: e.max_input_tokens,
            max_total_tokens: e.max_total_tokens,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.context_tokens.is_none()
            && self.max_input_tokens.is_none()
            && self.max_total_tokens.is_none()
    }

    /// The smaller of the two hard limits: configured context length is not processable capacity.
    pub fn processable(&self) -> Option<u64> {
        match (self.max_input_tokens, self.max_total_tokens) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Newer values win field by field.
    pub fn update(&mut self, newer: Capacity) {
        self.context_tokens = newer.context_tokens.or(self.context_tokens);
        self.max_input_tokens = newer.max_input_tokens.or(self.max_input_tokens);
        self.max_total_tokens = newer.max_total_tokens.or(self.max_total_tokens);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CapacityField {
    ContextTokens,
    MaxInputTokens,
    MaxTotalTokens,
    /// min(max_input_tokens, max_total_tokens).
    Processable,
}

impl CapacityField {
    fn of(self, c: &Capacity) -> Option<u64> {
        match self {
            CapacityField::ContextTokens => c.context_tokens,
            CapacityField::MaxInputTokens => c.max_input_tokens,
            CapacityField::MaxTotalTokens => c.max_total_tokens,
            CapacityField::Processable => c.processable(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Operand {
    Value(u64),
    Field(NumField),
    Capacity(CapacityField),
}

/// `field <op> operand`, written with exactly one of gt, ge, lt, le, eq.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Comparison {
    pub field: NumField,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gt: Option<Operand>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ge: Option<Operand>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lt: Option<Operand>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub le: Option<Operand>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eq: Option<Operand>,
    /// Added to the operand: `context_tokens gt max_input_tokens plus 1` allows the one output
    /// token SGLang reserves (its max input is context − 1 on a healthy worker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plus: Option<u64>,
}

impl Comparison {
    /// The operator and operand, for a comparison already validated by [`Self::op`] (rules are
    /// checked when loaded): the first one set, without building the list.
    #[inline]
    fn set_op(&self) -> Option<(&'static str, Operand)> {
        if let Some(o) = self.gt {
            Some(("gt", o))
        } else if let Some(o) = self.ge {
            Some(("ge", o))
        } else if let Some(o) = self.lt {
            Some(("lt", o))
        } else if let Some(o) = self.le {
            Some(("le", o))
        } else {
            self.eq.map(|o| ("eq", o))
        }
    }

    fn op(&self) -> Result<(&'static str, Operand), RuleError> {
        let ops = [
            ("gt", self.gt),
            ("ge", self.ge),
            ("lt", self.lt),
            ("le", self.le),
            ("eq", self.eq),
        ];
        let set: Vec<_> = ops
            .into_iter()
            .filter_map(|(n, o)| o.map(|o| (n, o)))
            .collect();
        match set[..] {
            [one] => Ok(one),
            _ => Err(RuleError::ComparisonOperator {
                field: self.field,
                ops: set.iter().map(|(n, _)| *n).collect(),
            }),
        }
    }
}

/// The numbers that made a predicate hold, for the violation's summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breach {
    pub field: NumField,
    pub value: u64,
    pub op: &'static str,
    pub limit: u64,
}

/// "field value op limit", e.g. `context_tokens 9000 > 8192` (the summary's `{breach}`).
impl fmt::Display for Breach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = match self.op {
            "gt" => ">",
            "ge" => ">=",
            "lt" => "<",
            "le" => "<=",
            _ => "==",
        };
        write!(
            f,
            "{} {} {op} {}",
            self.field.as_str(),
            self.value,
            self.limit
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Predicate {
    pub on: Vec<Matcher>,
    /// Breach when every comparison holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub all: Vec<Comparison>,
    /// Breach when any comparison holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub any: Vec<Comparison>,
}

/// Values the event itself may lack but its attempt or worker knows.
#[derive(Debug, Clone, Copy, Default)]
pub struct Known {
    /// The attempt's input length from an earlier event (e.g. the router's dispatch).
    pub input_tokens: Option<u64>,
    /// The latest capacity report of the event's worker and stage.
    pub capacity: Option<Capacity>,
}

impl Predicate {
    /// One slot per stage the rule can match: capacity, and so the verdict, depends on the stage.
    /// Capacity reports are worker facts, not attempt events, and get no slot.
    pub fn slots(&self, attempt: &mut SlotLayout) -> RuleSlots {
        let mut per_stage = [None; 4];
        for stage in Stage::ALL {
            let on: Vec<Matcher> = self
                .on
                .iter()
                .filter(|m| m.stage.is_empty() || m.stage.contains(&stage))
                .filter(|m| m.kind.is_empty() || m.kind.iter().any(|k| *k != Kind::Capacity))
                .map(|m| Matcher {
                    stage: vec![stage],
                    ..m.clone()
                })
                .collect();
            if !on.is_empty() {
                per_stage[stage as usize] = Some(attempt.slot(&on, Keep::Earliest) as u8);
            }
        }
        RuleSlots {
            per_stage,
            ..Default::default()
        }
    }

    pub fn validate(&self) -> Result<(), RuleError> {
        if self.on.is_empty() {
            return Err(RuleError::PredicateNoOn);
        }
        if self.all.is_empty() == self.any.is_empty() {
            return Err(RuleError::PredicateAllOrAny {
                all: self.all.len(),
                any: self.any.len(),
            });
        }
        for c in self.all.iter().chain(&self.any) {
            c.op()?;
        }
        Ok(())
    }

    /// The first comparison that makes the predicate breached, if it is.
    pub fn evaluate(&self, e: &LifecycleEvent, known: Known) -> Option<Breach> {
        let capacity = {
            let mut c = known.capacity.unwrap_or_default();
            c.update(Capacity::from_event(e));
            c
        };
        let field = |f: NumField| match f {
            NumField::InputTokens => f.of(e).or(known.input_tokens),
            _ => f.of(e),
        };
        let check = |c: &Comparison| -> Option<Breach> {
            let (op, operand) = c.set_op()?;
            let value = field(c.field)?;
            let limit = match operand {
                Operand::Value(v) => v,
                Operand::Field(f) => field(f)?,
                Operand::Capacity(f) => f.of(&capacity)?,
            }
            .saturating_add(c.plus.unwrap_or(0));
            let holds = match op {
                "gt" => value > limit,
                "ge" => value >= limit,
                "lt" => value < limit,
                "le" => value <= limit,
                _ => value == limit,
            };
            holds.then_some(Breach {
                field: c.field,
                value,
                op,
                limit,
            })
        };
        if !self.all.is_empty() {
            let mut first = None;
            for c in &self.all {
                let b = check(c)?;
                first.get_or_insert(b);
            }
            first
        } else {
            self.any.iter().find_map(check)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Source;

    fn over_capacity() -> Predicate {
        Predicate {
            on: vec![Matcher {
                kind: vec![Kind::Admitted],
                ..Default::default()
            }],
            all: vec![Comparison {
                field: NumField::InputTokens,
                gt: Some(Operand::Capacity(CapacityField::Processable)),
                ge: None,
                lt: None,
                le: None,
                eq: None,
                plus: None,
            }],
            any: vec![],
        }
    }

    #[test]
    fn capacity_from_the_event_or_the_report() {
        let p = over_capacity();
        let e = LifecycleEvent::new(1, Stage::Prefill, Kind::Admitted, Source::Otlp)
            .with_input_tokens(9000);
        assert_eq!(
            p.evaluate(&e, Known::default()),
            None,
            "unknown capacity is no breach"
        );
        let report = Capacity {
            context_tokens: Some(32768),
            max_input_tokens: None,
            max_total_tokens: Some(8192),
        };
        let b = p
            .evaluate(
                &e,
                Known {
                    input_tokens: None,
                    capacity: Some(report),
                },
            )
            .unwrap();
        assert_eq!((b.value, b.limit), (9000, 8192));
        let mut own = e.clone();
        own.max_total_tokens = Some(10_000);
        assert_eq!(
            p.evaluate(
                &own,
                Known {
                    input_tokens: None,
                    capacity: Some(report)
                }
            ),
            None
        );
    }

    #[test]
    fn input_tokens_fall_back_to_the_attempt() {
        let p = over_capacity();
        let mut e = LifecycleEvent::new(1, Stage::Decode, Kind::Admitted, Source::Otlp);
        e.max_input_tokens = Some(100);
        assert!(
            p.evaluate(
                &e,
                Known {
                    input_tokens: Some(101),
                    capacity: None
                }
            )
            .is_some()
        );
        assert!(
            p.evaluate(
                &e,
                Known {
                    input_tokens: Some(100),
                    capacity: None
                }
            )
            .is_none()
        );
    }

    #[test]
    fn any_of_several() {
        let cmp = |f| Comparison {
            field: NumField::ContextTokens,
            gt: Some(Operand::Field(f)),
            ge: None,
            lt: None,
            le: None,
            eq: None,
            plus: None,
        };
        let p = Predicate {
            on: vec![Matcher::default()],
            all: vec![],
            any: vec![cmp(NumField::MaxInputTokens), cmp(NumField::MaxTotalTokens)],
        };
        let mut e = LifecycleEvent::new(1, Stage::Prefill, Kind::Capacity, Source::Otlp);
        e.context_tokens = Some(32768);
        e.max_total_tokens = Some(8192);
        assert_eq!(p.evaluate(&e, Known::default()).unwrap().limit, 8192);
        e.max_total_tokens = Some(40000);
        assert!(p.evaluate(&e, Known::default()).is_none());
    }

    #[test]
    fn validation() {
        let mut p = over_capacity();
        p.all[0].lt = Some(Operand::Value(1));
        let err = p.validate().unwrap_err();
        assert_eq!(
            err,
            RuleError::ComparisonOperator {
                field: NumField::InputTokens,
                ops: vec!["gt", "lt"],
            }
        );
        assert!(err.to_string().contains("exactly one of gt"), "{err}");
        p.all.clear();
        assert_eq!(
            p.validate(),
            Err(RuleError::PredicateAllOrAny { all: 0, any: 0 })
        );
    }

    /// The default rule on a healthy SGLang worker (max input = context - 1) and on one whose KV
    /// pool is smaller than its context.
    #[test]
    fn default_context_rule_allows_the_reserved_output_token() {
        let rules = crate::engine::check::RuleSet::embedded_defaults();
        let rule = rules
            .rules
            .iter()
            .find(|r| r.name == "context-exceeds-capacity")
            .expect("default rule");
        let crate::engine::rules::Shape::Predicate(p) = &rule.shape else {
            panic!("context-exceeds-capacity is a predicate");
        };
        let report = |ctx, max_in, total| {
            let mut e = LifecycleEvent::new(1, Stage::Prefill, Kind::Capacity, Source::Ebpf);
            e.context_tokens = Some(ctx);
            e.max_input_tokens = Some(max_in);
            e.max_total_tokens = Some(total);
            p.evaluate(&e, Known::default())
        };
        assert_eq!(report(32768, 32767, 500_000), None, "healthy SGLang worker");
        let b = report(32768, 8191, 8192).expect("pool smaller than the context");
        assert_eq!((b.value, b.limit), (32768, 8192));
        assert!(
            report(32768, 16000, 500_000).is_some(),
            "max input cut below the context"
        );
    }
}
