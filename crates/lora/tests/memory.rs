//! Memory, measured through the allocation hook (headroom-profiler's tracker, plus a hook
//! that records every single allocation): the adapter's parameters, gradients, optimizer
//! moments and kept activations land in their categories at exactly the documented sizes,
//! and nothing of the base weight's size is ever allocated — in particular no gradient for
//! the frozen base.

use std::sync::{Arc, Mutex};

use headroom_lora::{DenseLinear, LoraAdapter, LoraConfig, Mode};
use headroom_profiler::MemoryTracker;
use headroom_tensor::{AllocEvent, AllocHook, BoxedError, Cpu, Device, MemoryCategory, Tensor};

/// Forwards to the tracker and keeps every allocation event.
struct Recorder {
    tracker: Arc<MemoryTracker>,
    events: Mutex<Vec<AllocEvent>>,
}

impl AllocHook for Recorder {
    fn on_alloc(&self, event: &AllocEvent) -> Result<(), BoxedError> {
        self.events.lock().unwrap().push(*event);
        self.tracker.on_alloc(event)
    }
    fn on_free(&self, event: &AllocEvent) {
        self.tracker.on_free(event);
    }
}

#[test]
fn adapter_state_is_counted_and_no_base_sized_buffer_is_allocated() {
    let tracker = Arc::new(MemoryTracker::new());
    let recorder = Arc::new(Recorder {
        tracker: tracker.clone(),
        events: Mutex::new(Vec::new()),
    });
    let cpu = Cpu::new().with_alloc_hook(recorder.clone());
    let (out_f, in_f, rows, r) = (256usize, 512usize, 8usize, 8usize);
    // The base weight is the caller's (not allocated through the backend here): the tracker
    // must see only adapter memory.
    let weight: Vec<f32> = (0..out_f * in_f).map(|i| (i % 13) as f32 * 0.01).collect();
    let base = DenseLinear::new(&weight, None, out_f, in_f).unwrap();
    let base_bytes = (out_f * in_f * 4) as u64;

    for dropout in [0.0f32, 0.25] {
        recorder.events.lock().unwrap().clear();
        let mut config = LoraConfig::new(r, 16.0, ["proj"]);
        config.dropout = dropout;
        let adapter = LoraAdapter::new(&cpu, config, [("layer.proj", out_f, in_f)]).unwrap();
        let lora = adapter.get("layer.proj").unwrap();
        let mem = adapter.memory(2);
        let dev = |t: &MemoryTracker| t.snapshot().device(Device::Cpu).unwrap().clone();
        assert_eq!(
            dev(&tracker).live[MemoryCategory::Parameters],
            mem.parameter_bytes as u64
        );
        assert_eq!(mem.parameter_bytes, r * (in_f + out_f) * 4);

        let mut grads = lora.alloc_grads().unwrap();
        let moments = lora.alloc_moments(2).unwrap();
        let d = dev(&tracker);
        assert_eq!(d.live[MemoryCategory::Gradients], mem.gradient_bytes as u64);
        assert_eq!(
            d.live[MemoryCategory::OptimizerState],
            mem.optimizer_bytes as u64
        );

        let x = vec![0.5f32; rows * in_f];
        let mut y = vec![0f32; rows * out_f];
        tracker.reset_peak();
        let saved = lora
            .forward(
                &base,
                &x,
                &mut y,
                rows,
                Mode::Train {
                    step: 0,
                    micro_batch: 0,
                },
            )
            .unwrap();
        let d = dev(&tracker);
        assert_eq!(
            d.live[MemoryCategory::Activations],
            lora.saved_bytes(rows) as u64
        );
        assert_eq!(saved.h().size_in_bytes(), rows * r * 4);
        assert_eq!(
            d.live[MemoryCategory::Workspace],
            0,
            "forward scratch freed"
        );
        let mut dx = vec![0f32; rows * in_f];
        lora.backward(&base, &saved, &x, &y, &mut dx, &mut grads)
            .unwrap();
        let d = dev(&tracker);
        assert!(d.peak[MemoryCategory::Workspace] as usize <= lora.workspace_bytes(rows));
        assert_eq!(
            d.live[MemoryCategory::Workspace],
            0,
            "backward scratch freed"
        );
        assert_eq!(
            d.peak[MemoryCategory::Gradients],
            mem.gradient_bytes as u64,
            "backward allocated no gradient"
        );

        let events = recorder.events.lock().unwrap().clone();
        let largest = events.iter().map(|e| e.bytes as u64).max().unwrap();
        assert!(
            largest < base_bytes / 4,
            "dropout {dropout}: an allocation of {largest} bytes (base weight {base_bytes})"
        );
        let grad_allocs: Vec<usize> = events
            .iter()
            .filter(|e| e.category == MemoryCategory::Gradients)
            .map(|e| e.bytes)
            .collect();
        assert_eq!(grad_allocs, [r * in_f * 4, out_f * r * 4], "dA and dB only");
        println!(
            "dropout {dropout}: adapter params {} B, grads {} B, Adam moments {} B, kept {} B, \
             peak workspace {} B; base weight {base_bytes} B",
            mem.parameter_bytes,
            mem.gradient_bytes,
            mem.optimizer_bytes,
            lora.saved_bytes(rows),
            d.peak[MemoryCategory::Workspace]
        );
        drop((saved, grads, moments, adapter));
        assert_eq!(dev(&tracker).live_total, 0, "everything freed");
    }
}
