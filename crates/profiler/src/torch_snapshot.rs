//! Export a [`Timeline`] in the format of PyTorch's `torch.cuda.memory._snapshot()` — a pickled
//! dict of allocator `segments` and per-device `device_traces` — so that PyTorch's memory
//! viewer (<https://pytorch.org/memory_viz>, or `torch.cuda._memory_viz.trace_plot` /
//! `segment_plot` / `segsum` / `trace`) opens a headroom run like a PyTorch one.
//!
//! # How the tracker's events become allocator state
//!
//! headroom's allocations have no device addresses, so addresses are synthesised: per device,
//! one segment starting at a fixed base, carved by a best-fit allocator with 512-byte blocks
//! (as PyTorch's caching allocator rounds), reusing freed ranges, so that live blocks never
//! overlap and the same timeline always gives the same addresses. Each block's `size` is the
//! rounded size and `requested_size` the exact bytes; trace entries carry the exact bytes, so
//! the viewer's "Active Memory Timeline" stacks to exactly the tracker's live totals.
//!
//! A free in the timeline is matched to an earlier allocation with the same (category, label,
//! size), which is all the timeline records — such allocations are interchangeable for every
//! report. Frees of allocations made before recording started become blocks live at the start
//! (the viewer shows them as "initially allocated"), and bytes that were live at the start and
//! never freed become one block per (category, label) group live at the start
//! ([`Timeline::start_groups`]; for a hand-built timeline without groups, one block per
//! category labelled `(live before recording)`).
//!
//! Each entry's `frames` is one frame naming what the allocation was for:
//! `{"filename": <category>, "line": 0, "name": <label>}` (the viewer prints it as
//! `activations:0:block 3 / attn`), and `category` is set on every alloc/free entry so the
//! viewer colours and lists the categories. The phases open at the time (`"forward"`,
//! `"backward"`, nested with ` / `) are in `user_metadata`. Budget refusals become `oom`
//! entries (with `device_free` = budget − live). The trace ends with a `snapshot` entry, as a
//! real snapshot's does; it carries the category `"unknown"`, which the viewer expects among
//! the categories whenever any are given.
//!
//! Device indices: a CUDA device keeps its ordinal; the host (`cpu`) comes after the highest
//! CUDA ordinal in the timeline (index 0 in a CPU-only run). [`TorchSnapshotInfo::devices`]
//! lists the mapping.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;

use headroom_tensor::{Device, MemoryCategory};

use crate::error::ProfilerError;
use crate::label::LabelId;
use crate::per_category::category_index;
use crate::pickle::{dict, Pickler, Value};
use crate::timeline::{EventKind, MarkKind, Timeline};

/// Block granularity of the synthesised allocator (PyTorch's caching allocator rounds to 512
/// bytes).
pub const BLOCK_ALIGN: u64 = 512;
/// Segments are rounded up to this size (PyTorch's large-segment granularity).
const SEGMENT_ALIGN: u64 = 2 << 20;
/// Address of device index 0's segment; index `i` starts `i` TiB above it.
const BASE_ADDRESS: u64 = 0x7f00_0000_0000;
const DEVICE_STRIDE: u64 = 1 << 40;
/// Largest device index a snapshot may have.
const MAX_DEVICE_INDEX: usize = 1024;
/// Label of the blocks that stand for bytes live before recording and never freed.
pub const BEFORE_RECORDING: &str = "(live before recording)";

/// What to export.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TorchSnapshotOptions {
    /// Keep only the last `n` trace entries per device, like
    /// `torch.cuda.memory._record_memory_history(max_entries=n)` (the viewer slows down past a
    /// few hundred thousand entries). `None` keeps every entry. The segments still show the
    /// complete state at the snapshot's end.
    pub max_entries: Option<usize>,
    /// End each device's snapshot at the moment it first reached its peak: the trace stops at
    /// the allocation that reached it, and the segments show what was live then (largest
    /// first in the viewer's segment view). Without it the snapshot ends where the timeline
    /// does.
    pub at_peak: bool,
}

/// What [`write_torch_snapshot`] wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TorchSnapshotInfo {
    /// Each device of the timeline and its index in `device_traces` (the viewer's device
    /// selector).
    pub devices: Vec<(Device, usize)>,
    /// Trace entries written, all devices.
    pub trace_entries: usize,
    /// Trace entries left out by [`TorchSnapshotOptions::max_entries`].
    pub trimmed_entries: usize,
    /// Active blocks in the segments (allocations live at the snapshot's end).
    pub live_blocks: usize,
}

/// The device index each of `devices` gets in the snapshot (see the module documentation).
pub fn torch_device_indices(devices: &[Device]) -> Vec<(Device, usize)> {
    let max_cuda = devices
        .iter()
        .filter_map(|d| match d {
            Device::Cuda(n) => Some(*n),
            Device::Cpu => None,
        })
        .max();
    let cpu_index = max_cuda.map_or(0, |m| m.saturating_add(1));
    devices
        .iter()
        .map(|d| {
            (
                *d,
                match d {
                    Device::Cuda(n) => *n,
                    Device::Cpu => cpu_index,
                },
            )
        })
        .collect()
}

/// The snapshot of `timeline` as pickle bytes (see [`write_torch_snapshot`]).
pub fn torch_snapshot(
    timeline: &Timeline,
    options: &TorchSnapshotOptions,
) -> Result<Vec<u8>, ProfilerError> {
    let mut out = Vec::new();
    write_torch_snapshot(timeline, options, &mut out)?;
    Ok(out)
}

