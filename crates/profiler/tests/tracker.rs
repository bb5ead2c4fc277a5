//! The tracker through real backends: categories, labels, peaks, budgets, reports.

use std::sync::Arc;

use headroom_profiler::{
    chrome_trace, confirm_boundary, fits_unless_out_of_budget, label, memory_summary,
    search_max_fit, stacked_columns, stacked_timeline_svg, validate_chrome_trace, MarkKind, MaxFit,
    MemoryTracker, OutOfBudget, PlotOptions, ReportContext,
};
use headroom_tensor::{
    AllocEvent, AllocHook, AllocId, Backend, Cpu, DType, Device, Error, MemoryCategory,
    TrackedAllocation,
};

fn tracked() -> (Arc<MemoryTracker>, Cpu) {
    let tracker = Arc::new(MemoryTracker::new());
    let cpu = Cpu::new().with_alloc_hook(tracker.clone());
    (tracker, cpu)
}

#[test]
fn counts_live_peak_and_composition_at_peak() {
    let (tracker, cpu) = tracked();
    let params = {
        let _c = MemoryCategory::Parameters.enter();
        cpu.zeros([1000], DType::F32).unwrap() // 4000 B
    };
    let mut saved = Vec::new();
    {
        let _c = MemoryCategory::Activations.enter();
        for block in 0..3 {
            let _l = label(&format!("block {block}"));
            let _a = label("attn");
            saved.push(cpu.zeros([100], DType::BF16).unwrap()); // 200 B each
        }
    }
    let grads = {
        let _c = MemoryCategory::Gradients.enter();
        cpu.zeros([1000], DType::F32).unwrap()
    };
    // Peak now: 4000 + 600 + 4000. Backward frees activations one by one.
    drop(saved.pop());
    drop(saved.pop());
    let scratch = {
        let _c = MemoryCategory::Workspace.enter();
        cpu.zeros([50], DType::F32).unwrap() // 200 B: back to 8400, under the peak
    };

    let snap = tracker.snapshot();
    let d = snap.device(Device::Cpu).unwrap();
    assert_eq!(d.peak_total, 8600);
    assert_eq!(d.live_total, 4000 + 200 + 4000 + 200);
    assert_eq!(d.at_peak[MemoryCategory::Activations], 600);
    assert_eq!(d.at_peak[MemoryCategory::Workspace], 0);
    assert_eq!(d.peak[MemoryCategory::Workspace], 200);
    assert_eq!(d.live[MemoryCategory::Activations], 200);
    assert_eq!(d.allocs[MemoryCategory::Activations], 3);
    assert_eq!(d.frees[MemoryCategory::Activations], 2);
    assert_eq!(d.allocs.total(), 6);
    let at_peak_labels: Vec<_> = d
        .peak_entries
        .iter()
        .filter(|e| e.category == MemoryCategory::Activations)
        .map(|e| (e.label.clone().unwrap(), e.bytes, e.count))
        .collect();
    assert_eq!(
        at_peak_labels,
        [
            ("block 0 / attn".to_owned(), 200, 1),
            ("block 1 / attn".to_owned(), 200, 1),
            ("block 2 / attn".to_owned(), 200, 1),
        ]
    );
    let live_labels: Vec<_> = d
        .live_entries
        .iter()
        .filter_map(|e| e.label.clone())
        .collect();
    assert_eq!(live_labels, ["block 0 / attn"]);

    let table = memory_summary(&snap, &ReportContext::with_process_memory());
    assert!(table.contains("headroom memory summary: cpu"), "{table}");
    assert!(table.contains("block 2 / attn"), "{table}");
    assert!(table.contains("8.40 KiB"), "{table}"); // peak total 8600 B
    assert!(table.contains("process peak RSS"), "{table}");
    for line in table.lines() {
        assert_eq!(line.chars().count(), 79, "ragged line {line:?}");
    }

    tracker.reset_peak();
    assert_eq!(tracker.peak_bytes(Device::Cpu), 8400);
    drop((params, grads, scratch, saved));
    assert_eq!(tracker.live_bytes(Device::Cpu), 0);
    assert_eq!(tracker.peak_bytes(Device::Cpu), 8400);
}

#[test]
fn labels_follow_an_allocation_freed_on_another_thread() {
    let (tracker, cpu) = tracked();
    let t = {
        let _l = label("producer");
        cpu.zeros([16], DType::F32).unwrap()
    };
    std::thread::spawn(move || drop(t)).join().unwrap();
    let snap = tracker.snapshot();
    let d = snap.device(Device::Cpu).unwrap();
    assert_eq!(d.live_total, 0);
    assert!(d.live_entries.is_empty());
    assert_eq!(d.peak_entries[0].label.as_deref(), Some("producer"));
    assert_eq!(snap.unmatched_frees, 0);
}

