//! `check --report FILE`: while the events stream through the engine, a bounded index of them
//! (admin's recent-events index, sized for a file) and the violations printed; at the end, the
//! page of every violating request and a summary, in one HTML file (`crate::report::summary`).

use std::collections::HashSet;
use std::path::PathBuf;

use crate::admin::{RecentEvents, RecentEventsLimits, Timeline, TimelineProvider};
use crate::alert::notification::primary_alias;
use crate::event::LifecycleEvent;
use crate::report::CancelWindow;
use crate::report::summary::{self, Report};
use crate::violation::Violation;

/// Events indexed for the report (the newest kept): at a few hundred bytes each, memory in the
/// hundreds of megabytes at most. A request older than that is drawn from the snapshot taken
/// when its first violation was printed.
const REPORT_EVENTS: usize = 500_000;
/// Requests that get a page; the rest are counted on the summary.
pub const MAX_REQUESTS: usize = 200;
/// Violations listed in the summary (its counts); beyond, they are counted only.
const MAX_VIOLATIONS: usize = 100_000;

pub struct ReportCollector {
    pub path: PathBuf,
    index: RecentEvents,
    violations: Vec<Violation>,
    violations_left_out: u64,
    /// (primary alias, timeline when its first violation was printed).
    requests: Vec<(String, Option<Timeline>)>,
    aliases: HashSet<String>,
    requests_left_out: usize,
    events: u64,
    files: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot write the report {path}: {source}")]
pub struct ReportError {
    path: PathBuf,
    source: std::io::Error,
}

impl ReportCollector {
    pub fn new(path: PathBuf) -> ReportCollector {
        ReportCollector {
            path,
            index: RecentEvents::new(RecentEventsLimits {
                max_events: REPORT_EVENTS,
                // A request with thousands of events (retries, streamed work) stays whole.
                max_per_alias: 20_000,
                max_response_events: 20_000,
            }),
            violations: Vec::new(),
            violations_left_out: 0,
            requests: Vec::new(),
            aliases: HashSet::new(),
            requests_left_out: 0,
            events: 0,
            files: Vec::new(),
        }
    }

    pub fn file(&mut self, name: &str) {
        if !self.files.iter().any(|f| f == name) {
            self.files.push(name.to_owned());
        }
    }

    pub fn event(&mut self, e: &LifecycleEvent) {
        self.events += 1;
        self.index.record(std::slice::from_ref(e));
    }

    pub fn violation(&mut self, v: &Violation) {
        if v.corroborates {
            return;
        }
        if self.violations.len() < MAX_VIOLATIONS {
            self.violations.push(v.clone());
        } else {
            self.violations_left_out += 1;
        }
        let Some(alias) = primary_alias(v) else {
            return;
        };
        if !self.aliases.insert(alias.clone()) {
            return;
        }
        if self.requests.len() < MAX_REQUESTS {
            let now = self.index.timeline(&alias);
            self.requests.push((alias, now));
        } else {
            self.requests_left_out += 1;
        }
    }

    /// Draws and writes the report.
    pub fn write(self, windows: &[CancelWindow]) -> Result<(), ReportError> {
        let mut timelines: Vec<Timeline> = Vec::with_capacity(self.requests.len());
        for (alias, snapshot) in &self.requests {
            // The end of the file knows the request's later events too, unless they were
            // pushed out of the index since.
            let t = match (self.index.timeline(alias), snapshot) {
                (Some(end), Some(s)) if end.events.len() < s.events.len() => Some(s.clone()),
                (Some(end), _) => Some(end),
                (None, s) => s.clone(),
            };
            if let Some(t) = t {
                timelines.push(t);
            }
        }
        let html = summary::render(&Report {
            files: &self.files,
            events: self.events,
            violations: &self.violations,
            requests: &timelines,
            requests_left_out: self.requests_left_out + (self.requests.len() - timelines.len()),
            windows,
        });
        std::fs::write(&self.path, html).map_err(|source| ReportError {
            path: self.path.clone(),
            source,
        })
    }
}
