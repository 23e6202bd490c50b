//! Normalize: OTLP spans and log records → [`LifecycleEvent`]s.
//!
//! Each serving stack has a *profile* that knows its span shapes: [`sglang`] (workers),
//! [`smg`] (sglang-router), [`vllm`], [`vllm_router`] and [`generic`] (a YAML mapping for anything else). The
//! profiles for single spans are pure functions; SGLang needs the span tree (only its root
//! names the attempt), so [`sglang::SpanTree`] keeps a small, bounded, time-injected state; so
//! does [`vllm_router::TraceJoin`] (only vLLM's worker spans name the attempt the router's
//! spans are about).
//!
//! Nothing here copies prompt or completion text: events carry ids, times, status codes,
//! token counts and short machine-made reasons only.

pub mod attrs;
pub mod generic;
pub mod sglang;
pub mod smg;
pub mod vllm;
pub mod vllm_router;

use std::collections::HashMap;

use opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::{Span, status::StatusCode};
use serde::Deserialize;

use crate::event::{LifecycleEvent, Source, Stage};

/// What a span is read against: the resource and scope it was exported under.
#[derive(Debug, Clone, Copy)]
pub struct SpanCtx<'a> {
    pub resource: &'a [KeyValue],
    pub service_name: Option<&'a str>,
    pub scope_name: &'a str,
    /// `host.name` of the resource: the clock domain of the span's times.
    pub node: Option<&'a str>,
    /// Optional `revenant.stage` resource attribute: the operator says which stage a process is.
    pub stage_hint: Option<Stage>,
}

impl<'a> SpanCtx<'a> {
    pub fn new(resource: &'a [KeyValue], scope_name: &'a str) -> Self {
        SpanCtx {
            resource,
            service_name: attrs::str(resource, "service.name"),
            scope_name,
            node: attrs::str(resource, "host.name"),
            stage_hint: attrs::str(resource, "revenant.stage").and_then(|s| s.parse().ok()),
        }
    }
}

/// Bounded label: which profile handled (or failed to handle) a span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ProfileLabel {
    None = 0,
    Sglang = 1,
    Smg = 2,
    Vllm = 3,
    Generic = 4,
    VllmRouter = 5,
}

impl ProfileLabel {
    pub const ALL: [ProfileLabel; 6] = [
        ProfileLabel::None,
        ProfileLabel::Sglang,
        ProfileLabel::Smg,
        ProfileLabel::Vllm,
        ProfileLabel::Generic,
        ProfileLabel::VllmRouter,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            ProfileLabel::None => "none",
            ProfileLabel::Sglang => "sglang",
            ProfileLabel::Smg => "smg",
            ProfileLabel::Vllm => "vllm",
            ProfileLabel::Generic => "generic",
            ProfileLabel::VllmRouter => "vllm_router",
        }
    }
}

/// Bounded label: why a span or record produced no event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Unmapped {
    /// No profile claims the resource/scope.
    NoProfile = 0,
    /// The profile does not know this span name (expected for many internal spans).
    UnknownSpan = 1,
    /// Known span without any id that could key an attempt or request.
    MissingIds = 2,
    /// A child span whose attempt root never arrived within the orphan TTL.
    OrphanExpired = 3,
    /// A child span pushed out because too many orphans were waiting.
    OrphanEvicted = 4,
    /// Zero or inverted timestamps.
    BadTime = 5,
    /// Log records: no profile maps logs for this source.
    LogNotMapped = 6,
    /// A request SGLang runs through its fake transfer backend (health checks, warmups: no
    /// bootstrap room): it never enters the disaggregated path.
    FakeTransfer = 7,
}

impl Unmapped {
    pub const ALL: [Unmapped; 8] = [
        Unmapped::NoProfile,
        Unmapped::UnknownSpan,
        Unmapped::MissingIds,
        Unmapped::OrphanExpired,
        Unmapped::OrphanEvicted,
        Unmapped::BadTime,
        Unmapped::LogNotMapped,
        Unmapped::FakeTransfer,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            Unmapped::NoProfile => "no_profile",
            Unmapped::UnknownSpan => "unknown_span",
            Unmapped::MissingIds => "missing_ids",
            Unmapped::OrphanExpired => "orphan_expired",
            Unmapped::OrphanEvicted => "orphan_evicted",
            Unmapped::BadTime => "bad_time",
            Unmapped::LogNotMapped => "log_not_mapped",
            Unmapped::FakeTransfer => "fake_transfer",
        }
    }
}

