//! The standard `process_*` metrics (as the Prometheus client libraries export them), read from
//! `/proc/self` at every scrape: resident memory next to `--memory-budget`, CPU, open file
//! descriptors and their limit, threads, start time. Nothing is rendered where `/proc` cannot be
//! read.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// What one scrape reads of the process.
#[derive(Debug, Default, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub threads: u64,
    pub start_time_seconds: f64,
    pub open_fds: u64,
    pub max_fds: Option<u64>,
}

/// The fields of `/proc/<pid>/stat` this needs, `ticks` clock ticks a second, `page` bytes a
/// page, `boot` the boot time (`btime` of `/proc/stat`).
pub fn parse_stat(stat: &str, ticks: f64, page: u64, boot: u64) -> Option<ProcessStats> {
    // The command name (field 2) is in parentheses and may hold spaces: fields after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Field n of proc(5) is f[n - 3].
    let num = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    Some(ProcessStats {
        cpu_seconds: (num(14)? + num(15)?) as f64 / ticks,
        threads: num(20)?,
        start_time_seconds: boot as f64 + num(22)? as f64 / ticks,
        virtual_bytes: num(23)?,
        resident_bytes: num(24)? * page,
        ..ProcessStats::default()
    })
}

fn read() -> Option<ProcessStats> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // SAFETY: sysconf only reads configuration values.
    let (ticks, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
    let mut s = parse_stat(&stat, ticks.max(1) as f64, page.max(1) as u64, boot)?;
    s.open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    s.max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()?
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3)?.parse().ok());
    Some(s)
}

/// Registered once in the metric registry.
#[derive(Debug)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let Some(s) = read() else { return Ok(()) };
        let c = ConstCounter::new(s.cpu_seconds);
        c.encode(enc.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            c.metric_type(),
        )?)?;
        let gauges: [(&str, &str, f64); 5] = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                s.resident_bytes as f64,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                s.virtual_bytes as f64,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                s.start_time_seconds,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                s.open_fds as f64,
            ),
            ("process_threads", "Number of OS threads", s.threads as f64),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        if let Some(max) = s.max_fds {
            let g = ConstGauge::new(max as f64);
            g.encode(enc.encode_descriptor(
                "process_max_fds",
                "Maximum number of open file descriptors",
                None,
                g.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_fields_after_a_command_name_with_spaces() {
        // pid (comm) state ppid … utime=14 stime=15 … num_threads=20 … starttime=22 vsize=23 rss=24
        let stat = "42 (tokio (runtime) w) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 7 0 \
                    1000 123456789 300 18446744073709551615";
        let s = parse_stat(stat, 100.0, 4096, 1_700_000_000).unwrap();
        assert_eq!(s.cpu_seconds, 3.0);
        assert_eq!(s.threads, 7);
        assert_eq!(s.start_time_seconds, 1_700_000_010.0);
        assert_eq!(s.virtual_bytes, 123_456_789);
        assert_eq!(s.resident_bytes, 300 * 4096);
        assert!(parse_stat("garbage", 100.0, 4096, 0).is_none());
    }

    #[test]
    fn this_process_has_memory_and_descriptors() {
        let s = read().expect("/proc/self is readable on Linux");
        assert!(
            s.resident_bytes > 0 && s.open_fds > 0 && s.threads > 0,
            "{s:?}"
        );
    }
}
