//! The memory ladder: one model trained a few steps under a device budget with techniques
//! added one at a time, each rung's peak memory per category taken from the tracker.

use headroom_attn::AttentionConfig;
use headroom_offload::StatePrecision;
use headroom_profiler::{OutOfBudget, PerCategory};
use headroom_tensor::{Device, MemoryCategory};

use crate::model::{finetune, params, FinetuneSpec, ModelConfig, Precision, QuantSpec};
use crate::techniques::{CheckpointChoice, OptimizerChoice, OptimizerPlacement, Techniques};
use crate::train::{train, TrainOptions};
use crate::zero_estimate::ZeroEstimate;
use crate::zero_train::{train_zero, ZeroOptions};
use crate::{Result, TrainError};
use headroom_zero::Stage;

/// One rung: a name and its techniques.
#[derive(Clone, Debug)]
pub struct Rung {
    /// What this rung adds, e.g. `+flash`.
    pub name: &'static str,
    /// Everything switched on so far.
    pub techniques: Techniques,
}

/// The standard ladder: fp32 baseline → +checkpoint (√n) → +bf16 → +flash → +fused loss →
/// +offload (optimizer state and masters to the host) → +accumulation (micro-batches of a
/// quarter of the batch, when the batch divides).
pub fn standard_rungs(batch: usize) -> Vec<Rung> {
    let mut t = Techniques::baseline();
    let mut rungs = vec![Rung {
        name: "fp32 baseline",
        techniques: t.clone(),
    }];
    let mut push = |name, t: &Techniques| {
        rungs.push(Rung {
            name,
            techniques: t.clone(),
        })
    };
    t.checkpoint = CheckpointChoice::SqrtN;
    push("+checkpoint (sqrt-n)", &t);
    t.model.precision = Precision::Bf16;
    push("+bf16", &t);
    t.model.attention = AttentionConfig::flash();
    push("+flash", &t);
    t.model.loss_chunk = Some(128);
    push("+fused loss", &t);
    t.optimizer = OptimizerChoice {
        state: StatePrecision::F32,
        placement: OptimizerPlacement::HostRam,
    };
    push("+offload", &t);
    if batch.is_multiple_of(4) && batch >= 4 {
        t.micro_batch = Some(batch / 4);
        push("+accumulation", &t);
    }
    rungs
}

/// The fine-tuning ladder (`headroom ladder --finetune`): full fine-tuning in fp32 → in bf16
/// → LoRA (rank 16 on every block linear, the base frozen in bf16) → QLoRA (the block linears
/// in NF4) → with double quantization → +checkpointing (√n) → +fused loss. Flash attention
/// throughout, so the rungs differ by the fine-tuning techniques alone.
pub fn finetune_rungs(cfg: &ModelConfig) -> Vec<Rung> {
    let mut t = Techniques::baseline();
    t.model.attention = AttentionConfig::flash();
    let mut rungs = vec![Rung {
        name: "full fine-tune fp32",
        techniques: t.clone(),
    }];
    let mut push = |name, t: &Techniques| {
        rungs.push(Rung {
            name,
            techniques: t.clone(),
        })
    };
    t.model.precision = Precision::Bf16;
    push("full fine-tune bf16", &t);
    let mut spec = FinetuneSpec {
        lora: headroom_lora::LoraConfig::new(16, 32.0, finetune::all_linear_targets(cfg)),
        quantize: None,
    };
    t.finetune = Some(spec.clone());
    push("LoRA r16 (bf16 base)", &t);
    spec.quantize = Some(QuantSpec {
        quant_type: "nf4".into(),
        blocksize: 64,
        double_quant: false,
    });
    t.finetune = Some(spec.clone());
    push("QLoRA (nf4)", &t);
    spec.quantize = Some(QuantSpec {
        quant_type: "nf4".into(),
        blocksize: 64,
        double_quant: true,
    });
    t.finetune = Some(spec);
    push("QLoRA (nf4 + dq)", &t);
    t.checkpoint = CheckpointChoice::SqrtN;
    push("+checkpoint (sqrt-n)", &t);
    t.model.loss_chunk = Some(128);
    push("+fused loss", &t);
    rungs
}

