//! Chrome-trace / Perfetto JSON export of a [`Timeline`], and a validator for the Trace Event
//! Format.
//!
//! Layout of the exported trace (open it in `ui.perfetto.dev` or `chrome://tracing`):
//!
//! - process 0, `phases`: phases as `B`/`E` slices on thread 0 (always properly nested: a phase
//!   that ends while a later one is still open closes the later one and reopens it at the same
//!   moment), marks ([`crate::MemoryTracker::mark`]) as global instant events (`"s": "g"`,
//!   a line across every track);
//! - process 1, 2, … per device (`memory cpu`, `memory cuda:0`, …): one counter track `live
//!   bytes` whose `args` hold the live bytes of every category, so the viewer stacks them by
//!   category; thread 1 `labels` gets an instant event whenever the label of the allocations
//!   changes; thread 2 `out of budget` an instant event per refused allocation;
//! - process / thread name and sort-order metadata (`"ph": "M"`).
//!
//! Timestamps are microseconds since the recording started (`displayTimeUnit` `ms`).

use std::collections::HashMap;
use std::io::Write;

use headroom_tensor::MemoryCategory;
use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::error::ProfilerError;
use crate::label::LabelId;
use crate::timeline::{EventKind, MarkKind, Timeline};
use crate::units::human_bytes;

/// Process id of the phase track; devices get 1, 2, … in [`Timeline::devices`] order.
const PHASES_PID: usize = 0;
/// Thread id, inside a device's process, of the label-change instants.
const LABELS_TID: usize = 1;
/// Thread id, inside a device's process, of the refusal instants.
const REFUSALS_TID: usize = 2;
/// Name of each device's counter track.
pub const COUNTER_NAME: &str = "live bytes";

fn micros(t_ns: u64) -> f64 {
    // Chrome traces count microseconds; f64 keeps nanoseconds exact for 104 days.
    t_ns as f64 / 1000.0
}

fn metadata(name: &str, pid: usize, tid: usize, args: Value) -> Value {
    json!({"name": name, "ph": "M", "ts": 0.0, "pid": pid, "tid": tid, "args": args})
}

fn counter(pid: usize, ts: f64, live: &crate::PerCategory<u64>) -> Value {
    let args: Map<String, Value> = live
        .iter()
        .map(|(c, bytes)| (c.name().to_owned(), json!(bytes)))
        .collect();
    json!({"name": COUNTER_NAME, "ph": "C", "ts": ts, "pid": pid, "tid": 0, "args": args})
}

