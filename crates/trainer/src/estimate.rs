//! The memory a training run will need, per category, before running it: the profiler's
//! estimator (`headroom_profiler::estimate`) specialised to this trainer's own activation set.
//!
//! The profiler's estimator counts llm.c's activation tensors; this trainer keeps a different
//! set (q, k, v split by head, the attention output once, no separate projection outputs, no
//! pre-softmax scores), so the terms below are the sizes of [`crate::model::BlockSaved`]'s
//! fields and of the head's buffers, by name. Checkpoint schedules are predicted by
//! headroom-ckpt's own simulator over the same byte sizes, so an every-k, √n or planned
//! schedule is costed exactly as the executor will run it.
//!
//! Notation: `b` micro-batch, `T` sequence, `C` width, `H` heads, `V` vocab, `L` layers, `a`
//! bytes per stored element (4 in fp32, 2 in bf16/fp16), `P` parameters.

use headroom_ckpt::{ChainCost, LayerCost, Schedule};
use headroom_offload::StatePrecision;
use headroom_profiler::PerCategory;
use headroom_tensor::MemoryCategory;
use serde::Serialize;

use crate::model::{finetune, params, Family, FinetuneSpec, ModelConfig, QkNorm};
use crate::ops::{matmul, quant_matmul};
use crate::techniques::{block_schedule, CheckpointChoice, OptimizerPlacement, Techniques};
use crate::{Result, TrainError};

/// Block-size of 8-bit optimizer state (headroom-offload's).
const INT8_BLOCK: usize = 2048;
/// Batch buffers the loader may hold at once (its default `max_buffered_batches`).
const LOADER_BUFFERS: u64 = 4;

/// Predicted peak bytes per category on the device and on the host.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TrainerEstimate {
    /// Parameters in the model.
    pub parameter_count: u64,
    /// Peak bytes per category on the device (the budgeted memory).
    pub device: PerCategory<u64>,
    /// Bytes per category an offloaded optimizer keeps on the host.
    pub host: PerCategory<u64>,
    /// Bytes one block keeps for backward (its [`crate::model::BlockSaved`]).
    pub block_saved_bytes: u64,
    /// Bytes of one block's input or output (`b·T·C·a`).
    pub block_io_bytes: u64,
    /// Blocks.
    pub layers: usize,
    /// Workspace peak of the head (loss and its backward, the final norm's included).
    pub head_workspace: u64,
    /// Workspace peak of one block's backward (recomputation inside it included).
    pub block_backward_workspace: u64,
    /// The device's simultaneous peak: the constant categories plus the largest of the head's
    /// moment (the activations kept when the loss runs, the head's buffers and workspace), a
    /// block backward's (the schedule's activation peak, recomputed ones, the block's
    /// workspace) and the embedding's backward, each with the gradients the device holds then
    /// (all of them, or — offloaded — the one part's being staged). An upper bound of the
    /// tracker's `peak_total`, tighter than [`TrainerEstimate::device_total`] (which adds each
    /// category's own peak although they peak at different moments).
    pub device_peak: u64,
    /// The three moments [`TrainerEstimate::device_peak`] takes the largest of, without the
    /// constant categories and gradients (which differ by device: see
    /// [`cuda_device_peak`]).
    pub moments: PeakMoments,
}

/// What the device holds beyond parameters, optimizer state, gradients and batches at the
/// three moments that bound a step's peak.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PeakMoments {
    /// When the loss runs: the activations kept then (the schedule's at the loss, the chain's
    /// output, the head's own), without the head's workspace.
    pub head_kept: u64,
    /// The part of [`PeakMoments::head_kept`] that is the logits (`[b·T, V]` of
    /// [`cpu_logit_bytes`] each; 0 when the loss is fused and they are workspace).
    pub head_logits: u64,
    /// A block's backward: the schedule's activation peak, a recomputation's extra and the
    /// block backward's workspace net of what it has dropped by then.
    pub block: u64,
    /// The embedding's backward: the chain's input and a block backward's workspace.
    pub embedding: u64,
}

impl TrainerEstimate {
    /// This estimate for data with a loss mask: the loader's buffers also hold each target's
    /// flag, one byte each ([`MemoryCategory::Data`], a constant of the step).
    pub fn with_loss_mask_flags(mut self, batch: usize, seq: usize) -> Self {
        let bytes = loss_mask_flag_bytes(batch, seq);
        self.device[MemoryCategory::Data] += bytes;
        self.device_peak += bytes;
        self
    }

    /// This estimate for packed documents (`--document-attention`): the loader's buffers also
    /// hold each input's position id, 4 bytes each ([`MemoryCategory::Data`]), and each
    /// target's flag (counted here unless [`TrainerEstimate::with_loss_mask_flags`] already
    /// did, for a masked file).
    pub fn with_document_positions(mut self, batch: usize, seq: usize, masked: bool) -> Self {
        if !masked {
            self = self.with_loss_mask_flags(batch, seq);
        }
        let bytes = 4 * loss_mask_flag_bytes(batch, seq);
        self.device[MemoryCategory::Data] += bytes;
        self.device_peak += bytes;
        self
    }

    /// Sum of the device categories' peaks (an upper bound on the device's total peak; see
    /// [`TrainerEstimate::device_peak`] for the simultaneous one).
    pub fn device_total(&self) -> u64 {
        self.device.total()
    }

    /// The blocks as the checkpoint planner sees them: equal layers whose backward costs two
    /// forwards (the usual matmul count), with the byte sizes above.
    pub fn block_chain_cost(&self) -> Result<ChainCost> {
        let layer = LayerCost {
            forward_time: 1.0,
            backward_time: 2.0,
            input_bytes: self.block_io_bytes,
            saved_bytes: self.block_saved_bytes,
        };
        let mut layers = vec![layer; self.layers];
        // The first block's input is the caller's (the embedding): the executor never frees or
        // counts it, so the planner must not either.
        if let Some(first) = layers.first_mut() {
            first.input_bytes = 0;
        }
        Ok(ChainCost::new(layers, self.block_io_bytes)?)
    }
}

fn u(x: usize) -> u64 {
    x as u64
}

/// Whose matrix products a block's transients are modelled for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Products {
    /// This machine's CPU kernels: whether bf16 products read a kept bf16 input in place
    /// (AMX) or through an f32 view, and the panels a low-precision weight is widened or packed
    /// into, whose depth follows gemm's blocking on this CPU.
    Host,
    /// The CUDA model's: cuBLASLt reads bf16 operands in place and needs no panel (its own
    /// workspace is counted by [`cuda_device_peak`]), so the figure is the same on every host.
    Cuda,
}

/// Bytes of loss-mask flags the loader's buffers hold for `batch` rows of `seq` targets.
pub fn loss_mask_flag_bytes(batch: usize, seq: usize) -> u64 {
    LOADER_BUFFERS * batch as u64 * seq as u64
}

/// What the CUDA model runs, checked without a device (so `estimate --device cuda` can say
/// what `train --device cuda` would refuse): flash attention on bf16 (the only attention
/// headroom-attn has on CUDA), head dimension 64 or 128 (its kernels'). The ops themselves
/// take any precision; attention is what binds the model to bf16.
pub fn cuda_runs(cfg: &ModelConfig, opts: &crate::model::ModelOptions) -> Result<()> {
    cfg.validate()?;
    let refuse = |m: String| Err(TrainError::Config(m));
    if opts.precision != crate::model::Precision::Bf16 {
        return refuse(format!(
            "the CUDA model runs in bf16 only (flash attention's kernels), not {}",
            opts.precision.name()
        ));
    }
    if !matches!(
        opts.attention.algorithm,
        headroom_attn::Algorithm::Flash { .. }
    ) {
        return refuse(format!(
            "the CUDA model runs flash attention only, not {}",
            opts.attention.algorithm.name()
        ));
    }
    let hd = cfg.head_dim();
    if hd != 64 && hd != 128 {
        return refuse(format!(
            "the CUDA flash kernels need head dimension 64 or 128, not {hd}"
        ));
    }
    if let Some(0) = opts.loss_chunk {
        return refuse("loss chunk must be at least 1 row".into());
    }
    Ok(())
}

