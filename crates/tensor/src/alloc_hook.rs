//! How backends report allocations: categories, events, the hook trait and an RAII token.
//!
//! The profiler (or any other observer) implements [`AllocHook`] and is handed to a backend.
//! Every allocation the backend makes produces an [`AllocEvent`] tagged with the
//! [`MemoryCategory`] that was current on the allocating thread; dropping the tensor reports the
//! same event as freed. Crates that own memory outside a backend (pinned staging, memory-mapped
//! optimizer state) report it with a [`TrackedAllocation`] so the numbers stay complete without
//! any crate depending on the profiler.

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{BoxedError, DType, Device, Error, Result};

/// What an allocation is for. The categories of a training step's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum MemoryCategory {
    /// Model parameters (master weights and working copies).
    Parameters,
    /// Parameter gradients.
    Gradients,
    /// Optimizer state (Adam moments, step counters).
    OptimizerState,
    /// Activations saved for backward.
    Activations,
    /// Temporary buffers inside an operation.
    Workspace,
    /// Input batches and data staging.
    Data,
    /// Anything not inside a category scope.
    Other,
}

impl MemoryCategory {
    /// Every category, in report order.
    pub const ALL: [MemoryCategory; 7] = [
        MemoryCategory::Parameters,
        MemoryCategory::Gradients,
        MemoryCategory::OptimizerState,
        MemoryCategory::Activations,
        MemoryCategory::Workspace,
        MemoryCategory::Data,
        MemoryCategory::Other,
    ];

    /// Short lowercase name for reports (`"params"`, `"grads"`, …).
    pub const fn name(self) -> &'static str {
        match self {
            MemoryCategory::Parameters => "params",
            MemoryCategory::Gradients => "grads",
            MemoryCategory::OptimizerState => "optimizer",
            MemoryCategory::Activations => "activations",
            MemoryCategory::Workspace => "workspace",
            MemoryCategory::Data => "data",
            MemoryCategory::Other => "other",
        }
    }

    /// The category that allocations on this thread are currently tagged with.
    pub fn current() -> MemoryCategory {
        CURRENT_CATEGORY.with(Cell::get)
    }

    /// Tag allocations on this thread with `self` until the guard is dropped; scopes nest and
    /// the previous category comes back on drop.
    #[must_use = "the category only applies while the guard lives"]
    pub fn enter(self) -> CategoryGuard {
        let previous = CURRENT_CATEGORY.with(|c| c.replace(self));
        CategoryGuard {
            previous,
            _not_send: PhantomData,
        }
    }
}

impl fmt::Display for MemoryCategory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

thread_local! {
    static CURRENT_CATEGORY: Cell<MemoryCategory> = const { Cell::new(MemoryCategory::Other) };
}

/// Restores the previous thread category when dropped. Not `Send`: the category is per thread.
#[derive(Debug)]
pub struct CategoryGuard {
    previous: MemoryCategory,
    _not_send: PhantomData<*const ()>,
}

impl Drop for CategoryGuard {
    fn drop(&mut self) {
        CURRENT_CATEGORY.with(|c| c.set(self.previous));
    }
}

/// A process-unique allocation id, so a hook can match a free to its allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AllocId(pub u64);

impl AllocId {
    /// A fresh id, never returned before in this process.
    pub fn next() -> AllocId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        AllocId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// One allocation as a hook sees it, at allocation and again at free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocEvent {
    /// Unique id of this allocation.
    pub id: AllocId,
    /// Bytes requested (the tensor's exact byte size, not a rounded-up block).
    pub bytes: usize,
    /// Element type of the allocation.
    pub dtype: DType,
    /// Where the memory lives.
    pub device: Device,
    /// What the memory is for.
    pub category: MemoryCategory,
}

/// Observer of allocations. Implementations must be cheap: they run on every allocation.
///
/// `on_alloc` runs on the allocating thread before the memory is handed out and may refuse it
/// (a budget); the backend then releases the memory and returns
/// [`Error::AllocationRejected`] with the hook's error as its source. `on_free` may run on any
/// thread, and runs exactly once for every accepted `on_alloc`.
pub trait AllocHook: Send + Sync {
    /// An allocation is about to be handed out. Return an error to refuse it.
    fn on_alloc(&self, event: &AllocEvent) -> Result<(), BoxedError>;
    /// An allocation accepted earlier has been released.
    fn on_free(&self, event: &AllocEvent);
}

