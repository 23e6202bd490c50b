//! Incidents, dedup and flood control, sans-IO: `admit(violation, now)`, `release_due(now)` and
//! `tick(now)`.
//!
//! **Incidents.** Findings (violations) about one client request become one incident, keyed by
//! the request's primary alias (the alias the checker's fingerprint uses besides the rule: the
//! x-request-id, else the trace id; a violation naming no request is keyed by its attempt, else
//! its worker). The first finding opens the incident and starts its group wait; findings arriving
//! meanwhile join the pending notification, which then lists every rule that fired. Once sent,
//! the incident is remembered for the dedup window: later findings are merged into its record
//! (visible to Alertmanager re-posts and the next notification) without a new notification,
//! except when one raises the incident's severity (one update, `update: escalated`) or arrives
//! after the dedup window of the last notification (`update: repeated`). A finding of a rule the
//! incident already lists (another attempt of the request breaking it again) is a repeat: it
//! bumps that finding's `occurrences`. With a group wait of 0 grouping is off: each (rule,
//! request) pair is an incident of its own, sent at once.
//!
//! **Rate limit.** Per lead rule (the rule of a notification's lead finding), fixed windows:
//! beyond `rate_limit` notifications per window, incident notifications are counted instead and a
//! single summary reports them when the window closes. An escalation takes a slot but is never
//! suppressed (at most one per severity step per incident).
//!
//! **Corroboration.** When a second source (eBPF after OTLP, or the reverse) confirms a (rule,
//! attempt) already reported, the checker emits a follow-up with `corroborates: true`. It is not
//! a repeat: it bumps no count and takes no rate-limit slot. Its evidence is merged into the
//! finding it confirms: into the pending notification when that is not sent yet (with a
//! corroboration window, a first notification whose evidence shows one source is held for it),
//! else into the incident's record that Alertmanager re-posts (the webhook/JSONL notification
//! already went out; sending a second one would be the duplicate dedup exists to prevent).

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::notification::{
    Finding, IncidentAlert, Lead, Links, SuppressedSummary, Update, incident_alias, incident_id,
};
use crate::violation::Severity;
use crate::violation::{AttemptAliases, Evidence, Violation, has_several_sources};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FloodConfig {
    /// An incident notified within this window is not notified again for later findings (they
    /// are merged into it), unless they raise its severity.
    #[serde(with = "crate::duration")]
    pub dedup_window: Duration,
    /// Incident notifications per lead rule per `rate_limit_window`; 0 disables the limit.
    pub rate_limit: u32,
    #[serde(with = "crate::duration")]
    pub rate_limit_window: Duration,
    /// Incidents remembered for dedup (and re-posting to Alertmanager).
    pub max_tracked: usize,
    /// Hold a first notification this long when more than one source is live, so that a second
    /// source's confirmation can be merged into it; 0 (default) sends at once. A held
    /// notification goes out as soon as every finding in it is corroborated (and its group wait
    /// is over). The price is alert latency (up to the window) for violations only one source
    /// ever sees.
    #[serde(with = "crate::duration")]
    pub corroboration_window: Duration,
    /// How long an incident's notification waits for the other findings of the same request
    /// (and an update for the findings that come with the escalating one); 0 turns grouping off:
    /// one notification per (rule, request), sent at once.
    #[serde(with = "crate::duration")]
    pub group_wait: Duration,
}

/// Default group wait: covers the findings of one breach (the orphaned-leg deadline fires about
/// the cancellation window + the allowed lateness + up to one 1 s checker tick after the
/// rejection that also triggers activity-after-rejection).
pub const DEFAULT_GROUP_WAIT: Duration = Duration::from_secs(2);

impl Default for FloodConfig {
    fn default() -> Self {
        FloodConfig {
            dedup_window: Duration::from_secs(300),
            rate_limit: 50,
            rate_limit_window: Duration::from_secs(60),
            max_tracked: 10_000,
            corroboration_window: Duration::ZERO,
            group_wait: DEFAULT_GROUP_WAIT,
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
        if self.group_wait > Duration::from_secs(600) {
            return Err(format!(
                "group_wait {} delays every alert by that much: at most 10m",
                humantime::format_duration(self.group_wait)
            ));
        }
        Ok(())
    }

    fn grouping(&self) -> bool {
        !self.group_wait.is_zero()
    }
}

/// Whether two references name the same attempt: a shared room or rid (each source may know only
/// some of the aliases), or both empty (request- or worker-scope rules).
fn same_attempt(a: &AttemptAliases, b: &AttemptAliases) -> bool {
    (a.bootstrap_room.is_some() && a.bootstrap_room == b.bootstrap_room)
        || (a.rid.is_some() && a.rid == b.rid)
        || (a.is_empty() && b.is_empty())
}

fn fill<T: Clone>(a: &mut Option<T>, b: &Option<T>) {
    if a.is_none() {
        a.clone_from(b);
    }
}

/// Request aliases another report of the request knew and `into` did not.
fn fill_request(into: &mut Violation, from: &Violation) {
    fill(&mut into.request.request_id, &from.request.request_id);
    fill(&mut into.request.trace_id, &from.request.trace_id);
}

/// Aliases the confirming source knew and the original did not (the fingerprint stays).
fn fill_aliases(into: &mut Violation, from: &Violation) {
    fill_request(into, from);
    fill(&mut into.attempt.rid, &from.attempt.rid);
    fill(
        &mut into.attempt.bootstrap_room,
        &from.attempt.bootstrap_room,
    );
    fill(&mut into.worker, &from.worker);
}

/// Adds the evidence entries `extra` has and `into` lacks, keeping event-time order. Returns
/// whether anything was added.
fn merge_evidence(into: &mut Vec<Evidence>, extra: &[Evidence]) -> bool {
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

/// What became of one (non-follow-up) violation.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// It opened an incident; its notification is pending (group wait, and `held` for the
    /// corroboration window) and comes out of [`FloodControl::release_due`].
    Opened { held: bool },
    /// A rule the incident did not list yet: merged into it.
    Merged(Merge),
    /// A rule the incident already lists (another attempt of the request): a repeat, folded into
    /// that finding's `occurrences`.
    Duplicate { occurrences: u64 },
    /// A follow-up confirmed by another source (`corroborates: true`): never a repeat.
    Corroborated(Corroboration),
}

/// Where a merged finding went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merge {
    /// Into a notification not sent yet: it goes out listing this finding too.
    Pending,
    /// Into an incident notified within the dedup window: its record (Alertmanager re-posts, the
    /// next notification) shows it; no notification of its own.
    Notified,
    /// It raised the incident's severity: one update notification (after the group wait).
    Escalated,
    /// The incident's last notification is older than the dedup window: notified again.
    Repeated,
}

