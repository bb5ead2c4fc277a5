//! Allocation reporting through the CPU backend: every tensor is one alloc event with its exact
//! byte size and the thread's category, one matching free, and a refusing hook stops the
//! allocation with a typed, downcastable error.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use headroom_tensor::{
    AllocEvent, AllocHook, AllocId, Backend, BoxedError, Cpu, DType, Device, Error, MemoryCategory,
    Tensor,
};

#[derive(Debug)]
struct OverBudget {
    requested: usize,
}
impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes over budget", self.requested)
    }
}
impl std::error::Error for OverBudget {}

#[derive(Default)]
struct Live {
    budget: usize,
    live: Mutex<HashMap<AllocId, AllocEvent>>,
    frees: Mutex<usize>,
}

impl Live {
    fn live_bytes(&self, c: MemoryCategory) -> usize {
        let live = self.live.lock().unwrap();
        live.values()
            .filter(|e| e.category == c)
            .map(|e| e.bytes)
            .sum()
    }
}

impl AllocHook for Live {
    fn on_alloc(&self, e: &AllocEvent) -> Result<(), BoxedError> {
        let mut live = self.live.lock().unwrap();
        let used: usize = live.values().map(|e| e.bytes).sum();
        if used + e.bytes > self.budget {
            return Err(Box::new(OverBudget { requested: e.bytes }));
        }
        assert!(live.insert(e.id, *e).is_none());
        Ok(())
    }
    fn on_free(&self, e: &AllocEvent) {
        let removed = self.live.lock().unwrap().remove(&e.id);
        assert_eq!(removed.as_ref(), Some(e), "free must match its alloc");
        *self.frees.lock().unwrap() += 1;
    }
}

#[test]
fn every_tensor_is_reported_with_exact_bytes_and_category() {
    let hook = Arc::new(Live {
        budget: 1 << 20,
        ..Default::default()
    });
    let cpu = Cpu::new().with_alloc_hook(hook.clone());
    let params = {
        let _g = MemoryCategory::Parameters.enter();
        cpu.zeros([3, 5], DType::BF16).unwrap()
    };
    let acts = {
        let _g = MemoryCategory::Activations.enter();
        cpu.upload(&[1.0f32; 7], [7]).unwrap()
    };
    assert_eq!(params.size_in_bytes(), 30);
    assert_eq!(hook.live_bytes(MemoryCategory::Parameters), 30);
    assert_eq!(hook.live_bytes(MemoryCategory::Activations), 28);
    assert_eq!(hook.live_bytes(MemoryCategory::Other), 0);
    drop(acts);
    assert_eq!(hook.live_bytes(MemoryCategory::Activations), 0);
    assert_eq!(*hook.frees.lock().unwrap(), 1);
    drop(params);
    assert!(hook.live.lock().unwrap().is_empty());
}

#[test]
fn refused_allocation_is_typed_and_downcastable() {
    let hook = Arc::new(Live {
        budget: 100,
        ..Default::default()
    });
    let cpu = Cpu::new().with_alloc_hook(hook.clone());
    let _kept = cpu.zeros([20], DType::F32).unwrap(); // 80 bytes
    let err = cpu.zeros([8], DType::F32).unwrap_err(); // 32 more would cross 100
    match &err {
        Error::AllocationRejected {
            device: Device::Cpu,
            bytes: 32,
            source,
        } => {
            let over = source.downcast_ref::<OverBudget>().unwrap();
            assert_eq!(over.requested, 32);
        }
        other => panic!("unexpected {other:?}"),
    }
    // The refusal left the accounting untouched and the next fitting allocation works.
    assert_eq!(hook.live_bytes(MemoryCategory::Other), 80);
    cpu.zeros([5], DType::F32).unwrap();
}
