//! Which processes to watch and what role each plays.
//!
//! Roles come from command lines with SGLang conventions (`--disaggregation-mode prefill|decode`,
//! the router binary `smg` / module `sglang_router`) and vLLM ones (`vllm serve` with a
//! `--kv-transfer-config` naming `kv_producer` / `kv_consumer`, the router `vllm-router` / module
//! `vllm_router` / title `vllm::router`), overridden by explicit `--watch ROLE=REGEX`
//! and `--pid ROLE=PID` rules. A rule may say `unknown`: the process is watched, and its role
//! is learned from the `disaggregation_mode` its `/server_info` answer names (see `track`).
//! The pure parts (classification, rule parsing, /proc/net parsing) are separate from the small
//! functions that read /proc.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use crate::event::Stage;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Router,
    Prefill,
    Decode,
    /// Watched, but what it serves is not known yet: its traffic is parsed, and it produces
    /// events once a `/server_info` answer names its `disaggregation_mode`.
    Unknown,
}

impl Role {
    /// The lifecycle stage this role's events belong to; none while the role is unknown.
    pub fn stage(self) -> Option<Stage> {
        match self {
            Role::Router => Some(Stage::Router),
            Role::Prefill => Some(Stage::Prefill),
            Role::Decode => Some(Stage::Decode),
            Role::Unknown => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Router => "router",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Unknown => "unknown",
        }
    }

    /// The role a worker's `disaggregation_mode` (SGLang `/server_info`) names: `Some(None)`
    /// for `"null"` (a server that is not disaggregated), `None` for anything else.
    pub fn from_disaggregation_mode(mode: &str) -> Option<Option<Role>> {
        match mode {
            "prefill" => Some(Some(Role::Prefill)),
            "decode" => Some(Some(Role::Decode)),
            "null" => Some(None),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("expected ROLE=VALUE, got {0:?}")]
    NoEquals(String),
    #[error("unknown role {0:?} (expected router, prefill, decode or unknown)")]
    Role(String),
    #[error("invalid regex {pattern:?}: {reason}")]
    Regex { pattern: String, reason: String },
    #[error("invalid pid {0:?}")]
    Pid(String),
}

impl FromStr for Role {
    type Err = RuleError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "router" => Ok(Role::Router),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "unknown" => Ok(Role::Unknown),
            _ => Err(RuleError::Role(s.to_owned())),
        }
    }
}

/// `--watch ROLE=REGEX`: processes whose command line (arguments joined by spaces) matches.
#[derive(Debug, Clone)]
pub struct WatchRule {
    pub role: Role,
    pub regex: regex::Regex,
}

impl FromStr for WatchRule {
    type Err = RuleError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (role, pat) = s
            .split_once('=')
            .ok_or_else(|| RuleError::NoEquals(s.to_owned()))?;
        let regex = regex::Regex::new(pat).map_err(|e| RuleError::Regex {
            pattern: pat.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(WatchRule {
            role: role.parse()?,
            regex,
        })
    }
}

/// `--pid ROLE=PID`, or `--pid PID` (role unknown until its `/server_info` answer names it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PidRule {
    pub role: Role,
    pub pid: u32,
}

impl FromStr for PidRule {
    type Err = RuleError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (role, pid) = match s.split_once('=') {
            Some((role, pid)) => (role.parse()?, pid),
            None if s.trim().bytes().all(|b| b.is_ascii_digit()) => (Role::Unknown, s),
            None => return Err(RuleError::NoEquals(s.to_owned())),
        };
        let pid = pid
            .trim()
            .parse()
            .map_err(|_| RuleError::Pid(pid.to_owned()))?;
        Ok(PidRule { role, pid })
    }
}

/// How roles are assigned; the explicit rules win over the SGLang conventions.
#[derive(Debug, Clone, Default)]
pub struct Discovery {
    pub watch: Vec<WatchRule>,
    pub pids: Vec<PidRule>,
    /// Apply the SGLang command-line conventions (on unless only explicit rules are wanted).
    pub conventions: bool,
}