const NP: usize = ProfileLabel::ALL.len();
const NR: usize = Unmapped::ALL.len();
const NJ: usize = vllm_router::JoinOutcome::ALL.len();

/// Counts from one normalization call; the receiver adds them to its atomics in one go.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    pub spans: [u64; NP],
    pub unmapped: [[u64; NR]; NP],
    pub events: u64,
    /// Spans parked waiting for their attempt root (they may still resolve later).
    pub orphans_buffered: u64,
    /// What became of trace-join entries (vllm-router rejections waiting for their rid).
    pub join: [u64; NJ],
    /// The service and scope of the last spans no profile claimed (each cut to
    /// [`attrs::MAX_ID_BYTES`]): what the operator must name in `normalize.by_service_name`.
    pub unclaimed: Option<(String, String)>,
}

impl Tally {
    pub fn seen(&mut self, p: ProfileLabel) {
        self.spans[p as usize] += 1;
    }
    pub fn unmapped(&mut self, p: ProfileLabel, r: Unmapped) {
        self.unmapped[p as usize][r as usize] += 1;
    }
    pub fn unmapped_count(&self, p: ProfileLabel, r: Unmapped) -> u64 {
        self.unmapped[p as usize][r as usize]
    }
    pub fn total_unmapped(&self) -> u64 {
        self.unmapped.iter().flatten().sum()
    }
    pub fn join(&mut self, o: vllm_router::JoinOutcome) {
        self.join[o as usize] += 1;
    }
    pub fn join_count(&self, o: vllm_router::JoinOutcome) -> u64 {
        self.join[o as usize]
    }
}

/// Which profile reads a span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProfileId {
    Sglang,
    Smg,
    Vllm,
    VllmRouter,
    /// A generic mapping, by its index in the configured list.
    Generic(usize),
}

impl ProfileId {
    pub fn label(&self) -> ProfileLabel {
        match self {
            ProfileId::Sglang => ProfileLabel::Sglang,
            ProfileId::Smg => ProfileLabel::Smg,
            ProfileId::Vllm => ProfileLabel::Vllm,
            ProfileId::VllmRouter => ProfileLabel::VllmRouter,
            ProfileId::Generic(_) => ProfileLabel::Generic,
        }
    }
}

/// Configuration of the normalize layer (part of `revenant run`'s config file).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NormalizeConfig {
    /// Force a profile for a resource `service.name`: `sglang`, `smg`, `vllm`, `vllm-router` or
    /// `generic:NAME`.
    #[serde(default)]
    pub by_service_name: HashMap<String, String>,
    /// Force a profile for an instrumentation scope name.
    #[serde(default)]
    pub by_scope_name: HashMap<String, String>,
    #[serde(default)]
    pub sglang: sglang::TreeConfig,
    /// Bounds of the trace → rid join (vllm-router rejections waiting for vLLM's rid).
    #[serde(default)]
    pub trace_join: vllm_router::JoinConfig,
    /// Mappings for stacks without a built-in profile.
    #[serde(default)]
    pub generic: Vec<generic::Mapping>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "unknown profile {0:?} (expected sglang, smg, vllm, vllm-router or generic:NAME of a configured mapping)"
    )]
    UnknownProfile(String),
    #[error("generic mapping {name:?}: {msg}")]
    Generic { name: String, msg: String },
    #[error("sglang: {0}")]
    Sglang(String),
    #[error("trace_join: {0}")]
    TraceJoin(&'static str),
}

#[derive(Debug)]
struct Selector {
    by_service: HashMap<String, ProfileId>,
    by_scope: HashMap<String, ProfileId>,
}

impl Selector {
    fn pick(&self, ctx: &SpanCtx<'_>, generic: &[generic::Mapping]) -> Option<ProfileId> {
        if let Some(p) = ctx.service_name.and_then(|s| self.by_service.get(s)) {
            return Some(p.clone());
        }
        if let Some(p) = self.by_scope.get(ctx.scope_name) {
            return Some(p.clone());
        }
        if let Some(i) = generic.iter().position(|m| m.selects(ctx)) {
            return Some(ProfileId::Generic(i));
        }
        builtin_profile(ctx)
    }
}