/// Write `timeline` as a pickled `torch.cuda.memory._snapshot()` dict to `writer` (open the
/// file at <https://pytorch.org/memory_viz>). Streams the trace: memory use is proportional to
/// the number of events, not to the pickle's size. Wrap files in a `BufWriter`.
///
/// ```
/// use std::sync::Arc;
/// use headroom_profiler::{label, torch_snapshot, MemoryTracker, TorchSnapshotOptions};
/// use headroom_tensor::{Backend, Cpu, DType, MemoryCategory};
///
/// let tracker = Arc::new(MemoryTracker::new());
/// let cpu = Cpu::new().with_alloc_hook(tracker.clone());
/// tracker.start_timeline();
/// {
///     let _acts = MemoryCategory::Activations.enter();
///     let _l = label("block 0");
///     let _saved = cpu.zeros([1024], DType::F32).unwrap();
/// }
/// let timeline = tracker.stop_timeline().unwrap();
/// let bytes = torch_snapshot(&timeline, &TorchSnapshotOptions::default()).unwrap();
/// assert_eq!(&bytes[..2], b"\x80\x04"); // pickle protocol 4
/// ```
pub fn write_torch_snapshot(
    timeline: &Timeline,
    options: &TorchSnapshotOptions,
    writer: impl Write,
) -> Result<TorchSnapshotInfo, ProfilerError> {
    let mut devices = timeline.devices();
    for r in &timeline.refusals {
        if !devices.contains(&r.device) {
            devices.push(r.device);
        }
    }
    let indices = torch_device_indices(&devices);
    // `device_traces` has one list per index up to the largest, so an absurd ordinal would
    // mean millions of empty lists.
    if let Some((device, index)) = indices.iter().find(|(_, i)| *i > MAX_DEVICE_INDEX) {
        return Err(ProfilerError::InvalidConfig {
            field: "device",
            reason: format!(
                "{device} would be device index {index} (more than {MAX_DEVICE_INDEX})"
            ),
        });
    }
    let phases = PhasePaths::new(timeline);
    let mut plans = Vec::with_capacity(indices.len());
    for (device, index) in &indices {
        plans.push(plan_device(timeline, *device, *index, options, &phases)?);
    }
    let trace_count = indices.iter().map(|(_, i)| i.saturating_add(1)).max();
    let info = TorchSnapshotInfo {
        devices: indices,
        trace_entries: plans.iter().map(|p| p.entries.len()).sum(),
        trimmed_entries: plans.iter().map(|p| p.trimmed).sum(),
        live_blocks: plans.iter().map(|p| p.live.len()).sum(),
    };
    let names = Names::new(&plans);
    let overflowed = timeline.dropped_events > 0 || info.trimmed_entries > 0;

    let mut p = Pickler::new(writer)?;
    let mut top = p.begin_dict()?;
    p.dict_item(&mut top, "segments", |p| {
        p.list_from(
            plans
                .iter()
                .filter(|plan| plan.extent > 0)
                .map(|plan| Ok(segment_value(plan, &names))),
        )
    })?;
    p.dict_item(&mut top, "device_traces", |p| {
        let mut traces = p.begin_list()?;
        for index in 0..trace_count.unwrap_or(0) {
            p.list_item(&mut traces, |p| {
                let entries = plans
                    .iter()
                    .find(|plan| plan.index == index)
                    .map_or(&[][..], |plan| &plan.entries[..]);
                p.list_from(entries.iter().map(|e| Ok(entry_value(e, &names, &phases))))
            })?;
        }
        p.end_list(traces)
    })?;
    p.dict_item(&mut top, "allocator_settings", |p| {
        p.value(&dict([
            ("producer", Value::from("headroom-profiler")),
            (
                "trace_alloc_max_entries",
                Value::Int(options.max_entries.map_or(-1, |n| n as i128)),
            ),
            ("trace_alloc_overflowed", Value::Bool(overflowed)),
            ("block_align", Value::from(BLOCK_ALIGN)),
        ]))
    })?;
    p.end_dict(top)?;
    p.finish()?;
    Ok(info)
}

/// Whose allocation a block or entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Owner {
    Label(LabelId),
    /// Live before recording, never freed.
    Before,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    Oom { device_free: u64 },
    Snapshot,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    action: Action,
    addr: u64,
    size: u64,
    t_us: u64,
    category: Option<MemoryCategory>,
    owner: Owner,
    /// Index into [`PhasePaths::paths`] of the phases open at the time.
    phase: Option<usize>,
}

#[derive(Clone, Copy, Debug)]
struct Block {
    size: u64,
    requested: u64,
    category: MemoryCategory,
    owner: Owner,
}

/// One device's part of the snapshot.
struct DevicePlan {
    index: usize,
    base: u64,
    /// Segment size (0: no segment).
    extent: u64,
    /// Blocks live at the end, by offset from `base`.
    live: BTreeMap<u64, Block>,
    entries: Vec<Entry>,
    trimmed: usize,
}

/// Best-fit allocator over one segment's offsets, with coalescing of freed ranges.
#[derive(Default)]
struct Arena {
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    top: u64,
    high_water: u64,
}

impl Arena {
    fn alloc(&mut self, size: u64) -> Result<u64, ProfilerError> {
        if let Some(&(len, offset)) = self.by_size.range((size, 0)..).next() {
            self.by_size.remove(&(len, offset));
            self.by_offset.remove(&offset);
            if len > size {
                self.insert_free(offset + size, len - size);
            }
            return Ok(offset);
        }
        let offset = self.top;
        self.top = offset.checked_add(size).ok_or(ProfilerError::Overflow {
            what: "synthesised segment",
        })?;
        self.high_water = self.high_water.max(self.top);
        Ok(offset)
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
    }

    fn free(&mut self, mut offset: u64, mut len: u64) {
        // Merge with the free range just below and just above.
        if let Some((&lo, &lo_len)) = self.by_offset.range(..offset).next_back() {
            if lo + lo_len == offset {
                self.by_offset.remove(&lo);
                self.by_size.remove(&(lo_len, lo));
                offset = lo;
                len += lo_len;
            }
        }
        let end = offset + len;
        if let Some(&hi_len) = self.by_offset.get(&end) {
            self.by_offset.remove(&end);
            self.by_size.remove(&(hi_len, end));
            len += hi_len;
        }
        if offset + len == self.top {
            self.top = offset;
        } else {
            self.insert_free(offset, len);
        }
    }
}

/// `base + offset`, or an overflow error for absurd sizes.
fn address(base: u64, offset: u64) -> Result<u64, ProfilerError> {
    base.checked_add(offset).ok_or(ProfilerError::Overflow {
        what: "synthesised address",
    })
}

fn block_size(bytes: u64) -> Result<u64, ProfilerError> {
    bytes
        .max(1)
        .checked_next_multiple_of(BLOCK_ALIGN)
        .ok_or(ProfilerError::Overflow {
            what: "synthesised block",
        })
}

