//! Durable alert spool: a notification is written to disk before any sink sees it and removed only
//! once every sink acknowledged it (or refused it for good). A restart reloads what is left and
//! delivery resumes. One small JSON file per notification: writes are rare (alerts, not events),
//! and a file per entry makes acknowledgement a rename or an unlink, with no log compaction.
//!
//! File `<seq:016x>.json` = `{"v":2,"seq":N,"pending":["webhook:3f2a…",...],"acked":[...],"notification":{...}}`,
//! written to a `.tmp` file, optionally fsynced, then renamed into place (atomic on POSIX).
//! `pending` and `acked` hold sink identities ([`crate::alert::sink_identities`]): derived from
//! each sink's configuration, not its position, so reordering sinks routes nothing elsewhere.
//!
//! An entry pending for a sink that is no longer configured is re-routed at open to the sinks
//! configured now that have not acknowledged it yet; with no sink at all it stays on disk. Only
//! `discard_removed_sinks` (`--spool-discard-removed-sinks`) drops those acknowledgements.
//! Version 1 entries hold single-violation alerts (`"type":"violation"`); they are read back as
//! one-finding incidents, so an upgrade delivers what the previous version left.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::notification::{IncidentAlert, Links, Notification, SuppressedSummary};
use crate::violation::Violation;

/// Version written in new entries.
const VERSION: u32 = 2;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpoolConfig {
    /// Directory of the spool; created if missing. Default: `<state dir>/spool`.
    pub dir: Option<PathBuf>,
    /// Notifications kept awaiting acknowledgement; beyond this new ones are dropped and counted.
    pub max_entries: usize,
    pub max_bytes: u64,
    /// fsync each new entry (survives power loss, not only a crash of revenant).
    pub fsync: bool,
    /// At open, drop what is pending for sinks no longer configured instead of re-routing it to
    /// the sinks configured now (counted as `reason="sink_removed"` drops).
    pub discard_removed_sinks: bool,
}

impl Default for SpoolConfig {
    fn default() -> Self {
        SpoolConfig {
            dir: None,
            max_entries: 10_000,
            max_bytes: 64 << 20,
            fsync: true,
            discard_removed_sinks: false,
        }
    }
}

/// Smallest `max_bytes`: one page.
const MIN_MAX_BYTES: u64 = 4096;

/// A spool size that cannot hold anything.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpoolConfigError {
    #[error("spool max_entries must be > 0")]
    ZeroMaxEntries,
    #[error("spool max_bytes must be at least {MIN_MAX_BYTES}")]
    MaxBytes { value: u64 },
}

impl SpoolConfig {
    pub fn validate(&self) -> Result<(), SpoolConfigError> {
        if self.max_entries == 0 {
            return Err(SpoolConfigError::ZeroMaxEntries);
        }
        if self.max_bytes < MIN_MAX_BYTES {
            return Err(SpoolConfigError::MaxBytes {
                value: self.max_bytes,
            });
        }
        Ok(())
    }

    pub fn resolved_dir(&self) -> PathBuf {
        self.dir
            .clone()
            .unwrap_or_else(|| default_state_dir().join("spool"))
    }
}

/// `$STATE_DIRECTORY` (systemd), else `$XDG_STATE_HOME/revenant`, else
/// `$HOME/.local/state/revenant`, else `/var/lib/revenant`.
pub fn default_state_dir() -> PathBuf {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = env("STATE_DIRECTORY") {
        return d;
    }
    if let Some(d) = env("XDG_STATE_HOME") {
        return d.join("revenant");
    }
    if let Some(h) = env("HOME") {
        return h.join(".local/state/revenant");
    }
    PathBuf::from("/var/lib/revenant")
}

#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("spool directory {dir}: {source}")]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "spool directory {dir} is not a directory (--spool-dir names a directory revenant owns)"
    )]
    NotADirectory { dir: PathBuf },
    #[error("spool write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "spool directory {dir} is in use by another revenant process (holding {dir}/.lock); \
         give each instance its own --spool-dir"
    )]
    InUse { dir: PathBuf },
    #[error("spool is full ({entries} entries, {bytes} bytes)")]
    Full { entries: usize, bytes: u64 },
    #[error("cannot encode notification: {0}")]
    Encode(#[from] serde_json::Error),
}

