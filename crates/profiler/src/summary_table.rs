//! The text summary in the spirit of `torch.cuda.memory_summary`: per device, current / peak /
//! at-peak bytes and alloc / free counts per category, the largest labels live at the peak,
//! the budget, and the process's (or device's) own figures.

use std::fmt::Write as _;

use headroom_tensor::MemoryCategory;

use headroom_tensor::Device;

use crate::process_memory::{DeviceMemoryInfo, DeviceMemoryProbe, ProcessMemory};
use crate::tracker::{DeviceSnapshot, MemorySnapshot};
use crate::units::human_bytes;

/// Inner width of the table (between the outer bars).
const WIDTH: usize = 77;

/// Figures from outside the tracker to print beside it, and how much detail to show.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReportContext {
    /// The process's resident memory: `Ok` to print it, `Err(reason)` to print why it is
    /// missing, `None` to leave the line out.
    pub process: Option<Result<ProcessMemory, String>>,
    /// Device figures from a [`crate::DeviceMemoryProbe`].
    pub devices: Vec<DeviceMemoryInfo>,
    /// How many (category, label) rows of the peak composition to list.
    pub top_labels: usize,
}

impl Default for ReportContext {
    fn default() -> Self {
        ReportContext {
            process: None,
            devices: Vec::new(),
            top_labels: 8,
        }
    }
}

impl ReportContext {
    /// A context with this process's resident memory read now (or the reason it cannot be).
    pub fn with_process_memory() -> Self {
        ReportContext {
            process: Some(ProcessMemory::read().map_err(|e| e.to_string())),
            ..ReportContext::default()
        }
    }

    /// Ask `probe` for the figures of each of `devices` and keep those it can see (a device the
    /// probe reports unavailable is left out of the table rather than failing the report).
    pub fn probe_devices(&mut self, probe: &dyn DeviceMemoryProbe, devices: &[Device]) {
        self.devices
            .extend(devices.iter().filter_map(|d| probe.probe(*d).ok()));
    }
}

fn line(out: &mut String, text: &str) {
    let text: String = text.chars().take(WIDTH - 2).collect();
    let _ = writeln!(out, "| {text:<w$} |", w = WIDTH - 2);
}

fn rule(out: &mut String, ch: char) {
    let _ = writeln!(out, "|{}|", ch.to_string().repeat(WIDTH));
}

fn row(out: &mut String, name: &str, cells: [String; 5]) {
    let _ = writeln!(
        out,
        "| {name:<12} | {:>10} | {:>10} | {:>10} | {:>10} | {:>8} |",
        cells[0], cells[1], cells[2], cells[3], cells[4]
    );
}

fn device_section(out: &mut String, d: &DeviceSnapshot, context: &ReportContext) {
    rule(out, '=');
    line(out, &format!("headroom memory summary: {}", d.device));
    rule(out, '-');
    row(
        out,
        "category",
        [
            "current".into(),
            "peak".into(),
            "at peak".into(),
            "allocs".into(),
            "frees".into(),
        ],
    );
    rule(out, '-');
    for category in MemoryCategory::ALL {
        row(
            out,
            category.name(),
            [
                human_bytes(d.live[category]),
                human_bytes(d.peak[category]),
                human_bytes(d.at_peak[category]),
                d.allocs[category].to_string(),
                d.frees[category].to_string(),
            ],
        );
    }
    rule(out, '-');
    row(
        out,
        "total",
        [
            human_bytes(d.live_total),
            human_bytes(d.peak_total),
            human_bytes(d.at_peak.total()),
            d.allocs.total().to_string(),
            d.frees.total().to_string(),
        ],
    );
    rule(out, '-');
    line(
        out,
        "largest live at peak (category, label, bytes, allocations):",
    );
    if d.peak_entries.is_empty() {
        line(out, "  nothing");
    }
    for e in d.peak_entries.iter().take(context.top_labels) {
        line(
            out,
            &format!(
                "  {:<12} {:<34} {:>12} {:>8}",
                e.category.name(),
                e.label.as_deref().unwrap_or("(unlabelled)"),
                human_bytes(e.bytes),
                e.count
            ),
        );
    }
    if d.peak_entries.len() > context.top_labels {
        line(
            out,
            &format!("  … {} more", d.peak_entries.len() - context.top_labels),
        );
    }
    match d.budget {
        Some(b) => line(
            out,
            &format!(
                "budget {}: peak uses {:.1}%, {} allocation(s) refused",
                human_bytes(b),
                if b == 0 {
                    0.0
                } else {
                    d.peak_total as f64 / b as f64 * 100.0
                },
                d.rejected
            ),
        ),
        None => line(out, "budget: none"),
    }
    if let Some(info) = context.devices.iter().find(|i| i.device == d.device) {
        let pool = info
            .pool_reserved
            .map_or_else(|| "n/a".to_owned(), human_bytes);
        line(
            out,
            &format!(
                "device: {} free of {}, pool reserved {pool}",
                human_bytes(info.free),
                human_bytes(info.total)
            ),
        );
    }
}

