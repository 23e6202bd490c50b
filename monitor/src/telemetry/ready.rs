//! Readiness latch: `/readyz` answers 200 once every component registered at startup reported in.
//! Components register before anything is spawned, so a component that never starts keeps the
//! process unready instead of being forgotten.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::events::ComponentReady;
use super::metrics::{ComponentLabels, Metrics};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ComponentKind {
    Source,
    Sink,
    Server,
    Other,
}

impl ComponentKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ComponentKind::Source => "source",
            ComponentKind::Sink => "sink",
            ComponentKind::Server => "server",
            ComponentKind::Other => "other",
        }
    }
}

#[derive(Debug)]
struct Component {
    kind: ComponentKind,
    ready: bool,
    last_activity: Option<Instant>,
    /// When it latched ready.
    ready_at: Option<Instant>,
}

#[derive(Debug)]
struct Inner {
    components: BTreeMap<String, Component>,
    /// Sources (or sinks) that are deliberately or necessarily not running, with why.
    disabled: BTreeMap<String, String>,
    /// Running components that currently lose data, with what they lose.
    degraded: BTreeMap<String, String>,
    /// Components that latched ready but cannot do their work right now, with why (the agent's
    /// NATS connection): the process is not ready while any is here.
    down: BTreeMap<String, String>,
    /// A source counts as live if it produced something within this window.
    live_window: Duration,
}

#[derive(Clone, Debug)]
pub struct Readiness {
    inner: Arc<Mutex<Inner>>,
    metrics: Arc<Metrics>,
}

/// Held by one component; `ready()` latches, `activity()` marks a source live.
#[derive(Clone, Debug)]
pub struct ReadyHandle {
    name: String,
    readiness: Readiness,
}

#[derive(Debug, Serialize)]
pub struct ComponentReport {
    pub name: String,
    pub kind: ComponentKind,
    pub ready: bool,
    /// Sources only: produced an event within the live window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_activity_age_seconds: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct ReadyReport {
    pub ready: bool,
    pub pending: Vec<String>,
    /// Every source started: with `live_sources`, "no traffic yet" (expected, not live) is told
    /// apart from "nothing to receive it" (none expected).
    pub expected_sources: Vec<String>,
    pub live_sources: Vec<String>,
    /// Components not running and why (`ebpf: "unavailable: ..."`): they do not hold readiness
    /// back, but an operator must see that this coverage is missing.
    pub disabled: BTreeMap<String, String>,
    /// Components running but blind in part right now (eBPF losing records): the monitor says so
    /// instead of reporting a clean bill of health.
    pub degraded: BTreeMap<String, String>,
    /// Components that cannot do their work right now, and why: the process is not ready.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub down: BTreeMap<String, String>,
    pub components: Vec<ComponentReport>,
}

/// Renders at every scrape what `/readyz` says about coverage, so that dashboards and alert
/// rules see it per node: how many sources are expected and how many delivered within the live
/// window, and which components are degraded or down.
#[derive(Debug)]
struct CoverageCollector(Arc<Mutex<Inner>>);

impl prometheus_client::collector::Collector for CoverageCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric as _;
        use prometheus_client::metrics::gauge::ConstGauge;
        let (expected, live, degraded, down) = {
            let g = self.0.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            let sources = g
                .components
                .values()
                .filter(|c| c.kind == ComponentKind::Source);
            let live = sources
                .clone()
                .filter(|c| {
                    c.ready
                        && c.last_activity
                            .is_some_and(|t| now.duration_since(t) <= g.live_window)
                })
                .count();
            // Every component at 0 or 1 (a series from the start), and what is degraded or
            // down that is no registered component (`memory`, `sources`).
            let rows = |m: &BTreeMap<String, String>| {
                let mut names: std::collections::BTreeSet<&String> = g.components.keys().collect();
                names.extend(m.keys());
                names
                    .into_iter()
                    .map(|n| (n.clone(), i64::from(m.contains_key(n))))
                    .collect::<Vec<_>>()
            };
            (sources.count(), live, rows(&g.degraded), rows(&g.down))
        };
        super::metrics::gauge(
            &mut enc,
            "revenant_sources_expected",
            "Sources started (OTLP, eBPF, replay, NATS): what /readyz expects to deliver",
            expected as i64,
        )?;
        super::metrics::gauge(
            &mut enc,
            "revenant_sources_live",
            "Sources that delivered an event within --source-live-window (0: this node sees nothing)",
            live as i64,
        )?;
        for (name, help, rows) in [
            (
                "revenant_component_degraded",
                "1 while a component runs but is blind in part (/readyz degraded: eBPF losing \
                 records, memory pressure, OTLP spans matching no profile), else 0",
                degraded,
            ),
            (
                "revenant_component_down",
                "1 while a component cannot work (/readyz down: NATS unreachable, no source at \
                 all), else 0",
                down,
            ),
        ] {
            let mut m = enc.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?;
            for (component, v) in rows {
                let labels = [("component", component)];
                let fam = m.encode_family(&labels)?;
                ConstGauge::new(v).encode(fam)?;
            }
        }
        Ok(())
    }
}

