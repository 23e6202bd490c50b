//! Loads the embedded kernel programs, attaches them to their tracepoints and hands out the maps.
//!
//! Every way this can fail on a real node gets its own error with what to do about it: no
//! privileges, tracefs not mounted, a program the verifier rejects, a tracepoint that does not
//! exist on this kernel.

use std::io;
use std::path::{Path, PathBuf};

use aya::maps::{HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf};
use aya::programs::TracePoint;
use aya::{Ebpf, EbpfLoader};
use monitor_common::{MAX_CAPTURE, counter, watch};

/// The kernel object `monitor/build.rs` built with aya-build.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/monitor-ebpf"));

/// Where the syscall and sched tracepoints are described; aya attaches through it.
const TRACEFS_DIRS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// Every program in the object and the tracepoint it attaches to.
pub const PROGRAMS: &[(&str, &str)] = &[
    ("sys_enter_read", "syscalls"),
    ("sys_exit_read", "syscalls"),
    ("sys_enter_write", "syscalls"),
    ("sys_exit_write", "syscalls"),
    ("sys_enter_readv", "syscalls"),
    ("sys_exit_readv", "syscalls"),
    ("sys_enter_writev", "syscalls"),
    ("sys_exit_writev", "syscalls"),
    ("sys_enter_recvfrom", "syscalls"),
    ("sys_exit_recvfrom", "syscalls"),
    ("sys_enter_sendto", "syscalls"),
    ("sys_exit_sendto", "syscalls"),
    ("sys_enter_recvmsg", "syscalls"),
    ("sys_exit_recvmsg", "syscalls"),
    ("sys_enter_sendmsg", "syscalls"),
    ("sys_exit_sendmsg", "syscalls"),
    ("sys_enter_connect", "syscalls"),
    ("sys_exit_connect", "syscalls"),
    ("sys_enter_accept", "syscalls"),
    ("sys_exit_accept", "syscalls"),
    ("sys_enter_accept4", "syscalls"),
    ("sys_exit_accept4", "syscalls"),
    ("sys_enter_close", "syscalls"),
    ("sched_process_fork", "sched"),
    ("sched_process_exec", "sched"),
    ("sched_process_exit", "sched"),
];

/// The program that reports the local address of every connection a watched process opens
/// (`sock/inet_sock_set_state`). Without it the probes still work; a peer on this node is then
/// unattributed rather than foreign (`track::Tracker::peer_of`).
pub const LOCAL_ADDRESS_PROGRAM: (&str, &str) = ("inet_sock_set_state", "sock");

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "not allowed to load eBPF programs ({0}): run revenant as root or grant it CAP_BPF and \
         CAP_PERFMON (and CAP_SYS_ADMIN on kernels before 5.8), or start it with --ebpf off"
    )]
    Privileges(String),
    #[error(
        "tracefs is not mounted (looked in {dirs}) and mounting it failed: {reason}; run \
         `mount -t tracefs tracefs /sys/kernel/tracing` as root, or start with --ebpf off"
    )]
    TracefsMissing { dirs: String, reason: String },
    #[error("tracepoint {category}/{name} does not exist on this kernel ({path} is missing)")]
    MissingTracepoint {
        category: &'static str,
        name: &'static str,
        path: PathBuf,
    },
    #[error("invalid eBPF configuration: {0}")]
    Config(String),
    #[error("loading the eBPF object failed: {0}")]
    Object(#[source] aya::EbpfError),
    #[error("the kernel rejected program {program}: {source}")]
    Program {
        program: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("eBPF map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
}

/// Capture sizes; validated before anything is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CaptureConfig {
    /// Leading bytes of each syscall's payload (default 512, at most 4096).
    pub head_bytes: u32,
    /// Trailing bytes of each syscall that moved more than `head_bytes` (default 512, at most 4096).
    pub tail_bytes: u32,
    /// Ring buffer size in bytes: a power of two multiple of the page size.
    pub ring_bytes: u32,
    /// Pending bytes before the kernel wakes the reader (0: every record). The reader also
    /// polls every [`POLL_INTERVAL`], so this only bounds latency under load.
    pub wakeup_bytes: u32,
}

/// How often the reader drains the ring buffer without being woken.
pub const POLL_INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);

