//! The training loop: the reference GPT on the synthetic Markov source (or any token dataset),
//! AdamW from headroom-offload, clipping from headroom-accum, data from headroom-mmap-data, and
//! the profiler's tracker on every allocation.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use headroom_accum::clip_grad_norm;
use headroom_attn::AttentionConfig;
use headroom_mmap_data::{
    Loader, LoaderConfig, MarkovChain, OutputType, SamplerConfig, SamplingMode, Shard,
};
use headroom_offload::{AdamWHyper, CpuAdamW, ParamSpec, StatePrecision, StoreSpec};
use headroom_profiler::{memory_summary, MemorySnapshot, MemoryTracker, ReportContext};
use headroom_tensor::cpu::kernels::FloatSlice;
use headroom_tensor::{Backend, Cpu, Device, MemoryCategory};

use crate::checkpoint::{self, TrainingState};
use crate::model::{params, Geometry, Gpt, GptConfig};
use crate::{Result, TrainError};

/// The built-in data: a random sparse Markov chain whose entropy rate is the loss floor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SyntheticData {
    /// Vocabulary (the model's vocab).
    pub vocab: u32,
    /// Successors per token.
    pub branching: u32,
    /// Tokens generated.
    pub tokens: usize,
    /// Chain and stream seed.
    pub seed: u64,
}

/// Everything a run needs.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Model shape (its vocab must match the data's).
    pub model: GptConfig,
    /// Synthetic source.
    pub data: SyntheticData,
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate as a fraction of `lr` (cosine decay).
    pub min_lr_frac: f64,
    /// Linear warmup steps.
    pub warmup: usize,
    /// Decoupled weight decay of matrices and embeddings (none for biases and norms).
    pub weight_decay: f64,
    /// Global gradient-norm clip.
    pub grad_clip: f64,
    /// Initialisation and data-order seed.
    pub seed: u64,
    /// Attention algorithm.
    pub attention: AttentionConfig,
    /// Optional memory budget in bytes (simulates a smaller device).
    pub budget: Option<u64>,
    /// Where to write checkpoints, and after how many steps (0: never).
    pub checkpoint: Option<(PathBuf, usize)>,
    /// Continue from this checkpoint directory.
    pub resume_from: Option<PathBuf>,
    /// Stop after this many completed steps (as an interruption would), keeping the schedule
    /// of the full run.
    pub stop_after: Option<usize>,
}

impl TrainOptions {
    /// The default run: `tiny` on the synthetic source, about a minute on 2 cores.
    pub fn tiny_default() -> Self {
        let data = SyntheticData {
            vocab: 64,
            branching: 4,
            tokens: 1 << 20,
            seed: 1337,
        };
        TrainOptions {
            model: GptConfig::tiny(data.vocab as usize),
            data,
            steps: 600,
            batch: 16,
            seq: 64,
            lr: 3e-3,
            min_lr_frac: 0.1,
            warmup: 20,
            weight_decay: 0.1,
            grad_clip: 1.0,
            seed: 1337,
            attention: AttentionConfig::flash(),
            budget: None,
            checkpoint: None,
            resume_from: None,
            stop_after: None,
        }
    }

    /// The learning rate at `step` (0-based): linear warmup, then cosine to `min_lr_frac·lr`.
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = (self.steps.saturating_sub(self.warmup)).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        let min = self.lr * self.min_lr_frac;
        min + 0.5 * (self.lr - min) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

/// One step's figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepLog {
    /// 0-based step.
    pub step: usize,
    /// Mean training loss of the step's batch (nats/token).
    pub loss: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Wall time of the step.
    pub seconds: f64,
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Live tracked bytes on the CPU after the step.
    pub live_bytes: u64,
}

/// The outcome of a run.
#[derive(Debug)]
pub struct TrainReport {
    /// Every step's log (from the resumed step on, when resuming).
    pub steps: Vec<StepLog>,
    /// The data's entropy rate: the lowest achievable loss (nats/token).
    pub entropy_floor: f64,
    /// Tracker snapshot at the end (peaks by category).
    pub memory: MemorySnapshot,
    /// The memory table.
    pub memory_table: String,
}

impl TrainReport {
    /// Mean loss of the last `k` steps.
    pub fn final_loss(&self, k: usize) -> f64 {
        let tail = &self.steps[self.steps.len().saturating_sub(k)..];
        tail.iter().map(|s| s.loss as f64).sum::<f64>() / tail.len().max(1) as f64
    }
}

