//! Kernel CLOCK_MONOTONIC stamps to Unix time.

/// Translates kernel CLOCK_MONOTONIC stamps to Unix time.
#[derive(Debug, Clone, Copy, Default)]
pub struct Clock {
    pub unix_minus_mono_ns: i128,
}

impl Clock {
    pub fn now() -> Clock {
        let mono = read_clock(libc::CLOCK_MONOTONIC);
        let real = read_clock(libc::CLOCK_REALTIME);
        Clock {
            unix_minus_mono_ns: real - mono,
        }
    }
    pub fn unix(&self, mono_ns: u64) -> u64 {
        (mono_ns as i128 + self.unix_minus_mono_ns).max(0) as u64
    }
}

fn read_clock(id: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a local timespec.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128
}
