//! The CPU implementation of [`AttentionBackend`]: input checks, f32 staging of bf16 data, and
//! dispatch to the naive, chunked and flash kernels.
//!
//! Memory goes through the backend so an [`AllocHook`](headroom_tensor::AllocHook) sees it:
//! outputs and gradients in the caller's category, saved state as `Activations`, everything
//! else (bf16→f32 copies, score tiles, partial gradients) as `Workspace`.

mod chunked;
mod flash;
mod matmul;
mod naive;
mod parallel;
mod softmax_rows;

use std::ops::Range;

use headroom_tensor::cpu::kernels::{self, FloatSlice, FloatSliceMut};
use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory, Shape, Tensor};

use crate::dims::{cached_dims, check_backward_inputs, check_documents, check_same};
use crate::{
    Algorithm, AttentionBackend, AttentionConfig, AttentionDims, AttentionForward,
    AttentionGradients, AttnError, DocumentMask, Result,
};

/// An input as f32: borrowed when it already is, else a `Workspace` copy.
enum F32Input<'a> {
    Borrowed(&'a [f32]),
    Converted(CpuTensor),
}

impl F32Input<'_> {
    fn slice(&self) -> Result<&[f32]> {
        match self {
            F32Input::Borrowed(s) => Ok(s),
            F32Input::Converted(t) => Ok(t.as_slice::<f32>()?),
        }
    }
}

fn f32_input<'a>(cpu: &Cpu, t: &'a CpuTensor) -> Result<F32Input<'a>> {
    if t.dtype() == DType::F32 {
        return Ok(F32Input::Borrowed(t.as_slice::<f32>()?));
    }
    // Trade-off: one up-front O(N·d) copy instead of converting every tile on every reuse;
    // it keeps the kernels single-typed and is still O(N), never O(N²).
    let _workspace = MemoryCategory::Workspace.enter();
    let mut f = cpu.uninit(t.shape().clone(), DType::F32)?;
    cpu.cast(t, &mut f)?;
    Ok(F32Input::Converted(f))
}

/// A result tensor in the inputs' dtype, computed in f32: written in place when the dtype is
/// f32, else through a `Workspace` f32 staging buffer cast at the end.
struct F32Output {
    tensor: CpuTensor,
    staging: Option<CpuTensor>,
}

impl F32Output {
    /// Allocates the result in the calling thread's current category.
    fn new(cpu: &Cpu, shape: Shape, dtype: DType) -> Result<Self> {
        let tensor = cpu.zeros(shape.clone(), dtype)?;
        let staging = if dtype == DType::F32 {
            None
        } else {
            let _workspace = MemoryCategory::Workspace.enter();
            Some(cpu.zeros(shape, DType::F32)?)
        };
        Ok(F32Output { tensor, staging })
    }

    fn slice_mut(&mut self) -> Result<&mut [f32]> {
        Ok(match &mut self.staging {
            Some(s) => s.as_mut_slice::<f32>()?,
            None => self.tensor.as_mut_slice::<f32>()?,
        })
    }

    fn finish(mut self, cpu: &Cpu) -> Result<CpuTensor> {
        if let Some(staging) = self.staging.take() {
            cpu.cast(&staging, &mut self.tensor)?;
        }
        Ok(self.tensor)
    }
}

/// One attention problem with every input as f32, `[batch·heads, seq, head_dim]` per tensor.
pub(crate) struct Problem<'a> {
    pub(crate) dims: AttentionDims,
    pub(crate) causal: bool,
    pub(crate) scale: f32,
    pub(crate) q: &'a [f32],
    pub(crate) k: &'a [f32],
    pub(crate) v: &'a [f32],
    /// Rows each key/value head holds in `k` and `v` (`dims.kv_len`, or more for a cache with
    /// room to grow: only the first `kv_len` of each head are read).
    pub(crate) kv_stride: usize,
    /// The document mask, if any: a lower bound on the keys each query sees, next to the
    /// causal upper bound of [`Problem::visible`].
    pub(crate) documents: Option<DocumentRows<'a>>,
}

/// A document mask as one [`Problem`] reads it. A grouped problem (see [`HeadGroups`]) covers
/// a sub-range of the call's flat query heads, so a head's batch row is found from its index
/// in the whole call, not in the problem.
#[derive(Clone, Copy)]
pub(crate) struct DocumentRows<'a> {
    mask: &'a DocumentMask,
    /// Query heads per batch row of the whole call.
    q_heads: usize,
    /// The whole call's flat query head that is this problem's head 0.
    first_head: usize,
}

impl<'a> DocumentRows<'a> {
    fn new(
        mask: Option<&'a DocumentMask>,
        dims: &AttentionDims,
        first_head: usize,
    ) -> Option<Self> {
        mask.map(|mask| DocumentRows {
            mask,
            q_heads: dims.q_heads,
            first_head,
        })
    }
}

/// The document starts of one query head's rows: the first key each query row may see, and a
/// padding mask's keys hidden from every row. Without a mask every start is 0 and nothing is
/// hidden, and masking does nothing at all, so unmasked attention runs exactly the
/// instructions it ran before masks existed.
#[derive(Clone, Copy)]
pub(crate) struct RowStarts<'a> {
    starts: Option<&'a [u32]>,
    hidden: (usize, usize),
}

