//! The eBPF source task: drains the ring buffer, follows processes, feeds the tracker and sends
//! event batches into the pipeline.
//!
//! The kernel cannot be back-pressured, so nothing here blocks on the pipeline: a full channel
//! drops the batch and counts it, the kernel counts what the ring buffer could not hold, and
//! [`EbpfStats::coverage_degraded`] turns both into one signal.

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use aya::maps::{MapData, RingBuf};
use monitor_common::counter;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc::{Sender, error::TrySendError};

use super::loader::{CaptureConfig, LoadError, Probes};
use super::procs::{self, Discovery, Role};
use super::record::{self, Record};
use super::sock_diag;
use super::track::{Clock, Learned, Tracker, TrackerLimits};
use crate::event::EventBatch;

#[derive(Debug, Clone)]
pub struct EbpfConfig {
    pub capture: CaptureConfig,
    pub discovery: Discovery,
    /// Name of this node, stamped on every event.
    pub node: Option<String>,
    /// How often /proc is rescanned for new processes and listening ports, and counters read.
    pub rescan_every: Duration,
    pub limits: TrackerLimits,
    /// Largest batch sent at once.
    pub max_batch: usize,
    /// How long the rules give a worker to let go of a leg whose partner is gone, to compare
    /// with the timeouts each SGLang worker's environment sets.
    pub hold_windows: HoldWindows,
}

/// The windows of the rules that judge a held leg (`held-decode-slot`: decode waiting for KV,
/// `stranded-kv`: prefill waiting for decode), where they are enabled. A worker whose own
/// timeout is as long as the window holds legs that long by design: the rule would report
/// SGLang's stock behaviour, so the source says so when it starts watching the worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HoldWindows {
    pub decode_waits_for_kv: Option<Duration>,
    pub prefill_waits_for_decode: Option<Duration>,
}

impl HoldWindows {
    /// What the rule named `rule` should be told about a worker of `role` with `timeouts`, if
    /// anything: (the environment variable, the worker's timeout, the rule, its window).
    pub fn beyond(
        &self,
        role: Role,
        timeouts: procs::SglangTimeouts,
    ) -> Option<(&'static str, Duration, &'static str, Duration)> {
        let (var, timeout, rule, window) = match role {
            Role::Decode => (
                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
                timeouts.waiting,
                "held-decode-slot",
                self.decode_waits_for_kv?,
            ),
            Role::Prefill => (
                "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
                timeouts.bootstrap,
                "stranded-kv",
                self.prefill_waits_for_decode?,
            ),
            _ => return None,
        };
        let timeout = timeout.unwrap_or(procs::SGLANG_DEFAULT_TIMEOUT);
        (timeout >= window).then_some((var, timeout, rule, window))
    }
}

impl Default for EbpfConfig {
    fn default() -> Self {
        EbpfConfig {
            capture: CaptureConfig::default(),
            discovery: Discovery::with_conventions(),
            node: None,
            rescan_every: Duration::from_secs(2),
            limits: TrackerLimits::default(),
            max_batch: 1024,
            hold_windows: HoldWindows::default(),
        }
    }
}

/// Counters of the eBPF source, for logs and /metrics. Bounded: no request ids.
#[derive(Debug, Default)]
pub struct EbpfStats {
    /// Sums of the kernel's per-CPU counters, indexed by `monitor_common::counter`.
    pub kernel: [AtomicU64; counter::COUNT as usize],
    pub records: AtomicU64,
    pub decode_errors: AtomicU64,
    pub events: AtomicU64,
    pub batches_sent: AtomicU64,
    /// Batches (and their events) dropped because the pipeline channel was full.
    pub batches_dropped: AtomicU64,
    pub events_dropped: AtomicU64,
    pub conns_evicted: AtomicU64,
    pub http_desyncs: AtomicU64,
    pub gap_bytes: AtomicU64,
    pub zmtp_damaged: AtomicU64,
    pub vllm_nixl_handshakes: AtomicU64,
    pub vllm_transfers_unattributed: AtomicU64,
    pub zmtp_desyncs: AtomicU64,
    /// Rooms whose control-channel protocol state the tracker forgot (table full).
    pub room_states_evicted: AtomicU64,
    /// Requests whose answers were among the records the kernel lost.
    pub answers_lost: AtomicU64,
    /// ZMTP connections whose syscalls the kernel captures whole.
    pub zmtp_captured_whole: AtomicU64,
    /// HTTP connections carrying `/metrics` scrapes whose syscalls the kernel captures whole.
    pub metrics_captured_whole: AtomicU64,
    /// Accepted connections whose listener (the local address they came in on) was not found
    /// in /proc: their peer is attributed by its address alone.
    pub accepts_unplaced: AtomicU64,
    pub watched_processes: AtomicU64,
    /// Connections the tracker currently holds state for.
    pub connections: AtomicU64,
    /// Set while something was lost since the previous check (kernel ring buffer full, pipeline
    /// full, undecodable records, evicted connections).
    pub coverage_degraded: AtomicBool,
}