/// The built-in choice, from what the real exporters put in resource and scope.
pub fn builtin_profile(ctx: &SpanCtx<'_>) -> Option<ProfileId> {
    let svc = ctx.service_name.unwrap_or("");
    let scope = ctx.scope_name;
    if svc == vllm_router::SERVICE_NAME
        || scope == vllm_router::SCOPE_NAME
        || svc.starts_with("vllm-router")
        || svc.starts_with("vllm_router")
    {
        Some(ProfileId::VllmRouter)
    } else if scope == "smg"
        || svc == "smg"
        || svc.starts_with("sglang-router")
        || svc.starts_with("sglang_router")
    {
        Some(ProfileId::Smg)
    } else if scope.starts_with("sglang") || svc.starts_with("sglang") {
        Some(ProfileId::Sglang)
    } else if scope.starts_with("vllm") || svc.starts_with("vllm") {
        Some(ProfileId::Vllm)
    } else {
        None
    }
}

/// Turns OTLP exports into events. Holds the SGLang span tree and the vllm-router trace join, so
/// one instance is shared (behind a lock) by all receivers: a router's spans and its workers'
/// may come in through different receivers.
#[derive(Debug)]
pub struct Normalizer {
    selector: Selector,
    generic: Vec<generic::Mapping>,
    tree: sglang::SpanTree,
    join: vllm_router::TraceJoin,
}

impl Normalizer {
    pub fn new(cfg: &NormalizeConfig) -> Result<Self, ConfigError> {
        for m in &cfg.generic {
            m.validate()?;
        }
        let resolve = |s: &str| -> Result<ProfileId, ConfigError> {
            match s {
                "sglang" => Ok(ProfileId::Sglang),
                "smg" => Ok(ProfileId::Smg),
                "vllm" => Ok(ProfileId::Vllm),
                "vllm-router" => Ok(ProfileId::VllmRouter),
                _ => s
                    .strip_prefix("generic:")
                    .and_then(|n| cfg.generic.iter().position(|m| m.name == n))
                    .map(ProfileId::Generic)
                    .ok_or_else(|| ConfigError::UnknownProfile(s.to_owned())),
            }
        };
        let mut by_service = HashMap::new();
        for (k, v) in &cfg.by_service_name {
            by_service.insert(k.clone(), resolve(v)?);
        }
        let mut by_scope = HashMap::new();
        for (k, v) in &cfg.by_scope_name {
            by_scope.insert(k.clone(), resolve(v)?);
        }
        Ok(Normalizer {
            selector: Selector {
                by_service,
                by_scope,
            },
            generic: cfg.generic.clone(),
            tree: sglang::SpanTree::new(cfg.sglang.clone())?,
            join: vllm_router::TraceJoin::new(cfg.trace_join.clone())?,
        })
    }

    /// Normalizes one export. `now_ns` is the arrival time (orphan deadlines), never event time.
    pub fn traces(
        &mut self,
        req: &ExportTraceServiceRequest,
        now_ns: u64,
        out: &mut Vec<LifecycleEvent>,
        tally: &mut Tally,
    ) {
        let before = out.len();
        for rs in &req.resource_spans {
            let resource = rs
                .resource
                .as_ref()
                .map(|r| r.attributes.as_slice())
                .unwrap_or(&[]);
            for ss in &rs.scope_spans {
                let scope = ss.scope.as_ref().map(|s| s.name.as_str()).unwrap_or("");
                let ctx = SpanCtx::new(resource, scope);
                let profile = self.selector.pick(&ctx, &self.generic);
                for span in &ss.spans {
                    let label = profile
                        .as_ref()
                        .map_or(ProfileLabel::None, ProfileId::label);
                    tally.seen(label);
                    if span.start_time_unix_nano == 0
                        || span.end_time_unix_nano < span.start_time_unix_nano
                    {
                        tally.unmapped(label, Unmapped::BadTime);
                        continue;
                    }
                    match &profile {
                        None => {
                            tally.unmapped(label, Unmapped::NoProfile);
                            if tally.unclaimed.is_none() {
                                tally.unclaimed = Some((
                                    attrs::clip_id(ctx.service_name.unwrap_or("")).to_owned(),
                                    attrs::clip_id(scope).to_owned(),
                                ));
                            }
                        }
                        Some(ProfileId::Sglang) => {
                            self.tree.observe(&ctx, span, now_ns, out, tally)
                        }
                        Some(ProfileId::Smg) => smg::map_span(&ctx, span, out, tally),
                        Some(ProfileId::Vllm) => {
                            vllm::map_span(&ctx, span, now_ns, &mut self.join, out, tally)
                        }
                        Some(ProfileId::VllmRouter) => {
                            vllm_router::map_span(&ctx, span, now_ns, &mut self.join, out, tally)
                        }
                        Some(ProfileId::Generic(i)) => {
                            self.generic[*i].map_span(&ctx, span, out, tally)
                        }
                    }
                }
            }
        }
        tally.events += (out.len() - before) as u64;
    }