impl RowStarts<'_> {
    const UNMASKED: Self = RowStarts {
        starts: None,
        hidden: (0, 0),
    };

    /// Whether a mask applies (some start may be above 0, or some key hidden).
    pub(crate) fn masked(self) -> bool {
        self.starts.is_some()
    }

    /// The first key query `row` may see: its document's start (0 without a mask).
    pub(crate) fn of(self, row: usize) -> usize {
        self.starts
            .and_then(|s| s.get(row))
            .map_or(0, |&start| start as usize)
    }

    /// Sets to -inf the scores, in `scores` for keys `k0..`, of the keys query `row` may not see
    /// because they precede its document or are hidden padding. The softmax helpers turn -inf
    /// into probability 0 (and a row of only -inf into no contribution), so the causal code
    /// needs no other change.
    pub(crate) fn mask(self, scores: &mut [f32], row: usize, k0: usize) {
        if self.masked() {
            let hidden = self.of(row).saturating_sub(k0).min(scores.len());
            scores[..hidden].fill(f32::NEG_INFINITY);
            let (begin, end) = self.hidden;
            let begin = begin.saturating_sub(k0).min(scores.len());
            let end = end.saturating_sub(k0).min(scores.len());
            if begin < end {
                scores[begin..end].fill(f32::NEG_INFINITY);
            }
        }
    }
}

impl<'a> Problem<'a> {
    /// Flat index `b·q_heads + h` of the key/value head that query head `bh` reads.
    pub(crate) fn kv_head_of(&self, bh: usize) -> usize {
        let d = &self.dims;
        let (b, h) = (bh / d.q_heads.max(1), bh % d.q_heads.max(1));
        b * d.kv_heads + h / d.group_size().max(1)
    }

    /// Rows `head·rows_per_head ..` of a `[heads, rows_per_head, head_dim]` slice.
    pub(crate) fn head<'s>(&self, data: &'s [f32], head: usize, rows: usize) -> Result<&'s [f32]> {
        let len = rows * self.dims.head_dim;
        data.get(head * len..(head + 1) * len)
            .ok_or(AttnError::Internal("head slice"))
    }

    /// The `kv_len` rows of key/value head `head` in `k` or `v` (`kv_stride` rows apart).
    pub(crate) fn kv<'s>(&self, data: &'s [f32], head: usize) -> Result<&'s [f32]> {
        let hd = self.dims.head_dim;
        data.get(head * self.kv_stride * hd..)
            .and_then(|d| d.get(..self.dims.kv_len * hd))
            .ok_or(AttnError::Internal("key/value head slice"))
    }

    /// Elements `head·len .. (head+1)·len` of a per-head slice.
    pub(crate) fn head_rows<'s>(
        &self,
        data: &'s [f32],
        head: usize,
        len: usize,
    ) -> Result<&'s [f32]> {
        data.get(head * len..(head + 1) * len)
            .ok_or(AttnError::Internal("head slice"))
    }

    /// Keys visible to query row `row` (a prefix of the key rows); a document mask also hides
    /// those before [`RowStarts::of`].
    pub(crate) fn visible(&self, row: usize) -> usize {
        self.dims.visible_keys(row, self.causal)
    }

    /// The document starts of flat query head `bh`'s rows.
    pub(crate) fn starts(&self, bh: usize) -> Result<RowStarts<'a>> {
        let Some(d) = self.documents else {
            return Ok(RowStarts::UNMASKED);
        };
        let b = (d.first_head + bh) / d.q_heads.max(1);
        let hidden = d.mask.hidden_keys(b);
        d.mask
            .row_starts(b)
            .filter(|s| s.len() == self.dims.q_len)
            .map(|s| RowStarts {
                starts: Some(s),
                hidden: (hidden.start, hidden.end),
            })
            .ok_or(AttnError::Internal("document mask row"))
    }

    /// Whether any query row of `rows` sees any key of `keys` under both bounds (its document
    /// start and the causal prefix).
    pub(crate) fn sees(
        &self,
        starts: RowStarts<'_>,
        mut rows: Range<usize>,
        keys: Range<usize>,
    ) -> bool {
        rows.any(|r| starts.of(r) < keys.end && self.visible(r) > keys.start)
    }
}

/// The forward state chunked and flash backward read, as f32.
pub(crate) struct SavedRows<'a> {
    pub(crate) out: &'a [f32],
    pub(crate) d_out: &'a [f32],
    pub(crate) lse: &'a [f32],
}

/// One query head's slices of everything a chunked or flash backward reads: its `q`, `d_out`,
/// `out` and logsumexp rows, and the `k`, `v` of the key/value head it attends to.
pub(crate) struct HeadBackward<'a> {
    pub(crate) q: &'a [f32],
    pub(crate) d_out: &'a [f32],
    pub(crate) out: &'a [f32],
    pub(crate) lse: &'a [f32],
    pub(crate) k: &'a [f32],
    pub(crate) v: &'a [f32],
}