/// Predict peak bytes per category for `cfg` trained on micro-batches of `micro` sequences of
/// `seq` tokens (`batch` per step) with `tech`.
pub fn estimate(
    cfg: &ModelConfig,
    seq: usize,
    micro: usize,
    batch: usize,
    tech: &Techniques,
) -> Result<TrainerEstimate> {
    estimate_for(cfg, seq, micro, batch, tech, Products::Host)
}

/// [`estimate`] with a block's product transients modelled for `products`.
fn estimate_for(
    cfg: &ModelConfig,
    seq: usize,
    micro: usize,
    batch: usize,
    tech: &Techniques,
    products: Products,
) -> Result<TrainerEstimate> {
    cfg.validate()?;
    if seq == 0 || micro == 0 || batch == 0 || !batch.is_multiple_of(micro) || seq > cfg.max_seq {
        return Err(TrainError::Config(format!(
            "batch {batch}, micro-batch {micro}, sequence {seq} (context {})",
            cfg.max_seq
        )));
    }
    check_magnitude(cfg, seq, micro, batch)?;
    let infos = params::param_infos(cfg);
    let p: u64 = infos.iter().map(|i| u(i.shape.iter().product())).sum();
    let precision = tech.model.precision;
    let a = u(precision.storage().size_in_bytes());
    let low = precision.is_low();
    let offload = tech.optimizer.placement != OptimizerPlacement::Resident;
    let mut device = PerCategory::<u64>::default();
    let mut host = PerCategory::<u64>::default();

    let finetune = match &tech.finetune {
        Some(spec) => Some(FinetunePlan::new(cfg, spec, a, low)?),
        None => None,
    };
    // Parameters: fp32 masters (forward reads them in fp32) plus the working copy in low
    // precision; offloading a low-precision run moves the masters to the host. A fine-tuning
    // run: the frozen base and the adapters (see `FinetunePlan`).
    if let Some(f) = &finetune {
        device[MemoryCategory::Parameters] = f.parameter_peak;
    } else if low {
        device[MemoryCategory::Parameters] = p * a;
        if offload {
            host[MemoryCategory::Parameters] = p * 4;
        } else {
            device[MemoryCategory::Parameters] += p * 4;
        }
    } else {
        device[MemoryCategory::Parameters] = p * 4;
    }
    // Which part's staged gradients the device holds at each moment, when offloading a
    // pre-training run (`None`: the same bytes throughout).
    let mut staged_grads = None;
    // Gradients: the accumulator's f32 buffers — on the host when offloading, where the
    // device holds one part's gradients at a time: the head's (its weight and the final
    // norm), the embedding's or one block's. A fine-tuning run's are the adapters'.
    if let Some(f) = &finetune {
        if offload {
            host[MemoryCategory::Gradients] = f.adapter_numel * 4;
            device[MemoryCategory::Gradients] = f.largest_block_adapter_numel * 4;
        } else {
            device[MemoryCategory::Gradients] = f.adapter_numel * 4;
        }
    } else if offload {
        host[MemoryCategory::Gradients] = p * 4;
        let numel = |i: usize| u(infos[i].shape.iter().product());
        let norm = params::final_norm_index(cfg);
        let head = numel(params::head_index(cfg))
            + (norm..norm + params::final_norm_count(cfg))
                .map(numel)
                .sum::<u64>();
        let embed: u64 = (0..params::embedding_count(cfg)).map(numel).sum();
        let block: u64 = (0..params::per_layer(cfg))
            .map(|o| numel(params::layer_index(cfg, 0, o)))
            .sum();
        device[MemoryCategory::Gradients] = 4 * head.max(embed).max(block);
        staged_grads = Some(StagedGrads {
            head: 4 * head,
            block: 4 * block,
            embedding: 4 * embed,
        });
    } else {
        device[MemoryCategory::Gradients] = p * 4;
    }
    // Optimizer state: two moments per parameter, f32 or u8 with an f32 scale per block of
    // each tensor.
    let state = match &finetune {
        Some(f) => optimizer_state_bytes(&f.adapter_infos, tech.optimizer.state),
        None => optimizer_state_bytes(&infos, tech.optimizer.state),
    };
    match &tech.optimizer.placement {
        OptimizerPlacement::Resident => device[MemoryCategory::OptimizerState] = state,
        OptimizerPlacement::HostRam => host[MemoryCategory::OptimizerState] = state,
        // A file-backed store is page cache, not allocated memory: neither ledger holds it.
        OptimizerPlacement::File(_) => {}
    }

    // Activations: the sizes of the kept fields of `Gpt2Saved` / `LlamaSaved`.
    let (b, t, c, h, v) = (
        u(micro),
        u(seq),
        u(cfg.channels),
        u(cfg.heads),
        u(cfg.vocab),
    );
    let bt = b * t;
    let btc = bt * c;
    let btf = bt * u(cfg.ffn());
    // Queries' and the attention output's width: C, or NH·hs for a Llama with its own head
    // width.
    let btq = bt * u(cfg.attention_width());
    // Keys' and values' width: C, or KV·hs under grouped-query attention.
    let btk = bt * u(cfg.kv_heads() * cfg.head_dim());
    let selective = tech.model.selective || tech.checkpoint == CheckpointChoice::Selective;
    let naive = tech.model.attention.algorithm == headroom_attn::Algorithm::Naive;
    let probs = if naive { b * h * t * t * 4 } else { 0 };
    let llama = matches!(cfg.family, Family::Llama(_));
    // Per norm: layer norm keeps mean and rstd, RMSNorm rstd.
    let norm_stats = if llama { bt * 4 } else { 2 * bt * 4 };
    // What selective recomputation drops: GPT-2's ln1, ln2 and GELU output; Llama's two norms
    // and the SwiGLU product.
    // OLMo 2 has no input norms: nothing of them is kept or recomputed.
    let input_norms = match cfg.family {
        Family::Llama(s) => s.input_norms(),
        Family::Gpt2 => true,
    };
    let kept_norms = if input_norms { 2 } else { 0 };
    let dropped_by_selective = (kept_norms * btc + btf) * a;
    // Query and key norms keep their inputs and one statistic per head and position (Qwen3's,
    // Gemma 3's) or per position (OLMo 2's, over the whole projection).
    let qk_norms = match cfg.family {
        Family::Llama(s) => match s.qk_norm_kind() {
            Some(QkNorm::PerHead) => (btq + btk) * a + b * t * (h + u(s.kv_heads)) * 4,
            Some(QkNorm::Projection) => (btq + btk) * a + 2 * bt * 4,
            None => 0,
        },
        _ => 0,
    };
    let attention_saved = (btq + 2 * btk) * a // q, k, v
        + btq * a // attention output
        + b * h * t * 4 // logsumexp
        + probs
        + qk_norms;
    let mlp_saved = if llama { 2 * btf * a } else { btf * a }; // gate and up, or fch
                                                               // Gemma 3's output norms keep the o_proj and down outputs they normalise, and their
                                                               // statistics.
    let output_norms = match cfg.family {
        Family::Llama(s) if s.output_norms() => 2 * (btc * a + norm_stats),
        _ => 0,
    };
    let block_saved = kept_norms * norm_stats
        + output_norms
        + attention_saved
        + btc * a // res2
        + mlp_saved
        + if selective { 0 } else { dropped_by_selective };
    let io = btc * a;
    let head_rows = tech.model.loss_chunk.map_or(bt, |r| u(r).min(bt));
    let logit = cpu_logit_bytes(cfg, tech, bt);
    // The final norm's output and statistics and the per-token losses; the logits too when
    // not fused.
    let head_act = btc * 4
        + norm_stats
        + bt * 4
        + if tech.model.loss_chunk.is_none() {
            bt * v * logit
        } else {
            0
        };
    // Selective recomputation brings back the two norms' outputs, then the MLP's activation:
    // the second norm's statistics live while its output is built (they are dropped at
    // once), so the moment is the larger of (both norms + those statistics) and (both norms +
    // the activation).
    let recompute_extra = match (selective, input_norms) {
        (true, true) => 2 * btc * a + (btc * a + norm_stats).max(btf * a),
        (true, false) => btf * a,
        (false, _) => 0,
    };
    let est = TrainerEstimate {
        parameter_count: p,
        device,
        host,
        block_saved_bytes: block_saved,
        block_io_bytes: io,
        layers: cfg.layers,
        head_workspace: 0,
        block_backward_workspace: 0,
        device_peak: 0,
        moments: PeakMoments::default(),
    };
    let schedule = match tech.checkpoint {
        // The plan depends on a budget; costing it with the planner's own view of the chain
        // is what the run will do too (the run supplies the budget).
        CheckpointChoice::Optimal(None) => Schedule::store_all(cfg.layers)?,
        other => {
            let budget = match other {
                CheckpointChoice::Optimal(Some(b)) => b,
                _ => 0,
            };
            block_schedule(other, cfg, || Ok((est.block_chain_cost()?, budget)))?
        }
    };
    let costs = est.block_chain_cost()?;
    let sim = schedule.simulate(&costs)?;
    let at_loss = schedule.saved_at_loss(&costs)?;
    let mut device = est.device;
    // The embedding output is the chain's input (held by the caller throughout). The head runs
    // when the chain's output is first in hand, with what the schedule keeps at that moment —
    // the schedule's peak when everything is stored, less when recomputing a segment later
    // keeps more; a selective block's recomputation happens in its backward.
    device[MemoryCategory::Activations] =
        io + (at_loss + head_act).max(sim.peak_saved_bytes + recompute_extra);

    // Workspace: the larger of the head and a block's backward. The head's: dlnf, the logit
    // chunk when fused (the loss writes the logits' gradient over the logits, so unfused they
    // are activations only), and in low precision the panel the head's weight is widened into
    // (the GEMMs read the bf16/f16 weight in place, the final norm the bf16/f16 residual).
    let views_head = if low {
        let (n, rows) = (bt as usize, head_rows as usize);
        u(matmul::head_scratch(
            n,
            rows,
            cfg.channels,
            cfg.vocab,
            true,
            logit == 2,
            headroom_tensor::Cpu::new().num_threads(),
        )) * 4
    } else {
        0
    };
    let logits_ws = if tech.model.loss_chunk.is_some() {
        head_rows * v * logit
    } else {
        0
    };
    // bf16 logits pass through an f32 strip of columns.
    let logit_stage = if logit == 2 {
        u(matmul::bf16_output_stage(
            bt as usize,
            head_rows as usize,
            cfg.channels,
            cfg.vocab,
        )) * 4
    } else {
        0
    };
    let head_ws = btc * 4 + logits_ws + views_head + logit_stage;
    // The attention backward's own workspace: naive's probability gradient, or chunked's and
    // flash's dK/dV partials and per-task scratch (headroom-attn's prediction, exact for its
    // CPU kernels).
    let threads = headroom_tensor::Cpu::new().num_threads();
    let attn_dims = headroom_attn::AttentionDims {
        batch: micro,
        q_heads: cfg.heads,
        kv_heads: cfg.kv_heads(),
        q_len: seq,
        kv_len: seq,
        head_dim: cfg.head_dim(),
        dtype: if low {
            headroom_tensor::DType::BF16
        } else {
            headroom_tensor::DType::F32
        },
    };
    let attn_config = tech.model.attention.causal(true);
    // bf16 and f16 are read in place by the attention kernels (a few heads widened at a time).
    let attn = if tech.model.precision.is_low() {
        AttnWorkspace {
            backward: headroom_attn::cpu_backward_f32_workspace_bytes(
                &attn_dims,
                headroom_tensor::DType::F32,
                &attn_config,
                threads,
            ),
            forward_in_place: Some(headroom_attn::cpu_forward_workspace_bytes(
                &attn_dims,
                &attn_config,
                threads,
            )),
        }
    } else {
        AttnWorkspace {
            backward: headroom_attn::cpu_backward_scratch_bytes(&attn_dims, &attn_config, threads),
            forward_in_place: None,
        }
    };
    // Blocks differ only in which linears have adapters (targets may name layers): the
    // largest over the distinct sets.
    let no_adapters = [Vec::new()];
    let adapter_sets = finetune
        .as_ref()
        .map_or(&no_adapters[..], |f| &f.adapted_sets[..]);
    // A block forward recomputed during backward runs beside the incoming f32 gradient.
    let forward_live = if schedule.forward_count() > cfg.layers {
        btc
    } else {
        0
    };
    let block_workspaces: Vec<BlockWorkspace> = adapter_sets
        .iter()
        .map(|adapted| {
            let lin = LinearMoments {
                bt,
                low,
                in_place: tech.model.precision == crate::model::Precision::Bf16
                    && (products == Products::Cuda || matmul::bf16_products()),
                panels: products == Products::Host,
                finetune: finetune.as_ref(),
                adapted,
                threads,
            };
            if llama {
                llama_block_workspace(cfg, bt, a, &attn, &lin, forward_live)
            } else {
                gpt2_block_workspace(cfg, bt, a, &attn, &lin, forward_live)
            }
        })
        .collect();
    let block_ws = block_workspaces.iter().map(|w| w.peak).max().unwrap_or(0);
    let block_over_saved = block_workspaces
        .iter()
        .map(|w| w.over_saved)
        .max()
        .unwrap_or(0);
    device[MemoryCategory::Workspace] = head_ws.max(block_ws);
    device[MemoryCategory::Data] = LOADER_BUFFERS * 2 * u(batch) * t * 4;
    // A fine-tuning run's parameter peak is its base streaming in, before anything else but
    // the loader's buffers exists; training holds the steady parameters.
    let (training_params, loading_peak) = match &finetune {
        Some(f) => (
            f.parameter_steady,
            f.parameter_peak + device[MemoryCategory::Data],
        ),
        None => (device[MemoryCategory::Parameters], 0),
    };
    let constant =
        training_params + device[MemoryCategory::OptimizerState] + device[MemoryCategory::Data];
    let grads = device[MemoryCategory::Gradients];
    let staged = staged_grads.unwrap_or(StagedGrads {
        head: grads,
        block: grads,
        embedding: grads,
    });
    // Three moments bound the rest. The head's: the saved activations it runs with, its own
    // buffers and workspace, and (offloaded) the head's gradients. A block's backward, or a
    // forward: at most the schedule's activation peak with a recomputation's extra and a
    // block backward's workspace net of the activations that backward has dropped by then
    // (a forward's workspace is smaller), and one block's gradients — the
    // offloaded head's were handed to the host before the first block's backward, and a
    // forward holds none. The embedding's backward: no saved activation is left, the chain's
    // input gradient is within a block's workspace, and its own gradients are staged.
    let moments = PeakMoments {
        head_kept: io + at_loss + head_act,
        head_logits: if tech.model.loss_chunk.is_none() {
            bt * v * logit
        } else {
            0
        },
        block: io + sim.peak_saved_bytes + recompute_extra + block_over_saved,
        embedding: io + block_ws,
    };
    let head_moment = staged.head + moments.head_kept + head_ws;
    let block_moment = staged.block + moments.block;
    let embedding_moment = staged.embedding + moments.embedding;
    let device_peak =
        (constant + head_moment.max(block_moment).max(embedding_moment)).max(loading_peak);
    Ok(TrainerEstimate {
        device,
        device_peak,
        head_workspace: head_ws,
        block_backward_workspace: block_ws,
        moments,
        ..est
    })
}