impl Discovery {
    pub fn with_conventions() -> Self {
        Discovery {
            conventions: true,
            ..Default::default()
        }
    }

    /// The role of process `pid` with arguments `args`, if it is to be watched.
    pub fn classify(&self, pid: u32, args: &[String]) -> Option<Role> {
        if let Some(r) = self.pids.iter().find(|r| r.pid == pid) {
            return Some(r.role);
        }
        if !self.watch.is_empty() {
            let line = args.join(" ");
            if let Some(r) = self.watch.iter().find(|r| r.regex.is_match(&line)) {
                return Some(r.role);
            }
        }
        if self.conventions {
            classify_sglang(args).or_else(|| classify_vllm(args))
        } else {
            None
        }
    }
}

/// SGLang conventions: a worker names its mode; the router is `smg` or `sglang_router`, or a
/// process titled `smg::router` (smg 1.13.0 retitles itself so: its command line is then that
/// title alone, the worker URLs gone with the rest).
pub fn classify_sglang(args: &[String]) -> Option<Role> {
    for (i, a) in args.iter().enumerate() {
        let mode = if a == "--disaggregation-mode" {
            args.get(i + 1).map(String::as_str)
        } else {
            a.strip_prefix("--disaggregation-mode=")
        };
        match mode {
            Some("prefill") => return Some(Role::Prefill),
            Some("decode") => return Some(Role::Decode),
            _ => {}
        }
    }
    // Only the program and the script it runs name the router (a flag value naming `smg` doesn't).
    let named_router = |a: &String| {
        let base = a.rsplit('/').next().unwrap_or(a);
        base == "smg" || base == "sglang-router" || base.starts_with("sglang_router")
    };
    if args.first().is_some_and(|a| a == "smg::router") {
        return Some(Role::Router);
    }
    let head: Vec<&String> = args.iter().take(3).collect();
    if head.iter().any(|a| named_router(a)) {
        return Some(Role::Router);
    }
    // `python -m sglang_router.launch_router`
    if args
        .windows(2)
        .any(|w| w[0] == "-m" && w[1].starts_with("sglang_router"))
    {
        return Some(Role::Router);
    }
    None
}

/// vLLM conventions: the router is `vllm-router` (or `python -m vllm_router…`, or a process
/// titled `vllm::router`: its launcher retitles itself so, dropping the flags); a worker is
/// `vllm serve` (or `python -m vllm.entrypoints…`) whose `--kv-transfer-config` JSON names its KV
/// role. `kv_producer` serves prefill, `kv_consumer` decode; `kv_both` (NIXL's usual setting)
/// says nothing, so such a worker is watched with role unknown and its role is learned from the
/// `kv_transfer_params` of the requests it gets (see `track`).
pub fn classify_vllm(args: &[String]) -> Option<Role> {
    let base = |a: &String| a.rsplit('/').next().unwrap_or(a).to_owned();
    if args.first().is_some_and(|a| a == "vllm::router") {
        return Some(Role::Router);
    }
    let head: Vec<String> = args.iter().take(3).map(base).collect();
    if head.iter().any(|a| a == "vllm-router")
        || args
            .windows(2)
            .any(|w| w[0] == "-m" && w[1].starts_with("vllm_router"))
    {
        return Some(Role::Router);
    }
    let serve = args
        .windows(2)
        .any(|w| base(&w[0]) == "vllm" && w[1] == "serve")
        || args
            .windows(2)
            .any(|w| w[0] == "-m" && w[1].starts_with("vllm.entrypoints"));
    if !serve {
        return None;
    }
    let config = args.iter().enumerate().find_map(|(i, a)| {
        if a == "--kv-transfer-config" {
            args.get(i + 1).map(String::as_str)
        } else {
            a.strip_prefix("--kv-transfer-config=")
        }
    })?;
    let compact: String = config.chars().filter(|c| !c.is_whitespace()).collect();
    if compact.contains("\"kv_role\":\"kv_producer\"") {
        Some(Role::Prefill)
    } else if compact.contains("\"kv_role\":\"kv_consumer\"") {
        Some(Role::Decode)
    } else {
        Some(Role::Unknown)
    }
}

