//! Alias keys and values: a 64-bit key per (namespace, alias), and alias table values that are a
//! 2-bit tag (live attempt, tombstone, request record, solo request) plus a 30-bit index.

use std::hash::BuildHasher;

use crate::engine::mem::stable_hash::stable_hasher;

/// Tags keep equal strings in different alias namespaces apart.
#[derive(Clone, Copy, Hash)]
#[repr(u8)]
pub(super) enum AliasKind {
    RequestId = 1,
    TraceId = 2,
    Rid = 3,
    Room = 4,
}

pub(super) fn key_str(kind: AliasKind, s: &str) -> u64 {
    stable_hasher().hash_one((kind, s))
}

pub(super) fn key_room(room: u64) -> u64 {
    stable_hasher().hash_one((AliasKind::Room, room))
}

pub(super) const TAG_ATTEMPT: u32 = 0;
pub(super) const TAG_TOMB: u32 = 1 << 30;
pub(super) const TAG_REQUEST: u32 = 2 << 30;
/// A request without a record, kept by its only attempt (the index is the attempt's).
pub(super) const TAG_SOLO: u32 = 3 << 30;
pub(super) const INDEX_MASK: u32 = (1 << 30) - 1;
const TAG_MASK: u32 = 3 << 30;

pub(super) fn tag(v: u32) -> u32 {
    v & TAG_MASK
}

/// What an alias is, so that the owner an alias entry names can confirm it has it (the table
/// keeps only a 32-bit fingerprint of the key).
#[derive(Clone, Copy)]
pub(super) enum Name<'a> {
    Room(u64),
    Rid(&'a str),
    RequestId(&'a str),
    TraceId(&'a str),
    /// Only the key is known (keys recorded in attempts, re-pointed aliases).
    Key,
}

/// An alias: its 64-bit key (the hash of namespace and name) and, when known, the name itself.
#[derive(Clone, Copy)]
pub(super) struct Alias<'a> {
    pub(super) key: u64,
    pub(super) name: Name<'a>,
}

impl<'a> Alias<'a> {
    pub(super) fn room(room: u64) -> Alias<'a> {
        Alias {
            key: key_room(room),
            name: Name::Room(room),
        }
    }
    pub(super) fn rid(rid: &'a str) -> Alias<'a> {
        Alias {
            key: key_str(AliasKind::Rid, rid),
            name: Name::Rid(rid),
        }
    }
    pub(super) fn request_id(id: &'a str) -> Alias<'a> {
        Alias {
            key: key_str(AliasKind::RequestId, id),
            name: Name::RequestId(id),
        }
    }
    pub(super) fn trace_id(id: &'a str) -> Alias<'a> {
        Alias {
            key: key_str(AliasKind::TraceId, id),
            name: Name::TraceId(id),
        }
    }
    pub(super) fn key(key: u64) -> Alias<'a> {
        Alias {
            key,
            name: Name::Key,
        }
    }
}