impl EbpfStats {
    pub fn kernel(&self, idx: u32) -> u64 {
        self.kernel[idx as usize].load(Relaxed)
    }
    pub fn coverage_degraded(&self) -> bool {
        self.coverage_degraded.load(Relaxed)
    }
    /// Everything lost so far, whatever the cause.
    pub fn losses(&self) -> u64 {
        self.kernel(counter::RINGBUF_DROPS)
            + self.kernel(counter::ACTIVE_FULL)
            + self.kernel(counter::SOCKS_FULL)
            // A watched connection whose local address went unreported: its writes to a
            // bootstrap server on this node would read as foreign.
            + self.kernel(counter::CONNECTING_FULL)
            + self.events_dropped.load(Relaxed)
            + self.decode_errors.load(Relaxed)
            + self.conns_evicted.load(Relaxed)
            // KV-transfer control messages lost to a gap: evidence of advancement may be gone.
            + self.zmtp_desyncs.load(Relaxed)
            // A forgotten room's breaches of its control-channel protocol go unseen.
            + self.room_states_evicted.load(Relaxed)
    }
}

/// Records decoded per drain before the batch is sent on.
pub const DRAIN_LIMIT: usize = 4096;

/// How long the final drain at shutdown may take (the drain budget gives the source more).
const FINAL_DRAIN_BUDGET: std::time::Duration = std::time::Duration::from_millis(500);

struct Fd(RawFd);
impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

pub struct EbpfSource {
    ring: RingBuf<MapData>,
    inner: Inner,
}

/// Everything but the ring buffer, so that draining it can borrow both.
struct Inner {
    probes: Probes,
    tracker: Tracker,
    cfg: EbpfConfig,
    stats: Arc<EbpfStats>,
    watched: HashMap<u32, Role>,
    last_losses: u64,
    last_listener_scan: Option<Instant>,
    listeners_stale: bool,
    /// The address of each listening socket of the watched processes, by (pid, fd): an
    /// accepted connection's record names the listener's fd, not the address it came in on.
    listener_addrs: HashMap<(u32, u32), SocketAddr>,
    /// Listeners looked for in /proc since the last scan and not found there (read once each).
    listener_misses: HashSet<(u32, u32)>,
    /// What the last walk of the watched processes' fds saw: the listening sockets of their
    /// namespaces and the processes with their roles. While both stay the same, the fds say
    /// the same, and a scan does not walk them again.
    last_walk: Option<ListenerWalk>,
    /// A namespace's listeners were read from /proc because socket diagnostics were refused
    /// (logged once).
    sock_diag_refused: bool,
    /// `/server_info` findings already handled (bounded by [`MAX_LEARNED_LOGGED`]).
    learned_logged: HashSet<Learned>,
}

/// What a walk of the watched processes' fds depends on: the listening socket inodes of their
/// namespaces (sorted) and the processes with their roles (by pid).
type ListenerWalk = (Vec<u64>, Vec<(u32, Role)>);

/// Distinct `/server_info` findings remembered, so each is logged once.
const MAX_LEARNED_LOGGED: usize = 4096;