/// What one rung measured.
#[derive(Clone, Debug)]
pub struct RungResult {
    /// The rung's name.
    pub name: &'static str,
    /// Its techniques, described.
    pub description: String,
    /// Device peak per category (tracker), from an unbudgeted run when the budgeted one
    /// failed.
    pub peak: PerCategory<u64>,
    /// Device peak total (tracker).
    pub peak_total: u64,
    /// Host bytes (offloaded state and masters), peak per category.
    pub host_peak: PerCategory<u64>,
    /// The estimator's simultaneous device peak: an upper bound of `peak_total` (equal to it
    /// where the estimator's moments are exact).
    pub estimated_peak: u64,
    /// Median step seconds (after the first step).
    pub step_seconds: f64,
    /// Whether the run fit the budget (ran to the end with the budget enforced).
    pub fits: bool,
    /// The last step's loss.
    pub final_loss: f32,
    /// A fine-tuning rung's frozen block linears in bits per parameter, from the tracker's
    /// live `Parameters` at the end (minus the dense tensors and the adapters, whose bytes
    /// follow from their shapes); `None` when the rung trains every parameter.
    pub frozen_linear_bits: Option<f64>,
}

fn is_out_of_budget(e: &TrainError) -> bool {
    OutOfBudget::find(e).is_some()
}

/// Run every rung of `rungs` on `base` (its model, data, batch, steps) with `budget` enforced
/// on the device. A rung that does not fit is measured again without the budget, so its
/// real peak is known; `on_rung` is called after each.
pub fn run_ladder(
    base: &TrainOptions,
    rungs: &[Rung],
    budget: u64,
    mut on_rung: impl FnMut(&RungResult),
) -> Result<Vec<RungResult>> {
    let mut out = Vec::with_capacity(rungs.len());
    for rung in rungs {
        let mut o = base.clone();
        o.techniques = rung.techniques.clone();
        o.budget = Some(budget);
        o.save = None;
        o.resume_from = None;
        let micro = o.micro_batch()?;
        let est = crate::train::estimate_with_data(&o, micro, &o.techniques)?;
        let (report, fits) = match train(&o, |_| {}) {
            Ok(r) => (r, true),
            Err(e) if is_out_of_budget(&e) => {
                o.budget = None;
                (train(&o, |_| {})?, false)
            }
            Err(e) => return Err(e),
        };
        let dev = report
            .memory
            .device(o.device.tracked())
            .ok_or_else(|| TrainError::Input("the tracker saw no device allocation".into()))?;
        let host_peak = report
            .host_memory
            .device(Device::Cpu)
            .map_or_else(PerCategory::default, |d| d.peak);
        let frozen_linear_bits = match &o.techniques.finetune {
            Some(spec) => Some(frozen_linear_bits(
                &o.model,
                spec,
                o.techniques.model.precision,
                dev.live[MemoryCategory::Parameters],
            )?),
            None => None,
        };
        let r = RungResult {
            frozen_linear_bits,
            name: rung.name,
            description: rung.techniques.describe(),
            peak: dev.peak,
            peak_total: dev.peak_total,
            host_peak,
            estimated_peak: est.device_peak,
            step_seconds: report.median_step_seconds(1),
            fits,
            final_loss: report.steps.last().map_or(f32::NAN, |s| s.loss),
        };
        on_rung(&r);
        out.push(r);
    }
    Ok(out)
}

