//! An allocation hook that measures live bytes of one memory category and their peak: the
//! independent check that the executor's own count of saved bytes is what the backend
//! actually allocated.

use std::sync::atomic::{AtomicU64, Ordering};

use headroom_tensor::{AllocEvent, AllocHook, BoxedError, MemoryCategory};

/// Counts live bytes and the peak of one [`MemoryCategory`] (by default `Activations`).
///
/// Hand it to a backend (`Cpu::new().with_alloc_hook(meter.clone())` with the meter in an
/// `Arc`); it never refuses an allocation.
#[derive(Debug)]
pub struct CategoryMeter {
    category: MemoryCategory,
    live: AtomicU64,
    peak: AtomicU64,
}

impl Default for CategoryMeter {
    fn default() -> Self {
        CategoryMeter::new(MemoryCategory::Activations)
    }
}

impl CategoryMeter {
    /// A meter of `category`.
    pub fn new(category: MemoryCategory) -> Self {
        CategoryMeter {
            category,
            live: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    /// Bytes of the category alive now.
    pub fn live_bytes(&self) -> u64 {
        self.live.load(Ordering::SeqCst)
    }

    /// The most bytes of the category alive at once since creation or the last reset.
    pub fn peak_bytes(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }

    /// Start a new peak measurement from the bytes alive now.
    pub fn reset_peak(&self) {
        self.peak.store(self.live_bytes(), Ordering::SeqCst);
    }
}

impl AllocHook for CategoryMeter {
    fn on_alloc(&self, event: &AllocEvent) -> Result<(), BoxedError> {
        if event.category == self.category {
            let now =
                self.live.fetch_add(event.bytes as u64, Ordering::SeqCst) + event.bytes as u64;
            self.peak.fetch_max(now, Ordering::SeqCst);
        }
        Ok(())
    }

    fn on_free(&self, event: &AllocEvent) {
        if event.category == self.category {
            self.live.fetch_sub(event.bytes as u64, Ordering::SeqCst);
        }
    }
}