impl EbpfSource {
    /// Loads and attaches the probes, then watches the serving processes already running.
    pub fn start(cfg: EbpfConfig) -> Result<EbpfSource, LoadError> {
        let mut probes = Probes::load(&cfg.capture)?;
        let ring = probes.take_ring()?;
        let mut tracker = Tracker::new(cfg.node.clone(), Clock::now(), cfg.limits);
        tracker.set_local_attribution(probes.local_addresses);
        let mut src = Inner {
            probes,
            tracker,
            cfg,
            stats: Arc::new(EbpfStats::default()),
            watched: HashMap::new(),
            last_losses: 0,
            last_listener_scan: None,
            listeners_stale: true,
            listener_addrs: HashMap::new(),
            listener_misses: HashSet::new(),
            last_walk: None,
            sock_diag_refused: false,
            learned_logged: HashSet::new(),
        };
        src.rescan();
        Ok(EbpfSource { ring, inner: src })
    }

    pub fn stats(&self) -> Arc<EbpfStats> {
        Arc::clone(&self.inner.stats)
    }

    /// Processes currently watched and their roles.
    pub fn watched(&self) -> &HashMap<u32, Role> {
        &self.inner.watched
    }

    /// Starts watching `pid` in `role`, with the sockets it already holds.
    pub fn watch(&mut self, pid: u32, role: Role) -> Result<(), LoadError> {
        self.inner.watch(pid, role)
    }

    /// Looks for new serving processes and listening ports; reads the kernel counters.
    pub fn rescan(&mut self) {
        self.inner.rescan()
    }

    /// Decodes what is in the ring buffer now, at most [`DRAIN_LIMIT`] records, so that a full
    /// ring does not turn into one huge batch; returns how many records it read.
    pub fn drain(&mut self, out: &mut EventBatch) -> usize {
        // Records the kernel lost before this drain (ring buffer full, syscall table full) may be
        // control messages of rooms whose next messages this drain reads: the tracker does not
        // judge those rooms' readiness order (see `track::rooms`).
        if let Ok(lost) = self
            .inner
            .probes
            .counter_sum(&[counter::RINGBUF_DROPS, counter::ACTIVE_FULL])
        {
            self.inner.tracker.set_kernel_losses(lost);
        }
        let mut n = 0;
        let mut execs = Vec::new();
        while n < DRAIN_LIMIT
            && let Some(item) = self.ring.next()
        {
            n += 1;
            if let Some(pid) = self.inner.handle(&item, out) {
                execs.push(pid);
            }
        }
        for pid in execs {
            self.inner.on_exec(pid);
        }
        for (from, role) in self.inner.tracker.take_learned() {
            self.inner.on_learned(from, role);
        }
        for (tgid, fd) in self.inner.tracker.take_zmtp_opened() {
            self.inner
                .set_capture(tgid, fd, monitor_common::capture::WHOLE);
        }
        for (tgid, fd) in self.inner.tracker.take_metrics_conns() {
            self.inner
                .set_capture(tgid, fd, monitor_common::capture::STREAM);
        }
        self.inner.stats.records.fetch_add(n as u64, Relaxed);
        n
    }

    /// Runs until `shutdown` resolves: drains the ring buffer when it has data, sends batches
    /// with `try_send` (never waiting on the pipeline), rescans periodically.
    pub async fn run(
        mut self,
        tx: Sender<EventBatch>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), LoadError> {
        // SAFETY: the fd belongs to `self.ring`, which outlives `afd` (both live in this frame
        // and `afd` is dropped first, at the end of this function).
        let afd = unsafe {
            AsyncFd::register_with_interest(
                Fd(self.ring.as_raw_fd()),
                tokio::io::Interest::READABLE,
            )
        }
        .map_err(|e| {
            LoadError::Config(format!(
                "ring buffer fd cannot be polled: {}",
                e.into_parts().1
            ))
        })?;
        let mut poll = tokio::time::interval(super::loader::POLL_INTERVAL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ticker = tokio::time::interval(self.inner.cfg.rescan_every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        let mut batch: EventBatch = Vec::new();
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = ticker.tick() => self.inner.rescan(),
                // Wakeups are batched in the kernel: read what sits below the threshold too.
                _ = poll.tick() => { self.drain(&mut batch); }
                guard = afd.readable() => {
                    let mut guard = guard.map_err(|e| LoadError::Config(format!("polling the ring buffer: {e}")))?;
                    // Still ready when the drain stopped at its limit: come back right away.
                    if self.drain(&mut batch) < DRAIN_LIMIT {
                        guard.clear_ready();
                    }
                }
            }
            self.inner.send(&tx, &mut batch);
            // Let the pipeline's consumer run between drains when it shares this thread.
            tokio::task::yield_now().await;
        }
        // What the ring holds when asked to stop still goes out. A busy node never empties its
        // ring, so the final drain ends at the first short pass or after its budget, not when
        // the ring is empty.
        let until = std::time::Instant::now() + FINAL_DRAIN_BUDGET;
        loop {
            let n = self.drain(&mut batch);
            self.inner.send(&tx, &mut batch);
            if n < DRAIN_LIMIT || std::time::Instant::now() >= until {
                break;
            }
        }
        Ok(())
    }
}

