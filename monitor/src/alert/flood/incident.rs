//! Findings grouped into incidents: the alias index, admission (merge, repeat, escalation),
//! corroboration, release of due notifications, and expiry past the dedup window.

use super::limit::rate_ok;
use super::{ActiveAlert, Admission, Corroboration, FloodControl, Merge, Release};
use crate::alert::notification::{
    Finding, IncidentAlert, Lead, Links, Update, incident_alias, incident_id,
};
use crate::violation::Severity;
use crate::violation::{AttemptAliases, Evidence, Violation, has_several_sources};

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
pub(super) struct Incident {
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
            detected_at: crate::alert::notification::rfc3339(l.violation.detected_at_ns),
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

impl FloodControl {
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

    pub(super) fn expire(&mut self, now_ns: u64) -> Vec<ActiveAlert> {
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