/// The device's staged gradient bytes of an offloaded run, by the part whose backward holds
/// them.
#[derive(Clone, Copy)]
struct StagedGrads {
    head: u64,
    block: u64,
    embedding: u64,
}

/// What a fine-tuning run changes in the estimate: the frozen base's bytes (and their peak
/// while it streams in), the adapters, and which block linears are 4-bit or adapted.
struct FinetunePlan {
    /// Peak `Parameters`: the larger of the base's streaming peak (the tensors converted so
    /// far, and a double-quantized linear's f32 absmax values beside its quantized form) and
    /// the steady state (the frozen base, the adapters' fp32 masters and, in low precision,
    /// their working copies).
    parameter_peak: u64,
    /// `Parameters` while training: the frozen base and the adapters.
    parameter_steady: u64,
    /// The trainable tensors (PEFT's names and shapes).
    adapter_infos: Vec<params::ParamInfo>,
    adapter_numel: u64,
    /// The most adapter elements in one block (the staged gradients of an offloaded run).
    largest_block_adapter_numel: u64,
    /// Rank.
    r: u64,
    /// The distinct sets of block-local offsets of adapted linears over the blocks (one set
    /// when every block adapts the same modules; an empty set for a block without any).
    /// targets select by module name, and names differ only in the layer index).
    adapted_sets: Vec<Vec<usize>>,
    /// The 4-bit configuration when the block linears are quantized.
    quant: Option<headroom_quant::QuantConfig>,
    /// LoRA dropout on: the adapter's input is a dropped `[N, in]` copy.
    dropout: bool,
}