/// The phases open at each moment, as ` / `-joined paths.
struct PhasePaths {
    /// (time the path starts to hold, index into `paths` or `None` when no phase is open).
    changes: Vec<(u64, Option<usize>)>,
    paths: Vec<String>,
}

impl PhasePaths {
    fn new(timeline: &Timeline) -> Self {
        let mut open: Vec<&str> = Vec::new();
        let mut paths: Vec<String> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut changes = Vec::new();
        for m in &timeline.marks {
            match m.kind {
                MarkKind::Instant => continue,
                MarkKind::Begin => open.push(&m.name),
                MarkKind::End => {
                    if let Some(i) = open.iter().rposition(|n| *n == m.name) {
                        open.remove(i);
                    } else {
                        continue;
                    }
                }
            }
            let current = if open.is_empty() {
                None
            } else {
                let path = open.join(" / ");
                let next = paths.len();
                let i = *index.entry(path.clone()).or_insert(next);
                if i == next {
                    paths.push(path);
                }
                Some(i)
            };
            changes.push((m.t_ns, current));
        }
        PhasePaths { changes, paths }
    }

    /// The phase path in force at `t_ns` (a change at exactly `t_ns` counts).
    fn at(&self, t_ns: u64) -> Option<usize> {
        let after = self.changes.partition_point(|(t, _)| *t <= t_ns);
        after.checked_sub(1).and_then(|i| self.changes[i].1)
    }
}

fn plan_device(
    timeline: &Timeline,
    device: Device,
    index: usize,
    options: &TorchSnapshotOptions,
    phases: &PhasePaths,
) -> Result<DevicePlan, ProfilerError> {
    let base = u64::try_from(index)
        .ok()
        .and_then(|i| i.checked_mul(DEVICE_STRIDE))
        .and_then(|o| o.checked_add(BASE_ADDRESS))
        .ok_or(ProfilerError::Overflow {
            what: "synthesised address",
        })?;
    let mut events: Vec<_> = timeline.device_events(device).collect();
    let mut end_ns = timeline.duration_ns();
    if options.at_peak {
        let keep = timeline.peak_event_index(device).map_or(0, |i| i + 1);
        events.truncate(keep);
        end_ns = events.last().map_or(0, |e| e.t_ns);
    }

    // Which frees have no allocation before them in the recording: their memory was live
    // when recording started.
    type Key = (MemoryCategory, LabelId, u64);
    let mut outstanding: HashMap<Key, usize> = HashMap::new();
    let mut unmatched = vec![false; events.len()];
    for (i, e) in events.iter().enumerate() {
        let key = (e.category, e.label, e.bytes);
        match e.kind {
            EventKind::Alloc => *outstanding.entry(key).or_default() += 1,
            EventKind::Free => match outstanding.get_mut(&key) {
                Some(n) if *n > 0 => *n -= 1,
                _ => unmatched[i] = true,
            },
        }
    }

    let mut arena = Arena::default();
    let mut live: BTreeMap<u64, Block> = BTreeMap::new();
    let mut by_key: HashMap<Key, Vec<u64>> = HashMap::new();
    let mut before: HashMap<Key, Vec<u64>> = HashMap::new();
    let mut before_bytes = [0u64; MemoryCategory::ALL.len()];
    for (e, _) in events.iter().zip(&unmatched).filter(|(_, u)| **u) {
        let size = block_size(e.bytes)?;
        let offset = arena.alloc(size)?;
        live.insert(
            offset,
            Block {
                size,
                requested: e.bytes,
                category: e.category,
                owner: Owner::Label(e.label),
            },
        );
        before
            .entry((e.category, e.label, e.bytes))
            .or_default()
            .push(offset);
        let slot = &mut before_bytes[category_index(e.category)];
        *slot = slot.saturating_add(e.bytes);
    }
    // Bytes live at the start that the recording never frees: one block per (category,
    // label) group the tracker listed, and one per category for whatever no group covers.
    let mut unmatched_bytes: HashMap<(MemoryCategory, LabelId), u64> = HashMap::new();
    for (e, _) in events.iter().zip(&unmatched).filter(|(_, u)| **u) {
        let slot = unmatched_bytes.entry((e.category, e.label)).or_default();
        *slot = slot.saturating_add(e.bytes);
    }
    let mut covered = before_bytes;
    for g in timeline.start_groups.iter().filter(|g| g.device == device) {
        let freed = unmatched_bytes
            .get(&(g.category, g.label))
            .copied()
            .unwrap_or(0);
        let rest = g.bytes.saturating_sub(freed);
        if rest > 0 {
            let size = block_size(rest)?;
            let offset = arena.alloc(size)?;
            live.insert(
                offset,
                Block {
                    size,
                    requested: rest,
                    category: g.category,
                    owner: Owner::Label(g.label),
                },
            );
            let slot = &mut covered[category_index(g.category)];
            *slot = slot.saturating_add(rest);
        }
    }
    if let Some((_, start)) = timeline.start_live.iter().find(|(d, _)| *d == device) {
        for (category, bytes) in start.iter() {
            let rest = bytes.saturating_sub(covered[category_index(category)]);
            if rest > 0 {
                let size = block_size(rest)?;
                let offset = arena.alloc(size)?;
                live.insert(
                    offset,
                    Block {
                        size,
                        requested: rest,
                        category,
                        owner: Owner::Before,
                    },
                );
            }
        }
    }

    let mut refusals = timeline
        .refusals
        .iter()
        .filter(|r| r.device == device && (!options.at_peak || r.t_ns <= end_ns))
        .peekable();
    let mut entries: Vec<Entry> = Vec::with_capacity(events.len() * 3 / 2 + 1);
    let mut push_refusals_until = |t_ns: u64, entries: &mut Vec<Entry>, inclusive: bool| {
        while let Some(r) = refusals.next_if(|r| r.t_ns < t_ns || (inclusive && r.t_ns <= t_ns)) {
            entries.push(Entry {
                action: Action::Oom {
                    device_free: r.budget.saturating_sub(r.device_live),
                },
                addr: r.budget.saturating_sub(r.device_live),
                size: r.bytes,
                t_us: r.t_ns / 1000,
                category: Some(r.category),
                owner: Owner::Label(r.label),
                phase: phases.at(r.t_ns),
            });
        }
    };
    for (e, was_before) in events.iter().zip(&unmatched) {
        push_refusals_until(e.t_ns, &mut entries, false);
        let key = (e.category, e.label, e.bytes);
        let entry = |action, addr| Entry {
            action,
            addr,
            size: e.bytes,
            t_us: e.t_ns / 1000,
            category: Some(e.category),
            owner: Owner::Label(e.label),
            phase: phases.at(e.t_ns),
        };
        match e.kind {
            EventKind::Alloc => {
                let size = block_size(e.bytes)?;
                let offset = arena.alloc(size)?;
                live.insert(
                    offset,
                    Block {
                        size,
                        requested: e.bytes,
                        category: e.category,
                        owner: Owner::Label(e.label),
                    },
                );
                by_key.entry(key).or_default().push(offset);
                entries.push(entry(Action::Alloc, address(base, offset)?));
            }
            EventKind::Free => {
                let pool = if *was_before {
                    &mut before
                } else {
                    &mut by_key
                };
                // Matched above, so an address is waiting; a miss would mean the two passes
                // disagree, and the free is then left out rather than invented.
                let Some(offset) = pool.get_mut(&key).and_then(Vec::pop) else {
                    continue;
                };
                if let Some(block) = live.remove(&offset) {
                    arena.free(offset, block.size);
                }
                let addr = address(base, offset)?;
                entries.push(entry(Action::FreeRequested, addr));
                entries.push(entry(Action::FreeCompleted, addr));
            }
        }
    }
    push_refusals_until(end_ns, &mut entries, true);
    if !entries.is_empty() || !live.is_empty() {
        entries.push(Entry {
            action: Action::Snapshot,
            addr: 0,
            size: 0,
            t_us: end_ns / 1000,
            category: None,
            owner: Owner::Before,
            phase: None,
        });
    }

    let mut trimmed = 0;
    if let Some(max) = options.max_entries {
        if entries.len() > max {
            trimmed = entries.len() - max;
            entries.drain(..trimmed);
        }
    }
    let extent = if arena.high_water == 0 {
        0
    } else {
        arena
            .high_water
            .checked_next_multiple_of(SEGMENT_ALIGN)
            .ok_or(ProfilerError::Overflow {
                what: "synthesised segment",
            })?
    };
    // Every address in the segment (blocks are written as base + offset < base + extent).
    address(base, extent)?;
    Ok(DevicePlan {
        index,
        base,
        extent,
        live,
        entries,
        trimmed,
    })
}