#[test]
fn unknown_frees_are_counted_not_subtracted() {
    let (tracker, cpu) = tracked();
    let _t = cpu.zeros([8], DType::F32).unwrap();
    tracker.on_free(&AllocEvent {
        id: AllocId::next(),
        bytes: 32,
        dtype: DType::F32,
        device: Device::Cpu,
        category: MemoryCategory::Other,
    });
    let snap = tracker.snapshot();
    assert_eq!(snap.unmatched_frees, 1);
    assert_eq!(snap.device(Device::Cpu).unwrap().live_total, 32);
}

#[test]
fn budget_refusal_downcasts_from_the_tensor_error() {
    let (tracker, cpu) = tracked();
    tracker.set_budget(Device::Cpu, Some(10_000));
    let _weights = {
        let _c = MemoryCategory::Parameters.enter();
        cpu.zeros([1500], DType::F32).unwrap() // 6000 B
    };
    let exactly_full = {
        let _c = MemoryCategory::Activations.enter();
        cpu.zeros([1000], DType::F32).unwrap() // 4000 B: live 10000 = budget, fits
    };
    let err = {
        let _c = MemoryCategory::Workspace.enter();
        let _l = label("block 7 / mlp");
        cpu.zeros([1], DType::BF16).unwrap_err() // 2 B over
    };
    assert!(matches!(
        err,
        Error::AllocationRejected {
            bytes: 2,
            device: Device::Cpu,
            ..
        }
    ));
    let source = std::error::Error::source(&err).expect("the hook's error is the source");
    let oob = source
        .downcast_ref::<OutOfBudget>()
        .expect("source downcasts to OutOfBudget");
    assert_eq!(OutOfBudget::find(&err), Some(oob));
    assert_eq!(oob.requested, 2);
    assert_eq!(oob.dtype, DType::BF16);
    assert_eq!(oob.category, MemoryCategory::Workspace);
    assert_eq!(oob.label.as_deref(), Some("block 7 / mlp"));
    assert_eq!(
        (oob.budget, oob.live_total, oob.shortfall()),
        (10_000, 10_000, 2)
    );
    assert_eq!(oob.live[MemoryCategory::Parameters], 6000);
    assert_eq!(oob.live[MemoryCategory::Activations], 4000);
    assert_eq!(oob.live_entries.len(), 2);
    assert_eq!(oob.live_entries[0].bytes, 6000);
    let text = oob.to_string();
    assert!(
        text.contains("out of budget on cpu: 2 B requested for workspace (block 7 / mlp)"),
        "{text}"
    );
    assert!(text.contains("params 5.86 KiB"), "{text}");

    // The refusal changed nothing: no live bytes, no allocation count, one rejection.
    let snap = tracker.snapshot();
    let d = snap.device(Device::Cpu).unwrap();
    assert_eq!((d.live_total, d.allocs.total(), d.rejected), (10_000, 2, 1));
    assert_eq!(d.budget, Some(10_000));

    // Freeing makes room again; a budget below what is live refuses every new allocation
    // but never takes memory back.
    drop(exactly_full);
    let _fits = cpu.zeros([1], DType::BF16).unwrap();
    tracker.set_budget(Device::Cpu, Some(100));
    // The rule is "refuse what would leave live bytes above the budget", so with live already
    // above it even an empty allocation is refused.
    assert!(cpu.zeros([0], DType::F32).is_err());
    assert!(cpu.zeros([1], DType::U8).is_err());
    assert_eq!(tracker.live_bytes(Device::Cpu), 6002);
    tracker.set_budget(Device::Cpu, None);
    assert!(cpu.zeros([1], DType::U8).is_ok());
}

#[test]
fn budgets_are_per_device() {
    let tracker = Arc::new(MemoryTracker::new());
    let hook: Arc<dyn AllocHook> = tracker.clone();
    tracker.set_budget(Device::Cuda(0), Some(100));
    let _host = TrackedAllocation::register(Some(&hook), 1000, DType::U8, Device::Cpu).unwrap();
    let _gpu = TrackedAllocation::register(Some(&hook), 100, DType::U8, Device::Cuda(0)).unwrap();
    let err = TrackedAllocation::register(Some(&hook), 1, DType::U8, Device::Cuda(0)).unwrap_err();
    let oob = OutOfBudget::find(&err).unwrap();
    assert_eq!(oob.device, Device::Cuda(0));
    assert_eq!(tracker.budget(Device::Cuda(0)), Some(100));
    assert_eq!(tracker.budget(Device::Cpu), None);
    assert_eq!(tracker.live_bytes(Device::Cpu), 1000);
}

