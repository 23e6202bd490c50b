//! Dedup and flood control, sans-IO: `admit(violation, now)` and `tick(now)`.
//!
//! One notification per fingerprint within the dedup window; repeats inside the window only bump
//! a count, which the next notification for that fingerprint carries. Then a per-rule fixed-window
//! rate limit: beyond `rate_limit` notifications per window, violations are counted instead and a
//! single summary notification reports them when the window closes.
//!
//! Corroboration: when a second source (eBPF after OTLP, or the reverse) confirms a (rule,
//! attempt) already reported, the checker emits a follow-up with `corroborates: true`. It is not
//! a repeat: it bumps no count and takes no rate-limit slot. Its evidence is merged into the
//! notification it confirms: into the held first notification when a corroboration window is
//! set (so the one notification that goes out shows both sources), else into the active alert
//! that Alertmanager re-posts (the webhook/JSONL notification already went out; sending a second
//! one would be the duplicate dedup exists to prevent).

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
    /// Hold a first notification this long when more than one source is live, so that a second
    /// source's confirmation can be merged into it; 0 (default) sends at once. A held
    /// notification is released early as soon as it is corroborated. The price is alert latency
    /// (up to the window) for violations only one source ever sees.
    #[serde(with = "humantime_serde_compat")]
    pub corroboration_window: Duration,
}

impl Default for FloodConfig {
    fn default() -> Self {
        FloodConfig {
            dedup_window: Duration::from_secs(300),
            rate_limit: 50,
            rate_limit_window: Duration::from_secs(60),
            max_tracked: 10_000,
            corroboration_window: Duration::ZERO,
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

/// Index keys of a violation's request aliases (rule-qualified).
fn alias_keys(v: &Violation) -> Vec<String> {
    let mut keys = Vec::with_capacity(2);
    if let Some(r) = &v.request.request_id {
        keys.push(format!("{}\0request_id\0{r}", v.rule));
    }
    if let Some(t) = &v.request.trace_id {
        keys.push(format!("{}\0trace_id\0{t}", v.rule));
    }
    keys
}

/// Whether two references name the same attempt: a shared room or rid (each source may know only
/// some of the aliases), or both empty (request- or worker-scope rules).
fn same_attempt(a: &crate::violation::AttemptRef, b: &crate::violation::AttemptRef) -> bool {
    (a.bootstrap_room.is_some() && a.bootstrap_room == b.bootstrap_room)
        || (a.rid.is_some() && a.rid == b.rid)
        || (a.is_empty() && b.is_empty())
}

/// Aliases the confirming source knew and the original did not (the fingerprint stays).
fn fill_aliases(into: &mut Violation, from: &Violation) {
    let fill = |a: &mut Option<String>, b: &Option<String>| {
        if a.is_none() {
            a.clone_from(b);
        }
    };
    fill(&mut into.request.request_id, &from.request.request_id);
    fill(&mut into.request.trace_id, &from.request.trace_id);
    fill(&mut into.attempt.rid, &from.attempt.rid);
    if into.attempt.bootstrap_room.is_none() {
        into.attempt.bootstrap_room = from.attempt.bootstrap_room;
    }
    if into.worker.is_none() {
        into.worker.clone_from(&from.worker);
    }
}

/// Adds the evidence entries `extra` has and `into` lacks, keeping event-time order. Returns
/// whether anything was added.
fn merge_evidence(
    into: &mut Vec<crate::violation::Evidence>,
    extra: &[crate::violation::Evidence],
) -> bool {
    let before = into.len();
    for e in extra {
        if !into.contains(e) {
            into.push(e.clone());
        }
    }
    if into.len() == before {
        return false;
    }
    into.sort_by_key(|e| e.time_ns);
    true
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
    /// First notification of its fingerprint, held for the corroboration window: it comes out
    /// of [`FloodControl::release_due`], or of a corroboration.
    Held,
    /// A follow-up confirmed by another source (`corroborates: true`): never a repeat.
    Corroborated(Corroboration),
}

// Consumed at once, like `Admission`.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Corroboration {
    /// The original was still held: it goes out now, with the merged evidence.
    Released(ViolationAlert),
    /// The original already went out: the active alert (Alertmanager re-posts) now carries the
    /// merged evidence; no new notification.
    Late { merged: bool },
    /// No tracked original about this attempt (rate-limited, or forgotten past the dedup window
    /// or `max_tracked`).
    Unmatched,
}

impl Corroboration {
    /// Bounded label value for metrics.
    pub fn outcome(&self) -> &'static str {
        match self {
            Corroboration::Released(_) => "merged_held",
            Corroboration::Late { merged: true } => "merged_active",
            Corroboration::Late { merged: false } => "late",
            Corroboration::Unmatched => "unmatched",
        }
    }
}

#[derive(Debug)]
struct Tracked {
    last_notified_ns: u64,
    last_seen_ns: u64,
    repeats: u64,
    /// The last notification, for re-posting while active (or the held one, not sent yet).
    alert: ViolationAlert,
    /// Held for corroboration until this time; `None` once sent.
    held_until_ns: Option<u64>,
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
    /// (rule, request alias) → tracked fingerprint. A fingerprint hashes the request's primary
    /// alias as known when the violation fired: a retry storm's first attempt may be named by its
    /// trace id (the router's span with the x-request-id comes last) and later ones by the
    /// x-request-id. Any shared alias makes them one notification.
    by_alias: HashMap<String, String>,
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
            by_alias: HashMap::new(),
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

