//! What `run` and `checker` say of themselves at start and at the end: the memory budget's split,
//! the shutdown summary and the OTLP counters (human lines, or JSON records with fields).

use super::memory;
use super::shutdown::Drain;
use crate::admin::AdminArgs;
use crate::alert::DispatchReport;
use crate::config::RunConfig;
use crate::pipeline::EngineTotals;
use crate::telemetry::console::LogFormat;
use crate::telemetry::{Structure, console};

/// The budget's split, once at start: what each structure may hold before it evicts or refuses.
pub(super) fn log_memory_plan(plan: &memory::MemoryPlan, cfg: &RunConfig, admin: &AdminArgs) {
    // MiB to one decimal: `149.6`, not `149.63198471069336`.
    let tenths = |bytes: u64| (bytes as f64 / (1 << 20) as f64 * 10.0).round() / 10.0;
    let mib = |s: Structure| tenths(plan.cap(s));
    let t = &cfg.normalize.sglang;
    tracing::info!(
        budget_mib = tenths(plan.budget),
        reserve_mib = (memory::RESERVE >> 20),
        attempts = plan.engine.max_attempts,
        request_records = plan.engine.max_requests,
        attempts_mib = mib(Structure::Attempts),
        tombstones = plan.engine.max_tombstones,
        tombstones_mib = mib(Structure::Tombstones),
        span_tree_known = t.max_known,
        span_tree_orphans = t.max_orphans,
        span_tree_completions = t.max_completions,
        span_tree_mib = mib(Structure::SpanTree),
        event_channel_mib = mib(Structure::EventChannel),
        timeline_events = admin.timeline_events,
        timeline_mib = mib(Structure::Timeline),
        recent_violations = admin.recent_violations,
        "memory budget split"
    );
}

/// The shutdown summary: one line (in JSON, its figures as fields).
pub(super) fn report_totals(drain: &Drain, totals: &EngineTotals, report: &DispatchReport) {
    let n = |count: u64, one: &str, many: &str| {
        format!("{count} {}", if count == 1 { one } else { many })
    };
    let human = format!(
        "stopped after draining in {:?}: {}, {} checked, {}; \
         alerts: {}, {} merged, {}, {} spooled for delivery, {} rate-limited, \
         {} delivered to every sink, {} pending in the spool, {} dropped by the spool{}{}",
        drain.elapsed(),
        n(totals.batches, "batch", "batches"),
        n(totals.events, "event", "events"),
        n(totals.violations, "violation", "violations"),
        n(report.incidents, "incident", "incidents"),
        n(report.merged, "finding", "findings"),
        n(report.deduplicated, "repeat", "repeats"),
        n(report.notified, "notification", "notifications"),
        n(report.rate_limited, "finding", "findings"),
        report.delivered,
        report.undelivered_at_exit,
        report.spool_dropped,
        if report.spool_discarded > 0 {
            format!(
                ", {} discarded from the spool at your request",
                report.spool_discarded
            )
        } else {
            String::new()
        },
        if report.sent_before > 0 {
            format!(
                ", {} not sent again (another checker life or replica had sent them)",
                report.sent_before
            )
        } else {
            String::new()
        },
    );
    let fields = serde_json::json!({
        "drain_seconds": drain.elapsed().as_secs_f64(),
        "batches": totals.batches,
        "events_checked": totals.events,
        "violations": totals.violations,
        "incidents": report.incidents,
        "findings_merged": report.merged,
        "repeats": report.deduplicated,
        "notifications_spooled": report.notified,
        "findings_rate_limited": report.rate_limited,
        "notifications_sent_before": report.sent_before,
        "spool_dropped": report.spool_dropped,
        "spool_left": report.undelivered_at_exit,
        "delivered": report.delivered,
        "spool_discarded": report.spool_discarded,
    });
    let serde_json::Value::Object(fields) = fields else {
        return;
    };
    console::say(console::Level::Info, &human, "stopped", fields);
}

/// The OTLP counters that moved (`name{labels} value` lines): as they are in the human format,
/// one record with a `counters` object (sample → value) in JSON.
pub(super) fn report_counters(rendered: &str) {
    let mut counters = serde_json::Map::new();
    for line in rendered.lines().filter(|l| !l.is_empty()) {
        if let Some((sample, value)) = line.rsplit_once(' ') {
            let value = value
                .parse::<u64>()
                .map_or_else(|_| value.into(), serde_json::Value::from);
            counters.insert(sample.to_owned(), value);
        }
    }
    if counters.is_empty() {
        return;
    }
    match console::format() {
        LogFormat::Human => {
            for line in rendered.lines().filter(|l| !l.is_empty()) {
                console::write_line(line);
            }
        }
        LogFormat::Json => {
            let mut fields = serde_json::Map::new();
            fields.insert("counters".into(), counters.into());
            console::say(console::Level::Info, "", "otlp counters", fields);
        }
    }
}
