//! Property tests of the tracker's invariants against plain models:
//! - concurrent alloc/free interleavings: live = sum of outstanding, peak = max prefix sum of the
//!   order the tracker saw, composition at the peak = the replayed state at that moment;
//! - budgets refuse exactly the allocations that would cross them;
//! - the Chrome trace passes the Trace Event Format validator, whatever the order phases end
//!   in, and its counters replay to the tracker's live totals and peak;
//! - the SVG plot of the same timeline is well formed in both x-axis modes.

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier, Mutex};

use headroom_profiler::{
    chrome_trace, label, stacked_columns, stacked_timeline_svg, validate_chrome_trace, EventKind,
    MarkKind, MemoryTracker, OutOfBudget, PlotOptions, Timeline, XAxis, COUNTER_NAME,
};
use headroom_tensor::{AllocHook, DType, Device, MemoryCategory, TrackedAllocation};
use proptest::prelude::*;

const DEVICES: [Device; 2] = [Device::Cpu, Device::Cuda(0)];
const LABELS: [&str; 3] = ["", "block 0", "block 1"];

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        bytes: usize,
        category: usize,
        device: usize,
        label: usize,
    },
    Free {
        pick: usize,
    },
    /// Hand one held allocation to the shared pool (another thread may free it).
    Share {
        pick: usize,
    },
    /// Free the newest allocation in the shared pool, whichever thread made it.
    FreeShared,
}

const PHASES: [&str; 3] = ["forward", "backward", "optimizer"];

/// What happens on the timeline beside an allocation op.
#[derive(Clone, Debug)]
enum TimelineOp {
    Nothing,
    Begin(usize),
    /// End one of the open phases, not necessarily the innermost.
    End(usize),
    Mark(usize),
}

fn timeline_op() -> impl Strategy<Value = TimelineOp> {
    prop_oneof![
        4 => Just(TimelineOp::Nothing),
        1 => (0usize..3).prop_map(TimelineOp::Begin),
        1 => any::<usize>().prop_map(TimelineOp::End),
        1 => (0usize..3).prop_map(TimelineOp::Mark),
    ]
}

/// Sizes mixing tiny ones (so totals hit a peak or a budget plus or minus one byte) with
/// round ones (so totals land exactly on a round budget).
fn bytes() -> impl Strategy<Value = usize> {
    prop_oneof![0usize..4, (0usize..40).prop_map(|k| k * 100)]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (bytes(), 0usize..7, 0usize..2, 0usize..3).prop_map(
            |(bytes, category, device, label)| Op::Alloc { bytes, category, device, label }
        ),
        2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Share { pick }),
        1 => Just(Op::FreeShared),
    ]
}

struct Held {
    allocation: TrackedAllocation,
    label: usize,
}

/// Allocations handed between threads.
type Pool = Mutex<Vec<Held>>;

/// Apply `op` on the calling thread; `None` if the allocation was refused.
fn apply(hook: &Arc<dyn AllocHook>, held: &mut Vec<Held>, pool: &Pool, op: &Op) -> Option<()> {
    match *op {
        Op::Alloc {
            bytes,
            category,
            device,
            label: l,
        } => {
            let _c = MemoryCategory::ALL[category].enter();
            let _l = label(LABELS[l]);
            let allocation =
                TrackedAllocation::register(Some(hook), bytes, DType::U8, DEVICES[device]).ok()?;
            held.push(Held {
                allocation,
                label: l,
            });
        }
        Op::Free { pick } => {
            if !held.is_empty() {
                let i = pick % held.len();
                held.swap_remove(i);
            }
        }
        Op::Share { pick } => {
            if !held.is_empty() {
                let i = pick % held.len();
                let shared = held.swap_remove(i);
                pool.lock().unwrap().push(shared);
            }
        }
        Op::FreeShared => {
            let freed = pool.lock().unwrap().pop();
            drop(freed);
        }
    }
    Some(())
}

type Key = (MemoryCategory, Option<String>);

fn label_name(i: usize) -> Option<String> {
    (!LABELS[i].is_empty()).then(|| LABELS[i].to_owned())
}

