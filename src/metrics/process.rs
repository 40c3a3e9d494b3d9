//! The standard `process_*` metrics (as client_golang's and the Prometheus client
//! libraries' process collector writes them), read from Linux `/proc` at scrape time.
//!
//! `process_cpu_seconds_total`, `process_resident_memory_bytes`,
//! `process_virtual_memory_bytes`, `process_open_fds`, `process_max_fds`,
//! `process_start_time_seconds`. Elsewhere than Linux (no `/proc/self`) the collector writes
//! nothing. CPU time and the start time are in clock ticks in `/proc`; the tick is taken as
//! 100 Hz (`USER_HZ`, fixed by the kernel ABI on every Linux architecture Kubernetes runs on;
//! client_golang's procfs assumes the same).

use std::path::Path;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::emit;

/// `USER_HZ`: clock ticks per second in `/proc/<pid>/stat` and `/proc/stat`.
const USER_HZ: f64 = 100.0;

/// The process collector (register once per registry).
#[derive(Debug, Default)]
pub struct ProcessCollector;

/// One reading of the process's `/proc` files.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub open_fds: u64,
    pub max_fds: Option<u64>,
    pub start_time_seconds: f64,
}

impl ProcessStats {
    /// Reads `/proc/self` (and `/proc/stat` for the boot time); `None` where there is none.
    pub fn read() -> Option<ProcessStats> {
        Self::read_from(Path::new("/proc"))
    }

    /// As [`Self::read`], from a `/proc` at `proc` (tests).
    pub fn read_from(proc: &Path) -> Option<ProcessStats> {
        let stat = std::fs::read_to_string(proc.join("self/stat")).ok()?;
        let status = std::fs::read_to_string(proc.join("self/status")).ok()?;
        let sys_stat = std::fs::read_to_string(proc.join("stat")).ok()?;
        let (ticks, start_ticks) = parse_stat(&stat)?;
        let boot = sys_stat
            .lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<f64>().ok())?;
        let open_fds = std::fs::read_dir(proc.join("self/fd"))
            .map(|d| d.count() as u64)
            .unwrap_or(0);
        let max_fds = std::fs::read_to_string(proc.join("self/limits"))
            .ok()
            .and_then(|l| parse_max_open_files(&l));
        Some(ProcessStats {
            cpu_seconds: ticks as f64 / USER_HZ,
            resident_bytes: status_kb(&status, "VmRSS:").unwrap_or(0) * 1024,
            virtual_bytes: status_kb(&status, "VmSize:").unwrap_or(0) * 1024,
            open_fds,
            max_fds,
            start_time_seconds: boot + start_ticks as f64 / USER_HZ,
        })
    }
}

/// (utime + stime, starttime) in ticks from `/proc/<pid>/stat`. The command name (field 2)
/// is in parentheses and may hold spaces and parentheses: fields are counted after the last
/// `)`.
fn parse_stat(stat: &str) -> Option<(u64, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the name: state is field 3; utime 14, stime 15, starttime 22 (proc(5)).
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    Some((field(14)? + field(15)?, field(22)?))
}

/// A `Vm*:` line of `/proc/<pid>/status`, in kB.
fn status_kb(status: &str, key: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The soft limit of `Max open files` in `/proc/<pid>/limits` (`None` when unlimited).
fn parse_max_open_files(limits: &str) -> Option<u64> {
    limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

impl Collector for ProcessCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let Some(s) = ProcessStats::read() else {
            return Ok(());
        };
        emit(
            &mut enc,
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            &ConstCounter::new(s.cpu_seconds),
        )?;
        emit(
            &mut enc,
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            &ConstGauge::new(s.resident_bytes as i64),
        )?;
        emit(
            &mut enc,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            &ConstGauge::new(s.virtual_bytes as i64),
        )?;
        emit(
            &mut enc,
            "process_open_fds",
            "Number of open file descriptors.",
            &ConstGauge::new(s.open_fds as i64),
        )?;
        if let Some(max) = s.max_fds {
            emit(
                &mut enc,
                "process_max_fds",
                "Maximum number of open file descriptors.",
                &ConstGauge::new(max as i64),
            )?;
        }
        emit(
            &mut enc,
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            &ConstGauge::new(s.start_time_seconds),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        // A command name with spaces and a parenthesis.
        let stat = "4242 (kube (cache) proxy) S 1 4242 4242 0 -1 4194560 2000 0 0 0 \
                    150 50 0 0 20 0 12 0 9000 123456789 2500 18446744073709551615";
        assert_eq!(parse_stat(stat), Some((200, 9000)));
        assert_eq!(parse_stat("no parenthesis"), None);
    }

    #[test]
    fn a_fake_proc_is_read_into_the_standard_values() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        std::fs::create_dir_all(p.join("self/fd")).unwrap();
        for fd in ["0", "1", "2"] {
            std::fs::write(p.join("self/fd").join(fd), "").unwrap();
        }
        std::fs::write(
            p.join("self/stat"),
            "7 (kcp) S 1 7 7 0 -1 0 0 0 0 0 250 50 0 0 20 0 4 0 1000 0 0",
        )
        .unwrap();
        std::fs::write(
            p.join("self/status"),
            "Name:\tkcp\nVmSize:\t  204800 kB\nVmRSS:\t   10240 kB\n",
        )
        .unwrap();
        std::fs::write(p.join("stat"), "cpu  1 2 3\nbtime 1700000000\n").unwrap();
        std::fs::write(
            p.join("self/limits"),
            "Limit                     Soft Limit           Hard Limit           Units\n\
             Max open files            1048576              1048576              files\n",
        )
        .unwrap();
        let s = ProcessStats::read_from(p).unwrap();
        assert_eq!(
            s,
            ProcessStats {
                cpu_seconds: 3.0,
                resident_bytes: 10 << 20,
                virtual_bytes: 200 << 20,
                open_fds: 3,
                max_fds: Some(1_048_576),
                start_time_seconds: 1_700_000_010.0,
            }
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_read_on_linux() {
        let s = ProcessStats::read().expect("/proc on Linux");
        assert!(s.resident_bytes > 0 && s.virtual_bytes >= s.resident_bytes);
        assert!(s.open_fds > 0);
        assert!(s.start_time_seconds > 1_500_000_000.0);
    }
}