impl Merge {
    /// Bounded label value for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Merge::Pending => "pending",
            Merge::Notified => "notified",
            Merge::Escalated => "escalated",
            Merge::Repeated => "repeated",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Corroboration {
    /// The finding's notification was not sent yet: it goes out with the merged evidence (at
    /// once when that was all its corroboration hold waited for and the group wait is over).
    MergedPending,
    /// The notification already went out: the incident's record (Alertmanager re-posts) now
    /// carries the merged evidence; no new notification.
    Late { merged: bool },
    /// No tracked finding about this (rule, attempt): rate-limited, forgotten past the dedup
    /// window or `max_tracked`, or a repeat about another attempt.
    Unmatched,
}

impl Corroboration {
    /// Bounded label value for metrics.
    pub fn outcome(&self) -> &'static str {
        match self {
            Corroboration::MergedPending => "merged_held",
            Corroboration::Late { merged: true } => "merged_active",
            Corroboration::Late { merged: false } => "late",
            Corroboration::Unmatched => "unmatched",
        }
    }
}

/// What [`FloodControl::release_due`] hands out.
// Returned by value once per notification and consumed at once.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Release {
    /// Send this notification.
    Notify(IncidentAlert),
    /// Over the lead rule's rate limit: summarised when the window closes. `rules`: the rules of
    /// the findings it would have carried for the first time.
    RateLimited {
        lead_rule: String,
        rules: Vec<String>,
    },
}

#[derive(Debug)]
struct FindingRec {
    violation: Violation,
    links: Links,
    occurrences: u64,
    /// Sequence of the notification that first listed it; 0 = not notified yet.
    first_sequence: u32,
    /// Counted as rate-limited once already (an update of a notified incident was suppressed).
    suppressed: bool,
}

#[derive(Debug)]
struct Pending {
    /// The group wait ends.
    due_ns: u64,
    /// Held for corroboration until then (first notifications only).
    hold_until_ns: Option<u64>,
    update: Option<Update>,
    /// When the first finding this notification is sent for was accepted.
    since_ns: u64,
}

impl Pending {
    fn ready_at(&self) -> u64 {
        self.due_ns.max(self.hold_until_ns.unwrap_or(0))
    }
}

#[derive(Debug)]
struct Notified {
    ns: u64,
    sequence: u32,
    /// Index of the lead finding in that notification (Alertmanager's label set).
    lead: usize,
    severity: Severity,
    id: String,
    update: Option<Update>,
    escalated_from: Option<Lead>,
    received_at_ns: u64,
}

#[derive(Debug)]
struct Incident {
    key: String,
    id: String,
    findings: Vec<FindingRec>,
    /// Some finding named the request (not only an attempt or a worker).
    has_request: bool,
    last_seen_ns: u64,
    pending: Option<Pending>,
    notified: Option<Notified>,
}

impl Incident {
    /// The highest severity; the first to arrive among equals.
    fn lead(&self) -> usize {
        let mut best = 0;
        for (i, f) in self.findings.iter().enumerate() {
            if f.violation.severity > self.findings[best].violation.severity {
                best = i;
            }
        }
        best
    }

    #[allow(clippy::too_many_arguments)]
    fn snapshot(
        &self,
        id: String,
        lead: usize,
        sequence: u32,
        update: Option<Update>,
        escalated_from: Option<Lead>,
        received_at_ns: u64,
    ) -> IncidentAlert {
        let l = &self.findings[lead];
        let mut violation = l.violation.clone();
        for f in &self.findings {
            fill_request(&mut violation, &f.violation);
        }
        IncidentAlert {
            id,
            incident: self.id.clone(),
            incident_key: self.key.clone(),
            sequence,
            update,
            escalated_from,
            occurrences: l.occurrences,
            detected_at: super::notification::rfc3339(l.violation.detected_at_ns),
            received_at_ns,
            rules: self
                .findings
                .iter()
                .map(|f| f.violation.rule.clone())
                .collect(),
            findings: self
                .findings
                .iter()
                .map(|f| Finding {
                    violation: f.violation.clone(),
                    occurrences: f.occurrences,
                    first_sequence: f.first_sequence,
                })
                .collect(),
            violation,
            links: l.links.clone(),
        }
    }

    /// The last notification with the record as it is now (Alertmanager's active alert).
    fn active(&self) -> Option<IncidentAlert> {
        let n = self.notified.as_ref()?;
        Some(self.snapshot(
            n.id.clone(),
            n.lead,
            n.sequence,
            n.update,
            n.escalated_from.clone(),
            n.received_at_ns,
        ))
    }
}

#[derive(Debug, Default)]
struct RuleWindow {
    start_ns: u64,
    sent: u32,
    suppressed: u64,
    findings: u64,
    sample: Vec<String>,
}

/// An incident still firing (seen within the dedup window), as re-posted to Alertmanager: its
/// last notification, with every finding merged since.
#[derive(Debug, Clone, PartialEq)]
pub struct ActiveAlert {
    pub alert: IncidentAlert,
    pub last_seen_ns: u64,
}

#[derive(Debug)]
pub struct FloodControl {
    cfg: FloodConfig,
    incidents: HashMap<u64, Incident>,
    /// Alias index key → incident. Request aliases (x-request-id, trace id) first: a request's
    /// first finding may name it by its trace id only (the router's span with the x-request-id
    /// comes last) and a later one by both; any shared alias makes them one incident. Attempt
    /// aliases (room, rid) and workers index what names no request. With grouping off, the keys
    /// are qualified by the rule.
    by_alias: HashMap<String, u64>,
    rules: HashMap<String, RuleWindow>,
    next_incident: u64,
    /// Makes notification ids unique within this process; combined with the start time, across
    /// restarts too.
    seq: u64,
    epoch_ns: u64,
    /// Notified incidents forgotten early because `max_tracked` was reached (reported as
    /// resolved by the next tick).
    evicted: Vec<ActiveAlert>,
    pub evictions: u64,
}

const SAMPLE: usize = 5;

