//! Per-rank memory of a trainer model under ZeRO (`headroom estimate --zero S --ranks N`),
//! before any rank runs: the answer to "how big a model fits on N devices".
//!
//! The model is split into ZeRO layers as `headroom train --zero` walks it ([`Part`]): the
//! embeddings, each block, and the final norm with the (untied) head. The training state per
//! rank — parameters, gradients, optimizer state and fp32 masters, padding — is
//! headroom-zero's [`per_rank_bytes`], the layout its engine allocates. What each rank
//! computes with — activations, the batch — is the single-process estimate of one rank's
//! micro-batch: ZeRO shards state, not activations.
//!
//! The transients come from replaying the driver's allocations in program order: stage 3's
//! gathered layers along the access order ([`Part::access_order`]), each part's gradient
//! buffers during its backward (a tied head's embedding gradient from the head to the end),
//! stages 2–3's buckets as the bucket plan fills and reduce-scatters them. The workspace is
//! replayed the same way, moment by moment: each use's copies of its parts' weights, stage 3's
//! all-gather send buffers (freed by the rank when it waits, so their lifetime is the
//! program's, not the communication thread's), the reduce-scatter outputs in flight, and the
//! model's own workspace at that moment (the single-process estimate's head and block
//! backward); then the optimizer step's. Every category is exact, as the tracker counts it
//! (`tests/zero_train.rs`).
//!
//! ZeRO-Offload (`--offload ram`) puts the optimizer shard (and fp32 masters) in `host` instead.
//! Not modelled (a typed error): a file-backed or 8-bit optimizer.

use headroom_offload::StatePrecision;
use headroom_profiler::PerCategory;
use headroom_tensor::MemoryCategory;
use headroom_zero::{per_rank_bytes, BucketPlan, FlatLayout, PerRankBytes, Stage, ZeroConfig};

use crate::estimate::estimate;
use crate::model::{params, ModelConfig, Part, Precision};
use crate::techniques::{
    block_schedule, CheckpointChoice, OptimizerChoice, OptimizerPlacement, Techniques,
};
use crate::{Result, TrainError};

/// One rank's predicted bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZeroEstimate {
    /// The stage.
    pub stage: Stage,
    /// Data-parallel ranks.
    pub ranks: usize,
    /// Parameter count of the model.
    pub parameter_count: u64,
    /// The training state one rank keeps between steps (headroom-zero's layout).
    pub state: PerRankBytes,
    /// One rank's peak per category, exactly as its tracker counts it.
    pub device: PerCategory<u64>,
    /// One rank's simultaneous peak, all categories at once: an upper bound of the tracker's
    /// `peak_total`, from the same replay (every transient at each moment, plus the
    /// activations' peak), much tighter than adding the categories' peaks
    /// ([`ZeroEstimate::per_rank_peak`]).
    pub device_peak: u64,
    /// One rank's host bytes: the optimizer shard (and fp32 masters) under ZeRO-Offload.
    pub host: PerCategory<u64>,
}

impl ZeroEstimate {
    /// The sum of the categories' peaks: a loose upper bound of the simultaneous peak (they
    /// peak at different moments); [`ZeroEstimate::device_peak`] is the tight one.
    pub fn per_rank_peak(&self) -> u64 {
        self.device.total()
    }

    /// This estimate for data with a loss mask: each rank's loader also holds its targets'
    /// flags (`batch` is the rank's rows).
    pub fn with_loss_mask_flags(mut self, batch: usize, seq: usize) -> Self {
        let bytes = crate::estimate::loss_mask_flag_bytes(batch, seq);
        self.device[MemoryCategory::Data] += bytes;
        self.device_peak += bytes;
        self
    }

    /// This estimate for packed documents: each rank's loader also holds its inputs' position
    /// ids, 4 bytes each, and (unless `masked` already counted them) its targets' flags.
    pub fn with_document_positions(mut self, batch: usize, seq: usize, masked: bool) -> Self {
        if !masked {
            self = self.with_loss_mask_flags(batch, seq);
        }
        let bytes = 4 * crate::estimate::loss_mask_flag_bytes(batch, seq);
        self.device[MemoryCategory::Data] += bytes;
        self.device_peak += bytes;
        self
    }
}

/// The parameter count of each ZeRO layer of `cfg`: embeddings, blocks, final norm + head.
pub fn zero_layers(cfg: &ModelConfig) -> Vec<usize> {
    crate::zero_train::part_sizes(cfg)
        .iter()
        .map(|p| p.iter().sum())
        .collect()
}