impl Inner {
    fn watch(&mut self, pid: u32, role: Role) -> Result<(), LoadError> {
        self.probes.watch(pid)?;
        self.tracker.set_role(pid, role);
        let first = self.watched.insert(pid, role).is_none();
        if first {
            tracing::info!(pid, role = role.as_str(), "eBPF: watching process");
            let timeouts = procs::SglangTimeouts::of(pid);
            if let Some((var, timeout, rule, window)) = self.cfg.hold_windows.beyond(role, timeouts)
            {
                tracing::warn!(
                    pid,
                    role = role.as_str(),
                    timeout_s = timeout.as_secs(),
                    window_s = window.as_secs(),
                    "eBPF: this SGLang worker lets go of a leg whose partner is gone after {var}={} s, \
                     no sooner than {rule} gives it ({} s): the rule would report its stock \
                     behaviour; patch {rule}'s `within` to the timeout plus 30 s \
                     (docs/advancement.md, \"Windows\")",
                    timeout.as_secs(),
                    window.as_secs(),
                );
            }
        }
        if role == Role::Router
            && let Some(args) = procs::read_cmdline(pid)
        {
            for (wrole, host, port) in procs::router_workers(&args) {
                for addr in resolve(&host, port) {
                    self.tracker.add_worker(addr, wrole);
                }
            }
        }
        // The table of the process's own network namespace (a serving pod's, when revenant
        // runs in a pod of its own).
        let table = procs::NetTables::of([pid]);
        for (fd, inode) in procs::socket_fds(pid) {
            let Some(entry) = table.get(&inode) else {
                continue;
            };
            if entry.listen {
                self.tracker.add_local_listener(entry.local.port(), role);
                self.listener_addrs.insert((pid, fd), entry.local);
                continue;
            }
            if let Err(e) = self.probes.track_socket(pid, fd) {
                tracing::warn!(pid, fd, error = %e, "eBPF: cannot track an existing socket");
            }
            // Connections opened before it was watched: the kernel never reported them.
            self.tracker.add_own_socket(pid, entry.local, entry.remote);
            self.tracker
                .add_existing_socket(pid, fd, Some(entry.remote));
        }
        self.stats
            .watched_processes
            .store(self.watched.len() as u64, Relaxed);
        Ok(())
    }

