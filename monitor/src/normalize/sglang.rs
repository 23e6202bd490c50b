//! SGLang worker spans (`--enable-trace`), 0.5.2x `sglang.srt.observability.trace` and the
//! older `sglang.srt.tracing.trace` (≤ 0.5.9).
//!
//! Shapes (see `shared/fixtures/sglang-router-0.3.2/sglang-0.5.23-trace-spans.jsonl`):
//! - request root `"{role} Req {rid[:8]}"` with `rid` (and in 0.5.2x `bootstrap_room` as hex);
//!   older versions put `bootstrap_room` on a parent `"Bootstrap Room 0x…"` span instead;
//! - one thread span per process/thread (`"Prefill Scheduler [TP 0] (host:… | pid:…)"`, attributes
//!   `thread_label`, `pid`, `host_id`) below the root; an abort sets ERROR status and `reason` there;
//! - stage slices below the thread span (`prefill_forward`, `decode_loop`, …);
//! - KV transfer (`mooncake_send`, …) under a separate root whose `rid` is the hex room.
//!
//! Only roots carry ids, and children end — so are exported — before their root. Each span's
//! attempt is therefore resolved through its parent chain; spans whose ancestors have not arrived
//! wait as orphans, bounded in time and count, and are counted when given up.

use std::collections::VecDeque;
use std::time::Duration;

use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use serde::Deserialize;

use super::{ConfigError, ProfileLabel, SpanCtx, Tally, Unmapped, attrs};
use crate::event::{BootstrapRoom, Kind, LifecycleEvent, Source, Stage};
use crate::telemetry::memory::EVENT_HEAP_BYTES;

const P: ProfileLabel = ProfileLabel::Sglang;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TreeConfig {
    /// How long a child span waits for its root before it is given up (counted).
    #[serde(default = "default_orphan_ttl", with = "crate::duration")]
    pub orphan_ttl: Duration,
    /// Most orphans held at once; the oldest is given up (counted) beyond this.
    #[serde(default = "default_max_orphans")]
    pub max_orphans: usize,
    /// How long a resolved span stays known so later children (other threads, later exports)
    /// still find their attempt.
    #[serde(default = "default_retention", with = "crate::duration")]
    pub retention: Duration,
    /// Most resolved spans remembered per retention half-window (`revenant run` lowers it to
    /// what its memory budget leaves the span tree).
    #[serde(default = "default_max_known")]
    pub max_known: usize,
    /// Most root completions waiting out `completion_grace` at once; beyond it the oldest is
    /// released early, unless an abort already arrived (counted as an eviction).
    #[serde(default = "default_max_completions")]
    pub max_completions: usize,
    /// A request root ends in a different process than the scheduler that may abort it, so
    /// its "completed" waits this long for an abort from below before it is believed.
    #[serde(default = "default_completion_grace", with = "crate::duration")]
    pub completion_grace: Duration,
}

fn default_orphan_ttl() -> Duration {
    Duration::from_secs(30)
}
fn default_max_orphans() -> usize {
    100_000
}
fn default_retention() -> Duration {
    // Exporters flush every few hundred ms; a minute covers slow processes with margin.
    Duration::from_secs(60)
}
fn default_max_known() -> usize {
    1_000_000
}
fn default_max_completions() -> usize {
    1_000_000
}
fn default_completion_grace() -> Duration {
    Duration::from_secs(5)
}

impl Default for TreeConfig {
    fn default() -> Self {
        TreeConfig {
            orphan_ttl: default_orphan_ttl(),
            max_orphans: default_max_orphans(),
            retention: default_retention(),
            max_known: default_max_known(),
            max_completions: default_max_completions(),
            completion_grace: default_completion_grace(),
        }
    }
}

type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

/// (trace id, span id): span ids are only unique within a trace.
type SpanRef = (u128, u64);
type AttemptId = u64;

#[derive(Debug, Clone, Default)]
struct Attempt {
    rid: Option<Box<str>>,
    room: Option<BootstrapRoom>,
    role: Option<Stage>,
    /// An ERROR with a reason was seen below this root: its end is not a completion.
    errored: bool,
    /// A prefill or decode request without a bootstrap room: SGLang runs it through its fake
    /// transfer backend (its health checks, `HEALTH_CHECK_…`, and its startup warmup, room 0,
    /// which the root does not name): no transfer, nothing to judge.
    fake: bool,
}