impl Default for CaptureConfig {
    fn default() -> Self {
        CaptureConfig {
            head_bytes: monitor_common::DEFAULT_HEAD_BYTES,
            tail_bytes: monitor_common::DEFAULT_TAIL_BYTES,
            ring_bytes: 16 << 20,
            wakeup_bytes: 256 << 10,
        }
    }
}

impl CaptureConfig {
    pub fn validate(&self) -> Result<(), LoadError> {
        let max = MAX_CAPTURE as u32;
        if self.head_bytes == 0 || self.head_bytes > max {
            return Err(LoadError::Config(format!(
                "head_bytes {} must be in 1..={max}",
                self.head_bytes
            )));
        }
        if self.tail_bytes > max {
            return Err(LoadError::Config(format!(
                "tail_bytes {} must be at most {max}",
                self.tail_bytes
            )));
        }
        if !self.ring_bytes.is_power_of_two() || self.ring_bytes < 4096 {
            return Err(LoadError::Config(format!(
                "ring_bytes {} must be a power of two of at least 4096",
                self.ring_bytes
            )));
        }
        if self.wakeup_bytes >= self.ring_bytes / 2 {
            return Err(LoadError::Config(format!(
                "wakeup_bytes {} must be below half the ring ({})",
                self.wakeup_bytes, self.ring_bytes
            )));
        }
        Ok(())
    }
}

/// The loaded, attached programs. Dropping it detaches everything, all programs at once.
pub struct Probes {
    ebpf: Ebpf,
    /// [`LOCAL_ADDRESS_PROGRAM`] is attached: every connection watched processes open is
    /// reported with its local address.
    pub local_addresses: bool,
}

/// Sums of the per-CPU kernel counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelCounters(pub [u64; counter::COUNT as usize]);

impl KernelCounters {
    pub fn get(&self, idx: u32) -> u64 {
        self.0[idx as usize]
    }
}

/// Each program's detach waits in the kernel (60–80 ms each on 6.18, most of it a grace period):
/// the 27 of them one after another held every stop for about 2 s. Detached side by side, part of
/// those waits overlap (about 1 s in all).
impl Drop for Probes {
    fn drop(&mut self) {
        std::thread::scope(|s| {
            for (name, prog) in self.ebpf.programs_mut() {
                s.spawn(move || {
                    if let Ok(tp) = <&mut TracePoint>::try_from(prog)
                        && let Err(e) = tp.unload()
                    {
                        tracing::debug!(program = name, error = %e, "eBPF: detaching");
                    }
                });
            }
        });
    }
}