impl FloodControl {
    pub fn new(cfg: FloodConfig, epoch_ns: u64) -> FloodControl {
        FloodControl {
            cfg,
            incidents: HashMap::new(),
            by_alias: HashMap::new(),
            rules: HashMap::new(),
            next_incident: 0,
            seq: 0,
            epoch_ns,
            evicted: Vec::new(),
            evictions: 0,
        }
    }

    pub fn config(&self) -> &FloodConfig {
        &self.cfg
    }

    fn next_id(seq: &mut u64, epoch_ns: u64, prefix: &str) -> String {
        *seq += 1;
        format!("{prefix}-{epoch_ns:x}-{seq}")
    }

    /// Index keys of `v`: (request aliases, attempt or worker aliases).
    fn keys(&self, v: &Violation) -> (Vec<String>, Vec<String>) {
        let scope = if self.cfg.grouping() {
            String::new()
        } else {
            format!("{}\0", v.rule)
        };
        let mut req = Vec::with_capacity(2);
        if let Some(r) = &v.request.request_id {
            req.push(format!("{scope}request_id\0{r}"));
        }
        if let Some(t) = &v.request.trace_id {
            req.push(format!("{scope}trace_id\0{t}"));
        }
        let mut other = Vec::with_capacity(2);
        if let Some(r) = v.attempt.bootstrap_room {
            other.push(format!("{scope}room\0{r}"));
        }
        if let Some(r) = &v.attempt.rid {
            other.push(format!("{scope}rid\0{r}"));
        }
        if other.is_empty()
            && let Some(w) = &v.worker
        {
            other.push(format!("{scope}worker\0{w}"));
        }
        (req, other)
    }

    /// The tracked incident `v` belongs to: one sharing a request alias; else one sharing an
    /// attempt (or worker) alias, provided it names no request or `v` names none (an attempt
    /// belongs to one request).
    fn find(&self, v: &Violation) -> Option<u64> {
        let (req, other) = self.keys(v);
        let live = |k: &String| {
            self.by_alias
                .get(k)
                .copied()
                .filter(|i| self.incidents.contains_key(i))
        };
        if let Some(i) = req.iter().find_map(live) {
            return Some(i);
        }
        other
            .iter()
            .find_map(live)
            .filter(|i| req.is_empty() || !self.incidents[i].has_request)
    }

    fn index(&mut self, v: &Violation, incident: u64) {
        let (req, other) = self.keys(v);
        for k in req.into_iter().chain(other) {
            let free = self
                .by_alias
                .get(&k)
                .is_none_or(|i| !self.incidents.contains_key(i));
            if free {
                self.by_alias.insert(k, incident);
            }
        }
    }

    /// Admits one violation. `hold`: the caller (which knows whether more than one source is
    /// live) allows holding a first notification for the corroboration window.
    pub fn admit(&mut self, v: &Violation, links: Links, now_ns: u64, hold: bool) -> Admission {
        if v.corroborates {
            return Admission::Corroborated(self.corroborate(v));
        }
        let Some(key) = self.find(v) else {
            return self.open(v, links, now_ns, hold);
        };
        let gw = self.cfg.group_wait.as_nanos() as u64;
        let window = self.cfg.dedup_window.as_nanos() as u64;
        let has_request = v.request.request_id.is_some() || v.request.trace_id.is_some();
        let inc = self.incidents.get_mut(&key).expect("found");
        inc.last_seen_ns = now_ns;
        inc.has_request |= has_request;
        let schedule = |inc: &mut Incident, update| {
            inc.pending = Some(Pending {
                due_ns: now_ns + gw,
                hold_until_ns: None,
                update: Some(update),
                since_ns: now_ns,
            });
        };
        let stale = inc.pending.is_none()
            && inc
                .notified
                .as_ref()
                .is_some_and(|n| now_ns.saturating_sub(n.ns) >= window);
        let admission = if let Some(f) =
            inc.findings.iter_mut().find(|f| f.violation.rule == v.rule)
        {
            f.occurrences += 1;
            fill_request(&mut f.violation, v);
            let occurrences = f.occurrences;
            if stale {
                schedule(inc, Update::Repeated);
            }
            Admission::Duplicate { occurrences }
        } else {
            inc.findings.push(FindingRec {
                violation: v.clone(),
                links,
                occurrences: 1,
                first_sequence: 0,
                suppressed: false,
            });
            let notified = inc.notified.as_ref().map(|n| n.severity);
            let merge = match (&mut inc.pending, notified) {
                (Some(p), Some(sev)) if v.severity > sev && p.update != Some(Update::Escalated) => {
                    p.update = Some(Update::Escalated);
                    Merge::Escalated
                }
                (Some(_), _) => Merge::Pending,
                (None, Some(sev)) if v.severity > sev => {
                    schedule(inc, Update::Escalated);
                    Merge::Escalated
                }
                (None, Some(_)) if stale => {
                    schedule(inc, Update::Repeated);
                    Merge::Repeated
                }
                (None, Some(_)) => Merge::Notified,
                // Neither pending nor notified cannot be tracked; send rather than lose it.
                (None, None) => {
                    schedule(inc, Update::Repeated);
                    Merge::Repeated
                }
            };
            Admission::Merged(merge)
        };
        self.index(v, key);
        admission
    }

    fn open(&mut self, v: &Violation, links: Links, now_ns: u64, hold: bool) -> Admission {
        if self.incidents.len() >= self.cfg.max_tracked {
            let resolved = self.expire(now_ns);
            self.evicted.extend(resolved);
            if self.incidents.len() >= self.cfg.max_tracked {
                self.evict_one();
            }
        }
        let alias = incident_alias(v);
        let id = incident_id((!self.cfg.grouping()).then_some(v.rule.as_str()), &alias);
        // Nothing to wait for when the evidence already shows two sources.
        let hold_until_ns =
            (hold && !self.cfg.corroboration_window.is_zero() && !has_several_sources(&v.evidence))
                .then(|| now_ns + self.cfg.corroboration_window.as_nanos() as u64);
        let n = self.next_incident;
        self.next_incident += 1;
        self.incidents.insert(
            n,
            Incident {
                key: alias,
                id,
                findings: vec![FindingRec {
                    violation: v.clone(),
                    links,
                    occurrences: 1,
                    first_sequence: 0,
                    suppressed: false,
                }],
                has_request: v.request.request_id.is_some() || v.request.trace_id.is_some(),
                last_seen_ns: now_ns,
                pending: Some(Pending {
                    due_ns: now_ns + self.cfg.group_wait.as_nanos() as u64,
                    hold_until_ns,
                    update: None,
                    since_ns: now_ns,
                }),
                notified: None,
            },
        );
        self.index(v, n);
        Admission::Opened {
            held: hold_until_ns.is_some(),
        }
    }

