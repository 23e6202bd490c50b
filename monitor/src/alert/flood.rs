//! Dedup and flood control, sans-IO: `admit(violation, now)` and `tick(now)`.
//!
//! One notification per fingerprint within the dedup window; repeats inside the window only bump
//! a count, which the next notification for that fingerprint carries. Then a per-rule fixed-window
//! rate limit: beyond `rate_limit` notifications per window, violations are counted instead and a
//! single summary notification reports them when the window closes.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::notification::{Links, SuppressedSummary, ViolationAlert};
use crate::violation::Violation;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FloodConfig {
    /// Repeats of a fingerprint within this window are folded into one notification.
    #[serde(with = "humantime_serde_compat")]
    pub dedup_window: Duration,
    /// Notifications per rule per `rate_limit_window`; 0 disables the limit.
    pub rate_limit: u32,
    #[serde(with = "humantime_serde_compat")]
    pub rate_limit_window: Duration,
    /// Fingerprints remembered for dedup (and re-posting to Alertmanager).
    pub max_tracked: usize,
}

impl Default for FloodConfig {
    fn default() -> Self {
        FloodConfig {
            dedup_window: Duration::from_secs(300),
            rate_limit: 50,
            rate_limit_window: Duration::from_secs(60),
            max_tracked: 10_000,
        }
    }
}

impl FloodConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.rate_limit > 0 && self.rate_limit_window.is_zero() {
            return Err("rate_limit_window must be > 0 when rate_limit is set".into());
        }
        if self.max_tracked == 0 {
            return Err("max_tracked must be > 0".into());
        }
        Ok(())
    }
}

/// serde helper: durations as humantime strings ("5m", "30s").
pub mod humantime_serde_compat {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}

// Returned by value once per violation and consumed at once.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// Notify now.
    Notify(ViolationAlert),
    /// Folded into an open notification.
    Duplicate { repeats: u64 },
    /// Over the rule's rate limit: summarised later.
    RateLimited,
}

#[derive(Debug)]
struct Tracked {
    last_notified_ns: u64,
    last_seen_ns: u64,
    repeats: u64,
    /// The last notification, for re-posting while active.
    alert: ViolationAlert,
}

#[derive(Debug, Default)]
struct RuleWindow {
    start_ns: u64,
    sent: u32,
    suppressed: u64,
    sample: Vec<String>,
}

/// An alert still firing (seen within the dedup window), as re-posted to Alertmanager.
#[derive(Debug, Clone, PartialEq)]
pub struct ActiveAlert {
    pub alert: ViolationAlert,
    pub last_seen_ns: u64,
    /// Occurrences since the last notification.
    pub repeats: u64,
}

#[derive(Debug)]
pub struct FloodControl {
    cfg: FloodConfig,
    tracked: HashMap<String, Tracked>,
    rules: HashMap<String, RuleWindow>,
    /// Makes notification ids unique within this process; combined with the start time, across
    /// restarts too.
    seq: u64,
    epoch_ns: u64,
    /// Notifications sent untracked because `max_tracked` was reached.
    pub untracked: u64,
}

const SAMPLE: usize = 5;

impl FloodControl {
    pub fn new(cfg: FloodConfig, epoch_ns: u64) -> FloodControl {
        FloodControl {
            cfg,
            tracked: HashMap::new(),
            rules: HashMap::new(),
            seq: 0,
            epoch_ns,
            untracked: 0,
        }
    }

    fn next_id(&mut self, prefix: &str) -> String {
        self.seq += 1;
        format!("{prefix}-{:x}-{}", self.epoch_ns, self.seq)
    }

    pub fn admit(&mut self, v: &Violation, links: Links, now_ns: u64) -> Admission {
        let window = self.cfg.dedup_window.as_nanos() as u64;
        let mut occurrences = 1;
        if let Some(t) = self.tracked.get_mut(&v.fingerprint) {
            t.last_seen_ns = now_ns;
            if now_ns.saturating_sub(t.last_notified_ns) < window {
                t.repeats += 1;
                return Admission::Duplicate { repeats: t.repeats };
            }
            occurrences += t.repeats;
        }
        if !self.rate_ok(&v.rule, &v.fingerprint, now_ns) {
            return Admission::RateLimited;
        }
        let alert = ViolationAlert {
            id: self.next_id(&v.fingerprint),
            occurrences,
            detected_at: super::notification::rfc3339(v.detected_at_ns),
            received_at_ns: now_ns,
            violation: v.clone(),
            links,
        };
        if self.tracked.len() >= self.cfg.max_tracked && !self.tracked.contains_key(&v.fingerprint)
        {
            self.expire(now_ns);
        }
        if self.tracked.len() < self.cfg.max_tracked || self.tracked.contains_key(&v.fingerprint) {
            self.tracked.insert(
                v.fingerprint.clone(),
                Tracked {
                    last_notified_ns: now_ns,
                    last_seen_ns: now_ns,
                    repeats: 0,
                    alert: alert.clone(),
                },
            );
        } else {
            // Still notified; only dedup of its repeats is lost, and that is counted.
            self.untracked += 1;
        }
        Admission::Notify(alert)
    }

    fn rate_ok(&mut self, rule: &str, fingerprint: &str, now_ns: u64) -> bool {
        if self.cfg.rate_limit == 0 {
            return true;
        }
        let w = self
            .rules
            .entry(rule.to_string())
            .or_insert_with(|| RuleWindow {
                start_ns: now_ns,
                ..Default::default()
            });
        if w.sent < self.cfg.rate_limit {
            w.sent += 1;
            true
        } else {
            w.suppressed += 1;
            if w.sample.len() < SAMPLE && !w.sample.iter().any(|f| f == fingerprint) {
                w.sample.push(fingerprint.to_string());
            }
            false
        }
    }