/// The summary table of every device in `snapshot`.
pub fn memory_summary(snapshot: &MemorySnapshot, context: &ReportContext) -> String {
    let mut out = String::new();
    if snapshot.devices.is_empty() {
        rule(&mut out, '=');
        line(&mut out, "headroom memory summary: no allocations tracked");
    }
    for d in &snapshot.devices {
        device_section(&mut out, d, context);
    }
    rule(&mut out, '-');
    match &context.process {
        Some(Ok(p)) => line(
            &mut out,
            &format!(
                "process peak RSS {} (current {})",
                human_bytes(p.peak_rss),
                human_bytes(p.rss)
            ),
        ),
        Some(Err(reason)) => line(&mut out, &format!("process peak RSS unavailable: {reason}")),
        None => {}
    }
    if snapshot.unmatched_frees > 0 {
        line(
            &mut out,
            &format!(
                "warning: {} free(s) of allocations this tracker never saw",
                snapshot.unmatched_frees
            ),
        );
    }
    rule(&mut out, '=');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ProfilerError;
    use crate::tracker::MemoryTracker;
    use headroom_tensor::{AllocHook, DType, TrackedAllocation};
    use std::sync::Arc;

    /// A probe that knows one fake GPU.
    struct FakeGpu;
    impl DeviceMemoryProbe for FakeGpu {
        fn probe(&self, device: Device) -> Result<DeviceMemoryInfo, ProfilerError> {
            match device {
                Device::Cuda(0) => Ok(DeviceMemoryInfo {
                    device,
                    free: 70 << 30,
                    total: 80 << 30,
                    pool_reserved: Some(3 << 30),
                }),
                _ => Err(ProfilerError::Unavailable {
                    what: "device memory",
                    reason: "not a GPU".into(),
                }),
            }
        }
    }

    #[test]
    fn probed_device_figures_and_budgets_appear() {
        let tracker = Arc::new(MemoryTracker::new());
        let hook: Arc<dyn AllocHook> = tracker.clone();
        tracker.set_budget(Device::Cuda(0), Some(1000));
        let _a = TrackedAllocation::register(Some(&hook), 250, DType::U8, Device::Cuda(0));
        let _b = TrackedAllocation::register(Some(&hook), 2000, DType::U8, Device::Cuda(0));
        let mut context = ReportContext::default();
        context.probe_devices(&FakeGpu, &[Device::Cpu, Device::Cuda(0)]);
        assert_eq!(context.devices.len(), 1);
        context.process = Some(Err("not on this platform".into()));
        let table = memory_summary(&tracker.snapshot(), &context);
        assert!(table.contains("headroom memory summary: cuda:0"), "{table}");
        assert!(
            table.contains("budget 1000 B: peak uses 25.0%, 1 allocation(s) refused"),
            "{table}"
        );
        assert!(
            table.contains("device: 70.00 GiB free of 80.00 GiB, pool reserved 3.00 GiB"),
            "{table}"
        );
        assert!(table.contains("process peak RSS unavailable: not on this platform"));
        let empty = memory_summary(&MemoryTracker::new().snapshot(), &ReportContext::default());
        assert!(empty.contains("no allocations tracked"), "{empty}");
    }
}