impl Readiness {
    pub fn new(metrics: Arc<Metrics>, live_window: Duration) -> Readiness {
        let inner = Arc::new(Mutex::new(Inner {
            components: BTreeMap::new(),
            disabled: BTreeMap::new(),
            degraded: BTreeMap::new(),
            down: BTreeMap::new(),
            live_window,
        }));
        metrics.register_collector(CoverageCollector(inner.clone()));
        Readiness { inner, metrics }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a component that must report in before the process is ready.
    pub fn register(&self, name: impl Into<String>, kind: ComponentKind) -> ReadyHandle {
        let name = name.into();
        self.lock().components.insert(
            name.clone(),
            Component {
                kind,
                ready: false,
                last_activity: None,
                ready_at: None,
            },
        );
        self.metrics
            .component_ready
            .get_or_create(&ComponentLabels {
                component: name.clone(),
                kind: kind.as_str(),
            })
            .set(0);
        self.metrics.ready.set(0);
        ReadyHandle {
            name,
            readiness: self.clone(),
        }
    }

    /// Records that `name` is not running, and why (shown in /readyz).
    pub fn disabled(&self, name: impl Into<String>, why: &str) {
        self.lock().disabled.insert(name.into(), why.to_string());
    }

    /// Marks `name` as losing data (`Some(what)`) or whole again (`None`), shown in /readyz.
    pub fn set_degraded(&self, name: &str, what: Option<String>) {
        let mut g = self.lock();
        match what {
            Some(w) => {
                g.degraded.insert(name.to_string(), w);
            }
            None => {
                g.degraded.remove(name);
            }
        }
    }

    /// Marks `name` as unable to work right now (`Some(why)`: not ready, said in /readyz) or
    /// working again (`None`).
    pub fn set_down(&self, name: &str, why: Option<String>) {
        let ready = {
            let mut g = self.lock();
            match why {
                Some(w) => {
                    g.down.insert(name.to_string(), w);
                }
                None => {
                    g.down.remove(name);
                }
            }
            g.down.is_empty() && g.components.values().all(|c| c.ready)
        };
        self.metrics.ready.set(i64::from(ready));
    }

    pub fn is_ready(&self) -> bool {
        let g = self.lock();
        g.down.is_empty() && g.components.values().all(|c| c.ready)
    }

    /// Sources expected to deliver: those that produced an event within the live window, and
    /// those that became ready less than a window ago (a source just started has had no chance
    /// to deliver yet, e.g. OTLP exporters batch). Cheap: no report built.
    pub fn presumed_live_source_count(&self) -> usize {
        let g = self.lock();
        let now = Instant::now();
        let recent = |t: Option<Instant>| t.is_some_and(|t| now.duration_since(t) <= g.live_window);
        g.components
            .values()
            .filter(|c| {
                c.kind == ComponentKind::Source
                    && c.ready
                    && (recent(c.last_activity) || recent(c.ready_at))
            })
            .count()
    }

    pub fn report(&self) -> ReadyReport {
        let g = self.lock();
        let now = Instant::now();
        let mut pending = Vec::new();
        let mut live_sources = Vec::new();
        let mut expected_sources = Vec::new();
        let mut components = Vec::new();
        for (name, c) in &g.components {
            if c.kind == ComponentKind::Source {
                expected_sources.push(name.clone());
            }
            if !c.ready {
                pending.push(name.clone());
            }
            let age = c.last_activity.map(|t| now.duration_since(t));
            let live = (c.kind == ComponentKind::Source)
                .then(|| c.ready && age.is_some_and(|a| a <= g.live_window));
            if live == Some(true) {
                live_sources.push(name.clone());
            }
            components.push(ComponentReport {
                name: name.clone(),
                kind: c.kind,
                ready: c.ready,
                live,
                last_activity_age_seconds: age.map(|a| a.as_secs_f64()),
            });
        }
        ReadyReport {
            ready: pending.is_empty() && g.down.is_empty(),
            pending,
            down: g.down.clone(),
            expected_sources,
            live_sources,
            disabled: g.disabled.clone(),
            degraded: g.degraded.clone(),
            components,
        }
    }
}

impl ReadyHandle {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Latches this component ready (idempotent).
    pub fn ready(&self) {
        let (kind, all, changed) = {
            let mut g = self.readiness.lock();
            let Some(c) = g.components.get_mut(&self.name) else {
                return;
            };
            let changed = !c.ready;
            c.ready = true;
            c.ready_at.get_or_insert_with(Instant::now);
            let kind = c.kind;
            let all = g.down.is_empty() && g.components.values().all(|c| c.ready);
            (kind, all, changed)
        };
        if changed {
            ComponentReady {
                component: &self.name,
                kind: kind.as_str(),
                all_ready: all,
            }
            .emit(&self.readiness.metrics);
        }
    }