    /// Admits one violation. `hold`: the caller (which knows whether more than one source is
    /// live) allows holding a first notification for the corroboration window.
    pub fn admit(&mut self, v: &Violation, links: Links, now_ns: u64, hold: bool) -> Admission {
        if v.corroborates {
            return Admission::Corroborated(self.corroborate(v));
        }
        let window = self.cfg.dedup_window.as_nanos() as u64;
        let mut occurrences = 1;
        let key = if self.tracked.contains_key(&v.fingerprint) {
            v.fingerprint.clone()
        } else {
            self.alias_owner(v).unwrap_or_else(|| v.fingerprint.clone())
        };
        if let Some(t) = self.tracked.get_mut(&key) {
            t.last_seen_ns = now_ns;
            if t.held_until_ns.is_some() {
                // Not sent yet: the repeat rides on the held notification itself.
                t.alert.occurrences += 1;
                return Admission::Duplicate {
                    repeats: t.alert.occurrences - 1,
                };
            }
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
        // Nothing to wait for when the evidence already shows two sources.
        let hold = hold
            && !self.cfg.corroboration_window.is_zero()
            && !crate::violation::has_several_sources(&v.evidence);
        if self.tracked.len() < self.cfg.max_tracked || self.tracked.contains_key(&v.fingerprint) {
            self.tracked.insert(
                v.fingerprint.clone(),
                Tracked {
                    last_notified_ns: now_ns,
                    last_seen_ns: now_ns,
                    repeats: 0,
                    alert: alert.clone(),
                    held_until_ns: hold
                        .then(|| now_ns + self.cfg.corroboration_window.as_nanos() as u64),
                },
            );
            for k in alias_keys(v) {
                let stale = self
                    .by_alias
                    .get(&k)
                    .is_none_or(|fp| !self.tracked.contains_key(fp) || *fp == v.fingerprint);
                if stale {
                    self.by_alias.insert(k, v.fingerprint.clone());
                }
            }
            if hold {
                return Admission::Held;
            }
        } else {
            // Still notified; only dedup of its repeats is lost, and that is counted.
            self.untracked += 1;
        }
        Admission::Notify(alert)
    }

    /// The tracked fingerprint of the same rule that shares a request alias with `v`.
    fn alias_owner(&self, v: &Violation) -> Option<String> {
        alias_keys(v).into_iter().find_map(|k| {
            let fp = self.by_alias.get(&k)?;
            self.tracked
                .get(fp)
                .filter(|t| t.alert.violation.rule == v.rule)
                .map(|_| fp.clone())
        })
    }

    fn corroborate(&mut self, v: &Violation) -> Corroboration {
        let confirms = |t: &Tracked| {
            t.alert.violation.rule == v.rule && same_attempt(&t.alert.violation.attempt, &v.attempt)
        };
        // One fingerprint covers every attempt of a request: merge only into the notification
        // about this very attempt (a later attempt's confirmation is not this alert's evidence).
        // The fingerprint may also differ when the second source knew another alias of the
        // request first (x-request-id vs trace id): then the attempt finds the original.
        let key = match self.tracked.get(&v.fingerprint) {
            Some(t) if confirms(t) => Some(v.fingerprint.clone()),
            _ => self
                .tracked
                .iter()
                .find(|(_, t)| confirms(t))
                .map(|(k, _)| k.clone()),
        };
        let Some(t) = key.and_then(|k| self.tracked.get_mut(&k)) else {
            return Corroboration::Unmatched;
        };
        let merged = merge_evidence(&mut t.alert.violation.evidence, &v.evidence);
        fill_aliases(&mut t.alert.violation, v);
        if t.held_until_ns.take().is_some() {
            return Corroboration::Released(t.alert.clone());
        }
        Corroboration::Late { merged }
    }

    /// Held notifications whose corroboration window has passed, to send now (uncorroborated).
    pub fn release_due(&mut self, now_ns: u64) -> Vec<ViolationAlert> {
        let mut out = Vec::new();
        for t in self.tracked.values_mut() {
            if t.held_until_ns.is_some_and(|d| d <= now_ns) {
                t.held_until_ns = None;
                out.push(t.alert.clone());
            }
        }
        out.sort_by_key(|a| a.received_at_ns);
        out
    }

    /// Every held notification (at shutdown: send rather than lose them).
    pub fn release_all(&mut self) -> Vec<ViolationAlert> {
        self.release_due(u64::MAX)
    }

    /// When the next held notification is due.
    pub fn next_release_ns(&self) -> Option<u64> {
        self.tracked.values().filter_map(|t| t.held_until_ns).min()
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
        let rw = self.cfg.rate_limit_window.as_nanos() as u64;
        let mut closed = Vec::new();
        for (rule, w) in &self.rules {
            if now_ns.saturating_sub(w.start_ns) >= rw {
                closed.push(rule.clone());
            }
        }
        let summaries = self.close_windows(closed, now_ns);
        (summaries, self.expire(now_ns))
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
            let keep = t.held_until_ns.is_some() || now_ns.saturating_sub(t.last_seen_ns) < window;
            if !keep {
                resolved.push(ActiveAlert {
                    alert: t.alert.clone(),
                    last_seen_ns: t.last_seen_ns,
                    repeats: t.repeats,
                });
            }
            keep
        });
        let tracked = &self.tracked;
        self.by_alias.retain(|_, fp| tracked.contains_key(fp));
        resolved
    }