#[derive(Debug, Clone, PartialEq)]
enum Class {
    /// Carries the attempt's ids (request root, Bootstrap Room span, mooncake root).
    Anchor {
        rid: Option<Box<str>>,
        room: Option<BootstrapRoom>,
        role: Option<Stage>,
        request_root: bool,
        /// The root names itself a request of SGLang's request module (`module =
        /// sglang::request`, 0.5.2x): in PD mode such a root without a room is a request on
        /// the fake transfer backend.
        request_module: bool,
    },
    /// A per-thread span; only interesting when it carries an abort.
    Thread { stage: Option<Stage> },
    /// A stage slice that maps to an event; `detail` is its canonical name.
    Slice {
        stage: Stage,
        kind: Kind,
        detail: &'static str,
    },
    /// A slice that only structures the tree (tokenize, dispatch, …).
    Structural,
}

/// The owned extract of one span: what is needed to emit its events once its attempt is known.
#[derive(Debug, Clone)]
struct Node {
    key: SpanRef,
    parent: Option<u64>,
    class: Class,
    /// The span name, kept only for spans that report an error (it goes into `detail`).
    name: Option<Box<str>>,
    start: u64,
    end: u64,
    error_reason: Option<Box<str>>,
    /// The HTTP status an abort names (`status_code`), when it names one.
    error_status: Option<u16>,
    /// A request root whose `gen_ai.response.finish_reasons` says it was aborted: its end is
    /// no completion, even when no span below it reported the abort.
    finished_by_abort: bool,
    node: Option<Box<str>>,
    pid: Option<u32>,
    input_tokens: Option<u64>,
    max_input_tokens: Option<u64>,
    max_total_tokens: Option<u64>,
    stage_hint: Option<Stage>,
}

impl Node {
    /// What the error this span reports was: by the status it names when it names one, else by
    /// its reason's words.
    fn error_kind(&self, reason: &str) -> Kind {
        self.error_status
            .map_or_else(|| error_kind(reason), Kind::of_failure)
    }
}

/// Two generations of "span → attempt", swapped every half retention: bounded memory with
/// no per-entry timestamps.
#[derive(Debug, Default)]
struct Generations {
    cur: HashMap<SpanRef, AttemptId>,
    old: HashMap<SpanRef, AttemptId>,
    attempts_cur: HashMap<AttemptId, Attempt>,
    attempts_old: HashMap<AttemptId, Attempt>,
}

impl Generations {
    fn lookup(&mut self, k: &SpanRef) -> Option<AttemptId> {
        if let Some(a) = self.cur.get(k) {
            return Some(*a);
        }
        let a = self.old.remove(k)?;
        self.cur.insert(*k, a);
        Some(a)
    }
    fn attempt(&mut self, id: AttemptId) -> Option<&mut Attempt> {
        if !self.attempts_cur.contains_key(&id) {
            let a = self.attempts_old.remove(&id)?;
            self.attempts_cur.insert(id, a);
        }
        self.attempts_cur.get_mut(&id)
    }
    /// Starts a new generation; returns how many resolved spans the dropped one still held.
    fn rotate(&mut self) -> usize {
        let dropped = self.old.len();
        self.old = std::mem::take(&mut self.cur);
        self.attempts_old = std::mem::take(&mut self.attempts_cur);
        dropped
    }

    fn bytes(&self) -> usize {
        (self.cur.capacity() + self.old.capacity()) * KNOWN_ENTRY_BYTES
            + (self.attempts_cur.capacity() + self.attempts_old.capacity()) * ATTEMPT_ENTRY_BYTES
    }
}

/// Heap bytes of one slot of a hashbrown table: the entry, its control byte, and the 1/8 of
/// slots kept free.
const fn table_slot<T>() -> usize {
    (std::mem::size_of::<T>() + 1) * 8 / 7
}
/// One resolved span (trace, span id → attempt).
const KNOWN_ENTRY_BYTES: usize = table_slot::<(SpanRef, AttemptId)>();
/// One attempt record and its rid (32 hex characters for SGLang's rids).
const ATTEMPT_ENTRY_BYTES: usize = table_slot::<(AttemptId, Attempt)>() + 32;
/// Heap an extracted span holds besides its struct: the node name, an error's reason and name.
const NODE_HEAP_BYTES: usize = 64;

