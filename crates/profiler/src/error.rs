//! The profiler's errors: [`ProfilerError`] for its own operations, and [`OutOfBudget`], the
//! refusal a budgeted tracker hands the backend (and that callers downcast back out of
//! [`headroom_tensor::Error::AllocationRejected`]).

use std::fmt;

use headroom_tensor::{DType, Device, MemoryCategory};
use serde::Serialize;

use crate::per_category::PerCategory;
use crate::units::human_bytes;

/// Everything the profiler's own operations can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProfilerError {
    /// The platform does not expose the requested figure (peak RSS outside Linux, device memory
    /// without the `cuda` feature).
    #[error("{what} is unavailable: {reason}")]
    Unavailable {
        /// The figure asked for.
        what: &'static str,
        /// Why it cannot be read here.
        reason: String,
    },
    /// An estimator or search input is invalid (a zero dimension, heads not dividing width…).
    #[error("invalid {field}: {reason}")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A byte count does not fit in `u64` (an absurd configuration).
    #[error("{what} overflows u64 bytes")]
    Overflow {
        /// The quantity that overflowed.
        what: &'static str,
    },
    /// A Chrome trace does not follow the Trace Event Format
    /// ([`crate::validate_chrome_trace`]).
    #[error("invalid Chrome trace: event {index}: {reason}")]
    InvalidTrace {
        /// Position of the offending event in `traceEvents` (the number of events for a
        /// problem found at the end, such as an unclosed slice).
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// Writing a report failed.
    #[error("writing a report failed")]
    Io(#[from] std::io::Error),
}

/// Bytes live under one (category, label) pair.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LiveEntry {
    /// The category the allocations were made in.
    pub category: MemoryCategory,
    /// The label scope they were made in (`None` outside any label).
    pub label: Option<String>,
    /// Bytes live.
    pub bytes: u64,
    /// Allocations live.
    pub count: u64,
}

/// A budgeted tracker refused an allocation: the request would have taken the device's live
/// bytes over its budget. Carries everything needed to see why.
///
/// The backend wraps it as the source of [`headroom_tensor::Error::AllocationRejected`];
/// [`OutOfBudget::find`] gets it back:
///
/// ```
/// use std::sync::Arc;
/// use headroom_profiler::{MemoryTracker, OutOfBudget};
/// use headroom_tensor::{Backend, Cpu, DType, Device};
///
/// let tracker = Arc::new(MemoryTracker::new());
/// tracker.set_budget(Device::Cpu, Some(1024));
/// let cpu = Cpu::new().with_alloc_hook(tracker.clone());
/// let err = cpu.zeros([512], DType::F32).unwrap_err(); // 2048 bytes > 1024
/// let oob = OutOfBudget::find(&err).expect("the tracker's refusal");
/// assert_eq!((oob.requested, oob.budget, oob.live_total), (2048, 1024, 0));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OutOfBudget {
    /// The device whose budget would be exceeded.
    pub device: Device,
    /// Bytes requested by the refused allocation.
    pub requested: u64,
    /// Element type of the refused allocation.
    pub dtype: DType,
    /// Category of the refused allocation.
    pub category: MemoryCategory,
    /// Label of the refused allocation.
    pub label: Option<String>,
    /// The device's budget in bytes.
    pub budget: u64,
    /// Bytes live on the device when the request came.
    pub live_total: u64,
    /// Live bytes per category at that moment.
    pub live: PerCategory<u64>,
    /// What was live, by (category, label), largest first.
    pub live_entries: Vec<LiveEntry>,
    /// The device's peak live bytes so far.
    pub peak_total: u64,
}

impl OutOfBudget {
    /// Bytes the request exceeds the budget by.
    pub fn shortfall(&self) -> u64 {
        self.live_total
            .saturating_add(self.requested)
            .saturating_sub(self.budget)
    }

