//! The trainer end to end, next to PyTorch eager (`benches/torch/trainer_gpt.py`,
//! `benches/torch/trainer_llama.py`).
//!
//! **CPU** (always): one training step of the `small` GPT (6 layers, 6 heads, width 384,
//! context 256, vocab 50257) and of `llama-small` (6 layers, 6 heads over 2 key/value heads,
//! width 384, SwiGLU 1024, untied head) at batch 8×256, fp32 and bf16, flash attention, fused
//! AdamW-equivalent: the median step time next to PyTorch eager's (same model — transformers'
//! `LlamaForCausalLM` for the Llama — batch and thread count), measured in the same
//! `cargo xtask bench` run. `HEADROOM_TRAINER_MODELS=small,llama-small` picks models.
//!
//! **CUDA** (feature `cuda`, issue 11): GPT-2 124M at batch 8×1024 (`trainer_gpt.py --device
//! cuda`'s defaults) on CUDA device 0, one run per rung — baseline, +checkpoint, +offload, full
//! stack — recording median tokens/s, median step seconds, the device tracker's peak bytes, the
//! estimator's prediction of it and the host tracker's peak. Ids are
//! `trainer/cuda/<variant>/bf16/gpt2/<metric>` with variant `headroom` (the baseline rung,
//! paired with `trainer/cuda/torch_eager/bf16/gpt2/<metric>`), `headroom_checkpoint`,
//! `headroom_offload` and `headroom_full` (no PyTorch counterpart, so no baseline). Without a
//! device it prints `trainer/cuda: skipped: <why>` and exits 0.
//!
//! Not a criterion bench: a step takes seconds, so it times whole steps of a real run after
//! warm-up and records the median, as the PyTorch script does.
//!
//! ## Environment
//! - `HEADROOM_BENCH_ONLY_CUDA=1`: skip the CPU part (a GPU session runs just the CUDA part;
//!   without the `cuda` feature this prints the skip line and exits 0).
//! - `HEADROOM_BENCH_CUDA_LARGEST=1`: after the rungs, also probe the largest GPT that trains
//!   on the device (baseline vs full stack): the estimator picks the largest shape and batch
//!   of a fixed list whose predicted peak fits the device's free memory (and whose host state
//!   fits the host's available RAM), and 2 steps of it confirm. `=only` runs the probe without
//!   the rungs. Off by default: it allocates up to ~90 GB of host RAM and takes minutes, too
//!   long for `./run.sh bench`. Records `trainer/cuda/<variant>/bf16/largest/<metric>` for
//!   variants `headroom` (baseline) and `headroom_full`: `params` (the full stack's names the
//!   baseline's as its baseline), `batch`, `seq`, `predicted_peak_bytes`, `peak_bytes`.
//! - `HEADROOM_BENCH_CUDA_PLAN_GIB=<GiB>`: run nothing on any device and record nothing; print
//!   each rung's predicted peaks and the shapes the largest-trainable probe would try on a
//!   device with that much free memory (checks the plan on a machine without a GPU).
//! - `HEADROOM_BENCH_DIR`: where records go (see `headroom_benches::output_dir`).

use headroom_attn::AttentionConfig;
use headroom_benches::{record, Better, Record};
use headroom_trainer::model::{ModelConfig, Precision};
use headroom_trainer::train::{train, TrainOptions};