impl<'a> HeadBackward<'a> {
    pub(crate) fn new(p: &Problem<'a>, saved: &SavedRows<'a>, bh: usize) -> Result<Self> {
        let nq = p.dims.q_len;
        let kv = p.kv_head_of(bh);
        Ok(HeadBackward {
            q: p.head(p.q, bh, nq)?,
            d_out: p.head(saved.d_out, bh, nq)?,
            out: p.head(saved.out, bh, nq)?,
            lse: saved
                .lse
                .get(bh * nq..(bh + 1) * nq)
                .ok_or(AttnError::Internal("backward lse"))?,
            k: p.kv(p.k, kv)?,
            v: p.kv(p.v, kv)?,
        })
    }
}

/// The algorithm with chunk and tile sizes clamped to the sequence lengths: a tile larger than
/// the sequence computes the same thing, and clamping keeps scratch sizes from overflowing when
/// a caller passes something like `usize::MAX`.
fn effective(algorithm: Algorithm, dims: &AttentionDims) -> Algorithm {
    let q_rows = dims.q_len.max(1);
    let k_rows = dims.kv_len.max(1);
    match algorithm {
        Algorithm::Naive => Algorithm::Naive,
        Algorithm::Chunked { chunk_size } => Algorithm::Chunked {
            chunk_size: chunk_size.min(q_rows),
        },
        Algorithm::Flash { block_q, block_k } => Algorithm::Flash {
            block_q: block_q.min(q_rows),
            block_k: block_k.min(k_rows),
        },
    }
}

/// The `Workspace` bytes the CPU backward of `dims` under `config` allocates for itself, all
/// live at once at its peak, on a pool of `threads` threads: naive's probability gradient;
/// chunked's and flash's `dK`/`dV` partials (with grouped-query heads or several segments per
/// head) and one scratch buffer per task that can run at once. Not included: the f32 copies of
/// bf16 inputs and the f32 staging of bf16 gradients, each the size of a tensor the caller
/// holds. A function of the shape, the configuration and the thread count only, so a memory
/// estimator can equal the tracker.
pub fn cpu_backward_scratch_bytes(
    dims: &AttentionDims,
    config: &AttentionConfig,
    threads: usize,
) -> u64 {
    let heads = dims.batch.saturating_mul(dims.q_heads);
    if dims.q_len == 0 || dims.kv_len == 0 || heads == 0 {
        return 0;
    }
    let elems = match effective(config.algorithm, dims) {
        Algorithm::Naive => heads.saturating_mul(dims.q_len).saturating_mul(dims.kv_len),
        Algorithm::Chunked { chunk_size } => {
            let seg_rows = parallel::segment_rows(dims, chunk_size, config.backward_segments);
            parallel::BackwardLayout::new(dims, config.causal, seg_rows).workspace_elems(
                dims,
                chunked::backward_scratch_len(chunk_size, dims.kv_len),
                threads,
            )
        }
        Algorithm::Flash { block_q, block_k } => {
            let seg_rows = parallel::segment_rows(dims, block_q, config.backward_segments);
            parallel::BackwardLayout::new(dims, config.causal, seg_rows).workspace_elems(
                dims,
                flash::backward_scratch_len(block_q, block_k, seg_rows),
                threads,
            )
        }
    };
    (elems as u64).saturating_mul(4)
}

/// A low-precision problem run a few heads at a time (chunked and flash): each group of
/// consecutive flat query heads — whole key/value groups — is widened into f32 buffers and
/// run as a problem of its own, so the f32 copies are a group's, not whole tensors'.
///
/// Same bits as one f32 problem: heads never mix in the forward, and the backward's segments
/// are the whole problem's (passed as the group's configuration), so every `dK`/`dV` partial
/// is summed in the same order. (Trade-off: a group's kernel call re-creates its scratch, one
/// more allocation per group; the groups hold two tasks per thread so the threads stay busy.)
#[derive(Clone, Copy, Debug)]
struct HeadGroups {
    /// The whole problem.
    dims: AttentionDims,
    /// Query heads per group (the last may have fewer), a multiple of the group size.
    per_group: usize,
}

impl HeadGroups {
    fn new(dims: &AttentionDims, threads: usize) -> Self {
        let heads = (dims.batch * dims.q_heads).max(1);
        let gs = dims.group_size().max(1);
        HeadGroups {
            dims: *dims,
            per_group: (2 * threads.max(1)).next_multiple_of(gs).min(heads),
        }
    }

    /// Whether `dims` under `algorithm` runs grouped: low-precision inputs to a tiled kernel
    /// (naive keeps whole-tensor copies: its O(N²) probabilities dwarf them).
    fn applies(dims: &AttentionDims, algorithm: Algorithm) -> bool {
        dims.dtype != DType::F32 && !matches!(effective(algorithm, dims), Algorithm::Naive)
    }

    /// Each group's query heads (flat), in order.
    fn groups(&self) -> impl Iterator<Item = Range<usize>> {
        let heads = self.dims.batch * self.dims.q_heads;
        let g = self.per_group.max(1);
        (0..heads).step_by(g).map(move |h| h..(h + g).min(heads))
    }