/// What the span tree charges per entry against its share of the memory budget, worst case:
/// hash tables and queues double when they grow, so each entry is charged twice its slot.
pub mod cost {
    use super::*;
    /// Per unit of `max_known`: a span in each of the two generations, and half an attempt
    /// record for each (a root and its thread span share one).
    pub const KNOWN: usize = 2 * 2 * (KNOWN_ENTRY_BYTES + ATTEMPT_ENTRY_BYTES / 2);
    /// Per orphan: its extract in a waiting list (which may hold room for four), the list's
    /// table slot and two arrival-queue entries (resolved ones are purged lazily).
    pub const ORPHAN: usize = 4 * std::mem::size_of::<Node>()
        + NODE_HEAP_BYTES
        + 2 * table_slot::<(SpanRef, Vec<Node>)>()
        + 2 * 2 * std::mem::size_of::<(u64, SpanRef, SpanRef)>();
    /// Per completion waiting out its grace: the queued event.
    pub const COMPLETION: usize = 2 * std::mem::size_of::<(u64, AttemptId, LifecycleEvent)>()
        + EVENT_HEAP_BYTES
        + 2 * table_slot::<(AttemptId, bool)>();
}

/// What the span tree dropped because of its caps, since start (not its expiries).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TreeEvictions {
    /// Resolved spans forgotten early: their generation was dropped because `max_known` filled
    /// before half the retention passed.
    pub known: u64,
    /// Orphans given up because `max_orphans` were waiting (also `unmapped{orphan_evicted}`).
    pub orphans: u64,
    /// Completions released before their grace ended because `max_completions` were waiting.
    pub completions: u64,
}

impl TreeEvictions {
    pub fn total(&self) -> u64 {
        self.known + self.orphans + self.completions
    }
}

#[derive(Debug)]
pub struct SpanTree {
    cfg: TreeConfig,
    known: Generations,
    next_attempt: AttemptId,
    /// Orphans by the parent span they wait for.
    waiting: HashMap<SpanRef, Vec<Node>>,
    /// Arrival order of orphans: (deadline, orphan, parent) for expiry and eviction; entries whose
    /// orphan was resolved meanwhile are skipped lazily.
    queue: VecDeque<(u64, SpanRef, SpanRef)>,
    orphans: usize,
    last_rotate_ns: u64,
    /// Root completions waiting out `completion_grace`: (deadline, attempt, event).
    completions: VecDeque<(u64, AttemptId, LifecycleEvent)>,
    /// The attempts of those completions, and whether an abort arrived for them since: kept
    /// apart from the attempt records, which the generations may drop before the grace ends.
    in_grace: HashMap<AttemptId, bool>,
    now_ns: u64,
    evicted: TreeEvictions,
}

impl SpanTree {
    pub fn new(cfg: TreeConfig) -> Result<Self, ConfigError> {
        if cfg.max_orphans == 0 || cfg.max_known == 0 || cfg.max_completions == 0 {
            return Err(ConfigError::Sglang(
                "max_orphans, max_known and max_completions must be > 0".into(),
            ));
        }
        if cfg.orphan_ttl.is_zero() || cfg.retention.is_zero() {
            return Err(ConfigError::Sglang(
                "orphan_ttl and retention must be > 0".into(),
            ));
        }
        Ok(SpanTree {
            cfg,
            known: Generations::default(),
            next_attempt: 1,
            waiting: HashMap::default(),
            queue: VecDeque::new(),
            orphans: 0,
            last_rotate_ns: 0,
            completions: VecDeque::new(),
            in_grace: HashMap::default(),
            now_ns: 0,
            evicted: TreeEvictions::default(),
        })
    }

    pub fn orphans_waiting(&self) -> usize {
        self.orphans
    }

    /// What the caps made the tree drop since start.
    pub fn evictions(&self) -> TreeEvictions {
        self.evicted
    }

    /// Estimated heap bytes held now (table and queue capacities, not lengths).
    pub fn estimated_bytes(&self) -> usize {
        let waiting: usize = self
            .waiting
            .values()
            .map(|l| l.capacity() * std::mem::size_of::<Node>() + l.len() * NODE_HEAP_BYTES)
            .sum();
        self.known.bytes()
            + waiting
            + self.waiting.capacity() * table_slot::<(SpanRef, Vec<Node>)>()
            + self.queue.capacity() * std::mem::size_of::<(u64, SpanRef, SpanRef)>()
            + self.completions.capacity() * std::mem::size_of::<(u64, AttemptId, LifecycleEvent)>()
            + self.completions.len() * EVENT_HEAP_BYTES
            + self.in_grace.capacity() * table_slot::<(AttemptId, bool)>()
    }