/// Worker addresses a router names on its command line: `--prefill URL [BOOTSTRAP_PORT]`,
/// `--decode URL` (and `--prefill-url`/`--decode-url` style spellings).
pub fn router_workers(args: &[String]) -> Vec<(Role, String, u16)> {
    let mut out = Vec::new();
    for (i, a) in args.iter().enumerate() {
        let role = match a.as_str() {
            "--prefill" | "--prefill-url" | "--prefill-urls" => Role::Prefill,
            "--decode" | "--decode-url" | "--decode-urls" => Role::Decode,
            _ => continue,
        };
        if let Some((host, port)) = args.get(i + 1).and_then(|u| parse_url_host_port(u)) {
            out.push((role, host, port));
        }
    }
    out
}

fn parse_url_host_port(url: &str) -> Option<(String, u16)> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let hostport = rest.split('/').next()?;
    let (host, port) = if let Some(h) = hostport.strip_prefix('[') {
        let (h, p) = h.split_once("]:")?;
        (h, p)
    } else {
        hostport.rsplit_once(':')?
    };
    Some((host.to_owned(), port.parse().ok()?))
}

/// SGLang's disaggregation timeouts as a worker's environment sets them (`srt/environ.py`:
/// `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, how long decode waits for a room's KV, and
/// `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, how long prefill waits for decode's destinations);
/// `None` where the environment leaves SGLang's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SglangTimeouts {
    pub waiting: Option<Duration>,
    pub bootstrap: Option<Duration>,
}

/// SGLang's default for both timeouts (`environ.py`).
pub const SGLANG_DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl SglangTimeouts {
    /// From a NUL-separated `/proc/PID/environ`.
    pub fn from_environ(raw: &[u8]) -> SglangTimeouts {
        let mut t = SglangTimeouts::default();
        for var in raw.split(|b| *b == 0) {
            let Some((key, value)) = std::str::from_utf8(var)
                .ok()
                .and_then(|v| v.split_once('='))
            else {
                continue;
            };
            let secs = || value.trim().parse::<u64>().ok().map(Duration::from_secs);
            match key {
                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT" => t.waiting = secs(),
                "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT" => t.bootstrap = secs(),
                _ => {}
            }
        }
        t
    }

    /// What process `pid`'s environment sets (none readable: SGLang's defaults).
    pub fn of(pid: u32) -> SglangTimeouts {
        std::fs::read(format!("/proc/{pid}/environ"))
            .map(|raw| SglangTimeouts::from_environ(&raw))
            .unwrap_or_default()
    }
}

/// NUL-separated `/proc/PID/cmdline` into arguments.
pub fn split_cmdline(raw: &[u8]) -> Vec<String> {
    raw.split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

pub fn read_cmdline(pid: u32) -> Option<Vec<String>> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .map(|raw| split_cmdline(&raw))
}

/// Tgid of task `tid`, from `/proc/TID/status` (a forked child may be a thread).
pub fn tgid_of(tid: u32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Parent of process `pid`, from `/proc/PID/stat` (the field after the parenthesised name,
/// which may itself hold spaces and parentheses).
pub fn ppid_of(pid: u32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_ppid(&s)
}

/// Process `pid` has exited: a zombie its parent has not reaped yet (still in /proc, with an
/// empty command line and no sockets), or gone altogether. A zombie leader whose threads go on
/// (it left with `pthread_exit`) is alive.
pub fn has_exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| parse_status_exited(&s))
        .unwrap_or(true)
}

fn parse_status_exited(status: &str) -> Option<bool> {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
    };
    let state = field("State:")?.chars().next()?;
    let threads: u32 = field("Threads:")?.parse().ok()?;
    Some(matches!(state, 'Z' | 'X') && threads <= 1)
}

