//! The node this process runs on: the name alerts, events and metrics carry when the
//! configuration names none.

/// This host's name: `$HOSTNAME`, then the kernel's, else `unknown`.
pub fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|s| s.trim().to_string())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}
