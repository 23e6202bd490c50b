//! An attempt's request in one tagged word ([`RequestLink`]), and a request's two ids behind one
//! pointer ([`PackedIds`]). Every `unsafe` of identity is here.

use super::keys::{AliasKind, key_str};
use crate::engine::mem::NO_INDEX;

/// A request's ids, the request id and the trace id, behind one 8-byte pointer.
///
/// Every request keeps them, including the single-attempt requests that live in their attempt
/// (see [`RequestLink`]): a `Box<str>` plus its split would take 20 bytes there. The heap
/// block is a 4-byte header (each id's length + 1, 0 for "absent") followed by both ids.
#[repr(transparent)]
pub struct PackedIds(std::ptr::NonNull<u8>);

// SAFETY: `PackedIds` owns its heap block exclusively, like a `Box<[u8]>`.
unsafe impl Send for PackedIds {}
// SAFETY: it has no interior mutability.
unsafe impl Sync for PackedIds {}

const IDS_HEADER: usize = 4;
/// The longest id kept (u16 length + 1 in the header); ids come from transports whose messages
/// are far smaller, so cutting only guards the encoding.
const ID_MAX: usize = u16::MAX as usize - 1;

impl PackedIds {
    pub fn new(request_id: Option<&str>, trace_id: Option<&str>) -> PackedIds {
        let cut = |s: &str| -> usize {
            let mut end = s.len().min(ID_MAX);
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            end
        };
        let (a, b) = (
            request_id.map(|s| &s[..cut(s)]),
            trace_id.map(|s| &s[..cut(s)]),
        );
        let len_field = |s: Option<&str>| s.map_or(0u16, |s| s.len() as u16 + 1);
        let (la, lb) = (a.map_or(0, str::len), b.map_or(0, str::len));
        let layout = Self::layout(la + lb);
        // SAFETY: the layout has a non-zero size (the header).
        let p = unsafe { std::alloc::alloc(layout) };
        let Some(p) = std::ptr::NonNull::new(p) else {
            std::alloc::handle_alloc_error(layout)
        };
        let mut head = [0u8; IDS_HEADER];
        head[..2].copy_from_slice(&len_field(a).to_le_bytes());
        head[2..].copy_from_slice(&len_field(b).to_le_bytes());
        // SAFETY: the block holds IDS_HEADER + la + lb bytes; the copies fill it exactly.
        unsafe {
            std::ptr::copy_nonoverlapping(head.as_ptr(), p.as_ptr(), IDS_HEADER);
            let body = p.as_ptr().add(IDS_HEADER);
            std::ptr::copy_nonoverlapping(a.unwrap_or("").as_ptr(), body, la);
            std::ptr::copy_nonoverlapping(b.unwrap_or("").as_ptr(), body.add(la), lb);
        }
        PackedIds(p)
    }

    fn layout(body: usize) -> std::alloc::Layout {
        // Aligned to 2 so that a pointer to it is even: see `RequestLink`.
        std::alloc::Layout::from_size_align(IDS_HEADER + body, 2).expect("ids are short")
    }

    /// The two length fields (length + 1, 0 = absent).
    fn fields(&self) -> (usize, usize) {
        // SAFETY: every block starts with the 4-byte header.
        let h = unsafe { std::slice::from_raw_parts(self.0.as_ptr(), IDS_HEADER) };
        (
            u16::from_le_bytes([h[0], h[1]]) as usize,
            u16::from_le_bytes([h[2], h[3]]) as usize,
        )
    }

    fn body_len(&self) -> usize {
        let (a, b) = self.fields();
        a.saturating_sub(1) + b.saturating_sub(1)
    }

    fn text(&self, from: usize, len: usize) -> &str {
        // SAFETY: the body holds the bytes of two `&str`s one after the other, and `from, len`
        // is one of them (cut at char boundaries when built), so this is valid UTF-8.
        unsafe {
            let p = self.0.as_ptr().add(IDS_HEADER + from);
            std::str::from_utf8_unchecked(std::slice::from_raw_parts(p, len))
        }
    }

    pub fn request_id(&self) -> Option<&str> {
        let (a, _) = self.fields();
        (a != 0).then(|| self.text(0, a - 1))
    }