    /// Alerts seen within the dedup window (held ones are not sent yet, so not active).
    pub fn active(&self) -> Vec<ActiveAlert> {
        self.tracked
            .values()
            .filter(|t| t.held_until_ns.is_none())
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
            f.admit(&violation("r", "a"), links(), 0, false),
            Admission::Notify(_)
        ));
        assert_eq!(
            f.admit(&violation("r", "a"), links(), S, false),
            Admission::Duplicate { repeats: 1 }
        );
        assert_eq!(
            f.admit(&violation("r", "a"), links(), 2 * S, false),
            Admission::Duplicate { repeats: 2 }
        );
        assert!(matches!(
            f.admit(&violation("r", "b"), links(), 2 * S, false),
            Admission::Notify(_)
        ));
        // After the window the repeats ride on the next notification.
        match f.admit(&violation("r", "a"), links(), 11 * S, false) {
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
                ..Default::default()
            },
            0,
        );
        let mut notified = 0;
        for i in 0..10 {
            if let Admission::Notify(_) =
                f.admit(&violation("flood", &format!("f{i}")), links(), i, false)
            {
                notified += 1;
            }
        }
        assert_eq!(notified, 2);
        // Another rule is not affected.
        assert!(matches!(
            f.admit(&violation("calm", "c"), links(), 10, false),
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

    fn ev(source: crate::event::Source, t: u64) -> crate::violation::Evidence {
        crate::violation::Evidence {
            role: crate::violation::Role::Offender,
            time_ns: t,
            stage: crate::event::Stage::Decode,
            kind: crate::event::Kind::Work,
            source,
            status: None,
            reason: None,
        }
    }

    /// The original (OTLP evidence) and its follow-up confirmed by eBPF, same fingerprint.
    fn pair(fp: &str) -> (Violation, Violation) {
        use crate::event::Source;
        let mut v = violation("r", fp);
        v.attempt.bootstrap_room = Some(7);
        v.evidence = vec![ev(Source::Otlp, 10)];
        let mut c = v.clone();
        c.corroborates = true;
        c.evidence = vec![ev(Source::Otlp, 10), ev(Source::Ebpf, 12)];
        (v, c)
    }

    /// A 2 s corroboration window holding the first report of `pair("a")`, and that pair.
    fn holding_a() -> (FloodControl, Violation, Violation) {
        let mut f = FloodControl::new(
            FloodConfig {
                corroboration_window: Duration::from_secs(2),
                ..Default::default()
            },
            0,
        );
        let (v, c) = pair("a");
        assert_eq!(f.admit(&v, links(), 0, true), Admission::Held);
        (f, v, c)
    }

    fn sources(a: &ViolationAlert) -> Vec<crate::event::Source> {
        a.violation.evidence.iter().map(|e| e.source).collect()
    }

    #[test]
    fn corroboration_is_not_a_repeat_and_takes_no_rate_slot() {
        let mut f = FloodControl::new(
            FloodConfig {
                rate_limit: 2,
                ..Default::default()
            },
            0,
        );
        let (v, c) = pair("a");
        assert!(matches!(
            f.admit(&v, links(), 0, false),
            Admission::Notify(_)
        ));
        // Already sent: merged into the active alert (what Alertmanager re-posts), no notification.
        assert_eq!(
            f.admit(&c, links(), S, false),
            Admission::Corroborated(Corroboration::Late { merged: true })
        );
        let active = f.active();
        assert_eq!(active.len(), 1);
        assert_eq!(active[0].repeats, 0, "not counted as a repeat");
        assert_eq!(active[0].alert.occurrences, 1);
        use crate::event::Source;
        assert_eq!(sources(&active[0].alert), [Source::Otlp, Source::Ebpf]);
        // The same confirmation again adds nothing.
        assert_eq!(
            f.admit(&c, links(), S, false),
            Admission::Corroborated(Corroboration::Late { merged: false })
        );
        // A real repeat still counts.
        let mut v2 = v.clone();
        v2.attempt.bootstrap_room = Some(8);
        assert_eq!(
            f.admit(&v2, links(), 2 * S, false),
            Admission::Duplicate { repeats: 1 }
        );
        // The limit is 2: the first notification took one slot, the two corroborations none,
        // so one more fingerprint still goes out and only the next is limited.
        assert!(matches!(
            f.admit(&violation("r", "b"), links(), 2 * S, false),
            Admission::Notify(_)
        ));
        assert_eq!(
            f.admit(&violation("r", "c"), links(), 2 * S, false),
            Admission::RateLimited
        );
        let sums = f.flush_summaries(3 * S);
        assert_eq!(sums[0].suppressed, 1);
    }

    #[test]
    fn corroboration_of_another_attempt_does_not_merge_and_unknown_is_unmatched() {
        let mut f = FloodControl::new(FloodConfig::default(), 0);
        let (v, mut c) = pair("a");
        assert!(matches!(
            f.admit(&v, links(), 0, false),
            Admission::Notify(_)
        ));
        // Same fingerprint (another attempt of the request), but no notification about it.
        c.attempt.bootstrap_room = Some(99);
        assert_eq!(
            f.admit(&c, links(), S, false),
            Admission::Corroborated(Corroboration::Unmatched)
        );
        assert_eq!(f.active()[0].alert.violation.evidence.len(), 1);
        let (_, mut c) = pair("never-seen");
        c.attempt.bootstrap_room = Some(1234);
        assert_eq!(
            f.admit(&c, links(), S, false),
            Admission::Corroborated(Corroboration::Unmatched)
        );
        // Another fingerprint (the other source named the request by another alias) but the
        // same attempt, known by one shared alias: the original is found and completed.
        let (_, mut c) = pair("fp-from-trace-id");
        c.attempt.rid = Some("rid-1".into());
        c.request.trace_id = Some("trace-1".into());
        assert_eq!(
            f.admit(&c, links(), S, false),
            Admission::Corroborated(Corroboration::Late { merged: true })
        );
        let a = &f.active()[0].alert;
        assert_eq!(
            a.violation.fingerprint, "a",
            "the original's fingerprint stays"
        );
        assert_eq!(a.violation.attempt.rid.as_deref(), Some("rid-1"));
        assert_eq!(a.violation.request.trace_id.as_deref(), Some("trace-1"));
        assert_eq!(a.violation.evidence.len(), 2);
    }

    #[test]
    fn held_notification_goes_out_once_merged_when_corroborated() {
        use crate::event::Source;
        let (mut f, v, c) = holding_a();
        assert_eq!(f.next_release_ns(), Some(2 * S));
        assert!(f.active().is_empty(), "held: not sent, not active");
        // A repeat while held rides on the held notification.
        let mut again = v.clone();
        again.attempt.bootstrap_room = Some(8);
        assert!(matches!(
            f.admit(&again, links(), S / 2, true),
            Admission::Duplicate { .. }
        ));
        let Admission::Corroborated(Corroboration::Released(a)) = f.admit(&c, links(), S, true)
        else {
            panic!("a held notification is released by its corroboration");
        };
        assert_eq!(sources(&a), [Source::Otlp, Source::Ebpf]);
        assert_eq!(a.occurrences, 2);
        assert!(!a.violation.corroborates, "it is the original notification");
        assert_eq!(f.next_release_ns(), None);
        assert!(f.release_due(10 * S).is_empty(), "sent once");
        assert_eq!(f.active().len(), 1);
    }

    #[test]
    fn held_notification_is_released_after_the_window_and_only_when_allowed() {
        let (mut f, _, c) = holding_a();
        assert!(f.release_due(S).is_empty());
        // Not forgotten by expiry while held, even past the dedup window.
        let _ = f.tick(0);
        let out = f.release_due(2 * S);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].violation.evidence.len(), 1);
        // The confirmation arriving after the window merges into the active alert instead.
        assert_eq!(
            f.admit(&c, links(), 3 * S, true),
            Admission::Corroborated(Corroboration::Late { merged: true })
        );
        // Caller says one source only: no hold. Evidence with two sources: no hold either.
        assert!(matches!(
            f.admit(&violation("r", "b"), links(), 0, false),
            Admission::Notify(_)
        ));
        let (_, mut both) = pair("c");
        both.corroborates = false;
        assert!(matches!(
            f.admit(&both, links(), 0, true),
            Admission::Notify(_)
        ));
        // Shutdown sends what is held.
        assert_eq!(
            f.admit(&violation("r", "d"), links(), 0, true),
            Admission::Held
        );
        assert_eq!(f.release_all().len(), 1);
    }

    #[test]
    fn a_request_named_by_another_alias_later_is_still_one_notification() {
        let mut f = FloodControl::new(FloodConfig::default(), 0);
        // First attempt: only the trace id was known; fingerprint from it.
        let mut first = violation("r", "fp-trace");
        first.request = RequestRef {
            request_id: None,
            trace_id: Some("t1".into()),
        };
        assert!(matches!(
            f.admit(&first, links(), 0, false),
            Admission::Notify(_)
        ));
        // A later attempt once the x-request-id was known: another fingerprint, same request.
        let mut later = violation("r", "fp-request-id");
        later.request = RequestRef {
            request_id: Some("req-1".into()),
            trace_id: Some("t1".into()),
        };
        assert_eq!(
            f.admit(&later, links(), S, false),
            Admission::Duplicate { repeats: 1 }
        );
        // Another rule about the same request is its own notification.
        let mut other = later.clone();
        other.rule = "other".into();
        assert!(matches!(
            f.admit(&other, links(), S, false),
            Admission::Notify(_)
        ));
        // Forgotten with its fingerprint: the index does not outlive it.
        let _ = f.tick(3600 * S);
        assert!(f.by_alias.is_empty());
        assert!(matches!(
            f.admit(&later, links(), 3601 * S, false),
            Admission::Notify(_)
        ));
    }
}