/// An accepted allocation that reports its own free when dropped.
///
/// Backends keep one inside every tensor; other crates create one beside memory they allocate
/// themselves.
pub struct TrackedAllocation {
    hook: Option<Arc<dyn AllocHook>>,
    event: AllocEvent,
}

impl TrackedAllocation {
    /// Report an allocation in the calling thread's current [`MemoryCategory`].
    pub fn register(
        hook: Option<&Arc<dyn AllocHook>>,
        bytes: usize,
        dtype: DType,
        device: Device,
    ) -> Result<Self> {
        Self::register_as(hook, bytes, dtype, device, MemoryCategory::current())
    }

    /// Report an allocation in an explicit category.
    pub fn register_as(
        hook: Option<&Arc<dyn AllocHook>>,
        bytes: usize,
        dtype: DType,
        device: Device,
        category: MemoryCategory,
    ) -> Result<Self> {
        let event = AllocEvent {
            id: AllocId::next(),
            bytes,
            dtype,
            device,
            category,
        };
        if let Some(h) = hook {
            h.on_alloc(&event)
                .map_err(|source| Error::AllocationRejected {
                    device,
                    bytes,
                    source,
                })?;
        }
        Ok(TrackedAllocation {
            hook: hook.cloned(),
            event,
        })
    }

    /// The event this allocation was reported with.
    pub fn event(&self) -> &AllocEvent {
        &self.event
    }
}

impl fmt::Debug for TrackedAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrackedAllocation")
            .field("event", &self.event)
            .field("hooked", &self.hook.is_some())
            .finish()
    }
}

impl Drop for TrackedAllocation {
    fn drop(&mut self) {
        if let Some(h) = &self.hook {
            h.on_free(&self.event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Log(Mutex<Vec<(bool, AllocEvent)>>);
    impl AllocHook for Log {
        fn on_alloc(&self, e: &AllocEvent) -> Result<(), BoxedError> {
            if e.bytes > 1000 {
                return Err("over budget".into());
            }
            self.0.lock().unwrap().push((true, *e));
            Ok(())
        }
        fn on_free(&self, e: &AllocEvent) {
            self.0.lock().unwrap().push((false, *e));
        }
    }

    #[test]
    fn scopes_nest_and_restore() {
        assert_eq!(MemoryCategory::current(), MemoryCategory::Other);
        {
            let _a = MemoryCategory::Activations.enter();
            assert_eq!(MemoryCategory::current(), MemoryCategory::Activations);
            {
                let _g = MemoryCategory::Gradients.enter();
                assert_eq!(MemoryCategory::current(), MemoryCategory::Gradients);
            }
            assert_eq!(MemoryCategory::current(), MemoryCategory::Activations);
        }
        assert_eq!(MemoryCategory::current(), MemoryCategory::Other);
    }

    #[test]
    fn token_reports_alloc_then_free_once_and_rejection_is_typed() {
        let log = Arc::new(Log::default());
        let hook: Arc<dyn AllocHook> = log.clone();
        {
            let _g = MemoryCategory::OptimizerState.enter();
            let t = TrackedAllocation::register(Some(&hook), 64, DType::F32, Device::Cpu).unwrap();
            assert_eq!(t.event().category, MemoryCategory::OptimizerState);
        }
        let events = log.0.lock().unwrap().clone();
        assert_eq!(events.len(), 2);
        assert!(events[0].0 && !events[1].0);
        assert_eq!(events[0].1, events[1].1);

        let err =
            TrackedAllocation::register(Some(&hook), 4096, DType::F32, Device::Cpu).unwrap_err();
        assert!(matches!(err, Error::AllocationRejected { bytes: 4096, .. }));
        assert_eq!(
            log.0.lock().unwrap().len(),
            2,
            "a rejected allocation is never freed"
        );
    }
}
