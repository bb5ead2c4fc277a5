//! # headroom-profiler
//!
//! Who holds memory, when, and what a change will do: a tracker that counts every allocation by
//! category, label and device (live, peak, composition at the peak), budgets that simulate a
//! smaller device, reports (a `torch.cuda.memory_summary`-style table, a Chrome-trace/Perfetto
//! timeline with its validator, a stacked SVG plot by time or by allocation event, PyTorch's
//! memory-snapshot pickle for pytorch.org/memory_viz, the summary at an out-of-budget failure,
//! the process's peak RSS), an analytical estimator for GPT-style training, and a max-batch
//! search with measured confirmation.
//!
//! What a training command needs for `--memory-trace`, `--memory-svg` and `--memory-snapshot`:
//! record with [`MemoryTracker::start_timeline`], then hand the [`Timeline`] to
//! [`write_chrome_trace`], [`stacked_timeline_svg`] and [`write_torch_snapshot`]. After a
//! refusal, [`OutOfBudget::summary`] (from the error, or [`MemoryTracker::last_refusal`]) is
//! what to print.
//!
//! ```
//! use std::sync::Arc;
//! use headroom_profiler::{label, memory_summary, MemoryTracker, OutOfBudget, ReportContext};
//! use headroom_tensor::{Backend, Cpu, DType, Device, MemoryCategory};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let tracker = Arc::new(MemoryTracker::new());
//! let cpu = Cpu::new().with_alloc_hook(tracker.clone());
//! tracker.start_timeline();
//! let weights = {
//!     let _params = MemoryCategory::Parameters.enter();
//!     cpu.zeros([256, 256], DType::F32)? // 256 KiB
//! };
//! {
//!     let _phase = tracker.phase("forward");
//!     let _acts = MemoryCategory::Activations.enter();
//!     let _block = label("block 0");
//!     let _saved = cpu.zeros([64, 256], DType::F32)?; // 64 KiB, freed at the end of scope
//! }
//! let snapshot = tracker.snapshot();
//! let stats = snapshot.device(Device::Cpu).expect("allocated on the cpu");
//! assert_eq!(stats.live_total, 256 << 10);
//! assert_eq!(stats.peak_total, 320 << 10);
//! assert_eq!(stats.at_peak[MemoryCategory::Activations], 64 << 10);
//! assert_eq!(stats.peak_entries[1].label.as_deref(), Some("block 0"));
//! println!("{}", memory_summary(&snapshot, &ReportContext::default()));
//!
//! // A budget simulates a smaller device: the refusal is a typed error inside the tensor error.
//! tracker.set_budget(Device::Cpu, Some(300 << 10));
//! let refused = cpu.zeros([64, 256], DType::F32).unwrap_err();
//! assert_eq!(OutOfBudget::find(&refused).map(|o| o.shortfall()), Some(20 << 10));
//!
//! let timeline = tracker.stop_timeline().expect("recording");
//! assert_eq!(timeline.peak(Device::Cpu), 320 << 10);
//! let _trace_json = headroom_profiler::chrome_trace(&timeline); // open in ui.perfetto.dev
//! # drop(weights);
//! # Ok(())
//! # }
//! ```
//!
//! ## Invariants
//! - This crate depends on no headroom crate but headroom-tensor, and nothing depends on it to
//!   be measurable: backends report through [`headroom_tensor::AllocHook`].
//! - A tracker's live bytes (per device, category and label) equal the sum of the accepted,
//!   not yet freed allocations; its peak equals the maximum prefix sum of the allocations and
//!   frees in the order its lock saw them; the composition at the peak is the state at the
//!   first moment that peak was reached. Refused allocations change nothing but the refusal
//!   count. (Property-tested with concurrent threads.)
//! - A budget refuses exactly the allocations that would leave live bytes above it.
//! - A recorded timeline replays (in the Chrome trace and the PyTorch snapshot too) to exactly
//!   the live totals and the peak the tracker saw. Every Chrome trace the crate writes passes
//!   [`validate_chrome_trace`], whatever order phases end in; the snapshot's synthesised blocks
//!   never overlap and lie inside their segment (property-tested).
//! - Reports are pure functions of a timeline or snapshot: same input, same bytes.
//! - The estimator's terms are byte sizes of named buffers ([`block_saved_tensors`]), in exact
//!   integer arithmetic ([`estimator`] documents every formula); a tracked simulation that
//!   allocates those buffers in forward/recompute/backward order measures exactly the
//!   predicted activation peak for every checkpoint policy (property-tested). Absurd inputs
//!   are [`ProfilerError`]s, not panics or wrapped numbers.
//! - Device figures beyond the tracker (free/total memory, allocator pool) come through
//!   [`DeviceMemoryProbe`]; the `cuda` feature will implement it, the CPU build needs none.

mod chrome_trace;
mod comparison;
#[cfg(feature = "cuda")]
mod cuda_probe;
mod error;
pub mod estimator;
mod label;
mod max_batch;
mod per_category;
mod pickle;
mod process_memory;
mod summary_table;
mod svg_plot;
mod timeline;
mod torch_snapshot;
mod tracker;
mod units;

pub use chrome_trace::{
    chrome_trace, validate_chrome_trace, write_chrome_trace, TraceStats, COUNTER_NAME,
};
pub use comparison::{compare_with_measured, comparison_table, CategoryComparison};
pub use error::{LiveEntry, OutOfBudget, ProfilerError};
pub use estimator::{
    block_saved_tensors, estimate, outside_saved_tensors, ActivationTerms, AttentionKind,
    CheckpointPolicy, GptConfig, MemoryEstimate, OptimizerSetup, OptimizerState, Precision,
    SavedTensor, TrainingSetup,
};
pub use label::{label, label_absolute, LabelGuard, LabelId};
pub use max_batch::{
    confirm_boundary, fits_unless_out_of_budget, search_max_fit, validate_search_bounds, Attempt,
    BoundaryCheck, MaxFit, SearchReport, TrialResult,
};
pub use per_category::{PerCategory, CATEGORY_COUNT};
pub use process_memory::{parse_proc_status, DeviceMemoryInfo, DeviceMemoryProbe, ProcessMemory};
pub use summary_table::{memory_summary, ReportContext};
pub use svg_plot::{stacked_columns, stacked_timeline_svg, PlotOptions, XAxis, GLYPH_WIDTH};
pub use timeline::{EventKind, LiveGroup, MarkKind, MemoryEvent, PhaseMark, Refusal, Timeline};
pub use torch_snapshot::{
    torch_device_indices, torch_snapshot, write_torch_snapshot, TorchSnapshotInfo,
    TorchSnapshotOptions, BEFORE_RECORDING, BLOCK_ALIGN,
};
pub use tracker::{DeviceSnapshot, MemorySnapshot, MemoryTracker, PhaseGuard};
pub use units::human_bytes;
