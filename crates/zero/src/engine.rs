//! [`ZeroEngine`]: one rank's share of a data-parallel training state, for stages 0–3.
//!
//! The model is a chain of layers, each a list of f32 parameter tensors. Each layer is its own
//! flat buffer ([`FlatLayout`]) padded to a multiple of the world size, so every collective
//! is an even reduce-scatter or all-gather and a layer can be gathered on its own (as FSDP
//! does with its flat parameters). A rank's shards of all layers sit end to end in one shard
//! buffer, so the optimizer state is one allocation.
//!
//! All communication goes through one [`CommThread`] in the order the trainer calls the
//! engine; every rank must make the same calls in the same order (as with any collective
//! library). Memory is allocated on the engine's [`Cpu`] backend under the categories
//! `Parameters`, `Gradients`, `OptimizerState` and `Workspace`, so an allocation hook on that
//! backend sees exactly what the rank holds ([`per_rank_bytes`](crate::per_rank_bytes) is
//! the same figure, computed).

use std::collections::VecDeque;
use std::ops::Range;

use half::bf16;
use half::slice::HalfFloatSliceExt;
use headroom_tensor::{Backend, BoxedError, Cpu, CpuTensor, DType, MemoryCategory, Tensor};

use crate::collective::{Buf, BufMut};
use crate::comm_thread::{CommThread, Handle};
use crate::error::{CommError, Result, ZeroError};
use crate::layout::{BucketPlan, FlatLayout, Piece};
use crate::memory::Precision;
use crate::{Collective, Stage};

/// How a [`ZeroEngine`] shards and communicates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroConfig {
    /// What is sharded.
    pub stage: Stage,
    /// Stages 2–3: a gradient bucket is reduce-scattered once it holds at least this many
    /// bytes of (padded) gradients; layers fill buckets in backward order.
    pub bucket_bytes: usize,
    /// Stages 2–3: at most this many buckets are in flight at once; pushing past it waits for
    /// the oldest (bounds the transient gradient memory). At least 1.
    pub max_in_flight: usize,
    /// fp32 throughout, or bf16 working parameters and gradients with fp32 masters kept
    /// (sharded from stage 1) beside the optimizer state.
    pub precision: Precision,
}

impl ZeroConfig {
    /// `stage` with 4 MiB buckets and two buckets in flight.
    pub fn new(stage: Stage) -> Self {
        ZeroConfig {
            stage,
            bucket_bytes: 4 << 20,
            max_in_flight: 2,
            precision: Precision::Fp32,
        }
    }

    /// The same configuration in another precision.
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// The same configuration with another bucket size.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self
    }
}

/// Where a slice handed to [`ShardOptimizer::update`] lies in the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpdatePiece {
    /// The step being taken, counting from 1.
    pub step: u64,
    /// Layer index.
    pub layer: usize,
    /// Tensor index within the layer.
    pub tensor: usize,
    /// The elements of that tensor this piece covers.
    pub tensor_range: Range<usize>,
}

/// One piece of a layer's state of record as [`ZeroEngine::export_layer`] gives it.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardPiece {
    /// Tensor index within the layer.
    pub tensor: usize,
    /// The elements of that tensor the piece covers.
    pub tensor_range: Range<usize>,
    /// Their f32 parameters of record (the masters in mixed precision).
    pub params: Vec<f32>,
    /// Their optimizer state, in planes (see [`ShardOptimizer::state_per_param`]); empty
    /// before the first step.
    pub state: Vec<f32>,
}

/// One piece of a rank's shard as [`ZeroEngine::export_piece`] lends it: a [`ShardPiece`]
/// without the copy. A checkpoint writer streams it straight to the file.
#[derive(Debug)]
pub struct ShardPieceRef<'a> {
    /// Tensor index within the layer.
    pub tensor: usize,
    /// The elements of that tensor the piece covers.
    pub tensor_range: Range<usize>,
    /// Their f32 parameters of record: the masters' (or f32 working values') own memory;
    /// converted, for this piece alone, only where they are held in bf16.
    pub params: std::borrow::Cow<'a, [f32]>,
    /// Their optimizer state, in planes, the state's own memory; empty before the first step.
    pub state: &'a [f32],
}

/// What [`ZeroEngine::step_clipped`] found and did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Global L2 norm of the summed gradients before clipping.
    pub grad_norm: f64,
    /// The factor the gradients were multiplied by (1 when the norm was within bounds).
    pub clip_factor: f32,
}

/// An elementwise optimizer that updates any contiguous piece of a tensor on its own (Adam,
/// AdamW, SGD with momentum, …). The engine calls it once per piece of the rank's shard;
/// padding is never passed.
pub trait ShardOptimizer {
    /// f32 values of state per parameter (2 for Adam's moments). A piece of `n` elements
    /// gets `k·n` values laid out in planes: value `j` of element `i` is `state[j·n + i]`
    /// (Adam's `m` then `v`, each contiguous, as a vectorised kernel reads them). It starts
    /// zeroed; [`ZeroEngine::export_layer`] and [`ZeroEngine::load_optimizer_state`]
    /// move it in this layout.
    fn state_per_param(&self) -> usize;

    /// Update `params` in place from `grads` (the summed gradient) and `state`, all of the
    /// piece's length (state `k` times it).
    fn update(
        &mut self,
        piece: &UpdatePiece,
        params: &mut [f32],
        grads: &[f32],
        state: &mut [f32],
    ) -> Result<(), BoxedError>;
}

#[derive(Debug)]
struct LayerInfo {
    layout: FlatLayout,
    /// Offset of the layer in the full parameter/gradient storage (stages 0–2).
    storage_off: usize,
    /// Offset of the layer's shard in the shard buffers (optimizer state in units of
    /// elements, gradient shard, parameter shard, masters). In stage 0, where the "shard" is
    /// the whole layer, this equals `storage_off`.
    shard_off: usize,
    /// This rank's pieces of the layer's tensors.
    own_pieces: Vec<Piece>,
    /// Every piece of every tensor, by tensor, in rank order (packing buckets).
    tensor_pieces: Vec<Vec<Piece>>,
}

/// A finished all-gather: the gathered layer, the send buffer (handed back so that the rank's
/// own thread frees it when it waits — at a point fixed by the program, not by the
/// communication thread's timing), and the outcome.
type GatherResult = (CpuTensor, CpuTensor, Result<(), CommError>);
type BucketResult = (CpuTensor, CpuTensor, Result<(), CommError>);

#[derive(Debug)]
enum Gathered {
    Empty,
    InFlight(Handle<GatherResult>),
    Ready(CpuTensor),
}

#[derive(Debug)]
struct OpenBucket {
    buf: CpuTensor,
    remaining: usize,
}

#[derive(Debug)]
struct Pending {
    bucket: usize,
    handle: Handle<BucketResult>,
}

