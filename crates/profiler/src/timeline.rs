//! The recorded memory timeline: every allocation and free in the order the tracker saw them,
//! plus phase marks, from which the Chrome trace and the SVG plot are drawn.

use headroom_tensor::{Device, MemoryCategory};
use serde::Serialize;

use crate::label::LabelId;
use crate::per_category::PerCategory;

/// Whether a timeline event added or removed memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    /// An accepted allocation.
    Alloc,
    /// A free of an earlier accepted allocation.
    Free,
}

/// One allocation or free, with the live totals it left behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryEvent {
    /// Nanoseconds since the timeline started.
    pub t_ns: u64,
    /// Allocation or free.
    pub kind: EventKind,
    /// Where the memory lives.
    pub device: Device,
    /// The allocation's category.
    pub category: MemoryCategory,
    /// The allocation's label (the label at allocation time, also for its free).
    pub label: LabelId,
    /// Size of the allocation.
    pub bytes: u64,
    /// Bytes live in `category` on `device` after the event.
    pub category_live: u64,
    /// Bytes live on `device` after the event.
    pub device_live: u64,
}

/// What a phase mark denotes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MarkKind {
    /// A point in time ([`crate::MemoryTracker::mark`]).
    Instant,
    /// A phase began ([`crate::MemoryTracker::phase`]).
    Begin,
    /// The phase begun by the matching `Begin` ended.
    End,
}

/// A named point or phase boundary on the timeline (`"forward"`, `"optimizer"`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PhaseMark {
    /// Nanoseconds since the timeline started.
    pub t_ns: u64,
    /// The phase's name.
    pub name: String,
    /// Point, begin or end.
    pub kind: MarkKind,
}

/// Allocations live when recording started, grouped by (device, category, label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveGroup {
    /// Where they live.
    pub device: Device,
    /// Their category.
    pub category: MemoryCategory,
    /// Their label.
    pub label: LabelId,
    /// Bytes live in the group.
    pub bytes: u64,
    /// Allocations live in the group.
    pub count: u64,
}

/// An allocation a budget refused while the timeline was recording (the out-of-memory moment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Nanoseconds since the timeline started.
    pub t_ns: u64,
    /// The device whose budget refused it.
    pub device: Device,
    /// The refused allocation's category.
    pub category: MemoryCategory,
    /// The refused allocation's label.
    pub label: LabelId,
    /// Bytes requested.
    pub bytes: u64,
    /// Bytes live on `device` at the refusal.
    pub device_live: u64,
    /// The budget that refused it.
    pub budget: u64,
}

/// A recorded timeline. Events are in the tracker's order (the order its lock was taken), so
/// replaying them reproduces every live total the tracker saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// Live bytes per category on each device when recording started.
    pub start_live: Vec<(Device, PerCategory<u64>)>,
    /// What was live when recording started, by (device, category, label); their bytes add
    /// up to `start_live` (empty for a timeline built by hand, which then only has the
    /// per-category totals).
    pub start_groups: Vec<LiveGroup>,
    /// Allocations and frees, in order.
    pub events: Vec<MemoryEvent>,
    /// Phase marks, in order.
    pub marks: Vec<PhaseMark>,
    /// Allocations refused by a budget, in order (they change no live total).
    pub refusals: Vec<Refusal>,
    /// Events (and refusals) not recorded because the timeline reached its capacity (recording
    /// stops at the capacity rather than wrapping, so what was recorded stays a consistent
    /// prefix).
    pub dropped_events: u64,
}

impl Timeline {
    /// Every device that appears in the timeline, in first-seen order.
    pub fn devices(&self) -> Vec<Device> {
        let mut devices: Vec<Device> = Vec::new();
        let seen = self
            .start_live
            .iter()
            .map(|(d, _)| *d)
            .chain(self.events.iter().map(|e| e.device));
        for d in seen {
            if !devices.contains(&d) {
                devices.push(d);
            }
        }
        devices
    }

    /// The live bytes per category on `device` at the start and after each of its events:
    /// a step function, `(t_ns, live)` holding until the next sample.
    pub fn replay(&self, device: Device) -> Vec<(u64, PerCategory<u64>)> {
        let mut live = self
            .start_live
            .iter()
            .find(|(d, _)| *d == device)
            .map(|(_, l)| *l)
            .unwrap_or_default();
        let mut samples = vec![(0, live)];
        for e in self.events.iter().filter(|e| e.device == device) {
            live[e.category] = e.category_live;
            samples.push((e.t_ns, live));
        }
        samples
    }

    /// The largest total live bytes on `device` over the recording.
    pub fn peak(&self, device: Device) -> u64 {
        self.replay(device)
            .iter()
            .map(|(_, l)| l.total())
            .max()
            .unwrap_or(0)
    }

    /// Nanoseconds from the start to the last event, mark or refusal.
    pub fn duration_ns(&self) -> u64 {
        let last_event = self.events.last().map_or(0, |e| e.t_ns);
        let last_mark = self.marks.last().map_or(0, |m| m.t_ns);
        let last_refusal = self.refusals.last().map_or(0, |r| r.t_ns);
        last_event.max(last_mark).max(last_refusal)
    }

    /// The events of `device`, in order.
    pub fn device_events(&self, device: Device) -> impl Iterator<Item = &MemoryEvent> + '_ {
        self.events.iter().filter(move |e| e.device == device)
    }

    /// The index (0-based, among `device`'s events) of the event after which `device` first
    /// reached its peak over the recording; `None` when the peak is the starting state.
    pub fn peak_event_index(&self, device: Device) -> Option<usize> {
        let start: u64 = self
            .start_live
            .iter()
            .find(|(d, _)| *d == device)
            .map_or(0, |(_, l)| l.total());
        let mut best = start;
        let mut at = None;
        for (i, e) in self.device_events(device).enumerate() {
            if e.device_live > best {
                best = e.device_live;
                at = Some(i);
            }
        }
        at
    }
}