/// Bits per parameter of the block linears of a fine-tuning model whose live `Parameters`
/// are `live_params` bytes: those bytes less the other base tensors (in the storage precision)
/// and the adapters (fp32 masters, and working copies in low precision), over the linears'
/// parameter count.
fn frozen_linear_bits(
    cfg: &ModelConfig,
    spec: &FinetuneSpec,
    precision: Precision,
    live_params: u64,
) -> Result<f64> {
    let a = precision.storage().size_in_bytes() as u64;
    let infos = params::param_infos(cfg);
    let linear: std::collections::BTreeSet<usize> = (0..cfg.layers)
        .flat_map(|l| {
            finetune::block_linear_offsets(cfg)
                .iter()
                .map(move |&o| params::layer_index(cfg, l, o))
        })
        .collect();
    let numel = |i: &params::ParamInfo| i.shape.iter().product::<usize>() as u64;
    let (mut linear_numel, mut other_bytes) = (0u64, 0u64);
    for (i, info) in infos.iter().enumerate() {
        if linear.contains(&i) {
            linear_numel += numel(info);
        } else {
            other_bytes += numel(info) * a;
        }
    }
    let adapters: u64 = finetune::adapter_infos(cfg, &spec.lora)?
        .iter()
        .map(numel)
        .sum();
    let adapter_bytes = adapters * 4 + if precision.is_low() { adapters * a } else { 0 };
    let linear_bytes = live_params.saturating_sub(other_bytes + adapter_bytes);
    Ok(8.0 * linear_bytes as f64 / linear_numel.max(1) as f64)
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1u64 << 20) as f64)
}

/// The ladder as a Markdown table: device peak per category (MiB), total, reduction (first
/// rung's peak ÷ this rung's), host bytes, step time relative to the first rung, and whether
/// it fit.
pub fn ladder_table(results: &[RungResult], budget: u64) -> String {
    use std::fmt::Write;
    let finetune = results.iter().any(|r| r.frozen_linear_bits.is_some());
    let mut s = String::new();
    let _ = writeln!(
        s,
        "device budget {} MiB; peaks in MiB from the tracker\n",
        mib(budget)
    );
    let _ = writeln!(
        s,
        "| rung | params | grads | optimizer | activations | workspace | device peak | reduction | host | step s | time ratio | fits |{}",
        if finetune { " block linears, bits/param |" } else { "" }
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|{}",
        if finetune { "---|" } else { "" }
    );
    let base = results.first();
    for r in results {
        let p = |c: MemoryCategory| mib(r.peak[c]);
        let ratio = base.map_or(f64::NAN, |b| {
            b.peak_total as f64 / r.peak_total.max(1) as f64
        });
        let time = base.map_or(f64::NAN, |b| r.step_seconds / b.step_seconds);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {:.2}× | {} | {:.2} | {:.2}× | {} |{}",
            r.name,
            p(MemoryCategory::Parameters),
            p(MemoryCategory::Gradients),
            p(MemoryCategory::OptimizerState),
            p(MemoryCategory::Activations),
            p(MemoryCategory::Workspace),
            mib(r.peak_total),
            ratio,
            mib(r.host_peak.total()),
            r.step_seconds,
            time,
            if r.fits { "yes" } else { "**no**" },
            match (finetune, r.frozen_linear_bits) {
                (false, _) => String::new(),
                (true, Some(b)) => format!(" {b:.3} |"),
                (true, None) => " — (trained) |".to_string(),
            },
        );
    }
    s
}

/// A change of techniques the estimator predicts would fit a budget.
#[derive(Clone, Debug, PartialEq)]
pub struct FitSuggestion {
    /// The command-line options to add, e.g. `--checkpoint sqrt-n --precision bf16`.
    pub flags: String,
    /// Predicted device peak with them (the estimator's simultaneous peak: an upper bound).
    pub predicted_peak: u64,
}

