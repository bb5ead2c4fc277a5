//! Chrome-trace / Perfetto JSON export of a [`Timeline`]: one process per device with a counter
//! track per category, label changes as instant events, and phases as instant events plus
//! slices. Open the file in `ui.perfetto.dev` or `chrome://tracing`.

use std::io::Write;

use headroom_tensor::MemoryCategory;
use serde_json::{json, Value};

use crate::error::ProfilerError;
use crate::label::LabelId;
use crate::timeline::{EventKind, MarkKind, Timeline};

/// Process id of the phase track; devices get 1, 2, … in [`Timeline::devices`] order.
const PHASES_PID: usize = 0;
/// Thread id, inside a device's process, of the label-change instants.
const LABELS_TID: usize = 1;

fn micros(t_ns: u64) -> f64 {
    // Chrome traces count microseconds; f64 keeps nanoseconds exact for 104 days.
    t_ns as f64 / 1000.0
}

/// The timeline as a Chrome trace JSON object (`{"traceEvents": [...], ...}`).
///
/// Counter events carry the category's absolute live bytes (`args.bytes`), so replaying a
/// device's counters in file order gives exactly the live totals the tracker saw, and their
/// stacked maximum is the timeline's peak.
pub fn chrome_trace(timeline: &Timeline) -> Value {
    let mut events = vec![
        json!({"name": "process_name", "ph": "M", "pid": PHASES_PID,
               "args": {"name": "phases"}}),
        json!({"name": "process_sort_index", "ph": "M", "pid": PHASES_PID,
               "args": {"sort_index": 0}}),
    ];
    let devices = timeline.devices();
    let pid_of = |device| {
        devices
            .iter()
            .position(|d| *d == device)
            .map_or(PHASES_PID, |i| i + 1)
    };
    let mut peaks = serde_json::Map::new();
    for device in &devices {
        let pid = pid_of(*device);
        events.push(json!({"name": "process_name", "ph": "M", "pid": pid,
                           "args": {"name": format!("memory {device}")}}));
        events.push(json!({"name": "process_sort_index", "ph": "M", "pid": pid,
                           "args": {"sort_index": pid}}));
        events.push(
            json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": LABELS_TID,
                           "args": {"name": "labels"}}),
        );
        let start = timeline
            .start_live
            .iter()
            .find(|(d, _)| d == device)
            .map(|(_, l)| *l)
            .unwrap_or_default();
        for category in MemoryCategory::ALL {
            events.push(
                json!({"name": category.name(), "ph": "C", "ts": 0.0, "pid": pid,
                               "args": {"bytes": start[category]}}),
            );
        }
        peaks.insert(device.to_string(), json!(timeline.peak(*device)));
    }

    let mut last_label: Vec<Option<LabelId>> = vec![None; devices.len() + 1];
    for e in &timeline.events {
        let pid = pid_of(e.device);
        let ts = micros(e.t_ns);
        events.push(
            json!({"name": e.category.name(), "ph": "C", "ts": ts, "pid": pid,
                           "args": {"bytes": e.category_live}}),
        );
        if e.kind == EventKind::Alloc {
            if let Some(slot) = last_label.get_mut(pid) {
                if *slot != Some(e.label) {
                    *slot = Some(e.label);
                    events.push(json!({"name": e.label.to_string(), "ph": "i", "s": "t",
                                       "ts": ts, "pid": pid, "tid": LABELS_TID}));
                }
            }
        }
    }

    // Phases: an instant at each begin (and each plain mark), a slice from begin to its end.
    let mut open: Vec<(&str, u64)> = Vec::new();
    for m in &timeline.marks {
        let ts = micros(m.t_ns);
        match m.kind {
            MarkKind::Instant | MarkKind::Begin => {
                events.push(json!({"name": m.name, "ph": "i", "s": "g", "ts": ts,
                                   "pid": PHASES_PID, "tid": 0}));
                if m.kind == MarkKind::Begin {
                    open.push((&m.name, m.t_ns));
                }
            }
            MarkKind::End => {
                if let Some(i) = open.iter().rposition(|(n, _)| *n == m.name) {
                    let (name, begin) = open.remove(i);
                    events.push(slice(name, begin, m.t_ns));
                }
            }
        }
    }
    let end = timeline.duration_ns();
    for (name, begin) in open {
        events.push(slice(name, begin, end));
    }

    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "headroom-profiler",
            "peak_bytes": peaks,
            "dropped_events": timeline.dropped_events,
        },
    })
}

fn slice(name: &str, begin_ns: u64, end_ns: u64) -> Value {
    json!({"name": name, "ph": "X", "ts": micros(begin_ns),
           "dur": micros(end_ns.saturating_sub(begin_ns)), "pid": PHASES_PID, "tid": 0})
}

/// Write [`chrome_trace`] to `writer` as compact JSON.
pub fn write_chrome_trace(timeline: &Timeline, writer: impl Write) -> Result<(), ProfilerError> {
    serde_json::to_writer(writer, &chrome_trace(timeline)).map_err(std::io::Error::from)?;
    Ok(())
}
