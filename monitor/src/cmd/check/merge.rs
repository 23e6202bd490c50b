//! Several inputs as one stream, merged by event time: per-node recordings of one deployment
//! (router and prefill on one node, decode on another) are checked as the live checker would have
//! seen them, whatever order the files are given in. Each file keeps its own order (its arrival
//! order, which may be out of time order within the allowed lateness); across files the event
//! with the smallest time goes first, ties to the file given first.
//!
//! [`FileIndex`] remembers which file recent events came from, so that a violation's evidence
//! names its files.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::path::Path;

use super::input::{BadLine, EventReader, ReadError};
use crate::event::LifecycleEvent;
use crate::violation::{Evidence, fnv1a};

/// The k-way merge over the inputs.
pub struct Merge {
    pub readers: Vec<EventReader>,
    heads: Vec<Option<LifecycleEvent>>,
    /// (time, file) of every head.
    order: BinaryHeap<Reverse<(u64, usize)>>,
    started: bool,
}

impl Merge {
    pub fn new(readers: Vec<EventReader>) -> Merge {
        let n = readers.len();
        Merge {
            readers,
            heads: (0..n).map(|_| None).collect(),
            order: BinaryHeap::with_capacity(n),
            started: false,
        }
    }

    fn refill(
        &mut self,
        i: usize,
        on_bad: &mut dyn FnMut(&Path, BadLine),
        on_error: &mut dyn FnMut(&Path, ReadError),
    ) {
        match self.readers[i].next_event(on_bad) {
            Ok(Some(e)) => {
                self.order.push(Reverse((e.time_ns, i)));
                self.heads[i] = Some(e);
            }
            Ok(None) => {}
            Err(err) => on_error(&self.readers[i].path, err),
        }
    }

    /// The next event of the merged stream and the index of its file.
    pub fn next(
        &mut self,
        on_bad: &mut dyn FnMut(&Path, BadLine),
        on_error: &mut dyn FnMut(&Path, ReadError),
    ) -> Option<(LifecycleEvent, usize)> {
        if !self.started {
            self.started = true;
            for i in 0..self.readers.len() {
                self.refill(i, on_bad, on_error);
            }
        }
        let Reverse((_, i)) = self.order.pop()?;
        let e = self.heads[i].take()?;
        self.refill(i, on_bad, on_error);
        Some((e, i))
    }
}

/// What identifies an event in a violation's evidence (time, stage, kind, source, status).
fn key(time_ns: u64, stage: u8, kind: u8, source: u8, status: Option<u16>) -> u64 {
    let status = status.map_or([0xff; 3], |s| {
        let [a, b] = s.to_le_bytes();
        [1, a, b]
    });
    fnv1a(&[&time_ns.to_le_bytes(), &[stage, kind, source], &status])
}

/// Width of one bucket of [`FileIndex`] in event time.
pub const BUCKET_NS: u64 = 60_000_000_000;

/// Which file each event of the last `horizon` of event time came from (at most `max_entries`,
/// the oldest minute dropped first). An event found in two files is named by the first.
pub struct FileIndex {
    buckets: BTreeMap<u64, HashMap<u64, u32>>,
    len: usize,
    horizon_ns: u64,
    max_entries: usize,
}

impl FileIndex {
    pub fn new(horizon_ns: u64, max_entries: usize) -> FileIndex {
        FileIndex {
            buckets: BTreeMap::new(),
            len: 0,
            horizon_ns,
            max_entries,
        }
    }

    pub fn insert(&mut self, e: &LifecycleEvent, file: usize) {
        let k = key(
            e.time_ns,
            e.stage as u8,
            e.kind as u8,
            e.source as u8,
            e.status,
        );
        let bucket = self.buckets.entry(e.time_ns / BUCKET_NS).or_default();
        if let std::collections::hash_map::Entry::Vacant(v) = bucket.entry(k) {
            v.insert(file as u32);
            self.len += 1;
        }
        while self.len > self.max_entries && self.buckets.len() > 1 {
            self.drop_oldest();
        }
    }

    /// Forgets what is older than the horizon before `newest_ns`.
    pub fn expire(&mut self, newest_ns: u64) {
        let oldest = newest_ns.saturating_sub(self.horizon_ns) / BUCKET_NS;
        while self
            .buckets
            .first_key_value()
            .is_some_and(|(b, _)| *b < oldest)
        {
            self.drop_oldest();
        }
    }

    fn drop_oldest(&mut self) {
        if let Some((_, b)) = self.buckets.pop_first() {
            self.len -= b.len();
        }
    }

    /// The file an evidence event came from, if it is still remembered.
    pub fn file_of(&self, ev: &Evidence) -> Option<usize> {
        let k = key(
            ev.time_ns,
            ev.stage as u8,
            ev.kind as u8,
            ev.source as u8,
            ev.status,
        );
        self.buckets
            .get(&(ev.time_ns / BUCKET_NS))?
            .get(&k)
            .map(|f| *f as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Kind, Source, Stage};

    fn reader(text: &'static str, name: &str) -> EventReader {
        EventReader::new(Path::new(name), Box::new(text.as_bytes()), 1 << 20).unwrap()
    }

    fn line(t: u64, stage: &str) -> String {
        format!("{{\"time_unix_nano\":{t},\"stage\":\"{stage}\",\"kind\":\"work\"}}\n")
    }

    #[test]
    fn merges_by_time_keeping_each_files_order_and_ties_to_the_first_file() {
        let a: &'static str = Box::leak(
            [line(1, "router"), line(5, "router"), line(3, "router")]
                .concat()
                .into_boxed_str(),
        );
        let b: &'static str = Box::leak(
            [line(2, "decode"), line(5, "decode")]
                .concat()
                .into_boxed_str(),
        );
        let mut m = Merge::new(vec![reader(a, "a"), reader(b, "b")]);
        let mut got = Vec::new();
        while let Some((e, f)) = m.next(&mut |_, b| panic!("{b:?}"), &mut |_, e| panic!("{e}")) {
            got.push((e.time_ns, f));
        }
        // File a's 3 stays after its 5 (its own order); the tie at 5 goes to a.
        assert_eq!(got, vec![(1, 0), (2, 1), (5, 0), (3, 0), (5, 1)]);
    }

    #[test]
    fn the_index_names_the_file_of_an_evidence_event_within_its_horizon() {
        let mut ix = FileIndex::new(10 * BUCKET_NS, 1000);
        let e = LifecycleEvent::new(5, Stage::Decode, Kind::Work, Source::Ebpf);
        ix.insert(&e, 1);
        let ev = Evidence {
            role: crate::violation::EvidenceRole::Offender,
            time_ns: 5,
            stage: Stage::Decode,
            kind: Kind::Work,
            source: Source::Ebpf,
            status: None,
            reason: None,
        };
        assert_eq!(ix.file_of(&ev), Some(1));
        assert_eq!(
            ix.file_of(&Evidence {
                status: Some(200),
                ..ev.clone()
            }),
            None
        );
        ix.expire(20 * BUCKET_NS);
        assert_eq!(ix.file_of(&ev), None, "past the horizon");
    }
}