/// Predict one rank's memory for `ranks` data-parallel ranks under `stage`, each running
/// `batch` sequences of `seq` tokens in micro-batches of `micro` with `techniques`, as
/// `headroom train --zero` runs them.
pub fn zero_estimate(
    cfg: &ModelConfig,
    seq: usize,
    micro: usize,
    batch: usize,
    techniques: &Techniques,
    stage: Stage,
    ranks: usize,
) -> Result<ZeroEstimate> {
    if ranks == 0 {
        return Err(TrainError::Input("--ranks must be at least 1".into()));
    }
    if matches!(techniques.optimizer.placement, OptimizerPlacement::File(_))
        || techniques.optimizer.state != StatePrecision::F32
    {
        return Err(TrainError::Input(
            "the ZeRO estimate models f32 AdamW on the device or in host RAM; a file-backed \
             or 8-bit optimizer under ZeRO is not modelled"
                .into(),
        ));
    }
    let offload = techniques.optimizer.placement == OptimizerPlacement::HostRam;
    // A rank computes as a single process with its optimizer beside it would (the driver
    // never stages gradients through the host); only where the state lives differs.
    let single = {
        let mut t = techniques.clone();
        t.optimizer = OptimizerChoice::resident();
        estimate(cfg, seq, micro, batch, &t)?
    };
    // fp16's working copies and gradients are as large as bf16's.
    let precision = match techniques.model.precision {
        Precision::Fp32 => headroom_zero::Precision::Fp32,
        Precision::Bf16 | Precision::Fp16 => headroom_zero::Precision::MixedBf16,
    };
    let config = ZeroConfig::new(stage);
    let layers = zero_layers(cfg);
    let state = per_rank_bytes(stage, &layers, ranks, precision, 8, config.bucket_bytes)
        .map_err(|e| TrainError::Input(format!("ZeRO estimate: {e}")))?;
    let schedule = block_schedule(techniques.checkpoint, cfg, || {
        let budget = match techniques.checkpoint {
            CheckpointChoice::Optimal(Some(b)) => b,
            _ => {
                return Err(TrainError::Config(
                    "the optimal schedule needs an explicit activation budget under ZeRO".into(),
                ))
            }
        };
        Ok((single.block_chain_cost()?, budget))
    })?;
    let replay = Replay::new(cfg, &layers, stage, ranks, precision, &config)?;
    let plan: Vec<usize> = Part::access_order(cfg, &schedule)
        .into_iter()
        .map(|p| p.index(cfg))
        .collect();
    // What each access of the plan is for: the schedule's block operations, in order.
    let uses: Vec<Use> = {
        let mut ops = schedule.ops().iter();
        let head = Part::Head.index(cfg);
        let mut v = Vec::with_capacity(plan.len());
        for (i, &l) in plan.iter().enumerate() {
            v.push(if i == 0 {
                Use::EmbedForward
            } else if l == head {
                Use::Head
            } else if l == 0 {
                // Only a tied head reads the embeddings again.
                Use::HeadTied
            } else {
                match ops.next() {
                    Some(op) if !op.is_forward() => Use::BlockBackward,
                    _ => Use::BlockForward,
                }
            });
        }
        v
    };
    let tied = params::head_index(cfg) == params::WTE;
    let grad_io = u(micro) * u(seq) * u(cfg.channels) * 4;
    let peaks = replay.walk(&plan, &uses, tied, &single, grad_io);
    let mut device = PerCategory::<u64>::default();
    device[MemoryCategory::Parameters] = state.parameters + peaks.gathered;
    device[MemoryCategory::Gradients] = state.gradients + peaks.gradients;
    let mut host = PerCategory::<u64>::default();
    if offload {
        host[MemoryCategory::OptimizerState] = state.optimizer_state;
    } else {
        device[MemoryCategory::OptimizerState] = state.optimizer_state;
    }
    device[MemoryCategory::Activations] = single.device[MemoryCategory::Activations];
    device[MemoryCategory::Data] = single.device[MemoryCategory::Data];
    let step_ws = replay.step_workspace(&crate::zero_train::part_sizes(cfg), precision);
    device[MemoryCategory::Workspace] = peaks.workspace.max(step_ws);
    // Between steps, and during the step, only the state and the loader's buffers stay; the
    // activations' peak is added to every moment of a micro-batch (a bound).
    let kept = state.parameters
        + state.gradients
        + device[MemoryCategory::OptimizerState]
        + device[MemoryCategory::Data];
    let device_peak =
        (kept + device[MemoryCategory::Activations] + peaks.total).max(kept + step_ws);
    Ok(ZeroEstimate {
        stage,
        ranks,
        parameter_count: single.parameter_count,
        state,
        device,
        device_peak,
        host,
    })
}

