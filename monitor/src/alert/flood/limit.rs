//! Rate limit per lead rule: fixed windows, the summaries of what they suppressed, and the tick
//! that closes them and forgets incidents past the dedup window.

use std::collections::HashMap;

use super::{ActiveAlert, FloodConfig, FloodControl};
use crate::alert::notification::SuppressedSummary;

#[derive(Debug, Default)]
pub(super) struct RuleWindow {
    start_ns: u64,
    sent: u32,
    suppressed: u64,
    findings: u64,
    sample: Vec<String>,
}

pub(super) const SAMPLE: usize = 5;

impl FloodControl {
    /// Closes rate windows (returning summaries of what they suppressed) and forgets incidents
    /// not seen within the dedup window (returning the notified ones as resolved).
    pub fn tick(&mut self, now_ns: u64) -> (Vec<SuppressedSummary>, Vec<ActiveAlert>) {
        let rw = self.cfg.rate_limit_window.as_nanos() as u64;
        let mut closed = Vec::new();
        for (rule, w) in &self.rules {
            if now_ns.saturating_sub(w.start_ns) >= rw {
                closed.push(rule.clone());
            }
        }
        let summaries = self.close_windows(closed, now_ns);
        let mut resolved = std::mem::take(&mut self.evicted);
        resolved.extend(self.expire(now_ns));
        (summaries, resolved)
    }

    /// At shutdown: summaries for every rate window that suppressed something.
    pub fn flush_summaries(&mut self, now_ns: u64) -> Vec<SuppressedSummary> {
        let rules: Vec<String> = self.rules.keys().cloned().collect();
        self.close_windows(rules, now_ns)
    }

    /// Closes the rate windows of `rules` at `now_ns`: a summary for each that suppressed
    /// something.
    fn close_windows(&mut self, rules: Vec<String>, now_ns: u64) -> Vec<SuppressedSummary> {
        let mut out = Vec::new();
        for rule in rules {
            let w = self.rules.remove(&rule).expect("an open window");
            if w.suppressed > 0 {
                let id = Self::next_id(&mut self.seq, self.epoch_ns, &format!("suppressed-{rule}"));
                out.push(SuppressedSummary {
                    id,
                    rule,
                    suppressed: w.suppressed,
                    findings: w.findings,
                    fingerprints_sample: w.sample,
                    window_start_ns: w.start_ns,
                    window_end_ns: now_ns,
                    limit: self.cfg.rate_limit,
                    received_at_ns: now_ns,
                });
            }
        }
        out
    }
}

/// One notification led by `rule` wants out: whether its rate window allows it. `force` takes
/// the slot even beyond the limit.
pub(super) fn rate_ok(
    rules: &mut HashMap<String, RuleWindow>,
    cfg: &FloodConfig,
    rule: &str,
    fingerprint: &str,
    findings: u64,
    now_ns: u64,
    force: bool,
) -> bool {
    if cfg.rate_limit == 0 {
        return true;
    }
    let w = rules.entry(rule.to_string()).or_insert_with(|| RuleWindow {
        start_ns: now_ns,
        ..Default::default()
    });
    if w.sent < cfg.rate_limit || force {
        w.sent = w.sent.saturating_add(1);
        true
    } else {
        w.suppressed += 1;
        w.findings += findings;
        if w.sample.len() < SAMPLE && !w.sample.iter().any(|f| f == fingerprint) {
            w.sample.push(fingerprint.to_string());
        }
        false
    }
}
