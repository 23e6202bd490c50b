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

/// Why a live attempt is compacted (counted apart).
#[derive(Debug, Clone, Copy)]
enum Compaction {
    /// It ended and was quiet for longer than the linger.
    Ended,
    /// It never ended and was idle for longer than the TTL.
    Idle,
}

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

    /// The watermark and the time of the next event to resolve: a live attempt the event finds
    /// due for compaction is compacted before the event is judged ([`Self::compact_if_stale`]).
    pub fn set_clock(&mut self, watermark_ns: u64, event_ns: u64) {
        self.watermark_ns = watermark_ns;
        self.event_ns = event_ns;
    }

    /// Why live attempt `i` is due for compaction at instant `now_ns`, if it is: it ended and was
    /// quiet for longer than the linger, or was idle for longer than the TTL, and no deadline of
    /// its own is still to be judged (`due_ns` past the watermark; see [`Self::deadline_judged`]).
    /// The one decision the sweep and the events' resolution both take (see
    /// [`Self::compact_if_stale`] for why it does not depend on arrival order).
    #[inline]
    fn stale_at(&self, i: usize, now_ns: u64) -> Option<Compaction> {
        let at = &self.attempts[i];
        // Most attempts looked at are active: the quiet time rules them out first (the TTL is
        // at least the linger).
        let idle = now_ns.saturating_sub(at.last_ns);
        if idle <= self.limits.linger_ns
            || !at.is_live()
            || (at.due_ns != 0 && at.due_ns > self.watermark_ns)
        {
            return None;
        }
        if at.ended() {
            Some(Compaction::Ended)
        } else if idle > self.limits.attempt_ttl_ns {
            Some(Compaction::Idle)
        } else {
            None
        }
    }

    fn compact_for(&mut self, i: u32, why: Compaction) {
        self.compact(i, self.watermark_ns);
        match why {
            Compaction::Ended => self.stats.compacted_ended += 1,
            Compaction::Idle => self.stats.evicted_ttl += 1,
        }
    }

    /// Compacts live attempt `i`, which the event being resolved names, if it is due for
    /// compaction at the event's time (at the watermark, for a late event): the event is then
    /// judged on its tombstone. Every way from an event to a live attempt comes through here
    /// (its room, its rid, its solo request's ids).
    ///
    /// Why the event's attempt is live or a tombstone whatever the arrival order within the
    /// allowed lateness, and wherever the sweep's hand is:
    /// - The sweep takes the same decision at the watermark, and an event within the lateness
    ///   is no earlier than the watermark: what the sweep compacted is due for compaction at the
    ///   event's time too. A late event is judged at the watermark, as the sweep would judge it.
    /// - Quiet for longer than the linger (at least the lateness) means the attempt's events
    ///   before the event are more than the lateness older: all of them have arrived, so its
    ///   last activity, its legs and its pending deadlines are theirs whatever their order.
    ///   (Pending means not yet satisfied: the checker works it out from the attempt's slots on
    ///   every event of an ended attempt, not only on the terminal one, and whenever it judges
    ///   a deadline, so it does not depend on which event came last.)
    /// - Deadlines: the checker moves the watermark to the event's own before resolving it, so
    ///   every deadline more than the lateness before the event has been judged, in any order.
    ///   One within the lateness keeps the attempt live either way: still pending, or judged,
    ///   and judging counts as activity at its time ([`Self::deadline_judged`]).
    ///
    /// One case stays with the arrival order: two events of the attempt less than the lateness
    /// apart on either side of the instant it becomes due for compaction (its linger or TTL
    /// running out). The later one finds the attempt quiet only when it arrives first; it is
    /// then judged on the tombstone, and so is the earlier one after it, where in time order
    /// both are judged live. No decision taken on arrival can tell, when the later one comes
    /// first, whether the earlier one exists: deciding it would mean holding events back until
    /// the watermark passes them.
    #[inline]
    pub(super) fn compact_if_stale(&mut self, i: u32) -> bool {
        let now = self.event_ns.max(self.watermark_ns);
        match self.stale_at(i as usize, now) {
            Some(why) => {
                self.compact_for(i, why);
                true
            }
            None => false,
        }
    }

    /// Bounded housekeeping: examines up to `steps` attempts and requests, compacts what ended or
    /// idled, and drops expired tombstones and unreferenced requests.
    pub fn sweep(&mut self, watermark_ns: u64, steps: usize) {
        // `stale_at` reads it: whether a deadline is still to be judged.
        self.watermark_ns = watermark_ns;
        let wm_s = (watermark_ns / 1_000_000_000) as u32;
        while !self.tombs.is_empty() && self.tomb(0).expires_s <= wm_s {
            self.pop_tomb();
            self.stats.tombstones_expired += 1;
        }
        let n = self.attempts.len();
        for _ in 0..steps.min(n) {
            let i = next_hand(&mut self.attempt_hand, n);
            if let Some(why) = self.stale_at(i, watermark_ns) {
                self.compact_for(i as u32, why);
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