impl Probes {
    /// Checks the environment, loads the object with `cfg` and attaches every program.
    pub fn load(cfg: &CaptureConfig) -> Result<Probes, LoadError> {
        cfg.validate()?;
        raise_memlock_rlimit();
        let tracefs = ensure_tracefs()?;
        let fork_off = fork_child_pid_offset(&tracefs).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "reading sched_process_fork format; assuming offset 20");
            20
        });
        // 0 (the leader's exit ends the process) on kernels before 6.16, which have no field.
        let group_dead_off = exit_group_dead_offset(&tracefs).unwrap_or(0);
        let mut ebpf = EbpfLoader::new()
            .override_global("HEAD_BYTES", &cfg.head_bytes, true)
            .override_global("TAIL_BYTES", &cfg.tail_bytes, true)
            .override_global("FORK_CHILD_PID_OFFSET", &fork_off, true)
            .override_global("EXIT_GROUP_DEAD_OFFSET", &group_dead_off, true)
            .override_global("WAKEUP_BYTES", &cfg.wakeup_bytes, true)
            .map_max_entries("EVENTS", cfg.ring_bytes)
            .load(OBJECT)
            .map_err(classify_object_error)?;
        for &(name, category) in PROGRAMS {
            let path = tracefs.join("events").join(category).join(name);
            if !path.is_dir() {
                return Err(LoadError::MissingTracepoint {
                    category,
                    name,
                    path,
                });
            }
        }
        let local = local_address_layout(&tracefs);
        let mut wanted: Vec<(&'static str, &'static str)> = PROGRAMS.to_vec();
        if local.is_ok() {
            wanted.push(LOCAL_ADDRESS_PROGRAM);
        }
        let mut results = attach_all(&mut ebpf, &wanted);
        let local_result = if local.is_ok() {
            results.pop().expect("one result per program")
        } else {
            Ok(())
        };
        // The first failure in the programs' order, whichever thread met it first.
        results.into_iter().collect::<Result<(), LoadError>>()?;
        let local_addresses = match local.and(local_result) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "eBPF: local addresses of connections not reported; writers to a bootstrap \
                     server on this node are unattributed, never foreign"
                );
                false
            }
        };
        tracing::info!(
            programs = PROGRAMS.len() + usize::from(local_addresses),
            head_bytes = cfg.head_bytes,
            tail_bytes = cfg.tail_bytes,
            ring_bytes = cfg.ring_bytes,
            "eBPF probes attached"
        );
        Ok(Probes {
            ebpf,
            local_addresses,
        })
    }

    /// Takes the ring buffer out (once) for the reader task.
    pub fn take_ring(&mut self) -> Result<RingBuf<MapData>, LoadError> {
        let map = self
            .ebpf
            .take_map("EVENTS")
            .ok_or_else(|| LoadError::Config("EVENTS ring buffer already taken".into()))?;
        RingBuf::try_from(map).map_err(|source| LoadError::Map {
            name: "EVENTS",
            source,
        })
    }

    /// Starts (or keeps) following `tgid`: the kernel then reports its socket traffic.
    pub fn watch(&mut self, tgid: u32) -> Result<(), LoadError> {
        self.watched()?
            .insert(tgid, watch::EXPLICIT, 0)
            .map_err(|source| LoadError::Map {
                name: "WATCHED",
                source,
            })
    }

    pub fn unwatch(&mut self, tgid: u32) {
        if let Ok(mut m) = self.watched() {
            let _ = m.remove(&tgid);
        }
    }

    /// Tgids (and inherited thread ids) the kernel currently filters on.
    pub fn watched_ids(&mut self) -> Vec<u32> {
        match self.watched() {
            Ok(m) => m.keys().filter_map(Result::ok).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Tells the kernel side that `fd` of `tgid` is a socket that existed before we watched it.
    pub fn track_socket(&mut self, tgid: u32, fd: u32) -> Result<(), LoadError> {
        let map = self
            .ebpf
            .map_mut("SOCKS")
            .ok_or_else(|| LoadError::Config("no SOCKS map".into()))?;
        let mut m: BpfHashMap<&mut MapData, u64, u32> =
            BpfHashMap::try_from(map).map_err(|source| LoadError::Map {
                name: "SOCKS",
                source,
            })?;
        m.insert(monitor_common::sock_key(tgid, fd), 0, 0)
            .map_err(|source| LoadError::Map {
                name: "SOCKS",
                source,
            })
    }

    /// Changes how much of every syscall on `fd` of `tgid` the kernel captures from now on
    /// (a [`monitor_common::capture`] mode): [`monitor_common::capture::WHOLE`] for a ZeroMQ
    /// control connection, whose writes batch many small messages;
    /// [`monitor_common::capture::STREAM`] for an HTTP connection whose long answers are read
    /// for a line anywhere in them. Only a socket the kernel side still tracks is changed (a
    /// closed one is not brought back); false when it tracks none.
    pub fn set_capture(&mut self, tgid: u32, fd: u32, mode: u32) -> Result<bool, LoadError> {
        let map = self
            .ebpf
            .map_mut("SOCKS")
            .ok_or_else(|| LoadError::Config("no SOCKS map".into()))?;
        let mut m: BpfHashMap<&mut MapData, u64, u32> =
            BpfHashMap::try_from(map).map_err(|source| LoadError::Map {
                name: "SOCKS",
                source,
            })?;
        /// `BPF_EXIST`: update an entry, never create one.
        const BPF_EXIST: u64 = 2;
        Ok(
            m.insert(monitor_common::sock_key(tgid, fd), mode, BPF_EXIST)
                .is_ok(),
        )
    }

    /// Forgets every socket of an exited process.
    pub fn forget_sockets(&mut self, tgid: u32) {
        let Some(map) = self.ebpf.map_mut("SOCKS") else {
            return;
        };
        let Ok(mut m) = BpfHashMap::<&mut MapData, u64, u32>::try_from(map) else {
            return;
        };
        let keys: Vec<u64> = m
            .keys()
            .filter_map(Result::ok)
            .filter(|k| (k >> 32) as u32 == tgid)
            .collect();
        for k in keys {
            let _ = m.remove(&k);
        }
    }

    /// The kernel's per-CPU counters (`monitor_common::counter`).
    fn counters_map(&self) -> Result<PerCpuArray<&MapData, u64>, LoadError> {
        let map = self
            .ebpf
            .map("COUNTERS")
            .ok_or_else(|| LoadError::Config("no COUNTERS map".into()))?;
        PerCpuArray::try_from(map).map_err(|source| LoadError::Map {
            name: "COUNTERS",
            source,
        })
    }

    /// The sum of some kernel counters over all CPUs: cheaper than [`Self::counters`] (one map
    /// lookup each).
    pub fn counter_sum(&self, idxs: &[u32]) -> Result<u64, LoadError> {
        let arr = self.counters_map()?;
        let mut sum = 0u64;
        for i in idxs {
            let per_cpu = arr.get(i, 0).map_err(|source| LoadError::Map {
                name: "COUNTERS",
                source,
            })?;
            sum = per_cpu.iter().fold(sum, |a, v| a.wrapping_add(*v));
        }
        Ok(sum)
    }

    pub fn counters(&self) -> Result<KernelCounters, LoadError> {
        let arr = self.counters_map()?;
        let mut out = KernelCounters::default();
        for i in 0..counter::COUNT {
            let per_cpu = arr.get(&i, 0).map_err(|source| LoadError::Map {
                name: "COUNTERS",
                source,
            })?;
            out.0[i as usize] = per_cpu.iter().sum();
        }
        Ok(out)
    }

    fn watched(&mut self) -> Result<BpfHashMap<&mut MapData, u32, u32>, LoadError> {
        let map = self
            .ebpf
            .map_mut("WATCHED")
            .ok_or_else(|| LoadError::Config("no WATCHED map".into()))?;
        BpfHashMap::try_from(map).map_err(|source| LoadError::Map {
            name: "WATCHED",
            source,
        })
    }
}

/// Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK; newer ones use memcg and ignore it.
/// Raising it needs CAP_SYS_RESOURCE, which containers often lack: log and go on.
fn raise_memlock_rlimit() {
    let rlim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain syscall with a valid pointer to a local.
    let ret = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rlim) };
    if ret != 0 {
        tracing::debug!(
            error = %io::Error::last_os_error(),
            "could not raise RLIMIT_MEMLOCK (harmless on kernels >= 5.11)"
        );
    }
}