    pub fn observe(
        &mut self,
        ctx: &SpanCtx<'_>,
        span: &Span,
        now_ns: u64,
        out: &mut Vec<LifecycleEvent>,
        tally: &mut Tally,
    ) {
        let Some(node) = extract(ctx, span) else {
            tally.unmapped(P, Unmapped::MissingIds);
            return;
        };
        if self.last_rotate_ns == 0 {
            self.last_rotate_ns = now_ns;
        }
        self.now_ns = now_ns;
        if let Class::Anchor {
            rid, room, role, ..
        } = &node.class
        {
            let mut attempt = Attempt {
                rid: rid.clone(),
                room: *room,
                role: *role,
                errored: false,
                fake: false,
            };
            // An old-style request root sits under its "Bootstrap Room" span: inherit the room.
            if let Some(pa) = node
                .parent
                .and_then(|p| self.known.lookup(&(node.key.0, p)))
                && let Some(parent) = self.known.attempt(pa)
            {
                attempt.room = attempt.room.or(parent.room);
                attempt.role = attempt.role.or(parent.role);
            }
            // SGLang's health checks (`HEALTH_CHECK_…` rids) and its warmup (room 0, which the
            // root leaves out: `trace.py` names a room only when it is not 0) run on the fake
            // transfer backend.
            attempt.fake = matches!(
                node.class,
                Class::Anchor {
                    request_root: true,
                    ..
                }
            ) && attempt.role.is_some()
                && (attempt
                    .rid
                    .as_deref()
                    .is_some_and(|r| r.starts_with("HEALTH_CHECK"))
                    || (attempt.room.is_none()
                        && matches!(
                            node.class,
                            Class::Anchor {
                                request_module: true,
                                ..
                            }
                        )));
            let id = self.next_attempt;
            self.next_attempt += 1;
            self.known.attempts_cur.insert(id, attempt);
            self.resolve(node, id, out, tally);
            return;
        }
        let Some(parent) = node.parent else {
            // A root without ids cannot be tied to any attempt.
            tally.unmapped(P, Unmapped::MissingIds);
            return;
        };
        if let Some(id) = self.known.lookup(&(node.key.0, parent)) {
            self.resolve(node, id, out, tally);
            return;
        }
        self.park(node, parent, now_ns, tally);
    }

    fn park(&mut self, node: Node, parent: u64, now_ns: u64, tally: &mut Tally) {
        let pk = (node.key.0, parent);
        self.queue.push_back((
            now_ns.saturating_add(self.cfg.orphan_ttl.as_nanos() as u64),
            node.key,
            pk,
        ));
        self.waiting.entry(pk).or_default().push(node);
        self.orphans += 1;
        tally.orphans_buffered += 1;
        // Resolved orphans leave stale queue entries behind; compact before they pile up.
        if self.queue.len() > 2 * self.cfg.max_orphans + 16 {
            let waiting = &self.waiting;
            self.queue.retain(|(_, k, pk)| {
                waiting
                    .get(pk)
                    .is_some_and(|l| l.iter().any(|n| n.key == *k))
            });
        }
        while self.orphans > self.cfg.max_orphans {
            let before = self.orphans;
            if !self.give_up_front(tally, Unmapped::OrphanEvicted) {
                break;
            }
            self.evicted.orphans += (before - self.orphans) as u64;
        }
    }

    /// Removes the oldest queued orphan if it is still waiting. Returns false when the queue is empty.
    fn give_up_front(&mut self, tally: &mut Tally, why: Unmapped) -> bool {
        let Some((_, key, pk)) = self.queue.pop_front() else {
            return false;
        };
        let mut removed = false;
        if let Some(list) = self.waiting.get_mut(&pk) {
            if let Some(pos) = list.iter().position(|n| n.key == key) {
                list.swap_remove(pos);
                removed = true;
            }
            if list.is_empty() {
                self.waiting.remove(&pk);
            }
        }
        if removed {
            self.orphans -= 1;
            tally.unmapped(P, why);
            // Its own waiting children can never resolve through it now.
            let mut stack = vec![key];
            while let Some(k) = stack.pop() {
                if let Some(children) = self.waiting.remove(&k) {
                    for c in children {
                        self.orphans -= 1;
                        tally.unmapped(P, why);
                        stack.push(c.key);
                    }
                }
            }
        }
        true
    }