    pub fn trace_id(&self) -> Option<&str> {
        let (a, b) = self.fields();
        (b != 0).then(|| self.text(a.saturating_sub(1), b - 1))
    }

    /// The id of one kind (`trace` false: the request id).
    pub fn get(&self, trace: bool) -> Option<&str> {
        if trace {
            self.trace_id()
        } else {
            self.request_id()
        }
    }

    /// These ids with the id of one kind set, if they have none of that kind.
    pub(super) fn with(&self, trace: bool, v: &str) -> Option<PackedIds> {
        if self.get(trace).is_some() {
            return None;
        }
        Some(match trace {
            false => PackedIds::new(Some(v), self.trace_id()),
            true => PackedIds::new(self.request_id(), Some(v)),
        })
    }

    /// The alias keys of the ids present.
    pub(super) fn keys(&self) -> impl Iterator<Item = u64> + use<> {
        [
            self.request_id().map(|s| key_str(AliasKind::RequestId, s)),
            self.trace_id().map(|s| key_str(AliasKind::TraceId, s)),
        ]
        .into_iter()
        .flatten()
    }
}

impl Drop for PackedIds {
    fn drop(&mut self) {
        let layout = Self::layout(self.body_len());
        // SAFETY: allocated in `new` with this very layout (the header records the lengths).
        unsafe { std::alloc::dealloc(self.0.as_ptr(), layout) }
    }
}

impl Clone for PackedIds {
    fn clone(&self) -> PackedIds {
        PackedIds::new(self.request_id(), self.trace_id())
    }
}

impl std::fmt::Debug for PackedIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedIds")
            .field("request_id", &self.request_id())
            .field("trace_id", &self.trace_id())
            .finish()
    }
}

/// An attempt's request in one word: none, a record (its index, and the union epoch at which it
/// was known to be a root), or the ids of a solo request. Every attempt has one; as three fields
/// it would take 16 bytes.
///
/// Encoding: null for none; a [`PackedIds`] pointer (even: its block is 2-aligned) for solo; a
/// record is `index << 32 | epoch << 1 | 1` (no provenance: it is never dereferenced).
#[repr(transparent)]
pub struct RequestLink(*mut u8);

// SAFETY: a solo link owns its `PackedIds` exclusively (which is Send and Sync); the other forms
// are plain numbers.
unsafe impl Send for RequestLink {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for RequestLink {}

const _: () = assert!(
    std::mem::size_of::<usize>() == 8,
    "RequestLink packs a record index and epoch into a pointer-sized word"
);

/// Union epochs wrap below this (they take 31 bits of a [`RequestLink`]).
pub(super) const EPOCH_LIMIT: u32 = 1 << 31;

impl RequestLink {
    pub const NONE: RequestLink = RequestLink(std::ptr::null_mut());

    pub(super) fn record(r: u32, epoch: u32) -> RequestLink {
        debug_assert!(epoch < EPOCH_LIMIT);
        let bits = (r as usize) << 32 | ((epoch as usize) << 1) | 1;
        RequestLink(std::ptr::without_provenance_mut(bits))
    }

    pub(super) fn solo(ids: PackedIds) -> RequestLink {
        RequestLink(std::mem::ManuallyDrop::new(ids).0.as_ptr())
    }

    fn bits(&self) -> usize {
        self.0.addr()
    }

    /// The record's index ([`NO_INDEX`] when there is no record).
    pub fn index(&self) -> u32 {
        match self.bits() & 1 {
            1 => (self.bits() >> 32) as u32,
            _ => NO_INDEX,
        }
    }

    /// The union epoch at which the record was known to be a root (0 when not a record).
    pub(super) fn epoch(&self) -> u32 {
        match self.bits() & 1 {
            1 => ((self.bits() as u32) >> 1) & (EPOCH_LIMIT - 1),
            _ => 0,
        }
    }

    pub(super) fn is_solo(&self) -> bool {
        self.bits() != 0 && self.bits() & 1 == 0
    }

    /// No request at all (neither a record nor a solo one).
    pub(super) fn is_none(&self) -> bool {
        self.bits() == 0
    }

    pub(super) fn solo_ids(&self) -> Option<&PackedIds> {
        // SAFETY: a solo link holds a live `PackedIds` pointer, and both types are
        // `repr(transparent)` over a pointer: the link can be read as the `PackedIds` it owns.
        self.is_solo()
            .then(|| unsafe { &*(self as *const RequestLink as *const PackedIds) })
    }