/// The timeline as a Chrome trace JSON object (`{"traceEvents": [...], ...}`); see the module
/// documentation for its layout.
///
/// Each counter event carries the absolute live bytes of every category, so the sum of a
/// device's counter args after each event is exactly the live total the tracker saw, and
/// their maximum is the timeline's peak. The result always passes [`validate_chrome_trace`].
pub fn chrome_trace(timeline: &Timeline) -> Value {
    let mut events = vec![
        metadata("process_name", PHASES_PID, 0, json!({"name": "phases"})),
        metadata(
            "process_sort_index",
            PHASES_PID,
            0,
            json!({"sort_index": 0}),
        ),
        metadata("thread_name", PHASES_PID, 0, json!({"name": "phases"})),
    ];
    let mut devices = timeline.devices();
    for r in &timeline.refusals {
        if !devices.contains(&r.device) {
            devices.push(r.device);
        }
    }
    let pid_of = |device| {
        devices
            .iter()
            .position(|d| *d == device)
            .map_or(PHASES_PID, |i| i + 1)
    };
    let mut peaks = Map::new();
    let mut live = Vec::with_capacity(devices.len());
    for device in &devices {
        let pid = pid_of(*device);
        events.push(metadata(
            "process_name",
            pid,
            0,
            json!({"name": format!("memory {device}")}),
        ));
        events.push(metadata(
            "process_sort_index",
            pid,
            0,
            json!({"sort_index": pid}),
        ));
        events.push(metadata(
            "thread_name",
            pid,
            LABELS_TID,
            json!({"name": "labels"}),
        ));
        events.push(metadata(
            "thread_name",
            pid,
            REFUSALS_TID,
            json!({"name": "out of budget"}),
        ));
        let start = timeline
            .start_live
            .iter()
            .find(|(d, _)| d == device)
            .map(|(_, l)| *l)
            .unwrap_or_default();
        events.push(counter(pid, 0.0, &start));
        live.push(start);
        peaks.insert(device.to_string(), json!(timeline.peak(*device)));
    }

    let mut last_label: Vec<Option<LabelId>> = vec![None; devices.len() + 1];
    let mut refusals = timeline.refusals.iter().peekable();
    let refusal_event = |r: &crate::timeline::Refusal| {
        json!({
            "name": format!("out of budget: {} for {}", human_bytes(r.bytes), r.category),
            "ph": "i", "s": "t", "ts": micros(r.t_ns), "pid": pid_of(r.device),
            "tid": REFUSALS_TID,
            "args": {"requested": r.bytes, "category": r.category.name(),
                     "label": r.label.to_string(), "live": r.device_live, "budget": r.budget},
        })
    };
    for e in &timeline.events {
        while let Some(r) = refusals.next_if(|r| r.t_ns <= e.t_ns) {
            events.push(refusal_event(r));
        }
        let pid = pid_of(e.device);
        let ts = micros(e.t_ns);
        if let Some(l) = live.get_mut(pid.wrapping_sub(1)) {
            l[e.category] = e.category_live;
            events.push(counter(pid, ts, l));
        }
        if e.kind == EventKind::Alloc {
            if let Some(slot) = last_label.get_mut(pid) {
                if *slot != Some(e.label) {
                    *slot = Some(e.label);
                    events.push(json!({"name": e.label.to_string(), "ph": "i", "s": "t",
                                       "ts": ts, "pid": pid, "tid": LABELS_TID,
                                       "args": {"category": e.category.name()}}));
                }
            }
        }
    }
    for r in refusals {
        events.push(refusal_event(r));
    }

    // Phases as properly nested B/E pairs; marks as global instants.
    let phase = |ph: &str, name: &str, t_ns: u64| json!({"name": name, "ph": ph, "ts": micros(t_ns), "pid": PHASES_PID, "tid": 0});
    let mut open: Vec<&str> = Vec::new();
    for m in &timeline.marks {
        match m.kind {
            MarkKind::Instant => events.push(json!({"name": m.name, "ph": "i", "s": "g",
                                                    "ts": micros(m.t_ns), "pid": PHASES_PID,
                                                    "tid": 0})),
            MarkKind::Begin => {
                events.push(phase("B", &m.name, m.t_ns));
                open.push(&m.name);
            }
            MarkKind::End => {
                let Some(i) = open.iter().rposition(|n| *n == m.name) else {
                    continue;
                };
                // Close the phases opened after this one, close it, reopen the others.
                for name in open[i..].iter().rev() {
                    events.push(phase("E", name, m.t_ns));
                }
                open.remove(i);
                for name in &open[i..] {
                    events.push(phase("B", name, m.t_ns));
                }
            }
        }
    }
    let end = timeline.duration_ns();
    for name in open.iter().rev() {
        events.push(phase("E", name, end));
    }

    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "headroom-profiler",
            "peak_bytes": peaks,
            "refusals": timeline.refusals.len(),
            "dropped_events": timeline.dropped_events,
            "categories": MemoryCategory::ALL.iter().map(|c| c.name()).collect::<Vec<_>>(),
        },
    })
}

/// Write [`chrome_trace`] to `writer` as compact JSON, then flush it (a buffered writer's
/// last bytes would otherwise be written, and could fail, unseen when it is dropped).
pub fn write_chrome_trace(
    timeline: &Timeline,
    mut writer: impl Write,
) -> Result<(), ProfilerError> {
    serde_json::to_writer(&mut writer, &chrome_trace(timeline)).map_err(std::io::Error::from)?;
    writer.flush()?;
    Ok(())
}

/// What [`validate_chrome_trace`] counted in a valid trace.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TraceStats {
    /// Events in `traceEvents`.
    pub events: usize,
    /// Counter events (`C`).
    pub counters: usize,
    /// Distinct counter tracks (process, name, id).
    pub counter_tracks: usize,
    /// Slices: `B`/`E` pairs plus complete events (`X`).
    pub slices: usize,
    /// Deepest nesting of slices on one thread.
    pub max_depth: usize,
    /// Instant events (`i`, `I`).
    pub instants: usize,
    /// Metadata events (`M`).
    pub metadata: usize,
    /// Largest timestamp (end of slices included), in microseconds.
    pub end_us: f64,
}

/// Event phases of the Trace Event Format.
const KNOWN_PHASES: [&str; 21] = [
    "B", "E", "X", "i", "I", "C", "M", "b", "n", "e", "s", "t", "f", "P", "O", "N", "D", "R", "c",
    "(", ")",
];
const METADATA_NAMES: [&str; 5] = [
    "process_name",
    "process_labels",
    "process_sort_index",
    "thread_name",
    "thread_sort_index",
];