    pub fn pending_completions(&self) -> usize {
        self.completions.len()
    }

    /// At shutdown no abort can arrive any more: release every completion still in its grace.
    pub fn flush_completions(&mut self, out: &mut Vec<LifecycleEvent>) {
        while let Some((_, id, e)) = self.completions.pop_front() {
            self.release(id, e, out);
        }
    }

    /// Gives up on expired orphans and releases root completions whose grace has passed (unless
    /// an abort arrived meanwhile).
    pub fn tick(&mut self, now_ns: u64, out: &mut Vec<LifecycleEvent>, tally: &mut Tally) {
        while self
            .completions
            .front()
            .is_some_and(|(d, _, _)| *d <= now_ns)
        {
            let Some((_, id, e)) = self.completions.pop_front() else {
                break;
            };
            self.release(id, e, out);
        }
        while let Some((deadline, _, _)) = self.queue.front() {
            if *deadline > now_ns {
                break;
            }
            self.give_up_front(tally, Unmapped::OrphanExpired);
        }
        let half = (self.cfg.retention.as_nanos() / 2) as u64;
        if now_ns.saturating_sub(self.last_rotate_ns) >= half {
            self.known.rotate();
            self.last_rotate_ns = now_ns;
        } else if self.known.cur.len() > self.cfg.max_known {
            self.evicted.known += self.known.rotate() as u64;
            self.last_rotate_ns = now_ns;
        }
    }

    /// A completion whose grace ended (or that the cap pushed out): believed unless an abort
    /// arrived. That is known even once the generations forgot the attempt, and a forgotten
    /// attempt can get no abort any more (its spans would not resolve to it): dropping its
    /// completion would leave the attempt open in the checker, a false "stuck" finding.
    fn release(&mut self, id: AttemptId, e: LifecycleEvent, out: &mut Vec<LifecycleEvent>) {
        let aborted = match self.in_grace.remove(&id) {
            Some(aborted) => aborted,
            None => self.known.attempt(id).is_some_and(|a| a.errored),
        };
        if !aborted {
            out.push(e);
        }
    }

    /// Emits a span whose attempt is known, then everything that was waiting on it.
    fn resolve(
        &mut self,
        node: Node,
        id: AttemptId,
        out: &mut Vec<LifecycleEvent>,
        tally: &mut Tally,
    ) {
        // Anchor end events wait until the subtree drained, so they know about child errors.
        let mut deferred: Vec<Node> = Vec::new();
        let mut work = vec![node];
        while let Some(n) = work.pop() {
            // Only roots and thread spans can still get children after they were exported:
            // other processes attach their thread spans to the root; within one thread children
            // end, so are exported, before their parent. Remembering only these keeps the table
            // at ~2 entries per attempt instead of one per span.
            if matches!(n.class, Class::Anchor { .. } | Class::Thread { .. }) {
                self.known.cur.insert(n.key, id);
                if self.known.cur.len() > self.cfg.max_known {
                    self.evicted.known += self.known.rotate() as u64;
                }
            }
            if let Some(children) = self.waiting.remove(&n.key) {
                self.orphans -= children.len();
                work.extend(children);
            }
            if matches!(n.class, Class::Anchor { .. }) {
                deferred.push(n);
            } else {
                self.emit(&n, id, out, tally);
            }
        }
        for n in deferred {
            self.emit(&n, id, out, tally);
        }
    }

