//! Bounded housekeeping: a clock hand over attempts and requests compacts what ended or idled,
//! drops expired tombstones and unreferenced requests, and evicts at the hard cap.

use super::Store;

/// The clock hand's position, then advanced around `n` items. A compare instead of `% n`: the
/// sweep runs on every event, and a 64-bit division is tens of cycles.
fn next_hand(hand: &mut usize, n: usize) -> usize {
    if *hand >= n {
        *hand = 0;
    }
    let i = *hand;
    *hand += 1;
    i
}

/// Records examined per sweep step while over the request cap: eviction must outpace creation
/// (at most one record per event) even where most records are held.
const REQUEST_EVICTION_STEPS: usize = 4;

impl Store {
    pub(super) fn evict_one_attempt(&mut self) {
        let n = self.attempts.len();
        for _ in 0..n {
            let i = next_hand(&mut self.attempt_hand, n);
            if self.attempts[i].is_live() {
                let wm = self.attempts[i].last_ns;
                self.compact(i as u32, wm);
                self.stats.evicted_cap += 1;
                return;
            }
        }
    }

    /// Frees request records nothing points to while there are more than `max_requests`,
    /// examining at most `steps` (attempts and tombstones hold their request: what they hold
    /// stays, so records over the cap that are all held are left to the attempts' own caps).
    fn evict_requests(&mut self, steps: usize) {
        let n = self.requests.len();
        for _ in 0..steps.min(n) {
            if self.request_records() <= self.limits.max_requests {
                return;
            }
            let i = next_hand(&mut self.request_hand, n);
            let r = &self.requests[i];
            if r.is_live() && r.refs == 0 {
                self.free_request(i as u32);
                self.stats.requests_evicted_cap += 1;
            }
        }
    }

    /// The watermark and the time of the next event to resolve: an ended attempt the event
    /// finds quiet for longer than the linger is compacted before the event is judged
    /// ([`Self::compact_if_stale`]).
    pub fn set_clock(&mut self, watermark_ns: u64, event_ns: u64) {
        self.watermark_ns = watermark_ns;
        self.event_ns = event_ns;
    }

    /// Compacts live attempt `i` if it ended and was quiet for longer than the linger before
    /// the event being resolved (and no deadline of its own is pending). The sweep compacts
    /// it once the watermark is that far past its last activity, and an event that is not
    /// late is no earlier than the watermark: so whether late activity is judged on the live
    /// attempt or on its tombstone depends on event times, not on where the sweep's hand is.
    pub(super) fn compact_if_stale(&mut self, i: u32) -> bool {
        let at = &self.attempts[i as usize];
        // Most events are an active attempt's: the quiet time rules them out first.
        let stale = self.event_ns.saturating_sub(at.last_ns) > self.limits.linger_ns
            && at.is_live()
            && at.ended()
            && (at.due_ns == 0 || at.due_ns <= self.watermark_ns);
        if stale {
            self.compact(i, self.watermark_ns);
            self.stats.compacted_ended += 1;
        }
        stale
    }

    /// Bounded housekeeping: examines up to `steps` attempts and requests, compacts what ended or
    /// idled, and drops expired tombstones and unreferenced requests.
    pub fn sweep(&mut self, watermark_ns: u64, steps: usize) {
        let wm_s = (watermark_ns / 1_000_000_000) as u32;
        while !self.tombs.is_empty() && self.tomb(0).expires_s <= wm_s {
            self.pop_tomb();
            self.stats.tombstones_expired += 1;
        }
        let n = self.attempts.len();
        for _ in 0..steps.min(n) {
            let i = next_hand(&mut self.attempt_hand, n);
            let at = &self.attempts[i];
            if !at.is_live() || (at.due_ns != 0 && at.due_ns > watermark_ns) {
                continue;
            }
            let idle = watermark_ns.saturating_sub(at.last_ns);
            if at.ended() && idle > self.limits.linger_ns {
                self.compact(i as u32, watermark_ns);
                self.stats.compacted_ended += 1;
            } else if idle > self.limits.attempt_ttl_ns {
                self.compact(i as u32, watermark_ns);
                self.stats.evicted_ttl += 1;
            }
        }
        let n = self.requests.len();
        for _ in 0..steps.min(n) {
            let i = next_hand(&mut self.request_hand, n);
            let r = &self.requests[i];
            if r.is_live()
                && r.refs == 0
                && watermark_ns.saturating_sub(r.last_ns) > self.limits.retention_ns
            {
                self.free_request(i as u32);
                self.stats.requests_expired += 1;
            }
        }
        // After resolution, never during it: a record being linked may still have no reference.
        // Bounded like the rest, so records held over the cap cost no full scan per event.
        self.evict_requests(steps * REQUEST_EVICTION_STEPS);
    }
}