#[derive(Debug, Serialize, Deserialize)]
struct OnDisk {
    v: u32,
    seq: u64,
    pending: Vec<String>,
    /// Sinks that already took the entry: a re-route never sends it to them again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    acked: Vec<String>,
    notification: Notification,
}

/// What an entry may hold when read back.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Stored {
    Incident(IncidentAlert),
    Suppressed(SuppressedSummary),
    /// A version 1 entry: one violation's alert.
    Violation(SingleViolationAlert),
}

#[derive(Debug, Deserialize)]
struct SingleViolationAlert {
    id: String,
    occurrences: u64,
    received_at_ns: u64,
    #[serde(flatten)]
    violation: Violation,
    links: Links,
}

impl From<Stored> for Notification {
    fn from(s: Stored) -> Notification {
        match s {
            Stored::Incident(a) => Notification::Incident(a),
            Stored::Suppressed(s) => Notification::Suppressed(s),
            Stored::Violation(a) => Notification::Incident(IncidentAlert::for_violation(
                a.id,
                &a.violation,
                a.occurrences,
                a.links,
                a.received_at_ns,
            )),
        }
    }
}

#[derive(Debug, Deserialize)]
struct OnDiskRead {
    seq: u64,
    pending: Vec<String>,
    #[serde(default)]
    acked: Vec<String>,
    notification: Stored,
}

#[derive(Debug, Clone)]
pub struct Entry {
    pub seq: u64,
    pub notification: Arc<Notification>,
    pub pending: Vec<String>,
    pub acked: Vec<String>,
    bytes: u64,
}

#[derive(Debug, Default)]
struct State {
    entries: BTreeMap<u64, Entry>,
    bytes: u64,
    next_seq: u64,
    /// Entries acknowledged by every sink they were pending for since open.
    completed: u64,
}

/// What `open` found on disk.
#[derive(Debug, Default)]
pub struct Recovered {
    pub entries: usize,
    /// Unreadable files, renamed to `*.corrupt` and counted as drops.
    pub corrupt: usize,
    /// Entries pending for sinks no longer configured, handed to the sinks configured now.
    pub rerouted: usize,
    /// Entries whose pending sinks are all gone, and that every sink configured now already
    /// took: delivered, removed.
    pub already_delivered: usize,
    /// Entries pending for removed sinks with no sink configured at all: kept on disk.
    pub stranded: usize,
    /// Entries whose acknowledgements for removed sinks were dropped (`discard_removed_sinks`).
    pub discarded: usize,
}

#[derive(Debug, Clone)]
pub struct Spool {
    dir: PathBuf,
    cfg: SpoolConfig,
    state: Arc<Mutex<State>>,
    /// Exclusive lock on `dir/.lock`, held while the spool is open: two processes resuming and
    /// deleting each other's entries would deliver twice or lose acknowledgements.
    _lock: Arc<std::fs::File>,
}

