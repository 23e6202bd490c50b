//! The most recent violations the alert dispatcher received, in a bounded ring (newest first on
//! read), for the admin server's `/api/violations`.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::Serialize;

use crate::violation::Violation;

#[derive(Debug, Clone, Serialize)]
pub struct RecentViolation {
    /// Wall clock (unix ns) when the dispatcher received it.
    pub received_at_ns: u64,
    #[serde(flatten)]
    pub violation: Violation,
}

/// What the memory budget charges per kept violation: the struct and its strings and evidence
/// (a summary line, aliases, a few evidence entries).
pub const VIOLATION_BYTES: usize = std::mem::size_of::<RecentViolation>() + 2048;

#[derive(Debug)]
pub struct RecentViolations {
    cap: usize,
    inner: Mutex<(VecDeque<RecentViolation>, u64)>,
    /// The rules that can fire (set once the engine's rules are known): a filter on another
    /// name is a mistake, not an empty answer.
    rules: std::sync::OnceLock<Vec<String>>,
}

impl RecentViolations {
    pub fn new(cap: usize) -> RecentViolations {
        RecentViolations {
            cap: cap.max(1),
            inner: Mutex::new((VecDeque::new(), 0)),
            rules: std::sync::OnceLock::new(),
        }
    }

    /// Names the rules that can fire (the first call counts).
    pub fn set_rules(&self, names: Vec<String>) {
        let _ = self.rules.set(names);
    }

    /// The rules that can fire, once known.
    pub fn rules(&self) -> Option<&[String]> {
        self.rules.get().map(Vec::as_slice)
    }

    /// Estimated heap bytes held now (for the memory budget's account).
    pub fn estimated_bytes(&self) -> usize {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.0.len() * VIOLATION_BYTES
    }

    /// Violations pushed out of the ring since start.
    pub fn evicted(&self) -> u64 {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.1 - g.0.len() as u64
    }

    pub fn push(&self, v: &Violation, received_at_ns: u64) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.0.push_back(RecentViolation {
            received_at_ns,
            violation: v.clone(),
        });
        g.1 += 1;
        while g.0.len() > self.cap {
            g.0.pop_front();
        }
    }

    /// Newest first; optionally only one rule or one fingerprint. Returns (items, total seen).
    pub fn list(
        &self,
        limit: usize,
        rule: Option<&str>,
        fingerprint: Option<&str>,
    ) -> (Vec<RecentViolation>, u64) {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let items =
            g.0.iter()
                .rev()
                .filter(|r| rule.is_none_or(|x| r.violation.rule == x))
                .filter(|r| fingerprint.is_none_or(|x| r.violation.fingerprint == x))
                .take(limit)
                .cloned()
                .collect();
        (items, g.1)
    }
}