    /// A connection carries ZMTP (its writes batch many small control messages, each of which
    /// counts: the kernel captures its syscalls up to 4 KiB at each end), or `/metrics` scrapes
    /// (each answer is captured whole, up to 128 KiB per syscall).
    fn set_capture(&mut self, tgid: u32, fd: u32, mode: u32) {
        let (count, what) = if mode == monitor_common::capture::STREAM {
            (&self.stats.metrics_captured_whole, "a /metrics connection")
        } else {
            (&self.stats.zmtp_captured_whole, "a ZMTP connection")
        };
        match self.probes.set_capture(tgid, fd, mode) {
            Ok(true) => {
                count.fetch_add(1, Relaxed);
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(tgid, fd, error = %e, "eBPF: cannot capture {what} whole"),
        }
    }

    fn rescan(&mut self) {
        for pid in procs::all_pids() {
            if self.watched.contains_key(&pid) {
                continue;
            }
            let Some(args) = procs::read_cmdline(pid) else {
                continue;
            };
            // A process that exited and that its parent has not reaped yet is still in /proc
            // (a `--pid` rule matches it whatever its empty command line): it is not watched
            // again, it is gone.
            if let Some(role) = self.cfg.discovery.classify(pid, &args)
                && !procs::has_exited(pid)
                && let Err(e) = self.watch(pid, role)
            {
                tracing::warn!(pid, error = %e, "eBPF: cannot watch process");
            }
        }
        self.scan_listeners();
        self.refresh_counters();
    }

    /// Ports that watched processes listen on (servers bind well after they exec). The
    /// namespaces' listening sockets are cheap to ask for; which process holds which is a
    /// readlink per fd (thousands on a busy server), done only when the listeners or the
    /// watched processes changed since the last walk.
    fn scan_listeners(&mut self) {
        self.last_listener_scan = Some(Instant::now());
        self.listeners_stale = false;
        let mut watched: Vec<(u32, Role)> = self.watched.iter().map(|(p, r)| (*p, *r)).collect();
        watched.sort_unstable_by_key(|(p, _)| *p);
        let listening = self.listeners_of(watched.iter().map(|(p, _)| *p));
        let mut inodes: Vec<u64> = listening.keys().copied().collect();
        inodes.sort_unstable();
        let walk = (inodes, watched);
        if self.last_walk.as_ref() == Some(&walk) {
            return;
        }
        self.listener_addrs.clear();
        self.listener_misses.clear();
        for &(pid, role) in &walk.1 {
            for (fd, inode) in procs::socket_fds(pid) {
                if let Some(local) = listening.get(&inode) {
                    self.tracker.add_local_listener(local.port(), role);
                    self.listener_addrs.insert((pid, fd), *local);
                }
            }
        }
        self.last_walk = Some(walk);
    }

    /// Listening sockets (inode → address) of the network namespaces of `pids`, each asked
    /// once: from the kernel's socket diagnostics, or from `/proc/PID/net/tcp{,6}` when those
    /// are refused (entering another namespace needs `CAP_SYS_ADMIN`).
    fn listeners_of(&mut self, pids: impl IntoIterator<Item = u32>) -> HashMap<u64, SocketAddr> {
        let mut out = HashMap::new();
        for pid in procs::one_per_namespace(pids) {
            match sock_diag::listening_in(pid) {
                Ok(l) => out.extend(l),
                Err(e) => {
                    if !std::mem::replace(&mut self.sock_diag_refused, true) {
                        tracing::info!(
                            pid,
                            error = %e,
                            "eBPF: socket diagnostics refused; listening ports read from /proc/PID/net/tcp (slower on a busy node)"
                        );
                    }
                    let table = procs::tcp_table(std::path::Path::new(&format!("/proc/{pid}")));
                    out.extend(
                        table
                            .into_iter()
                            .filter(|(_, e)| e.listen)
                            .map(|(inode, e)| (inode, e.local)),
                    );
                }
            }
        }
        out
    }

    /// Where an accepted connection came in on: its listener's address, read from /proc (the
    /// accepting process's sockets again for a listener opened since the last scan, once).
    fn place_accept(&mut self, c: &mut record::Conn) {
        let Some(fd) = c.listener_fd else { return };
        if c.peer.is_none() {
            return;
        }
        let key = (c.hdr.tgid, fd);
        if !self.listener_addrs.contains_key(&key) && self.listener_misses.insert(key) {
            let pid = c.hdr.tgid;
            let listening = self.listeners_of([pid]);
            for (fd, inode) in procs::socket_fds(pid) {
                if let Some(local) = listening.get(&inode) {
                    self.listener_addrs.insert((pid, fd), *local);
                }
            }
        }
        c.local = self.listener_addrs.get(&key).copied();
        if c.local.is_none() {
            self.stats.accepts_unplaced.fetch_add(1, Relaxed);
        }
    }

    fn refresh_counters(&mut self) {
        match self.probes.counters() {
            Ok(k) => {
                for i in 0..counter::COUNT {
                    self.stats.kernel[i as usize].store(k.get(i), Relaxed);
                }
            }
            Err(e) => tracing::warn!(error = %e, "eBPF: cannot read kernel counters"),
        }
        let t = self.tracker.stats;
        self.stats.conns_evicted.store(t.conns_evicted, Relaxed);
        self.stats.http_desyncs.store(t.http_desyncs, Relaxed);
        self.stats.gap_bytes.store(t.gap_bytes, Relaxed);
        self.stats.zmtp_damaged.store(t.zmtp_damaged, Relaxed);
        self.stats
            .vllm_nixl_handshakes
            .store(t.vllm_nixl_handshakes, Relaxed);
        self.stats
            .vllm_transfers_unattributed
            .store(t.vllm_transfers_unattributed, Relaxed);
        self.stats.zmtp_desyncs.store(t.zmtp_desyncs, Relaxed);
        self.stats
            .room_states_evicted
            .store(t.room_states_evicted, Relaxed);
        self.stats.answers_lost.store(t.answers_lost, Relaxed);
        self.stats
            .connections
            .store(self.tracker.conn_count() as u64, Relaxed);
        let losses = self.stats.losses();
        let degraded = losses > self.last_losses;
        if degraded {
            tracing::warn!(
                lost = losses - self.last_losses,
                ringbuf_drops = self.stats.kernel(counter::RINGBUF_DROPS),
                events_dropped = self.stats.events_dropped.load(Relaxed),
                "eBPF coverage degraded: events were lost"
            );
        }
        self.stats.coverage_degraded.store(degraded, Relaxed);
        self.last_losses = losses;
    }

    /// Handles one record; returns the pid of an exec, handled after the drain (it reads /proc).
    fn handle(&mut self, item: &[u8], out: &mut EventBatch) -> Option<u32> {
        match record::decode(item) {
            Ok(Record::Exec { hdr }) => return Some(hdr.tgid),
            Ok(Record::Fork { hdr, child }) => self.on_fork(hdr.tgid, child),
            Ok(Record::Exit { hdr }) => {
                self.tracker.remove_process(hdr.tgid, hdr.ts_ns, out);
                self.probes.forget_sockets(hdr.tgid);
                if let Some(role) = self.watched.remove(&hdr.tgid) {
                    tracing::info!(
                        pid = hdr.tgid,
                        role = role.as_str(),
                        "eBPF: watched process exited"
                    );
                }
            }
            Ok(mut rec) => {
                if let Record::Accept(c) = &mut rec {
                    self.place_accept(c);
                }
                if let Record::Connect(c) = &rec
                    && c.peer.is_some_and(|p| p.ip().is_loopback())
                {
                    self.listeners_stale = true;
                }
                if self.listeners_stale
                    && self
                        .last_listener_scan
                        .is_none_or(|t| t.elapsed() > Duration::from_millis(100))
                {
                    self.scan_listeners();
                }
                self.tracker.on_record(&rec, out);
            }
            Err(e) => {
                self.stats.decode_errors.fetch_add(1, Relaxed);
                tracing::debug!(error = %e, kind = e.label(), "eBPF: undecodable record");
            }
        }
        None
    }

    /// A `/server_info` answer named a server's `disaggregation_mode` (`role` is `None` for
    /// `"null"`). The tracker already gave a watched process of unknown role its role; here the
    /// role reaches the process table, its children and its listening ports, and a local server
    /// that was not watched at all (found by the port it answered on) starts being watched.
    fn on_learned(&mut self, from: Learned, role: Option<Role>) {
        // Each finding is acted on (and logged) once: a router re-reading /server_info must
        // not rescan /proc every time.
        if self.learned_logged.len() >= MAX_LEARNED_LOGGED || !self.learned_logged.insert(from) {
            return;
        }
        let Some(role) = role else {
            tracing::info!(
                ?from,
                "eBPF: /server_info says not disaggregated (mode null); role left unknown"
            );
            return;
        };
        let pid = match from {
            Learned::Process(pid) => Some(pid),
            Learned::Address(addr) if addr.ip().is_loopback() || addr.ip().is_unspecified() => {
                procs::listener_pid(
                    addr.port(),
                    &procs::NetTables::of(self.watched.keys().copied()),
                )
            }
            Learned::Address(_) => None,
        };
        let Some(pid) = pid else {
            tracing::info!(
                ?from,
                role = role.as_str(),
                "eBPF: worker role learned from /server_info"
            );
            return;
        };
        match self.watched.get(&pid).copied() {
            Some(Role::Unknown) => self.set_learned_role(pid, role),
            // Watched already with a role its command line or a rule gave: that role stands.
            Some(_) => return,
            None => {
                if let Err(e) = self.watch(pid, role) {
                    tracing::warn!(pid, error = %e, "eBPF: cannot watch a server found by its /server_info answer");
                    return;
                }
            }
        }
        tracing::info!(
            pid,
            ?from,
            role = role.as_str(),
            "eBPF: process role learned from /server_info"
        );
    }

    fn set_learned_role(&mut self, pid: u32, role: Role) {
        self.watched.insert(pid, role);
        self.tracker.set_role(pid, role);
        // Children forked before the answer (SGLang's scheduler subprocesses, which carry the
        // KV-transfer traffic) serve the same role.
        let children: Vec<u32> = self
            .watched
            .iter()
            .filter(|(c, r)| **r == Role::Unknown && procs::ppid_of(**c) == Some(pid))
            .map(|(c, _)| *c)
            .collect();
        for c in children {
            self.watched.insert(c, role);
            self.tracker.set_role(c, role);
        }
        self.scan_listeners();
    }

    fn on_exec(&mut self, pid: u32) {
        let Some(args) = procs::read_cmdline(pid) else {
            return;
        };
        if let Some(role) = self.cfg.discovery.classify(pid, &args)
            && self.watched.get(&pid) != Some(&role)
            // A rule that says `unknown` does not undo a role learned from traffic.
            && !(role == Role::Unknown && self.watched.contains_key(&pid))
            && let Err(e) = self.watch(pid, role)
        {
            tracing::warn!(pid, error = %e, "eBPF: cannot watch process");
        }
        // An inherited child that execs something unclassified keeps its parent's role: that
        // is how SGLang's scheduler subprocesses start.
    }

    fn on_fork(&mut self, parent: u32, child: u32) {
        match procs::tgid_of(child) {
            Some(tgid) if tgid == child => {
                if let Some(role) = self.watched.get(&parent).copied() {
                    self.watched.insert(child, role);
                    self.tracker.set_role(child, role);
                    self.stats
                        .watched_processes
                        .store(self.watched.len() as u64, Relaxed);
                }
            }
            // A thread, or a task already gone: the kernel filters on tgids, drop the entry.
            _ => {
                if !self.watched.contains_key(&child) {
                    self.probes.unwatch(child);
                }
            }
        }
    }

    fn send(&mut self, tx: &Sender<EventBatch>, batch: &mut EventBatch) {
        while !batch.is_empty() {
            let rest = if batch.len() > self.cfg.max_batch {
                batch.split_off(self.cfg.max_batch)
            } else {
                Vec::new()
            };
            let chunk = std::mem::replace(batch, rest);
            let n = chunk.len() as u64;
            match tx.try_send(chunk) {
                Ok(()) => {
                    self.stats.batches_sent.fetch_add(1, Relaxed);
                    self.stats.events.fetch_add(n, Relaxed);
                }
                Err(TrySendError::Full(_)) | Err(TrySendError::Closed(_)) => {
                    self.stats.batches_dropped.fetch_add(1, Relaxed);
                    self.stats.events_dropped.fetch_add(n, Relaxed);
                    if !self.stats.coverage_degraded.swap(true, Relaxed) {
                        tracing::warn!(events = n, "eBPF: pipeline full, dropped an event batch");
                    }
                }
            }
        }
    }
}

fn resolve(host: &str, port: u16) -> Vec<SocketAddr> {
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return vec![SocketAddr::new(ip, port)];
    }
    (host, port)
        .to_socket_addrs()
        .map(|it| it.collect())
        .unwrap_or_default()
}