impl FinetunePlan {
    fn new(cfg: &ModelConfig, spec: &FinetuneSpec, a: u64, low: bool) -> Result<Self> {
        let infos = params::param_infos(cfg);
        let quant = spec.quantize.as_ref().map(|q| q.config()).transpose()?;
        let offsets = finetune::block_linear_offsets(cfg);
        let (mut live, mut peak) = (0u64, 0u64);
        for (i, info) in infos.iter().enumerate() {
            let n = u(info.shape.iter().product());
            let quantized = quant.is_some()
                && (0..cfg.layers)
                    .any(|l| offsets.iter().any(|&o| params::layer_index(cfg, l, o) == i));
            let frozen = match quant {
                Some(q) if quantized => u(q.stored_bytes(n as usize)),
                _ => n * a,
            };
            // Every tensor arrives in its stored form, read or drawn a chunk at a time
            // (`params::TensorSink`); a 4-bit linear is quantized as its chunks come
            // (`headroom_quant::Quantizer`), and with double quantization its f32 absmax
            // values (one per block) outlive the compressed ones' allocation.
            let transient = match quant {
                Some(q) if quantized && q.double_quant => {
                    frozen + 4 * n.div_ceil(u(q.blocksize.get()))
                }
                _ => frozen,
            };
            peak = peak.max(live + transient);
            live += frozen;
        }
        let modules = finetune::adapted_modules(cfg, &spec.lora)?;
        let adapter_infos = finetune::adapter_infos(cfg, &spec.lora)?;
        let adapter_numel: u64 = adapter_infos
            .iter()
            .map(|i| u(i.shape.iter().product()))
            .sum();
        let r = u(spec.lora.r);
        let mut per_block = vec![0u64; cfg.layers];
        for m in &modules {
            per_block[m.layer] += r * u(m.in_features + m.out_features);
        }
        let mut per_layer_sets = vec![Vec::new(); cfg.layers];
        for m in &modules {
            per_layer_sets[m.layer].push(m.param - params::layer_index(cfg, m.layer, 0));
        }
        let mut adapted_sets: Vec<Vec<usize>> = Vec::new();
        for set in per_layer_sets {
            if !adapted_sets.contains(&set) {
                adapted_sets.push(set);
            }
        }
        let steady = live + adapter_numel * 4 + if low { adapter_numel * a } else { 0 };
        Ok(FinetunePlan {
            parameter_peak: peak.max(steady),
            parameter_steady: steady,
            adapter_infos,
            adapter_numel,
            largest_block_adapter_numel: per_block.into_iter().max().unwrap_or(0),
            r,
            adapted_sets,
            quant,
            dropout: spec.lora.dropout > 0.0,
        })
    }
}

/// The workspace moments of one block linear's backward, for full training or fine-tuning:
/// given `live`, the f32 elements the block holds at that moment (the incoming gradient, the
/// input gradient being built, what the caller keeps), the peak elements of
/// - the base's input gradient: dense — in low precision with the f32 view of a kept input
///   and the panel the weight is widened into; 4-bit — the `[N, in]` partial gradient and
///   one dequantized strip per task, or with bf16 products one dequantized block and the
///   packing buffer;
/// - an adapter's (`Model::block_linear_backward`): `h` and `dh` `[N, r]`, and in low
///   precision the input's view and the A/B panels of each of its three GEMMs.
struct LinearMoments<'a> {
    bt: u64,
    low: bool,
    /// The products read a kept bf16 input in place (bf16 weights on AMX products): no view.
    in_place: bool,
    /// A low-precision weight's products need a panel ([`Products::Host`]).
    panels: bool,
    finetune: Option<&'a FinetunePlan>,
    /// This block's adapted linears (block-local offsets).
    adapted: &'a [usize],
    threads: usize,
}