/// The driver's transient allocations, replayed in program order from the layer sizes. Every
/// one of them is made and freed by the rank's own thread at a point fixed by the access order
/// and the bucket plan (a collective's completion only hands buffers back; the rank frees them
/// when it next waits), so the peaks are exact, not bounds.
struct Replay {
    /// Per part: elements.
    numel: Vec<u64>,
    /// Per part: padded elements and one rank's shard (the engine's flat layout).
    padded: Vec<u64>,
    shard: Vec<u64>,
    /// Working parameter and reduced-gradient bytes per element.
    p: u64,
    g: u64,
    /// Storage bytes per element of the model's working weights (the part copies).
    a: u64,
    stage: Stage,
    ranks: u64,
    /// Gradient buckets (stages 2–3): each part's bucket, and the parts per bucket.
    bucket_of: Vec<usize>,
    buckets: Vec<Vec<usize>>,
    max_in_flight: usize,
}

impl Replay {
    fn new(
        cfg: &ModelConfig,
        layers: &[usize],
        stage: Stage,
        ranks: usize,
        precision: headroom_zero::Precision,
        config: &ZeroConfig,
    ) -> Result<Self> {
        let world = if stage.shards_optimizer() { ranks } else { 1 };
        let mut padded = Vec::with_capacity(layers.len());
        let mut shard = Vec::with_capacity(layers.len());
        for &n in layers {
            let l = FlatLayout::new(&[n], world)
                .map_err(|e| TrainError::Input(format!("ZeRO estimate: {e}")))?;
            padded.push(l.padded_len() as u64);
            shard.push(l.shard_len() as u64);
        }
        let g = precision.grad_bytes() as u64;
        let padded_bytes: Vec<usize> = padded
            .iter()
            .map(|&n| usize::try_from(n * g).unwrap_or(usize::MAX))
            .collect();
        let plan = BucketPlan::new(&padded_bytes, config.bucket_bytes);
        let buckets = plan.buckets().to_vec();
        let bucket_of = (0..layers.len())
            .map(|l| plan.bucket_of(l).unwrap_or(0))
            .collect();
        let _ = cfg;
        Ok(Replay {
            numel: layers.iter().map(|&n| n as u64).collect(),
            padded,
            shard,
            p: precision.param_bytes() as u64,
            g,
            a: precision.param_bytes() as u64,
            stage,
            ranks: ranks as u64,
            bucket_of,
            buckets,
            max_in_flight: config.max_in_flight,
        })
    }