impl Spool {
    /// Opens (creating) the spool and reloads what a previous run left. `sinks` are the sink names
    /// configured now: acknowledgements pending for other names are dropped.
    pub fn open(cfg: &SpoolConfig, sinks: &[String]) -> Result<(Spool, Recovered), SpoolError> {
        let dir = cfg.resolved_dir();
        let derr = |source| SpoolError::Dir {
            dir: dir.clone(),
            source,
        };
        if std::fs::metadata(&dir).is_ok_and(|m| !m.is_dir()) {
            return Err(SpoolError::NotADirectory { dir });
        }
        std::fs::create_dir_all(&dir).map_err(derr)?;
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(".lock"))
            .map_err(derr)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(SpoolError::InUse { dir: dir.clone() });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(derr(e)),
        }
        let mut st = State::default();
        let mut rec = Recovered::default();
        let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(derr)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        names.sort();
        for path in names {
            let Some(ext) = path.extension().and_then(|e| e.to_str()) else {
                continue;
            };
            match ext {
                // A write interrupted before its rename: never acknowledged to anyone upstream
                // of the spool either, but the dispatcher had accepted it. Counted as corrupt.
                "tmp" => {
                    let _ = std::fs::remove_file(&path);
                    rec.corrupt += 1;
                }
                "json" => {
                    let parsed = std::fs::read(&path).ok().and_then(|b| {
                        serde_json::from_slice::<OnDiskRead>(&b)
                            .ok()
                            .map(|d| (d, b.len()))
                    });
                    match parsed {
                        Some((d, len)) => {
                            st.next_seq = st.next_seq.max(d.seq + 1);
                            let notification: Notification = d.notification.into();
                            let route =
                                reroute(d.pending, d.acked, sinks, cfg.discard_removed_sinks);
                            let (notification, pending, acked, len) = match route {
                                Route::Unchanged { pending, acked } => {
                                    (notification, pending, acked, len as u64)
                                }
                                Route::Stranded { pending, acked } => {
                                    rec.stranded += 1;
                                    (notification, pending, acked, len as u64)
                                }
                                Route::Done { discarded } => {
                                    if discarded {
                                        rec.discarded += 1;
                                    } else {
                                        rec.already_delivered += 1;
                                    }
                                    let _ = std::fs::remove_file(&path);
                                    continue;
                                }
                                Route::Changed {
                                    pending,
                                    acked,
                                    discarded,
                                } => {
                                    if discarded {
                                        rec.discarded += 1;
                                    } else {
                                        rec.rerouted += 1;
                                    }
                                    let disk = OnDisk {
                                        v: VERSION,
                                        seq: d.seq,
                                        pending,
                                        acked,
                                        notification,
                                    };
                                    let bytes = serde_json::to_vec(&disk)?;
                                    // The new routing must survive a restart before any delivery
                                    // to it is acknowledged; otherwise it would be routed again.
                                    write_atomic(&dir, d.seq, &bytes, cfg.fsync)?;
                                    let len = bytes.len() as u64;
                                    (disk.notification, disk.pending, disk.acked, len)
                                }
                            };
                            st.bytes += len;
                            st.entries.insert(
                                d.seq,
                                Entry {
                                    seq: d.seq,
                                    notification: Arc::new(notification),
                                    pending,
                                    acked,
                                    bytes: len,
                                },
                            );
                            rec.entries += 1;
                        }
                        None => {
                            let _ = std::fs::rename(&path, path.with_extension("corrupt"));
                            rec.corrupt += 1;
                        }
                    }
                }
                _ => {}
            }
        }
        Ok((
            Spool {
                dir,
                cfg: cfg.clone(),
                state: Arc::new(Mutex::new(st)),
                _lock: Arc::new(lock),
            },
            rec,
        ))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn path(&self, seq: u64) -> PathBuf {
        entry_path(&self.dir, seq)
    }

    /// (entries, bytes)
    pub fn size(&self) -> (usize, u64) {
        let g = self.lock();
        (g.entries.len(), g.bytes)
    }

    /// Entries pending for `sink`, oldest first (used at start to resume delivery).
    pub fn pending_for(&self, sink: &str) -> Vec<u64> {
        self.lock()
            .entries
            .values()
            .filter(|e| e.pending.iter().any(|p| p == sink))
            .map(|e| e.seq)
            .collect()
    }

    pub fn get(&self, seq: u64) -> Option<Arc<Notification>> {
        self.lock()
            .entries
            .get(&seq)
            .map(|e| e.notification.clone())
    }

    /// Writes a notification for `sinks` to disk. Blocking I/O: call from `spawn_blocking` or
    /// accept a short stall (a few hundred µs per alert).
    pub fn put(&self, n: Notification, sinks: &[String]) -> Result<u64, SpoolError> {
        let seq = {
            let mut g = self.lock();
            if g.entries.len() >= self.cfg.max_entries || g.bytes >= self.cfg.max_bytes {
                return Err(SpoolError::Full {
                    entries: g.entries.len(),
                    bytes: g.bytes,
                });
            }
            let s = g.next_seq;
            g.next_seq += 1;
            s
        };
        let d = OnDisk {
            v: VERSION,
            seq,
            pending: sinks.to_vec(),
            acked: Vec::new(),
            notification: n,
        };
        let bytes = serde_json::to_vec(&d)?;
        self.write_atomic(seq, &bytes, self.cfg.fsync)?;
        let mut g = self.lock();
        g.bytes += bytes.len() as u64;
        g.entries.insert(
            seq,
            Entry {
                seq,
                notification: Arc::new(d.notification),
                pending: d.pending,
                acked: Vec::new(),
                bytes: bytes.len() as u64,
            },
        );
        Ok(seq)
    }

    /// Writes a batch of notifications, then makes them durable together (one directory sync for
    /// the lot). Results are in input order.
    pub fn put_many(
        &self,
        ns: Vec<Notification>,
        sinks: &[String],
    ) -> Vec<Result<u64, SpoolError>> {
        let mut out = Vec::with_capacity(ns.len());
        let mut written = Vec::new();
        for n in ns {
            let seq = {
                let mut g = self.lock();
                if g.entries.len() >= self.cfg.max_entries || g.bytes >= self.cfg.max_bytes {
                    out.push(Err(SpoolError::Full {
                        entries: g.entries.len(),
                        bytes: g.bytes,
                    }));
                    continue;
                }
                let s = g.next_seq;
                g.next_seq += 1;
                // Reserve the slot now so the bound holds within the batch.
                g.entries.insert(
                    s,
                    Entry {
                        seq: s,
                        notification: Arc::new(n.clone()),
                        pending: Vec::new(),
                        acked: Vec::new(),
                        bytes: 0,
                    },
                );
                s
            };
            let d = OnDisk {
                v: VERSION,
                seq,
                pending: sinks.to_vec(),
                acked: Vec::new(),
                notification: n,
            };
            let res = serde_json::to_vec(&d)
                .map_err(SpoolError::from)
                .and_then(|b| self.write_atomic(seq, &b, false).map(|_| b.len() as u64));
            match res {
                Ok(len) => {
                    written.push((seq, d, len));
                    out.push(Ok(seq));
                }
                Err(e) => {
                    self.lock().entries.remove(&seq);
                    out.push(Err(e));
                }
            }
        }
        if self.cfg.fsync
            && !written.is_empty()
            && let Err(e) = self.sync_all(&written)
        {
            tracing::error!(error = %e, dir = %self.dir.display(), "spool sync failed; entries may not survive a power loss");
        }
        let mut g = self.lock();
        for (seq, d, len) in written {
            g.bytes += len;
            g.entries.insert(
                seq,
                Entry {
                    seq,
                    notification: Arc::new(d.notification),
                    pending: d.pending,
                    acked: Vec::new(),
                    bytes: len,
                },
            );
        }
        out
    }

    /// fdatasync of each new file, then one fsync of the directory for all the renames. Not
    /// `syncfs`: that would also flush every other process's dirty pages on the filesystem (on a
    /// serving node: model weights, logs) and stall alerting behind them.
    fn sync_all(&self, written: &[(u64, OnDisk, u64)]) -> std::io::Result<()> {
        for (seq, _, _) in written {
            std::fs::File::open(self.path(*seq))?.sync_data()?;
        }
        std::fs::File::open(&self.dir)?.sync_all()
    }

    fn write_atomic(&self, seq: u64, bytes: &[u8], fsync: bool) -> Result<(), SpoolError> {
        write_atomic(&self.dir, seq, bytes, fsync)
    }

    /// Entries that every sink they were pending for acknowledged since open.
    pub fn completed(&self) -> u64 {
        self.lock().completed
    }

    /// Records that `sink` is done with `seq` (delivered, or refused for good). Removes the file
    /// once no sink is pending; otherwise rewrites it without `sink` (no fsync: losing an ack
    /// only means one redelivery, which receivers deduplicate by id).
    pub fn ack(&self, seq: u64, sink: &str) -> Result<(), SpoolError> {
        let rewrite = {
            let mut g = self.lock();
            let Some(e) = g.entries.get_mut(&seq) else {
                return Ok(());
            };
            if !e.pending.iter().any(|p| p == sink) {
                return Ok(());
            }
            e.pending.retain(|p| p != sink);
            e.acked.push(sink.to_string());
            if e.pending.is_empty() {
                let b = e.bytes;
                g.entries.remove(&seq);
                g.bytes -= b;
                g.completed += 1;
                None
            } else {
                Some(OnDisk {
                    v: VERSION,
                    seq,
                    pending: e.pending.clone(),
                    acked: e.acked.clone(),
                    notification: (*e.notification).clone(),
                })
            }
        };
        match rewrite {
            None => match std::fs::remove_file(self.path(seq)) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(source) => Err(SpoolError::Write {
                    path: self.path(seq),
                    source,
                }),
            },
            Some(d) => {
                let bytes = serde_json::to_vec(&d)?;
                self.write_atomic(seq, &bytes, false)
            }
        }
    }
}