    /// The problem of query heads `heads`: one batch of them, f32.
    fn sub_dims(&self, heads: &Range<usize>) -> AttentionDims {
        let gs = self.dims.group_size().max(1);
        AttentionDims {
            batch: 1,
            q_heads: heads.len(),
            kv_heads: heads.len() / gs,
            dtype: DType::F32,
            ..self.dims
        }
    }

    /// Elements of `heads`' rows in a `[heads, q_len, head_dim]` tensor, and of their
    /// key/value heads' in a `[kv heads, kv_len, head_dim]` one.
    fn ranges(&self, heads: &Range<usize>) -> (Range<usize>, Range<usize>) {
        let d = &self.dims;
        let (q_head, kv_head) = (d.q_len * d.head_dim, d.kv_len * d.head_dim);
        let gs = d.group_size().max(1);
        (
            heads.start * q_head..heads.end * q_head,
            heads.start / gs * kv_head..heads.end / gs * kv_head,
        )
    }

    /// `config` for a group's backward: the whole problem's segments per head (so the same
    /// partials, summed in the same order).
    fn backward_config(&self, config: &AttentionConfig) -> AttentionConfig {
        let tile = match effective(config.algorithm, &self.dims) {
            Algorithm::Chunked { chunk_size } => chunk_size,
            Algorithm::Flash { block_q, .. } => block_q,
            Algorithm::Naive => 1,
        };
        AttentionConfig {
            backward_segments: Some(parallel::segments(
                &self.dims,
                tile,
                config.backward_segments,
            )),
            ..*config
        }
    }

    /// f32 elements of one group's `q`-shaped and key/value-shaped buffers.
    fn buffer_lens(&self) -> (usize, usize) {
        let d = &self.dims;
        let g = self.per_group;
        (
            g * d.q_len * d.head_dim,
            g / d.group_size().max(1) * d.kv_len * d.head_dim,
        )
    }
}

/// Elements `range` of a float slice, same type.
fn sub<'a>(s: &FloatSlice<'a>, range: Range<usize>) -> Result<FloatSlice<'a>> {
    let bad = || AttnError::Internal("group range");
    Ok(match s {
        FloatSlice::F32(x) => FloatSlice::F32(x.get(range).ok_or_else(bad)?),
        FloatSlice::F16(x) => FloatSlice::F16(x.get(range).ok_or_else(bad)?),
        FloatSlice::BF16(x) => FloatSlice::BF16(x.get(range).ok_or_else(bad)?),
    })
}

/// `dst = src` widened (exactly) to f32, the tensor crate's cast.
fn widen(src: FloatSlice<'_>, dst: &mut [f32]) {
    kernels::cast(src, FloatSliceMut::F32(dst));
}

/// Zeroed f32 `Workspace` buffers of these lengths.
fn f32_buffers<const N: usize>(cpu: &Cpu, lens: [usize; N]) -> Result<[CpuTensor; N]> {
    let _workspace = MemoryCategory::Workspace.enter();
    let mut out = Vec::with_capacity(N);
    for len in lens {
        out.push(cpu.zeros([len], DType::F32)?);
    }
    out.try_into()
        .map_err(|_| AttnError::Internal("group buffers"))
}