/// Finds tracefs, mounting it when absent (we run as root when loading probes at all).
fn ensure_tracefs() -> Result<PathBuf, LoadError> {
    for d in TRACEFS_DIRS {
        if Path::new(d).join("events").is_dir() {
            return Ok(PathBuf::from(d));
        }
    }
    let target = TRACEFS_DIRS[0];
    let c_target = std::ffi::CString::new(target).expect("no NUL");
    let fstype = c"tracefs";
    // SAFETY: valid NUL-terminated strings; null data is allowed for tracefs.
    let ret = unsafe {
        libc::mount(
            fstype.as_ptr(),
            c_target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if ret == 0 && Path::new(target).join("events").is_dir() {
        tracing::info!(path = target, "mounted tracefs");
        return Ok(PathBuf::from(target));
    }
    Err(LoadError::TracefsMissing {
        dirs: TRACEFS_DIRS.join(", "),
        reason: io::Error::last_os_error().to_string(),
    })
}

/// Whether tracefs shows the record layout [`LOCAL_ADDRESS_PROGRAM`] reads.
fn local_address_layout(tracefs: &Path) -> Result<(), LoadError> {
    let (name, category) = LOCAL_ADDRESS_PROGRAM;
    let path = tracefs.join("events").join(category).join(name);
    let format =
        std::fs::read_to_string(path.join("format")).map_err(|_| LoadError::MissingTracepoint {
            category,
            name,
            path: path.clone(),
        })?;
    check_layout(&format, &monitor_common::inet_sock_set_state::FIELDS)
        .map_err(|m| LoadError::Config(format!("{category}/{name}: {m}")))
}

/// Loads and attaches every `(program, category)` of `wanted`, its result at its index. The
/// verifier takes 0.2–0.3 s of CPU for each of the larger programs and checks privileged
/// programs side by side, so one worker per core takes the next program as it is free (a start
/// spent 1.75 s on them one after another on 2 cores).
fn attach_all(
    ebpf: &mut Ebpf,
    wanted: &[(&'static str, &'static str)],
) -> Vec<Result<(), LoadError>> {
    type Job<'a> = (
        usize,
        &'static str,
        &'static str,
        Option<&'a mut aya::programs::Program>,
    );
    let mut programs: std::collections::HashMap<&str, &mut aya::programs::Program> =
        ebpf.programs_mut().collect();
    let jobs: Vec<Job<'_>> = wanted
        .iter()
        .enumerate()
        .map(|(i, &(name, category))| (i, name, category, programs.remove(name)))
        .collect();
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, jobs.len().max(1));
    let queue = std::sync::Mutex::new(jobs.into_iter());
    let mut results: Vec<Result<(), LoadError>> = Vec::with_capacity(wanted.len());
    results.resize_with(wanted.len(), || Ok(()));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    block_signals();
                    let mut done = Vec::new();
                    loop {
                        let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                        let Some((i, name, category, prog)) = next else {
                            return done;
                        };
                        done.push((i, attach_tracepoint(prog, category, name)));
                    }
                })
            })
            .collect();
        for h in handles {
            for (i, r) in h.join().expect("an attach worker panicked") {
                results[i] = r;
            }
        }
    });
    results
}

