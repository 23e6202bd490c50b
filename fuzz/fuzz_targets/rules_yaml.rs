//! The rules YAML compiler (`engine::rules`): a document as a whole rule set (`from_yaml`, inputs
//! of even length) or as a `--rules FILE` over the embedded defaults (`apply_yaml`, odd length),
//! then compiled into slots.
//!
//! Holds: no panic; a refused document gets an error with a message (and a rule error names
//! what is wrong); an accepted set has at most `MAX_RULES` rules, compiles, and what
//! `revenant rules list --yaml` prints for it loads back into the same set.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use revenant::RuleSet;
use revenant::engine::rules::{self, MAX_RULES, RuleDef, RulesError};
use revenant::engine::state::SlotLayout;

#[derive(serde::Serialize)]
struct Doc {
    rules: Vec<RuleDef>,
}

fn listed(set: &RuleSet) -> String {
    serde_saphyr::to_string(&Doc {
        rules: set.to_defs(),
    })
    .expect("a loaded rule set serializes")
}

fn check(result: Result<RuleSet, RulesError>) {
    let set = match result {
        Ok(set) => set,
        Err(e) => {
            assert!(!e.to_string().trim().is_empty());
            match &e {
                RulesError::Parse { message, .. } => {
                    assert!(!message.trim().is_empty(), "{e}")
                }
                RulesError::Invalid { error, .. } => {
                    assert!(!error.to_string().trim().is_empty(), "{e}")
                }
                RulesError::Read { .. } => panic!("no file was read: {e}"),
            }
            return;
        }
    };
    assert!(set.rules.len() <= MAX_RULES);
    let (mut attempt, mut request) = (SlotLayout::default(), SlotLayout::default());
    let compiled = rules::compile(&set, &mut attempt, &mut request);
    assert_eq!(compiled.len(), set.enabled().count());
    let yaml = listed(&set);
    let back = RuleSet::from_yaml(&yaml, "rules list --yaml")
        .unwrap_or_else(|e| panic!("the listed rules do not load back: {e}\n{yaml}"));
    assert_eq!(
        back.rules, set.rules,
        "the listed rules load back differently:\n{yaml}"
    );
}

/// Parsed once: every input patches a copy.
static DEFAULTS: LazyLock<RuleSet> = LazyLock::new(RuleSet::embedded_defaults);

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // One parse per execution (parsing is most of the cost): the length's parity picks the
    // entry point, so a mutation that only adds or drops a byte tries the same text in both.
    if text.len() % 2 == 0 {
        check(RuleSet::from_yaml(text, "fuzz input"));
    } else {
        let mut defaults = DEFAULTS.clone();
        check(defaults.apply_yaml(text, "fuzz input").map(|()| defaults));
    }
});