/// Train from scratch, calling `on_step` after every step.
pub fn train(opts: &TrainOptions, mut on_step: impl FnMut(&StepLog)) -> Result<TrainReport> {
    if opts.model.vocab != opts.data.vocab as usize {
        return Err(TrainError::Config(format!(
            "model vocab {} differs from the data's {}",
            opts.model.vocab, opts.data.vocab
        )));
    }
    if opts.steps == 0 || opts.batch == 0 || opts.seq == 0 {
        return Err(TrainError::Config(
            "steps, batch and seq must be positive".into(),
        ));
    }
    let tracker = Arc::new(MemoryTracker::new());
    tracker.set_budget(Device::Cpu, opts.budget);
    let cpu = Cpu::new().with_alloc_hook(tracker.clone());

    let chain = MarkovChain::random(opts.data.vocab, opts.data.branching, opts.data.seed)?;
    let dataset = Arc::new(chain.dataset(opts.data.tokens, opts.data.seed ^ 0x5eed)?);
    let sampler = SamplerConfig {
        mode: SamplingMode::EpochWindows,
        seq_len: opts.seq as u64,
        seed: opts.seed,
        shard: Shard::SINGLE,
    };
    let mut loader_cfg = LoaderConfig::new(opts.batch);
    loader_cfg.output = OutputType::U32;
    let resume = match &opts.resume_from {
        Some(dir) => {
            let ck = checkpoint::load(dir)?;
            if ck.state.config != opts.model {
                return Err(TrainError::Config(format!(
                    "checkpoint {} is for {:?}, this run is {:?}",
                    dir.display(),
                    ck.state.config,
                    opts.model
                )));
            }
            Some(ck)
        }
        None => None,
    };
    let mut loader = {
        let _g = MemoryCategory::Data.enter();
        match &resume {
            Some(ck) => Loader::resume(
                dataset,
                &ck.state.loader,
                loader_cfg,
                cpu.alloc_hook().cloned(),
            )?,
            None => Loader::new(dataset, sampler, loader_cfg, cpu.alloc_hook().cloned())?,
        }
    };

    let mut gpt = Gpt::new(&cpu, opts.model, opts.attention, opts.seed)?;
    if let Some(ck) = &resume {
        for (t, saved) in gpt.params.iter_mut().zip(&ck.params) {
            let dst = t.as_mut_slice::<f32>()?;
            if dst.len() != saved.len() {
                return Err(TrainError::Config(
                    "checkpoint parameter sizes differ from the model".into(),
                ));
            }
            dst.copy_from_slice(saved);
        }
    }
    let mut grads = params::alloc_like_params(&cpu, &opts.model, MemoryCategory::Gradients)?;
    let infos = params::param_infos(&opts.model);
    // GPT-2 practice: decay matrices and embeddings, not biases or norm gains.
    let specs: Vec<ParamSpec> = infos
        .iter()
        .map(|i| ParamSpec {
            numel: i.shape.iter().product(),
            group: if i.shape.len() >= 2 { 0 } else { 1 },
        })
        .collect();
    let groups = vec![
        AdamWHyper {
            lr: opts.lr,
            weight_decay: opts.weight_decay,
            beta2: 0.95,
            ..Default::default()
        },
        AdamWHyper {
            lr: opts.lr,
            weight_decay: 0.0,
            beta2: 0.95,
            ..Default::default()
        },
    ];
    let mut opt = match &resume {
        Some(ck) => CpuAdamW::restore(&ck.state.optimizer, &cpu, &ck.moments)?,
        None => CpuAdamW::new(groups, &specs, StatePrecision::F32, StoreSpec::Ram(&cpu))?,
    };
    let start = resume.as_ref().map_or(0, |ck| ck.state.step);
    drop(resume);

    let g = Geometry {
        b: opts.batch,
        t: opts.seq,
    };
    let mut logs = Vec::with_capacity(opts.steps);
    let end = opts.stop_after.map_or(opts.steps, |k| k.min(opts.steps));
    for step in start..end {
        let t0 = Instant::now();
        let (tokens, targets) = {
            let batch = loader.next_batch()?;
            let inputs = batch
                .inputs_u32()
                .ok_or_else(|| TrainError::Input("loader gave no u32 inputs".into()))?
                .to_vec();
            let targets = batch
                .targets_u32()
                .ok_or_else(|| TrainError::Input("loader gave no u32 targets".into()))?
                .to_vec();
            (inputs, targets)
        };
        for gr in grads.iter_mut() {
            cpu.fill_zero(gr)?;
        }
        let loss = {
            let _phase = tracker.phase("forward+backward");
            gpt.forward_backward(&tokens, &targets, g, &mut grads, 1.0)?
        };
        let clip = clip_grad_norm(&cpu, &mut grads, opts.grad_clip)?;
        let lr = opts.lr_at(step);
        opt.set_lr(0, lr)?;
        opt.set_lr(1, lr)?;
        {
            let _phase = tracker.phase("optimizer");
            for (i, (p, gr)) in gpt.params.iter_mut().zip(&grads).enumerate() {
                opt.step(
                    i,
                    p.as_mut_slice::<f32>()?,
                    FloatSlice::F32(gr.as_slice::<f32>()?),
                    None,
                )?;
            }
        }
        let seconds = t0.elapsed().as_secs_f64();
        let log = StepLog {
            step,
            loss,
            lr,
            grad_norm: clip.norm,
            seconds,
            tokens_per_s: (g.b * g.t) as f64 / seconds,
            live_bytes: tracker.live_bytes(Device::Cpu),
        };
        on_step(&log);
        logs.push(log);
        if let Some((dir, every)) = &opts.checkpoint {
            if *every > 0 && (step + 1) % every == 0 {
                let state = TrainingState::new(step + 1, opts.model, opt.state(), loader.state());
                checkpoint::save(dir, &state, &gpt.params, opt.moments())?;
            }
        }
    }
    let memory = tracker.snapshot();
    let memory_table = memory_summary(&memory, &ReportContext::with_process_memory());
    Ok(TrainReport {
        steps: logs,
        entropy_floor: chain.entropy_rate(),
        memory,
        memory_table,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lr_schedule_warms_up_then_decays_to_the_floor() {
        let o = TrainOptions {
            steps: 100,
            warmup: 10,
            lr: 1.0,
            min_lr_frac: 0.1,
            ..TrainOptions::tiny_default()
        };
        assert!((o.lr_at(0) - 0.1).abs() < 1e-12);
        assert!((o.lr_at(9) - 1.0).abs() < 1e-12);
        assert!((o.lr_at(10) - 1.0).abs() < 1e-12);
        assert!((o.lr_at(55) - 0.55).abs() < 1e-12);
        assert!((o.lr_at(100) - 0.1).abs() < 1e-12);
        assert!((1..100).all(|s| s < 10 || o.lr_at(s) <= o.lr_at(s - 1)));
    }
}