    /// Forgets the least recently seen notified incident (pending ones are bounded by time and
    /// never dropped).
    fn evict_one(&mut self) {
        let victim = self
            .incidents
            .iter()
            .filter(|(_, i)| i.pending.is_none())
            .min_by_key(|(_, i)| i.last_seen_ns)
            .map(|(k, _)| *k);
        if let Some(k) = victim {
            let inc = self.incidents.remove(&k).expect("present");
            self.evictions += 1;
            if let Some(alert) = inc.active() {
                self.evicted.push(ActiveAlert {
                    alert,
                    last_seen_ns: inc.last_seen_ns,
                });
            }
        }
    }

    fn corroborate(&mut self, v: &Violation) -> Corroboration {
        let confirms = |f: &FindingRec| {
            f.violation.rule == v.rule && same_attempt(&f.violation.attempt, &v.attempt)
        };
        // An incident covers every attempt of a request: merge only into the finding about this
        // very attempt (a later attempt's confirmation is not this finding's evidence). The
        // aliases may also differ when the second source knew another alias of the request first
        // (x-request-id vs trace id): then the attempt finds the original.
        let key = self
            .find(v)
            .filter(|k| self.incidents[k].findings.iter().any(confirms))
            .or_else(|| {
                self.incidents
                    .iter()
                    .find(|(_, i)| i.findings.iter().any(confirms))
                    .map(|(k, _)| *k)
            });
        let Some(key) = key else {
            return Corroboration::Unmatched;
        };
        let inc = self.incidents.get_mut(&key).expect("found");
        let f = inc
            .findings
            .iter_mut()
            .find(|f| confirms(f))
            .expect("confirmed");
        let merged = merge_evidence(&mut f.violation.evidence, &v.evidence);
        fill_aliases(&mut f.violation, v);
        let outcome = match &mut inc.pending {
            Some(p) => {
                if p.hold_until_ns.is_some()
                    && inc
                        .findings
                        .iter()
                        .all(|f| has_several_sources(&f.violation.evidence))
                {
                    p.hold_until_ns = None;
                }
                Corroboration::MergedPending
            }
            None => Corroboration::Late { merged },
        };
        self.index(v, key);
        outcome
    }

    /// Notifications whose group wait (and corroboration hold) is over, oldest first.
    pub fn release_due(&mut self, now_ns: u64) -> Vec<Release> {
        let mut due: Vec<(u64, u64)> = self
            .incidents
            .iter()
            .filter_map(|(k, i)| {
                let p = i.pending.as_ref()?;
                (p.ready_at() <= now_ns).then_some((p.since_ns, *k))
            })
            .collect();
        due.sort_unstable();
        due.into_iter()
            .map(|(_, k)| self.release(k, now_ns))
            .collect()
    }

    /// Every pending notification (at shutdown: send rather than lose them).
    pub fn release_all(&mut self, now_ns: u64) -> Vec<Release> {
        for i in self.incidents.values_mut() {
            if let Some(p) = &mut i.pending {
                p.due_ns = 0;
                p.hold_until_ns = None;
            }
        }
        self.release_due(now_ns)
    }

    /// When the next pending notification is due (corroboration may release one earlier).
    pub fn next_release_ns(&self) -> Option<u64> {
        self.incidents
            .values()
            .filter_map(|i| i.pending.as_ref().map(Pending::ready_at))
            .min()
    }

    fn release(&mut self, key: u64, now_ns: u64) -> Release {
        let inc = self.incidents.get_mut(&key).expect("due");
        let p = inc.pending.take().expect("pending");
        let lead = inc.lead();
        let lead_rule = inc.findings[lead].violation.rule.clone();
        let lead_fp = inc.findings[lead].violation.fingerprint.clone();
        let unsent = |f: &FindingRec| f.first_sequence == 0 && !f.suppressed;
        let findings_new = inc.findings.iter().filter(|f| unsent(f)).count() as u64;
        // An escalation is never suppressed: the receiver was told a lower severity.
        let force = p.update == Some(Update::Escalated);
        if !rate_ok(
            &mut self.rules,
            &self.cfg,
            &lead_rule,
            &lead_fp,
            findings_new,
            now_ns,
            force,
        ) {
            let mut rules = Vec::new();
            for f in inc.findings.iter_mut().filter(|f| unsent(f)) {
                f.suppressed = true;
                rules.push(f.violation.rule.clone());
            }
            if inc.notified.is_none() {
                // Never sent: nothing to re-post or resolve; the summary accounts for it.
                self.incidents.remove(&key);
            }
            return Release::RateLimited { lead_rule, rules };
        }
        let sequence = inc.notified.as_ref().map_or(1, |n| n.sequence + 1);
        let escalated_from = match (&p.update, &inc.notified) {
            (Some(Update::Escalated), Some(n)) => {
                let f = &inc.findings[n.lead].violation;
                Some(Lead {
                    rule: f.rule.clone(),
                    severity: f.severity,
                    fingerprint: f.fingerprint.clone(),
                })
            }
            _ => None,
        };
        for f in &mut inc.findings {
            if f.first_sequence == 0 {
                f.first_sequence = sequence;
            }
        }
        let id = Self::next_id(&mut self.seq, self.epoch_ns, &inc.id);
        let alert = inc.snapshot(
            id.clone(),
            lead,
            sequence,
            p.update,
            escalated_from.clone(),
            p.since_ns,
        );
        inc.notified = Some(Notified {
            ns: now_ns,
            sequence,
            lead,
            severity: inc.findings[lead].violation.severity,
            id,
            update: p.update,
            escalated_from,
            received_at_ns: p.since_ns,
        });
        Release::Notify(alert)
    }

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

    fn expire(&mut self, now_ns: u64) -> Vec<ActiveAlert> {
        let window = self.cfg.dedup_window.as_nanos() as u64;
        let mut resolved = Vec::new();
        self.incidents.retain(|_, i| {
            let keep = i.pending.is_some() || now_ns.saturating_sub(i.last_seen_ns) < window;
            if !keep && let Some(alert) = i.active() {
                resolved.push(ActiveAlert {
                    alert,
                    last_seen_ns: i.last_seen_ns,
                });
            }
            keep
        });
        let incidents = &self.incidents;
        self.by_alias.retain(|_, i| incidents.contains_key(i));
        resolved
    }

