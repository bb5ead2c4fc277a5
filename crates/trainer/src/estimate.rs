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

use crate::model::{params, Family, ModelConfig};
use crate::ops::matmul;
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
    /// The device's simultaneous peak: the constant categories plus the larger of the head's
    /// moment (every kept activation, the head's buffers and workspace) and a block backward's
    /// (kept activations, recomputed ones, the block's workspace). An upper bound of the
    /// tracker's `peak_total`, tighter than [`TrainerEstimate::device_total`] (which adds each
    /// category's own peak although they peak at different moments).
    pub device_peak: u64,
}

impl TrainerEstimate {
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

/// Predict peak bytes per category for `cfg` trained on micro-batches of `micro` sequences of
/// `seq` tokens (`batch` per step) with `tech`.
pub fn estimate(
    cfg: &ModelConfig,
    seq: usize,
    micro: usize,
    batch: usize,
    tech: &Techniques,
) -> Result<TrainerEstimate> {
    cfg.validate()?;
    if seq == 0 || micro == 0 || batch == 0 || batch % micro != 0 || seq > cfg.max_seq {
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

    // Parameters: fp32 masters (forward reads them in fp32) plus the working copy in low
    // precision; offloading a low-precision run moves the masters to the host.
    if low {
        device[MemoryCategory::Parameters] = p * a;
        if offload {
            host[MemoryCategory::Parameters] = p * 4;
        } else {
            device[MemoryCategory::Parameters] += p * 4;
        }
    } else {
        device[MemoryCategory::Parameters] = p * 4;
    }
    // Gradients: the accumulator's f32 buffers — on the host when offloading, where the
    // device holds one part's gradients at a time: the head's (its weight and the final
    // norm), the embedding's or one block's.
    if offload {
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
    } else {
        device[MemoryCategory::Gradients] = p * 4;
    }
    // Optimizer state: two moments per parameter, f32 or u8 with an f32 scale per block of
    // each tensor.
    let state = optimizer_state_bytes(&infos, tech.optimizer.state);
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
    let dropped_by_selective = (2 * btc + btf) * a;
    let attention_saved = (btc + 2 * btk) * a // q, k, v
        + btc * a // attention output
        + b * h * t * 4 // logsumexp
        + probs;
    let mlp_saved = if llama { 2 * btf * a } else { btf * a }; // gate and up, or fch
    let block_saved = 2 * norm_stats
        + attention_saved
        + btc * a // res2
        + mlp_saved
        + if selective { 0 } else { dropped_by_selective };
    let io = btc * a;
    let head_rows = tech.model.loss_chunk.map_or(bt, |r| u(r).min(bt));
    // The final norm's output and statistics and the per-token losses; the logits too when
    // not fused.
    let head_act = btc * 4
        + norm_stats
        + bt * 4
        + if tech.model.loss_chunk.is_none() {
            bt * v * 4
        } else {
            0
        };
    // A recomputed norm's statistics live until the next one is recomputed.
    let recompute_extra = if selective {
        dropped_by_selective + norm_stats
    } else {
        0
    };
    let est = TrainerEstimate {
        parameter_count: p,
        device,
        host,
        block_saved_bytes: block_saved,
        block_io_bytes: io,
        layers: cfg.layers,
        device_peak: 0,
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
    let sim = schedule.simulate(&est.block_chain_cost()?)?;
    let mut device = est.device;
    // The embedding output is the chain's input (held by the caller throughout); the head runs
    // when the chain's output is in hand, the peak of a store-all schedule.
    device[MemoryCategory::Activations] = io + sim.peak_saved_bytes + head_act.max(recompute_extra);

    // Workspace: the larger of the head (dlnf and the logits' gradient — or both logit chunks
    // when fused — plus, in low precision, the f32 view of the residual and the panel the
    // head's weight is widened into: the GEMMs read the bf16/f16 weight in place) and a
    // block's backward.
    let views_head = if low {
        let (n, rows) = (bt as usize, head_rows as usize);
        btc * 4
            + u(matmul::chunked_scratch(
                n,
                rows,
                cfg.channels,
                cfg.vocab,
                true,
            )) * 4
    } else {
        0
    };
    let logits_ws = if tech.model.loss_chunk.is_some() {
        2 * head_rows * v * 4
    } else {
        head_rows * v * 4
    };
    let head_ws = btc * 4 + logits_ws + views_head;
    let naive_ws = probs;
    let block_ws = if llama {
        llama_block_workspace(cfg, bt, low, naive_ws)
    } else if low {
        // GPT-2 at its two widest moments: the MLP (incoming gradient, dfch_gelu and dfch;
        // the f32 views of x, res2 and fch — or, one op earlier, of fch_gelu and the panel the
        // 4C×C projection weight is widened into) and attention (incoming gradient, dres2, dy,
        // dq/dk/dv, naive attention's [b, H, T, T] probability gradient; the f32 views of x,
        // q, k, v and the attention output).
        let proj_panel = u(matmul::backward_scratch(
            bt as usize,
            4 * cfg.channels,
            cfg.channels,
        ));
        let mlp = (15 * btc * 4).max(11 * btc * 4 + proj_panel * 4);
        mlp.max(11 * btc * 4 + naive_ws)
    } else {
        (9 * btc * 4).max(6 * btc * 4 + naive_ws)
    };
    device[MemoryCategory::Workspace] = head_ws.max(block_ws);
    device[MemoryCategory::Data] = LOADER_BUFFERS * 2 * u(batch) * t * 4;
    let constant = device[MemoryCategory::Parameters]
        + device[MemoryCategory::Gradients]
        + device[MemoryCategory::OptimizerState]
        + device[MemoryCategory::Data];
    let device_peak =
        constant + io + sim.peak_saved_bytes + (head_act + head_ws).max(recompute_extra + block_ws);
    Ok(TrainerEstimate {
        device,
        device_peak,
        ..est
    })
}

/// A Llama block backward's workspace peak: the largest of its moments, each the sum of the
/// f32 buffers live at once (`llama_block_backward` allocates them in this order). Always live:
/// the incoming gradient; in low precision also the f32 views of the input and (through the
/// MLP and the post-attention norm) of `res2`. Widths: C model, F SwiGLU, K keys and values.
fn llama_block_workspace(cfg: &ModelConfig, bt: u64, low: bool, naive_ws: u64) -> u64 {
    let (c, f) = (u(cfg.channels), u(cfg.ffn()));
    let k = u(cfg.kv_heads() * cfg.head_dim());
    let (btc, btf, btk) = (bt * c, bt * f, bt * k);
    // The panel a low-precision weight `[out, in]` is widened into for the input gradient.
    let panel = |inp: usize, out: usize| u(matmul::backward_scratch(bt as usize, inp, out));
    let (cu, fu) = (cfg.channels, cfg.ffn());
    let elems = if low {
        [
            // down's backward: dact, views of act, W_down's panel.
            3 * btc + 2 * btf + panel(fu, cu),
            // SwiGLU's backward: dact, dgate, dup, views of gate and up.
            3 * btc + 5 * btf,
            // gate's backward: dgate, dup, dnorm2, view of norm2, W_gate's panel.
            5 * btc + 2 * btf + panel(cu, fu),
            // o_proj's backward: dres2, atty, datty, W_o's panel.
            5 * btc + panel(cu, cu),
            // attention's backward: dres2, dy, the f32 output, views and gradients of q, k, v.
            7 * btc + 4 * btk,
            // q's backward: dres2, dq, dk, dv, dnorm1, the merged dq, view of norm1, W_q's
            // panel.
            7 * btc + 2 * btk + panel(cu, cu),
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
            * 4
    } else {
        [
            // SwiGLU's backward: dact, dgate, dup.
            btc + 3 * btf,
            // q's backward: dres2, dq, dk, dv, dnorm1, the merged dq.
            5 * btc + 2 * btk,
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
            * 4
    };
    // Naive attention's probability gradient, with dres2, dy and dq/dk/dv (and in low
    // precision the views of the attention output and q, k, v).
    let attention = if low {
        (7 * btc + 4 * btk) * 4 + naive_ws
    } else {
        (4 * btc + 2 * btk) * 4 + naive_ws
    };
    elems.max(attention)
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
        StatePrecision::Int8 => infos
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
    if resident && tech.optimizer.state == StatePrecision::Int8 {
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
            state: StatePrecision::Int8,
            placement: OptimizerPlacement::File("unused".into()),
        };
        let r = cuda_parameter_state(&cfg(), &tech).unwrap();
        assert_eq!(r.host[MemoryCategory::OptimizerState], 0, "page cache");
        assert_eq!(r.device[MemoryCategory::OptimizerState], 0);

        tech.optimizer = OptimizerChoice {
            state: StatePrecision::Int8,
            placement: OptimizerPlacement::Resident,
        };
        assert!(matches!(
            cuda_parameter_state(&cfg(), &tech),
            Err(TrainError::Config(_))
        ));
    }
}
