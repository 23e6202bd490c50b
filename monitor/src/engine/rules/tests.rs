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
            "foreign-bootstrap-writer",
            "second-decode-owner",
            "readiness-out-of-order",
            "kv-handoff-mismatch"
        ]
    );
    let sev = |n: &str| set.rules.iter().find(|r| r.name == n).unwrap().severity;
    assert_eq!(sev("activity-after-rejection"), Severity::Critical);
    assert_eq!(sev("handoff-after-rejection"), Severity::Critical);
    assert_eq!(sev("advanced-before-rejection"), Severity::Critical);
    assert_eq!(sev("failed-room-advanced"), Severity::Critical);
    assert_eq!(sev("rejected-room-reused"), Severity::Critical);
    assert_eq!(sev("second-decode-owner"), Severity::Critical);
    assert_eq!(sev("readiness-out-of-order"), Severity::Critical);
    assert_eq!(sev("kv-handoff-mismatch"), Severity::Critical);
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