fn entry_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("{seq:016x}.json"))
}

fn write_atomic(dir: &Path, seq: u64, bytes: &[u8], fsync: bool) -> Result<(), SpoolError> {
    let path = entry_path(dir, seq);
    let tmp = path.with_extension("tmp");
    let werr = |source| SpoolError::Write {
        path: path.clone(),
        source,
    };
    let mut f = std::fs::File::create(&tmp).map_err(werr)?;
    f.write_all(bytes).map_err(werr)?;
    if fsync {
        f.sync_data().map_err(werr)?;
    }
    drop(f);
    std::fs::rename(&tmp, &path).map_err(werr)?;
    if fsync {
        // The rename itself is durable only once the directory is.
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(werr)?;
    }
    Ok(())
}

/// What happens at open to an entry read back.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    /// Every pending sink is still configured.
    Unchanged {
        pending: Vec<String>,
        acked: Vec<String>,
    },
    /// Pending for removed sinks, and no sink is configured to take it over: kept as it is.
    Stranded {
        pending: Vec<String>,
        acked: Vec<String>,
    },
    /// Nothing left to deliver: every configured sink already took it, or the rest was discarded.
    Done { discarded: bool },
    /// Pending for removed sinks: re-routed to the configured sinks that have not taken it, or
    /// (on request) those acknowledgements discarded.
    Changed {
        pending: Vec<String>,
        acked: Vec<String>,
        discarded: bool,
    },
}