/// Loads program `name` of the object and attaches it to tracepoint `category/name`.
fn attach_tracepoint(
    prog: Option<&mut aya::programs::Program>,
    category: &'static str,
    name: &'static str,
) -> Result<(), LoadError> {
    let prog: &mut TracePoint = prog
        .ok_or_else(|| LoadError::Config(format!("program {name} missing from the object")))?
        .try_into()
        .map_err(|source| LoadError::Program {
            program: name,
            source,
        })?;
    retry_interrupted(|| prog.load()).map_err(|source| classify_program_error(name, source))?;
    prog.attach(category, name)
        .map_err(|source| classify_program_error(name, source))?;
    Ok(())
}

/// Blocks every signal that can be blocked on this thread (an attach worker, which ends with
/// the load): the kernel hands a process-directed signal to a thread that does not block it,
/// so a SIGTERM or SIGHUP at start-up does not cut a verification short here. SIGSTOP cannot
/// be blocked ([`retry_interrupted`]).
fn block_signals() {
    // SAFETY: a zeroed sigset_t is filled by sigfillset before use; pthread_sigmask changes
    // this thread's mask only.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
    }
}

/// Times a program load is tried while the verifier is interrupted.
const LOAD_ATTEMPTS: usize = 10;

/// Runs a program load again when the kernel's verifier gave up because a signal came in
/// (`BPF_PROG_LOAD` fails with EAGAIN while a signal is pending; a verification takes up to a
/// second here): a SIGSTOP/SIGCONT or a terminal's SIGWINCH at start-up must not fail it.
/// libbpf does the same.
fn retry_interrupted(
    load: impl FnMut() -> Result<(), aya::programs::ProgramError>,
) -> Result<(), aya::programs::ProgramError> {
    retry_while(load, |e| {
        matches!(e, aya::programs::ProgramError::LoadError { io_error, .. }
            if io_error.raw_os_error() == Some(libc::EAGAIN))
    })
}