/// Technique changes to `opts` that the estimator predicts fit `budget`: each single change,
/// then cumulative stacks in the ladder's order (checkpointing, bf16, fused loss, offload,
/// 8-bit state, smaller micro-batches), fewest changes first. What an out-of-memory error
/// suggests.
pub fn suggest_fitting(opts: &TrainOptions, budget: u64) -> Result<Vec<FitSuggestion>> {
    type Change = (String, fn(&mut Techniques, usize));
    let mut changes: Vec<Change> = Vec::new();
    let t = &opts.techniques;
    if matches!(
        t.checkpoint,
        CheckpointChoice::None | CheckpointChoice::Selective
    ) {
        changes.push(("--checkpoint sqrt-n".into(), |t, _| {
            t.checkpoint = CheckpointChoice::SqrtN
        }));
    }
    if t.model.precision == Precision::Fp32 {
        changes.push(("--precision bf16".into(), |t, _| {
            t.model.precision = Precision::Bf16
        }));
    }
    if t.model.attention.algorithm == headroom_attn::Algorithm::Naive {
        changes.push(("--attention flash".into(), |t, _| {
            t.model.attention = AttentionConfig::flash()
        }));
    }
    if t.model.loss_chunk.is_none() {
        changes.push(("--loss-chunk 128".into(), |t, _| {
            t.model.loss_chunk = Some(128)
        }));
    }
    if t.optimizer.placement == OptimizerPlacement::Resident {
        changes.push(("--offload ram".into(), |t, _| {
            t.optimizer.placement = OptimizerPlacement::HostRam
        }));
    }
    if t.optimizer.state == StatePrecision::F32 {
        changes.push(("--adam-8bit".into(), |t, _| {
            t.optimizer.state = StatePrecision::Float8
        }));
    }
    let micro_now = opts.micro_batch()?;
    let mut micro = micro_now / 2;
    while micro >= 1 && opts.batch.is_multiple_of(micro) {
        // One option per halving; the closure reads the micro-batch from its argument.
        changes.push((format!("--micro-batch {micro}"), |t, m| {
            t.micro_batch = Some(m)
        }));
        if micro == 1 {
            break;
        }
        micro /= 2;
    }
    let micro_of = |flags: &str| -> usize {
        flags
            .split("--micro-batch ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or(micro_now)
    };
    let predict = |t: &Techniques, micro: usize| -> Result<u64> {
        Ok(crate::train::estimate_with_data(opts, micro, t)?.device_peak)
    };
    let mut out: Vec<FitSuggestion> = Vec::new();
    // Single changes.
    for (flags, apply) in &changes {
        let mut t = t.clone();
        let m = micro_of(flags);
        apply(&mut t, m);
        let peak = predict(&t, m)?;
        if peak <= budget {
            out.push(FitSuggestion {
                flags: flags.clone(),
                predicted_peak: peak,
            });
        }
    }
    // Stacks, in order, until one fits (micro-batch halvings replace each other).
    if out.is_empty() {
        let mut stacked = t.clone();
        let mut flags: Vec<String> = Vec::new();
        let mut m = micro_now;
        for (f, apply) in &changes {
            let this_micro = micro_of(f);
            apply(&mut stacked, this_micro);
            if f.starts_with("--micro-batch") {
                flags.retain(|x| !x.starts_with("--micro-batch"));
                m = this_micro;
            }
            flags.push(f.clone());
            let peak = predict(&stacked, m)?;
            if peak <= budget {
                out.push(FitSuggestion {
                    flags: flags.join(" "),
                    predicted_peak: peak,
                });
                break;
            }
        }
    }
    out.sort_by_key(|s| s.predicted_peak);
    Ok(out)
}

/// The ZeRO ladder's rungs: one process (stage 0 on one rank, the baseline), then stages 1–3
/// on 2, 4 and 8 in-process ranks, at the same global batch.
pub fn zero_rungs() -> Vec<(Stage, usize)> {
    let mut out = vec![(Stage::Zero0, 1)];
    for stage in [Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for ranks in [2, 4, 8] {
            out.push((stage, ranks));
        }
    }
    out
}

/// What one ZeRO rung measured: the largest rank's figures.
#[derive(Clone, Debug)]
pub struct ZeroRungResult {
    /// The stage.
    pub stage: Stage,
    /// In-process ranks.
    pub ranks: usize,
    /// Per category, the largest rank's peak (tracker).
    pub peak: PerCategory<u64>,
    /// The largest rank's peak total (tracker).
    pub peak_total: u64,
    /// The estimator's per-rank prediction.
    pub estimate: ZeroEstimate,
    /// Median step seconds (after the first step).
    pub step_seconds: f64,
    /// Bytes rank 0 sent in the last step (ring model).
    pub sent_per_step: u64,
    /// Whether every rank stayed within the budget.
    pub fits: bool,
    /// The last step's loss.
    pub final_loss: f32,
}

impl ZeroRungResult {
    /// The categories whose measured peak differs from the estimator's prediction; empty when
    /// all agree.
    pub fn estimate_mismatches(&self) -> Vec<MemoryCategory> {
        MemoryCategory::ALL
            .into_iter()
            .filter(|&c| self.peak[c] != self.estimate.device[c])
            .collect()
    }
}

/// Run `rungs` (stage, ranks) on `base` — its global batch split over the ranks — with
/// `budget` enforced on every rank; a rung that does not fit is measured again without it.
pub fn run_zero_ladder(
    base: &TrainOptions,
    rungs: &[(Stage, usize)],
    budget: u64,
    mut on_rung: impl FnMut(&ZeroRungResult),
) -> Result<Vec<ZeroRungResult>> {
    let mut out = Vec::with_capacity(rungs.len());
    for &(stage, ranks) in rungs {
        let mut o = base.clone();
        o.budget = Some(budget);
        o.save = None;
        o.resume_from = None;
        o.eval = None;
        if !o.batch.is_multiple_of(ranks) {
            return Err(TrainError::Option {
                option: "--batch",
                reason: format!("{} sequences do not split over {ranks} ranks", o.batch),
            });
        }
        let per_rank = o.batch / ranks;
        let micro = o.techniques.micro_batch.unwrap_or(per_rank).min(per_rank);
        o.techniques.micro_batch = Some(micro);
        let zero = ZeroOptions::new(stage, ranks);
        let (estimate, _) = crate::zero_train::estimate_run(&o, &zero)?;
        let (report, fits) = match train_zero(&o, zero, |_| {}) {
            Ok(r) => (r, true),
            Err(e) if is_out_of_budget(&e) => {
                o.budget = None;
                (train_zero(&o, zero, |_| {})?, false)
            }
            Err(e) => return Err(e),
        };
        let mut peak = PerCategory::<u64>::default();
        let mut peak_total = 0;
        for r in &report.ranks {
            if let Some(d) = r.memory.device(Device::Cpu) {
                for c in MemoryCategory::ALL {
                    peak[c] = peak[c].max(d.peak[c]);
                }
                peak_total = peak_total.max(d.peak_total);
            }
        }
        let mut times: Vec<f64> = report.steps.iter().skip(1).map(|s| s.seconds).collect();
        times.sort_by(f64::total_cmp);
        let r = ZeroRungResult {
            stage,
            ranks,
            peak,
            peak_total,
            estimate,
            step_seconds: times.get(times.len() / 2).copied().unwrap_or(f64::NAN),
            sent_per_step: report
                .ranks
                .first()
                .map_or(0, |r| r.last_step_comm.sent_bytes()),
            fits,
            final_loss: report.steps.last().map_or(f32::NAN, |s| s.loss),
        };
        on_rung(&r);
        out.push(r);
    }
    Ok(out)
}

/// The ZeRO ladder as a Markdown table: the largest rank's peak per category (MiB), its
/// total beside the estimator's (the categories' peaks added), whether every exactly predicted
/// category matched, the reduction against the first rung, the bytes rank 0 sent per step,
/// the step time, and whether every rank fit.
pub fn zero_ladder_table(results: &[ZeroRungResult], budget: u64) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "per-rank budget {} MiB; the largest rank's peaks in MiB from its tracker\n",
        mib(budget)
    );
    let _ = writeln!(
        s,
        "| stage | ranks | params | grads | optimizer | activations | workspace | per-rank peak | estimate (simultaneous) | categories' peaks added | = estimate per category | reduction | sent/step | step s | fits |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    let base = results.first();
    for r in results {
        let p = |c: MemoryCategory| mib(r.peak[c]);
        let ratio = base.map_or(f64::NAN, |b| {
            b.peak_total as f64 / r.peak_total.max(1) as f64
        });
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2}× | {} | {:.2} | {} |",
            r.stage,
            r.ranks,
            p(MemoryCategory::Parameters),
            p(MemoryCategory::Gradients),
            p(MemoryCategory::OptimizerState),
            p(MemoryCategory::Activations),
            p(MemoryCategory::Workspace),
            mib(r.peak_total),
            mib(r.estimate.device_peak),
            mib(r.estimate.per_rank_peak()),
            match r.estimate_mismatches().as_slice() {
                [] => "yes".to_string(),
                m => format!("**no**: {m:?}"),
            },
            ratio,
            mib(r.sent_per_step),
            r.step_seconds,
            if r.fits { "yes" } else { "**no**" },
        );
    }
    s
}
