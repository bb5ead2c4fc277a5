//! How the tiled kernels are split into parallel tasks, and how backward's partial `dK`/`dV`
//! are summed deterministically.
//!
//! Forward: one task per (batch·head, query tile); tasks own disjoint output rows.
//! Backward: one task per (batch·head, query segment). A task owns its segment's `dQ` rows
//! outright and accumulates a private `dK`/`dV` partial over the whole key range; partials are
//! then summed per key/value head in a fixed (head, segment) order. No result depends on which
//! thread ran what, or how many threads there are.

use std::ops::Range;

use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory};
use rayon::prelude::*;

use super::Problem;
use crate::{AttentionDims, AttnError, Result};

/// Backward's three f32 destinations, `[batch·heads, seq, head_dim]` each.
pub(crate) struct Grads<'a> {
    pub(crate) dq: &'a mut [f32],
    pub(crate) dk: &'a mut [f32],
    pub(crate) dv: &'a mut [f32],
}

/// A forward task: query rows `rows` of flat head `bh`, and the output rows and logsumexp
/// entries it alone writes.
pub(crate) struct ForwardTile<'a> {
    pub(crate) bh: usize,
    pub(crate) rows: Range<usize>,
    pub(crate) out: &'a mut [f32],
    pub(crate) lse: &'a mut [f32],
}

/// A backward task: query rows `rows` of flat head `bh`, its `dQ` rows, and a private
/// `[kv_len, head_dim]` partial for `dK` and `dV` (zero on entry).
pub(crate) struct BackwardSegment<'a> {
    pub(crate) bh: usize,
    pub(crate) rows: Range<usize>,
    pub(crate) dq: &'a mut [f32],
    pub(crate) dk: &'a mut [f32],
    pub(crate) dv: &'a mut [f32],
}

/// A zeroed f32 scratch buffer reported as `Workspace` (tasks run on pool threads, whose
/// current category is not the caller's, so the category is set explicitly here).
pub(crate) fn workspace(cpu: &Cpu, len: usize) -> Result<CpuTensor> {
    let _workspace = MemoryCategory::Workspace.enter();
    Ok(cpu.zeros([len], DType::F32)?)
}

/// The tasks' scratch buffers, allocated by the caller before the tasks start: one for each
/// task that can run at once (`min(tasks, threads)`), handed out zeroed and taken back. The
/// workspace a parallel kernel holds is then a function of the shape and the thread count,
/// not of how the scheduler happened to overlap the tasks — what
/// [`crate::cpu_backward_scratch_bytes`] predicts. (Trade-off: a buffer is re-zeroed per task,
/// as the per-task allocation it replaces zeroed it too.)
struct ScratchPool {
    free: std::sync::Mutex<Vec<CpuTensor>>,
    cpu: Cpu,
    len: usize,
}

impl ScratchPool {
    fn new(cpu: &Cpu, len: usize, tasks: usize) -> Result<Self> {
        let n = concurrent_tasks(tasks, cpu.num_threads());
        let free = (0..n)
            .map(|_| workspace(cpu, len))
            .collect::<Result<Vec<_>>>()?;
        Ok(ScratchPool {
            free: std::sync::Mutex::new(free),
            cpu: cpu.clone(),
            len,
        })
    }

    /// Run `f` with a zeroed buffer. A task never runs beside more than `threads - 1` others
    /// (the kernels start no nested parallel work), so the pool does not run dry; if it ever
    /// did, a buffer would be allocated rather than shared.
    fn with<R>(&self, f: impl FnOnce(&mut [f32]) -> Result<R>) -> Result<R> {
        let taken = self.free.lock().map_or(None, |mut v| v.pop());
        let mut buf = match taken {
            Some(mut b) => {
                b.as_mut_slice::<f32>()?.fill(0.0);
                b
            }
            None => workspace(&self.cpu, self.len)?,
        };
        let out = f(buf.as_mut_slice::<f32>()?);
        if let Ok(mut v) = self.free.lock() {
            v.push(buf);
        }
        out
    }
}

/// How many of `tasks` run at once on `threads` threads.
pub(crate) fn concurrent_tasks(tasks: usize, threads: usize) -> usize {
    tasks.min(threads.max(1))
}