fn parse_stat_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The process listening on TCP `port` on loopback or any address, in one of the network
/// namespaces `tables` holds, if one is. A loopback address learnt from a watched process's
/// traffic is one of that process's namespace: `tables` are the watched processes' (a process
/// of another namespace holds none of their sockets).
pub fn listener_pid(port: u16, tables: &NetTables) -> Option<u32> {
    all_pids().into_iter().find(|&pid| {
        socket_fds(pid).iter().any(|(_, ino)| {
            tables.get(ino).is_some_and(|e| {
                e.listen
                    && e.local.port() == port
                    && (e.local.ip().is_loopback() || e.local.ip().is_unspecified())
            })
        })
    })
}

/// Network namespace of process `pid` (the inode `/proc/PID/ns/net` names).
pub fn netns_of(pid: u32) -> Option<u64> {
    let link = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()?;
    link.to_str()?
        .strip_prefix("net:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// One process of each network namespace `pids` are in, in order (a process whose namespace
/// cannot be read stands for itself): a namespace's tables are read once, through any of its
/// processes.
pub fn one_per_namespace(pids: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let mut seen = std::collections::HashSet::new();
    pids.into_iter()
        .filter(|&pid| netns_of(pid).is_none_or(|ns| seen.insert(ns)))
        .collect()
}

/// Socket inode -> TCP entry over the network namespaces of some processes. Each namespace's
/// table is read once, through one of its processes (`/proc/PID/net/tcp{,6}`: the table of the
/// namespace that process is in, not revenant's own); socket inodes are unique across
/// namespaces, so one map holds them all.
#[derive(Debug, Default)]
pub struct NetTables {
    entries: HashMap<u64, TcpEntry>,
}

impl NetTables {
    /// The tables of the namespaces of `pids`.
    pub fn of(pids: impl IntoIterator<Item = u32>) -> NetTables {
        let mut entries = HashMap::new();
        for pid in one_per_namespace(pids) {
            entries.extend(tcp_table(Path::new(&format!("/proc/{pid}"))));
        }
        NetTables { entries }
    }

    pub fn get(&self, inode: &u64) -> Option<&TcpEntry> {
        self.entries.get(inode)
    }
}

/// All process ids in /proc.
pub fn all_pids() -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// `(fd, socket inode)` of every socket `pid` holds.
pub fn socket_fds(pid: u32) -> Vec<(u32, u64)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let fd: u32 = e.file_name().to_str()?.parse().ok()?;
        let target = std::fs::read_link(e.path()).ok()?;
        let inode = target
            .to_str()?
            .strip_prefix("socket:[")?
            .strip_suffix(']')?
            .parse()
            .ok()?;
        Some((fd, inode))
    })
    .collect()
}

/// One line of /proc/net/tcp or tcp6.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpEntry {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub listen: bool,
    pub inode: u64,
}

/// Parses /proc/net/tcp{,6}; malformed lines are skipped.
pub fn parse_proc_net_tcp(text: &str) -> Vec<TcpEntry> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 {
                return None;
            }
            Some(TcpEntry {
                local: parse_hex_addr(f[1])?,
                remote: parse_hex_addr(f[2])?,
                listen: f[3] == "0A",
                inode: f[9].parse().ok()?,
            })
        })
        .collect()
}

