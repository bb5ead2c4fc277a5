//! Memory figures from outside the tracker: the process's resident set (peak RSS) on the CPU,
//! and — the extension point for the `cuda` feature — a device's free/total memory and its
//! allocator pool's reserved bytes.

use headroom_tensor::Device;
use serde::Serialize;

use crate::error::ProfilerError;

/// The process's resident memory, from the operating system.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ProcessMemory {
    /// Peak resident set size in bytes (`VmHWM` on Linux).
    pub peak_rss: u64,
    /// Current resident set size in bytes (`VmRSS` on Linux).
    pub rss: u64,
}

impl ProcessMemory {
    /// Read the calling process's figures. On Linux from `/proc/self/status`; elsewhere
    /// [`ProfilerError::Unavailable`].
    pub fn read() -> Result<ProcessMemory, ProfilerError> {
        #[cfg(target_os = "linux")]
        {
            let text = std::fs::read_to_string("/proc/self/status").map_err(|e| {
                ProfilerError::Unavailable {
                    what: "process peak RSS",
                    reason: format!("reading /proc/self/status: {e}"),
                }
            })?;
            parse_proc_status(&text)
        }
        #[cfg(not(target_os = "linux"))]
        {
            Err(ProfilerError::Unavailable {
                what: "process peak RSS",
                reason: "only read from /proc/self/status on Linux".to_owned(),
            })
        }
    }
}

/// Parse `VmHWM` and `VmRSS` out of the text of a Linux `/proc/<pid>/status` file.
pub fn parse_proc_status(text: &str) -> Result<ProcessMemory, ProfilerError> {
    let field = |name: &'static str| -> Result<u64, ProfilerError> {
        let unavailable = |reason: String| ProfilerError::Unavailable {
            what: "process peak RSS",
            reason,
        };
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .ok_or_else(|| unavailable(format!("no {name} line in the status file")))?;
        let mut parts = line.split_whitespace();
        let value: u64 = parts
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| unavailable(format!("{name} has no number: {line:?}")))?;
        match parts.next() {
            Some("kB") => value
                .checked_mul(1024)
                .ok_or_else(|| unavailable(format!("{name} overflows: {line:?}"))),
            other => Err(unavailable(format!(
                "{name} has unit {other:?}, expected kB"
            ))),
        }
    };
    Ok(ProcessMemory {
        peak_rss: field("VmHWM")?,
        rss: field("VmRSS")?,
    })
}

/// A device's memory as its driver and allocator see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceMemoryInfo {
    /// The device.
    pub device: Device,
    /// Free bytes on the device (driver's view).
    pub free: u64,
    /// Total bytes on the device.
    pub total: u64,
    /// Bytes the allocator's pool holds reserved (live plus cached), when it has a pool.
    pub pool_reserved: Option<u64>,
}

/// Reads a device's memory figures. The extension point for backends: the `cuda` feature
/// implements it for `headroom_cuda::Cuda` over `cuMemGetInfo` and the default memory pool, and
/// reports call it through this trait, so the CPU-only build needs no CUDA.
pub trait DeviceMemoryProbe {
    /// The figures of `device`, or [`ProfilerError::Unavailable`] if this probe cannot see it.
    fn probe(&self, device: Device) -> Result<DeviceMemoryInfo, ProfilerError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "Name:\tcargo\nVmPeak:\t  200000 kB\nVmHWM:\t   12345 kB\nVmRSS:\t    2048 kB\nThreads:\t4\n";

    #[test]
    fn parses_status_in_bytes() {
        let m = parse_proc_status(SAMPLE).unwrap();
        assert_eq!(m.peak_rss, 12345 * 1024);
        assert_eq!(m.rss, 2048 * 1024);
    }

    #[test]
    fn malformed_status_is_typed_unavailable() {
        for bad in [
            "VmRSS:\t 1 kB\n",
            "VmHWM:\t lots kB\nVmRSS:\t 1 kB\n",
            "VmHWM:\t 5 MB\nVmRSS:\t 1 kB\n",
            "VmHWM:\t 99999999999999999999 kB\n",
            "",
        ] {
            assert!(
                matches!(
                    parse_proc_status(bad),
                    Err(ProfilerError::Unavailable { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_this_process() {
        let keep = std::hint::black_box(vec![1u8; 4 << 20]);
        let m = ProcessMemory::read().unwrap();
        assert!(m.peak_rss >= m.rss, "{m:?}");
        assert!(m.peak_rss >= 4 << 20, "{m:?}");
        drop(keep);
    }
}
