//! Allocation labels: a thread-local, nestable name such as `"block 3 / attn"` that the tracker
//! records beside each allocation's category.
//!
//! Labels are interned once per distinct string into a process-wide table, so the per-allocation
//! cost is reading one thread-local integer. The trade-off: the table only grows, so labels
//! should come from a bounded set (layer and sub-layer names), not from per-step strings — use
//! phase marks ([`crate::MemoryTracker::mark`]) for those.

use std::cell::Cell;
use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

/// An interned label. [`LabelId::NONE`] means "no label scope active".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelId(pub(crate) u32);

struct Interner {
    ids: HashMap<Arc<str>, u32>,
    names: Vec<Arc<str>>,
}

static INTERNER: LazyLock<Mutex<Interner>> = LazyLock::new(|| {
    Mutex::new(Interner {
        ids: HashMap::new(),
        // Slot 0 is NONE so that ids index `names` directly.
        names: vec![Arc::from("")],
    })
});

thread_local! {
    static CURRENT_LABEL: Cell<u32> = const { Cell::new(0) };
}

impl LabelId {
    /// No label.
    pub const NONE: LabelId = LabelId(0);

    /// The id of `name`, interning it on first use. An empty name is [`LabelId::NONE`].
    pub fn intern(name: &str) -> LabelId {
        if name.is_empty() {
            return LabelId::NONE;
        }
        let mut table = INTERNER.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(id) = table.ids.get(name) {
            return LabelId(*id);
        }
        // Four billion distinct labels is a misuse, not a workload; fold the excess into NONE
        // rather than panic.
        let Ok(id) = u32::try_from(table.names.len()) else {
            return LabelId::NONE;
        };
        let name: Arc<str> = Arc::from(name);
        table.names.push(name.clone());
        table.ids.insert(name, id);
        LabelId(id)
    }

    /// The label active on the calling thread.
    pub fn current() -> LabelId {
        LabelId(CURRENT_LABEL.with(Cell::get))
    }

    /// True for [`LabelId::NONE`].
    pub const fn is_none(self) -> bool {
        self.0 == 0
    }

    /// The label's text (`None` for [`LabelId::NONE`] or an id not from [`LabelId::intern`]).
    pub fn name(self) -> Option<Arc<str>> {
        if self.is_none() {
            return None;
        }
        let table = INTERNER.lock().unwrap_or_else(PoisonError::into_inner);
        usize::try_from(self.0)
            .ok()
            .and_then(|i| table.names.get(i).cloned())
    }

    /// The raw index, used to address per-label tables densely.
    pub(crate) const fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for LabelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(&n),
            None => f.write_str("(unlabelled)"),
        }
    }
}

/// Label allocations made on this thread with `name` until the guard drops.
///
/// Scopes nest by path: inside `label("block 3")`, `label("attn")` labels allocations
/// `"block 3 / attn"`. The previous label comes back when the guard drops.
///
/// ```
/// use headroom_profiler::{label, LabelId};
/// let _block = label("block 3");
/// {
///     let _attn = label("attn");
///     assert_eq!(LabelId::current().name().as_deref(), Some("block 3 / attn"));
/// }
/// assert_eq!(LabelId::current().name().as_deref(), Some("block 3"));
/// ```
#[must_use = "the label only applies while the guard lives"]
pub fn label(name: &str) -> LabelGuard {
    let previous = LabelId::current();
    let id = match previous.name() {
        Some(parent) if !name.is_empty() => LabelId::intern(&format!("{parent} / {name}")),
        Some(_) => previous,
        None => LabelId::intern(name),
    };
    enter_id(previous, id)
}

/// Label allocations with exactly `name`, ignoring any enclosing label (no path nesting).
#[must_use = "the label only applies while the guard lives"]
pub fn label_absolute(name: &str) -> LabelGuard {
    enter_id(LabelId::current(), LabelId::intern(name))
}

fn enter_id(previous: LabelId, id: LabelId) -> LabelGuard {
    CURRENT_LABEL.with(|c| c.set(id.0));
    LabelGuard {
        previous,
        _not_send: PhantomData,
    }
}

/// Restores the previous label when dropped. Not `Send`: labels are per thread.
#[derive(Debug)]
pub struct LabelGuard {
    previous: LabelId,
    _not_send: PhantomData<*const ()>,
}

impl Drop for LabelGuard {
    fn drop(&mut self) {
        CURRENT_LABEL.with(|c| c.set(self.previous.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nesting_builds_paths_and_restores() {
        assert!(LabelId::current().is_none());
        {
            let _a = label("block 0");
            {
                let _b = label("mlp");
                assert_eq!(LabelId::current().name().as_deref(), Some("block 0 / mlp"));
                {
                    let _c = label_absolute("head");
                    assert_eq!(LabelId::current().name().as_deref(), Some("head"));
                }
                assert_eq!(LabelId::current().name().as_deref(), Some("block 0 / mlp"));
            }
            assert_eq!(LabelId::current().name().as_deref(), Some("block 0"));
        }
        assert!(LabelId::current().is_none());
        assert_eq!(LabelId::current().to_string(), "(unlabelled)");
    }

    #[test]
    fn interning_is_stable_and_empty_is_none() {
        assert_eq!(LabelId::intern("x / y"), LabelId::intern("x / y"));
        assert_ne!(LabelId::intern("x / y"), LabelId::intern("x / z"));
        assert_eq!(LabelId::intern(""), LabelId::NONE);
        assert_eq!(LabelId(u32::MAX).name(), None);
    }

    #[test]
    fn labels_are_per_thread() {
        let _a = label("main thread");
        let other = std::thread::spawn(|| LabelId::current().is_none())
            .join()
            .unwrap();
        assert!(other);
    }
}