/// The forward of a grouped problem (see [`HeadGroups`]): `output` in the inputs' dtype
/// (allocated in the caller's category), each group's f32 output narrowed into it.
///
/// `k` and `v` hold `kv_stride ≥ dims.kv_len` rows per head, of which the first `kv_len` are
/// widened (a KV cache's room is never read).
fn grouped_forward(
    cpu: &Cpu,
    (q, k, v): (&CpuTensor, &CpuTensor, &CpuTensor),
    config: &AttentionConfig,
    dims: AttentionDims,
    documents: Option<&DocumentMask>,
    kv_stride: usize,
) -> Result<AttentionForward<CpuTensor>> {
    let mut output = cpu.zeros(dims.q_shape(), dims.dtype)?;
    let mut logsumexp = {
        let _saved = MemoryCategory::Activations.enter();
        cpu.zeros(dims.lse_shape(), DType::F32)?
    };
    let groups = HeadGroups::new(&dims, cpu.num_threads());
    let (q_len, kv_len) = groups.buffer_lens();
    let [mut qb, mut kb, mut vb, mut ob] = f32_buffers(cpu, [q_len, kv_len, kv_len, q_len])?;
    let (qs, ks, vs) = (
        q.float_slice("attention")?,
        k.float_slice("attention")?,
        v.float_slice("attention")?,
    );
    let lse = logsumexp.as_mut_slice::<f32>()?;
    for heads in groups.groups() {
        let sub_dims = groups.sub_dims(&heads);
        let (qr, kr) = groups.ranges(&heads);
        let (qf, kf, vf) = (
            &mut qb.as_mut_slice::<f32>()?[..qr.len()],
            &mut kb.as_mut_slice::<f32>()?[..kr.len()],
            &mut vb.as_mut_slice::<f32>()?[..kr.len()],
        );
        cpu.install(|| -> Result<()> {
            widen(sub(&qs, qr.clone())?, qf);
            if kv_stride == dims.kv_len {
                widen(sub(&ks, kr.clone())?, kf);
                widen(sub(&vs, kr.clone())?, vf);
            } else {
                // Head by head: each one's rows in use, without the room after them.
                let head = dims.kv_len * dims.head_dim;
                let first = kr.start / head.max(1);
                for (i, (kh, vh)) in kf
                    .chunks_exact_mut(head.max(1))
                    .zip(vf.chunks_exact_mut(head.max(1)))
                    .enumerate()
                {
                    let at = (first + i) * kv_stride * dims.head_dim;
                    widen(sub(&ks, at..at + head)?, kh);
                    widen(sub(&vs, at..at + head)?, vh);
                }
            }
            Ok(())
        })?;
        let problem = Problem {
            dims: sub_dims,
            causal: config.causal,
            scale: config.scale_for(dims.head_dim),
            q: qf,
            k: kf,
            v: vf,
            kv_stride: sub_dims.kv_len,
            documents: DocumentRows::new(documents, &dims, heads.start),
        };
        let out = &mut ob.as_mut_slice::<f32>()?[..qr.len()];
        let lse = lse
            .get_mut(heads.start * dims.q_len..heads.end * dims.q_len)
            .ok_or(AttnError::Internal("group logsumexp"))?;
        match effective(config.algorithm, &dims) {
            Algorithm::Chunked { chunk_size } => {
                chunked::forward(cpu, &problem, chunk_size, out, lse)?
            }
            Algorithm::Flash { block_q, block_k } => {
                flash::forward(cpu, &problem, block_q, block_k, out, lse)?
            }
            Algorithm::Naive => return Err(AttnError::Internal("naive is not grouped")),
        }
        let out = &*out;
        let dst = output.float_slice_mut("attention")?;
        cpu.install(|| -> Result<()> {
            kernels::cast(FloatSlice::F32(out), sub_mut(dst, qr.clone())?);
            Ok(())
        })?;
    }
    Ok(AttentionForward {
        output,
        logsumexp,
        probs: None,
        config: *config,
        dims,
        documents: documents.cloned(),
    })
}