/// Run `kernel` on every query tile of `tile_rows` rows, in parallel, each with its own
/// `scratch_len`-float workspace.
pub(crate) fn for_each_forward_tile(
    cpu: &Cpu,
    p: &Problem<'_>,
    tile_rows: usize,
    out: &mut [f32],
    lse: &mut [f32],
    scratch_len: usize,
    kernel: impl Fn(ForwardTile<'_>, &mut [f32]) -> Result<()> + Sync,
) -> Result<()> {
    let (rows, hd) = (p.dims.q_len, p.dims.head_dim);
    if rows == 0 || tile_rows == 0 || out.is_empty() {
        return Ok(());
    }
    let mut tasks = Vec::new();
    for (bh, (o, l)) in out
        .chunks_mut(rows * hd)
        .zip(lse.chunks_mut(rows))
        .enumerate()
    {
        for (t, (ot, lt)) in o
            .chunks_mut(tile_rows * hd)
            .zip(l.chunks_mut(tile_rows))
            .enumerate()
        {
            let r0 = t * tile_rows;
            tasks.push(ForwardTile {
                bh,
                rows: r0..r0 + lt.len(),
                out: ot,
                lse: lt,
            });
        }
    }
    let pool = ScratchPool::new(cpu, scratch_len, tasks.len())?;
    cpu.install(|| {
        tasks
            .into_par_iter()
            .try_for_each(|task| pool.with(|scratch| kernel(task, scratch)))
    })
}

/// Rows per backward segment: a whole number of `tile_rows` tiles. Chosen from the shape (or
/// the config) only, so the summation order never depends on the machine.
pub(crate) fn segment_rows(
    dims: &AttentionDims,
    tile_rows: usize,
    configured: Option<usize>,
) -> usize {
    let tile_rows = tile_rows.max(1);
    let tiles = dims.q_len.div_ceil(tile_rows).max(1);
    tiles.div_ceil(segments(dims, tile_rows, configured)) * tile_rows
}

/// Segments per head [`segment_rows`] aims at: `configured`, or enough for about 8 tasks,
/// within `1..=tiles`. Passing it as the configuration of a problem with fewer heads (a group
/// of this one's) gives that problem the same segments, so the same summation order.
pub(crate) fn segments(dims: &AttentionDims, tile_rows: usize, configured: Option<usize>) -> usize {
    // About 8 tasks keep a few cores busy while adding at most 8 partials per head.
    const TARGET_TASKS: usize = 8;
    let tiles = dims.q_len.div_ceil(tile_rows.max(1)).max(1);
    let heads = (dims.batch * dims.q_heads).max(1);
    configured
        .unwrap_or_else(|| TARGET_TASKS.div_ceil(heads))
        .clamp(1, tiles)
}

/// How a backward splits into tasks: segments of `seg_rows` query rows per head, and the
/// `dK`/`dV` partial each segment accumulates.
pub(crate) struct BackwardLayout {
    /// Segments per (batch, query head).
    pub(crate) segments: usize,
    /// Elements of segment `s`'s partial (per head; a causal segment stops at the last key its
    /// last row sees, about half the partial memory).
    pub(crate) seg_len: Vec<usize>,
    /// `seg_len` summed.
    pub(crate) per_head: usize,
    /// Each key/value head has one partial (no GQA, one segment): the outputs are written
    /// directly, with no partial buffers.
    pub(crate) direct: bool,
}

impl BackwardLayout {
    /// The layout for `dims` (non-empty) in segments of `seg_rows` (≥ 1) rows.
    pub(crate) fn new(dims: &AttentionDims, causal: bool, seg_rows: usize) -> Self {
        let (nq, hd) = (dims.q_len, dims.head_dim);
        let segments = nq.div_ceil(seg_rows);
        let seg_len: Vec<usize> = (0..segments)
            .map(|s| dims.visible_keys(((s + 1) * seg_rows).min(nq) - 1, causal) * hd)
            .collect();
        BackwardLayout {
            segments,
            per_head: seg_len.iter().sum(),
            seg_len,
            direct: dims.group_size() * segments == 1,
        }
    }

    /// `Workspace` elements of the backward's partials and its tasks' scratch
    /// (`scratch_len` each, as many as run at once on `threads`).
    pub(crate) fn workspace_elems(
        &self,
        dims: &AttentionDims,
        scratch_len: usize,
        threads: usize,
    ) -> usize {
        let heads = dims.batch.saturating_mul(dims.q_heads);
        let partials = if self.direct {
            0
        } else {
            heads.saturating_mul(self.per_head).saturating_mul(2)
        };
        let tasks = concurrent_tasks(heads.saturating_mul(self.segments), threads);
        partials.saturating_add(tasks.saturating_mul(scratch_len))
    }
}

/// Run `kernel` on every backward segment in parallel, then sum the `dK`/`dV` partials into
/// `grads`. When each key/value head has exactly one partial (no GQA, one segment), partials
/// are the outputs themselves and nothing is summed.
pub(crate) fn for_each_backward_segment(
    cpu: &Cpu,
    p: &Problem<'_>,
    seg_rows: usize,
    grads: Grads<'_>,
    scratch_len: usize,
    kernel: impl Fn(BackwardSegment<'_>, &mut [f32]) -> Result<()> + Sync,
) -> Result<()> {
    let d = p.dims;
    let (nq, nk, hd) = (d.q_len, d.kv_len, d.head_dim);
    if nq == 0 || nk == 0 || seg_rows == 0 || grads.dq.is_empty() {
        return Ok(());
    }
    let BackwardLayout {
        seg_len,
        per_head,
        direct,
        ..
    } = BackwardLayout::new(&d, p.causal, seg_rows);
    let Grads { dq, dk, dv } = grads;
    let mut partial_buffers = None;
    let (dk_parts, dv_parts, outputs) = if direct {
        (dk, dv, None)
    } else {
        let len = d.batch * d.q_heads * per_head;
        partial_buffers = Some((workspace(cpu, len)?, workspace(cpu, len)?));
        let (a, b) = partial_buffers
            .as_mut()
            .ok_or(AttnError::Internal("partials"))?;
        (
            a.as_mut_slice::<f32>()?,
            b.as_mut_slice::<f32>()?,
            Some((dk, dv)),
        )
    };
    let (mut dk_rest, mut dv_rest) = (dk_parts, dv_parts);
    let mut tasks = Vec::new();
    for (bh, dq_head) in dq.chunks_mut(nq * hd).enumerate() {
        for (s, dq_seg) in dq_head.chunks_mut(seg_rows * hd).enumerate() {
            let r0 = s * seg_rows;
            let used = seg_len.get(s).copied().unwrap_or(0);
            // Direct outputs keep their full [kv_len, head_dim] layout; partials are packed.
            let slot = if direct { nk * hd } else { used };
            tasks.push(BackwardSegment {
                bh,
                rows: r0..r0 + dq_seg.len() / hd,
                dq: dq_seg,
                dk: take_prefix(&mut dk_rest, slot, used)?,
                dv: take_prefix(&mut dv_rest, slot, used)?,
            });
        }
    }
    let pool = ScratchPool::new(cpu, scratch_len, tasks.len())?;
    cpu.install(|| {
        tasks
            .into_par_iter()
            .try_for_each(|task| pool.with(|scratch| kernel(task, scratch)))
    })?;
    drop(pool);
    if let (Some((dk_out, dv_out)), Some((dk_p, dv_p))) = (outputs, partial_buffers.as_ref()) {
        let group = d.group_size() * per_head;
        let (dk_p, dv_p) = (dk_p.as_slice::<f32>()?, dv_p.as_slice::<f32>()?);
        cpu.install(|| {
            dk_out
                .par_chunks_mut(nk * hd)
                .zip(dk_p.par_chunks(group))
                .chain(dv_out.par_chunks_mut(nk * hd).zip(dv_p.par_chunks(group)))
                .for_each(|(out, parts)| sum_partials(out, parts, &seg_len));
        });
    }
    Ok(())
}

/// Split the next `slot` elements off `rest` and return the first `used` of them.
fn take_prefix<'a>(rest: &mut &'a mut [f32], slot: usize, used: usize) -> Result<&'a mut [f32]> {
    let all = std::mem::take(rest);
    if slot > all.len() || used > slot {
        return Err(AttnError::Internal("backward partial layout"));
    }
    let (this, tail) = all.split_at_mut(slot);
    *rest = tail;
    Ok(&mut this[..used])
}

/// `out = Σ parts`: `parts` holds the partials of one key/value head, for each query head of
/// its group the segments in order, segment `s` covering the first `seg_len[s]` elements.
/// Summed in that fixed order.
fn sum_partials(out: &mut [f32], parts: &[f32], seg_len: &[usize]) {
    out.fill(0.0);
    let mut rest = parts;
    while !rest.is_empty() {
        for &len in seg_len {
            let (part, tail) = rest.split_at(len.min(rest.len()));
            rest = tail;
            for (o, &x) in out.iter_mut().zip(part) {
                *o += x;
            }
        }
    }
}