/// One rank's engine. See the [crate docs](crate) for the calls a training step makes.
#[derive(Debug)]
pub struct ZeroEngine {
    cpu: Cpu,
    /// Where the optimizer state (and, in mixed precision, the fp32 masters) live: `cpu`, or
    /// a host backend of their own after [`ZeroEngine::offload_state`] (ZeRO-Offload).
    state_cpu: Cpu,
    comm: CommThread,
    config: ZeroConfig,
    rank: usize,
    world: usize,
    /// The rank's index in the layouts: 0 in stage 0 (which keeps everything), else `rank`.
    own_rank: usize,
    layers: Vec<LayerInfo>,
    shard_total: usize,
    max_shard: usize,
    /// Working parameters (f32, or bf16 in mixed precision), full replica (stages 0–2).
    full_params: Option<CpuTensor>,
    /// Working parameter shard (stage 3).
    shard_params: Option<CpuTensor>,
    /// Mixed precision only: f32 masters, whole (stage 0) or sharded (stages 1–3).
    masters: Option<CpuTensor>,
    /// Local gradient accumulation, full (stages 0–1).
    full_grads: Option<CpuTensor>,
    /// Reduced gradient shard (stages 2–3).
    grad_shard: Option<CpuTensor>,
    opt_state: Option<CpuTensor>,
    state_per_param: Option<usize>,
    plan: BucketPlan,
    /// Per layer: offset of its shard inside its bucket's per-rank segment.
    bucket_inner: Vec<usize>,
    /// Per bucket: length of one rank's segment.
    bucket_seg: Vec<usize>,
    open: Vec<Option<OpenBucket>>,
    in_flight: VecDeque<Pending>,
    pushed: Vec<bool>,
    pushed_count: usize,
    param_layers: usize,
    micro_batches: u64,
    steps: u64,
    gathered: Vec<Gathered>,
}

fn elem_dtype(p: Precision) -> DType {
    match p {
        Precision::Fp32 => DType::F32,
        Precision::MixedBf16 => DType::BF16,
    }
}

fn alloc(cpu: &Cpu, category: MemoryCategory, len: usize, dtype: DType) -> Result<CpuTensor> {
    let _c = category.enter();
    Ok(cpu.zeros([len], dtype)?)
}

/// A tensor's elements as a collective buffer (f32 or bf16 bits).
fn buf(t: &CpuTensor) -> Result<Buf<'_>, headroom_tensor::Error> {
    if t.dtype() == DType::BF16 {
        Ok(Buf::Bf16(t.as_slice::<bf16>()?.reinterpret_cast()))
    } else {
        Ok(Buf::F32(t.as_slice::<f32>()?))
    }
}

fn buf_mut(t: &mut CpuTensor) -> Result<BufMut<'_>, headroom_tensor::Error> {
    if t.dtype() == DType::BF16 {
        Ok(BufMut::Bf16(
            t.as_mut_slice::<bf16>()?.reinterpret_cast_mut(),
        ))
    } else {
        Ok(BufMut::F32(t.as_mut_slice::<f32>()?))
    }
}

fn field(t: &Option<CpuTensor>) -> Result<Buf<'_>> {
    Ok(buf(t.as_ref().ok_or(ZeroError::Broken)?)?)
}

fn field_mut(t: &mut Option<CpuTensor>) -> Result<BufMut<'_>> {
    Ok(buf_mut(t.as_mut().ok_or(ZeroError::Broken)?)?)
}

fn f32_field(t: &Option<CpuTensor>) -> Result<&[f32]> {
    Ok(t.as_ref().ok_or(ZeroError::Broken)?.as_slice::<f32>()?)
}

fn f32_field_mut(t: &mut Option<CpuTensor>) -> Result<&mut [f32]> {
    Ok(t.as_mut().ok_or(ZeroError::Broken)?.as_mut_slice::<f32>()?)
}