/// Label names, resolved once (each [`LabelId::name`] takes the interner's lock).
struct Names(HashMap<LabelId, String>);

impl Names {
    fn new(plans: &[DevicePlan]) -> Self {
        let mut names = HashMap::new();
        let owners = plans.iter().flat_map(|p| {
            p.live
                .values()
                .map(|b| b.owner)
                .chain(p.entries.iter().map(|e| e.owner))
        });
        for owner in owners {
            if let Owner::Label(id) = owner {
                names.entry(id).or_insert_with(|| id.to_string());
            }
        }
        Names(names)
    }

    fn of(&self, owner: Owner) -> &str {
        match owner {
            Owner::Before => BEFORE_RECORDING,
            Owner::Label(id) => self.0.get(&id).map_or("(unlabelled)", String::as_str),
        }
    }
}

fn frames(category: Option<MemoryCategory>, owner: Owner, names: &Names) -> Value {
    match category {
        None => Value::List(Vec::new()),
        Some(category) => Value::List(vec![dict([
            ("filename", Value::from(category.name())),
            ("line", Value::Int(0)),
            ("name", Value::from(names.of(owner))),
        ])]),
    }
}

fn segment_value(plan: &DevicePlan, names: &Names) -> Value {
    let mut blocks = Vec::with_capacity(plan.live.len() * 2 + 1);
    let (mut allocated, mut requested) = (0u64, 0u64);
    let mut cursor = 0u64;
    let inactive = |offset: u64, len: u64| {
        dict([
            ("address", Value::from(plan.base + offset)),
            ("size", Value::from(len)),
            ("requested_size", Value::Int(0)),
            ("state", Value::from("inactive")),
            ("frames", Value::List(Vec::new())),
        ])
    };
    for (&offset, block) in &plan.live {
        if offset > cursor {
            blocks.push(inactive(cursor, offset - cursor));
        }
        blocks.push(dict([
            ("address", Value::from(plan.base + offset)),
            ("size", Value::from(block.size)),
            ("requested_size", Value::from(block.requested)),
            ("state", Value::from("active_allocated")),
            ("frames", frames(Some(block.category), block.owner, names)),
        ]));
        allocated += block.size;
        requested += block.requested;
        cursor = offset + block.size;
    }
    if plan.extent > cursor {
        blocks.push(inactive(cursor, plan.extent - cursor));
    }
    dict([
        ("device", Value::Int(plan.index as i128)),
        ("address", Value::from(plan.base)),
        ("total_size", Value::from(plan.extent)),
        ("allocated_size", Value::from(allocated)),
        ("active_size", Value::from(allocated)),
        ("requested_size", Value::from(requested)),
        ("stream", Value::Int(0)),
        ("segment_type", Value::from("large")),
        (
            "segment_pool_id",
            Value::Tuple(vec![Value::Int(0), Value::Int(0)]),
        ),
        ("is_expandable", Value::Bool(false)),
        ("frames", Value::List(Vec::new())),
        ("blocks", Value::List(blocks)),
    ])
}