    /// One micro-batch of a rank, replayed event by event as the driver makes them: stage 3's
    /// gathers (each part's all-gather output and send buffer, from the prefetch until the
    /// rank waits for it, the output until its release); each use's copies of its parts'
    /// weights; each part's f32 gradient buffers while its backward runs (a tied head's
    /// embedding gradient from the head to the embeddings' push); stages 2–3's buckets, filled
    /// in push order and reduce-scattered at most `max_in_flight` at a time, with their
    /// outputs; and, at each moment, the model's own workspace — the head's and a block
    /// backward's from the single-process estimate, the f32 gradients flowing between parts
    /// (`grad_io` each) around the pushes. Returns each category's transient peak and the most
    /// of them live at once (a forward taken to need no more of the model's workspace than a
    /// block's backward, for that total).
    fn walk(
        &self,
        plan: &[usize],
        uses: &[Use],
        tied: bool,
        single: &crate::estimate::TrainerEstimate,
        grad_io: u64,
    ) -> Peaks {
        let parts = self.numel.len();
        let head = parts - 1;
        let stage3 = self.stage.shards_parameters();
        let send = |l: usize| self.shard[l] * self.p;
        let copy = |l: usize| self.numel[l] * self.a;
        let gathered = |l: usize| self.padded[l] * self.p;
        let grads = |l: usize| self.numel[l] * 4;
        let out_bytes = |b: usize| -> u64 {
            self.buckets[b].iter().map(|&l| self.shard[l]).sum::<u64>() * self.g
        };
        let bucket_bytes = |b: usize| out_bytes(b) * self.ranks;
        let mut ready = vec![false; parts];
        let mut in_flight_send = vec![false; parts];
        let mut remaining: Vec<usize> = self.buckets.iter().map(Vec::len).collect();
        let mut open = vec![false; self.buckets.len()];
        let mut rs: std::collections::VecDeque<usize> = Default::default();
        let mut m = Moments::default();
        let mut pushes = 0usize;
        // Part `l`'s gradients pushed, with `extra` bytes of the model's workspace live
        // besides; its buffers go when the push returns.
        let mut push = |l: usize, extra: u64, m: &mut Moments| {
            pushes += 1;
            if self.stage.shards_gradients() {
                let b = self.bucket_of[l];
                if !open[b] {
                    open[b] = true;
                    m.add_grads(bucket_bytes(b));
                    m.at(extra, 0);
                }
                remaining[b] -= 1;
                if remaining[b] == 0 {
                    open[b] = false;
                    while rs.len() >= self.max_in_flight {
                        if let Some(done) = rs.pop_front() {
                            m.ws -= out_bytes(done);
                            m.grads -= bucket_bytes(done);
                        }
                    }
                    m.ws += out_bytes(b);
                    m.at(extra, 0);
                    rs.push_back(b);
                }
                if pushes == parts {
                    while let Some(done) = rs.pop_front() {
                        m.ws -= out_bytes(done);
                        m.grads -= bucket_bytes(done);
                    }
                }
            }
            m.grads -= grads(l);
        };
        let mut copies = 0u64;
        for (i, (&l, &use_)) in plan.iter().zip(uses).enumerate() {
            let next = plan.get(i + 1).copied();
            if stage3 {
                if in_flight_send[l] {
                    in_flight_send[l] = false;
                    m.ws -= send(l);
                } else if !ready[l] {
                    // Gathered on the spot: the send buffer lives only for the wait.
                    m.add_params(gathered(l));
                    m.at(copies + send(l), 0);
                }
                ready[l] = true;
            }
            copies += copy(l);
            if next != Some(l) {
                if stage3 {
                    ready[l] = false;
                    m.params -= gathered(l);
                }
                if let Some(n) = next {
                    if stage3 && !ready[n] && !in_flight_send[n] {
                        in_flight_send[n] = true;
                        m.ws += send(n);
                        m.add_params(gathered(n));
                    }
                }
            }
            match use_ {
                Use::EmbedForward => {
                    m.at(copies, 0);
                    copies = 0;
                }
                Use::BlockForward => {
                    // The workspace category's peak is a backward's; for the moment's total,
                    // a forward's workspace is bounded by it.
                    m.at(copies, single.block_backward_workspace);
                    copies = 0;
                }
                // A tied head computes once it also holds the embeddings.
                Use::Head if tied => {}
                Use::Head | Use::HeadTied => {
                    m.add_grads(grads(head) + if tied { grads(0) } else { 0 });
                    m.at(copies + single.head_workspace, 0);
                    copies = 0;
                    // The head's input gradient is live when it hands over its gradients.
                    push(head, grad_io, &mut m);
                }
                Use::BlockBackward => {
                    m.add_grads(grads(l));
                    m.at(copies + single.block_backward_workspace, 0);
                    copies = 0;
                    // The block's output gradient and its input gradient.
                    push(l, 2 * grad_io, &mut m);
                    if next.is_none() {
                        // The embeddings' backward (a tied head's buffer is already there),
                        // then their push.
                        if !tied {
                            m.add_grads(grads(0));
                        }
                        m.at(grad_io, 0);
                        push(0, grad_io, &mut m);
                    }
                }
            }
        }
        Peaks {
            workspace: m.ws_peak,
            gathered: m.params_peak,
            gradients: m.grads_peak,
            total: m.total_peak,
        }
    }