impl LinearMoments<'_> {
    /// Peak elements while block linear `offset` (`[out, in]`) runs backward with `live`
    /// elements held; `kept_input`: its input is a kept activation (read through an f32
    /// view in low precision) rather than f32 scratch.
    fn peak(&self, live: u64, offset: usize, inp: usize, out: usize, kept_input: bool) -> u64 {
        let bt = self.bt;
        let view = self.view(inp, kept_input);
        // A fine-tuning run's base is frozen: its products never read the input.
        let base_view = if self.finetune.is_some() { 0 } else { view };
        let (panel, fwd_panel) = (|c, oc| self.panel(c, oc), |c, oc| self.fwd_panel(c, oc));
        let base = match self.finetune.and_then(|f| f.quant) {
            // bf16 products: one dequantized block and the packing buffer, accumulating
            // straight into the input gradient.
            Some(_) if self.in_place => {
                let (block, pack) =
                    quant_matmul::backward_scratch_dims(self.bt as usize, out, inp, self.threads);
                live + u(block.div_ceil(2)) + u(pack.div_ceil(2))
            }
            Some(_) => {
                let strips = headroom_quant::MatmulOptions::default().backward_workspace_bytes(
                    out,
                    inp,
                    self.threads,
                );
                live + bt * u(inp) + u(strips) / 4
            }
            None => live + base_view + panel(inp, out),
        };
        let adapter = match self.finetune {
            Some(f) if self.adapted.contains(&offset) && f.dropout => {
                // dropout(x) (made from the input's view), then h, dh and the partial input
                // gradient that the mask is applied to, all reading the f32 dropped copy.
                let (r, ru, xd) = (f.r, f.r as usize, bt * u(inp));
                let d0 = live + xd + self.copy(inp, kept_input);
                let d1 = live + xd + bt * r + fwd_panel(inp, ru);
                let d2 = live + xd + 2 * bt * r + panel(ru, out);
                let d3 = live + xd + bt * r + xd + panel(inp, ru);
                d0.max(d1).max(d2).max(d3)
            }
            Some(f) if self.adapted.contains(&offset) => {
                let (r, ru) = (f.r, f.r as usize);
                let a1 = live + bt * r + view + fwd_panel(inp, ru);
                let a2 = live + 2 * bt * r + panel(ru, out);
                let a3 = live + bt * r + view + panel(inp, ru);
                a1.max(a2).max(a3)
            }
            _ => 0,
        };
        base.max(adapter)
    }

    /// Elements of the panel a low-precision weight `[oc, c]` is widened (or packed) into for
    /// the input gradient's product.
    fn panel(&self, c: usize, oc: usize) -> u64 {
        if self.low && self.panels {
            u(matmul::backward_scratch(self.bt as usize, c, oc))
        } else {
            0
        }
    }

    /// [`LinearMoments::panel`] for the forward product.
    fn fwd_panel(&self, c: usize, oc: usize) -> u64 {
        if self.low && self.panels {
            u(matmul::forward_scratch(self.bt as usize, c, oc))
        } else {
            0
        }
    }

    /// Elements of the f32 view a dense product reads of its `[N, inp]` input: a kept
    /// activation in low precision, unless the products read it in place.
    fn view(&self, inp: usize, kept_input: bool) -> u64 {
        if self.in_place {
            0
        } else {
            self.copy(inp, kept_input)
        }
    }

    /// Elements of the f32 copy of a kept `[N, inp]` input that the 4-bit products and LoRA's
    /// dropout read (always, in low precision).
    fn copy(&self, inp: usize, kept_input: bool) -> u64 {
        if self.low && kept_input {
            self.bt * u(inp)
        } else {
            0
        }
    }

    /// Peak elements while block linear `offset` (`[out, in]`) runs forward
    /// (`Model::block_linear`) with `live` elements held, its output included: the base's
    /// product (the input's f32 view in low precision, and the widened weight panel or one
    /// dequantized strip per task — with bf16 products, no view and one dequantized block and
    /// the packing buffer), then an adapter's `h` `[N, r]` and `u` `[N, out]`.
    fn forward_peak(
        &self,
        live: u64,
        offset: usize,
        inp: usize,
        out: usize,
        kept_input: bool,
    ) -> u64 {
        let bt = self.bt;
        let view = self.view(inp, kept_input);
        let fwd_panel = |c, oc| self.fwd_panel(c, oc);
        let base = match self.finetune.and_then(|f| f.quant) {
            // bf16 products read the input in place.
            Some(_) if self.in_place => {
                let (block, pack) =
                    quant_matmul::forward_scratch_dims(self.bt as usize, out, inp, self.threads);
                live + u(block.div_ceil(2)) + u(pack.div_ceil(2))
            }
            Some(_) => {
                let strips = headroom_quant::MatmulOptions::default().forward_workspace_bytes(
                    out,
                    inp,
                    self.threads,
                );
                live + self.copy(inp, kept_input) + u(strips) / 4
            }
            None => live + view + fwd_panel(inp, out),
        };
        let adapter = match self.finetune {
            Some(f) if self.adapted.contains(&offset) => {
                let (h, ru) = (bt * f.r, f.r as usize);
                // h = dropout(x)·Aᵀ (the dropped copy made from the input's view), or x·Aᵀ.
                let first = if f.dropout {
                    let xd = bt * u(inp);
                    (live + xd + self.copy(inp, kept_input)).max(live + xd + h + fwd_panel(inp, ru))
                } else {
                    live + h + view + fwd_panel(inp, ru)
                };
                // u = h·Bᵀ, added into the output.
                first.max(live + h + bt * u(out) + fwd_panel(ru, out))
            }
            _ => 0,
        };
        base.max(adapter)
    }
}

/// Attention's workspace as a block sees it.
struct AttnWorkspace {
    /// Bytes the backward holds beyond its f32 gradients: headroom-attn's prediction (with,
    /// reading bf16, one group of heads' f32 copies).
    backward: u64,
    /// Bytes the forward holds beyond its output when it reads the stored bf16/f16 in place;
    /// `None` in fp32, where the model hands it its own f32 tensors.
    forward_in_place: Option<u64>,
}

impl AttnWorkspace {
    /// Elements the forward's attention moment holds: its own workspace when it reads
    /// bf16/f16 in place, none in fp32.
    fn forward(&self) -> u64 {
        self.forward_in_place.map_or(0, |b| b.div_ceil(4))
    }
}

/// A Llama block backward's workspace peak: the largest of its moments, each the sum of the
/// f32 buffers live at once (`llama_block_backward` allocates them in this order). Always live:
/// the incoming gradient (the norms, SwiGLU and the residual read the kept bf16/f16 input,
/// `res2`, gate and up in place). Widths: C model, F SwiGLU, K keys and values. The forward's
/// moments hold `forward_live` more elements (a recomputation's incoming gradient).
fn llama_block_workspace(
    cfg: &ModelConfig,
    bt: u64,
    a: u64,
    attn: &AttnWorkspace,
    lin: &LinearMoments<'_>,
    forward_live: u64,
) -> BlockWorkspace {
    let low = a < 4;
    use params::llama_layer as o;
    let (c, f) = (u(cfg.channels), u(cfg.ffn()));
    let k = u(cfg.kv_heads() * cfg.head_dim());
    let (btc, btf, btk, btq) = (bt * c, bt * f, bt * k, bt * u(cfg.attention_width()));
    let (cu, fu, ku) = (cfg.channels, cfg.ffn(), cfg.kv_heads() * cfg.head_dim());
    let wu = cfg.attention_width();
    let (qk_norm, input_norms) = match cfg.family {
        Family::Llama(s) => (s.qk_norm_kind(), s.input_norms()),
        Family::Gpt2 => (None, true),
    };
    // OLMo 2's q and k gradients leave their norms merged, and without an input norm the
    // q/k/v backward adds into dres2 itself: no dnorm1 and no merge scratch for them.
    let dnorm1 = if input_norms { btc } else { 0 };
    let (merge_q, merge_k) = match qk_norm {
        Some(QkNorm::Projection) => (0, 0),
        _ => (btq, btk),
    };
    // Gemma 3's and OLMo 2's output norms: the gradient of each sublayer's output beside its
    // residual's while that sublayer's output projection runs backward; each norm's kept input
    // and statistics are dropped once its backward has run.
    // Granite's residual multiplier: the scaled copy of the residual's gradient in its place.
    let output_norms = matches!(cfg.family, Family::Llama(s) if s.output_norms());
    let residual_scale = matches!(cfg.family, Family::Llama(s) if s.residual_scale().is_some());
    let (out_grad, out_norm_kept) = match (output_norms, residual_scale) {
        (true, _) => (btc, btc * a + bt * 4),
        (false, true) => (btc, 0),
        (false, false) => (0, 0),
    };
    // The incoming gradient.
    let (mlp_common, attn_common) = (btc, btc);
    // down's backward: dact.
    let first = lin.peak(mlp_common + out_grad + btf, o::DOWN, fu, cu, true) * 4;
    // From attention's backward on: dres2 and dq, dk, dv.
    let attn_grads = attn_common + btc + btq + 2 * btk;
    // The query and key norms' backward: each norm's input gradient beside the gradients (a
    // bf16/f16 gain is read through an f32 copy; a frozen one's gradient lands in a scratch),
    // the query's while dq is live, the key's once dq is replaced by it. OLMo 2's merge the
    // heads' gradient first, into a buffer that replaces them. Gains are a head wide, or the
    // projection's width.
    let hs = u(cfg.head_dim());
    let gain = |width: u64| width * (u64::from(low) + u64::from(lin.finetune.is_some()));
    let head_norms = match qk_norm {
        Some(QkNorm::PerHead) => (attn_grads + btq + gain(hs)).max(attn_grads + btk + gain(hs)),
        Some(QkNorm::Projection) => {
            (attn_grads + btq + gain(u(wu))).max(attn_grads + btk + gain(u(ku)))
        }
        None => 0,
    };
    let mlp = [
        // The gate's backward: dgate, and dact becoming dup in place.
        mlp_common + 2 * btf,
        // gate's backward: dgate, dup, dnorm2.
        lin.peak(mlp_common + 2 * btf + btc, o::GATE, cu, fu, true),
        // up's backward: dup, dnorm2.
        lin.peak(mlp_common + btf + btc, o::UP, cu, fu, true),
        // o_proj's backward: dres2, (the output norm's input gradient,) atty, datty (atty is
        // f32 scratch: no view).
        lin.peak(attn_common + btc + out_grad + 2 * btq, o::O, wu, cu, false),
    ];
    let attention_side = [
        head_norms,
        // q's, k's and v's backward: dres2, dq, dk, dv, dnorm1, the merged head gradient.
        lin.peak(attn_grads + dnorm1 + merge_q, o::Q, cu, wu, true),
        lin.peak(attn_grads + dnorm1 + merge_k, o::K, cu, ku, true),
        lin.peak(attn_grads + dnorm1 + btk, o::V, cu, ku, true),
    ];
    let most = |m: &[u64]| m.iter().copied().max().unwrap_or(0) * 4;
    // Attention's own workspace (naive's probability gradient, partials, scratch; reading
    // bf16/f16, a group of heads' f32 copies), with dres2, dy and dq/dk/dv.
    let attention = (attn_grads + btq) * 4 + attn.backward;
    // The forward (`llama_block_forward`; its f32 outputs are workspace until rounded in low
    // precision): each projection with its output, q/k/v's through a flat scratch; attention
    // with its own workspace. Qwen3's head norms write a fresh output once their input is
    // kept: less than the flat scratch and the heads together. OLMo 2's q and k projections
    // are the norm's kept input, fresh; its output is a scratch beside the fresh heads.
    let fresh = |elems: u64| if low { elems } else { 0 };
    let (q_out, k_out) = match qk_norm {
        Some(QkNorm::Projection) => (fresh(btq), fresh(btk)),
        _ => (btq, btk),
    };
    let forward = [
        lin.forward_peak(q_out, o::Q, cu, wu, true),
        lin.forward_peak(k_out, o::K, cu, ku, true),
        lin.forward_peak(btk, o::V, cu, ku, true),
        btq + fresh(btq),
        attn.forward(),
        lin.forward_peak(btq + fresh(btc), o::O, wu, cu, false),
        lin.forward_peak(fresh(btf), o::GATE, cu, fu, true),
        lin.forward_peak(fresh(btf), o::UP, cu, fu, true),
        lin.forward_peak(fresh(btc), o::DOWN, fu, cu, true),
    ]
    .into_iter()
    .max()
    .map_or(0, |m| (m + forward_live) * 4);
    // The gate's output (kept, or recomputed under selective recomputation) is dropped right
    // after down's backward: every later moment holds B·T·F fewer activation elements (and
    // what the output norms kept, from the end of each one's backward).
    let act = btf * a;
    BlockWorkspace::from_moments(&[
        (first, out_norm_kept),
        (most(&mlp), out_norm_kept + act),
        (
            most(&attention_side).max(attention),
            2 * out_norm_kept + act,
        ),
    ])
    .with_forward(forward)
}