/// `f` again while its error `again` says so, [`LOAD_ATTEMPTS`] times at most.
fn retry_while<E>(
    mut f: impl FnMut() -> Result<(), E>,
    again: impl Fn(&E) -> bool,
) -> Result<(), E> {
    let mut attempt = 1;
    loop {
        match f() {
            Err(e) if again(&e) && attempt < LOAD_ATTEMPTS => attempt += 1,
            other => return other,
        }
    }
}

/// Every `(field, offset)` is where the tracefs `format` says.
pub fn check_layout(format: &str, fields: &[(&str, usize)]) -> Result<(), String> {
    for &(field, want) in fields {
        match parse_field_offset(format, field) {
            Some(got) if got as usize == want => {}
            Some(got) => return Err(format!("field {field} at offset {got}, not {want}")),
            None => return Err(format!("no field {field}")),
        }
    }
    Ok(())
}

fn fork_child_pid_offset(tracefs: &Path) -> io::Result<u32> {
    let fmt = std::fs::read_to_string(tracefs.join("events/sched/sched_process_fork/format"))?;
    parse_field_offset(&fmt, "child_pid")
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no child_pid field"))
}

/// Where `sched_process_exit` says whether the exiting thread was its process's last.
fn exit_group_dead_offset(tracefs: &Path) -> Option<u32> {
    let fmt =
        std::fs::read_to_string(tracefs.join("events/sched/sched_process_exit/format")).ok()?;
    parse_field_offset(&fmt, "group_dead")
}

/// Reads `offset:N` of field `name` from a tracefs `format` file.
pub fn parse_field_offset(format: &str, name: &str) -> Option<u32> {
    format.lines().find_map(|line| {
        let line = line.trim();
        let decl = line.strip_prefix("field:")?.split(';').next()?;
        // An array field is named with its length: `__u8 saddr[4]`.
        let field = decl.split_whitespace().last()?.split('[').next()?;
        if field != name {
            return None;
        }
        let off = line
            .split(';')
            .find_map(|p| p.trim().strip_prefix("offset:"))?;
        off.trim().parse().ok()
    })
}

fn is_eperm(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<io::Error>()
            && matches!(io.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES))
        {
            return true;
        }
        cur = err.source();
    }
    false
}

fn classify_object_error(e: aya::EbpfError) -> LoadError {
    if is_eperm(&e) {
        LoadError::Privileges(e.to_string())
    } else {
        LoadError::Object(e)
    }
}