fn entry_value(e: &Entry, names: &Names, phases: &PhasePaths) -> Value {
    let action = match e.action {
        Action::Alloc => "alloc",
        Action::FreeRequested => "free_requested",
        Action::FreeCompleted => "free_completed",
        Action::Oom { .. } => "oom",
        Action::Snapshot => "snapshot",
    };
    let mut items = vec![
        (Value::from("action"), Value::from(action)),
        (Value::from("addr"), Value::from(e.addr)),
        (Value::from("size"), Value::from(e.size)),
        (Value::from("stream"), Value::Int(0)),
        (Value::from("time_us"), Value::from(e.t_us)),
        (Value::from("frames"), frames(e.category, e.owner, names)),
        (
            Value::from("category"),
            Value::from(e.category.map_or("unknown", MemoryCategory::name)),
        ),
    ];
    if let Action::Oom { device_free } = e.action {
        items.push((Value::from("device_free"), Value::from(device_free)));
    }
    if let Some(path) = e.phase.and_then(|i| phases.paths.get(i)) {
        items.push((Value::from("user_metadata"), Value::from(path.as_str())));
    }
    Value::Dict(items)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use headroom_tensor::{Backend, Cpu, DType};

    use super::*;
    use crate::pickle::decode::decode_for_viewer;
    use crate::{label, MemoryTracker, OutOfBudget};

    /// A tracked run: weights allocated before recording (some freed while recording), two
    /// steps of forward/backward with labelled activations, a refused allocation, and an end
    /// state with memory live.
    fn recorded_run() -> (Arc<MemoryTracker>, Timeline) {
        let tracker = Arc::new(MemoryTracker::new());
        let cpu = Cpu::new().with_alloc_hook(tracker.clone());
        let weights: Vec<_> = {
            let _c = MemoryCategory::Parameters.enter();
            let _l = label("weights");
            (0..3)
                .map(|_| cpu.zeros([1000], DType::F32).unwrap())
                .collect()
        };
        let kept = {
            let _c = MemoryCategory::Other.enter();
            cpu.zeros([77], DType::U8).unwrap()
        };
        tracker.start_timeline();
        tracker.reset_peak();
        let mut weights = weights;
        drop(weights.pop()); // freed while recording: live at the start
        let mut grads = Vec::new();
        for step in 0..2 {
            tracker.mark(&format!("step {step}"));
            let mut saved = Vec::new();
            {
                let _p = tracker.phase("forward");
                let _c = MemoryCategory::Activations.enter();
                for block in 0..3 {
                    let _b = label(&format!("block {block}"));
                    let _a = label("attn");
                    saved.push(cpu.zeros([600 + 100 * block], DType::F32).unwrap());
                    let _tmp = {
                        let _w = MemoryCategory::Workspace.enter();
                        cpu.zeros([33], DType::F32).unwrap()
                    };
                }
            }
            {
                let _p = tracker.phase("backward");
                while let Some(s) = saved.pop() {
                    let _c = MemoryCategory::Gradients.enter();
                    let _l = label("grad");
                    grads.push(cpu.zeros([200], DType::F32).unwrap());
                    drop(s);
                }
            }
        }
        tracker.set_budget(Device::Cpu, Some(tracker.live_bytes(Device::Cpu) + 100));
        {
            let _c = MemoryCategory::Activations.enter();
            let _l = label("too big");
            let err = cpu.zeros([1000], DType::F32).unwrap_err();
            assert!(OutOfBudget::find(&err).is_some());
        }
        let timeline = tracker.stop_timeline().unwrap();
        drop((weights, kept, grads));
        (tracker, timeline)
    }

    fn ints(v: &Value, key: &str) -> u64 {
        v.get(key)
            .and_then(Value::as_int)
            .and_then(|i| u64::try_from(i).ok())
            .unwrap_or_else(|| panic!("no integer {key} in {v:?}"))
    }

    fn frame_names(v: &Value) -> Vec<String> {
        v.get("frames")
            .and_then(Value::as_list)
            .unwrap_or(&[])
            .iter()
            .map(|f| {
                format!(
                    "{}:{}",
                    f.get("filename").and_then(Value::as_str).unwrap_or("?"),
                    f.get("name").and_then(Value::as_str).unwrap_or("?")
                )
            })
            .collect()
    }

    fn decode_snapshot(timeline: &Timeline, options: &TorchSnapshotOptions) -> Value {
        let bytes = torch_snapshot(timeline, options).unwrap();
        decode_for_viewer(&bytes).unwrap()
    }

    /// Check one segment's structure and return its active blocks as (address, block).
    fn check_segment(seg: &Value) -> Vec<(u64, &Value)> {
        assert_eq!(
            seg.keys(),
            [
                "device",
                "address",
                "total_size",
                "allocated_size",
                "active_size",
                "requested_size",
                "stream",
                "segment_type",
                "segment_pool_id",
                "is_expandable",
                "frames",
                "blocks"
            ]
        );
        assert_eq!(
            seg.get("segment_pool_id"),
            Some(&Value::Tuple(vec![Value::Int(0), Value::Int(0)]))
        );
        let mut addr = ints(seg, "address");
        let (mut allocated, mut requested) = (0, 0);
        let mut active = Vec::new();
        for b in seg.get("blocks").and_then(Value::as_list).unwrap() {
            assert_eq!(
                b.keys(),
                ["address", "size", "requested_size", "state", "frames"]
            );
            // Blocks tile the segment: the viewer derives addresses from the sizes.
            assert_eq!(ints(b, "address"), addr);
            let size = ints(b, "size");
            assert!(size > 0 && size.is_multiple_of(BLOCK_ALIGN));
            match b.get("state").and_then(Value::as_str) {
                Some("active_allocated") => {
                    allocated += size;
                    requested += ints(b, "requested_size");
                    assert!(ints(b, "requested_size") <= size);
                    assert_eq!(frame_names(b).len(), 1);
                    active.push((addr, b));
                }
                Some("inactive") => assert_eq!(ints(b, "requested_size"), 0),
                other => panic!("state {other:?}"),
            }
            addr += size;
        }
        assert_eq!(addr - ints(seg, "address"), ints(seg, "total_size"));
        assert_eq!(ints(seg, "allocated_size"), allocated);
        assert_eq!(ints(seg, "active_size"), allocated);
        assert_eq!(ints(seg, "requested_size"), requested);
        active
    }

    #[test]
    fn snapshot_structure_and_exact_totals() {
        let (tracker, timeline) = recorded_run();
        let snap = decode_snapshot(&timeline, &TorchSnapshotOptions::default());
        assert_eq!(
            snap.keys(),
            ["segments", "device_traces", "allocator_settings"]
        );
        let segments = snap.get("segments").and_then(Value::as_list).unwrap();
        assert_eq!(segments.len(), 1);
        assert_eq!(ints(&segments[0], "device"), 0);
        let active = check_segment(&segments[0]);
        let traces = snap.get("device_traces").and_then(Value::as_list).unwrap();
        assert_eq!(traces.len(), 1);
        let trace = traces[0].as_list().unwrap();

        // Replay the trace from the blocks live at its start (the segments' end state, minus
        // what the trace allocated, plus what it freed without allocating).
        let mut live: BTreeMap<u64, (u64, Vec<String>)> = BTreeMap::new();
        for (addr, b) in &active {
            live.insert(*addr, (ints(b, "requested_size"), frame_names(b)));
        }
        for e in trace.iter().rev() {
            match e.get("action").and_then(Value::as_str).unwrap() {
                "alloc" => {
                    live.remove(&ints(e, "addr"));
                }
                "free_completed" => {
                    live.insert(ints(e, "addr"), (ints(e, "size"), frame_names(e)));
                }
                _ => {}
            }
        }
        let start: u64 = live.values().map(|(s, _)| s).sum();
        let expected_start: u64 = timeline.start_live[0].1.total();
        assert_eq!(start, expected_start, "live at the start");
        let mut total = start;
        let mut peak = total;
        let mut last_time = 0;
        let mut actions = Vec::new();
        for e in trace {
            let keys = e.keys();
            for k in [
                "action", "addr", "size", "stream", "time_us", "frames", "category",
            ] {
                assert!(keys.contains(&k), "{k} missing from {e:?}");
            }
            let t = ints(e, "time_us");
            assert!(t >= last_time, "time goes back");
            last_time = t;
            let action = e.get("action").and_then(Value::as_str).unwrap();
            actions.push(action.to_owned());
            let (addr, size) = (ints(e, "addr"), ints(e, "size"));
            match action {
                "alloc" => {
                    // No overlap with any live block (sizes rounded as in the segment).
                    let end = addr + size.max(1).next_multiple_of(BLOCK_ALIGN);
                    for (a, (s, _)) in &live {
                        let a_end = a + s.max(&1).next_multiple_of(BLOCK_ALIGN);
                        assert!(end <= *a || a_end <= addr, "overlapping blocks");
                    }
                    live.insert(addr, (size, frame_names(e)));
                    total += size;
                    peak = peak.max(total);
                }
                "free_requested" => assert_eq!(live.get(&addr).map(|l| l.0), Some(size)),
                "free_completed" => {
                    let (s, frames) = live.remove(&addr).expect("free of a live block");
                    assert_eq!((s, frames), (size, frame_names(e)));
                    total -= size;
                }
                "oom" => {
                    assert_eq!(ints(e, "device_free"), 100);
                    assert_eq!(size, 4000);
                    assert_eq!(frame_names(e), ["activations:too big"]);
                }
                "snapshot" => {
                    assert_eq!(e.get("category").and_then(Value::as_str), Some("unknown"))
                }
                other => panic!("unexpected action {other}"),
            }
        }
        assert_eq!(actions.last().map(String::as_str), Some("snapshot"));
        assert_eq!(actions.iter().filter(|a| *a == "oom").count(), 1);
        // The replay ends in the segments' state and reproduces the tracker's numbers.
        let end: BTreeMap<u64, u64> = active
            .iter()
            .map(|(a, b)| (*a, ints(b, "requested_size")))
            .collect();
        assert_eq!(end, live.iter().map(|(a, (s, _))| (*a, *s)).collect());
        assert_eq!(peak, timeline.peak(Device::Cpu));
        assert_eq!(peak, tracker.peak_bytes(Device::Cpu));
        assert_eq!(
            total,
            timeline.replay(Device::Cpu).last().unwrap().1.total()
        );
        // Phases travel as user metadata; labels and categories as frames.
        assert!(trace
            .iter()
            .any(|e| e.get("user_metadata") == Some(&Value::from("backward"))));
        assert!(trace
            .iter()
            .any(|e| frame_names(e) == ["activations:block 2 / attn"]));
        // What was live before recording keeps its labels.
        let mut end_named: BTreeMap<String, u64> = BTreeMap::new();
        for (_, b) in &active {
            *end_named.entry(frame_names(b).remove(0)).or_default() += ints(b, "requested_size");
        }
        assert_eq!(end_named.get("params:weights"), Some(&8000));
        assert_eq!(end_named.get("other:(unlabelled)"), Some(&77));
        assert!(!end_named.keys().any(|k| k.ends_with(BEFORE_RECORDING)));
        let settings = snap.get("allocator_settings").unwrap();
        assert_eq!(
            settings.get("trace_alloc_overflowed"),
            Some(&Value::Bool(false))
        );
    }

    #[test]
    fn at_peak_the_largest_live_allocations_are_named() {
        let (tracker, timeline) = recorded_run();
        let stats = tracker.snapshot();
        let at_peak = &stats.device(Device::Cpu).unwrap().peak_entries;
        let snap = decode_snapshot(
            &timeline,
            &TorchSnapshotOptions {
                at_peak: true,
                ..TorchSnapshotOptions::default()
            },
        );
        let segments = snap.get("segments").and_then(Value::as_list).unwrap();
        let active = check_segment(&segments[0]);
        let live_total: u64 = active.iter().map(|(_, b)| ints(b, "requested_size")).sum();
        assert_eq!(live_total, tracker.peak_bytes(Device::Cpu));
        // Bytes per (category, label) among the blocks equal the tracker's composition at the
        // peak, for every labelled entry; the largest ones are there by name.
        let mut by_name: HashMap<String, u64> = HashMap::new();
        for (_, b) in &active {
            *by_name.entry(frame_names(b).remove(0)).or_default() += ints(b, "requested_size");
        }
        for entry in at_peak.iter().filter(|e| e.label.is_some()).take(3) {
            let name = format!(
                "{}:{}",
                entry.category.name(),
                entry.label.as_deref().unwrap_or_default()
            );
            assert_eq!(by_name.get(&name), Some(&entry.bytes), "{name} at the peak");
        }
        assert!(by_name.contains_key("activations:block 2 / attn"));
        // The trace stops at the allocation that reached the peak.
        let trace = snap.get("device_traces").and_then(Value::as_list).unwrap()[0]
            .as_list()
            .unwrap();
        let last_alloc = trace
            .iter()
            .rev()
            .find(|e| e.get("action") == Some(&Value::from("alloc")))
            .unwrap();
        assert_eq!(
            Some(&Value::from("alloc")),
            trace[trace.len() - 2].get("action"),
            "the peak allocation comes right before the snapshot entry"
        );
        assert!(ints(last_alloc, "size") > 0);
    }

    #[test]
    fn trimming_keeps_the_last_entries_and_the_full_state() {
        let (_, timeline) = recorded_run();
        let full = torch_snapshot(&timeline, &TorchSnapshotOptions::default()).unwrap();
        let full = decode_for_viewer(&full).unwrap();
        let mut out = Vec::new();
        let info = write_torch_snapshot(
            &timeline,
            &TorchSnapshotOptions {
                max_entries: Some(10),
                ..TorchSnapshotOptions::default()
            },
            &mut out,
        )
        .unwrap();
        let trimmed = decode_for_viewer(&out).unwrap();
        assert_eq!(info.trace_entries, 10);
        assert!(info.trimmed_entries > 0);
        let trace = |v: &Value| {
            v.get("device_traces").and_then(Value::as_list).unwrap()[0]
                .as_list()
                .unwrap()
                .to_vec()
        };
        let (t_full, t_trimmed) = (trace(&full), trace(&trimmed));
        assert_eq!(&t_full[t_full.len() - 10..], &t_trimmed[..]);
        assert_eq!(full.get("segments"), trimmed.get("segments"));
        assert_eq!(
            trimmed
                .get("allocator_settings")
                .and_then(|s| s.get("trace_alloc_overflowed")),
            Some(&Value::Bool(true))
        );
    }

    #[test]
    fn devices_get_torch_indices() {
        assert_eq!(torch_device_indices(&[Device::Cpu]), [(Device::Cpu, 0)]);
        assert_eq!(
            torch_device_indices(&[Device::Cpu, Device::Cuda(1), Device::Cuda(0)]),
            [(Device::Cpu, 2), (Device::Cuda(1), 1), (Device::Cuda(0), 0)]
        );
        let tracker = Arc::new(MemoryTracker::new());
        let hook: Arc<dyn headroom_tensor::AllocHook> = tracker.clone();
        tracker.start_timeline();
        let _a = headroom_tensor::TrackedAllocation::register(
            Some(&hook),
            1000,
            DType::U8,
            Device::Cuda(1),
        )
        .unwrap();
        let _b =
            headroom_tensor::TrackedAllocation::register(Some(&hook), 10, DType::U8, Device::Cpu)
                .unwrap();
        let timeline = tracker.stop_timeline().unwrap();
        let mut out = Vec::new();
        let info =
            write_torch_snapshot(&timeline, &TorchSnapshotOptions::default(), &mut out).unwrap();
        assert_eq!(info.devices, [(Device::Cuda(1), 1), (Device::Cpu, 2)]);
        assert_eq!(info.live_blocks, 2);
        let snap = decode_for_viewer(&out).unwrap();
        let traces = snap.get("device_traces").and_then(Value::as_list).unwrap();
        assert_eq!(traces.len(), 3);
        assert_eq!(traces[0], Value::List(Vec::new()));
        let segments = snap.get("segments").and_then(Value::as_list).unwrap();
        let devices: Vec<u64> = segments.iter().map(|s| ints(s, "device")).collect();
        assert_eq!(devices, [1, 2]);
        // Distinct address ranges per device.
        assert_ne!(ints(&segments[0], "address"), ints(&segments[1], "address"));
    }

    #[test]
    fn a_timeline_without_groups_keeps_its_starting_bytes() {
        let (_, mut timeline) = recorded_run();
        timeline.start_groups.clear();
        let snap = decode_snapshot(&timeline, &TorchSnapshotOptions::default());
        let segments = snap.get("segments").and_then(Value::as_list).unwrap();
        let active = check_segment(&segments[0]);
        let mut end_named: BTreeMap<String, u64> = BTreeMap::new();
        for (_, b) in &active {
            *end_named.entry(frame_names(b).remove(0)).or_default() += ints(b, "requested_size");
        }
        // The weight freed while recording had its own block; the rest is anonymous.
        assert_eq!(end_named.get("params:(live before recording)"), Some(&8000));
        assert_eq!(end_named.get("other:(live before recording)"), Some(&77));
        let end_total: u64 = end_named.values().sum();
        assert_eq!(
            end_total,
            timeline.replay(Device::Cpu).last().unwrap().1.total()
        );
    }

    /// Replay device `index`'s trace from the state at its start (the segment's blocks minus
    /// what the trace allocated, plus what it freed first) and check, after every entry, that
    /// live blocks never overlap, every free matches a live block, and the live total is the
    /// timeline's; the replay must end in the segment's state.
    fn check_replay(snap: &Value, index: usize, timeline: &Timeline, device: Device) {
        let segment = snap
            .get("segments")
            .and_then(Value::as_list)
            .unwrap()
            .iter()
            .find(|s| ints(s, "device") == index as u64);
        let active = segment.map(check_segment).unwrap_or_default();
        let trace = snap.get("device_traces").and_then(Value::as_list).unwrap()[index]
            .as_list()
            .unwrap();
        let mut live: BTreeMap<u64, u64> = active
            .iter()
            .map(|(a, b)| (*a, ints(b, "requested_size")))
            .collect();
        for e in trace.iter().rev() {
            match e.get("action").and_then(Value::as_str).unwrap() {
                "alloc" => assert!(live.remove(&ints(e, "addr")).is_some()),
                "free_completed" => {
                    assert!(live.insert(ints(e, "addr"), ints(e, "size")).is_none())
                }
                _ => {}
            }
        }
        let expected: Vec<u64> = timeline
            .replay(device)
            .iter()
            .map(|(_, l)| l.total())
            .collect();
        let mut total: u64 = live.values().sum();
        assert_eq!(total, expected[0]);
        // Every block lies inside the device's segment (the viewer's segment view needs it).
        let range = segment.map_or(0..0, |s| {
            ints(s, "address")..ints(s, "address") + ints(s, "total_size")
        });
        let mut step = 0;
        for e in trace {
            let (addr, size) = (ints(e, "addr"), ints(e, "size"));
            let action = e.get("action").and_then(Value::as_str).unwrap();
            if action.starts_with("alloc") || action.starts_with("free") {
                assert!(range.contains(&addr) && addr + size <= range.end);
            }
            match action {
                "alloc" => {
                    let end = addr + size.max(1).next_multiple_of(BLOCK_ALIGN);
                    if let Some((a, s)) = live.range(..end).next_back() {
                        assert!(a + s.max(&1).next_multiple_of(BLOCK_ALIGN) <= addr);
                    }
                    live.insert(addr, size);
                    total += size;
                    step += 1;
                    assert_eq!(total, expected[step]);
                }
                "free_completed" => {
                    assert_eq!(live.remove(&addr), Some(size));
                    total -= size;
                    step += 1;
                    assert_eq!(total, expected[step]);
                }
                _ => {}
            }
        }
        assert_eq!(step + 1, expected.len());
        let end: BTreeMap<u64, u64> = active
            .iter()
            .map(|(a, b)| (*a, ints(b, "requested_size")))
            .collect();
        assert_eq!(end, live);
    }

    proptest::proptest! {
        #[test]
        fn random_runs_replay_exactly(
            before in proptest::collection::vec((0usize..5000, 0usize..7, 0usize..2, 0usize..3), 0..12),
            ops in proptest::collection::vec((0usize..5000, 0usize..7, 0usize..2, 0usize..3, proptest::bool::ANY, 0usize..64), 0..120),
            at_peak in proptest::bool::ANY,
        ) {
            let devices = [Device::Cpu, Device::Cuda(0)];
            let labels = ["", "block 0", "block 1 / attn"];
            let tracker = Arc::new(MemoryTracker::new());
            let hook: Arc<dyn headroom_tensor::AllocHook> = tracker.clone();
            let alloc = |bytes: usize, c: usize, d: usize, l: usize| {
                let _c = MemoryCategory::ALL[c].enter();
                let _l = label(labels[l]);
                headroom_tensor::TrackedAllocation::register(
                    Some(&hook), bytes, DType::U8, devices[d]).unwrap()
            };
            let mut held: Vec<_> = before.iter().map(|&(b, c, d, l)| alloc(b, c, d, l)).collect();
            tracker.start_timeline();
            tracker.reset_peak();
            for &(b, c, d, l, free, pick) in &ops {
                if free && !held.is_empty() {
                    held.swap_remove(pick % held.len());
                } else {
                    held.push(alloc(b, c, d, l));
                }
            }
            let timeline = tracker.stop_timeline().unwrap();
            let options = TorchSnapshotOptions { at_peak, ..TorchSnapshotOptions::default() };
            let bytes = torch_snapshot(&timeline, &options).unwrap();
            let snap = decode_for_viewer(&bytes).unwrap();
            for (device, index) in torch_device_indices(&timeline.devices()) {
                let mut t = timeline.clone();
                if at_peak {
                    // The snapshot ends at the device's peak: compare with that prefix.
                    let keep = t.peak_event_index(device).map_or(0, |i| i + 1);
                    let mut n = 0;
                    t.events.retain(|e| {
                        if e.device != device {
                            return true;
                        }
                        n += 1;
                        n <= keep
                    });
                    proptest::prop_assert_eq!(
                        t.replay(device).last().map(|(_, l)| l.total()),
                        Some(tracker.peak_bytes(device))
                    );
                }
                check_replay(&snap, index, &t, device);
            }
        }
    }

    #[test]
    fn absurd_sizes_are_errors_not_panics() {
        use crate::timeline::MemoryEvent;
        for sizes in [
            vec![u64::MAX],
            vec![1 << 63, 1 << 63],
            vec![u64::MAX - 4096, 4096],
        ] {
            let mut t = Timeline::default();
            let mut live = 0u64;
            for bytes in sizes {
                live = live.saturating_add(bytes);
                t.events.push(MemoryEvent {
                    t_ns: 1,
                    kind: EventKind::Alloc,
                    device: Device::Cuda(0),
                    category: MemoryCategory::Other,
                    label: LabelId::NONE,
                    bytes,
                    category_live: live,
                    device_live: live,
                });
            }
            let result = torch_snapshot(&t, &TorchSnapshotOptions::default());
            assert!(
                matches!(result, Err(ProfilerError::Overflow { .. })),
                "{result:?}"
            );
            // The other reports take the same timeline without panicking.
            crate::validate_chrome_trace(&crate::chrome_trace(&t)).unwrap();
            let svg = crate::stacked_timeline_svg(&t, Device::Cuda(0), &Default::default());
            assert!(svg.ends_with("</svg>\n"));
        }
        let far = [Device::Cuda(usize::MAX)];
        assert_eq!(
            torch_device_indices(&far),
            [(Device::Cuda(usize::MAX), usize::MAX)]
        );
        let mut t = Timeline::default();
        t.start_live.push((Device::Cuda(5000), Default::default()));
        assert!(matches!(
            torch_snapshot(&t, &TorchSnapshotOptions::default()),
            Err(ProfilerError::InvalidConfig { .. })
        ));
    }

    #[test]
    fn empty_timeline_is_an_empty_snapshot() {
        let snap = decode_snapshot(&Timeline::default(), &TorchSnapshotOptions::default());
        assert_eq!(snap.get("segments"), Some(&Value::List(Vec::new())));
        assert_eq!(snap.get("device_traces"), Some(&Value::List(Vec::new())));
    }

    #[test]
    fn arena_reuses_and_coalesces() {
        let mut a = Arena::default();
        let x = a.alloc(512).unwrap();
        let y = a.alloc(1024).unwrap();
        let z = a.alloc(512).unwrap();
        assert_eq!((x, y, z), (0, 512, 1536));
        a.free(x, 512);
        a.free(y, 1024);
        // Coalesced into one 1536-byte hole, reused best-fit.
        assert_eq!(a.alloc(1536).unwrap(), 0);
        a.free(z, 512);
        assert_eq!(a.top, 1536);
        assert_eq!(a.high_water, 2048);
        assert!(a.alloc(u64::MAX).is_err());
    }
}