fn reroute(pending: Vec<String>, acked: Vec<String>, sinks: &[String], discard: bool) -> Route {
    let (kept, removed): (Vec<String>, Vec<String>) =
        pending.into_iter().partition(|p| sinks.contains(p));
    if removed.is_empty() {
        return Route::Unchanged {
            pending: kept,
            acked,
        };
    }
    if discard {
        return if kept.is_empty() {
            Route::Done { discarded: true }
        } else {
            Route::Changed {
                pending: kept,
                acked,
                discarded: true,
            }
        };
    }
    if sinks.is_empty() {
        let mut pending = kept;
        pending.extend(removed);
        return Route::Stranded { pending, acked };
    }
    // Still pending for a configured sink: the alert reaches someone without a new receiver.
    let mut pending = kept;
    let reaches_someone = !pending.is_empty();
    for s in sinks.iter().filter(|_| !reaches_someone) {
        if !pending.contains(s) && !acked.contains(s) {
            pending.push(s.clone());
        }
    }
    if pending.is_empty() {
        return Route::Done { discarded: false };
    }
    Route::Changed {
        pending,
        acked,
        discarded: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alert::notification::SuppressedSummary;

    fn note(i: u64) -> Notification {
        Notification::Suppressed(SuppressedSummary {
            id: format!("n{i}"),
            rule: "r".into(),
            suppressed: i,
            findings: i,
            fingerprints_sample: vec![],
            window_start_ns: 0,
            window_end_ns: 1,
            limit: 1,
            received_at_ns: 0,
        })
    }

    #[test]
    fn survives_reopen_and_removes_after_all_acks() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = SpoolConfig {
            dir: Some(dir.path().to_path_buf()),
            fsync: false,
            ..Default::default()
        };
        let sinks = vec!["a".to_string(), "b".to_string()];
        let (s, _) = Spool::open(&cfg, &sinks).unwrap();
        let s0 = s.put(note(0), &sinks).unwrap();
        let s1 = s.put(note(1), &sinks).unwrap();
        s.ack(s0, "a").unwrap();
        s.ack(s1, "a").unwrap();
        s.ack(s1, "b").unwrap();
        drop(s);
        let (s, rec) = Spool::open(&cfg, &sinks).unwrap();
        assert_eq!(rec.entries, 1);
        assert_eq!(s.pending_for("a"), Vec::<u64>::new());
        assert_eq!(s.pending_for("b"), vec![s0]);
        assert_eq!(s.get(s0).unwrap().id(), "n0");
        // New entries never collide with a pending one.
        assert!(s.put(note(2), &sinks).unwrap() > s0);
        s.ack(s0, "b").unwrap();
        let left = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name() != ".lock")
            .count();
        assert_eq!(left, 1);
    }

    /// An entry left by a version writing single-violation alerts is delivered as a one-finding
    /// incident with the same id (receivers deduplicate on it).
    #[test]
    fn single_violation_entries_are_read_as_incidents() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = SpoolConfig {
            dir: Some(dir.path().to_path_buf()),
            fsync: false,
            ..Default::default()
        };
        std::fs::write(
            dir.path().join("0000000000000007.json"),
            r#"{"v":1,"seq":7,"pending":["a"],"notification":{"type":"violation","id":"fp-1-1","occurrences":2,"detected_at":"2026-11-29T22:10:00Z","received_at_ns":5,"rule":"activity-after-rejection","severity":"critical","summary":"s","request":{"request_id":"req-1"},"attempt":{"bootstrap_room":4096},"detected_at_ns":4,"fingerprint":"fp","evidence":[],"links":{}}}"#,
        )
        .unwrap();
        let (s, rec) = Spool::open(&cfg, &["a".into()]).unwrap();
        assert_eq!((rec.entries, rec.corrupt), (1, 0));
        let n = s.get(7).unwrap();
        let Notification::Incident(a) = n.as_ref() else {
            panic!("{n:?}");
        };
        assert_eq!(a.id, "fp-1-1");
        assert_eq!(a.incident_key, "request_id:req-1");
        assert_eq!(a.rules, ["activity-after-rejection"]);
        assert_eq!(a.findings.len(), 1);
        assert_eq!(a.occurrences, 2);
        assert_eq!(a.violation.attempt.bootstrap_room, Some(4096));
        assert!(s.put(note(1), &["a".into()]).unwrap() > 7);
    }

    /// Versions before rooms were written as decimal strings left them as JSON numbers: such an
    /// entry loads with the exact room (above 2^53) and is delivered in the string form.
    #[test]
    fn entries_with_rooms_as_numbers_load_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = SpoolConfig {
            dir: Some(dir.path().to_path_buf()),
            fsync: false,
            ..Default::default()
        };
        let finding = r#""rule":"activity-after-rejection","severity":"critical","summary":"s","request":{"request_id":"req-1"},"attempt":{"bootstrap_room":9066467638188682269,"rid":"p-1"},"detected_at_ns":4,"fingerprint":"fp","evidence":[]"#;
        std::fs::write(
            dir.path().join("0000000000000009.json"),
            format!(
                r#"{{"v":2,"seq":9,"pending":["a"],"acked":[],"notification":{{"type":"incident","id":"i-1","incident":"0123456789abcdef","incident_key":"request_id:req-1","sequence":1,"occurrences":1,"detected_at":"2026-11-29T22:10:00Z","received_at_ns":5,"rules":["activity-after-rejection"],"findings":[{{{finding},"occurrences":1,"first_sequence":1}}],{finding},"links":{{}}}}}}"#
            ),
        )
        .unwrap();
        let (s, rec) = Spool::open(&cfg, &["a".into()]).unwrap();
        assert_eq!((rec.entries, rec.corrupt), (1, 0));
        let n = s.get(9).unwrap();
        let Notification::Incident(a) = n.as_ref() else {
            panic!("{n:?}");
        };
        assert_eq!(
            a.violation.attempt.bootstrap_room,
            Some(9_066_467_638_188_682_269)
        );
        assert_eq!(
            a.findings[0].violation.attempt.bootstrap_room,
            Some(9_066_467_638_188_682_269)
        );
        let out = serde_json::to_value(n.as_ref()).unwrap();
        for attempt in [&out["attempt"], &out["findings"][0]["attempt"]] {
            assert_eq!(attempt["bootstrap_room"], "9066467638188682269", "{out}");
            assert_eq!(attempt["bootstrap_room_hex"], "0x7dd29047ddcfac1d", "{out}");
        }
    }

    #[test]
    fn a_second_process_cannot_open_the_same_spool() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = SpoolConfig {
            dir: Some(dir.path().to_path_buf()),
            fsync: false,
            ..Default::default()
        };
        let sinks = vec!["a".to_string()];
        let (first, _) = Spool::open(&cfg, &sinks).unwrap();
        // flock locks belong to the open file description, so a second open in this process
        // conflicts exactly as another process would.
        let Err(e) = Spool::open(&cfg, &sinks) else {
            panic!("second open must fail");
        };
        assert!(matches!(e, SpoolError::InUse { .. }), "{e}");
        assert!(e.to_string().contains("--spool-dir"), "{e}");
        drop(first);
        Spool::open(&cfg, &sinks).expect("free again once the first is closed");
    }

    #[test]
    fn bounded_corrupt_and_orphans_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = SpoolConfig {
            dir: Some(dir.path().to_path_buf()),
            max_entries: 2,
            fsync: false,
            ..Default::default()
        };
        let (s, _) = Spool::open(&cfg, &["a".into(), "gone".into()]).unwrap();
        s.put(note(0), &["a".into(), "gone".into()]).unwrap();
        s.put(note(1), &["gone".into()]).unwrap();
        assert!(matches!(
            s.put(note(2), &["a".into()]),
            Err(SpoolError::Full { .. })
        ));
        std::fs::write(dir.path().join("00000000000000ff.json"), b"{not json").unwrap();
        drop(s);
        let (s, rec) = Spool::open(&cfg, &["a".into()]).unwrap();
        assert_eq!(rec.corrupt, 1);
        // Entry 0 still reaches "a"; entry 1 was only for "gone" and is handed to "a".
        assert_eq!(rec.rerouted, 2);
        assert_eq!(rec.entries, 2);
        assert_eq!(s.size().0, 2);
        assert_eq!(s.pending_for("a").len(), 2);
        assert_eq!(s.pending_for("gone").len(), 0);
    }

    fn cfg_in(dir: &Path) -> SpoolConfig {
        SpoolConfig {
            dir: Some(dir.to_path_buf()),
            fsync: false,
            ..Default::default()
        }
    }

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn entries_for_a_removed_sink_go_to_the_sinks_configured_now_once() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = cfg_in(dir.path());
        let (s, _) = Spool::open(&cfg, &strs(&["old", "both"])).unwrap();
        let only_old = s.put(note(0), &strs(&["old"])).unwrap();
        let shared = s.put(note(1), &strs(&["old", "both"])).unwrap();
        // "both" already took `shared`: it must not get it a second time.
        s.ack(shared, "both").unwrap();
        drop(s);
        let (s, rec) = Spool::open(&cfg, &strs(&["both", "new"])).unwrap();
        assert_eq!((rec.rerouted, rec.already_delivered), (2, 0));
        assert_eq!(rec.discarded, 0);
        assert_eq!(s.pending_for("both"), vec![only_old]);
        assert_eq!(s.pending_for("new"), vec![only_old, shared]);
        drop(s);
        // The routing was written back: reopening unchanged routes nothing again.
        let (s, rec) = Spool::open(&cfg, &strs(&["both", "new"])).unwrap();
        assert_eq!((rec.rerouted, rec.entries), (0, 2));
        for seq in [only_old, shared] {
            s.ack(seq, "new").unwrap();
        }
        s.ack(only_old, "both").unwrap();
        assert_eq!(s.size().0, 0);
        assert_eq!(s.completed(), 2);
    }

    #[test]
    fn an_entry_every_current_sink_already_took_is_complete() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = cfg_in(dir.path());
        let (s, _) = Spool::open(&cfg, &strs(&["old", "b"])).unwrap();
        let seq = s.put(note(0), &strs(&["old", "b"])).unwrap();
        s.ack(seq, "b").unwrap();
        drop(s);
        let (s, rec) = Spool::open(&cfg, &strs(&["b"])).unwrap();
        assert_eq!((rec.already_delivered, rec.entries), (1, 0));
        assert_eq!(s.size().0, 0);
    }

    #[test]
    fn without_any_sink_entries_stay_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = cfg_in(dir.path());
        let (s, _) = Spool::open(&cfg, &strs(&["old"])).unwrap();
        let seq = s.put(note(0), &strs(&["old"])).unwrap();
        drop(s);
        let (s, rec) = Spool::open(&cfg, &[]).unwrap();
        assert_eq!((rec.stranded, rec.entries, rec.discarded), (1, 1, 0));
        drop(s);
        let (s, rec) = Spool::open(&cfg, &strs(&["later"])).unwrap();
        assert_eq!(rec.rerouted, 1);
        assert_eq!(s.pending_for("later"), vec![seq]);
    }

    #[test]
    fn discarding_removed_sinks_is_explicit_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = cfg_in(dir.path());
        let (s, _) = Spool::open(&cfg, &strs(&["old", "b"])).unwrap();
        s.put(note(0), &strs(&["old"])).unwrap();
        let kept = s.put(note(1), &strs(&["old", "b"])).unwrap();
        drop(s);
        let discard = SpoolConfig {
            discard_removed_sinks: true,
            ..cfg.clone()
        };
        let (s, rec) = Spool::open(&discard, &strs(&["b", "new"])).unwrap();
        assert_eq!((rec.discarded, rec.rerouted, rec.entries), (2, 0, 1));
        assert_eq!(s.pending_for("b"), vec![kept]);
        assert_eq!(s.pending_for("new"), Vec::<u64>::new());
    }
}