    /// Log records: only generic mappings read them (by event name / attributes); the built-in
    /// stacks report request lifecycles as spans. Bodies are never read.
    pub fn logs(
        &mut self,
        req: &ExportLogsServiceRequest,
        out: &mut Vec<LifecycleEvent>,
        tally: &mut Tally,
    ) {
        let before = out.len();
        for rl in &req.resource_logs {
            let resource = rl
                .resource
                .as_ref()
                .map(|r| r.attributes.as_slice())
                .unwrap_or(&[]);
            for sl in &rl.scope_logs {
                let scope = sl.scope.as_ref().map(|s| s.name.as_str()).unwrap_or("");
                let ctx = SpanCtx::new(resource, scope);
                let profile = self.selector.pick(&ctx, &self.generic);
                for rec in &sl.log_records {
                    let label = profile
                        .as_ref()
                        .map_or(ProfileLabel::None, ProfileId::label);
                    tally.seen(label);
                    match &profile {
                        Some(ProfileId::Generic(i)) => {
                            self.generic[*i].map_log(&ctx, rec, out, tally)
                        }
                        _ => tally.unmapped(label, Unmapped::LogNotMapped),
                    }
                }
            }
        }
        tally.events += (out.len() - before) as u64;
    }

    /// Expires orphans and old span-tree entries. Driven by the receiver's timer.
    pub fn tick(&mut self, now_ns: u64, out: &mut Vec<LifecycleEvent>, tally: &mut Tally) {
        let before = out.len();
        self.tree.tick(now_ns, out, tally);
        self.join.tick(now_ns, tally);
        tally.events += (out.len() - before) as u64;
    }

    pub fn pending_completions(&self) -> usize {
        self.tree.pending_completions()
    }

    /// Shutdown: releases what `tick` would release later (nothing else can arrive any more).
    pub fn flush(&mut self, out: &mut Vec<LifecycleEvent>) {
        self.tree.flush_completions(out);
    }

    pub fn orphans_waiting(&self) -> usize {
        self.tree.orphans_waiting()
    }

    /// What the span tree's caps made it drop since start.
    pub fn tree_evictions(&self) -> sglang::TreeEvictions {
        self.tree.evictions()
    }

    /// Estimated heap bytes the span tree holds now.
    pub fn tree_bytes(&self) -> usize {
        self.tree.estimated_bytes()
    }

    /// vllm-router rejections waiting for their trace's rid.
    pub fn join_pending(&self) -> usize {
        self.join.pending_len()
    }
}

/// An event from an OTLP span with the fields every profile sets.
pub(crate) fn otlp_event(
    ctx: &SpanCtx<'_>,
    span: &Span,
    time_ns: u64,
    stage: Stage,
    kind: crate::event::Kind,
) -> LifecycleEvent {
    let mut e = LifecycleEvent::new(time_ns, stage, kind, Source::Otlp);
    e.ids.trace_id = attrs::trace_id_hex(&span.trace_id);
    e.node = ctx.node.map(Into::into);
    e
}

pub(crate) fn span_is_error(span: &Span) -> bool {
    span.status
        .as_ref()
        .is_some_and(|s| s.code == StatusCode::Error as i32)
}

/// Token counts in the attribute names used by the gen_ai semantic conventions (current and
/// older spellings) and by vLLM.
pub(crate) fn apply_token_attrs(e: &mut LifecycleEvent, a: &[KeyValue]) {
    if e.input_tokens.is_none() {
        e.input_tokens = attrs::first_u64(
            a,
            &[
                "gen_ai.usage.input_tokens",
                "gen_ai.usage.prompt_tokens",
                "prompt_tokens",
                "input_tokens",
            ],
        );
    }
    if e.max_input_tokens.is_none() {
        e.max_input_tokens = attrs::first_u64(a, &["max_input_tokens", "max_req_input_len"]);
    }
    if e.max_total_tokens.is_none() {
        e.max_total_tokens = attrs::first_u64(a, &["max_total_tokens", "max_total_num_tokens"]);
    }
    if e.context_tokens.is_none() {
        e.context_tokens = attrs::first_u64(a, &["context_tokens", "context_len", "max_model_len"]);
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod vllm_pd_tests;