/// A GPT-2 block backward's workspace peak, moment by moment as `gpt2_block_backward`
/// allocates: the incoming gradient always (the norms, GELU and the residual read the kept
/// bf16/f16 input, `res2` and `fch` in place). The forward's moments hold `forward_live` more
/// elements (a recomputation's incoming gradient).
fn gpt2_block_workspace(
    cfg: &ModelConfig,
    bt: u64,
    a: u64,
    attn: &AttnWorkspace,
    lin: &LinearMoments<'_>,
    forward_live: u64,
) -> BlockWorkspace {
    let low = a < 4;
    use params::layer as o;
    let c = cfg.channels;
    let btc = bt * u(c);
    let (mlp_common, attn_common) = (btc, btc);
    // Attention's backward: dres2, dy, dq, dk, dv.
    let attention = attn_common + 5 * btc;
    // The MLP projection's backward: dfch_gelu.
    let first = lin.peak(mlp_common + 4 * btc, o::FC_PROJ_W, 4 * c, c, true) * 4;
    let later = [
        // GELU's backward: dfch_gelu, becoming dfch in place.
        mlp_common + 4 * btc,
        // c_fc's backward: dfch, dln2.
        lin.peak(mlp_common + 5 * btc, o::FC_W, c, 4 * c, true),
        // The attention projection's backward: dres2, atty, datty.
        lin.peak(attn_common + 3 * btc, o::ATTN_PROJ_W, c, c, false),
        // Merging the heads' gradients: dres2, dq, dk, dv and dqkv.
        attn_common + 7 * btc,
        // c_attn's backward: dres2, dqkv, dln1.
        lin.peak(attn_common + 5 * btc, o::QKV_W, c, 3 * c, true),
    ]
    .into_iter()
    .max()
    .unwrap_or(0)
        * 4;
    let later = later.max(attention * 4 + attn.backward);
    // The forward (`gpt2_block_forward`; its f32 outputs are workspace until rounded in low
    // precision): c_attn into the qkv scratch, then q, k, v beside it; attention with its own
    // workspace; each later linear with its output.
    let fresh = |elems: u64| if low { elems } else { 0 };
    let forward = [
        lin.forward_peak(3 * btc, o::QKV_W, c, 3 * c, true),
        3 * btc + fresh(3 * btc),
        attn.forward(),
        lin.forward_peak(btc + fresh(btc), o::ATTN_PROJ_W, c, c, false),
        lin.forward_peak(fresh(4 * btc), o::FC_W, c, 4 * c, true),
        lin.forward_peak(fresh(btc), o::FC_PROJ_W, 4 * c, c, true),
    ]
    .into_iter()
    .max()
    .map_or(0, |m| (m + forward_live) * 4);
    // The GELU output (kept, or recomputed under selective recomputation) is dropped right
    // after the projection's backward, so every later moment holds 4·B·T·C fewer activation
    // elements than the block started its backward with.
    BlockWorkspace::new(first, later, 4 * btc * a).with_forward(forward)
}

/// A block backward's workspace at its moments: the peak (the `Workspace` category's), and
/// the most it adds to the activations live when the block's backward began, once what the
/// backward has dropped by then is taken off (the simultaneous peak's block moment).
#[derive(Clone, Copy, Debug, PartialEq)]
struct BlockWorkspace {
    peak: u64,
    over_saved: u64,
}

impl BlockWorkspace {
    /// With a block forward's workspace peak `forward` (bytes): part of the peak, and a moment
    /// whose saved activations are at most those a backward starts with.
    fn with_forward(self, forward: u64) -> Self {
        BlockWorkspace {
            peak: self.peak.max(forward),
            over_saved: self.over_saved.max(forward),
        }
    }

    /// From the workspace of the first moment (the MLP's output projection, before anything
    /// saved is dropped) and the largest of the later ones, after which `released` bytes of
    /// the block's activations are gone.
    fn new(first: u64, later: u64, released: u64) -> Self {
        Self::from_moments(&[(first, 0), (later, released)])
    }

    /// From moments of the backward, each its workspace bytes and the activation bytes the
    /// backward has dropped by then.
    fn from_moments(moments: &[(u64, u64)]) -> Self {
        BlockWorkspace {
            peak: moments.iter().map(|m| m.0).max().unwrap_or(0),
            over_saved: moments
                .iter()
                .map(|&(workspace, released)| workspace.saturating_sub(released))
                .max()
                .unwrap_or(0),
        }
    }
}