fn parse_hex_addr(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(
            u32::from_str_radix(ip, 16).ok()?.swap_bytes(),
        )),
        32 => {
            // Four host-endian 32-bit words.
            let mut b = [0u8; 16];
            for i in 0..4 {
                let w = u32::from_str_radix(&ip[8 * i..8 * i + 8], 16)
                    .ok()?
                    .swap_bytes();
                b[4 * i..4 * i + 4].copy_from_slice(&w.to_be_bytes());
            }
            let v6 = Ipv6Addr::from(b);
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// Socket inode → TCP entry from `PROC_ROOT/net/tcp{,6}`: with `/proc/PID` as the root, the
/// table of the network namespace process PID is in.
pub fn tcp_table(proc_root: &Path) -> HashMap<u64, TcpEntry> {
    let mut out = HashMap::new();
    for f in ["net/tcp", "net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(proc_root.join(f)) {
            for e in parse_proc_net_tcp(&text) {
                out.insert(e.inode, e);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn sglang_conventions() {
        assert_eq!(
            classify_sglang(&args(
                "python -m sglang.launch_server --disaggregation-mode prefill --port 30000"
            )),
            Some(Role::Prefill)
        );
        assert_eq!(
            classify_sglang(&args(
                "python -m sglang.launch_server --disaggregation-mode=decode"
            )),
            Some(Role::Decode)
        );
        assert_eq!(
            classify_sglang(&args(
                "/venv/bin/python /venv/bin/smg launch --pd-disaggregation --prefill http://127.0.0.1:31001 8998"
            )),
            Some(Role::Router)
        );
        assert_eq!(
            classify_sglang(&args(
                "python -m sglang_router.launch_router --pd-disaggregation"
            )),
            Some(Role::Router)
        );
        // smg 1.13.0 after setproctitle: the title, then NULs.
        assert_eq!(
            classify_sglang(&split_cmdline(b"smg::router\0\0\0\0")),
            Some(Role::Router)
        );
        assert_eq!(classify_sglang(&args("smg::router2")), None);
        assert_eq!(
            classify_sglang(&args("bash -c sleep 1 --name smgfoo")),
            None
        );
        assert_eq!(
            classify_sglang(&args("python -m sglang.launch_server --port 30000")),
            None
        );
    }

    #[test]
    fn vllm_conventions() {
        let d = Discovery::with_conventions();
        let cls = |s: &str| d.classify(1, &args(s));
        assert_eq!(
            cls(
                "/venv/bin/python /venv/bin/vllm-router --vllm-pd-disaggregation --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200"
            ),
            Some(Role::Router)
        );
        assert_eq!(
            cls("python -m vllm_router.launch_router"),
            Some(Role::Router)
        );
        assert_eq!(
            cls(
                r#"/venv/bin/python /venv/bin/vllm serve m --kv-transfer-config {"kv_connector":"NixlConnector","kv_role":"kv_producer"}"#
            ),
            Some(Role::Prefill)
        );
        assert_eq!(
            cls(
                r#"vllm serve m --kv-transfer-config={"kv_connector":"P2pNcclConnector","kv_role":"kv_consumer"}"#
            ),
            Some(Role::Decode)
        );
        assert_eq!(
            cls(
                r#"vllm serve m --kv-transfer-config {"kv_connector":"NixlConnector","kv_role":"kv_both"}"#
            ),
            Some(Role::Unknown)
        );
        // A vLLM server without disaggregation is not part of a PD pair.
        assert_eq!(cls("vllm serve m --port 8000"), None);
        assert_eq!(cls("python train.py --note vllm-router"), None);
        // vllm-router names its workers as smg does (no bootstrap port after the URL).
        assert_eq!(
            router_workers(&args(
                "vllm-router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200"
            )),
            vec![
                (Role::Prefill, "127.0.0.1".to_owned(), 8100),
                (Role::Decode, "127.0.0.1".to_owned(), 8200)
            ]
        );
    }

    #[test]
    fn explicit_rules_win() {
        let d = Discovery {
            watch: vec!["decode=fake_worker.py.*--role decode".parse().unwrap()],
            pids: vec!["router=42".parse().unwrap()],
            conventions: true,
        };
        assert_eq!(d.classify(42, &args("anything")), Some(Role::Router));
        assert_eq!(
            d.classify(7, &args("python fake_worker.py --role decode")),
            Some(Role::Decode)
        );
        assert_eq!(
            d.classify(7, &args("python other.py --disaggregation-mode prefill")),
            Some(Role::Prefill)
        );
        assert!("nope".parse::<WatchRule>().is_err());
        assert!("chef=.*".parse::<WatchRule>().is_err());
        assert!("decode=(".parse::<WatchRule>().is_err());
        assert!("decode=x".parse::<PidRule>().is_err());
        assert!("12x".parse::<PidRule>().is_err());
        let unknown: PidRule = "4242".parse().unwrap();
        assert_eq!((unknown.role, unknown.pid), (Role::Unknown, 4242));
        let d = Discovery {
            watch: vec!["unknown=my_server --port".parse().unwrap()],
            ..Default::default()
        };
        assert_eq!(
            d.classify(9, &args("./my_server --port 1")),
            Some(Role::Unknown)
        );
    }

    #[test]
    fn disaggregation_modes_and_stat_lines() {
        assert_eq!(
            Role::from_disaggregation_mode("prefill"),
            Some(Some(Role::Prefill))
        );
        assert_eq!(
            Role::from_disaggregation_mode("decode"),
            Some(Some(Role::Decode))
        );
        assert_eq!(Role::from_disaggregation_mode("null"), Some(None));
        assert_eq!(Role::from_disaggregation_mode("router"), None);
        assert_eq!(Role::Unknown.stage(), None);
        assert_eq!(parse_stat_ppid("77 (a) b (c)) S 12 77 77 0 -1"), Some(12));
        assert_eq!(parse_stat_ppid("garbage"), None);
        let status = |state: &str, threads: u32| {
            format!("Name:\tpython3\nState:\t{state}\nTgid:\t7\nThreads:\t{threads}\n")
        };
        assert_eq!(parse_status_exited(&status("Z (zombie)", 1)), Some(true));
        assert_eq!(parse_status_exited(&status("Z (zombie)", 2)), Some(false));
        assert_eq!(parse_status_exited(&status("S (sleeping)", 1)), Some(false));
        assert_eq!(parse_status_exited("garbage"), None);
        assert!(!has_exited(std::process::id()));
        assert!(has_exited(u32::MAX));
    }

    #[test]
    fn router_worker_urls() {
        let w = router_workers(&args(
            "smg launch --pd-disaggregation --prefill http://127.0.0.1:31001 8998 --decode http://[::1]:31002 --port 30000",
        ));
        assert_eq!(
            w,
            vec![
                (Role::Prefill, "127.0.0.1".into(), 31001),
                (Role::Decode, "::1".into(), 31002)
            ]
        );
    }

    /// The table is the one of the process's own namespace, read through `/proc/PID/net`.
    #[test]
    fn a_process_s_sockets_are_named_from_its_namespace_table() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let me = std::process::id();
        let tables = NetTables::of([me, me]);
        let named = socket_fds(me)
            .iter()
            .filter_map(|(_, ino)| tables.get(ino))
            .any(|e| e.listen && e.local.port() == port);
        assert!(named, "the listener on {port} is in /proc/{me}/net/tcp");
        assert_eq!(listener_pid(port, &tables), Some(me));
    }

    #[test]
    fn proc_net_tcp_lines() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:7919 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0\n   1: garbage\n";
        let e = parse_proc_net_tcp(text);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].local, "127.0.0.1:31001".parse().unwrap());
        assert!(e[0].listen);
        assert_eq!(e[0].inode, 12345);
        let v6 = "h\n 0: 0000000000000000FFFF00000100007F:1F90 00000000000000000000000000000000:0000 0A 0:0 0:0 0 0 0 99 1\n";
        assert_eq!(
            parse_proc_net_tcp(v6)[0].local,
            "127.0.0.1:8080".parse().unwrap()
        );
    }

    #[test]
    fn sglang_timeouts_from_the_environment() {
        let t = SglangTimeouts::from_environ(
            b"PATH=/bin\0SGLANG_DISAGGREGATION_WAITING_TIMEOUT=600\0SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT= 45 \0X=1=2\0",
        );
        assert_eq!(t.waiting, Some(Duration::from_secs(600)));
        assert_eq!(t.bootstrap, Some(Duration::from_secs(45)));
        let t = SglangTimeouts::from_environ(b"SGLANG_DISAGGREGATION_WAITING_TIMEOUT=soon\0\xff\0");
        assert_eq!(t, SglangTimeouts::default());
    }
}