    pub(super) fn take_solo(&mut self) -> Option<PackedIds> {
        if !self.is_solo() {
            return None;
        }
        let p = std::mem::replace(&mut self.0, std::ptr::null_mut());
        // SAFETY: a solo link's pointer came from `PackedIds::into` above and is non-null; the
        // link no longer holds it, so ownership moves back out exactly once.
        Some(PackedIds(unsafe { std::ptr::NonNull::new_unchecked(p) }))
    }
}

impl Drop for RequestLink {
    fn drop(&mut self) {
        drop(self.take_solo());
    }
}

impl Clone for RequestLink {
    fn clone(&self) -> RequestLink {
        match self.solo_ids() {
            Some(ids) => RequestLink::solo(ids.clone()),
            None => RequestLink(self.0),
        }
    }
}

impl std::fmt::Debug for RequestLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.solo_ids() {
            Some(ids) => f.debug_tuple("Solo").field(ids).finish(),
            None if self.bits() == 0 => f.write_str("None"),
            None => f
                .debug_struct("Record")
                .field("index", &self.index())
                .field("epoch", &self.epoch())
                .finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_round_trip_behind_one_pointer() {
        assert_eq!(std::mem::size_of::<Option<PackedIds>>(), 8);
        for (id, trace) in [
            (None, None),
            (Some("req-1"), None),
            (None, Some("4bf92f3577b34da6a3ce929d0e0e4736")),
            (Some(""), Some("")),
            (Some("réq-ü"), Some("t")),
        ] {
            let ids = PackedIds::new(id, trace);
            assert_eq!((ids.request_id(), ids.trace_id()), (id, trace));
            let copy = ids.clone();
            assert_eq!((copy.request_id(), copy.trace_id()), (id, trace));
            assert_eq!(ids.keys().count(), id.iter().count() + trace.iter().count());
        }
        let with = PackedIds::new(Some("a"), None).with(true, "t").unwrap();
        assert_eq!((with.request_id(), with.trace_id()), (Some("a"), Some("t")));
        assert!(
            with.with(false, "b").is_none(),
            "a second request id is refused"
        );
        // Overlong ids are cut at a char boundary, never mid-character.
        let long = "é".repeat(40_000);
        let ids = PackedIds::new(Some(&long), Some("t"));
        let kept = ids.request_id().unwrap();
        assert!(kept.len() <= ID_MAX && long.starts_with(kept));
        assert_eq!(ids.trace_id(), Some("t"));
    }

    #[test]
    fn request_links_hold_a_record_or_solo_ids_in_one_word() {
        assert_eq!(std::mem::size_of::<RequestLink>(), 8);
        let none = RequestLink::NONE;
        assert_eq!(
            (none.index(), none.epoch(), none.is_solo()),
            (NO_INDEX, 0, false)
        );
        for (r, epoch) in [
            (0, 0),
            (7, 1),
            (NO_INDEX - 1, EPOCH_LIMIT - 1),
            (1 << 29, 12345),
        ] {
            let l = RequestLink::record(r, epoch);
            assert_eq!((l.index(), l.epoch(), l.is_solo()), (r, epoch, false));
            assert!(l.solo_ids().is_none());
            let c = l.clone();
            assert_eq!((c.index(), c.epoch()), (r, epoch));
        }
        let mut l = RequestLink::solo(PackedIds::new(Some("q"), Some("t")));
        assert!(l.is_solo());
        assert_eq!((l.index(), l.epoch()), (NO_INDEX, 0));
        let c = l.clone();
        assert_eq!(c.solo_ids().unwrap().request_id(), Some("q"));
        drop(c);
        let ids = l.take_solo().unwrap();
        assert_eq!(ids.trace_id(), Some("t"));
        assert!(!l.is_solo() && l.take_solo().is_none());
        // Overwriting a solo link frees its ids (a leak would show in the state_size bench's
        // counting allocator).
        let mut l = RequestLink::solo(ids);
        assert!(l.is_solo());
        l = RequestLink::record(3, 4);
        assert_eq!(l.index(), 3);
    }
}