    /// The rank's workspace peak during the optimizer step: stage 1's reduced gradient shard
    /// with, in mixed precision, the f32 widening of the longest piece it updates; or stages
    /// 1–2's all-gather scratch of the largest layer shard afterwards. `tensors`: each part's
    /// tensor sizes (pieces are a tensor's overlap with a rank's shard; the longest over
    /// ranks).
    fn step_workspace(&self, tensors: &[Vec<usize>], precision: headroom_zero::Precision) -> u64 {
        let max_shard = self.shard.iter().copied().max().unwrap_or(0);
        let shard_total: u64 = self.shard.iter().sum();
        let longest_piece = if precision == headroom_zero::Precision::MixedBf16 {
            let world = if self.stage.shards_optimizer() {
                self.ranks
            } else {
                1
            };
            tensors
                .iter()
                .zip(&self.shard)
                .flat_map(|(sizes, &k)| {
                    let mut at = 0u64;
                    sizes
                        .iter()
                        .map(move |&n| {
                            let (a, b) = (at, at + n as u64);
                            at = b;
                            (0..world)
                                .map(|r| {
                                    let (s, e) = (r * k, (r + 1) * k);
                                    e.min(b).saturating_sub(s.max(a))
                                })
                                .max()
                                .unwrap_or(0)
                        })
                        .collect::<Vec<_>>()
                })
                .max()
                .unwrap_or(0)
        } else {
            0
        };
        let widen = longest_piece * 4;
        match self.stage {
            Stage::Zero1 => (shard_total * self.g + widen).max(max_shard * self.p),
            Stage::Zero2 => widen.max(max_shard * self.p),
            Stage::Zero0 | Stage::Zero3 => widen,
        }
    }
}

/// The live transient bytes of a replay and their peaks: each category's, and everything
/// transient at once.
#[derive(Default)]
struct Moments {
    /// Workspace held across model operations (send buffers, reduce-scatter outputs).
    ws: u64,
    /// Stage 3's gathered parts.
    params: u64,
    /// The parts' gradient buffers and the buckets.
    grads: u64,
    ws_peak: u64,
    params_peak: u64,
    grads_peak: u64,
    total_peak: u64,
}

impl Moments {
    /// A moment with `ws_extra` more workspace live (the model's, copies) and `total_extra`
    /// bytes that count towards the total only.
    fn at(&mut self, ws_extra: u64, total_extra: u64) {
        let ws = self.ws + ws_extra;
        self.ws_peak = self.ws_peak.max(ws);
        self.total_peak = self
            .total_peak
            .max(ws + self.params + self.grads + total_extra);
    }

    fn add_params(&mut self, bytes: u64) {
        self.params += bytes;
        self.params_peak = self.params_peak.max(self.params);
    }

    fn add_grads(&mut self, bytes: u64) {
        self.grads += bytes;
        self.grads_peak = self.grads_peak.max(self.grads);
    }
}

/// The peaks of one rank's transients over a micro-batch, from [`Replay::walk`].
struct Peaks {
    workspace: u64,
    /// Stage 3's gathered parts.
    gathered: u64,
    /// Gradient buffers and buckets.
    gradients: u64,
    /// All of them at once.
    total: u64,
}

/// What one access of the plan is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    EmbedForward,
    BlockForward,
    BlockBackward,
    Head,
    /// The embeddings, read again by a tied head.
    HeadTied,
}

/// `x` as `u64` (sizes here are bounded by the estimate's magnitude check).
fn u(x: usize) -> u64 {
    x as u64
}

/// The most layers (at `cfg`'s width, heads and vocabulary) whose simultaneous per-rank peak
/// ([`ZeroEstimate::device_peak`]) fits `budget` bytes, with that estimate; `None` when not even one layer fits. (The arguments are
/// [`zero_estimate`]'s plus the budget.)
#[allow(clippy::too_many_arguments)]
pub fn largest_fitting_depth(
    cfg: &ModelConfig,
    seq: usize,
    micro: usize,
    batch: usize,
    techniques: &Techniques,
    stage: Stage,
    ranks: usize,
    budget: u64,
) -> Result<Option<(usize, ZeroEstimate)>> {
    let at = |layers: usize| -> Result<ZeroEstimate> {
        let c = ModelConfig { layers, ..*cfg };
        // Schedules are per layer count; every-k and √n rebuild themselves from it.
        zero_estimate(&c, seq, micro, batch, techniques, stage, ranks)
    };
    let fits = |layers: usize| -> Result<Option<ZeroEstimate>> {
        let e = at(layers)?;
        Ok((e.device_peak <= budget).then_some(e))
    };
    let Some(mut best) = fits(1)? else {
        return Ok(None);
    };
    let (mut lo, mut hi) = (1usize, 2usize);
    // Double until it no longer fits (bounded: the state grows with every layer).
    while let Some(e) = fits(hi)? {
        (lo, best) = (hi, e);
        if hi >= 1 << 16 {
            return Ok(Some((lo, best)));
        }
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match fits(mid)? {
            Some(e) => (lo, best) = (mid, e),
            None => hi = mid,
        }
    }
    Ok(Some((lo, best)))
}