    fn emit(&mut self, n: &Node, id: AttemptId, out: &mut Vec<LifecycleEvent>, tally: &mut Tally) {
        let Some(a) = self.known.attempt(id) else {
            return;
        };
        if a.fake {
            tally.unmapped(P, Unmapped::FakeTransfer);
            return;
        }
        let role = n.stage_hint.or(a.role);
        let mk = |time: u64, stage: Stage, kind: Kind, a: &Attempt| {
            let mut e = LifecycleEvent::new(time, stage, kind, Source::Otlp);
            e.ids.rid = a.rid.clone();
            e.ids.bootstrap_room = a.room;
            e.ids.trace_id = if n.key.0 == 0 {
                None
            } else {
                Some(format!("{:032x}", n.key.0).into())
            };
            e.node = n.node.clone();
            e.pid = n.pid;
            e.input_tokens = n.input_tokens;
            e.max_input_tokens = n.max_input_tokens;
            e.max_total_tokens = n.max_total_tokens;
            e
        };
        match &n.class {
            Class::Anchor {
                request_root: true, ..
            } => {
                let stage = role.unwrap_or(Stage::Prefill);
                let mut start = mk(n.start, stage, Kind::Received, a);
                start.detail = Some("request".into());
                out.push(start);
                if let Some(reason) = &n.error_reason {
                    let mut e = mk(n.end, stage, n.error_kind(reason), a);
                    e.reason = Some(reason.clone());
                    a.errored = true;
                    out.push(e);
                } else if n.finished_by_abort && !a.errored {
                    // Aborted without a span below saying why (SGLang up to 0.5.20 finished a
                    // refused request's one-token stub this way): it ended, it did not
                    // complete, and what it was is not known.
                    let mut e = mk(n.end, stage, Kind::Aborted, a);
                    e.reason = Some("finish_reason abort".into());
                    a.errored = true;
                    out.push(e);
                } else if !a.errored {
                    let e = mk(n.end, stage, Kind::Completed, a);
                    let deadline = self
                        .now_ns
                        .saturating_add(self.cfg.completion_grace.as_nanos() as u64);
                    self.completions.push_back((deadline, id, e));
                    self.in_grace.insert(id, false);
                    if self.completions.len() > self.cfg.max_completions
                        && let Some((_, id, e)) = self.completions.pop_front()
                    {
                        self.evicted.completions += 1;
                        self.release(id, e, out);
                    }
                }
            }
            Class::Anchor { .. } | Class::Structural => {
                if let Some(reason) = &n.error_reason {
                    let stage = role.unwrap_or(Stage::Prefill);
                    let mut e = mk(n.end, stage, n.error_kind(reason), a);
                    e.reason = Some(reason.clone());
                    e.detail = n.name.clone();
                    a.errored = true;
                    out.push(e);
                } else if matches!(n.class, Class::Structural) {
                    tally.unmapped(P, Unmapped::UnknownSpan);
                }
            }
            Class::Thread { stage } => match &n.error_reason {
                Some(reason) => {
                    let st = stage.or(role).unwrap_or(Stage::Prefill);
                    let mut e = mk(n.end, st, n.error_kind(reason), a);
                    e.reason = Some(reason.clone());
                    a.errored = true;
                    out.push(e);
                }
                None => tally.unmapped(P, Unmapped::UnknownSpan),
            },
            Class::Slice {
                stage,
                kind,
                detail,
            } => {
                // Work is reported when the slice ends: by then it certainly happened.
                let mut e = mk(n.end, *stage, *kind, a);
                e.detail = Some((*detail).into());
                if let Some(reason) = &n.error_reason {
                    e.kind = n.error_kind(reason);
                    e.reason = Some(reason.clone());
                    a.errored = true;
                }
                out.push(e);
            }
        }
        // Every branch above that saw an error marked the attempt errored: a completion of it
        // still in its grace is not believed.
        if n.error_reason.is_some()
            && let Some(aborted) = self.in_grace.get_mut(&id)
        {
            *aborted = true;
        }
    }
}

/// A capacity or validation refusal is a rejection; anything else that errors is an abort.
pub fn error_kind(reason: &str) -> Kind {
    const REJECT: [&str; 11] = [
        "exceed",
        "too long",
        "longer than",
        "maximum",
        "capacity",
        "queue is full",
        "queue full",
        "too many",
        "not enough",
        "invalid",
        "rejected",
    ];
    let lower = reason.to_ascii_lowercase();
    if REJECT.iter().any(|p| lower.contains(p)) {
        Kind::Rejected
    } else {
        Kind::Aborted
    }
}

