//! A process's CPU time (`/proc/<pid>/stat`: user + system) and memory
//! (`/proc/<pid>/status`: `VmRSS` now, `VmHWM` the peak), read from outside it.

use std::process::Command;
use std::time::Duration;

use serde::Serialize;

use crate::BenchError;

/// CPU time a process has used so far, user plus system, in clock ticks.
pub fn cpu_ticks(pid: u32) -> Result<u64, BenchError> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path)
        .map_err(|error| BenchError::Io(format!("read {path}: {error}")))?;
    parse_stat_cpu_ticks(&text).map_err(|reason| BenchError::Io(format!("{path}: {reason}")))
}

/// `utime + stime` from the text of `/proc/<pid>/stat`. The command name (field 2) is in
/// parentheses and may hold spaces and parentheses itself, so fields are counted from
/// the last `)`: after it come field 3 (state) onwards, so utime (14) and stime (15) are
/// the 12th and 13th.
pub fn parse_stat_cpu_ticks(text: &str) -> Result<u64, String> {
    let after_name = text
        .rfind(')')
        .map(|end| &text[end + 1..])
        .ok_or("no ')' after the command name")?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let field = |index: usize, name: &str| -> Result<u64, String> {
        fields
            .get(index)
            .ok_or_else(|| format!("no {name} field"))?
            .parse::<u64>()
            .map_err(|error| format!("{name}: {error}"))
    };
    Ok(field(11, "utime")? + field(12, "stime")?)
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 when that cannot be run, which is what
/// Linux uses on every common architecture).
pub fn clock_ticks_per_second() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .and_then(|text| text.trim().parse::<u64>().ok())
        .filter(|ticks| *ticks > 0)
        .unwrap_or(100)
}

/// Converts a tick count to a duration.
pub fn ticks_to_duration(ticks: u64, ticks_per_second: u64) -> Duration {
    Duration::from_secs_f64(ticks as f64 / ticks_per_second.max(1) as f64)
}

/// A process's resident memory now and at its peak, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MemoryUse {
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
}

pub fn memory_use(pid: u32) -> Result<MemoryUse, BenchError> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path)
        .map_err(|error| BenchError::Io(format!("read {path}: {error}")))?;
    let read = |key: &str| {
        status_kibibytes(&text, key)
            .map(|kib| kib * 1024)
            .ok_or_else(|| BenchError::Io(format!("{path}: no {key} line")))
    };
    Ok(MemoryUse {
        rss_bytes: read("VmRSS")?,
        peak_rss_bytes: read("VmHWM")?,
    })
}

/// The value of a `Key:   1234 kB` line of `/proc/<pid>/status`, in KiB.
pub fn status_kibibytes(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let value = line.strip_prefix(key)?.strip_prefix(':')?;
        value.trim().strip_suffix("kB")?.trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_counted_after_an_awkward_command_name() {
        let stat = "4242 (carve (sched) x) S 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    731 269 0 0 20 0 9 0 12345 100000000 5000 18446744073709551615";
        assert_eq!(parse_stat_cpu_ticks(stat), Ok(1000));
        assert!(parse_stat_cpu_ticks("4242 (short) S 1").is_err());
        assert!(parse_stat_cpu_ticks("no name at all").is_err());
    }

    #[test]
    fn status_lines_are_read_in_kibibytes() {
        let status = "Name:\tcarve-scheduler\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        assert_eq!(status_kibibytes(status, "VmHWM"), Some(204_800));
        assert_eq!(status_kibibytes(status, "VmRSS"), Some(102_400));
        assert_eq!(status_kibibytes(status, "VmSwap"), None);
    }

    #[test]
    fn this_process_can_be_read() {
        let me = std::process::id();
        assert!(memory_use(me).unwrap().peak_rss_bytes > 0);
        cpu_ticks(me).unwrap();
        assert!(clock_ticks_per_second() > 0);
    }
}