#[test]
fn max_batch_search_under_a_budget() {
    // A "training step" that allocates 1 KiB of activations per sequence over 8 KiB of weights.
    let (tracker, cpu) = tracked();
    tracker.set_budget(Device::Cpu, Some(40 << 10));
    let _weights = cpu.zeros([8 << 10], DType::U8).unwrap();
    let report = search_max_fit(1, 1024, |batch| {
        fits_unless_out_of_budget(cpu.zeros([batch, 1024], DType::U8))
    })
    .unwrap();
    assert_eq!(report.largest_fit, Some(32));
    assert_eq!(
        report.outcome,
        MaxFit::Found {
            largest_fit: 32,
            smallest_refused: 33
        }
    );
    assert!(report.attempts.iter().any(|a| !a.fits));
    // An estimate of 20 confirmed by measuring: 32 fits, 33 does not.
    let check = confirm_boundary(20, 1024, 16, |batch| {
        fits_unless_out_of_budget(cpu.zeros([batch, 1024], DType::U8))
    })
    .unwrap();
    assert_eq!(
        check.outcome,
        Some(MaxFit::Found {
            largest_fit: 32,
            smallest_refused: 33
        })
    );
    assert_eq!(check.estimate_error(), Some(12));
    // Everything up to the limit fits: a lower bound, not the answer.
    let all = search_max_fit(1, 16, |batch| {
        fits_unless_out_of_budget(cpu.zeros([batch, 1024], DType::U8))
    })
    .unwrap();
    assert_eq!(all.outcome, MaxFit::LimitReached { limit: 16 });
    // Another error is not "does not fit".
    let other = search_max_fit(1, 8, |_| {
        fits_unless_out_of_budget(cpu.upload(&[1.0f32], [2]))
    });
    assert!(matches!(other, Err(Error::LengthMismatch { .. })));
}