    /// The report to print at the failure: what was asked for, the budget, what was live by
    /// category, and the `top` largest live (category, label) groups with their share of the
    /// budget (the rest folded into one line).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use headroom_profiler::{label, MemoryTracker, OutOfBudget};
    /// use headroom_tensor::{Backend, Cpu, DType, Device, MemoryCategory};
    ///
    /// let tracker = Arc::new(MemoryTracker::new());
    /// tracker.set_budget(Device::Cpu, Some(4096));
    /// let cpu = Cpu::new().with_alloc_hook(tracker.clone());
    /// let _kept = {
    ///     let _acts = MemoryCategory::Activations.enter();
    ///     let _l = label("block 0 / attn");
    ///     cpu.zeros([768], DType::F32).unwrap() // 3072 B
    /// };
    /// let err = cpu.zeros([512], DType::F32).unwrap_err();
    /// let text = OutOfBudget::find(&err).unwrap().summary(5);
    /// assert!(text.contains("block 0 / attn"), "{text}");
    /// assert_eq!(tracker.last_refusal().map(|r| r.requested), Some(2048));
    /// ```
    pub fn summary(&self, top: usize) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        // `write!` into a String cannot fail.
        let _ = write!(
            out,
            "out of budget on {}: {} requested for {}",
            self.device,
            human_bytes(self.requested),
            self.category
        );
        if let Some(label) = &self.label {
            let _ = write!(out, " ({label})");
        }
        let _ = writeln!(
            out,
            "\n  budget {}, live {} (short by {}), peak so far {}",
            human_bytes(self.budget),
            human_bytes(self.live_total),
            human_bytes(self.shortfall()),
            human_bytes(self.peak_total)
        );
        let share = |bytes: u64| {
            if self.budget == 0 {
                String::new()
            } else {
                format!("{:5.1}%", bytes as f64 * 100.0 / self.budget as f64)
            }
        };
        let _ = writeln!(out, "  live by category:");
        let mut any = false;
        for (category, bytes) in self.live.iter().filter(|(_, b)| *b > 0) {
            let _ = writeln!(
                out,
                "    {:<12} {:>11} {}",
                category.name(),
                human_bytes(bytes),
                share(bytes)
            );
            any = true;
        }
        if !any {
            let _ = writeln!(out, "    nothing");
        }
        if !self.live_entries.is_empty() {
            let _ = writeln!(out, "  largest live (category, label):");
            for e in self.live_entries.iter().take(top) {
                let _ = writeln!(
                    out,
                    "    {:>11} {} {:<12} {} ({} allocation{})",
                    human_bytes(e.bytes),
                    share(e.bytes),
                    e.category.name(),
                    e.label.as_deref().unwrap_or("(unlabelled)"),
                    e.count,
                    if e.count == 1 { "" } else { "s" }
                );
            }
            let rest = &self.live_entries[top.min(self.live_entries.len())..];
            if !rest.is_empty() {
                let bytes = rest.iter().fold(0u64, |a, e| a.saturating_add(e.bytes));
                let _ = writeln!(
                    out,
                    "    {:>11} {} … {} more (category, label) groups",
                    human_bytes(bytes),
                    share(bytes),
                    rest.len()
                );
            }
        }
        out
    }

    /// The first `OutOfBudget` in `error`'s source chain (the error itself included).
    pub fn find<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a OutOfBudget> {
        let mut current = Some(error);
        while let Some(e) = current {
            if let Some(found) = e.downcast_ref::<OutOfBudget>() {
                return Some(found);
            }
            current = e.source();
        }
        None
    }
}

impl fmt::Display for OutOfBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "out of budget on {}: {} requested for {}",
            self.device,
            human_bytes(self.requested),
            self.category
        )?;
        if let Some(label) = &self.label {
            write!(f, " ({label})")?;
        }
        write!(
            f,
            " with {} of {} live (short by {}); live:",
            human_bytes(self.live_total),
            human_bytes(self.budget),
            human_bytes(self.shortfall())
        )?;
        let mut any = false;
        for (category, bytes) in self.live.iter().filter(|(_, b)| *b > 0) {
            write!(f, " {category} {}", human_bytes(bytes))?;
            any = true;
        }
        if !any {
            f.write_str(" nothing")?;
        }
        Ok(())
    }
}

impl std::error::Error for OutOfBudget {}