/// Bytes no estimate may reach (2⁶²): with every term below this bound, the plain `u64`
/// arithmetic of [`estimate`] cannot overflow.
const MAX_ESTIMATE_BYTES: f64 = (1u64 << 62) as f64;

/// Refuse shapes whose byte counts would overflow: an upper bound of every term the estimate
/// adds (each with a generous constant). Computed in f64, which cannot overflow for any `usize`
/// inputs; its relative rounding (1e-16) is immaterial against the 4× margin to 2⁶⁴.
fn check_magnitude(cfg: &ModelConfig, seq: usize, micro: usize, batch: usize) -> Result<()> {
    let w = |x: usize| x as f64;
    let (b, t, c, h, v, l) = (
        w(micro),
        w(seq),
        w(cfg.channels),
        w(cfg.heads),
        w(cfg.vocab),
        w(cfg.layers),
    );
    let p = cfg.parameter_count()? as f64;
    let bt = b * t;
    let f = w(cfg.ffn());
    let per_block = bt * (c + f + 1.0) * 64.0 + b * h * t * t * 8.0;
    let bound =
        p * 64.0 + (l + 2.0) * per_block + bt * v * 16.0 + c * (c + f) * 64.0 + w(batch) * t * 64.0;
    if bound > MAX_ESTIMATE_BYTES {
        return Err(TrainError::Option {
            option: "--batch",
            reason: format!(
                "batch {batch} (micro-batch {micro}) × {seq} tokens of {cfg:?} needs more than \
                 2^62 bytes"
            ),
        });
    }
    Ok(())
}

/// Bytes of AdamW's two moments over `infos`: f32, or u8 codes with an f32 scale per block of
/// each tensor.
fn optimizer_state_bytes(infos: &[params::ParamInfo], state: StatePrecision) -> u64 {
    match state {
        StatePrecision::F32 => {
            8 * infos
                .iter()
                .map(|i| u(i.shape.iter().product()))
                .sum::<u64>()
        }
        StatePrecision::Int8 | StatePrecision::Float8 => infos
            .iter()
            .map(|i| {
                let n = u(i.shape.iter().product());
                2 * n + 2 * n.div_ceil(u(INT8_BLOCK)) * 4
            })
            .sum(),
    }
}

/// The parameter state of a CUDA run (feature `cuda`): peak bytes of `Parameters`,
/// `Gradients` and `OptimizerState` on the device and on the host. Activations, workspace and
/// data are not modelled here (the CUDA model keeps a different activation set from the CPU
/// model's that [`estimate`] costs).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CudaParameterState {
    /// Device bytes (only the three parameter-state categories are non-zero).
    pub device: PerCategory<u64>,
    /// Host bytes (likewise).
    pub host: PerCategory<u64>,
}

/// Predict [`CudaParameterState`] for `cfg` trained with `tech` on a CUDA device. The tracker
/// of such a run shows these peaks exactly:
///
/// - device `Parameters`: the model's weights — resident, the fp32 masters plus one working
///   copy of every parameter in the storage precision (none under fp32, which reads the
///   masters); offloaded, the working copies alone (f32 under fp32). The ops read norm gains,
///   biases and embeddings through transient f32 copies (`Workspace`), not kept ones;
/// - `Gradients`: f32 for every parameter on the device (resident: the accumulator; offloaded:
///   the model's per-micro-batch buffers), and offloaded also the host accumulator's;
/// - `OptimizerState`: the moments on the device (resident, f32 only) or the host (RAM
///   offload; a file store is page cache, on neither ledger);
/// - host `Parameters`: the fp32 masters — offloaded, kept; resident, the initial copy the
///   masters are uploaded from (dropped before the first step, but a peak).
///
/// Errors for a setup the CUDA path refuses (8-bit state resident on the device).
pub fn cuda_parameter_state(cfg: &ModelConfig, tech: &Techniques) -> Result<CudaParameterState> {
    cfg.validate()?;
    let resident = tech.optimizer.placement == OptimizerPlacement::Resident;
    if resident && tech.optimizer.state.is_8bit() {
        return Err(TrainError::Config(
            "8-bit optimizer state on CUDA runs only offloaded".into(),
        ));
    }
    let infos = params::param_infos(cfg);
    let p: u64 = infos.iter().map(|i| u(i.shape.iter().product())).sum();
    // `Model::from_masters` (resident) or `Model::from_working` (offloaded).
    let storage = u(tech.model.precision.storage().size_in_bytes());
    let mut device = PerCategory::<u64>::default();
    let mut host = PerCategory::<u64>::default();
    device[MemoryCategory::Parameters] = match (resident, tech.model.precision.is_low()) {
        (true, true) => 4 * p + storage * p,
        (true, false) => 4 * p,
        (false, _) => storage * p,
    };
    host[MemoryCategory::Parameters] = 4 * p;
    device[MemoryCategory::Gradients] = 4 * p;
    let state = optimizer_state_bytes(&infos, tech.optimizer.state);
    match &tech.optimizer.placement {
        OptimizerPlacement::Resident => device[MemoryCategory::OptimizerState] = state,
        OptimizerPlacement::HostRam => host[MemoryCategory::OptimizerState] = state,
        OptimizerPlacement::File(_) => {}
    }
    if !resident {
        host[MemoryCategory::Gradients] = 4 * p;
    }
    Ok(CudaParameterState { device, host })
}

/// The workspace cuBLASLt is offered per GEMM on Hopper (headroom-cuda follows NVIDIA's
/// recommendation: 32 MiB on compute capability 9.x, 4 MiB before). Each GEMM allocates it
/// through the backend, so the tracker counts it as `Workspace` while the GEMM runs.
pub const CUBLASLT_WORKSPACE_HOPPER: u64 = 32 << 20;

/// Workspace the CUDA model's head holds at its largest moment, the input-gradient GEMM of a
/// chunk of `r` rows (`--loss-chunk`'s, else all `n = micro · seq`), with `cublas_workspace`
/// bytes offered to cuBLASLt:
///
/// - the final norm's input gradient `dlnf` `[n, C]` f32 and the targets on the device (u32);
/// - the normed input in the weights' dtype (`[n, C]`; the norm writes f32, cuBLASLt reads
///   bf16);
/// - the chunk's logits `[r, V]` when fused (`Workspace`; unfused they are activations, see
///   [`cuda_logit_bytes`]), whose gradient the loss writes over them — in bf16 under bf16,
///   where cuBLASLt reads it as it is; otherwise f32, and a copy in the weights' dtype for the
///   GEMMs (cuBLASLt takes no f32 × bf16 product);
/// - the chunk's losses and loss gradients (`[r]` f32 each);
/// - chunked: the chunk's copies of the input rows, targets and input gradient;
/// - the GEMM's cuBLASLt workspace.
///
/// Unlike the CPU model's head ([`TrainerEstimate::head_workspace`]) nothing is widened: the
/// CPU's bf16 panels have no CUDA counterpart. Checked against the tracker on an H100
/// (`benches/results/2026-11-25-h100-first-gpu-run.md`).
pub fn cuda_head_workspace(
    cfg: &ModelConfig,
    seq: usize,
    micro: usize,
    tech: &Techniques,
    cublas_workspace: u64,
) -> u64 {
    let a = u(tech.model.precision.storage().size_in_bytes());
    let (c, v) = (u(cfg.channels), u(cfg.vocab));
    let n = u(micro) * u(seq);
    let r = tech
        .model
        .loss_chunk
        .map_or(n, |rows| u(rows).clamp(1, n.max(1)));
    let low_copy = |elements: u64| if a == 4 { 0 } else { elements * a };
    let logit = cuda_logit_bytes(tech);
    let logits = if tech.model.loss_chunk.is_some() {
        r * v * logit
    } else {
        0
    };
    let gradient_copy = if logit == 4 { low_copy(r * v) } else { 0 };
    let chunk_copies = if r < n {
        r * c * a + r * 4 + r * c * 4
    } else {
        0
    };
    n * c * 4 // dlnf
        + n * 4 // targets
        + low_copy(n * c) // the normed input in the weights' dtype
        + logits
        + gradient_copy // the logits' gradient in the weights' dtype
        + 2 * r * 4 // losses and loss gradients of the chunk
        + chunk_copies
        + cublas_workspace
}