/// The input and the limit a refusal names: "… exceeds the maximum number of tokens: 9000 >
/// 8192" (`prefill.py`), "The input (9000 tokens) is longer than the model's context length
/// (8192 tokens)." (`tokenizer_manager.py`), "Input length (9000 tokens) exceeds the maximum
/// allowed length (8192 tokens)…" (`scheduler.py`) → (9000, 8192).
pub fn tokens_from_reason(reason: &str) -> Option<(u64, u64)> {
    if !reason.contains("token") {
        return None;
    }
    if let Some((l, r)) = reason.rsplit_once(" > ") {
        let a = l
            .rsplit(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()?;
        let b = r
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()?;
        return Some((a, b));
    }
    let mut counts = reason.split('(').skip(1).filter_map(|p| {
        let (n, rest) = p.split_once(' ')?;
        rest.starts_with("tokens)")
            .then(|| n.parse::<u64>().ok())
            .flatten()
    });
    Some((counts.next()?, counts.next()?))
}

/// Slice name → (stage, kind). Names from `RequestStage` in 0.5.2x and the older enum.
pub fn slice_mapping(name: &str) -> Option<(Stage, Kind, &'static str)> {
    use Kind::*;
    use Stage::*;
    const TABLE: &[(&str, Stage, Kind)] = &[
        ("prefill_bootstrap", Prefill, Admitted),
        ("prefill_waiting", Prefill, Admitted),
        ("prefill_forward", Prefill, Work),
        ("chunked_prefill", Prefill, Work),
        ("prefill_transfer_kv_cache", Transfer, Work),
        ("decode_prepare", Decode, Received),
        // `decode_bootstrap` ends once decode reserved the room's KV pages and sent prefill its
        // destinations (`decode.py` `send_metadata`): the transfer admitted, as the wire's
        // destinations message; `decode_waiting` starts once the KV arrived and decode queues
        // the request to run (an admission); `decode_transferred` is the KV arriving.
        ("decode_bootstrap", Transfer, Admitted),
        ("decode_waiting", Decode, Admitted),
        ("decode_transferred", Transfer, Completed),
        ("decode_forward", Decode, Work),
        ("decode_loop", Decode, Work),
        ("fake_output", Decode, Work),
        ("quick_finish", Decode, Work),
        ("mooncake_send", Transfer, Work),
        ("mooncake_recv", Transfer, Work),
        ("mooncake_worker_send", Transfer, Work),
        ("mooncake_worker_send_session", Transfer, Work),
        ("mooncake_worker_recv", Transfer, Work),
    ];
    if let Some((n, st, k)) = TABLE.iter().find(|(n, _, _)| *n == name) {
        return Some((*st, *k, n));
    }
    // Transfer engines add slices over time; their prefix is enough to call it KV transfer.
    if name.starts_with("mooncake_") {
        return Some((Transfer, Work, "mooncake"));
    }
    if name.starts_with("nixl_") {
        return Some((Transfer, Work, "nixl"));
    }
    None
}

fn role_from_name(name: &str) -> Option<Stage> {
    let b = name.trim_start().as_bytes();
    let starts = |p: &[u8]| b.len() >= p.len() && b[..p.len()].eq_ignore_ascii_case(p);
    if starts(b"prefill") {
        Some(Stage::Prefill)
    } else if starts(b"decode") {
        Some(Stage::Decode)
    } else {
        None
    }
}

fn reason_of(a: &[KeyValue]) -> Option<&str> {
    [
        "reason",
        "abort_reason",
        "error",
        "exception.message",
        "message",
    ]
    .iter()
    .find_map(|k| attrs::str(a, k))
}

fn extract(ctx: &SpanCtx<'_>, span: &Span) -> Option<Node> {
    let trace = attrs::trace_key(&span.trace_id);
    let span_id = attrs::span_key(&span.span_id)?;
    let a = &span.attributes;
    let name = span.name.as_str();
    // The root's `rid` is SGLang's rid cut at its last `_` (`trace.py` `trace_req_start`: a
    // sub-request `X_1` reads `1`); `gen_ai.request.id`, set when the root ends, is whole.
    let rid_attr = attrs::id(a, "gen_ai.request.id").or_else(|| attrs::id(a, "rid"));
    let room_attr = attrs::room(a, "bootstrap_room");
    let class = if rid_attr.is_some() || room_attr.is_some() {
        // The KV-transfer root uses the hex room as its rid.
        let (rid, room) = match rid_attr {
            Some(r) if r.starts_with("0x") || r.starts_with("0X") => {
                (None, r.parse().ok().or(room_attr))
            }
            other => (other, room_attr),
        };
        let request_root = rid.is_some() && name.contains("Req");
        Class::Anchor {
            rid,
            room,
            role: role_from_name(name),
            request_root,
            request_module: attrs::str(a, "module") == Some("sglang::request"),
        }
    } else if attrs::has(a, "thread_label") || name.contains("(host:") {
        let label = attrs::str(a, "thread_label").unwrap_or(name);
        Class::Thread {
            stage: role_from_name(label),
        }
    } else if let Some((stage, kind, detail)) = slice_mapping(name) {
        Class::Slice {
            stage,
            kind,
            detail,
        }
    } else {
        Class::Structural
    };
    // An ERROR without any reason is how SGLang flags a slice-name mismatch, not an abort.
    let error_reason = if super::span_is_error(span) {
        reason_of(a)
            .or_else(|| {
                span.status
                    .as_ref()
                    .map(|s| s.message.as_str())
                    .filter(|m| !m.is_empty())
            })
            .map(|r| crate::event::truncate_reason(r).into())
    } else {
        None
    };
    // An abort's finish reason carries the HTTP status SGLang answers it with (400 a refused
    // input, 503 a refusal, 500 a failure: `scheduler.py`, `prefill.py`), set on the thread span
    // by `trace_ctx.abort(abort_info=finished_reason)`.
    let error_status = error_reason
        .as_ref()
        .and_then(|_| attrs::u64(a, "status_code"))
        .and_then(|s| u16::try_from(s).ok())
        .filter(|s| (400..600).contains(s));
    let mut input_tokens = attrs::first_u64(
        a,
        &[
            "gen_ai.usage.input_tokens",
            "gen_ai.usage.prompt_tokens",
            "prompt_tokens",
        ],
    );
    let mut max_input_tokens = attrs::first_u64(a, &["max_input_tokens", "max_req_input_len"]);
    if let Some((n, max)) = error_reason.as_deref().and_then(tokens_from_reason) {
        input_tokens = input_tokens.or(Some(n));
        max_input_tokens = max_input_tokens.or(Some(max));
    }
    Some(Node {
        key: (trace, span_id),
        parent: attrs::span_key(&span.parent_span_id),
        class,
        name: error_reason.is_some().then(|| attrs::clip_id(name).into()),
        start: span.start_time_unix_nano,
        end: span.end_time_unix_nano,
        error_reason,
        error_status,
        finished_by_abort: attrs::str(a, "gen_ai.response.finish_reasons")
            .is_some_and(|f| f.contains("abort")),
        // The node (clock domain) comes from the resource only: SGLang puts `host_id` on thread
        // spans but not on roots and stage spans, and a node known for some events of a process
        // but not others would make the checker compare one clock as two (skew tolerance).
        node: ctx.node.map(Into::into),
        pid: attrs::u64(a, "pid").and_then(|p| u32::try_from(p).ok()),
        input_tokens,
        max_input_tokens,
        max_total_tokens: attrs::first_u64(a, &["max_total_tokens", "max_total_num_tokens"]),
        stage_hint: ctx.stage_hint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons() {
        assert_eq!(
            error_kind("Request x exceeds the maximum number of tokens: 9000 > 8192"),
            Kind::Rejected
        );
        assert_eq!(error_kind("client disconnected"), Kind::Aborted);
        assert_eq!(
            tokens_from_reason("Request 8f3c exceeds the maximum number of tokens: 9000 > 8192"),
            Some((9000, 8192))
        );
        assert_eq!(tokens_from_reason("a > b tokens"), None);
        assert_eq!(tokens_from_reason("no numbers"), None);
        // SGLang 0.5.23's tokenizer and scheduler refusals.
        let tokenizer =
            "The input (9000 tokens) is longer than the model's context length (8192 tokens).";
        assert_eq!(error_kind(tokenizer), Kind::Rejected);
        assert_eq!(tokens_from_reason(tokenizer), Some((9000, 8192)));
        let scheduler = "Input length (9000 tokens) exceeds the maximum allowed length (8191 tokens). Use a shorter input or enable --allow-auto-truncate.";
        assert_eq!(error_kind(scheduler), Kind::Rejected);
        assert_eq!(tokens_from_reason(scheduler), Some((9000, 8191)));
        assert_eq!(tokens_from_reason("(12 tokens)"), None);
        assert_eq!(error_kind("Prefill bootstrap failed"), Kind::Aborted);
    }

    #[test]
    fn roles() {
        assert_eq!(role_from_name("prefill Req 8f3c2b1a"), Some(Stage::Prefill));
        assert_eq!(role_from_name("decode Req 8f3c2b1a"), Some(Stage::Decode));
        assert_eq!(role_from_name(" Req 8f3c2b1a"), None);
        assert_eq!(role_from_name("Prefill Scheduler"), Some(Stage::Prefill));
        assert_eq!(role_from_name("é"), None);
    }
}