    /// Marks activity (a source produced events); cheap enough to call once per batch.
    pub fn activity(&self) {
        if let Some(c) = self.readiness.lock().components.get_mut(&self.name) {
            c.last_activity = Some(Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latch_waits_for_every_component() {
        let m = Arc::new(Metrics::new());
        let r = Readiness::new(m.clone(), Duration::from_secs(60));
        let otlp = r.register("otlp", ComponentKind::Source);
        let hook = r.register("webhook-0", ComponentKind::Sink);
        assert!(!r.is_ready());
        otlp.ready();
        let rep = r.report();
        assert!(!rep.ready);
        assert_eq!(rep.pending, vec!["webhook-0".to_string()]);
        assert!(rep.live_sources.is_empty(), "no event yet: not live");
        otlp.activity();
        hook.ready();
        let rep = r.report();
        assert!(rep.ready);
        assert_eq!(rep.live_sources, vec!["otlp".to_string()]);
        assert!(m.render().contains("revenant_ready 1"));
        r.set_degraded("otlp", Some("lost 3".into()));
        let rep = r.report();
        assert!(rep.ready, "degraded is not down");
        assert_eq!(rep.degraded["otlp"], "lost 3");
        r.set_degraded("otlp", None);
        assert!(r.report().degraded.is_empty());
    }

    #[test]
    fn coverage_is_on_metrics_per_node() {
        let m = Arc::new(Metrics::new());
        let r = Readiness::new(m.clone(), Duration::from_secs(60));
        let otlp = r.register("otlp", ComponentKind::Source);
        otlp.ready();
        let text = m.render();
        assert!(text.contains("revenant_sources_expected 1"), "{text}");
        assert!(text.contains("revenant_sources_live 0"), "{text}");
        assert!(
            text.contains("revenant_component_degraded{component=\"otlp\"} 0"),
            "{text}"
        );
        otlp.activity();
        r.set_degraded("otlp", Some("unmapped".into()));
        r.set_down("sources", Some("none".into()));
        let text = m.render();
        assert!(text.contains("revenant_sources_live 1"), "{text}");
        assert!(
            text.contains("revenant_component_degraded{component=\"otlp\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("revenant_component_down{component=\"sources\"} 1"),
            "{text}"
        );
        assert_eq!(r.report().expected_sources, vec!["otlp".to_string()]);
    }

    #[test]
    fn a_component_down_holds_readiness_back_with_its_reason() {
        let m = Arc::new(Metrics::new());
        let r = Readiness::new(m.clone(), Duration::from_secs(60));
        r.register("nats", ComponentKind::Sink).ready();
        assert!(r.is_ready());
        r.set_down("nats", Some("NATS unreachable".into()));
        assert!(!r.is_ready());
        let rep = r.report();
        assert!(!rep.ready);
        assert_eq!(rep.down["nats"], "NATS unreachable");
        assert!(m.render().contains("revenant_ready 0"));
        r.set_down("nats", None);
        assert!(r.is_ready() && r.report().down.is_empty());
        assert!(m.render().contains("revenant_ready 1"));
    }

    #[test]
    fn sources_are_presumed_live_when_just_ready_or_active() {
        let m = Arc::new(Metrics::new());
        let r = Readiness::new(m, Duration::from_millis(50));
        let otlp = r.register("otlp", ComponentKind::Source);
        let ebpf = r.register("ebpf", ComponentKind::Source);
        r.register("admin", ComponentKind::Server).ready();
        assert_eq!(r.presumed_live_source_count(), 0, "not ready yet");
        otlp.ready();
        ebpf.ready();
        assert_eq!(r.presumed_live_source_count(), 2, "just started");
        std::thread::sleep(Duration::from_millis(80));
        assert_eq!(
            r.presumed_live_source_count(),
            0,
            "silent for a whole window"
        );
        ebpf.activity();
        assert_eq!(r.presumed_live_source_count(), 1);
    }
}