/// Whether `name` is set to something other than empty or `0`.
fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Append one record, or end the bench: a record that cannot be written is a failed run.
fn put(
    bench: String,
    metric: &str,
    value: f64,
    unit: &str,
    better: Better,
    baseline: Option<String>,
) {
    let r = Record {
        bench,
        metric: metric.into(),
        value,
        unit: unit.into(),
        baseline,
        baseline_value: None,
        ratio: None,
        better,
    };
    if let Err(e) = record(&r) {
        eprintln!("cannot write the record: {e}");
        std::process::exit(1);
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let only_cuda = env_flag("HEADROOM_BENCH_ONLY_CUDA");
    if !only_cuda {
        cpu_bench(quick);
    }
    #[cfg(feature = "cuda")]
    if let Err(e) = cuda_bench::run(quick) {
        eprintln!("trainer/cuda bench failed: {e}");
        std::process::exit(1);
    }
    #[cfg(not(feature = "cuda"))]
    if only_cuda {
        println!("trainer/cuda: skipped: built without the `cuda` feature");
    }
}

/// The `small` GPT and `llama-small` on the CPU, fp32 and bf16, each paired with PyTorch
/// eager's step of the same model (`trainer_gpt.py`, `trainer_llama.py`).
fn cpu_bench(quick: bool) {
    let warmup = 2;
    let timed = if quick { 3 } else { 8 };
    let only = std::env::var("HEADROOM_TRAINER_MODELS").unwrap_or_default();
    let models = [
        ("small", TrainOptions::small_default().model),
        ("llama-small", ModelConfig::llama_small(50257)),
    ];
    for (name, model) in models {
        if !only.is_empty() && !only.split(',').any(|m| m == name) {
            continue;
        }
        for precision in [Precision::Fp32, Precision::Bf16] {
            let mut o = TrainOptions::small_default();
            o.model = model;
            o.steps = warmup + timed;
            o.techniques.model.attention = AttentionConfig::flash();
            o.techniques.model.precision = precision;
            let report = match train(&o, |s| {
                eprintln!(
                    "trainer/{}/{name} step {}: {:.3} s, loss {:.4}",
                    precision.name(),
                    s.step,
                    s.seconds,
                    s.loss
                )
            }) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("trainer bench failed: {e}");
                    std::process::exit(1);
                }
            };
            let median = report.median_step_seconds(warmup);
            let p = precision.name();
            let tokens = (o.batch * o.seq) as f64;
            put(
                format!("trainer/step/headroom/{p}/{name}"),
                "step_seconds",
                median,
                "s",
                Better::Lower,
                Some(format!("trainer/step/torch_eager/{p}/{name}")),
            );
            put(
                format!("trainer/tokens_per_s/headroom/{p}/{name}"),
                "tokens_per_s",
                tokens / median,
                "tokens/s",
                Better::Higher,
                Some(format!("trainer/tokens_per_s/torch_eager/{p}/{name}")),
            );
            println!(
                "trainer/{p}/{name}: median step {median:.3} s ({:.0} tokens/s)",
                tokens / median
            );
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda_bench {
    use std::error::Error;

    use headroom_benches::Better;
    use headroom_cuda::{Cuda, CudaError};
    use headroom_profiler::OutOfBudget;
    use headroom_tensor::{Device, MemoryCategory};
    use headroom_trainer::engine::ComputeDevice;
    use headroom_trainer::estimate::{
        cuda_device_peak, cuda_parameter_state, estimate, CUBLASLT_WORKSPACE_HOPPER,
    };
    use headroom_trainer::ladder::standard_rungs;
    use headroom_trainer::model::ModelConfig;
    use headroom_trainer::techniques::{CheckpointChoice, OptimizerChoice, Techniques};
    use headroom_trainer::train::{train, TrainOptions, TrainReport};

    use super::{env_flag, put};

    type BenchResult<T> = Result<T, Box<dyn Error>>;

    /// `trainer_gpt.py --device cuda`'s defaults: the bench ids do not encode batch and
    /// sequence, so both sides must run the same ones.
    const BATCH: usize = 8;
    const SEQ: usize = 1024;
    /// Untimed steps before the timed ones, as the PyTorch script (`WARMUP_STEPS`).
    const WARMUP_STEPS: usize = 2;
    /// Steps of each "largest trainable" confirmation run.
    const CONFIRM_STEPS: usize = 2;
    /// Share of the device's free memory the probe lets the tracker use: the tracker sees
    /// every tensor, but not the context, the kernel modules, cuBLASLt's workspace or the
    /// pool's fragmentation.
    const DEVICE_SHARE: f64 = 0.9;
    /// Share of the host's available RAM the probe lets the offloaded state use (the page
    /// cache and the process's own buffers need the rest).
    const HOST_SHARE: f64 = 0.75;
    /// Confirmation runs per technique set before the probe gives up stepping down.
    const MAX_CONFIRMATIONS: usize = 3;
    /// (layers, width) of the shapes the probe considers, smallest first: GPT-2 small, medium,
    /// large, XL, then wider. Heads are width / 64: the CUDA flash kernels take head_dim 64
    /// or 128 only. Capped at 5.5B parameters: with the optimizer on the host a run needs
    /// about 16 bytes of host RAM per parameter (about 90 GB there), and one confirmation
    /// takes a couple of minutes (initialisation and AdamW run on the host).
    const LARGEST_SHAPES: [(usize, usize); 7] = [
        (12, 768),
        (24, 1024),
        (36, 1280),
        (48, 1600),
        (48, 2048),
        (48, 2560),
        (48, 3072),
    ];
    /// Batches the probe considers at each shape, largest first.
    const LARGEST_BATCHES: [usize; 4] = [8, 4, 2, 1];

    /// One rung of the CUDA ladder.
    struct CudaRung {
        /// Variant segment of the bench id.
        variant: &'static str,
        /// What it adds, for the log.
        name: &'static str,
        techniques: Techniques,
        /// Whether PyTorch eager runs the same thing (bf16 autocast, SDPA, nothing else).
        paired_with_torch: bool,
    }

    /// The CPU ladder's last rung at `batch`: bf16, flash, its checkpoint schedule, fused loss,
    /// offloaded AdamW and, when the batch divides, micro-batches of a quarter of it.
    fn full_stack(batch: usize) -> BenchResult<Techniques> {
        standard_rungs(batch)
            .pop()
            .map(|r| r.techniques)
            .ok_or_else(|| "the trainer's ladder has no rungs".into())
    }

    /// The full stack with everything but bf16 and flash attention switched off.
    fn baseline(batch: usize) -> BenchResult<Techniques> {
        let mut t = full_stack(batch)?;
        t.checkpoint = CheckpointChoice::None;
        t.optimizer = OptimizerChoice::resident();
        t.model.loss_chunk = None;
        t.model.selective = false;
        t.micro_batch = None;
        Ok(t)
    }

    /// Baseline → +checkpoint → +offload → full stack, each adding to the one before, with
    /// the settings the CPU ladder uses for the same names.
    ///
    /// bf16 with flash attention is the baseline, not a rung: the CUDA path runs nothing else
    /// (other precisions or attention algorithms are typed errors), and it is what PyTorch's
    /// bf16 autocast with SDPA runs too, which makes the baseline PyTorch's pair.
    ///
    /// The baseline keeps the fp32 masters and AdamW on the device, as PyTorch eager does;
    /// +offload moves them (and the gradient accumulation) to host RAM, ZeRO-Offload's split.
    fn rungs(batch: usize) -> BenchResult<Vec<CudaRung>> {
        let full = full_stack(batch)?;
        let base = baseline(batch)?;
        let mut checkpoint = base.clone();
        checkpoint.checkpoint = full.checkpoint;
        let mut offload = checkpoint.clone();
        offload.optimizer = full.optimizer.clone();
        Ok(vec![
            CudaRung {
                variant: "headroom",
                name: "baseline (bf16, flash)",
                techniques: base,
                paired_with_torch: true,
            },
            CudaRung {
                variant: "headroom_checkpoint",
                name: "+checkpoint",
                techniques: checkpoint,
                paired_with_torch: false,
            },
            CudaRung {
                variant: "headroom_offload",
                name: "+offload",
                techniques: offload,
                paired_with_torch: false,
            },
            CudaRung {
                variant: "headroom_full",
                name: "full stack",
                techniques: full,
                paired_with_torch: false,
            },
        ])
    }

    /// A run of `cfg` at `batch`×`seq` on device `ordinal`.
    fn options(
        ordinal: usize,
        cfg: ModelConfig,
        batch: usize,
        seq: usize,
        steps: usize,
        techniques: Techniques,
    ) -> TrainOptions {
        let mut o = TrainOptions::small_default();
        o.model = cfg;
        o.batch = batch;
        o.seq = seq;
        o.steps = steps;
        o.warmup = WARMUP_STEPS;
        o.techniques = techniques;
        o.device = ComputeDevice::Cuda { ordinal };
        o
    }

    /// Device and host bytes the run will need at most, predicted before it runs.
    struct Prediction {
        device: u64,
        host: u64,
        parameters: u64,
    }

    /// The trainer's estimator for the CUDA model: the device's tracked peak from
    /// [`cuda_device_peak`] (parameter state and the head's buffers exact, a block backward's
    /// transients the CPU model's; cuBLASLt's Hopper workspace, which these H100/H200 runs
    /// have), and on the host the offloaded state from [`cuda_parameter_state`] with the
    /// batch buffers.
    fn predict(
        cfg: &ModelConfig,
        seq: usize,
        batch: usize,
        techniques: &Techniques,
    ) -> BenchResult<Prediction> {
        let micro = techniques.micro_batch.unwrap_or(batch);
        let e = estimate(cfg, seq, micro, batch, techniques)?;
        let state = cuda_parameter_state(cfg, techniques)?;
        let device = cuda_device_peak(
            cfg,
            seq,
            micro,
            batch,
            techniques,
            CUBLASLT_WORKSPACE_HOPPER,
        )?;
        let mut host = e.host;
        for c in [
            MemoryCategory::Parameters,
            MemoryCategory::Gradients,
            MemoryCategory::OptimizerState,
        ] {
            host[c] = state.host[c];
        }
        host[MemoryCategory::Data] += e.device[MemoryCategory::Data];
        Ok(Prediction {
            device,
            host: host.total(),
            parameters: e.parameter_count,
        })
    }

    fn gib(bytes: u64) -> f64 {
        bytes as f64 / (1u64 << 30) as f64
    }

    /// The device's peak total bytes (tracker) and the host's.
    fn peaks(report: &TrainReport, ordinal: usize) -> BenchResult<(u64, u64)> {
        let device = report
            .memory
            .device(Device::Cuda(ordinal))
            .ok_or("the tracker saw no device allocation")?
            .peak_total;
        let host = report
            .host_memory
            .device(Device::Cpu)
            .map_or(0, |d| d.peak_total);
        Ok((device, host))
    }

    /// The CUDA part: skipped (exit 0) when no device can be opened.
    pub fn run(quick: bool) -> BenchResult<()> {
        if let Ok(gib) = std::env::var("HEADROOM_BENCH_CUDA_PLAN_GIB") {
            let device_gib: f64 = gib
                .parse()
                .map_err(|e| format!("HEADROOM_BENCH_CUDA_PLAN_GIB={gib}: {e}"))?;
            return print_plan(device_gib);
        }
        let ordinal = 0;
        let cuda = match Cuda::new(ordinal) {
            Ok(c) => c,
            Err(e) => {
                println!("trainer/cuda: skipped: {e}");
                return Ok(());
            }
        };
        let (free, total) = cuda.mem_info()?;
        println!(
            "trainer/cuda: {} (sm {}.{}, driver {}), {:.1} of {:.1} GiB free",
            cuda.device_name(),
            cuda.compute_capability().0,
            cuda.compute_capability().1,
            cuda.driver_version(),
            gib(free as u64),
            gib(total as u64)
        );
        let largest = std::env::var("HEADROOM_BENCH_CUDA_LARGEST").unwrap_or_default();
        if largest != "only" {
            ladder(ordinal, quick)?;
        }
        if env_flag("HEADROOM_BENCH_CUDA_LARGEST") {
            largest_trainable(&cuda)?;
        }
        Ok(())
    }

    /// GPT-2 124M at 8×1024 under each rung.
    fn ladder(ordinal: usize, quick: bool) -> BenchResult<()> {
        // PyTorch's counts: 3 timed steps with --quick, else 10.
        let timed = if quick { 3 } else { 10 };
        let cfg = ModelConfig::gpt2();
        let tokens = (BATCH * SEQ) as f64;
        let mut baseline: Option<(f64, u64)> = None;
        for rung in rungs(BATCH)? {
            let o = options(
                ordinal,
                cfg,
                BATCH,
                SEQ,
                WARMUP_STEPS + timed,
                rung.techniques.clone(),
            );
            let predicted = predict(&cfg, SEQ, BATCH, &rung.techniques)?;
            let v = rung.variant;
            let report = train(&o, |s| {
                eprintln!(
                    "trainer/cuda/{v}/gpt2 step {}: {:.3} s, loss {:.4}, device peak {:.2} GiB",
                    s.step,
                    s.seconds,
                    s.loss,
                    gib(s.peak_bytes)
                )
            })?;
            let step = report.median_step_seconds(WARMUP_STEPS);
            let (peak, host_peak) = peaks(&report, ordinal)?;
            let id = |metric: &str| format!("trainer/cuda/{v}/bf16/gpt2/{metric}");
            let torch = |metric: &str| {
                rung.paired_with_torch
                    .then(|| format!("trainer/cuda/torch_eager/bf16/gpt2/{metric}"))
            };
            put(
                id("tokens_per_s"),
                "tokens_per_s",
                tokens / step,
                "tokens/s",
                Better::Higher,
                torch("tokens_per_s"),
            );
            // PyTorch's script logs its step time but records only tokens/s and peak bytes.
            put(
                id("step_seconds"),
                "step_seconds",
                step,
                "s",
                Better::Lower,
                None,
            );
            // The tracker's peak over every step, warm-up included (PyTorch resets its peak
            // after the warm-up; every step here allocates the same shapes, so the two agree
            // unless a first step allocates more).
            put(
                id("peak_bytes"),
                "peak_bytes",
                peak as f64,
                "bytes",
                Better::Lower,
                torch("peak_bytes"),
            );
            put(
                id("predicted_peak_bytes"),
                "predicted_peak_bytes",
                predicted.device as f64,
                "bytes",
                Better::Lower,
                None,
            );
            put(
                id("host_peak_bytes"),
                "host_peak_bytes",
                host_peak as f64,
                "bytes",
                Better::Lower,
                None,
            );
            let (base_step, base_peak) = *baseline.get_or_insert((step, peak));
            println!(
                "trainer/cuda/{v}/bf16/gpt2 ({}: {}): step {:.1} ms ({:.2}x baseline), {:.0} tokens/s, device peak {:.2} GiB ({:.2}x baseline, predicted {:.2}), host peak {:.2} GiB",
                rung.name,
                rung.techniques.describe(),
                step * 1e3,
                step / base_step,
                tokens / step,
                gib(peak),
                peak as f64 / base_peak.max(1) as f64,
                gib(predicted.device),
                gib(host_peak),
            );
        }
        Ok(())
    }

    /// The host's available RAM (`MemAvailable`), when the system says.
    fn host_available_bytes() -> Option<u64> {
        let info = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// True when `e` says the run did not fit: the tracker refused an allocation over the
    /// budget, or the driver ran out of memory.
    fn is_out_of_memory(e: &(dyn Error + 'static)) -> bool {
        if OutOfBudget::find(e).is_some() {
            return true;
        }
        let mut current = Some(e);
        while let Some(err) = current {
            if let Some(CudaError::Driver { source, .. }) = err.downcast_ref::<CudaError>() {
                if source.is_out_of_memory() {
                    return true;
                }
            }
            current = err.source();
        }
        false
    }

    /// A shape of the probe's list.
    fn probe_config(layers: usize, channels: usize) -> ModelConfig {
        ModelConfig {
            layers,
            channels,
            heads: channels / 64,
            ..ModelConfig::gpt2()
        }
    }

    /// The estimator's answer for the true fp32 baseline (fp32, naive attention, AdamW and
    /// masters on the device: [`Techniques::baseline`]), which the CUDA path cannot run (bf16
    /// with flash attention only): a prediction in the log, for scale, never a record.
    fn fp32_estimate(device_budget: u64) -> BenchResult<()> {
        let tech = Techniques::baseline();
        for &(layers, channels) in LARGEST_SHAPES.iter().rev() {
            let cfg = probe_config(layers, channels);
            for &batch in &LARGEST_BATCHES {
                let e = estimate(&cfg, SEQ, batch, batch, &tech)?;
                if e.device_total() <= device_budget {
                    println!(
                        "trainer/cuda largest fp32 (estimate only, not runnable on CUDA): {layers}L/{channels}C ({:.2}B parameters), batch {batch}x{SEQ}, predicted {:.1} GiB",
                        e.parameter_count as f64 / 1e9,
                        gib(e.device_total())
                    );
                    return Ok(());
                }
            }
        }
        println!("trainer/cuda largest fp32 (estimate only): no shape of the list fits");
        Ok(())
    }

    /// One shape and batch the probe may confirm.
    struct Candidate {
        cfg: ModelConfig,
        batch: usize,
        techniques: Techniques,
        predicted: Prediction,
    }

    /// The budgets the probe works under: a share of the device's free memory, and of the
    /// host's available RAM when the system says.
    fn print_budgets(device_budget: u64, host_budget: Option<u64>) {
        println!(
            "trainer/cuda largest: device budget {:.1} GiB, host budget {}",
            gib(device_budget),
            host_budget.map_or("unknown (not checked)".into(), |b| format!(
                "{:.1} GiB ({:.0}% of available)",
                gib(b),
                HOST_SHARE * 100.0
            ))
        );
    }

    /// Every shape and batch of [`LARGEST_SHAPES`] × [`LARGEST_BATCHES`] predicted to fit
    /// both budgets, largest model first, then largest batch; the log says which memory rules
    /// out each shape that does not fit even at batch 1.
    fn candidates(
        variant: &str,
        is_full: bool,
        device_budget: u64,
        host_budget: Option<u64>,
    ) -> BenchResult<Vec<Candidate>> {
        let mut out = Vec::new();
        for &(layers, channels) in LARGEST_SHAPES.iter().rev() {
            let cfg = probe_config(layers, channels);
            let mut smallest_refused = None;
            for &batch in &LARGEST_BATCHES {
                let techniques = if is_full {
                    full_stack(batch)?
                } else {
                    baseline(batch)?
                };
                let predicted = predict(&cfg, SEQ, batch, &techniques)?;
                let device_fits = predicted.device <= device_budget;
                let host_fits = host_budget.is_none_or(|h| predicted.host <= h);
                if device_fits && host_fits {
                    out.push(Candidate {
                        cfg,
                        batch,
                        techniques,
                        predicted,
                    });
                } else {
                    smallest_refused = Some((batch, predicted, device_fits, host_fits));
                }
            }
            // With the optimizer on the host, host RAM (16 bytes per parameter) can bind
            // before the device does.
            if let Some((1, p, device_fits, host_fits)) = smallest_refused {
                println!(
                    "trainer/cuda largest {variant}: {layers}L/{channels}C ({:.2}B parameters) is predicted not to fit even at batch 1: device {:.1} GiB{}, host {:.1} GiB{}",
                    p.parameters as f64 / 1e9,
                    gib(p.device),
                    if device_fits { "" } else { " (over budget)" },
                    gib(p.host),
                    if host_fits { "" } else { " (over budget)" },
                );
            }
        }
        let top = (LARGEST_SHAPES[LARGEST_SHAPES.len() - 1], LARGEST_BATCHES[0]);
        if out
            .first()
            .is_some_and(|c| ((c.cfg.layers, c.cfg.channels), c.batch) == top)
        {
            println!(
                "trainer/cuda largest {variant}: the list's largest shape and batch are predicted to fit; the device's limit lies beyond the list"
            );
        }
        Ok(out)
    }

    fn describe_candidate(c: &Candidate) -> String {
        format!(
            "{}L/{}C/{}H ({:.2}B parameters), batch {}x{SEQ}: predicted device {:.2} GiB, host {:.2} GiB",
            c.cfg.layers,
            c.cfg.channels,
            c.cfg.heads,
            c.predicted.parameters as f64 / 1e9,
            c.batch,
            gib(c.predicted.device),
            gib(c.predicted.host)
        )
    }

    /// Without running anything: each rung's prediction at GPT-2 124M, and the candidates the
    /// probe would confirm on a device with `device_gib` GiB free.
    fn print_plan(device_gib: f64) -> BenchResult<()> {
        let cfg = ModelConfig::gpt2();
        for rung in rungs(BATCH)? {
            let p = predict(&cfg, SEQ, BATCH, &rung.techniques)?;
            println!(
                "trainer/cuda plan {} ({}): {}; predicted device {:.2} GiB, host {:.2} GiB",
                rung.variant,
                rung.name,
                rung.techniques.describe(),
                gib(p.device),
                gib(p.host)
            );
        }
        let device_budget = (device_gib * DEVICE_SHARE * (1u64 << 30) as f64) as u64;
        let host_budget = host_available_bytes().map(|b| (b as f64 * HOST_SHARE) as u64);
        print_budgets(device_budget, host_budget);
        fp32_estimate(device_budget)?;
        for (variant, is_full) in [("headroom", false), ("headroom_full", true)] {
            for c in candidates(variant, is_full, device_budget, host_budget)?
                .iter()
                .take(MAX_CONFIRMATIONS)
            {
                println!(
                    "trainer/cuda plan largest {variant}: would try {}",
                    describe_candidate(c)
                );
            }
        }
        Ok(())
    }

    /// The largest shape (then batch) of [`LARGEST_SHAPES`] × [`LARGEST_BATCHES`] that the
    /// estimator says fits, for the baseline and for the full stack, each confirmed by
    /// [`CONFIRM_STEPS`] steps on the device under the same budget; a candidate that runs
    /// out of memory hands over to the next one down.
    fn largest_trainable(cuda: &Cuda) -> BenchResult<()> {
        let (free, _) = cuda.mem_info()?;
        let device_budget = (free as f64 * DEVICE_SHARE) as u64;
        let host_budget = host_available_bytes().map(|b| (b as f64 * HOST_SHARE) as u64);
        print_budgets(device_budget, host_budget);
        fp32_estimate(device_budget)?;
        let mut baseline_params: Option<u64> = None;
        for (variant, is_full) in [("headroom", false), ("headroom_full", true)] {
            let candidates = candidates(variant, is_full, device_budget, host_budget)?;
            let mut confirmed = false;
            for c in candidates.into_iter().take(MAX_CONFIRMATIONS) {
                let label = describe_candidate(&c);
                let Candidate {
                    cfg,
                    batch,
                    techniques,
                    predicted: p,
                } = c;
                let mut o = options(cuda.ordinal(), cfg, batch, SEQ, CONFIRM_STEPS, techniques);
                o.budget = Some(device_budget);
                println!("trainer/cuda largest {variant}: trying {label}");
                let report = match train(&o, |s| {
                    eprintln!(
                        "trainer/cuda largest {variant} step {}: {:.2} s, loss {:.4}",
                        s.step, s.seconds, s.loss
                    )
                }) {
                    Ok(r) => r,
                    Err(e) if is_out_of_memory(&e) => {
                        println!(
                            "trainer/cuda largest {variant}: {label} did not fit ({e}); next one down"
                        );
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                };
                let (peak, host_peak) = peaks(&report, cuda.ordinal())?;
                let id = |metric: &str| format!("trainer/cuda/{variant}/bf16/largest/{metric}");
                put(
                    id("params"),
                    "params",
                    p.parameters as f64,
                    "params",
                    Better::Higher,
                    // How many times larger a model the full stack trains: like with like (same
                    // device, list and confirmation) against the baseline's.
                    (is_full && baseline_params.is_some())
                        .then(|| "trainer/cuda/headroom/bf16/largest/params".to_string()),
                );
                put(
                    id("batch"),
                    "batch",
                    batch as f64,
                    "sequences",
                    Better::Higher,
                    None,
                );
                put(id("seq"), "seq", SEQ as f64, "tokens", Better::Higher, None);
                put(
                    id("predicted_peak_bytes"),
                    "predicted_peak_bytes",
                    p.device as f64,
                    "bytes",
                    Better::Lower,
                    None,
                );
                put(
                    id("peak_bytes"),
                    "peak_bytes",
                    peak as f64,
                    "bytes",
                    Better::Lower,
                    None,
                );
                println!(
                    "trainer/cuda largest {variant}: {label} trains: device peak {:.2} GiB (predicted {:.2}), host peak {:.2} GiB (predicted {:.2})",
                    gib(peak),
                    gib(p.device),
                    gib(host_peak),
                    gib(p.host)
                );
                if !is_full {
                    baseline_params = Some(p.parameters);
                }
                confirmed = true;
                break;
            }
            if !confirmed {
                println!(
                    "trainer/cuda largest {variant}: no candidate of the list was confirmed (none predicted to fit, or {MAX_CONFIRMATIONS} ran out of memory)"
                );
            }
        }
        Ok(())
    }
}