/// Replay the timeline's events from their kinds and sizes alone (not the live fields the
/// tracker recorded), returning per device: the peak total, the per-category peaks, and the
/// (category, label) composition at the first moment the peak was reached.
fn replay_model(t: &Timeline, device: Device) -> (u64, [u64; 7], BTreeMap<Key, u64>) {
    let mut live: BTreeMap<Key, u64> = BTreeMap::new();
    let mut cat_live = [0u64; 7];
    let mut cat_peak = [0u64; 7];
    let (mut total, mut peak) = (0u64, 0u64);
    let mut at_peak = BTreeMap::new();
    for e in t.events.iter().filter(|e| e.device == device) {
        let key = (e.category, e.label.name().map(|n| n.to_string()));
        let ci = MemoryCategory::ALL
            .iter()
            .position(|c| *c == e.category)
            .unwrap();
        match e.kind {
            EventKind::Alloc => {
                *live.entry(key).or_default() += e.bytes;
                cat_live[ci] += e.bytes;
                total += e.bytes;
            }
            EventKind::Free => {
                *live.get_mut(&key).expect("free of a live key") -= e.bytes;
                cat_live[ci] -= e.bytes;
                total -= e.bytes;
            }
        }
        assert_eq!(
            e.device_live, total,
            "recorded live total disagrees with replay"
        );
        assert_eq!(e.category_live, cat_live[ci]);
        cat_peak[ci] = cat_peak[ci].max(cat_live[ci]);
        if total > peak {
            peak = total;
            at_peak = live
                .iter()
                .filter(|(_, b)| **b > 0)
                .map(|(k, b)| (k.clone(), *b))
                .collect();
        }
    }
    (peak, cat_peak, at_peak)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn concurrent_interleavings_keep_exact_accounts(
        threads in prop::collection::vec(prop::collection::vec(op(), 0..60), 1..5),
    ) {
        let tracker = Arc::new(MemoryTracker::new());
        let hook: Arc<dyn AllocHook> = tracker.clone();
        tracker.start_timeline();
        let barrier = Arc::new(Barrier::new(threads.len()));
        let pool = Arc::new(Pool::default());
        let handles: Vec<_> = threads
            .iter()
            .cloned()
            .map(|ops| {
                let (hook, barrier, pool) = (hook.clone(), barrier.clone(), pool.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let mut held = Vec::new();
                    for op in &ops {
                        apply(&hook, &mut held, &pool, op).expect("no budget, nothing refused");
                    }
                    held
                })
            })
            .collect();
        let mut outstanding: Vec<Held> =
            handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
        outstanding.append(&mut pool.lock().unwrap());
        let timeline = tracker.timeline().unwrap();
        let snap = tracker.snapshot();
        let alloc_ops = threads.iter().flatten().filter(|o| matches!(o, Op::Alloc { .. }));
        prop_assert_eq!(timeline.events.iter().filter(|e| e.kind == EventKind::Alloc).count(),
                        alloc_ops.count());

        for device in DEVICES {
            let mine: Vec<&Held> =
                outstanding.iter().filter(|h| h.allocation.event().device == device).collect();
            let (peak, cat_peak, at_peak) = replay_model(&timeline, device);
            let Some(d) = snap.device(device) else {
                prop_assert!(mine.is_empty() && peak == 0);
                continue;
            };
            // Live = outstanding, per category and per (category, label).
            for category in MemoryCategory::ALL {
                let expected: u64 = mine
                    .iter()
                    .filter(|h| h.allocation.event().category == category)
                    .map(|h| h.allocation.event().bytes as u64)
                    .sum();
                prop_assert_eq!(d.live[category], expected);
                let outstanding_count = mine
                    .iter()
                    .filter(|h| h.allocation.event().category == category)
                    .count() as u64;
                prop_assert_eq!(d.allocs[category] - d.frees[category], outstanding_count);
            }
            let mut expected_entries: BTreeMap<Key, (u64, u64)> = BTreeMap::new();
            for h in &mine {
                let e = expected_entries
                    .entry((h.allocation.event().category, label_name(h.label)))
                    .or_default();
                e.0 += h.allocation.event().bytes as u64;
                e.1 += 1;
            }
            let got: BTreeMap<Key, (u64, u64)> = d
                .live_entries
                .iter()
                .map(|e| ((e.category, e.label.clone()), (e.bytes, e.count)))
                .collect();
            prop_assert_eq!(got, expected_entries);

            // Peak = max prefix sum in the tracker's order; composition = state at that moment.
            prop_assert_eq!(d.peak_total, peak);
            prop_assert_eq!(d.peak.0, cat_peak);
            prop_assert_eq!(d.at_peak.total(), peak);
            let got_at_peak: BTreeMap<Key, u64> = d
                .peak_entries
                .iter()
                .filter(|e| e.bytes > 0)
                .map(|e| ((e.category, e.label.clone()), e.bytes))
                .collect();
            prop_assert_eq!(got_at_peak, at_peak);
        }

        // Free everything on this (another) thread: all accounts return to zero.
        drop(outstanding);
        let snap = tracker.snapshot();
        for d in &snap.devices {
            prop_assert_eq!(d.live_total, 0);
            prop_assert!(d.live_entries.is_empty());
            prop_assert_eq!(d.allocs, d.frees);
        }
        prop_assert_eq!(snap.unmatched_frees, 0);
    }

    #[test]
    fn budget_refuses_exactly_the_crossing_allocations(
        ops in prop::collection::vec(op(), 0..120),
        budget in prop_oneof![0u64..12_000, (0u64..100).prop_map(|k| k * 100)],
    ) {
        let tracker = Arc::new(MemoryTracker::new());
        let hook: Arc<dyn AllocHook> = tracker.clone();
        tracker.set_budget(Device::Cpu, Some(budget));
        let mut held: Vec<(TrackedAllocation, u64)> = Vec::new();
        let (mut live, mut refused) = (0u64, 0u64);
        for op in &ops {
            match *op {
                Op::Alloc { bytes, category, .. } => {
                    let _c = MemoryCategory::ALL[category].enter();
                    let result =
                        TrackedAllocation::register(Some(&hook), bytes, DType::U8, Device::Cpu);
                    let fits = live + bytes as u64 <= budget;
                    match result {
                        Ok(a) => {
                            prop_assert!(fits, "accepted {} with {} live of {}", bytes, live, budget);
                            live += bytes as u64;
                            held.push((a, bytes as u64));
                        }
                        Err(err) => {
                            prop_assert!(!fits, "refused {} with {} live of {}", bytes, live, budget);
                            refused += 1;
                            let oob = OutOfBudget::find(&err).expect("typed refusal");
                            prop_assert_eq!(oob.requested, bytes as u64);
                            prop_assert_eq!(oob.live_total, live);
                            prop_assert_eq!(oob.budget, budget);
                            prop_assert_eq!(oob.category, MemoryCategory::ALL[category]);
                            prop_assert_eq!(
                                oob.live_entries.iter().map(|e| e.bytes).sum::<u64>(), live);
                        }
                    }
                }
                Op::Free { pick } | Op::Share { pick } => {
                    if !held.is_empty() {
                        let (_, bytes) = held.swap_remove(pick % held.len());
                        live -= bytes;
                    }
                }
                Op::FreeShared => {}
            }
            prop_assert_eq!(tracker.live_bytes(Device::Cpu), live);
            prop_assert!(tracker.peak_bytes(Device::Cpu) <= budget);
        }
        let snap = tracker.snapshot();
        prop_assert_eq!(snap.devices[0].rejected, refused);
    }

    #[test]
    fn chrome_trace_is_valid_and_counters_replay_to_the_peak(
        before in prop::collection::vec(op(), 0..30),
        during in prop::collection::vec((op(), timeline_op()), 0..80),
        budget in prop::option::of(0u64..6000),
        columns in 2usize..40,
    ) {
        let tracker = Arc::new(MemoryTracker::new());
        let hook: Arc<dyn AllocHook> = tracker.clone();
        let mut held = Vec::new();
        let pool = Pool::default();
        for op in &before {
            apply(&hook, &mut held, &pool, op).unwrap();
        }
        tracker.start_timeline();
        tracker.reset_peak();
        tracker.set_budget(Device::Cuda(0), budget);
        // Phases opened and closed in random order, so they need not nest.
        let mut phases = Vec::new();
        let mut begins = 0;
        let mut refused = 0;
        for (op, timeline_op) in &during {
            match *timeline_op {
                TimelineOp::Begin(name) => {
                    phases.push(tracker.phase(PHASES[name]));
                    begins += 1;
                }
                TimelineOp::End(pick) if !phases.is_empty() => {
                    drop(phases.remove(pick % phases.len()));
                }
                TimelineOp::Mark(name) => tracker.mark(&format!("{} <&>", PHASES[name])),
                _ => {}
            }
            if apply(&hook, &mut held, &pool, op).is_none() {
                refused += 1;
            }
        }
        let open_at_end = phases.len();
        let timeline = tracker.stop_timeline().unwrap();
        drop(phases);
        let text = serde_json::to_string(&chrome_trace(&timeline)).unwrap();
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        let stats = validate_chrome_trace(&parsed);
        prop_assert!(stats.is_ok(), "{:?}", stats);
        let stats = stats.unwrap();
        let events = parsed["traceEvents"].as_array().unwrap();
        prop_assert_eq!(timeline.refusals.len(), refused);
        prop_assert_eq!(
            events.iter().filter(|e| e["ph"] == "i" && e["tid"] == 2).count(),
            refused
        );

        let mut pid_of_device = BTreeMap::new();
        for e in events.iter().filter(|e| e["ph"] == "M" && e["name"] == "process_name") {
            let name = e["args"]["name"].as_str().unwrap();
            if let Some(device) = name.strip_prefix("memory ") {
                pid_of_device.insert(device.to_owned(), e["pid"].as_u64().unwrap());
            }
        }
        let mut counter_tracks = 0;
        for device in DEVICES {
            let expected = tracker.peak_bytes(device);
            let Some(pid) = pid_of_device.get(&device.to_string()) else {
                prop_assert_eq!(expected, 0);
                continue;
            };
            counter_tracks += 1;
            // One counter track per device; every event carries every category, so the
            // stacked sum after each event is the live total.
            let counters: Vec<_> =
                events.iter().filter(|e| e["ph"] == "C" && e["pid"] == *pid).collect();
            prop_assert_eq!(
                counters.len(),
                1 + timeline.events.iter().filter(|e| e.device == device).count()
            );
            let mut peak = 0u64;
            for (e, (_, live)) in counters.iter().zip(timeline.replay(device)) {
                prop_assert_eq!(e["name"].as_str(), Some(COUNTER_NAME));
                let args = e["args"].as_object().unwrap();
                prop_assert_eq!(args.len(), MemoryCategory::ALL.len());
                let total: u64 = args.values().map(|v| v.as_u64().unwrap()).sum();
                prop_assert_eq!(total, live.total());
                for c in MemoryCategory::ALL {
                    prop_assert_eq!(args[c.name()].as_u64(), Some(live[c]));
                }
                peak = peak.max(total);
            }
            prop_assert_eq!(peak, expected);
            prop_assert_eq!(timeline.peak(device), expected);
            let columns_peak =
                stacked_columns(&timeline, device, columns).iter().map(|(_, l)| l.total()).max();
            prop_assert_eq!(columns_peak.unwrap_or(0), expected);
        }
        prop_assert_eq!(stats.counter_tracks, counter_tracks);
        // Every phase is a slice (reopened pieces of overlapping phases add more), and the
        // phases still open at the end are closed there.
        let begin_events = events.iter().filter(|e| e["ph"] == "B").count();
        prop_assert!(begin_events >= begins);
        prop_assert_eq!(begin_events, events.iter().filter(|e| e["ph"] == "E").count());
        prop_assert!(stats.max_depth >= open_at_end.min(1));
        let marks = timeline.marks.iter().filter(|m| m.kind == MarkKind::Instant).count();
        prop_assert_eq!(
            events.iter().filter(|e| e["ph"] == "i" && e["s"] == "g").count(),
            marks
        );

        // The SVG of the same timeline is well formed in both x modes.
        for x_axis in [XAxis::Time, XAxis::EventIndex] {
            let svg = stacked_timeline_svg(
                &timeline,
                Device::Cuda(0),
                &PlotOptions { x_axis, budget, ..PlotOptions::default() },
            );
            prop_assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
            prop_assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
            prop_assert!(!svg.contains("<&>"));
        }
    }
}