fn part(b: Buf<'_>, r: Range<usize>) -> Result<Buf<'_>> {
    b.get(r).ok_or(ZeroError::Broken)
}

fn part_mut<'a>(b: &'a mut BufMut<'_>, r: Range<usize>) -> Result<BufMut<'a>> {
    b.get_mut(r).ok_or(ZeroError::Broken)
}

fn f32s(s: &[f32], r: Range<usize>) -> Result<&[f32]> {
    s.get(r).ok_or(ZeroError::Broken)
}

fn f32s_mut(s: &mut [f32], r: Range<usize>) -> Result<&mut [f32]> {
    s.get_mut(r).ok_or(ZeroError::Broken)
}

fn off(base: usize, r: &Range<usize>) -> Range<usize> {
    base + r.start..base + r.end
}

/// `dst = src` (same element type).
fn copy_buf(dst: BufMut<'_>, src: Buf<'_>) {
    match (dst, src) {
        (BufMut::F32(d), Buf::F32(s)) => d.iter_mut().zip(s).for_each(|(d, &s)| *d = s),
        (BufMut::Bf16(d), Buf::Bf16(s)) => d.iter_mut().zip(s).for_each(|(d, &s)| *d = s),
        _ => {}
    }
}

/// `dst = src` rounded to `dst`'s type (nearest-even for bf16).
fn store_f32(dst: BufMut<'_>, src: &[f32]) {
    match dst {
        BufMut::F32(d) => d.iter_mut().zip(src).for_each(|(d, &s)| *d = s),
        BufMut::Bf16(d) => d
            .iter_mut()
            .zip(src)
            .for_each(|(d, &s)| *d = bf16::from_f32(s).to_bits()),
    }
}

/// `dst += src`, added in f32 and rounded once to `dst`'s type.
fn add_f32(dst: BufMut<'_>, src: &[f32]) {
    match dst {
        BufMut::F32(d) => d.iter_mut().zip(src).for_each(|(d, &s)| *d += s),
        BufMut::Bf16(d) => d.iter_mut().zip(src).for_each(|(d, &s)| {
            *d = bf16::from_f32(bf16::from_bits(*d).to_f32() + s).to_bits();
        }),
    }
}

/// `dst += src` (same element type), added in f32 and rounded once.
fn add_buf(dst: BufMut<'_>, src: Buf<'_>) {
    match (dst, src) {
        (BufMut::F32(d), Buf::F32(s)) => d.iter_mut().zip(s).for_each(|(d, &s)| *d += s),
        (BufMut::Bf16(d), Buf::Bf16(s)) => d.iter_mut().zip(s).for_each(|(d, &s)| {
            let sum = bf16::from_bits(*d).to_f32() + bf16::from_bits(s).to_f32();
            *d = bf16::from_f32(sum).to_bits();
        }),
        _ => {}
    }
}

/// `dst = src` widened to f32.
fn load_f32(src: Buf<'_>, dst: &mut [f32]) {
    match src {
        Buf::F32(s) => dst.iter_mut().zip(s).for_each(|(d, &s)| *d = s),
        Buf::Bf16(s) => dst
            .iter_mut()
            .zip(s)
            .for_each(|(d, &s)| *d = bf16::from_bits(s).to_f32()),
    }
}

fn backend_err(e: headroom_tensor::Error) -> CommError {
    CommError::Backend {
        source: Box::new(e),
    }
}

/// `f` on the contents of two tensors, inside a communication job.
fn with_bufs(
    a: &CpuTensor,
    b: &mut CpuTensor,
    f: impl FnOnce(Buf<'_>, BufMut<'_>) -> Result<(), CommError>,
) -> Result<(), CommError> {
    let a = buf(a).map_err(backend_err)?;
    let b = buf_mut(b).map_err(backend_err)?;
    f(a, b)
}

fn span_err() -> CommError {
    CommError::Backend {
        source: "buffer span out of range".into(),
    }
}

impl ZeroEngine {
    /// An engine for a model whose layer `l` has tensors of `layers[l][t]` elements, on
    /// `cpu` (whose allocation hook sees this rank's memory), communicating through `comm`
    /// (moved onto a communication thread). Parameters start at zero; set them with
    /// [`load_layer`](Self::load_layer). Allocates the persistent parameter and gradient
    /// buffers of the stage (and the masters in mixed precision); optimizer state is
    /// allocated at the first step.
    pub fn new<C: Collective + 'static>(
        cpu: Cpu,
        comm: C,
        layers: &[Vec<usize>],
        config: ZeroConfig,
    ) -> Result<Self> {
        Self::with_state_on(cpu.clone(), cpu, comm, layers, config)
    }

    /// [`new`](Self::new) with the optimizer state — and, in mixed precision, the fp32
    /// masters — on `state` from the start (ZeRO-Offload: another backend, whose allocation
    /// hook is the host's ledger): nothing of it is ever allocated on `cpu`, not even
    /// transiently, as a later [`offload_state`](Self::offload_state) would.
    pub fn with_state_on<C: Collective + 'static>(
        cpu: Cpu,
        state: Cpu,
        comm: C,
        layers: &[Vec<usize>],
        config: ZeroConfig,
    ) -> Result<Self> {
        let (rank, world) = (comm.rank(), comm.world_size());
        if world == 0 || rank >= world {
            return Err(ZeroError::InvalidConfig(format!(
                "rank {rank} of a world of {world}"
            )));
        }
        if config.max_in_flight == 0 {
            return Err(ZeroError::InvalidConfig(
                "max_in_flight must be at least 1".into(),
            ));
        }
        let stage = config.stage;
        let (layout_world, own_rank) = if stage.shards_optimizer() {
            (world, rank)
        } else {
            (1, 0)
        };
        let overflow = |what| ZeroError::SizeOverflow { what };
        let mut infos = Vec::with_capacity(layers.len());
        let (mut storage, mut shard_total, mut max_shard) = (0usize, 0usize, 0usize);
        for sizes in layers {
            let layout = FlatLayout::new(sizes, layout_world)?;
            let own_pieces = layout.shard_pieces(own_rank);
            let tensor_pieces = (0..sizes.len()).map(|t| layout.tensor_pieces(t)).collect();
            let info = LayerInfo {
                storage_off: storage,
                shard_off: shard_total,
                own_pieces,
                tensor_pieces,
                layout,
            };
            storage = storage
                .checked_add(info.layout.padded_len())
                .ok_or(overflow("parameter storage"))?;
            shard_total = shard_total
                .checked_add(info.layout.shard_len())
                .ok_or(overflow("shard storage"))?;
            max_shard = max_shard.max(info.layout.shard_len());
            infos.push(info);
        }
        shard_total
            .checked_mul(4)
            .ok_or(overflow("shard storage"))?;
        storage
            .checked_mul(4)
            .ok_or(overflow("parameter storage"))?;

        let dt = elem_dtype(config.precision);
        let (params, grads) = (MemoryCategory::Parameters, MemoryCategory::Gradients);
        let (full_params, full_grads, shard_params, grad_shard) = match stage {
            Stage::Zero0 | Stage::Zero1 => (
                Some(alloc(&cpu, params, storage, dt)?),
                Some(alloc(&cpu, grads, storage, dt)?),
                None,
                None,
            ),
            Stage::Zero2 => (
                Some(alloc(&cpu, params, storage, dt)?),
                None,
                None,
                Some(alloc(&cpu, grads, shard_total, dt)?),
            ),
            Stage::Zero3 => (
                None,
                None,
                Some(alloc(&cpu, params, shard_total, dt)?),
                Some(alloc(&cpu, grads, shard_total, dt)?),
            ),
        };
        // Masters are optimizer state in the ZeRO paper's accounting (its K).
        let masters = match config.precision {
            Precision::Fp32 => None,
            Precision::MixedBf16 => Some(alloc(
                &state,
                MemoryCategory::OptimizerState,
                shard_total,
                DType::F32,
            )?),
        };

        let padded_bytes: Vec<usize> = infos
            .iter()
            .map(|i| {
                i.layout
                    .padded_len()
                    .saturating_mul(config.precision.grad_bytes())
            })
            .collect();
        let plan = BucketPlan::new(&padded_bytes, config.bucket_bytes);
        let mut bucket_inner = vec![0; infos.len()];
        let mut bucket_seg = Vec::with_capacity(plan.buckets().len());
        for bucket in plan.buckets() {
            let mut seg = 0usize;
            for &l in bucket {
                bucket_inner[l] = seg;
                seg += infos[l].layout.shard_len();
            }
            bucket_seg.push(seg);
        }
        let param_layers = infos.iter().filter(|i| i.layout.numel() > 0).count();
        let n_layers = infos.len();
        let n_buckets = plan.buckets().len();
        Ok(ZeroEngine {
            state_cpu: state,
            cpu,
            comm: CommThread::spawn(comm)?,
            config,
            rank,
            world,
            own_rank,
            layers: infos,
            shard_total,
            max_shard,
            full_params,
            shard_params,
            masters,
            full_grads,
            grad_shard,
            opt_state: None,
            state_per_param: None,
            plan,
            bucket_inner,
            bucket_seg,
            open: (0..n_buckets).map(|_| None).collect(),
            in_flight: VecDeque::new(),
            pushed: vec![false; n_layers],
            pushed_count: 0,
            param_layers,
            micro_batches: 0,
            steps: 0,
            gathered: (0..n_layers).map(|_| Gathered::Empty).collect(),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }
    /// The configuration.
    pub fn config(&self) -> &ZeroConfig {
        &self.config
    }
    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }
    /// Micro-batches whose gradients are complete since the last step.
    pub fn micro_batches(&self) -> u64 {
        self.micro_batches
    }
    /// The gradient buckets (stages 2–3 use them).
    pub fn bucket_plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// Layer `l`'s flat layout: over the world in stages 1–3, over one rank in stage 0
    /// (which shards nothing).
    pub fn layout(&self, l: usize) -> Result<&FlatLayout> {
        Ok(&self.layer(l)?.layout)
    }

    fn layer(&self, l: usize) -> Result<&LayerInfo> {
        self.layers.get(l).ok_or(ZeroError::LayerOutOfRange {
            layer: l,
            layers: self.layers.len(),
        })
    }

    fn dtype(&self) -> DType {
        elem_dtype(self.config.precision)
    }

    /// Where this rank's shard of layer `info` starts in the working parameters.
    fn working_base(&self, info: &LayerInfo) -> usize {
        if self.config.stage.shards_parameters() {
            info.shard_off
        } else {
            info.storage_off + self.own_rank * info.layout.shard_len()
        }
    }

    fn check_tensors(&self, l: usize, values: &[&[f32]]) -> Result<()> {
        let layout = &self.layer(l)?.layout;
        if values.len() != layout.num_tensors() {
            return Err(ZeroError::Shape {
                layer: l,
                what: "number of tensors",
                expected: layout.num_tensors(),
                got: values.len(),
            });
        }
        for (v, &n) in values.iter().zip(layout.sizes()) {
            if v.len() != n {
                return Err(ZeroError::Shape {
                    layer: l,
                    what: "tensor length",
                    expected: n,
                    got: v.len(),
                });
            }
        }
        Ok(())
    }

    /// Set layer `l`'s parameters from its full f32 tensors (every rank passes the same
    /// values and keeps the part its stage needs; in mixed precision the masters take them
    /// as they are and the working copy rounded). Local: no communication.
    pub fn load_layer(&mut self, l: usize, values: &[&[f32]]) -> Result<()> {
        self.check_tensors(l, values)?;
        let info = &self.layers[l];
        let base = self.working_base(info);
        if let Some(m) = self.masters.as_mut() {
            let masters = m.as_mut_slice::<f32>()?;
            for p in &info.own_pieces {
                let src = values
                    .get(p.tensor)
                    .and_then(|v| v.get(p.tensor_range.clone()))
                    .ok_or(ZeroError::Broken)?;
                f32s_mut(masters, off(info.shard_off, &p.shard_range))?.copy_from_slice(src);
            }
        }
        if self.config.stage.shards_parameters() {
            let mut working = field_mut(&mut self.shard_params)?;
            for p in &info.own_pieces {
                let src = values
                    .get(p.tensor)
                    .and_then(|v| v.get(p.tensor_range.clone()))
                    .ok_or(ZeroError::Broken)?;
                store_f32(part_mut(&mut working, off(base, &p.shard_range))?, src);
            }
        } else {
            let mut working = field_mut(&mut self.full_params)?;
            for (t, v) in values.iter().enumerate() {
                let r = info.layout.tensor_range(t).ok_or(ZeroError::Broken)?;
                store_f32(part_mut(&mut working, off(info.storage_off, &r))?, v);
            }
        }
        Ok(())
    }

    /// Stage 3: make layer `l`'s full parameters available (waiting for a prefetch, or
    /// all-gathering now). Call before the layer's forward, its backward, and any
    /// recomputation. Stages 0–2 keep full parameters: a no-op there.
    pub fn gather(&mut self, l: usize) -> Result<()> {
        self.layer(l)?;
        if !self.config.stage.shards_parameters() {
            return Ok(());
        }
        let state = std::mem::replace(&mut self.gathered[l], Gathered::Empty);
        let tensor = match state {
            Gathered::Ready(t) => t,
            Gathered::InFlight(h) => Self::finish_gather(h)?,
            Gathered::Empty => Self::finish_gather(self.submit_gather(l)?)?,
        };
        self.gathered[l] = Gathered::Ready(tensor);
        Ok(())
    }

    /// Stage 3: start all-gathering layer `l`'s parameters in the background (typically the
    /// next layer's, while this one computes); [`gather`](Self::gather) waits for it. A
    /// no-op if already gathered or in flight, and in stages 0–2.
    pub fn prefetch(&mut self, l: usize) -> Result<()> {
        self.layer(l)?;
        if !self.config.stage.shards_parameters() {
            return Ok(());
        }
        if matches!(self.gathered[l], Gathered::Empty) {
            let h = self.submit_gather(l)?;
            self.gathered[l] = Gathered::InFlight(h);
        }
        Ok(())
    }

    /// Stage 3: free layer `l`'s gathered parameters (waiting for a prefetch still in
    /// flight). A no-op if not gathered, and in stages 0–2.
    pub fn release(&mut self, l: usize) -> Result<()> {
        self.layer(l)?;
        if !self.config.stage.shards_parameters() {
            return Ok(());
        }
        match std::mem::replace(&mut self.gathered[l], Gathered::Empty) {
            Gathered::InFlight(h) => drop(Self::finish_gather(h)?),
            Gathered::Ready(t) => drop(t),
            Gathered::Empty => {}
        }
        Ok(())
    }

    fn submit_gather(&mut self, l: usize) -> Result<Handle<GatherResult>> {
        let info = &self.layers[l];
        let (k, padded) = (info.layout.shard_len(), info.layout.padded_len());
        let dt = self.dtype();
        let out = alloc(&self.cpu, MemoryCategory::Parameters, padded, dt)?;
        let mut input = alloc(&self.cpu, MemoryCategory::Workspace, k, dt)?;
        copy_buf(
            buf_mut(&mut input)?,
            part(
                field(&self.shard_params)?,
                info.shard_off..info.shard_off + k,
            )?,
        );
        Ok(self.comm.submit(move |c| {
            let mut out = out;
            let r = with_bufs(&input, &mut out, |i, o| c.all_gather(i, o));
            (out, input, r)
        })?)
    }

    fn finish_gather(h: Handle<GatherResult>) -> Result<CpuTensor> {
        let (t, sent, r) = h.wait()?;
        drop(sent);
        r?;
        Ok(t)
    }

    fn param_buf(&self, l: usize) -> Result<Buf<'_>> {
        let info = self.layer(l)?;
        let n = info.layout.numel();
        if self.config.stage.shards_parameters() {
            match &self.gathered[l] {
                Gathered::Ready(t) => part(buf(t)?, 0..n),
                _ => Err(ZeroError::NotGathered { layer: l }),
            }
        } else {
            part(
                field(&self.full_params)?,
                info.storage_off..info.storage_off + n,
            )
        }
    }

    /// Layer `l`'s f32 parameters as one flat slice (the layer's tensors end to end, no
    /// padding), for its forward or backward. Stage 3: only between
    /// [`gather`](Self::gather) and [`release`](Self::release), else
    /// [`ZeroError::NotGathered`]. In mixed precision use [`params_bf16`](Self::params_bf16).
    pub fn params(&self, l: usize) -> Result<&[f32]> {
        match self.param_buf(l)? {
            Buf::F32(s) => Ok(s),
            Buf::Bf16(_) => Err(ZeroError::Precision {
                wanted: Precision::Fp32,
                engine: self.config.precision,
            }),
        }
    }

    /// Mixed precision: layer `l`'s bf16 working parameters (bit patterns), as
    /// [`params`](Self::params).
    pub fn params_bf16(&self, l: usize) -> Result<&[u16]> {
        match self.param_buf(l)? {
            Buf::Bf16(s) => Ok(s),
            Buf::F32(_) => Err(ZeroError::Precision {
                wanted: Precision::MixedBf16,
                engine: self.config.precision,
            }),
        }
    }

    fn tensor_range(&self, l: usize, t: usize) -> Result<Range<usize>> {
        let layout = &self.layer(l)?.layout;
        layout.tensor_range(t).ok_or(ZeroError::Shape {
            layer: l,
            what: "tensor index",
            expected: layout.num_tensors(),
            got: t,
        })
    }

    /// Tensor `t` of layer `l` (see [`params`](Self::params)).
    pub fn tensor(&self, l: usize, t: usize) -> Result<&[f32]> {
        let r = self.tensor_range(l, t)?;
        f32s(self.params(l)?, r)
    }

    /// Tensor `t` of layer `l` in bf16 (see [`params_bf16`](Self::params_bf16)).
    pub fn tensor_bf16(&self, l: usize, t: usize) -> Result<&[u16]> {
        let r = self.tensor_range(l, t)?;
        self.params_bf16(l)?.get(r).ok_or(ZeroError::Broken)
    }

    /// Hand over layer `l`'s f32 gradients of the current micro-batch, one slice per tensor,
    /// once per layer per micro-batch, in any layer order (backward order lets buckets go out
    /// early). Stages 0–1 add them to the local gradient buffer; stages 2–3 pack them into
    /// the layer's bucket and reduce-scatter the bucket in the background once all its layers
    /// are in. When every layer has pushed, the micro-batch is complete (stages 2–3 wait for
    /// their buckets then). In mixed precision gradients are rounded to bf16 on entry and
    /// after every sum.
    pub fn push_grads(&mut self, l: usize, grads: &[&[f32]]) -> Result<()> {
        self.check_tensors(l, grads)?;
        if self.layers[l].layout.numel() == 0 {
            return Ok(());
        }
        if self.pushed[l] {
            return Err(ZeroError::GradsPushedTwice { layer: l });
        }
        if self.config.stage.shards_gradients() {
            self.pack_into_bucket(l, grads)?;
        } else {
            let info = &self.layers[l];
            let mut full = field_mut(&mut self.full_grads)?;
            for (t, g) in grads.iter().enumerate() {
                let r = info.layout.tensor_range(t).ok_or(ZeroError::Broken)?;
                add_f32(part_mut(&mut full, off(info.storage_off, &r))?, g);
            }
        }
        self.pushed[l] = true;
        self.pushed_count += 1;
        if self.pushed_count == self.param_layers {
            while !self.in_flight.is_empty() {
                self.wait_oldest()?;
            }
            self.pushed.iter_mut().for_each(|p| *p = false);
            self.pushed_count = 0;
            self.micro_batches += 1;
        }
        Ok(())
    }

    fn pack_into_bucket(&mut self, l: usize, grads: &[&[f32]]) -> Result<()> {
        let b = self.plan.bucket_of(l).ok_or(ZeroError::Broken)?;
        let seg = self.bucket_seg[b];
        let dt = self.dtype();
        if self.open[b].is_none() {
            let len = seg.checked_mul(self.world).ok_or(ZeroError::SizeOverflow {
                what: "gradient bucket",
            })?;
            self.open[b] = Some(OpenBucket {
                buf: alloc(&self.cpu, MemoryCategory::Gradients, len, dt)?,
                remaining: self.plan.buckets()[b].len(),
            });
        }
        let inner = self.bucket_inner[l];
        let info = &self.layers[l];
        let open = self.open[b].as_mut().ok_or(ZeroError::Broken)?;
        let mut bucket = buf_mut(&mut open.buf)?;
        // Rank r's segment holds, for each layer of the bucket, that layer's shard r; the
        // reduce-scatter then hands each rank its shards of all the bucket's layers.
        for (pieces, g) in info.tensor_pieces.iter().zip(grads) {
            for p in pieces {
                let at = p.rank * seg + inner;
                let src = g.get(p.tensor_range.clone()).ok_or(ZeroError::Broken)?;
                store_f32(part_mut(&mut bucket, off(at, &p.shard_range))?, src);
            }
        }
        open.remaining -= 1;
        if open.remaining == 0 {
            let open = self.open[b].take().ok_or(ZeroError::Broken)?;
            while self.in_flight.len() >= self.config.max_in_flight {
                self.wait_oldest()?;
            }
            let out = alloc(&self.cpu, MemoryCategory::Workspace, seg, dt)?;
            let handle = self.comm.submit(move |c| {
                let (bucket, mut out) = (open.buf, out);
                let r = with_bufs(&bucket, &mut out, |i, o| c.reduce_scatter(i, o));
                (bucket, out, r)
            })?;
            self.in_flight.push_back(Pending { bucket: b, handle });
        }
        Ok(())
    }

    fn wait_oldest(&mut self) -> Result<()> {
        let Some(p) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let (bucket, out, r) = p.handle.wait()?;
        drop(bucket);
        r?;
        let out = buf(&out)?;
        let mut shard = field_mut(&mut self.grad_shard)?;
        for &l in &self.plan.buckets()[p.bucket] {
            let info = &self.layers[l];
            let k = info.layout.shard_len();
            let inner = self.bucket_inner[l];
            add_buf(
                part_mut(&mut shard, info.shard_off..info.shard_off + k)?,
                part(out, inner..inner + k)?,
            );
        }
        Ok(())
    }

    /// Finish the step: reduce the accumulated gradients over ranks (stage 0 all-reduce,
    /// stage 1 reduce-scatter; stages 2–3 already did), update this rank's shard with `opt`
    /// piece by piece (the masters, in mixed precision, then refresh the working copy),
    /// all-gather the updated parameters (stages 1–2; stage 3 gathers at the next forward),
    /// and zero the gradients. Gradients are sums over ranks and micro-batches in
    /// [`Stage::reduction_order`]; scale the loss for a mean.
    pub fn step(&mut self, opt: &mut dyn ShardOptimizer) -> Result<()> {
        self.step_inner(opt, None).map(|_| ())
    }

    /// [`step`](Self::step) with the summed gradients clipped to a global L2 norm of at most
    /// `max_norm` first (torch's `clip_grad_norm_`: multiplied by `max_norm / (norm + 1e-6)`
    /// when that is below 1). The norm is taken over every rank's shard: each rank sums the
    /// squares of its own pieces in f64, and the partial sums are added in rank order, so
    /// every rank clips by the same factor. Returns the norm and the factor.
    pub fn step_clipped(
        &mut self,
        opt: &mut dyn ShardOptimizer,
        max_norm: f32,
    ) -> Result<StepReport> {
        if !(max_norm > 0.0 && max_norm.is_finite()) {
            return Err(ZeroError::InvalidConfig(format!(
                "max_norm must be positive and finite, got {max_norm}"
            )));
        }
        self.step_inner(opt, Some(max_norm))?
            .ok_or(ZeroError::Broken)
    }

    fn step_inner(
        &mut self,
        opt: &mut dyn ShardOptimizer,
        max_norm: Option<f32>,
    ) -> Result<Option<StepReport>> {
        if self.pushed_count > 0 {
            let missing = (0..self.layers.len())
                .filter(|&l| !self.pushed[l] && self.layers[l].layout.numel() > 0)
                .collect();
            return Err(ZeroError::IncompleteBackward { missing });
        }
        if self.micro_batches == 0 {
            return Err(ZeroError::NoGradients);
        }
        let spp = opt.state_per_param();
        self.ensure_state(spp)?;

        let mut reduced = self.reduce_gradients()?;
        let report = match max_norm {
            Some(max_norm) => Some(self.clip(max_norm, reduced.as_mut())?),
            None => None,
        };
        self.update(opt, spp, reduced.as_ref())?;
        drop(reduced);
        if matches!(self.config.stage, Stage::Zero1 | Stage::Zero2) {
            self.gather_updated()?;
        }

        if let Some(g) = self.full_grads.as_mut() {
            self.cpu.fill_zero(g)?;
        }
        if let Some(g) = self.grad_shard.as_mut() {
            self.cpu.fill_zero(g)?;
        }
        self.micro_batches = 0;
        self.steps += 1;
        Ok(report)
    }

    /// Where this rank's reduced gradients of layer `info` start in the reduced buffer.
    fn grad_base(&self, info: &LayerInfo) -> usize {
        if self.config.stage == Stage::Zero0 {
            info.storage_off
        } else {
            info.shard_off
        }
    }

    fn clip(&mut self, max_norm: f32, reduced: Option<&mut CpuTensor>) -> Result<StepReport> {
        let stage = self.config.stage;
        let spans: Vec<Range<usize>> = self
            .layers
            .iter()
            .flat_map(|i| {
                let base = self.grad_base(i);
                i.own_pieces.iter().map(move |p| off(base, &p.shard_range))
            })
            .collect();
        let mut grads: BufMut<'_> = match stage {
            Stage::Zero0 => field_mut(&mut self.full_grads)?,
            Stage::Zero1 => buf_mut(reduced.ok_or(ZeroError::Broken)?)?,
            Stage::Zero2 | Stage::Zero3 => field_mut(&mut self.grad_shard)?,
        };
        let mut local = 0.0f64;
        for r in &spans {
            match part(grads.as_buf(), r.clone())? {
                Buf::F32(g) => g.iter().for_each(|&x| local += f64::from(x) * f64::from(x)),
                Buf::Bf16(g) => g.iter().for_each(|&b| {
                    let x = f64::from(bf16::from_bits(b).to_f32());
                    local += x * x;
                }),
            }
        }
        let sum_squares = if stage.shards_optimizer() {
            // An f64 travels as two f32s (high part and remainder): exact to about 48 bits,
            // and the per-rank partials are added in rank order on every rank.
            let hi = local as f32;
            let lo = (local - f64::from(hi)) as f32;
            let parts = self.comm.run(move |c| {
                let mut all = vec![0.0f32; 2 * c.world_size()];
                c.all_gather(Buf::F32(&[hi, lo]), BufMut::F32(&mut all))
                    .map(|()| all)
            })??;
            parts
                .chunks_exact(2)
                .map(|p| f64::from(p[0]) + f64::from(p[1]))
                .sum()
        } else {
            // Stage 0: every rank holds the whole reduced gradient.
            local
        };
        let grad_norm = sum_squares.sqrt();
        let factor = (f64::from(max_norm) / (grad_norm + 1e-6)) as f32;
        let clip_factor = if factor < 1.0 { factor } else { 1.0 };
        if clip_factor < 1.0 {
            for r in &spans {
                match part_mut(&mut grads, r.clone())? {
                    BufMut::F32(g) => g.iter_mut().for_each(|x| *x *= clip_factor),
                    BufMut::Bf16(g) => g.iter_mut().for_each(|b| {
                        let x = bf16::from_bits(*b).to_f32() * clip_factor;
                        *b = bf16::from_f32(x).to_bits();
                    }),
                }
            }
        }
        Ok(StepReport {
            grad_norm,
            clip_factor,
        })
    }

    /// Stage 0: all-reduce the local gradients in place. Stage 1: reduce-scatter them into a
    /// transient shard, returned.
    fn reduce_gradients(&mut self) -> Result<Option<CpuTensor>> {
        match self.config.stage {
            Stage::Zero0 => {
                let grads = self.full_grads.take().ok_or(ZeroError::Broken)?;
                let (grads, r) = self.comm.run(move |c| {
                    let mut grads = grads;
                    let r = buf_mut(&mut grads)
                        .map_err(backend_err)
                        .and_then(|g| c.all_reduce(g));
                    (grads, r)
                })?;
                self.full_grads = Some(grads);
                r?;
                Ok(None)
            }
            Stage::Zero1 => {
                let grads = self.full_grads.take().ok_or(ZeroError::Broken)?;
                let reduced = alloc(
                    &self.cpu,
                    MemoryCategory::Workspace,
                    self.shard_total,
                    self.dtype(),
                )?;
                let spans: Vec<(Range<usize>, Range<usize>)> = self
                    .layers
                    .iter()
                    .filter(|i| i.layout.padded_len() > 0)
                    .map(|i| {
                        (
                            i.storage_off..i.storage_off + i.layout.padded_len(),
                            i.shard_off..i.shard_off + i.layout.shard_len(),
                        )
                    })
                    .collect();
                let (grads, reduced, r) = self.comm.run(move |c| {
                    let mut reduced = reduced;
                    let r = with_bufs(&grads, &mut reduced, |g, mut out| {
                        for (src, dst) in spans {
                            let i = g.get(src).ok_or_else(span_err)?;
                            let o = out.get_mut(dst).ok_or_else(span_err)?;
                            c.reduce_scatter(i, o)?;
                        }
                        Ok(())
                    });
                    (grads, reduced, r)
                })?;
                self.full_grads = Some(grads);
                r?;
                Ok(Some(reduced))
            }
            Stage::Zero2 | Stage::Zero3 => Ok(None),
        }
    }

    fn update(
        &mut self,
        opt: &mut dyn ShardOptimizer,
        spp: usize,
        reduced: Option<&CpuTensor>,
    ) -> Result<()> {
        let stage = self.config.stage;
        let step = self.steps + 1;
        let bases: Vec<usize> = self.layers.iter().map(|i| self.working_base(i)).collect();
        let g_bases: Vec<usize> = self.layers.iter().map(|i| self.grad_base(i)).collect();
        let mixed = self.masters.is_some();
        // Mixed precision: each piece's gradients widened to f32 here.
        let mut scratch = if mixed {
            let longest = self
                .layers
                .iter()
                .flat_map(|i| i.own_pieces.iter().map(|p| p.shard_range.len()))
                .max()
                .unwrap_or(0);
            Some(alloc(
                &self.cpu,
                MemoryCategory::Workspace,
                longest,
                DType::F32,
            )?)
        } else {
            None
        };
        let state = f32_field_mut(&mut self.opt_state)?;
        let grads: Buf<'_> = match stage {
            Stage::Zero0 => field(&self.full_grads)?,
            Stage::Zero1 => buf(reduced.ok_or(ZeroError::Broken)?)?,
            Stage::Zero2 | Stage::Zero3 => field(&self.grad_shard)?,
        };
        let mut working = if stage.shards_parameters() {
            field_mut(&mut self.shard_params)?
        } else {
            field_mut(&mut self.full_params)?
        };
        let mut masters = match self.masters.as_mut() {
            Some(m) => Some(m.as_mut_slice::<f32>()?),
            None => None,
        };
        for (l, info) in self.layers.iter().enumerate() {
            let g_base = g_bases[l];
            for piece in &info.own_pieces {
                let sr = &piece.shard_range;
                let g = part(grads, off(g_base, sr))?;
                let s = f32s_mut(
                    state,
                    (info.shard_off + sr.start) * spp..(info.shard_off + sr.end) * spp,
                )?;
                let up = UpdatePiece {
                    step,
                    layer: l,
                    tensor: piece.tensor,
                    tensor_range: piece.tensor_range.clone(),
                };
                let fail = |source| ZeroError::Optimizer {
                    layer: l,
                    tensor: piece.tensor,
                    source,
                };
                let w = part_mut(&mut working, off(bases[l], sr))?;
                match (masters.as_deref_mut(), scratch.as_mut(), w, g) {
                    (None, _, BufMut::F32(p), Buf::F32(g)) => {
                        opt.update(&up, p, g, s).map_err(fail)?;
                    }
                    (Some(m), Some(tmp), w, g) => {
                        let m = f32s_mut(m, off(info.shard_off, sr))?;
                        let tmp = f32s_mut(tmp.as_mut_slice::<f32>()?, 0..sr.len())?;
                        load_f32(g, tmp);
                        opt.update(&up, m, tmp, s).map_err(fail)?;
                        store_f32(w, m);
                    }
                    _ => return Err(ZeroError::Broken),
                }
            }
        }
        Ok(())
    }

    /// Stages 1–2: every rank's updated shard of every layer into the full replicas.
    fn gather_updated(&mut self) -> Result<()> {
        let params = self.full_params.take().ok_or(ZeroError::Broken)?;
        let scratch = alloc(
            &self.cpu,
            MemoryCategory::Workspace,
            self.max_shard,
            self.dtype(),
        )?;
        let rank = self.rank;
        let spans: Vec<(usize, usize)> = self
            .layers
            .iter()
            .filter(|i| i.layout.padded_len() > 0)
            .map(|i| (i.storage_off, i.layout.shard_len()))
            .collect();
        let (params, r) = self.comm.run(move |c| {
            let (mut params, mut scratch) = (params, scratch);
            let r = (|| -> Result<(), CommError> {
                let mut full = buf_mut(&mut params).map_err(backend_err)?;
                let mut tmp = buf_mut(&mut scratch).map_err(backend_err)?;
                for (at, k) in spans {
                    let n = k * c.world_size();
                    let own = full
                        .as_buf()
                        .get(at + rank * k..at + (rank + 1) * k)
                        .ok_or_else(span_err)?;
                    copy_buf(tmp.get_mut(0..k).ok_or_else(span_err)?, own);
                    let dst = full.get_mut(at..at + n).ok_or_else(span_err)?;
                    c.all_gather(tmp.as_buf().get(0..k).ok_or_else(span_err)?, dst)?;
                }
                Ok(())
            })();
            (params, r)
        })?;
        self.full_params = Some(params);
        Ok(r?)
    }

    /// Every rank's `x`, in rank order (every rank calls it and gets the same list). An f64
    /// travels as three f32s — its value rounded to f32, then the remainder, twice — which
    /// hold all 53 bits of any f64 whose magnitude is within f32's normal range (losses,
    /// counters): it arrives bit for bit.
    pub fn gather_scalars(&mut self, x: f64) -> Result<Vec<f64>> {
        let hi = x as f32;
        let r = x - f64::from(hi);
        let mid = r as f32;
        let lo = (r - f64::from(mid)) as f32;
        let parts = self.comm.run(move |c| {
            let mut all = vec![0.0f32; 3 * c.world_size()];
            c.all_gather(Buf::F32(&[hi, mid, lo]), BufMut::F32(&mut all))
                .map(|()| all)
        })??;
        Ok(parts
            .chunks_exact(3)
            .map(|p| f64::from(p[0]) + f64::from(p[1]) + f64::from(p[2]))
            .collect())
    }

    /// ZeRO-Offload: keep this rank's optimizer state — and, in mixed precision, its fp32
    /// masters — on `host` (another backend, whose allocation hook is the host's ledger)
    /// instead of the engine's backend. What is already there moves over, values kept; the
    /// optimizer runs on the host, where the state is. Local.
    pub fn offload_state(&mut self, host: Cpu) -> Result<()> {
        let mv = |t: &mut Option<CpuTensor>| -> Result<()> {
            if let Some(old) = t.take() {
                let mut new = alloc(
                    &host,
                    MemoryCategory::OptimizerState,
                    old.numel(),
                    DType::F32,
                )?;
                new.as_mut_slice::<f32>()?
                    .copy_from_slice(old.as_slice::<f32>()?);
                *t = Some(new);
            }
            Ok(())
        };
        mv(&mut self.masters)?;
        mv(&mut self.opt_state)?;
        self.state_cpu = host;
        Ok(())
    }

    /// Wait until every rank has called this (after the collectives submitted before it).
    pub fn barrier(&mut self) -> Result<()> {
        Ok(self.comm.run(|c| c.barrier())??)
    }

    /// Continue a run at `steps` completed optimizer steps (a resume from a checkpoint): the
    /// next [`step`](Self::step) hands the optimizer step `steps + 1`.
    pub fn resume_at(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// Which elements of which of layer `l`'s tensors [`export_layer`](Self::export_layer)
    /// returns, in its order, as `(tensor, tensor_range)`, copying nothing: a writer lays out
    /// a file from them before exporting one layer at a time.
    pub fn export_geometry(&self, l: usize) -> Result<Vec<(usize, Range<usize>)>> {
        let info = self.layer(l)?;
        if self.config.stage == Stage::Zero0 && self.rank != 0 {
            return Ok(Vec::new());
        }
        Ok(info
            .own_pieces
            .iter()
            .map(|p| (p.tensor, p.tensor_range.clone()))
            .collect())
    }

    /// What this rank holds of layer `l`'s state of record, piece by piece (see
    /// [`ShardPiece`]): the pieces of its shard in stages 1–3; in stage 0, where every rank
    /// holds everything, rank 0 returns every tensor whole and the others nothing. With
    /// the shards of every rank, the layer is complete exactly once: what a per-rank
    /// checkpoint writes. Local: no communication.
    pub fn export_layer(&self, l: usize) -> Result<Vec<ShardPiece>> {
        (0..self.export_geometry(l)?.len())
            .map(|j| {
                let p = self.export_piece(l, j)?;
                Ok(ShardPiece {
                    tensor: p.tensor,
                    tensor_range: p.tensor_range,
                    params: p.params.into_owned(),
                    state: p.state.to_vec(),
                })
            })
            .collect()
    }

    /// Piece `j` of layer `l` (in [`export_geometry`](Self::export_geometry)'s order) lent
    /// rather than copied: what [`export_layer`](Self::export_layer) returns for it, so that a
    /// writer needs no copy of a layer beside the shard. A piece the geometry does not list is
    /// [`ZeroError::Shape`]. Local: no communication.
    pub fn export_piece(&self, l: usize, j: usize) -> Result<ShardPieceRef<'_>> {
        let info = self.layer(l)?;
        let pieces = if self.config.stage == Stage::Zero0 && self.rank != 0 {
            &[][..]
        } else {
            &info.own_pieces[..]
        };
        let p = pieces.get(j).ok_or_else(|| ZeroError::Shape {
            layer: l,
            what: "exported piece index",
            expected: pieces.len(),
            got: j,
        })?;
        let spp = self.state_per_param.unwrap_or(0);
        let sr = &p.shard_range;
        let params = match &self.masters {
            Some(m) => {
                std::borrow::Cow::Borrowed(f32s(m.as_slice::<f32>()?, off(info.shard_off, sr))?)
            }
            None => {
                let working = if self.config.stage.shards_parameters() {
                    field(&self.shard_params)?
                } else {
                    field(&self.full_params)?
                };
                match part(working, off(self.working_base(info), sr))? {
                    Buf::F32(values) => std::borrow::Cow::Borrowed(values),
                    narrow => {
                        let mut values = vec![0.0f32; sr.len()];
                        load_f32(narrow, &mut values);
                        std::borrow::Cow::Owned(values)
                    }
                }
            }
        };
        let state = match &self.opt_state {
            Some(st) => f32s(
                st.as_slice::<f32>()?,
                (info.shard_off + sr.start) * spp..(info.shard_off + sr.end) * spp,
            )?,
            None => &[],
        };
        Ok(ShardPieceRef {
            tensor: p.tensor,
            tensor_range: p.tensor_range.clone(),
            params,
            state,
        })
    }

    /// Allocate the optimizer state for `k` values per parameter (zeroed) the first time;
    /// after that, `k` must not change.
    fn ensure_state(&mut self, k: usize) -> Result<()> {
        match self.state_per_param {
            Some(was) if was != k => Err(ZeroError::OptimizerStateChanged { was, now: k }),
            Some(_) => Ok(()),
            None => {
                let len = self
                    .shard_total
                    .checked_mul(k)
                    .ok_or(ZeroError::SizeOverflow {
                        what: "optimizer state",
                    })?;
                self.opt_state = Some(alloc(
                    &self.state_cpu,
                    MemoryCategory::OptimizerState,
                    len,
                    DType::F32,
                )?);
                self.state_per_param = Some(k);
                Ok(())
            }
        }
    }

    /// Set layer `l`'s optimizer state from its full per-tensor values: `state[t]` holds
    /// tensor `t`'s `k` planes (`state[t][j·n + i]`, value `j` of element `i` of a tensor of
    /// `n` elements) for an optimizer of `k` values per parameter. Every rank passes the same
    /// values and keeps its pieces (a resume, on any number of ranks). Local.
    pub fn load_optimizer_state(&mut self, l: usize, k: usize, state: &[&[f32]]) -> Result<()> {
        let info = self.layer(l)?;
        if state.len() != info.layout.num_tensors() {
            return Err(ZeroError::Shape {
                layer: l,
                what: "tensor count",
                expected: info.layout.num_tensors(),
                got: state.len(),
            });
        }
        for (s, &n) in state.iter().zip(info.layout.sizes()) {
            let want = n.checked_mul(k).ok_or(ZeroError::SizeOverflow {
                what: "optimizer state",
            })?;
            if s.len() != want {
                return Err(ZeroError::Shape {
                    layer: l,
                    what: "optimizer state length",
                    expected: want,
                    got: s.len(),
                });
            }
        }
        self.ensure_state(k)?;
        let info = &self.layers[l];
        let dst = f32_field_mut(&mut self.opt_state)?;
        for p in &info.own_pieces {
            let (sr, tr) = (&p.shard_range, &p.tensor_range);
            let n = info.layout.sizes()[p.tensor];
            let piece = f32s_mut(
                dst,
                (info.shard_off + sr.start) * k..(info.shard_off + sr.end) * k,
            )?;
            let src = state.get(p.tensor).ok_or(ZeroError::Broken)?;
            for j in 0..k {
                piece[j * sr.len()..(j + 1) * sr.len()]
                    .copy_from_slice(f32s(src, j * n + tr.start..j * n + tr.end)?);
            }
        }
        Ok(())
    }

    /// Every layer's full f32 parameters of record (flat, no padding): the parameters in
    /// fp32, the masters in mixed precision. Collective where they are sharded (stage 3, and
    /// the masters from stage 1): every rank must call it. For checks and consolidated
    /// checkpoints.
    pub fn full_parameters(&mut self) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(self.layers.len());
        if self.masters.is_some() {
            let dt_world = if self.config.stage.shards_optimizer() {
                self.world
            } else {
                1
            };
            for l in 0..self.layers.len() {
                let info = &self.layers[l];
                let (k, n) = (info.layout.shard_len(), info.layout.numel());
                let shard = f32s(
                    f32_field(&self.masters)?,
                    info.shard_off..info.shard_off + k,
                )?;
                if dt_world == 1 {
                    out.push(shard.get(..n).ok_or(ZeroError::Broken)?.to_vec());
                    continue;
                }
                let input = shard.to_vec();
                let mut full = self.comm.run(move |c| {
                    let mut full = vec![0.0f32; k * c.world_size()];
                    c.all_gather(Buf::F32(&input), BufMut::F32(&mut full))
                        .map(|()| full)
                })??;
                full.truncate(n);
                out.push(full);
            }
            return Ok(out);
        }
        for l in 0..self.layers.len() {
            let was = matches!(self.gathered[l], Gathered::Ready(_));
            self.gather(l)?;
            out.push(self.params(l)?.to_vec());
            if !was {
                self.release(l)?;
            }
        }
        Ok(out)
    }
}