    /// Incidents seen within the dedup window that were notified (pending first notifications
    /// are not sent yet, so not active).
    pub fn active(&self) -> Vec<ActiveAlert> {
        self.incidents
            .values()
            .filter_map(|i| {
                Some(ActiveAlert {
                    alert: i.active()?,
                    last_seen_ns: i.last_seen_ns,
                })
            })
            .collect()
    }

    /// Incidents whose notification waits (group wait, corroboration hold).
    pub fn pending(&self) -> usize {
        self.incidents
            .values()
            .filter(|i| i.pending.is_some())
            .count()
    }

    /// Incidents tracked (pending or remembered for dedup).
    pub fn tracked(&self) -> usize {
        self.incidents.len()
    }
}

/// One notification led by `rule` wants out: whether its rate window allows it. `force` takes
/// the slot even beyond the limit.
fn rate_ok(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, Source, Stage};
    use crate::violation::{EvidenceRole, RequestAliases};

    const S: u64 = 1_000_000_000;
    const AAR: &str = "activity-after-rejection";
    const AARF: &str = "activity-after-request-failed";
    const ORPHAN: &str = "orphaned-leg";

    fn ev(source: Source, t: u64) -> Evidence {
        Evidence {
            role: EvidenceRole::Offender,
            time_ns: t,
            stage: Stage::Decode,
            kind: Kind::Work,
            source,
            status: None,
            reason: None,
        }
    }

    /// A finding of `rule` about request `req` (None: names no request) and attempt `room`.
    fn finding(rule: &str, req: Option<&str>, room: Option<u64>, severity: Severity) -> Violation {
        let alias = req
            .map(|r| format!("request_id:{r}"))
            .or(room.map(|r| format!("room:{r}")))
            .unwrap_or_default();
        Violation {
            rule: rule.into(),
            severity,
            summary: format!("{rule} on {alias}"),
            request: RequestAliases {
                request_id: req.map(str::to_string),
                trace_id: None,
            },
            attempt: AttemptAliases {
                bootstrap_room: room,
                rid: None,
            },
            worker: None,
            detected_at_ns: 1,
            fingerprint: format!(
                "{:016x}",
                crate::violation::fnv1a(&[rule.as_bytes(), alias.as_bytes()])
            ),
            evidence: vec![ev(Source::Otlp, 10)],
            corroborates: false,
        }
    }

    fn crit(rule: &str, req: &str, room: u64) -> Violation {
        finding(rule, Some(req), Some(room), Severity::Critical)
    }

    fn links() -> Links {
        Links {
            timeline: None,
            violations: None,
        }
    }

    fn flood(cfg: FloodConfig) -> FloodControl {
        FloodControl::new(cfg, 0)
    }

    fn grouping(secs: u64) -> FloodConfig {
        FloodConfig {
            group_wait: Duration::from_secs(secs),
            rate_limit: 0,
            ..Default::default()
        }
    }

    fn no_grouping() -> FloodConfig {
        FloodConfig {
            group_wait: Duration::ZERO,
            rate_limit: 0,
            ..Default::default()
        }
    }

    fn notes(r: Vec<Release>) -> Vec<IncidentAlert> {
        r.into_iter()
            .map(|r| match r {
                Release::Notify(a) => a,
                other => panic!("expected a notification: {other:?}"),
            })
            .collect()
    }

    #[test]
    fn two_rules_for_one_request_within_the_wait_are_one_notification() {
        let mut f = flood(grouping(2));
        assert_eq!(
            f.admit(&crit(AAR, "req-1", 1), links(), 0, false),
            Admission::Opened { held: false }
        );
        // Another request: an incident of its own.
        assert_eq!(
            f.admit(&crit(AAR, "req-2", 2), links(), S / 10, false),
            Admission::Opened { held: false }
        );
        assert_eq!(
            f.admit(&crit(AARF, "req-1", 1), links(), S / 2, false),
            Admission::Merged(Merge::Pending)
        );
        assert_eq!(f.next_release_ns(), Some(2 * S));
        assert!(f.release_due(2 * S - 1).is_empty(), "group wait not over");
        assert!(f.active().is_empty(), "pending: not sent, not active");
        let out = notes(f.release_due(2 * S));
        assert_eq!(out.len(), 1);
        let a = &out[0];
        assert_eq!(a.rules, [AAR, AARF]);
        assert_eq!(a.findings.len(), 2);
        assert_eq!(a.incident_key, "request_id:req-1");
        assert_eq!(a.violation.rule, AAR, "lead: first among equals");
        assert_eq!(a.sequence, 1);
        assert_eq!(a.update, None);
        assert_eq!(a.received_at_ns, 0, "latency counts from the first finding");
        assert!(a.findings.iter().all(|f| f.first_sequence == 1));
        let out = notes(f.release_due(3 * S));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].incident_key, "request_id:req-2");
        assert_ne!(out[0].incident, a.incident);
        assert_eq!(f.active().len(), 2);
        assert!(f.release_due(10 * S).is_empty(), "each sent once");
    }

    #[test]
    fn the_lead_is_the_highest_severity() {
        let mut f = flood(grouping(2));
        let w = finding(ORPHAN, Some("req-1"), Some(1), Severity::Warning);
        f.admit(&w, links(), 0, false);
        f.admit(&crit(AAR, "req-1", 1), links(), S, false);
        let a = &notes(f.release_due(2 * S))[0];
        assert_eq!(a.violation.rule, AAR);
        assert_eq!(a.violation.severity, Severity::Critical);
        assert_eq!(a.rules, [ORPHAN, AAR], "findings stay in arrival order");
        assert_eq!(a.violation.fingerprint, crit(AAR, "req-1", 1).fingerprint);
    }

    #[test]
    fn an_escalation_after_sending_is_exactly_one_update() {
        let mut f = flood(grouping(2));
        let w = finding(ORPHAN, Some("req-1"), Some(1), Severity::Warning);
        f.admit(&w, links(), 0, false);
        let first = notes(f.release_due(2 * S)).remove(0);
        assert_eq!(first.violation.severity, Severity::Warning);
        // Critical findings after the warning went out: one update for both.
        assert_eq!(
            f.admit(&crit(AAR, "req-1", 1), links(), 3 * S, false),
            Admission::Merged(Merge::Escalated)
        );
        assert_eq!(
            f.admit(&crit(AARF, "req-1", 1), links(), 3 * S + S / 2, false),
            Admission::Merged(Merge::Pending)
        );
        assert!(f.release_due(5 * S - 1).is_empty());
        let mut out = notes(f.release_due(5 * S));
        assert_eq!(out.len(), 1, "{out:#?}");
        let u = out.remove(0);
        assert_eq!(u.update, Some(Update::Escalated));
        assert_eq!(u.sequence, 2);
        assert_eq!(u.incident, first.incident);
        assert_ne!(u.id, first.id);
        assert_eq!(u.violation.severity, Severity::Critical);
        assert_eq!(u.violation.rule, AAR);
        assert_eq!(u.rules, [ORPHAN, AAR, AARF]);
        assert_eq!(u.received_at_ns, 3 * S);
        assert_eq!(
            u.escalated_from,
            Some(Lead {
                rule: ORPHAN.into(),
                severity: Severity::Warning,
                fingerprint: w.fingerprint.clone(),
            })
        );
        assert_eq!(u.previous_lead().unwrap().violation.rule, ORPHAN);
        let seqs: Vec<u32> = u.findings.iter().map(|f| f.first_sequence).collect();
        assert_eq!(seqs, [1, 2, 2]);
        // Nothing more: a finding of equal or lower severity, or a repeat, only joins the record.
        let w2 = finding("stuck-attempt", Some("req-1"), Some(1), Severity::Warning);
        assert_eq!(
            f.admit(&w2, links(), 6 * S, false),
            Admission::Merged(Merge::Notified)
        );
        assert_eq!(
            f.admit(&crit(AAR, "req-1", 9), links(), 6 * S, false),
            Admission::Duplicate { occurrences: 2 }
        );
        assert!(f.release_due(60 * S).is_empty());
        let active = f.active();
        assert_eq!(active.len(), 1);
        assert_eq!(active[0].alert.id, u.id, "the last notification, re-posted");
        assert_eq!(active[0].alert.findings.len(), 4, "with what merged since");
        assert_eq!(active[0].alert.occurrences, 2);
    }

    #[test]
    fn group_wait_zero_is_one_notification_per_finding() {
        let mut f = flood(no_grouping());
        assert_eq!(
            f.admit(&crit(AAR, "req-1", 1), links(), 0, false),
            Admission::Opened { held: false }
        );
        assert_eq!(
            f.admit(&crit(AARF, "req-1", 1), links(), 0, false),
            Admission::Opened { held: false }
        );
        assert_eq!(f.next_release_ns(), Some(0), "due at once");
        let out = notes(f.release_due(0));
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].rules, [AAR]);
        assert_eq!(out[1].rules, [AARF]);
        assert_ne!(
            out[0].incident, out[1].incident,
            "the rule is part of the key"
        );
        assert_eq!(out[0].incident_key, out[1].incident_key);
        // A retry breaking the same rule is still a repeat of its notification.
        assert_eq!(
            f.admit(&crit(AAR, "req-1", 2), links(), S, false),
            Admission::Duplicate { occurrences: 2 }
        );
        assert!(f.release_due(S).is_empty());
    }

    #[test]
    fn repeats_within_the_dedup_window_fold_and_after_it_notify_again() {
        let mut f = flood(FloodConfig {
            dedup_window: Duration::from_secs(10),
            ..no_grouping()
        });
        let a = |room| crit(AAR, "req-a", room);
        f.admit(&a(1), links(), 0, false);
        assert_eq!(notes(f.release_due(0)).len(), 1);
        assert_eq!(
            f.admit(&a(2), links(), S, false),
            Admission::Duplicate { occurrences: 2 }
        );
        assert_eq!(
            f.admit(&a(3), links(), 2 * S, false),
            Admission::Duplicate { occurrences: 3 }
        );
        f.admit(&crit(AAR, "req-b", 7), links(), 2 * S, false);
        assert_eq!(notes(f.release_due(2 * S)).len(), 1);
        // After the window the incident is notified again, with its occurrences so far.
        assert_eq!(
            f.admit(&a(4), links(), 11 * S, false),
            Admission::Duplicate { occurrences: 4 }
        );
        let out = notes(f.release_due(11 * S));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].update, Some(Update::Repeated));
        assert_eq!(out[0].sequence, 2);
        assert_eq!(out[0].occurrences, 4);
        // Quiet for a whole window: resolved.
        let (_, resolved) = f.tick(30 * S);
        assert_eq!(resolved.len(), 2);
        assert!(f.active().is_empty());
        assert_eq!(f.tracked(), 0);
    }

    #[test]
    fn rate_limit_counts_notifications_and_summarises_suppressed() {
        let mut f = flood(FloodConfig {
            dedup_window: Duration::from_secs(1),
            rate_limit: 2,
            rate_limit_window: Duration::from_secs(60),
            max_tracked: 100,
            ..grouping(1)
        });
        for i in 0..10 {
            let req = format!("req-{i}");
            f.admit(&crit(AAR, &req, i), links(), i, false);
            // Two findings per request: still one notification, one slot.
            f.admit(&crit(AARF, &req, i), links(), i, false);
        }
        let out = f.release_due(2 * S);
        let sent = out
            .iter()
            .filter(|r| matches!(r, Release::Notify(_)))
            .count();
        assert_eq!(sent, 2);
        let limited: Vec<_> = out
            .iter()
            .filter_map(|r| match r {
                Release::RateLimited { lead_rule, rules } => Some((lead_rule.clone(), rules.len())),
                _ => None,
            })
            .collect();
        assert_eq!(limited.len(), 8);
        assert!(limited.iter().all(|(r, n)| r == AAR && *n == 2));
        // Another lead rule is not affected.
        f.admit(&crit("calm", "req-c", 99), links(), 2 * S, false);
        assert_eq!(notes(f.release_due(3 * S)).len(), 1);
        let (none, _) = f.tick(61 * S);
        assert!(none.is_empty(), "window still open");
        let (sums, _) = f.tick(63 * S);
        assert_eq!(sums.len(), 1);
        assert_eq!(sums[0].rule, AAR);
        assert_eq!(sums[0].suppressed, 8);
        assert_eq!(sums[0].findings, 16);
        assert_eq!(sums[0].fingerprints_sample.len(), SAMPLE);
    }

    #[test]
    fn an_escalation_is_never_rate_limited() {
        let mut f = flood(FloodConfig {
            rate_limit: 1,
            ..grouping(1)
        });
        let w = finding(ORPHAN, Some("req-1"), Some(1), Severity::Warning);
        f.admit(&w, links(), 0, false);
        assert_eq!(notes(f.release_due(S)).len(), 1);
        let w2 = finding(ORPHAN, Some("req-2"), Some(2), Severity::Warning);
        f.admit(&w2, links(), S, false);
        assert!(matches!(
            f.release_due(2 * S)[..],
            [Release::RateLimited { .. }]
        ));
        f.admit(
            &finding(AAR, Some("req-1"), Some(1), Severity::Critical),
            links(),
            2 * S,
            false,
        );
        let out = notes(f.release_due(3 * S));
        assert_eq!(out[0].update, Some(Update::Escalated));
    }

    #[test]
    fn findings_of_a_suppressed_update_are_counted_once() {
        let mut f = flood(FloodConfig {
            rate_limit: 1,
            dedup_window: Duration::from_secs(10),
            ..grouping(1)
        });
        f.admit(&crit(AAR, "req-1", 1), links(), 0, false);
        assert_eq!(notes(f.release_due(S)).len(), 1);
        // Past the dedup window: a repeated update, over the limit.
        f.admit(&crit(AARF, "req-1", 1), links(), 12 * S, false);
        let out = f.release_due(13 * S);
        assert!(
            matches!(&out[..], [Release::RateLimited { rules, .. }] if rules.len() == 1),
            "{out:?}"
        );
        f.admit(&crit(AAR, "req-1", 2), links(), 30 * S, false);
        let out = f.release_due(31 * S);
        assert!(
            matches!(&out[..], [Release::RateLimited { rules, .. }] if rules.is_empty()),
            "{out:?}"
        );
    }

    /// The original (OTLP evidence) and its follow-up confirmed by eBPF.
    fn pair(req: &str) -> (Violation, Violation) {
        let mut v = crit(AAR, req, 7);
        v.evidence = vec![ev(Source::Otlp, 10)];
        let mut c = v.clone();
        c.corroborates = true;
        c.evidence = vec![ev(Source::Otlp, 10), ev(Source::Ebpf, 12)];
        (v, c)
    }

    fn sources(v: &Violation) -> Vec<Source> {
        v.evidence.iter().map(|e| e.source).collect()
    }

    #[test]
    fn corroboration_is_not_a_repeat_and_takes_no_rate_slot() {
        let mut f = flood(FloodConfig {
            rate_limit: 2,
            ..no_grouping()
        });
        let (v, c) = pair("req-a");
        f.admit(&v, links(), 0, false);
        assert_eq!(notes(f.release_due(0)).len(), 1);
        // Already sent: merged into the active alert (what Alertmanager re-posts), no notification.
        assert_eq!(
            f.admit(&c, links(), S, false),
            Admission::Corroborated(Corroboration::Late { merged: true })
        );
        assert!(f.release_due(S).is_empty());
        let active = f.active();
        assert_eq!(active.len(), 1);
        assert_eq!(active[0].alert.occurrences, 1, "not counted as a repeat");
        assert_eq!(
            sources(&active[0].alert.violation),
            [Source::Otlp, Source::Ebpf]
        );
        assert_eq!(
            sources(&active[0].alert.findings[0].violation),
            [Source::Otlp, Source::Ebpf]
        );
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
            Admission::Duplicate { occurrences: 2 }
        );
        // The limit is 2: the first notification took one slot, the corroborations none, so one
        // more incident still goes out and only the next is limited.
        f.admit(&crit(AAR, "req-b", 1), links(), 2 * S, false);
        assert_eq!(notes(f.release_due(2 * S)).len(), 1);
        f.admit(&crit(AAR, "req-c", 2), links(), 2 * S, false);
        assert!(matches!(
            f.release_due(2 * S)[..],
            [Release::RateLimited { .. }]
        ));
        let sums = f.flush_summaries(3 * S);
        assert_eq!(sums[0].suppressed, 1);
    }

    #[test]
    fn corroboration_of_another_attempt_does_not_merge_and_unknown_is_unmatched() {
        let mut f = flood(no_grouping());
        let (v, mut c) = pair("req-a");
        f.admit(&v, links(), 0, false);
        f.release_due(0);
        // Same request (another attempt of it), but no finding about that attempt.
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
        // The other source named the request by another alias, but the attempt is the same,
        // known by one shared alias: the original is found and completed.
        let (_, mut c) = pair("req-by-other-alias");
        c.request = RequestAliases {
            request_id: None,
            trace_id: Some("trace-1".into()),
        };
        c.attempt.rid = Some("rid-1".into());
        assert_eq!(
            f.admit(&c, links(), S, false),
            Admission::Corroborated(Corroboration::Late { merged: true })
        );
        let a = &f.active()[0].alert;
        assert_eq!(
            a.violation.fingerprint, v.fingerprint,
            "the original's fingerprint stays"
        );
        assert_eq!(a.violation.attempt.rid.as_deref(), Some("rid-1"));
        assert_eq!(a.violation.request.trace_id.as_deref(), Some("trace-1"));
        assert_eq!(a.violation.evidence.len(), 2);
    }

    #[test]
    fn held_notification_goes_out_once_merged_when_corroborated() {
        let mut f = flood(FloodConfig {
            corroboration_window: Duration::from_secs(2),
            ..no_grouping()
        });
        let (v, c) = pair("req-a");
        assert_eq!(
            f.admit(&v, links(), 0, true),
            Admission::Opened { held: true }
        );
        assert_eq!(f.next_release_ns(), Some(2 * S));
        assert!(f.release_due(S / 4).is_empty(), "held");
        assert!(f.active().is_empty(), "held: not sent, not active");
        // A repeat while held rides on the held notification.
        let mut again = v.clone();
        again.attempt.bootstrap_room = Some(8);
        assert_eq!(
            f.admit(&again, links(), S / 2, true),
            Admission::Duplicate { occurrences: 2 }
        );
        assert_eq!(
            f.admit(&c, links(), S, true),
            Admission::Corroborated(Corroboration::MergedPending)
        );
        let out = notes(f.release_due(S));
        assert_eq!(out.len(), 1, "released by its corroboration");
        assert_eq!(sources(&out[0].violation), [Source::Otlp, Source::Ebpf]);
        assert_eq!(out[0].occurrences, 2);
        assert!(
            !out[0].violation.corroborates,
            "it is the original notification"
        );
        assert_eq!(f.next_release_ns(), None);
        assert!(f.release_due(10 * S).is_empty(), "sent once");
        assert_eq!(f.active().len(), 1);
    }

    #[test]
    fn held_incident_waits_for_every_finding_and_its_group_wait() {
        let mut f = flood(FloodConfig {
            corroboration_window: Duration::from_secs(5),
            ..grouping(2)
        });
        let (v, c) = pair("req-a");
        let mut v2 = v.clone();
        v2.rule = AARF.into();
        let mut c2 = c.clone();
        c2.rule = AARF.into();
        assert_eq!(
            f.admit(&v, links(), 0, true),
            Admission::Opened { held: true }
        );
        assert_eq!(
            f.admit(&v2, links(), 0, true),
            Admission::Merged(Merge::Pending)
        );
        f.admit(&c, links(), S / 2, true);
        assert!(
            f.release_due(3 * S).is_empty(),
            "the second finding is not corroborated yet"
        );
        f.admit(&c2, links(), 3 * S, true);
        let out = notes(f.release_due(3 * S));
        assert_eq!(out.len(), 1);
        for fi in &out[0].findings {
            assert_eq!(sources(&fi.violation), [Source::Otlp, Source::Ebpf]);
        }
        // Corroborated within the group wait: out when the group wait ends, not before.
        let (v, c) = pair("req-b");
        f.admit(&v, links(), 10 * S, true);
        f.admit(&c, links(), 10 * S, true);
        assert!(f.release_due(11 * S).is_empty());
        assert_eq!(notes(f.release_due(12 * S)).len(), 1);
    }

    #[test]
    fn held_notification_is_released_after_the_window_and_only_when_allowed() {
        let mut f = flood(FloodConfig {
            corroboration_window: Duration::from_secs(2),
            ..no_grouping()
        });
        let (v, c) = pair("req-a");
        f.admit(&v, links(), 0, true);
        assert!(f.release_due(S).is_empty());
        // Not forgotten by expiry while held, even past the dedup window.
        let _ = f.tick(0);
        let out = notes(f.release_due(2 * S));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].violation.evidence.len(), 1);
        // The confirmation arriving after the window merges into the active alert instead.
        assert_eq!(
            f.admit(&c, links(), 3 * S, true),
            Admission::Corroborated(Corroboration::Late { merged: true })
        );
        // Caller says one source only: no hold. Evidence with two sources: no hold either.
        assert_eq!(
            f.admit(&crit(AAR, "req-b", 1), links(), 0, false),
            Admission::Opened { held: false }
        );
        let (_, mut both) = pair("req-c");
        both.corroborates = false;
        assert_eq!(
            f.admit(&both, links(), 0, true),
            Admission::Opened { held: false }
        );
        assert_eq!(notes(f.release_due(3 * S)).len(), 2);
        // Shutdown sends what is held or waiting.
        assert_eq!(
            f.admit(&crit(AAR, "req-d", 2), links(), 3 * S, true),
            Admission::Opened { held: true }
        );
        assert_eq!(notes(f.release_all(3 * S)).len(), 1);
    }

    #[test]
    fn a_request_named_by_another_alias_later_is_still_one_incident() {
        let mut f = flood(grouping(2));
        // First finding: only the trace id was known.
        let mut first = crit(AAR, "unused", 1);
        first.request = RequestAliases {
            request_id: None,
            trace_id: Some("t1".into()),
        };
        f.admit(&first, links(), 0, false);
        // A later one once the x-request-id was known too: same incident.
        let mut later = crit(AARF, "req-1", 1);
        later.request.trace_id = Some("t1".into());
        assert_eq!(
            f.admit(&later, links(), S, false),
            Admission::Merged(Merge::Pending)
        );
        let a = notes(f.release_due(2 * S)).remove(0);
        assert_eq!(a.incident_key, "trace_id:t1");
        assert_eq!(a.rules, [AAR, AARF]);
        assert_eq!(
            a.violation.request.request_id.as_deref(),
            Some("req-1"),
            "the lead shows every alias the incident's findings knew"
        );
        // Known by the x-request-id alone now: still this incident.
        let mut by_id = crit(ORPHAN, "req-1", 1);
        by_id.severity = Severity::Warning;
        assert_eq!(
            f.admit(&by_id, links(), 3 * S, false),
            Admission::Merged(Merge::Notified)
        );
        // Forgotten with its incident: the index does not outlive it.
        let _ = f.tick(3600 * S);
        assert!(f.by_alias.is_empty());
        assert_eq!(
            f.admit(&later, links(), 3601 * S, false),
            Admission::Opened { held: false }
        );
    }

    #[test]
    fn findings_naming_no_request_are_keyed_by_attempt() {
        let mut f = flood(grouping(2));
        f.admit(&crit(AAR, "req-1", 5), links(), 0, false);
        // Same attempt, request unknown to this finding: the attempt's incident.
        let anon = finding(ORPHAN, None, Some(5), Severity::Warning);
        assert_eq!(
            f.admit(&anon, links(), S, false),
            Admission::Merged(Merge::Pending)
        );
        // Another attempt with no request: its own incident, keyed by the room.
        let other = finding(ORPHAN, None, Some(6), Severity::Warning);
        assert_eq!(
            f.admit(&other, links(), S, false),
            Admission::Opened { held: false }
        );
        // A finding about another request that reuses a room does not join the first.
        assert_eq!(
            f.admit(&crit(AARF, "req-9", 5), links(), S, false),
            Admission::Opened { held: false }
        );
        let out = notes(f.release_due(3 * S));
        let keys: Vec<&str> = out.iter().map(|a| a.incident_key.as_str()).collect();
        assert_eq!(keys, ["request_id:req-1", "room:6", "request_id:req-9"]);
        assert_eq!(out[0].rules, [AAR, ORPHAN]);
    }

    #[test]
    fn max_tracked_forgets_the_least_recent_notified_incident() {
        let mut f = flood(FloodConfig {
            max_tracked: 2,
            ..no_grouping()
        });
        f.admit(&crit(AAR, "req-1", 1), links(), 0, false);
        f.admit(&crit(AAR, "req-2", 2), links(), S, false);
        f.release_due(S);
        f.admit(&crit(AAR, "req-3", 3), links(), 2 * S, false);
        assert_eq!(f.tracked(), 2);
        assert_eq!(f.evictions, 1);
        let (_, resolved) = f.tick(2 * S);
        assert_eq!(resolved.len(), 1, "reported resolved to Alertmanager");
        assert_eq!(resolved[0].alert.incident_key, "request_id:req-1");
        assert_eq!(notes(f.release_due(2 * S)).len(), 1);
    }
}