#[test]
fn timeline_exports_phases_counters_and_svg() {
    let (tracker, cpu) = tracked();
    let _before = cpu.zeros([10], DType::U8).unwrap();
    tracker.mark("ignored: not recording");
    tracker.start_timeline();
    let weights = {
        let _c = MemoryCategory::Parameters.enter();
        cpu.zeros([100], DType::F32).unwrap()
    };
    {
        let _p = tracker.phase("forward");
        let _c = MemoryCategory::Activations.enter();
        let _l = label("block <0> & \"x\"");
        let _a = cpu.zeros([50], DType::F32).unwrap();
        tracker.mark("loss");
    }
    {
        let _p = tracker.phase("optimizer");
    }
    let timeline = tracker.timeline().unwrap();
    assert_eq!(timeline.events.len(), 3);
    assert_eq!(timeline.peak(Device::Cpu), 10 + 400 + 200);
    let kinds: Vec<_> = timeline
        .marks
        .iter()
        .map(|m| (m.name.as_str(), m.kind))
        .collect();
    assert_eq!(
        kinds,
        [
            ("forward", MarkKind::Begin),
            ("loss", MarkKind::Instant),
            ("forward", MarkKind::End),
            ("optimizer", MarkKind::Begin),
            ("optimizer", MarkKind::End),
        ]
    );

    let trace = chrome_trace(&timeline);
    let text = serde_json::to_string(&trace).unwrap();
    let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = parsed["traceEvents"].as_array().unwrap();
    let stats = validate_chrome_trace(&parsed).unwrap();
    assert_eq!(stats.slices, 2);
    let slices: Vec<_> = events
        .iter()
        .filter(|e| e["ph"] == "B" || e["ph"] == "E")
        .map(|e| (e["ph"].as_str().unwrap(), e["name"].as_str().unwrap()))
        .collect();
    assert_eq!(
        slices,
        [
            ("B", "forward"),
            ("E", "forward"),
            ("B", "optimizer"),
            ("E", "optimizer")
        ]
    );
    assert!(events.iter().any(|e| e["ph"] == "i" && e["name"] == "loss"));
    assert!(events
        .iter()
        .any(|e| e["ph"] == "i" && e["name"] == "block <0> & \"x\""));
    assert_eq!(parsed["otherData"]["peak_bytes"]["cpu"], 610);

    let svg = stacked_timeline_svg(
        &timeline,
        Device::Cpu,
        &PlotOptions {
            budget: Some(1000),
            ..PlotOptions::default()
        },
    );
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains(r#"class="params""#) && svg.contains(r#"class="activations""#));
    assert!(
        svg.contains(r#"class="other""#),
        "the 10 B allocated before recording"
    );
    assert!(
        !svg.contains(r#"class="grads""#),
        "absent categories are not drawn"
    );
    assert!(svg.contains("peak 610 B") && svg.contains("budget 1000 B"));
    assert!(svg.contains(">optimizer</text>"));
    assert_eq!(svg.matches('<').count(), svg.matches('>').count());
    assert!(svg.contains(">memory (B)</text>") && svg.contains(">time ("));

    let stopped = tracker.stop_timeline().unwrap();
    assert!(!tracker.is_recording());
    assert_eq!(stopped.events.len(), 3);
    drop(weights);
    assert!(tracker.timeline().is_none());
}

#[test]
fn timeline_capacity_keeps_a_consistent_prefix() {
    let (tracker, cpu) = tracked();
    tracker.start_timeline_with_capacity(4);
    for _ in 0..5 {
        let _t = cpu.zeros([4], DType::F32).unwrap();
    }
    let t = tracker.stop_timeline().unwrap();
    assert_eq!(t.events.len(), 4);
    assert_eq!(t.dropped_events, 6);
    assert_eq!(t.peak(Device::Cpu), 16);
    assert_eq!(
        stacked_columns(&t, Device::Cpu, 2)
            .iter()
            .map(|(_, l)| l.total())
            .max(),
        Some(16)
    );
}

#[test]
fn the_summary_at_the_failure_names_what_was_live() {
    let (tracker, cpu) = tracked();
    tracker.set_budget(Device::Cpu, Some(64 << 10));
    let _weights = {
        let _c = MemoryCategory::Parameters.enter();
        let _l = label("wte");
        cpu.zeros([8 << 10], DType::F32).unwrap() // 32 KiB
    };
    let _saved: Vec<_> = {
        let _c = MemoryCategory::Activations.enter();
        (0..3)
            .map(|block| {
                let _l = label(&format!("block {block}"));
                cpu.zeros([1 << 10, 2], DType::F32).unwrap() // 8 KiB each
            })
            .collect()
    };
    assert!(tracker.last_refusal().is_none());
    let live = tracker.live_entries(Device::Cpu);
    assert_eq!(live.len(), 4);
    assert_eq!(live[0].label.as_deref(), Some("wte"));
    assert_eq!(live.iter().map(|e| e.bytes).sum::<u64>(), 56 << 10);
    assert!(tracker.live_entries(Device::Cuda(3)).is_empty());

    let err = {
        let _c = MemoryCategory::Workspace.enter();
        let _l = label("block 3 / mlp");
        cpu.zeros([4 << 10], DType::F32).unwrap_err() // 16 KiB > 8 KiB left
    };
    let oob = OutOfBudget::find(&err).unwrap();
    assert_eq!(oob.shortfall(), 8 << 10);
    let text = oob.summary(2);
    for needed in [
        "out of budget on cpu: 16.00 KiB requested for workspace (block 3 / mlp)",
        "budget 64.00 KiB, live 56.00 KiB (short by 8.00 KiB)",
        "params",
        "32.00 KiB  50.0% params       wte (1 allocation)",
        "… 2 more (category, label) groups",
    ] {
        assert!(text.contains(needed), "{needed:?} not in\n{text}");
    }
    assert_eq!(text.matches("block ").count(), 2, "{text}");
    // The tracker remembers the refusal after the error is gone.
    let remembered = tracker.last_refusal().unwrap();
    assert_eq!(&remembered, oob);
    drop(err);
    tracker.clear_last_refusal();
    assert!(tracker.last_refusal().is_none());
}

#[test]
fn refusals_are_on_the_timeline() {
    let (tracker, cpu) = tracked();
    tracker.set_budget(Device::Cpu, Some(100));
    tracker.start_timeline();
    let _a = cpu.zeros([20], DType::F32).unwrap();
    assert!(cpu.zeros([10], DType::F32).is_err());
    let timeline = tracker.stop_timeline().unwrap();
    assert_eq!(timeline.refusals.len(), 1);
    let r = timeline.refusals[0];
    assert_eq!((r.bytes, r.device_live, r.budget), (40, 80, 100));
    assert!(r.t_ns >= timeline.events[0].t_ns);
    let trace = chrome_trace(&timeline);
    validate_chrome_trace(&trace).unwrap();
    let refusal = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| {
            e["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("out of budget"))
        })
        .unwrap();
    assert_eq!(refusal["args"]["requested"], 40);
}