fn invalid(index: usize, reason: impl Into<String>) -> ProfilerError {
    ProfilerError::InvalidTrace {
        index,
        reason: reason.into(),
    }
}

/// Check `trace` against the Trace Event Format (the JSON object format, `{"traceEvents":
/// [...]}`, or a bare array of events) as strictly as the viewers need:
///
/// - every event is an object with a known `ph`, a string `name` (optional only for `E`), an
///   integer `pid`, an integer `tid` (optional for counters and process metadata) and, except
///   for metadata, a finite `ts` ≥ 0 in microseconds; `args`, where present, is an object;
/// - `X` has a finite `dur` ≥ 0; instants (`i`, `I`) have a scope `s` of `g`, `p` or `t`;
///   counters (`C`) have a non-empty `args` of numbers only; metadata (`M`) is one of the
///   standard names with the argument it needs (`name` or `sort_index`);
/// - timestamps never decrease within a track (a thread's slices and instants, a counter);
/// - `B`/`E` are balanced and nested per (pid, tid) — an `E` closes the innermost open `B`
///   (and names it, if it has a name) — and complete events on a thread do not partially
///   overlap one another.
///
/// `displayTimeUnit`, if present, must be `"ms"` or `"ns"`.
pub fn validate_chrome_trace(trace: &Value) -> Result<TraceStats, ProfilerError> {
    let events = match trace {
        Value::Array(events) => events,
        Value::Object(top) => {
            if let Some(unit) = top.get("displayTimeUnit") {
                if !matches!(unit.as_str(), Some("ms" | "ns")) {
                    return Err(invalid(0, "displayTimeUnit must be \"ms\" or \"ns\""));
                }
            }
            top.get("traceEvents")
                .and_then(Value::as_array)
                .ok_or_else(|| invalid(0, "no traceEvents array"))?
        }
        _ => return Err(invalid(0, "a trace is an object or an array")),
    };
    let mut stats = TraceStats {
        events: events.len(),
        ..TraceStats::default()
    };
    // Per thread: last timestamp, open B names, open X end times.
    #[derive(Default)]
    struct Thread {
        last_ts: f64,
        open: Vec<Option<String>>,
        complete_ends: Vec<f64>,
    }
    let mut threads: HashMap<(i64, i64), Thread> = HashMap::new();
    let mut counters: HashMap<(i64, String, Option<String>), f64> = HashMap::new();
    for (index, event) in events.iter().enumerate() {
        let e = event
            .as_object()
            .ok_or_else(|| invalid(index, "an event is an object"))?;
        let ph = e
            .get("ph")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(index, "missing ph"))?;
        if !KNOWN_PHASES.contains(&ph) {
            return Err(invalid(index, format!("unknown ph {ph:?}")));
        }
        let name = match e.get("name") {
            Some(Value::String(n)) => Some(n.as_str()),
            Some(_) => return Err(invalid(index, "name is not a string")),
            None if ph == "E" => None,
            None => return Err(invalid(index, "missing name")),
        };
        let pid = e
            .get("pid")
            .and_then(Value::as_i64)
            .ok_or_else(|| invalid(index, "missing or non-integer pid"))?;
        let tid = match e.get("tid") {
            Some(t) => Some(
                t.as_i64()
                    .ok_or_else(|| invalid(index, "non-integer tid"))?,
            ),
            None => None,
        };
        if ph == "M" && !name.is_some_and(|n| METADATA_NAMES.contains(&n)) {
            return Err(invalid(index, format!("unknown metadata {name:?}")));
        }
        let process_metadata = ph == "M"
            && matches!(
                name,
                Some("process_name" | "process_labels" | "process_sort_index")
            );
        let tid = match tid {
            Some(t) => t,
            None if ph == "C" || process_metadata => 0,
            None => return Err(invalid(index, "missing tid")),
        };
        let args = match e.get("args") {
            Some(Value::Object(a)) => Some(a),
            Some(_) => return Err(invalid(index, "args is not an object")),
            None => None,
        };
        if ph == "M" {
            stats.metadata += 1;
            let name = name.unwrap_or_default();
            let args = args.ok_or_else(|| invalid(index, "metadata without args"))?;
            let ok = if name.ends_with("sort_index") {
                args.get("sort_index").is_some_and(Value::is_i64)
            } else if name == "process_labels" {
                args.get("labels").is_some_and(Value::is_string)
            } else {
                args.get("name").is_some_and(Value::is_string)
            };
            if !ok {
                return Err(invalid(index, format!("{name} has the wrong args")));
            }
            continue;
        }
        let ts = e
            .get("ts")
            .and_then(Value::as_f64)
            .ok_or_else(|| invalid(index, "missing or non-numeric ts"))?;
        if !ts.is_finite() || ts < 0.0 {
            return Err(invalid(index, format!("ts {ts} is not a finite time ≥ 0")));
        }
        stats.end_us = stats.end_us.max(ts);
        if ph == "C" {
            stats.counters += 1;
            let args = args.ok_or_else(|| invalid(index, "counter without args"))?;
            if args.is_empty() {
                return Err(invalid(index, "counter with empty args"));
            }
            if let Some((key, _)) = args
                .iter()
                .find(|(_, v)| !v.as_f64().is_some_and(f64::is_finite))
            {
                return Err(invalid(
                    index,
                    format!("counter arg {key:?} is not a finite number"),
                ));
            }
            let id = e.get("id").map(|i| i.to_string());
            let key = (pid, name.unwrap_or_default().to_owned(), id);
            let last = counters.entry(key).or_insert(f64::NEG_INFINITY);
            if ts < *last {
                return Err(invalid(index, format!("counter ts {ts} < previous {last}")));
            }
            *last = ts;
            continue;
        }
        let thread = threads.entry((pid, tid)).or_default();
        if ts < thread.last_ts {
            return Err(invalid(
                index,
                format!(
                    "ts {ts} < previous {} on pid {pid} tid {tid}",
                    thread.last_ts
                ),
            ));
        }
        thread.last_ts = ts;
        match ph {
            "B" => {
                thread.open.push(name.map(str::to_owned));
                stats.max_depth = stats
                    .max_depth
                    .max(thread.open.len() + thread.complete_ends.len());
            }
            "E" => {
                let open = thread
                    .open
                    .pop()
                    .ok_or_else(|| invalid(index, "E without an open B"))?;
                if let (Some(end), Some(begin)) = (name, open.as_deref()) {
                    if end != begin {
                        return Err(invalid(
                            index,
                            format!("E {end:?} closes B {begin:?}: slices not nested"),
                        ));
                    }
                }
                stats.slices += 1;
            }
            "X" => {
                let dur = e
                    .get("dur")
                    .and_then(Value::as_f64)
                    .ok_or_else(|| invalid(index, "X without a numeric dur"))?;
                if !dur.is_finite() || dur < 0.0 {
                    return Err(invalid(index, format!("dur {dur} is not a duration")));
                }
                let end = ts + dur;
                while thread.complete_ends.last().is_some_and(|e| *e <= ts) {
                    thread.complete_ends.pop();
                }
                if thread.complete_ends.last().is_some_and(|e| *e < end) {
                    return Err(invalid(index, "X partially overlaps an enclosing X"));
                }
                thread.complete_ends.push(end);
                stats.slices += 1;
                stats.max_depth = stats
                    .max_depth
                    .max(thread.open.len() + thread.complete_ends.len());
                stats.end_us = stats.end_us.max(end);
            }
            "i" | "I" => {
                if !matches!(e.get("s").and_then(Value::as_str), Some("g" | "p" | "t")) {
                    return Err(invalid(index, "instant without a scope s of g, p or t"));
                }
                stats.instants += 1;
            }
            _ => {}
        }
    }
    let mut unclosed: Vec<_> = threads
        .iter()
        .filter(|(_, t)| !t.open.is_empty())
        .map(|((pid, tid), t)| format!("pid {pid} tid {tid}: {} open", t.open.len()))
        .collect();
    if !unclosed.is_empty() {
        unclosed.sort();
        return Err(invalid(
            events.len(),
            format!("B without E ({})", unclosed.join(", ")),
        ));
    }
    stats.counter_tracks = counters.len();
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(events: Value) -> TraceStats {
        validate_chrome_trace(&json!({ "traceEvents": events })).unwrap()
    }

    fn fails(events: Value, what: &str) {
        let err = validate_chrome_trace(&json!({ "traceEvents": events }))
            .expect_err("accepted an invalid trace");
        assert!(err.to_string().contains(what), "{err} (expected {what:?})");
    }

    #[test]
    fn accepts_the_format() {
        let stats = ok(json!([
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "p"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "t"}},
            {"name": "c", "ph": "C", "ts": 0, "pid": 1, "args": {"a": 1, "b": 2.5}},
            {"name": "outer", "ph": "B", "ts": 1, "pid": 1, "tid": 2},
            {"name": "x", "ph": "X", "ts": 1, "dur": 3, "pid": 1, "tid": 2},
            {"name": "y", "ph": "X", "ts": 2, "dur": 1, "pid": 1, "tid": 2},
            {"ph": "E", "ts": 5, "pid": 1, "tid": 2},
            {"name": "m", "ph": "i", "s": "g", "ts": 5, "pid": 0, "tid": 0},
            {"name": "c", "ph": "C", "ts": 5, "pid": 1, "args": {"a": 0, "b": 0}},
        ]));
        assert_eq!(
            (stats.slices, stats.counters, stats.instants, stats.metadata),
            (3, 2, 1, 2)
        );
        assert_eq!((stats.counter_tracks, stats.max_depth), (1, 3));
        assert_eq!(stats.end_us, 5.0);
    }

    #[test]
    fn rejects_what_viewers_choke_on() {
        let b = |ts: f64| json!({"name": "f", "ph": "B", "ts": ts, "pid": 0, "tid": 0});
        let e = |ts: f64| json!({"name": "f", "ph": "E", "ts": ts, "pid": 0, "tid": 0});
        fails(json!([{"name": "f", "ph": "B", "pid": 0, "tid": 0}]), "ts");
        fails(json!([b(0.0), e(1.0), e(2.0)]), "E without an open B");
        fails(json!([b(0.0)]), "B without E");
        fails(
            json!([{"name": "c", "ph": "C", "ts": 0, "pid": 0, "args": {"a": "1"}}]),
            "not a finite number",
        );
        fails(
            json!([{"name": "c", "ph": "C", "ts": 0, "pid": 0, "args": {}}]),
            "empty args",
        );
        fails(json!([b(2.0), e(1.0)]), "previous");
        fails(
            json!([
                {"name": "c", "ph": "C", "ts": 2, "pid": 0, "args": {"a": 1}},
                {"name": "c", "ph": "C", "ts": 1, "pid": 0, "args": {"a": 1}},
            ]),
            "previous",
        );
        fails(
            json!([{"name": "f", "ph": "Z", "ts": 0, "pid": 0, "tid": 0}]),
            "unknown ph",
        );
        fails(
            json!([{"name": "f", "ts": 0, "pid": 0, "tid": 0}]),
            "missing ph",
        );
        fails(
            json!([{"name": "f", "ph": "i", "ts": 0, "pid": 0, "tid": 0}]),
            "scope",
        );
        fails(
            json!([{"name": "f", "ph": "X", "ts": 0, "pid": 0, "tid": 0}]),
            "dur",
        );
        fails(
            json!([
                {"name": "a", "ph": "X", "ts": 0, "dur": 5, "pid": 0, "tid": 0},
                {"name": "b", "ph": "X", "ts": 3, "dur": 5, "pid": 0, "tid": 0},
            ]),
            "overlaps",
        );
        fails(
            json!([
                {"name": "a", "ph": "B", "ts": 0, "pid": 0, "tid": 0},
                {"name": "b", "ph": "B", "ts": 1, "pid": 0, "tid": 0},
                {"name": "a", "ph": "E", "ts": 2, "pid": 0, "tid": 0},
            ]),
            "not nested",
        );
        fails(
            json!([{"ph": "B", "ts": 0, "pid": 0, "tid": 0}]),
            "missing name",
        );
        fails(json!([{"name": "f", "ph": "B", "ts": 0, "tid": 0}]), "pid");
        fails(
            json!([{"name": "f", "ph": "B", "ts": 0, "pid": 0}]),
            "missing tid",
        );
        fails(
            json!([{"name": "f", "ph": "B", "ts": -1, "pid": 0, "tid": 0}]),
            "finite time",
        );
        fails(
            json!([{"name": "process_nam", "ph": "M", "pid": 0, "args": {"name": "x"}}]),
            "unknown metadata",
        );
        fails(
            json!([{"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {}}]),
            "wrong args",
        );
        fails(json!(["B"]), "object");
        assert!(validate_chrome_trace(&json!({"events": []})).is_err());
        assert!(
            validate_chrome_trace(&json!({"traceEvents": [], "displayTimeUnit": "s"})).is_err()
        );
        // The same thread's slices nest; other threads are independent.
        ok(json!([
            b(0.0),
            {"name": "g", "ph": "B", "ts": 0.5, "pid": 0, "tid": 1},
            e(1.0),
            {"name": "g", "ph": "E", "ts": 2, "pid": 0, "tid": 1},
        ]));
    }

    #[test]
    fn empty_timeline_exports_a_valid_trace() {
        let trace = chrome_trace(&Timeline::default());
        let stats = validate_chrome_trace(&trace).unwrap();
        assert_eq!(stats.counters, 0);
        assert_eq!(stats.metadata, 3);
    }
}