/// Bytes of one logit in the CPU model's head over `bt` tokens (a micro-batch): 2 where a bf16
/// run keeps its logits in bf16 ([`matmul::bf16_head_logits`]: a vocabulary wide enough for the
/// f32 strip the product passes through to cost less than f32 logits, and products that read
/// a bf16 gradient piece by piece), else 4.
pub fn cpu_logit_bytes(cfg: &ModelConfig, tech: &Techniques, bt: u64) -> u64 {
    let head_rows = tech.model.loss_chunk.map_or(bt, |r| u(r).min(bt));
    if tech.model.precision == crate::model::Precision::Bf16
        && matmul::bf16_head_logits(
            bt as usize,
            head_rows as usize,
            cfg.channels,
            cfg.vocab,
            true,
        )
    {
        2
    } else {
        4
    }
}

/// Bytes of one logit in the CUDA model's head: 2 under bf16 (the head stores the values the
/// f32 path would round to bf16, and the loss writes their bf16 gradient over them), else 4.
pub fn cuda_logit_bytes(tech: &Techniques) -> u64 {
    if tech.model.precision.storage() == headroom_tensor::DType::BF16 {
        2
    } else {
        4
    }
}

/// The CUDA model's simultaneous device peak as its tracker counts it (`peak_total`), for
/// `cfg` trained on micro-batches of `micro` sequences of `seq` tokens (`batch` per step) with
/// `tech`, with `cublas_workspace` bytes offered to cuBLASLt per GEMM
/// ([`CUBLASLT_WORKSPACE_HOPPER`] on an H100/H200).
///
/// The constant part is [`cuda_parameter_state`]'s device bytes (exact; every gradient stays
/// on the device, offloaded or not, and batches stay on the host). The moments are the CPU
/// model's ([`PeakMoments`]: the CUDA model keeps the same activations but for the logits,
/// bf16 under bf16 — [`cuda_logit_bytes`]) with the head's workspace from
/// [`cuda_head_workspace`] and a block backward's plus one GEMM's cuBLASLt workspace. The head's moment is modelled op by op; a block's uses the CPU model's
/// transients, so where a block backward is the peak (a fused loss over few rows) the figure
/// is an estimate rather than the tracker's exact count. Those transients are costed as
/// cuBLASLt's products run (bf16 inputs read in place, no widened or packed panel), not as
/// this host's CPU kernels would, so the figure does not depend on the machine computing it.
pub fn cuda_device_peak(
    cfg: &ModelConfig,
    seq: usize,
    micro: usize,
    batch: usize,
    tech: &Techniques,
    cublas_workspace: u64,
) -> Result<u64> {
    let e = estimate_for(cfg, seq, micro, batch, tech, Products::Cuda)?;
    let state = cuda_parameter_state(cfg, tech)?;
    let constant = state.device[MemoryCategory::Parameters]
        + state.device[MemoryCategory::Gradients]
        + state.device[MemoryCategory::OptimizerState];
    // Both heads keep their logits in bf16 under bf16, the CPU model's only over a wide
    // enough vocabulary (and where its products can read a bf16 gradient).
    let cpu_logit = cpu_logit_bytes(cfg, tech, u(seq) * u(micro));
    let cuda_logits = e.moments.head_logits / cpu_logit * cuda_logit_bytes(tech);
    let head = e.moments.head_kept - e.moments.head_logits
        + cuda_logits
        + cuda_head_workspace(cfg, seq, micro, tech, cublas_workspace);
    let block = e.moments.block + cublas_workspace;
    Ok(constant + head.max(block).max(e.moments.embedding))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::techniques::OptimizerChoice;

    /// vocab 32, context 8, one block, width 4: every tensor counted by hand.
    fn cfg() -> ModelConfig {
        ModelConfig {
            vocab: 32,
            max_seq: 8,
            layers: 1,
            heads: 1,
            channels: 4,
            family: crate::model::Family::Gpt2,
        }
    }

    #[test]
    fn cuda_parameter_state_counts_every_copy_by_hand() {
        let c = 4u64;
        let (wte, wpe) = (32 * c, 8 * c);
        // The block's four matrices (qkv, attention projection, fc, fc projection) and its
        // vectors (two layer norms' weight and bias, the four biases), then ln_f.
        let matrices = c * 3 * c + c * c + c * 4 * c + 4 * c * c;
        let vectors = 4 * c + 3 * c + c + 4 * c + c;
        let lnf = 2 * c;
        let p = wte + wpe + matrices + vectors + lnf;
        let infos = params::param_infos(&cfg());
        assert_eq!(
            infos
                .iter()
                .map(|i| u(i.shape.iter().product()))
                .sum::<u64>(),
            p
        );
        // One bf16 working copy of every parameter.
        let working = 2 * p;

        let mut tech = Techniques::baseline();
        tech.model.precision = crate::model::Precision::Bf16;
        let r = cuda_parameter_state(&cfg(), &tech).unwrap();
        assert_eq!(r.device[MemoryCategory::Parameters], working + 4 * p);
        assert_eq!(r.device[MemoryCategory::Gradients], 4 * p);
        assert_eq!(r.device[MemoryCategory::OptimizerState], 8 * p);
        assert_eq!(r.host[MemoryCategory::Parameters], 4 * p);
        assert_eq!(r.host[MemoryCategory::Gradients], 0);
        assert_eq!(r.host[MemoryCategory::OptimizerState], 0);

        tech.optimizer.placement = OptimizerPlacement::HostRam;
        let r = cuda_parameter_state(&cfg(), &tech).unwrap();
        assert_eq!(r.device[MemoryCategory::Parameters], working);
        assert_eq!(r.device[MemoryCategory::Gradients], 4 * p);
        assert_eq!(r.device[MemoryCategory::OptimizerState], 0);
        assert_eq!(r.host[MemoryCategory::Parameters], 4 * p);
        assert_eq!(r.host[MemoryCategory::Gradients], 4 * p);
        assert_eq!(r.host[MemoryCategory::OptimizerState], 8 * p);

        // fp32 offloaded: f32 working copies; fp32 resident: the masters are the weights.
        tech.model.precision = crate::model::Precision::Fp32;
        let r = cuda_parameter_state(&cfg(), &tech).unwrap();
        assert_eq!(r.device[MemoryCategory::Parameters], 4 * p);
        tech.optimizer.placement = OptimizerPlacement::Resident;
        let r = cuda_parameter_state(&cfg(), &tech).unwrap();
        assert_eq!(r.device[MemoryCategory::Parameters], 4 * p);

        tech.optimizer = OptimizerChoice {
            state: StatePrecision::Float8,
            placement: OptimizerPlacement::File("unused".into()),
        };
        let r = cuda_parameter_state(&cfg(), &tech).unwrap();
        assert_eq!(r.host[MemoryCategory::OptimizerState], 0, "page cache");
        assert_eq!(r.device[MemoryCategory::OptimizerState], 0);

        tech.optimizer = OptimizerChoice {
            state: StatePrecision::Float8,
            placement: OptimizerPlacement::Resident,
        };
        assert!(matches!(
            cuda_parameter_state(&cfg(), &tech),
            Err(TrainError::Config(_))
        ));
    }
}