/// Elements `range` of a mutable float slice, same type.
fn sub_mut(s: FloatSliceMut<'_>, range: Range<usize>) -> Result<FloatSliceMut<'_>> {
    let bad = || AttnError::Internal("group range");
    Ok(match s {
        FloatSliceMut::F32(x) => FloatSliceMut::F32(x.get_mut(range).ok_or_else(bad)?),
        FloatSliceMut::F16(x) => FloatSliceMut::F16(x.get_mut(range).ok_or_else(bad)?),
        FloatSliceMut::BF16(x) => FloatSliceMut::BF16(x.get_mut(range).ok_or_else(bad)?),
    })
}

/// The f32-gradient backward of a grouped problem: each group's `q`, output, `d_out` (when
/// not f32), `k` and `v` widened, its gradients written straight into the f32 results.
fn grouped_backward_f32(
    cpu: &Cpu,
    (q, k, v): (&CpuTensor, &CpuTensor, &CpuTensor),
    forward: &AttentionForward<CpuTensor>,
    d_out: &CpuTensor,
    dims: AttentionDims,
) -> Result<AttentionGradients<CpuTensor>> {
    let config = forward.config;
    let mut dq = cpu.zeros(dims.q_shape(), DType::F32)?;
    let mut dk = cpu.zeros(dims.kv_shape(), DType::F32)?;
    let mut dv = cpu.zeros(dims.kv_shape(), DType::F32)?;
    let groups = HeadGroups::new(&dims, cpu.num_threads());
    let (q_len, kv_len) = groups.buffer_lens();
    let d_out_len = if d_out.dtype() == DType::F32 {
        0
    } else {
        q_len
    };
    let [mut qb, mut ob, mut db, mut kb, mut vb] =
        f32_buffers(cpu, [q_len, q_len, d_out_len, kv_len, kv_len])?;
    let (qs, ks, vs) = (
        q.float_slice("attention")?,
        k.float_slice("attention")?,
        v.float_slice("attention")?,
    );
    let (os, ds) = (
        forward.output.float_slice("attention")?,
        d_out.float_slice("attention")?,
    );
    let lse = forward.logsumexp.as_slice::<f32>()?;
    let sub_config = groups.backward_config(&config);
    for heads in groups.groups() {
        let sub_dims = groups.sub_dims(&heads);
        let (qr, kr) = groups.ranges(&heads);
        let (qf, of, kf, vf) = (
            &mut qb.as_mut_slice::<f32>()?[..qr.len()],
            &mut ob.as_mut_slice::<f32>()?[..qr.len()],
            &mut kb.as_mut_slice::<f32>()?[..kr.len()],
            &mut vb.as_mut_slice::<f32>()?[..kr.len()],
        );
        let df: &mut [f32] = match d_out_len {
            0 => &mut [],
            _ => &mut db.as_mut_slice::<f32>()?[..qr.len()],
        };
        cpu.install(|| -> Result<()> {
            widen(sub(&qs, qr.clone())?, qf);
            widen(sub(&os, qr.clone())?, of);
            widen(sub(&ks, kr.clone())?, kf);
            widen(sub(&vs, kr.clone())?, vf);
            if !df.is_empty() {
                widen(sub(&ds, qr.clone())?, df);
            }
            Ok(())
        })?;
        let d_out_f: &[f32] = match &ds {
            FloatSlice::F32(x) => x.get(qr.clone()).ok_or(AttnError::Internal("d_out"))?,
            _ => df,
        };
        let problem = Problem {
            dims: sub_dims,
            causal: config.causal,
            scale: config.scale_for(dims.head_dim),
            q: qf,
            k: kf,
            v: vf,
            kv_stride: sub_dims.kv_len,
            documents: DocumentRows::new(forward.documents.as_ref(), &dims, heads.start),
        };
        let saved = SavedRows {
            out: of,
            d_out: d_out_f,
            lse: lse
                .get(heads.start * dims.q_len..heads.end * dims.q_len)
                .ok_or(AttnError::Internal("group logsumexp"))?,
        };
        let grads = parallel::Grads {
            dq: dq
                .as_mut_slice::<f32>()?
                .get_mut(qr.clone())
                .ok_or(AttnError::Internal("group dq"))?,
            dk: dk
                .as_mut_slice::<f32>()?
                .get_mut(kr.clone())
                .ok_or(AttnError::Internal("group dk"))?,
            dv: dv
                .as_mut_slice::<f32>()?
                .get_mut(kr.clone())
                .ok_or(AttnError::Internal("group dv"))?,
        };
        match effective(config.algorithm, &dims) {
            Algorithm::Chunked { chunk_size } => {
                chunked::backward(cpu, &problem, &saved, chunk_size, &sub_config, grads)?
            }
            Algorithm::Flash { block_q, block_k } => {
                flash::backward(cpu, &problem, &saved, block_q, block_k, &sub_config, grads)?
            }
            Algorithm::Naive => return Err(AttnError::Internal("naive is not grouped")),
        }
    }
    Ok(AttentionGradients { dq, dk, dv })
}

/// Scratch elements of one forward task, and the tasks: what [`parallel::for_each_forward_tile`]
/// allocates for `dims` (f32) under `algorithm`.
fn forward_pool_elems(dims: &AttentionDims, algorithm: Algorithm, threads: usize) -> usize {
    let heads = dims.batch * dims.q_heads;
    let (tile_rows, scratch) = match effective(algorithm, dims) {
        Algorithm::Naive => return 0,
        Algorithm::Chunked { chunk_size } => (chunk_size, chunk_size * dims.kv_len),
        Algorithm::Flash { block_q, block_k } => (block_q, block_q * block_k + 2 * block_q),
    };
    let tasks = heads.saturating_mul(dims.q_len.div_ceil(tile_rows.max(1)));
    parallel::concurrent_tasks(tasks, threads).saturating_mul(scratch)
}

/// The `Workspace` bytes the CPU forward of `dims` under `config` holds at its peak on a pool
/// of `threads` threads, beyond its output and log-sum-exp: for low-precision inputs to
/// chunked or flash attention, one group of heads' f32 `q`, `k`, `v` and output (see the
/// module's grouping) and the group's per-task scratch; for f32 inputs the per-task scratch;
/// for naive in low precision the whole f32 copies of `q`, `k`, `v` and the output's staging.
/// A function of the shape, the configuration and the thread count only.
pub fn cpu_forward_workspace_bytes(
    dims: &AttentionDims,
    config: &AttentionConfig,
    threads: usize,
) -> u64 {
    let heads = dims.batch * dims.q_heads;
    if dims.q_len == 0 || dims.kv_len == 0 || heads == 0 {
        return 0;
    }
    let elems = if HeadGroups::applies(dims, config.algorithm) {
        let groups = HeadGroups::new(dims, threads);
        let (q_len, kv_len) = groups.buffer_lens();
        let first = groups.sub_dims(&(0..groups.per_group));
        2 * q_len + 2 * kv_len + forward_pool_elems(&first, config.algorithm, threads)
    } else if dims.dtype != DType::F32 {
        // Naive: whole copies and the output's staging.
        let (q, kv) = (dims.q_shape().numel(), dims.kv_shape().numel());
        2 * q + 2 * kv
    } else {
        forward_pool_elems(dims, config.algorithm, threads)
    };
    (elems as u64).saturating_mul(4)
}

/// The `Workspace` bytes [`AttentionBackend::attention_backward_f32`] holds at its peak on the
/// CPU beyond its f32 gradients, for `d_out` of dtype `d_out`: with low-precision inputs to
/// chunked or flash attention, one group of heads' f32 `q`, output, `d_out` (unless f32), `k`
/// and `v` and the group's [`cpu_backward_scratch_bytes`]; otherwise the whole f32 copies of
/// what is not f32 (the output, `q`, `k`, `v`, `d_out`) and [`cpu_backward_scratch_bytes`].
pub fn cpu_backward_f32_workspace_bytes(
    dims: &AttentionDims,
    d_out: DType,
    config: &AttentionConfig,
    threads: usize,
) -> u64 {
    let heads = dims.batch * dims.q_heads;
    if dims.q_len == 0 || dims.kv_len == 0 || heads == 0 {
        return 0;
    }
    let f32_dims = AttentionDims {
        dtype: DType::F32,
        ..*dims
    };
    if HeadGroups::applies(dims, config.algorithm) {
        let groups = HeadGroups::new(dims, threads);
        let (q_len, kv_len) = groups.buffer_lens();
        let d_out_len = if d_out == DType::F32 { 0 } else { q_len };
        let sub_config = groups.backward_config(config);
        let first = groups.sub_dims(&(0..groups.per_group));
        let buffers = (2 * q_len + d_out_len + 2 * kv_len) as u64 * 4;
        return buffers.saturating_add(cpu_backward_scratch_bytes(&first, &sub_config, threads));
    }
    let (q, kv) = (
        dims.q_shape().numel() as u64,
        dims.kv_shape().numel() as u64,
    );
    let copies = if dims.dtype == DType::F32 {
        0
    } else {
        2 * q + 2 * kv
    } + if d_out == DType::F32 { 0 } else { q };
    (copies * 4).saturating_add(cpu_backward_scratch_bytes(&f32_dims, config, threads))
}

/// The forward of [`AttentionBackend::attention_forward`] and, with `documents`, of
/// [`AttentionBackend::attention_forward_documents`]: one path, so that a mask of one
/// document per row gives plain causal attention's bits.
fn forward(
    cpu: &Cpu,
    (q, k, v): (&CpuTensor, &CpuTensor, &CpuTensor),
    config: &AttentionConfig,
    documents: Option<&DocumentMask>,
) -> Result<AttentionForward<CpuTensor>> {
    let dims = AttentionDims::of_forward(q, k, v, config)?;
    if let Some(documents) = documents {
        check_documents(&dims, config, documents)?;
    }
    if HeadGroups::applies(&dims, config.algorithm) && dims.q_len > 0 && dims.kv_len > 0 {
        return grouped_forward(cpu, (q, k, v), config, dims, documents, dims.kv_len);
    }
    forward_f32(cpu, (q, k, v), config, documents, dims, dims.kv_len)
}

/// [`forward`] through whole-tensor f32 inputs (f32 read in place, others widened), `k` and
/// `v` holding `kv_stride ≥ dims.kv_len` rows per head of which the first `kv_len` are read.
fn forward_f32(
    cpu: &Cpu,
    (q, k, v): (&CpuTensor, &CpuTensor, &CpuTensor),
    config: &AttentionConfig,
    documents: Option<&DocumentMask>,
    dims: AttentionDims,
    kv_stride: usize,
) -> Result<AttentionForward<CpuTensor>> {
    let mut output = F32Output::new(cpu, dims.q_shape(), dims.dtype)?;
    let mut logsumexp = {
        let _saved = MemoryCategory::Activations.enter();
        cpu.zeros(dims.lse_shape(), DType::F32)?
    };
    let (qf, kf, vf) = (f32_input(cpu, q)?, f32_input(cpu, k)?, f32_input(cpu, v)?);
    let problem = Problem {
        dims,
        causal: config.causal,
        scale: config.scale_for(dims.head_dim),
        q: qf.slice()?,
        k: kf.slice()?,
        v: vf.slice()?,
        kv_stride,
        documents: DocumentRows::new(documents, &dims, 0),
    };
    let out = output.slice_mut()?;
    let lse = logsumexp.as_mut_slice::<f32>()?;
    let probs = match effective(config.algorithm, &dims) {
        Algorithm::Naive => Some(naive::forward(cpu, &problem, out, lse)?),
        Algorithm::Chunked { chunk_size } => {
            chunked::forward(cpu, &problem, chunk_size, out, lse)?;
            None
        }
        Algorithm::Flash { block_q, block_k } => {
            flash::forward(cpu, &problem, block_q, block_k, out, lse)?;
            None
        }
    };
    Ok(AttentionForward {
        output: output.finish(cpu)?,
        logsumexp,
        probs,
        config: *config,
        dims,
        documents: documents.cloned(),
    })
}

impl AttentionBackend for Cpu {
    fn attention_forward_cached(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        kv_len: usize,
        config: &AttentionConfig,
        documents: Option<&DocumentMask>,
    ) -> Result<CpuTensor> {
        let stored = AttentionDims::of_forward(q, k, v, config)?;
        let dims = cached_dims(stored, kv_len)?;
        if let Some(documents) = documents {
            check_documents(&dims, config, documents)?;
        }
        // Low-precision inputs are widened a group of heads at a time, each head's rows in use
        // alone, as the exact-length forward widens them (so the same bits).
        if HeadGroups::applies(&dims, config.algorithm) && dims.q_len > 0 && dims.kv_len > 0 {
            let f = grouped_forward(self, (q, k, v), config, dims, documents, stored.kv_len)?;
            return Ok(f.output);
        }
        let f = forward_f32(self, (q, k, v), config, documents, dims, stored.kv_len)?;
        Ok(f.output)
    }

    fn attention_forward(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        config: &AttentionConfig,
    ) -> Result<AttentionForward<CpuTensor>> {
        forward(self, (q, k, v), config, None)
    }

    fn attention_forward_documents(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        config: &AttentionConfig,
        documents: &DocumentMask,
    ) -> Result<AttentionForward<CpuTensor>> {
        forward(self, (q, k, v), config, Some(documents))
    }

    fn attention_backward(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        forward: &AttentionForward<CpuTensor>,
        d_out: &CpuTensor,
    ) -> Result<AttentionGradients<CpuTensor>> {
        let config = forward.config;
        let dims = check_backward_inputs(q, k, v, forward, d_out)?;
        let q_shape = dims.q_shape();
        let mut dq = F32Output::new(self, q_shape, dims.dtype)?;
        let mut dk = F32Output::new(self, dims.kv_shape(), dims.dtype)?;
        let mut dv = F32Output::new(self, dims.kv_shape(), dims.dtype)?;
        let (qf, kf, vf) = (
            f32_input(self, q)?,
            f32_input(self, k)?,
            f32_input(self, v)?,
        );
        let d_out_f = f32_input(self, d_out)?;
        let problem = Problem {
            dims,
            causal: config.causal,
            scale: config.scale_for(dims.head_dim),
            q: qf.slice()?,
            k: kf.slice()?,
            v: vf.slice()?,
            kv_stride: dims.kv_len,
            documents: DocumentRows::new(forward.documents.as_ref(), &dims, 0),
        };
        let grads = parallel::Grads {
            dq: dq.slice_mut()?,
            dk: dk.slice_mut()?,
            dv: dv.slice_mut()?,
        };
        match effective(config.algorithm, &dims) {
            Algorithm::Naive => {
                let probs = forward.probs.as_ref().ok_or(AttnError::ForwardMismatch(
                    "naive backward needs the probabilities its forward saved",
                ))?;
                check_same(
                    "probs",
                    probs,
                    &dims.probs_shape(),
                    DType::F32,
                    "probs is [batch, q_heads, q_len, kv_len] f32",
                )?;
                naive::backward(
                    self,
                    &problem,
                    probs.as_slice::<f32>()?,
                    d_out_f.slice()?,
                    grads,
                )?;
            }
            Algorithm::Chunked { chunk_size } => {
                let out_f = f32_input(self, &forward.output)?;
                let saved = SavedRows {
                    out: out_f.slice()?,
                    d_out: d_out_f.slice()?,
                    lse: forward.logsumexp.as_slice::<f32>()?,
                };
                chunked::backward(self, &problem, &saved, chunk_size, &config, grads)?;
            }
            Algorithm::Flash { block_q, block_k } => {
                let out_f = f32_input(self, &forward.output)?;
                let saved = SavedRows {
                    out: out_f.slice()?,
                    d_out: d_out_f.slice()?,
                    lse: forward.logsumexp.as_slice::<f32>()?,
                };
                flash::backward(self, &problem, &saved, block_q, block_k, &config, grads)?;
            }
        }
        Ok(AttentionGradients {
            dq: dq.finish(self)?,
            dk: dk.finish(self)?,
            dv: dv.finish(self)?,
        })
    }

    fn attention_backward_f32(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        forward: AttentionForward<CpuTensor>,
        d_out: &CpuTensor,
    ) -> Result<AttentionGradients<CpuTensor>> {
        let dims = check_f32_backward_inputs(q, k, v, &forward, d_out)?;
        if HeadGroups::applies(&dims, forward.config.algorithm) && dims.q_len > 0 && dims.kv_len > 0
        {
            return grouped_backward_f32(self, (q, k, v), &forward, d_out, dims);
        }
        // f32 inputs, naive, or an empty problem: whole copies of what is not f32.
        crate::backend_ext::backward_f32_via_copies(self, q, k, v, forward, d_out)
    }
}

/// [`check_backward_inputs`] for [`AttentionBackend::attention_backward_f32`]: `d_out` may be
/// f32 or the inputs' dtype.
fn check_f32_backward_inputs(
    q: &CpuTensor,
    k: &CpuTensor,
    v: &CpuTensor,
    forward: &AttentionForward<CpuTensor>,
    d_out: &CpuTensor,
) -> Result<AttentionDims> {
    if d_out.dtype() == DType::F32 && q.dtype() != DType::F32 {
        // Check everything else against a d_out of the inputs' dtype: same shape, any data.
        check_same(
            "d_out",
            d_out,
            &forward.dims.q_shape(),
            DType::F32,
            "d_out has q's shape",
        )?;
        let dims = AttentionDims::new(
            (q.shape(), q.dtype()),
            (k.shape(), k.dtype()),
            (v.shape(), v.dtype()),
        )?;
        check_backward_inputs(q, k, v, forward, &forward.output).map(|_| dims)
    } else {
        check_backward_inputs(q, k, v, forward, d_out)
    }
}