    /// Closes rate windows (returning summaries of what they suppressed) and forgets fingerprints
    /// not seen within the dedup window (returning them as resolved).
    pub fn tick(&mut self, now_ns: u64) -> (Vec<SuppressedSummary>, Vec<ActiveAlert>) {
        let mut summaries = Vec::new();
        let rw = self.cfg.rate_limit_window.as_nanos() as u64;
        let mut closed = Vec::new();
        for (rule, w) in &self.rules {
            if now_ns.saturating_sub(w.start_ns) >= rw {
                closed.push(rule.clone());
            }
        }
        for rule in closed {
            let w = self.rules.remove(&rule).expect("listed above");
            if w.suppressed > 0 {
                let id = self.next_id(&format!("suppressed-{rule}"));
                summaries.push(SuppressedSummary {
                    id,
                    rule,
                    suppressed: w.suppressed,
                    fingerprints_sample: w.sample,
                    window_start_ns: w.start_ns,
                    window_end_ns: now_ns,
                    limit: self.cfg.rate_limit,
                    received_at_ns: now_ns,
                });
            }
        }
        (summaries, self.expire(now_ns))
    }

    /// At shutdown: summaries for every rate window that suppressed something.
    pub fn flush_summaries(&mut self, now_ns: u64) -> Vec<SuppressedSummary> {
        let rules: Vec<String> = self.rules.keys().cloned().collect();
        let mut out = Vec::new();
        for rule in rules {
            let w = self.rules.remove(&rule).expect("listed above");
            if w.suppressed > 0 {
                let id = self.next_id(&format!("suppressed-{rule}"));
                out.push(SuppressedSummary {
                    id,
                    rule,
                    suppressed: w.suppressed,
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

    fn expire(&mut self, now_ns: u64) -> Vec<ActiveAlert> {
        let window = self.cfg.dedup_window.as_nanos() as u64;
        let mut resolved = Vec::new();
        self.tracked.retain(|_, t| {
            let keep = now_ns.saturating_sub(t.last_seen_ns) < window;
            if !keep {
                resolved.push(ActiveAlert {
                    alert: t.alert.clone(),
                    last_seen_ns: t.last_seen_ns,
                    repeats: t.repeats,
                });
            }
            keep
        });
        resolved
    }

    /// Alerts seen within the dedup window.
    pub fn active(&self) -> Vec<ActiveAlert> {
        self.tracked
            .values()
            .map(|t| ActiveAlert {
                alert: t.alert.clone(),
                last_seen_ns: t.last_seen_ns,
                repeats: t.repeats,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::Severity;
    use crate::violation::{AttemptRef, RequestRef};

    pub fn violation(rule: &str, fp: &str) -> Violation {
        Violation {
            rule: rule.into(),
            severity: Severity::Critical,
            summary: "s".into(),
            request: RequestRef {
                request_id: Some(format!("req-{fp}")),
                trace_id: None,
            },
            attempt: AttemptRef::default(),
            worker: None,
            detected_at_ns: 1,
            fingerprint: fp.into(),
            evidence: vec![],
            corroborates: false,
        }
    }

    const S: u64 = 1_000_000_000;
    fn links() -> Links {
        Links {
            timeline: None,
            violations: None,
        }
    }

    #[test]
    fn one_notification_per_fingerprint_per_window_with_count() {
        let mut f = FloodControl::new(
            FloodConfig {
                dedup_window: Duration::from_secs(10),
                rate_limit: 0,
                ..Default::default()
            },
            0,
        );
        assert!(matches!(
            f.admit(&violation("r", "a"), links(), 0),
            Admission::Notify(_)
        ));
        assert_eq!(
            f.admit(&violation("r", "a"), links(), S),
            Admission::Duplicate { repeats: 1 }
        );
        assert_eq!(
            f.admit(&violation("r", "a"), links(), 2 * S),
            Admission::Duplicate { repeats: 2 }
        );
        assert!(matches!(
            f.admit(&violation("r", "b"), links(), 2 * S),
            Admission::Notify(_)
        ));
        // After the window the repeats ride on the next notification.
        match f.admit(&violation("r", "a"), links(), 11 * S) {
            Admission::Notify(a) => assert_eq!(a.occurrences, 3),
            other => panic!("{other:?}"),
        }
        // Quiet for a whole window: resolved.
        let (_, resolved) = f.tick(30 * S);
        assert_eq!(resolved.len(), 2);
        assert!(f.active().is_empty());
    }

    #[test]
    fn rate_limit_summarises_suppressed() {
        let mut f = FloodControl::new(
            FloodConfig {
                dedup_window: Duration::from_secs(1),
                rate_limit: 2,
                rate_limit_window: Duration::from_secs(60),
                max_tracked: 100,
            },
            0,
        );
        let mut notified = 0;
        for i in 0..10 {
            if let Admission::Notify(_) = f.admit(&violation("flood", &format!("f{i}")), links(), i)
            {
                notified += 1;
            }
        }
        assert_eq!(notified, 2);
        // Another rule is not affected.
        assert!(matches!(
            f.admit(&violation("calm", "c"), links(), 10),
            Admission::Notify(_)
        ));
        let (none, _) = f.tick(30 * S);
        assert!(none.is_empty(), "window still open");
        let (sums, _) = f.tick(61 * S);
        assert_eq!(sums.len(), 1);
        assert_eq!(sums[0].rule, "flood");
        assert_eq!(sums[0].suppressed, 8);
        assert_eq!(sums[0].fingerprints_sample.len(), SAMPLE);
    }
}