fn classify_program_error(program: &'static str, source: aya::programs::ProgramError) -> LoadError {
    if is_eperm(&source) {
        LoadError::Privileges(format!("{program}: {source}"))
    } else {
        LoadError::Program { program, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A verification a signal cut short is run again; a rejection is not, and the attempts
    /// end.
    #[test]
    fn a_load_interrupted_by_a_signal_is_tried_again() {
        let err = io::Error::from_raw_os_error;
        // (succeeded, calls) when the n-th call answers `answer(n)`.
        let run = |answer: &dyn Fn(usize) -> Result<(), io::Error>| {
            let mut calls = 0;
            let r = retry_while(
                || {
                    calls += 1;
                    answer(calls)
                },
                |e| e.raw_os_error() == Some(libc::EAGAIN),
            );
            (r.is_ok(), calls)
        };
        let twice_interrupted = |n| {
            if n < 3 {
                Err(err(libc::EAGAIN))
            } else {
                Ok(())
            }
        };
        assert_eq!(run(&twice_interrupted), (true, 3));
        assert_eq!(
            run(&|_| Err(err(libc::EACCES))),
            (false, 1),
            "a rejection is final"
        );
        assert_eq!(run(&|_| Err(err(libc::EAGAIN))), (false, LOAD_ATTEMPTS));
    }

    const FORK_FORMAT: &str = "name: sched_process_fork\nID: 366\nformat:\n\
        \tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\
        \tfield:__data_loc char[] parent_comm;\toffset:8;\tsize:4;\tsigned:0;\n\
        \tfield:pid_t parent_pid;\toffset:12;\tsize:4;\tsigned:1;\n\
        \tfield:__data_loc char[] child_comm;\toffset:16;\tsize:4;\tsigned:0;\n\
        \tfield:pid_t child_pid;\toffset:20;\tsize:4;\tsigned:1;\n";

    /// `sched/sched_process_exit` as kernel 6.18 describes it.
    const EXIT_FORMAT: &str = "name: sched_process_exit\nID: 369\nformat:\n\
        \tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\
        \tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\
        \tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n\
        \tfield:int prio;\toffset:28;\tsize:4;\tsigned:1;\n\
        \tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;\n";

    #[test]
    fn finds_the_exit_record_s_group_dead_flag() {
        assert_eq!(parse_field_offset(EXIT_FORMAT, "group_dead"), Some(32));
        let old = EXIT_FORMAT.replace(
            "\tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;\n",
            "",
        );
        assert_eq!(parse_field_offset(&old, "group_dead"), None);
    }

    #[test]
    fn finds_field_offsets_in_tracefs_formats() {
        assert_eq!(parse_field_offset(FORK_FORMAT, "child_pid"), Some(20));
        assert_eq!(parse_field_offset(FORK_FORMAT, "parent_pid"), Some(12));
        assert_eq!(parse_field_offset(FORK_FORMAT, "pid"), None);
        assert_eq!(parse_field_offset("garbage;;offset:", "child_pid"), None);
    }

    /// `sock/inet_sock_set_state` as kernel 6.18 describes it.
    const SET_STATE_FORMAT: &str = "name: inet_sock_set_state\nID: 2287\nformat:\n\
        \tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\
        \tfield:const void * skaddr;\toffset:8;\tsize:8;\tsigned:0;\n\
        \tfield:int oldstate;\toffset:16;\tsize:4;\tsigned:1;\n\
        \tfield:int newstate;\toffset:20;\tsize:4;\tsigned:1;\n\
        \tfield:__u16 sport;\toffset:24;\tsize:2;\tsigned:0;\n\
        \tfield:__u16 dport;\toffset:26;\tsize:2;\tsigned:0;\n\
        \tfield:__u16 family;\toffset:28;\tsize:2;\tsigned:0;\n\
        \tfield:__u16 protocol;\toffset:30;\tsize:2;\tsigned:0;\n\
        \tfield:__u8 saddr[4];\toffset:32;\tsize:4;\tsigned:0;\n\
        \tfield:__u8 daddr[4];\toffset:36;\tsize:4;\tsigned:0;\n\
        \tfield:__u8 saddr_v6[16];\toffset:40;\tsize:16;\tsigned:0;\n\
        \tfield:__u8 daddr_v6[16];\toffset:56;\tsize:16;\tsigned:0;\n";

    #[test]
    fn the_local_address_program_checks_the_record_layout() {
        let fields = &monitor_common::inet_sock_set_state::FIELDS;
        assert_eq!(check_layout(SET_STATE_FORMAT, fields), Ok(()));
        // A kernel before 4.20 had no protocol field, and everything after it moved.
        let old = SET_STATE_FORMAT.replace("protocol", "other");
        assert_eq!(
            check_layout(&old, fields),
            Err("no field protocol".to_owned())
        );
        let moved = SET_STATE_FORMAT.replace("offset:32", "offset:30");
        assert!(check_layout(&moved, fields).unwrap_err().contains("saddr"));
    }

    #[test]
    fn capture_config_is_validated() {
        assert!(CaptureConfig::default().validate().is_ok());
        let bad = CaptureConfig {
            head_bytes: 5000,
            ..Default::default()
        };
        assert!(matches!(bad.validate(), Err(LoadError::Config(_))));
        let bad = CaptureConfig {
            ring_bytes: 3000,
            ..Default::default()
        };
        assert!(matches!(bad.validate(), Err(LoadError::Config(_))));
    }
}
